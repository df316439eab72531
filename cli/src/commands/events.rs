//! `events list|get|watch|export`. `watch` follows the log from its end unless `--since` says
//! where to start (`start` or `0`: the beginning); the stream itself is followed by
//! `crate::watch`. `export` reads the database itself (`crate::sim`), as the audit does.

use std::path::PathBuf;

use clap::Subcommand;
use serde_json::json;

use crate::client::CliError;
use crate::flags::{DatabaseArgs, Deployment, Page};
use crate::output::Format;
use crate::{credentials, tables, watch};

use super::{Context, check_id};

#[derive(Subcommand)]
pub enum EventsCommand {
    /// Page through a tenant's events by outbox position.
    List {
        #[command(flatten)]
        page: Page,
        /// Comma-separated type patterns (`pool.*`).
        #[arg(long)]
        types: Option<String>,
    },
    /// One event with its canonical bytes, hash and signature.
    Get { event_id: String },
    /// Write a tenant's events (--tenant), with their hashes and signatures, to a file that
    /// verifies alone (a CBOR sequence; schema/LOG-FORMAT.md, "Event exports"). Reads the
    /// database directly, like `audit verify`.
    Export {
        /// The first seq (default 1: the chain from its start, which `sim replay` needs).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        from: u64,
        /// The last seq (default: the chain head when the export starts).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        to: Option<u64>,
        /// The file to create (never over an existing file).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// Follow the log live from its end (like `tail -f`): one JSON line per event; reconnects
    /// after a broken connection.
    Watch {
        /// Comma-separated type patterns (`pool.*,node.registered`), at most 20.
        #[arg(long)]
        types: Option<String>,
        /// Start after this position (`COMMIT.INDEX` or `COMMIT:INDEX`), or `start` (or `0`) to
        /// replay the log from its beginning. Default: only events appended from now on.
        #[arg(long)]
        since: Option<String>,
        /// Stop after printing this many events.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
}

pub async fn run(ctx: &Context, command: EventsCommand) -> Result<(), CliError> {
    match command {
        EventsCommand::Watch { types, since, count } => {
            let token = credentials::token(&ctx.global.url)?;
            watch::watch(watch::WatchArgs {
                url: ctx.global.url.clone(),
                token,
                tenant: ctx.global.tenant.clone(),
                types,
                since: since.as_deref().map(watch::Since::parse).transpose()?,
                count,
            })
            .await
        }
        EventsCommand::Export { from, to, out, db, deployment } => {
            let tenant = ctx.tenant_id()?.ok_or_else(|| CliError::usage("events export needs --tenant TENANT_ID"))?;
            let args =
                crate::sim::ExportArgs { tenant, from_seq: from, to_seq: to, out: &out, deployment: &deployment.deployment };
            ctx.print(&crate::sim::export(&db.database(), args).await?, Format::Json)
        }
        EventsCommand::List { page, types } => {
            let mut body = ctx.page_body(&page)?;
            if let Some(types) = types {
                body.insert("types".into(), json!(types.split(',').map(str::trim).collect::<Vec<_>>()));
            }
            let value = ctx.call("events.list", body, None).await?;
            ctx.print_list(&value, tables::EVENTS)
        }
        EventsCommand::Get { event_id } => {
            let mut body = ctx.tenant_body()?;
            body.insert("eventId".into(), json!(check_id::<bc_core::id::EventId>("EVENT_ID", &event_id)?));
            ctx.print(&ctx.call("events.get", body, None).await?, Format::Json)
        }
    }
}
