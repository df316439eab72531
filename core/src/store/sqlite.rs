//! The embedded backend: SQLite in WAL mode with `synchronous = FULL`, so an acknowledged
//! append survives a crash of the process or the machine.
//!
//! Only SQL text, parameter binding and row decoding live here; the algorithms (append commit,
//! locked commit, projection fold, migrations, the outbox's transactions) are in `engine.rs` and
//! `outbox.rs`, over [`SqliteTransaction`]. Each statement is written once as a [`stmt::Sql`]
//! and runs where [`stmt::On`] says: on sqlx's pool, or on one of the store's own connections
//! (`inline`) on the caller's thread.
//!
//! **Writes.** Every write of this process (the appender's transactions, the outbox's, the
//! one-statement writes) is made on one connection of the store's own, [`inline::Own`], after
//! the writers before it (an async lock, in order: SQLite has one write lock, and its busy
//! handler sleeps 1, 2, 5, 10 ms … between tries, never woken when the lock frees). Write
//! transactions start with `BEGIN IMMEDIATE`, taking SQLite's write lock up front; so SQLite's
//! "locks" (the commit counter's, the chain heads') are that one write lock. In a server the
//! statements run on the caller's thread (microseconds each: no hand-over to a worker thread
//! and back, and one connection whose page cache the other writers never invalidate) and the
//! `COMMIT`, SQLite's fsync, on a blocking thread; a `BEGIN` that finds another process
//! holding the lock waits for it on a blocking thread too.
//!
//! **Reads.** sqlx hands every statement to a worker thread, so the cost is per statement, not
//! per row (`notes/limits.md`). A server's point reads (a row by key, rows by up to
//! [`super::ROWS_GET_MAX`] keys, a bounded page of stream touches, the commit counter) run on
//! the caller's thread, on one of a few read-only connections ([`inline::Readers`]) that never
//! wait: with none free, or SQLite busy, the read goes to the pool. Every other read (scans,
//! pages of events) stays on the pool.
//!
//! The simulator opens the store with [`SqliteStore::open_for_one_thread`]: every statement,
//! reads included and the `COMMIT` too, then runs on the store's own connection on the
//! caller's thread; the pool is left the reads made while that connection is inside a write
//! transaction.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{Row as _, SqlitePool};

use self::stmt::{On, Sql, execute_script};
use super::engine::{Migration, Transaction};
use super::outbox::{
    ATTEMPT_COLUMNS, Attempt, CLAIM_ITEMS_MAX, Completion, ITEM_COLUMNS, NewWorkItem, OutboxStore, WorkItem, WorkState,
    count_states, outcome_columns,
};
use super::status::{PASS_COLUMNS, PassRecord, StatusStore};
use super::{
    Columns, EVENT_COLUMNS, EventStore, Head, LogStore, PreRead, PreReadQuery, PreparedBatch, RawRow, Row, RowKey, RowStore,
    SecretStore, Store, WriteToken, columns_by_try_get, event_row_decode, head_decode, idempotency_decode, migrations_of,
    projection_row_decode, raw_row_decode, stream_version_decode, to_i64, to_u32, to_u64,
};
use crate::error::{Error, Result};
use crate::event::{EventRow, Position};
use crate::id::{EventId, TenantId};

/// Connections in the pool: one writer at a time (SQLite's rule) plus readers.
pub const POOL_CONNECTIONS_MAX: u32 = 8;
/// How long a statement waits for SQLite's write lock before failing.
pub const BUSY_TIMEOUT_MS: u64 = 10_000;
/// Rows per multi-row statement, well under SQLite's 32,766 bound parameters.
const ROWS_PER_STATEMENT_MAX: usize = 1000;

/// The rest of `items_complete`'s statement after its `u` rows: consumer and owner bound last.
///
/// Each row of the batch finds its item by the primary key, named (`INDEXED BY`, here and in
/// [`ITEMS_RELEASE_UPDATE`]) because SQLite's planner, once a batch holds more than a few dozen
/// rows, would rather walk every pending item of the consumer (`work_items_due`) and scan the
/// whole batch for each: quadratic, and most of a webhook delivery's database time once
/// completions queued up. `plan_tests` holds both to a whole chunk's rows.
const ITEMS_COMPLETE_UPDATE: &str = ") UPDATE work_items INDEXED BY sqlite_autoindex_work_items_1 SET state = u.state, next_at_ms = u.next_at, lease_owner = NULL, \
     lease_until_ms = 0, last_error = u.err, updated_at_ms = u.upd FROM u \
     WHERE work_items.tenant_id = u.t AND work_items.consumer = ? AND work_items.id = u.i AND work_items.lease_owner = ? \
     AND work_items.attempts = u.num AND work_items.state = 'pending' \
     RETURNING work_items.tenant_id, work_items.id, work_items.attempts";

/// Gives claimed items back (after `WITH r(t, i, num) AS (VALUES …)`): only those `owner`
/// still holds at the attempt its claim counted, with the claim's counts undone.
const ITEMS_RELEASE_UPDATE: &str = ") UPDATE work_items INDEXED BY sqlite_autoindex_work_items_1 SET lease_owner = NULL, lease_until_ms = 0, \
     attempts = work_items.attempts - 1, round_attempts = work_items.round_attempts - 1 FROM r \
     WHERE work_items.tenant_id = r.t AND work_items.consumer = ? AND work_items.id = r.i AND work_items.lease_owner = ? \
     AND work_items.attempts = r.num AND work_items.state = 'pending'";

const MIGRATIONS: &[Migration] = migrations_of!("sqlite");

mod inline;
mod stmt;

pub struct SqliteStore {
    pool: SqlitePool,
    data_keys: std::sync::RwLock<Option<std::sync::Arc<crate::sealing::DataKeys>>>,
    /// The connection every write of this process is made on (module `inline`): a server's
    /// writer, or, in the simulator ([`Self::open_for_one_thread`]), the connection every
    /// statement runs on.
    own: inline::Own,
    /// Point reads on the caller's thread, in a server ([`inline::Readers`]).
    readers: Option<inline::Readers>,
}

/// SQLite's VFS for a database only this process opens: the Unix VFS with one exclusive lock
/// on the file taken once, and every lock between this process's connections kept in memory.
pub const ONE_PROCESS_VFS: &str = "unix-excl";

/// [`RowStore::row_last`]: the primary key walked backwards from the end of the kind's rows.
const ROW_LAST_SQL: &str =
    "SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? ORDER BY id DESC LIMIT 1";

/// The database file and its `-wal` and `-shm` companions are readable by their owner only
/// (they hold webhook secrets and every event), whatever the umask.
const FILE_MODE: u32 = 0o600;

/// Creates `path` with [`FILE_MODE`] if absent, and takes group and other permissions off it if
/// present with them (a file made by an older version took the umask).
fn private_file(path: &Path, create: bool) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let failed = |e: std::io::Error| Error::Storage(format!("{}: {e}", path.display()));
    if create {
        std::fs::OpenOptions::new().read(true).write(true).create(true).mode(FILE_MODE).open(path).map_err(failed)?;
    }
    let mode = match std::fs::metadata(path) {
        Ok(metadata) => metadata.permissions().mode(),
        Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(failed(e)),
    };
    if mode & 0o077 != 0 {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & FILE_MODE)).map_err(failed)?;
    }
    Ok(())
}

impl SqliteStore {
    /// Opens (creating if absent) the database at `path`, in WAL mode. The file is created with
    /// mode 0600 before SQLite opens it, so SQLite gives its `-wal` and `-shm` the same mode;
    /// those are checked once open.
    pub async fn open(path: &Path) -> Result<Self> {
        Self::open_on(path, None).await
    }

    /// [`Self::open`] through the named SQLite VFS (`None`: the platform's default).
    async fn open_on(path: &Path, vfs: Option<&'static str>) -> Result<Self> {
        private_file(path, true)?;
        let mut options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS));
        if let Some(vfs) = vfs {
            options = options.vfs(vfs);
        }
        // No ping before each statement (sqlx's default): a SQLite connection is a file handle in
        // this process, not a socket that can go stale, and the ping is one more hand-over to
        // the connection's worker thread and back per statement (with the ping sqlx
        // does when a connection is given back, two of the three hand-overs of every read).
        let pool = SqlitePoolOptions::new()
            .max_connections(POOL_CONNECTIONS_MAX)
            .test_before_acquire(false)
            .connect_with(options)
            .await?;
        for suffix in ["-wal", "-shm"] {
            let mut companion = path.as_os_str().to_owned();
            companion.push(suffix);
            private_file(Path::new(&companion), false)?;
        }
        let (own, readers) = match vfs {
            // The simulator's store reads on its own connection: no readers beside it.
            Some(vfs) => (inline::Own::OneThread(inline::InlineConn::open(path, Some(vfs))?.into()), None),
            None => (
                inline::Own::Writer(inline::InlineConn::open(path, None)?.into()),
                Some(inline::Readers::open(path, inline::READERS)?),
            ),
        };
        Ok(Self { pool, data_keys: Default::default(), own, readers })
    }

    /// [`Self::open`], with every statement (reads, writes, write transactions) made on the
    /// caller's thread through a connection of its own rather than handed to a pool
    /// connection's worker thread (the module `inline`). For the simulator, whose one thread is
    /// the whole world; never for a server, whose runtime threads such a statement would block.
    ///
    /// Opened through SQLite's `unix-excl` VFS ([`ONE_PROCESS_VFS`]), pool and inline
    /// connection alike: the file is locked once against other processes, and the connections
    /// of this one coordinate in memory (the WAL index on the heap, not in a `-shm` file), so a
    /// transaction makes no `fcntl` lock calls (before: 1.33 million of them in a 1,000-node
    /// run, 27 thousand after).
    pub async fn open_for_one_thread(path: &Path) -> Result<Self> {
        Self::open_on(path, Some(ONE_PROCESS_VFS)).await
    }

    /// `sqlite://PATH` or `sqlite:PATH`.
    pub async fn open_url(url: &str) -> Result<Self> {
        let path = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")).unwrap_or(url);
        Self::open(Path::new(path)).await
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Where a read outside any transaction runs: the inline connection, unless a write
    /// transaction is open on it (whose uncommitted rows the read must not see).
    fn read_on(&self) -> On<'_> {
        match &self.own {
            inline::Own::OneThread(inline) if !inline.in_transaction() => On::Inline(inline),
            _ => On::Pool(&self.pool),
        }
    }

    /// Every row of a point read (a row by key, a few hundred by key, a `LIMIT`ed page): on a
    /// reader on this thread where one is free, else where [`Self::read_on`] says.
    async fn point<T>(&self, sql: Sql, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Vec<T>> {
        if let Some(readers) = &self.readers
            && let Some(read) = readers.all(&sql, &decode)
        {
            return read;
        }
        sql.all(self.read_on(), decode).await
    }

    /// The first row of a point read ([`Self::point`]), if any.
    async fn point_first<T>(&self, sql: Sql, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Option<T>> {
        Ok(self.point(sql, decode).await?.into_iter().next())
    }

    /// Runs one statement that writes, committing on its own; returns the rows it changed.
    async fn write(&self, sql: Sql) -> Result<u64> {
        let mut tx = self.begin().await?;
        let changed = sql.execute(tx.on()?).await?;
        tx.end(true).await?;
        Ok(changed)
    }

    /// [`Self::write`] for a statement with `RETURNING`: the rows it returns.
    async fn write_returning<T>(&self, sql: Sql, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Vec<T>> {
        let mut tx = self.begin().await?;
        let rows = sql.all(tx.on()?, decode).await?;
        tx.end(true).await?;
        Ok(rows)
    }

    /// Opens a write transaction (`BEGIN IMMEDIATE`) on the store's own connection, after
    /// this process's writers before it (its async lock, in order).
    async fn begin(&self) -> Result<SqliteTransaction> {
        let conn = self.own.conn().clone();
        let mut writer = conn.writer.clone().lock_owned().await;
        match &self.own {
            inline::Own::OneThread(_) => conn.begin()?,
            inline::Own::Writer(_) => {
                if !conn.begin_now()? {
                    // Another process holds SQLite's write lock: wait for it off the runtime,
                    // the writer lock going with the wait (`InlineConn::begin` ends a
                    // transaction a caller that stopped waiting left open).
                    let waiting = conn.clone();
                    let begun = tokio::task::spawn_blocking(move || (waiting.begin(), writer))
                        .await
                        .map_err(|e| Error::Internal(format!("the store's writer: {e}")))?;
                    begun.0?;
                    writer = begun.1;
                }
            }
        }
        Ok(SqliteTransaction { state: TxState::Open { conn, commit_off_thread: self.own.commits_off_thread(), _writer: writer } })
    }
}

/// `VALUES (?, ?), (?, ?), …` for a CTE of pairs.
fn push_pairs(q: &mut Sql, pairs: impl IntoIterator<Item = (String, String)>) {
    q.push_values(pairs, |t, (a, b)| {
        t.bind(a).bind(b);
    });
}

/// `VALUES (?, ?, ?), …` for a CTE of projection row keys.
fn push_row_keys<'k>(q: &mut Sql, keys: impl IntoIterator<Item = &'k RowKey>) {
    q.push_values(keys, |t, key| {
        t.bind(&key.tenant).bind(&key.kind).bind(&key.id);
    });
}

/// Where the statements of a pre-read (and of the heads read under the write lock) run: inside
/// a transaction, on its connection; outside one, each as a point read ([`SqliteStore::point`]: on a reader on this thread where one is
/// free, not handed to a pool connection's thread statement by statement).
enum Reads<'a> {
    On(On<'a>),
    Point(&'a SqliteStore),
}

impl Reads<'_> {
    async fn all<T>(&mut self, sql: Sql, decode: impl Fn(&dyn Columns) -> Result<T>) -> Result<Vec<T>> {
        match self {
            Reads::On(on) => sql.all(on.again(), decode).await,
            Reads::Point(store) => store.point(sql, decode).await,
        }
    }
}

async fn heads_on(on: &mut Reads<'_>, tenants: &[TenantId]) -> Result<HashMap<TenantId, Head>> {
    let mut heads = HashMap::new();
    for chunk in tenants.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = Sql::new("SELECT tenant_id, seq, hash FROM chain_heads WHERE tenant_id IN (");
        q.push_list(chunk.iter().map(|t| t.to_string())).push(")");
        heads.extend(on.all(q, |r| head_decode(r)).await?);
    }
    Ok(heads)
}

async fn preread_on(mut on: Reads<'_>, query: &PreReadQuery) -> Result<PreRead> {
    let mut out = PreRead { heads: heads_on(&mut on, &query.tenants).await?, ..Default::default() };
    for chunk in query.streams.chunks(ROWS_PER_STATEMENT_MAX) {
        // A correlated MAX per key walks the (tenant_id, stream, version) index; a row-value IN
        // list does not, and scans the table.
        let mut q = Sql::new("WITH k(t, s) AS (");
        push_pairs(&mut q, chunk.iter().map(|(t, s)| (t.to_string(), s.clone())));
        q.push(") SELECT k.t, k.s, (SELECT MAX(version) FROM events e WHERE e.tenant_id = k.t AND e.stream = k.s) FROM k");
        out.stream_versions.extend(on.all(q, |r| stream_version_decode(r)).await?.into_iter().flatten());
    }
    for chunk in query.idempotency_keys.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = Sql::new("WITH k(t, s) AS (");
        push_pairs(&mut q, chunk.iter().map(|(t, k)| (t.to_string(), k.clone())));
        q.push(") SELECT i.tenant_id, i.key, i.request_hash, i.first_seq, i.last_seq FROM k JOIN idempotency i ON i.tenant_id = k.t AND i.key = k.s");
        out.idempotency.extend(on.all(q, |r| idempotency_decode(r)).await?);
    }
    Ok(out)
}

/// One write transaction, `BEGIN IMMEDIATE`, on the store's own connection, holding this
/// process's writer lock. Dropped unfinished, it is rolled back.
pub struct SqliteTransaction {
    state: TxState,
}

enum TxState {
    Open {
        conn: std::sync::Arc<inline::InlineConn>,
        /// The `COMMIT` (SQLite's fsync) runs on a blocking thread: a server's.
        commit_off_thread: bool,
        _writer: tokio::sync::OwnedMutexGuard<()>,
    },
    Ended,
}

impl SqliteTransaction {
    fn on(&mut self) -> Result<On<'_>> {
        match &self.state {
            TxState::Open { conn, .. } => Ok(On::Inline(conn)),
            TxState::Ended => Err(Error::Internal("the transaction has already ended".into())),
        }
    }

    async fn end(&mut self, commit: bool) -> Result<()> {
        match std::mem::replace(&mut self.state, TxState::Ended) {
            TxState::Open { conn, commit_off_thread: true, _writer } if commit => {
                // The writer lock goes with the commit: a caller that stops waiting for it does
                // not let the next writer in before it ends.
                tokio::task::spawn_blocking(move || {
                    let _writer = _writer;
                    conn.end(true)
                })
                .await
                .map_err(|e| Error::Internal(format!("the store's writer: {e}")))?
            }
            // A rollback in WAL mode writes nothing durable: it is quick on any thread.
            TxState::Open { conn, .. } => conn.end(commit),
            TxState::Ended => Err(Error::Internal("the transaction has already ended".into())),
        }
    }
}

impl Drop for SqliteTransaction {
    fn drop(&mut self) {
        if let TxState::Open { conn, .. } = &self.state
            && let Err(e) = conn.end(false)
        {
            tracing::debug!(error = %e, "rolling back a dropped transaction");
        }
    }
}

#[async_trait]
impl Transaction for SqliteTransaction {
    async fn commit(&mut self) -> Result<()> {
        self.end(true).await
    }

    async fn rollback(&mut self) -> Result<()> {
        self.end(false).await
    }

    async fn counter_bump(&mut self) -> Result<u64> {
        let q = Sql::new("UPDATE log_counter SET last_commit = last_commit + 1 WHERE id = 1 RETURNING last_commit");
        to_u64(q.one(self.on()?, |r| r.int(0)).await?)
    }

    async fn counter_lock(&mut self) -> Result<u64> {
        // `BEGIN IMMEDIATE` already holds the write lock, so appenders wait.
        to_u64(Sql::new("SELECT last_commit FROM log_counter WHERE id = 1").one(self.on()?, |r| r.int(0)).await?)
    }

    async fn heads_lock(&mut self, tenants: &[TenantId]) -> Result<HashMap<TenantId, Head>> {
        heads_on(&mut Reads::On(self.on()?), tenants).await
    }

    async fn preread(&mut self, query: &PreReadQuery) -> Result<PreRead> {
        preread_on(Reads::On(self.on()?), query).await
    }

    async fn batch_insert(
        &mut self,
        batch: &PreparedBatch,
        commit: u64,
        touched: &[RowKey],
    ) -> Result<HashMap<RowKey, serde_json::Value>> {
        let commit = to_i64(commit)?;
        let mut on = self.on()?;
        for chunk in batch.events.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut columns = Vec::with_capacity(chunk.len());
            for e in chunk {
                let env = &e.envelope;
                columns.push((to_i64(env.seq)?, to_i64(env.version)?, to_i64(env.at_ms)?));
            }
            let mut q = Sql::new(
                "INSERT INTO events (tenant_id, seq, id, stream, version, type, at_ms, commit_no, commit_index, canonical, hash, sig, key_id) ",
            );
            q.push_values(chunk.iter().zip(columns), |t, (e, (seq, version, at))| {
                let env = &e.envelope;
                t.bind(env.tenant.to_string())
                    .bind(seq)
                    .bind(env.id.to_string())
                    .bind(&env.stream)
                    .bind(version)
                    .bind(&env.event_type)
                    .bind(at)
                    .bind(commit)
                    .bind(i64::from(e.position.index))
                    .bind(e.canonical.clone())
                    .bind(e.hash.to_vec())
                    .bind(e.sig.clone())
                    .bind(&e.key_id);
            });
            q.execute(on.again()).await?;
        }
        let heads: Vec<(String, i64, Vec<u8>)> = batch
            .heads_after
            .iter()
            .map(|(tenant, head)| Ok((tenant.to_string(), to_i64(head.seq)?, head.hash.to_vec())))
            .collect::<Result<_>>()?;
        if !heads.is_empty() {
            let mut q = Sql::new("INSERT INTO chain_heads (tenant_id, seq, hash) ");
            q.push_values(heads, |t, (tenant, seq, hash)| {
                t.bind(tenant).bind(seq).bind(hash);
            });
            q.push(" ON CONFLICT (tenant_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash");
            q.execute(on.again()).await?;
        }
        let records: Vec<(String, String, Vec<u8>, i64, i64)> = batch
            .idempotency
            .iter()
            .map(|(tenant, key, r)| {
                Ok((tenant.to_string(), key.clone(), r.request_hash.to_vec(), to_i64(r.first_seq)?, to_i64(r.last_seq)?))
            })
            .collect::<Result<_>>()?;
        for chunk in records.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q = Sql::new("INSERT INTO idempotency (tenant_id, key, request_hash, first_seq, last_seq) ");
            q.push_values(chunk, |t, (tenant, key, hash, first, last)| {
                t.bind(tenant).bind(key).bind(hash.clone()).bind(*first).bind(*last);
            });
            q.execute(on.again()).await?;
        }
        let mut current = HashMap::new();
        for chunk in touched.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q = Sql::new("WITH k(t, kd, i) AS (");
            push_row_keys(&mut q, chunk);
            q.push(") SELECT p.tenant_id, p.kind, p.id, p.doc FROM k JOIN projections p ON p.tenant_id = k.t AND p.kind = k.kd AND p.id = k.i");
            for row in q.all(on.again(), |r| projection_row_decode(r)).await? {
                current.insert(row.key, row.doc);
            }
        }
        Ok(current)
    }

    async fn projections_upsert(&mut self, rows: &[Row]) -> Result<()> {
        let mut on = self.on()?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q = Sql::new("INSERT INTO projections (tenant_id, kind, id, doc) ");
            q.push_values(chunk, |t, row| {
                t.bind(&row.key.tenant).bind(&row.key.kind).bind(&row.key.id).bind(row.doc.to_string());
            });
            q.push(" ON CONFLICT (tenant_id, kind, id) DO UPDATE SET doc = excluded.doc");
            q.execute(on.again()).await?;
        }
        Ok(())
    }

    async fn projections_delete(&mut self, keys: &[RowKey]) -> Result<()> {
        // One statement per key walks the primary key; a row-value IN list would scan.
        let mut on = self.on()?;
        for key in keys {
            Sql::new("DELETE FROM projections WHERE tenant_id = ? AND kind = ? AND id = ?")
                .bind(&key.tenant)
                .bind(&key.kind)
                .bind(&key.id)
                .execute(on.again())
                .await?;
        }
        Ok(())
    }

    async fn projections_clear(&mut self) -> Result<()> {
        Sql::new("DELETE FROM projections").execute(self.on()?).await?;
        Ok(())
    }

    async fn migrations_lock(&mut self) -> Result<()> {
        // `BEGIN IMMEDIATE` holds the write lock: concurrent runners queue behind it.
        execute_script(
            self.on()?,
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)",
        )
        .await
    }

    async fn migration_applied(&mut self, version: u64) -> Result<bool> {
        let q = Sql::new("SELECT version FROM schema_migrations WHERE version = ?").bind(to_i64(version)?);
        Ok(q.first(self.on()?, |r| r.int(0)).await?.is_some())
    }

    async fn migration_apply(&mut self, migration: &Migration, at_ms: u64) -> Result<()> {
        let mut on = self.on()?;
        execute_script(on.again(), migration.sql).await?;
        Sql::new("INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES (?, ?, ?)")
            .bind(to_i64(migration.version)?)
            .bind(migration.name)
            .bind(to_i64(at_ms)?)
            .execute(on)
            .await?;
        Ok(())
    }

    async fn cursor_create(&mut self, consumer: &str, now_ms: u64) -> Result<()> {
        Sql::new(
            "INSERT INTO consumer_cursors (consumer, commit_no, commit_index, lease_owner, lease_until_ms, updated_at_ms) \
             VALUES (?, 0, 0, NULL, 0, ?) ON CONFLICT (consumer) DO NOTHING",
        )
        .bind(consumer)
        .bind(to_i64(now_ms)?)
        .execute(self.on()?)
        .await?;
        Ok(())
    }

    async fn cursor_take(&mut self, consumer: &str, owner: &str, now_ms: u64, until_ms: u64) -> Result<Option<Position>> {
        let now = to_i64(now_ms)?;
        Sql::new(
            "UPDATE consumer_cursors SET lease_owner = ?, lease_until_ms = ?, updated_at_ms = ? \
             WHERE consumer = ? AND (lease_owner IS NULL OR lease_owner = ? OR lease_until_ms < ?) \
             RETURNING commit_no, commit_index",
        )
        .bind(owner)
        .bind(to_i64(until_ms)?)
        .bind(now)
        .bind(consumer)
        .bind(owner)
        .bind(now)
        .first(self.on()?, |r| position_decode(r))
        .await
    }

    async fn cursor_move(&mut self, consumer: &str, owner: &str, from: Position, to: Position, now_ms: u64) -> Result<bool> {
        let moved = Sql::new(
            "UPDATE consumer_cursors SET commit_no = ?, commit_index = ?, updated_at_ms = ? \
             WHERE consumer = ? AND lease_owner = ? AND commit_no = ? AND commit_index = ?",
        )
        .bind(to_i64(to.commit)?)
        .bind(i64::from(to.index))
        .bind(to_i64(now_ms)?)
        .bind(consumer)
        .bind(owner)
        .bind(to_i64(from.commit)?)
        .bind(i64::from(from.index))
        .execute(self.on()?)
        .await?;
        Ok(moved == 1)
    }

    async fn items_insert(
        &mut self,
        consumer: &str,
        items: &[NewWorkItem],
        now_ms: u64,
        claimed_by: Option<(&str, u64)>,
    ) -> Result<Vec<(String, String)>> {
        let now = to_i64(now_ms)?;
        let (owner, lease_until, attempts) = match claimed_by {
            Some((owner, until_ms)) => (Some(owner), to_i64(until_ms)?, 1i64),
            None => (None, 0, 0),
        };
        let mut on = self.on()?;
        let mut inserted = Vec::new();
        for chunk in items.chunks(ROWS_PER_STATEMENT_MAX / 4) {
            let mut q = Sql::new(
                "INSERT INTO work_items (tenant_id, consumer, id, subject, payload, state, attempts, round_attempts, \
                 next_at_ms, lease_owner, lease_until_ms, last_error, created_at_ms, updated_at_ms) ",
            );
            q.push_values(chunk, |t, item| {
                t.bind(item.tenant.to_string())
                    .bind(consumer)
                    .bind(&item.id)
                    .bind(&item.subject)
                    .bind(item.payload.to_string())
                    .bind("pending")
                    .bind(attempts)
                    .bind(attempts)
                    .bind(now)
                    .bind(owner)
                    .bind(lease_until)
                    .bind(None::<String>)
                    .bind(now)
                    .bind(now);
            });
            q.push(" ON CONFLICT (tenant_id, consumer, id) DO NOTHING");
            if claimed_by.is_some() {
                q.push(" RETURNING tenant_id, id");
                inserted.extend(q.all(on.again(), |r| Ok((r.text(0)?, r.text(1)?))).await?);
            } else {
                q.execute(on.again()).await?;
            }
        }
        Ok(inserted)
    }

    async fn items_complete(&mut self, consumer: &str, owner: &str, done: &[Completion]) -> Result<Vec<bool>> {
        // One statement per chunk of the batch: the guarded update of every item in it, joined
        // to its row by the primary key (`plan_tests`). Through sqlx each statement costs a
        // worker thread's wake-up, so one per item was most of a delivery's database time.
        let mut rows = Vec::with_capacity(done.len());
        for c in done {
            let (state, next_at) = outcome_columns(&c.outcome, c.attempt.at_ms);
            let updated = to_i64(c.attempt.at_ms.saturating_add(c.attempt.latency_ms))?;
            rows.push((c, state, to_i64(next_at)?, updated));
        }
        let mut on = self.on()?;
        let mut moved = std::collections::HashSet::new();
        for chunk in rows.chunks(ROWS_PER_STATEMENT_MAX / 7) {
            let mut q = Sql::new("WITH u(t, i, state, next_at, err, upd, num) AS (");
            q.push_values(chunk, |t, (c, state, next_at, updated)| {
                t.bind(c.tenant.to_string())
                    .bind(&c.id)
                    .bind(state.as_str())
                    .bind(*next_at)
                    .bind(c.attempt.error.as_deref())
                    .bind(*updated)
                    .bind(i64::from(c.attempt.number));
            });
            q.push(ITEMS_COMPLETE_UPDATE);
            let returned = q.bind(consumer).bind(owner).all(on.again(), |r| Ok((r.text(0)?, r.text(1)?, r.int(2)?))).await?;
            moved.extend(returned);
        }
        // By attempt number too: one batch may hold two attempts of one item.
        Ok(done.iter().map(|c| moved.contains(&(c.tenant.to_string(), c.id.clone(), i64::from(c.attempt.number)))).collect())
    }

    async fn attempts_insert(&mut self, consumer: &str, owner: &str, done: &[&Completion]) -> Result<()> {
        let mut rows = Vec::with_capacity(done.len());
        for c in done {
            let a = &c.attempt;
            rows.push((c, to_i64(a.at_ms)?, to_i64(a.latency_ms)?, a.next_at_ms.map(to_i64).transpose()?));
        }
        let mut on = self.on()?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT_MAX / 10) {
            let mut q = Sql::new(
                "INSERT INTO work_attempts (tenant_id, consumer, item_id, number, at_ms, latency_ms, status, error, next_at_ms, owner) ",
            );
            q.push_values(chunk, |t, (c, at, latency, next_at)| {
                t.bind(c.tenant.to_string())
                    .bind(consumer)
                    .bind(&c.id)
                    .bind(i64::from(c.attempt.number))
                    .bind(*at)
                    .bind(*latency)
                    .bind(c.attempt.status.map(i64::from))
                    .bind(c.attempt.error.as_deref())
                    .bind(*next_at)
                    .bind(owner);
            });
            q.push(" ON CONFLICT (tenant_id, consumer, item_id, number) DO NOTHING");
            q.execute(on.again()).await?;
        }
        Ok(())
    }

    async fn items_prune(&mut self, consumer: &str, before_ms: u64, limit: u32) -> Result<Vec<(String, String)>> {
        Sql::new(
            "DELETE FROM work_items WHERE rowid IN (SELECT rowid FROM work_items WHERE consumer = ? AND state = 'done' \
             AND updated_at_ms < ? LIMIT ?) RETURNING tenant_id, id",
        )
        .bind(consumer)
        .bind(to_i64(before_ms)?)
        .bind(i64::from(limit))
        .all(self.on()?, |r| Ok((r.text(0)?, r.text(1)?)))
        .await
    }

    async fn attempts_delete(&mut self, consumer: &str, items: &[(String, String)]) -> Result<()> {
        let mut on = self.on()?;
        for chunk in items.chunks(ROWS_PER_STATEMENT_MAX / 2) {
            let mut q = Sql::new("DELETE FROM work_attempts WHERE consumer = ");
            q.push_bind(consumer);
            q.push(" AND (tenant_id, item_id) IN (");
            push_pairs(&mut q, chunk.iter().cloned());
            q.push(")");
            q.execute(on.again()).await?;
        }
        Ok(())
    }
}

/// A consumer's cursor from `commit_no, commit_index`.
fn position_decode(row: &dyn Columns) -> Result<Position> {
    Ok(Position { commit: to_u64(row.int(0)?)?, index: to_u32(row.int(1)?)? })
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn transaction(&self, _: WriteToken) -> Result<Box<dyn Transaction + '_>> {
        Ok(Box::new(self.begin().await?))
    }
}

#[async_trait]
impl EventStore for SqliteStore {
    fn migrations(&self) -> &'static [Migration] {
        MIGRATIONS
    }

    async fn schema_version(&self) -> Result<Option<u64>> {
        // No migrations table yet reads as no migration applied.
        let latest = Sql::new("SELECT MAX(version) FROM schema_migrations").first(self.read_on(), |r| r.opt_int(0)).await;
        latest.ok().flatten().flatten().map(to_u64).transpose()
    }
}

#[async_trait]
impl LogStore for SqliteStore {
    async fn preread(&self, query: &PreReadQuery) -> Result<PreRead> {
        preread_on(Reads::Point(self), query).await
    }

    async fn read_chain_rows(&self, tenant: TenantId, from_seq: u64, limit: u32) -> Result<Vec<EventRow>> {
        // A page by an index (here and below): a point read (the audit's walk, a proof's
        // leaves, a stream's or a consumer's next page), so read on this thread, not handed row
        // by row from a pool connection's thread.
        let sql = Sql::new(format!("SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND seq >= ? ORDER BY seq LIMIT ?"))
            .bind(tenant.to_string())
            .bind(to_i64(from_seq)?)
            .bind(i64::from(limit));
        self.point(sql, |r| event_row_decode(r)).await
    }

    async fn read_stream_rows(&self, tenant: TenantId, stream: &str, after_version: u64, limit: u32) -> Result<Vec<EventRow>> {
        let sql = Sql::new(format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND stream = ? AND version > ? ORDER BY version LIMIT ?"
        ))
        .bind(tenant.to_string())
        .bind(stream)
        .bind(to_i64(after_version)?)
        .bind(i64::from(limit));
        self.point(sql, |r| event_row_decode(r)).await
    }

    async fn read_after_rows(&self, after: Position, tenant: Option<TenantId>, limit: u32) -> Result<Vec<EventRow>> {
        let mut q = Sql::new(read_after_sql(tenant.is_some()));
        if let Some(t) = tenant {
            q = q.bind(t.to_string());
        }
        let sql = q.bind(to_i64(after.commit)?).bind(i64::from(after.index)).bind(i64::from(limit));
        self.point(sql, |r| event_row_decode(r)).await
    }

    async fn read_after_touches(&self, after: Position, limit: u32) -> Result<Vec<super::StreamTouch>> {
        let sql = Sql::new(format!(
            "SELECT {} FROM events WHERE (commit_no, commit_index) > (?, ?) ORDER BY commit_no, commit_index LIMIT ?",
            super::TOUCH_COLUMNS
        ))
        .bind(to_i64(after.commit)?)
        .bind(i64::from(after.index))
        .bind(i64::from(limit));
        self.point(sql, |r| super::touch_decode(r)).await
    }

    async fn event_row(&self, tenant: TenantId, id: EventId) -> Result<Option<EventRow>> {
        let sql = Sql::new(format!("SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND id = ?"))
            .bind(tenant.to_string())
            .bind(id.to_string());
        self.point_first(sql, |r| event_row_decode(r)).await
    }

    async fn heads(&self) -> Result<Vec<(TenantId, Head)>> {
        Sql::new("SELECT tenant_id, seq, hash FROM chain_heads ORDER BY tenant_id").all(self.read_on(), |r| head_decode(r)).await
    }

    async fn tenants(&self) -> Result<Vec<TenantId>> {
        let rows = Sql::new(super::TENANTS_SQL).all(self.read_on(), |r| r.text(0)).await?;
        rows.iter().map(|t| t.parse()).collect()
    }

    async fn last_commit(&self) -> Result<u64> {
        let sql = Sql::new("SELECT last_commit FROM log_counter WHERE id = 1");
        match self.point_first(sql, |r| r.int(0)).await? {
            Some(last) => to_u64(last),
            None => Err(Error::Storage("log_counter has no row".into())),
        }
    }

    async fn signing_key_put(&self, key_id: &str, public: &[u8; 32], at_ms: u64) -> Result<()> {
        self.write(
            Sql::new(
                "INSERT INTO signing_keys (key_id, public_key, created_at_ms) VALUES (?, ?, ?) ON CONFLICT (key_id) DO NOTHING",
            )
            .bind(key_id)
            .bind(public.to_vec())
            .bind(to_i64(at_ms)?),
        )
        .await?;
        Ok(())
    }

    async fn signing_keys(&self) -> Result<Vec<(String, Vec<u8>)>> {
        Sql::new("SELECT key_id, public_key FROM signing_keys ORDER BY created_at_ms")
            .all(self.read_on(), |r| Ok((r.text(0)?, r.bytes(1)?)))
            .await
    }
}

#[async_trait]
impl RowStore for SqliteStore {
    async fn row_get(&self, tenant: &str, kind: &str, id: &str) -> Result<Option<Row>> {
        let sql = Sql::new("SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? AND id = ?")
            .bind(tenant)
            .bind(kind)
            .bind(id);
        self.point_first(sql, |r| projection_row_decode(r)).await
    }

    async fn rows_get_raw(&self, tenant: &str, kind: &str, ids: &[&str]) -> Result<Vec<RawRow>> {
        super::check_rows_get(ids)?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let mut sql = Sql::new("SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? AND id IN (")
            .bind(tenant)
            .bind(kind);
        sql.push_list(ids.iter().copied()).push(") ORDER BY id");
        self.point(sql, |r| raw_row_decode(r)).await
    }

    async fn row_find(&self, kind: &str, id: &str) -> Result<Option<Row>> {
        let sql = Sql::new("SELECT tenant_id, kind, id, doc FROM projections WHERE kind = ? AND id = ?").bind(kind).bind(id);
        self.point_first(sql, |r| projection_row_decode(r)).await
    }

    async fn row_list_raw(&self, tenant: &str, kind: &str, after_id: Option<&str>, limit: u32) -> Result<Vec<RawRow>> {
        // A page by the key: a point read (every list method's page, a fleet view's load).
        let sql = Sql::new(
            "SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? AND id > ? ORDER BY id LIMIT ?",
        )
        .bind(tenant)
        .bind(kind)
        .bind(after_id.unwrap_or(""))
        .bind(i64::from(limit));
        self.point(sql, |r| raw_row_decode(r)).await
    }

    async fn row_last(&self, tenant: &str, kind: &str) -> Result<Option<Row>> {
        let sql = Sql::new(ROW_LAST_SQL).bind(tenant).bind(kind);
        self.point_first(sql, |r| projection_row_decode(r)).await
    }

    async fn rows_all(&self) -> Result<Vec<Row>> {
        Sql::new("SELECT tenant_id, kind, id, doc FROM projections ORDER BY tenant_id, kind, id")
            .all(self.read_on(), |r| projection_row_decode(r))
            .await
    }
}

columns_by_try_get!(SqliteRow);

#[async_trait]
impl OutboxStore for SqliteStore {
    async fn cursor_position(&self, consumer: &str) -> Result<Option<Position>> {
        let sql = Sql::new("SELECT commit_no, commit_index FROM consumer_cursors WHERE consumer = ?").bind(consumer);
        self.point_first(sql, |r| position_decode(r)).await
    }

    async fn cursor_release(&self, consumer: &str, owner: &str) -> Result<()> {
        self.write(
            Sql::new("UPDATE consumer_cursors SET lease_owner = NULL, lease_until_ms = 0 WHERE consumer = ? AND lease_owner = ?")
                .bind(consumer)
                .bind(owner),
        )
        .await?;
        Ok(())
    }

    async fn work_claim(&self, consumer: &str, owner: &str, now_ms: u64, lease_ms: u64, limit: u32) -> Result<Vec<WorkItem>> {
        let now = to_i64(now_ms)?;
        // One statement: SQLite has one writer, so nothing else can claim between the select
        // and the update.
        let q = Sql::new(format!(
            "UPDATE work_items SET lease_owner = ?, lease_until_ms = ?, attempts = attempts + 1, \
             round_attempts = round_attempts + 1 \
             WHERE rowid IN (SELECT rowid FROM work_items WHERE consumer = ? AND state = 'pending' \
             AND next_at_ms <= ? AND lease_until_ms <= ? ORDER BY next_at_ms LIMIT ?) \
             RETURNING {ITEM_COLUMNS}"
        ))
        .bind(owner)
        .bind(to_i64(now_ms.saturating_add(lease_ms))?)
        .bind(consumer)
        .bind(now)
        .bind(now)
        .bind(i64::from(limit.min(CLAIM_ITEMS_MAX)));
        self.write_returning(q, |r| WorkItem::decode(r)).await
    }

    async fn work_release(&self, consumer: &str, owner: &str, items: &[(TenantId, String, u32)]) -> Result<u64> {
        let mut released = 0;
        for chunk in items.chunks(ROWS_PER_STATEMENT_MAX / 3) {
            let mut q = Sql::new("WITH r(t, i, num) AS (");
            q.push_values(chunk, |t, (tenant, id, number)| {
                t.bind(tenant.to_string()).bind(id.as_str()).bind(i64::from(*number));
            });
            q.push(ITEMS_RELEASE_UPDATE);
            released += self.write(q.bind(consumer).bind(owner)).await?;
        }
        Ok(released)
    }

    async fn work_get(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Option<WorkItem>> {
        let sql = Sql::new(format!("SELECT {ITEM_COLUMNS} FROM work_items WHERE tenant_id = ? AND consumer = ? AND id = ?"))
            .bind(tenant.to_string())
            .bind(consumer)
            .bind(id);
        self.point_first(sql, |r| WorkItem::decode(r)).await
    }

    async fn work_list(
        &self,
        consumer: &str,
        tenant: TenantId,
        subject: &str,
        state: Option<WorkState>,
        before_id: Option<&str>,
        limit: u32,
    ) -> Result<Vec<WorkItem>> {
        Sql::new(format!(
            "SELECT {ITEM_COLUMNS} FROM work_items WHERE tenant_id = ? AND consumer = ? AND subject = ? \
             AND (? IS NULL OR state = ?) AND (? IS NULL OR id < ?) ORDER BY id DESC LIMIT ?"
        ))
        .bind(tenant.to_string())
        .bind(consumer)
        .bind(subject)
        .bind(state.map(WorkState::as_str))
        .bind(state.map(WorkState::as_str))
        .bind(before_id)
        .bind(before_id)
        .bind(i64::from(limit))
        .all(self.read_on(), |r| WorkItem::decode(r))
        .await
    }

    async fn work_requeue(&self, consumer: &str, tenant: TenantId, id: &str, now_ms: u64) -> Result<bool> {
        let now = to_i64(now_ms)?;
        let moved = self
            .write(
                Sql::new(
                    "UPDATE work_items SET state = 'pending', next_at_ms = ?, round_attempts = 0, lease_owner = NULL, \
                     lease_until_ms = 0, updated_at_ms = ? WHERE tenant_id = ? AND consumer = ? AND id = ? AND state <> 'pending'",
                )
                .bind(now)
                .bind(now)
                .bind(tenant.to_string())
                .bind(consumer)
                .bind(id),
            )
            .await?;
        Ok(moved == 1)
    }

    async fn attempts(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Vec<Attempt>> {
        Sql::new(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM work_attempts WHERE tenant_id = ? AND consumer = ? AND item_id = ? ORDER BY number"
        ))
        .bind(tenant.to_string())
        .bind(consumer)
        .bind(id)
        .all(self.read_on(), |r| Attempt::decode(r))
        .await
    }

    async fn work_counts(&self, consumer: &str) -> Result<(u64, u64, u64)> {
        let rows = Sql::new("SELECT state, COUNT(*) FROM work_items WHERE consumer = ? GROUP BY state")
            .bind(consumer)
            .all(self.read_on(), |r| Ok((r.text(0)?, to_u64(r.int(1)?)?)))
            .await?;
        Ok(count_states(rows))
    }
}

#[async_trait]
impl SecretStore for SqliteStore {
    async fn secret_put_raw(&self, tenant: TenantId, id: &str, stored: &str, now_ms: u64) -> Result<()> {
        self.write(
            Sql::new("INSERT INTO secrets (tenant_id, id, value, created_at_ms) VALUES (?, ?, ?, ?)")
                .bind(tenant.to_string())
                .bind(id)
                .bind(stored)
                .bind(to_i64(now_ms)?),
        )
        .await?;
        Ok(())
    }

    async fn secret_get_raw(&self, tenant: TenantId, id: &str) -> Result<Option<String>> {
        // A row by key, read on every authenticated request: a point read.
        let sql = Sql::new("SELECT value FROM secrets WHERE tenant_id = ? AND id = ?").bind(tenant.to_string()).bind(id);
        self.point_first(sql, |r| r.text(0)).await
    }

    async fn secret_delete(&self, tenant: TenantId, id: &str) -> Result<()> {
        self.write(Sql::new("DELETE FROM secrets WHERE tenant_id = ? AND id = ?").bind(tenant.to_string()).bind(id)).await?;
        Ok(())
    }

    async fn secrets_count(&self, tenant: TenantId) -> Result<u64> {
        let q = Sql::new("SELECT COUNT(*) FROM secrets WHERE tenant_id = ?").bind(tenant.to_string());
        to_u64(q.one(self.read_on(), |r| r.int(0)).await?)
    }

    async fn secrets_page_raw(&self, after: Option<(String, String)>, limit: u32) -> Result<Vec<(String, String, String)>> {
        let (tenant, id) = after.unwrap_or_default();
        Sql::new("SELECT tenant_id, id, value FROM secrets WHERE (tenant_id, id) > (?, ?) ORDER BY tenant_id, id LIMIT ?")
            .bind(tenant)
            .bind(id)
            .bind(i64::from(limit))
            .all(self.read_on(), |r| Ok((r.text(0)?, r.text(1)?, r.text(2)?)))
            .await
    }

    async fn secret_replace_raw(&self, tenant: &str, id: &str, old: &str, new: &str) -> Result<bool> {
        let done = self
            .write(
                Sql::new("UPDATE secrets SET value = ? WHERE tenant_id = ? AND id = ? AND value = ?")
                    .bind(new)
                    .bind(tenant)
                    .bind(id)
                    .bind(old),
            )
            .await?;
        Ok(done == 1)
    }

    fn data_keys(&self) -> Option<std::sync::Arc<crate::sealing::DataKeys>> {
        self.data_keys.read().expect("data keys").clone()
    }

    fn set_data_keys(&self, keys: std::sync::Arc<crate::sealing::DataKeys>) {
        *self.data_keys.write().expect("data keys") = Some(keys);
    }
}

#[async_trait]
impl StatusStore for SqliteStore {
    async fn pass_record(&self, pass: &PassRecord, forget_before_ms: u64) -> Result<()> {
        self.write(
            Sql::new(
                "INSERT INTO reconciler_passes (name, instance, started_at_ms, duration_ms, ok, counts, error, passes) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?) \
                 ON CONFLICT (name, instance) DO UPDATE SET started_at_ms = excluded.started_at_ms, \
                 duration_ms = excluded.duration_ms, ok = excluded.ok, counts = excluded.counts, error = excluded.error, \
                 passes = reconciler_passes.passes + excluded.passes",
            )
            .bind(&pass.name)
            .bind(&pass.instance)
            .bind(to_i64(pass.started_at_ms)?)
            .bind(to_i64(pass.duration_ms)?)
            .bind(i64::from(pass.ok))
            .bind(pass.counts_json()?)
            .bind(pass.error_text())
            .bind(to_i64(pass.passes)?),
        )
        .await?;
        self.write(Sql::new("DELETE FROM reconciler_passes WHERE started_at_ms < ?").bind(to_i64(forget_before_ms)?)).await?;
        Ok(())
    }

    async fn passes(&self) -> Result<Vec<PassRecord>> {
        Sql::new(format!("SELECT {PASS_COLUMNS} FROM reconciler_passes ORDER BY name, instance"))
            .all(self.read_on(), |r| PassRecord::decode(r))
            .await
    }
}

/// The read by position, of one tenant or of all: parameters (tenant), commit, index, limit.
fn read_after_sql(one_tenant: bool) -> String {
    let tenant_filter = if one_tenant { "tenant_id = ? AND" } else { "" };
    format!(
        "SELECT {EVENT_COLUMNS} FROM events WHERE {tenant_filter} (commit_no, commit_index) > (?, ?) \
         ORDER BY commit_no, commit_index LIMIT ?"
    )
}

#[async_trait]
impl super::lease::LeaseStore for SqliteStore {
    async fn lease_renew(&self, leases: &[(String, String, u64)]) -> Result<()> {
        let mut tx = self.begin().await?;
        // One statement per chunk: a gateway renews every node it holds a session to.
        for chunk in leases.chunks(ROWS_PER_STATEMENT_MAX) {
            let expires = chunk.iter().map(|(_, _, at)| to_i64(*at)).collect::<Result<Vec<_>>>()?;
            let mut q = Sql::new("INSERT INTO node_leases (tenant_id, node_id, expires_at_ms) ");
            q.push_values(chunk.iter().zip(expires), |t, ((tenant, node, _), at)| {
                t.bind(tenant).bind(node).bind(at);
            });
            q.push(
                " ON CONFLICT (tenant_id, node_id) DO UPDATE SET expires_at_ms = MAX(node_leases.expires_at_ms, excluded.expires_at_ms)",
            );
            q.execute(tx.on()?).await?;
        }
        tx.end(true).await
    }

    async fn lease_changes(&self, now_ms: u64, limit: u32) -> Result<Vec<super::lease::Lease>> {
        Sql::new(format!(
            "SELECT {} FROM node_leases WHERE (expires_at_ms > ?) <> (reported_reachable = 1) LIMIT ?",
            super::lease::LEASE_COLUMNS
        ))
        .bind(to_i64(now_ms)?)
        .bind(i64::from(limit))
        .all(self.read_on(), |r| super::lease::Lease::decode(r))
        .await
    }

    async fn lease_reported(&self, tenant: &str, node: &str, reachable: bool) -> Result<()> {
        self.write(
            Sql::new("UPDATE node_leases SET reported_reachable = ? WHERE tenant_id = ? AND node_id = ?")
                .bind(i64::from(reachable))
                .bind(tenant)
                .bind(node),
        )
        .await?;
        Ok(())
    }

    async fn lease_get(&self, tenant: &str, node: &str) -> Result<Option<super::lease::Lease>> {
        let sql =
            Sql::new(format!("SELECT {} FROM node_leases WHERE tenant_id = ? AND node_id = ?", super::lease::LEASE_COLUMNS))
                .bind(tenant)
                .bind(node);
        self.point_first(sql, |r| super::lease::Lease::decode(r)).await
    }

    async fn lease_claim(&self, claim: &super::lease::LeaseClaim, expires_at_ms: u64) -> Result<()> {
        self.write(
            Sql::new(
                "INSERT INTO node_leases (tenant_id, node_id, expires_at_ms, holder, claimed_at_ms) VALUES (?, ?, ?, ?, ?) \
                 ON CONFLICT (tenant_id, node_id) DO UPDATE SET expires_at_ms = MAX(node_leases.expires_at_ms, excluded.expires_at_ms), \
                 holder = excluded.holder, claimed_at_ms = excluded.claimed_at_ms",
            )
            .bind(&claim.tenant)
            .bind(&claim.node)
            .bind(to_i64(expires_at_ms)?)
            .bind(&claim.holder)
            .bind(to_i64(claim.claimed_at_ms)?),
        )
        .await?;
        Ok(())
    }

    async fn lease_claims_since(&self, since_ms: u64, limit: u32) -> Result<Vec<super::lease::LeaseClaim>> {
        Sql::new(format!(
            "SELECT {} FROM node_leases WHERE claimed_at_ms >= ? ORDER BY claimed_at_ms LIMIT ?",
            super::lease::CLAIM_COLUMNS
        ))
        .bind(to_i64(since_ms)?)
        .bind(i64::from(limit))
        .all(self.read_on(), |r| super::lease::LeaseClaim::decode(r))
        .await
    }
}

#[cfg(test)]
mod plan_tests {
    use super::*;

    /// Regression: a tenant's read by position searched the tenant's
    /// whole chain and sorted it in a temporary B-tree. It must walk an index, in order.
    #[tokio::test]
    async fn a_tenants_read_by_position_uses_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap();
        crate::store::EventStore::migrate(&store).await.unwrap();
        for (one_tenant, index) in [(true, "events_by_tenant_position"), (false, "events_by_position")] {
            let mut q = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {}", read_after_sql(one_tenant))));
            if one_tenant {
                q = q.bind("ten_00000000000000000000000000");
            }
            let rows = q.bind(0i64).bind(0i64).bind(10i64).fetch_all(store.pool()).await.unwrap();
            let plan: Vec<String> = rows.iter().map(|r| r.get::<String, _>(3)).collect();
            let plan = plan.join(" | ");
            assert!(plan.contains(index), "one tenant: {one_tenant}: {plan}");
            assert!(!plan.contains("TEMP B-TREE"), "no sort: {plan}");
        }
    }

    /// A kind's last row is read off the end of the projections' primary key, not found by
    /// reading and sorting every row of the kind (the newest checkpoint, read for every tile).
    #[tokio::test]
    async fn a_kinds_last_row_is_read_by_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap();
        crate::store::EventStore::migrate(&store).await.unwrap();
        let q = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {ROW_LAST_SQL}")));
        let rows = q.bind("ten_0").bind("checkpoint").fetch_all(store.pool()).await.unwrap();
        let plan = rows.iter().map(|r| r.get::<String, _>(3)).collect::<Vec<_>>().join(" | ");
        assert!(plan.contains("USING INDEX sqlite_autoindex_projections_1") || plan.contains("PRIMARY KEY"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "no sort: {plan}");
    }

    /// `items_complete` and `work_release` update a batch in one statement: each of its rows
    /// must find its item by the primary key, never by a walk of the consumer's items, at two
    /// rows and at a whole chunk's. Regression: from some dozens of rows on, SQLite
    /// walked every pending item of the consumer and scanned the batch for each.
    #[tokio::test]
    async fn updating_a_batch_of_items_finds_each_by_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap();
        crate::store::EventStore::migrate(&store).await.unwrap();
        // Each row's item id `item<n>`, the rest of its columns as any.
        let statements = [
            (
                "u(t, i, state, next_at, err, upd, num)",
                ITEMS_COMPLETE_UPDATE,
                "'done', 1, NULL, 2, 1",
                ROWS_PER_STATEMENT_MAX / 7,
            ),
            ("r(t, i, num)", ITEMS_RELEASE_UPDATE, "1", ROWS_PER_STATEMENT_MAX / 3),
        ];
        for (cte, rest, columns, chunk) in statements {
            for rows in [2, chunk] {
                let values: Vec<String> =
                    (0..rows).map(|n| format!("('ten_00000000000000000000000000', 'item{n}', {columns})")).collect();
                let text = format!("EXPLAIN QUERY PLAN WITH {cte} AS (VALUES {}{rest}", values.join(", "));
                let q = sqlx::query(sqlx::AssertSqlSafe(text)).bind("webhooks").bind("owner");
                let plan: Vec<String> = q.fetch_all(store.pool()).await.unwrap().iter().map(|r| r.get::<String, _>(3)).collect();
                let plan = plan.join(" | ");
                assert!(
                    plan.contains(
                        "SEARCH work_items USING INDEX sqlite_autoindex_work_items_1 (tenant_id=? AND consumer=? AND id=?)"
                    ),
                    "{rows} rows: {plan}"
                );
                assert!(!plan.contains("SCAN work_items") && !plan.contains("work_items_due"), "{rows} rows: {plan}");
            }
        }
    }
}

#[cfg(test)]
mod inline_tests {
    use futures::FutureExt as _;

    use super::*;

    pub(super) fn row(id: &str) -> Row {
        Row { key: RowKey { tenant: "t".into(), kind: "k".into(), id: id.into() }, doc: serde_json::json!({ "id": id }) }
    }

    /// Opens a write transaction on `store`, checks that a second transaction and a
    /// one-statement write wait while it is open, and writes row `a` in it: the opening both
    /// stores' writer tests share (inline here, the pool's in `reader_tests`).
    pub(super) async fn first_writer_and_others_waiting(store: &SqliteStore) -> SqliteTransaction {
        let mut first = store.begin().await.unwrap();
        assert!(store.begin().now_or_never().is_none(), "a second transaction must wait");
        assert!(store.cursor_release("c", "o").now_or_never().is_none(), "a one-statement write must wait");
        first.projections_upsert(&[row("a")]).await.unwrap();
        first
    }

    async fn store(dir: &tempfile::TempDir) -> SqliteStore {
        let store = SqliteStore::open_for_one_thread(&dir.path().join("log.sqlite3")).await.unwrap();
        EventStore::migrate(&store).await.unwrap();
        store
    }

    /// On the simulator's one connection, a write transaction's rows are its own until it
    /// commits: a read outside it sees the last commit (it goes to the pool meanwhile), and so
    /// does everyone after a rollback or a drop.
    #[tokio::test]
    async fn a_read_outside_an_open_inline_transaction_sees_only_commits() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let mut tx = store.begin().await.unwrap();
        tx.projections_upsert(&[row("a")]).await.unwrap();
        assert!(store.row_get("t", "k", "a").await.unwrap().is_none(), "uncommitted, so not seen");
        tx.commit().await.unwrap();
        drop(tx);
        assert!(store.row_get("t", "k", "a").await.unwrap().is_some());

        let mut tx = store.begin().await.unwrap();
        tx.projections_upsert(&[row("b")]).await.unwrap();
        tx.rollback().await.unwrap();
        drop(tx);
        let mut tx = store.begin().await.unwrap();
        tx.projections_upsert(&[row("c")]).await.unwrap();
        drop(tx);
        let ids: Vec<String> = store.row_list("t", "k", None, 10).await.unwrap().into_iter().map(|r| r.key.id).collect();
        assert_eq!(ids, ["a"], "rolled back and dropped transactions leave nothing");
    }

    /// A second writer waits for the first (as for SQLite's write lock) instead of failing or
    /// starting a transaction inside the open one; a one-statement write waits too.
    #[tokio::test]
    async fn a_second_inline_writer_waits_for_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let mut first = first_writer_and_others_waiting(&store).await;
        first.commit().await.unwrap();
        drop(first);
        let mut second = store.begin().now_or_never().expect("free once the first ends").unwrap();
        second.projections_delete(&[row("a").key]).await.unwrap();
        second.commit().await.unwrap();
        drop(second);
        assert!(store.row_get("t", "k", "a").await.unwrap().is_none());
    }
}

#[cfg(test)]
mod reader_tests {
    use super::inline_tests::row;
    use super::*;

    async fn store(dir: &tempfile::TempDir) -> SqliteStore {
        let store = SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap();
        EventStore::migrate(&store).await.unwrap();
        store
    }

    fn id_of(r: &dyn Columns) -> Result<String> {
        r.text(2)
    }

    /// A server's writers queue on the store's lock, as the simulator's do: a second
    /// transaction and a one-statement write wait while one is open, and a transaction dropped
    /// unfinished frees the lock (its writes rolled back), so the next writer begins.
    #[tokio::test]
    async fn a_server_writer_waits_for_the_open_one_and_a_dropped_one_frees_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let first = super::inline_tests::first_writer_and_others_waiting(&store).await;
        drop(first);
        let begun = tokio::time::timeout(std::time::Duration::from_secs(30), store.begin());
        let mut second = begun.await.expect("the lock is free once the first is dropped").unwrap();
        second.projections_upsert(&[row("b")]).await.unwrap();
        second.commit().await.unwrap();
        drop(second);
        assert!(store.row_get("t", "k", "a").await.unwrap().is_none(), "the dropped transaction wrote nothing");
        assert!(store.row_get("t", "k", "b").await.unwrap().is_some());
        store.cursor_release("c", "o").await.unwrap();
    }

    /// A server's point reads run on its readers and see every commit made before them, through
    /// the pool or not; a transaction's rows only once it commits.
    #[tokio::test]
    async fn point_reads_see_each_commit_and_no_open_transaction() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let readers = store.readers.as_ref().expect("a server's store has readers");
        let select = || Sql::new("SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = 't' ORDER BY id");
        assert_eq!(readers.all(&select(), &id_of).unwrap().unwrap(), Vec::<String>::new());
        let mut tx = store.begin().await.unwrap();
        tx.projections_upsert(&[row("a")]).await.unwrap();
        assert!(store.row_get("t", "k", "a").await.unwrap().is_none(), "uncommitted, so not seen");
        tx.commit().await.unwrap();
        drop(tx);
        assert_eq!(readers.all(&select(), &id_of).unwrap().unwrap(), ["a"]);
        assert!(store.row_get("t", "k", "a").await.unwrap().is_some());
        assert_eq!(store.rows_get("t", "k", &["a", "b"]).await.unwrap().len(), 1);
    }

    /// A reader reads bytes as the pool does: text where bytes are asked for is its bytes
    /// (a row tampered with `canonical || X'00'`, which is text, is read and named by the
    /// audit, not a storage error), and a wrong type is refused by both.
    #[tokio::test]
    async fn a_reader_decodes_bytes_as_the_pool_does() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let readers = store.readers.as_ref().unwrap();
        let bytes = || Sql::new("SELECT X'6162' || X'00', X'0001', 7");
        let decode = |r: &dyn Columns| Ok((r.bytes(0)?, r.bytes(1)?, r.bytes(2).is_err()));
        let on_reader = readers.all(&bytes(), &decode).unwrap().unwrap();
        let on_pool = bytes().all(On::Pool(&store.pool), decode).await.unwrap();
        assert_eq!(on_reader, vec![(b"ab\0".to_vec(), vec![0, 1], true)]);
        assert_eq!(on_reader, on_pool);
    }

    /// A reader never waits: with every reader in use, or SQLite busy (another connection holds
    /// the file exclusively, as a migration or recovery may), it gives the read back to the
    /// pool, which waits as it always did.
    #[tokio::test]
    async fn a_point_read_goes_to_the_pool_when_no_reader_is_free_or_sqlite_is_busy() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let readers = store.readers.as_ref().unwrap();
        let select = || Sql::new("SELECT tenant_id, kind, id, doc FROM projections");
        let held: Vec<_> = readers.conns.iter().map(|c| c.lock().unwrap()).collect();
        assert!(readers.all(&select(), &id_of).is_none(), "every reader in use");
        assert!(store.row_get("t", "k", "a").await.unwrap().is_none(), "read on the pool instead");
        drop(held);
        assert!(readers.all(&select(), &id_of).is_some());

        // The file held exclusively by another connection (every connection of this store
        // closed first, as WAL mode shares the file while any is open): busy, answered at once.
        store.pool.close().await;
        drop(store);
        let path = dir.path().join("log.sqlite3");
        let other = rusqlite::Connection::open(&path).unwrap();
        other.execute_batch("PRAGMA locking_mode = EXCLUSIVE; BEGIN EXCLUSIVE;").unwrap();
        let readers = inline::Readers::open(&path, 1).unwrap();
        let timeout: i64 = readers.conns[0].lock().unwrap().query_row("PRAGMA busy_timeout", [], |r| r.get(0)).unwrap();
        assert_eq!(timeout, 0, "a reader never waits for a lock on a runtime thread");
        assert!(readers.all(&select(), &id_of).is_none(), "busy: the pool reads it");
        other.execute_batch("COMMIT").unwrap();
    }

    /// Another process's connection holding SQLite's write lock.
    fn other_process_writing(dir: &tempfile::TempDir) -> rusqlite::Connection {
        let other = rusqlite::Connection::open(dir.path().join("log.sqlite3")).unwrap();
        other
            .execute_batch("BEGIN IMMEDIATE; INSERT INTO projections (tenant_id, kind, id, doc) VALUES ('t', 'k', 'x', '{}')")
            .unwrap();
        other
    }

    /// While another process holds SQLite's write lock, a server's writer waits for it off the
    /// runtime's thread (this test's runtime has one thread, which goes on running other
    /// tasks meanwhile), and writes once the lock is free. Seen, not timed: the lock is let go
    /// only after ticks on this thread ran, so a writer that waited on the thread would hold it
    /// until SQLite's busy timeout ended its wait with BUSY, and the write would fail.
    #[tokio::test]
    async fn a_server_writer_waits_for_another_process_off_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let other = other_process_writing(&dir);
        let write = store.cursor_release("c", "o");
        tokio::pin!(write);
        let ticks = async {
            for _ in 0..5 {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        tokio::select! {
            written = &mut write => panic!("the write cannot end while another process holds the lock: {written:?}"),
            () = ticks => {}
        }
        // Five ticks ran on this thread while the writer waited; only now is the lock let go.
        other.execute_batch("COMMIT").unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), write)
            .await
            .expect("written once the lock is free")
            .expect("the writer waited for the lock, never gave up on it");
        assert!(store.row_get("t", "k", "x").await.unwrap().is_some());
    }

    /// A writer that stops waiting for another process's lock leaves nothing open behind it:
    /// the next transaction begins and commits its own rows only.
    #[tokio::test]
    async fn a_writer_that_stops_waiting_for_another_process_leaves_no_transaction_open() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let other = other_process_writing(&dir);
        let gave_up = tokio::time::timeout(std::time::Duration::from_millis(50), store.begin()).await;
        assert!(gave_up.is_err(), "the lock is another process's");
        other.execute_batch("COMMIT").unwrap();
        let begun = tokio::time::timeout(std::time::Duration::from_secs(30), store.begin());
        let mut tx = begun.await.expect("the writer lock is free again").unwrap();
        tx.projections_upsert(&[row("b")]).await.unwrap();
        tx.commit().await.unwrap();
        drop(tx);
        assert!(store.row_get("t", "k", "b").await.unwrap().is_some());
        assert!(store.row_get("t", "k", "x").await.unwrap().is_some());
    }
}
