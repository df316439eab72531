//! The application layer: what a method does between its checked input and its answer when
//! that is more than one decision and one append. Free of HTTP: a function here takes the
//! [`Call`](crate::api::Call) (who asks, the state, the idempotency key) and the checked
//! input, and returns what it appended; the handler parses before and builds its view after.
//!
//! **Invariant:** a method decides again only here, by a rule stated in the doc comment of the
//! function that does it, and only through [`retry_on_conflict`] or [`retry_on_quota_race`],
//! bounded. Handlers never retry; every other CONFLICT goes back to the caller.

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
pub async fn retry_on_conflict<T, Fut>(stream: &str, attempts_max: u32, attempt: impl FnMut(u32) -> Fut) -> Result<T>
where
    Fut: Future<Output = Result<T>>,
{
    retry_while(attempts_max, |e| conflict_on(e, stream), attempt).await
}

/// [`retry_on_conflict`] for work counted against a tenant's resource limits in a pool (an
/// instance's create or resize, a sandbox's create or claim: `quota.counted`, guarded at the
/// quota's version): decided again, on what is read then, while the CONFLICT is on the quota's
/// stream (`quota/pool_…`: another's work was counted there, or a refusal recorded, between this
/// attempt's read and its append), up to `attempts_max` attempts. Two creates racing on one quota
/// both land when both fit, and one is `QUOTA_EXCEEDED` when only one does, never `CONFLICT`.
pub async fn retry_on_quota_race<T, Fut>(attempts_max: u32, attempt: impl FnMut(u32) -> Fut) -> Result<T>
where
    Fut: Future<Output = Result<T>>,
{
    let quota = format!("{}/", bc_projections::KIND_QUOTA);
    retry_while(attempts_max, |e| matches!(e, Error::Conflict { stream, .. } if stream.starts_with(&quota)), attempt).await
}

async fn retry_while<T, Fut>(attempts_max: u32, retry: impl Fn(&Error) -> bool, mut attempt: impl FnMut(u32) -> Fut) -> Result<T>
where
    Fut: Future<Output = Result<T>>,
{
    let mut n = 1;
    loop {
        match attempt(n).await {
            Err(e) if n < attempts_max && retry(&e) => {
                if let Error::Conflict { stream, .. } = &e {
                    tracing::debug!(stream, attempt = n, "the stream moved; deciding again");
                }
                n += 1;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    fn conflict(stream: &str) -> Error {
        Error::Conflict { stream: stream.into(), expected: "4".into(), actual: 5 }
    }

    #[tokio::test]
    async fn a_quota_race_is_decided_again_and_nothing_else_is() {
        // Moved twice under it, then it lands: three decisions, the last one's answer.
        let tries = AtomicU32::new(0);
        let landed = retry_on_quota_race(16, |n| {
            tries.fetch_add(1, Ordering::Relaxed);
            async move { if n < 3 { Err(conflict("quota/pool_1")) } else { Ok(n) } }
        })
        .await;
        assert_eq!((landed.unwrap(), tries.load(Ordering::Relaxed)), (3, 3));
        // A CONFLICT on another stream, or a refusal, goes back at once.
        let others: [fn() -> Error; 3] =
            [|| conflict("node/node_1"), || conflict("quotas/x"), || Error::QuotaExceeded("past its limit".into())];
        for other in others {
            let tries = AtomicU32::new(0);
            let answer: Result<()> = retry_on_quota_race(16, |_| {
                tries.fetch_add(1, Ordering::Relaxed);
                async move { Err(other()) }
            })
            .await;
            assert_eq!(answer.unwrap_err().to_string(), other().to_string());
            assert_eq!(tries.load(Ordering::Relaxed), 1, "{}", other());
        }
        // Bounded: the last attempt's CONFLICT is the answer.
        let tries = AtomicU32::new(0);
        let answer: Result<()> = retry_on_quota_race(4, |_| {
            tries.fetch_add(1, Ordering::Relaxed);
            async { Err(conflict("quota/pool_1")) }
        })
        .await;
        assert!(matches!(answer, Err(Error::Conflict { .. })));
        assert_eq!(tries.load(Ordering::Relaxed), 4);
    }
}
