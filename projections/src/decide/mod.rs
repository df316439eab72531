//! Decisions: pure functions from state (this process's [`FleetIndex`](crate::fleet::FleetIndex) of the fleet, the
//! documents a method read) and input (the parsed, checked request, the time, the ids of what
//! it creates) to what to append ([`Append`]: events, stream, expected version, guards), or a
//! typed [`Refusal`]. No IO, no clock, no id generation in here: the caller reads, draws ids and
//! the time, and appends; so the gateway, the reservations reconciler, the simulator and the
//! tests make the very same decisions, and the same view and input give the same appends.
//!
//! - A gateway handler is parse → one decision → append → view; a decision that must be made
//!   again when its append lost a race (the quota's, for [`reservation_create`]) is retried by
//!   the gateway's application layer (`bc_gateway::app`), never here and never in a handler.
//! - A node choice or a retry rule a method needs ([`rollout_nodes`], [`workflow_retry`]) is a
//!   decision too, so the simulator and the gateway share it.
//! - The reservations reconciler's pass is [`plan`]`(view, now_ms)` (expiries first, then each
//!   pool's queue in FIFO order), then one append per [`Action`].
//!
//! This file holds what the decisions share ([`Append`], [`Refusal`], [`PoolLoad`]). The unit
//! tests (no database) are in `projections/tests/decide.rs` and `projections/tests/rollout.rs`.

use std::collections::BTreeMap;

use bc_core::Error;
use bc_core::id::TenantId;
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};

use crate::{KIND_RESERVATION, ReservationDoc, ReservationState, stream_of};

pub mod batch;
mod capacity;
pub mod image;
mod instance;
pub mod join_request;
mod metal;
mod plan;
pub mod pool_offer;
pub mod project;
pub mod quota;
mod reservation;
mod rollout;
pub mod sandbox;
pub mod sandbox_snapshot;
pub mod sandbox_volume;
pub mod secret;
pub mod site;
pub mod ssh_cert;
pub mod tunnel;
pub mod usage;

pub use capacity::{CapacityPreview, ModelCapacity, PoolCapacity, ProductCapacity, capacity_preview, pool_capacity};
pub use instance::{
    CAPABILITY_INSTANCE_APPLY, InstanceAction, InstanceCreateInput, InstanceRequest, instance_create, instance_request,
    instance_request_under, instances_plan,
};
pub use metal::{
    DEPLOY_TOKEN_GRACE_S, MetalPlan, StepResult, VerbInput, WorkflowRetry, metal_drift, metal_fail, metal_pause, metal_plan,
    metal_run_now, metal_step, metal_unauthorized_at_rest, metal_verb, step_backoff_ms, workflow_retry,
};
pub use plan::{Action, Policy, QueueRule, needs_nodes, plan, plan_with};
// `node_keys_change`, `node_register` and their bounds are defined below.
pub use reservation::{
    HeldFor, OfferedCreate, ReservationAsk, ReservationCreate, ReservationCreateInput, reservation_create,
    reservation_create_offered, reservation_extend, reservation_release,
};
pub use rollout::{
    RolloutCreateInput, RolloutPlan, RolloutVerb, agent_update_issue, release_check, release_refusal, resolve_waves,
    rollout_create, rollout_nodes, rollout_plan, rollout_selector, rollout_verb,
};

/// One append a decision asks for: `events` on `stream` (or, for an event that names one, on
/// another stream of the tenant, which is then one of the `guards`), if `stream` is at
/// `expected` and every guarded stream at its version. The caller adds who appends and the
/// request's idempotency key.
#[derive(Clone, Debug, PartialEq)]
pub struct Append {
    pub stream: String,
    pub expected: ExpectedVersion,
    pub guards: Vec<(String, ExpectedVersion)>,
    pub events: Vec<NewEvent>,
}

impl Append {
    /// `events` with guards on other streams (what [`crate::placement::activation`] and
    /// [`crate::placement::ending`] give).
    pub fn guarded(
        stream: String,
        expected: ExpectedVersion,
        (events, guards): (Vec<NewEvent>, Vec<(String, ExpectedVersion)>),
    ) -> Self {
        Self { stream, expected, guards, events }
    }

    /// The request for the log, by `actor`, with no idempotency key.
    pub fn into_request(self, tenant: TenantId, actor: impl Into<String>) -> AppendRequest {
        let mut request = AppendRequest::new(tenant, self.stream, self.expected, actor, self.events);
        request.guards = self.guards;
        request
    }

    /// The types of the events, in order.
    pub fn event_types(&self) -> Vec<&str> {
        self.events.iter().map(|e| e.event_type.as_str()).collect()
    }
}

/// Why a decision appends nothing: the request is refused (`Internal` aside, which is a broken
/// invariant, not the caller's mistake). Each maps to the error the caller sees
/// (`From<Refusal> for bc_core::Error`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("pool {pool_id} is archived")]
    PoolArchived { pool_id: String },
    #[error("durationS {duration_s} is past the pool's maximum of {max_reservation_s} s")]
    DurationPastPoolMaximum { duration_s: u64, max_reservation_s: u64 },
    /// No node of the pool could hold it even empty: queued, it would block the pool for good.
    #[error(
        "no node in pool {pool_id} could ever hold {gpus} GPUs{}{}",
        if .selector.is_empty() { String::new() } else { format!(" matching {:?}", .selector) },
        if *.nvlink { " in one NVLink domain" } else { "" }
    )]
    NeverFits { pool_id: String, gpus: u32, selector: String, nvlink: bool },
    /// The tenant's live reservations in the pool plus this one would pass its quota.
    #[error("{requested} GPUs would take the tenant to {} of its quota of {limit} in pool {pool_id}", .in_use + .requested)]
    OverQuota { pool_id: String, requested: u32, in_use: u32, limit: u32 },
    /// An instance's or a sandbox's vCPUs, memory or count would pass a resource limit of the
    /// tenant's quota in its pool ([`quota::admit`]'s words).
    #[error("{0}")]
    OverResourceQuota(String),
    /// `ifVersion` names another version than the one the decision read.
    #[error("reservation {reservation_id} is at version {actual}, not {expected}")]
    VersionMismatch { reservation_id: String, expected: u64, actual: u64 },
    #[error("reservation {reservation_id} is {state}: only an active reservation is extended")]
    NotActive { reservation_id: String, state: ReservationState },
    #[error("extending by {by_s} s goes past the pool's maximum of {max_reservation_s} s")]
    ExtendPastPoolMaximum { by_s: u64, max_reservation_s: u64 },
    /// A node would carry more labels (or taints) than [`NODE_KEYS_MAX`].
    #[error("node {node_id} would have {count} {what}, more than the {max} a node may have", max = NODE_KEYS_MAX)]
    TooManyNodeKeys { node_id: String, what: &'static str, count: usize },
    /// The tenant has [`NODES_PER_TENANT_MAX`] nodes already.
    #[error("the tenant has {count} nodes, its limit of {max}", max = NODES_PER_TENANT_MAX)]
    TooManyNodes { count: usize },
    /// The reservation cannot take an instance now (not active, not bound, or it has one).
    #[error("reservation {reservation_id} cannot take an instance: {why}")]
    ReservationNotReady { reservation_id: String, version: u64, why: String },
    /// The flavor does not fit the reservation (another pool, another GPU count).
    #[error("{0}")]
    InstanceMismatch(String),
    /// The node's agent has no hypervisor (it does not say `instance.apply`).
    #[error("node {node_id} does not run instances: its agent has no hypervisor (capability instance.apply)")]
    NodeCannotRunInstances { node_id: String, version: u64 },
    #[error("instance {instance_id} is at version {actual}, not {expected}")]
    InstanceVersionMismatch { instance_id: String, expected: u64, actual: u64 },
    #[error("instance {instance_id} is {state}: it takes no other request")]
    InstanceFinished { instance_id: String, version: u64, state: &'static str },
    /// The node is not one that can go for good now (`why` says what holds it).
    #[error("node {node_id} cannot be deleted: {why}")]
    NodeNotDeletable { node_id: String, version: u64, why: String },
    /// The pool is not (or no longer) offered to the tenant that asks (`pools.offer`).
    #[error("pool {pool_id} is not offered to tenant {tenant_id}")]
    NotOffered { pool_id: String, tenant_id: String },
    /// An offer the pool cannot take (`pools.offer`): its owner, or past the bound.
    #[error("{0}")]
    OfferInvalid(String),
    /// The reservation is held for another tenant (a pool offered to it): its GPUs are that
    /// tenant's, charged to its quota, so the owner starts no instance on them.
    #[error(
        "reservation {reservation_id} is held for tenant {holder_tenant_id} (its pool is offered to that tenant): the owner starts no instance on it"
    )]
    HeldForOther { reservation_id: String, holder_tenant_id: String },
    /// A held reservation whose pool is no longer offered to its holder: it runs to its end.
    #[error(
        "reservation {reservation_id} is held for tenant {tenant_id}, to whom pool {pool_id} is no longer offered: it runs to its end and is not extended"
    )]
    OfferWithdrawn { reservation_id: String, pool_id: String, tenant_id: String },
    /// Not a refusal of the request: a document breaks an invariant (an active reservation
    /// without a node) or a payload does not encode.
    #[error("{0}")]
    Internal(String),
}

/// What to do when a pool a request names is archived (every `INVALID_STATE` refusal of one).
pub const ARCHIVED_POOL_HINT: &str = "use a pool that is not archived (pools list)";

impl From<Refusal> for Error {
    fn from(refusal: Refusal) -> Self {
        let message = refusal.to_string();
        match refusal {
            // Refusals that depend on what is stored, not on the request alone: the same request
            // may succeed in another state, so they are INVALID_STATE (409), never a usage error.
            Refusal::DurationPastPoolMaximum { .. } => {
                Error::state(message, "ask for a shorter reservation and extend it later, within the maximum")
            }
            Refusal::NeverFits { .. } => {
                Error::state(message, "check the selector's values with `capacity`, or ask for fewer GPUs")
            }
            Refusal::OverQuota { .. } | Refusal::OverResourceQuota(_) => Error::QuotaExceeded(message),
            Refusal::VersionMismatch { reservation_id, expected, actual } => {
                Error::Conflict { stream: stream_of(KIND_RESERVATION, &reservation_id), expected: expected.to_string(), actual }
            }
            Refusal::TooManyNodeKeys { what, .. } => {
                Error::state(message, format!("remove some {what} in the same call (`remove`), or use fewer"))
            }
            Refusal::TooManyNodes { .. } => Error::state(message, "deregister nodes that are gone, or use another tenant"),
            Refusal::PoolArchived { .. } => Error::state(message, ARCHIVED_POOL_HINT),
            Refusal::NotOffered { pool_id, tenant_id } => {
                Error::not_found(format!("pool {pool_id} offered to tenant {tenant_id}"))
            }
            Refusal::OfferInvalid(_) => Error::invalid(message),
            Refusal::HeldForOther { .. } => {
                Error::state(message, "start instances on a reservation of your own; release this one to take its GPUs back")
            }
            Refusal::OfferWithdrawn { .. } => {
                Error::state(message, "offer the pool to the tenant again (pools offer) to extend it, or reserve again")
            }
            Refusal::NotActive { .. } => {
                Error::state(message, "wait until a queued reservation is active, or reserve again if it has ended")
            }
            Refusal::ExtendPastPoolMaximum { .. } => Error::state(message, "extend by less, or reserve again when this one ends"),
            Refusal::ReservationNotReady { reservation_id, version, why } => Error::Conflict {
                stream: stream_of(KIND_RESERVATION, &reservation_id),
                expected: format!("an active reservation with its GPUs bound and no instance ({why})"),
                actual: version,
            },
            Refusal::InstanceMismatch(_) => {
                Error::state(message, "choose a flavor of the reservation's pool with as many GPUs as it holds")
            }
            Refusal::NodeCannotRunInstances { node_id, version } => Error::Conflict {
                stream: stream_of(crate::KIND_NODE, &node_id),
                expected: "a node whose agent runs instances (capability instance.apply)".into(),
                actual: version,
            },
            Refusal::InstanceVersionMismatch { instance_id, expected, actual } => {
                Error::Conflict { stream: stream_of(crate::KIND_INSTANCE, &instance_id), expected: expected.to_string(), actual }
            }
            Refusal::InstanceFinished { instance_id, version, state } => Error::Conflict {
                stream: stream_of(crate::KIND_INSTANCE, &instance_id),
                expected: format!("a live instance (this one is {state})"),
                actual: version,
            },
            Refusal::NodeNotDeletable { node_id, version, why } => Error::Conflict {
                stream: stream_of(crate::KIND_NODE, &node_id),
                expected: format!("a node that can be deleted ({why})"),
                actual: version,
            },
            Refusal::Internal(_) => Error::Internal(message),
        }
    }
}

impl Refusal {
    /// [`quota::admit`]'s refusal as a decision's: `QUOTA_EXCEEDED` stays itself.
    pub fn of_quota(error: Error) -> Self {
        match error {
            Error::QuotaExceeded(message) => Refusal::OverResourceQuota(message),
            other => other.into(),
        }
    }
}

impl From<Error> for Refusal {
    /// Encoding a payload is the only fallible step inside a decision.
    fn from(error: Error) -> Self {
        Refusal::Internal(error.to_string())
    }
}

/// Labels a node carries at most, and taints at most (each counted on its own).
pub const NODE_KEYS_MAX: usize = 64;
/// Nodes one tenant registers at most.
pub const NODES_PER_TENANT_MAX: usize = 4096;

/// Whether a node may take a labels (or taints) change: `current` after `remove` then `set`
/// (the fold's order) holds at most [`NODE_KEYS_MAX`] keys. `what` is "labels" or "taints".
pub fn node_keys_change(
    node_id: &str,
    what: &'static str,
    current: &BTreeMap<String, String>,
    set: &BTreeMap<String, String>,
    remove: &[String],
) -> Result<(), Refusal> {
    let kept = current.keys().filter(|k| !remove.contains(k) && !set.contains_key(*k)).count();
    let count = kept + set.len();
    if count > NODE_KEYS_MAX {
        return Err(Refusal::TooManyNodeKeys { node_id: node_id.to_owned(), what, count });
    }
    Ok(())
}

/// What else holds on to a node, read by the caller for [`node_delete`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeHolders {
    /// Its commands not finished yet.
    pub unfinished_commands: usize,
    /// Live instances on it.
    pub instances: Vec<String>,
    /// Live rollouts that name it.
    pub rollouts: Vec<String>,
}

/// `nodes.delete`: the node goes for good (`node.deleted`, its document with it), at the
/// version read, so a placement that raced the decision fails. Only a node nothing holds: taken
/// out of placement (cordoned or draining), no GPU held, its agent gone (its lease lapsed: an
/// agent still connected would go on reporting), no unfinished command, no live instance, no
/// live rollout naming it.
pub fn node_delete(node: &crate::NodeDoc, holders: &NodeHolders, reason: Option<String>) -> Result<Append, Refusal> {
    let refuse = |why: String| Refusal::NodeNotDeletable { node_id: node.node_id.clone(), version: node.version, why };
    if !node.cordoned {
        return Err(refuse("it still takes reservations: cordon or drain it first".into()));
    }
    if !node.allocations.is_empty() {
        let holders: std::collections::BTreeSet<&str> = node.allocations.values().map(String::as_str).collect();
        let names: Vec<&str> = holders.into_iter().take(3).collect();
        return Err(refuse(format!("{} GPUs are held, by {}", node.allocations.len(), names.join(", "))));
    }
    if node.agent.as_ref().is_some_and(|a| a.reachable) {
        return Err(refuse("its agent is connected: stop bcd on the machine, then wait for the node to be unreachable".into()));
    }
    if holders.unfinished_commands > 0 {
        return Err(refuse(format!("{} commands are unfinished: cancel them or let them end", holders.unfinished_commands)));
    }
    if let Some(instance) = holders.instances.first() {
        return Err(refuse(format!("{} live instances are on it ({instance}, …)", holders.instances.len())));
    }
    if let Some(rollout) = holders.rollouts.first() {
        return Err(refuse(format!("rollout {rollout} is live on it: let it end or abort it")));
    }
    let payload = crate::events::to_cbor(&crate::events::NodeDeleted { reason })?;
    Ok(Append {
        stream: stream_of(crate::KIND_NODE, &node.node_id),
        expected: ExpectedVersion::Exact(node.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(crate::events::NODE_DELETED, payload)],
    })
}

/// Whether the tenant may register one more node, given how many it has.
pub fn node_register(nodes: usize) -> Result<(), Refusal> {
    if nodes >= NODES_PER_TENANT_MAX {
        return Err(Refusal::TooManyNodes { count: nodes });
    }
    Ok(())
}

/// What the queue and the quota need of a tenant's live reservations in one pool. The view keeps
/// one per pool as its reservations change ([`FleetIndex::pool_load`](crate::fleet::FleetIndex::pool_load)).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolLoad {
    /// Queued reservations by request order: (request seq, id).
    pub queued: Vec<(u64, String)>,
    pub queued_gpus: u32,
    /// GPUs of queued and active reservations: what the quota counts.
    pub gpus: u32,
    /// Queued and active reservations.
    pub reservations: u32,
    /// Of `gpus`, those of reservations held for other tenants (`holderTenantId`, in a pool
    /// offered to them), by tenant: each counts against its holder's quota, not the owner's.
    pub held_for: BTreeMap<String, u32>,
}

/// A queued entry's sort key, borrowed: the queue is searched without cloning an id.
fn queue_key((seq, id): &(u64, String)) -> (u64, &str) {
    (*seq, id)
}

impl PoolLoad {
    /// No live reservation.
    pub const EMPTY: PoolLoad =
        PoolLoad { queued: Vec::new(), queued_gpus: 0, gpus: 0, reservations: 0, held_for: BTreeMap::new() };

    /// GPUs of live reservations held for `holder` (`None`: the pool owner's own): what that
    /// tenant's quota in the pool counts.
    pub fn gpus_of(&self, holder: Option<&str>) -> u32 {
        match holder {
            Some(h) => self.held_for.get(h).copied().unwrap_or(0),
            None => self.gpus.saturating_sub(self.held_for.values().fold(0u32, |a, g| a.saturating_add(*g))),
        }
    }

    /// The load of these live reservations (all of one pool).
    pub fn of<'a>(reservations: impl IntoIterator<Item = &'a ReservationDoc>) -> Self {
        let mut load = Self::default();
        for r in reservations {
            load.add(r);
        }
        load
    }

    /// Counts one more live reservation of the pool.
    pub(crate) fn add(&mut self, r: &ReservationDoc) {
        self.reservations += 1;
        self.gpus = self.gpus.saturating_add(r.gpus);
        if let Some(h) = &r.holder_tenant_id {
            let held = self.held_for.entry(h.clone()).or_default();
            *held = held.saturating_add(r.gpus);
        }
        if r.state == ReservationState::Queued {
            let at = self.queued.partition_point(|q| queue_key(q) < (r.request_seq, &r.reservation_id));
            self.queued.insert(at, (r.request_seq, r.reservation_id.clone()));
            self.queued_gpus = self.queued_gpus.saturating_add(r.gpus);
        }
    }

    /// Stops counting a live reservation [`Self::add`] counted (the same document); true when
    /// none is left.
    pub(crate) fn remove(&mut self, r: &ReservationDoc) -> bool {
        self.reservations = self.reservations.saturating_sub(1);
        self.gpus = self.gpus.saturating_sub(r.gpus);
        if let Some(h) = &r.holder_tenant_id
            && let Some(held) = self.held_for.get_mut(h)
        {
            *held = held.saturating_sub(r.gpus);
            if *held == 0 {
                self.held_for.remove(h);
            }
        }
        if r.state == ReservationState::Queued {
            if let Ok(at) = self.queued.binary_search_by(|q| queue_key(q).cmp(&(r.request_seq, &r.reservation_id))) {
                self.queued.remove(at);
            }
            self.queued_gpus = self.queued_gpus.saturating_sub(r.gpus);
        }
        self.reservations == 0
    }

    /// A queued reservation's place in the queue (1: next in line); `None` when not queued.
    pub fn position(&self, rsv: &ReservationDoc) -> Option<usize> {
        (rsv.state == ReservationState::Queued).then(|| self.queued.partition_point(|(seq, _)| *seq < rsv.request_seq) + 1)
    }
}

#[cfg(test)]
mod node_delete_tests {
    use super::*;

    fn node(cordoned: bool, allocations: serde_json::Value) -> crate::NodeDoc {
        serde_json::from_value(serde_json::json!({
            "tenantId": "ten_00000000000000000000000000", "nodeId": "node_01jd0000000000000000000000",
            "poolId": "pool_01jd0000000000000000000000", "name": "n0", "gpus": [], "labels": {},
            "state": if cordoned { "cordoned" } else { "ready" }, "cordoned": cordoned,
            "allocations": allocations, "version": 7, "createdAtMs": 1, "updatedAtMs": 2,
        }))
        .expect("a node document")
    }

    fn why(result: Result<Append, Refusal>) -> String {
        match result {
            Err(Refusal::NodeNotDeletable { version: 7, why, .. }) => why,
            Err(other) => panic!("another refusal: {other}"),
            Ok(_) => panic!("deleted"),
        }
    }

    #[test]
    fn only_a_node_nothing_holds_goes_and_at_the_version_read() {
        let free = NodeHolders::default();
        assert!(why(node_delete(&node(false, serde_json::json!({})), &free, None)).contains("cordon or drain it first"));
        let held = node(true, serde_json::json!({ "0": "rsv_a", "1": "rsv_a" }));
        assert!(why(node_delete(&held, &free, None)).contains("2 GPUs are held, by rsv_a"));
        let cordoned = node(true, serde_json::json!({}));
        let commands = NodeHolders { unfinished_commands: 3, ..NodeHolders::default() };
        assert!(why(node_delete(&cordoned, &commands, None)).contains("3 commands are unfinished"));
        let instances = NodeHolders { instances: vec!["inst_x".into()], ..NodeHolders::default() };
        assert!(why(node_delete(&cordoned, &instances, None)).contains("inst_x"));
        let rollouts = NodeHolders { rollouts: vec!["ro_y".into()], ..NodeHolders::default() };
        assert!(why(node_delete(&cordoned, &rollouts, None)).contains("rollout ro_y"));
        let append = node_delete(&cordoned, &free, Some("retired".into())).expect("deleted");
        assert_eq!(append.stream, "node/node_01jd0000000000000000000000");
        assert_eq!(append.expected, ExpectedVersion::Exact(7));
        assert_eq!(append.event_types(), [crate::events::NODE_DELETED]);
        let refusal: Error = Refusal::NodeNotDeletable { node_id: "node_x".into(), version: 7, why: "w".into() }.into();
        assert_eq!(refusal.code(), bc_core::ErrorCode::Conflict);
    }
}
