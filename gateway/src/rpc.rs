//! `POST /api/compute/{method}`: the one handler every method goes through. It finds the method
//! in [`crate::api::table`], authenticates before reading the body (so an anonymous caller
//! cannot make the server buffer it), checks the content type and the `Idempotency-Key`,
//! fingerprints the request for idempotent retries, and runs the method's handler.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use bc_core::Error;
use bc_core::id::RequestId;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use tracing::Instrument;

use crate::api::{self, Access, Call};
use crate::error::ApiError;
use crate::{AppState, BODY_BYTES_MAX, IDEMPOTENCY_KEY_BYTES_MAX, auth};

pub async fn rpc(State(state): State<Arc<AppState>>, Path(name): Path<String>, headers: HeaderMap, body: Body) -> Response {
    // From the deployment's id source: the request id is the events' correlation.
    let request_id = RequestId::from_ulid(state.log.ids.ulid()).to_string();
    let span = tracing::info_span!("rpc", method = %bc_core::id::truncate(&name, 64), request_id = %request_id);
    let mut response = match call(&state, &name, &headers, body, request_id.clone()).instrument(span).await {
        Ok(value) => axum::Json(value).into_response(),
        Err(e) => {
            let too_large = e.error.code() == bc_core::ErrorCode::PayloadTooLarge;
            let mut response = e.into_response();
            if too_large {
                // The rest of the body was never read: the connection cannot carry another request.
                response.headers_mut().insert(header::CONNECTION, axum::http::HeaderValue::from_static("close"));
            }
            response
        }
    };
    response.headers_mut().insert("x-request-id", request_id.parse().expect("ids are ASCII"));
    response
}

async fn call(
    state: &AppState,
    name: &str,
    headers: &HeaderMap,
    body: Body,
    request_id: String,
) -> Result<serde_json::Value, ApiError> {
    let method = api::find(name).ok_or_else(|| {
        ApiError::with_details(
            Error::NotFound { what: format!("method {:?}", bc_core::id::truncate(name, 64)) },
            match api::suggest(name) {
                Some(nearest) => json!({ "didYouMean": nearest }),
                None => json!({}),
            },
        )
    })?;
    let principal = match method.access {
        Access::Public => None,
        Access::Authenticated | Access::Action(_) => {
            let header = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
            Some(auth::authenticate(&*state.store, header).await?)
        }
    };
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("");
        if !ct.starts_with("application/json") {
            return Err(Error::invalid(format!(
                "content-type must be application/json, not {:?}",
                bc_core::id::truncate(ct, 60)
            ))
            .into());
        }
    }
    let bytes =
        axum::body::to_bytes(body, BODY_BYTES_MAX).await.map_err(|_| Error::PayloadTooLarge { limit_bytes: BODY_BYTES_MAX })?;
    let idempotency_key = match headers.get("idempotency-key") {
        None => None,
        Some(value) => {
            let key = value.to_str().map_err(|_| Error::invalid("Idempotency-Key must be printable ASCII"))?;
            if key.is_empty() || key.len() > IDEMPOTENCY_KEY_BYTES_MAX || !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(Error::invalid(format!(
                    "Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_BYTES_MAX} printable ASCII characters"
                ))
                .into());
            }
            Some(key.to_owned())
        }
    };
    let fingerprint = {
        // Key order and whitespace do not make a different request.
        let normalized = api::toolkit::body_json(&bytes).map(|v| v.to_string()).unwrap_or_default();
        let mut hasher = Sha256::new();
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(normalized.as_bytes());
        hasher.finalize().into()
    };
    let action = method.access.action().unwrap_or("");
    let call = Call { state, principal, action, idempotency_key, fingerprint, request_id };
    Ok((method.handler)(&call, &bytes).await?)
}
