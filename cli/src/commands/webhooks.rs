//! `webhooks …`: the `webhooks.*` methods with typed flags. A signing secret is printed once, or
//! with `--secret-out FILE` written to a new 0600 file (never over one that exists) and left out
//! of the output.

use std::path::PathBuf;

use bc_core::id::WebhookId;
use clap::Subcommand;
use serde_json::{Map, Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, add_page, check_id, idempotency_key};

#[derive(Subcommand)]
pub enum WebhooksCommand {
    /// A tenant's webhooks.
    List {
        #[command(flatten)]
        page: Page,
    },
    Get {
        webhook_id: String,
    },
    /// Subscribe a receiver. The signing secret (`whsec_…`) is shown once.
    Create {
        /// The receiver's URL: https:// (http:// only to loopback in dev).
        #[arg(long)]
        endpoint: String,
        /// Comma-separated type patterns (`pool.*,node.registered`, or `*`).
        #[arg(long)]
        types: String,
        #[arg(long, default_value = "")]
        description: String,
        /// Write the secret to this new file (mode 0600) instead of printing it.
        #[arg(long, conflicts_with = "secret_ref")]
        secret_out: Option<PathBuf>,
        /// Sign with this secret of the tenant (`secret://TENANT/sec_…`, from `secrets put`)
        /// instead of one made for the webhook; no secret is shown.
        #[arg(long)]
        secret_ref: Option<String>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// Change the receiver, the types, the description or the secret it signs with.
    Update {
        webhook_id: String,
        #[arg(long)]
        endpoint: Option<String>,
        #[arg(long)]
        types: Option<String>,
        #[arg(long)]
        description: Option<String>,
        /// From now on sign with this secret of the tenant (`secret://TENANT/sec_…`); the
        /// webhook's own secrets are deleted.
        #[arg(long)]
        secret_ref: Option<String>,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Delete a webhook; its pending deliveries die.
    Delete {
        webhook_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Send a test delivery (`webhook.pinged`) to this webhook only.
    Ping {
        webhook_id: String,
    },
    /// A new signing secret, shown once; the old one keeps signing beside it for a while.
    RotateSecret {
        webhook_id: String,
        /// How long the old secret keeps signing: seconds (0 to 604800; default 86400).
        #[arg(long)]
        previous_valid_s: Option<u64>,
        /// Write the secret to this new file (mode 0600) instead of printing it.
        #[arg(long)]
        secret_out: Option<PathBuf>,
    },
    /// Deliveries and their attempts, newest first.
    Deliveries {
        webhook_id: String,
        /// pending, done or dead.
        #[arg(long)]
        state: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// Queue a done or dead delivery again.
    Redeliver {
        webhook_id: String,
        /// `evt_…/wh_…`, from `deliveries`.
        delivery_id: String,
    },
    /// Every event type a webhook can subscribe to.
    EventTypes,
}

fn types(list: &str) -> Value {
    json!(list.split(',').map(str::trim).filter(|t| !t.is_empty()).collect::<Vec<_>>())
}

/// `--secret-out` names a new file: refused before the call, so no secret is made for nothing.
fn refuse_existing(path: &Option<PathBuf>) -> Result<(), CliError> {
    match path {
        Some(path) if path.exists() => Err(CliError::new("ALREADY_EXISTS", format!("{} exists", path.display()))
            .hint("--secret-out never overwrites: give a new file")),
        _ => Ok(()),
    }
}

/// Moves the secret out of `value` into a new 0600 file, if asked to.
fn secret_out(value: &mut Value, path: &Option<PathBuf>) -> Result<(), CliError> {
    let Some(path) = path else { return Ok(()) };
    let Some(secret) = value.get("secret").and_then(Value::as_str).map(str::to_owned) else {
        return Ok(());
    };
    bc_core::keys::write_secret_file(path, format!("{secret}\n").as_bytes()).map_err(|e| {
        CliError::from(e).hint("the webhook exists; run rotate-secret --secret-out NEW_FILE to get a secret you can keep")
    })?;
    value["secret"] = json!(format!("written to {}", path.display()));
    Ok(())
}

pub async fn run(ctx: &Context, command: WebhooksCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    let id = |text: &str| check_id::<WebhookId>("WEBHOOK_ID", text);
    let call = |method: &'static str, body: Map<String, Value>, key: Option<String>| {
        let c = &c;
        async move { c.call(method, &Value::Object(body), key.as_deref()).await }
    };
    let value = match command {
        WebhooksCommand::List { page } => {
            add_page(&mut body, &page);
            return ctx.print_list(&call("webhooks.list", body, None).await?, tables::WEBHOOKS);
        }
        WebhooksCommand::Deliveries { webhook_id, state, page } => {
            body.insert("webhookId".into(), json!(id(&webhook_id)?));
            if let Some(state) = state {
                body.insert("state".into(), json!(state));
            }
            add_page(&mut body, &page);
            return ctx.print_list(&call("webhooks.deliveries", body, None).await?, tables::DELIVERIES);
        }
        WebhooksCommand::EventTypes => {
            return ctx.print_list(&call("webhooks.eventTypes", Map::new(), None).await?, tables::EVENT_TYPES);
        }
        WebhooksCommand::Get { webhook_id } => {
            body.insert("webhookId".into(), json!(id(&webhook_id)?));
            call("webhooks.get", body, None).await?
        }
        WebhooksCommand::Create { endpoint, types: list, description, secret_out: out, secret_ref, key } => {
            refuse_existing(&out)?;
            body.insert("url".into(), json!(endpoint));
            body.insert("eventTypes".into(), types(&list));
            body.insert("description".into(), json!(description));
            if let Some(reference) = secret_ref {
                body.insert("secretRef".into(), json!(reference));
            }
            let key = idempotency_key(&key.key);
            let mut value = call("webhooks.create", body, Some(key)).await?;
            secret_out(&mut value, &out)?;
            value
        }
        WebhooksCommand::Update { webhook_id, endpoint, types: list, description, secret_ref, if_version } => {
            body.insert("webhookId".into(), json!(id(&webhook_id)?));
            if endpoint.is_none() && list.is_none() && description.is_none() && secret_ref.is_none() {
                return Err(CliError::usage("nothing to update: give --endpoint, --types, --description or --secret-ref"));
            }
            if let Some(reference) = secret_ref {
                body.insert("secretRef".into(), json!(reference));
            }
            if let Some(endpoint) = endpoint {
                body.insert("url".into(), json!(endpoint));
            }
            if let Some(list) = list {
                body.insert("eventTypes".into(), types(&list));
            }
            if let Some(description) = description {
                body.insert("description".into(), json!(description));
            }
            if let Some(v) = if_version.if_version {
                body.insert("ifVersion".into(), json!(v));
            }
            call("webhooks.update", body, None).await?
        }
        WebhooksCommand::Delete { webhook_id, if_version } => {
            body.insert("webhookId".into(), json!(id(&webhook_id)?));
            if let Some(v) = if_version.if_version {
                body.insert("ifVersion".into(), json!(v));
            }
            call("webhooks.delete", body, None).await?
        }
        WebhooksCommand::Ping { webhook_id } => {
            body.insert("webhookId".into(), json!(id(&webhook_id)?));
            call("webhooks.ping", body, None).await?
        }
        WebhooksCommand::RotateSecret { webhook_id, previous_valid_s, secret_out: out } => {
            refuse_existing(&out)?;
            body.insert("webhookId".into(), json!(id(&webhook_id)?));
            if let Some(s) = previous_valid_s {
                body.insert("previousValidS".into(), json!(s));
            }
            let mut value = call("webhooks.rotateSecret", body, None).await?;
            secret_out(&mut value, &out)?;
            value
        }
        WebhooksCommand::Redeliver { webhook_id, delivery_id } => {
            body.insert("webhookId".into(), json!(id(&webhook_id)?));
            body.insert("deliveryId".into(), json!(delivery_id));
            call("webhooks.redeliver", body, None).await?
        }
    };
    ctx.print(&value, Format::Json)
}
