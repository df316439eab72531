//! `nodes.*`: hosts and their GPUs. `register` adds one by hand; `cordon`, `uncordon`, `drain`,
//! `label` and `taint` change what can be placed on it; `delete` removes one nothing holds any
//! more, for good (`decide::node_delete`).

use std::collections::BTreeMap;

use bc_core::id::{NodeId, PoolId, TenantId};
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::placement::node_holders;
use bc_projections::{KIND_NODE, NodeDoc, decide, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::expected_version;
use super::paging::{Page, list_input};
use super::pools::pool_doc;
use super::resource::list_by;
use super::validate::{
    LabelKeyText, LabelsMap, NameText, NodeIdText, PoolIdText, TenantIdText, VersionNumber, string_schema, validate_label_key,
    validate_labels, validate_name, validate_text,
};
use super::views::{NodeChangedView, NodeDeletedView, NodeView};
use super::{Access, Call, Method, method};

/// Also what `inventory.*` are read as: a node's reports are the node's.
pub(super) const READ: Access = Access::Action("compute:nodes:read");
const WRITE: Access = Access::Action("compute:nodes:write");

pub const GPUS_PER_NODE_MAX: usize = 64;
pub const GPU_VRAM_GIB_MAX: u32 = 4096;
pub const NVLINK_DOMAIN_MAX: u32 = 1024;
/// Labels or taints one call may set or remove.
pub const KEY_CHANGES_MAX: usize = 64;
// A node is registered with at most `LABELS_MAX` labels, which a node may carry; a change is
// checked against the node's keys by `decide::node_keys_change`.
const _: () = assert!(super::validate::LABELS_MAX <= decide::NODE_KEYS_MAX);

pub(super) const METHODS: &[Method] = &[
    method!("nodes.register", WRITE, "add a host and its GPUs by hand", NodesRegister => NodeView, nodes_register),
    method!("nodes.get", READ, "one node", NodeRef => NodeView, nodes_get),
    method!("nodes.list", READ, "a tenant's nodes, paged by cursor", NodesList => Page<NodeView>, nodes_list),
    method!("nodes.cordon", WRITE, "take no new reservations on a node", NodeChange => NodeChangedView, nodes_cordon),
    method!("nodes.uncordon", WRITE, "take reservations on a node again", NodeChange => NodeChangedView, nodes_uncordon),
    method!("nodes.drain", WRITE, "cordon a node until its reservations end", NodeChange => NodeChangedView, nodes_drain),
    method!("nodes.label", WRITE, "set or remove a node's labels", NodeKeys => NodeChangedView, nodes_label),
    method!("nodes.taint", WRITE, "set or remove a node's taints", NodeKeys => NodeChangedView, nodes_taint),
    method!(
        "nodes.delete",
        WRITE,
        "remove a node for good: cordoned, no GPU held, its agent gone, nothing else holding it",
        NodeDelete => NodeDeletedView,
        nodes_delete
    ),
    method!(
        "nodes.revoke",
        WRITE,
        "revoke a node: its certificates are refused and its sessions end at once; it never starts another",
        NodeRevoke => NodeChangedView,
        nodes_revoke
    ),
];

string_schema!(
    /// A GPU model or product name: 1 to 63 of `A-Z a-z 0-9 - . _`, starting with a letter or digit.
    GpuNameText as "GpuName",
    |_| {
            schemars::json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$" })
    }
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuInput {
    /// `H100`, `A100`, …
    #[schemars(with = "GpuNameText")]
    model: String,
    /// `H100-SXM5-80GB`, …
    #[schemars(with = "GpuNameText")]
    product: String,
    #[schemars(range(min = 1, max = GPU_VRAM_GIB_MAX))]
    vram_gi_b: u32,
    /// GPUs of the node with the same domain share NVLink.
    #[schemars(range(max = NVLINK_DOMAIN_MAX))]
    nvlink_domain: u32,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodesRegister {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    #[schemars(with = "NameText")]
    name: String,
    #[schemars(length(max = GPUS_PER_NODE_MAX))]
    gpus: Vec<GpuInput>,
    #[serde(default)]
    #[schemars(with = "LabelsMap")]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
}

list_input!(NodesList {
    /// Only the nodes of this pool.
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
});

/// A state change of one node, while it is at `ifVersion` (if given).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeChange {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

/// A node to delete, while it is at `ifVersion` (if given), and why.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeDelete {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    #[schemars(with = "Option<DeleteReasonText>")]
    reason: Option<String>,
}

/// A node to revoke, while it is at `ifVersion` (if given), and why (at most
/// [`DELETE_REASON_CHARS_MAX`] characters, as a deletion's).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeRevoke {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    #[schemars(with = "Option<DeleteReasonText>")]
    reason: Option<String>,
}

/// Longest reason an operator gives a node's deletion, in characters.
pub const DELETE_REASON_CHARS_MAX: usize = 500;

string_schema!(
    /// Why a node was deleted ([`validate_text`] with [`DELETE_REASON_CHARS_MAX`]).
    DeleteReasonText,
    schemars::json_schema!({ "type": "string", "maxLength": DELETE_REASON_CHARS_MAX, "pattern": super::validate::TEXT_PATTERN })
);

/// Keys to set and keys to remove: at least one, at most `KEY_CHANGES_MAX` in all.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("anyOf" = [
    { "required": ["set"], "properties": { "set": { "minProperties": 1 } } },
    { "required": ["remove"], "properties": { "remove": { "minItems": 1 } } },
]))]
pub struct NodeKeys {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    #[serde(default)]
    #[schemars(with = "LabelsMap")]
    set: BTreeMap<String, String>,
    #[serde(default)]
    #[schemars(with = "Vec<LabelKeyText>", length(max = KEY_CHANGES_MAX))]
    remove: Vec<String>,
}

pub(super) async fn node_doc(call: &Call<'_>, tenant: TenantId, node: &str) -> Result<NodeDoc> {
    call.row(tenant, KIND_NODE, node, "node").await
}

async fn nodes_register(call: &Call<'_>, input: NodesRegister) -> Result<NodeView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool: PoolId = parse_id("poolId", &input.pool_id)?;
    validate_name("name", &input.name)?;
    validate_labels(&input.labels)?;
    if input.gpus.len() > GPUS_PER_NODE_MAX {
        return Err(Error::invalid(format!("a node has at most {GPUS_PER_NODE_MAX} GPUs")));
    }
    let mut gpus = Vec::with_capacity(input.gpus.len());
    for (i, gpu) in input.gpus.into_iter().enumerate() {
        validate_name(&format!("gpus[{i}].model"), &gpu.model.to_ascii_lowercase())?;
        validate_name(&format!("gpus[{i}].product"), &gpu.product.to_ascii_lowercase())?;
        if !(1..=GPU_VRAM_GIB_MAX).contains(&gpu.vram_gi_b) {
            return Err(Error::invalid(format!("gpus[{i}].vramGiB must be 1 to {GPU_VRAM_GIB_MAX}")));
        }
        if gpu.nvlink_domain > NVLINK_DOMAIN_MAX {
            return Err(Error::invalid(format!("gpus[{i}].nvlinkDomain must be 0 to {NVLINK_DOMAIN_MAX}")));
        }
        gpus.push(Gpu { model: gpu.model, product: gpu.product, vram_gib: gpu.vram_gi_b, nvlink_domain: gpu.nvlink_domain });
    }
    let pool_doc = pool_doc(call, tenant, &pool.to_string()).await?;
    if pool_doc.archived {
        return Err(Error::state(format!("pool {pool} is archived"), decide::ARCHIVED_POOL_HINT));
    }
    // Counted in this process's fleet view: registrations in flight elsewhere can pass the
    // limit by their number, which still bounds a tenant's nodes.
    let nodes = call.state.fleet.with_tenant(&*call.state.store, tenant, |view| view.nodes().len()).await?;
    decide::node_register(nodes)?;
    let node = NodeId::from_ulid(call.ulid());
    let payload = ev::to_cbor(&ev::NodeRegistered { pool_id: pool.to_string(), name: input.name, gpus, labels: input.labels })?;
    // Only into the pool as read: an archive committed meanwhile makes this a CONFLICT.
    let guard = (stream_of(bc_projections::KIND_POOL, &pool), ExpectedVersion::Exact(pool_doc.version));
    let result = call
        .append_guarded(tenant, stream_of(KIND_NODE, &node), ExpectedVersion::NoStream, ev::NODE_REGISTERED, payload, vec![guard])
        .await?;
    Ok(call.created::<NodeDoc>(tenant, &result).await?.into())
}

async fn nodes_get(call: &Call<'_>, input: NodeRef) -> Result<NodeView> {
    Ok(call.named::<NodeDoc>(&input.tenant_id, &input.node_id).await?.into())
}

async fn nodes_list(call: &Call<'_>, input: NodesList) -> Result<Page<NodeView>> {
    let page = (input.limit, input.cursor.as_deref());
    list_by::<NodeDoc, _, PoolId>(call, &input.tenant_id, page, ("poolId", &input.pool_id), |n| &n.pool_id).await
}

/// Appends one change to a node at the version read (`ifVersion`, if given, must be it), and
/// answers with the node. The payload is made once the caller is authorized and the node found,
/// so a caller who may not change it learns nothing from its validation.
async fn node_change(
    call: &Call<'_>,
    tenant_id: &Option<String>,
    node_id: &str,
    if_version: Option<u64>,
    event_type: &str,
    payload: impl FnOnce(&NodeDoc) -> Result<ciborium::Value>,
) -> Result<NodeChangedView> {
    let tenant = call.tenant(tenant_id).await?;
    let node_id: NodeId = parse_id("nodeId", node_id)?;
    let node = node_doc(call, tenant, &node_id.to_string()).await?;
    let payload = payload(&node)?;
    let stream = stream_of(KIND_NODE, &node_id);
    let expected = expected_version(if_version, node.version, &stream)?;
    call.append(tenant, stream, expected, event_type, payload).await?;
    let node: NodeView = node_doc(call, tenant, &node_id.to_string()).await?.into();
    let drained = node.state == super::views::NodeStateView::Draining && node.allocations.is_empty();
    Ok(NodeChangedView { node, drained })
}

async fn nodes_cordon(call: &Call<'_>, input: NodeChange) -> Result<NodeChangedView> {
    let payload = |_: &NodeDoc| ev::to_cbor(&ev::NodeStateChanged {});
    node_change(call, &input.tenant_id, &input.node_id, input.if_version, ev::NODE_CORDONED, payload).await
}

async fn nodes_uncordon(call: &Call<'_>, input: NodeChange) -> Result<NodeChangedView> {
    let payload = |_: &NodeDoc| ev::to_cbor(&ev::NodeStateChanged {});
    node_change(call, &input.tenant_id, &input.node_id, input.if_version, ev::NODE_UNCORDONED, payload).await
}

async fn nodes_drain(call: &Call<'_>, input: NodeChange) -> Result<NodeChangedView> {
    let payload = |_: &NodeDoc| ev::to_cbor(&ev::NodeStateChanged {});
    node_change(call, &input.tenant_id, &input.node_id, input.if_version, ev::NODE_DRAINING, payload).await
}

async fn nodes_delete(call: &Call<'_>, input: NodeDelete) -> Result<NodeDeletedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let node_id: NodeId = parse_id("nodeId", &input.node_id)?;
    if let Some(reason) = &input.reason {
        validate_text("reason", reason, DELETE_REASON_CHARS_MAX)?;
    }
    decide::batch::batch_required(call.state.batch_quorum, decide::batch::DestructiveScope::NodeDelete)?;
    let node = node_doc(call, tenant, &node_id.to_string()).await?;
    expected_version(input.if_version, node.version, &stream_of(KIND_NODE, &node_id))?;
    let holders = node_holders(&*call.state.store, tenant, &node_id.to_string()).await?;
    let append = decide::node_delete(&node, &holders, input.reason)?;
    let appended = call.submit(call.decided(tenant, append)).await?;
    // A deleted node's certificate is refused by this process's TLS layer too, until it expires.
    let key = node.agent.as_ref().and_then(|a| bc_core::agent::unb64(&a.public_key).ok());
    if let (Some(ca), Some(key)) = (&call.state.node_ca, key.and_then(|k| <[u8; 32]>::try_from(k).ok())) {
        ca.revoke(&key);
    }
    let version = appended.events.last().map_or(node.version + 1, |e| e.envelope.version);
    Ok(NodeDeletedView { node_id: node_id.to_string(), deleted: true, version })
}

/// `nodes.revoke`: `node.revoked` at the node's version, then this process's TLS layer refuses
/// the node's key and its sessions here end (`node_ca::NodeCa::revoke`); other processes
/// refuse its sessions from its document, and its handshakes once they load the revoked set.
async fn nodes_revoke(call: &Call<'_>, input: NodeRevoke) -> Result<NodeChangedView> {
    if let Some(reason) = &input.reason {
        validate_text("reason", reason, DELETE_REASON_CHARS_MAX)?;
    }
    let mut key = None;
    let reason = input.reason.clone();
    let changed = node_change(call, &input.tenant_id, &input.node_id, input.if_version, ev::NODE_REVOKED, |node| {
        let agent = node.agent.as_ref().ok_or_else(|| {
            Error::state(
                format!("node {} did not join with bcd: it has no certificate", node.node_id),
                "delete it instead (nodes.delete)",
            )
        })?;
        if agent.revoked_at_ms > 0 {
            return Err(Error::state(format!("node {} is already revoked", node.node_id), "nothing more to do"));
        }
        key = Some(
            bc_core::agent::unb64(&agent.public_key)
                .ok()
                .and_then(|k| <[u8; 32]>::try_from(k).ok())
                .ok_or_else(|| Error::Internal(format!("node {}'s stored key does not decode", node.node_id)))?,
        );
        ev::to_cbor(&ev::NodeRevoked { reason })
    })
    .await?;
    if let (Some(ca), Some(key)) = (&call.state.node_ca, key) {
        ca.revoke(&key);
    }
    Ok(changed)
}

/// Checks a labels (or taints, `what`) change against the node's current keys.
fn check_keys(input: &NodeKeys, what: &'static str, node: &NodeDoc) -> Result<ciborium::Value> {
    if input.set.is_empty() && input.remove.is_empty() {
        return Err(Error::invalid("nothing to change: give set or remove"));
    }
    if input.set.len() + input.remove.len() > KEY_CHANGES_MAX {
        return Err(Error::invalid(format!("at most {KEY_CHANGES_MAX} keys per call")));
    }
    validate_labels(&input.set)?;
    for key in &input.remove {
        validate_label_key(key)?;
    }
    let current = if what == "labels" { &node.labels } else { &node.taints };
    decide::node_keys_change(&node.node_id, what, current, &input.set, &input.remove)?;
    ev::to_cbor(&ev::NodeKeysChanged { set: input.set.clone(), remove: input.remove.clone() })
}

async fn nodes_label(call: &Call<'_>, input: NodeKeys) -> Result<NodeChangedView> {
    node_change(call, &input.tenant_id, &input.node_id, input.if_version, ev::NODE_LABELED, |node| {
        check_keys(&input, "labels", node)
    })
    .await
}

async fn nodes_taint(call: &Call<'_>, input: NodeKeys) -> Result<NodeChangedView> {
    node_change(call, &input.tenant_id, &input.node_id, input.if_version, ev::NODE_TAINTED, |node| {
        check_keys(&input, "taints", node)
    })
    .await
}
