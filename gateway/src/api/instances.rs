//! `instances.*`: virtual machines on a reservation's node, with the reservation's GPUs passed
//! through, made real by the node's agent through its hypervisor (libvirt).
//!
//! An instance is created on an active reservation whose GPUs its node's agent holds
//! (`binding: bound`), from a flavor of the reservation's pool with as many GPUs, and a
//! registered image. Each method changes what the instance should be (desired state, shape) and
//! sends the node `instance.apply` in the same append; what the node observes comes back from
//! its journal (`instance.observed`), and the `instances` reconciler applies again when the two
//! differ. The decisions are `bc_projections::decide::{instance_create, instance_request}`.

use bc_core::id::{CommandId, FlavorId, InstanceId, ProjectId, ReservationId, TenantId};
use bc_core::{Error, Result};
use bc_projections::decide::{self, InstanceCreateInput, InstanceRequest};
use bc_projections::events::InstanceShape;
use bc_projections::placement::Issue;
use bc_projections::{
    FlavorDoc, ImageDoc, InstanceDoc, KIND_FLAVOR, KIND_INSTANCE, KIND_NODE, KIND_RESERVATION, NodeDoc, ReservationDoc,
};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::{parse_filter, parse_id};
use super::paging::Page;
use super::resource::list_where;
use super::validate::{
    CursorText, FlavorIdText, ImageIdText, InstanceIdText, LimitNumber, NameText, ProjectIdText, ReservationIdText, TenantIdText,
    VersionNumber, validate_name,
};
use super::views::InstanceView;
use super::{Access, Call, Method, method};
use crate::app::reservations::QUOTA_RACE_ATTEMPTS;

const READ: Access = Access::Action("compute:instances:read");
const WRITE: Access = Access::Action("compute:instances:write");

pub(super) const METHODS: &[Method] = &[
    method!(
        "instances.create",
        WRITE,
        "create an instance on a bound reservation's node, with its GPUs",
        InstancesCreate => InstanceView,
        instances_create,
    ),
    method!("instances.get", READ, "one instance, with what its node observes", InstanceRef => InstanceView, instances_get),
    method!("instances.list", READ, "a tenant's instances, paged by cursor", InstancesList => Page<InstanceView>, instances_list),
    method!("instances.start", WRITE, "start an instance", InstanceRef => InstanceView, instances_start),
    method!("instances.stop", WRITE, "stop an instance", InstanceRef => InstanceView, instances_stop),
    method!(
        "instances.resize",
        WRITE,
        "give an instance another flavor of its pool (as many GPUs)",
        InstancesResize => InstanceView,
        instances_resize,
    ),
    method!("instances.delete", WRITE, "delete an instance from its node", InstanceRef => InstanceView, instances_delete),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstancesCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NameText")]
    name: String,
    /// An active reservation whose GPUs its node holds (`binding.state` `bound`).
    #[schemars(with = "ReservationIdText")]
    reservation_id: String,
    /// A flavor of the reservation's pool giving as many GPUs as it holds.
    #[schemars(with = "FlavorIdText")]
    flavor_id: String,
    /// The image by id; or, instead, by channel (`image`).
    #[schemars(with = "Option<ImageIdText>")]
    image_id: Option<String>,
    /// The image by channel: `NAME@stable` or `NAME@testing`, the newest image of that name in
    /// that channel now (the instance records the image it resolved to). Exactly one of
    /// `imageId` and `image`.
    #[schemars(with = "Option<super::images::ImageChannelRefText>")]
    image: Option<String>,
    /// Start it once defined (the default), or leave it stopped.
    #[serde(default)]
    start: Option<bool>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "InstanceIdText")]
    instance_id: String,
    /// Act only while the instance is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstancesResize {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "InstanceIdText")]
    instance_id: String,
    #[schemars(with = "FlavorIdText")]
    flavor_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstancesList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Only the instances on this reservation (a filtered page can come back short).
    #[schemars(with = "Option<ReservationIdText>")]
    reservation_id: Option<String>,
    /// Only the instances made in this project (their reservation's; a filtered page can come
    /// back short).
    #[schemars(with = "Option<ProjectIdText>")]
    project_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

async fn instance_doc(call: &Call<'_>, tenant: TenantId, id: &InstanceId) -> Result<InstanceDoc> {
    call.row(tenant, KIND_INSTANCE, &id.to_string(), "instance").await
}

/// A fresh command id and the time: what a decision that issues `instance.apply` takes.
fn command_id(call: &Call<'_>) -> String {
    CommandId::from_ulid(call.state.log.ids.ulid()).to_string()
}

async fn instances_create(call: &Call<'_>, input: InstancesCreate) -> Result<InstanceView> {
    // Counted against the tenant's resource limits: decided again when another's work was
    // counted on the quota in between (a CONFLICT on its stream), never answered CONFLICT.
    crate::app::retry_on_quota_race(QUOTA_RACE_ATTEMPTS, |_| instance_create_once(call, &input)).await
}

async fn instance_create_once(call: &Call<'_>, input: &InstancesCreate) -> Result<InstanceView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    let reservation_id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
    let flavor_id: FlavorId = parse_id("flavorId", &input.flavor_id)?;
    let reservation: ReservationDoc = call.row(tenant, KIND_RESERVATION, &reservation_id.to_string(), "reservation").await?;
    let flavor: FlavorDoc = call.row(tenant, KIND_FLAVOR, &flavor_id.to_string(), "flavor").await?;
    let image: ImageDoc = super::images::image_named(call, tenant, input.image_id.as_deref(), input.image.as_deref()).await?;
    let retry = call.is_retry(tenant).await?;
    let instance_id = InstanceId::from_ulid(call.ulid()).to_string();
    let node_id = reservation.node_id.clone().unwrap_or_default();
    if !retry && !node_id.is_empty() {
        super::commands::check_node_queue(call, tenant, &node_id).await?;
    }
    // A retry is answered from the log whatever the reservation says now (it names this
    // request's instance): the decision only has to encode the same request.
    let node: NodeDoc = if node_id.is_empty() {
        return Err(decide::Refusal::ReservationNotReady {
            reservation_id: reservation.reservation_id.clone(),
            version: reservation.version,
            why: format!("it is {}, not active", reservation.state.as_str()),
        }
        .into());
    } else {
        call.row(tenant, KIND_NODE, &node_id, "node").await?
    };
    let mut reservation = reservation;
    if retry {
        // The first request's own instance holds the reservation: the retry is decided as
        // that request was, and the append answers it from the log.
        reservation.instance_id = None;
    }
    let id = command_id(call);
    let issue = Issue { command_id: &id, now_ms: call.now_ms() };
    let quota = super::quotas::quota_under(call, tenant, &reservation.pool_id).await?;
    let quota = quota.as_ref().map(|(quota, in_use)| decide::quota::QuotaRead { quota, in_use: *in_use });
    let input = InstanceCreateInput {
        instance_id: &instance_id,
        name: &input.name,
        reservation: &reservation,
        node: &node,
        flavor: &flavor,
        image: &image,
        start: input.start.unwrap_or(true),
        quota,
    };
    let decided = decide::instance_create(&input, issue).map_err(Error::from);
    let adding = decide::quota::ResourceUse::instance(flavor.vcpus, flavor.memory_mib);
    let decided = super::quotas::recording_refusal(call, tenant, quota.as_ref(), &adding, &instance_id, decided).await?;
    let result = call.submit(call.decided(tenant, decided)).await?;
    Ok(call.created::<InstanceDoc>(tenant, &result).await?.into())
}

async fn instances_get(call: &Call<'_>, input: InstanceRef) -> Result<InstanceView> {
    Ok(call.named::<InstanceDoc>(&input.tenant_id, &input.instance_id).await?.into())
}

async fn instances_list(call: &Call<'_>, input: InstancesList) -> Result<Page<InstanceView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let reservation = parse_filter::<ReservationId>("reservationId", &input.reservation_id)?;
    let project = parse_filter::<ProjectId>("projectId", &input.project_id)?;
    list_where(call, tenant, input.limit, input.cursor.as_deref(), |i: &InstanceDoc| {
        reservation.as_deref().is_none_or(|r| r == i.reservation_id)
            && project.as_deref().is_none_or(|p| i.project_id.as_deref() == Some(p))
    })
    .await
}

/// A request on an existing instance: decided on its document, appended at its version. A
/// resize's growth is counted against the tenant's resource limits: decided again when
/// another's work was counted on the quota in between.
async fn request(
    call: &Call<'_>,
    tenant: &Option<String>,
    instance_id: &str,
    if_version: Option<u64>,
    request: impl Fn(&InstanceDoc) -> Result<InstanceRequest>,
) -> Result<InstanceView> {
    crate::app::retry_on_quota_race(QUOTA_RACE_ATTEMPTS, |_| request_once(call, tenant, instance_id, if_version, &request)).await
}

async fn request_once(
    call: &Call<'_>,
    tenant: &Option<String>,
    instance_id: &str,
    if_version: Option<u64>,
    request: &impl Fn(&InstanceDoc) -> Result<InstanceRequest>,
) -> Result<InstanceView> {
    let tenant = call.tenant(tenant).await?;
    let id: InstanceId = parse_id("instanceId", instance_id)?;
    let mut current = instance_doc(call, tenant, &id).await?;
    let asked = request(&current)?;
    if call.is_retry(tenant).await? {
        // Answered from the log: a delete that since finished does not refuse its own retry.
        if current.state == bc_projections::InstanceState::Deleted {
            current.state = bc_projections::InstanceState::Deleting;
        }
    } else {
        super::commands::check_node_queue(call, tenant, &current.node_id).await?;
    }
    let command = command_id(call);
    let issue = Issue { command_id: &command, now_ms: call.now_ms() };
    // A resize that grows the instance is counted against the tenant's resource limits.
    let quota = match &asked {
        InstanceRequest::Resize(_) => super::quotas::quota_under(call, tenant, &current.pool_id).await?,
        _ => None,
    };
    let quota = quota.as_ref().map(|(quota, in_use)| decide::quota::QuotaRead { quota, in_use: *in_use });
    let decided = decide::instance_request_under(&current, &asked, if_version, None, issue, quota.as_ref()).map_err(Error::from);
    let decided = match &asked {
        InstanceRequest::Resize(shape) => {
            let growth = decide::quota::ResourceUse::growth(
                (current.shape.vcpus, current.shape.memory_mib),
                (shape.vcpus, shape.memory_mib),
            );
            super::quotas::recording_refusal(call, tenant, quota.as_ref(), &growth, &current.instance_id, decided).await?
        }
        _ => decided?,
    };
    call.submit(call.decided(tenant, decided)).await?;
    Ok(instance_doc(call, tenant, &id).await?.into())
}

async fn instances_start(call: &Call<'_>, input: InstanceRef) -> Result<InstanceView> {
    request(call, &input.tenant_id, &input.instance_id, input.if_version, |_| Ok(InstanceRequest::Start)).await
}

async fn instances_stop(call: &Call<'_>, input: InstanceRef) -> Result<InstanceView> {
    request(call, &input.tenant_id, &input.instance_id, input.if_version, |_| Ok(InstanceRequest::Stop)).await
}

async fn instances_delete(call: &Call<'_>, input: InstanceRef) -> Result<InstanceView> {
    request(call, &input.tenant_id, &input.instance_id, input.if_version, |_| Ok(InstanceRequest::Delete)).await
}

async fn instances_resize(call: &Call<'_>, input: InstancesResize) -> Result<InstanceView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let flavor_id: FlavorId = parse_id("flavorId", &input.flavor_id)?;
    let flavor: FlavorDoc = call.row(tenant, KIND_FLAVOR, &flavor_id.to_string(), "flavor").await?;
    request(call, &input.tenant_id, &input.instance_id, input.if_version, |current| {
        if flavor.pool_id != current.pool_id || flavor.gpus as usize != current.gpus.len() {
            return Err(decide::Refusal::InstanceMismatch(format!(
                "flavor {} ({} GPUs, pool {}) does not fit instance {} ({} GPUs, pool {})",
                flavor.flavor_id,
                flavor.gpus,
                flavor.pool_id,
                current.instance_id,
                current.gpus.len(),
                current.pool_id
            ))
            .into());
        }
        Ok(InstanceRequest::Resize(InstanceShape {
            flavor_id: flavor.flavor_id.clone(),
            vcpus: flavor.vcpus,
            memory_mib: flavor.memory_mib,
            disk_gib: flavor.disk_gib,
        }))
    })
    .await
}
