//! `events.*`: a tenant's log, read by outbox position, and one event with its proof material.

use bc_core::event::{Position, SIGNED_SEQ_INTERVAL, STREAM_NAME_BYTES_MAX};
use bc_core::id::EventId;
use bc_core::store::{READ_ROWS_MAX, decode_row, decode_rows};
use bc_core::{Error, Result};
use bc_projections::events::TYPE_PATTERNS_MAX;
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::paging::limit;
use super::validate::{EventIdText, LimitNumber, PositionText, TenantIdText, string_schema};
use super::views::{CoveredBy, EventView};
use super::{Access, Call, Method, method};
use crate::watch::TypeFilter;

const READ: Access = Access::Action("compute:events:read");

/// Rows one `events.list` call scans at most while filtering.
pub const EVENTS_SCAN_ROWS_MAX: usize = 5000;

pub(super) const METHODS: &[Method] = &[
    method!("events.list", READ, "a tenant's events by outbox position", EventsList => EventPage, events_list),
    method!(
        "events.get",
        READ,
        "one event with its canonical bytes, hash and signature (or the later events whose signature covers it)",
        EventsGet => EventView,
        events_get,
    ),
];

string_schema!(
    /// The schema of type patterns: every pattern that matches some event type.
    TypePatterns as "TypePatterns",
    |_| {
            schemars::json_schema!({
                "type": "array",
                "maxItems": TYPE_PATTERNS_MAX,
                "items": { "type": "string", "enum": bc_projections::events::type_patterns() },
            })
    }
);

/// A page of events: its cursor is the outbox position to read after, not a row id.
#[derive(serde::Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EventPage {
    pub items: Vec<EventView>,
    /// Set while events remain: pass it as `cursor` (`COMMIT.INDEX`).
    #[schemars(with = "Option<PositionText>")]
    pub next_cursor: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EventsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    /// The position to read after (`COMMIT.INDEX`); the start of the log when absent.
    #[schemars(with = "Option<PositionText>")]
    cursor: Option<String>,
    /// Type patterns (`pool.*`); none: every type.
    #[serde(default)]
    #[schemars(with = "TypePatterns")]
    types: Vec<String>,
    /// Only the events of this stream (`pool/pool_…`).
    #[schemars(length(min = 1, max = STREAM_NAME_BYTES_MAX), regex(pattern = r"^[!-~]+$"))]
    stream: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EventsGet {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "EventIdText")]
    event_id: String,
}

async fn events_list(call: &Call<'_>, input: EventsList) -> Result<EventPage> {
    let store = &*call.state.store;
    let tenant = call.tenant(&input.tenant_id).await?;
    let limit = limit(input.limit)?;
    let after = match &input.cursor {
        Some(c) => c.parse::<Position>()?,
        None => Position::START,
    };
    let filter = TypeFilter::parse(&input.types)?;
    if let Some(stream) = &input.stream {
        bc_core::event::validate_name("stream", stream, STREAM_NAME_BYTES_MAX)?;
    }
    // Filters are applied while scanning by position; a page scans at most
    // EVENTS_SCAN_ROWS_MAX rows and then hands back a cursor, so a rare type cannot make one
    // call read the whole log. A row is matched on its columns (type, stream), and only the
    // rows served are decoded and checked against their hashed bytes, as the webhooks'
    // fan-out does: a filter that passes over thousands of rows does not hash them all.
    let mut items = Vec::new();
    let mut scanned = 0usize;
    let mut position = after;
    let mut exhausted = false;
    while items.len() < limit as usize && scanned < EVENTS_SCAN_ROWS_MAX {
        let rows = store.read_after_rows(position, Some(tenant), READ_ROWS_MAX).await?;
        if rows.is_empty() {
            exhausted = true;
            break;
        }
        for row in rows {
            scanned += 1;
            position = Position { commit: row.commit, index: row.index };
            if !filter.matches(&row.event_type) || input.stream.as_ref().is_some_and(|s| *s != row.stream) {
                continue;
            }
            let event = decode_row(row)?;
            items.push(EventView::of(&event, false));
            if items.len() == limit as usize {
                break;
            }
        }
    }
    let next_cursor = if exhausted {
        None
    } else {
        // More may follow: check cheaply whether anything lies past the cursor.
        let more = !store.read_after_rows(position, Some(tenant), 1).await?.is_empty();
        more.then(|| position.to_string())
    };
    Ok(EventPage { items, next_cursor })
}

async fn events_get(call: &Call<'_>, input: EventsGet) -> Result<EventView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: EventId = parse_id("eventId", &input.event_id)?;
    let row = call.state.store.event_row(tenant, id).await?.ok_or_else(|| Error::not_found(format!("event {id}")))?;
    let event = decode_row(row)?;
    let mut view = EventView::of(&event, true);
    if event.sig.is_empty() {
        // Covered by a later event: the ones up to it, so this one verifies alone.
        let seq = event.envelope.seq;
        let rows = call.state.store.read_chain_rows(tenant, seq + 1, SIGNED_SEQ_INTERVAL as u32).await?;
        let following = decode_rows(rows)?;
        let upto = following.iter().position(|e| !e.sig.is_empty()).ok_or_else(|| Error::Corrupt {
            tenant: tenant.to_string(),
            seq,
            what: format!("no signed event follows it within {SIGNED_SEQ_INTERVAL} events"),
        })?;
        view.covered_by = CoveredBy::of(&following[..=upto]);
    }
    Ok(view)
}
