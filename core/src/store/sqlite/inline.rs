//! The store's own connections on the calling thread: its writer, and in a server its point
//! readers.
//!
//! sqlx hands every statement to a worker thread and waits for it to answer (`notes/limits.md`:
//! waking a core costs about 20 µs here, per statement, not per row), and each pooled
//! connection throws its page cache away whenever another connection has written (WAL mode:
//! a read transaction that finds the WAL changed resets the pager). An [`InlineConn`] runs
//! statements directly on the caller's thread, with the same SQL text and the same row
//! decoding as the pool's ([`super::stmt`]). Every store writes on one ([`Own`]):
//!
//! - A write transaction holds [`InlineConn::writer`] (an async lock: a second writer waits,
//!   as it would for SQLite's write lock, without blocking the thread the first one needs).
//! - In a server ([`Own::Writer`]) only writes use it. Its statements inside a transaction
//!   hold SQLite's write lock already, so they never wait for another connection; the
//!   `COMMIT` (the fsync) runs on a blocking thread, and so does a `BEGIN` that finds another
//!   process holding the lock ([`InlineConn::begin_now`] answers at once).
//! - The simulator's ([`Own::OneThread`]) runs every statement, reads included: its one thread
//!   is the whole world. It marks itself busy inside a write transaction; a read outside that
//!   transaction meanwhile goes to the pool, so it sees the last commit and never the
//!   transaction's uncommitted rows, as on a server.
//! - The connection is opened as sqlx opens its own (`synchronous = FULL`, foreign keys on,
//!   the same busy timeout), so what commits here is as durable as through the pool.
//!
//! A server reads on [`Readers`]: connections of the same kind that run only point reads (a
//! row by key, a few hundred by key, a bounded page of the log or of projection rows, each
//! statement of the appender's pre-read), which take microseconds, never wait for a lock, and
//! give way to the pool when they would.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::OpenFlags;

use super::BUSY_TIMEOUT_MS;
use super::stmt::Sql;
use crate::error::{Error, Result};
use crate::store::Columns;

/// Prepared statements kept: every statement the store runs, and the multi-row inserts at the
/// batch sizes the appender makes.
const STATEMENTS_CACHED: usize = 256;

/// The connection a store writes on (and, in the simulator, reads on too).
pub(crate) enum Own {
    /// The simulator's: every statement, reads included, on the caller's thread.
    OneThread(Arc<InlineConn>),
    /// A server's: every write, each statement on the caller's thread and each `COMMIT` (the
    /// fsync) on a blocking thread; reads go to the readers and the pool.
    Writer(Arc<InlineConn>),
}

impl Own {
    pub(super) fn conn(&self) -> &Arc<InlineConn> {
        match self {
            Self::OneThread(conn) | Self::Writer(conn) => conn,
        }
    }

    pub(super) fn commits_off_thread(&self) -> bool {
        matches!(self, Self::Writer(_))
    }
}

pub(crate) struct InlineConn {
    conn: Mutex<rusqlite::Connection>,
    /// Held by the one write transaction open on this connection.
    pub(super) writer: Arc<tokio::sync::Mutex<()>>,
    /// A write transaction is open: reads outside it go elsewhere.
    in_transaction: AtomicBool,
}

fn storage(e: rusqlite::Error) -> Error {
    Error::Storage(format!("sqlite: {e}"))
}

impl InlineConn {
    /// A connection to the database at `path`, which the pool has already opened (so it
    /// exists, in WAL mode).
    /// `vfs` is the pool's (SQLite's in-process locks coordinate the two only within one VFS);
    /// `None`: the platform's default.
    pub(super) fn open(path: &Path, vfs: Option<&str>) -> Result<Self> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = match vfs {
            Some(vfs) => rusqlite::Connection::open_with_flags_and_vfs(path, flags, vfs),
            None => rusqlite::Connection::open_with_flags(path, flags),
        }
        .map_err(storage)?;
        conn.busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS)).map_err(storage)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(storage)?;
        conn.pragma_update(None, "foreign_keys", true).map_err(storage)?;
        conn.set_prepared_statement_cache_capacity(STATEMENTS_CACHED);
        Ok(Self { conn: Mutex::new(conn), writer: Default::default(), in_transaction: AtomicBool::new(false) })
    }

    /// Whether a write transaction is open on this connection.
    pub(super) fn in_transaction(&self) -> bool {
        self.in_transaction.load(Ordering::Acquire)
    }

    /// Starts the write transaction (the caller holds [`Self::writer`]), waiting up to the
    /// busy timeout for another process's write lock.
    pub(super) fn begin(&self) -> Result<()> {
        let conn = self.lock()?;
        self.begin_locked(&conn).map_err(storage)
    }

    /// [`Self::begin`] without waiting: false, and no transaction, when another process holds
    /// SQLite's write lock (the caller waits for it off its thread).
    pub(super) fn begin_now(&self) -> Result<bool> {
        let conn = self.lock()?;
        conn.busy_timeout(Duration::ZERO).map_err(storage)?;
        let begun = self.begin_locked(&conn);
        conn.busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS)).map_err(storage)?;
        match begun {
            Ok(()) => Ok(true),
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => Ok(false),
            Err(e) => Err(storage(e)),
        }
    }

    fn begin_locked(&self, conn: &rusqlite::Connection) -> rusqlite::Result<()> {
        if !conn.is_autocommit() {
            // Left open by a writer that stopped waiting for its `BEGIN` off the runtime.
            conn.execute_batch("ROLLBACK")?;
        }
        self.in_transaction.store(true, Ordering::Release);
        conn.execute_batch("BEGIN IMMEDIATE").inspect_err(|_| self.in_transaction.store(false, Ordering::Release))
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

/// Connections for point reads on the caller's thread, in a server (with every read
/// handed to a pool connection's worker thread and back, those hand-overs were a quarter of the
/// reservations bench's time, in the kernel). A point read is bounded by its statement (a
/// primary key, at most [`crate::store::ROWS_GET_MAX`] keys, a `LIMIT`ed page), so it blocks
/// the runtime thread for microseconds; it never waits: a reader in use by another thread is
/// skipped, SQLite's busy timeout is 0, and when no reader is free or SQLite is busy the read
/// goes to the pool as before. WAL mode gives each statement a snapshot of the last commit,
/// as on a pool connection.
pub(crate) struct Readers {
    pub(super) conns: Vec<Mutex<rusqlite::Connection>>,
    next: std::sync::atomic::AtomicUsize,
}

/// Readers a server's store keeps: the runtime's threads on this kind of machine, and a few more.
pub(crate) const READERS: usize = 4;

impl Readers {
    /// `count` read-only connections to the database at `path`, which the pool has opened
    /// through the platform's default VFS (a server's store; the simulator's has no readers).
    pub(super) fn open(path: &Path, count: usize) -> Result<Self> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conns = (0..count)
            .map(|_| {
                let conn = rusqlite::Connection::open_with_flags(path, flags).map_err(storage)?;
                // Never wait for a lock on a runtime thread: busy means the pool reads it.
                conn.busy_timeout(Duration::ZERO).map_err(storage)?;
                conn.pragma_update(None, "query_only", true).map_err(storage)?;
                conn.set_prepared_statement_cache_capacity(STATEMENTS_CACHED);
                Ok(Mutex::new(conn))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { conns, next: std::sync::atomic::AtomicUsize::new(0) })
    }

    /// Every row `sql` returns, decoded, read on this thread by a free reader; `None` when every
    /// reader is in use or SQLite answers busy (the caller reads on the pool instead).
    pub(super) fn all<T>(&self, sql: &Sql, decode: &dyn Fn(&dyn Columns) -> Result<T>) -> Option<Result<Vec<T>>> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = (0..self.conns.len()).find_map(|i| self.conns[(start + i) % self.conns.len()].try_lock().ok())?;
        let read = || -> rusqlite::Result<Result<Vec<T>>> {
            let mut statement = conn.prepare_cached(&sql.text)?;
            let mut rows = statement.query(rusqlite::params_from_iter(&sql.args))?;
            let mut out = Vec::new();
            while let Some(row) = rows.next()? {
                match decode(row) {
                    Ok(decoded) => out.push(decoded),
                    Err(e) => return Ok(Err(e)),
                }
            }
            Ok(Ok(out))
        };
        match read() {
            Ok(decoded) => Some(decoded),
            Err(rusqlite::Error::SqliteFailure(e, _))
                if matches!(e.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) =>
            {
                None
            }
            Err(e) => Some(Err(storage(e))),
        }
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
        // Text is taken as its bytes, as sqlx's pool reads it: a value written as text into a
        // blob column (`canonical || X'00'` is text) is a changed row the audit must name, not
        // a read that fails.
        match self.get_ref(i).map_err(storage)? {
            rusqlite::types::ValueRef::Blob(b) | rusqlite::types::ValueRef::Text(b) => Ok(b.to_vec()),
            _ => self.get(i).map_err(storage),
        }
    }
}
