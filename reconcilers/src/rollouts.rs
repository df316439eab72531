//! The `rollouts` reconciler: takes each live rollout one step further. Level-triggered: every
//! pass re-reads each tenant's live rollouts, their release, their nodes' documents and the
//! commands they issued, and appends what [`decide::rollout_plan`] says (a node's gate passed or
//! failed, the next nodes sent `agent.update` within `maxUnavailable`, a wave passed, a pause
//! with its reason, a rollback after `abort`), every event of one rollout's pass in one append
//! at the rollout's version, so two processes running it never both act on one state: the
//! second gets a CONFLICT and decides again next pass.

use std::collections::BTreeMap;
use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::id::{CommandId, TenantId};
use bc_core::store::Log;
use bc_core::{ErrorCode, Result};
use bc_projections::decide;
use bc_projections::placement::all_rows;
use bc_projections::rollout::{self, KIND_ROLLOUT_LIVE, RolloutDoc};
use bc_projections::{KIND_NODE, NodeDoc};

pub const NAME: &str = "rollouts";
const ACTOR: &str = "reconciler:rollouts";
/// How often a pass runs when nothing wakes it.
pub const TICK_MS_DEFAULT: u64 = 1_000;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Rollouts that moved.
    pub moved: usize,
    pub conflicts: usize,
}

/// A tenant's rollouts that are not finished.
pub async fn live_rollouts(log: &Log, tenant: TenantId) -> Result<Vec<RolloutDoc>> {
    Ok(all_rows::<RolloutDoc>(&*log.store, tenant, KIND_ROLLOUT_LIVE).await?.into_iter().filter(|r| r.state.is_live()).collect())
}

/// One pass over every tenant's live rollouts.
pub async fn pass(log: &Log, clock: &dyn Clock) -> Result<Pass> {
    let mut done = Pass::default();
    for tenant in log.store.tenants().await? {
        let rollouts = live_rollouts(log, tenant).await?;
        if rollouts.is_empty() {
            continue;
        }
        let all_nodes: BTreeMap<String, NodeDoc> =
            all_rows::<NodeDoc>(&*log.store, tenant, KIND_NODE).await?.into_iter().map(|n| (n.node_id.clone(), n)).collect();
        for rollout in rollouts {
            let inputs = rollout::plan_inputs(&*log.store, &rollout, Some(&all_nodes)).await?;
            let now_ms = clock.now_ms();
            let mut ids = || CommandId::from_ulid(log.ids.ulid()).to_string();
            let plan = decide::rollout_plan(&rollout, &inputs.release, &inputs.nodes, &inputs.commands, now_ms, &mut ids)?;
            let Some(append) = plan.append else { continue };
            match log.append(append.into_request(tenant, ACTOR)).await {
                Ok(_) => {
                    done.moved += 1;
                    for line in &plan.did {
                        tracing::info!(reconciler = NAME, rollout = %rollout.rollout_id, "{}", bc_core::id::truncate(line, 300));
                    }
                }
                Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                Err(e) => {
                    // One rollout's failure is its own: the pass goes on.
                    tracing::warn!(reconciler = NAME, rollout = %rollout.rollout_id, code = %e.code(), error = %e, "append failed");
                }
            }
        }
    }
    Ok(done)
}

impl crate::driver::PassReport for Pass {
    fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![("moved", self.moved as u64), ("conflicts", self.conflicts as u64)]
    }

    fn again(&self) -> bool {
        self.conflicts > 0
    }
}

/// The reconciler: [`pass`] every [`TICK_MS_DEFAULT`] ([`crate::registry`]); a pass that lost a
/// race (a conflict) is followed by the next soon.
pub fn reconciler(log: Arc<Log>, clock: Arc<dyn Clock>) -> crate::driver::LogPasses<Pass> {
    crate::driver::LogPasses { name: NAME, log, clock, pass: |log, clock| Box::pin(pass(log, clock)) }
}
