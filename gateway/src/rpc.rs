//! `POST /api/compute/{method}`: the one handler every method goes through. It finds the method
//! in [`crate::api::table`], authenticates before reading the body (so an anonymous caller
//! cannot make the server buffer it), checks the content type and the `Idempotency-Key`,
//! fingerprints the request for idempotent retries, and runs the method's handler.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use bc_core::Error;
use bc_core::id::RequestId;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use tracing::Instrument;

use crate::api::{self, Access, Call};
use crate::error::ApiError;
use crate::{AppState, BODY_BYTES_MAX, IDEMPOTENCY_KEY_BYTES_MAX};

/// Every request the router has no route for: `POST /api/compute/NAME` goes to [`rpc`], another
/// method on such a path is 405 (`Allow: POST`), anything else 404.
pub async fn dispatch(State(state): State<Arc<AppState>>, method: Method, uri: Uri, headers: HeaderMap, body: Body) -> Response {
    match uri.path().strip_prefix(RPC_PREFIX) {
        Some(raw) if method == Method::POST => rpc(&state, raw, &headers, body).await,
        Some(_) => (StatusCode::METHOD_NOT_ALLOWED, [(header::ALLOW, "POST")]).into_response(),
        None => crate::not_found().await.into_response(),
    }
}

/// What every method's path starts with.
const RPC_PREFIX: &str = "/api/compute/";

/// One call: `raw` is the method's name as it is in the path. A name longer than any method's is
/// `NOT_FOUND` before it is percent-decoded or copied.
pub async fn rpc(state: &AppState, raw: &str, headers: &HeaderMap, body: Body) -> Response {
    let name = if raw.len() > api::METHOD_NAME_BYTES_MAX { std::borrow::Cow::Borrowed(raw) } else { percent_decoded(raw) };
    let name = name.as_ref();
    // The client's `X-Request-Id` when well formed, else one from the deployment's id source:
    // the request id is the log line's and the events' correlation.
    let request_id = client_request_id(headers).unwrap_or_else(|| RequestId::from_ulid(state.log.ids.ulid()).to_string());
    let span = tracing::info_span!("rpc", method = %echo(name), request_id = %request_id);
    let mut response = match call(state, name, headers, body, request_id.clone()).instrument(span).await {
        Ok(value) => axum::Json(value).into_response(),
        // A body not read to the end (too large, too slow) closes the connection (`ApiError::close`).
        Err(e) => e.into_response(),
    };
    response.headers_mut().insert("x-request-id", request_id.parse().expect("ids are ASCII"));
    response
}

/// Longest `X-Request-Id` taken from a client.
pub const REQUEST_ID_BYTES_MAX: usize = 64;

/// The client's `X-Request-Id`, if it is 1 to [`REQUEST_ID_BYTES_MAX`] letters, digits and
/// `.`, `_`, `:`, `-` (a UUID, a ULID, a trace id); any other is replaced, not refused, so a
/// strange proxy's header never fails a call.
fn client_request_id(headers: &HeaderMap) -> Option<String> {
    let id = headers.get("x-request-id")?.to_str().ok()?;
    let well_formed = !id.is_empty()
        && id.len() <= REQUEST_ID_BYTES_MAX
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    well_formed.then(|| id.to_owned())
}

/// `%XX` decoded, as axum's `Path` would (a method name is plain ASCII, so this is rare).
fn percent_decoded(raw: &str) -> std::borrow::Cow<'_, str> {
    if !raw.contains('%') {
        return std::borrow::Cow::Borrowed(raw);
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(byte) = raw.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(byte);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    std::borrow::Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// `NOT_FOUND` for a method not in the table. Anyone may ask, without a token, so the work is
/// bounded: a name longer than [`api::METHOD_NAME_BYTES_MAX`] gets no "did you mean" (finding a
/// suggestion compares the name with every method's), and at most `METHOD_NAME_ECHO_CHARS` of
/// the name are echoed.
fn unknown_method(name: &str) -> ApiError {
    if name.len() > api::METHOD_NAME_BYTES_MAX {
        let what = format!("method {:?} (longer than {} bytes)", echo(name), api::METHOD_NAME_BYTES_MAX);
        return Error::NotFound { what }.into();
    }
    let details = match api::suggest(name) {
        Some(nearest) => json!({ "didYouMean": nearest }),
        None => json!({}),
    };
    ApiError::with_details(Error::NotFound { what: format!("method {:?}", echo(name)) }, details)
}

/// How much of an oversized body is read past [`BODY_BYTES_MAX`] and thrown away before the
/// 413 is answered. Answered at once, the connection closed with the rest of the body unread,
/// a client still writing it met a broken pipe or a reset instead of its answer (seen: a 2 MiB
/// body's `PAYLOAD_TOO_LARGE` lost so, one run in four of the suite's bad-input test). Read
/// to its end within this bound and the body's read deadline, the client gets the 413 (a
/// lingering close, as nginx's `lingering_close`); a larger body is still cut off.
const OVERSIZE_DRAIN_BYTES_MAX: usize = 8 * BODY_BYTES_MAX;

/// The request's body, or `None` when it is longer than [`BODY_BYTES_MAX`] (or its stream
/// failed): an oversized body is read on, unkept, up to [`OVERSIZE_DRAIN_BYTES_MAX`] more.
async fn read_body(body: Body) -> Option<Vec<u8>> {
    use futures::StreamExt;
    let mut stream = body.into_data_stream();
    let mut kept = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.ok()?;
        seen = seen.saturating_add(chunk.len());
        if seen <= BODY_BYTES_MAX {
            kept.extend_from_slice(&chunk);
        } else if seen > BODY_BYTES_MAX + OVERSIZE_DRAIN_BYTES_MAX {
            return None;
        }
    }
    (seen <= BODY_BYTES_MAX).then_some(kept)
}

/// The refusal of a body that did not arrive within `deadline`. The rest of it is never read, so
/// the answer closes the connection (as for `PAYLOAD_TOO_LARGE`).
fn body_too_slow(deadline: std::time::Duration) -> Error {
    Error::InvalidArgument {
        message: format!("the request body did not arrive within {} s", deadline.as_secs_f64()),
        hint: Some("send the whole body at once; a body is read under a deadline".into()),
    }
}

/// Characters of an unknown method's name the answer repeats.
const METHOD_NAME_ECHO_CHARS: usize = 64;

/// The start of `name`, as the answer repeats it, whatever its length.
fn echo(name: &str) -> String {
    let end = name.char_indices().nth(METHOD_NAME_ECHO_CHARS).map(|(at, _)| at);
    match end {
        Some(at) => format!("{}…", &name[..at]),
        None => name.to_owned(),
    }
}

async fn call(
    state: &AppState,
    name: &str,
    headers: &HeaderMap,
    body: Body,
    request_id: String,
) -> Result<serde_json::Value, ApiError> {
    let method = api::find(name).ok_or_else(|| unknown_method(name))?;
    let principal = match method.access {
        Access::Public => None,
        Access::Authenticated | Access::Action(_) => {
            let header = headers.get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
            let principal = state.keys.authenticate(&*state.store, header).await?;
            // Before the body is read: a caller past its rate costs no more than its headers.
            state.rate_limiter.check(principal.tenant, &principal.key_id, state.log.clock.now_ms())?;
            Some(principal)
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
    // A body that trickles in frees its request slot at the deadline, whatever its size.
    let deadline = state.limits.body_read_timeout;
    let bytes = match tokio::time::timeout(deadline, read_body(body)).await {
        Ok(read) => read.ok_or(Error::PayloadTooLarge { limit_bytes: BODY_BYTES_MAX })?,
        Err(_) => return Err(ApiError::closing(body_too_slow(deadline))),
    };
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
        let normalized = api::body::body_json(&bytes).map(|v| v.to_string()).unwrap_or_default();
        let mut hasher = Sha256::new();
        hasher.update(name.as_bytes());
        hasher.update([0]);
        hasher.update(normalized.as_bytes());
        hasher.finalize().into()
    };
    let action = method.access.action().unwrap_or("");
    let call = Call { state, principal, action, idempotency_key, fingerprint, request_id, appended: Default::default() };
    Ok((method.handler)(&call, &bytes).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suggestions_computed() -> u64 {
        api::SUGGEST_CALLS.with(|calls| calls.get())
    }

    /// Regression: an unknown method's "did you mean" ran over a name of any length
    /// before authentication. A 64 KiB name is `NOT_FOUND` without any suggestion computed, and
    /// the answer repeats only the start of it; a short typo still gets its suggestion.
    #[test]
    fn unknown_method_with_a_64_kib_name_computes_no_suggestion() {
        let name = "p".repeat(64 * 1024);
        let before = suggestions_computed();
        let error = unknown_method(&name);
        assert_eq!(suggestions_computed(), before, "no suggestion is computed for an over-long name");
        assert_eq!(error.error.code(), bc_core::ErrorCode::NotFound);
        assert!(error.details.get("didYouMean").is_none(), "{}", error.details);
        assert!(error.error.public_message().len() < 200, "the echo is bounded: {}", error.error.public_message().len());

        let error = unknown_method("pools.lsit");
        assert_eq!(suggestions_computed(), before + 1);
        assert_eq!(error.details["didYouMean"], "pools.list");
        let at_the_bound = "x".repeat(api::METHOD_NAME_BYTES_MAX);
        assert!(unknown_method(&at_the_bound).details.get("didYouMean").is_none(), "nothing near it");
        assert_eq!(suggestions_computed(), before + 2, "a name at the bound is still compared");
    }

    #[test]
    fn the_echo_keeps_the_first_characters_whole() {
        assert_eq!(echo("pools.lsit"), "pools.lsit");
        let long = "é".repeat(METHOD_NAME_ECHO_CHARS + 5);
        assert_eq!(echo(&long), format!("{}…", "é".repeat(METHOD_NAME_ECHO_CHARS)));
    }
}
