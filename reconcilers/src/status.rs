//! Each reconciler records what it did (omicron's background-task status): [`PassRecorder`]
//! (called by [`crate::driver::run`] after every activation) writes a reconciler's last pass
//! in this process to the store (`reconciler_passes`), which
//! `better-compute reconcilers status` reads. A busy reconciler records at most once every
//! `RECORD_EVERY_MS`, its counts summed over the passes since; a failure is recorded at once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bc_core::clock::Clock;
use bc_core::store::EventStore;
use bc_core::store::status::{PASS_FORGET_MS, PassRecord};

/// How often a reconciler writes its status at most while all is well.
pub const RECORD_EVERY_MS: u64 = 1000;

/// This process, as a status row names it: `HOST:PID:STARTED` (the process's first call, in
/// seconds since the Unix epoch), so a restart under the same PID (a container's PID 1) is a new
/// instance. The wall clock names the process here, an IO edge like the host name; it decides
/// nothing (clippy.toml).
#[allow(clippy::disallowed_methods)]
pub fn instance() -> String {
    static INSTANCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    INSTANCE
        .get_or_init(|| {
            let host = std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| "localhost".into());
            let started_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
            format!("{}:{}:{started_s}", bc_core::id::truncate(&host, 64), std::process::id())
        })
        .clone()
}

/// What one pass did: `Ok(counts)` or the failure.
pub type PassOutcome<'a> = Result<&'a [(&'static str, u64)], &'a bc_core::Error>;

/// Records one reconciler's passes in this process.
pub struct PassRecorder {
    store: Arc<dyn EventStore>,
    clock: Arc<dyn Clock>,
    name: &'static str,
    instance: String,
    /// Passes since the last record, and when it was written.
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    passes: u64,
    counts: BTreeMap<String, u64>,
    recorded_at_ms: u64,
    /// The last record was a failure: the next pass is written at once, so a recovery is never
    /// held back behind a stale failure.
    failed_last: bool,
}

impl PassRecorder {
    pub fn new(store: Arc<dyn EventStore>, clock: Arc<dyn Clock>, name: &'static str) -> Self {
        Self { store, clock, name, instance: instance(), pending: Mutex::default() }
    }

    /// One pass, begun at `started_at_ms`, with its outcome. A failure to record is logged,
    /// never passed on: the status is for operators, the work goes on without it.
    pub async fn pass(&self, started_at_ms: u64, outcome: PassOutcome<'_>) {
        let now = self.clock.now_ms();
        let record = {
            let mut pending = self.pending.lock().expect("the recorder's lock is never poisoned");
            pending.passes += 1;
            if let Ok(counts) = outcome {
                for (key, n) in counts {
                    *pending.counts.entry((*key).to_owned()).or_default() += n;
                }
            }
            if outcome.is_ok() && !pending.failed_last && now < pending.recorded_at_ms.saturating_add(RECORD_EVERY_MS) {
                return;
            }
            let taken = std::mem::take(&mut *pending);
            pending.recorded_at_ms = now;
            pending.failed_last = outcome.is_err();
            PassRecord {
                name: self.name.to_owned(),
                instance: self.instance.clone(),
                started_at_ms,
                duration_ms: now.saturating_sub(started_at_ms),
                ok: outcome.is_ok(),
                counts: taken.counts,
                error: outcome.err().map(|e| e.public_message()),
                passes: taken.passes,
            }
        };
        if let Err(e) = self.store.pass_record(&record, now.saturating_sub(PASS_FORGET_MS)).await {
            tracing::warn!(reconciler = self.name, code = %e.code(), error = %e, "recording the pass failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bc_core::clock::ManualClock;

    /// Regression (review): a success right after a recorded failure was held back by the
    /// once-a-second limit, so an idle reconciler showed a stale failure for good.
    #[tokio::test]
    async fn a_recovery_is_recorded_at_once_after_a_failure() {
        let dir = tempfile::tempdir().unwrap();
        let store = bc_core::store::sqlite::SqliteStore::open(&dir.path().join("s.sqlite3")).await.unwrap();
        store.migrate().await.unwrap();
        let store: Arc<dyn EventStore> = Arc::new(store);
        let clock = Arc::new(ManualClock::new(1_000_000));
        let recorder = PassRecorder::new(store.clone(), clock.clone(), "test");
        recorder.pass(clock.now_ms(), Ok(&[("done", 1)])).await;
        clock.advance_ms(100);
        let failure = bc_core::Error::Unavailable("the database went away".into());
        recorder.pass(clock.now_ms(), Err(&failure)).await;
        let last = |passes: Vec<PassRecord>| passes.into_iter().find(|p| p.name == "test").unwrap();
        assert!(!last(store.passes().await.unwrap()).ok, "a failure is recorded at once");
        clock.advance_ms(100);
        recorder.pass(clock.now_ms(), Ok(&[("done", 2)])).await;
        let now = last(store.passes().await.unwrap());
        assert!(now.ok, "the recovery is recorded at once: {now:?}");
        assert_eq!((now.passes, now.counts["done"]), (3, 2));
        // Then the once-a-second limit holds again.
        clock.advance_ms(100);
        recorder.pass(clock.now_ms(), Ok(&[("done", 5)])).await;
        assert_eq!(last(store.passes().await.unwrap()).passes, 3, "held back within the second");
    }
}
