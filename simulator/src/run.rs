//! `sim run`: one seeded run of the [`World`] on a virtual clock, with a workload, faults and
//! invariants; then a liveness phase; then one digest of every chain head.
//!
//! - **Time** is the world's `ManualClock`, moved only by the scheduler, which jumps to the next
//!   due task (a tenant's next request or action, the next reconciler tick, an agent's answer or
//!   tick, a fault starting or ending); nothing sleeps.
//! - **Randomness** is one `SeededRng` from `--seed`; the log key, the nodes' keys, the tenants'
//!   and every event's id (`SeededIds` on the same seed) and every fault's probability derive from
//!   it, so a seed repeats the run byte for byte.
//! - **Workload**: each tenant has one pool and its share of the nodes (node `i` is tenant
//!   `i % T`'s). Requests arrive so the tenant's GPUs are about [`LOAD_TARGET`] busy; each is
//!   decided by `decide::reservation_create` on the tenant's view (placed at once or queued, as
//!   the gateway does); tenants release and extend at random; operators cordon a node and
//!   uncordon it later; nodes join (about every [`NODE_JOIN_MEAN_MS`], on their own stream of
//!   the seed) and their agents connect; operators take nodes out (`node.draining`; once
//!   nothing runs on one and its journal is delivered, its agent stops for good and its lease
//!   lapses; then `node.deleted`, decided as `nodes.delete` decides it).
//! - **Faults** (`--faults`, default all; each enabled by the seed with [`FAULT_ENABLED_P`]):
//!   see [`Fault`].
//! - **Invariants** after every step ([`World::check`], on the tenant the step touched, or on
//!   all after a reconciler pass or a fault): no GPU held by two live reservations, on the
//!   control plane or on an agent; what the control plane calls bound, the agent holds. Full
//!   checks ([`full_check`]) as often as their cost allows (at least [`FULL_CHECK_STEPS_MIN`]
//!   steps apart, and as many steps as the log has events over [`FULL_CHECK_EVENTS_PER_STEP`])
//!   and at the end: every chain verifies under the log key (`bc_core::audit::verify`, node
//!   signatures included), the projection rows equal a fold of the whole log, every workload
//!   append the log acknowledged is still in it, and each node's journal entries in the log are
//!   the ones its agent wrote, once each, in order, and include all it was acknowledged.
//! - **Agents** talk to the gateway over the in-memory transport (`net.rs`): each agent's real
//!   session machine (`bc_agent::session`) and the gateway's real session functions
//!   (`bc_gateway::agents::session`): hello, challenge, proof, welcome, entries appended once
//!   and acknowledged, commands down, heartbeats renewing the node's lease, which the liveness
//!   pass turns into `node.unreachable` / `node.ready`. A step that only moved the transport
//!   (nothing appended, no command run) is quiet: no check runs after it.
//! - **Liveness**: the faults and the workload stop; within [`LIVENESS_BOUND_MS`] of simulated
//!   time every active reservation is bound, every agent holds exactly what the control plane
//!   says and was acknowledged its whole journal, or the run fails.
//! - **Timeline** ([`Options::timeline`], `--report`): a sample of the series (GPU utilization,
//!   queue depth, nodes up, faults injected, checks passed) at the start, after every reconciler
//!   pass and fault, and at the end, and the marks (the liveness phase, the first failure), in a
//!   bounded [`Timeline`]. Observing only reads rows and the agents' state and draws nothing
//!   from the seed, so the run and its digest are the same with or without it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bc_agent::session::{Rng, SeededRng};
use bc_core::ErrorCode;
use bc_core::event::Position;
use bc_core::id::{CommandId, ReservationId};
use bc_core::store::{ExpectedVersion, NewEvent, RowKey};
use bc_projections::decide::{self, ReservationAsk, ReservationCreate, ReservationCreateInput};
use bc_projections::events as ev;
use bc_projections::fleet::FleetIndex;
use bc_projections::placement::Selector;
use bc_projections::{
    KIND_NODE, KIND_NODE_COMMANDS, KIND_POOL, KIND_RESERVATION, KIND_RESERVATION_LIVE, NodeCommandsDoc, NodeDoc, PoolDoc,
    Projections, ReservationDoc, ReservationState, stream_of,
};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

mod metal;
mod net;
mod rollouts;
mod webhooks;

pub use metal::MetalCounts;
pub use webhooks::WebhookCounts;

pub use net::NetCounts;

use crate::timeline::{MarkKind, Sample, Timeline};
use crate::world::{JournalInLog, Shape, Violation, World, chance, pick};

/// The bounds of a run (what was measured sane on 2 cores; see README).
pub const NODES_MAX: usize = 5000;
pub const TENANTS_MAX: usize = 100;
pub const HOURS_MAX: u64 = 24 * 30;
/// Bare-metal machines at most (`--metal`).
pub const METAL_MAX: usize = 1000;
/// Steps of one run at most, whatever the options (a run that never ends is a bug).
pub const STEPS_MAX: u64 = 50_000_000;
/// How often the reservations reconciler and the liveness sweep pass.
pub const RECONCILE_EVERY_MS: u64 = 10_000;
/// How often every agent looks again by itself (retries releases, delivers its journal).
pub const AGENT_TICK_MS: u64 = 300_000;
/// A command reaches its agent this long after it is issued, at most (at least 50 ms).
pub const COMMAND_LATENCY_MAX_MS: u64 = 2_000;
/// A tenant's mean time between releases, extensions and its operator's cordons.
pub const TENANT_ACTION_MEAN_MS: u64 = 60_000;
/// The share of a tenant's GPUs its requests keep busy, on average.
pub const LOAD_TARGET: f64 = 0.9;
/// A request's duration: 5 to 60 minutes, in 5-minute steps.
pub const DURATION_STEP_S: u64 = 300;
pub const DURATION_STEPS_MAX: u64 = 12;
/// A request asks for 1 to this many GPUs (at most a node's smallest count).
pub const REQUEST_GPUS_MAX: u32 = 4;
/// Nodes have this many GPUs, drawn per node.
pub const NODE_GPUS_MIN: u32 = 4;
pub const NODE_GPUS_MAX: u32 = 8;
/// The mean time between nodes joining while the workload runs (each to a tenant drawn from
/// the seed, with 4 to 8 GPUs), while the fleet is under [`NODES_MAX`].
pub const NODE_JOIN_MEAN_MS: u64 = 20 * 60_000;
/// The mean time between operators taking a node out (cordon and drain; once nothing runs on
/// it and its journal is delivered, its agent stops for good), while the workload runs.
pub const NODE_LEAVE_MEAN_MS: u64 = 20 * 60_000;
/// How often a draining node is looked at again to see whether it can go.
pub const LEAVE_CHECK_MS: u64 = 60_000;
/// Mixed into the seed for the joins' (and leaves') own stream.
pub const JOIN_STREAM: u64 = 0x6a6f_696e_6a6f_696e;
/// The mean time between faults while faults run.
pub const FAULT_MEAN_MS: u64 = 60_000;
/// A crashed reconciler pass takes 0 to this many appends before it dies.
pub const PASS_CRASH_APPENDS_MAX: u64 = 4;
/// A `failing-commits` fault fails the next 1 to this many append transactions.
pub const FAILING_COMMITS_MAX: u64 = 3;
/// A `failover` fault loses the answers of the next 1 to this many append transactions that
/// commit (the commits in flight when the primary went).
pub const FAILOVER_LOST_ANSWERS_MAX: u64 = 3;
/// Each fault named is enabled by the seed with this probability.
pub const FAULT_ENABLED_P: f64 = 0.75;
/// A stale view (another gateway's) is this old at most; a request is decided on it with the
/// seed's probability when `stale-view` is enabled.
pub const STALE_VIEW_REFRESH_MS: u64 = 60_000;
/// The full checks (chains, projections, journals, acknowledged appends) read the whole log, so
/// the next one waits for at least [`FULL_CHECK_STEPS_MIN`] steps and for as many steps as the
/// log had events over [`FULL_CHECK_EVENTS_PER_STEP`]: a step pays for at most that many
/// events' worth of full checking, however long or wide the run, and a short run is still
/// checked many times (the end checks once more).
pub const FULL_CHECK_STEPS_MIN: u64 = 50;
pub const FULL_CHECK_EVENTS_PER_STEP: u64 = 2;
/// After the faults stop, everything settles within this much simulated time or the run fails:
/// a hold is answered within `COMMAND_LATENCY_MAX_MS`, a failed one is retried on the next pass,
/// at most `HOLD_ATTEMPTS_MAX` times, each unanswered one within `HOLD_DEADLINE_S`.
/// And an agent cut off when the faults stopped reconnects within its longest back-off and
/// is ready again within a lease of it. And a webhook delivery the faults left pending is
/// attempted again within its longest retry wait (`webhooks::RETRY_WAIT_MAX_MS`) and the next
/// pass, and succeeds (the receivers are up): it settles delivered or, already, dead.
pub const LIVENESS_BOUND_MS: u64 = (bc_projections::HOLD_ATTEMPTS_MAX as u64 + 1)
    * (bc_projections::HOLD_DEADLINE_S * 1000 + RECONCILE_EVERY_MS)
    + AGENT_TICK_MS
    + bc_agent::session::BACKOFF_MAX_MS
    + net::SESSION.lease_ms
    + webhooks::RETRY_WAIT_MAX_MS
    + RECONCILE_EVERY_MS;

const _: () = assert!(COMMAND_LATENCY_MAX_MS < RECONCILE_EVERY_MS);
const _: () = assert!(REQUEST_GPUS_MAX <= NODE_GPUS_MIN && NODE_GPUS_MIN <= NODE_GPUS_MAX);
const _: () = assert!(LIVENESS_BOUND_MS < 3_600_000);

/// A fault the run can inject, by its `--faults` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// A machine refuses every hold for a while (`gpu.hold_failed`; the plan requeues).
    FailedHolds,
    /// An agent's runner hangs for a while: the commands it is sent wait (holds unanswered past
    /// their deadline), and run when it recovers.
    UnansweredHolds,
    /// A machine refuses releases for a while (the ledger keeps them; the agent retries).
    RefusedReleases,
    /// An agent goes away (stops) for up to 10 minutes, then starts again and catches up.
    AgentsAway,
    /// An agent's clock is up to 30 s off the control plane's.
    ClockSkew,
    /// An agent crashes after running its commands, before its journal goes out.
    AgentCrash,
    /// The next command that reaches an agent reaches it twice.
    DuplicateCommands,
    /// A request is decided on a view up to a minute old (another gateway's): its placement's
    /// node guard must refuse it.
    StaleView,
    /// The next acknowledgement of a journal entry to an agent is lost and its stream breaks:
    /// the agent sends the entries again in its next session, which the log must take once.
    LostAcks,
    /// The next reconciler pass dies after its k-th append (k from the seed, 0 to 4; a group of
    /// actions appended in one transaction is one): nothing after it lands, and the next pass
    /// must do the rest.
    ReconcilerCrash,
    /// The gateway restarts: its `Log` (the appender), the store's connections and the fleet's
    /// in-memory views are dropped and opened again from the same SQLite file; the agents
    /// reconnect and deliver their journals again from what they were last acknowledged.
    GatewayRestart,
    /// The next 1 to 3 append transactions make their writes and then fail instead of
    /// committing: the caller (a tenant, a reconciler pass, an agent's session) sees an error
    /// and nothing is half written.
    FailingCommits,
    /// The database's primary fails over: the next 1 to 3 append transactions that commit are
    /// made and their answers lost (every caller in them sees `Indeterminate`, UNAVAILABLE; the
    /// writes refused while no primary is reached are `failing-commits`'). A tenant sends its request again under the same idempotency
    /// key, which must replay what was made (the check: never made twice, never lost); a
    /// reconciler pass, an agent's session and the webhooks consumer decide again or deliver
    /// again from what the log says.
    Failover,
    /// A node's link loses messages for a while; a loss breaks the stream (gRPC's is reliable),
    /// and the agent reconnects.
    DropMessages,
    /// A node's link delays messages for a while, up to more than a lease (order kept): its
    /// lease may lapse (`node.unreachable`) and its session end.
    DelayMessages,
    /// A node's link delivers messages twice for a while.
    DuplicateMessages,
    /// A node's link lets a message overtake the one before it for a while.
    ReorderMessages,
    /// A node is cut off both ways for a while (no message passes, no connection opens), then
    /// healed.
    Partition,
    /// A webhook receiver is down for 10 s to 4 minutes: it refuses connections or answers
    /// 503, so its deliveries are retried on the schedule and some die (dead letters).
    FailingReceivers,
    /// An operator rolls a new agent release out to a tenant's pool (or, one live already,
    /// pauses, resumes or aborts it now and then); each node's new agent, by the seed, starts
    /// and confirms, exits at start or hangs (its watchdog rolls it back), or drops off after
    /// confirming (`run/rollouts.rs`).
    Rollouts,
    /// A bare-metal machine's BMC hangs for 10 s to 3 minutes: every call answers only at its
    /// timeout (`bc_bmc::REQUEST_TIMEOUT_S` of simulated time), with `Timeout` (`run/metal.rs`).
    BmcHangs,
    /// A BMC accepts power changes and applies none for 30 s to 5 minutes: the power wait's
    /// deadline fails the workflow.
    PowerNeverApplies,
    /// A machine's next deploy installs a system whose agent never joins: the deploy fails at
    /// its deadline and its join token is revoked.
    DeployNeverJoins,
    /// A BMC refuses the credentials (HTTP 401) for 30 s to 10 minutes, as when its password was
    /// changed on the machine and not yet in the control plane: a workflow's step fails, a
    /// machine at rest goes into maintenance after the sync's bounded reads, and its operator
    /// recovers it.
    BmcRefusesCredentials,
}

impl Fault {
    /// Named only: not in `all` (and so not in `make test`'s seeds) until what it finds is
    /// understood. None now: `failover` was, until its finding (a machine whose join's answer was
    /// lost gave up, and left its node ready with no agent) was fixed in the gateway's join.
    pub const NAMED_ONLY: &[Fault] = &[];

    pub const ALL: &[Fault] = &[
        Fault::FailedHolds,
        Fault::UnansweredHolds,
        Fault::RefusedReleases,
        Fault::AgentsAway,
        Fault::ClockSkew,
        Fault::AgentCrash,
        Fault::DuplicateCommands,
        Fault::StaleView,
        Fault::LostAcks,
        Fault::ReconcilerCrash,
        Fault::GatewayRestart,
        Fault::FailingCommits,
        Fault::DropMessages,
        Fault::DelayMessages,
        Fault::DuplicateMessages,
        Fault::ReorderMessages,
        Fault::Partition,
        Fault::FailingReceivers,
        Fault::Rollouts,
        Fault::BmcHangs,
        Fault::PowerNeverApplies,
        Fault::DeployNeverJoins,
        Fault::BmcRefusesCredentials,
        Fault::Failover,
    ];

    /// Bare metal's: enabled from, and injected on, the metal stream of the seed (`run/metal.rs`).
    pub fn is_metal(self) -> bool {
        matches!(self, Fault::BmcHangs | Fault::PowerNeverApplies | Fault::DeployNeverJoins | Fault::BmcRefusesCredentials)
    }

    pub fn name(self) -> &'static str {
        match self {
            Fault::FailedHolds => "failed-holds",
            Fault::UnansweredHolds => "unanswered-holds",
            Fault::RefusedReleases => "refused-releases",
            Fault::AgentsAway => "agents-away",
            Fault::ClockSkew => "clock-skew",
            Fault::AgentCrash => "agent-crash",
            Fault::DuplicateCommands => "duplicate-commands",
            Fault::LostAcks => "lost-acks",
            Fault::StaleView => "stale-view",
            Fault::ReconcilerCrash => "reconciler-crash",
            Fault::GatewayRestart => "gateway-restart",
            Fault::FailingCommits => "failing-commits",
            Fault::Failover => "failover",
            Fault::DropMessages => "drop-messages",
            Fault::DelayMessages => "delay-messages",
            Fault::DuplicateMessages => "duplicate-messages",
            Fault::ReorderMessages => "reorder-messages",
            Fault::Partition => "partition",
            Fault::FailingReceivers => "failing-receivers",
            Fault::Rollouts => "rollouts",
            Fault::BmcHangs => "bmc-hangs",
            Fault::PowerNeverApplies => "power-never-applies",
            Fault::DeployNeverJoins => "deploy-never-joins",
            Fault::BmcRefusesCredentials => "bmc-refuses-credentials",
        }
    }

    /// `all`, `none`, or names separated by commas.
    pub fn parse_list(text: &str) -> Result<Vec<Fault>, String> {
        match text.trim() {
            "all" => return Ok(Fault::ALL.to_vec()),
            "none" | "" => return Ok(vec![]),
            _ => {}
        }
        let mut out = BTreeSet::new();
        for name in text.split(',').map(str::trim) {
            let fault = Fault::ALL.iter().chain(Fault::NAMED_ONLY).find(|f| f.name() == name).ok_or_else(|| {
                let names: Vec<&str> = Fault::ALL.iter().chain(Fault::NAMED_ONLY).map(|f| f.name()).collect();
                format!("unknown fault {name:?}; the faults are all, none or {}", names.join(", "))
            })?;
            out.insert(*fault);
        }
        Ok(out.into_iter().collect())
    }
}

/// TEST ONLY: what `--unsafe-break NAME` breaks, each behind the back of the code that would
/// refuse it, so that only the simulator's own check can find it: each has a test
/// in `tests/tests/sim_run.rs` that asserts that check's message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Break {
    /// The log's fold (on the write path and in the full checks' fold alike) keeps a node's
    /// GPUs allocated on some `node.freed` events: a fold wrong both ways, which only the
    /// oracle ([`crate::oracle`]) sees.
    WrongFold,
    /// An agent handed `agent.update` takes every other running node of its rollout out with
    /// it, as if the release were pushed to all at once: the rollout's own document never
    /// says so, the modelled updaters do (the `maxUnavailable` check).
    RolloutAllAtOnce,
    /// When the liveness phase begins, one agent's ledger holds a GPU for a reservation the
    /// control plane never gave it: the run never settles (the liveness bound).
    LeakedHold,
    /// One session's proof reaches the gateway with a flipped bit: a refusal no fault explains
    /// (the sessions' check).
    BadProof,
    /// The `metal` reconciler is handed every machine with its running workflow's deadline a
    /// day later than the log's (as a reconciler that read the wrong deadline would), and every
    /// deploy's system never joins: a deploy waits past its bound, which the metal check derives
    /// from the lifecycle table, not from the row (`run/metal.rs`).
    MetalDeadlineIgnored,
}

impl Break {
    pub const ALL: &[Break] =
        &[Break::WrongFold, Break::RolloutAllAtOnce, Break::LeakedHold, Break::BadProof, Break::MetalDeadlineIgnored];

    pub fn name(self) -> &'static str {
        match self {
            Break::WrongFold => "wrong-fold",
            Break::RolloutAllAtOnce => "rollout-all-at-once",
            Break::LeakedHold => "leaked-hold",
            Break::BadProof => "bad-proof",
            Break::MetalDeadlineIgnored => "metal-deadline-ignored",
        }
    }

    pub fn parse(text: &str) -> Result<Break, String> {
        Break::ALL.iter().copied().find(|b| b.name() == text.trim()).ok_or_else(|| {
            let names: Vec<&str> = Break::ALL.iter().map(|b| b.name()).collect();
            format!("unknown --unsafe-break {text:?}; expected one of {}", names.join(", "))
        })
    }
}

/// TEST ONLY (`--unsafe-break wrong-fold`): the real fold, but on one `node.freed` in
/// [`WRONG_FOLD_EVERY`] (by its seq) the node's row keeps the reservation's GPUs. It is a pure
/// function of the event, so the write path and a replay agree, as a wrong fold would.
struct WrongFold;

/// `--unsafe-break wrong-fold` breaks the `node.freed` events whose seq is a multiple of this.
const WRONG_FOLD_EVERY: u64 = 7;

impl bc_core::store::Projector for WrongFold {
    fn touches(&self, event: &bc_core::event::StoredEvent, out: &mut Vec<RowKey>) {
        Projections.touches(event, out)
    }

    fn apply(&self, key: &RowKey, current: Option<Value>, event: &bc_core::event::StoredEvent) -> bc_core::Result<Option<Value>> {
        let kept = current.as_ref().and_then(|doc| doc.get("allocations").cloned());
        let mut doc = Projections.apply(key, current, event)?;
        let env = &event.envelope;
        if key.kind == KIND_NODE
            && env.event_type == ev::NODE_FREED
            && env.seq.is_multiple_of(WRONG_FOLD_EVERY)
            && let (Some(doc), Some(kept)) = (doc.as_mut(), kept)
        {
            doc["allocations"] = kept;
        }
        Ok(doc)
    }
}

/// What `sim run` is asked.
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    pub nodes: usize,
    pub tenants: usize,
    pub hours: u64,
    pub faults: Vec<Fault>,
    /// Bare-metal machines enrolled (`--metal`); `None`: one for every `NODES_PER_MACHINE`
    /// (25) nodes, at least one (`run/metal.rs`). `Some(0)`: no bare metal at all.
    pub metal: Option<usize>,
    /// TEST ONLY: the stale view's placements are appended without their node guard, so the
    /// checker's premise is broken on purpose and it must find a double booking.
    pub unsafe_no_placement_guard: bool,
    /// TEST ONLY: journal entries are appended without their idempotency key, and deliveries'
    /// acknowledgements are lost often, so an entry delivered twice is appended twice: the
    /// checker must find the duplicate.
    pub unsafe_no_journal_dedupe: bool,
    /// TEST ONLY (`--unsafe-break NAME`): one thing broken on purpose that only the
    /// simulator's own checks can see (see [`Break`]).
    pub unsafe_break: Option<Break>,
    /// Record the [`Timeline`] a report draws (`sim run --report`). It only reads: the run
    /// decides the same and gives the same digest either way.
    pub timeline: bool,
}

impl Options {
    pub fn check(&self) -> Result<(), String> {
        if self.nodes == 0 || self.nodes > NODES_MAX {
            return Err(format!("--nodes {} is outside 1..={NODES_MAX}", self.nodes));
        }
        if self.tenants == 0 || self.tenants > TENANTS_MAX {
            return Err(format!("--tenants {} is outside 1..={TENANTS_MAX}", self.tenants));
        }
        if self.nodes < self.tenants {
            return Err(format!("--nodes {} < --tenants {}: every tenant needs a node", self.nodes, self.tenants));
        }
        if self.hours == 0 || self.hours > HOURS_MAX {
            return Err(format!("--hours {} is outside 1..={HOURS_MAX}", self.hours));
        }
        if let Some(metal) = self.metal
            && metal > METAL_MAX
        {
            return Err(format!("--metal {metal} is outside 0..={METAL_MAX}"));
        }
        Ok(())
    }

    /// The bare-metal machines the run enrolls ([`Options::metal`], or its default).
    pub fn metal_machines(&self) -> usize {
        self.metal.unwrap_or_else(|| self.nodes.div_ceil(metal::NODES_PER_MACHINE).max(1))
    }

    /// The one command that repeats this run.
    pub fn command(&self) -> String {
        let faults = if self.faults == Fault::ALL {
            "all".to_owned()
        } else if self.faults.is_empty() {
            "none".to_owned()
        } else {
            self.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(",")
        };
        let mut command = format!(
            "better-compute sim run --seed {} --nodes {} --tenants {} --hours {} --faults {faults}",
            self.seed, self.nodes, self.tenants, self.hours
        );
        if let Some(metal) = self.metal {
            command.push_str(&format!(" --metal {metal}"));
        }
        if self.unsafe_no_placement_guard {
            command.push_str(" --unsafe-no-placement-guard");
        }
        if self.unsafe_no_journal_dedupe {
            command.push_str(" --unsafe-no-journal-dedupe");
        }
        if let Some(broken) = self.unsafe_break {
            command.push_str(" --unsafe-break ");
            command.push_str(broken.name());
        }
        command
    }
}

/// What a run did and found.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub steps: u64,
    pub simulated_ms: u64,
    pub events: u64,
    pub reservations_requested: u64,
    pub placed_at_request: u64,
    pub stale_placements_refused: u64,
    /// Reconciler passes a `reconciler-crash` stopped once they had made their appends.
    pub passes_cut: u64,
    /// Tenants' writes whose answer a `failover` lost, sent again under their idempotency key
    /// (each replayed what the lost commit made).
    pub failover_retries: u64,
    /// Reservations per final state.
    pub reservations: BTreeMap<String, u64>,
    pub releases: u64,
    pub extensions: u64,
    pub cordons: u64,
    /// Faults enabled by the seed, and how often each was injected.
    pub faults_enabled: Vec<&'static str>,
    pub faults_injected: BTreeMap<&'static str, u64>,
    pub step_checks: u64,
    pub full_checks: u64,
    /// Workload appends the log acknowledged, found again by the last full check.
    pub acknowledged_checked: u64,
    pub liveness_ms: Option<u64>,
    /// The liveness phase's bound: [`LIVENESS_BOUND_MS`] after the last reservation running
    /// when the faults stopped ended.
    pub liveness_bound_ms: u64,
    /// `(tenant, seq, hash hex)` in tenant order.
    pub heads: Vec<(String, u64, String)>,
    /// SHA-256 over every tenant's head in tenant order (tenant id, seq big-endian, hash).
    pub digest: String,
    pub violation: Option<Failure>,
    /// The series over simulated time, when [`Options::timeline`] asked for them.
    pub timeline: Option<Timeline>,
    /// Steps that only moved the transport or a session (a heartbeat and its answer, a tick): no
    /// event appended, no command run, so nothing a check reads changed, and none is run.
    pub quiet_steps: u64,
    /// What the transport carried and did to it.
    pub net: NetCounts,
    /// Nodes that went unreachable (`node.unreachable` appended by the liveness pass).
    pub unreachable: u64,
    /// Rollouts the `rollouts` fault created, and agent updates and rollbacks it carried out.
    pub rollouts: u64,
    pub updates: u64,
    /// The webhooks' subscriptions and deliveries.
    pub webhooks: WebhookCounts,
    /// Nodes that joined during the run (beside `--nodes` at the start), operators began to
    /// take out (drained), and that went (their agent stopped for good).
    pub nodes_joined: u64,
    pub nodes_drained: u64,
    pub nodes_left: u64,
    /// Of those, deleted once nothing held them (`node.deleted`).
    pub nodes_deleted: u64,
    /// Bare metal: machines, verbs, workflows, BMC calls (`run/metal.rs`).
    pub metal: MetalCounts,
}

#[derive(Clone, Debug)]
pub struct Failure {
    pub step: u64,
    pub at_ms: u64,
    pub what: String,
}

impl Outcome {
    pub fn to_json(&self, options: &Options) -> Value {
        json!({
            "ok": self.violation.is_none(),
            "seed": options.seed,
            "nodes": options.nodes,
            "tenants": options.tenants,
            "hours": options.hours,
            "steps": self.steps,
            "simulatedHours": self.simulated_ms as f64 / 3_600_000.0,
            "events": self.events,
            "reservationsRequested": self.reservations_requested,
            "placedAtRequest": self.placed_at_request,
            "stalePlacementsRefused": self.stale_placements_refused,
            "reconcilerPassesCut": self.passes_cut,
            "failoverRetries": self.failover_retries,
            "reservations": self.reservations,
            "releases": self.releases,
            "extensions": self.extensions,
            "cordons": self.cordons,
            "rollouts": self.rollouts,
            "agentUpdates": self.updates,
            "faultsEnabled": self.faults_enabled,
            "faultsInjected": self.faults_injected,
            "invariantChecks": {
                "afterEveryStep": self.step_checks,
                "full": self.full_checks,
                "fullStepsMin": FULL_CHECK_STEPS_MIN,
                "fullEventsPerStep": FULL_CHECK_EVENTS_PER_STEP,
                "acknowledgedAppendsChecked": self.acknowledged_checked,
            },
            "quietSteps": self.quiet_steps,
            "nodesUnreachable": self.unreachable,
            "nodesJoined": self.nodes_joined,
            "nodesDrained": self.nodes_drained,
            "nodesLeft": self.nodes_left,
            "nodesDeleted": self.nodes_deleted,
            "transport": {
                "messages": self.net.messages,
                "sessions": self.net.sessions,
                "dropped": self.net.dropped,
                "delayed": self.net.delayed,
                "duplicated": self.net.duplicated,
                "reordered": self.net.reordered,
                "refusedPastAGap": self.net.gaps_refused,
                "endedIdle": self.net.idle_ended,
            },
            "webhooks": {
                "subscriptions": self.webhooks.subscriptions,
                "subscribedMidRun": self.webhooks.subscribed_mid_run,
                "matchedEvents": self.webhooks.matched,
                "delivered": self.webhooks.delivered,
                "deadLetters": self.webhooks.dead,
                "attempts": self.webhooks.attempts,
                "received": self.webhooks.received,
            },
            "metal": self.metal.to_json(),
            "livenessSettledMs": self.liveness_ms,
            "livenessBoundMs": self.liveness_bound_ms,
            "heads": self.heads.iter().map(|(t, seq, hash)| json!({"tenantId": t, "seq": seq, "hash": hash})).collect::<Vec<_>>(),
            "digest": self.digest,
            "failure": self.violation.as_ref().map(|f| json!({"step": f.step, "atMs": f.at_ms, "what": f.what})),
            "reproduce": options.command(),
        })
    }
}

/// A due thing. Ordered by due time, then by when it was scheduled.
#[derive(Clone, Debug)]
enum Task {
    Arrival(usize),
    TenantAction(usize),
    Reconcile,
    /// A message reaches an end of node `a`'s connection.
    Deliver(usize, u64, Box<net::Message>),
    /// Node `a`'s connection opened, or broke (the agent hears of it).
    Connected(usize, u64),
    Broken(usize, u64, String),
    /// Node `a`'s session machine's periodic tick (of its start's generation), or its retry after a
    /// back-off.
    SessionTick(usize, u64),
    SessionRetry(usize),
    AgentTick(usize),
    FaultTick,
    Restart(usize),
    RefuseHoldsEnd(usize),
    RefuseReleasesEnd(usize),
    DeafEnd(usize),
    Uncordon(usize, String),
    StaleViewRefresh(usize),
    /// A node joins (the tenant is drawn when it does).
    Join,
    /// An operator drains a node to take it out (the node is drawn when it does).
    Leave,
    /// Node `a`, draining, goes if nothing runs on it any more.
    LeaveCheck(usize),
    /// Node `a`'s agent starts again after an update or a rollback (`run/rollouts.rs`).
    UpdateRestart(usize, Box<rollouts::Restart>),
    /// Node `a`'s new agent, unhealthy, drops off.
    UpdateAway(usize),
    /// The gateway's deadline for hearing from node `a` on a connection.
    GatewayIdle(usize, u64),
    /// Node `a`, gone, is deleted by its operator once nothing holds it.
    NodeDelete(usize),
    /// An operator's next verb on bare-metal machine `m`; a metal fault; machine `m`'s hanging
    /// BMC call times out; machine `m`'s installed system joins (`run/metal.rs`).
    MetalAction(usize),
    MetalFault,
    BmcAnswer(usize),
    MetalInstalled(usize),
}

/// The simulator's own state beside the world: the schedule and what each fault has pending.
struct Sim {
    /// Releases the `rollouts` fault registered.
    releases: u64,
    world: World,
    rng: SeededRng,
    options: Options,
    queue: BTreeMap<(u64, u64), Task>,
    scheduled: u64,
    /// The transport, the agents' session machines and the gateway's sessions.
    net: net::Net,
    net_counts: NetCounts,
    /// Commands the agents' runners ran (a step that ran one is checked).
    commands_run: u64,
    /// Per agent: its runner is hung until; it crashes after its next commands; the next
    /// command is delivered twice; the next entry's acknowledgement is lost.
    deaf_until: Vec<u64>,
    crash_next: Vec<bool>,
    again_next: Vec<bool>,
    lose_ack_next: Vec<bool>,
    /// The next reconciler pass dies after this many appends (`reconciler-crash`).
    pass_crash_next: Option<u64>,
    /// Per tenant: the mean time between requests, and the stale view (another gateway's).
    arrival_mean_ms: Vec<f64>,
    stale_views: Vec<Option<(Vec<NodeDoc>, Vec<ReservationDoc>)>>,
    /// Each enabled fault's probability of being the one injected (drawn from the seed); the
    /// stale view's is per request.
    enabled: BTreeMap<Fault, f64>,
    faults_running: bool,
    workload_running: bool,
    out: Outcome,
    /// The series being recorded (`--report`), and every node's GPUs added up (its denominator).
    timeline: Option<Timeline>,
    gpus_total: u64,
    /// The step of the last full check and the events the log had then (its next one's gap).
    step_at_full_check: u64,
    events_at_full_check: u64,
    /// The log as the full checks have read and folded it so far.
    fold: LogFold,
    /// The webhooks: subscriptions, receivers, the real consumer.
    webhooks: webhooks::SimWebhooks,
    /// Nodes whose agent stopped for good after their drain (never restarted).
    departed: BTreeSet<usize>,
    /// The nodes' joins draw from their own stream of the seed ([`JOIN_STREAM`]), so adding
    /// them moved no other draw.
    join_rng: SeededRng,
    /// The last full check is running: no delivery may be pending.
    ending: bool,
    /// The modelled updaters: each agent that was handed `agent.update` or `agent.rollback` and
    /// has not started again yet, with the rollout and the command's issue time.
    updating: BTreeMap<usize, (String, u64)>,
    /// Since when each stopped agent is down (crashed, away, updating, gone).
    down_since: BTreeMap<usize, u64>,
    /// `--unsafe-break bad-proof` flipped its bit already.
    proof_broken: bool,
    /// A broken invariant found deep in a step (a modelled updater's check), reported at its end.
    found: Option<Violation>,
    /// Bare metal: the machines, their simulated BMCs and the real `metal` reconciler.
    metal: Option<metal::SimMetal>,
}

/// An exponential draw with mean `mean_ms` (at least 1 ms).
fn exponential_ms(rng: &mut SeededRng, mean_ms: f64) -> u64 {
    let u = rng.next_unit().max(1e-12);
    ((-u.ln()) * mean_ms).max(1.0) as u64
}

fn between(rng: &mut SeededRng, low: u64, high: u64) -> u64 {
    low + pick(rng, (high - low + 1) as usize) as u64
}

/// Runs `options` to the end (or its first broken invariant).
pub async fn run(options: Options) -> Outcome {
    let mut rng = SeededRng(options.seed);
    let shape = Shape { tenants: options.tenants, nodes: options.nodes, gpus_min: NODE_GPUS_MIN, gpus_max: NODE_GPUS_MAX };
    let mut world = match options.unsafe_break {
        Some(Break::WrongFold) => World::new_folding(options.seed, &mut rng, shape, std::sync::Arc::new(WrongFold)).await,
        _ => World::new(options.seed, &mut rng, shape).await,
    };
    world.journal_dedupe = !options.unsafe_no_journal_dedupe;
    let mut enabled = BTreeMap::new();
    for fault in options.faults.iter().filter(|f| !f.is_metal()) {
        let forced = (options.unsafe_no_placement_guard && *fault == Fault::StaleView)
            || (options.unsafe_no_journal_dedupe && *fault == Fault::DuplicateMessages);
        if chance(&mut rng, FAULT_ENABLED_P) || forced {
            enabled.insert(*fault, 0.1 + 0.4 * rng.next_unit());
        }
    }
    if options.unsafe_no_placement_guard {
        // The switch is there to be caught: the stale view decides often.
        enabled.insert(Fault::StaleView, 0.5);
    }
    if options.unsafe_no_journal_dedupe {
        // Likewise: messages are duplicated often.
        enabled.insert(Fault::DuplicateMessages, 0.5);
    }
    let webhooks = webhooks::SimWebhooks::new(&world, &mut rng).await;
    let nodes = options.nodes;
    let mut sim = Sim {
        webhooks,
        ending: false,
        updating: BTreeMap::new(),
        down_since: BTreeMap::new(),
        proof_broken: false,
        found: None,
        metal: None,
        join_rng: SeededRng(options.seed ^ JOIN_STREAM),
        departed: BTreeSet::new(),
        releases: 0,
        rng,
        options: options.clone(),
        queue: BTreeMap::new(),
        scheduled: 0,
        net: net::Net::new(nodes),
        net_counts: NetCounts::default(),
        commands_run: 0,
        deaf_until: vec![0; nodes],
        crash_next: vec![false; nodes],
        again_next: vec![false; nodes],
        lose_ack_next: vec![false; nodes],
        pass_crash_next: None,
        arrival_mean_ms: vec![],
        stale_views: vec![None; options.tenants],
        out: Outcome { faults_enabled: enabled.keys().map(|f| f.name()).collect(), ..Outcome::default() },
        enabled,
        faults_running: true,
        workload_running: true,
        timeline: options.timeline.then(Timeline::new),
        gpus_total: world.agents.iter().map(|a| a.machine.inventory.gpus.gpus.len() as u64).sum(),
        step_at_full_check: 0,
        events_at_full_check: 0,
        fold: LogFold::default(),
        world,
    };
    sim.observe().await;
    let went = sim.go().await;
    // The last sample: the end, or the moment of the failure.
    sim.observe().await;
    if let Err(violation) = went {
        let (step, at_ms) = (sim.out.steps, sim.world.now_ms().saturating_sub(crate::world::EPOCH_MS));
        if let Some(timeline) = sim.timeline.as_mut() {
            timeline.mark(MarkKind::Failure, at_ms, format!("step {step}: {}", violation.0));
        }
        sim.out.violation = Some(Failure { step, at_ms, what: violation.0 });
    }
    sim.out.simulated_ms = sim.world.now_ms().saturating_sub(crate::world::EPOCH_MS);
    sim.out.net = sim.net_counts.clone();
    if let Some(metal) = sim.metal.as_ref() {
        sim.out.metal = metal.counts.clone();
    }
    sim.finish().await;
    sim.out.timeline = sim.timeline.take();
    sim.out
}

impl Sim {
    fn schedule(&mut self, at_ms: u64, task: Task) {
        self.scheduled += 1;
        self.queue.insert((at_ms, self.scheduled), task);
    }

    fn after(&mut self, by_ms: u64, task: Task) {
        let at = self.world.now_ms().saturating_add(by_ms);
        self.schedule(at, task);
    }

    fn injected(&mut self, fault: Fault) {
        *self.out.faults_injected.entry(fault.name()).or_default() += 1;
    }

    /// The run: its start, the safety phase until `--hours` are up, then the liveness phase.
    async fn go(&mut self) -> Result<(), Violation> {
        self.start().await;
        let end_ms = crate::world::EPOCH_MS + self.options.hours * 3_600_000;
        // The safety phase.
        while let Some(((at, _), _)) = self.queue.first_key_value() {
            if *at > end_ms {
                break;
            }
            self.step().await?;
        }
        self.liveness_phase(end_ms).await
    }

    /// The first of everything on the schedule: each tenant's requests and actions, the clock
    /// skews, the reconciler steps, each node's lease and agent, the faults, joins and leaves.
    async fn start(&mut self) {
        // Arrivals keep each tenant's GPUs about LOAD_TARGET busy: mean gap = the mean ask's
        // GPU-seconds over the GPUs kept busy.
        for t in 0..self.options.tenants {
            let nodes: Vec<NodeDoc> = self.world.rows(t, KIND_NODE).await;
            let gpus: usize = nodes.iter().map(|n| n.gpus.len()).sum();
            let mean_gpus = (1 + REQUEST_GPUS_MAX) as f64 / 2.0;
            let mean_s = DURATION_STEP_S as f64 * (1 + DURATION_STEPS_MAX) as f64 / 2.0;
            self.arrival_mean_ms.push(mean_gpus * mean_s * 1000.0 / (gpus as f64 * LOAD_TARGET).max(1.0));
            let first = exponential_ms(&mut self.rng, self.arrival_mean_ms[t]);
            self.after(first, Task::Arrival(t));
            let first = exponential_ms(&mut self.rng, TENANT_ACTION_MEAN_MS as f64);
            self.after(first, Task::TenantAction(t));
            self.after(0, Task::StaleViewRefresh(t));
        }
        if self.enabled.contains_key(&Fault::ClockSkew) {
            for a in 0..self.options.nodes {
                if chance(&mut self.rng, 0.5) {
                    self.world.agents[a].skew_ms = between(&mut self.rng, 0, 60_000) as i64 - 30_000;
                    self.injected(Fault::ClockSkew);
                }
            }
        }
        self.after(RECONCILE_EVERY_MS, Task::Reconcile);
        // Each node's lease as its join left it (held for one lease), then its agent starts and
        // connects.
        let now = self.world.now_ms();
        for a in 0..self.options.nodes {
            let agent = &self.world.agents[a];
            let tenant = self.world.tenants[agent.tenant].id.to_string();
            let lease = [(tenant.clone(), agent.node.clone(), now + net::SESSION.lease_ms)];
            self.world.store.lease_renew(&lease).await.expect("the lease is written");
            self.world.store.lease_reported(&tenant, &agent.node, true).await.expect("the lease is written");
        }
        for a in 0..self.options.nodes {
            self.agent_start(a).await;
            let first = between(&mut self.rng, 1, AGENT_TICK_MS);
            self.after(first, Task::AgentTick(a));
        }
        if !self.enabled.is_empty() {
            let first = exponential_ms(&mut self.rng, FAULT_MEAN_MS as f64);
            self.after(first, Task::FaultTick);
        }
        let first = exponential_ms(&mut self.join_rng, NODE_JOIN_MEAN_MS as f64);
        self.after(first, Task::Join);
        let first = exponential_ms(&mut self.join_rng, NODE_LEAVE_MEAN_MS as f64);
        self.after(first, Task::Leave);
        self.metal_start().await;
    }

    /// The liveness phase, from `end_ms`: faults and the workload stop, every agent comes back,
    /// and the run must settle within [`LIVENESS_BOUND_MS`]; then the last full check.
    async fn liveness_phase(&mut self, end_ms: u64) -> Result<(), Violation> {
        self.world.clock.set_ms(end_ms.max(self.world.now_ms()));
        self.faults_running = false;
        self.workload_running = false;
        self.pass_crash_next = None;
        self.world.log.commits_fail(0);
        self.world.log.commit_answers_lost(0);
        self.net.heal();
        self.webhooks.heal();
        if let Some(timeline) = self.timeline.as_mut() {
            let at_ms = self.world.now_ms() - crate::world::EPOCH_MS;
            timeline.mark(MarkKind::Liveness, at_ms, "liveness phase: faults and the workload stop");
        }
        for a in 0..self.world.agents.len() {
            if self.departed.contains(&a) {
                continue;
            }
            let machine = &self.world.agents[a].machine;
            machine.set_refuse_holds(false);
            machine.set_refuse_releases(false);
            self.deaf_until[a] = 0;
            self.crash_next[a] = false;
            self.again_next[a] = false;
            self.lose_ack_next[a] = false;
            if self.net.links[a].machine.is_none() {
                self.agent_start(a).await;
            } else {
                // A hung runner recovers: what it was handed runs now.
                self.agent_input(a, bc_agent::session::Input::Tick).await?;
            }
        }
        self.rollouts_abort_running().await;
        if self.options.unsafe_break == Some(Break::LeakedHold) {
            self.leak_a_hold().await;
        }
        let started = self.world.now_ms();
        // The reservations still running end on their own time, each end a release in flight,
        // so the fleet cannot be quiet before the last of them ended: the bound runs from then.
        // A bare-metal workflow running now ends by its own bound (a deploy whose system never
        // joins, at its deadline): the run's bound is the later of the two.
        let running_ms = self.last_running_end_ms().await.saturating_sub(started);
        let metal_ms = self.metal_heal().await;
        let bound_ms = (running_ms + LIVENESS_BOUND_MS).max(metal_ms);
        self.out.liveness_bound_ms = bound_ms;
        // Why it was not settled at the last pass (what a failure reports: between passes the
        // fan-out or a journal may trail what that very step appended).
        let mut why_last = None;
        while let Some(((at, _), task)) = self.queue.first_key_value() {
            let reconcile = matches!(task, Task::Reconcile);
            if *at > started + bound_ms {
                break;
            }
            self.step().await?;
            if !reconcile {
                continue;
            }
            match self.unsettled().await {
                None => {
                    self.out.liveness_ms = Some(self.world.now_ms() - started);
                    break;
                }
                Some(why) => {
                    tracing::debug!(after_ms = self.world.now_ms() - started, why = %why, "not settled yet");
                    why_last = Some(why);
                }
            }
        }
        if self.out.liveness_ms.is_none() {
            let mut why = why_last.unwrap_or_else(|| "no reconciler pass ran".into());
            // The histories of what an agent and the control plane still disagree on, read once.
            if let Err(now) = self.world.settled().await {
                why.push_str(&format!("; at the end, {now}"));
            }
            if metal_ms > 0 {
                why.push_str(&format!("; the bare-metal workflows running then were bound to end within {metal_ms} ms"));
            }
            return Err(Violation(format!(
                "not settled {bound_ms} ms after the faults stopped (the last reservation running then ended after \
                 {running_ms} ms, and {LIVENESS_BOUND_MS} ms more): at the last pass, {why}"
            )));
        }
        self.ending = true;
        self.full_check().await
    }

    /// When the last reservation still running (or pending) ends, by its `endsAtMs` (`0`: none).
    async fn last_running_end_ms(&self) -> u64 {
        let mut last = 0;
        for t in 0..self.options.tenants {
            let live: Vec<ReservationDoc> = self.world.rows(t, KIND_RESERVATION_LIVE).await;
            last = live.iter().filter_map(|r| r.ends_at_ms).fold(last, u64::max);
        }
        last
    }

    /// TEST ONLY (`--unsafe-break leaked-hold`): the first running agent with a GPU it holds
    /// for nobody takes it for a reservation the control plane never made, in its runner's
    /// ledger and in `holds.json`, as a bug in the agent would.
    async fn leak_a_hold(&mut self) {
        for agent in &self.world.agents {
            let Some(runner) = agent.runner.as_ref() else { continue };
            let mut ledger = runner.ledger.lock().await;
            let held: BTreeSet<&str> = ledger.holds.values().flat_map(|h| h.gpus.iter().map(|g| g.uuid.as_str())).collect();
            let Some(free) = agent.machine.inventory.gpus.gpus.iter().find(|g| !held.contains(g.uuid.as_str())) else { continue };
            let hold = bc_agent::holds::Hold {
                command_id: "cmd_leaked".into(),
                gpus: vec![bc_agent::binding::HeldGpu { uuid: free.uuid.clone(), pci_address: free.pci_bus_id.clone() }],
                release_command_id: None,
            };
            ledger.holds.insert("rsv_never_given".into(), hold);
            runner.ledger_file.save(&ledger).expect("the ledger saves");
            return;
        }
    }

    /// What keeps the run from being settled (`None`: nothing): a reservation or an agent's
    /// holds ([`World::settled`]), a rollout, a webhook delivery, an agent whose journal is not
    /// all acknowledged, a command still queued for its node.
    async fn unsettled(&self) -> Option<String> {
        if let Err(v) = self.world.settled_explained(false).await {
            return Some(v.0);
        }
        if let Err(v) = self.rollouts_settled().await {
            return Some(v.0);
        }
        if let Some(why) = self.webhooks.unsettled(&self.world).await {
            return Some(why);
        }
        if let Some(why) = self.metal_unsettled().await {
            return Some(why);
        }
        let undelivered: Vec<&str> = (self.net.links.iter().enumerate())
            .filter(|(a, l)| !self.departed.contains(a) && l.machine.as_ref().is_none_or(|m| m.acked() != m.head()))
            .map(|(a, _)| self.world.agents[a].node.as_str())
            .collect();
        if !undelivered.is_empty() {
            return Some(format!("the journals of {undelivered:?} are not all acknowledged (or their agents are down)"));
        }
        for t in 0..self.options.tenants {
            let queues: Vec<NodeCommandsDoc> = self.world.rows(t, KIND_NODE_COMMANDS).await;
            if let Some(queue) = queues.iter().find(|q| !q.pending.is_empty()) {
                return Some(format!("commands are still queued for a node: {:?}", queue.pending));
            }
        }
        None
    }

    /// One step: the next task due, run at its time; then, unless it was quiet, the commands it
    /// issued routed and the invariants checked ([`Self::check_after`]).
    async fn step(&mut self) -> Result<(), Violation> {
        let Some(((at, _), task)) = self.queue.pop_first() else { return Ok(()) };
        if at > self.world.now_ms() {
            self.world.clock.set_ms(at);
        }
        self.out.steps += 1;
        if self.out.steps > STEPS_MAX {
            return Err(Violation(format!("more than {STEPS_MAX} steps")));
        }
        let appended_before = self.world.log.stats.events.load(std::sync::atomic::Ordering::Relaxed);
        let ran_before = self.commands_run;
        // The tenant the step changed (`None`: every tenant): only its rows and its agents'
        // ledgers can have moved, so the check after the step looks at it alone.
        let touched = self.touched(&task);
        // A reconciler pass appends for some tenants and runs nothing on an agent (it queues
        // commands; their deliveries are steps of their own): the check after it looks at the
        // tenants whose chain moved.
        let heads_before = match &task {
            Task::Reconcile => Some(self.world.store.heads().await.expect("the heads read")),
            _ => None,
        };
        self.run_task(task).await?;
        self.check_after(touched, heads_before, appended_before, ran_before).await
    }

    /// The tenant a task can change (`None`: every tenant).
    fn touched(&self, task: &Task) -> Option<usize> {
        match task {
            Task::Arrival(t) | Task::TenantAction(t) | Task::Uncordon(t, _) | Task::StaleViewRefresh(t) => Some(*t),
            Task::Deliver(a, _, _)
            | Task::Connected(a, _)
            | Task::Broken(a, _, _)
            | Task::SessionTick(a, _)
            | Task::SessionRetry(a)
            | Task::AgentTick(a)
            | Task::Restart(a)
            | Task::RefuseHoldsEnd(a)
            | Task::RefuseReleasesEnd(a)
            | Task::DeafEnd(a)
            | Task::UpdateRestart(a, _)
            | Task::UpdateAway(a)
            | Task::GatewayIdle(a, _)
            | Task::NodeDelete(a) => Some(self.world.agents[*a].tenant),
            Task::Reconcile | Task::FaultTick | Task::Join | Task::Leave => None,
            Task::MetalAction(m) | Task::BmcAnswer(m) | Task::MetalInstalled(m) => {
                Some(self.metal.as_ref().map_or(0, |metal| metal.machines[*m].tenant))
            }
            // It appends nothing (a quiet step).
            Task::MetalFault => Some(0),
            Task::LeaveCheck(a) => Some(self.world.agents[*a].tenant),
        }
    }

    /// Runs a task of the workload, the operators, the reconcilers or the faults; a node's
    /// own task goes to [`Self::run_node_task`].
    async fn run_task(&mut self, task: Task) -> Result<(), Violation> {
        match task {
            Task::Reconcile => self.reconcile().await?,
            Task::Arrival(t) => {
                if self.workload_running {
                    self.request(t).await?;
                    let next = exponential_ms(&mut self.rng, self.arrival_mean_ms[t]);
                    self.after(next, Task::Arrival(t));
                }
            }
            Task::TenantAction(t) => {
                if self.workload_running {
                    self.tenant_action(t).await;
                    let next = exponential_ms(&mut self.rng, TENANT_ACTION_MEAN_MS as f64);
                    self.after(next, Task::TenantAction(t));
                }
            }
            Task::FaultTick => {
                if self.faults_running {
                    self.fault().await;
                    let next = exponential_ms(&mut self.rng, FAULT_MEAN_MS as f64);
                    self.after(next, Task::FaultTick);
                }
            }
            Task::NodeDelete(a) => {
                if !self.node_delete(a).await {
                    self.after(LEAVE_CHECK_MS, Task::NodeDelete(a));
                }
            }
            Task::Uncordon(t, node) => {
                // A node being taken out stays cordoned.
                if self.world.doc::<NodeDoc>(t, KIND_NODE, &node).await.is_some_and(|n| !n.draining) {
                    self.cordon(t, &node, false).await;
                }
            }
            Task::Leave => {
                if self.workload_running {
                    self.node_leave().await;
                    let next = exponential_ms(&mut self.join_rng, NODE_LEAVE_MEAN_MS as f64);
                    self.after(next, Task::Leave);
                }
            }
            Task::LeaveCheck(a) => {
                if !self.node_gone(a).await {
                    self.after(LEAVE_CHECK_MS, Task::LeaveCheck(a));
                }
            }
            Task::Join => {
                if self.workload_running {
                    self.node_join().await;
                    let next = exponential_ms(&mut self.join_rng, NODE_JOIN_MEAN_MS as f64);
                    self.after(next, Task::Join);
                }
            }
            Task::StaleViewRefresh(t) => {
                if self.workload_running {
                    let nodes = self.world.rows(t, KIND_NODE).await;
                    let live = self.world.rows(t, KIND_RESERVATION_LIVE).await;
                    self.stale_views[t] = Some((nodes, live));
                    self.after(STALE_VIEW_REFRESH_MS, Task::StaleViewRefresh(t));
                }
            }
            Task::MetalAction(m) => self.metal_action(m).await?,
            Task::MetalFault => self.metal_fault(),
            Task::BmcAnswer(m) => self.metal_answer(m).await?,
            Task::MetalInstalled(m) => self.metal_installed(m).await?,
            node_task => self.run_node_task(node_task).await?,
        }
        Ok(())
    }

    /// The reconciler step: the passes the registry marks for the simulator (or a crashed
    /// one), the rollouts' check, the next step scheduled, and the webhooks consumer's round.
    async fn reconcile(&mut self) -> Result<(), Violation> {
        // The sessions' lease renewals are written before the liveness pass reads them
        // (the gateway writes them every 250 ms; only that pass reads them).
        self.net.leases.flush(&*self.world.store).await;
        match self.pass_crash_next.take() {
            Some(appends) => {
                if self.world.pass_crashing(appends).await {
                    self.out.passes_cut += 1;
                }
            }
            None => self.out.unreachable += self.world.pass().await,
        }
        self.rollouts_check().await?;
        // The `metal` reconciler's activation: a turn for each machine its scheduler starts.
        self.metal_pass().await?;
        self.after(RECONCILE_EVERY_MS, Task::Reconcile);
        // (What the pass issued is routed after the step, as after every step.)
        // The webhooks consumer's round: fan out what the pass appended, deliver what is due.
        self.webhooks.drive(&self.world).await?;
        Ok(())
    }

    /// Runs a task of one node: its connection, its session machine, its agent, its hardware.
    async fn run_node_task(&mut self, task: Task) -> Result<(), Violation> {
        match task {
            Task::Deliver(a, connection, message) => {
                if !self.net.partitioned(a, self.world.now_ms()) {
                    self.deliver(a, connection, *message).await?;
                }
            }
            Task::Connected(a, connection) => {
                if self.net.links[a].connection == connection {
                    self.agent_input(a, bc_agent::session::Input::Connected).await?;
                }
            }
            Task::Broken(a, connection, reason) => {
                if self.net.links[a].connection == connection {
                    self.agent_input(a, bc_agent::session::Input::Disconnected { reason }).await?;
                }
            }
            Task::SessionTick(a, generation) => {
                if self.net.links[a].machine.is_some() && self.net.links[a].tick_generation == generation {
                    self.agent_input(a, bc_agent::session::Input::Tick).await?;
                    self.after(net::SESSION_TICK_MS, Task::SessionTick(a, generation));
                }
            }
            Task::SessionRetry(a) => self.agent_input(a, bc_agent::session::Input::Tick).await?,
            Task::AgentTick(a) => {
                // It retries the releases its machine refused, and sends what that journaled.
                let now = self.agent_now(a);
                if let Some(runner) = self.world.agents[a].runner.as_ref() {
                    let entries = runner.retry_releases(now).await.expect("the runner retries releases");
                    if let Some(last) = entries.last() {
                        let input = bc_agent::session::Input::Journaled { seq: last.seq, hash: last.hash };
                        self.agent_input(a, input).await?;
                    }
                }
                self.after(AGENT_TICK_MS, Task::AgentTick(a));
            }
            Task::Restart(a) => {
                if self.net.links[a].machine.is_none() && !self.departed.contains(&a) {
                    self.agent_start(a).await;
                }
            }
            Task::UpdateRestart(a, restart) => self.update_restart(a, *restart).await?,
            Task::UpdateAway(a) => self.update_away(a),
            Task::GatewayIdle(a, connection) => self.gateway_idle(a, connection)?,
            Task::RefuseHoldsEnd(a) => self.world.agents[a].machine.set_refuse_holds(false),
            Task::RefuseReleasesEnd(a) => self.world.agents[a].machine.set_refuse_releases(false),
            Task::DeafEnd(a) => {
                if self.deaf_until[a] <= self.world.now_ms() {
                    self.deaf_until[a] = 0;
                    // The runner recovers: what it was handed runs now.
                    self.agent_input(a, bc_agent::session::Input::Tick).await?;
                }
            }
            other => unreachable!("not a node's task: {other:?}"),
        }
        Ok(())
    }

    /// After a step's task: a broken invariant it found; then, unless the step was quiet (only
    /// the transport or a session moved), the commands routed, the tenants it touched checked
    /// (every tenant whose chain moved, after a reconciler step), a full check when one is
    /// due, and a sample of the series after a step that touched every tenant.
    async fn check_after(
        &mut self,
        touched: Option<usize>,
        heads_before: Option<Vec<(bc_core::id::TenantId, bc_core::store::Head)>>,
        appended_before: u64,
        ran_before: u64,
    ) -> Result<(), Violation> {
        if let Some(violation) = self.found.take() {
            return Err(violation);
        }
        // A journal entry the log refused in this step: reported at the step that delivered it.
        if let Some(refused) = self.world.refused.take() {
            return Err(Violation(format!("the log refused a journal entry: {refused}")));
        }
        let appended = self.world.log.stats.events.load(std::sync::atomic::Ordering::Relaxed) != appended_before;
        let quiet = touched.is_some() && !appended && self.commands_run == ran_before;
        if quiet {
            // Only the transport or a session moved: no row, ledger or journal entry changed.
            self.out.quiet_steps += 1;
            return Ok(());
        }
        // The gateway's command router follows every commit.
        self.route_commands().await?;
        match (touched, heads_before) {
            (Some(t), _) => self.world.check_tenant(t).await?,
            (None, Some(before)) => {
                let before: HashMap<_, _> = before.into_iter().map(|(tenant, head)| (tenant, head.seq)).collect();
                for (tenant, head) in self.world.store.heads().await.expect("the heads read") {
                    if before.get(&tenant) != Some(&head.seq)
                        && let Some(t) = self.world.tenants.iter().position(|x| x.id == tenant)
                    {
                        self.world.check_tenant(t).await?;
                    }
                }
            }
            (None, None) => self.world.check().await?,
        }
        self.out.step_checks += 1;
        let full_check_gap = FULL_CHECK_STEPS_MIN.max(self.events_at_full_check / FULL_CHECK_EVENTS_PER_STEP);
        if self.out.step_checks >= self.step_at_full_check + full_check_gap {
            self.full_check().await?;
        }
        if touched.is_none() {
            // After a reconciler pass (every RECONCILE_EVERY_MS) or a fault: the series' step.
            self.observe().await;
        }
        Ok(())
    }

    /// One sample of the series, when a timeline is recorded: GPUs held by active reservations
    /// over every GPU, reservations queued, nodes whose agent runs and hears its commands,
    /// faults injected and checks passed so far. Reads only (the rows, the agents' state);
    /// draws nothing from the seed.
    async fn observe(&mut self) {
        if self.timeline.is_none() {
            return;
        }
        let (mut busy, mut queued) = (0u64, 0u64);
        for t in 0..self.options.tenants {
            let live: Vec<ReservationDoc> = self.world.rows(t, KIND_RESERVATION_LIVE).await;
            for rsv in &live {
                match rsv.state {
                    ReservationState::Active => busy += rsv.gpu_indexes.len() as u64,
                    ReservationState::Queued => queued += 1,
                    _ => {}
                }
            }
        }
        let now = self.world.now_ms();
        let up = (0..self.world.agents.len())
            .filter(|&a| self.world.agents[a].runner.is_some() && self.deaf_until[a] <= now && !self.net.partitioned(a, now))
            .count();
        let sample = Sample {
            at_ms: now - crate::world::EPOCH_MS,
            gpu_utilization: busy as f64 / self.gpus_total.max(1) as f64,
            queue_depth: queued,
            nodes_up: up as u64,
            faults: self.out.faults_injected.values().sum(),
            checks: self.out.step_checks + self.out.full_checks,
        };
        if let Some(timeline) = self.timeline.as_mut() {
            timeline.observe(sample);
        }
    }

    /// A message reaches its end of node `a`'s connection.
    async fn deliver(&mut self, a: usize, connection: u64, message: net::Message) -> Result<(), Violation> {
        match message {
            net::Message::ToGateway(msg) => self.gateway_receive(a, connection, msg).await,
            net::Message::Closed => {
                self.net.gateway.remove(&(a, connection));
                Ok(())
            }
            net::Message::ToAgent(msg) => {
                if self.net.links[a].connection != connection {
                    return Ok(());
                }
                let is_ack = matches!(msg, bc_proto::gateway_message::Msg::EntryAck(_));
                if is_ack && std::mem::take(&mut self.lose_ack_next[a]) {
                    self.cut(a, connection, "an acknowledgement was lost: the stream broke");
                    return Ok(());
                }
                let twice = matches!(msg, bc_proto::gateway_message::Msg::Command(_)) && std::mem::take(&mut self.again_next[a]);
                let again = twice.then(|| msg.clone());
                self.agent_input(a, bc_agent::session::Input::Received(msg)).await?;
                if let Some(again) = again {
                    self.agent_input(a, bc_agent::session::Input::Received(again)).await?;
                }
                Ok(())
            }
        }
    }

    /// One request, decided as `reservations.create` decides it: on the tenant's view (or, with
    /// the stale-view fault, on one up to a minute old), placed at once or queued.
    async fn request(&mut self, t: usize) -> Result<(), Violation> {
        let gpus = 1 + pick(&mut self.rng, REQUEST_GPUS_MAX as usize) as u32;
        let duration_s = DURATION_STEP_S * between(&mut self.rng, 1, DURATION_STEPS_MAX);
        let tenant = self.world.tenants[t].clone();
        let pool: PoolDoc = self.world.doc(t, KIND_POOL, &tenant.pool).await.expect("the pool");
        let ask = ReservationAsk {
            pool,
            gpus,
            duration_s,
            selector_text: String::new(),
            selector: Selector::parse("").expect("the empty selector"),
            nvlink: false,
            tolerations: vec![],
            project: None,
        };
        let reservation_id = ReservationId::from_ulid(self.world.log.ids.ulid()).to_string();
        let command_id = CommandId::from_ulid(self.world.log.ids.ulid()).to_string();
        let input = ReservationCreateInput {
            reservation_id: &reservation_id,
            command_id: &command_id,
            now_ms: self.world.now_ms(),
            actor: "sim",
            replay: false,
        };
        let stale_p = self.enabled.get(&Fault::StaleView).copied().filter(|_| self.faults_running);
        let stale = stale_p.is_some_and(|p| chance(&mut self.rng, p)) && self.stale_views[t].is_some();
        let decided = if stale {
            let (nodes, live) = self.stale_views[t].clone().expect("a stale view");
            self.injected(Fault::StaleView);
            decide::reservation_create(&FleetIndex::new(nodes, live), None, &ask, &input)
        } else {
            self.world
                .fleet
                .with_tenant(&*self.world.store, tenant.id, |view| decide::reservation_create(view, None, &ask, &input))
                .await
                .expect("the view reads")
        };
        let decided = match decided {
            Ok(decided) => decided,
            Err(decide::Refusal::NeverFits { .. }) => return Ok(()),
            Err(e) => return Err(Violation(format!("reservation_create refused {reservation_id}: {e:?}"))),
        };
        self.out.reservations_requested += 1;
        match decided {
            ReservationCreate::Place { mut append, if_lost, .. } => {
                if self.options.unsafe_no_placement_guard && stale {
                    // TEST ONLY: the node guard dropped, so a stale placement lands; and the
                    // guard below it, the fold's refusal of a GPU already held, is broken too:
                    // the GPUs it takes are freed in the node's row behind the fold's back.
                    // Only the checker can find the double booking that follows.
                    for (stream, expected) in &mut append.guards {
                        if stream.starts_with("node/") {
                            *expected = ExpectedVersion::Any;
                        }
                    }
                    self.free_behind_the_fold(t, &append).await;
                }
                match self.client_append(append.into_request(tenant.id, "sim"), &reservation_id).await? {
                    Ok(_) => self.out.placed_at_request += 1,
                    // A failed commit: the client sees an error and nothing was written.
                    Err(e) if crate::world::injected(&e) => {}
                    Err(e) if e.code() == ErrorCode::Conflict => {
                        if stale {
                            self.out.stale_placements_refused += 1;
                        }
                        self.append_or_conflict(if_lost.into_request(tenant.id, "sim")).await?;
                    }
                    Err(e) => return Err(Violation(format!("appending the placement of {reservation_id}: {e}"))),
                }
            }
            ReservationCreate::Queue { append, .. } => {
                match self.client_append(append.into_request(tenant.id, "sim"), &reservation_id).await? {
                    Ok(_) => {}
                    Err(e) if crate::world::injected(&e) || e.code() == ErrorCode::Conflict => {}
                    Err(e) => return Err(Violation(format!("appending the queued request {reservation_id}: {e}"))),
                }
            }
            ReservationCreate::OverQuota { .. } => {}
        }
        Ok(())
    }

    /// A tenant's `reservations.create` append as its client makes it through the gateway
    /// ([`World::append_as_client`]): under a key, asked again under it when a `failover` lost
    /// the answer.
    async fn client_append(
        &mut self,
        request: bc_core::store::AppendRequest,
        reservation_id: &str,
    ) -> Result<bc_core::Result<bc_core::store::AppendResult>, Violation> {
        let key = format!("sim:reservations.create:{reservation_id}");
        let (answer, retried) = self.world.append_as_client(request, key).await.map_err(Violation)?;
        self.out.failover_retries += u64::from(retried);
        Ok(answer)
    }

    /// TEST ONLY (`--unsafe-no-placement-guard`): frees, in the node rows, the GPUs a
    /// placement's `node.allocated` events take, underneath the log (no event says so), so the
    /// fold takes them whoever holds them.
    async fn free_behind_the_fold(&self, t: usize, append: &bc_projections::decide::Append) {
        for event in &append.events {
            if event.event_type != ev::NODE_ALLOCATED {
                continue;
            }
            let Some(node_id) = event.stream.as_deref().and_then(|s| s.strip_prefix("node/")) else { continue };
            let payload = bc_core::canonical::to_json(&event.payload);
            let gpus: Vec<String> =
                payload["gpus"].as_array().into_iter().flatten().filter_map(Value::as_u64).map(|g| g.to_string()).collect();
            let Some(mut row) = self.world.doc::<Value>(t, KIND_NODE, node_id).await else { continue };
            if let Some(allocations) = row.get_mut("allocations").and_then(Value::as_object_mut) {
                allocations.retain(|gpu, _| !gpus.contains(gpu));
            }
            self.world.row_overwrite(t, KIND_NODE, node_id, &row).await;
        }
    }

    async fn append_or_conflict(&self, request: bc_core::store::AppendRequest) -> Result<(), Violation> {
        match self.world.append_acknowledged(request).await {
            Ok(_) => Ok(()),
            Err(e) if crate::world::injected(&e) => Ok(()),
            Err(e) if e.code() == ErrorCode::Conflict => Ok(()),
            Err(e) => Err(Violation(format!("an append failed: {e}"))),
        }
    }

    /// A release, an extension, an operator's cordon or a new webhook subscription, at random.
    async fn tenant_action(&mut self, t: usize) {
        let roll = pick(&mut self.rng, 20);
        if roll < 10 {
            if self.world.release(t, &mut self.rng).await {
                self.out.releases += 1;
            }
        } else if roll < 16 {
            let live: Vec<ReservationDoc> = self.world.rows(t, KIND_RESERVATION_LIVE).await;
            let active: Vec<&ReservationDoc> = live.iter().filter(|r| r.state == ReservationState::Active).collect();
            if active.is_empty() {
                return;
            }
            let rsv = active[pick(&mut self.rng, active.len())];
            let pool: PoolDoc = self.world.doc(t, KIND_POOL, &self.world.tenants[t].pool).await.expect("the pool");
            let by_s = DURATION_STEP_S * between(&mut self.rng, 1, 6);
            if let Ok(append) = decide::reservation_extend(rsv, &pool, by_s, None)
                && self.world.append_acknowledged(append.into_request(self.world.tenants[t].id, "sim")).await.is_ok()
            {
                self.out.extensions += 1;
            }
        } else if roll == 19 {
            self.webhooks.subscribe_more(&self.world, &mut self.rng, t).await;
        } else {
            let nodes: Vec<NodeDoc> = self.world.rows(t, KIND_NODE).await;
            let ready: Vec<&NodeDoc> = nodes.iter().filter(|n| !n.cordoned).collect();
            // Never the tenant's last uncordoned node: its queue would wait for the uncordon.
            if ready.len() < 2 {
                return;
            }
            let node = ready[pick(&mut self.rng, ready.len())].node_id.clone();
            self.cordon(t, &node, true).await;
            let back = between(&mut self.rng, 60_000, 1_200_000);
            self.after(back, Task::Uncordon(t, node));
        }
    }

    /// A node joins a tenant drawn from the seed, as `bcd join` makes it join: `node.joined`
    /// and `node.ready`, its lease held for one lease, its agent started and connecting.
    async fn node_join(&mut self) {
        if self.world.agents.len() >= NODES_MAX {
            return;
        }
        let t = pick(&mut self.join_rng, self.options.tenants);
        let shape = Shape { tenants: self.options.tenants, nodes: 1, gpus_min: NODE_GPUS_MIN, gpus_max: NODE_GPUS_MAX };
        let Some(a) = self.world.node_join(t, &mut self.join_rng, &shape).await else { return };
        self.out.nodes_joined += 1;
        self.gpus_total += self.world.agents[a].machine.inventory.gpus.gpus.len() as u64;
        self.deaf_until.push(0);
        self.crash_next.push(false);
        self.again_next.push(false);
        self.lose_ack_next.push(false);
        self.net.links.push(net::Link::default());
        let agent = &self.world.agents[a];
        let tenant = self.world.tenants[t].id.to_string();
        let lease = [(tenant.clone(), agent.node.clone(), self.world.now_ms() + net::SESSION.lease_ms)];
        self.world.store.lease_renew(&lease).await.expect("the lease is written");
        self.world.store.lease_reported(&tenant, &agent.node, true).await.expect("the lease is written");
        self.agent_start(a).await;
        let first = between(&mut self.join_rng, 1, AGENT_TICK_MS);
        self.after(first, Task::AgentTick(a));
    }

    /// An operator takes a node out: `node.draining` (cordoned: nothing new is placed on it),
    /// then it goes once nothing runs on it ([`Sim::node_gone`]). Never a tenant's last node
    /// that is not cordoned.
    async fn node_leave(&mut self) {
        let t = pick(&mut self.join_rng, self.options.tenants);
        let nodes: Vec<NodeDoc> = self.world.rows(t, KIND_NODE).await;
        let ready: Vec<&NodeDoc> = nodes.iter().filter(|n| !n.cordoned).collect();
        if ready.len() < 2 {
            return;
        }
        let node = ready[pick(&mut self.join_rng, ready.len())].clone();
        let Some(a) = self.world.agents.iter().position(|g| g.node == node.node_id) else { return };
        let event = NewEvent::new(ev::NODE_DRAINING, ev::to_cbor(&ev::NodeStateChanged {}).expect("cbor"));
        let request = bc_core::store::AppendRequest::new(
            self.world.tenants[t].id,
            stream_of(KIND_NODE, &node.node_id),
            ExpectedVersion::Exact(node.version),
            "sim-operator",
            vec![event],
        );
        if self.world.append_acknowledged(request).await.is_ok() {
            self.out.nodes_drained += 1;
            self.after(LEAVE_CHECK_MS, Task::LeaveCheck(a));
        }
    }

    /// Node `a` goes if its drain is done: no live reservation on it, nothing held by its
    /// agent, no command queued for it, and its whole journal acknowledged. Its agent stops
    /// for good (its lease lapses: `node.unreachable`). True when it went.
    async fn node_gone(&mut self, a: usize) -> bool {
        let (t, node) = (self.world.agents[a].tenant, self.world.agents[a].node.clone());
        let live: Vec<ReservationDoc> = self.world.rows(t, KIND_RESERVATION_LIVE).await;
        if live.iter().any(|r| r.node_id.as_deref() == Some(node.as_str())) {
            return false;
        }
        if !self.world.agents[a].ledger().holds.is_empty() {
            return false;
        }
        let queued: Option<NodeCommandsDoc> = self.world.doc(t, KIND_NODE_COMMANDS, &node).await;
        if queued.is_some_and(|q| !q.pending.is_empty()) {
            return false;
        }
        let delivered = self.net.links[a].machine.as_ref().is_some_and(|m| m.acked() == m.head());
        if !delivered {
            return false;
        }
        self.agent_stop(a);
        self.departed.insert(a);
        self.out.nodes_left += 1;
        // Once its lease lapses and the liveness pass says so, its operator deletes it.
        self.after(net::SESSION.lease_ms + RECONCILE_EVERY_MS, Task::NodeDelete(a));
        true
    }

    /// Node `a`, gone, is deleted as `nodes.delete` deletes one: decided on its document and what
    /// holds it (`decide::node_delete`; refused while its agent is still marked connected). True
    /// when it is gone; false to try again later (refused, a conflict, a failed commit).
    async fn node_delete(&mut self, a: usize) -> bool {
        let (t, node_id) = (self.world.agents[a].tenant, self.world.agents[a].node.clone());
        let Some(node) = self.world.doc::<NodeDoc>(t, KIND_NODE, &node_id).await else { return true };
        let tenant = self.world.tenants[t].id;
        let holders = bc_projections::placement::node_holders(&*self.world.store, tenant, &node_id)
            .await
            .expect("what holds the node reads");
        let Ok(append) = decide::node_delete(&node, &holders, Some("sim: taken out of the fleet".into())) else { return false };
        if self.world.append_acknowledged(append.into_request(tenant, "sim-operator")).await.is_err() {
            return false;
        }
        self.out.nodes_deleted += 1;
        true
    }

    async fn cordon(&mut self, t: usize, node_id: &str, on: bool) {
        let Some(node) = self.world.doc::<NodeDoc>(t, KIND_NODE, node_id).await else { return };
        if node.cordoned == on {
            return;
        }
        let event_type = if on { ev::NODE_CORDONED } else { ev::NODE_UNCORDONED };
        let event = NewEvent::new(event_type, ev::to_cbor(&ev::NodeStateChanged {}).expect("cbor"));
        let request = bc_core::store::AppendRequest::new(
            self.world.tenants[t].id,
            stream_of(KIND_NODE, &node_id),
            ExpectedVersion::Exact(node.version),
            "sim-operator",
            vec![event],
        );
        if self.world.append_acknowledged(request).await.is_ok() && on {
            self.out.cordons += 1;
        }
    }

    /// One fault, chosen among the enabled ones by their probabilities, on a random agent.
    async fn fault(&mut self) {
        let kinds: Vec<(Fault, f64)> = self
            .enabled
            .iter()
            .filter(|(f, _)| !matches!(f, Fault::StaleView | Fault::ClockSkew) && !f.is_metal())
            .map(|(f, p)| (*f, *p))
            .collect();
        let total: f64 = kinds.iter().map(|(_, p)| p).sum();
        if kinds.is_empty() || total <= 0.0 {
            return;
        }
        let mut roll = self.rng.next_unit() * total;
        let mut fault = kinds[kinds.len() - 1].0;
        for (f, p) in &kinds {
            if roll < *p {
                fault = *f;
                break;
            }
            roll -= p;
        }
        let a = pick(&mut self.rng, self.world.agents.len());
        self.injected(fault);
        match fault {
            Fault::FailedHolds => {
                self.world.agents[a].machine.set_refuse_holds(true);
                let end = between(&mut self.rng, 10_000, 300_000);
                self.after(end, Task::RefuseHoldsEnd(a));
            }
            Fault::RefusedReleases => {
                self.world.agents[a].machine.set_refuse_releases(true);
                let end = between(&mut self.rng, 10_000, 300_000);
                self.after(end, Task::RefuseReleasesEnd(a));
            }
            Fault::UnansweredHolds => {
                let end = between(&mut self.rng, 30_000, 3 * bc_projections::HOLD_DEADLINE_S * 1000);
                self.deaf_until[a] = self.world.now_ms() + end;
                self.after(end, Task::DeafEnd(a));
            }
            Fault::AgentsAway => {
                if self.net.links[a].machine.is_some() {
                    self.agent_stop(a);
                    let back = between(&mut self.rng, 30_000, 600_000);
                    self.after(back, Task::Restart(a));
                }
            }
            Fault::AgentCrash => self.crash_next[a] = true,
            Fault::DuplicateCommands => self.again_next[a] = true,
            Fault::LostAcks => self.lose_ack_next[a] = true,
            Fault::ReconcilerCrash => self.pass_crash_next = Some(between(&mut self.rng, 0, PASS_CRASH_APPENDS_MAX)),
            Fault::GatewayRestart => {
                self.world.restart_gateway().await;
                if let Some(metal) = self.metal.as_mut() {
                    metal.restart(&self.world);
                }
                // The old process's sessions, its unwritten lease renewals and its command
                // router go with it.
                self.net.leases = Default::default();
                self.net.router_restart(&self.world).await;
                let sessions: Vec<(usize, u64)> = std::mem::take(&mut self.net.gateway).into_keys().collect();
                for (b, connection) in sessions {
                    self.cut(b, connection, "the gateway restarted");
                }
            }
            Fault::DropMessages | Fault::DelayMessages | Fault::DuplicateMessages | Fault::ReorderMessages | Fault::Partition => {
                let until = self.world.now_ms() + between(&mut self.rng, net::LINK_FAULT_MS_MIN, net::LINK_FAULT_MS_MAX);
                let link = &mut self.net.links[a];
                let window = match fault {
                    Fault::DropMessages => &mut link.drop_until_ms,
                    Fault::DelayMessages => &mut link.delay_until_ms,
                    Fault::DuplicateMessages => &mut link.duplicate_until_ms,
                    Fault::ReorderMessages => &mut link.reorder_until_ms,
                    _ => &mut link.partition_until_ms,
                };
                *window = (*window).max(until);
                if fault == Fault::Partition {
                    self.net_counts.partitioned += 1;
                }
            }
            Fault::FailingCommits => self.world.log.commits_fail(between(&mut self.rng, 1, FAILING_COMMITS_MAX)),
            Fault::Failover => self.world.log.commit_answers_lost(between(&mut self.rng, 1, FAILOVER_LOST_ANSWERS_MAX)),
            Fault::FailingReceivers => {
                let until = self.world.now_ms() + between(&mut self.rng, webhooks::FAILING_MS_MIN, webhooks::FAILING_MS_MAX);
                let refusing = chance(&mut self.rng, 0.5);
                self.webhooks.fail(a, until, refusing);
            }
            Fault::Rollouts => self.rollout_fault(a).await,
            Fault::ClockSkew
            | Fault::StaleView
            | Fault::BmcHangs
            | Fault::PowerNeverApplies
            | Fault::DeployNeverJoins
            | Fault::BmcRefusesCredentials => {}
        }
    }

    /// The full checks: every chain verifies under the log key (node signatures included), the
    /// projection rows equal a fold of the whole log, every workload append the log
    /// acknowledged is still in it, and each node's journal in the log is what its agent wrote,
    /// once each ([`World::check_journals`]).
    ///
    /// The fold is kept between checks and each check folds only the events after the last
    /// one ([`LogFold`]; a test holds it to a fold from scratch as the log grows).
    async fn full_check(&mut self) -> Result<(), Violation> {
        self.out.full_checks += 1;
        self.step_at_full_check = self.out.step_checks;
        let (events, acknowledged) = full_check_on(&self.world, self.ending, &mut self.fold).await?;
        self.events_at_full_check = events;
        self.out.acknowledged_checked = acknowledged;
        self.webhooks.check(&self.world, &self.fold.logged, self.ending).await?;
        self.out.webhooks = self.webhooks.counts.clone();
        self.metal_rows_check().await?;
        Ok(())
    }

    /// The summary: reservations by state, the heads and the digest.
    async fn finish(&mut self) {
        let heads: BTreeMap<_, _> = self.world.store.heads().await.expect("heads read").into_iter().collect();
        let mut digest = Sha256::new();
        for tenant in &self.world.tenants {
            let head = heads.get(&tenant.id).copied().unwrap_or(bc_core::store::Head { seq: 0, hash: [0; 32] });
            digest.update(tenant.id.to_string().as_bytes());
            digest.update(head.seq.to_be_bytes());
            digest.update(head.hash);
            self.out.events += head.seq;
            self.out.heads.push((tenant.id.to_string(), head.seq, hex::encode(head.hash)));
        }
        self.out.digest = hex::encode(digest.finalize());
        for t in 0..self.options.tenants {
            let all: Vec<ReservationDoc> = self.world.rows(t, KIND_RESERVATION).await;
            for rsv in all {
                let state = serde_json::to_value(rsv.state).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
                *self.out.reservations.entry(state).or_default() += 1;
            }
        }
    }
}

/// What the full checks have read of the log: the fold of every event up to `after`, the
/// journal entries the events carry, every event's id, and the events as the webhooks' check
/// lists them. The simulator's log only grows (a gateway restart opens the same file again, and
/// what committed stays), so a check that keeps this reads and folds only the events after the
/// last check's: a full check costs what the log grew by, not the whole log, apart from the
/// chains' verification and the comparison with the stored rows, which read everything (the
/// verification without the arithmetic of signatures an earlier check found good).
#[derive(Default)]
pub(crate) struct LogFold {
    pub(crate) after: Position,
    pub(crate) state: HashMap<RowKey, Value>,
    pub(crate) journal: BTreeMap<String, JournalInLog>,
    pub(crate) ids: BTreeMap<(bc_core::id::TenantId, u64), String>,
    pub(crate) logged: Vec<webhooks::LoggedEvent>,
    /// The event and journal signatures found good by an earlier check: each check still
    /// verifies every chain whole (every hash from the stored bytes, every link, every
    /// checkpoint) but does the curve arithmetic only for signatures it has not seen.
    pub(crate) verified: std::sync::Arc<bc_core::keys::VerifiedSignatures>,
    /// The reference model of GPUs and reservations, fed the same events as the fold.
    pub(crate) oracle: crate::oracle::Oracle,
}

/// [`Sim::full_check`]'s checks on a world, from scratch; `settled`: every journal entry has
/// been delivered. Returns the events in the log and the acknowledged appends found in it.
pub async fn full_check(world: &World, settled: bool) -> Result<(u64, u64), Violation> {
    full_check_on(world, settled, &mut LogFold::default()).await
}

/// [`full_check`], folding on from `fold` (and leaving it at the end of the log).
pub(crate) async fn full_check_on(world: &World, settled: bool, fold: &mut LogFold) -> Result<(u64, u64), Violation> {
    let store = &*world.store;
    let trust = bc_core::audit::Trust::of(&[world.log_key.public()], "sim").expect("trust");
    let report = bc_core::audit::verify_with(&world.store, &trust, None, &|_| {}, Some(fold.verified.clone()))
        .await
        .expect("verify reads");
    if let Some(problem) = report.problems.first() {
        return Err(Violation(format!("the chain does not verify: {problem:?}")));
    }
    let LogFold { after, state, journal, ids, logged, verified: _, oracle } = fold;
    loop {
        let rows = store.read_after_rows(*after, None, 1000).await.expect("the log reads");
        let Some(last) = rows.last() else { break };
        *after = Position { commit: last.commit, index: last.index };
        let page = bc_core::store::decode_rows(rows).expect("events decode");
        for event in &page {
            ids.insert((event.envelope.tenant, event.envelope.seq), event.envelope.id.to_string());
            logged.push(webhooks::LoggedEvent {
                tenant: event.envelope.tenant,
                seq: event.envelope.seq,
                id: event.envelope.id.to_string(),
                event_type: event.envelope.event_type.clone(),
                position: event.position,
            });
            let payload = bc_core::canonical::to_json(&event.envelope.payload);
            if let Some(origin) = payload.get(bc_core::agent::JOURNAL_PAYLOAD_KEY) {
                let node = origin.get("nodeId").and_then(Value::as_str).unwrap_or_default().to_owned();
                let seq = origin.get("seq").and_then(Value::as_u64).unwrap_or_default();
                let body = origin.get("body").and_then(Value::as_str).unwrap_or_default().to_owned();
                journal.entry(node).or_default().push((seq, body));
            }
        }
        for event in &page {
            oracle.apply(event);
        }
        let projector = &*world.projector;
        let keys = bc_core::store::touched_rows(projector, &page);
        let current = keys.iter().filter_map(|k| state.remove(k).map(|v| (k.clone(), v))).collect();
        match bc_core::store::fold_projections(projector, &page, current) {
            Ok(folded) => {
                for (key, doc) in folded {
                    if let Some(doc) = doc {
                        state.insert(key, doc);
                    }
                }
            }
            Err(e) => {
                // The log holds what its own fold refuses: a journal entry taken twice says so
                // by its cause first.
                world.check_journals(journal, false).await?;
                return Err(Violation(format!("the log does not fold again: {e}")));
            }
        }
    }
    // Before the rows: a lost event leaves its rows unlike the fold too, and this says which.
    let acknowledged = world.acknowledged.lock().expect("not poisoned").clone();
    for (tenant, seq, id) in &acknowledged {
        match ids.get(&(*tenant, *seq)) {
            Some(found) if found == id => {}
            found => {
                return Err(Violation(format!(
                    "an acknowledged append is lost: event {id} at seq {seq} of {tenant}, the log has {found:?} there"
                )));
            }
        }
    }
    let stored: BTreeMap<RowKey, Value> =
        store.rows_all().await.expect("rows read").into_iter().map(|r| (r.key, r.doc)).collect();
    if stored.len() != state.len() || stored.iter().any(|(k, v)| state.get(k) != Some(v)) {
        let folded: BTreeMap<&RowKey, &Value> = state.iter().collect();
        let differs = stored
            .keys()
            .chain(folded.keys().copied())
            .find(|k| stored.get(*k) != folded.get(*k).copied())
            .map(|k| format!("{}/{}/{}", k.tenant, k.kind, k.id))
            .unwrap_or_default();
        return Err(Violation(format!(
            "the projections differ from a fold of the log ({} rows stored, {} folded; first at {differs})",
            stored.len(),
            folded.len()
        )));
    }
    oracle_check(world, oracle, &stored)?;
    world.check_checked_rows().await?;
    world.check_journals(journal, settled).await?;
    Ok((ids.len() as u64, acknowledged.len() as u64))
}

/// The projection rows the per-step checker reads (each node's allocations, the live
/// reservations' states) against the oracle's model of the log ([`crate::oracle`]), which is
/// not the fold: a fold wrong on the write path and in a replay alike is found here.
fn oracle_check(world: &World, oracle: &crate::oracle::Oracle, stored: &BTreeMap<RowKey, Value>) -> Result<(), Violation> {
    for tenant in &world.tenants {
        let id = tenant.id.to_string();
        let mut nodes: BTreeMap<String, BTreeMap<u32, String>> = BTreeMap::new();
        let mut live: BTreeMap<String, String> = BTreeMap::new();
        for (key, doc) in stored.range(RowKey { tenant: id.clone(), kind: String::new(), id: String::new() }..) {
            if key.tenant != id {
                break;
            }
            if key.kind == KIND_NODE {
                let allocations = doc["allocations"].as_object().into_iter().flatten();
                let held = allocations.filter_map(|(gpu, rsv)| Some((gpu.parse().ok()?, rsv.as_str()?.to_owned()))).collect();
                nodes.insert(key.id.clone(), held);
            } else if key.kind == KIND_RESERVATION_LIVE {
                live.insert(key.id.clone(), doc["state"].as_str().unwrap_or_default().to_owned());
            }
        }
        oracle
            .compare(tenant.id, &nodes, &live)
            .map_err(|e| Violation(format!("the projections differ from the oracle's model of the log: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(seed: u64) -> Options {
        Options {
            seed,
            nodes: 4,
            tenants: 2,
            hours: 1,
            faults: Fault::ALL.to_vec(),
            metal: None,
            unsafe_no_placement_guard: false,
            unsafe_no_journal_dedupe: false,
            unsafe_break: None,
            timeline: false,
        }
    }

    #[test]
    fn fault_lists_parse_by_name_and_the_command_names_them_back() {
        assert_eq!(Fault::parse_list("all").unwrap(), Fault::ALL);
        assert_eq!(Fault::parse_list("none").unwrap(), vec![]);
        assert_eq!(Fault::parse_list("agent-crash, failed-holds").unwrap(), vec![Fault::FailedHolds, Fault::AgentCrash]);
        assert!(Fault::parse_list("gremlins").unwrap_err().contains("stale-view"));
        let mut o = options(3);
        assert!(o.command().ends_with("--hours 1 --faults all"), "{}", o.command());
        o.faults = vec![Fault::ClockSkew];
        assert!(o.command().ends_with("--faults clock-skew"), "{}", o.command());
        o.metal = Some(0);
        assert!(o.command().ends_with("--faults clock-skew --metal 0"), "{}", o.command());
        o.unsafe_no_placement_guard = true;
        assert!(o.command().ends_with(" --unsafe-no-placement-guard"));
    }

    #[test]
    fn options_out_of_bounds_are_refused() {
        assert!(options(1).check().is_ok());
        assert!(Options { nodes: NODES_MAX + 1, ..options(1) }.check().is_err());
        assert!(Options { tenants: 5, ..options(1) }.check().unwrap_err().contains("every tenant needs a node"));
        assert!(Options { hours: 0, ..options(1) }.check().is_err());
        assert!(Options { hours: HOURS_MAX + 1, ..options(1) }.check().is_err());
        assert!(Options { metal: Some(METAL_MAX), ..options(1) }.check().is_ok());
        assert!(Options { metal: Some(METAL_MAX + 1), ..options(1) }.check().unwrap_err().contains("--metal"));
    }

    #[tokio::test]
    async fn the_same_seed_gives_the_same_digest_and_another_seed_another() {
        let (a, b, c) = (run(options(11)).await, run(options(11)).await, run(options(12)).await);
        for outcome in [&a, &b, &c] {
            assert!(outcome.violation.is_none(), "{:?}", outcome.violation);
            assert!(outcome.liveness_ms.is_some());
            assert!(outcome.full_checks > 1, "{} full checks", outcome.full_checks);
            assert_eq!(outcome.step_checks + outcome.quiet_steps, outcome.steps, "every step is checked or quiet");
            assert!(outcome.net.sessions >= 4 && outcome.net.messages > 1000, "{:?}", outcome.net);
            assert!(outcome.acknowledged_checked > 0, "the workload's appends were checked");
        }
        assert_eq!((a.digest.as_str(), &a.heads), (b.digest.as_str(), &b.heads));
        assert_ne!(a.digest, c.digest);
        assert!(a.nodes_joined > 0 && a.nodes_left > 0, "nodes joined and left during the run");
        assert!(a.nodes_deleted > 0, "nodes that left were deleted");
        assert!(a.timeline.is_none(), "no timeline unless asked");
    }

    #[tokio::test]
    async fn crashed_passes_gateway_restarts_and_failing_commits_keep_the_invariants_and_the_digest() {
        // The first seed from 9 that enables all three (each does with FAULT_ENABLED_P); every
        // run on the way must hold its invariants too.
        let mut found = None;
        for seed in 9..19 {
            println!("seed {seed}");
            let faults = vec![Fault::ReconcilerCrash, Fault::GatewayRestart, Fault::FailingCommits];
            let options = Options { faults, ..options(seed) };
            let a = run(options.clone()).await;
            assert!(a.violation.is_none(), "seed {seed}: {:?}", a.violation);
            if a.faults_enabled.len() == 3 {
                found = Some((options, a));
                break;
            }
        }
        let (options, a) = found.expect("a seed enables all three");
        let b = run(options).await;
        for fault in ["reconciler-crash", "gateway-restart", "failing-commits"] {
            assert!(a.faults_injected.get(fault).is_some_and(|n| *n > 0), "{fault}: {:?}", a.faults_injected);
        }
        assert!(a.passes_cut > 0, "a crash cut a pass short");
        assert!(a.liveness_ms.is_some() && a.full_checks > 1);
        assert_eq!((a.digest.as_str(), &a.heads, &a.faults_injected), (b.digest.as_str(), &b.heads, &b.faults_injected));
    }

    #[tokio::test]
    async fn failovers_that_lose_commit_answers_keep_the_invariants_and_the_digest() {
        // Every caller of the log meets answers lost after their commit was made: tenants ask
        // again under their key (and must get a replay), reconciler passes, agents' sessions,
        // the webhooks consumer and the metal reconciler decide again from the log. Beside the
        // other faults that touch commits, so a lost answer lands in the middle of theirs.
        let faults = vec![Fault::Failover];
        let mut retried = 0;
        let mut found = None;
        // Seed 4 left commands queued at the end until a join asked again was answered.
        for seed in 1..5 {
            println!("seed {seed}");
            let options = Options { faults: faults.clone(), nodes: 8, tenants: 2, ..options(seed) };
            let a = run(options.clone()).await;
            assert!(a.violation.is_none(), "seed {seed}: {:?}", a.violation);
            println!("  failovers {:?}, tenants' keyed retries {}", a.faults_injected.get("failover"), a.failover_retries);
            retried += a.failover_retries;
            if found.is_none() && a.faults_injected.get("failover").is_some_and(|n| *n > 0) {
                found = Some((options, a));
            }
        }
        assert!(retried > 0, "some tenant's answer was lost and asked again under its key");
        let (options, a) = found.expect("a seed injects a failover");
        let b = run(options).await;
        assert_eq!((a.digest.as_str(), &a.heads, &a.faults_injected), (b.digest.as_str(), &b.heads, &b.faults_injected));
    }

    #[tokio::test]
    async fn lost_delayed_duplicated_reordered_messages_and_partitions_keep_the_invariants_and_the_digest() {
        // The first seed from 33 that enables all five (seeds 21 to 32 passed too, and enable
        // fewer); every run on the way must hold.
        let faults =
            vec![Fault::DropMessages, Fault::DelayMessages, Fault::DuplicateMessages, Fault::ReorderMessages, Fault::Partition];
        let mut found = None;
        for seed in 33..53 {
            println!("seed {seed}");
            let options = Options { faults: faults.clone(), ..options(seed) };
            let a = run(options.clone()).await;
            assert!(a.violation.is_none(), "seed {seed}: {:?}", a.violation);
            if a.faults_enabled.len() == faults.len() {
                found = Some((options, a));
                break;
            }
        }
        let (options, a) = found.expect("a seed enables all five");
        println!("{}", a.to_json(&options));
        for fault in &faults {
            assert!(a.faults_injected.get(fault.name()).is_some_and(|n| *n > 0), "{}: {:?}", fault.name(), a.faults_injected);
        }
        let net = &a.net;
        assert!(net.dropped > 0 && net.delayed > 0 && net.duplicated > 0 && net.reordered > 0, "{net:?}");
        assert!(net.sessions > options.nodes as u64, "lost messages broke sessions, which began again: {net:?}");
        assert!(a.unreachable > 0, "a partition or a delay lapsed a lease: the liveness pass said so");
        assert!(a.liveness_ms.is_some() && a.full_checks > 1);
        let b = run(options).await;
        assert_eq!((a.digest.as_str(), &a.heads, a.steps), (b.digest.as_str(), &b.heads, b.steps));
    }

    #[tokio::test]
    async fn failing_receivers_retry_and_dead_letter_and_every_matched_event_settles() {
        // The first seed from 61 that enables it; every run on the way must hold too.
        let mut found = None;
        for seed in 61..71 {
            println!("seed {seed}");
            let options = Options { faults: vec![Fault::FailingReceivers, Fault::GatewayRestart], ..options(seed) };
            let a = run(options.clone()).await;
            assert!(a.violation.is_none(), "seed {seed}: {:?}", a.violation);
            if a.faults_enabled.contains(&"failing-receivers") {
                found = Some((options, a));
                break;
            }
        }
        let (options, a) = found.expect("a seed enables failing-receivers");
        println!("{}", a.to_json(&options));
        let hooks = &a.webhooks;
        assert!(hooks.subscriptions >= options.tenants as u64, "{hooks:?}");
        // Some made while the run went, the fan-out behind them: only what followed each one's
        // `webhook.created` was delivered to it (the check after every pass).
        assert!(hooks.subscribed_mid_run > 0, "{hooks:?}");
        assert!(a.faults_injected.get("failing-receivers").is_some_and(|n| *n > 0), "{:?}", a.faults_injected);
        assert_eq!(hooks.delivered + hooks.dead, hooks.matched, "every matched event settled: {hooks:?}");
        assert!(hooks.delivered > 0 && hooks.attempts > hooks.matched, "failures were retried: {hooks:?}");
        let b = run(options).await;
        assert_eq!((a.digest.as_str(), &a.heads, &a.webhooks), (b.digest.as_str(), &b.heads, &b.webhooks));
    }

    #[tokio::test]
    async fn hanging_bmcs_power_never_applied_and_systems_that_never_join_keep_the_metal_invariants_and_the_digest() {
        // The first seed from 96 that enables and injects all four; every run on the way must
        // hold too. (Seeds 81 to 99 hold and inject fewer, 2026-12-07: scanning them was two
        // minutes of the suite; the many-seeds e2e runs every fault.)
        let faults = vec![Fault::BmcHangs, Fault::PowerNeverApplies, Fault::DeployNeverJoins, Fault::BmcRefusesCredentials];
        let mut found = None;
        for seed in 96..116 {
            println!("seed {seed}");
            let options = Options { faults: faults.clone(), nodes: 30, tenants: 2, ..options(seed) };
            let a = run(options.clone()).await;
            assert!(a.violation.is_none(), "seed {seed}: {:?}", a.violation);
            if faults.iter().all(|f| a.faults_injected.get(f.name()).is_some_and(|n| *n > 0)) && a.metal.bmc_unauthorized > 0 {
                found = Some((options, a));
                break;
            }
        }
        let (options, a) = found.expect("a seed injects all four, and a BMC refuses a call");
        println!("{}", a.to_json(&options));
        let metal = &a.metal;
        assert_eq!(metal.machines, 2, "one machine for every {} nodes", metal::NODES_PER_MACHINE);
        assert!(metal.bmc_hangs > 0, "a call hung until its timeout: {metal:?}");
        assert!(metal.bmc_unauthorized > 0, "a BMC refused the credentials: {metal:?}");
        assert!(metal.moves > metal.verbs.values().sum::<u64>() / 2, "the moves were checked against the table: {metal:?}");
        assert!(metal.verbs.get("deploy").is_some_and(|n| *n > 0), "{metal:?}");
        assert!(metal.workflows.get("succeeded").is_some_and(|n| *n > 0), "{metal:?}");
        assert!(metal.workflows.get("failed").is_some_and(|n| *n > 0), "a fault failed a workflow: {metal:?}");
        assert!(a.liveness_ms.is_some() && a.full_checks > 1);
        let b = run(options).await;
        assert_eq!((a.digest.as_str(), &a.heads, &a.metal), (b.digest.as_str(), &b.heads, &b.metal));
    }

    #[tokio::test]
    async fn a_timeline_changes_nothing_the_run_decides() {
        let plain = run(options(11)).await;
        let recorded = run(Options { timeline: true, ..options(11) }).await;
        assert!(recorded.violation.is_none(), "{:?}", recorded.violation);
        assert_eq!(
            (plain.digest.as_str(), &plain.heads, plain.steps),
            (recorded.digest.as_str(), &recorded.heads, recorded.steps)
        );
        assert_eq!(plain.faults_injected, recorded.faults_injected);
        let timeline = recorded.timeline.expect("a timeline");
        let samples = timeline.samples();
        // One sample at the start and one after every pass or fault: about an hour of passes.
        assert!(samples.len() as u64 >= 3_600_000 / RECONCILE_EVERY_MS, "{}", samples.len());
        assert!(samples.iter().any(|s| s.gpu_utilization > 0.0), "GPUs were used");
        assert!(samples.iter().all(|s| s.nodes_up <= 4 + recorded.nodes_joined && (0.0..=1.0).contains(&s.gpu_utilization)));
        assert_eq!(samples.last().unwrap().checks, recorded.step_checks + recorded.full_checks);
        assert_eq!(samples.last().unwrap().faults, recorded.faults_injected.values().sum::<u64>());
        assert!(timeline.marks.iter().any(|m| m.kind == MarkKind::Liveness && m.at_ms == 3_600_000));
    }
}
