//! The `EventStore` conformance suite: every test runs against SQLite, SQLite with the
//! simulator's inline connection (`SqliteStore::open_for_one_thread`) and PostgreSQL.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bc_core::chain::verify_chain;
use bc_core::clock::SystemClock;
use bc_core::event::{Position, StoredEvent};
use bc_core::id::TenantId;
use bc_core::keys::{KeyRing, LogKey};
use bc_core::store::postgres::PostgresStore;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{
    AppendRequest, EventStore, ExpectedVersion, Log, NewEvent, Projector, RowKey, decode_rows, rebuild_projections,
};
use bc_core::testing::ScratchDatabase;
use bc_core::{ErrorCode, Result};
use ciborium::Value;

/// Counts events per stream: enough to prove projections commit with the events.
struct CountingProjector;

impl Projector for CountingProjector {
    fn touches(&self, event: &StoredEvent, out: &mut Vec<RowKey>) {
        out.push(RowKey { tenant: event.envelope.tenant.to_string(), kind: "count".into(), id: event.envelope.stream.clone() });
    }
    fn apply(&self, _: &RowKey, current: Option<serde_json::Value>, event: &StoredEvent) -> Result<Option<serde_json::Value>> {
        let n = current.and_then(|c| c["n"].as_u64()).unwrap_or(0) + 1;
        if event.envelope.event_type == "thing.deleted" {
            return Ok(None);
        }
        Ok(Some(serde_json::json!({ "n": n, "lastSeq": event.envelope.seq })))
    }
}

#[allow(dead_code)] // the payloads are held for their Drop (temp dir, scratch database)
enum Backend {
    Sqlite(tempfile::TempDir),
    Postgres(ScratchDatabase),
}

struct Fixture {
    log: Log,
    store: Arc<dyn EventStore>,
    keys: KeyRing,
    _backend: Backend,
}

/// Which store a test runs against.
#[derive(Clone, Copy)]
enum Kind {
    Sqlite,
    /// SQLite whose every statement runs on the caller's thread, as the simulator opens it.
    SqliteInline,
    Postgres,
}

async fn fixture(kind: Kind) -> Fixture {
    let (store, backend): (Arc<dyn EventStore>, Backend) = match kind {
        Kind::Postgres => {
            let db = ScratchDatabase::create().await.expect("PostgreSQL for the conformance suite");
            (Arc::new(PostgresStore::connect(&db.url).await.unwrap()), Backend::Postgres(db))
        }
        Kind::Sqlite | Kind::SqliteInline => {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("log.sqlite3");
            let store = match kind {
                Kind::SqliteInline => SqliteStore::open_for_one_thread(&path).await.unwrap(),
                _ => SqliteStore::open(&path).await.unwrap(),
            };
            (Arc::new(store), Backend::Sqlite(dir))
        }
    };
    assert!(store.check_schema().await.is_err(), "an empty database must not pass the schema check");
    store.migrate().await.unwrap();
    assert!(store.migrate().await.unwrap().is_empty(), "migrations apply once");
    store.check_schema().await.unwrap();
    let key = Arc::new(LogKey::generate());
    let mut keys = KeyRing::default();
    keys.insert(key.public());
    let log = Log::open(store.clone(), Arc::new(CountingProjector), key, Arc::new(SystemClock)).await.unwrap();
    Fixture { log, store, keys, _backend: backend }
}

fn request(tenant: TenantId, stream: &str, expected: ExpectedVersion, n: usize) -> AppendRequest {
    AppendRequest {
        tenant,
        stream: stream.into(),
        expected,
        idempotency_key: None,
        actor: "test".into(),
        causation: None,
        correlation: None,
        fingerprint: None,
        guards: vec![],
        events: (0..n)
            .map(|i| NewEvent {
                stream: None,
                event_type: "thing.happened".into(),
                payload: Value::Map(vec![(Value::Text("i".into()), Value::Integer(i.into()))]),
            })
            .collect(),
    }
}

async fn chain(store: &dyn EventStore, tenant: TenantId) -> Vec<bc_core::event::EventRow> {
    let mut rows = Vec::new();
    loop {
        let page = store.read_chain_rows(tenant, rows.len() as u64 + 1, 1000).await.unwrap();
        let last = page.len() < 1000;
        rows.extend(page);
        if last {
            return rows;
        }
    }
}

async fn verify_all(f: &Fixture) -> u64 {
    let mut total = 0;
    for (tenant, head) in f.store.heads().await.unwrap() {
        let rows = chain(&*f.store, tenant).await;
        total += verify_chain(tenant, rows, Some((head.seq, head.hash)), &f.keys).unwrap_or_else(|p| panic!("{p}"));
    }
    total
}

async fn appends_and_reads(kind: Kind) {
    let f = fixture(kind).await;
    let (a, b) = (TenantId::generate(), TenantId::generate());
    let first = f.log.append(request(a, "thing/1", ExpectedVersion::NoStream, 3)).await.unwrap();
    assert!(!first.replayed);
    assert_eq!(first.events.iter().map(|e| e.envelope.seq).collect::<Vec<_>>(), [1, 2, 3]);
    assert_eq!(first.events.iter().map(|e| e.envelope.version).collect::<Vec<_>>(), [1, 2, 3]);
    let second = f.log.append(request(b, "thing/1", ExpectedVersion::Any, 1)).await.unwrap();
    assert_eq!(second.events[0].envelope.seq, 1, "chains are per tenant");
    let third = f.log.append(request(a, "thing/2", ExpectedVersion::NoStream, 2)).await.unwrap();
    assert_eq!(third.events[0].envelope.seq, 4);
    assert_eq!(third.events[0].envelope.version, 1, "versions are per stream");
    assert_eq!(third.events[0].envelope.prev, first.events[2].hash, "the chain links across streams");
    assert_eq!(verify_all(&f).await, 6);

    // Reads by chain, by stream, by position, by id.
    let rows = f.store.read_chain_rows(a, 3, 10).await.unwrap();
    assert_eq!(rows.iter().map(|r| r.seq).collect::<Vec<_>>(), [3, 4, 5]);
    let rows = f.store.read_stream_rows(a, "thing/1", 1, 10).await.unwrap();
    assert_eq!(rows.iter().map(|r| r.version).collect::<Vec<_>>(), [2, 3]);
    let all = decode_rows(f.store.read_after_rows(Position::START, None, 100).await.unwrap()).unwrap();
    assert_eq!(all.len(), 6);
    assert!(all.windows(2).all(|w| w[0].position < w[1].position), "position order");
    assert_eq!(all[3].envelope.tenant, b, "commit order across tenants");
    let after = decode_rows(f.store.read_after_rows(all[1].position, None, 100).await.unwrap()).unwrap();
    assert_eq!(after.len(), 4);
    assert_eq!(after[0].position, all[2].position);
    // The narrow read names the same events' streams and positions, in the same order.
    let touches = f.store.read_after_touches(all[1].position, 100).await.unwrap();
    let expected: Vec<_> = after
        .iter()
        .map(|e| bc_core::store::StreamTouch {
            tenant: e.envelope.tenant.to_string(),
            stream: e.envelope.stream.clone(),
            commit: e.position.commit,
            index: e.position.index,
        })
        .collect();
    assert_eq!(touches, expected);
    assert_eq!(f.store.read_after_touches(all[1].position, 2).await.unwrap(), expected[..2], "bounded by its limit");
    let only_b = f.store.read_after_rows(Position::START, Some(b), 100).await.unwrap();
    assert_eq!(only_b.len(), 1);
    let one = f.store.event_row(a, third.events[1].envelope.id).await.unwrap().unwrap();
    assert_eq!(one.decode().unwrap(), third.events[1]);
    assert!(f.store.event_row(b, third.events[1].envelope.id).await.unwrap().is_none(), "ids are scoped to their tenant");
    assert_eq!(f.store.last_commit().await.unwrap(), all.last().unwrap().position.commit);

    // Projections were written in the same transactions, and a rebuild gives the same rows.
    let row = f.store.row_get(&a.to_string(), "count", "thing/1").await.unwrap().unwrap();
    assert_eq!(row.doc, serde_json::json!({"n": 3, "lastSeq": 3}));
    // Each append answers with the rows it touched as its commit left them: what a read gives.
    assert_eq!(first.row(&row.key), Some(Some(&row.doc)));
    assert_eq!(first.rows.len(), 1);
    let other = bc_core::store::RowKey { tenant: a.to_string(), kind: "count".into(), id: "thing/2".into() };
    assert_eq!(first.row(&other), None, "a row the append did not touch is not in its answer");
    assert_eq!(
        third.row(&other).flatten(),
        f.store.row_get(&a.to_string(), "count", "thing/2").await.unwrap().map(|r| r.doc).as_ref()
    );
    // Several rows in one read: the absent id left out, another tenant's row not read.
    let some = f.store.rows_get(&a.to_string(), "count", &["thing/none", "thing/1", "thing/2"]).await.unwrap();
    let ids: Vec<&str> = some.iter().map(|r| r.key.id.as_str()).collect();
    assert_eq!(ids, ["thing/1", "thing/2"]);
    assert_eq!(some[0], row);
    assert!(f.store.rows_get(&a.to_string(), "count", &[]).await.unwrap().is_empty());
    let too_many = vec!["x"; bc_core::store::ROWS_GET_MAX + 1];
    assert_eq!(f.store.rows_get(&a.to_string(), "count", &too_many).await.unwrap_err().code(), ErrorCode::InvalidArgument);
    let before = f.store.rows_all().await.unwrap();
    assert_eq!(before.len(), 3);
    let (events, rows) = rebuild_projections(&*f.store, &CountingProjector).await.unwrap();
    assert_eq!((events, rows), (6, 3));
    assert_eq!(f.store.rows_all().await.unwrap(), before);
    // A delete in the fold removes the row.
    let mut del = request(a, "thing/1", ExpectedVersion::Exact(3), 1);
    del.events[0].event_type = "thing.deleted".into();
    let deleted = f.log.append(del).await.unwrap();
    assert!(f.store.row_get(&a.to_string(), "count", "thing/1").await.unwrap().is_none());
    assert_eq!(deleted.row(&row.key), Some(None), "the answer says the row was deleted");
}

/// Every tenant with events is listed once, in order, however many events each has (the store
/// finds them one tenant at a time, not by reading every event).
async fn tenants_are_listed(kind: Kind) {
    let f = fixture(kind).await;
    assert!(f.store.tenants().await.unwrap().is_empty());
    let mut tenants: Vec<TenantId> = (0..5).map(|_| TenantId::generate()).collect();
    for (i, tenant) in tenants.iter().enumerate().rev() {
        for n in 0..=i {
            f.log.append(request(*tenant, &format!("thing/{n}"), ExpectedVersion::NoStream, 2)).await.unwrap();
        }
    }
    tenants.sort_by_key(|t| t.to_string());
    assert_eq!(f.store.tenants().await.unwrap(), tenants);
}

/// A kind's last row is the one with the greatest id in byte order (as pages list them), per
/// tenant; none for a kind without rows.
async fn a_kinds_last_row(kind: Kind) {
    let f = fixture(kind).await;
    let (a, b) = (TenantId::generate(), TenantId::generate());
    assert!(f.store.row_last(&a.to_string(), "count").await.unwrap().is_none());
    // "thing/B" < "thing/_x" < "thing/a" in bytes; a linguistic collation, which passes over
    // punctuation and case first, would put "thing/_x" last.
    for stream in ["thing/a", "thing/_x", "thing/B"] {
        f.log.append(request(a, stream, ExpectedVersion::Any, 1)).await.unwrap();
    }
    f.log.append(request(b, "thing/0", ExpectedVersion::Any, 1)).await.unwrap();
    let last = f.store.row_last(&a.to_string(), "count").await.unwrap().expect("a row");
    assert_eq!((last.key.tenant.clone(), last.key.id.clone()), (a.to_string(), "thing/a".to_owned()));
    let listed = f.store.row_list(&a.to_string(), "count", None, 10).await.unwrap();
    assert_eq!(listed.last().map(|r| r.key.id.clone()), Some(last.key.id.clone()), "the last a page lists");
    assert_eq!(f.store.row_last(&b.to_string(), "count").await.unwrap().expect("b's row").key.id, "thing/0");
    assert!(f.store.row_last(&a.to_string(), "other").await.unwrap().is_none());
}

async fn idempotency(kind: Kind) {
    let f = fixture(kind).await;
    let t = TenantId::generate();
    let mut req = request(t, "thing/1", ExpectedVersion::Any, 2);
    req.idempotency_key = Some("create-1".into());
    let first = f.log.append(req.clone()).await.unwrap();
    let again = f.log.append(req.clone()).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.events, first.events, "a retry returns the first result");
    assert!(again.rows.is_empty(), "a replay's caller reads the rows as they are now");
    assert_eq!(chain(&*f.store, t).await.len(), 2, "and appends nothing");
    // Same key, different request.
    let mut other = req.clone();
    other.events.pop();
    let err = f.log.append(other).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::IdempotencyConflict);
    assert_eq!(chain(&*f.store, t).await.len(), 2);
    // The same key in another tenant is another key.
    let mut elsewhere = req.clone();
    elsewhere.tenant = TenantId::generate();
    assert!(!f.log.append(elsewhere).await.unwrap().replayed);
    // Concurrent retries with one key: one append, the rest replay it.
    let mut racing = request(t, "thing/2", ExpectedVersion::Any, 1);
    racing.idempotency_key = Some("race".into());
    let results = futures::future::join_all((0..8).map(|_| f.log.append(racing.clone()))).await;
    let ids: HashSet<_> = results.iter().map(|r| r.as_ref().unwrap().events[0].envelope.id).collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(results.iter().filter(|r| !r.as_ref().unwrap().replayed).count(), 1);
    assert_eq!(chain(&*f.store, t).await.len(), 3);
}

async fn optimistic_concurrency(kind: Kind) {
    let f = fixture(kind).await;
    let t = TenantId::generate();
    f.log.append(request(t, "thing/1", ExpectedVersion::NoStream, 2)).await.unwrap();
    let err = f.log.append(request(t, "thing/1", ExpectedVersion::NoStream, 1)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    let err = f.log.append(request(t, "thing/1", ExpectedVersion::Exact(1), 1)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    assert!(err.to_string().contains("version 2"), "{err}");
    assert_eq!(chain(&*f.store, t).await.len(), 2, "a conflict appends nothing");
    f.log.append(request(t, "thing/1", ExpectedVersion::Exact(2), 1)).await.unwrap();
    // Racing writers at the same expected version: exactly one wins.
    let results =
        futures::future::join_all((0..6).map(|_| f.log.append(request(t, "thing/1", ExpectedVersion::Exact(3), 1)))).await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
    assert!(results.iter().filter_map(|r| r.as_ref().err()).all(|e| e.code() == ErrorCode::Conflict));
    // Guards: another stream must be at a version, though nothing is appended to it.
    let mut guarded = request(t, "thing/child", ExpectedVersion::Any, 1);
    guarded.guards = vec![("thing/1".into(), ExpectedVersion::Exact(3))];
    let before = chain(&*f.store, t).await.len();
    assert_eq!(f.log.append(guarded.clone()).await.unwrap_err().code(), ErrorCode::Conflict, "thing/1 is at 4");
    assert_eq!(chain(&*f.store, t).await.len(), before, "a failed guard appends nothing");
    guarded.guards = vec![("thing/1".into(), ExpectedVersion::Exact(4)), ("thing/none".into(), ExpectedVersion::NoStream)];
    f.log.append(guarded).await.unwrap();
    // Bad requests are refused before they reach the store.
    for bad in [
        request(t, "", ExpectedVersion::Any, 1),
        request(t, "a b", ExpectedVersion::Any, 1),
        request(t, "x", ExpectedVersion::Any, 0),
    ] {
        assert_eq!(f.log.append(bad).await.unwrap_err().code(), ErrorCode::InvalidArgument);
    }
    let mut float = request(t, "thing/9", ExpectedVersion::Any, 1);
    float.events[0].payload = Value::Float(1.5);
    assert_eq!(f.log.append(float).await.unwrap_err().code(), ErrorCode::InvalidArgument);
    assert_eq!(verify_all(&f).await, 5);
}

/// A group of appends lands whole, in one commit, each member seeing the versions the members
/// before it made; a group with one refused member lands nothing and is refused with that
/// member's error, while appends racing it land; a group past the batch's size is refused
/// before the store; the simulator's appends limit counts a group's members.
async fn append_groups(kind: Kind) {
    let f = fixture(kind).await;
    let t = TenantId::generate();
    let mut second = request(t, "group/b", ExpectedVersion::NoStream, 1);
    second.guards = vec![("group/a".into(), ExpectedVersion::Exact(2))];
    let third = request(t, "group/a", ExpectedVersion::Exact(2), 1);
    let results = f.log.append_group(vec![request(t, "group/a", ExpectedVersion::NoStream, 2), second, third]).await.unwrap();
    assert_eq!(results.len(), 3);
    let commits: std::collections::BTreeSet<u64> =
        results.iter().flat_map(|r| r.events.iter().map(|e| e.position.commit)).collect();
    assert_eq!(commits.len(), 1, "one commit for the group: {commits:?}");
    assert_eq!(results[2].events[0].envelope.version, 3);
    assert_eq!(chain(&*f.store, t).await.len(), 4);
    // Each member is answered with the rows its events touched as the commit left them: a row
    // two members touched, in both answers.
    let key = |id: &str| RowKey { tenant: t.to_string(), kind: "count".into(), id: id.into() };
    let a = serde_json::json!({ "n": 3, "lastSeq": 4 });
    assert_eq!(results[0].row(&key("group/a")), Some(Some(&a)));
    assert_eq!(results[2].row(&key("group/a")), Some(Some(&a)));
    assert_eq!(results[1].rows, [(key("group/b"), Some(serde_json::json!({ "n": 1, "lastSeq": 3 })))]);
    assert_eq!(results[0].rows.len() + results[2].rows.len(), 2);

    // The second member's guard fails: nothing of the group lands, the singles around it do.
    let mut stale = request(t, "group/c", ExpectedVersion::NoStream, 1);
    stale.guards = vec![("group/a".into(), ExpectedVersion::Exact(2))];
    let group = f.log.append_group(vec![request(t, "group/d", ExpectedVersion::NoStream, 1), stale]);
    let before = f.log.append(request(t, "group/e", ExpectedVersion::NoStream, 1));
    let after = f.log.append(request(t, "group/f", ExpectedVersion::NoStream, 1));
    let (group, before, after) = tokio::join!(group, before, after);
    let error = group.unwrap_err();
    assert_eq!(error.code(), ErrorCode::Conflict, "{error}");
    assert!(error.to_string().contains("group/a"), "the refused member's error: {error}");
    before.unwrap();
    after.unwrap();
    assert_eq!(chain(&*f.store, t).await.len(), 6, "the two singles, nothing of the group");
    assert_eq!(f.log.append(request(t, "group/d", ExpectedVersion::NoStream, 1)).await.unwrap().events[0].envelope.version, 1);

    let too_big: Vec<AppendRequest> = (0..=bc_core::store::BATCH_EVENTS_MAX / 100)
        .map(|i| request(t, &format!("big/{i}"), ExpectedVersion::Any, 100))
        .collect();
    assert_eq!(f.log.append_group(too_big).await.unwrap_err().code(), ErrorCode::InvalidArgument);
    assert!(f.log.append_group(vec![]).await.unwrap().is_empty());

    // A group is one transaction: under the simulator's limit it counts as one append.
    f.log.appends_limit(Some(1));
    let three = || (0..3).map(|i| request(t, &format!("limit/{i}"), ExpectedVersion::Any, 1)).collect();
    assert_eq!(f.log.append_group(three()).await.unwrap().len(), 3);
    assert_eq!(f.log.append_group(three()).await.unwrap_err().code(), ErrorCode::Unavailable);
    assert_eq!(f.log.appends_limit(None), Some(0));
    assert_eq!(verify_all(&f).await, 10);
}

/// One append moving two streams (a reservation and a node): each event takes its own stream's
/// next version; racing appends on the same node version, each with its own first stream, let
/// exactly one through; an event for an unguarded stream is refused.
async fn multi_stream_appends(kind: Kind) {
    let f = fixture(kind).await;
    let t = TenantId::generate();
    f.log.append(request(t, "node/1", ExpectedVersion::NoStream, 2)).await.unwrap();
    let two = |rsv: &str, node_version: u64| {
        let mut r = request(t, rsv, ExpectedVersion::NoStream, 2);
        r.guards = vec![("node/1".into(), ExpectedVersion::Exact(node_version))];
        r.events[1].stream = Some("node/1".into());
        r
    };
    let done = f.log.append(two("rsv/a", 2)).await.unwrap();
    let placed: Vec<(String, u64)> = done.events.iter().map(|e| (e.envelope.stream.clone(), e.envelope.version)).collect();
    assert_eq!(placed, [("rsv/a".to_owned(), 1), ("node/1".to_owned(), 3)]);
    let stream = f.store.read_stream_rows(t, "node/1", 0, 10).await.unwrap();
    assert_eq!(stream.iter().map(|r| r.version).collect::<Vec<_>>(), [1, 2, 3]);
    // Six appends that all read node/1 at version 3: one wins, the rest are conflicts.
    let results = futures::future::join_all((0..6).map(|i| f.log.append(two(&format!("rsv/r{i}"), 3)))).await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
    assert!(results.iter().filter_map(|r| r.as_ref().err()).all(|e| e.code() == ErrorCode::Conflict));
    let mut unguarded = request(t, "rsv/z", ExpectedVersion::NoStream, 1);
    unguarded.events[0].stream = Some("node/1".into());
    assert_eq!(f.log.append(unguarded).await.unwrap_err().code(), ErrorCode::InvalidArgument);
    assert_eq!(verify_all(&f).await, 6);
}

/// The outbox store: one fan-out lease at a time, items inserted once however often a fan-out
/// repeats, claims that never hand one item to two owners, completions only by the lease
/// holder, requeue of dead items, and pruning of done ones (dead ones stay).
async fn outbox_leases_and_items(kind: Kind) {
    use bc_core::store::outbox::{Attempt, Completion, NewWorkItem, Outcome, WorkState};
    let f = fixture(kind).await;
    let s = &*f.store;
    let t = TenantId::generate();
    f.log.append(request(t, "thing/1", ExpectedVersion::NoStream, 3)).await.unwrap();
    let start = s.cursor_lease("c", "a", 1_000, 100).await.unwrap().expect("a new consumer's lease");
    assert_eq!(start, Position::START);
    assert!(s.cursor_lease("c", "b", 1_050, 100).await.unwrap().is_none(), "held by a until 1100");
    let items: Vec<NewWorkItem> = (0..3)
        .map(|i| NewWorkItem { tenant: t, id: format!("item{i}"), subject: "s".into(), payload: serde_json::json!({ "i": i }) })
        .collect();
    let to = Position { commit: 1, index: 2 };
    assert!(s.cursor_advance("c", "a", start, to, &items, 1_060).await.unwrap());
    assert!(
        !s.cursor_advance("c", "a", start, to, &items, 1_061).await.unwrap(),
        "the cursor moved: a stale advance writes nothing"
    );
    assert_eq!(s.cursor_lease("c", "b", 1_200, 100).await.unwrap(), Some(to), "b takes over after the lease");
    s.work_insert("c", &items, 1_300).await.unwrap();
    assert_eq!(s.work_counts("c").await.unwrap(), (3, 0, 0), "inserted once");
    // Claims: two owners at once get disjoint items; a lease blocks reclaiming until it ends.
    let a = s.work_claim("c", "a", 2_000, 1_000, 2).await.unwrap();
    let b = s.work_claim("c", "b", 2_000, 1_000, 5).await.unwrap();
    assert_eq!((a.len(), b.len()), (2, 1));
    assert!(s.work_claim("c", "b", 2_500, 1_000, 5).await.unwrap().is_empty());
    let attempt = |item: &bc_core::store::outbox::WorkItem, owner: &str| Attempt {
        number: item.attempts,
        at_ms: 2_100,
        latency_ms: 5,
        status: Some(500),
        error: Some("boom".into()),
        next_at_ms: None,
        owner: owner.into(),
    };
    // Only the holder completes; a batch records several.
    let wrong = [Completion { tenant: t, id: a[0].id.clone(), attempt: attempt(&a[0], "b"), outcome: Outcome::Done }];
    assert_eq!(s.work_complete_many("c", "b", &wrong).await.unwrap(), [false]);
    let done = [
        Completion { tenant: t, id: a[0].id.clone(), attempt: attempt(&a[0], "a"), outcome: Outcome::Done },
        Completion { tenant: t, id: a[1].id.clone(), attempt: attempt(&a[1], "a"), outcome: Outcome::Dead },
    ];
    assert_eq!(s.work_complete_many("c", "a", &done).await.unwrap(), [true, true]);
    assert_eq!(s.attempts("c", t, &a[0].id).await.unwrap().len(), 1);
    // b's lease runs out: a claims the item again, and b's late completion is refused.
    let again = s.work_claim("c", "a", 3_500, 1_000, 5).await.unwrap();
    assert_eq!((again.len(), again[0].id.as_str(), again[0].attempts), (1, b[0].id.as_str(), 2));
    assert!(!s.work_complete("c", t, &b[0].id, "b", &attempt(&b[0], "b"), &Outcome::Done).await.unwrap());
    assert!(s.work_complete("c", t, &again[0].id, "a", &attempt(&again[0], "a"), &Outcome::Done).await.unwrap());
    // Dead → queued again; prune removes done items only.
    assert!(s.work_requeue("c", t, &a[1].id, 4_000).await.unwrap());
    assert!(!s.work_requeue("c", t, &a[1].id, 4_000).await.unwrap(), "already pending");
    // A claim given back unattempted: only by its holder, at the attempt the claim counted; it
    // is due again at once, for anyone, with the claim's counts undone.
    let claimed = s.work_claim("c", "a", 4_000, 1_000, 5).await.unwrap();
    assert_eq!((claimed.len(), claimed[0].attempts, claimed[0].round_attempts), (1, 2, 1));
    let key = |item: &bc_core::store::outbox::WorkItem| (t, item.id.clone(), item.attempts);
    assert_eq!(s.work_release("c", "b", &[key(&claimed[0])]).await.unwrap(), 0, "not b's to give back");
    assert_eq!(s.work_release("c", "a", &[(t, claimed[0].id.clone(), 1)]).await.unwrap(), 0, "another attempt's claim");
    assert_eq!(s.work_release("c", "a", &[key(&claimed[0])]).await.unwrap(), 1);
    assert_eq!(s.work_release("c", "a", &[key(&claimed[0])]).await.unwrap(), 0, "given back once");
    assert!(s.work_release("c", "a", &[]).await.unwrap() == 0);
    let dead = s.work_claim("c", "b", 4_000, 1_000, 5).await.unwrap();
    assert_eq!((dead.len(), dead[0].attempts, dead[0].round_attempts), (1, 2, 1), "due at once, its counts as before");
    assert!(s.work_release("c", "b", &[key(&dead[0])]).await.unwrap() == 1);
    let dead = s.work_claim("c", "a", 4_000, 1_000, 5).await.unwrap();
    assert!(s.work_complete("c", t, &dead[0].id, "a", &attempt(&dead[0], "a"), &Outcome::Dead).await.unwrap());
    assert_eq!(s.work_get("c", t, &dead[0].id).await.unwrap().unwrap().state, WorkState::Dead);
    assert_eq!(s.work_prune("c", 1_000_000, 100).await.unwrap(), 2);
    assert_eq!(s.work_counts("c").await.unwrap(), (0, 0, 1));
    assert!(s.attempts("c", t, &a[0].id).await.unwrap().is_empty(), "a pruned item's attempts go with it");
    s.cursor_release("c", "b").await.unwrap();
    assert!(s.cursor_lease("c", "z", 1_250, 100).await.unwrap().is_some(), "released: anyone may take it");
}

/// A fan-out that writes its first items already claimed: those are its owner's,
/// with their first attempt counted as a claim counts it, so no claim hands them to anyone
/// before their lease ends; the rest are due for any claim; an item that existed is skipped and
/// never handed over; a lost lease writes and hands nothing; a handed item is completed and
/// given back as a claimed one is.
async fn outbox_items_written_claimed(kind: Kind) {
    use bc_core::store::outbox::{Attempt, Claim, Completion, NewWorkItem, Outcome, WorkState};
    let f = fixture(kind).await;
    let s = &*f.store;
    let t = TenantId::generate();
    f.log.append(request(t, "thing/1", ExpectedVersion::NoStream, 3)).await.unwrap();
    let item =
        |i: usize| NewWorkItem { tenant: t, id: format!("item{i}"), subject: "s".into(), payload: serde_json::json!({ "i": i }) };
    let start = s.cursor_lease("c", "a", 1_000, 10_000).await.unwrap().expect("a new consumer's lease");
    let one = Position { commit: 1, index: 0 };
    s.work_insert("c", &[item(0)], 1_000).await.unwrap();
    // item0 exists (unclaimed): of the three to claim, only item1 and item2 are a's.
    let items: Vec<NewWorkItem> = (0..4).map(item).collect();
    let claim = Claim { count: 3, lease_until_ms: 2_000 };
    let handed = s.cursor_advance_claiming("c", "a", start, one, &items, claim, 1_010).await.unwrap().expect("a holds the lease");
    let ids: Vec<&str> = handed.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, ["item1", "item2"]);
    assert!(
        handed
            .iter()
            .all(|i| (i.attempts, i.round_attempts, i.state, i.payload["i"].is_u64()) == (1, 1, WorkState::Pending, true))
    );
    assert_eq!(handed[0], s.work_get("c", t, "item1").await.unwrap().unwrap(), "as stored");
    // Until the lease ends a claim gets only the unclaimed ones (item0 and item3).
    let mut others: Vec<String> = s.work_claim("c", "b", 1_500, 1_000, 10).await.unwrap().into_iter().map(|i| i.id).collect();
    others.sort();
    assert_eq!(others, ["item0", "item3"]);
    // Done by a; given back by a (due at once, its counts undone).
    let attempt =
        Attempt { number: 1, at_ms: 1_100, latency_ms: 3, status: Some(204), error: None, next_at_ms: None, owner: "a".into() };
    let done = [Completion { tenant: t, id: "item1".into(), attempt, outcome: Outcome::Done }];
    assert_eq!(s.work_complete_many("c", "a", &done).await.unwrap(), [true]);
    assert_eq!(s.work_release("c", "a", &[(t, "item2".into(), 1)]).await.unwrap(), 1);
    let again = s.work_claim("c", "b", 1_600, 1_000, 10).await.unwrap();
    assert_eq!((again.len(), again[0].id.as_str(), again[0].attempts), (1, "item2", 1));
    // A fan-out redone from an older cursor, or by an owner without the lease, hands nothing.
    let two = Position { commit: 1, index: 1 };
    assert!(s.cursor_advance_claiming("c", "a", start, two, &items, claim, 1_700).await.unwrap().is_none());
    assert!(s.cursor_advance_claiming("c", "b", one, two, &items, claim, 1_700).await.unwrap().is_none());
    let redone = s.cursor_advance_claiming("c", "a", one, two, &items, claim, 1_700).await.unwrap();
    assert_eq!(redone, Some(Vec::new()), "every id exists: nothing is a's");
    assert_eq!(s.work_counts("c").await.unwrap(), (3, 1, 0));
}

/// Many tasks append to many tenants at once while a reader follows positions: every chain is
/// gap-free and verifies, and the reader sees every event exactly once, in position order.
async fn concurrent_appends_and_reader(kind: Kind) {
    const TASKS: usize = 16;
    const TENANTS: usize = 5;
    const APPENDS_PER_TASK: usize = 25;
    let f = Arc::new(fixture(kind).await);
    // A second appender on the same store plays a second process: its batches race the first's
    // and lose the chain-head check now and then, which must cost nothing but a retry.
    let second = Log::open(f.store.clone(), Arc::new(CountingProjector), Arc::new(LogKey::generate()), Arc::new(SystemClock))
        .await
        .unwrap();
    let mut keys = f.keys.clone();
    keys.insert(second.key.public());
    let second = Arc::new(second);
    let tenants: Vec<TenantId> = (0..TENANTS).map(|_| TenantId::generate()).collect();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (store, done) = (f.store.clone(), done.clone());
        tokio::spawn(async move {
            let mut seen: Vec<StoredEvent> = Vec::new();
            let mut after = Position::START;
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let page = decode_rows(store.read_after_rows(after, None, 200).await.unwrap()).unwrap();
                if let Some(last) = page.last() {
                    after = last.position;
                }
                let empty = page.is_empty();
                seen.extend(page);
                if finished && empty {
                    return seen;
                }
                tokio::task::yield_now().await;
            }
        })
    };
    let writers: Vec<_> = (0..TASKS)
        .map(|task| {
            let (f, second, tenants) = (f.clone(), second.clone(), tenants.clone());
            tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..APPENDS_PER_TASK {
                    let tenant = tenants[(task + i) % TENANTS];
                    let req = request(tenant, &format!("task/{task}"), ExpectedVersion::Any, 1 + i % 3);
                    let result = if task % 2 == 0 { f.log.append(req).await } else { second.append(req).await };
                    acked.extend(result.unwrap().events.into_iter().map(|e| e.envelope.id));
                }
                acked
            })
        })
        .collect();
    let mut acked = HashSet::new();
    for w in writers {
        acked.extend(w.await.unwrap());
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = reader.await.unwrap();
    let seen_ids: Vec<_> = seen.iter().map(|e| e.envelope.id).collect();
    let unique: HashSet<_> = seen_ids.iter().copied().collect();
    assert_eq!(unique.len(), seen_ids.len(), "the reader saw an event twice");
    assert_eq!(unique, acked, "the reader missed an acknowledged event, or saw one never acknowledged");
    assert!(seen.windows(2).all(|w| w[0].position < w[1].position));
    let mut per_tenant: HashMap<TenantId, Vec<u64>> = HashMap::new();
    for e in &seen {
        per_tenant.entry(e.envelope.tenant).or_default().push(e.envelope.seq);
    }
    for seqs in per_tenant.values() {
        assert_eq!(*seqs, (1..=seqs.len() as u64).collect::<Vec<_>>(), "in position order each chain is gap-free");
    }
    let mut total = 0;
    for (tenant, head) in f.store.heads().await.unwrap() {
        let rows = f.store.read_chain_rows(tenant, 1, 1000).await.unwrap();
        total += verify_chain(tenant, rows, Some((head.seq, head.hash)), &keys).unwrap_or_else(|p| panic!("{p}"));
    }
    assert_eq!(total as usize, acked.len());
    // Projection counts equal the number of events per stream.
    let mut counts: BTreeMap<(String, String), u64> = BTreeMap::new();
    for e in &seen {
        *counts.entry((e.envelope.tenant.to_string(), e.envelope.stream.clone())).or_default() += 1;
    }
    for ((tenant, stream), n) in counts {
        let row = f.store.row_get(&tenant, "count", &stream).await.unwrap().unwrap();
        assert_eq!(row.doc["n"], n);
    }
}

/// Transactions that end without a commit (a stale rebuild swap, a lost cursor lease, a refused
/// completion) and transactions abandoned mid-flight (a cancelled caller) leave nothing open:
/// far more of them than the pool has connections, and the store still appends, swaps and
/// leases, with nothing half-written.
async fn abandoned_transactions_leave_nothing_open(kind: Kind) {
    use bc_core::store::outbox::NewWorkItem;
    const ROUNDS: usize = 40;
    let f = fixture(kind).await;
    let s = &*f.store;
    let t = TenantId::generate();
    f.log.append(request(t, "thing/1", ExpectedVersion::NoStream, 2)).await.unwrap();
    let at = s.last_commit().await.unwrap();
    let rows = s.rows_all().await.unwrap();
    let lease = s.cursor_lease("c", "a", 1_000, 1_000_000).await.unwrap().expect("a new consumer's lease");
    let item = [NewWorkItem { tenant: t, id: "item".into(), subject: "s".into(), payload: serde_json::json!({}) }];
    for round in 0..ROUNDS {
        assert!(!s.rows_replace_all(&[], at + 1).await.unwrap(), "the log is not at that commit");
        assert!(!s.cursor_advance("c", "b", lease, Position { commit: 1, index: 0 }, &item, 1_001).await.unwrap());
        assert!(s.cursor_lease("c", "b", 1_002, 100).await.unwrap().is_none(), "a holds the lease");
        // Polled a few times, then dropped: somewhere between asking for a connection and
        // committing.
        let mut swap = std::pin::pin!(s.rows_replace_all(&[], at));
        for _ in 0..round % 8 {
            if futures::poll!(swap.as_mut()).is_ready() {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
    // Whatever the abandoned swaps did, they did all of it or none of it.
    let after = s.rows_all().await.unwrap();
    assert!(after == rows || after.is_empty(), "a swap was half done: {after:?}");
    assert_eq!(s.work_counts("c").await.unwrap(), (0, 0, 0), "no refused advance inserted its items");
    f.log.append(request(t, "thing/1", ExpectedVersion::Exact(2), 1)).await.unwrap();
    assert!(s.rows_replace_all(&rows, s.last_commit().await.unwrap()).await.unwrap());
    assert_eq!(s.rows_all().await.unwrap(), rows);
    assert!(s.cursor_advance("c", "a", lease, Position { commit: 1, index: 0 }, &item, 1_003).await.unwrap());
    assert_eq!(s.work_counts("c").await.unwrap(), (1, 0, 0));
    assert_eq!(verify_all(&f).await, 3);
}

/// The last pass of each reconciler per process: replaced by each pass with its count of
/// passes, kept per instance, and forgotten once the process has not passed for long.
async fn reconciler_passes(kind: Kind) {
    use bc_core::store::status::PassRecord;
    let f = fixture(kind).await;
    let pass = |name: &str, instance: &str, at: u64, ok: bool| PassRecord {
        name: name.into(),
        instance: instance.into(),
        started_at_ms: at,
        duration_ms: 12,
        ok,
        counts: [("expired".to_owned(), at % 7), ("activated".to_owned(), 2)].into(),
        error: (!ok).then(|| "the database went away".to_owned()),
        passes: 1,
    };
    f.store.pass_record(&pass("reservations", "a:1", 1_000, true), 0).await.unwrap();
    f.store.pass_record(&pass("reservations", "a:1", 2_000, false), 0).await.unwrap();
    f.store.pass_record(&pass("webhooks", "a:1", 2_500, true), 0).await.unwrap();
    f.store.pass_record(&pass("reservations", "b:2", 3_000, true), 0).await.unwrap();
    let all = f.store.passes().await.unwrap();
    let names: Vec<(&str, &str, u64)> = all.iter().map(|p| (p.name.as_str(), p.instance.as_str(), p.passes)).collect();
    assert_eq!(names, [("reservations", "a:1", 2), ("reservations", "b:2", 1), ("webhooks", "a:1", 1)]);
    let last = &all[0];
    assert_eq!((last.started_at_ms, last.ok, last.error.as_deref()), (2_000, false, Some("the database went away")));
    assert_eq!(last.counts, pass("x", "y", 2_000, false).counts, "counts round-trip");
    // A pass forgets the processes that stopped passing before the horizon.
    f.store.pass_record(&pass("webhooks", "c:3", 10_000, true), 2_600).await.unwrap();
    let left: Vec<String> = f.store.passes().await.unwrap().iter().map(|p| format!("{}@{}", p.name, p.instance)).collect();
    assert_eq!(left, ["reservations@b:2", "webhooks@c:3"]);
}

/// Lease renewals in one call, more than one statement's worth: each held or renewed, never
/// shortened; what is due to be reported follows.
async fn lease_renewals(kind: Kind) {
    const LEASES: u64 = 2_500;
    let f = fixture(kind).await;
    let tenant = TenantId::ROOT.to_string();
    let node = |i: u64| format!("node_{i:026}");
    let first: Vec<(String, String, u64)> = (0..LEASES).map(|i| (tenant.clone(), node(i), 10_000 + i)).collect();
    f.store.lease_renew(&first).await.unwrap();
    // Again: the even ones longer, the odd ones shorter (kept as they were).
    let again: Vec<(String, String, u64)> =
        (0..LEASES).map(|i| (tenant.clone(), node(i), if i % 2 == 0 { 50_000 + i } else { 5_000 })).collect();
    f.store.lease_renew(&again).await.unwrap();
    for i in [0, 1, 998, 999, 1_000, 1_001, LEASES - 2, LEASES - 1] {
        let lease = f.store.lease_get(&tenant, &node(i)).await.unwrap().unwrap();
        let expected = if i % 2 == 0 { 50_000 + i } else { 10_000 + i };
        assert_eq!(lease.expires_at_ms, expected, "lease {i}");
    }
    assert!(f.store.lease_get(&tenant, &node(LEASES)).await.unwrap().is_none());
    // Held, never reported ready: every one is a change to report; reported, none is until the
    // odd ones lapse.
    assert_eq!(f.store.lease_changes(0, 10_000).await.unwrap().len() as u64, LEASES);
    for i in 0..LEASES {
        f.store.lease_reported(&tenant, &node(i), true).await.unwrap();
    }
    assert!(f.store.lease_changes(10_000, 10_000).await.unwrap().is_empty());
    let lapsed = f.store.lease_changes(20_000, 10_000).await.unwrap();
    assert_eq!(lapsed.len() as u64, LEASES / 2);
    assert!(lapsed.iter().all(|l| l.reported_reachable && !l.held_at(20_000)));
}

/// Lease claims: the last claim names the holder (a renewal keeps it, and never shortens the
/// lease), and a gateway reads back only the claims written since a time, oldest first.
async fn lease_claims(kind: Kind) {
    use bc_core::store::lease::LeaseClaim;
    let f = fixture(kind).await;
    let tenant = TenantId::ROOT.to_string();
    let claim = |node: &str, holder: &str, at: u64| LeaseClaim {
        tenant: tenant.clone(),
        node: node.to_owned(),
        holder: holder.to_owned(),
        claimed_at_ms: at,
    };
    // A lease renewed before any claim (a gateway of an earlier version) is claimed over.
    f.store.lease_renew(&[(tenant.clone(), "node_a".into(), 9_000)]).await.unwrap();
    f.store.lease_claim(&claim("node_a", "gw1/1", 1_000), 5_000).await.unwrap();
    f.store.lease_claim(&claim("node_b", "gw1/2", 1_100), 6_000).await.unwrap();
    assert_eq!(f.store.lease_get(&tenant, "node_a").await.unwrap().unwrap().expires_at_ms, 9_000, "never shortened");
    // The other gateway's session of node_a binds later: its claim wins.
    f.store.lease_claim(&claim("node_a", "gw2/1", 2_000), 12_000).await.unwrap();
    f.store.lease_renew(&[(tenant.clone(), "node_a".into(), 13_000)]).await.unwrap();
    assert_eq!(f.store.lease_get(&tenant, "node_a").await.unwrap().unwrap().expires_at_ms, 13_000);
    let all = f.store.lease_claims_since(0, 100).await.unwrap();
    assert_eq!(all, [claim("node_b", "gw1/2", 1_100), claim("node_a", "gw2/1", 2_000)], "the last claim of each, oldest first");
    assert_eq!(f.store.lease_claims_since(1_500, 100).await.unwrap(), [claim("node_a", "gw2/1", 2_000)]);
    assert_eq!(f.store.lease_claims_since(0, 1).await.unwrap().len(), 1, "at most the limit");
    assert!(f.store.lease_claims_since(2_001, 100).await.unwrap().is_empty());
}

/// Decisions made while a commit is in flight: appends that depend on the batch in
/// flight (the next version of its stream, a retry of its idempotency key) are decided on top
/// of it and land in order; when a commit fails, whatever was decided on top of it is decided
/// again, and the chain has no gap. More appends than one batch takes
/// ([`bc_core::store::BATCH_EVENTS_MAX`]), all queued at once: the first batch commits while
/// the rest is decided on top of it.
async fn pipelined_decisions(kind: Kind) {
    const APPENDS: u64 = bc_core::store::BATCH_EVENTS_MAX as u64 * 3 / 2;
    let f = fixture(kind).await;
    let t = TenantId::generate();
    let mut keyed = request(t, "keyed/1", ExpectedVersion::NoStream, 1);
    keyed.idempotency_key = Some("once".into());
    // Queued in this order (the appender's queue is first in, first out): the first commits
    // alone while the rest are decided on top of it, each expecting exactly the version the
    // ones before it leave, so none passes unless what is in flight is counted.
    let mut all = vec![f.log.append(keyed.clone())];
    all.extend((0..APPENDS).map(|i| f.log.append(request(t, "counted/1", exact_or_new(i), 1))));
    all.push(f.log.append(keyed.clone()));
    let results = in_order(all).await;
    let results: Vec<_> = results.into_iter().map(|r| r.unwrap_or_else(|e| panic!("{e}"))).collect();
    assert!(!results[0].replayed && results.last().unwrap().replayed, "the retry of a key in flight replays it");
    assert_eq!(results[0].events, results.last().unwrap().events);
    let versions: Vec<u64> = results[1..=APPENDS as usize].iter().map(|r| r.events[0].envelope.version).collect();
    assert_eq!(versions, (1..=APPENDS).collect::<Vec<_>>());
    assert_eq!(verify_all(&f).await, APPENDS + 1);

    // A commit that fails: the batch in flight is answered with the failure, what was decided on
    // top of it is decided again and lands, with no gap in the chain or the stream.
    f.log.commits_fail(1);
    let results = in_order((0..APPENDS).map(|_| f.log.append(request(t, "counted/2", ExpectedVersion::Any, 1))).collect()).await;
    let failed = results.iter().filter(|r| r.is_err()).count();
    assert!(failed >= 1, "the first commit failed");
    for e in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(e.to_string().contains(bc_core::store::COMMIT_FAILED), "{e}");
    }
    let mut versions: Vec<u64> = results.iter().filter_map(|r| r.as_ref().ok()).map(|r| r.events[0].envelope.version).collect();
    versions.sort_unstable();
    assert_eq!(versions, (1..=APPENDS - failed as u64).collect::<Vec<_>>(), "{failed} failed");
    assert_eq!(verify_all(&f).await, APPENDS + 1 + APPENDS - failed as u64);
}

/// A commit whose answer is lost (a database failover between `COMMIT` and its answer): it was
/// made, every request in it is answered `Indeterminate`, and the same request again under the
/// same key replays the first result, exactly once, while one without a key, decided again on
/// the stream's real version, is refused (it is never appended twice). What was decided on top
/// of the lost batch is decided again and lands with no gap.
async fn a_lost_commit_answer_is_indeterminate_and_the_keyed_retry_replays_it(kind: Kind) {
    const APPENDS: u64 = 40;
    let f = fixture(kind).await;
    let t = TenantId::generate();
    let mut keyed = request(t, "failover/1", ExpectedVersion::NoStream, 1);
    keyed.idempotency_key = Some("failover-once".into());
    f.log.commit_answers_lost(1);
    let err = f.log.append(keyed.clone()).await.expect_err("the answer was lost");
    assert!(matches!(err, bc_core::Error::Indeterminate(_)), "{err:?}");
    assert_eq!(err.code(), bc_core::ErrorCode::Unavailable);
    assert!(err.to_string().contains(bc_core::store::COMMIT_ANSWER_LOST), "{err}");
    // It was made: the retry replays it, and the stream holds it once.
    let retry = f.log.append(keyed.clone()).await.expect("the keyed retry");
    assert!(retry.replayed, "the keyed retry of a commit that was made replays it");
    assert_eq!(retry.events[0].envelope.version, 1);
    let mut unkeyed = keyed.clone();
    unkeyed.idempotency_key = None;
    let refused = f.log.append(unkeyed).await.expect_err("a second first event");
    assert_eq!(refused.code(), bc_core::ErrorCode::Conflict, "{refused}");

    // Under load: the batch whose answer is lost and what was decided on top of it.
    f.log.commit_answers_lost(1);
    let results = in_order((0..APPENDS).map(|_| f.log.append(request(t, "failover/2", ExpectedVersion::Any, 1))).collect()).await;
    let lost = results.iter().filter(|r| r.is_err()).count() as u64;
    assert!(lost >= 1, "the first commit's answer was lost");
    for e in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(matches!(e, bc_core::Error::Indeterminate(_)), "{e:?}");
    }
    // Every request was made (the lost ones too): the stream has all of them, no gap.
    let mut versions: Vec<u64> = results.iter().filter_map(|r| r.as_ref().ok()).map(|r| r.events[0].envelope.version).collect();
    versions.sort_unstable();
    assert_eq!(versions, ((lost + 1)..=APPENDS).collect::<Vec<_>>(), "{lost} lost");
    assert_eq!(verify_all(&f).await, 1 + APPENDS);
}

/// Runs `appends` to the end, each queued in the order given: each is polled once, in order,
/// before any is waited on (`join_all` polls a long list in no set order), outside tokio's
/// cooperative budget (which makes a send wait after a hundred or so even with room in the
/// queue). One may finish on its first poll; `MaybeDone` keeps its answer.
async fn in_order<F: std::future::Future>(appends: Vec<F>) -> Vec<F::Output> {
    let mut all: Vec<_> = appends.into_iter().map(|a| Box::pin(futures::future::maybe_done(a))).collect();
    tokio::task::unconstrained(async {
        for append in all.iter_mut() {
            let _ = futures::poll!(append.as_mut());
        }
    })
    .await;
    futures::future::join_all(all.iter_mut().map(|a| a.as_mut())).await;
    all.iter_mut().map(|a| a.as_mut().take_output().expect("each ran to the end")).collect()
}

fn exact_or_new(version: u64) -> ExpectedVersion {
    if version == 0 { ExpectedVersion::NoStream } else { ExpectedVersion::Exact(version) }
}

macro_rules! every_backend {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Kind::Sqlite).await })*
        }
        mod sqlite_inline {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Kind::SqliteInline).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Kind::Postgres).await })*
        }
    };
}

every_backend!(
    appends_and_reads,
    tenants_are_listed,
    a_kinds_last_row,
    append_groups,
    lease_renewals,
    lease_claims,
    idempotency,
    optimistic_concurrency,
    multi_stream_appends,
    outbox_leases_and_items,
    outbox_items_written_claimed,
    concurrent_appends_and_reader,
    pipelined_decisions,
    a_lost_commit_answer_is_indeterminate_and_the_keyed_retry_replays_it,
    abandoned_transactions_leave_nothing_open,
    reconciler_passes
);
