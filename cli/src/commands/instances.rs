//! `instances create|list|get|start|stop|resize|delete` (the `instances.*` methods). With
//! `--wait S`, a change is followed until the node observes what was asked (the state is no
//! longer `pending` or `deleting`), with its progress on standard error.

use bc_core::id::{FlavorId, InstanceId, ReservationId};
use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, Settle, add_if_version, add_page, idempotency_key, put_id};

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
        /// The image: by id (`img_…`) or by channel (`NAME@stable`, `NAME@testing`).
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
        /// Only the instances made in this project (`proj_…`: their reservation's).
        #[arg(long)]
        project: Option<String>,
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

/// `--wait`: until the node observes what was asked (the state is no longer `pending` or
/// `deleting`), read again every 250 ms.
const SETTLE: Settle = Settle {
    get: "instances.get",
    id_field: "instanceId",
    poll_ms: 250,
    progress: |instance| {
        let state = instance["state"].as_str().unwrap_or_default();
        if state != "pending" && state != "deleting" {
            return None;
        }
        let observed = instance["observed"]["state"].as_str().unwrap_or("nothing yet");
        Some(format!("{state}: the node observes {observed}, desired {}", instance["desired"].as_str().unwrap_or("")))
    },
    timed_out: |instance, wait_s| {
        let state = instance["state"].as_str().unwrap_or_default();
        CliError::new("TIMEOUT", format!("the instance is still {state} after {wait_s} s"))
            .hint("`instances get` shows where it stands; the node may be away or fetching the image")
    },
};

pub async fn run(ctx: &Context, command: InstancesCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let c = ctx.client()?;
    let (method, wait, key) = match command {
        InstancesCommand::List { reservation, project, page } => {
            if let Some(r) = reservation {
                put_id::<ReservationId>(&mut body, "reservationId", "--reservation", &r)?;
            }
            if let Some(p) = project {
                put_id::<bc_core::id::ProjectId>(&mut body, "projectId", "--project", &p)?;
            }
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("instances.list", &Value::Object(body), None).await?, tables::INSTANCES);
        }
        InstancesCommand::Get { instance_id } => {
            put_id::<InstanceId>(&mut body, "instanceId", "INSTANCE_ID", &instance_id)?;
            return ctx.print(&c.call("instances.get", &Value::Object(body), None).await?, Format::Json);
        }
        InstancesCommand::Create { name, reservation, flavor, image, stopped, wait, key } => {
            body.insert("name".into(), json!(name));
            put_id::<ReservationId>(&mut body, "reservationId", "--reservation", &reservation)?;
            put_id::<FlavorId>(&mut body, "flavorId", "--flavor", &flavor)?;
            super::put_image(&mut body, &image)?;
            body.insert("start".into(), json!(!stopped));
            ("instances.create", wait, Some(idempotency_key(&key.key)))
        }
        InstancesCommand::Start { instance_id, if_version, wait } => {
            put_id::<InstanceId>(&mut body, "instanceId", "INSTANCE_ID", &instance_id)?;
            add_if_version(&mut body, &if_version);
            ("instances.start", wait, None)
        }
        InstancesCommand::Stop { instance_id, if_version, wait } => {
            put_id::<InstanceId>(&mut body, "instanceId", "INSTANCE_ID", &instance_id)?;
            add_if_version(&mut body, &if_version);
            ("instances.stop", wait, None)
        }
        InstancesCommand::Delete { instance_id, if_version, wait } => {
            put_id::<InstanceId>(&mut body, "instanceId", "INSTANCE_ID", &instance_id)?;
            add_if_version(&mut body, &if_version);
            ("instances.delete", wait, None)
        }
        InstancesCommand::Resize { instance_id, flavor, if_version, wait } => {
            put_id::<InstanceId>(&mut body, "instanceId", "INSTANCE_ID", &instance_id)?;
            put_id::<FlavorId>(&mut body, "flavorId", "--flavor", &flavor)?;
            add_if_version(&mut body, &if_version);
            ("instances.resize", wait, None)
        }
    };
    let instance = c.call(method, &Value::Object(body), key.as_deref()).await?;
    let instance = SETTLE.follow(ctx, &c, instance, wait.wait).await?;
    ctx.print(&instance, Format::Json)
}
