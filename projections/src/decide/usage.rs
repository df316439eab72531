//! Usage windows: what the `usage` reconciler appends, from a tenant's ledger
//! ([`crate::usage::UsageLedger`]) and the time. Pure: the caller reads the ledger, each tracked
//! reservation's pool and GPU product, and the prices, and appends the result at the ledger's
//! `usage_version`. An instance's or a sandbox's span carries its own pool and shape, and gives
//! one line per resource kind it counts ([`Tracked::meters`]): `vcpu` and `memory` (and
//! `sandbox` for a sandbox), each split at the window edges as a reservation's GPU line is.
//!
//! - A window `[a, a + window_ms)` (aligned to multiples of `window_ms` since the epoch) closes
//!   once `now` is past its end by `grace_ms`. Each activation counts in it the part of
//!   `[start, end)` inside it (an activation still open: to the window's end), split exactly at the
//!   edges, so no millisecond is counted twice or lost.
//! - A window no activation overlaps is closed without an event (the next closed window's end
//!   covers it).
//! - An activation whose recorded span (`[start, counted)`) differs from what the log now says for
//!   the closed windows (an expiry appended after its window closed) gets correction lines for
//!   the difference, per closed window; a closed window is never written again.

use std::collections::BTreeMap;

use bc_core::event::Envelope;
use bc_core::store::{ExpectedVersion, NewEvent};

use crate::usage::{
    GPU_MS_PER_GPU_HOUR, KIND_USAGE, MIB_PER_GIB, MeterKind, RESOURCE_GPU, RESOURCE_MEMORY, RESOURCE_SANDBOX, RESOURCE_VCPU,
    SKU_MEMORY, SKU_SANDBOX, SKU_VCPU, Tracked, USAGE_CORRECTION, USAGE_LINES_PER_EVENT_MAX, USAGE_WINDOW_CLOSED,
    UsageCorrection, UsageLedger, UsageLine, UsagePriceDoc, UsageWindowClosed,
};

/// Most windows one pass closes (a process that was down catches up over several passes).
pub const USAGE_WINDOWS_PER_PASS_MAX: usize = 48;
/// Most events one pass appends (one append: under `APPEND_EVENTS_MAX`).
pub const USAGE_EVENTS_PER_PASS_MAX: usize = 256;
/// A reservation's pool and GPU product when neither its document nor its node says (never in a
/// well-formed log; the line still counts, so nothing is lost).
pub const SKU_UNKNOWN: &str = "unknown";

/// What the lines of one tracked reservation name besides its ledger entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageDetail {
    pub pool_id: String,
    /// The GPU product of its GPUs on its node.
    pub sku: String,
    /// The seq of its `reservation.requested` (which names the pool).
    pub request_seq: u64,
    /// The tenant it is held for, in a pool another tenant offered (`holderTenantId`): its
    /// lines are that tenant's usage ([`UsageLine::holder_tenant_id`]).
    pub holder_tenant_id: Option<String>,
    /// The project its request names (`reservation.requested`'s `projectId`), which its lines
    /// carry ([`UsageLine::project_id`]).
    pub project_id: Option<String>,
}

/// The input of [`usage_close`].
pub struct UsageCloseInput<'a> {
    pub ledger: &'a UsageLedger,
    pub now_ms: u64,
    pub window_ms: u64,
    /// How long after a window's end it closes, so events committed around its end are in.
    pub grace_ms: u64,
    /// By reservation id.
    pub details: &'a BTreeMap<String, UsageDetail>,
    /// By SKU.
    pub prices: &'a BTreeMap<String, UsagePriceDoc>,
}

/// One usage event to append, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UsageEvent {
    Closed(UsageWindowClosed),
    Correction(UsageCorrection),
}

/// What one pass appends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageClose {
    pub events: Vec<UsageEvent>,
    pub windows: usize,
    pub correction_lines: usize,
    /// More windows are closable than one pass closes.
    pub more: bool,
}

/// The windows (aligned to `window_ms`) of `[from, to)`, each with the part of the span in it.
fn split(from: u64, to: u64, window_ms: u64) -> Vec<(u64, u64, u64, u64)> {
    let mut out = Vec::new();
    let mut a = from;
    while a < to {
        let ws = a / window_ms * window_ms;
        let we = ws.saturating_add(window_ms);
        let b = we.min(to);
        out.push((ws, we, a, b));
        a = b;
    }
    out
}

/// The cost of `quantity_ms` GPU-milliseconds at `gpu_hour_micros`, rounded half away from zero.
pub fn cost_micros(quantity_ms: i64, gpu_hour_micros: u64) -> i64 {
    cost_micros_of(RESOURCE_GPU, quantity_ms, gpu_hour_micros)
}

/// The cost of a line of `resource_kind` counting `quantity_ms` at `unit_hour_micros` per unit-hour
/// of its SKU (a GPU-, vCPU- or sandbox-hour; a GiB-hour for memory, whose lines count
/// MiB-milliseconds), rounded half away from zero.
pub fn cost_micros_of(resource_kind: &str, quantity_ms: i64, unit_hour_micros: u64) -> i64 {
    let per_unit_hour =
        i128::from(GPU_MS_PER_GPU_HOUR) * if resource_kind == RESOURCE_MEMORY { i128::from(MIB_PER_GIB) } else { 1 };
    let product = i128::from(quantity_ms) * i128::from(unit_hour_micros);
    let half = per_unit_hour / 2 * product.signum();
    i64::try_from((product + half) / per_unit_hour).unwrap_or(if product < 0 { i64::MIN } else { i64::MAX })
}

/// The part of window `[window_start_ms, window_end_ms)` the activation `t` held:
/// `[max(start, windowStart), min(end, windowEnd))`, to the window's end while it has not ended;
/// `None` when it held none of it. What a window's line counts: [`usage_close`] and the offline
/// check of a row ([`check_line`], `usage verify`) both count with it.
pub fn held_in_window(t: &Tracked, window_start_ms: u64, window_end_ms: u64) -> Option<(u64, u64)> {
    let from = t.start_ms.max(window_start_ms);
    let to = t.end_ms.unwrap_or(u64::MAX).min(window_end_ms);
    (from < to).then_some((from, to))
}

/// GPU-milliseconds of `gpus` GPUs over `[from_ms, to_ms)`, negative when `taken_back`.
pub fn gpu_ms(gpus: u32, from_ms: u64, to_ms: u64, taken_back: bool) -> i64 {
    unit_ms(u64::from(gpus), from_ms, to_ms, taken_back)
}

/// Unit-milliseconds of `units` (GPUs, vCPUs, MiB, sandboxes) over `[from_ms, to_ms)`, negative
/// when `taken_back`.
pub fn unit_ms(units: u64, from_ms: u64, to_ms: u64, taken_back: bool) -> i64 {
    let span = i64::try_from(to_ms.saturating_sub(from_ms)).unwrap_or(i64::MAX);
    span.saturating_mul(i64::try_from(units).unwrap_or(i64::MAX)) * if taken_back { -1 } else { 1 }
}

/// What the windows and corrections of a window must add up to for the activation or span `t`,
/// of `resource_kind`: the unit-milliseconds it held in the window (0 of a kind it does not
/// count).
pub fn window_total_ms(t: &Tracked, resource_kind: &str, window_start_ms: u64, window_end_ms: u64) -> i64 {
    let units = t.units_of(resource_kind).unwrap_or(0);
    held_in_window(t, window_start_ms, window_end_ms).map_or(0, |(from, to)| unit_ms(units, from, to, false))
}

/// The SKU of a line of `resource_kind` that is not a GPU's.
fn sku_of(resource_kind: &str) -> &'static str {
    match resource_kind {
        RESOURCE_VCPU => SKU_VCPU,
        RESOURCE_MEMORY => SKU_MEMORY,
        RESOURCE_SANDBOX => SKU_SANDBOX,
        _ => SKU_UNKNOWN,
    }
}

/// The lines of `t`'s span `[from, to)` in window `[ws, we)`, one per resource kind it counts,
/// taken back when `negative`.
fn lines(input: &UsageCloseInput<'_>, t: &Tracked, (ws, we, from, to): (u64, u64, u64, u64), negative: bool) -> Vec<UsageLine> {
    let detail = if t.metered.is_none() { input.details.get(&t.reservation_id) } else { None };
    let mut seqs: Vec<u64> = detail.map(|d| d.request_seq).into_iter().collect();
    seqs.extend(&t.seqs);
    let (pool_id, project_id) = match &t.metered {
        Some(m) => (m.pool_id.clone(), m.project_id.clone()),
        None => (detail.map_or(String::new(), |d| d.pool_id.clone()), detail.and_then(|d| d.project_id.clone())),
    };
    t.meters()
        .into_iter()
        .map(|(kind, units)| {
            let sku = if kind == RESOURCE_GPU { detail.map_or(SKU_UNKNOWN, |d| d.sku.as_str()) } else { sku_of(kind) };
            let quantity_ms = unit_ms(units, from, to, negative);
            let price = input.prices.get(sku).and_then(|p| p.at(ws));
            let (instance_id, sandbox_id) = match &t.metered {
                Some(m) if m.kind == MeterKind::Instance => (Some(m.id.clone()), None),
                Some(m) => (None, Some(m.id.clone())),
                None => (None, None),
            };
            UsageLine {
                window_start_ms: ws,
                window_end_ms: we,
                reservation_id: t.reservation_id.clone(),
                instance_id,
                sandbox_id,
                activation_seq: t.activation_seq,
                pool_id: pool_id.clone(),
                project_id: project_id.clone(),
                sku: sku.to_owned(),
                resource_kind: kind.to_owned(),
                gpus: if kind == RESOURCE_GPU { t.gpus() } else { 0 },
                units: (kind != RESOURCE_GPU).then_some(units),
                from_ms: from,
                to_ms: to,
                quantity_ms,
                gpu_hour_micros: price.map(|p| p.gpu_hour_micros),
                currency: price.map(|p| p.currency.clone()),
                cost_micros: price.map_or(0, |p| cost_micros_of(kind, quantity_ms, p.gpu_hour_micros)),
                holder_tenant_id: detail.and_then(|d| d.holder_tenant_id.clone()),
                seqs: seqs.clone(),
            }
        })
        .collect()
}

/// Where `t` stands against the closed windows: what it should have recorded in them.
fn closed_target(t: &Tracked, closed_through_ms: u64) -> u64 {
    t.end_ms.unwrap_or(u64::MAX).min(closed_through_ms).max(t.start_ms)
}

/// The corrections the closed windows need: per activation, the difference between what they
/// recorded and what the log now says.
fn corrections(input: &UsageCloseInput<'_>) -> Vec<UsageLine> {
    let closed = input.ledger.closed_through_ms;
    let mut lines = Vec::new();
    for t in input.ledger.tracked.values() {
        let target = closed_target(t, closed);
        let (from, to, negative) =
            if t.counted_ms < target { (t.counted_ms, target, false) } else { (target, t.counted_ms, true) };
        for piece in split(from, to, input.window_ms) {
            lines.extend(self::lines(input, t, piece, negative));
        }
    }
    lines
}

/// What each activation has left to count from the closed windows' end: `[from, end)`.
fn remaining(ledger: &UsageLedger) -> Vec<(&Tracked, u64, u64)> {
    let closed = ledger.closed_through_ms;
    ledger
        .tracked
        .values()
        .map(|t| (t, closed_target(t, closed).max(closed), t.end_ms.unwrap_or(u64::MAX)))
        .filter(|(_, from, end)| from < end)
        .collect()
}

/// The corrections, then the windows that may close at `now_ms`, in order; see the module.
pub fn usage_close(input: &UsageCloseInput<'_>) -> UsageClose {
    let window_ms = input.window_ms.max(1);
    let mut close = UsageClose::default();
    let corrected = corrections(input);
    close.correction_lines = corrected.len();
    for chunk in corrected.chunks(USAGE_LINES_PER_EVENT_MAX) {
        close.events.push(UsageEvent::Correction(UsageCorrection { lines: chunk.to_vec() }));
    }

    let last_end = input.now_ms.saturating_sub(input.grace_ms) / window_ms * window_ms;
    let left = remaining(input.ledger);
    let mut next = left.iter().map(|(_, from, _)| *from).min();
    while let Some(at) = next {
        let ws = (at / window_ms * window_ms).max(input.ledger.closed_through_ms);
        let we = (ws / window_ms + 1) * window_ms;
        if we > last_end {
            break;
        }
        if close.windows == USAGE_WINDOWS_PER_PASS_MAX || close.events.len() >= USAGE_EVENTS_PER_PASS_MAX {
            close.more = true;
            break;
        }
        // `ws` is at or past the closed windows' end, so what is left of each activation in
        // the window is what it held in it.
        let lines: Vec<UsageLine> = left
            .iter()
            .filter_map(|(t, _, _)| held_in_window(t, ws, we).map(|(a, b)| self::lines(input, t, (ws, we, a, b), false)))
            .flatten()
            .collect();
        for chunk in lines.chunks(USAGE_LINES_PER_EVENT_MAX) {
            let closed = UsageWindowClosed { window_start_ms: ws, window_end_ms: we, lines: chunk.to_vec() };
            close.events.push(UsageEvent::Closed(closed));
        }
        close.windows += 1;
        // The next window anything overlaps: windows in between count nothing.
        next = left.iter().map(|(_, from, end)| ((*from).max(we), *end)).filter(|(from, end)| from < end).map(|(f, _)| f).min();
    }
    close
}

/// What a line's events name besides the time it counts: the pool and the project of its
/// reservation's request, or of its instance's (or sandbox's) creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineOrigin {
    pub pool_id: String,
    pub project_id: Option<String>,
}

/// Whether `line` names the pool and the project its events say ([`recount_activation`]'s
/// [`LineOrigin`]); errs with the difference, in words.
pub fn check_origin(line: &UsageLine, origin: &LineOrigin) -> Result<(), String> {
    if origin.pool_id != line.pool_id {
        return Err(format!("its request names pool {}, the row {}", origin.pool_id, line.pool_id));
    }
    if origin.project_id != line.project_id {
        let name = |p: &Option<String>| p.clone().unwrap_or_else(|| "no project".into());
        return Err(format!("its request names {}, the row {}", name(&origin.project_id), name(&line.project_id)));
    }
    Ok(())
}

/// The activation (or an instance's or sandbox's span) a usage line counts, as the events it
/// names say: `events` are those events (each already proved to be in the log, in any order),
/// folded as the ledger folds them ([`crate::usage::fold_subject_event`]). Also returns the pool
/// and project its request (or its instance's or sandbox's creation) names, when the events
/// hold it. Errs when an event is not one the line names, is another reservation's, instance's
/// or sandbox's or another tenant's, or the activation is missing.
pub fn recount_activation(line: &UsageLine, events: &[&Envelope]) -> Result<(Tracked, Option<LineOrigin>), String> {
    let mut events: Vec<&Envelope> = events.to_vec();
    events.sort_by_key(|e| e.seq);
    let subject = line.subject_id().to_owned();
    let stream = if line.instance_id.is_some() {
        crate::stream_of(crate::instance::KIND_INSTANCE, &subject)
    } else if line.sandbox_id.is_some() {
        crate::stream_of(crate::sandbox::KIND_SANDBOX, &subject)
    } else {
        crate::stream_of(crate::reservation::KIND_RESERVATION, &subject)
    };
    let key = crate::usage::tracked_key(&subject, line.activation_seq);
    let mut open = UsageLedger::default();
    let (mut origin, mut tracked): (Option<LineOrigin>, Option<Tracked>) = (None, None);
    for env in events {
        if !line.seqs.contains(&env.seq) {
            return Err(format!("event seq {} is not one the row names ({:?})", env.seq, line.seqs));
        }
        if env.stream != stream {
            return Err(format!("event seq {} is on {}, not the row's {stream}", env.seq, env.stream));
        }
        if env.event_type == crate::reservation::RESERVATION_REQUESTED {
            let requested: crate::reservation::ReservationRequested =
                serde_json::from_value(bc_core::canonical::to_json(&env.payload))
                    .map_err(|e| format!("event seq {}: {e}", env.seq))?;
            origin = Some(LineOrigin { pool_id: requested.pool_id, project_id: requested.project_id });
        }
        crate::usage::fold_subject_event(&mut open, &subject, env).map_err(|e| format!("event seq {}: {e}", env.seq))?;
        tracked = match (open.tracked.get(&key), tracked) {
            (Some(t), _) => Some(t.clone()),
            // The ledger drops an activation once it has ended and is counted to its end; from
            // nothing counted, that is an end at its start (a requeue, a failure): it held
            // nothing.
            (None, Some(mut t)) if t.end_ms.is_none() => {
                t.end_ms = Some(t.start_ms);
                t.seqs.push(env.seq);
                Some(t)
            }
            (None, before) => before,
        };
    }
    let tracked = tracked.ok_or_else(|| format!("the row's events start nothing it counts at seq {}", line.activation_seq))?;
    let origin = origin.or_else(|| {
        tracked.metered.as_ref().map(|m| LineOrigin { pool_id: m.pool_id.clone(), project_id: m.project_id.clone() })
    });
    Ok((tracked, origin))
}

/// Checks one usage line against the activation its events give (`t`, from
/// [`recount_activation`]): its GPUs, its span, its quantity and its cost. `closed`: a line of
/// `usage.window_closed`, which counts exactly what the activation held in the window
/// ([`held_in_window`]); else a line of `usage.correction`, whose span must lie in its window
/// and be wholly time the activation held (a positive line) or wholly time it did not (a line
/// taking back). What a correction's span must be also depends on what was recorded before it:
/// [`window_total_ms`] checks a window's lines together. Errs with why, in words.
pub fn check_line(line: &UsageLine, closed: bool, t: &Tracked) -> Result<(), String> {
    if t.activation_seq != line.activation_seq {
        return Err(format!("the activation is seq {}, the row names {}", t.activation_seq, line.activation_seq));
    }
    let kind = line.resource_kind.as_str();
    let Some(units) = t.units_of(kind) else {
        return Err(format!("its events count no {kind} (the row's resource kind)"));
    };
    if kind == RESOURCE_GPU && t.gpus() != line.gpus {
        return Err(format!("the activation holds {} GPUs, the row says {}", t.gpus(), line.gpus));
    }
    if kind != RESOURCE_GPU && (line.units != Some(units) || line.gpus != 0) {
        return Err(format!("its events give {units} {kind} units, the row says {:?}", line.units));
    }
    if kind != RESOURCE_GPU && sku_of(kind) != line.sku {
        return Err(format!("a {kind} row's SKU is {}, the row says {}", sku_of(kind), line.sku));
    }
    let (ws, we) = (line.window_start_ms, line.window_end_ms);
    if !(ws <= line.from_ms && line.from_ms < line.to_ms && line.to_ms <= we) {
        return Err(format!("its span [{}, {}) is not inside its window [{ws}, {we})", line.from_ms, line.to_ms));
    }
    let taken_back = line.quantity_ms < 0;
    if closed {
        let Some((from, to)) = held_in_window(t, ws, we) else {
            return Err(format!("its events say the activation held nothing in the window [{ws}, {we})"));
        };
        let expected = unit_ms(units, from, to, false);
        if (from, to, expected) != (line.from_ms, line.to_ms, line.quantity_ms) {
            return Err(format!(
                "its events give {expected} {kind}-ms ({units} units over [{from}, {to})), the row {} {kind}-ms",
                line.quantity_ms
            ));
        }
    } else {
        let expected = unit_ms(units, line.from_ms, line.to_ms, taken_back);
        if expected != line.quantity_ms {
            return Err(format!(
                "its events give {expected} {kind}-ms ({units} units over [{}, {})), the row {} {kind}-ms",
                line.from_ms, line.to_ms, line.quantity_ms
            ));
        }
        let held = held_in_window(t, line.from_ms, line.to_ms);
        if taken_back && held.is_some() {
            return Err(format!("it takes back [{}, {}), time its events say the activation held", line.from_ms, line.to_ms));
        }
        if !taken_back && held != Some((line.from_ms, line.to_ms)) {
            return Err(format!("it adds [{}, {}), time its events say the activation did not hold", line.from_ms, line.to_ms));
        }
    }
    let cost = line.gpu_hour_micros.map_or(0, |price| cost_micros_of(kind, line.quantity_ms, price));
    if cost != line.cost_micros {
        return Err(format!("its cost is {} millionths, its quantity and price give {cost}", line.cost_micros));
    }
    Ok(())
}

impl UsageEvent {
    pub fn lines(&self) -> &[UsageLine] {
        match self {
            Self::Closed(c) => &c.lines,
            Self::Correction(c) => &c.lines,
        }
    }

    /// Folds it into `ledger`, as the projection does once it is appended.
    pub fn fold(&self, ledger: &mut UsageLedger) {
        match self {
            Self::Closed(c) => ledger.recorded(Some(c.window_end_ms), &c.lines),
            Self::Correction(c) => ledger.recorded(None, &c.lines),
        }
    }

    fn new_event(&self) -> bc_core::Result<NewEvent> {
        Ok(match self {
            Self::Closed(c) => NewEvent::new(USAGE_WINDOW_CLOSED, crate::events::to_cbor(c)?),
            Self::Correction(c) => NewEvent::new(USAGE_CORRECTION, crate::events::to_cbor(c)?),
        })
    }
}

impl UsageClose {
    /// The append of the tenant's usage stream (`usage/<tenant>`), at the version its ledger
    /// folded; `None` when there is nothing to append.
    pub fn append(&self, tenant_id: &str, ledger: &UsageLedger) -> bc_core::Result<Option<super::Append>> {
        if self.events.is_empty() {
            return Ok(None);
        }
        let expected = match ledger.usage_version {
            0 => ExpectedVersion::NoStream,
            v => ExpectedVersion::Exact(v),
        };
        let events = self.events.iter().map(UsageEvent::new_event).collect::<bc_core::Result<Vec<_>>>()?;
        Ok(Some(super::Append { stream: crate::stream_of(KIND_USAGE, &tenant_id), expected, guards: Vec::new(), events }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::ReservationActivated;
    use crate::usage::PricePeriod;

    const HOUR_MS: u64 = 3_600_000;

    /// A seeded source of draws below `n`.
    fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        move |n| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) % n.max(1)
        }
    }

    /// One activation as the test wrote it, for the count made apart from the ledger.
    struct Truth {
        gpus: u64,
        start_ms: u64,
        /// Set when its end is appended.
        end_ms: Option<u64>,
    }

    /// What the windows and corrections recorded, and what was checked along the way.
    #[derive(Default)]
    struct Recorded {
        /// (window start, subject, activation seq, resource kind) of each `usage.window_closed`
        /// line.
        closed_lines: BTreeMap<(u64, String, u64, String), i64>,
        /// Unit-ms per (resource kind, window start), windows and corrections together.
        per_window: BTreeMap<(String, u64), i64>,
        /// Corrections per resource kind.
        corrections: BTreeMap<String, usize>,
    }

    fn pass(ledger: &mut UsageLedger, now_ms: u64, details: &BTreeMap<String, UsageDetail>, recorded: &mut Recorded) {
        let prices = BTreeMap::new();
        loop {
            let input = UsageCloseInput { ledger, now_ms, window_ms: HOUR_MS, grace_ms: 60_000, details, prices: &prices };
            let close = usage_close(&input);
            for event in &close.events {
                for line in event.lines() {
                    // The offline check (`usage verify`) accepts every line from the activation
                    // it was computed from, and refuses it with its quantity changed.
                    let t = &ledger.tracked[&crate::usage::tracked_key(line.subject_id(), line.activation_seq)];
                    let closed = matches!(event, UsageEvent::Closed(_));
                    check_line(line, closed, t).unwrap_or_else(|e| panic!("{e}: {line:?} of {t:?}"));
                    let edited = UsageLine { quantity_ms: line.quantity_ms + 1, ..line.clone() };
                    assert!(check_line(&edited, closed, t).is_err(), "an edited quantity passes: {edited:?}");
                    *recorded.per_window.entry((line.resource_kind.clone(), line.window_start_ms)).or_default() +=
                        line.quantity_ms;
                    match event {
                        UsageEvent::Closed(_) => {
                            assert!(line.window_start_ms >= ledger.closed_through_ms, "a closed window written again: {line:?}");
                            let key = (
                                line.window_start_ms,
                                line.subject_id().to_owned(),
                                line.activation_seq,
                                line.resource_kind.clone(),
                            );
                            assert!(recorded.closed_lines.insert(key, line.quantity_ms).is_none(), "a line twice: {line:?}");
                        }
                        UsageEvent::Correction(_) => {
                            assert!(line.window_end_ms <= ledger.closed_through_ms, "a correction of an open window: {line:?}");
                            *recorded.corrections.entry(line.resource_kind.clone()).or_default() += 1;
                        }
                    }
                }
            }
            for event in &close.events {
                event.fold(ledger);
            }
            if !close.more {
                return;
            }
        }
    }

    /// Random reservations over several days: activations, extensions, releases and expiries
    /// (some appended hours late), with window passes at random times between; random instances
    /// started, stopped, resized, failed and deleted (some stops appended late, with a time in a
    /// closed window); random sandboxes, cold and warm (claimed), extended, deleted, some deleted
    /// late (past their end). Every window's unit-ms of each resource kind (GPU, vCPU, memory,
    /// sandbox), corrections included, equals exactly what each activation or span held in it
    /// times its units, computed apart; no closed window is written twice; late ends give
    /// corrections, of each kind.
    #[test]
    fn windows_count_exactly_what_each_reservation_held() {
        let base = bc_core::testing::seed();
        let mut corrections: BTreeMap<String, usize> = BTreeMap::new();
        for case in 0..48u64 {
            let seed = base.wrapping_add(case);
            let result = std::panic::catch_unwind(|| one_case(seed));
            match result {
                Ok(n) => n.into_iter().for_each(|(k, c)| *corrections.entry(k).or_default() += c),
                Err(e) => {
                    eprintln!("usage property failed; replay with BC_TEST_SEED={base} (case seed {seed})");
                    std::panic::resume_unwind(e);
                }
            }
        }
        for kind in [RESOURCE_GPU, RESOURCE_VCPU, RESOURCE_MEMORY, RESOURCE_SANDBOX] {
            assert!(
                corrections.get(kind).copied().unwrap_or(0) > 0,
                "no late end gave a {kind} correction (BC_TEST_SEED={base}): the cases prove nothing of them ({corrections:?})"
            );
        }
    }

    /// An instance as the test drives it, for the count made apart from the ledger.
    struct InstanceTruth {
        /// (vcpus, memory MiB) now.
        shape: (u64, u64),
        /// Since when it runs, if it does.
        running_since: Option<u64>,
        /// Its time of its latest event: a late one is never before it.
        last_ms: u64,
    }

    /// A sandbox as the test drives it: its life's start (once it starts), its end so far,
    /// (vcpus, memory MiB).
    struct SandboxTruth {
        start_ms: Option<u64>,
        ends_at_ms: u64,
        shape: (u64, u64),
    }

    fn meter(kind: MeterKind, id: &str, seq: u64, shape: (u64, u64)) -> crate::usage::Meter {
        crate::usage::Meter {
            kind,
            id: id.to_owned(),
            pool_id: "pool_1".into(),
            node_id: "node_1".into(),
            reservation_id: if kind == MeterKind::Instance { "rsv_x".into() } else { String::new() },
            project_id: None,
            shape: meter_shape(shape),
            created_seq: seq,
            shape_seq: seq,
        }
    }

    fn meter_shape((vcpus, mib): (u64, u64)) -> crate::usage::MeterShape {
        crate::usage::MeterShape { flavor_id: format!("flv_{vcpus}_{mib}"), vcpus: vcpus as u32, memory_mib: mib }
    }

    /// Adds `units` × the part of `[from, to)` in each window to `expected`.
    fn add_span(expected: &mut BTreeMap<(String, u64), i64>, kind: &str, units: u64, from: u64, to: u64) {
        let mut at = from;
        while at < to {
            let ws = at / HOUR_MS * HOUR_MS;
            let b = (ws + HOUR_MS).min(to);
            *expected.entry((kind.to_owned(), ws)).or_default() += ((b - at) * units) as i64;
            at = b;
        }
    }

    fn one_case(seed: u64) -> BTreeMap<String, usize> {
        let mut next = draws(seed);
        let start = 1_700_000_000_000 + next(HOUR_MS);
        let days = 3 + next(3);
        let mut ledger = UsageLedger::default();
        let mut truth: BTreeMap<String, Truth> = BTreeMap::new();
        let mut open: Vec<(String, u64)> = Vec::new(); // (reservation, ends_at)
        let mut late: Vec<(u64, String)> = Vec::new(); // expiries to append at a later time
        let mut details = BTreeMap::new();
        let mut recorded = Recorded::default();
        // Instances and sandboxes, and what they held, counted apart: (kind, window) → unit-ms.
        let mut instances: BTreeMap<String, InstanceTruth> = BTreeMap::new();
        let mut sandboxes: BTreeMap<String, SandboxTruth> = BTreeMap::new();
        let mut held: BTreeMap<(String, u64), i64> = BTreeMap::new();
        let shapes = [(1u64, 512u64), (2, 1536), (4, 8192), (8, 16384)];
        let (mut now, mut seq, end) = (start, 0u64, start + days * 24 * HOUR_MS);
        while now < end {
            now += 1 + next(40 * 60_000);
            seq += 1;
            late.sort();
            while let Some((at, id)) = late.first().cloned().filter(|(at, _)| *at <= now) {
                late.remove(0);
                expire(&mut ledger, &mut truth, &id, seq, at);
                seq += 1;
            }
            if next(2) == 0 {
                seq += 1;
                instance_step(&mut next, &mut ledger, &mut instances, &mut held, &shapes, seq, now);
                seq += 1;
                sandbox_step(&mut next, &mut ledger, &mut sandboxes, &mut held, &shapes, seq, now);
                seq += 1;
            }
            match next(10) {
                0..=2 => {
                    let id = format!("rsv_{seq}");
                    let gpus = 1 + next(8) as u32;
                    let ends_at = now + 1 + next(10 * HOUR_MS);
                    let p = ReservationActivated {
                        node_id: "node_1".into(),
                        gpus: (0..gpus).collect(),
                        ends_at_ms: ends_at,
                        hold: None,
                    };
                    ledger.activated(&id, seq, now, &p);
                    let detail = UsageDetail {
                        pool_id: "pool_1".into(),
                        sku: "H100".into(),
                        request_seq: seq,
                        holder_tenant_id: None,
                        project_id: None,
                    };
                    details.insert(id.clone(), detail);
                    truth.insert(id.clone(), Truth { gpus: u64::from(gpus), start_ms: now, end_ms: None });
                    open.push((id, ends_at));
                }
                3 if !open.is_empty() => {
                    let i = next(open.len() as u64) as usize;
                    let new_end = open[i].1.max(now) + next(3 * HOUR_MS);
                    open[i].1 = new_end;
                    ledger.extended(&open[i].0, seq, new_end);
                }
                4 if !open.is_empty() => {
                    let (id, ends_at) = open.remove(next(open.len() as u64) as usize);
                    ledger.ended(&id, seq, now, false);
                    truth.get_mut(&id).unwrap().end_ms = Some(now.min(ends_at));
                }
                5 if !open.is_empty() => {
                    // Expiries: some on time, some appended hours after their end.
                    let (id, ends_at) = open.remove(next(open.len() as u64) as usize);
                    late.push((ends_at.max(now) + next(4 * HOUR_MS), id.clone()));
                    truth.get_mut(&id).unwrap().end_ms = Some(ends_at);
                }
                _ => pass(&mut ledger, now, &details, &mut recorded),
            }
        }
        // Everything ends, and every window closes.
        let end = now;
        for (id, ends_at) in std::mem::take(&mut open) {
            seq += 1;
            ledger.ended(&id, seq, end, false);
            truth.get_mut(&id).unwrap().end_ms = Some(end.min(ends_at));
        }
        for (at, id) in std::mem::take(&mut late) {
            seq += 1;
            expire(&mut ledger, &mut truth, &id, seq, at);
        }
        for (id, i) in std::mem::take(&mut instances) {
            seq += 1;
            let at = end.max(i.last_ms);
            if let Some(since) = i.running_since {
                add_span(&mut held, RESOURCE_VCPU, i.shape.0, since, at);
                add_span(&mut held, RESOURCE_MEMORY, i.shape.1, since, at);
            }
            ledger.instance_ended(&id, seq, at, true);
        }
        for (id, sbx) in std::mem::take(&mut sandboxes) {
            seq += 1;
            if let Some(start) = sbx.start_ms {
                let to = end.max(start).min(sbx.ends_at_ms);
                add_span(&mut held, RESOURCE_SANDBOX, 1, start, to);
                add_span(&mut held, RESOURCE_VCPU, sbx.shape.0, start, to);
                add_span(&mut held, RESOURCE_MEMORY, sbx.shape.1, start, to);
            }
            ledger.sandbox_ended(&id, seq, end.max(sbx.start_ms.unwrap_or(0)), true);
        }
        pass(&mut ledger, end + 48 * HOUR_MS, &details, &mut recorded);
        assert!(ledger.meters.is_empty(), "seed {seed}: meters left: {:?}", ledger.meters.keys());
        assert!(ledger.tracked.is_empty(), "seed {seed}: activations left uncounted: {:?}", ledger.tracked.keys());

        let mut expected = held;
        let mut total_expected = 0i64;
        for t in truth.values() {
            let end_ms = t.end_ms.unwrap();
            total_expected += ((end_ms - t.start_ms) * t.gpus) as i64;
            add_span(&mut expected, RESOURCE_GPU, t.gpus, t.start_ms, end_ms);
        }
        let total: i64 = recorded.per_window.iter().filter(|((k, _), _)| k == RESOURCE_GPU).map(|(_, q)| q).sum();
        assert_eq!(total, total_expected, "seed {seed}: GPU-ms over every window");
        recorded.per_window.retain(|_, q| *q != 0);
        expected.retain(|_, q| *q != 0);
        assert_eq!(recorded.per_window, expected, "seed {seed}: unit-ms per resource kind and window");
        recorded.corrections
    }

    /// One random step of the instances: a new one (running or not), a start, a stop (sometimes
    /// appended late: its time up to three hours back, never before its instance's latest
    /// event), a resize, a failure, a deletion.
    fn instance_step(
        next: &mut impl FnMut(u64) -> u64,
        ledger: &mut UsageLedger,
        instances: &mut BTreeMap<String, InstanceTruth>,
        held: &mut BTreeMap<(String, u64), i64>,
        shapes: &[(u64, u64)],
        seq: u64,
        now: u64,
    ) {
        let ids: Vec<String> = instances.keys().cloned().collect();
        let pick = |next: &mut dyn FnMut(u64) -> u64| (!ids.is_empty()).then(|| ids[next(ids.len() as u64) as usize].clone());
        let stop = |i: &mut InstanceTruth, held: &mut BTreeMap<(String, u64), i64>, at: u64| {
            if let Some(since) = i.running_since.take() {
                add_span(held, RESOURCE_VCPU, i.shape.0, since, at);
                add_span(held, RESOURCE_MEMORY, i.shape.1, since, at);
            }
            i.last_ms = at;
        };
        let start = |i: &mut InstanceTruth, at: u64| {
            i.running_since = Some(at);
            i.last_ms = at;
        };
        match (next(8), pick(next)) {
            (0 | 1, _) | (_, None) => {
                let id = format!("inst_{seq}");
                let shape = shapes[next(shapes.len() as u64) as usize];
                let running = next(4) != 0;
                ledger.instance_created(&id, seq, now, meter(MeterKind::Instance, &id, seq, shape), running);
                let mut i = InstanceTruth { shape, running_since: None, last_ms: now };
                if running {
                    start(&mut i, now);
                }
                instances.insert(id, i);
            }
            (2, Some(id)) => {
                let i = instances.get_mut(&id).unwrap();
                stop(i, held, now);
                ledger.instance_requested(&id, seq, now, true, None);
                start(i, now);
            }
            (3, Some(id)) => {
                // A stop, often appended late: its time is in the past, maybe in a closed window.
                let i = instances.get_mut(&id).unwrap();
                let at = if next(2) == 0 { now } else { now.saturating_sub(next(3 * HOUR_MS)).max(i.last_ms) };
                stop(i, held, at);
                ledger.instance_requested(&id, seq, at, false, None);
            }
            (4, Some(id)) => {
                let i = instances.get_mut(&id).unwrap();
                let shape = shapes[next(shapes.len() as u64) as usize];
                let running = i.running_since.is_some();
                stop(i, held, now);
                i.shape = shape;
                ledger.instance_requested(&id, seq, now, running, Some(meter_shape(shape)));
                if running {
                    start(i, now);
                }
            }
            (5, Some(id)) => {
                let i = instances.get_mut(&id).unwrap();
                stop(i, held, now);
                ledger.instance_ended(&id, seq, now, false);
            }
            (6, Some(id)) => {
                let mut i = instances.remove(&id).unwrap();
                stop(&mut i, held, now);
                ledger.instance_requested(&id, seq, now, false, None);
                ledger.instance_ended(&id, seq + 1, now, true);
            }
            (_, Some(_)) => {}
        }
    }

    /// One random step of the sandboxes: a new one, cold (its life starts) or warm (at its
    /// claim); a claim; an extension; a deletion (sometimes appended hours after its end, which
    /// caps it).
    fn sandbox_step(
        next: &mut impl FnMut(u64) -> u64,
        ledger: &mut UsageLedger,
        sandboxes: &mut BTreeMap<String, SandboxTruth>,
        held: &mut BTreeMap<(String, u64), i64>,
        shapes: &[(u64, u64)],
        seq: u64,
        now: u64,
    ) {
        let ids: Vec<String> = sandboxes.keys().cloned().collect();
        let picked = (!ids.is_empty()).then(|| ids[next(ids.len() as u64) as usize].clone());
        match (next(6), picked) {
            (0 | 1, _) | (_, None) => {
                let id = format!("sbx_{seq}");
                let shape = shapes[next(shapes.len() as u64) as usize];
                let warm = next(3) == 0;
                let ends_at = now + 1 + next(3 * HOUR_MS);
                let start_ms = (!warm).then_some(now);
                ledger.sandbox_created(&id, seq, now, meter(MeterKind::Sandbox, &id, seq, shape), start_ms.map(|_| ends_at));
                sandboxes.insert(id, SandboxTruth { start_ms, ends_at_ms: if warm { u64::MAX } else { ends_at }, shape });
            }
            (2, Some(id)) => {
                let sbx = sandboxes.get_mut(&id).unwrap();
                if sbx.start_ms.is_none() {
                    let ends_at = now + 1 + next(3 * HOUR_MS);
                    ledger.sandbox_claimed(&id, seq, now, ends_at, None);
                    (sbx.start_ms, sbx.ends_at_ms) = (Some(now), ends_at);
                }
            }
            (3, Some(id)) => {
                let sbx = sandboxes.get_mut(&id).unwrap();
                if sbx.start_ms.is_some() && sbx.ends_at_ms > now {
                    let ends_at = sbx.ends_at_ms + next(2 * HOUR_MS);
                    ledger.sandbox_extended(&id, seq, ends_at);
                    sbx.ends_at_ms = ends_at;
                }
            }
            (4 | 5, Some(id)) => {
                let sbx = sandboxes.remove(&id).unwrap();
                if let Some(start) = sbx.start_ms {
                    let to = now.min(sbx.ends_at_ms);
                    add_span(held, RESOURCE_SANDBOX, 1, start, to);
                    add_span(held, RESOURCE_VCPU, sbx.shape.0, start, to);
                    add_span(held, RESOURCE_MEMORY, sbx.shape.1, start, to);
                }
                ledger.sandbox_ended(&id, seq, now, true);
            }
            (_, Some(_)) => {}
        }
    }

    fn expire(ledger: &mut UsageLedger, truth: &mut BTreeMap<String, Truth>, id: &str, seq: u64, at: u64) {
        ledger.ended(id, seq, at, false);
        assert!(truth[id].end_ms.is_some());
    }

    fn envelope(seq: u64, stream: &str, event_type: &str, at_ms: u64, payload: ciborium::Value) -> Envelope {
        Envelope {
            tenant: bc_core::id::TenantId::ROOT,
            seq,
            id: bc_core::id::EventId::from_ulid(ulid::Ulid::from_parts(at_ms, u128::from(seq))),
            stream: stream.into(),
            version: seq,
            event_type: event_type.into(),
            at_ms,
            actor: "test".into(),
            idempotency_key: None,
            causation: None,
            correlation: None,
            payload,
            prev: [0; 32],
        }
    }

    /// Folds `events` as the projection does, closes every window, and checks each line as
    /// `usage verify` does: recounted from the events it names alone (with events of other spans
    /// of the same subject left out), it passes; with its quantity edited, it fails. Returns the
    /// lines by (resource kind) summed.
    fn close_and_recount(subject: &str, events: &[Envelope], now_ms: u64) -> (Vec<UsageLine>, BTreeMap<String, i64>) {
        let mut ledger = UsageLedger::default();
        for env in events {
            crate::usage::fold_subject_event(&mut ledger, subject, env).unwrap();
        }
        let (details, prices) = (BTreeMap::new(), BTreeMap::new());
        let input =
            UsageCloseInput { ledger: &ledger, now_ms, window_ms: HOUR_MS, grace_ms: 0, details: &details, prices: &prices };
        let close = usage_close(&input);
        let mut all = Vec::new();
        let mut sums = BTreeMap::new();
        for event in &close.events {
            let closed = matches!(event, UsageEvent::Closed(_));
            for line in event.lines() {
                let named: Vec<&Envelope> = events.iter().filter(|e| line.seqs.contains(&e.seq)).collect();
                let (t, origin) = recount_activation(line, &named).unwrap_or_else(|e| panic!("{e}: {line:?}"));
                let origin = origin.expect("an instance's or sandbox's creation names its pool");
                assert_eq!(origin.pool_id, "pool_1");
                check_origin(line, &origin).unwrap_or_else(|e| panic!("{e}: {line:?}"));
                let other_project = UsageLine { project_id: Some("proj_other".into()), ..line.clone() };
                assert!(check_origin(&other_project, &origin).is_err(), "another project passes: {other_project:?}");
                check_line(line, closed, &t).unwrap_or_else(|e| panic!("{e}: {line:?}"));
                assert_eq!(window_total_ms(&t, &line.resource_kind, line.window_start_ms, line.window_end_ms), line.quantity_ms);
                let edited = UsageLine { quantity_ms: line.quantity_ms + 1, ..line.clone() };
                assert!(check_line(&edited, closed, &t).is_err(), "an edited quantity passes: {edited:?}");
                let other_units = UsageLine { units: line.units.map(|u| u + 1), ..line.clone() };
                assert!(check_line(&other_units, closed, &t).is_err(), "edited units pass: {other_units:?}");
                *sums.entry(line.resource_kind.clone()).or_default() += line.quantity_ms;
                all.push(line.clone());
            }
        }
        (all, sums)
    }

    /// An instance made running at 2 vCPUs and 1 GiB, resized to 4 vCPUs and 2 GiB while it ran,
    /// stopped, started again and deleted: each span at the shape its events say, split at the
    /// hour; each line recounted from the events it names alone.
    #[test]
    fn an_instance_counts_vcpu_and_memory_from_its_events_and_each_line_recounts() {
        use crate::events::*;
        let stream = "instance/inst_1";
        let apply = HoldIssued { command_id: "cmd_1".into(), deadline_at_ms: 0 };
        let shape = |vcpus, memory_mib| InstanceShape { flavor_id: "flv_1".into(), vcpus, memory_mib, disk_gib: 10 };
        let created = InstanceCreated {
            name: "vm".into(),
            pool_id: "pool_1".into(),
            node_id: "node_1".into(),
            reservation_id: "rsv_1".into(),
            shape: shape(2, 1024),
            gpus: vec![],
            image: InstanceImage {
                image_id: "img_1".into(),
                url: "http://x".into(),
                sha256: "00".into(),
                disk_format: DiskFormat::Qcow2,
                size_bytes: None,
            },
            desired: DesiredState::Running,
            generation: 1,
            apply: apply.clone(),
            project_id: Some("proj_1".into()),
        };
        let request = |desired, shape: Option<InstanceShape>| {
            to_cbor(&InstanceRequested { desired, generation: 2, apply: apply.clone(), shape, reason: None }).unwrap()
        };
        let h = HOUR_MS;
        let events = vec![
            envelope(1, stream, INSTANCE_CREATED, h / 2, to_cbor(&created).unwrap()),
            envelope(2, stream, INSTANCE_RESIZE_REQUESTED, h + h / 4, request(DesiredState::Running, Some(shape(4, 2048)))),
            envelope(3, stream, INSTANCE_STOP_REQUESTED, 2 * h, request(DesiredState::Stopped, None)),
            envelope(4, stream, INSTANCE_START_REQUESTED, 3 * h, request(DesiredState::Running, None)),
            envelope(5, stream, INSTANCE_DELETE_REQUESTED, 3 * h + 1000, request(DesiredState::Deleted, None)),
            envelope(6, stream, INSTANCE_DELETED, 3 * h + 2000, to_cbor(&crate::NoFields {}).unwrap()),
        ];
        let (lines, sums) = close_and_recount("inst_1", &events, 10 * h);
        // [h/2, 5h/4) at 2 vCPUs, [5h/4, 2h) at 4, [3h, 3h + 1 s) at 4.
        let vcpu_ms = 2 * (3 * h / 4) + 4 * (3 * h / 4) + 4 * 1000;
        let mib_ms = 1024 * (3 * h / 4) + 2048 * (3 * h / 4) + 2048 * 1000;
        assert_eq!(sums[RESOURCE_VCPU], vcpu_ms as i64);
        assert_eq!(sums[RESOURCE_MEMORY], mib_ms as i64);
        assert!(lines.iter().all(|l| l.instance_id.as_deref() == Some("inst_1") && l.reservation_id == "rsv_1" && l.gpus == 0));
        assert!(lines.iter().all(|l| l.project_id.as_deref() == Some("proj_1")), "every line names its instance's project");
        let started_by_start = lines.iter().find(|l| l.activation_seq == 4).unwrap();
        assert_eq!(started_by_start.seqs, vec![1, 2, 4, 5], "its creation, its shape's resize, its start, its end");
        assert_eq!(lines.iter().filter(|l| l.activation_seq == 1).count(), 4, "two windows, vCPU and memory");
        assert!(lines.iter().all(|l| l.sku == if l.resource_kind == RESOURCE_VCPU { SKU_VCPU } else { SKU_MEMORY }));
    }

    /// A warm sandbox counts from its claim, to its end when its deletion comes late (an hour
    /// past it); a cold one from its creation to its deletion; each with its template flavor's
    /// vCPUs and memory.
    #[test]
    fn a_sandbox_counts_from_its_claim_or_creation_to_its_end_and_each_line_recounts() {
        use crate::events::*;
        let h = HOUR_MS;
        let created = |warm: bool, ends_at_ms: Option<u64>, project_id: Option<&str>| SandboxCreated {
            template_id: "sbxt_1".into(),
            pool_id: "pool_1".into(),
            node_id: "node_1".into(),
            shape: SandboxShape { flavor_id: "flv_1".into(), vcpus: 2, memory_mib: 512 },
            image: InstanceImage {
                image_id: "img_1".into(),
                url: "http://x".into(),
                sha256: "00".into(),
                disk_format: DiskFormat::Qcow2,
                size_bytes: None,
            },
            env: BTreeMap::new(),
            network: "none".into(),
            warm,
            ends_at_ms,
            apply: HoldIssued { command_id: "cmd_1".into(), deadline_at_ms: 0 },
            volumes: Vec::new(),
            restore: None,
            project_id: project_id.map(str::to_owned),
        };
        let delete = || {
            to_cbor(&SandboxDeleteRequested { apply: HoldIssued { command_id: "cmd_2".into(), deadline_at_ms: 0 }, reason: None })
                .unwrap()
        };
        let warm = "sandbox/sbx_1";
        let events = vec![
            envelope(1, warm, SANDBOX_CREATED, h / 2, to_cbor(&created(true, None, None)).unwrap()),
            envelope(
                2,
                warm,
                SANDBOX_CLAIMED,
                h,
                to_cbor(&SandboxClaimed { ends_at_ms: h + 1000, project_id: Some("proj_1".into()) }).unwrap(),
            ),
            envelope(3, warm, SANDBOX_EXTENDED, h + 500, to_cbor(&SandboxEnd { ends_at_ms: h + 3000 }).unwrap()),
            envelope(4, warm, SANDBOX_DELETE_REQUESTED, 2 * h + 5, delete()),
        ];
        let (lines, sums) = close_and_recount("sbx_1", &events, 10 * h);
        assert_eq!((sums[RESOURCE_SANDBOX], sums[RESOURCE_VCPU], sums[RESOURCE_MEMORY]), (3000, 6000, 512 * 3000));
        assert!(lines.iter().all(|l| l.sandbox_id.as_deref() == Some("sbx_1") && l.reservation_id.is_empty()));
        assert_eq!(lines[0].seqs, vec![1, 2, 3, 4], "its creation, claim, latest extension and deletion");
        assert!(
            lines.iter().all(|l| l.project_id.as_deref() == Some("proj_1")),
            "a warm sandbox's lines name its claim's project"
        );
        // A claim from before projects (`{endsAtMs}` alone) still decodes: no project.
        let old_claim = to_cbor(&SandboxEnd { ends_at_ms: h + 1000 }).unwrap();
        let old = vec![events[0].clone(), envelope(2, warm, SANDBOX_CLAIMED, h, old_claim), events[3].clone()];
        let (lines, _) = close_and_recount("sbx_1", &old, 10 * h);
        assert!(!lines.is_empty() && lines.iter().all(|l| l.project_id.is_none()));
        let cold = "sandbox/sbx_2";
        let events = vec![
            envelope(1, cold, SANDBOX_CREATED, h - 10, to_cbor(&created(false, Some(5 * h), Some("proj_2"))).unwrap()),
            envelope(2, cold, SANDBOX_DELETE_REQUESTED, h + 20, delete()),
        ];
        let (lines, sums) = close_and_recount("sbx_2", &events, 10 * h);
        assert_eq!(sums[RESOURCE_SANDBOX], 30);
        assert_eq!(lines.len(), 6, "two windows, three kinds");
        assert!(lines.iter().all(|l| l.project_id.as_deref() == Some("proj_2")), "a cold sandbox's lines name its project");
    }

    #[test]
    fn a_line_takes_the_price_of_its_window_start_and_keeps_it() {
        let mut ledger = UsageLedger::default();
        let p = ReservationActivated { node_id: "node_1".into(), gpus: vec![0, 1], ends_at_ms: 10 * HOUR_MS, hold: None };
        ledger.activated("rsv_1", 5, HOUR_MS / 2, &p);
        let details = BTreeMap::from([(
            "rsv_1".to_owned(),
            UsageDetail {
                pool_id: "pool_1".into(),
                sku: "H100".into(),
                request_seq: 4,
                holder_tenant_id: None,
                project_id: Some("proj_1".into()),
            },
        )]);
        let period = |from_ms, micros, seq| PricePeriod { from_ms, currency: "USD".into(), gpu_hour_micros: micros, seq };
        let mut prices = BTreeMap::from([(
            "H100".to_owned(),
            UsagePriceDoc { sku: "H100".into(), periods: vec![period(0, 2_000_000, 1)], version: 1 },
        )]);
        let input = UsageCloseInput {
            ledger: &ledger,
            now_ms: HOUR_MS + 1,
            window_ms: HOUR_MS,
            grace_ms: 0,
            details: &details,
            prices: &prices,
        };
        let close = usage_close(&input);
        let line = &close.events[0].lines()[0];
        assert_eq!((line.quantity_ms, line.cost_micros, line.seqs.clone()), (HOUR_MS as i64, 2_000_000, vec![4, 5]));
        assert_eq!(line.project_id.as_deref(), Some("proj_1"), "a reservation's line names its request's project");
        close.events[0].fold(&mut ledger);
        // A new price from before the window: the closed line keeps its cost; the next window
        // takes the new one.
        prices.get_mut("H100").unwrap().periods.push(period(HOUR_MS / 4, 3_000_000, 2));
        ledger.ended("rsv_1", 9, 2 * HOUR_MS, false);
        let input = UsageCloseInput {
            ledger: &ledger,
            now_ms: 3 * HOUR_MS,
            window_ms: HOUR_MS,
            grace_ms: 0,
            details: &details,
            prices: &prices,
        };
        let close = usage_close(&input);
        assert_eq!(close.events.len(), 1, "{close:?}");
        let line = &close.events[0].lines()[0];
        assert_eq!((line.window_start_ms, line.cost_micros, line.seqs.clone()), (HOUR_MS, 6_000_000, vec![4, 5, 9]));
        assert_eq!(cost_micros(-1_800_000, 3), -2, "rounded half away from zero");
    }

    /// A reservation held for another tenant (in a pool the chain's tenant offered it) is
    /// counted on the chain it lives on, every line marked with its holder, corrections too:
    /// it is the holder's usage, not the chain's; an unmarked line is the chain's own.
    #[test]
    fn lines_of_a_held_reservation_are_its_holders_usage() {
        const OWNER: &str = "ten_owner";
        const HOLDER: &str = "ten_holder";
        let mut ledger = UsageLedger::default();
        let p = ReservationActivated { node_id: "node_1".into(), gpus: vec![0], ends_at_ms: 10 * HOUR_MS, hold: None };
        ledger.activated("rsv_held", 5, HOUR_MS / 2, &p);
        ledger.activated("rsv_own", 6, HOUR_MS / 2, &p);
        let detail = |holder: Option<&str>| UsageDetail {
            pool_id: "pool_1".into(),
            sku: "H100".into(),
            request_seq: 4,
            holder_tenant_id: holder.map(str::to_owned),
            project_id: None,
        };
        let details = BTreeMap::from([("rsv_held".to_owned(), detail(Some(HOLDER))), ("rsv_own".to_owned(), detail(None))]);
        let prices = BTreeMap::new();
        let input = UsageCloseInput {
            ledger: &ledger,
            now_ms: HOUR_MS + 1,
            window_ms: HOUR_MS,
            grace_ms: 0,
            details: &details,
            prices: &prices,
        };
        let close = usage_close(&input);
        let lines = close.events[0].lines();
        let of = |id: &str| lines.iter().find(|l| l.reservation_id == id).unwrap();
        assert_eq!(of("rsv_held").holder_tenant_id.as_deref(), Some(HOLDER));
        assert!(of("rsv_held").is_usage_of(HOLDER, OWNER) && !of("rsv_held").is_usage_of(OWNER, OWNER));
        assert!(of("rsv_own").is_usage_of(OWNER, OWNER) && !of("rsv_own").is_usage_of(HOLDER, OWNER));
        // Its end, learnt after the window closed: the correction is the holder's too.
        close.events[0].fold(&mut ledger);
        ledger.ended("rsv_held", 9, HOUR_MS / 2 + 1000, false);
        let input = UsageCloseInput {
            ledger: &ledger,
            now_ms: HOUR_MS + 2,
            window_ms: HOUR_MS,
            grace_ms: 0,
            details: &details,
            prices: &prices,
        };
        let close = usage_close(&input);
        let corrections: Vec<&UsageLine> = close.events.iter().flat_map(|e| e.lines()).filter(|l| l.quantity_ms < 0).collect();
        assert!(!corrections.is_empty(), "{close:?}");
        assert!(corrections.iter().all(|l| l.holder_tenant_id.as_deref() == Some(HOLDER)), "{corrections:?}");
    }
}
