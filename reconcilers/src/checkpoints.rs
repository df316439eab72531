//! The `checkpoints` reconciler: every interval, seals a signed checkpoint of each tenant whose
//! log grew since its last one (`bc_core::audit::Sealer`). Level-triggered: each pass compares
//! every tenant's chain with its newest checkpoint, so a restart or a second process seals
//! nothing twice (a checkpoint is an idempotent append keyed by its tree size). A pass verifies
//! the events appended since the one before, and each chain from seq 1 once a day
//! (`SEAL_FULL_WALK_INTERVAL_MS`) and on the first pass.

use std::sync::Arc;

use bc_core::audit::{Sealer, Trust};
use bc_core::store::Log;
use futures::future::BoxFuture;

use crate::driver::Activation;

pub const NAME: &str = "checkpoints";
/// The shortest interval between sealing passes.
pub const INTERVAL_S_MIN: u64 = 1;

/// The reconciler. Its schedule is every interval, the first pass after one interval
/// ([`crate::registry`]).
pub struct Checkpoints {
    log: Arc<Log>,
    deployment: String,
    trust: Trust,
    /// What each pass verified of each chain, so the next walks only what was appended since.
    sealer: Sealer,
}

impl Checkpoints {
    pub fn new(log: Arc<Log>, deployment: String, trust: Trust) -> Self {
        Self { log, deployment, trust, sealer: Sealer::default() }
    }
}

impl crate::driver::Reconciler for Checkpoints {
    fn name(&self) -> &'static str {
        NAME
    }

    fn activate(&mut self) -> BoxFuture<'_, Activation> {
        Box::pin(async move {
            match self.sealer.seal_all(&self.log, None, &self.deployment, &self.trust).await {
                Ok(done) => {
                    if !done.sealed.is_empty() {
                        tracing::info!(reconciler = NAME, tenants = done.sealed.len(), "sealed checkpoints");
                    }
                    match done.failed.into_iter().next() {
                        None => Activation::ok(vec![("sealed", done.sealed.len() as u64), ("failed", 0)]),
                        // A tenant that did not seal fails the pass: its status shows why.
                        Some((_, e)) => Activation::failed(e),
                    }
                }
                Err(e) => {
                    tracing::error!(reconciler = NAME, code = %e.code(), error = %e, "sealing checkpoints failed");
                    Activation::failed(e)
                }
            }
        })
    }
}
