//! Event types and their payloads: the log's wire format (STYLE rule 5: separate from the HTTP
//! JSON and from the documents). The catalogue in `schema/EVENTS.md` lists the same types.
//! Field names are camelCase CBOR text keys; numbers are unsigned integers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const TENANT_CREATED: &str = "tenant.created";
pub const API_KEY_CREATED: &str = "api_key.created";
pub const API_KEY_REVOKED: &str = "api_key.revoked";
pub const POOL_CREATED: &str = "pool.created";
pub const POOL_UPDATED: &str = "pool.updated";
pub const POOL_ARCHIVED: &str = "pool.archived";
pub const NODE_REGISTERED: &str = "node.registered";
pub const NODE_CORDONED: &str = "node.cordoned";
pub const NODE_UNCORDONED: &str = "node.uncordoned";
pub const NODE_DRAINING: &str = "node.draining";
pub const NODE_LABELED: &str = "node.labeled";
pub const NODE_TAINTED: &str = "node.tainted";
pub const NODE_ALLOCATED: &str = "node.allocated";
pub const NODE_FREED: &str = "node.freed";
pub const NODE_DELETED: &str = "node.deleted";
pub const RESERVATION_REQUESTED: &str = "reservation.requested";
pub const RESERVATION_ACTIVATED: &str = "reservation.activated";
pub const RESERVATION_EXTENDED: &str = "reservation.extended";
pub const RESERVATION_RELEASED: &str = "reservation.released";
pub const RESERVATION_EXPIRED: &str = "reservation.expired";
pub const RESERVATION_CANCELLED: &str = "reservation.cancelled";
pub const QUOTA_SET: &str = "quota.set";
pub const QUOTA_EXCEEDED: &str = "quota.exceeded";
/// A reservation counted against its tenant's quota in a pool: in the reservation's own append,
/// guarded at the quota stream's version, so two gateways deciding on the same usage cannot both
/// land (one is a CONFLICT and decides again).
pub const QUOTA_CHARGED: &str = "quota.charged";
pub const WEBHOOK_CREATED: &str = "webhook.created";
pub const WEBHOOK_UPDATED: &str = "webhook.updated";
pub const WEBHOOK_SECRET_ROTATED: &str = "webhook.secret_rotated";
pub const WEBHOOK_PINGED: &str = "webhook.pinged";
pub const WEBHOOK_DELETED: &str = "webhook.deleted";
pub const FLAVOR_CREATED: &str = "flavor.created";
pub const FLAVOR_DELETED: &str = "flavor.deleted";
pub const IMAGE_REGISTERED: &str = "image.registered";
pub const IMAGE_DELETED: &str = "image.deleted";
pub const JOIN_TOKEN_CREATED: &str = "join_token.created";
pub const JOIN_TOKEN_USED: &str = "join_token.used";
pub const JOIN_TOKEN_REVOKED: &str = "join_token.revoked";
pub const NODE_JOINED: &str = "node.joined";
pub const NODE_READY: &str = "node.ready";
pub const NODE_UNREACHABLE: &str = "node.unreachable";
pub const COMMAND_ISSUED: &str = "command.issued";
pub const COMMAND_CANCELLED: &str = "command.cancelled";
pub const COMMAND_STARTED: &str = "command.started";
pub const COMMAND_SUCCEEDED: &str = "command.succeeded";
pub const COMMAND_FAILED: &str = "command.failed";
pub const NODE_OBSERVED: &str = "node.observed";
/// Every start of `bcd node` ([`NodeAgentStarted`]): the agent's version and slot, on
/// `agent/node_…`. The node's document takes its version from here; a rollout's gate reads it.
pub const NODE_AGENT_STARTED: &str = "node.agent_started";
pub const NODE_INVENTORY_REPORTED: &str = "node.inventory_reported";
/// A node's answer to `gpu.hold` and `gpu.release`, journaled on the reservation's stream
/// ([`GpuReport`]); each finishes its command.
pub const GPU_HELD: &str = "gpu.held";
pub const GPU_HOLD_FAILED: &str = "gpu.hold_failed";
pub const GPU_RELEASED: &str = "gpu.released";
/// The GPU reports, which finish a command and change a reservation's binding.
pub const GPU_REPORT_TYPES: &[&str] = &[GPU_HELD, GPU_HOLD_FAILED, GPU_RELEASED];
/// An active reservation whose hold failed, given back to the head of its pool's queue.
pub const RESERVATION_REQUEUED: &str = "reservation.requeued";
/// A reservation whose holds failed [`crate::HOLD_ATTEMPTS_MAX`] times: ended, with the reason.
pub const RESERVATION_FAILED: &str = "reservation.failed";
/// An instance (`instance/inst_…`): created on an active, bound reservation's node with the
/// `instance.apply` command issued in the same append ([`InstanceCreated`]); each request
/// (start, stop, resize, delete) moves its desired state or shape, bumps its generation and
/// issues `instance.apply` again ([`InstanceRequested`]).
pub const INSTANCE_CREATED: &str = "instance.created";
pub const INSTANCE_START_REQUESTED: &str = "instance.start_requested";
pub const INSTANCE_STOP_REQUESTED: &str = "instance.stop_requested";
pub const INSTANCE_RESIZE_REQUESTED: &str = "instance.resize_requested";
pub const INSTANCE_DELETE_REQUESTED: &str = "instance.delete_requested";
/// The instances reconciler sent `instance.apply` again: the node's state differs from the
/// desired one, or the last apply failed or went unanswered ([`InstanceReapplied`]).
pub const INSTANCE_REAPPLIED: &str = "instance.reapplied";
/// Applies failed [`crate::INSTANCE_APPLY_ATTEMPTS_MAX`] times in a row: given up, with the reason.
pub const INSTANCE_FAILED: &str = "instance.failed";
/// The node reported the domain gone after a delete: the instance is finished, and its
/// reservation takes another (`reservation.instance_detached` in the same append).
pub const INSTANCE_DELETED: &str = "instance.deleted";
/// What the node's hypervisor says of the domain ([`InstanceReport`]), from its journal: the
/// answer to an `instance.apply` (finishing it), or a change the node saw by itself.
pub const INSTANCE_OBSERVED: &str = "instance.observed";
/// The node could not apply (`image-digest: …`, `gpus-not-held: …`); finishes the command.
pub const INSTANCE_APPLY_FAILED: &str = "instance.apply_failed";
/// The node's instance reports.
pub const INSTANCE_REPORT_TYPES: &[&str] = &[INSTANCE_OBSERVED, INSTANCE_APPLY_FAILED];
/// On the reservation's stream: an instance now uses its GPUs, or no longer does.
pub const RESERVATION_INSTANCE_ATTACHED: &str = "reservation.instance_attached";
pub const RESERVATION_INSTANCE_DETACHED: &str = "reservation.instance_detached";
/// A bare-metal machine (`metal/node_…`) was enrolled by its BMC ([`MetalEnrolled`]); its BMC
/// password is sealed in the secret store, never in the log.
pub const METAL_ENROLLED: &str = "metal.enrolled";
/// The machine moved from one lifecycle state to another by a verb ([`MetalTransitioned`]):
/// a caller's, or its workflow's (`done`, `wait`, `fail`). Every transition is one of these.
pub const METAL_TRANSITIONED: &str = "metal.transitioned";
/// One step of the machine's workflow finished ([`MetalStepDone`]).
pub const METAL_STEP_DONE: &str = "metal.step_done";
/// One step failed and is tried again after a back-off ([`MetalStepRetried`]).
pub const METAL_STEP_RETRIED: &str = "metal.step_retried";
/// A workflow ended ([`MetalWorkflowFinished`]): succeeded, failed (with the reason) or aborted.
pub const METAL_WORKFLOW_FINISHED: &str = "metal.workflow_finished";
/// An operator paused or resumed a workflow's steps (its deadline runs on either way).
pub const METAL_WORKFLOW_PAUSED: &str = "metal.workflow_paused";
pub const METAL_WORKFLOW_RESUMED: &str = "metal.workflow_resumed";
/// The machine was put in maintenance with a reason ([`MetalMaintenanceSet`]): a BMC that
/// refuses its credentials, after bounded retries. `recover` clears it.
pub const METAL_MAINTENANCE_SET: &str = "metal.maintenance_set";
/// The BMC says another power state than the log, on reads a sync interval apart
/// ([`MetalPowerDrifted`]): the log follows the machine.
pub const METAL_POWER_DRIFTED: &str = "metal.power_drifted";
/// A signed `bcd` release, checked under a configured release key (`release/rel_…`).
pub const RELEASE_REGISTERED: &str = "release.registered";
/// A rollout of a release to a fixed list of nodes, in waves (`rollout/ro_…`; see
/// `crate::rollout`).
pub const ROLLOUT_CREATED: &str = "rollout.created";
/// A node was sent `agent.update` (the command issued in the same append).
pub const ROLLOUT_NODE_UPDATING: &str = "rollout.node_updating";
/// A node runs the release, confirmed, and stayed ready for the rollout's `minReadyS`.
pub const ROLLOUT_NODE_UPDATED: &str = "rollout.node_updated";
/// A node did not get there (the reason: its command's, or the deadline's).
pub const ROLLOUT_NODE_FAILED: &str = "rollout.node_failed";
/// After `abort`: an updated node was sent `agent.rollback`, and how that ended.
pub const ROLLOUT_NODE_ROLLING_BACK: &str = "rollout.node_rolling_back";
pub const ROLLOUT_NODE_ROLLED_BACK: &str = "rollout.node_rolled_back";
pub const ROLLOUT_NODE_ROLLBACK_FAILED: &str = "rollout.node_rollback_failed";
/// Every node of a wave finished, within the wave's failure limit.
pub const ROLLOUT_WAVE_PASSED: &str = "rollout.wave_passed";
/// Paused by an operator or by a wave's gate (with the reason); resumed by an operator.
pub const ROLLOUT_PAUSED: &str = "rollout.paused";
pub const ROLLOUT_RESUMED: &str = "rollout.resumed";
/// `abort` asked: the updated nodes are rolled back, then `rollout.aborted`.
pub const ROLLOUT_ABORTING: &str = "rollout.aborting";
pub const ROLLOUT_ABORTED: &str = "rollout.aborted";
/// Every wave passed.
pub const ROLLOUT_COMPLETED: &str = "rollout.completed";
/// The event types a node may originate through its journal; nothing else is appended from one.
pub const NODE_ORIGINATED_TYPES: &[&str] = &[
    COMMAND_STARTED,
    COMMAND_SUCCEEDED,
    COMMAND_FAILED,
    NODE_OBSERVED,
    NODE_AGENT_STARTED,
    NODE_INVENTORY_REPORTED,
    GPU_HELD,
    GPU_HOLD_FAILED,
    GPU_RELEASED,
    INSTANCE_OBSERVED,
    INSTANCE_APPLY_FAILED,
];

/// Every event type this version writes.
pub const EVENT_TYPES: &[&str] = &[
    TENANT_CREATED,
    API_KEY_CREATED,
    API_KEY_REVOKED,
    POOL_CREATED,
    POOL_UPDATED,
    POOL_ARCHIVED,
    NODE_REGISTERED,
    NODE_CORDONED,
    NODE_UNCORDONED,
    NODE_DRAINING,
    NODE_LABELED,
    NODE_TAINTED,
    NODE_ALLOCATED,
    NODE_FREED,
    NODE_DELETED,
    RESERVATION_REQUESTED,
    RESERVATION_ACTIVATED,
    RESERVATION_EXTENDED,
    RESERVATION_RELEASED,
    RESERVATION_EXPIRED,
    RESERVATION_CANCELLED,
    QUOTA_SET,
    QUOTA_EXCEEDED,
    QUOTA_CHARGED,
    WEBHOOK_CREATED,
    WEBHOOK_UPDATED,
    WEBHOOK_SECRET_ROTATED,
    WEBHOOK_PINGED,
    WEBHOOK_DELETED,
    FLAVOR_CREATED,
    FLAVOR_DELETED,
    IMAGE_REGISTERED,
    IMAGE_DELETED,
    JOIN_TOKEN_CREATED,
    JOIN_TOKEN_USED,
    JOIN_TOKEN_REVOKED,
    NODE_JOINED,
    NODE_READY,
    NODE_UNREACHABLE,
    COMMAND_ISSUED,
    COMMAND_CANCELLED,
    COMMAND_STARTED,
    COMMAND_SUCCEEDED,
    COMMAND_FAILED,
    NODE_OBSERVED,
    NODE_AGENT_STARTED,
    NODE_INVENTORY_REPORTED,
    GPU_HELD,
    GPU_HOLD_FAILED,
    GPU_RELEASED,
    RESERVATION_REQUEUED,
    RESERVATION_FAILED,
    INSTANCE_CREATED,
    INSTANCE_START_REQUESTED,
    INSTANCE_STOP_REQUESTED,
    INSTANCE_RESIZE_REQUESTED,
    INSTANCE_DELETE_REQUESTED,
    INSTANCE_REAPPLIED,
    INSTANCE_FAILED,
    INSTANCE_DELETED,
    INSTANCE_OBSERVED,
    INSTANCE_APPLY_FAILED,
    RESERVATION_INSTANCE_ATTACHED,
    RESERVATION_INSTANCE_DETACHED,
    METAL_ENROLLED,
    METAL_TRANSITIONED,
    METAL_STEP_DONE,
    METAL_STEP_RETRIED,
    METAL_WORKFLOW_FINISHED,
    METAL_WORKFLOW_PAUSED,
    METAL_WORKFLOW_RESUMED,
    RELEASE_REGISTERED,
    ROLLOUT_CREATED,
    ROLLOUT_NODE_UPDATING,
    ROLLOUT_NODE_UPDATED,
    ROLLOUT_NODE_FAILED,
    ROLLOUT_NODE_ROLLING_BACK,
    ROLLOUT_NODE_ROLLED_BACK,
    ROLLOUT_NODE_ROLLBACK_FAILED,
    ROLLOUT_WAVE_PASSED,
    ROLLOUT_PAUSED,
    ROLLOUT_RESUMED,
    ROLLOUT_ABORTING,
    ROLLOUT_ABORTED,
    ROLLOUT_COMPLETED,
    METAL_MAINTENANCE_SET,
    METAL_POWER_DRIFTED,
    bc_core::audit::CHECKPOINT_SEALED,
    bc_core::audit::CHECKPOINT_COSIGNED,
    bc_core::audit::LOG_KEY_ROTATED,
];

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantCreated {
    pub name: String,
    pub root: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeyCreated {
    pub name: String,
    pub actions: Vec<String>,
    /// Hex SHA-256 of the secret part of the token: only in keys created before the hash moved
    /// to the secret store ([`crate::api_key_secret_id`]); new events leave it out, so neither
    /// the log nor what is delivered from it carries it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeyRevoked {}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolCreated {
    pub name: String,
    pub description: String,
    pub labels: BTreeMap<String, String>,
    /// The longest reservation the pool grants, in seconds (absent: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_reservation_s: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolUpdated {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_reservation_s: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolArchived {}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeRegistered {
    pub pool_id: String,
    pub name: String,
    pub gpus: Vec<Gpu>,
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpu {
    /// `H100`, `A100`, …
    pub model: String,
    /// `H100-SXM5-80GB`, …
    pub product: String,
    #[serde(rename = "vramGiB")]
    pub vram_gib: u32,
    /// GPUs with the same domain on one node share NVLink.
    pub nvlink_domain: u32,
}

/// A join token: who may join, into which pool, until when, how often. The secret's hash is
/// not here: it lives in the secret store, so the log and its receivers never carry it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenCreated {
    pub pool_id: String,
    pub description: String,
    pub expires_at_ms: u64,
    pub uses_max: u32,
    /// The one node a machine may join as with it (a bare-metal deploy's token: the installed
    /// system joins as the enrolled machine's node, `bcd join --node-id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

/// A join spent one use of the token (in the same append as `node.joined`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenUsed {
    pub node_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenRevoked {}

/// A machine joined with a join token: its public key (base64), what it claims about its
/// hardware, and the token spent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeJoined {
    pub pool_id: String,
    pub name: String,
    pub gpus: Vec<Gpu>,
    pub labels: BTreeMap<String, String>,
    pub public_key: String,
    pub join_token_id: String,
    pub agent_version: String,
    pub hostname: String,
    /// The GPUs' UUIDs in `gpus`' order, as the node's inventory gives them (absent in joins
    /// recorded before holds existed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
}

/// `node.ready`: the node's lease is held again. `node.unreachable`: it lapsed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeLiveness {
    /// When the lease lapses (ready) or lapsed (unreachable).
    pub lease_expires_at_ms: u64,
}

/// A command to one node, delivered over its session in issue order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandIssued {
    pub node_id: String,
    pub kind: String,
    /// A JSON object.
    pub args: serde_json::Value,
    pub deadline_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandCancelled {
    pub node_id: String,
    pub reason: String,
}

/// `command.started`, `.succeeded`, `.failed`. From the node's journal they carry the entry
/// (`journal`); a command that passed its deadline undelivered is failed by the control plane,
/// without one.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandProgress {
    pub command_id: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

/// What a node observed of itself (from `/proc`), journaled every `observe_interval`; on the
/// stream `agent/node_…`, so it never moves the node's version.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeObserved {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uptime_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_avg1_milli: Option<u64>,
    #[serde(default, rename = "memAvailableKiB", skip_serializing_if = "Option::is_none")]
    pub mem_available_kib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

/// A node's agent started: its version and slot ([`NODE_AGENT_STARTED`]), on `agent/node_…`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeAgentStarted {
    pub node_id: String,
    pub version: String,
    /// `a` or `b` for an agent run from its update slots; empty otherwise.
    #[serde(default)]
    pub slot: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

/// What a node's agent found on its machine (NVML and `/proc`, `/sys`), at its first session
/// and whenever it changes; on `agent/node_…`. The node's GPUs are taken from it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeInventoryReported {
    pub node_id: String,
    pub gpus: Vec<InventoryGpu>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_version: Option<String>,
    /// Why no GPUs could be read (no driver, no library).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    pub host: InventoryHost,
    /// What the agent can do with the machine (`command.ping`, `gpu.hold`, …).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    /// Why the agent cannot hold GPUs (`node-unprivileged: …`); absent when it can.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_unavailable: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct InventoryGpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub product: String,
    #[serde(rename = "vramGiB")]
    pub vram_gib: u32,
    pub pci_bus_id: String,
    pub nvlink_domain: u32,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct InventoryHost {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    pub cpus: u32,
    #[serde(rename = "memoryKiB")]
    pub memory_kib: u64,
    pub disks: Vec<InventoryDisk>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[derive(schemars::JsonSchema)]
pub struct InventoryDisk {
    pub name: String,
    pub bytes: u64,
    pub rotational: bool,
}

/// `node.cordoned`, `node.uncordoned`, `node.draining`: no payload.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeStateChanged {}

/// `node.deleted`: the node is gone for good (its document with it); why, as the operator said.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeDeleted {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `node.labeled` and `node.tainted`: keys to set and keys to remove.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeKeysChanged {
    pub set: BTreeMap<String, String>,
    pub remove: Vec<String>,
}

/// GPUs of a node given to a reservation (in the same append as `reservation.activated`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeAllocated {
    pub reservation_id: String,
    /// Indexes into the node's `gpus`.
    pub gpus: Vec<u32>,
}

/// A reservation's GPUs given back (with `reservation.released` or `.expired`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeFreed {
    pub reservation_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationRequested {
    pub pool_id: String,
    pub gpus: u32,
    pub duration_s: u64,
    /// The selector as written (checked when requested); empty: any GPU.
    pub selector: String,
    pub nvlink: bool,
    pub tolerations: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationActivated {
    pub node_id: String,
    pub gpus: Vec<u32>,
    pub ends_at_ms: u64,
    /// On a node with an agent: the `gpu.hold` command issued in the same append; the binding
    /// is `pending` until the node answers (absent: a node registered by hand, bound at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldIssued>,
}

/// The `gpu.hold` (or `gpu.release`) command an append issued for a reservation.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HoldIssued {
    pub command_id: String,
    /// The command's deadline: a hold not answered by then counts as failed.
    pub deadline_at_ms: u64,
}

/// `reservation.requeued`: the hold on `node_id` failed (or was not answered by its deadline);
/// the GPUs are freed in the same append and the reservation waits at the head of its queue.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationRequeued {
    pub node_id: String,
    pub reason: String,
    /// Holds failed so far, this one included.
    pub attempts: u32,
    /// `gpu.release` to the node, when the hold was not answered (it may yet hold them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<HoldIssued>,
}

/// `reservation.failed`: ended after its last allowed hold failed; the same fields as
/// `reservation.requeued`.
pub type ReservationFailed = ReservationRequeued;

/// `gpu.held`, `gpu.hold_failed`, `gpu.released`: a node's answer to its `gpu.hold` or
/// `gpu.release` command, from its journal, on the stream of the reservation the command names.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuReport {
    pub command_id: String,
    pub node_id: String,
    pub reservation_id: String,
    /// The GPUs' UUIDs.
    pub gpus: Vec<String>,
    /// Why a hold failed: a stable code, a colon, and words (`node-unprivileged: …`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationExtended {
    pub ends_at_ms: u64,
}

/// `reservation.released`, `.expired`, `.cancelled`: no payload, but for the `gpu.release`
/// issued in the same append to a node that may hold the GPUs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationEnded {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<HoldIssued>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaSet {
    /// GPUs the tenant's live (queued and active) reservations in the pool may hold at once.
    pub gpus: u32,
}

/// `quota.charged`: the reservation and the GPUs it counts for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaCharged {
    pub reservation_id: String,
    pub gpus: u32,
}

/// The audit record of a refusal: nothing else is appended.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaExceeded {
    pub requested: u32,
    pub in_use: u32,
    pub limit: u32,
    pub actor: String,
}

/// A webhook subscription. Its signing secret is not here: secrets never enter the log.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookCreated {
    pub url: String,
    pub event_types: Vec<String>,
    pub description: String,
    pub secret_version: u32,
    /// Where the signing secret is kept in the secret store (an id, not the secret).
    pub secret_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookUpdated {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_types: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// A new signing secret; the previous one is still signed with until `previousValidUntilMs`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookSecretRotated {
    pub secret_version: u32,
    pub secret_id: String,
    pub previous_valid_until_ms: u64,
}

/// A test delivery: it goes to this webhook only, whatever its event types.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookPinged {}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookDeleted {}

/// A flavor of one pool: what an instance of it is given. Guarded on the pool's version, so a
/// flavor is never created in a pool archived meanwhile.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorCreated {
    pub pool_id: String,
    pub name: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    pub gpus: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorDeleted {}

/// How an image's bytes are laid out on disk.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    Qcow2,
    Raw,
    /// A bootable ISO 9660 image: what a bare-metal deploy or rescue boots through a BMC's
    /// virtual CD; never an instance's disk.
    Iso,
}

/// A disk image, by where it is fetched from and the SHA-256 its bytes must have.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageRegistered {
    pub name: String,
    pub url: String,
    /// Lowercase hex SHA-256 of the image's bytes.
    pub sha256: String,
    pub disk_format: DiskFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageDeleted {}

/// What an instance should be: `running`, `stopped`, or `deleted` (gone from its node).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DesiredState {
    Running,
    Stopped,
    Deleted,
}

impl DesiredState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Deleted => "deleted",
        }
    }
}

/// A domain's state as the node's hypervisor reports it; `absent`: no such domain.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ObservedState {
    Running,
    Paused,
    Stopping,
    Stopped,
    Crashed,
    Other,
    Absent,
}

impl ObservedState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Crashed => "crashed",
            Self::Other => "other",
            Self::Absent => "absent",
        }
    }

    /// Whether a domain in this state is what `desired` asks for.
    pub fn satisfies(self, desired: DesiredState) -> bool {
        matches!(
            (self, desired),
            (Self::Running, DesiredState::Running)
                | (Self::Stopped, DesiredState::Stopped)
                | (Self::Absent, DesiredState::Deleted)
        )
    }
}

/// The image an instance boots from, copied from its registration when the instance is made
/// (the node fetches it by URL and checks the digest).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceImage {
    pub image_id: String,
    pub url: String,
    pub sha256: String,
    pub disk_format: DiskFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

/// What an instance is given: its flavor's shape when it was made or last resized.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceShape {
    pub flavor_id: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
}

/// `instance.created`: on the node of `reservation_id` (active and bound), with its GPUs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceCreated {
    pub name: String,
    pub pool_id: String,
    pub node_id: String,
    pub reservation_id: String,
    pub shape: InstanceShape,
    /// The reservation's GPUs' UUIDs, passed through whole.
    pub gpus: Vec<String>,
    pub image: InstanceImage,
    pub desired: DesiredState,
    pub generation: u64,
    /// The `instance.apply` issued in the same append.
    pub apply: HoldIssued,
}

/// `instance.start_requested`, `.stop_requested`, `.resize_requested` (with `shape`),
/// `.delete_requested` (by a caller, or by the reconciler when the reservation ended: `reason`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceRequested {
    pub desired: DesiredState,
    pub generation: u64,
    pub apply: HoldIssued,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<InstanceShape>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `instance.reapplied`: `instance.apply` sent again for the same generation, and why
/// (`drift: …`, `apply-timeout: …`, or the node's last failure); `attempts` so far, this one
/// included.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceReapplied {
    pub apply: HoldIssued,
    pub reason: String,
    pub attempts: u32,
}

/// `instance.failed`: no more applies; the last reason and the attempts made.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceFailed {
    pub reason: String,
    pub attempts: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceDeleted {}

/// `instance.observed` and `instance.apply_failed`, from the node's journal, on the instance's
/// stream. With `command_id`, the answer to that `instance.apply` (and it finishes it).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceReport {
    pub instance_id: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// The generation the node applied (or failed to).
    pub generation: u64,
    /// `instance.observed` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ObservedState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// `instance.apply_failed` only: a stable code, a colon, and words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

/// `reservation.instance_attached` / `.instance_detached`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationInstance {
    pub instance_id: String,
}

/// Most patterns one filter (a watch, a webhook) takes.
pub const TYPE_PATTERNS_MAX: usize = 20;

/// Event type patterns: a type (`pool.created`), a prefix (`pool.*`) or `*`. Empty: every type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TypeFilter {
    patterns: Vec<String>,
}

impl TypeFilter {
    /// Parses and checks patterns against the event catalogue: a pattern that matches no known
    /// type is a mistake, not an empty stream.
    pub fn parse(patterns: &[String]) -> bc_core::Result<Self> {
        use bc_core::Error;
        if patterns.len() > TYPE_PATTERNS_MAX {
            return Err(Error::invalid(format!("at most {TYPE_PATTERNS_MAX} type patterns, not {}", patterns.len())));
        }
        for p in patterns {
            let well_formed = p == "*"
                || (!p.is_empty()
                    && p.len() <= 100
                    && p.trim_end_matches(".*").split('.').all(|part| {
                        !part.is_empty() && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                    }));
            if !well_formed {
                return Err(Error::InvalidArgument {
                    message: format!("malformed type pattern {:?}", bc_core::id::truncate(p, 60)),
                    hint: Some("a pattern is a type (pool.created), a prefix (pool.*) or *".into()),
                });
            }
            if !EVENT_TYPES.iter().any(|t| pattern_matches(p, t)) {
                return Err(Error::InvalidArgument {
                    message: format!("unknown type pattern {:?}: it matches no event type", bc_core::id::truncate(p, 60)),
                    hint: Some(format!("event types: {}", EVENT_TYPES.join(", "))),
                });
            }
        }
        Ok(Self { patterns: patterns.to_vec() })
    }

    pub fn matches(&self, event_type: &str) -> bool {
        self.patterns.is_empty() || self.patterns.iter().any(|p| pattern_matches(p, event_type))
    }
}

fn pattern_matches(pattern: &str, event_type: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some("") => true,
        Some(prefix) => event_type.starts_with(prefix),
        None => pattern == event_type,
    }
}

/// A payload as CBOR, ready for an append.
pub fn to_cbor<T: Serialize>(payload: &T) -> bc_core::Result<ciborium::Value> {
    let json = serde_json::to_value(payload).map_err(|e| bc_core::Error::Internal(format!("payload: {e}")))?;
    bc_core::canonical::from_json(&json)
}

/// Every pattern [`TypeFilter::parse`] accepts: `*`, each type, and each prefix (`pool.*`) of
/// some type. The OpenAPI document lists them.
pub fn type_patterns() -> Vec<String> {
    let mut patterns = vec!["*".to_owned()];
    for event_type in EVENT_TYPES {
        let mut prefix = String::new();
        for part in event_type.split('.') {
            let pattern = format!("{prefix}{part}.*");
            if !patterns.contains(&pattern) && EVENT_TYPES.iter().any(|t| t.starts_with(&pattern[..pattern.len() - 1])) {
                patterns.push(pattern);
            }
            prefix.push_str(part);
            prefix.push('.');
        }
        patterns.push((*event_type).to_owned());
    }
    patterns
}

/// How a BMC's certificate is checked, as enrolled. The CA bundle and the pin are public.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalBmc {
    /// `https://host[:port]`.
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_path: Option<String>,
    pub username: String,
    /// `ca`, `pin` or `insecure`.
    pub tls: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin: Option<String>,
    /// Where the password is sealed in the secret store.
    pub secret_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalEnrolled {
    pub pool_id: String,
    pub name: String,
    pub bmc: MetalBmc,
}

/// A workflow started by a transition: its id, its steps in order, and what they need.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalWorkflowStart {
    pub workflow_id: String,
    /// The verb it runs (`deploy`, `power`, …).
    pub verb: String,
    pub steps: Vec<String>,
    /// When it fails if not finished: the state's deadline (or the power change's).
    pub deadline_at_ms: u64,
    /// The image a deploy or a rescue boots (its URL, from the catalog).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_url: Option<String>,
    /// A deploy's join token, bound to the node, that the installed system joins with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_token_id: Option<String>,
    /// `on`, `off` or `reboot`: a power workflow's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalTransitioned {
    pub verb: String,
    pub from: String,
    pub to: String,
    /// Why (a failure's reason: the machine's `lastError`; an operator's note).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The workflow the new state runs, when it runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<MetalWorkflowStart>,
}

/// What a machine's BMC said at inspection.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalInspection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manufacturer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processor_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_gib: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalStepDone {
    pub workflow_id: String,
    pub step: String,
    pub index: u32,
    /// The power state the BMC said at this step (`on`/`off`), when it read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inspection: Option<MetalInspection>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalStepRetried {
    pub workflow_id: String,
    pub step: String,
    pub index: u32,
    /// Failed attempts of this step so far.
    pub attempts: u32,
    /// The BMC error's kind (`unauthorized`, `timeout`, `unreachable`, `refused`, `protocol`).
    pub error_kind: String,
    pub error: String,
    pub retry_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalWorkflowFinished {
    pub workflow_id: String,
    /// `succeeded`, `failed` or `aborted`.
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalWorkflowRef {
    pub workflow_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalMaintenanceSet {
    pub reason: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalPowerDrifted {
    /// What the log said (`on`/`off`), and what the BMC says now.
    pub expected: String,
    pub observed: String,
}
