//! bcd's own metrics for Prometheus (`[metrics] listen`, off by default), with the
//! `prometheus-client` crate as the gateway's: `GET /metrics` and nothing else, read-only, on
//! the address the operator sets (a loopback one unless a scraper elsewhere needs it).
//!
//! The session machine does no IO and knows nothing of this: the driver (`driver.rs`) feeds
//! [`Metrics`] with what it sees carrying out the machine's outputs: the session's phase and the
//! journal's head and acknowledgement after each step, each command's kind and outcome, the
//! holds after each command and observation, a heartbeat's send and its acknowledgement.
//!
//! Every name starts with [`METRICS_PREFIX`]. Labels are bounded: a command's kind is one of
//! [`COMMAND_KINDS`] or `other`, its outcome one of `succeeded`, `failed`, `none` (a redelivered
//! command already finished, or an update waiting for its confirmation); the session's state one
//! of [`SESSION_STATES`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// The first word of every metric's name.
pub const METRICS_PREFIX: &str = "bcd";
/// The command kinds counted by name; any other is `other`, so a gateway cannot make a label
/// value per command.
pub const COMMAND_KINDS: &[&str] = &["ping", "gpu.hold", "gpu.release", "instance.apply", "agent.update"];
/// The session's states, as `bcd status` says them.
pub const SESSION_STATES: [&str; 4] = ["idle", "connecting", "handshake", "live"];
/// A heartbeat's round trip buckets, in seconds: from loopback to a lease (at most 600 s).
pub const HEARTBEAT_BUCKETS_S: [f64; 12] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0];
/// Connections to the metrics endpoint served at once; more wait to be accepted.
pub const METRICS_CONNECTIONS_MAX: usize = 16;
/// A scrape's connection is closed after this, whatever it does.
pub const METRICS_CONNECTION_TIMEOUT_S: u64 = 30;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CommandLabels {
    kind: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// The agent's metrics; the driver writes them, the endpoint reads them.
pub struct Metrics {
    registry: Registry,
    commands: Family<CommandLabels, Counter>,
    session_state: Family<StateLabels, Gauge>,
    sessions: Counter,
    sessions_seen: AtomicI64,
    journal_head: Gauge,
    journal_unacked: Gauge,
    journal_full: Gauge,
    holds: Gauge,
    held_gpus: Gauge,
    heartbeat: Histogram,
    heartbeat_sent: std::sync::Mutex<Option<Instant>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(METRICS_PREFIX);
        let commands = Family::<CommandLabels, Counter>::default();
        registry.register("commands", "Commands run by this agent, by kind and outcome", commands.clone());
        let session_state = Family::<StateLabels, Gauge>::default();
        registry.register(
            "session_state",
            "The session to the gateway: 1 for the state it is in (idle, connecting, handshake, live)",
            session_state.clone(),
        );
        for state in SESSION_STATES {
            session_state.get_or_create(&StateLabels { state }).set(i64::from(state == "idle"));
        }
        let sessions = Counter::default();
        registry.register("sessions", "Sessions to the gateway that went live", sessions.clone());
        let journal_head = Gauge::default();
        registry.register("journal_head_seq", "The journal's newest entry", journal_head.clone());
        let journal_unacked = Gauge::default();
        registry.register(
            "journal_unacked_entries",
            "Journal entries the gateway has not acknowledged yet: the journal's depth",
            journal_unacked.clone(),
        );
        let journal_full = Gauge::default();
        registry.register("journal_full", "1 when the journal is at its bound and writes wait", journal_full.clone());
        let holds = Gauge::default();
        registry.register("holds", "Reservations this node holds GPUs for", holds.clone());
        let held_gpus = Gauge::default();
        registry.register("held_gpus", "GPUs this node holds for reservations", held_gpus.clone());
        let heartbeat = Histogram::new(HEARTBEAT_BUCKETS_S);
        registry.register_with_unit(
            "heartbeat_latency",
            "From a heartbeat's send to its acknowledgement by the gateway",
            Unit::Seconds,
            heartbeat.clone(),
        );
        Self {
            registry,
            commands,
            session_state,
            sessions,
            sessions_seen: AtomicI64::new(0),
            journal_head,
            journal_unacked,
            journal_full,
            holds,
            held_gpus,
            heartbeat,
            heartbeat_sent: std::sync::Mutex::new(None),
        }
    }

    /// The session's state (one of [`SESSION_STATES`]), the sessions that went live so far, and
    /// the journal's head and acknowledged entry: after each step of the machine.
    pub fn session(&self, state: &'static str, sessions: u64, head: u64, acked: u64) {
        for s in SESSION_STATES {
            self.session_state.get_or_create(&StateLabels { state: s }).set(i64::from(s == state));
        }
        let sessions = i64::try_from(sessions).unwrap_or(i64::MAX);
        let before = self.sessions_seen.swap(sessions, Ordering::Relaxed);
        if sessions > before {
            self.sessions.inc_by((sessions - before) as u64);
        }
        self.journal_head.set(i64::try_from(head).unwrap_or(i64::MAX));
        self.journal_unacked.set(i64::try_from(head.saturating_sub(acked)).unwrap_or(i64::MAX));
    }

    pub fn journal_full(&self, full: bool) {
        self.journal_full.set(i64::from(full));
    }

    /// A command of `kind` ran; `outcome` is `Some(true)` when it succeeded, `Some(false)` when it
    /// failed, `None` when it finished nothing this time.
    pub fn command(&self, kind: &str, outcome: Option<bool>) {
        let kind = COMMAND_KINDS.iter().copied().find(|k| *k == kind).unwrap_or("other");
        let outcome = match outcome {
            Some(true) => "succeeded",
            Some(false) => "failed",
            None => "none",
        };
        self.commands.get_or_create(&CommandLabels { kind, outcome }).inc();
    }

    /// The reservations held and their GPUs, from the holds' ledger.
    pub fn holds(&self, holds: usize, gpus: usize) {
        self.holds.set(i64::try_from(holds).unwrap_or(i64::MAX));
        self.held_gpus.set(i64::try_from(gpus).unwrap_or(i64::MAX));
    }

    /// A heartbeat was sent now.
    #[allow(clippy::disallowed_methods)] // a round trip measured for a metric only; it decides nothing
    pub fn heartbeat_sent(&self) {
        *self.heartbeat_sent.lock().expect("heartbeat lock") = Some(Instant::now());
    }

    /// The gateway acknowledged the heartbeat last sent.
    pub fn heartbeat_acked(&self) {
        if let Some(sent) = self.heartbeat_sent.lock().expect("heartbeat lock").take() {
            self.heartbeat.observe(sent.elapsed().as_secs_f64());
        }
    }

    /// Every metric in the Prometheus text format 0.0.4.
    pub fn encode(&self) -> String {
        let mut text = String::with_capacity(4096);
        if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry) {
            tracing::error!(error = %e, "the metrics could not be encoded");
        }
        text
    }
}

/// The answer to one request: `GET /metrics` (or `HEAD`), 404 for another path, 405 for another
/// method. Nothing here changes anything.
fn answer(metrics: &Metrics, method: &hyper::Method, path: &str) -> hyper::Response<String> {
    let status = |code: u16, body: &str| {
        let mut response = hyper::Response::new(body.to_owned());
        *response.status_mut() = hyper::StatusCode::from_u16(code).unwrap_or(hyper::StatusCode::NOT_FOUND);
        response
    };
    if path != "/metrics" {
        return status(404, "not found: bcd serves /metrics only\n");
    }
    if method != hyper::Method::GET && method != hyper::Method::HEAD {
        let mut response = status(405, "method not allowed: GET /metrics\n");
        response.headers_mut().insert(hyper::header::ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let mut response = hyper::Response::new(metrics.encode());
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(prometheus_client::encoding::prometheus_text::CONTENT_TYPE),
    );
    response
}

/// Binds `[metrics] listen`.
pub async fn bind(listen: &str) -> Result<(tokio::net::TcpListener, SocketAddr), String> {
    let addr: SocketAddr = listen.parse().map_err(|_| format!("[metrics] listen {listen:?} is not HOST:PORT"))?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    Ok((listener, bound))
}

/// Serves `/metrics` on `listener` (HTTP/1.1), [`METRICS_CONNECTIONS_MAX`] connections at once,
/// each for at most [`METRICS_CONNECTION_TIMEOUT_S`], until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(METRICS_CONNECTIONS_MAX));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a metrics connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let response = answer(&metrics, request.method(), request.uri().path());
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
            let connection =
                hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(Duration::from_secs(METRICS_CONNECTION_TIMEOUT_S), connection).await;
            drop(permit);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_driver_feeds_is_what_is_served() {
        let metrics = Metrics::new();
        metrics.session("live", 2, 10, 7);
        metrics.session("live", 3, 12, 12);
        metrics.command("gpu.hold", Some(true));
        metrics.command("gpu.hold", Some(false));
        metrics.command("made.up", None);
        metrics.holds(1, 4);
        metrics.heartbeat_sent();
        metrics.heartbeat_acked();
        metrics.heartbeat_acked(); // no second observation without a send
        let text = metrics.encode();
        for line in [
            "bcd_session_state{state=\"live\"} 1",
            "bcd_session_state{state=\"idle\"} 0",
            "bcd_sessions_total 3",
            "bcd_journal_head_seq 12",
            "bcd_journal_unacked_entries 0",
            "bcd_commands_total{kind=\"gpu.hold\",outcome=\"succeeded\"} 1",
            "bcd_commands_total{kind=\"gpu.hold\",outcome=\"failed\"} 1",
            "bcd_commands_total{kind=\"other\",outcome=\"none\"} 1",
            "bcd_holds 1",
            "bcd_held_gpus 4",
            "bcd_heartbeat_latency_seconds_count 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
        }
    }

    #[test]
    fn only_get_metrics_is_answered() {
        let metrics = Metrics::new();
        assert_eq!(answer(&metrics, &hyper::Method::GET, "/metrics").status(), 200);
        assert_eq!(answer(&metrics, &hyper::Method::GET, "/").status(), 404);
        assert_eq!(answer(&metrics, &hyper::Method::POST, "/metrics").status(), 405);
    }
}
