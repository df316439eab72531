//! Issue 15, finding 4: a stated `ifVersion` overrode the version a handler checked. The race
//! (a handler reads, another request appends, the handler appends at the client's version) is
//! made deterministic with a stale read replica: the gateway reads from a copy of the
//! projection rows taken before the other append, and appends through the real log. A
//! projector that counts what it folds shows whether the request reached the fold.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Body;
use axum::http::{Request, header};
use bc_core::clock::SystemClock;
use bc_core::event::StoredEvent;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log, Projector, RowKey, RowStore};
use bc_gateway::AppState;
use bc_projections::events as ev;
use bc_projections::{KIND_POOL, Projections};
use serde_json::{Value, json};
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

async fn call(router: &axum::Router, token: &str, method: &str, body: Value) -> (u16, Value) {
    let request = Request::post(format!("/api/compute/{method}"))
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// Before the fix, the stale handler checked version 1 and appended at the client's version 2:
/// the update landed on a pool changed since, and it was folded.
#[tokio::test]
async fn finding_4_pools_update_with_an_if_version_other_than_the_one_read_is_conflict_and_appends_nothing() {
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
async fn finding_4_an_update_racing_an_archive_with_a_stale_if_version_does_not_reach_the_fold() {
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
async fn finding_4_a_racing_if_version_does_not_fail_other_tenants_appends() {
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
