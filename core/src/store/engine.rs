//! The store's algorithms, written once: the append commit, the contended (locked) commit, the
//! projection fold inside the append transaction, the projection swap of a rebuild, the
//! migration runner and the schema check; the outbox's multi-statement transactions sit beside
//! the outbox in `outbox.rs`, over the same trait.
//!
//! Each backend supplies a [`Transaction`]: one open write transaction and the few statements
//! these algorithms need (bump the commit counter, read and lock the chain heads, insert a
//! batch, write projection rows, record a migration, …). A backend keeps only its SQL text, its
//! parameter binding and its row decoding; what to do in which order, and when to give up and
//! roll back, is decided here.
//!
//! Nothing outside `bc_core::store` can open a transaction: [`super::Store::transaction`]
//! takes a [`super::WriteToken`], which only this module tree can make, and the append
//! functions here are called by `log.rs` alone. So every event reaches the database through the
//! `Log`: chained, signed, and committed with its projections.

use std::collections::HashMap;

use async_trait::async_trait;

use super::outbox::{Completion, NewWorkItem};
use super::{
    CommitOutcome, Head, PreRead, PreReadQuery, PreparedBatch, ProjectedRows, Projector, Row, RowKey, fold_projections,
    touched_rows,
};
use crate::error::{Error, Result};
use crate::event::Position;
use crate::id::TenantId;

/// One schema migration, applied once, in `version` order, in one transaction with the others.
#[derive(Clone, Copy, Debug)]
pub struct Migration {
    pub version: u64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// One open write transaction of a backend. Every method is one statement (or one pipelined
/// group of statements); none commits except [`Transaction::commit`]. A transaction dropped
/// without `commit` or `rollback` (a cancelled caller) is rolled back by the backend.
#[async_trait]
pub trait Transaction: Send {
    async fn commit(&mut self) -> Result<()>;
    async fn rollback(&mut self) -> Result<()>;

    // The log.
    /// Bumps the one-row commit counter and returns the new commit number. Every append
    /// transaction does this first: the counter's row lock serialises appenders, so commit
    /// numbers are gap-free and in commit order.
    async fn counter_bump(&mut self) -> Result<u64>;
    /// Reads the commit counter, locking it until the transaction ends (appenders wait).
    async fn counter_lock(&mut self) -> Result<u64>;
    /// The chain heads of `tenants`, locked until the transaction ends.
    async fn heads_lock(&mut self, tenants: &[TenantId]) -> Result<HashMap<TenantId, Head>>;
    /// What the appender reads before deciding, read inside this transaction.
    async fn preread(&mut self, query: &PreReadQuery) -> Result<PreRead>;
    /// Inserts the batch's events (at `commit`), moves its chain heads, inserts its idempotency
    /// records, and returns the current documents of the `touched` projection rows. A backend
    /// may pipeline these; none depends on another.
    async fn batch_insert(
        &mut self,
        batch: &PreparedBatch,
        commit: u64,
        touched: &[RowKey],
    ) -> Result<HashMap<RowKey, serde_json::Value>>;

    // Projection rows.
    /// Inserts or replaces each row's document.
    async fn projections_upsert(&mut self, rows: &[Row]) -> Result<()>;
    async fn projections_delete(&mut self, keys: &[RowKey]) -> Result<()>;
    /// Deletes every projection row (a rebuild swaps in a new set).
    async fn projections_clear(&mut self) -> Result<()>;

    // The schema.
    /// Creates the migrations table if need be and locks it, so concurrent runners queue.
    async fn migrations_lock(&mut self) -> Result<()>;
    async fn migration_applied(&mut self, version: u64) -> Result<bool>;
    /// Runs the migration's SQL and records it as applied at `at_ms`.
    async fn migration_apply(&mut self, migration: &Migration, at_ms: u64) -> Result<()>;

    // The outbox (see `outbox.rs`).
    /// Creates `consumer`'s cursor at the start of the log, unless it exists.
    async fn cursor_create(&mut self, consumer: &str, now_ms: u64) -> Result<()>;
    /// Gives `consumer`'s fan-out lease to `owner` until `until_ms`, if no other owner's lease
    /// runs at `now_ms`; returns the cursor if it did.
    async fn cursor_take(&mut self, consumer: &str, owner: &str, now_ms: u64, until_ms: u64) -> Result<Option<Position>>;
    /// Moves the cursor from `from` to `to` if `owner` holds the lease at `from`.
    async fn cursor_move(&mut self, consumer: &str, owner: &str, from: Position, to: Position, now_ms: u64) -> Result<bool>;
    /// Inserts pending items, skipping ids that exist. With `claimed_by` (an owner and the end
    /// of its lease) they are inserted already claimed, their first attempt counted as
    /// `work_claim` counts it, and the `(tenant, id)` of each row inserted is returned (none
    /// without).
    async fn items_insert(
        &mut self,
        consumer: &str,
        items: &[NewWorkItem],
        now_ms: u64,
        claimed_by: Option<(&str, u64)>,
    ) -> Result<Vec<(String, String)>>;
    /// Moves each completed item on where `owner` still holds its lease for that attempt; one
    /// flag per completion.
    async fn items_complete(&mut self, consumer: &str, owner: &str, done: &[Completion]) -> Result<Vec<bool>>;
    /// Records attempts. An attempt already recorded (same item and number) is kept as it was:
    /// the history is append-only.
    async fn attempts_insert(&mut self, consumer: &str, owner: &str, done: &[&Completion]) -> Result<()>;
    /// Deletes up to `limit` done items last changed before `before_ms`; returns their
    /// `(tenant, id)`.
    async fn items_prune(&mut self, consumer: &str, before_ms: u64, limit: u32) -> Result<Vec<(String, String)>>;
    async fn attempts_delete(&mut self, consumer: &str, items: &[(String, String)]) -> Result<()>;
}

/// How a transaction's work ended: keep it or throw it away, with the answer either way.
pub(super) enum End<T> {
    Commit(T),
    Rollback(T),
}

/// Commits or rolls back as `outcome` says; an error rolls back (best effort: a transaction the
/// backend cannot roll back is dropped, which ends it) and is returned.
pub(super) async fn finish<T>(tx: &mut (dyn Transaction + '_), outcome: Result<End<T>>) -> Result<T> {
    match outcome {
        Ok(End::Commit(value)) => {
            tx.commit().await?;
            Ok(value)
        }
        Ok(End::Rollback(value)) => {
            tx.rollback().await?;
            Ok(value)
        }
        Err(e) => {
            if let Err(rollback) = tx.rollback().await {
                tracing::debug!(error = %rollback, "rolling back after a failed transaction");
            }
            Err(e)
        }
    }
}

/// Writes a prepared batch unless a chain head it was built on moved (then nothing is written:
/// the appender decides the batch again). `fail`: every write is made, then the transaction is
/// rolled back instead of committed and the answer is UNAVAILABLE ([`super::COMMIT_FAILED`]):
/// the simulator's failing commit (`Log::commits_fail`); never set elsewhere.
pub(super) async fn commit(
    tx: &mut (dyn Transaction + '_),
    batch: &PreparedBatch,
    projector: &dyn Projector,
    fail: bool,
) -> Result<CommitOutcome> {
    let outcome = async {
        let commit = tx.counter_bump().await?;
        let tenants: Vec<TenantId> = batch.heads_before.iter().map(|(tenant, _)| *tenant).collect();
        let heads = tx.heads_lock(&tenants).await?;
        if batch.heads_before.iter().any(|(tenant, before)| heads.get(tenant) != before.as_ref()) {
            return Ok(End::Rollback(CommitOutcome::Stale));
        }
        let rows = batch_write(tx, batch, commit, projector).await?;
        if fail {
            return Err(Error::Unavailable(super::COMMIT_FAILED.into()));
        }
        Ok(End::Commit(CommitOutcome::Committed { commit, rows }))
    }
    .await;
    finish(tx, outcome).await
}

/// The contended path: reads the state and decides inside the transaction, under the counter
/// lock, so the batch cannot go stale. Returns the commit number (0 when `decide` accepted
/// nothing and nothing was written), the batch as written and the rows its projection left.
pub(super) async fn commit_locked(
    tx: &mut (dyn Transaction + '_),
    query: &PreReadQuery,
    decide: &mut (dyn for<'p> FnMut(&'p PreRead) -> PreparedBatch + Send),
    projector: &dyn Projector,
) -> Result<(u64, PreparedBatch, ProjectedRows)> {
    let outcome = async {
        let commit = tx.counter_bump().await?;
        let pre = tx.preread(query).await?;
        let batch = decide(&pre);
        if batch.events.is_empty() {
            return Ok(End::Rollback((0, batch, ProjectedRows::new())));
        }
        let rows = batch_write(tx, &batch, commit, projector).await?;
        Ok(End::Commit((commit, batch, rows)))
    }
    .await;
    finish(tx, outcome).await
}

/// The batch's rows, then its projection updates, in the caller's transaction. Returns the
/// rows as the projection left them.
async fn batch_write(
    tx: &mut (dyn Transaction + '_),
    batch: &PreparedBatch,
    commit: u64,
    projector: &dyn Projector,
) -> Result<ProjectedRows> {
    let touched = touched_rows(projector, &batch.events);
    let current = tx.batch_insert(batch, commit, &touched).await?;
    let mut upserts = Vec::new();
    let mut deletes = Vec::new();
    for (key, doc) in fold_projections(projector, &batch.events, current)? {
        match doc {
            Some(doc) => upserts.push(Row { key, doc }),
            None => deletes.push(key),
        }
    }
    if !upserts.is_empty() {
        tx.projections_upsert(&upserts).await?;
    }
    if !deletes.is_empty() {
        tx.projections_delete(&deletes).await?;
    }
    // The rows handed back as they were written: no copy of a document.
    let deleted = deletes.into_iter().map(|key| (key, None));
    Ok(upserts.into_iter().map(|row| (row.key, Some(row.doc))).chain(deleted).collect())
}

/// Replaces every projection row if the log is still at `at_commit` (holding the counter lock,
/// so no append lands in between); false if it moved.
pub(super) async fn rows_replace_all(tx: &mut (dyn Transaction + '_), rows: &[Row], at_commit: u64) -> Result<bool> {
    let outcome = async {
        if tx.counter_lock().await? != at_commit {
            return Ok(End::Rollback(false));
        }
        tx.projections_clear().await?;
        if !rows.is_empty() {
            tx.projections_upsert(rows).await?;
        }
        Ok(End::Commit(true))
    }
    .await;
    finish(tx, outcome).await
}

/// Applies every migration not yet applied, in one transaction, recording `now_ms`; returns the
/// ones applied (`0002_outbox`).
pub(super) async fn migrate(tx: &mut (dyn Transaction + '_), migrations: &[Migration], now_ms: u64) -> Result<Vec<String>> {
    let outcome = async {
        tx.migrations_lock().await?;
        let mut applied = Vec::new();
        for migration in migrations {
            if tx.migration_applied(migration.version).await? {
                continue;
            }
            tx.migration_apply(migration, now_ms).await?;
            applied.push(format!("{:04}_{}", migration.version, migration.name));
        }
        Ok(End::Commit(applied))
    }
    .await;
    finish(tx, outcome).await
}

/// Whether a database whose newest applied migration is `latest` (`None`: none, or no
/// migrations table) is recent enough for `migrations`.
pub(super) fn schema_check(latest: Option<u64>, migrations: &[Migration]) -> Result<()> {
    let wanted = migrations.last().map(|m| m.version).unwrap_or(0);
    match latest {
        Some(version) if version >= wanted => Ok(()),
        _ => Err(Error::Unavailable("the database schema is not up to date; hint: run better-compute migrate".into())),
    }
}

#[cfg(test)]
mod tests {
    //! The algorithms' order and their ends (commit, rollback) over a fake transaction that
    //! records what it is asked: no database.
    use super::*;
    use crate::event::{Envelope, GENESIS_PREV, StoredEvent};
    use crate::id::EventId;

    const MIGRATIONS: &[Migration] =
        &[Migration { version: 1, name: "log", sql: "" }, Migration { version: 2, name: "outbox", sql: "" }];

    /// Answers from fixed state and logs each call by name; `fail` names the call that errs.
    #[derive(Default)]
    struct Recording {
        calls: Vec<String>,
        heads: HashMap<TenantId, Head>,
        counter: u64,
        applied: Vec<u64>,
        fail: Option<&'static str>,
    }

    impl Recording {
        fn call(&mut self, name: &'static str) -> Result<()> {
            self.calls.push(name.to_owned());
            match self.fail {
                Some(failing) if failing == name => Err(Error::Storage(format!("{name} failed"))),
                _ => Ok(()),
            }
        }
    }

    fn no_outbox() -> Error {
        Error::Internal("the engine's log algorithms never touch the outbox".into())
    }

    #[async_trait]
    impl Transaction for Recording {
        async fn commit(&mut self) -> Result<()> {
            self.call("commit")
        }
        async fn rollback(&mut self) -> Result<()> {
            self.call("rollback")
        }
        async fn counter_bump(&mut self) -> Result<u64> {
            self.call("counter_bump")?;
            self.counter += 1;
            Ok(self.counter)
        }
        async fn counter_lock(&mut self) -> Result<u64> {
            self.call("counter_lock")?;
            Ok(self.counter)
        }
        async fn heads_lock(&mut self, _: &[TenantId]) -> Result<HashMap<TenantId, Head>> {
            self.call("heads_lock")?;
            Ok(self.heads.clone())
        }
        async fn preread(&mut self, _: &PreReadQuery) -> Result<PreRead> {
            self.call("preread")?;
            Ok(PreRead { heads: self.heads.clone(), ..Default::default() })
        }
        async fn batch_insert(
            &mut self,
            _: &PreparedBatch,
            _: u64,
            touched: &[RowKey],
        ) -> Result<HashMap<RowKey, serde_json::Value>> {
            self.call("batch_insert")?;
            Ok(touched.iter().map(|k| (k.clone(), serde_json::json!({ "n": 1 }))).collect())
        }
        async fn projections_upsert(&mut self, _: &[Row]) -> Result<()> {
            self.call("projections_upsert")
        }
        async fn projections_delete(&mut self, _: &[RowKey]) -> Result<()> {
            self.call("projections_delete")
        }
        async fn projections_clear(&mut self) -> Result<()> {
            self.call("projections_clear")
        }
        async fn migrations_lock(&mut self) -> Result<()> {
            self.call("migrations_lock")
        }
        async fn migration_applied(&mut self, version: u64) -> Result<bool> {
            self.call("migration_applied")?;
            Ok(self.applied.contains(&version))
        }
        async fn migration_apply(&mut self, _: &Migration, _: u64) -> Result<()> {
            self.call("migration_apply")
        }
        async fn cursor_create(&mut self, _: &str, _: u64) -> Result<()> {
            Err(no_outbox())
        }
        async fn cursor_take(&mut self, _: &str, _: &str, _: u64, _: u64) -> Result<Option<Position>> {
            Err(no_outbox())
        }
        async fn cursor_move(&mut self, _: &str, _: &str, _: Position, _: Position, _: u64) -> Result<bool> {
            Err(no_outbox())
        }
        async fn items_insert(
            &mut self,
            _: &str,
            _: &[NewWorkItem],
            _: u64,
            _: Option<(&str, u64)>,
        ) -> Result<Vec<(String, String)>> {
            Err(no_outbox())
        }
        async fn items_complete(&mut self, _: &str, _: &str, _: &[Completion]) -> Result<Vec<bool>> {
            Err(no_outbox())
        }
        async fn attempts_insert(&mut self, _: &str, _: &str, _: &[&Completion]) -> Result<()> {
            Err(no_outbox())
        }
        async fn items_prune(&mut self, _: &str, _: u64, _: u32) -> Result<Vec<(String, String)>> {
            Err(no_outbox())
        }
        async fn attempts_delete(&mut self, _: &str, _: &[(String, String)]) -> Result<()> {
            Err(no_outbox())
        }
    }

    /// One row per stream; `*.deleted` deletes it.
    struct PerStream;

    impl Projector for PerStream {
        fn touches(&self, event: &StoredEvent, out: &mut Vec<RowKey>) {
            out.push(RowKey { tenant: event.envelope.tenant.to_string(), kind: "k".into(), id: event.envelope.stream.clone() });
        }
        fn apply(&self, _: &RowKey, _: Option<serde_json::Value>, event: &StoredEvent) -> Result<Option<serde_json::Value>> {
            Ok((!event.envelope.event_type.ends_with(".deleted")).then(|| serde_json::json!({ "seq": event.envelope.seq })))
        }
    }

    fn batch(tenant: TenantId, before: Option<Head>, types: &[&str]) -> PreparedBatch {
        let events: Vec<StoredEvent> = types
            .iter()
            .enumerate()
            .map(|(i, event_type)| StoredEvent {
                envelope: Envelope {
                    tenant,
                    seq: i as u64 + 1,
                    id: EventId::from_ulid(ulid::Ulid::from_parts(1, i as u128)),
                    stream: format!("s/{i}"),
                    version: 1,
                    event_type: (*event_type).into(),
                    at_ms: 1,
                    actor: "test".into(),
                    idempotency_key: None,
                    causation: None,
                    correlation: None,
                    payload: ciborium::Value::Null,
                    prev: GENESIS_PREV,
                },
                canonical: vec![],
                hash: [0; 32],
                sig: vec![],
                key_id: "k".into(),
                position: Position { commit: 0, index: i as u32 },
            })
            .collect();
        let after = Head { seq: events.len() as u64, hash: [1; 32] };
        PreparedBatch { heads_before: vec![(tenant, before)], heads_after: vec![(tenant, after)], events, idempotency: vec![] }
    }

    fn calls(tx: &Recording) -> Vec<&str> {
        tx.calls.iter().map(String::as_str).collect()
    }

    #[tokio::test]
    async fn a_commit_bumps_the_counter_first_and_writes_rows_then_projections() {
        let tenant = TenantId::ROOT;
        let mut tx = Recording::default();
        let outcome = commit(&mut tx, &batch(tenant, None, &["a.made", "b.deleted"]), &PerStream, false).await.unwrap();
        assert!(matches!(outcome, CommitOutcome::Committed { commit: 1, .. }), "{outcome:?}");
        assert_eq!(
            calls(&tx),
            ["counter_bump", "heads_lock", "batch_insert", "projections_upsert", "projections_delete", "commit"]
        );
    }

    #[tokio::test]
    async fn a_moved_head_rolls_back_before_writing() {
        let tenant = TenantId::ROOT;
        let mut tx = Recording { heads: [(tenant, Head { seq: 9, hash: [9; 32] })].into(), ..Default::default() };
        let outcome = commit(&mut tx, &batch(tenant, None, &["a.made"]), &PerStream, false).await.unwrap();
        assert_eq!(outcome, CommitOutcome::Stale);
        assert_eq!(calls(&tx), ["counter_bump", "heads_lock", "rollback"]);
    }

    #[tokio::test]
    async fn a_failed_statement_rolls_back_and_reports_its_error() {
        let mut tx = Recording { fail: Some("batch_insert"), ..Default::default() };
        let err = commit(&mut tx, &batch(TenantId::ROOT, None, &["a.made"]), &PerStream, false).await.unwrap_err();
        assert!(err.to_string().contains("batch_insert failed"), "{err}");
        assert_eq!(calls(&tx), ["counter_bump", "heads_lock", "batch_insert", "rollback"]);
        // A failing commit is the error too (nothing to roll back after it).
        let mut tx = Recording { fail: Some("commit"), ..Default::default() };
        assert!(commit(&mut tx, &batch(TenantId::ROOT, None, &["a.made"]), &PerStream, false).await.is_err());
    }

    #[tokio::test]
    async fn an_injected_commit_failure_writes_everything_then_rolls_back_unavailable() {
        let mut tx = Recording::default();
        let err = commit(&mut tx, &batch(TenantId::ROOT, None, &["a.made"]), &PerStream, true).await.unwrap_err();
        assert_eq!(err.code(), crate::ErrorCode::Unavailable, "{err}");
        assert!(err.to_string().contains(super::super::COMMIT_FAILED), "{err}");
        assert_eq!(calls(&tx), ["counter_bump", "heads_lock", "batch_insert", "projections_upsert", "rollback"]);
    }

    #[tokio::test]
    async fn the_locked_path_decides_inside_and_writes_nothing_when_nothing_is_accepted() {
        let tenant = TenantId::ROOT;
        let mut tx = Recording::default();
        let mut nothing = |_: &PreRead| PreparedBatch::default();
        let (commit_no, written, rows) =
            commit_locked(&mut tx, &PreReadQuery::default(), &mut nothing, &PerStream).await.unwrap();
        assert_eq!((commit_no, written.events.len(), rows.len()), (0, 0, 0));
        assert_eq!(calls(&tx), ["counter_bump", "preread", "rollback"]);
        let mut tx = Recording::default();
        let mut one = |_: &PreRead| batch(tenant, None, &["a.made"]);
        let (commit_no, written, rows) = commit_locked(&mut tx, &PreReadQuery::default(), &mut one, &PerStream).await.unwrap();
        assert_eq!((commit_no, written.events.len()), (1, 1));
        assert_eq!(rows.len(), 1, "the rows the projection left come back with the commit: {rows:?}");
        assert_eq!(calls(&tx), ["counter_bump", "preread", "batch_insert", "projections_upsert", "commit"]);
    }

    #[tokio::test]
    async fn a_swap_happens_only_at_the_commit_it_was_folded_at() {
        let mut tx = Recording { counter: 5, ..Default::default() };
        assert!(!rows_replace_all(&mut tx, &[], 4).await.unwrap());
        assert_eq!(calls(&tx), ["counter_lock", "rollback"]);
        let mut tx = Recording { counter: 5, ..Default::default() };
        assert!(rows_replace_all(&mut tx, &[], 5).await.unwrap());
        assert_eq!(calls(&tx), ["counter_lock", "projections_clear", "commit"]);
    }

    #[tokio::test]
    async fn migrations_apply_once_in_order_under_the_lock() {
        let mut tx = Recording { applied: vec![1], ..Default::default() };
        assert_eq!(migrate(&mut tx, MIGRATIONS, 7).await.unwrap(), ["0002_outbox"]);
        assert_eq!(calls(&tx), ["migrations_lock", "migration_applied", "migration_applied", "migration_apply", "commit"]);
    }

    #[test]
    fn schema_check_wants_the_newest_migration() {
        assert!(schema_check(None, MIGRATIONS).is_err());
        assert!(schema_check(Some(1), MIGRATIONS).is_err());
        schema_check(Some(2), MIGRATIONS).unwrap();
        schema_check(Some(3), MIGRATIONS).unwrap();
        schema_check(None, &[]).unwrap_err();
        schema_check(Some(0), &[]).unwrap();
    }
}
