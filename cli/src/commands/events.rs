//! `events list|get|watch|export`. `watch` follows the log from its end unless `--since` says
//! where to start (`start` or `0`: the beginning); the stream itself is followed by
//! `crate::watch`. `export` reads the database itself (`crate::sim`), as the audit does.

use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::EventsCommand;
use crate::output::Format;
use crate::{credentials, tables, watch};

use super::{Context, check_id};

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
            let value = ctx.client()?.call("events.list", &Value::Object(body), None).await?;
            ctx.print_list(&value, tables::EVENTS)
        }
        EventsCommand::Get { event_id } => {
            let mut body = ctx.tenant_body()?;
            body.insert("eventId".into(), json!(check_id::<bc_core::id::EventId>("EVENT_ID", &event_id)?));
            ctx.print(&ctx.client()?.call("events.get", &Value::Object(body), None).await?, Format::Json)
        }
    }
}
