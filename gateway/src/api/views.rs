//! Wire types: what every method answers, apart from the stored projection documents.
//!
//! A view is built from a document (or from a decision) by one conversion here, so the JSON a
//! client reads changes only when a view does; every view derives its JSON schema for the
//! OpenAPI document. Field names are the API's (camelCase); times are ms since the Unix epoch
//! and say so in their names (`createdAtMs`).

use std::collections::BTreeMap;

use bc_projections::{ApiKeyDoc, NodeDoc, PoolDoc, TenantDoc, WebhookDoc};
use schemars::JsonSchema;
use serde::Serialize;

use super::toolkit::{
    ApiKeyIdText, DescriptionText, LabelsMap, NameText, NodeIdText, PoolIdText, PositionText, ReservationIdText, TenantIdText,
    WebhookIdText,
};

pub use bc_projections::EventView;

/// `system.version`.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VersionView {
    pub version: String,
    /// `sqlite` or `postgres`.
    pub backend: String,
    pub log_key_id: String,
    /// The log key's pin (`ed25519:…`), for auditors.
    pub log_key_pin: String,
}

/// `system.whoami`: the calling key.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WhoamiView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "ApiKeyIdText")]
    pub key_id: String,
    pub actions: Vec<String>,
    /// The root tenant's keys act across tenants.
    pub root: bool,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub root: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<TenantDoc> for TenantView {
    fn from(d: TenantDoc) -> Self {
        Self { tenant_id: d.tenant_id, name: d.name, root: d.root, version: d.version, created_at_ms: d.created_at_ms }
    }
}

/// An API key; never its secret or the secret's hash.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyView {
    #[schemars(with = "ApiKeyIdText")]
    pub key_id: String,
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub actions: Vec<String>,
    pub revoked: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<ApiKeyDoc> for ApiKeyView {
    fn from(d: ApiKeyDoc) -> Self {
        Self {
            key_id: d.key_id,
            tenant_id: d.tenant_id,
            name: d.name,
            actions: d.actions,
            revoked: d.revoked,
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}

/// `apiKeys.create`: the key and, once, its token.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyCreatedView {
    #[serde(flatten)]
    pub key: ApiKeyView,
    /// `KEY_ID.SECRET`, shown only in the first answer: `null` when `replayed`.
    pub token: Option<String>,
    /// This answers a retry with the same `Idempotency-Key`; nothing new was created.
    pub replayed: bool,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "DescriptionText")]
    pub description: String,
    #[schemars(with = "LabelsMap")]
    pub labels: BTreeMap<String, String>,
    /// The longest reservation the pool grants, in seconds.
    pub max_reservation_s: u64,
    pub archived: bool,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<PoolDoc> for PoolView {
    fn from(d: PoolDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            pool_id: d.pool_id,
            name: d.name,
            description: d.description,
            labels: d.labels,
            max_reservation_s: d.max_reservation_s,
            archived: d.archived,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

/// A node's state: whether it takes new reservations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NodeStateView {
    /// Takes reservations.
    Ready,
    /// Takes no new reservation.
    Cordoned,
    /// Cordoned until its reservations end.
    Draining,
}

impl From<bc_projections::NodeState> for NodeStateView {
    fn from(s: bc_projections::NodeState) -> Self {
        use bc_projections::NodeState as S;
        match s {
            S::Ready => Self::Ready,
            S::Cordoned => Self::Cordoned,
            S::Draining => Self::Draining,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuView {
    pub model: String,
    pub product: String,
    #[serde(rename = "vramGiB")]
    pub vram_gib: u32,
    /// GPUs of one node with the same domain share NVLink.
    pub nvlink_domain: u32,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub gpus: Vec<GpuView>,
    #[schemars(with = "LabelsMap")]
    pub labels: BTreeMap<String, String>,
    pub state: NodeStateView,
    #[schemars(with = "LabelsMap")]
    pub taints: BTreeMap<String, String>,
    /// GPU index → the reservation holding it.
    #[schemars(with = "BTreeMap<String, ReservationIdText>")]
    pub allocations: BTreeMap<u32, String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<NodeDoc> for NodeView {
    fn from(d: NodeDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            node_id: d.node_id,
            pool_id: d.pool_id,
            name: d.name,
            gpus: d
                .gpus
                .into_iter()
                .map(|g| GpuView { model: g.model, product: g.product, vram_gib: g.vram_gib, nvlink_domain: g.nvlink_domain })
                .collect(),
            labels: d.labels,
            state: d.state.into(),
            taints: d.taints,
            allocations: d.allocations,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

/// A node after `cordon`, `uncordon`, `drain`, `label` or `taint`.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeChangedView {
    #[serde(flatten)]
    pub node: NodeView,
    /// Draining and holding no GPU: safe to take down.
    pub drained: bool,
}

/// A reservation's state: `queued` → `active` → `released` | `expired`, or `queued` →
/// `cancelled`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReservationStateView {
    Queued,
    Active,
    Released,
    Expired,
    Cancelled,
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

/// A tenant's GPU quota in one pool and what it uses of it.
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
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookView {
    #[schemars(with = "WebhookIdText")]
    pub webhook_id: String,
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    pub url: String,
    pub event_types: Vec<String>,
    #[schemars(with = "DescriptionText")]
    pub description: String,
    pub secret_version: u32,
    /// Until when each rotated-out secret still signs.
    pub previous_secrets_valid_until_ms: Vec<u64>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<WebhookDoc> for WebhookView {
    fn from(d: WebhookDoc) -> Self {
        Self {
            webhook_id: d.webhook_id,
            tenant_id: d.tenant_id,
            url: d.url,
            event_types: d.event_types,
            description: d.description,
            secret_version: d.secret_version,
            previous_secrets_valid_until_ms: d.previous_secrets.iter().map(|p| p.valid_until_ms).collect(),
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

/// `webhooks.create` and `webhooks.rotateSecret`: the webhook and, once, its new secret.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookSecretView {
    #[serde(flatten)]
    pub webhook: WebhookView,
    /// `whsec_…`, shown only in the first answer: `null` when `replayed`.
    pub secret: Option<String>,
    pub replayed: bool,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WebhookDeletedView {
    #[schemars(with = "WebhookIdText")]
    pub webhook_id: String,
    pub deleted: bool,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PingView {
    #[schemars(with = "WebhookIdText")]
    pub webhook_id: String,
    /// The `webhook.pinged` event: the delivery's `webhook-id`.
    pub message_id: String,
    pub delivery_id: String,
    #[schemars(with = "PositionText")]
    pub position: String,
}

/// A delivery's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStateView {
    /// Not yet delivered; `nextAtMs` says when it is tried.
    Pending,
    Done,
    /// Out of attempts; `webhooks.redeliver` sends it again.
    Dead,
}

impl From<bc_core::store::outbox::WorkState> for DeliveryStateView {
    fn from(s: bc_core::store::outbox::WorkState) -> Self {
        use bc_core::store::outbox::WorkState as W;
        match s {
            W::Pending => Self::Pending,
            W::Done => Self::Done,
            W::Dead => Self::Dead,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AttemptView {
    pub number: u32,
    pub at_ms: u64,
    pub latency_ms: u64,
    /// The receiver's HTTP status, when it answered.
    pub status: Option<u16>,
    pub error: Option<String>,
    pub next_at_ms: Option<u64>,
    /// The reconciler process that made the attempt.
    pub owner: String,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    pub delivery_id: String,
    #[schemars(with = "WebhookIdText")]
    pub webhook_id: String,
    pub message_id: serde_json::Value,
    #[serde(rename = "type")]
    pub event_type: serde_json::Value,
    pub state: DeliveryStateView,
    pub attempts: u32,
    pub next_at_ms: Option<u64>,
    pub last_error: Option<String>,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    pub attempt_log: Vec<AttemptView>,
}

impl DeliveryView {
    pub fn of(item: &bc_core::store::outbox::WorkItem, attempts: Vec<bc_core::store::outbox::Attempt>) -> Self {
        use bc_core::store::outbox::WorkState;
        Self {
            delivery_id: item.id.clone(),
            webhook_id: item.subject.clone(),
            message_id: item.payload["messageId"].clone(),
            event_type: item.payload["type"].clone(),
            state: item.state.into(),
            attempts: item.attempts,
            next_at_ms: (item.state == WorkState::Pending).then_some(item.next_at_ms),
            last_error: item.last_error.clone(),
            created_at_ms: item.created_at_ms,
            updated_at_ms: item.updated_at_ms,
            attempt_log: attempts
                .into_iter()
                .map(|a| AttemptView {
                    number: a.number,
                    at_ms: a.at_ms,
                    latency_ms: a.latency_ms,
                    status: a.status,
                    error: a.error,
                    next_at_ms: a.next_at_ms,
                    owner: a.owner,
                })
                .collect(),
        }
    }
}

/// `webhooks.eventTypes`.
#[derive(Serialize, JsonSchema)]
pub struct EventTypesView {
    pub items: Vec<String>,
}
