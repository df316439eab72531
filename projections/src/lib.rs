//! `bc-projections`: read models folded from the event log.
//!
//! Every read model is a JSON document per entity, keyed by (tenant, kind, id), where kind and
//! id come from the event's stream name (`pool/pool_…` → kind `pool`, id `pool_…`). The fold is
//! a pure function ([`Projections::apply`]); the store runs it inside the append transaction and
//! again, from the whole log, in `better-compute projections rebuild`.
//!
//! Layout: [`events`] holds the CBOR payload of every event type (the log's wire format);
//! [`inventory`] the row per inventory report and the pure diff of two; [`placement`] the
//! selector language and the choice of GPUs; [`fleet`] the in-memory view of nodes and live
//! reservations; [`decide`] the pure decisions of the reservation methods and of
//! the reservations reconciler's pass; this file holds the documents (with their state enums)
//! and the fold.

use bc_core::event::StoredEvent;
use bc_core::store::{Projector, RowKey};
use bc_core::{Error, Result};
use bc_core::{audit, canonical};
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub mod decide;
pub mod event_view;
pub mod events;
pub mod fleet;
pub mod instance;
pub mod inventory;
pub mod metal;
pub mod placement;
pub mod rollout;
pub mod workflow;

pub use event_view::{CoveredBy, EventView, event_view};
use events::*;
pub use instance::{
    INSTANCE_APPLY, INSTANCE_APPLY_ATTEMPTS_MAX, INSTANCE_APPLY_DEADLINE_S, InstanceDoc, InstanceState, KIND_INSTANCE,
    KIND_INSTANCE_LIVE,
};

/// Row kinds; also the stream prefixes.
pub const KIND_TENANT: &str = "tenant";
pub const KIND_API_KEY: &str = "api_key";
pub const KIND_POOL: &str = "pool";
pub const KIND_NODE: &str = "node";
pub const KIND_WEBHOOK: &str = "webhook";
pub const KIND_RESERVATION: &str = "reservation";
/// One row per queued or active reservation (removed when it ends): what the reconciler and
/// the capacity views scan, so they never read finished reservations.
pub const KIND_RESERVATION_LIVE: &str = "reservation_live";
/// A join token's document (never its secret or the secret's hash).
pub const KIND_JOIN_TOKEN: &str = "join_token";
/// A command to a node.
pub const KIND_COMMAND: &str = "command";
/// One row per unfinished command (removed when it ends): what the deadline sweep scans.
pub const KIND_COMMAND_LIVE: &str = "command_live";
/// The stream of what a node's agent reports of itself (`agent/node_…`): its events touch the
/// node's document without moving the node's version.
pub const KIND_AGENT: &str = "agent";
/// One row per node: the node's unfinished commands in issue order, what its session delivers.
pub const KIND_NODE_COMMANDS: &str = "node_commands";
/// Unfinished commands one node may have: a node that is away for long cannot pile up more.
pub const COMMANDS_PENDING_PER_NODE_MAX: usize = 256;
/// Holds a reservation may try: after this many failed holds it fails, with the last reason,
/// instead of going back to its queue again.
pub const HOLD_ATTEMPTS_MAX: u32 = 3;
/// How long a node has to answer `gpu.hold` or `gpu.release`; an unanswered hold then counts as
/// failed (`hold-timeout`).
pub const HOLD_DEADLINE_S: u64 = 120;
/// A flavor of a pool (`flavor/flv_…`): the shape instances of it get.
pub const KIND_FLAVOR: &str = "flavor";
/// A registered disk image (`image/img_…`).
pub const KIND_IMAGE: &str = "image";
/// A tenant's quota in one pool; the stream is `quota/pool_…`.
pub const KIND_QUOTA: &str = "quota";
/// The longest reservation a pool grants unless it says otherwise: 30 days.
pub const MAX_RESERVATION_S_DEFAULT: u64 = 30 * 24 * 3600;

/// The stream of one entity: `KIND/ID`.
/// The id part of a stream name (`metal/node_…` → `node_…`).
pub fn stream_id_of(stream: &str) -> &str {
    stream.split_once('/').map_or(stream, |(_, id)| id)
}

pub fn stream_of(kind: &str, id: &impl std::fmt::Display) -> String {
    format!("{kind}/{id}")
}

/// A tenant document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TenantDoc {
    pub tenant_id: String,
    pub name: String,
    pub root: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

/// An API key document. It holds no secret: the SHA-256 of the token's secret is in the secret
/// store under [`api_key_secret_id`] (keys created before that carry it here, from their event).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyDoc {
    pub tenant_id: String,
    pub key_id: String,
    pub name: String,
    pub actions: Vec<String>,
    /// Only for keys whose `api_key.created` carried the hash; empty otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_sha256: String,
    pub revoked: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolDoc {
    pub tenant_id: String,
    pub pool_id: String,
    pub name: String,
    pub description: String,
    pub labels: std::collections::BTreeMap<String, String>,
    #[serde(default = "max_reservation_default")]
    pub max_reservation_s: u64,
    pub archived: bool,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeDoc {
    pub tenant_id: String,
    pub node_id: String,
    pub pool_id: String,
    pub name: String,
    pub gpus: Vec<Gpu>,
    /// The GPUs' UUIDs in `gpus`' order, for a node with an agent (what `gpu.hold` names);
    /// empty for a node registered by hand.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    pub state: NodeState,
    #[serde(default)]
    pub taints: std::collections::BTreeMap<String, String>,
    /// GPU index → the reservation holding it.
    #[serde(default)]
    pub allocations: std::collections::BTreeMap<u32, String>,
    /// Cordoned or draining by an operator; `state` says the effect (an unreachable node is
    /// `unreachable` whatever these say, and returns to them when it is back).
    #[serde(default)]
    pub cordoned: bool,
    #[serde(default)]
    pub draining: bool,
    /// Set for a node that joined with `bcd` (absent: registered by hand, no agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<NodeAgent>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

/// What the control plane knows of a node's agent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeAgent {
    /// Standard base64 of the node's Ed25519 public key: its session proofs and journal
    /// entries are checked against it.
    pub public_key: String,
    pub agent_version: String,
    pub hostname: String,
    pub join_token_id: String,
    pub joined_at_ms: u64,
    /// Whether the node holds its lease (`node.ready`) or let it lapse (`node.unreachable`).
    pub reachable: bool,
    pub lease_expires_at_ms: u64,
    /// The newest journal entry of this node in the log, and its hash (hex; empty: none).
    pub journal_seq: u64,
    pub journal_hash: String,
    /// The node's latest observation of itself (`node.observed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<Observation>,
    /// What the node last reported holding (`node.inventory_reported`), and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inventory: Option<NodeInventoryReported>,
    #[serde(default)]
    pub inventory_at_ms: u64,
    /// The last inventory's GPUs differ from `gpus` but GPUs were allocated when it came: they
    /// are taken when the node is free.
    #[serde(default)]
    pub inventory_pending: bool,
    /// Since when the node holds its lease without a lapse (`node.ready`); 0: not reachable.
    #[serde(default)]
    pub ready_since_ms: u64,
    /// The update slot the agent last started from (`a`, `b`; empty: no slots) and when it
    /// started (`node.agent_started`); `agentVersion` is that start's version.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub agent_slot: String,
    #[serde(default)]
    pub agent_started_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Observation {
    pub at_ms: u64,
    pub uptime_s: Option<u64>,
    pub load_avg1_milli: Option<u64>,
    #[serde(rename = "memAvailableKiB")]
    pub mem_available_kib: Option<u64>,
}

impl NodeDoc {
    /// Derives `state` from the operator's marks and the agent's liveness.
    fn refresh_state(&mut self) {
        self.state = if self.agent.as_ref().is_some_and(|a| !a.reachable) {
            NodeState::Unreachable
        } else {
            node_state(self.cordoned, self.draining)
        };
    }

    /// A document written before `cordoned`/`draining` existed says them only in `state`.
    fn normalize(&mut self) {
        if !self.cordoned && !self.draining {
            match self.state {
                NodeState::Cordoned => self.cordoned = true,
                NodeState::Draining => (self.cordoned, self.draining) = (true, true),
                _ => {}
            }
        }
    }
}

/// A join token's document: what `joinTokens.list` shows.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct JoinTokenDoc {
    pub tenant_id: String,
    pub join_token_id: String,
    pub pool_id: String,
    pub description: String,
    pub expires_at_ms: u64,
    pub uses_max: u32,
    pub uses: u32,
    /// The one node a machine may join as with it (a bare-metal deploy's token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The nodes that joined with it, oldest first.
    pub node_ids: Vec<String>,
    pub revoked: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

/// A command's state: `issued` (waiting for the node), `started`, then `succeeded`, `failed`
/// (with a reason; also when its deadline passed) or `cancelled`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CommandState {
    Issued,
    Started,
    Succeeded,
    Failed,
    Cancelled,
}

impl CommandState {
    pub const ALL: &[Self] = &[Self::Issued, Self::Started, Self::Succeeded, Self::Failed, Self::Cancelled];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Issued => "issued",
            Self::Started => "started",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    pub fn is_finished(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

impl std::str::FromStr for CommandState {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        state_from_str("command", text, Self::ALL, Self::as_str)
    }
}

/// A command document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CommandDoc {
    pub tenant_id: String,
    pub command_id: String,
    pub node_id: String,
    pub kind: String,
    pub args: Value,
    pub state: CommandState,
    pub reason: Option<String>,
    pub result: Option<Value>,
    pub issued_by: String,
    pub issued_at_ms: u64,
    pub deadline_at_ms: u64,
    pub started_at_ms: Option<u64>,
    pub finished_at_ms: Option<u64>,
    /// The journal entries of the node that reported on it.
    pub journal_seqs: Vec<u64>,
    pub version: u64,
}

/// A node's unfinished commands, oldest first: what its session sends.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeCommandsDoc {
    pub pending: Vec<String>,
}

/// A webhook subscription. It receives its tenant's events after `createdSeq` whose type its
/// patterns match (empty: none; `*`: all).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WebhookDoc {
    pub tenant_id: String,
    pub webhook_id: String,
    pub url: String,
    pub event_types: Vec<String>,
    pub description: String,
    pub secret_version: u32,
    pub secret_id: String,
    /// Rotated-out secrets that still sign beside the current one, each until its time.
    pub previous_secrets: Vec<PreviousSecret>,
    pub created_seq: u64,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

/// A flavor: what an instance of it in its pool is given. Deleting it removes the document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FlavorDoc {
    pub tenant_id: String,
    pub flavor_id: String,
    pub pool_id: String,
    pub name: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    pub gpus: u32,
    pub version: u64,
    pub created_at_ms: u64,
}

/// A registered image. Deleting it removes the document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ImageDoc {
    pub tenant_id: String,
    pub image_id: String,
    pub name: String,
    pub url: String,
    pub sha256: String,
    pub disk_format: DiskFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    pub version: u64,
    pub created_at_ms: u64,
}

/// The outbox consumer whose work items are webhook deliveries.
pub const WEBHOOK_CONSUMER: &str = "webhooks";

/// A delivery's id: the event (also the `webhook-id` header) and the webhook it goes to.
pub fn webhook_delivery_id(event_id: &impl std::fmt::Display, webhook_id: &impl std::fmt::Display) -> String {
    format!("{event_id}/{webhook_id}")
}

/// Rotated-out secrets kept signing at once, at most: a rotation drops the oldest beyond this.
pub const PREVIOUS_SECRETS_MAX: usize = 4;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PreviousSecret {
    pub secret_id: String,
    pub valid_until_ms: u64,
}

/// The id of an API key's secret hash in the secret store (the log does not carry it).
pub fn api_key_secret_id(key_id: &str) -> String {
    key_id.to_owned()
}

/// The id of one of a webhook's signing secrets in the secret store, from a fresh ULID.
pub fn new_webhook_secret_id(webhook_id: &str, ulid: ulid::Ulid) -> String {
    format!("{webhook_id}/{}", bc_core::id::EventId::from_ulid(ulid))
}

fn max_reservation_default() -> u64 {
    MAX_RESERVATION_S_DEFAULT
}

/// A reservation: `queued` → `active` → `released` | `expired`, or `queued` → `cancelled`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReservationDoc {
    pub tenant_id: String,
    pub reservation_id: String,
    pub pool_id: String,
    pub gpus: u32,
    pub duration_s: u64,
    pub selector: String,
    pub nvlink: bool,
    pub tolerations: Vec<String>,
    pub state: ReservationState,
    pub node_id: Option<String>,
    pub gpu_indexes: Vec<u32>,
    /// The tenant chain's sequence number of the request: the queue's order.
    pub request_seq: u64,
    pub requested_at_ms: u64,
    pub activated_at_ms: Option<u64>,
    pub ends_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    /// Whether its node really set its GPUs aside; `None` while queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<Binding>,
    /// Holds that failed so far (each put it back in its queue), the nodes they failed on, and
    /// the last reason.
    #[serde(default)]
    pub hold_attempts: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hold_failed_nodes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The instance using its GPUs, until that instance is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    pub version: u64,
}

/// A reservation's GPUs on its node: `pending` (the node was sent `gpu.hold`) → `bound` (it
/// journaled `gpu.held`) or `failed` (`gpu.hold_failed`, or no answer by the deadline); after the
/// reservation ends, `released` once the node journaled `gpu.released`. A node registered by
/// hand has no agent to ask: `bound` at once.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Binding {
    pub state: BindingState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_command_id: Option<String>,
    /// When a pending hold counts as failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_command_id: Option<String>,
    /// The GPUs' UUIDs the node reported holding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub changed_at_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BindingState {
    Pending,
    Bound,
    Failed,
    Released,
}

impl Binding {
    /// Whether the node may hold the GPUs: a hold was sent and not refused (`pending` or
    /// `bound`), so ending the reservation sends `gpu.release`.
    pub fn may_hold(&self) -> bool {
        self.hold_command_id.is_some() && matches!(self.state, BindingState::Pending | BindingState::Bound)
    }
}

impl BindingState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Bound => "bound",
            Self::Failed => "failed",
            Self::Released => "released",
        }
    }
}

/// Where a reservation is in its life: `queued` → `active` → `released` | `expired`, or
/// `queued` → `cancelled`. Stored (and shown) in lowercase, as the words were before the enum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReservationState {
    /// Waiting in its pool's queue for GPUs.
    Queued,
    /// Holding GPUs on a node until its end.
    Active,
    /// Ended by its owner before its end.
    Released,
    /// Ended at its end time by the reconciler.
    Expired,
    /// Ended by its owner while still queued.
    Cancelled,
    /// Ended because its node could not hold its GPUs, [`HOLD_ATTEMPTS_MAX`] times
    /// (`lastError` says why).
    Failed,
}

impl ReservationState {
    pub const ALL: &[Self] = &[Self::Queued, Self::Active, Self::Released, Self::Expired, Self::Cancelled, Self::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Active => "active",
            Self::Released => "released",
            Self::Expired => "expired",
            Self::Cancelled => "cancelled",
            Self::Failed => "failed",
        }
    }

    /// Queued or active: the reservation has a live row and counts against its pool's quota.
    pub fn is_live(self) -> bool {
        matches!(self, Self::Queued | Self::Active)
    }
}

/// Whether a node takes new reservations: `ready`, `cordoned` (takes no new reservation),
/// `draining` (cordoned until its reservations end) or `unreachable` (its agent let its lease
/// lapse).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Ready,
    Cordoned,
    Draining,
    /// A node with an agent whose lease lapsed: it takes nothing until it is back.
    Unreachable,
}

impl NodeState {
    pub const ALL: &[Self] = &[Self::Ready, Self::Cordoned, Self::Draining, Self::Unreachable];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Cordoned => "cordoned",
            Self::Draining => "draining",
            Self::Unreachable => "unreachable",
        }
    }
}

/// Parses one of `all` by its `as_str` word, or names the allowed words.
fn state_from_str<T: Copy>(what: &str, text: &str, all: &[T], as_str: impl Fn(T) -> &'static str) -> Result<T> {
    all.iter().copied().find(|s| as_str(*s) == text).ok_or_else(|| Error::InvalidArgument {
        message: format!("state {:?} is not a {what} state", bc_core::id::truncate(text, 40)),
        hint: Some(all.iter().map(|s| as_str(*s)).collect::<Vec<_>>().join(", ")),
    })
}

impl std::str::FromStr for ReservationState {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        state_from_str("reservation", text, Self::ALL, Self::as_str)
    }
}

impl std::str::FromStr for NodeState {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        state_from_str("node", text, Self::ALL, Self::as_str)
    }
}

impl std::fmt::Display for ReservationState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct QuotaDoc {
    pub tenant_id: String,
    pub pool_id: String,
    pub gpus: u32,
    pub version: u64,
    pub updated_at_ms: u64,
}

fn node_state(cordoned: bool, draining: bool) -> NodeState {
    if draining {
        NodeState::Draining
    } else if cordoned {
        NodeState::Cordoned
    } else {
        NodeState::Ready
    }
}

fn apply_keys(map: &mut std::collections::BTreeMap<String, String>, change: NodeKeysChanged) {
    for key in change.remove {
        map.remove(&key);
    }
    map.extend(change.set);
}

/// The projector for every read model of this crate.
#[derive(Clone, Copy, Debug, Default)]
pub struct Projections;

fn payload<T: for<'de> Deserialize<'de>>(event: &StoredEvent) -> Result<T> {
    serde_json::from_value(canonical::to_json(&event.envelope.payload)).map_err(|e| Error::Corrupt {
        tenant: event.envelope.tenant.to_string(),
        seq: event.envelope.seq,
        what: format!("{} payload does not parse: {e}", event.envelope.event_type),
    })
}

fn corrupt(event: &StoredEvent, what: String) -> Error {
    Error::Corrupt { tenant: event.envelope.tenant.to_string(), seq: event.envelope.seq, what }
}

fn to_doc<T: Serialize>(doc: &T) -> Result<Option<Value>> {
    serde_json::to_value(doc).map(Some).map_err(|e| Error::Internal(format!("projection: {e}")))
}

fn from_doc<T: for<'de> Deserialize<'de>>(event: &StoredEvent, doc: Option<Value>) -> Result<T> {
    let doc = doc.ok_or_else(|| Error::Corrupt {
        tenant: event.envelope.tenant.to_string(),
        seq: event.envelope.seq,
        what: format!("{} applies to an entity that does not exist", event.envelope.event_type),
    })?;
    serde_json::from_value(doc).map_err(|e| Error::Internal(format!("projection document: {e}")))
}

impl Projector for Projections {
    fn touches(&self, event: &StoredEvent, out: &mut Vec<RowKey>) {
        if event.envelope.event_type == audit::CHECKPOINT_SEALED || event.envelope.event_type == audit::CHECKPOINT_COSIGNED {
            // One row per checkpoint, by size, not one per stream.
            let size = audit::parse_checkpoint_payload(&event.envelope.payload)
                .map(|(size, _)| size)
                .or_else(|| audit::parse_cosigned_payload(&event.envelope.payload).map(|(size, _, _)| size));
            if let Some(size) = size {
                out.push(RowKey {
                    tenant: event.envelope.tenant.to_string(),
                    kind: audit::KIND_CHECKPOINT.to_owned(),
                    id: audit::checkpoint_row_id(size),
                });
            }
            return;
        }
        if let Some((kind, id)) = event.envelope.stream.split_once('/')
            && kind == KIND_AGENT
        {
            out.push(RowKey { tenant: event.envelope.tenant.to_string(), kind: KIND_NODE.to_owned(), id: id.to_owned() });
            if event.envelope.event_type == NODE_INVENTORY_REPORTED {
                // And the report's own row, which `inventory.history` pages.
                out.push(RowKey {
                    tenant: event.envelope.tenant.to_string(),
                    kind: inventory::KIND_INVENTORY.to_owned(),
                    id: inventory::inventory_row_id(id, event.envelope.seq),
                });
            }
            return;
        }
        if let Some((kind, id)) = event.envelope.stream.split_once('/')
            && kind == KIND_COMMAND
        {
            let tenant = event.envelope.tenant.to_string();
            let row = |kind: &str, id: &str| RowKey { tenant: tenant.clone(), kind: kind.to_owned(), id: id.to_owned() };
            out.push(row(KIND_COMMAND, id));
            out.push(row(KIND_COMMAND_LIVE, id));
            // Every command event names its node: its queue changes, and an entry from its
            // journal moves the node's journal head.
            if let Some(node) = canonical::to_json(&event.envelope.payload).get("nodeId").and_then(Value::as_str) {
                out.push(row(KIND_NODE_COMMANDS, node));
                if event.envelope.payload_has(bc_core::agent::JOURNAL_PAYLOAD_KEY) {
                    out.push(row(KIND_NODE, node));
                }
            }
            return;
        }
        if let Some((kind, id)) = event.envelope.stream.split_once('/')
            && kind == workflow::KIND_METAL
        {
            let tenant = event.envelope.tenant.to_string();
            out.push(RowKey { tenant: tenant.clone(), kind: workflow::KIND_METAL.to_owned(), id: id.to_owned() });
            if let Some(workflow) = workflow::workflow_of(&canonical::to_json(&event.envelope.payload)) {
                out.push(RowKey { tenant, kind: workflow::KIND_WORKFLOW.to_owned(), id: workflow.to_owned() });
            }
            return;
        }
        let report_type = event.envelope.event_type.as_str();
        if GPU_REPORT_TYPES.contains(&report_type) || INSTANCE_REPORT_TYPES.contains(&report_type) {
            // On the reservation's (or the instance's) stream (its rows below), and it finishes its command: the
            // command's rows, its node's queue and the node's journal head.
            let tenant = event.envelope.tenant.to_string();
            let row = |kind: &str, id: &str| RowKey { tenant: tenant.clone(), kind: kind.to_owned(), id: id.to_owned() };
            let report = canonical::to_json(&event.envelope.payload);
            let node = report.get("nodeId").and_then(Value::as_str);
            if let (Some(command), Some(node)) = (report.get("commandId").and_then(Value::as_str), node) {
                out.push(row(KIND_COMMAND, command));
                out.push(row(KIND_COMMAND_LIVE, command));
                out.push(row(KIND_NODE_COMMANDS, node));
            }
            // Any entry of a node's journal moves the node's journal head (an instance report
            // may answer no command: a change the node saw by itself).
            if let Some(node) = node
                && event.envelope.payload_has(bc_core::agent::JOURNAL_PAYLOAD_KEY)
            {
                out.push(row(KIND_NODE, node));
            }
        }
        if let Some((kind, id)) = event.envelope.stream.split_once('/')
            && matches!(
                kind,
                KIND_TENANT
                    | KIND_API_KEY
                    | KIND_POOL
                    | KIND_NODE
                    | KIND_WEBHOOK
                    | KIND_RESERVATION
                    | KIND_QUOTA
                    | KIND_JOIN_TOKEN
                    | KIND_FLAVOR
                    | KIND_IMAGE
                    | KIND_INSTANCE
                    | rollout::KIND_RELEASE
                    | rollout::KIND_ROLLOUT
            )
        {
            out.push(RowKey { tenant: event.envelope.tenant.to_string(), kind: kind.to_owned(), id: id.to_owned() });
            if kind == KIND_INSTANCE {
                out.push(RowKey {
                    tenant: event.envelope.tenant.to_string(),
                    kind: KIND_INSTANCE_LIVE.to_owned(),
                    id: id.to_owned(),
                });
            }
            if kind == rollout::KIND_ROLLOUT {
                out.push(RowKey {
                    tenant: event.envelope.tenant.to_string(),
                    kind: rollout::KIND_ROLLOUT_LIVE.to_owned(),
                    id: id.to_owned(),
                });
            }
            if kind == KIND_RESERVATION {
                out.push(RowKey {
                    tenant: event.envelope.tenant.to_string(),
                    kind: KIND_RESERVATION_LIVE.to_owned(),
                    id: id.to_owned(),
                });
            }
        }
    }

    fn apply(&self, key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
        let env = &event.envelope;
        let tenant_id = env.tenant.to_string();
        match env.event_type.as_str() {
            audit::CHECKPOINT_SEALED => {
                let (size, note) = audit::parse_checkpoint_payload(&env.payload).ok_or_else(|| Error::Corrupt {
                    tenant: tenant_id.clone(),
                    seq: env.seq,
                    what: "checkpoint.sealed payload does not parse".into(),
                })?;
                Ok(Some(serde_json::json!({ "treeSize": size, "note": note, "seq": env.seq, "sealedAtMs": env.at_ms })))
            }
            audit::CHECKPOINT_COSIGNED => {
                let (_, _, line) = audit::parse_cosigned_payload(&env.payload).ok_or_else(|| Error::Corrupt {
                    tenant: tenant_id.clone(),
                    seq: env.seq,
                    what: "checkpoint.cosigned payload does not parse".into(),
                })?;
                let mut doc = current.ok_or_else(|| Error::Corrupt {
                    tenant: tenant_id.clone(),
                    seq: env.seq,
                    what: "a cosignature of a checkpoint that was never sealed".into(),
                })?;
                let lines = doc["cosignatures"].as_array().cloned().unwrap_or_default();
                if !lines.iter().any(|l| l.as_str() == Some(line.as_str())) && lines.len() < bc_core::witness::WITNESSES_MAX {
                    let mut lines = lines;
                    lines.push(serde_json::Value::String(line));
                    doc["cosignatures"] = serde_json::Value::Array(lines);
                }
                Ok(Some(doc))
            }
            TENANT_CREATED => {
                let p: TenantCreated = payload(event)?;
                to_doc(&TenantDoc { tenant_id, name: p.name, root: p.root, version: env.version, created_at_ms: env.at_ms })
            }
            API_KEY_CREATED => {
                let p: ApiKeyCreated = payload(event)?;
                to_doc(&ApiKeyDoc {
                    tenant_id,
                    key_id: key.id.clone(),
                    name: p.name,
                    actions: p.actions,
                    secret_sha256: p.secret_sha256,
                    revoked: false,
                    version: env.version,
                    created_at_ms: env.at_ms,
                })
            }
            API_KEY_REVOKED => {
                let mut doc: ApiKeyDoc = from_doc(event, current)?;
                doc.revoked = true;
                doc.version = env.version;
                to_doc(&doc)
            }
            POOL_CREATED => {
                let p: PoolCreated = payload(event)?;
                to_doc(&PoolDoc {
                    tenant_id,
                    pool_id: key.id.clone(),
                    name: p.name,
                    description: p.description,
                    labels: p.labels,
                    max_reservation_s: p.max_reservation_s.unwrap_or(MAX_RESERVATION_S_DEFAULT),
                    archived: false,
                    version: env.version,
                    created_at_ms: env.at_ms,
                    updated_at_ms: env.at_ms,
                })
            }
            POOL_UPDATED => {
                let p: PoolUpdated = payload(event)?;
                let mut doc: PoolDoc = from_doc(event, current)?;
                if let Some(name) = p.name {
                    doc.name = name;
                }
                if let Some(description) = p.description {
                    doc.description = description;
                }
                if let Some(labels) = p.labels {
                    doc.labels = labels;
                }
                if let Some(max) = p.max_reservation_s {
                    doc.max_reservation_s = max;
                }
                doc.version = env.version;
                doc.updated_at_ms = env.at_ms;
                to_doc(&doc)
            }
            POOL_ARCHIVED => {
                let mut doc: PoolDoc = from_doc(event, current)?;
                doc.archived = true;
                doc.version = env.version;
                doc.updated_at_ms = env.at_ms;
                to_doc(&doc)
            }
            NODE_REGISTERED => {
                let p: NodeRegistered = payload(event)?;
                to_doc(&NodeDoc {
                    tenant_id,
                    node_id: key.id.clone(),
                    pool_id: p.pool_id,
                    name: p.name,
                    gpus: p.gpus,
                    labels: p.labels,
                    state: NodeState::Ready,
                    taints: Default::default(),
                    allocations: Default::default(),
                    gpu_uuids: Vec::new(),
                    cordoned: false,
                    draining: false,
                    agent: None,
                    version: env.version,
                    created_at_ms: env.at_ms,
                    updated_at_ms: env.at_ms,
                })
            }
            NODE_JOINED => {
                let p: NodeJoined = payload(event)?;
                let mut doc = NodeDoc {
                    tenant_id,
                    node_id: key.id.clone(),
                    pool_id: p.pool_id,
                    name: p.name,
                    gpus: p.gpus,
                    labels: p.labels,
                    state: NodeState::Unreachable,
                    taints: Default::default(),
                    allocations: Default::default(),
                    gpu_uuids: p.gpu_uuids,
                    cordoned: false,
                    draining: false,
                    // Unreachable until its first session: joining is not running.
                    agent: Some(NodeAgent {
                        public_key: p.public_key,
                        agent_version: p.agent_version,
                        hostname: p.hostname,
                        join_token_id: p.join_token_id,
                        joined_at_ms: env.at_ms,
                        reachable: false,
                        lease_expires_at_ms: 0,
                        journal_seq: 0,
                        journal_hash: String::new(),
                        observed: None,
                        inventory: None,
                        inventory_at_ms: 0,
                        inventory_pending: false,
                        ready_since_ms: 0,
                        agent_slot: String::new(),
                        agent_started_at_ms: 0,
                    }),
                    version: env.version,
                    created_at_ms: env.at_ms,
                    updated_at_ms: env.at_ms,
                };
                doc.refresh_state();
                to_doc(&doc)
            }
            NODE_READY | NODE_UNREACHABLE => {
                let p: NodeLiveness = payload(event)?;
                let mut doc: NodeDoc = from_doc(event, current)?;
                doc.normalize();
                let agent = doc.agent.as_mut().ok_or_else(|| corrupt(event, format!("node {} has no agent", key.id)))?;
                let ready = env.event_type == NODE_READY;
                if ready && !agent.reachable {
                    agent.ready_since_ms = env.at_ms;
                } else if !ready {
                    agent.ready_since_ms = 0;
                }
                agent.reachable = ready;
                agent.lease_expires_at_ms = p.lease_expires_at_ms;
                doc.refresh_state();
                doc.version = env.version;
                doc.updated_at_ms = env.at_ms;
                to_doc(&doc)
            }
            JOIN_TOKEN_CREATED => {
                let p: JoinTokenCreated = payload(event)?;
                to_doc(&JoinTokenDoc {
                    tenant_id,
                    join_token_id: key.id.clone(),
                    pool_id: p.pool_id,
                    description: p.description,
                    expires_at_ms: p.expires_at_ms,
                    uses_max: p.uses_max,
                    uses: 0,
                    node_id: p.node_id,
                    node_ids: Vec::new(),
                    revoked: false,
                    version: env.version,
                    created_at_ms: env.at_ms,
                })
            }
            JOIN_TOKEN_USED | JOIN_TOKEN_REVOKED => {
                let mut doc: JoinTokenDoc = from_doc(event, current)?;
                if env.event_type == JOIN_TOKEN_USED {
                    let p: JoinTokenUsed = payload(event)?;
                    if doc.uses >= doc.uses_max || doc.revoked {
                        // The join decision reads the token at its version; never spend more.
                        return Err(corrupt(event, format!("join token {} has no use left", key.id)));
                    }
                    doc.uses += 1;
                    doc.node_ids.push(p.node_id);
                } else {
                    doc.revoked = true;
                }
                doc.version = env.version;
                to_doc(&doc)
            }
            COMMAND_ISSUED | COMMAND_CANCELLED | COMMAND_STARTED | COMMAND_SUCCEEDED | COMMAND_FAILED => {
                let command_id = env.stream.split_once('/').map(|(_, id)| id.to_owned()).unwrap_or_default();
                let progress: Option<CommandProgress> =
                    if matches!(env.event_type.as_str(), COMMAND_STARTED | COMMAND_SUCCEEDED | COMMAND_FAILED) {
                        Some(payload(event)?)
                    } else {
                        None
                    };
                apply_command(key, current, event, command_id, progress, env.event_type.as_str())
            }
            NODE_INVENTORY_REPORTED => {
                let mut p: NodeInventoryReported = payload(event)?;
                let journal = p.journal.take().ok_or_else(|| corrupt(event, "an inventory without a journal entry".into()))?;
                if key.kind == inventory::KIND_INVENTORY {
                    if current.is_some() {
                        return Err(corrupt(event, format!("inventory row {} folded twice", key.id)));
                    }
                    return to_doc(&inventory::InventoryReportDoc {
                        tenant_id,
                        node_id: p.node_id.clone(),
                        seq: env.seq,
                        event_id: env.id.to_string(),
                        journal_seq: journal.seq,
                        reported_at_ms: env.at_ms,
                        inventory: p,
                    });
                }
                let mut doc: NodeDoc = from_doc(event, current)?;
                advance_journal(&mut doc, &journal, event)?;
                let free = doc.allocations.is_empty();
                if free {
                    (doc.gpus, doc.gpu_uuids) = gpus_of_inventory(&p);
                }
                if let Some(agent) = doc.agent.as_mut() {
                    agent.inventory_pending = !free;
                    agent.inventory = Some(p);
                    agent.inventory_at_ms = env.at_ms;
                }
                to_doc(&doc)
            }
            NODE_AGENT_STARTED => {
                let p: NodeAgentStarted = payload(event)?;
                let journal = p.journal.ok_or_else(|| corrupt(event, "node.agent_started without a journal entry".into()))?;
                let mut doc: NodeDoc = from_doc(event, current)?;
                advance_journal(&mut doc, &journal, event)?;
                if let Some(agent) = doc.agent.as_mut() {
                    agent.agent_version = p.version;
                    agent.agent_slot = p.slot;
                    agent.agent_started_at_ms = env.at_ms;
                }
                to_doc(&doc)
            }
            NODE_OBSERVED => {
                let p: NodeObserved = payload(event)?;
                let journal = p.journal.ok_or_else(|| corrupt(event, "node.observed without a journal entry".into()))?;
                let mut doc: NodeDoc = from_doc(event, current)?;
                advance_journal(&mut doc, &journal, event)?;
                if let Some(agent) = doc.agent.as_mut() {
                    agent.observed = Some(Observation {
                        at_ms: env.at_ms,
                        uptime_s: p.uptime_s,
                        load_avg1_milli: p.load_avg1_milli,
                        mem_available_kib: p.mem_available_kib,
                    });
                }
                to_doc(&doc)
            }
            // The node is gone: its document with it (the events stay in the log).
            NODE_DELETED => {
                let _: NodeDeleted = payload(event)?;
                Ok(None)
            }
            NODE_CORDONED | NODE_UNCORDONED | NODE_DRAINING | NODE_LABELED | NODE_TAINTED | NODE_ALLOCATED | NODE_FREED => {
                let mut doc: NodeDoc = from_doc(event, current)?;
                doc.normalize();
                match env.event_type.as_str() {
                    NODE_CORDONED => doc.cordoned = true,
                    NODE_UNCORDONED => (doc.cordoned, doc.draining) = (false, false),
                    NODE_DRAINING => (doc.cordoned, doc.draining) = (true, true),
                    NODE_LABELED => apply_keys(&mut doc.labels, payload(event)?),
                    NODE_TAINTED => apply_keys(&mut doc.taints, payload(event)?),
                    NODE_ALLOCATED => {
                        let p: NodeAllocated = payload(event)?;
                        for gpu in p.gpus {
                            if gpu as usize >= doc.gpus.len() {
                                return Err(corrupt(event, format!("node {} has no GPU {gpu}", doc.node_id)));
                            }
                            if let Some(holder) = doc.allocations.insert(gpu, p.reservation_id.clone()) {
                                // The decision guards the node's version, so this never happens;
                                // if it did, the append fails here rather than double-book.
                                return Err(corrupt(event, format!("GPU {gpu} of {} is already held by {holder}", doc.node_id)));
                            }
                        }
                    }
                    _ => {
                        let p: NodeFreed = payload(event)?;
                        doc.allocations.retain(|_, holder| *holder != p.reservation_id);
                        // An inventory that came while GPUs were held is taken once they are free.
                        if doc.allocations.is_empty()
                            && let Some(agent) = doc.agent.as_mut()
                            && agent.inventory_pending
                            && let Some(inventory) = &agent.inventory
                        {
                            (doc.gpus, doc.gpu_uuids) = gpus_of_inventory(inventory);
                            agent.inventory_pending = false;
                        }
                    }
                }
                doc.refresh_state();
                doc.version = env.version;
                doc.updated_at_ms = env.at_ms;
                to_doc(&doc)
            }
            RESERVATION_REQUESTED => {
                let p: ReservationRequested = payload(event)?;
                to_doc(&ReservationDoc {
                    tenant_id,
                    reservation_id: key.id.clone(),
                    pool_id: p.pool_id,
                    gpus: p.gpus,
                    duration_s: p.duration_s,
                    selector: p.selector,
                    nvlink: p.nvlink,
                    tolerations: p.tolerations,
                    state: ReservationState::Queued,
                    node_id: None,
                    gpu_indexes: Vec::new(),
                    request_seq: env.seq,
                    requested_at_ms: env.at_ms,
                    activated_at_ms: None,
                    ends_at_ms: None,
                    ended_at_ms: None,
                    binding: None,
                    hold_attempts: 0,
                    hold_failed_nodes: Vec::new(),
                    last_error: None,
                    instance_id: None,
                    version: env.version,
                })
            }
            GPU_HELD | GPU_HOLD_FAILED | GPU_RELEASED => apply_gpu_report(key, current, event),
            METAL_ENROLLED
            | METAL_TRANSITIONED
            | METAL_STEP_DONE
            | METAL_STEP_RETRIED
            | METAL_WORKFLOW_FINISHED
            | METAL_WORKFLOW_PAUSED
            | METAL_WORKFLOW_RESUMED
            | METAL_MAINTENANCE_SET
            | METAL_POWER_DRIFTED => workflow::apply_metal(&key.kind, &key.id, current, event),
            RELEASE_REGISTERED => rollout::apply_release(&key.id, current, event),
            ROLLOUT_CREATED
            | ROLLOUT_NODE_UPDATING
            | ROLLOUT_NODE_UPDATED
            | ROLLOUT_NODE_FAILED
            | ROLLOUT_NODE_ROLLING_BACK
            | ROLLOUT_NODE_ROLLED_BACK
            | ROLLOUT_NODE_ROLLBACK_FAILED
            | ROLLOUT_WAVE_PASSED
            | ROLLOUT_PAUSED
            | ROLLOUT_RESUMED
            | ROLLOUT_ABORTING
            | ROLLOUT_ABORTED
            | ROLLOUT_COMPLETED => rollout::apply_rollout(&key.kind, &key.id, current, event),
            INSTANCE_CREATED
            | INSTANCE_START_REQUESTED
            | INSTANCE_STOP_REQUESTED
            | INSTANCE_RESIZE_REQUESTED
            | INSTANCE_DELETE_REQUESTED
            | INSTANCE_REAPPLIED
            | INSTANCE_FAILED
            | INSTANCE_DELETED => instance::apply_instance(&key.kind, &key.id, current, event),
            INSTANCE_OBSERVED | INSTANCE_APPLY_FAILED => match key.kind.as_str() {
                KIND_INSTANCE | KIND_INSTANCE_LIVE => instance::apply_instance(&key.kind, &key.id, current, event),
                KIND_NODE => {
                    let report: InstanceReport = payload(event)?;
                    let journal = report
                        .journal
                        .ok_or_else(|| corrupt(event, "an instance report without a journal entry touched its node".into()))?;
                    let mut doc: NodeDoc = from_doc(event, current)?;
                    advance_journal(&mut doc, &journal, event)?;
                    to_doc(&doc)
                }
                _ => {
                    // It finishes its command, as `command.succeeded` or `.failed` would.
                    let report: InstanceReport = payload(event)?;
                    let command_id = report
                        .command_id
                        .clone()
                        .ok_or_else(|| corrupt(event, format!("{} without a command touched a command", env.event_type)))?;
                    let failed = env.event_type == INSTANCE_APPLY_FAILED;
                    let result = (!failed).then(
                        || serde_json::json!({ "state": report.state, "vcpus": report.vcpus, "memoryMiB": report.memory_mib }),
                    );
                    let progress = CommandProgress {
                        command_id: command_id.clone(),
                        node_id: report.node_id,
                        result,
                        reason: report.reason,
                        journal: report.journal,
                    };
                    apply_command(
                        key,
                        current,
                        event,
                        command_id,
                        Some(progress),
                        if failed { COMMAND_FAILED } else { COMMAND_SUCCEEDED },
                    )
                }
            },
            RESERVATION_INSTANCE_ATTACHED | RESERVATION_INSTANCE_DETACHED => {
                if key.kind == KIND_RESERVATION_LIVE && current.is_none() {
                    return Ok(None);
                }
                let p: ReservationInstance = payload(event)?;
                let mut doc: ReservationDoc = from_doc(event, current)?;
                doc.instance_id = (env.event_type == RESERVATION_INSTANCE_ATTACHED).then_some(p.instance_id);
                doc.version = env.version;
                to_doc(&doc)
            }
            RESERVATION_ACTIVATED
            | RESERVATION_EXTENDED
            | RESERVATION_RELEASED
            | RESERVATION_EXPIRED
            | RESERVATION_CANCELLED
            | RESERVATION_REQUEUED
            | RESERVATION_FAILED => {
                // The live row of a reservation that has ended stays gone.
                if key.kind == KIND_RESERVATION_LIVE && current.is_none() {
                    return Ok(None);
                }
                let mut doc: ReservationDoc = from_doc(event, current)?;
                match env.event_type.as_str() {
                    RESERVATION_ACTIVATED => {
                        let p: ReservationActivated = payload(event)?;
                        doc.state = ReservationState::Active;
                        doc.node_id = Some(p.node_id);
                        doc.gpu_indexes = p.gpus;
                        doc.activated_at_ms = Some(env.at_ms);
                        doc.ends_at_ms = Some(p.ends_at_ms);
                        doc.binding = Some(Binding {
                            state: if p.hold.is_some() { BindingState::Pending } else { BindingState::Bound },
                            hold_command_id: p.hold.as_ref().map(|h| h.command_id.clone()),
                            deadline_at_ms: p.hold.as_ref().map(|h| h.deadline_at_ms),
                            release_command_id: None,
                            gpu_uuids: Vec::new(),
                            reason: None,
                            changed_at_ms: env.at_ms,
                        });
                    }
                    RESERVATION_EXTENDED => {
                        let p: ReservationExtended = payload(event)?;
                        doc.ends_at_ms = Some(p.ends_at_ms);
                    }
                    RESERVATION_REQUEUED => {
                        let p: ReservationRequeued = payload(event)?;
                        doc.state = ReservationState::Queued;
                        doc.node_id = None;
                        doc.gpu_indexes = Vec::new();
                        doc.activated_at_ms = None;
                        doc.ends_at_ms = None;
                        doc.binding = None;
                        doc.hold_attempts = p.attempts;
                        if !doc.hold_failed_nodes.contains(&p.node_id) {
                            doc.hold_failed_nodes.push(p.node_id);
                        }
                        doc.last_error = Some(p.reason);
                    }
                    ended => {
                        doc.state = match ended {
                            RESERVATION_RELEASED => ReservationState::Released,
                            RESERVATION_EXPIRED => ReservationState::Expired,
                            RESERVATION_FAILED => ReservationState::Failed,
                            _ => ReservationState::Cancelled,
                        };
                        let release = if ended == RESERVATION_FAILED {
                            let p: ReservationFailed = payload(event)?;
                            doc.hold_attempts = p.attempts;
                            doc.last_error = Some(p.reason);
                            p.release
                        } else {
                            payload::<ReservationEnded>(event)?.release
                        };
                        if let (Some(binding), Some(release)) = (doc.binding.as_mut(), release) {
                            binding.release_command_id = Some(release.command_id);
                            binding.changed_at_ms = env.at_ms;
                        }
                        doc.ended_at_ms = Some(env.at_ms);
                    }
                }
                doc.version = env.version;
                let live = doc.state.is_live();
                if key.kind == KIND_RESERVATION_LIVE && !live { Ok(None) } else { to_doc(&doc) }
            }
            QUOTA_EXCEEDED | QUOTA_CHARGED => {
                // The quota's version follows its stream, which these move: a reservation's
                // append guards it.
                let Some(current) = current else { return Ok(None) };
                let mut doc: QuotaDoc = from_doc(event, Some(current))?;
                doc.version = env.version;
                to_doc(&doc)
            }
            QUOTA_SET => {
                let p: QuotaSet = payload(event)?;
                to_doc(&QuotaDoc {
                    tenant_id,
                    pool_id: key.id.clone(),
                    gpus: p.gpus,
                    version: env.version,
                    updated_at_ms: env.at_ms,
                })
            }
            WEBHOOK_CREATED => {
                let p: WebhookCreated = payload(event)?;
                to_doc(&WebhookDoc {
                    tenant_id,
                    webhook_id: key.id.clone(),
                    url: p.url,
                    event_types: p.event_types,
                    description: p.description,
                    secret_version: p.secret_version,
                    secret_id: p.secret_id,
                    previous_secrets: Vec::new(),
                    created_seq: env.seq,
                    version: env.version,
                    created_at_ms: env.at_ms,
                    updated_at_ms: env.at_ms,
                })
            }
            WEBHOOK_UPDATED => {
                let p: WebhookUpdated = payload(event)?;
                let mut doc: WebhookDoc = from_doc(event, current)?;
                if let Some(url) = p.url {
                    doc.url = url;
                }
                if let Some(types) = p.event_types {
                    doc.event_types = types;
                }
                if let Some(description) = p.description {
                    doc.description = description;
                }
                doc.version = env.version;
                doc.updated_at_ms = env.at_ms;
                to_doc(&doc)
            }
            WEBHOOK_SECRET_ROTATED => {
                let p: WebhookSecretRotated = payload(event)?;
                let mut doc: WebhookDoc = from_doc(event, current)?;
                doc.secret_version = p.secret_version;
                let old = std::mem::replace(&mut doc.secret_id, p.secret_id);
                doc.previous_secrets.retain(|prev| prev.valid_until_ms > env.at_ms);
                if p.previous_valid_until_ms > env.at_ms {
                    doc.previous_secrets.push(PreviousSecret { secret_id: old, valid_until_ms: p.previous_valid_until_ms });
                }
                let excess = doc.previous_secrets.len().saturating_sub(PREVIOUS_SECRETS_MAX);
                doc.previous_secrets.drain(..excess);
                doc.version = env.version;
                doc.updated_at_ms = env.at_ms;
                to_doc(&doc)
            }
            WEBHOOK_PINGED => {
                let mut doc: WebhookDoc = from_doc(event, current)?;
                doc.version = env.version;
                to_doc(&doc)
            }
            WEBHOOK_DELETED => Ok(None),
            FLAVOR_CREATED => {
                let p: FlavorCreated = payload(event)?;
                if current.is_some() {
                    return Err(corrupt(event, format!("flavor {} created twice", key.id)));
                }
                to_doc(&FlavorDoc {
                    tenant_id,
                    flavor_id: key.id.clone(),
                    pool_id: p.pool_id,
                    name: p.name,
                    vcpus: p.vcpus,
                    memory_mib: p.memory_mib,
                    disk_gib: p.disk_gib,
                    gpus: p.gpus,
                    version: env.version,
                    created_at_ms: env.at_ms,
                })
            }
            IMAGE_REGISTERED => {
                let p: ImageRegistered = payload(event)?;
                if current.is_some() {
                    return Err(corrupt(event, format!("image {} registered twice", key.id)));
                }
                to_doc(&ImageDoc {
                    tenant_id,
                    image_id: key.id.clone(),
                    name: p.name,
                    url: p.url,
                    sha256: p.sha256,
                    disk_format: p.disk_format,
                    size_bytes: p.size_bytes,
                    version: env.version,
                    created_at_ms: env.at_ms,
                })
            }
            FLAVOR_DELETED | IMAGE_DELETED => {
                // Deleting what does not exist is a broken log, not a no-op.
                let _: Value =
                    current.ok_or_else(|| corrupt(event, format!("{} of {} that does not exist", env.event_type, key.id)))?;
                Ok(None)
            }
            // An event type this fold does not know leaves the row as it was: newer writers may
            // add types that older readers ignore.
            _ => Ok(current),
        }
    }
}

/// A node's GPU report (`gpu.held`, `gpu.hold_failed`, `gpu.released`, on the reservation's
/// stream): it finishes its command (as `command.succeeded` or `.failed` would) and changes the
/// reservation's binding when it answers the command the binding waits on; a stale answer (the
/// reservation requeued or ended meanwhile) changes only the reservation's version.
fn apply_gpu_report(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let report: GpuReport = payload(event)?;
    match key.kind.as_str() {
        KIND_RESERVATION | KIND_RESERVATION_LIVE => {
            if key.kind == KIND_RESERVATION_LIVE && current.is_none() {
                return Ok(None);
            }
            let mut doc: ReservationDoc = from_doc(event, current)?;
            if let Some(binding) = doc.binding.as_mut() {
                let answers_hold = binding.hold_command_id.as_deref() == Some(report.command_id.as_str())
                    && binding.state == BindingState::Pending;
                let answers_release = binding.release_command_id.as_deref() == Some(report.command_id.as_str());
                match env.event_type.as_str() {
                    GPU_HELD if answers_hold => {
                        binding.state = BindingState::Bound;
                        binding.gpu_uuids = report.gpus.clone();
                        binding.changed_at_ms = env.at_ms;
                    }
                    GPU_HOLD_FAILED if answers_hold => {
                        binding.state = BindingState::Failed;
                        binding.reason = report.reason.clone();
                        binding.changed_at_ms = env.at_ms;
                    }
                    GPU_RELEASED if answers_release => {
                        binding.state = BindingState::Released;
                        binding.changed_at_ms = env.at_ms;
                    }
                    _ => {}
                }
            }
            doc.version = env.version;
            to_doc(&doc)
        }
        _ => {
            let result = (env.event_type != GPU_HOLD_FAILED).then(|| serde_json::json!({ "gpus": report.gpus }));
            let progress = CommandProgress {
                command_id: report.command_id.clone(),
                node_id: report.node_id,
                result,
                reason: report.reason,
                journal: report.journal,
            };
            let effect = if env.event_type == GPU_HOLD_FAILED { COMMAND_FAILED } else { COMMAND_SUCCEEDED };
            apply_command(key, current, event, report.command_id, Some(progress), effect)
        }
    }
}

/// The rows a command event changes: the command, its live row, its node's queue and, for an
/// entry of the node's journal, the node's journal head (the node's version does not move: the
/// event is on the command's stream). `effect` is the command event type the event counts as
/// (a GPU report finishes its command as `command.succeeded` or `.failed`).
fn apply_command(
    key: &RowKey,
    current: Option<Value>,
    event: &StoredEvent,
    command_id: String,
    progress: Option<CommandProgress>,
    effect: &str,
) -> Result<Option<Value>> {
    let env = &event.envelope;
    let issued = effect == COMMAND_ISSUED;
    match key.kind.as_str() {
        KIND_COMMAND | KIND_COMMAND_LIVE => {
            if key.kind == KIND_COMMAND_LIVE && current.is_none() && !issued {
                return Ok(None);
            }
            let mut doc = if issued {
                let p: CommandIssued = payload(event)?;
                CommandDoc {
                    tenant_id: env.tenant.to_string(),
                    command_id,
                    node_id: p.node_id,
                    kind: p.kind,
                    args: p.args,
                    state: CommandState::Issued,
                    reason: None,
                    result: None,
                    issued_by: env.actor.clone(),
                    issued_at_ms: env.at_ms,
                    deadline_at_ms: p.deadline_at_ms,
                    started_at_ms: None,
                    finished_at_ms: None,
                    journal_seqs: Vec::new(),
                    version: env.version,
                }
            } else {
                from_doc(event, current)?
            };
            if let Some(p) = &progress {
                if let Some(journal) = &p.journal {
                    doc.journal_seqs.push(journal.seq);
                }
                // A report on a finished command (cancelled while it ran) is kept in the log
                // but does not reopen it.
                if !doc.state.is_finished() {
                    match effect {
                        COMMAND_STARTED => {
                            doc.state = CommandState::Started;
                            doc.started_at_ms = Some(env.at_ms);
                        }
                        COMMAND_SUCCEEDED => {
                            doc.state = CommandState::Succeeded;
                            doc.result = p.result.clone();
                            doc.finished_at_ms = Some(env.at_ms);
                        }
                        _ => {
                            doc.state = CommandState::Failed;
                            doc.reason = p.reason.clone();
                            doc.finished_at_ms = Some(env.at_ms);
                        }
                    }
                }
            } else if effect == COMMAND_CANCELLED && !doc.state.is_finished() {
                let p: CommandCancelled = payload(event)?;
                doc.state = CommandState::Cancelled;
                doc.reason = Some(p.reason);
                doc.finished_at_ms = Some(env.at_ms);
            }
            // A GPU report finishes its command from the reservation's stream: the command's own
            // version moves only with its own stream.
            if env.stream.starts_with(&format!("{KIND_COMMAND}/")) {
                doc.version = env.version;
            }
            if key.kind == KIND_COMMAND_LIVE && doc.state.is_finished() { Ok(None) } else { to_doc(&doc) }
        }
        KIND_NODE_COMMANDS => {
            let mut queue: NodeCommandsDoc = match current {
                Some(doc) => serde_json::from_value(doc).map_err(|e| Error::Internal(format!("projection document: {e}")))?,
                None => NodeCommandsDoc::default(),
            };
            if issued {
                // The bound is `commands.issue`'s; the control plane's own GPU commands (one or two
                // per placement, so bounded by the node's GPUs and the hold attempts) are never
                // refused here, or an expiry or a release would fail for a node that is away.
                let kind = canonical::to_json(&env.payload).get("kind").and_then(Value::as_str).map(str::to_owned);
                // `instances.*` checks the bound before it issues `instance.apply`; the reconciler's
                // applies again are bounded by the instances' attempts.
                let ours = kind.is_some_and(|k| k.starts_with("gpu.") || k == INSTANCE_APPLY);
                if !ours && queue.pending.len() >= COMMANDS_PENDING_PER_NODE_MAX {
                    return Err(corrupt(
                        event,
                        format!("node {} has {COMMANDS_PENDING_PER_NODE_MAX} unfinished commands", key.id),
                    ));
                }
                queue.pending.push(command_id);
            } else if effect != COMMAND_STARTED {
                queue.pending.retain(|id| *id != command_id);
            }
            if queue.pending.is_empty() { Ok(None) } else { to_doc(&queue) }
        }
        KIND_NODE => {
            let journal = progress
                .and_then(|p| p.journal)
                .ok_or_else(|| corrupt(event, "a command event without a journal entry touched its node".into()))?;
            let mut doc: NodeDoc = from_doc(event, current)?;
            advance_journal(&mut doc, &journal, event)?;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}

/// Moves a node's journal head to the entry an event carries: the next one, always.
fn advance_journal(doc: &mut NodeDoc, journal: &bc_core::agent::JournalOrigin, event: &StoredEvent) -> Result<()> {
    let node = doc.node_id.clone();
    let agent = doc.agent.as_mut().ok_or_else(|| corrupt(event, format!("node {node} has no agent")))?;
    let body = bc_core::agent::unb64(&journal.body).map_err(|e| corrupt(event, format!("journal entry: {e}")))?;
    if journal.seq != agent.journal_seq + 1 {
        return Err(corrupt(event, format!("journal entry {} follows {} of node {node}", journal.seq, agent.journal_seq)));
    }
    agent.journal_seq = journal.seq;
    agent.journal_hash = hex::encode(bc_core::event::sha256(&body));
    Ok(())
}

/// The node's GPUs as an inventory reports them, in index order, and their UUIDs.
pub fn gpus_of_inventory(inventory: &NodeInventoryReported) -> (Vec<Gpu>, Vec<String>) {
    inventory
        .gpus
        .iter()
        .map(|g| {
            let gpu =
                Gpu { model: g.model.clone(), product: g.product.clone(), vram_gib: g.vram_gib, nvlink_domain: g.nvlink_domain };
            (gpu, g.uuid.clone())
        })
        .unzip()
}
