//! The gateway on a fresh SQLite database, served in the bench's own process on loopback,
//! with the root administrator's token: what the benches that measure the API from outside
//! share (`watch`, `log_growth`, `agents`).

use std::path::Path;
use std::sync::{Arc, Mutex};

use bc_core::clock::SystemClock;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log};
use bc_gateway::AppState;
use bc_projections::Projections;

// Each bench reads the fields it needs (`watch` only the URL and token).
#[allow(dead_code)]
pub struct InProcess {
    pub log: Arc<Log>,
    pub store: Arc<dyn EventStore>,
    pub key: Arc<LogKey>,
    pub state: Arc<AppState>,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The root administrator's token.
    pub token: String,
}

/// Opens (and migrates) the database at `path`, bootstraps the root tenant, lets `configure`
/// change the state (limits) and serves HTTP on a free loopback port, on the current runtime.
pub async fn start(path: &Path, configure: impl FnOnce(&mut AppState)) -> InProcess {
    let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(path).await.unwrap());
    store.migrate().await.unwrap();
    let key = Arc::new(LogKey::generate());
    let log = Arc::new(Log::open(store.clone(), Arc::new(Projections), key.clone(), Arc::new(SystemClock)).await.unwrap());
    let token = Arc::new(Mutex::new(String::new()));
    let keep = token.clone();
    bc_gateway::bootstrap_root(
        &log,
        move |t| {
            *keep.lock().unwrap() = t.to_owned();
            Ok(())
        },
        || {},
    )
    .await
    .unwrap();
    let token = token.lock().unwrap().clone();
    let mut state = AppState::new(log.clone());
    // The benches measure what the server carries, not the per-key rate limit.
    state.rate_limiter = Arc::new(bc_gateway::rate_limit::RateLimiter::new(bc_gateway::rate_limit::RateLimits::off()));
    configure(&mut state);
    let state = Arc::new(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(bc_gateway::serve(listener, state.clone(), std::future::pending()));
    InProcess { log, store, key, state, url, token }
}
