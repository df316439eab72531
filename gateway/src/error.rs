//! The one error envelope of the HTTP API: `{code, message, details}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bc_core::{Error, ErrorCode};
use serde_json::{Value, json};

/// An API failure: the core error plus optional structured details for the client.
#[derive(Debug)]
pub struct ApiError {
    pub error: Error,
    pub details: Value,
    /// The request was answered before its body was read to the end, so the connection cannot
    /// carry another request: the answer says `Connection: close`.
    pub close: bool,
}

impl From<Error> for ApiError {
    fn from(error: Error) -> Self {
        let close = error.code() == ErrorCode::PayloadTooLarge;
        let details = match &error {
            Error::InvalidState { allowed, .. } => json!({ "allowed": allowed }),
            Error::Unsupported { reason, .. } => json!({ "reason": reason }),
            Error::RateLimited { retry_after_ms, .. } => json!({ "retryAfterMs": retry_after_ms }),
            // UNAVAILABLE either way; this one may have been written (its hint says how to
            // find out: the same request with the same Idempotency-Key).
            Error::Indeterminate(_) => json!({ "indeterminate": true }),
            _ => Value::Object(Default::default()),
        };
        Self { error, details, close }
    }
}

impl ApiError {
    pub fn with_details(error: Error, details: Value) -> Self {
        Self { details, ..Self::from(error) }
    }

    /// `error`, answered with `Connection: close`.
    pub fn closing(error: Error) -> Self {
        Self { close: true, ..Self::from(error) }
    }
}

pub fn status_of(code: ErrorCode) -> StatusCode {
    match code {
        ErrorCode::InvalidArgument => StatusCode::BAD_REQUEST,
        ErrorCode::NotFound => StatusCode::NOT_FOUND,
        ErrorCode::Conflict
        | ErrorCode::InvalidState
        | ErrorCode::IdempotencyConflict
        | ErrorCode::AlreadyExists
        | ErrorCode::PlanBlocked
        | ErrorCode::ConfigDrift => StatusCode::CONFLICT,
        ErrorCode::Unauthenticated => StatusCode::UNAUTHORIZED,
        ErrorCode::AccessDenied | ErrorCode::QuotaExceeded | ErrorCode::BatchRequired => StatusCode::FORBIDDEN,
        ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::RateLimited => StatusCode::TOO_MANY_REQUESTS,
        ErrorCode::Unsupported => StatusCode::NOT_IMPLEMENTED,
        ErrorCode::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::Corrupt | ErrorCode::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = self.error.code();
        // Bad input is the client's business; only broken invariants are errors here.
        match code {
            ErrorCode::Corrupt | ErrorCode::Internal => tracing::error!(error = %self.error, "request failed"),
            ErrorCode::Unavailable => tracing::warn!(error = %self.error, "request failed"),
            _ => tracing::debug!(code = %code, message = %self.error, "request refused"),
        }
        let mut details = self.details;
        if let (Some(hint), Value::Object(map)) = (self.error.hint(), &mut details) {
            map.entry("hint").or_insert_with(|| Value::String(hint.to_owned()));
        }
        let body = json!({ "code": code.as_str(), "message": self.error.public_message(), "details": details });
        let mut response = (status_of(code), axum::Json(body)).into_response();
        if self.close {
            response.headers_mut().insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        if let Error::RateLimited { retry_after_ms, .. } = &self.error {
            // RFC 9110's delay-seconds: whole seconds, rounded up so a client that waits it
            // finds a token.
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, retry_after_ms.div_ceil(1000).max(1).into());
        }
        if code == ErrorCode::Unauthenticated {
            response.headers_mut().insert("www-authenticate", axum::http::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
