//! The views of `sandboxTemplates.*` and `sandboxes.*`.

use std::collections::BTreeMap;

use bc_projections::sandbox::{SandboxDoc, SandboxState, SandboxTemplateDoc};
use bc_projections::sandbox_volume::{SandboxVolumeDoc, SandboxVolumeState};
use schemars::JsonSchema;
use serde::Serialize;

use super::InstanceImageView;
use crate::api::validate::{
    CommandIdText, FlavorIdText, NameText, NodeIdText, PoolIdText, SandboxIdText, SandboxTemplateIdText, SandboxVolumeIdText,
    TenantIdText,
};

/// What each sandbox of a template is given: its flavor's vCPUs and memory.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxShapeView {
    #[schemars(with = "FlavorIdText")]
    pub flavor_id: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "SandboxTemplateIdText")]
    pub template_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    pub shape: SandboxShapeView,
    pub image: InstanceImageView,
    pub warm_min: u32,
    pub default_ttl_s: u64,
    pub max_ttl_s: u64,
    pub env: BTreeMap<String, String>,
    pub network: String,
    /// The volumes every sandbox mounts, in order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMountView>,
    pub version: u64,
    pub created_at_ms: u64,
}

/// A volume a template's sandboxes mount, and where.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMountView {
    #[schemars(with = "SandboxVolumeIdText")]
    pub volume_id: String,
    pub path: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

fn mount_views(mounts: Vec<bc_projections::events::VolumeMount>) -> Vec<VolumeMountView> {
    mounts.into_iter().map(|m| VolumeMountView { volume_id: m.volume_id, path: m.path, read_only: m.read_only }).collect()
}

fn image_view(image: &bc_projections::events::InstanceImage) -> InstanceImageView {
    InstanceImageView {
        image_id: image.image_id.clone(),
        url: image.url.clone(),
        sha256: image.sha256.clone(),
        disk_format: image.disk_format.into(),
    }
}

impl From<SandboxTemplateDoc> for SandboxTemplateView {
    fn from(d: SandboxTemplateDoc) -> Self {
        Self {
            image: image_view(&d.image),
            tenant_id: d.tenant_id,
            template_id: d.template_id,
            name: d.name,
            pool_id: d.pool_id,
            shape: SandboxShapeView { flavor_id: d.shape.flavor_id, vcpus: d.shape.vcpus, memory_mib: d.shape.memory_mib },
            warm_min: d.warm_min,
            default_ttl_s: d.default_ttl_s,
            max_ttl_s: d.max_ttl_s,
            env: d.env,
            network: d.network,
            volumes: mount_views(d.volumes),
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}

/// The last `sandbox.apply` sent to the node.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxApplyView {
    #[schemars(with = "CommandIdText")]
    pub command_id: String,
    /// `running` or `deleted`.
    pub desired: String,
    pub deadline_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "SandboxIdText")]
    pub sandbox_id: String,
    #[schemars(with = "SandboxTemplateIdText")]
    pub template_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    pub shape: SandboxShapeView,
    pub image: InstanceImageView,
    pub network: String,
    /// The volumes it mounts (attached to it while it is live).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMountView>,
    /// The project it was made in, or claimed in (a warm one: none until its claim).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<crate::api::validate::ProjectIdText>")]
    pub project_id: Option<String>,
    /// Unclaimed, in its template's warm pool.
    pub warm: bool,
    /// `starting`, `running`, `deleting`, `failed` or `deleted`.
    pub state: SandboxState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    /// Its end: the `sandboxes` reconciler deletes it then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ends_at_ms: Option<u64>,
    pub apply: SandboxApplyView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<SandboxDoc> for SandboxView {
    fn from(d: SandboxDoc) -> Self {
        Self {
            image: image_view(&d.image),
            tenant_id: d.tenant_id,
            sandbox_id: d.sandbox_id,
            template_id: d.template_id,
            pool_id: d.pool_id,
            node_id: d.node_id,
            shape: SandboxShapeView { flavor_id: d.shape.flavor_id, vcpus: d.shape.vcpus, memory_mib: d.shape.memory_mib },
            network: d.network,
            volumes: mount_views(d.volumes),
            project_id: d.project_id,
            warm: d.warm,
            state: d.state,
            started_at_ms: d.started_at_ms,
            ends_at_ms: d.ends_at_ms,
            apply: SandboxApplyView {
                command_id: d.apply.command_id,
                desired: d.apply.desired,
                deadline_at_ms: d.apply.deadline_at_ms,
                answered_at_ms: d.apply.answered_at_ms,
            },
            last_error: d.last_error,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

/// How `sandboxes.create` got its sandbox.
#[derive(Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SandboxWarmth {
    /// A warm sandbox of the template's pool, claimed (already running).
    Warm,
    /// Started now on a node (`starting` until the node answers).
    Cold,
}

/// The answer of `sandboxes.create`: the sandbox, and whether it was warm.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxCreatedView {
    pub claimed: SandboxWarmth,
    #[serde(flatten)]
    pub sandbox: SandboxView,
}

/// The last `sandbox_volume.apply` sent to the volume's node.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxVolumeApplyView {
    #[schemars(with = "CommandIdText")]
    pub command_id: String,
    /// `ready` or `deleted`.
    pub desired: String,
    pub deadline_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
}

/// The sandbox a volume is attached to.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxVolumeAttachmentView {
    #[schemars(with = "SandboxIdText")]
    pub sandbox_id: String,
    pub path: String,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    pub attached_at_ms: u64,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxVolumeView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "SandboxVolumeIdText")]
    pub volume_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    /// The node its disk image lives on; its sandboxes run there.
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    /// Its size on the node.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u64,
    /// The size a resize in flight asks.
    #[serde(rename = "requestedSizeGiB", skip_serializing_if = "Option::is_none")]
    pub requested_size_gib: Option<u64>,
    /// Who made it: `apikey:key_…`.
    pub created_by: String,
    /// `creating`, `ready`, `resizing`, `deleting`, `failed` or `deleted`.
    pub state: SandboxVolumeState,
    pub apply: SandboxVolumeApplyView,
    /// The sandbox it was last attached to (the `sandboxes` reconciler detaches it once that
    /// sandbox is no longer live).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attachment: Option<SandboxVolumeAttachmentView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<SandboxVolumeDoc> for SandboxVolumeView {
    fn from(d: SandboxVolumeDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            volume_id: d.volume_id,
            name: d.name,
            pool_id: d.pool_id,
            node_id: d.node_id,
            size_gib: d.size_gib,
            requested_size_gib: d.requested_size_gib,
            created_by: d.created_by,
            state: d.state,
            apply: SandboxVolumeApplyView {
                command_id: d.apply.command_id,
                desired: d.apply.desired,
                deadline_at_ms: d.apply.deadline_at_ms,
                answered_at_ms: d.apply.answered_at_ms,
            },
            attachment: d.attachment.map(|a| SandboxVolumeAttachmentView {
                sandbox_id: a.sandbox_id,
                path: a.path,
                read_only: a.read_only,
                attached_at_ms: a.attached_at_ms,
            }),
            last_error: d.last_error,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}
