//! `RequestJoin`: a machine with no join token asks to join (`bcd join --request`). Its first
//! ask makes a join request (`join_request.created` in the root tenant, named after its key);
//! while the request is pending each ask is answered `pending` and appends nothing; once an
//! operator approved it (`joinRequests.approve`), the next ask admits the machine exactly as a
//! token join would (`node.joined` with its node certificate, at the node id the approval
//! drew); once rejected, the ask is answered with the reason.
//!
//! Anyone may ask: the ask is signed by the key it names (so no one asks for another's key),
//! and at most [`JOIN_REQUESTS_PENDING_MAX`] requests wait at once, so asking cannot fill the
//! log. The decisions are `bc_projections::decide::join_request`.

use bc_core::agent::{b64, node_public_key};
use bc_core::id::{JoinRequestId, NodeId, PoolId, TenantId};
use bc_core::store::{AppendRequest, ExpectedVersion};
use bc_core::{Error, Result};
use bc_projections::decide::join_request::{JOIN_REQUESTS_PENDING_MAX, JoinRequestAnswer, join_request_ask};
use bc_projections::events as ev;
use bc_projections::join_request::join_request_id_of;
use bc_projections::{
    JoinRequestDoc, KIND_JOIN_REQUEST, KIND_JOIN_REQUEST_PENDING, KIND_NODE, KIND_POOL, NodeDoc, PoolDoc, stream_of,
};
use ed25519_dalek::Verifier;

use super::join::{
    AGENT_VERSION_BYTES_MAX, HOSTNAME_BYTES_MAX, Joined, check_text, gpus_of, node_name, refused, signed_identity,
};
use crate::AppState;

/// How long a pending machine waits before asking again, at least (its own back-off may wait
/// longer).
pub const JOIN_ASK_RETRY_AFTER_MS: u64 = 2_000;
/// Admissions decided again when the node's stream or the pool moved first.
const ADMIT_ATTEMPTS_MAX: usize = 3;

/// What an ask is answered with.
pub enum Asked {
    Pending { id: JoinRequestId },
    Rejected { id: JoinRequestId, reason: String },
    Approved { id: JoinRequestId, joined: Joined },
}

pub async fn ask(state: &AppState, ask: bc_proto::JoinAsk) -> Result<Asked> {
    let public_key = node_public_key(&ask.node_public_key).map_err(Error::invalid)?;
    let signature =
        ed25519_dalek::Signature::from_slice(&ask.signature).map_err(|_| refused("the ask's signature is malformed"))?;
    let mut signed = bc_proto::JOIN_ASK_SIGNING_PREFIX.to_vec();
    signed.extend_from_slice(public_key.as_bytes());
    public_key.verify(&signed, &signature).map_err(|_| refused("the ask is not signed by the key it names"))?;
    let hardware = ask.hardware.unwrap_or_default();
    let (gpus, gpu_uuids) = gpus_of(&hardware.gpus)?;
    check_text("hostname", &hardware.hostname, HOSTNAME_BYTES_MAX)?;
    check_text("agent version", &ask.agent_version, AGENT_VERSION_BYTES_MAX)?;
    let id = join_request_id_of(public_key.as_bytes());
    let created = ev::JoinRequestCreated {
        public_key: b64(public_key.as_bytes()),
        hostname: hardware.hostname,
        agent_version: ask.agent_version,
        gpus,
        gpu_uuids,
    };
    for _ in 0..ADMIT_ATTEMPTS_MAX {
        let existing = request_doc(state, id).await?;
        let pending = match existing {
            Some(_) => 0,
            None => state
                .store
                .row_list(&TenantId::ROOT.to_string(), KIND_JOIN_REQUEST_PENDING, None, pending_read_limit())
                .await?
                .len(),
        };
        match join_request_ask(id, existing.as_ref(), created.clone(), pending)? {
            JoinRequestAnswer::Create(append) => {
                match state.log.append(append.into_request(TenantId::ROOT, format!("join_request:{id}"))).await {
                    Ok(_) => {
                        tracing::info!(join_request = %id, hostname = %created.hostname, "a machine asked to join");
                        return Ok(Asked::Pending { id });
                    }
                    // Another ask of the same machine made it first: answer from it.
                    Err(Error::Conflict { .. }) => continue,
                    Err(e) => return Err(e),
                }
            }
            JoinRequestAnswer::Pending => return Ok(Asked::Pending { id }),
            JoinRequestAnswer::Rejected { reason } => return Ok(Asked::Rejected { id, reason }),
            JoinRequestAnswer::Approved { tenant, pool, node } => {
                let doc = existing.ok_or_else(|| Error::Internal("an approved request has a document".into()))?;
                let joined = admit(state, id, &doc, (tenant, pool, node), &public_key).await?;
                return Ok(Asked::Approved { id, joined });
            }
        }
    }
    Err(Error::Unavailable("the join request is contended; retry".into()))
}

/// Reading one more pending row than the bound tells "at the bound" from "below it".
fn pending_read_limit() -> u32 {
    u32::try_from(JOIN_REQUESTS_PENDING_MAX + 1).unwrap_or(u32::MAX)
}

async fn request_doc(state: &AppState, id: JoinRequestId) -> Result<Option<JoinRequestDoc>> {
    match state.store.row_get(&TenantId::ROOT.to_string(), KIND_JOIN_REQUEST, &id.to_string()).await? {
        Some(row) => Ok(Some(crate::api::call::doc(row)?)),
        None => Ok(None),
    }
}

/// Admits an approved machine as `node` of `tenant`'s `pool`: the node stream's first append,
/// `node.joined` (actor `join_request:jreq_…`) with its certificate, guarded on the pool. An
/// ask after that (the answer was lost) gets the same identity and a new certificate.
async fn admit(
    state: &AppState,
    id: JoinRequestId,
    doc: &JoinRequestDoc,
    (tenant, pool_id, node): (TenantId, PoolId, NodeId),
    public_key: &ed25519_dalek::VerifyingKey,
) -> Result<Joined> {
    let actor = format!("join_request:{id}");
    for _ in 0..ADMIT_ATTEMPTS_MAX {
        let pool_row = state.store.row_get(&tenant.to_string(), KIND_POOL, &pool_id.to_string()).await?;
        let pool: PoolDoc = crate::api::call::doc(pool_row.ok_or_else(|| refused("the approved pool is gone"))?)?;
        if pool.archived {
            return Err(refused(&format!("the approved pool {pool_id} is archived")));
        }
        let node_row = state.store.row_get(&tenant.to_string(), KIND_NODE, &node.to_string()).await?;
        let certificate = super::join::issue_node_certificate(state, node, public_key)?;
        let result = match node_row {
            None => {
                let nodes = state.fleet.with_tenant(&*state.store, tenant, |view| view.nodes().len()).await?;
                bc_projections::decide::node_register(nodes)?;
                let joined = ev::NodeJoined {
                    pool_id: pool_id.to_string(),
                    name: node_name(&doc.hostname),
                    gpus: doc.gpus.clone(),
                    labels: Default::default(),
                    public_key: doc.public_key.clone(),
                    join_token_id: String::new(),
                    agent_version: doc.agent_version.clone(),
                    hostname: doc.hostname.clone(),
                    gpu_uuids: doc.gpu_uuids.clone(),
                    tpm: None,
                };
                let mut events = vec![bc_core::store::NewEvent::new(ev::NODE_JOINED, ev::to_cbor(&joined)?)];
                events.extend(certificate.as_ref().map(|c| c.event(false)).transpose()?);
                let mut request =
                    AppendRequest::new(tenant, stream_of(KIND_NODE, &node), ExpectedVersion::NoStream, actor.clone(), events);
                request.guards = vec![(stream_of(KIND_POOL, &pool_id), ExpectedVersion::Exact(pool.version))];
                state.log.append(request).await
            }
            Some(row) => {
                let existing: NodeDoc = crate::api::call::doc(row)?;
                let agent = existing.agent.as_ref().filter(|a| a.public_key == doc.public_key);
                match agent {
                    None => return Err(refused(&format!("node {node} is another machine's"))),
                    Some(a) if a.revoked_at_ms != 0 => return Err(refused(&format!("node {node} was revoked"))),
                    Some(_) => {}
                }
                // Admitted before and the answer lost: a new certificate on the node's stream.
                let Some(certificate) = &certificate else {
                    return first_identity(state, tenant, node, pool_id, public_key).await;
                };
                let request = AppendRequest::new(
                    tenant,
                    stream_of(KIND_NODE, &node),
                    ExpectedVersion::Exact(existing.version),
                    actor.clone(),
                    vec![certificate.event(false)?],
                );
                state.log.append(request).await
            }
        };
        match result {
            Ok(_) => {
                let mut joined = first_identity(state, tenant, node, pool_id, public_key).await?;
                joined.certificate = certificate;
                tracing::info!(%tenant, node = %node, join_request = %id, "a machine joined by its approved request");
                return Ok(joined);
            }
            Err(Error::Conflict { .. }) => {
                if state.store.row_get(&tenant.to_string(), KIND_NODE, &node.to_string()).await?.is_none()
                    && !state.store.read_stream_rows(tenant, &stream_of(KIND_NODE, &node), 0, 1).await?.is_empty()
                {
                    return Err(refused(&format!(
                        "node {node}, which this request was approved as, was deleted: ask again with a new key (bcd join --reset --yes --request)"
                    )));
                }
                continue;
            }
            Err(e) => return Err(e),
        }
    }
    Err(Error::Unavailable("the admission is contended; retry".into()))
}

/// The node's identity, signed, from the first event of its stream (the `node.joined` this
/// request made).
async fn first_identity(
    state: &AppState,
    tenant: TenantId,
    node: NodeId,
    pool_id: PoolId,
    public_key: &ed25519_dalek::VerifyingKey,
) -> Result<Joined> {
    let rows = state.store.read_stream_rows(tenant, &stream_of(KIND_NODE, &node), 0, 1).await?;
    let first = rows
        .into_iter()
        .next()
        .ok_or_else(|| Error::Internal(format!("node {node} has no events")))?
        .decode()
        .map_err(|e| Error::Corrupt { tenant: tenant.to_string(), seq: 0, what: e })?;
    if first.envelope.event_type != ev::NODE_JOINED {
        return Err(refused(&format!("node {node} did not join by this request")));
    }
    signed_identity(state, tenant, node, pool_id, public_key, &first).await
}
