//! The embedded backend: SQLite through `sqlx`, in WAL mode with `synchronous = FULL`, so an
//! acknowledged append survives a crash of the process or the machine.
//!
//! sqlx hands every statement to a worker thread, so the cost is per statement, not per row
//! (`notes/limits.md`): a batch is written with one multi-row statement per table. Append
//! transactions start with `BEGIN IMMEDIATE`, taking SQLite's write lock up front.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteRow, SqliteSynchronous};
use sqlx::{QueryBuilder, Row as _, Sqlite, SqlitePool};

use super::outbox::{
    ATTEMPT_COLUMNS, Attempt, CLAIM_ITEMS_MAX, Columns, Completion, ITEM_COLUMNS, NewWorkItem, OutboxStore, WorkItem, WorkState,
    count_states, outcome_columns,
};
use super::{
    CommitOutcome, EventStore, Head, IdempotencyRecord, PreRead, PreReadQuery, PreparedBatch, Projector, Row, RowKey,
    fold_projections, hash32, to_i64, to_u32, to_u64, touched_rows,
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

const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "log", include_str!("../../../schema/sqlite/0001_log.sql")),
    (2, "outbox", include_str!("../../../schema/sqlite/0002_outbox.sql")),
    (3, "outbox_prune", include_str!("../../../schema/sqlite/0003_outbox_prune.sql")),
];

const EVENT_COLUMNS: &str = "tenant_id, seq, id, stream, version, type, commit_no, commit_index, canonical, hash, sig, key_id";

pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    pub async fn open(path: &Path) -> Result<Self> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_millis(BUSY_TIMEOUT_MS));
        let pool = SqlitePoolOptions::new().max_connections(POOL_CONNECTIONS_MAX).connect_with(options).await?;
        Ok(Self { pool })
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

fn event_row(row: &SqliteRow) -> Result<EventRow> {
    Ok(EventRow {
        tenant: row.try_get(0)?,
        seq: to_u64(row.try_get(1)?)?,
        id: row.try_get(2)?,
        stream: row.try_get(3)?,
        version: to_u64(row.try_get(4)?)?,
        event_type: row.try_get(5)?,
        commit: to_u64(row.try_get(6)?)?,
        index: u32::try_from(row.try_get::<i64, _>(7)?).map_err(|_| Error::Storage("commit_index out of range".into()))?,
        canonical: row.try_get(8)?,
        hash: row.try_get(9)?,
        sig: row.try_get(10)?,
        key_id: row.try_get(11)?,
    })
}

fn projection_row(row: &SqliteRow) -> Result<Row> {
    let doc: String = row.try_get(3)?;
    Ok(Row {
        key: RowKey { tenant: row.try_get(0)?, kind: row.try_get(1)?, id: row.try_get(2)? },
        doc: serde_json::from_str(&doc).map_err(|e| Error::Storage(format!("projection doc: {e}")))?,
    })
}

async fn write_projections(
    tx: &mut sqlx::Transaction<'static, Sqlite>,
    projector: &dyn Projector,
    events: &[crate::event::StoredEvent],
) -> Result<()> {
    let keys = touched_rows(projector, events);
    let mut current = HashMap::new();
    for chunk in keys.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = QueryBuilder::<Sqlite>::new("WITH k(t, kd, i) AS (VALUES ");
        let mut list = q.separated(", ");
        for key in chunk {
            list.push("(");
            list.push_bind_unseparated(key.tenant.clone());
            list.push_unseparated(", ");
            list.push_bind_unseparated(key.kind.clone());
            list.push_unseparated(", ");
            list.push_bind_unseparated(key.id.clone());
            list.push_unseparated(")");
        }
        q.push(") SELECT p.tenant_id, p.kind, p.id, p.doc FROM k JOIN projections p ON p.tenant_id = k.t AND p.kind = k.kd AND p.id = k.i");
        for row in q.build().fetch_all(&mut **tx).await? {
            let row = projection_row(&row)?;
            current.insert(row.key, row.doc);
        }
    }
    let folded = fold_projections(projector, events, current)?;
    let (upserts, deletes): (Vec<_>, Vec<_>) = folded.into_iter().partition(|(_, doc)| doc.is_some());
    for chunk in upserts.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO projections (tenant_id, kind, id, doc) ");
        q.push_values(chunk, |mut b, (key, doc)| {
            b.push_bind(key.tenant.clone())
                .push_bind(key.kind.clone())
                .push_bind(key.id.clone())
                .push_bind(doc.as_ref().map(|d| d.to_string()).unwrap_or_default());
        });
        q.push(" ON CONFLICT (tenant_id, kind, id) DO UPDATE SET doc = excluded.doc");
        q.build().execute(&mut **tx).await?;
    }
    for (key, _) in deletes {
        sqlx::query("DELETE FROM projections WHERE tenant_id = ? AND kind = ? AND id = ?")
            .bind(key.tenant)
            .bind(key.kind)
            .bind(key.id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
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

async fn next_commit(tx: &mut sqlx::Transaction<'static, Sqlite>) -> Result<i64> {
    Ok(sqlx::query_scalar("UPDATE log_counter SET last_commit = last_commit + 1 WHERE id = 1 RETURNING last_commit")
        .fetch_one(&mut **tx)
        .await?)
}

async fn preread_on(conn: &mut sqlx::SqliteConnection, query: &PreReadQuery) -> Result<PreRead> {
    let mut out = PreRead::default();
    if !query.tenants.is_empty() {
        let mut q = QueryBuilder::<Sqlite>::new("SELECT tenant_id, seq, hash FROM chain_heads WHERE tenant_id IN (");
        let mut list = q.separated(", ");
        for t in &query.tenants {
            list.push_bind(t.to_string());
        }
        q.push(")");
        for row in q.build().fetch_all(&mut *conn).await? {
            let tenant: String = row.try_get(0)?;
            out.heads.insert(tenant.parse()?, Head { seq: to_u64(row.try_get(1)?)?, hash: hash32(row.try_get(2)?)? });
        }
    }
    for chunk in query.streams.chunks(ROWS_PER_STATEMENT_MAX) {
        // A correlated MAX per key walks the (tenant_id, stream, version) index; a row-value IN
        // list does not, and scans the table.
        let mut q = QueryBuilder::<Sqlite>::new("WITH k(t, s) AS (");
        push_pairs(&mut q, chunk.iter().map(|(t, s)| (t.to_string(), s.clone())));
        q.push(") SELECT k.t, k.s, (SELECT MAX(version) FROM events e WHERE e.tenant_id = k.t AND e.stream = k.s) FROM k");
        for row in q.build().fetch_all(&mut *conn).await? {
            let tenant: String = row.try_get(0)?;
            if let Some(version) = row.try_get::<Option<i64>, _>(2)? {
                out.stream_versions.insert((tenant.parse()?, row.try_get(1)?), to_u64(version)?);
            }
        }
    }
    for chunk in query.idempotency_keys.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = QueryBuilder::<Sqlite>::new("WITH k(t, s) AS (");
        push_pairs(&mut q, chunk.iter().map(|(t, k)| (t.to_string(), k.clone())));
        q.push(") SELECT i.tenant_id, i.key, i.request_hash, i.first_seq, i.last_seq FROM k JOIN idempotency i ON i.tenant_id = k.t AND i.key = k.s");
        for row in q.build().fetch_all(&mut *conn).await? {
            let tenant: String = row.try_get(0)?;
            out.idempotency.insert(
                (tenant.parse()?, row.try_get(1)?),
                IdempotencyRecord::from_columns(row.try_get(2)?, row.try_get(3)?, row.try_get(4)?)?,
            );
        }
    }
    Ok(out)
}

async fn write_batch(
    tx: &mut sqlx::Transaction<'static, Sqlite>,
    batch: &PreparedBatch,
    commit: i64,
    projector: &dyn Projector,
) -> Result<()> {
    for chunk in batch.events.chunks(ROWS_PER_STATEMENT_MAX) {
        let mut q = QueryBuilder::<Sqlite>::new(
            "INSERT INTO events (tenant_id, seq, id, stream, version, type, at_ms, commit_no, commit_index, canonical, hash, sig, key_id) ",
        );
        let mut failed = None;
        q.push_values(chunk, |mut b, e| {
            let env = &e.envelope;
            let (seq, version, at) = match (to_i64(env.seq), to_i64(env.version), to_i64(env.at_ms)) {
                (Ok(s), Ok(v), Ok(a)) => (s, v, a),
                _ => {
                    failed = Some(Error::Internal("event number out of range".into()));
                    (0, 0, 0)
                }
            };
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
        if let Some(e) = failed {
            return Err(e);
        }
        q.build().execute(&mut **tx).await?;
    }
    let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO chain_heads (tenant_id, seq, hash) ");
    let mut bad = false;
    q.push_values(&batch.heads_after, |mut b, (tenant, head)| {
        bad |= head.seq > i64::MAX as u64;
        b.push_bind(tenant.to_string()).push_bind(head.seq as i64).push_bind(head.hash.to_vec());
    });
    if bad {
        return Err(Error::Internal("sequence number out of range".into()));
    }
    q.push(" ON CONFLICT (tenant_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash");
    q.build().execute(&mut **tx).await?;
    if !batch.idempotency.is_empty() {
        let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO idempotency (tenant_id, key, request_hash, first_seq, last_seq) ");
        q.push_values(&batch.idempotency, |mut b, (tenant, key, record)| {
            b.push_bind(tenant.to_string())
                .push_bind(key.clone())
                .push_bind(record.request_hash.to_vec())
                .push_bind(record.first_seq as i64)
                .push_bind(record.last_seq as i64);
        });
        q.build().execute(&mut **tx).await?;
    }
    write_projections(tx, projector, &batch.events).await
}

#[async_trait]
impl EventStore for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn migrate(&self) -> Result<Vec<String>> {
        let mut applied = Vec::new();
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at_ms INTEGER NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        for (version, name, sql) in MIGRATIONS {
            let done: Option<i64> = sqlx::query_scalar("SELECT version FROM schema_migrations WHERE version = ?")
                .bind(version)
                .fetch_optional(&mut *tx)
                .await?;
            if done.is_some() {
                continue;
            }
            sqlx::raw_sql(*sql).execute(&mut *tx).await?;
            sqlx::query("INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES (?, ?, ?)")
                .bind(version)
                .bind(*name)
                .bind(to_i64(crate::clock::Clock::now_ms(&crate::clock::SystemClock))?)
                .execute(&mut *tx)
                .await?;
            applied.push(format!("{version:04}_{name}"));
        }
        tx.commit().await?;
        Ok(applied)
    }

    async fn check_schema(&self) -> Result<()> {
        let latest: Option<i64> =
            sqlx::query_scalar("SELECT MAX(version) FROM schema_migrations").fetch_one(&self.pool).await.unwrap_or(None);
        let wanted = MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
        match latest {
            Some(v) if v >= wanted => Ok(()),
            _ => Err(Error::Unavailable("the database schema is not up to date; hint: run better-compute migrate".into())),
        }
    }

    async fn preread(&self, query: &PreReadQuery) -> Result<PreRead> {
        let mut conn = self.pool.acquire().await?;
        preread_on(&mut conn, query).await
    }

    async fn commit(&self, batch: &PreparedBatch, projector: &dyn Projector) -> Result<CommitOutcome> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let commit = next_commit(&mut tx).await?;
        let heads = preread_on(
            &mut tx,
            &PreReadQuery { tenants: batch.heads_before.iter().map(|(t, _)| *t).collect(), ..Default::default() },
        )
        .await?
        .heads;
        for (tenant, before) in &batch.heads_before {
            if heads.get(tenant) != before.as_ref() {
                return Ok(CommitOutcome::Stale);
            }
        }
        write_batch(&mut tx, batch, commit, projector).await?;
        tx.commit().await?;
        Ok(CommitOutcome::Committed { commit: to_u64(commit)? })
    }

    async fn commit_locked(
        &self,
        query: &PreReadQuery,
        decide: &mut (dyn for<'p> FnMut(&'p PreRead) -> PreparedBatch + Send),
        projector: &dyn Projector,
    ) -> Result<(u64, PreparedBatch)> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let commit = next_commit(&mut tx).await?;
        let pre = preread_on(&mut tx, query).await?;
        let batch = decide(&pre);
        if batch.events.is_empty() {
            return Ok((0, batch));
        }
        write_batch(&mut tx, &batch, commit, projector).await?;
        tx.commit().await?;
        Ok((to_u64(commit)?, batch))
    }

    async fn read_chain_rows(&self, tenant: TenantId, from_seq: u64, limit: u32) -> Result<Vec<EventRow>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND seq >= ? ORDER BY seq LIMIT ?"
        )))
        .bind(tenant.to_string())
        .bind(to_i64(from_seq)?)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(event_row).collect()
    }

    async fn read_stream_rows(&self, tenant: TenantId, stream: &str, after_version: u64, limit: u32) -> Result<Vec<EventRow>> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND stream = ? AND version > ? ORDER BY version LIMIT ?"
        )))
        .bind(tenant.to_string())
        .bind(stream.to_owned())
        .bind(to_i64(after_version)?)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(event_row).collect()
    }

    async fn read_after_rows(&self, after: Position, tenant: Option<TenantId>, limit: u32) -> Result<Vec<EventRow>> {
        let tenant_filter = if tenant.is_some() { "AND tenant_id = ?" } else { "" };
        let mut q = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {EVENT_COLUMNS} FROM events WHERE (commit_no, commit_index) > (?, ?) {tenant_filter} \
             ORDER BY commit_no, commit_index LIMIT ?"
        )))
        .bind(to_i64(after.commit)?)
        .bind(i64::from(after.index));
        if let Some(t) = tenant {
            q = q.bind(t.to_string());
        }
        let rows = q.bind(i64::from(limit)).fetch_all(&self.pool).await?;
        rows.iter().map(event_row).collect()
    }

    async fn event_row(&self, tenant: TenantId, id: EventId) -> Result<Option<EventRow>> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {EVENT_COLUMNS} FROM events WHERE tenant_id = ? AND id = ?")))
            .bind(tenant.to_string())
            .bind(id.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(event_row).transpose()
    }

    async fn heads(&self) -> Result<Vec<(TenantId, Head)>> {
        let rows = sqlx::query("SELECT tenant_id, seq, hash FROM chain_heads ORDER BY tenant_id").fetch_all(&self.pool).await?;
        rows.iter()
            .map(|row| {
                let tenant: String = row.try_get(0)?;
                Ok((tenant.parse()?, Head { seq: to_u64(row.try_get(1)?)?, hash: hash32(row.try_get(2)?)? }))
            })
            .collect()
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

    async fn row_get(&self, tenant: &str, kind: &str, id: &str) -> Result<Option<Row>> {
        let row = sqlx::query("SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? AND id = ?")
            .bind(tenant.to_owned())
            .bind(kind.to_owned())
            .bind(id.to_owned())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(projection_row).transpose()
    }

    async fn row_find(&self, kind: &str, id: &str) -> Result<Option<Row>> {
        let row = sqlx::query("SELECT tenant_id, kind, id, doc FROM projections WHERE kind = ? AND id = ?")
            .bind(kind.to_owned())
            .bind(id.to_owned())
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(projection_row).transpose()
    }

    async fn row_list(&self, tenant: &str, kind: &str, after_id: Option<&str>, limit: u32) -> Result<Vec<Row>> {
        let rows = sqlx::query(
            "SELECT tenant_id, kind, id, doc FROM projections WHERE tenant_id = ? AND kind = ? AND id > ? ORDER BY id LIMIT ?",
        )
        .bind(tenant.to_owned())
        .bind(kind.to_owned())
        .bind(after_id.unwrap_or("").to_owned())
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(projection_row).collect()
    }

    async fn rows_all(&self) -> Result<Vec<Row>> {
        let rows = sqlx::query("SELECT tenant_id, kind, id, doc FROM projections ORDER BY tenant_id, kind, id")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(projection_row).collect()
    }

    async fn rows_replace_all(&self, rows: &[Row], at_commit: u64) -> Result<bool> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let now: i64 = sqlx::query_scalar("SELECT last_commit FROM log_counter WHERE id = 1").fetch_one(&mut *tx).await?;
        if to_u64(now)? != at_commit {
            return Ok(false);
        }
        sqlx::query("DELETE FROM projections").execute(&mut *tx).await?;
        for chunk in rows.chunks(ROWS_PER_STATEMENT_MAX) {
            let mut q = QueryBuilder::<Sqlite>::new("INSERT INTO projections (tenant_id, kind, id, doc) ");
            q.push_values(chunk, |mut b, row| {
                b.push_bind(row.key.tenant.clone())
                    .push_bind(row.key.kind.clone())
                    .push_bind(row.key.id.clone())
                    .push_bind(row.doc.to_string());
            });
            q.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(true)
    }
}

impl Columns for SqliteRow {
    fn text(&self, i: usize) -> Result<String> {
        Ok(self.try_get(i)?)
    }
    fn opt_text(&self, i: usize) -> Result<Option<String>> {
        Ok(self.try_get(i)?)
    }
    fn int(&self, i: usize) -> Result<i64> {
        Ok(self.try_get(i)?)
    }
    fn opt_int(&self, i: usize) -> Result<Option<i64>> {
        Ok(self.try_get(i)?)
    }
}

async fn insert_items(conn: &mut sqlx::SqliteConnection, consumer: &str, items: &[NewWorkItem], now_ms: u64) -> Result<()> {
    let now = to_i64(now_ms)?;
    for chunk in items.chunks(ROWS_PER_STATEMENT_MAX / 4) {
        let mut q = QueryBuilder::<Sqlite>::new(
            "INSERT OR IGNORE INTO work_items (tenant_id, consumer, id, subject, payload, state, attempts, round_attempts, \
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
        q.build().execute(&mut *conn).await?;
    }
    Ok(())
}

#[async_trait]
impl OutboxStore for SqliteStore {
    async fn cursor_lease(&self, consumer: &str, owner: &str, now_ms: u64, lease_ms: u64) -> Result<Option<Position>> {
        let now = to_i64(now_ms)?;
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query(
            "INSERT OR IGNORE INTO consumer_cursors (consumer, commit_no, commit_index, lease_owner, lease_until_ms, updated_at_ms) \
             VALUES (?, 0, 0, NULL, 0, ?)",
        )
        .bind(consumer)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query(
            "UPDATE consumer_cursors SET lease_owner = ?, lease_until_ms = ?, updated_at_ms = ? \
             WHERE consumer = ? AND (lease_owner IS NULL OR lease_owner = ? OR lease_until_ms < ?) \
             RETURNING commit_no, commit_index",
        )
        .bind(owner)
        .bind(to_i64(now_ms.saturating_add(lease_ms))?)
        .bind(now)
        .bind(consumer)
        .bind(owner)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        row.map(|row| Ok(Position { commit: to_u64(row.try_get(0)?)?, index: to_u32(row.try_get(1)?)? })).transpose()
    }

    async fn cursor_advance(
        &self,
        consumer: &str,
        owner: &str,
        from: Position,
        to: Position,
        items: &[NewWorkItem],
        now_ms: u64,
    ) -> Result<bool> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
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
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if moved != 1 {
            return Ok(false);
        }
        insert_items(&mut tx, consumer, items, now_ms).await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn work_insert(&self, consumer: &str, items: &[NewWorkItem], now_ms: u64) -> Result<()> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        insert_items(&mut tx, consumer, items, now_ms).await?;
        tx.commit().await?;
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

    async fn work_complete_many(&self, consumer: &str, owner: &str, done: &[Completion]) -> Result<Vec<bool>> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
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
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if moved == 1 {
                sqlx::query(
                    "INSERT OR REPLACE INTO work_attempts (tenant_id, consumer, item_id, number, at_ms, latency_ms, status, error, \
                     next_at_ms, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                )
                .bind(c.tenant.to_string())
                .bind(consumer)
                .bind(&c.id)
                .bind(i64::from(c.attempt.number))
                .bind(to_i64(c.attempt.at_ms)?)
                .bind(to_i64(c.attempt.latency_ms)?)
                .bind(c.attempt.status.map(i64::from))
                .bind(c.attempt.error.as_deref())
                .bind(c.attempt.next_at_ms.map(to_i64).transpose()?)
                .bind(owner)
                .execute(&mut *tx)
                .await?;
            }
            written.push(moved == 1);
        }
        tx.commit().await?;
        Ok(written)
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

    async fn work_prune(&self, consumer: &str, before_ms: u64, limit: u32) -> Result<u64> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let gone = sqlx::query(
            "DELETE FROM work_items WHERE rowid IN (SELECT rowid FROM work_items WHERE consumer = ? AND state = 'done' \
             AND updated_at_ms < ? LIMIT ?) RETURNING tenant_id, id",
        )
        .bind(consumer)
        .bind(to_i64(before_ms)?)
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
        let gone: Vec<(String, String)> = gone.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect::<Result<_>>()?;
        for chunk in gone.chunks(ROWS_PER_STATEMENT_MAX / 2) {
            let mut q = QueryBuilder::<Sqlite>::new("DELETE FROM work_attempts WHERE consumer = ");
            q.push_bind(consumer.to_owned());
            q.push(" AND (tenant_id, item_id) IN (VALUES ");
            let mut list = q.separated(", ");
            for (tenant, id) in chunk {
                list.push("(");
                list.push_bind_unseparated(tenant.clone());
                list.push_unseparated(", ");
                list.push_bind_unseparated(id.clone());
                list.push_unseparated(")");
            }
            q.push(")");
            q.build().execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(gone.len() as u64)
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

    async fn secret_put(&self, tenant: TenantId, id: &str, value: &str, now_ms: u64) -> Result<()> {
        sqlx::query("INSERT INTO secrets (tenant_id, id, value, created_at_ms) VALUES (?, ?, ?, ?)")
            .bind(tenant.to_string())
            .bind(id)
            .bind(value)
            .bind(to_i64(now_ms)?)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn secret_delete(&self, tenant: TenantId, id: &str) -> Result<()> {
        sqlx::query("DELETE FROM secrets WHERE tenant_id = ? AND id = ?")
            .bind(tenant.to_string())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn cursor_position(&self, consumer: &str) -> Result<Option<Position>> {
        let row = sqlx::query("SELECT commit_no, commit_index FROM consumer_cursors WHERE consumer = ?")
            .bind(consumer)
            .fetch_optional(&self.pool)
            .await?;
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

    async fn secret_get(&self, tenant: TenantId, id: &str) -> Result<Option<String>> {
        Ok(sqlx::query_scalar("SELECT value FROM secrets WHERE tenant_id = ? AND id = ?")
            .bind(tenant.to_string())
            .bind(id)
            .fetch_optional(&self.pool)
            .await?)
    }
}
