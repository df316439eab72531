//! The live event stream: `GET /watch` as server-sent events, and the type patterns it shares
//! with `events.list`.
//!
//! Each event goes out as `id: COMMIT.INDEX` (its outbox position), `event: TYPE`, and one line
//! of JSON. A new watcher starts at the end of the log, as `tail -f` does; `?since=start` (or
//! `since=0`) replays from the beginning. `Last-Event-ID` (a reconnect) or `?since=` resume
//! exactly after a position; both `COMMIT.INDEX` and `COMMIT:INDEX` are accepted.
//!
//! One shared tail per process ([`tail`], the Kubernetes watch cache's shape) reads each
//! commit's new rows once, woken by the appender's commit notification (once the commit's
//! writers have their answers, or after `WATCH_ANSWER_WAIT_MS`; a fan-out to many watchers
//! `WATCH_AFTER_ANSWER_MS` later) and polling every
//! `WATCH_POLL_MS` for other processes' commits, renders each event once, and hands it to every
//! caught-up watcher of its tenant whose filter takes it; a bounded ring of recent events
//! (`WATCH_RING_EVENTS`, `WATCH_RING_BYTES`) serves a watcher that joins from a recent position.
//! A watcher that is behind (it resumes from before the ring, or its client did not keep up)
//! reads history itself, a page of `WATCH_PAGE_ROWS` at a time, and then joins the tail with no
//! gap and no duplicate at the seam (`tail.rs` says why). Each watcher's task holds its slot,
//! does that catching up, and checks its key. Each client has a bounded buffer
//! (`WATCH_BUFFER_EVENTS`): when it is full the tail hands the watcher back, and a client that
//! takes nothing for `WATCH_SEND_TIMEOUT_S` is disconnected, so a slow reader never grows the
//! server's memory. The key is checked again every `WATCH_REAUTH_S` and whenever API keys of
//! the watched tenant or of the key's own change (before anything more is sent), and a server
//! shutdown ends every stream (a graceful shutdown waits for open responses). Heartbeats every
//! `WATCH_HEARTBEAT_S`. A client that stops reading is dropped by the connection's write
//! deadline (`conn.rs`). Slots are limited in total (`WATCHERS_MAX`), per tenant
//! (`WATCHERS_PER_TENANT_MAX`) and per key (`WATCHERS_PER_KEY_MAX`); a watcher's slot is held
//! by its task, which ends as soon as the client is gone.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use bc_core::event::Position;
use bc_core::id::TenantId;
use bc_core::store::{EventStore, decode_rows};
use bc_core::{Error, Result};
use serde::Deserialize;

use crate::AppState;
use crate::error::ApiError;

pub mod tail;

use tail::{Cursor, Join, Why, end_of};
pub use tail::{Tail, TailLimits, WATCH_RING_BYTES, WATCH_RING_EVENTS};

/// Type patterns one watch or list may give.
pub const WATCH_TYPES_MAX: usize = bc_projections::events::TYPE_PATTERNS_MAX;
/// Events queued for one watcher's client; when full, the tail hands the watcher back.
pub const WATCH_BUFFER_EVENTS: usize = 256;
/// How long a watcher waits for its client to take an event before disconnecting it.
pub const WATCH_SEND_TIMEOUT_S: u64 = 30;
/// How often the tail looks for commits made by other processes.
pub const WATCH_POLL_MS: u64 = 1000;
/// How long the tail waits, after this process commits, for the commit's writers to have their
/// answers before it reads the commit for the watchers ([`bc_core::store::Log::answered`]): a
/// write is answered before its fan-out takes the cores. A caller that holds its answer longer
/// delays the watchers by this much at most, and `WATCH_AFTER_ANSWER_MS` for a fan-out to many
/// watchers (each rounded up to tokio's millisecond timer tick: 3–5 ms in all, at worst). A
/// commit the tail has already read (it landed while the tail waited or read) is not waited for.
pub const WATCH_ANSWER_WAIT_MS: u64 = 2;
/// Then, when what the tail read goes to `WATCH_AFTER_ANSWER_WATCHERS` or more watchers (the
/// joined watchers of its events' tenants), how long more before the fan-out: the writers'
/// clients read their answers while the cores are not busy writing to every watcher. With 1,000
/// watchers on 2 cores (`make bench`, 2026-12-05, four interleaved pairs), a write's p99 went
/// from 6.4–10.0 ms to 2.5–3.2 ms (with no watcher: 1.5–2.6 ms), and write → watcher p50 from
/// 7.4–8.7 ms to 10.1–11.3 ms (etcd's: 24–30 ms). A fan-out to a few watchers takes the cores
/// for microseconds, not milliseconds, and is not held back: with one watcher the wait had taken
/// write → watcher p50 from 0.8–1.0 ms to 3.2 ms, for nothing.
pub const WATCH_AFTER_ANSWER_MS: u64 = 1;
/// Watchers a fan-out goes to from which the tail waits `WATCH_AFTER_ANSWER_MS` after the
/// answers. Measured at 1 and 1,000 watchers only: 128 is an estimate of where a fan-out's socket
/// writes (several µs each, counting both ends of loopback) come to about a millisecond. Above
/// the 64 watchers one tenant's keys may hold by default, so it takes a tenant with raised
/// limits, or the root's administrators watching it.
pub const WATCH_AFTER_ANSWER_WATCHERS: usize = 128;
const _: () = assert!(WATCH_AFTER_ANSWER_WATCHERS <= WATCHERS_MAX);
/// Comment lines that keep idle connections (and proxies) alive.
pub const WATCH_HEARTBEAT_S: u64 = 15;
/// Watchers served at once, all tenants together: each costs a task, a buffer and (over
/// HTTP/1.1) a connection, and nothing per event of other tenants.
pub const WATCHERS_MAX: usize = 1024;
/// Watchers one tenant's keys hold at once, so one tenant cannot take every slot.
pub const WATCHERS_PER_TENANT_MAX: usize = 64;
/// Watchers one API key holds at once, so one leaked or looping client cannot take its
/// tenant's share.
pub const WATCHERS_PER_KEY_MAX: usize = 16;
const _: () = assert!(WATCHERS_PER_KEY_MAX <= WATCHERS_PER_TENANT_MAX && WATCHERS_PER_TENANT_MAX <= WATCHERS_MAX);
// Every watcher can have a connection of its own, with room left for requests.
const _: () = assert!(WATCHERS_MAX < crate::conn::CONNECTIONS_MAX);
/// How often a watcher's key is checked again, so a revoked key stops receiving events.
pub const WATCH_REAUTH_S: u64 = 30;
/// Rows read from the log per query, by the tail and by a watcher that is behind.
pub const WATCH_PAGE_ROWS: u32 = 500;
const _: () = assert!(WATCH_BUFFER_EVENTS >= 1 && WATCH_PAGE_ROWS as usize >= WATCH_BUFFER_EVENTS);

/// The key presented as `header` (`Authorization`), read as it is now rather than from the
/// cache, if it is still live and still grants `action` in `tenant`: a revoked or deleted key is
/// `UNAUTHENTICATED`, one that no longer grants the action `ACCESS_DENIED`, and a failed read
/// its own error. What a watch checks every `WATCH_REAUTH_S`, and a tunnel every
/// `tunnels::TUNNEL_RECHECK_S`, while they last.
pub(crate) async fn still_authorized(
    store: &dyn EventStore,
    header: Option<&str>,
    action: &str,
    tenant: TenantId,
) -> Result<crate::auth::Principal> {
    let principal = crate::auth::authenticate(store, header).await?;
    principal.authorize(action, tenant)?;
    Ok(principal)
}

/// What a client is sent when nothing else was for `WATCH_HEARTBEAT_S`: an SSE comment.
const HEARTBEAT: &[u8] = b":\n\n";

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
    let after = match resume.as_deref() {
        // Like `tail -f`: a new watcher sees what commits from now on.
        None => end_of(state.store.last_commit().await?),
        Some("start" | "0") => Position::START,
        Some(p) => p.parse::<Position>()?,
    };
    let patterns: Vec<String> = query
        .types
        .as_deref()
        .map(|t| t.split(',').map(|p| p.trim().to_owned()).filter(|p| !p.is_empty()).collect())
        .unwrap_or_default();
    let filter = TypeFilter::parse(&patterns)?;
    // The slot lives in the watcher's task, which ends when the client is gone (its receiver
    // dropped), so the count is of live watchers, and a stalled connection keeps its slot only
    // until the write deadline drops it.
    let slot = state.watchers.acquire(principal.tenant, &principal.key_id)?;
    let wakes = tail::Wakes { commits: state.log.subscribe(), answered: state.log.answered() };
    state.watch_tail.start(&state.store, wakes, state.shutdown.subscribe()).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(state.watch_tail.limits().buffer_events);
    let watcher = Watcher {
        tail: state.watch_tail.clone(),
        store: state.store.clone(),
        token_header: header.map(str::to_owned),
        closed: tx.clone(),
        shutdown: state.shutdown.subscribe(),
        authorized_at: Instant::now(),
    };
    let cursor = Cursor { tenant, key_tenant: principal.tenant, filter, after, tx };
    tokio::spawn(async move {
        let _slot = slot;
        watcher.run(cursor).await;
    });
    Ok(stream_response(rx))
}

/// The response: the client's buffer as a body of server-sent events, and a heartbeat every
/// `WATCH_HEARTBEAT_S` (on a timer of its own that frames do not touch, so a frame costs no timer
/// work). It ends when the watcher's task and the tail have both let go of the buffer.
fn stream_response(rx: tokio::sync::mpsc::Receiver<Bytes>) -> Response {
    let period = Duration::from_secs(WATCH_HEARTBEAT_S);
    let mut heartbeat = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let frames = futures::stream::unfold((rx, heartbeat), |(mut rx, mut heartbeat)| async move {
        let frame = tokio::select! {
            biased;
            frame = rx.recv() => frame?,
            _ = heartbeat.tick() => Bytes::from_static(HEARTBEAT),
        };
        Some((Ok::<_, Infallible>(frame), (rx, heartbeat)))
    });
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(frames))
        .into_response()
}

/// One watcher's task: it catches up when the watcher is behind, joins the tail, and checks
/// the key; the tail does the sending while the watcher is joined.
struct Watcher {
    tail: Arc<Tail>,
    store: Arc<dyn EventStore>,
    token_header: Option<String>,
    /// A handle on the client's buffer, to notice the client is gone while the tail holds the
    /// cursor.
    closed: tokio::sync::mpsc::Sender<Bytes>,
    shutdown: tokio::sync::watch::Receiver<bool>,
    authorized_at: Instant,
}

/// What one page of history came to.
enum Page {
    /// Read and sent; join (or read more) next.
    Sent,
    /// An API key event was sent or passed: check the key before anything more.
    Recheck,
    /// The client is gone, too slow, the server stops, or the read failed.
    Ended,
}

impl Watcher {
    async fn run(mut self, mut cursor: Cursor) {
        let reauth = Duration::from_secs(WATCH_REAUTH_S);
        let mut recheck = false;
        loop {
            if *self.shutdown.borrow() {
                return;
            }
            // A revoked key, or one that lost the action, stops receiving events.
            if recheck || self.authorized_at.elapsed() >= reauth {
                if !self.still_authorized(cursor.tenant).await {
                    return;
                }
                recheck = false;
            }
            let tenant = cursor.tenant;
            cursor = match self.tail.join(cursor) {
                Join::Ended => return,
                Join::Recheck(c) => {
                    recheck = true;
                    c
                }
                Join::Full(c) => {
                    if !self.wait_for_room(&c).await {
                        return;
                    }
                    c
                }
                Join::Behind(mut c) => match self.history_page(&mut c).await {
                    Page::Sent => c,
                    Page::Recheck => {
                        recheck = true;
                        c
                    }
                    Page::Ended => return,
                },
                Join::Joined { id, mut handback } => {
                    let due = reauth.saturating_sub(self.authorized_at.elapsed());
                    let back = tokio::select! {
                        back = &mut handback => back,
                        _ = tokio::time::sleep(due) => match self.tail.leave(tenant, id) {
                            Some(c) => Ok(tail::Handback { cursor: c, why: Why::Keys }),
                            // Handed back meanwhile (or dropped): take it from the channel.
                            None => handback.await,
                        },
                        _ = self.shutdown.changed() => {
                            let _ = self.tail.leave(tenant, id);
                            return;
                        }
                        _ = self.closed.closed() => {
                            let _ = self.tail.leave(tenant, id);
                            return;
                        }
                    };
                    // Dropped by the tail: the client is gone, a stored event does not verify,
                    // or the server stops.
                    let Ok(back) = back else { return };
                    recheck |= back.why == Why::Keys;
                    back.cursor
                }
            };
        }
    }

    /// Checks the key again; false (and logged) when it no longer may read `tenant`'s events.
    async fn still_authorized(&mut self, tenant: TenantId) -> bool {
        let still = still_authorized(&*self.store, self.token_header.as_deref(), "compute:events:read", tenant).await;
        if still.is_err() {
            tracing::info!(%tenant, "ending a watch whose key is no longer valid");
            return false;
        }
        self.authorized_at = Instant::now();
        true
    }

    /// Waits up to `WATCH_SEND_TIMEOUT_S` for room in the client's buffer; false when the
    /// client is gone, took nothing in that time, or the server stops.
    async fn wait_for_room(&mut self, cursor: &Cursor) -> bool {
        let timeout = Duration::from_secs(WATCH_SEND_TIMEOUT_S);
        tokio::select! {
            room = tokio::time::timeout(timeout, cursor.tx.reserve()) => match room {
                // The permit is dropped unused: the next join sends into the room it saw.
                Ok(Ok(_permit)) => true,
                Ok(Err(_)) => false,
                Err(_) => {
                    tracing::info!(tenant = %cursor.tenant, "disconnecting a watcher that stopped reading");
                    false
                }
            },
            _ = self.shutdown.changed() => false,
        }
    }

    /// Reads one page of the watched tenant's history after the cursor and sends what the
    /// filter takes, each send waiting up to `WATCH_SEND_TIMEOUT_S`. A page shorter than asked
    /// for read everything committed when it began, so the cursor moves to the end of that
    /// commit even when none of it was this tenant's: the next join finds it in the ring.
    async fn history_page(&mut self, cursor: &mut Cursor) -> Page {
        let page_rows = self.tail.limits().page_rows;
        // Read before the rows: commit numbers are gap-free and become visible in order, so
        // the rows read next include every commit up to this one.
        let read = async {
            let last = self.store.last_commit().await?;
            let rows = self.store.read_after_rows(cursor.after, Some(cursor.tenant), page_rows).await.and_then(decode_rows)?;
            Ok::<_, Error>((last, rows))
        };
        let (last, rows) = match read.await {
            Ok(read) => read,
            Err(e) => {
                tracing::warn!(error = %e, "watch stream ended: reading the log failed");
                return Page::Ended;
            }
        };
        let short = rows.len() < page_rows as usize;
        let timeout = Duration::from_secs(WATCH_SEND_TIMEOUT_S);
        for event in rows {
            if cursor.filter.matches(&event.envelope.event_type) {
                let sent = tokio::select! {
                    sent = cursor.tx.send_timeout(tail::frame(&event), timeout) => sent,
                    _ = self.shutdown.changed() => return Page::Ended,
                };
                match sent {
                    Ok(()) => {}
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Timeout(_)) => {
                        tracing::info!(tenant = %cursor.tenant, "disconnecting a watcher that stopped reading");
                        return Page::Ended;
                    }
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Closed(_)) => return Page::Ended,
                }
            } else if cursor.tx.is_closed() {
                // A client gone away ends its watcher even while its filter drops every event.
                return Page::Ended;
            }
            cursor.after = event.position;
            if event.envelope.event_type.starts_with("api_key.") {
                // Keys changed: check this watcher's key before sending anything more.
                return Page::Recheck;
            }
        }
        if short {
            cursor.after = cursor.after.max(end_of(last));
        }
        Page::Sent
    }
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

impl WatcherLimits {
    /// Limits an operator set, checked: each at least 1, a key's at most its tenant's, a
    /// tenant's at most the total, and the total below the connections a gateway keeps open
    /// (every watcher holds one, and the API needs some for itself).
    pub fn checked(total: usize, per_tenant: usize, per_key: usize, connections_max: usize) -> Result<Self> {
        if per_key == 0 || per_key > per_tenant || per_tenant > total || total >= connections_max {
            return Err(Error::invalid(format!(
                "watcher limits must hold 1 <= per key ({per_key}) <= per tenant ({per_tenant}) <= total ({total}) < \
                 connections ({connections_max})"
            )));
        }
        Ok(Self { total, per_tenant, per_key })
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

    /// Frames go out as they come; a heartbeat comment after each `WATCH_HEARTBEAT_S`, on a
    /// paused clock; the body ends when its buffer's senders are gone.
    #[tokio::test(start_paused = true)]
    async fn the_stream_sends_frames_and_a_heartbeat_every_period() {
        use futures::StreamExt;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let response = stream_response(rx);
        assert_eq!(response.headers()[header::CONTENT_TYPE], "text/event-stream");
        let mut body = response.into_body().into_data_stream();
        tx.send(Bytes::from_static(b"id: 1.0\nevent: pool.created\ndata: {}\n\n")).await.unwrap();
        assert_eq!(&body.next().await.unwrap().unwrap()[..], b"id: 1.0\nevent: pool.created\ndata: {}\n\n");
        let started = tokio::time::Instant::now();
        assert_eq!(&body.next().await.unwrap().unwrap()[..], HEARTBEAT);
        assert_eq!(started.elapsed(), Duration::from_secs(WATCH_HEARTBEAT_S), "on the virtual clock");
        assert_eq!(&body.next().await.unwrap().unwrap()[..], HEARTBEAT);
        drop(tx);
        assert!(body.next().await.is_none(), "the stream ends with its buffer");
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
