//! `events export`, `sim replay` and `sim run`: the files and the terminal around
//! `bc_simulator`, which holds the format, the verification, the fold and the simulation.
//!
//! An export is written to a temporary file beside `--out`, fsynced, renamed into place and
//! its directory fsynced, so `--out` is either absent or whole; it is never written over. A
//! report (`--report`) is written the same way, 0644, but over a file of its name: it is a
//! picture of a run, made again at will, and never seen half written.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use bc_core::id::TenantId;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::server::Database;

/// How often progress is reported on a terminal.
const PROGRESS_INTERVAL_MS: u128 = 1000;
/// The write buffer of an export.
const EXPORT_BUFFER_BYTES: usize = 256 * 1024;

/// What `events export` was asked.
pub struct ExportArgs<'a> {
    pub tenant: TenantId,
    pub from_seq: u64,
    pub to_seq: Option<u64>,
    pub out: &'a Path,
    pub deployment: &'a str,
}

pub async fn export(db: &Database, args: ExportArgs<'_>) -> Result<Value, CliError> {
    if args.out.exists() {
        return Err(CliError::new(
            "ALREADY_EXISTS",
            format!("{} exists; an export is never written over a file", args.out.display()),
        ));
    }
    let store = db.open().await?;
    store.check_schema().await?;
    let temporary = temporary_path(args.out);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temporary)
        .map_err(|e| CliError::new("INTERNAL", format!("cannot create {}: {e}", temporary.display())))?;
    let mut writer = std::io::BufWriter::with_capacity(EXPORT_BUFFER_BYTES, file);
    let started = Instant::now();
    let terminal = std::io::stderr().is_terminal();
    let mut last_report = Instant::now();
    let mut progress = |written: u64, total: u64| {
        if terminal && last_report.elapsed().as_millis() >= PROGRESS_INTERVAL_MS {
            last_report = Instant::now();
            eprint!("\rexported {written} of {total} events…");
        }
    };
    let written = bc_simulator::export::export(
        &*store,
        args.tenant,
        args.from_seq,
        args.to_seq,
        args.deployment,
        &mut writer,
        &mut progress,
    )
    .await;
    if terminal {
        eprint!("\r\x1b[K");
    }
    let finished = written.map_err(CliError::from).and_then(|exported| {
        let file = writer.into_inner().map_err(|e| CliError::new("INTERNAL", format!("writing the export: {}", e.error())))?;
        file.sync_all().map_err(|e| CliError::new("INTERNAL", format!("syncing the export: {e}")))?;
        std::fs::rename(&temporary, args.out)
            .map_err(|e| CliError::new("INTERNAL", format!("renaming the export into place: {e}")))?;
        bc_core::keys::sync_dir_of(args.out)?;
        Ok(exported)
    });
    let exported = match finished {
        Ok(exported) => exported,
        Err(e) => {
            let _ = std::fs::remove_file(&temporary);
            return Err(e);
        }
    };
    Ok(json!({
        "out": args.out.display().to_string(),
        "format": bc_simulator::format::FORMAT_NAME,
        "version": bc_simulator::format::FORMAT_VERSION,
        "tenantId": args.tenant,
        "fromSeq": exported.from_seq,
        "toSeq": exported.to_seq,
        "events": exported.events,
        "bytes": exported.bytes,
        "keyIds": exported.key_ids,
        "rotations": exported.rotations,
        "elapsedMs": started.elapsed().as_millis() as u64,
    }))
}

/// Writes a report over `path`, atomically: a temporary file beside it (0644), fsynced, renamed
/// over it, the directory fsynced. A failure removes the temporary file and leaves `path` as
/// it was.
pub fn write_report(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    use std::os::unix::fs::PermissionsExt;
    let temporary = temporary_path(path);
    let written = (|| -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(&temporary)?;
        // Exactly 0644, whatever the umask: a report is for reading.
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temporary);
        return Err(CliError::new("INTERNAL", format!("writing the report {}: {e}", path.display())));
    }
    bc_core::keys::sync_dir_of(path)?;
    Ok(())
}

/// `.NAME.tmp-PID` beside `out`: on the same file system, so the rename is atomic.
fn temporary_path(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "export".into());
    out.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// What `sim replay` was asked.
pub struct ReplayArgs<'a> {
    pub file: &'a Path,
    pub pin: &'a str,
    pub until: Option<u64>,
    pub rows_out: Option<&'a Path>,
    pub report: Option<&'a Path>,
    /// `KEY=VALUE` policy changes for a what-if.
    pub what_if: &'a [String],
}

pub fn replay(args: ReplayArgs<'_>) -> Result<Value, CliError> {
    if !args.pin.starts_with("sha256/") {
        return Err(CliError::usage(format!("--log-key-pin {:?} is not sha256/…", args.pin)));
    }
    if let Some(rows_out) = args.rows_out
        && rows_out.exists()
    {
        return Err(CliError::new(
            "ALREADY_EXISTS",
            format!("{} exists; rows are never written over a file", rows_out.display()),
        ));
    }
    let policy = (!args.what_if.is_empty())
        .then(|| bc_simulator::whatif::parse_policy(args.what_if).map_err(CliError::usage))
        .transpose()?;
    let file =
        std::fs::File::open(args.file).map_err(|e| CliError::usage(format!("cannot read {}: {e}", args.file.display())))?;
    let started = Instant::now();
    let mut reader = std::io::BufReader::new(file);
    let mut what_if = policy.map(bc_simulator::whatif::WhatIf::new);
    let mut first_at_ms: Option<u64> = None;
    let mut observe = |event: &bc_core::event::StoredEvent| {
        first_at_ms.get_or_insert(event.envelope.at_ms);
        if let Some(w) = what_if.as_mut() {
            w.event(event);
        }
    };
    let replayed = bc_simulator::replay::replay_observed(&mut reader, args.pin, args.until, args.report.is_some(), &mut observe);
    let replayed = replayed.map_err(|e| {
        let error = CliError::new(e.code, e.to_string());
        match e.code {
            bc_simulator::replay::REPLAY_UNTIL_OUTSIDE => CliError { code: "INVALID_ARGUMENT".into(), ..error },
            bc_simulator::replay::EXPORT_UNTRUSTED_KEY => {
                error.hint("pass the pin of the log that wrote the file (better-compute pki show prints it)")
            }
            bc_simulator::replay::REPLAY_PARTIAL_FILE => error.hint("export from seq 1 (without --from) to rebuild state"),
            _ => error,
        }
    })?;
    let digest = replayed.digest();
    if let Some(rows_out) = args.rows_out {
        let document = json!({
            "tenantId": replayed.header.tenant,
            "atSeq": replayed.at_seq,
            "stateDigest": digest,
            "rows": replayed.rows_json(),
        });
        let mut text =
            serde_json::to_vec_pretty(&document).map_err(|e| CliError::new("INTERNAL", format!("encoding the rows: {e}")))?;
        text.write_all(b"\n").map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
        bc_core::keys::write_new_file(rows_out, &text, 0o644)?;
    }
    let mut replayed = replayed;
    let what_if = what_if.map(|w| (w.finish(), w));
    if let (Some((found, _)), Some(timeline), Some(first)) = (&what_if, replayed.timeline.as_mut(), first_at_ms)
        && let Some(at_ms) =
            found["firstDivergence"]["whatIf"]["atMs"].as_u64().or(found["firstDivergence"]["baseline"]["atMs"].as_u64())
    {
        let seq = found["firstDivergence"]["afterSeq"].as_u64().unwrap_or(0);
        timeline.mark(
            bc_simulator::timeline::MarkKind::Divergence,
            at_ms.saturating_sub(first),
            format!("after seq {seq}: the what-if's first decision that differs"),
        );
    }
    if let Some(report) = args.report {
        let page = bc_simulator::report::replay_report(&replayed, &args.file.display().to_string())
            .map_err(|e| CliError::new("INTERNAL", e))?;
        write_report(report, page.as_bytes())?;
    }
    Ok(json!({
        "verified": true,
        "tenantId": replayed.header.tenant,
        "fromSeq": replayed.header.from_seq,
        "toSeq": replayed.header.to_seq,
        "events": replayed.events_verified,
        "atSeq": replayed.at_seq,
        "keyIds": replayed.key_ids,
        "stateDigest": digest,
        "rows": replayed.rows.len(),
        "kinds": replayed.counts(),
        "rowsOut": args.rows_out.map(|p| p.display().to_string()),
        "report": args.report.map(|p| p.display().to_string()),
        "whatIf": what_if.map(|(found, _)| found),
        "elapsedMs": started.elapsed().as_millis() as u64,
    }))
}

/// What `sim run` was asked.
pub struct RunArgs<'a> {
    pub seed: u64,
    pub nodes: usize,
    pub tenants: usize,
    pub hours: u64,
    pub faults: &'a str,
    /// `--metal`: bare-metal machines (`None`: the run's default).
    pub metal: Option<usize>,
    /// `--cpu`: `auto`, a CPU number or `any`.
    pub cpu: &'a str,
    pub report: Option<&'a Path>,
    pub unsafe_no_placement_guard: bool,
    pub unsafe_no_journal_dedupe: bool,
    pub unsafe_break: Option<&'a str>,
}

/// Keeps the calling thread, and the threads it starts from now on (SQLite's workers), to one
/// CPU (`--cpu`): `auto` the one it runs on now, `N` that one, `any` leaves it to the scheduler.
/// Call it before the run opens its store. Nothing the run decides depends on it.
pub fn keep_to_cpu(cpu: &str) -> Result<(), CliError> {
    use rustix::thread::{CpuSet, sched_getaffinity, sched_getcpu, sched_setaffinity};
    let allowed = sched_getaffinity(None).map_err(|e| CliError::new("INTERNAL", format!("reading the CPU affinity: {e}")))?;
    let chosen = match cpu {
        "any" => return Ok(()),
        "auto" => sched_getcpu(),
        n => n.parse::<usize>().map_err(|_| CliError::usage(format!("--cpu {n:?}: expected auto, any or a CPU number")))?,
    };
    if chosen >= CpuSet::MAX_CPU || !allowed.is_set(chosen) {
        return Err(CliError::usage(format!("--cpu {chosen}: this process may not run on that CPU")));
    }
    let mut one = CpuSet::new();
    one.set(chosen);
    sched_setaffinity(None, &one).map_err(|e| CliError::new("INTERNAL", format!("keeping to CPU {chosen}: {e}")))
}

/// Runs the simulation and prints its summary (text, or JSON with `--json`) on stdout; a broken
/// invariant also says what broke and the command that repeats the run, and fails (exit 1).
pub async fn run(args: RunArgs<'_>, json_out: bool) -> Result<(), CliError> {
    use bc_simulator::run::{Fault, Options};
    let faults = Fault::parse_list(args.faults).map_err(CliError::usage)?;
    let options = Options {
        seed: args.seed,
        nodes: args.nodes,
        tenants: args.tenants,
        hours: args.hours,
        faults,
        metal: args.metal,
        unsafe_no_placement_guard: args.unsafe_no_placement_guard,
        unsafe_no_journal_dedupe: args.unsafe_no_journal_dedupe,
        unsafe_break: args.unsafe_break.map(bc_simulator::run::Break::parse).transpose().map_err(CliError::usage)?,
        timeline: args.report.is_some(),
    };
    options.check().map_err(CliError::usage)?;
    keep_to_cpu(args.cpu)?;
    let started = Instant::now();
    let outcome = bc_simulator::run::run(options.clone()).await;
    let mut value = outcome.to_json(&options);
    value["wallMs"] = json!(started.elapsed().as_millis() as u64);
    // The report first, so a failed run still leaves its picture.
    if let Some(report) = args.report {
        let page = bc_simulator::report::run_report(&options, &outcome).map_err(|e| CliError::new("INTERNAL", e))?;
        write_report(report, page.as_bytes())?;
        value["report"] = json!(report.display().to_string());
    }
    let mut out = std::io::stdout().lock();
    let written = if json_out {
        writeln!(out, "{}", serde_json::to_string_pretty(&value).unwrap_or_default())
    } else {
        writeln!(out, "{}", summary_text(&value))
    };
    written.map_err(|e| CliError::new("INTERNAL", format!("writing the summary: {e}")))?;
    match &outcome.violation {
        None => Ok(()),
        Some(failure) => Err(CliError::new(
            "SIM_INVARIANT_BROKEN",
            format!(
                "seed {} (--nodes {} --tenants {} --hours {}), step {}, at {} ms of simulated time: {}",
                options.seed, options.nodes, options.tenants, options.hours, failure.step, failure.at_ms, failure.what
            ),
        )
        .hint(format!("repeat it with: {}", options.command()))),
    }
}

/// The summary for a person: one line per figure.
fn summary_text(value: &Value) -> String {
    let mut lines = Vec::new();
    let field = |name: &str| value.get(name).map(|v| v.to_string()).unwrap_or_default();
    lines.push(format!(
        "sim run: {} (seed {}, {} nodes, {} tenants, {} h)",
        if value["ok"] == json!(true) { "ok" } else { "FAILED" },
        field("seed"),
        field("nodes"),
        field("tenants"),
        field("hours")
    ));
    lines.push(format!(
        "steps: {}, simulated hours: {:.3}, wall: {} ms",
        field("steps"),
        value["simulatedHours"].as_f64().unwrap_or(0.0),
        field("wallMs")
    ));
    lines.push(format!("events: {}", field("events")));
    lines.push(format!(
        "reservations: {} requested ({} placed at once, {} stale placements refused), {} released by tenants, {} extended; by state: {}",
        field("reservationsRequested"),
        field("placedAtRequest"),
        field("stalePlacementsRefused"),
        field("releases"),
        field("extensions"),
        value["reservations"]
    ));
    lines.push(format!("cordons: {}", field("cordons")));
    lines.push(format!("rollouts: {} (agent updates and rollbacks: {})", field("rollouts"), field("agentUpdates")));
    lines.push(format!("metal: {}", value["metal"]));
    lines.push(format!("faults enabled: {}; injected: {}", value["faultsEnabled"], value["faultsInjected"]));
    lines.push(format!("transport: {}", value["transport"]));
    lines.push(format!("invariant checks: {}", value["invariantChecks"]));
    lines.push(format!("liveness: settled in {} ms (bound {} ms)", field("livenessSettledMs"), field("livenessBoundMs")));
    for head in value["heads"].as_array().into_iter().flatten() {
        lines.push(format!(
            "head {} {} {}",
            head["tenantId"].as_str().unwrap_or(""),
            head["seq"],
            head["hash"].as_str().unwrap_or("")
        ));
    }
    lines.push(format!("digest {}", value["digest"].as_str().unwrap_or("")));
    if let Some(report) = value.get("report").and_then(Value::as_str) {
        lines.push(format!("report {report}"));
    }
    if let Some(failure) = value.get("failure").filter(|f| !f.is_null()) {
        lines.push(format!("failure at step {}: {}", failure["step"], failure["what"].as_str().unwrap_or("")));
        lines.push(format!("reproduce: {}", value["reproduce"].as_str().unwrap_or("")));
    }
    lines.join("\n")
}
