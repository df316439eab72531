//! Event types and their payloads: the log's wire format (STYLE rule 5: separate from the HTTP
//! JSON and from the documents). The catalogue in `schema/EVENTS.md` lists the same types.
//! Field names are camelCase CBOR text keys; numbers are unsigned integers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const TENANT_CREATED: &str = "tenant.created";
pub const API_KEY_CREATED: &str = "api_key.created";
pub const API_KEY_REVOKED: &str = "api_key.revoked";
pub const POOL_CREATED: &str = "pool.created";
pub const POOL_UPDATED: &str = "pool.updated";
pub const POOL_ARCHIVED: &str = "pool.archived";
pub const NODE_REGISTERED: &str = "node.registered";

/// Every event type this version writes.
pub const EVENT_TYPES: &[&str] = &[
    TENANT_CREATED,
    API_KEY_CREATED,
    API_KEY_REVOKED,
    POOL_CREATED,
    POOL_UPDATED,
    POOL_ARCHIVED,
    NODE_REGISTERED,
    bc_core::audit::CHECKPOINT_SEALED,
    bc_core::audit::LOG_KEY_ROTATED,
];

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
    /// Hex SHA-256 of the secret part of the token.
    pub secret_sha256: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeyRevoked {}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolCreated {
    pub name: String,
    pub description: String,
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolUpdated {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolArchived {}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeRegistered {
    pub pool_id: String,
    pub name: String,
    pub gpus: Vec<Gpu>,
    pub labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpu {
    /// `H100`, `A100`, …
    pub model: String,
    /// `H100-SXM5-80GB`, …
    pub product: String,
    #[serde(rename = "vramGiB")]
    pub vram_gib: u32,
    /// GPUs with the same domain on one node share NVLink.
    pub nvlink_domain: u32,
}

/// A payload as CBOR, ready for an append.
pub fn to_cbor<T: Serialize>(payload: &T) -> bc_core::Result<ciborium::Value> {
    let json = serde_json::to_value(payload).map_err(|e| bc_core::Error::Internal(format!("payload: {e}")))?;
    bc_core::canonical::from_json(&json)
}
