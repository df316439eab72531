//! What the outbox tests (`fan_out.rs`, `outbox_runner.rs`) share: an event to fan out and the
//! one item a test consumer makes of it.

use bc_core::Result;
use bc_core::event::EventRow;
use bc_core::id::{PoolId, TenantId};
use bc_core::store::outbox::NewWorkItem;
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_projections::events as ev;
use bc_projections::{KIND_POOL, stream_of};

/// A `pool.created` of the root tenant on a pool of its own: its stream and the request.
pub fn pool_created() -> (String, AppendRequest) {
    let pool = PoolId::generate();
    let stream = stream_of(KIND_POOL, &pool);
    let payload = ev::to_cbor(&ev::PoolCreated {
        name: format!("p-{}", pool.ulid().to_string().to_ascii_lowercase()),
        description: String::new(),
        labels: Default::default(),
        max_reservation_s: None,
    })
    .unwrap();
    let event = vec![NewEvent::new(ev::POOL_CREATED, payload)];
    (stream.clone(), AppendRequest::new(TenantId::ROOT, stream, ExpectedVersion::NoStream, "test", event))
}

/// The item a test consumer makes of an event: the event's id, an empty payload.
pub fn item_of(row: &EventRow) -> Result<NewWorkItem> {
    Ok(NewWorkItem { tenant: row.tenant.parse()?, id: row.id.clone(), subject: "s".into(), payload: serde_json::json!({}) })
}
