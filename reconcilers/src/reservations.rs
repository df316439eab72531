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
//! read, or the one the plan's earlier appends give it (so no GPU is given twice). A pass that
//! loses a race gets a CONFLICT, stops that pool's queue, and the next pass decides again on
//! fresh state. Several processes can run it; one killed with
//! SIGKILL loses nothing, since its state is the log.
//!
//! Queue rule (also in the README): FIFO per pool by request order, strictly: the oldest queued
//! reservation of a pool is placed first, and a pool whose oldest does not fit activates nothing
//! until it does.

use std::collections::HashSet;
use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::id::{CommandId, TenantId};
use bc_core::store::{AppendRequest, Log};
use bc_core::{ErrorCode, Result};
use bc_projections::decide::{self, Action};
use bc_projections::fleet::Fleet;
use bc_projections::placement::Issue;
use futures::future::BoxFuture;

use crate::driver::Activation;

pub const NAME: &str = "reservations";
const ACTOR: &str = "reconciler:reservations";
/// The shortest time between two passes.
pub use crate::driver::PASS_INTERVAL_MIN_MS;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub activated: usize,
    pub expired: usize,
    /// Reservations whose hold failed: back in their queue, or (on their last attempt) failed.
    pub requeued: usize,
    pub failed: usize,
    /// Queued reservations held for a tenant their pool is no longer offered to: cancelled.
    pub cancelled: usize,
    /// Appends refused because another writer moved first; the next pass decides again.
    pub conflicts: usize,
}

/// Actions appended together, in one transaction, at most ([`Log::append_group`]): a pass that
/// activates thousands commits them a group at a time instead of one commit each.
pub const GROUP_ACTIONS_MAX: usize = 64;
/// Events one action appends at most (its reservation's event, its node's, and a command).
const ACTION_EVENTS_MAX: usize = 3;
const _: () = assert!(GROUP_ACTIONS_MAX * ACTION_EVENTS_MAX <= bc_core::store::BATCH_EVENTS_MAX);

/// One pass over every tenant with live reservations: [`decide::plan`] on this process's view
/// of the log (`fleet`), then the actions appended in order, in groups of up to
/// [`GROUP_ACTIONS_MAX`] that land whole or not at all. `known` are tenants to load into the
/// view first (every tenant on the first pass). The view holds nothing of the pass: it reads
/// what the appends did from the log on the next pass.
///
/// A group is gathered as if every action before it landed (an activation counting on an
/// expiry of the same group, say); one that does not land is appended again one action at a
/// time, each decided on what the actions before it did, as a pass without groups would: the
/// appends that still land land, and a pool stops at its first activation that does not.
///
/// Each action that issues a command (`gpu.hold` with an activation on a node with an agent,
/// `gpu.release` with an ending) gets a fresh command id from the log's id source.
pub async fn pass(log: &Log, fleet: &Fleet, clock: &dyn Clock, known: &[TenantId]) -> Result<Pass> {
    let mut done = Pass::default();
    let now_ms = clock.now_ms();
    let plans = fleet
        .with_busy_tenants(
            &*log.store,
            known,
            |view| decide::needs_nodes(view, now_ms),
            |tenant, view| (tenant, decide::plan(view, now_ms)),
        )
        .await?;
    for (tenant, actions) in plans {
        append_plan(log, tenant, now_ms, &actions, &mut done).await?;
    }
    Ok(done)
}

/// Appends one tenant's plan (see [`pass`]), counting what happened into `done`.
async fn append_plan(log: &Log, tenant: TenantId, now_ms: u64, actions: &[Action], done: &mut Pass) -> Result<()> {
    let mut run = TenantPass { log, tenant, now_ms, expired: HashSet::new(), stopped: HashSet::new(), done };
    let mut group: Vec<(&Action, AppendRequest)> = Vec::new();
    for action in actions {
        if group.len() == GROUP_ACTIONS_MAX {
            run.flush(std::mem::take(&mut group)).await?;
        }
        if !run.gate(action) {
            continue;
        }
        let Some(request) = run.request(action)? else { continue };
        // As if it landed, for the actions after it in the group.
        if let Action::Expire { reservation_id, .. } | Action::HoldFailed { reservation_id, .. } = action {
            run.expired.insert(reservation_id.clone());
        }
        group.push((action, request));
    }
    run.flush(group).await
}

/// One tenant's share of a pass: what landed so far, and the counts.
struct TenantPass<'a> {
    log: &'a Log,
    tenant: TenantId,
    now_ms: u64,
    /// Expiries (and failed holds) that landed, or are in the group being gathered.
    expired: HashSet<String>,
    /// Pools whose queue stopped at an activation that did not land.
    stopped: HashSet<String>,
    done: &'a mut Pass,
}

impl TenantPass<'_> {
    /// Whether `action` is to be appended after what landed so far: not a skip, not an
    /// activation of a stopped pool, not one whose guard counts on expiries that did not land
    /// (that stops its pool: the next pass decides again).
    fn gate(&mut self, action: &Action) -> bool {
        match action {
            Action::Skip { reservation_id, reason, .. } => {
                tracing::warn!(reconciler = NAME, reservation = %reservation_id, error = %reason, "skipping a reservation whose selector does not parse");
                false
            }
            Action::Activate { pool_id, freed_by, .. } => {
                if self.stopped.contains(pool_id) {
                    return false;
                }
                if !freed_by.iter().all(|id| self.expired.contains(id)) {
                    self.stopped.insert(pool_id.clone());
                    return false;
                }
                true
            }
            Action::Expire { .. } | Action::HoldFailed { .. } | Action::Withdraw { .. } => true,
        }
    }

    /// The append `action` makes, with a fresh command id.
    fn request(&self, action: &Action) -> Result<Option<AppendRequest>> {
        let command_id = CommandId::from_ulid(self.log.ids.ulid()).to_string();
        let append = action.append(Issue { command_id: &command_id, now_ms: self.now_ms })?;
        Ok(append.map(|a| a.into_request(self.tenant, ACTOR)))
    }

    /// Appends a gathered group in one transaction; if it does not land, its actions one at a
    /// time, each gated again on what landed.
    async fn flush(&mut self, group: Vec<(&Action, AppendRequest)>) -> Result<()> {
        if group.is_empty() {
            return Ok(());
        }
        let (actions, requests): (Vec<&Action>, Vec<AppendRequest>) = group.into_iter().unzip();
        let appended = match <[AppendRequest; 1]>::try_from(requests) {
            Ok([one]) => self.log.append(one).await.map(drop),
            Err(requests) => self.log.append_group(requests).await.map(drop),
        };
        match appended {
            Ok(()) => actions.into_iter().for_each(|action| self.landed(action)),
            Err(e) if actions.len() == 1 => {
                self.unassume(actions[0]);
                self.refused(actions[0], e);
            }
            Err(e) => {
                tracing::debug!(reconciler = NAME, actions = actions.len(), code = %e.code(), error = %e, "a group did not land; appending its actions one at a time");
                for action in &actions {
                    self.unassume(action);
                }
                for action in actions {
                    if !self.gate(action) {
                        continue;
                    }
                    let Some(request) = self.request(action)? else { continue };
                    match self.log.append(request).await {
                        Ok(_) => self.landed(action),
                        Err(e) => self.refused(action, e),
                    }
                }
            }
        }
        Ok(())
    }

    /// Forgets that an ending of a group that did not land was taken as landed.
    fn unassume(&mut self, action: &Action) {
        if let Action::Expire { reservation_id, .. } | Action::HoldFailed { reservation_id, .. } = action {
            self.expired.remove(reservation_id);
        }
    }

    fn landed(&mut self, action: &Action) {
        match action {
            Action::Expire { reservation_id, .. } => {
                self.done.expired += 1;
                self.expired.insert(reservation_id.clone());
            }
            Action::HoldFailed { reservation_id, reason, gives_up, attempts, .. } => {
                if *gives_up {
                    self.done.failed += 1;
                } else {
                    self.done.requeued += 1;
                }
                tracing::info!(reconciler = NAME, reservation = %reservation_id, attempts, failed = gives_up, reason = %bc_core::id::truncate(reason, 200), "hold failed");
                self.expired.insert(reservation_id.clone());
            }
            Action::Activate { .. } => self.done.activated += 1,
            Action::Withdraw { reservation_id, reason, .. } => {
                self.done.cancelled += 1;
                tracing::info!(reconciler = NAME, reservation = %reservation_id, reason = %reason, "cancelled");
            }
            Action::Skip { .. } => {}
        }
    }

    fn refused(&mut self, action: &Action, e: bc_core::Error) {
        match action {
            Action::Expire { .. } | Action::HoldFailed { .. } | Action::Withdraw { .. } if e.code() == ErrorCode::Conflict => {
                self.done.conflicts += 1
            }
            Action::Expire { reservation_id, .. }
            | Action::HoldFailed { reservation_id, .. }
            | Action::Withdraw { reservation_id, .. } => {
                // One reservation's failure is its own: the rest of the pass (other pools,
                // other tenants) goes on, and its pool activates nothing more this pass.
                tracing::warn!(reconciler = NAME, reservation = %reservation_id, code = %e.code(), error = %e, "ending failed");
                self.stopped.insert(action.pool_id().to_owned());
            }
            Action::Activate { .. } | Action::Skip { .. } => {
                // Oldest first: a pool whose next activation did not land activates nothing more.
                self.stopped.insert(action.pool_id().to_owned());
                if e.code() == ErrorCode::Conflict {
                    self.done.conflicts += 1;
                } else {
                    tracing::warn!(reconciler = NAME, reservation = %action.reservation_id(), code = %e.code(), error = %e, "activation failed");
                }
            }
        }
    }
}

/// The reconciler: [`pass`] on this process's view of the log, which it keeps between passes
/// (a cache: it catches up from the log by position). A pass that lost a race asks to pass
/// again soon; commits of this process wake it (its [`crate::driver::Schedule`]).
pub struct Reservations {
    log: Arc<Log>,
    clock: Arc<dyn Clock>,
    fleet: Fleet,
    /// Every tenant, read before the first pass (and again after a failed one); `None` until
    /// then.
    known: Option<Vec<TenantId>>,
}

impl Reservations {
    pub fn new(log: Arc<Log>, clock: Arc<dyn Clock>) -> Self {
        Self { log, clock, fleet: Fleet::new(), known: None }
    }
}

impl crate::driver::Reconciler for Reservations {
    fn name(&self) -> &'static str {
        NAME
    }

    fn activate(&mut self) -> BoxFuture<'_, Activation> {
        Box::pin(async move {
            let log = &*self.log;
            // The first pass loads every tenant; later ones find new tenants in the log.
            let first = self.known.is_none();
            if first {
                // Follow the log from before the tenants are listed, so none is missed in between.
                if let Err(e) = self.fleet.prime(&*log.store).await {
                    tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "reading the log failed");
                }
                match log.store.heads().await {
                    Ok(heads) => self.known = Some(heads.into_iter().map(|(t, _)| t).collect()),
                    Err(e) => tracing::warn!(reconciler = NAME, code = %e.code(), error = %e, "listing tenants failed"),
                }
            }
            let tenants: &[TenantId] = if first { self.known.as_deref().unwrap_or(&[]) } else { &[] };
            match pass(log, &self.fleet, &*self.clock, tenants).await {
                Ok(p) => {
                    if p.activated + p.expired + p.requeued + p.failed + p.cancelled + p.conflicts > 0 {
                        tracing::info!(
                            reconciler = NAME,
                            activated = p.activated,
                            expired = p.expired,
                            requeued = p.requeued,
                            failed = p.failed,
                            cancelled = p.cancelled,
                            conflicts = p.conflicts,
                            "pass"
                        );
                    }
                    let counts = vec![
                        ("activated", p.activated as u64),
                        ("expired", p.expired as u64),
                        ("requeued", p.requeued as u64),
                        ("failed", p.failed as u64),
                        ("cancelled", p.cancelled as u64),
                        ("conflicts", p.conflicts as u64),
                    ];
                    Activation { outcome: Ok(counts), again: p.conflicts > 0 }
                }
                Err(e) => {
                    // The view may have been dropped: load every tenant again next time.
                    self.known = None;
                    Activation::failed(e)
                }
            }
        })
    }
}

/// Runs this reconciler alone until `shutdown` ([`crate::driver::run`]): every `tick_ms`, and
/// soon after a commit of this process (`wake`). The benches start it so; `dev`, `serve` and
/// `reconcile` start it from [`crate::registry`].
pub async fn run(
    log: Arc<Log>,
    clock: Arc<dyn Clock>,
    tick_ms: u64,
    wake: Option<tokio::sync::watch::Receiver<u64>>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let schedule = crate::driver::Schedule { period_ms: tick_ms, first_after_period: false, wake };
    let store = log.store.clone();
    crate::driver::run(Box::new(Reservations::new(log, clock.clone())), schedule, store, clock, shutdown).await;
}

#[cfg(test)]
// Tests, outside the simulator: fresh random ids and the real clock (clippy.toml).
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::sync::Arc;

    use bc_core::clock::SystemClock;
    use bc_core::id::{NodeId, PoolId, ReservationId, TenantId};
    use bc_core::keys::LogKey;
    use bc_core::store::sqlite::SqliteStore;
    use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
    use bc_projections::events::{self as ev, Gpu};
    use bc_projections::fleet::Fleet;
    use bc_projections::placement::{self, Ask, Selector};
    use bc_projections::{
        KIND_NODE, KIND_POOL, KIND_RESERVATION, NodeDoc, Projections, ReservationDoc, ReservationState, stream_of,
    };

    use super::{Action, Pass, pass};

    fn requested(pool: &str, gpus: u32) -> NewEvent {
        let payload = ev::ReservationRequested {
            pool_id: pool.to_owned(),
            gpus,
            duration_s: 3600,
            selector: String::new(),
            nvlink: false,
            tolerations: vec![],
            project_id: None,
        };
        NewEvent::new(ev::RESERVATION_REQUESTED, ev::to_cbor(&payload).unwrap())
    }

    async fn reservation(store: &dyn EventStore, tenant: TenantId, id: &str) -> ReservationDoc {
        let row = store.row_get(&tenant.to_string(), KIND_RESERVATION, id).await.unwrap().unwrap();
        serde_json::from_value(row.doc).unwrap()
    }

    /// A fresh SQLite store and log in the temporary directory, with one tenant's pool.
    struct Scratch {
        path: std::path::PathBuf,
        store: Arc<dyn EventStore>,
        log: Log,
        tenant: TenantId,
        pool: String,
    }

    async fn scratch(name: &str) -> Scratch {
        let path = std::env::temp_dir().join(format!("bc-reservations-{name}-{}.sqlite3", TenantId::generate()));
        let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&path).await.unwrap());
        store.migrate().await.unwrap();
        let log =
            Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap();
        let tenant = TenantId::generate();
        let pool = PoolId::generate().to_string();
        let created = ev::PoolCreated::named("p");
        let event = NewEvent::new(ev::POOL_CREATED, ev::to_cbor(&created).unwrap());
        let request = AppendRequest::new(tenant, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, "test", vec![event]);
        log.append(request).await.unwrap();
        Scratch { path, store, log, tenant, pool }
    }

    /// Registers `nodes` nodes of 8 GPUs (two NVLink domains) in `pool`, then queues `queued`
    /// reservations of 4 GPUs, in that order.
    async fn fill(log: &Log, tenant: TenantId, pool: &str, nodes: usize, queued: usize) {
        let append = |stream: String, events| AppendRequest::new(tenant, stream, ExpectedVersion::NoStream, "test", events);
        for i in 0..nodes {
            let gpus = (0..8)
                .map(|g| Gpu { model: "H100".into(), product: "H100-SXM5-80GB".into(), vram_gib: 80, nvlink_domain: g / 4 })
                .collect();
            let node = ev::NodeRegistered { pool_id: pool.to_owned(), name: format!("n{i}"), gpus, labels: Default::default() };
            let event = NewEvent::new(ev::NODE_REGISTERED, ev::to_cbor(&node).unwrap());
            log.append(append(stream_of(KIND_NODE, &NodeId::generate()), vec![event])).await.unwrap();
        }
        for _ in 0..queued {
            let id = ReservationId::generate().to_string();
            log.append(append(stream_of(KIND_RESERVATION, &id), vec![requested(pool, 4)])).await.unwrap();
        }
    }

    /// One pass activates a whole queue that fits, several on each node, each activation
    /// guarding the node at the version the pass's earlier appends gave it: no append of the
    /// pass conflicts with another of the same pass.
    #[tokio::test]
    async fn one_pass_drains_a_queue_that_fits_without_conflicting_with_itself() {
        const NODES: usize = 30;
        const QUEUED: usize = 70;
        let Scratch { path, store, log, tenant, pool } = scratch("drain").await;
        fill(&log, tenant, &pool, NODES, QUEUED).await;

        let fleet = Fleet::new();
        fleet.prime(&*store).await.unwrap();
        let batches = log.stats.snapshot()[0];
        let first = pass(&log, &fleet, &SystemClock, &[tenant]).await.unwrap();
        assert_eq!(first, Pass { activated: 2 * NODES, ..Pass::default() }, "the queue up to a full pool, in one pass");
        assert_eq!(log.stats.snapshot()[0] - batches, 1, "{} activations, one group: one commit", 2 * NODES);
        assert_eq!(pass(&log, &fleet, &SystemClock, &[]).await.unwrap(), Pass::default(), "the rest wait");
        drop(log);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }

    /// A group with an activation that no longer lands (its node was cordoned after the plan
    /// read it) lands nothing; its actions are then appended one at a time, so those before the
    /// refused activation land and the pool's queue stops at it, as a pass without groups does.
    #[tokio::test]
    async fn a_group_that_does_not_land_is_appended_one_action_at_a_time_and_stops_its_pool() {
        const NODES: usize = 12;
        let Scratch { path, store, log, tenant, pool } = scratch("group").await;
        let append = |stream: String, expected, events| AppendRequest::new(tenant, stream, expected, "test", events);
        fill(&log, tenant, &pool, NODES, 2 * NODES).await;
        let nodes = placement::pool_nodes(&*store, tenant, &pool).await.unwrap();
        let view = bc_projections::fleet::FleetIndex::new(nodes, placement::live(&*store, tenant).await.unwrap());
        let actions = bc_projections::decide::plan(&view, 1);
        assert_eq!(actions.len(), 2 * NODES);
        // The node of the ninth activation (the fifth node), cordoned after the plan: its first
        // activation is refused.
        let Action::Activate { placement: ninth, .. } = &actions[8] else { panic!("{:?}", actions[8]) };
        let first_on_it = actions
            .iter()
            .position(|a| matches!(a, Action::Activate { placement, .. } if placement.node_id == ninth.node_id))
            .unwrap();
        let cordon = NewEvent::new(ev::NODE_CORDONED, ev::to_cbor(&ev::NodeStateChanged {}).unwrap());
        log.append(append(stream_of(KIND_NODE, &ninth.node_id), ExpectedVersion::Any, vec![cordon])).await.unwrap();

        let mut done = Pass::default();
        super::append_plan(&log, tenant, 1, &actions, &mut done).await.unwrap();
        assert_eq!(done, Pass { activated: first_on_it, conflicts: 1, ..Pass::default() });
        let live = placement::live(&*store, tenant).await.unwrap();
        assert_eq!(live.iter().filter(|r| r.state == ReservationState::Active).count(), first_on_it);
        drop(log);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }

    /// The pass reads the pools' offers from the log like the nodes: a reservation held for a
    /// tenant the pool is offered to is placed; once the pool is withdrawn from that tenant (the
    /// unoffer read by the view's catch-up), a held one still queued is cancelled with the
    /// reason, never placed, and the active one is left to run to its end.
    #[tokio::test]
    async fn a_held_reservation_is_placed_while_offered_and_cancelled_once_withdrawn() {
        let Scratch { path, store, log, tenant, pool } = scratch("offers").await;
        let holder = TenantId::generate().to_string();
        let append = |stream: String, events| AppendRequest::new(tenant, stream, ExpectedVersion::Any, "test", events);
        let offers = |event_type: &str| {
            let payload = ev::PoolOffers { tenant_ids: vec![holder.clone()], owner_tenant_id: None };
            NewEvent::new(event_type, ev::to_cbor(&payload).unwrap())
        };
        let held = |gpus| {
            let held_for = ev::ReservationHeldFor { tenant_id: holder.clone() };
            vec![requested(&pool, gpus), NewEvent::new(ev::RESERVATION_HELD_FOR, ev::to_cbor(&held_for).unwrap())]
        };
        log.append(append(stream_of(KIND_POOL, &pool), vec![offers(ev::POOL_OFFERED)])).await.unwrap();
        fill(&log, tenant, &pool, 1, 0).await;
        let fleet = Fleet::new();
        fleet.prime(&*store).await.unwrap();

        let first = ReservationId::generate().to_string();
        log.append(append(stream_of(KIND_RESERVATION, &first), held(2))).await.unwrap();
        assert_eq!(pass(&log, &fleet, &SystemClock, &[tenant]).await.unwrap(), Pass { activated: 1, ..Pass::default() });

        let second = ReservationId::generate().to_string();
        log.append(append(stream_of(KIND_RESERVATION, &second), held(2))).await.unwrap();
        // Withdrawn without cancelling the queued one (as a requeue landing after it would leave it).
        log.append(append(stream_of(KIND_POOL, &pool), vec![offers(ev::POOL_UNOFFERED)])).await.unwrap();
        assert_eq!(pass(&log, &fleet, &SystemClock, &[]).await.unwrap(), Pass { cancelled: 1, ..Pass::default() });
        let cancelled = reservation(&*store, tenant, &second).await;
        assert_eq!(cancelled.state, ReservationState::Cancelled);
        let reason = bc_projections::decide::pool_offer::unoffered_reason(&pool, &holder);
        assert_eq!(cancelled.last_error.as_deref(), Some(reason.as_str()));
        assert_eq!(reservation(&*store, tenant, &first).await.state, ReservationState::Active, "runs to its end");
        assert_eq!(pass(&log, &fleet, &SystemClock, &[]).await.unwrap(), Pass::default());
        drop(log);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }

    /// One pass expires a reservation and gives its GPUs to the oldest queued one, guarding the
    /// node at the version the expiry's append gives it; the next in line waits.
    #[tokio::test]
    async fn one_pass_expires_then_activates_on_the_freed_gpus() {
        let Scratch { path, store, log, tenant, pool } = scratch("pass").await;
        let append = |stream: String, expected, events| AppendRequest::new(tenant, stream, expected, "test", events);
        let node_id = NodeId::generate().to_string();
        let gpu = Gpu { model: "H100".into(), product: "H100-SXM5-80GB".into(), vram_gib: 80, nvlink_domain: 0 };
        let node = ev::NodeRegistered { pool_id: pool.clone(), name: "n".into(), gpus: vec![gpu; 4], labels: Default::default() };
        let event = NewEvent::new(ev::NODE_REGISTERED, ev::to_cbor(&node).unwrap());
        log.append(append(stream_of(KIND_NODE, &node_id), ExpectedVersion::NoStream, vec![event])).await.unwrap();

        // `done` holds the whole node and ended long ago; `big` then `small` wait behind it.
        let row = store.row_get(&tenant.to_string(), KIND_NODE, &node_id).await.unwrap().unwrap();
        let node: NodeDoc = serde_json::from_value(row.doc).unwrap();
        let selector = Selector::default();
        let ask = Ask { gpus: 4, selector: &selector, nvlink: false, tolerations: &[] };
        let placed = placement::place([&node], &ask).unwrap();
        let done = ReservationId::generate().to_string();
        let issue = placement::Issue { command_id: "cmd_unused", now_ms: 1 };
        let (events, guards) = placement::activation(&done, &placed, 1, issue).unwrap();
        let mut request = append(stream_of(KIND_RESERVATION, &done), ExpectedVersion::NoStream, vec![requested(&pool, 4)]);
        request.events.extend(events);
        request.guards = guards;
        log.append(request).await.unwrap();
        let (big, small) = (ReservationId::generate().to_string(), ReservationId::generate().to_string());
        for (id, gpus) in [(&big, 4), (&small, 1)] {
            log.append(append(stream_of(KIND_RESERVATION, id), ExpectedVersion::NoStream, vec![requested(&pool, gpus)]))
                .await
                .unwrap();
        }

        let fleet = Fleet::new();
        fleet.prime(&*store).await.unwrap();
        let first = pass(&log, &fleet, &SystemClock, &[tenant]).await.unwrap();
        assert_eq!(first, Pass { activated: 1, expired: 1, ..Pass::default() }, "both in one pass, no conflict");
        assert_eq!(reservation(&*store, tenant, &done).await.state, ReservationState::Expired);
        let activated = reservation(&*store, tenant, &big).await;
        assert_eq!((activated.state, activated.node_id.as_deref()), (ReservationState::Active, Some(node_id.as_str())));
        assert_eq!(reservation(&*store, tenant, &small).await.state, ReservationState::Queued);
        // The view reads what the pass appended from the log: nothing more to do.
        assert_eq!(pass(&log, &fleet, &SystemClock, &[]).await.unwrap(), Pass::default());
        drop(log);
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
}
