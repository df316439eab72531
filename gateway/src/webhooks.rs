//! `webhooks.*`: subscriptions, their signing secrets, pings, and the delivery record.
//!
//! A subscription is an entity in the log (`webhook/wh_…`); its signing secret is not: it goes
//! to the write-only secret store and is shown once, in the answer to `create` and
//! `rotateSecret`. Deliveries are the `webhooks` consumer's work items (`bc-reconcilers`).

use bc_core::id::WebhookId;
use bc_core::store::ExpectedVersion;
use bc_core::store::outbox::{WorkItem, WorkState};
use bc_core::webhook::Secret;
use bc_core::{Error, Result};
use bc_projections::events::{self as ev, EVENT_TYPES, TypeFilter};
use bc_projections::{KIND_WEBHOOK, WebhookDoc, new_webhook_secret_id, stream_of};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::methods::{Call, DESCRIPTION_CHARS_MAX, doc, limit, opt_tenant, parse, parse_id, validate_text};

use bc_projections::WEBHOOK_CONSUMER as CONSUMER;
/// Webhooks one tenant may have.
pub const WEBHOOKS_PER_TENANT_MAX: u32 = 100;
/// How long a rotated-out secret still signs, by default and at most.
pub const PREVIOUS_SECRET_DEFAULT_S: u64 = 24 * 3600;
pub const PREVIOUS_SECRET_MAX_S: u64 = 7 * 24 * 3600;
/// What a subscription must also be allowed: it reads the tenant's events.
const EVENTS_READ: &str = "compute:events:read";
/// Longest delivery id (`evt_…/wh_…`).
const DELIVERY_ID_BYTES_MAX: usize = 80;

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Create {
    tenant_id: Option<String>,
    url: String,
    event_types: Vec<String>,
    #[serde(default)]
    description: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Update {
    tenant_id: Option<String>,
    webhook_id: String,
    if_version: Option<u64>,
    url: Option<String>,
    event_types: Option<Vec<String>>,
    description: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Ref {
    tenant_id: Option<String>,
    webhook_id: String,
    if_version: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Rotate {
    tenant_id: Option<String>,
    webhook_id: String,
    /// Seconds the old secret keeps signing beside the new one (0 to 7 days; default 1 day).
    previous_valid_s: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct List {
    tenant_id: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Deliveries {
    tenant_id: Option<String>,
    webhook_id: String,
    state: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Redeliver {
    tenant_id: Option<String>,
    webhook_id: String,
    delivery_id: String,
}

fn check_types(types: &[String]) -> Result<()> {
    if types.is_empty() {
        return Err(Error::InvalidArgument {
            message: "eventTypes is empty: the webhook would receive nothing".into(),
            hint: Some("give patterns such as pool.* or *; webhooks.eventTypes lists the types".into()),
        });
    }
    TypeFilter::parse(types).map(|_| ())
}

fn view(doc: &WebhookDoc) -> Value {
    json!({
        "webhookId": doc.webhook_id,
        "tenantId": doc.tenant_id,
        "url": doc.url,
        "eventTypes": doc.event_types,
        "description": doc.description,
        "secretVersion": doc.secret_version,
        "previousSecretsValidUntilMs": doc.previous_secrets.iter().map(|p| p.valid_until_ms).collect::<Vec<_>>(),
        "version": doc.version,
        "createdAtMs": doc.created_at_ms,
        "updatedAtMs": doc.updated_at_ms,
    })
}

fn delivery_view(item: &WorkItem, attempts: Vec<bc_core::store::outbox::Attempt>) -> Value {
    json!({
        "deliveryId": item.id,
        "webhookId": item.subject,
        "messageId": item.payload["messageId"],
        "type": item.payload["type"],
        "state": item.state.as_str(),
        "attempts": item.attempts,
        "nextAtMs": (item.state == WorkState::Pending).then_some(item.next_at_ms),
        "lastError": item.last_error,
        "createdAtMs": item.created_at_ms,
        "updatedAtMs": item.updated_at_ms,
        "attemptLog": attempts.iter().map(|a| json!({
            "number": a.number,
            "atMs": a.at_ms,
            "latencyMs": a.latency_ms,
            "status": a.status,
            "error": a.error,
            "nextAtMs": a.next_at_ms,
            "owner": a.owner,
        })).collect::<Vec<_>>(),
    })
}

async fn current(call: &Call<'_>, tenant: bc_core::id::TenantId, id: &WebhookId) -> Result<WebhookDoc> {
    let row = call.state.store.row_get(&tenant.to_string(), KIND_WEBHOOK, &id.to_string()).await?;
    doc(row.ok_or_else(|| Error::not_found(format!("webhook {id}")))?)
}

/// The input type of each `webhooks.*` method, for the OpenAPI document.
pub fn input_schema(name: &str, g: &mut schemars::SchemaGenerator) -> Option<schemars::Schema> {
    Some(match name {
        "webhooks.eventTypes" => g.subschema_for::<crate::methods::Empty>(),
        "webhooks.create" => g.subschema_for::<Create>(),
        "webhooks.list" => g.subschema_for::<List>(),
        "webhooks.get" | "webhooks.delete" | "webhooks.ping" => g.subschema_for::<Ref>(),
        "webhooks.update" => g.subschema_for::<Update>(),
        "webhooks.rotateSecret" => g.subschema_for::<Rotate>(),
        "webhooks.deliveries" => g.subschema_for::<Deliveries>(),
        "webhooks.redeliver" => g.subschema_for::<Redeliver>(),
        _ => return None,
    })
}

pub async fn dispatch(call: &Call<'_>, name: &str, body: &[u8]) -> Result<Value> {
    let store = &*call.state.store;
    let now_ms = call.state.log.clock.now_ms();
    match name {
        "webhooks.eventTypes" => {
            let _: crate::methods::Empty = parse(body)?;
            Ok(json!({ "items": EVENT_TYPES }))
        }
        "webhooks.create" => {
            let input: Create = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            // A subscription reads the tenant's events: it needs what events.list needs.
            call.principal().authorize(EVENTS_READ, tenant)?;
            call.state.webhook_policy.check_url(&input.url)?;
            check_types(&input.event_types)?;
            validate_text("description", &input.description, DESCRIPTION_CHARS_MAX)?;
            let existing = store.row_list(&tenant.to_string(), KIND_WEBHOOK, None, WEBHOOKS_PER_TENANT_MAX).await?;
            if existing.len() >= WEBHOOKS_PER_TENANT_MAX as usize {
                return Err(Error::invalid(format!("a tenant has at most {WEBHOOKS_PER_TENANT_MAX} webhooks")));
            }
            let id = WebhookId::generate();
            let secret = Secret::generate();
            // The secret is stored before the event that names it, so a delivery never finds a
            // webhook without its secret. If the append fails, the secret is an orphan that
            // nothing names.
            let secret_id = new_webhook_secret_id(&id.to_string());
            store.secret_put(tenant, &secret_id, &secret.expose(), now_ms).await?;
            let payload = ev::to_cbor(&ev::WebhookCreated {
                url: input.url,
                event_types: input.event_types,
                description: input.description,
                secret_version: 1,
                secret_id,
            })?;
            let result = call
                .append(tenant, stream_of(KIND_WEBHOOK, &id), ExpectedVersion::NoStream, ev::WEBHOOK_CREATED, payload)
                .await?;
            let stream = &result.events[0].envelope.stream;
            let id: WebhookId = parse_id("webhookId", stream.split_once('/').map(|(_, id)| id).unwrap_or_default())?;
            let mut out = view(&current(call, tenant, &id).await?);
            // Shown once: a replay of the same request does not show it again.
            out["secret"] = if result.replayed { Value::Null } else { Value::String(secret.expose()) };
            out["replayed"] = Value::Bool(result.replayed);
            Ok(out)
        }
        "webhooks.list" => {
            let input: List = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let list = crate::methods::ListInput::page(input.limit, input.cursor);
            crate::methods::list_rows(call, tenant, KIND_WEBHOOK, &list, |row| Ok(Some(view(&doc(row)?)))).await
        }
        "webhooks.get" => {
            let input: Ref = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
            Ok(view(&current(call, tenant, &id).await?))
        }
        "webhooks.update" => {
            let input: Update = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            call.principal().authorize(EVENTS_READ, tenant)?;
            let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
            if let Some(url) = &input.url {
                call.state.webhook_policy.check_url(url)?;
            }
            if let Some(types) = &input.event_types {
                check_types(types)?;
            }
            if let Some(description) = &input.description {
                validate_text("description", description, DESCRIPTION_CHARS_MAX)?;
            }
            if input.url.is_none() && input.event_types.is_none() && input.description.is_none() {
                return Err(Error::invalid("nothing to update: give url, eventTypes or description"));
            }
            let doc = current(call, tenant, &id).await?;
            let expected = ExpectedVersion::Exact(input.if_version.unwrap_or(doc.version));
            let payload = ev::to_cbor(&ev::WebhookUpdated {
                url: input.url,
                event_types: input.event_types,
                description: input.description,
            })?;
            call.append(tenant, stream_of(KIND_WEBHOOK, &id), expected, ev::WEBHOOK_UPDATED, payload).await?;
            Ok(view(&current(call, tenant, &id).await?))
        }
        "webhooks.delete" => {
            let input: Ref = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
            let doc = current(call, tenant, &id).await?;
            let expected = ExpectedVersion::Exact(input.if_version.unwrap_or(doc.version));
            call.append(
                tenant,
                stream_of(KIND_WEBHOOK, &id),
                expected,
                ev::WEBHOOK_DELETED,
                ev::to_cbor(&ev::WebhookDeleted {})?,
            )
            .await?;
            // Its secrets go with it; deliveries still pending die at their next attempt.
            for secret_id in std::iter::once(&doc.secret_id).chain(doc.previous_secrets.iter().map(|p| &p.secret_id)) {
                store.secret_delete(tenant, secret_id).await?;
            }
            Ok(json!({ "webhookId": id, "deleted": true }))
        }
        "webhooks.ping" => {
            let input: Ref = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
            let doc = current(call, tenant, &id).await?;
            let expected = ExpectedVersion::Exact(input.if_version.unwrap_or(doc.version));
            let result = call
                .append(tenant, stream_of(KIND_WEBHOOK, &id), expected, ev::WEBHOOK_PINGED, ev::to_cbor(&ev::WebhookPinged {})?)
                .await?;
            let event = &result.events[0];
            Ok(json!({
                "webhookId": id,
                "messageId": event.envelope.id,
                "deliveryId": bc_projections::webhook_delivery_id(&event.envelope.id, &id),
                "position": event.position.to_string(),
            }))
        }
        "webhooks.rotateSecret" => {
            let input: Rotate = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
            let keep_s = input.previous_valid_s.unwrap_or(PREVIOUS_SECRET_DEFAULT_S);
            if keep_s > PREVIOUS_SECRET_MAX_S {
                return Err(Error::invalid(format!("previousValidS is at most {PREVIOUS_SECRET_MAX_S} (7 days)")));
            }
            let doc = current(call, tenant, &id).await?;
            let version = doc.secret_version + 1;
            let secret = Secret::generate();
            let secret_id = new_webhook_secret_id(&id.to_string());
            // A concurrent rotation fails at the append (CONFLICT); its secret is an orphan.
            store.secret_put(tenant, &secret_id, &secret.expose(), now_ms).await?;
            let previous_valid_until_ms = now_ms.saturating_add(keep_s * 1000);
            let payload = ev::to_cbor(&ev::WebhookSecretRotated { secret_version: version, secret_id, previous_valid_until_ms })?;
            let result = call
                .append(
                    tenant,
                    stream_of(KIND_WEBHOOK, &id),
                    ExpectedVersion::Exact(doc.version),
                    ev::WEBHOOK_SECRET_ROTATED,
                    payload,
                )
                .await?;
            let mut out = view(&current(call, tenant, &id).await?);
            out["secret"] = if result.replayed { Value::Null } else { Value::String(secret.expose()) };
            out["replayed"] = Value::Bool(result.replayed);
            Ok(out)
        }
        "webhooks.deliveries" => {
            let input: Deliveries = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
            let state = match input.state.as_deref() {
                None => None,
                Some(s) => Some(WorkState::parse(s).ok_or_else(|| Error::InvalidArgument {
                    message: format!("state {:?} is not a delivery state", bc_core::id::truncate(s, 40)),
                    hint: Some("pending, done or dead".into()),
                })?),
            };
            let limit = limit(input.limit)?.min(100);
            if let Some(cursor) = &input.cursor
                && (cursor.len() > DELIVERY_ID_BYTES_MAX
                    || !cursor.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'/'))
            {
                return Err(Error::invalid("malformed cursor"));
            }
            current(call, tenant, &id).await?;
            let subject = id.to_string();
            let items = store.work_list(CONSUMER, tenant, &subject, state, input.cursor.as_deref(), limit + 1).await?;
            let more = items.len() > limit as usize;
            let mut out = Vec::with_capacity(items.len().min(limit as usize));
            for item in items.iter().take(limit as usize) {
                let attempts = store.attempts(CONSUMER, tenant, &item.id).await?;
                out.push(delivery_view(item, attempts));
            }
            let next = if more { items.get(limit as usize - 1).map(|i| i.id.clone()) } else { None };
            Ok(json!({ "items": out, "nextCursor": next }))
        }
        "webhooks.redeliver" => {
            let input: Redeliver = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
            current(call, tenant, &id).await?;
            let delivery = input.delivery_id.as_str();
            let well_formed = delivery.len() <= DELIVERY_ID_BYTES_MAX
                && delivery
                    .split_once('/')
                    .is_some_and(|(msg, hook)| msg.parse::<bc_core::id::EventId>().is_ok() && hook == id.to_string());
            if !well_formed {
                return Err(Error::InvalidArgument {
                    message: format!("deliveryId {:?} is not a delivery of {id}", bc_core::id::truncate(delivery, 90)),
                    hint: Some("delivery ids look like evt_…/wh_…; webhooks.deliveries lists them".into()),
                });
            }
            let item = store
                .work_get(CONSUMER, tenant, delivery)
                .await?
                .ok_or_else(|| Error::not_found(format!("delivery {delivery}")))?;
            if !store.work_requeue(CONSUMER, tenant, delivery, now_ms).await? {
                return Err(Error::InvalidArgument {
                    message: format!("delivery {delivery} is still pending ({} attempts so far)", item.attempts),
                    hint: Some("only a done or dead delivery is queued again".into()),
                });
            }
            tracing::info!(%tenant, delivery, "delivery queued again");
            let item = store.work_get(CONSUMER, tenant, delivery).await?.ok_or_else(|| Error::not_found("delivery"))?;
            let attempts = store.attempts(CONSUMER, tenant, delivery).await?;
            Ok(delivery_view(&item, attempts))
        }
        _ => Err(Error::not_found(format!("method {name}"))),
    }
}
