//! Join requests (`join_request/jreq_…`, in the root tenant): a machine with no join token asks
//! to join (`bcd join --request`), and an operator approves or rejects it
//! (`joinRequests.approve`, `.reject`). The document, the payloads of `join_request.*`, and their
//! fold; the decisions are in [`crate::decide::join_request`].
//!
//! A request's id is derived from the machine's public key ([`join_request_id_of`]), so a
//! machine that asks again finds its own request, and two asks of one machine racing make one
//! request (the second append finds the stream made). A pending request also has a live row
//! (`join_request_pending`), removed once it is decided: the gateway counts those to bound how
//! many requests wait, since anyone may ask.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::id::JoinRequestId;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::node::Gpu;
use crate::{corrupt, create_once, from_doc, payload, to_doc};

pub const JOIN_REQUEST_CREATED: &str = "join_request.created";
pub const JOIN_REQUEST_APPROVED: &str = "join_request.approved";
pub const JOIN_REQUEST_REJECTED: &str = "join_request.rejected";

/// A join request's document.
pub const KIND_JOIN_REQUEST: &str = "join_request";
/// The same document while the request is pending; none once it is decided.
pub const KIND_JOIN_REQUEST_PENDING: &str = "join_request_pending";

/// The request of the machine holding the Ed25519 key `public_key` (its 32 bytes): the first
/// 128 bits of SHA-256 over a domain tag and the key, as a ULID.
pub fn join_request_id_of(public_key: &[u8]) -> JoinRequestId {
    let digest = Sha256::new().chain_update(b"better-compute/join-request-id/v1\n").chain_update(public_key).finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    JoinRequestId::from_ulid(ulid::Ulid::from_bytes(bytes))
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum JoinRequestState {
    Pending,
    Approved,
    Rejected,
}

impl JoinRequestState {
    pub const ALL: [Self; 3] = [Self::Pending, Self::Approved, Self::Rejected];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Approved => "approved",
            Self::Rejected => "rejected",
        }
    }
}

/// A join request: what the machine said of itself, and what an operator decided.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct JoinRequestDoc {
    pub join_request_id: String,
    pub state: JoinRequestState,
    /// Standard base64 of the machine's Ed25519 public key.
    pub public_key: String,
    pub hostname: String,
    pub agent_version: String,
    pub gpus: Vec<Gpu>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
    /// Approved: the tenant, pool and node the machine joins as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// Rejected: why, as the machine is told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who decided (the API key's actor) and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    #[serde(default)]
    pub decided_at_ms: u64,
    pub version: u64,
    pub created_at_ms: u64,
}

/// `join_request.created`: a machine asked to join (actor `join_request:jreq_…`, unauthenticated:
/// the machine signed the ask with its key).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequestCreated {
    pub public_key: String,
    pub hostname: String,
    pub agent_version: String,
    pub gpus: Vec<Gpu>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
}

/// `join_request.approved`: the machine joins `tenantId`'s pool `poolId` as `nodeId` (drawn
/// here, so its admission is the node stream's first append, made once).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequestApproved {
    pub tenant_id: String,
    pub pool_id: String,
    pub node_id: String,
}

/// `join_request.rejected`: the machine's wait ends with `reason`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequestRejected {
    pub reason: String,
}

/// Folds one `join_request.*` event into the row `key` (the document, or the pending row).
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let doc = match env.event_type.as_str() {
        JOIN_REQUEST_CREATED => {
            let made =
                create_once(key, &current, event, ("join request", "created"), |p: JoinRequestCreated, env| JoinRequestDoc {
                    join_request_id: key.id.clone(),
                    state: JoinRequestState::Pending,
                    public_key: p.public_key,
                    hostname: p.hostname,
                    agent_version: p.agent_version,
                    gpus: p.gpus,
                    gpu_uuids: p.gpu_uuids,
                    tenant_id: None,
                    pool_id: None,
                    node_id: None,
                    reason: None,
                    decided_by: None,
                    decided_at_ms: 0,
                    version: env.version,
                    created_at_ms: env.at_ms,
                })?;
            return Ok(made);
        }
        JOIN_REQUEST_APPROVED | JOIN_REQUEST_REJECTED => {
            let mut doc: JoinRequestDoc = from_doc(event, current)?;
            if doc.state != JoinRequestState::Pending {
                return Err(corrupt(event, format!("join request {} was decided already", key.id)));
            }
            if env.event_type == JOIN_REQUEST_APPROVED {
                let p: JoinRequestApproved = payload(event)?;
                doc.state = JoinRequestState::Approved;
                doc.tenant_id = Some(p.tenant_id);
                doc.pool_id = Some(p.pool_id);
                doc.node_id = Some(p.node_id);
            } else {
                let p: JoinRequestRejected = payload(event)?;
                doc.state = JoinRequestState::Rejected;
                doc.reason = Some(p.reason);
            }
            doc.decided_by = Some(env.actor.clone());
            doc.decided_at_ms = env.at_ms;
            doc.version = env.version;
            doc
        }
        _ => return Ok(current),
    };
    if key.kind == KIND_JOIN_REQUEST_PENDING { Ok(None) } else { to_doc(&doc) }
}
