//! `bc-gateway`: the HTTP face of the control plane.
//!
//! Layout:
//! - `lib.rs` (this file): the shared state, the router, health, serving, and bootstrap of the
//!   root tenant;
//! - [`rpc`]: the one handler of `POST /api/compute/{method}`: it finds the method in the
//!   table, authenticates, reads the body and runs the method's handler;
//! - [`api`]: the method table, one file per API group, what the handlers share (the call,
//!   body parsing, validators, paging) and the wire views;
//! - [`openapi`]: the OpenAPI document, generated from the table (checked in as
//!   `gateway/openapi.json`);
//! - [`audit`]: `GET /audit/{tenant}/checkpoint` and `…/tile/…`, the tree as C2SP tlog-tiles;
//!   `…/keys` and `…/rotations`, what a monitor holding a pin needs to follow a key rotation;
//! - [`watch`]: `GET /watch`, the live stream over server-sent events, served from one shared
//!   tail of the log per process (`watch::tail`);
//! - [`auth`]: API keys, tokens, actions; [`rate_limit`]: a token bucket per key and per
//!   tenant (`RATE_LIMITED`, `429` with `Retry-After`);
//! - [`error`]: the `{code, message, details}` envelope and status mapping;
//! - [`conn`]: the connections' limits (header, idle, body and write deadlines; the cap on open
//!   connections), served with hyper-util's `auto::Builder`;
//! - [`agents`]: the gRPC endpoint of the node agents (`bcd`): joins and sessions, on a
//!   listener of its own with a pinned TLS certificate; [`node_ca`]: the node CA, whose
//!   certificates the endpoint asks each node for (mutual TLS), renewed and revoked;
//! - [`join_keys`]: the join signing and encryption keys, and `GET /.well-known/better-compute`,
//!   the signed document a machine joins from (`bcd join --server`);
//! - [`metrics`]: `GET /metrics` for Prometheus; [`health`]: `GET /healthz` and `GET /readyz`,
//!   and the agents' endpoint's gRPC health status.
//!
//! Architecture invariant: this crate is the only one that knows HTTP and serves gRPC. It talks to storage only
//! through `bc_core::store`.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bc_core::id::{ApiKeyId, TenantId};
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{KIND_API_KEY, KIND_TENANT, stream_of};

pub mod agents;
pub mod api;
pub mod app;
pub mod audit;
pub mod auth;
pub mod conn;
pub mod error;
pub mod health;
pub mod join_keys;
pub mod metrics;
pub mod node_ca;
pub mod openapi;
pub mod rate_limit;
pub mod rpc;
pub mod ssh_ca;
pub mod tpm;
pub mod tunnels;
pub mod watch;

use error::ApiError;

/// Largest request body, in bytes.
pub const BODY_BYTES_MAX: usize = 1024 * 1024;
/// Longest `Idempotency-Key` header.
pub const IDEMPOTENCY_KEY_BYTES_MAX: usize = 128;
/// A request taking longer than this is answered `UNAVAILABLE`.
pub const REQUEST_TIMEOUT_S: u64 = 30;
/// Requests served at once, so a burst queues instead of exhausting memory and connections.
pub const CONCURRENT_REQUESTS_MAX: usize = 1024;

/// What every request shares.
pub struct AppState {
    pub log: Arc<Log>,
    pub store: Arc<dyn EventStore>,
    /// Connected watchers, bounded in total, per tenant and per key (`watch::WATCHERS_*`).
    pub watchers: Arc<watch::WatcherSlots>,
    /// The one tail of the log every caught-up watcher is served from (`watch::tail`), started
    /// by the first watcher.
    pub watch_tail: Arc<watch::Tail>,
    /// Set when the server stops: long-lived streams end so the graceful shutdown can finish.
    pub shutdown: tokio::sync::watch::Sender<bool>,
    /// Which webhook receivers this deployment accepts.
    pub webhook_policy: bc_core::webhook::EndpointPolicy,
    /// Where BMCs may be reached (`--bmc-allow-network`): an enrolled address literal is
    /// checked against it (a name when the reconciler connects).
    pub bmc_networks: bc_bmc::BmcNetworks,
    /// This process's view of the nodes, for placement.
    pub fleet: Arc<bc_projections::fleet::Fleet>,
    /// The connections' and requests' limits (`dev`/`serve` flags).
    pub limits: ServeLimits,
    /// Full tiles computed once (`bc_core::tiles`: bounded, never stale).
    pub tiles: Arc<bc_core::tiles::TileSource>,
    /// The key rotations' proofs, computed once per root checkpoint (`bc_core::audit`).
    pub rotations: Arc<bc_core::audit::RotationSource>,
    /// Held from the read of a tenant's names to the append of a new one (`flavors.create`,
    /// `images.register`), so two creates of one name in this process cannot both pass the
    /// check. Striped by tenant: bounded, and one tenant's creates rarely wait on another's.
    pub name_locks: Arc<NameLocks>,
    /// The release keys `releases.register` trusts (`--release-key`): none, no release is taken.
    pub release_keys: Arc<Vec<bc_core::release::ReleasePublicKey>>,
    /// The API keys found live lately (`auth::KEY_CACHE_TTL`).
    pub keys: Arc<auth::KeyCache>,
    /// Each API key's and tenant's token bucket (`rate_limit.rs`, `limits.rate`).
    pub rate_limiter: Arc<rate_limit::RateLimiter>,
    /// The tunnels of this process: tickets, the nodes' sessions here, open counts
    /// (`schema/TUNNELS.md`).
    pub tunnels: Arc<tunnels::Tunnels>,
    /// The deployment's SSH user CAs (`nodes.issueSshCert` signs with the current one; each
    /// agent's session carries the keys trusted now); none: certificates are refused
    /// `UNAVAILABLE`.
    pub ssh_user_ca: Option<Arc<ssh_ca::SshUserCaRing>>,
    /// The deployment's node CA (`node_ca.rs`): node certificates at join and renewal, and
    /// the revoked set the agents' TLS layer checks; none: joins issue no certificate.
    pub node_ca: Option<Arc<node_ca::NodeCa>>,
    /// The deployment's join keys (`join_keys.rs`): a sealed join token is opened with the
    /// encryption key and every join answer is signed with the signing key; none: only plain
    /// tokens are taken and answers carry no join signature.
    pub join_keys: Option<Arc<join_keys::JoinKeys>>,
    /// The signed document `GET /.well-known/better-compute` serves; none (`NOT_FOUND`): this
    /// process names no agents' endpoint.
    pub well_known: Option<Arc<join_keys::WellKnownDocument>>,
    /// Take a join token only sealed to the join encryption key (`--agents-sealed-joins-only`):
    /// a plain one is refused before it is looked at, so no proxy in front of the agents'
    /// endpoint ever carries a usable token.
    pub sealed_joins_only: bool,
    /// TPM joins (`--tpm-ek-ca-bundle`, `--tpm-join-pool`: `agents::tpm_join`): the EK CA bundle
    /// and the pool; none: `bcd join --attestor tpm` is refused `TPM_NOT_CONFIGURED`.
    pub tpm_joins: Option<Arc<agents::tpm_join::TpmJoins>>,
    /// This process's metrics (`metrics.rs`): the log reports its batches to them from the start.
    pub metrics: Arc<metrics::Metrics>,
    /// Whether the API's router serves `GET /metrics` (not when `--metrics-listen` serves them
    /// on an address of their own).
    pub metrics_on_api: bool,
    /// Whether this process serves the API (`serve --roles`: the `api` role). Without it the
    /// HTTP listener answers only the probes and the scrape, and every other path
    /// `UNSUPPORTED` (`api-not-served`), so a load balancer sent here by mistake says so.
    pub api_served: bool,
    /// The approvers' quorum (`dev`/`serve --approvers`): the calls
    /// `bc_projections::decide::batch::batch_required` names go through a destructive batch.
    pub batch_quorum: bool,
}

/// Stripes of [`NameLocks`]: a bound on the locks, whatever the number of tenants.
pub const NAME_LOCK_STRIPES: usize = 64;

/// A bounded set of locks, one chosen per tenant.
pub struct NameLocks([tokio::sync::Mutex<()>; NAME_LOCK_STRIPES]);

impl NameLocks {
    pub fn new() -> Self {
        Self(std::array::from_fn(|_| tokio::sync::Mutex::new(())))
    }

    /// The lock of `tenant`'s stripe.
    pub async fn lock(&self, tenant: TenantId) -> tokio::sync::MutexGuard<'_, ()> {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        tenant.hash(&mut hasher);
        self.0[(hasher.finish() % NAME_LOCK_STRIPES as u64) as usize].lock().await
    }
}

impl Default for NameLocks {
    fn default() -> Self {
        Self::new()
    }
}

/// The limits of serving; `conn.rs` says what each bounds. The defaults are the named constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeLimits {
    /// A write making no progress this long fails (`--write-stall`).
    pub write_stall: Duration,
    /// A request's head must arrive within this (`--header-timeout`).
    pub header_read_timeout: Duration,
    /// A connection carrying nothing this long is closed (`--idle-timeout`).
    pub idle_timeout: Duration,
    /// A request body must arrive within this once read (`--body-timeout`).
    pub body_read_timeout: Duration,
    /// Connections open at once (`--connections-max`).
    pub connections_max: usize,
    /// Requests served at once.
    pub requests_max: usize,
    /// Watchers connected at once, in all, per tenant and per key (`--watchers-max`,
    /// `--watchers-per-tenant-max`, `--watchers-per-key-max`).
    pub watchers: watch::WatcherLimits,
    /// Tunnels open at once per tenant, key and node, and how long one may idle or last
    /// (`--tunnels-per-tenant-max`, `--tunnels-per-key-max`, `--tunnels-per-node-max`,
    /// `--tunnel-idle-timeout`, `--tunnel-max-duration`).
    pub tunnels: tunnels::TunnelLimits,
    /// Requests a second per API key and per tenant (`--rate-per-key`, `--burst-per-key`,
    /// `--rate-per-tenant`, `--burst-per-tenant`).
    pub rate: rate_limit::RateLimits,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            write_stall: Duration::from_secs(conn::WRITE_STALL_S),
            header_read_timeout: Duration::from_secs(conn::HEADER_READ_TIMEOUT_S),
            idle_timeout: Duration::from_secs(conn::IDLE_TIMEOUT_S),
            body_read_timeout: Duration::from_secs(conn::BODY_READ_TIMEOUT_S),
            connections_max: conn::CONNECTIONS_MAX,
            requests_max: CONCURRENT_REQUESTS_MAX,
            watchers: watch::WatcherLimits::default(),
            tunnels: tunnels::TunnelLimits::default(),
            rate: rate_limit::RateLimits::default(),
        }
    }
}

impl AppState {
    /// Authorizes `action` on `tenant` for `principal`, and checks that a tenant other than the
    /// caller's own exists (the root tenant's administrators may name any).
    pub async fn authorize_tenant(&self, principal: &auth::Principal, action: &str, tenant: TenantId) -> Result<()> {
        principal.authorize(action, tenant)?;
        if tenant != principal.tenant
            && self.store.row_get(&tenant.to_string(), KIND_TENANT, &tenant.to_string()).await?.is_none()
        {
            return Err(Error::not_found(format!("tenant {tenant}")));
        }
        Ok(())
    }

    pub fn new(log: Arc<Log>) -> Self {
        let metrics = Arc::new(metrics::Metrics::new(log.store.backend()));
        log.stats.observe(metrics.log_observer());
        Self {
            store: log.store.clone(),
            log,
            watchers: watch::WatcherSlots::new(watch::WatcherLimits::default()),
            watch_tail: watch::Tail::new(watch::TailLimits::default()),
            shutdown: tokio::sync::watch::channel(false).0,
            webhook_policy: bc_core::webhook::EndpointPolicy::default(),
            bmc_networks: bc_bmc::BmcNetworks::default(),
            fleet: Arc::new(bc_projections::fleet::Fleet::new()),
            limits: ServeLimits::default(),
            tiles: Arc::new(bc_core::tiles::TileSource::new()),
            rotations: Arc::new(bc_core::audit::RotationSource::default()),
            name_locks: Arc::new(NameLocks::new()),
            release_keys: Arc::new(Vec::new()),
            keys: Arc::new(auth::KeyCache::default()),
            rate_limiter: Arc::new(rate_limit::RateLimiter::new(rate_limit::RateLimits::default())),
            tunnels: tunnels::Tunnels::new(tunnels::TunnelLimits::default()),
            ssh_user_ca: None,
            node_ca: None,
            join_keys: None,
            sealed_joins_only: false,
            tpm_joins: None,
            well_known: None,
            metrics,
            metrics_on_api: true,
            api_served: true,
            batch_quorum: false,
        }
    }

    pub fn with_ssh_user_ca(mut self, ring: ssh_ca::SshUserCaRing) -> Self {
        self.ssh_user_ca = Some(Arc::new(ring));
        self
    }

    pub fn with_node_ca(mut self, ca: Arc<node_ca::NodeCa>) -> Self {
        self.node_ca = Some(ca);
        self
    }

    pub fn with_join_keys(mut self, keys: Arc<join_keys::JoinKeys>, document: Option<join_keys::WellKnownDocument>) -> Self {
        self.join_keys = Some(keys);
        self.well_known = document.map(Arc::new);
        self
    }

    pub fn with_sealed_joins_only(mut self, sealed_only: bool) -> Self {
        self.sealed_joins_only = sealed_only;
        self
    }

    pub fn with_tpm_joins(mut self, joins: Option<agents::tpm_join::TpmJoins>) -> Self {
        self.tpm_joins = joins.map(Arc::new);
        self
    }

    pub fn with_release_keys(mut self, keys: Vec<bc_core::release::ReleasePublicKey>) -> Self {
        self.release_keys = Arc::new(keys);
        self
    }

    pub fn with_bmc_networks(mut self, networks: bc_bmc::BmcNetworks) -> Self {
        self.bmc_networks = networks;
        self
    }

    pub fn with_webhook_policy(mut self, policy: bc_core::webhook::EndpointPolicy) -> Self {
        self.webhook_policy = policy;
        self
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    state.metrics.watch_state(&state);
    // Probes and scrapes outside authentication and the request limit (`health.rs`).
    let mut outside =
        Router::new().route("/healthz", get(health::healthz)).route("/readyz", get(health::readyz)).with_state(state.clone());
    if state.metrics_on_api {
        outside = outside.merge(metrics::router(state.metrics.clone()));
    }
    let api = if state.api_served { api_router(state.clone()) } else { Router::new().fallback(api_not_served) };
    outside.merge(api).layer(axum::middleware::from_fn_with_state(state.metrics.clone(), metrics::Metrics::track))
}

/// The API's routes, under its limits.
fn api_router(state: Arc<AppState>) -> Router {
    let requests_max = state.limits.requests_max;
    Router::new()
        // `GET /tunnels/{ticket}` under the same limits as the API: the upgrade waits for the
        // node's agent to attach (at most `tunnels::AGENT_ATTACH_TIMEOUT_MS`) holding a request
        // slot, and lets it go with the `101` (the upgraded tunnel is bounded by its own flags).
        // The ticket is a secret: the trace layer's span names the route, never the path.
        .route("/tunnels/{ticket}", get(tunnels::upgrade))
        .route("/api/compute/openapi.json", get(openapi))
        .route(bc_core::well_known::WELL_KNOWN_PATH, get(well_known))
        // `POST /api/compute/{method}` is dispatched by the fallback (`rpc::dispatch`), not a
        // route: axum percent-decodes and copies a route's parameters (and rewrites a nested
        // service's URI) before any handler runs, so a 64 KB name would be worked over before
        // authentication; the fallback gets the request as it came.
        .route("/watch", get(watch::watch))
        .route("/audit/{tenant}/checkpoint", get(audit::checkpoint))
        .route("/audit/{tenant}/keys", get(audit::keys))
        .route("/audit/{tenant}/rotations", get(audit::rotations))
        .route("/audit/{tenant}/tile/{*rest}", get(audit::tile))
        .fallback(rpc::dispatch)
        .layer(
            tower::ServiceBuilder::new()
                .layer(tower_http::trace::TraceLayer::new_for_http().make_span_with(request_span))
                // One semaphore for every route: axum applies a layer to each route, and a plain
                // `ConcurrencyLimitLayer` would give each route a limit of its own.
                .layer(tower::limit::GlobalConcurrencyLimitLayer::new(requests_max))
                .layer(tower_http::timeout::TimeoutLayer::with_status_code(
                    StatusCode::SERVICE_UNAVAILABLE,
                    Duration::from_secs(REQUEST_TIMEOUT_S),
                )),
        )
        .with_state(state)
}

/// Every path but the probes' and the scrape's, in a process without the `api` role.
async fn api_not_served() -> Response {
    ApiError::from(Error::Unsupported {
        message: "this process does not serve the API (serve --roles without api)".into(),
        reason: "api-not-served".into(),
    })
    .into_response()
}

/// The trace layer's span of a request, as `DefaultMakeSpan` at `DEBUG` makes it (its method,
/// URI and version) but for a tunnel's, whose URI is only `/tunnels/{ticket}`: the ticket is a
/// secret.
fn request_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    let uri = request.uri();
    let shown: &dyn std::fmt::Display = if uri.path().starts_with("/tunnels/") { &"/tunnels/{ticket}" } else { uri };
    tracing::debug_span!("request", method = %request.method(), uri = %shown, version = ?request.version())
}

/// `GET /api/compute/openapi.json`: the API's OpenAPI document (public).
async fn openapi() -> Response {
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let body = DOCUMENT.get_or_init(openapi::document_text);
    ([(header::CONTENT_TYPE, "application/json")], body.clone()).into_response()
}

/// `GET /.well-known/better-compute`: the signed document a machine joins from (public;
/// docs/admission.md), or `NOT_FOUND` when this process names no agents' endpoint.
async fn well_known(axum::extract::State(state): axum::extract::State<Arc<AppState>>) -> Response {
    match &state.well_known {
        Some(document) => {
            ([(header::CONTENT_TYPE, "application/json"), (header::CACHE_CONTROL, "no-cache")], document.bytes.clone())
                .into_response()
        }
        None => ApiError::from(Error::NotFound {
            what: "well-known document (this process serves no agents' endpoint: serve it with the agents role)".into(),
        })
        .into_response(),
    }
}

pub(crate) async fn not_found() -> ApiError {
    Error::NotFound { what: "route (the API is POST /api/compute/GROUP.METHOD)".into() }.into()
}

/// Creates the root tenant and its first administrator key on a new database. `persist` is
/// given the token *before* the key is appended (so a crash can never leave a key whose token
/// was lost) and must store it durably; `unpersist` undoes that if the append then fails.
/// Returns whether a key was created. A root tenant without any key (a crash between the two
/// appends) gets one on the next start.
pub async fn bootstrap_root(log: &Log, persist: impl FnOnce(&str) -> Result<()>, unpersist: impl FnOnce()) -> Result<bool> {
    let root = TenantId::ROOT;
    let request = |stream: String, expected, event_type: &str, payload| AppendRequest {
        tenant: root,
        stream,
        expected,
        idempotency_key: None,
        actor: "system:bootstrap".into(),
        causation: None,
        correlation: None,
        fingerprint: None,
        guards: vec![],
        events: vec![NewEvent::new(event_type, payload)],
    };
    if log.store.row_get(&root.to_string(), KIND_TENANT, &root.to_string()).await?.is_none() {
        let tenant = ev::to_cbor(&ev::TenantCreated { name: "root".into(), root: true })?;
        match log.append(request(stream_of(KIND_TENANT, &root), ExpectedVersion::NoStream, ev::TENANT_CREATED, tenant)).await {
            Ok(_) => {}
            // Another server bootstrapped this database at the same moment.
            Err(Error::Conflict { .. }) => return Ok(false),
            Err(e) => return Err(e),
        }
    } else if !log.store.row_list(&root.to_string(), KIND_API_KEY, None, 1).await?.is_empty() {
        return Ok(false);
    }
    let key_id = ApiKeyId::from_ulid(log.ids.ulid());
    let (token, secret_sha256) = auth::new_token(key_id);
    persist(&token)?;
    // The hash lives in the secret store, not in the log (`auth.rs`).
    let secret_id = bc_projections::api_key_secret_id(&key_id.to_string());
    if let Err(e) = log.store.secret_put(root, &secret_id, &secret_sha256, log.clock.now_ms()).await {
        unpersist();
        return Err(e);
    }
    let key = ev::to_cbor(&ev::ApiKeyCreated { name: "admin".into(), actions: vec!["*".into()], secret_sha256: String::new() })?;
    if let Err(e) =
        log.append(request(stream_of(KIND_API_KEY, &key_id), ExpectedVersion::NoStream, ev::API_KEY_CREATED, key)).await
    {
        // A failure can still have committed (the connection dropped after COMMIT): keep the
        // token unless the key is certainly absent.
        if matches!(log.store.row_get(&root.to_string(), KIND_API_KEY, &key_id.to_string()).await, Ok(None)) {
            unpersist();
        }
        return Err(e);
    }
    Ok(true)
}

/// Serves until `shutdown` resolves, with the limits of `state.limits` (`conn.rs`): HTTP/1.1
/// and HTTP/2 over hyper-util's `auto::Builder` on tokio's timer, at most `connections_max`
/// connections at once. On shutdown it stops accepting, ends the watch streams, and waits for
/// every open response to finish (idle connections are closed at once).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let limits = state.limits;
    let app = router(state.clone());
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true)
        .max_buf_size(conn::HEAD_BYTES_MAX);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(conn::HTTP2_KEEP_ALIVE_S))
        .keep_alive_timeout(Duration::from_secs(conn::HTTP2_KEEP_ALIVE_S))
        .max_concurrent_streams(conn::HTTP2_STREAMS_MAX)
        .max_header_list_size(conn::HEAD_BYTES_MAX as u32);
    let deadlines =
        conn::Deadlines { write_stall: limits.write_stall, first_read: limits.header_read_timeout, idle: limits.idle_timeout };
    // So a burst of connections cannot exhaust file descriptors: the accept loop waits for a
    // slot, and the kernel's backlog holds the rest.
    let connections = Arc::new(tokio::sync::Semaphore::new(limits.connections_max));
    // What the metrics count in the database, read every `METRICS_REFRESH_MS` while serving.
    let refreshing = tokio::spawn(metrics::refresh(state.metrics.clone(), state.store.clone(), state.shutdown.subscribe()));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let shutdown = std::pin::pin!(shutdown);
    let mut shutdown = shutdown;
    loop {
        let permit = tokio::select! {
            permit = connections.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            stream = conn::accept(&listener) => stream,
            () = &mut shutdown => break,
        };
        // The peer's address, for the handlers that record it (`tunnel.opened`'s `from`).
        let peer = stream.peer_addr().ok();
        let io = TokioIo::new(conn::GuardedIo::new(stream, deadlines));
        let app = tower::ServiceExt::map_request(app.clone(), move |mut request: axum::http::Request<hyper::body::Incoming>| {
            if let Some(peer) = peer {
                request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
            }
            request
        });
        let service = hyper_util::service::TowerToHyperService::new(app);
        // With upgrades: `GET /tunnels/{ticket}` becomes a WebSocket.
        let connection = graceful.watch(builder.serve_connection_with_upgrades(io, service).into_owned());
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    // End the watch streams; the graceful shutdown waits for every open response.
    state.shutdown.send_replace(true);
    graceful.shutdown().await;
    refreshing.abort();
    Ok(())
}
