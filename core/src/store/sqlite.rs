//! The embedded backend: SQLite through `sqlx`, in WAL mode with `synchronous = FULL`, so an
//! acknowledged append survives a crash of the process or the machine.
//!
//! Only SQL text, parameter binding and row decoding live here; the algorithms (append commit,
//! locked commit, projection fold, migrations, the outbox's transactions) are in `engine.rs` and
//! `outbox.rs`, over [`SqliteTransaction`].
//!
//! sqlx hands every statement to a worker thread, so the cost is per statement, not per row
//! (`notes/limits.md`): a batch is written with one multi-row statement per table. Write
//! transactions start with `BEGIN IMMEDIATE`, taking SQLite's write lock up front; so SQLite's
//! "locks" (the commit counter's, the chain heads') are that one write lock.
//!
//! The simulator opens the store with [`SqliteStore::open_for_one_thread`]: the hot reads then
//! run the same SQL on a read-only connection on the caller's thread (the module `inline`).

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{QueryBuilder, Row as _, Sqlite, SqliteConnection, SqlitePool};

use super::Columns as _;
use super::engine::{Migration, Transaction};
use super::outbox::{
    ATTEMPT_COLUMNS, Attempt, CLAIM_ITEMS_MAX, Completion, ITEM_COLUMNS, NewWorkItem, OutboxStore, WorkItem, WorkState,
    count_states, outcome_columns,
};
use super::status::{PASS_COLUMNS, PassRecord, StatusStore};
use super::{
    EVENT_COLUMNS, EventStore, Head, LogStore, PreRead, PreReadQuery, PreparedBatch, Row, RowKey, RowStore, SecretStore, Store,
    WriteToken, columns_by_try_get, event_row_decode, head_decode, idempotency_decode, migrations_of, projection_row_decode,
    stream_version_decode, to_i64, to_u32, to_u64,
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

const MIGRATIONS: &[Migration] = migrations_of!("sqlite");

mod inline;

pub struct SqliteStore {
    pool: SqlitePool,
    data_keys: std::sync::RwLock<Option<std::sync::Arc<crate::sealing::DataKeys>>>,
    /// The hot reads' own connection, on the caller's thread ([`Self::open_for_one_thread`]).
    inline: Option<inline::InlineReads>,
}

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
        private_file(path, true)?;
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS));
        let pool = SqlitePoolOptions::new().max_connections(POOL_CONNECTIONS_MAX).connect_with(options).await?;
        for suffix in ["-wal", "-shm"] {
            let mut companion = path.as_os_str().to_owned();
            companion.push(suffix);
            private_file(Path::new(&companion), false)?;
        }
        Ok(Self { pool, data_keys: Default::default(), inline: None })
    }

    /// [`Self::open`], with the hot reads (projection rows, events, chain heads, secrets, cursor
    /// positions) made on the caller's thread through a read-only connection of their own
    /// rather than handed to a pool connection's worker thread (the module `inline`). For the
    /// simulator, whose one thread is the whole world; never for a server, whose runtime
    /// threads such a read would block.
    pub async fn open_for_one_thread(path: &Path) -> Result<Self> {
        let store = Self::open(path).await?;
        Ok(Self { inline: Some(inline::InlineReads::open(path)?), ..store })
    }

    /// `sqlite://PATH` or `sqlite:PATH`.
    pub async fn open_url(url: &str) -> Result<Self> {
        let path = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:")).unwrap_or(url);
        Self::open(Path::new(path)).await
    }

    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }
}

/// `VALUES (?, ?), (?, ?), …` for a CTE of pairs.
fn push_pairs(q: &mut QueryBuilder<Sqlite>, pairs: impl Iterator<Item = (String, String)>) {
    q.push("VALUES ");
    let mut list = q.separated(", ");
    for (a, b) in pairs {
        list.push("(");
        list.push_bind_unseparated(a);
        list.push_unseparated(", ");
        list.push_bind_unseparated(b);
        list.push_unseparated(")");
    }
}

/// `VALUES (?, ?, ?), …` for a CTE of projection row keys.
fn push_row_keys<'k>(q: &mut QueryBuilder<Sqlite>, keys: impl Iterator<Item = &'k RowKey>) {
    q.push("VALUES ");
    let mut list = q.separated(", ");
    for key in keys {
        list.push("(");
        list.push_bind_unseparated(key.tenant.clone());
        list.push_unseparated(", ");
        list.push_bind_unseparated(key.kind.clone());
        list.push_unseparated(", ");
        list.push_bind_unseparated(key.id.clone());
        list.push_unseparated(")");
    }
}

async fn heads_on(conn: &mut SqliteConnection, tenants: &[TenantId]) -> Result<HashMap<TenantId, Head>> {
    let mut heads = HashMap::new();
    for chunk in tenants.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = QueryBuilder::<Sqlite>::new("SELECT tenant_id, seq, hash FROM chain_heads WHERE tenant_id IN (");
        let mut list = q.separated(", ");
        for t in chunk {
            list.push_bind(t.to_string());
        }
        q.push(")");
        for row in q.build().fetch_all(&mut *conn).await? {
            let (tenant, head) = head_decode(&row)?;
            heads.insert(tenant, head);
        }
    }
    Ok(heads)
}

async fn preread_on(conn: &mut SqliteConnection, query: &PreReadQuery) -> Result<PreRead> {
    let mut out = PreRead { heads: heads_on(conn, &query.tenants).await?, ..Default::default() };
    for chunk in query.streams.chunks(ROWS_PER_STATEMENT_MAX) {
        // A correlated MAX per key walks the (tenant_id, stream, version) index; a row-value IN
        // list does not, and scans the table.
        let mut q = QueryBuilder::<Sqlite>::new("WITH k(t, s) AS (");
        push_pairs(&mut q, chunk.iter().map(|(t, s)| (t.to_string(), s.clone())));
        q.push(") SELECT k.t, k.s, (SELECT MAX(version) FROM events e WHERE e.tenant_id = k.t AND e.stream = k.s) FROM k");
        for row in q.build().fetch_all(&mut *conn).await? {
            if let Some((stream, version)) = stream_version_decode(&row)? {
                out.stream_versions.insert(stream, version);
            }
        }
    }
    for chunk in query.idempotency_keys.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = QueryBuilder::<Sqlite>::new("WITH k(t, s) AS (");
        push_pairs(&mut q, chunk.iter().map(|(t, k)| (t.to_string(), k.clone())));
        q.push(") SELECT i.tenant_id, i.key, i.request_hash, i.first_seq, i.last_seq FROM k JOIN idempotency i ON i.tenant_id = k.t AND i.key = k.s");
        for row in q.build().fetch_all(&mut *conn).await? {
            let (slot, record) = idempotency_decode(&row)?;
            out.idempotency.insert(slot, record);
        }
    }
    Ok(out)
}

/// One write transaction: `BEGIN IMMEDIATE` on a pooled connection. Dropped unfinished, sqlx
/// rolls it back.
pub struct SqliteTransaction {
    tx: Option<sqlx::Transaction<'static, Sqlite>>,
}

impl SqliteTransaction {
    fn conn(&mut self) -> Result<&mut SqliteConnection> {
        self.tx.as_deref_mut().ok_or_else(|| Error::Internal("the transaction has already ended".into()))
    }

    fn take(&mut self) -> Result<sqlx::Transaction<'static, Sqlite>> {
        self.tx.take().ok_or_else(|| Error::Internal("the transaction has already ended".into()))
    }
}

#[async_trait]
impl Transaction for SqliteTransaction {
    async fn commit(&mut self) -> Result<()> {
        Ok(self.take()?.commit().await?)
    }

    async fn rollback(&mut self) -> Result<()> {
        Ok(self.take()?.rollback().await?)
    }

    async fn counter_bump(&mut self) -> Result<u64> {
        let commit: i64 =
            sqlx::query_scalar("UPDATE log_counter SET last_commit = last_commit + 1 WHERE id = 1 RETURNING last_commit")
                .fetch_one(self.conn()?)
                .await?;
        to_u64(commit)
    }

    async fn counter_lock(&mut self) -> Result<u64> {
        // `BEGIN IMMEDIATE` already holds the write lock, so appenders wait.
        let commit: i64 = sqlx::query_scalar("SELECT last_commit FROM log_counter WHERE id = 1").fetch_one(self.conn()?).await?;
        to_u64(commit)
    }

    async fn heads_lock(&mut self, tenants: &[TenantId]) -> Result<HashMap<TenantId, Head>> {
        heads_on(self.conn()?, tenants).await
    }

    async fn preread(&mut self, query: &PreReadQuery) -> Result<PreRead> {
        preread_on(self.conn()?, query).await
    }

    async fn batch_insert(
        &mut self,
        batch: &PreparedBatch,
        commit: u64,
        touched: &[RowKey],
    ) -> Result<HashMap<RowKey, serde_json::Value>> {
        let commit = to_i64(commit)?;
        let conn = self.conn()?;
        for chunk in batch.events.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut columns = Vec::with_capacity(chunk.len());
            for e in chunk {
                let env = &e.envelope;
                columns.push((to_i64(env.seq)?, to_i64(env.version)?, to_i64(env.at_ms)?));
            }
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO events (tenant_id, seq, id, stream, version, type, at_ms, commit_no, commit_index, canonical, hash, sig, key_id) ",
            );
            q.push_values(chunk.iter().zip(columns), |mut b, (e, (seq, version, at))| {
                let env = &e.envelope;
                b.push_bind(env.tenant.to_string())
                    .push_bind(seq)
                    .push_bind(env.id.to_string())
                    .push_bind(env.stream.clone())
                    .push_bind(version)
                    .push_bind(env.event_type.clone())
                    .push_bind(at)
                    .push_bind(commit)
                    .push_bind(i64::from(e.position.index))
                    .push_bind(e.canonical.clone())
                    .push_bind(e.hash.to_vec())
                    .push_bind(e.sig.clone())
                    .push_bind(e.key_id.clone());
            });
            q.build().execute(&mut *conn).await?;
        }
        let heads: Vec<(String, i64, Vec<u8>)> = batch
            .heads_after
            .iter()
            .map(|(tenant, head)| Ok((tenant.to_string(), to_i64(head.seq)?, head.hash.to_vec())))
            .collect::<Result<_>>()?;
        if !heads.is_empty() {
            let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO chain_heads (tenant_id, seq, hash) ");
            q.push_values(heads, |mut b, (tenant, seq, hash)| {
                b.push_bind(tenant).push_bind(seq).push_bind(hash);
            });
            q.push(" ON CONFLICT (tenant_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash");
            q.build().execute(&mut *conn).await?;
        }
        let records: Vec<(String, String, Vec<u8>, i64, i64)> = batch
            .idempotency
            .iter()
            .map(|(tenant, key, r)| {
                Ok((tenant.to_string(), key.clone(), r.request_hash.to_vec(), to_i64(r.first_seq)?, to_i64(r.last_seq)?))
            })
            .collect::<Result<_>>()?;
        for chunk in records.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q =
                QueryBuilder::<Sqlite>::new("INSERT INTO idempotency (tenant_id, key, request_hash, first_seq, last_seq) ");
            q.push_values(chunk, |mut b, (tenant, key, hash, first, last)| {
                b.push_bind(tenant.clone()).push_bind(key.clone()).push_bind(hash.clone()).push_bind(*first).push_bind(*last);
            });
            q.build().execute(&mut *conn).await?;
        }
        let mut current = HashMap::new();
        for chunk in touched.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q = QueryBuilder::<Sqlite>::new("WITH k(t, kd, i) AS (");
            push_row_keys(&mut q, chunk.iter());
            q.push(") SELECT p.tenant_id, p.kind, p.id, p.doc FROM k JOIN projections p ON p.tenant_id = k.t AND p.kind = k.kd AND p.id = k.i");
            for row in q.build().fetch_all(&mut *conn).await? {
                let row = projection_row_decode(&row)?;
                current.insert(row.key, row.doc);
            }
        }
        Ok(current)
    }

    async fn projections_upsert(&mut self, rows: &[Row]) -> Result<()> {
        let conn = self.conn()?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO projections (tenant_id, kind, id, doc) ");
            q.push_values(chunk, |mut b, row| {
                b.push_bind(row.key.tenant.clone())
                    .push_bind(row.key.kind.clone())
                    .push_bind(row.key.id.clone())
                    .push_bind(row.doc.to_string());
            });
            q.push(" ON CONFLICT (tenant_id, kind, id) DO UPDATE SET doc = excluded.doc");
            q.build().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn projections_delete(&mut self, keys: &[RowKey]) -> Result<()> {
        // One statement per key walks the primary key; a row-value IN list would scan.
        let conn = self.conn()?;
        for key in keys {
            sqlx::query("DELETE FROM projections WHERE tenant_id = ? AND kind = ? AND id = ?")
                .bind(key.tenant.clone())
                .bind(key.kind.clone())
                .bind(key.id.clone())
                .execute(&mut *conn)
                .await?;
        }
        Ok(())
    }

    async fn projections_clear(&mut self) -> Result<()> {
        sqlx::query("DELETE FROM projections").execute(self.conn()?).await?;
        Ok(())
    }

    async fn migrations_lock(&mut self) -> Result<()> {
        // `BEGIN IMMEDIATE` holds the write lock: concurrent runners queue behind it.
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)",
        )
        .execute(self.conn()?)
        .await?;
        Ok(())
    }

    async fn migration_applied(&mut self, version: u64) -> Result<bool> {
        let done: Option<i64> = sqlx::query_scalar("SELECT version FROM schema_migrations WHERE version = ?")
            .bind(to_i64(version)?)
            .fetch_optional(self.conn()?)
            .await?;
        Ok(done.is_some())
    }

    async fn migration_apply(&mut self, migration: &Migration, at_ms: u64) -> Result<()> {
        let conn = self.conn()?;
        sqlx::raw_sql(migration.sql).execute(&mut *conn).await?;
        sqlx::query("INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES (?, ?, ?)")
            .bind(to_i64(migration.version)?)
            .bind(migration.name)
            .bind(to_i64(at_ms)?)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn cursor_create(&mut self, consumer: &str, now_ms: u64) -> Result<()> {
        sqlx::query(
            "INSERT INTO consumer_cursors (consumer, commit_no, commit_index, lease_owner, lease_until_ms, updated_at_ms) \
             VALUES (?, 0, 0, NULL, 0, ?) ON CONFLICT (consumer) DO NOTHING",
        )
        .bind(consumer)
        .bind(to_i64(now_ms)?)
        .execute(self.conn()?)
        .await?;
        Ok(())
    }

    async fn cursor_take(&mut self, consumer: &str, owner: &str, now_ms: u64, until_ms: u64) -> Result<Option<Position>> {
        let now = to_i64(now_ms)?;
        let row = sqlx::query(
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
        .fetch_optional(self.conn()?)
        .await?;
        row.map(|row| Ok(Position { commit: to_u64(row.try_get(0)?)?, index: to_u32(row.try_get(1)?)? })).transpose()
    }

    async fn cursor_move(&mut self, consumer: &str, owner: &str, from: Position, to: Position, now_ms: u64) -> Result<bool> {
        let moved = sqlx::query(
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
        .execute(self.conn()?)
        .await?
        .rows_affected();
        Ok(moved == 1)
    }

    async fn items_insert(&mut self, consumer: &str, items: &[NewWorkItem], now_ms: u64) -> Result<()> {
        let now = to_i64(now_ms)?;
        let conn = self.conn()?;
        for chunk in items.chunks(ROWS_PER_STATEMENT_MAX / 4) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO work_items (tenant_id, consumer, id, subject, payload, state, attempts, round_attempts, \
                 next_at_ms, lease_owner, lease_until_ms, last_error, created_at_ms, updated_at_ms) ",
            );
            q.push_values(chunk, |mut b, item| {
                b.push_bind(item.tenant.to_string())
                    .push_bind(consumer.to_owned())
                    .push_bind(item.id.clone())
                    .push_bind(item.subject.clone())
                    .push_bind(item.payload.to_string())
                    .push_bind("pending")
                    .push_bind(0i64)
                    .push_bind(0i64)
                    .push_bind(now)
                    .push_bind(None::<String>)
                    .push_bind(0i64)
                    .push_bind(None::<String>)
                    .push_bind(now)
                    .push_bind(now);
            });
            q.push(" ON CONFLICT (tenant_id, consumer, id) DO NOTHING");
            q.build().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn items_complete(&mut self, consumer: &str, owner: &str, done: &[Completion]) -> Result<Vec<bool>> {
        // One statement per item: SQLite has no UPDATE … FROM over a list of bound rows that
        // beats a prepared statement run in the same transaction.
        let conn = self.conn()?;
        let mut written = Vec::with_capacity(done.len());
        for c in done {
            let (state, next_at) = outcome_columns(&c.outcome, c.attempt.at_ms);
            let moved = sqlx::query(
                "UPDATE work_items SET state = ?, next_at_ms = ?, lease_owner = NULL, lease_until_ms = 0, last_error = ?, \
                 updated_at_ms = ? WHERE tenant_id = ? AND consumer = ? AND id = ? AND lease_owner = ? AND attempts = ? \
                 AND state = 'pending'",
            )
            .bind(state.as_str())
            .bind(to_i64(next_at)?)
            .bind(c.attempt.error.as_deref())
            .bind(to_i64(c.attempt.at_ms.saturating_add(c.attempt.latency_ms))?)
            .bind(c.tenant.to_string())
            .bind(consumer)
            .bind(&c.id)
            .bind(owner)
            .bind(i64::from(c.attempt.number))
            .execute(&mut *conn)
            .await?
            .rows_affected();
            written.push(moved == 1);
        }
        Ok(written)
    }

    async fn attempts_insert(&mut self, consumer: &str, owner: &str, done: &[&Completion]) -> Result<()> {
        let mut rows = Vec::with_capacity(done.len());
        for c in done {
            let a = &c.attempt;
            rows.push((c, to_i64(a.at_ms)?, to_i64(a.latency_ms)?, a.next_at_ms.map(to_i64).transpose()?));
        }
        let conn = self.conn()?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT_MAX / 10) {
            let mut q = QueryBuilder::<Sqlite>::new(
                "INSERT INTO work_attempts (tenant_id, consumer, item_id, number, at_ms, latency_ms, status, error, next_at_ms, owner) ",
            );
            q.push_values(chunk, |mut b, (c, at, latency, next_at)| {
                b.push_bind(c.tenant.to_string())
                    .push_bind(consumer.to_owned())
                    .push_bind(c.id.clone())
                    .push_bind(i64::from(c.attempt.number))
                    .push_bind(*at)
                    .push_bind(*latency)
                    .push_bind(c.attempt.status.map(i64::from))
                    .push_bind(c.attempt.error.clone())
                    .push_bind(*next_at)
                    .push_bind(owner.to_owned());
            });
            q.push(" ON CONFLICT (tenant_id, consumer, item_id, number) DO NOTHING");
            q.build().execute(&mut *conn).await?;
        }
        Ok(())
    }

    async fn items_prune(&mut self, consumer: &str, before_ms: u64, limit: u32) -> Result<Vec<(String, String)>> {
        let gone = sqlx::query(
            "DELETE FROM work_items WHERE rowid IN (SELECT rowid FROM work_items WHERE consumer = ? AND state = 'done' \
             AND updated_at_ms < ? LIMIT ?) RETURNING tenant_id, id",
        )
        .bind(consumer)
        .bind(to_i64(before_ms)?)
        .bind(i64::from(limit))
        .fetch_all(self.conn()?)
        .await?;
        gone.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
    }

    async fn attempts_delete(&mut self, consumer: &str, items: &[(String, String)]) -> Result<()> {
        let conn = self.conn()?;
        for chunk in items.chunks(ROWS_PER_STATEMENT_MAX / 2) {
            let mut q = QueryBuilder::<Sqlite>::new("DELETE FROM work_attempts WHERE consumer = ");
            q.push_bind(consumer.to_owned());
            q.push(" AND (tenant_id, item_id) IN (");
            push_pairs(&mut q, chunk.iter().cloned());
            q.push(")");
            q.build().execute(&mut *conn).await?;
        }
        Ok(())
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn transaction(&self, _: WriteToken) -> Result<Box<dyn Transaction + '_>> {
        Ok(Box::new(SqliteTransaction { tx: Some(self.pool.begin_with("BEGIN IMMEDIATE").await?) }))
    }
}

#[async_trait]
impl EventStore for SqliteStore {
    fn migrations(&self) -> &'static [Migration] {
        MIGRATIONS
    }

    async fn schema_version(&self) -> Result<Option<u64>> {
        // No migrations table yet reads as no migration applied.
        let latest: Option<i64> =
            sqlx::query_scalar("SELECT MAX(version) FROM schema_migrations").fetch_one(&self.pool).await.unwrap_or(None);
        latest.map(to_u64).transpose()
    }
}

#[async_trait]
impl LogStore for SqliteStore {
    async fn preread(&self, query: &PreReadQuery) -> Result<PreRead> {
        let mut conn = self.pool.acquire().await?;
        preread_on(&mut conn, query).await
    }

    async fn read_chain_rows(&self, tenant: TenantId, from_seq: u64, limit: u32) -> Result<Vec<EventRow>> {
        let sql = format!("SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND seq >= ? ORDER BY seq LIMIT ?");
        if let Some(inline) = &self.inline {
            let params = rusqlite::params![tenant.to_string(), to_i64(from_seq)?, i64::from(limit)];
            return inline.all(&sql, params, |r| event_row_decode(r));
        }
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant.to_string())
            .bind(to_i64(from_seq)?)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(event_row_decode).collect()
    }

    async fn read_stream_rows(&self, tenant: TenantId, stream: &str, after_version: u64, limit: u32) -> Result<Vec<EventRow>> {
        let sql = format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND stream = ? AND version > ? ORDER BY version LIMIT ?"
        );
        if let Some(inline) = &self.inline {
            let params = rusqlite::params![tenant.to_string(), stream, to_i64(after_version)?, i64::from(limit)];
            return inline.all(&sql, params, |r| event_row_decode(r));
        }
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant.to_string())
            .bind(stream.to_owned())
            .bind(to_i64(after_version)?)
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(event_row_decode).collect()
    }

    async fn read_after_rows(&self, after: Position, tenant: Option<TenantId>, limit: u32) -> Result<Vec<EventRow>> {
        if let Some(inline) = &self.inline {
            let sql = read_after_sql(tenant.is_some());
            let (commit, index, limit) = (to_i64(after.commit)?, i64::from(after.index), i64::from(limit));
            return match tenant {
                Some(t) => inline.all(&sql, rusqlite::params![t.to_string(), commit, index, limit], |r| event_row_decode(r)),
                None => inline.all(&sql, rusqlite::params![commit, index, limit], |r| event_row_decode(r)),
            };
        }
        let mut q = sqlx::query(sqlx::AssertSqlSafe(read_after_sql(tenant.is_some())));
        if let Some(t) = tenant {
            q = q.bind(t.to_string());
        }
        let q = q.bind(to_i64(after.commit)?).bind(i64::from(after.index));
        let rows = q.bind(i64::from(limit)).fetch_all(&self.pool).await?;
        rows.iter().map(event_row_decode).collect()
    }

    async fn read_after_touches(&self, after: Position, limit: u32) -> Result<Vec<super::StreamTouch>> {
        let sql = format!(
            "SELECT {} FROM events WHERE (commit_no, commit_index) > (?, ?) ORDER BY commit_no, commit_index LIMIT ?",
            super::TOUCH_COLUMNS
        );
        if let Some(inline) = &self.inline {
            let params = rusqlite::params![to_i64(after.commit)?, i64::from(after.index), i64::from(limit)];
            return inline.all(&sql, params, |r| super::touch_decode(r));
        }
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(to_i64(after.commit)?)
            .bind(i64::from(after.index))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(super::touch_decode).collect()
    }

    async fn event_row(&self, tenant: TenantId, id: EventId) -> Result<Option<EventRow>> {
        let sql = format!("SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND id = ?");
        if let Some(inline) = &self.inline {
            return inline.first(&sql, rusqlite::params![tenant.to_string(), id.to_string()], |r| event_row_decode(r));
        }
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant.to_string())
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(event_row_decode).transpose()
    }

    async fn heads(&self) -> Result<Vec<(TenantId, Head)>> {
        const SQL: &str = "SELECT tenant_id, seq, hash FROM chain_heads ORDER BY tenant_id";
        if let Some(inline) = &self.inline {
            return inline.all(SQL, [], |r| head_decode(r));
        }
        let rows = sqlx::query(SQL).fetch_all(&self.pool).await?;
        rows.iter().map(head_decode).collect()
    }

    async fn tenants(&self) -> Result<Vec<TenantId>> {
        let rows: Vec<String> = sqlx::query_scalar(
            "SELECT tenant_id FROM chain_heads UNION SELECT DISTINCT tenant_id FROM events \
             UNION SELECT DISTINCT tenant_id FROM projections ORDER BY 1",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|t| t.parse()).collect()
    }

    async fn last_commit(&self) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT last_commit FROM log_counter WHERE id = 1").fetch_one(&self.pool).await?;
        to_u64(n)
    }

    async fn signing_key_put(&self, key_id: &str, public: &[u8; 32], at_ms: u64) -> Result<()> {
        sqlx::query(
            "INSERT INTO signing_keys (key_id, public_key, created_at_ms) VALUES (?, ?, ?) ON CONFLICT (key_id) DO NOTHING",
        )
        .bind(key_id.to_owned())
        .bind(public.to_vec())
        .bind(to_i64(at_ms)?)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn signing_keys(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let rows =
            sqlx::query("SELECT key_id, public_key FROM signing_keys ORDER BY created_at_ms").fetch_all(&self.pool).await?;
        rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
    }
}

#[async_trait]
impl RowStore for SqliteStore {
    async fn row_get(&self, tenant: &str, kind: &str, id: &str) -> Result<Option<Row>> {
        const SQL: &str = "SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? AND id = ?";
        if let Some(inline) = &self.inline {
            return inline.first(SQL, rusqlite::params![tenant, kind, id], |r| projection_row_decode(r));
        }
        let row =
            sqlx::query(SQL).bind(tenant.to_owned()).bind(kind.to_owned()).bind(id.to_owned()).fetch_optional(&self.pool).await?;
        row.as_ref().map(projection_row_decode).transpose()
    }

    async fn row_find(&self, kind: &str, id: &str) -> Result<Option<Row>> {
        const SQL: &str = "SELECT tenant_id, kind, id, doc FROM projections WHERE kind = ? AND id = ?";
        if let Some(inline) = &self.inline {
            return inline.first(SQL, rusqlite::params![kind, id], |r| projection_row_decode(r));
        }
        let row = sqlx::query(SQL).bind(kind.to_owned()).bind(id.to_owned()).fetch_optional(&self.pool).await?;
        row.as_ref().map(projection_row_decode).transpose()
    }

    async fn row_list(&self, tenant: &str, kind: &str, after_id: Option<&str>, limit: u32) -> Result<Vec<Row>> {
        const SQL: &str =
            "SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? AND id > ? ORDER BY id LIMIT ?";
        if let Some(inline) = &self.inline {
            let params = rusqlite::params![tenant, kind, after_id.unwrap_or(""), i64::from(limit)];
            return inline.all(SQL, params, |r| projection_row_decode(r));
        }
        let rows = sqlx::query(SQL)
            .bind(tenant.to_owned())
            .bind(kind.to_owned())
            .bind(after_id.unwrap_or("").to_owned())
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(projection_row_decode).collect()
    }

    async fn rows_all(&self) -> Result<Vec<Row>> {
        let rows = sqlx::query("SELECT tenant_id, kind, id, doc FROM projections ORDER BY tenant_id, kind, id")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(projection_row_decode).collect()
    }
}

columns_by_try_get!(SqliteRow);

#[async_trait]
impl OutboxStore for SqliteStore {
    async fn cursor_position(&self, consumer: &str) -> Result<Option<Position>> {
        const SQL: &str = "SELECT commit_no, commit_index FROM consumer_cursors WHERE consumer = ?";
        if let Some(inline) = &self.inline {
            return inline.first(SQL, [consumer], |r| Ok(Position { commit: to_u64(r.int(0)?)?, index: to_u32(r.int(1)?)? }));
        }
        let row = sqlx::query(SQL).bind(consumer).fetch_optional(&self.pool).await?;
        row.map(|row| Ok(Position { commit: to_u64(row.try_get(0)?)?, index: to_u32(row.try_get(1)?)? })).transpose()
    }

    async fn cursor_release(&self, consumer: &str, owner: &str) -> Result<()> {
        sqlx::query("UPDATE consumer_cursors SET lease_owner = NULL, lease_until_ms = 0 WHERE consumer = ? AND lease_owner = ?")
            .bind(consumer)
            .bind(owner)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn work_claim(&self, consumer: &str, owner: &str, now_ms: u64, lease_ms: u64, limit: u32) -> Result<Vec<WorkItem>> {
        let now = to_i64(now_ms)?;
        // One statement: SQLite has one writer, so nothing else can claim between the select
        // and the update.
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE work_items SET lease_owner = ?, lease_until_ms = ?, attempts = attempts + 1, \
             round_attempts = round_attempts + 1, updated_at_ms = ? \
             WHERE rowid IN (SELECT rowid FROM work_items WHERE consumer = ? AND state = 'pending' \
             AND next_at_ms <= ? AND lease_until_ms <= ? ORDER BY next_at_ms LIMIT ?) \
             RETURNING {ITEM_COLUMNS}"
        )))
        .bind(owner)
        .bind(to_i64(now_ms.saturating_add(lease_ms))?)
        .bind(now)
        .bind(consumer)
        .bind(now)
        .bind(now)
        .bind(i64::from(limit.min(CLAIM_ITEMS_MAX)))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(WorkItem::decode).collect()
    }

    async fn work_get(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Option<WorkItem>> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ITEM_COLUMNS} FROM work_items WHERE tenant_id = ? AND consumer = ? AND id = ?"
        )))
        .bind(tenant.to_string())
        .bind(consumer)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(WorkItem::decode).transpose()
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
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ITEM_COLUMNS} FROM work_items WHERE tenant_id = ? AND consumer = ? AND subject = ? \
             AND (? IS NULL OR state = ?) AND (? IS NULL OR id < ?) ORDER BY id DESC LIMIT ?"
        )))
        .bind(tenant.to_string())
        .bind(consumer)
        .bind(subject)
        .bind(state.map(WorkState::as_str))
        .bind(state.map(WorkState::as_str))
        .bind(before_id)
        .bind(before_id)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(WorkItem::decode).collect()
    }

    async fn work_requeue(&self, consumer: &str, tenant: TenantId, id: &str, now_ms: u64) -> Result<bool> {
        let now = to_i64(now_ms)?;
        let moved = sqlx::query(
            "UPDATE work_items SET state = 'pending', next_at_ms = ?, round_attempts = 0, lease_owner = NULL, \
             lease_until_ms = 0, updated_at_ms = ? WHERE tenant_id = ? AND consumer = ? AND id = ? AND state <> 'pending'",
        )
        .bind(now)
        .bind(now)
        .bind(tenant.to_string())
        .bind(consumer)
        .bind(id)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(moved == 1)
    }

    async fn attempts(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Vec<Attempt>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {ATTEMPT_COLUMNS} FROM work_attempts WHERE tenant_id = ? AND consumer = ? AND item_id = ? ORDER BY number"
        )))
        .bind(tenant.to_string())
        .bind(consumer)
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Attempt::decode).collect()
    }

    async fn work_counts(&self, consumer: &str) -> Result<(u64, u64, u64)> {
        let rows = sqlx::query("SELECT state, COUNT(*) FROM work_items WHERE consumer = ? GROUP BY state")
            .bind(consumer)
            .fetch_all(&self.pool)
            .await?;
        let rows: Vec<(String, u64)> =
            rows.iter().map(|row| Ok((row.try_get(0)?, to_u64(row.try_get(1)?)?))).collect::<Result<_>>()?;
        Ok(count_states(rows))
    }
}

#[async_trait]
impl SecretStore for SqliteStore {
    async fn secret_put_raw(&self, tenant: TenantId, id: &str, stored: &str, now_ms: u64) -> Result<()> {
        sqlx::query("INSERT INTO secrets (tenant_id, id, value, created_at_ms) VALUES (?, ?, ?, ?)")
            .bind(tenant.to_string())
            .bind(id)
            .bind(stored)
            .bind(to_i64(now_ms)?)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn secret_get_raw(&self, tenant: TenantId, id: &str) -> Result<Option<String>> {
        const SQL: &str = "SELECT value FROM secrets WHERE tenant_id = ? AND id = ?";
        if let Some(inline) = &self.inline {
            return inline.first(SQL, rusqlite::params![tenant.to_string(), id], |r| r.text(0));
        }
        Ok(sqlx::query_scalar(SQL).bind(tenant.to_string()).bind(id).fetch_optional(&self.pool).await?)
    }

    async fn secret_delete(&self, tenant: TenantId, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM secrets WHERE tenant_id = ? AND id = ?")
            .bind(tenant.to_string())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn secrets_count(&self, tenant: TenantId) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM secrets WHERE tenant_id = ?")
            .bind(tenant.to_string())
            .fetch_one(&self.pool)
            .await?;
        Ok(n as u64)
    }

    async fn secrets_page_raw(&self, after: Option<(String, String)>, limit: u32) -> Result<Vec<(String, String, String)>> {
        let (tenant, id) = after.unwrap_or_default();
        let rows =
            sqlx::query("SELECT tenant_id, id, value FROM secrets WHERE (tenant_id, id) > (?, ?) ORDER BY tenant_id, id LIMIT ?")
                .bind(tenant)
                .bind(id)
                .bind(i64::from(limit))
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))).collect()
    }

    async fn secret_replace_raw(&self, tenant: &str, id: &str, old: &str, new: &str) -> Result<bool> {
        let done = sqlx::query("UPDATE secrets SET value = ? WHERE tenant_id = ? AND id = ? AND value = ?")
            .bind(new)
            .bind(tenant)
            .bind(id)
            .bind(old)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
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
        sqlx::query(
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
        .bind(to_i64(pass.passes)?)
        .execute(&self.pool)
        .await?;
        sqlx::query("DELETE FROM reconciler_passes WHERE started_at_ms < ?")
            .bind(to_i64(forget_before_ms)?)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn passes(&self) -> Result<Vec<PassRecord>> {
        let rows =
            sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {PASS_COLUMNS} FROM reconciler_passes ORDER BY name, instance")))
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(PassRecord::decode).collect()
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
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        // One statement per chunk: a gateway renews every node it holds a session to.
        for chunk in leases.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO node_leases (tenant_id, node_id, expires_at_ms) ");
            let expires = chunk.iter().map(|(_, _, at)| to_i64(*at)).collect::<Result<Vec<_>>>()?;
            q.push_values(chunk.iter().zip(expires), |mut b, ((tenant, node, _), at)| {
                b.push_bind(tenant.clone()).push_bind(node.clone()).push_bind(at);
            });
            q.push(
                " ON CONFLICT (tenant_id, node_id) DO UPDATE SET expires_at_ms = MAX(node_leases.expires_at_ms, excluded.expires_at_ms)",
            );
            q.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn lease_changes(&self, now_ms: u64, limit: u32) -> Result<Vec<super::lease::Lease>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {} FROM node_leases WHERE (expires_at_ms > ?) <> (reported_reachable = 1) LIMIT ?",
            super::lease::LEASE_COLUMNS
        )))
        .bind(to_i64(now_ms)?)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(super::lease::Lease::decode).collect()
    }

    async fn lease_reported(&self, tenant: &str, node: &str, reachable: bool) -> Result<()> {
        sqlx::query("UPDATE node_leases SET reported_reachable = ? WHERE tenant_id = ? AND node_id = ?")
            .bind(i64::from(reachable))
            .bind(tenant)
            .bind(node)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn lease_get(&self, tenant: &str, node: &str) -> Result<Option<super::lease::Lease>> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {} FROM node_leases WHERE tenant_id = ? AND node_id = ?",
            super::lease::LEASE_COLUMNS
        )))
        .bind(tenant)
        .bind(node)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(super::lease::Lease::decode).transpose()
    }
}

#[cfg(test)]
mod plan_tests {
    use super::*;

    /// Regression (hardening, finding 3): a tenant's read by position searched the tenant's
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
}
