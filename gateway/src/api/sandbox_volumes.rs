//! `sandboxVolumes.*`: persistent volumes for sandboxes, each an ext4 disk image of its size on
//! one node of its pool, made, grown and removed there by the node's agent through
//! `sandbox_volume.apply` commands; every change an event on `sandbox_volume/vol_…`
//! (docs/sandboxes.md, "Volumes").
//!
//! A handler is parse, one decision (`bc_projections::decide::sandbox_volume`), append, view.
//! A template names volumes (`sandboxTemplates.create`/`update`, in `api/sandboxes.rs`); a
//! sandbox of it is placed on the volumes' node and attaches them in its creation's append. The
//! node's answers come back from its journal ([`check_volume_report`]).

use std::collections::BTreeMap;

use bc_core::Result;
use bc_core::id::{CommandId, PoolId, SandboxVolumeId, TenantId};
use bc_projections::decide::sandbox_volume::{self as decide, SandboxVolumeInput};
use bc_projections::placement::Issue;
use bc_projections::sandbox::{KIND_SANDBOX_LIVE, SandboxDoc};
use bc_projections::sandbox_volume::{KIND_SANDBOX_VOLUME, KIND_SANDBOX_VOLUME_LIVE, SandboxVolumeDoc};
use bc_projections::{KIND_NODE, KIND_POOL, NodeDoc, PoolDoc};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::doc;
use super::paging::{Page, list_rows};
use super::validate::{CursorText, LimitNumber, NameText, PoolIdText, SandboxVolumeIdText, TenantIdText, validate_name};
use super::views::SandboxVolumeView;
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:sandboxes:read");
const WRITE: Access = Access::Action("compute:sandboxes:write");
/// Rows read at most when reading a tenant's live volumes, sandboxes or nodes (each bound, a
/// tenant's volumes by `SANDBOX_VOLUMES_PER_TENANT_MAX`, is below it).
const ROWS_READ_MAX: u32 = 1000;

pub(super) const METHODS: &[Method] = &[
    method!(
        "sandboxVolumes.create",
        WRITE,
        "a persistent volume of sizeGiB on a node of the pool that runs sandboxes (an ext4 disk image, made by the node)",
        SandboxVolumesCreate => SandboxVolumeView,
        sandbox_volumes_create,
    ),
    method!("sandboxVolumes.get", READ, "one sandbox volume, with its state, size and attachment", VolumeRef => SandboxVolumeView, sandbox_volumes_get),
    method!(
        "sandboxVolumes.list",
        READ,
        "the caller's sandbox volumes (scope all: every one of the tenant), paged by cursor",
        SandboxVolumesList => Page<SandboxVolumeView>,
        sandbox_volumes_list,
    ),
    method!(
        "sandboxVolumes.resize",
        WRITE,
        "grow a volume (the file and its file system); never while a sandbox mounts it",
        SandboxVolumesResize => SandboxVolumeView,
        sandbox_volumes_resize,
    ),
    method!(
        "sandboxVolumes.delete",
        WRITE,
        "delete a volume and its data from its node; refused while a live sandbox mounts it",
        VolumeRef => SandboxVolumeView,
        sandbox_volumes_delete,
    ),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumesCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Unique among the tenant's volumes; templates may name it.
    #[schemars(with = "NameText")]
    name: String,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    /// 1 to 16384.
    #[serde(rename = "sizeGiB")]
    #[schemars(range(min = decide::SANDBOX_VOLUME_SIZE_MIN_GIB, max = decide::SANDBOX_VOLUME_SIZE_MAX_GIB))]
    size_gib: u64,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxVolumeIdText")]
    volume_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumesResize {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxVolumeIdText")]
    volume_id: String,
    /// Larger than its size now, at most 16384.
    #[serde(rename = "sizeGiB")]
    #[schemars(range(min = decide::SANDBOX_VOLUME_SIZE_MIN_GIB, max = decide::SANDBOX_VOLUME_SIZE_MAX_GIB))]
    size_gib: u64,
}

/// Whose volumes a list shows.
#[derive(Clone, Copy, Default, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum VolumeScope {
    /// The caller's own (made with its key).
    #[default]
    Own,
    /// Every volume of the tenant.
    All,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumesList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// `own` (the default: the volumes made with the caller's key) or `all`.
    #[serde(default)]
    scope: VolumeScope,
    /// Only this pool's volumes (a filtered page can come back short).
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
    /// Deleted volumes too (by default only those not yet deleted).
    #[serde(default)]
    deleted: bool,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

fn command_id(call: &Call<'_>) -> String {
    CommandId::from_ulid(call.state.log.ids.ulid()).to_string()
}

pub(super) async fn volume_doc(call: &Call<'_>, tenant: TenantId, id: &str) -> Result<SandboxVolumeDoc> {
    let id: SandboxVolumeId = parse_id("volumeId", id)?;
    call.row(tenant, KIND_SANDBOX_VOLUME, &id.to_string(), "sandbox volume").await
}

/// Every row of `kind` of the tenant, up to [`ROWS_READ_MAX`].
pub(super) async fn rows<T: serde::de::DeserializeOwned>(call: &Call<'_>, tenant: TenantId, kind: &str) -> Result<Vec<T>> {
    let rows = call.state.store.row_list(&tenant.to_string(), kind, None, ROWS_READ_MAX).await?;
    rows.into_iter().map(doc).collect()
}

async fn sandbox_volumes_create(call: &Call<'_>, input: SandboxVolumesCreate) -> Result<SandboxVolumeView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    let pool_id: PoolId = parse_id("poolId", &input.pool_id)?;
    decide::check_size(input.size_gib)?;
    let pool: PoolDoc = call.row(tenant, KIND_POOL, &pool_id.to_string(), "pool").await?;
    let retry = call.is_retry(tenant).await?;
    // Names are checked and taken, and the tenant's bound counted, under the tenant's names'
    // lock, as flavors', images' and secrets' are: two creates in this process cannot both find
    // a name free. (Across gateway processes the lock does not reach: see docs/sandboxes.md.)
    let _names = call.state.name_locks.lock(tenant).await;
    // A retry is answered from the log: its own name is taken by itself.
    let live: Vec<SandboxVolumeDoc> = if retry { Vec::new() } else { rows(call, tenant, KIND_SANDBOX_VOLUME_LIVE).await? };
    let nodes: Vec<NodeDoc> = rows(call, tenant, KIND_NODE).await?;
    let sandboxes: Vec<SandboxDoc> = rows(call, tenant, KIND_SANDBOX_LIVE).await?;
    let mut load: BTreeMap<String, usize> = BTreeMap::new();
    for s in &sandboxes {
        *load.entry(s.node_id.clone()).or_default() += 1;
    }
    let node = decide::volume_node(&nodes, &pool.pool_id, &load, &live, input.size_gib)?;
    if !retry {
        super::commands::check_node_queue(call, tenant, &node.node_id).await?;
    }
    let volume_id = SandboxVolumeId::from_ulid(call.ulid()).to_string();
    let command = command_id(call);
    let input =
        SandboxVolumeInput { volume_id: &volume_id, name: &input.name, pool: &pool, node, size_gib: input.size_gib, live: &live };
    let decided = decide::sandbox_volume_create(&input, Issue { command_id: &command, now_ms: call.now_ms() })?;
    let result = call.submit(call.decided(tenant, decided)).await?;
    let stream = &result.events[0].envelope.stream;
    Ok(volume_doc(call, tenant, super::call::stream_id(stream)).await?.into())
}

async fn sandbox_volumes_get(call: &Call<'_>, input: VolumeRef) -> Result<SandboxVolumeView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    Ok(volume_doc(call, tenant, &input.volume_id).await?.into())
}

async fn sandbox_volumes_list(call: &Call<'_>, input: SandboxVolumesList) -> Result<Page<SandboxVolumeView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool = input.pool_id.as_deref().map(|p| parse_id::<PoolId>("poolId", p)).transpose()?.map(|p| p.to_string());
    let owner = (input.scope == VolumeScope::Own).then(|| call.actor());
    let kind = if input.deleted { KIND_SANDBOX_VOLUME } else { KIND_SANDBOX_VOLUME_LIVE };
    list_rows(call, tenant, kind, input.limit, input.cursor.as_deref(), |row| {
        let v: SandboxVolumeDoc = doc(row)?;
        let shown = pool.as_deref().is_none_or(|p| p == v.pool_id) && owner.as_deref().is_none_or(|o| o == v.created_by);
        Ok(shown.then(|| v.into()))
    })
    .await
}

async fn sandbox_volumes_resize(call: &Call<'_>, input: SandboxVolumesResize) -> Result<SandboxVolumeView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    decide::check_size(input.size_gib)?;
    let volume = volume_doc(call, tenant, &input.volume_id).await?;
    let live: Vec<SandboxDoc> = rows(call, tenant, KIND_SANDBOX_LIVE).await?;
    // The node's volumes, for its disk's bound (a node is one tenant's, so the tenant's are all).
    let volumes: Vec<SandboxVolumeDoc> = rows(call, tenant, KIND_SANDBOX_VOLUME_LIVE).await?;
    let node: NodeDoc = call.row(tenant, KIND_NODE, &volume.node_id, "node").await?;
    if !call.is_retry(tenant).await? {
        super::commands::check_node_queue(call, tenant, &volume.node_id).await?;
    }
    let command = command_id(call);
    let disk = decide::NodeDisk { node: &node, volumes: &volumes };
    let decided = decide::sandbox_volume_resize(
        &volume,
        input.size_gib,
        &live,
        disk,
        Issue { command_id: &command, now_ms: call.now_ms() },
    )?;
    call.submit(call.decided(tenant, decided)).await?;
    Ok(volume_doc(call, tenant, &volume.volume_id).await?.into())
}

async fn sandbox_volumes_delete(call: &Call<'_>, input: VolumeRef) -> Result<SandboxVolumeView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let volume = volume_doc(call, tenant, &input.volume_id).await?;
    let live: Vec<SandboxDoc> = rows(call, tenant, KIND_SANDBOX_LIVE).await?;
    if !call.is_retry(tenant).await? {
        super::commands::check_node_queue(call, tenant, &volume.node_id).await?;
    }
    let command = command_id(call);
    let decided = decide::sandbox_volume_delete(&volume, &live, Issue { command_id: &command, now_ms: call.now_ms() })?;
    call.submit(call.decided(tenant, decided)).await?;
    Ok(volume_doc(call, tenant, &volume.volume_id).await?.into())
}

/// A volume report (`sandbox_volume.observed`, `.apply_failed`) from a node's journal must be
/// about a volume on that node, on the volume's stream; one that answers a command must answer
/// that node's `sandbox_volume.apply` for that volume. `Err(why)` refuses the entry.
pub(crate) async fn check_volume_report(
    store: &dyn bc_core::store::EventStore,
    tenant: TenantId,
    node: &str,
    subject: &str,
    payload: &serde_json::Value,
) -> Result<std::result::Result<(), String>> {
    use bc_projections::events::{SANDBOX_VOLUME_OBSERVED, SandboxVolumeReport};
    use bc_projections::sandbox_volume::SANDBOX_VOLUME_APPLY;
    let report: SandboxVolumeReport = match serde_json::from_value(payload.clone()) {
        Ok(r) => r,
        Err(e) => return Ok(Err(format!("the payload of a sandbox volume report: {e}"))),
    };
    let shape_ok = report.journal.is_none()
        && report.node_id == node
        && report.volume_id.parse::<SandboxVolumeId>().is_ok()
        && subject == bc_projections::stream_of(KIND_SANDBOX_VOLUME, &report.volume_id)
        && report.command_id.as_deref().is_some_and(|c| c.parse::<CommandId>().is_ok())
        && report.reason.as_ref().is_none_or(|r| r.len() <= crate::agents::session::REASON_BYTES_MAX)
        && report.state.as_deref().is_none_or(|s| matches!(s, "ready" | "absent"))
        && report.size_gib.is_none_or(|s| s <= decide::SANDBOX_VOLUME_SIZE_MAX_GIB);
    if !shape_ok {
        return Ok(Err(format!(
            "a sandbox volume report names this node, one of its volumes and the command it answers, on the volume's stream ({SANDBOX_VOLUME_OBSERVED}: with a state)"
        )));
    }
    let volume = store.row_get(&tenant.to_string(), KIND_SANDBOX_VOLUME, &report.volume_id).await?;
    let volume: Option<SandboxVolumeDoc> = volume.map(doc).transpose()?;
    if volume.is_none_or(|v| v.node_id != node) {
        return Ok(Err(format!("sandbox volume {} is not on this node", report.volume_id)));
    }
    if let Some(command_id) = &report.command_id {
        let command = store.row_get(&tenant.to_string(), bc_projections::KIND_COMMAND, command_id).await?;
        let command: Option<bc_projections::CommandDoc> = command.map(doc).transpose()?;
        let answers = command.is_some_and(|c| {
            c.node_id == node
                && c.kind == SANDBOX_VOLUME_APPLY
                && c.args.get("volumeId").and_then(|i| i.as_str()) == Some(&report.volume_id)
        });
        if !answers {
            return Ok(Err(format!(
                "command {command_id} is not this node's sandbox_volume.apply for volume {}",
                report.volume_id
            )));
        }
    }
    Ok(Ok(()))
}
