//! `sandboxes.snapshot` and `sandboxSnapshots.*`: a running sandbox's memory and disk saved on its
//! node by its agent (`runsc checkpoint`, through a `sandbox.snapshot` command), content-addressed
//! there by SHA-256; `sandboxes.create` with `fromSnapshotId` (in `api/sandboxes.rs`) starts a new
//! sandbox from one. Every change an event on `sandbox_snapshot/snap_…` (docs/sandboxes.md,
//! "Snapshots").
//!
//! A handler is parse, one decision (`bc_projections::decide::sandbox_snapshot`), append, view.
//! The node's answers come back from its journal ([`check_snapshot_report`]).

use bc_core::Result;
use bc_core::id::{CommandId, SandboxId, SandboxSnapshotId, TenantId};
use bc_projections::decide::sandbox_snapshot::{self as decide, SnapshotInput};
use bc_projections::placement::Issue;
use bc_projections::sandbox::{KIND_SANDBOX, SandboxDoc};
use bc_projections::sandbox_snapshot::{
    KIND_SANDBOX_SNAPSHOT, KIND_SANDBOX_SNAPSHOT_LIVE, SandboxSnapshotDoc, SandboxSnapshotState,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::body::parse_id;
use super::call::doc;
use super::paging::{Page, list_rows};
use super::sandbox_volumes::rows;
use super::validate::{
    CommandIdText, CursorText, LimitNumber, NodeIdText, PoolIdText, SandboxIdText, SandboxSnapshotIdText, SandboxTemplateIdText,
    TenantIdText,
};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:sandboxes:read");
const WRITE: Access = Access::Action("compute:sandboxes:write");

pub(super) const METHODS: &[Method] = &[
    method!(
        "sandboxes.snapshot",
        WRITE,
        "save a running sandbox's memory and disk on its node (content-addressed by SHA-256); keep: outlive the sandbox",
        SandboxesSnapshot => SandboxSnapshotView,
        sandboxes_snapshot,
    ),
    method!("sandboxSnapshots.get", READ, "one sandbox snapshot, with its state, digest and size", SnapshotRef => SandboxSnapshotView, snapshots_get),
    method!(
        "sandboxSnapshots.list",
        READ,
        "the caller's sandbox snapshots (scope all: every one of the tenant), paged by cursor",
        SandboxSnapshotsList => Page<SandboxSnapshotView>,
        snapshots_list,
    ),
    method!("sandboxSnapshots.delete", WRITE, "delete a snapshot and its files from its node", SnapshotRef => SandboxSnapshotView, snapshots_delete),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxesSnapshot {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxIdText")]
    sandbox_id: String,
    /// The disk alone, without the processes' memory: refused (`UNSUPPORTED`, `no-memory`) on
    /// this runtime, where the disk layer lives in memory.
    #[serde(default)]
    no_memory: bool,
    /// Outlive the sandbox (otherwise deleted with it).
    #[serde(default)]
    keep: bool,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SnapshotRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxSnapshotIdText")]
    snapshot_id: String,
}

/// Whose snapshots a list shows.
#[derive(Clone, Copy, Default, Deserialize, JsonSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotScope {
    /// The caller's own.
    #[default]
    Own,
    /// Every snapshot of the tenant.
    All,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxSnapshotsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// `own` (the default) or `all`.
    #[serde(default)]
    scope: SnapshotScope,
    /// Only this sandbox's snapshots (a filtered page can come back short).
    #[schemars(with = "Option<SandboxIdText>")]
    sandbox_id: Option<String>,
    /// Deleted snapshots too.
    #[serde(default)]
    deleted: bool,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSnapshotApplyView {
    #[schemars(with = "CommandIdText")]
    pub command_id: String,
    /// `ready` or `deleted`.
    pub desired: String,
    pub deadline_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSnapshotView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "SandboxSnapshotIdText")]
    pub snapshot_id: String,
    /// The sandbox it was taken of.
    #[schemars(with = "SandboxIdText")]
    pub sandbox_id: String,
    #[schemars(with = "SandboxTemplateIdText")]
    pub template_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    /// The node that holds its files: restores run there.
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    /// With the processes' memory.
    pub memory: bool,
    /// Outlives its sandbox.
    pub keep: bool,
    /// `taking`, `ready`, `failed`, `deleting` or `deleted`.
    pub state: SandboxSnapshotState,
    /// The SHA-256 of its files' manifest, once taken: a restore is checked against it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Its size once taken; until then, the sandbox's memory.
    pub bytes: u64,
    pub created_by: String,
    pub apply: SandboxSnapshotApplyView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<SandboxSnapshotDoc> for SandboxSnapshotView {
    fn from(d: SandboxSnapshotDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            snapshot_id: d.snapshot_id,
            sandbox_id: d.sandbox_id,
            template_id: d.template_id,
            pool_id: d.pool_id,
            node_id: d.node_id,
            memory: d.memory,
            keep: d.keep,
            state: d.state,
            sha256: d.sha256,
            bytes: d.bytes,
            created_by: d.created_by,
            apply: SandboxSnapshotApplyView {
                command_id: d.apply.command_id,
                desired: d.apply.desired,
                deadline_at_ms: d.apply.deadline_at_ms,
                answered_at_ms: d.apply.answered_at_ms,
            },
            last_error: d.last_error,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

fn command_id(call: &Call<'_>) -> String {
    CommandId::from_ulid(call.state.log.ids.ulid()).to_string()
}

pub(super) async fn snapshot_doc(call: &Call<'_>, tenant: TenantId, id: &str) -> Result<SandboxSnapshotDoc> {
    let id: SandboxSnapshotId = parse_id("snapshotId", id)?;
    call.row(tenant, KIND_SANDBOX_SNAPSHOT, &id.to_string(), "sandbox snapshot").await
}

async fn sandboxes_snapshot(call: &Call<'_>, input: SandboxesSnapshot) -> Result<SandboxSnapshotView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let sandbox_id: SandboxId = parse_id("sandboxId", &input.sandbox_id)?;
    let sandbox: SandboxDoc = call.row(tenant, KIND_SANDBOX, &sandbox_id.to_string(), "sandbox").await?;
    let retry = call.is_retry(tenant).await?;
    // Counted under the tenant's names' lock, as volumes are: two snapshots in this process
    // cannot both take the last room.
    let _names = call.state.name_locks.lock(tenant).await;
    // A retry is answered from the log: its own snapshot is counted already.
    let snapshots: Vec<SandboxSnapshotDoc> =
        if retry { Vec::new() } else { rows(call, tenant, KIND_SANDBOX_SNAPSHOT_LIVE).await? };
    if !retry {
        super::commands::check_node_queue(call, tenant, &sandbox.node_id).await?;
    }
    let snapshot_id = SandboxSnapshotId::from_ulid(call.ulid()).to_string();
    let command = command_id(call);
    let input = SnapshotInput {
        snapshot_id: &snapshot_id,
        sandbox: &sandbox,
        memory: !input.no_memory,
        keep: input.keep,
        snapshots: &snapshots,
    };
    let decided = decide::snapshot_create(&input, Issue { command_id: &command, now_ms: call.now_ms() })?;
    let result = call.submit(call.decided(tenant, decided)).await?;
    let stream = &result.events[0].envelope.stream;
    Ok(snapshot_doc(call, tenant, super::call::stream_id(stream)).await?.into())
}

async fn snapshots_get(call: &Call<'_>, input: SnapshotRef) -> Result<SandboxSnapshotView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    Ok(snapshot_doc(call, tenant, &input.snapshot_id).await?.into())
}

async fn snapshots_list(call: &Call<'_>, input: SandboxSnapshotsList) -> Result<Page<SandboxSnapshotView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let sandbox = input.sandbox_id.as_deref().map(|s| parse_id::<SandboxId>("sandboxId", s)).transpose()?.map(|s| s.to_string());
    let owner = (input.scope == SnapshotScope::Own).then(|| call.actor());
    let kind = if input.deleted { KIND_SANDBOX_SNAPSHOT } else { KIND_SANDBOX_SNAPSHOT_LIVE };
    list_rows(call, tenant, kind, input.limit, input.cursor.as_deref(), |row| {
        let s: SandboxSnapshotDoc = doc(row)?;
        let shown = sandbox.as_deref().is_none_or(|id| id == s.sandbox_id) && owner.as_deref().is_none_or(|o| o == s.created_by);
        Ok(shown.then(|| s.into()))
    })
    .await
}

async fn snapshots_delete(call: &Call<'_>, input: SnapshotRef) -> Result<SandboxSnapshotView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let snapshot = snapshot_doc(call, tenant, &input.snapshot_id).await?;
    if !call.is_retry(tenant).await? {
        super::commands::check_node_queue(call, tenant, &snapshot.node_id).await?;
    }
    let command = command_id(call);
    let decided = decide::snapshot_delete(&snapshot, None, Issue { command_id: &command, now_ms: call.now_ms() })?;
    call.submit(call.decided(tenant, decided)).await?;
    Ok(snapshot_doc(call, tenant, &snapshot.snapshot_id).await?.into())
}

/// A snapshot report (`sandbox_snapshot.observed`, `.apply_failed`) from a node's journal must be
/// about a snapshot on that node, on the snapshot's stream, answering that node's
/// `sandbox.snapshot` for it. `Err(why)` refuses the entry.
pub(crate) async fn check_snapshot_report(
    store: &dyn bc_core::store::EventStore,
    tenant: TenantId,
    node: &str,
    subject: &str,
    payload: &serde_json::Value,
) -> Result<std::result::Result<(), String>> {
    use bc_projections::events::SandboxSnapshotReport;
    use bc_projections::sandbox_snapshot::SANDBOX_SNAPSHOT_APPLY;
    let report: SandboxSnapshotReport = match serde_json::from_value(payload.clone()) {
        Ok(r) => r,
        Err(e) => return Ok(Err(format!("the payload of a sandbox snapshot report: {e}"))),
    };
    let digest_ok = report
        .sha256
        .as_deref()
        .is_none_or(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    let shape_ok = report.journal.is_none()
        && report.node_id == node
        && report.snapshot_id.parse::<SandboxSnapshotId>().is_ok()
        && subject == bc_projections::stream_of(KIND_SANDBOX_SNAPSHOT, &report.snapshot_id)
        && report.command_id.as_deref().is_some_and(|c| c.parse::<CommandId>().is_ok())
        && report.reason.as_ref().is_none_or(|r| r.len() <= crate::agents::session::REASON_BYTES_MAX)
        && report.state.as_deref().is_none_or(|s| matches!(s, "ready" | "absent"))
        && digest_ok;
    if !shape_ok {
        return Ok(Err(
            "a sandbox snapshot report names this node, one of its snapshots and the command it answers, on the snapshot's stream"
                .into(),
        ));
    }
    let snapshot = store.row_get(&tenant.to_string(), KIND_SANDBOX_SNAPSHOT, &report.snapshot_id).await?;
    let snapshot: Option<SandboxSnapshotDoc> = snapshot.map(doc).transpose()?;
    if snapshot.is_none_or(|s| s.node_id != node) {
        return Ok(Err(format!("sandbox snapshot {} is not on this node", report.snapshot_id)));
    }
    if let Some(command_id) = &report.command_id {
        let command = store.row_get(&tenant.to_string(), bc_projections::KIND_COMMAND, command_id).await?;
        let command: Option<bc_projections::CommandDoc> = command.map(doc).transpose()?;
        let answers = command.is_some_and(|c| {
            c.node_id == node
                && c.kind == SANDBOX_SNAPSHOT_APPLY
                && c.args.get("snapshotId").and_then(|i| i.as_str()) == Some(&report.snapshot_id)
        });
        if !answers {
            return Ok(Err(format!(
                "command {command_id} is not this node's sandbox.snapshot for snapshot {}",
                report.snapshot_id
            )));
        }
    }
    Ok(Ok(()))
}

/// `sandboxes.create` with `fromSnapshotId`: a new sandbox of `template` (cold, never a warm one)
/// restored from the snapshot on the node that holds it, within the tenant's and the node's
/// bounds of sandboxes.
pub(super) async fn create_from_snapshot(
    call: &Call<'_>,
    tenant: TenantId,
    template: &bc_projections::sandbox::SandboxTemplateDoc,
    ttl_s: u64,
    snapshot_id: &str,
    admission: &bc_projections::decide::sandbox::SandboxAdmission<'_>,
) -> Result<SandboxDoc> {
    use bc_projections::decide::sandbox as decide_sandbox;
    use bc_projections::sandbox::KIND_SANDBOX_LIVE;
    let snapshot = snapshot_doc(call, tenant, snapshot_id).await?;
    let retry = call.is_retry(tenant).await?;
    let live: Vec<SandboxDoc> = rows(call, tenant, KIND_SANDBOX_LIVE).await?;
    let nodes: Vec<bc_projections::NodeDoc> = rows(call, tenant, bc_projections::KIND_NODE).await?;
    let node = decide::restore_node(&snapshot, template, &nodes)?;
    if !retry {
        if live.len() >= decide_sandbox::SANDBOXES_PER_TENANT_MAX {
            return Err(bc_core::Error::QuotaExceeded(format!(
                "the tenant has {} live sandboxes, the most it may ({}); delete some first",
                live.len(),
                decide_sandbox::SANDBOXES_PER_TENANT_MAX
            )));
        }
        let mut load = std::collections::BTreeMap::new();
        for s in &live {
            *load.entry(s.node_id.clone()).or_default() += 1;
        }
        decide_sandbox::check_node_room(&node.node_id, &load)?;
        super::commands::check_node_queue(call, tenant, &node.node_id).await?;
    }
    let sandbox_id = SandboxId::from_ulid(call.ulid()).to_string();
    let command = command_id(call);
    let restore = bc_projections::sandbox_snapshot::SandboxRestore {
        snapshot_id: snapshot.snapshot_id.clone(),
        // `restore_node` checked it is there.
        sha256: snapshot.sha256.clone().unwrap_or_default(),
    };
    let issue = Issue { command_id: &command, now_ms: call.now_ms() };
    let decided =
        decide_sandbox::sandbox_create_from(template, &sandbox_id, node, Some(ttl_s), issue, &[], &[], Some(&restore), admission);
    let adding = decide_sandbox::sandbox_use(template);
    let decided = super::quotas::recording_refusal(call, tenant, admission.quota.as_ref(), &adding, &sandbox_id, decided).await?;
    let result = call.submit(call.decided(tenant, decided)).await?;
    let stream = &result.events[0].envelope.stream;
    call.row(tenant, KIND_SANDBOX, super::call::stream_id(stream), "sandbox").await
}
