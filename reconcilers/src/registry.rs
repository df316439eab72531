//! Every reconciler, in one place ([`REGISTRY`]): its name, whether it appends, and how it is
//! built and started (omicron's `BackgroundTasksInitializer`). `dev`, `serve`, `reconcile
//! --only` (and its help), `reconcilers status` (which lists those that never ran too) and the
//! simulator read it: the simulator activates the ones marked [`Simulated::Passes`], in the
//! registry's order, at each of its reconciler steps ([`simulated`]).
//!
//! All but one are [`Reconciler`]s driven by [`driver::run`]. The outbox consumer (`webhooks`)
//! keeps its own loops ([`outbox::run`]): it claims work items under leases and delivers them
//! concurrently as they come, which one pass at a time would serialise; its activations (each
//! fan-out step, each claimed batch) record their status through the same
//! [`crate::status::PassRecorder`].

use std::sync::Arc;

use bc_bmc::BmcConnector;
use bc_core::audit::Trust;
use bc_core::clock::Clock;
use bc_core::store::{EventStore, Log};
use bc_core::webhook::EndpointPolicy;
use futures::future::BoxFuture;
use tokio::sync::watch;

use crate::driver::{self, Reconciler, Schedule};
use crate::outbox::{self, RunnerConfig};
use crate::{
    batches, checkpoints, fleet_drift, instances, liveness, metal, reservations, rollouts, sandboxes, usage, webhooks, witnesses,
};

/// What the reconcilers are built from: one process's store, log, clock and settings.
pub struct Inputs {
    pub store: Arc<dyn EventStore>,
    /// The log, for the reconcilers that append; `None` in a process without the log key.
    pub log: Option<Arc<Log>>,
    pub clock: Arc<dyn Clock>,
    /// This process's commits, to wake the reconcilers that follow them (`reservations`, the
    /// outbox's fan-out); `None`: they poll.
    pub wake: Option<watch::Receiver<u64>>,
    /// How often `reservations` passes when nothing wakes it.
    pub reservations_tick_ms: u64,
    /// The outbox consumers' runner (leases, the time limit of one delivery, retries); `None`:
    /// `webhooks` does not run.
    pub outbox: Option<RunnerConfig>,
    pub webhook_policy: EndpointPolicy,
    /// How `metal` reaches BMCs; `None`: it does not run.
    pub bmc: Option<Arc<dyn BmcConnector>>,
    /// How `checkpoints` seals; `None`: it does not run.
    pub sealing: Option<Sealing>,
    /// Where `witnesses` sends checkpoints; empty: it does not run.
    pub witnesses: Vec<witnesses::Witness>,
    /// The length of `usage`'s windows ([`usage::WINDOW_MS_DEFAULT`], an hour).
    pub usage_window_ms: u64,
}

/// How often `reservations` passes when nothing wakes it, unless its process says otherwise.
pub const RESERVATIONS_TICK_MS_DEFAULT: u64 = 500;

impl Inputs {
    /// Inputs that build only what needs nothing more than the store, the log and the clock: no
    /// wake-ups (`reservations` polls every [`RESERVATIONS_TICK_MS_DEFAULT`]), no outbox runner,
    /// no BMC connector, no sealing, no witness.
    pub fn new(store: Arc<dyn EventStore>, log: Option<Arc<Log>>, clock: Arc<dyn Clock>) -> Self {
        Self {
            store,
            log,
            clock,
            wake: None,
            reservations_tick_ms: RESERVATIONS_TICK_MS_DEFAULT,
            outbox: None,
            webhook_policy: EndpointPolicy::default(),
            bmc: None,
            sealing: None,
            witnesses: Vec::new(),
            usage_window_ms: usage::WINDOW_MS_DEFAULT,
        }
    }
}

/// How `checkpoints` seals.
pub struct Sealing {
    pub interval_s: u64,
    pub deployment: String,
    pub trust: Trust,
}

/// How a registered reconciler runs.
pub enum Task {
    /// An activation at a time, by [`driver::run`].
    Driven(Box<dyn Reconciler>, Schedule),
    /// Its own loops until the shutdown it is given (the outbox consumers: see the module's
    /// header).
    Own(Box<dyn FnOnce(watch::Receiver<bool>) -> BoxFuture<'static, ()> + Send>),
}

/// How the simulator (`sim run`) runs a registered reconciler on its virtual clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simulated {
    /// Not at all: the simulated world has none of what it works on (instances, a sealing
    /// interval, witnesses).
    No,
    /// Activated at each of the simulator's reconciler steps, in the registry's order.
    /// `crashes`: the `reconciler-crash` fault cuts it; a step so cut activates only these, in
    /// order, and none after the one the cut stopped.
    Passes { crashes: bool },
    /// The outbox consumer: the simulator steps its fan-out, claims and attempts itself, after
    /// the passes (its `run/webhooks.rs`), since its own loops run on the real clock.
    Consumer,
    /// `metal`: the simulator runs each machine's turn itself (`metal::Metal::machine`, started
    /// by the reconciler's `metal::Scheduler` at each of its reconciler steps) against
    /// simulated BMCs on its virtual clock (its `run/metal.rs`), since `MetalTurns` runs turns
    /// as tasks and a hanging BMC's timeout is on the real clock.
    Turns,
}

/// One reconciler of [`REGISTRY`].
pub struct Registration {
    pub name: &'static str,
    /// It appends to the log, so its process needs the log key.
    pub appends: bool,
    /// The server's own duty (the audit trail): `dev` and `serve` run it even with
    /// `--no-reconcilers`.
    pub duty: bool,
    /// How `sim run` runs it.
    pub simulated: Simulated,
    /// Builds it; `None` when `Inputs` leave it nothing to do (no sealing interval, no
    /// witness).
    build: fn(&Inputs) -> bc_core::Result<Option<Task>>,
}

/// Activated at each of the simulator's reconciler steps, and cut by `reconciler-crash`.
const PASS_CUT: Simulated = Simulated::Passes { crashes: true };
/// Activated at each of the simulator's reconciler steps; `reconciler-crash` leaves it out.
const PASS: Simulated = Simulated::Passes { crashes: false };

/// Every reconciler this version runs. The order is the simulator's order of activation.
pub const REGISTRY: &[Registration] = &[
    Registration { name: reservations::NAME, appends: true, duty: false, simulated: PASS_CUT, build: build_reservations },
    Registration { name: webhooks::CONSUMER, appends: true, duty: false, simulated: Simulated::Consumer, build: build_webhooks },
    Registration { name: checkpoints::NAME, appends: true, duty: true, simulated: Simulated::No, build: build_checkpoints },
    Registration { name: rollouts::NAME, appends: true, duty: false, simulated: PASS, build: build_rollouts },
    Registration { name: liveness::NAME, appends: true, duty: false, simulated: PASS_CUT, build: build_liveness },
    Registration { name: instances::NAME, appends: true, duty: false, simulated: Simulated::No, build: build_instances },
    Registration { name: sandboxes::NAME, appends: true, duty: false, simulated: Simulated::No, build: build_sandboxes },
    Registration { name: metal::NAME, appends: true, duty: false, simulated: Simulated::Turns, build: build_metal },
    Registration { name: witnesses::NAME, appends: true, duty: true, simulated: Simulated::No, build: build_witnesses },
    Registration { name: usage::NAME, appends: true, duty: false, simulated: Simulated::No, build: build_usage },
    Registration { name: batches::NAME, appends: true, duty: false, simulated: Simulated::No, build: build_batches },
    Registration { name: fleet_drift::NAME, appends: true, duty: false, simulated: Simulated::No, build: build_fleet_drift },
];

/// The names of [`REGISTRY`], in its order (`reconcile --only`'s possible values).
pub const NAMES: [&str; REGISTRY.len()] = {
    let mut names = [""; REGISTRY.len()];
    let mut i = 0;
    while i < REGISTRY.len() {
        names[i] = REGISTRY[i].name;
        i += 1;
    }
    names
};

/// The registered reconciler named `name`.
pub fn find(name: &str) -> Option<&'static Registration> {
    REGISTRY.iter().find(|r| r.name == name)
}

/// A reconciler the simulator activates itself at each of its reconciler steps
/// ([`Simulated::Passes`]).
pub struct SimulatedPass {
    pub name: &'static str,
    /// The `reconciler-crash` fault cuts it.
    pub crashes: bool,
    pub reconciler: Box<dyn Reconciler>,
}

/// The reconcilers `sim run` activates at each of its reconciler steps, built from `inputs`, in
/// the registry's order.
pub fn simulated(inputs: &Inputs) -> bc_core::Result<Vec<SimulatedPass>> {
    let mut passes = Vec::new();
    for registration in REGISTRY {
        let Simulated::Passes { crashes } = registration.simulated else { continue };
        match (registration.build)(inputs)? {
            Some(Task::Driven(reconciler, _)) => passes.push(SimulatedPass { name: registration.name, crashes, reconciler }),
            Some(Task::Own(_)) | None => {
                return Err(bc_core::Error::Internal(format!(
                    "the {} reconciler is simulated by its passes: it must build as one",
                    registration.name
                )));
            }
        }
    }
    Ok(passes)
}

impl Registration {
    /// Builds it and spawns it until `shutdown`; `None` when it has nothing to do.
    pub fn start(
        &self,
        inputs: &Inputs,
        shutdown: watch::Receiver<bool>,
    ) -> bc_core::Result<Option<tokio::task::JoinHandle<()>>> {
        Ok((self.build)(inputs)?.map(|task| match task {
            Task::Driven(reconciler, schedule) => {
                tokio::spawn(driver::run(reconciler, schedule, inputs.store.clone(), inputs.clock.clone(), shutdown))
            }
            Task::Own(run) => tokio::spawn(run(shutdown)),
        }))
    }
}

fn log(inputs: &Inputs, name: &str) -> bc_core::Result<Arc<Log>> {
    inputs.log.clone().ok_or_else(|| bc_core::Error::Internal(format!("the {name} reconciler appends: it needs the log")))
}

fn build_reservations(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let reconciler = reservations::Reservations::new(log(inputs, reservations::NAME)?, inputs.clock.clone());
    let schedule = Schedule { period_ms: inputs.reservations_tick_ms, first_after_period: false, wake: inputs.wake.clone() };
    Ok(Some(Task::Driven(Box::new(reconciler), schedule)))
}

fn build_webhooks(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let Some(config) = inputs.outbox.clone() else { return Ok(None) };
    let mut webhooks = webhooks::Webhooks::new(inputs.webhook_policy, config.time_limit_ms, inputs.clock.clone())?;
    // Webhooks that name a secret need the log, where each resolution is recorded.
    if let Some(log) = &inputs.log {
        webhooks = webhooks.resolving_with(log.clone());
    }
    let consumer: Arc<dyn outbox::Consumer> = Arc::new(webhooks);
    let (store, wake) = (inputs.store.clone(), inputs.wake.clone());
    Ok(Some(Task::Own(Box::new(move |shutdown| Box::pin(outbox::run(store, consumer, config, wake, shutdown))))))
}

fn build_checkpoints(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let Some(sealing) = &inputs.sealing else { return Ok(None) };
    let reconciler =
        checkpoints::Checkpoints::new(log(inputs, checkpoints::NAME)?, sealing.deployment.clone(), sealing.trust.clone());
    let period_ms = sealing.interval_s.max(checkpoints::INTERVAL_S_MIN).saturating_mul(1000);
    let schedule = Schedule { period_ms, first_after_period: true, wake: None };
    Ok(Some(Task::Driven(Box::new(reconciler), schedule)))
}

fn build_liveness(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let reconciler = liveness::reconciler(log(inputs, liveness::NAME)?, inputs.clock.clone());
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(liveness::TICK_MS_DEFAULT))))
}

fn build_instances(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let reconciler = instances::reconciler(log(inputs, instances::NAME)?, inputs.clock.clone());
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(instances::TICK_MS_DEFAULT))))
}

fn build_sandboxes(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let reconciler = sandboxes::reconciler(log(inputs, sandboxes::NAME)?, inputs.clock.clone());
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(sandboxes::TICK_MS_DEFAULT))))
}

fn build_metal(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let Some(bmc) = inputs.bmc.clone() else { return Ok(None) };
    let metal = metal::Metal::new(log(inputs, metal::NAME)?, inputs.clock.clone(), bmc);
    let reconciler = metal::MetalTurns::new(Arc::new(metal));
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(metal::TICK_MS_DEFAULT))))
}

fn build_rollouts(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let reconciler = rollouts::reconciler(log(inputs, rollouts::NAME)?, inputs.clock.clone());
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(rollouts::TICK_MS_DEFAULT))))
}

fn build_batches(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let reconciler = batches::reconciler(log(inputs, batches::NAME)?, inputs.clock.clone());
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(batches::TICK_MS_DEFAULT))))
}

fn build_fleet_drift(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let reconciler = fleet_drift::reconciler(log(inputs, fleet_drift::NAME)?, inputs.clock.clone());
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(fleet_drift::TICK_MS_DEFAULT))))
}

fn build_usage(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    let window_ms = inputs.usage_window_ms.clamp(usage::WINDOW_MS_MIN, usage::WINDOW_MS_MAX);
    let reconciler = usage::Usage { log: log(inputs, usage::NAME)?, clock: inputs.clock.clone(), window_ms };
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(usage::TICK_MS_DEFAULT.min(window_ms)))))
}

fn build_witnesses(inputs: &Inputs) -> bc_core::Result<Option<Task>> {
    if inputs.witnesses.is_empty() {
        return Ok(None);
    }
    let reconciler = witnesses::Witnesses::new(log(inputs, witnesses::NAME)?, inputs.witnesses.clone())?;
    Ok(Some(Task::Driven(Box::new(reconciler), Schedule::every(witnesses::TICK_MS))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reconciler_is_registered_once() {
        let mut names = NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), REGISTRY.len(), "a name is registered twice: {NAMES:?}");
        for name in NAMES {
            assert_eq!(find(name).map(|r| r.name), Some(name));
        }
        assert!(NAMES.contains(&witnesses::NAME), "witnesses is a reconciler too");
    }
}
