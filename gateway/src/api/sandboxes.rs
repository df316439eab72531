//! `sandboxTemplates.*` and `sandboxes.*`: isolated, short-lived machines made from templates,
//! run by a node's sandbox runtime (gVisor's `runsc`), each change an event on the sandbox's
//! stream (docs/sandboxes.md).
//!
//! A handler is parse, one decision (`bc_projections::decide::sandbox`), append, view.
//! `sandboxes.create` hands out a warm sandbox of the template when one is running (one append,
//! `sandbox.claimed`) and makes a cold one on the least loaded node of the pool that runs
//! sandboxes otherwise (`sandbox.created` with its `sandbox.apply`); the answer says which
//! (`claimed`: `warm` or `cold`). `sandboxes.exec` grants a single-use ticket for an `exec`
//! tunnel (`GET /tunnels/{ticket}`, schema/TUNNELS.md) whose node's agent runs the command in the
//! sandbox. The node's answers come back from its journal ([`check_sandbox_report`]).

use std::collections::BTreeMap;

use bc_core::id::{CommandId, FlavorId, PoolId, SandboxId, SandboxTemplateId, SandboxVolumeId, TenantId};
use bc_core::{Error, Result};
use bc_projections::decide::sandbox::{self as decide, SANDBOXES_PER_TENANT_MAX, SandboxExecInput, SandboxTemplateInput};
use bc_projections::decide::sandbox_volume::{self as decide_volume, SANDBOX_TEMPLATE_VOLUMES_MAX};
use bc_projections::events::VolumeMount;
use bc_projections::placement::Issue;
use bc_projections::sandbox::{KIND_SANDBOX, KIND_SANDBOX_LIVE, KIND_SANDBOX_TEMPLATE, SandboxDoc, SandboxTemplateDoc};
use bc_projections::sandbox_volume::{KIND_SANDBOX_VOLUME_LIVE, SandboxVolumeDoc};
use bc_projections::{FlavorDoc, ImageDoc, KIND_FLAVOR, KIND_NODE, KIND_POOL, NodeDoc, PoolDoc};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::doc;
use super::paging::{Page, list_rows};
use super::validate::{
    CursorText, FlavorIdText, ImageIdText, LimitNumber, NameText, PoolIdText, SandboxIdText, SandboxTemplateIdText, TenantIdText,
    VersionNumber, validate_name,
};
use super::views::{SandboxCreatedView, SandboxTemplateView, SandboxView, SandboxWarmth};
use super::{Access, Call, Method, method};
use crate::app::reservations::QUOTA_RACE_ATTEMPTS;

const READ: Access = Access::Action("compute:sandboxes:read");
const WRITE: Access = Access::Action("compute:sandboxes:write");
const MANAGE: Access = Access::Action("compute:sandboxes:manage");
super::validate::string_schema!(/// A sandbox template's environment: variable names (a letter or `_`, then letters, digits
/// and `_`, at most 128 bytes) to values without a NUL byte; at most 32 variables and 16 KiB in
/// all (`decide::check_env`, which the schema states as far as JSON Schema can).
SandboxEnv, schemars::json_schema!({
    "type": "object",
    "maxProperties": decide::SANDBOX_ENV_VARS_MAX,
    "propertyNames": { "pattern": "^[A-Za-z_][A-Za-z0-9_]{0,127}$" },
    "additionalProperties": { "type": "string", "pattern": "^[^\\u0000]*$" }
}));

/// The action an `exec` into a sandbox is decided as (and rechecked as while it lasts).
pub const ACTION_SANDBOX_EXEC: &str = "compute:sandboxes:exec";
/// Rows read at most when counting a tenant's live sandboxes or nodes.
const ROWS_READ_MAX: u32 = 1000;

pub(super) const METHODS: &[Method] = &[
    method!(
        "sandboxTemplates.create",
        MANAGE,
        "a sandbox template: a pool, a flavor, a root-filesystem image (rootfs-tar), env, TTL bounds, a warm pool",
        SandboxTemplatesCreate => SandboxTemplateView,
        sandbox_templates_create,
    ),
    method!(
        "sandboxTemplates.update",
        MANAGE,
        "change a template's name, warm pool, TTLs or environment in place (claimed sandboxes keep theirs)",
        SandboxTemplatesUpdate => SandboxTemplateView,
        sandbox_templates_update,
    ),
    method!("sandboxTemplates.get", READ, "one sandbox template", TemplateRef => SandboxTemplateView, sandbox_templates_get),
    method!("sandboxTemplates.list", READ, "a tenant's sandbox templates, paged by cursor", ListInput => Page<SandboxTemplateView>, sandbox_templates_list),
    method!(
        "sandboxTemplates.delete",
        MANAGE,
        "delete a sandbox template (its warm sandboxes go; claimed ones live to their end)",
        TemplateRef => SandboxTemplateView,
        sandbox_templates_delete,
    ),
    method!(
        "sandboxes.create",
        WRITE,
        "a sandbox of a template: a warm one claimed when one is running, else started cold on a node of its pool",
        SandboxesCreate => SandboxCreatedView,
        sandboxes_create,
    ),
    method!("sandboxes.get", READ, "one sandbox, with its state and end", SandboxRef => SandboxView, sandboxes_get),
    method!("sandboxes.list", READ, "a tenant's sandboxes, paged by cursor", SandboxesList => Page<SandboxView>, sandboxes_list),
    method!(
        "sandboxes.extend",
        WRITE,
        "a later end for a sandbox, within its template's maxTtlS from its start",
        SandboxesExtend => SandboxView,
        sandboxes_extend,
    ),
    method!("sandboxes.delete", WRITE, "delete a sandbox from its node", SandboxRef => SandboxView, sandboxes_delete),
    method!(
        "sandboxes.exec",
        // Decided in the handler as `compute:sandboxes:exec` in the tenant named.
        Access::Authenticated,
        "a single-use ticket for an exec tunnel running a command in a sandbox (GET /tunnels/{ticket}, schema/TUNNELS.md)",
        SandboxesExec => super::tunnels::TunnelTicketView,
        sandboxes_exec,
    ),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxTemplatesCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NameText")]
    name: String,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    /// A flavor of the pool: its vCPUs and memory bound each sandbox.
    #[schemars(with = "FlavorIdText")]
    flavor_id: String,
    /// A registered image of disk format `rootfs-tar`, by id; or, instead, by channel (`image`).
    #[schemars(with = "Option<ImageIdText>")]
    image_id: Option<String>,
    /// The image by channel: `NAME@stable` or `NAME@testing`, the newest image of that name in
    /// that channel now (the template records the image it resolved to). Exactly one of
    /// `imageId` and `image`.
    #[schemars(with = "Option<super::images::ImageChannelRefText>")]
    image: Option<String>,
    /// Sandboxes kept started and unclaimed (0 to 64).
    #[schemars(range(min = 0, max = 64))]
    warm_min: Option<u32>,
    /// A sandbox's life when its create names none (5 s to `maxTtlS`; default 30 min).
    #[schemars(range(min = decide::SANDBOX_TTL_MIN_S, max = decide::SANDBOX_TTL_MAX_S))]
    default_ttl_s: Option<u64>,
    /// The longest a sandbox may live from its start, extensions included (5 s to 24 h).
    #[schemars(range(min = decide::SANDBOX_TTL_MIN_S, max = decide::SANDBOX_TTL_MAX_S))]
    max_ttl_s: Option<u64>,
    /// The environment every command in its sandboxes gets (at most 32 variables, 16 KiB).
    #[serde(default)]
    #[schemars(with = "SandboxEnv")]
    env: BTreeMap<String, String>,
    /// `none` (the default and, so far, the only policy).
    network: Option<String>,
    /// The volumes every sandbox mounts, in order (at most 8, all on one node; a template with
    /// volumes keeps no warm pool: `warmMin` 0).
    #[serde(default)]
    volumes: Vec<VolumeMountInput>,
}

/// A volume a template's sandboxes mount: the volume by `name` or by `volumeId` (exactly one),
/// at `path`, an absolute path inside the sandbox.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeMountInput {
    #[schemars(with = "Option<NameText>")]
    name: Option<String>,
    #[schemars(with = "Option<super::validate::SandboxVolumeIdText>")]
    volume_id: Option<String>,
    /// Absolute, at most 256 bytes, not under /proc, /dev, /sys or /tmp.
    #[schemars(length(min = 2, max = bc_projections::decide::sandbox_volume::SANDBOX_VOLUME_PATH_BYTES_MAX))]
    path: String,
    /// Mounted read-only.
    #[serde(default)]
    read_only: bool,
}

/// At least one of `name`, `warmMin`, `defaultTtlS`, `maxTtlS`, `env`, not `null`. Its pool,
/// flavor, image and network do not change in place: make another template.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("anyOf" = [
    { "required": ["name"], "properties": { "name": { "type": "string" } } },
    { "required": ["warmMin"], "properties": { "warmMin": { "type": "integer" } } },
    { "required": ["defaultTtlS"], "properties": { "defaultTtlS": { "type": "integer" } } },
    { "required": ["maxTtlS"], "properties": { "maxTtlS": { "type": "integer" } } },
    { "required": ["env"], "properties": { "env": { "type": "object" } } },
    { "required": ["volumes"], "properties": { "volumes": { "type": "array" } } },
]))]
pub struct SandboxTemplatesUpdate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxTemplateIdText")]
    template_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    #[schemars(with = "Option<NameText>")]
    name: Option<String>,
    /// Sandboxes kept started and unclaimed (0 to 64); lowered, the newest warm ones go.
    #[schemars(range(min = 0, max = 64))]
    warm_min: Option<u32>,
    /// 5 s to `maxTtlS` (the new one when both change).
    #[schemars(range(min = decide::SANDBOX_TTL_MIN_S, max = decide::SANDBOX_TTL_MAX_S))]
    default_ttl_s: Option<u64>,
    /// 5 s to 24 h, and at least `defaultTtlS`; sandboxes already made keep their end, and an
    /// extension is bounded by the new maximum.
    #[schemars(range(min = decide::SANDBOX_TTL_MIN_S, max = decide::SANDBOX_TTL_MAX_S))]
    max_ttl_s: Option<u64>,
    /// The environment from now on, replacing the old whole; warm sandboxes made with the old one
    /// are replaced, claimed ones keep it.
    #[schemars(with = "Option<SandboxEnv>")]
    env: Option<BTreeMap<String, String>>,
    /// The volumes from now on, replacing the old whole (`[]`: none); with volumes the
    /// template's `warmMin` must be 0.
    volumes: Option<Vec<VolumeMountInput>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxTemplateIdText")]
    template_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListInput {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxesCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxTemplateIdText")]
    template_id: String,
    /// Its life in seconds (the template's `defaultTtlS` when absent; at most its `maxTtlS`).
    #[schemars(range(min = decide::SANDBOX_TTL_MIN_S, max = decide::SANDBOX_TTL_MAX_S))]
    ttl_s: Option<u64>,
    /// Start it from this snapshot of a sandbox of the template (`runsc restore`, on the node
    /// that holds it, checked against its SHA-256 first): a new sandbox, with its own id.
    #[schemars(with = "Option<super::validate::SandboxSnapshotIdText>")]
    from_snapshot_id: Option<String>,
    /// The asking tenant's live project it is made in (`projects.*`): a warm sandbox claimed
    /// takes it, a cold one is made in it.
    #[schemars(with = "Option<super::validate::ProjectIdText>")]
    project_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxIdText")]
    sandbox_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxesList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Only this template's sandboxes (a filtered page can come back short).
    #[schemars(with = "Option<SandboxTemplateIdText>")]
    template_id: Option<String>,
    /// Only the sandboxes made or claimed in this project (a filtered page can come back short).
    #[schemars(with = "Option<super::validate::ProjectIdText>")]
    project_id: Option<String>,
    /// Deleted sandboxes too (by default only live ones).
    #[serde(default)]
    deleted: bool,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

/// Exactly one of `bySeconds` and `untilMs`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxesExtend {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxIdText")]
    sandbox_id: String,
    /// Seconds added to its end.
    by_s: Option<u64>,
    /// Its new end, Unix ms.
    until_ms: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxesExec {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SandboxIdText")]
    sandbox_id: String,
    /// The program and its arguments (at most 256 of 64 KiB together), run with the template's
    /// environment.
    command: Vec<String>,
}

fn command_id(call: &Call<'_>) -> String {
    CommandId::from_ulid(call.state.log.ids.ulid()).to_string()
}

async fn template_doc(call: &Call<'_>, tenant: TenantId, id: &str) -> Result<SandboxTemplateDoc> {
    let id: SandboxTemplateId = parse_id("templateId", id)?;
    call.row(tenant, KIND_SANDBOX_TEMPLATE, &id.to_string(), "sandbox template").await
}

async fn sandbox_doc(call: &Call<'_>, tenant: TenantId, id: &str) -> Result<SandboxDoc> {
    let id: SandboxId = parse_id("sandboxId", id)?;
    call.row(tenant, KIND_SANDBOX, &id.to_string(), "sandbox").await
}

/// Every row of `kind` of the tenant, up to [`ROWS_READ_MAX`].
async fn rows<T: serde::de::DeserializeOwned>(call: &Call<'_>, tenant: TenantId, kind: &str) -> Result<Vec<T>> {
    let rows = call.state.store.row_list(&tenant.to_string(), kind, None, ROWS_READ_MAX).await?;
    rows.into_iter().map(doc).collect()
}

/// The volumes `inputs` name, each found among the tenant's volumes not yet deleted by id or by
/// name, and those volumes' documents.
async fn volume_mounts(
    call: &Call<'_>,
    tenant: TenantId,
    inputs: &[VolumeMountInput],
) -> Result<(Vec<VolumeMount>, Vec<SandboxVolumeDoc>)> {
    if inputs.is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    if inputs.len() > SANDBOX_TEMPLATE_VOLUMES_MAX {
        return Err(Error::invalid(format!(
            "{} volumes, more than the {SANDBOX_TEMPLATE_VOLUMES_MAX} a template mounts",
            inputs.len()
        )));
    }
    let live: Vec<SandboxVolumeDoc> = rows(call, tenant, KIND_SANDBOX_VOLUME_LIVE).await?;
    let mut mounts = Vec::with_capacity(inputs.len());
    for m in inputs {
        bc_projections::decide::sandbox_volume::check_mount_path(&m.path)?;
        let found = match (&m.volume_id, &m.name) {
            (Some(id), None) => {
                let id: SandboxVolumeId = parse_id("volumes[].volumeId", id)?;
                let id = id.to_string();
                live.iter().find(|v| v.volume_id == id).ok_or_else(|| Error::not_found(format!("sandbox volume {id}")))?
            }
            (None, Some(name)) => {
                validate_name("volumes[].name", name)?;
                live.iter().find(|v| &v.name == name).ok_or_else(|| Error::not_found(format!("sandbox volume named {name}")))?
            }
            _ => return Err(Error::invalid("each of volumes names its volume by exactly one of name and volumeId")),
        };
        mounts.push(VolumeMount { volume_id: found.volume_id.clone(), path: m.path.clone(), read_only: m.read_only });
    }
    Ok((mounts, live))
}

async fn sandbox_templates_create(call: &Call<'_>, input: SandboxTemplatesCreate) -> Result<SandboxTemplateView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    let pool_id: PoolId = parse_id("poolId", &input.pool_id)?;
    let flavor_id: FlavorId = parse_id("flavorId", &input.flavor_id)?;
    decide::check_env(&input.env)?;
    // Secret references in the environment are checked, and the template made, under the names'
    // lock a secret's delete takes, so a delete cannot pass between the two; so is the tenant's
    // sum of warmMin, so two creates in this process cannot both take its last room.
    let warm_min = input.warm_min.unwrap_or(0);
    let _names = match warm_min > 0 || input.env.values().any(|v| super::secrets::is_secret_ref(v)) {
        true => Some(call.state.name_locks.lock(tenant).await),
        false => None,
    };
    let template_id = SandboxTemplateId::from_ulid(call.ulid()).to_string();
    if warm_min > 0 {
        let templates: Vec<SandboxTemplateDoc> = rows(call, tenant, KIND_SANDBOX_TEMPLATE).await?;
        decide::check_tenant_warm(&templates, &template_id, warm_min)?;
    }
    let env = super::secrets::env_refs_checked(call, tenant, &input.env).await?;
    let pool: PoolDoc = call.row(tenant, KIND_POOL, &pool_id.to_string(), "pool").await?;
    let flavor: FlavorDoc = call.row(tenant, KIND_FLAVOR, &flavor_id.to_string(), "flavor").await?;
    let image: ImageDoc = super::images::image_named(call, tenant, input.image_id.as_deref(), input.image.as_deref()).await?;
    let (volumes, volume_docs) = volume_mounts(call, tenant, &input.volumes).await?;
    let decided = decide::sandbox_template_create(&SandboxTemplateInput {
        template_id: &template_id,
        name: &input.name,
        pool: &pool,
        flavor: &flavor,
        image: &image,
        warm_min,
        default_ttl_s: input.default_ttl_s,
        max_ttl_s: input.max_ttl_s,
        env: &env,
        network: input.network.as_deref(),
        volumes: &volumes,
        volume_docs: &volume_docs,
    })?;
    let result = call.submit(call.decided(tenant, decided)).await?;
    let stream = &result.events[0].envelope.stream;
    let doc: SandboxTemplateDoc =
        call.row(tenant, KIND_SANDBOX_TEMPLATE, super::call::stream_id(stream), "sandbox template").await?;
    Ok(doc.into())
}

async fn sandbox_templates_update(call: &Call<'_>, input: SandboxTemplatesUpdate) -> Result<SandboxTemplateView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    if let Some(name) = &input.name {
        validate_name("name", name)?;
    }
    super::call::check_if_version(input.if_version)?;
    let template = template_doc(call, tenant, &input.template_id).await?;
    // A retry is answered from the log (the append replays it, or the template already is what
    // it asked), though the version it stated is the one its first attempt moved on from.
    let retry = call.is_retry(tenant).await?;
    if !retry {
        let stream = bc_projections::stream_of(KIND_SANDBOX_TEMPLATE, &template.template_id);
        super::call::expected_version(input.if_version, template.version, &stream)?;
    }
    let volumes = match &input.volumes {
        Some(inputs) => {
            let (mounts, docs) = volume_mounts(call, tenant, inputs).await?;
            // The warm pool is checked with the volumes by the update's decision.
            decide_volume::check_template_volumes(&template.pool_id, 0, &mounts, &docs)?;
            Some(mounts)
        }
        None => None,
    };
    let raises_warm = input.warm_min.is_some_and(|w| w > template.warm_min);
    let _names = match raises_warm || input.env.as_ref().is_some_and(|env| env.values().any(|v| super::secrets::is_secret_ref(v)))
    {
        true => Some(call.state.name_locks.lock(tenant).await),
        false => None,
    };
    if let Some(warm_min) = input.warm_min.filter(|_| raises_warm && !retry) {
        let templates: Vec<SandboxTemplateDoc> = rows(call, tenant, KIND_SANDBOX_TEMPLATE).await?;
        decide::check_tenant_warm(&templates, &template.template_id, warm_min)?;
    }
    let env = match &input.env {
        Some(env) => Some(super::secrets::env_refs_checked(call, tenant, env).await?),
        None => None,
    };
    let change = bc_projections::events::SandboxTemplateUpdated {
        name: input.name,
        warm_min: input.warm_min,
        default_ttl_s: input.default_ttl_s,
        max_ttl_s: input.max_ttl_s,
        env,
        volumes,
    };
    if let Some(append) = decide::sandbox_template_update(&template, change)? {
        call.submit(call.decided(tenant, append)).await?;
    }
    Ok(template_doc(call, tenant, &template.template_id).await?.into())
}

async fn sandbox_templates_get(call: &Call<'_>, input: TemplateRef) -> Result<SandboxTemplateView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    Ok(template_doc(call, tenant, &input.template_id).await?.into())
}

async fn sandbox_templates_list(call: &Call<'_>, input: ListInput) -> Result<Page<SandboxTemplateView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    list_rows(call, tenant, KIND_SANDBOX_TEMPLATE, input.limit, input.cursor.as_deref(), |row| {
        let t: SandboxTemplateDoc = doc(row)?;
        Ok(Some(t.into()))
    })
    .await
}

async fn sandbox_templates_delete(call: &Call<'_>, input: TemplateRef) -> Result<SandboxTemplateView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let template = template_doc(call, tenant, &input.template_id).await?;
    call.submit(call.decided(tenant, decide::sandbox_template_delete(&template)?)).await?;
    Ok(template.into())
}

async fn sandboxes_create(call: &Call<'_>, input: SandboxesCreate) -> Result<SandboxCreatedView> {
    // Counted against the tenant's resource limits: decided again when another's work was
    // counted on the quota in between (a CONFLICT on its stream), never answered CONFLICT.
    crate::app::retry_on_quota_race(QUOTA_RACE_ATTEMPTS, |_| sandbox_create_once(call, &input)).await
}

async fn sandbox_create_once(call: &Call<'_>, input: &SandboxesCreate) -> Result<SandboxCreatedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let template = template_doc(call, tenant, &input.template_id).await?;
    let ttl_s = input.ttl_s.unwrap_or(template.default_ttl_s);
    decide::check_ttl("ttlS", ttl_s, template.max_ttl_s)?;
    // The project is the asking tenant's own and live (another tenant's NOT_FOUND, an archived
    // one INVALID_STATE), as for a reservation; the append guards it at the version read.
    let project = match &input.project_id {
        Some(project_id) => Some(super::projects::project_for_work(call, tenant, project_id).await?),
        None => None,
    };
    // The tenant's resource limits in the template's pool (none on a retry).
    let quota = super::quotas::quota_under(call, tenant, &template.pool_id).await?;
    let admission = decide::SandboxAdmission {
        project: project.as_ref(),
        quota: quota.as_ref().map(|(quota, in_use)| bc_projections::decide::quota::QuotaRead { quota, in_use: *in_use }),
    };
    if let Some(snapshot_id) = &input.from_snapshot_id {
        let sandbox =
            super::sandbox_snapshots::create_from_snapshot(call, tenant, &template, ttl_s, snapshot_id, &admission).await?;
        return Ok(SandboxCreatedView { claimed: SandboxWarmth::Cold, sandbox: sandbox.into() });
    }
    // What a sandbox of the template adds to the tenant's use (a refusal past a limit names it).
    let adding = decide::sandbox_use(&template);
    let retry = call.is_retry(tenant).await?;
    // A template with volumes runs its sandboxes on the volumes' node. The volumes are read
    // before the live sandboxes: a sandbox and its volumes' attachment land in one append, so
    // every attachment read here has its sandbox in the read after it, and a volume another
    // create has just mounted is seen mounted (read the other way round, that sandbox could be
    // missing from `live` while its attachment is not, and the volume would mount twice).
    let volumes: Vec<SandboxVolumeDoc> =
        if template.volumes.is_empty() { Vec::new() } else { rows(call, tenant, KIND_SANDBOX_VOLUME_LIVE).await? };
    let live: Vec<SandboxDoc> = rows(call, tenant, KIND_SANDBOX_LIVE).await?;
    let now_ms = call.now_ms();
    if !retry {
        if let Some(warm) = decide::warm_sandbox(&live, &template) {
            let decided = decide::sandbox_claim(&template, warm, ttl_s, now_ms, &admission);
            let decided =
                super::quotas::recording_refusal(call, tenant, admission.quota.as_ref(), &adding, &warm.sandbox_id, decided)
                    .await?;
            call.submit(call.decided(tenant, decided)).await?;
            let doc = sandbox_doc(call, tenant, &warm.sandbox_id).await?;
            return Ok(SandboxCreatedView { claimed: SandboxWarmth::Warm, sandbox: doc.into() });
        }
        if live.len() >= SANDBOXES_PER_TENANT_MAX {
            return Err(Error::QuotaExceeded(format!(
                "the tenant has {} live sandboxes, the most it may ({SANDBOXES_PER_TENANT_MAX}); delete some first",
                live.len()
            )));
        }
    }
    let nodes: Vec<NodeDoc> = rows(call, tenant, KIND_NODE).await?;
    let mut load: BTreeMap<String, usize> = BTreeMap::new();
    for s in &live {
        *load.entry(s.node_id.clone()).or_default() += 1;
    }
    let node = match decide_volume::volumes_node(&template, &volumes)? {
        Some(node_id) => nodes
            .iter()
            .find(|n| n.node_id == node_id && decide::runs_sandboxes(n, &template.pool_id))
            .ok_or_else(|| {
                Error::state(
                    format!("node {node_id}, where the template's volumes are, is not a ready node that runs sandboxes"),
                    "wait until it is ready again; a volume stays on its node",
                )
            })
            .and_then(|node| decide::check_node_room(&node.node_id, &load).map(|()| node))?,
        // A node with room (SANDBOXES_PER_NODE_MAX), else QUOTA_EXCEEDED.
        None => decide::place_sandbox(&nodes, &template.pool_id, &load, None)?,
    };
    let sandbox_id = SandboxId::from_ulid(call.ulid()).to_string();
    if !retry {
        super::commands::check_node_queue(call, tenant, &node.node_id).await?;
    }
    let command = command_id(call);
    let issue = Issue { command_id: &command, now_ms };
    // A retry's own sandbox mounts the volumes already: the append answers it from the log.
    let mounting: &[SandboxDoc] = if retry { &[] } else { &live };
    let decided =
        decide::sandbox_create_mounting(&template, &sandbox_id, node, Some(ttl_s), issue, &volumes, mounting, &admission);
    let decided = super::quotas::recording_refusal(call, tenant, admission.quota.as_ref(), &adding, &sandbox_id, decided).await?;
    let result = call.submit(call.decided(tenant, decided)).await?;
    let stream = &result.events[0].envelope.stream;
    let doc = sandbox_doc(call, tenant, super::call::stream_id(stream)).await?;
    Ok(SandboxCreatedView { claimed: SandboxWarmth::Cold, sandbox: doc.into() })
}

async fn sandboxes_get(call: &Call<'_>, input: SandboxRef) -> Result<SandboxView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    Ok(sandbox_doc(call, tenant, &input.sandbox_id).await?.into())
}

async fn sandboxes_list(call: &Call<'_>, input: SandboxesList) -> Result<Page<SandboxView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let template = input.template_id.as_deref().map(|t| parse_id::<SandboxTemplateId>("templateId", t)).transpose()?;
    let template = template.map(|t| t.to_string());
    let project = super::body::parse_filter::<bc_core::id::ProjectId>("projectId", &input.project_id)?;
    let kind = if input.deleted { KIND_SANDBOX } else { KIND_SANDBOX_LIVE };
    list_rows(call, tenant, kind, input.limit, input.cursor.as_deref(), |row| {
        let s: SandboxDoc = doc(row)?;
        let wanted = template.as_deref().is_none_or(|t| t == s.template_id)
            && project.as_deref().is_none_or(|p| s.project_id.as_deref() == Some(p));
        Ok(wanted.then(|| s.into()))
    })
    .await
}

async fn sandboxes_extend(call: &Call<'_>, input: SandboxesExtend) -> Result<SandboxView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let current = sandbox_doc(call, tenant, &input.sandbox_id).await?;
    let now_ms = call.now_ms();
    let until_ms = match (input.by_s, input.until_ms) {
        (Some(by_s), None) => current.ends_at_ms.unwrap_or(now_ms).saturating_add(by_s.saturating_mul(1000)),
        (None, Some(until_ms)) => until_ms,
        _ => return Err(Error::invalid("give exactly one of byS and untilMs")),
    };
    let max_ttl_s = match call.state.store.row_get(&tenant.to_string(), KIND_SANDBOX_TEMPLATE, &current.template_id).await? {
        Some(row) => doc::<SandboxTemplateDoc>(row)?.max_ttl_s,
        None => {
            return Err(Error::state(format!("sandbox {}'s template is deleted", current.sandbox_id), "create another sandbox"));
        }
    };
    call.submit(call.decided(tenant, decide::sandbox_extend(&current, max_ttl_s, until_ms, now_ms)?)).await?;
    Ok(sandbox_doc(call, tenant, &input.sandbox_id).await?.into())
}

async fn sandboxes_delete(call: &Call<'_>, input: SandboxRef) -> Result<SandboxView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let current = sandbox_doc(call, tenant, &input.sandbox_id).await?;
    if !call.is_retry(tenant).await? {
        super::commands::check_node_queue(call, tenant, &current.node_id).await?;
    }
    let command = command_id(call);
    let decided = decide::sandbox_delete(&current, None, Issue { command_id: &command, now_ms: call.now_ms() })?;
    call.submit(call.decided(tenant, decided)).await?;
    Ok(sandbox_doc(call, tenant, &input.sandbox_id).await?.into())
}

async fn sandboxes_exec(call: &Call<'_>, input: SandboxesExec) -> Result<super::tunnels::TunnelTicketView> {
    let principal = call.principal();
    let tenant = match &input.tenant_id {
        Some(t) => parse_id("tenantId", t)?,
        None => principal.tenant,
    };
    call.state.authorize_tenant(principal, ACTION_SANDBOX_EXEC, tenant).await?;
    let sandbox = sandbox_doc(call, tenant, &input.sandbox_id).await?;
    let tunnels = &call.state.tunnels;
    let bounds = tunnels.limits.bounds();
    let (ticket, expires_at_ms) = tunnels
        .issue(tenant, &principal.key_id, &sandbox.node_id, call.now_ms(), |open, capabilities| {
            decide::sandbox_exec(&SandboxExecInput { sandbox: &sandbox, command: &input.command, capabilities, open, bounds })
        })
        .map_err(super::tunnels::refusal_error)?;
    Ok(super::tunnels::TunnelTicketView::new(ticket, expires_at_ms))
}

/// A sandbox report (`sandbox.observed`, `sandbox.apply_failed`) from a node's journal must be
/// about a sandbox on that node, on the sandbox's stream; one that answers a command must answer
/// that node's `sandbox.apply` for that sandbox. `Err(why)` refuses the entry.
pub(crate) async fn check_sandbox_report(
    store: &dyn bc_core::store::EventStore,
    tenant: TenantId,
    node: &str,
    subject: &str,
    payload: &serde_json::Value,
) -> Result<std::result::Result<(), String>> {
    use bc_projections::events::{SANDBOX_OBSERVED, SandboxReport};
    let report: SandboxReport = match serde_json::from_value(payload.clone()) {
        Ok(r) => r,
        Err(e) => return Ok(Err(format!("the payload of a sandbox report: {e}"))),
    };
    let shape_ok = report.journal.is_none()
        && report.node_id == node
        && report.sandbox_id.parse::<SandboxId>().is_ok()
        && subject == bc_projections::stream_of(KIND_SANDBOX, &report.sandbox_id)
        && report.command_id.as_deref().is_none_or(|c| c.parse::<CommandId>().is_ok())
        && report.reason.as_ref().is_none_or(|r| r.len() <= crate::agents::session::REASON_BYTES_MAX)
        && report.state.as_deref().is_none_or(|s| matches!(s, "running" | "stopped" | "absent"));
    if !shape_ok {
        return Ok(Err(format!(
            "a sandbox report names this node and one of its sandboxes, on the sandbox's stream ({SANDBOX_OBSERVED}: with a state)"
        )));
    }
    let sandbox = store.row_get(&tenant.to_string(), KIND_SANDBOX, &report.sandbox_id).await?;
    let sandbox: Option<SandboxDoc> = sandbox.map(doc).transpose()?;
    if sandbox.is_none_or(|s| s.node_id != node) {
        return Ok(Err(format!("sandbox {} is not on this node", report.sandbox_id)));
    }
    if let Some(command_id) = &report.command_id {
        let command = store.row_get(&tenant.to_string(), bc_projections::KIND_COMMAND, command_id).await?;
        let command: Option<bc_projections::CommandDoc> = command.map(doc).transpose()?;
        let answers = command.is_some_and(|c| {
            c.node_id == node
                && c.kind == bc_projections::sandbox::SANDBOX_APPLY
                && c.args.get("sandboxId").and_then(|i| i.as_str()) == Some(&report.sandbox_id)
        });
        if !answers {
            return Ok(Err(format!("command {command_id} is not this node's sandbox.apply for sandbox {}", report.sandbox_id)));
        }
    }
    Ok(Ok(()))
}
