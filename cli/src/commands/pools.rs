//! `pools list|get|create|update|archive|offer|unoffer`.

use bc_core::id::{PoolId, TenantId};
use clap::Subcommand;
use serde_json::{Map, Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, IfVersion, Page, parse_max_reservation_s};
use crate::output::Format;
use crate::tables;

use super::{Context, add_if_version, check_id, idempotency_key, labels, put_id};

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
    /// Change a pool in place (`pools.update`): only what is given; never its site.
    Update {
        pool_id: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        description: Option<String>,
        /// `key=value`, repeatable: the pool's labels, all of them (they replace its own).
        #[arg(long = "label")]
        labels: Vec<String>,
        /// Remove every label.
        #[arg(long, conflicts_with = "labels")]
        clear_labels: bool,
        /// The longest reservation the pool takes (`8h`, `7d`: whole seconds, a minute to 366
        /// days).
        #[arg(long, value_parser = parse_max_reservation_s, value_name = "DURATION")]
        max_reservation: Option<u64>,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Archive a pool for good (`pools.archive`): it takes no new reservation or machine, and no
    /// longer holds its site; archiving it again changes nothing.
    Archive {
        pool_id: String,
        #[command(flatten)]
        if_version: IfVersion,
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

/// What `pools update` changes: the fields given, into `body` (which names the pool already).
/// Nothing given is a usage error, before anything is sent.
fn add_update_fields(
    body: &mut Map<String, Value>,
    name: Option<String>,
    description: Option<String>,
    (items, clear_labels): (&[String], bool),
    max_reservation_s: Option<u64>,
) -> Result<(), CliError> {
    if name.is_none() && description.is_none() && items.is_empty() && !clear_labels && max_reservation_s.is_none() {
        return Err(CliError::usage(
            "nothing to update: give --name, --description, --label, --clear-labels or --max-reservation",
        ));
    }
    if let Some(name) = name {
        body.insert("name".into(), json!(name));
    }
    if let Some(description) = description {
        body.insert("description".into(), json!(description));
    }
    if !items.is_empty() || clear_labels {
        body.insert("labels".into(), labels(items)?);
    }
    if let Some(seconds) = max_reservation_s {
        body.insert("maxReservationS".into(), json!(seconds));
    }
    Ok(())
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
        PoolsCommand::Update { pool_id, name, description, labels: items, clear_labels, max_reservation, if_version } => {
            let mut body = ctx.tenant_body()?;
            put_id::<PoolId>(&mut body, "poolId", "POOL_ID", &pool_id)?;
            add_update_fields(&mut body, name, description, (&items, clear_labels), max_reservation)?;
            add_if_version(&mut body, &if_version);
            ctx.print(&c.call("pools.update", &Value::Object(body), None).await?, Format::Json)
        }
        PoolsCommand::Archive { pool_id, if_version } => {
            let mut body = ctx.tenant_body()?;
            put_id::<PoolId>(&mut body, "poolId", "POOL_ID", &pool_id)?;
            add_if_version(&mut body, &if_version);
            ctx.print(&c.call("pools.archive", &Value::Object(body), None).await?, Format::Json)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the fields given are sent; `--clear-labels` sends no labels at all; nothing given
    /// is a usage error.
    #[test]
    fn an_update_sends_only_what_is_given() {
        let mut body = Map::new();
        add_update_fields(&mut body, Some("gpu-b".into()), None, (&["tier=a".into()], false), Some(3600)).unwrap();
        assert_eq!(Value::Object(body), json!({ "name": "gpu-b", "labels": { "tier": "a" }, "maxReservationS": 3600 }));
        let mut body = Map::new();
        add_update_fields(&mut body, None, Some(String::new()), (&[], true), None).unwrap();
        assert_eq!(Value::Object(body), json!({ "description": "", "labels": {} }));
        let err = add_update_fields(&mut Map::new(), None, None, (&[], false), None).unwrap_err();
        assert!(err.message.contains("nothing to update"), "{}", err.message);
        assert!(add_update_fields(&mut Map::new(), None, None, (&["no-equals".into()], false), None).is_err());
        assert_eq!(parse_max_reservation_s("8h"), Ok(8 * 3600));
        assert!(parse_max_reservation_s("30s").is_err(), "under a minute");
        assert!(parse_max_reservation_s("400d").is_err(), "over 366 days");
    }
}
