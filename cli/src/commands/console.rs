//! `console`: a terminal on a node (or an instance's serial console) through its agent
//! (`schema/TUNNELS.md`): `tunnels.open` for a ticket, then the WebSocket, the local terminal
//! in raw mode until the remote program exits (`crate::tunnel`). The command's exit status is
//! the remote program's (`REMOTE_EXIT`), 255 when the tunnel broke, 0 after a detach (Ctrl-]).
//! [`terminal`] is `exec`'s too.

use bc_core::id::{InstanceId, NodeId};
use clap::Args;
use serde_json::{Map, Value, json};

use super::{Context, check_id};
use crate::client::CliError;
use crate::tunnel;

#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct ConsoleArgs {
    /// A shell on this node, as the user its agent runs as.
    #[arg(long, value_name = "NODE_ID")]
    pub node: Option<String>,
    /// This running instance's serial console.
    #[arg(long, value_name = "INSTANCE_ID")]
    pub instance: Option<String>,
}

pub async fn run(ctx: &Context, args: ConsoleArgs) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    body.insert("op".into(), json!("console"));
    match (&args.node, &args.instance) {
        (Some(node), _) => body.insert("nodeId".into(), json!(check_id::<NodeId>("--node", node)?)),
        (_, Some(instance)) => body.insert("instanceId".into(), json!(check_id::<InstanceId>("--instance", instance)?)),
        (None, None) => return Err(CliError::usage("give --node or --instance")),
    };
    terminal(ctx, body).await
}

/// Opens the tunnel `body` asks `tunnels.open` for and attaches the local terminal to it; the
/// remote program's status is the command's (`REMOTE_EXIT`).
pub async fn terminal(ctx: &Context, body: Map<String, Value>) -> Result<(), CliError> {
    terminal_by(ctx, "tunnels.open", body).await
}

/// [`terminal`] with the ticket from `method` (`tunnels.open`, `sandboxes.exec`).
pub async fn terminal_by(ctx: &Context, method: &str, body: Map<String, Value>) -> Result<(), CliError> {
    // The URL, the token and the client are checked before any ticket is spent.
    let api = crate::client::api_url(&ctx.global.url)?;
    let token = crate::credentials::token(&ctx.global.url)?;
    let http = tunnel::upgrade_client(&api)?;
    let answer = ctx.call(method, body, None).await?;
    let ticket = tunnel::ticket_of(&answer)?;
    let socket = tunnel::connect(&http, &api, &ticket, &token).await?;
    let outcome = tunnel::attach(socket).await?;
    if let tunnel::Outcome::Broken(why) = &outcome {
        eprintln!("\r\nthe tunnel broke: {}\r", crate::output::safe_text(why));
    }
    if let tunnel::Outcome::Ended(bc_core::tunnel::End::Broken { message, .. }) = &outcome {
        eprintln!("\r\nthe tunnel ended: {}\r", crate::output::safe_text(message));
    }
    match outcome.exit_status() {
        0 => Ok(()),
        status => {
            let mut error = CliError::new("REMOTE_EXIT", format!("the remote program exited with status {status}"));
            error.details = Some(json!({ "exitStatus": status }));
            Err(error)
        }
    }
}
