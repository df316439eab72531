//! Usage (`usage/<tenant>`): the GPU time each reservation held, closed into windows, and the
//! prices (`usage_price/<sku>`, on the root tenant's chain) that turn it into cost.
//!
//! Read models, all pure folds of the log:
//! - the **ledger** follows every activation of a reservation from `reservation.activated` to its
//!   end (`released`/`expired`, capped at its `endsAtMs`; `requeued`/`failed` take the activation
//!   back: the hold never held), and how far each one is already counted
//!   ([`Tracked::counted_ms`]), from the `usage.window_closed` and `usage.correction` events the
//!   `usage` reconciler appends. It is stored as one `usage_ledger/<tenant>` row (the windows
//!   closed) and one `usage_open/<reservation>` row per reservation with an activation still to
//!   count, removed once it has ended and is counted exactly to its end;
//! - the **prices** (`usage_price/<sku>`): per SKU, the periods a price per GPU-hour holds from.
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
/// A price per GPU-hour for a SKU from a time on (root tenant, `usage_price/<sku>`).
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
    pub reservation_id: String,
    /// The seq of the `reservation.activated` this line counts (a reservation requeued and
    /// placed again has several).
    pub activation_seq: u64,
    pub pool_id: String,
    /// The GPU product (`H100-SXM5-80GB`), the SKU prices are set for.
    pub sku: String,
    pub resource_kind: String,
    pub gpus: u32,
    /// The span inside the window this line counts (or, when `quantityMs` is negative, takes
    /// back).
    pub from_ms: u64,
    pub to_ms: u64,
    /// GPU-milliseconds: `gpus × (toMs − fromMs)`, negative for what a correction takes back.
    pub quantity_ms: i64,
    /// The price per GPU-hour, in millionths of `currency`, that held at the window's start when
    /// the line was written; absent without a price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_hour_micros: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    /// `quantityMs × gpuHourMicros / 3,600,000`, rounded to the nearest millionth; 0 without a
    /// price. Written once: a later price never changes it.
    pub cost_micros: i64,
    /// The tenant chain's seqs of the events the line was computed from: the request, the
    /// activation, each extension and the end.
    pub seqs: Vec<u64>,
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

/// One activation of a reservation the ledger follows.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Tracked {
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
}

impl Tracked {
    pub fn gpus(&self) -> u32 {
        self.gpu_indexes.len() as u32
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
        };
        self.tracked.insert(tracked_key(reservation_id, seq), tracked);
    }

    fn open_mut(&mut self, reservation_id: &str) -> Option<&mut Tracked> {
        self.tracked.values_mut().rev().find(|t| t.reservation_id == reservation_id && t.end_ms.is_none())
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
            if let Some(t) = self.tracked.get_mut(&tracked_key(&line.reservation_id, line.activation_seq)) {
                t.counted_ms = if line.quantity_ms < 0 { t.counted_ms.min(line.from_ms) } else { t.counted_ms.max(line.to_ms) };
            }
        }
        self.prune();
    }

    fn prune(&mut self) {
        self.tracked.retain(|_, t| !t.settled());
    }
}

/// The usage rows an event changes: a reservation's `usage_open` row for its activations and ends;
/// for a usage event, the tenant's `usage_ledger` row and the `usage_open` row of each
/// reservation its lines name.
pub(crate) fn touches(event: &StoredEvent, out: &mut Vec<RowKey>) {
    let env = &event.envelope;
    let t = env.event_type.as_str();
    let tenant = env.tenant.to_string();
    let row = |kind: &str, id: &str| RowKey { tenant: tenant.clone(), kind: kind.to_owned(), id: id.to_owned() };
    if LEDGER_RESERVATION_TYPES.contains(&t) {
        out.push(row(KIND_USAGE_OPEN, crate::stream_id_of(&env.stream)));
    } else if t == USAGE_WINDOW_CLOSED || t == USAGE_CORRECTION {
        out.push(row(KIND_USAGE_LEDGER, &tenant));
        let payload = bc_core::canonical::to_json(&env.payload);
        let mut named: Vec<&str> = payload
            .get("lines")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|line| line.get("reservationId").and_then(Value::as_str))
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

/// Folds one event into a reservation's `usage_open` row (its activations still to count, as a
/// ledger holding only them): gone once every activation is settled.
pub(crate) fn apply_open(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let mut open = ledger_of(current)?;
    let reservation_id = key.id.as_str();
    match env.event_type.as_str() {
        USAGE_WINDOW_CLOSED | USAGE_CORRECTION => {
            let (_, lines) = usage_lines(event)?;
            open.recorded(None, &lines);
        }
        _ => fold_reservation_event(&mut open, reservation_id, env).map_err(|what| corrupt(event, what))?,
    }
    if open.tracked.is_empty() { Ok(None) } else { to_doc(&open) }
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
