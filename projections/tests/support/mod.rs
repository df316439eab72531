//! What the tests of several files share: an appended event as the log would store it.

use bc_core::event::{Envelope, StoredEvent};
use bc_core::store::NewEvent;

/// `event` as the log stores it at `seq` (also its stream's version) on `stream`, at `at_ms`,
/// with the id `ulid`: what a test folds, unsigned and unchained.
pub fn stored(tenant: &str, stream: String, seq: u64, ulid: ulid::Ulid, at_ms: u64, event: &NewEvent) -> StoredEvent {
    StoredEvent {
        envelope: Envelope {
            tenant: tenant.parse().unwrap(),
            seq,
            id: bc_core::id::EventId::from_ulid(ulid),
            stream,
            version: seq,
            event_type: event.event_type.clone(),
            at_ms,
            actor: "test".into(),
            idempotency_key: None,
            causation: None,
            correlation: None,
            payload: event.payload.clone(),
            prev: [0; 32],
        },
        canonical: vec![],
        hash: [0; 32],
        sig: vec![],
        key_id: String::new(),
        position: Default::default(),
    }
}
