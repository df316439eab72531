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
    /// The key whose signature the event carries; absent when it carries none of its own (a
    /// later event of its chain covers it: `coveredBy` in `events.get`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub causation: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub correlation: Option<String>,
    /// The canonical CBOR bytes the hash is taken over (`events.get` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canonical: Option<String>,
    /// The log key's Ed25519 signature over the hash (`events.get` only, when the event carries
    /// one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sig: Option<String>,
    /// For an event without a signature of its own (`events.get` only): what proves it alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub covered_by: Option<CoveredBy>,
}

/// The events after one without a signature of its own, up to the first that carries one, so
/// the event verifies with nothing else: hash each `following` in turn, each one's `prev` the
/// hash before it (the first's the event's own hash), and the signature over the last hash
/// (`schema/LOG-FORMAT.md`, "Verifying one event").
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CoveredBy {
    /// The seq of the signed event.
    #[schemars(range(min = 2))]
    pub seq: u64,
    pub key_id: String,
    /// Its Ed25519 signature, standard base64.
    pub sig: String,
    /// The canonical bytes (standard base64) of every event after this one up to and including
    /// the signed one, in chain order: at most `SIGNED_SEQ_INTERVAL` (16).
    #[schemars(length(min = 1, max = 16))]
    pub following: Vec<String>,
}

impl CoveredBy {
    /// `following`: the events after the one covered, the last of them signed.
    pub fn of(following: &[StoredEvent]) -> Option<Self> {
        let signed = following.last().filter(|e| !e.sig.is_empty())?;
        let b64 = base64::engine::general_purpose::STANDARD;
        Some(Self {
            seq: signed.envelope.seq,
            key_id: signed.key_id.clone(),
            sig: b64.encode(&signed.sig),
            following: following.iter().map(|e| b64.encode(&e.canonical)).collect(),
        })
    }
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
            payload: redacted(&env.event_type, canonical::to_json(&env.payload)),
            position: event.position.to_string(),
            prev: hex::encode(env.prev),
            hash: hex::encode(event.hash),
            key_id: (!event.key_id.is_empty()).then(|| event.key_id.clone()),
            idempotency_key: env.idempotency_key.clone(),
            causation: env.causation.clone(),
            correlation: env.correlation.clone(),
            canonical: with_bytes.then(|| b64.encode(&event.canonical)),
            sig: (with_bytes && !event.sig.is_empty()).then(|| b64.encode(&event.sig)),
            covered_by: None,
        }
    }
}

/// What stands in for a redacted part.
pub const REDACTED: &str = "REDACTED";

/// The payload as clients and other receivers see it: secret-bearing fields are redacted. A
/// webhook's URL may carry a token in its userinfo or query (`https://user:pw@host/?token=…`):
/// those parts are replaced, the scheme, host and path kept, so a reader still sees which
/// receiver it is. An `api_key.created` written before the key's hash left the log carries it:
/// it is dropped. The log itself (and `canonical`, which the hash covers) keeps what was
/// appended; `webhooks.get` shows the owner the whole URL.
fn redacted(event_type: &str, mut payload: Value) -> Value {
    let Value::Object(map) = &mut payload else { return payload };
    match event_type {
        crate::events::WEBHOOK_CREATED | crate::events::WEBHOOK_UPDATED => {
            if let Some(Value::String(url)) = map.get_mut("url") {
                *url = redact_url(url);
            }
        }
        crate::events::API_KEY_CREATED => {
            map.remove("secretSha256");
        }
        _ => {}
    }
    payload
}

/// `url` without its userinfo, query and fragment (each replaced by [`REDACTED`]).
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let host = match authority.rsplit_once('@') {
        Some((_, host)) => format!("{REDACTED}@{host}"),
        None => authority.to_owned(),
    };
    let (path, query) = match tail.find(['?', '#']) {
        Some(at) => (&tail[..at], Some(&tail[at..at + 1])),
        None => (tail, None),
    };
    match query {
        Some(mark) => format!("{scheme}{host}{path}{mark}{REDACTED}"),
        None => format!("{scheme}{host}{path}"),
    }
}

/// The JSON form of an event (see [`EventView`]).
pub fn event_view(event: &StoredEvent, with_bytes: bool) -> Value {
    serde_json::to_value(EventView::of(event, with_bytes)).expect("an event view is plain JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_userinfo_and_query() {
        assert_eq!(redact_url("https://hooks.example.com/a/b"), "https://hooks.example.com/a/b");
        assert_eq!(
            redact_url("https://u:pw@hooks.example.com:8443/a?token=s3cret"),
            "https://REDACTED@hooks.example.com:8443/a?REDACTED"
        );
        assert_eq!(redact_url("https://hooks.example.com?t=1#frag"), "https://hooks.example.com?REDACTED");
        assert_eq!(redact_url("https://hooks.example.com/x#frag"), "https://hooks.example.com/x#REDACTED");
        let payload = serde_json::json!({ "url": "https://a@b.example/?k=v", "eventTypes": ["*"] });
        assert_eq!(redacted(crate::events::WEBHOOK_UPDATED, payload)["url"], "https://REDACTED@b.example/?REDACTED");
        let key = serde_json::json!({ "name": "k", "secretSha256": "ab" });
        assert!(redacted(crate::events::API_KEY_CREATED, key).get("secretSha256").is_none());
    }
}
