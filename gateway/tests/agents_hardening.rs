//! Regression: whoever reached the agents' gRPC port exhausted the gateway without
//! credentials. One TLS connection opened 20,000 `Session` streams (tonic's server set no
//! stream limit); TLS connections that sent nothing after the handshake stayed open; `Join`
//! waited, unbounded, for one of its permits. Each test starts the real endpoint
//! (`bc_gateway::agents::serve`) on loopback with a fresh database.

use crate::common;
use crate::h2_flood;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bc_gateway::AppState;
use bc_gateway::agents::tls::ServingIdentity;
use bc_gateway::agents::{AgentLimits, AgentService, SessionConfig, Transport};
use tokio::io::AsyncWriteExt;

const SESSION_PATH: &str = "/bettercompute.agent.v1.Agent/Session";
/// How long a test waits for what should come at once, or within a short deadline; only a
/// guard against hanging, not a measure.
const GUARD: Duration = Duration::from_secs(20);

struct Endpoint {
    _dir: tempfile::TempDir,
    addr: std::net::SocketAddr,
    join_permits: Arc<tokio::sync::Semaphore>,
}

async fn endpoint(limits: AgentLimits, tls: bool) -> Endpoint {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let state = Arc::new(AppState::new(log));
    let transport = if tls {
        let (identity, _) = ServingIdentity::load_or_create(dir.path(), &[]).unwrap();
        Transport::Tls(identity.server_config().unwrap())
    } else {
        Transport::Plaintext
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = AgentService::with_limits(state, SessionConfig::default(), limits);
    let join_permits = service.join_permits();
    tokio::spawn(bc_gateway::agents::serve(listener, transport, service, std::future::pending()));
    Endpoint { _dir: dir, addr, join_permits }
}

/// 20,000 `Session` streams on one unauthenticated TLS connection: the server opens at most
/// `AGENT_STREAMS_PER_CONNECTION_MAX`, refuses the next with `REFUSED_STREAM`, and closes the
/// connection (`GOAWAY ENHANCE_YOUR_CALM`) after `AGENT_STREAM_REFUSALS_MAX` refusals; the
/// endpoint still answers an honest call after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_streams_on_one_connection_are_refused_and_the_connection_closed() {
    let endpoint = endpoint(AgentLimits::default(), true).await;
    let tls = h2_flood::tls_connect(endpoint.addr).await.unwrap();
    let report = h2_flood::flood(tls, 20_000, SESSION_PATH, true, GUARD).await;
    eprintln!(
        "sent {}, opened {}, refused {}, reset otherwise {}, goaway {:?}",
        report.sent,
        report.accepted.len(),
        report.refused,
        report.reset_otherwise,
        report.goaway
    );
    let opened = bc_gateway::agents::AGENT_STREAMS_PER_CONNECTION_MAX as usize;
    assert!(
        report.accepted.len() <= opened,
        "the server opened {} streams of {} sent, more than {opened}: {report:?}",
        report.accepted.len(),
        report.sent
    );
    assert!(report.refused > 0, "the streams past the limit are refused: {report:?}");
    assert_eq!(report.goaway, Some(h2_flood::ENHANCE_YOUR_CALM), "{report:?}");
    assert!(report.closed, "the connection is closed: {report:?}");
    assert!(report.refused <= bc_gateway::agents::AGENT_STREAM_REFUSALS_MAX + 1, "{report:?}");

    // An honest call on a new connection is still answered (a join with a token that is none).
    let addr = endpoint.addr;
    let connector = tower::service_fn(move |_: tonic::transport::Uri| async move {
        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(h2_flood::tls_connect(addr).await?))
    });
    let channel = tonic::transport::Endpoint::from_static("http://agents").connect_with_connector(connector).await.unwrap();
    let mut client = bc_proto::agent_client::AgentClient::new(channel);
    let refused = tokio::time::timeout(GUARD, client.join(bogus_join())).await.expect("answered").unwrap_err();
    assert_ne!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
}

/// Regression: 50 TLS connections that sent nothing after the handshake were all open after
/// 70 s. With a short `--agents-handshake-timeout`: a connection that never starts TLS, one that
/// finishes TLS and sends nothing, and one that sends the HTTP/2 preface and opens no stream
/// are each closed by the server; so is one whose last stream ended an idle timeout ago.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_within_the_handshake_deadline() {
    let limits = AgentLimits {
        handshake_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(600),
        ..AgentLimits::default()
    };
    let endpoint = endpoint(limits, true).await;

    let mut tcp = tokio::net::TcpStream::connect(endpoint.addr).await.unwrap();
    let after = common::closed_after(&mut tcp, GUARD).await;
    assert!(after.is_some(), "a connection that never starts TLS is closed");

    let mut tls = h2_flood::tls_connect(endpoint.addr).await.unwrap();
    let after = common::closed_after(&mut tls, GUARD).await;
    assert!(after.is_some(), "a TLS connection that sends nothing is closed");

    let mut tls = h2_flood::tls_connect(endpoint.addr).await.unwrap();
    tls.write_all(&h2_flood::preface()).await.unwrap();
    let after = common::closed_after(&mut tls, GUARD).await;
    assert!(after.is_some(), "a connection with the preface and no stream is closed");

    // A call answered at once (an unknown method), then nothing: closed an idle timeout after.
    let plain = self::endpoint(limits, false).await;
    let tcp = tokio::net::TcpStream::connect(plain.addr).await.unwrap();
    let report = h2_flood::flood(tcp, 1, "/bettercompute.agent.v1.Agent/Nothing", false, GUARD).await;
    assert_eq!(report.accepted.len(), 1, "the call is answered: {report:?}");
    assert!(report.closed, "the connection is closed once idle: {report:?}");
}

/// At most `connections_per_peer_max` connections from one address: the next is closed before
/// its TLS handshake; once one closes, another is let in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_per_peer_address_are_capped() {
    let limits = AgentLimits { connections_per_peer_max: 2, ..AgentLimits::default() };
    let endpoint = endpoint(limits, true).await;
    let first = h2_flood::tls_connect(endpoint.addr).await.unwrap();
    let _second = h2_flood::tls_connect(endpoint.addr).await.unwrap();
    assert!(h2_flood::tls_connect(endpoint.addr).await.is_err(), "a third connection from the same address is closed");
    drop(first);
    let started = Instant::now();
    loop {
        if h2_flood::tls_connect(endpoint.addr).await.is_ok() {
            break;
        }
        assert!(started.elapsed() < GUARD, "a slot is given back when a connection closes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn bogus_join() -> bc_proto::JoinRequest {
    bc_proto::JoinRequest {
        token: "bcjt_none_none".into(),
        node_public_key: vec![0; 32],
        hardware: None,
        agent_version: "test".into(),
        node_id: String::new(),
        sealed_token: None,
    }
}

/// `Join` with every permit taken is refused at once with `UNAVAILABLE` and a retry hint
/// (it waited, unbounded, for a permit); with a permit free it is decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_with_its_permits_taken_is_unavailable_at_once_with_a_retry_hint() {
    let endpoint = endpoint(AgentLimits::default(), false).await;
    let held = endpoint.join_permits.clone().acquire_many_owned(bc_gateway::agents::JOINS_CONCURRENT_MAX as u32).await.unwrap();
    let mut client = bc_proto::agent_client::AgentClient::connect(format!("http://{}", endpoint.addr)).await.unwrap();
    let refused = tokio::time::timeout(GUARD, client.join(bogus_join())).await.expect("answered without waiting").unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let hint = refused.metadata().get(bc_proto::RETRY_PUSHBACK_MS_KEY).expect("a retry hint").to_str().unwrap();
    assert_eq!(hint.parse::<u64>().unwrap(), bc_gateway::agents::JOIN_RETRY_AFTER_MS);
    drop(held);
    let decided = client.join(bogus_join()).await.unwrap_err();
    assert_ne!(decided.code(), tonic::Code::Unavailable, "with a permit free the join is decided: {decided:?}");
}
