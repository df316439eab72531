//! Fair use of the API: a token bucket per API key and one per tenant. A call takes one token
//! from both, or from neither: a key past its rate is refused `RATE_LIMITED` while another key
//! of its tenant goes on, until the tenant's own bucket is empty. The answer is `429` with
//! `Retry-After` (whole seconds, rounded up) and `details.retryAfterMs`.
//!
//! The arithmetic ([`take`]) is pure: buckets and the time in, the verdict out. Tokens are
//! counted in thousandths, so a rate of `r` a second refills exactly `r` thousandths a
//! millisecond and nothing is lost to rounding. Public methods (`system.version`, …) are not
//! limited here: they carry no key to count them by.

use std::collections::HashMap;
use std::sync::Mutex;

use bc_core::id::TenantId;

/// Requests a second one API key may make, sustained (`--rate-per-key`).
pub const RATE_PER_KEY_DEFAULT: u32 = 200;
/// Requests one API key may make at once above its rate (`--burst-per-key`): a script that
/// creates a few hundred objects in a row is not refused (the end-to-end suite does).
pub const BURST_PER_KEY_DEFAULT: u32 = 1000;
/// Requests a second all of one tenant's keys may make together (`--rate-per-tenant`).
pub const RATE_PER_TENANT_DEFAULT: u32 = 1000;
/// Requests one tenant's keys may make at once above its rate (`--burst-per-tenant`).
pub const BURST_PER_TENANT_DEFAULT: u32 = 5000;
/// Largest rate or burst a flag takes.
pub const RATE_MAX: u32 = 1_000_000;
/// Buckets held at once. Past it, buckets already full (which hold no state: a full bucket is
/// what a new one is) are forgotten; if every bucket is still draining, a new caller is let
/// through uncounted until one fills, so memory stays bounded whatever the number of keys.
pub const BUCKETS_MAX: usize = 100_000;

const MILLI: u64 = 1000;

/// A token bucket's shape: `per_s` tokens a second, holding at most `burst`. A rate of 0
/// turns the limit off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub per_s: u32,
    pub burst: u32,
}

impl Rate {
    pub fn off() -> Self {
        Self { per_s: 0, burst: 0 }
    }

    fn is_off(self) -> bool {
        self.per_s == 0
    }

    fn capacity_milli(self) -> u64 {
        u64::from(self.burst.max(1)) * MILLI
    }
}

/// The limits of one deployment (`dev`/`serve` flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimits {
    pub per_key: Rate,
    pub per_tenant: Rate,
}

impl RateLimits {
    /// No limit at all: for benches that measure what the server itself can carry.
    pub fn off() -> Self {
        Self { per_key: Rate::off(), per_tenant: Rate::off() }
    }
}

impl Default for RateLimits {
    fn default() -> Self {
        Self {
            per_key: Rate { per_s: RATE_PER_KEY_DEFAULT, burst: BURST_PER_KEY_DEFAULT },
            per_tenant: Rate { per_s: RATE_PER_TENANT_DEFAULT, burst: BURST_PER_TENANT_DEFAULT },
        }
    }
}

/// One bucket: tokens (in thousandths) as of `at_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    milli: u64,
    at_ms: u64,
}

impl Bucket {
    /// A full bucket, as a caller never seen before gets.
    pub fn full(rate: Rate, now_ms: u64) -> Self {
        Self { milli: rate.capacity_milli(), at_ms: now_ms }
    }

    /// The bucket at `now_ms`: refilled for the time since, never above its burst. A clock that
    /// went back refills nothing.
    fn refilled(self, rate: Rate, now_ms: u64) -> Self {
        let elapsed = now_ms.saturating_sub(self.at_ms);
        let milli = self.milli.saturating_add(elapsed.saturating_mul(u64::from(rate.per_s))).min(rate.capacity_milli());
        Self { milli, at_ms: now_ms.max(self.at_ms) }
    }

    fn is_full(self, rate: Rate, now_ms: u64) -> bool {
        self.refilled(rate, now_ms).milli >= rate.capacity_milli()
    }

    /// Milliseconds until this bucket holds a whole token.
    fn wait_ms(self, rate: Rate) -> u64 {
        MILLI.saturating_sub(self.milli).div_ceil(u64::from(rate.per_s.max(1)))
    }
}

/// Takes one token from each bucket whose rate is on, or none: `Err` carries the milliseconds
/// until every one of them holds a token again.
pub fn take(buckets: &mut [(&mut Bucket, Rate)], now_ms: u64) -> Result<(), u64> {
    for (bucket, rate) in buckets.iter_mut() {
        if !rate.is_off() {
            **bucket = bucket.refilled(*rate, now_ms);
        }
    }
    let wait = buckets.iter().filter(|(_, rate)| !rate.is_off()).map(|(bucket, rate)| bucket.wait_ms(*rate)).max().unwrap_or(0);
    if wait > 0 {
        return Err(wait);
    }
    for (bucket, rate) in buckets.iter_mut() {
        if !rate.is_off() {
            bucket.milli -= MILLI;
        }
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Owner {
    Key(String),
    Tenant(TenantId),
}

/// The buckets of this process. Each gateway process counts its own calls: two processes behind
/// one balancer each allow the rate (the limit bounds one process's load, not a bill).
pub struct RateLimiter {
    limits: RateLimits,
    buckets: Mutex<HashMap<Owner, Bucket>>,
}

/// Which bucket refused, for the message.
fn refused(limits: RateLimits, key_bucket: Bucket, retry_after_ms: u64) -> bc_core::Error {
    let (who, rate) = if !limits.per_key.is_off() && key_bucket.wait_ms(limits.per_key) > 0 {
        ("this API key", limits.per_key)
    } else {
        ("this tenant's API keys", limits.per_tenant)
    };
    bc_core::Error::RateLimited {
        message: format!(
            "{who} made more than {} requests a second (a burst of {}); retry in {} ms",
            rate.per_s, rate.burst, retry_after_ms
        ),
        retry_after_ms,
    }
}

impl RateLimiter {
    pub fn new(limits: RateLimits) -> Self {
        Self { limits, buckets: Mutex::new(HashMap::new()) }
    }

    pub fn limits(&self) -> RateLimits {
        self.limits
    }

    /// Counts one call of `key_id` of `tenant` at `now_ms`, or refuses it `RATE_LIMITED`.
    pub fn check(&self, tenant: TenantId, key_id: &str, now_ms: u64) -> Result<(), bc_core::Error> {
        let RateLimits { per_key, per_tenant } = self.limits;
        if per_key.is_off() && per_tenant.is_off() {
            return Ok(());
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = Owner::Key(key_id.to_owned());
        let owner = Owner::Tenant(tenant);
        if buckets.len() + 2 > BUCKETS_MAX && !(buckets.contains_key(&key) && buckets.contains_key(&owner)) {
            buckets.retain(|owner, bucket| {
                let rate = if matches!(owner, Owner::Key(_)) { per_key } else { per_tenant };
                !bucket.is_full(rate, now_ms)
            });
            if buckets.len() + 2 > BUCKETS_MAX {
                tracing::warn!(buckets = buckets.len(), "every rate-limit bucket is draining; a new caller goes uncounted");
                return Ok(());
            }
        }
        let mut key_bucket = *buckets.entry(key.clone()).or_insert_with(|| Bucket::full(per_key, now_ms));
        let mut tenant_bucket = *buckets.entry(owner.clone()).or_insert_with(|| Bucket::full(per_tenant, now_ms));
        let verdict = take(&mut [(&mut key_bucket, per_key), (&mut tenant_bucket, per_tenant)], now_ms);
        buckets.insert(key, key_bucket);
        buckets.insert(owner, tenant_bucket);
        verdict.map_err(|wait| refused(self.limits, key_bucket, wait))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};

    fn rate(per_s: u32, burst: u32) -> Rate {
        Rate { per_s, burst }
    }

    #[test]
    fn a_bucket_gives_its_burst_then_one_token_per_interval() {
        let r = rate(10, 3);
        let mut b = Bucket::full(r, 0);
        for _ in 0..3 {
            assert_eq!(take(&mut [(&mut b, r)], 0), Ok(()));
        }
        assert_eq!(take(&mut [(&mut b, r)], 0), Err(100), "one token every 100 ms at 10/s");
        assert_eq!(take(&mut [(&mut b, r)], 99), Err(1));
        assert_eq!(take(&mut [(&mut b, r)], 100), Ok(()));
        assert_eq!(take(&mut [(&mut b, r)], 100), Err(100));
        // A long pause refills to the burst, never past it.
        for _ in 0..3 {
            assert_eq!(take(&mut [(&mut b, r)], 60_000), Ok(()));
        }
        assert!(take(&mut [(&mut b, r)], 60_000).is_err());
    }

    #[test]
    fn two_buckets_give_a_token_each_or_neither() {
        let (key, tenant) = (rate(1, 2), rate(1, 1));
        let (mut k, mut t) = (Bucket::full(key, 0), Bucket::full(tenant, 0));
        assert_eq!(take(&mut [(&mut k, key), (&mut t, tenant)], 0), Ok(()));
        let before = k;
        assert_eq!(take(&mut [(&mut k, key), (&mut t, tenant)], 0), Err(1000), "the tenant's bucket is empty");
        assert_eq!(k, before, "the key's token was not spent on a refused call");
    }

    #[test]
    fn a_rate_of_zero_is_off_and_a_clock_going_back_refills_nothing() {
        let (off, on) = (Rate::off(), rate(1, 1));
        let (mut a, mut b) = (Bucket::full(off, 0), Bucket::full(on, 1000));
        for _ in 0..1000 {
            take(&mut [(&mut a, off)], 0).unwrap();
        }
        assert_eq!(take(&mut [(&mut a, off), (&mut b, on)], 1000), Ok(()));
        assert_eq!(take(&mut [(&mut a, off), (&mut b, on)], 0), Err(1000), "the clock went back: no refill");
    }

    /// Property (seeded): over any sequence of calls, the calls a bucket allowed up to time t
    /// never exceed `burst + rate * t`, and a call refused is refused for no longer than the
    /// wait it was told.
    #[test]
    fn never_more_than_burst_plus_rate_times_time() {
        let seed: u64 = std::env::var("BC_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed_2026);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for round in 0..200 {
            let r = rate(rng.random_range(1..200), rng.random_range(1..50));
            let mut b = Bucket::full(r, 0);
            let (mut now, mut allowed) = (0u64, 0u64);
            for _ in 0..500 {
                now += rng.random_range(0..20);
                match take(&mut [(&mut b, r)], now) {
                    Ok(()) => allowed += 1,
                    Err(wait) => {
                        let mut later = b;
                        assert_eq!(
                            take(&mut [(&mut later, r)], now + wait),
                            Ok(()),
                            "seed {seed} round {round}: the wait told is enough"
                        );
                    }
                }
                let bound = u64::from(r.burst) + now * u64::from(r.per_s) / 1000;
                assert!(allowed <= bound, "seed {seed} round {round}: {allowed} calls allowed by {now} ms, bound {bound}");
            }
        }
    }

    #[test]
    fn a_key_past_its_rate_leaves_another_key_of_its_tenant_alone_until_the_tenants_bucket() {
        let limiter = RateLimiter::new(RateLimits { per_key: rate(1, 2), per_tenant: rate(1, 3) });
        let tenant = TenantId::ROOT;
        assert!(limiter.check(tenant, "key_a", 0).is_ok());
        assert!(limiter.check(tenant, "key_a", 0).is_ok());
        let e = limiter.check(tenant, "key_a", 0).unwrap_err();
        assert_eq!(e.code(), bc_core::ErrorCode::RateLimited);
        assert!(e.to_string().starts_with("this API key"), "{e}");
        assert!(limiter.check(tenant, "key_b", 0).is_ok(), "another key of the tenant goes on");
        let e = limiter.check(tenant, "key_b", 0).unwrap_err();
        assert!(e.to_string().starts_with("this tenant's API keys"), "{e}");
        assert!(matches!(e, bc_core::Error::RateLimited { retry_after_ms: 1000, .. }), "{e:?}");
    }

    #[test]
    fn the_buckets_stay_bounded() {
        let limiter = RateLimiter::new(RateLimits { per_key: rate(1000, 1), per_tenant: Rate::off() });
        for i in 0..(BUCKETS_MAX + 10) {
            limiter.check(TenantId::ROOT, &format!("key_{i}"), i as u64).unwrap();
        }
        assert!(limiter.buckets.lock().unwrap().len() <= BUCKETS_MAX);
    }
}
