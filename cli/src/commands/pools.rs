//! `pools list|get|create|offer|unoffer`.

use bc_core::id::{PoolId, TenantId};
use clap::Subcommand;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, check_id, idempotency_key, labels, put_id};

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
        /// The site its machines are at (`site_…`); a pool's site never changes.
        #[arg(long)]
        site: Option<String>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// Offer a pool to other tenants, who then reserve from it under their own quota
    /// (`pools.offer`). Offering a tenant that is offered already changes nothing.
    Offer {
        pool_id: String,
        /// A tenant to offer the pool to, repeatable (`--tenant` is the tenant acting, the
        /// pool's owner).
        #[arg(long = "tenant-id", value_name = "TENANT", required = true)]
        tenant_ids: Vec<String>,
    },
    /// Withdraw a pool's offer (`pools.unoffer`): the tenants' active reservations run to their
    /// end, their queued ones are cancelled, and nothing new of theirs is placed.
    Unoffer {
        pool_id: String,
        /// A tenant to withdraw the offer from, repeatable.
        #[arg(long = "tenant-id", value_name = "TENANT", required = true)]
        tenant_ids: Vec<String>,
    },
}

/// The body of `pools.offer` / `pools.unoffer`, every id checked before anything is sent.
fn offer_body(ctx: &Context, pool_id: &str, tenant_ids: &[String]) -> Result<Value, CliError> {
    let mut body = ctx.tenant_body()?;
    put_id::<PoolId>(&mut body, "poolId", "POOL_ID", pool_id)?;
    let ids = tenant_ids.iter().map(|t| check_id::<TenantId>("--tenant-id", t)).collect::<Result<Vec<_>, _>>()?;
    body.insert("tenantIds".into(), json!(ids));
    Ok(Value::Object(body))
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
        PoolsCommand::Create { name, description, labels: items, site, key } => {
            let mut body = ctx.tenant_body()?;
            body.insert("name".into(), json!(name));
            body.insert("description".into(), json!(description));
            body.insert("labels".into(), labels(&items)?);
            if let Some(site) = site {
                put_id::<bc_core::id::SiteId>(&mut body, "siteId", "--site", &site)?;
            }
            let key = idempotency_key(&key.key);
            ctx.print(&c.call("pools.create", &Value::Object(body), Some(&key)).await?, Format::Json)
        }
        PoolsCommand::Offer { pool_id, tenant_ids } => {
            let body = offer_body(ctx, &pool_id, &tenant_ids)?;
            ctx.print(&c.call("pools.offer", &body, None).await?, Format::Json)
        }
        PoolsCommand::Unoffer { pool_id, tenant_ids } => {
            let body = offer_body(ctx, &pool_id, &tenant_ids)?;
            ctx.print(&c.call("pools.unoffer", &body, None).await?, Format::Json)
        }
    }
}
