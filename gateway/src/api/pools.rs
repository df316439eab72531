//! `pools.*`: pools of capacity inside a tenant. Nodes register into a pool; reservations are
//! placed within one.

use std::collections::BTreeMap;

use bc_core::id::PoolId;
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{KIND_POOL, PoolDoc, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::expected_version;
use super::paging::{Page, list_input};
use super::resource::list_where;
use super::validate::{
    DESCRIPTION_CHARS_MAX, DescriptionText, LabelsMap, NameText, PoolIdText, TenantIdText, VersionNumber, validate_labels,
    validate_name, validate_text,
};
use super::views::PoolView;
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:pools:read");
const WRITE: Access = Access::Action("compute:pools:write");

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
];

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
    let pool = PoolId::from_ulid(call.ulid());
    let payload = ev::to_cbor(&ev::PoolCreated {
        name: input.name,
        description: input.description,
        labels: input.labels,
        max_reservation_s: check_max_reservation(input.max_reservation_s)?,
    })?;
    let result = call.append(tenant, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, ev::POOL_CREATED, payload).await?;
    Ok(call.created::<PoolDoc>(tenant, &result).await?.into())
}

async fn pools_get(call: &Call<'_>, input: PoolRef) -> Result<PoolView> {
    Ok(call.named::<PoolDoc>(&input.tenant_id, &input.pool_id).await?.into())
}

async fn pools_list(call: &Call<'_>, input: PoolsList) -> Result<Page<PoolView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let include_archived = input.include_archived;
    list_where(call, tenant, input.limit, input.cursor.as_deref(), |p: &PoolDoc| include_archived || !p.archived).await
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
