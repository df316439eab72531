//! The outbox runner (`outbox::run`) on SQLite with a consumer whose attempts wait at a gate:
//! claimed items that never started are given back unattempted, at a clean stop and when they
//! waited for a slot until their leases would not outlast an attempt and its record, so an item
//! given back never uses up one of its attempts and is due at once for any process; and what
//! `prepare` read for a waiting item is read again once it is older than an attempt's limit.
//! Items the runner's own fan-out writes go to its work loop already claimed, as many as it has
//! room for, and a clean stop gives back those too.
// Fixtures' ids only name things; the clock is the manual one.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bc_core::Result;
use bc_core::clock::{Clock as _, ManualClock};
use bc_core::event::EventRow;
use bc_core::id::TenantId;
use bc_core::keys::LogKey;
use bc_core::store::outbox::{NewWorkItem, WorkItem};
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log};
use bc_projections::Projections;
use bc_reconcilers::outbox::{Consumer, Handled, Prepared, RunnerConfig, run};

use crate::support;

const NAME: &str = "gated";
/// The fixture runner's lease.
const LEASE_MS: u64 = 60_000;

/// Each attempt says it started (the item, when it was claimed, when its batch was prepared),
/// then waits for a permit of the gate. With `fans_out`, each event makes one item.
struct Gated {
    started: tokio::sync::mpsc::UnboundedSender<Started>,
    gate: Arc<tokio::sync::Semaphore>,
    clock: Arc<ManualClock>,
    fans_out: bool,
}

#[derive(Debug)]
struct Started {
    id: String,
    claimed_at_ms: u64,
    prepared_at_ms: u64,
}

#[async_trait]
impl Consumer for Gated {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn fan_out(&self, _: &dyn EventStore, rows: &[EventRow]) -> Result<Vec<NewWorkItem>> {
        if !self.fans_out {
            return Ok(Vec::new());
        }
        rows.iter().map(support::item_of).collect()
    }

    async fn prepare(&self, _: &dyn EventStore, _: &[WorkItem]) -> Prepared {
        Some(Arc::new(self.clock.now_ms()))
    }

    async fn handle(&self, _: &dyn EventStore, item: &WorkItem, prepared: &Prepared) -> Handled {
        let prepared_at_ms = *prepared.as_ref().and_then(|p| p.downcast_ref::<u64>()).expect("prepared by the runner");
        let _ = self.started.send(Started { id: item.id.clone(), claimed_at_ms: item.claimed_at_ms(LEASE_MS), prepared_at_ms });
        self.gate.acquire().await.expect("the gate stays open").forget();
        Handled::ok(Some(204))
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<dyn EventStore>,
    clock: Arc<ManualClock>,
    gate: Arc<tokio::sync::Semaphore>,
    started: tokio::sync::mpsc::UnboundedReceiver<Started>,
    stop: tokio::sync::watch::Sender<bool>,
    runner: tokio::task::JoinHandle<()>,
}

/// `items` items due at 1 s, and a runner with one slot, a 60 s lease and a 10 s attempt limit
/// (so four claimed items may wait, each to start within 40 s of its claim).
async fn fixture(items: usize) -> Fixture {
    fixture_with(items, 0).await
}

/// [`fixture`], with `events` events in the log first, each of which the consumer's fan-out
/// makes one item of.
async fn fixture_with(items: usize, events: usize) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("outbox.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let clock = Arc::new(ManualClock::new(1_000));
    let log = Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), clock.clone()).await.unwrap();
    for _ in 0..events {
        log.append(support::pool_created().1).await.unwrap();
    }
    let new: Vec<NewWorkItem> = (0..items)
        .map(|i| NewWorkItem {
            tenant: TenantId::ROOT,
            id: format!("item-{i}"),
            subject: "s".into(),
            payload: serde_json::json!({ "n": i }),
        })
        .collect();
    store.work_insert(NAME, &new, 1_000).await.unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (tx, started) = tokio::sync::mpsc::unbounded_channel();
    let consumer = Arc::new(Gated { started: tx, gate: gate.clone(), clock: clock.clone(), fans_out: events > 0 });
    let mut config = RunnerConfig::new(clock.clone());
    (config.owner, config.seed, config.concurrency, config.poll_ms) = ("p1".into(), 7, 1, 20);
    (config.lease_ms, config.time_limit_ms) = (LEASE_MS, 10_000);
    assert_eq!(bc_reconcilers::outbox::ahead_max(&config, 1), 4);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let runner = tokio::spawn(run(store.clone(), consumer, config, None, stopped));
    Fixture { _dir: dir, store, clock, gate, started, stop, runner }
}

async fn next_start(f: &mut Fixture) -> Started {
    tokio::time::timeout(Duration::from_secs(30), f.started.recv()).await.expect("an attempt starts").expect("the runner runs")
}

#[tokio::test]
async fn a_clean_stop_gives_unstarted_claims_back_due_at_once_with_their_attempts_unspent() {
    let mut f = fixture(5).await;
    let first = next_start(&mut f).await.id;
    // One attempt in flight, four claimed items waiting for the one slot: stop, then let the
    // attempt end.
    f.stop.send(true).unwrap();
    f.gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(30), f.runner).await.expect("the runner stops").unwrap();
    assert_eq!(f.store.work_counts(NAME).await.unwrap(), (4, 1, 0), "the attempt in flight was recorded");
    let done = f.store.work_get(NAME, TenantId::ROOT, &first).await.unwrap().unwrap();
    assert_eq!(done.attempts, 1);
    // The others are as before their claim, and another process takes them at once, on the
    // same clock (not when the 60 s lease would have run out).
    let again = f.store.work_claim(NAME, "p2", f.clock.now_ms(), 60_000, 10).await.unwrap();
    assert_eq!(again.len(), 4);
    assert!(again.iter().all(|i| (i.attempts, i.round_attempts) == (1, 1) && i.id != first), "{again:?}");
}

#[tokio::test]
async fn claims_that_wait_past_their_start_by_are_given_back_and_run_once_each() {
    let mut f = fixture(3).await;
    let started = next_start(&mut f).await;
    let first = started.id;
    assert_eq!(started.claimed_at_ms, 1_000);
    // The attempt in flight takes 40 s and a millisecond: the two claimed items behind it
    // could no longer finish an attempt and have it recorded within their leases, so they are
    // given back, claimed again (at 41.001 s, not under the claim that ran short) and attempted
    // once each.
    f.clock.advance_ms(40_001);
    f.gate.add_permits(10);
    let mut rest = Vec::new();
    for _ in 0..2 {
        let Started { id, claimed_at_ms, .. } = next_start(&mut f).await;
        assert_eq!(claimed_at_ms, 41_001, "{id} attempted under a fresh claim");
        rest.push(id);
    }
    assert!(!rest.contains(&first));
    for _ in 0..1_500 {
        if f.store.work_counts(NAME).await.unwrap() == (0, 3, 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(f.store.work_counts(NAME).await.unwrap(), (0, 3, 0));
    for id in [&first, &rest[0], &rest[1]] {
        let attempts = f.store.attempts(NAME, TenantId::ROOT, id).await.unwrap();
        assert_eq!(attempts.iter().map(|a| a.number).collect::<Vec<_>>(), [1], "{id}: one attempt, numbered 1");
    }
    f.stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), f.runner).await.expect("the runner stops").unwrap();
}

#[tokio::test]
async fn what_prepare_read_is_read_again_for_items_that_waited_longer_than_an_attempts_limit() {
    let mut f = fixture(3).await;
    let started = next_start(&mut f).await;
    assert_eq!((started.claimed_at_ms, started.prepared_at_ms), (1_000, 1_000));
    // The attempt in flight takes 10 s and a millisecond: the items behind it still start
    // under their claim (within 40 s of it), but with what `prepare` reads now, not at the claim.
    f.clock.advance_ms(10_001);
    f.gate.add_permits(10);
    for _ in 0..2 {
        let next = next_start(&mut f).await;
        assert_eq!((next.claimed_at_ms, next.prepared_at_ms), (1_000, 11_001), "{next:?}");
    }
    f.stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), f.runner).await.expect("the runner stops").unwrap();
    assert_eq!(f.store.work_counts(NAME).await.unwrap(), (0, 3, 0));
}

#[tokio::test]
async fn the_fan_out_hands_the_work_loop_claimed_items_and_a_clean_stop_gives_back_those_unstarted() {
    // Eight events make eight items; the work loop has room for five (its slot and the four
    // that may wait), which the fan-out writes claimed and hands over; the other three are
    // written due, for any process to claim.
    let mut f = fixture_with(0, 8).await;
    let first = next_start(&mut f).await;
    assert_eq!((first.claimed_at_ms, first.prepared_at_ms), (1_000, 1_000));
    let item = f.store.work_get(NAME, TenantId::ROOT, &first.id).await.unwrap().unwrap();
    assert_eq!((item.attempts, item.round_attempts), (1, 1), "claimed as it was written");
    let due = f.store.work_claim(NAME, "p2", f.clock.now_ms(), 60_000, 10).await.unwrap();
    assert_eq!(due.len(), 3, "only those not handed over are due: {due:?}");
    let due: Vec<_> = due.iter().map(|i| (TenantId::ROOT, i.id.clone(), i.attempts)).collect();
    assert_eq!(f.store.work_release(NAME, "p2", &due).await.unwrap(), 3);
    // A clean stop with one attempt in flight: the four handed over and never started are
    // given back, due at once with their attempts unspent.
    f.stop.send(true).unwrap();
    f.gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(30), f.runner).await.expect("the runner stops").unwrap();
    assert_eq!(f.store.work_counts(NAME).await.unwrap(), (7, 1, 0), "the attempt in flight was recorded");
    let again = f.store.work_claim(NAME, "p2", f.clock.now_ms(), 60_000, 10).await.unwrap();
    assert_eq!(again.len(), 7);
    assert!(again.iter().all(|i| (i.attempts, i.round_attempts) == (1, 1) && i.id != first.id), "{again:?}");
}
