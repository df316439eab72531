//! The watch's seam through the real gateway and a real database: a watcher behind the tail's
//! ring reads history itself, a page at a time, and joins the tail with no event lost and none
//! twice, while events keep coming (from this process, so the tail is woken, and from another
//! process on the same database, which the tail only finds by polling, so the watcher's own read
//! runs ahead of the tail). The ring, the pages and the client's buffer are made small so every
//! path is taken: reads of history, joins from the ring, hand-backs of a full buffer. The
//! assertions hold in every interleaving; the unit tests in `watch/tail.rs` pin each path.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, header};
use bc_core::clock::SystemClock;
use bc_core::id::{PoolId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, AppendResult, ExpectedVersion, Log, NewEvent};
use bc_gateway::AppState;
use bc_gateway::watch::{Tail, TailLimits};
use bc_projections::Projections;
use bc_projections::events as ev;
use futures::StreamExt;
use serde_json::{Value, json};
use tower::ServiceExt;

/// A ring of 8 events, pages of 5 rows, buffers of 4 events.
const SMALL: TailLimits = TailLimits {
    ring_events: 8,
    ring_bytes: 1 << 20,
    page_rows: 5,
    buffer_events: 4,
    answer_wait: Duration::from_millis(bc_gateway::watch::WATCH_ANSWER_WAIT_MS),
};

struct World {
    dir: tempfile::TempDir,
    router: axum::Router,
    token: String,
}

impl World {
    async fn new(limits: TailLimits) -> World {
        let dir = tempfile::tempdir().unwrap();
        let log = common::sqlite_log(dir.path()).await;
        let token = common::admin_token(&log).await;
        let mut state = AppState::new(log);
        state.watch_tail = Tail::new(limits);
        let router = bc_gateway::router(Arc::new(state));
        World { dir, router, token }
    }

    async fn pool(&self, name: &str) {
        let request = Request::post("/api/compute/pools.create")
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(json!({ "name": name }).to_string()))
            .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), 200, "pools.create {name}");
    }

    async fn watch(&self, query: &str) -> Events {
        let request = Request::get(format!("/watch{query}"))
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token))
            .body(Body::empty())
            .unwrap();
        let response = self.router.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), 200);
        Events { body: response.into_body().into_data_stream(), buffer: String::new() }
    }

    /// A log of its own on the same database file: another process's appends, of which this
    /// process's tail hears nothing until it polls.
    async fn other_process(&self) -> Arc<Log> {
        let store = Arc::new(SqliteStore::open(&self.dir.path().join("log.sqlite3")).await.unwrap());
        Arc::new(Log::open(store, Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap())
    }
}

async fn pool_via(log: &Log, name: &str) -> AppendResult {
    let payload = ev::to_cbor(&ev::PoolCreated::named(name.to_owned())).unwrap();
    log.append(AppendRequest {
        tenant: TenantId::ROOT,
        stream: format!("pool/{}", PoolId::generate()),
        expected: ExpectedVersion::NoStream,
        idempotency_key: None,
        actor: "other".into(),
        causation: None,
        correlation: None,
        fingerprint: None,
        guards: vec![],
        events: vec![NewEvent::new(ev::POOL_CREATED, payload)],
    })
    .await
    .unwrap()
}

/// A watch's response body, read an event at a time.
struct Events {
    body: axum::body::BodyDataStream,
    buffer: String,
}

impl Events {
    /// The next event's `id:` and its pool name (heartbeats skipped). Waits up to a minute, so
    /// a broken stream fails the test instead of hanging it.
    async fn next(&mut self) -> (String, String) {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let id = block.lines().find_map(|l| l.strip_prefix("id: "));
                let data = block.lines().find_map(|l| l.strip_prefix("data: "));
                if let (Some(id), Some(data)) = (id, data) {
                    let event: Value = serde_json::from_str(data).unwrap();
                    assert_eq!(event["position"], id, "the id is the position");
                    return (id.to_owned(), event["payload"]["name"].as_str().unwrap_or_default().to_owned());
                }
                continue;
            }
            let chunk = tokio::time::timeout(Duration::from_secs(60), self.body.next()).await.expect("an event within a minute");
            self.buffer.push_str(std::str::from_utf8(&chunk.expect("the stream goes on").unwrap()).unwrap());
        }
    }

    async fn names(&mut self, n: usize) -> Vec<String> {
        let mut positions = Vec::new();
        let mut names = Vec::new();
        for _ in 0..n {
            let (id, name) = self.next().await;
            positions.push(id.parse::<bc_core::event::Position>().unwrap());
            names.push(name);
        }
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "in position order, each once: {positions:?}");
        names
    }
}

fn named(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_behind_the_ring_reads_history_then_joins_with_no_gap_and_no_duplicate() {
    let world = Arc::new(World::new(SMALL).await);
    // A watcher at the end starts the tail; the ring then holds only the last 8 of 40 pools.
    let _idle = world.watch("?types=webhook.*").await;
    for i in 0..40 {
        world.pool(&format!("p{i}")).await;
    }
    let mut late = world.watch("?since=start&types=pool.*").await;
    // It is reading history (its buffer of 4 full until the test reads) while 40 more come.
    let more = {
        let world = world.clone();
        tokio::spawn(async move {
            for i in 40..80 {
                world.pool(&format!("p{i}")).await;
            }
        })
    };
    let mut names = late.names(10).await;
    more.await.unwrap();
    names.extend(late.names(70).await);
    assert_eq!(names, named("p", 0..80));
    // Joined at the end: the next pool is the next event, nothing replayed before it.
    world.pool("p80").await;
    assert_eq!(late.names(1).await, ["p80"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_whose_read_ran_ahead_of_the_tail_gets_nothing_twice() {
    // Pages of 64 rows: the watcher's one read of history takes everything in the database,
    // the other process's pools too, while the tail has read only this process's.
    let world = World::new(TailLimits { page_rows: 64, ..SMALL }).await;
    let _idle = world.watch("?types=webhook.*").await;
    for i in 0..40 {
        world.pool(&format!("p{i}")).await;
    }
    // Another process commits 10 pools: the tail finds them at its next poll.
    let other = world.other_process().await;
    for i in 0..10 {
        pool_via(&other, &format!("q{i}")).await;
    }
    // This watcher's own read reaches the end of the database, past the tail's head, and it
    // joins there; the tail then reads the 10 and must not send them again.
    let mut late = world.watch("?since=start&types=pool.*").await;
    let mut names = late.names(50).await;
    world.pool("p40").await;
    for i in 10..13 {
        pool_via(&other, &format!("q{i}")).await;
    }
    names.extend(late.names(4).await);
    let mut want = named("p", 0..40);
    want.extend(named("q", 0..10));
    want.push("p40".into());
    want.extend(named("q", 10..13));
    assert_eq!(names, want);
}

/// A watcher resuming from a recent position (a reconnect) is served from the ring, exactly
/// after that position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_within_the_ring_resumes_exactly_after_its_position() {
    let world = World::new(SMALL).await;
    let mut first = world.watch("?types=pool.*").await;
    for i in 0..6 {
        world.pool(&format!("p{i}")).await;
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(first.next().await);
    }
    drop(first);
    let (last_id, last_name) = seen.last().unwrap().clone();
    assert_eq!(last_name, "p2");
    let request = Request::get("/watch?types=pool.*")
        .header(header::AUTHORIZATION, format!("Bearer {}", world.token))
        .header("last-event-id", &last_id)
        .body(Body::empty())
        .unwrap();
    let response = world.router.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let mut again = Events { body: response.into_body().into_data_stream(), buffer: String::new() };
    assert_eq!(again.names(3).await, named("p", 3..6));
}

/// The tail reads a commit for the watchers once the commit's writers have let their answers go
/// (`Log::answered`), so a write is answered before its fan-out; but a writer that keeps its
/// answer holds the watchers back `WATCH_ANSWER_WAIT_MS` at most, never until it lets go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_keeps_its_answer_does_not_hold_the_watchers_back() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let token = common::admin_token(&log).await;
    let router = bc_gateway::router(Arc::new(AppState::new(log.clone())));
    let world = World { dir, router, token };
    let mut events = world.watch("").await;
    let kept = pool_via(&log, "kept").await;
    let commit = kept.events[0].position.commit;
    // Seconds, where the bound is milliseconds: a tail that waited for the answer to be let go
    // would not send it at all while the answer is kept.
    let (id, name) = tokio::time::timeout(Duration::from_secs(10), events.next()).await.expect("the event, with its answer kept");
    assert_eq!((id, name.as_str()), (kept.events[0].position.to_string(), "kept"));
    assert!(*log.answered().borrow() < commit, "the answer is still kept, and the event came anyway");
    drop(kept);
    assert_eq!(*log.answered().borrow(), commit);
}

/// And the tail does wait for them: with the bound made long, an event whose writer keeps its
/// answer is not sent until the answer is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tail_fans_a_commit_out_once_its_answers_are_let_go() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let token = common::admin_token(&log).await;
    let mut state = AppState::new(log.clone());
    state.watch_tail = Tail::new(TailLimits { answer_wait: Duration::from_secs(600), ..TailLimits::default() });
    let world = World { dir, router: bc_gateway::router(Arc::new(state)), token };
    let mut events = world.watch("").await;
    let kept = pool_via(&log, "kept").await;
    let position = kept.events[0].position.to_string();
    let early = tokio::time::timeout(Duration::from_millis(300), events.next()).await;
    assert!(early.is_err(), "sent while its answer was kept: {early:?}");
    drop(kept);
    let (id, name) = tokio::time::timeout(Duration::from_secs(10), events.next()).await.expect("the event, its answer let go");
    assert_eq!((id, name.as_str()), (position, "kept"));
}
