//! The outbox consumers' storage: cursors, work items and attempts.
//!
//! A consumer (`webhooks`, …) reads the log by outbox position from its durable **cursor** and
//! turns events into **work items** (one delivery of one event to one receiver). Work items are
//! claimed with a **lease**: a process that dies holding one loses it when the lease runs out,
//! and another process claims the item again. So delivery is at least once, and handlers must be
//! idempotent.
//!
//! - Fan-out: one process at a time holds a consumer's cursor lease. Advancing the cursor and
//!   inserting the items it produced is one transaction, and item ids are deterministic, so a
//!   fan-out repeated after a crash inserts nothing twice.
//! - Claiming: PostgreSQL claims with `FOR UPDATE SKIP LOCKED`, so processes never wait on each
//!   other's rows; SQLite has one writer, and a claim is one `UPDATE … RETURNING`.
//! - Completing: only the lease holder may complete an item (`lease_owner` is checked), and the
//!   attempt is recorded in the same transaction as the item's new state.
//!
//! - Written once: the transactions above (and pruning) are [`OutboxStore`]'s provided
//!   methods over the backend's transaction; the backends keep their SQL.
//!
//! None of this is the log: cursors, items and attempts are operational state. Deleting them
//! loses delivery history, never an event.

use async_trait::async_trait;

use super::engine::{End, finish};
use super::{Columns, Store, WriteToken, to_u32, to_u64};
use crate::error::{Error, Result};
use crate::event::Position;
use crate::id::TenantId;

/// Items one claim returns at most.
pub const CLAIM_ITEMS_MAX: u32 = 256;
/// Longest error text kept per attempt.
pub const ATTEMPT_ERROR_CHARS_MAX: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkState {
    /// Waiting for `next_at_ms`, or leased and in flight.
    Pending,
    Done,
    /// Gave up after the last attempt; an operator may retry it.
    Dead,
}

impl WorkState {
    /// Every state, in the order a work item goes through them.
    pub const ALL: [Self; 3] = [Self::Pending, Self::Done, Self::Dead];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Done => "done",
            Self::Dead => "dead",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// How many of the items a fan-out writes are inserted already claimed, and until when
/// ([`OutboxStore::cursor_advance_claiming`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    pub count: usize,
    pub lease_until_ms: u64,
}

/// A work item to create.
#[derive(Clone, Debug, PartialEq)]
pub struct NewWorkItem {
    pub tenant: TenantId,
    /// Unique per consumer and tenant, and the same however often the fan-out runs.
    pub id: String,
    /// What it is for (a webhook id), for listing.
    pub subject: String,
    pub payload: serde_json::Value,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WorkItem {
    pub tenant: TenantId,
    pub consumer: String,
    pub id: String,
    pub subject: String,
    pub payload: serde_json::Value,
    pub state: WorkState,
    /// Every attempt ever made (numbering the attempt records).
    pub attempts: u32,
    /// Attempts since the item was last (re)queued, for the back-off.
    pub round_attempts: u32,
    pub next_at_ms: u64,
    /// Until when the current claim holds it (0: not claimed).
    pub lease_until_ms: u64,
    pub last_error: Option<String>,
    pub created_at_ms: u64,
    /// When it was made or last attempted (a claim leaves it: see [`OutboxStore::work_claim`]).
    pub updated_at_ms: u64,
}

impl WorkItem {
    /// When the current claim was taken, by a claimer whose leases last `lease_ms`.
    pub fn claimed_at_ms(&self, lease_ms: u64) -> u64 {
        self.lease_until_ms.saturating_sub(lease_ms)
    }
}

/// How an attempt ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Done,
    /// Try again at `next_at_ms`.
    Retry {
        next_at_ms: u64,
    },
    Dead,
}

/// One attempt, as recorded.
#[derive(Clone, Debug, PartialEq)]
pub struct Attempt {
    pub number: u32,
    pub at_ms: u64,
    pub latency_ms: u64,
    /// The receiver's HTTP status, if it answered.
    pub status: Option<u16>,
    pub error: Option<String>,
    /// Set when the attempt scheduled another.
    pub next_at_ms: Option<u64>,
    pub owner: String,
}

/// One finished attempt, to record.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub tenant: TenantId,
    pub id: String,
    pub attempt: Attempt,
    pub outcome: Outcome,
}

/// The outbox's storage. The methods that take several statements (leases, cursor moves,
/// inserts, completions, pruning) are written here once over the backend's
/// transaction (`engine::Transaction`); a backend writes the one-statement reads and
/// the claim (whose locking is its own: `FOR UPDATE SKIP LOCKED` on PostgreSQL).
#[async_trait]
pub trait OutboxStore: Store {
    /// Takes (or renews) `consumer`'s fan-out lease for `owner`; returns the cursor, or `None`
    /// while another owner's lease runs. A new consumer starts at the beginning of the log.
    async fn cursor_lease(&self, consumer: &str, owner: &str, now_ms: u64, lease_ms: u64) -> Result<Option<Position>> {
        let mut tx = self.transaction(WriteToken(())).await?;
        let outcome = async {
            tx.cursor_create(consumer, now_ms).await?;
            Ok(End::Commit(tx.cursor_take(consumer, owner, now_ms, now_ms.saturating_add(lease_ms)).await?))
        }
        .await;
        finish(&mut *tx, outcome).await
    }
    /// The cursor, read without taking the lease (to see whether there is anything to do).
    async fn cursor_position(&self, consumer: &str) -> Result<Option<Position>>;
    /// Gives the fan-out lease up (on a clean stop), so another process need not wait it out.
    async fn cursor_release(&self, consumer: &str, owner: &str) -> Result<()>;
    /// Inserts `items` (skipping ids that exist) and moves the cursor from `from` to `to`, in
    /// one transaction, if `owner` still holds the lease at `from`. False: the lease was lost
    /// and nothing was written.
    async fn cursor_advance(
        &self,
        consumer: &str,
        owner: &str,
        from: Position,
        to: Position,
        items: &[NewWorkItem],
        now_ms: u64,
    ) -> Result<bool> {
        let claim = Claim { count: 0, lease_until_ms: 0 };
        Ok(self.cursor_advance_claiming(consumer, owner, from, to, items, claim, now_ms).await?.is_some())
    }
    /// [`OutboxStore::cursor_advance`], with the first `claim.count` of `items` inserted
    /// already claimed by `owner` (their first attempt counted, as [`OutboxStore::work_claim`]
    /// counts it): the fan-out hands them to its own process's work loop, which then needs no
    /// claim of its own for them. Returns those of them that were inserted (an id
    /// that existed is skipped, and so is not the caller's), or `None` when the lease was lost
    /// and nothing was written.
    #[allow(clippy::too_many_arguments)]
    async fn cursor_advance_claiming(
        &self,
        consumer: &str,
        owner: &str,
        from: Position,
        to: Position,
        items: &[NewWorkItem],
        claim: Claim,
        now_ms: u64,
    ) -> Result<Option<Vec<WorkItem>>> {
        let (claimed, rest) = items.split_at(claim.count.min(items.len()));
        let mut tx = self.transaction(WriteToken(())).await?;
        let outcome = async {
            if !tx.cursor_move(consumer, owner, from, to, now_ms).await? {
                return Ok(End::Rollback(None));
            }
            let mut inserted = Vec::new();
            if !claimed.is_empty() {
                inserted = tx.items_insert(consumer, claimed, now_ms, Some((owner, claim.lease_until_ms))).await?;
            }
            if !rest.is_empty() {
                tx.items_insert(consumer, rest, now_ms, None).await?;
            }
            Ok(End::Commit(Some(inserted)))
        }
        .await;
        let Some(inserted) = finish(&mut *tx, outcome).await? else { return Ok(None) };
        let inserted: std::collections::HashSet<(String, String)> = inserted.into_iter().collect();
        Ok(Some(
            claimed
                .iter()
                .filter(|item| inserted.contains(&(item.tenant.to_string(), item.id.clone())))
                .map(|item| WorkItem {
                    tenant: item.tenant,
                    consumer: consumer.to_owned(),
                    id: item.id.clone(),
                    subject: item.subject.clone(),
                    payload: item.payload.clone(),
                    state: WorkState::Pending,
                    attempts: 1,
                    round_attempts: 1,
                    next_at_ms: now_ms,
                    lease_until_ms: claim.lease_until_ms,
                    last_error: None,
                    created_at_ms: now_ms,
                    updated_at_ms: now_ms,
                })
                .collect(),
        ))
    }
    /// Inserts items directly, skipping ids that exist (for work not driven by the cursor).
    async fn work_insert(&self, consumer: &str, items: &[NewWorkItem], now_ms: u64) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let mut tx = self.transaction(WriteToken(())).await?;
        let outcome = tx.items_insert(consumer, items, now_ms, None).await.map(|_| End::Commit(()));
        finish(&mut *tx, outcome).await
    }
    /// Leases up to `limit` due pending items (oldest due first) to `owner` and counts the
    /// attempt they are about to get. It writes no column an index covers (`updated_at_ms`
    /// stays when the item was made or last attempted; the claim's time is its lease,
    /// [`WorkItem::claimed_at_ms`]), so on PostgreSQL the new row version needs no index entry.
    async fn work_claim(&self, consumer: &str, owner: &str, now_ms: u64, lease_ms: u64, limit: u32) -> Result<Vec<WorkItem>>;
    /// Gives back claimed items that were never attempted (`(tenant, id, attempt)`, the attempt
    /// number the claim counted), where `owner` still holds them: each is due again at once for
    /// any process, and its attempt counts are as before the claim, so an item given back never
    /// uses up one of its attempts. Returns how many were given back.
    async fn work_release(&self, consumer: &str, owner: &str, items: &[(TenantId, String, u32)]) -> Result<u64>;
    /// Records each attempt and moves its item on, in one transaction, where `owner` still
    /// holds the item's lease. One flag per completion; false: the lease ran out and another
    /// owner may have the item, so nothing was written for it.
    async fn work_complete_many(&self, consumer: &str, owner: &str, done: &[Completion]) -> Result<Vec<bool>> {
        if done.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.transaction(WriteToken(())).await?;
        let outcome = async {
            let written = tx.items_complete(consumer, owner, done).await?;
            let moved: Vec<&Completion> = done.iter().zip(&written).filter(|(_, w)| **w).map(|(c, _)| c).collect();
            if !moved.is_empty() {
                tx.attempts_insert(consumer, owner, &moved).await?;
            }
            Ok(End::Commit(written))
        }
        .await;
        finish(&mut *tx, outcome).await
    }
    /// [`OutboxStore::work_complete_many`] for one item.
    async fn work_complete(
        &self,
        consumer: &str,
        tenant: TenantId,
        id: &str,
        owner: &str,
        attempt: &Attempt,
        outcome: &Outcome,
    ) -> Result<bool> {
        let done = [Completion { tenant, id: id.to_owned(), attempt: attempt.clone(), outcome: outcome.clone() }];
        Ok(self.work_complete_many(consumer, owner, &done).await?.first().copied().unwrap_or(false))
    }
    async fn work_get(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Option<WorkItem>>;
    /// A subject's items by id (newest first when ids are ULID-ordered: descending), after the
    /// cursor `before_id`, optionally in one state.
    async fn work_list(
        &self,
        consumer: &str,
        tenant: TenantId,
        subject: &str,
        state: Option<WorkState>,
        before_id: Option<&str>,
        limit: u32,
    ) -> Result<Vec<WorkItem>>;
    /// Queues a done or dead item again, due now, with a fresh back-off. False: no such item, or
    /// it is still pending.
    async fn work_requeue(&self, consumer: &str, tenant: TenantId, id: &str, now_ms: u64) -> Result<bool>;
    async fn attempts(&self, consumer: &str, tenant: TenantId, id: &str) -> Result<Vec<Attempt>>;
    /// Deletes up to `limit` of a consumer's done items last changed before `before_ms`, with
    /// their attempts; dead items stay until an operator acts. Returns how many went.
    async fn work_prune(&self, consumer: &str, before_ms: u64, limit: u32) -> Result<u64> {
        let mut tx = self.transaction(WriteToken(())).await?;
        let outcome = async {
            let gone = tx.items_prune(consumer, before_ms, limit).await?;
            if !gone.is_empty() {
                tx.attempts_delete(consumer, &gone).await?;
            }
            Ok(End::Commit(gone.len() as u64))
        }
        .await;
        finish(&mut *tx, outcome).await
    }
    /// How many of a consumer's items are pending, done and dead.
    async fn work_counts(&self, consumer: &str) -> Result<(u64, u64, u64)>;
}

/// The columns a work item is read from, in `WorkItem::decode`'s order.
pub(crate) const ITEM_COLUMNS: &str = "tenant_id, consumer, id, subject, payload, state, attempts, round_attempts, \
                                       next_at_ms, last_error, created_at_ms, updated_at_ms, lease_until_ms";
/// The columns an attempt is read from, in `Attempt::decode`'s order.
pub(crate) const ATTEMPT_COLUMNS: &str = "number, at_ms, latency_ms, status, error, next_at_ms, owner";

impl WorkItem {
    pub(crate) fn decode(row: &(impl Columns + ?Sized)) -> Result<Self> {
        let payload = row.text(4)?;
        let state = row.text(5)?;
        Ok(Self {
            tenant: row.text(0)?.parse()?,
            consumer: row.text(1)?,
            id: row.text(2)?,
            subject: row.text(3)?,
            payload: serde_json::from_str(&payload).map_err(|e| Error::Storage(format!("work item payload: {e}")))?,
            state: WorkState::parse(&state).ok_or_else(|| Error::Storage(format!("work item state {state:?}")))?,
            attempts: to_u32(row.int(6)?)?,
            round_attempts: to_u32(row.int(7)?)?,
            next_at_ms: to_u64(row.int(8)?)?,
            last_error: row.opt_text(9)?,
            created_at_ms: to_u64(row.int(10)?)?,
            updated_at_ms: to_u64(row.int(11)?)?,
            lease_until_ms: to_u64(row.int(12)?)?,
        })
    }
}

impl Attempt {
    pub(crate) fn decode(row: &(impl Columns + ?Sized)) -> Result<Self> {
        Ok(Self {
            number: to_u32(row.int(0)?)?,
            at_ms: to_u64(row.int(1)?)?,
            latency_ms: to_u64(row.int(2)?)?,
            status: row.opt_int(3)?.and_then(|s| u16::try_from(s).ok()),
            error: row.opt_text(4)?,
            next_at_ms: row.opt_int(5)?.map(to_u64).transpose()?,
            owner: row.text(6)?,
        })
    }
}

/// The state and due time an outcome leaves an item in.
pub(crate) fn outcome_columns(outcome: &Outcome, at_ms: u64) -> (WorkState, u64) {
    match outcome {
        Outcome::Done => (WorkState::Done, at_ms),
        Outcome::Retry { next_at_ms } => (WorkState::Pending, *next_at_ms),
        Outcome::Dead => (WorkState::Dead, at_ms),
    }
}

/// (pending, done, dead) from `state, count` rows.
pub(crate) fn count_states(rows: impl IntoIterator<Item = (String, u64)>) -> (u64, u64, u64) {
    let mut counts = (0, 0, 0);
    for (state, n) in rows {
        match WorkState::parse(&state) {
            Some(WorkState::Pending) => counts.0 = n,
            Some(WorkState::Done) => counts.1 = n,
            Some(WorkState::Dead) => counts.2 = n,
            None => {}
        }
    }
    counts
}
