//! `flavors.*`: the shapes of instance a pool offers (vCPUs, memory, disk, GPUs). A flavor
//! belongs to one pool and is named uniquely within it; instances will name one.
//!
//! A flavor is created only in a live pool (an archived one is `CONFLICT`, as `pools.update`
//! answers): the append is guarded on the pool's version, so an archive racing the create makes
//! one of them `CONFLICT`. `flavors.update` changes a flavor's name and shape (vCPUs, memory,
//! disk, GPUs) in place: an instance keeps what its flavor said when it was made, so only
//! instances and sandboxes made after get the new shape. Its pool cannot change (a flavor of
//! another pool is another flavor: create it there).

use bc_core::id::{FlavorId, PoolId, TenantId};
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{FlavorDoc, KIND_FLAVOR, KIND_POOL, PoolDoc, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::{check_if_version, doc, expected_version};
use super::paging::Page;
use super::pools::pool_doc;
use super::resource::list_by;
use super::validate::{CursorText, FlavorIdText, LimitNumber, NameText, PoolIdText, TenantIdText, VersionNumber, validate_name};
use super::views::{FlavorDeletedView, FlavorView};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:flavors:read");
const WRITE: Access = Access::Action("compute:flavors:write");

/// vCPUs a flavor gives: at least one, at most what a large host has.
pub const FLAVOR_VCPUS_MAX: u32 = 1024;
/// Memory a flavor gives, in MiB: at most 16 TiB.
pub const FLAVOR_MEMORY_MIB_MAX: u64 = 16 * 1024 * 1024;
/// Disk a flavor gives, in GiB: at most 64 TiB.
pub const FLAVOR_DISK_GIB_MAX: u64 = 65_536;
/// GPUs a flavor gives: at most what one node holds, since an instance lives on one node.
pub const FLAVOR_GPUS_MAX: u32 = 64;
/// Flavors one pool offers at most.
pub const FLAVORS_PER_POOL_MAX: usize = 64;
/// Flavors one tenant has at most, over all its pools: a create reads them all (name
/// uniqueness and the per-pool count), so this bounds that read.
pub const FLAVORS_PER_TENANT_MAX: u32 = 1000;
const _: () = assert!(FLAVORS_PER_TENANT_MAX <= bc_core::store::READ_ROWS_MAX);
const _: () = assert!(FLAVORS_PER_POOL_MAX <= FLAVORS_PER_TENANT_MAX as usize);

pub(super) const METHODS: &[Method] = &[
    method!("flavors.create", WRITE, "create a flavor in a pool", FlavorsCreate => FlavorView, flavors_create),
    method!("flavors.get", READ, "one flavor", FlavorRef => FlavorView, flavors_get),
    method!("flavors.list", READ, "a tenant's flavors, or one pool's, paged by cursor", FlavorsList => Page<FlavorView>, flavors_list),
    method!("flavors.delete", WRITE, "delete a flavor", FlavorRef => FlavorDeletedView, flavors_delete),
    method!(
        "flavors.update",
        WRITE,
        "change a flavor's name or shape in place (instances made before keep theirs); not its pool",
        FlavorsUpdate => FlavorView,
        flavors_update,
    ),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorsCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// The pool whose nodes run instances of this flavor.
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    /// Unique within the pool.
    #[schemars(with = "NameText")]
    name: String,
    #[schemars(range(min = 1, max = FLAVOR_VCPUS_MAX))]
    vcpus: u32,
    /// Memory in MiB (1 to 16 TiB).
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 1, max = FLAVOR_MEMORY_MIB_MAX))]
    memory_mib: u64,
    /// Disk in GiB.
    #[serde(rename = "diskGiB")]
    #[schemars(range(min = 1, max = FLAVOR_DISK_GIB_MAX))]
    disk_gib: u64,
    /// GPUs passed through to the instance (0: none).
    #[schemars(range(max = FLAVOR_GPUS_MAX))]
    gpus: u32,
}

/// At least one of `name`, `vcpus`, `memoryMiB`, `diskGiB`, `gpus`, not `null`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("anyOf" = [
    { "required": ["name"], "properties": { "name": { "type": "string" } } },
    { "required": ["vcpus"], "properties": { "vcpus": { "type": "integer" } } },
    { "required": ["memoryMiB"], "properties": { "memoryMiB": { "type": "integer" } } },
    { "required": ["diskGiB"], "properties": { "diskGiB": { "type": "integer" } } },
    { "required": ["gpus"], "properties": { "gpus": { "type": "integer" } } },
]))]
pub struct FlavorsUpdate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "FlavorIdText")]
    flavor_id: String,
    /// Act only while the flavor is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    /// Unique within the flavor's pool.
    #[schemars(with = "Option<NameText>")]
    name: Option<String>,
    #[schemars(range(min = 1, max = FLAVOR_VCPUS_MAX))]
    vcpus: Option<u32>,
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = 1, max = FLAVOR_MEMORY_MIB_MAX))]
    memory_mib: Option<u64>,
    #[serde(rename = "diskGiB")]
    #[schemars(range(min = 1, max = FLAVOR_DISK_GIB_MAX))]
    disk_gib: Option<u64>,
    #[schemars(range(max = FLAVOR_GPUS_MAX))]
    gpus: Option<u32>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "FlavorIdText")]
    flavor_id: String,
    /// Act only while the flavor is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Only this pool's flavors (a filtered page can come back short).
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

/// The shape a flavor gives, checked against the bounds above (what the schema states too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlavorShape {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
    pub gpus: u32,
}

/// Refuses a shape outside the bounds, naming the field and its range.
pub fn validate_flavor_shape(shape: FlavorShape) -> Result<()> {
    let range = |field: &str, value: u64, min: u64, max: u64| {
        if (min..=max).contains(&value) {
            Ok(())
        } else {
            Err(Error::invalid(format!("{field} must be {min} to {max}, not {value}")))
        }
    };
    range("vcpus", shape.vcpus.into(), 1, FLAVOR_VCPUS_MAX.into())?;
    range("memoryMiB", shape.memory_mib, 1, FLAVOR_MEMORY_MIB_MAX)?;
    range("diskGiB", shape.disk_gib, 1, FLAVOR_DISK_GIB_MAX)?;
    range("gpus", shape.gpus.into(), 0, FLAVOR_GPUS_MAX.into())
}

/// Whether a flavor called `name` may join `pool`, given the tenant's flavors: the name is
/// free in the pool, the pool has room, the tenant has room.
pub fn check_flavor_fits(existing: &[FlavorDoc], pool: &str, name: &str) -> Result<()> {
    if existing.len() >= FLAVORS_PER_TENANT_MAX as usize {
        return Err(Error::state(
            format!("a tenant has at most {FLAVORS_PER_TENANT_MAX} flavors"),
            "delete flavors no one uses (flavors delete)",
        ));
    }
    let in_pool: Vec<&FlavorDoc> = existing.iter().filter(|f| f.pool_id == pool).collect();
    if let Some(same) = in_pool.iter().find(|f| f.name == name) {
        return Err(Error::AlreadyExists { what: format!("flavor {name:?} in pool {pool} ({})", same.flavor_id) });
    }
    if in_pool.len() >= FLAVORS_PER_POOL_MAX {
        return Err(Error::state(
            format!("pool {pool} has {FLAVORS_PER_POOL_MAX} flavors, the most a pool has"),
            "delete flavors no one uses (flavors delete)",
        ));
    }
    Ok(())
}

/// What an update of `flavor` to `change` appends: the fields that differ, the new shape within
/// its bounds, a new name free in the flavor's pool (`existing`: the tenant's flavors).
pub fn flavor_update(existing: &[FlavorDoc], flavor: &FlavorDoc, change: ev::FlavorUpdated) -> Result<ev::FlavorUpdated> {
    let shape = FlavorShape {
        vcpus: change.vcpus.unwrap_or(flavor.vcpus),
        memory_mib: change.memory_mib.unwrap_or(flavor.memory_mib),
        disk_gib: change.disk_gib.unwrap_or(flavor.disk_gib),
        gpus: change.gpus.unwrap_or(flavor.gpus),
    };
    validate_flavor_shape(shape)?;
    if let Some(name) = &change.name {
        validate_name("name", name)?;
        if let Some(same) =
            existing.iter().find(|f| f.pool_id == flavor.pool_id && f.name == *name && f.flavor_id != flavor.flavor_id)
        {
            return Err(Error::AlreadyExists {
                what: format!("flavor {name:?} in pool {} ({})", flavor.pool_id, same.flavor_id),
            });
        }
    }
    let changed = ev::FlavorUpdated {
        name: change.name.filter(|n| *n != flavor.name),
        vcpus: change.vcpus.filter(|v| *v != flavor.vcpus),
        memory_mib: change.memory_mib.filter(|v| *v != flavor.memory_mib),
        disk_gib: change.disk_gib.filter(|v| *v != flavor.disk_gib),
        gpus: change.gpus.filter(|v| *v != flavor.gpus),
    };
    Ok(changed)
}

async fn flavor_doc(call: &Call<'_>, tenant: TenantId, id: &FlavorId) -> Result<FlavorDoc> {
    call.row(tenant, KIND_FLAVOR, &id.to_string(), "flavor").await
}

/// `CONFLICT` for an archived pool, as `pools.update` answers: the request is well formed and
/// the pool's state refuses it (a 409, which a schema-valid request may meet, not a 400);
/// `what` says what an archived pool does not do.
fn live_pool(pool: &PoolDoc, pool_id: &PoolId, what: &str) -> Result<()> {
    if pool.archived {
        return Err(Error::Conflict {
            stream: stream_of(KIND_POOL, pool_id),
            expected: format!("a live pool (this one is archived: it {what})"),
            actual: pool.version,
        });
    }
    Ok(())
}

async fn flavors_create(call: &Call<'_>, input: FlavorsCreate) -> Result<FlavorView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    validate_flavor_shape(FlavorShape {
        vcpus: input.vcpus,
        memory_mib: input.memory_mib,
        disk_gib: input.disk_gib,
        gpus: input.gpus,
    })?;
    let pool_id: PoolId = parse_id("poolId", &input.pool_id)?;
    let pool = pool_doc(call, tenant, &pool_id.to_string()).await?;
    // A retry is answered from the log (the append replays it), whatever the pool and its
    // flavors say now: the first request's own flavor holds the name.
    let retry = call.is_retry(tenant).await?;
    if !retry {
        live_pool(&pool, &pool_id, "takes no new flavor")?;
    }
    // One read of the tenant's flavors answers both the name and the counts. Two gateway
    // processes creating one name at once can both pass it: the flavors are then told apart
    // by id (the count bounds are exceeded by at most what the processes had in flight).
    // The names' lock is held until the append is done: in this process, one create of a name
    // passes the check at a time.
    let _names = call.state.name_locks.lock(tenant).await;
    if !retry {
        let rows = call.state.store.row_list(&tenant.to_string(), KIND_FLAVOR, None, FLAVORS_PER_TENANT_MAX).await?;
        let existing = rows.into_iter().map(doc::<FlavorDoc>).collect::<Result<Vec<_>>>()?;
        check_flavor_fits(&existing, &pool_id.to_string(), &input.name)?;
    }
    let flavor = FlavorId::from_ulid(call.ulid());
    let payload = ev::to_cbor(&ev::FlavorCreated {
        pool_id: pool_id.to_string(),
        name: input.name,
        vcpus: input.vcpus,
        memory_mib: input.memory_mib,
        disk_gib: input.disk_gib,
        gpus: input.gpus,
    })?;
    let result = call
        .append_guarded(
            tenant,
            stream_of(KIND_FLAVOR, &flavor),
            ExpectedVersion::NoStream,
            ev::FLAVOR_CREATED,
            payload,
            vec![(stream_of(KIND_POOL, &pool_id), ExpectedVersion::Exact(pool.version))],
        )
        .await?;
    Ok(call.created::<FlavorDoc>(tenant, &result).await?.into())
}

async fn flavors_get(call: &Call<'_>, input: FlavorRef) -> Result<FlavorView> {
    Ok(call.named::<FlavorDoc>(&input.tenant_id, &input.flavor_id).await?.into())
}

async fn flavors_list(call: &Call<'_>, input: FlavorsList) -> Result<Page<FlavorView>> {
    let page = (input.limit, input.cursor.as_deref());
    list_by::<FlavorDoc, _, PoolId>(call, &input.tenant_id, page, ("poolId", &input.pool_id), |f| &f.pool_id).await
}

async fn flavors_update(call: &Call<'_>, input: FlavorsUpdate) -> Result<FlavorView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: FlavorId = parse_id("flavorId", &input.flavor_id)?;
    let change = ev::FlavorUpdated {
        name: input.name,
        vcpus: input.vcpus,
        memory_mib: input.memory_mib,
        disk_gib: input.disk_gib,
        gpus: input.gpus,
    };
    check_if_version(input.if_version)?;
    if change == ev::FlavorUpdated::default() {
        return Err(Error::invalid("nothing to update: give name, vcpus, memoryMiB, diskGiB or gpus"));
    }
    if let Some(name) = &change.name {
        validate_name("name", name)?;
    }
    let current = flavor_doc(call, tenant, &id).await?;
    let stream = stream_of(KIND_FLAVOR, &id);
    // A retry is answered from the log (the append replays it), though the version it stated
    // is the one its first attempt moved on from.
    let retry = call.is_retry(tenant).await?;
    let expected = if retry {
        ExpectedVersion::Exact(current.version)
    } else {
        expected_version(input.if_version, current.version, &stream)?
    };
    let pool_id: PoolId = parse_id("poolId", &current.pool_id)?;
    let pool = pool_doc(call, tenant, &current.pool_id).await?;
    if !retry {
        live_pool(&pool, &pool_id, "its flavors change no more")?;
    }
    // A new name is checked and taken under the tenant's names' lock, as a create's is.
    let _names = call.state.name_locks.lock(tenant).await;
    let existing = if change.name.is_some() && !retry {
        let rows = call.state.store.row_list(&tenant.to_string(), KIND_FLAVOR, None, FLAVORS_PER_TENANT_MAX).await?;
        rows.into_iter().map(doc::<FlavorDoc>).collect::<Result<Vec<_>>>()?
    } else {
        Vec::new()
    };
    let changed = flavor_update(&existing, &current, change)?;
    if changed == ev::FlavorUpdated::default() && !retry {
        // It already is what the request asks: nothing to record.
        return Ok(current.into());
    }
    let payload = ev::to_cbor(&changed)?;
    call.append_guarded(
        tenant,
        stream,
        expected,
        ev::FLAVOR_UPDATED,
        payload,
        vec![(stream_of(KIND_POOL, &pool_id), ExpectedVersion::Exact(pool.version))],
    )
    .await?;
    Ok(flavor_doc(call, tenant, &id).await?.into())
}

async fn flavors_delete(call: &Call<'_>, input: FlavorRef) -> Result<FlavorDeletedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: FlavorId = parse_id("flavorId", &input.flavor_id)?;
    let current = flavor_doc(call, tenant, &id).await?;
    let stream = stream_of(KIND_FLAVOR, &id);
    let expected = expected_version(input.if_version, current.version, &stream)?;
    call.append(tenant, stream, expected, ev::FLAVOR_DELETED, ev::to_cbor(&ev::FlavorDeleted {})?).await?;
    Ok(FlavorDeletedView { flavor_id: id.to_string(), deleted: true })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> FlavorShape {
        FlavorShape { vcpus: 8, memory_mib: 65_536, disk_gib: 200, gpus: 1 }
    }

    #[test]
    fn shapes_within_their_bounds_only() {
        assert!(validate_flavor_shape(shape()).is_ok());
        let edges =
            FlavorShape { vcpus: FLAVOR_VCPUS_MAX, memory_mib: FLAVOR_MEMORY_MIB_MAX, disk_gib: FLAVOR_DISK_GIB_MAX, gpus: 0 };
        assert!(validate_flavor_shape(edges).is_ok());
        let refused = [
            (FlavorShape { vcpus: 0, ..shape() }, "vcpus"),
            (FlavorShape { vcpus: FLAVOR_VCPUS_MAX + 1, ..shape() }, "vcpus"),
            (FlavorShape { memory_mib: 0, ..shape() }, "memoryMiB"),
            (FlavorShape { memory_mib: FLAVOR_MEMORY_MIB_MAX + 1, ..shape() }, "memoryMiB"),
            (FlavorShape { disk_gib: 0, ..shape() }, "diskGiB"),
            (FlavorShape { disk_gib: FLAVOR_DISK_GIB_MAX + 1, ..shape() }, "diskGiB"),
            (FlavorShape { gpus: FLAVOR_GPUS_MAX + 1, ..shape() }, "gpus"),
        ];
        for (shape, field) in refused {
            let err = validate_flavor_shape(shape).unwrap_err();
            assert_eq!(err.code(), bc_core::error::ErrorCode::InvalidArgument);
            assert!(err.to_string().starts_with(field), "{shape:?}: {err}");
        }
    }

    fn flavor(pool: &str, name: &str, n: usize) -> FlavorDoc {
        FlavorDoc {
            tenant_id: "ten_x".into(),
            flavor_id: format!("flv_{n}"),
            pool_id: pool.into(),
            name: name.into(),
            vcpus: 1,
            memory_mib: 1,
            disk_gib: 1,
            gpus: 0,
            version: 1,
            created_at_ms: 0,
        }
    }

    #[test]
    fn an_update_keeps_the_bounds_and_the_pools_names_and_says_only_what_changed() {
        let small = flavor("pool_a", "small", 0);
        let existing = vec![small.clone(), flavor("pool_a", "large", 1), flavor("pool_b", "medium", 2)];
        let grow = ev::FlavorUpdated { vcpus: Some(4), memory_mib: Some(1), ..Default::default() };
        let changed = flavor_update(&existing, &small, grow).unwrap();
        assert_eq!(changed, ev::FlavorUpdated { vcpus: Some(4), ..Default::default() }, "memory was 1 already");
        let taken = ev::FlavorUpdated { name: Some("large".into()), ..Default::default() };
        assert_eq!(flavor_update(&existing, &small, taken).unwrap_err().code(), bc_core::error::ErrorCode::AlreadyExists);
        let other_pool = ev::FlavorUpdated { name: Some("medium".into()), ..Default::default() };
        assert_eq!(flavor_update(&existing, &small, other_pool).unwrap().name.as_deref(), Some("medium"));
        let same = ev::FlavorUpdated { name: Some("small".into()), ..Default::default() };
        assert_eq!(flavor_update(&existing, &small, same).unwrap(), ev::FlavorUpdated::default(), "its own name is no clash");
        for bad in [
            ev::FlavorUpdated { vcpus: Some(0), ..Default::default() },
            ev::FlavorUpdated { gpus: Some(FLAVOR_GPUS_MAX + 1), ..Default::default() },
            ev::FlavorUpdated { disk_gib: Some(FLAVOR_DISK_GIB_MAX + 1), ..Default::default() },
            ev::FlavorUpdated { name: Some("Not A Name".into()), ..Default::default() },
        ] {
            assert_eq!(
                flavor_update(&existing, &small, bad.clone()).unwrap_err().code(),
                bc_core::error::ErrorCode::InvalidArgument,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_name_is_unique_within_its_pool_and_pools_are_bounded() {
        let existing = vec![flavor("pool_a", "small", 0)];
        assert_eq!(check_flavor_fits(&existing, "pool_a", "small").unwrap_err().code(), bc_core::error::ErrorCode::AlreadyExists);
        assert!(check_flavor_fits(&existing, "pool_b", "small").is_ok(), "another pool's name is no clash");
        assert!(check_flavor_fits(&existing, "pool_a", "large").is_ok());
        let full: Vec<FlavorDoc> = (0..FLAVORS_PER_POOL_MAX).map(|n| flavor("pool_a", &format!("f{n}"), n)).collect();
        let err = check_flavor_fits(&full, "pool_a", "one-more").unwrap_err();
        assert_eq!(err.code(), bc_core::error::ErrorCode::InvalidState, "{err}");
        assert!(check_flavor_fits(&full, "pool_b", "one-more").is_ok());
        let tenant_full: Vec<FlavorDoc> =
            (0..FLAVORS_PER_TENANT_MAX as usize).map(|n| flavor(&format!("pool_{n}"), "f", n)).collect();
        assert!(check_flavor_fits(&tenant_full, "pool_new", "f").unwrap_err().to_string().contains("at most"));
    }
}
