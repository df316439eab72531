//! `sites.*`: where machines are. A site is a name unique in its tenant, a region and labels
//! (`site/site_…`). Pools may name their site when they are made (`pools.create --site`), and
//! bare-metal machines when they are enrolled (`metal.enroll`'s `siteId`, else their pool's);
//! each create is guarded on the site's stream, so nothing is made at a site already deleted.
//! A site's name and labels change in place; its region does not (a site elsewhere is another
//! site). A delete is refused `INVALID_STATE` while a live pool or a machine not retired names
//! the site, naming them, as `secrets.delete` names a secret's referrers.

use std::collections::BTreeMap;

use bc_core::id::{SiteId, TenantId};
use bc_core::{Error, Result};
use bc_projections::decide::site::{SITES_PER_TENANT_MAX, machine_holds_site, site_create, site_delete, site_update};
use bc_projections::events as ev;
use bc_projections::site::{KIND_SITE, SiteDoc};
use bc_projections::workflow::{KIND_METAL, MetalDoc};
use bc_projections::{KIND_POOL, PoolDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::call::{check_if_version, doc};
use super::paging::{Page, list_input};
use super::resource::{Resource, list_all};
use super::validate::{LabelsMap, NameText, SiteIdText, TenantIdText, VersionNumber, validate_labels, validate_name};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:sites:read");
const WRITE: Access = Access::Action("compute:sites:write");
const _: () = assert!(SITES_PER_TENANT_MAX as u32 <= bc_core::store::READ_ROWS_MAX);

pub(super) const METHODS: &[Method] = &[
    method!("sites.create", WRITE, "create a site: a name, a region and labels", SitesCreate => SiteView, sites_create),
    method!("sites.get", READ, "one site", SiteRef => SiteView, sites_get),
    method!("sites.list", READ, "a tenant's sites, paged by cursor", SitesList => Page<SiteView>, sites_list),
    method!(
        "sites.update",
        WRITE,
        "change a site's name or labels in place; not its region",
        SitesUpdate => SiteView,
        sites_update,
    ),
    method!(
        "sites.delete",
        WRITE,
        "delete a site; refused while a live pool names it",
        SiteRef => SiteDeletedView,
        sites_delete,
    ),
];

impl Resource for SiteDoc {
    const KIND: &'static str = KIND_SITE;
    const WHAT: &'static str = "site";
    const ID_FIELD: &'static str = "siteId";
    type Id = SiteId;
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SitesCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Unique within the tenant.
    #[schemars(with = "NameText")]
    name: String,
    /// Where it is (`eu-west-1`, `fra`): a name, fixed for the site's life.
    #[schemars(with = "NameText")]
    region: String,
    #[serde(default)]
    #[schemars(with = "LabelsMap")]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SiteRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SiteIdText")]
    site_id: String,
    /// Act only while the site is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

/// At least one of `name`, `labels`, not `null`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("anyOf" = [
    { "required": ["name"], "properties": { "name": { "type": "string" } } },
    { "required": ["labels"], "properties": { "labels": { "type": "object" } } },
]))]
pub struct SitesUpdate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "SiteIdText")]
    site_id: String,
    /// Act only while the site is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    /// Unique within the tenant.
    #[schemars(with = "Option<NameText>")]
    name: Option<String>,
    /// The site's labels, all of them (they replace the ones it has).
    #[schemars(with = "Option<LabelsMap>")]
    labels: Option<BTreeMap<String, String>>,
}

list_input!(SitesList {});

/// A site as the API shows it.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteView {
    #[schemars(with = "SiteIdText")]
    pub site_id: String,
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "NameText")]
    pub region: String,
    #[schemars(with = "LabelsMap")]
    pub labels: BTreeMap<String, String>,
    /// The stream's version, for `ifVersion`.
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<SiteDoc> for SiteView {
    fn from(d: SiteDoc) -> Self {
        Self {
            site_id: d.site_id,
            tenant_id: d.tenant_id,
            name: d.name,
            region: d.region,
            labels: d.labels,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SiteDeletedView {
    #[schemars(with = "SiteIdText")]
    pub site_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub deleted: bool,
}

/// The tenant's sites (at most [`SITES_PER_TENANT_MAX`]).
pub(super) async fn tenant_sites(call: &Call<'_>, tenant: TenantId) -> Result<Vec<SiteDoc>> {
    let rows = call.state.store.row_list(&tenant.to_string(), KIND_SITE, None, SITES_PER_TENANT_MAX as u32).await?;
    rows.into_iter().map(doc::<SiteDoc>).collect()
}

/// The site `site_id` of `tenant`, or `NOT_FOUND`.
pub(super) async fn site_doc(call: &Call<'_>, tenant: TenantId, site_id: &SiteId) -> Result<SiteDoc> {
    call.row(tenant, KIND_SITE, &site_id.to_string(), "site").await
}

/// What names `site_id` in `tenant`: `pool/pool_…` for each live pool made at it, then
/// `metal/node_…` for each machine at it not retired (`decide::site::machine_holds_site`).
async fn referrers(call: &Call<'_>, tenant: TenantId, site_id: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    each_row(call, tenant, KIND_POOL, |pool: PoolDoc| {
        if !pool.archived && pool.site_id.as_deref() == Some(site_id) {
            out.push(format!("{KIND_POOL}/{}", pool.pool_id));
        }
    })
    .await?;
    each_row(call, tenant, KIND_METAL, |machine: MetalDoc| {
        if machine_holds_site(&machine, site_id) {
            out.push(format!("{KIND_METAL}/{}", machine.node_id));
        }
    })
    .await?;
    Ok(out)
}

/// Hands `visit` every row of `kind` of `tenant`, a page of [`bc_core::store::READ_ROWS_MAX`]
/// at a time.
pub(super) async fn each_row<T: serde::de::DeserializeOwned>(
    call: &Call<'_>,
    tenant: TenantId,
    kind: &str,
    mut visit: impl FnMut(T),
) -> Result<()> {
    let mut after: Option<String> = None;
    loop {
        let rows = call.state.store.row_list(&tenant.to_string(), kind, after.as_deref(), bc_core::store::READ_ROWS_MAX).await?;
        let full = rows.len() == bc_core::store::READ_ROWS_MAX as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            visit(doc(row)?);
        }
        if !full {
            return Ok(());
        }
    }
}

async fn sites_create(call: &Call<'_>, input: SitesCreate) -> Result<SiteView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    validate_name("region", &input.region)?;
    validate_labels(&input.labels)?;
    // Names are checked and taken under the tenant's lock, as flavors' are; a retry is
    // answered from the log by its idempotency key, whatever the sites say now.
    let _names = call.state.name_locks.lock(tenant).await;
    let existing = if call.is_retry(tenant).await? { Vec::new() } else { tenant_sites(call, tenant).await? };
    let append = site_create(&existing, SiteId::from_ulid(call.ulid()), &input.name, &input.region, input.labels)?;
    let result = call.submit(call.decided(tenant, append)).await?;
    Ok(call.created::<SiteDoc>(tenant, &result).await?.into())
}

async fn sites_get(call: &Call<'_>, input: SiteRef) -> Result<SiteView> {
    check_if_version(input.if_version)?;
    Ok(call.named::<SiteDoc>(&input.tenant_id, &input.site_id).await?.into())
}

async fn sites_list(call: &Call<'_>, input: SitesList) -> Result<Page<SiteView>> {
    list_all::<SiteDoc, _>(call, &input.tenant_id, input.limit, input.cursor.as_deref()).await
}

async fn sites_update(call: &Call<'_>, input: SitesUpdate) -> Result<SiteView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let site_id: SiteId = super::body::parse_id("siteId", &input.site_id)?;
    check_if_version(input.if_version)?;
    if input.name.is_none() && input.labels.is_none() {
        return Err(Error::invalid("nothing to update: give name or labels (a site's region does not change)"));
    }
    if let Some(name) = &input.name {
        validate_name("name", name)?;
    }
    if let Some(labels) = &input.labels {
        validate_labels(labels)?;
    }
    let _names = call.state.name_locks.lock(tenant).await;
    let current = site_doc(call, tenant, &site_id).await?;
    // A retry's `ifVersion` was checked by the first request, whose version it then moved.
    let if_version = if call.is_retry(tenant).await? { None } else { input.if_version };
    let existing = tenant_sites(call, tenant).await?;
    let change = ev::SiteUpdated { name: input.name, labels: input.labels };
    if let Some(append) = site_update(&existing, &current, if_version, change)? {
        call.submit(call.decided(tenant, append)).await?;
    }
    Ok(site_doc(call, tenant, &site_id).await?.into())
}

async fn sites_delete(call: &Call<'_>, input: SiteRef) -> Result<SiteDeletedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let site_id: SiteId = super::body::parse_id("siteId", &input.site_id)?;
    check_if_version(input.if_version)?;
    // Under the names' lock, which a pool made at a site also takes: in this process a pool
    // cannot name the site between the check and the delete (across gateway processes it can,
    // as with secrets: the pool's create guards the site's version, which a delete does not
    // move until it lands).
    let _names = call.state.name_locks.lock(tenant).await;
    let site = site_doc(call, tenant, &site_id).await?;
    let referring = referrers(call, tenant, &site.site_id).await?;
    let append = site_delete(&site, input.if_version, &referring)?;
    call.submit(call.decided(tenant, append)).await?;
    Ok(SiteDeletedView { site_id: site.site_id, name: site.name, deleted: true })
}
