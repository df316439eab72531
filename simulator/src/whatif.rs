//! `sim replay --what-if`: the reservations a tenant's log records, decided again under another
//! policy, and where the decisions part.
//!
//! A log holds two kinds of events: what callers and machines did (a reservation requested,
//! released, extended; a node registered, joined, cordoned, gone unreachable) and what the
//! control plane decided from them (an activation, an expiry). The what-if keeps the first and
//! decides the second again: every caller's and machine's event is applied, in log order and at
//! its time, to a world of its own, and after each (and at each expiry due in between) the real
//! reservations plan (`bc_projections::decide::plan_with`) runs on that world under the policy
//! asked for. The same engine runs under the control plane's own policy too (the *baseline*),
//! which says how far the model reproduces the log (it does not model holds that fail on an
//! agent, for one); the first decision where the what-if and the baseline part is the
//! divergence, and the reservations' waits under each say what followed from it.

use std::collections::BTreeMap;

use bc_core::event::StoredEvent;
use bc_core::store::{Projector, RowKey};
use bc_projections::decide::{Action, Policy, QueueRule, plan_with};
use bc_projections::events as ev;
use bc_projections::fleet::FleetIndex;
use bc_projections::placement::Preference;
use bc_projections::{KIND_NODE, KIND_RESERVATION, NodeDoc, ReservationDoc, ReservationState};
use serde_json::{Value, json};

/// A policy key a what-if may change, and the values it takes.
pub const WHAT_IF_KEYS: &[(&str, &[&str])] = &[("queue", &["fifo", "backfill"]), ("placement", &["tightest-fit", "spread"])];

/// Parses `KEY=VALUE` pairs into a policy (the others as the control plane's).
pub fn parse_policy(pairs: &[String]) -> Result<Policy, String> {
    let mut policy = Policy::default();
    let keys = || WHAT_IF_KEYS.iter().map(|(k, v)| format!("{k}={}", v.join("|"))).collect::<Vec<_>>().join(", ");
    for pair in pairs {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(format!("--what-if {pair:?} is not KEY=VALUE ({})", keys()));
        };
        match key {
            "queue" => {
                policy.queue = QueueRule::ALL
                    .iter()
                    .copied()
                    .find(|q| q.as_str() == value)
                    .ok_or_else(|| format!("--what-if queue={value:?}: the queue rules are fifo and backfill"))?;
            }
            "placement" => {
                policy.placement = Preference::ALL
                    .iter()
                    .copied()
                    .find(|p| p.as_str() == value)
                    .ok_or_else(|| format!("--what-if placement={value:?}: the placements are tightest-fit and spread"))?;
            }
            _ => return Err(format!("--what-if {key:?} is not a policy key ({})", keys())),
        }
    }
    Ok(policy)
}

/// One decision of the plan: an activation or an expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The seq of the event it followed (the request, the release, the event after the expiry).
    pub after_seq: u64,
    pub at_ms: u64,
    pub kind: &'static str,
    pub reservation_id: String,
    pub node_id: String,
    pub gpus: Vec<u32>,
}

impl Decision {
    fn json(&self) -> Value {
        json!({
            "afterSeq": self.after_seq,
            "atMs": self.at_ms,
            "action": self.kind,
            "reservationId": self.reservation_id,
            "nodeId": self.node_id,
            "gpus": self.gpus,
        })
    }

    /// What two decisions are compared by (their time may differ by the reconciler's tick).
    fn same(&self, other: &Decision) -> bool {
        (self.kind, &self.reservation_id, &self.node_id, &self.gpus)
            == (other.kind, &other.reservation_id, &other.node_id, &other.gpus)
    }
}

/// A world of its own: the nodes and live reservations as this policy left them.
struct World {
    policy: Policy,
    nodes: BTreeMap<String, NodeDoc>,
    live: BTreeMap<String, ReservationDoc>,
    decisions: Vec<Decision>,
    /// Reservation → (requested at, activated at).
    waits: BTreeMap<String, (u64, Option<u64>)>,
    /// Reservation → (activated at, ends at, GPUs): the GPU-time given.
    held: BTreeMap<String, (u64, u64, u64)>,
}

/// The event types that change a node as a caller or a machine did, not as a plan decided.
const NODE_INPUTS: &[&str] = &[
    ev::NODE_REGISTERED,
    ev::NODE_JOINED,
    ev::NODE_CORDONED,
    ev::NODE_UNCORDONED,
    ev::NODE_DRAINING,
    ev::NODE_LABELED,
    ev::NODE_TAINTED,
    ev::NODE_READY,
    ev::NODE_UNREACHABLE,
];

fn fold(kind: &str, id: &str, current: Option<Value>, event: &StoredEvent) -> Option<Value> {
    let key = RowKey { tenant: event.envelope.tenant.to_string(), kind: kind.to_owned(), id: id.to_owned() };
    bc_projections::Projections.apply(&key, current, event).ok().flatten()
}

impl World {
    fn new(policy: Policy) -> Self {
        World {
            policy,
            nodes: BTreeMap::new(),
            live: BTreeMap::new(),
            decisions: Vec::new(),
            waits: BTreeMap::new(),
            held: BTreeMap::new(),
        }
    }

    /// Runs the plan at `now_ms` and applies what it decides.
    fn pass(&mut self, now_ms: u64, after_seq: u64) {
        let view = FleetIndex::new(self.nodes.values().cloned(), self.live.values().cloned());
        for action in plan_with(&view, now_ms, self.policy) {
            match action {
                Action::Expire { reservation_id, node_id, .. } => {
                    self.end(&reservation_id);
                    self.decisions.push(Decision {
                        after_seq,
                        at_ms: now_ms,
                        kind: "expire",
                        reservation_id,
                        node_id,
                        gpus: vec![],
                    });
                }
                Action::Activate { reservation_id, placement, ends_at_ms, .. } => {
                    let Some(rsv) = self.live.get_mut(&reservation_id) else { continue };
                    rsv.state = ReservationState::Active;
                    rsv.node_id = Some(placement.node_id.clone());
                    rsv.gpu_indexes = placement.gpus.clone();
                    rsv.ends_at_ms = Some(ends_at_ms);
                    if let Some(node) = self.nodes.get_mut(&placement.node_id) {
                        for gpu in &placement.gpus {
                            node.allocations.insert(*gpu, reservation_id.clone());
                        }
                    }
                    if let Some(wait) = self.waits.get_mut(&reservation_id) {
                        wait.1.get_or_insert(now_ms);
                    }
                    self.held.insert(reservation_id.clone(), (now_ms, ends_at_ms, placement.gpus.len() as u64));
                    self.decisions.push(Decision {
                        after_seq,
                        at_ms: now_ms,
                        kind: "activate",
                        reservation_id,
                        node_id: placement.node_id,
                        gpus: placement.gpus,
                    });
                }
                // This world folds no `reservation.held_for`: no reservation here is held for
                // another tenant, so none is withdrawn; ended all the same if one were.
                Action::Withdraw { reservation_id, .. } => drop(self.end(&reservation_id)),
                Action::HoldFailed { .. } | Action::Skip { .. } => {}
            }
        }
    }

    /// A reservation ends: its GPUs go back to its node. (An early end gives back the GPU-time
    /// counted past it.)
    fn end(&mut self, reservation_id: &str) -> Option<ReservationDoc> {
        let rsv = self.live.remove(reservation_id)?;
        if let Some(node) = rsv.node_id.as_ref().and_then(|n| self.nodes.get_mut(n)) {
            node.allocations.retain(|_, holder| holder != reservation_id);
        }
        Some(rsv)
    }

    /// The expiries due up to `now_ms`, each at its own time.
    fn expire_until(&mut self, now_ms: u64, after_seq: u64) {
        loop {
            let next = self
                .live
                .values()
                .filter(|r| r.state == ReservationState::Active)
                .filter_map(|r| r.ends_at_ms)
                .filter(|end| *end <= now_ms)
                .min();
            let Some(at) = next else { return };
            self.pass(at, after_seq);
        }
    }

    /// One event of the log: applied if a caller or a machine did it, then the plan runs.
    fn event(&mut self, event: &StoredEvent) {
        let env = &event.envelope;
        self.expire_until(env.at_ms, env.seq);
        let Some((kind, id)) = env.stream.split_once('/') else { return };
        let t = env.event_type.as_str();
        if kind == KIND_NODE && t == ev::NODE_DELETED {
            // Gone for good: nothing is placed on it in this world either.
            self.nodes.remove(id);
        } else if kind == KIND_NODE && NODE_INPUTS.contains(&t) {
            let current = self.nodes.get(id).and_then(|n| serde_json::to_value(n).ok());
            let allocations = self.nodes.get(id).map(|n| n.allocations.clone()).unwrap_or_default();
            if let Some(mut node) = fold(KIND_NODE, id, current, event).and_then(|v| serde_json::from_value::<NodeDoc>(v).ok()) {
                // Which GPUs are taken is this world's, whatever the log's node says.
                node.allocations = allocations;
                self.nodes.insert(id.to_owned(), node);
            }
        } else if kind == KIND_RESERVATION {
            match t {
                ev::RESERVATION_REQUESTED => {
                    if let Some(rsv) =
                        fold(KIND_RESERVATION, id, None, event).and_then(|v| serde_json::from_value::<ReservationDoc>(v).ok())
                    {
                        self.waits.insert(id.to_owned(), (env.at_ms, None));
                        self.live.insert(id.to_owned(), rsv);
                    }
                }
                ev::RESERVATION_RELEASED | ev::RESERVATION_CANCELLED => {
                    if self.end(id).is_some()
                        && let Some(held) = self.held.get_mut(id)
                    {
                        held.1 = held.1.min(env.at_ms);
                    }
                }
                ev::RESERVATION_EXTENDED => {
                    if let (Some(rsv), Ok(p)) = (
                        self.live.get_mut(id),
                        serde_json::from_value::<ev::ReservationExtended>(bc_core::canonical::to_json(&env.payload)),
                    ) && rsv.state == ReservationState::Active
                    {
                        rsv.ends_at_ms = Some(p.ends_at_ms);
                        if let Some(held) = self.held.get_mut(id) {
                            held.1 = p.ends_at_ms;
                        }
                    }
                }
                _ => return,
            }
        } else {
            return;
        }
        self.pass(env.at_ms, env.seq);
    }

    /// GPU-hours given up to `end_ms` (the log's last event).
    fn gpu_hours(&self, end_ms: u64) -> f64 {
        let ms: u128 = self
            .held
            .values()
            .map(|(from, to, gpus)| u128::from(to.min(&end_ms).saturating_sub(*from)) * u128::from(*gpus))
            .sum();
        (ms as f64 / 3_600_000.0 * 1000.0).round() / 1000.0
    }
}

/// The log's own decision in `event`, if it is one.
fn logged(event: &StoredEvent, out: &mut Vec<Decision>) {
    let env = &event.envelope;
    let Some((kind, id)) = env.stream.split_once('/') else { return };
    if kind != KIND_RESERVATION {
        return;
    }
    match env.event_type.as_str() {
        ev::RESERVATION_ACTIVATED => {
            if let Ok(p) = serde_json::from_value::<ev::ReservationActivated>(bc_core::canonical::to_json(&env.payload)) {
                out.push(Decision {
                    after_seq: env.seq,
                    at_ms: env.at_ms,
                    kind: "activate",
                    reservation_id: id.to_owned(),
                    node_id: p.node_id,
                    gpus: p.gpus,
                });
            }
        }
        ev::RESERVATION_EXPIRED => out.push(Decision {
            after_seq: env.seq,
            at_ms: env.at_ms,
            kind: "expire",
            reservation_id: id.to_owned(),
            node_id: String::new(),
            gpus: vec![],
        }),
        _ => {}
    }
}

/// The first index where two decision streams differ (by reservation, node and GPUs), if any.
fn first_difference(a: &[Decision], b: &[Decision], compare_nodes: bool) -> Option<usize> {
    let same = |x: &Decision, y: &Decision| {
        if compare_nodes { x.same(y) } else { (x.kind, &x.reservation_id) == (y.kind, &y.reservation_id) }
    };
    (0..a.len().max(b.len())).find(|&i| match (a.get(i), b.get(i)) {
        (Some(x), Some(y)) => !same(x, y),
        _ => true,
    })
}

fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    (!sorted.is_empty()).then(|| sorted[((sorted.len() as f64 - 1.0) * p).round() as usize])
}

fn waits_json(world: &World, end_ms: u64) -> Value {
    let mut waits: Vec<u64> = world.waits.values().filter_map(|(asked, got)| got.map(|g| g.saturating_sub(*asked))).collect();
    waits.sort_unstable();
    json!({
        "requested": world.waits.len(),
        "activated": waits.len(),
        "neverActivated": world.waits.len() - waits.len(),
        "waitP50Ms": percentile(&waits, 0.5),
        "waitP99Ms": percentile(&waits, 0.99),
        "waitMaxMs": waits.last(),
        "gpuHours": world.gpu_hours(end_ms),
    })
}

fn policy_json(policy: Policy) -> Value {
    json!({ "queue": policy.queue.as_str(), "placement": policy.placement.as_str() })
}

/// A what-if in progress: give it the file's verified events in seq order from seq 1
/// ([`WhatIf::event`]), then [`WhatIf::finish`].
pub struct WhatIf {
    policy: Policy,
    baseline: World,
    changed: World,
    log: Vec<Decision>,
    events: u64,
    end_ms: u64,
}

impl WhatIf {
    pub fn new(policy: Policy) -> Self {
        WhatIf {
            policy,
            baseline: World::new(Policy::default()),
            changed: World::new(policy),
            log: Vec::new(),
            events: 0,
            end_ms: 0,
        }
    }

    pub fn event(&mut self, event: &StoredEvent) {
        self.baseline.event(event);
        self.changed.event(event);
        logged(event, &mut self.log);
        self.events += 1;
        self.end_ms = self.end_ms.max(event.envelope.at_ms);
    }

    /// The seq after which the what-if's decisions part from the baseline's, if they do.
    pub fn divergence_seq(&self) -> Option<u64> {
        let i = first_difference(&self.baseline.decisions, &self.changed.decisions, true)?;
        [self.baseline.decisions.get(i), self.changed.decisions.get(i)].into_iter().flatten().map(|d| d.after_seq).min()
    }

    /// What the what-if found, as `sim replay --what-if` prints it.
    pub fn finish(&self) -> Value {
        let (baseline, changed, policy) = (&self.baseline, &self.changed, self.policy);
        let log_activations: Vec<Decision> = self.log.iter().filter(|d| d.kind == "activate").cloned().collect();
        let base_activations: Vec<Decision> = baseline.decisions.iter().filter(|d| d.kind == "activate").cloned().collect();
        let fidelity = match first_difference(&log_activations, &base_activations, true) {
            None => json!({ "reproducesLog": true, "activations": log_activations.len() }),
            Some(i) => json!({
                "reproducesLog": false,
                "activations": log_activations.len(),
                "firstMismatch": { "index": i, "log": log_activations.get(i).map(Decision::json), "model": base_activations.get(i).map(Decision::json) },
                "note": "the model applies callers' and machines' events and decides again; it does not model holds an agent refused or never answered",
            }),
        };
        let divergence = first_difference(&baseline.decisions, &changed.decisions, true).map(|i| {
            json!({
                "index": i,
                "afterSeq": self.divergence_seq(),
                "baseline": baseline.decisions.get(i).map(Decision::json),
                "whatIf": changed.decisions.get(i).map(Decision::json),
            })
        });
        // What followed: each reservation's activation under each policy.
        let (mut earlier, mut later, mut same, mut only_baseline, mut only_what_if) = (0u64, 0u64, 0u64, 0u64, 0u64);
        for (id, (_, base_at)) in &baseline.waits {
            match (base_at, changed.waits.get(id).and_then(|w| w.1)) {
                (Some(b), Some(w)) if w < *b => earlier += 1,
                (Some(b), Some(w)) if w > *b => later += 1,
                (Some(_), Some(_)) => same += 1,
                (Some(_), None) => only_baseline += 1,
                (None, Some(_)) => only_what_if += 1,
                (None, None) => {}
            }
        }
        json!({
            "policy": policy_json(policy),
            "baselinePolicy": policy_json(Policy::default()),
            "events": self.events,
            "baseline": fidelity,
            "firstDivergence": divergence,
            "followed": {
                "baseline": waits_json(baseline, self.end_ms),
                "whatIf": waits_json(changed, self.end_ms),
                "activatedEarlier": earlier,
                "activatedLater": later,
                "activatedSame": same,
                "activatedOnlyInBaseline": only_baseline,
                "activatedOnlyInWhatIf": only_what_if,
            },
        })
    }
}
