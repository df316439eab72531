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

use std::collections::{HashMap, HashSet};

use bc_core::Result;
use bc_core::event::Position;
use bc_core::id::TenantId;
use bc_core::store::EventStore;

use crate::{KIND_NODE, KIND_RESERVATION_LIVE, NodeDoc, ReservationDoc};

/// Log rows read per query while catching up.
const CATCH_UP_ROWS: u32 = 1000;

/// One tenant's view.
#[derive(Default)]
pub struct TenantView {
    pub nodes: HashMap<String, NodeDoc>,
    /// Queued and active reservations.
    pub live: HashMap<String, ReservationDoc>,
    /// Rows to read again before the next use: changed in the log, or held for an append that
    /// failed.
    dirty_nodes: HashSet<String>,
    dirty_reservations: HashSet<String>,
    /// Nodes with GPUs held for appends not yet read back: a placement guards a node's store
    /// version, so two in flight on one node cannot both land.
    held: HashSet<String>,
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

    /// The nodes of a pool, in no particular order (placement breaks ties by node id).
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

#[derive(Default)]
struct Inner {
    /// Every event up to here is reflected in the loaded tenants.
    after: Option<Position>,
    tenants: HashMap<TenantId, TenantView>,
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

#[derive(Default)]
pub struct Fleet {
    inner: tokio::sync::Mutex<Inner>,
}

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

    /// Runs `f` on the tenant's view, brought up to date with the log first.
    pub async fn with_tenant<R>(
        &self,
        store: &dyn EventStore,
        tenant: TenantId,
        f: impl FnOnce(&mut TenantView) -> R,
    ) -> Result<R> {
        let mut inner = self.inner.lock().await;
        catch_up_or_reset(store, &mut inner, false).await?;
        let view = match inner.tenants.entry(tenant) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(load(store, tenant).await?),
        };
        Ok(f(view))
    }

    /// Runs `f` on every tenant with live reservations, brought up to date first. `known` are
    /// tenants to load if they are not yet (the reconciler's first pass passes every tenant);
    /// after that, a tenant is loaded when a reservation event of its shows up in the log.
    pub async fn with_busy_tenants<R>(
        &self,
        store: &dyn EventStore,
        known: &[TenantId],
        mut f: impl FnMut(TenantId, &mut TenantView) -> R,
    ) -> Result<Vec<R>> {
        let mut inner = self.inner.lock().await;
        catch_up_or_reset(store, &mut inner, true).await?;
        for tenant in known {
            if let std::collections::hash_map::Entry::Vacant(v) = inner.tenants.entry(*tenant) {
                v.insert(load(store, *tenant).await?);
            }
        }
        Ok(inner.tenants.iter_mut().filter(|(_, v)| !v.live.is_empty()).map(|(t, v)| f(*t, v)).collect())
    }

    /// Reads a node and a reservation again before the next use: what a placer held in the view
    /// is replaced by what the store holds, whether its append happened or not.
    pub async fn reread(&self, tenant: TenantId, node_id: Option<&str>, reservation_id: &str) {
        if let Some(view) = self.inner.lock().await.tenants.get_mut(&tenant) {
            if let Some(node) = node_id {
                view.dirty_nodes.insert(node.to_owned());
            }
            if !reservation_id.is_empty() {
                view.dirty_reservations.insert(reservation_id.to_owned());
            }
        }
    }

    /// Starts following the log from now, if not yet: call before listing the tenants to load,
    /// so nothing committed in between is missed.
    pub async fn prime(&self, store: &dyn EventStore) -> Result<()> {
        let mut inner = self.inner.lock().await;
        catch_up_or_reset(store, &mut inner, true).await
    }
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

/// A catch-up that fails half-way may have dropped what it meant to read again: start over.
async fn catch_up_or_reset(store: &dyn EventStore, inner: &mut Inner, discover: bool) -> Result<()> {
    let result = catch_up(store, inner, discover).await;
    if result.is_err() {
        *inner = Inner::default();
    }
    result
}

/// Reads the log after the last position for every tenant at once, then reads again the rows
/// that changed in loaded tenants. With `discover`, a tenant not loaded yet whose reservations
/// changed is loaded.
async fn catch_up(store: &dyn EventStore, inner: &mut Inner, discover: bool) -> Result<()> {
    let Some(mut after) = inner.after else {
        // First use: everything loaded from now on is at least this recent.
        inner.after = Some(Position { commit: store.last_commit().await?, index: u32::MAX >> 1 });
        return Ok(());
    };
    let mut new_tenants = HashSet::new();
    loop {
        let rows = store.read_after_rows(after, None, CATCH_UP_ROWS).await?;
        let Some(last) = rows.last() else { break };
        after = Position { commit: last.commit, index: last.index };
        for row in &rows {
            let Ok(tenant) = row.tenant.parse::<TenantId>() else { continue };
            match inner.tenants.get_mut(&tenant) {
                Some(view) => {
                    if let Some(id) = row.stream.strip_prefix("node/") {
                        view.dirty_nodes.insert(id.to_owned());
                    } else if let Some(id) = row.stream.strip_prefix("reservation/") {
                        view.dirty_reservations.insert(id.to_owned());
                    }
                }
                None if discover && row.stream.starts_with("reservation/") => {
                    new_tenants.insert(tenant);
                }
                None => {}
            }
        }
        if rows.len() < CATCH_UP_ROWS as usize {
            break;
        }
    }
    inner.after = Some(after);
    for (tenant, view) in inner.tenants.iter_mut() {
        let t = tenant.to_string();
        for id in std::mem::take(&mut view.dirty_nodes) {
            view.held.remove(&id);
            match store.row_get(&t, KIND_NODE, &id).await? {
                Some(row) => view.nodes.insert(id, decode(row.doc)?),
                None => view.nodes.remove(&id),
            };
        }
        for id in std::mem::take(&mut view.dirty_reservations) {
            match store.row_get(&t, KIND_RESERVATION_LIVE, &id).await? {
                Some(row) => view.live.insert(id, decode(row.doc)?),
                None => view.live.remove(&id),
            };
        }
    }
    for tenant in new_tenants {
        let view = load(store, tenant).await?;
        inner.tenants.insert(tenant, view);
    }
    Ok(())
}
