//! Pools (`pool/pool_…`): the document, the payloads of `pool.*`, and their fold.
//!
//! A pool groups nodes and queues the reservations asked of it. It can be renamed, relabelled
//! and given another longest reservation ([`MAX_RESERVATION_S_DEFAULT`] unless it says), and
//! archived once; an archived pool's document stays.

use std::collections::BTreeMap;

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, create, from_doc, set_if, to_doc, update};

pub const POOL_CREATED: &str = "pool.created";
pub const POOL_UPDATED: &str = "pool.updated";
pub const POOL_ARCHIVED: &str = "pool.archived";

/// A pool's document; also its stream's prefix (`pool/pool_…`).
pub const KIND_POOL: &str = "pool";
/// The longest reservation a pool grants unless it says otherwise: 30 days.
pub const MAX_RESERVATION_S_DEFAULT: u64 = 30 * 24 * 3600;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolDoc {
    pub tenant_id: String,
    pub pool_id: String,
    pub name: String,
    pub description: String,
    pub labels: std::collections::BTreeMap<String, String>,
    #[serde(default = "max_reservation_default")]
    pub max_reservation_s: u64,
    pub archived: bool,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

fn max_reservation_default() -> u64 {
    MAX_RESERVATION_S_DEFAULT
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolCreated {
    pub name: String,
    pub description: String,
    pub labels: BTreeMap<String, String>,
    /// The longest reservation the pool grants, in seconds (absent: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_reservation_s: Option<u64>,
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_reservation_s: Option<u64>,
}

pub type PoolArchived = NoFields;

/// Folds one `pool.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        POOL_CREATED => create(event, |p: PoolCreated, env| PoolDoc {
            tenant_id: env.tenant.to_string(),
            pool_id: key.id.clone(),
            name: p.name,
            description: p.description,
            labels: p.labels,
            max_reservation_s: p.max_reservation_s.unwrap_or(MAX_RESERVATION_S_DEFAULT),
            archived: false,
            version: env.version,
            created_at_ms: env.at_ms,
            updated_at_ms: env.at_ms,
        }),
        POOL_UPDATED => update(event, current, |doc: &mut PoolDoc, p: PoolUpdated| {
            set_if(&mut doc.name, p.name);
            set_if(&mut doc.description, p.description);
            set_if(&mut doc.labels, p.labels);
            set_if(&mut doc.max_reservation_s, p.max_reservation_s);
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
        }),
        POOL_ARCHIVED => {
            let mut doc: PoolDoc = from_doc(event, current)?;
            doc.archived = true;
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}
