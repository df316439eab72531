//! What the gateway's in-process tests share: a router over a `Log`, with the root tenant's
//! first administrator token, and a call through it.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, header};
use serde_json::Value;
use tower::ServiceExt;

use bc_core::store::Log;
use bc_gateway::AppState;

/// Bootstraps the root tenant on `log` and returns the router and the administrator's token.
pub async fn gateway_over(log: &Arc<Log>) -> (axum::Router, String) {
    let token = std::sync::Mutex::new(String::new());
    let keep = |t: &str| {
        *token.lock().unwrap() = t.to_owned();
        Ok(())
    };
    bc_gateway::bootstrap_root(log, keep, || {}).await.unwrap();
    let router = bc_gateway::router(Arc::new(AppState::new(log.clone())));
    (router, token.into_inner().unwrap())
}

/// `POST /api/compute/{method}` with `body` as `token`: the status and the JSON answer.
#[allow(dead_code)] // not every test file calls it
pub async fn call(router: &axum::Router, token: &str, method: &str, body: Value) -> (u16, Value) {
    let request = Request::post(format!("/api/compute/{method}"))
        .header(header::AUTHORIZATION, format!("Bearer {token}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}
