//! What the node does and journals: commands, run once each (the journal records how far each
//! got, so a redelivered command runs nothing twice), and periodic observations of the machine.
//! Every result is journaled before it is sent.

use std::sync::Arc;

use bc_core::agent::SignedEntry;
use bc_core::id::NodeId;
use ed25519_dalek::SigningKey;
use serde_json::{Value, json};

use crate::binding::GpuBinding;
use crate::holds::{Hold, HoldArgs, HoldDecision, Ledger, LedgerFile, decide_hold};
use crate::inventory::InventorySource;
use crate::journal::{Draft, Journal, JournalError, Stage};

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
}

/// What a command ended in: its last journal entry's type, subject and payload.
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
        let args: HoldArgs = match serde_json::from_str(args_json) {
            Ok(args) => args,
            Err(e) => return Finish::failed(format!("bad-args: gpu.hold: {}", bc_core::id::truncate(&e.to_string(), 200))),
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

    /// `gpu.release`: gives back what the ledger holds for the reservation (nothing held:
    /// released already), then reports `gpu.released`. A release the machine refuses keeps the
    /// GPUs in the ledger (no other reservation gets them), marked for [`Self::retry_releases`],
    /// and fails the command with the reason.
    async fn release(&self, command_id: &str, args_json: &str) -> Finish {
        let args: HoldArgs = match serde_json::from_str::<HoldArgs>(args_json) {
            Ok(args) if args.reservation_id.parse::<bc_core::id::ReservationId>().is_ok() => args,
            _ => return Finish::failed("bad-args: gpu.release names no reservation"),
        };
        let mut ledger = self.ledger.lock().await;
        let Some(hold) = ledger.holds.get(&args.reservation_id).cloned() else {
            return Finish::gpu("gpu.released", &args.reservation_id, &[], None);
        };
        if let Err(reason) = self.binding.release(&hold.gpus) {
            let mut next = ledger.clone();
            if let Some(h) = next.holds.get_mut(&args.reservation_id) {
                h.release_command_id = Some(command_id.to_owned());
            }
            if self.ledger_file.save(&next).is_ok() {
                *ledger = next;
            }
            tracing::warn!(reservation = %args.reservation_id, reason = %reason, "a release failed; retrying");
            return Finish::failed(format!("release-failed: {reason} (the node retries)"));
        }
        let mut next = ledger.clone();
        next.holds.remove(&args.reservation_id);
        if let Err(e) = self.ledger_file.save(&next) {
            return Finish::failed(format!("ledger-failed: {e}"));
        }
        *ledger = next;
        tracing::info!(reservation = %args.reservation_id, gpus = hold.gpus.len(), "GPUs released");
        Finish::gpu("gpu.released", &args.reservation_id, &hold.gpus, None)
    }

    /// Runs `command` unless the journal says it finished; returns the entries written.
    pub async fn run(&self, command: &bc_proto::Command, now_ms: u64) -> Result<Vec<SignedEntry>, JournalError> {
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
                _ => Finish::failed(reason),
            };
            self.finish(now_ms, id, finish, &mut out).await?;
            return Ok(out);
        }
        if stage.is_none() {
            self.write(self.draft(now_ms, "command.started", id, json!({}), Stage::Started), &mut out).await?;
        }
        let finish = match command.kind.as_str() {
            "ping" => Finish::succeeded(json!({ "result": { "pong": true, "agentVersion": self.version } })),
            "gpu.hold" => self.hold(id, &command.args_json).await,
            "gpu.release" => self.release(id, &command.args_json).await,
            other => Finish::failed(format!("unknown-kind: this agent does not know {:?}", bc_core::id::truncate(other, 40))),
        };
        self.finish(now_ms, id, finish, &mut out).await?;
        tracing::info!(command = %id, kind = %bc_core::id::truncate(&command.kind, 40), "command ran");
        Ok(out)
    }

    /// Retries the releases the machine refused; each that now succeeds leaves the ledger and
    /// is reported `gpu.released` for its command. Returns the entries written.
    pub async fn retry_releases(&self, now_ms: u64) -> Result<Vec<SignedEntry>, JournalError> {
        let mut out = Vec::new();
        let mut ledger = self.ledger.lock().await;
        let stuck: Vec<(String, Hold)> =
            ledger.holds.iter().filter(|(_, h)| h.release_command_id.is_some()).map(|(r, h)| (r.clone(), h.clone())).collect();
        for (reservation_id, hold) in stuck {
            let Some(command_id) = hold.release_command_id.as_deref() else { continue };
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
        let unavailable = self.binding.unprivileged();
        let payload = inventory_payload(&self.node, inventory, &self.capabilities(), unavailable.as_deref());
        self.journal_about_node(now_ms, "node.inventory_reported", payload).await
    }
}
