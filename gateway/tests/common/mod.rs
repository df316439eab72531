//! What the gateway's in-process tests share: a log on a fresh SQLite file, the root tenant's
//! first administrator token, a router over a `Log`, and a call through it. Not every test file
//! uses every piece.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, header};
use bc_core::clock::SystemClock;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log};
use bc_gateway::AppState;
use serde_json::Value;
use tower::ServiceExt;

/// A log with the real projections and a fresh key on a new SQLite file in `dir`.
pub async fn sqlite_log(dir: &Path) -> Arc<Log> {
    let store = Arc::new(SqliteStore::open(&dir.join("log.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let store: Arc<dyn EventStore> = store;
    Arc::new(
        Log::open(store, Arc::new(bc_projections::Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock))
            .await
            .unwrap(),
    )
}

/// Bootstraps the root tenant on `log` and returns its first administrator's token.
pub async fn admin_token(log: &Arc<Log>) -> String {
    let token = std::sync::Mutex::new(String::new());
    let keep = |t: &str| {
        *token.lock().unwrap() = t.to_owned();
        Ok(())
    };
    bc_gateway::bootstrap_root(log, keep, || {}).await.unwrap();
    token.into_inner().unwrap()
}

/// Bootstraps the root tenant on `log` and returns the router and the administrator's token.
pub async fn gateway_over(log: &Arc<Log>) -> (axum::Router, String) {
    let token = admin_token(log).await;
    (bc_gateway::router(Arc::new(AppState::new(log.clone()))), token)
}

/// `POST /api/compute/{method}` with `body` as `token`: the status and the JSON answer.
pub async fn call(router: &axum::Router, token: &str, method: &str, body: Value) -> (u16, Value) {
    call_with(router, token, method, body, None).await
}

/// [`call`] with an `Idempotency-Key` when one is given.
pub async fn call_with(
    router: &axum::Router,
    token: &str,
    method: &str,
    body: Value,
    idempotency_key: Option<&str>,
) -> (u16, Value) {
    let mut request = Request::post(format!("/api/compute/{method}"))
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = idempotency_key {
        request = request.header("idempotency-key", key);
    }
    let response = router.clone().oneshot(request.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let status = response.status().as_u16();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// How long until the server closes `stream` (reading and dropping what it sends), at most
/// `within`; `None` if it is still open then.
pub async fn closed_after<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    within: std::time::Duration,
) -> Option<std::time::Duration> {
    use tokio::io::AsyncReadExt;
    let started = std::time::Instant::now();
    let mut sink = [0u8; 4096];
    let read = async {
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read).await.ok().map(|()| started.elapsed())
}
