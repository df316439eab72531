//! `joinRequests.*`: machines that asked to join without a token (`bcd join --request`), and the
//! operators' decisions. Requests live in the root tenant (the machine names no tenant), so
//! these methods are the root's: authorized as `compute:jointokens:admin` in the root tenant
//! (approving admits a machine, as minting a join token does), and an approval into another
//! tenant's pool is authorized in that tenant too. The decisions are
//! `bc_projections::decide::join_request`; the machine's side is `crate::agents::join_request`.

use bc_core::Result;
use bc_core::id::{JoinRequestId, NodeId, PoolId, TenantId};
use bc_projections::decide::join_request::{JOIN_REQUEST_REASON_CHARS_MAX, join_request_approve, join_request_reject};
use bc_projections::{JoinRequestDoc, KIND_JOIN_REQUEST, KIND_JOIN_REQUEST_PENDING};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::{doc, expected_version};
use super::paging::{Page, list_rows};
use super::pools::pool_doc;
use super::validate::{
    CursorText, JoinRequestIdText, LimitNumber, PoolIdText, TenantIdText, VersionNumber, string_schema, validate_text,
};
use super::views::JoinRequestView;
use super::{Access, Call, Method, method};

const ADMIN: Access = Access::Action("compute:jointokens:admin");

pub(super) const METHODS: &[Method] = &[
    method!(
        "joinRequests.list",
        ADMIN,
        "the machines that asked to join without a token, paged by cursor",
        JoinRequestsList => Page<JoinRequestView>,
        join_requests_list,
    ),
    method!(
        "joinRequests.approve",
        ADMIN,
        "admit a pending machine into a pool: it joins when it asks next",
        JoinRequestApprove => JoinRequestView,
        join_requests_approve,
    ),
    method!(
        "joinRequests.reject",
        ADMIN,
        "turn down a pending machine: its wait ends with the reason",
        JoinRequestReject => JoinRequestView,
        join_requests_reject,
    ),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequestsList {
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
    /// Only the pending requests.
    #[serde(default)]
    pending: bool,
}

/// A pending request to admit into `tenantId`'s pool `poolId` (the caller's tenant when
/// absent), while it is at `ifVersion` (if given).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequestApprove {
    #[schemars(with = "JoinRequestIdText")]
    join_request_id: String,
    /// The tenant the machine joins (the caller's when absent).
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pool_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

/// A pending request to turn down, and why (the machine prints it).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequestReject {
    #[schemars(with = "JoinRequestIdText")]
    join_request_id: String,
    #[schemars(with = "RejectReasonText")]
    reason: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

string_schema!(
    /// Why a join request was rejected ([`validate_text`] with `JOIN_REQUEST_REASON_CHARS_MAX`), not empty.
    RejectReasonText,
    schemars::json_schema!({
        "type": "string",
        "minLength": 1,
        "maxLength": JOIN_REQUEST_REASON_CHARS_MAX,
        "pattern": super::validate::TEXT_PATTERN,
    })
);

/// Join requests are the root tenant's: the caller must act there.
async fn root(call: &Call<'_>) -> Result<TenantId> {
    call.state.authorize_tenant(call.principal(), call.action, TenantId::ROOT).await?;
    Ok(TenantId::ROOT)
}

async fn request_doc(call: &Call<'_>, id: JoinRequestId) -> Result<JoinRequestDoc> {
    call.row(root(call).await?, KIND_JOIN_REQUEST, &id.to_string(), "join request").await
}

async fn join_requests_list(call: &Call<'_>, input: JoinRequestsList) -> Result<Page<JoinRequestView>> {
    let root = root(call).await?;
    let kind = if input.pending { KIND_JOIN_REQUEST_PENDING } else { KIND_JOIN_REQUEST };
    list_rows(call, root, kind, input.limit, input.cursor.as_deref(), |row| {
        Ok(Some(JoinRequestView::from(doc::<JoinRequestDoc>(row)?)))
    })
    .await
}

async fn join_requests_approve(call: &Call<'_>, input: JoinRequestApprove) -> Result<JoinRequestView> {
    let id: JoinRequestId = parse_id("joinRequestId", &input.join_request_id)?;
    let pool_id: PoolId = parse_id("poolId", &input.pool_id)?;
    let current = request_doc(call, id).await?;
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool = pool_doc(call, tenant, &pool_id.to_string()).await?;
    if pool.archived {
        return Err(bc_core::Error::state(
            format!("pool {pool_id} is archived: no machine joins it"),
            bc_projections::decide::ARCHIVED_POOL_HINT,
        ));
    }
    let stream = format!("{KIND_JOIN_REQUEST}/{id}");
    let mut append = join_request_approve(&current, tenant, pool_id, NodeId::from_ulid(call.ulid()))?;
    append.expected = expected_version(input.if_version, current.version, &stream)?;
    call.submit(call.decided(TenantId::ROOT, append)).await?;
    Ok(call.row::<JoinRequestDoc>(TenantId::ROOT, KIND_JOIN_REQUEST, &id.to_string(), "join request").await?.into())
}

async fn join_requests_reject(call: &Call<'_>, input: JoinRequestReject) -> Result<JoinRequestView> {
    let id: JoinRequestId = parse_id("joinRequestId", &input.join_request_id)?;
    if input.reason.is_empty() {
        return Err(bc_core::Error::invalid("reason is required: the machine prints it"));
    }
    validate_text("reason", &input.reason, JOIN_REQUEST_REASON_CHARS_MAX)?;
    let current = request_doc(call, id).await?;
    let stream = format!("{KIND_JOIN_REQUEST}/{id}");
    let mut append = join_request_reject(&current, &input.reason)?;
    append.expected = expected_version(input.if_version, current.version, &stream)?;
    call.submit(call.decided(TenantId::ROOT, append)).await?;
    Ok(call.row::<JoinRequestDoc>(TenantId::ROOT, KIND_JOIN_REQUEST, &id.to_string(), "join request").await?.into())
}
