//! Quotas (`quota/pool_…`, one per tenant and pool): the document, the payloads of `quota.*`,
//! and their fold.
//!
//! A quota bounds the GPUs a tenant's live reservations in one pool hold at once and, when set,
//! its instances, vCPUs, memory and sandboxes there (`decide::quota`). Its stream is the guard
//! of those bounds: every reservation counted against it (`quota.charged`), every instance or
//! sandbox counted against a resource limit (`quota.counted`) and every refusal
//! (`quota.exceeded` for GPUs, `quota.resource_exceeded` for the rest) moves the quota's
//! version, so two appends deciding on the same usage cannot both land.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{from_doc, payload, to_doc};

pub const QUOTA_SET: &str = "quota.set";
pub const QUOTA_EXCEEDED: &str = "quota.exceeded";
/// The record of a refusal past a resource limit (an instance, a resize's growth, a sandbox):
/// nothing else is appended, as `quota.exceeded` records a reservation's.
pub const QUOTA_RESOURCE_EXCEEDED: &str = "quota.resource_exceeded";
/// A reservation counted against its tenant's quota in a pool: in the reservation's own append,
/// guarded at the quota stream's version, so two gateways deciding on the same usage cannot both
/// land (one is a CONFLICT and decides again).
pub const QUOTA_CHARGED: &str = "quota.charged";
/// An instance (created or grown) or a sandbox (created or claimed) counted against its tenant's
/// resource limits in a pool: in the work's own append, guarded at the quota stream's version.
pub const QUOTA_COUNTED: &str = "quota.counted";

/// A tenant's quota in one pool; the stream is `quota/pool_…`.
pub const KIND_QUOTA: &str = "quota";
/// A reservation of this tenant held on another tenant's chain, in a pool that tenant offered
/// (`reservation_ref/rsv_…`, from its `quota.charged`): where the tenant's own reads find it.
pub const KIND_RESERVATION_REF: &str = "reservation_ref";

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct QuotaDoc {
    pub tenant_id: String,
    pub pool_id: String,
    pub gpus: u32,
    /// Live instances the tenant may hold in the pool (absent: unbounded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instances: Option<u32>,
    /// vCPUs of its live instances and claimed or cold sandboxes in the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// Memory (MiB) of the same.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "memoryMiB")]
    pub memory_mib: Option<u64>,
    /// Live sandboxes (claimed or cold: a template's warm ones count once claimed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u32>,
    pub version: u64,
    pub updated_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaSet {
    /// GPUs the tenant's live (queued and active) reservations in the pool may hold at once.
    pub gpus: u32,
    /// The other resources' limits ([`QuotaDoc`]'s); absent (as in every `quota.set` before
    /// them): unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instances: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "memoryMiB")]
    pub memory_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u32>,
}

impl QuotaDoc {
    /// Its limits, as a `quota.set` states them.
    pub fn limits(&self) -> QuotaSet {
        QuotaSet {
            gpus: self.gpus,
            instances: self.instances,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            sandboxes: self.sandboxes,
        }
    }
}

/// `quota.counted`: what an instance's or a sandbox's append adds to the tenant's use in the
/// pool (`subject`: its `inst_…` or `sbx_…`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaCounted {
    pub subject: String,
    #[serde(default)]
    pub instances: u32,
    #[serde(default)]
    pub vcpus: u64,
    #[serde(default, rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(default)]
    pub sandboxes: u32,
}

/// `quota.resource_exceeded`: which limit the work would have passed, by how much it asked, the
/// tenant's use then, the limit, the work (`subject`: the `inst_…` or `sbx_…` it would have
/// been) and who asked.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaResourceExceeded {
    /// `instances`, `vcpus`, `memoryMiB` or `sandboxes` (`quotas.set`'s names).
    pub resource: String,
    pub requested: u64,
    pub in_use: u64,
    pub limit: u64,
    pub subject: String,
    pub actor: String,
}

/// `quota.charged`: the reservation and the GPUs it counts for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaCharged {
    pub reservation_id: String,
    pub gpus: u32,
    /// The pool's owner, for a reservation in a pool another tenant offered: the reservation
    /// lives on the owner's chain (absent: on this tenant's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_tenant_id: Option<String>,
}

/// Where a reservation held on the pool owner's chain is (`reservation_ref/rsv_…`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReservationRefDoc {
    pub reservation_id: String,
    pub pool_id: String,
    pub owner_tenant_id: String,
}

/// The audit record of a refusal: nothing else is appended.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct QuotaExceeded {
    pub requested: u32,
    pub in_use: u32,
    pub limit: u32,
    pub actor: String,
}

/// The row beside the quota's a charge for a reservation on another chain writes.
pub(crate) fn touches(event: &StoredEvent, out: &mut Vec<RowKey>) {
    if event.envelope.event_type != QUOTA_CHARGED {
        return;
    }
    if let Ok(QuotaCharged { reservation_id, owner_tenant_id: Some(_), .. }) = payload::<QuotaCharged>(event) {
        out.push(RowKey { tenant: event.envelope.tenant.to_string(), kind: KIND_RESERVATION_REF.into(), id: reservation_id });
    }
}

/// Folds one `quota.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if key.kind == KIND_RESERVATION_REF {
        if env.event_type != QUOTA_CHARGED {
            return Ok(current);
        }
        let p: QuotaCharged = payload(event)?;
        let pool_id = crate::stream_id_of(&env.stream).to_owned();
        let owner_tenant_id = p.owner_tenant_id.unwrap_or_default();
        return to_doc(&ReservationRefDoc { reservation_id: p.reservation_id, pool_id, owner_tenant_id });
    }
    let tenant_id = env.tenant.to_string();
    match env.event_type.as_str() {
        QUOTA_EXCEEDED | QUOTA_RESOURCE_EXCEEDED | QUOTA_CHARGED | QUOTA_COUNTED => {
            // The quota's version follows its stream, which these move: a reservation's
            // append guards it.
            let Some(current) = current else { return Ok(None) };
            let mut doc: QuotaDoc = from_doc(event, Some(current))?;
            doc.version = env.version;
            to_doc(&doc)
        }
        QUOTA_SET => {
            let p: QuotaSet = payload(event)?;
            to_doc(&QuotaDoc {
                tenant_id,
                pool_id: key.id.clone(),
                gpus: p.gpus,
                instances: p.instances,
                vcpus: p.vcpus,
                memory_mib: p.memory_mib,
                sandboxes: p.sandboxes,
                version: env.version,
                updated_at_ms: env.at_ms,
            })
        }
        _ => Ok(current),
    }
}
