//! Time comes in through a trait (STYLE rule 9) so the simulator can run the real code on a
//! virtual clock: [`SystemClock`] in production, [`ManualClock`] in tests and the simulator.
//! Ids come in the same way, beside it (`id_source.rs`).

pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    // The one reading of the wall clock in the crates the simulator runs (clippy.toml): the real
    // Clock, which the simulator replaces with a ManualClock.
    #[allow(clippy::disallowed_methods)]
    fn now_ms(&self) -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

/// A clock that moves only when told: for tests and the simulator's virtual time.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: std::sync::atomic::AtomicU64,
}

impl ManualClock {
    pub fn new(now_ms: u64) -> Self {
        Self { now_ms: std::sync::atomic::AtomicU64::new(now_ms) }
    }

    pub fn set_ms(&self, now_ms: u64) {
        self.now_ms.store(now_ms, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn advance_ms(&self, by_ms: u64) {
        self.now_ms.fetch_add(by_ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// `2026-11-29T19:32:50.123Z` for a time in milliseconds since the Unix epoch (UTC, proleptic
/// Gregorian; Howard Hinnant's days-to-civil).
pub fn rfc3339_ms(ms: u64) -> String {
    let days = (ms / 86_400_000) as i64;
    let rem = ms % 86_400_000;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, milli) = (rem / 3_600_000, rem / 60_000 % 60, rem / 1000 % 60, rem % 1000);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339() {
        assert_eq!(super::rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(super::rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(super::rfc3339_ms(1_795_980_770_123), "2026-11-29T19:32:50.123Z");
    }
}
