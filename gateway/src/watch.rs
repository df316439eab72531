//! The live event stream: `GET /watch` as server-sent events, and the type patterns it shares
//! with `events.list`.
//!
//! Each event goes out as `id: COMMIT.INDEX` (its outbox position), `event: TYPE`, and one line
//! of JSON. A new watcher starts at the end of the log, as `tail -f` does; `?since=start` (or
//! `since=0`) replays from the beginning. `Last-Event-ID` (a reconnect) or `?since=` resume
//! exactly after a position; both `COMMIT.INDEX` and `COMMIT:INDEX` are accepted. A producer task reads the log by position and
//! feeds a bounded channel (`WATCH_BUFFER_EVENTS`); a client that does not drain it within
//! `WATCH_SEND_TIMEOUT_S` is disconnected, so a slow reader never grows the server's memory.
//! The appender's commit notification wakes the producer early; it also polls every
//! `WATCH_POLL_MS`, so commits by other processes are found too. The key is checked again every
//! `WATCH_REAUTH_S` and whenever API keys change, and a server shutdown ends every stream (a
//! graceful shutdown waits for open responses). A client that stops reading is dropped by the
//! connection's write deadline (`conn.rs`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use bc_core::event::Position;
use bc_core::id::TenantId;
use bc_core::store::decode_rows;
use bc_core::{Error, Result};
use serde::Deserialize;

use crate::AppState;
use crate::error::ApiError;

/// Type patterns one watch or list may give.
pub const WATCH_TYPES_MAX: usize = bc_projections::events::TYPE_PATTERNS_MAX;
/// Events queued for one watcher before the producer waits for the client.
pub const WATCH_BUFFER_EVENTS: usize = 256;
/// How long the producer waits for a client to take an event before disconnecting it.
pub const WATCH_SEND_TIMEOUT_S: u64 = 30;
/// How often an idle watcher looks for commits made by other processes.
pub const WATCH_POLL_MS: u64 = 1000;
/// Comment lines that keep idle connections (and proxies) alive.
pub const WATCH_HEARTBEAT_S: u64 = 15;
/// Watchers served at once.
pub const WATCHERS_MAX: usize = 256;
/// How often a watcher's key is checked again, so a revoked key stops receiving events.
pub const WATCH_REAUTH_S: u64 = 30;
/// Rows read from the log per query while streaming.
const WATCH_PAGE_ROWS: u32 = 500;
const _: () = assert!(WATCH_BUFFER_EVENTS >= 1 && WATCH_PAGE_ROWS as usize >= WATCH_BUFFER_EVENTS);

pub use bc_projections::events::TypeFilter;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WatchQuery {
    since: Option<String>,
    /// Comma-separated patterns.
    types: Option<String>,
    tenant_id: Option<String>,
}

pub async fn watch(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    match start(state, &headers, query).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn start(
    state: Arc<AppState>,
    headers: &HeaderMap,
    query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let header = headers.get(axum::http::header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
    let principal = crate::auth::authenticate(&*state.store, header).await?;
    let Query(query) = query.map_err(|e| Error::invalid(format!("invalid query: {e}")))?;
    let tenant = match &query.tenant_id {
        Some(t) => t.parse::<TenantId>().map_err(|e| Error::invalid(format!("tenantId: {e}")))?,
        None => principal.tenant,
    };
    state.authorize_tenant(&principal, "compute:events:read", tenant).await?;
    let resume = headers.get("last-event-id").map(|v| v.to_str().unwrap_or("-").to_owned()).or(query.since.clone());
    let mut after = match resume.as_deref() {
        // Like `tail -f`: a new watcher sees what commits from now on.
        None => Position { commit: state.store.last_commit().await?, index: i32::MAX as u32 },
        Some("start" | "0") => Position::START,
        Some(p) => p.parse::<Position>()?,
    };
    let patterns: Vec<String> = query
        .types
        .as_deref()
        .map(|t| t.split(',').map(|p| p.trim().to_owned()).filter(|p| !p.is_empty()).collect())
        .unwrap_or_default();
    let filter = TypeFilter::parse(&patterns)?;
    let permit = state
        .watchers
        .clone()
        .try_acquire_owned()
        .map_err(|_| Error::Unavailable(format!("{WATCHERS_MAX} watchers are connected already; retry later")))?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Event>(WATCH_BUFFER_EVENTS);
    let mut commits = state.log.subscribe();
    let mut notified = true;
    let mut shutdown = state.shutdown.subscribe();
    let store = state.store.clone();
    let token_header = header.map(str::to_owned);
    let mut authorized_at = std::time::Instant::now();
    tokio::spawn(async move {
        loop {
            // A client gone away ends its producer, even while it scans past events its filter
            // drops (and so never tries to send).
            if tx.is_closed() {
                return;
            }
            // A revoked key, or one that lost the action, stops receiving events.
            if authorized_at.elapsed() >= Duration::from_secs(WATCH_REAUTH_S) {
                let still = crate::auth::authenticate(&*store, token_header.as_deref())
                    .await
                    .and_then(|p| p.authorize("compute:events:read", tenant));
                if still.is_err() {
                    tracing::info!(%tenant, "ending a watch whose key is no longer valid");
                    return;
                }
                authorized_at = std::time::Instant::now();
            }
            let rows = match store.read_after_rows(after, Some(tenant), WATCH_PAGE_ROWS).await.and_then(decode_rows) {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "watch stream ended: reading the log failed");
                    return;
                }
            };
            let idle = rows.is_empty();
            for event in rows {
                after = event.position;
                if event.envelope.event_type.starts_with("api_key.") {
                    // Keys changed: check this watcher's key before sending anything more.
                    authorized_at = std::time::Instant::now() - Duration::from_secs(WATCH_REAUTH_S);
                }
                if !filter.matches(&event.envelope.event_type) {
                    continue;
                }
                let data = bc_projections::event_view(&event, false).to_string();
                let sse = Event::default().id(event.position.to_string()).event(&event.envelope.event_type).data(data);
                match tx.send_timeout(sse, Duration::from_secs(WATCH_SEND_TIMEOUT_S)).await {
                    Ok(()) => {}
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Timeout(_)) => {
                        tracing::info!(%tenant, "disconnecting a watcher that stopped reading");
                        return;
                    }
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Closed(_)) => return,
                }
            }
            if *shutdown.borrow() {
                return;
            }
            if idle || authorized_at.elapsed() >= Duration::from_secs(WATCH_REAUTH_S) {
                tokio::select! {
                    // If the appender is gone, its sender is dropped: fall back to polling only.
                    changed = commits.changed(), if notified => notified = changed.is_ok(),
                    _ = tokio::time::sleep(Duration::from_millis(WATCH_POLL_MS)) => {}
                    _ = shutdown.changed() => return,
                    _ = tx.closed() => return,
                }
            }
        }
    });
    // The permit lives as long as the response, so stalled connections count against the limit.
    let stream = futures::stream::poll_fn(move |cx| {
        let _held = &permit;
        rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(WATCH_HEARTBEAT_S))).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let f = TypeFilter::parse(&["pool.*".into(), "node.registered".into()]).unwrap();
        assert!(f.matches("pool.created") && f.matches("node.registered") && !f.matches("tenant.created"));
        assert!(TypeFilter::parse(&["*".into()]).unwrap().matches("anything"));
        assert!(TypeFilter::parse(&[]).unwrap().matches("anything"));
        for bad in ["bogus.*", "pool.", "Pool.created", "", "pool..x", "pool.created;drop"] {
            assert!(TypeFilter::parse(&[bad.into()]).is_err(), "{bad:?}");
        }
        let many: Vec<String> = (0..21).map(|_| "pool.*".to_owned()).collect();
        assert!(TypeFilter::parse(&many).is_err());
    }
}
