//! `pools.*`: pools of capacity inside a tenant. Nodes register into a pool; reservations are
//! placed within one.
//!
//! A pool's owner may offer it to other tenants (`pools.offer`, `pools.unoffer`, decided as
//! `compute:pools:admin`; `decide::pool_offer` states what guards what). An offered tenant sees
//! the pool in its own `pools.list` and `pools.get`, marked `offered` and read-only, and
//! reserves from it under its own quota in it.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::id::{PoolId, TenantId};
use bc_core::store::{AppendRequest, ExpectedVersion, PreReadQuery};
use bc_core::{Error, Result};
use bc_projections::decide::pool_offer::{OFFERS_PER_POOL_MAX, pool_offer, pool_unoffer};
use bc_projections::events as ev;
use bc_projections::{KIND_POOL, KIND_POOL_OFFER, KIND_QUOTA, KIND_TENANT, PoolDoc, PoolOfferDoc, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::expected_version;
use super::paging::{Page, list_input, list_rows, merge_pages};
use super::resource::list_where;
use super::validate::{
    DESCRIPTION_CHARS_MAX, DescriptionText, LabelsMap, NameText, PoolIdText, TenantIdText, VersionNumber, validate_labels,
    validate_name, validate_text,
};
use super::views::PoolView;
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:pools:read");
const WRITE: Access = Access::Action("compute:pools:write");
const ADMIN: Access = Access::Action("compute:pools:admin");

/// The shortest and the longest reservation a pool may allow: a minute and a year.
pub const MAX_RESERVATION_S_MIN: u64 = 60;
pub const MAX_RESERVATION_S_LIMIT: u64 = 366 * 24 * 3600;

pub(super) const METHODS: &[Method] = &[
    method!("pools.create", WRITE, "create a pool", PoolsCreate => PoolView, pools_create),
    method!("pools.get", READ, "one pool", PoolRef => PoolView, pools_get),
    method!("pools.list", READ, "a tenant's pools, paged by cursor", PoolsList => Page<PoolView>, pools_list),
    method!(
        "pools.update",
        WRITE,
        "change a pool's name, description or labels",
        PoolsUpdate => PoolView,
        pools_update,
    ),
    method!("pools.archive", WRITE, "archive a pool", PoolRef => PoolView, pools_archive),
    method!(
        "pools.offer",
        ADMIN,
        "offer a pool to other tenants, who reserve from it under their own quota",
        PoolsOffer => PoolView,
        pools_offer,
    ),
    method!(
        "pools.unoffer",
        ADMIN,
        "withdraw a pool's offer: live reservations run to their end, queued ones are cancelled",
        PoolsOffer => PoolView,
        pools_unoffer,
    ),
];

/// `pools.offer` / `pools.unoffer`: the pool (the caller's tenant's, or `tenantId`'s) and the
/// tenants, 1 to [`OFFERS_PER_POOL_MAX`] of them.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolsOffer {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    /// The tenants offered (or no longer), other than the pool's owner.
    #[schemars(with = "Vec<TenantIdText>", length(min = 1, max = OFFERS_PER_POOL_MAX))]
    tenant_ids: Vec<String>,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolsCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NameText")]
    name: String,
    #[serde(default)]
    #[schemars(with = "DescriptionText")]
    description: String,
    #[serde(default)]
    #[schemars(with = "LabelsMap")]
    labels: BTreeMap<String, String>,
    /// The longest reservation the pool grants, in seconds (60 to a year; default 30 days).
    #[schemars(range(min = MAX_RESERVATION_S_MIN, max = MAX_RESERVATION_S_LIMIT))]
    max_reservation_s: Option<u64>,
    /// The site its machines are at (`sites.*`, the tenant's own); fixed for the pool's life.
    #[schemars(with = "Option<super::validate::SiteIdText>")]
    site_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    /// Act only while the pool is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

/// At least one of `name`, `description`, `labels`, `maxReservationS`, not `null`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("anyOf" = [
    { "required": ["name"], "properties": { "name": { "type": "string" } } },
    { "required": ["description"], "properties": { "description": { "type": "string" } } },
    { "required": ["labels"], "properties": { "labels": { "type": "object" } } },
    { "required": ["maxReservationS"], "properties": { "maxReservationS": { "type": "integer" } } },
]))]
pub struct PoolsUpdate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    #[schemars(with = "Option<NameText>")]
    name: Option<String>,
    #[schemars(with = "Option<DescriptionText>")]
    description: Option<String>,
    #[schemars(with = "Option<LabelsMap>")]
    labels: Option<BTreeMap<String, String>>,
    #[schemars(range(min = MAX_RESERVATION_S_MIN, max = MAX_RESERVATION_S_LIMIT))]
    max_reservation_s: Option<u64>,
}

list_input!(PoolsList {
    /// Archived pools too.
    #[serde(default)]
    include_archived: bool,
});

/// A pool as a tenant may use it: its own, or one another tenant offered to it.
pub(super) struct UsablePool {
    pub doc: PoolDoc,
    /// The tenant whose chain holds the pool (and the reservations made in it).
    pub owner: TenantId,
    /// Another tenant's pool, offered to the caller's tenant.
    pub offered: bool,
}

/// `tenant`'s own pool `pool`, else a pool offered to it and still offered, else `NOT_FOUND`.
/// Reading the owner's row needs no right on the owner's tenant: the offer is the right.
pub(super) async fn usable_pool(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<UsablePool> {
    let store = &call.state.store;
    if let Some(row) = store.row_get(&tenant.to_string(), KIND_POOL, pool).await? {
        return Ok(UsablePool { doc: super::call::doc(row)?, owner: tenant, offered: false });
    }
    if let Some(offer) = offered_row(call, tenant, pool).await? {
        let owner: TenantId = parse_id("tenantId", &offer.owner_tenant_id)?;
        let doc: PoolDoc = call.row(owner, KIND_POOL, pool, "pool").await?;
        if doc.offered_to.contains(&tenant.to_string()) {
            return Ok(UsablePool { doc, owner, offered: true });
        }
    }
    Err(Error::not_found(format!("pool {pool}")))
}

/// The row of `pool` as offered to `tenant`, while offered.
async fn offered_row(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<Option<PoolOfferDoc>> {
    let row = call.state.store.row_get(&tenant.to_string(), KIND_POOL_OFFER, pool).await?;
    Ok(row.map(super::call::doc::<PoolOfferDoc>).transpose()?.filter(|o| o.offered))
}

/// The tenants of an offer, parsed, existing, deduplicated and bounded.
async fn offer_tenants(call: &Call<'_>, tenant_ids: &[String]) -> Result<BTreeSet<String>> {
    if tenant_ids.is_empty() || tenant_ids.len() > OFFERS_PER_POOL_MAX {
        return Err(Error::invalid(format!("tenantIds must name 1 to {OFFERS_PER_POOL_MAX} tenants, not {}", tenant_ids.len())));
    }
    let mut set = BTreeSet::new();
    for t in tenant_ids {
        let id: TenantId = parse_id("tenantIds", t)?;
        if call.state.store.row_get(&id.to_string(), KIND_TENANT, &id.to_string()).await?.is_none() {
            return Err(Error::not_found(format!("tenant {id}")));
        }
        set.insert(id.to_string());
    }
    Ok(set)
}

/// Appends an offer's or unoffer's group: the owner's append with this call's idempotency key,
/// each offered tenant's without (a key of the owner's call must not take a name in another
/// tenant's space).
async fn append_offers(call: &Call<'_>, appends: Vec<(String, bc_projections::decide::Append)>) -> Result<()> {
    let mut requests: Vec<AppendRequest> = Vec::with_capacity(appends.len());
    for (n, (tenant, append)) in appends.into_iter().enumerate() {
        let tenant: TenantId = parse_id("tenantId", &tenant)?;
        let mut request = call.decided(tenant, append);
        if n > 0 {
            request.idempotency_key = None;
            request.fingerprint = None;
        }
        requests.push(request);
    }
    call.state.log.append_group(requests).await?;
    Ok(())
}

/// The owner's pool for an offer, checked against `ifVersion`.
async fn offer_pool(call: &Call<'_>, input: &PoolsOffer) -> Result<(TenantId, PoolDoc, BTreeSet<String>)> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool: PoolId = parse_id("poolId", &input.pool_id)?;
    let tenants = offer_tenants(call, &input.tenant_ids).await?;
    let doc = pool_doc(call, tenant, &pool.to_string()).await?;
    expected_version(input.if_version, doc.version, &stream_of(KIND_POOL, &pool))?;
    Ok((tenant, doc, tenants))
}

async fn pools_offer(call: &Call<'_>, input: PoolsOffer) -> Result<PoolView> {
    let (tenant, doc, tenants) = offer_pool(call, &input).await?;
    // None: every tenant named is offered the pool already; offering again changes nothing.
    if let Some(appends) = pool_offer(&doc, &tenants)? {
        append_offers(call, appends.into_appends(&doc.tenant_id)).await?;
    }
    Ok(pool_doc_fresh(call, tenant, &doc.pool_id).await?.into())
}

/// Withdraws the offer; `decide::pool_offer::pool_unoffer` says what happens to the tenants'
/// reservations. Each tenant's quota stream version is read before the owner's view of its live
/// reservations, so a reservation landing after the view was read moves a version the append
/// guards (a CONFLICT: call again).
async fn pools_unoffer(call: &Call<'_>, input: PoolsOffer) -> Result<PoolView> {
    let (tenant, doc, tenants) = offer_pool(call, &input).await?;
    let quota_stream = stream_of(KIND_QUOTA, &doc.pool_id);
    let mut streams = Vec::new();
    for t in tenants.iter().filter(|t| doc.offered_to.contains(*t)) {
        streams.push((parse_id::<TenantId>("tenantIds", t)?, quota_stream.clone()));
    }
    let read = call.state.store.preread(&PreReadQuery { streams, ..Default::default() }).await?;
    let quota_versions: BTreeMap<String, u64> =
        read.stream_versions.into_iter().map(|((t, _), version)| (t.to_string(), version)).collect();
    let decided = call
        .state
        .fleet
        .with_tenant(&*call.state.store, tenant, |view| pool_unoffer(&doc, &tenants, view.live().values(), &quota_versions))
        .await??;
    if let Some(appends) = decided {
        append_offers(call, appends.into_appends(&doc.tenant_id)).await?;
    }
    Ok(pool_doc_fresh(call, tenant, &doc.pool_id).await?.into())
}

/// The pool's document as stored now (after a group append, which [`Call::row`] does not see).
async fn pool_doc_fresh(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<PoolDoc> {
    let row = call.state.store.row_get(&tenant.to_string(), KIND_POOL, pool).await?;
    super::call::doc(row.ok_or_else(|| Error::not_found(format!("pool {pool}")))?)
}

fn check_max_reservation(value: Option<u64>) -> Result<Option<u64>> {
    match value {
        Some(s) if !(MAX_RESERVATION_S_MIN..=MAX_RESERVATION_S_LIMIT).contains(&s) => Err(Error::invalid(format!(
            "maxReservationS must be {MAX_RESERVATION_S_MIN} to {MAX_RESERVATION_S_LIMIT} (a year), not {s}"
        ))),
        other => Ok(other),
    }
}

/// The pool's document, or `NOT_FOUND`.
pub(super) async fn pool_doc(call: &Call<'_>, tenant: bc_core::id::TenantId, pool: &str) -> Result<PoolDoc> {
    call.row(tenant, KIND_POOL, pool, "pool").await
}

async fn pools_create(call: &Call<'_>, input: PoolsCreate) -> Result<PoolView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    validate_text("description", &input.description, DESCRIPTION_CHARS_MAX)?;
    validate_labels(&input.labels)?;
    let max_reservation_s = check_max_reservation(input.max_reservation_s)?;
    let site_id: Option<bc_core::id::SiteId> = input.site_id.as_deref().map(|s| parse_id("siteId", s)).transpose()?;
    // A pool made at a site guards the site's version (a site deleted meanwhile is a
    // CONFLICT), under the names' lock `sites.delete` takes while it looks for referrers.
    let _names = match site_id {
        Some(_) => Some(call.state.name_locks.lock(tenant).await),
        None => None,
    };
    let mut guards = Vec::new();
    if let Some(site_id) = &site_id {
        let site = super::sites::site_doc(call, tenant, site_id).await?;
        guards.push((stream_of(bc_projections::site::KIND_SITE, site_id), ExpectedVersion::Exact(site.version)));
    }
    let pool = PoolId::from_ulid(call.ulid());
    let payload = ev::to_cbor(&ev::PoolCreated {
        name: input.name,
        description: input.description,
        labels: input.labels,
        max_reservation_s,
        site_id: site_id.map(|s| s.to_string()),
    })?;
    let result = call
        .append_guarded(tenant, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, ev::POOL_CREATED, payload, guards)
        .await?;
    Ok(call.created::<PoolDoc>(tenant, &result).await?.into())
}

/// The tenant's own pool, or one offered to it (marked `offered`).
async fn pools_get(call: &Call<'_>, input: PoolRef) -> Result<PoolView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool: PoolId = parse_id("poolId", &input.pool_id)?;
    let usable = usable_pool(call, tenant, &pool.to_string()).await?;
    let view = PoolView::from(usable.doc);
    Ok(if usable.offered { view.as_offered() } else { view })
}

/// The tenant's own pools and the pools offered to it (marked `offered`), merged in one order
/// by pool id, so one cursor pages through both.
async fn pools_list(call: &Call<'_>, input: PoolsList) -> Result<Page<PoolView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let include_archived = input.include_archived;
    let cursor = input.cursor.as_deref();
    let own: Page<PoolView> =
        list_where(call, tenant, input.limit, cursor, |p: &PoolDoc| include_archived || !p.archived).await?;
    let offers = list_rows(call, tenant, KIND_POOL_OFFER, input.limit, cursor, |row| {
        Ok(Some(super::call::doc::<PoolOfferDoc>(row)?).filter(|o| o.offered))
    })
    .await?;
    if offers.items.is_empty() && offers.next_cursor.is_none() {
        return Ok(own);
    }
    let mut offered = Vec::new();
    for offer in offers.items {
        let Ok(owner) = parse_id::<TenantId>("tenantId", &offer.owner_tenant_id) else { continue };
        let Some(row) = call.state.store.row_get(&owner.to_string(), KIND_POOL, &offer.pool_id).await? else { continue };
        let doc: PoolDoc = super::call::doc(row)?;
        if doc.offered_to.contains(&tenant.to_string()) && (include_archived || !doc.archived) {
            offered.push(PoolView::from(doc).as_offered());
        }
    }
    merge_pages(own, offered, offers.next_cursor, input.limit, |p| p.pool_id.as_str())
}

async fn pools_update(call: &Call<'_>, input: PoolsUpdate) -> Result<PoolView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool: PoolId = parse_id("poolId", &input.pool_id)?;
    if let Some(name) = &input.name {
        validate_name("name", name)?;
    }
    if let Some(description) = &input.description {
        validate_text("description", description, DESCRIPTION_CHARS_MAX)?;
    }
    if let Some(labels) = &input.labels {
        validate_labels(labels)?;
    }
    let max_reservation_s = check_max_reservation(input.max_reservation_s)?;
    if input.name.is_none() && input.description.is_none() && input.labels.is_none() && max_reservation_s.is_none() {
        return Err(Error::invalid("nothing to update: give name, description, labels or maxReservationS"));
    }
    let current = pool_doc(call, tenant, &pool.to_string()).await?;
    if current.archived {
        return Err(Error::Conflict {
            stream: stream_of(KIND_POOL, &pool),
            expected: "a live pool".into(),
            actual: current.version,
        });
    }
    let stream = stream_of(KIND_POOL, &pool);
    let expected = expected_version(input.if_version, current.version, &stream)?;
    let payload = ev::to_cbor(&ev::PoolUpdated {
        name: input.name,
        description: input.description,
        labels: input.labels,
        max_reservation_s,
    })?;
    call.append(tenant, stream, expected, ev::POOL_UPDATED, payload).await?;
    Ok(pool_doc(call, tenant, &pool.to_string()).await?.into())
}

async fn pools_archive(call: &Call<'_>, input: PoolRef) -> Result<PoolView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool: PoolId = parse_id("poolId", &input.pool_id)?;
    let current = pool_doc(call, tenant, &pool.to_string()).await?;
    if !current.archived {
        // Archiving an archived pool again changes nothing, whatever version it names.
        let stream = stream_of(KIND_POOL, &pool);
        let expected = expected_version(input.if_version, current.version, &stream)?;
        call.append(tenant, stream, expected, ev::POOL_ARCHIVED, ev::to_cbor(&ev::PoolArchived {})?).await?;
    }
    Ok(pool_doc(call, tenant, &pool.to_string()).await?.into())
}
