//! `apiKeys.*`: a tenant's API keys. A key's token is shown once, in the answer to `create`;
//! the SHA-256 of its secret is kept in the secret store, not in the log. A live key's name and
//! actions can be changed (`update`); a watch or tunnel it opened is checked against its actions
//! as they are at each recheck, so taking an action away ends what needed it (`access-lost`).

use bc_core::id::ApiKeyId;
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{ApiKeyDoc, KIND_API_KEY, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::{check_if_version, expected_version};
use super::paging::{Page, list_input};
use super::resource::list_all;
use super::validate::{ApiKeyIdText, NameText, TenantIdText, VersionNumber, validate_name};
use super::views::{ApiKeyCreatedView, ApiKeyView};
use super::{Access, Call, Method, method};
use crate::auth;

const ADMIN: Access = Access::Action("compute:apikeys:admin");

pub(super) const METHODS: &[Method] = &[
    method!(
        "apiKeys.create",
        ADMIN,
        "create an API key; the token is shown once",
        ApiKeysCreate => ApiKeyCreatedView,
        api_keys_create,
    ),
    method!("apiKeys.list", ADMIN, "a tenant's API keys (never their secrets)", ApiKeysList => Page<ApiKeyView>, api_keys_list),
    method!(
        "apiKeys.update",
        ADMIN,
        "rename a live API key or replace its actions (at most what the caller holds)",
        ApiKeysUpdate => ApiKeyView,
        api_keys_update,
    ),
    method!("apiKeys.revoke", ADMIN, "revoke an API key", ApiKeysRevoke => ApiKeyView, api_keys_revoke),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeysCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NameText")]
    name: String,
    /// Actions granted (`compute:pools:read`, `compute:pools:*`, `*`); at most what the caller
    /// holds.
    #[schemars(with = "auth::ActionList")]
    actions: Vec<String>,
}

list_input!(ApiKeysList {});

/// At least one of `name`, `actions`, not `null`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("anyOf" = [
    { "required": ["name"], "properties": { "name": { "type": "string" } } },
    { "required": ["actions"], "properties": { "actions": { "type": "array" } } },
]))]
pub struct ApiKeysUpdate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ApiKeyIdText")]
    key_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
    #[schemars(with = "Option<NameText>")]
    name: Option<String>,
    /// The key's actions from now on, replacing the old ones whole; at most what the caller holds.
    #[schemars(with = "Option<auth::ActionList>")]
    actions: Option<Vec<String>>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeysRevoke {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ApiKeyIdText")]
    key_id: String,
}

async fn api_keys_create(call: &Call<'_>, input: ApiKeysCreate) -> Result<ApiKeyCreatedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    auth::validate_actions(&input.actions)?;
    auth::check_grantable(call.principal(), &input.actions)?;
    let key_id = ApiKeyId::from_ulid(call.ulid());
    let (token, secret_sha256) = auth::new_token(key_id);
    // The hash goes to the secret store before the event that names the key, never into the log.
    let store = &*call.state.store;
    let secret_id = bc_projections::api_key_secret_id(&key_id.to_string());
    store.secret_put(tenant, &secret_id, &secret_sha256, call.now_ms()).await?;
    let payload = ev::to_cbor(&ev::ApiKeyCreated { name: input.name, actions: input.actions, secret_sha256: String::new() })?;
    let appended =
        call.append(tenant, stream_of(KIND_API_KEY, &key_id), ExpectedVersion::NoStream, ev::API_KEY_CREATED, payload).await;
    let result = super::webhooks::forget_unused_secret(store, tenant, &secret_id, appended).await?;
    // A replay names the key created first; its secret was shown once and is not kept.
    let key: ApiKeyDoc = call.created(tenant, &result).await?;
    Ok(ApiKeyCreatedView { key: key.into(), token: (!result.replayed).then_some(token), replayed: result.replayed })
}

async fn api_keys_list(call: &Call<'_>, input: ApiKeysList) -> Result<Page<ApiKeyView>> {
    list_all::<ApiKeyDoc, _>(call, &input.tenant_id, input.limit, input.cursor.as_deref()).await
}

async fn api_keys_update(call: &Call<'_>, input: ApiKeysUpdate) -> Result<ApiKeyView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let key_id: ApiKeyId = parse_id("keyId", &input.key_id)?;
    if let Some(name) = &input.name {
        validate_name("name", name)?;
    }
    if let Some(actions) = &input.actions {
        auth::validate_actions(actions)?;
        auth::check_grantable(call.principal(), actions)?;
    }
    if input.name.is_none() && input.actions.is_none() {
        return Err(Error::invalid("nothing to update: give name or actions"));
    }
    check_if_version(input.if_version)?;
    let current: ApiKeyDoc = call.row(tenant, KIND_API_KEY, &key_id.to_string(), "api key").await?;
    // A retry is answered from the log (the append replays it), though the version it stated
    // is the one its first attempt moved on from.
    let retry = call.is_retry(tenant).await?;
    if current.revoked && !retry {
        return Err(Error::InvalidState {
            message: format!("api key {key_id} is revoked; a revoked key cannot be changed"),
            allowed: vec![],
            hint: Some("create a new key with apiKeys.create".into()),
        });
    }
    let stream = stream_of(KIND_API_KEY, &key_id);
    let expected = if retry {
        ExpectedVersion::Exact(current.version)
    } else {
        expected_version(input.if_version, current.version, &stream)?
    };
    let change = ev::ApiKeyUpdated {
        name: input.name.filter(|n| *n != current.name),
        actions: input.actions.filter(|a| *a != current.actions),
    };
    if change == ev::ApiKeyUpdated::default() && !retry {
        // It already is what the request asks: nothing to record.
        return Ok(current.into());
    }
    call.append(tenant, stream, expected, ev::API_KEY_UPDATED, ev::to_cbor(&change)?).await?;
    // This process authenticates the key with its new actions at once; another reads it again
    // within `auth::KEY_CACHE_TTL`.
    call.state.keys.forget(&key_id);
    let key: ApiKeyDoc = call.row(tenant, KIND_API_KEY, &key_id.to_string(), "api key").await?;
    Ok(key.into())
}

async fn api_keys_revoke(call: &Call<'_>, input: ApiKeysRevoke) -> Result<ApiKeyView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let key_id: ApiKeyId = parse_id("keyId", &input.key_id)?;
    let current: ApiKeyDoc = call.row(tenant, KIND_API_KEY, &key_id.to_string(), "api key").await?;
    if !current.revoked {
        let payload = ev::to_cbor(&ev::ApiKeyRevoked {})?;
        let expected = ExpectedVersion::Exact(current.version);
        call.append(tenant, stream_of(KIND_API_KEY, &key_id), expected, ev::API_KEY_REVOKED, payload).await?;
    }
    // A revoked key is refused before its hash is looked at: the hash is not needed again.
    call.state.store.secret_delete(tenant, &bc_projections::api_key_secret_id(&key_id.to_string())).await?;
    call.state.keys.forget(&key_id);
    let key: ApiKeyDoc = call.row(tenant, KIND_API_KEY, &key_id.to_string(), "api key").await?;
    Ok(key.into())
}
