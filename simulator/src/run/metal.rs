//! Bare metal in `sim run`: the real `metal` reconciler (`bc_reconcilers::metal::Metal`, each
//! machine's turn as [`Metal::machine`] runs it, started by its real [`Scheduler`]) against
//! simulated BMCs ([`SimBmc`], the [`Bmc`] trait on the virtual clock, deterministic from the
//! seed), with operators moving machines through their lifecycle by the real
//! `decide::metal_verb`, and the installed system of a deploy joining as its node as `bcd join
//! --node-id` does (`node.joined` and `join_token.used`, guarded as the gateway's join guards
//! them).
//!
//! - **Machines**: one for every [`NODES_PER_MACHINE`] nodes (at least one), or `--metal N`
//!   (`0`: no bare metal at all), machine `i` tenant `i % T`'s, in a pool of their own
//!   (`metal-<t>`), so no reservation, rollout or drain of the GPU workload takes a node a
//!   deploy made.
//! - **Its own stream of the seed** ([`METAL_STREAM`]): the operators' verbs, the BMCs' power
//!   lag, the install times and the metal faults draw from it, so the rest of a run draws what
//!   it drew before.
//! - **BMCs**: a reset is applied 1 to 20 s later (seen at the next read); a power-on with the
//!   virtual CD inserted and a one-time boot from it boots the installer, whose system joins 1
//!   to 10 minutes later. A call that **hangs** parks the machine's turn until
//!   `bc_bmc::REQUEST_TIMEOUT_S` of simulated time has passed, then answers `Timeout`; other
//!   machines' turns run meanwhile, as in `MetalTurns`.
//! - **Faults** (`--faults`, each enabled from the metal stream with the run's probability):
//!   `bmc-hangs` (a BMC's every call hangs for 10 s to 3 minutes), `power-never-applies` (a
//!   BMC accepts resets and applies none for 30 s to 5 minutes), `deploy-never-joins` (a
//!   machine's next deploy installs a system whose agent never joins: the deploy fails at its
//!   deadline), `bmc-refuses-credentials` (a BMC answers every call 401 for 30 s to 10
//!   minutes: a workflow's step fails, a machine at rest goes into maintenance, its operator
//!   recovers it). Operators also retire machines now and then (a retired machine's cleaning
//!   ends in `manageable`, and nothing deploys it again).
//! - **Checks** at every activation of the reconciler, on the machines as it reads them
//!   ([`Sim::metal_docs_check`]), and after every turn ([`Sim::metal_bmc_check`]): every move of
//!   a machine in the log (`metal.transitioned`) is a row of the lifecycle table from where its
//!   last move left it, and its document rests where its last move left it
//!   ([`Sim::metal_moves_check`], [`table_allows`]); no BMC is asked two things at
//!   once (a second call while one is in flight: two turns of one machine); a stable state runs
//!   nothing but a power change and every other state runs a workflow (no wait without a
//!   deadline); every running workflow ends within its bound, derived from the lifecycle table
//!   (`MetalState::deadline_s` of the state it runs in, from its start, not the row's deadline)
//!   and [`BOUND_SLACK_MS`]; a machine `active` by a deploy had its deploy's token spent (its
//!   agent joined); and a deploy's join token does not outlive its deploy (spent or revoked once
//!   the machine left deploying). With the full checks ([`Sim::metal_rows_check`]): at most one
//!   running workflow per machine among the workflows' own rows, and it is the machine's.
//! - **Liveness**: faults and operators' verbs stop, the BMCs heal (a system that never joins
//!   stays so), the operators abort each wait as they find it (as they abort running
//!   rollouts), and every workflow must have ended ([`Sim::metal_unsettled`]) within the run's
//!   bound, which grows to the last running workflow's bound (and, for a teardown, the
//!   cleaning after it) when that is later.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use bc_agent::session::{Rng as _, SeededRng};
use bc_bmc::{Bmc, BmcConnector, BmcError, BmcResult, BmcTarget, BootSource, PowerState, ResetType, SystemInfo};
use bc_core::clock::{Clock, ManualClock};
use bc_core::id::{JoinTokenId, NodeId, PoolId, WorkflowId};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_projections::decide::{self, VerbInput};
use bc_projections::events as ev;
use bc_projections::metal::{MetalState, POWER_DEADLINE_S, Verb, WAIT_DEADLINE_S};
use bc_projections::workflow::{KIND_METAL, KIND_WORKFLOW, MetalBmc, MetalDoc, Workflow};
use bc_projections::{JoinTokenDoc, KIND_JOIN_TOKEN, KIND_NODE, KIND_POOL, NodeDoc, PoolDoc, stream_of};
use bc_reconcilers::metal::{Metal, Scheduler};
use tokio::sync::{mpsc, oneshot};

use super::{Break, Fault, RECONCILE_EVERY_MS, Sim, Task, between, exponential_ms};
use crate::world::{Violation, World, chance, injected, pick};

/// Mixed into the seed for bare metal's own stream.
pub const METAL_STREAM: u64 = 0x6d65_7461_6c6d_6574;
/// One machine for this many nodes (at least one).
pub const NODES_PER_MACHINE: usize = 25;
/// The mean time between an operator's verbs on one machine.
pub const ACTION_MEAN_MS: u64 = 300_000;
/// The mean time between metal faults while faults run.
pub const FAULT_MEAN_MS: u64 = 300_000;
/// A reset is applied this long after it is asked (seen at the next read).
pub const POWER_LAG_MS_MIN: u64 = 1_000;
pub const POWER_LAG_MS_MAX: u64 = 20_000;
/// A booted installer's system joins this long after the boot.
pub const INSTALL_MS_MIN: u64 = 60_000;
pub const INSTALL_MS_MAX: u64 = 600_000;
/// The windows of `bmc-hangs` and `power-never-applies`.
pub const HANG_MS_MIN: u64 = 10_000;
pub const HANG_MS_MAX: u64 = 180_000;
pub const NEVER_APPLIES_MS_MIN: u64 = 30_000;
pub const NEVER_APPLIES_MS_MAX: u64 = 300_000;
/// The window of `bmc-refuses-credentials`.
pub const REFUSES_CREDENTIALS_MS_MIN: u64 = 30_000;
pub const REFUSES_CREDENTIALS_MS_MAX: u64 = 600_000;
/// An operator's action on a machine at rest retires it with this probability (where the
/// lifecycle table has a retire row).
pub const RETIRE_P: f64 = 0.02;
/// How late past its deadline a workflow may still be running when an activation finds it (the
/// check reads the machines before the activation's turns): the pass that finds the deadline
/// passed comes up to a reconciler step late, its last look may hang for a whole request, its
/// append may fail (`failing-commits`) and be made at the next steps, and the check looks one
/// step before that step's turns.
pub const BOUND_SLACK_MS: u64 = 4 * RECONCILE_EVERY_MS + bc_bmc::REQUEST_TIMEOUT_S * 1000;
/// `--unsafe-break metal-deadline-ignored` hands the reconciler each machine with its workflow's
/// deadline this much later than the log's.
pub const BROKEN_DEADLINE_LATER_MS: u64 = 24 * 3_600_000;
/// The image a deploy and a rescue boot (the reconciler only passes its URL to the BMC).
const IMAGE_ID: &str = "img_sim";
const IMAGE_URL: &str = "https://images.sim.invalid/installer.iso";

/// What the metal part of a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetalCounts {
    pub machines: u64,
    /// Verbs the operators' appends landed, by verb.
    pub verbs: BTreeMap<String, u64>,
    /// Workflows that ended, by outcome (`succeeded`, `failed`, `aborted`).
    pub workflows: BTreeMap<String, u64>,
    /// BMC calls, and those that hung until their timeout.
    pub bmc_calls: u64,
    pub bmc_hangs: u64,
    /// BMC calls refused 401 (`bmc-refuses-credentials`).
    pub bmc_unauthorized: u64,
    /// Installed systems that joined as their node.
    pub joins: u64,
    /// Reconciler turns run, and steps recorded (`metal.step_done`).
    pub turns: u64,
    pub steps: u64,
    /// Machines' moves (`metal.transitioned`) checked against the lifecycle table.
    pub moves: u64,
}

impl MetalCounts {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "machines": self.machines,
            "verbs": self.verbs,
            "workflows": self.workflows,
            "bmcCalls": self.bmc_calls,
            "bmcHangs": self.bmc_hangs,
            "bmcUnauthorized": self.bmc_unauthorized,
            "joins": self.joins,
            "turns": self.turns,
            "steps": self.steps,
            "moves": self.moves,
        })
    }
}

/// One simulated BMC's machine.
#[derive(Debug)]
struct BmcState {
    index: usize,
    power: PowerState,
    /// A reset asked and when it applies.
    pending: Option<(PowerState, u64)>,
    boot_once: Option<BootSource>,
    media: Option<String>,
    /// `bmc-hangs`: every call hangs until then; `power-never-applies`: resets are dropped.
    hang_until: u64,
    never_applies_until: u64,
    /// `bmc-refuses-credentials`: every call is refused 401 until then.
    refusing_until: u64,
    /// Calls answered or hanging now (more than one: two operations at once).
    in_flight: u32,
    /// The call in flight, named.
    doing: Option<&'static str>,
}

impl BmcState {
    /// Machine `index`'s BMC as enrolled: powered off, nothing asked, no fault.
    fn off(index: usize) -> Self {
        Self {
            index,
            power: PowerState::Off,
            pending: None,
            boot_once: None,
            media: None,
            hang_until: 0,
            never_applies_until: 0,
            refusing_until: 0,
            in_flight: 0,
            doing: None,
        }
    }
}

/// What every simulated BMC shares: the clock, the stream their power lag draws from, and what
/// the run reads back after a turn (installers booted, calls made at once).
struct Bmcs {
    clock: Arc<ManualClock>,
    rng: SeededRng,
    by_address: BTreeMap<String, BmcState>,
    /// Machines whose installer booted, and when.
    booted: Vec<(usize, u64)>,
    /// Two operations at once on one BMC.
    conflicts: Vec<String>,
    calls: u64,
    hangs: u64,
    refused: u64,
}

type Shared = Arc<Mutex<Bmcs>>;

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Bmcs> {
    shared.lock().unwrap_or_else(|p| p.into_inner())
}

/// A turn parked on a hanging call: the machine, when its call times out, and the call's answer.
type ParkedCall = (usize, u64, oneshot::Sender<()>);

/// One machine's BMC, as the reconciler holds it.
struct SimBmc {
    shared: Shared,
    address: String,
    parked: mpsc::UnboundedSender<ParkedCall>,
}

impl SimBmc {
    /// Runs `f` on the machine as one call: counted in flight while it runs; a hanging BMC parks
    /// the call until its timeout, on the virtual clock.
    async fn call<T: Send>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut BmcState, u64, &mut SeededRng) -> T + Send,
    ) -> BmcResult<T> {
        let (hang, index, due, refused) = {
            let mut bmcs = lock(&self.shared);
            bmcs.calls += 1;
            let now = bmcs.clock.now_ms();
            let Some(state) = bmcs.by_address.get_mut(&self.address) else {
                return Err(BmcError::Unreachable(format!("no BMC at {}", self.address)));
            };
            state.in_flight += 1;
            let conflict = (state.in_flight > 1).then(|| {
                format!("{what} while {} was in flight on the BMC of machine {}", state.doing.unwrap_or("?"), state.index)
            });
            state.doing = Some(what);
            let hang = now < state.hang_until;
            let refused = !hang && now < state.refusing_until;
            let index = state.index;
            if let Some(conflict) = conflict {
                bmcs.conflicts.push(conflict);
            }
            if hang {
                bmcs.hangs += 1;
            }
            if refused {
                bmcs.refused += 1;
            }
            (hang, index, now + bc_bmc::REQUEST_TIMEOUT_S * 1000, refused)
        };
        if refused {
            let mut bmcs = lock(&self.shared);
            if let Some(state) = bmcs.by_address.get_mut(&self.address) {
                state.in_flight -= 1;
                state.doing = None;
            }
            return Err(BmcError::Unauthorized(format!("HTTP 401 from the BMC of machine {index}")));
        }
        if hang {
            let (answer, answered) = oneshot::channel();
            // The run keeps the receiving end for as long as it runs.
            let _ = self.parked.send((index, due, answer));
            let _ = answered.await;
            let mut bmcs = lock(&self.shared);
            if let Some(state) = bmcs.by_address.get_mut(&self.address) {
                state.in_flight -= 1;
                state.doing = None;
            }
            return Err(BmcError::Timeout(format!("no answer in {} s", bc_bmc::REQUEST_TIMEOUT_S)));
        }
        let mut bmcs = lock(&self.shared);
        let now = bmcs.clock.now_ms();
        let Bmcs { rng, by_address, booted, .. } = &mut *bmcs;
        let state = by_address.get_mut(&self.address).expect("the machine is there");
        // A reset applied by now is what this call sees.
        if let Some((want, at)) = state.pending
            && now >= at
        {
            state.power = want;
            state.pending = None;
            if want == PowerState::On {
                if state.boot_once == Some(BootSource::Cd) && state.media.is_some() {
                    booted.push((state.index, at));
                }
                state.boot_once = None;
            }
        }
        let out = f(state, now, rng);
        state.in_flight -= 1;
        state.doing = None;
        Ok(out)
    }
}

#[async_trait::async_trait]
impl Bmc for SimBmc {
    async fn system(&self) -> BmcResult<SystemInfo> {
        self.call("system", |state, _, _| SystemInfo {
            power_state: Some(match state.pending {
                Some((PowerState::On, _)) if state.power == PowerState::Off => PowerState::PoweringOn,
                Some((PowerState::Off, _)) if state.power == PowerState::On => PowerState::PoweringOff,
                _ => state.power,
            }),
            manufacturer: Some("Sim".into()),
            model: Some("sim-bmc".into()),
            serial_number: Some(format!("SIM-{:04}", state.index)),
            uuid: None,
            processor_count: Some(2),
            memory_gib: Some(64),
            boot_once: state.boot_once,
            media_image: state.media.clone(),
        })
        .await
    }

    async fn reset(&self, reset: ResetType) -> BmcResult<()> {
        self.call("reset", |state, now, rng| {
            if now < state.never_applies_until {
                return;
            }
            let want = match reset {
                ResetType::On | ResetType::ForceRestart => PowerState::On,
                ResetType::ForceOff | ResetType::GracefulShutdown => PowerState::Off,
            };
            if reset == ResetType::ForceRestart || state.power != want {
                state.pending = Some((want, now + between(rng, POWER_LAG_MS_MIN, POWER_LAG_MS_MAX)));
            }
        })
        .await
    }

    async fn set_boot_once(&self, source: BootSource) -> BmcResult<()> {
        self.call("set-boot-once", |state, _, _| state.boot_once = Some(source)).await
    }

    async fn insert_media(&self, image_url: &str) -> BmcResult<()> {
        let url = image_url.to_owned();
        self.call("insert-media", move |state, _, _| state.media = Some(url)).await
    }

    async fn eject_media(&self) -> BmcResult<()> {
        self.call("eject-media", |state, _, _| state.media = None).await
    }
}

/// Hands the reconciler the simulated BMC at a target's address.
struct SimConnector {
    shared: Shared,
    parked: mpsc::UnboundedSender<ParkedCall>,
}

impl BmcConnector for SimConnector {
    fn connect(&self, target: &BmcTarget) -> BmcResult<Arc<dyn Bmc>> {
        let address = target.address.as_str().trim_end_matches('/').to_owned();
        Ok(Arc::new(SimBmc { shared: self.shared.clone(), address, parked: self.parked.clone() }))
    }
}

/// One enrolled machine.
pub(super) struct Machine {
    pub tenant: usize,
    pub node: String,
    /// Its running (or last) deploy installs a system that never joins; its next deploy will
    /// (`deploy-never-joins`).
    pub never_joins: bool,
    pub never_joins_next: bool,
}

/// A turn parked on a hanging call.
struct Parked {
    turn: Pin<Box<dyn Future<Output = bc_reconcilers::metal::Pass> + Send>>,
    answer: Option<oneshot::Sender<()>>,
}

/// Bare metal's part of the run.
pub(super) struct SimMetal {
    metal: Arc<Metal>,
    scheduler: Scheduler,
    shared: Shared,
    parked_tx: mpsc::UnboundedSender<ParkedCall>,
    parked_rx: mpsc::UnboundedReceiver<ParkedCall>,
    parked: BTreeMap<usize, Parked>,
    pub machines: Vec<Machine>,
    pub rng: SeededRng,
    /// The metal faults the stream enabled, with their weights.
    pub enabled: BTreeMap<Fault, f64>,
    pub counts: MetalCounts,
    /// `--unsafe-break metal-deadline-ignored`.
    broken_deadline: bool,
    /// Deploys' join tokens found spent or revoked (for good): the check reads them no more.
    tokens_final: BTreeSet<String>,
    /// Each machine's moves as the log has them, checked against the lifecycle table up to a
    /// version of its stream ([`Sim::metal_moves_check`]).
    moves: BTreeMap<String, Moves>,
}

/// A machine's moves checked so far: up to `version` of its stream, ending in `state`.
#[derive(Clone, Copy, Debug)]
struct Moves {
    version: u64,
    state: MetalState,
    retired: bool,
}

/// One `metal.transitioned`, `from` → `to` by `verb`, against the lifecycle table
/// (`bc_projections::metal::TRANSITIONS`, read here as data, apart from the fold and the
/// decision): it must start where the machine's last move ended (`at`), name a row of the table,
/// and end where that row goes (`to_if_retired` on a machine retired before). The state it
/// leaves the machine in, or what is wrong with it.
pub fn table_allows(at: MetalState, retired: bool, verb: &str, from: &str, to: &str) -> Result<MetalState, String> {
    let state = |text: &str| bc_projections::metal::STATES.iter().copied().find(|s| s.as_str() == text);
    let (Some(from), Some(to)) = (state(from), state(to)) else {
        return Err(format!("moved from {from:?} to {to:?}, a state the lifecycle table does not have"));
    };
    let Some(verb) = Verb::ALL.iter().copied().find(|v| v.as_str() == verb) else {
        return Err(format!("moved by {verb:?}, a verb the lifecycle table does not have"));
    };
    if from != at {
        return Err(format!("moved from {from} by {verb}, but its last move left it in {at}"));
    }
    let Some(row) = bc_projections::metal::TRANSITIONS.iter().find(|r| r.from == from && r.verb == verb) else {
        return Err(format!("moved from {from} by {verb}, which the lifecycle table does not allow"));
    };
    let expected = if retired { row.to_if_retired.unwrap_or(row.to) } else { row.to };
    if to != expected {
        return Err(format!("moved from {from} by {verb} to {to}, where the lifecycle table goes to {expected}"));
    }
    Ok(to)
}

/// The bound of a running workflow, from the lifecycle table: the deadline of the state it runs
/// in (a power change in a stable state: its own), from its start, and [`BOUND_SLACK_MS`].
pub fn workflow_bound_ms(state: MetalState, workflow: &Workflow) -> u64 {
    let deadline_s = state.deadline_s().unwrap_or(POWER_DEADLINE_S * 2);
    workflow.started_at_ms + deadline_s * 1000 + BOUND_SLACK_MS
}

fn metal_faults() -> [Fault; 4] {
    [Fault::BmcHangs, Fault::PowerNeverApplies, Fault::DeployNeverJoins, Fault::BmcRefusesCredentials]
}

impl SimMetal {
    fn reconciler(world: &World, shared: &Shared, parked: &mpsc::UnboundedSender<ParkedCall>) -> Arc<Metal> {
        let connector = Arc::new(SimConnector { shared: shared.clone(), parked: parked.clone() });
        Arc::new(Metal::new(world.log.clone(), world.clock.clone(), connector))
    }

    /// The reconciler again on the world's new log (a gateway restart: the process's turns die
    /// with it, and their hanging calls; each step is safe to run again).
    pub fn restart(&mut self, world: &World) {
        self.parked.clear();
        while self.parked_rx.try_recv().is_ok() {}
        for state in lock(&self.shared).by_address.values_mut() {
            state.in_flight = 0;
            state.doing = None;
        }
        self.metal = Self::reconciler(world, &self.shared, &self.parked_tx);
        self.scheduler = Scheduler::default();
    }
}

fn address(m: usize) -> String {
    format!("https://bmc-{m}.sim.invalid")
}

impl Sim {
    /// Enrolls the machines (a pool of their own per tenant that has one), each powered off,
    /// and schedules their operators and the metal faults.
    pub(super) async fn metal_start(&mut self) {
        let count = self.options.metal_machines();
        if count == 0 {
            // `--metal 0`: no machine, no metal fault.
            return;
        }
        let faults = self.options.faults.clone();
        let mut rng = SeededRng(self.options.seed ^ METAL_STREAM);
        let mut enabled = BTreeMap::new();
        for fault in metal_faults() {
            if faults.contains(&fault)
                && (chance(&mut rng, super::FAULT_ENABLED_P) || self.options.unsafe_break == Some(Break::MetalDeadlineIgnored))
            {
                enabled.insert(fault, 0.1 + 0.4 * rng.next_unit());
            }
        }
        self.out.faults_enabled.extend(enabled.keys().map(|f| f.name()));
        let shared: Shared = Arc::new(Mutex::new(Bmcs {
            clock: self.world.clock.clone(),
            rng: SeededRng(self.options.seed ^ METAL_STREAM ^ 1),
            by_address: BTreeMap::new(),
            booted: vec![],
            conflicts: vec![],
            calls: 0,
            hangs: 0,
            refused: 0,
        }));
        let (parked_tx, parked_rx) = mpsc::unbounded_channel();
        let metal = SimMetal::reconciler(&self.world, &shared, &parked_tx);
        let mut pools: BTreeMap<usize, String> = BTreeMap::new();
        let mut machines = Vec::new();
        let now = self.world.now_ms();
        for m in 0..count {
            let t = m % self.options.tenants;
            let tenant = self.world.tenants[t].id;
            let pool_id = match pools.get(&t) {
                Some(pool) => pool.clone(),
                None => {
                    let pool = PoolId::from_ulid(self.world.log.ids.ulid()).to_string();
                    let created = ev::PoolCreated {
                        name: format!("metal-{t}"),
                        description: "the simulated bare-metal machines".into(),
                        labels: Default::default(),
                        max_reservation_s: None,
                        site_id: None,
                    };
                    let event = NewEvent::new(ev::POOL_CREATED, ev::to_cbor(&created).expect("cbor"));
                    let request =
                        AppendRequest::new(tenant, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, "sim", vec![event]);
                    self.world.append_acknowledged(request).await.expect("the metal pool is created");
                    pools.insert(t, pool.clone());
                    pool
                }
            };
            let node = NodeId::from_ulid(self.world.log.ids.ulid()).to_string();
            let secret_id = format!("bmc_{node}");
            self.world.store.secret_put(tenant, &secret_id, "sim-bmc-password", now).await.expect("the password is sealed");
            let enrolled = ev::MetalEnrolled {
                pool_id,
                name: format!("metal-{m}"),
                site_id: None,
                bmc: MetalBmc {
                    address: address(m),
                    system_path: None,
                    username: "admin".into(),
                    tls: "insecure".into(),
                    ca_pem: None,
                    pin: None,
                    secret_id,
                },
            };
            let event = NewEvent::new(ev::METAL_ENROLLED, ev::to_cbor(&enrolled).expect("cbor"));
            let request = AppendRequest::new(tenant, stream_of(KIND_METAL, &node), ExpectedVersion::NoStream, "sim", vec![event]);
            self.world.append_acknowledged(request).await.expect("the machine is enrolled");
            lock(&shared).by_address.insert(address(m), BmcState::off(m));
            machines.push(Machine { tenant: t, node, never_joins: false, never_joins_next: false });
        }
        for m in 0..count {
            let first = exponential_ms(&mut rng, ACTION_MEAN_MS as f64);
            self.after(first, Task::MetalAction(m));
        }
        if !enabled.is_empty() {
            let first = exponential_ms(&mut rng, FAULT_MEAN_MS as f64);
            self.after(first, Task::MetalFault);
        }
        self.metal = Some(SimMetal {
            metal,
            scheduler: Scheduler::default(),
            shared,
            parked_tx,
            parked_rx,
            parked: BTreeMap::new(),
            counts: MetalCounts { machines: count as u64, ..MetalCounts::default() },
            machines,
            rng,
            enabled,
            broken_deadline: self.options.unsafe_break == Some(Break::MetalDeadlineIgnored),
            tokens_final: BTreeSet::new(),
            moves: BTreeMap::new(),
        });
    }

    /// Every machine of every tenant that has machines, as the reconciler reads them (by
    /// tenant index).
    async fn metal_docs(&self) -> BTreeMap<usize, Vec<MetalDoc>> {
        let mut all = BTreeMap::new();
        let Some(metal) = self.metal.as_ref() else { return all };
        let tenants: BTreeSet<usize> = metal.machines.iter().map(|m| m.tenant).collect();
        for t in tenants {
            all.insert(t, self.world.rows(t, KIND_METAL).await);
        }
        all
    }

    /// The metal reconciler's activation at the run's reconciler step: the scheduler reads
    /// every machine and starts a turn for each it lets start; each turn runs to its end, or
    /// parks on a hanging call (its slot held until the call times out).
    pub(super) async fn metal_pass(&mut self) -> Result<(), Violation> {
        let Some(metal) = self.metal.as_ref() else { return Ok(()) };
        let broken = metal.broken_deadline;
        if !self.workload_running {
            self.metal_abort_waits().await?;
        }
        let docs = self.metal_docs().await;
        // The machines as this activation finds them: checked before its turns.
        self.metal_docs_check(&docs).await?;
        let mut docs: BTreeMap<String, Vec<MetalDoc>> =
            docs.into_iter().map(|(t, docs)| (self.world.tenants[t].id.to_string(), docs)).collect();
        if broken {
            // TEST ONLY: what the reconciler reads says every workflow ends a day later.
            for doc in docs.values_mut().flatten() {
                if let Some(w) = doc.workflow.as_mut().filter(|w| w.is_running()) {
                    w.deadline_at_ms += BROKEN_DEADLINE_LATER_MS;
                }
            }
        }
        self.metal.as_mut().expect("metal").scheduler.read(docs);
        self.metal_start_turns().await;
        self.metal_after().await
    }

    /// Runs a machine's turn until it ends (its slot freed) or parks on a hanging call (the
    /// call's timeout scheduled).
    async fn metal_turn(&mut self, index: usize, mut parked: Parked) {
        let metal = self.metal.as_mut().expect("metal");
        if let Some(answer) = parked.answer.take() {
            let _ = answer.send(());
        }
        let ended = tokio::select! {
            biased;
            pass = &mut parked.turn => Ok(pass),
            Some((at, due, answer)) = metal.parked_rx.recv() => {
                debug_assert_eq!(at, index, "only the turn running parks");
                Err((due, answer))
            }
        };
        let metal = self.metal.as_mut().expect("metal");
        match ended {
            Ok(pass) => {
                metal.counts.turns += 1;
                metal.counts.steps += pass.steps as u64;
                let machine = &metal.machines[index];
                let tenant = self.world.tenants[machine.tenant].id.to_string();
                metal.scheduler.finished(&tenant, &machine.node);
            }
            Err((due, answer)) => {
                parked.answer = Some(answer);
                metal.parked.insert(index, parked);
                self.schedule(due, Task::BmcAnswer(index));
            }
        }
    }

    /// Starts a turn for each machine the scheduler lets start now, until none is left.
    async fn metal_start_turns(&mut self) {
        loop {
            let metal = self.metal.as_mut().expect("metal");
            let started = metal.scheduler.start();
            if started.is_empty() {
                return;
            }
            for doc in started {
                let metal = self.metal.as_mut().expect("metal");
                let reconciler = metal.metal.clone();
                let index = metal.machines.iter().position(|m| m.node == doc.node_id).expect("a machine of the run");
                let turn: Pin<Box<dyn Future<Output = bc_reconcilers::metal::Pass> + Send>> =
                    Box::pin(async move { reconciler.machine(doc).await });
                self.metal_turn(index, Parked { turn, answer: None }).await;
            }
        }
    }

    /// A hanging call of machine `m` times out: its turn goes on, and the scheduler starts the
    /// machines waiting for a slot.
    pub(super) async fn metal_answer(&mut self, m: usize) -> Result<(), Violation> {
        let Some(metal) = self.metal.as_mut() else { return Ok(()) };
        let Some(parked) = metal.parked.remove(&m) else { return Ok(()) };
        self.metal_turn(m, parked).await;
        self.metal_start_turns().await;
        self.metal_after().await
    }

    /// After metal's turns: the installers that booted get their join scheduled; no BMC was
    /// asked two things at once.
    async fn metal_after(&mut self) -> Result<(), Violation> {
        let metal = self.metal.as_mut().expect("metal");
        let booted = std::mem::take(&mut lock(&metal.shared).booted);
        let installs: Vec<(usize, u64)> =
            booted.into_iter().map(|(m, at)| (m, at + between(&mut metal.rng, INSTALL_MS_MIN, INSTALL_MS_MAX))).collect();
        for (m, at) in installs {
            self.schedule(at, Task::MetalInstalled(m));
        }
        self.metal_bmc_check()
    }

    /// Machine `m`'s installed system has booted: its agent joins as the machine's node with
    /// the running deploy's token (`bcd join --node-id`), unless the deploy is one whose agent
    /// never joins, the deploy is over, or the token is no longer usable (the join is refused).
    pub(super) async fn metal_installed(&mut self, m: usize) -> Result<(), Violation> {
        let Some(metal) = self.metal.as_mut() else { return Ok(()) };
        let (t, node) = (metal.machines[m].tenant, metal.machines[m].node.clone());
        if metal.machines[m].never_joins {
            return Ok(());
        }
        let Some(doc) = self.world.doc::<MetalDoc>(t, KIND_METAL, &node).await else { return Ok(()) };
        let Some(token_id) = doc.running().filter(|w| w.verb == "deploy").and_then(|w| w.join_token_id.clone()) else {
            return Ok(());
        };
        let Some(token) = self.world.doc::<JoinTokenDoc>(t, KIND_JOIN_TOKEN, &token_id).await else { return Ok(()) };
        if token.revoked || token.uses >= token.uses_max || self.world.now_ms() >= token.expires_at_ms {
            return Ok(());
        }
        let Some(pool) = self.world.doc::<PoolDoc>(t, KIND_POOL, &token.pool_id).await else { return Ok(()) };
        let existing = self.world.doc::<NodeDoc>(t, KIND_NODE, &node).await;
        let expected = existing.as_ref().map_or(ExpectedVersion::NoStream, |n| ExpectedVersion::Exact(n.version));
        let key = ed25519_dalek::SigningKey::from_bytes(&crate::world::seed_bytes(&mut metal.rng));
        let joined = ev::NodeJoined {
            pool_id: token.pool_id.clone(),
            name: format!("metal-{m}"),
            gpus: vec![],
            labels: Default::default(),
            public_key: bc_core::agent::b64(key.verifying_key().as_bytes()),
            join_token_id: token_id.clone(),
            agent_version: "sim".into(),
            hostname: format!("metal-{m}"),
            gpu_uuids: vec![],
            tpm: None,
        };
        let token_stream = stream_of(KIND_JOIN_TOKEN, &token_id);
        let mut spend =
            NewEvent::new(ev::JOIN_TOKEN_USED, ev::to_cbor(&ev::JoinTokenUsed { node_id: node.clone() }).expect("cbor"));
        spend.stream = Some(token_stream.clone());
        let mut request = AppendRequest::new(
            self.world.tenants[t].id,
            stream_of(KIND_NODE, &node),
            expected,
            format!("join_token:{token_id}"),
            vec![NewEvent::new(ev::NODE_JOINED, ev::to_cbor(&joined).expect("cbor")), spend],
        );
        request.guards = vec![
            (token_stream, ExpectedVersion::Exact(token.version)),
            (stream_of(KIND_POOL, &token.pool_id), ExpectedVersion::Exact(pool.version)),
        ];
        match self.world.append_acknowledged(request).await {
            Ok(_) => {
                self.metal.as_mut().expect("metal").counts.joins += 1;
            }
            // The installed system tries again (a failed commit, a race): a minute later.
            Err(e) if injected(&e) || e.code() == bc_core::ErrorCode::Conflict => {
                self.after(60_000, Task::MetalInstalled(m));
            }
            Err(e) => return Err(Violation(format!("the join of metal machine {node}: {e}"))),
        }
        // What it changed is checked at the next activation.
        Ok(())
    }

    /// An operator's next verb on machine `m`, toward a deploy and back, decided by the real
    /// `decide::metal_verb` on the machine's document.
    pub(super) async fn metal_action(&mut self, m: usize) -> Result<(), Violation> {
        if !self.workload_running {
            return Ok(());
        }
        let Some(metal) = self.metal.as_mut() else { return Ok(()) };
        let next = exponential_ms(&mut metal.rng, ACTION_MEAN_MS as f64);
        let (t, node) = (metal.machines[m].tenant, metal.machines[m].node.clone());
        self.after(next, Task::MetalAction(m));
        let Some(doc) = self.world.doc::<MetalDoc>(t, KIND_METAL, &node).await else { return Ok(()) };
        let metal = self.metal.as_mut().expect("metal");
        let roll = metal.rng.next_unit();
        let power = |p: &'static str| (Verb::Power, Some(p));
        let (verb, power) = if doc.flags.maintenance.is_some() {
            (Verb::Recover, None)
        } else if doc.running().is_some() {
            // A wait may be aborted now and then.
            if roll < 0.05 { (Verb::Abort, None) } else { return Ok(()) }
        } else if !doc.flags.retired
            && metal.rng.next_unit() < RETIRE_P
            && table_allows(doc.state, false, "retire", doc.state.as_str(), doc.state.as_str()).is_ok()
        {
            // Now and then an operator takes a machine out of service for good (a retired
            // machine's cleaning ends in manageable; nothing deploys it again).
            (Verb::Retire, None)
        } else {
            match doc.state {
                MetalState::Enroll | MetalState::InspectFailed | MetalState::CleanFailed => (Verb::Manage, None),
                MetalState::Manageable if roll < 0.3 => (Verb::Inspect, None),
                MetalState::Manageable => (Verb::Provide, None),
                MetalState::Available if roll < 0.15 => power(if roll < 0.075 { "on" } else { "off" }),
                MetalState::Available => (Verb::Deploy, None),
                MetalState::Active if roll < 0.4 => (Verb::Undeploy, None),
                MetalState::Active if roll < 0.55 => power("reboot"),
                MetalState::Active if roll < 0.65 => (Verb::Rescue, None),
                MetalState::Active => return Ok(()),
                MetalState::DeployFailed if roll < 0.5 => (Verb::Deploy, None),
                MetalState::DeployFailed | MetalState::Error | MetalState::RescueFailed => (Verb::Undeploy, None),
                MetalState::Rescue | MetalState::UnrescueFailed => (Verb::Unrescue, None),
                _ => return Ok(()),
            }
        };
        let workflow_id = WorkflowId::from_ulid(self.world.log.ids.ulid()).to_string();
        let token_id = (verb == Verb::Deploy).then(|| JoinTokenId::from_ulid(self.world.log.ids.ulid()).to_string());
        let input = VerbInput {
            now_ms: self.world.now_ms(),
            workflow_id: &workflow_id,
            image: matches!(verb, Verb::Deploy | Verb::Rescue).then_some((IMAGE_ID, IMAGE_URL)),
            join_token_id: token_id.as_deref(),
            power,
            if_version: None,
        };
        let Ok(mut append) = decide::metal_verb(&doc, verb, &input) else { return Ok(()) };
        if verb == Verb::Undeploy
            && let Some(node) = self.world.doc::<NodeDoc>(t, KIND_NODE, &node).await
        {
            // As `metal.undeploy`: the node is cordoned in the same append.
            let stream = stream_of(KIND_NODE, &node.node_id);
            if !node.cordoned {
                let mut cordon = NewEvent::new(ev::NODE_CORDONED, ev::to_cbor(&ev::NodeStateChanged {}).expect("cbor"));
                cordon.stream = Some(stream.clone());
                append.events.push(cordon);
            }
            append.guards.push((stream, ExpectedVersion::Exact(node.version)));
        }
        let tenant = self.world.tenants[t].id;
        match self.world.append_acknowledged(append.into_request(tenant, "sim-operator")).await {
            Ok(_) => {
                let metal = self.metal.as_mut().expect("metal");
                *metal.counts.verbs.entry(verb.as_str().to_owned()).or_default() += 1;
                if verb == Verb::Deploy {
                    // This deploy's system joins, or never does (`deploy-never-joins`, or always
                    // under `--unsafe-break metal-deadline-ignored`).
                    let machine = &mut metal.machines[m];
                    machine.never_joins = std::mem::take(&mut machine.never_joins_next) || metal.broken_deadline;
                }
            }
            Err(e) if injected(&e) || e.code() == bc_core::ErrorCode::Conflict => {}
            Err(e) => return Err(Violation(format!("the operator's {verb} of metal machine {node}: {e}"))),
        }
        // What it changed is checked at the next activation.
        Ok(())
    }

    /// One metal fault on a machine drawn from the metal stream.
    pub(super) fn metal_fault(&mut self) {
        if !self.faults_running {
            return;
        }
        let Some(metal) = self.metal.as_mut() else { return };
        let next = exponential_ms(&mut metal.rng, FAULT_MEAN_MS as f64);
        let kinds: Vec<(Fault, f64)> = metal.enabled.iter().map(|(f, p)| (*f, *p)).collect();
        let total: f64 = kinds.iter().map(|(_, p)| p).sum();
        let mut roll = metal.rng.next_unit() * total;
        let mut fault = kinds[kinds.len() - 1].0;
        for (f, p) in &kinds {
            if roll < *p {
                fault = *f;
                break;
            }
            roll -= p;
        }
        let m = pick(&mut metal.rng, metal.machines.len());
        let now = self.world.now_ms();
        match fault {
            Fault::BmcHangs => {
                let until = now + between(&mut metal.rng, HANG_MS_MIN, HANG_MS_MAX);
                let mut bmcs = lock(&metal.shared);
                let state = bmcs.by_address.get_mut(&address(m)).expect("its BMC");
                state.hang_until = state.hang_until.max(until);
            }
            Fault::PowerNeverApplies => {
                let until = now + between(&mut metal.rng, NEVER_APPLIES_MS_MIN, NEVER_APPLIES_MS_MAX);
                let mut bmcs = lock(&metal.shared);
                let state = bmcs.by_address.get_mut(&address(m)).expect("its BMC");
                state.never_applies_until = state.never_applies_until.max(until);
                // A reset asked already is lost too.
                state.pending = None;
            }
            Fault::BmcRefusesCredentials => {
                let until = now + between(&mut metal.rng, REFUSES_CREDENTIALS_MS_MIN, REFUSES_CREDENTIALS_MS_MAX);
                let mut bmcs = lock(&metal.shared);
                let state = bmcs.by_address.get_mut(&address(m)).expect("its BMC");
                state.refusing_until = state.refusing_until.max(until);
            }
            _ => metal.machines[m].never_joins_next = true,
        }
        self.injected(fault);
        self.after(next, Task::MetalFault);
    }

    /// The liveness phase begins: operators and faults stop, every BMC answers and applies
    /// power again (a system that never joins stays so). The bound by which every workflow
    /// running now must have ended (ms from now; 0: none runs).
    pub(super) async fn metal_heal(&mut self) -> u64 {
        let Some(metal) = self.metal.as_mut() else { return 0 };
        for state in lock(&metal.shared).by_address.values_mut() {
            state.hang_until = 0;
            state.never_applies_until = 0;
            state.refusing_until = 0;
        }
        let now = self.world.now_ms();
        let mut last = 0;
        for docs in self.metal_docs().await.values() {
            for doc in docs {
                let Some(w) = doc.running() else { continue };
                let mut bound = workflow_bound_ms(doc.state, w);
                if doc.state == MetalState::Deleting {
                    // The cleaning that follows a teardown runs a workflow of its own.
                    bound += WAIT_DEADLINE_S * 1000 + BOUND_SLACK_MS;
                }
                last = last.max(bound);
            }
        }
        last.saturating_sub(now)
    }

    /// In the liveness phase, before each activation: the operators abort every workflow that
    /// waits on its machine (a deploy's installed system, an inspection, a cleaning, a rescue),
    /// as they abort the rollouts still running. What needs only the BMCs (healed) runs to its
    /// end; the deadlines were checked while the faults ran.
    async fn metal_abort_waits(&mut self) -> Result<(), Violation> {
        for (t, docs) in self.metal_docs().await {
            let tenant = self.world.tenants[t].id;
            for doc in docs {
                let waits = matches!(
                    doc.state,
                    MetalState::InspectWait | MetalState::CleanWait | MetalState::DeployWait | MetalState::RescueWait
                );
                if !waits || doc.running().is_none() {
                    continue;
                }
                let input = VerbInput { now_ms: self.world.now_ms(), ..VerbInput::default() };
                let Ok(append) = decide::metal_verb(&doc, Verb::Abort, &input) else { continue };
                match self.world.append_acknowledged(append.into_request(tenant, "sim-operator")).await {
                    Ok(_) => {
                        let metal = self.metal.as_mut().expect("metal");
                        *metal.counts.verbs.entry(Verb::Abort.as_str().to_owned()).or_default() += 1;
                    }
                    Err(e) if injected(&e) || e.code() == bc_core::ErrorCode::Conflict => {}
                    Err(e) => return Err(Violation(format!("the operator's abort on metal machine {}: {e}", doc.node_id))),
                }
            }
        }
        Ok(())
    }

    /// What keeps bare metal from being settled: a workflow still running.
    pub(super) async fn metal_unsettled(&self) -> Option<String> {
        self.metal.as_ref()?;
        for docs in self.metal_docs().await.values() {
            if let Some(doc) = docs.iter().find(|d| d.running().is_some()) {
                let w = doc.running().expect("running");
                return Some(format!(
                    "metal machine {} ({}) still runs workflow {} ({}, at step {})",
                    doc.node_id,
                    doc.state,
                    w.workflow_id,
                    w.verb,
                    w.current().map_or("none", |s| s.as_str())
                ));
            }
        }
        None
    }

    /// No BMC was asked two things at once (a second call while one was in flight).
    fn metal_bmc_check(&mut self) -> Result<(), Violation> {
        let Some(metal) = self.metal.as_mut() else { return Ok(()) };
        let mut bmcs = lock(&metal.shared);
        metal.counts.bmc_calls = bmcs.calls;
        metal.counts.bmc_hangs = bmcs.hangs;
        metal.counts.bmc_unauthorized = bmcs.refused;
        match bmcs.conflicts.pop() {
            Some(conflict) => Err(Violation(format!("metal: two operations at once on one machine: {conflict}"))),
            None => Ok(()),
        }
    }

    /// Bare metal's invariants on every machine's document, as each activation of the
    /// reconciler reads them (see the module's header); the workflows' own rows are checked with
    /// the full checks ([`Sim::metal_rows_check`]).
    async fn metal_docs_check(&mut self, all: &BTreeMap<usize, Vec<MetalDoc>>) -> Result<(), Violation> {
        self.metal_bmc_check()?;
        let now = self.world.now_ms();
        for (&t, docs) in all {
            for doc in docs {
                self.metal_moves_check(t, doc).await?;
                let node = doc.node_id.as_str();
                match doc.running() {
                    Some(w) => {
                        if doc.state.is_stable() && w.verb != Verb::Power.as_str() {
                            return Err(Violation(format!(
                                "metal: machine {node} rests in {} but runs a {} workflow ({})",
                                doc.state, w.verb, w.workflow_id
                            )));
                        }
                        let bound = workflow_bound_ms(doc.state, w);
                        if now > bound {
                            return Err(Violation(format!(
                                "metal: the {} workflow {} of machine {node} is still running ({}, at step {}) {} ms after it \
                                 started, past its bound of {} ms (the {} s deadline of {} from the lifecycle table, and {} ms \
                                 for a late pass)",
                                w.verb,
                                w.workflow_id,
                                doc.state,
                                w.current().map_or("none", |s| s.as_str()),
                                now - w.started_at_ms,
                                bound - w.started_at_ms,
                                doc.state.deadline_s().unwrap_or(POWER_DEADLINE_S * 2),
                                doc.state,
                                BOUND_SLACK_MS
                            )));
                        }
                    }
                    None => {
                        if !doc.state.is_stable() {
                            return Err(Violation(format!("metal: machine {node} waits in {} with no workflow", doc.state)));
                        }
                    }
                }
                // The last deploy's token: spent if it made the machine active; spent or revoked
                // once the machine left deploying.
                if let Some(w) = doc.workflow.as_ref().filter(|w| w.verb == Verb::Deploy.as_str())
                    && let Some(token_id) = w.join_token_id.as_deref()
                    && !matches!(doc.state, MetalState::Deploying | MetalState::DeployWait)
                    && !self.metal.as_ref().is_some_and(|m| m.tokens_final.contains(token_id))
                {
                    let token = self.world.doc::<JoinTokenDoc>(t, KIND_JOIN_TOKEN, token_id).await;
                    let (spent, revoked) = token.as_ref().map_or((false, false), |t| (t.uses > 0, t.revoked));
                    if w.outcome == bc_projections::workflow::WorkflowOutcome::Succeeded && !spent {
                        return Err(Violation(format!(
                            "metal: machine {node} was deployed by {} but its agent never joined (token {token_id} unspent)",
                            w.workflow_id
                        )));
                    }
                    if !spent && !revoked {
                        return Err(Violation(format!(
                            "metal: machine {node} is {} but its deploy's join token {token_id} is still usable",
                            doc.state
                        )));
                    }
                    // Spent or revoked for good: not read again.
                    if let Some(metal) = self.metal.as_mut() {
                        metal.tokens_final.insert(token_id.to_owned());
                    }
                }
            }
        }
        Ok(())
    }

    /// Every move of machine `doc` the log has since the last check, in order, against the
    /// lifecycle table ([`table_allows`]); and the document rests where the last move left it.
    /// Read only when the document's version moved.
    async fn metal_moves_check(&mut self, t: usize, doc: &MetalDoc) -> Result<(), Violation> {
        let node = doc.node_id.as_str();
        let metal = self.metal.as_mut().expect("metal");
        let mut moves = metal.moves.get(node).copied().unwrap_or(Moves { version: 0, state: MetalState::Enroll, retired: false });
        if doc.version <= moves.version {
            return Ok(());
        }
        let tenant = self.world.tenants[t].id;
        let stream = stream_of(KIND_METAL, &doc.node_id);
        while moves.version < doc.version {
            let page = self.world.store.read_stream_rows(tenant, &stream, moves.version, 256).await.expect("the log reads");
            if page.is_empty() {
                break;
            }
            for row in page {
                let version = row.version;
                moves.version = version;
                if row.event_type == ev::METAL_ENROLLED {
                    moves.state = MetalState::Enroll;
                }
                if row.event_type != ev::METAL_TRANSITIONED {
                    continue;
                }
                let event = row.decode().map_err(|e| Violation(format!("metal: machine {node}'s event: {e}")))?;
                let p: ev::MetalTransitioned = serde_json::from_value(bc_core::canonical::to_json(&event.envelope.payload))
                    .map_err(|e| Violation(format!("metal: machine {node}'s metal.transitioned at version {version}: {e}")))?;
                moves.state = table_allows(moves.state, moves.retired, &p.verb, &p.from, &p.to).map_err(|why| {
                    Violation(format!("metal: machine {node} (seq {}, version {version}) {why}", event.envelope.seq))
                })?;
                moves.retired |= p.verb == Verb::Retire.as_str();
                self.metal.as_mut().expect("metal").counts.moves += 1;
            }
        }
        if moves.version == doc.version && moves.state != doc.state {
            return Err(Violation(format!(
                "metal: machine {node} is {} by its document at version {}, but its moves in the log end in {}",
                doc.state, doc.version, moves.state
            )));
        }
        self.metal.as_mut().expect("metal").moves.insert(node.to_owned(), moves);
        Ok(())
    }

    /// With the full checks: every machine's workflows' own rows (every workflow it ran): at
    /// most one runs, and it is the one the machine's document names; and the workflows by
    /// outcome, for the summary.
    pub(super) async fn metal_rows_check(&mut self) -> Result<(), Violation> {
        if self.metal.is_none() {
            return Ok(());
        }
        let mut ended: BTreeMap<String, u64> = BTreeMap::new();
        for t in 0..self.options.tenants {
            let docs: Vec<MetalDoc> = self.world.rows(t, KIND_METAL).await;
            if docs.is_empty() {
                continue;
            }
            let workflows: Vec<Workflow> = self.world.rows(t, KIND_WORKFLOW).await;
            let mut running: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
            for w in &workflows {
                if w.is_running() {
                    running.entry(w.node_id.as_str()).or_default().insert(w.workflow_id.as_str());
                } else {
                    *ended.entry(w.outcome.as_str().to_owned()).or_default() += 1;
                }
            }
            for doc in &docs {
                let node = doc.node_id.as_str();
                let runs = running.get(node).cloned().unwrap_or_default();
                if runs.len() > 1 {
                    return Err(Violation(format!("metal: machine {node} runs {} workflows at once: {runs:?}", runs.len())));
                }
                let named: BTreeSet<&str> = doc.running().map(|w| w.workflow_id.as_str()).into_iter().collect();
                if runs != named {
                    return Err(Violation(format!(
                        "metal: machine {node} runs {named:?} by its document, but its workflows' rows say {runs:?} run"
                    )));
                }
            }
        }
        if let Some(metal) = self.metal.as_mut() {
            metal.counts.workflows = ended;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bmcs(clock: &Arc<ManualClock>) -> Shared {
        let state = BmcState::off(0);
        Arc::new(Mutex::new(Bmcs {
            clock: clock.clone(),
            rng: SeededRng(1),
            by_address: BTreeMap::from([(address(0), state)]),
            booted: vec![],
            conflicts: vec![],
            calls: 0,
            hangs: 0,
            refused: 0,
        }))
    }

    /// Power applies late, on the virtual clock; a power-on with the CD inserted and a boot from
    /// it boots the installer once; a hanging BMC parks its call until its timeout, and a second
    /// call while it hangs is a conflict the check reports.
    #[tokio::test]
    async fn the_simulated_bmc_applies_power_late_boots_the_installer_hangs_and_sees_two_calls_at_once() {
        let clock = Arc::new(ManualClock::new(crate::world::EPOCH_MS));
        let shared = bmcs(&clock);
        let (parked, mut parked_rx) = mpsc::unbounded_channel();
        let bmc = SimBmc { shared: shared.clone(), address: address(0), parked };
        bmc.insert_media(IMAGE_URL).await.unwrap();
        bmc.set_boot_once(BootSource::Cd).await.unwrap();
        bmc.reset(ResetType::On).await.unwrap();
        assert_eq!(bmc.system().await.unwrap().power_state, Some(PowerState::PoweringOn));
        clock.set_ms(clock.now_ms() + POWER_LAG_MS_MAX);
        let system = bmc.system().await.unwrap();
        assert_eq!((system.power_state, system.boot_once), (Some(PowerState::On), None));
        assert_eq!(lock(&shared).booted.len(), 1, "the installer booted once");

        let until = clock.now_ms() + HANG_MS_MIN;
        lock(&shared).by_address.get_mut(&address(0)).unwrap().hang_until = until;
        let mut hanging = Box::pin(bmc.system());
        assert!(futures_poll(&mut hanging).is_none(), "the call hangs");
        let (_, due, answer) = parked_rx.try_recv().expect("the call parked");
        assert_eq!(due, clock.now_ms() + bc_bmc::REQUEST_TIMEOUT_S * 1000);
        lock(&shared).by_address.get_mut(&address(0)).unwrap().hang_until = 0;
        bmc.eject_media().await.unwrap();
        let conflict = lock(&shared).conflicts.pop().expect("two calls at once");
        assert!(conflict.contains("eject-media while system was in flight"), "{conflict}");
        answer.send(()).unwrap();
        assert!(matches!(hanging.await, Err(BmcError::Timeout(_))));
    }

    /// The moves check takes what the table allows, from where the last move left the machine,
    /// a retired machine's cleaning ending in manageable; and refuses a move the table has no
    /// row for, one from another state than the last move's, one to another state than its
    /// row's, and a state or verb the table does not know.
    #[test]
    fn the_moves_check_takes_the_tables_rows_and_refuses_anything_else() {
        use MetalState as S;
        assert_eq!(table_allows(S::Enroll, false, "manage", "enroll", "verifying"), Ok(S::Verifying));
        assert_eq!(table_allows(S::DeployWait, false, "fail", "deploy-wait", "deploy-failed"), Ok(S::DeployFailed));
        assert_eq!(table_allows(S::Active, false, "power", "active", "active"), Ok(S::Active));
        assert_eq!(table_allows(S::Cleaning, true, "done", "cleaning", "manageable"), Ok(S::Manageable));
        assert_eq!(table_allows(S::Cleaning, false, "done", "cleaning", "available"), Ok(S::Available));
        let refused = |at, retired, verb, from, to| table_allows(at, retired, verb, from, to).unwrap_err();
        assert!(refused(S::Enroll, false, "deploy", "enroll", "deploying").contains("does not allow"));
        assert!(refused(S::Active, false, "done", "active", "manageable").contains("does not allow"));
        assert!(refused(S::Manageable, false, "provide", "available", "cleaning").contains("last move left it in manageable"));
        assert!(refused(S::Cleaning, true, "done", "cleaning", "available").contains("goes to manageable"));
        assert!(refused(S::DeployWait, false, "fail", "deploy-wait", "error").contains("goes to deploy-failed"));
        assert!(refused(S::Enroll, false, "manage", "enroll", "limbo").contains("does not have"));
        assert!(refused(S::Enroll, false, "teleport", "enroll", "verifying").contains("does not have"));
    }

    /// Polls a future once.
    fn futures_poll<F: Future + Unpin>(future: &mut F) -> Option<F::Output> {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        match Pin::new(future).poll(&mut cx) {
            std::task::Poll::Ready(out) => Some(out),
            std::task::Poll::Pending => None,
        }
    }
}
