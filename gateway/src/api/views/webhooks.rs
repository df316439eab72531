//! The views of `webhooks.*`: subscriptions, pings and deliveries.

use schemars::JsonSchema;
use serde::Serialize;

use crate::api::validate::{DescriptionText, PositionText, TenantIdText, WebhookIdText};
use bc_projections::WebhookDoc;

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
    /// The version of the webhook's own secret (0 while it signs with a reference).
    pub secret_version: u32,
    /// The tenant's secret it signs with, `secret://TENANT/sec_…`; absent: its own secret.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
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
            secret_ref: d.secret_ref,
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
