//! Issue 15, finding 9: the fleet view held one global lock across database reads, so one
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_9_one_tenants_use_of_the_fleet_view_does_not_stall_anothers() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("fleet.sqlite3")).await.unwrap();
    store.migrate().await.unwrap();
    let store: Arc<dyn EventStore> = Arc::new(store);
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
    let other = tokio::time::timeout(Duration::from_secs(5), fleet.with_tenant(&*store, b, |view| view.nodes.len())).await;
    release.send(()).unwrap();
    assert!(holder.await.unwrap(), "tenant A was released");
    assert_eq!(other.expect("tenant B did not wait for tenant A").unwrap(), 0);
}
