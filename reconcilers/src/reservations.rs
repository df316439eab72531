//! The `reservations` reconciler: activates queued reservations when capacity frees, and ends
//! active ones at their end time. Level-triggered: every pass compares the live reservations
//! (projection rows) with the time and the nodes; commits wake it early in process, and it
//! polls otherwise.
//!
//! What a pass does is decided by [`decide::plan`], a pure function of the view and the time;
//! this file appends the plan's actions and counts what happened.
//!
//! Every effect is an append through the [`Log`], decided on the versions it read: activation
//! appends to the reservation's stream at its version (so it is activated once, whichever
//! process gets there first) and `node.allocated` to the node's stream at the version placement
//! read (so no GPU is given twice). A pass that loses a race gets a CONFLICT, does nothing, and
//! the next pass decides again on fresh state. Several processes can run it; one killed with
//! SIGKILL loses nothing, since its state is the log.
//!
//! Queue rule (also in the README): FIFO per pool by request order, strictly: the oldest queued
//! reservation of a pool is placed first, and a pool whose oldest does not fit activates nothing
//! until it does.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bc_core::clock::Clock;
use bc_core::id::TenantId;
use bc_core::store::Log;
use bc_core::{ErrorCode, Result};
use bc_projections::decide::{self, Action};
use bc_projections::fleet::Fleet;

pub const NAME: &str = "reservations";
const ACTOR: &str = "reconciler:reservations";
/// The shortest time between two passes.
pub const PASS_INTERVAL_MIN_MS: u64 = 20;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub activated: usize,
    pub expired: usize,
    /// Appends refused because another writer moved first; the next pass decides again.
    pub conflicts: usize,
}

/// One pass over every tenant with live reservations: [`decide::plan`] on this process's view
/// of the log (`fleet`), then each action appended in order. `known` are tenants to load into
/// the view first (every tenant on the first pass). The view holds nothing of the pass: it
/// reads what the appends did from the log on the next pass.
pub async fn pass(log: &Log, fleet: &Fleet, clock: &dyn Clock, known: &[TenantId]) -> Result<Pass> {
    let mut done = Pass::default();
    let now_ms = clock.now_ms();
    let plans = fleet.with_busy_tenants(&*log.store, known, |tenant, view| (tenant, decide::plan(view, now_ms))).await?;
    for (tenant, actions) in plans {
        // Expiries that landed, and pools whose queue stopped at an activation that did not.
        let mut expired: HashSet<String> = HashSet::new();
        let mut stopped: HashSet<String> = HashSet::new();
        for action in &actions {
            match action {
                Action::Skip { reservation_id, reason, .. } => {
                    tracing::warn!(reconciler = NAME, reservation = %reservation_id, error = %reason, "skipping a reservation whose selector does not parse");
                    continue;
                }
                Action::Activate { pool_id, freed_by, .. } => {
                    if stopped.contains(pool_id) {
                        continue;
                    }
                    // Its guard counts on expiries that did not land: the next pass decides again.
                    if !freed_by.iter().all(|id| expired.contains(id)) {
                        stopped.insert(pool_id.clone());
                        continue;
                    }
                }
                Action::Expire { .. } => {}
            }
            let Some(append) = action.append()? else { continue };
            let appended = log.append(append.into_request(tenant, ACTOR)).await;
            match (action, appended) {
                (Action::Expire { reservation_id, .. }, Ok(_)) => {
                    done.expired += 1;
                    expired.insert(reservation_id.clone());
                }
                (Action::Expire { .. }, Err(e)) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                (Action::Expire { .. }, Err(e)) => return Err(e),
                (_, Ok(_)) => done.activated += 1,
                (_, Err(e)) => {
                    // Oldest first: a pool whose next activation did not land activates nothing more.
                    stopped.insert(action.pool_id().to_owned());
                    if e.code() == ErrorCode::Conflict {
                        done.conflicts += 1;
                    } else {
                        tracing::warn!(reconciler = NAME, reservation = %action.reservation_id(), code = %e.code(), error = %e, "activation failed");
                    }
                }
            }
        }
    }
    Ok(done)
}

/// Runs passes until `shutdown`: every `tick_ms`, and at once after a commit of this process.
pub async fn run(
    log: Arc<Log>,
    clock: Arc<dyn Clock>,
    tick_ms: u64,
    mut wake: Option<tokio::sync::watch::Receiver<u64>>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    tracing::info!(reconciler = NAME, "reconciler started");
    let fleet = Fleet::new();
    let mut known: Option<Vec<TenantId>> = None;
    while !*shutdown.borrow() {
        // The first pass loads every tenant; later ones find new tenants in the log.
        let first = known.is_none();
        if first {
            // Follow the log from before the tenants are listed, so none is missed in between.
            if let Err(e) = fleet.prime(&*log.store).await {
                tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "reading the log failed");
            }
            match log.store.heads().await {
                Ok(heads) => known = Some(heads.into_iter().map(|(t, _)| t).collect()),
                Err(e) => tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "listing tenants failed"),
            }
        }
        let tenants: &[TenantId] = if first { known.as_deref().unwrap_or(&[]) } else { &[] };
        let result = pass(&log, &fleet, &*clock, tenants).await;
        if result.is_err() {
            // The view may have been dropped: load every tenant again next time.
            known = None;
        }
        match result {
            Ok(p) if p.activated + p.expired + p.conflicts > 0 => {
                tracing::info!(reconciler = NAME, activated = p.activated, expired = p.expired, conflicts = p.conflicts, "pass");
                if p.conflicts > 0 {
                    continue;
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "pass failed; retrying"),
        }
        // At most one pass per PASS_INTERVAL_MIN_MS however often commits wake it.
        tokio::time::sleep(Duration::from_millis(PASS_INTERVAL_MIN_MS.min(tick_ms))).await;
        crate::idle(tick_ms.saturating_sub(PASS_INTERVAL_MIN_MS), &mut wake, &mut shutdown).await;
    }
    tracing::info!(reconciler = NAME, "reconciler stopped");
}
