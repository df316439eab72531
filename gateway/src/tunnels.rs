//! Tunnels (`schema/TUNNELS.md`): the tickets `tunnels.open` grants, `GET /tunnels/{ticket}` (the
//! WebSocket, `v5.channel.k8s.io`), and its relay to the node's agent over the agent's own gRPC
//! connection.
//!
//! Everything is in this process's memory ([`Tunnels`]): tickets (a secret, never logged nor
//! stored), the nodes whose agent holds a session here, on which connection, and what each
//! advertised, the tunnels waiting for their agent to attach, and the open tunnels' counts per
//! tenant, key and node. Invariants:
//!
//! - A ticket counts against the bounds from its issue (so a burst of `tunnels.open` cannot pass
//!   them) until it expires unspent or its tunnel ends; only unspent tickets bound the map
//!   (`TICKETS_MAX`), spent and expired ones are remembered in the room left.
//! - An agent's `Tunnel` call pairs with a waiting tunnel only on the connection of the session
//!   that was asked; any other call leaves it waiting. A waiting entry goes with its dial.
//! - `GET /tunnels/{ticket}` checks the ticket's form before anything costly, answers every
//!   refusal before the upgrade, and records a refused ticket of a known node (`tunnel.refused`).
//! - Every tunnel that runs is two events, `tunnel.opened` (appended once the socket is
//!   upgraded; none for an upgrade that fails) and `tunnel.closed`, with counts, never a byte
//!   typed or printed.
//!
//! The relay (`relay.rs`) checks every frame both ways with `bc_core::tunnel`, counts payload
//! bytes, and ends the tunnel on its time limits, the gateway's shutdown, or a recheck that finds
//! its key revoked or its target gone.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::ws::{WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use bc_core::id::{SandboxId, TenantId};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_core::tunnel::{self as wire, Op};
use bc_core::{Error, ErrorCode, Result};
use bc_projections::decide::tunnel::{
    TunnelCounts, TunnelGrant, TunnelRefusal, TunnelRefusalKind, TunnelTargetNow, tunnel_action, tunnel_target_ended,
};
use bc_projections::tunnel::{
    CloseReason, TUNNEL_CLOSED, TUNNEL_OPENED, TUNNEL_REFUSED, TunnelClosed, TunnelOpened, TunnelRefused,
};
use bc_projections::{InstanceDoc, KIND_INSTANCE, KIND_NODE, KIND_RESERVATION, NodeDoc, ReservationDoc, stream_of};
use futures::{Stream, StreamExt};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use crate::AppState;
use crate::agents::ConnectionId;

mod relay;
use crate::error::ApiError;

// A client's largest message fits one agent message (`bc_proto::MESSAGE_BYTES_MAX` allows for the envelope).
const _: () = assert!(wire::FRAME_BYTES_MAX == bc_proto::TUNNEL_FRAME_BYTES_MAX);
pub use relay::{Ending, Relayed, TUNNEL_CLOSE_GRACE_MS};

/// Tickets one process holds, so a flood of `tunnels.open` cannot grow memory. Only unspent
/// ones bound it: spent and expired tickets are remembered in the room left (so a late use says
/// "spent" or "expired" rather than "unknown"), the oldest forgotten first to make room.
pub const TICKETS_MAX: usize = 4096;
/// A ticket is remembered at most this long past its expiry.
pub const TICKET_FORGET_AFTER_MS: u64 = 60_000;
/// The longest a ticket may be good for (`--tunnel-ticket-ttl`; 30 s by default,
/// `bc_core::tunnel::TICKET_TTL_MS`): a ticket is a bearer secret, used at once.
pub const TICKET_TTL_MAX_S: u64 = 300;
const _: () = assert!(wire::TICKET_TTL_MS <= TICKET_TTL_MAX_S * 1000);
/// Refusals of one ticket recorded as `tunnel.refused`: past them a refusal is only answered, so
/// a client retrying a spent ticket in a loop cannot flood the node's stream.
pub const TICKET_REFUSALS_RECORDED_MAX: u8 = 8;
/// Tunnels open at once per tenant, per API key and per node (`--tunnels-per-tenant-max`,
/// `--tunnels-per-key-max`, `--tunnels-per-node-max`). Each is one HTTP/2 stream of the agent's
/// connection, which carries `agents::AGENT_STREAMS_PER_CONNECTION_MAX` with its session.
pub const TUNNELS_PER_TENANT_MAX: usize = 64;
pub const TUNNELS_PER_KEY_MAX: usize = 16;
pub const TUNNELS_PER_NODE_MAX: usize = 16;
const _: () = assert!(TUNNELS_PER_NODE_MAX < crate::agents::AGENT_STREAMS_PER_CONNECTION_MAX as usize);
/// A tunnel carrying no data either way this long is closed (`--tunnel-idle-timeout`).
pub const TUNNEL_IDLE_TIMEOUT_S: u64 = 900;
/// The longest a tunnel stays open (`--tunnel-max-duration`).
pub const TUNNEL_MAX_DURATION_S: u64 = 12 * 3600;
/// The longest `--tunnel-idle-timeout` and `--tunnel-max-duration` may be.
pub const TUNNEL_TIMEOUT_MAX_S: u64 = 7 * 24 * 3600;
const _: () = assert!(TUNNEL_IDLE_TIMEOUT_S <= TUNNEL_TIMEOUT_MAX_S && TUNNEL_MAX_DURATION_S <= TUNNEL_TIMEOUT_MAX_S);
/// The agent must attach its end within this of the upgrade.
pub const AGENT_ATTACH_TIMEOUT_MS: u64 = 10_000;
/// Frames queued each way between the WebSocket and the agent's stream: a slow reader holds the
/// other side back rather than growing a buffer.
pub const TUNNEL_FRAMES_QUEUED: usize = 16;
/// The relay pings the client this often, so the connection's own idle deadline
/// (`conn::IDLE_TIMEOUT_S`) never closes a quiet tunnel: only the tunnel's idle timeout does.
pub const TUNNEL_KEEPALIVE_S: u64 = 30;
const _: () = assert!(TUNNEL_KEEPALIVE_S < crate::conn::IDLE_TIMEOUT_S);
/// How often an open tunnel reads its key and its target again: a key revoked, a key that no
/// longer grants the tunnel's action, a node deleted, an instance stopped or deleted, or the
/// reservation holding the instance ended closes it within this.
pub const TUNNEL_RECHECK_S: u64 = 5;
const _: () = assert!(TUNNEL_RECHECK_S < TUNNEL_KEEPALIVE_S);
/// Tunnel requests queued for one node's session.
pub const OPEN_REQUESTS_QUEUED: usize = 8;

/// The bounds of tunnels (`dev`/`serve` flags); the defaults are the named constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TunnelLimits {
    pub per_tenant_max: usize,
    pub per_key_max: usize,
    pub per_node_max: usize,
    pub idle_timeout: Duration,
    pub max_duration: Duration,
    /// How long a ticket is good for (`--tunnel-ticket-ttl`).
    pub ticket_ttl: Duration,
}

impl Default for TunnelLimits {
    fn default() -> Self {
        Self {
            per_tenant_max: TUNNELS_PER_TENANT_MAX,
            per_key_max: TUNNELS_PER_KEY_MAX,
            per_node_max: TUNNELS_PER_NODE_MAX,
            idle_timeout: Duration::from_secs(TUNNEL_IDLE_TIMEOUT_S),
            max_duration: Duration::from_secs(TUNNEL_MAX_DURATION_S),
            ticket_ttl: Duration::from_millis(wire::TICKET_TTL_MS),
        }
    }
}

impl TunnelLimits {
    pub fn bounds(&self) -> bc_projections::decide::tunnel::TunnelBounds {
        bc_projections::decide::tunnel::TunnelBounds {
            per_tenant_max: self.per_tenant_max,
            per_key_max: self.per_key_max,
            per_node_max: self.per_node_max,
        }
    }
}

/// What a node's session is asked to do: open a `Tunnel` call carrying `tunnel_id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenRequest {
    pub tunnel_id: Vec<u8>,
    pub op: Op,
    pub instance_id: Option<String>,
    pub port: Option<u16>,
    /// `exec` in a sandbox: the command.
    pub command: Vec<String>,
}

/// The agent's end of a tunnel, as its `Tunnel` call delivered it: frames from the node, and a
/// sender of frames to it. Dropping the sender ends the call.
pub struct AgentEnd {
    pub from_node: std::pin::Pin<Box<dyn Stream<Item = Bytes> + Send>>,
    pub to_node: mpsc::Sender<Bytes>,
}

/// One granted ticket.
struct Ticket {
    tenant: TenantId,
    key_id: String,
    grant: TunnelGrant,
    expires_at_ms: u64,
    spent: bool,
    /// Its refusals recorded as `tunnel.refused` so far (at most `TICKET_REFUSALS_RECORDED_MAX`).
    refusals_recorded: u8,
}

/// A node whose agent holds a session with this process.
struct Attached {
    session: u64,
    /// The agents' endpoint connection that carries the session: a tunnel's `Tunnel` call must
    /// come on it.
    connection: ConnectionId,
    capabilities: Vec<String>,
    requests: mpsc::Sender<OpenRequest>,
}

/// A tunnel whose agent has been asked to attach: the session asked, on which connection, and
/// where its end goes.
struct Waiting {
    node: String,
    session: u64,
    connection: ConnectionId,
    attached: oneshot::Sender<AgentEnd>,
}

#[derive(Default)]
struct Inner {
    tickets: HashMap<String, Ticket>,
    nodes: HashMap<String, Attached>,
    waiting: HashMap<Vec<u8>, Waiting>,
    per_tenant: HashMap<TenantId, usize>,
    per_key: HashMap<String, usize>,
    per_node: HashMap<String, usize>,
    next_session: u64,
}

impl Inner {
    fn counts(&self, tenant: TenantId, key: &str, node: &str) -> TunnelCounts {
        TunnelCounts {
            tenant: self.per_tenant.get(&tenant).copied().unwrap_or(0),
            key: self.per_key.get(key).copied().unwrap_or(0),
            node: self.per_node.get(node).copied().unwrap_or(0),
        }
    }

    fn take(&mut self, tenant: TenantId, key: &str, node: &str) {
        *self.per_tenant.entry(tenant).or_insert(0) += 1;
        *self.per_key.entry(key.to_owned()).or_insert(0) += 1;
        *self.per_node.entry(node.to_owned()).or_insert(0) += 1;
    }

    fn give_back(&mut self, tenant: TenantId, key: &str, node: &str) {
        fn down<K: std::hash::Hash + Eq>(map: &mut HashMap<K, usize>, k: &K) {
            if let Some(n) = map.get_mut(k) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    map.remove(k);
                }
            }
        }
        down(&mut self.per_tenant, &tenant);
        down(&mut self.per_key, &key.to_owned());
        down(&mut self.per_node, &node.to_owned());
    }

    /// Room for one more ticket: when the map is full, the spent or expired ticket that expires
    /// first is forgotten. `false`: every ticket held is unspent.
    fn make_room(&mut self) -> bool {
        if self.tickets.len() < TICKETS_MAX {
            return true;
        }
        let oldest = self.tickets.iter().filter(|(_, t)| t.spent).min_by_key(|(_, t)| t.expires_at_ms).map(|(k, _)| k.clone());
        match oldest {
            Some(ticket) => {
                self.tickets.remove(&ticket);
                true
            }
            None => false,
        }
    }

    /// Forgets old tickets; one that expired unspent gives its place back.
    fn sweep(&mut self, now_ms: u64) {
        let expired: Vec<String> = self
            .tickets
            .iter()
            .filter(|(_, t)| !t.spent && now_ms >= t.expires_at_ms || now_ms >= t.expires_at_ms + TICKET_FORGET_AFTER_MS)
            .map(|(k, _)| k.clone())
            .collect();
        for ticket in expired {
            let t = self.tickets.get_mut(&ticket).expect("listed above");
            if !t.spent {
                t.spent = true;
                let (tenant, key, node) = (t.tenant, t.key_id.clone(), t.grant.node_id.clone());
                self.give_back(tenant, &key, &node);
            }
            if now_ms >= self.tickets[&ticket].expires_at_ms + TICKET_FORGET_AFTER_MS {
                self.tickets.remove(&ticket);
            }
        }
    }
}

/// The tunnels of this process: tickets, attached sessions, open counts.
pub struct Tunnels {
    pub limits: TunnelLimits,
    inner: Mutex<Inner>,
}

/// A session's place among the attached nodes; detached when dropped.
pub struct SessionLink {
    tunnels: Arc<Tunnels>,
    node: String,
    session: u64,
}

impl Drop for SessionLink {
    fn drop(&mut self) {
        let mut inner = self.tunnels.lock();
        if inner.nodes.get(&self.node).is_some_and(|a| a.session == self.session) {
            inner.nodes.remove(&self.node);
        }
    }
}

/// A dial's waiting entry, removed when the dial returns or its future is dropped.
struct WaitingGuard<'a> {
    tunnels: &'a Tunnels,
    tunnel_id: &'a [u8],
}

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        self.tunnels.lock().waiting.remove(self.tunnel_id);
    }
}

/// A spent ticket's tunnel: what it is bound to, and its place in the counts until dropped.
pub struct TunnelSlot {
    tunnels: Arc<Tunnels>,
    pub tenant: TenantId,
    pub key_id: String,
    pub grant: TunnelGrant,
}

impl Drop for TunnelSlot {
    fn drop(&mut self) {
        self.tunnels.lock().give_back(self.tenant, &self.key_id, &self.grant.node_id);
    }
}

/// Why a ticket cannot be spent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpendRefusal {
    Unknown,
    OtherKey,
    Spent,
    Expired,
}

impl SpendRefusal {
    /// The refusal as the answer's `details.reason` and `tunnel.refused`'s `reason` say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::OtherKey => "other-key",
            Self::Spent => "spent",
            Self::Expired => "expired",
        }
    }

    /// The API's answer (a ticket is good for `ticket_ttl`), with `details.reason`.
    pub fn answer(self, ticket_ttl: Duration) -> ApiError {
        let error = match self {
            Self::Unknown => Error::not_found("ticket (never issued, or forgotten after it expired)"),
            Self::OtherKey => Error::AccessDenied("this ticket was issued to another API key".into()),
            Self::Spent => Error::state("this ticket was spent already: a ticket opens one tunnel", "call tunnels.open again"),
            Self::Expired => Error::state(
                format!("this ticket expired: a ticket is good for {} s", ticket_ttl.as_secs_f64()),
                "call tunnels.open again and connect at once",
            ),
        };
        ApiError::with_details(error, json!({ "reason": self.as_str() }))
    }
}

/// A refused spend: why, and the ticket's binding when the ticket is known and this refusal is
/// to be recorded (`tunnel.refused`).
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub why: SpendRefusal,
    /// Boxed: the grant (a sandbox exec's command with it) would make every refusal large.
    pub record: Option<Box<RefusedTicket>>,
}

/// What `tunnel.refused` says of the refused ticket (never the ticket itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedTicket {
    /// The tenant it was issued in: the node's.
    pub tenant: TenantId,
    /// The key it was issued to.
    pub key_id: String,
    pub grant: TunnelGrant,
}

impl Tunnels {
    pub fn new(limits: TunnelLimits) -> Arc<Self> {
        Arc::new(Self { limits, inner: Mutex::new(Inner::default()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Attaches `node`'s session, carried by `connection` and which advertised `capabilities`:
    /// tunnel requests for the node come on the receiver until the link is dropped (a newer
    /// session of the node replaces it), and their `Tunnel` calls must come on `connection`.
    pub fn attach_session(
        self: &Arc<Self>,
        node: &str,
        connection: ConnectionId,
        capabilities: Vec<String>,
    ) -> (SessionLink, mpsc::Receiver<OpenRequest>) {
        let (requests, receiver) = mpsc::channel(OPEN_REQUESTS_QUEUED);
        let mut inner = self.lock();
        inner.next_session += 1;
        let session = inner.next_session;
        inner.nodes.insert(node.to_owned(), Attached { session, connection, capabilities, requests });
        (SessionLink { tunnels: self.clone(), node: node.to_owned(), session }, receiver)
    }

    /// Issues a ticket if `decide` (given the open counts of the tenant, the key and the node,
    /// and what the node's session advertised, if it has one here) grants it. Returns the
    /// ticket and its expiry.
    pub fn issue(
        &self,
        tenant: TenantId,
        key_id: &str,
        node_id: &str,
        now_ms: u64,
        decide: impl FnOnce(TunnelCounts, Option<&[String]>) -> std::result::Result<TunnelGrant, TunnelRefusal>,
    ) -> std::result::Result<(String, u64), TunnelRefusal> {
        let mut inner = self.lock();
        inner.sweep(now_ms);
        let counts = inner.counts(tenant, key_id, node_id);
        let capabilities = inner.nodes.get(node_id).map(|a| a.capabilities.clone());
        let grant = decide(counts, capabilities.as_deref())?;
        if !inner.make_room() {
            return Err(TunnelRefusal {
                kind: TunnelRefusalKind::QuotaExceeded,
                message: format!("this gateway holds {TICKETS_MAX} unspent tickets, the most it may; retry in a minute"),
                reason: Some("tickets"),
            });
        }
        let ticket = format!(
            "{}{}",
            wire::TICKET_PREFIX,
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rand::random::<[u8; 32]>())
        );
        debug_assert!(wire::is_ticket(&ticket));
        let expires_at_ms = now_ms + u64::try_from(self.limits.ticket_ttl.as_millis()).unwrap_or(u64::MAX);
        inner.take(tenant, key_id, &grant.node_id);
        let issued = Ticket { tenant, key_id: key_id.to_owned(), grant, expires_at_ms, spent: false, refusals_recorded: 0 };
        inner.tickets.insert(ticket.clone(), issued);
        Ok((ticket, expires_at_ms))
    }

    /// Spends `ticket` for `key_id`: it is the caller's, unspent and unexpired. The slot holds
    /// the tunnel's place in the counts until it is dropped. A refusal of a known ticket carries
    /// what `tunnel.refused` records, for its first `TICKET_REFUSALS_RECORDED_MAX` refusals.
    pub fn spend(self: &Arc<Self>, ticket: &str, key_id: &str, now_ms: u64) -> std::result::Result<TunnelSlot, Refused> {
        let mut inner = self.lock();
        inner.sweep(now_ms);
        let Some(t) = inner.tickets.get_mut(ticket) else { return Err(Refused { why: SpendRefusal::Unknown, record: None }) };
        let why = if t.key_id != key_id {
            SpendRefusal::OtherKey
        } else if t.spent {
            if now_ms >= t.expires_at_ms { SpendRefusal::Expired } else { SpendRefusal::Spent }
        } else {
            t.spent = true;
            return Ok(TunnelSlot { tunnels: self.clone(), tenant: t.tenant, key_id: t.key_id.clone(), grant: t.grant.clone() });
        };
        let record = (t.refusals_recorded < TICKET_REFUSALS_RECORDED_MAX).then(|| {
            t.refusals_recorded += 1;
            Box::new(RefusedTicket { tenant: t.tenant, key_id: t.key_id.clone(), grant: t.grant.clone() })
        });
        Err(Refused { why, record })
    }

    /// Asks the node's session to attach a tunnel's end, and waits for its `Tunnel` call. The
    /// waiting entry is gone when this returns or its future is dropped.
    pub async fn dial(&self, grant: &TunnelGrant, timeout: Duration) -> Result<AgentEnd> {
        let tunnel_id = rand::random::<[u8; 32]>().to_vec();
        let (attached, waiting) = oneshot::channel();
        let requests = {
            let mut inner = self.lock();
            let attached_node = inner.nodes.get(&grant.node_id).map(|a| (a.requests.clone(), a.session, a.connection));
            attached_node.map(|(requests, session, connection)| {
                let entry = Waiting { node: grant.node_id.clone(), session, connection, attached };
                inner.waiting.insert(tunnel_id.clone(), entry);
                requests
            })
        };
        let unavailable = || Error::Unavailable(format!("node {}'s agent has no session with this gateway now", grant.node_id));
        let requests = requests.ok_or_else(unavailable)?;
        let _forget = WaitingGuard { tunnels: self, tunnel_id: &tunnel_id };
        let request = OpenRequest {
            tunnel_id: tunnel_id.clone(),
            op: grant.op,
            instance_id: grant.instance_id.clone(),
            port: grant.port,
            command: grant.command.clone(),
        };
        let answer = async {
            requests.send(request).await.map_err(|_| unavailable())?;
            waiting.await.map_err(|_| unavailable())
        };
        let outcome = tokio::time::timeout(timeout, answer).await;
        match outcome {
            Ok(end) => end,
            Err(_) => Err(Error::Unavailable(format!(
                "node {}'s agent did not attach the tunnel within {} s",
                grant.node_id,
                timeout.as_secs()
            ))),
        }
    }

    /// Hands the agent's `Tunnel` call, which came on `connection`, to the tunnel waiting for
    /// `tunnel_id`; `false`: none is (an id never asked for, or one that timed out), or it waits
    /// for a call on another connection or of a session that ended, and the call should be
    /// refused. A refused call leaves the waiting tunnel as it was: only its own agent's call
    /// takes it.
    pub fn agent_attached(&self, tunnel_id: &[u8], connection: ConnectionId, end: AgentEnd) -> bool {
        let waiting = {
            let mut inner = self.lock();
            let Some(waiting) = inner.waiting.get(tunnel_id) else { return false };
            let session_live = inner.nodes.get(&waiting.node).is_some_and(|a| a.session == waiting.session);
            if waiting.connection != connection || !session_live {
                return false;
            }
            inner.waiting.remove(tunnel_id).expect("found above")
        };
        waiting.attached.send(end).is_ok()
    }

    /// Tunnels counted against `tenant` now (open, and tickets unspent).
    pub fn open_in(&self, tenant: TenantId) -> usize {
        self.lock().per_tenant.get(&tenant).copied().unwrap_or(0)
    }

    /// Tunnels counted now in all tenants (open, and tickets unspent): `/metrics`.
    pub fn open_total(&self) -> usize {
        self.lock().per_tenant.values().sum()
    }
}

/// `GET /tunnels/{ticket}`: checks the ticket's form, the request and the caller, spends the
/// ticket, has the node's agent attach its end, then upgrades; once upgraded, appends
/// `tunnel.opened` and relays until the tunnel ends. Every refusal is an HTTP answer with the
/// API's envelope, before the upgrade; an upgrade that fails appends nothing (the slot and the
/// agent's end are dropped with the callback), so the log holds no tunnel that never opened.
pub async fn upgrade(
    State(state): State<Arc<AppState>>,
    Path(ticket): Path<String>,
    peer: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    ws: std::result::Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Response {
    let from = peer.map(|axum::Extension(ConnectInfo(addr))| addr.to_string()).unwrap_or_default();
    match prepare(&state, &ticket, &from, &headers, ws).await {
        Ok((ws, slot, end)) => {
            let admitted = Admitted {
                slot,
                end,
                from,
                authorization: headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).map(str::to_owned),
            };
            ws.protocols([wire::SUBPROTOCOL])
                .max_message_size(wire::FRAME_BYTES_MAX)
                .on_failed_upgrade(|e| tracing::debug!(error = %e, "a tunnel's upgrade failed; nothing was opened"))
                .on_upgrade(move |socket| open_and_relay(state, admitted, socket))
                .into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// Everything `upgrade` checks and does before the `101`. A refused ticket of a known node is
/// recorded (`tunnel.refused`, from `from`) before the answer.
async fn prepare(
    state: &Arc<AppState>,
    ticket: &str,
    from: &str,
    headers: &HeaderMap,
    ws: std::result::Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> std::result::Result<(WebSocketUpgrade, TunnelSlot, AgentEnd), ApiError> {
    let ticket_ttl = state.tunnels.limits.ticket_ttl;
    // The form of the ticket before anything that reads the store or hashes a secret.
    if !wire::is_ticket(ticket) {
        return Err(SpendRefusal::Unknown.answer(ticket_ttl));
    }
    let ws = ws.map_err(|e| Error::invalid(format!("GET /tunnels/TICKET is a WebSocket upgrade: {e}")))?;
    let offered = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == wire::SUBPROTOCOL);
    if !offered {
        return Err(Error::InvalidArgument {
            message: format!("the WebSocket must offer the subprotocol {}", wire::SUBPROTOCOL),
            hint: Some("see schema/TUNNELS.md".into()),
        }
        .into());
    }
    // Read as it is now, not from the cache: a key revoked a moment ago opens nothing.
    let authorization = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
    let principal = crate::auth::authenticate(&*state.store, authorization).await?;
    let slot = match state.tunnels.spend(ticket, &principal.key_id, state.log.clock.now_ms()) {
        Ok(slot) => slot,
        Err(Refused { why, record }) => {
            if let Some(refused) = record {
                record_refusal(state, &refused, &principal.key_id, from, why).await;
            }
            return Err(why.answer(ticket_ttl));
        }
    };
    let end = state.tunnels.dial(&slot.grant, Duration::from_millis(AGENT_ATTACH_TIMEOUT_MS)).await?;
    Ok((ws, slot, end))
}

/// What `tunnel.closed` needs of the opening.
struct Opened {
    tunnel_id: String,
    started: tokio::time::Instant,
}

async fn append_node_event(state: &AppState, slot: &TunnelSlot, event_type: &str, payload: ciborium::Value) -> Result<()> {
    append_on_node(state, slot.tenant, &slot.grant.node_id, &slot.key_id, event_type, payload).await
}

/// Appends one event on `node`'s stream of `tenant`, its actor the API key `key_id`.
async fn append_on_node(
    state: &AppState,
    tenant: TenantId,
    node: &str,
    key_id: &str,
    event_type: &str,
    payload: ciborium::Value,
) -> Result<()> {
    let stream = stream_of(KIND_NODE, &node);
    let actor = format!("apikey:{key_id}");
    let request = AppendRequest::new(tenant, stream, ExpectedVersion::Any, actor, vec![NewEvent::new(event_type, payload)]);
    state.log.append(request).await.map(|_| ())
}

/// Records a refused ticket as `tunnel.refused` on its node's stream: who presented it (`key_id`,
/// the event's actor), from where, what it was for, and why it was refused. A failed append is
/// logged and the refusal answered all the same.
async fn record_refusal(state: &AppState, refused: &RefusedTicket, key_id: &str, from: &str, why: SpendRefusal) {
    let grant = &refused.grant;
    let event = TunnelRefused {
        op: grant.op.as_str().to_owned(),
        node_id: grant.node_id.clone(),
        instance_id: grant.instance_id.clone(),
        port: grant.port,
        key_id: key_id.to_owned(),
        ticket_key_id: refused.key_id.clone(),
        from: from.to_owned(),
        reason: why.as_str().to_owned(),
    };
    let appended = match bc_projections::events::to_cbor(&event) {
        Ok(payload) => append_on_node(state, refused.tenant, &grant.node_id, key_id, TUNNEL_REFUSED, payload).await,
        Err(e) => Err(e),
    };
    match appended {
        Ok(()) => tracing::info!(node = %grant.node_id, reason = why.as_str(), "a tunnel's ticket was refused"),
        Err(e) => tracing::warn!(node = %grant.node_id, code = %e.code(), error = %e, "tunnel.refused could not be appended"),
    }
}

async fn opened(state: &AppState, slot: &TunnelSlot, from: &str) -> Result<Opened> {
    let tunnel_id = format!("tun_{}", state.log.ids.ulid());
    let payload = bc_projections::events::to_cbor(&TunnelOpened {
        tunnel_id: tunnel_id.clone(),
        op: slot.grant.op.as_str().to_owned(),
        node_id: slot.grant.node_id.clone(),
        instance_id: slot.grant.instance_id.clone(),
        port: slot.grant.port,
        key_id: slot.key_id.clone(),
        from: from.to_owned(),
    })?;
    append_node_event(state, slot, TUNNEL_OPENED, payload).await?;
    tracing::info!(tunnel = %tunnel_id, node = %slot.grant.node_id, op = slot.grant.op.as_str(), "tunnel opened");
    Ok(Opened { tunnel_id, started: tokio::time::Instant::now() })
}

/// A spent ticket whose agent attached its end, until the upgrade: what the tunnel opens with.
struct Admitted {
    slot: TunnelSlot,
    end: AgentEnd,
    /// The client's address.
    from: String,
    /// The `Authorization` the client presented, kept in memory (never logged) for the
    /// rechecks, as a watch keeps it.
    authorization: Option<String>,
}

/// The upgraded tunnel: appends `tunnel.opened`, then relays. A tunnel the log cannot record
/// does not open: the client is sent a `Failure` status and the agent's end is dropped.
async fn open_and_relay(state: Arc<AppState>, admitted: Admitted, mut socket: WebSocket) {
    let Admitted { slot, end, from, authorization } = admitted;
    match opened(&state, &slot, &from).await {
        Ok(opened) => {
            let recheck = recheck(state.clone(), &slot, authorization);
            relay_and_close(state, slot, opened, end, recheck, socket).await
        }
        Err(e) => {
            tracing::warn!(node = %slot.grant.node_id, code = %e.code(), error = %e, "a tunnel was not opened: tunnel.opened could not be appended");
            relay::end_broken(&mut socket, "the gateway could not record the tunnel in its log; try again", false).await;
        }
    }
}

/// Relays until the tunnel ends (`relay`), then appends `tunnel.closed`.
async fn relay_and_close(
    state: Arc<AppState>,
    slot: TunnelSlot,
    opened: Opened,
    end: AgentEnd,
    recheck: relay::Recheck,
    socket: WebSocket,
) {
    let (to_client, from_client) = socket.split();
    let limits = state.tunnels.limits;
    let relayed = relay::relay(to_client, from_client, end, limits, state.shutdown.subscribe(), recheck).await;
    let closed = TunnelClosed {
        tunnel_id: opened.tunnel_id.clone(),
        node_id: slot.grant.node_id.clone(),
        duration_ms: u64::try_from(opened.started.elapsed().as_millis()).unwrap_or(u64::MAX),
        bytes_in: relayed.bytes_in,
        bytes_out: relayed.bytes_out,
        exit_status: relayed.exit,
        reason: relayed.reason.as_str().to_owned(),
    };
    tracing::info!(tunnel = %opened.tunnel_id, reason = relayed.reason.as_str(), "tunnel closed");
    let appended = match bc_projections::events::to_cbor(&closed) {
        Ok(payload) => append_node_event(&state, &slot, TUNNEL_CLOSED, payload).await,
        Err(e) => Err(e),
    };
    if let Err(e) = appended {
        tracing::error!(tunnel = %opened.tunnel_id, code = %e.code(), error = %e, "tunnel.closed could not be appended");
    }
    drop(slot);
}

/// An open tunnel's recheck (`TUNNEL_RECHECK_S`): the key that opened it, as the client
/// presented it (`authorization`), must still be live and still grant the tunnel's action in its
/// tenant (read as a watch reads it again, `watch::still_authorized`), and its target must not
/// have ended (`decide::tunnel::tunnel_target_ended`). A read that fails ends nothing: the next
/// recheck reads again.
fn recheck(state: Arc<AppState>, slot: &TunnelSlot, authorization: Option<String>) -> relay::Recheck {
    let (tenant, grant, authorization) = (slot.tenant, Arc::new(slot.grant.clone()), Arc::new(authorization));
    Box::new(move || {
        let (state, grant, authorization) = (state.clone(), grant.clone(), authorization.clone());
        Box::pin(async move { still_open(&state, tenant, &grant, authorization.as_deref()).await })
    })
}

async fn still_open(
    state: &AppState,
    tenant: TenantId,
    grant: &TunnelGrant,
    authorization: Option<&str>,
) -> Option<relay::Ending> {
    let action = match &grant.instance_id {
        Some(id) if id.starts_with(SandboxId::PREFIX) => crate::api::sandboxes::ACTION_SANDBOX_EXEC,
        _ => tunnel_action(grant.instance_id.is_none()),
    };
    if let Err(e) = crate::watch::still_authorized(&*state.store, authorization, action, tenant).await {
        let (reason, message) = match e.code() {
            ErrorCode::Unauthenticated => (CloseReason::KeyRevoked, "the API key that opened the tunnel was revoked".to_owned()),
            ErrorCode::AccessDenied => {
                (CloseReason::AccessLost, format!("the API key that opened the tunnel no longer grants {action}"))
            }
            _ => {
                tracing::warn!(node = %grant.node_id, code = %e.code(), error = %e, "a tunnel's key could not be read again; it stays open until the next recheck");
                return None;
            }
        };
        return Some(relay::Ending { reason, message });
    }
    match target_ended(state, tenant, grant).await {
        Ok(ended) => ended.map(|message| relay::Ending { reason: CloseReason::TargetEnded, message }),
        Err(e) => {
            tracing::warn!(node = %grant.node_id, code = %e.code(), error = %e, "a tunnel's target could not be read again; it stays open until the next recheck");
            None
        }
    }
}

/// Why the tunnel's target has ended, read as it is now; `None`: it has not.
async fn target_ended(state: &AppState, tenant: TenantId, grant: &TunnelGrant) -> Result<Option<String>> {
    async fn read<T: serde::de::DeserializeOwned>(state: &AppState, tenant: TenantId, kind: &str, id: &str) -> Result<Option<T>> {
        match state.store.row_get(&tenant.to_string(), kind, id).await? {
            Some(row) => serde_json::from_value(row.doc)
                .map(Some)
                .map_err(|e| Error::Internal(format!("projection document {kind}/{id}: {e}"))),
            None => Ok(None),
        }
    }
    let Some(instance_id) = &grant.instance_id else {
        let node: Option<NodeDoc> = read(state, tenant, KIND_NODE, &grant.node_id).await?;
        return Ok(tunnel_target_ended(&TunnelTargetNow::Node { node_id: &grant.node_id, node: node.as_ref() }));
    };
    if instance_id.starts_with(SandboxId::PREFIX) {
        let sandbox: Option<bc_projections::sandbox::SandboxDoc> =
            read(state, tenant, bc_projections::sandbox::KIND_SANDBOX, instance_id).await?;
        return Ok(bc_projections::decide::sandbox::sandbox_exec_ended(instance_id, sandbox.as_ref()));
    }
    let instance: Option<InstanceDoc> = read(state, tenant, KIND_INSTANCE, instance_id).await?;
    let reservation: Option<ReservationDoc> = match &instance {
        Some(doc) => read(state, tenant, KIND_RESERVATION, &doc.reservation_id).await?,
        None => None,
    };
    let now = TunnelTargetNow::Instance { instance_id, instance: instance.as_ref(), reservation: reservation.as_ref() };
    Ok(tunnel_target_ended(&now))
}

/// The JSON answer of `tunnels.open`, built by the API's handler.
pub fn ticket_answer(ticket: &str, expires_at_ms: u64) -> serde_json::Value {
    json!({ "ticket": ticket, "url": format!("/tunnels/{ticket}"), "expiresAtMs": expires_at_ms })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(node: &str) -> TunnelGrant {
        TunnelGrant { op: Op::Console, node_id: node.into(), instance_id: None, port: None, command: Vec::new() }
    }

    fn why(spent: std::result::Result<TunnelSlot, Refused>) -> Option<SpendRefusal> {
        spent.err().map(|refused| refused.why)
    }

    /// A refusal of a known ticket carries what `tunnel.refused` records (the ticket's tenant,
    /// key and grant), for its first `TICKET_REFUSALS_RECORDED_MAX` refusals only; an unknown
    /// ticket's carries nothing.
    #[test]
    fn a_refused_ticket_is_recorded_a_bounded_number_of_times() {
        let tunnels = Tunnels::new(TunnelLimits::default());
        let tenant = TenantId::generate();
        let (ticket, _) = tunnels.issue(tenant, "key_a", "node_1", 0, |_, _| Ok(grant("node_1"))).unwrap();
        let refused = tunnels.spend(&ticket, "key_b", 1).err().unwrap();
        let expected = RefusedTicket { tenant, key_id: "key_a".into(), grant: grant("node_1") };
        assert_eq!(refused, Refused { why: SpendRefusal::OtherKey, record: Some(Box::new(expected)) });
        drop(tunnels.spend(&ticket, "key_a", 2).unwrap());
        let recorded = (0..20).filter(|_| tunnels.spend(&ticket, "key_a", 3).err().unwrap().record.is_some()).count();
        assert_eq!(recorded, usize::from(TICKET_REFUSALS_RECORDED_MAX) - 1, "one was the other key's");
        assert_eq!(tunnels.spend("bctt_never", "key_a", 3).err().unwrap(), Refused { why: SpendRefusal::Unknown, record: None });
        let answer = SpendRefusal::Expired.answer(Duration::from_secs(30));
        assert_eq!((answer.error.code(), answer.details["reason"].as_str()), (ErrorCode::InvalidState, Some("expired")));
    }

    #[test]
    fn a_ticket_is_spent_once_by_its_own_key_before_it_expires() {
        let tunnels = Tunnels::new(TunnelLimits::default());
        let tenant = TenantId::generate();
        let (ticket, expires) = tunnels.issue(tenant, "key_a", "node_1", 1_000, |_, _| Ok(grant("node_1"))).unwrap();
        assert!(wire::is_ticket(&ticket));
        assert_eq!(expires, 1_000 + wire::TICKET_TTL_MS);
        assert_eq!(why(tunnels.spend(&ticket, "key_b", 2_000)), Some(SpendRefusal::OtherKey));
        let slot = tunnels.spend(&ticket, "key_a", 2_000).unwrap();
        assert_eq!(why(tunnels.spend(&ticket, "key_a", 2_001)), Some(SpendRefusal::Spent));
        assert_eq!(tunnels.open_in(tenant), 1);
        drop(slot);
        assert_eq!(tunnels.open_in(tenant), 0);
        assert_eq!(why(tunnels.spend("bctt_nope", "key_a", 2_000)), Some(SpendRefusal::Unknown));

        let (late, _) = tunnels.issue(tenant, "key_a", "node_1", 10_000, |_, _| Ok(grant("node_1"))).unwrap();
        assert_eq!(tunnels.open_in(tenant), 1, "an unspent ticket counts");
        assert_eq!(why(tunnels.spend(&late, "key_a", 10_000 + wire::TICKET_TTL_MS)), Some(SpendRefusal::Expired));
        assert_eq!(tunnels.open_in(tenant), 0, "an expired ticket gives its place back");
        let forgotten = 10_000 + wire::TICKET_TTL_MS + TICKET_FORGET_AFTER_MS;
        assert_eq!(why(tunnels.spend(&late, "key_a", forgotten)), Some(SpendRefusal::Unknown));
    }

    /// Spent tickets do not hold places: past `TICKETS_MAX` spent ones, a new ticket is still
    /// issued (the oldest spent one forgotten); only `TICKETS_MAX` unspent ones refuse it.
    #[test]
    fn only_unspent_tickets_bound_the_map() {
        let tunnels = Tunnels::new(TunnelLimits::default());
        let tenant = TenantId::generate();
        let issue = |now_ms| tunnels.issue(tenant, "key_a", "node_1", now_ms, |_, _| Ok(grant("node_1")));
        let spent: Vec<String> = (0..TICKETS_MAX as u64)
            .map(|i| {
                let (ticket, _) = issue(i).unwrap();
                drop(tunnels.spend(&ticket, "key_a", i).unwrap());
                ticket
            })
            .collect();
        let now = TICKETS_MAX as u64;
        let (fresh, _) = issue(now).expect("spent tickets leave room");
        assert_eq!(why(tunnels.spend(&spent[0], "key_a", now)), Some(SpendRefusal::Unknown), "the oldest spent one made room");
        assert_eq!(why(tunnels.spend(&spent[1], "key_a", now)), Some(SpendRefusal::Spent), "the others are still remembered");

        let unspent: Vec<String> = (1..TICKETS_MAX).map(|_| issue(now).unwrap().0).collect();
        let full = issue(now).unwrap_err();
        assert_eq!((full.kind, full.reason), (TunnelRefusalKind::QuotaExceeded, Some("tickets")), "{}", full.message);
        drop(tunnels.spend(&fresh, "key_a", now).unwrap());
        assert!(issue(now).is_ok(), "a spend makes room");
        assert_eq!(unspent.len() + 1, TICKETS_MAX);
    }

    #[test]
    fn the_decision_sees_the_counts_and_the_session() {
        let tunnels = Tunnels::new(TunnelLimits::default());
        let tenant = TenantId::generate();
        let seen = std::cell::RefCell::new(Vec::new());
        let decide = |counts: TunnelCounts, caps: Option<&[String]>| {
            seen.borrow_mut().push((counts, caps.map(<[String]>::to_vec)));
            Ok(grant("node_1"))
        };
        tunnels.issue(tenant, "key_a", "node_1", 0, decide).unwrap();
        let (_link, _requests) = tunnels.attach_session("node_1", ConnectionId(1), vec!["tunnel.node-console".into()]);
        tunnels.issue(tenant, "key_a", "node_1", 0, decide).unwrap();
        let seen = seen.into_inner();
        assert_eq!(seen[0], (TunnelCounts::default(), None));
        assert_eq!(seen[1], (TunnelCounts { tenant: 1, key: 1, node: 1 }, Some(vec!["tunnel.node-console".to_owned()])));
    }

    /// An agent's end that carries nothing.
    fn empty_end() -> AgentEnd {
        let (to_node, _) = mpsc::channel(1);
        AgentEnd { from_node: Box::pin(futures::stream::empty()), to_node }
    }

    #[tokio::test]
    async fn dial_asks_the_session_and_pairs_the_agents_call() {
        let tunnels = Tunnels::new(TunnelLimits::default());
        let (link, mut requests) = tunnels.attach_session("node_1", ConnectionId(1), Vec::new());
        let agent = {
            let tunnels = tunnels.clone();
            tokio::spawn(async move {
                let request = requests.recv().await.unwrap();
                assert_eq!(request.op, Op::Console);
                let (to_node, _keep) = mpsc::channel(1);
                let end = AgentEnd { from_node: Box::pin(futures::stream::empty()), to_node };
                assert!(tunnels.agent_attached(&request.tunnel_id, ConnectionId(1), end));
                assert!(!tunnels.agent_attached(&request.tunnel_id, ConnectionId(1), empty_end()), "an id pairs once");
                _keep
            })
        };
        tunnels.dial(&grant("node_1"), Duration::from_secs(5)).await.unwrap();
        agent.await.unwrap();
        assert_eq!(tunnels.lock().waiting.len(), 0);
        drop(link);
        let gone = tunnels.dial(&grant("node_1"), Duration::from_secs(5)).await.err().unwrap();
        assert_eq!(gone.code(), bc_core::ErrorCode::Unavailable);
    }

    /// A `Tunnel` call pairs only on the connection of the session that was asked: a call on
    /// another connection (another node, or anyone who learnt the id) is refused and leaves the
    /// waiting tunnel to its own agent.
    #[tokio::test]
    async fn an_agents_call_pairs_only_on_its_sessions_connection() {
        let tunnels = Tunnels::new(TunnelLimits::default());
        let (_link, mut requests) = tunnels.attach_session("node_1", ConnectionId(7), Vec::new());
        let agent = {
            let tunnels = tunnels.clone();
            tokio::spawn(async move {
                let request = requests.recv().await.unwrap();
                assert!(!tunnels.agent_attached(&request.tunnel_id, ConnectionId(8), empty_end()), "another connection");
                assert_eq!(tunnels.lock().waiting.len(), 1, "the refused call cancelled nothing");
                assert!(tunnels.agent_attached(&request.tunnel_id, ConnectionId(7), empty_end()));
            })
        };
        tunnels.dial(&grant("node_1"), Duration::from_secs(5)).await.expect("its own agent's call pairs");
        agent.await.unwrap();

        // A session that ended (replaced by a newer one) pairs nothing it was asked.
        let (_old, mut asked) = tunnels.attach_session("node_2", ConnectionId(9), Vec::new());
        let dial = tokio::spawn({
            let tunnels = tunnels.clone();
            async move { tunnels.dial(&grant("node_2"), Duration::from_millis(300)).await.err().unwrap() }
        });
        let request = asked.recv().await.unwrap();
        let (_new, _) = tunnels.attach_session("node_2", ConnectionId(10), Vec::new());
        assert!(!tunnels.agent_attached(&request.tunnel_id, ConnectionId(9), empty_end()));
        assert_eq!(dial.await.unwrap().code(), bc_core::ErrorCode::Unavailable);
    }

    /// A dial whose future is dropped (the client went away mid-upgrade) leaves no waiting entry.
    #[tokio::test]
    async fn a_dropped_dial_leaves_nothing_waiting() {
        let tunnels = Tunnels::new(TunnelLimits::default());
        let (_link, mut requests) = tunnels.attach_session("node_1", ConnectionId(1), Vec::new());
        let grant = grant("node_1");
        let dial = tunnels.dial(&grant, Duration::from_secs(60));
        tokio::select! {
            _ = dial => panic!("nobody attaches"),
            request = requests.recv() => assert!(request.is_some()),
        }
        assert_eq!(tunnels.lock().waiting.len(), 0);
    }
}
