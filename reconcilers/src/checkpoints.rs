//! The `checkpoints` reconciler: every interval, seals a signed checkpoint of each tenant whose
//! log grew since its last one (`bc_core::audit::Sealer`). Level-triggered: each pass compares
//! every tenant's chain with its newest checkpoint, so a restart or a second process seals
//! nothing twice (a checkpoint is an idempotent append keyed by its tree size). A pass verifies
//! the events appended since the one before, and each chain from seq 1 once a day
//! (`SEAL_FULL_WALK_INTERVAL_MS`) and on the first pass.

use std::sync::Arc;
use std::time::Duration;

use bc_core::audit::{Sealer, Trust};
use bc_core::store::Log;

use crate::status::PassRecorder;

pub const NAME: &str = "checkpoints";
/// The shortest interval between sealing passes.
pub const INTERVAL_S_MIN: u64 = 1;

/// Seals every `interval_s` seconds (the first pass after one interval) until `shutdown`.
pub async fn run(
    log: Arc<Log>,
    interval_s: u64,
    deployment: String,
    trust: Trust,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let interval_s = interval_s.max(INTERVAL_S_MIN);
    let status = PassRecorder::new(log.store.clone(), log.clock.clone(), NAME);
    // What each pass verified of each chain, so the next walks only what was appended since.
    let mut sealer = Sealer::default();
    tracing::info!(reconciler = NAME, interval_s, "reconciler started");
    while !*shutdown.borrow() {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(interval_s)) => {}
            _ = shutdown.changed() => break,
        }
        let started_at_ms = log.clock.now_ms();
        match sealer.seal_all(&log, None, &deployment, &trust).await {
            Ok(done) => {
                if !done.sealed.is_empty() {
                    tracing::info!(reconciler = NAME, tenants = done.sealed.len(), "sealed checkpoints");
                }
                let counts = [("sealed", done.sealed.len() as u64), ("failed", done.failed.len() as u64)];
                match done.failed.first() {
                    None => status.pass(started_at_ms, Ok(&counts)).await,
                    Some((_, e)) => status.pass(started_at_ms, Err(e)).await,
                }
            }
            Err(e) => {
                tracing::error!(reconciler = NAME, code = %e.code(), error = %e, "sealing checkpoints failed");
                status.pass(started_at_ms, Err(&e)).await;
            }
        }
    }
    tracing::info!(reconciler = NAME, "reconciler stopped");
}
