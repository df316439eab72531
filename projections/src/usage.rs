//! Usage (`usage/<tenant>`): the GPU time each reservation held, the vCPU and memory time each
//! instance ran with, and the time each sandbox lived (with its vCPUs and memory), closed into
//! windows; and the prices (`usage_price/<sku>`, on the root tenant's chain) that turn it into
//! cost.
//!
//! Read models, all pure folds of the log:
//! - the **ledger** follows every activation of a reservation from `reservation.activated` to its
//!   end (`released`/`expired`, capped at its `endsAtMs`; `requeued`/`failed` take the activation
//!   back: the hold never held), and how far each one is already counted
//!   ([`Tracked::counted_ms`]), from the `usage.window_closed` and `usage.correction` events the
//!   `usage` reconciler appends. It is stored as one `usage_ledger/<tenant>` row (the windows
//!   closed) and one `usage_open/<reservation>` row per reservation with an activation still to
//!   count, removed once it has ended and is counted exactly to its end;
//! - the same ledger follows each instance's **spans**: from the request that makes it run
//!   (`instance.created` or a request with `desired: running`: `start_requested`, and
//!   `resize_requested` of a running instance, which ends the span before it and starts one at
//!   the new shape) to the one that stops it (`stop_requested`, `delete_requested`), or
//!   `instance.failed`, `instance.deleted`; each span at the vCPUs and memory the events say
//!   (`instance.created`'s shape, or the latest `resize_requested`'s). Its `usage_open/<instance>`
//!   row also holds the instance's [`Meter`] (its shape, pool, node) until it is deleted;
//! - and each sandbox's **life**: from `sandbox.created` (a cold one) or `sandbox.claimed` (a warm
//!   one: the warm pool's wait counts nothing) to `sandbox.delete_requested` or
//!   `sandbox.apply_failed`, never past its end (`endsAtMs`, moved by `sandbox.extended`), as a
//!   reservation's; at its template's flavor's vCPUs and memory, which `sandbox.created` carries;
//! - the **prices** (`usage_price/<sku>`): per SKU, the periods a price per unit-hour (GPU-,
//!   vCPU-, GiB-, sandbox-hour) holds from.
//!
//! What a window counts is decided in [`crate::decide::usage`]; this module holds the payloads,
//! the ledger and its fold. Invariant: what the windows and corrections of a tenant recorded for
//! an activation is exactly `[start_ms, counted_ms)`, split at the window edges.

use std::collections::BTreeMap;

use bc_core::event::{Envelope, StoredEvent};
use bc_core::store::RowKey;
use bc_core::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::reservation::{
    RESERVATION_ACTIVATED, RESERVATION_EXPIRED, RESERVATION_EXTENDED, RESERVATION_FAILED, RESERVATION_RELEASED,
    RESERVATION_REQUEUED, ReservationActivated, ReservationExtended,
};
use crate::{corrupt, from_doc, payload, to_doc};

/// A window of a tenant's usage closed: what each activation used in it.
pub const USAGE_WINDOW_CLOSED: &str = "usage.window_closed";
/// A closed window adjusted by what the log learnt after it closed (a late end, a late start):
/// lines that add to (or, negative, take back from) the window, which is never rewritten.
pub const USAGE_CORRECTION: &str = "usage.correction";
/// A price per unit-hour (GPU-, vCPU-, GiB-, sandbox-hour) for a SKU from a time on (root tenant, `usage_price/<sku>`).
pub const USAGE_PRICE_SET: &str = "usage.price_set";
/// The first word of the usage events' types.
pub const USAGE: &str = "usage";
/// The tenant's ledger row (id: the tenant id): the windows closed, and the usage stream's
/// version.
pub const KIND_USAGE_LEDGER: &str = "usage_ledger";
/// A reservation's activations still to count (id: the reservation id); removed once each is
/// settled, so the rows of a tenant are its reservations that may still change its usage.
pub const KIND_USAGE_OPEN: &str = "usage_open";
/// A SKU's price periods (root tenant; id: the SKU).
pub const KIND_USAGE_PRICE: &str = "usage_price";
/// The stream of a tenant's usage events.
pub const KIND_USAGE: &str = "usage";
/// The unit a line's quantity is counted in: GPU-milliseconds, so a split at a window edge is
/// exact (the log's times are milliseconds).
pub const GPU_MS_PER_GPU_HOUR: i64 = 3_600_000;
/// Most lines one usage event carries; a window with more is closed by several events.
pub const USAGE_LINES_PER_EVENT_MAX: usize = 64;
/// Most price periods one SKU keeps.
pub const PRICE_PERIODS_MAX: usize = 256;
/// The resource kind of a reservation's line.
pub const RESOURCE_GPU: &str = "gpu";
/// The resource kind of an instance's or a sandbox's vCPU line: vCPU-milliseconds.
pub const RESOURCE_VCPU: &str = "vcpu";
/// The resource kind of an instance's or a sandbox's memory line: MiB-milliseconds (priced and
/// exported per GiB).
pub const RESOURCE_MEMORY: &str = "memory";
/// The resource kind of a sandbox's own line: sandbox-milliseconds (one unit).
pub const RESOURCE_SANDBOX: &str = "sandbox";
/// The SKU of vCPU lines, instances' and sandboxes' alike (prices per vCPU-hour).
pub const SKU_VCPU: &str = "vCPU";
/// The SKU of memory lines (prices per GiB-hour).
pub const SKU_MEMORY: &str = "Memory-GiB";
/// The SKU of a sandbox's own line (prices per sandbox-hour).
pub const SKU_SANDBOX: &str = "Sandbox";
/// MiB in a GiB: a memory line counts MiB-milliseconds, priced per GiB-hour.
pub const MIB_PER_GIB: i64 = 1024;
/// An end that is never reached: an instance's span has none.
pub const NO_END_MS: u64 = u64::MAX;

/// The instance event types the ledger folds (the node's reports change nothing it counts).
pub const LEDGER_INSTANCE_TYPES: &[&str] = &[
    crate::instance::INSTANCE_CREATED,
    crate::instance::INSTANCE_START_REQUESTED,
    crate::instance::INSTANCE_STOP_REQUESTED,
    crate::instance::INSTANCE_RESIZE_REQUESTED,
    crate::instance::INSTANCE_DELETE_REQUESTED,
    crate::instance::INSTANCE_FAILED,
    crate::instance::INSTANCE_DELETED,
];

/// The sandbox event types the ledger folds.
pub const LEDGER_SANDBOX_TYPES: &[&str] = &[
    crate::sandbox::SANDBOX_CREATED,
    crate::sandbox::SANDBOX_CLAIMED,
    crate::sandbox::SANDBOX_EXTENDED,
    crate::sandbox::SANDBOX_DELETE_REQUESTED,
    crate::sandbox::SANDBOX_APPLY_FAILED,
];

/// The reservation event types the ledger folds.
pub const LEDGER_RESERVATION_TYPES: &[&str] = &[
    RESERVATION_ACTIVATED,
    RESERVATION_EXTENDED,
    RESERVATION_RELEASED,
    RESERVATION_EXPIRED,
    RESERVATION_REQUEUED,
    RESERVATION_FAILED,
];

/// One activation's use of one window (or a correction of it).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageLine {
    pub window_start_ms: u64,
    pub window_end_ms: u64,
    /// The reservation a GPU line counts, or the one an instance runs on; empty for a sandbox.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reservation_id: String,
    /// The instance a `vcpu` or `memory` line counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// The sandbox a `sandbox`, `vcpu` or `memory` line counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// The seq of the `reservation.activated` this line counts (a reservation requeued and
    /// placed again has several); for an instance or a sandbox, of the event its span starts at.
    pub activation_seq: u64,
    pub pool_id: String,
    /// The project (`proj_…`) the reservation was made in, the instance (its reservation's), or
    /// the sandbox (its create's or its claim's); absent when none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    /// The GPU product (`H100-SXM5-80GB`), the SKU prices are set for; [`SKU_VCPU`],
    /// [`SKU_MEMORY`], [`SKU_SANDBOX`] for the other kinds.
    pub sku: String,
    /// [`RESOURCE_GPU`], [`RESOURCE_VCPU`], [`RESOURCE_MEMORY`] or [`RESOURCE_SANDBOX`].
    pub resource_kind: String,
    /// A GPU line's GPUs; 0 for the other kinds, which say `units`.
    pub gpus: u32,
    /// What a line of another kind counts of it: vCPUs, MiB of memory, or 1 (a sandbox).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub units: Option<u64>,
    /// The span inside the window this line counts (or, when `quantityMs` is negative, takes
    /// back).
    pub from_ms: u64,
    pub to_ms: u64,
    /// `gpus × (toMs − fromMs)` GPU-milliseconds (`units ×` for the other kinds: vCPU-ms,
    /// MiB-ms, sandbox-ms), negative for what a correction takes back.
    pub quantity_ms: i64,
    /// The price per unit-hour of the SKU (GPU-hour, vCPU-hour, GiB-hour, sandbox-hour), in
    /// millionths of `currency`, that held at the window's start when the line was written;
    /// absent without a price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_hour_micros: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// `quantityMs × gpuHourMicros / 3,600,000` (and `/ 1024` for memory), rounded to the
    /// nearest millionth; 0 without a price. Written once: a later price never changes it.
    pub cost_micros: i64,
    /// The tenant a GPU line's reservation is held for, in a pool its owner (this chain's
    /// tenant) offered to it (`reservation.held_for`): the usage is that tenant's, not the
    /// owner's, though the line and the events it was computed from are on the owner's chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_tenant_id: Option<String>,
    /// The tenant chain's seqs of the events the line was computed from: the request, the
    /// activation, the latest extension and the end (an instance: its creation, the event that
    /// gave its shape, the span's start and its end; a sandbox: its creation, its claim, its
    /// latest extension and its end).
    pub seqs: Vec<u64>,
}

impl UsageLine {
    /// The id of what it counts: its instance, its sandbox, or its reservation.
    pub fn subject_id(&self) -> &str {
        self.instance_id.as_deref().or(self.sandbox_id.as_deref()).unwrap_or(&self.reservation_id)
    }

    /// Whether the line is `tenant`'s usage, read on `chain`'s usage stream: a line of the
    /// chain's own is the chain's, unless held for another tenant; a line on another chain is
    /// `tenant`'s only when held for it.
    pub fn is_usage_of(&self, tenant: &str, chain: &str) -> bool {
        match self.holder_tenant_id.as_deref() {
            Some(holder) => holder == tenant,
            None => chain == tenant,
        }
    }

    /// What it counts of its kind: its GPUs, or its `units`.
    pub fn line_units(&self) -> u64 {
        if self.resource_kind == RESOURCE_GPU { u64::from(self.gpus) } else { self.units.unwrap_or(0) }
    }
}

/// `usage.window_closed`: the window `[windowStartMs, windowEndMs)` of the tenant is closed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageWindowClosed {
    pub window_start_ms: u64,
    pub window_end_ms: u64,
    pub lines: Vec<UsageLine>,
}

/// `usage.correction`: lines for windows already closed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageCorrection {
    pub lines: Vec<UsageLine>,
}

/// `usage.price_set`: from `fromMs` on (until the SKU's next period), a GPU-hour of `sku` costs
/// `gpuHourMicros` millionths of `currency`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsagePriceSet {
    pub sku: String,
    pub from_ms: u64,
    pub currency: String,
    pub gpu_hour_micros: u64,
}

/// One price period of a SKU.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PricePeriod {
    pub from_ms: u64,
    pub currency: String,
    pub gpu_hour_micros: u64,
    /// The seq of the `usage.price_set` that set it.
    pub seq: u64,
}

/// A SKU's prices, by period.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct UsagePriceDoc {
    pub sku: String,
    /// Ordered by `fromMs`, one per start.
    pub periods: Vec<PricePeriod>,
    pub version: u64,
}

impl UsagePriceDoc {
    /// The period that holds at `at_ms`: the latest that starts at or before it.
    pub fn at(&self, at_ms: u64) -> Option<&PricePeriod> {
        self.periods.iter().rev().find(|p| p.from_ms <= at_ms)
    }
}

/// What metered an instance or a sandbox is: an instance, or a sandbox.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MeterKind {
    Instance,
    Sandbox,
}

/// The vCPUs and memory an instance or a sandbox is counted at, as its events say.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct MeterShape {
    pub flavor_id: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
}

/// An instance or a sandbox the ledger follows between its spans: what a new span counts.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Meter {
    pub kind: MeterKind,
    pub id: String,
    pub pool_id: String,
    pub node_id: String,
    /// An instance's reservation; empty for a sandbox.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reservation_id: String,
    /// An instance's project (`instance.created`'s, its reservation's), or a sandbox's
    /// (`sandbox.created`'s, or its `sandbox.claimed`'s), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    pub shape: MeterShape,
    /// The seq of its `instance.created` / `sandbox.created`.
    pub created_seq: u64,
    /// The seq of the event that gave its shape (its creation, or its latest resize).
    pub shape_seq: u64,
}

/// What a span of an instance or a sandbox counts: whose it is, and at what shape.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Metered {
    pub kind: MeterKind,
    pub id: String,
    pub pool_id: String,
    /// Its meter's project, which its lines name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    pub shape: MeterShape,
}

/// One activation of a reservation the ledger follows, or one span of an instance or a sandbox
/// (`metered`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Tracked {
    /// The reservation; an instance's span: the reservation it runs on; a sandbox's: empty.
    pub reservation_id: String,
    pub activation_seq: u64,
    pub node_id: String,
    /// GPU indexes on the node.
    pub gpu_indexes: Vec<u32>,
    pub start_ms: u64,
    pub ends_at_ms: u64,
    /// When it stopped counting, once it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_ms: Option<u64>,
    /// What windows and corrections recorded: `[start_ms, counted_ms)`.
    pub counted_ms: u64,
    /// The activation's seq, the latest extension's and the end's.
    pub seqs: Vec<u64>,
    /// Set for an instance's or a sandbox's span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metered: Option<Metered>,
}

impl Tracked {
    pub fn gpus(&self) -> u32 {
        if self.metered.is_some() { 0 } else { self.gpu_indexes.len() as u32 }
    }

    /// The id it is keyed by: its instance, its sandbox, or its reservation.
    pub fn subject_id(&self) -> &str {
        self.metered.as_ref().map_or(&self.reservation_id, |m| &m.id)
    }

    /// What it counts, per resource kind: `(kind, units)`, in the order its lines are written.
    pub fn meters(&self) -> Vec<(&'static str, u64)> {
        match &self.metered {
            None => vec![(RESOURCE_GPU, u64::from(self.gpus()))],
            Some(m) => {
                let shape = [(RESOURCE_VCPU, u64::from(m.shape.vcpus)), (RESOURCE_MEMORY, m.shape.memory_mib)];
                match m.kind {
                    MeterKind::Instance => shape.to_vec(),
                    MeterKind::Sandbox => [(RESOURCE_SANDBOX, 1)].into_iter().chain(shape).collect(),
                }
            }
        }
    }

    /// The units it counts of `resource_kind`; `None` when it counts none of that kind.
    pub fn units_of(&self, resource_kind: &str) -> Option<u64> {
        self.meters().into_iter().find(|(k, _)| *k == resource_kind).map(|(_, u)| u)
    }

    /// Ended and recorded exactly to its end: nothing about it can change.
    fn settled(&self) -> bool {
        self.end_ms == Some(self.counted_ms)
    }
}

/// A tenant's ledger: what is closed, and the activations still to count. Stored split: the
/// tenant's `usage_ledger` row holds the closed windows and the version (no `tracked`), and each
/// reservation's `usage_open` row its own `tracked`, so a reservation event rewrites only its
/// own row; the usage reconciler reads them back into one.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct UsageLedger {
    /// The end of the last window closed; every window before it is closed (those no event names
    /// had nothing to count). 0: none yet.
    #[serde(default)]
    pub closed_through_ms: u64,
    /// By [`tracked_key`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tracked: BTreeMap<String, Tracked>,
    /// The instances and sandboxes followed, by id: what their next span counts. A
    /// `usage_open` row holds its own only.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub meters: BTreeMap<String, Meter>,
    /// The version of the tenant's `usage/<tenant>` stream this ledger has folded: the usage
    /// reconciler appends at it, so two processes never close one window twice.
    #[serde(default)]
    pub usage_version: u64,
}

/// The ledger's key of an activation: the reservation and the activation's seq.
pub fn tracked_key(reservation_id: &str, activation_seq: u64) -> String {
    format!("{reservation_id}@{activation_seq:020}")
}

impl UsageLedger {
    /// `reservation.activated` at `at_ms` (seq `seq`).
    pub fn activated(&mut self, reservation_id: &str, seq: u64, at_ms: u64, p: &ReservationActivated) {
        let tracked = Tracked {
            reservation_id: reservation_id.to_owned(),
            activation_seq: seq,
            node_id: p.node_id.clone(),
            gpu_indexes: p.gpus.clone(),
            start_ms: at_ms,
            ends_at_ms: p.ends_at_ms.max(at_ms),
            end_ms: None,
            counted_ms: at_ms,
            seqs: vec![seq],
            metered: None,
        };
        self.tracked.insert(tracked_key(reservation_id, seq), tracked);
    }

    fn open_mut(&mut self, reservation_id: &str) -> Option<&mut Tracked> {
        self.tracked.values_mut().rev().find(|t| t.metered.is_none() && t.reservation_id == reservation_id && t.end_ms.is_none())
    }

    fn metered_open_mut(&mut self, id: &str) -> Option<&mut Tracked> {
        self.tracked.values_mut().rev().find(|t| t.metered.as_ref().is_some_and(|m| m.id == id) && t.end_ms.is_none())
    }

    /// Starts a span of the instance or sandbox `id` at `at_ms` (seq `seq`), at its meter's shape,
    /// until `ends_at_ms` at the latest.
    fn start_span(&mut self, id: &str, seq: u64, at_ms: u64, ends_at_ms: u64) {
        let Some(meter) = self.meters.get(id) else { return };
        let mut seqs = vec![meter.created_seq, meter.shape_seq, seq];
        seqs.sort_unstable();
        seqs.dedup();
        let tracked = Tracked {
            reservation_id: meter.reservation_id.clone(),
            activation_seq: seq,
            node_id: meter.node_id.clone(),
            gpu_indexes: Vec::new(),
            start_ms: at_ms,
            ends_at_ms: ends_at_ms.max(at_ms),
            end_ms: None,
            counted_ms: at_ms,
            seqs,
            metered: Some(Metered {
                kind: meter.kind,
                id: id.to_owned(),
                pool_id: meter.pool_id.clone(),
                project_id: meter.project_id.clone(),
                shape: meter.shape.clone(),
            }),
        };
        self.tracked.insert(tracked_key(id, seq), tracked);
    }

    /// Ends the open span of `id`, if any, at `at_ms` (never past its `endsAtMs`).
    fn end_span(&mut self, id: &str, seq: u64, at_ms: u64) {
        if let Some(t) = self.metered_open_mut(id) {
            t.end_ms = Some(at_ms.min(t.ends_at_ms).max(t.start_ms));
            t.seqs.push(seq);
        }
        self.prune();
    }

    /// `instance.created`: its meter, and a span when it is made running.
    pub fn instance_created(&mut self, id: &str, seq: u64, at_ms: u64, meter: Meter, running: bool) {
        debug_assert_eq!(meter.kind, MeterKind::Instance);
        self.meters.insert(id.to_owned(), meter);
        if running {
            self.start_span(id, seq, at_ms, NO_END_MS);
        }
    }

    /// A request on an instance (`start`, `stop`, `resize`, `delete`): the span open ends at it,
    /// and, when the instance is to run, one starts at it, at the new shape of a resize.
    pub fn instance_requested(&mut self, id: &str, seq: u64, at_ms: u64, running: bool, shape: Option<MeterShape>) {
        let Some(meter) = self.meters.get_mut(id) else { return };
        if let Some(shape) = shape {
            meter.shape = shape;
            meter.shape_seq = seq;
        }
        self.end_span(id, seq, at_ms);
        if running {
            self.start_span(id, seq, at_ms, NO_END_MS);
        }
    }

    /// `instance.failed` (`gone: false`), `instance.deleted` (`gone: true`): the open span ends;
    /// a deleted instance's meter goes.
    pub fn instance_ended(&mut self, id: &str, seq: u64, at_ms: u64, gone: bool) {
        self.end_span(id, seq, at_ms);
        if gone {
            self.meters.remove(id);
        }
    }

    /// `sandbox.created`: its meter, and its life's span when it is cold (a warm one starts at its
    /// claim).
    pub fn sandbox_created(&mut self, id: &str, seq: u64, at_ms: u64, meter: Meter, ends_at_ms: Option<u64>) {
        debug_assert_eq!(meter.kind, MeterKind::Sandbox);
        self.meters.insert(id.to_owned(), meter);
        if let Some(ends_at) = ends_at_ms {
            self.start_span(id, seq, at_ms, ends_at);
        }
    }

    /// `sandbox.claimed`: a warm sandbox's life starts, until `ends_at_ms`.
    pub fn sandbox_claimed(&mut self, id: &str, seq: u64, at_ms: u64, ends_at_ms: u64, project_id: Option<String>) {
        if self.metered_open_mut(id).is_none() {
            // The claim names the project its span is made in (the claim's seq is among the
            // span's, so a recount finds it).
            if let Some(meter) = self.meters.get_mut(id) {
                meter.project_id = project_id;
            }
            self.start_span(id, seq, at_ms, ends_at_ms);
        }
    }

    /// `sandbox.extended` to `ends_at_ms`: only the latest extension is named, as a reservation's.
    pub fn sandbox_extended(&mut self, id: &str, seq: u64, ends_at_ms: u64) {
        if let Some(t) = self.metered_open_mut(id) {
            t.ends_at_ms = ends_at_ms.max(t.start_ms);
            let start = t.activation_seq;
            t.seqs.retain(|s| *s <= start);
            t.seqs.push(seq);
        }
    }

    /// `sandbox.delete_requested` (`gone: true`) or `sandbox.apply_failed`: its life ends (never
    /// past its end); a deleted sandbox's meter goes.
    pub fn sandbox_ended(&mut self, id: &str, seq: u64, at_ms: u64, gone: bool) {
        self.end_span(id, seq, at_ms);
        if gone {
            self.meters.remove(id);
        }
    }

    /// `reservation.extended` to `ends_at_ms`.
    pub fn extended(&mut self, reservation_id: &str, seq: u64, ends_at_ms: u64) {
        if let Some(t) = self.open_mut(reservation_id) {
            t.ends_at_ms = ends_at_ms.max(t.start_ms);
            // Only the latest extension says when it ends: its seq replaces an earlier one's,
            // so a line names at most the activation, one extension and the end.
            t.seqs.truncate(1);
            t.seqs.push(seq);
        }
    }

    /// The activation's end: `released` and `expired` at `at_ms`, never past its `endsAtMs`;
    /// `requeued` and `failed` (`voided`) take it back whole: its hold never held.
    pub fn ended(&mut self, reservation_id: &str, seq: u64, at_ms: u64, voided: bool) {
        if let Some(t) = self.open_mut(reservation_id) {
            let end = if voided { t.start_ms } else { at_ms.min(t.ends_at_ms).max(t.start_ms) };
            t.end_ms = Some(end);
            t.seqs.push(seq);
        }
        self.prune();
    }

    /// A window closed (`window_end_ms`) or a correction (`None`): each line moves its
    /// activation's `counted_ms` (a line taking back moves it down to its `fromMs`).
    pub fn recorded(&mut self, window_end_ms: Option<u64>, lines: &[UsageLine]) {
        if let Some(end) = window_end_ms {
            self.closed_through_ms = self.closed_through_ms.max(end);
        }
        for line in lines {
            if let Some(t) = self.tracked.get_mut(&tracked_key(line.subject_id(), line.activation_seq)) {
                t.counted_ms = if line.quantity_ms < 0 { t.counted_ms.min(line.from_ms) } else { t.counted_ms.max(line.to_ms) };
            }
        }
        self.prune();
    }

    fn prune(&mut self) {
        self.tracked.retain(|_, t| !t.settled());
    }
}

/// The usage rows an event changes: a reservation's, an instance's or a sandbox's `usage_open`
/// row for its starts and ends; for a usage event, the tenant's `usage_ledger` row and the
/// `usage_open` row of each reservation, instance or sandbox its lines name.
pub(crate) fn touches(event: &StoredEvent, out: &mut Vec<RowKey>) {
    let env = &event.envelope;
    let t = env.event_type.as_str();
    let tenant = env.tenant.to_string();
    let row = |kind: &str, id: &str| RowKey { tenant: tenant.clone(), kind: kind.to_owned(), id: id.to_owned() };
    if LEDGER_RESERVATION_TYPES.contains(&t) || LEDGER_INSTANCE_TYPES.contains(&t) || LEDGER_SANDBOX_TYPES.contains(&t) {
        out.push(row(KIND_USAGE_OPEN, crate::stream_id_of(&env.stream)));
    } else if t == USAGE_WINDOW_CLOSED || t == USAGE_CORRECTION {
        out.push(row(KIND_USAGE_LEDGER, &tenant));
        let payload = bc_core::canonical::to_json(&env.payload);
        let mut named: Vec<&str> = payload
            .get("lines")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|line| {
                ["instanceId", "sandboxId", "reservationId"].iter().find_map(|k| line.get(*k).and_then(Value::as_str))
            })
            .collect();
        named.sort_unstable();
        named.dedup();
        out.extend(named.into_iter().map(|id| row(KIND_USAGE_OPEN, id)));
    }
}

fn ledger_of(current: Option<Value>) -> Result<UsageLedger> {
    match current {
        Some(doc) => serde_json::from_value(doc).map_err(|e| Error::Internal(format!("usage ledger: {e}"))),
        None => Ok(UsageLedger::default()),
    }
}

/// The lines of a usage event, checked; the window it closes, for `usage.window_closed`.
fn usage_lines(event: &StoredEvent) -> Result<(Option<u64>, Vec<UsageLine>)> {
    if event.envelope.event_type == USAGE_CORRECTION {
        return Ok((None, payload::<UsageCorrection>(event)?.lines));
    }
    let p: UsageWindowClosed = payload(event)?;
    if p.window_end_ms <= p.window_start_ms {
        return Err(corrupt(event, "a usage window that ends before it starts".into()));
    }
    Ok((Some(p.window_end_ms), p.lines))
}

/// Folds a usage event into the tenant's `usage_ledger` row: the windows closed, and the usage
/// stream's version.
pub(crate) fn apply_ledger(current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let mut ledger = ledger_of(current)?;
    if env.event_type == USAGE_WINDOW_CLOSED || env.event_type == USAGE_CORRECTION {
        let (window_end_ms, _) = usage_lines(event)?;
        ledger.usage_version = env.version;
        ledger.recorded(window_end_ms, &[]);
    }
    to_doc(&ledger)
}

/// Folds one of a reservation's events into `open` (its activations still to count): an
/// activation, an extension, an end; other types change nothing. The `usage_open` row folds
/// with it, and so does the offline check of a usage row (`decide::usage::recount_activation`,
/// `usage verify`), so the two can never count differently. Errs when the payload does not
/// parse.
pub fn fold_reservation_event(open: &mut UsageLedger, reservation_id: &str, env: &Envelope) -> std::result::Result<(), String> {
    fn parse<T: for<'de> Deserialize<'de>>(env: &Envelope) -> std::result::Result<T, String> {
        serde_json::from_value(bc_core::canonical::to_json(&env.payload))
            .map_err(|e| format!("{} payload does not parse: {e}", env.event_type))
    }
    match env.event_type.as_str() {
        RESERVATION_ACTIVATED => open.activated(reservation_id, env.seq, env.at_ms, &parse(env)?),
        RESERVATION_EXTENDED => {
            let p: ReservationExtended = parse(env)?;
            open.extended(reservation_id, env.seq, p.ends_at_ms);
        }
        RESERVATION_RELEASED | RESERVATION_EXPIRED => open.ended(reservation_id, env.seq, env.at_ms, false),
        RESERVATION_REQUEUED | RESERVATION_FAILED => open.ended(reservation_id, env.seq, env.at_ms, true),
        _ => {}
    }
    Ok(())
}

fn parse_env<T: for<'de> Deserialize<'de>>(env: &Envelope) -> std::result::Result<T, String> {
    serde_json::from_value(bc_core::canonical::to_json(&env.payload))
        .map_err(|e| format!("{} payload does not parse: {e}", env.event_type))
}

/// Folds one of an instance's events into `open`: its creation, the requests that start, stop
/// or resize it, its failure and its deletion; other types change nothing. The `usage_open` row
/// and the offline check of a row (`usage verify`) both fold with it.
pub fn fold_instance_event(open: &mut UsageLedger, instance_id: &str, env: &Envelope) -> std::result::Result<(), String> {
    use crate::instance::*;
    let shape_of = |s: InstanceShape| MeterShape { flavor_id: s.flavor_id, vcpus: s.vcpus, memory_mib: s.memory_mib };
    match env.event_type.as_str() {
        INSTANCE_CREATED => {
            let p: InstanceCreated = parse_env(env)?;
            let meter = Meter {
                kind: MeterKind::Instance,
                id: instance_id.to_owned(),
                pool_id: p.pool_id,
                node_id: p.node_id,
                reservation_id: p.reservation_id,
                project_id: p.project_id,
                shape: shape_of(p.shape),
                created_seq: env.seq,
                shape_seq: env.seq,
            };
            open.instance_created(instance_id, env.seq, env.at_ms, meter, p.desired == DesiredState::Running);
        }
        INSTANCE_START_REQUESTED | INSTANCE_STOP_REQUESTED | INSTANCE_RESIZE_REQUESTED | INSTANCE_DELETE_REQUESTED => {
            let p: InstanceRequested = parse_env(env)?;
            open.instance_requested(instance_id, env.seq, env.at_ms, p.desired == DesiredState::Running, p.shape.map(shape_of));
        }
        INSTANCE_FAILED => open.instance_ended(instance_id, env.seq, env.at_ms, false),
        INSTANCE_DELETED => open.instance_ended(instance_id, env.seq, env.at_ms, true),
        _ => {}
    }
    Ok(())
}

/// Folds one of a sandbox's events into `open`: its creation, claim, extension and end; other
/// types change nothing. The `usage_open` row and `usage verify` both fold with it.
pub fn fold_sandbox_event(open: &mut UsageLedger, sandbox_id: &str, env: &Envelope) -> std::result::Result<(), String> {
    use crate::sandbox::*;
    match env.event_type.as_str() {
        SANDBOX_CREATED => {
            let p: SandboxCreated = parse_env(env)?;
            let meter = Meter {
                kind: MeterKind::Sandbox,
                id: sandbox_id.to_owned(),
                pool_id: p.pool_id,
                node_id: p.node_id,
                reservation_id: String::new(),
                project_id: p.project_id,
                shape: MeterShape { flavor_id: p.shape.flavor_id, vcpus: p.shape.vcpus, memory_mib: p.shape.memory_mib },
                created_seq: env.seq,
                shape_seq: env.seq,
            };
            let ends_at = if p.warm { None } else { Some(p.ends_at_ms.unwrap_or(NO_END_MS)) };
            open.sandbox_created(sandbox_id, env.seq, env.at_ms, meter, ends_at);
        }
        SANDBOX_CLAIMED => {
            let p: SandboxClaimed = parse_env(env)?;
            open.sandbox_claimed(sandbox_id, env.seq, env.at_ms, p.ends_at_ms, p.project_id);
        }
        SANDBOX_EXTENDED => {
            let p: SandboxEnd = parse_env(env)?;
            open.sandbox_extended(sandbox_id, env.seq, p.ends_at_ms);
        }
        SANDBOX_DELETE_REQUESTED => open.sandbox_ended(sandbox_id, env.seq, env.at_ms, true),
        SANDBOX_APPLY_FAILED => open.sandbox_ended(sandbox_id, env.seq, env.at_ms, false),
        _ => {}
    }
    Ok(())
}

/// Folds one event of the reservation, instance or sandbox `id` (by its type) into `open`.
pub fn fold_subject_event(open: &mut UsageLedger, id: &str, env: &Envelope) -> std::result::Result<(), String> {
    let t = env.event_type.as_str();
    if LEDGER_INSTANCE_TYPES.contains(&t) {
        fold_instance_event(open, id, env)
    } else if LEDGER_SANDBOX_TYPES.contains(&t) {
        fold_sandbox_event(open, id, env)
    } else {
        fold_reservation_event(open, id, env)
    }
}

/// Folds one event into a reservation's, an instance's or a sandbox's `usage_open` row (its
/// activations or spans still to count, and an instance's or sandbox's meter, as a ledger
/// holding only them): gone once every one is settled and the meter gone.
pub(crate) fn apply_open(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let mut open = ledger_of(current)?;
    let id = key.id.as_str();
    match env.event_type.as_str() {
        USAGE_WINDOW_CLOSED | USAGE_CORRECTION => {
            let (_, lines) = usage_lines(event)?;
            open.recorded(None, &lines);
        }
        _ => fold_subject_event(&mut open, id, env).map_err(|what| corrupt(event, what))?,
    }
    if open.tracked.is_empty() && open.meters.is_empty() { Ok(None) } else { to_doc(&open) }
}

/// Folds `usage.price_set` into its SKU's periods (a period set again at the same start is
/// replaced).
pub(crate) fn apply_price(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if env.event_type != USAGE_PRICE_SET {
        return Ok(current);
    }
    let p: UsagePriceSet = payload(event)?;
    let mut doc = match current {
        Some(_) => from_doc(event, current)?,
        None => UsagePriceDoc { sku: key.id.clone(), periods: Vec::new(), version: 0 },
    };
    doc.periods.retain(|period| period.from_ms != p.from_ms);
    let period = PricePeriod { from_ms: p.from_ms, currency: p.currency, gpu_hour_micros: p.gpu_hour_micros, seq: env.seq };
    let at = doc.periods.partition_point(|q| q.from_ms < period.from_ms);
    doc.periods.insert(at, period);
    doc.version = env.version;
    to_doc(&doc)
}
