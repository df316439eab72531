//! `capacity.*`: free GPUs per pool, model and product, and whether a reservation would fit.

use bc_core::Result;
use bc_core::id::PoolId;
use bc_projections::decide;
use bc_projections::{KIND_POOL, PoolDoc};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::doc;
use super::paging::LIST_LIMIT_MAX;
use super::pools::pool_doc;
use super::reservations::{AskInput, check_ask};
use super::validate::{PoolIdText, TenantIdText};
use super::views::{CapacityListView, CapacityView, PreviewView};
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
    let items = call
        .state
        .fleet
        .with_tenant(store, tenant, |view| pools.iter().map(|pool| decide::pool_capacity(pool, view)).collect::<Vec<_>>())
        .await?;
    Ok(CapacityListView { items: items.into_iter().map(CapacityView::from).collect() })
}

async fn capacity_preview(call: &Call<'_>, input: AskInput) -> Result<PreviewView> {
    let checked = check_ask(call, input).await?;
    let store = &*call.state.store;
    let preview = call.state.fleet.with_tenant(store, checked.owner, |view| decide::capacity_preview(view, &checked.ask)).await?;
    Ok(preview.into())
}
