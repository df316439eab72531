//! `releases register|list|get` and `rollouts create|list|get|pause|resume|abort` (the
//! `releases.*` and `rollouts.*` methods). `rollouts get --wait` follows a rollout until it is
//! done, paused or aborted, its progress on standard error; a rollout that ends otherwise than
//! done exits 1 with its reason.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bc_core::id::{PoolId, ReleaseId, RolloutId};
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{BusyNodesArg, ReleasesCommand, RolloutsCommand};
use crate::output::Format;
use crate::tables;

use super::{Context, add_page, check_id, idempotency_key, labels};

/// How often `rollouts get --wait` reads the rollout again.
const WAIT_POLL_MS: u64 = 1_000;

/// A manifest or signature file, bounded before it is read.
fn read_bounded(path: &Path, what: &str, max: usize) -> Result<String, CliError> {
    let meta = std::fs::metadata(path).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))?;
    if meta.len() > max as u64 {
        return Err(CliError::usage(format!("{what} {} is over {max} bytes", path.display())));
    }
    std::fs::read_to_string(path).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))
}

fn signature_path(manifest: &Path, given: Option<PathBuf>) -> PathBuf {
    given.unwrap_or_else(|| {
        let mut path = manifest.as_os_str().to_owned();
        path.push(".sig");
        PathBuf::from(path)
    })
}

pub async fn releases(ctx: &Context, command: ReleasesCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let value = match command {
        ReleasesCommand::List { page } => {
            add_page(&mut body, &page);
            let c = ctx.client()?;
            return ctx.print_list(&c.call("releases.list", &Value::Object(body), None).await?, tables::RELEASES);
        }
        ReleasesCommand::Get { release_id } => {
            body.insert("releaseId".into(), json!(check_id::<ReleaseId>("RELEASE_ID", &release_id)?));
            ctx.client()?.call("releases.get", &Value::Object(body), None).await?
        }
        ReleasesCommand::Keygen { .. } | ReleasesCommand::Sign { .. } | ReleasesCommand::Verify { .. } => {
            return super::release::run(ctx, command);
        }
        ReleasesCommand::Register { manifest, signature, key } => {
            let signature = signature_path(&manifest, signature);
            let manifest_text = read_bounded(&manifest, "--manifest", bc_core::release::MANIFEST_BYTES_MAX)?;
            let signature_text = read_bounded(&signature, "--signature", bc_core::release::SIGNATURE_BYTES_MAX)?;
            body.insert("manifest".into(), json!(manifest_text));
            body.insert("signature".into(), json!(signature_text.trim_end()));
            let c = ctx.client()?;
            let key = idempotency_key(&key.key);
            c.call("releases.register", &Value::Object(body), Some(&key)).await?
        }
    };
    ctx.print(&value, Format::Json)
}

/// One line of a rollout's progress: its state, its wave, its nodes by state.
fn progress(rollout: &Value) -> String {
    let waves = rollout["waves"].as_array().map_or(0, Vec::len);
    let wave = rollout["wave"].as_u64().unwrap_or(0) as usize;
    let counts = rollout["counts"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", "))
        .unwrap_or_default();
    let mut line = format!(
        "{}: wave {} of {waves}; nodes: {counts}",
        rollout["state"].as_str().unwrap_or("?"),
        (wave + 1).min(waves.max(1))
    );
    if let Some(waiting) = rollout["waiting"].as_array().and_then(|w| w.first()).and_then(Value::as_str) {
        line.push_str(&format!("; waiting: {waiting}"));
    }
    line
}

/// Follows a rollout until it ends or `wait_s` passes.
async fn follow(ctx: &Context, c: &Client, body: Map<String, Value>, wait_s: u64) -> Result<(), CliError> {
    let deadline = Instant::now() + Duration::from_secs(wait_s);
    let mut shown = String::new();
    loop {
        let rollout = c.call("rollouts.get", &Value::Object(body.clone()), None).await?;
        let state = rollout["state"].as_str().unwrap_or_default().to_owned();
        let line = progress(&rollout);
        if line != shown {
            eprintln!("{line}");
            shown = line;
        }
        match state.as_str() {
            "done" => return ctx.print(&rollout, Format::Json),
            "paused" | "aborted" => {
                ctx.print(&rollout, Format::Json)?;
                let reason = rollout["reason"].as_str().unwrap_or("no reason given");
                return Err(CliError::new(
                    if state == "paused" { "ROLLOUT_PAUSED" } else { "ROLLOUT_ABORTED" },
                    format!("the rollout is {state}: {reason}"),
                )
                .hint("`rollouts resume` goes on; `rollouts abort` rolls the updated nodes back"));
            }
            _ => {}
        }
        if Instant::now() >= deadline {
            ctx.print(&rollout, Format::Json)?;
            return Err(CliError::new("TIMEOUT", format!("the rollout is still {state} after {wait_s} s"))
                .hint("`rollouts get` shows each wave's gate and what it waits for"));
        }
        tokio::time::sleep(Duration::from_millis(WAIT_POLL_MS)).await;
    }
}

/// The body of a verb on one rollout, and its method.
fn act(
    body: &mut Map<String, Value>,
    method: &'static str,
    rollout_id: &str,
    reason: Option<String>,
) -> Result<(&'static str, Option<String>), CliError> {
    body.insert("rolloutId".into(), json!(check_id::<RolloutId>("ROLLOUT_ID", rollout_id)?));
    if let Some(reason) = reason {
        body.insert("reason".into(), json!(reason));
    }
    Ok((method, None))
}

pub async fn run(ctx: &Context, command: RolloutsCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let (method, key) = match command {
        RolloutsCommand::List { page } => {
            add_page(&mut body, &page);
            let c = ctx.client()?;
            return ctx.print_list(&c.call("rollouts.list", &Value::Object(body), None).await?, tables::ROLLOUTS);
        }
        RolloutsCommand::Get { rollout_id, wait } => {
            body.insert("rolloutId".into(), json!(check_id::<RolloutId>("ROLLOUT_ID", &rollout_id)?));
            let c = ctx.client()?;
            if let Some(wait_s) = wait {
                return follow(ctx, &c, body, wait_s).await;
            }
            return ctx.print(&c.call("rollouts.get", &Value::Object(body), None).await?, Format::Json);
        }
        RolloutsCommand::Create {
            release,
            pool,
            labels: items,
            waves,
            max_unavailable,
            min_ready,
            node_deadline,
            wave_failures_max,
            busy_nodes,
            key,
        } => {
            body.insert("releaseId".into(), json!(check_id::<ReleaseId>("--release", &release)?));
            if let Some(pool) = pool {
                body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", &pool)?));
            }
            if !items.is_empty() {
                body.insert("labels".into(), labels(&items)?);
            }
            body.insert("waves".into(), json!(waves.iter().map(|w| w.trim()).collect::<Vec<_>>()));
            body.insert("maxUnavailable".into(), json!(max_unavailable));
            body.insert("minReadyS".into(), json!(min_ready));
            body.insert("nodeDeadlineS".into(), json!(node_deadline));
            body.insert("waveFailuresMax".into(), json!(wave_failures_max));
            let busy = match busy_nodes {
                BusyNodesArg::Wait => "wait",
                BusyNodesArg::Proceed => "proceed",
            };
            body.insert("busyNodes".into(), json!(busy));
            ("rollouts.create", Some(idempotency_key(&key.key)))
        }
        RolloutsCommand::Pause { rollout_id, reason } => act(&mut body, "rollouts.pause", &rollout_id, reason)?,
        RolloutsCommand::Resume { rollout_id, reason } => act(&mut body, "rollouts.resume", &rollout_id, reason)?,
        RolloutsCommand::Abort { rollout_id, reason } => act(&mut body, "rollouts.abort", &rollout_id, reason)?,
    };
    let c = ctx.client()?;
    let value = c.call(method, &Value::Object(body), key.as_deref()).await?;
    ctx.print(&value, Format::Json)
}
