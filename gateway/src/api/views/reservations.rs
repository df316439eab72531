//! The views of `reservations.*`, `capacity.*` and `quotas.*`.

use schemars::JsonSchema;
use serde::Serialize;

use crate::api::validate::{CommandIdText, NameText, NodeIdText, PoolIdText, ReservationIdText, TenantIdText};

/// A reservation's state: `queued` → `active` → `released` | `expired`, or `queued` →
/// `cancelled`; `active` → `queued` again when its node could not hold its GPUs, and `failed`
/// after the last allowed try.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReservationStateView {
    Queued,
    Active,
    Released,
    Expired,
    Cancelled,
    Failed,
}

impl From<bc_projections::ReservationState> for ReservationStateView {
    fn from(s: bc_projections::ReservationState) -> Self {
        use bc_projections::ReservationState as S;
        match s {
            S::Queued => Self::Queued,
            S::Active => Self::Active,
            S::Released => Self::Released,
            S::Expired => Self::Expired,
            S::Cancelled => Self::Cancelled,
            S::Failed => Self::Failed,
        }
    }
}

/// Whether the reservation's node really set its GPUs aside: `pending` (the node was sent
/// `gpu.hold`) → `bound` or `failed`; `released` once the node gave them back. A node
/// registered by hand is `bound` at once.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BindingView {
    pub state: bc_projections::BindingState,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<CommandIdText>")]
    pub hold_command_id: Option<String>,
    /// When a pending hold counts as failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deadline_at_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<CommandIdText>")]
    pub release_command_id: Option<String>,
    /// The GPUs' UUIDs the node holds.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
    /// Why the hold failed: a stable code, a colon, and words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub changed_at_ms: u64,
}

impl From<bc_projections::Binding> for BindingView {
    fn from(b: bc_projections::Binding) -> Self {
        Self {
            state: b.state,
            hold_command_id: b.hold_command_id,
            deadline_at_ms: b.deadline_at_ms,
            release_command_id: b.release_command_id,
            gpu_uuids: b.gpu_uuids,
            reason: b.reason,
            changed_at_ms: b.changed_at_ms,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReservationView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "ReservationIdText")]
    pub reservation_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    pub gpus: u32,
    pub duration_s: u64,
    pub selector: String,
    pub nvlink: bool,
    pub tolerations: Vec<String>,
    pub state: ReservationStateView,
    #[schemars(with = "Option<NodeIdText>")]
    pub node_id: Option<String>,
    /// The node's GPUs it holds, while active.
    pub gpu_indexes: Vec<u32>,
    /// The tenant chain's sequence number of the request: the queue's order.
    pub request_seq: u64,
    pub requested_at_ms: u64,
    pub activated_at_ms: Option<u64>,
    pub ends_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    /// While active (and after): whether its node holds its GPUs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub binding: Option<BindingView>,
    /// Holds of it that failed so far (it fails after 3), and the last one's reason.
    pub hold_attempts: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The instance using its GPUs (`instances.*`), until that instance is deleted.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<crate::api::validate::InstanceIdText>")]
    pub instance_id: Option<String>,
    /// In a pool offered to another tenant (`pools.offer`): the tenant it is held for, whose
    /// quota counts it; `tenantId` is the pool's owner, on whose chain it lives.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<TenantIdText>")]
    pub holder_tenant_id: Option<String>,
    /// The project it was made in (`projects.*`), of the tenant that asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<crate::api::validate::ProjectIdText>")]
    pub project_id: Option<String>,
    pub version: u64,
    /// While queued: 1 for the next in line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<u32>,
    /// `reservations.create` only: this answers a retry with the same `Idempotency-Key`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayed: Option<bool>,
}

impl ReservationView {
    pub fn of(d: bc_projections::ReservationDoc, queue_position: Option<u32>) -> Self {
        Self {
            tenant_id: d.tenant_id,
            reservation_id: d.reservation_id,
            pool_id: d.pool_id,
            gpus: d.gpus,
            duration_s: d.duration_s,
            selector: d.selector,
            nvlink: d.nvlink,
            tolerations: d.tolerations,
            state: d.state.into(),
            node_id: d.node_id,
            gpu_indexes: d.gpu_indexes,
            request_seq: d.request_seq,
            requested_at_ms: d.requested_at_ms,
            activated_at_ms: d.activated_at_ms,
            ends_at_ms: d.ends_at_ms,
            ended_at_ms: d.ended_at_ms,
            binding: d.binding.map(BindingView::from),
            hold_attempts: d.hold_attempts,
            last_error: d.last_error,
            instance_id: d.instance_id,
            holder_tenant_id: d.holder_tenant_id,
            project_id: d.project_id,
            version: d.version,
            queue_position,
            replayed: None,
        }
    }
}

/// GPUs of one model or product in a pool.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuCountView {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    pub gpus: u32,
    pub free: u32,
}

/// `capacity.get`: one pool's GPUs.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapacityView {
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub nodes: u32,
    pub gpus: u32,
    /// On ready nodes and held by no reservation.
    pub free: u32,
    /// Held by reservations.
    pub reserved: u32,
    /// Not held, on cordoned or draining nodes.
    pub unavailable: u32,
    /// Reservations waiting in the pool's queue, and their GPUs.
    pub queued: u32,
    pub queued_gpus: u32,
    pub by_model: Vec<GpuCountView>,
    pub by_product: Vec<GpuCountView>,
    pub max_reservation_s: u64,
}

impl From<bc_projections::decide::PoolCapacity> for CapacityView {
    fn from(c: bc_projections::decide::PoolCapacity) -> Self {
        Self {
            pool_id: c.pool_id,
            name: c.name,
            nodes: c.nodes,
            gpus: c.gpus,
            free: c.free,
            reserved: c.reserved,
            unavailable: c.unavailable,
            queued: c.queued,
            queued_gpus: c.queued_gpus,
            by_model: c
                .by_model
                .into_iter()
                .map(|m| GpuCountView { model: Some(m.model), product: None, gpus: m.gpus, free: m.free })
                .collect(),
            by_product: c
                .by_product
                .into_iter()
                .map(|p| GpuCountView { model: None, product: Some(p.product), gpus: p.gpus, free: p.free })
                .collect(),
            max_reservation_s: c.max_reservation_s,
        }
    }
}

/// `capacity.get`: every pool asked for.
#[derive(Serialize, JsonSchema)]
pub struct CapacityListView {
    pub items: Vec<CapacityView>,
}

/// `capacity.preview`: would a reservation fit now, and where.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreviewView {
    /// Some node of the pool could hold it, were it empty.
    pub possible: bool,
    /// It would be placed at once.
    pub fits: bool,
    /// It would be placed were nothing queued ahead.
    pub fits_ignoring_queue: bool,
    pub queued_ahead: u32,
    #[schemars(with = "Option<NodeIdText>")]
    pub node_id: Option<String>,
    pub gpus: Option<Vec<u32>>,
    pub selector: String,
}

impl From<bc_projections::decide::CapacityPreview> for PreviewView {
    fn from(p: bc_projections::decide::CapacityPreview) -> Self {
        Self {
            possible: p.possible,
            fits: p.fits,
            fits_ignoring_queue: p.fits_ignoring_queue,
            queued_ahead: p.queued_ahead,
            node_id: p.node_id,
            gpus: p.gpus,
            selector: p.selector,
        }
    }
}

/// A tenant's quota in one pool, per resource, and what it uses of each.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    /// The quota; `null`: none set.
    pub gpus: Option<u32>,
    /// GPUs of the tenant's queued and active reservations in the pool.
    pub in_use: u32,
    /// Live instances it may hold in the pool; `null`: unbounded.
    pub instances: Option<u32>,
    /// vCPUs of its live instances and claimed or cold sandboxes; `null`: unbounded.
    pub vcpus: Option<u32>,
    /// Memory (MiB) of the same; `null`: unbounded.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: Option<u64>,
    /// Live claimed or cold sandboxes; `null`: unbounded.
    pub sandboxes: Option<u32>,
    /// What the tenant's live instances and sandboxes in the pool hold now.
    pub resources_in_use: ResourceUseView,
}

/// Instances, vCPUs, memory and sandboxes in use.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceUseView {
    pub instances: u32,
    pub vcpus: u64,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    pub sandboxes: u32,
}

impl From<bc_projections::decide::quota::ResourceUse> for ResourceUseView {
    fn from(u: bc_projections::decide::quota::ResourceUse) -> Self {
        Self { instances: u.instances, vcpus: u.vcpus, memory_mib: u.memory_mib, sandboxes: u.sandboxes }
    }
}
