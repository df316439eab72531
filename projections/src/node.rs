//! Nodes (`node/node_…`) and what their agents report (`agent/node_…`): the document, its state,
//! the payloads of `node.*`, and their fold.
//!
//! A node is registered by hand (no agent) or joins with `bcd`. Its `state` is derived, never
//! set: `unreachable` while its agent's lease is lapsed, else what the operator's marks say
//! (`cordoned`, `draining`). A GPU is allocated to one reservation at a time; the fold refuses a
//! double allocation rather than write it. The agent's own reports are on `agent/…`, so they
//! never move the node's version; each is an entry of the node's journal and advances the
//! journal head by exactly one. An inventory changes the node's GPUs only while none is
//! allocated; otherwise it is taken when the last one is freed.

use std::collections::BTreeMap;

use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use bc_core::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::inventory::{self, NODE_INVENTORY_REPORTED, NodeInventoryReported};
use crate::{NoFields, corrupt, from_doc, payload, state_from_str, to_doc};

pub const NODE_REGISTERED: &str = "node.registered";
pub const NODE_CORDONED: &str = "node.cordoned";
pub const NODE_UNCORDONED: &str = "node.uncordoned";
pub const NODE_DRAINING: &str = "node.draining";
pub const NODE_LABELED: &str = "node.labeled";
pub const NODE_TAINTED: &str = "node.tainted";
pub const NODE_ALLOCATED: &str = "node.allocated";
pub const NODE_FREED: &str = "node.freed";
pub const NODE_DELETED: &str = "node.deleted";
pub const NODE_JOINED: &str = "node.joined";
pub const NODE_READY: &str = "node.ready";
pub const NODE_UNREACHABLE: &str = "node.unreachable";
pub const NODE_OBSERVED: &str = "node.observed";
/// Every start of `bcd node` ([`NodeAgentStarted`]): the agent's version and slot, on
/// `agent/node_…`. The node's document takes its version from here; a rollout's gate reads it.
pub const NODE_AGENT_STARTED: &str = "node.agent_started";
/// A node certificate issued by the deployment's node CA ([`NodeCertificateIssued`]), at join or
/// renewed on the node's session; on `node/node_…`.
pub const NODE_CERTIFICATE_ISSUED: &str = "node.certificate_issued";
/// `nodes.revoke` ([`NodeRevoked`]): the node's certificates are refused and its sessions end.
pub const NODE_REVOKED: &str = "node.revoked";

/// A node's document; also its stream's prefix (`node/node_…`).
pub const KIND_NODE: &str = "node";
/// The stream of what a node's agent reports of itself (`agent/node_…`): its events touch the
/// node's document without moving the node's version.
pub const KIND_AGENT: &str = "agent";

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
    /// The serial (hex) and end of the node's newest certificate (`node.certificate_issued`);
    /// empty and 0: none issued (a node that joined before the node CA).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub certificate_serial: String,
    #[serde(default)]
    pub certificate_not_after_ms: u64,
    /// When the node was revoked (`node.revoked`); 0: not revoked.
    #[serde(default)]
    pub revoked_at_ms: u64,
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

impl NodeAgent {
    /// The agent of a machine that just joined: unreachable until its first session, with no
    /// journal, observation, inventory or start recorded yet.
    pub fn joined(public_key: String, agent_version: String, hostname: String, join_token_id: String, joined_at_ms: u64) -> Self {
        NodeAgent {
            public_key,
            agent_version,
            hostname,
            join_token_id,
            joined_at_ms,
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
            certificate_serial: String::new(),
            certificate_not_after_ms: 0,
            revoked_at_ms: 0,
        }
    }
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

impl std::str::FromStr for NodeState {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        state_from_str("node", text, Self::ALL, Self::as_str)
    }
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub(crate) fn node_state(cordoned: bool, draining: bool) -> NodeState {
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
    /// What the machine's TPM proved, for a join with no token (`bcd join --attestor tpm`);
    /// absent for every other join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<TpmEvidence>,
}

/// The evidence a TPM join was admitted on (docs/admission.md), kept so that an auditor can
/// check later, offline, which TPM joined and what it had measured: the EK certificate chain
/// against the EK CA bundle, the quote's signature under the AK, its qualifying data, and the
/// PCR values against the quote's digest. Binary fields are standard base64.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TpmEvidence {
    /// `sha256/` of the EK certificate's SubjectPublicKeyInfo (DER): the machine's name, from
    /// which its node id is derived.
    pub ek_pin: String,
    /// The EK certificate, then the intermediates the machine sent (DER).
    pub ek_certificates: Vec<String>,
    /// The attestation key's `TPMT_PUBLIC`, bound to the EK by credential activation.
    pub ak_public: String,
    /// The quote's `TPMS_ATTEST` and its `TPMT_SIGNATURE` by the AK.
    pub quote: String,
    pub quote_signature: String,
    /// The quote's qualifying data: SHA-256 of the gateway's nonce and the node's key.
    pub qualifying_data: String,
    /// The SHA-256 bank's PCRs quoted, and their values (hex) in the same order.
    pub pcrs: Vec<u32>,
    pub pcr_values: Vec<String>,
}

/// `node.ready`: the node's lease is held again. `node.unreachable`: it lapsed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeLiveness {
    /// When the lease lapses (ready) or lapsed (unreachable).
    pub lease_expires_at_ms: u64,
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

/// `node.cordoned`, `node.uncordoned`, `node.draining`: no payload.
pub type NodeStateChanged = NoFields;

/// `node.deleted`: the node is gone for good (its document with it); why, as the operator said.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeDeleted {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `node.certificate_issued`: a certificate for the node's own key, by the node CA: its serial
/// (hex) and validity; `renewal`: on the node's session, not at its join.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeCertificateIssued {
    pub serial: String,
    pub not_before_ms: u64,
    pub not_after_ms: u64,
    #[serde(default)]
    pub renewal: bool,
}

/// `node.revoked`: why, as the operator said.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeRevoked {
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

/// Folds one `node.*` event into the row `key`: the node's own events (on `node/…`) and the
/// reports of its agent (on `agent/…`, which advance its journal head without moving its
/// version); any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let tenant_id = env.tenant.to_string();
    match env.event_type.as_str() {
        NODE_REGISTERED => registered(key, event, tenant_id),
        NODE_JOINED => joined(key, event, tenant_id),
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
        NODE_INVENTORY_REPORTED => inventory_reported(key, current, event, tenant_id),
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
        NODE_CERTIFICATE_ISSUED | NODE_REVOKED => {
            let mut doc: NodeDoc = from_doc(event, current)?;
            let node = doc.node_id.clone();
            let agent = doc.agent.as_mut().ok_or_else(|| corrupt(event, format!("node {node} has no agent")))?;
            if env.event_type == NODE_REVOKED {
                let _: NodeRevoked = payload(event)?;
                agent.revoked_at_ms = env.at_ms;
            } else {
                let p: NodeCertificateIssued = payload(event)?;
                agent.certificate_serial = p.serial;
                agent.certificate_not_after_ms = p.not_after_ms;
            }
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
            to_doc(&doc)
        }
        NODE_CORDONED
        | NODE_UNCORDONED
        | NODE_DRAINING
        | NODE_LABELED
        | NODE_TAINTED
        | NODE_ALLOCATED
        | NODE_FREED
        | crate::decide::ssh_cert::NODE_SSH_CERT_ISSUED
        | crate::decide::sandbox_volume::NODE_VOLUMES_PROMISED => marked(current, event),
        _ => Ok(current),
    }
}

/// Whether `event` is on the stream of the node whose row is `key` (`node/ID`, not its
/// agent's `agent/ID`).
pub(crate) fn on_own_stream(key: &RowKey, event: &StoredEvent) -> bool {
    event.envelope.stream.strip_prefix(KIND_NODE).and_then(|rest| rest.strip_prefix('/')).is_some_and(|id| id == key.id)
}

/// An event of another aggregate on the node's own stream (`tunnel.opened`, `.closed`,
/// `.refused`: a session through the node's agent, whose record is the event itself). The
/// node's document shows nothing new, but its `version` is its stream's: placement, liveness,
/// rollouts, deletes and volumes append guarded on the version they read, and a version left
/// behind its stream would refuse every one of them `CONFLICT`, for ever.
pub(crate) fn apply_foreign(current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    if current.is_none() {
        return Ok(None);
    }
    let mut doc: NodeDoc = from_doc(event, current)?;
    doc.version = event.envelope.version;
    to_doc(&doc)
}

fn registered(key: &RowKey, event: &StoredEvent, tenant_id: String) -> Result<Option<Value>> {
    let env = &event.envelope;
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

fn joined(key: &RowKey, event: &StoredEvent, tenant_id: String) -> Result<Option<Value>> {
    let env = &event.envelope;
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
        agent: Some(NodeAgent::joined(p.public_key, p.agent_version, p.hostname, p.join_token_id, env.at_ms)),
        version: env.version,
        created_at_ms: env.at_ms,
        updated_at_ms: env.at_ms,
    };
    doc.refresh_state();
    to_doc(&doc)
}

/// `node.inventory_reported`: the report's own row (what `inventory.history` pages), or the
/// node's GPUs (taken at once when none is allocated, else when they are freed).
fn inventory_reported(key: &RowKey, current: Option<Value>, event: &StoredEvent, tenant_id: String) -> Result<Option<Value>> {
    let env = &event.envelope;
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

/// An operator's mark (cordon, drain, labels, taints) or a reservation's GPUs given or freed.
fn marked(current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let mut doc: NodeDoc = from_doc(event, current)?;
    doc.normalize();
    match env.event_type.as_str() {
        NODE_CORDONED => doc.cordoned = true,
        NODE_UNCORDONED => (doc.cordoned, doc.draining) = (false, false),
        NODE_DRAINING => (doc.cordoned, doc.draining) = (true, true),
        NODE_LABELED => apply_keys(&mut doc.labels, payload(event)?),
        NODE_TAINTED => apply_keys(&mut doc.taints, payload(event)?),
        // A certificate changes nothing the node's document shows; the event moves its version.
        crate::decide::ssh_cert::NODE_SSH_CERT_ISSUED => {
            let _: crate::decide::ssh_cert::NodeSshCertIssued = payload(event)?;
        }
        // Its disk promised to a volume: the event moves its version (a guard for the next).
        crate::decide::sandbox_volume::NODE_VOLUMES_PROMISED => {
            let _: crate::decide::sandbox_volume::NodeVolumesPromised = payload(event)?;
        }
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

/// Moves a node's journal head to the entry an event carries: the next one, always.
pub(crate) fn advance_journal(doc: &mut NodeDoc, journal: &bc_core::agent::JournalOrigin, event: &StoredEvent) -> Result<()> {
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

/// The rows an event on the agent's stream changes: the node's, and an inventory's own row.
pub(crate) fn touches_agent(event: &StoredEvent, id: &str, out: &mut Vec<RowKey>) {
    out.push(RowKey { tenant: event.envelope.tenant.to_string(), kind: KIND_NODE.to_owned(), id: id.to_owned() });
    if event.envelope.event_type == NODE_INVENTORY_REPORTED {
        // And the report's own row, which `inventory.history` pages.
        out.push(RowKey {
            tenant: event.envelope.tenant.to_string(),
            kind: inventory::KIND_INVENTORY.to_owned(),
            id: inventory::inventory_row_id(id, event.envelope.seq),
        });
    }
}
