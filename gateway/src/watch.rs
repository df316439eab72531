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
//! connection's write deadline (`conn.rs`). Slots are limited in total (`WATCHERS_MAX`), per
//! tenant (`WATCHERS_PER_TENANT_MAX`) and per key (`WATCHERS_PER_KEY_MAX`); a watcher's slot
//! is held by its producer task, which ends as soon as the client is gone.

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
/// Watchers served at once, all tenants together.
pub const WATCHERS_MAX: usize = 256;
/// Watchers one tenant's keys hold at once, so one tenant cannot take every slot.
pub const WATCHERS_PER_TENANT_MAX: usize = 64;
/// Watchers one API key holds at once, so one leaked or looping client cannot take its
/// tenant's share.
pub const WATCHERS_PER_KEY_MAX: usize = 16;
const _: () = assert!(WATCHERS_PER_KEY_MAX <= WATCHERS_PER_TENANT_MAX && WATCHERS_PER_TENANT_MAX <= WATCHERS_MAX);
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
    // The slot lives in the producer task, which ends when the client is gone (its receiver
    // dropped), so the count is of live producers, and a stalled connection keeps its slot only
    // until the write deadline drops it.
    let slot = state.watchers.acquire(principal.tenant, &principal.key_id)?;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Event>(WATCH_BUFFER_EVENTS);
    let mut commits = state.log.subscribe();
    let mut notified = true;
    let mut shutdown = state.shutdown.subscribe();
    let store = state.store.clone();
    let token_header = header.map(str::to_owned);
    let mut authorized_at = std::time::Instant::now();
    tokio::spawn(async move {
        let _slot = slot;
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
    let stream = futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|e| e.map(Ok::<_, Infallible>)));
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(WATCH_HEARTBEAT_S))).into_response())
}

/// The watcher limits a gateway enforces (the defaults are the `WATCHERS_*` constants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WatcherLimits {
    pub total: usize,
    pub per_tenant: usize,
    pub per_key: usize,
}

impl Default for WatcherLimits {
    fn default() -> Self {
        Self { total: WATCHERS_MAX, per_tenant: WATCHERS_PER_TENANT_MAX, per_key: WATCHERS_PER_KEY_MAX }
    }
}

/// Watcher slots, counted in total, per tenant (of the calling key) and per key.
#[derive(Debug, Default)]
pub struct WatcherSlots {
    limits: WatcherLimits,
    held: std::sync::Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    /// Only tenants and keys holding a slot have an entry, so the maps are bounded by `total`.
    per_tenant: std::collections::HashMap<TenantId, usize>,
    per_key: std::collections::HashMap<String, usize>,
}

/// One watcher's slot; dropping it frees the slot.
#[derive(Debug)]
pub struct WatcherSlot {
    slots: Arc<WatcherSlots>,
    tenant: TenantId,
    key_id: String,
}

impl WatcherSlots {
    pub fn new(limits: WatcherLimits) -> Arc<Self> {
        Arc::new(Self { limits, held: Default::default() })
    }

    /// A slot for a watcher of `key_id` (a key of `tenant`), or `UNAVAILABLE` naming the limit
    /// that is reached.
    pub fn acquire(self: &Arc<Self>, tenant: TenantId, key_id: &str) -> Result<WatcherSlot> {
        let mut held = self.held.lock().expect("watcher slots");
        let limits = self.limits;
        if held.total >= limits.total {
            return Err(Error::Unavailable(format!("{} watchers are connected already; retry later", limits.total)));
        }
        if held.per_tenant.get(&tenant).copied().unwrap_or(0) >= limits.per_tenant {
            return Err(Error::Unavailable(format!(
                "tenant {tenant} has {} watchers connected already, its limit; close one or retry later",
                limits.per_tenant
            )));
        }
        if held.per_key.get(key_id).copied().unwrap_or(0) >= limits.per_key {
            return Err(Error::Unavailable(format!(
                "this key has {} watchers connected already, its limit; close one or retry later",
                limits.per_key
            )));
        }
        held.total += 1;
        *held.per_tenant.entry(tenant).or_default() += 1;
        *held.per_key.entry(key_id.to_owned()).or_default() += 1;
        Ok(WatcherSlot { slots: self.clone(), tenant, key_id: key_id.to_owned() })
    }

    /// Slots held now: the number of live watch producers.
    pub fn held(&self) -> usize {
        self.held.lock().expect("watcher slots").total
    }
}

impl Drop for WatcherSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().expect("watcher slots");
        held.total -= 1;
        if let Some(n) = held.per_tenant.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                held.per_tenant.remove(&self.tenant);
            }
        }
        if let Some(n) = held.per_key.get_mut(&self.key_id) {
            *n -= 1;
            if *n == 0 {
                held.per_key.remove(&self.key_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_limited_in_total_per_tenant_and_per_key() {
        let slots = WatcherSlots::new(WatcherLimits { total: 5, per_tenant: 3, per_key: 2 });
        let (a, b) = (TenantId::generate(), TenantId::generate());
        let a1 = [slots.acquire(a, "k1").unwrap(), slots.acquire(a, "k1").unwrap()];
        assert!(slots.acquire(a, "k1").unwrap_err().to_string().contains("this key"));
        let a2 = slots.acquire(a, "k2").unwrap();
        assert!(slots.acquire(a, "k3").unwrap_err().to_string().contains("tenant"));
        let b1 = [slots.acquire(b, "k4").unwrap(), slots.acquire(b, "k5").unwrap()];
        assert!(slots.acquire(b, "k6").unwrap_err().to_string().contains("5 watchers"));
        assert_eq!(slots.held(), 5);
        drop(a2);
        let _a3 = slots.acquire(a, "k3").unwrap();
        drop((a1, b1));
        assert_eq!(slots.held(), 1);
        let held = slots.held.lock().unwrap();
        assert_eq!((held.per_tenant.len(), held.per_key.len()), (1, 1), "no entries are left for idle tenants and keys");
    }

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
