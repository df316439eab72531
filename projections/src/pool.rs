//! Pools (`pool/pool_…`): the document, the payloads of `pool.*`, and their fold.
//!
//! A pool groups nodes and queues the reservations asked of it. It can be renamed, relabelled
//! and given another longest reservation ([`MAX_RESERVATION_S_DEFAULT`] unless it says), and
//! archived once; an archived pool's document stays.
//!
//! Its owner may **offer** it to other tenants (`pool.offered` / `pool.unoffered` on its stream,
//! `offeredTo` in its document). Each offered tenant's chain carries the same event on
//! `pool_offer/pool_…` (with `ownerTenantId`), whose row ([`PoolOfferDoc`]) is how that tenant
//! finds the pool: it may then reserve from it under its own quota (`quota/pool_…` on its own
//! chain), its reservations living on the owner's chain beside the owner's, so the nodes' stream
//! versions decide the capacity they share.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, create, from_doc, payload, set_if, to_doc, update};

pub const POOL_CREATED: &str = "pool.created";
pub const POOL_UPDATED: &str = "pool.updated";
pub const POOL_ARCHIVED: &str = "pool.archived";
/// Tenants the pool is offered to: on the pool's stream, and on each such tenant's
/// `pool_offer/pool_…` (with the owner).
pub const POOL_OFFERED: &str = "pool.offered";
/// Tenants the pool is no longer offered to, on the same streams as [`POOL_OFFERED`].
pub const POOL_UNOFFERED: &str = "pool.unoffered";
/// The row of a pool another tenant offered to this one (`pool_offer/pool_…`, on the offered
/// tenant's chain).
pub const KIND_POOL_OFFER: &str = "pool_offer";

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
    /// The site it was made at (`pool.created`'s `siteId`); it never moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site_id: Option<String>,
    /// Tenants the pool is offered to (`pools.offer`).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub offered_to: BTreeSet<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

/// A pool offered to this tenant by its owner: the row `pool_offer/pool_…` on the offered
/// tenant's chain, `offered` false once unoffered.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolOfferDoc {
    /// The offered tenant (whose chain holds the row).
    pub tenant_id: String,
    pub pool_id: String,
    pub owner_tenant_id: String,
    pub offered: bool,
    pub version: u64,
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
    /// The site the pool's machines are at (`site_…` of the tenant), fixed for the pool's life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site_id: Option<String>,
}

impl PoolCreated {
    /// A pool of `name` with nothing else given: no description, labels, longest reservation
    /// or site (what tests, benches and the simulator make; the API's create names the rest).
    pub fn named(name: impl Into<String>) -> Self {
        PoolCreated {
            name: name.into(),
            description: String::new(),
            labels: BTreeMap::new(),
            max_reservation_s: None,
            site_id: None,
        }
    }
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

/// `pool.offered` / `pool.unoffered`: the tenants offered (or no longer); on an offered tenant's
/// `pool_offer/pool_…`, that tenant alone and the pool's owner.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolOffers {
    pub tenant_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_tenant_id: Option<String>,
}

/// Folds one `pool.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if key.kind == KIND_POOL_OFFER {
        return apply_offer(key, current, event);
    }
    match env.event_type.as_str() {
        POOL_CREATED => create(event, |p: PoolCreated, env| PoolDoc {
            tenant_id: env.tenant.to_string(),
            pool_id: key.id.clone(),
            name: p.name,
            description: p.description,
            labels: p.labels,
            max_reservation_s: p.max_reservation_s.unwrap_or(MAX_RESERVATION_S_DEFAULT),
            archived: false,
            site_id: p.site_id,
            offered_to: BTreeSet::new(),
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
        POOL_OFFERED | POOL_UNOFFERED => {
            let p: PoolOffers = payload(event)?;
            let mut doc: PoolDoc = from_doc(event, current)?;
            if env.event_type == POOL_OFFERED {
                doc.offered_to.extend(p.tenant_ids);
            } else {
                for t in &p.tenant_ids {
                    doc.offered_to.remove(t);
                }
            }
            doc.version = env.version;
            doc.updated_at_ms = env.at_ms;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}

/// An offered tenant's row of the pool: offered, or no longer.
fn apply_offer(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let offered = match env.event_type.as_str() {
        POOL_OFFERED => true,
        POOL_UNOFFERED => false,
        _ => return Ok(current),
    };
    let p: PoolOffers = payload(event)?;
    let owner_tenant_id = p.owner_tenant_id.unwrap_or_default();
    to_doc(&PoolOfferDoc {
        tenant_id: env.tenant.to_string(),
        pool_id: key.id.clone(),
        owner_tenant_id,
        offered,
        version: env.version,
        updated_at_ms: env.at_ms,
    })
}
