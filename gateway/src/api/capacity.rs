//! `capacity.*`: free GPUs per pool, model and product, and whether a reservation would fit.

use std::collections::BTreeMap;

use bc_core::Result;
use bc_core::id::PoolId;
use bc_projections::placement::{self, Ask};
use bc_projections::{KIND_POOL, PoolDoc};
use schemars::JsonSchema;
use serde::Deserialize;

use super::pools::pool_doc;
use super::reservations::{AskInput, check_ask, loads, pool_load};
use super::toolkit::{LIST_LIMIT_MAX, PoolIdText, TenantIdText, doc, parse_id};
use super::views::{CapacityListView, CapacityView, GpuCountView, PreviewView};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:capacity:read");

pub(super) const METHODS: &[Method] = &[
    method!("capacity.get", READ, "free GPUs per pool and per GPU product", CapacityGet => CapacityListView, capacity_get),
    method!("capacity.preview", READ, "would a reservation fit now, and where", AskInput => PreviewView, capacity_preview),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CapacityGet {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// One pool; every live pool when absent.
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
}

async fn capacity_get(call: &Call<'_>, input: CapacityGet) -> Result<CapacityListView> {
    let store = &*call.state.store;
    let tenant = call.tenant(&input.tenant_id).await?;
    let pools: Vec<PoolDoc> = match &input.pool_id {
        Some(p) => {
            let id: PoolId = parse_id("poolId", p)?;
            vec![pool_doc(call, tenant, &id.to_string()).await?]
        }
        None => {
            let rows = store.row_list(&tenant.to_string(), KIND_POOL, None, LIST_LIMIT_MAX).await?;
            rows.into_iter().map(doc).collect::<Result<Vec<PoolDoc>>>()?.into_iter().filter(|p| !p.archived).collect()
        }
    };
    let loads = loads(call, tenant).await?;
    let mut items = Vec::new();
    for pool in pools {
        let (node_count, (by_model, by_product), [total, free, held, unavailable]) = call
            .state
            .fleet
            .with_pool(store, tenant, &pool.pool_id, |nodes| {
                let mut by_product: BTreeMap<String, (u32, u32)> = BTreeMap::new();
                let mut by_model: BTreeMap<String, (u32, u32)> = BTreeMap::new();
                let mut counts = [0u32; 4];
                for node in nodes.iter() {
                    let usable = node.state == "ready";
                    for (i, gpu) in node.gpus.iter().enumerate() {
                        let held = node.allocations.contains_key(&(i as u32));
                        let free = !held && usable;
                        for (map, key) in [(&mut by_product, &gpu.product), (&mut by_model, &gpu.model)] {
                            let entry = map.entry(key.clone()).or_default();
                            entry.0 += 1;
                            entry.1 += u32::from(free);
                        }
                        counts[0] += 1;
                        if held {
                            counts[2] += 1;
                        } else if usable {
                            counts[1] += 1;
                        } else {
                            counts[3] += 1;
                        }
                    }
                }
                (nodes.len() as u32, (by_model, by_product), counts)
            })
            .await?;
        let load = loads.get(&pool.pool_id);
        items.push(CapacityView {
            pool_id: pool.pool_id,
            name: pool.name,
            nodes: node_count,
            gpus: total,
            free,
            reserved: held,
            unavailable,
            queued: load.map(|l| l.queued.len() as u32).unwrap_or(0),
            queued_gpus: load.map(|l| l.queued_gpus).unwrap_or(0),
            by_model: by_model
                .into_iter()
                .map(|(m, (gpus, free))| GpuCountView { model: Some(m), product: None, gpus, free })
                .collect(),
            by_product: by_product
                .into_iter()
                .map(|(p, (gpus, free))| GpuCountView { model: None, product: Some(p), gpus, free })
                .collect(),
            max_reservation_s: pool.max_reservation_s,
        });
    }
    Ok(CapacityListView { items })
}

async fn capacity_preview(call: &Call<'_>, input: AskInput) -> Result<PreviewView> {
    let store = &*call.state.store;
    let checked = check_ask(call, input).await?;
    let ahead = pool_load(call, checked.tenant, &checked.pool.pool_id).await?.queued.len() as u32;
    let ask = Ask { gpus: checked.gpus, selector: &checked.selector, nvlink: checked.nvlink, tolerations: &checked.tolerations };
    let (placed, possible) = call
        .state
        .fleet
        .with_pool(store, checked.tenant, &checked.pool.pool_id, |nodes| {
            let possible = nodes.iter().any(|n| placement::could_fit(n, &ask));
            (placement::place(nodes.iter().map(|n| &**n), &ask), possible)
        })
        .await?;
    Ok(PreviewView {
        possible,
        fits: placed.is_some() && ahead == 0,
        fits_ignoring_queue: placed.is_some(),
        queued_ahead: ahead,
        node_id: placed.as_ref().map(|p| p.node_id.clone()),
        gpus: placed.map(|p| p.gpus),
        selector: checked.selector_text,
    })
}
