//! `pools list|get|create`.

use bc_core::id::PoolId;
use clap::Subcommand;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, idempotency_key, labels, put_id};

#[derive(Subcommand)]
pub enum PoolsCommand {
    List {
        #[command(flatten)]
        page: Page,
        #[arg(long)]
        include_archived: bool,
    },
    Get {
        pool_id: String,
    },
    Create {
        #[arg(long)]
        name: String,
        #[arg(long, default_value = "")]
        description: String,
        /// `key=value`, repeatable.
        #[arg(long = "label")]
        labels: Vec<String>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
}

pub async fn run(ctx: &Context, command: PoolsCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    match command {
        PoolsCommand::List { page, include_archived } => {
            let mut body = ctx.page_body(&page)?;
            body.insert("includeArchived".into(), json!(include_archived));
            ctx.print_list(&c.call("pools.list", &Value::Object(body), None).await?, tables::POOLS)
        }
        PoolsCommand::Get { pool_id } => {
            let mut body = ctx.tenant_body()?;
            put_id::<PoolId>(&mut body, "poolId", "POOL_ID", &pool_id)?;
            ctx.print(&c.call("pools.get", &Value::Object(body), None).await?, Format::Json)
        }
        PoolsCommand::Create { name, description, labels: items, key } => {
            let mut body = ctx.tenant_body()?;
            body.insert("name".into(), json!(name));
            body.insert("description".into(), json!(description));
            body.insert("labels".into(), labels(&items)?);
            let key = idempotency_key(&key.key);
            ctx.print(&c.call("pools.create", &Value::Object(body), Some(&key)).await?, Format::Json)
        }
    }
}
