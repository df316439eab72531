//! The views of `instances.*`.

use bc_projections::events::{DesiredState, ObservedState};
use bc_projections::{InstanceDoc, InstanceState};
use schemars::JsonSchema;
use serde::Serialize;

use super::DiskFormatView;
use crate::api::validate::{
    CommandIdText, FlavorIdText, ImageIdText, InstanceIdText, NameText, NodeIdText, PoolIdText, ReservationIdText, TenantIdText,
};

/// What the node's hypervisor last said of the domain.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceObservedView {
    /// As the hypervisor reports it (`absent`: no such domain).
    pub state: ObservedState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// The generation the node had applied.
    pub generation: u64,
    pub at_ms: u64,
}

/// The last `instance.apply` sent to the node.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceApplyView {
    #[schemars(with = "CommandIdText")]
    pub command_id: String,
    pub generation: u64,
    pub deadline_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
    /// Why the node could not apply it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceImageView {
    #[schemars(with = "ImageIdText")]
    pub image_id: String,
    pub url: String,
    pub sha256: String,
    pub disk_format: DiskFormatView,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "InstanceIdText")]
    pub instance_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    #[schemars(with = "ReservationIdText")]
    pub reservation_id: String,
    /// The project it was made in: its reservation's (`projects.*`), when that names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<crate::api::validate::ProjectIdText>")]
    pub project_id: Option<String>,
    #[schemars(with = "FlavorIdText")]
    pub flavor_id: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    /// The reservation's GPUs' UUIDs, passed through.
    pub gpus: Vec<String>,
    pub image: InstanceImageView,
    /// What it should be.
    pub desired: DesiredState,
    /// Counts the requests; each is applied by the node as one `instance.apply`.
    pub generation: u64,
    /// `pending` (an apply in flight), `running` / `stopped` (the node observes what is
    /// desired), `drifted` (it does not; applied again), `deleting`, `failed`, `deleted`.
    pub state: InstanceState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub observed: Option<InstanceObservedView>,
    pub apply: InstanceApplyView,
    pub apply_attempts: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<InstanceDoc> for InstanceView {
    fn from(d: InstanceDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            instance_id: d.instance_id,
            name: d.name,
            pool_id: d.pool_id,
            node_id: d.node_id,
            reservation_id: d.reservation_id,
            project_id: d.project_id,
            flavor_id: d.shape.flavor_id,
            vcpus: d.shape.vcpus,
            memory_mib: d.shape.memory_mib,
            disk_gib: d.shape.disk_gib,
            gpus: d.gpus,
            image: InstanceImageView {
                image_id: d.image.image_id,
                url: d.image.url,
                sha256: d.image.sha256,
                disk_format: d.image.disk_format.into(),
            },
            desired: d.desired,
            generation: d.generation,
            state: d.state,
            observed: d.observed.map(|o| InstanceObservedView {
                state: o.state,
                vcpus: o.vcpus,
                memory_mib: o.memory_mib,
                generation: o.generation,
                at_ms: o.at_ms,
            }),
            apply: InstanceApplyView {
                command_id: d.apply.command_id,
                generation: d.apply.generation,
                deadline_at_ms: d.apply.deadline_at_ms,
                answered_at_ms: d.apply.answered_at_ms,
                failed: d.apply.failed,
            },
            apply_attempts: d.apply_attempts,
            last_error: d.last_error,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}
