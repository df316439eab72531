//! Each reconciler records what it did (omicron's background-task status): [`PassRecorder`]
//! writes a reconciler's last pass in this process to the store (`reconciler_passes`), which
//! `better-compute reconcilers status` reads. A busy reconciler records at most once every
//! `RECORD_EVERY_MS`, its counts summed over the passes since; a failure is recorded at once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bc_core::clock::Clock;
use bc_core::store::EventStore;
use bc_core::store::status::{PASS_FORGET_MS, PassRecord};

/// How often a reconciler writes its status at most while all is well.
pub const RECORD_EVERY_MS: u64 = 1000;

/// This process, as a status row names it: `HOST:PID`.
pub fn instance() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into());
    format!("{}:{}", bc_core::id::truncate(&host, 64), std::process::id())
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
            if outcome.is_ok() && now < pending.recorded_at_ms.saturating_add(RECORD_EVERY_MS) {
                return;
            }
            let taken = std::mem::take(&mut *pending);
            pending.recorded_at_ms = now;
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
