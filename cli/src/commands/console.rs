//! `console`: a terminal on a node (or an instance's serial console) through its agent
//! (`schema/TUNNELS.md`): `tunnels.open` for a ticket, then the WebSocket, the local terminal
//! in raw mode until the remote program exits (`crate::tunnel`). The command's exit status is
//! the remote program's (`REMOTE_EXIT`), 255 when the tunnel broke, 0 after a detach (Ctrl-]).

use clap::Args;
use serde_json::{Map, json};

use super::Context;
use crate::client::CliError;
use crate::tunnel;

#[derive(Args, Debug)]
#[group(required = true, multiple = false)]
pub struct ConsoleArgs {
    /// A shell on this node, as the user its agent runs as.
    #[arg(long, value_name = "NODE_ID")]
    pub node: Option<String>,
    /// This instance's serial console.
    #[arg(long, value_name = "INSTANCE_ID")]
    pub instance: Option<String>,
}

pub async fn run(ctx: &Context, args: ConsoleArgs) -> Result<(), CliError> {
    let api = url::Url::parse(&ctx.global.url).map_err(|e| CliError::usage(format!("--url {:?}: {e}", ctx.global.url)))?;
    // Refused before any ticket is granted: this client speaks plain ws:// only.
    if api.scheme() != "http" {
        return Err(CliError::new("UNSUPPORTED", "console opens tunnels over plain http:// (ws://) only for now")
            .hint("reach the gateway on a loopback address, or use a WebSocket client that speaks schema/TUNNELS.md"));
    }
    let mut body = Map::new();
    body.insert("op".into(), json!("console"));
    match (&args.node, &args.instance) {
        (Some(node), _) => body.insert("nodeId".into(), json!(node)),
        (_, Some(instance)) => body.insert("instanceId".into(), json!(instance)),
        (None, None) => return Err(CliError::usage("give --node or --instance")),
    };
    let ticket = ctx.call("tunnels.open", body, None).await?;
    let path = ticket["url"].as_str().ok_or_else(|| CliError::new("INVALID_RESPONSE", "tunnels.open answered no url"))?;
    let token = crate::credentials::token(&ctx.global.url)?;
    let outcome = tunnel::attach(&tunnel::socket_url(&api, path)?, &token).await?;
    if let tunnel::Outcome::Broken(why) = &outcome {
        eprintln!("\r\nthe tunnel broke: {why}\r");
    }
    if let tunnel::Outcome::Ended(bc_core::tunnel::End::Broken { message, .. }) = &outcome {
        eprintln!("\r\nthe tunnel ended: {message}\r");
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
