//! `releases.*`: signed `bcd` releases. `releases.register` takes a manifest and its detached
//! signature (`better-compute release sign` makes both) and keeps them only when the signature
//! verifies under a release key this deployment was configured with (`--release-key`): keys are
//! trusted by configuration, never because a caller sent them. A version is registered once
//! per tenant. A manifest that allows a downgrade must say until when (`notAfter`) and is
//! refused past it. The agents check the same signature again under their own pinned keys;
//! `commands.issue` sends `agent.update` only for a registered release.

use bc_core::id::{ReleaseId, TenantId, truncate};
use bc_core::release::{MANIFEST_BYTES_MAX, SIGNATURE_BYTES_MAX};
use bc_core::store::ExpectedVersion;
use bc_core::{Error, Result};
use bc_projections::events as ev;
use bc_projections::rollout::{KIND_RELEASE, ReleaseArtifact, ReleaseDoc, ReleaseRegistered};
use bc_projections::stream_of;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::call::doc;
use super::paging::{Page, list_input};
use super::resource::list_all;
use super::validate::{ReleaseIdText, TenantIdText};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:releases:read");
const WRITE: Access = Access::Action("compute:releases:write");

/// Releases one tenant registers at most: a register reads them all (a version is unique).
pub const RELEASES_PER_TENANT_MAX: u32 = 500;
const _: () = assert!(RELEASES_PER_TENANT_MAX <= bc_core::store::READ_ROWS_MAX);

pub(super) const METHODS: &[Method] = &[
    method!("releases.register", WRITE, "register a signed bcd release (manifest and signature)", ReleasesRegister => ReleaseView, releases_register),
    method!("releases.get", READ, "one release", ReleaseRef => ReleaseView, releases_get),
    method!("releases.list", READ, "a tenant's releases, paged by cursor", ReleasesList => Page<ReleaseView>, releases_list),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleasesRegister {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// The manifest's JSON text exactly as signed.
    #[schemars(length(min = 1, max = MANIFEST_BYTES_MAX))]
    manifest: String,
    /// The signature file's line: `rk_<16 hex> <base64 signature>`.
    #[schemars(length(min = 1, max = SIGNATURE_BYTES_MAX))]
    signature: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ReleaseIdText")]
    release_id: String,
}

list_input!(ReleasesList {});

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "ReleaseIdText")]
    pub release_id: String,
    /// The release's semantic version.
    pub release_version: String,
    /// The release key that signed it (`rk_…`).
    pub key_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_update_from: Option<String>,
    pub allow_downgrade: bool,
    pub artifacts: Vec<ReleaseArtifact>,
    /// The manifest as signed, and its signature line: what the agents verify again.
    pub manifest: String,
    pub signature: String,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<ReleaseDoc> for ReleaseView {
    fn from(d: ReleaseDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            release_id: d.release_id,
            release_version: d.release_version,
            key_id: d.key_id,
            min_update_from: d.min_update_from,
            allow_downgrade: d.allow_downgrade,
            artifacts: d.artifacts,
            manifest: d.manifest,
            signature: d.signature,
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}

/// A tenant's release of `id`.
pub(super) async fn release_doc(call: &Call<'_>, tenant: TenantId, id: &ReleaseId) -> Result<ReleaseDoc> {
    call.row(tenant, KIND_RELEASE, &id.to_string(), "release").await
}

async fn releases_register(call: &Call<'_>, input: ReleasesRegister) -> Result<ReleaseView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    // A signature that does not verify under a key this deployment trusts is a signer that may
    // not publish releases here: ACCESS_DENIED (the signature is checked before the manifest is
    // read at all). A manifest a trusted key signed that does not hold up, or a downgrade
    // permission past its notAfter, is INVALID_ARGUMENT (`decide::release_check`, which
    // `commands.issue` of `agent.update` applies too).
    let manifest =
        bc_projections::decide::release_check(&call.state.release_keys, &input.manifest, &input.signature, call.now_ms())?;
    let _names = call.state.name_locks.lock(tenant).await;
    if !call.is_retry(tenant).await? {
        let rows = call.state.store.row_list(&tenant.to_string(), KIND_RELEASE, None, RELEASES_PER_TENANT_MAX).await?;
        let existing = rows.into_iter().map(doc::<ReleaseDoc>).collect::<Result<Vec<_>>>()?;
        if let Some(same) = existing.iter().find(|r| r.release_version == manifest.version) {
            return Err(Error::AlreadyExists {
                what: format!("release {} ({})", truncate(&manifest.version, 64), same.release_id),
            });
        }
        if existing.len() >= RELEASES_PER_TENANT_MAX as usize {
            return Err(Error::state(
                format!("a tenant has at most {RELEASES_PER_TENANT_MAX} releases"),
                "releases are kept for the audit trail: publish only versions you roll out, or use another tenant",
            ));
        }
    }
    let release = ReleaseId::from_ulid(call.ulid());
    let payload = ev::to_cbor(&ReleaseRegistered {
        release_version: manifest.version.clone(),
        manifest: input.manifest,
        signature: input.signature.trim_end().to_owned(),
        key_id: manifest.key_id.clone(),
        min_update_from: manifest.min_update_from.clone(),
        allow_downgrade: manifest.allow_downgrade,
        artifacts: manifest
            .artifacts
            .iter()
            .map(|a| ReleaseArtifact { arch: a.arch.clone(), url: a.url.clone(), sha256: a.sha256.clone(), size: a.size })
            .collect(),
    })?;
    let result = call
        .append(tenant, stream_of(KIND_RELEASE, &release), ExpectedVersion::NoStream, ev::RELEASE_REGISTERED, payload)
        .await?;
    Ok(call.created::<ReleaseDoc>(tenant, &result).await?.into())
}

async fn releases_get(call: &Call<'_>, input: ReleaseRef) -> Result<ReleaseView> {
    Ok(call.named::<ReleaseDoc>(&input.tenant_id, &input.release_id).await?.into())
}

async fn releases_list(call: &Call<'_>, input: ReleasesList) -> Result<Page<ReleaseView>> {
    list_all::<ReleaseDoc, _>(call, &input.tenant_id, input.limit, input.cursor.as_deref()).await
}
