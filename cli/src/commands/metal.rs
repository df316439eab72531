//! `metal …` (the `metal.*` methods) and `workflows …` (`workflows.*`). The BMC password is
//! read from `--bmc-password-file` only, and a deploy's join token goes to a new 0600 file
//! (`--token-out`), never to the terminal. With `--wait S`, a verb is followed until the
//! machine rests in a stable state, its workflow's steps shown on standard error.

use std::time::{Duration, Instant};

use bc_core::id::{ImageId, NodeId, PoolId, WorkflowId};
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{MachineVerbArgs, MetalCommand, MetalWait, WorkflowsCommand};
use crate::output::Format;
use crate::tables;

use super::{Context, add_page, check_id, idempotency_key};

/// How often `--wait` reads the machine again.
const WAIT_POLL_MS: u64 = 500;
/// Largest password file read.
const PASSWORD_FILE_BYTES_MAX: u64 = 4096;
/// Largest CA file read.
const CA_FILE_BYTES_MAX: u64 = 64 * 1024;

fn read_file(what: &str, path: &std::path::Path, bytes_max: u64) -> Result<String, CliError> {
    let meta = std::fs::metadata(path).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))?;
    if meta.len() > bytes_max {
        return Err(CliError::usage(format!("{what} {} is larger than {bytes_max} bytes", path.display())));
    }
    std::fs::read_to_string(path).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))
}

/// The password: the file's first line, without its line ending.
fn password(path: &std::path::Path) -> Result<String, CliError> {
    let text = read_file("--bmc-password-file", path, PASSWORD_FILE_BYTES_MAX)?;
    let line = text.lines().next().unwrap_or("").to_owned();
    if line.is_empty() {
        return Err(CliError::usage(format!("--bmc-password-file {} is empty", path.display())));
    }
    Ok(line)
}

fn machine_body(ctx: &Context, verb: &MachineVerbArgs) -> Result<Map<String, Value>, CliError> {
    let mut body = ctx.tenant_body()?;
    body.insert("nodeId".into(), json!(check_id::<NodeId>("NODE_ID", &verb.node_id)?));
    if let Some(v) = verb.if_version.if_version {
        body.insert("ifVersion".into(), json!(v));
    }
    Ok(body)
}

/// Follows the machine until it rests in a stable state, or `wait.wait` seconds pass (then
/// exit 1 with the machine as it stands).
async fn settle(ctx: &Context, c: &Client, mut machine: Value, wait: MetalWait) -> Result<Value, CliError> {
    if wait.wait == 0 {
        return Ok(machine);
    }
    let deadline = Instant::now() + Duration::from_secs(wait.wait);
    let mut shown = String::new();
    loop {
        let running = machine["workflow"]["outcome"] == "running";
        if !running {
            return Ok(machine);
        }
        let step = machine["workflow"]["steps"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["state"] == "running"))
            .and_then(|s| s["name"].as_str())
            .unwrap_or("-")
            .to_owned();
        let line = format!(
            "{}: {} at step {step}",
            machine["state"].as_str().unwrap_or("?"),
            machine["workflow"]["verb"].as_str().unwrap_or("?")
        );
        if line != shown {
            eprintln!("{line}…");
            shown = line;
        }
        if Instant::now() >= deadline {
            ctx.print(&machine, Format::Json)?;
            return Err(CliError::new("TIMEOUT", format!("the machine's workflow still runs after {} s", wait.wait))
                .hint("`metal get` shows where it stands; its workflow fails by itself at its deadline"));
        }
        tokio::time::sleep(Duration::from_millis(WAIT_POLL_MS)).await;
        let mut get = ctx.tenant_body()?;
        get.insert("nodeId".into(), machine["nodeId"].clone());
        machine = c.call("metal.get", &Value::Object(get), None).await?;
    }
}

pub async fn run(ctx: &Context, command: MetalCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let simple =
        |method: &'static str, verb: MachineVerbArgs| -> Result<(&'static str, Map<String, Value>, MetalWait), CliError> {
            Ok((method, machine_body(ctx, &verb)?, verb.wait))
        };
    let (method, body, wait) = match command {
        MetalCommand::Enroll {
            pool,
            name,
            bmc_address,
            bmc_username,
            bmc_password_file,
            bmc_system_path,
            bmc_ca_file,
            bmc_pin,
            bmc_insecure,
            key,
        } => {
            let mut body = ctx.tenant_body()?;
            body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", &pool)?));
            body.insert("name".into(), json!(name));
            if !bmc_address.starts_with("https://") {
                return Err(CliError::usage(
                    "--bmc-address must be https://: the BMC's password never crosses a network in clear text",
                ));
            }
            body.insert("bmcAddress".into(), json!(bmc_address));
            body.insert("bmcUsername".into(), json!(bmc_username));
            body.insert("bmcPassword".into(), json!(password(&bmc_password_file)?));
            if let Some(path) = bmc_system_path {
                body.insert("bmcSystemPath".into(), json!(path));
            }
            match (bmc_ca_file, bmc_pin, bmc_insecure) {
                (Some(ca), None, false) => {
                    body.insert(
                        "bmcTls".into(),
                        json!({ "mode": "ca", "caPem": read_file("--bmc-ca-file", &ca, CA_FILE_BYTES_MAX)? }),
                    );
                }
                (None, Some(pin), false) => {
                    body.insert("bmcTls".into(), json!({ "mode": "pin", "pin": pin }));
                }
                (None, None, true) => {
                    eprintln!("warning: --bmc-insecure: the BMC's certificate is not checked; `metal get` says so");
                    body.insert("bmcTls".into(), json!({ "mode": "insecure" }));
                }
                _ => {
                    return Err(CliError::usage(
                        "say how the BMC's certificate is checked: --bmc-ca-file, --bmc-pin or --bmc-insecure",
                    ));
                }
            }
            let machine = c.call("metal.enroll", &Value::Object(body), Some(&idempotency_key(&key.key))).await?;
            return ctx.print(&machine, Format::Json);
        }
        MetalCommand::List { pool, state, page } => {
            let mut body = ctx.tenant_body()?;
            if let Some(p) = pool {
                body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", &p)?));
            }
            if let Some(s) = state {
                body.insert("state".into(), json!(s));
            }
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("metal.list", &Value::Object(body), None).await?, tables::MACHINES);
        }
        MetalCommand::Get { node_id } => {
            let mut body = ctx.tenant_body()?;
            body.insert("nodeId".into(), json!(check_id::<NodeId>("NODE_ID", &node_id)?));
            return ctx.print(&c.call("metal.get", &Value::Object(body), None).await?, Format::Json);
        }
        MetalCommand::Deploy { verb, image, token_out } => {
            // Refused before the call: a token made for a file that cannot be written is lost.
            if token_out.exists() {
                return Err(CliError::new("ALREADY_EXISTS", format!("{} exists", token_out.display()))
                    .hint("--token-out never overwrites: give a new file"));
            }
            let mut body = machine_body(ctx, &verb)?;
            body.insert("imageId".into(), json!(check_id::<ImageId>("--image", &image)?));
            let answer = c.call("metal.deploy", &Value::Object(body), None).await?;
            if let Some(token) = answer["joinToken"].as_str() {
                bc_core::keys::write_secret_file(&token_out, format!("{token}\n").as_bytes()).map_err(|e| {
                    CliError::from(e)
                        .hint("the deploy started; abort it (metal abort) and deploy again with a writable --token-out")
                })?;
                eprintln!("join token written to {} (0600)", token_out.display());
            }
            let machine = settle(ctx, &c, answer["machine"].clone(), verb.wait).await?;
            return ctx.print(&machine, Format::Json);
        }
        MetalCommand::Rescue { verb, image } => {
            let mut body = machine_body(ctx, &verb)?;
            body.insert("imageId".into(), json!(check_id::<ImageId>("--image", &image)?));
            ("metal.rescue", body, verb.wait)
        }
        MetalCommand::Power { verb, power } => {
            let mut body = machine_body(ctx, &verb)?;
            body.insert("power".into(), json!(power));
            ("metal.power", body, verb.wait)
        }
        MetalCommand::Manage(v) => simple("metal.manage", v)?,
        MetalCommand::Inspect(v) => simple("metal.inspect", v)?,
        MetalCommand::Provide(v) => simple("metal.provide", v)?,
        MetalCommand::Undeploy(v) => simple("metal.undeploy", v)?,
        MetalCommand::Unrescue(v) => simple("metal.unrescue", v)?,
        MetalCommand::Retire(v) => simple("metal.retire", v)?,
        MetalCommand::Recover(v) => simple("metal.recover", v)?,
        MetalCommand::Abort(v) => simple("metal.abort", v)?,
    };
    let machine = c.call(method, &Value::Object(body), None).await?;
    let machine = settle(ctx, &c, machine, wait).await?;
    ctx.print(&machine, Format::Json)
}

pub async fn workflows(ctx: &Context, command: WorkflowsCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    let (method, id) = match command {
        WorkflowsCommand::List { node, page } => {
            body.insert("nodeId".into(), json!(check_id::<NodeId>("--node", &node)?));
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("workflows.list", &Value::Object(body), None).await?, tables::WORKFLOWS);
        }
        WorkflowsCommand::Get { workflow_id } => ("workflows.get", workflow_id),
        WorkflowsCommand::Abort { workflow_id } => ("workflows.abort", workflow_id),
        WorkflowsCommand::Pause { workflow_id } => ("workflows.pause", workflow_id),
        WorkflowsCommand::Resume { workflow_id } => ("workflows.resume", workflow_id),
        WorkflowsCommand::Retry { workflow_id } => ("workflows.retry", workflow_id),
    };
    body.insert("workflowId".into(), json!(check_id::<WorkflowId>("WORKFLOW_ID", &id)?));
    ctx.print(&c.call(method, &Value::Object(body), None).await?, Format::Json)
}
