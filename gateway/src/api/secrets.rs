//! `secrets.*`: write-only secrets. A secret is a name in a tenant (`secret/sec_…`) with a
//! version counter; each version's value is sealed in the secret store under the data key
//! (`bc_core::sealing`), written before the `secret.put` that names it, and never read back
//! through the API: `put` and `list` answer names, versions and the reference
//! (`secret://TENANT/sec_…`), never a value. The events carry no value and no digest of one.
//!
//! A put of a name the tenant holds makes its next version; each version's value has a row of
//! its own (`sec_…/vN/…`, named by the event), so two puts racing to one version never write
//! one row and the loser's cleanup never takes the winner's value. The previous version's value
//! is kept (a delivery that read the document just before still finds it), the one before is
//! deleted. A delete is refused while a webhook names the secret (`--secret-ref`), naming it.
//!
//! Idempotency: a retried put is "the same request" by its method, tenant and name, never by
//! its value, since the request's fingerprint is kept in the idempotency records and a hash of
//! a short value would be an oracle for it.

use std::collections::BTreeMap;

use bc_core::id::{SecretId, TenantId};
use bc_core::{Error, Result};
use bc_projections::decide::secret::{SECRET_VALUE_CHARS_MAX, SECRETS_PER_TENANT_MAX, secret_delete, secret_put};
use bc_projections::sandbox::{KIND_SANDBOX_TEMPLATE, SandboxTemplateDoc};
use bc_projections::secret::{KIND_SECRET, SECRET_REF_SCHEME, SecretDoc, parse_secret_ref, secret_ref};
use bc_projections::{KIND_WEBHOOK, WebhookDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::call::{check_if_version, doc};
use super::paging::{Page, list_input};
use super::resource::{Resource, list_all};
use super::validate::{NameText, TenantIdText, ULID_PATTERN, VersionNumber, string_schema, validate_name};
use super::webhooks::{WEBHOOKS_PER_TENANT_MAX, forget_unused_secret};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:secrets:read");
const WRITE: Access = Access::Action("compute:secrets:write");
const _: () = assert!(SECRETS_PER_TENANT_MAX as u32 <= bc_core::store::READ_ROWS_MAX);

pub(super) const METHODS: &[Method] = &[
    method!(
        "secrets.put",
        WRITE,
        "store a secret's value under a name (a new version if the name exists); never shown again",
        SecretsPut => SecretView,
        secrets_put,
    ),
    method!("secrets.list", READ, "a tenant's secrets: names and versions, never values", SecretsList => Page<SecretView>, secrets_list),
    method!(
        "secrets.delete",
        WRITE,
        "delete a secret and its values; refused while anything refers to it",
        SecretsDelete => SecretDeletedView,
        secrets_delete,
    ),
];

impl Resource for SecretDoc {
    const KIND: &'static str = KIND_SECRET;
    const WHAT: &'static str = "secret";
    const ID_FIELD: &'static str = "secretId";
    type Id = SecretId;
}

string_schema!(
    /// A secret's value: 1 to `SECRET_VALUE_CHARS_MAX` characters of any text.
    SecretValueText as "SecretValue",
    |_| schemars::json_schema!({ "type": "string", "minLength": 1, "maxLength": SECRET_VALUE_CHARS_MAX, "writeOnly": true })
);

/// The pattern of a secret reference, exactly what [`parse_secret_ref`] takes.
pub fn secret_ref_pattern() -> String {
    format!("^secret://ten_{ULID_PATTERN}/sec_{ULID_PATTERN}$")
}

string_schema!(
    /// A reference to a secret: `secret://TENANT/sec_…`.
    SecretRefText as "SecretRef",
    |_| schemars::json_schema!({ "type": "string", "pattern": secret_ref_pattern() })
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretsPut {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    /// Unique within the tenant; a put of a name it holds makes a new version.
    #[schemars(with = "NameText")]
    name: String,
    #[schemars(with = "SecretValueText")]
    value: String,
    /// Put only while the secret is at this version (0: only if the name is new).
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretsDelete {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "NameText")]
    name: String,
    /// Delete only while the secret is at this version.
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

list_input!(SecretsList {});

/// A secret as the API shows it: never its value.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretView {
    pub secret_id: String,
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    /// How other objects name it: `secret://TENANT/sec_…`.
    #[serde(rename = "ref")]
    #[schemars(with = "SecretRefText")]
    pub reference: String,
    /// The value's version: 1, then one more for each put.
    pub secret_version: u32,
    /// The stream's version, for `ifVersion`.
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<SecretDoc> for SecretView {
    fn from(d: SecretDoc) -> Self {
        Self {
            reference: d.reference(),
            secret_id: d.secret_id,
            tenant_id: d.tenant_id,
            name: d.name,
            secret_version: d.secret_version,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretDeletedView {
    pub secret_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub deleted: bool,
}

/// A value within its bounds (what the schema says).
pub fn validate_secret_value(value: &str) -> Result<()> {
    let chars = value.chars().count();
    if chars == 0 || chars > SECRET_VALUE_CHARS_MAX {
        // Never the value itself, not even a part of it.
        return Err(Error::invalid(format!("value must be 1 to {SECRET_VALUE_CHARS_MAX} characters, not {chars}")));
    }
    Ok(())
}

/// The tenant's secrets (at most [`SECRETS_PER_TENANT_MAX`]).
pub(super) async fn tenant_secrets(call: &Call<'_>, tenant: TenantId) -> Result<Vec<SecretDoc>> {
    let rows = call.state.store.row_list(&tenant.to_string(), KIND_SECRET, None, SECRETS_PER_TENANT_MAX as u32).await?;
    rows.into_iter().map(doc::<SecretDoc>).collect()
}

/// What signs with `reference` in `tenant`: `webhook/wh_…` for each webhook that does.
pub(super) async fn webhook_referrers(call: &Call<'_>, tenant: TenantId, reference: &str) -> Result<Vec<String>> {
    let rows = call.state.store.row_list(&tenant.to_string(), KIND_WEBHOOK, None, WEBHOOKS_PER_TENANT_MAX).await?;
    let mut out = Vec::new();
    for row in rows {
        let hook: WebhookDoc = doc(row)?;
        if hook.secret_ref.as_deref() == Some(reference) {
            out.push(format!("{KIND_WEBHOOK}/{}", hook.webhook_id));
        }
    }
    Ok(out)
}

/// What refers to `reference` in `tenant`: the webhooks that sign with it, and
/// `sandbox_template/sbxt_…` for each template whose environment names it.
pub(super) async fn referrers(call: &Call<'_>, tenant: TenantId, reference: &str) -> Result<Vec<String>> {
    let mut out = webhook_referrers(call, tenant, reference).await?;
    let mut after: Option<String> = None;
    loop {
        let rows = call
            .state
            .store
            .row_list(&tenant.to_string(), KIND_SANDBOX_TEMPLATE, after.as_deref(), bc_core::store::READ_ROWS_MAX)
            .await?;
        let full = rows.len() == bc_core::store::READ_ROWS_MAX as usize;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            let template: SandboxTemplateDoc = doc(row)?;
            if template.env.values().any(|v| v == reference) {
                out.push(format!("{KIND_SANDBOX_TEMPLATE}/{}", template.template_id));
            }
        }
        if !full {
            return Ok(out);
        }
    }
}

/// A sandbox environment's values checked where they are secret references
/// (`secret://TENANT/sec_…`): each a secret of `tenant` that exists now (another tenant's is not
/// found, as from this tenant it is not). Answers the environment with each reference in its
/// canonical form, which [`referrers`] and the session's resolution compare. Values that are not
/// references are the environment's own and pass as they are.
pub(super) async fn env_refs_checked(
    call: &Call<'_>,
    tenant: TenantId,
    env: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>> {
    let mut out = env.clone();
    for (name, value) in out.iter_mut() {
        if !is_secret_ref(value) {
            continue;
        }
        let (owner, secret_id) = parse_secret_ref(value).map_err(|e| match e {
            Error::InvalidArgument { message, hint } => {
                Error::InvalidArgument { message: format!("env {name}: {message}"), hint }
            }
            other => other,
        })?;
        let canonical = secret_ref(&owner.to_string(), &secret_id.to_string());
        if owner != tenant {
            return Err(Error::not_found(format!("env {name}: secret {canonical} in tenant {tenant}")));
        }
        let _: SecretDoc = call.row(tenant, KIND_SECRET, &secret_id.to_string(), "secret").await?;
        *value = canonical;
    }
    Ok(out)
}

/// Whether an environment value is a secret reference (`secret://…`), which the control plane
/// resolves when it sends the sandbox to its node; any case of the scheme, as the parser reads
/// none but the lowercase one and refuses the rest.
pub(crate) fn is_secret_ref(value: &str) -> bool {
    value.get(..SECRET_REF_SCHEME.len()).is_some_and(|s| s.eq_ignore_ascii_case(SECRET_REF_SCHEME))
}

/// The actor of the `secret.resolved` events the agents' endpoint appends.
const SESSION_RESOLVER_ACTOR: &str = "gateway:agents";

/// A `sandbox.apply` command's arguments as its node receives them: each secret reference in
/// `env` replaced by the secret's current value, and each resolution recorded once per referrer
/// (`sandbox/sbx_…`) and version as `secret.resolved`, without the value, before the value
/// leaves the control plane. The command in the log keeps the references. A reference that does
/// not resolve (the secret deleted, another tenant's, its value not readable yet) is an error:
/// the command is not sent with it.
pub(crate) async fn resolve_env_refs(
    store: &dyn bc_core::store::EventStore,
    log: &bc_core::store::Log,
    tenant: TenantId,
    referrer: &str,
    env: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    for value in env.values_mut() {
        let Some(reference) = value.as_str().filter(|v| is_secret_ref(v)) else { continue };
        let (owner, secret_id) = parse_secret_ref(reference)?;
        if owner != tenant {
            return Err(Error::not_found(format!("secret {reference} in tenant {tenant}")));
        }
        let row = store
            .row_get(&tenant.to_string(), KIND_SECRET, &secret_id.to_string())
            .await?
            .ok_or_else(|| Error::not_found(format!("secret {reference} (deleted)")))?;
        let secret: SecretDoc = doc(row)?;
        let text = store
            .secret_get(tenant, &secret.value_id)
            .await?
            .ok_or_else(|| Error::Unavailable(format!("version {} of {reference} is not readable yet", secret.secret_version)))?;
        let payload = bc_projections::events::to_cbor(&bc_projections::events::SecretResolved {
            secret_id: secret.secret_id.clone(),
            secret_version: secret.secret_version,
            referrer: referrer.to_owned(),
        })?;
        let mut request = bc_core::store::AppendRequest::new(
            tenant,
            bc_projections::stream_of(bc_projections::secret::KIND_SECRET_RESOLUTION, &secret.secret_id),
            bc_core::store::ExpectedVersion::Any,
            SESSION_RESOLVER_ACTOR,
            vec![bc_core::store::NewEvent::new(bc_projections::events::SECRET_RESOLVED, payload)],
        );
        request.idempotency_key = Some(format!("secret_resolved:{referrer}:{}:{}", secret.secret_id, secret.secret_version));
        log.append(request).await?;
        *value = serde_json::Value::String(text);
    }
    Ok(())
}

async fn secrets_put(call: &Call<'_>, input: SecretsPut) -> Result<SecretView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    validate_secret_value(&input.value)?;
    check_if_version(input.if_version)?;
    // Names are checked and taken under the tenant's lock, as flavors' and images' are; a
    // retry is answered from the log by its idempotency key, whatever the secrets say now.
    let _names = call.state.name_locks.lock(tenant).await;
    let existing = tenant_secrets(call, tenant).await?;
    // A retry's `ifVersion` was checked by the first request, whose version it then moved.
    let if_version = if call.is_retry(tenant).await? { None } else { input.if_version };
    let plan = secret_put(&existing, &input.name, if_version, SecretId::from_ulid(call.ulid()), call.ulid())?;
    // A secret a webhook signs with stays a signing secret: another kind of value would fail
    // every delivery of those webhooks, so it is refused here, as binding one is.
    if let Some(current) = existing.iter().find(|s| s.name == input.name)
        && bc_core::webhook::Secret::parse(&input.value).is_err()
    {
        let referrers = webhook_referrers(call, tenant, &current.reference()).await?;
        if !referrers.is_empty() {
            return Err(Error::state(
                format!(
                    "secret {:?} is a webhook signing secret ({} sign with it): its new value must be one too",
                    input.name,
                    referrers.join(", ")
                ),
                "a webhook signs with whsec_ followed by the base64 of 24 to 64 random bytes",
            ));
        }
    }
    // The value is sealed and stored before the event that names its version, so a reader of
    // the document always finds it; an append that does not happen takes the row back.
    call.state.store.secret_put(tenant, &plan.value_id, &input.value, call.now_ms()).await?;
    let mut request = call.decided(tenant, plan.append);
    let mut fingerprint = Sha256::new();
    fingerprint.update(b"secrets.put\0");
    fingerprint.update(tenant.to_string().as_bytes());
    fingerprint.update([0]);
    fingerprint.update(input.name.as_bytes());
    request.fingerprint = Some(fingerprint.finalize().into());
    let appended = call.submit(request).await;
    let result = forget_unused_secret(&*call.state.store, tenant, &plan.value_id, appended).await?;
    if !result.replayed
        && let Some(stale) = &plan.stale_value_id
        && let Err(e) = call.state.store.secret_delete(tenant, stale).await
    {
        // The put is made; the value two versions back stays sealed until a later put or the
        // secret's delete removes it.
        tracing::warn!(code = %e.code(), error = %e, "a secret's old value could not be removed");
    }
    let id = bc_projections::stream_id_of(&result.events[0].envelope.stream).to_owned();
    Ok(call.row::<SecretDoc>(tenant, KIND_SECRET, &id, "secret").await?.into())
}

async fn secrets_list(call: &Call<'_>, input: SecretsList) -> Result<Page<SecretView>> {
    list_all::<SecretDoc, _>(call, &input.tenant_id, input.limit, input.cursor.as_deref()).await
}

async fn secrets_delete(call: &Call<'_>, input: SecretsDelete) -> Result<SecretDeletedView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    validate_name("name", &input.name)?;
    // Under the names' lock, which a webhook naming a secret also takes: in this process a
    // reference cannot be made between the check and the delete.
    let _names = call.state.name_locks.lock(tenant).await;
    let existing = tenant_secrets(call, tenant).await?;
    let Some(secret) = existing.into_iter().find(|s| s.name == input.name) else {
        return Err(Error::not_found(format!("secret {:?}", input.name)));
    };
    let referring = referrers(call, tenant, &secret.reference()).await?;
    let append = secret_delete(&secret, input.if_version, &referring)?;
    call.submit(call.decided(tenant, append)).await?;
    // Its values go with it.
    for value_id in std::iter::once(&secret.value_id).chain(&secret.previous_value_id) {
        call.state.store.secret_delete(tenant, value_id).await?;
    }
    Ok(SecretDeletedView { secret_id: secret.secret_id, name: secret.name, deleted: true })
}

#[cfg(test)]
mod tests {
    use schemars::{JsonSchema, SchemaGenerator};

    use super::*;

    #[test]
    fn the_reference_pattern_says_what_the_parser_does() {
        let pattern = regex::Regex::new(&secret_ref_pattern()).unwrap();
        let tenant = TenantId::generate().to_string();
        let secret = SecretId::generate().to_string();
        let good = format!("secret://{tenant}/{secret}");
        let cases = [
            (good.clone(), true),
            (good.to_uppercase().replace("SECRET://TEN_", "secret://ten_").replace("/SEC_", "/sec_"), true),
            (format!("secret://{secret}/{tenant}"), false),
            (format!("secret://{tenant}/{secret}/"), false),
            (format!("secret:/{tenant}/{secret}"), false),
            (format!(" {good}"), false),
            (format!("secret://{tenant}/sec_"), false),
        ];
        for (text, ok) in cases {
            assert_eq!(pattern.is_match(&text), ok, "pattern, {text:?}");
            assert_eq!(bc_projections::secret::parse_secret_ref(&text).is_ok(), ok, "parser, {text:?}");
        }
    }

    #[test]
    fn the_value_bound_is_the_schemas() {
        let schema = SecretValueText::json_schema(&mut SchemaGenerator::default());
        assert_eq!(schema.get("maxLength").and_then(|v| v.as_u64()), Some(SECRET_VALUE_CHARS_MAX as u64));
        assert_eq!(schema.get("minLength").and_then(|v| v.as_u64()), Some(1));
        assert!(validate_secret_value("x").is_ok());
        assert!(validate_secret_value(&"é".repeat(SECRET_VALUE_CHARS_MAX)).is_ok(), "characters, not bytes");
        assert!(validate_secret_value("").is_err());
        let err = validate_secret_value(&"s3cr3t".repeat(SECRET_VALUE_CHARS_MAX)).unwrap_err().to_string();
        assert!(!err.contains("s3cr3t"), "a refusal never echoes the value: {err}");
    }
}
