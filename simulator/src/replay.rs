//! Replaying an export: read it one record at a time, verify every record (the chain's links,
//! the hashes, the signatures under the keys the caller's pin vouches for), and fold the events
//! up to a seq into projection rows in memory with the real fold
//! (`bc_core::store::fold_projections` over `bc_projections::Projections`).
//!
//! Verification is `bc_core::chain::ChainVerifier`'s, resumed at the file's first seq; trust
//! is the pin's: a key of the file is used only when its pin is the one given, or when a key
//! rotation proved from such a key (`bc_core::audit::follow_rotations`) names it.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;

use bc_core::canonical;
use bc_core::chain::ChainVerifier;
use bc_core::event::{Envelope, EventRow, StoredEvent};
use bc_core::id::TenantId;
use bc_core::keys::KeyRing;
use bc_core::store::{Projector, RowKey, fold_projections, touched_rows};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::format::{HEADER_BYTES_MAX, Header, RECORD_BYTES_MAX, Record, read_item};
use crate::timeline::{MarkKind, Sample, Timeline};

/// Events folded at once: the fold's batch, bounded like a page of the store.
pub const FOLD_EVENTS_MAX: usize = bc_core::store::READ_ROWS_MAX as usize;

/// Why a file was refused. `code` is stable; `seq` is the first record that does not verify.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayError {
    pub code: &'static str,
    pub seq: Option<u64>,
    pub message: String,
}

/// The file is not an export (not a CBOR sequence, another format or version, a bad field).
pub const EXPORT_MALFORMED: &str = "EXPORT_MALFORMED";
/// No key of the file is vouched for by the pin.
pub const EXPORT_UNTRUSTED_KEY: &str = "EXPORT_UNTRUSTED_KEY";
/// A record does not verify: its hash, its link, its signature, its place in the chain.
pub const EXPORT_TAMPERED: &str = "EXPORT_TAMPERED";
/// The file ends before the last record its header announces.
pub const EXPORT_TRUNCATED: &str = "EXPORT_TRUNCATED";
/// The file verifies but cannot rebuild state: it does not start at seq 1.
pub const REPLAY_PARTIAL_FILE: &str = "REPLAY_PARTIAL_FILE";
/// `--until` names no seq of the file.
pub const REPLAY_UNTIL_OUTSIDE: &str = "REPLAY_UNTIL_OUTSIDE";
/// An event verified but the projections refused it (a log the fold cannot read).
pub const REPLAY_FOLD_FAILED: &str = "REPLAY_FOLD_FAILED";

impl ReplayError {
    fn new(code: &'static str, seq: Option<u64>, message: impl Into<String>) -> Self {
        Self { code, seq, message: message.into() }
    }
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seq {
            Some(seq) => write!(f, "seq {seq}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// The state rebuilt from a verified file.
#[derive(Clone, Debug)]
pub struct Replayed {
    pub header: Header,
    /// Records verified: every record of the file, whatever `until`.
    pub events_verified: u64,
    /// The seq the state is at (`until`, or the file's last).
    pub at_seq: u64,
    /// The keys that signed the file's records, in first-use order.
    pub key_ids: Vec<String>,
    /// The projection rows of the tenant at `at_seq`, by `(kind, id)`.
    pub rows: BTreeMap<(String, String), Value>,
    /// The series over the log's time, the whole file's, when [`replay_recorded`] was asked.
    pub timeline: Option<Timeline>,
}

impl Replayed {
    /// SHA-256 of [`rows_json`] in canonical JSON ([`canonical_json`]), hex.
    pub fn digest(&self) -> String {
        hex::encode(Sha256::digest(canonical_json(&self.rows_json()).as_bytes()))
    }

    /// The rows as `[{kind, id, doc}]`, sorted by `(kind, id)`.
    pub fn rows_json(&self) -> Value {
        Value::Array(
            self.rows.iter().map(|((kind, id), doc)| serde_json::json!({ "kind": kind, "id": id, "doc": doc })).collect(),
        )
    }

    /// Rows per kind.
    pub fn counts(&self) -> BTreeMap<String, u64> {
        let mut counts = BTreeMap::new();
        for (kind, _) in self.rows.keys() {
            *counts.entry(kind.clone()).or_insert(0) += 1;
        }
        counts
    }
}

/// Verifies the export read from `reader` against `pin` (`sha256/…`, the log key's) and folds
/// its events up to `until` (default: the last). Reads one record at a time.
pub fn replay(reader: &mut impl Read, pin: &str, until: Option<u64>) -> Result<Replayed, ReplayError> {
    replay_observed(reader, pin, until, false, &mut |_| {})
}

/// [`replay`] (or [`replay_recorded`], with `record`), handing `observe` every event of the
/// file once it verified, in seq order, past `until` too (`sim replay --what-if`).
pub fn replay_observed(
    reader: &mut impl Read,
    pin: &str,
    until: Option<u64>,
    record: bool,
    observe: &mut dyn FnMut(&StoredEvent),
) -> Result<Replayed, ReplayError> {
    let (header, tenant, keys, at_seq) = read_header(reader, pin, until)?;
    let mut verifier = ChainVerifier::resume(tenant, &keys, header.from_seq, header.prev_hash);
    let mut folding = Folding::new(record, until, at_seq, header.to_seq);
    // Verified events a later signature must still cover.
    let mut held: Vec<StoredEvent> = Vec::new();
    let mut next = header.from_seq;
    while let Some(event) = read_record(reader, &header, &keys, pin, &mut verifier, &tenant, next)? {
        next += 1;
        // An event without a signature of its own is held back until the one that covers it
        // verifies (at most 15 later: the verifier refuses an unsigned 16th), so nothing a
        // signature has not vouched for reaches the fold or the caller.
        let signed = !event.sig.is_empty();
        held.push(event);
        if !signed {
            continue;
        }
        for event in held.drain(..) {
            observe(&event);
            folding.take(event)?;
        }
    }
    if let Some(from) = verifier.uncovered_from()
        && next > header.to_seq
    {
        // Every record there, the last ones covered by no signature: stripped.
        return Err(ReplayError::new(EXPORT_TAMPERED, Some(from), bc_core::chain::uncovered(from, header.to_seq)));
    }
    verifier
        .finish(Some((header.to_seq, header.last_hash)))
        .map_err(|p| ReplayError::new(EXPORT_TRUNCATED, Some(p.seq), format!("{} (the header's last seq)", p.what)))?;
    let Folded { state, key_ids, timeline } = folding.finish()?;
    let rows = state.into_iter().map(|(key, doc)| ((key.kind, key.id), doc)).collect();
    Ok(Replayed { events_verified: next - header.from_seq, at_seq, key_ids, rows, header, timeline })
}

/// [`replay`], and the whole file's [`Timeline`] beside the state at `until` (`sim replay
/// --report`): every event is folded, one at a time, past `until` too, and after each one the
/// series are observed from the rows it changed. The state, the digest and the
/// errors are [`replay`]'s.
pub fn replay_recorded(reader: &mut impl Read, pin: &str, until: Option<u64>) -> Result<Replayed, ReplayError> {
    replay_observed(reader, pin, until, true, &mut |_| {})
}

fn malformed(seq: Option<u64>, m: String) -> ReplayError {
    ReplayError::new(EXPORT_MALFORMED, seq, m)
}

/// The file's header, its tenant, the keys `pin` vouches for, and the seq to replay to: the
/// file must start at seq 1 and hold `until`.
fn read_header(reader: &mut impl Read, pin: &str, until: Option<u64>) -> Result<(Header, TenantId, KeyRing, u64), ReplayError> {
    let item = read_item(reader, HEADER_BYTES_MAX).map_err(|e| malformed(None, format!("the header: {e}")))?;
    let item = item.ok_or_else(|| malformed(None, "the file is empty".into()))?;
    let value = canonical::decode_canonical(&item).map_err(|e| malformed(None, format!("the header: {e}")))?;
    let header = Header::from_cbor(value).map_err(|e| malformed(None, e))?;
    let tenant: TenantId = header.tenant.parse().map_err(|e| malformed(None, format!("the header's tenant: {e}")))?;
    let keys = trusted_keys(&header, pin)?;
    if header.from_seq != 1 {
        return Err(ReplayError::new(
            REPLAY_PARTIAL_FILE,
            None,
            format!("the file starts at seq {}, so the state before it is unknown", header.from_seq),
        ));
    }
    let at_seq = until.unwrap_or(header.to_seq);
    if at_seq < header.from_seq || at_seq > header.to_seq {
        return Err(ReplayError::new(
            REPLAY_UNTIL_OUTSIDE,
            None,
            format!("--until {at_seq} is outside the file's seqs {} to {}", header.from_seq, header.to_seq),
        ));
    }
    Ok((header, tenant, keys, at_seq))
}

/// The next record (seq `next`), decoded, signed by a key `keys` holds (if signed) and verified
/// on the chain; `None` at the end of the file.
fn read_record(
    reader: &mut impl Read,
    header: &Header,
    keys: &KeyRing,
    pin: &str,
    verifier: &mut ChainVerifier<'_>,
    tenant: &TenantId,
    next: u64,
) -> Result<Option<StoredEvent>, ReplayError> {
    let item = read_item(reader, RECORD_BYTES_MAX).map_err(|e| malformed(Some(next), format!("the record: {e}")))?;
    let Some(item) = item else { return Ok(None) };
    if next > header.to_seq {
        return Err(ReplayError::new(
            EXPORT_TAMPERED,
            Some(next),
            format!("a record past the header's last seq {}", header.to_seq),
        ));
    }
    let value = canonical::decode_canonical(&item).map_err(|e| malformed(Some(next), format!("the record: {e}")))?;
    let record = Record::from_cbor(value).map_err(|e| malformed(Some(next), e))?;
    if !record.key_id.is_empty() && keys.get(&record.key_id).is_none() {
        return Err(ReplayError::new(
            EXPORT_TAMPERED,
            Some(next),
            format!("signed by {}, a key the pin {pin} does not vouch for (nor a rotation from it)", record.key_id),
        ));
    }
    verify_record(verifier, tenant, record).map(Some)
}

/// The fold of a replay's verified events: the rows, in batches up to `at_seq`; or, recording a
/// timeline, one event at a time to the file's end, the state at `at_seq` kept aside.
struct Folding {
    state: HashMap<RowKey, Value>,
    batch: Vec<StoredEvent>,
    key_ids: Vec<String>,
    recording: Option<(Series, Timeline)>,
    /// With a timeline the fold goes on past `until`; the state at `until` is kept aside.
    at_until: Option<HashMap<RowKey, Value>>,
    until: Option<u64>,
    at_seq: u64,
    to_seq: u64,
}

impl Folding {
    fn new(record: bool, until: Option<u64>, at_seq: u64, to_seq: u64) -> Self {
        Self {
            state: HashMap::new(),
            batch: Vec::new(),
            key_ids: Vec::new(),
            recording: record.then(|| (Series::default(), Timeline::new())),
            at_until: None,
            until,
            at_seq,
            to_seq,
        }
    }

    /// Takes the next verified event: its key id noted, and folded (or batched to be).
    fn take(&mut self, event: StoredEvent) -> Result<(), ReplayError> {
        if !event.key_id.is_empty() && !self.key_ids.contains(&event.key_id) {
            self.key_ids.push(event.key_id.clone());
        }
        if let Some((series, timeline)) = self.recording.as_mut() {
            let seq = event.envelope.seq;
            let at_ms = event.envelope.at_ms;
            let event_type = event.envelope.event_type.clone();
            let changed = fold(&mut self.state, &[event])?;
            timeline.observe(series.observe(at_ms, &event_type, &changed, &self.state));
            if seq == self.at_seq {
                let label = match self.until {
                    Some(_) => format!("--until {seq}: the state replayed"),
                    None => format!("seq {seq}, the file's last: the state replayed"),
                };
                timeline.mark(MarkKind::Until, series.since_first_ms(at_ms), label);
                if seq < self.to_seq {
                    self.at_until = Some(self.state.clone());
                }
            }
        } else if event.envelope.seq <= self.at_seq {
            self.batch.push(event);
            if self.batch.len() == FOLD_EVENTS_MAX {
                fold(&mut self.state, &self.batch)?;
                self.batch.clear();
            }
        }
        Ok(())
    }

    /// What the fold came to.
    fn finish(mut self) -> Result<Folded, ReplayError> {
        fold(&mut self.state, &self.batch)?;
        let state = self.at_until.unwrap_or(self.state);
        Ok(Folded { state, key_ids: self.key_ids, timeline: self.recording.map(|(_, timeline)| timeline) })
    }
}

/// A replay's fold, finished: the state at `at_seq`, the key ids in the order met, and the
/// timeline when recorded.
struct Folded {
    state: HashMap<RowKey, Value>,
    key_ids: Vec<String>,
    timeline: Option<Timeline>,
}

/// Event types that say something went wrong on a node or with a hold: what a replay's
/// "faults" series counts (a log has no injected faults, only what they caused).
pub const FAULT_EVENT_TYPES: &[&str] = &[
    bc_projections::events::NODE_UNREACHABLE,
    bc_projections::events::COMMAND_FAILED,
    bc_projections::events::GPU_HOLD_FAILED,
    bc_projections::events::RESERVATION_FAILED,
    bc_projections::events::INSTANCE_FAILED,
    bc_projections::events::INSTANCE_APPLY_FAILED,
];

/// A replay's series, kept up to date from the rows each event changes (never a scan of the
/// state): each node's GPUs, how many are allocated and whether it is reachable; the queued
/// reservations; the fault events and the records verified so far.
#[derive(Default)]
struct Series {
    nodes: BTreeMap<String, NodeCounts>,
    queued: std::collections::BTreeSet<String>,
    gpus: u64,
    allocated: u64,
    up: u64,
    faults: u64,
    verified: u64,
    first_at_ms: Option<u64>,
}

#[derive(Clone, Copy, Default)]
struct NodeCounts {
    gpus: u64,
    allocated: u64,
    up: bool,
}

impl Series {
    fn since_first_ms(&self, at_ms: u64) -> u64 {
        at_ms.saturating_sub(self.first_at_ms.unwrap_or(at_ms))
    }

    /// After one event (`changed`: the rows it touched, `None` deleted): the sample.
    fn observe(&mut self, at_ms: u64, event_type: &str, changed: &[RowKey], state: &HashMap<RowKey, Value>) -> Sample {
        self.first_at_ms.get_or_insert(at_ms);
        self.verified += 1;
        if FAULT_EVENT_TYPES.contains(&event_type) {
            self.faults += 1;
        }
        for key in changed {
            let doc = state.get(key);
            if key.kind == bc_projections::KIND_NODE {
                let old = self.nodes.remove(&key.id).unwrap_or_default();
                self.gpus -= old.gpus;
                self.allocated -= old.allocated;
                self.up -= u64::from(old.up);
                if let Some(doc) = doc {
                    let count = |field: &str| match &doc[field] {
                        Value::Array(items) => items.len() as u64,
                        Value::Object(items) => items.len() as u64,
                        _ => 0,
                    };
                    let new = NodeCounts {
                        gpus: count("gpus"),
                        allocated: count("allocations"),
                        up: doc["state"].as_str() != Some(bc_projections::NodeState::Unreachable.as_str()),
                    };
                    self.gpus += new.gpus;
                    self.allocated += new.allocated;
                    self.up += u64::from(new.up);
                    self.nodes.insert(key.id.clone(), new);
                }
            } else if key.kind == bc_projections::KIND_RESERVATION {
                let queued = doc.is_some_and(|d| d["state"].as_str() == Some("queued"));
                if queued {
                    self.queued.insert(key.id.clone());
                } else {
                    self.queued.remove(&key.id);
                }
            }
        }
        Sample {
            at_ms: self.since_first_ms(at_ms),
            gpu_utilization: self.allocated as f64 / self.gpus.max(1) as f64,
            queue_depth: self.queued.len() as u64,
            nodes_up: self.up,
            faults: self.faults,
            checks: self.verified,
        }
    }
}

/// The keys `pin` vouches for among the file's: its own, and those a proved rotation from it
/// names. None is refused: the file is not the pinned log's.
fn trusted_keys(header: &Header, pin: &str) -> Result<KeyRing, ReplayError> {
    let malformed = |m: String| ReplayError::new(EXPORT_MALFORMED, None, m);
    let mut publics = Vec::new();
    for (key_id, public) in &header.keys {
        let public = bc_core::keys::stored_public_key(key_id, public).map_err(|e| malformed(format!("the header: {e}")))?;
        if bc_core::keys::pin_of(&public) == pin {
            publics.push(public);
        }
    }
    let rotations =
        bc_core::note::parse_rotations(&header.rotations).map_err(|e| malformed(format!("the header's rotations: {e}")))?;
    let publics = bc_core::audit::follow_rotations(&rotations, &[pin.to_owned()], &publics)
        .map_err(|e| ReplayError::new(EXPORT_UNTRUSTED_KEY, None, format!("the header's rotations: {e}")))?;
    if publics.is_empty() {
        let ids: Vec<&str> = header.keys.iter().map(|(id, _)| id.as_str()).collect();
        return Err(ReplayError::new(
            EXPORT_UNTRUSTED_KEY,
            None,
            format!("no key of the file has the pin {pin} (the file names {})", ids.join(", ")),
        ));
    }
    let mut keys = KeyRing::default();
    for public in publics {
        keys.insert(public);
    }
    Ok(keys)
}

/// One record through the chain verifier, as the row a store would hold.
fn verify_record(verifier: &mut ChainVerifier<'_>, tenant: &TenantId, record: Record) -> Result<StoredEvent, ReplayError> {
    let seq = record.seq;
    let tampered = |what: String| ReplayError::new(EXPORT_TAMPERED, Some(seq), what);
    let index = u32::try_from(record.index).map_err(|_| tampered("the record's index is past 32 bits".into()))?;
    // The columns a store keeps beside the bytes, from the bytes: the verifier compares them
    // with the envelope it decodes again, and reports an envelope that does not decode.
    let envelope = Envelope::from_canonical(&record.event).ok();
    let row = EventRow {
        tenant: tenant.to_string(),
        seq,
        id: envelope.as_ref().map(|e| e.id.to_string()).unwrap_or_default(),
        stream: envelope.as_ref().map(|e| e.stream.clone()).unwrap_or_default(),
        version: envelope.as_ref().map_or(0, |e| e.version),
        event_type: envelope.as_ref().map(|e| e.event_type.clone()).unwrap_or_default(),
        commit: record.commit,
        index,
        canonical: record.event,
        hash: record.hash,
        sig: record.sig,
        key_id: record.key_id,
    };
    let event = verifier.push(row).map_err(|p| ReplayError::new(EXPORT_TAMPERED, Some(p.seq), p.what))?;
    if record.prev != event.envelope.prev {
        return Err(tampered("the record's prev differs from its envelope's".into()));
    }
    Ok(event)
}

/// Folds `batch` into `state` with the real fold: the rows it touches, taken out, folded,
/// put back (a `None` deletes). Returns the rows it touched.
fn fold(state: &mut HashMap<RowKey, Value>, batch: &[StoredEvent]) -> Result<Vec<RowKey>, ReplayError> {
    let projector: &dyn Projector = &bc_projections::Projections;
    let current = touched_rows(projector, batch).into_iter().filter_map(|k| state.remove_entry(&k)).collect();
    let folded = fold_projections(projector, batch, current).map_err(|e| {
        let seq = match &e {
            bc_core::Error::Corrupt { seq, .. } => Some(*seq),
            _ => None,
        };
        ReplayError::new(REPLAY_FOLD_FAILED, seq, e.to_string())
    })?;
    let mut touched = Vec::with_capacity(folded.len());
    for (key, doc) in folded {
        if let Some(doc) = doc {
            state.insert(key.clone(), doc);
        }
        touched.push(key);
    }
    Ok(touched)
}

/// JSON with every object's keys sorted by their UTF-8 bytes and no whitespace; strings and
/// numbers as `serde_json` writes them. The digest's input, so two builds agree whatever
/// order their maps keep.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}
