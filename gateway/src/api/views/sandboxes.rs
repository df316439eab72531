//! The views of `sandboxTemplates.*` and `sandboxes.*`.

use std::collections::BTreeMap;

use bc_projections::sandbox::{SandboxDoc, SandboxState, SandboxTemplateDoc};
use schemars::JsonSchema;
use serde::Serialize;

use super::InstanceImageView;
use crate::api::validate::{
    CommandIdText, FlavorIdText, NameText, NodeIdText, PoolIdText, SandboxIdText, SandboxTemplateIdText, TenantIdText,
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
    pub version: u64,
    pub created_at_ms: u64,
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
