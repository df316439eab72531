//! The store's own connection on the calling thread, for a process whose one thread is the
//! whole world.
//!
//! sqlx hands every statement to a worker thread and waits for it to answer (`notes/limits.md`:
//! waking a core costs about 20 µs here, per statement, not per row), and each pooled
//! connection throws its page cache away whenever another connection has written (WAL mode:
//! a read transaction that finds the WAL changed resets the pager). The simulator runs the
//! control plane, every agent and the clock on one thread, so it paid both on every statement
//! of every step. [`SqliteStore::open_for_one_thread`](super::SqliteStore::open_for_one_thread)
//! gives the store one more connection to the same file, which every statement then uses
//! directly on the caller's thread: reads, one-statement writes and write transactions, with the
//! same SQL text and the same row decoding as the pool's ([`super::stmt`]).
//!
//! - A write transaction holds [`InlineConn::writer`] (an async lock: a second writer waits,
//!   as it would for SQLite's write lock, without blocking the thread the first one needs) and
//!   marks the connection busy; a read outside that transaction meanwhile goes to the pool, so
//!   it sees the last commit and never the transaction's uncommitted rows, as on a server.
//! - The connection is opened as sqlx opens its own (`synchronous = FULL`, foreign keys on,
//!   the same busy timeout), so what commits here is as durable as through the pool.
//!
//! Never in a server: a statement here blocks the runtime thread that runs it.

use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rusqlite::OpenFlags;

use super::BUSY_TIMEOUT_MS;
use super::stmt::Sql;
use crate::error::{Error, Result};
use crate::store::Columns;

/// Prepared statements kept: every statement the store runs, and the multi-row inserts at the
/// batch sizes the appender makes.
const STATEMENTS_CACHED: usize = 256;

pub(crate) struct InlineConn {
    conn: Mutex<rusqlite::Connection>,
    /// Held by the one write transaction open on this connection.
    pub(super) writer: tokio::sync::Mutex<()>,
    /// A write transaction is open: reads outside it go elsewhere.
    in_transaction: AtomicBool,
}

fn storage(e: rusqlite::Error) -> Error {
    Error::Storage(format!("sqlite: {e}"))
}

impl InlineConn {
    /// A connection to the database at `path`, which the pool has already opened (so it
    /// exists, in WAL mode).
    /// `vfs` is the pool's (SQLite's in-process locks coordinate the two only within one VFS).
    pub(super) fn open(path: &Path, vfs: &str) -> Result<Self> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = rusqlite::Connection::open_with_flags_and_vfs(path, flags, vfs).map_err(storage)?;
        conn.busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS)).map_err(storage)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(storage)?;
        conn.pragma_update(None, "foreign_keys", true).map_err(storage)?;
        conn.set_prepared_statement_cache_capacity(STATEMENTS_CACHED);
        Ok(Self { conn: Mutex::new(conn), writer: tokio::sync::Mutex::new(()), in_transaction: AtomicBool::new(false) })
    }

    /// Whether a write transaction is open on this connection.
    pub(super) fn in_transaction(&self) -> bool {
        self.in_transaction.load(Ordering::Acquire)
    }

    /// Starts the write transaction (the caller holds [`Self::writer`]).
    pub(super) fn begin(&self) -> Result<()> {
        self.in_transaction.store(true, Ordering::Release);
        self.script("BEGIN IMMEDIATE").inspect_err(|_| self.in_transaction.store(false, Ordering::Release))
    }

    /// Ends the write transaction: commits it, or rolls it back. A failed commit is rolled back
    /// too (SQLite may leave the transaction open), and reported.
    pub(super) fn end(&self, commit: bool) -> Result<()> {
        let ended = self.script(if commit { "COMMIT" } else { "ROLLBACK" });
        if ended.is_err() && commit {
            let conn = self.lock()?;
            if !conn.is_autocommit()
                && let Err(e) = conn.execute_batch("ROLLBACK")
            {
                tracing::debug!(error = %e, "rolling back after a failed commit");
            }
        }
        self.in_transaction.store(false, Ordering::Release);
        ended
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, rusqlite::Connection>> {
        self.conn.lock().map_err(|_| Error::Internal("the store's inline connection is poisoned".into()))
    }

    /// Runs statements without arguments.
    pub(super) fn script(&self, text: &str) -> Result<()> {
        self.lock()?.execute_batch(text).map_err(storage)
    }

    /// Runs `sql`; returns the rows it changed.
    pub(super) fn execute(&self, sql: &Sql) -> Result<u64> {
        let conn = self.lock()?;
        let mut statement = conn.prepare_cached(&sql.text).map_err(storage)?;
        Ok(statement.execute(rusqlite::params_from_iter(&sql.args)).map_err(storage)? as u64)
    }

    /// Runs `sql` and hands its rows to `read`, under the connection's lock.
    fn query<R>(&self, sql: &Sql, read: impl FnOnce(rusqlite::Rows<'_>) -> Result<R>) -> Result<R> {
        let conn = self.lock()?;
        let mut statement = conn.prepare_cached(&sql.text).map_err(storage)?;
        read(statement.query(rusqlite::params_from_iter(&sql.args)).map_err(storage)?)
    }

    /// Every row `sql` returns, each decoded by `decode`.
    pub(super) fn all<T>(&self, sql: &Sql, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Vec<T>> {
        self.query(sql, |mut rows| {
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(storage)? {
                out.push(decode(row)?);
            }
            Ok(out)
        })
    }

    /// The first row `sql` returns, if any, decoded by `decode`; the rest are never read.
    pub(super) fn first<T>(&self, sql: &Sql, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Option<T>> {
        self.query(sql, |mut rows| rows.next().map_err(storage)?.map(|row| decode(row)).transpose())
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
