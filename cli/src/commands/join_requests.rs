//! `join-requests list|approve|reject`: the `joinRequests.*` methods, the machines that asked
//! to join without a token (`bcd join --request`). Requests are the root tenant's; `approve`
//! admits the machine into a pool of `--tenant` (the caller's own when absent), `reject` ends
//! its wait with `--reason`, which the machine prints.

use bc_core::id::{JoinRequestId, PoolId};
use clap::Subcommand;
use serde_json::{Map, json};

use crate::client::CliError;
use crate::flags::{IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, check_id, put_id};

/// Longest `--reason`, in characters (`JOIN_REQUEST_REASON_CHARS_MAX` on the server).
const REASON_CHARS_MAX: usize = 500;

#[derive(Subcommand)]
pub enum JoinRequestsCommand {
    /// The machines that asked to join, newest decisions included (`--pending`: only those waiting).
    List {
        /// Only the requests still waiting for a decision.
        #[arg(long)]
        pending: bool,
        #[command(flatten)]
        page: Page,
    },
    /// Admit a waiting machine into a pool (of --tenant): it joins when it asks next.
    Approve {
        join_request_id: String,
        #[arg(long)]
        pool: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Turn a waiting machine down: `bcd join --request` there exits 1 with the reason.
    Reject {
        join_request_id: String,
        /// Why (1 to 500 characters): the machine prints it.
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

pub async fn run(ctx: &Context, command: JoinRequestsCommand) -> Result<(), CliError> {
    let value = match command {
        JoinRequestsCommand::List { pending, page } => {
            let mut body = Map::new();
            if pending {
                body.insert("pending".into(), json!(true));
            }
            return ctx.list("joinRequests.list", body, &page, tables::JOIN_REQUESTS).await;
        }
        JoinRequestsCommand::Approve { join_request_id, pool, if_version } => {
            let mut body = ctx.tenant_body()?;
            body.insert("joinRequestId".into(), json!(check_id::<JoinRequestId>("JOIN_REQUEST_ID", &join_request_id)?));
            put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            if let Some(v) = if_version.if_version {
                body.insert("ifVersion".into(), json!(v));
            }
            ctx.call("joinRequests.approve", body, None).await?
        }
        JoinRequestsCommand::Reject { join_request_id, reason, if_version } => {
            let mut body = Map::new();
            body.insert("joinRequestId".into(), json!(check_id::<JoinRequestId>("JOIN_REQUEST_ID", &join_request_id)?));
            if reason.is_empty() || reason.chars().count() > REASON_CHARS_MAX {
                return Err(CliError::usage(format!("--reason is 1 to {REASON_CHARS_MAX} characters: the machine prints it")));
            }
            body.insert("reason".into(), json!(reason));
            if let Some(v) = if_version.if_version {
                body.insert("ifVersion".into(), json!(v));
            }
            ctx.call("joinRequests.reject", body, None).await?
        }
    };
    ctx.print(&value, Format::Json)
}
