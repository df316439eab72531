//! Hardening of the gateway: connections (slow clients, the connection cap, graceful
//! shutdown), watchers (slots per tenant and per key; a producer ends with its client) and
//! growth bounds, below; first, the regression where a stated `ifVersion` overrode the
//! version a handler checked. The race
//! (a handler reads, another request appends, the handler appends at the client's version) is
//! made deterministic with a stale read replica: the gateway reads from a copy of the
//! projection rows taken before the other append, and appends through the real log. A
//! projector that counts what it folds shows whether the request reached the fold.

use crate::common;

use common::{call, call_with, closed_after};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, header};
use bc_core::clock::SystemClock;
use bc_core::event::StoredEvent;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log, Projector, RowKey, RowStore, SecretStore};
use bc_gateway::AppState;
use bc_projections::events as ev;
use bc_projections::{KIND_POOL, Projections};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

/// The real projector, counting the `pool.updated` events it folds.
struct CountingProjector {
    pool_updates_folded: AtomicU64,
}

impl Projector for CountingProjector {
    fn touches(&self, event: &StoredEvent, out: &mut Vec<RowKey>) {
        Projections.touches(event, out)
    }

    fn apply(&self, key: &RowKey, current: Option<Value>, event: &StoredEvent) -> bc_core::Result<Option<Value>> {
        if event.envelope.event_type == ev::POOL_UPDATED {
            self.pool_updates_folded.fetch_add(1, Ordering::SeqCst);
        }
        Projections.apply(key, current, event)
    }
}

struct World {
    _dir: tempfile::TempDir,
    store: Arc<dyn EventStore>,
    log: Arc<Log>,
    projector: Arc<CountingProjector>,
    router: axum::Router,
    token: String,
}

impl World {
    async fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let store: Arc<dyn EventStore> = store;
        let projector = Arc::new(CountingProjector { pool_updates_folded: AtomicU64::new(0) });
        let log = Arc::new(
            Log::open(store.clone(), projector.clone(), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap(),
        );
        let (router, token) = common::gateway_over(&log).await;
        World { _dir: dir, store, log, projector, router, token }
    }

    /// A gateway that reads from a copy of the projection rows as they are now, and appends
    /// through the real log: every read it makes from now on is stale.
    async fn stale_gateway(&self) -> (tempfile::TempDir, axum::Router) {
        let dir = tempfile::tempdir().unwrap();
        let replica = Arc::new(SqliteStore::open(&dir.path().join("replica.sqlite3")).await.unwrap());
        replica.migrate().await.unwrap();
        assert!(replica.rows_replace_all(&self.store.rows_all().await.unwrap(), 0).await.unwrap());
        // The administrator's token hash lives in the secret store, not in the rows.
        let root = bc_core::id::TenantId::ROOT;
        let key_id = self.token.split_once('.').unwrap().0;
        let hash = self.store.secret_get(root, key_id).await.unwrap().expect("the admin key's hash");
        replica.secret_put(root, key_id, &hash, 0).await.unwrap();
        let mut state = AppState::new(self.log.clone());
        state.store = replica;
        (dir, bc_gateway::router(Arc::new(state)))
    }

    fn pool_updates_folded(&self) -> u64 {
        self.projector.pool_updates_folded.load(Ordering::SeqCst)
    }

    async fn pool(&self, pool: &str) -> bc_projections::PoolDoc {
        let row = self.store.row_find(KIND_POOL, pool).await.unwrap().expect("the pool");
        serde_json::from_value(row.doc).unwrap()
    }
}

/// Before the fix, the stale handler checked version 1 and appended at the client's version 2:
/// the update landed on a pool changed since, and it was folded.
#[tokio::test]
async fn pools_update_with_an_if_version_other_than_the_one_read_is_conflict_and_appends_nothing() {
    let world = World::new().await;
    let (status, pool) = call(&world.router, &world.token, "pools.create", json!({ "name": "gpu-a" })).await;
    assert_eq!(status, 200, "{pool}");
    let pool_id = pool["poolId"].as_str().unwrap().to_owned();
    let (_replica, stale) = world.stale_gateway().await;
    let (status, body) =
        call(&world.router, &world.token, "pools.update", json!({ "poolId": pool_id, "description": "moved" })).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(world.pool(&pool_id).await.version, 2);
    let (folded, commit) = (world.pool_updates_folded(), world.store.last_commit().await.unwrap());

    // The stale handler reads version 1; the client states 2, the version now in the log.
    let (status, body) =
        call(&stale, &world.token, "pools.update", json!({ "poolId": pool_id, "ifVersion": 2, "name": "renamed" })).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["code"], "CONFLICT");
    assert_eq!(world.store.last_commit().await.unwrap(), commit, "nothing is appended");
    assert_eq!(world.pool_updates_folded(), folded, "nothing reaches the fold");
    let doc = world.pool(&pool_id).await;
    assert_eq!((doc.version, doc.name.as_str()), (2, "gpu-a"));

    // Without ifVersion the handler appends at the version it read: a conflict in the log.
    let (status, body) = call(&stale, &world.token, "pools.update", json!({ "poolId": pool_id, "name": "renamed" })).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("CONFLICT")), "{body}");
    assert_eq!(world.store.last_commit().await.unwrap(), commit);
}

/// The race of the issue: a handler checks that the pool is live, the pool is archived, and the
/// update (stating the archived pool's version) was appended and folded onto the archived pool.
#[tokio::test]
async fn an_update_racing_an_archive_with_a_stale_if_version_does_not_reach_the_fold() {
    let world = World::new().await;
    let (status, pool) = call(&world.router, &world.token, "pools.create", json!({ "name": "gpu-b" })).await;
    assert_eq!(status, 200, "{pool}");
    let pool_id = pool["poolId"].as_str().unwrap().to_owned();
    let (_replica, stale) = world.stale_gateway().await;
    let (status, body) = call(&world.router, &world.token, "pools.archive", json!({ "poolId": pool_id })).await;
    assert_eq!(status, 200, "{body}");
    let (folded, commit) = (world.pool_updates_folded(), world.store.last_commit().await.unwrap());

    let (status, body) =
        call(&stale, &world.token, "pools.update", json!({ "poolId": pool_id, "ifVersion": 2, "name": "renamed" })).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("CONFLICT")), "{body}");
    assert_eq!(world.pool_updates_folded(), folded, "the update never reaches the fold");
    assert_eq!(world.store.last_commit().await.unwrap(), commit, "nothing is appended");
    let doc = world.pool(&pool_id).await;
    assert!(doc.archived);
    assert_eq!((doc.version, doc.name.as_str()), (2, "gpu-b"));
}

/// The poisoning of the issue: a request racing a delete (an update at the deleted webhook's
/// version, checked against the live one) reached the fold, which failed inside the commit, and
/// every request of its batch failed with it, other tenants' included. Tenants append
/// concurrently while one sends the racing `ifVersion`: it alone is refused, every other
/// request succeeds.
#[tokio::test]
async fn a_racing_if_version_does_not_fail_other_tenants_appends() {
    let world = World::new().await;
    let mut tenants = Vec::new();
    for name in ["t1", "t2", "t3"] {
        let (status, tenant) = call(&world.router, &world.token, "tenants.create", json!({ "name": name })).await;
        assert_eq!(status, 200, "{tenant}");
        tenants.push(tenant["tenantId"].as_str().unwrap().to_owned());
    }
    let body = json!({ "url": "https://hooks.example.com/compute", "eventTypes": ["pool.*"] });
    let (status, webhook) = call(&world.router, &world.token, "webhooks.create", body).await;
    assert_eq!(status, 200, "{webhook}");
    let webhook_id = webhook["webhookId"].as_str().unwrap().to_owned();
    let (_replica, stale) = world.stale_gateway().await;
    let (status, body) = call(&world.router, &world.token, "webhooks.delete", json!({ "webhookId": webhook_id })).await;
    assert_eq!(status, 200, "{body}");

    let racing =
        call(&stale, &world.token, "webhooks.update", json!({ "webhookId": webhook_id, "ifVersion": 2, "description": "x" }));
    let others = (0..12).map(|i| {
        let body = json!({ "tenantId": tenants[i % tenants.len()], "name": format!("p{i}") });
        call(&world.router, &world.token, "pools.create", body)
    });
    let (racing, others) = tokio::join!(racing, futures::future::join_all(others));
    for (status, body) in others {
        assert_eq!(status, 200, "every other request succeeds: {body}");
    }
    assert_eq!((racing.0, racing.1["code"].as_str()), (409, Some("CONFLICT")), "{}", racing.1);
}

// ---------------------------------------------------------------------------------------------
// Connections. A real listener on loopback, served by `bc_gateway::serve` with short
// limits, and raw TCP clients that misbehave.

/// A gateway served on `127.0.0.1:0` with `limits`: the address, the administrator's token, and
/// a sender that shuts the server down.
struct Served {
    _dir: tempfile::TempDir,
    addr: std::net::SocketAddr,
    token: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Served {
    async fn start(limits: bc_gateway::ServeLimits) -> Served {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let log =
            Arc::new(Log::open(store, Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap());
        let (_, token) = common::gateway_over(&log).await;
        let mut state = AppState::new(log);
        state.limits = limits;
        let state = Arc::new(state);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(bc_gateway::serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Served { _dir: dir, addr, token, stop: Some(stop), served }
    }

    async fn connect(&self) -> tokio::net::TcpStream {
        tokio::net::TcpStream::connect(self.addr).await.unwrap()
    }

    /// `GET path` on a new connection: the status line, or `None` if nothing came within
    /// `within`.
    async fn get(&self, path: &str, within: Duration) -> Option<String> {
        let mut stream = self.connect().await;
        stream.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        match tokio::time::timeout(within, stream.read_to_end(&mut answer)).await {
            Ok(_) => Some(String::from_utf8_lossy(&answer).lines().next().unwrap_or_default().to_owned()),
            Err(_) => None,
        }
    }
}

fn limits() -> bc_gateway::ServeLimits {
    bc_gateway::ServeLimits::default()
}

const HEADER_TIMEOUT: Duration = Duration::from_millis(400);
/// How long a test waits for the header timeout to close a connection: far past it, and a
/// third of hyper's own 30 s header timeout, so only ours can have closed it. A bound on what
/// closed it, not on speed: a close is awaited, never timed.
const OTHER_TIMEOUTS_BELOW: Duration = Duration::from_secs(10);

/// Regression: 300 connections that sent half a request line were all still held after 35 s.
/// A client that sends nothing, half a request line, or a request without its final blank line
/// is dropped within the header timeout; so is a keep-alive connection that sends no next
/// request. One that completes its request in time is answered.
#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_dropped_within_the_header_timeout() {
    let served = Served::start(bc_gateway::ServeLimits { header_read_timeout: HEADER_TIMEOUT, ..limits() }).await;
    let partial: [&[u8]; 3] = [b"", b"GET /hea", b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: 1\r\n"];
    for sent in partial {
        let mut stream = served.connect().await;
        stream.write_all(sent).await.unwrap();
        // Closed well before hyper's own 30 s header timeout could close it: ours did.
        let closed = closed_after(&mut stream, OTHER_TIMEOUTS_BELOW).await;
        assert!(closed.is_some(), "{:?}: still open after {OTHER_TIMEOUTS_BELOW:?}", String::from_utf8_lossy(sent));
    }
    // Many at once, as in the finding: all dropped.
    let mut many = Vec::new();
    for _ in 0..50 {
        let mut stream = served.connect().await;
        stream.write_all(b"GET /heal").await.unwrap();
        many.push(stream);
    }
    for stream in &mut many {
        assert!(closed_after(stream, OTHER_TIMEOUTS_BELOW).await.is_some(), "every half-sent request is dropped");
    }
    // A whole request is answered, then the idle keep-alive connection is closed in turn.
    let mut stream = served.connect().await;
    stream.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut first = [0u8; 12];
    stream.read_exact(&mut first).await.unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    assert!(closed_after(&mut stream, OTHER_TIMEOUTS_BELOW).await.is_some(), "an idle keep-alive connection is closed");
}

/// Regression: a body that trickles in held its request slot for as long as it trickled. With one
/// request slot, a client trickling a body holds it until the body deadline; then it is refused
/// (`Connection: close`) and the slot is free: a waiting request is answered at the deadline
/// (0.6 s), long before the body would have ended (60 s): the bound between them tells the two
/// apart by a wide margin, whatever the machine's load.
#[tokio::test]
async fn a_trickled_body_frees_its_request_slot_at_the_deadline() {
    let body_deadline = Duration::from_millis(600);
    let served = Served::start(bc_gateway::ServeLimits { body_read_timeout: body_deadline, requests_max: 1, ..limits() }).await;
    let mut slow = served.connect().await;
    let head = format!(
        "POST /api/compute/pools.list HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: 600\r\n\r\n{{",
        served.token
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    // 600 bytes, one per 100 ms: 60 s of body, a hundred times the deadline.
    let (mut reader, mut writer) = slow.into_split();
    let trickle = tokio::spawn(async move {
        for _ in 0..599 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if writer.write_all(b" ").await.is_err() {
                return;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The one slot is the trickler's: this request waits for it (the OpenAPI document: a public
    // route under the limit; `/healthz` is outside it).
    let answered = served.get("/api/compute/openapi.json", Duration::from_secs(30)).await;
    let waited = started.elapsed();
    assert_eq!(answered.as_deref(), Some("HTTP/1.1 200 OK"), "the document is answered");
    assert!(waited >= body_deadline - Duration::from_millis(100), "it waited for the slot: {waited:?}");
    assert!(waited < Duration::from_secs(30), "the slot was freed at the deadline, not when the body ended: {waited:?}");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), reader.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("did not arrive within") && answer.to_lowercase().contains("connection: close"), "{answer}");
    trickle.abort();
}

/// Open connections are capped. With a cap of 2, a third connection's request gets no answer
/// while two are open (with no cap it is answered at once), and is answered as soon as one of
/// the two closes.
#[tokio::test]
async fn open_connections_are_capped() {
    let served = Served::start(bc_gateway::ServeLimits { connections_max: 2, ..limits() }).await;
    let mut first = served.connect().await;
    let second = served.connect().await;
    // Both are accepted (a request on the first is answered).
    first.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut status = [0u8; 12];
    first.read_exact(&mut status).await.unwrap();
    assert_eq!(&status, b"HTTP/1.1 200");
    // The third: its request is sent, and nothing comes back while the two are open.
    let mut third = served.connect().await;
    third.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let early = tokio::time::timeout(WHILE_CAPPED, third.read_buf(&mut answer)).await;
    assert!(early.is_err(), "the third connection was served while two were open: {:?}", String::from_utf8_lossy(&answer));
    // One closes: the third is accepted and answered.
    drop(second);
    tokio::time::timeout(Duration::from_secs(30), third.read_to_end(&mut answer))
        .await
        .expect("answered once one closed")
        .unwrap();
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200 OK"), "{}", String::from_utf8_lossy(&answer));
    drop(first);
}

/// How long the capped connection's request is watched for an answer that must not come.
const WHILE_CAPPED: Duration = Duration::from_millis(500);

/// Graceful shutdown is kept: an open watch stream ends, the server stops, and a request that
/// was being answered finishes.
#[tokio::test]
async fn graceful_shutdown_ends_watch_streams_and_stops() {
    let mut served = Served::start(limits()).await;
    let mut watch = served.connect().await;
    let request = format!("GET /watch HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\n\r\n", served.token);
    watch.write_all(request.as_bytes()).await.unwrap();
    let mut status = [0u8; 12];
    watch.read_exact(&mut status).await.unwrap();
    assert_eq!(&status, b"HTTP/1.1 200");
    let _ = served.stop.take().unwrap().send(());
    let stopped = tokio::time::timeout(Duration::from_secs(10), &mut served.served).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "the server stopped: {stopped:?}");
    assert!(closed_after(&mut watch, Duration::from_secs(5)).await.is_some(), "the watch stream ended");
}

// ---------------------------------------------------------------------------------------------
// Watcher slots per tenant and per key; a producer ends with its client.

/// Opens `GET /watch` (`query` appended) as `token`: the response, whose body is the stream.
async fn watch(router: &axum::Router, token: &str, query: &str) -> axum::response::Response {
    let request = Request::get(format!("/watch{query}"))
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .body(Body::empty())
        .unwrap();
    router.clone().oneshot(request).await.unwrap()
}

/// A new key in `tenant` that may read events.
async fn events_key(router: &axum::Router, admin: &str, tenant: &str, name: &str) -> String {
    let body = json!({ "tenantId": tenant, "name": name, "actions": ["compute:events:read"] });
    let (status, key) = call(router, admin, "apiKeys.create", body).await;
    assert_eq!(status, 200, "{key}");
    key["token"].as_str().unwrap().to_owned()
}

/// Waits up to 5 s for the gateway's live watch producers to number `n`.
async fn producers_become(state: &AppState, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while state.watchers.held() != n {
        assert!(Instant::now() < deadline, "{} producers live, not {n}", state.watchers.held());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Regression: the 256 watcher slots were shared by all tenants, so one key could take them all.
/// A key holds at most `WATCHERS_PER_KEY_MAX`, a tenant's keys `WATCHERS_PER_TENANT_MAX`
/// together; another tenant still gets a slot.
#[tokio::test]
async fn watchers_are_limited_per_key_and_per_tenant() {
    use bc_gateway::watch::{WATCHERS_PER_KEY_MAX, WATCHERS_PER_TENANT_MAX};
    let world = World::new().await;
    let state = Arc::new(AppState::new(world.log.clone()));
    let router = bc_gateway::router(state.clone());
    let (status, tenant) = call(&router, &world.token, "tenants.create", json!({ "name": "acme" })).await;
    assert_eq!(status, 200, "{tenant}");
    let acme = tenant["tenantId"].as_str().unwrap().to_owned();
    let keys_per_tenant = WATCHERS_PER_TENANT_MAX / WATCHERS_PER_KEY_MAX;
    let mut keys = Vec::new();
    for i in 0..=keys_per_tenant {
        keys.push(events_key(&router, &world.token, &acme, &format!("k{i}")).await);
    }
    let mut held = Vec::new();
    for _ in 0..WATCHERS_PER_KEY_MAX {
        let response = watch(&router, &keys[0], "").await;
        assert_eq!(response.status(), 200);
        held.push(response);
    }
    let refused = watch(&router, &keys[0], "").await;
    assert_eq!(refused.status(), 503, "the key's limit");
    let body = axum::body::to_bytes(refused.into_body(), 1 << 16).await.unwrap();
    assert!(String::from_utf8_lossy(&body).contains("this key has"), "{}", String::from_utf8_lossy(&body));
    for key in &keys[1..keys_per_tenant] {
        for _ in 0..WATCHERS_PER_KEY_MAX {
            let response = watch(&router, key, "").await;
            assert_eq!(response.status(), 200);
            held.push(response);
        }
    }
    assert_eq!(held.len(), WATCHERS_PER_TENANT_MAX);
    let refused = watch(&router, &keys[keys_per_tenant], "").await;
    assert_eq!(refused.status(), 503, "the tenant's limit, for a key with no watcher yet");
    let body = axum::body::to_bytes(refused.into_body(), 1 << 16).await.unwrap();
    assert!(String::from_utf8_lossy(&body).contains(&format!("tenant {acme} has")), "{}", String::from_utf8_lossy(&body));
    // Another tenant (the root's administrator) is not starved.
    let other = watch(&router, &world.token, "").await;
    assert_eq!(other.status(), 200);
    // One closed: its key may watch again.
    held.remove(0);
    producers_become(&state, WATCHERS_PER_TENANT_MAX).await;
    let again = watch(&router, &keys[0], "").await;
    assert_eq!(again.status(), 200);
    drop((held, other, again));
    producers_become(&state, 0).await;
}

/// Regression: a watcher's producer task outlived its closed client and kept scanning. A producer
/// ends, and frees its slot, as soon as its client is gone: one idle at the end of the log, and
/// one that replayed events its filter drops (so it never tried to send) and then waits.
#[tokio::test]
async fn a_watch_producer_stops_when_its_client_is_gone() {
    let world = World::new().await;
    let state = Arc::new(AppState::new(world.log.clone()));
    let router = bc_gateway::router(state.clone());
    for i in 0..300 {
        let (status, body) = call(&router, &world.token, "pools.create", json!({ "name": format!("p{i}") })).await;
        assert_eq!(status, 200, "{body}");
    }
    let idle = watch(&router, &world.token, "").await;
    assert_eq!(idle.status(), 200);
    // Replays 300 pool events, none of which it sends; the watch then waits for new events.
    let scanning = watch(&router, &world.token, "?since=start&types=webhook.*").await;
    assert_eq!(scanning.status(), 200);
    producers_become(&state, 2).await;
    drop(idle);
    producers_become(&state, 1).await;
    drop(scanning);
    producers_become(&state, 0).await;
}

// ---------------------------------------------------------------------------------------------
// Growth bounds.

/// Regression: labels and taints added up on a node without a cap. A node carries at most
/// `NODE_KEYS_MAX` of each; a change that would pass it is refused, one that makes room is not.
#[tokio::test]
async fn labels_and_taints_per_node_are_capped() {
    use bc_projections::decide::NODE_KEYS_MAX;
    let world = World::new().await;
    let (_, pool) = call(&world.router, &world.token, "pools.create", json!({ "name": "caps" })).await;
    let labels: serde_json::Map<String, Value> = (0..NODE_KEYS_MAX).map(|i| (format!("k{i}"), json!("v"))).collect();
    let body = json!({ "poolId": pool["poolId"], "name": "n1", "gpus": [], "labels": labels });
    let (status, node) = call(&world.router, &world.token, "nodes.register", body).await;
    assert_eq!(status, 200, "{node}");
    let node_id = node["nodeId"].as_str().unwrap().to_owned();
    let (status, body) =
        call(&world.router, &world.token, "nodes.label", json!({ "nodeId": node_id, "set": { "extra": "v" } })).await;
    // The node's keys refuse it, not the request's form: INVALID_STATE, with what to do.
    assert_eq!((status, body["code"].as_str()), (409, Some("INVALID_STATE")), "{body}");
    assert!(body["message"].as_str().unwrap().contains(&format!("{} labels", NODE_KEYS_MAX + 1)), "{body}");
    assert!(body["details"]["hint"].as_str().is_some_and(|h| h.contains("remove")), "{body}");
    let change = json!({ "nodeId": node_id, "set": { "extra": "v" }, "remove": ["k0"] });
    let (status, body) = call(&world.router, &world.token, "nodes.label", change).await;
    assert_eq!(status, 200, "{body}");
    // Taints, 64 at a time (a call's own bound), then one more.
    let taints: serde_json::Map<String, Value> = (0..NODE_KEYS_MAX).map(|i| (format!("t{i}"), json!("NoSchedule"))).collect();
    let (status, body) = call(&world.router, &world.token, "nodes.taint", json!({ "nodeId": node_id, "set": taints })).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) =
        call(&world.router, &world.token, "nodes.taint", json!({ "nodeId": node_id, "set": { "t-extra": "x" } })).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["message"].as_str().unwrap().contains("taints"), "{body}");
}

/// Regression: each replay of `webhooks.create` with the same idempotency key stored a new
/// secret row, and rotated-out secrets were never deleted. Replays store nothing; a rotation
/// deletes the secrets whose overlap is over.
#[tokio::test]
async fn webhook_secret_rows_do_not_grow_with_replays_and_rotations() {
    let world = World::new().await;
    let root = bc_core::id::TenantId::ROOT;
    let body = json!({ "url": "https://hooks.example.com/compute", "eventTypes": ["pool.*"] });
    // The administrator's key hash is a secret row too.
    let before = world.store.secrets_count(root).await.unwrap();
    let (status, first) = call_with(&world.router, &world.token, "webhooks.create", body.clone(), Some("create-1")).await;
    assert_eq!(status, 200, "{first}");
    for _ in 0..5 {
        let (status, again) = call_with(&world.router, &world.token, "webhooks.create", body.clone(), Some("create-1")).await;
        assert_eq!((status, &again["replayed"]), (200, &json!(true)), "{again}");
    }
    assert_eq!(world.store.secrets_count(root).await.unwrap(), before + 1, "replays store no secret rows");
    let webhook_id = first["webhookId"].as_str().unwrap().to_owned();
    // A rotation with an overlap keeps the old secret for it: two rows.
    let rotate = |keep_s: u64| json!({ "webhookId": webhook_id, "previousValidS": keep_s });
    let (status, body) = call(&world.router, &world.token, "webhooks.rotateSecret", rotate(1)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(world.store.secrets_count(root).await.unwrap(), before + 2);
    // Once the overlap is over, the next rotation deletes it (and keeps none, with no overlap).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, body) = call(&world.router, &world.token, "webhooks.rotateSecret", rotate(0)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(world.store.secrets_count(root).await.unwrap(), before + 1, "only the current secret is left");
}
