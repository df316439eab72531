//! What the reconcilers' tests share: an event to fan out and the one item a test consumer makes
//! of it (the outbox tests), and a log on a fresh SQLite file at a manual clock (the metal tests).
//! Not every test file uses every piece.
#![allow(dead_code)]
// A test, outside the simulator: fresh random ids (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;

use bc_core::Result;
use bc_core::clock::ManualClock;
use bc_core::event::EventRow;
use bc_core::id::{PoolId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::outbox::NewWorkItem;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::events as ev;
use bc_projections::{KIND_POOL, Projections, stream_of};

/// A `pool.created` of the root tenant on a pool of its own: its stream and the request.
pub fn pool_created() -> (String, AppendRequest) {
    let pool = PoolId::generate();
    let stream = stream_of(KIND_POOL, &pool);
    let payload = ev::to_cbor(&ev::PoolCreated::named(format!("p-{}", pool.ulid().to_string().to_ascii_lowercase()))).unwrap();
    let event = vec![NewEvent::new(ev::POOL_CREATED, payload)];
    (stream.clone(), AppendRequest::new(TenantId::ROOT, stream, ExpectedVersion::NoStream, "test", event))
}

/// The item a test consumer makes of an event: the event's id, an empty payload.
pub fn item_of(row: &EventRow) -> Result<NewWorkItem> {
    Ok(NewWorkItem { tenant: row.tenant.parse()?, id: row.id.clone(), subject: "s".into(), payload: serde_json::json!({}) })
}

/// A store on a new SQLite file in a temporary directory (kept while the first part lives), and a
/// log with the real projections and a fresh key over it, on a manual clock.
pub async fn manual_log() -> (tempfile::TempDir, Arc<dyn EventStore>, Arc<Log>, Arc<ManualClock>) {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("s.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    let log =
        Arc::new(Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), clock.clone()).await.unwrap());
    (dir, store, log, clock)
}

/// Enrolls machine `node` (named `name`, in a pool of its own) in `tenant`: its BMC at `address`
/// over TLS unchecked, user `admin` with `password`, kept as the secret `bmc_NODE`.
pub async fn enroll(
    store: &dyn EventStore,
    log: &Log,
    tenant: TenantId,
    node: &str,
    name: String,
    address: &str,
    password: &str,
) {
    let enrolled = ev::MetalEnrolled {
        pool_id: PoolId::generate().to_string(),
        name,
        site_id: None,
        bmc: ev::MetalBmc {
            address: address.into(),
            system_path: None,
            username: "admin".into(),
            tls: "insecure".into(),
            ca_pem: None,
            pin: None,
            secret_id: format!("bmc_{node}"),
        },
    };
    store.secret_put(tenant, &format!("bmc_{node}"), password, 0).await.unwrap();
    let event = NewEvent::new(ev::METAL_ENROLLED, ev::to_cbor(&enrolled).unwrap());
    let stream = stream_of(bc_projections::workflow::KIND_METAL, &node);
    log.append(AppendRequest::new(tenant, stream, ExpectedVersion::NoStream, "test", vec![event])).await.unwrap();
}
