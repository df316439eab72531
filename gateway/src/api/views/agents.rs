//! Views of what the agent side adds: a node's agent, join tokens and commands.

use bc_projections::inventory::{InventoryDiff, InventoryReportDoc};
use bc_projections::{CommandDoc, CommandState, JoinTokenDoc, NodeAgent};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;

use crate::api::validate::{CommandIdText, DescriptionText, JoinTokenIdText, NodeIdText, PoolIdText, TenantIdText};

/// What the control plane knows of a joined node's agent.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeAgentView {
    /// Standard base64 of the node's Ed25519 public key.
    pub public_key: String,
    /// The version the agent runs: from its last start (`node.agent_started`), or its join.
    pub agent_version: String,
    /// The update slot it runs from (`a`, `b`); absent without slots.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub agent_slot: String,
    /// When the agent last started (0: not since it joined).
    pub agent_started_at_ms: u64,
    /// Since when the node holds its lease without a lapse (0: not reachable).
    pub ready_since_ms: u64,
    pub hostname: String,
    #[schemars(with = "JoinTokenIdText")]
    pub join_token_id: String,
    pub joined_at_ms: u64,
    /// Whether the node holds its lease.
    pub reachable: bool,
    pub lease_expires_at_ms: u64,
    /// The newest entry of the node's journal in the log (0: none yet).
    pub journal_seq: u64,
    /// The node's latest observation of itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed: Option<ObservationView>,
    /// What the node last reported holding.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inventory: Option<InventoryView>,
}

/// What an agent reported its machine holds (NVML, `/proc`, `/sys`) and can do with it: the
/// fields a node's latest inventory and each report in its history share.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryFields {
    pub reported_at_ms: u64,
    pub gpus: Vec<bc_projections::events::InventoryGpu>,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    /// Why no GPUs could be read (no driver, no library).
    pub unavailable: Option<String>,
    pub host: bc_projections::events::InventoryHost,
    /// What the agent can do with the machine (`command.ping`, `gpu.hold`, …).
    pub capabilities: Vec<String>,
    /// Why the agent cannot hold GPUs (`node-unprivileged: …`); absent when it can.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_unavailable: Option<String>,
    /// The size in bytes of the file system that holds the node's sandbox volumes (an agent that
    /// makes them): the sum of its volumes' sizes is bounded by it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_file_system_bytes: Option<u64>,
}

impl InventoryFields {
    fn of(reported_at_ms: u64, i: bc_projections::events::NodeInventoryReported) -> Self {
        Self {
            reported_at_ms,
            gpus: i.gpus,
            driver_version: i.driver_version,
            cuda_version: i.cuda_version,
            unavailable: i.unavailable,
            host: i.host,
            capabilities: i.capabilities,
            hold_unavailable: i.hold_unavailable,
            volume_file_system_bytes: i.volume_file_system_bytes,
        }
    }
}

/// A node's inventory as its agent last reported it.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryView {
    #[serde(flatten)]
    pub report: InventoryFields,
    /// The reported GPUs differ from the node's but some were allocated when it came: they are
    /// taken once the node is free.
    pub pending: bool,
}

/// One inventory report (`inventory.get`, `inventory.history`): what the agent found, and
/// which event of the log said so.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryReportView {
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    /// The event's sequence in the tenant's log: what `inventory.diff` and the history's cursor
    /// name a report by.
    pub seq: u64,
    pub event_id: String,
    /// The entry of the node's journal it came in.
    pub journal_seq: u64,
    #[serde(flatten)]
    pub report: InventoryFields,
}

impl From<InventoryReportDoc> for InventoryReportView {
    fn from(d: InventoryReportDoc) -> Self {
        Self {
            node_id: d.node_id,
            seq: d.seq,
            event_id: d.event_id,
            journal_seq: d.journal_seq,
            report: InventoryFields::of(d.reported_at_ms, d.inventory),
        }
    }
}

/// `inventory.diff`: what changed from report `from` to report `to` (by `seq`).
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryDiffView {
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    pub from: u64,
    pub to: u64,
    pub from_reported_at_ms: u64,
    pub to_reported_at_ms: u64,
    /// Whether anything differs.
    pub changed: bool,
    #[serde(flatten)]
    pub diff: InventoryDiff,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ObservationView {
    pub at_ms: u64,
    pub uptime_s: Option<u64>,
    pub load_avg1_milli: Option<u64>,
    #[serde(rename = "memAvailableKiB")]
    pub mem_available_kib: Option<u64>,
}

impl From<NodeAgent> for NodeAgentView {
    fn from(a: NodeAgent) -> Self {
        Self {
            public_key: a.public_key,
            agent_version: a.agent_version,
            agent_slot: a.agent_slot,
            agent_started_at_ms: a.agent_started_at_ms,
            ready_since_ms: a.ready_since_ms,
            hostname: a.hostname,
            join_token_id: a.join_token_id,
            joined_at_ms: a.joined_at_ms,
            reachable: a.reachable,
            lease_expires_at_ms: a.lease_expires_at_ms,
            journal_seq: a.journal_seq,
            inventory: a
                .inventory
                .map(|i| InventoryView { report: InventoryFields::of(a.inventory_at_ms, i), pending: a.inventory_pending }),
            observed: a.observed.map(|o| ObservationView {
                at_ms: o.at_ms,
                uptime_s: o.uptime_s,
                load_avg1_milli: o.load_avg1_milli,
                mem_available_kib: o.mem_available_kib,
            }),
        }
    }
}

/// Whether a join token can still be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JoinTokenStateView {
    Active,
    /// Every use spent.
    Spent,
    Expired,
    Revoked,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JoinTokenView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "JoinTokenIdText")]
    pub join_token_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "DescriptionText")]
    pub description: String,
    pub state: JoinTokenStateView,
    pub expires_at_ms: u64,
    pub uses_max: u32,
    pub uses: u32,
    /// The nodes that joined with it.
    #[schemars(with = "Vec<NodeIdText>")]
    pub node_ids: Vec<String>,
    pub version: u64,
    pub created_at_ms: u64,
}

impl JoinTokenView {
    pub fn of(d: JoinTokenDoc, now_ms: u64) -> Self {
        let state = if d.revoked {
            JoinTokenStateView::Revoked
        } else if d.uses >= d.uses_max {
            JoinTokenStateView::Spent
        } else if now_ms >= d.expires_at_ms {
            JoinTokenStateView::Expired
        } else {
            JoinTokenStateView::Active
        };
        Self {
            tenant_id: d.tenant_id,
            join_token_id: d.join_token_id,
            pool_id: d.pool_id,
            description: d.description,
            state,
            expires_at_ms: d.expires_at_ms,
            uses_max: d.uses_max,
            uses: d.uses,
            node_ids: d.node_ids,
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}

/// `joinTokens.create`: the token, shown once.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JoinTokenCreatedView {
    #[serde(flatten)]
    pub join_token: JoinTokenView,
    /// `bcjt_…`, shown only in the first answer: `null` when `replayed`. Give it to `bcd join`
    /// on standard input or in a 0600 file, never as an argument.
    pub token: Option<String>,
    /// This answers a retry with the same `Idempotency-Key`; nothing new was created.
    pub replayed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CommandStateView {
    /// Waiting for the node (delivered when its session is up).
    Issued,
    Started,
    Succeeded,
    /// With a reason; also when the deadline passed first.
    Failed,
    Cancelled,
}

impl From<CommandState> for CommandStateView {
    fn from(s: CommandState) -> Self {
        match s {
            CommandState::Issued => Self::Issued,
            CommandState::Started => Self::Started,
            CommandState::Succeeded => Self::Succeeded,
            CommandState::Failed => Self::Failed,
            CommandState::Cancelled => Self::Cancelled,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CommandView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "CommandIdText")]
    pub command_id: String,
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    /// `ping`, `gpu.hold`, `gpu.release`, `instance.apply`, `agent.update`, `agent.rollback`.
    pub kind: String,
    pub args: serde_json::Map<String, Value>,
    pub state: CommandStateView,
    pub reason: Option<String>,
    pub result: Option<serde_json::Map<String, Value>>,
    /// Who issued it (`apikey:key_…`).
    pub issued_by: String,
    pub issued_at_ms: u64,
    pub deadline_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// The node's journal entries that reported on it.
    pub journal_seqs: Vec<u64>,
    pub version: u64,
}

impl From<CommandDoc> for CommandView {
    fn from(d: CommandDoc) -> Self {
        let object = |v: Value| match v {
            Value::Object(map) => map,
            _ => Default::default(),
        };
        Self {
            tenant_id: d.tenant_id,
            command_id: d.command_id,
            node_id: d.node_id,
            kind: d.kind,
            args: object(d.args),
            state: d.state.into(),
            reason: d.reason,
            result: d.result.map(object),
            issued_by: d.issued_by,
            issued_at_ms: d.issued_at_ms,
            deadline_at_ms: d.deadline_at_ms,
            started_at_ms: d.started_at_ms,
            finished_at_ms: d.finished_at_ms,
            journal_seqs: d.journal_seqs,
            version: d.version,
        }
    }
}
