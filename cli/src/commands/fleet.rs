//! `fleet export|plan|apply|status`: the tenant's platform objects as one reviewed FleetConfig
//! document (docs/fleet.md). The loop is export, edit, plan, review, apply with the plan's hash.
//!
//! Outcomes beyond success, each its own code (exit 1): `PLAN_BLOCKED` (a change cannot be made
//! in place), `CONFIG_DRIFT` (the fleet changed since the reviewed plan; nothing applied),
//! `FLEET_DRIFTED` (`--fail-on-drift`: the plan is not empty, or the fleet drifted from the last
//! apply).

use std::path::{Path, PathBuf};

use clap::Subcommand;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::IdempotencyKey;
use crate::output::Format;

use super::{Context, idempotency_key};

/// Largest document read: the API's body limit bounds what it takes anyway.
const DOCUMENT_BYTES_MAX: u64 = 8 << 20;

#[derive(Subcommand)]
pub enum FleetCommand {
    /// Write the tenant's pools (with its quota in each), flavors and images as one FleetConfig
    /// document, to a new file (never over one).
    Export {
        #[arg(long)]
        out: PathBuf,
    },
    /// What applying FILE would change: `+` create, `~` update, `-` delete (only with --prune),
    /// `BLOCKED`; and the plan's hash, which `fleet apply --plan-hash` takes.
    Plan {
        file: PathBuf,
        /// Delete (archive, for pools) the live objects FILE leaves out.
        #[arg(long)]
        prune: bool,
        /// Also print the API call each change stands for, and the action it is decided on.
        #[arg(long)]
        calls: bool,
        /// Exit FLEET_DRIFTED when the plan is not empty (the live fleet is not FILE).
        #[arg(long)]
        fail_on_drift: bool,
    },
    /// Make the plan of FILE, in one transaction, if it is still the reviewed one
    /// (`--plan-hash`), or whatever it is now (`--yes`). Without either, only plans.
    Apply {
        file: PathBuf,
        #[arg(long)]
        prune: bool,
        /// The hash `fleet plan` printed: nothing is applied unless the plan is still exactly it.
        #[arg(long, value_name = "HASH", conflicts_with = "yes")]
        plan_hash: Option<String>,
        /// Apply whatever the plan is now, unreviewed.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// The last applied plan, and what changed outside the document since.
    Status {
        /// Exit FLEET_DRIFTED when anything drifted.
        #[arg(long)]
        fail_on_drift: bool,
    },
}

pub async fn run(ctx: &Context, command: FleetCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    match command {
        FleetCommand::Export { out } => {
            if out.exists() {
                return Err(CliError::new(
                    "ALREADY_EXISTS",
                    format!("{} exists; an export is never written over a file", out.display()),
                ));
            }
            let body = Value::Object(ctx.tenant_body()?);
            let answer = c.call("fleet.export", &body, None).await?;
            let document = &answer["document"];
            let mut text = serde_json::to_string_pretty(document).map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
            text.push('\n');
            bc_core::keys::write_new_file(&out, text.as_bytes(), 0o644)?;
            ctx.print(
                &json!({
                    "out": out.display().to_string(),
                    "documentSha256": answer["documentSha256"],
                    "pools": document["pools"].as_object().map_or(0, |m| m.len()),
                    "flavors": document["flavors"].as_object().map_or(0, |m| m.len()),
                    "images": document["images"].as_object().map_or(0, |m| m.len()),
                }),
                Format::Json,
            )
        }
        FleetCommand::Plan { file, prune, calls, fail_on_drift } => {
            let plan = plan(ctx, &c, &file, prune).await?;
            show_plan(ctx, &plan, calls)?;
            blocked(&plan)?;
            if fail_on_drift && !plan["empty"].as_bool().unwrap_or(false) {
                return Err(CliError::new(
                    "FLEET_DRIFTED",
                    format!("the live fleet is not {}: the plan is not empty", file.display()),
                ));
            }
            Ok(())
        }
        FleetCommand::Apply { file, prune, plan_hash, yes, key } => {
            let hash = match (plan_hash, yes) {
                (Some(hash), _) => {
                    if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                        return Err(CliError::usage("--plan-hash is the 64 lowercase hex digits fleet plan printed"));
                    }
                    hash
                }
                (None, true) => {
                    let plan = plan(ctx, &c, &file, prune).await?;
                    blocked(&plan)?;
                    plan["planHash"].as_str().unwrap_or_default().to_owned()
                }
                (None, false) => {
                    let plan = plan(ctx, &c, &file, prune).await?;
                    show_plan(ctx, &plan, false)?;
                    blocked(&plan)?;
                    eprintln!(
                        "Not applied. Review the plan, then: fleet apply {} --plan-hash {}",
                        file.display(),
                        plan["planHash"].as_str().unwrap_or_default()
                    );
                    return Ok(());
                }
            };
            let mut body = ctx.tenant_body()?;
            body.insert("document".into(), read_document(&file)?);
            body.insert("prune".into(), json!(prune));
            body.insert("planHash".into(), json!(hash));
            let key = idempotency_key(&key.key);
            ctx.print(&c.call("fleet.apply", &Value::Object(body), Some(&key)).await?, Format::Json)
        }
        FleetCommand::Status { fail_on_drift } => {
            let status = c.call("fleet.status", &Value::Object(ctx.tenant_body()?), None).await?;
            ctx.print(&status, Format::Json)?;
            let drift = status["drift"].as_array().map_or(0, Vec::len);
            if fail_on_drift && drift > 0 {
                let named: Vec<String> = status["drift"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .take(5)
                    .map(|d| {
                        format!(
                            "{} {} ({}) {}",
                            d["kind"].as_str().unwrap_or(""),
                            d["key"].as_str().unwrap_or(""),
                            d["id"].as_str().unwrap_or(""),
                            d["what"].as_str().unwrap_or("")
                        )
                    })
                    .collect();
                return Err(CliError::new(
                    "FLEET_DRIFTED",
                    format!("{drift} object(s) changed outside the applied document: {}", named.join("; ")),
                ));
            }
            Ok(())
        }
    }
}

/// The document in FILE, as JSON (the server checks it against the schema).
fn read_document(file: &Path) -> Result<Value, CliError> {
    let meta = std::fs::metadata(file).map_err(|e| CliError::usage(format!("{}: {e}", file.display())))?;
    if meta.len() > DOCUMENT_BYTES_MAX {
        return Err(CliError::usage(format!("{} is larger than {DOCUMENT_BYTES_MAX} bytes", file.display())));
    }
    let text = std::fs::read_to_string(file).map_err(|e| CliError::usage(format!("{}: {e}", file.display())))?;
    serde_json::from_str(&text).map_err(|e| CliError::usage(format!("{} is not JSON: {e}", file.display())))
}

async fn plan(ctx: &Context, c: &crate::client::Client, file: &Path, prune: bool) -> Result<Value, CliError> {
    let mut body = ctx.tenant_body()?;
    body.insert("document".into(), read_document(file)?);
    body.insert("prune".into(), json!(prune));
    c.call("fleet.plan", &Value::Object(body), None).await
}

fn blocked(plan: &Value) -> Result<(), CliError> {
    let blocked = plan["blocked"].as_array().map_or(0, Vec::len);
    if blocked > 0 {
        return Err(CliError::new(
            "PLAN_BLOCKED",
            format!("{blocked} change(s) cannot be made in place; nothing can be applied"),
        )
        .hint("change the document as each BLOCKED line says"));
    }
    Ok(())
}

/// The plan as a reviewer reads it (`--format json` for the raw answer).
fn show_plan(ctx: &Context, plan: &Value, calls: bool) -> Result<(), CliError> {
    if ctx.global.format.is_some() || ctx.global.query.is_some() {
        return ctx.print(plan, Format::Json);
    }
    let items = |name: &str| plan[name].as_array().cloned().unwrap_or_default();
    let mut out = String::new();
    for change in items("changes") {
        let sign = match change["op"].as_str() {
            Some("create") => '+',
            Some("update") => '~',
            _ => '-',
        };
        let id = change["id"].as_str().map(|id| format!(" ({id})")).unwrap_or_default();
        out.push_str(&format!("{sign} {} {}{id}\n", change["kind"].as_str().unwrap_or(""), change["key"].as_str().unwrap_or("")));
        if let Some(fields) = change["fields"].as_object() {
            for (name, f) in fields {
                if f["from"].is_null() {
                    out.push_str(&format!("    {name}: {}\n", f["to"]));
                } else {
                    out.push_str(&format!("    {name}: {} -> {}\n", f["from"], f["to"]));
                }
            }
        }
        if calls {
            out.push_str(&format!(
                "    call: {} ({})\n",
                change["method"].as_str().unwrap_or(""),
                change["action"].as_str().unwrap_or("")
            ));
        }
    }
    for b in items("blocked") {
        out.push_str(&format!(
            "BLOCKED {} {}: {}\n",
            b["kind"].as_str().unwrap_or(""),
            b["key"].as_str().unwrap_or(""),
            b["reason"].as_str().unwrap_or("")
        ));
    }
    for u in items("unmanaged") {
        out.push_str(&format!(
            "  (not in the document, left alone: {} {} {})\n",
            u["kind"].as_str().unwrap_or(""),
            u["id"].as_str().unwrap_or(""),
            u["name"].as_str().unwrap_or("")
        ));
    }
    let changes = items("changes").len();
    if changes == 0 && items("blocked").is_empty() {
        out.push_str("No changes: the live fleet is the document.\n");
    } else {
        out.push_str(&format!("{changes} change(s), {} blocked.\n", items("blocked").len()));
    }
    out.push_str(&format!("planHash: {}\n", plan["planHash"].as_str().unwrap_or("")));
    print!("{out}");
    Ok(())
}
