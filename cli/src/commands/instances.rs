//! `instances create|list|get|start|stop|resize|delete` (the `instances.*` methods). With
//! `--wait S`, a change is followed until the node observes what was asked (the state is no
//! longer `pending` or `deleting`), with its progress on standard error.

use std::time::{Duration, Instant};

use bc_core::id::{FlavorId, ImageId, InstanceId, ReservationId};
use clap::{Args, Subcommand};
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, add_page, check_id, idempotency_key};

/// How long to wait for an instance to settle.
#[derive(Args, Clone, Copy)]
pub struct InstanceWait {
    /// Wait up to this many seconds until the node observes what was asked (0: do not wait).
    #[arg(long, default_value_t = 0)]
    pub wait: u64,
}

#[derive(Subcommand)]
pub enum InstancesCommand {
    /// An instance on an active reservation whose GPUs its node holds, from a flavor of the
    /// reservation's pool (as many GPUs) and a registered image; started unless --stopped.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        reservation: String,
        #[arg(long)]
        flavor: String,
        #[arg(long)]
        image: String,
        /// Define it, but do not start it.
        #[arg(long)]
        stopped: bool,
        #[command(flatten)]
        wait: InstanceWait,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's instances, on one reservation with --reservation.
    List {
        #[arg(long)]
        reservation: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One instance, by its `inst_…` id, with what its node observes.
    Get { instance_id: String },
    /// Start an instance.
    Start {
        instance_id: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
    /// Stop an instance.
    Stop {
        instance_id: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
    /// Give an instance another flavor of its pool, with as many GPUs.
    Resize {
        instance_id: String,
        #[arg(long)]
        flavor: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
    /// Delete an instance from its node.
    Delete {
        instance_id: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
}

/// How often `--wait` reads the instance again.
const WAIT_POLL_MS: u64 = 250;

fn add_if_version(body: &mut Map<String, Value>, if_version: &IfVersion) {
    if let Some(v) = if_version.if_version {
        body.insert("ifVersion".into(), json!(v));
    }
}

/// Follows the instance until it settles, or `wait.wait` seconds pass (then exit 1, with the
/// instance as it stands printed).
async fn settle(ctx: &Context, c: &Client, mut instance: Value, wait: InstanceWait) -> Result<Value, CliError> {
    if wait.wait == 0 {
        return Ok(instance);
    }
    let deadline = Instant::now() + Duration::from_secs(wait.wait);
    let mut shown = String::new();
    loop {
        let state = instance["state"].as_str().unwrap_or_default().to_owned();
        if state != "pending" && state != "deleting" {
            return Ok(instance);
        }
        let observed = instance["observed"]["state"].as_str().unwrap_or("nothing yet");
        let line = format!("{state}: the node observes {observed}, desired {}", instance["desired"].as_str().unwrap_or(""));
        if line != shown {
            eprintln!("{line}…");
            shown = line;
        }
        if Instant::now() >= deadline {
            ctx.print(&instance, Format::Json)?;
            return Err(CliError::new("TIMEOUT", format!("the instance is still {state} after {} s", wait.wait))
                .hint("`instances get` shows where it stands; the node may be away or fetching the image"));
        }
        tokio::time::sleep(Duration::from_millis(WAIT_POLL_MS)).await;
        let mut get = ctx.tenant_body()?;
        get.insert("instanceId".into(), instance["instanceId"].clone());
        instance = c.call("instances.get", &Value::Object(get), None).await?;
    }
}

pub async fn run(ctx: &Context, command: InstancesCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let c = ctx.client()?;
    let (method, wait, key) = match command {
        InstancesCommand::List { reservation, page } => {
            if let Some(r) = reservation {
                body.insert("reservationId".into(), json!(check_id::<ReservationId>("--reservation", &r)?));
            }
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("instances.list", &Value::Object(body), None).await?, tables::INSTANCES);
        }
        InstancesCommand::Get { instance_id } => {
            body.insert("instanceId".into(), json!(check_id::<InstanceId>("INSTANCE_ID", &instance_id)?));
            return ctx.print(&c.call("instances.get", &Value::Object(body), None).await?, Format::Json);
        }
        InstancesCommand::Create { name, reservation, flavor, image, stopped, wait, key } => {
            body.insert("name".into(), json!(name));
            body.insert("reservationId".into(), json!(check_id::<ReservationId>("--reservation", &reservation)?));
            body.insert("flavorId".into(), json!(check_id::<FlavorId>("--flavor", &flavor)?));
            body.insert("imageId".into(), json!(check_id::<ImageId>("--image", &image)?));
            body.insert("start".into(), json!(!stopped));
            ("instances.create", wait, Some(idempotency_key(&key.key)))
        }
        InstancesCommand::Start { instance_id, if_version, wait } => {
            body.insert("instanceId".into(), json!(check_id::<InstanceId>("INSTANCE_ID", &instance_id)?));
            add_if_version(&mut body, &if_version);
            ("instances.start", wait, None)
        }
        InstancesCommand::Stop { instance_id, if_version, wait } => {
            body.insert("instanceId".into(), json!(check_id::<InstanceId>("INSTANCE_ID", &instance_id)?));
            add_if_version(&mut body, &if_version);
            ("instances.stop", wait, None)
        }
        InstancesCommand::Delete { instance_id, if_version, wait } => {
            body.insert("instanceId".into(), json!(check_id::<InstanceId>("INSTANCE_ID", &instance_id)?));
            add_if_version(&mut body, &if_version);
            ("instances.delete", wait, None)
        }
        InstancesCommand::Resize { instance_id, flavor, if_version, wait } => {
            body.insert("instanceId".into(), json!(check_id::<InstanceId>("INSTANCE_ID", &instance_id)?));
            body.insert("flavorId".into(), json!(check_id::<FlavorId>("--flavor", &flavor)?));
            add_if_version(&mut body, &if_version);
            ("instances.resize", wait, None)
        }
    };
    let instance = c.call(method, &Value::Object(body), key.as_deref()).await?;
    let instance = settle(ctx, &c, instance, wait).await?;
    ctx.print(&instance, Format::Json)
}
