//! `metal …` (the `metal.*` methods) and `workflows …` (`workflows.*`). The BMC password is
//! read from `--bmc-password-file` only, and a deploy's join token goes to a new 0600 file
//! (`--token-out`), never to the terminal. With `--wait S`, a verb is followed until the
//! machine rests in a stable state, its workflow's steps shown on standard error.

use std::path::{Path, PathBuf};

use bc_core::id::{ImageId, NodeId, PoolId, WorkflowId};
use clap::{Args, Subcommand};
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, Settle, add_if_version, add_page, check_id, idempotency_key, put_id};

/// How long to wait for a machine's workflow to end.
#[derive(Args, Clone, Copy)]
pub struct MetalWait {
    /// Wait up to this many seconds until the machine rests in a stable state (0: do not wait).
    #[arg(long, default_value_t = 0)]
    pub wait: u64,
}

/// A verb on one machine.
#[derive(Args)]
pub struct MachineVerbArgs {
    /// The machine's `node_…` id.
    pub node_id: String,
    #[command(flatten)]
    pub if_version: IfVersion,
    #[command(flatten)]
    pub wait: MetalWait,
}

#[derive(Args)]
pub struct EnrollArgs {
    #[arg(long)]
    pub pool: String,
    #[arg(long)]
    pub name: String,
    /// `https://host[:port]`.
    #[arg(long)]
    pub bmc_address: String,
    #[arg(long)]
    pub bmc_username: String,
    /// A file holding the BMC's password (its first line).
    #[arg(long)]
    pub bmc_password_file: PathBuf,
    /// The ComputerSystem (`/redfish/v1/Systems/…`) when the BMC has several.
    #[arg(long)]
    pub bmc_system_path: Option<String>,
    /// Check the BMC's certificate against the CA certificates in this PEM file.
    #[arg(long, conflicts_with_all = ["bmc_pin", "bmc_insecure"])]
    pub bmc_ca_file: Option<PathBuf>,
    /// Check the BMC's certificate by its public key: `sha256/…`.
    #[arg(long, conflicts_with = "bmc_insecure")]
    pub bmc_pin: Option<String>,
    /// Do not check the BMC's certificate (anyone on the path can read its password).
    #[arg(long)]
    pub bmc_insecure: bool,
    /// The site the machine is at (`site_…`); absent, its pool's, if the pool names one.
    #[arg(long)]
    pub site: Option<String>,
    #[command(flatten)]
    pub key: IdempotencyKey,
}

#[derive(Subcommand)]
pub enum MetalCommand {
    /// Enroll a machine by its BMC (Redfish over HTTPS); the password only from a file.
    Enroll(EnrollArgs),
    /// A tenant's machines.
    List {
        #[arg(long)]
        pool: Option<String>,
        /// Only machines in this state (`available`, `deploy-wait`, …).
        #[arg(long)]
        state: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One machine: state, power, BMC, workflow.
    Get { node_id: String },
    /// Check the BMC and manage the machine (enroll → manageable).
    Manage(MachineVerbArgs),
    /// Read the machine's hardware from its BMC.
    Inspect(MachineVerbArgs),
    /// Clean the machine and offer it (manageable → available).
    Provide(MachineVerbArgs),
    /// Boot an image on the machine through virtual media; it is active once the installed
    /// system's agent joins as its node with the join token written to --token-out.
    Deploy {
        #[command(flatten)]
        verb: MachineVerbArgs,
        /// A registered image (`img_…`) whose URL the BMC's virtual CD boots.
        #[arg(long)]
        image: String,
        /// A new 0600 file for the one-use join token the installed system joins with
        /// (`bcd join --node-id NODE --token-file FILE`).
        #[arg(long)]
        token_out: PathBuf,
    },
    /// Tear down a deployed machine and clean it (drain its node first).
    Undeploy(MachineVerbArgs),
    /// Boot a deployed machine into a rescue image.
    Rescue {
        #[command(flatten)]
        verb: MachineVerbArgs,
        #[arg(long)]
        image: String,
    },
    /// Boot a rescued machine back into its system.
    Unrescue(MachineVerbArgs),
    /// Retire a machine: never offered or deployed again.
    Retire(MachineVerbArgs),
    /// Take a machine out of maintenance.
    Recover(MachineVerbArgs),
    /// Abort the machine's running workflow (in a wait state, or a power change).
    Abort(MachineVerbArgs),
    /// Power a machine on, off, or reboot it.
    Power {
        #[command(flatten)]
        verb: MachineVerbArgs,
        #[arg(value_parser = ["on", "off", "reboot"])]
        power: String,
    },
    /// One destructive verb on several machines as one batch (commandBatches.create): nothing
    /// reaches a BMC until the approvers' quorum signs it (batch approve).
    Bulk(BulkArgs),
}

/// `metal bulk`: the verb, the machines, and what the approvers read.
#[derive(Args)]
pub struct BulkArgs {
    #[arg(long, value_parser = ["undeploy", "deploy", "retire", "power-off"])]
    pub verb: String,
    /// Machines (`node_…`), comma-separated or repeated; duplicates are dropped.
    #[arg(long, value_delimiter = ',')]
    pub nodes: Vec<String>,
    /// A file of machines, one per line (`#` starts a comment).
    #[arg(long, value_name = "FILE")]
    pub nodes_file: Option<PathBuf>,
    /// What the batch's approvers read.
    #[arg(long)]
    pub reason: String,
    /// `deploy`: the registered ISO (`img_…`) each machine boots.
    #[arg(long)]
    pub image: Option<String>,
    /// `deploy`: an existing directory for each machine's join token (`NODE.token`, new 0600
    /// files), which its installed system joins with once the batch is released.
    #[arg(long, value_name = "DIR")]
    pub token_dir: Option<PathBuf>,
    /// Hours the batch stays open for approvals (1 to 72; default 24).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=bc_projections::batch::COMMAND_BATCH_HOURS_MAX))]
    pub hours: Option<u64>,
    /// No batch: apply the verb to each machine now (metal.bulkNow). A deployment with the
    /// approvers' quorum on refuses it beyond one machine (BATCH_REQUIRED).
    #[arg(long, conflicts_with_all = ["hours", "token_dir", "image"])]
    pub now: bool,
    #[command(flatten)]
    pub key: IdempotencyKey,
}

/// Largest `--nodes-file` read.
const NODES_FILE_BYTES_MAX: u64 = 1024 * 1024;

#[derive(Subcommand)]
pub enum WorkflowsCommand {
    /// A machine's workflows.
    List {
        #[arg(long)]
        node: String,
        #[command(flatten)]
        page: Page,
    },
    /// One workflow, by its `wf_…` id.
    Get { workflow_id: String },
    /// Abort a running workflow.
    Abort { workflow_id: String },
    /// Stop running a workflow's steps (its deadline runs on).
    Pause { workflow_id: String },
    /// Run a paused workflow's steps again.
    Resume { workflow_id: String },
    /// Run a backing-off step now, or a failed workflow's verb again.
    Retry { workflow_id: String },
}

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
    add_if_version(&mut body, &verb.if_version);
    Ok(body)
}

/// `--wait`: until the machine rests in a stable state (its workflow no longer runs), read
/// again every 500 ms.
const SETTLE: Settle = Settle {
    get: "metal.get",
    id_field: "nodeId",
    poll_ms: 500,
    progress: |machine| {
        if machine["workflow"]["outcome"] != "running" {
            return None;
        }
        let step = machine["workflow"]["steps"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["state"] == "running"))
            .and_then(|s| s["name"].as_str())
            .unwrap_or("-");
        Some(format!(
            "{}: {} at step {step}",
            machine["state"].as_str().unwrap_or("?"),
            machine["workflow"]["verb"].as_str().unwrap_or("?")
        ))
    },
    timed_out: |_, wait_s| {
        CliError::new("TIMEOUT", format!("the machine's workflow still runs after {wait_s} s"))
            .hint("`metal get` shows where it stands; its workflow fails by itself at its deadline")
    },
};

pub async fn run(ctx: &Context, command: MetalCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let simple =
        |method: &'static str, verb: MachineVerbArgs| -> Result<(&'static str, Map<String, Value>, MetalWait), CliError> {
            Ok((method, machine_body(ctx, &verb)?, verb.wait))
        };
    let (method, body, wait) = match command {
        MetalCommand::Enroll(args) => {
            let key = idempotency_key(&args.key.key);
            let machine = c.call("metal.enroll", &Value::Object(enroll_body(ctx, args)?), Some(&key)).await?;
            return ctx.print(&machine, Format::Json);
        }
        MetalCommand::List { pool, state, page } => {
            let mut body = ctx.tenant_body()?;
            if let Some(p) = pool {
                put_id::<PoolId>(&mut body, "poolId", "--pool", &p)?;
            }
            if let Some(s) = state {
                body.insert("state".into(), json!(s));
            }
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("metal.list", &Value::Object(body), None).await?, tables::MACHINES);
        }
        MetalCommand::Get { node_id } => {
            let mut body = ctx.tenant_body()?;
            put_id::<NodeId>(&mut body, "nodeId", "NODE_ID", &node_id)?;
            return ctx.print(&c.call("metal.get", &Value::Object(body), None).await?, Format::Json);
        }
        MetalCommand::Bulk(args) => {
            let batch = bulk(ctx, &c, args).await?;
            return ctx.print(&batch, Format::Json);
        }
        MetalCommand::Deploy { verb, image, token_out } => {
            let machine = deploy(ctx, &c, verb, &image, &token_out).await?;
            return ctx.print(&machine, Format::Json);
        }
        MetalCommand::Rescue { verb, image } => {
            let mut body = machine_body(ctx, &verb)?;
            put_id::<ImageId>(&mut body, "imageId", "--image", &image)?;
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
    let machine = SETTLE.follow(ctx, &c, machine, wait.wait).await?;
    ctx.print(&machine, Format::Json)
}

/// `metal.enroll`'s body: the BMC's address (https only: its password crosses the network),
/// the password from its file, and how its certificate is checked.
fn enroll_body(ctx: &Context, args: EnrollArgs) -> Result<Map<String, Value>, CliError> {
    let mut body = ctx.tenant_body()?;
    body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", &args.pool)?));
    body.insert("name".into(), json!(args.name));
    if let Some(site) = &args.site {
        body.insert("siteId".into(), json!(check_id::<bc_core::id::SiteId>("--site", site)?));
    }
    if !args.bmc_address.starts_with("https://") {
        return Err(CliError::usage("--bmc-address must be https://: the BMC's password never crosses a network in clear text"));
    }
    body.insert("bmcAddress".into(), json!(args.bmc_address));
    body.insert("bmcUsername".into(), json!(args.bmc_username));
    body.insert("bmcPassword".into(), json!(password(&args.bmc_password_file)?));
    if let Some(path) = args.bmc_system_path {
        body.insert("bmcSystemPath".into(), json!(path));
    }
    let tls = match (args.bmc_ca_file, args.bmc_pin, args.bmc_insecure) {
        (Some(ca), None, false) => json!({ "mode": "ca", "caPem": read_file("--bmc-ca-file", &ca, CA_FILE_BYTES_MAX)? }),
        (None, Some(pin), false) => json!({ "mode": "pin", "pin": pin }),
        (None, None, true) => {
            eprintln!("warning: --bmc-insecure: the BMC's certificate is not checked; `metal get` says so");
            json!({ "mode": "insecure" })
        }
        _ => {
            return Err(CliError::usage("say how the BMC's certificate is checked: --bmc-ca-file, --bmc-pin or --bmc-insecure"));
        }
    };
    body.insert("bmcTls".into(), tls);
    Ok(body)
}

/// `metal deploy`: the join token the answer carries goes to the new file `token_out`, never
/// to the terminal; then the machine is followed as any verb's.
async fn deploy(ctx: &Context, c: &Client, verb: MachineVerbArgs, image: &str, token_out: &Path) -> Result<Value, CliError> {
    // Refused before the call: a token made for a file that cannot be written is lost.
    if token_out.exists() {
        return Err(CliError::new("ALREADY_EXISTS", format!("{} exists", token_out.display()))
            .hint("--token-out never overwrites: give a new file"));
    }
    let mut body = machine_body(ctx, &verb)?;
    put_id::<ImageId>(&mut body, "imageId", "--image", image)?;
    let answer = c.call("metal.deploy", &Value::Object(body), None).await?;
    if let Some(token) = answer["joinToken"].as_str() {
        bc_core::keys::write_secret_file(token_out, format!("{token}\n").as_bytes()).map_err(|e| {
            CliError::from(e).hint("the deploy started; abort it (metal abort) and deploy again with a writable --token-out")
        })?;
        eprintln!("join token written to {} (0600)", token_out.display());
    }
    SETTLE.follow(ctx, c, answer["machine"].clone(), verb.wait.wait).await
}

/// `metal bulk`: the machines of `--nodes` and `--nodes-file`, deduplicated in order, as the
/// leaves of one batch of the verb's `metal.*` kind; a deploy's join tokens go to new 0600 files
/// in `--token-dir`, never to the terminal.
async fn bulk(ctx: &Context, c: &Client, args: BulkArgs) -> Result<Value, CliError> {
    let mut nodes: Vec<String> = Vec::new();
    let mut listed = args.nodes.clone();
    if let Some(path) = &args.nodes_file {
        let text = read_file("--nodes-file", path, NODES_FILE_BYTES_MAX)?;
        listed.extend(text.lines().map(|l| l.split('#').next().unwrap_or("").trim().to_owned()).filter(|l| !l.is_empty()));
    }
    for node in listed {
        let node = check_id::<NodeId>("--nodes", &node)?;
        if !nodes.contains(&node) {
            nodes.push(node);
        }
    }
    if nodes.is_empty() {
        return Err(CliError::usage("name the machines: --nodes node_…,node_… or --nodes-file FILE"));
    }
    // The leaf kinds (`decide::batch`), named by their constants: not all are methods.
    use bc_projections::decide::batch::{LEAF_METAL_DEPLOY, LEAF_METAL_POWER_OFF, LEAF_METAL_RETIRE, LEAF_METAL_UNDEPLOY};
    let kind = match args.verb.as_str() {
        "undeploy" => LEAF_METAL_UNDEPLOY,
        "deploy" => LEAF_METAL_DEPLOY,
        "retire" => LEAF_METAL_RETIRE,
        _ => LEAF_METAL_POWER_OFF,
    };
    if args.now {
        let mut body = ctx.tenant_body()?;
        let verb = if kind == LEAF_METAL_POWER_OFF { "powerOff" } else { args.verb.as_str() };
        body.insert("verb".into(), json!(verb));
        body.insert("nodeIds".into(), json!(nodes));
        return c.call("metal.bulkNow", &Value::Object(body), None).await;
    }
    let payload = match (kind, &args.image, &args.token_dir) {
        (LEAF_METAL_DEPLOY, Some(image), Some(dir)) => {
            if !dir.is_dir() {
                return Err(CliError::usage(format!("--token-dir {} is not a directory", dir.display())));
            }
            // Refused before the call: a token made for a file that cannot be written is lost.
            if let Some(taken) = nodes.iter().map(|n| dir.join(format!("{n}.token"))).find(|p| p.exists()) {
                return Err(CliError::new("ALREADY_EXISTS", format!("{} exists", taken.display()))
                    .hint("--token-dir never overwrites: give a new directory"));
            }
            json!({ "imageId": check_id::<ImageId>("--image", image)? })
        }
        (LEAF_METAL_DEPLOY, _, _) => return Err(CliError::usage("--verb deploy needs --image IMG and --token-dir DIR")),
        (_, None, None) => json!({}),
        _ => return Err(CliError::usage("--image and --token-dir go with --verb deploy only")),
    };
    let mut body = ctx.tenant_body()?;
    body.insert("reason".into(), json!(args.reason));
    let leaves: Vec<Value> = nodes.iter().map(|n| json!({ "subject": n, "kind": kind, "payload": payload })).collect();
    body.insert("leaves".into(), Value::Array(leaves));
    if let Some(hours) = args.hours {
        body.insert("hours".into(), json!(hours));
    }
    let key = idempotency_key(&args.key.key);
    let mut batch = c.call("commandBatches.create", &Value::Object(body), Some(&key)).await?;
    if let (Some(tokens), Some(dir)) = (batch.as_object_mut().and_then(|b| b.remove("joinTokens")), &args.token_dir) {
        for (node, token) in tokens.as_object().into_iter().flatten() {
            let path = dir.join(format!("{}.token", check_id::<NodeId>("a joinTokens machine", node)?));
            let token = token.as_str().unwrap_or_default();
            bc_core::keys::write_secret_file(&path, format!("{token}\n").as_bytes()).map_err(|e| {
                CliError::from(e)
                    .hint("the batch is made: cancel it (batch cancel) and make it again with a writable --token-dir")
            })?;
        }
        eprintln!("join tokens written to {} (NODE.token, 0600)", dir.display());
    }
    if let Some(id) = batch["batchId"].as_str() {
        eprintln!(
            "batch {id} holds {} {kind} leaves; nothing runs until the approvers sign it: batch approve --batch {id} --key PATH",
            nodes.len()
        );
    }
    Ok(batch)
}

pub async fn workflows(ctx: &Context, command: WorkflowsCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    let (method, id) = match command {
        WorkflowsCommand::List { node, page } => {
            put_id::<NodeId>(&mut body, "nodeId", "--node", &node)?;
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("workflows.list", &Value::Object(body), None).await?, tables::WORKFLOWS);
        }
        WorkflowsCommand::Get { workflow_id } => ("workflows.get", workflow_id),
        WorkflowsCommand::Abort { workflow_id } => ("workflows.abort", workflow_id),
        WorkflowsCommand::Pause { workflow_id } => ("workflows.pause", workflow_id),
        WorkflowsCommand::Resume { workflow_id } => ("workflows.resume", workflow_id),
        WorkflowsCommand::Retry { workflow_id } => ("workflows.retry", workflow_id),
    };
    put_id::<WorkflowId>(&mut body, "workflowId", "WORKFLOW_ID", &id)?;
    ctx.print(&c.call(method, &Value::Object(body), None).await?, Format::Json)
}
