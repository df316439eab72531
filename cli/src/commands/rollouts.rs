//! `rollouts create|list|get|pause|resume|abort` (the `rollouts.*` methods): a release taken
//! to a pool's nodes in waves. `rollouts get --wait` follows a rollout until it is
//! done, paused or aborted, its progress on standard error; a rollout that ends otherwise than
//! done exits 1 with its reason.

use std::time::{Duration, Instant};

use bc_core::id::{PoolId, ReleaseId, RolloutId};
use clap::Subcommand;
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{IdempotencyKey, Page, parse_duration_s};
use crate::output::Format;
use crate::tables;

use super::{Context, idempotency_key, labels, put_id};

/// What a node with live reservations does when its turn comes.
#[derive(clap::ValueEnum, Clone, Copy)]
pub enum BusyNodesArg {
    /// Leave it until its reservations end (drain it to hurry that along).
    Wait,
    /// Update it anyway: held GPUs and running instances stay through the agent's restart.
    Proceed,
}

#[derive(Subcommand)]
pub enum RolloutsCommand {
    /// Take a release to the nodes of a pool (and/or those with some labels) in waves.
    Create {
        /// The release, `rel_…`.
        #[arg(long)]
        release: String,
        /// The pool whose nodes take it.
        #[arg(long)]
        pool: Option<String>,
        /// Only nodes with this label, `key=value` (repeatable).
        #[arg(long = "label")]
        labels: Vec<String>,
        /// Cumulative waves, comma-separated: how many nodes have the release once each is
        /// done, as counts or percentages; the last reaches every node.
        #[arg(long, default_value = "1,100%", value_delimiter = ',')]
        waves: Vec<String>,
        /// Most nodes updating, rolling back or unreachable at once.
        #[arg(long, default_value_t = 1)]
        max_unavailable: u32,
        /// How long a node must stay ready on the new version to pass its gate: `30s`, `5m`.
        #[arg(long, default_value = "30s", value_parser = parse_duration_s)]
        min_ready: u64,
        /// How long a node has from its update to passing its gate.
        #[arg(long, default_value = "15m", value_parser = parse_duration_s)]
        node_deadline: u64,
        /// Failed nodes a wave tolerates before the rollout pauses.
        #[arg(long, default_value_t = 0)]
        wave_failures_max: u32,
        /// A node with live reservations: wait for them to end, or proceed.
        #[arg(long, value_enum, default_value = "wait")]
        busy_nodes: BusyNodesArg,
        /// Make a batch of one `rollouts.create` leaf (commandBatches.create) with this reason,
        /// what the approvers read, rather than creating the rollout now: the leaf binds these
        /// flags and the nodes they choose now; `batch approve` signs it, and the rollout starts
        /// once the quorum has. What a rollout to more than one node takes when the deployment
        /// runs the approvers' quorum (--approvers).
        #[arg(long, value_name = "TEXT")]
        batch_reason: Option<String>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's rollouts.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One rollout: its waves and gates, its nodes, what it waits for.
    Get {
        rollout_id: String,
        /// Wait up to this long for the rollout to end (done, paused or aborted), printing
        /// its progress: `10m`.
        #[arg(long, value_parser = parse_duration_s)]
        wait: Option<u64>,
    },
    /// Send the release to no more nodes (the ones updating finish).
    Pause {
        rollout_id: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Go on, accepting the failures seen so far.
    Resume {
        rollout_id: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Roll the updated nodes back to the version they ran, then end.
    Abort {
        rollout_id: String,
        #[arg(long)]
        reason: Option<String>,
    },
}

/// How often `rollouts get --wait` reads the rollout again.
const WAIT_POLL_MS: u64 = 1_000;

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
    put_id::<RolloutId>(body, "rolloutId", "ROLLOUT_ID", rollout_id)?;
    if let Some(reason) = reason {
        body.insert("reason".into(), json!(reason));
    }
    Ok((method, None))
}

pub async fn run(ctx: &Context, command: RolloutsCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let (method, key) = match command {
        RolloutsCommand::List { page } => return ctx.list("rollouts.list", body, &page, tables::ROLLOUTS).await,
        RolloutsCommand::Get { rollout_id, wait } => {
            put_id::<RolloutId>(&mut body, "rolloutId", "ROLLOUT_ID", &rollout_id)?;
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
            batch_reason,
            key,
        } => {
            put_id::<ReleaseId>(&mut body, "releaseId", "--release", &release)?;
            if let Some(pool) = pool {
                put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
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
            if let Some(batch_reason) = batch_reason {
                // The leaf: the release is its subject, the rest of the call its payload.
                body.remove("tenantId");
                let release = body.remove("releaseId").unwrap_or_default().as_str().unwrap_or_default().to_owned();
                let leaves = vec![(release, Value::Object(body))];
                let kind = bc_projections::decide::batch::LEAF_ROLLOUT_CREATE;
                return ctx.print(&super::batch::make_batch(ctx, &batch_reason, kind, leaves, &key).await?, Format::Json);
            }
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
