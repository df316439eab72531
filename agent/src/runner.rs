//! What the node does and journals: commands, run once each (the journal records how far each
//! got, so a redelivered command runs nothing twice), and periodic observations of the machine.
//! Every result is journaled before it is sent.

use std::sync::Arc;

use bc_core::agent::SignedEntry;
use bc_core::id::NodeId;
use ed25519_dalek::SigningKey;
use serde_json::{Value, json};

use crate::journal::{Draft, Journal, JournalError, Stage};

/// What this build can do: no GPU binding yet, so `gpu.hold` fails at once with a reason.
pub const CAPABILITIES: &[&str] = &["command.ping"];
/// Why a GPU command fails on a node without a binding capability.
pub const NO_GPU_BINDING: &str = "node-unbound: this node advertises no GPU binding capability";

pub struct Runner {
    pub journal: Arc<Journal>,
    pub key: SigningKey,
    pub node: NodeId,
    pub version: String,
}

impl Runner {
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

    fn draft(&self, now_ms: u64, entry_type: &str, command: &str, mut payload: Value, stage: Stage) -> Draft {
        payload["commandId"] = json!(command);
        payload["nodeId"] = json!(self.node.to_string());
        Draft {
            at_ms: now_ms,
            entry_type: entry_type.to_owned(),
            subject: format!("command/{command}"),
            payload,
            command: Some((command.to_owned(), stage)),
        }
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
        if now_ms > command.deadline_ms {
            let reason = json!({ "reason": "deadline passed before the node ran it" });
            self.write(self.draft(now_ms, "command.failed", id, reason, Stage::Finished), &mut out).await?;
            return Ok(out);
        }
        if stage.is_none() {
            self.write(self.draft(now_ms, "command.started", id, json!({}), Stage::Started), &mut out).await?;
        }
        let outcome = match command.kind.as_str() {
            "ping" => Ok(json!({ "result": { "pong": true, "agentVersion": self.version } })),
            "gpu.hold" | "gpu.release" => Err(NO_GPU_BINDING.to_owned()),
            other => Err(format!("unknown-kind: this agent does not know {:?}", bc_core::id::truncate(other, 40))),
        };
        match outcome {
            Ok(result) => self.write(self.draft(now_ms, "command.succeeded", id, result, Stage::Finished), &mut out).await?,
            Err(reason) => {
                self.write(self.draft(now_ms, "command.failed", id, json!({ "reason": reason }), Stage::Finished), &mut out)
                    .await?
            }
        }
        tracing::info!(command = %id, kind = %bc_core::id::truncate(&command.kind, 40), "command ran");
        Ok(out)
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

/// The journal payload of an inventory (`node.inventory_reported`): integers and text only.
pub fn inventory_payload(node: &NodeId, inventory: &crate::inventory::Inventory) -> Value {
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
    let mut payload = json!({ "nodeId": node.to_string(), "gpus": gpus, "host": host });
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
        let payload = inventory_payload(&self.node, inventory);
        self.journal_about_node(now_ms, "node.inventory_reported", payload).await
    }
}
