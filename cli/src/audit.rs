//! `better-compute audit …`: sealing, verifying and proving, and the offline proof check.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bc_core::audit::{self, Trust};
use bc_core::clock::SystemClock;
use bc_core::id::{EventId, TenantId};
use bc_core::keys::{LogKey, write_secret_file};
use bc_core::note::Vkey;
use bc_core::store::{EventStore, Log};
use bc_projections::Projections;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::server::{Database, LOG_KEY_FILE};

fn load_key(data_dir: &Path) -> Result<LogKey, CliError> {
    let path = data_dir.join(LOG_KEY_FILE);
    if !path.exists() {
        return Err(CliError::new("PKI_NOT_FOUND", format!("no log key at {}", path.display()))
            .hint("pass the --data-dir that `dev` or `serve` uses"));
    }
    Ok(LogKey::load(&path)?)
}

/// `audit checkpoint`: seal now, for one tenant or all.
pub async fn checkpoint(db: &Database, data_dir: &Path, tenant: Option<TenantId>, deployment: &str) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    let key = Arc::new(load_key(data_dir)?);
    let trust = local_trust(data_dir, deployment)?;
    let log = Log::open(store.clone(), Arc::new(Projections), key, Arc::new(SystemClock)).await?;
    let done = audit::seal_all(&log, tenant, deployment, &trust).await?;
    let sealed: Vec<Value> = done
        .sealed
        .iter()
        .map(|(tenant, cp)| json!({ "tenantId": tenant, "treeSize": cp.size, "checkpoint": cp.note }))
        .collect();
    let failed: Vec<CliError> = done.failed.into_iter().map(|(_, e)| CliError::from(e)).collect();
    if let Some(first) = failed.first() {
        let mut e =
            CliError::new(&first.code, format!("{} tenant(s) could not be sealed; first: {}", failed.len(), first.message));
        e.details = Some(json!({ "sealed": sealed }));
        return Err(e);
    }
    Ok(json!({ "sealed": sealed }))
}

/// The local keys (current and rotated-out) as the trust for sealing.
pub fn local_trust(data_dir: &Path, deployment: &str) -> Result<Trust, CliError> {
    let publics: Vec<_> = local_keys(data_dir)?.iter().map(|k| k.public()).collect();
    Ok(Trust::of(&publics, deployment)?)
}

/// The local log key and every key it replaced (`log.key.lk_…`, kept by `pki rotate-log-key`).
fn local_keys(data_dir: &Path) -> Result<Vec<LogKey>, CliError> {
    let mut keys = vec![load_key(data_dir)?];
    if let Ok(entries) = std::fs::read_dir(data_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("{LOG_KEY_FILE}.lk_")) {
                keys.push(LogKey::load(&entry.path())?);
            }
        }
    }
    Ok(keys)
}

/// The keys `verify` trusts: those in the database whose pin was given, or else the local keys.
async fn trust(store: &dyn EventStore, data_dir: &Path, pins: &[String], deployment: &str) -> Result<Trust, CliError> {
    let wanted: Vec<String> =
        if pins.is_empty() { local_keys(data_dir)?.iter().map(|k| k.pin()).collect() } else { pins.to_vec() };
    let mut publics = Vec::new();
    for (key_id, public) in store.signing_keys().await? {
        // A malformed key row can vouch for nothing: skip it (verify then reports its events).
        let Ok(public) = bc_core::keys::stored_public_key(&key_id, &public) else { continue };
        if wanted.contains(&bc_core::keys::pin_of(&public)) {
            publics.push(public);
        }
    }
    if publics.is_empty() {
        return Err(CliError::new("AUDIT_KEY_MISSING", "none of the trusted keys signed anything in this database")
            .hint("pass the log's pin with --pin (better-compute pki show prints it)"));
    }
    Ok(Trust::of(&publics, deployment)?)
}

pub async fn verify(
    db: &Database,
    data_dir: &Path,
    tenant: Option<TenantId>,
    pins: &[String],
    deployment: &str,
) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    let trust = trust(&*store, data_dir, pins, deployment).await?;
    let started = Instant::now();
    let terminal = std::io::stderr().is_terminal();
    // The events to check: the chain heads' lengths (what verify walks), so a terminal gets a
    // bar with a percentage and the time left; anywhere else a line a second.
    let total: u64 = store.heads().await?.iter().filter(|(t, _)| tenant.is_none_or(|only| *t == only)).map(|(_, h)| h.seq).sum();
    let bar = terminal.then(|| {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "verifying {bar:30} {percent:>3}% {human_pos}/{human_len} events, {per_sec}, {eta} left",
            )
            .expect("a valid template"),
        );
        bar
    });
    let last_report = std::sync::Mutex::new(Instant::now());
    let progress = |events: u64| {
        if let Some(bar) = &bar {
            bar.set_position(events.min(total));
            return;
        }
        let mut last = last_report.lock().expect("progress lock");
        if last.elapsed().as_millis() >= 1000 {
            *last = Instant::now();
            let rate = events as f64 / started.elapsed().as_secs_f64();
            eprintln!("verified {events} of {total} events ({rate:.0}/s)");
        }
    };
    let report = audit::verify(&store, &trust, tenant, &progress).await?;
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let elapsed = started.elapsed();
    let problems: Vec<Value> =
        report.problems.iter().map(|p| json!({ "tenantId": p.tenant, "seq": p.seq, "what": p.what })).collect();
    let summary = json!({
        "ok": problems.is_empty(),
        "tenants": report.tenants,
        "events": report.events,
        "nodeSignedEvents": report.node_entries,
        "checkpoints": report.checkpoints,
        "elapsedMs": elapsed.as_millis() as u64,
        "eventsPerSecond": (report.events as f64 / elapsed.as_secs_f64().max(1e-9)).round(),
        "problems": problems,
        "problemsOmitted": report.problems_omitted,
    });
    if !report.problems.is_empty() {
        let first = &report.problems[0];
        let mut e = CliError::new(
            "AUDIT_TAMPERED",
            format!(
                "{} problem(s); first: tenant {} seq {}: {}",
                report.problems.len() as u64 + report.problems_omitted,
                first.tenant,
                first.seq,
                first.what
            ),
        );
        e.details = Some(summary);
        return Err(e);
    }
    Ok(summary)
}

pub async fn prove(
    db: &Database,
    data_dir: &Path,
    tenant: Option<TenantId>,
    event: EventId,
    out: &Path,
    saved: Option<&Path>,
    deployment: &str,
) -> Result<Value, CliError> {
    if out.exists() {
        return Err(CliError::new("ALREADY_EXISTS", format!("{} exists; a proof is never written over a file", out.display())));
    }
    let consistency_path = consistency_path_of(out);
    if saved.is_some() && consistency_path.exists() {
        return Err(CliError::new("ALREADY_EXISTS", format!("{} exists", consistency_path.display())));
    }
    let saved = match saved {
        Some(p) => Some(std::fs::read_to_string(p).map_err(|e| CliError::usage(format!("cannot read {}: {e}", p.display())))?),
        None => None,
    };
    let store = db.open().await?;
    store.check_schema().await?;
    let key = load_key(data_dir)?;
    let vkey = audit::vkey_of(&key, deployment)?;
    let tenant = match tenant {
        Some(t) => t,
        None => {
            let mut found = None;
            for (t, _) in store.heads().await? {
                if store.event_row(t, event).await?.is_some() {
                    found = Some(t);
                    break;
                }
            }
            found.ok_or_else(|| CliError::new("NOT_FOUND", format!("event {event} not found in any tenant")))?
        }
    };
    let (proof, consistency) = audit::prove(&*store, tenant, event, &vkey, saved.as_deref()).await?;
    write_new(out, proof.encode().as_bytes())?;
    if let Some(c) = &consistency {
        write_new(&consistency_path, c.encode().as_bytes())?;
    }
    Ok(json!({
        "proof": out.display().to_string(),
        "consistency": consistency.as_ref().map(|_| consistency_path.display().to_string()),
        "tenantId": tenant,
        "eventId": event,
        "index": proof.index,
    }))
}

/// Proofs are not secret, but "never over an existing file" is the same rule as for secrets.
fn write_new(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    Ok(bc_core::keys::write_new_file(path, bytes, 0o644)?)
}

pub fn consistency_path_of(proof: &Path) -> PathBuf {
    let mut name = proof.as_os_str().to_owned();
    name.push(".consistency");
    PathBuf::from(name)
}

/// `pki rotate-log-key`: a new log key, announced in the log by the old one. The new key is
/// written first (`log.key.next`), the rotation appended, then the files swap: a crash at any
/// point leaves either the old key in force or both on disk.
pub async fn rotate_log_key(db: &Database, data_dir: &Path, deployment: &str) -> Result<Value, CliError> {
    let store = db.open().await?;
    store.check_schema().await?;
    let old = Arc::new(load_key(data_dir)?);
    let next_path = data_dir.join(format!("{LOG_KEY_FILE}.next"));
    if next_path.exists() {
        return Err(CliError::new("ALREADY_EXISTS", format!("{} exists: an earlier rotation did not finish", next_path.display()))
            .hint("if the log names its key (events list --query 'items[].type'), move it to log.key by hand; otherwise delete it and retry"));
    }
    let new = LogKey::generate();
    write_secret_file(&next_path, format!("{}\n", new.seed_hex()).as_bytes())?;
    let log = Log::open(store.clone(), Arc::new(Projections), old.clone(), Arc::new(SystemClock)).await?;
    let seq = audit::rotate_log_key(&log, &new, bc_core::clock::Clock::now_ms(&SystemClock)).await?;
    // The old key seals a root checkpoint covering the announcement, so a checker holding only
    // the old pin can prove the rotation (`check-proof`, `follow`).
    let trust = local_trust(data_dir, deployment)?;
    let sealed = audit::seal(&log, bc_core::id::TenantId::ROOT, deployment, &trust).await?;
    let archived = data_dir.join(format!("{LOG_KEY_FILE}.{}", old.key_id()));
    std::fs::rename(data_dir.join(LOG_KEY_FILE), &archived)
        .map_err(|e| CliError::new("INTERNAL", format!("archiving the old key: {e}")))?;
    std::fs::rename(&next_path, data_dir.join(LOG_KEY_FILE))
        .map_err(|e| CliError::new("INTERNAL", format!("installing the new key: {e}")))?;
    Ok(json!({
        "previousKeyId": old.key_id(),
        "keyId": new.key_id(),
        "pin": new.pin(),
        "vkey": audit::vkey_of(&new, deployment)?.encode(),
        "rotationSeq": seq,
        "rotationCheckpointSize": sealed.map(|c| c.size),
        "archived": archived.display().to_string(),
        "next": "restart running servers so they sign with the new key",
    }))
}

/// `audit check-proof`: offline, no database, no network. `saved` is the auditor's own earlier
/// checkpoint, from which consistency is proved; the output's `consistency` says plainly what
/// was checked, and a check that proved no consistency also says so on stderr.
pub fn check_proof(
    file: &Path,
    pins: &[String],
    vkeys: &[String],
    saved: Option<&Path>,
    witnesses: &[String],
    witnesses_min: Option<usize>,
) -> Result<Value, CliError> {
    let invalid = |m: String| CliError::new("INVALID_PROOF", m);
    let trust = ProofTrust::parse(pins, vkeys, witnesses, witnesses_min)?;
    let text = std::fs::read_to_string(file).map_err(|e| CliError::usage(format!("cannot read {}: {e}", file.display())))?;
    let consistency_path = consistency_path_of(file);
    let consistency = if consistency_path.exists() {
        Some(
            std::fs::read_to_string(&consistency_path)
                .map_err(|e| invalid(format!("cannot read {}: {e}", consistency_path.display())))?,
        )
    } else {
        None
    };
    let saved = match saved {
        Some(p) => Some(std::fs::read_to_string(p).map_err(|e| CliError::usage(format!("cannot read {}: {e}", p.display())))?),
        None => None,
    };
    let proved = audit::check_proof(&text, consistency.as_deref(), saved.as_deref(), pins, &trust.vkeys).map_err(invalid)?;
    // The checkpoint verified under the log key; now the witnesses' cosignatures of it.
    let checkpoint = bc_core::note::ProofFile::parse(&text).map_err(invalid)?.checkpoint;
    let cosigned = bc_core::witness::cosigners(&checkpoint, &trust.witness_keys);
    if cosigned < trust.witnesses_min {
        return Err(invalid(format!(
            "the proof's checkpoint is cosigned by {cosigned} of the {} witnesses given, fewer than the {} required",
            trust.witness_keys.len(),
            trust.witnesses_min
        )));
    }
    let (consistent_from, said) = consistency_said(&proved.consistency, &consistency_path);
    if !matches!(proved.consistency, audit::Consistency::FromSaved { .. }) {
        eprintln!("warning: consistency {said}");
    }
    Ok(json!({
        "proved": true,
        "tenantId": proved.tenant,
        "eventId": proved.event.id,
        "seq": proved.event.seq,
        "type": proved.event.event_type,
        "stream": proved.event.stream,
        "payload": bc_core::canonical::to_json(&proved.event.payload),
        "hash": hex_of(&proved.hash),
        "origin": proved.origin,
        "treeSize": proved.tree_size,
        "root": hex_of(&proved.root),
        "keyId": proved.key_id,
        "consistentFrom": consistent_from,
        "consistencyFrom": match proved.consistency {
            audit::Consistency::FromSaved { .. } => Some("saved"),
            audit::Consistency::FromProver { .. } => Some("prover"),
            audit::Consistency::NotChecked => None,
        },
        "consistency": said,
        "witnessesCosigned": cosigned,
    }))
}

/// The keys `check-proof` trusts, checked before any file is read: the log key by pin or
/// verifier key, and the witnesses, of which at least `witnesses_min` must have cosigned.
struct ProofTrust {
    vkeys: Vec<Vkey>,
    witness_keys: Vec<bc_core::witness::WitnessKey>,
    witnesses_min: usize,
}

impl ProofTrust {
    fn parse(pins: &[String], vkeys: &[String], witnesses: &[String], witnesses_min: Option<usize>) -> Result<Self, CliError> {
        let witness_keys: Vec<bc_core::witness::WitnessKey> = witnesses
            .iter()
            .map(|w| bc_core::witness::WitnessKey::parse(w).map_err(|e| CliError::usage(format!("--witness: {e}"))))
            .collect::<Result<_, _>>()?;
        // Every witness named must cosign unless --witnesses-min says fewer suffice.
        let witnesses_min = witnesses_min.unwrap_or(witness_keys.len());
        if witnesses_min > witness_keys.len() {
            return Err(CliError::usage(format!(
                "--witnesses-min {witnesses_min} is more than the {} --witness keys given",
                witness_keys.len()
            )));
        }
        if pins.is_empty() && vkeys.is_empty() {
            return Err(CliError::usage("give --pin PIN (or BETTER_COMPUTE_AUDIT_PIN) or --vkey VKEY: the key you trust"));
        }
        let vkeys: Vec<Vkey> = vkeys
            .iter()
            .map(|v| Vkey::parse(v).map_err(|e| CliError::usage(format!("--vkey: {e}"))))
            .collect::<Result<_, _>>()?;
        for pin in pins {
            if !pin.starts_with("sha256/") {
                return Err(CliError::usage(format!("--pin {pin:?} is not sha256/…")));
            }
        }
        Ok(Self { vkeys, witness_keys, witnesses_min })
    }
}

/// The size consistency was proved from, if any, and what was checked, in words a reader acts
/// on: only a checkpoint the auditor saved catches a forked log.
fn consistency_said(consistency: &audit::Consistency, consistency_path: &Path) -> (Option<u64>, String) {
    match *consistency {
        audit::Consistency::FromSaved { size } => {
            (Some(size), format!("checked: the log extends your saved checkpoint (size {size})"))
        }
        audit::Consistency::FromProver { size } => (
            Some(size),
            format!(
                "checked from the prover's own checkpoint (size {size}), not one you saved: a forked log would pass; \
                 give --saved CHECKPOINT"
            ),
        ),
        audit::Consistency::NotChecked => (
            None,
            format!(
                "NOT CHECKED: no --saved checkpoint and no {}; the event is in a tree the key signed, which a forked log \
                 would also show",
                consistency_path.display()
            ),
        ),
    }
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
