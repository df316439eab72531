//! The `fleet_drift` reconciler: for every tenant whose fleet configuration was applied
//! (`fleet/default`), compares each object the applied document covers with what the document
//! said of it (its fingerprint), and records the drift it sees as `fleet.drifted` when that
//! changes: an object changed outside the document, or gone; and `fleet.drifted` with no objects
//! once it is all back. `fleet status` shows the recorded drift beside the drift it reads itself.
//! The decision is [`bc_projections::fleet_config::fleet_drift`] and
//! [`bc_projections::fleet_config::drift_change`]; the append is at the fleet stream's version,
//! so an apply meanwhile wins and the next pass decides again.

use std::collections::BTreeMap;
use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::store::{AppendRequest, ExpectedVersion, Log, NewEvent};
use bc_core::{ErrorCode, Result};
use bc_projections::events as ev;
use bc_projections::fleet_config::{
    FLEET_DRIFTED, FLEET_STREAM_ID, FleetConfigDoc, FleetObjectsLive, KIND_FLEET, drift_change, fleet_drift,
};
use bc_projections::placement::all_rows;
use bc_projections::{FlavorDoc, ImageDoc, KIND_FLAVOR, KIND_IMAGE, KIND_POOL, KIND_QUOTA, PoolDoc, QuotaDoc};

pub const NAME: &str = "fleet_drift";
const ACTOR: &str = "reconciler:fleet_drift";
/// How often a pass runs.
pub const TICK_MS_DEFAULT: u64 = 30_000;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Fleets whose configuration was checked.
    pub checked: usize,
    /// `fleet.drifted` appended (drift found, changed, or gone).
    pub recorded: usize,
    pub conflicts: usize,
}

/// One pass over every tenant's applied fleet configuration.
pub async fn pass(log: &Log, _clock: &dyn Clock) -> Result<Pass> {
    let mut done = Pass::default();
    for tenant in log.store.tenants().await? {
        let Some(row) = log.store.row_get(&tenant.to_string(), KIND_FLEET, FLEET_STREAM_ID).await? else { continue };
        let applied: FleetConfigDoc =
            serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("fleet row: {e}")))?;
        let store = &*log.store;
        let pools: Vec<PoolDoc> = all_rows(store, tenant, KIND_POOL).await?;
        let quotas: Vec<QuotaDoc> = all_rows(store, tenant, KIND_QUOTA).await?;
        let quotas: BTreeMap<String, QuotaDoc> = quotas.into_iter().map(|q| (q.pool_id.clone(), q)).collect();
        let flavors: Vec<FlavorDoc> = all_rows(store, tenant, KIND_FLAVOR).await?;
        let images: Vec<ImageDoc> = all_rows(store, tenant, KIND_IMAGE).await?;
        let sites: Vec<bc_projections::site::SiteDoc> = all_rows(store, tenant, bc_projections::site::KIND_SITE).await?;
        let projects: Vec<bc_projections::project::ProjectDoc> =
            all_rows(store, tenant, bc_projections::project::KIND_PROJECT).await?;
        let webhooks: Vec<bc_projections::WebhookDoc> = all_rows(store, tenant, bc_projections::KIND_WEBHOOK).await?;
        let live = FleetObjectsLive {
            pools: &pools,
            quotas: &quotas,
            flavors: &flavors,
            images: &images,
            sites: &sites,
            projects: &projects,
            webhooks: &webhooks,
        };
        done.checked += 1;
        let drift = fleet_drift(&applied, &live);
        let Some(change) = drift_change(&applied, &drift) else { continue };
        let request = AppendRequest::new(
            tenant,
            format!("{KIND_FLEET}/{FLEET_STREAM_ID}"),
            ExpectedVersion::Exact(applied.version),
            ACTOR,
            vec![NewEvent::new(FLEET_DRIFTED, ev::to_cbor(&change)?)],
        );
        match log.append(request).await {
            Ok(_) => {
                done.recorded += 1;
                tracing::info!(reconciler = NAME, tenant = %tenant, drifted = change.count, "fleet drift recorded");
            }
            Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
            Err(e) => tracing::warn!(reconciler = NAME, tenant = %tenant, code = %e.code(), error = %e, "append failed"),
        }
    }
    Ok(done)
}

impl crate::driver::PassReport for Pass {
    fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![("checked", self.checked as u64), ("recorded", self.recorded as u64), ("conflicts", self.conflicts as u64)]
    }

    fn again(&self) -> bool {
        self.conflicts > 0
    }
}

/// The reconciler: [`pass`] every [`TICK_MS_DEFAULT`] ([`crate::registry`]).
pub fn reconciler(log: Arc<Log>, clock: Arc<dyn Clock>) -> crate::driver::LogPasses<Pass> {
    crate::driver::LogPasses { name: NAME, log, clock, pass: |log, clock| Box::pin(pass(log, clock)) }
}

#[cfg(test)]
// Tests, outside the simulator: fresh random ids (clippy.toml).
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use bc_core::clock::ManualClock;
    use bc_core::id::{PoolId, TenantId};
    use bc_core::keys::LogKey;
    use bc_core::store::sqlite::SqliteStore;
    use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
    use bc_projections::events as ev;
    use bc_projections::fleet_config::{
        FLEET_APPLIED, FLEET_OBJECTS, FLEET_STREAM_ID, FleetApplied, FleetConfigDoc, FleetObject, FleetObjects, KIND_FLEET,
        pool_fingerprint,
    };
    use bc_projections::pool::MAX_RESERVATION_S_DEFAULT;
    use bc_projections::{KIND_POOL, Projections, stream_of};

    use super::{Pass, pass};

    /// A pool changed outside the applied document is recorded once as drift, and its return
    /// to what the document said is recorded as no drift.
    #[tokio::test]
    async fn a_pool_changed_by_hand_is_recorded_once_and_cleared_when_it_is_back() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("s.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        let log = Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), clock.clone()).await.unwrap();
        let tenant = TenantId::generate();
        let pool = PoolId::generate().to_string();
        let append = |stream: String, expected: ExpectedVersion, events: Vec<NewEvent>| {
            let log = &log;
            async move { log.append(AppendRequest::new(tenant, stream, expected, "test", events)).await.unwrap() }
        };
        let created = ev::PoolCreated::named("gpu-a");
        append(
            stream_of(KIND_POOL, &pool),
            ExpectedVersion::NoStream,
            vec![NewEvent::new(ev::POOL_CREATED, ev::to_cbor(&created).unwrap())],
        )
        .await;
        let fingerprint = pool_fingerprint("gpu-a", "", &BTreeMap::new(), MAX_RESERVATION_S_DEFAULT);
        let applied = FleetApplied {
            plan_hash: "ab".repeat(32),
            document_sha256: "cd".repeat(32),
            created: 1,
            updated: 0,
            deleted: 0,
            objects: 1,
        };
        let objects = FleetObjects {
            objects: vec![FleetObject { kind: "pool".into(), key: "gpu-a".into(), id: pool.clone(), fingerprint }],
        };
        append(
            format!("{KIND_FLEET}/{FLEET_STREAM_ID}"),
            ExpectedVersion::NoStream,
            vec![
                NewEvent::new(FLEET_APPLIED, ev::to_cbor(&applied).unwrap()),
                NewEvent::new(FLEET_OBJECTS, ev::to_cbor(&objects).unwrap()),
            ],
        )
        .await;
        let fleet = || {
            let store = store.clone();
            async move {
                let row = store.row_get(&tenant.to_string(), KIND_FLEET, FLEET_STREAM_ID).await.unwrap().unwrap();
                serde_json::from_value::<FleetConfigDoc>(row.doc).unwrap()
            }
        };
        assert_eq!(pass(&log, &*clock).await.unwrap(), Pass { checked: 1, ..Pass::default() }, "nothing drifted");

        let update = |description: &str| ev::PoolUpdated {
            name: None,
            description: Some(description.into()),
            labels: None,
            max_reservation_s: None,
        };
        append(
            stream_of(KIND_POOL, &pool),
            ExpectedVersion::Any,
            vec![NewEvent::new(ev::POOL_UPDATED, ev::to_cbor(&update("by hand")).unwrap())],
        )
        .await;
        assert_eq!(pass(&log, &*clock).await.unwrap(), Pass { checked: 1, recorded: 1, ..Pass::default() });
        let doc = fleet().await;
        assert_eq!((doc.drift_count, doc.drift[0].key.as_str(), doc.drift[0].what.as_str()), (1, "gpu-a", "changed"), "{doc:?}");
        assert_eq!(pass(&log, &*clock).await.unwrap(), Pass { checked: 1, ..Pass::default() }, "recorded once");

        append(
            stream_of(KIND_POOL, &pool),
            ExpectedVersion::Any,
            vec![NewEvent::new(ev::POOL_UPDATED, ev::to_cbor(&update("")).unwrap())],
        )
        .await;
        assert_eq!(pass(&log, &*clock).await.unwrap(), Pass { checked: 1, recorded: 1, ..Pass::default() }, "cleared");
        let doc = fleet().await;
        assert!(doc.drift.is_empty() && doc.drift_count == 0 && doc.drift_at_ms.is_some(), "{doc:?}");
    }
}
