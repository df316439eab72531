//! `webhooks.*`: subscriptions, their signing secrets, pings, and the delivery record.
//!
//! A subscription is an entity in the log (`webhook/wh_…`); its signing secret is not: it goes
//! to the write-only secret store and is shown once, in the answer to `create` and
//! `rotateSecret`. Deliveries are the `webhooks` consumer's work items (`bc-reconcilers`).

use bc_core::id::{EventId, TenantId, WebhookId};
use bc_core::store::outbox::WorkState;
use bc_core::store::{AppendResult, EventStore, ExpectedVersion};
use bc_core::webhook::Secret;
use bc_core::{Error, Result};
use bc_projections::WEBHOOK_CONSUMER as CONSUMER;
use bc_projections::events::{self as ev, EVENT_TYPES, TypeFilter};
use bc_projections::{KIND_WEBHOOK, WebhookDoc, new_webhook_secret_id, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::{expected_version, stream_id};
use super::events::TypePatterns;
use super::paging::{Page, limit, list_input};
use super::resource::list_all;
use super::secrets::SecretRefText;
use super::system::Empty;
use super::validate::{
    DESCRIPTION_CHARS_MAX, DescriptionText, LimitNumber, TenantIdText, VersionNumber, WebhookIdText, string_schema, validate_text,
};
use super::views::{DeliveryView, EventTypesView, PingView, WebhookDeletedView, WebhookSecretView, WebhookView};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:webhooks:read");
const WRITE: Access = Access::Action("compute:webhooks:write");

/// Webhooks one tenant may have.
pub const WEBHOOKS_PER_TENANT_MAX: u32 = 100;
/// How long a rotated-out secret still signs, by default and at most.
pub const PREVIOUS_SECRET_DEFAULT_S: u64 = 24 * 3600;
pub const PREVIOUS_SECRET_MAX_S: u64 = 7 * 24 * 3600;
/// What a subscription must also be allowed: it reads the tenant's events.
const EVENTS_READ: &str = "compute:events:read";
/// Longest delivery id (`evt_…/wh_…`).
const DELIVERY_ID_BYTES_MAX: usize = 80;
/// Deliveries one `webhooks.deliveries` page holds at most.
pub const DELIVERIES_PAGE_MAX: u32 = 100;

pub(super) const METHODS: &[Method] = &[
    method!(
        "webhooks.create",
        WRITE,
        "subscribe a receiver; the secret is shown once",
        WebhooksCreate => WebhookSecretView,
        webhooks_create,
    ),
    method!("webhooks.list", READ, "a tenant's webhooks", WebhooksList => Page<WebhookView>, webhooks_list),
    method!("webhooks.get", READ, "one webhook", WebhookRef => WebhookView, webhooks_get),
    method!(
        "webhooks.update",
        WRITE,
        "change a webhook's URL, types or description",
        WebhooksUpdate => WebhookView,
        webhooks_update,
    ),
    method!(
        "webhooks.delete",
        WRITE,
        "delete a webhook; pending deliveries die",
        WebhookRef => WebhookDeletedView,
        webhooks_delete,
    ),
    method!("webhooks.ping", WRITE, "send a test delivery to one webhook", WebhookRef => PingView, webhooks_ping),
    method!(
        "webhooks.rotateSecret",
        WRITE,
        "a new signing secret, shown once; the old one signs too for a while",
        WebhooksRotate => WebhookSecretView,
        webhooks_rotate_secret,
    ),
    method!(
        "webhooks.deliveries",
        READ,
        "a webhook's deliveries and their attempts",
        WebhooksDeliveries => Page<DeliveryView>,
        webhooks_deliveries,
    ),
    method!(
        "webhooks.redeliver",
        WRITE,
        "queue a done or dead delivery again",
        WebhooksRedeliver => DeliveryView,
        webhooks_redeliver,
    ),
    method!(
        "webhooks.eventTypes",
        Access::Authenticated,
        "every event type a webhook can subscribe to",
        Empty => EventTypesView,
        webhooks_event_types,
    ),
];

/// A TCP port, 1 to 65535, as a pattern.
const PORT: &str = "(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})";

string_schema!(
    /// A receiver's URL as the schema states it: `https://` and a fully qualified host name. The
    /// deployment's policy decides the rest when the URL is saved (no private, link-local or
    /// metadata addresses; loopback and `http://` only in `dev`) and again at every delivery.
    ReceiverUrl as "ReceiverUrl",
    |_| {
            schemars::json_schema!({
                "type": "string",
                "maxLength": bc_core::webhook::URL_BYTES_MAX,
                "pattern": format!(
                    "^https://([A-Za-z0-9][A-Za-z0-9-]{{0,62}}\\.)+[A-Za-z][A-Za-z0-9-]{{0,62}}(:{PORT})?(/[A-Za-z0-9._~/%-]{{0,200}})?(\\?[A-Za-z0-9._~=&%-]{{0,200}})?$"
                ),
            })
    }
);

string_schema!(
    /// At least one type pattern: a webhook with none would receive nothing.
    ReceiverTypes as "ReceiverTypes",
    |g| {
            let mut schema = TypePatterns::json_schema(g);
            schema.insert("minItems".into(), 1.into());
            schema
    }
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhooksCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ReceiverUrl")]
    url: String,
    #[schemars(with = "ReceiverTypes")]
    event_types: Vec<String>,
    #[serde(default)]
    #[schemars(with = "DescriptionText")]
    description: String,
    /// Sign with this secret of the tenant (`secret://TENANT/sec_…`, its current version at
    /// each delivery) instead of a secret made for the webhook; none is shown then.
    #[schemars(with = "Option<SecretRefText>")]
    secret_ref: Option<String>,
}

/// At least one of `url`, `eventTypes`, `description`, `secretRef`, not `null`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("anyOf" = [
    { "required": ["url"], "properties": { "url": { "type": "string" } } },
    { "required": ["eventTypes"], "properties": { "eventTypes": { "type": "array" } } },
    { "required": ["description"], "properties": { "description": { "type": "string" } } },
    { "required": ["secretRef"], "properties": { "secretRef": { "type": "string" } } },
]))]
pub struct WebhooksUpdate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "WebhookIdText")]
    webhook_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    #[schemars(with = "Option<ReceiverUrl>")]
    url: Option<String>,
    #[schemars(with = "Option<ReceiverTypes>")]
    event_types: Option<Vec<String>>,
    #[schemars(with = "Option<DescriptionText>")]
    description: Option<String>,
    /// From now on sign with this secret of the tenant (`secret://TENANT/sec_…`); the
    /// webhook's own secrets are deleted.
    #[schemars(with = "Option<SecretRefText>")]
    secret_ref: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "WebhookIdText")]
    webhook_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhooksRotate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "WebhookIdText")]
    webhook_id: String,
    /// Seconds the old secret keeps signing beside the new one (0 to 7 days; default 1 day).
    #[schemars(range(max = PREVIOUS_SECRET_MAX_S))]
    previous_valid_s: Option<u64>,
}

list_input!(WebhooksList {});

string_schema!(
    /// A delivery's state, as a filter: `pending`, `done` or `dead`.
    DeliveryStateText as "DeliveryState",
    |_| {
            let states: Vec<&str> = WorkState::ALL.iter().map(|s| s.as_str()).collect();
        schemars::json_schema!({ "type": "string", "enum": states })
    }
);

string_schema!(
    /// A delivery id (`evt_…/wh_…`), as a cursor.
    DeliveryCursor as "DeliveryCursor",
    |_| {
            schemars::json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9_/]{1,80}$" })
    }
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhooksDeliveries {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "WebhookIdText")]
    webhook_id: String,
    #[schemars(with = "Option<DeliveryStateText>")]
    state: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<DeliveryCursor>")]
    cursor: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhooksRedeliver {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "WebhookIdText")]
    webhook_id: String,
    /// `evt_…/wh_…` in lowercase, as `webhooks.deliveries` lists them.
    #[schemars(regex(pattern = r"^evt_[0-7][0-9a-hjkmnp-tv-z]{25}/wh_[0-7][0-9a-hjkmnp-tv-z]{25}$"))]
    delivery_id: String,
}

pub(super) fn check_types(types: &[String]) -> Result<()> {
    if types.is_empty() {
        return Err(Error::InvalidArgument {
            message: "eventTypes is empty: the webhook would receive nothing".into(),
            hint: Some("give patterns such as pool.* or *; webhooks.eventTypes lists the types".into()),
        });
    }
    TypeFilter::parse(types).map(|_| ())
}

/// The webhook's own signing secrets in the secret store (none while it names a reference).
pub(super) fn own_secrets(doc: &WebhookDoc) -> impl Iterator<Item = &String> {
    std::iter::once(&doc.secret_id).chain(doc.previous_secrets.iter().map(|p| &p.secret_id)).filter(|id| !id.is_empty())
}

/// `reference` checked as a webhook's signing secret: a secret of `tenant` (another tenant's is
/// not found, as from this tenant it is not) whose current value is a Standard Webhooks secret
/// (`whsec_…`). Answers the reference in its canonical (lowercase) form. The value is read to
/// be checked and goes nowhere.
async fn signing_secret_ref(call: &Call<'_>, tenant: TenantId, reference: &str) -> Result<String> {
    let (owner, secret_id) = bc_projections::secret::parse_secret_ref(reference)?;
    let canonical = bc_projections::secret::secret_ref(&owner.to_string(), &secret_id.to_string());
    if owner != tenant {
        return Err(Error::not_found(format!("secret {canonical} in tenant {tenant}")));
    }
    let secret: bc_projections::SecretDoc =
        call.row(tenant, bc_projections::KIND_SECRET, &secret_id.to_string(), "secret").await?;
    let value = call.state.store.secret_get(tenant, &secret.value_id).await?;
    if value.as_deref().and_then(|v| Secret::parse(v).ok()).is_none() {
        return Err(Error::state(
            format!("secret {:?} ({canonical}) is not a webhook signing secret", secret.name),
            "a webhook signs with whsec_ followed by the base64 of 24 to 64 random bytes; put such a value first",
        ));
    }
    Ok(canonical)
}

/// A fleet document's webhook's `reference`, as read (`None`: it names no secret of `tenant`):
/// what [`signing_secret_ref`] checks, for a plan to block on rather than refuse.
pub(super) async fn signing_secret_read(
    call: &Call<'_>,
    tenant: TenantId,
    reference: &str,
) -> Result<Option<crate::app::fleet::SecretRead>> {
    let (owner, secret_id) = bc_projections::secret::parse_secret_ref(reference)?;
    if owner != tenant {
        return Ok(None);
    }
    let Some(row) = call.state.store.row_get(&tenant.to_string(), bc_projections::KIND_SECRET, &secret_id.to_string()).await?
    else {
        return Ok(None);
    };
    let secret: bc_projections::SecretDoc = super::call::doc(row)?;
    let value = call.state.store.secret_get(tenant, &secret.value_id).await?;
    let signs = value.as_deref().and_then(|v| Secret::parse(v).ok()).is_some();
    Ok(Some(crate::app::fleet::SecretRead { secret_id: secret.secret_id, version: secret.version, signs }))
}

/// A webhook of a fleet document checked as `webhooks.create` checks its fields: the endpoint
/// against the receivers' policy, the event types, the description, the reference's form.
pub(super) fn check_fleet_webhook(
    call: &Call<'_>,
    url: &str,
    types: &[String],
    description: &str,
    reference: Option<&str>,
) -> Result<()> {
    call.state.webhook_policy.check_url(url)?;
    check_types(types)?;
    validate_text("description", description, DESCRIPTION_CHARS_MAX)?;
    if let Some(reference) = reference {
        bc_projections::secret::parse_secret_ref(reference)?;
    }
    Ok(())
}

async fn current(call: &Call<'_>, tenant: TenantId, id: &WebhookId) -> Result<WebhookDoc> {
    call.row(tenant, KIND_WEBHOOK, &id.to_string(), "webhook").await
}

async fn webhooks_event_types(_: &Call<'_>, _: Empty) -> Result<EventTypesView> {
    Ok(EventTypesView { items: EVENT_TYPES.iter().map(|t| (*t).to_owned()).collect() })
}

async fn webhooks_create(call: &Call<'_>, input: WebhooksCreate) -> Result<WebhookSecretView> {
    let store = &*call.state.store;
    let tenant = call.tenant(&input.tenant_id).await?;
    // A subscription reads the tenant's events: it needs what events.list needs.
    call.principal().authorize(EVENTS_READ, tenant)?;
    call.state.webhook_policy.check_url(&input.url)?;
    check_types(&input.event_types)?;
    validate_text("description", &input.description, DESCRIPTION_CHARS_MAX)?;
    if let Some(reference) = &input.secret_ref {
        bc_projections::secret::parse_secret_ref(reference)?;
    }
    let existing = store.row_list(&tenant.to_string(), KIND_WEBHOOK, None, WEBHOOKS_PER_TENANT_MAX).await?;
    if existing.len() >= WEBHOOKS_PER_TENANT_MAX as usize {
        return Err(Error::state(
            format!("a tenant has at most {WEBHOOKS_PER_TENANT_MAX} webhooks"),
            "delete webhooks no one receives (webhooks delete)",
        ));
    }
    let id = WebhookId::from_ulid(call.ulid());
    if let Some(reference) = &input.secret_ref {
        // Checked and bound under the names' lock, which `secrets.delete` takes too.
        let _names = call.state.name_locks.lock(tenant).await;
        let reference = signing_secret_ref(call, tenant, reference).await?;
        let payload = ev::to_cbor(&ev::WebhookCreated {
            url: input.url,
            event_types: input.event_types,
            description: input.description,
            secret_version: 0,
            secret_id: String::new(),
            secret_ref: Some(reference),
        })?;
        let result =
            call.append(tenant, stream_of(KIND_WEBHOOK, &id), ExpectedVersion::NoStream, ev::WEBHOOK_CREATED, payload).await?;
        let id: WebhookId = parse_id("webhookId", stream_id(&result.events[0].envelope.stream))?;
        return Ok(WebhookSecretView {
            webhook: current(call, tenant, &id).await?.into(),
            secret: None,
            replayed: result.replayed,
        });
    }
    let secret = Secret::generate();
    // The secret is stored before the event that names it, so a delivery never finds a webhook
    // without its secret. If the append fails, the secret is an orphan that nothing names.
    let secret_id = new_webhook_secret_id(&id.to_string(), call.ulid());
    store.secret_put(tenant, &secret_id, &secret.expose(), call.now_ms()).await?;
    let secret_id_of_request = secret_id.clone();
    let payload = ev::to_cbor(&ev::WebhookCreated {
        url: input.url,
        event_types: input.event_types,
        description: input.description,
        secret_version: 1,
        secret_id,
        secret_ref: None,
    })?;
    let appended =
        call.append(tenant, stream_of(KIND_WEBHOOK, &id), ExpectedVersion::NoStream, ev::WEBHOOK_CREATED, payload).await;
    let result = forget_unused_secret(store, tenant, &secret_id_of_request, appended).await?;
    let id: WebhookId = parse_id("webhookId", stream_id(&result.events[0].envelope.stream))?;
    // Shown once: a replay of the same request does not show it again.
    Ok(WebhookSecretView {
        webhook: current(call, tenant, &id).await?.into(),
        secret: (!result.replayed).then(|| secret.expose()),
        replayed: result.replayed,
    })
}

/// The secret `secret_id` was stored for an append that did not use it: a replay (the first
/// request's event names its own secret) or a certain refusal. Its row is deleted, so retries
/// with the same idempotency key store no new secret rows. A failure that may still have
/// committed (storage, unavailable) keeps it: the event might name it.
pub(super) async fn forget_unused_secret(
    store: &dyn EventStore,
    tenant: TenantId,
    secret_id: &str,
    appended: Result<AppendResult>,
) -> Result<AppendResult> {
    let unused = match &appended {
        Ok(result) => result.replayed,
        Err(e) => !matches!(e, Error::Storage(_) | Error::Internal(_) | Error::Unavailable(_)),
    };
    if unused {
        store.secret_delete(tenant, secret_id).await?;
    }
    appended
}

async fn webhooks_list(call: &Call<'_>, input: WebhooksList) -> Result<Page<WebhookView>> {
    list_all::<WebhookDoc, _>(call, &input.tenant_id, input.limit, input.cursor.as_deref()).await
}

async fn webhooks_get(call: &Call<'_>, input: WebhookRef) -> Result<WebhookView> {
    Ok(call.named::<WebhookDoc>(&input.tenant_id, &input.webhook_id).await?.into())
}

async fn webhooks_update(call: &Call<'_>, input: WebhooksUpdate) -> Result<WebhookView> {
    let tenant = call.tenant(&input.tenant_id).await?;
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
    if let Some(reference) = &input.secret_ref {
        bc_projections::secret::parse_secret_ref(reference)?;
    }
    if input.url.is_none() && input.event_types.is_none() && input.description.is_none() && input.secret_ref.is_none() {
        return Err(Error::invalid("nothing to update: give url, eventTypes, description or secretRef"));
    }
    // Held while a reference is checked and bound, as `secrets.delete` holds it.
    let _names = match input.secret_ref {
        Some(_) => Some(call.state.name_locks.lock(tenant).await),
        None => None,
    };
    let doc = current(call, tenant, &id).await?;
    let expected = expected_version(input.if_version, doc.version, &stream_of(KIND_WEBHOOK, &id))?;
    let secret_ref = match &input.secret_ref {
        Some(reference) => Some(signing_secret_ref(call, tenant, reference).await?),
        None => None,
    };
    let switched = secret_ref.is_some();
    let payload = ev::to_cbor(&ev::WebhookUpdated {
        url: input.url,
        event_types: input.event_types,
        description: input.description,
        secret_ref,
    })?;
    let result = call.append(tenant, stream_of(KIND_WEBHOOK, &id), expected, ev::WEBHOOK_UPDATED, payload).await?;
    if switched && !result.replayed {
        // It signs with the referenced secret now: its own secrets sign nothing again.
        for secret_id in own_secrets(&doc) {
            call.state.store.secret_delete(tenant, secret_id).await?;
        }
    }
    Ok(current(call, tenant, &id).await?.into())
}

async fn webhooks_delete(call: &Call<'_>, input: WebhookRef) -> Result<WebhookDeletedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
    let doc = current(call, tenant, &id).await?;
    let expected = expected_version(input.if_version, doc.version, &stream_of(KIND_WEBHOOK, &id))?;
    let payload = ev::to_cbor(&ev::WebhookDeleted {})?;
    call.append(tenant, stream_of(KIND_WEBHOOK, &id), expected, ev::WEBHOOK_DELETED, payload).await?;
    // Its own secrets go with it (a referenced one stays the tenant's); deliveries still
    // pending die at their next attempt.
    for secret_id in own_secrets(&doc) {
        call.state.store.secret_delete(tenant, secret_id).await?;
    }
    Ok(WebhookDeletedView { webhook_id: id.to_string(), deleted: true })
}

async fn webhooks_ping(call: &Call<'_>, input: WebhookRef) -> Result<PingView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
    let doc = current(call, tenant, &id).await?;
    let expected = expected_version(input.if_version, doc.version, &stream_of(KIND_WEBHOOK, &id))?;
    let payload = ev::to_cbor(&ev::WebhookPinged {})?;
    let result = call.append(tenant, stream_of(KIND_WEBHOOK, &id), expected, ev::WEBHOOK_PINGED, payload).await?;
    let event = &result.events[0];
    Ok(PingView {
        webhook_id: id.to_string(),
        message_id: event.envelope.id.to_string(),
        delivery_id: bc_projections::webhook_delivery_id(&event.envelope.id, &id),
        position: event.position.to_string(),
    })
}

async fn webhooks_rotate_secret(call: &Call<'_>, input: WebhooksRotate) -> Result<WebhookSecretView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
    let keep_s = input.previous_valid_s.unwrap_or(PREVIOUS_SECRET_DEFAULT_S);
    if keep_s > PREVIOUS_SECRET_MAX_S {
        return Err(Error::invalid(format!("previousValidS is at most {PREVIOUS_SECRET_MAX_S} (7 days)")));
    }
    let doc = current(call, tenant, &id).await?;
    if let Some(reference) = &doc.secret_ref {
        return Err(Error::state(
            format!("webhook {id} signs with {reference}, not a secret of its own"),
            "put a new version of that secret (secrets put NAME --value-file FILE): the next delivery signs with it",
        ));
    }
    let version = doc.secret_version + 1;
    let secret = Secret::generate();
    let secret_id = new_webhook_secret_id(&id.to_string(), call.ulid());
    let now_ms = call.now_ms();
    // A concurrent rotation fails at the append (CONFLICT), and its secret row is removed.
    call.state.store.secret_put(tenant, &secret_id, &secret.expose(), now_ms).await?;
    let secret_id_of_request = secret_id.clone();
    let previous_valid_until_ms = now_ms.saturating_add(keep_s * 1000);
    let payload = ev::to_cbor(&ev::WebhookSecretRotated { secret_version: version, secret_id, previous_valid_until_ms })?;
    let expected = ExpectedVersion::Exact(doc.version);
    let appended = call.append(tenant, stream_of(KIND_WEBHOOK, &id), expected, ev::WEBHOOK_SECRET_ROTATED, payload).await;
    let result = forget_unused_secret(&*call.state.store, tenant, &secret_id_of_request, appended).await?;
    let after = current(call, tenant, &id).await?;
    if !result.replayed {
        // The rotation dropped from the document the previous secrets whose overlap is over
        // (and any past `PREVIOUS_SECRETS_MAX`): nothing signs with them again, so their rows go.
        let kept: Vec<&str> = std::iter::once(after.secret_id.as_str())
            .chain(after.previous_secrets.iter().map(|p| p.secret_id.as_str()))
            .collect();
        let before = std::iter::once(&doc.secret_id).chain(doc.previous_secrets.iter().map(|p| &p.secret_id));
        for dropped in before.filter(|s| !kept.contains(&s.as_str())) {
            call.state.store.secret_delete(tenant, dropped).await?;
        }
    }
    Ok(WebhookSecretView {
        webhook: after.into(),
        secret: (!result.replayed).then(|| secret.expose()),
        replayed: result.replayed,
    })
}

async fn webhooks_deliveries(call: &Call<'_>, input: WebhooksDeliveries) -> Result<Page<DeliveryView>> {
    let store = &*call.state.store;
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
    let state = match input.state.as_deref() {
        None => None,
        Some(s) => Some(WorkState::parse(s).ok_or_else(|| Error::InvalidArgument {
            message: format!("state {:?} is not a delivery state", bc_core::id::truncate(s, 40)),
            hint: Some("pending, done or dead".into()),
        })?),
    };
    let limit = limit(input.limit)?.min(DELIVERIES_PAGE_MAX);
    if let Some(cursor) = &input.cursor
        && (cursor.is_empty()
            || cursor.len() > DELIVERY_ID_BYTES_MAX
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
        out.push(DeliveryView::of(item, attempts));
    }
    let next_cursor = if more { items.get(limit as usize - 1).map(|i| i.id.clone()) } else { None };
    Ok(Page { items: out, next_cursor })
}

async fn webhooks_redeliver(call: &Call<'_>, input: WebhooksRedeliver) -> Result<DeliveryView> {
    let store = &*call.state.store;
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: WebhookId = parse_id("webhookId", &input.webhook_id)?;
    current(call, tenant, &id).await?;
    let delivery = input.delivery_id.as_str();
    let parts =
        delivery.split_once('/').filter(|(msg, hook)| msg.parse::<EventId>().is_ok() && hook.parse::<WebhookId>().is_ok());
    let Some((_, hook)) = parts.filter(|_| delivery.len() <= DELIVERY_ID_BYTES_MAX) else {
        return Err(Error::InvalidArgument {
            message: format!("deliveryId {:?} is not a delivery id", bc_core::id::truncate(delivery, 90)),
            hint: Some("delivery ids look like evt_…/wh_…; webhooks.deliveries lists them".into()),
        });
    };
    // Well formed, but another webhook's: this webhook has no such delivery.
    if hook != id.to_string() {
        return Err(Error::not_found(format!("delivery {} of {id}", bc_core::id::truncate(delivery, 90))));
    }
    let item =
        store.work_get(CONSUMER, tenant, delivery).await?.ok_or_else(|| Error::not_found(format!("delivery {delivery}")))?;
    // A delivery still pending is a state of the delivery, not a fault of the request: 409.
    if !store.work_requeue(CONSUMER, tenant, delivery, call.now_ms()).await? {
        return Err(Error::state(
            format!("delivery {delivery} is still pending ({} attempts so far)", item.attempts),
            "only a done or dead delivery is queued again",
        ));
    }
    tracing::info!(%tenant, delivery, "delivery queued again");
    let item = store.work_get(CONSUMER, tenant, delivery).await?.ok_or_else(|| Error::not_found("delivery"))?;
    let attempts = store.attempts(CONSUMER, tenant, delivery).await?;
    Ok(DeliveryView::of(&item, attempts))
}
