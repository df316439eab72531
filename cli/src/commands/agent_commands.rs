//! `commands issue|list|get|cancel`: the `commands.*` methods, work for a node's agent. Only
//! nodes that joined with `bcd join` take commands; the gateway refuses the rest.

use bc_core::id::{CommandId, NodeId};
use clap::Subcommand;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, Page, parse_duration_s};
use crate::output::Format;
use crate::tables;

use super::{Context, check_id, put_id};

#[derive(Subcommand)]
pub enum CommandsCommand {
    /// Send a command to a node's agent: `ping`, `gpu.hold`, `gpu.release`.
    Issue {
        /// The node (one that joined with `bcd join`).
        #[arg(long)]
        node: String,
        /// `ping`, `gpu.hold` or `gpu.release`.
        kind: String,
        /// The kind's arguments as a JSON object (`{"reservationId":"rsv_…","gpus":[0,1]}`).
        #[arg(long, value_name = "JSON")]
        args: Option<String>,
        /// How long the node has to run it: `30s`, `5m`, `1h` (at most a day; default 5m).
        #[arg(long, value_parser = parse_duration_s)]
        deadline: Option<u64>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's commands, of one node with --node.
    List {
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One command.
    Get { command_id: String },
    /// Cancel a command that has not finished.
    Cancel { command_id: String },
}

pub async fn run(ctx: &Context, command: CommandsCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let id = |text: &str| check_id::<CommandId>("COMMAND_ID", text);
    let value = match command {
        CommandsCommand::List { node, page } => {
            if let Some(node) = node {
                put_id::<NodeId>(&mut body, "nodeId", "--node", &node)?;
            }
            return ctx.list("commands.list", body, &page, tables::COMMANDS).await;
        }
        CommandsCommand::Get { command_id } => {
            body.insert("commandId".into(), json!(id(&command_id)?));
            ctx.call("commands.get", body, None).await?
        }
        CommandsCommand::Cancel { command_id } => {
            body.insert("commandId".into(), json!(id(&command_id)?));
            ctx.call("commands.cancel", body, None).await?
        }
        CommandsCommand::Issue { node, kind, args, deadline, key } => {
            put_id::<NodeId>(&mut body, "nodeId", "--node", &node)?;
            body.insert("kind".into(), json!(kind));
            if let Some(args) = args {
                let parsed: Value =
                    serde_json::from_str(&args).map_err(|e| CliError::usage(format!("--args is not JSON: {e}")))?;
                if !parsed.is_object() {
                    return Err(CliError::usage("--args is a JSON object: {\"reservationId\":\"rsv_…\"}"));
                }
                body.insert("args".into(), parsed);
            }
            if let Some(s) = deadline {
                body.insert("deadlineS".into(), json!(s));
            }
            ctx.create("commands.issue", body, &key).await?
        }
    };
    ctx.print(&value, Format::Json)
}
