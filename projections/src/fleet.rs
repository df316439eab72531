//! An in-memory view of tenants' nodes and live (queued and active) reservations, kept current by
//! reading the log forward by position from where it last read (one query for all tenants), so
//! neither a placement nor a reconciler pass reads every row.
//!
//! It is only a cache: every placement is still appended with a guard on the node's version, so
//! a stale view costs a CONFLICT, never a double booking. The decisions made on it are pure
//! functions of a [`FleetIndex`] (see [`crate::decide`]); within one process, the gateway then
//! marks the GPUs it is about to append as held ([`FleetIndex::hold`]), so concurrent requests
//! in the same process do not pick the same GPUs, and [`Reread`] makes the next use read what
//! it held from the store again, whether the append happened or not.
//!
//! It also keeps the tenant's pools, for their offers (`pools.offer`): a reservation held for
//! another tenant is placed (or requeued) only while its pool is offered to that tenant
//! ([`FleetIndex::offer_of`]), and the append that relies on it guards the pool's version read.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::Result;
use bc_core::event::Position;
use bc_core::id::TenantId;
use bc_core::store::{EventStore, ROWS_GET_MAX};

use crate::decide::PoolLoad;
use crate::{BindingState, KIND_NODE, KIND_POOL, KIND_RESERVATION_LIVE, NodeDoc, PoolDoc, ReservationDoc, ReservationState};

/// Log rows read per query while catching up.
const CATCH_UP_ROWS: u32 = 1000;

/// One tenant's fleet index: its nodes and live reservations, with the rankings and loads the
/// decisions read, kept as they change. Ordered maps throughout: the decisions iterate it, and an iteration that
/// decides something takes the same order in every process (by id), whatever the hasher.
#[derive(Default)]
pub struct FleetIndex {
    /// Private: every change goes through [`Self::put_node`], [`Self::remove_node`] and
    /// [`Self::hold`], which keep `ranked` equal to a ranking of it.
    nodes: BTreeMap<String, NodeDoc>,
    /// Each pool's nodes by (free GPUs, node id), kept as the nodes change: placement walks the
    /// nodes with enough free GPUs in the order it prefers them instead of scoring every node
    /// of the pool (before, at 10,000 nodes a placement scored all of them, 2.6 ms).
    ranked: BTreeMap<String, BTreeSet<(u32, String)>>,
    /// Queued and active reservations. Private: every change goes through [`Self::put_live`]
    /// and [`Self::remove_live`], which keep `loads` equal to a count of it.
    live: BTreeMap<String, ReservationDoc>,
    /// Each pool's [`PoolLoad`] of `live`, kept as it changes (pools with no live reservation
    /// absent): a request's quota and queue are read here instead of counting every live
    /// reservation of the tenant (before, that count was a third of a reservation's time at 20,000 live).
    loads: BTreeMap<String, PoolLoad>,
    /// Active reservations by when a reconciler pass must next look at them ([`attention_at`]),
    /// kept as `live` changes: a pass takes those due instead of reading every live
    /// reservation twice (before, at 20,000 live a pass on every commit read them all).
    attention: BTreeSet<(u64, String)>,
    /// Nodes with GPUs held for appends still in flight, and how many: a placement guards a
    /// node's store version, so two in flight on one node cannot both land. A held node's row
    /// is not read back until its placers are done ([`Fleet::reread`]): a read made while an
    /// append was in flight may miss it, and a placement decided on it would be a CONFLICT.
    held: BTreeMap<String, u32>,
    /// The tenant's pools, by id: what a held reservation's offer is read on ([`Self::offer_of`]).
    /// A pool absent here offers nothing to anyone, so a view that does not know a held
    /// reservation's pool never places it.
    pools: BTreeMap<String, PoolDoc>,
}

/// Whether a live reservation may still be placed, as far as its pool's offers go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// The chain's own reservation: no offer is involved.
    Own,
    /// Held for a tenant its pool is offered to, read at the pool's `pool_version`: an append
    /// that relies on it guards that version, so a withdrawal landing meanwhile is a CONFLICT.
    Offered { pool_version: u64 },
    /// Held for a tenant its pool is no longer offered to (or a pool the view does not know:
    /// `pool_version` `None`): it is never placed again.
    Withdrawn { pool_version: Option<u64> },
}

impl FleetIndex {
    /// A view of these nodes and live reservations, with nothing held: what a test or the
    /// simulator hands to the decisions of [`crate::decide`].
    pub fn new(nodes: impl IntoIterator<Item = NodeDoc>, live: impl IntoIterator<Item = ReservationDoc>) -> Self {
        let mut view = Self::default();
        for node in nodes {
            view.put_node(node);
        }
        for rsv in live {
            view.put_live(rsv);
        }
        view
    }

    /// The pools, by id.
    pub fn pools(&self) -> &BTreeMap<String, PoolDoc> {
        &self.pools
    }

    /// Adds or replaces a pool.
    pub fn put_pool(&mut self, pool: PoolDoc) {
        self.pools.insert(pool.pool_id.clone(), pool);
    }

    /// Whether `rsv` may still be placed as far as its pool's offers go (see [`Offer`]).
    pub fn offer_of(&self, rsv: &ReservationDoc) -> Offer {
        let Some(holder) = rsv.holder_tenant_id.as_deref() else { return Offer::Own };
        match self.pools.get(&rsv.pool_id) {
            Some(pool) if pool.offered_to.contains(holder) => Offer::Offered { pool_version: pool.version },
            Some(pool) => Offer::Withdrawn { pool_version: Some(pool.version) },
            None => Offer::Withdrawn { pool_version: None },
        }
    }

    /// Nodes, by id.
    pub fn nodes(&self) -> &BTreeMap<String, NodeDoc> {
        &self.nodes
    }

    /// Adds or replaces a node.
    pub fn put_node(&mut self, node: NodeDoc) {
        self.remove_node(&node.node_id);
        let entry = (crate::placement::free_gpus(&node), node.node_id.clone());
        self.ranked.entry(node.pool_id.clone()).or_default().insert(entry);
        self.nodes.insert(node.node_id.clone(), node);
    }

    /// Removes a node, if it is there.
    pub fn remove_node(&mut self, id: &str) -> Option<NodeDoc> {
        let node = self.nodes.remove(id)?;
        if let Some(ranked) = self.ranked.get_mut(&node.pool_id) {
            ranked.remove(&(crate::placement::free_gpus(&node), node.node_id.clone()));
            if ranked.is_empty() {
                self.ranked.remove(&node.pool_id);
            }
        }
        Some(node)
    }

    /// A pool's nodes with at least `min_free` free GPUs, with their free GPUs, in ascending
    /// order of (free GPUs, node id): what [`crate::placement::place_ranked`] walks.
    pub fn ranked(&self, pool_id: &str, min_free: u32) -> impl DoubleEndedIterator<Item = (u32, &NodeDoc)> + Clone {
        let from = (min_free, String::new());
        self.ranked
            .get(pool_id)
            .into_iter()
            .flat_map(move |set| set.range(from.clone()..))
            .filter_map(|(free, id)| Some((*free, self.nodes.get(id)?)))
    }

    /// Queued and active reservations, by id.
    pub fn live(&self) -> &BTreeMap<String, ReservationDoc> {
        &self.live
    }

    /// Adds or replaces a live reservation.
    pub fn put_live(&mut self, rsv: ReservationDoc) {
        self.remove_live(&rsv.reservation_id);
        self.loads.entry(rsv.pool_id.clone()).or_default().add(&rsv);
        if let Some(at) = attention_at(&rsv) {
            self.attention.insert((at, rsv.reservation_id.clone()));
        }
        self.live.insert(rsv.reservation_id.clone(), rsv);
    }

    /// Removes a live reservation (ended, or gone from the store), if it is there.
    pub fn remove_live(&mut self, id: &str) -> Option<ReservationDoc> {
        let rsv = self.live.remove(id)?;
        if let Some(load) = self.loads.get_mut(&rsv.pool_id)
            && load.remove(&rsv)
        {
            self.loads.remove(&rsv.pool_id);
        }
        if let Some(at) = attention_at(&rsv) {
            self.attention.remove(&(at, rsv.reservation_id.clone()));
        }
        Some(rsv)
    }

    /// The active reservations a pass at `now_ms` must look at, by (time due, id): every one
    /// whose end or hold deadline has come, or whose hold failed, and perhaps others (a
    /// reservation is listed by the earlier of its times; the pass checks each).
    pub fn needing_attention(&self, now_ms: u64) -> impl Iterator<Item = &ReservationDoc> {
        self.attention.range(..(now_ms.saturating_add(1), String::new())).filter_map(|(_, id)| self.live.get(id))
    }

    /// The load of one pool: its live reservations' GPUs and its queue.
    pub fn pool_load(&self, pool_id: &str) -> &PoolLoad {
        static EMPTY: PoolLoad = PoolLoad::EMPTY;
        self.loads.get(pool_id).unwrap_or(&EMPTY)
    }

    /// Every pool's load, by pool id (pools with no live reservation are absent).
    pub fn pool_loads(&self) -> &BTreeMap<String, PoolLoad> {
        &self.loads
    }

    /// Whether a placement this process decided on `node_id` is still in flight.
    pub fn is_held(&self, node_id: &str) -> bool {
        self.held.contains_key(node_id)
    }

    /// Holds in the view what an append about to be made will do, until the store is read
    /// again: `pending` joins the live reservations (so queues and quotas count it), and
    /// `placement`'s GPUs are marked as `pending`'s on their node, so concurrent requests in
    /// this process do not pick them.
    ///
    /// The node's version is left alone: a guard must name a version whose content the decision
    /// saw. A later placement on the same node guards the same store version, so if this append
    /// commits first, that one is a CONFLICT; if this append fails, that one was decided on the
    /// store's content minus even more free GPUs, which is still sound. (Bumping the version
    /// here would let a view of "store at v, plus a hold that never landed" pass a guard on a
    /// store version v+1 that someone else's event made, with other GPUs taken: a double
    /// booking.)
    pub fn hold(&mut self, pending: ReservationDoc, placement: Option<&crate::placement::Placement>) {
        if let Some(p) = placement {
            if let Some(mut node) = self.remove_node(&p.node_id) {
                for gpu in &p.gpus {
                    node.allocations.insert(*gpu, pending.reservation_id.clone());
                }
                self.put_node(node);
            }
            *self.held.entry(p.node_id.clone()).or_default() += 1;
        }
        self.put_live(pending);
    }
}

/// When a reconciler pass must next look at a live reservation: an active one's end, its hold's
/// deadline while the node has not answered, or at once (0) when the hold failed; never for a
/// queued one (the pass reads the queues from the pools' loads).
pub fn attention_at(rsv: &ReservationDoc) -> Option<u64> {
    if rsv.state != ReservationState::Active {
        return None;
    }
    let hold = rsv.binding.as_ref().and_then(|b| match b.state {
        BindingState::Failed => Some(0),
        BindingState::Pending => b.deadline_at_ms,
        BindingState::Bound | BindingState::Released => None,
    });
    match (rsv.ends_at_ms, hold) {
        (Some(end), Some(hold)) => Some(end.min(hold)),
        (end, hold) => end.or(hold),
    }
}

/// What the log's catch-up found for the tenants with a slot, and the slots themselves. Behind a
/// plain mutex that is never held across an `await`: no database read happens under it.
#[derive(Default)]
struct Shared {
    /// Marks made so far: each mark of a row in `dirty` takes the next number, so a refresh
    /// that read a row knows whether it was marked again while it read (then it stays dirty).
    marks: u64,
    /// Each tenant's view behind its own lock (`None` until loaded): loading or refreshing one
    /// tenant never waits on another's.
    /// A `BTreeMap`, so a pass over every tenant takes them in one order (the simulator's ids
    /// are drawn in that order, and the same seed must give the same log).
    slots: BTreeMap<TenantId, std::sync::Arc<tokio::sync::Mutex<Option<FleetIndex>>>>,
    /// Rows changed in the log (or held by a placer) since the tenant's view last read them.
    dirty: BTreeMap<TenantId, Dirty>,
    /// Placers done with their holds ([`Fleet::reread`]) on each node, not yet taken off the
    /// view's `held` counts (the next refresh does).
    released: BTreeMap<TenantId, BTreeMap<String, u32>>,
    /// Placements that landed ([`Reread::landed`]): node → (the version the placement read, the
    /// version its append gave the node), for the next refresh to move the view's node to.
    landed: BTreeMap<TenantId, BTreeMap<String, (u64, u64)>>,
}

/// Rows to read again before the next use (changed in the log, or held for an append that
/// may have failed), each with the number of its latest mark.
#[derive(Clone, Default)]
struct Dirty {
    nodes: BTreeMap<String, u64>,
    reservations: BTreeMap<String, u64>,
    /// Read with either kind of refresh: pools change seldom, and a plan reads their offers.
    pools: BTreeMap<String, u64>,
}

impl Dirty {
    fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.reservations.is_empty() && self.pools.is_empty()
    }
}

impl Shared {
    fn mark(&mut self, tenant: TenantId, node: Option<&str>, reservation: Option<&str>) {
        self.marks += 1;
        let (mark, dirty) = (self.marks, self.dirty.entry(tenant).or_default());
        if let Some(id) = node {
            dirty.nodes.insert(id.to_owned(), mark);
        }
        if let Some(id) = reservation {
            dirty.reservations.insert(id.to_owned(), mark);
        }
    }

    fn mark_pool(&mut self, tenant: TenantId, pool: &str) {
        self.marks += 1;
        let mark = self.marks;
        self.dirty.entry(tenant).or_default().pools.insert(pool.to_owned(), mark);
    }
}

/// Makes the view read a node and a reservation again once a placer is done with its holds,
/// also when the placer is cancelled half-way (a client that hangs up mid-request): dropped
/// without [`Reread::now`], it does so from a spawned task.
pub struct Reread {
    fleet: std::sync::Arc<Fleet>,
    tenant: TenantId,
    node: Option<String>,
    reservation: String,
    armed: bool,
}

impl Reread {
    pub fn new(fleet: std::sync::Arc<Fleet>, tenant: TenantId, node: Option<String>, reservation: String) -> Self {
        Self { fleet, tenant, node, reservation, armed: true }
    }

    pub async fn now(mut self) {
        self.armed = false;
        self.fleet.reread(self.tenant, self.node.as_deref(), &self.reservation).await;
    }

    /// The placement's append landed, moving its node from version `read` (the one its guard
    /// named) to `appended`: the view's node, which is the store's at `read` with the placed
    /// GPUs held, is the store's at `appended` (or holds more, for other placers still in
    /// flight, who will conflict), so it takes that version without reading the row again.
    /// The next request's tightest fit is often this very node: read again later, it would be
    /// decided on the old version and conflict. The reservation is read again.
    pub async fn landed(mut self, read: u64, appended: u64) {
        self.armed = false;
        // The new version before the release: a refresh between the two must not find the node
        // released, free to place on, at the old version (a placement on it would conflict).
        if let Some(node) = &self.node {
            let mut shared = self.fleet.shared.lock().expect("fleet");
            if shared.slots.contains_key(&self.tenant) {
                shared.landed.entry(self.tenant).or_default().insert(node.clone(), (read, appended));
            }
        }
        self.fleet.reread(self.tenant, self.node.as_deref(), &self.reservation).await;
    }
}

impl Drop for Reread {
    fn drop(&mut self) {
        if self.armed
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (fleet, tenant, node, reservation) =
                (self.fleet.clone(), self.tenant, self.node.take(), std::mem::take(&mut self.reservation));
            runtime.spawn(async move { fleet.reread(tenant, node.as_deref(), &reservation).await });
        }
    }
}

/// The view of every tenant a process has used. No lock is held across a database read (issue
/// 17): rows are read first, then applied under the locks. `cursor` and `shared` are plain
/// mutexes taken only to copy or record (where the log was read to, what changed); each
/// tenant's slot is taken to apply what was read and while the tenant is decided on.
///
/// Reads that race are sound: marks are idempotent; a refresh removes a row's mark only if no
/// newer mark came while it read (so a row changed meanwhile is read again at the next use); a
/// node row older than the view's is not applied over it; and every use catches up with the log
/// first, so a change a racing refresh missed is marked before the next decision. What stays
/// is what always was: the view may be stale, and a decision on a stale view is a CONFLICT at
/// its guarded append, never a double booking.
#[derive(Default)]
pub struct Fleet {
    /// Every event up to here is marked in `shared.dirty` for the tenants that had a slot.
    cursor: std::sync::Mutex<Option<Position>>,
    shared: std::sync::Mutex<Shared>,
}

type Slot = std::sync::Arc<tokio::sync::Mutex<Option<FleetIndex>>>;

/// Which of a tenant's dirty rows a refresh reads again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kinds {
    /// Its nodes and its live reservations.
    All,
    /// Its live reservations only: its nodes stay as they are, marked.
    Reservations,
}

impl Fleet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on the tenant's view, brought up to date with the log first. Only this tenant's
    /// slot is held while its rows are read.
    pub async fn with_tenant<R>(
        &self,
        store: &dyn EventStore,
        tenant: TenantId,
        f: impl FnOnce(&mut FleetIndex) -> R,
    ) -> Result<R> {
        self.catch_up(store, false).await?;
        let slot = self.slot(tenant);
        self.refresh(store, tenant, &slot, Kinds::All).await?;
        let mut view = slot.lock().await;
        Ok(f(view.as_mut().expect("a refreshed view is loaded, and stays so")))
    }

    /// Runs `f` on every tenant with live reservations, brought up to date first: its live
    /// reservations always, its nodes only when `needs_nodes` says `f` will look at them on the
    /// view as it then is (else the nodes that changed stay marked, and are read at the next use
    /// that needs them). `known` are tenants to load if they are not yet (the reconciler's first
    /// pass passes every tenant); after that, a tenant is loaded when a reservation event of its
    /// shows up in the log. Tenants are taken one at a time, each under its own slot.
    pub async fn with_busy_tenants<R>(
        &self,
        store: &dyn EventStore,
        known: &[TenantId],
        needs_nodes: impl Fn(&FleetIndex) -> bool,
        mut f: impl FnMut(TenantId, &mut FleetIndex) -> R,
    ) -> Result<Vec<R>> {
        self.catch_up(store, true).await?;
        for tenant in known {
            self.slot(*tenant);
        }
        let slots: Vec<(TenantId, Slot)> =
            self.shared.lock().expect("fleet").slots.iter().map(|(t, s)| (*t, s.clone())).collect();
        let mut out = Vec::new();
        for (tenant, slot) in slots {
            self.refresh(store, tenant, &slot, Kinds::Reservations).await?;
            let mut view = slot.lock().await;
            if view.as_ref().is_some_and(|view| !view.live.is_empty() && needs_nodes(view)) {
                drop(view);
                self.refresh(store, tenant, &slot, Kinds::All).await?;
                view = slot.lock().await;
            }
            let view = view.as_mut().expect("a refreshed view is loaded, and stays so");
            if !view.live.is_empty() {
                out.push(f(tenant, view));
            }
        }
        Ok(out)
    }

    /// Reads a node and a reservation again before the next use: what a placer held in the view
    /// is replaced by what the store holds, whether its append happened or not.
    pub async fn reread(&self, tenant: TenantId, node_id: Option<&str>, reservation_id: &str) {
        let mut shared = self.shared.lock().expect("fleet");
        if !shared.slots.contains_key(&tenant) {
            return;
        }
        if let Some(node) = node_id {
            *shared.released.entry(tenant).or_default().entry(node.to_owned()).or_default() += 1;
        }
        shared.mark(tenant, node_id, (!reservation_id.is_empty()).then_some(reservation_id));
    }

    /// Starts following the log from now, if not yet: call before listing the tenants to load,
    /// so nothing committed in between is missed.
    pub async fn prime(&self, store: &dyn EventStore) -> Result<()> {
        self.catch_up(store, true).await
    }

    /// The tenant's slot, made (empty) if it has none: from then on the catch-up records what
    /// changes for it.
    fn slot(&self, tenant: TenantId) -> Slot {
        self.shared.lock().expect("fleet").slots.entry(tenant).or_default().clone()
    }

    /// Loads the tenant's view if it is not yet, and reads again the rows of `kinds` marked
    /// dirty: read with no lock held, then applied under the slot. A failure applies nothing and
    /// leaves every mark, so the next use reads the same rows again; rows not read stay marked.
    async fn refresh(&self, store: &dyn EventStore, tenant: TenantId, slot: &Slot, kinds: Kinds) -> Result<()> {
        if slot.lock().await.is_none() {
            // Rows read from here on reflect at least every mark made so far.
            let marked = self.shared.lock().expect("fleet").marks;
            let fresh = load(store, tenant).await?;
            let mut view = slot.lock().await;
            if view.is_none() {
                *view = Some(fresh);
                let mut shared = self.shared.lock().expect("fleet");
                if let Some(dirty) = shared.dirty.get_mut(&tenant) {
                    dirty.nodes.retain(|_, mark| *mark > marked);
                    dirty.reservations.retain(|_, mark| *mark > marked);
                    dirty.pools.retain(|_, mark| *mark > marked);
                }
            }
        }
        // Only the kinds to read: a reconciler that needs no nodes leaves thousands marked.
        let wanted = match self.shared.lock().expect("fleet").dirty.get(&tenant) {
            Some(dirty) => Dirty {
                nodes: if kinds == Kinds::All { dirty.nodes.clone() } else { BTreeMap::new() },
                reservations: dirty.reservations.clone(),
                pools: dirty.pools.clone(),
            },
            None => Dirty::default(),
        };
        if wanted.is_empty() {
            return Ok(());
        }
        let read = read_rows(store, tenant, &wanted).await?;
        let mut view = slot.lock().await;
        let view = view.as_mut().expect("loaded above or by a racing refresh");
        let mut shared = self.shared.lock().expect("fleet");
        for (node, done) in shared.released.remove(&tenant).unwrap_or_default() {
            if let Some(count) = view.held.get_mut(&node) {
                *count = count.saturating_sub(done);
                if *count == 0 {
                    view.held.remove(&node);
                }
            }
        }
        for (id, (read_at, appended)) in shared.landed.remove(&tenant).unwrap_or_default() {
            if let Some(mut node) = view.nodes.get(&id).filter(|n| n.version == read_at).cloned() {
                node.version = appended;
                view.put_node(node);
            }
        }
        let dirty = shared.dirty.entry(tenant).or_default();
        for (id, doc) in read.nodes {
            // Marked again while it was read (the read may predate what the mark is for), or
            // held by a placer still appending (the read may predate its append): the view
            // keeps what it has, and the row stays marked, to be read at the next use.
            if dirty.nodes.get(&id) != wanted.nodes.get(&id) || view.is_held(&id) {
                continue;
            }
            match doc {
                // A racing refresh may have applied a newer read of this row already.
                Some(doc) if view.nodes.get(&id).is_some_and(|seen| seen.version > doc.version) => {}
                Some(doc) => view.put_node(doc),
                None => drop(view.remove_node(&id)),
            }
            dirty.nodes.remove(&id);
        }
        for (id, doc) in read.reservations {
            match doc {
                Some(doc) => view.put_live(doc),
                None => drop(view.remove_live(&id)),
            }
            if dirty.reservations.get(&id) == wanted.reservations.get(&id) {
                dirty.reservations.remove(&id);
            }
        }
        for (id, doc) in read.pools {
            match doc {
                Some(doc) if view.pools.get(&id).is_some_and(|seen| seen.version > doc.version) => {}
                Some(doc) => view.put_pool(doc),
                None => drop(view.pools.remove(&id)),
            }
            if dirty.pools.get(&id) == wanted.pools.get(&id) {
                dirty.pools.remove(&id);
            }
        }
        Ok(())
    }

    /// Reads the log after the cursor for every tenant at once and marks what changed for the
    /// tenants with a slot. With `discover`, a tenant without a slot whose reservations changed
    /// gets one (and is loaded at its next use). No lock is held while the log is read: racing
    /// catch-ups read the same rows and make the same marks, and the cursor only moves forward.
    /// A failure leaves the cursor where it was (marks already made are only extra reads).
    async fn catch_up(&self, store: &dyn EventStore, discover: bool) -> Result<()> {
        let Some(mut after) = *self.cursor.lock().expect("fleet") else {
            // First use: everything loaded from now on is at least this recent.
            let at = Position { commit: store.last_commit().await?, index: u32::MAX >> 1 };
            self.cursor.lock().expect("fleet").get_or_insert(at);
            return Ok(());
        };
        loop {
            let rows = store.read_after_touches(after, CATCH_UP_ROWS).await?;
            let Some(last) = rows.last() else { break };
            after = Position { commit: last.commit, index: last.index };
            let mut shared = self.shared.lock().expect("fleet");
            for row in &rows {
                let Ok(tenant) = row.tenant.parse::<TenantId>() else { continue };
                let reservation = row.stream.strip_prefix("reservation/");
                if let std::collections::btree_map::Entry::Vacant(vacant) = shared.slots.entry(tenant) {
                    if discover && reservation.is_some() {
                        vacant.insert(Slot::default());
                    }
                    // Loaded at its next use, from rows at least this recent.
                    continue;
                }
                // A node's agent stream changes its row too (its inventory gives its GPUs).
                if let Some(id) = row.stream.strip_prefix("node/").or_else(|| row.stream.strip_prefix("agent/")) {
                    shared.mark(tenant, Some(id), None);
                } else if reservation.is_some() {
                    shared.mark(tenant, None, reservation);
                } else if let Some(id) = row.stream.strip_prefix("pool/") {
                    shared.mark_pool(tenant, id);
                }
            }
            drop(shared);
            if rows.len() < CATCH_UP_ROWS as usize {
                break;
            }
        }
        let mut cursor = self.cursor.lock().expect("fleet");
        if cursor.is_none_or(|at| at < after) {
            *cursor = Some(after);
        }
        Ok(())
    }
}

/// Rows of a tenant read again: each dirty id with its row (`None`: gone).
#[derive(Default)]
struct ReadRows {
    nodes: Vec<(String, Option<NodeDoc>)>,
    reservations: Vec<(String, Option<ReservationDoc>)>,
    pools: Vec<(String, Option<PoolDoc>)>,
}

/// Reads the rows `dirty` names, holding no lock: a statement per kind (and per
/// [`ROWS_GET_MAX`] ids), not one per row.
async fn read_rows(store: &dyn EventStore, tenant: TenantId, dirty: &Dirty) -> Result<ReadRows> {
    let t = tenant.to_string();
    Ok(ReadRows {
        nodes: read_kind(store, &t, KIND_NODE, dirty.nodes.keys()).await?,
        reservations: read_kind(store, &t, KIND_RESERVATION_LIVE, dirty.reservations.keys()).await?,
        pools: read_kind(store, &t, KIND_POOL, dirty.pools.keys()).await?,
    })
}

/// Each of `ids` with its row of `kind`, decoded (`None`: it has none).
async fn read_kind<'i, T: serde::de::DeserializeOwned>(
    store: &dyn EventStore,
    tenant: &str,
    kind: &str,
    ids: impl Iterator<Item = &'i String>,
) -> Result<Vec<(String, Option<T>)>> {
    let ids: Vec<&str> = ids.map(String::as_str).collect();
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(ROWS_GET_MAX) {
        // Decoded from the stored text into the type at once, not through a JSON tree.
        let mut rows: BTreeMap<String, String> =
            store.rows_get_raw(tenant, kind, chunk).await?.into_iter().map(|r| (r.key.id, r.doc)).collect();
        for id in chunk {
            let doc = rows.remove(*id).map(|text| serde_json::from_str(&text)).transpose();
            out.push(((*id).to_owned(), doc.map_err(|e| bc_core::Error::Internal(format!("projection document: {e}")))?));
        }
    }
    Ok(out)
}

/// A tenant's rows as they are now. Events the catch-up replays over them later only make it
/// read some rows again, which is harmless.
async fn load(store: &dyn EventStore, tenant: TenantId) -> Result<FleetIndex> {
    let nodes: Vec<NodeDoc> = crate::placement::all_rows(store, tenant, KIND_NODE).await?;
    let live = crate::placement::live(store, tenant).await?;
    let pools: Vec<PoolDoc> = crate::placement::all_rows(store, tenant, KIND_POOL).await?;
    let mut view = FleetIndex::new(nodes, live);
    for pool in pools {
        view.put_pool(pool);
    }
    Ok(view)
}
