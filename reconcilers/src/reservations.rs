//! The `reservations` reconciler: activates queued reservations when capacity frees, and ends
//! active ones at their end time. Level-triggered: every pass compares the live reservations
//! (projection rows) with the time and the nodes; commits wake it early in process, and it
//! polls otherwise.
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

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bc_core::clock::Clock;
use bc_core::id::TenantId;
use bc_core::store::{AppendRequest, ExpectedVersion, Log, NewEvent};
use bc_core::{ErrorCode, Result};
use bc_projections::events as ev;
use bc_projections::fleet::Fleet;
use bc_projections::placement::{self, Ask, Selector};
use bc_projections::{ACTIVE, KIND_RESERVATION, QUEUED, ReservationDoc, stream_of};

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

/// `events` on `rsv`'s stream at the version this pass read, with `guard` on the node.
fn request(tenant: TenantId, rsv: &ReservationDoc, (events, guard): (Vec<NewEvent>, (String, ExpectedVersion))) -> AppendRequest {
    let stream = stream_of(KIND_RESERVATION, &rsv.reservation_id);
    let mut request = AppendRequest::new(tenant, stream, ExpectedVersion::Exact(rsv.version), ACTOR, events);
    request.guards = vec![guard];
    request
}

/// One pass over every tenant with live reservations. `fleet` is this process's view of the
/// log; `known` are tenants to load into it first (every tenant on the first pass).
pub async fn pass(log: &Log, fleet: &Fleet, clock: &dyn Clock, known: &[TenantId]) -> Result<Pass> {
    let mut done = Pass::default();
    let now = clock.now_ms();
    // Only what is due is copied out of the view.
    let work = fleet
        .with_busy_tenants(&*log.store, known, |tenant, view| {
            let due = view.live.values().filter(|r| r.state == ACTIVE && r.ends_at_ms.is_some_and(|end| end <= now));
            let queued = view.live.values().filter(|r| r.state == QUEUED);
            (tenant, due.cloned().collect::<Vec<ReservationDoc>>(), queued.cloned().collect::<Vec<ReservationDoc>>())
        })
        .await?;
    for (tenant, expired, queued) in work {
        // Expiry first: it frees GPUs the queue may be waiting for.
        for rsv in &expired {
            let Some(node) = rsv.node_id.as_deref() else { continue };
            let req = request(tenant, rsv, placement::ending(&rsv.reservation_id, node, ev::RESERVATION_EXPIRED)?);
            match log.append(req).await {
                Ok(_) => done.expired += 1,
                Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                Err(e) => return Err(e),
            }
        }
        let mut queues: BTreeMap<&str, Vec<&ReservationDoc>> = BTreeMap::new();
        for rsv in &queued {
            queues.entry(rsv.pool_id.as_str()).or_default().push(rsv);
        }
        for (pool, mut queue) in queues {
            queue.sort_by_key(|r| r.request_seq);
            // A selector this version cannot read (a newer writer's) skips that reservation with
            // a warning; it must not stop every other pool's queue and expiry.
            queue.retain(|rsv| match Selector::parse(&rsv.selector) {
                Ok(_) => true,
                Err(e) => {
                    tracing::warn!(reconciler = NAME, reservation = %rsv.reservation_id, error = %e, "skipping a reservation whose selector does not parse");
                    false
                }
            });
            let selectors: Vec<Selector> = queue.iter().map(|rsv| Selector::parse(&rsv.selector).unwrap_or_default()).collect();
            // Oldest first, one at a time; stop at the first that does not fit or fails.
            for (rsv, selector) in queue.iter().zip(&selectors) {
                let ask = Ask { gpus: rsv.gpus, selector, nvlink: rsv.nvlink, tolerations: &rsv.tolerations };
                let placed = fleet
                    .with_pool(&*log.store, tenant, pool, |nodes| placement::place_and_hold(nodes, &ask, &rsv.reservation_id))
                    .await?;
                let Some(p) = placed else { break };
                let ends_at_ms = clock.now_ms().saturating_add(rsv.duration_s.saturating_mul(1000));
                let req = request(tenant, rsv, placement::activation(&rsv.reservation_id, &p, ends_at_ms)?);
                match log.append(req).await {
                    Ok(_) => {
                        done.activated += 1;
                        // Only this pass holds GPUs in this view, and the append moved the node
                        // from the version decided on by exactly this allocation: the view is
                        // the store's next version.
                        fleet.confirm(tenant, &p.node_id, p.node_version).await;
                    }
                    Err(e) => {
                        fleet.forget(tenant, &p.node_id).await;
                        if e.code() == ErrorCode::Conflict {
                            done.conflicts += 1;
                        } else {
                            tracing::warn!(reconciler = NAME, reservation = %rsv.reservation_id, code = %e.code(), error = %e, "activation failed");
                        }
                        break;
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
