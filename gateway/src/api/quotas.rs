//! `quotas.*`: a tenant's GPU quota in a pool. A reservation that would take the tenant past it
//! is refused with `QUOTA_EXCEEDED`, and the refusal is recorded in the log. In a pool another
//! tenant offered to it (`pools.offer`) the quota is the tenant's own, on its own chain, set by
//! the root tenant's administrators like any quota; without one it reserves nothing there.

use bc_core::id::PoolId;
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{KIND_QUOTA, QuotaDoc, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::pools::usable_pool;
use super::reservations::gpus_in_use;
use super::validate::{PoolIdText, TenantIdText};
use super::views::QuotaView;
use super::{Access, Call, Method, method};

pub(super) const METHODS: &[Method] = &[
    method!(
        "quotas.get",
        Access::Action("compute:quotas:read"),
        "a tenant's GPU quota in a pool and its use",
        QuotasGet => QuotaView,
        quotas_get,
    ),
    method!(
        "quotas.set",
        Access::Action("compute:quotas:admin"),
        "set a tenant's GPU quota in a pool (root tenant only)",
        QuotasSet => QuotaView,
        quotas_set,
    ),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotasGet {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotasSet {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    /// GPUs of queued and active reservations the tenant may hold in the pool.
    #[schemars(range(min = 0, max = u32::MAX))]
    gpus: i64,
}

async fn quota_view(call: &Call<'_>, tenant: bc_core::id::TenantId, pool: &PoolId) -> Result<QuotaView> {
    // The tenant's own pool or one offered to it: its quota row is on its own chain either way.
    let owner = usable_pool(call, tenant, &pool.to_string()).await?.owner;
    let quota = call.state.store.row_get(&tenant.to_string(), KIND_QUOTA, &pool.to_string()).await?;
    let gpus = quota.map(super::call::doc::<QuotaDoc>).transpose()?.map(|q| q.gpus);
    let in_use = gpus_in_use(call, tenant, owner, &pool.to_string()).await?;
    Ok(QuotaView { tenant_id: tenant.to_string(), pool_id: pool.to_string(), gpus, in_use })
}

async fn quotas_get(call: &Call<'_>, input: QuotasGet) -> Result<QuotaView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool: PoolId = parse_id("poolId", &input.pool_id)?;
    quota_view(call, tenant, &pool).await
}

/// An operator action: a tenant's own key, whatever actions it holds, must not raise its own
/// quota, so only the root tenant's administrators set quotas (as they create tenants).
async fn quotas_set(call: &Call<'_>, input: QuotasSet) -> Result<QuotaView> {
    if !call.principal().is_root() {
        return Err(Error::AccessDenied("only the root tenant's administrators set quotas".into()));
    }
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool: PoolId = parse_id("poolId", &input.pool_id)?;
    if !(0..=i64::from(u32::MAX)).contains(&input.gpus) {
        return Err(Error::invalid(format!("gpus must be 0 or more, not {}", input.gpus)));
    }
    // The tenant's own pool, or one offered to it: the quota its reservations there count against.
    usable_pool(call, tenant, &pool.to_string()).await?;
    let payload = ev::to_cbor(&ev::QuotaSet { gpus: input.gpus as u32 })?;
    call.append(tenant, stream_of(KIND_QUOTA, &pool), ExpectedVersion::Any, ev::QUOTA_SET, payload).await?;
    quota_view(call, tenant, &pool).await
}
