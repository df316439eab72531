//! Health for machines: `GET /healthz` (live) and `GET /readyz` (ready), and the agents'
//! endpoint's `grpc.health.v1.Health` status, all from one readiness check ([`ready`]).
//!
//! - `/healthz` answers `200 ok` (text) while the process serves HTTP at all: a load balancer's
//!   or Kubernetes' liveness probe. It reads nothing.
//! - `/readyz` answers `200` with the checks when the process can do its work, and `503` with
//!   the checks and the names of those that failed (`failed`) otherwise: the database answers
//!   within [`READY_CHECK_TIMEOUT_MS`], its migrations are the ones this binary knows, and the log
//!   key this process signs with is registered in it.
//!
//! Both are outside authentication and the request limit (`lib.rs::router`), so a probe is
//! answered while the API is saturated.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use crate::AppState;

/// How long each readiness check may take before it counts as failed.
pub const READY_CHECK_TIMEOUT_MS: u64 = 2_000;
/// How often the agents' endpoint checks readiness again for its gRPC health status.
pub const GRPC_HEALTH_INTERVAL_MS: u64 = 5_000;

/// The checks' names, in the order they run.
pub const CHECK_DATABASE: &str = "database";
pub const CHECK_MIGRATIONS: &str = "migrations";
pub const CHECK_LOG_KEY: &str = "logKey";

/// What [`ready`] found.
#[derive(Debug)]
pub struct Readiness {
    /// Each check's name and its failure, if it failed.
    pub checks: Vec<(&'static str, Option<String>)>,
    /// The newest commit, when the database answered.
    pub last_commit: Option<u64>,
}

impl Readiness {
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|(_, failure)| failure.is_none())
    }

    fn body(&self, state: &AppState) -> Value {
        let mut checks = Map::new();
        for (name, failure) in &self.checks {
            let check = match failure {
                None => json!({ "ok": true }),
                Some(message) => json!({ "ok": false, "message": message }),
            };
            checks.insert((*name).to_owned(), check);
        }
        let failed: Vec<&str> = self.checks.iter().filter(|(_, f)| f.is_some()).map(|(n, _)| *n).collect();
        let mut body = json!({
            "status": if failed.is_empty() { "ready" } else { "not ready" },
            "backend": state.store.backend(),
            "checks": checks,
        });
        if !failed.is_empty() {
            body["failed"] = json!(failed);
        }
        if let Some(commit) = self.last_commit {
            body["lastCommit"] = json!(commit);
        }
        body
    }
}

/// One check under [`READY_CHECK_TIMEOUT_MS`]: its failure's public message, if any.
async fn check<T>(what: &str, future: impl std::future::Future<Output = bc_core::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(Duration::from_millis(READY_CHECK_TIMEOUT_MS), future).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(format!("{what}: {}", e.public_message())),
        Err(_) => Err(format!("{what}: no answer within {READY_CHECK_TIMEOUT_MS} ms")),
    }
}

/// Runs the readiness checks in order; after a failed database check the others are reported
/// as not run.
pub async fn ready(state: &AppState) -> Readiness {
    let store = &state.store;
    let last_commit = match check("the database does not answer", store.last_commit()).await {
        Ok(commit) => commit,
        Err(failure) => {
            let skipped = || Some("not checked: the database does not answer".to_owned());
            return Readiness {
                checks: vec![(CHECK_DATABASE, Some(failure)), (CHECK_MIGRATIONS, skipped()), (CHECK_LOG_KEY, skipped())],
                last_commit: None,
            };
        }
    };
    let migrations = check("the schema is not current", store.check_schema()).await.err();
    let key = &state.log.key;
    let log_key = match check("the log keys cannot be read", store.signing_keys()).await {
        Ok(keys) if keys.iter().any(|(id, public)| id == key.key_id() && public[..] == key.public().as_bytes()[..]) => None,
        Ok(_) => Some(format!("the log key {} is not registered in the database", key.key_id())),
        Err(failure) => Some(failure),
    };
    Readiness {
        checks: vec![(CHECK_DATABASE, None), (CHECK_MIGRATIONS, migrations), (CHECK_LOG_KEY, log_key)],
        last_commit: Some(last_commit),
    }
}

/// `GET /healthz`: live.
pub async fn healthz() -> &'static str {
    "ok"
}

/// `GET /readyz`: ready, or `503` naming what is not.
pub async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let readiness = ready(&state).await;
    let status = if readiness.ok() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(readiness.body(&state))).into_response()
}

/// Keeps the agents' service's `grpc.health.v1` status (`service`, and the server's overall
/// `""`) to readiness, checked every [`GRPC_HEALTH_INTERVAL_MS`], until the task is aborted.
pub async fn report_grpc_health(state: Arc<AppState>, reporter: tonic_health::server::HealthReporter, service: &'static str) {
    use tonic_health::ServingStatus;
    let mut was = None;
    loop {
        let readiness = ready(&state).await;
        let now = if readiness.ok() { ServingStatus::Serving } else { ServingStatus::NotServing };
        if was != Some(now) {
            if now == ServingStatus::NotServing {
                let failed: Vec<&str> = readiness.checks.iter().filter(|(_, f)| f.is_some()).map(|(n, _)| *n).collect();
                tracing::warn!(?failed, "not ready: the agents' endpoint reports NOT_SERVING");
            }
            reporter.set_service_status("", now).await;
            reporter.set_service_status(service, now).await;
            was = Some(now);
        }
        tokio::time::sleep(Duration::from_millis(GRPC_HEALTH_INTERVAL_MS)).await;
    }
}
