//! `tenants.*`: the owners of the log's chains. Only the root tenant's administrators create
//! tenants.

use bc_core::id::TenantId;
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::{KIND_TENANT, TenantDoc, stream_of};
use schemars::JsonSchema;
use serde::Deserialize;
use sha2::Digest;

use super::validate::{NameText, TenantIdText, validate_name};
use super::views::TenantView;
use super::{Access, Call, Method, method};

const ADMIN: Access = Access::Action("compute:tenants:admin");

pub(super) const METHODS: &[Method] = &[
    method!("tenants.create", ADMIN, "create a tenant (root tenant only)", TenantsCreate => TenantView, tenants_create),
    method!("tenants.get", ADMIN, "one tenant", TenantOnly => TenantView, tenants_get),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantsCreate {
    #[schemars(with = "NameText")]
    name: String,
}

/// Only the tenant acted in: the caller's own unless `tenantId` names another.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantOnly {
    #[schemars(with = "Option<TenantIdText>")]
    pub tenant_id: Option<String>,
}

async fn tenants_create(call: &Call<'_>, input: TenantsCreate) -> Result<TenantView> {
    validate_name("name", &input.name)?;
    let principal = call.principal();
    if !principal.is_root() {
        return Err(Error::AccessDenied("only the root tenant's administrators create tenants".into()));
    }
    principal.authorize(call.action, principal.tenant)?;
    // The idempotency record lives in the new tenant's chain, so a retry must name the same
    // tenant: with a key, the id is derived from it.
    let tenant = match &call.idempotency_key {
        Some(key) => {
            let digest = sha2::Sha256::digest(format!("tenant\0{}\0{key}", principal.tenant).as_bytes());
            TenantId::from_ulid(ulid::Ulid::from_bytes(digest[..16].try_into().expect("16 bytes")))
        }
        None => TenantId::from_ulid(call.ulid()),
    };
    let payload = ev::to_cbor(&ev::TenantCreated { name: input.name, root: false })?;
    let result =
        call.append(tenant, stream_of(KIND_TENANT, &tenant), ExpectedVersion::NoStream, ev::TENANT_CREATED, payload).await?;
    let tenant = result.events[0].envelope.tenant;
    let doc: TenantDoc = call.row(tenant, KIND_TENANT, &tenant.to_string(), "tenant").await?;
    Ok(doc.into())
}

async fn tenants_get(call: &Call<'_>, input: TenantOnly) -> Result<TenantView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let doc: TenantDoc = call.row(tenant, KIND_TENANT, &tenant.to_string(), "tenant").await?;
    Ok(doc.into())
}
