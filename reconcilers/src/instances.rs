//! The `instances` reconciler: makes each instance what it should be. Level-triggered: every
//! pass reads each tenant's live instances (their `instance_live` rows) and the reservations
//! they run on, and appends what [`decide::instances_plan`] says: another `instance.apply` when
//! the node observes something else than what is desired (a drift, a failed or unanswered
//! apply), `instance.failed` after [`bc_projections::INSTANCE_APPLY_ATTEMPTS_MAX`] tries, a
//! delete when the reservation ended, and `instance.deleted` (with the reservation detached) once
//! the node reports the domain gone.
//!
//! Every append is at the instance's version the pass read, so two processes running it never
//! both act on one state: the second gets a CONFLICT and decides again next pass.

use std::collections::HashMap;
use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::id::CommandId;
use bc_core::store::Log;
use bc_core::{ErrorCode, Result};
use bc_projections::decide::{self, InstanceAction};
use bc_projections::placement::Issue;
use bc_projections::{InstanceDoc, KIND_INSTANCE_LIVE, KIND_RESERVATION, ReservationDoc};

pub const NAME: &str = "instances";
const ACTOR: &str = "reconciler:instances";
/// How often a pass runs when nothing wakes it.
pub const TICK_MS_DEFAULT: u64 = 500;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub reapplied: usize,
    pub failed: usize,
    pub deleting: usize,
    pub deleted: usize,
    pub conflicts: usize,
}

impl Pass {
    fn any(&self) -> bool {
        self.reapplied + self.failed + self.deleting + self.deleted + self.conflicts > 0
    }
}

/// One pass over every tenant.
pub async fn pass(log: &Log, clock: &dyn Clock) -> Result<Pass> {
    let mut done = Pass::default();
    for tenant in log.store.tenants().await? {
        let tenant_text = tenant.to_string();
        let instances: Vec<InstanceDoc> = crate::all_rows(log, &tenant_text, KIND_INSTANCE_LIVE).await?;
        if instances.is_empty() {
            continue;
        }
        let mut reservations: HashMap<String, ReservationDoc> = HashMap::new();
        for instance in &instances {
            if reservations.contains_key(&instance.reservation_id) {
                continue;
            }
            if let Some(row) = log.store.row_get(&tenant_text, KIND_RESERVATION, &instance.reservation_id).await? {
                let doc: ReservationDoc =
                    serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("reservation row: {e}")))?;
                reservations.insert(instance.reservation_id.clone(), doc);
            }
        }
        let now_ms = clock.now_ms();
        let by_id: HashMap<&str, &InstanceDoc> = instances.iter().map(|i| (i.instance_id.as_str(), i)).collect();
        for action in decide::instances_plan(&instances, &reservations, now_ms) {
            let Some(doc) = by_id.get(action.instance_id()) else { continue };
            let command_id = CommandId::from_ulid(log.ids.ulid()).to_string();
            let append = action.append(doc, Issue { command_id: &command_id, now_ms }).map_err(bc_core::Error::from)?;
            match log.append(append.into_request(tenant, ACTOR)).await {
                Ok(_) => match &action {
                    InstanceAction::Reapply { reason, attempts, .. } => {
                        done.reapplied += 1;
                        tracing::info!(reconciler = NAME, instance = %doc.instance_id, attempts, reason = %bc_core::id::truncate(reason, 200), "applying again");
                    }
                    InstanceAction::Fail { reason, attempts, .. } => {
                        done.failed += 1;
                        tracing::warn!(reconciler = NAME, instance = %doc.instance_id, attempts, reason = %bc_core::id::truncate(reason, 200), "instance failed");
                    }
                    InstanceAction::Delete { .. } => done.deleting += 1,
                    InstanceAction::Deleted { .. } => done.deleted += 1,
                },
                Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                Err(e) => {
                    // One instance's failure is its own: the pass goes on.
                    tracing::warn!(reconciler = NAME, instance = %doc.instance_id, code = %e.code(), error = %e, "append failed");
                }
            }
        }
    }
    Ok(done)
}

impl crate::driver::PassReport for Pass {
    fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("reapplied", self.reapplied as u64),
            ("failed", self.failed as u64),
            ("deleting", self.deleting as u64),
            ("deleted", self.deleted as u64),
            ("conflicts", self.conflicts as u64),
        ]
    }

    fn again(&self) -> bool {
        self.conflicts > 0
    }

    fn log(&self, name: &'static str) {
        if self.any() {
            tracing::info!(
                reconciler = name,
                reapplied = self.reapplied,
                failed = self.failed,
                deleting = self.deleting,
                deleted = self.deleted,
                conflicts = self.conflicts,
                "pass"
            );
        }
    }
}

/// The reconciler: [`pass`] every [`TICK_MS_DEFAULT`] ([`crate::registry`]); a pass that lost a
/// race (a conflict) is followed by the next soon. Commits do not wake it: a pass reads every
/// tenant's live instances, and the node's answers are not in a hurry.
pub fn reconciler(log: Arc<Log>, clock: Arc<dyn Clock>) -> crate::driver::LogPasses<Pass> {
    crate::driver::LogPasses { name: NAME, log, clock, pass: |log, clock| Box::pin(pass(log, clock)) }
}
