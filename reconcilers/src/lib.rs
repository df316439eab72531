//! `bc-reconcilers`: the background work, each reconciler runnable in its own process
//! (`better-compute reconcile --only NAME`) or inside `dev` and `serve`.
//!
//! **Invariants.** Every reconciler is a [`driver::Reconciler`] (a name, one pass, a report),
//! listed once in [`registry`], which `dev`, `serve`, `reconcile --only`, `reconcilers status`
//! and the simulator all read; [`driver::run`] activates it and records each activation. A pass
//! re-reads the state it needs, asks a pure decision of `bc_projections::decide` what follows,
//! and appends that through the `Log`, at the versions it read: a pass that loses a race is
//! simply run again, and two processes running the same reconciler append nothing twice.
//! Outbox consumers (webhooks) work off leased work items, at least once.
//!
//! Dependencies: `bc-core` (storage, signing, the URL policy) and `bc-projections` (the
//! documents consumers read). Never the gateway: consumers talk to the database, not to HTTP
//! handlers.

pub mod batches;
pub mod checkpoints;
pub mod driver;
pub mod fleet_drift;
pub mod instances;
pub mod liveness;
pub mod metal;
pub mod outbox;
pub mod registry;
pub mod reservations;
pub mod rollouts;
pub mod sandboxes;
pub mod status;
pub mod usage;
pub mod webhooks;
pub mod witnesses;

/// Waits `ms`, or until this process commits (`wake`, dropped once the appender is gone), or
/// until shutdown: how the loops here idle.
pub(crate) async fn idle(
    ms: u64,
    wake: &mut Option<tokio::sync::watch::Receiver<u64>>,
    shutdown: &mut tokio::sync::watch::Receiver<bool>,
) {
    let sleep = tokio::time::sleep(std::time::Duration::from_millis(ms));
    match wake.as_mut() {
        Some(w) => tokio::select! {
            _ = sleep => {}
            changed = w.changed() => if changed.is_err() { *wake = None },
            _ = shutdown.changed() => {}
        },
        None => tokio::select! {
            _ = sleep => {}
            _ = shutdown.changed() => {}
        },
    }
}

/// Rows read per query by [`all_rows`].
const ROWS_PER_READ: u32 = 500;

/// Every row of `kind` of `tenant`, every page, decoded.
pub(crate) async fn all_rows<T: serde::de::DeserializeOwned>(
    log: &bc_core::store::Log,
    tenant: &str,
    kind: &str,
) -> bc_core::Result<Vec<T>> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let rows = log.store.row_list(tenant, kind, after.as_deref(), ROWS_PER_READ).await?;
        let full = rows.len() == ROWS_PER_READ as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            out.push(serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("{kind} row: {e}")))?);
        }
        if !full {
            return Ok(out);
        }
    }
}
