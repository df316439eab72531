//! Regression: the fleet view held one global lock across database reads, so one
//! tenant's catch-up (loading its nodes, reading changed rows again) stalled every tenant's
//! reservations. Each tenant's view has its own lock now: while one tenant's view is in use,
//! another tenant's is loaded and used.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::Duration;

use bc_core::id::TenantId;
use bc_core::store::EventStore;
use bc_core::store::sqlite::SqliteStore;
use bc_projections::fleet::Fleet;

/// A migrated store in a fresh directory (kept while the directory is).
async fn fresh_store() -> (tempfile::TempDir, Arc<dyn EventStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("fleet.sqlite3")).await.unwrap();
    store.migrate().await.unwrap();
    (dir, Arc::new(store))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_use_of_the_fleet_view_does_not_stall_anothers() {
    let (_dir, store) = fresh_store().await;
    let fleet = Arc::new(Fleet::new());
    fleet.prime(&*store).await.unwrap();
    let (a, b) = (TenantId::generate(), TenantId::generate());
    let (inside, entered) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    // Tenant A's view is held (as a catch-up or a placement would hold it) until released.
    let holder = tokio::spawn({
        let (fleet, store) = (fleet.clone(), store.clone());
        async move {
            fleet
                .with_tenant(&*store, a, move |_| {
                    inside.send(()).unwrap();
                    released.recv_timeout(Duration::from_secs(20)).is_ok()
                })
                .await
                .unwrap()
        }
    });
    tokio::task::spawn_blocking(move || entered.recv().unwrap()).await.unwrap();
    // Tenant B's first use loads it from the database while A's view is held.
    let other = tokio::time::timeout(Duration::from_secs(5), fleet.with_tenant(&*store, b, |view| view.nodes().len())).await;
    release.send(()).unwrap();
    assert!(holder.await.unwrap(), "tenant A was released");
    assert_eq!(other.expect("tenant B did not wait for tenant A").unwrap(), 0);
}

/// Regression: a placer's held GPUs were lost from the view when any refresh read its node again,
/// even a read made before the placer's append landed; the next request then placed on the
/// same GPUs, its guarded append was a CONFLICT, and it queued (and with it every request
/// after it, behind the queue). A held node is read again only once its placers are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_node_keeps_its_held_gpus_until_its_placer_is_done() {
    use bc_core::clock::SystemClock;
    use bc_core::id::{NodeId, PoolId};
    use bc_core::keys::LogKey;
    use bc_core::store::{AppendRequest, ExpectedVersion, Log, NewEvent};
    use bc_projections::decide::{self, ReservationAsk, ReservationCreateInput};
    use bc_projections::events::{self as ev, Gpu};
    use bc_projections::fleet::Reread;
    use bc_projections::placement;
    use bc_projections::{KIND_NODE, KIND_POOL, Projections, stream_of};

    let (_dir, store) = fresh_store().await;
    let log = Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap();
    let tenant = TenantId::generate();
    let (pool, node) = (PoolId::generate().to_string(), NodeId::generate().to_string());
    let append = |stream: String, event_type: &str, payload| {
        AppendRequest::new(tenant, stream, ExpectedVersion::Any, "test", vec![NewEvent::new(event_type, payload)])
    };
    let created = ev::PoolCreated::named("p");
    log.append(append(stream_of(KIND_POOL, &pool), ev::POOL_CREATED, ev::to_cbor(&created).unwrap())).await.unwrap();
    let gpus = vec![Gpu { model: "H100".into(), product: "H100-SXM5-80GB".into(), vram_gib: 80, nvlink_domain: 0 }; 8];
    let registered = ev::NodeRegistered { pool_id: pool.clone(), name: "n".into(), gpus, labels: Default::default() };
    log.append(append(stream_of(KIND_NODE, &node), ev::NODE_REGISTERED, ev::to_cbor(&registered).unwrap())).await.unwrap();

    let fleet = Arc::new(Fleet::new());
    fleet.prime(&*store).await.unwrap();
    // A placer decides a reservation of four GPUs and holds them for an append it has not
    // made yet, as the gateway's create does.
    let row = store.row_get(&tenant.to_string(), KIND_POOL, &pool).await.unwrap().unwrap();
    let ask = ReservationAsk {
        pool: serde_json::from_value(row.doc).unwrap(),
        gpus: 4,
        duration_s: 60,
        selector_text: String::new(),
        selector: Default::default(),
        nvlink: false,
        tolerations: vec![],
        project: None,
    };
    let input = ReservationCreateInput {
        reservation_id: "rsv_pending",
        command_id: "cmd_unused",
        now_ms: 1,
        actor: "test",
        replay: false,
    };
    let placed = fleet
        .with_tenant(&*store, tenant, |view| {
            let decision = decide::reservation_create(view, None, &ask, &input).unwrap();
            decision.hold(view);
            decision.held_node().map(str::to_owned)
        })
        .await
        .unwrap();
    assert_eq!(placed.as_deref(), Some(node.as_str()), "placed at once on the one node");
    // Meanwhile the node's row changes in the log (an operator cordons it), and the next use
    // reads it again.
    log.append(append(stream_of(KIND_NODE, &node), ev::NODE_CORDONED, ev::to_cbor(&ev::NodeStateChanged {}).unwrap()))
        .await
        .unwrap();
    let seen = |view: &mut bc_projections::fleet::FleetIndex| (placement::free_gpus(&view.nodes()[&node]), view.is_held(&node));
    let held = fleet.with_tenant(&*store, tenant, seen).await.unwrap();
    assert_eq!(held, (4, true), "the held GPUs stay held while the placer appends");
    // The placer is done (its append failed, say): the node is read from the store again.
    Reread::new(fleet.clone(), tenant, placed, "rsv_pending".into()).now().await;
    assert_eq!(fleet.with_tenant(&*store, tenant, seen).await.unwrap(), (8, false), "read again once its placer is done");
}
