//! The one shape of a reconciler (omicron's `nexus/src/app/background`): a [`Reconciler`] is a
//! name and one pass ([`Reconciler::activate`]) that reports what it did ([`Activation`]);
//! [`run`] drives it on its [`Schedule`] and records every activation's status
//! ([`crate::status::PassRecorder`]), which `better-compute reconcilers status` reads. Every
//! reconciler is built in one place, [`crate::registry`].
//!
//! An activation takes no input: it re-reads the world it needs. A commit of this process
//! (`Schedule::wake`) only brings the next activation forward, so a restart and a wake-up run
//! the same pass.

use std::sync::Arc;
use std::time::Duration;

use bc_core::clock::Clock;
use bc_core::store::{EventStore, Log};
use futures::future::BoxFuture;

use crate::status::PassRecorder;

/// The shortest time between two activations of one reconciler, however often it is woken or
/// asks to pass again: so a hot loop cannot starve the appender.
pub const PASS_INTERVAL_MIN_MS: u64 = 20;

/// What one activation did.
#[derive(Debug)]
pub struct Activation {
    /// Its counts for the status row, or why it failed.
    pub outcome: bc_core::Result<Vec<(&'static str, u64)>>,
    /// Activate again after [`PASS_INTERVAL_MIN_MS`] rather than after the period: work is left,
    /// or a race was lost.
    pub again: bool,
}

impl Activation {
    pub fn ok(counts: Vec<(&'static str, u64)>) -> Self {
        Self { outcome: Ok(counts), again: false }
    }

    pub fn failed(error: bc_core::Error) -> Self {
        Self { outcome: Err(error), again: false }
    }
}

/// One reconciler: a name and one pass. `activate` re-reads what it needs and appends what
/// follows; what it keeps between activations (`&mut self`) is a cache or a schedule (a view
/// of the log, back-off, turns under way), never a decision the log does not record.
pub trait Reconciler: Send {
    fn name(&self) -> &'static str;
    /// One pass. It logs what it did beyond its counts; the driver records the counts.
    fn activate(&mut self) -> BoxFuture<'_, Activation>;
}

/// When [`run`] activates a reconciler.
pub struct Schedule {
    /// How long after an activation the next one runs when nothing wakes it.
    pub period_ms: u64,
    /// The first activation waits one period (sealing: a fresh process seals after one
    /// interval), instead of running at once.
    pub first_after_period: bool,
    /// Wakes it before the period is up (this process's commits); `None` once the appender is
    /// gone, or for a reconciler that only polls.
    pub wake: Option<tokio::sync::watch::Receiver<u64>>,
}

impl Schedule {
    /// Every `period_ms`, the first at once, never woken.
    pub fn every(period_ms: u64) -> Self {
        Self { period_ms, first_after_period: false, wake: None }
    }
}

/// Told of every pass [`run`] drives: the composition root's metrics (`/metrics`) count them.
pub trait PassObserver: Send + Sync {
    /// `reconciler` passed, `ok` or not, in `duration` (by the driver's clock, in milliseconds).
    fn pass(&self, reconciler: &'static str, ok: bool, duration: Duration);

    /// An outbox consumer's item was attempted and its outcome recorded: `done`, `retried`,
    /// `dead` or `lost` (the lease had passed to another process), the attempt taking `latency`
    /// (by the attempt's own clock).
    fn outbox_completed(&self, _consumer: &'static str, _outcome: &'static str, _latency: Duration) {}

    /// What the `sandboxes` reconciler's pass read across every tenant: the sandboxes not yet
    /// deleted, and of those the warm ones (started, unclaimed).
    fn sandboxes_seen(&self, _live: u64, _warm: u64) {}
}

/// The process's observer, if one was set ([`observe`]).
pub(crate) fn observer() -> Option<&'static Arc<dyn PassObserver>> {
    PASS_OBSERVER.get()
}

/// The process's [`PassObserver`], set once by [`observe`]: the driver's one hook, so the
/// registry and every reconciler stay as they are.
static PASS_OBSERVER: std::sync::OnceLock<Arc<dyn PassObserver>> = std::sync::OnceLock::new();

/// Tells `observer` of every pass [`run`] drives in this process from now on; the first
/// observer set stays (a process has one set of metrics).
pub fn observe(observer: Arc<dyn PassObserver>) {
    let _ = PASS_OBSERVER.set(observer);
}

/// Drives `reconciler` until `shutdown`: an activation, its status recorded in `store` (at most
/// once a second while all is well, a failure at once), then a wait of the period, cut short by
/// a wake-up; after an activation that asks to pass again, only [`PASS_INTERVAL_MIN_MS`]. A
/// failed activation is logged and tried again after the period.
pub async fn run(
    mut reconciler: Box<dyn Reconciler>,
    schedule: Schedule,
    store: Arc<dyn EventStore>,
    clock: Arc<dyn Clock>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let name = reconciler.name();
    let Schedule { period_ms, first_after_period, mut wake } = schedule;
    tracing::info!(reconciler = name, period_ms, "reconciler started");
    let status = PassRecorder::new(store, clock.clone(), name);
    if first_after_period {
        crate::idle(period_ms, &mut None, &mut shutdown).await;
    }
    while !*shutdown.borrow() {
        let started_at_ms = clock.now_ms();
        let Activation { outcome, again } = reconciler.activate().await;
        if let Some(observer) = PASS_OBSERVER.get() {
            let duration = Duration::from_millis(clock.now_ms().saturating_sub(started_at_ms));
            observer.pass(name, outcome.is_ok(), duration);
        }
        match &outcome {
            Ok(counts) => status.pass(started_at_ms, Ok(counts)).await,
            Err(e) => {
                tracing::warn!(reconciler = name, code = %e.code(), error = %e, "pass failed; retrying");
                status.pass(started_at_ms, Err(e)).await;
            }
        }
        let least_ms = PASS_INTERVAL_MIN_MS.min(period_ms);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(least_ms)) => {}
            _ = shutdown.changed() => {}
        }
        if !again && !*shutdown.borrow() {
            crate::idle(period_ms - least_ms, &mut wake, &mut shutdown).await;
        }
    }
    tracing::info!(reconciler = name, "reconciler stopped");
}

/// What a pass over the log reports to [`LogPasses`]: its counts, whether to pass again soon,
/// and what to log when it did something.
pub trait PassReport {
    fn counts(&self) -> Vec<(&'static str, u64)>;
    fn again(&self) -> bool;
    /// Logs what the pass did (nothing by default).
    fn log(&self, _name: &'static str) {}
}

/// One pass of a reconciler that keeps nothing between passes, over the log at the clock's now.
pub type PassFn<P> = for<'a> fn(&'a Log, &'a dyn Clock) -> BoxFuture<'a, bc_core::Result<P>>;

/// A [`Reconciler`] made of a pass that keeps nothing between passes (`instances`, `liveness`,
/// `rollouts`).
pub struct LogPasses<P> {
    pub name: &'static str,
    pub log: Arc<Log>,
    pub clock: Arc<dyn Clock>,
    pub pass: PassFn<P>,
}

impl<P: PassReport + Send + 'static> Reconciler for LogPasses<P> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn activate(&mut self) -> BoxFuture<'_, Activation> {
        Box::pin(async move {
            match (self.pass)(&self.log, &*self.clock).await {
                Ok(p) => {
                    p.log(self.name);
                    Activation { outcome: Ok(p.counts()), again: p.again() }
                }
                Err(e) => Activation::failed(e),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bc_core::clock::ManualClock;
    use std::sync::atomic::{AtomicU64, Ordering};

    struct Counting {
        activations: Arc<AtomicU64>,
        again_until: u64,
    }

    impl Reconciler for Counting {
        fn name(&self) -> &'static str {
            "counting"
        }

        fn activate(&mut self) -> BoxFuture<'_, Activation> {
            Box::pin(async move {
                let n = self.activations.fetch_add(1, Ordering::SeqCst) + 1;
                if n == 3 {
                    return Activation::failed(bc_core::Error::Unavailable("down".into()));
                }
                Activation { outcome: Ok(vec![("n", 1)]), again: n < self.again_until }
            })
        }
    }

    async fn store() -> (tempfile::TempDir, Arc<dyn EventStore>) {
        let dir = tempfile::tempdir().unwrap();
        let store = bc_core::store::sqlite::SqliteStore::open(&dir.path().join("s.sqlite3")).await.unwrap();
        store.migrate().await.unwrap();
        (dir, Arc::new(store))
    }

    /// Each activation is recorded for `reconcilers status`.
    #[tokio::test]
    async fn the_driver_records_its_activations() {
        let (_dir, store) = store().await;
        let clock = Arc::new(ManualClock::new(1_000_000));
        let activations = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = Counting { activations: activations.clone(), again_until: 0 };
        let driver = tokio::spawn(run(Box::new(task), Schedule::every(60_000), store.clone(), clock, stopped));
        while activations.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.send(true).unwrap();
        driver.await.unwrap();
        let rows = store.passes().await.unwrap();
        let row = rows.iter().find(|p| p.name == "counting").expect("the driver records its passes");
        assert_eq!((row.ok, row.passes, row.counts["n"]), (true, 1, 1), "{row:?}");
    }

    /// Passes that ask again follow at the least interval; then one per period, or at once on
    /// a wake-up; after a failure, the next pass comes after the period; shutdown ends it
    /// between passes. (The store is opened before time is paused; the status writes under a
    /// paused clock may time out, which the driver only logs.)
    #[tokio::test]
    async fn the_driver_passes_on_its_period_when_asked_again_and_when_woken() {
        let (_dir, store) = store().await;
        tokio::time::pause();
        let clock = Arc::new(ManualClock::new(1_000_000));
        let activations = Arc::new(AtomicU64::new(0));
        let (wake, woken) = tokio::sync::watch::channel(0u64);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let schedule = Schedule { period_ms: 10_000, first_after_period: false, wake: Some(woken) };
        let task = Counting { activations: activations.clone(), again_until: 3 };
        let driver = tokio::spawn(run(Box::new(task), schedule, store.clone(), clock, stopped));
        let at = |ms| tokio::time::sleep(Duration::from_millis(ms));
        at(5).await;
        assert_eq!(activations.load(Ordering::SeqCst), 1, "the first pass runs at once");
        at(2 * PASS_INTERVAL_MIN_MS).await;
        assert_eq!(activations.load(Ordering::SeqCst), 3, "passes that ask again follow soon");
        at(5_000).await;
        assert_eq!(activations.load(Ordering::SeqCst), 3, "after a failure, the period");
        at(5_000).await;
        assert_eq!(activations.load(Ordering::SeqCst), 4);
        wake.send(1).unwrap();
        at(PASS_INTERVAL_MIN_MS + 1).await;
        assert_eq!(activations.load(Ordering::SeqCst), 5, "a wake-up brings the next pass forward");
        stop.send(true).unwrap();
        driver.await.unwrap();
    }

    /// Sealing's schedule: the first pass after one period.
    #[tokio::test]
    async fn the_first_pass_may_wait_one_period() {
        let (_dir, store) = store().await;
        tokio::time::pause();
        let clock = Arc::new(ManualClock::new(1_000_000));
        let activations = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let schedule = Schedule { period_ms: 1_000, first_after_period: true, wake: None };
        let task = Counting { activations: activations.clone(), again_until: 0 };
        let driver = tokio::spawn(run(Box::new(task), schedule, store, clock, stopped));
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert_eq!(activations.load(Ordering::SeqCst), 0);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(activations.load(Ordering::SeqCst), 1);
        stop.send(true).unwrap();
        driver.await.unwrap();
    }
}
