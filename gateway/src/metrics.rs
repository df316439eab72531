//! `GET /metrics`: the process's metrics for Prometheus, with the `prometheus-client` crate.
//!
//! Served in the OpenMetrics text format to a scraper that asks for it (`Accept:
//! application/openmetrics-text`, as Prometheus does) and in the Prometheus text format 0.0.4
//! otherwise (`curl`, `promtool check metrics`). On the API's address, or only on
//! `--metrics-listen` when that is given (`cli/src/server.rs`); never authenticated, never under
//! the request limit.
//!
//! Every name starts with [`METRICS_PREFIX`]. Labels are bounded by construction: the HTTP
//! method (one of [`HTTP_METHODS`] or `other`), the status code, the reconciler's name (the
//! registry's), a pass's outcome (`ok`, `error`) and the store's backend (one per process). No
//! label names a tenant, a key, a node or a path.
//!
//! Where the numbers come from:
//! - [`Metrics::track`], a layer around the API: requests and their latency;
//! - [`LogMetrics`], the `Log`'s [`bc_core::store::AppendObserver`]: events appended, batch
//!   sizes, commit latency; and the `Log`'s own counters (`LogStats`) read at scrape time;
//! - [`Metrics::reconciler_pass`], called by the composition root's observer of the reconciler
//!   driver (`bc_reconcilers::driver::observe`);
//! - [`Live`], read at each scrape: agent sessions, tunnels, watchers;
//! - [`Metrics::outbox_completed`], the reconciler driver's observer again: each outbox item's
//!   outcome (`done`, `retried`, `dead`, `lost`) and its attempt's latency (webhook deliveries);
//! - [`Metrics::agent_heartbeat`] and [`Metrics::agent_journal_entry`], from the agents'
//!   sessions: heartbeats and the gaps between them, journal entries and their append latency;
//! - [`refresh`], every [`METRICS_REFRESH_MS`] while the server runs: the outbox's pending and
//!   dead items per consumer, the number of tenants, and the log head and checkpoint lag of the
//!   [`TENANTS_SHOWN_MAX`] tenants with the longest chains (the one label that names a tenant:
//!   bounded by that number, whatever the fleet).

use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::AppState;
use crate::agents::Sessions;

/// The first word of every metric's name.
pub const METRICS_PREFIX: &str = "better_compute";
/// The HTTP methods counted by name; any other is counted as `other`, so a client cannot make
/// a label value per request.
pub const HTTP_METHODS: [&str; 7] = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"];
/// A request's latency buckets, in seconds: from a cached read to the request timeout
/// (`REQUEST_TIMEOUT_S`).
pub const HTTP_DURATION_BUCKETS_S: [f64; 14] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0];
/// A batch's size buckets, in events: one to `BATCH_EVENTS_MAX`.
pub const LOG_BATCH_EVENTS_BUCKETS: [f64; 12] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0];
/// A commit's latency buckets, in seconds.
pub const LOG_COMMIT_BUCKETS_S: [f64; 12] = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5];
/// A reconciler pass's duration buckets, in seconds (the driver measures in milliseconds).
pub const RECONCILER_PASS_BUCKETS_S: [f64; 11] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0];
/// An outbox attempt's latency buckets, in seconds: up to the longest `--delivery-timeout`.
pub const OUTBOX_ATTEMPT_BUCKETS_S: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0];
/// The gap between two heartbeats of one session, in seconds: around the heartbeat interval
/// (5 s by default) and up to the longest lease.
pub const HEARTBEAT_GAP_BUCKETS_S: [f64; 11] = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 6.0, 7.5, 10.0, 15.0, 60.0];
/// A journal entry's check and append, in seconds.
pub const JOURNAL_APPEND_BUCKETS_S: [f64; 11] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];
/// How often [`refresh`] reads what is counted in the database.
pub const METRICS_REFRESH_MS: u64 = 15_000;
/// Tenants whose log head and checkpoint lag are shown, by label: those with the longest
/// chains.
pub const TENANTS_SHOWN_MAX: usize = 10;
/// The outbox consumers [`refresh`] counts the items of.
pub const OUTBOX_CONSUMERS: [&str; 1] = [bc_projections::WEBHOOK_CONSUMER];
/// The OpenMetrics text format's content type.
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One request's labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    method: &'static str,
    code: u16,
}

/// One reconciler pass's labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PassLabels {
    reconciler: &'static str,
    outcome: &'static str,
}

/// One outbox item's outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutboxLabels {
    consumer: &'static str,
    outcome: &'static str,
}

/// One outbox consumer.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabels {
    consumer: &'static str,
}

/// One journal entry's outcome (`appended`, `refused`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EntryLabels {
    outcome: &'static str,
}

/// One of the tenants shown ([`TENANTS_SHOWN_MAX`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabels {
    tenant: String,
}

/// One reconciler's label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReconcilerLabels {
    reconciler: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn http_histogram() -> Histogram {
    Histogram::new(HTTP_DURATION_BUCKETS_S)
}

fn reconciler_histogram() -> Histogram {
    Histogram::new(RECONCILER_PASS_BUCKETS_S)
}

fn outbox_histogram() -> Histogram {
    Histogram::new(OUTBOX_ATTEMPT_BUCKETS_S)
}

/// The process's metrics: what is counted as it happens, and what is read at each scrape.
pub struct Metrics {
    registry: Registry,
    http_requests: Family<HttpLabels, Counter>,
    http_duration: HistogramFamily<HttpLabels>,
    reconciler_passes: Family<PassLabels, Counter>,
    reconciler_duration: HistogramFamily<ReconcilerLabels>,
    outbox_items: Family<OutboxLabels, Counter>,
    outbox_attempt_duration: HistogramFamily<ConsumerLabels>,
    agent_heartbeats: Counter,
    agent_heartbeat_gap: Histogram,
    agent_journal_entries: Family<EntryLabels, Counter>,
    agent_journal_append: Histogram,
    /// The `Log`'s observer ([`Metrics::log_observer`]).
    log: Arc<LogMetrics>,
    /// What the scrape reads from the server's state.
    live: Arc<Live>,
}

/// What the `Log`'s appender reports per committed batch (its totals, batches and events, are
/// the `Log`'s own `LogStats`, read by [`LogTotals`], so they count the appends made before
/// the observer was set too).
#[derive(Debug)]
pub struct LogMetrics {
    batch_events: Histogram,
    commit_seconds: Histogram,
}

impl bc_core::store::AppendObserver for LogMetrics {
    fn batch_committed(&self, events: usize, commit: std::time::Duration) {
        self.batch_events.observe(events as f64);
        self.commit_seconds.observe(commit.as_secs_f64());
    }
}

/// Read at each scrape: held weakly, so the metrics keep nothing of the server alive.
#[derive(Default)]
pub struct Live {
    state: OnceLock<Weak<AppState>>,
    sessions: OnceLock<Weak<Sessions>>,
    /// What [`refresh`] read last; `None` before its first reading.
    refreshed: std::sync::Mutex<Option<Refreshed>>,
    /// What this process's `sandboxes` reconciler read at its last pass (live, warm); `None` in
    /// a process that runs no such pass, which then says nothing of sandboxes.
    sandboxes: std::sync::Mutex<Option<(u64, u64)>>,
}

/// What [`refresh`] reads from the database.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refreshed {
    pub tenants: u64,
    /// The [`TENANTS_SHOWN_MAX`] longest chains: tenant, head seq, events past the newest
    /// checkpoint's tree size (all of them when none was sealed).
    pub top: Vec<(String, u64, u64)>,
    /// Per outbox consumer: items pending (to attempt or retry), and dead.
    pub outbox: Vec<(&'static str, u64, u64)>,
}

/// A family of gauges, one per label set, written with its descriptor.
fn encode_gauges<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    values: impl IntoIterator<Item = (L, u64)>,
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, prometheus_client::metrics::MetricType::Gauge)?;
    for (labels, value) in values {
        ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").finish_non_exhaustive()
    }
}

/// One gauge or counter of [`Live`], written with its descriptor.
fn encode_const(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64, counter: bool) -> std::fmt::Result {
    if counter {
        let metric = ConstCounter::new(value);
        metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
    } else {
        let metric = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
        metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
    }
}

impl Collector for Live {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        if let Some(sessions) = self.sessions.get().and_then(Weak::upgrade) {
            encode_const(
                &mut encoder,
                "agent_sessions",
                "Agent sessions connected to this process",
                sessions.len() as u64,
                false,
            )?;
        }
        let refreshed = self.refreshed.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(refreshed) = refreshed {
            encode_const(&mut encoder, "log_tenants", "Tenants with a chain in the log", refreshed.tenants, false)?;
            let tenants = |i: usize| refreshed.top.iter().map(move |t| (TenantLabels { tenant: t.0.clone() }, [t.1, t.2][i]));
            encode_gauges(
                &mut encoder,
                "log_head_seq",
                "The seq of a chain's newest event, for the tenants with the longest chains",
                tenants(0),
            )?;
            encode_gauges(
                &mut encoder,
                "checkpoint_lag_events",
                "Events of a chain past its newest checkpoint's tree size (the checkpoint's own event and cosignatures among them), for the tenants with the longest chains",
                tenants(1),
            )?;
            let consumers = |i: usize| refreshed.outbox.iter().map(move |c| (ConsumerLabels { consumer: c.0 }, [c.1, c.2][i]));
            encode_gauges(&mut encoder, "outbox_items_pending", "Outbox items waiting for an attempt or a retry", consumers(0))?;
            encode_gauges(&mut encoder, "outbox_items_dead", "Outbox items given up on (dead letters)", consumers(1))?;
        }
        let sandboxes = *self.sandboxes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((live, warm)) = sandboxes {
            encode_const(&mut encoder, "sandboxes_live", "Sandboxes not yet deleted, across every tenant", live, false)?;
            encode_const(
                &mut encoder,
                "sandboxes_warm",
                "Of those, the warm pools' members: unclaimed, starting or running",
                warm,
                false,
            )?;
        }
        let Some(state) = self.state.get().and_then(Weak::upgrade) else { return Ok(()) };
        encode_const(
            &mut encoder,
            "tunnels_open",
            "Tunnels open through this process, with tickets not yet spent",
            state.tunnels.open_total() as u64,
            false,
        )?;
        let held = state.watchers.held() as u64;
        encode_const(&mut encoder, "watchers", "Watch streams connected to this process", held, false)?;
        let tail = state.watch_tail.stats();
        encode_const(
            &mut encoder,
            "watchers_behind",
            "Watch streams reading history or waiting for their client, not yet served by the shared tail",
            held.saturating_sub(tail.joined as u64),
            false,
        )?;
        encode_const(
            &mut encoder,
            "watch_slow_handbacks",
            "Watch streams the shared tail handed back because their client read too slowly",
            tail.slow_handbacks,
            true,
        )?;
        if tail.started {
            let committed = *state.log.subscribe().borrow();
            encode_const(
                &mut encoder,
                "watch_tail_lag_commits",
                "Commits this process's log has made that the watch tail has not read yet",
                committed.saturating_sub(tail.head.commit),
                false,
            )?;
        }
        Ok(())
    }
}

/// Reads what the metrics count in the database (see [`Refreshed`]) every
/// [`METRICS_REFRESH_MS`], the first at once, until `shutdown` turns true. A failed reading is
/// logged, and the last one stays.
pub async fn refresh(
    metrics: Arc<Metrics>,
    store: Arc<dyn bc_core::store::EventStore>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        match read_refreshed(&*store).await {
            Ok(read) => *metrics.live.refreshed.lock().unwrap_or_else(|e| e.into_inner()) = Some(read),
            Err(e) => tracing::warn!(code = %e.code(), error = %e, "reading the metrics' counts failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_millis(METRICS_REFRESH_MS)) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
    }
}

/// One reading: the heads (one query), the newest checkpoint of the [`TENANTS_SHOWN_MAX`]
/// longest chains (one row each), and each outbox consumer's counts.
async fn read_refreshed(store: &dyn bc_core::store::EventStore) -> bc_core::Result<Refreshed> {
    let mut heads = store.heads().await?;
    let tenants = heads.len() as u64;
    heads.sort_by(|a, b| b.1.seq.cmp(&a.1.seq).then(a.0.cmp(&b.0)));
    let mut top = Vec::with_capacity(TENANTS_SHOWN_MAX.min(heads.len()));
    for (tenant, head) in heads.into_iter().take(TENANTS_SHOWN_MAX) {
        let sealed = bc_core::audit::newest_checkpoint(store, tenant).await?.map_or(0, |cp| cp.size);
        top.push((tenant.to_string(), head.seq, head.seq.saturating_sub(sealed)));
    }
    let mut outbox = Vec::with_capacity(OUTBOX_CONSUMERS.len());
    for consumer in OUTBOX_CONSUMERS {
        let (pending, _done, dead) = store.work_counts(consumer).await?;
        outbox.push((consumer, pending, dead));
    }
    Ok(Refreshed { tenants, top, outbox })
}

/// The `Log`'s totals (`LogStats`), read at each scrape; registered under the backend's label.
#[derive(Debug)]
struct LogTotals(Arc<Live>);

impl Collector for LogTotals {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(state) = self.0.state.get().and_then(Weak::upgrade) else { return Ok(()) };
        let [batches, events, _, _, _, stale] = state.log.stats.snapshot();
        encode_const(&mut encoder, "log_events_appended", "Events appended by this process's log", events, true)?;
        encode_const(&mut encoder, "log_batches", "Append batches committed by this process", batches, true)?;
        encode_const(
            &mut encoder,
            "log_stale_batches",
            "Append batches decided again because another process moved a chain head",
            stale,
            true,
        )?;
        Ok(())
    }
}

impl Metrics {
    /// The metrics of a process whose store is `backend` (`sqlite`, `postgres`).
    pub fn new(backend: &'static str) -> Self {
        let mut registry = Registry::with_prefix(METRICS_PREFIX);
        let http_requests = Family::<HttpLabels, Counter>::default();
        registry.register("http_requests", "HTTP requests answered, by method and status code", http_requests.clone());
        let http_duration = HistogramFamily::<HttpLabels>::new_with_constructor(http_histogram);
        registry.register_with_unit(
            "http_request_duration",
            "Time from a request's arrival to its response's head, by method and status code",
            Unit::Seconds,
            http_duration.clone(),
        );
        let reconciler_passes = Family::<PassLabels, Counter>::default();
        registry.register(
            "reconciler_passes",
            "Reconciler passes in this process, by reconciler and outcome",
            reconciler_passes.clone(),
        );
        let reconciler_duration = HistogramFamily::<ReconcilerLabels>::new_with_constructor(reconciler_histogram);
        registry.register_with_unit(
            "reconciler_pass_duration",
            "How long a reconciler's pass took",
            Unit::Seconds,
            reconciler_duration.clone(),
        );
        let outbox_items = Family::<OutboxLabels, Counter>::default();
        registry.register(
            "outbox_items",
            "Outbox items attempted and recorded, by consumer and outcome (done, retried, dead, lost)",
            outbox_items.clone(),
        );
        let outbox_attempt_duration = HistogramFamily::<ConsumerLabels>::new_with_constructor(outbox_histogram);
        registry.register_with_unit(
            "outbox_attempt_duration",
            "How long one attempt at an outbox item took (a webhook delivery: connect, send, answer)",
            Unit::Seconds,
            outbox_attempt_duration.clone(),
        );
        let agent_heartbeats = Counter::default();
        registry.register("agent_heartbeats", "Heartbeats received from agents' sessions", agent_heartbeats.clone());
        let agent_heartbeat_gap = Histogram::new(HEARTBEAT_GAP_BUCKETS_S);
        registry.register_with_unit(
            "agent_heartbeat_gap",
            "Time between two heartbeats of one session: the asked interval, or more when a node or its network is slow",
            Unit::Seconds,
            agent_heartbeat_gap.clone(),
        );
        let agent_journal_entries = Family::<EntryLabels, Counter>::default();
        registry.register(
            "agent_journal_entries",
            "Journal entries received from agents, by outcome (appended, refused)",
            agent_journal_entries.clone(),
        );
        let agent_journal_append = Histogram::new(JOURNAL_APPEND_BUCKETS_S);
        registry.register_with_unit(
            "agent_journal_append_duration",
            "How long a journal entry took from its arrival to its acknowledgement (checked and appended once)",
            Unit::Seconds,
            agent_journal_append.clone(),
        );
        let live = Arc::new(Live::default());
        registry.register_collector(Box::new(live.clone()));
        let log = Arc::new(LogMetrics {
            batch_events: Histogram::new(LOG_BATCH_EVENTS_BUCKETS),
            commit_seconds: Histogram::new(LOG_COMMIT_BUCKETS_S),
        });
        let by_backend = registry.sub_registry_with_label(("backend".into(), backend.into()));
        by_backend.register_collector(Box::new(LogTotals(live.clone())));
        by_backend.register("log_batch_events", "Events per committed append batch", log.batch_events.clone());
        by_backend.register_with_unit(
            "log_commit_duration",
            "How long a batch's commit took",
            Unit::Seconds,
            log.commit_seconds.clone(),
        );
        Self {
            registry,
            http_requests,
            http_duration,
            reconciler_passes,
            reconciler_duration,
            outbox_items,
            outbox_attempt_duration,
            agent_heartbeats,
            agent_heartbeat_gap,
            agent_journal_entries,
            agent_journal_append,
            log,
            live,
        }
    }

    /// What the `Log` reports its batches to (`LogStats::observe`).
    pub fn log_observer(&self) -> Arc<LogMetrics> {
        self.log.clone()
    }

    /// Reads the server's state at each scrape from now on (the first call wins).
    pub fn watch_state(&self, state: &Arc<AppState>) {
        let _ = self.live.state.set(Arc::downgrade(state));
    }

    /// Counts the agents' sessions at each scrape from now on (the first call wins).
    pub fn watch_sessions(&self, sessions: &Arc<Sessions>) {
        let _ = self.live.sessions.set(Arc::downgrade(sessions));
    }

    /// One reconciler pass, `ok` or not, of `duration`.
    pub fn reconciler_pass(&self, reconciler: &'static str, ok: bool, duration: std::time::Duration) {
        let outcome = if ok { "ok" } else { "error" };
        self.reconciler_passes.get_or_create(&PassLabels { reconciler, outcome }).inc();
        self.reconciler_duration.get_or_create(&ReconcilerLabels { reconciler }).observe(duration.as_secs_f64());
    }

    /// What the `sandboxes` reconciler's pass read: the sandboxes not yet deleted, and the warm
    /// ones among them (`sandboxes_live`, `sandboxes_warm`, from then on).
    pub fn sandboxes_seen(&self, live: u64, warm: u64) {
        *self.live.sandboxes.lock().unwrap_or_else(|e| e.into_inner()) = Some((live, warm));
    }

    /// An outbox item's attempt recorded with `outcome`, the attempt taking `latency`.
    pub fn outbox_completed(&self, consumer: &'static str, outcome: &'static str, latency: std::time::Duration) {
        self.outbox_items.get_or_create(&OutboxLabels { consumer, outcome }).inc();
        self.outbox_attempt_duration.get_or_create(&ConsumerLabels { consumer }).observe(latency.as_secs_f64());
    }

    /// A heartbeat from an agent's session, `gap` after the one before it (none for a session's
    /// first).
    pub fn agent_heartbeat(&self, gap: Option<std::time::Duration>) {
        self.agent_heartbeats.inc();
        if let Some(gap) = gap {
            self.agent_heartbeat_gap.observe(gap.as_secs_f64());
        }
    }

    /// A journal entry acknowledged (`appended`) or refused, `took` from its arrival.
    pub fn agent_journal_entry(&self, appended: bool, took: std::time::Duration) {
        let outcome = if appended { "appended" } else { "refused" };
        self.agent_journal_entries.get_or_create(&EntryLabels { outcome }).inc();
        if appended {
            self.agent_journal_append.observe(took.as_secs_f64());
        }
    }

    /// One answered request.
    fn request(&self, method: &axum::http::Method, code: u16, duration: std::time::Duration) {
        let method = HTTP_METHODS.iter().copied().find(|m| *m == method.as_str()).unwrap_or("other");
        let labels = HttpLabels { method, code };
        self.http_requests.get_or_create(&labels).inc();
        self.http_duration.get_or_create(&labels).observe(duration.as_secs_f64());
    }

    /// Every metric, in OpenMetrics (`openmetrics`) or the Prometheus text format 0.0.4.
    pub fn encode(&self, openmetrics: bool) -> String {
        let mut text = String::with_capacity(16 * 1024);
        let written = if openmetrics {
            prometheus_client::encoding::text::encode(&mut text, &self.registry)
        } else {
            prometheus_client::encoding::prometheus_text::encode(&mut text, &self.registry)
        };
        // Writing to a String fails only if a metric's own encoding does, which none here can.
        if let Err(e) = written {
            tracing::error!(error = %e, "the metrics could not be encoded");
        }
        text
    }

    /// The layer's function: counts every request the router answers, with its latency to the
    /// response's head.
    pub async fn track(State(metrics): State<Arc<Metrics>>, request: Request, next: Next) -> Response {
        let method = request.method().clone();
        let started = Instant::now();
        let response = next.run(request).await;
        metrics.request(&method, response.status().as_u16(), started.elapsed());
        response
    }
}

/// Whether a scraper asked for OpenMetrics.
fn wants_openmetrics(headers: &HeaderMap) -> bool {
    headers.get_all(header::ACCEPT).iter().any(|v| v.to_str().is_ok_and(|v| v.contains("application/openmetrics-text")))
}

/// `GET /metrics`.
pub async fn metrics(State(metrics): State<Arc<Metrics>>, headers: HeaderMap) -> Response {
    let openmetrics = wants_openmetrics(&headers);
    let content_type =
        if openmetrics { OPENMETRICS_CONTENT_TYPE } else { prometheus_client::encoding::prometheus_text::CONTENT_TYPE };
    ([(header::CONTENT_TYPE, content_type)], metrics.encode(openmetrics)).into_response()
}

/// A router serving `/metrics` alone, for `--metrics-listen`.
pub fn router(metrics: Arc<Metrics>) -> axum::Router {
    axum::Router::new().route("/metrics", axum::routing::get(self::metrics)).with_state(metrics)
}

/// Serves [`router`] on `listener` (`--metrics-listen`) until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics)).with_graceful_shutdown(shutdown).await
}
