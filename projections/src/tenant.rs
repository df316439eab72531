//! Tenants and their API keys (`tenant/ten_…`, `api_key/key_…`): the documents, the payloads of
//! `tenant.*` and `api_key.*`, and their fold.
//!
//! A tenant is made once and never changes. An API key is made with its actions; its name and
//! actions can be changed (`api_key.updated`) and it can be revoked, which is final. Neither a key's document nor its events carry its secret: the secret's hash is in the
//! secret store under [`api_key_secret_id`] (only keys made before that carry it in their event).

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, create, from_doc, set_if, to_doc, update};

pub const TENANT_CREATED: &str = "tenant.created";
pub const API_KEY_CREATED: &str = "api_key.created";
pub const API_KEY_REVOKED: &str = "api_key.revoked";
pub const API_KEY_UPDATED: &str = "api_key.updated";

/// A tenant's document; also its stream's prefix (`tenant/ten_…`), as every row kind is its
/// stream's.
pub const KIND_TENANT: &str = "tenant";
/// An API key's document; also its stream's prefix (`api_key/key_…`).
pub const KIND_API_KEY: &str = "api_key";

/// A tenant document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TenantDoc {
    pub tenant_id: String,
    pub name: String,
    pub root: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

/// An API key document. It holds no secret: the SHA-256 of the token's secret is in the secret
/// store under [`api_key_secret_id`] (keys created before that carry it here, from their event).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyDoc {
    pub tenant_id: String,
    pub key_id: String,
    pub name: String,
    pub actions: Vec<String>,
    /// Only for keys whose `api_key.created` carried the hash; empty otherwise.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_sha256: String,
    pub revoked: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

/// The id of an API key's secret hash in the secret store (the log does not carry it).
pub fn api_key_secret_id(key_id: &str) -> String {
    key_id.to_owned()
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantCreated {
    pub name: String,
    pub root: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeyCreated {
    pub name: String,
    pub actions: Vec<String>,
    /// Hex SHA-256 of the secret part of the token: only in keys created before the hash moved
    /// to the secret store ([`crate::api_key_secret_id`]); new events leave it out, so neither
    /// the log nor what is delivered from it carries it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub secret_sha256: String,
}

pub type ApiKeyRevoked = NoFields;

/// A live key's new name and/or actions; an absent field is unchanged. The actions replace the
/// old ones whole: a watch or tunnel the key opened is checked against them at its next recheck.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeyUpdated {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actions: Option<Vec<String>>,
}

/// Folds one `tenant.*` or `api_key.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match event.envelope.event_type.as_str() {
        TENANT_CREATED => create(event, |p: TenantCreated, env| TenantDoc {
            tenant_id: env.tenant.to_string(),
            name: p.name,
            root: p.root,
            version: env.version,
            created_at_ms: env.at_ms,
        }),
        API_KEY_CREATED => create(event, |p: ApiKeyCreated, env| ApiKeyDoc {
            tenant_id: env.tenant.to_string(),
            key_id: key.id.clone(),
            name: p.name,
            actions: p.actions,
            secret_sha256: p.secret_sha256,
            revoked: false,
            version: env.version,
            created_at_ms: env.at_ms,
        }),
        API_KEY_UPDATED => update(event, current, |doc: &mut ApiKeyDoc, p: ApiKeyUpdated| {
            set_if(&mut doc.name, p.name);
            set_if(&mut doc.actions, p.actions);
            doc.version = event.envelope.version;
        }),
        API_KEY_REVOKED => {
            let mut doc: ApiKeyDoc = from_doc(event, current)?;
            doc.revoked = true;
            doc.version = event.envelope.version;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}
