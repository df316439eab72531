//! The JSON form of an event: what `events.list` / `events.get` answer, what `GET /watch`
//! streams as `data:`, and the `data` of a webhook delivery. One type, so the three agree.

use base64::Engine;
use bc_core::canonical;
use bc_core::event::StoredEvent;
use serde::Serialize;
use serde_json::Value;

/// One event as clients see it. Hashes are lowercase hex; `canonical` and `sig` (only in
/// `events.get`) are standard base64.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    #[schemars(regex(pattern = r"^evt_[0-7][0-9a-hjkmnp-tv-z]{25}$"))]
    pub id: String,
    #[schemars(regex(pattern = r"^ten_[0-7][0-9a-hjkmnp-tv-z]{25}$"))]
    pub tenant_id: String,
    /// The place in the tenant's chain, from 1.
    #[schemars(range(min = 1))]
    pub seq: u64,
    pub stream: String,
    #[schemars(range(min = 1))]
    pub version: u64,
    #[serde(rename = "type")]
    pub event_type: String,
    /// Commit time, ms since the Unix epoch.
    pub at: u64,
    pub actor: String,
    /// The payload as JSON (byte strings as base64).
    pub payload: Value,
    /// The outbox position, `COMMIT.INDEX`.
    #[schemars(regex(pattern = r"^[0-9]+\.[0-9]+$"))]
    pub position: String,
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub prev: String,
    #[schemars(regex(pattern = r"^[0-9a-f]{64}$"))]
    pub hash: String,
    pub key_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub causation: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub correlation: Option<String>,
    /// The canonical CBOR bytes the hash is taken over (`events.get` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canonical: Option<String>,
    /// The log key's Ed25519 signature over the hash (`events.get` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
}

impl EventView {
    /// The view of `event`; `with_bytes` adds its canonical bytes and signature.
    pub fn of(event: &StoredEvent, with_bytes: bool) -> Self {
        let env = &event.envelope;
        let b64 = base64::engine::general_purpose::STANDARD;
        Self {
            id: env.id.to_string(),
            tenant_id: env.tenant.to_string(),
            seq: env.seq,
            stream: env.stream.clone(),
            version: env.version,
            event_type: env.event_type.clone(),
            at: env.at_ms,
            actor: env.actor.clone(),
            payload: canonical::to_json(&env.payload),
            position: event.position.to_string(),
            prev: hex::encode(env.prev),
            hash: hex::encode(event.hash),
            key_id: event.key_id.clone(),
            idempotency_key: env.idempotency_key.clone(),
            causation: env.causation.clone(),
            correlation: env.correlation.clone(),
            canonical: with_bytes.then(|| b64.encode(&event.canonical)),
            sig: with_bytes.then(|| b64.encode(&event.sig)),
        }
    }
}

/// The JSON form of an event (see [`EventView`]).
pub fn event_view(event: &StoredEvent, with_bytes: bool) -> Value {
    serde_json::to_value(EventView::of(event, with_bytes)).expect("an event view is plain JSON")
}
