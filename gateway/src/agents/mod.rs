//! The agents' endpoint: the gRPC service of `schema/agent.proto` (tonic), on its own listener,
//! TLS with a pinned serving certificate ([`tls`]); plain h2c only on loopback in `dev`.
//!
//! Layout: [`join`] spends a join token (plain, or sealed to the join encryption key:
//! `crate::join_keys`); [`join_request`] answers a machine that asks to join
//! without one; [`tpm_join`] admits a machine by its TPM (`bcd join --attestor tpm`, up to three
//! challenge rounds on one call); [`session`] is a node's session, free of tonic (the
//! service here only adapts its streams); [`tls`] the serving certificate. [`serve`] is the
//! listener: its own accept loop and hyper's HTTP/2 server per connection (not tonic's
//! `Server`, which leaves the streams per connection unbounded), with the bounds of
//! [`AgentLimits`], each a named default and most a `dev`/`serve` flag, so that whoever reaches
//! the port without credentials cannot exhaust the gateway or the agents' slots:
//!
//! - at most `connections_max` connections ([`AGENT_CONNECTIONS_MAX`]; the accept loop waits
//!   for a slot) and `connections_per_peer_max` from one address ([`AGENT_CONNECTIONS_PER_PEER_MAX`];
//!   more are closed at once);
//! - the TLS handshake, the HTTP/2 preface and the first stream must all come within
//!   `handshake_timeout` of the accept ([`AGENT_HANDSHAKE_TIMEOUT_MS`]); a session's `Hello`
//!   and `Proof` within `session::HANDSHAKE_TIMEOUT_MS` of its stream;
//! - at most [`AGENT_STREAMS_PER_CONNECTION_MAX`] streams open on a connection (every call is
//!   one stream, so this is also the calls in service per connection): more are refused with
//!   `REFUSED_STREAM`, and after [`AGENT_STREAM_REFUSALS_MAX`] refusals the connection is closed
//!   (`GOAWAY ENHANCE_YOUR_CALM`);
//! - a connection with no stream open for `idle_timeout` ([`AGENT_IDLE_TIMEOUT_MS`]) is closed,
//!   a peer that does not answer a keep-alive ping is dropped, and a write that makes no progress
//!   for `write_stall` fails;
//! - `Join` (and `RequestJoin`) takes one of `joins_max` permits ([`JOINS_CONCURRENT_MAX`]) or is refused at once
//!   with `UNAVAILABLE` and a retry hint (`bc_proto::RETRY_PUSHBACK_MS_KEY`), which `bcd join`
//!   honours.
//!
//! Beside the agents' service the endpoint serves the standard `grpc.health.v1.Health`
//! (tonic-health; `SERVING` while the gateway is ready, `crate::health`) and server reflection
//! (tonic-reflection, v1 and v1alpha, from `bc_proto::FILE_DESCRIPTOR_SET`), under the same
//! bounds ([`grpc_routes`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bc_core::Error;
use bc_proto::agent_server::{Agent, AgentServer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::AppState;
use crate::conn::{Deadlines, GuardedIo};

pub mod join;
pub mod join_request;
pub mod session;
pub mod tls;
pub mod tpm_join;

pub use session::{SessionConfig, Sessions};

/// Agent connections held at once, so a flood cannot exhaust file descriptors
/// (`--agents-connections-max`).
pub const AGENT_CONNECTIONS_MAX: usize = 10_000;
/// Agent connections from one peer address at once, so one machine cannot take every slot
/// (`--agents-connections-per-peer-max`): a `bcd` holds one. Raise it when many nodes reach the
/// gateway through one NAT address.
pub const AGENT_CONNECTIONS_PER_PEER_MAX: usize = 256;
const _: () = assert!(AGENT_CONNECTIONS_PER_PEER_MAX <= AGENT_CONNECTIONS_MAX);
/// From the accept, the TLS handshake, the HTTP/2 preface and the first stream must all arrive
/// within this (`--agents-handshake-timeout`); a connection that stays silent is closed.
pub const AGENT_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// A connection with no stream open this long is closed (`--agents-idle-timeout`). A `bcd`
/// keeps its session open; `bcd join` and `bcd doctor` close theirs when done.
pub const AGENT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Streams (calls) one connection may hold open at once (HTTP/2's
/// `SETTINGS_MAX_CONCURRENT_STREAMS`): a `bcd` holds one session and a stream per tunnel to its
/// node (`tunnels::TUNNELS_PER_NODE_MAX`); more are refused with `REFUSED_STREAM`. Each stream
/// has a window of `bc_proto::AGENT_STREAM_WINDOW_BYTES` and the connection room for all of them
/// (`bc_proto::AGENT_CONNECTION_WINDOW_BYTES`, 8 MiB), so no stalled stream holds back another:
/// what the gateway buffers for stalled streams is at most 8 MiB a connection, 2 GiB for one
/// peer address at `AGENT_CONNECTIONS_PER_PEER_MAX`.
pub const AGENT_STREAMS_PER_CONNECTION_MAX: u32 = bc_proto::AGENT_STREAMS_PER_CONNECTION_MAX;
/// Streams the server refuses or resets on one connection for the peer's faults before it
/// closes the connection (`GOAWAY ENHANCE_YOUR_CALM`).
pub const AGENT_STREAM_REFUSALS_MAX: usize = 32;
/// Streams the peer opens and resets before they are served (a "rapid reset") before the
/// connection is closed.
pub const AGENT_PENDING_RESETS_MAX: usize = 20;
/// The largest request head (HTTP/2 header list) read, in bytes.
pub const AGENT_HEAD_BYTES_MAX: u32 = 16 * 1024;
/// HTTP/2 keep-alive: a ping this often, and the peer dropped if it does not answer within
/// `AGENT_KEEP_ALIVE_TIMEOUT_S`.
pub const AGENT_KEEP_ALIVE_S: u64 = 30;
pub const AGENT_KEEP_ALIVE_TIMEOUT_S: u64 = 10;
/// A connection told to close (idle, or the server stopping) is dropped after this even if its
/// peer never acknowledges.
pub const AGENT_CLOSE_GRACE_MS: u64 = 5_000;
/// Joins decided at once: each is an append and a signature (`--agents-joins-max`).
pub const JOINS_CONCURRENT_MAX: usize = 16;
/// The retry hint a refused `Join` carries (`bc_proto::RETRY_PUSHBACK_MS_KEY`).
pub const JOIN_RETRY_AFTER_MS: u64 = 1_000;
/// How often the command router looks for other processes' commands.
pub const COMMAND_POLL_MS: u64 = 1000;
const _: () = assert!(AGENT_HANDSHAKE_TIMEOUT_MS <= AGENT_IDLE_TIMEOUT_MS);

/// The bounds of the agents' endpoint; the module's header says what each bounds. The defaults
/// are the named constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentLimits {
    /// Connections open at once (`--agents-connections-max`).
    pub connections_max: usize,
    /// Connections from one peer address at once (`--agents-connections-per-peer-max`).
    pub connections_per_peer_max: usize,
    /// TLS, the preface and the first stream within this of the accept
    /// (`--agents-handshake-timeout`).
    pub handshake_timeout: Duration,
    /// A connection with no stream open this long is closed (`--agents-idle-timeout`).
    pub idle_timeout: Duration,
    /// Joins decided at once (`--agents-joins-max`).
    pub joins_max: usize,
    /// A write making no progress this long fails (`--write-stall`, shared with the HTTP API).
    pub write_stall: Duration,
}

impl Default for AgentLimits {
    fn default() -> Self {
        Self {
            connections_max: AGENT_CONNECTIONS_MAX,
            connections_per_peer_max: AGENT_CONNECTIONS_PER_PEER_MAX,
            handshake_timeout: Duration::from_millis(AGENT_HANDSHAKE_TIMEOUT_MS),
            idle_timeout: Duration::from_millis(AGENT_IDLE_TIMEOUT_MS),
            joins_max: JOINS_CONCURRENT_MAX,
            write_stall: Duration::from_secs(crate::conn::WRITE_STALL_S),
        }
    }
}

/// One connection of the agents' endpoint, as a request extension of every call on it: a
/// tunnel's `Tunnel` call must come on the connection of the session that was asked for it
/// (`crate::tunnels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnectionId(pub u64);

/// What the TLS layer of one connection says of its peer, as a request extension of every call
/// on it: whether the connection is TLS, and the SPKI pin of the client certificate the peer
/// presented (checked against the node CA and the revoked set by `node_ca::NodeCertVerifier`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsPeer {
    pub tls: bool,
    pub certificate_key_pin: Option<String>,
}

/// The gRPC status a core error leaves as.
pub fn code_of(e: &Error) -> tonic::Code {
    use bc_core::error::ErrorCode as C;
    match e.code() {
        C::InvalidArgument | C::PayloadTooLarge => tonic::Code::InvalidArgument,
        C::NotFound => tonic::Code::NotFound,
        C::Conflict | C::IdempotencyConflict => tonic::Code::Aborted,
        C::AlreadyExists => tonic::Code::AlreadyExists,
        C::InvalidState | C::PlanBlocked | C::ConfigDrift => tonic::Code::FailedPrecondition,
        C::Unauthenticated => tonic::Code::Unauthenticated,
        C::AccessDenied | C::BatchRequired => tonic::Code::PermissionDenied,
        C::QuotaExceeded | C::RateLimited => tonic::Code::ResourceExhausted,
        C::Unavailable => tonic::Code::Unavailable,
        C::Unsupported => tonic::Code::Unimplemented,
        C::Corrupt | C::Internal => tonic::Code::Internal,
    }
}

fn status_of(e: &Error) -> Status {
    Status::new(code_of(e), e.public_message())
}

/// The service: joins and sessions.
pub struct AgentService {
    pub state: Arc<AppState>,
    pub sessions: Arc<Sessions>,
    pub config: SessionConfig,
    limits: AgentLimits,
    /// Joins decided at once: a join past them is refused, never queued, so a flood of joins
    /// holds no task and no memory while it waits.
    joins: Arc<tokio::sync::Semaphore>,
    /// TPM joins through their rounds (`tpm_join::TPM_JOINS_CONCURRENT_MAX`), apart from `joins`.
    tpm_joins: Arc<tokio::sync::Semaphore>,
}

impl AgentService {
    pub fn new(state: Arc<AppState>, config: SessionConfig) -> Self {
        Self::with_limits(state, config, AgentLimits::default())
    }

    pub fn with_limits(state: Arc<AppState>, config: SessionConfig, limits: AgentLimits) -> Self {
        Self {
            state,
            sessions: Arc::new(Sessions::default()),
            config,
            limits,
            joins: Arc::new(tokio::sync::Semaphore::new(limits.joins_max)),
            tpm_joins: Arc::new(tokio::sync::Semaphore::new(tpm_join::TPM_JOINS_CONCURRENT_MAX)),
        }
    }

    /// The joins' permits (a test holds them to see a join refused).
    pub fn join_permits(&self) -> Arc<tokio::sync::Semaphore> {
        self.joins.clone()
    }
}

/// `UNAVAILABLE` with a hint of when to try again.
fn unavailable_retry_after(message: &str, retry_after_ms: u64) -> Status {
    let mut status = Status::unavailable(message);
    status.metadata_mut().insert(bc_proto::RETRY_PUSHBACK_MS_KEY, retry_after_ms.into());
    status
}

impl AgentService {
    /// A join's answer: the signed identity, the log key, and the node certificate with its CA.
    fn join_response(&self, joined: join::Joined) -> bc_proto::JoinResponse {
        join_response(&self.state, joined)
    }
}

/// A join's answer: the signed identity, the log key, and the node certificate with its CA,
/// signed by the join signing key when the deployment has one.
fn join_response(state: &AppState, joined: join::Joined) -> bc_proto::JoinResponse {
    let mut response = bc_proto::JoinResponse {
        identity: joined.identity,
        signature: joined.signature,
        log_key_id: state.log.key.key_id().to_owned(),
        log_public_key: state.log.key.public().as_bytes().to_vec(),
        node_certificate_not_after_ms: joined.certificate.as_ref().map_or(0, |c| c.not_after_ms),
        node_certificate: joined.certificate.map(|c| c.der).unwrap_or_default(),
        node_ca_certificate: state.node_ca.as_ref().map(|ca| ca.certificate().to_vec()).unwrap_or_default(),
        join_signature: Vec::new(),
        join_signing_public_key: Vec::new(),
    };
    // Signed by the join signing key, which the well-known document names (its pin is what
    // a machine that joined through the document holds).
    if let Some(keys) = &state.join_keys {
        let message = bc_core::well_known::join_response_signing_message(
            &response.identity,
            &response.signature,
            &response.log_public_key,
            &response.node_certificate,
            &response.node_ca_certificate,
            response.node_certificate_not_after_ms,
        );
        response.join_signature = keys.sign_join_response(&message);
        response.join_signing_public_key = keys.signing_public().to_vec();
    }
    response
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn join(&self, request: Request<bc_proto::JoinRequest>) -> Result<Response<bc_proto::JoinResponse>, Status> {
        let Ok(_permit) = self.joins.try_acquire() else {
            tracing::debug!("a join was refused: every join permit is taken");
            return Err(unavailable_retry_after("the gateway is deciding as many joins as it can; retry", JOIN_RETRY_AFTER_MS));
        };
        match join::join(&self.state, request.into_inner()).await {
            Ok(joined) => Ok(Response::new(self.join_response(joined))),
            Err(e) => {
                tracing::info!(code = %e.code(), error = %e.public_message(), "a join was refused");
                Err(status_of(&e))
            }
        }
    }

    /// A machine with no token asks (again); it takes a join permit as a join does.
    async fn request_join(&self, request: Request<bc_proto::JoinAsk>) -> Result<Response<bc_proto::JoinAskAnswer>, Status> {
        let Ok(_permit) = self.joins.try_acquire() else {
            tracing::debug!("an ask to join was refused: every join permit is taken");
            return Err(unavailable_retry_after("the gateway is deciding as many joins as it can; retry", JOIN_RETRY_AFTER_MS));
        };
        let answer = |id: bc_core::id::JoinRequestId, state: &str| bc_proto::JoinAskAnswer {
            join_request_id: id.to_string(),
            state: state.to_owned(),
            ..Default::default()
        };
        match join_request::ask(&self.state, request.into_inner()).await {
            Ok(join_request::Asked::Pending { id }) => Ok(Response::new(bc_proto::JoinAskAnswer {
                retry_after_ms: join_request::JOIN_ASK_RETRY_AFTER_MS,
                ..answer(id, bc_proto::JOIN_ASK_PENDING)
            })),
            Ok(join_request::Asked::Rejected { id, reason }) => {
                Ok(Response::new(bc_proto::JoinAskAnswer { reason, ..answer(id, bc_proto::JOIN_ASK_REJECTED) }))
            }
            Ok(join_request::Asked::Approved { id, joined }) => Ok(Response::new(bc_proto::JoinAskAnswer {
                joined: Some(self.join_response(joined)),
                ..answer(id, bc_proto::JOIN_ASK_APPROVED)
            })),
            Err(e) => {
                tracing::info!(code = %e.code(), error = %e.public_message(), "an ask to join was refused");
                Err(status_of(&e))
            }
        }
    }

    type TpmJoinStream = ReceiverStream<Result<bc_proto::TpmJoinReply, Status>>;

    /// A join by the machine's TPM (`tpm_join`): its rounds on this call, which holds a TPM
    /// join's place until it ends, and one of the join permits for its append only.
    async fn tpm_join(
        &self,
        request: Request<Streaming<bc_proto::TpmJoinMessage>>,
    ) -> Result<Response<Self::TpmJoinStream>, Status> {
        let Ok(permit) = self.tpm_joins.clone().try_acquire_owned() else {
            tracing::debug!("a TPM join was refused: every TPM join's place is taken");
            return Err(unavailable_retry_after("the gateway is deciding as many joins as it can; retry", JOIN_RETRY_AFTER_MS));
        };
        let mut inbound = request.into_inner();
        // A challenge, then the answer or the refusal: the call never has more in flight.
        let (outbound, stream) = tokio::sync::mpsc::channel(2);
        let (state, appends) = (self.state.clone(), self.joins.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let reply = match tpm_join::run(&state, &appends, &mut inbound, &outbound).await {
                Ok(joined) => {
                    Ok(bc_proto::TpmJoinReply { msg: Some(bc_proto::tpm_join_reply::Msg::Joined(join_response(&state, joined))) })
                }
                Err(e) => {
                    tracing::info!(code = %e.code(), error = %e.public_message(), "a TPM join was refused");
                    Err(status_of(&e))
                }
            };
            let _ = outbound.send(reply).await;
        });
        Ok(Response::new(ReceiverStream::new(stream)))
    }

    type SessionStream = ReceiverStream<Result<bc_proto::GatewayMessage, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<bc_proto::AgentMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let connection = connection_of(&request)?;
        let peer = request.extensions().get::<TlsPeer>().cloned().unwrap_or_default();
        let inbound = request.into_inner();
        let (outbound, stream) = tokio::sync::mpsc::channel(session::SESSION_OUTBOUND_MESSAGES);
        let link = session::Link { connection, peer };
        tokio::spawn(session::run(self.state.clone(), self.sessions.clone(), self.config, link, inbound, outbound));
        Ok(Response::new(ReceiverStream::new(stream)))
    }

    type TunnelStream = Pin<Box<dyn futures::Stream<Item = Result<bc_proto::TunnelFrame, Status>> + Send>>;

    /// A tunnel's end: the first message names a tunnel this process asked the node's session
    /// for (`crate::tunnels`), and the call comes on that session's connection; then frames both
    /// ways until either side ends.
    async fn tunnel(&self, request: Request<Streaming<bc_proto::TunnelFrame>>) -> Result<Response<Self::TunnelStream>, Status> {
        use futures::StreamExt;
        let connection = connection_of(&request)?;
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(Duration::from_millis(crate::tunnels::AGENT_ATTACH_TIMEOUT_MS), inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("a tunnel's first message names it"))??
            .ok_or_else(|| Status::cancelled("the node closed the tunnel"))?;
        let from_node =
            inbound.take_while(|m| std::future::ready(m.is_ok())).filter_map(|m| std::future::ready(m.ok().map(|f| f.frame)));
        let (to_node, to_node_rx) = tokio::sync::mpsc::channel(crate::tunnels::TUNNEL_FRAMES_QUEUED);
        let end = crate::tunnels::AgentEnd { from_node: Box::pin(from_node), to_node };
        if !self.state.tunnels.agent_attached(&first.tunnel_id, connection, end) {
            return Err(Status::not_found("no tunnel waits for this id"));
        }
        let outbound = ReceiverStream::new(to_node_rx).map(|frame| Ok(bc_proto::TunnelFrame { tunnel_id: Vec::new(), frame }));
        Ok(Response::new(Box::pin(outbound)))
    }
}

/// The connection a call came on ([`Connection::run`] marks every request).
fn connection_of<T>(request: &Request<T>) -> Result<ConnectionId, Status> {
    request.extensions().get::<ConnectionId>().copied().ok_or_else(|| Status::internal("a call with no connection"))
}

/// One accepted agent connection, plain or TLS.
enum AgentIo {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for AgentIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for AgentIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// How the endpoint is reached.
pub enum Transport {
    Tls(Arc<rustls::ServerConfig>),
    /// h2c: `dev` on a loopback address only (the caller checks).
    Plaintext,
}

/// The connections open from each peer address.
#[derive(Default)]
struct PeerConnections {
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in [`PeerConnections`], given back when dropped.
struct PeerSlot {
    peers: Arc<PeerConnections>,
    ip: IpAddr,
}

impl PeerConnections {
    /// A slot for one more connection from `ip`, unless it holds `max` already.
    fn admit(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<PeerSlot> {
        let ip = ip.to_canonical();
        let mut open = self.open.lock().expect("the peer map is never poisoned");
        let count = open.entry(ip).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(PeerSlot { peers: self.clone(), ip })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.open.lock().expect("the peer map is never poisoned");
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// The streams open on one connection, so a connection that holds none can be closed.
#[derive(Clone)]
struct OpenStreams(Arc<tokio::sync::watch::Sender<usize>>);

/// One open stream; the count goes down when its response body is dropped.
struct StreamGuard(OpenStreams);

impl OpenStreams {
    fn new() -> Self {
        Self(Arc::new(tokio::sync::watch::channel(0).0))
    }

    fn opened(&self) -> StreamGuard {
        self.0.send_modify(|n| *n += 1);
        StreamGuard(self.clone())
    }

    /// Resolves once no stream has been open for `first` from now (before any stream) or for
    /// `then` (after one).
    async fn idle(&self, first: Duration, then: Duration) {
        let mut open = self.0.subscribe();
        let mut limit = first;
        loop {
            let _ = open.wait_for(|n| *n == 0).await;
            if tokio::time::timeout(limit, open.wait_for(|n| *n > 0)).await.is_err() {
                return;
            }
            limit = then;
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.0.send_modify(|n| *n -= 1);
    }
}

/// A response body that holds its stream's place in [`OpenStreams`] until it is dropped.
struct CountedBody {
    inner: tonic::body::Body,
    _stream: StreamGuard,
}

impl hyper::body::Body for CountedBody {
    type Data = hyper::body::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serves the agents' endpoint on `listener` until `shutdown`, with the service's
/// [`AgentLimits`]; also runs the command router and the lease writer.
pub async fn serve(
    listener: TcpListener,
    transport: Transport,
    service: AgentService,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioTimer};
    let limits = service.limits;
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.connections_max));
    let peers = Arc::new(PeerConnections::default());
    let acceptor = match &transport {
        Transport::Tls(config) => Some(tokio_rustls::TlsAcceptor::from(config.clone())),
        Transport::Plaintext => None,
    };
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(AGENT_STREAMS_PER_CONNECTION_MAX)
        .initial_stream_window_size(bc_proto::AGENT_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(bc_proto::AGENT_CONNECTION_WINDOW_BYTES)
        .max_local_error_reset_streams(AGENT_STREAM_REFUSALS_MAX)
        .max_pending_accept_reset_streams(AGENT_PENDING_RESETS_MAX)
        .max_header_list_size(AGENT_HEAD_BYTES_MAX)
        .keep_alive_interval(Duration::from_secs(AGENT_KEEP_ALIVE_S))
        .keep_alive_timeout(Duration::from_secs(AGENT_KEEP_ALIVE_TIMEOUT_S));
    let builder = Arc::new(builder);
    let router = tokio::spawn(session::route_commands(service.state.clone(), service.sessions.clone(), COMMAND_POLL_MS));
    let leases = tokio::spawn(session::write_leases(service.state.clone(), service.sessions.clone()));
    service.state.metrics.watch_sessions(&service.sessions);
    let state = service.state.clone();
    let server = AgentServer::new(service)
        .max_decoding_message_size(bc_proto::MESSAGE_BYTES_MAX)
        .max_encoding_message_size(bc_proto::MESSAGE_BYTES_MAX);
    let (server, health) = grpc_routes(server, state)?;
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut next_connection = 0u64;
    loop {
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            stream = crate::conn::accept(&listener) => stream,
            () = &mut shutdown => break,
        };
        let Ok(peer) = stream.peer_addr() else { continue };
        let Some(peer_slot) = peers.admit(peer.ip(), limits.connections_per_peer_max) else {
            tracing::debug!(peer = %peer.ip(), "an agent connection was closed: its address holds as many as it may");
            continue;
        };
        next_connection += 1;
        let connection = Connection {
            id: ConnectionId(next_connection),
            acceptor: acceptor.clone(),
            builder: builder.clone(),
            server: server.clone(),
            limits,
            stopping: stopping.clone(),
            peer,
        };
        tokio::spawn(async move {
            connection.run(stream).await;
            drop((permit, peer_slot));
        });
    }
    drop(listener);
    // Every connection is told to close; each is dropped within its grace at most.
    let _ = stop.send(true);
    let all = u32::try_from(limits.connections_max).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(Duration::from_millis(AGENT_CLOSE_GRACE_MS * 2), slots.acquire_many(all)).await;
    router.abort();
    health.abort();
    // Written once more on shutdown (the task ends itself then); not waited for past that.
    let _ = tokio::time::timeout(Duration::from_secs(2), leases).await;
    Ok(())
}

/// The agents' service with the standard health and reflection services beside it, and the
/// task that keeps the health status to the gateway's readiness (aborted when serving ends).
fn grpc_routes(
    server: AgentServer<AgentService>,
    state: Arc<AppState>,
) -> io::Result<(tonic::service::Routes, tokio::task::JoinHandle<()>)> {
    use tonic::server::NamedService;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(bc_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let invalid = |e: tonic_reflection::server::Error| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
    let (v1, v1alpha) = (reflection().build_v1().map_err(invalid)?, reflection().build_v1alpha().map_err(invalid)?);
    let (reporter, health) = tonic_health::server::health_reporter();
    let name = <AgentServer<AgentService> as NamedService>::NAME;
    let reporting = tokio::spawn(crate::health::report_grpc_health(state, reporter, name));
    let routes = tonic::service::Routes::new(server).add_service(health).add_service(v1).add_service(v1alpha).prepare();
    Ok((routes, reporting))
}

/// What one connection is served with.
struct Connection {
    /// Marks every call on the connection ([`ConnectionId`]).
    id: ConnectionId,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    builder: Arc<hyper::server::conn::http2::Builder<hyper_util::rt::TokioExecutor>>,
    server: tonic::service::Routes,
    limits: AgentLimits,
    stopping: tokio::sync::watch::Receiver<bool>,
    peer: SocketAddr,
}

impl Connection {
    async fn run(mut self, stream: TcpStream) {
        let deadline = tokio::time::Instant::now() + self.limits.handshake_timeout;
        let mut peer = TlsPeer::default();
        let io = match &self.acceptor {
            None => AgentIo::Plain(stream),
            Some(acceptor) => match tokio::time::timeout_at(deadline, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    let presented = tls.get_ref().1.peer_certificates().and_then(|chain| chain.first());
                    peer = TlsPeer { tls: true, certificate_key_pin: presented.and_then(|c| bc_pin::spki_pin(c).ok()) };
                    AgentIo::Tls(Box::new(tls))
                }
                Ok(Err(e)) => return tracing::debug!(peer = %self.peer, error = %e, "an agent's TLS handshake failed"),
                Err(_) => return tracing::debug!(peer = %self.peer, "an agent's TLS handshake timed out"),
            },
        };
        // The preface's first bytes by the deadline; the keep-alive pings find a peer gone
        // later, so the read deadline after that is far away.
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let far = Duration::from_secs(365 * 24 * 3600);
        let io = GuardedIo::new(io, Deadlines { write_stall: self.limits.write_stall, first_read: remaining, idle: far });
        let open = OpenStreams::new();
        let (server, counter, id) = (self.server.clone(), open.clone(), self.id);
        let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
            let mut server = server.clone();
            let stream = counter.opened();
            request.extensions_mut().insert(id);
            request.extensions_mut().insert(peer.clone());
            async move {
                let response = tower::Service::call(&mut server, request).await.unwrap_or_else(|never| match never {});
                Ok::<_, Infallible>(response.map(|inner| CountedBody { inner, _stream: stream }))
            }
        });
        let connection = self.builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
        let mut connection = std::pin::pin!(connection);
        let why = tokio::select! {
            served = connection.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(peer = %self.peer, error = %e, "an agent connection ended with an error");
                }
                return;
            }
            () = open.idle(remaining, self.limits.idle_timeout) => "no stream open in time",
            _ = self.stopping.wait_for(|stop| *stop) => "the gateway is stopping",
        };
        tracing::debug!(peer = %self.peer, why, "closing an agent connection");
        connection.as_mut().graceful_shutdown();
        if tokio::time::timeout(Duration::from_millis(AGENT_CLOSE_GRACE_MS), connection).await.is_err() {
            tracing::debug!(peer = %self.peer, "an agent connection did not close in time; dropped");
        }
    }
}
