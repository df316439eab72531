//! The `sandboxes` reconciler: ends sandboxes at their end and keeps the warm pools full.
//! Level-triggered: every pass reads each tenant's live sandboxes (`sandbox_live` rows), its
//! templates and its nodes, and appends what [`decide::sandboxes_plan`] says: a delete (with its
//! `sandbox.apply`) for each sandbox past its end, whatever its node's state; the delete again
//! when the node did not answer it by its deadline (an unreachable node gets it when it is back:
//! its queue keeps it); and warm sandboxes made on the least loaded node of the pool until each
//! template has `warmMin` of them. A sandbox volume attached to a sandbox that is no longer
//! live is detached (`sandbox_volume.detached`, [`decide_volume::volumes_to_detach`]).
//!
//! Every append is at the sandbox's (or the template's) version the pass read, so two processes
//! running it never both act on one state: the second gets a CONFLICT and decides again.

use std::collections::BTreeMap;
use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::id::{CommandId, SandboxId};
use bc_core::store::Log;
use bc_core::{ErrorCode, Result};
use bc_projections::decide::sandbox::{self as decide, SandboxAction};
use bc_projections::decide::sandbox_snapshot as decide_snapshot;
use bc_projections::decide::sandbox_volume as decide_volume;
use bc_projections::placement::Issue;
use bc_projections::sandbox::{KIND_SANDBOX_LIVE, KIND_SANDBOX_TEMPLATE, SandboxDoc, SandboxState, SandboxTemplateDoc};
use bc_projections::sandbox_snapshot::{KIND_SANDBOX_SNAPSHOT_LIVE, SandboxSnapshotDoc};
use bc_projections::sandbox_volume::{KIND_SANDBOX_VOLUME_LIVE, SandboxVolumeDoc};
use bc_projections::{KIND_NODE, NodeDoc};

use crate::all_rows;

pub const NAME: &str = "sandboxes";
const ACTOR: &str = "reconciler:sandboxes";
/// How often a pass runs when nothing wakes it: a sandbox outlives its end by at most this.
pub const TICK_MS_DEFAULT: u64 = 500;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub deleting: usize,
    pub warmed: usize,
    pub detached: usize,
    pub conflicts: usize,
}

/// One pass over every tenant. What it read (the sandboxes not yet deleted, the warm ones) goes
/// to the process's metrics (`sandboxes_live`, `sandboxes_warm`) when the pass read everything.
pub async fn pass(log: &Log, clock: &dyn Clock) -> Result<Pass> {
    let mut done = Pass::default();
    let (mut live, mut warm) = (0u64, 0u64);
    for tenant in log.store.tenants().await? {
        let tenant_text = tenant.to_string();
        let templates: Vec<SandboxTemplateDoc> = all_rows(log, &tenant_text, KIND_SANDBOX_TEMPLATE).await?;
        // The volumes before the sandboxes: a sandbox and its volumes' attachment land in one
        // append, so every attachment read here has its sandbox in the read after it. Read the
        // other way round, a sandbox made between the two reads would be missing from the
        // sandboxes while its attachment is not, and the volume would be detached under it.
        let volumes: Vec<SandboxVolumeDoc> = all_rows(log, &tenant_text, KIND_SANDBOX_VOLUME_LIVE).await?;
        let sandboxes: Vec<SandboxDoc> = all_rows(log, &tenant_text, KIND_SANDBOX_LIVE).await?;
        live += sandboxes.len() as u64;
        warm += sandboxes.iter().filter(|s| s.warm && matches!(s.state, SandboxState::Starting | SandboxState::Running)).count()
            as u64;
        for append in decide_volume::volumes_to_detach(&volumes, &sandboxes)? {
            match log.append(append.into_request(tenant, ACTOR)).await {
                Ok(_) => done.detached += 1,
                Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                Err(e) => tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "append failed"),
            }
        }
        // Snapshots without `keep` go with their sandbox; a delete the node did not answer is
        // sent again (decide::sandbox_snapshot::snapshots_plan).
        let snapshots: Vec<SandboxSnapshotDoc> = all_rows(log, &tenant_text, KIND_SANDBOX_SNAPSHOT_LIVE).await?;
        let live_ids: Vec<&str> = sandboxes.iter().map(|s| s.sandbox_id.as_str()).collect();
        for (snapshot_id, reason) in decide_snapshot::snapshots_plan(&snapshots, &live_ids, clock.now_ms()) {
            let Some(doc) = snapshots.iter().find(|s| s.snapshot_id == snapshot_id) else { continue };
            let command_id = CommandId::from_ulid(log.ids.ulid()).to_string();
            let issue = Issue { command_id: &command_id, now_ms: clock.now_ms() };
            let append = decide_snapshot::snapshot_delete(doc, Some(reason.clone()), issue)?;
            tracing::info!(reconciler = NAME, snapshot = %snapshot_id, reason = %bc_core::id::truncate(&reason, 200), "deleting");
            match log.append(append.into_request(tenant, ACTOR)).await {
                Ok(_) => done.deleting += 1,
                Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                Err(e) => tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "append failed"),
            }
        }
        if templates.is_empty() && sandboxes.is_empty() {
            continue;
        }
        let now_ms = clock.now_ms();
        let plan = decide::sandboxes_plan(&templates, &sandboxes, now_ms);
        if plan.is_empty() {
            continue;
        }
        let nodes: Vec<NodeDoc> = all_rows(log, &tenant_text, KIND_NODE).await?;
        let mut load: BTreeMap<String, usize> = BTreeMap::new();
        for s in &sandboxes {
            *load.entry(s.node_id.clone()).or_default() += 1;
        }
        let mut warm_load = decide::warm_load(&sandboxes);
        for action in plan {
            let mut appends = Vec::new();
            match &action {
                SandboxAction::Delete { sandbox_id, reason } => {
                    let Some(doc) = sandboxes.iter().find(|s| &s.sandbox_id == sandbox_id) else { continue };
                    let command_id = CommandId::from_ulid(log.ids.ulid()).to_string();
                    let append = decide::sandbox_delete(doc, Some(reason.clone()), Issue { command_id: &command_id, now_ms })?;
                    tracing::info!(reconciler = NAME, sandbox = %sandbox_id, reason = %bc_core::id::truncate(reason, 200), "deleting");
                    appends.push((append, false));
                }
                SandboxAction::Warm { template_id, count } => {
                    let Some(template) = templates.iter().find(|t| &t.template_id == template_id) else { continue };
                    // One append per warm sandbox, each guarded at the template's version: the
                    // first lands, and the rest of this pass's go in the next (conflicts).
                    for _ in 0..*count {
                        // Only on a node with room for another warm one (SANDBOX_WARM_PER_NODE_MAX).
                        let node = match decide::place_sandbox(&nodes, &template.pool_id, &load, Some(&warm_load)) {
                            Ok(node) => node,
                            Err(why) => {
                                tracing::debug!(reconciler = NAME, template = %template_id, reason = %why, "no warm sandbox made");
                                break;
                            }
                        };
                        *load.entry(node.node_id.clone()).or_default() += 1;
                        *warm_load.entry(node.node_id.clone()).or_default() += 1;
                        let sandbox_id = SandboxId::from_ulid(log.ids.ulid()).to_string();
                        let command_id = CommandId::from_ulid(log.ids.ulid()).to_string();
                        let append =
                            decide::sandbox_create(template, &sandbox_id, node, None, Issue { command_id: &command_id, now_ms })?;
                        appends.push((append, true));
                        // Guarded at the template's version, which a creation does not move:
                        // the next is decided on the same read.
                    }
                }
            }
            for (append, warming) in appends {
                match log.append(append.into_request(tenant, ACTOR)).await {
                    Ok(_) if warming => done.warmed += 1,
                    Ok(_) => done.deleting += 1,
                    Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                    Err(e) => tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "append failed"),
                }
            }
        }
    }
    if let Some(observer) = crate::driver::observer() {
        observer.sandboxes_seen(live, warm);
    }
    Ok(done)
}

impl crate::driver::PassReport for Pass {
    fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("deleting", self.deleting as u64),
            ("warmed", self.warmed as u64),
            ("detached", self.detached as u64),
            ("conflicts", self.conflicts as u64),
        ]
    }

    fn again(&self) -> bool {
        self.conflicts > 0
    }

    fn log(&self, name: &'static str) {
        if self.deleting + self.warmed + self.detached + self.conflicts > 0 {
            let (deleting, warmed, detached, conflicts) = (self.deleting, self.warmed, self.detached, self.conflicts);
            tracing::info!(reconciler = name, deleting, warmed, detached, conflicts, "pass");
        }
    }
}

/// The reconciler: [`pass`] every [`TICK_MS_DEFAULT`] ([`crate::registry`]).
pub fn reconciler(log: Arc<Log>, clock: Arc<dyn Clock>) -> crate::driver::LogPasses<Pass> {
    crate::driver::LogPasses { name: NAME, log, clock, pass: |log, clock| Box::pin(pass(log, clock)) }
}
