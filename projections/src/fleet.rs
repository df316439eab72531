//! An in-memory view of each tenant's nodes for placement, kept current by reading the log
//! forward from the last position it saw, so a placement does not read every node row.
//!
//! It is only a cache: every placement is still appended with a guard on the node's version, so
//! a stale view costs a CONFLICT, never a double booking. Within one process, a placement marks
//! the GPUs it is about to append as held ([`Fleet::with_pool`]'s closure changes the docs),
//! so concurrent requests in the same process do not pick the same GPUs; if the append then
//! fails, [`Fleet::forget`] makes the next use read that node again.

use std::collections::{HashMap, HashSet};

use bc_core::Result;
use bc_core::event::Position;
use bc_core::id::TenantId;
use bc_core::store::EventStore;

use crate::{KIND_NODE, NodeDoc};

/// Log rows read per query while catching up.
const CATCH_UP_ROWS: u32 = 1000;
/// Node rows read per query on a tenant's first use.
const LOAD_ROWS: u32 = 1000;

#[derive(Default)]
struct TenantNodes {
    /// Every event up to here is reflected in `nodes`.
    after: Position,
    nodes: HashMap<String, NodeDoc>,
    /// Nodes to read again before the next use (a placement on them failed to append).
    stale: HashSet<String>,
}

#[derive(Default)]
pub struct Fleet {
    tenants: tokio::sync::Mutex<HashMap<TenantId, TenantNodes>>,
}

impl Fleet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on the tenant's nodes in `pool`, brought up to date with the log first (in node
    /// id order, so placement is deterministic). `f` may change them: a placer records the
    /// GPUs it is about to append.
    pub async fn with_pool<R>(
        &self,
        store: &dyn EventStore,
        tenant: TenantId,
        pool: &str,
        f: impl FnOnce(&mut [&mut NodeDoc]) -> R,
    ) -> Result<R> {
        let mut tenants = self.tenants.lock().await;
        let entry = match tenants.entry(tenant) {
            std::collections::hash_map::Entry::Occupied(o) => {
                let entry = o.into_mut();
                catch_up(store, tenant, entry).await?;
                entry
            }
            std::collections::hash_map::Entry::Vacant(v) => v.insert(load(store, tenant).await?),
        };
        let mut nodes: Vec<&mut NodeDoc> = entry.nodes.values_mut().filter(|n| n.pool_id == pool).collect();
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(f(&mut nodes))
    }

    /// Reads this node again before its next use.
    pub async fn forget(&self, tenant: TenantId, node_id: &str) {
        if let Some(entry) = self.tenants.lock().await.get_mut(&tenant) {
            entry.stale.insert(node_id.to_owned());
        }
    }
}

async fn load(store: &dyn EventStore, tenant: TenantId) -> Result<TenantNodes> {
    // Events after this point are replayed over what is loaded: reading a node again is harmless.
    let at = store.last_commit().await?;
    let mut entry = TenantNodes { after: Position { commit: at, index: u32::MAX >> 1 }, ..Default::default() };
    let mut cursor: Option<String> = None;
    loop {
        let rows = store.row_list(&tenant.to_string(), KIND_NODE, cursor.as_deref(), LOAD_ROWS).await?;
        let full = rows.len() == LOAD_ROWS as usize;
        cursor = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            let node: NodeDoc =
                serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("node document: {e}")))?;
            entry.nodes.insert(node.node_id.clone(), node);
        }
        if !full {
            return Ok(entry);
        }
    }
}

async fn catch_up(store: &dyn EventStore, tenant: TenantId, entry: &mut TenantNodes) -> Result<()> {
    let mut dirty = std::mem::take(&mut entry.stale);
    loop {
        let rows = store.read_after_rows(entry.after, Some(tenant), CATCH_UP_ROWS).await?;
        let Some(last) = rows.last() else { break };
        entry.after = Position { commit: last.commit, index: last.index };
        for row in &rows {
            if let Some(id) = row.stream.strip_prefix("node/") {
                dirty.insert(id.to_owned());
            }
        }
        if rows.len() < CATCH_UP_ROWS as usize {
            break;
        }
    }
    for id in dirty {
        match store.row_get(&tenant.to_string(), KIND_NODE, &id).await? {
            Some(row) => {
                let node: NodeDoc =
                    serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("node document: {e}")))?;
                entry.nodes.insert(id, node);
            }
            None => {
                entry.nodes.remove(&id);
            }
        }
    }
    Ok(())
}
