//! `events export` and `sim replay`: the files and the terminal around `bc_simulator`, which
//! holds the format, the verification and the fold.
//!
//! An export is written to a temporary file beside `--out`, fsynced, renamed into place and
//! its directory fsynced, so `--out` is either absent or whole; it is never written over.

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
    let file =
        std::fs::File::open(args.file).map_err(|e| CliError::usage(format!("cannot read {}: {e}", args.file.display())))?;
    let started = Instant::now();
    let mut reader = std::io::BufReader::new(file);
    let replayed = bc_simulator::replay(&mut reader, args.pin, args.until).map_err(|e| {
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
        "elapsedMs": started.elapsed().as_millis() as u64,
    }))
}
