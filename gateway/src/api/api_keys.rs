//! `apiKeys.*`: a tenant's API keys. A key's token is shown once, in the answer to `create`;
//! the SHA-256 of its secret is kept in the secret store, not in the log.

use bc_core::Result;
use bc_core::id::ApiKeyId;
use bc_core::store::ExpectedVersion;
use bc_projections::events as ev;
use bc_projections::{ApiKeyDoc, KIND_API_KEY, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::paging::{Page, list_input};
use super::resource::list_all;
use super::validate::{ApiKeyIdText, NameText, TenantIdText, validate_name};
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
