//! `joinTokens.*`: the credentials machines join with (`bcd join`). A token is scoped to a
//! tenant and a pool, expires, and is single use unless it says otherwise. Its secret is shown
//! once; only the SHA-256 of the secret is kept, in the secret store, never in the log.

use bc_core::Result;
use bc_core::agent::{join_token_new, looks_like_join_token};
use bc_core::id::{JoinTokenId, TenantId};
use bc_core::store::ExpectedVersion;
use bc_core::{Error, id};
use bc_projections::events as ev;
use bc_projections::{JoinTokenDoc, KIND_JOIN_TOKEN, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::{doc, stream_id};
use super::paging::{Page, list_input, list_rows};
use super::pools::pool_doc;
use super::validate::{DESCRIPTION_CHARS_MAX, DescriptionText, JoinTokenIdText, PoolIdText, TenantIdText, validate_text};
use super::views::{JoinTokenCreatedView, JoinTokenView};
use super::{Access, Call, Method, method};

const ADMIN: Access = Access::Action("compute:jointokens:admin");

/// A token lives an hour unless asked otherwise, and at most thirty days.
pub const JOIN_TOKEN_EXPIRES_S_DEFAULT: u64 = 3600;
pub const JOIN_TOKEN_EXPIRES_S_MAX: u64 = 30 * 24 * 3600;
/// Most machines one token may join.
pub const JOIN_TOKEN_USES_MAX: u32 = 1000;

pub(super) const METHODS: &[Method] = &[
    method!(
        "joinTokens.create",
        ADMIN,
        "create a join token for one pool; the secret is shown once",
        JoinTokensCreate => JoinTokenCreatedView,
        join_tokens_create,
    ),
    method!("joinTokens.get", ADMIN, "one join token (never its secret)", JoinTokenRef => JoinTokenView, join_tokens_get),
    method!("joinTokens.list", ADMIN, "a tenant's join tokens, paged by cursor", JoinTokensList => Page<JoinTokenView>, join_tokens_list),
    method!("joinTokens.revoke", ADMIN, "revoke a join token: no machine joins with it again", JoinTokenRef => JoinTokenView, join_tokens_revoke),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokensCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// The pool the machines join.
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    #[serde(default)]
    #[schemars(with = "DescriptionText")]
    description: String,
    /// Seconds until it expires (default an hour).
    #[schemars(range(min = 1, max = JOIN_TOKEN_EXPIRES_S_MAX))]
    expires_s: Option<u64>,
    /// How many machines may join with it (default 1).
    #[schemars(range(min = 1, max = JOIN_TOKEN_USES_MAX))]
    uses: Option<u32>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokenRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "JoinTokenIdText")]
    join_token_id: String,
}

list_input!(JoinTokensList {});

/// A token id, refusing a pasted secret without quoting it.
fn token_id(text: &str) -> Result<JoinTokenId> {
    if looks_like_join_token(text) {
        return Err(Error::InvalidArgument {
            message: "joinTokenId holds a join token's secret, not its id".into(),
            hint: Some("pass the jt_… id that joinTokens.create and joinTokens.list show; treat the secret as exposed and revoke the token".into()),
        });
    }
    parse_id("joinTokenId", text)
}

async fn token_doc(call: &Call<'_>, tenant: TenantId, id: &JoinTokenId) -> Result<JoinTokenDoc> {
    call.row(tenant, KIND_JOIN_TOKEN, &id.to_string(), "join token").await
}

async fn join_tokens_create(call: &Call<'_>, input: JoinTokensCreate) -> Result<JoinTokenCreatedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_text("description", &input.description, DESCRIPTION_CHARS_MAX)?;
    let expires_s = input.expires_s.unwrap_or(JOIN_TOKEN_EXPIRES_S_DEFAULT);
    if !(1..=JOIN_TOKEN_EXPIRES_S_MAX).contains(&expires_s) {
        return Err(Error::invalid(format!("expiresS must be 1 to {JOIN_TOKEN_EXPIRES_S_MAX} seconds")));
    }
    let uses_max = input.uses.unwrap_or(1);
    if !(1..=JOIN_TOKEN_USES_MAX).contains(&uses_max) {
        return Err(Error::invalid(format!("uses must be 1 to {JOIN_TOKEN_USES_MAX}")));
    }
    let pool_id: id::PoolId = parse_id("poolId", &input.pool_id)?;
    let pool = pool_doc(call, tenant, &pool_id.to_string()).await?;
    if pool.archived {
        return Err(Error::state(
            format!("pool {pool_id} is archived: no machine joins it"),
            bc_projections::decide::ARCHIVED_POOL_HINT,
        ));
    }
    let join_token = JoinTokenId::from_ulid(call.ulid());
    let (token, secret_sha256) = join_token_new(join_token);
    let payload = ev::to_cbor(&ev::JoinTokenCreated {
        pool_id: pool_id.to_string(),
        description: input.description,
        expires_at_ms: call.now_ms().saturating_add(expires_s * 1000),
        uses_max,
        node_id: None,
    })?;
    let pool_stream = stream_of(bc_projections::KIND_POOL, &pool_id);
    let result = call
        .append_guarded(
            tenant,
            stream_of(KIND_JOIN_TOKEN, &join_token),
            ExpectedVersion::NoStream,
            ev::JOIN_TOKEN_CREATED,
            payload,
            vec![(pool_stream, ExpectedVersion::Exact(pool.version))],
        )
        .await?;
    // A replay names the token created first; its secret was shown once and is not kept, and
    // nothing new is stored. A crash before the hash is stored leaves a token no one can use.
    if !result.replayed {
        call.state.store.secret_put(tenant, &join_token.to_string(), &secret_sha256, call.now_ms()).await?;
    }
    let id = stream_id(&result.events[0].envelope.stream);
    let doc: JoinTokenDoc = call.row(tenant, KIND_JOIN_TOKEN, id, "join token").await?;
    Ok(JoinTokenCreatedView {
        join_token: JoinTokenView::of(doc, call.now_ms()),
        token: (!result.replayed).then_some(token),
        replayed: result.replayed,
    })
}

async fn join_tokens_get(call: &Call<'_>, input: JoinTokenRef) -> Result<JoinTokenView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id = token_id(&input.join_token_id)?;
    Ok(JoinTokenView::of(token_doc(call, tenant, &id).await?, call.now_ms()))
}

async fn join_tokens_list(call: &Call<'_>, input: JoinTokensList) -> Result<Page<JoinTokenView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let now_ms = call.now_ms();
    list_rows(call, tenant, KIND_JOIN_TOKEN, input.limit, input.cursor.as_deref(), |row| {
        Ok(Some(JoinTokenView::of(doc::<JoinTokenDoc>(row)?, now_ms)))
    })
    .await
}

async fn join_tokens_revoke(call: &Call<'_>, input: JoinTokenRef) -> Result<JoinTokenView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id = token_id(&input.join_token_id)?;
    let current = token_doc(call, tenant, &id).await?;
    if !current.revoked {
        let payload = ev::to_cbor(&ev::JoinTokenRevoked {})?;
        let expected = ExpectedVersion::Exact(current.version);
        call.append(tenant, stream_of(KIND_JOIN_TOKEN, &id), expected, ev::JOIN_TOKEN_REVOKED, payload).await?;
        // The hash is of no use once revoked.
        call.state.store.secret_delete(tenant, &id.to_string()).await?;
    }
    Ok(JoinTokenView::of(token_doc(call, tenant, &id).await?, call.now_ms()))
}
