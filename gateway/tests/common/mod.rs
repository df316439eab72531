//! What the gateway's in-process tests share: a router over a `Log`, with the root tenant's
//! first administrator token.

use std::sync::Arc;

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
