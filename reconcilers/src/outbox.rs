//! The outbox consumer framework: a named [`Consumer`] turns committed events into work items
//! (fan-out) and does each item (handle); [`run`] drives both against the database, in as many
//! processes as you like.
//!
//! - **Fan-out** reads the log by outbox position from the consumer's durable cursor, under the
//!   cursor's lease (one process at a time), and writes the items with the cursor move in one
//!   transaction. Item ids are deterministic, so a fan-out redone after a crash adds nothing.
//! - **Work** is claimed in leases (`FOR UPDATE SKIP LOCKED` on PostgreSQL), so processes split
//!   it; an item whose process died is claimed again when its lease runs out. Delivery is at
//!   least once: handlers must be idempotent.
//! - **Failures** are retried on [`RetryPolicy`]'s schedule (exponential, with jitter); after the
//!   last attempt an item is dead, where an operator sees it and can queue it again.
//!
//! Time comes from the [`Clock`]; jitter from a seeded generator, so a schedule replays.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bc_core::Result;
use bc_core::clock::Clock;
use bc_core::event::{EventRow, Position};
use bc_core::store::outbox::{
    ATTEMPT_ERROR_CHARS_MAX, Attempt, CLAIM_ITEMS_MAX, Claim, Completion, NewWorkItem, Outcome, WorkItem,
};
use bc_core::store::{EventStore, READ_ROWS_MAX};
use rand::{Rng, RngExt, SeedableRng};

use crate::status::PassRecorder;

/// How long done items are kept by default: a week.
pub const RETENTION_MS_DEFAULT: u64 = 7 * 24 * 3600 * 1000;
/// How often a runner prunes, and how many items one prune deletes at most.
const PRUNE_EVERY_MS: u64 = 10 * 60 * 1000;
const PRUNE_ITEMS_MAX: u32 = 1_000;

/// Events one fan-out step reads.
pub const FAN_OUT_EVENTS_MAX: u32 = 256;
/// Items one fan-out step writes (in one transaction), unless a single event makes more.
pub const FAN_OUT_ITEMS_MAX: usize = 2000;
const _: () = assert!(FAN_OUT_EVENTS_MAX <= READ_ROWS_MAX);
/// Items one process works on at once, at most.
pub const CONCURRENCY_MAX: usize = 256;
/// Claimed items that wait for a slot in one process, at most.
pub const AHEAD_MAX: usize = 1024;

/// How long after its claim a claimed item may still start: while its lease outlasts its own
/// attempt and one more limit's worth for its record to be written (`lease - 2 × limit`, when the
/// lease is at least three limits); else one limit (at most half the lease), as long as items
/// waited before the limit was known.
fn start_window_ms(config: &RunnerConfig) -> u64 {
    let limit = config.time_limit_ms;
    if config.lease_ms >= limit.saturating_mul(3) { config.lease_ms - 2 * limit } else { limit.min(config.lease_ms / 2) }
}

/// How many claimed items may wait for a slot: as many as start within their start window
/// ([`start_window_ms`]). The item `k` places back in the queue starts within
/// `(k / concurrency + 1) × limit` (every slot busy with an attempt that takes its whole
/// limit), so `concurrency × (window / limit)` of them, at least `concurrency` (one claim's
/// worth), at most [`AHEAD_MAX`]. With the defaults of `serve` (a 60 s lease, a 10 s delivery
/// limit) and 32 slots: 128.
pub fn ahead_max(config: &RunnerConfig, concurrency: usize) -> usize {
    let rounds = start_window_ms(config) / config.time_limit_ms.max(1);
    concurrency.saturating_mul(usize::try_from(rounds).unwrap_or(usize::MAX)).clamp(concurrency, AHEAD_MAX.max(concurrency))
}

/// When a claimed item must have started by, or be given back.
fn start_by_ms(config: &RunnerConfig, claimed_at_ms: u64) -> u64 {
    claimed_at_ms.saturating_add(start_window_ms(config))
}

/// When to try again. After the `n`th failed attempt of a round (n ≥ 1) the next comes
/// `base × factor^(n-1)` later, at most `max_delay`, scaled by a random factor in
/// `[1 - jitter, 1 + jitter)`. After `attempts_max` attempts the item is dead.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryPolicy {
    pub base_ms: u64,
    pub factor: u64,
    pub max_delay_ms: u64,
    pub attempts_max: u32,
    pub jitter: f64,
}

impl RetryPolicy {
    /// 5 s, 20 s, 80 s, 5m20s, 21m20s, 1h25m, 5h41m: eight attempts over about 7.5 hours.
    pub const DEFAULT: Self = Self { base_ms: 5_000, factor: 4, max_delay_ms: 6 * 3600 * 1000, attempts_max: 8, jitter: 0.2 };

    /// The delay after the `n`th failed attempt, before jitter.
    pub fn nominal_delay_ms(&self, n: u32) -> u64 {
        let mut delay = self.base_ms;
        for _ in 1..n {
            delay = delay.saturating_mul(self.factor);
            if delay >= self.max_delay_ms {
                return self.max_delay_ms;
            }
        }
        delay.min(self.max_delay_ms)
    }

    pub fn delay_ms(&self, n: u32, rng: &mut impl Rng) -> u64 {
        let nominal = self.nominal_delay_ms(n) as f64;
        let scale = 1.0 - self.jitter + rng.random::<f64>() * 2.0 * self.jitter;
        (nominal * scale).round() as u64
    }
}

/// How one attempt went, as the handler saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct Handled {
    pub ok: bool,
    /// False: retrying cannot help (the item is dead at once).
    pub retryable: bool,
    pub status: Option<u16>,
    pub error: Option<String>,
}

impl Handled {
    pub fn ok(status: Option<u16>) -> Self {
        Self { ok: true, retryable: false, status, error: None }
    }

    pub fn retry(status: Option<u16>, error: impl Into<String>) -> Self {
        Self { ok: false, retryable: true, status, error: Some(error.into()) }
    }

    pub fn fatal(status: Option<u16>, error: impl Into<String>) -> Self {
        Self { ok: false, retryable: false, status, error: Some(error.into()) }
    }
}

/// What [`Consumer::prepare`] read for a claimed batch: the consumer's own type behind `Any`.
pub type Prepared = Option<Arc<dyn std::any::Any + Send + Sync>>;

/// One named consumer of the outbox.
#[async_trait]
pub trait Consumer: Send + Sync + 'static {
    /// Its name: the cursor's and the items' key. Never rename a consumer in use.
    fn name(&self) -> &'static str;
    /// The items these committed events give rise to (ids deterministic per event). They come
    /// as stored rows: a consumer decodes (and so checks, `decode_rows`) only the events it
    /// makes items of, and decides on the rows' columns (tenant, stream, type) which those are;
    /// decoding every event of a busy log for a consumer with nothing to deliver was most of
    /// its cost.
    async fn fan_out(&self, store: &dyn EventStore, rows: &[EventRow]) -> Result<Vec<NewWorkItem>>;
    /// The reads a claimed batch of items shares (the webhooks' documents and signing
    /// secrets), made once, right after the claim and before any of its items is handled, and
    /// handed to each [`Consumer::handle`] of the batch. Nothing by default.
    async fn prepare(&self, _store: &dyn EventStore, _items: &[WorkItem]) -> Prepared {
        None
    }
    /// Does one item, with what [`Consumer::prepare`] read for its batch (`None`: it reads for
    /// itself). It may run more than once for the same item.
    async fn handle(&self, store: &dyn EventStore, item: &WorkItem, prepared: &Prepared) -> Handled;
}

#[derive(Clone)]
pub struct RunnerConfig {
    /// This process's name in leases (unique per process).
    pub owner: String,
    /// How long a claim lasts; longer than any one handler call can take.
    pub lease_ms: u64,
    /// How long one handler call can take at most (the webhooks' delivery timeout). With the
    /// lease it sets how many claimed items may wait for a slot: only as many as can start
    /// while their leases still outlast an attempt.
    pub time_limit_ms: u64,
    /// How often an idle runner looks for work it was not told about.
    pub poll_ms: u64,
    pub concurrency: usize,
    pub retry: RetryPolicy,
    pub clock: Arc<dyn Clock>,
    /// For the jitter.
    pub seed: u64,
    /// Done items (and their attempts) are deleted this long after they finished; dead ones
    /// stay until an operator acts.
    pub retention_ms: u64,
}

impl RunnerConfig {
    /// A real process's defaults: its owner name (the PID and a fresh ULID, so two processes'
    /// leases never share an owner) and the jitter's seed from the OS's randomness. Both are
    /// fields a caller that must repeat itself (a test, the simulator) sets (clippy.toml).
    #[allow(clippy::disallowed_methods)]
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            owner: format!("{}-{}", std::process::id(), ulid::Ulid::generate().to_string().to_lowercase()),
            lease_ms: 60_000,
            // Half the lease: one round of claimed items waits, as before the limit was known.
            // `serve` and `reconcile` set it to --delivery-timeout.
            time_limit_ms: 30_000,
            poll_ms: 250,
            concurrency: 32,
            retry: RetryPolicy::DEFAULT,
            clock,
            seed: rand::random(),
            retention_ms: RETENTION_MS_DEFAULT,
        }
    }
}

/// Runs `consumer` until `shutdown` turns true: the fan-out and the workers. `wake` (the
/// in-process appender's commit notification) makes the fan-out prompt; without it, it polls.
pub async fn run(
    store: Arc<dyn EventStore>,
    consumer: Arc<dyn Consumer>,
    config: RunnerConfig,
    wake: Option<tokio::sync::watch::Receiver<u64>>,
    shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let work_ready = Arc::new(tokio::sync::Notify::new());
    tracing::info!(consumer = consumer.name(), owner = %config.owner, "consumer started");
    let status = Arc::new(PassRecorder::new(store.clone(), config.clock.clone(), consumer.name()));
    // The items the fan-out writes already claimed go straight to the work loop, as many as it
    // has room for.
    let concurrency = config.concurrency.clamp(1, CONCURRENCY_MAX);
    let room = Arc::new(AtomicUsize::new(concurrency + ahead_max(&config, concurrency)));
    let (hand, handed) = tokio::sync::mpsc::unbounded_channel();
    let fan_out = FanOut::handing_to(Handoff { room: room.clone(), items: hand });
    let fan = fan_out_loop(
        store.clone(),
        consumer.clone(),
        config.clone(),
        fan_out,
        wake,
        shutdown.clone(),
        work_ready.clone(),
        status.clone(),
    );
    let prune = prune_loop(store.clone(), consumer.name(), config.clone(), shutdown.clone());
    let work = work_loop(store, consumer.clone(), config, shutdown, work_ready, Handed { room, items: handed }, status);
    tokio::join!(fan, work, prune);
    tracing::info!(consumer = consumer.name(), "consumer stopped");
}

/// Deletes done items past the retention, now and then (in every process: the deletes skip
/// what another process is deleting).
async fn prune_loop(
    store: Arc<dyn EventStore>,
    name: &'static str,
    config: RunnerConfig,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    while !*shutdown.borrow() {
        let before = config.clock.now_ms().saturating_sub(config.retention_ms);
        // Batch after batch until what is due is gone, so pruning keeps up with any rate.
        let mut pruned = 0;
        loop {
            match store.work_prune(name, before, PRUNE_ITEMS_MAX).await {
                Ok(n) => {
                    pruned += n;
                    if n < u64::from(PRUNE_ITEMS_MAX) || *shutdown.borrow() {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(consumer = name, code = %e.code(), error = %e, "pruning failed");
                    break;
                }
            }
        }
        if pruned > 0 {
            tracing::info!(consumer = name, items = pruned, "pruned done items past the retention");
        }
        crate::idle(PRUNE_EVERY_MS, &mut None, &mut shutdown).await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn fan_out_loop(
    store: Arc<dyn EventStore>,
    consumer: Arc<dyn Consumer>,
    config: RunnerConfig,
    mut fan_out: FanOut,
    mut wake: Option<tokio::sync::watch::Receiver<u64>>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    work_ready: Arc<tokio::sync::Notify>,
    status: Arc<PassRecorder>,
) {
    let name = consumer.name();
    while !*shutdown.borrow() {
        let started_at_ms = config.clock.now_ms();
        let progressed = match fan_out.step(&*store, &*consumer, &config, true).await {
            Ok(Some(n)) => {
                // Items it wrote unclaimed are the work loop's to claim; those it handed over
                // reach it without.
                if fan_out.take_unhanded() > 0 {
                    work_ready.notify_one();
                }
                status.pass(started_at_ms, Ok(&[("items", n as u64)])).await;
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(consumer = name, code = %e.code(), error = %e, "fan-out failed; retrying");
                status.pass(started_at_ms, Err(&e)).await;
                false
            }
        };
        if progressed {
            continue;
        }
        crate::idle(config.poll_ms, &mut wake, &mut shutdown).await;
    }
    // A clean stop writes where the fan-out got to and hands the cursor over at once; a crash
    // leaves it to the lease (and the events since the cursor, which made no items, are read
    // again by whoever takes it).
    if let Err(e) = fan_out.flush(&*store, name, &config).await {
        tracing::warn!(consumer = name, code = %e.code(), error = %e, "writing the fan-out cursor failed");
    }
    if let Err(e) = store.cursor_release(name, &config.owner).await {
        tracing::warn!(consumer = name, code = %e.code(), error = %e, "releasing the fan-out lease failed");
    }
}

/// One fan-out step that leaves nothing in memory: `Some(items)` when the cursor moved, `None`
/// when there was nothing to do (no new events, or another process holds the cursor). The
/// simulator drives its consumer with it.
pub async fn fan_out_step(store: &dyn EventStore, consumer: &dyn Consumer, config: &RunnerConfig) -> Result<Option<usize>> {
    FanOut::default().step(store, consumer, config, false).await
}

/// The fan-out's cursor as a runner holds it between steps. Before, every step
/// wrote twice (the lease taken again, then the cursor moved), each a transaction with its
/// fsync, and a step followed nearly every commit of the log, so a consumer with nothing to
/// deliver doubled the writes of a busy log. Now the lease is taken once and renewed when half
/// its term is gone, and events that make no items are passed over in memory: the cursor is
/// written with the next items, when the consumer goes idle, at most [`RunnerConfig::poll_ms`]
/// after the first event passed over, and at a clean stop. A crash between loses no work: the
/// events after the written cursor are read again and make no items again (an item's id is
/// its event's and its subject's, inserted once). So the written cursor may trail the
/// fan-out by up to two poll intervals while only events without items arrive.
#[derive(Default)]
pub struct FanOut {
    held: Option<Held>,
    handoff: Option<Handoff>,
    /// Items written unclaimed since [`FanOut::take_unhanded`] last looked.
    unhanded: usize,
}

/// Where a runner's fan-out hands the items it writes already claimed: its own work loop, with
/// room for this many now. The room is the items the loop may hold (waiting and in its slots)
/// less those it holds and those claimed for it, by its own claim or by the fan-out, and not yet
/// handed over: both set a [`ClaimRoom`] of it aside before they claim, and each item claimed
/// carries its own share of it ([`RoomBack`]) until it is done with, however it leaves (its
/// attempt queued for the record, given back stale, dropped at a stop). So the two never claim
/// the same room twice, and no path has to remember to give room back.
struct Handoff {
    room: Arc<AtomicUsize>,
    items: tokio::sync::mpsc::UnboundedSender<Holding>,
}

/// The work loop's end of a [`Handoff`].
struct Handed {
    room: Arc<AtomicUsize>,
    items: tokio::sync::mpsc::UnboundedReceiver<Holding>,
}

/// One claimed item's room, given back when it is dropped.
struct RoomBack(Arc<AtomicUsize>);

impl Drop for RoomBack {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
}

/// The room a claim sets aside of a work loop's before it runs: a count of `count` items' worth,
/// given back when it is dropped, less what [`ClaimRoom::settle`] handed on to the items the claim
/// got. A claim that failed, or whose task panicked, so gives back all of it.
struct ClaimRoom {
    room: Arc<AtomicUsize>,
    count: usize,
}

impl ClaimRoom {
    /// Takes up to `wanted` of `room` (less when less is free).
    fn take(room: &Arc<AtomicUsize>, wanted: usize) -> Self {
        let before = room.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| Some(r - r.min(wanted))).expect("always Some");
        Self { room: room.clone(), count: before.min(wanted) }
    }

    /// The claim got `items` (at most `count`: a claim asks for no more than was reserved):
    /// each takes its share of the room with it; the rest goes back.
    fn settle(mut self, items: Vec<WorkItem>) -> Holding {
        debug_assert!(items.len() <= self.count, "a claim got more than it reserved room for");
        self.count -= items.len().min(self.count);
        let rooms = items.iter().map(|_| RoomBack(self.room.clone())).collect();
        Holding { items, rooms }
    }
}

/// Claimed items with their shares of the room, `rooms[i]` the share of `items[i]`.
#[derive(Default)]
struct Holding {
    items: Vec<WorkItem>,
    rooms: Vec<RoomBack>,
}

impl Holding {
    fn append(&mut self, mut more: Holding) {
        self.items.append(&mut more.items);
        self.rooms.append(&mut more.rooms);
    }
}

impl Drop for ClaimRoom {
    fn drop(&mut self) {
        if self.count > 0 {
            self.room.fetch_add(self.count, Ordering::AcqRel);
        }
    }
}

/// The lease this runner holds on the cursor, and how far it has read past the written cursor.
struct Held {
    until_ms: u64,
    /// The cursor as written.
    written: Position,
    /// The last event read, at or after `written`: every event between made no items.
    read: Position,
    /// When `read` first moved past `written`.
    ahead_since_ms: u64,
}

impl FanOut {
    /// A fan-out that writes as many of its items already claimed as `handoff`'s work loop has
    /// room for, and hands them to it: no claim (a write, and on PostgreSQL a round trip) for
    /// them, and no wait for one.
    fn handing_to(handoff: Handoff) -> Self {
        Self { handoff: Some(handoff), ..Self::default() }
    }

    /// How many items were written unclaimed since the last look (for the work loop to claim).
    pub fn take_unhanded(&mut self) -> usize {
        std::mem::take(&mut self.unhanded)
    }

    /// One step: `Some(items)` when the fan-out moved on (the cursor written, or with `defer`
    /// only read past events that made no items), `None` when there was nothing to do. Without
    /// `defer` every step that moves writes the cursor, as [`fan_out_step`] does.
    pub async fn step(
        &mut self,
        store: &dyn EventStore,
        consumer: &dyn Consumer,
        config: &RunnerConfig,
        defer: bool,
    ) -> Result<Option<usize>> {
        let name = consumer.name();
        let now = config.clock.now_ms();
        // A read first: an idle consumer polls without writing (and fsyncing) anything, but
        // writes a cursor it has read ahead of for a poll's interval.
        let at = match &self.held {
            Some(held) => Some(held.read),
            None => store.cursor_position(name).await?,
        };
        // The events after the cursor, read once: the same read tells an idle consumer there
        // is nothing to do and gives a busy one what it fans out (unless the lease moved the
        // cursor meanwhile).
        let mut read = None;
        if let Some(at) = at {
            let rows = store.read_after_rows(at, None, FAN_OUT_EVENTS_MAX).await?;
            if rows.is_empty() {
                if !defer || self.held.as_ref().is_some_and(|held| now >= held.ahead_since_ms.saturating_add(config.poll_ms)) {
                    self.flush(store, name, config).await?;
                }
                return Ok(None);
            }
            read = Some((at, rows));
        }
        let renew = self.held.as_ref().is_none_or(|held| now >= held.until_ms.saturating_sub(config.lease_ms / 2));
        if renew {
            let Some(from) = store.cursor_lease(name, &config.owner, now, config.lease_ms).await? else {
                self.held = None;
                return Ok(None);
            };
            let until_ms = now.saturating_add(config.lease_ms);
            self.held = Some(match self.held.take() {
                // Still ours, as written: what was read past stays passed over.
                Some(held) if held.written == from => Held { until_ms, ..held },
                _ => Held { until_ms, written: from, read: from, ahead_since_ms: now },
            });
        }
        let held = self.held.as_mut().expect("the lease is held");
        let mut rows = match read {
            Some((at, rows)) if at == held.read => rows,
            _ => store.read_after_rows(held.read, None, FAN_OUT_EVENTS_MAX).await?,
        };
        let mut items = consumer.fan_out(store, &rows).await?;
        // One step writes a bounded transaction: fewer events until their items fit (at least one
        // event, whose items are bounded by the subscriptions one tenant may have).
        while items.len() > FAN_OUT_ITEMS_MAX && rows.len() > 1 {
            rows.truncate(rows.len() / 2);
            items = consumer.fan_out(store, &rows).await?;
        }
        let Some(last) = rows.last() else { return Ok(None) };
        let to = Position { commit: last.commit, index: last.index };
        if held.read == held.written {
            held.ahead_since_ms = now;
        }
        if defer && items.is_empty() && now < held.ahead_since_ms.saturating_add(config.poll_ms) {
            held.read = to;
            return Ok(Some(0));
        }
        let from = held.written;
        if self.write(store, name, config, to, &items).await? {
            tracing::debug!(consumer = name, %from, %to, items = items.len(), "fanned out");
            Ok(Some(items.len()))
        } else {
            Ok(None)
        }
    }

    /// Writes the cursor where the fan-out has read to, if it is ahead of the written one.
    pub async fn flush(&mut self, store: &dyn EventStore, name: &str, config: &RunnerConfig) -> Result<()> {
        if let Some(held) = &self.held
            && held.read != held.written
        {
            self.write(store, name, config, held.read, &[]).await?;
        }
        Ok(())
    }

    /// Moves the written cursor to `to` with `items` (the lease is held); false when another
    /// process took the cursor once the lease ran out: the next step starts again from it.
    async fn write(
        &mut self,
        store: &dyn EventStore,
        name: &str,
        config: &RunnerConfig,
        to: Position,
        items: &[NewWorkItem],
    ) -> Result<bool> {
        let Some(held) = self.held.as_mut() else { return Ok(false) };
        let now = config.clock.now_ms();
        // Room for the items it claims, given back (as it drops) on an error or a lost lease.
        let claim_room = self.handoff.as_ref().map(|h| ClaimRoom::take(&h.room, items.len()));
        let claim =
            Claim { count: claim_room.as_ref().map_or(0, |r| r.count), lease_until_ms: now.saturating_add(config.lease_ms) };
        let Some(claimed) = store.cursor_advance_claiming(name, &config.owner, held.written, to, items, claim, now).await? else {
            self.held = None;
            return Ok(false);
        };
        (held.written, held.read) = (to, to);
        self.unhanded += items.len() - claimed.len();
        if let (Some(handoff), Some(claim_room)) = (&self.handoff, claim_room)
            && !claimed.is_empty()
        {
            // A work loop that has stopped takes nothing more: give them back at once.
            if let Err(unsent) = handoff.items.send(claim_room.settle(claimed)) {
                release(store, name, &config.owner, &unsent.0.items).await;
            }
        }
        Ok(true)
    }
}

async fn work_loop(
    store: Arc<dyn EventStore>,
    consumer: Arc<dyn Consumer>,
    config: RunnerConfig,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    work_ready: Arc<tokio::sync::Notify>,
    mut handed: Handed,
    status: Arc<PassRecorder>,
) {
    let concurrency = config.concurrency.clamp(1, CONCURRENCY_MAX);
    let name = consumer.name();
    // Finished attempts go to one completer, which records them in batches: one transaction
    // for many deliveries instead of one each. Up to a whole batch waits for it, so the slots
    // go on delivering while a batch is written; with no more room than the slots, a slot
    // waited for each recording and the recordings' round trips bound the rate.
    let (finished, to_record) = tokio::sync::mpsc::channel::<Finished>(COMPLETIONS_PER_COMMIT_MAX.max(concurrency));
    let completer = tokio::spawn(complete(store.clone(), name, config.clone(), to_record, work_ready.clone(), status));
    let mut work = Slots {
        slots: Arc::new(tokio::sync::Semaphore::new(concurrency)),
        rng: Arc::new(std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(config.seed))),
        slot_freed: Arc::new(tokio::sync::Notify::new()),
        ahead: std::collections::VecDeque::new(),
        store,
        consumer,
        config,
        concurrency,
        finished,
    };
    // Nothing more to claim until something new is due (a fan-out's wake-up or the poll),
    // unless the last claim took all it asked for.
    let mut claim_due = true;
    // Items the fan-out wrote already claimed for this loop, and whether it may hand more.
    let mut received = Holding::default();
    let mut fan_out_open = true;
    // A claim runs beside this loop: while it waits for the database (on SQLite,
    // for the writer, behind a commit's fsync) the loop goes on starting waiting items as slots
    // free. At most one at a time: where its outcome comes, with the room set aside for it.
    let mut claiming: Option<tokio::sync::oneshot::Receiver<ClaimDone>> = None;
    while !*shutdown.borrow() {
        while let Ok(more) = handed.items.try_recv() {
            received.append(more);
        }
        if !received.items.is_empty() {
            work.queue_prepared(std::mem::take(&mut received)).await;
        }
        work.prepare_again_when_old().await;
        work.start_waiting().await;
        // Claim when fewer than one round of slots' worth wait: then a claim is large (up to
        // the room: the slots and the queue ahead, less what the fan-out is handing over), and
        // the slots have a round to work on while it runs.
        if claim_due
            && claiming.is_none()
            && work.ahead.len() < work.concurrency
            && let Some(outcome) = work.start_claim(&handed.room)
        {
            // Due again only if this claim comes back full or something new is due meanwhile.
            (claiming, claim_due) = (Some(outcome), false);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(work.config.poll_ms)) => claim_due = true,
            _ = work_ready.notified() => claim_due = true,
            _ = work.slot_freed.notified() => {}
            items = handed.items.recv(), if fan_out_open => match items {
                Some(items) => received = items,
                None => fan_out_open = false,
            },
            done = async { claiming.as_mut().expect("a claim runs").await }, if claiming.is_some() => {
                claiming = None;
                claim_due |= take_claim(name, &work.config, done, &mut work.ahead);
            }
            _ = shutdown.changed() => {}
        }
    }
    work.stop(claiming, handed, received, completer).await;
}

/// A work loop's slots and the claimed items waiting for one.
struct Slots {
    store: Arc<dyn EventStore>,
    consumer: Arc<dyn Consumer>,
    config: RunnerConfig,
    /// How many attempts run at once: the permits of `slots`.
    concurrency: usize,
    slots: Arc<tokio::sync::Semaphore>,
    /// The retry schedule's jitter.
    rng: Arc<std::sync::Mutex<rand::rngs::StdRng>>,
    /// Where each finished attempt goes to be recorded (the completer).
    finished: tokio::sync::mpsc::Sender<Finished>,
    /// Wakes the loop when an attempt gives its slot back.
    slot_freed: Arc<tokio::sync::Notify>,
    /// Claims run ahead of the slots: up to [`ahead_max`] claimed items wait here for a slot, so
    /// one claim feeds the slots for several rounds (one transaction on the writer for many
    /// deliveries) and the slots never wait for a claim. An item that waited until its lease
    /// would not outlast an attempt and its record is given back unattempted (`work_release`),
    /// never started; what `prepare` read for waiting items is read again once it is older than
    /// one attempt's limit, so a webhook deleted, re-pointed or given a new secret meanwhile is
    /// seen as it is now.
    ahead: std::collections::VecDeque<Claimed>,
}

impl Slots {
    /// Queues items the fan-out handed over, with what [`Consumer::prepare`] reads for them now.
    async fn queue_prepared(&mut self, holding: Holding) {
        let now = self.config.clock.now_ms();
        let prepared = self.consumer.prepare(&*self.store, &holding.items).await;
        queue(&self.config, &mut self.ahead, holding, prepared, now);
    }

    /// Reads again what the waiting items need once the first's read is older than an attempt's
    /// time limit.
    async fn prepare_again_when_old(&mut self) {
        let now = self.config.clock.now_ms();
        if self.ahead.front().is_some_and(|c| now.saturating_sub(c.prepared_at_ms) > self.config.time_limit_ms) {
            let items: Vec<WorkItem> = self.ahead.iter().map(|c| c.item.clone()).collect();
            let prepared = self.consumer.prepare(&*self.store, &items).await;
            for c in &mut self.ahead {
                (c.prepared, c.prepared_at_ms) = (prepared.clone(), now);
            }
        }
    }

    /// Starts an attempt of each waiting item in a free slot, in order; items that waited past
    /// their start-by time are given back unattempted.
    async fn start_waiting(&mut self) {
        let name = self.consumer.name();
        let mut stale = Vec::new();
        while !self.ahead.is_empty() {
            let Ok(permit) = self.slots.clone().try_acquire_owned() else { break };
            let Claimed { item, room, prepared, start_by_ms, .. } = self.ahead.pop_front().expect("not empty");
            if self.config.clock.now_ms() > start_by_ms {
                // Its room goes back as it drops here.
                stale.push(item);
                continue;
            }
            let (store, consumer, config, rng, finished, slot_freed) = (
                self.store.clone(),
                self.consumer.clone(),
                self.config.clone(),
                self.rng.clone(),
                self.finished.clone(),
                self.slot_freed.clone(),
            );
            tokio::spawn(async move {
                let (attempt, outcome) = attempt(&*store, &*consumer, &config, &rng, &item, &prepared).await;
                // The slot (and the item's room) is freed once the attempt is queued for the
                // completer (at most a batch waits there), or when the task ends some other
                // way (a panic). The item stays leased until its record is written.
                let _ = finished.send(Finished { item, attempt, outcome }).await;
                drop(permit);
                drop(room);
                slot_freed.notify_one();
            });
        }
        if !stale.is_empty() {
            tracing::info!(consumer = name, items = stale.len(), "claimed items waited too long for a slot; giving them back");
            release(&*self.store, name, &self.config.owner, &stale).await;
        }
    }

    /// Starts a claim beside the loop, of as many items as `room` has (no more than the store
    /// hands out in one claim, so a full claim reads as full); `None` when there is no room.
    fn start_claim(&self, room: &Arc<AtomicUsize>) -> Option<tokio::sync::oneshot::Receiver<ClaimDone>> {
        let claim_room = Some(ClaimRoom::take(room, CLAIM_ITEMS_MAX as usize)).filter(|r| r.count > 0)?;
        let (claim_done, outcome) = tokio::sync::oneshot::channel();
        let (store, consumer, config) = (self.store.clone(), self.consumer.clone(), self.config.clone());
        // The task holds the claim's room: a task that panics gives it back as it unwinds.
        tokio::spawn(async move {
            let at_ms = config.clock.now_ms();
            let asked = claim_room.count as u32;
            let items = store.work_claim(consumer.name(), &config.owner, at_ms, config.lease_ms, asked).await;
            let prepared = match &items {
                Ok(items) if !items.is_empty() => consumer.prepare(&*store, items).await,
                _ => None,
            };
            let _ = claim_done.send(ClaimDone { at_ms, items, prepared, claim_room });
        });
        Some(outcome)
    }

    /// The loop's end. Claimed items that never started are given back, due at once for any
    /// process (a process that dies instead leaves them to their leases); so are those the
    /// fan-out handed over meanwhile, and any it hands from now on (it gives them back itself),
    /// and those of a claim still running. Then what is in flight finishes and is recorded,
    /// within [`SHUTDOWN_WAIT_S`].
    async fn stop(
        mut self,
        claiming: Option<tokio::sync::oneshot::Receiver<ClaimDone>>,
        mut handed: Handed,
        mut received: Holding,
        completer: tokio::task::JoinHandle<()>,
    ) {
        let name = self.consumer.name();
        if let Some(outcome) = claiming {
            take_claim(name, &self.config, outcome.await, &mut self.ahead);
        }
        handed.items.close();
        while let Ok(more) = handed.items.try_recv() {
            received.append(more);
        }
        let unstarted: Vec<WorkItem> = self.ahead.drain(..).map(|c| c.item).chain(received.items).collect();
        release(&*self.store, name, &self.config.owner, &unstarted).await;
        // Let what is in flight finish (bounded by the handlers' own timeouts) and be recorded
        // (the completer ends when the last attempt has sent its record); what does not is
        // claimed again when its lease runs out.
        drop(self.finished);
        // One deadline for both: the attempts (bounded by the handlers' time limits) and their
        // records.
        let wait = async {
            let _ = self.slots.acquire_many(self.concurrency as u32).await;
            let _ = completer.await;
        };
        let _ = tokio::time::timeout(Duration::from_secs(SHUTDOWN_WAIT_S), wait).await;
    }
}

/// A claim's outcome, from the task that ran it beside the work loop, with the room reserved
/// for it.
struct ClaimDone {
    at_ms: u64,
    items: Result<Vec<WorkItem>>,
    prepared: Prepared,
    claim_room: ClaimRoom,
}

/// Queues a claim's items to wait for a slot, each with its share of the room reserved for the
/// claim (the rest goes back); true when it took all it asked for (so more may be due). A claim
/// whose task ended without an outcome (it panicked) took nothing this loop knows of: its items
/// wait for their leases, and its room went back as the task unwound.
fn take_claim(
    name: &str,
    config: &RunnerConfig,
    done: std::result::Result<ClaimDone, tokio::sync::oneshot::error::RecvError>,
    ahead: &mut std::collections::VecDeque<Claimed>,
) -> bool {
    let Ok(ClaimDone { at_ms, items, prepared, claim_room }) = done else {
        tracing::warn!(consumer = name, "a claim ended without an outcome");
        return false;
    };
    match items {
        Ok(items) => {
            let full = items.len() == claim_room.count;
            queue(config, ahead, claim_room.settle(items), prepared, at_ms);
            full
        }
        Err(e) => {
            tracing::warn!(consumer = name, code = %e.code(), error = %e, "claiming work failed");
            false
        }
    }
}

/// Queues claimed items (by a claim, or written so by the fan-out) to wait for a slot, with what
/// [`Consumer::prepare`] read for them at `prepared_at_ms`; each must start within the window
/// from its claim, the start of the lease this process took on it.
fn queue(
    config: &RunnerConfig,
    ahead: &mut std::collections::VecDeque<Claimed>,
    holding: Holding,
    prepared: Prepared,
    prepared_at_ms: u64,
) {
    ahead.extend(holding.items.into_iter().zip(holding.rooms).map(|(item, room)| Claimed {
        start_by_ms: start_by_ms(config, item.claimed_at_ms(config.lease_ms)),
        item,
        room,
        prepared: prepared.clone(),
        prepared_at_ms,
    }));
}

/// A claimed item waiting for a slot, with its share of the work loop's room, what
/// [`Consumer::prepare`] read for it and when, and the time it must start by.
struct Claimed {
    item: WorkItem,
    room: RoomBack,
    prepared: Prepared,
    prepared_at_ms: u64,
    start_by_ms: u64,
}

/// Gives claimed items back unattempted; a failure leaves them to their leases.
async fn release(store: &dyn EventStore, name: &str, owner: &str, items: &[WorkItem]) {
    if items.is_empty() {
        return;
    }
    let keys: Vec<(bc_core::id::TenantId, String, u32)> = items.iter().map(|i| (i.tenant, i.id.clone(), i.attempts)).collect();
    match store.work_release(name, owner, &keys).await {
        Ok(n) => tracing::debug!(consumer = name, items = n, "gave claimed items back"),
        Err(e) => tracing::warn!(consumer = name, items = items.len(), code = %e.code(), error = %e,
            "giving claimed items back failed; they run again when their leases run out"),
    }
}

/// How long a stopping work loop waits for its attempts in flight and their records.
const SHUTDOWN_WAIT_S: u64 = 20;

/// A handled item on its way to being recorded.
struct Finished {
    item: WorkItem,
    attempt: Attempt,
    outcome: Outcome,
}

/// The longest wait between two tries at recording a batch of completions (the first waits
/// 200 ms, each next 200 ms more, up to this).
const COMPLETE_RETRY_MAX_MS: u64 = 2_000;
/// Completions recorded in one transaction at most.
const COMPLETIONS_PER_COMMIT_MAX: usize = 256;

/// Records finished attempts: whatever has arrived, up to a batch, in one transaction.
async fn complete(
    store: Arc<dyn EventStore>,
    name: &'static str,
    config: RunnerConfig,
    mut to_record: tokio::sync::mpsc::Receiver<Finished>,
    work_ready: Arc<tokio::sync::Notify>,
    status: Arc<PassRecorder>,
) {
    let owner = config.owner.clone();
    while let Some(first) = to_record.recv().await {
        let started_at_ms = config.clock.now_ms();
        let mut batch = vec![first];
        while batch.len() < COMPLETIONS_PER_COMMIT_MAX {
            match to_record.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let done: Vec<Completion> = batch
            .iter()
            .map(|f| Completion {
                tenant: f.item.tenant,
                id: f.item.id.clone(),
                attempt: f.attempt.clone(),
                outcome: f.outcome.clone(),
            })
            .collect();
        // A failed write (the database failing over: no primary for the TTL and more) is tried
        // again while every lease of the batch still runs, so an attempt a receiver got is
        // recorded once a primary answers; only after that are the items claimed and attempted
        // again, which at-least-once allows. (Three tries over 1.2 s gave up within a failover,
        // and each delivery in flight then reached its receiver a second time, the first
        // attempt never recorded: tests/tests/ha.rs.)
        let leases_until_ms = batch.iter().map(|f| f.item.lease_until_ms).min().unwrap_or(0);
        let mut tries: u64 = 0;
        loop {
            match store.work_complete_many(name, &owner, &done).await {
                Ok(written) => {
                    let mut counts = [("done", 0), ("retried", 0), ("dead", 0), ("lost", 0)];
                    for (f, written) in batch.iter().zip(written) {
                        log_completion(name, f, written);
                        let slot = match (&f.outcome, written) {
                            (_, false) => 3,
                            (Outcome::Done, _) => 0,
                            (Outcome::Retry { .. }, _) => 1,
                            (Outcome::Dead, _) => 2,
                        };
                        counts[slot].1 += 1;
                        if let Some(observer) = crate::driver::observer() {
                            observer.outbox_completed(name, counts[slot].0, Duration::from_millis(f.attempt.latency_ms));
                        }
                    }
                    status.pass(started_at_ms, Ok(&counts)).await;
                    break;
                }
                Err(e)
                    if tries < complete_tries_max(config.lease_ms)
                        && complete_again_at_ms(config.clock.now_ms(), tries + 1, leases_until_ms).is_some() =>
                {
                    tries += 1;
                    let now_ms = config.clock.now_ms();
                    let at_ms = complete_again_at_ms(now_ms, tries, leases_until_ms).unwrap_or(now_ms);
                    tracing::warn!(consumer = name, items = batch.len(), code = %e.code(), error = %e, "recording attempts failed; trying again");
                    tokio::time::sleep(Duration::from_millis(at_ms.saturating_sub(now_ms))).await;
                }
                Err(e) => {
                    tracing::warn!(consumer = name, items = batch.len(), code = %e.code(), error = %e, "recording attempts failed; their leases will run out and they run again");
                    status.pass(started_at_ms, Err(&e)).await;
                    break;
                }
            }
        }
        work_ready.notify_one();
    }
}

/// When the `tries`-th try again at recording completions whose leases run until
/// `leases_until_ms` is made: `200 ms × tries` (at most [`COMPLETE_RETRY_MAX_MS`]) from `now_ms`,
/// or `None` when that is past the leases (the items are then another process's to take: the
/// record would be refused, and waiting longer only holds the completer up).
fn complete_again_at_ms(now_ms: u64, tries: u64, leases_until_ms: u64) -> Option<u64> {
    let at_ms = now_ms.saturating_add((200 * tries).min(COMPLETE_RETRY_MAX_MS));
    (at_ms < leases_until_ms).then_some(at_ms)
}

/// Tries again at most, whatever the clock says (a clock that stands still must not hold the
/// completer forever): as many as fit in a lease at the shortest wait.
fn complete_tries_max(lease_ms: u64) -> u64 {
    lease_ms / 200 + 1
}

fn log_completion(name: &str, f: &Finished, written: bool) {
    let (item, record) = (&f.item, &f.attempt);
    if !written {
        tracing::warn!(consumer = name, item = %item.id, "lease lost before completion; another process has it");
        return;
    }
    match &f.outcome {
        Outcome::Done => tracing::debug!(consumer = name, item = %item.id, attempt = item.attempts, "done"),
        Outcome::Retry { next_at_ms } => tracing::info!(
            consumer = name, item = %item.id, attempt = item.attempts, status = ?record.status,
            error = record.error.as_deref().unwrap_or(""),
            retry_in_ms = next_at_ms.saturating_sub(record.at_ms + record.latency_ms), "attempt failed"
        ),
        Outcome::Dead => tracing::warn!(
            consumer = name, item = %item.id, attempt = item.attempts, status = ?record.status,
            error = record.error.as_deref().unwrap_or(""), "giving up: dead letter"
        ),
    }
}

/// One attempt at one claimed item (with what [`Consumer::prepare`] read for its batch):
/// handle it, and decide what comes next (done, a retry on
/// the schedule, or dead).
pub async fn attempt(
    store: &dyn EventStore,
    consumer: &dyn Consumer,
    config: &RunnerConfig,
    rng: &std::sync::Mutex<rand::rngs::StdRng>,
    item: &WorkItem,
    prepared: &Prepared,
) -> (Attempt, Outcome) {
    // On the config's clock: the end of the attempt decides when the next one is due, so it is
    // the clock's (a ManualClock that does not move makes the latency 0), never the wall's.
    let started = config.clock.now_ms();
    let handled = consumer.handle(store, item, prepared).await;
    let ended = config.clock.now_ms().max(started);
    let latency_ms = ended - started;
    let outcome = if handled.ok {
        Outcome::Done
    } else if handled.retryable && item.round_attempts < config.retry.attempts_max {
        let delay = config.retry.delay_ms(item.round_attempts, &mut *rng.lock().expect("rng lock"));
        Outcome::Retry { next_at_ms: ended.saturating_add(delay) }
    } else {
        Outcome::Dead
    };
    let record = Attempt {
        number: item.attempts,
        at_ms: started,
        latency_ms,
        status: handled.status,
        error: handled.error.map(|e| e.chars().take(ATTEMPT_ERROR_CHARS_MAX).collect()),
        next_at_ms: match outcome {
            Outcome::Retry { next_at_ms } => Some(next_at_ms),
            _ => None,
        },
        owner: config.owner.clone(),
    };
    (record, outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claimed_items_wait_only_while_their_leases_outlast_an_attempt_and_its_record() {
        let mut config = RunnerConfig::new(Arc::new(bc_core::clock::ManualClock::new(0)));
        // serve's defaults: a 60 s lease, a 10 s delivery limit: an item starts within 40 s of
        // its claim (its attempt then ends 10 s before its lease, left for its record), so
        // four rounds of the slots wait.
        (config.lease_ms, config.time_limit_ms) = (60_000, 10_000);
        assert_eq!((ahead_max(&config, 32), start_by_ms(&config, 1_000)), (128, 41_000));
        // The runner's own defaults (60 s, 30 s) and the shortest lease `serve` accepts (twice
        // the limit): one round, each to start within one limit.
        (config.lease_ms, config.time_limit_ms) = (60_000, 30_000);
        assert_eq!((ahead_max(&config, 32), start_by_ms(&config, 0)), (32, 30_000));
        (config.lease_ms, config.time_limit_ms) = (20_000, 10_000);
        assert_eq!((ahead_max(&config, 32), start_by_ms(&config, 0)), (32, 10_000));
        // A lease shorter than two attempts: one round waits, each to start within half the
        // lease.
        (config.lease_ms, config.time_limit_ms) = (15_000, 10_000);
        assert_eq!((ahead_max(&config, 8), start_by_ms(&config, 0)), (8, 7_500));
        // Never past the cap, however long the lease.
        (config.lease_ms, config.time_limit_ms) = (86_400_000, 1);
        assert_eq!(ahead_max(&config, 256), AHEAD_MAX);
    }

    #[test]
    fn room_reserved_for_a_claim_goes_back_however_the_claim_and_its_items_end() {
        let item = |n: u32| WorkItem {
            tenant: bc_core::id::TenantId::ROOT,
            consumer: "test".into(),
            id: format!("item-{n}"),
            subject: "s".into(),
            payload: serde_json::Value::Null,
            state: bc_core::store::outbox::WorkState::Pending,
            attempts: 1,
            round_attempts: 1,
            next_at_ms: 0,
            lease_until_ms: 0,
            last_error: None,
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        let room = Arc::new(AtomicUsize::new(10));
        let left = || room.load(Ordering::Acquire);
        // A claim's room takes what it wants while there is room, then what is left.
        let first = ClaimRoom::take(&room, 4);
        assert_eq!((first.count, left()), (4, 6));
        let second = ClaimRoom::take(&room, 8);
        assert_eq!((second.count, left()), (6, 0));
        assert_eq!(ClaimRoom::take(&room, 1).count, 0);
        // A claim that failed (or whose task panicked) drops its room: all of it goes back.
        drop(second);
        assert_eq!(left(), 6);
        // A claim that got 3 of 4: one goes back at once, each item holds its own until it ends.
        let mut held = first.settle((0..3).map(item).collect());
        assert_eq!((held.rooms.len(), left()), (3, 7));
        drop(held.rooms.pop());
        assert_eq!(left(), 8);
        drop(held);
        assert_eq!(left(), 10);
    }

    #[test]
    fn recording_is_tried_again_while_the_leases_run_and_not_past_them() {
        // A failover's 15 s without a primary, in a 60 s lease claimed just now: tried again
        // throughout (the waits grow to 2 s), never past the lease.
        let (claimed_at, lease) = (1_000_000, 60_000);
        let until = claimed_at + lease;
        let mut now = claimed_at + 100;
        let mut tries = 0;
        while let Some(at) = complete_again_at_ms(now, tries + 1, until) {
            tries += 1;
            assert!(at > now && at - now <= COMPLETE_RETRY_MAX_MS);
            now = at;
        }
        assert!(now >= claimed_at + 15_000, "still trying 15 s on: stopped at {}", now - claimed_at);
        assert!(now < until && now + COMPLETE_RETRY_MAX_MS >= until, "until the lease is nearly over");
        assert!(tries < complete_tries_max(lease), "the cap is not what ends it with a real clock");
        assert_eq!(complete_again_at_ms(until - 100, 1, until), None, "past the lease: left to the next claim");
        assert_eq!(complete_again_at_ms(0, 1, 0), None, "no lease: no try again");
    }

    #[test]
    fn retry_schedule_is_exponential_capped_and_jittered() {
        let policy = RetryPolicy::DEFAULT;
        let nominal: Vec<u64> = (1..=8).map(|n| policy.nominal_delay_ms(n)).collect();
        assert_eq!(nominal, [5_000, 20_000, 80_000, 320_000, 1_280_000, 5_120_000, 20_480_000, 21_600_000]);
        let seed = bc_core::testing::seed();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for n in 1..=8 {
            for _ in 0..200 {
                let d = policy.delay_ms(n, &mut rng) as f64;
                let nominal = policy.nominal_delay_ms(n) as f64;
                assert!(d >= nominal * 0.8 - 1.0 && d <= nominal * 1.2 + 1.0, "seed {seed}: attempt {n} delay {d}");
            }
        }
    }
}
