//! Webhook subscriptions (`webhook/wh_…`): the document, the payloads of `webhook.*`, their fold,
//! and the ids of its deliveries and secrets.
//!
//! A webhook receives its tenant's events after the one that created it (`createdSeq`) whose
//! type its patterns match. Its signing secrets never enter the log: the events carry the secret
//! store's ids. A rotation keeps the previous secret signing until its time, at most
//! [`PREVIOUS_SECRETS_MAX`] of them.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, create, from_doc, set_if, to_doc, update};

pub const WEBHOOK_CREATED: &str = "webhook.created";
pub const WEBHOOK_UPDATED: &str = "webhook.updated";
pub const WEBHOOK_SECRET_ROTATED: &str = "webhook.secret_rotated";
pub const WEBHOOK_PINGED: &str = "webhook.pinged";
pub const WEBHOOK_DELETED: &str = "webhook.deleted";

/// A webhook's document; also its stream's prefix (`webhook/wh_…`).
pub const KIND_WEBHOOK: &str = "webhook";
/// The outbox consumer whose work items are webhook deliveries.
pub const WEBHOOK_CONSUMER: &str = "webhooks";
/// Rotated-out secrets kept signing at once, at most: a rotation drops the oldest beyond this.
pub const PREVIOUS_SECRETS_MAX: usize = 4;

/// A webhook subscription. It receives its tenant's events after `createdSeq` whose type its
/// patterns match (empty: none; `*`: all).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WebhookDoc {
    pub tenant_id: String,
    pub webhook_id: String,
    pub url: String,
    pub event_types: Vec<String>,
    pub description: String,
    pub secret_version: u32,
    /// The webhook's own signing secret in the secret store; empty while `secretRef` names
    /// the secret it signs with instead.
    #[serde(default)]
    pub secret_id: String,
    /// A tenant's secret the webhook signs with (`secret://TENANT/sec_…`), resolved by the
    /// deliverer to its current version; `None`: its own secret (`secretId`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
    /// Rotated-out secrets that still sign beside the current one, each until its time.
    pub previous_secrets: Vec<PreviousSecret>,
    pub created_seq: u64,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

/// A delivery's id: the event (also the `webhook-id` header) and the webhook it goes to.
pub fn webhook_delivery_id(event_id: &impl std::fmt::Display, webhook_id: &impl std::fmt::Display) -> String {
    format!("{event_id}/{webhook_id}")
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PreviousSecret {
    pub secret_id: String,
    pub valid_until_ms: u64,
}

/// The id of one of a webhook's signing secrets in the secret store, from a fresh ULID.
pub fn new_webhook_secret_id(webhook_id: &str, ulid: ulid::Ulid) -> String {
    format!("{webhook_id}/{}", bc_core::id::EventId::from_ulid(ulid))
}

/// A webhook subscription. Its signing secret is not here: secrets never enter the log.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookCreated {
    pub url: String,
    pub event_types: Vec<String>,
    pub description: String,
    pub secret_version: u32,
    /// Where the signing secret is kept in the secret store (an id, not the secret); absent
    /// when `secretRef` names the secret instead.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_id: String,
    /// The tenant's secret it signs with, `secret://TENANT/sec_…` (a reference, not the value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookUpdated {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_types: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// From now on the webhook signs with this secret (`secret://TENANT/sec_…`); its own
    /// secrets sign no more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<String>,
}

/// A new signing secret; the previous one is still signed with until `previousValidUntilMs`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookSecretRotated {
    pub secret_version: u32,
    pub secret_id: String,
    pub previous_valid_until_ms: u64,
}

/// A test delivery: it goes to this webhook only, whatever its event types.
pub type WebhookPinged = NoFields;

pub type WebhookDeleted = NoFields;

/// Folds one `webhook.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        WEBHOOK_CREATED => create(event, |p: WebhookCreated, env| WebhookDoc {
            tenant_id: env.tenant.to_string(),
            webhook_id: key.id.clone(),
            url: p.url,
            event_types: p.event_types,
            description: p.description,
            secret_version: p.secret_version,
            secret_id: p.secret_id,
            secret_ref: p.secret_ref,
            previous_secrets: Vec::new(),
            created_seq: env.seq,
            version: env.version,
            created_at_ms: env.at_ms,
            updated_at_ms: env.at_ms,
        }),
        WEBHOOK_UPDATED => update(event, current, |doc: &mut WebhookDoc, p: WebhookUpdated| {
            set_if(&mut doc.url, p.url);
            set_if(&mut doc.event_types, p.event_types);
            set_if(&mut doc.description, p.description);
            if let Some(reference) = p.secret_ref {
                doc.secret_ref = Some(reference);
                doc.secret_id.clear();
                doc.previous_secrets.clear();
            }
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
        }),
        WEBHOOK_SECRET_ROTATED => update(event, current, |doc: &mut WebhookDoc, p: WebhookSecretRotated| {
            doc.secret_version = p.secret_version;
            // Rotation is refused while a reference names the secret; a log that says otherwise
            // still folds to a webhook with its own secret.
            doc.secret_ref = None;
            let old = std::mem::replace(&mut doc.secret_id, p.secret_id);
            doc.previous_secrets.retain(|prev| prev.valid_until_ms > env.at_ms);
            if p.previous_valid_until_ms > env.at_ms && !old.is_empty() {
                doc.previous_secrets.push(PreviousSecret { secret_id: old, valid_until_ms: p.previous_valid_until_ms });
            }
            let excess = doc.previous_secrets.len().saturating_sub(PREVIOUS_SECRETS_MAX);
            doc.previous_secrets.drain(..excess);
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
        }),
        WEBHOOK_PINGED => {
            let mut doc: WebhookDoc = from_doc(event, current)?;
            doc.version = env.version;
            to_doc(&doc)
        }
        WEBHOOK_DELETED => Ok(None),
        _ => Ok(current),
    }
}
