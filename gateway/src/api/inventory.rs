//! `inventory.*`: what a node's agent reported its machine holds (`node.inventory_reported`,
//! journaled at the agent's start and whenever it changes). `get` is the latest report,
//! `history` the node's reports newest first, `diff` what changed between two of them.
//!
//! The reports are read from their own rows (`bc_projections::inventory`), one per event,
//! never by scanning the agent stream. A report is named by its event's `seq` in the tenant's
//! log. They are a node's property, so they are read with `compute:nodes:read`, like
//! `nodes.get` (which shows the latest report too); no new action, so every key that reads
//! nodes reads their inventories.
//!
//! A node registered by hand has no agent and so no inventory: every method answers
//! `INVALID_ARGUMENT` saying so (its GPUs are what `nodes.register` was given, in `nodes.get`).
//! A joined node whose agent has reported nothing yet: `get` and `diff` are `NOT_FOUND`,
//! `history` an empty page.

use bc_core::id::{NodeId, TenantId};
use bc_core::store::Row;
use bc_core::{Error, Result};
use bc_projections::inventory::{
    InventoryReportDoc, KIND_INVENTORY, inventory_diff, inventory_row_id, inventory_row_prefix, inventory_row_seq,
};
use schemars::JsonSchema;
use serde::Deserialize;

use super::call::doc;
use super::nodes::{READ, node_doc};
use super::paging::Page;
use super::validate::{NodeIdText, TenantIdText, string_schema};
use super::views::{InventoryDiffView, InventoryReportView};
use super::{Call, Method, method};

/// Reports one `history` page holds at most, and unless asked otherwise. Lower than
/// `LIST_LIMIT_MAX`: a report of a full node (64 GPUs, its disks) is some kilobytes.
pub const INVENTORY_HISTORY_LIMIT_MAX: u32 = 50;
pub const INVENTORY_HISTORY_LIMIT_DEFAULT: u32 = 10;
const _: () = assert!(INVENTORY_HISTORY_LIMIT_DEFAULT <= INVENTORY_HISTORY_LIMIT_MAX);
const _: () = assert!(INVENTORY_HISTORY_LIMIT_MAX <= super::paging::LIST_LIMIT_MAX);

pub(super) const METHODS: &[Method] = &[
    method!("inventory.get", READ, "a node's latest reported inventory", InventoryGet => InventoryReportView, inventory_get),
    method!(
        "inventory.history",
        READ,
        "a node's reported inventories, newest first, paged by cursor",
        InventoryHistory => Page<InventoryReportView>,
        inventory_history,
    ),
    method!(
        "inventory.diff",
        READ,
        "what changed between two of a node's inventory reports",
        InventoryDiffInput => InventoryDiffView,
        inventory_diff_method,
    ),
];

string_schema!(
    /// A history cursor: the `seq` of the last report of the page before.
    InventoryCursorText,
    schemars::json_schema!({ "type": "string", "pattern": "^[0-9]{1,20}$" })
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InventoryGet {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InventoryHistory {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    /// Reports per page: 1 to 50 (default 10).
    #[schemars(range(min = 1, max = INVENTORY_HISTORY_LIMIT_MAX))]
    limit: Option<u32>,
    #[schemars(with = "Option<InventoryCursorText>")]
    cursor: Option<String>,
}

/// Two reports by their `seq`: `to` defaults to the latest, `from` to the one before `to`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InventoryDiffInput {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NodeIdText")]
    node_id: String,
    #[schemars(range(min = 1))]
    from: Option<u64>,
    #[schemars(range(min = 1))]
    to: Option<u64>,
}

/// The tenant and the node, once it is known to exist and to have an agent.
async fn agent_node(call: &Call<'_>, tenant_id: &Option<String>, node_id: &str) -> Result<(TenantId, String)> {
    let tenant = call.tenant(tenant_id).await?;
    let node: NodeId = super::body::parse_id("nodeId", node_id)?;
    let node = node.to_string();
    if node_doc(call, tenant, &node).await?.agent.is_none() {
        return Err(Error::state(
            format!("node {node} has no agent: it was registered by hand, so it reports no inventory"),
            "its GPUs are the ones it was registered with: better-compute nodes get",
        ));
    }
    Ok((tenant, node))
}

/// Up to `limit` of the node's reports after the row id `after` (newest first).
async fn reports_after(
    call: &Call<'_>,
    tenant: TenantId,
    node: &str,
    after: &str,
    limit: u32,
) -> Result<Vec<InventoryReportDoc>> {
    let rows = call.state.store.row_list(&tenant.to_string(), KIND_INVENTORY, Some(after), limit).await?;
    // The node's rows are one run of ids; the next node's follow it.
    rows.into_iter().take_while(|row| inventory_row_seq(node, &row.key.id).is_some()).map(doc::<InventoryReportDoc>).collect()
}

async fn latest(call: &Call<'_>, tenant: TenantId, node: &str) -> Result<Option<InventoryReportDoc>> {
    Ok(reports_after(call, tenant, node, &inventory_row_prefix(node), 1).await?.pop())
}

async fn report_at(call: &Call<'_>, tenant: TenantId, node: &str, seq: u64) -> Result<InventoryReportDoc> {
    let row: Option<Row> = call.state.store.row_get(&tenant.to_string(), KIND_INVENTORY, &inventory_row_id(node, seq)).await?;
    doc(row.ok_or_else(|| Error::not_found(format!("inventory report seq {seq} of node {node}")))?)
}

async fn inventory_get(call: &Call<'_>, input: InventoryGet) -> Result<InventoryReportView> {
    let (tenant, node) = agent_node(call, &input.tenant_id, &input.node_id).await?;
    let report = latest(call, tenant, &node)
        .await?
        .ok_or_else(|| Error::not_found(format!("inventory of node {node} (none reported yet)")))?;
    Ok(report.into())
}

async fn inventory_history(call: &Call<'_>, input: InventoryHistory) -> Result<Page<InventoryReportView>> {
    let limit = match input.limit {
        None => INVENTORY_HISTORY_LIMIT_DEFAULT,
        Some(n) if (1..=INVENTORY_HISTORY_LIMIT_MAX).contains(&n) => n,
        Some(n) => return Err(Error::invalid(format!("limit {n} is out of range 1 to {INVENTORY_HISTORY_LIMIT_MAX}"))),
    };
    let after_seq = match &input.cursor {
        None => None,
        Some(c) => Some(
            c.parse::<u64>()
                .ok()
                .filter(|_| c.len() <= 20 && c.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| Error::invalid("malformed cursor: it is the seq of a report"))?,
        ),
    };
    let (tenant, node) = agent_node(call, &input.tenant_id, &input.node_id).await?;
    let after = match after_seq {
        Some(seq) => inventory_row_id(&node, seq),
        None => inventory_row_prefix(&node),
    };
    let mut reports = reports_after(call, tenant, &node, &after, limit + 1).await?;
    let more = reports.len() > limit as usize;
    reports.truncate(limit as usize);
    let next_cursor = if more { reports.last().map(|r| r.seq.to_string()) } else { None };
    Ok(Page { items: reports.into_iter().map(Into::into).collect(), next_cursor })
}

async fn inventory_diff_method(call: &Call<'_>, input: InventoryDiffInput) -> Result<InventoryDiffView> {
    let (tenant, node) = agent_node(call, &input.tenant_id, &input.node_id).await?;
    let to = match input.to {
        Some(seq) => report_at(call, tenant, &node, seq).await?,
        None => latest(call, tenant, &node)
            .await?
            .ok_or_else(|| Error::not_found(format!("inventory of node {node} (none reported yet)")))?,
    };
    let from = match input.from {
        Some(seq) => report_at(call, tenant, &node, seq).await?,
        None => reports_after(call, tenant, &node, &inventory_row_id(&node, to.seq), 1)
            .await?
            .pop()
            .ok_or_else(|| Error::not_found(format!("an inventory report of node {node} before seq {} (its first)", to.seq)))?,
    };
    let diff = inventory_diff(&from.inventory, &to.inventory);
    Ok(InventoryDiffView {
        node_id: node,
        from: from.seq,
        to: to.seq,
        from_reported_at_ms: from.reported_at_ms,
        to_reported_at_ms: to.reported_at_ms,
        changed: !diff.is_empty(),
        diff,
    })
}
