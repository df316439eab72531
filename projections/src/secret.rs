//! Write-only secrets (`secret/sec_…`): the document, the payloads of `secret.*`, and their fold.
//!
//! A secret is a name in a tenant and a version counter; its value never enters the log or a
//! projection. Each version's value is sealed in the secret store under an id of its own
//! ([`secret_value_id`], `sec_…/vN/…` with a fresh ULID, so two racing puts never write one
//! row), written before the `secret.put` that names the version and that id. The events carry
//! no value and no digest of one (a digest of a short value would be an oracle for guessing
//! it): only the name, the version and where the sealed value is kept.
//!
//! Elsewhere a secret is named by reference, `secret://TENANT/sec_…` ([`secret_ref`]); the
//! control plane alone resolves one, and records the first use of each version by each referrer
//! as `secret.resolved` on `secret_resolution/sec_…`, a stream with no row, so resolving never
//! moves the secret's own version (which `ifVersion` guards).

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, corrupt, delete_once, from_doc, payload, to_doc};

pub const SECRET_PUT: &str = "secret.put";
pub const SECRET_DELETED: &str = "secret.deleted";
pub const SECRET_RESOLVED: &str = "secret.resolved";

/// A secret's document; also its stream's prefix (`secret/sec_…`).
pub const KIND_SECRET: &str = "secret";
/// The stream (`secret_resolution/sec_…`) of a secret's `secret.resolved` events; it has no row.
pub const KIND_SECRET_RESOLUTION: &str = "secret_resolution";
/// How a reference starts: `secret://TENANT/sec_…`.
pub const SECRET_REF_SCHEME: &str = "secret://";

/// A secret: its name and current version, never its value.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretDoc {
    pub tenant_id: String,
    pub secret_id: String,
    pub name: String,
    /// The value's version: 1 for the first put, one more for each put after it.
    pub secret_version: u32,
    /// Where the current version's sealed value is kept in the secret store.
    pub value_id: String,
    /// Where the previous version's is, kept so a delivery that read the document just before a
    /// put still finds it; the put after next deletes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_value_id: Option<String>,
    /// The stream's version, for `ifVersion`.
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl SecretDoc {
    /// `secret://TENANT/sec_…`.
    pub fn reference(&self) -> String {
        secret_ref(&self.tenant_id, &self.secret_id)
    }
}

/// The secret store's id for version `version` of secret `secret_id`, made unique by `nonce` (a
/// fresh ULID): `sec_…/vN/…`.
pub fn secret_value_id(secret_id: &str, version: u32, nonce: ulid::Ulid) -> String {
    format!("{secret_id}/v{version}/{}", nonce.to_string().to_ascii_lowercase())
}

/// The reference to a secret: `secret://TENANT/sec_…`.
pub fn secret_ref(tenant: &str, secret_id: &str) -> String {
    format!("{SECRET_REF_SCHEME}{tenant}/{secret_id}")
}

/// A reference's tenant and secret id, each parsed as its typed id.
pub fn parse_secret_ref(text: &str) -> Result<(bc_core::id::TenantId, bc_core::id::SecretId)> {
    let refuse = || bc_core::Error::InvalidArgument {
        message: format!("{:?} is not a secret reference", bc_core::id::truncate(text, 90)),
        hint: Some("a reference is secret://ten_…/sec_…, as secrets put and secrets list show it".into()),
    };
    let rest = text.strip_prefix(SECRET_REF_SCHEME).ok_or_else(refuse)?;
    let (tenant, secret) = rest.split_once('/').ok_or_else(refuse)?;
    Ok((tenant.parse().map_err(|_| refuse())?, secret.parse().map_err(|_| refuse())?))
}

/// A new version of a secret (version 1 makes it). The value is sealed in the secret store,
/// never here.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretPut {
    pub name: String,
    pub secret_version: u32,
    /// Where the version's sealed value is kept in the secret store (an id, not the value).
    pub value_id: String,
}

pub type SecretDeleted = NoFields;

/// The control plane resolved a reference for `referrer` (`webhook/wh_…`) and used version
/// `secretVersion`: appended once per referrer and version, without the value.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretResolved {
    pub secret_id: String,
    pub secret_version: u32,
    pub referrer: String,
}

/// Folds one `secret.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        SECRET_PUT => {
            let p: SecretPut = payload(event)?;
            match current {
                None if p.secret_version == 1 => to_doc(&SecretDoc {
                    tenant_id: env.tenant.to_string(),
                    secret_id: key.id.clone(),
                    name: p.name,
                    secret_version: 1,
                    value_id: p.value_id,
                    previous_value_id: None,
                    version: env.version,
                    created_at_ms: env.at_ms,
                    updated_at_ms: env.at_ms,
                }),
                None => Err(corrupt(event, format!("secret {} put at version {} before version 1", key.id, p.secret_version))),
                Some(current) => {
                    let mut doc: SecretDoc = from_doc(event, Some(current))?;
                    if p.secret_version != doc.secret_version + 1 || p.name != doc.name {
                        return Err(corrupt(
                            event,
                            format!(
                                "secret {} put as {:?} version {} after {:?} version {}",
                                key.id, p.name, p.secret_version, doc.name, doc.secret_version
                            ),
                        ));
                    }
                    doc.secret_version = p.secret_version;
                    doc.previous_value_id = Some(std::mem::replace(&mut doc.value_id, p.value_id));
                    doc.version = env.version;
                    doc.updated_at_ms = env.at_ms;
                    to_doc(&doc)
                }
            }
        }
        SECRET_DELETED => delete_once(key, current, event),
        _ => Ok(current),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reference_names_a_tenant_and_a_secret() {
        let tenant = bc_core::id::TenantId::from_ulid(ulid::Ulid::from_parts(1, 7));
        let secret = bc_core::id::SecretId::from_ulid(ulid::Ulid::from_parts(2, 9));
        let text = secret_ref(&tenant.to_string(), &secret.to_string());
        assert_eq!(parse_secret_ref(&text).unwrap(), (tenant, secret));
        for bad in [
            String::new(),
            format!("secret:/{tenant}/{secret}"),
            format!("secret://{tenant}"),
            format!("secret://{secret}/{tenant}"),
            format!("secret://{tenant}/{secret}/x"),
            format!("SECRET://{tenant}/{secret}"),
        ] {
            assert!(parse_secret_ref(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(secret_value_id("sec_x", 3, ulid::Ulid::from_parts(0, 1)), "sec_x/v3/00000000000000000000000001");
    }
}
