//! `Join`: a machine spends a join token and becomes a node. The token is checked (its hash, its
//! tenant's pool, expiry, uses, revocation) and spent in the same append as `node.joined`, with
//! the token's stream guarded at the version read: of two joins racing for the last use, one
//! commits and the other is refused. The answer is the node's identity signed by the log key.
//! A join asked again with the same node key after its answer was lost is answered with the
//! node it made (`joined_before`).

use bc_core::agent::{NodeIdentity, b64, identity_signing_message, join_token_parse, node_public_key};
use bc_core::id::{JoinTokenId, NodeId, PoolId, TenantId};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_core::webhook::constant_time_eq;
use bc_core::{Error, Result};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::{JoinTokenDoc, KIND_JOIN_TOKEN, KIND_NODE, KIND_POOL, NodeDoc, PoolDoc, stream_of};

use crate::AppState;

// Most GPUs a machine may claim, and the bounds on their fields: those of `nodes.register`.
use crate::api::nodes::{GPU_VRAM_GIB_MAX, GPUS_PER_NODE_MAX, NVLINK_DOMAIN_MAX};
/// Longest host name and agent version taken.
pub const HOSTNAME_BYTES_MAX: usize = 253;
pub const AGENT_VERSION_BYTES_MAX: usize = 64;
/// Joins decided again when a racing join moved the token first.
const JOIN_ATTEMPTS_MAX: usize = 3;

/// A join, refused or not, as the gateway answers it.
pub struct Joined {
    pub identity: Vec<u8>,
    pub signature: Vec<u8>,
    /// The node certificate issued with the join (none without a node CA).
    pub certificate: Option<crate::node_ca::IssuedCertificate>,
}

/// Why a join is refused: said to the machine without quoting its token.
pub(super) fn refused(why: &str) -> Error {
    Error::AccessDenied(format!("join refused: {why}"))
}

pub async fn join(state: &AppState, request: bc_proto::JoinRequest) -> Result<Joined> {
    let token = token_of(state, &request)?;
    let (token_id, secret_sha256) = join_token_parse(&token).map_err(|e| refused(&e))?;
    let public_key = node_public_key(&request.node_public_key).map_err(Error::invalid)?;
    let hardware = request.hardware.unwrap_or_default();
    let (gpus, gpu_uuids) = gpus_of(&hardware.gpus)?;
    check_text("hostname", &hardware.hostname, HOSTNAME_BYTES_MAX)?;
    check_text("agent version", &request.agent_version, AGENT_VERSION_BYTES_MAX)?;
    let row = state.store.row_find(KIND_JOIN_TOKEN, &token_id.to_string()).await?.ok_or_else(|| refused("unknown join token"))?;
    let tenant: TenantId = row.key.tenant.parse()?;
    let stored = state.store.secret_get(tenant, &token_id.to_string()).await?;
    if !stored
        .is_some_and(|hash| constant_time_eq(hash.as_bytes(), secret_sha256.as_bytes()) && hash.len() == secret_sha256.len())
    {
        return Err(refused("unknown join token"));
    }
    let as_node = if request.node_id.is_empty() {
        None
    } else {
        Some(request.node_id.parse::<NodeId>().map_err(|_| refused("the node id asked for is not a node_ id"))?)
    };
    for _ in 0..JOIN_ATTEMPTS_MAX {
        let claimed = Claimed { hostname: &hardware.hostname, gpus: &gpus, gpu_uuids: &gpu_uuids, as_node };
        match join_once(state, tenant, token_id, &request.agent_version, claimed, &public_key).await {
            Err(Error::Conflict { .. }) => continue,
            other => return other,
        }
    }
    Err(Error::Unavailable("the join token is contended; retry".into()))
}

/// The join token a request carries: sealed to the deployment's join encryption key (opened
/// here, for the request's node key), or plain (agents without `join-encryption.jwk`; taken
/// unless the gateway takes sealed tokens only, so agents joined before the well-known document
/// keep joining). Never both.
fn token_of(state: &AppState, request: &bc_proto::JoinRequest) -> Result<String> {
    let Some(sealed) = &request.sealed_token else {
        if state.sealed_joins_only {
            return Err(refused(
                "this control plane takes join tokens only sealed to its join encryption key: join through its well-known document (bcd join --server URL --join-signing-pin PIN)",
            ));
        }
        return Ok(request.token.clone());
    };
    if !request.token.is_empty() {
        return Err(Error::invalid("a join carries its token sealed or plain, not both"));
    }
    let keys =
        state.join_keys.as_ref().ok_or_else(|| refused("this gateway has no join encryption key to open a sealed token"))?;
    let ours = keys.encryption().pin();
    if sealed.key_pin.len() > bc_core::well_known::PIN_BYTES_MAX || (!sealed.key_pin.is_empty() && sealed.key_pin != ours) {
        return Err(refused(&format!(
            "the token is sealed to another join encryption key than this deployment's ({ours}): fetch the well-known document again"
        )));
    }
    let sealed = bc_core::well_known::SealedToken { enc: sealed.enc.clone(), ciphertext: sealed.ciphertext.clone() };
    let opened = keys.encryption().open(&sealed, &request.node_public_key).map_err(|e| refused(&e))?;
    String::from_utf8(opened).map_err(|_| refused("the sealed join token is not text"))
}

/// What a machine says of itself at join.
#[derive(Clone, Copy)]
struct Claimed<'a> {
    /// The node asked for (a deployed machine's installed system: `bcd join --node-id`).
    as_node: Option<NodeId>,
    hostname: &'a str,
    gpus: &'a [Gpu],
    gpu_uuids: &'a [String],
}

async fn join_once(
    state: &AppState,
    tenant: TenantId,
    token_id: JoinTokenId,
    agent_version: &str,
    claimed: Claimed<'_>,
    public_key: &ed25519_dalek::VerifyingKey,
) -> Result<Joined> {
    let Claimed { hostname, gpus, gpu_uuids, as_node } = claimed;
    if let Some(joined) = joined_before(state, tenant, token_id, public_key).await? {
        return Ok(joined);
    }
    let (token, pool_id, pool) = usable_token(state, tenant, token_id).await?;
    let (node, expected) = node_to_join(state, tenant, &token, as_node).await?;
    // A machine that becomes a new node counts against the tenant's limit, as `nodes.register`
    // does (counted the same way, in this process's fleet view); one that joins again as its
    // node (a redeploy) adds none.
    if expected == ExpectedVersion::NoStream {
        let nodes = state.fleet.with_tenant(&*state.store, tenant, |view| view.nodes().len()).await?;
        bc_projections::decide::node_register(nodes)?;
    }
    let joined = ev::NodeJoined {
        pool_id: pool_id.to_string(),
        name: node_name(hostname),
        gpus: gpus.to_vec(),
        labels: Default::default(),
        public_key: b64(public_key.as_bytes()),
        join_token_id: token_id.to_string(),
        agent_version: agent_version.to_owned(),
        hostname: hostname.to_owned(),
        gpu_uuids: gpu_uuids.to_vec(),
        tpm: None,
    };
    // The node certificate for the node's key, recorded in the same append as the join.
    let certificate = issue_node_certificate(state, node, public_key)?;
    let token_stream = stream_of(KIND_JOIN_TOKEN, &token_id);
    let mut spend = NewEvent::new(ev::JOIN_TOKEN_USED, ev::to_cbor(&ev::JoinTokenUsed { node_id: node.to_string() })?);
    spend.stream = Some(token_stream.clone());
    let mut request = AppendRequest::new(
        tenant,
        stream_of(KIND_NODE, &node),
        expected,
        format!("join_token:{token_id}"),
        vec![NewEvent::new(ev::NODE_JOINED, ev::to_cbor(&joined)?), spend],
    );
    if let Some(certificate) = &certificate {
        request.events.insert(1, certificate.event(false)?);
    }
    request.guards = vec![
        (token_stream, ExpectedVersion::Exact(token.version)),
        (stream_of(KIND_POOL, &pool_id), ExpectedVersion::Exact(pool.version)),
    ];
    let result = state.log.append(request).await?;
    let mut joined = signed_identity(state, tenant, node, pool_id, public_key, &result.events[0]).await?;
    joined.certificate = certificate;
    tracing::info!(%tenant, node = %node, join_token = %token_id, "a machine joined");
    Ok(joined)
}

/// Events read at a time when a join asked again looks for its `node.joined`.
const JOIN_EVENT_PAGE: u32 = 256;

/// The answer to a join asked again by the machine that made it: the identity of the node this
/// token already joined with this node key, if one did (and neither is revoked). A join whose
/// commit was made but whose answer was lost (a database failover between the commit and its
/// answer, a timeout, `bcd` killed after the append) is retried by `bcd` with the same key;
/// without this the retry was refused (the token spent) and left a node in the log that no
/// machine could run as. The identity is no use without the node's private key, which the
/// session proves; a new node certificate is issued (and recorded) for the key, as a renewal.
async fn joined_before(
    state: &AppState,
    tenant: TenantId,
    token_id: JoinTokenId,
    public_key: &ed25519_dalek::VerifyingKey,
) -> Result<Option<Joined>> {
    let tenant_text = tenant.to_string();
    let Some(row) = state.store.row_get(&tenant_text, KIND_JOIN_TOKEN, &token_id.to_string()).await? else { return Ok(None) };
    let token: JoinTokenDoc = crate::api::call::doc(row)?;
    if token.revoked {
        return Ok(None);
    }
    let key = b64(public_key.as_bytes());
    for node_id in token.node_ids.iter().rev() {
        let Some(row) = state.store.row_get(&tenant_text, KIND_NODE, node_id).await? else { continue };
        let doc: NodeDoc = crate::api::call::doc(row)?;
        if doc.agent.as_ref().is_none_or(|agent| agent.public_key != key || agent.revoked_at_ms != 0) {
            continue;
        }
        let node: NodeId = node_id.parse()?;
        let pool_id: PoolId = doc.pool_id.parse()?;
        let event = last_join(state, tenant, node).await?;
        let certificate = issue_node_certificate(state, node, public_key)?;
        if let Some(certificate) = &certificate {
            let request = AppendRequest::new(
                tenant,
                stream_of(KIND_NODE, &node),
                ExpectedVersion::Any,
                format!("join_token:{token_id}"),
                vec![certificate.event(true)?],
            );
            state.log.append(request).await?;
        }
        let mut joined = signed_identity(state, tenant, node, pool_id, public_key, &event).await?;
        joined.certificate = certificate;
        tracing::info!(%tenant, node = %node, join_token = %token_id, "a join asked again was answered with the node it made");
        return Ok(Some(joined));
    }
    Ok(None)
}

/// The last `node.joined` on `node`'s stream.
async fn last_join(state: &AppState, tenant: TenantId, node: NodeId) -> Result<bc_core::event::StoredEvent> {
    let stream = stream_of(KIND_NODE, &node);
    let (mut after, mut found) = (0, None);
    loop {
        let rows = state.store.read_stream_rows(tenant, &stream, after, JOIN_EVENT_PAGE).await?;
        let Some(last) = rows.last() else { break };
        after = last.version;
        found = rows.into_iter().rev().find(|r| r.event_type == ev::NODE_JOINED).or(found);
    }
    let row = found.ok_or_else(|| Error::Internal(format!("node {node} has no node.joined")))?;
    row.decode().map_err(|e| Error::Corrupt { tenant: tenant.to_string(), seq: 0, what: e })
}

/// The join token, if it may join a machine now (not revoked, not spent, not expired), and its
/// pool, if that is not archived.
async fn usable_token(state: &AppState, tenant: TenantId, token_id: JoinTokenId) -> Result<(JoinTokenDoc, PoolId, PoolDoc)> {
    let row = state.store.row_get(&tenant.to_string(), KIND_JOIN_TOKEN, &token_id.to_string()).await?;
    let token: JoinTokenDoc = crate::api::call::doc(row.ok_or_else(|| refused("unknown join token"))?)?;
    let now_ms = state.log.clock.now_ms();
    if token.revoked {
        return Err(refused("the join token was revoked"));
    }
    if token.uses >= token.uses_max {
        return Err(refused("the join token is spent (each use joins one machine)"));
    }
    if now_ms >= token.expires_at_ms {
        return Err(refused("the join token expired"));
    }
    let pool_id: PoolId = token.pool_id.parse()?;
    let pool_row = state.store.row_get(&tenant.to_string(), KIND_POOL, &pool_id.to_string()).await?;
    let pool: PoolDoc = crate::api::call::doc(pool_row.ok_or_else(|| refused("the join token's pool is gone"))?)?;
    if pool.archived {
        return Err(refused("the join token's pool is archived"));
    }
    Ok((token, pool_id, pool))
}

/// The node the machine joins as, and the version its stream is expected at. A deploy's token
/// is bound to its machine's node: the installed system joins as that node (again, after a
/// redeploy: the node's stream goes on at its version), and as no other; another token makes a
/// new node.
async fn node_to_join(
    state: &AppState,
    tenant: TenantId,
    token: &JoinTokenDoc,
    as_node: Option<NodeId>,
) -> Result<(NodeId, ExpectedVersion)> {
    match (&token.node_id, as_node) {
        (None, None) => Ok((NodeId::from_ulid(state.log.ids.ulid()), ExpectedVersion::NoStream)),
        (None, Some(_)) => Err(refused("this join token is not bound to a node: join without --node-id")),
        (Some(bound), asked) => {
            if asked.map(|a| a.to_string()).as_deref() != Some(bound.as_str()) {
                return Err(refused(&format!("this join token provisions node {bound}: join with --node-id {bound}")));
            }
            let node: NodeId = bound.parse()?;
            let existing = state.store.row_get(&tenant.to_string(), KIND_NODE, bound).await?;
            let expected = match existing {
                Some(row) => ExpectedVersion::Exact(crate::api::call::doc::<NodeDoc>(row)?.version),
                None => ExpectedVersion::NoStream,
            };
            Ok((node, expected))
        }
    }
}

/// The node's identity document, signed by the log key, from its `node.joined` event and the
/// node's row.
pub(super) async fn signed_identity(
    state: &AppState,
    tenant: TenantId,
    node: NodeId,
    pool_id: PoolId,
    public_key: &ed25519_dalek::VerifyingKey,
    event: &bc_core::event::StoredEvent,
) -> Result<Joined> {
    let doc: NodeDoc = crate::api::call::doc(
        state
            .store
            .row_get(&tenant.to_string(), KIND_NODE, &node.to_string())
            .await?
            .ok_or_else(|| Error::Internal("the joined node has no document".into()))?,
    )?;
    let identity = NodeIdentity {
        node_id: node.to_string(),
        tenant_id: tenant.to_string(),
        pool_id: pool_id.to_string(),
        name: doc.name,
        node_public_key: b64(public_key.as_bytes()),
        log_key_id: state.log.key.key_id().to_owned(),
        joined_at_ms: event.envelope.at_ms,
        event_id: event.envelope.id.to_string(),
    };
    let bytes = serde_json::to_vec(&identity).map_err(|e| Error::Internal(format!("identity: {e}")))?;
    let signature = state.log.key.sign_raw(&identity_signing_message(&bytes)).to_vec();
    Ok(Joined { identity: bytes, signature, certificate: None })
}

/// The node's name: its host name when that is a valid name (lowercased), else `node`.
pub(super) fn node_name(hostname: &str) -> String {
    let lower = hostname.split('.').next().unwrap_or("").to_ascii_lowercase();
    if crate::api::validate::validate_name("name", &lower).is_ok() { lower } else { "node".to_owned() }
}

pub(super) fn check_text(what: &str, text: &str, bytes_max: usize) -> Result<()> {
    if text.len() > bytes_max || text.chars().any(char::is_control) {
        return Err(Error::invalid(format!("the {what} is at most {bytes_max} bytes without control characters")));
    }
    Ok(())
}

/// The GPUs a machine claims at join, and their UUIDs (none when it names none: an agent from
/// before holds).
pub(super) fn gpus_of(claimed: &[bc_proto::Gpu]) -> Result<(Vec<Gpu>, Vec<String>)> {
    let gpus: Vec<Gpu> = claimed
        .iter()
        .map(|g| Gpu { model: g.model.clone(), product: g.product.clone(), vram_gib: g.vram_gib, nvlink_domain: g.nvlink_domain })
        .collect();
    check_gpus(&gpus)?;
    let uuids: Vec<String> = claimed.iter().map(|g| g.uuid.clone()).collect();
    if uuids.iter().any(|u| u.len() > INVENTORY_TEXT_BYTES_MAX || u.chars().any(char::is_control)) {
        return Err(Error::invalid(format!("a GPU's UUID is at most {INVENTORY_TEXT_BYTES_MAX} bytes of text")));
    }
    Ok((gpus, if uuids.iter().all(String::is_empty) { Vec::new() } else { uuids }))
}

/// A machine's GPUs, claimed at join or reported in an inventory, within `nodes.register`'s
/// bounds.
fn check_gpus(gpus: &[Gpu]) -> Result<()> {
    if gpus.len() > GPUS_PER_NODE_MAX {
        return Err(Error::invalid(format!("a machine claims at most {GPUS_PER_NODE_MAX} GPUs")));
    }
    let name_ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    for g in gpus {
        if !name_ok(&g.model) || !name_ok(&g.product) {
            return Err(Error::invalid("a GPU's model and product are 1 to 63 of A-Z a-z 0-9 - . _"));
        }
        if g.vram_gib == 0 || g.vram_gib > GPU_VRAM_GIB_MAX || g.nvlink_domain > NVLINK_DOMAIN_MAX {
            return Err(Error::invalid(format!(
                "a GPU has 1 to {GPU_VRAM_GIB_MAX} GiB and an NVLink domain up to {NVLINK_DOMAIN_MAX}"
            )));
        }
    }
    Ok(())
}

/// Most disks an inventory lists, and the longest text in it.
pub const INVENTORY_DISKS_MAX: usize = 256;
pub const INVENTORY_TEXT_BYTES_MAX: usize = 256;

/// Whether a reported inventory is within the node's bounds: at most `GPUS_PER_NODE_MAX` GPUs
/// with valid names and sizes, indexes 0..n in order, bounded text.
pub fn check_inventory(inventory: &ev::NodeInventoryReported) -> std::result::Result<(), String> {
    check_gpus(&bc_projections::gpus_of_inventory(inventory).0).map_err(|e| e.public_message())?;
    if inventory.gpus.iter().enumerate().any(|(i, g)| g.index as usize != i) {
        return Err("the inventory's GPUs are numbered 0, 1, … in order".into());
    }
    let text_ok = |t: &str| t.len() <= INVENTORY_TEXT_BYTES_MAX && !t.chars().any(char::is_control);
    let host = &inventory.host;
    let texts = inventory
        .gpus
        .iter()
        .flat_map(|g| [g.uuid.as_str(), g.pci_bus_id.as_str()])
        .chain(
            [
                &inventory.driver_version,
                &inventory.cuda_version,
                &inventory.unavailable,
                &host.cpu_model,
                &host.vendor,
                &host.product,
                &host.serial,
            ]
            .into_iter()
            .flatten()
            .map(String::as_str),
        )
        .chain(host.disks.iter().map(|d| d.name.as_str()));
    let capabilities_ok = inventory.capabilities.len() <= bc_proto::CAPABILITIES_MAX
        && inventory.capabilities.iter().all(|c| !c.is_empty() && c.len() <= bc_proto::CAPABILITY_BYTES_MAX);
    if !capabilities_ok {
        return Err(format!(
            "an inventory names at most {} capabilities of 1 to {} bytes",
            bc_proto::CAPABILITIES_MAX,
            bc_proto::CAPABILITY_BYTES_MAX
        ));
    }
    let texts = texts.chain(inventory.hold_unavailable.as_deref());
    if host.disks.len() > INVENTORY_DISKS_MAX || !texts.into_iter().all(text_ok) {
        return Err(format!(
            "an inventory holds at most {INVENTORY_DISKS_MAX} disks and text of at most {INVENTORY_TEXT_BYTES_MAX} bytes"
        ));
    }
    Ok(())
}

/// The node certificate for `public_key` as `node` when the deployment has a node CA (none
/// without): its serial from the log's ids, its time from the log's clock. Every join (a token's,
/// a request's, a TPM's) records it in the append that admits the node.
pub(super) fn issue_node_certificate(
    state: &AppState,
    node: NodeId,
    public_key: &ed25519_dalek::VerifyingKey,
) -> Result<Option<crate::node_ca::IssuedCertificate>> {
    let Some(ca) = &state.node_ca else { return Ok(None) };
    ca.issue(&node.to_string(), public_key.as_bytes(), state.log.ids.ulid().to_bytes(), state.log.clock.now_ms()).map(Some)
}
