//! Sites (`site/site_…`): the document, the payloads of `site.*`, and their fold.
//!
//! A site is where machines are: a name unique in its tenant, a region and labels. Pools may
//! name their site when they are made (`pool.created`'s `siteId`), and cannot move to another
//! (a pool's nodes are where they are). The name and labels change in place; the region does
//! not (a site in another region is another site). A site that anything names is not deleted
//! ([`crate::decide::site::site_delete`]).

use std::collections::BTreeMap;

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, create_once, delete_once, set_if, update};

pub const SITE_CREATED: &str = "site.created";
pub const SITE_UPDATED: &str = "site.updated";
pub const SITE_DELETED: &str = "site.deleted";

/// A site's document; also its stream's prefix (`site/site_…`).
pub const KIND_SITE: &str = "site";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SiteDoc {
    pub tenant_id: String,
    pub site_id: String,
    pub name: String,
    pub region: String,
    pub labels: BTreeMap<String, String>,
    /// The stream's version, for `ifVersion`.
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SiteCreated {
    pub name: String,
    pub region: String,
    pub labels: BTreeMap<String, String>,
}

/// What changed (absent: unchanged); never the region.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SiteUpdated {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
}

pub type SiteDeleted = NoFields;

/// Folds one `site.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        SITE_CREATED => create_once(key, &current, event, ("site", "created"), |p: SiteCreated, env| SiteDoc {
            tenant_id: env.tenant.to_string(),
            site_id: key.id.clone(),
            name: p.name,
            region: p.region,
            labels: p.labels,
            version: env.version,
            created_at_ms: env.at_ms,
            updated_at_ms: env.at_ms,
        }),
        SITE_UPDATED => update(event, current, |doc: &mut SiteDoc, p: SiteUpdated| {
            set_if(&mut doc.name, p.name);
            set_if(&mut doc.labels, p.labels);
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
        }),
        SITE_DELETED => delete_once(key, current, event),
        _ => Ok(current),
    }
}
