//! The `metal` reconciler: runs each machine's workflow against its BMC, one step at a time,
//! and keeps the log's power state true to the machine.
//!
//! Level-triggered: every pass reads each tenant's machines and, for each, asks
//! [`decide::metal_plan`] what is next: a step to run, a deadline passed (fail), or nothing.
//! It runs the step on the BMC (the [`bc_bmc::Bmc`] a [`BmcConnector`] gives: Redfish in `dev`
//! and `serve`, fakes in the simulator and the deadline tests) and appends what
//! [`decide::metal_step`] makes of the result, at the machine's version it read: a reconciler
//! killed anywhere resumes at the first step not recorded as done (each step is safe to run
//! twice: power to a state it is in is skipped, media ejected twice is no error), and two
//! reconcilers never both record one step.
//!
//! A machine with no workflow running is **synced** every `sync_interval_ms`: its BMC's power
//! state is read, and one that differs from the log's is read again on the next passes;
//! [`DRIFT_READS`] reads in a row that differ are recorded (`metal.power_drifted`), and the log
//! follows the machine (it is not forced back: the operator may have had a reason).
//!
//! Scheduled per machine ([`MetalTurns`]): each machine's turn (decide, one BMC step, append) runs on
//! its own, a pass every tick starting a turn for each machine that has none running, at most
//! [`TENANT_TURNS_MAX`] of a tenant's at once and [`TURNS_MAX`] in all, tenants taken in turn
//! and each tenant's machines from where its last turn started, and a slot freed starts the
//! next machine at once. A pass never waits for a turn: a BMC that hangs holds its own
//! machine's turn (for at most `bc_bmc::REQUEST_TIMEOUT_S`, connecting at most
//! `bc_bmc::CONNECT_TIMEOUT_S`), and one of a tenant's slots, nothing else.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};

use bc_bmc::{Bmc, BmcConnector, BmcError, BmcTarget, BmcTls, BootSource, PowerState, ResetType};
use bc_core::clock::Clock;
use bc_core::id::WorkflowId;
use bc_core::store::Log;
use bc_core::{ErrorCode, Result};
use bc_projections::decide::{self, MetalPlan, StepResult};
use bc_projections::events::MetalInspection;
use bc_projections::workflow::{KIND_METAL, MetalDoc, Step};
use bc_projections::{JoinTokenDoc, KIND_JOIN_TOKEN};
use futures::StreamExt;

pub const NAME: &str = "metal";
const ACTOR: &str = "reconciler:metal";
/// How often a pass runs: also how often a wait (power, the agent) is polled.
pub const TICK_MS_DEFAULT: u64 = 1_000;
/// How often a machine with no workflow has its power state read.
pub const SYNC_INTERVAL_MS_DEFAULT: u64 = 60_000;
/// Reads in a row that differ from the log before a power drift is recorded.
pub const DRIFT_READS: u32 = 3;
/// One tenant's machines whose turns run at once: its fair share, so one tenant's hanging BMCs
/// hold its own slots only (each BMC call may take up to `bc_bmc::REQUEST_TIMEOUT_S`).
pub const TENANT_TURNS_MAX: usize = 16;
/// Machines whose turns run at once, all tenants together.
pub const TURNS_MAX: usize = 256;
const _: () = assert!(TENANT_TURNS_MAX <= TURNS_MAX);
/// Machines read per tenant per query.
const ROWS_PER_READ: u32 = 500;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub steps: usize,
    pub retried: usize,
    pub failed: usize,
    pub drifted: usize,
    pub conflicts: usize,
}

impl Pass {
    fn add(&mut self, other: Pass) {
        self.steps += other.steps;
        self.retried += other.retried;
        self.failed += other.failed;
        self.drifted += other.drifted;
        self.conflicts += other.conflicts;
    }

    fn any(&self) -> bool {
        self.steps + self.retried + self.failed + self.drifted + self.conflicts > 0
    }
}

/// The reconciler's state between passes: when each machine was last synced, and the drift
/// reads so far (lost on restart, which only makes the next sync come sooner).
pub struct Metal {
    pub log: Arc<Log>,
    pub clock: Arc<dyn Clock>,
    pub connector: Arc<dyn BmcConnector>,
    pub sync_interval_ms: u64,
    synced: Mutex<BTreeMap<String, u64>>,
    drift: Mutex<BTreeMap<String, (String, u32)>>,
    /// Sync reads in a row the BMC refused with 401, per machine: a machine at rest whose
    /// credentials stopped working goes into maintenance after
    /// [`UNAUTHORIZED_ATTEMPTS_MAX`](bc_projections::workflow::UNAUTHORIZED_ATTEMPTS_MAX) of them.
    unauthorized: Mutex<BTreeMap<String, u32>>,
}

fn power_text(power: Option<PowerState>) -> Option<String> {
    match power? {
        PowerState::On => Some("on".into()),
        PowerState::Off => Some("off".into()),
        PowerState::PoweringOn | PowerState::PoweringOff => None,
    }
}

fn failed(e: BmcError) -> StepResult {
    StepResult::Failed { kind: e.kind().to_owned(), message: e.to_string() }
}

impl Metal {
    pub fn new(log: Arc<Log>, clock: Arc<dyn Clock>, connector: Arc<dyn BmcConnector>) -> Self {
        Metal {
            log,
            clock,
            connector,
            sync_interval_ms: SYNC_INTERVAL_MS_DEFAULT,
            synced: Mutex::new(BTreeMap::new()),
            drift: Mutex::new(BTreeMap::new()),
            unauthorized: Mutex::new(BTreeMap::new()),
        }
    }

    /// The machine's BMC, its password opened from the secret store.
    async fn bmc(&self, doc: &MetalDoc) -> std::result::Result<Arc<dyn Bmc>, StepResult> {
        let tenant: bc_core::id::TenantId = doc.tenant_id.parse().map_err(|e: bc_core::Error| credentials(e.to_string()))?;
        let password = match self.log.store.secret_get(tenant, &doc.bmc.secret_id).await {
            Ok(Some(p)) => p,
            Ok(None) => return Err(credentials("no BMC password is stored for this machine; enroll it again".into())),
            Err(e) => return Err(StepResult::Failed { kind: "storage".into(), message: e.public_message() }),
        };
        // Only the enrollment's explicit `insecure` skips verification: any other value (a
        // row written by a later version, a damaged one) fails closed.
        let tls = match (doc.bmc.tls.as_str(), &doc.bmc.ca_pem, &doc.bmc.pin) {
            ("ca", Some(pem), _) => BmcTls::CaBundle { pem: pem.clone() },
            ("pin", _, Some(pin)) => BmcTls::Pin { pin: pin.clone() },
            ("insecure", _, _) => BmcTls::Insecure,
            (mode, _, _) => {
                return Err(credentials(format!(
                    "the BMC's TLS mode {mode:?} is not one this reconciler knows, or lacks its CA or pin; enroll it again"
                )));
            }
        };
        let address =
            url::Url::parse(&doc.bmc.address).map_err(|e| credentials(format!("the BMC address does not parse: {e}")))?;
        let target =
            BmcTarget { address, system_path: doc.bmc.system_path.clone(), username: doc.bmc.username.clone(), password, tls };
        self.connector.connect(&target).map_err(failed)
    }

    /// Runs `step` on the machine's BMC (or, for the agent's wait, reads the log).
    async fn run_step(&self, doc: &MetalDoc, step: Step) -> StepResult {
        if step == Step::WaitAgent {
            return self.agent_joined(doc).await;
        }
        let bmc = match self.bmc(doc).await {
            Ok(bmc) => bmc,
            Err(result) => return result,
        };
        let workflow = doc.running();
        let result: std::result::Result<StepResult, BmcError> = async {
            let done = |power: Option<String>| StepResult::Done { power, inspection: None };
            Ok(match step {
                Step::CheckBmc => done(power_text(bmc.system().await?.power_state)),
                Step::ReadInventory => {
                    let system = bmc.system().await?;
                    StepResult::Done {
                        power: power_text(system.power_state),
                        inspection: Some(MetalInspection {
                            manufacturer: system.manufacturer,
                            model: system.model,
                            serial_number: system.serial_number,
                            processor_count: system.processor_count,
                            memory_gib: system.memory_gib,
                        }),
                    }
                }
                Step::PowerOff | Step::PowerOn => {
                    let (want, reset) = if step == Step::PowerOff {
                        (PowerState::Off, ResetType::ForceOff)
                    } else {
                        (PowerState::On, ResetType::On)
                    };
                    if bmc.system().await?.power_state == Some(want) {
                        done(power_text(Some(want)))
                    } else {
                        bmc.reset(reset).await?;
                        done(None)
                    }
                }
                Step::WaitPowerOff | Step::WaitPowerOn => {
                    let want = if step == Step::WaitPowerOff { PowerState::Off } else { PowerState::On };
                    if bmc.system().await?.power_state == Some(want) { done(power_text(Some(want))) } else { StepResult::NotYet }
                }
                Step::Reboot => {
                    bmc.reset(ResetType::ForceRestart).await?;
                    done(None)
                }
                Step::EjectMedia => {
                    bmc.eject_media().await?;
                    done(None)
                }
                Step::InsertMedia => {
                    let url = workflow.and_then(|w| w.image_url.clone()).unwrap_or_default();
                    bmc.insert_media(&url).await?;
                    done(None)
                }
                Step::BootOnceCd => {
                    bmc.set_boot_once(BootSource::Cd).await?;
                    done(None)
                }
                Step::WaitAgent => unreachable!("handled above"),
            })
        }
        .await;
        result.unwrap_or_else(failed)
    }

    /// Whether the deploy's join token was spent: the installed system's agent joined as the
    /// node (the join spends it in the same append as `node.joined`).
    async fn agent_joined(&self, doc: &MetalDoc) -> StepResult {
        let Some(token) = doc.running().and_then(|w| w.join_token_id.clone()) else {
            return StepResult::Failed { kind: "protocol".into(), message: "the deploy has no join token".into() };
        };
        match self.log.store.row_get(&doc.tenant_id, KIND_JOIN_TOKEN, &token).await {
            Ok(Some(row)) => match serde_json::from_value::<JoinTokenDoc>(row.doc) {
                Ok(t) if t.uses > 0 => StepResult::Done { power: Some("on".into()), inspection: None },
                Ok(_) => StepResult::NotYet,
                Err(e) => StepResult::Failed { kind: "storage".into(), message: format!("join token row: {e}") },
            },
            Ok(None) => StepResult::NotYet,
            Err(e) => StepResult::Failed { kind: "storage".into(), message: e.public_message() },
        }
    }

    /// Appends a decision; a conflict (another reconciler, a caller) is counted, and decided
    /// again next pass.
    async fn append(&self, doc: &MetalDoc, append: decide::Append, done: Pass) -> Pass {
        let tenant: bc_core::id::TenantId = match doc.tenant_id.parse() {
            Ok(t) => t,
            Err(_) => return done,
        };
        match self.log.append(append.into_request(tenant, ACTOR)).await {
            Ok(_) => done,
            Err(e) if e.code() == ErrorCode::Conflict => Pass { conflicts: 1, ..Pass::default() },
            Err(e) => {
                tracing::warn!(reconciler = NAME, node = %doc.node_id, code = %e.code(), error = %e, "append failed");
                Pass::default()
            }
        }
    }

    /// One machine's turn in a pass: decide, at most one BMC step, append. [`MetalTurns`] runs
    /// each as a task of its own; the simulator runs them itself on its virtual clock, a turn
    /// parked on a hanging BMC while the others go on (`simulator/src/run/metal.rs`).
    pub async fn machine(&self, doc: MetalDoc) -> Pass {
        let now_ms = self.clock.now_ms();
        match decide::metal_plan(&doc, now_ms) {
            MetalPlan::Fail(reason) => self.fail(&doc, &reason).await,
            MetalPlan::LastLook { step, reason } => match self.run_step(&doc, step).await {
                done @ StepResult::Done { .. } => self.record(&doc, step, done).await,
                _ => self.fail(&doc, &reason).await,
            },
            MetalPlan::Run(step) => {
                let result = self.run_step(&doc, step).await;
                self.record(&doc, step, result).await
            }
            MetalPlan::Idle => {
                if doc.running().is_none() && doc.power.is_some() && doc.flags.maintenance.is_none() {
                    self.sync(&doc, now_ms).await
                } else {
                    Pass::default()
                }
            }
        }
    }

    /// Fails the running workflow with `reason`.
    async fn fail(&self, doc: &MetalDoc, reason: &str) -> Pass {
        tracing::warn!(reconciler = NAME, node = %doc.node_id, state = %doc.state, reason = %reason, "workflow failed");
        match decide::metal_fail(doc, reason) {
            Ok(append) => self.append(doc, append, Pass { failed: 1, ..Pass::default() }).await,
            Err(e) => {
                tracing::error!(reconciler = NAME, node = %doc.node_id, error = %e, "cannot fail the workflow");
                Pass::default()
            }
        }
    }

    /// Appends what `result`, the outcome of running `step`, means for the workflow.
    async fn record(&self, doc: &MetalDoc, step: Step, result: StepResult) -> Pass {
        let now_ms = self.clock.now_ms();
        let next = WorkflowId::from_ulid(self.log.ids.ulid()).to_string();
        let counted = match &result {
            StepResult::Failed { kind, message } => {
                tracing::info!(reconciler = NAME, node = %doc.node_id, step = step.as_str(), kind = %kind, error = %bc_core::id::truncate(message, 300), "step failed");
                Pass { retried: 1, ..Pass::default() }
            }
            StepResult::NotYet => Pass::default(),
            StepResult::Done { .. } => Pass { steps: 1, ..Pass::default() },
        };
        match decide::metal_step(doc, step, result, now_ms, &next) {
            Ok(Some(append)) => {
                let failing = append.event_types().contains(&bc_projections::events::METAL_WORKFLOW_FINISHED)
                    && matches!(counted, Pass { retried: 1, .. });
                let counted = if failing { Pass { failed: 1, ..Pass::default() } } else { counted };
                self.append(doc, append, counted).await
            }
            Ok(None) => Pass::default(),
            Err(e) => {
                tracing::error!(reconciler = NAME, node = %doc.node_id, error = %e, "cannot record the step");
                Pass::default()
            }
        }
    }

    /// The power sync of a machine with no workflow.
    async fn sync(&self, doc: &MetalDoc, now_ms: u64) -> Pass {
        let suspect = self.drift.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&doc.node_id)
            || self.unauthorized.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&doc.node_id);
        let last = self.synced.lock().unwrap_or_else(|p| p.into_inner()).get(&doc.node_id).copied();
        if !suspect && last.is_some_and(|at| now_ms < at.saturating_add(self.sync_interval_ms)) {
            return Pass::default();
        }
        self.synced.lock().unwrap_or_else(|p| p.into_inner()).insert(doc.node_id.clone(), now_ms);
        let Ok(bmc) = self.bmc(doc).await else { return Pass::default() };
        let observed = match bmc.system().await {
            Ok(system) => {
                self.unauthorized.lock().unwrap_or_else(|p| p.into_inner()).remove(&doc.node_id);
                power_text(system.power_state)
            }
            Err(BmcError::Unauthorized(message)) => return self.sync_unauthorized(doc, message).await,
            Err(e) => {
                self.unauthorized.lock().unwrap_or_else(|p| p.into_inner()).remove(&doc.node_id);
                tracing::debug!(reconciler = NAME, node = %doc.node_id, error = %e, "power sync read failed");
                return Pass::default();
            }
        };
        let Some(observed) = observed else { return Pass::default() };
        if doc.power.as_deref() == Some(observed.as_str()) {
            self.drift.lock().unwrap_or_else(|p| p.into_inner()).remove(&doc.node_id);
            return Pass::default();
        }
        let reads = {
            let mut drift = self.drift.lock().unwrap_or_else(|p| p.into_inner());
            let entry = drift.entry(doc.node_id.clone()).or_insert((observed.clone(), 0));
            if entry.0 != observed {
                *entry = (observed.clone(), 0);
            }
            entry.1 += 1;
            entry.1
        };
        if reads < DRIFT_READS {
            return Pass::default();
        }
        self.drift.lock().unwrap_or_else(|p| p.into_inner()).remove(&doc.node_id);
        tracing::warn!(reconciler = NAME, node = %doc.node_id, expected = ?doc.power, observed = %observed, "power drifted");
        match decide::metal_drift(doc, &observed) {
            Ok(Some(append)) => self.append(doc, append, Pass { drifted: 1, ..Pass::default() }).await,
            _ => Pass::default(),
        }
    }

    /// A sync read the BMC refused with 401: read again on the next passes (bounded), then the
    /// machine goes into maintenance with the reason, as a workflow's step would put it.
    async fn sync_unauthorized(&self, doc: &MetalDoc, message: String) -> Pass {
        let reads = {
            let mut refused = self.unauthorized.lock().unwrap_or_else(|p| p.into_inner());
            let reads = refused.entry(doc.node_id.clone()).or_insert(0);
            *reads += 1;
            *reads
        };
        tracing::info!(reconciler = NAME, node = %doc.node_id, reads, error = %message, "power sync refused the credentials");
        match decide::metal_unauthorized_at_rest(doc, reads, &message) {
            Ok(Some(append)) => {
                self.unauthorized.lock().unwrap_or_else(|p| p.into_inner()).remove(&doc.node_id);
                tracing::warn!(reconciler = NAME, node = %doc.node_id, "BMC refused the credentials; machine put in maintenance");
                self.append(doc, append, Pass { failed: 1, ..Pass::default() }).await
            }
            Ok(None) => Pass::default(),
            Err(e) => {
                tracing::error!(reconciler = NAME, node = %doc.node_id, error = %e, "cannot record maintenance");
                Pass::default()
            }
        }
    }

    /// Every machine of a tenant.
    async fn machines(&self, tenant: &str) -> Result<Vec<MetalDoc>> {
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let rows = self.log.store.row_list(tenant, KIND_METAL, after.as_deref(), ROWS_PER_READ).await?;
            let full = rows.len() == ROWS_PER_READ as usize;
            after = rows.last().map(|r| r.key.id.clone());
            for row in rows {
                out.push(serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("machine row: {e}")))?);
            }
            if !full {
                return Ok(out);
            }
        }
    }

    /// Every tenant's machines, by tenant.
    async fn all_machines(&self) -> Result<BTreeMap<String, Vec<MetalDoc>>> {
        let mut all = BTreeMap::new();
        for tenant in self.log.store.tenants().await? {
            let tenant = tenant.to_string();
            let machines = self.machines(&tenant).await?;
            all.insert(tenant, machines);
        }
        Ok(all)
    }

    /// One pass over every tenant's machines that waits for every turn it starts (at most
    /// [`TURNS_MAX`] at once): what the tests and the simulator step; [`MetalTurns`] does not wait.
    pub async fn pass(&self) -> Result<Pass> {
        let mut done = Pass::default();
        let machines = self.all_machines().await?.into_values().flatten();
        let mut turns = futures::stream::iter(machines.map(|doc| self.machine(doc))).buffer_unordered(TURNS_MAX);
        while let Some(p) = turns.next().await {
            done.add(p);
        }
        Ok(done)
    }
}

/// Which machines' turns run and which wait, per tenant: the fair share of [`MetalTurns`]. Holds no
/// IO and no time: a pass hands it what it read, a finished turn frees its slot.
#[derive(Default)]
pub struct Scheduler {
    /// Per tenant: machines read by the last pass that have no turn yet, in the order they
    /// are taken.
    waiting: BTreeMap<String, VecDeque<MetalDoc>>,
    /// Per tenant: the machines whose turn runs.
    running: BTreeMap<String, BTreeSet<String>>,
    /// Per tenant: the machine whose turn started last; the next pass's order starts after it,
    /// so a tenant with more machines than its share has each of them in turn.
    last_started: BTreeMap<String, String>,
}

impl Scheduler {
    /// What a pass read (every tenant's machines, each tenant's in id order) replaces what
    /// waited; machines with a turn running are left out.
    pub fn read(&mut self, machines: BTreeMap<String, Vec<MetalDoc>>) {
        self.waiting.clear();
        for (tenant, docs) in machines {
            let running = self.running.get(&tenant);
            let mut docs: Vec<MetalDoc> = docs.into_iter().filter(|d| running.is_none_or(|r| !r.contains(&d.node_id))).collect();
            if let Some(last) = self.last_started.get(&tenant) {
                let after = docs.iter().position(|d| d.node_id > *last).unwrap_or(docs.len());
                docs.rotate_left(after);
            }
            self.waiting.insert(tenant, docs.into());
        }
    }

    /// The machines whose turn starts now: tenants taken in turn, one machine each per round,
    /// while a tenant has fewer than [`TENANT_TURNS_MAX`] running and all fewer than
    /// [`TURNS_MAX`].
    pub fn start(&mut self) -> Vec<MetalDoc> {
        let mut started = Vec::new();
        let mut total: usize = self.running.values().map(BTreeSet::len).sum();
        loop {
            let mut any = false;
            for (tenant, queue) in &mut self.waiting {
                if total >= TURNS_MAX {
                    return started;
                }
                let running = self.running.entry(tenant.clone()).or_default();
                if running.len() >= TENANT_TURNS_MAX {
                    continue;
                }
                let Some(doc) = queue.pop_front() else { continue };
                running.insert(doc.node_id.clone());
                self.last_started.insert(tenant.clone(), doc.node_id.clone());
                total += 1;
                any = true;
                started.push(doc);
            }
            if !any {
                return started;
            }
        }
    }

    /// A turn ended: its slot is free.
    pub fn finished(&mut self, tenant: &str, node: &str) {
        if let Some(running) = self.running.get_mut(tenant) {
            running.remove(node);
        }
    }

    /// Turns running now.
    pub fn running(&self) -> usize {
        self.running.values().map(BTreeSet::len).sum()
    }
}

fn credentials(message: String) -> StepResult {
    StepResult::Failed { kind: "credentials".into(), message }
}

/// The reconciler, scheduled per machine: each activation reads every machine and starts a
/// turn ([`Metal::machine`]) for those without one ([`Scheduler`]), and returns without waiting
/// for any: turns run as tasks of their own and outlive the activation. A turn that ends frees
/// its slot and starts the next machine of its tenant at once. An activation's counts are those
/// of the turns that ended since the one before. Dropped (the driver stopped), it aborts the
/// turns still running: each step is safe to run again, and the next process's pass does.
pub struct MetalTurns {
    metal: Arc<Metal>,
    turns: Arc<Mutex<Turns>>,
}

/// What the activations and the turns share.
#[derive(Default)]
struct Turns {
    scheduler: Scheduler,
    /// The turns running; aborted when the reconciler is dropped.
    tasks: tokio::task::JoinSet<()>,
    /// What the turns that ended since the last activation did.
    done: Pass,
}

impl MetalTurns {
    pub fn new(metal: Arc<Metal>) -> Self {
        Self { metal, turns: Arc::default() }
    }
}

/// Starts a turn for each machine the scheduler lets start now.
fn start_turns(metal: &Arc<Metal>, shared: &Arc<Mutex<Turns>>, turns: &mut Turns) {
    for doc in turns.scheduler.start() {
        let (metal, shared) = (metal.clone(), shared.clone());
        turns.tasks.spawn(async move {
            let (tenant, node) = (doc.tenant_id.clone(), doc.node_id.clone());
            let p = metal.machine(doc).await;
            let mut turns = shared.lock().unwrap_or_else(|p| p.into_inner());
            turns.done.add(p);
            turns.scheduler.finished(&tenant, &node);
            start_turns(&metal, &shared, &mut turns);
        });
    }
}

impl crate::driver::Reconciler for MetalTurns {
    fn name(&self) -> &'static str {
        NAME
    }

    fn activate(&mut self) -> futures::future::BoxFuture<'_, crate::driver::Activation> {
        Box::pin(async move {
            let machines = match self.metal.all_machines().await {
                Ok(machines) => machines,
                Err(e) => return crate::driver::Activation::failed(e),
            };
            let (p, running) = {
                let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
                // Reap the turns that ended (their results are in `done`).
                while turns.tasks.try_join_next().is_some() {}
                turns.scheduler.read(machines);
                start_turns(&self.metal, &self.turns, &mut turns);
                (std::mem::take(&mut turns.done), turns.scheduler.running())
            };
            if p.any() {
                tracing::info!(
                    reconciler = NAME,
                    steps = p.steps,
                    retried = p.retried,
                    failed = p.failed,
                    drifted = p.drifted,
                    conflicts = p.conflicts,
                    running,
                    "pass"
                );
            }
            crate::driver::Activation::ok(vec![
                ("steps", p.steps as u64),
                ("retried", p.retried as u64),
                ("failed", p.failed as u64),
                ("drifted", p.drifted as u64),
                ("conflicts", p.conflicts as u64),
            ])
        })
    }
}

impl Drop for MetalTurns {
    fn drop(&mut self) {
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        if !turns.tasks.is_empty() {
            tracing::info!(reconciler = NAME, running = turns.tasks.len(), "turns stopped");
        }
        turns.tasks.abort_all();
    }
}

/// Runs this reconciler alone, a pass every `tick_ms` until `shutdown`
/// ([`crate::driver::run`]); `dev`, `serve` and `reconcile` start it from [`crate::registry`].
pub async fn run(metal: Arc<Metal>, tick_ms: u64, shutdown: tokio::sync::watch::Receiver<bool>) {
    let (store, clock) = (metal.log.store.clone(), metal.clock.clone());
    crate::driver::run(Box::new(MetalTurns::new(metal)), crate::driver::Schedule::every(tick_ms), store, clock, shutdown).await;
}
