//! `bcd join --request`'s wait, without IO: what to do after each answer to an ask. A machine
//! with no join token asks the gateway to join (`RequestJoin`); while its request is pending it
//! asks again with back-off, and it stops when the request is approved (the answer carries the
//! join), rejected (exit 1 with the reason), or refused, or when it has waited
//! [`ASK_WAIT_MS_MAX`] in all. Time comes in as `now_ms` and randomness through [`Rng`];
//! `join::request` makes the calls and sleeps.

use crate::join::{JOIN_ATTEMPTS_MAX, retry_delay_ms};
use crate::session::{Backoff, Rng};

/// The longest wait between two asks while the request is pending: an approval is seen within
/// about this long.
pub const ASK_INTERVAL_MS_MAX: u64 = 30_000;
/// The longest a machine waits for a decision in all; then `bcd join --request` exits 1 and can
/// be run again (the request stays, and the same machine finds it).
pub const ASK_WAIT_MS_MAX: u64 = 24 * 3600 * 1000;
/// Failures worth retrying (the gateway unreachable, out of join permits, too many requests
/// pending) in a row before the wait gives up: a join's own bound.
pub const ASK_FAILURES_MAX: u32 = JOIN_ATTEMPTS_MAX;

/// What an ask was answered with.
#[derive(Clone, Debug, PartialEq)]
pub enum Heard {
    /// Pending: ask again, no sooner than `retry_after_ms`.
    Pending { retry_after_ms: u64 },
    /// Approved: the answer carries the join.
    Approved,
    /// Rejected by an operator, for this reason.
    Rejected { reason: String },
    /// A failure worth asking again after (with the gateway's hint, if it gave one).
    Retryable { hint_ms: Option<u64>, message: String },
    /// A refusal: asking again would be refused the same way.
    Refused { message: String },
}

/// What to do next.
#[derive(Clone, Debug, PartialEq)]
pub enum Next {
    /// Ask again after this long.
    AskAfter { delay_ms: u64 },
    /// Keep the join the approval carried.
    Join,
    /// Stop, exit 1 with this message.
    Fail(String),
}

/// The wait of one `bcd join --request`.
pub struct AskWait {
    request: String,
    started_ms: u64,
    backoff: Backoff,
    failures: u32,
}

impl AskWait {
    pub fn new(now_ms: u64) -> Self {
        Self { request: String::new(), started_ms: now_ms, backoff: Backoff::default(), failures: 0 }
    }

    /// The request the gateway named (`jreq_…`), for the messages.
    pub fn named(&mut self, request: &str) {
        request.clone_into(&mut self.request);
    }

    fn name(&self) -> &str {
        if self.request.is_empty() { "this machine's join request" } else { &self.request }
    }

    /// What to do after hearing `heard` at `now_ms`.
    pub fn next(&mut self, now_ms: u64, heard: Heard, rng: &mut dyn Rng) -> Next {
        let delay_ms = match heard {
            Heard::Approved => return Next::Join,
            Heard::Rejected { reason } => return Next::Fail(format!("{} was rejected: {reason}", self.name())),
            Heard::Refused { message } => return Next::Fail(format!("join request refused: {message}")),
            Heard::Pending { retry_after_ms } => {
                self.failures = 0;
                let backoff_ms = self.backoff.next_delay_ms(rng).min(ASK_INTERVAL_MS_MAX);
                retry_after_ms.min(ASK_INTERVAL_MS_MAX).max(backoff_ms)
            }
            Heard::Retryable { hint_ms, message } => {
                self.failures += 1;
                if self.failures >= ASK_FAILURES_MAX {
                    return Next::Fail(format!("asking to join failed {} times in a row: {message}", self.failures));
                }
                retry_delay_ms(hint_ms, self.backoff.next_delay_ms(rng))
            }
        };
        if now_ms.saturating_sub(self.started_ms).saturating_add(delay_ms) > ASK_WAIT_MS_MAX {
            return Next::Fail(format!(
                "{} is still pending after {} hours: run bcd join --request again to go on waiting",
                self.name(),
                ASK_WAIT_MS_MAX / 3_600_000
            ));
        }
        Next::AskAfter { delay_ms }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The middle of every jitter.
    struct Middle;
    impl Rng for Middle {
        fn next_unit(&mut self) -> f64 {
            0.5
        }
    }

    #[test]
    fn a_pending_request_is_asked_again_with_growing_bounded_waits_until_decided() {
        let mut wait = AskWait::new(0);
        wait.named("jreq_x");
        let mut delays = Vec::new();
        let mut now = 0;
        for _ in 0..12 {
            match wait.next(now, Heard::Pending { retry_after_ms: 2_000 }, &mut Middle) {
                Next::AskAfter { delay_ms } => {
                    delays.push(delay_ms);
                    now += delay_ms;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(delays[..3], [2_000, 2_000, 2_560], "the gateway's hint, then the back-off");
        assert!(delays.windows(2).all(|w| w[0] <= w[1]), "{delays:?}");
        assert_eq!(*delays.last().unwrap(), ASK_INTERVAL_MS_MAX, "bounded");
        assert_eq!(wait.next(now, Heard::Approved, &mut Middle), Next::Join);
        assert_eq!(
            wait.next(now, Heard::Rejected { reason: "unknown machine".into() }, &mut Middle),
            Next::Fail("jreq_x was rejected: unknown machine".into())
        );
    }

    #[test]
    fn the_wait_ends_after_its_bound_and_after_too_many_failures_in_a_row() {
        let mut wait = AskWait::new(0);
        let late = wait.next(ASK_WAIT_MS_MAX - 1_000, Heard::Pending { retry_after_ms: 2_000 }, &mut Middle);
        assert!(matches!(&late, Next::Fail(m) if m.contains("still pending after 24 hours")), "{late:?}");

        let mut wait = AskWait::new(0);
        let busy = || Heard::Retryable { hint_ms: Some(5_000), message: "busy".into() };
        for _ in 1..ASK_FAILURES_MAX {
            assert!(matches!(wait.next(0, busy(), &mut Middle), Next::AskAfter { delay_ms } if delay_ms >= 5_000));
        }
        assert!(matches!(wait.next(0, busy(), &mut Middle), Next::Fail(m) if m.contains("failed 20 times")));
        // A pending answer between failures starts the count again.
        let mut wait = AskWait::new(0);
        for _ in 1..ASK_FAILURES_MAX {
            wait.next(0, busy(), &mut Middle);
        }
        wait.next(0, Heard::Pending { retry_after_ms: 0 }, &mut Middle);
        assert!(matches!(wait.next(0, busy(), &mut Middle), Next::AskAfter { .. }));
        let refused = wait.next(0, Heard::Refused { message: "the ask is not signed by the key it names".into() }, &mut Middle);
        assert!(matches!(refused, Next::Fail(m) if m.starts_with("join request refused: ")));
    }
}
