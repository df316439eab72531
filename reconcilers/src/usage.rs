//! The `usage` reconciler: closes each tenant's usage windows. Level-triggered: every pass reads
//! each tenant's usage ledger (its `usage_ledger` row and the `usage_open` rows of its
//! reservations, instances and sandboxes, folded from their events and the usage events), the
//! pool and GPU product of each reservation it follows, and the prices (root tenant), and appends what [`decide::usage::usage_close`] says: corrections of closed windows
//! the log has since learnt more about, then the windows that ended (plus a grace) since the
//! last pass.
//!
//! The append is at the usage stream's version the ledger folded, so two processes running it
//! never close one window twice: the second gets a CONFLICT and decides again next pass.

use std::collections::BTreeMap;
use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::id::TenantId;
use bc_core::store::Log;
use bc_core::{ErrorCode, Result};
use bc_projections::decide::usage::{UsageCloseInput, UsageDetail, usage_close};
use bc_projections::usage::{KIND_USAGE_LEDGER, KIND_USAGE_OPEN, KIND_USAGE_PRICE, UsageLedger, UsagePriceDoc};
use bc_projections::{KIND_NODE, KIND_RESERVATION, NodeDoc, ReservationDoc};
use futures::future::BoxFuture;

use crate::driver::{Activation, PassReport, Reconciler};

pub const NAME: &str = "usage";
const ACTOR: &str = "reconciler:usage";
/// How often a pass runs.
pub const TICK_MS_DEFAULT: u64 = 1000;
/// The length of a usage window unless the process says otherwise (`--usage-window`).
pub const WINDOW_MS_DEFAULT: u64 = 3_600_000;
/// The shortest window a process may use (tests use it; a deployment keeps the hour).
pub const WINDOW_MS_MIN: u64 = 1000;
/// The longest window: a day.
pub const WINDOW_MS_MAX: u64 = 86_400_000;
/// How long after its end a window waits before it closes, so what committed around its end is
/// in: a tenth of the window, at most a minute.
pub const GRACE_MS_MAX: u64 = 60_000;
/// Rows read per query.
const ROWS_PER_READ: u32 = 500;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub windows: usize,
    pub corrections: usize,
    pub conflicts: usize,
    pub more: bool,
}

/// The grace of a window of `window_ms`.
pub fn grace_ms(window_ms: u64) -> u64 {
    (window_ms / 10).min(GRACE_MS_MAX)
}

/// Every SKU's prices (root tenant).
async fn prices(log: &Log) -> Result<BTreeMap<String, UsagePriceDoc>> {
    let mut out = BTreeMap::new();
    let root = TenantId::ROOT.to_string();
    let mut after: Option<String> = None;
    loop {
        let rows = log.store.row_list(&root, KIND_USAGE_PRICE, after.as_deref(), ROWS_PER_READ).await?;
        let full = rows.len() == ROWS_PER_READ as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            let doc: UsagePriceDoc =
                serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("price row: {e}")))?;
            out.insert(doc.sku.clone(), doc);
        }
        if !full {
            return Ok(out);
        }
    }
}

/// The pool, GPU product, request seq and project of each reservation the ledger follows.
async fn details(log: &Log, tenant: &str, ledger: &UsageLedger) -> Result<BTreeMap<String, UsageDetail>> {
    let mut out = BTreeMap::new();
    let mut nodes: BTreeMap<String, Option<NodeDoc>> = BTreeMap::new();
    // An instance's or a sandbox's span carries its own pool and shape.
    for t in ledger.tracked.values().filter(|t| t.metered.is_none()) {
        if out.contains_key(&t.reservation_id) {
            continue;
        }
        let Some(row) = log.store.row_get(tenant, KIND_RESERVATION, &t.reservation_id).await? else { continue };
        let rsv: ReservationDoc =
            serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("reservation row: {e}")))?;
        if !nodes.contains_key(&t.node_id) {
            let node = log.store.row_get(tenant, KIND_NODE, &t.node_id).await?;
            let node = node.map(|r| serde_json::from_value::<NodeDoc>(r.doc)).transpose();
            nodes.insert(t.node_id.clone(), node.map_err(|e| bc_core::Error::Internal(format!("node row: {e}")))?);
        }
        let product = nodes[&t.node_id].as_ref().and_then(|n| {
            let first = t.gpu_indexes.first().copied().unwrap_or(0) as usize;
            n.gpus.get(first).map(|g| if g.product.is_empty() { g.model.clone() } else { g.product.clone() })
        });
        let sku = product.unwrap_or_else(|| bc_projections::decide::usage::SKU_UNKNOWN.to_owned());
        let detail = UsageDetail {
            pool_id: rsv.pool_id,
            sku,
            request_seq: rsv.request_seq,
            holder_tenant_id: rsv.holder_tenant_id,
            project_id: rsv.project_id,
        };
        out.insert(t.reservation_id.clone(), detail);
    }
    Ok(out)
}

/// A tenant's ledger: its `usage_ledger` row (the windows closed) with the activations of every
/// `usage_open` row; `None` when no reservation has anything left to count.
async fn ledger(log: &Log, tenant: &str) -> Result<Option<UsageLedger>> {
    let parse = |doc| serde_json::from_value::<UsageLedger>(doc).map_err(|e| bc_core::Error::Internal(format!("usage row: {e}")));
    let mut ledger = UsageLedger::default();
    let mut after: Option<String> = None;
    loop {
        let rows = log.store.row_list(tenant, KIND_USAGE_OPEN, after.as_deref(), ROWS_PER_READ).await?;
        let full = rows.len() == ROWS_PER_READ as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            ledger.tracked.extend(parse(row.doc)?.tracked);
        }
        if !full {
            break;
        }
    }
    if ledger.tracked.is_empty() {
        return Ok(None);
    }
    if let Some(row) = log.store.row_get(tenant, KIND_USAGE_LEDGER, tenant).await? {
        let closed = parse(row.doc)?;
        (ledger.closed_through_ms, ledger.usage_version) = (closed.closed_through_ms, closed.usage_version);
    }
    Ok(Some(ledger))
}

/// One pass over every tenant with a reservation to count.
pub async fn pass(log: &Log, clock: &dyn Clock, window_ms: u64) -> Result<Pass> {
    let mut done = Pass::default();
    let mut price_docs: Option<BTreeMap<String, UsagePriceDoc>> = None;
    for tenant in log.store.tenants().await? {
        let tenant_text = tenant.to_string();
        let Some(ledger) = ledger(log, &tenant_text).await? else { continue };
        let details = details(log, &tenant_text, &ledger).await?;
        if price_docs.is_none() {
            price_docs = Some(prices(log).await?);
        }
        let prices = price_docs.as_ref().expect("read above");
        let now_ms = clock.now_ms();
        let input =
            UsageCloseInput { ledger: &ledger, now_ms, window_ms, grace_ms: grace_ms(window_ms), details: &details, prices };
        let close = usage_close(&input);
        let Some(append) = close.append(&tenant_text, &ledger)? else { continue };
        match log.append(append.into_request(tenant, ACTOR)).await {
            Ok(_) => {
                done.windows += close.windows;
                done.corrections += close.correction_lines;
                done.more |= close.more;
            }
            Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
            Err(e) => {
                // One tenant's failure is its own: the pass goes on.
                tracing::warn!(reconciler = NAME, tenant = %tenant_text, code = %e.code(), error = %e, "append failed");
            }
        }
    }
    Ok(done)
}

impl PassReport for Pass {
    fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![("windows", self.windows as u64), ("corrections", self.corrections as u64), ("conflicts", self.conflicts as u64)]
    }

    fn again(&self) -> bool {
        self.conflicts > 0 || self.more
    }

    fn log(&self, name: &'static str) {
        if self.windows + self.corrections + self.conflicts > 0 {
            tracing::info!(
                reconciler = name,
                windows = self.windows,
                corrections = self.corrections,
                conflicts = self.conflicts,
                "pass"
            );
        }
    }
}

/// The reconciler: [`pass`] every [`TICK_MS_DEFAULT`] with its window length.
pub struct Usage {
    pub log: Arc<Log>,
    pub clock: Arc<dyn Clock>,
    pub window_ms: u64,
}

impl Reconciler for Usage {
    fn name(&self) -> &'static str {
        NAME
    }

    fn activate(&mut self) -> BoxFuture<'_, Activation> {
        Box::pin(async move {
            match pass(&self.log, &*self.clock, self.window_ms).await {
                Ok(p) => {
                    p.log(NAME);
                    Activation { outcome: Ok(p.counts()), again: p.again() }
                }
                Err(e) => Activation::failed(e),
            }
        })
    }
}
