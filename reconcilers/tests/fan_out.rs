//! The outbox runner's fan-out (`outbox::FanOut`) on SQLite and a manual clock: events that
//! make no items are read past without a write, and the cursor is written with the next items,
//! after a poll's interval, or when idle past it; a step without deferral (the simulator's
//! `fan_out_step`) writes every time; a fan-out whose lease another process took starts again
//! from the cursor as written.
// Fixtures' ids only name things; the clock is the manual one.
#![allow(clippy::disallowed_methods)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bc_core::Result;
use bc_core::clock::ManualClock;
use bc_core::event::{EventRow, Position};
use bc_core::keys::LogKey;
use bc_core::store::outbox::{NewWorkItem, WorkItem};
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log};
use bc_projections::Projections;
use bc_reconcilers::outbox::{Consumer, FanOut, Handled, Prepared, RunnerConfig, fan_out_step};

use crate::support;

const NAME: &str = "picky";
const POLL_MS: u64 = 250;
const LEASE_MS: u64 = 60_000;

/// One item for each event on a stream it was told to want; none for the rest.
struct Picky {
    wanted: Mutex<HashSet<String>>,
}

#[async_trait]
impl Consumer for Picky {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn fan_out(&self, _: &dyn EventStore, rows: &[EventRow]) -> Result<Vec<NewWorkItem>> {
        let wanted = self.wanted.lock().unwrap();
        rows.iter().filter(|r| wanted.contains(&r.stream)).map(support::item_of).collect()
    }

    async fn prepare(&self, _: &dyn EventStore, _: &[WorkItem]) -> Prepared {
        None
    }

    async fn handle(&self, _: &dyn EventStore, _: &WorkItem, _: &Prepared) -> Handled {
        Handled::ok(Some(204))
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<dyn EventStore>,
    log: Log,
    clock: Arc<ManualClock>,
    consumer: Picky,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("fan-out.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let clock = Arc::new(ManualClock::new(1_000));
    let log = Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), clock.clone()).await.unwrap();
    Fixture { _dir: dir, store, log, clock, consumer: Picky { wanted: Mutex::default() } }
}

impl Fixture {
    fn config(&self, owner: &str) -> RunnerConfig {
        let mut config = RunnerConfig::new(self.clock.clone());
        (config.owner, config.poll_ms, config.lease_ms) = (owner.into(), POLL_MS, LEASE_MS);
        config
    }

    /// Appends a `pool.created` on a pool of its own (wanted or not); returns its position.
    async fn append(&self, wanted: bool) -> Position {
        let (stream, request) = support::pool_created();
        if wanted {
            self.consumer.wanted.lock().unwrap().insert(stream);
        }
        self.log.append(request).await.unwrap().events[0].position
    }

    async fn cursor(&self) -> Option<Position> {
        self.store.cursor_position(NAME).await.unwrap()
    }

    async fn pending(&self) -> u64 {
        self.store.work_counts(NAME).await.unwrap().0
    }
}

#[tokio::test]
async fn events_without_items_are_read_past_and_the_cursor_written_with_items_or_after_a_poll() {
    let f = fixture().await;
    let config = f.config("p1");
    let mut fan_out = FanOut::default();
    let quiet = f.append(false).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), Some(0));
    let start = f.cursor().await.expect("the lease made the cursor");
    assert!(start < quiet, "read past, not written: {start}");
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), None, "nothing new");
    assert_eq!(f.cursor().await, Some(start), "idle for less than a poll: still not written");

    // Items write the cursor, past the events read over before them, at once.
    let wanted = f.append(true).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), Some(1));
    assert_eq!((f.cursor().await, f.pending().await), (Some(wanted), 1));

    // Idle past a poll: the cursor is written where the fan-out read to.
    f.append(false).await;
    let last = f.append(false).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), Some(0));
    assert_eq!(f.cursor().await, Some(wanted));
    f.clock.advance_ms(POLL_MS);
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), None);
    assert_eq!(f.cursor().await, Some(last));

    // Busy: written once the first event read past is a poll old, never later.
    let first = f.append(false).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), Some(0));
    assert_eq!(f.cursor().await, Some(last), "{first} read past");
    f.clock.advance_ms(POLL_MS);
    let busy = f.append(false).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), Some(0));
    assert_eq!(f.cursor().await, Some(busy));
    assert_eq!(f.pending().await, 1, "events without items made none");

    // A clean stop writes what was read past.
    let stopped = f.append(false).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &config, true).await.unwrap(), Some(0));
    fan_out.flush(&*f.store, NAME, &config).await.unwrap();
    assert_eq!(f.cursor().await, Some(stopped));
}

#[tokio::test]
async fn a_step_without_deferral_writes_the_cursor_every_time() {
    let f = fixture().await;
    let config = f.config("p1");
    let quiet = f.append(false).await;
    assert_eq!(fan_out_step(&*f.store, &f.consumer, &config).await.unwrap(), Some(0));
    assert_eq!(f.cursor().await, Some(quiet));
    let wanted = f.append(true).await;
    assert_eq!(fan_out_step(&*f.store, &f.consumer, &config).await.unwrap(), Some(1));
    assert_eq!((f.cursor().await, f.pending().await), (Some(wanted), 1));
    assert_eq!(fan_out_step(&*f.store, &f.consumer, &config).await.unwrap(), None);
}

#[tokio::test]
async fn a_fan_out_whose_lease_another_process_took_starts_again_from_the_written_cursor() {
    let f = fixture().await;
    let (mine, theirs) = (f.config("p1"), f.config("p2"));
    let mut fan_out = FanOut::default();
    f.append(false).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &mine, true).await.unwrap(), Some(0));
    let written = f.cursor().await;
    // The lease runs out (a stalled process); another takes the cursor and fans out a wanted
    // event the first had not read.
    f.clock.advance_ms(LEASE_MS + 1);
    let wanted = f.append(true).await;
    assert_eq!(fan_out_step(&*f.store, &f.consumer, &theirs).await.unwrap(), Some(1));
    assert_eq!(f.cursor().await, Some(wanted));
    assert_ne!(f.cursor().await, written);
    // The first's next steps write nothing and leave the cursor to its holder: its flush finds
    // the lease gone, and a step finds the cursor held.
    fan_out.flush(&*f.store, NAME, &mine).await.unwrap();
    f.append(true).await;
    assert_eq!(fan_out.step(&*f.store, &f.consumer, &mine, true).await.unwrap(), None);
    assert_eq!((f.cursor().await, f.pending().await), (Some(wanted), 1));
}
