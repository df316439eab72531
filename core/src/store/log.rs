//! The appender: group commit with signing outside the database transaction.
//!
//! Callers send [`AppendRequest`]s over a bounded channel (`APPEND_QUEUE_REQUESTS_MAX`, so a
//! burst applies back-pressure instead of growing memory). One task drains the channel into a
//! batch, reads the chain heads, stream versions and idempotency records the batch needs, then,
//! on a blocking thread, decides every request and hashes and signs its events. Only then does it
//! open the transaction, which re-checks the chain heads under the counter lock: if another
//! process moved one, nothing is written and the batch is decided again (bounded by
//! `APPEND_ATTEMPTS_MAX`). Because a tenant's head moves with every append to any of its streams,
//! an unchanged head also proves its stream versions and idempotency records are unchanged.
//!
//! A batch whose commit fails is split in halves, each processed again, so that a request whose
//! projection fold fails is refused alone while the rest of its batch commits.
//!
//! Ids and time are inputs: each event's id comes from the log's [`IdSource`] and its time from
//! the log's [`Clock`], so a seeded source and a manual clock give the same events, byte for
//! byte, for the same appends (a batch decided again after losing a race draws new ids, so
//! that holds where nothing races, as in the simulator). And only this module commits: it makes
//! the [`WriteToken`] that opens an append transaction (`engine.rs` holds the algorithm).

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::{
    AppendRequest, AppendResult, BATCH_EVENTS_MAX, CommitOutcome, EventStore, Head, IdempotencyRecord, PreRead, PreReadQuery,
    PreparedBatch, ProjectedRows, Projector, READ_ROWS_MAX, RowKey, WriteToken, decode_rows, engine, touched_rows,
};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::event::{Envelope, GENESIS_PREV, PAYLOAD_BYTES_MAX, Position, StoredEvent, sha256, signed_alone};
use crate::id::{EventId, TenantId};
use crate::id_source::{IdSource, RandomIds};
use crate::keys::LogKey;

/// Append requests waiting for the appender.
pub const APPEND_QUEUE_REQUESTS_MAX: usize = 4096;
/// Optimistic attempts (decided and signed outside the transaction) before the appender decides
/// the batch inside the transaction instead, under the counter lock, which cannot go stale.
pub const OPTIMISTIC_ATTEMPTS_MAX: usize = 2;
/// Below this many events, deciding on this task beats a hop to the blocking pool, and below
/// this many signatures, signing on one thread beats starting another.
const PARALLEL_SIGNING_EVENTS_MIN: usize = 64;

struct Job {
    /// One request, or a group ([`Log::append_group`]) that is appended whole or not at all.
    requests: Vec<AppendRequest>,
    reply: oneshot::Sender<Result<Vec<AppendResult>>>,
}

impl Job {
    fn events(&self) -> usize {
        self.requests.iter().map(|r| r.events.len()).sum()
    }
}

/// What the appender decided for one job.
enum Outcome {
    /// Appends `events[range]` of the batch.
    Append(std::ops::Range<usize>),
    /// Same idempotency key and request as an earlier append: return its events.
    Replay {
        tenant: TenantId,
        first_seq: u64,
        last_seq: u64,
    },
    /// Same key and request as an earlier job of this batch.
    ReplayOfJob(usize),
    Refused(Error),
}

/// Told of every batch the appender commits: the gateway's metrics (`/metrics`) keep their
/// histograms with it, so this crate knows nothing of how they are served.
pub trait AppendObserver: Send + Sync + std::fmt::Debug {
    /// A batch of `events` committed; its commit took `commit`.
    fn batch_committed(&self, events: usize, commit: std::time::Duration);
}

/// Running totals of the appender's work, for metrics and for `make bench`'s account of where
/// the time goes. Microseconds are wall-clock time spent in each phase.
#[derive(Debug, Default)]
pub struct LogStats {
    pub batches: std::sync::atomic::AtomicU64,
    pub events: std::sync::atomic::AtomicU64,
    pub preread_us: std::sync::atomic::AtomicU64,
    pub decide_us: std::sync::atomic::AtomicU64,
    pub commit_us: std::sync::atomic::AtomicU64,
    /// Batches that found a chain head moved and were decided again.
    pub stale: std::sync::atomic::AtomicU64,
    /// Told of each committed batch ([`LogStats::observe`]); none by default.
    observer: std::sync::OnceLock<Arc<dyn AppendObserver>>,
}

impl LogStats {
    /// Tells `observer` of every batch committed from now on; the first observer set stays.
    pub fn observe(&self, observer: Arc<dyn AppendObserver>) {
        let _ = self.observer.set(observer);
    }

    /// Counts one committed batch.
    fn committed(&self, events: usize, commit_us: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.batches.fetch_add(1, Relaxed);
        self.events.fetch_add(events as u64, Relaxed);
        // A batch of replays and refusals alone commits nothing.
        if let Some(observer) = self.observer.get().filter(|_| events > 0) {
            observer.batch_committed(events, std::time::Duration::from_micros(commit_us));
        }
    }

    /// (batches, events, preread µs, decide µs, commit µs, stale) so far.
    pub fn snapshot(&self) -> [u64; 6] {
        use std::sync::atomic::Ordering::Relaxed;
        [
            self.batches.load(Relaxed),
            self.events.load(Relaxed),
            self.preread_us.load(Relaxed),
            self.decide_us.load(Relaxed),
            self.commit_us.load(Relaxed),
            self.stale.load(Relaxed),
        ]
    }
}

/// A cheap, cloneable handle for appending.
#[derive(Clone)]
pub struct LogHandle {
    jobs: mpsc::Sender<Job>,
}

impl LogHandle {
    pub async fn append(&self, request: AppendRequest) -> Result<AppendResult> {
        request.validate()?;
        let mut results = self.send(vec![request]).await?;
        results.pop().ok_or_else(|| Error::Internal("the appender answered an append with nothing".into()))
    }

    /// Appends every request, in order, in one transaction, or none: the first refusal (a
    /// guard's CONFLICT, say) refuses the whole group with its error. At most
    /// [`BATCH_EVENTS_MAX`] events in all.
    pub async fn append_group(&self, requests: Vec<AppendRequest>) -> Result<Vec<AppendResult>> {
        for request in &requests {
            request.validate()?;
        }
        let events: usize = requests.iter().map(|r| r.events.len()).sum();
        if events > BATCH_EVENTS_MAX {
            return Err(Error::invalid(format!("a group of appends holds at most {BATCH_EVENTS_MAX} events, not {events}")));
        }
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        self.send(requests).await
    }

    async fn send(&self, requests: Vec<AppendRequest>) -> Result<Vec<AppendResult>> {
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job { requests, reply }).await.map_err(|_| Error::Unavailable("the appender has stopped".into()))?;
        answer.await.map_err(|_| Error::Unavailable("the appender stopped before answering".into()))?
    }
}

/// The log: a store, the key that signs, and the appender task.
pub struct Log {
    pub store: Arc<dyn EventStore>,
    pub key: Arc<LogKey>,
    pub stats: Arc<LogStats>,
    /// The appender's clock, for callers that stamp things beside the log (secrets, leases).
    pub clock: Arc<dyn Clock>,
    /// Where the appender's event ids come from; callers that create entities draw their ids
    /// here too (`PoolId::from_ulid(log.ids.ulid())`), so one seed fixes them all.
    pub ids: Arc<dyn IdSource>,
    handle: LogHandle,
    /// The newest commit number this process wrote: wakes watchers early. Only a nudge: other
    /// processes' commits are found by polling, so correctness never rests on it.
    commits: tokio::sync::watch::Receiver<u64>,
    /// The newest commit of this process whose answers have all been let go ([`Log::answered`]).
    answered: tokio::sync::watch::Receiver<u64>,
    /// The simulator's crash of a caller part way (`sim run`'s `reconciler-crash`): while
    /// `Some(n)`, `n` more appends are taken and every later one is refused before it is queued,
    /// as if the caller's process had died after its last one. Always `None` elsewhere.
    appends_left: std::sync::Mutex<Option<u64>>,
    /// The simulator's failing commits (`sim run`'s `failing-commits`): this many more append
    /// transactions make their writes and then fail instead of committing. Always 0 elsewhere.
    commits_to_fail: Arc<std::sync::atomic::AtomicU64>,
    /// The simulator's database failover (`sim run`'s `failover`): this many more append
    /// transactions commit and then answer as if the connection had been lost before the
    /// answer came ([`Error::Indeterminate`]). Always 0 elsewhere.
    answers_to_lose: Arc<std::sync::atomic::AtomicU64>,
}

/// The error of an append whose commit [`Log::commits_fail`] made fail.
pub const COMMIT_FAILED: &str = "the commit failed (a failure the simulator injected); nothing was written";

/// The error of an append refused by [`Log::appends_limit`].
pub const APPENDS_STOPPED: &str = "the caller stopped (a crash the simulator injected)";

/// The error of an append whose commit [`Log::commit_answers_lost`] made and whose answer it
/// then lost, as a database failover loses the answer of a `COMMIT` in flight.
pub const COMMIT_ANSWER_LOST: &str =
    "the commit's answer was lost (a database failover the simulator injected); it may have been made";

impl Log {
    /// Registers the key with the store and starts the appender task; event ids are random
    /// ULIDs on `clock` ([`RandomIds`]).
    pub async fn open(
        store: Arc<dyn EventStore>,
        projector: Arc<dyn Projector>,
        key: Arc<LogKey>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self> {
        let ids = Arc::new(RandomIds::new(clock.clone()));
        Self::open_with_ids(store, projector, key, clock, ids).await
    }

    /// [`Log::open`] with event ids from `ids` (a seeded source: the same seed, clock and
    /// appends give the same events, byte for byte).
    pub async fn open_with_ids(
        store: Arc<dyn EventStore>,
        projector: Arc<dyn Projector>,
        key: Arc<LogKey>,
        clock: Arc<dyn Clock>,
        ids: Arc<dyn IdSource>,
    ) -> Result<Self> {
        store.signing_key_put(key.key_id(), key.public().as_bytes(), clock.now_ms()).await?;
        let (jobs, receiver) = mpsc::channel(APPEND_QUEUE_REQUESTS_MAX);
        let stats = Arc::new(LogStats::default());
        let last = store.last_commit().await?;
        let (notify, commits) = tokio::sync::watch::channel(last);
        let (answered_tx, answered) = tokio::sync::watch::channel(last);
        let commits_to_fail = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let answers_to_lose = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let appender = Appender {
            store: store.clone(),
            projector,
            key: key.clone(),
            clock: clock.clone(),
            ids: ids.clone(),
            faults: CommitFaults { to_fail: commits_to_fail.clone(), answers_to_lose: answers_to_lose.clone() },
            answered: Arc::new(answered_tx),
        };
        tokio::spawn(run_appender(receiver, appender, stats.clone(), notify));
        Ok(Self {
            store,
            key,
            stats,
            clock,
            ids,
            handle: LogHandle { jobs },
            commits,
            answered,
            appends_left: Default::default(),
            commits_to_fail,
            answers_to_lose,
        })
    }

    /// A receiver that changes when this process commits.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.commits.clone()
    }

    /// A receiver that moves to a commit of this process once every answer the commit gave has
    /// been let go by its caller (an HTTP handler: once it has made its response), or to a
    /// newer commit's. The watch tail waits on it, a bounded time, so that a write is answered
    /// before its event is fanned out to the watchers: the fan-out's work does not delay the
    /// answer.
    pub fn answered(&self) -> tokio::sync::watch::Receiver<u64> {
        self.answered.clone()
    }

    pub fn handle(&self) -> LogHandle {
        self.handle.clone()
    }

    pub async fn append(&self, request: AppendRequest) -> Result<AppendResult> {
        if let Some(stopped) = self.appends_limit_take() {
            return Err(stopped);
        }
        self.handle.append(request).await
    }

    /// [`LogHandle::append_group`]: every request in one transaction, or none. Under
    /// [`Log::appends_limit`] a group counts as one append: it is one transaction, so a caller
    /// that dies does so before it or after it.
    pub async fn append_group(&self, requests: Vec<AppendRequest>) -> Result<Vec<AppendResult>> {
        if let Some(stopped) = self.appends_limit_take() {
            return Err(stopped);
        }
        self.handle.append_group(requests).await
    }

    /// Takes one append from the limit, if there is one: `Some(error)` when none is left.
    fn appends_limit_take(&self) -> Option<Error> {
        let mut limit = self.appends_left.lock().expect("the appends limit is not poisoned");
        let left = limit.as_mut()?;
        if *left == 0 {
            return Some(Error::Unavailable(APPENDS_STOPPED.into()));
        }
        *left -= 1;
        None
    }

    /// Makes the next `count` append transactions fail at their commit, after every write (rolled
    /// back, answered UNAVAILABLE, [`COMMIT_FAILED`]): the simulator's failing commits. The
    /// append path is otherwise untouched.
    pub fn commits_fail(&self, count: u64) {
        self.commits_to_fail.store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// Makes the next `count` append transactions commit and then answer every request in them
    /// [`Error::Indeterminate`] ([`COMMIT_ANSWER_LOST`]), as when the database's primary fails
    /// over between a `COMMIT` and its answer: the simulator's failover. The append path is
    /// otherwise untouched; what the callers do next (a retry with the same idempotency key,
    /// a decision made again) is theirs.
    pub fn commit_answers_lost(&self, count: u64) {
        self.answers_to_lose.store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// Takes `left` more appends through this `Log`, then refuses every one (UNAVAILABLE,
    /// [`APPENDS_STOPPED`]) until called with `None`: the simulator's crash of a caller after
    /// its k-th append. The append path is otherwise untouched. Returns the limit it replaces
    /// (`Some(0)`: it was reached).
    pub fn appends_limit(&self, left: Option<u64>) -> Option<u64> {
        std::mem::replace(&mut *self.appends_left.lock().expect("the appends limit is not poisoned"), left)
    }
}

/// What the appender task decides and commits with.
struct Appender {
    store: Arc<dyn EventStore>,
    projector: Arc<dyn Projector>,
    key: Arc<LogKey>,
    clock: Arc<dyn Clock>,
    ids: Arc<dyn IdSource>,
    /// The simulator's injected commit faults.
    faults: CommitFaults,
    /// Where a commit's [`Receipt`] reports that its answers were let go.
    answered: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Appender {
    /// The receipt every answer of `commit` holds.
    fn receipt(&self, commit: u64) -> Arc<Receipt> {
        Arc::new(Receipt { commit, answered: self.answered.clone() })
    }
}

/// Shared by every answer ([`AppendResult`]) one commit gave; dropped when the last of them is,
/// which moves [`Log::answered`] to the commit (never back).
#[derive(Debug)]
pub(crate) struct Receipt {
    commit: u64,
    answered: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Drop for Receipt {
    fn drop(&mut self) {
        let commit = self.commit;
        self.answered.send_if_modified(|at| {
            let newer = *at < commit;
            if newer {
                *at = commit;
            }
            newer
        });
    }
}

/// The appender: takes jobs from the queue in batches, decides, signs and commits them, and
/// answers each. Decisions are pipelined with commits: while one batch's commit
/// waits for the database (on SQLite its fsync), the jobs that arrive are pre-read and decided
/// on top of it, as if it had committed (its heads, stream versions and idempotency keys laid
/// over what the database says), and signed, in chunks as they come; when the commit lands,
/// every chunk decided meanwhile is committed together as the next batch. If the commit did not
/// land (a head moved under it, or it failed), what was decided on top of it is thrown away
/// and those jobs are decided again from the database. A chunk built on a wrong guess can never
/// be written: its commit checks the chain heads it was decided on, under the lock.
async fn run_appender(
    mut receiver: mpsc::Receiver<Job>,
    appender: Appender,
    stats: Arc<LogStats>,
    notify: tokio::sync::watch::Sender<u64>,
) {
    let mut carried: Option<Job> = None;
    // The batch being committed, in a task of its own.
    let mut committing: Option<Committing> = None;
    // Chunks decided on top of it (and of each other), in order.
    let mut decided: Vec<Decided> = Vec::new();
    loop {
        let Some(in_flight) = committing.as_mut() else {
            if !decided.is_empty() {
                let merged = merge(std::mem::take(&mut decided));
                if merged.batch.events.is_empty() {
                    // Refusals and replays only, decided on a commit that has landed since.
                    let Decided { jobs, batch, outcomes } = merged;
                    answer(&appender, jobs, &batch, outcomes, ProjectedRows::new(), None).await;
                } else {
                    committing = Some(Committing::start(&appender, merged));
                }
                continue;
            }
            let Some(first) = next_job(&mut carried, &mut receiver).await else { return };
            let jobs = gather(first, BATCH_EVENTS_MAX, &mut carried, &mut receiver);
            if let Some(chunk) = decide_chunk(&appender, &stats, jobs, &[]).await {
                decided.push(chunk);
            }
            continue;
        };
        let decided_events: usize = decided.iter().map(|d| d.batch.events.len()).sum();
        let room = BATCH_EVENTS_MAX.saturating_sub(decided_events);
        tokio::select! {
            biased;
            done = &mut in_flight.task => {
                let landed = committing.take().expect("a commit in flight");
                if let Some(commit) = settle(&appender, &stats, landed, done, &mut decided).await {
                    notify.send_replace(commit);
                }
            }
            job = next_job(&mut carried, &mut receiver), if room > 0 => {
                let Some(first) = job else {
                    // Every handle is gone: finish what is in flight, then stop.
                    let mut landed = committing.take().expect("a commit in flight");
                    let done = (&mut landed.task).await;
                    if let Some(commit) = settle(&appender, &stats, landed, done, &mut decided).await {
                        notify.send_replace(commit);
                    }
                    for chunk in std::mem::take(&mut decided) {
                        if let Some(commit) = process_batch(&appender, &stats, chunk.jobs).await {
                            notify.send_replace(commit);
                        }
                    }
                    return;
                };
                let jobs = gather(first, room, &mut carried, &mut receiver);
                let mut under: Vec<&PreparedBatch> = vec![&in_flight.decided.batch];
                under.extend(decided.iter().map(|d| &d.batch));
                if let Some(chunk) = decide_chunk(&appender, &stats, jobs, &under).await {
                    decided.push(chunk);
                }
            }
        }
    }
}

/// The next job: the one carried over from the last gathering, else the queue's next.
async fn next_job(carried: &mut Option<Job>, receiver: &mut mpsc::Receiver<Job>) -> Option<Job> {
    match carried.take() {
        Some(job) => Some(job),
        None => receiver.recv().await,
    }
}

/// `first` and the jobs already queued behind it, up to `events_max` events (at least `first`);
/// the job that would overflow is carried to the next gathering.
fn gather(first: Job, events_max: usize, carried: &mut Option<Job>, receiver: &mut mpsc::Receiver<Job>) -> Vec<Job> {
    let mut events = first.events();
    let mut jobs = vec![first];
    while let Ok(job) = receiver.try_recv() {
        if events + job.events() > events_max {
            *carried = Some(job);
            break;
        }
        events += job.events();
        jobs.push(job);
    }
    jobs
}

/// Jobs decided, hashed and signed, waiting for their commit.
struct Decided {
    jobs: Vec<Job>,
    batch: PreparedBatch,
    outcomes: Vec<Outcome>,
}

/// A decided batch whose commit runs in a task of its own.
struct Committing {
    decided: Decided,
    task: tokio::task::JoinHandle<Result<CommitOutcome>>,
    started: std::time::Instant,
}

impl Committing {
    fn start(appender: &Appender, decided: Decided) -> Self {
        let (store, projector, batch) = (appender.store.clone(), appender.projector.clone(), decided.batch.clone());
        let faults = appender.faults.clone();
        let task = tokio::spawn(async move { commit(&*store, &batch, projector.as_ref(), &faults).await });
        Self { decided, task, started: stopwatch() }
    }
}

/// Pre-reads and decides `jobs` on top of the batches `under` (decided, not yet known to be
/// committed, oldest first). `None` when the pre-read failed (every job answered with its
/// error) or when nothing needs a commit (every job answered: refused or replayed).
async fn decide_chunk(appender: &Appender, stats: &LogStats, jobs: Vec<Job>, under: &[&PreparedBatch]) -> Option<Decided> {
    use std::sync::atomic::Ordering::Relaxed;
    let phase = stopwatch();
    let mut pre = match appender.store.preread(&pre_read_query(&jobs)).await {
        Ok(pre) => pre,
        Err(e) => {
            fail_all(jobs, &e);
            return None;
        }
    };
    for batch in under {
        lay_over(&mut pre, batch);
    }
    stats.preread_us.fetch_add(phase.elapsed().as_micros() as u64, Relaxed);
    let phase = stopwatch();
    let (batch, outcomes) = match decide_signed(appender, pre, &jobs).await {
        Ok(decided) => decided,
        Err(e) => {
            fail_all(jobs, &e);
            return None;
        }
    };
    stats.decide_us.fetch_add(phase.elapsed().as_micros() as u64, Relaxed);
    if batch.events.is_empty() && under.is_empty() {
        // Nothing to write and nothing in flight it could depend on: answer now.
        answer(appender, jobs, &batch, outcomes, ProjectedRows::new(), None).await;
        return None;
    }
    Some(Decided { jobs, batch, outcomes })
}

/// [`decide_jobs`] for `jobs` on `pre`, now: on this task for a few events (a few signatures
/// cost less than a hop to the blocking pool), on the blocking pool for more.
async fn decide_signed(appender: &Appender, pre: PreRead, jobs: &[Job]) -> Result<(PreparedBatch, Vec<Outcome>)> {
    let (requests, sizes) = flatten(jobs);
    let (key, clock, ids) = (appender.key.clone(), appender.clock.clone(), appender.ids.clone());
    if jobs.iter().map(Job::events).sum::<usize>() < PARALLEL_SIGNING_EVENTS_MIN {
        return Ok(decide_jobs(&pre, &requests, &sizes, &key, clock.now_ms(), &*ids));
    }
    tokio::task::spawn_blocking(move || decide_jobs(&pre, &requests, &sizes, &key, clock.now_ms(), &*ids))
        .await
        .map_err(|e| Error::Internal(format!("appender task: {e}")))
}

/// The state after `batch` commits, laid over a pre-read: its chain heads, the versions of the
/// streams it wrote and its idempotency keys.
fn lay_over(pre: &mut PreRead, batch: &PreparedBatch) {
    for (tenant, head) in &batch.heads_after {
        pre.heads.insert(*tenant, *head);
    }
    for event in &batch.events {
        let envelope = &event.envelope;
        pre.stream_versions.insert((envelope.tenant, envelope.stream.clone()), envelope.version);
    }
    for (tenant, key, record) in &batch.idempotency {
        pre.idempotency.insert((*tenant, key.clone()), *record);
    }
}

/// Chunks decided one on top of another, as one batch for one commit: their events in order
/// (positions renumbered; a position is not part of what is hashed or signed), each tenant's
/// head before the first chunk that touched it and after the last.
fn merge(chunks: Vec<Decided>) -> Decided {
    let mut merged = Decided { jobs: Vec::new(), batch: PreparedBatch::default(), outcomes: Vec::new() };
    for chunk in chunks {
        let (events_at, requests_at) = (merged.batch.events.len(), merged.outcomes.len());
        for mut event in chunk.batch.events {
            event.position.index = merged.batch.events.len() as u32;
            merged.batch.events.push(event);
        }
        for (tenant, before) in chunk.batch.heads_before {
            if !merged.batch.heads_before.iter().any(|(t, _)| *t == tenant) {
                merged.batch.heads_before.push((tenant, before));
            }
        }
        for (tenant, after) in chunk.batch.heads_after {
            match merged.batch.heads_after.iter_mut().find(|(t, _)| *t == tenant) {
                Some(slot) => slot.1 = after,
                None => merged.batch.heads_after.push((tenant, after)),
            }
        }
        merged.batch.idempotency.extend(chunk.batch.idempotency);
        merged.outcomes.extend(chunk.outcomes.into_iter().map(|outcome| match outcome {
            Outcome::Append(range) => Outcome::Append(range.start + events_at..range.end + events_at),
            Outcome::ReplayOfJob(first) => Outcome::ReplayOfJob(first + requests_at),
            other => other,
        }));
        merged.jobs.extend(chunk.jobs);
    }
    merged
}

/// Ends a batch's commit (`done`: its task's outcome): counts its time, answers its jobs when
/// it landed; when it did not, decides them again
/// from the database as the sequential path does (and so also every chunk `decided` on top of
/// it, which is thrown away). Returns the newest commit made.
async fn settle(
    appender: &Appender,
    stats: &LogStats,
    landed: Committing,
    done: std::result::Result<Result<CommitOutcome>, tokio::task::JoinError>,
    decided: &mut Vec<Decided>,
) -> Option<u64> {
    use std::sync::atomic::Ordering::Relaxed;
    let commit_us = landed.started.elapsed().as_micros() as u64;
    stats.commit_us.fetch_add(commit_us, Relaxed);
    let mut batch = landed.decided;
    let done = done.unwrap_or_else(|e| Err(Error::Internal(format!("appender commit task: {e}"))));
    let newest = match done {
        Ok(CommitOutcome::Committed { commit, rows }) => {
            set_commit(&mut batch.batch, commit);
            stats.committed(batch.batch.events.len(), commit_us);
            tracing::debug!(jobs = batch.jobs.len(), events = batch.batch.events.len(), commit, "append batch");
            answer(appender, batch.jobs, &batch.batch, batch.outcomes, rows, Some(commit)).await;
            return Some(commit);
        }
        Ok(CommitOutcome::Stale) => {
            stats.stale.fetch_add(1, Relaxed);
            tracing::debug!("a chain head moved under the batch; deciding it and what was decided on it again");
            process_batch(appender, stats, batch.jobs).await
        }
        Err(e) => split_failed(appender, stats, batch.jobs, e).await,
    };
    let mut newest = newest;
    for chunk in std::mem::take(decided) {
        newest = newest.max(process_batch(appender, stats, chunk.jobs).await);
    }
    newest
}

/// The start of one of the appender's phase timings (`LogStats`): a duration measured to be
/// reported, never an input to a decision, so the wall clock is allowed here (clippy.toml).
#[allow(clippy::disallowed_methods)]
fn stopwatch() -> std::time::Instant {
    std::time::Instant::now()
}

async fn process_batch(appender: &Appender, stats: &LogStats, jobs: Vec<Job>) -> Option<u64> {
    let Appender { store, projector, key, clock, ids, faults, answered: _ } = appender;
    let store = &**store;
    let mut decided = None;
    let started = stopwatch();
    let mut timings = [0u128; 3];
    for _attempt in 0..OPTIMISTIC_ATTEMPTS_MAX {
        let phase = stopwatch();
        let pre = match store.preread(&pre_read_query(&jobs)).await {
            Ok(pre) => pre,
            Err(e) => return fail_all(jobs, &e),
        };
        timings[0] += phase.elapsed().as_micros();
        let phase = stopwatch();
        let (mut batch, outcomes) = match decide_signed(appender, pre, &jobs).await {
            Ok(decided) => decided,
            Err(e) => return fail_all(jobs, &e),
        };
        timings[1] += phase.elapsed().as_micros();
        if batch.events.is_empty() {
            decided = Some((batch, outcomes, ProjectedRows::new()));
            break;
        }
        let phase = stopwatch();
        let committed = commit(store, &batch, projector.as_ref(), faults).await;
        timings[2] += phase.elapsed().as_micros();
        match committed {
            Ok(CommitOutcome::Committed { commit, rows }) => {
                set_commit(&mut batch, commit);
                decided = Some((batch, outcomes, rows));
                break;
            }
            Ok(CommitOutcome::Stale) => {
                stats.stale.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!("a chain head moved under the batch; deciding it again")
            }
            Err(e) => return split_failed(appender, stats, jobs, e).await,
        }
    }
    let (batch, outcomes, rows) = match decided {
        Some(decided) => decided,
        None => {
            // Contended: decide under the lock.
            let (requests, sizes) = flatten(&jobs);
            let mut outcomes = Vec::new();
            let now_ms = clock.now_ms();
            let mut decide_locked = |pre: &PreRead| {
                let (batch, decided) = decide_jobs(pre, &requests, &sizes, key, now_ms, &**ids);
                outcomes = decided;
                batch
            };
            match commit_locked(store, &pre_read_query(&jobs), &mut decide_locked, projector.as_ref()).await {
                Ok((commit, mut batch, rows)) => {
                    set_commit(&mut batch, commit);
                    (batch, outcomes, rows)
                }
                Err(e) => return split_failed(appender, stats, jobs, e).await,
            }
        }
    };
    {
        use std::sync::atomic::Ordering::Relaxed;
        stats.committed(batch.events.len(), timings[2] as u64);
        stats.preread_us.fetch_add(timings[0] as u64, Relaxed);
        stats.decide_us.fetch_add(timings[1] as u64, Relaxed);
        stats.commit_us.fetch_add(timings[2] as u64, Relaxed);
    }
    tracing::debug!(
        jobs = jobs.len(),
        events = batch.events.len(),
        preread_us = timings[0] as u64,
        decide_us = timings[1] as u64,
        commit_us = timings[2] as u64,
        total_us = started.elapsed().as_micros() as u64,
        "append batch"
    );
    let commit = batch.events.first().map(|e| e.position.commit).filter(|commit| *commit > 0);
    answer(appender, jobs, &batch, outcomes, rows, commit).await;
    commit
}

/// Answers every job of a batch that was committed as `commit` (or needed no commit): each
/// request its events and the rows they touched, a replay the events it names, a refusal its
/// error. The answers of a commit share its [`Receipt`].
async fn answer(
    appender: &Appender,
    mut jobs: Vec<Job>,
    batch: &PreparedBatch,
    outcomes: Vec<Outcome>,
    rows: ProjectedRows,
    commit: Option<u64>,
) {
    let (store, projector) = (appender.store.as_ref(), appender.projector.as_ref());
    let receipt = commit.map(|commit| appender.receipt(commit));
    let mut rows = AnsweredRows::new(projector, batch, &outcomes, rows);
    let ranges: Vec<Option<std::ops::Range<usize>>> = outcomes
        .iter()
        .map(|o| match o {
            Outcome::Append(range) => Some(range.clone()),
            _ => None,
        })
        .collect();
    let mut outcomes = outcomes.into_iter();
    for job in jobs.drain(..) {
        // A group's members are all appended or all refused (`decide_jobs`).
        let mut answer = Ok(Vec::with_capacity(job.requests.len()));
        for outcome in outcomes.by_ref().take(job.requests.len()) {
            let result = match outcome {
                Outcome::Append(range) => {
                    let events = &batch.events[range];
                    Ok(AppendResult {
                        events: events.to_vec(),
                        replayed: false,
                        rows: rows.next_answer(),
                        _receipt: receipt.clone(),
                    })
                }
                Outcome::ReplayOfJob(first) => Ok(AppendResult {
                    events: ranges[first].clone().map(|r| batch.events[r].to_vec()).unwrap_or_default(),
                    replayed: true,
                    rows: Vec::new(),
                    _receipt: receipt.clone(),
                }),
                Outcome::Replay { tenant, first_seq, last_seq } => read_replay(store, tenant, first_seq, last_seq).await,
                Outcome::Refused(e) => Err(e),
            };
            answer = match (answer, result) {
                (Ok(mut results), Ok(result)) => {
                    results.push(result);
                    Ok(results)
                }
                (Err(e), _) | (Ok(_), Err(e)) => Err(e),
            };
        }
        let _ = job.reply.send(answer);
    }
}

/// Writes a decided batch: the one place outside the backends that opens an append
/// transaction (the [`WriteToken`] is made here).
/// The simulator's injected commit faults ([`Log::commits_fail`], [`Log::commit_answers_lost`]):
/// how many more append transactions fail, and how many more commit and lose their answer.
/// Both are 0 outside the simulator.
#[derive(Clone)]
struct CommitFaults {
    to_fail: Arc<std::sync::atomic::AtomicU64>,
    answers_to_lose: Arc<std::sync::atomic::AtomicU64>,
}

impl CommitFaults {
    /// Takes one from `count` if it is not 0.
    fn take(count: &std::sync::atomic::AtomicU64) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        count.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok()
    }
}

/// Commits `batch` in a write transaction of its own (a failing commit, when one is injected,
/// makes its writes and rolls back; a lost answer commits and then reports
/// [`Error::Indeterminate`]).
async fn commit(
    store: &dyn EventStore,
    batch: &PreparedBatch,
    projector: &dyn Projector,
    faults: &CommitFaults,
) -> Result<CommitOutcome> {
    let fail = CommitFaults::take(&faults.to_fail);
    let mut tx = store.transaction(WriteToken(())).await?;
    match engine::commit(&mut *tx, batch, projector, fail).await {
        Ok(CommitOutcome::Committed { .. }) if CommitFaults::take(&faults.answers_to_lose) => {
            Err(Error::Indeterminate(COMMIT_ANSWER_LOST.into()))
        }
        other => other,
    }
}

async fn commit_locked(
    store: &dyn EventStore,
    query: &PreReadQuery,
    decide: &mut (dyn for<'p> FnMut(&'p PreRead) -> PreparedBatch + Send),
    projector: &dyn Projector,
) -> Result<(u64, PreparedBatch, ProjectedRows)> {
    let mut tx = store.transaction(WriteToken(())).await?;
    engine::commit_locked(&mut *tx, query, decide, projector).await
}

/// The rows a commit left (`projected`), handed to the answers of the requests whose events
/// touched them: a row one request touched moves into its answer, and a row several touched
/// is copied for all but the last of them (a document is a tree of allocations; copying every
/// one was 1.5 % of the reservations bench's samples).
struct AnsweredRows {
    projected: ProjectedRows,
    /// The rows each appended request's events touched, in the order of the outcomes, each
    /// with whether this is the last answer that takes it.
    touched: std::collections::VecDeque<Vec<(RowKey, bool)>>,
}

impl AnsweredRows {
    fn new(projector: &dyn Projector, batch: &PreparedBatch, outcomes: &[Outcome], projected: ProjectedRows) -> Self {
        if projected.is_empty() {
            return Self { projected, touched: Default::default() };
        }
        let lists: Vec<Vec<RowKey>> = outcomes
            .iter()
            .filter_map(|outcome| match outcome {
                Outcome::Append(range) => Some(touched_rows(projector, &batch.events[range.clone()])),
                _ => None,
            })
            .collect();
        // From the last answer back: a row not yet seen is taken for the last time here.
        let mut later = std::collections::HashSet::new();
        let mut last: Vec<Vec<bool>> =
            lists.iter().rev().map(|keys| keys.iter().map(|key| later.insert(key)).collect()).collect();
        last.reverse();
        let touched = lists.into_iter().zip(last).map(|(keys, last)| keys.into_iter().zip(last).collect()).collect();
        Self { projected, touched }
    }

    /// The rows the next appended request's events touched (outcomes taken in order), as the
    /// commit left them.
    fn next_answer(&mut self) -> Vec<(RowKey, Option<serde_json::Value>)> {
        let Some(keys) = self.touched.pop_front() else { return Vec::new() };
        keys.into_iter()
            .filter_map(|(key, last)| {
                let doc = if last { self.projected.remove(&key) } else { self.projected.get(&key).cloned() };
                doc.map(|doc| (key, doc))
            })
            .collect()
    }
}

fn set_commit(batch: &mut PreparedBatch, commit: u64) {
    for event in &mut batch.events {
        event.position.commit = commit;
    }
}

async fn read_replay(store: &dyn EventStore, tenant: TenantId, first_seq: u64, last_seq: u64) -> Result<AppendResult> {
    let count = last_seq - first_seq + 1;
    let mut events = Vec::new();
    let mut from = first_seq;
    while (events.len() as u64) < count {
        let limit = (count - events.len() as u64).min(u64::from(READ_ROWS_MAX)) as u32;
        let page = decode_rows(store.read_chain_rows(tenant, from, limit).await?)?;
        if page.is_empty() {
            return Err(Error::Corrupt {
                tenant: tenant.to_string(),
                seq: from,
                what: "idempotency record points at a missing event".into(),
            });
        }
        from += page.len() as u64;
        events.extend(page);
    }
    Ok(AppendResult { events, replayed: true, rows: Vec::new(), _receipt: None })
}

/// A batch whose commit failed. One request can be the cause (its projection fold refused its
/// event, inside the transaction), and it must not fail the others, other tenants' included:
/// with more than one request, each half is processed again on its own, so the cause ends up
/// alone with the error and the rest commit (at most `2n - 1` attempts for `n` requests). A
/// database that is unavailable fails every request at once, and a commit whose answer was lost
/// ([`Error::Indeterminate`]) answers every request so: it may have been made, and a request
/// without an idempotency key tried again here could be made twice. The next batch is decided
/// from what the database says then (its pre-read, on whichever primary the pool reaches),
/// never from this batch's heads. Returns the newest commit made.
async fn split_failed(appender: &Appender, stats: &LogStats, mut jobs: Vec<Job>, error: Error) -> Option<u64> {
    if jobs.len() < 2 || matches!(error, Error::Unavailable(_) | Error::Indeterminate(_)) {
        return fail_all(jobs, &error);
    }
    tracing::warn!(error = %error, jobs = jobs.len(), "append batch failed; trying its halves apart");
    let second = jobs.split_off(jobs.len() / 2);
    let first = Box::pin(process_batch(appender, stats, jobs)).await;
    let second = Box::pin(process_batch(appender, stats, second)).await;
    first.max(second)
}

fn fail_all(jobs: Vec<Job>, error: &Error) -> Option<u64> {
    tracing::error!(error = %error, jobs = jobs.len(), "append batch failed");
    for job in jobs {
        let _ = job.reply.send(Err(error.clone()));
    }
    None
}

fn pre_read_query(jobs: &[Job]) -> PreReadQuery {
    let mut query = PreReadQuery::default();
    let mut tenants = std::collections::HashSet::new();
    let mut streams = std::collections::HashSet::new();
    let mut keys = std::collections::HashSet::new();
    for r in jobs.iter().flat_map(|job| &job.requests) {
        if tenants.insert(r.tenant) {
            query.tenants.push(r.tenant);
        }
        for stream in std::iter::once(&r.stream).chain(r.guards.iter().map(|(s, _)| s)) {
            if streams.insert((r.tenant, stream.clone())) {
                query.streams.push((r.tenant, stream.clone()));
            }
        }
        if let Some(k) = &r.idempotency_key
            && keys.insert((r.tenant, k.clone()))
        {
            query.idempotency_keys.push((r.tenant, k.clone()));
        }
    }
    query
}

/// Every job's requests in one list, and how many each job holds.
fn flatten(jobs: &[Job]) -> (Vec<AppendRequest>, Vec<usize>) {
    (jobs.iter().flat_map(|j| j.requests.iter().cloned()).collect(), jobs.iter().map(|j| j.requests.len()).collect())
}

/// [`decide`] for jobs: `requests` are the jobs' requests in order, `sizes[j]` of them job
/// `j`'s. A group (a job of more than one) with a refused member is refused whole: each of its
/// members gets the first refusal's error, and the rest of the batch is decided again without
/// it (rare: a group is a reconciler's, decided on what it read). One outcome per request, in
/// order, [`Outcome::ReplayOfJob`] naming an index of `requests`.
fn decide_jobs(
    pre: &PreRead,
    requests: &[AppendRequest],
    sizes: &[usize],
    key: &LogKey,
    now_ms: u64,
    ids: &dyn IdSource,
) -> (PreparedBatch, Vec<Outcome>) {
    let starts: Vec<usize> = sizes.iter().scan(0, |at, n| Some(std::mem::replace(at, *at + n))).collect();
    // The error each refused group was refused with.
    let mut refused: HashMap<usize, Error> = HashMap::new();
    loop {
        // The requests of the jobs still in, and where each sits in `requests`.
        let kept: Vec<usize> =
            (0..sizes.len()).filter(|j| !refused.contains_key(j)).flat_map(|j| starts[j]..starts[j] + sizes[j]).collect();
        let subset: Vec<&AppendRequest> = kept.iter().map(|&i| &requests[i]).collect();
        let (batch, outcomes) = decide(pre, &subset, key, now_ms, ids);
        let mut at = 0;
        let mut newly_refused = Vec::new();
        for job in (0..sizes.len()).filter(|j| !refused.contains_key(j)) {
            let mine = &outcomes[at..at + sizes[job]];
            at += sizes[job];
            if sizes[job] > 1
                && let Some(Outcome::Refused(e)) = mine.iter().find(|o| matches!(o, Outcome::Refused(_)))
            {
                newly_refused.push((job, e.clone()));
            }
        }
        if !newly_refused.is_empty() {
            refused.extend(newly_refused);
            continue;
        }
        let mut decided = outcomes.into_iter();
        let mut out = Vec::with_capacity(requests.len());
        for (job, &size) in sizes.iter().enumerate() {
            match refused.get(&job) {
                Some(e) => out.extend((0..size).map(|_| Outcome::Refused(e.clone()))),
                None => out.extend(decided.by_ref().take(size).map(|o| match o {
                    Outcome::ReplayOfJob(first) => Outcome::ReplayOfJob(kept[first]),
                    other => other,
                })),
            }
        }
        return (batch, out);
    }
}

/// Decides every request of a batch against the pre-read state, then hashes and signs the
/// accepted events. Pure: the time is passed in and event ids come from `ids`.
fn decide(
    pre: &PreRead,
    requests: &[&AppendRequest],
    key: &LogKey,
    now_ms: u64,
    ids: &dyn IdSource,
) -> (PreparedBatch, Vec<Outcome>) {
    let mut deciding = Deciding {
        pre,
        now_ms,
        ids,
        batch: PreparedBatch::default(),
        heads: HashMap::new(),
        versions: HashMap::new(),
        keys_in_batch: HashMap::new(),
    };
    let outcomes = requests.iter().enumerate().map(|(job_index, request)| deciding.request(job_index, request)).collect();
    let Deciding { mut batch, heads, .. } = deciding;
    batch.heads_after =
        batch.heads_before.iter().map(|(tenant, _)| (*tenant, heads[tenant].expect("accepted tenants have a head"))).collect();
    sign_all(&mut batch.events, key);
    (batch, outcomes)
}

/// The working state of [`decide`]: the pre-read state as the batch's accepted requests so far
/// leave it.
struct Deciding<'a> {
    pre: &'a PreRead,
    now_ms: u64,
    ids: &'a dyn IdSource,
    batch: PreparedBatch,
    heads: HashMap<TenantId, Option<Head>>,
    versions: HashMap<(TenantId, String), u64>,
    /// (tenant, key) → (request hash, job index) for keys first used in this batch.
    keys_in_batch: HashMap<(TenantId, String), ([u8; 32], usize)>,
}

impl Deciding<'_> {
    /// One request's outcome: a replay, a refusal, or its events added to the batch (and the
    /// working state advanced past them).
    fn request(&mut self, job_index: usize, request: &AppendRequest) -> Outcome {
        // Only idempotent appends need the request's hash (an encoding of every event).
        let request_hash = match request.idempotency_key.as_ref().map(|_| request.request_hash()).transpose() {
            Ok(h) => h.unwrap_or_default(),
            Err(e) => return Outcome::Refused(e),
        };
        if let Some(replayed) = self.replayed(request, request_hash) {
            return replayed;
        }
        let current = match self.admitted(request) {
            Ok(current) => current,
            Err(e) => return Outcome::Refused(e),
        };
        let mut written = self.written_streams(request, current);
        let head_before = *self.heads.entry(request.tenant).or_insert_with(|| self.pre.heads.get(&request.tenant).copied());
        let (built, head_after) = match self.build(request, head_before, &mut written) {
            Ok(built) => built,
            Err(e) => return Outcome::Refused(e),
        };
        // Accepted: advance the working state.
        let first_seq = built[0].envelope.seq;
        let start = self.batch.events.len();
        for (i, mut event) in built.into_iter().enumerate() {
            event.position.index = (start + i) as u32;
            self.batch.events.push(event);
        }
        let end = self.batch.events.len();
        self.heads.insert(request.tenant, Some(head_after));
        for (stream, version) in written {
            self.versions.insert((request.tenant, stream), version);
        }
        if !self.batch.heads_before.iter().any(|(t, _)| *t == request.tenant) {
            self.batch.heads_before.push((request.tenant, head_before));
        }
        if let Some(idem) = &request.idempotency_key {
            self.keys_in_batch.insert((request.tenant, idem.clone()), (request_hash, job_index));
            let record = IdempotencyRecord { request_hash, first_seq, last_seq: head_after.seq };
            self.batch.idempotency.push((request.tenant, idem.clone(), record));
        }
        Outcome::Append(start..end)
    }

    /// The answer to a request whose idempotency key was used before, stored or earlier in this
    /// batch: a replay of the same request, a conflict for another.
    fn replayed(&self, request: &AppendRequest, request_hash: [u8; 32]) -> Option<Outcome> {
        let idem = request.idempotency_key.as_ref()?;
        let slot = (request.tenant, idem.clone());
        let conflict = || Outcome::Refused(Error::IdempotencyConflict { key: idem.clone() });
        if let Some(record) = self.pre.idempotency.get(&slot) {
            return Some(if record.request_hash == request_hash {
                Outcome::Replay { tenant: request.tenant, first_seq: record.first_seq, last_seq: record.last_seq }
            } else {
                conflict()
            });
        }
        let (hash, first_job) = self.keys_in_batch.get(&slot)?;
        Some(if *hash == request_hash { Outcome::ReplayOfJob(*first_job) } else { conflict() })
    }

    /// A stream's version as the batch so far leaves it.
    fn version(&self, tenant: TenantId, stream: &str) -> u64 {
        let slot = (tenant, stream.to_owned());
        self.versions.get(&slot).copied().unwrap_or_else(|| self.pre.stream_versions.get(&slot).copied().unwrap_or(0))
    }

    /// Checks the request's guards, its expected version and that every stream its events name
    /// is guarded; the request's stream's current version, or why it is refused.
    fn admitted(&mut self, request: &AppendRequest) -> Result<u64> {
        let guard_failed = request.guards.iter().find_map(|(stream, expected)| {
            let current = self.version(request.tenant, stream);
            (!expected.admits(current)).then(|| Error::Conflict {
                stream: stream.clone(),
                expected: expected.to_string(),
                actual: current,
            })
        });
        if let Some(conflict) = guard_failed {
            return Err(conflict);
        }
        let stream_slot = (request.tenant, request.stream.clone());
        let pre = self.pre;
        let current = *self
            .versions
            .entry(stream_slot.clone())
            .or_insert_with(|| pre.stream_versions.get(&stream_slot).copied().unwrap_or(0));
        if !request.expected.admits(current) {
            return Err(Error::Conflict {
                stream: request.stream.clone(),
                expected: request.expected.to_string(),
                actual: current,
            });
        }
        // An event on another stream must name it among the guards: only a guard's version is
        // read (and checked) before the append, so an unguarded one would take a version the
        // stream already has and fail at the commit as a broken constraint, far from its cause.
        if let Some(unguarded) = request
            .events
            .iter()
            .filter_map(|e| e.stream.as_ref())
            .find(|other| **other != request.stream && !request.guards.iter().any(|(guarded, _)| guarded == *other))
        {
            return Err(Error::Internal(format!(
                "an event of the append on {} names stream {unguarded}, which is not among its guards",
                request.stream
            )));
        }
        Ok(current)
    }

    /// Every stream this request writes, at its version before the request; its own stream
    /// (at `current`) first.
    fn written_streams(&self, request: &AppendRequest, current: u64) -> Vec<(String, u64)> {
        let mut written: Vec<(String, u64)> = vec![(request.stream.clone(), current)];
        for event in &request.events {
            if let Some(other) = &event.stream
                && !written.iter().any(|(s, _)| s == other)
            {
                written.push((other.clone(), self.version(request.tenant, other)));
            }
        }
        written
    }

    /// The request's events, chained from `head_before` and hashed (not yet signed), each at
    /// the next version of its stream in `written`; and the head they leave. Refused when an
    /// event does not encode or is larger than [`PAYLOAD_BYTES_MAX`].
    fn build(
        &self,
        request: &AppendRequest,
        head_before: Option<Head>,
        written: &mut [(String, u64)],
    ) -> Result<(Vec<StoredEvent>, Head)> {
        let (mut seq, mut prev) = head_before.map(|h| (h.seq, h.hash)).unwrap_or((0, GENESIS_PREV));
        let mut built = Vec::with_capacity(request.events.len());
        for new in &request.events {
            let stream = new.stream.as_ref().unwrap_or(&request.stream);
            let version = {
                let slot = written.iter_mut().find(|(s, _)| s == stream).expect("every written stream is listed");
                slot.1 += 1;
                slot.1
            };
            let envelope = Envelope {
                tenant: request.tenant,
                seq: seq + 1,
                id: EventId::from_ulid(self.ids.ulid()),
                stream: stream.clone(),
                version,
                event_type: new.event_type.clone(),
                at_ms: self.now_ms,
                actor: request.actor.clone(),
                idempotency_key: request.idempotency_key.clone(),
                causation: request.causation.clone(),
                correlation: request.correlation.clone(),
                payload: new.payload.clone(),
                prev,
            };
            let canonical = envelope.to_canonical()?;
            if canonical.len() > PAYLOAD_BYTES_MAX {
                return Err(Error::PayloadTooLarge { limit_bytes: PAYLOAD_BYTES_MAX });
            }
            let hash = sha256(&canonical);
            seq += 1;
            prev = hash;
            built.push(StoredEvent {
                envelope,
                canonical,
                hash,
                sig: Vec::new(),
                key_id: String::new(),
                position: Position::default(),
            });
        }
        Ok((built, Head { seq, hash: prev }))
    }
}

/// Threads a large batch is signed on: the cores this process may use, at most 4. Asked once:
/// `available_parallelism` reads the cgroup's CPU quota from `/proc` and `/sys` (four files) on
/// every call, which every batch paid (four `openat` per append in `sim run`'s `strace`).
fn signing_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(4))
}

/// Signs the events that carry a signature (`schema/LOG-FORMAT.md`, "Signature"): the last
/// event of each chain in the batch (the head it leaves, which covers every event of that chain
/// before it through their `prev` links), and the ones [`signed_alone`] names. The others keep an
/// empty `sig` and `key_id`. On both cores when there are enough signatures to pay for a thread.
fn sign_all(events: &mut [StoredEvent], key: &LogKey) {
    let mut last_of: Vec<(TenantId, usize)> = Vec::new();
    for (i, event) in events.iter().enumerate() {
        match last_of.iter_mut().find(|(t, _)| *t == event.envelope.tenant) {
            Some(slot) => slot.1 = i,
            None => last_of.push((event.envelope.tenant, i)),
        }
    }
    let mut to_sign: Vec<&mut StoredEvent> = events
        .iter_mut()
        .enumerate()
        .filter(|(i, e)| {
            signed_alone(e.envelope.seq, &e.envelope.event_type)
                || last_of.iter().any(|(t, last)| *t == e.envelope.tenant && last == i)
        })
        .map(|(_, e)| e)
        .collect();
    let sign = |chunk: &mut [&mut StoredEvent]| {
        for event in chunk {
            event.sig = key.sign_event_hash(&event.hash).to_vec();
            event.key_id = key.key_id().to_owned();
        }
    };
    if to_sign.len() < PARALLEL_SIGNING_EVENTS_MIN || signing_threads() < 2 {
        sign(&mut to_sign);
        return;
    }
    let chunk = to_sign.len().div_ceil(signing_threads());
    std::thread::scope(|scope| {
        for part in to_sign.chunks_mut(chunk) {
            scope.spawn(move || sign(part));
        }
    });
}
