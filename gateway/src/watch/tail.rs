//! The shared tail of `GET /watch`, in the shape of the Kubernetes watch cache: one task per
//! process reads each commit's new rows once (all tenants, in position order), renders each
//! event's frame once, and hands it to every caught-up watcher of the event's tenant whose type
//! filter takes it. Watchers are held by tenant, so an event costs the watchers of its own
//! tenant and nothing for anyone else's. A bounded ring of recent events (`WATCH_RING_EVENTS`,
//! `WATCH_RING_BYTES`) lets a watcher that joins from a recent position be served from memory.
//!
//! A watcher is either **joined** (the tail holds its [`Cursor`] and sends to it) or **behind**
//! (its own task holds the cursor: it reads history from the database, or waits for room in its
//! client's buffer, then joins again). The tail hands a cursor back when the client's buffer is
//! full (`Why::Slow`) and when API keys changed (`Why::Keys`: the key is checked again first).
//!
//! The seam. A cursor's `after` is the position of the last event its watcher has taken (sent,
//! or passed over as not its own). The ring holds every event after `covered_from` up to `head`,
//! the newest the tail has read. [`Tail::join`], under the lock the fan-out takes too: refuses
//! a cursor older than `covered_from` (the watcher reads the database first), sends the ring's
//! events after the cursor, and registers it; from then on the tail sends a watcher only events
//! after its cursor. So nothing is published between the ring's last event and the
//! registration (no gap), and an event the watcher read from the database ahead of the tail is
//! not sent again when the tail reads it (no duplicate). Every structure is bounded: the ring
//! by both constants, each watcher's buffer by `WATCH_BUFFER_EVENTS`, the watchers by their
//! slots.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use bc_core::event::{EventRow, Position, StoredEvent};
use bc_core::id::TenantId;
use bc_core::store::EventStore;
use bc_projections::events::TypeFilter;
use tokio::sync::{mpsc, oneshot};

use super::{
    WATCH_AFTER_ANSWER_MS, WATCH_AFTER_ANSWER_WATCHERS, WATCH_ANSWER_WAIT_MS, WATCH_BUFFER_EVENTS, WATCH_PAGE_ROWS, WATCH_POLL_MS,
};

/// Recent events the tail keeps in memory, all tenants together, for watchers that join from a
/// recent position (a reconnect, a re-check of the key, a watcher that fell behind).
pub const WATCH_RING_EVENTS: usize = 4096;
/// The ring's bound in bytes of rendered frames, so large events cannot make it large.
pub const WATCH_RING_BYTES: usize = 16 * 1024 * 1024;
const _: () = assert!(WATCH_RING_EVENTS >= WATCH_PAGE_ROWS as usize && WATCH_RING_BYTES >= 1024 * 1024);
/// What one ring entry costs beside its frame and type (position, tenant, the deque's slot).
const RING_ENTRY_BYTES: usize = 64;

/// The position after every event of `commit`: where a watcher that has seen the whole commit
/// stands. Indexes are stored as 32-bit signed integers, so none is larger.
pub fn end_of(commit: u64) -> Position {
    Position { commit, index: i32::MAX as u32 }
}

/// The tail's bounds; the defaults are the named constants (tests make them small).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailLimits {
    pub ring_events: usize,
    pub ring_bytes: usize,
    /// Rows per database read, the tail's and a behind watcher's.
    pub page_rows: u32,
    /// Frames queued for one client.
    pub buffer_events: usize,
    /// How long the tail waits for a commit's answers to be let go (`WATCH_ANSWER_WAIT_MS`).
    pub answer_wait: Duration,
}

impl Default for TailLimits {
    fn default() -> Self {
        Self {
            ring_events: WATCH_RING_EVENTS,
            ring_bytes: WATCH_RING_BYTES,
            page_rows: WATCH_PAGE_ROWS,
            buffer_events: WATCH_BUFFER_EVENTS,
            answer_wait: Duration::from_millis(WATCH_ANSWER_WAIT_MS),
        }
    }
}

/// One event as the tail keeps it: where it is, whose it is, and its frame, rendered once.
#[derive(Clone, Debug)]
pub struct TailEvent {
    pub position: Position,
    pub tenant: TenantId,
    pub event_type: Box<str>,
    /// The server-sent event every watcher it goes to is sent (shared bytes, not copies);
    /// `None` for a stored row that does not verify, which ends its tenant's watchers as a
    /// failed read always has.
    pub frame: Option<Bytes>,
}

impl TailEvent {
    pub fn of(event: &StoredEvent) -> Self {
        Self {
            position: event.position,
            tenant: event.envelope.tenant,
            event_type: event.envelope.event_type.clone().into_boxed_str(),
            frame: Some(frame(event)),
        }
    }

    /// Checks a row as `decode_rows` does; a row that does not verify is kept as a failure at
    /// its position. `None` for a row naming no tenant, which no tenant's watcher reads.
    fn of_row(row: EventRow) -> Option<Self> {
        let (position, seq) = (Position { commit: row.commit, index: row.index }, row.seq);
        let tenant: TenantId = match row.tenant.parse() {
            Ok(tenant) => tenant,
            Err(_) => {
                tracing::error!(tenant = %row.tenant, seq, %position, "stored event names no tenant; the watch skips it");
                return None;
            }
        };
        let event_type = row.event_type.clone().into_boxed_str();
        match row.decode() {
            Ok(event) => Some(Self::of(&event)),
            Err(what) => {
                tracing::error!(%tenant, seq, %what, "stored event does not verify");
                Some(Self { position, tenant, event_type, frame: None })
            }
        }
    }

    fn keys_changed(&self) -> bool {
        self.event_type.starts_with("api_key.")
    }

    fn bytes(&self) -> usize {
        RING_ENTRY_BYTES + self.event_type.len() + self.frame.as_ref().map_or(0, Bytes::len)
    }
}

/// An event as one server-sent event: `id:` its position, `event:` its type, one `data:` line
/// of JSON (serde_json escapes every line break inside strings, so there is one line).
pub fn frame(event: &StoredEvent) -> Bytes {
    let data = bc_projections::event_view(event, false).to_string();
    debug_assert!(!data.contains(['\n', '\r']), "one data line");
    Bytes::from(format!("id: {}\nevent: {}\ndata: {data}\n\n", event.position, event.envelope.event_type))
}

/// A watcher's place in the log and its way to its client. It moves: the tail holds it while
/// the watcher is joined, the watcher's task while it is behind.
#[derive(Debug)]
pub struct Cursor {
    /// The tenant whose events are watched.
    pub tenant: TenantId,
    /// The tenant of the watcher's key (the root's administrators may watch any tenant): its
    /// keys changing makes the watcher's key be checked again too.
    pub key_tenant: TenantId,
    pub filter: TypeFilter,
    /// The last event taken: sent to the client, or passed over as not this watcher's.
    pub after: Position,
    /// The client's bounded buffer; its receiver is the response body.
    pub tx: mpsc::Sender<Bytes>,
}

/// Why the tail handed a cursor back to its watcher's task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// The client's buffer was full: the watcher waits for room, then joins again.
    Slow,
    /// API keys of the watched tenant or of the key's own changed: the key is checked before
    /// anything more is sent.
    Keys,
}

#[derive(Debug)]
pub struct Handback {
    pub cursor: Cursor,
    pub why: Why,
}

/// What a join came to.
#[derive(Debug)]
pub enum Join {
    /// Caught up: the tail sends from now on, and hands the cursor back on `handback` (dropped
    /// instead when the client is gone, a stored event fails to verify, or the server stops).
    Joined { id: u64, handback: oneshot::Receiver<Handback> },
    /// The cursor is older than the ring: read the database after it first.
    Behind(Cursor),
    /// The client's buffer filled while the ring was sent: wait for room, then join again.
    Full(Cursor),
    /// An event just sent (or passed) changed API keys: check the key, then join again.
    Recheck(Cursor),
    /// The client is gone, the server is stopping, or a stored event of the tenant does not
    /// verify: the stream ends.
    Ended,
}

struct Subscriber {
    cursor: Cursor,
    handback: oneshot::Sender<Handback>,
}

/// What the tail did with one event for one watcher.
enum Offer {
    Taken,
    Full,
    Gone,
}

fn offer(cursor: &mut Cursor, event: &TailEvent) -> Offer {
    if event.position <= cursor.after {
        // Read from the database before the tail read it: sent already.
        return Offer::Taken;
    }
    let Some(frame) = &event.frame else {
        tracing::info!(tenant = %cursor.tenant, position = %event.position, "watch stream ended: a stored event does not verify");
        return Offer::Gone;
    };
    if cursor.filter.matches(&event.event_type) {
        match cursor.tx.try_send(frame.clone()) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => return Offer::Full,
            Err(mpsc::error::TrySendError::Closed(_)) => return Offer::Gone,
        }
    }
    cursor.after = event.position;
    Offer::Taken
}

/// [`Tail::stats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TailStats {
    pub started: bool,
    pub head: Position,
    pub joined: usize,
    pub slow_handbacks: u64,
}

#[derive(Default)]
struct TailState {
    /// The newest position the tail has read.
    head: Position,
    /// Every event after this position and up to `head` is in `ring`.
    covered_from: Position,
    ring: VecDeque<TailEvent>,
    ring_bytes: usize,
    /// Joined watchers by watched tenant, then by id (in join order, so fan-out order is
    /// deterministic). Only tenants with a joined watcher have an entry.
    joined: HashMap<TenantId, BTreeMap<u64, Subscriber>>,
    next_id: u64,
    /// The server stopped: nothing joins any more.
    closed: bool,
    /// Watchers handed back because their client's buffer was full (`/metrics`).
    slow_handbacks: u64,
}

impl TailState {
    fn publish(&mut self, events: Vec<TailEvent>, limits: &TailLimits) {
        for event in events {
            debug_assert!(event.position > self.head, "the tail reads in position order");
            if let Some(watchers) = self.joined.get_mut(&event.tenant) {
                let mut out: Vec<(u64, Option<Why>)> = Vec::new();
                for (id, subscriber) in watchers.iter_mut() {
                    match offer(&mut subscriber.cursor, &event) {
                        Offer::Taken => {}
                        Offer::Full => out.push((*id, Some(Why::Slow))),
                        Offer::Gone => out.push((*id, None)),
                    }
                }
                for (id, why) in out {
                    self.slow_handbacks += u64::from(why == Some(Why::Slow));
                    let subscriber = watchers.remove(&id).expect("listed above");
                    if let Some(why) = why {
                        let _ = subscriber.handback.send(Handback { cursor: subscriber.cursor, why });
                    }
                }
                if watchers.is_empty() {
                    self.joined.remove(&event.tenant);
                }
            }
            if event.keys_changed() {
                self.hand_back_key_holders(event.tenant);
            }
            self.head = event.position;
            self.ring_bytes += event.bytes();
            self.ring.push_back(event);
            while self.ring.len() > limits.ring_events || self.ring_bytes > limits.ring_bytes {
                let Some(oldest) = self.ring.pop_front() else { break };
                self.ring_bytes -= oldest.bytes();
                self.covered_from = oldest.position;
            }
        }
    }

    /// Hands back every watcher of `tenant` and every watcher holding one of its keys, to check
    /// its key before it is sent anything more. Rare (keys change seldom), so a full pass.
    fn hand_back_key_holders(&mut self, tenant: TenantId) {
        let mut emptied = Vec::new();
        for (watched, watchers) in self.joined.iter_mut() {
            let holders =
                watchers.extract_if(.., |_, s| s.cursor.tenant == tenant || s.cursor.key_tenant == tenant).collect::<Vec<_>>();
            for (_, subscriber) in holders {
                let _ = subscriber.handback.send(Handback { cursor: subscriber.cursor, why: Why::Keys });
            }
            if watchers.is_empty() {
                emptied.push(*watched);
            }
        }
        for watched in emptied {
            self.joined.remove(&watched);
        }
    }

    fn join(&mut self, mut cursor: Cursor) -> Join {
        if self.closed || cursor.tx.is_closed() {
            return Join::Ended;
        }
        if cursor.after < self.covered_from {
            return Join::Behind(cursor);
        }
        let from = self.ring.partition_point(|e| e.position <= cursor.after);
        for event in self.ring.range(from..) {
            if event.tenant == cursor.tenant {
                match offer(&mut cursor, event) {
                    Offer::Taken => {}
                    Offer::Full => return Join::Full(cursor),
                    Offer::Gone => return Join::Ended,
                }
                if event.keys_changed() {
                    return Join::Recheck(cursor);
                }
            } else if event.tenant == cursor.key_tenant && event.keys_changed() {
                // Not this watcher's event, but its key's tenant changed keys.
                cursor.after = event.position;
                return Join::Recheck(cursor);
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        let (handback, receiver) = oneshot::channel();
        self.joined.entry(cursor.tenant).or_default().insert(id, Subscriber { cursor, handback });
        Join::Joined { id, handback: receiver }
    }

    fn leave(&mut self, tenant: TenantId, id: u64) -> Option<Cursor> {
        let watchers = self.joined.get_mut(&tenant)?;
        let subscriber = watchers.remove(&id)?;
        if watchers.is_empty() {
            self.joined.remove(&tenant);
        }
        Some(subscriber.cursor)
    }

    #[cfg(test)]
    fn joined_count(&self) -> usize {
        self.joined.values().map(BTreeMap::len).sum()
    }

    /// The joined watchers of the tenants `events` belong to: how many connections their
    /// fan-out writes to (at most; filters take some out).
    fn watchers_of(&self, events: &[TailEvent]) -> usize {
        let tenants: std::collections::HashSet<TenantId> = events.iter().map(|e| e.tenant).collect();
        tenants.iter().filter_map(|t| self.joined.get(t)).map(BTreeMap::len).sum()
    }
}

/// What wakes the tail: this process's commits ([`bc_core::store::Log::subscribe`]) and their
/// answers being let go ([`bc_core::store::Log::answered`]).
pub struct Wakes {
    pub commits: tokio::sync::watch::Receiver<u64>,
    pub answered: tokio::sync::watch::Receiver<u64>,
}

/// The process's one tail. [`Tail::start`] starts its task the first time a watcher needs it.
pub struct Tail {
    limits: TailLimits,
    state: Mutex<TailState>,
    started: tokio::sync::OnceCell<()>,
}

impl Tail {
    pub fn new(limits: TailLimits) -> Arc<Self> {
        assert!(limits.ring_events >= 1 && limits.page_rows >= 1 && limits.buffer_events >= 1, "{limits:?}");
        Arc::new(Self { limits, state: Mutex::default(), started: tokio::sync::OnceCell::new() })
    }

    pub fn limits(&self) -> &TailLimits {
        &self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TailState> {
        self.state.lock().expect("watch tail")
    }

    /// Starts the tail's task at the end of the log, once; later calls return at once. It
    /// reads after every commit this process announces on `wakes.commits`, once the commit's
    /// writers have their answers (`wakes.answered`, or after `WATCH_ANSWER_WAIT_MS`), and hands
    /// what it read to `WATCH_AFTER_ANSWER_WATCHERS` or more watchers `WATCH_AFTER_ANSWER_MS`
    /// later; and every `WATCH_POLL_MS` for other processes' commits. It stops when `shutdown`
    /// is set (ending every joined watcher) or when nothing but the task holds the tail.
    pub async fn start(
        self: &Arc<Self>,
        store: &Arc<dyn EventStore>,
        wakes: Wakes,
        shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> bc_core::Result<()> {
        self.started
            .get_or_try_init(|| async {
                let at = end_of(store.last_commit().await?);
                {
                    let mut state = self.lock();
                    state.head = at;
                    state.covered_from = at;
                }
                tokio::spawn(run(self.clone(), store.clone(), wakes, shutdown));
                Ok::<_, bc_core::Error>(())
            })
            .await
            .map(|_| ())
    }

    /// Joins `cursor` (see the module's header on the seam).
    pub fn join(&self, cursor: Cursor) -> Join {
        self.lock().join(cursor)
    }

    /// Takes a joined watcher's cursor back; `None` if the tail has handed it back (it is on
    /// the watcher's handback channel) or dropped it.
    pub fn leave(&self, tenant: TenantId, id: u64) -> Option<Cursor> {
        self.lock().leave(tenant, id)
    }

    /// The joined watchers of the tenants `events` belong to.
    fn watchers_of(&self, events: &[TailEvent]) -> usize {
        self.lock().watchers_of(events)
    }

    /// Publishes events read after the head, in position order (the tail's task; tests).
    pub fn publish(&self, events: Vec<TailEvent>) {
        self.lock().publish(events, &self.limits)
    }

    /// Moves the head to `position` if it is behind: the tail has read that far.
    fn read_to(&self, position: Position) {
        let mut state = self.lock();
        state.head = state.head.max(position);
    }

    /// The newest position read.
    pub fn head(&self) -> Position {
        self.lock().head
    }

    /// What `/metrics` shows of the tail: whether its task started, the newest position it
    /// read, the watchers it holds (caught up), and how many it handed back for a full buffer.
    pub fn stats(&self) -> TailStats {
        let state = self.lock();
        TailStats {
            started: self.started.initialized(),
            head: state.head,
            joined: state.joined.values().map(BTreeMap::len).sum(),
            slow_handbacks: state.slow_handbacks,
        }
    }

    /// Ends every joined watcher; nothing joins any more.
    fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.joined.clear();
        state.ring.clear();
        state.ring_bytes = 0;
    }
}

/// The tail's task: everything committed after the head, a page at a time, then wait.
async fn run(tail: Arc<Tail>, store: Arc<dyn EventStore>, wakes: Wakes, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    let Wakes { mut commits, mut answered } = wakes;
    let mut notified = true;
    // The next read follows a wait for a commit's answers.
    let mut answered_now = false;
    loop {
        // The state that owns the tail is gone (a test's), or the server stops.
        if *shutdown.borrow() || Arc::strong_count(&tail) == 1 {
            tail.close();
            return;
        }
        loop {
            let rows = match store.read_after_rows(tail.head(), None, tail.limits.page_rows).await {
                Ok(rows) => rows,
                Err(e) => {
                    // Watchers stay joined and the read is tried again at the next wake.
                    tracing::warn!(error = %e, "the watch tail could not read the log; trying again");
                    break;
                }
            };
            let full = rows.len() >= tail.limits.page_rows as usize;
            let read_to = rows.last().map(|row| Position { commit: row.commit, index: row.index });
            let events: Vec<TailEvent> = rows.into_iter().filter_map(TailEvent::of_row).collect();
            // A fan-out to many connections waits a little more after its commit's answers
            // (`WATCH_AFTER_ANSWER_MS`): their clients read them while the cores are free.
            if std::mem::take(&mut answered_now) && tail.watchers_of(&events) >= WATCH_AFTER_ANSWER_WATCHERS {
                tokio::time::sleep(Duration::from_millis(WATCH_AFTER_ANSWER_MS)).await;
            }
            tail.publish(events);
            if let Some(read_to) = read_to {
                // Past a row naming no tenant too, so it is not read again.
                tail.read_to(read_to);
            }
            if !full || *shutdown.borrow() {
                break;
            }
        }
        tokio::select! {
            // If the appender is gone, its sender is dropped: fall back to polling only.
            changed = commits.changed(), if notified => {
                notified = changed.is_ok();
                // Answer first: the commit's writers have their responses, and their clients
                // the time to read them, before its fan-out (a write to every watcher's
                // connection) takes the cores (`WATCH_AFTER_ANSWER_MS` says
                // what it was measured to change). A commit the last read already took (it
                // landed while the tail waited or read) has nothing left to fan out: no wait.
                let commit = *commits.borrow_and_update();
                if tail.head().commit < commit {
                    let wait = tail.limits.answer_wait;
                    let _ = tokio::time::timeout(wait, answered.wait_for(|at| *at >= commit)).await;
                    answered_now = true;
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(WATCH_POLL_MS)) => {}
            _ = shutdown.changed() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    //! The seam, deterministically: the tail's state driven by hand, with the database's part
    //! played by the test (a watcher that reads history hands its cursor to `join` at the
    //! position it read to).

    use super::*;

    fn event(commit: u64, index: u32, tenant: TenantId, event_type: &str) -> TailEvent {
        let position = Position { commit, index };
        TailEvent {
            position,
            tenant,
            event_type: event_type.into(),
            frame: Some(Bytes::from(format!("id: {position}\nevent: {event_type}\ndata: {{}}\n\n"))),
        }
    }

    fn cursor(tenant: TenantId, after: Position, buffer: usize) -> (Cursor, mpsc::Receiver<Bytes>) {
        let (tx, rx) = mpsc::channel(buffer);
        (Cursor { tenant, key_tenant: tenant, filter: TypeFilter::default(), after, tx }, rx)
    }

    fn limits(ring_events: usize) -> TailLimits {
        TailLimits { ring_events, ring_bytes: usize::MAX, page_rows: 4, buffer_events: 4, ..TailLimits::default() }
    }

    fn state_at(commit: u64) -> TailState {
        TailState { head: end_of(commit), covered_from: end_of(commit), ..Default::default() }
    }

    /// The positions in a client's buffer, in order.
    fn drain(rx: &mut mpsc::Receiver<Bytes>) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(frame) = rx.try_recv() {
            let text = String::from_utf8(frame.to_vec()).unwrap();
            out.push(text.lines().next().unwrap().trim_start_matches("id: ").to_owned());
        }
        out
    }

    #[test]
    fn a_joined_watcher_gets_its_tenants_matching_events_once_each() {
        let (a, b) = (TenantId::generate(), TenantId::generate());
        let mut state = state_at(10);
        let (mut only_pools, mut pools) = cursor(a, end_of(10), 8);
        only_pools.filter = TypeFilter::parse(&["pool.*".into()]).unwrap();
        let (everything, mut all) = cursor(a, end_of(10), 8);
        let (other, mut others) = cursor(b, end_of(10), 8);
        for c in [only_pools, everything, other] {
            assert!(matches!(state.join(c), Join::Joined { .. }));
        }
        state.publish(
            vec![event(11, 0, a, "pool.created"), event(11, 1, a, "node.registered"), event(12, 0, b, "pool.created")],
            &limits(16),
        );
        assert_eq!(drain(&mut pools), ["11.0"]);
        assert_eq!(drain(&mut all), ["11.0", "11.1"]);
        assert_eq!(drain(&mut others), ["12.0"]);
        assert_eq!(state.joined_count(), 3);
    }

    /// A watcher that read the database ahead of the tail (the tail has not yet read commits 11
    /// and 12) joins at its cursor; when the tail reads them it sends only what comes after.
    #[test]
    fn no_duplicate_when_the_database_read_ran_ahead_of_the_tail() {
        let a = TenantId::generate();
        let mut state = state_at(10);
        let (c, mut rx) = cursor(a, Position { commit: 12, index: 0 }, 8);
        assert!(matches!(state.join(c), Join::Joined { .. }));
        state.publish(
            vec![event(11, 0, a, "pool.created"), event(12, 0, a, "pool.created"), event(12, 1, a, "pool.created")],
            &limits(16),
        );
        assert_eq!(drain(&mut rx), ["12.1"], "11.0 and 12.0 came from the database");
    }

    /// A watcher older than the ring reads the database; once its cursor is inside the ring,
    /// the join sends the ring's rest, and the tail what comes after: every event once, in
    /// order, whatever the tail published meanwhile (here it evicts what the watcher needs
    /// next, once, so the watcher reads the database again).
    #[test]
    fn no_gap_from_the_database_through_the_ring_to_the_tail() {
        let a = TenantId::generate();
        let limits = limits(4);
        let mut state = state_at(0);
        state.publish((1..=10).map(|c| event(c, 0, a, "pool.created")).collect(), &limits);
        assert_eq!(state.covered_from, Position { commit: 6, index: 0 }, "the ring holds 7..=10");
        let (c, mut rx) = cursor(a, Position::START, 16);
        let Join::Behind(mut c) = state.join(c) else { panic!("the ring does not reach back to the start") };
        // The watcher's database read, a page: commits 1..=4, sent by the watcher itself.
        let read = |c: &mut Cursor, commits: std::ops::RangeInclusive<u64>| {
            for commit in commits {
                c.tx.try_send(Bytes::from(format!("id: {commit}.0\n\n"))).unwrap();
                c.after = Position { commit, index: 0 };
            }
        };
        read(&mut c, 1..=4);
        let Join::Behind(mut c) = state.join(c) else { panic!("5 and 6 are not in the ring") };
        read(&mut c, 5..=6);
        // Meanwhile the tail reads 11 and 12, evicting 7 and 8: the watcher is behind again.
        state.publish(vec![event(11, 0, a, "pool.created"), event(12, 0, a, "pool.created")], &limits);
        let Join::Behind(mut c) = state.join(c) else { panic!("7 and 8 were evicted") };
        read(&mut c, 7..=8);
        assert!(matches!(state.join(c), Join::Joined { .. }), "9..=12 from the ring");
        state.publish(vec![event(13, 0, a, "pool.created")], &limits);
        let want: Vec<String> = (1..=13).map(|c| format!("{c}.0")).collect();
        assert_eq!(drain(&mut rx), want);
    }

    /// A full buffer hands the cursor back at the last event sent; after the client reads, the
    /// watcher joins again from there: nothing lost, nothing twice.
    #[test]
    fn a_slow_watcher_is_handed_back_and_rejoins_without_a_gap() {
        let a = TenantId::generate();
        let limits = limits(64);
        let mut state = state_at(0);
        let (c, mut rx) = cursor(a, end_of(0), 2);
        let Join::Joined { mut handback, .. } = state.join(c) else { panic!() };
        state.publish((1..=5).map(|c| event(c, 0, a, "pool.created")).collect(), &limits);
        let back = handback.try_recv().expect("handed back when the buffer filled");
        assert_eq!((back.why, back.cursor.after), (Why::Slow, Position { commit: 2, index: 0 }));
        assert_eq!(state.joined_count(), 0);
        let mut got = drain(&mut rx);
        // Joins again: 3 and 4 from the ring fill the buffer.
        let Join::Full(c) = state.join(back.cursor) else { panic!("the buffer fills again") };
        got.extend(drain(&mut rx));
        let Join::Joined { .. } = state.join(c) else { panic!("room for 5") };
        state.publish(vec![event(6, 0, a, "pool.created")], &limits);
        got.extend(drain(&mut rx));
        assert_eq!(got, ["1.0", "2.0", "3.0", "4.0", "5.0", "6.0"]);
    }

    /// An API key event hands back the tenant's watchers (after sending it, if they take it)
    /// and those holding the tenant's keys elsewhere; others stay joined.
    #[test]
    fn key_changes_hand_watchers_back_for_a_check() {
        let (a, b, root) = (TenantId::generate(), TenantId::generate(), TenantId::generate());
        let mut state = state_at(0);
        let (own, mut own_rx) = cursor(a, end_of(0), 8);
        let (mut by_root, _by_root_rx) = cursor(a, end_of(0), 8);
        by_root.key_tenant = root;
        let (other, _other_rx) = cursor(b, end_of(0), 8);
        let mut handbacks = Vec::new();
        for c in [own, by_root, other] {
            let Join::Joined { handback, .. } = state.join(c) else { panic!() };
            handbacks.push(handback);
        }
        state.publish(vec![event(1, 0, a, "api_key.created"), event(2, 0, a, "pool.created")], &limits(16));
        assert_eq!(drain(&mut own_rx), ["1.0"], "the key event is sent, nothing after it before the check");
        let back = handbacks[0].try_recv().unwrap();
        assert_eq!((back.why, back.cursor.after), (Why::Keys, Position { commit: 1, index: 0 }));
        assert_eq!(handbacks[1].try_recv().unwrap().why, Why::Keys);
        assert!(handbacks[2].try_recv().is_err(), "tenant b's watcher stays joined");
        // The root's keys change: the watcher holding a root key is handed back from the ring.
        state.publish(vec![event(3, 0, root, "api_key.revoked")], &limits(16));
        let (mut c, _rx) = cursor(a, Position { commit: 2, index: 0 }, 8);
        c.key_tenant = root;
        let Join::Recheck(c) = state.join(c) else { panic!("the ring holds the root's key event") };
        assert!(matches!(state.join(c), Join::Joined { .. }), "checked once, then joined");
    }

    #[test]
    fn gone_clients_and_unverified_events_end_watchers() {
        let a = TenantId::generate();
        let mut state = state_at(0);
        let (c, rx) = cursor(a, end_of(0), 8);
        let Join::Joined { handback, .. } = state.join(c) else { panic!() };
        drop(rx);
        state.publish(vec![event(1, 0, a, "pool.created")], &limits(16));
        assert_eq!(state.joined_count(), 0);
        drop(handback);
        let (c, _rx) = cursor(a, end_of(1), 8);
        let Join::Joined { mut handback, .. } = state.join(c) else { panic!() };
        let mut bad = event(2, 0, a, "pool.created");
        bad.frame = None;
        state.publish(vec![bad], &limits(16));
        assert!(matches!(handback.try_recv(), Err(oneshot::error::TryRecvError::Closed)), "dropped: the stream ends");
        let (c, _rx) = cursor(a, end_of(1), 8);
        assert!(matches!(state.join(c), Join::Ended), "a join across the bad event ends too");
    }

    #[test]
    fn a_fan_out_counts_the_watchers_of_its_events_tenants_once_each() {
        let (a, b, c) = (TenantId::generate(), TenantId::generate(), TenantId::generate());
        let mut state = state_at(0);
        let mut receivers = Vec::new();
        for tenant in [a, a, a, b] {
            let (cursor, rx) = cursor(tenant, end_of(0), 8);
            assert!(matches!(state.join(cursor), Join::Joined { .. }));
            receivers.push(rx);
        }
        let events = [event(1, 0, a, "pool.created"), event(1, 1, a, "pool.created"), event(2, 0, c, "pool.created")];
        assert_eq!(state.watchers_of(&events), 3, "a's three, once; c has none; b's are not written to");
        assert_eq!(state.watchers_of(&[event(3, 0, b, "pool.created")]), 1);
        assert_eq!(state.watchers_of(&[]), 0);
    }

    #[test]
    fn the_ring_is_bounded_in_events_and_bytes() {
        let a = TenantId::generate();
        let mut state = state_at(0);
        let limits = TailLimits { ring_events: 3, ring_bytes: 9_100, page_rows: 4, buffer_events: 4, ..TailLimits::default() };
        state.publish((1..=5).map(|c| event(c, 0, a, "pool.created")).collect(), &limits);
        assert_eq!(state.ring.len(), 3);
        assert_eq!(state.covered_from, Position { commit: 2, index: 0 });
        let mut big = event(6, 0, a, "pool.created");
        big.frame = Some(Bytes::from(vec![b'x'; 9_000]));
        state.publish(vec![big], &limits);
        assert_eq!(state.ring.len(), 1, "the bytes bound evicts the rest");
        assert!(state.ring_bytes <= limits.ring_bytes);
        let (c, _rx) = cursor(a, Position { commit: 4, index: 0 }, 8);
        assert!(matches!(state.join(c), Join::Behind(_)), "older than the ring");
    }
}
