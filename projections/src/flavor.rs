//! Flavors (`flavor/flv_…`): the document, the payloads of `flavor.*`, and their fold.
//!
//! A flavor is the shape an instance of it gets in its pool. It is made once and deleted once:
//! made twice, or deleted when it does not exist, is a broken log, not a no-op. Its name and
//! shape change in place (`flavor.updated`): instances made before keep what they were given.
//! Its pool never changes.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, create_once, delete_once, set_if, update};

pub const FLAVOR_CREATED: &str = "flavor.created";
pub const FLAVOR_DELETED: &str = "flavor.deleted";
pub const FLAVOR_UPDATED: &str = "flavor.updated";

/// A flavor of a pool (`flavor/flv_…`): the shape instances of it get.
pub const KIND_FLAVOR: &str = "flavor";

/// A flavor: what an instance of it in its pool is given. Deleting it removes the document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FlavorDoc {
    pub tenant_id: String,
    pub flavor_id: String,
    pub pool_id: String,
    pub name: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    pub gpus: u32,
    pub version: u64,
    pub created_at_ms: u64,
}

/// A flavor of one pool: what an instance of it is given. Guarded on the pool's version, so a
/// flavor is never created in a pool archived meanwhile.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorCreated {
    pub pool_id: String,
    pub name: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    pub gpus: u32,
}

pub type FlavorDeleted = NoFields;

/// A flavor's name or shape changed in place (what is absent is unchanged). Instances made
/// before keep their shape; instances and sandboxes made after get this one.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorUpdated {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    #[serde(default, rename = "diskGiB", skip_serializing_if = "Option::is_none")]
    pub disk_gib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
}

/// Folds one `flavor.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match event.envelope.event_type.as_str() {
        FLAVOR_CREATED => create_once(key, &current, event, ("flavor", "created"), |p: FlavorCreated, env| FlavorDoc {
            tenant_id: env.tenant.to_string(),
            flavor_id: key.id.clone(),
            pool_id: p.pool_id,
            name: p.name,
            vcpus: p.vcpus,
            memory_mib: p.memory_mib,
            disk_gib: p.disk_gib,
            gpus: p.gpus,
            version: env.version,
            created_at_ms: env.at_ms,
        }),
        FLAVOR_UPDATED => update(event, current, |doc: &mut FlavorDoc, p: FlavorUpdated| {
            set_if(&mut doc.name, p.name);
            set_if(&mut doc.vcpus, p.vcpus);
            set_if(&mut doc.memory_mib, p.memory_mib);
            set_if(&mut doc.disk_gib, p.disk_gib);
            set_if(&mut doc.gpus, p.gpus);
            doc.version = event.envelope.version;
        }),
        FLAVOR_DELETED => delete_once(key, current, event),
        _ => Ok(current),
    }
}
