//! The reservations reconciler's pass as a plan: `plan(view, now_ms)` lists what to append, in
//! order, and the reconciler appends each [`Action`] (see `bc_reconcilers::reservations`).
//!
//! Expiries come first: an active reservation whose end is at or before `now_ms` is expired and
//! its GPUs freed. Then failed holds: an active reservation whose node refused `gpu.hold`, or did
//! not answer it by its deadline, is requeued (its GPUs freed; it keeps its request order, so it
//! is next in its pool, and its pool activates nothing more this pass) or, on its
//! [`crate::HOLD_ATTEMPTS_MAX`]th failure, failed. A requeued reservation is placed on a node
//! where no hold of it failed if one fits, else on any. Then each pool's queue (pools by id), oldest request first: each queued
//! reservation is placed on the nodes as the actions before it leave them (the expiries' GPUs
//! freed, the earlier activations' held), until the first that does not fit, which stops its
//! pool so a large request is never overtaken by smaller ones.
//!
//! Every action is guarded at the versions the plan read, or predicts: an activation on a node
//! changed by earlier actions of the plan guards the version those appends give it (one more
//! per append), and names the expiries it counts on (`freed_by`); the reconciler skips it
//! unless they all landed, and stops its pool's queue when one of the pool's activations does
//! not land. The predicted version is the node's only if exactly those appends moved it since
//! the view read it, so its content is what the plan saw; if another writer moved the node
//! meanwhile, the guard fails and the append is a CONFLICT (the next pass decides again),
//! never a double booking.
//!
//! **Offered pools.** A reservation held for another tenant (`holderTenantId`, in a pool its
//! owner offered to that tenant) is placed, and requeued after a failed hold, only while the
//! pool is still offered to its holder, as the view's pool document says
//! ([`FleetIndex::offer_of`]); each such append guards the pool's stream at the version read,
//! so a withdrawal (`pools.unoffer`) landing meanwhile makes it a CONFLICT and the next pass
//! decides again. Once withdrawn, a failed hold fails the reservation instead of requeueing it,
//! and a queued one (left by a requeue decided before this rule, say) is cancelled: both with
//! the reason ([`super::pool_offer::unoffered_reason`]), so it is never placed again.

use std::collections::{BTreeSet, HashMap, HashSet};

use bc_core::store::ExpectedVersion;

use bc_core::store::NewEvent;

use super::pool_offer::unoffered_reason;
use super::{Append, PoolLoad};
use crate::events::{self as ev, to_cbor};
use crate::fleet::{FleetIndex, Offer};
use crate::placement::{self, Ask, Ending, Issue, Placement, Selector};
use crate::{BindingState, HOLD_ATTEMPTS_MAX, KIND_POOL, KIND_RESERVATION, NodeDoc, ReservationDoc, ReservationState, stream_of};

/// One step of a reconciler pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// End an active reservation at its end time and free its GPUs (`release`: and send its
    /// node `gpu.release`).
    Expire { reservation_id: String, reservation_version: u64, pool_id: String, node_id: String, release: bool },
    /// An active reservation whose hold failed: free its GPUs and put it back in its queue, or
    /// (`gives_up`, its last attempt) fail it. `release`: the node is sent `gpu.release` in case it
    /// holds them after all (always, today: a release of nothing is answered at once).
    HoldFailed {
        reservation_id: String,
        reservation_version: u64,
        pool_id: String,
        node_id: String,
        reason: String,
        attempts: u32,
        gives_up: bool,
        release: bool,
        /// A held reservation's pool version whose offer the decision read: guarded.
        offer_version: Option<u64>,
    },
    /// Give `placement`'s GPUs to a queued reservation until `ends_at_ms`.
    Activate {
        reservation_id: String,
        reservation_version: u64,
        pool_id: String,
        placement: Placement,
        ends_at_ms: u64,
        /// Expiries of this plan on the placement's node: the guard counts their appends, so the
        /// activation is made only if they all landed.
        freed_by: Vec<String>,
        /// A held reservation's pool version whose offer the decision read: guarded.
        offer_version: Option<u64>,
    },
    /// Cancel a queued reservation held for a tenant its pool is no longer offered to
    /// (`reason` says so): it is never placed again. It frees nothing and stops no queue.
    Withdraw {
        reservation_id: String,
        reservation_version: u64,
        pool_id: String,
        reason: String,
        /// The pool's version read (`None`: the view has no such pool): guarded.
        offer_version: Option<u64>,
    },
    /// A queued reservation whose selector this version cannot read (a newer writer's): it is
    /// left queued, and must not stop its pool's queue or anything else. Nothing to append.
    Skip { reservation_id: String, pool_id: String, reason: String },
}

impl Action {
    pub fn reservation_id(&self) -> &str {
        match self {
            Self::Expire { reservation_id, .. }
            | Self::HoldFailed { reservation_id, .. }
            | Self::Activate { reservation_id, .. }
            | Self::Withdraw { reservation_id, .. }
            | Self::Skip { reservation_id, .. } => reservation_id,
        }
    }

    pub fn pool_id(&self) -> &str {
        match self {
            Self::Expire { pool_id, .. }
            | Self::HoldFailed { pool_id, .. }
            | Self::Activate { pool_id, .. }
            | Self::Withdraw { pool_id, .. }
            | Self::Skip { pool_id, .. } => pool_id,
        }
    }

    /// The append this action makes (`None` for [`Action::Skip`]): on the reservation's stream
    /// at the version the plan read, with the node's stream guarded. A command it issues
    /// (`gpu.hold`, `gpu.release`) takes `issue`'s id, drawn by the caller for each action.
    pub fn append(&self, issue: Issue<'_>) -> bc_core::Result<Option<Append>> {
        let stream = |id: &str| stream_of(KIND_RESERVATION, &id);
        let mut append = self.append_unguarded(issue, stream)?;
        if let (Some(append), Some(version)) = (append.as_mut(), self.offer_version()) {
            append.guards.push((stream_of(KIND_POOL, &self.pool_id()), ExpectedVersion::Exact(version)));
        }
        Ok(append)
    }

    /// The pool version whose offer this action relies on, if it does.
    fn offer_version(&self) -> Option<u64> {
        match self {
            Self::HoldFailed { offer_version, .. }
            | Self::Activate { offer_version, .. }
            | Self::Withdraw { offer_version, .. } => *offer_version,
            Self::Expire { .. } | Self::Skip { .. } => None,
        }
    }

    fn append_unguarded(&self, issue: Issue<'_>, stream: impl Fn(&str) -> String) -> bc_core::Result<Option<Append>> {
        Ok(match self {
            Self::Expire { reservation_id, reservation_version, node_id, release, .. } => Some(Append::guarded(
                stream(reservation_id),
                ExpectedVersion::Exact(*reservation_version),
                placement::ending(reservation_id, node_id, *release, Ending::Expired, issue)?,
            )),
            Self::HoldFailed { reservation_id, reservation_version, node_id, reason, attempts, gives_up, release, .. } => {
                let (reason, attempts) = (reason.clone(), *attempts);
                let ending = if *gives_up { Ending::Failed { reason, attempts } } else { Ending::Requeued { reason, attempts } };
                Some(Append::guarded(
                    stream(reservation_id),
                    ExpectedVersion::Exact(*reservation_version),
                    placement::ending(reservation_id, node_id, *release, ending, issue)?,
                ))
            }
            Self::Activate { reservation_id, reservation_version, placement, ends_at_ms, .. } => Some(Append::guarded(
                stream(reservation_id),
                ExpectedVersion::Exact(*reservation_version),
                placement::activation(reservation_id, placement, *ends_at_ms, issue)?,
            )),
            Self::Withdraw { reservation_id, reservation_version, reason, .. } => {
                let ended = ev::ReservationEnded { release: None, reason: Some(reason.clone()) };
                Some(Append {
                    stream: stream(reservation_id),
                    expected: ExpectedVersion::Exact(*reservation_version),
                    guards: vec![],
                    events: vec![NewEvent::new(ev::RESERVATION_CANCELLED, to_cbor(&ended)?)],
                })
            }
            Self::Skip { .. } => None,
        })
    }
}

/// How a pool's queue is served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueRule {
    /// Oldest request first, and the first that does not fit stops its pool (what this control
    /// plane does): a large request is never overtaken.
    #[default]
    Fifo,
    /// Oldest request first, but one that does not fit lets the later ones that do go ahead (a
    /// what-if of `sim replay`): fuller nodes, at the risk of starving large requests.
    Backfill,
}

impl QueueRule {
    pub const ALL: &[QueueRule] = &[QueueRule::Fifo, QueueRule::Backfill];

    pub fn as_str(self) -> &'static str {
        match self {
            QueueRule::Fifo => "fifo",
            QueueRule::Backfill => "backfill",
        }
    }
}

/// The rules a plan decides by: the control plane's are the defaults; `sim replay --what-if`
/// runs the same plan under others.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    pub queue: QueueRule,
    pub placement: placement::Preference,
}

/// Whether a plan at `now_ms` may look at the view's nodes: only when an active reservation is
/// due for attention (its end, its hold's deadline, a failed hold: each frees GPUs on its node)
/// or a pool has a queue (activations place on nodes). When neither, every plan at `now_ms` is
/// empty whatever the nodes hold, so a reconciler pass need not read them again
/// ([`crate::fleet::Fleet::with_busy_tenants`]): at fleet scale, every node placed on since the
/// last pass.
pub fn needs_nodes(view: &FleetIndex, now_ms: u64) -> bool {
    view.needing_attention(now_ms).next().is_some() || view.pool_loads().values().any(|load| !load.queued.is_empty())
}

/// What the reconciler does in one pass over one tenant's view at `now_ms`. Deterministic: the
/// same view and time give the same actions in the same order.
pub fn plan(view: &FleetIndex, now_ms: u64) -> Vec<Action> {
    plan_with(view, now_ms, Policy::default())
}

/// [`plan`] under `policy`: the expiries, then the failed holds, then each pool's queue.
pub fn plan_with(view: &FleetIndex, now_ms: u64, policy: Policy) -> Vec<Action> {
    let mut planned = Planned::default();
    // The active reservations whose time has come (the view keeps them by it), not every live one.
    let attention: Vec<&ReservationDoc> = view.needing_attention(now_ms).collect();
    expire_due(view, &attention, now_ms, &mut planned);
    let requeued = fail_holds(view, &attention, now_ms, &mut planned);
    // Each pool's queue in request order, as the view's loads keep it.
    for (pool_id, load) in view.pool_loads() {
        if load.queued.is_empty() || requeued.contains(pool_id.as_str()) {
            continue;
        }
        activate_queue(view, pool_id, load, now_ms, policy, &mut planned);
    }
    planned.actions
}

/// A plan as its phases leave it: the actions so far, and the nodes they change.
#[derive(Default)]
struct Planned<'v> {
    actions: Vec<Action>,
    /// The nodes the actions so far change, as they leave them (with the version their appends
    /// give them); the others are as the view has them.
    changed: HashMap<&'v str, NodeDoc>,
    /// Node id → this plan's expiries on it.
    freed: HashMap<&'v str, Vec<String>>,
}

impl<'v> Planned<'v> {
    /// Frees `reservation_id`'s GPUs on `node_id` as the plan's actions leave the node (one more
    /// version), and records that the node's next activations count on this action.
    fn free(&mut self, view: &'v FleetIndex, node_id: &str, reservation_id: &str) {
        if let Some((key, node)) = view.nodes().get_key_value(node_id) {
            let node = self.changed.entry(key.as_str()).or_insert_with(|| node.clone());
            node.allocations.retain(|_, holder| holder != reservation_id);
            node.version += 1;
            self.freed.entry(key.as_str()).or_default().push(reservation_id.to_owned());
        }
    }
}

/// The expiries: every active reservation of `attention` whose end is at or before `now_ms`,
/// earliest end first, its GPUs freed.
fn expire_due<'v>(view: &'v FleetIndex, attention: &[&ReservationDoc], now_ms: u64, planned: &mut Planned<'v>) {
    let mut due: Vec<&ReservationDoc> = attention
        .iter()
        .copied()
        .filter(|r| r.state == ReservationState::Active && r.ends_at_ms.is_some_and(|end| end <= now_ms))
        .collect();
    due.sort_by(|a, b| (a.ends_at_ms, &a.reservation_id).cmp(&(b.ends_at_ms, &b.reservation_id)));
    for rsv in due {
        let Some(node_id) = rsv.node_id.as_deref() else { continue };
        planned.actions.push(Action::Expire {
            reservation_id: rsv.reservation_id.clone(),
            reservation_version: rsv.version,
            pool_id: rsv.pool_id.clone(),
            node_id: node_id.to_owned(),
            release: rsv.binding.as_ref().is_some_and(crate::Binding::may_hold),
        });
        planned.free(view, node_id, &rsv.reservation_id);
    }
}

/// Failed holds (and holds unanswered by their deadline), not already expired: each requeued or,
/// at its last attempt, failed, its GPUs freed. Returns the pools a reservation was requeued in,
/// which activate nothing more this pass (it is next in its pool).
fn fail_holds<'v, 'a>(
    view: &'v FleetIndex,
    attention: &[&'a ReservationDoc],
    now_ms: u64,
    planned: &mut Planned<'v>,
) -> HashSet<&'a str> {
    let mut requeued: HashSet<&str> = HashSet::new();
    let mut failed: Vec<(&ReservationDoc, String, bool)> = Vec::new();
    for rsv in attention.iter().copied().filter(|r| r.state == ReservationState::Active) {
        let (Some(binding), Some(_)) = (&rsv.binding, &rsv.node_id) else { continue };
        if rsv.ends_at_ms.is_some_and(|end| end <= now_ms) {
            continue;
        }
        match binding.state {
            BindingState::Failed => {
                let reason = binding.reason.clone().unwrap_or_else(|| "hold-failed: the node gave no reason".into());
                // A node that refused may still hold them (it bound, then lost its answer, then
                // refused the redelivery): the release is idempotent, so it is always sent.
                failed.push((rsv, reason, true));
            }
            BindingState::Pending if binding.deadline_at_ms.is_some_and(|d| d <= now_ms) => {
                let reason = format!("hold-timeout: the node did not answer gpu.hold within {} s", crate::HOLD_DEADLINE_S);
                failed.push((rsv, reason, true));
            }
            _ => {}
        }
    }
    failed.sort_by(|a, b| a.0.reservation_id.cmp(&b.0.reservation_id));
    for (rsv, reason, release) in failed {
        let node_id = rsv.node_id.as_deref().unwrap_or_default();
        let attempts = rsv.hold_attempts.saturating_add(1);
        // A held reservation goes back to the queue only while its pool is offered to its
        // holder; once withdrawn, its failed hold is its end.
        let (gives_up, reason, offer_version) = match view.offer_of(rsv) {
            Offer::Own => (attempts >= HOLD_ATTEMPTS_MAX, reason, None),
            Offer::Offered { pool_version } => (attempts >= HOLD_ATTEMPTS_MAX, reason, Some(pool_version)),
            Offer::Withdrawn { pool_version } => {
                (true, format!("{reason}; not requeued: {}", withdrawn_reason(rsv)), pool_version)
            }
        };
        planned.actions.push(Action::HoldFailed {
            reservation_id: rsv.reservation_id.clone(),
            reservation_version: rsv.version,
            pool_id: rsv.pool_id.clone(),
            node_id: node_id.to_owned(),
            reason,
            attempts,
            gives_up,
            release,
            offer_version,
        });
        if !gives_up {
            // It is next in its pool: nothing there overtakes it in this pass.
            requeued.insert(rsv.pool_id.as_str());
        }
        planned.free(view, node_id, &rsv.reservation_id);
    }
    requeued
}

/// Why a reservation held for a tenant its pool is no longer offered to ends.
fn withdrawn_reason(rsv: &ReservationDoc) -> String {
    unoffered_reason(&rsv.pool_id, rsv.holder_tenant_id.as_deref().unwrap_or_default())
}

/// One pool's queue, oldest request first: each queued reservation placed on the nodes as the
/// actions before it leave them, until the first that does not fit ([`QueueRule::Fifo`]; under
/// [`QueueRule::Backfill`], past it).
fn activate_queue<'v>(
    view: &'v FleetIndex,
    pool_id: &str,
    load: &PoolLoad,
    now_ms: u64,
    policy: Policy,
    planned: &mut Planned<'v>,
) {
    // Held for a tenant no longer offered the pool: cancelled, wherever it is in the queue,
    // never placed; it holds nothing, so the queue goes on without it. The whole queue is
    // scanned only when the pool holds reservations for a tenant it no longer offers to.
    let offered = |rsv: &ReservationDoc| match view.offer_of(rsv) {
        Offer::Own => Ok(None),
        Offer::Offered { pool_version } => Ok(Some(pool_version)),
        Offer::Withdrawn { pool_version } => Err(pool_version),
    };
    let live_queue = || load.queued.iter().filter_map(|(_, id)| view.live().get(id));
    let pool = view.pools().get(pool_id);
    if load.held_for.keys().any(|holder| pool.is_none_or(|p| !p.offered_to.contains(holder))) {
        for rsv in live_queue() {
            if let Err(pool_version) = offered(rsv) {
                planned.actions.push(Action::Withdraw {
                    reservation_id: rsv.reservation_id.clone(),
                    reservation_version: rsv.version,
                    pool_id: pool_id.to_owned(),
                    reason: withdrawn_reason(rsv),
                    offer_version: pool_version,
                });
            }
        }
    }
    let queue = live_queue().filter_map(|rsv| Some((rsv, offered(rsv).ok()?)));
    // The pool's nodes by (free GPUs, node id) as the actions so far leave them, kept so as
    // this pool's activations take GPUs: placement walks it (`place_ranked`) instead of
    // scoring every node of the pool for each queued reservation.
    let mut ranked: BTreeSet<(u32, &str)> = view
        .ranked(pool_id, 0)
        .map(|(free, n)| (planned.changed.get(n.node_id.as_str()).map_or(free, placement::free_gpus), n.node_id.as_str()))
        .collect();
    for (rsv, offer_version) in queue {
        let selector = match Selector::parse(&rsv.selector) {
            Ok(selector) => selector,
            Err(e) => {
                planned.actions.push(Action::Skip {
                    reservation_id: rsv.reservation_id.clone(),
                    pool_id: pool_id.to_owned(),
                    reason: e.to_string(),
                });
                continue;
            }
        };
        let ask = Ask { gpus: rsv.gpus, selector: &selector, nvlink: rsv.nvlink, tolerations: &rsv.tolerations };
        let node_of = |id: &str| planned.changed.get(id).or_else(|| view.nodes().get(id));
        let walk = || ranked.range((rsv.gpus, "")..).filter_map(|(free, id)| Some((*free, node_of(id)?)));
        // Not again on a node where its hold failed, unless no other fits.
        let avoided = walk().filter(|(_, n)| !rsv.hold_failed_nodes.contains(&n.node_id));
        let placed =
            if rsv.hold_failed_nodes.is_empty() { None } else { placement::place_ranked(avoided, &ask, policy.placement) };
        let Some(placed) = placed.or_else(|| placement::place_ranked(walk(), &ask, policy.placement)) else {
            match policy.queue {
                QueueRule::Fifo => break,
                QueueRule::Backfill => continue,
            }
        };
        let Some((key, node)) = view.nodes().get_key_value(&placed.node_id) else { break };
        let node = planned.changed.entry(key.as_str()).or_insert_with(|| node.clone());
        ranked.remove(&(placement::free_gpus(node), key.as_str()));
        for gpu in &placed.gpus {
            node.allocations.insert(*gpu, rsv.reservation_id.clone());
        }
        node.version += 1;
        ranked.insert((placement::free_gpus(node), key.as_str()));
        planned.actions.push(Action::Activate {
            reservation_id: rsv.reservation_id.clone(),
            reservation_version: rsv.version,
            pool_id: pool_id.to_owned(),
            ends_at_ms: now_ms.saturating_add(rsv.duration_s.saturating_mul(1000)),
            freed_by: planned.freed.get(key.as_str()).cloned().unwrap_or_default(),
            placement: placed,
            offer_version,
        });
    }
}
