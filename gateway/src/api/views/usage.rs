//! `usage.*`'s answers: a usage row (one line of a closed window or of a correction), a group of
//! rows, and a SKU's prices.

use bc_projections::usage::{UsageLine, UsagePriceDoc};
use schemars::JsonSchema;
use serde::Serialize;

use crate::api::validate::{InstanceIdText, PoolIdText, ReservationIdText, SandboxIdText, TenantIdText};

/// One line of a `usage.window_closed` (`kind: usage`) or `usage.correction` (`kind:
/// correction`): what one reservation's activation (GPU time), one instance's span (vCPU or
/// memory time) or one sandbox's life (sandbox, vCPU or memory time) used of one window, with
/// the events it was computed from.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageRowView {
    /// `usage` or `correction`.
    pub kind: String,
    /// The seq of the usage event that holds the line, on the tenant's chain, and the line's
    /// place in it: together, the row's id.
    pub event_seq: u64,
    pub line: u32,
    /// When the usage event was appended.
    pub recorded_at_ms: u64,
    pub window_start_ms: u64,
    pub window_end_ms: u64,
    /// The reservation a GPU row counts, or the one an instance runs on; absent for a sandbox.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ReservationIdText>")]
    pub reservation_id: Option<String>,
    /// The instance a `vcpu` or `memory` row counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<InstanceIdText>")]
    pub instance_id: Option<String>,
    /// The sandbox a `sandbox`, `vcpu` or `memory` row counts.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<SandboxIdText>")]
    pub sandbox_id: Option<String>,
    /// The seq of the event the activation or span starts at.
    pub activation_seq: u64,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    /// The project the reservation (or the instance's reservation) was made in, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<crate::api::validate::ProjectIdText>")]
    pub project_id: Option<String>,
    /// The GPU product; `vCPU`, `Memory-GiB` or `Sandbox` for the other kinds.
    pub sku: String,
    /// `gpu`, `vcpu`, `memory` or `sandbox`.
    pub resource_kind: String,
    /// A `gpu` row's GPUs; 0 for the other kinds.
    pub gpus: u32,
    /// What a row of another kind counts: vCPUs, MiB of memory, or 1 (a sandbox).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub units: Option<u64>,
    pub from_ms: u64,
    pub to_ms: u64,
    /// Unit-milliseconds of its kind (GPU-ms, vCPU-ms, MiB-ms, sandbox-ms); negative for what a
    /// correction takes back.
    pub quantity_ms: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_hour_micros: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// Millionths of `currency`; 0 without a price.
    pub cost_micros: i64,
    /// The seqs of the reservation's (instance's, sandbox's) events the line was computed from.
    pub seqs: Vec<u64>,
    /// The tenant whose chain holds the row (its `eventSeq` and `seqs`) when it is not this
    /// tenant's: a reservation held for this tenant in a pool that tenant offered it.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<TenantIdText>")]
    pub owner_tenant_id: Option<String>,
}

impl UsageRowView {
    pub fn new(kind: &str, event_seq: u64, line_index: u32, recorded_at_ms: u64, line: UsageLine) -> Self {
        Self {
            kind: kind.to_owned(),
            event_seq,
            line: line_index,
            recorded_at_ms,
            window_start_ms: line.window_start_ms,
            window_end_ms: line.window_end_ms,
            reservation_id: (!line.reservation_id.is_empty()).then_some(line.reservation_id),
            instance_id: line.instance_id,
            sandbox_id: line.sandbox_id,
            activation_seq: line.activation_seq,
            pool_id: line.pool_id,
            project_id: line.project_id,
            sku: line.sku,
            resource_kind: line.resource_kind,
            gpus: line.gpus,
            units: line.units,
            from_ms: line.from_ms,
            to_ms: line.to_ms,
            quantity_ms: line.quantity_ms,
            gpu_hour_micros: line.gpu_hour_micros,
            currency: line.currency,
            cost_micros: line.cost_micros,
            seqs: line.seqs,
            owner_tenant_id: None,
        }
    }
}

/// `usage.list` with `groupBy`: the rows of the range summed by the keys asked for (a key not
/// asked for is absent), and always by resource kind (a sum never adds GPU-ms to vCPU-ms).
#[derive(Serialize, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct UsageGroupView {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub window_start_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sku: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    /// `gpu`, `vcpu`, `memory` or `sandbox`: every group is of one kind.
    pub resource_kind: String,
    /// Unit-milliseconds of the kind, corrections included.
    pub quantity_ms: i64,
    /// Per currency: a group of rows priced in several currencies lists each.
    pub costs: Vec<UsageCostView>,
    /// Rows summed (corrections included).
    pub rows: u64,
}

#[derive(Serialize, JsonSchema, Clone, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct UsageCostView {
    /// Empty for rows without a price.
    pub currency: String,
    pub cost_micros: i64,
}

/// `usage.list`: rows (without `groupBy`, paged) or groups (with it, the whole range).
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageListView {
    pub items: Vec<UsageRowView>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<UsageGroupView>,
    /// Set while rows remain: the `cursor` of the next page.
    pub next_cursor: Option<String>,
}

/// One price period of a SKU.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsagePricePeriodView {
    pub from_ms: u64,
    /// Until the next period's start; absent for the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until_ms: Option<u64>,
    pub currency: String,
    pub gpu_hour_micros: u64,
    /// The seq of its `usage.price_set` (root tenant).
    pub seq: u64,
}

/// A SKU's prices.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsagePriceView {
    pub sku: String,
    pub periods: Vec<UsagePricePeriodView>,
    pub version: u64,
}

impl From<UsagePriceDoc> for UsagePriceView {
    fn from(doc: UsagePriceDoc) -> Self {
        let starts: Vec<u64> = doc.periods.iter().map(|p| p.from_ms).collect();
        let periods = doc
            .periods
            .into_iter()
            .enumerate()
            .map(|(i, p)| UsagePricePeriodView {
                from_ms: p.from_ms,
                until_ms: starts.get(i + 1).copied(),
                currency: p.currency,
                gpu_hour_micros: p.gpu_hour_micros,
                seq: p.seq,
            })
            .collect();
        Self { sku: doc.sku, periods, version: doc.version }
    }
}
