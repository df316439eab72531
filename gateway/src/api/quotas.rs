//! `quotas.*`: a tenant's quota in a pool: GPUs and, optionally, instances, vCPUs, memory and
//! sandboxes. A reservation that would take the tenant past its GPUs is refused with
//! `QUOTA_EXCEEDED`, and the refusal is recorded in the log; an instance or a sandbox past a
//! resource limit is refused with the same code, naming the resource, its limit and its use, and
//! recorded too (`quota.resource_exceeded`, [`recording_refusal`]) (`bc_projections::decide::quota`;
//! [`quota_under`] reads what those decisions count on). In a pool another
//! tenant offered to it (`pools.offer`) the quota is the tenant's own, on its own chain, set by
//! the root tenant's administrators like any quota; without one it reserves nothing there.

use bc_core::id::{PoolId, TenantId};
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::decide::quota::{self as decide_quota, QuotaRead, ResourceUse};
use bc_projections::events as ev;
use bc_projections::sandbox::{KIND_SANDBOX_LIVE, SandboxDoc};
use bc_projections::{InstanceDoc, KIND_INSTANCE_LIVE};
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
        "a tenant's quota in a pool (GPUs, instances, vCPUs, memory, sandboxes) and its use of each",
        QuotasGet => QuotaView,
        quotas_get,
    ),
    method!(
        "quotas.set",
        Access::Action("compute:quotas:admin"),
        "set a tenant's quota in a pool: GPUs and optional instance, vCPU, memory and sandbox limits (root tenant only)",
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
    /// Live instances it may hold in the pool (absent: unbounded; a set replaces every limit).
    #[schemars(range(min = 0, max = decide_quota::QUOTA_COUNT_MAX))]
    instances: Option<i64>,
    /// vCPUs of its live instances and claimed or cold sandboxes in the pool.
    #[schemars(range(min = 0, max = decide_quota::QUOTA_VCPUS_MAX))]
    vcpus: Option<i64>,
    /// Memory (MiB) of the same.
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 0, max = decide_quota::QUOTA_MEMORY_MIB_MAX))]
    memory_mib: Option<i64>,
    /// Live claimed or cold sandboxes (a template's warm ones count once claimed).
    #[schemars(range(min = 0, max = decide_quota::QUOTA_COUNT_MAX))]
    sandboxes: Option<i64>,
}

/// What the tenant's live instances and claimed or cold sandboxes in `pool` hold, `except` the
/// one a retry decides again (already counted by its first attempt).
pub(super) async fn resource_use(call: &Call<'_>, tenant: TenantId, pool: &str, except: Option<&str>) -> Result<ResourceUse> {
    let mut used = ResourceUse::default();
    super::sites::each_row(call, tenant, KIND_INSTANCE_LIVE, |i: InstanceDoc| {
        if i.pool_id == pool && except != Some(i.instance_id.as_str()) {
            used.add(&ResourceUse {
                instances: 1,
                vcpus: u64::from(i.shape.vcpus),
                memory_mib: i.shape.memory_mib,
                sandboxes: 0,
            });
        }
    })
    .await?;
    super::sites::each_row(call, tenant, KIND_SANDBOX_LIVE, |s: SandboxDoc| {
        if s.pool_id == pool && !s.warm && except != Some(s.sandbox_id.as_str()) {
            used.add(&ResourceUse {
                instances: 0,
                vcpus: u64::from(s.shape.vcpus),
                memory_mib: s.shape.memory_mib,
                sandboxes: 1,
            });
        }
    })
    .await?;
    Ok(used)
}

/// The tenant's quota in `pool` and its use, when the quota bounds instances, vCPUs, memory or
/// sandboxes (else `None`: nothing to count, and nothing read). A retry is answered from the log:
/// `None` too.
pub(super) async fn quota_under(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<Option<(QuotaDoc, ResourceUse)>> {
    if call.is_retry(tenant).await? {
        return Ok(None);
    }
    let Some(row) = call.state.store.row_get(&tenant.to_string(), KIND_QUOTA, pool).await? else { return Ok(None) };
    let quota: QuotaDoc = super::call::doc(row)?;
    if !quota.bounds_resources() {
        return Ok(None);
    }
    let used = resource_use(call, tenant, pool, None).await?;
    Ok(Some((quota, used)))
}

/// `decided`, a decision made under `read` (the tenant's quota as [`quota_under`] read it) on
/// work that adds `adding` (its `subject`: the `inst_…` or `sbx_…` it would be), as answered: a
/// refusal past one of the quota's resource limits is recorded first, `quota.resource_exceeded`
/// on the quota's stream in an append of its own (as a reservation's refusal is: the log shows
/// who was refused what, and when), then answered as it was. The record is not the request's
/// result: a retry with the same idempotency key decides again.
pub(super) async fn recording_refusal<T>(
    call: &Call<'_>,
    tenant: TenantId,
    read: Option<&QuotaRead<'_>>,
    adding: &ResourceUse,
    subject: &str,
    decided: Result<T>,
) -> Result<T> {
    if let Err(Error::QuotaExceeded(_)) = &decided
        && let Some(record) = decide_quota::refusal_record(read, adding, subject, &call.actor())?
    {
        let mut request = call.decided(tenant, record);
        request.idempotency_key = None;
        request.fingerprint = None;
        call.submit(request).await?;
    }
    decided
}

async fn quota_view(call: &Call<'_>, tenant: bc_core::id::TenantId, pool: &PoolId) -> Result<QuotaView> {
    // The tenant's own pool or one offered to it: its quota row is on its own chain either way.
    let owner = usable_pool(call, tenant, &pool.to_string()).await?.owner;
    let quota = call.state.store.row_get(&tenant.to_string(), KIND_QUOTA, &pool.to_string()).await?;
    let quota = quota.map(super::call::doc::<QuotaDoc>).transpose()?;
    let in_use = gpus_in_use(call, tenant, owner, &pool.to_string()).await?;
    let used = resource_use(call, tenant, &pool.to_string(), None).await?;
    let q = quota.as_ref();
    Ok(QuotaView {
        tenant_id: tenant.to_string(),
        pool_id: pool.to_string(),
        gpus: q.map(|q| q.gpus),
        in_use,
        instances: q.and_then(|q| q.instances),
        vcpus: q.and_then(|q| q.vcpus),
        memory_mib: q.and_then(|q| q.memory_mib),
        sandboxes: q.and_then(|q| q.sandboxes),
        resources_in_use: used.into(),
    })
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
    decide_quota::check_limits(input.instances, input.vcpus, input.memory_mib, input.sandboxes)?;
    // The tenant's own pool, or one offered to it: the quota its reservations there count against.
    usable_pool(call, tenant, &pool.to_string()).await?;
    // Each is within its bound (check_limits), so the casts keep the value.
    let payload = ev::to_cbor(&ev::QuotaSet {
        gpus: input.gpus as u32,
        instances: input.instances.map(|v| v as u32),
        vcpus: input.vcpus.map(|v| v as u32),
        memory_mib: input.memory_mib.map(|v| v as u64),
        sandboxes: input.sandboxes.map(|v| v as u32),
    })?;
    call.append(tenant, stream_of(KIND_QUOTA, &pool), ExpectedVersion::Any, ev::QUOTA_SET, payload).await?;
    quota_view(call, tenant, &pool).await
}
