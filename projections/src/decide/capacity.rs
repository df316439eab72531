//! `capacity.get` and `capacity.preview`: what a pool has and holds, and where an ask would go,
//! from the fleet view.

use std::collections::BTreeMap;

use serde::Serialize;

use super::ReservationAsk;
use crate::fleet::FleetIndex;
use crate::{NodeState, PoolDoc, placement};

/// One pool's GPUs: how many, free (on ready nodes, not held), reserved (held by a
/// reservation), unavailable (on cordoned or draining nodes, not held), and its queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolCapacity {
    pub pool_id: String,
    pub name: String,
    pub nodes: u32,
    pub gpus: u32,
    pub free: u32,
    pub reserved: u32,
    pub unavailable: u32,
    /// Reservations waiting in the pool's queue, and the GPUs they ask for.
    pub queued: u32,
    pub queued_gpus: u32,
    pub by_model: Vec<ModelCapacity>,
    pub by_product: Vec<ProductCapacity>,
    pub max_reservation_s: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelCapacity {
    pub model: String,
    pub gpus: u32,
    pub free: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProductCapacity {
    pub product: String,
    pub gpus: u32,
    pub free: u32,
}

/// `capacity.get` for one pool.
pub fn pool_capacity(pool: &PoolDoc, view: &FleetIndex) -> PoolCapacity {
    // (GPUs, free) by model and by product.
    let mut by_model: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
    let mut by_product: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
    let (mut nodes, mut gpus, mut free, mut reserved, mut unavailable) = (0u32, 0u32, 0u32, 0u32, 0u32);
    for (_, node) in view.ranked(&pool.pool_id, 0) {
        nodes += 1;
        let ready = node.state == NodeState::Ready;
        for (i, gpu) in node.gpus.iter().enumerate() {
            let held = node.allocations.contains_key(&(i as u32));
            let is_free = !held && ready;
            for (map, key) in [(&mut by_product, gpu.product.as_str()), (&mut by_model, gpu.model.as_str())] {
                let entry = map.entry(key).or_default();
                entry.0 += 1;
                entry.1 += u32::from(is_free);
            }
            gpus += 1;
            if held {
                reserved += 1;
            } else if ready {
                free += 1;
            } else {
                unavailable += 1;
            }
        }
    }
    let load = view.pool_load(&pool.pool_id);
    PoolCapacity {
        pool_id: pool.pool_id.clone(),
        name: pool.name.clone(),
        nodes,
        gpus,
        free,
        reserved,
        unavailable,
        queued: load.queued.len() as u32,
        queued_gpus: load.queued_gpus,
        by_model: by_model
            .into_iter()
            .map(|(model, (gpus, free))| ModelCapacity { model: model.to_owned(), gpus, free })
            .collect(),
        by_product: by_product
            .into_iter()
            .map(|(product, (gpus, free))| ProductCapacity { product: product.to_owned(), gpus, free })
            .collect(),
        max_reservation_s: pool.max_reservation_s,
    }
}

/// `capacity.preview`: whether an ask could ever be placed in its pool, whether it would be
/// placed now (nothing queued ahead and a node fits), and where.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CapacityPreview {
    /// Some node of the pool could hold it with every GPU free.
    pub possible: bool,
    pub fits: bool,
    pub fits_ignoring_queue: bool,
    pub queued_ahead: u32,
    pub node_id: Option<String>,
    pub gpus: Option<Vec<u32>>,
    pub selector: String,
}

pub fn capacity_preview(view: &FleetIndex, ask: &ReservationAsk) -> CapacityPreview {
    let pool_id = ask.pool.pool_id.as_str();
    let queued_ahead = view.pool_load(pool_id).queued.len() as u32;
    let placement_ask = ask.placement_ask();
    let possible = view.ranked(pool_id, 0).any(|(_, n)| placement::could_fit(n, &placement_ask));
    let placed = placement::place_ranked(view.ranked(pool_id, placement_ask.gpus), &placement_ask, Default::default());
    CapacityPreview {
        possible,
        fits: placed.is_some() && queued_ahead == 0,
        fits_ignoring_queue: placed.is_some(),
        queued_ahead,
        node_id: placed.as_ref().map(|p| p.node_id.clone()),
        gpus: placed.map(|p| p.gpus),
        selector: ask.selector_text.clone(),
    }
}
