//! The gateway's side of a node's session. [`run`] reads `AgentMessage`s from any stream and
//! writes `GatewayMessage`s to a channel, with tokio's timers; what it decides is in functions
//! of the store, the log and the message alone, with no stream, no timer and no `AppState`
//! ([`greet`], [`prove`], [`welcome`], [`handle`], [`commands_unsent`], [`LeaseRenewals`]), which
//! the simulator (`bc-simulator`) calls on its virtual clock over its in-memory transport, so
//! neither has its own copy. (A [`Refusal`] carries a `tonic::Code` as a plain value.)
//!
//! A session: `Hello` names the node; the gateway answers a random challenge, which the node
//! signs with its key (bound to the node's public key from `node.joined`); then `Welcome` says
//! the newest journal entry the log holds, and the node sends what follows. Each entry is
//! checked (the node's signature, the chain link, the sequence, what it may say) and appended
//! to the tenant's log exactly once: keyed by node and sequence, and an entry at or below the
//! head already in the log is acknowledged without an append. Heartbeats renew the node's lease
//! (never an append). The node's unfinished commands are sent in issue order, and again after
//! every reconnect; a new command wakes the session through [`Sessions`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bc_core::agent::{JOURNAL_PAYLOAD_KEY, JournalOrigin, SignedEntry, session_proof_message, unb64};
use bc_core::event::sha256;
use bc_core::id::{CommandId, NodeId, TenantId};
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_core::{Error, canonical};
use bc_projections::events::{self as ev, CommandProgress, NODE_ORIGINATED_TYPES};
use bc_projections::{
    CommandDoc, KIND_AGENT, KIND_COMMAND, KIND_NODE, KIND_NODE_COMMANDS, NodeCommandsDoc, NodeDoc, placement, stream_of,
};
use bc_proto::{agent_message, gateway_message};
use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;

use crate::AppState;

/// How long a node's lease lasts past its last heartbeat, and how often it is asked to beat.
pub const LEASE_MS_DEFAULT: u64 = 15_000;
pub const HEARTBEAT_MS_DEFAULT: u64 = 5_000;
const _: () = assert!(HEARTBEAT_MS_DEFAULT * 2 < LEASE_MS_DEFAULT);
/// The first two messages (`Hello`, `Proof`) must come within this.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Messages queued for one node's stream; a node that reads nothing for a lease while it is full
/// is dropped (`send_within`), not buffered.
pub const SESSION_OUTBOUND_MESSAGES: usize = 64;
/// A session asks for a new node certificate at most this often; one asked sooner is ignored.
pub const RENEWALS_MIN_INTERVAL_MS: u64 = 10_000;

/// The connection a session came on: its id (its tunnels' calls must come on it) and what its
/// TLS layer says of the peer.
#[derive(Clone, Debug)]
pub struct Link {
    pub connection: super::ConnectionId,
    pub peer: super::TlsPeer,
}

#[derive(Clone, Copy, Debug)]
pub struct SessionConfig {
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self { lease_ms: LEASE_MS_DEFAULT, heartbeat_ms: HEARTBEAT_MS_DEFAULT }
    }
}

/// What wakes a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nudge {
    /// Its node's commands changed: read them again.
    Commands,
    /// A newer session of the same node took over in this process.
    Replaced,
    /// A newer session of the same node claimed its lease through another gateway process
    /// ([`check_claims`]).
    ReplacedElsewhere,
}

/// The sessions of this process, by node: so a new command wakes the one that serves its node,
/// and a node that reconnects replaces its stale session, here or (through the lease's claim,
/// [`check_claims`]) on another gateway process.
pub struct Sessions {
    nodes: Mutex<HashMap<String, (u64, mpsc::Sender<Nudge>)>>,
    next: std::sync::atomic::AtomicU64,
    /// This process's part of its sessions' holder ids (random, so two gateways on one database
    /// never name a session alike).
    process: String,
    /// The sessions' lease renewals, written in batches by [`write_leases`].
    pub leases: LeaseRenewals,
}

impl Default for Sessions {
    fn default() -> Self {
        Self {
            nodes: Mutex::default(),
            next: std::sync::atomic::AtomicU64::default(),
            process: format!("{:016x}", rand::random::<u64>()),
            leases: LeaseRenewals::default(),
        }
    }
}

impl Sessions {
    /// A new session's id, and the holder id it claims its node's lease with.
    fn next_session(&self) -> (u64, String) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (id, self.holder(id))
    }

    fn holder(&self, id: u64) -> String {
        format!("{}/{id}", self.process)
    }

    fn register(&self, node: &str, id: u64, nudges: mpsc::Sender<Nudge>) {
        let old = self.nodes.lock().expect("sessions lock").insert(node.to_owned(), (id, nudges));
        if let Some((_, old)) = old {
            let _ = old.try_send(Nudge::Replaced);
        }
    }

    /// Closes this process's session of each node whose lease a session of another gateway
    /// process claimed: the node bound again elsewhere, so this stream is stale even if still
    /// open. (A newer session in this process replaces the older itself, in [`Self::register`].)
    /// Returns how many it closed.
    fn replaced_elsewhere(&self, claims: &[bc_core::store::lease::LeaseClaim]) -> usize {
        let mine = format!("{}/", self.process);
        let nodes = self.nodes.lock().expect("sessions lock");
        let mut closed = 0;
        for claim in claims {
            if let Some((_, sender)) = nodes.get(&claim.node)
                && !claim.holder.is_empty()
                && !claim.holder.starts_with(&mine)
                && sender.try_send(Nudge::ReplacedElsewhere).is_ok()
            {
                closed += 1;
            }
        }
        closed
    }

    fn unregister(&self, node: &str, id: u64) {
        let mut nodes = self.nodes.lock().expect("sessions lock");
        if nodes.get(node).is_some_and(|(current, _)| *current == id) {
            nodes.remove(node);
        }
    }

    /// Wakes `node`'s session, if this process has one.
    pub fn nudge(&self, node: &str) {
        if let Some((_, sender)) = self.nodes.lock().expect("sessions lock").get(node) {
            let _ = sender.try_send(Nudge::Commands);
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.lock().expect("sessions lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A refusal's status: gRPC's code, as a plain value (the simulator reads it without tonic's
/// transport).
pub use tonic::Code as RefusalCode;

/// A refusal sent to the node before the session ends: a stable code and a message.
#[derive(Debug)]
pub struct Refusal {
    pub status: tonic::Code,
    pub message: String,
}

fn refuse(status: tonic::Code, message: impl Into<String>) -> Refusal {
    Refusal { status, message: message.into() }
}

/// What ends a session whose node sent nothing by its deadline: `HANDSHAKE_TIMEOUT_MS` for the
/// hello and the proof, then a lease (`SessionConfig::lease_ms`) from its last message.
pub fn idle_refusal() -> Refusal {
    refuse(tonic::Code::DeadlineExceeded, "the node sent nothing in time")
}

impl From<Error> for Refusal {
    fn from(e: Error) -> Self {
        refuse(crate::agents::code_of(&e), e.public_message())
    }
}

type Outbound = mpsc::Sender<std::result::Result<bc_proto::GatewayMessage, tonic::Status>>;

fn message(msg: gateway_message::Msg) -> std::result::Result<bc_proto::GatewayMessage, tonic::Status> {
    Ok(bc_proto::GatewayMessage { msg: Some(msg) })
}

/// The node a session serves, once its proof checked.
pub struct Bound {
    pub tenant: TenantId,
    pub node: NodeId,
    key: VerifyingKey,
    /// The newest entry of this node's journal in the log.
    head_seq: u64,
    head_hash: [u8; 32],
    /// Commands sent in this session.
    sent: BTreeSet<String>,
}

impl Bound {
    /// The newest entry of the node's journal the log holds, as this session knows it.
    pub fn head_seq(&self) -> u64 {
        self.head_seq
    }

    /// Whether this session sent `command_id` already.
    pub fn was_sent(&self, command_id: &str) -> bool {
        self.sent.contains(command_id)
    }
}

/// A node that said hello: who it claims to be and what the log holds of it, until its proof.
pub struct Greeted {
    tenant: TenantId,
    node: NodeId,
    key: VerifyingKey,
    journal_seq: u64,
    head_hash: [u8; 32],
    /// The journal head the node said it has.
    hello_seq: u64,
    /// Whether the node was issued a node certificate (`node.certificate_issued`): over TLS it
    /// must then present it.
    certified: bool,
}

/// Runs one session until the node goes, the stream breaks, a refusal or the server stops.
/// `link.connection` carries the session (its tunnels' calls must come on it).
pub async fn run<S>(
    state: Arc<AppState>,
    sessions: Arc<Sessions>,
    config: SessionConfig,
    link: Link,
    mut inbound: S,
    outbound: Outbound,
) where
    S: Stream<Item = std::result::Result<bc_proto::AgentMessage, tonic::Status>> + Unpin,
{
    // Subscribed before the welcome reads them, so no change of the trusted CAs falls between.
    let ssh_user_ca_keys = state.ssh_user_ca.as_ref().map(|ring| ring.subscribe(state.shutdown.subscribe()));
    // Subscribed before the node's document is read, so no revocation falls between.
    let revocations = state.node_ca.as_ref().map(|ca| ca.revocations());
    let connection = link.connection;
    let (bound, capabilities) = match handshake(&state, &sessions.leases, &mut inbound, &outbound, config, &link.peer).await {
        Ok(bound) => bound,
        Err(refusal) => {
            let _ = send_within(&outbound, Err(tonic::Status::new(refusal.status, refusal.message)), config.lease_ms).await;
            return;
        }
    };
    let (nudge_tx, mut nudges) = mpsc::channel(4);
    let node = bound.node.to_string();
    let (id, holder) = sessions.next_session();
    claim(&state, &bound, holder, config).await;
    sessions.register(&node, id, nudge_tx);
    // Tunnels to the node are asked for on this session while it lasts (dropping the link ends that).
    let (tunnel_link, mut tunnel_requests) = state.tunnels.attach_session(&node, connection, capabilities);
    tracing::info!(tenant = %bound.tenant, node = %node, "node session started");
    let channels = Channels { nudges: &mut nudges, tunnels: &mut tunnel_requests, ssh_user_ca_keys, revocations };
    let outcome = serve(&state, &sessions.leases, config, bound, &mut inbound, &outbound, channels).await;
    drop(tunnel_link);
    sessions.unregister(&node, id);
    match outcome {
        Ok(why) => tracing::info!(node = %node, why, "node session ended"),
        Err(refusal) => {
            tracing::info!(node = %node, code = ?refusal.status, error = %refusal.message, "node session refused");
            let _ = send_within(&outbound, Err(tonic::Status::new(refusal.status, refusal.message)), config.lease_ms).await;
        }
    }
}

async fn next_message<S>(inbound: &mut S, within_ms: u64) -> std::result::Result<agent_message::Msg, Refusal>
where
    S: Stream<Item = std::result::Result<bc_proto::AgentMessage, tonic::Status>> + Unpin,
{
    next_message_by(inbound, tokio::time::Instant::now() + Duration::from_millis(within_ms)).await
}

/// The node's next message, if it comes by `deadline` (else `DEADLINE_EXCEEDED`).
async fn next_message_by<S>(inbound: &mut S, deadline: tokio::time::Instant) -> std::result::Result<agent_message::Msg, Refusal>
where
    S: Stream<Item = std::result::Result<bc_proto::AgentMessage, tonic::Status>> + Unpin,
{
    match tokio::time::timeout_at(deadline, inbound.next()).await {
        Err(_) => Err(idle_refusal()),
        Ok(None) => Err(refuse(tonic::Code::Cancelled, "the node closed the stream")),
        Ok(Some(Err(status))) => Err(refuse(status.code(), status.message().to_owned())),
        Ok(Some(Ok(bc_proto::AgentMessage { msg: None }))) => Err(refuse(tonic::Code::InvalidArgument, "an empty message")),
        Ok(Some(Ok(bc_proto::AgentMessage { msg: Some(msg) }))) => Ok(msg),
    }
}

async fn handshake<S>(
    state: &AppState,
    leases: &LeaseRenewals,
    inbound: &mut S,
    outbound: &Outbound,
    config: SessionConfig,
    peer: &super::TlsPeer,
) -> std::result::Result<(Bound, Vec<String>), Refusal>
where
    S: Stream<Item = std::result::Result<bc_proto::AgentMessage, tonic::Status>> + Unpin,
{
    let agent_message::Msg::Hello(hello) = next_message(inbound, HANDSHAKE_TIMEOUT_MS).await? else {
        return Err(refuse(tonic::Code::InvalidArgument, "a session starts with hello"));
    };
    let greeted = greet(&*state.store, &hello).await?;
    let nonce: [u8; 32] = rand::random();
    outbound
        .send(message(gateway_message::Msg::Challenge(bc_proto::Challenge { nonce: nonce.to_vec() })))
        .await
        .map_err(|_| refuse(tonic::Code::Cancelled, "the node went away"))?;
    let agent_message::Msg::Proof(proof) = next_message(inbound, HANDSHAKE_TIMEOUT_MS).await? else {
        return Err(refuse(tonic::Code::InvalidArgument, "a challenge is answered with proof"));
    };
    let certified = greeted.certified;
    let bound = prove(greeted, &nonce, &proof)?;
    check_certificate(state, &bound, certified, peer)?;
    renew(&state.log, leases, bound.tenant, &bound.node, config);
    let mut welcomed = welcome(&bound, config);
    // The CA keys ride on the welcome, so a node trusts the current ones after every reconnect
    // (and each change after it comes as `SshUserCaKeys`).
    if let (gateway_message::Msg::Welcome(w), Some(ring)) = (&mut welcomed, &state.ssh_user_ca) {
        let keys = crate::ssh_ca::ssh_user_ca_keys(&ring.trusted());
        (w.ssh_user_ca_keys, w.ssh_user_ca_keys_until_ms) = (keys.keys, keys.until_ms);
    }
    outbound.send(message(welcomed)).await.map_err(|_| refuse(tonic::Code::Cancelled, "the node went away"))?;
    Ok((bound, hello.capabilities))
}

/// Whether the session's TLS peer presented what the node must: over TLS, a node issued a node
/// certificate presents one for its own key (the TLS layer checked it chains to the node CA,
/// is valid now and is not revoked); a plaintext `dev` endpoint has no TLS layer to ask.
fn check_certificate(
    state: &AppState,
    bound: &Bound,
    certified: bool,
    peer: &super::TlsPeer,
) -> std::result::Result<(), Refusal> {
    let key_pin = crate::node_ca::node_key_pin(bound.key.as_bytes());
    if state.node_ca.as_ref().is_some_and(|ca| ca.is_revoked(&key_pin)) {
        return Err(revoked_refusal(&bound.node));
    }
    match &peer.certificate_key_pin {
        Some(presented) if *presented != key_pin => {
            Err(refuse(tonic::Code::Unauthenticated, format!("the client certificate is not for node {}'s key", bound.node)))
        }
        None if peer.tls && certified => Err(refuse(
            tonic::Code::Unauthenticated,
            format!(
                "node {} must present its node certificate (hint: bcd node reads node-certificate.json in its data directory)",
                bound.node
            ),
        )),
        _ => Ok(()),
    }
}

/// What ends a revoked node's session: `bcd node` exits 1 on it.
pub fn revoked_refusal(node: &NodeId) -> Refusal {
    refuse(
        tonic::Code::PermissionDenied,
        format!("{}: node {node} was revoked; its certificate is refused", crate::node_ca::NODE_REVOKED_CODE),
    )
}

/// A session's first message: checks what `hello` claims (its capabilities' bounds, a node
/// that joined with `bcd`) and reads the node's key and its journal head in the log. The caller
/// then sends a challenge of 32 random bytes.
pub async fn greet(store: &dyn EventStore, hello: &bc_proto::Hello) -> std::result::Result<Greeted, Refusal> {
    if hello.capabilities.len() > bc_proto::CAPABILITIES_MAX
        || hello.capabilities.iter().any(|c| c.is_empty() || c.len() > bc_proto::CAPABILITY_BYTES_MAX)
    {
        return Err(refuse(
            tonic::Code::InvalidArgument,
            format!("at most {} capabilities of 1 to {} bytes", bc_proto::CAPABILITIES_MAX, bc_proto::CAPABILITY_BYTES_MAX),
        ));
    }
    let node: NodeId = hello.node_id.parse().map_err(|_| refuse(tonic::Code::InvalidArgument, "hello names no node_… id"))?;
    let row = store
        .row_find(KIND_NODE, &node.to_string())
        .await?
        .ok_or_else(|| refuse(tonic::Code::PermissionDenied, format!("node {node} has not joined, or was deleted")))?;
    let tenant: TenantId = row.key.tenant.parse()?;
    let doc: NodeDoc = crate::api::call::doc(row)?;
    let agent = doc.agent.ok_or_else(|| refuse(tonic::Code::PermissionDenied, format!("node {node} did not join with bcd")))?;
    if agent.revoked_at_ms > 0 {
        return Err(revoked_refusal(&node));
    }
    let certified = agent.certificate_not_after_ms > 0;
    let key = unb64(&agent.public_key)
        .and_then(|bytes| bc_core::agent::node_public_key(&bytes))
        .map_err(|e| refuse(tonic::Code::Internal, format!("node {node}'s stored key: {e}")))?;
    let head_hash = if agent.journal_hash.is_empty() {
        bc_core::agent::GENESIS_HASH
    } else {
        hex::decode(&agent.journal_hash)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| refuse(tonic::Code::Internal, "the stored journal head does not parse"))?
    };
    Ok(Greeted { tenant, node, key, journal_seq: agent.journal_seq, head_hash, hello_seq: hello.journal_seq, certified })
}

/// Checks the node's proof: its signature of the challenge's `nonce` under the node's key.
/// Then the session is bound to the node: the caller renews its lease and sends [`welcome`].
pub fn prove(greeted: Greeted, nonce: &[u8], proof: &bc_proto::Proof) -> std::result::Result<Bound, Refusal> {
    let Greeted { tenant, node, key, journal_seq, head_hash, hello_seq, certified: _ } = greeted;
    let signature = Signature::from_slice(&proof.signature)
        .map_err(|_| refuse(tonic::Code::Unauthenticated, "the proof is not an Ed25519 signature"))?;
    key.verify(&session_proof_message(&node.to_string(), nonce), &signature)
        .map_err(|_| refuse(tonic::Code::Unauthenticated, format!("the proof is not signed by node {node}'s key")))?;
    if hello_seq < journal_seq {
        // The log holds entries the node no longer has: its journal was lost or replaced.
        tracing::warn!(%tenant, node = %node, log = journal_seq, node_says = hello_seq, "a node's journal is behind the log");
    }
    Ok(Bound { tenant, node, key, head_seq: journal_seq, head_hash, sent: BTreeSet::new() })
}

/// The `Welcome` a bound session sends: the newest journal entry the log holds, and the lease.
pub fn welcome(bound: &Bound, config: SessionConfig) -> gateway_message::Msg {
    gateway_message::Msg::Welcome(bc_proto::Welcome {
        acked_seq: bound.head_seq,
        acked_hash: if bound.head_seq == 0 { Vec::new() } else { bound.head_hash.to_vec() },
        lease_ms: config.lease_ms,
        heartbeat_ms: config.heartbeat_ms,
        // Set by the caller that holds the CA (`handshake`); the simulator's agents get none.
        ssh_user_ca_keys: Vec::new(),
        ssh_user_ca_keys_until_ms: Vec::new(),
    })
}

/// Renews a lease in this process's next batch (written within `LEASE_FLUSH_MS`).
pub fn renew(log: &Log, leases: &LeaseRenewals, tenant: TenantId, node: &NodeId, config: SessionConfig) {
    let until = log.clock.now_ms().saturating_add(config.lease_ms);
    leases.renew(tenant.to_string(), node.to_string(), until);
}

/// How often this process writes its sessions' lease renewals, in one transaction. Far below
/// any lease (`SessionConfig::lease_ms` is seconds), so the delay never lapses one.
pub const LEASE_FLUSH_MS: u64 = 250;
const _: () = assert!(LEASE_FLUSH_MS * 8 < HEARTBEAT_MS_DEFAULT * 2);

/// The lease renewals of this process's sessions since the last write: one per node, the
/// latest.
#[derive(Default)]
pub struct LeaseRenewals {
    /// Ordered, so a batch is written in the same order each time (the simulator's runs repeat).
    pending: Mutex<BTreeMap<(String, String), u64>>,
}

impl LeaseRenewals {
    pub fn renew(&self, tenant: String, node: String, until_ms: u64) {
        let mut pending = self.pending.lock().expect("leases lock");
        let at = pending.entry((tenant, node)).or_insert(until_ms);
        *at = (*at).max(until_ms);
    }

    fn take(&self) -> Vec<(String, String, u64)> {
        std::mem::take(&mut *self.pending.lock().expect("leases lock")).into_iter().map(|((t, n), u)| (t, n, u)).collect()
    }

    /// Writes the pending renewals; on failure they wait for the next write.
    pub async fn flush(&self, store: &dyn EventStore) {
        let batch = self.take();
        if batch.is_empty() {
            return;
        }
        if let Err(e) = store.lease_renew(&batch).await {
            tracing::warn!(code = %e.code(), error = %e, leases = batch.len(), "writing lease renewals failed; retrying");
            for (tenant, node, until) in batch {
                self.renew(tenant, node, until);
            }
        }
    }
}

/// How often a gateway reads the lease claims other sessions wrote, to close its own sessions
/// of nodes that bound again elsewhere; far below a lease, so a stale session is closed long
/// before it would time out.
pub const CLAIMS_CHECK_MS: u64 = 500;
const _: () = assert!(CLAIMS_CHECK_MS * 4 < LEASE_MS_DEFAULT);
/// How far back each read of the claims goes: past a check's interval, by what the clocks of two
/// gateway processes may differ (a claim's time is its writer's clock). Claims read twice are
/// harmless: a session is closed only when another holder claimed its node.
pub const CLAIMS_CLOCK_SKEW_MS: u64 = 10_000;
/// Claims read in one check; a check that reads this many reads again from the last one's time.
pub const CLAIMS_PER_CHECK_MAX: u32 = 1_000;

/// Claims the bound node's lease for this session (`holder`), so a session of the node on
/// another gateway process closes ([`check_claims`] there). A claim that cannot be written only
/// leaves that session to end at its lease.
async fn claim(state: &AppState, bound: &Bound, holder: String, config: SessionConfig) {
    let now = state.log.clock.now_ms();
    let claim = bc_core::store::lease::LeaseClaim {
        tenant: bound.tenant.to_string(),
        node: bound.node.to_string(),
        holder,
        claimed_at_ms: now,
    };
    if let Err(e) = state.store.lease_claim(&claim, now.saturating_add(config.lease_ms)).await {
        tracing::warn!(node = %bound.node, code = %e.code(), error = %e, "claiming the node's lease failed");
    }
}

/// Closes this process's sessions whose node another session claimed since `since_ms`; returns
/// the time to read from next.
async fn check_claims(store: &dyn EventStore, sessions: &Sessions, since_ms: u64, now_ms: u64) -> u64 {
    let mut from = since_ms;
    loop {
        match store.lease_claims_since(from, CLAIMS_PER_CHECK_MAX).await {
            Ok(claims) => {
                let closed = sessions.replaced_elsewhere(&claims);
                if closed > 0 {
                    tracing::info!(sessions = closed, "closing sessions whose node bound again through another gateway");
                }
                match claims.last() {
                    Some(last) if claims.len() == CLAIMS_PER_CHECK_MAX as usize && last.claimed_at_ms > from => {
                        from = last.claimed_at_ms;
                    }
                    _ => return now_ms.saturating_sub(CLAIMS_CLOCK_SKEW_MS),
                }
            }
            Err(e) => {
                tracing::warn!(code = %e.code(), error = %e, "reading the lease claims failed; retrying");
                return since_ms;
            }
        }
    }
}

/// Writes this process's lease renewals every `LEASE_FLUSH_MS`, and reads other sessions'
/// claims every `CLAIMS_CHECK_MS` (while it has sessions), until the server stops.
pub async fn write_leases(state: Arc<AppState>, sessions: Arc<Sessions>) {
    let mut shutdown = state.shutdown.subscribe();
    let mut ticker = tokio::time::interval(Duration::from_millis(LEASE_FLUSH_MS));
    let mut claims = tokio::time::interval(Duration::from_millis(CLAIMS_CHECK_MS));
    let mut claims_since = state.log.clock.now_ms().saturating_sub(CLAIMS_CLOCK_SKEW_MS);
    loop {
        tokio::select! {
            _ = ticker.tick() => sessions.leases.flush(&*state.store).await,
            _ = claims.tick() => {
                let now = state.log.clock.now_ms();
                claims_since = if sessions.is_empty() {
                    now.saturating_sub(CLAIMS_CLOCK_SKEW_MS)
                } else {
                    check_claims(&*state.store, &sessions, claims_since, now).await
                };
            }
            _ = shutdown.changed() => {
                sessions.leases.flush(&*state.store).await;
                return;
            }
        }
    }
}

/// What wakes a bound session besides the node's messages: this process's nudges, the
/// tunnels asked of the node, and a change of the SSH CA keys it trusts.
struct Channels<'a> {
    nudges: &'a mut mpsc::Receiver<Nudge>,
    tunnels: &'a mut mpsc::Receiver<crate::tunnels::OpenRequest>,
    ssh_user_ca_keys: Option<tokio::sync::watch::Receiver<Vec<bc_projections::decide::ssh_cert::TrustedCaKey>>>,
    /// Wakes at every revocation in this process (`node_ca::NodeCa::revocations`).
    revocations: Option<tokio::sync::watch::Receiver<u64>>,
}

/// The next revocation in this process; never, without a node CA.
async fn next_revocation(revocations: &mut Option<tokio::sync::watch::Receiver<u64>>) {
    let Some(receiver) = revocations else { return std::future::pending().await };
    if receiver.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn serve<S>(
    state: &AppState,
    leases: &LeaseRenewals,
    config: SessionConfig,
    mut bound: Bound,
    inbound: &mut S,
    outbound: &Outbound,
    mut channels: Channels<'_>,
) -> std::result::Result<&'static str, Refusal>
where
    S: Stream<Item = std::result::Result<bc_proto::AgentMessage, tonic::Status>> + Unpin,
{
    let mut shutdown = state.shutdown.subscribe();
    send_commands(state, &mut bound, outbound, config).await?;
    // The node must be heard from within a lease of the last message (a nudge that wakes the
    // loop does not move it).
    let mut deadline = tokio::time::Instant::now() + Duration::from_millis(config.lease_ms);
    // The last heartbeat's arrival, for the gap to the next (`/metrics`).
    let mut last_heartbeat: Option<tokio::time::Instant> = None;
    // The last node certificate issued on this session ([`RENEWALS_MIN_INTERVAL_MS`]).
    let mut last_renewal: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            received = next_message_by(inbound, deadline) => {
                deadline = tokio::time::Instant::now() + Duration::from_millis(config.lease_ms);
                let reply = match received {
                    Ok(agent_message::Msg::RenewCertificate(_)) => renew_certificate(state, &bound, &mut last_renewal).await?,
                    Ok(msg) => {
                        let arrived = tokio::time::Instant::now();
                        let kind = match &msg {
                            agent_message::Msg::Heartbeat(_) => Some(true),
                            agent_message::Msg::Entry(_) => Some(false),
                            _ => None,
                        };
                        let handled = handle(&state.log, leases, config, &mut bound, msg).await;
                        match kind {
                            Some(true) => {
                                state.metrics.agent_heartbeat(last_heartbeat.map(|last| arrived - last));
                                last_heartbeat = Some(arrived);
                            }
                            Some(false) => state.metrics.agent_journal_entry(handled.is_ok(), arrived.elapsed()),
                            None => {}
                        }
                        handled?
                    }
                    Err(refusal) if refusal.status == tonic::Code::Cancelled => return Ok("the node closed the stream"),
                    Err(refusal) => return Err(refusal),
                };
                if let Some(reply) = reply && !send_within(outbound, message(reply), config.lease_ms).await? {
                    return Ok("the stream broke");
                }
            }
            Some(open) = channels.tunnels.recv() => {
                let open = gateway_message::Msg::OpenTunnel(bc_proto::OpenTunnel {
                    tunnel_id: open.tunnel_id,
                    op: open.op.as_str().to_owned(),
                    instance_id: open.instance_id.unwrap_or_default(),
                    port: open.port.map(u32::from).unwrap_or(0),
                    command: open.command,
                });
                if !send_within(outbound, message(open), config.lease_ms).await? {
                    return Ok("the stream broke");
                }
            }
            keys = crate::ssh_ca::next_trusted(&mut channels.ssh_user_ca_keys) => {
                let keys = gateway_message::Msg::SshUserCaKeys(crate::ssh_ca::ssh_user_ca_keys(&keys));
                if !send_within(outbound, message(keys), config.lease_ms).await? {
                    return Ok("the stream broke");
                }
            }
            () = next_revocation(&mut channels.revocations) => {
                let key_pin = crate::node_ca::node_key_pin(bound.key.as_bytes());
                if state.node_ca.as_ref().is_some_and(|ca| ca.is_revoked(&key_pin)) {
                    return Err(revoked_refusal(&bound.node));
                }
            }
            nudge = channels.nudges.recv() => match nudge {
                Some(Nudge::Commands) => send_commands(state, &mut bound, outbound, config).await?,
                Some(Nudge::Replaced) | None => return Ok("a newer session of the node replaced it"),
                Some(Nudge::ReplacedElsewhere) => return Ok("a newer session of the node on another gateway replaced it"),
            },
            _ = shutdown.changed() => return Err(refuse(tonic::Code::Unavailable, "the gateway is stopping; reconnect")),
        }
    }
}

/// One message of a bound session: a heartbeat renews the lease, an entry is checked and
/// appended once ([`append_entry`]), a command's receipt is noted. `Ok(Some(reply))`: send it;
/// `Err`: the session ends with the refusal.
pub async fn handle(
    log: &Log,
    leases: &LeaseRenewals,
    config: SessionConfig,
    bound: &mut Bound,
    msg: agent_message::Msg,
) -> std::result::Result<Option<gateway_message::Msg>, Refusal> {
    Ok(match msg {
        agent_message::Msg::Heartbeat(_) => {
            renew(log, leases, bound.tenant, &bound.node, config);
            Some(gateway_message::Msg::HeartbeatAck(bc_proto::HeartbeatAck {}))
        }
        agent_message::Msg::Entry(entry) => match append_entry(log, bound, entry).await? {
            Ok(seq) => Some(gateway_message::Msg::EntryAck(bc_proto::EntryAck { seq })),
            Err((seq, code, message)) => {
                tracing::warn!(tenant = %bound.tenant, node = %bound.node, seq, code, error = %message, "a journal entry was refused");
                return Err(refuse(tonic::Code::FailedPrecondition, format!("{code}: entry {seq}: {message}")));
            }
        },
        agent_message::Msg::CommandReceived(received) => {
            tracing::debug!(node = %bound.node, command = %bc_core::id::truncate(&received.command_id, 40), "command received");
            None
        }
        // Answered by the session's loop, which holds the node CA; the simulator has none.
        agent_message::Msg::RenewCertificate(_) => {
            return Err(refuse(tonic::Code::Unimplemented, "this gateway issues no node certificates"));
        }
        agent_message::Msg::Hello(_) | agent_message::Msg::Proof(_) => {
            return Err(refuse(tonic::Code::InvalidArgument, "hello and proof come once, first"));
        }
    })
}

/// A new node certificate for the session's node key, recorded as `node.certificate_issued`
/// (`renewal`), unless the session had one issued within [`RENEWALS_MIN_INTERVAL_MS`] (then
/// nothing is sent and the node asks again later).
async fn renew_certificate(
    state: &AppState,
    bound: &Bound,
    last_renewal: &mut Option<tokio::time::Instant>,
) -> std::result::Result<Option<gateway_message::Msg>, Refusal> {
    let Some(ca) = &state.node_ca else {
        return Err(refuse(tonic::Code::Unimplemented, "this gateway issues no node certificates"));
    };
    if ca.is_revoked(&crate::node_ca::node_key_pin(bound.key.as_bytes())) {
        return Err(revoked_refusal(&bound.node));
    }
    if last_renewal.is_some_and(|at| at.elapsed() < Duration::from_millis(RENEWALS_MIN_INTERVAL_MS)) {
        tracing::debug!(node = %bound.node, "a certificate renewal asked for too soon was ignored");
        return Ok(None);
    }
    let node = bound.node.to_string();
    let issued = ca.issue(&node, bound.key.as_bytes(), state.log.ids.ulid().to_bytes(), state.log.clock.now_ms())?;
    let request = AppendRequest::new(
        bound.tenant,
        stream_of(KIND_NODE, &bound.node),
        ExpectedVersion::Any,
        format!("node:{node}"),
        vec![issued.event(true)?],
    );
    state.log.append(request).await?;
    *last_renewal = Some(tokio::time::Instant::now());
    tracing::info!(tenant = %bound.tenant, node = %node, serial = %issued.serial, not_after_ms = issued.not_after_ms, "renewed a node certificate");
    Ok(Some(gateway_message::Msg::NodeCertificate(bc_proto::NodeCertificate {
        certificate: issued.der,
        not_after_ms: issued.not_after_ms,
    })))
}

type EntryOutcome = std::result::Result<u64, (u64, &'static str, String)>;

/// Checks one entry and appends it once. `Ok(Err(..))` is the node's fault (refused, with a
/// stable code); `Err` is the gateway's (the session ends, the node retries later).
async fn append_entry(log: &Log, bound: &mut Bound, entry: bc_proto::JournalEntry) -> std::result::Result<EntryOutcome, Refusal> {
    let seq = entry.seq;
    let refuse_entry = |code: &'static str, message: String| Ok(Err((seq, code, message)));
    if entry.body.len() > bc_proto::ENTRY_BODY_BYTES_MAX {
        return refuse_entry("INVALID_ARGUMENT", format!("the body is over {} bytes", bc_proto::ENTRY_BODY_BYTES_MAX));
    }
    let (body, hash) = match SignedEntry::verify(seq, &entry.body, &entry.signature, &bound.key) {
        Ok(checked) => checked,
        Err(why) => return refuse_entry("JOURNAL_SIGNATURE", why),
    };
    if body.node != bound.node {
        return refuse_entry("JOURNAL_SIGNATURE", format!("the entry is node {}'s", body.node));
    }
    if seq <= bound.head_seq {
        // Already in the log (a replay after a lost acknowledgement). The newest one must be
        // the very entry the log holds: another would be a fork of the journal.
        if seq == bound.head_seq && hash != bound.head_hash {
            return refuse_entry("JOURNAL_LINK", "the log holds another entry with this number".into());
        }
        return Ok(Ok(seq));
    }
    if seq != bound.head_seq + 1 {
        return refuse_entry(
            "JOURNAL_GAP",
            format!("the log holds entries up to {}; send {} next", bound.head_seq, bound.head_seq + 1),
        );
    }
    if body.prev != bound.head_hash {
        return refuse_entry("JOURNAL_LINK", format!("prev is not the hash of entry {}", bound.head_seq));
    }
    if !NODE_ORIGINATED_TYPES.contains(&body.entry_type.as_str()) {
        return refuse_entry(
            "INVALID_ARGUMENT",
            format!("a node does not report {}", bc_core::id::truncate(&body.entry_type, 64)),
        );
    }
    if let Err(why) = check_entry_subject(&*log.store, bound, &body).await? {
        return refuse_entry("INVALID_ARGUMENT", why);
    }
    let origin = JournalOrigin {
        node_id: bound.node.to_string(),
        seq,
        body: bc_core::agent::b64(&entry.body),
        signature: bc_core::agent::b64(&entry.signature),
    };
    let mut payload = body.payload.clone();
    payload[JOURNAL_PAYLOAD_KEY] = serde_json::to_value(&origin).map_err(|e| Error::Internal(e.to_string()))?;
    let mut request = AppendRequest::new(
        bound.tenant,
        body.subject.clone(),
        ExpectedVersion::Any,
        format!("node:{}", bound.node),
        vec![NewEvent::new(body.entry_type.clone(), canonical::from_json(&payload)?)],
    );
    // Exactly once: a second append of this entry, by this session or a racing one, replays.
    request.idempotency_key = Some(format!("journal:{}:{seq}", bound.node));
    request.fingerprint = Some(sha256(&entry.body));
    match log.append(request).await {
        Ok(_) => {}
        Err(Error::IdempotencyConflict { .. }) => {
            return refuse_entry("JOURNAL_LINK", "the log holds another entry with this number".into());
        }
        Err(e) => return Err(e.into()),
    }
    bound.head_seq = seq;
    bound.head_hash = hash;
    Ok(Ok(seq))
}

/// Whether an entry says only what a node may say: its own observations on `agent/NODE`, or
/// progress of one of its own commands on `command/CMD`. `Ok(Err(why))` refuses the entry.
async fn check_entry_subject(
    store: &dyn EventStore,
    bound: &Bound,
    body: &bc_core::agent::EntryBody,
) -> std::result::Result<std::result::Result<(), String>, Refusal> {
    let node = bound.node.to_string();
    if body.entry_type == ev::NODE_INVENTORY_REPORTED {
        let inventory: ev::NodeInventoryReported = match serde_json::from_value(body.payload.clone()) {
            Ok(p) => p,
            Err(e) => return Ok(Err(format!("the payload of node.inventory_reported: {e}"))),
        };
        if inventory.journal.is_some() || inventory.node_id != node || body.subject != format!("{KIND_AGENT}/{node}") {
            return Ok(Err(format!("node.inventory_reported is about this node, on {KIND_AGENT}/{node}")));
        }
        if let Err(why) = crate::agents::join::check_inventory(&inventory) {
            return Ok(Err(why));
        }
        return Ok(Ok(()));
    }
    if body.entry_type == ev::NODE_AGENT_STARTED {
        let started: ev::NodeAgentStarted = match serde_json::from_value(body.payload.clone()) {
            Ok(p) => p,
            Err(e) => return Ok(Err(format!("the payload of node.agent_started: {e}"))),
        };
        let bounded = started.version.len() <= bc_core::release::VERSION_BYTES_MAX
            && started.previous_version.as_ref().is_none_or(|v| v.len() <= bc_core::release::VERSION_BYTES_MAX)
            && matches!(started.slot.as_str(), "" | "a" | "b");
        if started.journal.is_some() || started.node_id != node || body.subject != format!("{KIND_AGENT}/{node}") || !bounded {
            return Ok(Err(format!(
                "node.agent_started is about this node, on {KIND_AGENT}/{node}, with a version of at most {} bytes and slot a, b or none",
                bc_core::release::VERSION_BYTES_MAX
            )));
        }
        return Ok(Ok(()));
    }
    if body.entry_type == ev::NODE_OBSERVED {
        let observed: ev::NodeObserved = match serde_json::from_value(body.payload.clone()) {
            Ok(p) => p,
            Err(e) => return Ok(Err(format!("the payload of node.observed: {e}"))),
        };
        if observed.journal.is_some() || observed.node_id != node || body.subject != format!("{KIND_AGENT}/{node}") {
            return Ok(Err(format!("node.observed is about this node, on {KIND_AGENT}/{node}")));
        }
        return Ok(Ok(()));
    }
    if ev::GPU_REPORT_TYPES.contains(&body.entry_type.as_str()) {
        return check_gpu_report(store, bound, body).await;
    }
    if ev::INSTANCE_REPORT_TYPES.contains(&body.entry_type.as_str()) {
        return check_instance_report(store, bound, body).await;
    }
    if ev::SANDBOX_SNAPSHOT_REPORT_TYPES.contains(&body.entry_type.as_str()) {
        return Ok(crate::api::sandbox_snapshots::check_snapshot_report(
            store,
            bound.tenant,
            &node,
            &body.subject,
            &body.payload,
        )
        .await?);
    }
    if ev::SANDBOX_VOLUME_REPORT_TYPES.contains(&body.entry_type.as_str()) {
        return Ok(
            crate::api::sandbox_volumes::check_volume_report(store, bound.tenant, &node, &body.subject, &body.payload).await?
        );
    }
    if ev::SANDBOX_REPORT_TYPES.contains(&body.entry_type.as_str()) {
        return Ok(crate::api::sandboxes::check_sandbox_report(store, bound.tenant, &node, &body.subject, &body.payload).await?);
    }
    let progress: CommandProgress = match serde_json::from_value(body.payload.clone()) {
        Ok(p) => p,
        Err(e) => return Ok(Err(format!("the payload of {}: {e}", body.entry_type))),
    };
    let subject_ok = progress.journal.is_none()
        && progress.node_id == node
        && progress.command_id.parse::<CommandId>().is_ok()
        && body.subject == format!("{KIND_COMMAND}/{}", progress.command_id);
    if !subject_ok {
        return Ok(Err("the entry must name this node and the command it is about".into()));
    }
    let command = store.row_get(&bound.tenant.to_string(), KIND_COMMAND, &progress.command_id).await?;
    let command: Option<CommandDoc> = command.map(crate::api::call::doc).transpose()?;
    if command.is_none_or(|c| c.node_id != node) {
        return Ok(Err(format!("command {} is not this node's", progress.command_id)));
    }
    Ok(Ok(()))
}

/// A GPU report must answer one of this node's own `gpu.hold` (`gpu.held`, `gpu.hold_failed`)
/// or `gpu.release` (`gpu.released`) commands, on the stream of the reservation that command
/// names: a node cannot write to another reservation's history.
async fn check_gpu_report(
    store: &dyn EventStore,
    bound: &Bound,
    body: &bc_core::agent::EntryBody,
) -> std::result::Result<std::result::Result<(), String>, Refusal> {
    let node = bound.node.to_string();
    let report: ev::GpuReport = match serde_json::from_value(body.payload.clone()) {
        Ok(r) => r,
        Err(e) => return Ok(Err(format!("the payload of {}: {e}", body.entry_type))),
    };
    let shape_ok = report.journal.is_none()
        && report.node_id == node
        && report.command_id.parse::<CommandId>().is_ok()
        && report.reservation_id.parse::<bc_core::id::ReservationId>().is_ok()
        && body.subject == stream_of(bc_projections::KIND_RESERVATION, &report.reservation_id)
        && report.gpus.len() <= crate::api::nodes::GPUS_PER_NODE_MAX
        && report.gpus.iter().all(|u| u.len() <= crate::agents::join::INVENTORY_TEXT_BYTES_MAX)
        && report.reason.as_ref().is_none_or(|r| r.len() <= REASON_BYTES_MAX);
    if !shape_ok {
        return Ok(Err(format!(
            "{} names this node, one of its commands and that command's reservation, on the reservation's stream",
            body.entry_type
        )));
    }
    let command = store.row_get(&bound.tenant.to_string(), KIND_COMMAND, &report.command_id).await?;
    let command: Option<CommandDoc> = command.map(crate::api::call::doc).transpose()?;
    let kind = if body.entry_type == ev::GPU_RELEASED { placement::GPU_RELEASE } else { placement::GPU_HOLD };
    let answers = command.is_some_and(|c| {
        c.node_id == node
            && c.kind == kind
            && c.args.get("reservationId").and_then(|r| r.as_str()) == Some(&report.reservation_id)
    });
    if !answers {
        return Ok(Err(format!(
            "command {} is not this node's {kind} for reservation {}",
            report.command_id, report.reservation_id
        )));
    }
    Ok(Ok(()))
}

/// An instance report must be about an instance on this node, on that instance's stream; one
/// that answers a command must answer this node's `instance.apply` for that instance.
async fn check_instance_report(
    store: &dyn EventStore,
    bound: &Bound,
    body: &bc_core::agent::EntryBody,
) -> std::result::Result<std::result::Result<(), String>, Refusal> {
    let node = bound.node.to_string();
    let report: ev::InstanceReport = match serde_json::from_value(body.payload.clone()) {
        Ok(r) => r,
        Err(e) => return Ok(Err(format!("the payload of {}: {e}", body.entry_type))),
    };
    let observed = body.entry_type == ev::INSTANCE_OBSERVED;
    let shape_ok = report.journal.is_none()
        && report.node_id == node
        && report.instance_id.parse::<bc_core::id::InstanceId>().is_ok()
        && body.subject == stream_of(bc_projections::KIND_INSTANCE, &report.instance_id)
        && report.command_id.as_deref().is_none_or(|c| c.parse::<CommandId>().is_ok())
        && report.reason.as_ref().is_none_or(|r| r.len() <= REASON_BYTES_MAX)
        && if observed { report.state.is_some() } else { report.command_id.is_some() && report.reason.is_some() };
    if !shape_ok {
        return Ok(Err(format!(
            "{} names this node and one of its instances, on the instance's stream ({})",
            body.entry_type,
            if observed { "with the state observed" } else { "with the command and the reason" }
        )));
    }
    let instance = store.row_get(&bound.tenant.to_string(), bc_projections::KIND_INSTANCE, &report.instance_id).await?;
    let instance: Option<bc_projections::InstanceDoc> = instance.map(crate::api::call::doc).transpose()?;
    if instance.is_none_or(|i| i.node_id != node) {
        return Ok(Err(format!("instance {} is not on this node", report.instance_id)));
    }
    if let Some(command_id) = &report.command_id {
        let command = store.row_get(&bound.tenant.to_string(), KIND_COMMAND, command_id).await?;
        let command: Option<CommandDoc> = command.map(crate::api::call::doc).transpose()?;
        let answers = command.is_some_and(|c| {
            c.node_id == node
                && c.kind == bc_projections::INSTANCE_APPLY
                && c.args.get("instanceId").and_then(|i| i.as_str()) == Some(&report.instance_id)
        });
        if !answers {
            return Ok(Err(format!(
                "command {command_id} is not this node's {} for instance {}",
                bc_projections::INSTANCE_APPLY,
                report.instance_id
            )));
        }
    }
    Ok(Ok(()))
}

/// The longest reason a node gives for a failed hold or apply.
pub const REASON_BYTES_MAX: usize = 1024;

/// Sends the node's unfinished commands it has not been sent in this session, in issue order.
async fn send_commands(
    state: &AppState,
    bound: &mut Bound,
    outbound: &Outbound,
    config: SessionConfig,
) -> std::result::Result<(), Refusal> {
    for mut msg in commands_unsent(&*state.store, bound).await? {
        if let Err(e) = resolve_secrets(state, bound.tenant, &mut msg).await {
            // Not sent without its secrets: a later round (the node's next command or session)
            // sends it again, and the command's deadline ends it if it never can be.
            if let gateway_message::Msg::Command(command) = &msg {
                tracing::warn!(code = %e.code(), error = %e, command = %command.command_id, node = %bound.node,
                    "a sandbox's secret reference did not resolve; its command waits");
                bound.sent.remove(&command.command_id);
            }
            continue;
        }
        if !send_within(outbound, message(msg), config.lease_ms).await? {
            return Ok(());
        }
    }
    Ok(())
}

/// A `sandbox.apply` that starts a sandbox leaves with its environment's secret references
/// resolved (`api::secrets::resolve_env_refs`, which records each resolution): the command in
/// the log, and every copy of it but the one on the node's stream, keeps the references.
async fn resolve_secrets(state: &AppState, tenant: TenantId, msg: &mut gateway_message::Msg) -> Result<(), Error> {
    let gateway_message::Msg::Command(command) = msg else { return Ok(()) };
    if command.kind != bc_projections::sandbox::SANDBOX_APPLY {
        return Ok(());
    }
    let mut args: serde_json::Value =
        serde_json::from_str(&command.args_json).map_err(|e| Error::Internal(format!("a sandbox.apply's arguments: {e}")))?;
    if args.get("desired").and_then(serde_json::Value::as_str) != Some("running") {
        return Ok(());
    }
    let referrer = match args.get("sandboxId").and_then(serde_json::Value::as_str) {
        Some(id) => format!("{}/{id}", bc_projections::sandbox::KIND_SANDBOX),
        None => return Ok(()),
    };
    let Some(env) = args.get_mut("env").and_then(serde_json::Value::as_object_mut) else { return Ok(()) };
    if !env.values().any(|v| v.as_str().is_some_and(crate::api::secrets::is_secret_ref)) {
        return Ok(());
    }
    crate::api::secrets::resolve_env_refs(&*state.store, &state.log, tenant, &referrer, env).await?;
    command.args_json = serde_json::to_string(&args).map_err(|e| Error::Internal(e.to_string()))?;
    Ok(())
}

/// Queues `msg` for the node's stream, waiting at most `within_ms` for room
/// (`SESSION_OUTBOUND_MESSAGES` are queued): a node that reads nothing for that long ends its
/// session rather than holding it, and the commands behind, for ever. `Ok(false)`: the stream
/// is gone.
async fn send_within(
    outbound: &Outbound,
    msg: std::result::Result<bc_proto::GatewayMessage, tonic::Status>,
    within_ms: u64,
) -> std::result::Result<bool, Refusal> {
    match tokio::time::timeout(Duration::from_millis(within_ms), outbound.send(msg)).await {
        Ok(sent) => Ok(sent.is_ok()),
        Err(_) => Err(refuse(tonic::Code::DeadlineExceeded, "the node read nothing in time")),
    }
}

/// The node's unfinished commands this session has not sent yet, in issue order, each marked
/// sent: the caller sends them in this order. All of them: a session is woken once per command
/// issued ([`wakes`]), so one left for a later round could wait for the node's next command.
/// (The API keeps a node's unfinished commands to `COMMANDS_PENDING_PER_NODE_MAX`.)
pub async fn commands_unsent(
    store: &dyn EventStore,
    bound: &mut Bound,
) -> std::result::Result<Vec<gateway_message::Msg>, Refusal> {
    let tenant = bound.tenant.to_string();
    let Some(row) = store.row_get(&tenant, KIND_NODE_COMMANDS, &bound.node.to_string()).await? else {
        return Ok(Vec::new());
    };
    let queue: NodeCommandsDoc = crate::api::call::doc(row)?;
    let unsent: Vec<String> = queue.pending.into_iter().filter(|id| !bound.sent.contains(id)).collect();
    let mut out = Vec::new();
    for id in unsent {
        let Some(row) = store.row_get(&tenant, KIND_COMMAND, &id).await? else { continue };
        let command: CommandDoc = crate::api::call::doc(row)?;
        if command.state.is_finished() {
            continue;
        }
        let args_json = serde_json::to_string(&command.args).map_err(|e| Error::Internal(e.to_string()))?;
        out.push(gateway_message::Msg::Command(bc_proto::Command {
            command_id: command.command_id.clone(),
            kind: command.kind.clone(),
            args_json,
            issued_at_ms: command.issued_at_ms,
            deadline_ms: command.deadline_at_ms,
            release_json: match &command.release {
                Some(release) => serde_json::to_string(release).map_err(|e| Error::Internal(e.to_string()))?,
                None => String::new(),
            },
        }));
        bound.sent.insert(id);
    }
    Ok(out)
}

/// The node whose session `event` wakes: a command issued to it, or cancelled. Only these
/// change what [`commands_unsent`] returns to a session that has sent what it had.
pub fn wakes(event: &bc_core::event::StoredEvent) -> Option<String> {
    let t = event.envelope.event_type.as_str();
    if t != ev::COMMAND_ISSUED && t != ev::COMMAND_CANCELLED {
        return None;
    }
    canonical::to_json(&event.envelope.payload).get("nodeId").and_then(|n| n.as_str()).map(str::to_owned)
}

/// Wakes the sessions whose node got a command: follows the log by position (one read per
/// commit for the whole process, not one per session), woken by this process's commits and by
/// polling for other processes'. Only a command's row is decoded (and checked), and only while
/// this process has sessions: the type is a column of the row, and decoding every event of a
/// busy log was 6 % of a server's time under API writes with no agent at all.
pub async fn route_commands(state: Arc<AppState>, sessions: Arc<Sessions>, poll_ms: u64) {
    let mut commits = state.log.subscribe();
    let mut shutdown = state.shutdown.subscribe();
    let mut after = match state.store.last_commit().await {
        Ok(commit) => bc_core::event::Position { commit, index: i32::MAX as u32 },
        Err(e) => {
            tracing::error!(code = %e.code(), error = %e, "the command router cannot read the log");
            return;
        }
    };
    loop {
        if sessions.is_empty() {
            // Nobody to nudge, so nothing to read: every commit known so far is passed over. A
            // session that joins later reads its pending commands itself when it starts, after
            // every commit numbered up to here, so starting from here misses none of the
            // commands issued after it did.
            let known = *commits.borrow_and_update();
            if known > after.commit {
                after = bc_core::event::Position { commit: known, index: i32::MAX as u32 };
            }
        } else {
            let rows = state.store.read_after_rows(after, None, 500).await.and_then(|rows| {
                let read = rows.len();
                let last = rows.last().map(|r| bc_core::event::Position { commit: r.commit, index: r.index });
                let commands = rows
                    .into_iter()
                    .filter(|r| r.event_type == ev::COMMAND_ISSUED || r.event_type == ev::COMMAND_CANCELLED)
                    .collect();
                Ok((read, last, bc_core::store::decode_rows(commands)?))
            });
            match rows {
                Ok((read, last, commands)) => {
                    for node in commands.iter().filter_map(wakes) {
                        sessions.nudge(&node);
                    }
                    after = last.unwrap_or(after);
                    if read == 500 {
                        continue;
                    }
                }
                Err(e) => tracing::warn!(code = %e.code(), error = %e, "the command router's read failed"),
            }
        }
        tokio::select! {
            _ = commits.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(poll_ms)) => {}
            _ = shutdown.changed() => return,
        }
    }
}

#[cfg(test)]
mod claims_tests {
    use super::*;
    use bc_core::store::lease::LeaseClaim;

    fn claim(node: &str, holder: &str) -> LeaseClaim {
        LeaseClaim { tenant: "ten_root".into(), node: node.into(), holder: holder.into(), claimed_at_ms: 1 }
    }

    /// A session is closed only by a claim of its node from another gateway process: not by this
    /// process's claims (its own, or a newer session's here, which `register` handles), not by a
    /// claim of a node it does not serve, not by a row that names no holder.
    #[test]
    fn only_another_holders_claim_of_the_node_closes_its_session() {
        let sessions = Sessions::default();
        let (a, holder_a) = sessions.next_session();
        let (b, _) = sessions.next_session();
        let (tx_a, mut rx_a) = mpsc::channel(4);
        let (tx_b, mut rx_b) = mpsc::channel(4);
        sessions.register("node_a", a, tx_a);
        sessions.register("node_b", b, tx_b);
        let (_, holder_next) = sessions.next_session();
        let claims = [claim("node_a", &holder_a), claim("node_a", &holder_next), claim("node_b", ""), claim("node_c", "other/1")];
        assert_eq!(sessions.replaced_elsewhere(&claims), 0);
        assert!(rx_a.try_recv().is_err() && rx_b.try_recv().is_err());
        let other = Sessions::default();
        let (_, holder_elsewhere) = other.next_session();
        assert_ne!(holder_elsewhere, holder_a, "two processes never name a session alike");
        assert_eq!(sessions.replaced_elsewhere(&[claim("node_a", &holder_elsewhere)]), 1);
        assert_eq!(rx_a.try_recv().ok(), Some(Nudge::ReplacedElsewhere));
        assert!(rx_b.try_recv().is_err());
    }
}
