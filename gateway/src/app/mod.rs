//! The application layer: what a method does between its checked input and its answer when
//! that is more than one decision and one append. Free of HTTP: a function here takes the
//! [`Call`](crate::api::Call) (who asks, the state, the idempotency key) and the checked
//! input, and returns what it appended; the handler parses before and builds its view after.
//!
//! **Invariant:** a method decides again only here, by a rule stated in the doc comment of the
//! function that does it, and only through [`retry_on_conflict`], bounded. Handlers never
//! retry; every other CONFLICT goes back to the caller.

pub mod fleet;
pub mod reservations;

use std::future::Future;

use bc_core::{Error, Result};

/// Whether `e` is a CONFLICT on `stream` (as the append's guard on it failed).
pub fn conflict_on(e: &Error, stream: &str) -> bool {
    matches!(e, Error::Conflict { stream: s, .. } if s == stream)
}

/// Decide-and-append with a retry on one race: runs `attempt` (which reads what it decides on,
/// decides and appends; `attempt` counts from 1) and runs it again while it fails with a
/// CONFLICT on `stream`, a stream another writer moved between the attempt's read and its
/// append, up to `attempts_max` attempts in all. Any other outcome, and the last attempt's
/// CONFLICT, goes back to the caller as it is.
pub async fn retry_on_conflict<T, Fut>(stream: &str, attempts_max: u32, mut attempt: impl FnMut(u32) -> Fut) -> Result<T>
where
    Fut: Future<Output = Result<T>>,
{
    let mut n = 1;
    loop {
        match attempt(n).await {
            Err(e) if n < attempts_max && conflict_on(&e, stream) => {
                tracing::debug!(stream, attempt = n, "the stream moved; deciding again");
                n += 1;
            }
            other => return other,
        }
    }
}
