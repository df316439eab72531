//! `fleet.*`: a tenant's platform objects (sites, pools with the tenant's quota in each,
//! flavors, images, projects) as one reviewed [`FleetDocument`]: `export` writes it, `plan` diffs it against the
//! live fleet and names the plan by its hash, `apply` makes a reviewed plan's changes in one
//! transaction guarded on everything the plan read, `status` says what drifted since the last
//! apply. The decisions are `crate::app::fleet`'s, pure; here they are read for and appended.
//!
//! Decided on `compute:fleet:admin`, and only for the root tenant's administrators (the document
//! sets quotas, which a tenant must not set itself). Every call a plan stands for is decided on
//! its own action too, before anything is appended: one denial applies nothing.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::id::{FlavorId, ImageId, PoolId, ProjectId, SiteId, TenantId, WebhookId};
use bc_projections::KIND_WEBHOOK;

use super::webhooks::WEBHOOKS_PER_TENANT_MAX;
use bc_core::store::{AppendRequest, BATCH_EVENTS_MAX, ExpectedVersion, NewEvent};
use bc_core::{Error, Result};
use bc_projections::decide::project::PROJECTS_PER_TENANT_MAX;
use bc_projections::decide::quota as decide_quota;
use bc_projections::decide::site::SITES_PER_TENANT_MAX;
use bc_projections::events as ev;
use bc_projections::fleet_config::{
    FLEET_APPLIED, FLEET_OBJECTS, FLEET_OBJECTS_PER_EVENT, FLEET_STREAM_ID, FleetApplied, FleetConfigDoc, FleetDrift,
    FleetObjects, KIND_FLEET,
};
use bc_projections::project::{KIND_PROJECT, ProjectDoc};
use bc_projections::site::{KIND_SITE, SiteDoc};
use bc_projections::{FlavorDoc, ImageDoc, KIND_FLAVOR, KIND_IMAGE, KIND_POOL, KIND_QUOTA, PoolDoc, QuotaDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::body::parse_id;
use super::call::doc;
use super::flavors::{
    FLAVOR_DISK_GIB_MAX, FLAVOR_GPUS_MAX, FLAVOR_MEMORY_MIB_MAX, FLAVOR_VCPUS_MAX, FlavorShape as ApiFlavorShape,
};
use super::flavors::{FLAVORS_PER_TENANT_MAX, validate_flavor_shape};
use super::images::{IMAGE_SIZE_BYTES_MAX, IMAGES_PER_TENANT_MAX, ImageUrl, Sha256Hex, validate_image_url, validate_sha256};
use super::pools::{MAX_RESERVATION_S_LIMIT, MAX_RESERVATION_S_MIN};
use super::validate::{
    DESCRIPTION_CHARS_MAX, DescriptionText, LabelsMap, NameText, TenantIdText, string_schema, validate_labels, validate_name,
    validate_text,
};
use super::views::{DiskFormatView, ImageChannelView};
use super::{Access, Call, Method, method};
use crate::app::fleet::{self as decide, Blocked, Change, FleetLive, FleetPlan, Op, Unmanaged};
use bc_projections::decide::pool_offer::OFFERS_PER_POOL_MAX;

const ADMIN: Access = Access::Action("compute:fleet:admin");

/// The document's `apiVersion`.
pub const FLEET_API_VERSION: &str = "better-compute/v1";
/// The document's `kind`.
pub const FLEET_KIND: &str = "FleetConfig";
/// Pools one document holds at most.
pub const FLEET_POOLS_MAX: usize = 500;
/// Changes one apply makes at most: they land in one transaction, and the log takes at most
/// `BATCH_EVENTS_MAX` events in one; the rest is room for `fleet.applied` and its objects.
pub const FLEET_CHANGES_MAX: usize = 800;
/// Objects of one kind the live fleet may hold for a plan to be made (each is read).
pub const FLEET_LIVE_OBJECTS_MAX: usize = 5000;
/// Objects one applied document records at most: per pool its own, its quota's and its offers',
/// and every flavor, image, site and project.
const FLEET_OBJECTS_MAX: usize = FLEET_POOLS_MAX * 3
    + FLAVORS_PER_TENANT_MAX as usize
    + IMAGES_PER_TENANT_MAX as usize
    + SITES_PER_TENANT_MAX
    + PROJECTS_PER_TENANT_MAX
    + WEBHOOKS_PER_TENANT_MAX as usize;
const _: () = assert!(FLEET_CHANGES_MAX + 1 + FLEET_OBJECTS_MAX.div_ceil(FLEET_OBJECTS_PER_EVENT) <= BATCH_EVENTS_MAX);

/// A key of the document: the fleet's own (`gpu-a`: 1 to 63 of a-z 0-9 . -) or an id.
const FLEET_KEY: &str = "[a-z0-9][a-z0-9.-]{0,62}";
const ULID: &str = "[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}";

fn key_pattern(prefix: &str) -> String {
    format!("^({FLEET_KEY}|{prefix}_{ULID})$")
}

string_schema!(
    /// The document's `apiVersion`, `better-compute/v1`.
    FleetApiVersionText as "FleetApiVersion",
    |_| schemars::json_schema!({ "type": "string", "enum": [FLEET_API_VERSION] })
);
string_schema!(
    /// The document's `kind`, `FleetConfig`.
    FleetKindText as "FleetKind",
    |_| schemars::json_schema!({ "type": "string", "enum": [FLEET_KIND] })
);
string_schema!(
    /// A webhook's receiver in the document: an `https://` or `http://` URL with a host (a name
    /// or an address literal). Wider than the API's `ReceiverUrl` (`https://` and a fully
    /// qualified name, the production contract): the document is what a deployment exported,
    /// and a deployment that allows loopback or `http://` receivers (`dev`,
    /// `--webhook-allow-loopback`) exports them. Its receiver policy decides the rest when the
    /// plan checks the document, as `webhooks.create` does.
    FleetReceiverUrl as "FleetReceiverUrl",
    |_| schemars::json_schema!({
        "type": "string",
        "maxLength": bc_core::webhook::URL_BYTES_MAX,
        "pattern": "^https?://([A-Za-z0-9._~-]+|\\[[0-9A-Fa-f:.]+\\])(:[0-9]{1,5})?(/[^\\s?#]*)?(\\?[^\\s#]*)?$"
    })
);

string_schema!(
    /// A pool's key in the document: the fleet's own, or the id of a pool it did not create.
    FleetPoolKeyText as "FleetPoolKey",
    |_| schemars::json_schema!({ "type": "string", "pattern": key_pattern(PoolId::PREFIX) })
);

string_schema!(
    /// A site's key in the document: the fleet's own, or the id of a site it did not create.
    FleetSiteKeyText as "FleetSiteKey",
    |_| schemars::json_schema!({ "type": "string", "pattern": key_pattern(SiteId::PREFIX) })
);

string_schema!(
    /// A tenant id in the document, in canonical form (`ten_` and the ULID in lowercase), as
    /// `fleet export` writes it: the plan compares ids as text.
    FleetTenantIdText as "FleetTenantId",
    |_| schemars::json_schema!({
        "type": "string",
        "pattern": format!("^ten_[0-7][0-9a-hjkmnp-tv-z]{{25}}$"),
        "description": "ten_ followed by a 26-character ULID, lowercase",
    })
);

/// `offeredTo` as a set that names each tenant once: a list that names one twice is refused
/// (the schema's `uniqueItems`), not quietly made a set.
fn unique_tenants<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<BTreeSet<String>>, D::Error> {
    let Some(list) = Option::<Vec<String>>::deserialize(d)? else { return Ok(None) };
    let count = list.len();
    let set: BTreeSet<String> = list.into_iter().collect();
    if set.len() != count {
        return Err(serde::de::Error::custom("offeredTo names a tenant more than once"));
    }
    Ok(Some(set))
}

fn keyed<T: JsonSchema>(g: &mut schemars::SchemaGenerator, prefix: &str, max: usize) -> schemars::Schema {
    let item = g.subschema_for::<T>();
    schemars::json_schema!({
        "type": "object",
        "maxProperties": max,
        "propertyNames": { "pattern": key_pattern(prefix) },
        "additionalProperties": item,
    })
}

/// A FleetConfig document: the tenant's sites, pools (with its quota in each), flavors, images
/// and projects, each keyed by the fleet's own key or, for what the fleet did not create, by its
/// id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "FleetConfig")]
pub struct FleetDocument {
    #[schemars(with = "FleetApiVersionText")]
    pub api_version: String,
    #[schemars(with = "FleetKindText")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "sites_schema")]
    pub sites: BTreeMap<String, FleetSite>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "pools_schema")]
    pub pools: BTreeMap<String, FleetPool>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "flavors_schema")]
    pub flavors: BTreeMap<String, FleetFlavor>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "images_schema")]
    pub images: BTreeMap<String, FleetImage>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "projects_schema")]
    pub projects: BTreeMap<String, FleetProject>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "webhooks_schema")]
    pub webhooks: BTreeMap<String, FleetWebhook>,
}

fn sites_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    keyed::<FleetSite>(g, SiteId::PREFIX, SITES_PER_TENANT_MAX)
}
fn projects_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    keyed::<FleetProject>(g, ProjectId::PREFIX, PROJECTS_PER_TENANT_MAX)
}
fn webhooks_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    keyed::<FleetWebhook>(g, WebhookId::PREFIX, WEBHOOKS_PER_TENANT_MAX as usize)
}

fn pools_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    keyed::<FleetPool>(g, PoolId::PREFIX, FLEET_POOLS_MAX)
}
fn flavors_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    keyed::<FleetFlavor>(g, FlavorId::PREFIX, FLAVORS_PER_TENANT_MAX as usize)
}
fn images_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
    keyed::<FleetImage>(g, ImageId::PREFIX, IMAGES_PER_TENANT_MAX as usize)
}

impl FleetDocument {
    pub fn empty() -> Self {
        Self {
            api_version: FLEET_API_VERSION.into(),
            kind: FLEET_KIND.into(),
            sites: BTreeMap::new(),
            pools: BTreeMap::new(),
            flavors: BTreeMap::new(),
            images: BTreeMap::new(),
            projects: BTreeMap::new(),
            webhooks: BTreeMap::new(),
        }
    }
}

/// A pool, and the tenant's GPU quota in it when the document manages it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetPool {
    #[schemars(with = "NameText")]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(with = "DescriptionText")]
    pub description: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(with = "LabelsMap")]
    pub labels: BTreeMap<String, String>,
    /// The longest reservation the pool grants, in seconds (absent: 30 days for a new pool,
    /// unchanged for one that exists).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = MAX_RESERVATION_S_MIN, max = MAX_RESERVATION_S_LIMIT))]
    pub max_reservation_s: Option<u64>,
    /// The tenant's GPU quota in the pool (absent: the document leaves the quota alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = u32::MAX))]
    pub quota_gpus: Option<u32>,
    /// With `quotaGpus`, the quota's limit of live instances (absent: unbounded; without
    /// `quotaGpus` the plan is `BLOCKED`: a quota always names its GPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = decide_quota::QUOTA_COUNT_MAX))]
    pub quota_instances: Option<u32>,
    /// With `quotaGpus`, the limit of vCPUs of live instances and claimed or cold sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = decide_quota::QUOTA_VCPUS_MAX))]
    pub quota_vcpus: Option<u32>,
    /// With `quotaGpus`, the limit of their memory, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "quotaMemoryMiB")]
    #[schemars(range(min = 0, max = decide_quota::QUOTA_MEMORY_MIB_MAX))]
    pub quota_memory_mib: Option<u64>,
    /// With `quotaGpus`, the limit of live claimed or cold sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = decide_quota::QUOTA_COUNT_MAX))]
    pub quota_sandboxes: Option<u32>,
    /// The other tenants the pool is offered to (`pools.offer`; absent: the document leaves
    /// the offers alone, empty: none).
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "unique_tenants")]
    #[schemars(with = "Option<BTreeSet<FleetTenantIdText>>", length(max = OFFERS_PER_POOL_MAX))]
    pub offered_to: Option<BTreeSet<String>>,
    /// The site its machines are at: the site's key in the document (absent: none). Fixed for
    /// the pool's life: another site for a pool that exists is `BLOCKED`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<FleetSiteKeyText>")]
    pub site: Option<String>,
}

/// A site: where machines are. Its name and labels change in place, its region never.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetSite {
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "NameText")]
    pub region: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(with = "LabelsMap")]
    pub labels: BTreeMap<String, String>,
}

/// A project: a subdivision of the tenant. It is made and archived (`--prune` archives one the
/// document leaves out), never changed: another name or description is `BLOCKED`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetProject {
    #[schemars(with = "NameText")]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(with = "DescriptionText")]
    pub description: String,
}

/// A webhook subscription. Its signing secret is only ever a reference to a secret of the
/// tenant (`secretRef`, never a value): a webhook the document creates must name one (an apply
/// cannot hand out a generated secret: `BLOCKED` otherwise); without `secretRef`, the webhook's
/// secret, generated or referenced, is left alone, and one with a generated secret is exported
/// without it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetWebhook {
    #[schemars(with = "FleetReceiverUrl")]
    pub url: String,
    #[schemars(with = "super::webhooks::ReceiverTypes")]
    pub event_types: Vec<String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    #[schemars(with = "DescriptionText")]
    pub description: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<super::secrets::SecretRefText>")]
    pub secret_ref: Option<String>,
}

/// A flavor of a pool of the document (`pool` is the pool's key there).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetFlavor {
    #[schemars(with = "FleetPoolKeyText")]
    pub pool: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(range(min = 1, max = FLAVOR_VCPUS_MAX))]
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 1, max = FLAVOR_MEMORY_MIB_MAX))]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    #[schemars(range(min = 1, max = FLAVOR_DISK_GIB_MAX))]
    pub disk_gib: u64,
    #[schemars(range(max = FLAVOR_GPUS_MAX))]
    pub gpus: u32,
}

/// A disk image by URL and SHA-256.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetImage {
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "ImageUrl")]
    pub url: String,
    #[schemars(with = "Sha256Hex")]
    pub sha256: String,
    pub disk_format: DiskFormatView,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = IMAGE_SIZE_BYTES_MAX))]
    pub size_bytes: Option<u64>,
    /// `testing` or `stable` (absent: the document leaves the channel alone). `stable` over a
    /// `testing` image is a promotion (`images.promote`); a stable image is never demoted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<ImageChannelView>,
}

pub(super) const METHODS: &[Method] = &[
    method!("fleet.export", ADMIN, "the tenant's platform objects as one FleetConfig document", FleetExport => FleetExportView, fleet_export),
    method!("fleet.plan", ADMIN, "what applying a FleetConfig document would change, and the plan's hash", FleetPlanInput => FleetPlanView, fleet_plan),
    method!(
        "fleet.apply",
        ADMIN,
        "make a reviewed plan's changes in one transaction, or none (CONFIG_DRIFT, PLAN_BLOCKED)",
        FleetApplyInput => FleetApplyView,
        fleet_apply,
    ),
    method!("fleet.status", ADMIN, "the last applied plan and what drifted from it since", FleetExport => FleetStatusView, fleet_status),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetExport {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetPlanInput {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    document: FleetDocument,
    /// Delete (archive, for a pool) the live objects the document leaves out.
    #[serde(default)]
    prune: bool,
}

string_schema!(
    /// A plan's hash, as `fleet.plan` answered it: 64 lowercase hex digits.
    PlanHashText as "PlanHash",
    |_| schemars::json_schema!({ "type": "string", "pattern": "^[0-9a-f]{64}$" })
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetApplyInput {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    document: FleetDocument,
    #[serde(default)]
    prune: bool,
    /// The hash of the plan reviewed: applied only while the plan is still exactly that.
    #[schemars(with = "PlanHashText")]
    plan_hash: String,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetExportView {
    #[schemars(with = "TenantIdText")]
    tenant_id: String,
    document: FleetDocument,
    /// SHA-256 of the document in canonical JSON.
    document_sha256: String,
}

/// One change of a plan, as the API shows it.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetChangeView {
    /// `create`, `update` or `delete`.
    op: String,
    /// `pool`, `quota`, `flavor` or `image`.
    kind: String,
    key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    /// Each field set: `{from, to}` (`from` is null for a create).
    fields: BTreeMap<String, Value>,
    /// The API call that makes the change on its own, and the action it is decided on.
    method: String,
    action: String,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetBlockedView {
    kind: String,
    key: String,
    reason: String,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetUnmanagedView {
    kind: String,
    id: String,
    name: String,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetPlanView {
    plan_hash: String,
    document_sha256: String,
    changes: Vec<FleetChangeView>,
    blocked: Vec<FleetBlockedView>,
    /// Live objects the document leaves out, left alone (deleted only with `prune`).
    unmanaged: Vec<FleetUnmanagedView>,
    /// Nothing to change and nothing blocked.
    empty: bool,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetApplyView {
    plan_hash: String,
    /// Whether this call applied it (false: the same request again, already applied).
    applied: bool,
    created: u32,
    updated: u32,
    deleted: u32,
    /// The ids of what the plan created, by `kind/key`.
    created_ids: BTreeMap<String, String>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetDriftView {
    kind: String,
    key: String,
    id: String,
    /// `changed` or `deleted`.
    what: String,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FleetStatusView {
    /// Whether a document was ever applied.
    applied: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    plan_hash: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    applied_at_ms: Option<u64>,
    /// Objects the last applied document covers.
    objects: u32,
    /// What changed outside the document since, read now.
    drift: Vec<FleetDriftView>,
    /// The drift the `fleet.drift` reconciler last recorded (`fleet.drifted`), and when.
    recorded_drift: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    recorded_at_ms: Option<u64>,
}

fn change_view(c: &Change) -> FleetChangeView {
    let (method, action) = c.call();
    FleetChangeView {
        op: serde_json::to_value(c.op).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default(),
        kind: c.kind.into(),
        key: c.key.clone(),
        id: c.id.clone(),
        fields: c.fields.iter().map(|(k, f)| (k.clone(), serde_json::json!({ "from": f.from, "to": f.to }))).collect(),
        method: method.into(),
        action: action.into(),
    }
}

fn blocked_view(b: &Blocked) -> FleetBlockedView {
    FleetBlockedView { kind: b.kind.into(), key: b.key.clone(), reason: b.reason.clone() }
}

fn unmanaged_view(u: &Unmanaged) -> FleetUnmanagedView {
    FleetUnmanagedView { kind: u.kind.into(), id: u.id.clone(), name: u.name.clone() }
}

fn drift_view(d: FleetDrift) -> FleetDriftView {
    FleetDriftView { kind: d.kind, key: d.key, id: d.id, what: d.what }
}

/// The fleet methods are the root tenant's administrators' alone.
fn root_only(call: &Call<'_>) -> Result<()> {
    if !call.principal().is_root() {
        return Err(Error::AccessDenied("only the root tenant's administrators manage the fleet configuration".into()));
    }
    Ok(())
}

/// Refuses a document the schema refuses, saying where: every field checked as the object's
/// own method checks it.
fn validate_document(d: &FleetDocument) -> Result<()> {
    if d.api_version != FLEET_API_VERSION {
        return Err(Error::invalid(format!("document.apiVersion must be {FLEET_API_VERSION:?}")));
    }
    if d.kind != FLEET_KIND {
        return Err(Error::invalid(format!("document.kind must be {FLEET_KIND:?}")));
    }
    let bounds = [
        ("pools", d.pools.len(), FLEET_POOLS_MAX),
        ("flavors", d.flavors.len(), FLAVORS_PER_TENANT_MAX as usize),
        ("images", d.images.len(), IMAGES_PER_TENANT_MAX as usize),
        ("sites", d.sites.len(), SITES_PER_TENANT_MAX),
        ("projects", d.projects.len(), PROJECTS_PER_TENANT_MAX),
        ("webhooks", d.webhooks.len(), WEBHOOKS_PER_TENANT_MAX as usize),
    ];
    for (what, n, max) in bounds {
        if n > max {
            return Err(Error::invalid(format!("document.{what} holds at most {max} objects, not {n}")));
        }
    }
    let at = |what: &str, key: &str, e: Error| Error::InvalidArgument {
        message: format!("document.{what}.{key}: {}", e.public_message()),
        hint: e.hint().map(str::to_owned),
    };
    for (key, s) in &d.sites {
        check_key(SiteId::PREFIX, "sites", key)?;
        validate_name("name", &s.name).map_err(|e| at("sites", key, e))?;
        validate_name("region", &s.region).map_err(|e| at("sites", key, e))?;
        validate_labels(&s.labels).map_err(|e| at("sites", key, e))?;
    }
    for (key, p) in &d.projects {
        check_key(ProjectId::PREFIX, "projects", key)?;
        validate_name("name", &p.name).map_err(|e| at("projects", key, e))?;
        validate_text("description", &p.description, DESCRIPTION_CHARS_MAX).map_err(|e| at("projects", key, e))?;
    }
    for (key, p) in &d.pools {
        check_key(PoolId::PREFIX, "pools", key)?;
        if let Some(site) = &p.site {
            check_key(SiteId::PREFIX, &format!("pools.{key}.site"), site)?;
        }
        validate_name("name", &p.name).map_err(|e| at("pools", key, e))?;
        validate_text("description", &p.description, DESCRIPTION_CHARS_MAX).map_err(|e| at("pools", key, e))?;
        validate_labels(&p.labels).map_err(|e| at("pools", key, e))?;
        if let Some(s) = p.max_reservation_s
            && !(MAX_RESERVATION_S_MIN..=MAX_RESERVATION_S_LIMIT).contains(&s)
        {
            return Err(Error::invalid(format!(
                "document.pools.{key}: maxReservationS must be {MAX_RESERVATION_S_MIN} to {MAX_RESERVATION_S_LIMIT}, not {s}"
            )));
        }
        decide_quota::check_limits(
            p.quota_instances.map(i64::from),
            p.quota_vcpus.map(i64::from),
            p.quota_memory_mib.and_then(|m| i64::try_from(m).ok().or(Some(i64::MAX))),
            p.quota_sandboxes.map(i64::from),
        )
        .map_err(|e| at("pools", key, e))?;
        let offered = p.offered_to.iter().flatten();
        if p.offered_to.as_ref().is_some_and(|o| o.len() > OFFERS_PER_POOL_MAX) {
            return Err(Error::invalid(format!("document.pools.{key}: offeredTo names at most {OFFERS_PER_POOL_MAX} tenants")));
        }
        for t in offered {
            parse_id::<TenantId>("offeredTo", t).map_err(|e| at("pools", key, e))?;
            if t.parse::<TenantId>().map(|id| id.to_string()).ok().as_deref() != Some(t.as_str()) {
                return Err(Error::invalid(format!(
                    "document.pools.{key}: offeredTo {t:?} is not a tenant id in canonical form"
                )));
            }
        }
    }
    for key in d.webhooks.keys() {
        check_key(WebhookId::PREFIX, "webhooks", key)?;
    }
    for (key, f) in &d.flavors {
        check_key(FlavorId::PREFIX, "flavors", key)?;
        check_key(PoolId::PREFIX, &format!("flavors.{key}.pool"), &f.pool)?;
        validate_name("name", &f.name).map_err(|e| at("flavors", key, e))?;
        let shape = ApiFlavorShape { vcpus: f.vcpus, memory_mib: f.memory_mib, disk_gib: f.disk_gib, gpus: f.gpus };
        validate_flavor_shape(shape).map_err(|e| at("flavors", key, e))?;
    }
    for (key, i) in &d.images {
        check_key(ImageId::PREFIX, "images", key)?;
        validate_name("name", &i.name).map_err(|e| at("images", key, e))?;
        validate_image_url(&i.url).map_err(|e| at("images", key, e))?;
        validate_sha256(&i.sha256).map_err(|e| at("images", key, e))?;
        if let Some(size) = i.size_bytes
            && !(1..=IMAGE_SIZE_BYTES_MAX).contains(&size)
        {
            return Err(Error::invalid(format!(
                "document.images.{key}: sizeBytes must be 1 to {IMAGE_SIZE_BYTES_MAX}, not {size}"
            )));
        }
    }
    Ok(())
}

/// A key is the fleet's own (`gpu-a`) or an id of its kind, in canonical form.
fn check_key(prefix: &str, what: &str, key: &str) -> Result<()> {
    let own = !key.is_empty()
        && key.len() <= 63
        && key.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && key.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-');
    let id = key.strip_prefix(prefix).and_then(|rest| rest.strip_prefix('_')).is_some_and(|ulid| {
        ulid.len() == 26
            && ulid.as_bytes()[0] <= b'7'
            && ulid.bytes().all(|b| b.is_ascii_digit() || (b.is_ascii_alphabetic() && !b"ILOUilou".contains(&b)))
    });
    if own || id {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        message: format!(
            "document.{what}: key {:?} is neither a key of the fleet's own nor a {prefix}_ id",
            bc_core::id::truncate(key, 70)
        ),
        hint: Some("a key is 1 to 63 of a-z 0-9 . - (starting with a letter or digit), or the id of an existing object".into()),
    })
}

/// Every row of `kind` of the tenant, at most [`FLEET_LIVE_OBJECTS_MAX`].
async fn read_all<T: serde::de::DeserializeOwned>(call: &Call<'_>, tenant: TenantId, kind: &str) -> Result<Vec<T>> {
    let rows: Vec<T> = bc_projections::placement::all_rows(&*call.state.store, tenant, kind).await?;
    if rows.len() > FLEET_LIVE_OBJECTS_MAX {
        return Err(Error::state(
            format!("the tenant has {} {kind} objects, more than the {FLEET_LIVE_OBJECTS_MAX} one plan reads", rows.len()),
            "archive or delete what is no longer used",
        ));
    }
    Ok(rows)
}

// A plan reads every machine of the tenant (those naming a site hold it against a prune).
const _: () = assert!(super::metal::MACHINES_PER_TENANT_MAX <= FLEET_LIVE_OBJECTS_MAX);

/// The live fleet of `tenant`, as a plan reads it.
async fn read_live(call: &Call<'_>, tenant: TenantId) -> Result<FleetLive> {
    let pools: Vec<PoolDoc> = read_all(call, tenant, KIND_POOL).await?;
    let quotas: Vec<QuotaDoc> = read_all(call, tenant, KIND_QUOTA).await?;
    let flavors: Vec<FlavorDoc> = read_all(call, tenant, KIND_FLAVOR).await?;
    let images: Vec<ImageDoc> = read_all(call, tenant, KIND_IMAGE).await?;
    let sites: Vec<SiteDoc> = read_all(call, tenant, KIND_SITE).await?;
    let machines: Vec<bc_projections::workflow::MetalDoc> = read_all(call, tenant, bc_projections::workflow::KIND_METAL).await?;
    let site_machines = machines
        .into_iter()
        .filter_map(|m| {
            m.site_id
                .clone()
                .filter(|site| bc_projections::decide::site::machine_holds_site(&m, site))
                .map(|site| (m.node_id, site))
        })
        .collect();
    let projects: Vec<ProjectDoc> = read_all(call, tenant, KIND_PROJECT).await?;
    let applied = call
        .state
        .store
        .row_get(&tenant.to_string(), KIND_FLEET, FLEET_STREAM_ID)
        .await?
        .map(doc::<FleetConfigDoc>)
        .transpose()?;
    let quotas = quotas.into_iter().map(|q| (q.pool_id.clone(), q)).collect();
    let webhooks: Vec<bc_projections::WebhookDoc> = read_all(call, tenant, KIND_WEBHOOK).await?;
    let webhook_secrets = BTreeMap::new();
    Ok(FleetLive { pools, quotas, flavors, images, sites, site_machines, projects, webhooks, webhook_secrets, applied })
}

async fn fleet_export(call: &Call<'_>, input: FleetExport) -> Result<FleetExportView> {
    root_only(call)?;
    let tenant = call.tenant(&input.tenant_id).await?;
    let document = decide::fleet_export(&read_live(call, tenant).await?);
    let document_sha256 = decide::canonical_sha256(&document);
    Ok(FleetExportView { tenant_id: tenant.to_string(), document, document_sha256 })
}

fn plan_view(plan: &FleetPlan) -> FleetPlanView {
    FleetPlanView {
        plan_hash: plan.plan_hash.clone(),
        document_sha256: plan.document_sha256.clone(),
        changes: plan.changes.iter().map(change_view).collect(),
        blocked: plan.blocked.iter().map(blocked_view).collect(),
        unmanaged: plan.unmanaged.iter().map(unmanaged_view).collect(),
        empty: plan.changes.is_empty() && plan.blocked.is_empty(),
    }
}

async fn fleet_plan(call: &Call<'_>, input: FleetPlanInput) -> Result<FleetPlanView> {
    root_only(call)?;
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_document(&input.document)?;
    validate_webhooks(call, &input.document)?;
    let live = read_live_for(call, tenant, &input.document).await?;
    let plan = decide::fleet_plan(&live, &input.document, input.prune);
    Ok(plan_view(&plan))
}

/// The document's webhooks checked as `webhooks.create` checks them (the endpoint against this
/// deployment's receiver policy), saying which. A receiver the policy refuses blocks the plan
/// (`PLAN_BLOCKED`, 409), as a reference to a secret that is not there does: the document's
/// schema states a URL's form (`FleetReceiverUrl`), and which receivers a deployment delivers to
/// (loopback, private addresses, `http://`) is the deployment's, not the document's.
fn validate_webhooks(call: &Call<'_>, d: &FleetDocument) -> Result<()> {
    for (key, w) in &d.webhooks {
        call.state.webhook_policy.check_url(&w.url).map_err(|e| {
            let why = e.hint().map(|h| format!(" ({h})")).unwrap_or_default();
            Error::PlanBlocked(format!(
                "document.webhooks.{key}: this deployment refuses the receiver: {}{why}",
                e.public_message()
            ))
        })?;
        super::webhooks::check_fleet_webhook(call, &w.url, &w.event_types, &w.description, w.secret_ref.as_deref()).map_err(
            |e| Error::InvalidArgument {
                message: format!("document.webhooks.{key}: {}", e.public_message()),
                hint: e.hint().map(str::to_owned),
            },
        )?;
    }
    Ok(())
}

/// The live fleet, with the secrets the document's webhooks name as read.
async fn read_live_for(call: &Call<'_>, tenant: TenantId, d: &FleetDocument) -> Result<FleetLive> {
    let mut live = read_live(call, tenant).await?;
    for reference in d.webhooks.values().filter_map(|w| w.secret_ref.as_ref()) {
        let canonical = reference.to_lowercase();
        if live.webhook_secrets.contains_key(&canonical) {
            continue;
        }
        if let Some(read) = super::webhooks::signing_secret_read(call, tenant, reference).await? {
            live.webhook_secrets.insert(canonical, read);
        }
    }
    Ok(live)
}

fn counts(plan: &FleetPlan) -> (u32, u32, u32) {
    let n = |op: Op| plan.changes.iter().filter(|c| c.op == op).count() as u32;
    (n(Op::Create), n(Op::Update), n(Op::Delete))
}

async fn fleet_apply(call: &Call<'_>, input: FleetApplyInput) -> Result<FleetApplyView> {
    root_only(call)?;
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_document(&input.document)?;
    validate_webhooks(call, &input.document)?;
    let live = read_live_for(call, tenant, &input.document).await?;
    // The same request again (its idempotency key seen) after it applied: answered from the
    // fleet's record, not planned again (the plan over the changed fleet is another plan).
    if call.is_retry(tenant).await?
        && let Some(applied) = &live.applied
        && applied.plan_hash == input.plan_hash
    {
        let created_ids = BTreeMap::new();
        return Ok(FleetApplyView {
            plan_hash: applied.plan_hash.clone(),
            applied: false,
            created: 0,
            updated: 0,
            deleted: 0,
            created_ids,
        });
    }
    let plan = decide::fleet_plan(&live, &input.document, input.prune);
    if !plan.blocked.is_empty() {
        let first = &plan.blocked[0];
        return Err(Error::PlanBlocked(format!(
            "{} change(s) cannot be made in place, the first: {} {}: {}; nothing was applied",
            plan.blocked.len(),
            first.kind,
            first.key,
            first.reason
        )));
    }
    if plan.plan_hash != input.plan_hash {
        return Err(Error::ConfigDrift(format!(
            "the fleet or the document is not what the plan {} was made on (the plan is now {}); nothing was applied",
            bc_core::id::truncate(&input.plan_hash, 64),
            plan.plan_hash
        )));
    }
    if plan.changes.len() > FLEET_CHANGES_MAX {
        return Err(Error::invalid(format!(
            "one apply makes at most {FLEET_CHANGES_MAX} changes (one transaction), this plan has {}; apply the document in parts",
            plan.changes.len()
        )));
    }
    // Every call decided before anything is appended: one denial, nothing applied.
    let principal = call.principal();
    for (n, change) in plan.changes.iter().enumerate() {
        let (method, action) = change.call();
        if !principal.allows(action) {
            return Err(Error::AccessDenied(format!(
                "call {} of {} ({method} for {} {}) needs {action}, which this key does not hold; nothing was applied",
                n + 1,
                plan.changes.len(),
                change.kind,
                change.key
            )));
        }
    }
    let offers = offer_reads(call, tenant, &plan).await?;
    let (requests, created_ids) = appends(call, tenant, &plan, &live, &offers)?;
    match call.state.log.append_group(requests).await {
        Ok(_) => {}
        Err(Error::Conflict { stream, .. }) => {
            return Err(Error::ConfigDrift(format!("{stream} changed while the plan was applied; nothing was applied")));
        }
        Err(e) => return Err(e),
    }
    // A webhook deleted, or signing with a referenced secret now: its own secrets sign nothing
    // again, and their rows go (as `webhooks.delete` and `webhooks.update` do).
    for c in plan.changes.iter().filter(|c| c.kind == decide::OBJECT_WEBHOOK && c.op != Op::Create) {
        if c.op == Op::Update && !c.fields.contains_key("secretRef") {
            continue;
        }
        if let Some(w) = live.webhooks.iter().find(|w| Some(&w.webhook_id) == c.id.as_ref()) {
            for secret_id in super::webhooks::own_secrets(w) {
                call.state.store.secret_delete(tenant, secret_id).await?;
            }
        }
    }
    let (created, updated, deleted) = counts(&plan);
    Ok(FleetApplyView {
        plan_hash: plan.plan_hash,
        applied: true,
        created,
        updated,
        deleted,
        created_ids: created_ids.into_iter().map(|((kind, key), id)| (format!("{kind}/{key}"), id)).collect(),
    })
}

/// The appends that make `plan`, in one group: each change on its own stream at the version it
/// read, then `fleet.applied` and `fleet.objects` on the fleet's stream, guarded on every stream
/// the plan read and does not append to.
#[allow(clippy::type_complexity)]
fn appends(
    call: &Call<'_>,
    tenant: TenantId,
    plan: &FleetPlan,
    live: &FleetLive,
    offers: &OfferReads,
) -> Result<(Vec<AppendRequest>, BTreeMap<(&'static str, String), String>)> {
    let mut created: BTreeMap<(&'static str, String), String> = BTreeMap::new();
    for c in plan.changes.iter().filter(|c| c.op == Op::Create && c.kind != decide::OBJECT_QUOTA) {
        let id = match c.kind {
            decide::OBJECT_POOL => PoolId::from_ulid(call.ulid()).to_string(),
            decide::OBJECT_SITE => SiteId::from_ulid(call.ulid()).to_string(),
            decide::OBJECT_PROJECT => ProjectId::from_ulid(call.ulid()).to_string(),
            decide::OBJECT_FLAVOR => FlavorId::from_ulid(call.ulid()).to_string(),
            decide::OBJECT_WEBHOOK => WebhookId::from_ulid(call.ulid()).to_string(),
            _ => ImageId::from_ulid(call.ulid()).to_string(),
        };
        created.insert((c.kind, c.key.clone()), id);
    }
    let str_field = |c: &Change, name: &str| -> Result<String> {
        c.fields
            .get(name)
            .and_then(|f| f.to.as_str())
            .map(str::to_owned)
            .ok_or_else(|| Error::Internal(format!("fleet plan: {name}")))
    };
    let u64_field = |c: &Change, name: &str| c.fields.get(name).and_then(|f| f.to.as_u64());
    let mut requests = Vec::new();
    let mut appended: Vec<String> = Vec::new();
    for c in &plan.changes {
        let id = c.id.clone().or_else(|| created.get(&(c.kind, c.key.clone())).cloned());
        if c.kind == decide::OBJECT_OFFER {
            // A pool's id is drawn above when the plan creates it.
            let pool = id.or_else(|| created.get(&(decide::OBJECT_POOL, c.key.clone())).cloned()).unwrap_or_default();
            let pool_changed = plan.changes.iter().any(|o| o.kind == decide::OBJECT_POOL && o.key == c.key);
            requests.extend(offer_requests(call, tenant, c, &pool, pool_changed, live, offers)?);
            appended.push(format!("{KIND_POOL}/{pool}"));
            continue;
        }
        // What follows the change's event in its own append (a stable image's promotion).
        let mut then: Option<NewEvent> = None;
        let (stream, expected, event_type, payload) = match (c.kind, c.op) {
            (decide::OBJECT_POOL, Op::Create) => (
                format!("{KIND_POOL}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::NoStream,
                ev::POOL_CREATED,
                ev::to_cbor(&ev::PoolCreated {
                    name: str_field(c, "name")?,
                    description: str_field(c, "description")?,
                    labels: labels_field(c)?.unwrap_or_default(),
                    max_reservation_s: u64_field(c, "maxReservationS"),
                    // The site's id, or its key when the plan creates it (its id drawn above).
                    site_id: c.fields.get("site").map(|_| str_field(c, "site")).transpose()?.map(|site| {
                        if site.starts_with("site_") {
                            site
                        } else {
                            created.get(&(decide::OBJECT_SITE, site.clone())).cloned().unwrap_or(site)
                        }
                    }),
                })?,
            ),
            (decide::OBJECT_POOL, Op::Update) => (
                format!("{KIND_POOL}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::POOL_UPDATED,
                ev::to_cbor(&ev::PoolUpdated {
                    name: c.fields.get("name").map(|_| str_field(c, "name")).transpose()?,
                    description: c.fields.get("description").map(|_| str_field(c, "description")).transpose()?,
                    labels: labels_field(c)?,
                    max_reservation_s: u64_field(c, "maxReservationS"),
                })?,
            ),
            (decide::OBJECT_POOL, Op::Delete) => (
                format!("{KIND_POOL}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::POOL_ARCHIVED,
                ev::to_cbor(&ev::PoolArchived {})?,
            ),
            (decide::OBJECT_SITE, Op::Create) => (
                format!("{KIND_SITE}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::NoStream,
                ev::SITE_CREATED,
                ev::to_cbor(&ev::SiteCreated {
                    name: str_field(c, "name")?,
                    region: str_field(c, "region")?,
                    labels: labels_field(c)?.unwrap_or_default(),
                })?,
            ),
            (decide::OBJECT_SITE, Op::Update) => (
                format!("{KIND_SITE}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::SITE_UPDATED,
                ev::to_cbor(&ev::SiteUpdated {
                    name: c.fields.get("name").map(|_| str_field(c, "name")).transpose()?,
                    labels: labels_field(c)?,
                })?,
            ),
            (decide::OBJECT_SITE, Op::Delete) => (
                format!("{KIND_SITE}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::SITE_DELETED,
                ev::to_cbor(&ev::SiteDeleted {})?,
            ),
            (decide::OBJECT_PROJECT, Op::Create) => (
                format!("{KIND_PROJECT}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::NoStream,
                ev::PROJECT_CREATED,
                ev::to_cbor(&ev::ProjectCreated {
                    name: str_field(c, "name")?,
                    description: c
                        .fields
                        .get("description")
                        .map(|_| str_field(c, "description"))
                        .transpose()?
                        .unwrap_or_default(),
                })?,
            ),
            (decide::OBJECT_WEBHOOK, Op::Create) => {
                // Never a secret made here: a created webhook signs with the secret it names.
                let types: Vec<String> =
                    c.fields.get("eventTypes").and_then(|f| serde_json::from_value(f.to.clone()).ok()).unwrap_or_default();
                let created = ev::WebhookCreated {
                    url: str_field(c, "url")?,
                    event_types: types,
                    description: str_field(c, "description")?,
                    secret_version: 0,
                    secret_id: String::new(),
                    secret_ref: Some(str_field(c, "secretRef")?),
                };
                (
                    format!("{KIND_WEBHOOK}/{}", id.clone().unwrap_or_default()),
                    ExpectedVersion::NoStream,
                    ev::WEBHOOK_CREATED,
                    ev::to_cbor(&created)?,
                )
            }
            (decide::OBJECT_WEBHOOK, Op::Update) => {
                let text = |name: &str| c.fields.get(name).and_then(|f| f.to.as_str()).map(str::to_owned);
                let updated = ev::WebhookUpdated {
                    url: text("url"),
                    event_types: c.fields.get("eventTypes").and_then(|f| serde_json::from_value(f.to.clone()).ok()),
                    description: text("description"),
                    secret_ref: text("secretRef"),
                };
                (
                    format!("{KIND_WEBHOOK}/{}", id.clone().unwrap_or_default()),
                    ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                    ev::WEBHOOK_UPDATED,
                    ev::to_cbor(&updated)?,
                )
            }
            (decide::OBJECT_WEBHOOK, _) => (
                format!("{KIND_WEBHOOK}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::WEBHOOK_DELETED,
                ev::to_cbor(&ev::WebhookDeleted {})?,
            ),
            (decide::OBJECT_PROJECT, _) => (
                format!("{KIND_PROJECT}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::PROJECT_ARCHIVED,
                ev::to_cbor(&ev::ProjectArchived {})?,
            ),
            (decide::OBJECT_QUOTA, _) => {
                // A quota's id is its pool's, drawn above when the plan creates the pool. The
                // change names the limits that differ; the others are the live quota's.
                let pool = c.id.clone().or_else(|| created.get(&(decide::OBJECT_POOL, c.key.clone())).cloned());
                let now = c.id.as_ref().and_then(|p| live.quotas.get(p)).map(QuotaDoc::limits);
                let limit = |name: &str, live: Option<u64>| match c.fields.get(name) {
                    Some(f) => f.to.as_u64(),
                    None => live,
                };
                let small = |v: Option<u64>| v.and_then(|v| u32::try_from(v).ok());
                let set = ev::QuotaSet {
                    gpus: small(limit("gpus", now.as_ref().map(|q| u64::from(q.gpus)))).unwrap_or_default(),
                    instances: small(limit("instances", now.as_ref().and_then(|q| q.instances).map(u64::from))),
                    vcpus: small(limit("vcpus", now.as_ref().and_then(|q| q.vcpus).map(u64::from))),
                    memory_mib: limit("memoryMiB", now.as_ref().and_then(|q| q.memory_mib)),
                    sandboxes: small(limit("sandboxes", now.as_ref().and_then(|q| q.sandboxes).map(u64::from))),
                };
                (format!("{KIND_QUOTA}/{}", pool.unwrap_or_default()), ExpectedVersion::Any, ev::QUOTA_SET, ev::to_cbor(&set)?)
            }
            (decide::OBJECT_FLAVOR, Op::Delete) => (
                format!("{KIND_FLAVOR}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::FLAVOR_DELETED,
                ev::to_cbor(&ev::FlavorDeleted {})?,
            ),
            (decide::OBJECT_FLAVOR, Op::Update) => {
                let u32_field = |name: &str| u64_field(c, name).and_then(|v| u32::try_from(v).ok());
                (
                    format!("{KIND_FLAVOR}/{}", id.clone().unwrap_or_default()),
                    ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                    ev::FLAVOR_UPDATED,
                    ev::to_cbor(&ev::FlavorUpdated {
                        name: c.fields.get("name").map(|_| str_field(c, "name")).transpose()?,
                        vcpus: u32_field("vcpus"),
                        memory_mib: u64_field(c, "memoryMiB"),
                        disk_gib: u64_field(c, "diskGiB"),
                        gpus: u32_field("gpus"),
                    })?,
                )
            }
            (decide::OBJECT_FLAVOR, _) => {
                let pool = str_field(c, "pool")?;
                let pool = if pool.starts_with("pool_") {
                    pool
                } else {
                    created.get(&(decide::OBJECT_POOL, pool.clone())).cloned().unwrap_or(pool)
                };
                let u32_field = |name: &str| u64_field(c, name).and_then(|v| u32::try_from(v).ok()).unwrap_or_default();
                (
                    format!("{KIND_FLAVOR}/{}", id.clone().unwrap_or_default()),
                    ExpectedVersion::NoStream,
                    ev::FLAVOR_CREATED,
                    ev::to_cbor(&ev::FlavorCreated {
                        pool_id: pool,
                        name: str_field(c, "name")?,
                        vcpus: u32_field("vcpus"),
                        memory_mib: u64_field(c, "memoryMiB").unwrap_or_default(),
                        disk_gib: u64_field(c, "diskGiB").unwrap_or_default(),
                        gpus: u32_field("gpus"),
                    })?,
                )
            }
            (decide::OBJECT_IMAGE, Op::Delete) => (
                format!("{KIND_IMAGE}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::IMAGE_DELETED,
                ev::to_cbor(&ev::ImageDeleted {})?,
            ),
            (decide::OBJECT_IMAGE, Op::Update) => (
                format!("{KIND_IMAGE}/{}", id.clone().unwrap_or_default()),
                ExpectedVersion::Exact(c.expects.unwrap_or_default()),
                ev::IMAGE_PROMOTED,
                ev::to_cbor(&ev::ImagePromoted { from: ev::ImageChannel::Testing, to: ev::ImageChannel::Stable })?,
            ),
            (_, _) => {
                let stable = c.fields.get("channel").is_some_and(|f| f.to == serde_json::json!("stable"));
                if stable {
                    // Registered in testing, and promoted in the same append.
                    let promoted = ev::ImagePromoted { from: ev::ImageChannel::Testing, to: ev::ImageChannel::Stable };
                    then = Some(NewEvent::new(ev::IMAGE_PROMOTED, ev::to_cbor(&promoted)?));
                }
                let disk_format: DiskFormatView = c
                    .fields
                    .get("diskFormat")
                    .and_then(|f| serde_json::from_value(f.to.clone()).ok())
                    .ok_or_else(|| Error::Internal("fleet plan: diskFormat".into()))?;
                (
                    format!("{KIND_IMAGE}/{}", id.clone().unwrap_or_default()),
                    ExpectedVersion::NoStream,
                    ev::IMAGE_REGISTERED,
                    ev::to_cbor(&ev::ImageRegistered {
                        name: str_field(c, "name")?,
                        url: str_field(c, "url")?,
                        sha256: str_field(c, "sha256")?,
                        disk_format: disk_format.into(),
                        size_bytes: u64_field(c, "sizeBytes"),
                    })?,
                )
            }
        };
        appended.push(stream.clone());
        let events = std::iter::once(NewEvent::new(event_type, payload)).chain(then).collect();
        let mut request = call.request(tenant, stream, expected, events);
        // The call's idempotency key names the whole apply: it goes on the fleet's own append.
        request.idempotency_key = None;
        requests.push(request);
    }
    let (created_n, updated, deleted) = counts(plan);
    let objects = decide::applied_objects(plan, &created);
    let mut events = vec![NewEvent::new(
        FLEET_APPLIED,
        ev::to_cbor(&FleetApplied {
            plan_hash: plan.plan_hash.clone(),
            document_sha256: plan.document_sha256.clone(),
            created: created_n,
            updated,
            deleted,
            objects: objects.len() as u32,
        })?,
    )];
    for chunk in objects.chunks(FLEET_OBJECTS_PER_EVENT) {
        events.push(NewEvent::new(FLEET_OBJECTS, ev::to_cbor(&FleetObjects { objects: chunk.to_vec() })?));
    }
    let fleet_stream = format!("{KIND_FLEET}/{FLEET_STREAM_ID}");
    let expected = if plan.fleet_version == 0 { ExpectedVersion::NoStream } else { ExpectedVersion::Exact(plan.fleet_version) };
    let mut request = call.request(tenant, fleet_stream, expected, events);
    request.guards = plan
        .reads
        .iter()
        .filter(|(stream, _)| !stream.starts_with(&format!("{KIND_QUOTA}/")) && !appended.contains(stream))
        .map(|(stream, version)| (stream.clone(), ExpectedVersion::Exact(*version)))
        .collect();
    requests.push(request);
    Ok((requests, created))
}

/// What applying a plan's offers reads first: the owner's live reservations and, per pool, each
/// withdrawn tenant's quota stream version (`decide::pool_offer::pool_unoffer`). Every tenant an
/// offer adds must exist.
#[derive(Default)]
struct OfferReads {
    live: Vec<bc_projections::ReservationDoc>,
    quota_versions: BTreeMap<String, BTreeMap<String, u64>>,
}

/// The sets an offer change goes from and to.
fn offer_sets(c: &Change) -> Result<(BTreeSet<String>, BTreeSet<String>)> {
    let f = c.fields.get("offeredTo").ok_or_else(|| Error::Internal("fleet plan: offeredTo".into()))?;
    let set = |v: &Value| -> Result<BTreeSet<String>> {
        serde_json::from_value(v.clone()).map_err(|e| Error::Internal(format!("fleet plan: offeredTo: {e}")))
    };
    Ok((set(&f.from)?, set(&f.to)?))
}

async fn offer_reads(call: &Call<'_>, tenant: TenantId, plan: &FleetPlan) -> Result<OfferReads> {
    let mut reads = OfferReads::default();
    let mut withdrawn = Vec::new();
    for c in plan.changes.iter().filter(|c| c.kind == decide::OBJECT_OFFER) {
        let (from, to) = offer_sets(c)?;
        for t in to.difference(&from) {
            let id: TenantId = parse_id("offeredTo", t)?;
            if call.state.store.row_get(&id.to_string(), bc_projections::KIND_TENANT, &id.to_string()).await?.is_none() {
                return Err(Error::not_found(format!("tenant {id} (document.pools.{}.offeredTo); nothing was applied", c.key)));
            }
        }
        if let Some(pool) = &c.id {
            for t in from.difference(&to) {
                withdrawn.push((pool.clone(), parse_id::<TenantId>("offeredTo", t)?));
            }
        }
    }
    if withdrawn.is_empty() {
        return Ok(reads);
    }
    let streams = withdrawn.iter().map(|(pool, t)| (*t, format!("{KIND_QUOTA}/{pool}"))).collect();
    let read = call.state.store.preread(&bc_core::store::PreReadQuery { streams, ..Default::default() }).await?;
    for ((t, stream), version) in read.stream_versions {
        let pool = stream.trim_start_matches(&format!("{KIND_QUOTA}/")).to_owned();
        reads.quota_versions.entry(pool).or_default().insert(t.to_string(), version);
    }
    // After the quota versions: see `decide::pool_offer`.
    reads.live = call.state.fleet.with_tenant(&*call.state.store, tenant, |view| view.live().values().cloned().collect()).await?;
    Ok(reads)
}

/// The appends of one offer change: `pools.offer` of the tenants it adds, `pools.unoffer` of
/// those it withdraws, each tenant's on its own chain (without the call's key). The first
/// append on the pool's stream expects the version the plan read unless the plan changes the
/// pool first (that change's append expects it).
fn offer_requests(
    call: &Call<'_>,
    tenant: TenantId,
    c: &Change,
    pool_id: &str,
    pool_changed: bool,
    live: &FleetLive,
    offers: &OfferReads,
) -> Result<Vec<AppendRequest>> {
    let (from, to) = offer_sets(c)?;
    let mut pool = match live.pools.iter().find(|p| p.pool_id == pool_id) {
        Some(p) => p.clone(),
        None => PoolDoc {
            tenant_id: tenant.to_string(),
            pool_id: pool_id.to_owned(),
            name: String::new(),
            description: String::new(),
            labels: BTreeMap::new(),
            max_reservation_s: bc_projections::MAX_RESERVATION_S_DEFAULT,
            archived: false,
            site_id: None,
            offered_to: BTreeSet::new(),
            version: 0,
            created_at_ms: 0,
            updated_at_ms: 0,
        },
    };
    let mut appends = Vec::new();
    let added: BTreeSet<String> = to.difference(&from).cloned().collect();
    let removed: BTreeSet<String> = from.difference(&to).cloned().collect();
    if let Some(offered) = bc_projections::decide::pool_offer::pool_offer(&pool, &added)? {
        appends.extend(offered.into_appends(&pool.tenant_id));
        pool.offered_to.extend(added);
    }
    let no_versions = BTreeMap::new();
    let versions = offers.quota_versions.get(pool_id).unwrap_or(&no_versions);
    if let Some(withdrawn) = bc_projections::decide::pool_offer::pool_unoffer(&pool, &removed, &offers.live, versions)? {
        appends.extend(withdrawn.into_appends(&pool.tenant_id));
    }
    let pool_stream = format!("{KIND_POOL}/{pool_id}");
    let mut first_on_pool = true;
    let mut requests = Vec::with_capacity(appends.len());
    for (t, mut append) in appends {
        let on = parse_id::<TenantId>("tenantId", &t)?;
        if on == tenant && append.stream == pool_stream {
            if pool_changed || !first_on_pool {
                append.expected = ExpectedVersion::Any;
            }
            first_on_pool = false;
        }
        let mut request = call.decided(on, append);
        request.idempotency_key = None;
        request.fingerprint = None;
        requests.push(request);
    }
    Ok(requests)
}

fn labels_field(c: &Change) -> Result<Option<BTreeMap<String, String>>> {
    c.fields
        .get("labels")
        .map(|f| serde_json::from_value(f.to.clone()).map_err(|e| Error::Internal(format!("fleet plan: labels: {e}"))))
        .transpose()
}

async fn fleet_status(call: &Call<'_>, input: FleetExport) -> Result<FleetStatusView> {
    root_only(call)?;
    let tenant = call.tenant(&input.tenant_id).await?;
    let live = read_live(call, tenant).await?;
    let drift = decide::fleet_drift(&live);
    let applied = live.applied.as_ref();
    Ok(FleetStatusView {
        applied: applied.is_some(),
        plan_hash: applied.map(|a| a.plan_hash.clone()),
        applied_at_ms: applied.map(|a| a.applied_at_ms),
        objects: applied.map_or(0, |a| a.objects.len() as u32),
        drift: drift.into_iter().map(drift_view).collect(),
        recorded_drift: applied.map_or(0, |a| a.drift_count),
        recorded_at_ms: applied.and_then(|a| a.drift_at_ms),
    })
}

/// The FleetConfig document's JSON Schema (draft 2020-12), as `schema/fleet-config.schema.json`
/// holds it: what `fleet export` validates against and what a reviewer's tools can check with.
pub fn fleet_config_schema() -> Value {
    let settings = schemars::generate::SchemaSettings::draft2020_12();
    let schema = settings.into_generator().into_root_schema_for::<FleetDocument>();
    let mut value = serde_json::to_value(schema).expect("a schema is JSON");
    if let Value::Object(map) = &mut value {
        map.insert("$id".into(), Value::String("https://better-compute.dev/schema/fleet-config.schema.json".into()));
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `offeredTo` names each tenant once: a repeat is refused as the schema's `uniqueItems`
    /// says, not made a set behind the caller's back (schemathesis sent one).
    #[test]
    fn offered_to_refuses_a_tenant_named_twice() {
        let t = "ten_01j00000000000000000000000";
        let pool = |offered: Value| serde_json::json!({ "name": "gpu-a", "offeredTo": offered });
        let once: FleetPool = serde_json::from_value(pool(serde_json::json!([t]))).unwrap();
        assert_eq!(once.offered_to, Some(BTreeSet::from([t.to_owned()])));
        let twice = serde_json::from_value::<FleetPool>(pool(serde_json::json!([t, t]))).unwrap_err();
        assert!(twice.to_string().contains("more than once"), "{twice}");
        let absent: FleetPool = serde_json::from_value(serde_json::json!({ "name": "gpu-a" })).unwrap();
        assert_eq!(absent.offered_to, None);
    }

    /// The checked-in schema is the one the code makes (`BC_BLESS=1` writes it again).
    #[test]
    fn the_checked_in_fleet_config_schema_is_current() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../schema/fleet-config.schema.json");
        let now = serde_json::to_string_pretty(&fleet_config_schema()).unwrap() + "\n";
        if std::env::var_os("BC_BLESS").is_some() {
            std::fs::write(&path, &now).unwrap();
        }
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            checked_in == now,
            "schema/fleet-config.schema.json is stale: run BC_BLESS=1 cargo test -p bc-gateway --lib fleet"
        );
    }

    #[test]
    fn keys_are_the_fleets_own_or_ids_of_their_kind() {
        for ok in ["gpu-a", "a", "pool.1", "pool_01hzz0000000000000000000ab"] {
            assert!(check_key("pool", "pools", ok).is_ok(), "{ok}");
        }
        for bad in
            ["", "-a", "Gpu", "gpu_a", "flv_01hzz0000000000000000000ab", "pool_81hzz0000000000000000000ab", &"a".repeat(64)]
        {
            assert!(check_key("pool", "pools", bad).is_err(), "{bad}");
        }
    }
}
