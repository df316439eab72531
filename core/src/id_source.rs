//! Ids come in through a trait, beside the [`Clock`] (STYLE rule 9): the same seed, clock and
//! inputs give the same ids, so the same events byte for byte.
//!
//! An [`IdSource`] yields ULIDs; each typed id wraps one (`PoolId::from_ulid(ids.ulid())`), so
//! the appender's event ids and a handler's new pool or reservation ids can all come from the
//! one source a deployment (or the simulator) is given.
//!
//! - [`RandomIds`]: the real source, the clock's milliseconds and 80 bits from the thread's
//!   CSPRNG (seeded from the operating system);
//! - [`SeededIds`]: a deterministic one for tests and the simulator, the clock's milliseconds
//!   and 80 bits of SplitMix64 from a seed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ulid::Ulid;

use crate::clock::{Clock, SystemClock};

pub trait IdSource: Send + Sync + 'static {
    /// A fresh ULID: the time in milliseconds, then 80 bits this source chooses.
    fn ulid(&self) -> Ulid;
}

/// ULIDs from a clock and the operating system's randomness.
#[derive(Clone)]
pub struct RandomIds {
    clock: Arc<dyn Clock>,
}

impl RandomIds {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self { clock }
    }
}

impl Default for RandomIds {
    /// On the system clock.
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

impl IdSource for RandomIds {
    // The real IdSource: the OS-seeded thread RNG behind the trait (clippy.toml), which the
    // simulator replaces with SeededIds.
    #[allow(clippy::disallowed_methods)]
    fn ulid(&self) -> Ulid {
        Ulid::from_parts(self.clock.now_ms(), rand::random::<u128>())
    }
}

/// ULIDs from a clock and a seeded generator: the same seed, the same clock readings and the
/// same order of calls give the same ids.
pub struct SeededIds {
    clock: Arc<dyn Clock>,
    /// SplitMix64's counter: each draw adds the golden gamma, so a draw is one atomic add and
    /// calls from several threads each get a distinct value.
    state: AtomicU64,
}

/// SplitMix64's increment (2^64 / φ).
const SPLITMIX_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl SeededIds {
    pub fn new(seed: u64, clock: Arc<dyn Clock>) -> Self {
        Self { clock, state: AtomicU64::new(seed) }
    }

    fn next_u64(&self) -> u64 {
        let mut z = self.state.fetch_add(SPLITMIX_GAMMA, Ordering::Relaxed).wrapping_add(SPLITMIX_GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

impl IdSource for SeededIds {
    fn ulid(&self) -> Ulid {
        let random = (u128::from(self.next_u64()) << 64) | u128::from(self.next_u64());
        Ulid::from_parts(self.clock.now_ms(), random)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::id::PoolId;

    #[test]
    fn the_same_seed_gives_the_same_ids() {
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        let (a, b, c) = (SeededIds::new(7, clock.clone()), SeededIds::new(7, clock.clone()), SeededIds::new(8, clock.clone()));
        let first: Vec<Ulid> = (0..100).map(|_| a.ulid()).collect();
        let second: Vec<Ulid> = (0..100).map(|_| b.ulid()).collect();
        let other: Vec<Ulid> = (0..100).map(|_| c.ulid()).collect();
        assert_eq!(first, second);
        assert_ne!(first, other);
        assert_eq!(first.iter().collect::<std::collections::HashSet<_>>().len(), 100, "ids repeat");
        assert!(first.iter().all(|u| u.timestamp_ms() == 1_800_000_000_000));
        clock.advance_ms(5);
        assert_eq!(a.ulid().timestamp_ms(), 1_800_000_000_005);
        // A typed id wraps one.
        assert!(PoolId::from_ulid(a.ulid()).to_string().starts_with("pool_"));
    }

    #[test]
    fn random_ids_take_the_clock_time() {
        let clock = Arc::new(ManualClock::new(42));
        let ids = RandomIds::new(clock);
        let (x, y) = (ids.ulid(), ids.ulid());
        assert_eq!((x.timestamp_ms(), y.timestamp_ms()), (42, 42));
        assert_ne!(x, y);
    }
}
