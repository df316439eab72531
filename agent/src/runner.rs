//! What the node does and journals: commands, run once each (the journal records how far each
//! got, so a redelivered command runs nothing twice), and periodic observations of the machine.
//! Every result is journaled before it is sent.
//!
//! [`Runner`] runs `ping` and the GPU commands; [`Instances`] (a node with a hypervisor) adds
//! `instance.apply`, and [`Agent`] is the two together, which `bcd node` runs. Locks are taken
//! in one order: the instance ledger, then the holds ledger.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bc_core::agent::SignedEntry;
use bc_core::id::NodeId;
use ed25519_dalek::SigningKey;
use serde_json::{Value, json};

use crate::binding::GpuBinding;
use crate::holds::{Hold, HoldArgs, HoldDecision, Ledger, LedgerFile, decide_hold};
use crate::hypervisor::{DomainSpec, DomainState, Hypervisor};
use crate::images::ImageCache;
use crate::instances::{
    ApplyArgs, ApplyDecision, BadArgs, DiskFormat, GIB, INSTANCES_MAX, Instance, InstanceLedger, InstanceLedgerFile, Report,
    Request, Step, decide_apply, parse_apply,
};
use crate::inventory::InventorySource;
use crate::journal::{Draft, Journal, JournalError, Stage};
use crate::update::{RollbackArgs, RollbackPlan, UPDATE_UNCONFIGURED, UpdateArgs, UpdatePlan, Updater};

/// The command that has the agent take a signed release.
pub const AGENT_UPDATE: &str = "agent.update";
/// The command that has the agent go back to the version its previous slot holds.
pub const AGENT_ROLLBACK: &str = "agent.rollback";
/// What every start of `bcd node` journals, on `agent/NODE`.
pub const NODE_AGENT_STARTED: &str = "node.agent_started";

/// The longest reason a GPU report gives, and the longest `holdUnavailable`, in bytes: within
/// what the gateway takes (1024 and 256), or the entry would be refused and block the journal.
pub const REASON_BYTES_MAX: usize = 1000;
pub const HOLD_UNAVAILABLE_BYTES_MAX: usize = 250;

/// `text` cut to at most `max` bytes, on a character boundary.
fn truncate_bytes(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
}

/// What every agent does.
pub const CAPABILITIES: &[&str] = &["command.ping"];
/// Said in `Hello` by an agent whose binding can set GPUs aside.
pub const CAPABILITY_GPU_HOLD: &str = "gpu.hold";
/// Said in `Hello` by an agent with a hypervisor.
pub const CAPABILITY_INSTANCE_APPLY: &str = "instance.apply";
/// How long a graceful stop (an ACPI shutdown) is given before the domain is stopped at once.
pub const INSTANCE_STOP_GRACE_MS: u64 = 60_000;
/// How often a domain shutting down is looked at.
pub const INSTANCE_STOP_POLL_MS: u64 = 250;
/// The answer of an agent without a hypervisor.
pub const NO_HYPERVISOR: &str =
    "no-hypervisor: this node runs no instances (hint: set [hypervisor] uri in config.toml, in a libvirt build)";

const _: () = assert!(INSTANCE_STOP_POLL_MS < INSTANCE_STOP_GRACE_MS);
const _: () = assert!(INSTANCE_STOP_GRACE_MS / 1000 < crate::images::INSTANCE_APPLY_DEADLINE_S);

pub struct Runner {
    pub journal: Arc<Journal>,
    pub key: SigningKey,
    pub node: NodeId,
    pub version: String,
    pub binding: Box<dyn GpuBinding>,
    pub inventory: Arc<dyn InventorySource>,
    /// The GPUs held, by reservation; the lock is held across a whole hold or release, so
    /// they run one at a time.
    pub ledger: tokio::sync::Mutex<Ledger>,
    pub ledger_file: LedgerFile,
    /// The approver-set roots this node pins (`command_root_sha256`): with any, a command a batch
    /// released runs only once [`batch_release_refusal`] finds nothing to refuse.
    pub command_roots: Vec<String>,
}

/// Whether this node refuses `command` for its batch release: `None` when it pins no root
/// (`command_root_sha256`) or the command came from no batch; otherwise the release is verified
/// here ([`bc_core::approval::verify_release`]: the pinned set's chain, the quorum of approvals,
/// this command as the leaf at its index) and the refusal is `batch-release-refused: WHY`. Pure.
pub fn batch_release_refusal(roots: &[String], node_id: &str, command: &bc_proto::Command) -> Option<String> {
    if roots.is_empty() || command.release_json.is_empty() {
        return None;
    }
    let refused = |why: String| Some(format!("batch-release-refused: {why}"));
    let release: bc_core::approval::BatchRelease = match serde_json::from_str(&command.release_json) {
        Ok(release) => release,
        Err(e) => return refused(format!("the release does not parse: {e}")),
    };
    let args: Value = match serde_json::from_str(&command.args_json) {
        Ok(args) => args,
        Err(e) => return refused(format!("the command's arguments do not parse: {e}")),
    };
    bc_core::approval::verify_release(roots, node_id, &command.kind, &args, &release).err().and_then(refused)
}

/// What a command ended in: its last journal entry's type, subject and payload.
/// A ledgered apply's arguments, or why not: `Err((its subject's id if read, the reason))`.
type ParsedArgs<A> = Result<A, (Option<String>, String)>;

/// What a ledgered apply (`sandbox.apply`, `sandbox_volume.apply`) is made of: its subject's
/// stream kind, how its arguments parse (`Err((subject id if read, reason))`), its subject's id,
/// how what became of the subject is reported, and the reason a node without the runtime gives.
struct LedgeredApply<A, O> {
    stream: &'static str,
    parse: fn(&str) -> ParsedArgs<A>,
    subject: fn(&A) -> &str,
    report: fn(&str, &Result<O, String>) -> (&'static str, Value),
    no_runtime: &'static str,
}

struct Finish {
    entry_type: &'static str,
    subject: Option<String>,
    payload: Value,
}

impl Finish {
    fn succeeded(payload: Value) -> Self {
        Self { entry_type: "command.succeeded", subject: None, payload }
    }

    fn failed(reason: impl Into<String>) -> Self {
        Self { entry_type: "command.failed", subject: None, payload: json!({ "reason": reason.into() }) }
    }

    /// An instance report (`instance.observed`, `instance.apply_failed`) on the instance's stream.
    fn instance(entry_type: &'static str, instance_id: &str, payload: Value) -> Self {
        Self { entry_type, subject: Some(format!("instance/{instance_id}")), payload }
    }

    fn instance_observed(instance_id: &str, generation: u64, report: &Report) -> Self {
        Self::instance("instance.observed", instance_id, report.payload(instance_id, generation))
    }

    fn instance_failed(instance_id: &str, generation: u64, reason: &str) -> Self {
        let payload = json!({
            "instanceId": instance_id, "generation": generation, "reason": truncate_bytes(reason, REASON_BYTES_MAX),
        });
        Self::instance("instance.apply_failed", instance_id, payload)
    }

    /// A GPU report (`gpu.held`, …) on the reservation's stream.
    fn gpu(entry_type: &'static str, reservation_id: &str, gpus: &[crate::binding::HeldGpu], reason: Option<String>) -> Self {
        let mut payload = json!({
            "reservationId": reservation_id,
            "gpus": gpus.iter().map(|g| g.uuid.clone()).collect::<Vec<_>>(),
        });
        if let Some(reason) = reason {
            payload["reason"] = json!(truncate_bytes(&reason, REASON_BYTES_MAX));
        }
        Self { entry_type, subject: Some(format!("reservation/{reservation_id}")), payload }
    }
}

impl Runner {
    /// The runner for the machine `config` names: its inventory source, its GPU binding and the
    /// ledger of its holds in the data directory.
    pub fn for_config(
        config: &crate::config::Config,
        journal: Arc<Journal>,
        key: SigningKey,
        node: NodeId,
        version: String,
    ) -> Result<Self, String> {
        let hw = &config.hardware;
        let inventory: Arc<dyn InventorySource> = crate::inventory::source(hw.root.as_deref(), hw.fake_seed)?.into();
        let ledger_file = LedgerFile::new(&config.data_dir);
        let ledger = ledger_file.load()?;
        Ok(Self {
            journal,
            key,
            node,
            version,
            binding: crate::binding::binding(hw.root.as_deref(), hw.fake_seed, hw.fake_hold_refusal.clone()),
            inventory,
            ledger: tokio::sync::Mutex::new(ledger),
            ledger_file,
            command_roots: config.command_roots()?,
        })
    }

    async fn write(&self, draft: Draft, out: &mut Vec<SignedEntry>) -> Result<(), JournalError> {
        out.push(self.journal.append(&self.key, draft).await?);
        Ok(())
    }

    /// Journals an entry about this node itself, on its stream `agent/NODE`.
    async fn journal_about_node(&self, now_ms: u64, entry_type: &str, payload: Value) -> Result<SignedEntry, JournalError> {
        let subject = format!("agent/{}", self.node);
        let draft = Draft { at_ms: now_ms, entry_type: entry_type.to_owned(), subject, payload, command: None };
        self.journal.append(&self.key, draft).await
    }

    fn draft(&self, now_ms: u64, entry_type: &str, command: &str, payload: Value, stage: Stage) -> Draft {
        self.draft_on(now_ms, entry_type, command, format!("command/{command}"), payload, stage)
    }

    fn draft_on(&self, now_ms: u64, entry_type: &str, command: &str, subject: String, mut payload: Value, stage: Stage) -> Draft {
        payload["commandId"] = json!(command);
        payload["nodeId"] = json!(self.node.to_string());
        Draft { at_ms: now_ms, entry_type: entry_type.to_owned(), subject, payload, command: Some((command.to_owned(), stage)) }
    }

    /// The capabilities this agent says in `Hello`.
    pub fn capabilities(&self) -> Vec<String> {
        let mut out: Vec<String> = CAPABILITIES.iter().map(|c| (*c).to_owned()).collect();
        if self.binding.unprivileged().is_none() {
            out.push(CAPABILITY_GPU_HOLD.to_owned());
        }
        out
    }

    /// `gpu.hold`: decided on the ledger and the machine's inventory, bound, recorded, then
    /// reported (`gpu.held` or `gpu.hold_failed` with the reason).
    async fn hold(&self, command_id: &str, args_json: &str) -> Finish {
        let args: HoldArgs = match command_args("gpu.hold", args_json) {
            Ok(args) => args,
            Err(bad) => return bad,
        };
        if args.reservation_id.parse::<bc_core::id::ReservationId>().is_err() {
            return Finish::failed("bad-args: gpu.hold names no reservation");
        }
        let failed = |reason: String| Finish::gpu("gpu.hold_failed", &args.reservation_id, &[], Some(reason));
        let mut ledger = self.ledger.lock().await;
        // What the node holds comes first: a hold recorded before a crash is held. The ledger is
        // written before the machine is touched, so the binding may not have happened: it is
        // applied again (binding is idempotent). If that fails the entry stays, and the release
        // the control plane sends after a failed hold gives the GPUs back.
        if let Some(hold) = ledger.holds.get(&args.reservation_id)
            && hold.release_command_id.is_none()
        {
            let same = hold.gpus.iter().map(|g| g.uuid.as_str()).eq(args.gpu_uuids.iter().map(String::as_str));
            if same {
                return match self.binding.hold(&hold.gpus) {
                    Ok(()) => Finish::gpu("gpu.held", &args.reservation_id, &hold.gpus, None),
                    Err(reason) => failed(reason),
                };
            }
        }
        if let Some(reason) = self.binding.unprivileged() {
            return failed(reason);
        }
        let inventory = self.inventory.read();
        let gpus = match decide_hold(&ledger, &inventory, &args) {
            HoldDecision::AlreadyHeld(gpus) => return Finish::gpu("gpu.held", &args.reservation_id, &gpus, None),
            HoldDecision::Refuse(reason) => return failed(reason),
            HoldDecision::Bind(gpus) => gpus,
        };
        // Recorded first: a crash after the binding can never leave GPUs bound that the ledger
        // does not name (a release would not know to give them back).
        let mut next = ledger.clone();
        let hold = Hold { command_id: command_id.to_owned(), gpus: gpus.clone(), release_command_id: None };
        next.holds.insert(args.reservation_id.clone(), hold);
        if let Err(e) = self.ledger_file.save(&next) {
            return failed(format!("ledger-failed: {e}"));
        }
        *ledger = next;
        if let Err(reason) = self.binding.hold(&gpus) {
            // The binding undid itself (all or nothing): not held.
            let mut back = ledger.clone();
            back.holds.remove(&args.reservation_id);
            match self.ledger_file.save(&back) {
                Ok(()) => *ledger = back,
                Err(e) => tracing::error!(error = %e, "forgetting a failed hold in the ledger failed; the release clears it"),
            }
            return failed(reason);
        }
        tracing::info!(reservation = %args.reservation_id, gpus = gpus.len(), "GPUs held");
        Finish::gpu("gpu.held", &args.reservation_id, &gpus, None)
    }

    /// `gpu.release`: deletes the reservation's instances first (a domain holds its GPUs through
    /// passthrough; each is journaled `instance.observed` `absent`), then gives back what the
    /// ledger holds for the reservation (nothing held: released already), then reports
    /// `gpu.released`. A release the machine refuses keeps the GPUs in the ledger (no other
    /// reservation gets them), marked for [`Self::retry_releases`], and fails the command with
    /// the reason.
    async fn release(
        &self,
        command_id: &str,
        args_json: &str,
        instances: Option<&Instances>,
        now_ms: u64,
        out: &mut Vec<SignedEntry>,
    ) -> Result<Finish, JournalError> {
        let args: HoldArgs = match serde_json::from_str::<HoldArgs>(args_json) {
            Ok(args) if args.reservation_id.parse::<bc_core::id::ReservationId>().is_ok() => args,
            _ => return Ok(Finish::failed("bad-args: gpu.release names no reservation")),
        };
        // The instance ledger before the holds ledger, everywhere.
        let mut instance_ledger = match instances {
            Some(instances) => Some(instances.ledger.lock().await),
            None => None,
        };
        let mut ledger = self.ledger.lock().await;
        let deleted = match (instances, instance_ledger.as_deref_mut()) {
            (Some(instances), Some(il)) => self.delete_instances_of(instances, il, &args.reservation_id, now_ms, out).await?,
            _ => Ok(()),
        };
        let Some(hold) = ledger.holds.get(&args.reservation_id).cloned() else {
            return Ok(match deleted {
                Ok(()) => Finish::gpu("gpu.released", &args.reservation_id, &[], None),
                Err(reason) => Finish::failed(format!("release-failed: {reason}")),
            });
        };
        if let Err(reason) = deleted.and_then(|()| self.binding.release(&hold.gpus)) {
            let mut next = ledger.clone();
            if let Some(h) = next.holds.get_mut(&args.reservation_id) {
                h.release_command_id = Some(command_id.to_owned());
            }
            if self.ledger_file.save(&next).is_ok() {
                *ledger = next;
            }
            tracing::warn!(reservation = %args.reservation_id, reason = %reason, "a release failed; retrying");
            return Ok(Finish::failed(format!("release-failed: {reason} (the node retries)")));
        }
        let mut next = ledger.clone();
        next.holds.remove(&args.reservation_id);
        if let Err(e) = self.ledger_file.save(&next) {
            return Ok(Finish::failed(format!("ledger-failed: {e}")));
        }
        *ledger = next;
        tracing::info!(reservation = %args.reservation_id, gpus = hold.gpus.len(), "GPUs released");
        Ok(Finish::gpu("gpu.released", &args.reservation_id, &hold.gpus, None))
    }

    /// Deletes every instance of `ledger` on `reservation_id`, journaling each `absent` (no
    /// command: the release's own answer is `gpu.released`). `Ok(Err(reason))`: one could not
    /// be deleted; the ones before it are gone.
    async fn delete_instances_of(
        &self,
        instances: &Instances,
        ledger: &mut InstanceLedger,
        reservation_id: &str,
        now_ms: u64,
        out: &mut Vec<SignedEntry>,
    ) -> Result<Result<(), String>, JournalError> {
        let on: Vec<(String, u64)> = ledger
            .instances
            .iter()
            .filter(|(_, i)| i.reservation_id == reservation_id)
            .map(|(id, i)| (id.clone(), i.generation))
            .collect();
        for (instance_id, generation) in on {
            if let Err(reason) = instances.remove(ledger, &instance_id, generation).await {
                return Ok(Err(reason));
            }
            tracing::info!(instance = %instance_id, reservation = %reservation_id, "instance deleted for its reservation's release");
            self.journal_instance(now_ms, &instance_id, generation, &Report::absent(), out).await?;
        }
        Ok(Ok(()))
    }

    /// Journals what the node says of an instance by itself (no command).
    async fn journal_instance(
        &self,
        now_ms: u64,
        instance_id: &str,
        generation: u64,
        report: &Report,
        out: &mut Vec<SignedEntry>,
    ) -> Result<(), JournalError> {
        let mut payload = report.payload(instance_id, generation);
        payload["nodeId"] = json!(self.node.to_string());
        let subject = format!("instance/{instance_id}");
        let draft = Draft { at_ms: now_ms, entry_type: "instance.observed".into(), subject, payload, command: None };
        self.write(draft, out).await
    }

    /// `instance.apply`: decided on the instance ledger, the holds ledger and what the
    /// hypervisor says, recorded, carried out, then answered with what the hypervisor says
    /// (`instance.observed`) or why not (`instance.apply_failed`).
    async fn instance_apply(&self, command_id: &str, args_json: &str, instances: Option<&Instances>) -> Finish {
        let apply = match parse_apply(args_json) {
            Ok(apply) => apply,
            Err(BadArgs { head: Some((instance_id, generation)), reason }) => {
                return Finish::instance_failed(&instance_id, generation, &reason);
            }
            Err(BadArgs { head: None, reason }) => return Finish::failed(reason),
        };
        let (id, generation) = (apply.instance_id.as_str(), apply.generation);
        let failed = |reason: String| Finish::instance_failed(id, generation, &reason);
        let Some(instances) = instances else { return failed(NO_HYPERVISOR.into()) };
        let mut ledger = instances.ledger.lock().await;
        let entry = ledger.instances.get(id).cloned();
        let observed = match instances.hypervisor.observe(id) {
            Ok(observed) => observed,
            Err(e) => return failed(format!("hypervisor: {e}")),
        };
        let holds = self.ledger.lock().await.clone();
        let (gpus, steps) = match decide_apply(entry.as_ref(), &holds, &apply, observed.as_ref()) {
            ApplyDecision::Stale { generation } => {
                let report = Report::of(observed.as_ref());
                instances.remember(id, &report);
                return Finish::instance_observed(id, generation, &report);
            }
            ApplyDecision::Refuse(reason) => return failed(reason),
            ApplyDecision::Delete => {
                return match instances.remove(&mut ledger, id, generation).await {
                    Ok(()) => {
                        tracing::info!(instance = %id, "instance deleted");
                        Finish::instance_observed(id, generation, &Report::absent())
                    }
                    Err(reason) => failed(reason),
                };
            }
            ApplyDecision::Apply { gpus, steps } => (gpus, steps),
        };
        // `decide_apply` answers every delete `Delete`: what is left is a make.
        let Request::Make { start, args } = &apply.request else {
            return failed("bad-args: a delete is not made".into());
        };
        if entry.is_none() && ledger.instances.len() >= INSTANCES_MAX {
            return failed(format!("bad-args: this node runs {INSTANCES_MAX} instances, its most"));
        }
        // Recorded first: a crash part way leaves the ledger naming what the machine may have,
        // so a delete (or the reservation's release) knows to clean it up.
        let mut next = ledger.clone();
        next.instances.insert(id.to_owned(), ledger_entry(command_id, generation, *start, args, gpus.clone()));
        if let Err(e) = instances.ledger_file.save(&next) {
            return failed(format!("disk: recording the instance: {e}"));
        }
        *ledger = next;
        let spec = match instances.domain_spec(id, args, gpus) {
            Ok(spec) => spec,
            Err(reason) => return failed(reason),
        };
        if let Err(reason) = instances.run_steps(id, args, &spec, steps).await {
            // What it is now is what the control plane learns next, not a change to report.
            if let Ok(report) = instances.report(id) {
                instances.remember(id, &report);
            }
            tracing::info!(instance = %id, reason = %reason, "an apply failed");
            return failed(reason);
        }
        match instances.report(id) {
            Ok(report) => {
                instances.remember(id, &report);
                tracing::info!(instance = %id, generation, state = report.state, "instance applied");
                Finish::instance_observed(id, generation, &report)
            }
            Err(reason) => failed(reason),
        }
    }

    /// `agent.update`: decided by [`crate::update::decide_update`] and carried out by the
    /// [`Updater`]. `None`: not finished here (the new agent confirms, or the watchdog's
    /// rollback fails it at the old agent's start).
    async fn agent_update(&self, command_id: &str, args_json: &str, update: Option<&Updater>, now_ms: u64) -> Option<Finish> {
        let Some(updater) = update else { return Some(Finish::failed(UPDATE_UNCONFIGURED)) };
        let args: UpdateArgs = match command_args("agent.update", args_json) {
            Ok(args) => args,
            Err(bad) => return Some(bad),
        };
        let refused = |reason: String| {
            tracing::warn!(command = %command_id, reason = %reason, "an update was refused");
            Some(Finish::failed(truncate_bytes(&reason, REASON_BYTES_MAX)))
        };
        match updater.decide(&args, Some(command_id), now_ms) {
            Err(reason) => refused(reason),
            Ok(UpdatePlan::AwaitingConfirmation) => None,
            Ok(UpdatePlan::Already { version }) => Some(already_running(updater, &version)),
            Ok(plan) => match updater.install(plan, Some(command_id), now_ms).await {
                Ok(binary) => {
                    updater.request_reexec(binary);
                    None
                }
                Err(reason) => refused(reason),
            },
        }
    }

    /// `agent.rollback`: decided by [`crate::update::decide_rollback`] and carried out by the
    /// [`Updater`]'s switch (as an update's). `None`: not finished here (the agent of the
    /// previous slot confirms, or the watchdog's rollback fails it).
    async fn agent_rollback(&self, command_id: &str, args_json: &str, update: Option<&Updater>, now_ms: u64) -> Option<Finish> {
        let Some(updater) = update else { return Some(Finish::failed(UPDATE_UNCONFIGURED)) };
        let args: RollbackArgs = match command_args("agent.rollback", args_json) {
            Ok(args) => args,
            Err(bad) => return Some(bad),
        };
        let refused = |reason: String| {
            tracing::warn!(command = %command_id, reason = %reason, "a rollback was refused");
            Some(Finish::failed(truncate_bytes(&reason, REASON_BYTES_MAX)))
        };
        match updater.decide_rollback(&args, Some(command_id)) {
            Err(reason) => refused(reason),
            Ok(RollbackPlan::AwaitingConfirmation) => None,
            Ok(RollbackPlan::Already { version }) => Some(already_running(updater, &version)),
            Ok(plan) => match updater.roll_back(plan, Some(command_id), now_ms) {
                Ok(binary) => {
                    updater.request_reexec(binary);
                    None
                }
                Err(reason) => refused(reason),
            },
        }
    }

    /// Journals the end of an update command the runner left open: `command.succeeded` with
    /// `result` (the new agent, confirmed) or `command.failed` with the reason (a rollback).
    /// Nothing when the journal says it finished.
    pub async fn finish_update(
        &self,
        now_ms: u64,
        command_id: &str,
        outcome: Result<Value, String>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        let mut out = Vec::new();
        if self.journal.command_stage(command_id).await? == Some(Stage::Finished) {
            return Ok(out);
        }
        let finish = match outcome {
            Ok(result) => Finish::succeeded(json!({ "result": result })),
            Err(reason) => Finish::failed(truncate_bytes(&reason, REASON_BYTES_MAX)),
        };
        self.finish(now_ms, command_id, finish, &mut out).await?;
        Ok(out)
    }

    /// Journals `node.agent_started` (every start of `bcd node`): this agent's version, its
    /// slot (`""` without slots) and the version that ran before it, when known.
    pub async fn journal_agent_started(
        &self,
        now_ms: u64,
        slot: &str,
        previous_version: Option<&str>,
    ) -> Result<SignedEntry, JournalError> {
        let mut payload = json!({ "nodeId": self.node.to_string(), "version": self.version, "slot": slot });
        if let Some(previous) = previous_version {
            payload["previousVersion"] = json!(previous);
        }
        self.journal_about_node(now_ms, NODE_AGENT_STARTED, payload).await
    }

    /// Runs `command` unless the journal says it finished; returns the entries written. A node
    /// without instances: [`Agent::run`] runs them too.
    pub async fn run(&self, command: &bc_proto::Command, now_ms: u64) -> Result<Vec<SignedEntry>, JournalError> {
        self.run_with(command, now_ms, None).await
    }

    /// [`Self::run`] on a node whose instances are `instances`.
    pub async fn run_with(
        &self,
        command: &bc_proto::Command,
        now_ms: u64,
        instances: Option<&Instances>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        self.run_all(command, now_ms, instances, None).await
    }

    /// [`Self::run_with`] on a node that takes updates through `update`.
    async fn run_all(
        &self,
        command: &bc_proto::Command,
        now_ms: u64,
        instances: Option<&Instances>,
        update: Option<&Updater>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        let mut out = Vec::new();
        let id = command.command_id.as_str();
        if id.parse::<bc_core::id::CommandId>().is_err() {
            tracing::warn!("a command with a malformed id was ignored");
            return Ok(out);
        }
        let stage = self.journal.command_stage(id).await?;
        if stage == Some(Stage::Finished) {
            return Ok(out);
        }
        // A release runs whatever its deadline: the GPUs must come back.
        if now_ms > command.deadline_ms && command.kind != "gpu.release" {
            let reason = "deadline-passed: the deadline passed before the node ran it";
            let finish = match command.kind.as_str() {
                // A hold's answer goes to its reservation, which then goes back to its queue; one
                // the node holds already (bound before a crash) is answered as held.
                "gpu.hold" => match serde_json::from_str::<HoldArgs>(&command.args_json) {
                    Ok(args) => {
                        let ledger = self.ledger.lock().await;
                        match ledger.holds.get(&args.reservation_id).filter(|h| h.release_command_id.is_none()) {
                            Some(hold) => Finish::gpu("gpu.held", &args.reservation_id, &hold.gpus, None),
                            None => Finish::gpu("gpu.hold_failed", &args.reservation_id, &[], Some(reason.into())),
                        }
                    }
                    Err(_) => Finish::failed(reason),
                },
                // An apply's answer goes to its instance, which the control plane applies again.
                "instance.apply" => match parse_apply(&command.args_json) {
                    Ok(apply) => Finish::instance_failed(&apply.instance_id, apply.generation, reason),
                    Err(BadArgs { head: Some((instance_id, generation)), .. }) => {
                        Finish::instance_failed(&instance_id, generation, reason)
                    }
                    Err(BadArgs { head: None, .. }) => Finish::failed(reason),
                },
                _ => Finish::failed(reason),
            };
            self.finish(now_ms, id, finish, &mut out).await?;
            return Ok(out);
        }
        if let Some(refusal) = batch_release_refusal(&self.command_roots, &self.node.to_string(), command) {
            tracing::warn!(command = %id, reason = %refusal, "a batch command's release was refused");
            self.finish(now_ms, id, Finish::failed(truncate_bytes(&refusal, REASON_BYTES_MAX)), &mut out).await?;
            return Ok(out);
        }
        if stage.is_none() {
            self.write(self.draft(now_ms, "command.started", id, json!({}), Stage::Started), &mut out).await?;
        }
        let finish = match command.kind.as_str() {
            "ping" => Finish::succeeded(json!({ "result": { "pong": true, "agentVersion": self.version } })),
            "gpu.hold" => self.hold(id, &command.args_json).await,
            "gpu.release" => self.release(id, &command.args_json, instances, now_ms, &mut out).await?,
            "instance.apply" => self.instance_apply(id, &command.args_json, instances).await,
            AGENT_UPDATE => match self.agent_update(id, &command.args_json, update, now_ms).await {
                Some(finish) => finish,
                // Switched (the driver re-executes) or waiting for the new agent's confirmation:
                // the new agent answers it.
                None => return Ok(out),
            },
            AGENT_ROLLBACK => match self.agent_rollback(id, &command.args_json, update, now_ms).await {
                Some(finish) => finish,
                // Switched back (the driver re-executes) or waiting for the confirmation of the
                // agent of the previous slot, which answers it.
                None => return Ok(out),
            },
            other => Finish::failed(format!("unknown-kind: this agent does not know {:?}", bc_core::id::truncate(other, 40))),
        };
        self.finish(now_ms, id, finish, &mut out).await?;
        tracing::info!(command = %id, kind = %bc_core::id::truncate(&command.kind, 40), "command ran");
        Ok(out)
    }

    /// `sandbox.apply`: run once (a finished command is not run again), past its deadline
    /// answered `sandbox.apply_failed` unrun, else carried out by `sandboxes` (the ledger first,
    /// then the runtime) and answered with what the sandbox then is (`sandbox.observed`) or why
    /// not (`sandbox.apply_failed`), on the sandbox's stream.
    pub async fn run_sandbox_apply(
        &self,
        command: &bc_proto::Command,
        now_ms: u64,
        sandboxes: Option<&crate::sandboxes::Sandboxes>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        let shape = LedgeredApply {
            stream: "sandbox",
            parse: crate::sandboxes::parse_args,
            subject: |args| &args.sandbox_id,
            report: crate::sandboxes::report_payload,
            no_runtime: "no-runtime: this node runs no sandboxes (hint: install runsc, Debian's package runsc)",
        };
        let run = sandboxes.map(|s| async move |id: &str, args: &crate::sandboxes::SandboxArgs| s.apply(id, args).await);
        self.run_ledgered_apply(command, now_ms, shape, run).await
    }

    /// `sandbox.snapshot`: run once, past its deadline answered `sandbox_snapshot.apply_failed`
    /// unrun, else carried out by `sandboxes` (the snapshot ledger first, then the runtime:
    /// [`crate::sandbox_snapshots`]) and answered `sandbox_snapshot.observed` (ready with its
    /// digest and size, or absent) or why not, on the snapshot's stream.
    pub async fn run_snapshot_apply(
        &self,
        command: &bc_proto::Command,
        now_ms: u64,
        sandboxes: Option<&crate::sandboxes::Sandboxes>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        let shape = LedgeredApply {
            stream: "sandbox_snapshot",
            parse: crate::sandbox_snapshots::parse_args,
            subject: |args| &args.snapshot_id,
            report: crate::sandbox_snapshots::report_payload,
            no_runtime: "no-runtime: this node runs no sandboxes, so it takes no snapshots (hint: install runsc)",
        };
        let run =
            sandboxes.map(|s| async move |_id: &str, args: &crate::sandbox_snapshots::SnapshotArgs| s.apply_snapshot(args).await);
        self.run_ledgered_apply(command, now_ms, shape, run).await
    }

    /// `sandbox_volume.apply`: run once, past its deadline answered `sandbox_volume.apply_failed`
    /// unrun, else carried out by `sandboxes` (the volume ledger first, then the disk) and
    /// answered with what the volume then is (`sandbox_volume.observed`) or why not
    /// (`sandbox_volume.apply_failed`), on the volume's stream.
    pub async fn run_volume_apply(
        &self,
        command: &bc_proto::Command,
        now_ms: u64,
        sandboxes: Option<&crate::sandboxes::Sandboxes>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        let shape = LedgeredApply {
            stream: "sandbox_volume",
            parse: crate::volumes::parse_args,
            subject: |args| &args.volume_id,
            report: crate::volumes::report_payload,
            no_runtime: "no-runtime: this node runs no sandboxes, so it keeps no volumes (hint: install runsc)",
        };
        let run = sandboxes.map(|s| async move |id: &str, args: &crate::volumes::VolumeArgs| s.apply_volume(id, args).await);
        self.run_ledgered_apply(command, now_ms, shape, run).await
    }

    /// A command the node carries out through a ledger of its own (`shape`): run once (a finished
    /// command is not run again); arguments that do not parse answered failed (on the subject's
    /// stream when its id was read); past its deadline answered failed unrun; else `run` (none:
    /// the node has no runtime for it) after `command.started`, and answered with what `run`
    /// made of the subject or why not, on the subject's stream.
    async fn run_ledgered_apply<A, O>(
        &self,
        command: &bc_proto::Command,
        now_ms: u64,
        shape: LedgeredApply<A, O>,
        run: Option<impl AsyncFnOnce(&str, &A) -> Result<O, String>>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        let mut out = Vec::new();
        let id = command.command_id.as_str();
        if id.parse::<bc_core::id::CommandId>().is_err() {
            tracing::warn!("a command with a malformed id was ignored");
            return Ok(out);
        }
        let stage = self.journal.command_stage(id).await?;
        if stage == Some(Stage::Finished) {
            return Ok(out);
        }
        let args = match (shape.parse)(&command.args_json) {
            Ok(args) => args,
            Err((Some(subject), reason)) => {
                let (entry_type, payload) = (shape.report)(&subject, &Err(reason));
                let finish = Finish { entry_type, subject: Some(format!("{}/{subject}", shape.stream)), payload };
                self.finish(now_ms, id, finish, &mut out).await?;
                return Ok(out);
            }
            Err((None, reason)) => {
                self.finish(now_ms, id, Finish::failed(reason), &mut out).await?;
                return Ok(out);
            }
        };
        let outcome = if now_ms > command.deadline_ms {
            Err("deadline-passed: the deadline passed before the node ran it".to_owned())
        } else if let Some(run) = run {
            if stage.is_none() {
                self.write(self.draft(now_ms, "command.started", id, json!({}), Stage::Started), &mut out).await?;
            }
            run(id, &args).await
        } else {
            Err(shape.no_runtime.to_owned())
        };
        let subject = (shape.subject)(&args);
        let (entry_type, payload) = (shape.report)(subject, &outcome);
        let finish = Finish { entry_type, subject: Some(format!("{}/{subject}", shape.stream)), payload };
        self.finish(now_ms, id, finish, &mut out).await?;
        tracing::info!(command = %id, subject = %subject, kind = %command.kind, "a ledgered apply ran");
        Ok(out)
    }

    /// Retries the releases the machine refused; each that now succeeds leaves the ledger and
    /// is reported `gpu.released` for its command. Returns the entries written.
    pub async fn retry_releases(&self, now_ms: u64) -> Result<Vec<SignedEntry>, JournalError> {
        self.retry_releases_with(now_ms, None).await
    }

    /// [`Self::retry_releases`] on a node whose instances are `instances`: a release's
    /// instances are deleted first.
    pub async fn retry_releases_with(
        &self,
        now_ms: u64,
        instances: Option<&Instances>,
    ) -> Result<Vec<SignedEntry>, JournalError> {
        let mut out = Vec::new();
        // The instance ledger before the holds ledger; an apply holding it (an image fetch can
        // take minutes) is not waited for: the next tick retries.
        let mut instance_ledger = match instances.map(|i| i.ledger.try_lock()) {
            None => None,
            Some(Ok(guard)) => Some(guard),
            Some(Err(_)) => return Ok(out),
        };
        let mut ledger = self.ledger.lock().await;
        let stuck: Vec<(String, Hold)> =
            ledger.holds.iter().filter(|(_, h)| h.release_command_id.is_some()).map(|(r, h)| (r.clone(), h.clone())).collect();
        for (reservation_id, hold) in stuck {
            let Some(command_id) = hold.release_command_id.as_deref() else { continue };
            if let (Some(instances), Some(il)) = (instances, instance_ledger.as_deref_mut())
                && self.delete_instances_of(instances, il, &reservation_id, now_ms, &mut out).await?.is_err()
            {
                continue;
            }
            if self.binding.release(&hold.gpus).is_err() {
                continue;
            }
            let mut next = ledger.clone();
            next.holds.remove(&reservation_id);
            if let Err(e) = self.ledger_file.save(&next) {
                tracing::error!(error = %e, "recording a retried release failed");
                continue;
            }
            *ledger = next;
            tracing::info!(reservation = %reservation_id, "a release that failed went through");
            self.finish(now_ms, command_id, Finish::gpu("gpu.released", &reservation_id, &hold.gpus, None), &mut out).await?;
        }
        Ok(out)
    }

    async fn finish(&self, now_ms: u64, id: &str, finish: Finish, out: &mut Vec<SignedEntry>) -> Result<(), JournalError> {
        let draft = match finish.subject {
            Some(subject) => self.draft_on(now_ms, finish.entry_type, id, subject, finish.payload, Stage::Finished),
            None => self.draft(now_ms, finish.entry_type, id, finish.payload, Stage::Finished),
        };
        self.write(draft, out).await
    }

    /// Journals an observation of the machine: uptime, load and free memory, from `/proc`.
    pub async fn observe(&self, now_ms: u64) -> Result<SignedEntry, JournalError> {
        let observed = observe_machine();
        let mut payload = json!({ "nodeId": self.node.to_string() });
        for (key, value) in observed {
            payload[key] = json!(value);
        }
        self.journal_about_node(now_ms, "node.observed", payload).await
    }
}

/// What `/proc` says, as integers (the log holds no floats).
fn observe_machine() -> Vec<(&'static str, u64)> {
    let mut out = Vec::new();
    let first_number = |text: &str| text.split_whitespace().next().and_then(|n| n.parse::<f64>().ok());
    if let Some(uptime) = std::fs::read_to_string("/proc/uptime").ok().as_deref().and_then(first_number) {
        out.push(("uptimeS", uptime as u64));
    }
    if let Some(load) = std::fs::read_to_string("/proc/loadavg").ok().as_deref().and_then(first_number) {
        out.push(("loadAvg1Milli", (load * 1000.0) as u64));
    }
    if let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo")
        && let Some(kib) = meminfo.lines().find_map(|l| l.strip_prefix("MemAvailable:")).and_then(first_number)
    {
        out.push(("memAvailableKiB", kib as u64));
    }
    out
}

/// The journal payload of an inventory (`node.inventory_reported`): integers and text only. It
/// says what the agent can do with the machine too: its capabilities (`gpu.hold` when its
/// binding can set GPUs aside) and, when it cannot, why (`holdUnavailable`).
pub fn inventory_payload(
    node: &NodeId,
    inventory: &crate::inventory::Inventory,
    capabilities: &[String],
    hold_unavailable: Option<&str>,
    volume_file_system_bytes: Option<u64>,
) -> Value {
    let mut gpus = Vec::new();
    for g in &inventory.gpus.gpus {
        gpus.push(json!({
            "index": g.index, "uuid": g.uuid, "model": g.model, "product": g.product,
            "vramGiB": g.vram_gib, "pciBusId": g.pci_bus_id, "nvlinkDomain": g.nvlink_domain,
        }));
    }
    let h = &inventory.host;
    let mut host = json!({
        "cpus": h.cpus,
        "memoryKiB": h.memory_kib,
        "disks": h.disks.iter().map(|d| json!({ "name": d.name, "bytes": d.bytes, "rotational": d.rotational })).collect::<Vec<_>>(),
    });
    for (key, value) in [("cpuModel", &h.cpu_model), ("vendor", &h.vendor), ("product", &h.product), ("serial", &h.serial)] {
        if let Some(v) = value {
            host[key] = json!(v);
        }
    }
    let mut payload = json!({ "nodeId": node.to_string(), "gpus": gpus, "host": host, "capabilities": capabilities });
    if let Some(reason) = hold_unavailable {
        payload["holdUnavailable"] = json!(truncate_bytes(reason, HOLD_UNAVAILABLE_BYTES_MAX));
    }
    if let Some(bytes) = volume_file_system_bytes {
        payload["volumeFileSystemBytes"] = json!(bytes);
    }
    for (key, value) in [
        ("driverVersion", &inventory.gpus.driver_version),
        ("cudaVersion", &inventory.gpus.cuda_version),
        ("unavailable", &inventory.gpus.unavailable),
    ] {
        if let Some(v) = value {
            payload[key] = json!(v);
        }
    }
    payload
}

impl Runner {
    /// Journals what the machine holds.
    pub async fn report_inventory(
        &self,
        now_ms: u64,
        inventory: &crate::inventory::Inventory,
    ) -> Result<SignedEntry, JournalError> {
        self.report_inventory_saying(now_ms, inventory, &self.capabilities()).await
    }

    /// [`Self::report_inventory`] with these capabilities.
    async fn report_inventory_saying(
        &self,
        now_ms: u64,
        inventory: &crate::inventory::Inventory,
        capabilities: &[String],
    ) -> Result<SignedEntry, JournalError> {
        self.report_inventory_with(now_ms, inventory, capabilities, None).await
    }

    /// [`Self::report_inventory_saying`] with the size of the volumes' file system, on a node
    /// that makes volumes.
    async fn report_inventory_with(
        &self,
        now_ms: u64,
        inventory: &crate::inventory::Inventory,
        capabilities: &[String],
        volume_file_system_bytes: Option<u64>,
    ) -> Result<SignedEntry, JournalError> {
        let unavailable = self.binding.unprivileged();
        let payload = inventory_payload(&self.node, inventory, capabilities, unavailable.as_deref(), volume_file_system_bytes);
        self.journal_about_node(now_ms, "node.inventory_reported", payload).await
    }

    /// Journals each instance whose (state, vCPUs, memory) is not what was last reported
    /// (`instance.observed` without a command, at the generation last applied). An apply in
    /// flight holds the ledger: this tick looks at nothing (the apply answers for itself).
    pub async fn observe_instances(&self, now_ms: u64, instances: &Instances) -> Result<Vec<SignedEntry>, JournalError> {
        let mut out = Vec::new();
        let Ok(ledger) = instances.ledger.try_lock() else { return Ok(out) };
        for (instance_id, entry) in &ledger.instances {
            let report = match instances.report(instance_id) {
                Ok(report) => report,
                Err(reason) => {
                    tracing::warn!(instance = %instance_id, reason = %reason, "observing an instance failed");
                    continue;
                }
            };
            if instances.last_reported(instance_id).as_ref() == Some(&report) {
                continue;
            }
            self.journal_instance(now_ms, instance_id, entry.generation, &report, &mut out).await?;
            instances.remember(instance_id, &report);
        }
        Ok(out)
    }
}

/// A command's arguments, or its failure `bad-args: TYPE: why` (the parser's message, cut short).
fn command_args<T: serde::de::DeserializeOwned>(command_type: &str, args_json: &str) -> Result<T, Finish> {
    serde_json::from_str(args_json)
        .map_err(|e| Finish::failed(format!("bad-args: {command_type}: {}", bc_core::id::truncate(&e.to_string(), 200))))
}

/// An update or rollback to the version this agent runs already: it succeeds at once, saying so.
fn already_running(updater: &Updater, version: &str) -> Finish {
    let slot = updater.active_slot().map(|s| s.as_str()).unwrap_or("");
    Finish::succeeded(json!({ "result": { "version": version, "slot": slot, "already": true } }))
}

/// The instance ledger's entry for a make: what it was asked, and the GPUs it was given.
fn ledger_entry(
    command_id: &str,
    generation: u64,
    start: bool,
    args: &ApplyArgs,
    gpus: Vec<crate::binding::HeldGpu>,
) -> Instance {
    Instance {
        reservation_id: args.reservation_id.clone(),
        generation,
        command_id: command_id.to_owned(),
        desired: if start { crate::instances::Desired::Running } else { crate::instances::Desired::Stopped },
        vcpus: args.vcpus,
        memory_mib: args.memory_mib,
        disk_gib: args.disk_gib,
        gpus,
        image_sha256: args.image.sha256.clone(),
        disk_format: args.image.disk_format,
    }
}

/// A node's instances: its hypervisor, its image cache, and the ledger of what it was asked to
/// run. A node without a hypervisor has none (and answers `instance.apply` `no-hypervisor`).
pub struct Instances {
    pub hypervisor: Box<dyn Hypervisor>,
    pub images: ImageCache,
    /// What the node was asked to run; the lock is held across a whole apply or delete (so they
    /// run one at a time) and taken before the holds ledger's, everywhere.
    pub ledger: tokio::sync::Mutex<InstanceLedger>,
    pub ledger_file: InstanceLedgerFile,
    /// `<data_dir>/instances`: a directory per instance, holding its disk.
    pub dir: PathBuf,
    /// How long a graceful stop is given before it is forced ([`INSTANCE_STOP_GRACE_MS`]).
    pub stop_grace_ms: u64,
    /// What was last journaled of each instance, so the observer journals changes only. In
    /// memory: after a restart each instance is reported once more.
    reported: std::sync::Mutex<BTreeMap<String, Report>>,
}

impl Instances {
    /// The instances of the node whose data directory is `data_dir`, on `hypervisor`.
    pub fn new(data_dir: &Path, hypervisor: Box<dyn Hypervisor>) -> Result<Self, String> {
        let ledger_file = InstanceLedgerFile::new(data_dir);
        let ledger = ledger_file.load()?;
        Ok(Self {
            hypervisor,
            images: ImageCache::new(data_dir)?,
            ledger: tokio::sync::Mutex::new(ledger),
            ledger_file,
            dir: data_dir.join("instances"),
            stop_grace_ms: INSTANCE_STOP_GRACE_MS,
            reported: std::sync::Mutex::new(BTreeMap::new()),
        })
    }

    /// The instances of the machine `config` names, if it has a hypervisor
    /// ([`crate::hypervisor::for_config`]).
    pub fn for_config(config: &crate::config::Config) -> Result<Option<Self>, String> {
        match crate::hypervisor::for_config(config)? {
            Some(hypervisor) => Ok(Some(Self::new(&config.data_dir, hypervisor)?)),
            None => Ok(None),
        }
    }

    /// The instance's disk: `<data_dir>/instances/<id>/disk.<format>`.
    pub fn disk_path(&self, instance_id: &str, format: DiskFormat) -> PathBuf {
        self.dir.join(instance_id).join(format!("disk.{}", format.as_str()))
    }

    /// The domain an apply defines: the instance's shape, its disk, and the GPUs it was given.
    fn domain_spec(&self, instance_id: &str, args: &ApplyArgs, gpus: Vec<crate::binding::HeldGpu>) -> Result<DomainSpec, String> {
        let disk = self.disk_path(instance_id, args.image.disk_format);
        let Some(disk_path) = disk.to_str() else {
            return Err(format!("disk: {} is not UTF-8", disk.display()));
        };
        Ok(DomainSpec {
            name: instance_id.to_owned(),
            vcpus: args.vcpus,
            memory_mib: args.memory_mib,
            disk_path: Some(disk_path.to_owned()),
            disk_format: args.image.disk_format.as_str().to_owned(),
            gpus,
        })
    }

    /// Carries out an apply's steps in order, up to the first that fails.
    async fn run_steps(&self, instance_id: &str, args: &ApplyArgs, spec: &DomainSpec, steps: Vec<Step>) -> Result<(), String> {
        for step in steps {
            match step {
                Step::PrepareDisk => self.prepare_disk(instance_id, args).await,
                Step::Stop { graceful } => self.stop(instance_id, graceful).await,
                Step::Define => self.hypervisor.define(spec).map_err(|e| format!("hypervisor: {e}")),
                Step::Start => self.hypervisor.start(instance_id).map_err(|e| format!("hypervisor: {e}")),
            }?;
        }
        Ok(())
    }

    /// What the hypervisor says of the instance now.
    fn report(&self, instance_id: &str) -> Result<Report, String> {
        let observed = self.hypervisor.observe(instance_id).map_err(|e| format!("hypervisor: {e}"))?;
        Ok(Report::of(observed.as_ref()))
    }

    fn last_reported(&self, instance_id: &str) -> Option<Report> {
        self.reported.lock().expect("reported lock").get(instance_id).cloned()
    }

    fn remember(&self, instance_id: &str, report: &Report) {
        self.reported.lock().expect("reported lock").insert(instance_id.to_owned(), report.clone());
    }

    /// The instance's disk, copied once from the image in the cache (fetched if need be); a
    /// raw one grown, sparse, to the disk size (never shrunk). A qcow2 disk keeps its image's
    /// virtual size. The copy is inspected before it takes the disk's name
    /// ([`crate::disk_header`]: `image-format`, a qcow2 naming a backing or data file, or an
    /// image that is not what it is registered as), and a qcow2 disk again at every apply (one
    /// copied before disks were inspected is refused too); so a domain is only ever defined on
    /// a disk that names no other file. (A raw disk is the guest's to write: only its copy is.)
    async fn prepare_disk(&self, instance_id: &str, args: &ApplyArgs) -> Result<(), String> {
        let disk = self.disk_path(instance_id, args.image.disk_format);
        let io = |path: &Path, e: std::io::Error| format!("disk: {}: {e}", path.display());
        if !tokio::fs::try_exists(&disk).await.map_err(|e| io(&disk, e))? {
            let cached = self.images.fetch(&args.image).await.map_err(|e| e.to_string())?;
            let dir = self.dir.join(instance_id);
            // 0711: the hypervisor's user (libvirt's qemu) may pass through to the disk, which
            // libvirt hands to it; nobody may list the directory.
            let mut builder = tokio::fs::DirBuilder::new();
            builder.recursive(true).mode(0o711);
            builder.create(&dir).await.map_err(|e| io(&dir, e))?;
            let partial = dir.join(format!("disk.{}.partial", args.image.disk_format.as_str()));
            let copied = async {
                let synced = async {
                    tokio::fs::copy(&cached, &partial).await?;
                    tokio::fs::File::open(&partial).await?.sync_all().await
                };
                synced.await.map_err(|e| io(&disk, e))?;
                // The copy the domain will use, not the cached image: nothing changes it between
                // this check and the use.
                crate::disk_header::inspect(&partial, args.image.disk_format).await?;
                let renamed = async {
                    tokio::fs::rename(&partial, &disk).await?;
                    tokio::fs::File::open(&dir).await?.sync_all().await
                };
                renamed.await.map_err(|e| io(&disk, e))
            };
            if let Err(reason) = copied.await {
                let _ = tokio::fs::remove_file(&partial).await;
                let _ = tokio::fs::remove_dir(&dir).await;
                return Err(reason);
            }
        } else if args.image.disk_format == DiskFormat::Qcow2 {
            crate::disk_header::inspect(&disk, DiskFormat::Qcow2).await?;
        }
        if args.image.disk_format == DiskFormat::Raw {
            let size_bytes = args.disk_gib.saturating_mul(GIB);
            let grown = async {
                let file = tokio::fs::OpenOptions::new().write(true).open(&disk).await?;
                if file.metadata().await?.len() < size_bytes {
                    file.set_len(size_bytes).await?;
                    file.sync_all().await?;
                }
                Ok::<(), std::io::Error>(())
            };
            grown.await.map_err(|e| io(&disk, e))?;
        }
        Ok(())
    }

    fn stopped(&self, instance_id: &str) -> Result<bool, String> {
        let observed = self.hypervisor.observe(instance_id).map_err(|e| format!("hypervisor: {e}"))?;
        Ok(observed.is_none_or(|o| o.state == DomainState::Stopped))
    }

    /// Stops the domain: an ACPI shutdown given [`Self::stop_grace_ms`], then at once; or at
    /// once.
    async fn stop(&self, instance_id: &str, graceful: bool) -> Result<(), String> {
        let hypervisor = |e: String| format!("hypervisor: {e}");
        if graceful {
            self.hypervisor.stop(instance_id, false).map_err(hypervisor)?;
            let mut waited_ms = 0;
            while !self.stopped(instance_id)? {
                if waited_ms >= self.stop_grace_ms {
                    tracing::info!(instance = %instance_id, grace_ms = self.stop_grace_ms, "a shutdown took its whole grace; stopping at once");
                    break;
                }
                tokio::time::sleep(Duration::from_millis(INSTANCE_STOP_POLL_MS)).await;
                waited_ms += INSTANCE_STOP_POLL_MS;
            }
            if self.stopped(instance_id)? {
                return Ok(());
            }
        }
        self.hypervisor.stop(instance_id, true).map_err(hypervisor)?;
        if self.stopped(instance_id)? { Ok(()) } else { Err(format!("hypervisor: {instance_id} did not stop")) }
    }

    /// Deletes the instance: its domain, its directory, its ledger entry (marked as being
    /// deleted first, so a crash part way leaves the ledger saying what is left to do).
    async fn remove(&self, ledger: &mut InstanceLedger, instance_id: &str, generation: u64) -> Result<(), String> {
        if let Some(entry) = ledger.instances.get(instance_id)
            && (entry.desired != crate::instances::Desired::Deleted || entry.generation < generation)
        {
            let mut next = ledger.clone();
            if let Some(entry) = next.instances.get_mut(instance_id) {
                entry.desired = crate::instances::Desired::Deleted;
                entry.generation = entry.generation.max(generation);
            }
            self.ledger_file.save(&next).map_err(|e| format!("disk: recording the delete: {e}"))?;
            *ledger = next;
        }
        self.hypervisor.delete(instance_id).map_err(|e| format!("hypervisor: {e}"))?;
        let dir = self.dir.join(instance_id);
        match tokio::fs::remove_dir_all(&dir).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(format!("disk: {}: {e}", dir.display())),
            _ => {}
        }
        if ledger.instances.contains_key(instance_id) {
            let mut next = ledger.clone();
            next.instances.remove(instance_id);
            self.ledger_file.save(&next).map_err(|e| format!("disk: recording the delete: {e}"))?;
            *ledger = next;
        }
        self.reported.lock().expect("reported lock").remove(instance_id);
        Ok(())
    }
}

/// What `bcd node` runs: the [`Runner`] (commands, GPUs, observations) and, on a node with a
/// hypervisor, its [`Instances`]. (The runner stands alone for a node without instances, which
/// is what the GPU property tests drive.)
pub struct Agent {
    pub runner: Runner,
    pub instances: Option<Instances>,
    /// The slots and the watchdog, with `[update]` (else `agent.update` is refused
    /// `update-unconfigured`).
    pub update: Option<Arc<Updater>>,
    /// Its sandboxes, on a node with a sandbox runtime (`runsc`).
    pub sandboxes: Option<Arc<crate::sandboxes::Sandboxes>>,
}

impl Agent {
    /// The capabilities this agent says in `Hello`: the runner's, and `instance.apply` and
    /// `hypervisor.<driver>` with a hypervisor.
    pub fn capabilities(&self) -> Vec<String> {
        let mut out = self.runner.capabilities();
        if let Some(instances) = &self.instances {
            out.push(CAPABILITY_INSTANCE_APPLY.to_owned());
            out.push(format!("{}{}", bc_core::agent::CAPABILITY_HYPERVISOR_PREFIX, instances.hypervisor.driver()));
        }
        if let Some(sandboxes) = &self.sandboxes {
            out.extend(sandboxes.capabilities());
        }
        out
    }

    pub async fn run(&self, command: &bc_proto::Command, now_ms: u64) -> Result<Vec<SignedEntry>, JournalError> {
        if command.kind == crate::sandboxes::SANDBOX_APPLY {
            return self.runner.run_sandbox_apply(command, now_ms, self.sandboxes.as_deref()).await;
        }
        if command.kind == crate::volumes::SANDBOX_VOLUME_APPLY {
            return self.runner.run_volume_apply(command, now_ms, self.sandboxes.as_deref()).await;
        }
        if command.kind == crate::sandbox_snapshots::SANDBOX_SNAPSHOT {
            return self.runner.run_snapshot_apply(command, now_ms, self.sandboxes.as_deref()).await;
        }
        self.runner.run_all(command, now_ms, self.instances.as_ref(), self.update.as_deref()).await
    }

    pub async fn retry_releases(&self, now_ms: u64) -> Result<Vec<SignedEntry>, JournalError> {
        self.runner.retry_releases_with(now_ms, self.instances.as_ref()).await
    }

    /// [`Runner::observe_instances`]; nothing without a hypervisor.
    pub async fn observe_instances(&self, now_ms: u64) -> Result<Vec<SignedEntry>, JournalError> {
        match &self.instances {
            Some(instances) => self.runner.observe_instances(now_ms, instances).await,
            None => Ok(Vec::new()),
        }
    }

    pub async fn report_inventory(
        &self,
        now_ms: u64,
        inventory: &crate::inventory::Inventory,
    ) -> Result<SignedEntry, JournalError> {
        let volume_bytes = self.sandboxes.as_ref().and_then(|s| s.volumes.file_system_bytes);
        self.runner.report_inventory_with(now_ms, inventory, &self.capabilities(), volume_bytes).await
    }
}

#[cfg(test)]
mod tests {
    use bc_core::agent::EntryBody;

    use super::*;
    use crate::binding::HeldGpu;
    use crate::images::tests::{ImageServer, sha256_of};

    /// As the node id prints: lowercase.
    const NODE: &str = "node_01j00000000000000000000000";
    const RSV: &str = "rsv_01J00000000000000000000000";
    const INST: &str = "inst_01J00000000000000000000000";
    const INST_2: &str = "inst_01J00000000000000000000001";
    const NOW_MS: u64 = 1_000_000;

    /// A machine with two GPUs whose binding holds anything.
    struct TwoGpus;

    impl GpuBinding for TwoGpus {
        fn unprivileged(&self) -> Option<String> {
            None
        }
        fn hold(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
            Ok(())
        }
        fn release(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
            Ok(())
        }
    }

    impl InventorySource for TwoGpus {
        fn read(&self) -> crate::inventory::Inventory {
            crate::holds::tests::inventory_of(2)
        }
    }

    /// The agent of a node in `dir` on `hypervisor` (`None`: a node without one).
    async fn agent(dir: &Path, hypervisor: Option<Box<dyn Hypervisor>>) -> Agent {
        let node: NodeId = NODE.parse().unwrap();
        let journal = Journal::open(&dir.join("journal.db"), node, u64::MAX).await.unwrap();
        let runner = Runner {
            journal: Arc::new(journal),
            key: SigningKey::from_bytes(&[7; 32]),
            node,
            version: "test".into(),
            binding: Box::new(TwoGpus),
            inventory: Arc::new(TwoGpus),
            ledger: tokio::sync::Mutex::new(Ledger::default()),
            ledger_file: LedgerFile::new(dir),
            command_roots: Vec::new(),
        };
        let instances = hypervisor.map(|h| Instances::new(dir, h).unwrap());
        Agent { runner, instances, update: None, sandboxes: None }
    }

    fn command(n: u32, kind: &str, args: Value) -> bc_proto::Command {
        bc_proto::Command {
            command_id: format!("cmd_01J000000000000000000000{n:02}"),
            kind: kind.into(),
            args_json: args.to_string(),
            deadline_ms: NOW_MS + 900_000,
            ..Default::default()
        }
    }

    fn hold(n: u32) -> bc_proto::Command {
        command(n, "gpu.hold", json!({ "reservationId": RSV, "gpuUuids": ["GPU-0", "GPU-1"] }))
    }

    fn release(n: u32) -> bc_proto::Command {
        command(n, "gpu.release", json!({ "reservationId": RSV }))
    }

    struct Image {
        url: String,
        sha256: String,
        /// `raw` or `qcow2`: what the image is registered as.
        disk_format: &'static str,
    }

    fn apply(n: u32, instance_id: &str, generation: u64, desired: &str, vcpus: u32, image: &Image) -> bc_proto::Command {
        command(
            n,
            "instance.apply",
            json!({
                "instanceId": instance_id, "generation": generation, "desired": desired, "reservationId": RSV,
                "vcpus": vcpus, "memoryMiB": 1024 * vcpus, "diskGiB": 1, "gpus": ["GPU-0", "GPU-1"],
                "image": { "imageId": "img_01J00000000000000000000000", "url": image.url, "sha256": image.sha256,
                           "diskFormat": image.disk_format },
            }),
        )
    }

    /// The entries `run` wrote, read back.
    fn bodies(entries: &[SignedEntry]) -> Vec<EntryBody> {
        entries.iter().map(|e| EntryBody::decode(&e.body).unwrap()).collect()
    }

    /// The entry that finished the command: its type, subject and payload.
    async fn run(agent: &Agent, command: &bc_proto::Command) -> EntryBody {
        let entries = bodies(&agent.run(command, NOW_MS).await.unwrap());
        entries.into_iter().last().expect("the command was answered")
    }

    fn observed(agent: &Agent, instance_id: &str) -> Option<crate::hypervisor::Observed> {
        agent.instances.as_ref().unwrap().hypervisor.observe(instance_id).unwrap()
    }

    fn instance_ledger(dir: &Path) -> InstanceLedger {
        InstanceLedgerFile::new(dir).load().unwrap()
    }

    async fn served(body: &[u8]) -> (ImageServer, Image) {
        let server = ImageServer::start(body.to_vec()).await;
        let image = Image { url: server.url.clone(), sha256: sha256_of(body), disk_format: "raw" };
        (server, image)
    }

    /// A node on the fake hypervisor holding `GPU-0` and `GPU-1` for [`RSV`], and an image
    /// served on loopback.
    async fn held_on_a_fake_hypervisor() -> (tempfile::TempDir, Agent, ImageServer, Image) {
        let dir = tempfile::tempdir().unwrap();
        let agent = agent(dir.path(), Some(Box::new(crate::hypervisor::Fake::default()))).await;
        let (server, image) = served(b"a raw disk image").await;
        assert_eq!(run(&agent, &hold(1)).await.entry_type, "gpu.held");
        (dir, agent, server, image)
    }

    #[tokio::test]
    async fn an_apply_fetches_verifies_and_caches_the_image_and_runs_the_instance() {
        let (dir, agent, server, image) = held_on_a_fake_hypervisor().await;
        assert!(agent.capabilities().contains(&CAPABILITY_INSTANCE_APPLY.to_owned()));

        let cmd = apply(2, INST, 1, "running", 2, &image);
        let answer = run(&agent, &cmd).await;
        assert_eq!((answer.entry_type.as_str(), answer.subject.as_str()), ("instance.observed", &*format!("instance/{INST}")));
        assert_eq!(
            answer.payload,
            json!({ "instanceId": INST, "generation": 1, "state": "running", "vcpus": 2, "memoryMiB": 2048,
                    "commandId": cmd.command_id, "nodeId": NODE })
        );
        assert_eq!(agent.runner.journal.command_stage(&cmd.command_id).await.unwrap(), Some(Stage::Finished));
        let disk = dir.path().join("instances").join(INST).join("disk.raw");
        assert_eq!(std::fs::metadata(&disk).unwrap().len(), GIB, "a raw disk is grown, sparse, to diskGiB");
        assert_eq!(server.requests(), 1);
        let recorded = &instance_ledger(dir.path()).instances[INST];
        assert_eq!((recorded.generation, recorded.gpus.len(), recorded.reservation_id.as_str()), (1, 2, RSV));

        // Another instance of the same image, and this one stopped: no fetch either time.
        let stopped = run(&agent, &apply(3, INST, 2, "stopped", 2, &image)).await;
        assert_eq!((stopped.payload["state"].as_str(), stopped.payload["generation"].as_u64()), (Some("stopped"), Some(2)));
        let second = run(&agent, &apply(4, INST_2, 1, "running", 1, &image)).await;
        assert_eq!(second.payload["state"], "running");
        assert_eq!(server.requests(), 1, "the image is the cached one, by its digest");

        // Resized while running: stopped, redefined, started again.
        let resized = run(&agent, &apply(5, INST_2, 2, "running", 4, &image)).await;
        assert_eq!((resized.payload["state"].as_str(), resized.payload["vcpus"].as_u64()), (Some("running"), Some(4)));
        assert_eq!(resized.payload["memoryMiB"], 4096);
    }

    #[tokio::test]
    async fn a_digest_mismatch_is_refused_image_digest_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let agent = agent(dir.path(), Some(Box::new(crate::hypervisor::Fake::default()))).await;
        let (_server, image) = served(b"not what was registered").await;
        run(&agent, &hold(1)).await;
        let wrong = Image { url: image.url.clone(), sha256: sha256_of(b"what was registered"), disk_format: "raw" };
        let answer = run(&agent, &apply(2, INST, 1, "running", 2, &wrong)).await;
        assert_eq!(answer.entry_type, "instance.apply_failed");
        let reason = answer.payload["reason"].as_str().unwrap();
        assert!(reason.starts_with("image-digest: "), "{reason}");
        assert!(!reason.contains("signature=secret"), "no URL query in a reason: {reason}");
        assert_eq!((answer.payload["instanceId"].as_str(), answer.payload["generation"].as_u64()), (Some(INST), Some(1)));
        assert!(std::fs::read_dir(dir.path().join("images")).unwrap().next().is_none(), "no image, no partial file");
        assert!(!dir.path().join("instances").join(INST).exists());
        assert_eq!(observed(&agent, INST), None, "no domain");
    }

    /// A qcow2 whose header names a host file (the node's key as its
    /// backing file, or a data file it writes) is refused `image-format` before any domain is
    /// defined on it, and leaves no disk; so is a qcow2 disk already in place (copied by an agent
    /// that did not inspect disks) at its next apply. A standalone qcow2 runs.
    #[tokio::test]
    async fn a_hostile_qcow2_is_refused_before_any_domain_is_defined() {
        let images = crate::disk_header::tests::Images::new();
        let hostile = [("backing file", images.with_backing_file()), ("data file", images.with_data_file())];
        for (names, bytes) in &hostile {
            let dir = tempfile::tempdir().unwrap();
            let agent = agent(dir.path(), Some(Box::new(crate::hypervisor::Fake::default()))).await;
            let (_server, image) = served(bytes).await;
            let image = Image { disk_format: "qcow2", ..image };
            assert_eq!(run(&agent, &hold(1)).await.entry_type, "gpu.held");
            let answer = run(&agent, &apply(2, INST, 1, "running", 2, &image)).await;
            assert_eq!(answer.entry_type, "instance.apply_failed", "a qcow2 naming a {names}");
            let reason = answer.payload["reason"].as_str().unwrap();
            assert!(reason.starts_with("image-format: the qcow2 image ") && reason.contains(names), "{reason}");
            assert_eq!(observed(&agent, INST), None, "no domain is defined on a qcow2 naming a {names}");
            assert!(!dir.path().join("instances").join(INST).exists(), "no disk, no partial copy");
        }

        let dir = tempfile::tempdir().unwrap();
        let agent = agent(dir.path(), Some(Box::new(crate::hypervisor::Fake::default()))).await;
        let (_server, image) = served(&images.qcow2("clean.qcow2", &[])).await;
        let image = Image { disk_format: "qcow2", ..image };
        assert_eq!(run(&agent, &hold(1)).await.entry_type, "gpu.held");
        let answer = run(&agent, &apply(2, INST, 1, "running", 2, &image)).await;
        assert_eq!((answer.entry_type.as_str(), answer.payload["state"].as_str()), ("instance.observed", Some("running")));

        let disk = dir.path().join("instances").join(INST_2).join("disk.qcow2");
        std::fs::create_dir_all(disk.parent().unwrap()).unwrap();
        std::fs::write(&disk, &hostile[0].1).unwrap();
        let answer = run(&agent, &apply(3, INST_2, 1, "running", 2, &image)).await;
        let reason = answer.payload["reason"].as_str().unwrap_or_default();
        assert!(reason.starts_with("image-format: the qcow2 image names a backing file"), "{answer:?}");
        assert_eq!(observed(&agent, INST_2), None, "no domain on a disk in place that names a backing file");
    }

    #[tokio::test]
    async fn a_stale_generation_is_answered_with_the_current_state_and_changes_nothing() {
        let (dir, agent, _server, image) = held_on_a_fake_hypervisor().await;
        run(&agent, &apply(2, INST, 3, "running", 2, &image)).await;
        let stale = run(&agent, &apply(3, INST, 2, "stopped", 8, &image)).await;
        assert_eq!(stale.entry_type, "instance.observed");
        assert_eq!(
            (stale.payload["state"].as_str(), stale.payload["generation"].as_u64(), stale.payload["vcpus"].as_u64()),
            (Some("running"), Some(3), Some(2))
        );
        assert_eq!(observed(&agent, INST).unwrap().state, DomainState::Running);
        assert_eq!(instance_ledger(dir.path()).instances[INST].generation, 3);
        let stale_delete = run(&agent, &apply(4, INST, 1, "deleted", 2, &image)).await;
        assert_eq!(stale_delete.payload["state"], "running");
        assert!(observed(&agent, INST).is_some());
    }

    #[tokio::test]
    async fn an_instance_needs_its_reservations_gpus_held_and_a_node_a_hypervisor() {
        let dir = tempfile::tempdir().unwrap();
        let agent = agent(dir.path(), Some(Box::new(crate::hypervisor::Fake::default()))).await;
        let (server, image) = served(b"disk").await;
        let answer = run(&agent, &apply(1, INST, 1, "running", 2, &image)).await;
        assert_eq!(answer.entry_type, "instance.apply_failed");
        assert!(answer.payload["reason"].as_str().unwrap().starts_with("gpus-not-held: "), "{}", answer.payload);
        assert_eq!(server.requests(), 0, "refused before anything is fetched");
        assert!(instance_ledger(dir.path()).instances.is_empty());

        let bare_dir = tempfile::tempdir().unwrap();
        let bare = self::agent(bare_dir.path(), None).await;
        assert!(!bare.capabilities().contains(&CAPABILITY_INSTANCE_APPLY.to_owned()));
        let answer = run(&bare, &apply(1, INST, 1, "running", 2, &image)).await;
        assert!(answer.payload["reason"].as_str().unwrap().starts_with("no-hypervisor: "), "{}", answer.payload);

        let late = bc_proto::Command { deadline_ms: NOW_MS - 1, ..apply(2, INST, 1, "running", 2, &image) };
        let answer = run(&agent, &late).await;
        assert_eq!(
            (answer.entry_type.as_str(), answer.subject.as_str()),
            ("instance.apply_failed", &*format!("instance/{INST}"))
        );
        assert!(answer.payload["reason"].as_str().unwrap().starts_with("deadline-passed: "), "{}", answer.payload);

        let unnamed = run(&agent, &command(3, "instance.apply", json!({ "instanceId": "nope" }))).await;
        assert_eq!(unnamed.entry_type, "command.failed");
        let bad =
            run(&agent, &command(4, "instance.apply", json!({ "instanceId": INST, "generation": 1, "desired": "running" })))
                .await;
        assert_eq!(bad.entry_type, "instance.apply_failed");
        assert!(bad.payload["reason"].as_str().unwrap().starts_with("bad-args: "), "{}", bad.payload);
    }

    #[tokio::test]
    async fn a_delete_removes_the_domain_the_directory_and_the_ledger_entry() {
        let (dir, agent, _server, image) = held_on_a_fake_hypervisor().await;
        run(&agent, &apply(2, INST, 1, "running", 2, &image)).await;
        let cmd = apply(3, INST, 2, "deleted", 2, &image);
        let deleted = run(&agent, &cmd).await;
        assert_eq!(
            deleted.payload,
            json!({ "instanceId": INST, "generation": 2, "state": "absent", "commandId": cmd.command_id, "nodeId": NODE })
        );
        assert_eq!(observed(&agent, INST), None);
        assert!(!dir.path().join("instances").join(INST).exists());
        assert!(instance_ledger(dir.path()).instances.is_empty());
        assert!(dir.path().join("images").join(&image.sha256).exists(), "the image stays cached");
        // Deleting what is gone already answers absent again.
        let again = run(&agent, &apply(4, INST, 3, "deleted", 2, &image)).await;
        assert_eq!(again.payload["state"], "absent");
    }

    #[tokio::test]
    async fn a_release_deletes_the_reservations_instances_first() {
        let (dir, agent, _server, image) = held_on_a_fake_hypervisor().await;
        run(&agent, &apply(2, INST, 4, "running", 2, &image)).await;
        let cmd = release(3);
        let entries = bodies(&agent.run(&cmd, NOW_MS).await.unwrap());
        let kinds: Vec<(&str, &str)> = entries.iter().map(|e| (e.entry_type.as_str(), e.subject.as_str())).collect();
        let instance_subject = format!("instance/{INST}");
        let reservation_subject = format!("reservation/{RSV}");
        assert_eq!(
            kinds,
            vec![
                ("command.started", &*format!("command/{}", cmd.command_id)),
                ("instance.observed", &*instance_subject),
                ("gpu.released", &*reservation_subject),
            ]
        );
        assert_eq!(entries[1].payload, json!({ "instanceId": INST, "generation": 4, "state": "absent", "nodeId": NODE }));
        assert_eq!(observed(&agent, INST), None);
        assert!(instance_ledger(dir.path()).instances.is_empty());
        assert!(agent.runner.ledger.lock().await.holds.is_empty());
    }

    #[tokio::test]
    async fn the_observer_journals_a_change_once() {
        let (_dir, agent, _server, image) = held_on_a_fake_hypervisor().await;
        run(&agent, &apply(2, INST, 1, "running", 2, &image)).await;
        assert!(agent.observe_instances(NOW_MS).await.unwrap().is_empty(), "the apply reported it already");
        // Stopped behind the agent's back.
        agent.instances.as_ref().unwrap().hypervisor.stop(INST, true).unwrap();
        let seen = bodies(&agent.observe_instances(NOW_MS).await.unwrap());
        assert_eq!(seen.len(), 1);
        assert_eq!((seen[0].entry_type.as_str(), seen[0].subject.as_str()), ("instance.observed", &*format!("instance/{INST}")));
        assert_eq!(
            seen[0].payload,
            json!({ "instanceId": INST, "generation": 1, "state": "stopped", "vcpus": 2, "memoryMiB": 2048, "nodeId": NODE })
        );
        assert!(agent.observe_instances(NOW_MS).await.unwrap().is_empty(), "nothing changed since");
        agent.instances.as_ref().unwrap().hypervisor.delete(INST).unwrap();
        let gone = bodies(&agent.observe_instances(NOW_MS).await.unwrap());
        assert_eq!(gone[0].payload["state"], "absent");
        assert!(agent.observe_instances(NOW_MS).await.unwrap().is_empty());
    }

    /// The same apply, against libvirt's `test:///default` driver: running, stopped, resized,
    /// resized while running, deleted; each state as libvirt reports it.
    #[cfg(feature = "libvirt")]
    #[tokio::test]
    async fn an_instance_lives_and_dies_in_libvirts_test_driver() {
        let dir = tempfile::tempdir().unwrap();
        let libvirt = crate::hypervisor::Libvirt::open("test:///default").unwrap();
        let agent = agent(dir.path(), Some(Box::new(libvirt))).await;
        let (server, image) = served(b"disk").await;
        run(&agent, &hold(1)).await;
        let id = format!("inst_01J0000000000000000000{:04}", std::process::id() % 10_000);
        let state = |e: &EntryBody| (e.payload["state"].as_str().map(str::to_owned), e.payload["vcpus"].as_u64());
        let running = run(&agent, &apply(2, &id, 1, "running", 2, &image)).await;
        assert_eq!(state(&running), (Some("running".into()), Some(2)), "{}", running.payload);
        let stopped = run(&agent, &apply(3, &id, 2, "stopped", 2, &image)).await;
        assert_eq!(state(&stopped), (Some("stopped".into()), Some(2)), "{}", stopped.payload);
        let resized = run(&agent, &apply(4, &id, 3, "running", 4, &image)).await;
        assert_eq!(state(&resized), (Some("running".into()), Some(4)), "{}", resized.payload);
        assert_eq!(resized.payload["memoryMiB"], 4096);
        let resized_running = run(&agent, &apply(5, &id, 4, "running", 8, &image)).await;
        assert_eq!(state(&resized_running), (Some("running".into()), Some(8)), "{}", resized_running.payload);
        let deleted = run(&agent, &apply(6, &id, 5, "deleted", 8, &image)).await;
        assert_eq!(state(&deleted), (Some("absent".into()), None));
        assert_eq!(observed(&agent, &id), None);
        assert_eq!(server.requests(), 1);
    }
}
