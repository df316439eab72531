//! Proving usage rows: `usage export --with-proofs` writes, beside the export, the inclusion
//! proof of every event its rows name; `usage verify` checks each row offline with nothing but
//! the two files and the log key's pin (`docs/usage.md`, "Proving a row").
//!
//! Nothing here hashes a tree or opens a note by itself: the proofs are built with
//! `bc_core::merkle` from the tenant's served tiles (`GET /audit/{tenant}/…`, as `audit follow`
//! reads them) and are the files `audit check-proof` reads; `usage verify` checks each with
//! `bc_core::audit::check_proof`, and recounts each row with the server's own pure functions
//! (`bc_projections::decide::usage::{recount_activation, check_line, window_total_ms}`).
//!
//! The proofs file is JSON lines: a header `{format, tenantId, treeSize, proved, unproved}`, then
//! one line per event, `{seq, proof}` (`proof`: the `audit check-proof` file, verbatim) or
//! `{seq, unproved}` (why there is no proof: no checkpoint covered it yet).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, Read, Write};
use std::path::Path;

use bc_core::event::Envelope;
use bc_core::merkle::{self, Hash};
use bc_core::note::{self, CheckpointBody, ProofFile, Vkey};
use bc_core::tiles::{self, TILE_WIDTH, TilePath, TileRef};
use bc_projections::decide::usage::{check_line, check_origin, recount_activation, window_total_ms};
use bc_projections::usage::{USAGE_CORRECTION, USAGE_WINDOW_CLOSED, UsageCorrection, UsageLine, UsageWindowClosed};
use serde_json::{Value, json};

use crate::client::CliError;

/// The first line of a proofs file names its format.
pub const PROOFS_FORMAT: &str = "better-compute-usage-proofs/1";
/// Longest line of a proofs file or an export `usage verify` reads (a proof is a few KiB).
const VERIFY_LINE_BYTES_MAX: usize = 1 << 20;
/// Failures and unproved rows listed in a verdict; past that, only counted.
const VERDICT_ROWS_MAX: usize = 100;

/// The seqs a usage row names: its usage event's and its source events'.
pub fn row_seqs(row: &Value, out: &mut BTreeSet<u64>) {
    out.extend(row.get("eventSeq").and_then(Value::as_u64));
    out.extend(row.get("seqs").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_u64));
}

/// What [`write_proofs`] wrote.
pub struct ProofsWritten {
    pub tree_size: u64,
    pub proved: u64,
    pub unproved: u64,
}

/// Writes the proofs of `seqs` (the tenant's events the exported rows name) against the
/// tenant's newest checkpoint: the checkpoint, the keys and rotations, every entry bundle of the
/// tree (its leaves, 32 bytes each, to build the paths with `merkle::inclusion_proof`), and the
/// event bundles holding the events. Seqs past the checkpoint get an `unproved` line saying why.
pub async fn write_proofs(
    url: &str,
    tenant: &str,
    seqs: &BTreeSet<u64>,
    out: &mut impl Write,
) -> Result<ProofsWritten, CliError> {
    let werr = |e: std::io::Error| CliError::new("INTERNAL", format!("writing the proofs: {e}"));
    let bad = |what: String| CliError::new("INVALID_RESPONSE", format!("tenant {tenant}: {what}"));
    let f = crate::follow::Fetcher::new(url, tenant)?;
    let Some(note_bytes) = f.get("checkpoint").await? else {
        let why = format!("no checkpoint of tenant {tenant} was sealed yet");
        return write_unproved_only(tenant, seqs, &why, out).map_err(werr);
    };
    let note_text = String::from_utf8(note_bytes).map_err(|_| bad("the checkpoint is not UTF-8".into()))?;
    let keys = f.get("keys").await?.unwrap_or_default();
    let (signer, body) = String::from_utf8_lossy(&keys)
        .lines()
        .filter_map(|line| Vkey::parse(line).ok())
        .find_map(|v| note::open_note(&note_text, &v).ok().and_then(|text| CheckpointBody::parse(&text).ok()).map(|b| (v, b)))
        .ok_or_else(|| bad("the checkpoint is signed by none of the keys the server lists".into()))?;
    let rotations = match f.get("rotations").await? {
        Some(bytes) => note::parse_rotations(&bytes).map_err(bad)?,
        None => Vec::new(),
    };
    let size = body.size;
    let mut leaves: Vec<Hash> = Vec::with_capacity(size as usize);
    let mut event_hashes: Vec<Hash> = Vec::with_capacity(size as usize);
    for n in 0..size.div_ceil(TILE_WIDTH) {
        let t = TileRef { index: n, width: TILE_WIDTH.min(size - n * TILE_WIDTH) };
        let entries = tiles::parse_entry_bundle(&f.must(&tiles::tile_path(TilePath::Entries(t))).await?).map_err(bad)?;
        if entries.len() as u64 != t.width {
            return Err(bad(format!("entry bundle {n} holds {} entries, not {}", entries.len(), t.width)));
        }
        for e in entries {
            let hash = <Hash>::try_from(e.as_slice()).map_err(|_| bad(format!("an entry of bundle {n} is not 32 bytes")))?;
            leaves.push(merkle::leaf_hash(&hash));
            event_hashes.push(hash);
        }
    }
    if merkle::root(&leaves) != body.root {
        return Err(bad(format!("the served entries do not give the checkpoint's root (size {size})")));
    }
    let (covered, later): (Vec<u64>, Vec<u64>) = seqs.iter().partition(|s| **s >= 1 && **s <= size);
    let header = json!({
        "format": PROOFS_FORMAT,
        "tenantId": tenant,
        "treeSize": size,
        "proved": covered.len(),
        "unproved": later.len(),
    });
    writeln!(out, "{header}").map_err(werr)?;
    let vkey = signer.encode();
    let mut bundle: Option<(u64, Vec<tiles::BundledEvent>)> = None;
    for seq in &covered {
        let index = seq - 1;
        let n = index / TILE_WIDTH;
        if bundle.as_ref().is_none_or(|(m, _)| *m != n) {
            let t = TileRef { index: n, width: TILE_WIDTH.min(size - n * TILE_WIDTH) };
            let events = tiles::parse_event_bundle(&f.must(&tiles::tile_path(TilePath::Events(t))).await?).map_err(bad)?;
            bundle = Some((n, events));
        }
        let events = &bundle.as_ref().expect("fetched above").1;
        let event = events.get((index % TILE_WIDTH) as usize).ok_or_else(|| bad(format!("event bundle {n} is short")))?;
        if bc_core::event::sha256(&event.canonical) != event_hashes[index as usize] {
            return Err(bad(format!("the served event of seq {seq} does not hash to its leaf")));
        }
        let path = merkle::inclusion_proof(index, &leaves).expect("the seq is within the checkpoint");
        let proof = ProofFile {
            event: event.canonical.clone(),
            vkey: vkey.clone(),
            index,
            path,
            checkpoint: note_text.clone(),
            rotations: rotations.clone(),
        };
        writeln!(out, "{}", json!({ "seq": seq, "proof": proof.encode() })).map_err(werr)?;
    }
    for seq in &later {
        let why = format!(
            "no checkpoint covers seq {seq} yet: the newest is of size {size}; export again once the next is sealed (`audit checkpoint`, or the server's --checkpoint-interval)"
        );
        writeln!(out, "{}", json!({ "seq": seq, "unproved": why })).map_err(werr)?;
    }
    Ok(ProofsWritten { tree_size: size, proved: covered.len() as u64, unproved: later.len() as u64 })
}

fn write_unproved_only(tenant: &str, seqs: &BTreeSet<u64>, why: &str, out: &mut impl Write) -> std::io::Result<ProofsWritten> {
    let header = json!({ "format": PROOFS_FORMAT, "tenantId": tenant, "treeSize": 0, "proved": 0, "unproved": seqs.len() });
    writeln!(out, "{header}")?;
    for seq in seqs {
        writeln!(out, "{}", json!({ "seq": seq, "unproved": why }))?;
    }
    Ok(ProofsWritten { tree_size: 0, proved: 0, unproved: seqs.len() as u64 })
}

/// What the proofs file says of each event.
#[derive(Default)]
struct Proofs {
    proved: BTreeMap<u64, Envelope>,
    unproved: BTreeMap<u64, String>,
    /// Proofs that do not verify, and why.
    bad: BTreeMap<u64, String>,
    /// The checkpoint every proof is in: origin, size, root.
    tree: Option<(String, u64, [u8; 32])>,
    key_id: String,
}

impl Proofs {
    /// The event of `seq`, or why the row naming it is unproved (`Ok(Err)`) or fails (`Err`).
    fn event(&self, seq: u64, what: &str) -> Result<Result<&Envelope, String>, String> {
        if let Some(env) = self.proved.get(&seq) {
            return Ok(Ok(env));
        }
        if let Some(why) = self.bad.get(&seq) {
            return Err(format!("the proof of {what} (seq {seq}) does not verify: {why}"));
        }
        if let Some(why) = self.unproved.get(&seq) {
            return Ok(Err(format!("{what} (seq {seq}) is not proved: {why}")));
        }
        Err(format!("the proofs file holds nothing for {what} (seq {seq})"))
    }
}

/// Lines of a text file, each at most [`VERIFY_LINE_BYTES_MAX`].
fn lines_of(path: &Path) -> Result<impl Iterator<Item = Result<String, CliError>>, CliError> {
    let file = std::fs::File::open(path).map_err(|e| CliError::usage(format!("cannot read {}: {e}", path.display())))?;
    let name = path.display().to_string();
    let mut reader = std::io::BufReader::new(file);
    let mut number = 0u64;
    Ok(std::iter::from_fn(move || {
        let mut line = String::new();
        number += 1;
        match (&mut reader).take(VERIFY_LINE_BYTES_MAX as u64 + 1).read_line(&mut line) {
            Ok(0) => None,
            Ok(_) if line.len() > VERIFY_LINE_BYTES_MAX => Some(Err(CliError::new(
                "INVALID_PROOF",
                format!("{name}: line {number} is longer than {VERIFY_LINE_BYTES_MAX} bytes"),
            ))),
            Ok(_) => Some(Ok(line.trim_end_matches(['\n', '\r']).to_owned())),
            Err(e) => Some(Err(CliError::new("INVALID_PROOF", format!("{name}: line {number}: {e}")))),
        }
    }))
}

fn read_proofs(path: &Path, pins: &[String], vkeys: &[Vkey]) -> Result<Proofs, CliError> {
    let invalid = |m: String| CliError::new("INVALID_PROOF", format!("{}: {m}", path.display()));
    let mut lines = lines_of(path)?;
    let header: Value = match lines.next() {
        Some(line) => serde_json::from_str(&line?).map_err(|e| invalid(format!("the header does not parse: {e}")))?,
        None => return Err(invalid("empty".into())),
    };
    if header["format"] != PROOFS_FORMAT {
        return Err(invalid(format!("not a {PROOFS_FORMAT} file")));
    }
    let mut proofs = Proofs::default();
    for (n, line) in lines.enumerate() {
        let entry: Value = serde_json::from_str(&line?).map_err(|e| invalid(format!("line {} does not parse: {e}", n + 2)))?;
        let seq = entry["seq"].as_u64().ok_or_else(|| invalid(format!("line {} has no seq", n + 2)))?;
        if let Some(why) = entry["unproved"].as_str() {
            proofs.unproved.insert(seq, why.to_owned());
            continue;
        }
        let text = entry["proof"].as_str().ok_or_else(|| invalid(format!("line {} has neither proof nor unproved", n + 2)))?;
        match bc_core::audit::check_proof(text, None, None, pins, vkeys) {
            Err(why) => {
                proofs.bad.insert(seq, why);
            }
            Ok(p) if p.event.seq != seq => {
                proofs.bad.insert(seq, format!("it proves the event of seq {}", p.event.seq));
            }
            Ok(p) => {
                let tree = (p.origin.clone(), p.tree_size, p.root);
                match &proofs.tree {
                    None => {
                        proofs.tree = Some(tree);
                        proofs.key_id = p.key_id.clone();
                    }
                    Some(first) if *first != tree => {
                        proofs.bad.insert(
                            seq,
                            format!("it is in another tree ({} of size {}) than the file's first proof", tree.0, tree.1),
                        );
                        continue;
                    }
                    Some(_) => {}
                }
                proofs.proved.insert(seq, p.event);
            }
        }
    }
    Ok(proofs)
}

/// The lines of a proved usage event, and whether it closes a window.
fn usage_lines(env: &Envelope) -> Result<(bool, Vec<UsageLine>), String> {
    let json = bc_core::canonical::to_json(&env.payload);
    let bad = |e: serde_json::Error| format!("the usage event (seq {}) does not parse: {e}", env.seq);
    match env.event_type.as_str() {
        USAGE_WINDOW_CLOSED => Ok((true, serde_json::from_value::<UsageWindowClosed>(json).map_err(bad)?.lines)),
        USAGE_CORRECTION => Ok((false, serde_json::from_value::<UsageCorrection>(json).map_err(bad)?.lines)),
        other => Err(format!("seq {} is a {other}, not a usage event", env.seq)),
    }
}

/// A row as `usage.list` answers it, made from the signed usage event: what the export's line
/// must have been written from.
fn row_view(env: &Envelope, closed: bool, index: usize, line: &UsageLine) -> Value {
    let mut row = serde_json::to_value(line).expect("a usage line is JSON");
    row["kind"] = json!(if closed { "usage" } else { "correction" });
    row["eventSeq"] = json!(env.seq);
    row["line"] = json!(index);
    row["recordedAtMs"] = json!(env.at_ms);
    row
}

/// The fields of one CSV line (RFC 4180 quoting, as the export writes it).
fn csv_fields(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted, mut chars) = (Vec::new(), String::new(), false, line.chars().peekable());
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', true) => quoted = false,
            ('"', false) if field.is_empty() => quoted = true,
            (',', false) => fields.push(std::mem::take(&mut field)),
            (c, _) => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// One row of the export, as read.
enum Written {
    Csv(Vec<String>),
    Json(Value),
}

impl Written {
    /// Its usage event's seq and line, as the row says.
    fn place(&self) -> Option<(u64, usize)> {
        match self {
            Self::Csv(fields) => {
                let at = |name: &str| super::FOCUS_COLUMNS.iter().position(|c| *c == name).and_then(|i| fields.get(i));
                Some((at("x_EventSeq")?.parse().ok()?, at("x_EventLine")?.parse().ok()?))
            }
            Self::Json(v) => Some((v["data"]["eventSeq"].as_u64()?, v["data"]["line"].as_u64()? as usize)),
        }
    }

    /// How the row differs from `expected` (the same line written from the signed event).
    fn differences(&self, env: &Envelope, closed: bool, index: usize, line: &UsageLine) -> Vec<String> {
        let tenant = env.tenant.to_string();
        let view = row_view(env, closed, index, line);
        match self {
            Self::Csv(fields) => {
                // A row without a price carries the export's --currency, which no event says.
                let currency_at = super::FOCUS_COLUMNS.iter().position(|c| *c == "BillingCurrency").expect("a column");
                let currency = fields.get(currency_at).map(String::as_str).unwrap_or("USD");
                let expected = csv_fields(&super::focus_row(&view, &tenant, currency));
                super::FOCUS_COLUMNS
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| fields.get(*i) != expected.get(*i))
                    .map(|(i, name)| {
                        format!(
                            "{name} is {:?} in the file, the signed usage event gives {:?}",
                            fields.get(i).map(String::as_str).unwrap_or(""),
                            expected[i]
                        )
                    })
                    .collect()
            }
            Self::Json(v) => {
                let expected = super::cloud_event(&view, &tenant);
                let mut out = Vec::new();
                let keys: BTreeSet<&String> =
                    expected.as_object().into_iter().chain(v.as_object()).flat_map(|m| m.keys()).collect();
                for key in keys {
                    if key == "data" {
                        let (got, want) = (&v["data"], &expected["data"]);
                        let names: BTreeSet<&String> =
                            want.as_object().into_iter().chain(got.as_object()).flat_map(|m| m.keys()).collect();
                        for name in names.into_iter().filter(|n| got[n.as_str()] != want[n.as_str()]) {
                            out.push(format!(
                                "data.{name} is {} in the file, the signed usage event gives {}",
                                got[name.as_str()],
                                want[name.as_str()]
                            ));
                        }
                    } else if v[key.as_str()] != expected[key.as_str()] {
                        out.push(format!(
                            "{key} is {} in the file, the signed usage event gives {}",
                            v[key.as_str()],
                            expected[key.as_str()]
                        ));
                    }
                }
                out
            }
        }
    }
}

/// A window's rows of one activation (or span) and resource kind: together they must add up to
/// what it held there.
#[derive(Default)]
struct Group {
    rows: Vec<u64>,
    /// The first row's line: what the recount reads of the group (its subject, its kind).
    line: Option<UsageLine>,
    quantity_ms: i64,
    /// The seqs its rows name, sorted, once each (a handful: memory stays a few dozen bytes a
    /// row, since a window's rows are held until the file ends).
    seqs: Vec<u64>,
}

/// What `usage verify` found.
#[derive(Default)]
struct Verdict {
    rows: u64,
    proved: u64,
    failed: Vec<Value>,
    failed_count: u64,
    unproved: Vec<Value>,
    unproved_count: u64,
}

impl Verdict {
    fn fail(&mut self, row: u64, place: Option<(u64, usize)>, why: String) {
        self.failed_count += 1;
        if self.failed.len() < VERDICT_ROWS_MAX {
            self.failed.push(json!({ "row": row, "eventSeq": place.map(|p| p.0), "line": place.map(|p| p.1), "why": why }));
        }
    }

    fn unprove(&mut self, row: u64, place: (u64, usize), why: String) {
        self.unproved_count += 1;
        if self.unproved.len() < VERDICT_ROWS_MAX {
            self.unproved.push(json!({ "row": row, "eventSeq": place.0, "line": place.1, "why": why }));
        }
    }
}

/// `usage verify`: checks every row of `export` against `proofs`, offline, trusting only `pins`
/// and `vkeys`. A row is proved when its usage event and the reservation events it names are in
/// a checkpoint the trusted key signed, the row is exactly what that usage event's line says, and
/// the line's quantity is what those events give (`check_line`); the rows of one activation in
/// one window must add up to what it held there (`window_total_ms`), so a row repeated or left
/// out shows. Fails `INVALID_PROOF` naming each row and why; `USAGE_UNPROVED` when every row
/// checked but some had no proof (no checkpoint covered them at export time).
pub fn verify(export: &Path, proofs_path: &Path, pins: &[String], vkeys: &[String]) -> Result<Value, CliError> {
    if pins.is_empty() && vkeys.is_empty() {
        return Err(CliError::usage("give --pin PIN (or BETTER_COMPUTE_AUDIT_PIN) or --vkey VKEY: the key you trust"));
    }
    if let Some(pin) = pins.iter().find(|p| !p.starts_with("sha256/")) {
        return Err(CliError::usage(format!("--pin {pin:?} is not sha256/…")));
    }
    let vkeys: Vec<Vkey> =
        vkeys.iter().map(|v| Vkey::parse(v).map_err(|e| CliError::usage(format!("--vkey: {e}")))).collect::<Result<_, _>>()?;
    let proofs = read_proofs(proofs_path, pins, &vkeys)?;
    let mut verdict = Verdict::default();
    let mut seen: BTreeMap<(u64, usize), u64> = BTreeMap::new();
    let mut groups = Groups::new();
    let mut lines = lines_of(export)?;
    let first = lines.next().transpose()?.unwrap_or_default();
    let csv = first == super::FOCUS_COLUMNS.join(",");
    let mut pending = (!csv && !first.is_empty()).then_some(first);
    loop {
        let text = match pending.take() {
            Some(t) => t,
            None => match lines.next() {
                Some(t) => t?,
                None => break,
            },
        };
        if text.is_empty() {
            continue;
        }
        verdict.rows += 1;
        let row = verdict.rows;
        let written = if csv {
            Written::Csv(csv_fields(&text))
        } else {
            match serde_json::from_str(&text) {
                Ok(v) => Written::Json(v),
                Err(e) => {
                    verdict.fail(row, None, format!("the line is not JSON: {e}"));
                    continue;
                }
            }
        };
        let Some(place) = written.place() else {
            verdict.fail(row, None, "the row names no usage event (x_EventSeq/x_EventLine, data.eventSeq/line)".into());
            continue;
        };
        if let Some(earlier) = seen.insert(place, row) {
            verdict.fail(row, Some(place), format!("it repeats row {earlier}: a usage line is billed once"));
            continue;
        }
        match check_row(&proofs, &written, place) {
            Err(why) => verdict.fail(row, Some(place), why),
            Ok(Err(why)) => verdict.unprove(row, place, why),
            Ok(Ok(line)) => {
                verdict.proved += 1;
                let key = (
                    line.subject_id().to_owned(),
                    line.activation_seq,
                    line.resource_kind.clone(),
                    line.window_start_ms,
                    line.window_end_ms,
                );
                let group = groups.entry(key).or_default();
                group.rows.push(row);
                group.line.get_or_insert_with(|| line.clone());
                group.quantity_ms += line.quantity_ms;
                group.seqs.extend(&line.seqs);
                group.seqs.sort_unstable();
                group.seqs.dedup();
            }
        }
    }
    check_groups(groups, &proofs, &mut verdict);
    let (origin, size, root) = proofs.tree.clone().unwrap_or_default();
    let summary = json!({
        "ok": verdict.failed_count == 0 && verdict.unproved_count == 0,
        "rows": verdict.rows,
        "proved": verdict.proved,
        "failed": verdict.failed_count,
        "unproved": verdict.unproved_count,
        "events": proofs.proved.len(),
        "origin": origin,
        "treeSize": size,
        "root": root.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        "keyId": proofs.key_id,
        "consistency": "NOT CHECKED: the rows are in a tree the key signed; `audit check-proof --saved` on one of the proofs checks it extends a checkpoint you saved",
        "failures": verdict.failed,
        "unprovedRows": verdict.unproved,
    });
    if verdict.failed_count > 0 {
        let first = &summary["failures"][0];
        let mut e = CliError::new(
            "INVALID_PROOF",
            format!(
                "{} of {} rows fail; first: row {}: {}",
                verdict.failed_count,
                verdict.rows,
                first["row"],
                first["why"].as_str().unwrap_or("")
            ),
        );
        e.details = Some(summary);
        return Err(e);
    }
    if verdict.unproved_count > 0 {
        let first = &summary["unprovedRows"][0];
        let mut e = CliError::new(
            "USAGE_UNPROVED",
            format!(
                "{} of {} rows are not proved; first: row {}: {}",
                verdict.unproved_count,
                verdict.rows,
                first["row"],
                first["why"].as_str().unwrap_or("")
            ),
        )
        .hint("export again with --with-proofs once a checkpoint covers the rows' events");
        e.details = Some(summary);
        return Err(e);
    }
    Ok(summary)
}

/// A window's rows of one activation or span and resource kind (keyed by reservation, instance
/// or sandbox, activation seq, kind and window), which must add up to what it held in the window
/// as the union of their events says.
type Groups = BTreeMap<(String, u64, String, u64, u64), Group>;

/// Checks each window's rows together ([`window_total_ms`]) against the union of the events they
/// name: a row left out whose events another row of the window names (a window's row beside its
/// correction) fails the window's first row. A correction left out with the end it alone names
/// does not show: a proof shows an event is in the log, never that no other is.
fn check_groups(groups: Groups, proofs: &Proofs, verdict: &mut Verdict) {
    for ((subject, activation, kind, ws, we), group) in groups {
        let Some(first) = group.line else { continue };
        // What the recount reads of a line: its subject, its activation, its kind and its seqs.
        let line = UsageLine { from_ms: ws, to_ms: we, quantity_ms: group.quantity_ms, seqs: group.seqs, ..first };
        let events: Vec<&Envelope> = line.seqs.iter().filter_map(|s| proofs.proved.get(s)).collect();
        let total = recount_activation(&line, &events).map(|(t, _)| window_total_ms(&t, &kind, ws, we));
        match total {
            Ok(total) if total == group.quantity_ms => {}
            Ok(total) => {
                let rows: Vec<String> = group.rows.iter().map(u64::to_string).collect();
                let why = format!(
                    "rows {} ({subject}, activation seq {activation}, window [{ws}, {we})) add up to {} {kind}-ms, its events give {total}: a row of the window is missing or altered",
                    rows.join(", "),
                    group.quantity_ms
                );
                verdict.proved -= group.rows.len() as u64;
                verdict.fail(group.rows[0], None, why);
            }
            Err(why) => {
                verdict.proved -= group.rows.len() as u64;
                verdict.fail(group.rows[0], None, why);
            }
        }
    }
}

/// One row: its signed usage line (`Ok(Ok)`), or why it is unproved (`Ok(Err)`) or fails
/// (`Err`).
fn check_row(proofs: &Proofs, written: &Written, (seq, index): (u64, usize)) -> Result<Result<UsageLine, String>, String> {
    let env = match proofs.event(seq, "its usage event")? {
        Ok(env) => env,
        Err(why) => return Ok(Err(why)),
    };
    let (closed, lines) = usage_lines(env)?;
    let line = lines.get(index).ok_or_else(|| format!("the usage event (seq {seq}) has no line {index}"))?;
    let differences = written.differences(env, closed, index, line);
    if !differences.is_empty() {
        return Err(differences.join("; "));
    }
    let mut events = Vec::new();
    for s in &line.seqs {
        match proofs.event(*s, "an event it was computed from")? {
            Ok(e) => events.push(e),
            Err(why) => return Ok(Err(why)),
        }
    }
    if events.iter().any(|e| e.tenant != env.tenant) {
        return Err("an event it was computed from is another tenant's".into());
    }
    let (t, origin) = recount_activation(line, &events)?;
    if let Some(origin) = origin {
        check_origin(line, &origin)?;
    }
    check_line(line, closed, &t).map_err(|why| format!("the quantity does not follow from its events: {why}"))?;
    Ok(Ok(line.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(seq: u64, event_type: &str, at_ms: u64, payload: ciborium::Value) -> Envelope {
        Envelope {
            tenant: bc_core::id::TenantId::ROOT,
            seq,
            id: bc_core::id::EventId::generate(),
            stream: "reservation/rsv_1".into(),
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

    /// A window closed while its reservation ran (2 GPUs, [2000, 4000): 4,000 GPU-ms), then the
    /// expiry at 2,500 taken back by a correction (-3,000): together they are what it held
    /// (1,000). The correction alone fails the window; the window's row alone passes, since the
    /// events it names say nothing of the end (what inclusion proofs cannot show: docs/usage.md).
    #[test]
    fn a_window_whose_correction_is_left_out_fails() {
        use bc_projections::events as ev;
        let requested = ev::ReservationRequested {
            pool_id: "pool_1".into(),
            gpus: 2,
            duration_s: 4,
            selector: String::new(),
            nvlink: false,
            tolerations: vec![],
            project_id: None,
        };
        let activated = ev::ReservationActivated { node_id: "node_1".into(), gpus: vec![0, 1], ends_at_ms: 5000, hold: None };
        let proofs = Proofs {
            proved: BTreeMap::from([
                (1, event(1, ev::RESERVATION_REQUESTED, 900, ev::to_cbor(&requested).unwrap())),
                (2, event(2, ev::RESERVATION_ACTIVATED, 1000, ev::to_cbor(&activated).unwrap())),
                (3, event(3, ev::RESERVATION_EXPIRED, 2500, ev::to_cbor(&ev::ReservationEnded::default()).unwrap())),
            ]),
            ..Proofs::default()
        };
        let key = ("rsv_1".to_owned(), 2, "gpu".to_owned(), 2000, 4000);
        let template = UsageLine {
            window_start_ms: 2000,
            window_end_ms: 4000,
            reservation_id: "rsv_1".into(),
            instance_id: None,
            sandbox_id: None,
            activation_seq: 2,
            pool_id: "pool_1".into(),
            project_id: None,
            sku: "H100".into(),
            resource_kind: "gpu".into(),
            gpus: 2,
            units: None,
            from_ms: 2000,
            to_ms: 4000,
            quantity_ms: 0,
            gpu_hour_micros: None,
            currency: None,
            cost_micros: 0,
            holder_tenant_id: None,
            seqs: vec![],
        };
        let run = |rows: &[(u64, i64, &[u64])]| {
            let mut group = Group { line: Some(template.clone()), ..Group::default() };
            for (row, quantity_ms, seqs) in rows {
                group.rows.push(*row);
                group.quantity_ms += quantity_ms;
                group.seqs.extend(*seqs);
            }
            group.seqs.sort_unstable();
            group.seqs.dedup();
            let mut verdict = Verdict { proved: rows.len() as u64, ..Verdict::default() };
            check_groups(Groups::from([(key.clone(), group)]), &proofs, &mut verdict);
            verdict
        };
        let both = run(&[(1, 4000, &[1, 2]), (2, -3000, &[1, 2, 3])]);
        assert_eq!((both.failed_count, both.proved), (0, 2));
        let without_correction = run(&[(1, 4000, &[1, 2])]);
        assert_eq!(without_correction.failed_count, 0);
        let only_correction = run(&[(2, -3000, &[1, 2, 3])]);
        assert_eq!((only_correction.failed_count, only_correction.proved), (1, 0));
        let why = only_correction.failed[0]["why"].as_str().unwrap();
        assert!(why.contains("add up to -3000 gpu-ms, its events give 1000"), "{why}");
    }

    #[test]
    fn csv_fields_read_what_the_export_writes() {
        assert_eq!(csv_fields("a,\"b,\"\"c\"\"\",,d"), vec!["a", "b,\"c\"", "", "d"]);
        assert_eq!(csv_fields(""), vec![""]);
    }
}
