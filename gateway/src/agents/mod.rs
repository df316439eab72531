//! The agents' endpoint: the gRPC service of `schema/agent.proto` (tonic), on its own listener,
//! TLS with a pinned serving certificate ([`tls`]); plain h2c only on loopback in `dev`.
//!
//! Layout: [`join`] spends a join token; [`session`] is a node's session, free of tonic (the
//! service here only adapts its streams); [`tls`] the serving certificate. Every connection
//! holds a slot of `AGENT_CONNECTIONS_MAX`, and its TLS handshake must finish within
//! `TLS_HANDSHAKE_TIMEOUT_MS`.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bc_core::Error;
use bc_proto::agent_server::{Agent, AgentServer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::AppState;

pub mod join;
pub mod session;
pub mod tls;

pub use session::{SessionConfig, Sessions};

/// Agent connections held at once, so a flood cannot exhaust file descriptors.
pub const AGENT_CONNECTIONS_MAX: usize = 10_000;
/// A TLS handshake that takes longer is dropped, freeing its slot.
pub const TLS_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Joins decided at once: each is an append and a signature.
pub const JOINS_CONCURRENT_MAX: usize = 16;
/// How often the command router looks for other processes' commands.
pub const COMMAND_POLL_MS: u64 = 1000;

/// The gRPC status a core error leaves as.
pub fn code_of(e: &Error) -> tonic::Code {
    use bc_core::error::ErrorCode as C;
    match e.code() {
        C::InvalidArgument | C::PayloadTooLarge => tonic::Code::InvalidArgument,
        C::NotFound => tonic::Code::NotFound,
        C::Conflict | C::IdempotencyConflict => tonic::Code::Aborted,
        C::AlreadyExists => tonic::Code::AlreadyExists,
        C::InvalidState => tonic::Code::FailedPrecondition,
        C::Unauthenticated => tonic::Code::Unauthenticated,
        C::AccessDenied => tonic::Code::PermissionDenied,
        C::QuotaExceeded => tonic::Code::ResourceExhausted,
        C::Unavailable => tonic::Code::Unavailable,
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
    joins: Arc<tokio::sync::Semaphore>,
}

impl AgentService {
    pub fn new(state: Arc<AppState>, config: SessionConfig) -> Self {
        Self {
            state,
            sessions: Arc::new(Sessions::default()),
            config,
            joins: Arc::new(tokio::sync::Semaphore::new(JOINS_CONCURRENT_MAX)),
        }
    }
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn join(&self, request: Request<bc_proto::JoinRequest>) -> Result<Response<bc_proto::JoinResponse>, Status> {
        let _permit = self.joins.acquire().await.map_err(|_| Status::unavailable("the gateway is stopping"))?;
        match join::join(&self.state, request.into_inner()).await {
            Ok(joined) => Ok(Response::new(bc_proto::JoinResponse {
                identity: joined.identity,
                signature: joined.signature,
                log_key_id: self.state.log.key.key_id().to_owned(),
                log_public_key: self.state.log.key.public().as_bytes().to_vec(),
            })),
            Err(e) => {
                tracing::info!(code = %e.code(), error = %e.public_message(), "a join was refused");
                Err(status_of(&e))
            }
        }
    }

    type SessionStream = ReceiverStream<Result<bc_proto::GatewayMessage, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<bc_proto::AgentMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let inbound = request.into_inner();
        let (outbound, stream) = tokio::sync::mpsc::channel(session::SESSION_OUTBOUND_MESSAGES);
        tokio::spawn(session::run(self.state.clone(), self.sessions.clone(), self.config, inbound, outbound));
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}

/// One accepted agent connection, plain or TLS, holding its slot.
pub enum AgentConn {
    Plain(TcpStream, tokio::sync::OwnedSemaphorePermit),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>, tokio::sync::OwnedSemaphorePermit),
}

impl tonic::transport::server::Connected for AgentConn {
    type ConnectInfo = Option<SocketAddr>;

    fn connect_info(&self) -> Self::ConnectInfo {
        match self {
            Self::Plain(s, _) => s.peer_addr().ok(),
            Self::Tls(s, _) => s.get_ref().0.peer_addr().ok(),
        }
    }
}

impl AsyncRead for AgentConn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for AgentConn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_flush(cx),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s, _) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s, _) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// How the endpoint is reached.
pub enum Transport {
    Tls(Arc<rustls::ServerConfig>),
    /// h2c: `dev` on a loopback address only (the caller checks).
    Plaintext,
}

/// Serves the agents' endpoint on `listener` until `shutdown`; also runs the command router.
pub async fn serve(
    listener: TcpListener,
    transport: Transport,
    service: AgentService,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (connections, incoming) = tokio::sync::mpsc::channel::<io::Result<AgentConn>>(64);
    let slots = Arc::new(tokio::sync::Semaphore::new(AGENT_CONNECTIONS_MAX));
    let acceptor = match &transport {
        Transport::Tls(config) => Some(tokio_rustls::TlsAcceptor::from(config.clone())),
        Transport::Plaintext => None,
    };
    let mut stopping = service.state.shutdown.subscribe();
    let accept = tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                permit = slots.clone().acquire_owned() => match permit { Ok(p) => p, Err(_) => return },
                _ = stopping.changed() => return,
            };
            let (stream, _) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting an agent connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                _ = stopping.changed() => return,
            };
            let _ = stream.set_nodelay(true);
            let connections = connections.clone();
            match &acceptor {
                None => {
                    if connections.send(Ok(AgentConn::Plain(stream, permit))).await.is_err() {
                        return;
                    }
                }
                Some(acceptor) => {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        let handshake =
                            tokio::time::timeout(Duration::from_millis(TLS_HANDSHAKE_TIMEOUT_MS), acceptor.accept(stream));
                        match handshake.await {
                            Ok(Ok(tls)) => {
                                let _ = connections.send(Ok(AgentConn::Tls(Box::new(tls), permit))).await;
                            }
                            Ok(Err(e)) => tracing::debug!(error = %e, "an agent's TLS handshake failed"),
                            Err(_) => tracing::debug!("an agent's TLS handshake timed out"),
                        }
                    });
                }
            }
        }
    });
    let router = tokio::spawn(session::route_commands(service.state.clone(), service.sessions.clone(), COMMAND_POLL_MS));
    let leases = tokio::spawn(session::write_leases(service.state.clone(), service.sessions.clone()));
    let served = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(
            AgentServer::new(service)
                .max_decoding_message_size(bc_proto::MESSAGE_BYTES_MAX)
                .max_encoding_message_size(bc_proto::MESSAGE_BYTES_MAX),
        )
        .serve_with_incoming_shutdown(ReceiverStream::new(incoming), shutdown)
        .await;
    accept.abort();
    router.abort();
    // Written once more on shutdown (the task ends itself then); not waited for past that.
    let _ = tokio::time::timeout(Duration::from_secs(2), leases).await;
    served
}
