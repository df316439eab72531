//! An in-memory view of tenants' nodes and live (queued and active) reservations, kept current by
//! reading the log forward by position from where it last read (one query for all tenants), so
//! neither a placement nor a reconciler pass reads every row.
//!
//! It is only a cache: every placement is still appended with a guard on the node's version, so
//! a stale view costs a CONFLICT, never a double booking. The decisions made on it are pure
//! functions of a [`TenantView`] (see [`crate::decide`]); within one process, the gateway then
//! marks the GPUs it is about to append as held ([`TenantView::hold`]), so concurrent requests
//! in the same process do not pick the same GPUs, and [`Reread`] makes the next use read what
//! it held from the store again, whether the append happened or not.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::Result;
use bc_core::event::Position;
use bc_core::id::TenantId;
use bc_core::store::EventStore;

use crate::{KIND_NODE, KIND_RESERVATION_LIVE, NodeDoc, ReservationDoc};

/// Log rows read per query while catching up.
const CATCH_UP_ROWS: u32 = 1000;

/// One tenant's view. Ordered maps throughout: the decisions iterate it, and an iteration that
/// decides something takes the same order in every process (by id), whatever the hasher.
#[derive(Default)]
pub struct TenantView {
    pub nodes: BTreeMap<String, NodeDoc>,
    /// Queued and active reservations.
    pub live: BTreeMap<String, ReservationDoc>,
    /// Rows to read again before the next use: changed in the log, or held for an append that
    /// failed.
    dirty_nodes: BTreeSet<String>,
    dirty_reservations: BTreeSet<String>,
    /// Nodes with GPUs held for appends not yet read back: a placement guards a node's store
    /// version, so two in flight on one node cannot both land.
    held: BTreeSet<String>,
}

impl TenantView {
    /// A view of these nodes and live reservations, with nothing held: what a test or the
    /// simulator hands to the decisions of [`crate::decide`].
    pub fn new(nodes: impl IntoIterator<Item = NodeDoc>, live: impl IntoIterator<Item = ReservationDoc>) -> Self {
        Self {
            nodes: nodes.into_iter().map(|n| (n.node_id.clone(), n)).collect(),
            live: live.into_iter().map(|r| (r.reservation_id.clone(), r)).collect(),
            ..Default::default()
        }
    }

    /// The nodes of a pool, by node id (placement breaks ties by node id too).
    pub fn pool_nodes(&mut self, pool: &str) -> Vec<&mut NodeDoc> {
        self.nodes.values_mut().filter(|n| n.pool_id == pool).collect()
    }

    /// Whether a placement this process decided on `node_id` is still in flight.
    pub fn is_held(&self, node_id: &str) -> bool {
        self.held.contains(node_id)
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
            if let Some(node) = self.nodes.get_mut(&p.node_id) {
                for gpu in &p.gpus {
                    node.allocations.insert(*gpu, pending.reservation_id.clone());
                }
            }
            self.held.insert(p.node_id.clone());
        }
        self.live.insert(pending.reservation_id.clone(), pending);
    }
}

/// What the log's catch-up found for the tenants with a slot, and the slots themselves. Behind a
/// plain mutex that is never held across an `await`: no database read happens under it.
#[derive(Default)]
struct Shared {
    /// Each tenant's view behind its own lock (`None` until loaded): loading or refreshing one
    /// tenant never waits on another's.
    /// A `BTreeMap`, so a pass over every tenant takes them in one order (the simulator's ids
    /// are drawn in that order, and the same seed must give the same log).
    slots: BTreeMap<TenantId, std::sync::Arc<tokio::sync::Mutex<Option<TenantView>>>>,
    /// Rows changed in the log (or held by a placer) since the tenant's view last read them.
    dirty: BTreeMap<TenantId, Dirty>,
}

#[derive(Default)]
struct Dirty {
    nodes: BTreeSet<String>,
    reservations: BTreeSet<String>,
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

/// The view of every tenant a process has used. Three locks, none held across another tenant's
/// database reads: `cursor` while the log's new rows are read (all tenants' events, from where
/// the last catch-up stopped), `shared` (a plain mutex) only to find a slot or record what
/// changed, and each tenant's own slot while that tenant is loaded, refreshed and decided on.
#[derive(Default)]
pub struct Fleet {
    /// Every event up to here is marked in `shared.dirty` for the tenants that had a slot.
    cursor: tokio::sync::Mutex<Option<Position>>,
    shared: std::sync::Mutex<Shared>,
}

type Slot = std::sync::Arc<tokio::sync::Mutex<Option<TenantView>>>;

impl Fleet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on the tenant's nodes in `pool`, brought up to date with the
    /// log first. `f` may change them: a placer records the GPUs it is about to append.
    pub async fn with_pool<R>(
        &self,
        store: &dyn EventStore,
        tenant: TenantId,
        pool: &str,
        f: impl FnOnce(&mut [&mut NodeDoc]) -> R,
    ) -> Result<R> {
        self.with_tenant(store, tenant, |view| f(&mut view.pool_nodes(pool))).await
    }

    /// Runs `f` on the tenant's view, brought up to date with the log first. Only this tenant's
    /// slot is held while its rows are read.
    pub async fn with_tenant<R>(
        &self,
        store: &dyn EventStore,
        tenant: TenantId,
        f: impl FnOnce(&mut TenantView) -> R,
    ) -> Result<R> {
        self.catch_up(store, false).await?;
        let slot = self.slot(tenant);
        let mut view = slot.lock().await;
        self.refresh(store, tenant, &mut view).await?;
        Ok(f(view.as_mut().expect("refreshed")))
    }

    /// Runs `f` on every tenant with live reservations, brought up to date first. `known` are
    /// tenants to load if they are not yet (the reconciler's first pass passes every tenant);
    /// after that, a tenant is loaded when a reservation event of its shows up in the log.
    /// Tenants are taken one at a time, each under its own slot.
    pub async fn with_busy_tenants<R>(
        &self,
        store: &dyn EventStore,
        known: &[TenantId],
        mut f: impl FnMut(TenantId, &mut TenantView) -> R,
    ) -> Result<Vec<R>> {
        self.catch_up(store, true).await?;
        for tenant in known {
            self.slot(*tenant);
        }
        let slots: Vec<(TenantId, Slot)> =
            self.shared.lock().expect("fleet").slots.iter().map(|(t, s)| (*t, s.clone())).collect();
        let mut out = Vec::new();
        for (tenant, slot) in slots {
            let mut view = slot.lock().await;
            self.refresh(store, tenant, &mut view).await?;
            let view = view.as_mut().expect("refreshed");
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
        let dirty = shared.dirty.entry(tenant).or_default();
        if let Some(node) = node_id {
            dirty.nodes.insert(node.to_owned());
        }
        if !reservation_id.is_empty() {
            dirty.reservations.insert(reservation_id.to_owned());
        }
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

    /// Loads the tenant's view if it is not yet, and reads again the rows marked dirty. A
    /// failure half-way leaves the view unloaded, so the next use loads it whole.
    async fn refresh(&self, store: &dyn EventStore, tenant: TenantId, view: &mut Option<TenantView>) -> Result<()> {
        let dirty = self.shared.lock().expect("fleet").dirty.remove(&tenant).unwrap_or_default();
        let Some(loaded) = view.as_mut() else {
            // Loaded from the rows as they are now, which reflect at least what was marked.
            *view = Some(load(store, tenant).await?);
            return Ok(());
        };
        loaded.dirty_nodes.extend(dirty.nodes);
        loaded.dirty_reservations.extend(dirty.reservations);
        if let Err(e) = reread_dirty(store, tenant, loaded).await {
            *view = None;
            return Err(e);
        }
        Ok(())
    }

    /// Reads the log after the cursor for every tenant at once and marks what changed for the
    /// tenants with a slot. With `discover`, a tenant without a slot whose reservations changed
    /// gets one (and is loaded at its next use). Holds only the cursor while reading the log; a
    /// failure leaves the cursor where it was (marks already made are only extra reads).
    async fn catch_up(&self, store: &dyn EventStore, discover: bool) -> Result<()> {
        let mut cursor = self.cursor.lock().await;
        let Some(mut after) = *cursor else {
            // First use: everything loaded from now on is at least this recent.
            *cursor = Some(Position { commit: store.last_commit().await?, index: u32::MAX >> 1 });
            return Ok(());
        };
        loop {
            let rows = store.read_after_rows(after, None, CATCH_UP_ROWS).await?;
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
                let dirty = shared.dirty.entry(tenant).or_default();
                // A node's agent stream changes its row too (its inventory gives its GPUs).
                if let Some(id) = row.stream.strip_prefix("node/").or_else(|| row.stream.strip_prefix("agent/")) {
                    dirty.nodes.insert(id.to_owned());
                } else if let Some(id) = reservation {
                    dirty.reservations.insert(id.to_owned());
                }
            }
            drop(shared);
            if rows.len() < CATCH_UP_ROWS as usize {
                break;
            }
        }
        *cursor = Some(after);
        Ok(())
    }
}

/// Reads again the rows of `view` marked dirty.
async fn reread_dirty(store: &dyn EventStore, tenant: TenantId, view: &mut TenantView) -> Result<()> {
    let t = tenant.to_string();
    while let Some(id) = view.dirty_nodes.iter().next().cloned() {
        match store.row_get(&t, KIND_NODE, &id).await? {
            Some(row) => view.nodes.insert(id.clone(), decode(row.doc)?),
            None => view.nodes.remove(&id),
        };
        view.held.remove(&id);
        view.dirty_nodes.remove(&id);
    }
    while let Some(id) = view.dirty_reservations.iter().next().cloned() {
        match store.row_get(&t, KIND_RESERVATION_LIVE, &id).await? {
            Some(row) => view.live.insert(id.clone(), decode(row.doc)?),
            None => view.live.remove(&id),
        };
        view.dirty_reservations.remove(&id);
    }
    Ok(())
}

fn decode<T: serde::de::DeserializeOwned>(doc: serde_json::Value) -> Result<T> {
    serde_json::from_value(doc).map_err(|e| bc_core::Error::Internal(format!("projection document: {e}")))
}

/// A tenant's rows as they are now. Events the catch-up replays over them later only make it
/// read some rows again, which is harmless.
async fn load(store: &dyn EventStore, tenant: TenantId) -> Result<TenantView> {
    let nodes: Vec<NodeDoc> = crate::placement::all_rows(store, tenant, KIND_NODE).await?;
    let live = crate::placement::live(store, tenant).await?;
    Ok(TenantView {
        nodes: nodes.into_iter().map(|n| (n.node_id.clone(), n)).collect(),
        live: live.into_iter().map(|r| (r.reservation_id.clone(), r)).collect(),
        ..Default::default()
    })
}
