//! Ids and time are inputs: two fresh SQLite stores given the same seed, the same manual clock
//! readings, the same log key and the same appends hold the same events, byte for byte (ids,
//! canonical encodings, hashes, signatures, positions and chain heads). A different seed gives
//! other ids, so the equality is not an accident of the source.

use std::sync::Arc;

use bc_core::clock::{Clock, ManualClock};
use bc_core::event::{EventRow, Position, StoredEvent};
use bc_core::id::{PoolId, TenantId};
use bc_core::id_source::{IdSource, SeededIds};
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Head, Log, NewEvent, Projector, RowKey};
use ciborium::Value;

const START_MS: u64 = 1_800_000_000_000;

struct NoProjections;

impl Projector for NoProjections {
    fn touches(&self, _: &StoredEvent, _: &mut Vec<RowKey>) {}
    fn apply(&self, _: &RowKey, _: Option<serde_json::Value>, _: &StoredEvent) -> bc_core::Result<Option<serde_json::Value>> {
        Ok(None)
    }
}

fn payload(n: u64) -> Value {
    Value::Map(vec![(Value::Text("n".into()), Value::Integer(n.into()))])
}

/// Everything one run wrote: every event row in position order, and the chain heads.
struct Run {
    rows: Vec<EventRow>,
    heads: Vec<(TenantId, Head)>,
    pool_ids: Vec<PoolId>,
}

/// A fresh store and log on `seed` and a manual clock, then a fixed script of appends: creates,
/// a multi-event append, an idempotent append and its retry, a two-stream append with a guard,
/// a second tenant, with the clock moved between them.
async fn run(seed: u64) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap());
    let clock = Arc::new(ManualClock::new(START_MS));
    store.migrate_at(clock.now_ms()).await.unwrap();
    let ids: Arc<dyn IdSource> = Arc::new(SeededIds::new(seed, clock.clone()));
    let key = Arc::new(LogKey::from_seed([7; 32]));
    let log = Log::open_with_ids(store.clone(), Arc::new(NoProjections), key, clock.clone(), ids.clone()).await.unwrap();

    // Entity ids from the same source, as the gateway will take them.
    let tenant = TenantId::from_ulid(log.ids.ulid());
    let other = TenantId::from_ulid(log.ids.ulid());
    let pool_ids: Vec<PoolId> = (0..2).map(|_| PoolId::from_ulid(log.ids.ulid())).collect();
    let pool = format!("pool/{}", pool_ids[0]);
    let node = format!("node/{}", pool_ids[1]);

    let create = AppendRequest::new(
        tenant,
        pool.clone(),
        ExpectedVersion::NoStream,
        "test",
        vec![NewEvent::new("pool.created", payload(0))],
    );
    log.append(create).await.unwrap();
    clock.advance_ms(17);
    let many = AppendRequest::new(
        tenant,
        pool.clone(),
        ExpectedVersion::Exact(1),
        "test",
        (1..=5).map(|n| NewEvent::new("pool.changed", payload(n))).collect(),
    );
    log.append(many).await.unwrap();
    clock.advance_ms(1_000);
    let mut idempotent = AppendRequest::new(
        tenant,
        node.clone(),
        ExpectedVersion::NoStream,
        "test",
        vec![NewEvent::new("node.joined", payload(9))],
    );
    idempotent.idempotency_key = Some("join-1".into());
    idempotent.correlation = Some("req_1".into());
    let first = log.append(idempotent.clone()).await.unwrap();
    let retry = log.append(idempotent).await.unwrap();
    assert!(retry.replayed && retry.events == first.events, "a retry replays");
    clock.advance_ms(3);
    let mut two_streams =
        AppendRequest::new(tenant, pool.clone(), ExpectedVersion::Exact(6), "test", vec![NewEvent::new("pool.held", payload(1))]);
    two_streams.guards = vec![(node.clone(), ExpectedVersion::Exact(1))];
    two_streams.events.push(NewEvent { stream: Some(node.clone()), event_type: "node.held".into(), payload: payload(2) });
    log.append(two_streams).await.unwrap();
    clock.advance_ms(250);
    let elsewhere =
        AppendRequest::new(other, "pool/x", ExpectedVersion::Any, "test", vec![NewEvent::new("pool.created", payload(3))]);
    log.append(elsewhere).await.unwrap();

    let rows = store.read_after_rows(Position::START, None, 1000).await.unwrap();
    let heads = store.heads().await.unwrap();
    Run { rows, heads, pool_ids }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_seed_and_clock_give_the_same_bytes() {
    let (first, second) = (run(42).await, run(42).await);
    assert_eq!(first.rows.len(), 10);
    assert_eq!(first.pool_ids, second.pool_ids);
    for (a, b) in first.rows.iter().zip(&second.rows) {
        assert_eq!(a.id, b.id, "event ids");
        assert_eq!(a.canonical, b.canonical, "canonical bytes of {}", a.id);
        assert_eq!(a.hash, b.hash, "hash of {}", a.id);
        assert_eq!(a.sig, b.sig, "signature of {}", a.id);
        assert_eq!((a.tenant.as_str(), a.seq, a.commit, a.index), (b.tenant.as_str(), b.seq, b.commit, b.index));
    }
    assert_eq!(first.rows.len(), second.rows.len());
    assert_eq!(first.heads, second.heads, "chain heads");
    // The times are the clock's, not the machine's.
    let times: Vec<u64> = first.rows.iter().map(|r| r.clone().decode().unwrap().envelope.at_ms).collect();
    assert_eq!(
        times,
        [
            START_MS,
            START_MS + 17,
            START_MS + 17,
            START_MS + 17,
            START_MS + 17,
            START_MS + 17,
            START_MS + 1017,
            START_MS + 1020,
            START_MS + 1020,
            START_MS + 1270
        ]
    );

    let third = run(43).await;
    assert_ne!(first.rows[0].id, third.rows[0].id, "another seed, other ids");
    assert_ne!(first.heads, third.heads);
}
