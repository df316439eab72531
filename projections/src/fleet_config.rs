//! The fleet's applied configuration (`fleet/default`, one per tenant): the document, the
//! payloads of `fleet.*`, and their fold.
//!
//! `fleet apply` appends, in the one transaction that makes a reviewed plan's changes,
//! `fleet.applied` (the plan's hash and what it changed) and `fleet.objects` (which id each key of
//! the document names, and a fingerprint of what the document said of it), so the log shows which
//! reviewed plan made each change, the next plan knows which objects the fleet made, and the
//! `fleet.drift` reconciler can tell an object changed outside the document. The drift it finds
//! is `fleet.drifted` (and `fleet.drifted` with no objects when it is gone again).

use std::collections::BTreeMap;

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{from_doc, payload, to_doc};

pub const FLEET_APPLIED: &str = "fleet.applied";
pub const FLEET_OBJECTS: &str = "fleet.objects";
pub const FLEET_DRIFTED: &str = "fleet.drifted";

/// A tenant's fleet configuration (`fleet/default`).
pub const KIND_FLEET: &str = "fleet";
/// The one fleet configuration stream's id in each tenant.
pub const FLEET_STREAM_ID: &str = "default";

/// Objects one `fleet.objects` event names at most, so the payload stays far under the log's
/// 64 KiB (an entry is about 150 bytes).
pub const FLEET_OBJECTS_PER_EVENT: usize = 200;
/// Drifted objects one `fleet.drifted` event names at most; more are counted, not named.
pub const FLEET_DRIFT_NAMED_MAX: usize = 200;

/// One object the applied document covers: its kind (`pool`, `quota`, `offer`, `flavor`, `image`), its
/// key in the document, the id it names, and the SHA-256 of what the document said of it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetObject {
    pub kind: String,
    pub key: String,
    pub id: String,
    pub fingerprint: String,
}

/// `fleet.applied`: a reviewed plan applied; its `fleet.objects` follow in the same transaction.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetApplied {
    /// The plan's hash, as `fleet plan` printed it and `fleet apply --plan-hash` named it.
    pub plan_hash: String,
    /// SHA-256 of the applied document in canonical JSON.
    pub document_sha256: String,
    pub created: u32,
    pub updated: u32,
    pub deleted: u32,
    /// Objects the document covers (the `fleet.objects` that follow name them all).
    pub objects: u32,
}

/// `fleet.objects`: part of the applied document's objects (at most [`FLEET_OBJECTS_PER_EVENT`]).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetObjects {
    pub objects: Vec<FleetObject>,
}

/// One object changed outside the applied document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetDrift {
    pub kind: String,
    pub key: String,
    pub id: String,
    /// `changed` or `deleted`.
    pub what: String,
}

/// `fleet.drifted`: the drift the `fleet.drift` reconciler sees now (empty: none any more).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FleetDrifted {
    /// The drifted objects, at most [`FLEET_DRIFT_NAMED_MAX`].
    pub objects: Vec<FleetDrift>,
    /// How many objects drifted in all.
    pub count: u32,
}

/// Where an object stands in the applied document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FleetObjectState {
    pub id: String,
    pub fingerprint: String,
}

/// The fleet configuration's document: the last applied plan and what it covers.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FleetConfigDoc {
    pub tenant_id: String,
    pub plan_hash: String,
    pub document_sha256: String,
    pub applied_at_ms: u64,
    pub applies: u64,
    /// `kind/key` → the id and fingerprint.
    pub objects: BTreeMap<String, FleetObjectState>,
    /// The drift last recorded (empty: none).
    #[serde(default)]
    pub drift: Vec<FleetDrift>,
    #[serde(default)]
    pub drift_count: u32,
    #[serde(default)]
    pub drift_at_ms: Option<u64>,
    pub version: u64,
}

impl FleetConfigDoc {
    /// The id the fleet made for `key` of `kind`, if it made one.
    pub fn id_of(&self, kind: &str, key: &str) -> Option<&str> {
        self.objects.get(&object_key(kind, key)).map(|o| o.id.as_str())
    }
}

/// The key of an object in [`FleetConfigDoc::objects`].
pub fn object_key(kind: &str, key: &str) -> String {
    format!("{kind}/{key}")
}

/// Folds one `fleet.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(_key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        FLEET_APPLIED => {
            let p: FleetApplied = payload(event)?;
            let applies = match current {
                Some(current) => from_doc::<FleetConfigDoc>(event, Some(current))?.applies,
                None => 0,
            };
            to_doc(&FleetConfigDoc {
                tenant_id: env.tenant.to_string(),
                plan_hash: p.plan_hash,
                document_sha256: p.document_sha256,
                applied_at_ms: env.at_ms,
                applies: applies + 1,
                objects: BTreeMap::new(),
                drift: Vec::new(),
                drift_count: 0,
                drift_at_ms: None,
                version: env.version,
            })
        }
        FLEET_OBJECTS => {
            let p: FleetObjects = payload(event)?;
            let mut doc: FleetConfigDoc = from_doc(event, current)?;
            for o in p.objects {
                doc.objects.insert(object_key(&o.kind, &o.key), FleetObjectState { id: o.id, fingerprint: o.fingerprint });
            }
            doc.version = env.version;
            to_doc(&doc)
        }
        FLEET_DRIFTED => {
            let p: FleetDrifted = payload(event)?;
            let mut doc: FleetConfigDoc = from_doc(event, current)?;
            doc.drift = p.objects;
            doc.drift_count = p.count;
            doc.drift_at_ms = Some(env.at_ms);
            doc.version = env.version;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}

/// SHA-256 in lowercase hex of `value` in canonical JSON: keys sorted (serde_json's maps are
/// ordered), no insignificant whitespace, integers only. What plans hash and fingerprints are.
pub fn canonical_sha256<T: Serialize>(value: &T) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(canonical_json(value)))
}

/// `value` as canonical JSON bytes.
pub fn canonical_json<T: Serialize>(value: &T) -> Vec<u8> {
    // Through `Value`, whose maps are sorted by key, so struct fields come out sorted too.
    let value = serde_json::to_value(value).expect("a fleet document's values are JSON");
    serde_json::to_vec(&value).expect("a JSON value serializes")
}

/// A pool's fingerprint: what a FleetConfig document says of it, every field stated.
pub fn pool_fingerprint(name: &str, description: &str, labels: &BTreeMap<String, String>, max_reservation_s: u64) -> String {
    canonical_sha256(&serde_json::json!({
        "name": name, "description": description, "labels": labels, "maxReservationS": max_reservation_s,
    }))
}

/// A pool's offers (`offeredTo`, when the document states them): the tenants, in order.
pub fn offer_fingerprint(offered_to: &std::collections::BTreeSet<String>) -> String {
    canonical_sha256(&serde_json::json!({ "offeredTo": offered_to }))
}

/// The tenant's quota in a pool: its GPUs and the resource limits it states (a quota of GPUs
/// alone has the fingerprint it had before resource limits).
pub fn quota_fingerprint(limits: &crate::quota::QuotaSet) -> String {
    canonical_sha256(&serde_json::to_value(limits).expect("a quota is JSON"))
}

/// A flavor's fingerprint: its name and shape (its pool is its identity's, not a field).
pub fn flavor_fingerprint(name: &str, vcpus: u32, memory_mib: u64, disk_gib: u64, gpus: u32) -> String {
    canonical_sha256(&serde_json::json!({
        "name": name, "vcpus": vcpus, "memoryMiB": memory_mib, "diskGiB": disk_gib, "gpus": gpus,
    }))
}

/// An image's fingerprint: its name, where it is fetched from, its digest, format and size.
pub fn image_fingerprint(
    name: &str,
    url: &str,
    sha256: &str,
    disk_format: crate::image::DiskFormat,
    size_bytes: Option<u64>,
) -> String {
    canonical_sha256(&serde_json::json!({
        "name": name, "url": url, "sha256": sha256, "diskFormat": disk_format, "sizeBytes": size_bytes,
    }))
}

/// A site's fingerprint: its name, region and labels.
pub fn site_fingerprint(name: &str, region: &str, labels: &BTreeMap<String, String>) -> String {
    canonical_sha256(&serde_json::json!({ "name": name, "region": region, "labels": labels }))
}

/// A project's fingerprint: its name and description.
pub fn project_fingerprint(name: &str, description: &str) -> String {
    canonical_sha256(&serde_json::json!({ "name": name, "description": description }))
}

/// A webhook's fingerprint: its endpoint, event types and description, and the reference to its
/// signing secret when the document names one (`secretRef`, canonical). A document may leave
/// the secret alone (a generated one is never in a document): then the secret is not in it, and
/// neither is it in a fingerprint recorded before references were.
pub fn webhook_fingerprint(url: &str, event_types: &[String], description: &str, secret_ref: Option<&str>) -> String {
    let mut fields = serde_json::json!({ "url": url, "eventTypes": event_types, "description": description });
    if let Some(reference) = secret_ref {
        fields["secretRef"] = serde_json::json!(reference);
    }
    canonical_sha256(&fields)
}

/// The live objects a drift check reads: the tenant's pools, quotas (by pool id), flavors,
/// images, sites, projects and webhooks.
pub struct FleetObjectsLive<'a> {
    pub pools: &'a [crate::PoolDoc],
    pub quotas: &'a BTreeMap<String, crate::QuotaDoc>,
    pub flavors: &'a [crate::FlavorDoc],
    pub images: &'a [crate::ImageDoc],
    pub sites: &'a [crate::site::SiteDoc],
    pub projects: &'a [crate::project::ProjectDoc],
    pub webhooks: &'a [crate::WebhookDoc],
}

/// The objects the applied document covers that changed outside it since: each one whose live
/// fingerprint is not the one recorded at apply (`changed`), or that is gone (`deleted`, an
/// archived pool too). Sorted; empty when nothing drifted. Pure.
pub fn fleet_drift(applied: &FleetConfigDoc, live: &FleetObjectsLive<'_>) -> Vec<FleetDrift> {
    let mut drift = Vec::new();
    for (kind_key, recorded) in &applied.objects {
        let Some((kind, key)) = kind_key.split_once('/') else { continue };
        let id = recorded.id.as_str();
        let now: Option<String> = match kind {
            "pool" => live
                .pools
                .iter()
                .find(|p| p.pool_id == id && !p.archived)
                .map(|p| pool_fingerprint(&p.name, &p.description, &p.labels, p.max_reservation_s)),
            "quota" => live.quotas.get(id).map(|q| quota_fingerprint(&q.limits())),
            // A pool's offers: changed by `pools.offer`/`unoffer` outside the document, or gone
            // with the pool.
            "offer" => live.pools.iter().find(|p| p.pool_id == id && !p.archived).map(|p| offer_fingerprint(&p.offered_to)),
            "flavor" => live
                .flavors
                .iter()
                .find(|f| f.flavor_id == id)
                .map(|f| flavor_fingerprint(&f.name, f.vcpus, f.memory_mib, f.disk_gib, f.gpus)),
            "image" => live
                .images
                .iter()
                .find(|i| i.image_id == id)
                .map(|i| image_fingerprint(&i.name, &i.url, &i.sha256, i.disk_format, i.size_bytes)),
            "site" => live.sites.iter().find(|s| s.site_id == id).map(|s| site_fingerprint(&s.name, &s.region, &s.labels)),
            // An archived project is gone from the fleet, as an archived pool is.
            "project" => live
                .projects
                .iter()
                .find(|p| p.project_id == id && !p.archived)
                .map(|p| project_fingerprint(&p.name, &p.description)),
            // The secret is the document's only when it named it: recorded without one, a
            // reference made or changed by hand is not drift; recorded with one, another
            // reference or a generated secret is.
            "webhook" => live.webhooks.iter().find(|w| w.webhook_id == id).map(|w| {
                let bare = webhook_fingerprint(&w.url, &w.event_types, &w.description, None);
                match w.secret_ref.as_deref() {
                    Some(reference) if bare != recorded.fingerprint => {
                        webhook_fingerprint(&w.url, &w.event_types, &w.description, Some(reference))
                    }
                    _ => bare,
                }
            }),
            _ => continue,
        };
        let what = match now {
            None => "deleted",
            Some(now) if now != recorded.fingerprint => "changed",
            Some(_) => continue,
        };
        drift.push(FleetDrift { kind: kind.to_owned(), key: key.to_owned(), id: id.to_owned(), what: what.to_owned() });
    }
    drift.sort();
    drift
}

/// The `fleet.drifted` that records `drift`, or `None` when the document already records it.
pub fn drift_change(applied: &FleetConfigDoc, drift: &[FleetDrift]) -> Option<FleetDrifted> {
    let named: Vec<FleetDrift> = drift.iter().take(FLEET_DRIFT_NAMED_MAX).cloned().collect();
    let count = drift.len() as u32;
    (named != applied.drift || count != applied.drift_count).then_some(FleetDrifted { objects: named, count })
}
