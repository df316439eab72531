//! Reads on the calling thread, for a process whose one thread is the whole world.
//!
//! sqlx hands every statement to a worker thread and waits for it to answer (`notes/limits.md`:
//! waking a core costs about 20 µs here, per statement, not per row). The simulator runs the
//! control plane, every agent and the clock on one thread, so it paid that hand-off, twice, on
//! every read of every step. [`SqliteStore::open_for_one_thread`](super::SqliteStore::open_for_one_thread)
//! gives the store a second connection to the same file, read-only (`query_only`), which the hot
//! reads (projection rows, events, chain heads, secrets, cursor positions) use directly on the
//! caller's thread; writes and everything inside a transaction keep going through the pool.
//!
//! Each read is the same SQL as the pool's (the text is shared, so is the row decoding) and sees
//! what a pooled read sees: in WAL mode a statement outside a transaction reads the last committed
//! state. Never in a server: a read here blocks the runtime thread that makes it.

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use rusqlite::{OpenFlags, Params};

use super::BUSY_TIMEOUT_MS;
use crate::error::{Error, Result};
use crate::store::Columns;

/// Prepared statements kept by the inline connection: every hot read, with room to spare.
const STATEMENTS_CACHED: usize = 64;

pub(super) struct InlineReads {
    conn: Mutex<rusqlite::Connection>,
}

fn storage(e: rusqlite::Error) -> Error {
    Error::Storage(format!("sqlite (inline read): {e}"))
}

impl InlineReads {
    /// A read-only connection to the database at `path`, which the pool has already opened (so
    /// it exists, in WAL mode, migrated or about to be).
    pub(super) fn open(path: &Path) -> Result<Self> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = rusqlite::Connection::open_with_flags(path, flags).map_err(storage)?;
        conn.busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS)).map_err(storage)?;
        conn.pragma_update(None, "query_only", true).map_err(storage)?;
        conn.set_prepared_statement_cache_capacity(STATEMENTS_CACHED);
        Ok(Self { conn: Mutex::new(conn) })
    }

    /// Runs `sql` and hands its rows to `read`, under the connection's lock.
    fn query<R>(&self, sql: &str, params: impl Params, read: impl FnOnce(rusqlite::Rows<'_>) -> Result<R>) -> Result<R> {
        let conn = self.conn.lock().map_err(|_| Error::Internal("the inline read connection is poisoned".into()))?;
        let mut statement = conn.prepare_cached(sql).map_err(storage)?;
        read(statement.query(params).map_err(storage)?)
    }

    /// Every row `sql` returns, each decoded by `decode`.
    pub(super) fn all<T>(
        &self,
        sql: &str,
        params: impl Params,
        decode: impl Fn(&rusqlite::Row<'_>) -> Result<T>,
    ) -> Result<Vec<T>> {
        self.query(sql, params, |mut rows| {
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(storage)? {
                out.push(decode(row)?);
            }
            Ok(out)
        })
    }

    /// The first row `sql` returns, if any, decoded by `decode`; the rest are never read.
    pub(super) fn first<T>(
        &self,
        sql: &str,
        params: impl Params,
        decode: impl Fn(&rusqlite::Row<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        self.query(sql, params, |mut rows| rows.next().map_err(storage)?.map(decode).transpose())
    }
}

impl Columns for rusqlite::Row<'_> {
    fn text(&self, i: usize) -> Result<String> {
        self.get(i).map_err(storage)
    }
    fn opt_text(&self, i: usize) -> Result<Option<String>> {
        self.get(i).map_err(storage)
    }
    fn int(&self, i: usize) -> Result<i64> {
        self.get(i).map_err(storage)
    }
    fn opt_int(&self, i: usize) -> Result<Option<i64>> {
        self.get(i).map_err(storage)
    }
    fn bytes(&self, i: usize) -> Result<Vec<u8>> {
        self.get(i).map_err(storage)
    }
}
