//! The RPC-style methods under `POST /api/compute/{group}.{method}`.
//!
//! Each method has a wire input type (JSON, `deny_unknown_fields`, camelCase), an action it is
//! authorized as, and a handler that validates, reads projections, and appends events. Handlers
//! never retry (STYLE rule 4): a conflict goes back to the caller.

use std::collections::BTreeMap;

use bc_core::event::Position;
use bc_core::id::{ApiKeyId, EventId, NodeId, PoolId, TenantId, truncate};
use bc_core::store::{AppendRequest, AppendResult, ExpectedVersion, NewEvent, READ_ROWS_MAX, decode_rows};
use bc_core::{Error, Result};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::{ApiKeyDoc, KIND_API_KEY, KIND_NODE, KIND_POOL, KIND_TENANT, NodeDoc, PoolDoc, stream_of};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sha2::Digest;

use crate::AppState;
use crate::auth::{self, Principal};

/// Rows a list method returns at most; the default is `LIST_LIMIT_DEFAULT`.
pub const LIST_LIMIT_MAX: u32 = 500;
pub const LIST_LIMIT_DEFAULT: u32 = 100;
/// Bounds on user-provided names and labels.
pub const NAME_CHARS_MAX: usize = 63;
pub const DESCRIPTION_CHARS_MAX: usize = 1024;
pub const LABELS_MAX: usize = 64;
pub const LABEL_KEY_CHARS_MAX: usize = 63;
pub const LABEL_VALUE_CHARS_MAX: usize = 255;
pub const GPUS_PER_NODE_MAX: usize = 64;
pub const GPU_VRAM_GIB_MAX: u32 = 4096;
pub const NVLINK_DOMAIN_MAX: u32 = 1024;
/// Rows one `events.list` call scans at most while filtering.
pub const EVENTS_SCAN_ROWS_MAX: usize = 5000;
const _: () = assert!(LIST_LIMIT_DEFAULT <= LIST_LIMIT_MAX && LIST_LIMIT_MAX <= READ_ROWS_MAX);

/// One API method: its name, the action it is authorized as (`None`: public), and what it does.
pub struct Method {
    pub name: &'static str,
    pub action: Option<&'static str>,
    pub summary: &'static str,
}

pub const METHODS: &[Method] = &[
    Method { name: "system.version", action: None, summary: "server version and the log key's pin" },
    Method { name: "system.whoami", action: Some(""), summary: "the calling key: tenant, key id, actions" },
    Method { name: "tenants.create", action: Some("compute:tenants:admin"), summary: "create a tenant (root tenant only)" },
    Method { name: "tenants.get", action: Some("compute:tenants:admin"), summary: "one tenant" },
    Method {
        name: "apiKeys.create",
        action: Some("compute:apikeys:admin"),
        summary: "create an API key; the token is shown once",
    },
    Method { name: "apiKeys.list", action: Some("compute:apikeys:admin"), summary: "a tenant's API keys (never their secrets)" },
    Method { name: "apiKeys.revoke", action: Some("compute:apikeys:admin"), summary: "revoke an API key" },
    Method { name: "pools.create", action: Some("compute:pools:write"), summary: "create a pool" },
    Method { name: "pools.get", action: Some("compute:pools:read"), summary: "one pool" },
    Method { name: "pools.list", action: Some("compute:pools:read"), summary: "a tenant's pools, paged by cursor" },
    Method { name: "pools.update", action: Some("compute:pools:write"), summary: "change a pool's name, description or labels" },
    Method { name: "pools.archive", action: Some("compute:pools:write"), summary: "archive a pool" },
    Method { name: "nodes.register", action: Some("compute:nodes:write"), summary: "add a host and its GPUs by hand" },
    Method { name: "nodes.get", action: Some("compute:nodes:read"), summary: "one node" },
    Method { name: "nodes.list", action: Some("compute:nodes:read"), summary: "a tenant's nodes, paged by cursor" },
    Method { name: "nodes.cordon", action: Some("compute:nodes:write"), summary: "take no new reservations on a node" },
    Method { name: "nodes.uncordon", action: Some("compute:nodes:write"), summary: "take reservations on a node again" },
    Method { name: "nodes.drain", action: Some("compute:nodes:write"), summary: "cordon a node until its reservations end" },
    Method { name: "nodes.label", action: Some("compute:nodes:write"), summary: "set or remove a node's labels" },
    Method { name: "nodes.taint", action: Some("compute:nodes:write"), summary: "set or remove a node's taints" },
    Method { name: "capacity.get", action: Some("compute:capacity:read"), summary: "free GPUs per pool and per GPU product" },
    Method { name: "capacity.preview", action: Some("compute:capacity:read"), summary: "would a reservation fit now, and where" },
    Method {
        name: "reservations.create",
        action: Some("compute:reservations:write"),
        summary: "reserve GPUs: placed at once, or queued",
    },
    Method { name: "reservations.get", action: Some("compute:reservations:read"), summary: "one reservation" },
    Method { name: "reservations.list", action: Some("compute:reservations:read"), summary: "a tenant's reservations" },
    Method {
        name: "reservations.extend",
        action: Some("compute:reservations:write"),
        summary: "move an active reservation's end",
    },
    Method {
        name: "reservations.release",
        action: Some("compute:reservations:write"),
        summary: "end an active reservation, or cancel a queued one",
    },
    Method { name: "quotas.get", action: Some("compute:quotas:read"), summary: "a tenant's GPU quota in a pool and its use" },
    Method { name: "quotas.set", action: Some("compute:quotas:admin"), summary: "set a tenant's GPU quota in a pool" },
    Method { name: "events.list", action: Some("compute:events:read"), summary: "a tenant's events by outbox position" },
    Method {
        name: "webhooks.create",
        action: Some("compute:webhooks:write"),
        summary: "subscribe a receiver; the secret is shown once",
    },
    Method { name: "webhooks.list", action: Some("compute:webhooks:read"), summary: "a tenant's webhooks" },
    Method { name: "webhooks.get", action: Some("compute:webhooks:read"), summary: "one webhook" },
    Method {
        name: "webhooks.update",
        action: Some("compute:webhooks:write"),
        summary: "change a webhook's URL, types or description",
    },
    Method {
        name: "webhooks.delete",
        action: Some("compute:webhooks:write"),
        summary: "delete a webhook; pending deliveries die",
    },
    Method { name: "webhooks.ping", action: Some("compute:webhooks:write"), summary: "send a test delivery to one webhook" },
    Method {
        name: "webhooks.rotateSecret",
        action: Some("compute:webhooks:write"),
        summary: "a new signing secret, shown once; the old one signs too for a while",
    },
    Method {
        name: "webhooks.deliveries",
        action: Some("compute:webhooks:read"),
        summary: "a webhook's deliveries and their attempts",
    },
    Method { name: "webhooks.redeliver", action: Some("compute:webhooks:write"), summary: "queue a done or dead delivery again" },
    Method { name: "webhooks.eventTypes", action: Some(""), summary: "every event type a webhook can subscribe to" },
    Method {
        name: "events.get",
        action: Some("compute:events:read"),
        summary: "one event with its canonical bytes, hash and signature",
    },
];

pub fn method(name: &str) -> Option<&'static Method> {
    METHODS.iter().find(|m| m.name == name)
}

/// Everything a handler needs about the call.
pub struct Call<'a> {
    pub state: &'a AppState,
    pub principal: Option<Principal>,
    pub action: &'static str,
    pub idempotency_key: Option<String>,
    /// SHA-256 of the method name and the request body, for idempotent retries.
    pub fingerprint: [u8; 32],
    pub request_id: String,
}

impl Call<'_> {
    /// Who appends: the calling key.
    pub(crate) fn actor(&self) -> String {
        self.principal.as_ref().map(|p| format!("apikey:{}", p.key_id)).unwrap_or_else(|| "system".into())
    }

    pub(crate) fn principal(&self) -> &Principal {
        self.principal.as_ref().expect("authenticated methods have a principal")
    }

    /// The tenant the call acts in (the key's own unless `tenantId` says otherwise), authorized.
    pub(crate) async fn tenant(&self, requested: Option<TenantId>) -> Result<TenantId> {
        let principal = self.principal();
        let tenant = requested.unwrap_or(principal.tenant);
        self.state.authorize_tenant(principal, self.action, tenant).await?;
        Ok(tenant)
    }

    pub(crate) async fn append(
        &self,
        tenant: TenantId,
        stream: String,
        expected: ExpectedVersion,
        event_type: &str,
        payload: ciborium::Value,
    ) -> Result<AppendResult> {
        self.append_guarded(tenant, stream, expected, event_type, payload, vec![]).await
    }

    async fn append_guarded(
        &self,
        tenant: TenantId,
        stream: String,
        expected: ExpectedVersion,
        event_type: &str,
        payload: ciborium::Value,
        guards: Vec<(String, ExpectedVersion)>,
    ) -> Result<AppendResult> {
        let mut request = self.request(tenant, stream, expected, vec![NewEvent::new(event_type, payload)]);
        request.guards = guards;
        self.state.log.append(request).await
    }

    /// An append on behalf of this call: its key, its request id, its fingerprint.
    pub(crate) fn request(
        &self,
        tenant: TenantId,
        stream: String,
        expected: ExpectedVersion,
        events: Vec<NewEvent>,
    ) -> AppendRequest {
        let mut request = AppendRequest::new(tenant, stream, expected, self.actor(), events);
        // Clients' keys live in their own namespace, apart from the server's own
        // (`checkpoint:…`), so a client cannot pre-empt them.
        request.idempotency_key = self.idempotency_key.as_ref().map(|k| format!("request:{k}"));
        request.correlation = Some(self.request_id.clone());
        request.fingerprint = Some(self.fingerprint);
        request
    }
}

pub(crate) fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    let body = if body.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { body };
    serde_json::from_slice(body).map_err(|e| Error::InvalidArgument {
        message: format!("invalid request body: {e}"),
        hint: Some("send a JSON object with the method's fields".into()),
    })
}

pub(crate) fn parse_id<T: std::str::FromStr<Err = Error>>(field: &str, text: &str) -> Result<T> {
    text.parse()
        .map_err(|e: Error| Error::InvalidArgument { message: format!("{field}: {e}"), hint: e.hint().map(str::to_owned) })
}

pub(crate) fn opt_tenant(text: &Option<String>) -> Result<Option<TenantId>> {
    text.as_deref().map(|t| parse_id("tenantId", t)).transpose()
}

pub(crate) fn limit(requested: Option<u32>) -> Result<u32> {
    match requested {
        None => Ok(LIST_LIMIT_DEFAULT),
        Some(n) if (1..=LIST_LIMIT_MAX).contains(&n) => Ok(n),
        Some(n) => Err(Error::invalid(format!("limit {n} is out of range 1 to {LIST_LIMIT_MAX}"))),
    }
}

/// A name: 1 to 63 characters of lowercase letters, digits, `-`, `.` and `_`, starting with a
/// letter or digit.
fn validate_name(field: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.chars().count() <= NAME_CHARS_MAX
        && name.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | '_'));
    if !ok {
        return Err(Error::InvalidArgument {
            message: format!("{field} {:?} is not a valid name", truncate(name, 70)),
            hint: Some(format!("1 to {NAME_CHARS_MAX} of a-z 0-9 - . _, starting with a letter or digit")),
        });
    }
    Ok(())
}

pub(crate) fn validate_text(field: &str, text: &str, chars_max: usize) -> Result<()> {
    if text.chars().count() > chars_max {
        return Err(Error::invalid(format!("{field} is longer than {chars_max} characters")));
    }
    if text.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(Error::invalid(format!("{field} contains control characters")));
    }
    Ok(())
}

pub(crate) fn validate_labels(labels: &BTreeMap<String, String>) -> Result<()> {
    if labels.len() > LABELS_MAX {
        return Err(Error::invalid(format!("at most {LABELS_MAX} labels")));
    }
    for (key, value) in labels {
        let key_ok = !key.is_empty()
            && key.len() <= LABEL_KEY_CHARS_MAX
            && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '/'));
        if !key_ok {
            return Err(Error::invalid(format!(
                "label key {:?} must be 1 to {LABEL_KEY_CHARS_MAX} of A-Z a-z 0-9 - . _ /",
                truncate(key, 70)
            )));
        }
        validate_text(&format!("label {key}"), value, LABEL_VALUE_CHARS_MAX)?;
    }
    Ok(())
}

pub(crate) fn doc<T: DeserializeOwned>(row: bc_core::store::Row) -> Result<T> {
    serde_json::from_value(row.doc).map_err(|e| Error::Internal(format!("projection document: {e}")))
}

fn to_value<T: serde::Serialize>(value: &T) -> Result<Value> {
    serde_json::to_value(value).map_err(|e| Error::Internal(format!("response: {e}")))
}

fn api_key_view(doc: &ApiKeyDoc) -> Value {
    json!({
        "keyId": doc.key_id,
        "tenantId": doc.tenant_id,
        "name": doc.name,
        "actions": doc.actions,
        "revoked": doc.revoked,
        "version": doc.version,
        "createdAtMs": doc.created_at_ms,
    })
}

// ---- inputs (wire types) ----

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct Empty {}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TenantsCreate {
    name: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TenantOnly {
    tenant_id: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ApiKeysCreate {
    tenant_id: Option<String>,
    name: String,
    actions: Vec<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ApiKeysRevoke {
    tenant_id: Option<String>,
    key_id: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolsCreate {
    tenant_id: Option<String>,
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    max_reservation_s: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolRef {
    tenant_id: Option<String>,
    pool_id: String,
    if_version: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolsUpdate {
    tenant_id: Option<String>,
    pool_id: String,
    if_version: Option<u64>,
    name: Option<String>,
    description: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    max_reservation_s: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct ListInput {
    tenant_id: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
    pool_id: Option<String>,
    #[serde(default)]
    include_archived: bool,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuInput {
    model: String,
    product: String,
    vram_gi_b: u32,
    nvlink_domain: u32,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NodesRegister {
    tenant_id: Option<String>,
    pool_id: String,
    name: String,
    gpus: Vec<GpuInput>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NodeRef {
    tenant_id: Option<String>,
    node_id: String,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct EventsList {
    tenant_id: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
    /// Type patterns (`pool.*`), at most `WATCH_TYPES_MAX`.
    #[serde(default)]
    types: Vec<String>,
    stream: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct EventsGet {
    tenant_id: Option<String>,
    event_id: String,
}

impl ListInput {
    /// A plain page: no filters.
    pub(crate) fn page(limit: Option<u32>, cursor: Option<String>) -> Self {
        Self { tenant_id: None, limit, cursor, pool_id: None, include_archived: false }
    }
}

/// The JSON schema of a method's input: the type its handler parses (for the OpenAPI
/// document). `None`: no such method.
pub fn input_schema(name: &str, g: &mut schemars::SchemaGenerator) -> Option<schemars::Schema> {
    Some(match name {
        "system.version" | "system.whoami" => g.subschema_for::<Empty>(),
        "tenants.create" => g.subschema_for::<TenantsCreate>(),
        "tenants.get" => g.subschema_for::<TenantOnly>(),
        "apiKeys.create" => g.subschema_for::<ApiKeysCreate>(),
        "apiKeys.list" | "pools.list" | "nodes.list" => g.subschema_for::<ListInput>(),
        "apiKeys.revoke" => g.subschema_for::<ApiKeysRevoke>(),
        "pools.create" => g.subschema_for::<PoolsCreate>(),
        "pools.get" | "pools.archive" => g.subschema_for::<PoolRef>(),
        "pools.update" => g.subschema_for::<PoolsUpdate>(),
        "nodes.register" => g.subschema_for::<NodesRegister>(),
        "nodes.get" => g.subschema_for::<NodeRef>(),
        "events.list" => g.subschema_for::<EventsList>(),
        "events.get" => g.subschema_for::<EventsGet>(),
        other => return crate::webhooks::input_schema(other, g).or_else(|| crate::reservations::input_schema(other, g)),
    })
}

/// Runs one method. `body` is the raw JSON body.
pub async fn dispatch(call: &Call<'_>, name: &str, body: &[u8]) -> Result<Value> {
    let store = &*call.state.store;
    match name {
        "system.version" => {
            let _: Empty = parse(body)?;
            Ok(json!({
                "version": env!("CARGO_PKG_VERSION"),
                "backend": store.backend(),
                "logKeyId": call.state.log.key.key_id(),
                "logKeyPin": call.state.log.key.pin(),
            }))
        }
        "system.whoami" => {
            let _: Empty = parse(body)?;
            let p = call.principal();
            Ok(json!({ "tenantId": p.tenant, "keyId": p.key_id, "actions": p.actions, "root": p.is_root() }))
        }
        "tenants.create" => {
            let input: TenantsCreate = parse(body)?;
            validate_name("name", &input.name)?;
            let principal = call.principal();
            if !principal.is_root() {
                return Err(Error::AccessDenied("only the root tenant's administrators create tenants".into()));
            }
            principal.authorize(call.action, principal.tenant)?;
            // The idempotency record lives in the new tenant's chain, so a retry must name the
            // same tenant: with a key, the id is derived from it.
            let tenant = match &call.idempotency_key {
                Some(key) => {
                    let digest = sha2::Sha256::digest(format!("tenant\0{}\0{key}", principal.tenant).as_bytes());
                    TenantId::from_ulid(ulid::Ulid::from_bytes(digest[..16].try_into().expect("16 bytes")))
                }
                None => TenantId::generate(),
            };
            let payload = ev::to_cbor(&ev::TenantCreated { name: input.name, root: false })?;
            let result = call
                .append(tenant, stream_of(KIND_TENANT, &tenant), ExpectedVersion::NoStream, ev::TENANT_CREATED, payload)
                .await?;
            let tenant = result.events[0].envelope.tenant;
            let row = store
                .row_get(&tenant.to_string(), KIND_TENANT, &tenant.to_string())
                .await?
                .ok_or_else(|| Error::not_found("tenant"))?;
            Ok(row.doc)
        }
        "tenants.get" => {
            let input: TenantOnly = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let row = store.row_get(&tenant.to_string(), KIND_TENANT, &tenant.to_string()).await?;
            Ok(row.ok_or_else(|| Error::not_found(format!("tenant {tenant}")))?.doc)
        }
        "apiKeys.create" => {
            let input: ApiKeysCreate = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            validate_name("name", &input.name)?;
            auth::validate_actions(&input.actions)?;
            auth::check_grantable(call.principal(), &input.actions)?;
            let key_id = ApiKeyId::generate();
            let (token, secret_sha256) = auth::new_token(key_id);
            let payload = ev::to_cbor(&ev::ApiKeyCreated { name: input.name, actions: input.actions, secret_sha256 })?;
            let result = call
                .append(tenant, stream_of(KIND_API_KEY, &key_id), ExpectedVersion::NoStream, ev::API_KEY_CREATED, payload)
                .await?;
            // A replay names the key created first; its secret was shown once and is not kept.
            let stream = &result.events[0].envelope.stream;
            let id = stream.split_once('/').map(|(_, id)| id).unwrap_or_default();
            let row = store.row_get(&tenant.to_string(), KIND_API_KEY, id).await?.ok_or_else(|| Error::not_found("api key"))?;
            let mut view = api_key_view(&doc(row)?);
            view["token"] = if result.replayed { Value::Null } else { Value::String(token) };
            view["replayed"] = Value::Bool(result.replayed);
            Ok(view)
        }
        "apiKeys.list" => {
            let input: ListInput = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            list_rows(call, tenant, KIND_API_KEY, &input, |row| Ok(Some(api_key_view(&doc(row)?)))).await
        }
        "apiKeys.revoke" => {
            let input: ApiKeysRevoke = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let key_id: ApiKeyId = parse_id("keyId", &input.key_id)?;
            let row = store
                .row_get(&tenant.to_string(), KIND_API_KEY, &key_id.to_string())
                .await?
                .ok_or_else(|| Error::not_found(format!("api key {key_id}")))?;
            let current: ApiKeyDoc = doc(row)?;
            if !current.revoked {
                let payload = ev::to_cbor(&ev::ApiKeyRevoked {})?;
                call.append(
                    tenant,
                    stream_of(KIND_API_KEY, &key_id),
                    ExpectedVersion::Exact(current.version),
                    ev::API_KEY_REVOKED,
                    payload,
                )
                .await?;
            }
            let row = store
                .row_get(&tenant.to_string(), KIND_API_KEY, &key_id.to_string())
                .await?
                .ok_or_else(|| Error::not_found("api key"))?;
            Ok(api_key_view(&doc(row)?))
        }
        "pools.create" => {
            let input: PoolsCreate = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            validate_name("name", &input.name)?;
            validate_text("description", &input.description, DESCRIPTION_CHARS_MAX)?;
            validate_labels(&input.labels)?;
            let pool = PoolId::generate();
            let payload = ev::to_cbor(&ev::PoolCreated {
                name: input.name,
                description: input.description,
                labels: input.labels,
                max_reservation_s: check_max_reservation(input.max_reservation_s)?,
            })?;
            let result =
                call.append(tenant, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, ev::POOL_CREATED, payload).await;
            let stream = match result {
                Ok(r) => r.events[0].envelope.stream.clone(),
                Err(e) => return Err(e),
            };
            let id = stream.split_once('/').map(|(_, id)| id.to_owned()).unwrap_or_default();
            pool_get(call, tenant, &id).await
        }
        "pools.get" => {
            let input: PoolRef = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pool: PoolId = parse_id("poolId", &input.pool_id)?;
            pool_get(call, tenant, &pool.to_string()).await
        }
        "pools.list" => {
            let input: ListInput = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let include_archived = input.include_archived;
            list_rows(call, tenant, KIND_POOL, &input, |row| {
                let pool: PoolDoc = doc(row)?;
                (include_archived || !pool.archived).then(|| to_value(&pool)).transpose()
            })
            .await
        }
        "pools.update" => {
            let input: PoolsUpdate = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pool: PoolId = parse_id("poolId", &input.pool_id)?;
            if let Some(name) = &input.name {
                validate_name("name", name)?;
            }
            if let Some(description) = &input.description {
                validate_text("description", description, DESCRIPTION_CHARS_MAX)?;
            }
            if let Some(labels) = &input.labels {
                validate_labels(labels)?;
            }
            let max_reservation_s = check_max_reservation(input.max_reservation_s)?;
            if input.name.is_none() && input.description.is_none() && input.labels.is_none() && max_reservation_s.is_none() {
                return Err(Error::invalid("nothing to update: give name, description, labels or maxReservationS"));
            }
            let current: PoolDoc = doc(pool_row(call, tenant, &pool).await?)?;
            if current.archived {
                return Err(Error::Conflict {
                    stream: stream_of(KIND_POOL, &pool),
                    expected: "a live pool".into(),
                    actual: current.version,
                });
            }
            let expected = ExpectedVersion::Exact(input.if_version.unwrap_or(current.version));
            let payload = ev::to_cbor(&ev::PoolUpdated {
                name: input.name,
                description: input.description,
                labels: input.labels,
                max_reservation_s,
            })?;
            call.append(tenant, stream_of(KIND_POOL, &pool), expected, ev::POOL_UPDATED, payload).await?;
            pool_get(call, tenant, &pool.to_string()).await
        }
        "pools.archive" => {
            let input: PoolRef = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pool: PoolId = parse_id("poolId", &input.pool_id)?;
            let current: PoolDoc = doc(pool_row(call, tenant, &pool).await?)?;
            if !current.archived {
                let expected = ExpectedVersion::Exact(input.if_version.unwrap_or(current.version));
                call.append(tenant, stream_of(KIND_POOL, &pool), expected, ev::POOL_ARCHIVED, ev::to_cbor(&ev::PoolArchived {})?)
                    .await?;
            }
            pool_get(call, tenant, &pool.to_string()).await
        }
        "nodes.register" => {
            let input: NodesRegister = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pool: PoolId = parse_id("poolId", &input.pool_id)?;
            validate_name("name", &input.name)?;
            validate_labels(&input.labels)?;
            if input.gpus.len() > GPUS_PER_NODE_MAX {
                return Err(Error::invalid(format!("a node has at most {GPUS_PER_NODE_MAX} GPUs")));
            }
            let mut gpus = Vec::with_capacity(input.gpus.len());
            for (i, gpu) in input.gpus.into_iter().enumerate() {
                validate_name(&format!("gpus[{i}].model"), &gpu.model.to_ascii_lowercase())?;
                validate_name(&format!("gpus[{i}].product"), &gpu.product.to_ascii_lowercase())?;
                if !(1..=GPU_VRAM_GIB_MAX).contains(&gpu.vram_gi_b) {
                    return Err(Error::invalid(format!("gpus[{i}].vramGiB must be 1 to {GPU_VRAM_GIB_MAX}")));
                }
                if gpu.nvlink_domain > NVLINK_DOMAIN_MAX {
                    return Err(Error::invalid(format!("gpus[{i}].nvlinkDomain must be 0 to {NVLINK_DOMAIN_MAX}")));
                }
                gpus.push(Gpu {
                    model: gpu.model,
                    product: gpu.product,
                    vram_gib: gpu.vram_gi_b,
                    nvlink_domain: gpu.nvlink_domain,
                });
            }
            let pool_doc: PoolDoc = doc(pool_row(call, tenant, &pool).await?)?;
            if pool_doc.archived {
                return Err(Error::invalid(format!("pool {pool} is archived")));
            }
            let node = NodeId::generate();
            let payload =
                ev::to_cbor(&ev::NodeRegistered { pool_id: pool.to_string(), name: input.name, gpus, labels: input.labels })?;
            // Only into the pool as read: an archive committed meanwhile makes this a CONFLICT.
            let guard = (stream_of(KIND_POOL, &pool), ExpectedVersion::Exact(pool_doc.version));
            let result = call
                .append_guarded(
                    tenant,
                    stream_of(KIND_NODE, &node),
                    ExpectedVersion::NoStream,
                    ev::NODE_REGISTERED,
                    payload,
                    vec![guard],
                )
                .await?;
            let id = result.events[0].envelope.stream.split_once('/').map(|(_, id)| id.to_owned()).unwrap_or_default();
            let row = store.row_get(&tenant.to_string(), KIND_NODE, &id).await?.ok_or_else(|| Error::not_found("node"))?;
            Ok(row.doc)
        }
        "nodes.get" => {
            let input: NodeRef = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let node: NodeId = parse_id("nodeId", &input.node_id)?;
            let row = store.row_get(&tenant.to_string(), KIND_NODE, &node.to_string()).await?;
            Ok(row.ok_or_else(|| Error::not_found(format!("node {node}")))?.doc)
        }
        "nodes.list" => {
            let input: ListInput = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pool = input.pool_id.as_deref().map(|p| parse_id::<PoolId>("poolId", p)).transpose()?.map(|p| p.to_string());
            list_rows(call, tenant, KIND_NODE, &input, |row| {
                let node: NodeDoc = doc(row)?;
                pool.as_ref().is_none_or(|p| *p == node.pool_id).then(|| to_value(&node)).transpose()
            })
            .await
        }
        "events.list" => {
            let input: EventsList = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let limit = limit(input.limit)?;
            let after = match &input.cursor {
                Some(c) => c.parse::<Position>()?,
                None => Position::START,
            };
            let filter = crate::watch::TypeFilter::parse(&input.types)?;
            if let Some(stream) = &input.stream {
                bc_core::event::validate_name("stream", stream, bc_core::event::STREAM_NAME_BYTES_MAX)?;
            }
            // Filters are applied while scanning by position; a page scans at most
            // EVENTS_SCAN_ROWS_MAX rows and then hands back a cursor, so a rare type cannot make
            // one call read the whole log.
            let mut items = Vec::new();
            let mut scanned = 0usize;
            let mut position = after;
            let mut exhausted = false;
            while items.len() < limit as usize && scanned < EVENTS_SCAN_ROWS_MAX {
                let page = decode_rows(store.read_after_rows(position, Some(tenant), READ_ROWS_MAX).await?)?;
                if page.is_empty() {
                    exhausted = true;
                    break;
                }
                for event in page {
                    scanned += 1;
                    position = event.position;
                    let wanted = filter.matches(&event.envelope.event_type)
                        && input.stream.as_ref().is_none_or(|s| *s == event.envelope.stream);
                    if wanted {
                        items.push(bc_projections::event_view(&event, false));
                        if items.len() == limit as usize {
                            break;
                        }
                    }
                }
            }
            let next = if exhausted {
                None
            } else {
                // More may follow: check cheaply whether anything lies past the cursor.
                let more = !store.read_after_rows(position, Some(tenant), 1).await?.is_empty();
                more.then(|| position.to_string())
            };
            Ok(json!({ "items": items, "nextCursor": next }))
        }
        "events.get" => {
            let input: EventsGet = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: EventId = parse_id("eventId", &input.event_id)?;
            let row = store.event_row(tenant, id).await?.ok_or_else(|| Error::not_found(format!("event {id}")))?;
            let event = decode_rows(vec![row])?.remove(0);
            Ok(bc_projections::event_view(&event, true))
        }
        name if name.starts_with("webhooks.") => crate::webhooks::dispatch(call, name, body).await,
        name if name.starts_with("reservations.")
            || name.starts_with("capacity.")
            || name.starts_with("quotas.")
            || matches!(name, "nodes.cordon" | "nodes.uncordon" | "nodes.drain" | "nodes.label" | "nodes.taint") =>
        {
            crate::reservations::dispatch(call, name, body).await
        }
        _ => Err(Error::not_found(format!("method {name}"))),
    }
}

/// The longest reservation a pool may allow: a year.
pub const MAX_RESERVATION_S_LIMIT: u64 = 366 * 24 * 3600;

fn check_max_reservation(value: Option<u64>) -> Result<Option<u64>> {
    match value {
        Some(s) if !(60..=MAX_RESERVATION_S_LIMIT).contains(&s) => {
            Err(Error::invalid(format!("maxReservationS must be 60 to {MAX_RESERVATION_S_LIMIT} (a year), not {s}")))
        }
        other => Ok(other),
    }
}

async fn pool_row(call: &Call<'_>, tenant: TenantId, pool: &PoolId) -> Result<bc_core::store::Row> {
    call.state
        .store
        .row_get(&tenant.to_string(), KIND_POOL, &pool.to_string())
        .await?
        .ok_or_else(|| Error::not_found(format!("pool {pool}")))
}

async fn pool_get(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<Value> {
    let row = call.state.store.row_get(&tenant.to_string(), KIND_POOL, pool).await?;
    Ok(row.ok_or_else(|| Error::not_found(format!("pool {pool}")))?.doc)
}

/// Pages through one kind of row by id. `view` may drop a row (a filter) by returning `None`;
/// filtered pages can come back short, and `nextCursor` is set while rows remain.
pub(crate) async fn list_rows(
    call: &Call<'_>,
    tenant: TenantId,
    kind: &str,
    input: &ListInput,
    view: impl Fn(bc_core::store::Row) -> Result<Option<Value>>,
) -> Result<Value> {
    let limit = limit(input.limit)?;
    if let Some(cursor) = &input.cursor
        && (cursor.len() > 64 || !cursor.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
    {
        return Err(Error::invalid("malformed cursor"));
    }
    let rows = call.state.store.row_list(&tenant.to_string(), kind, input.cursor.as_deref(), limit + 1).await?;
    let more = rows.len() > limit as usize;
    let rows: Vec<_> = rows.into_iter().take(limit as usize).collect();
    let next = if more { rows.last().map(|r| r.key.id.clone()) } else { None };
    let mut items = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(v) = view(row)? {
            items.push(v);
        }
    }
    Ok(json!({ "items": items, "nextCursor": next }))
}
