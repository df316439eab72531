//! The fleet configuration's decisions: a [`FleetDocument`] against the live fleet ([`FleetLive`])
//! gives a [`FleetPlan`] (what `+`/`~`/`-` apply would make, what is `BLOCKED`, the versions read,
//! and the plan's hash); the live fleet alone gives the document `fleet export` writes; the live
//! fleet against the last applied document gives the drift.
//!
//! Pure: no IO, no clock, no ids. The gateway reads the live fleet, decides here, draws the ids
//! of what a plan creates, and appends (`crate::api::fleet`). The document is the wire format
//! (its JSON Schema is the API's), which is why these decisions live beside it in the gateway and
//! not in `bc_projections::decide`.
//!
//! **Identity.** A document keys each object. A key that is an id (`pool_…`, `flv_…`, `img_…`)
//! names that object: objects the fleet did not create are exported so. Any other key (`gpu-a`)
//! is the fleet's own: the first apply creates the object and records which id the key names
//! (`fleet.objects`), and later plans find it by the key. Renaming an object (its `name`) in the
//! document keeps it, since its key is unchanged.
//!
//! **The hash.** SHA-256 over the canonical document, the prune flag, every version (or quota)
//! the plan read, and the plan's changes: the same plan over the same fleet always has the same
//! hash, and any change to what it read changes it, which is how `apply` finds `CONFIG_DRIFT`.

use std::collections::{BTreeMap, BTreeSet};

use bc_projections::decide::project::PROJECTS_PER_TENANT_MAX;
use bc_projections::decide::site::SITES_PER_TENANT_MAX;
use bc_projections::fleet_config::{
    FleetConfigDoc, FleetDrift, FleetObject, FleetObjectsLive, flavor_fingerprint, image_fingerprint, offer_fingerprint,
    pool_fingerprint, project_fingerprint, quota_fingerprint, site_fingerprint, webhook_fingerprint,
};
pub use bc_projections::fleet_config::{canonical_json, canonical_sha256};
use bc_projections::project::{KIND_PROJECT, ProjectDoc};
use bc_projections::site::{KIND_SITE, SiteDoc};
use bc_projections::{FlavorDoc, ImageDoc, KIND_FLAVOR, KIND_IMAGE, KIND_POOL, KIND_QUOTA, PoolDoc, QuotaDoc};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::flavors::{FLAVORS_PER_POOL_MAX, FLAVORS_PER_TENANT_MAX};
use crate::api::fleet::{FleetDocument, FleetFlavor, FleetImage, FleetPool, FleetProject, FleetSite, FleetWebhook};
use crate::api::images::IMAGES_PER_TENANT_MAX;
use crate::api::views::ImageChannelView;
use crate::api::webhooks::WEBHOOKS_PER_TENANT_MAX;
use bc_projections::events::ImageChannel;

/// `fleet/default`'s kind name for the document's object kinds.
pub const OBJECT_POOL: &str = "pool";
pub const OBJECT_QUOTA: &str = "quota";
pub const OBJECT_FLAVOR: &str = "flavor";
pub const OBJECT_IMAGE: &str = "image";
/// A pool's offers to other tenants (`pools.offer` / `pools.unoffer`), keyed by the pool's key.
pub const OBJECT_OFFER: &str = "offer";
pub const OBJECT_SITE: &str = "site";
pub const OBJECT_PROJECT: &str = "project";
pub const OBJECT_WEBHOOK: &str = "webhook";

/// A signing secret a webhook of the document names (`secret://TENANT/sec_…`), as read: the
/// secret's id and stream version, and whether its value is a webhook signing secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretRead {
    pub secret_id: String,
    pub version: u64,
    pub signs: bool,
}

/// The live fleet a plan is made against: the tenant's pools (archived too), quotas, flavors,
/// images, sites and projects (archived too), and the last applied configuration.
#[derive(Clone, Debug, Default)]
pub struct FleetLive {
    pub pools: Vec<PoolDoc>,
    /// By pool id.
    pub quotas: BTreeMap<String, QuotaDoc>,
    pub flavors: Vec<FlavorDoc>,
    pub images: Vec<ImageDoc>,
    pub sites: Vec<SiteDoc>,
    /// `(node id, site id)` of each bare-metal machine not retired that names a site
    /// (`decide::site::machine_holds_site`): they hold their sites against a prune.
    pub site_machines: Vec<(String, String)>,
    pub projects: Vec<ProjectDoc>,
    pub webhooks: Vec<bc_projections::WebhookDoc>,
    /// The secrets the document's webhooks name, by reference (canonical), as read: absent, a
    /// reference names no secret of the tenant.
    pub webhook_secrets: BTreeMap<String, SecretRead>,
    pub applied: Option<FleetConfigDoc>,
}

/// What a change does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Create,
    Update,
    Delete,
}

impl Op {
    /// `+`, `~` or `-`, as `fleet plan` prints it.
    pub fn sign(self) -> char {
        match self {
            Self::Create => '+',
            Self::Update => '~',
            Self::Delete => '-',
        }
    }
}

/// One field a change sets: what it was and what it becomes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FieldChange {
    pub from: Value,
    pub to: Value,
}

/// One change a plan makes: one API call's worth, one append.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Change {
    pub op: Op,
    /// `site`, `pool`, `quota`, `offer`, `flavor`, `image` or `project`.
    pub kind: &'static str,
    /// The object's key in the document (for a delete, its id).
    pub key: String,
    /// The object's id; `None` for what a create makes (drawn when applied).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// The fields set: for a create every field, for an update the changed ones.
    pub fields: BTreeMap<String, FieldChange>,
    /// The version the change expects its object at (0: none yet; `None`: any, for a quota).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expects: Option<u64>,
}

impl Change {
    /// The API method that makes this change by itself, and the action it is decided on.
    pub fn call(&self) -> (&'static str, &'static str) {
        match (self.kind, self.op) {
            (OBJECT_POOL, Op::Create) => ("pools.create", "compute:pools:write"),
            (OBJECT_POOL, Op::Update) => ("pools.update", "compute:pools:write"),
            (OBJECT_POOL, Op::Delete) => ("pools.archive", "compute:pools:write"),
            (OBJECT_QUOTA, _) => ("quotas.set", "compute:quotas:admin"),
            // An offer change that withdraws a tenant (and perhaps adds others) is an update.
            (OBJECT_OFFER, Op::Create) => ("pools.offer", "compute:pools:admin"),
            (OBJECT_OFFER, _) => ("pools.unoffer", "compute:pools:admin"),
            (OBJECT_FLAVOR, Op::Delete) => ("flavors.delete", "compute:flavors:write"),
            (OBJECT_FLAVOR, Op::Update) => ("flavors.update", "compute:flavors:write"),
            (OBJECT_FLAVOR, _) => ("flavors.create", "compute:flavors:write"),
            (OBJECT_IMAGE, Op::Delete) => ("images.delete", "compute:images:write"),
            (OBJECT_IMAGE, Op::Update) => ("images.promote", "compute:images:write"),
            (OBJECT_SITE, Op::Create) => ("sites.create", "compute:sites:write"),
            (OBJECT_SITE, Op::Update) => ("sites.update", "compute:sites:write"),
            (OBJECT_SITE, Op::Delete) => ("sites.delete", "compute:sites:write"),
            (OBJECT_PROJECT, Op::Delete) => ("projects.archive", "compute:projects:write"),
            (OBJECT_PROJECT, _) => ("projects.create", "compute:projects:write"),
            (OBJECT_WEBHOOK, Op::Create) => ("webhooks.create", "compute:webhooks:write"),
            (OBJECT_WEBHOOK, Op::Update) => ("webhooks.update", "compute:webhooks:write"),
            (OBJECT_WEBHOOK, Op::Delete) => ("webhooks.delete", "compute:webhooks:write"),
            (_, _) => ("images.register", "compute:images:write"),
        }
    }
}

/// A change the plan cannot make in place; a plan with one applies nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Blocked {
    pub kind: &'static str,
    pub key: String,
    pub reason: String,
}

/// A live object the document does not hold, left alone (deleted only with `--prune`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Unmanaged {
    pub kind: &'static str,
    pub id: String,
    pub name: String,
}

/// A plan: the changes in the order apply makes them, what is blocked, what is left alone, what
/// was read, and the hash that names it all.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FleetPlan {
    pub changes: Vec<Change>,
    pub blocked: Vec<Blocked>,
    pub unmanaged: Vec<Unmanaged>,
    /// Each stream the plan read (`pool/pool_…`) and its version, or a quota's GPUs
    /// (`quota/pool_… gpus`): a quota's version moves with every reservation, its value does not.
    pub reads: BTreeMap<String, u64>,
    /// The fleet configuration stream's version the plan read (0: never applied).
    pub fleet_version: u64,
    /// What the document covers once applied: `(kind, key, id, fingerprint)`, the id `None`
    /// for what the plan creates.
    #[serde(skip)]
    pub objects: Vec<(&'static str, String, Option<String>, String)>,
    pub document_sha256: String,
    pub plan_hash: String,
}

/// A pool as the document holds it, every field stated: what its fingerprint covers.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
struct FleetPoolShape {
    name: String,
    description: String,
    labels: BTreeMap<String, String>,
    max_reservation_s: u64,
}

impl FleetPoolShape {
    fn fingerprint(&self) -> String {
        pool_fingerprint(&self.name, &self.description, &self.labels, self.max_reservation_s)
    }
}

/// A flavor's fields but its pool: what must not change in place.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
struct FlavorShape {
    name: String,
    vcpus: u32,
    #[serde(rename = "memoryMiB")]
    memory_mib: u64,
    #[serde(rename = "diskGiB")]
    disk_gib: u64,
    gpus: u32,
}

impl FlavorShape {
    fn of_doc(f: &FlavorDoc) -> Self {
        Self { name: f.name.clone(), vcpus: f.vcpus, memory_mib: f.memory_mib, disk_gib: f.disk_gib, gpus: f.gpus }
    }
    fn of_fleet(f: &FleetFlavor) -> Self {
        Self { name: f.name.clone(), vcpus: f.vcpus, memory_mib: f.memory_mib, disk_gib: f.disk_gib, gpus: f.gpus }
    }
    fn fingerprint(&self) -> String {
        flavor_fingerprint(&self.name, self.vcpus, self.memory_mib, self.disk_gib, self.gpus)
    }
}

fn image_of(i: &ImageDoc) -> FleetImage {
    FleetImage {
        name: i.name.clone(),
        url: i.url.clone(),
        sha256: i.sha256.clone(),
        disk_format: i.disk_format.into(),
        size_bytes: i.size_bytes,
        channel: Some(i.channel.into()),
    }
}

/// Whether two images are the same bytes under the same name: all but the channel, which
/// changes in place (a promotion).
fn same_image(a: &FleetImage, b: &FleetImage) -> bool {
    (&a.name, &a.url, &a.sha256, a.disk_format, a.size_bytes) == (&b.name, &b.url, &b.sha256, b.disk_format, b.size_bytes)
}

fn fleet_image_fingerprint(i: &FleetImage) -> String {
    image_fingerprint(&i.name, &i.url, &i.sha256, i.disk_format.into(), i.size_bytes)
}

/// The id `key` names for objects whose ids start with `prefix`: the key itself when it is one
/// (the document keys by id what the fleet did not create), else the id the fleet recorded for
/// it, else none (a new object).
fn resolve(applied: Option<&FleetConfigDoc>, kind: &str, prefix: &str, key: &str) -> Option<String> {
    if key.starts_with(prefix) && key.as_bytes().get(prefix.len()) == Some(&b'_') {
        return Some(key.to_owned());
    }
    applied.and_then(|a| a.id_of(kind, key)).map(str::to_owned)
}

fn is_id_key(prefix: &str, key: &str) -> bool {
    key.starts_with(prefix) && key.as_bytes().get(prefix.len()) == Some(&b'_')
}

fn field(from: Value, to: Value) -> FieldChange {
    FieldChange { from, to }
}

fn created_fields<T: Serialize>(value: &T) -> BTreeMap<String, FieldChange> {
    match serde_json::to_value(value).expect("a document's object is JSON") {
        Value::Object(map) => map.into_iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| (k, field(Value::Null, v))).collect(),
        _ => BTreeMap::new(),
    }
}

/// The plan that takes the live fleet to `doc`: pure, and the same for the same inputs.
pub fn fleet_plan(live: &FleetLive, doc: &FleetDocument, prune: bool) -> FleetPlan {
    let applied = live.applied.as_ref();
    let pools_by_id: BTreeMap<&str, &PoolDoc> = live.pools.iter().map(|p| (p.pool_id.as_str(), p)).collect();
    let flavors_by_id: BTreeMap<&str, &FlavorDoc> = live.flavors.iter().map(|f| (f.flavor_id.as_str(), f)).collect();
    let images_by_id: BTreeMap<&str, &ImageDoc> = live.images.iter().map(|i| (i.image_id.as_str(), i)).collect();
    let mut plan = FleetPlan {
        changes: Vec::new(),
        blocked: Vec::new(),
        unmanaged: Vec::new(),
        reads: BTreeMap::new(),
        fleet_version: applied.map_or(0, |a| a.version),
        objects: Vec::new(),
        document_sha256: canonical_sha256(doc),
        plan_hash: String::new(),
    };
    // Every live object is read: each can be compared, deleted or block a name.
    for p in &live.pools {
        plan.reads.insert(format!("{KIND_POOL}/{}", p.pool_id), p.version);
    }
    for (pool, q) in &live.quotas {
        plan.reads.insert(format!("{KIND_QUOTA}/{pool} gpus"), u64::from(q.gpus));
        // The resource limits it states (none: the reads of a quota of GPUs alone, as before).
        let limits = [
            ("instances", q.instances.map(u64::from)),
            ("vcpus", q.vcpus.map(u64::from)),
            ("memoryMiB", q.memory_mib),
            ("sandboxes", q.sandboxes.map(u64::from)),
        ];
        for (name, value) in limits {
            if let Some(v) = value {
                plan.reads.insert(format!("{KIND_QUOTA}/{pool} {name}"), v);
            }
        }
    }
    for f in &live.flavors {
        plan.reads.insert(format!("{KIND_FLAVOR}/{}", f.flavor_id), f.version);
    }
    for i in &live.images {
        plan.reads.insert(format!("{KIND_IMAGE}/{}", i.image_id), i.version);
    }
    for s in &live.sites {
        plan.reads.insert(format!("{KIND_SITE}/{}", s.site_id), s.version);
    }
    for p in &live.projects {
        plan.reads.insert(format!("{KIND_PROJECT}/{}", p.project_id), p.version);
    }
    for w in &live.webhooks {
        plan.reads.insert(format!("{}/{}", bc_projections::KIND_WEBHOOK, w.webhook_id), w.version);
    }
    // A secret a webhook names is read too: a delete or a put between plan and apply is drift.
    for s in live.webhook_secrets.values() {
        plan.reads.insert(format!("{}/{}", bc_projections::KIND_SECRET, s.secret_id), s.version);
    }

    // Sites first (pools name them): their name and labels change in place, their region never.
    let sites = plan_sites(live, doc, &mut plan);

    // Pools: the id each key names (None: created by this plan), and which keys are usable.
    let mut pool_ids: BTreeMap<&str, Option<String>> = BTreeMap::new();
    let mut pool_blocked: BTreeSet<&str> = BTreeSet::new();
    let mut pools_covered: BTreeSet<String> = BTreeSet::new();
    for (key, want) in &doc.pools {
        let id = resolve(applied, OBJECT_POOL, bc_core::id::PoolId::PREFIX, key);
        let live_pool = id.as_deref().and_then(|id| pools_by_id.get(id).copied());
        if let Some(id) = &id {
            pools_covered.insert(id.clone());
        }
        // Its site: `Some(Some(id))` a live site, `Some(None)` one this plan creates.
        let site: Option<Option<String>> = match &want.site {
            None => None,
            Some(site_key) => match sites.ids.get(site_key.as_str()) {
                Some(site_id) => Some(site_id.clone()),
                None => {
                    let reason = if sites.blocked.contains(site_key.as_str()) {
                        format!("its site {site_key:?} is blocked")
                    } else {
                        format!("dangling reference: site {site_key:?} is not in the document")
                    };
                    pool_blocked.insert(key);
                    plan.blocked.push(Blocked { kind: OBJECT_POOL, key: key.clone(), reason });
                    continue;
                }
            },
        };
        match (id, live_pool) {
            (Some(id), None) if is_id_key(bc_core::id::PoolId::PREFIX, key) => {
                pool_blocked.insert(key);
                plan.blocked.push(Blocked {
                    kind: OBJECT_POOL,
                    key: key.clone(),
                    reason: format!(
                        "{id} does not exist: a key that is an id names an existing pool; give a new pool a key of its own"
                    ),
                });
            }
            (_, Some(p)) if p.archived => {
                pool_blocked.insert(key);
                plan.blocked.push(Blocked {
                    kind: OBJECT_POOL,
                    key: key.clone(),
                    reason: format!("{} is archived and cannot be brought back; give a new pool a new key", p.pool_id),
                });
            }
            // Absent, another site or one this plan creates: not where the pool is.
            (_, Some(p)) if site.as_ref().map(|s| s.as_deref()) != p.site_id.as_deref().map(Some) => {
                pool_blocked.insert(key);
                let now = p.site_id.as_deref().unwrap_or("no site");
                plan.blocked.push(Blocked {
                    kind: OBJECT_POOL,
                    key: key.clone(),
                    reason: format!(
                        "{} is at {now}: a pool's site cannot change in place (its machines are where they are); \
                         make a new pool at the other site under a new key",
                        p.pool_id
                    ),
                });
            }
            (_, Some(p)) => {
                let mut fields = BTreeMap::new();
                if want.name != p.name {
                    fields.insert("name".into(), field(json!(p.name), json!(want.name)));
                }
                if want.description != p.description {
                    fields.insert("description".into(), field(json!(p.description), json!(want.description)));
                }
                if want.labels != p.labels {
                    fields.insert("labels".into(), field(json!(p.labels), json!(want.labels)));
                }
                if let Some(max) = want.max_reservation_s
                    && max != p.max_reservation_s
                {
                    fields.insert("maxReservationS".into(), field(json!(p.max_reservation_s), json!(max)));
                }
                let after = FleetPoolShape {
                    name: want.name.clone(),
                    description: want.description.clone(),
                    labels: want.labels.clone(),
                    max_reservation_s: want.max_reservation_s.unwrap_or(p.max_reservation_s),
                };
                if !fields.is_empty() {
                    plan.changes.push(Change {
                        op: Op::Update,
                        kind: OBJECT_POOL,
                        key: key.clone(),
                        id: Some(p.pool_id.clone()),
                        fields,
                        expects: Some(p.version),
                    });
                }
                plan.objects.push((OBJECT_POOL, key.clone(), Some(p.pool_id.clone()), after.fingerprint()));
                pool_ids.insert(key, Some(p.pool_id.clone()));
            }
            (_, None) => {
                let after = FleetPoolShape {
                    name: want.name.clone(),
                    description: want.description.clone(),
                    labels: want.labels.clone(),
                    max_reservation_s: want.max_reservation_s.unwrap_or(bc_projections::pool::MAX_RESERVATION_S_DEFAULT),
                };
                let mut fields = created_fields(&after);
                if let (Some(site), Some(site_key)) = (&site, &want.site) {
                    // The site's id, or its key when this plan creates it.
                    fields.insert("site".into(), field(Value::Null, json!(site.clone().unwrap_or_else(|| site_key.clone()))));
                }
                plan.changes.push(Change {
                    op: Op::Create,
                    kind: OBJECT_POOL,
                    key: key.clone(),
                    id: None,
                    fields,
                    expects: Some(0),
                });
                plan.objects.push((OBJECT_POOL, key.clone(), None, after.fingerprint()));
                pool_ids.insert(key, None);
            }
        }
        // The tenant's quota in the pool, when the document states one: its GPUs and resource
        // limits (a limit left out is unbounded). Limits without GPUs state no quota: BLOCKED.
        let limits_without_gpus = want.quota_gpus.is_none()
            && (want.quota_instances.is_some()
                || want.quota_vcpus.is_some()
                || want.quota_memory_mib.is_some()
                || want.quota_sandboxes.is_some());
        if limits_without_gpus {
            plan.blocked.push(Blocked {
                kind: OBJECT_QUOTA,
                key: key.clone(),
                reason: "a quota's instance, vCPU, memory or sandbox limits need its quotaGpus".into(),
            });
        }
        if let (Some(gpus), Some(pool_id)) = (want.quota_gpus, pool_ids.get(key.as_str())) {
            let want_limits = bc_projections::events::QuotaSet {
                gpus,
                instances: want.quota_instances,
                vcpus: want.quota_vcpus,
                memory_mib: want.quota_memory_mib,
                sandboxes: want.quota_sandboxes,
            };
            let now = pool_id.as_deref().and_then(|id| live.quotas.get(id)).map(QuotaDoc::limits);
            let json_of = |v: Option<u64>| v.map_or(Value::Null, |v| json!(v));
            let pairs = [
                ("gpus", now.as_ref().map(|q| u64::from(q.gpus)), Some(u64::from(gpus))),
                ("instances", now.as_ref().and_then(|q| q.instances).map(u64::from), want_limits.instances.map(u64::from)),
                ("vcpus", now.as_ref().and_then(|q| q.vcpus).map(u64::from), want_limits.vcpus.map(u64::from)),
                ("memoryMiB", now.as_ref().and_then(|q| q.memory_mib), want_limits.memory_mib),
                ("sandboxes", now.as_ref().and_then(|q| q.sandboxes).map(u64::from), want_limits.sandboxes.map(u64::from)),
            ];
            let fields: BTreeMap<String, FieldChange> = pairs
                .into_iter()
                .filter(|(_, from, to)| now.is_none() || from != to)
                .filter(|(_, _, to)| now.is_some() || to.is_some())
                .map(|(name, from, to)| (name.to_owned(), field(json_of(from), json_of(to))))
                .collect();
            if now.as_ref() != Some(&want_limits) {
                plan.changes.push(Change {
                    op: if now.is_some() { Op::Update } else { Op::Create },
                    kind: OBJECT_QUOTA,
                    key: key.clone(),
                    id: pool_id.clone(),
                    fields,
                    expects: None,
                });
            }
            plan.objects.push((OBJECT_QUOTA, key.clone(), pool_id.clone(), quota_fingerprint(&want_limits)));
        }
        // The pool's offers, when the document states them: one change offering the tenants
        // added and withdrawing the ones left out.
        if let (Some(want), Some(pool_id)) = (&want.offered_to, pool_ids.get(key.as_str())) {
            let now: BTreeSet<String> =
                pool_id.as_deref().and_then(|id| pools_by_id.get(id)).map(|p| p.offered_to.clone()).unwrap_or_default();
            if now != *want {
                // `+` while it only offers, `~` once it withdraws an offer (never `-`: the document
                // states the whole set, with or without --prune).
                let withdraws = now.difference(want).next().is_some();
                plan.changes.push(Change {
                    op: if withdraws { Op::Update } else { Op::Create },
                    kind: OBJECT_OFFER,
                    key: key.clone(),
                    id: pool_id.clone(),
                    fields: BTreeMap::from([("offeredTo".into(), field(json!(now), json!(want)))]),
                    expects: None,
                });
            }
            // Recorded, so an offer made or withdrawn outside the document is drift.
            plan.objects.push((OBJECT_OFFER, key.clone(), pool_id.clone(), offer_fingerprint(want)));
        }
    }

    // Flavors: their name and shape change in place, their pool never; a pool named by its key
    // in the document.
    let mut flavors_covered: BTreeSet<String> = BTreeSet::new();
    let mut flavor_creates = Vec::new();
    // Names per pool id (or new pool key) the document will hold, to find duplicates.
    let mut flavor_names: BTreeMap<(String, String), &str> = BTreeMap::new();
    for (key, want) in &doc.flavors {
        let id = resolve(applied, OBJECT_FLAVOR, bc_core::id::FlavorId::PREFIX, key);
        if let Some(id) = &id {
            flavors_covered.insert(id.clone());
        }
        let live_flavor = id.as_deref().and_then(|id| flavors_by_id.get(id).copied());
        let block = |plan: &mut FleetPlan, reason: String| {
            plan.blocked.push(Blocked { kind: OBJECT_FLAVOR, key: key.clone(), reason });
        };
        let Some(pool) = pool_ids.get(want.pool.as_str()) else {
            let reason = if pool_blocked.contains(want.pool.as_str()) {
                format!("its pool {:?} is blocked", want.pool)
            } else {
                format!("dangling reference: pool {:?} is not in the document", want.pool)
            };
            block(&mut plan, reason);
            continue;
        };
        let pool_slot = pool.clone().unwrap_or_else(|| format!("new:{}", want.pool));
        if let Some(other) = flavor_names.insert((pool_slot.clone(), want.name.clone()), key) {
            block(&mut plan, format!("flavor {other:?} of the same pool has the name {:?} too", want.name));
            continue;
        }
        match (id, live_flavor) {
            (Some(id), None) if is_id_key(bc_core::id::FlavorId::PREFIX, key) => {
                block(&mut plan, format!("{id} does not exist: a key that is an id names an existing flavor"));
            }
            (_, Some(f)) => {
                if pool.as_deref() != Some(f.pool_id.as_str()) {
                    block(
                        &mut plan,
                        format!("{} belongs to pool {}: a flavor's pool cannot change in place", f.flavor_id, f.pool_id),
                    );
                } else {
                    // Its name and shape change in place (`flavors.update`).
                    let (from, to) = (FlavorShape::of_doc(f), FlavorShape::of_fleet(want));
                    if from != to {
                        let (from_fields, to_fields) = (created_fields(&from), created_fields(&to));
                        let fields: BTreeMap<String, FieldChange> = to_fields
                            .into_iter()
                            .filter(|(name, to)| from_fields.get(name).map(|f| &f.to) != Some(&to.to))
                            .map(|(name, to)| {
                                let was = from_fields.get(&name).map_or(Value::Null, |f| f.to.clone());
                                (name, field(was, to.to))
                            })
                            .collect();
                        plan.changes.push(Change {
                            op: Op::Update,
                            kind: OBJECT_FLAVOR,
                            key: key.clone(),
                            id: Some(f.flavor_id.clone()),
                            fields,
                            expects: Some(f.version),
                        });
                    }
                    plan.objects.push((
                        OBJECT_FLAVOR,
                        key.clone(),
                        Some(f.flavor_id.clone()),
                        FlavorShape::of_fleet(want).fingerprint(),
                    ));
                }
            }
            (_, None) => flavor_creates.push((key, want, pool.clone())),
        }
    }
    // Flavors the document leaves out: deleted with --prune, else left alone (their names
    // taken). Those of archived pools are out of the fleet's reach either way.
    let live_pool_ids: BTreeSet<&str> = live.pools.iter().filter(|p| !p.archived).map(|p| p.pool_id.as_str()).collect();
    let mut flavor_deletes = Vec::new();
    for f in &live.flavors {
        if flavors_covered.contains(&f.flavor_id) || !live_pool_ids.contains(f.pool_id.as_str()) {
            continue;
        }
        if prune {
            flavor_deletes.push(Change {
                op: Op::Delete,
                kind: OBJECT_FLAVOR,
                key: f.flavor_id.clone(),
                id: Some(f.flavor_id.clone()),
                fields: BTreeMap::new(),
                expects: Some(f.version),
            });
        } else {
            plan.unmanaged.push(Unmanaged { kind: OBJECT_FLAVOR, id: f.flavor_id.clone(), name: f.name.clone() });
            if let Some(other) = flavor_names.get(&(f.pool_id.clone(), f.name.clone())) {
                plan.blocked.push(Blocked {
                    kind: OBJECT_FLAVOR,
                    key: (*other).to_owned(),
                    reason: format!(
                        "the name {:?} is taken by {} outside the document (--prune deletes it)",
                        f.name, f.flavor_id
                    ),
                });
            }
        }
    }
    // The bounds `flavors.create` enforces, over what the tenant holds once the plan is made.
    let mut per_pool: BTreeMap<String, usize> = BTreeMap::new();
    let deleted: BTreeSet<&str> = flavor_deletes.iter().filter_map(|c| c.id.as_deref()).collect();
    let kept = live.flavors.iter().filter(|f| !deleted.contains(f.flavor_id.as_str()));
    let mut tenant_flavors = 0usize;
    for f in kept {
        tenant_flavors += 1;
        if live_pool_ids.contains(f.pool_id.as_str()) {
            *per_pool.entry(f.pool_id.clone()).or_default() += 1;
        }
    }
    for (_, want, pool) in &flavor_creates {
        tenant_flavors += 1;
        *per_pool.entry(pool.clone().unwrap_or_else(|| format!("new pool {}", want.pool))).or_default() += 1;
    }
    for (pool, n) in per_pool.iter().filter(|(_, n)| **n > FLAVORS_PER_POOL_MAX) {
        plan.blocked.push(Blocked {
            kind: OBJECT_FLAVOR,
            key: pool.clone(),
            reason: format!("pool {pool} would hold {n} flavors, more than the {FLAVORS_PER_POOL_MAX} a pool offers"),
        });
    }
    if tenant_flavors > FLAVORS_PER_TENANT_MAX as usize {
        plan.blocked.push(Blocked {
            kind: OBJECT_FLAVOR,
            key: "*".into(),
            reason: format!("the tenant would hold {tenant_flavors} flavors, more than {FLAVORS_PER_TENANT_MAX}"),
        });
    }
    for (key, want, pool) in flavor_creates {
        let shape = FlavorShape::of_fleet(want);
        let mut fields = created_fields(&shape);
        fields.insert("pool".into(), field(Value::Null, json!(pool.clone().unwrap_or_else(|| want.pool.clone()))));
        plan.changes.push(Change { op: Op::Create, kind: OBJECT_FLAVOR, key: key.clone(), id: None, fields, expects: Some(0) });
        plan.objects.push((OBJECT_FLAVOR, key.clone(), None, shape.fingerprint()));
    }
    plan.changes.extend(flavor_deletes);

    // Images: their bytes never change, their channel only forward; names unique in the tenant.
    let mut images_covered: BTreeSet<String> = BTreeSet::new();
    let mut image_names: BTreeMap<&str, &str> = BTreeMap::new();
    let mut image_creates = Vec::new();
    for (key, want) in &doc.images {
        let id = resolve(applied, OBJECT_IMAGE, bc_core::id::ImageId::PREFIX, key);
        if let Some(id) = &id {
            images_covered.insert(id.clone());
        }
        let live_image = id.as_deref().and_then(|id| images_by_id.get(id).copied());
        if let Some(other) = image_names.insert(want.name.as_str(), key) {
            plan.blocked.push(Blocked {
                kind: OBJECT_IMAGE,
                key: key.clone(),
                reason: format!("image {other:?} has the name {:?} too", want.name),
            });
            continue;
        }
        match (id, live_image) {
            (Some(id), None) if is_id_key(bc_core::id::ImageId::PREFIX, key) => plan.blocked.push(Blocked {
                kind: OBJECT_IMAGE,
                key: key.clone(),
                reason: format!("{id} does not exist: a key that is an id names an existing image"),
            }),
            (_, Some(i)) if !same_image(&image_of(i), want) => plan.blocked.push(Blocked {
                kind: OBJECT_IMAGE,
                key: key.clone(),
                reason: format!("{} cannot change in place: register the new bytes under a new key", i.image_id),
            }),
            (_, Some(i)) if want.channel == Some(ImageChannelView::Testing) && i.channel == ImageChannel::Stable => {
                plan.blocked.push(Blocked {
                    kind: OBJECT_IMAGE,
                    key: key.clone(),
                    reason: format!("{} is stable: an image is never demoted; register the bytes under a new key", i.image_id),
                })
            }
            (_, Some(i)) => {
                if want.channel == Some(ImageChannelView::Stable) && i.channel == ImageChannel::Testing {
                    plan.changes.push(Change {
                        op: Op::Update,
                        kind: OBJECT_IMAGE,
                        key: key.clone(),
                        id: Some(i.image_id.clone()),
                        fields: BTreeMap::from([("channel".into(), field(json!("testing"), json!("stable")))]),
                        expects: Some(i.version),
                    });
                }
                plan.objects.push((OBJECT_IMAGE, key.clone(), Some(i.image_id.clone()), fleet_image_fingerprint(want)))
            }
            (_, None) => image_creates.push((key, want)),
        }
    }
    let mut image_deletes = Vec::new();
    for i in &live.images {
        if images_covered.contains(&i.image_id) {
            continue;
        }
        if prune {
            image_deletes.push(Change {
                op: Op::Delete,
                kind: OBJECT_IMAGE,
                key: i.image_id.clone(),
                id: Some(i.image_id.clone()),
                fields: BTreeMap::new(),
                expects: Some(i.version),
            });
        } else {
            plan.unmanaged.push(Unmanaged { kind: OBJECT_IMAGE, id: i.image_id.clone(), name: i.name.clone() });
            if let Some(other) = image_names.get(i.name.as_str()) {
                plan.blocked.push(Blocked {
                    kind: OBJECT_IMAGE,
                    key: (*other).to_owned(),
                    reason: format!("the name {:?} is taken by {} outside the document (--prune deletes it)", i.name, i.image_id),
                });
            }
        }
    }
    let tenant_images = live.images.len() - image_deletes.len() + image_creates.len();
    if tenant_images > IMAGES_PER_TENANT_MAX as usize {
        plan.blocked.push(Blocked {
            kind: OBJECT_IMAGE,
            key: "*".into(),
            reason: format!("the tenant would hold {tenant_images} images, more than {IMAGES_PER_TENANT_MAX}"),
        });
    }
    for (key, want) in image_creates {
        plan.changes.push(Change {
            op: Op::Create,
            kind: OBJECT_IMAGE,
            key: key.clone(),
            id: None,
            fields: created_fields(want),
            expects: Some(0),
        });
        plan.objects.push((OBJECT_IMAGE, key.clone(), None, fleet_image_fingerprint(want)));
    }
    plan.changes.extend(image_deletes);

    // Pools the document leaves out: archived last, after their flavors went.
    for p in live.pools.iter().filter(|p| !p.archived && !pools_covered.contains(&p.pool_id)) {
        if prune {
            plan.changes.push(Change {
                op: Op::Delete,
                kind: OBJECT_POOL,
                key: p.pool_id.clone(),
                id: Some(p.pool_id.clone()),
                fields: BTreeMap::new(),
                expects: Some(p.version),
            });
        } else {
            plan.unmanaged.push(Unmanaged { kind: OBJECT_POOL, id: p.pool_id.clone(), name: p.name.clone() });
        }
    }
    // Sites the document leaves out: deleted last (after the pools archived above), and only
    // when no pool that stays names them.
    plan_sites_left_out(live, prune, &sites, &mut plan);
    plan_projects(live, doc, prune, &mut plan);
    plan_webhooks(live, doc, prune, &mut plan);

    plan.blocked.sort_by(|a, b| (a.kind, &a.key).cmp(&(b.kind, &b.key)));
    plan.blocked.dedup();
    plan.plan_hash = plan_hash(doc, prune, &plan);
    plan
}

/// What the plan made of the document's sites: the id each key names (`None`: created by this
/// plan), the keys blocked, the live sites the document covers, and the names it holds.
#[derive(Default)]
struct SitePlan {
    ids: BTreeMap<String, Option<String>>,
    blocked: BTreeSet<String>,
    covered: BTreeSet<String>,
    names: BTreeMap<String, String>,
    creates: usize,
}

/// The document's sites against the live ones: `+` a new site, `~` a new name or labels, and
/// `BLOCKED` for another region (a site elsewhere is another site), an id naming nothing, or a
/// name two sites would hold.
fn plan_sites(live: &FleetLive, doc: &FleetDocument, plan: &mut FleetPlan) -> SitePlan {
    let applied = live.applied.as_ref();
    let by_id: BTreeMap<&str, &SiteDoc> = live.sites.iter().map(|s| (s.site_id.as_str(), s)).collect();
    let mut out = SitePlan::default();
    for (key, want) in &doc.sites {
        let id = resolve(applied, OBJECT_SITE, bc_core::id::SiteId::PREFIX, key);
        if let Some(id) = &id {
            out.covered.insert(id.clone());
        }
        let live_site = id.as_deref().and_then(|id| by_id.get(id).copied());
        let blocked = if let Some(other) = out.names.insert(want.name.clone(), key.clone()) {
            Some(format!("site {other:?} has the name {:?} too", want.name))
        } else {
            match (id, live_site) {
                (Some(id), None) if is_id_key(bc_core::id::SiteId::PREFIX, key) => {
                    Some(format!("{id} does not exist: a key that is an id names an existing site"))
                }
                (_, Some(s)) if s.region != want.region => Some(format!(
                    "{} is in region {:?}: a site's region cannot change in place; make the new site under a new key",
                    s.site_id, s.region
                )),
                (_, Some(s)) => {
                    let mut fields = BTreeMap::new();
                    if want.name != s.name {
                        fields.insert("name".into(), field(json!(s.name), json!(want.name)));
                    }
                    if want.labels != s.labels {
                        fields.insert("labels".into(), field(json!(s.labels), json!(want.labels)));
                    }
                    if !fields.is_empty() {
                        plan.changes.push(Change {
                            op: Op::Update,
                            kind: OBJECT_SITE,
                            key: key.clone(),
                            id: Some(s.site_id.clone()),
                            fields,
                            expects: Some(s.version),
                        });
                    }
                    let fingerprint = site_fingerprint(&want.name, &want.region, &want.labels);
                    plan.objects.push((OBJECT_SITE, key.clone(), Some(s.site_id.clone()), fingerprint));
                    out.ids.insert(key.clone(), Some(s.site_id.clone()));
                    None
                }
                (_, None) => {
                    let mut fields = created_fields(want);
                    fields.entry("labels".into()).or_insert_with(|| field(Value::Null, json!({})));
                    plan.changes.push(Change {
                        op: Op::Create,
                        kind: OBJECT_SITE,
                        key: key.clone(),
                        id: None,
                        fields,
                        expects: Some(0),
                    });
                    let fingerprint = site_fingerprint(&want.name, &want.region, &want.labels);
                    plan.objects.push((OBJECT_SITE, key.clone(), None, fingerprint));
                    out.ids.insert(key.clone(), None);
                    out.creates += 1;
                    None
                }
            }
        };
        if let Some(reason) = blocked {
            out.blocked.insert(key.clone());
            plan.blocked.push(Blocked { kind: OBJECT_SITE, key: key.clone(), reason });
        }
    }
    out
}

/// The live sites the document leaves out: with `prune`, deleted once no pool that stays and no
/// machine names them (one that is named is `BLOCKED`, as `sites.delete` refuses it; machines
/// are not in the document), else left alone with their
/// names taken. Then the tenant's bound on sites, over what it holds once the plan is made.
fn plan_sites_left_out(live: &FleetLive, prune: bool, sites: &SitePlan, plan: &mut FleetPlan) {
    let archived_now: BTreeSet<String> =
        plan.changes.iter().filter(|c| c.kind == OBJECT_POOL && c.op == Op::Delete).filter_map(|c| c.id.clone()).collect();
    let mut deletes = 0usize;
    for s in live.sites.iter().filter(|s| !sites.covered.contains(&s.site_id)) {
        if prune {
            let named_by: Vec<String> = live
                .pools
                .iter()
                .filter(|p| !p.archived && p.site_id.as_deref() == Some(s.site_id.as_str()) && !archived_now.contains(&p.pool_id))
                .map(|p| format!("{KIND_POOL}/{}", p.pool_id))
                .chain(
                    live.site_machines
                        .iter()
                        .filter(|(_, site)| *site == s.site_id)
                        .map(|(node, _)| format!("{}/{node}", bc_projections::workflow::KIND_METAL)),
                )
                .collect();
            if named_by.is_empty() {
                deletes += 1;
                plan.changes.push(Change {
                    op: Op::Delete,
                    kind: OBJECT_SITE,
                    key: s.site_id.clone(),
                    id: Some(s.site_id.clone()),
                    fields: BTreeMap::new(),
                    expects: Some(s.version),
                });
            } else {
                plan.blocked.push(Blocked {
                    kind: OBJECT_SITE,
                    key: s.site_id.clone(),
                    reason: format!("{} is named by {}: a named site is not deleted", s.site_id, named_by.join(", ")),
                });
            }
        } else {
            plan.unmanaged.push(Unmanaged { kind: OBJECT_SITE, id: s.site_id.clone(), name: s.name.clone() });
            if let Some(other) = sites.names.get(&s.name) {
                plan.blocked.push(Blocked {
                    kind: OBJECT_SITE,
                    key: other.clone(),
                    reason: format!("the name {:?} is taken by {} outside the document (--prune deletes it)", s.name, s.site_id),
                });
            }
        }
    }
    let held = live.sites.len() - deletes + sites.creates;
    if held > SITES_PER_TENANT_MAX {
        plan.blocked.push(Blocked {
            kind: OBJECT_SITE,
            key: "*".into(),
            reason: format!("the tenant would hold {held} sites, more than {SITES_PER_TENANT_MAX}"),
        });
    }
}

/// The document's projects against the live ones: `+` a new project, `-` (with `prune`) the
/// archive of a live one it leaves out; `BLOCKED` for an archived project (never brought back),
/// another name or description (a project does not change), an id naming nothing, or a name
/// another project holds (archived ones too: names stay theirs).
fn plan_projects(live: &FleetLive, doc: &FleetDocument, prune: bool, plan: &mut FleetPlan) {
    let applied = live.applied.as_ref();
    let by_id: BTreeMap<&str, &ProjectDoc> = live.projects.iter().map(|p| (p.project_id.as_str(), p)).collect();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    let mut names: BTreeMap<&str, &str> = BTreeMap::new();
    let mut creates = 0usize;
    for (key, want) in &doc.projects {
        let id = resolve(applied, OBJECT_PROJECT, bc_core::id::ProjectId::PREFIX, key);
        if let Some(id) = &id {
            covered.insert(id.clone());
        }
        let live_project = id.as_deref().and_then(|id| by_id.get(id).copied());
        let block = |plan: &mut FleetPlan, reason: String| {
            plan.blocked.push(Blocked { kind: OBJECT_PROJECT, key: key.clone(), reason });
        };
        if let Some(other) = names.insert(want.name.as_str(), key) {
            block(plan, format!("project {other:?} has the name {:?} too", want.name));
            continue;
        }
        match (id, live_project) {
            (Some(id), None) if is_id_key(bc_core::id::ProjectId::PREFIX, key) => {
                block(plan, format!("{id} does not exist: a key that is an id names an existing project"));
            }
            (_, Some(p)) if p.archived => {
                block(plan, format!("{} is archived and cannot be brought back; give a new project a new key", p.project_id))
            }
            (_, Some(p)) if p.name != want.name || p.description != want.description => {
                block(plan, format!("{} cannot change in place: a project's name and description are fixed", p.project_id))
            }
            (_, Some(p)) => {
                let fingerprint = project_fingerprint(&want.name, &want.description);
                plan.objects.push((OBJECT_PROJECT, key.clone(), Some(p.project_id.clone()), fingerprint));
            }
            (_, None) => {
                let mut fields = created_fields(want);
                fields.entry("description".into()).or_insert_with(|| field(Value::Null, json!("")));
                plan.changes.push(Change {
                    op: Op::Create,
                    kind: OBJECT_PROJECT,
                    key: key.clone(),
                    id: None,
                    fields,
                    expects: Some(0),
                });
                plan.objects.push((OBJECT_PROJECT, key.clone(), None, project_fingerprint(&want.name, &want.description)));
                creates += 1;
            }
        }
    }
    for p in live.projects.iter().filter(|p| !covered.contains(&p.project_id)) {
        if !p.archived && prune {
            plan.changes.push(Change {
                op: Op::Delete,
                kind: OBJECT_PROJECT,
                key: p.project_id.clone(),
                id: Some(p.project_id.clone()),
                fields: BTreeMap::new(),
                expects: Some(p.version),
            });
            continue;
        }
        if !p.archived {
            plan.unmanaged.push(Unmanaged { kind: OBJECT_PROJECT, id: p.project_id.clone(), name: p.name.clone() });
        }
        if let Some(other) = names.get(p.name.as_str()) {
            plan.blocked.push(Blocked {
                kind: OBJECT_PROJECT,
                key: (*other).to_owned(),
                reason: format!("the name {:?} is taken by {} outside the document", p.name, p.project_id),
            });
        }
    }
    let held = live.projects.len() + creates;
    if held > PROJECTS_PER_TENANT_MAX {
        plan.blocked.push(Blocked {
            kind: OBJECT_PROJECT,
            key: "*".into(),
            reason: format!("the tenant would hold {held} projects, more than {PROJECTS_PER_TENANT_MAX}"),
        });
    }
}

/// The document's webhooks against the live ones: `+` a new webhook (it must name its signing
/// secret by reference: an apply cannot hand out a generated one), `~` a new endpoint, event
/// types, description or secret reference, `-` (with `prune`) the delete of one it leaves out.
/// A webhook without `secretRef` leaves its secret alone. `BLOCKED`: a reference to no secret
/// of the tenant, or to one that is no webhook signing secret; an id naming nothing; past
/// `WEBHOOKS_PER_TENANT_MAX`.
fn plan_webhooks(live: &FleetLive, doc: &FleetDocument, prune: bool, plan: &mut FleetPlan) {
    let applied = live.applied.as_ref();
    let by_id: BTreeMap<&str, &bc_projections::WebhookDoc> = live.webhooks.iter().map(|w| (w.webhook_id.as_str(), w)).collect();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    let mut creates = 0usize;
    for (key, want) in &doc.webhooks {
        let id = resolve(applied, OBJECT_WEBHOOK, bc_core::id::WebhookId::PREFIX, key);
        if let Some(id) = &id {
            covered.insert(id.clone());
        }
        let live_webhook = id.as_deref().and_then(|id| by_id.get(id).copied());
        let block = |plan: &mut FleetPlan, reason: String| {
            plan.blocked.push(Blocked { kind: OBJECT_WEBHOOK, key: key.clone(), reason });
        };
        if let Some(reference) = &want.secret_ref {
            match live.webhook_secrets.get(&reference.to_lowercase()) {
                None => {
                    block(plan, format!("dangling reference: secret {reference} is not a secret of the tenant"));
                    continue;
                }
                Some(s) if !s.signs => {
                    block(plan, format!("secret {reference} is not a webhook signing secret (whsec_…)"));
                    continue;
                }
                Some(_) => {}
            }
        }
        let reference = want.secret_ref.as_ref().map(|r| r.to_lowercase());
        let fingerprint = webhook_fingerprint(&want.url, &want.event_types, &want.description, reference.as_deref());
        match (id, live_webhook) {
            (Some(id), None) if is_id_key(bc_core::id::WebhookId::PREFIX, key) => {
                block(plan, format!("{id} does not exist: a key that is an id names an existing webhook"));
            }
            (_, Some(w)) => {
                let mut fields = BTreeMap::new();
                if w.url != want.url {
                    fields.insert("url".to_owned(), field(json!(w.url), json!(want.url)));
                }
                if w.event_types != want.event_types {
                    fields.insert("eventTypes".to_owned(), field(json!(w.event_types), json!(want.event_types)));
                }
                if w.description != want.description {
                    fields.insert("description".to_owned(), field(json!(w.description), json!(want.description)));
                }
                if let Some(reference) = want.secret_ref.as_ref().map(|r| r.to_lowercase())
                    && w.secret_ref.as_deref() != Some(reference.as_str())
                {
                    let from = w.secret_ref.as_ref().map_or(Value::Null, |r| json!(r));
                    fields.insert("secretRef".to_owned(), field(from, json!(reference)));
                }
                if !fields.is_empty() {
                    plan.changes.push(Change {
                        op: Op::Update,
                        kind: OBJECT_WEBHOOK,
                        key: key.clone(),
                        id: Some(w.webhook_id.clone()),
                        fields,
                        expects: Some(w.version),
                    });
                }
                plan.objects.push((OBJECT_WEBHOOK, key.clone(), Some(w.webhook_id.clone()), fingerprint));
            }
            (_, None) => {
                if want.secret_ref.is_none() {
                    block(
                        plan,
                        "a webhook the document creates names its signing secret by reference (secretRef: secret://TENANT/sec_…): an apply cannot hand out a generated one".into(),
                    );
                    continue;
                }
                let mut fields = created_fields(want);
                fields.entry("description".into()).or_insert_with(|| field(Value::Null, json!("")));
                if let Some(reference) = &want.secret_ref {
                    fields.insert("secretRef".into(), field(Value::Null, json!(reference.to_lowercase())));
                }
                plan.changes.push(Change {
                    op: Op::Create,
                    kind: OBJECT_WEBHOOK,
                    key: key.clone(),
                    id: None,
                    fields,
                    expects: Some(0),
                });
                plan.objects.push((OBJECT_WEBHOOK, key.clone(), None, fingerprint));
                creates += 1;
            }
        }
    }
    for w in live.webhooks.iter().filter(|w| !covered.contains(&w.webhook_id)) {
        if prune {
            plan.changes.push(Change {
                op: Op::Delete,
                kind: OBJECT_WEBHOOK,
                key: w.webhook_id.clone(),
                id: Some(w.webhook_id.clone()),
                fields: BTreeMap::new(),
                expects: Some(w.version),
            });
        } else {
            plan.unmanaged.push(Unmanaged { kind: OBJECT_WEBHOOK, id: w.webhook_id.clone(), name: w.url.clone() });
        }
    }
    let held = live.webhooks.len() + creates;
    if held > WEBHOOKS_PER_TENANT_MAX as usize {
        plan.blocked.push(Blocked {
            kind: OBJECT_WEBHOOK,
            key: "*".into(),
            reason: format!("the tenant would hold {held} webhooks, more than {WEBHOOKS_PER_TENANT_MAX}"),
        });
    }
}

/// The plan's hash: SHA-256 over a domain tag, the canonical document, the prune flag, what was
/// read and the changes.
fn plan_hash(doc: &FleetDocument, prune: bool, plan: &FleetPlan) -> String {
    let mut h = Sha256::new();
    h.update(b"better-compute fleet plan v1\n");
    h.update(canonical_json(doc));
    h.update(if prune { b"\nprune\n" as &[u8] } else { b"\nkeep\n" });
    h.update(canonical_json(&json!({ "fleetVersion": plan.fleet_version, "reads": plan.reads })));
    h.update(b"\n");
    h.update(canonical_json(&json!({ "changes": plan.changes, "blocked": plan.blocked })));
    hex::encode(h.finalize())
}

/// The live fleet as a document: objects the fleet made keyed by their key, the others by id.
/// Archived pools, the flavors of archived pools, and archived projects are left out.
pub fn fleet_export(live: &FleetLive) -> FleetDocument {
    let keys: BTreeMap<(&str, &str), &str> = live
        .applied
        .iter()
        .flat_map(|a| a.objects.iter())
        .filter_map(|(k, o)| k.split_once('/').map(|(kind, key)| ((kind, o.id.as_str()), key)))
        .collect();
    let key_of = |kind: &str, id: &str| keys.get(&(kind, id)).map_or_else(|| id.to_owned(), |k| (*k).to_owned());
    let mut doc = FleetDocument::empty();
    for p in live.pools.iter().filter(|p| !p.archived) {
        doc.pools.insert(
            key_of(OBJECT_POOL, &p.pool_id),
            FleetPool {
                name: p.name.clone(),
                description: p.description.clone(),
                labels: p.labels.clone(),
                max_reservation_s: Some(p.max_reservation_s),
                quota_gpus: live.quotas.get(&p.pool_id).map(|q| q.gpus),
                quota_instances: live.quotas.get(&p.pool_id).and_then(|q| q.instances),
                quota_vcpus: live.quotas.get(&p.pool_id).and_then(|q| q.vcpus),
                quota_memory_mib: live.quotas.get(&p.pool_id).and_then(|q| q.memory_mib),
                quota_sandboxes: live.quotas.get(&p.pool_id).and_then(|q| q.sandboxes),
                offered_to: (!p.offered_to.is_empty()).then(|| p.offered_to.clone()),
                site: p.site_id.as_deref().map(|s| key_of(OBJECT_SITE, s)),
            },
        );
    }
    for s in &live.sites {
        doc.sites.insert(
            key_of(OBJECT_SITE, &s.site_id),
            FleetSite { name: s.name.clone(), region: s.region.clone(), labels: s.labels.clone() },
        );
    }
    for p in live.projects.iter().filter(|p| !p.archived) {
        doc.projects.insert(
            key_of(OBJECT_PROJECT, &p.project_id),
            FleetProject { name: p.name.clone(), description: p.description.clone() },
        );
    }
    for f in &live.flavors {
        if !live.pools.iter().any(|p| p.pool_id == f.pool_id && !p.archived) {
            continue;
        }
        doc.flavors.insert(
            key_of(OBJECT_FLAVOR, &f.flavor_id),
            FleetFlavor {
                pool: key_of(OBJECT_POOL, &f.pool_id),
                name: f.name.clone(),
                vcpus: f.vcpus,
                memory_mib: f.memory_mib,
                disk_gib: f.disk_gib,
                gpus: f.gpus,
            },
        );
    }
    for i in &live.images {
        doc.images.insert(key_of(OBJECT_IMAGE, &i.image_id), image_of(i));
    }
    // A webhook's signing secret only as a reference: one with a generated secret has none.
    for w in &live.webhooks {
        doc.webhooks.insert(
            key_of(OBJECT_WEBHOOK, &w.webhook_id),
            FleetWebhook {
                url: w.url.clone(),
                event_types: w.event_types.clone(),
                description: w.description.clone(),
                secret_ref: w.secret_ref.clone(),
            },
        );
    }
    doc
}

/// The objects the last applied document covers that changed outside it since
/// ([`bc_projections::fleet_config::fleet_drift`]); empty when nothing was ever applied.
pub fn fleet_drift(live: &FleetLive) -> Vec<FleetDrift> {
    let Some(applied) = &live.applied else { return Vec::new() };
    let objects = FleetObjectsLive {
        pools: &live.pools,
        quotas: &live.quotas,
        flavors: &live.flavors,
        images: &live.images,
        sites: &live.sites,
        projects: &live.projects,
        webhooks: &live.webhooks,
    };
    bc_projections::fleet_config::fleet_drift(applied, &objects)
}

/// What `fleet.objects` records for a plan applied with `ids` for what it created (by key).
pub fn applied_objects(plan: &FleetPlan, created: &BTreeMap<(&'static str, String), String>) -> Vec<FleetObject> {
    plan.objects
        .iter()
        .filter_map(|(kind, key, id, fingerprint)| {
            let id = match id {
                Some(id) => id.clone(),
                // A quota's id and an offer's are their pool's.
                None if *kind == OBJECT_QUOTA || *kind == OBJECT_OFFER => created.get(&(OBJECT_POOL, key.clone()))?.clone(),
                None => created.get(&(*kind, key.clone()))?.clone(),
            };
            Some(FleetObject { kind: (*kind).to_owned(), key: key.clone(), id, fingerprint: fingerprint.clone() })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(id: &str, name: &str, version: u64) -> PoolDoc {
        PoolDoc {
            tenant_id: "ten_x".into(),
            pool_id: id.into(),
            name: name.into(),
            description: String::new(),
            labels: BTreeMap::new(),
            max_reservation_s: bc_projections::pool::MAX_RESERVATION_S_DEFAULT,
            archived: false,
            site_id: None,
            offered_to: BTreeSet::new(),
            version,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    /// The flavor `f` of pool `P1` (1 vCPU, 1 GiB, 10 GiB disk) at `version`.
    fn flavor_doc(version: u64) -> FlavorDoc {
        FlavorDoc {
            tenant_id: "ten_x".into(),
            flavor_id: "flv_01hzz0000000000000000000f1".into(),
            pool_id: P1.into(),
            name: "f".into(),
            vcpus: 1,
            memory_mib: 1024,
            disk_gib: 10,
            gpus: 0,
            version,
            created_at_ms: 0,
        }
    }

    fn want(name: &str) -> FleetPool {
        FleetPool {
            name: name.into(),
            description: String::new(),
            labels: BTreeMap::new(),
            max_reservation_s: None,
            quota_gpus: None,
            quota_instances: None,
            quota_vcpus: None,
            quota_memory_mib: None,
            quota_sandboxes: None,
            offered_to: None,
            site: None,
        }
    }

    const P1: &str = "pool_01hzz0000000000000000000p1";

    /// A site the document leaves out is pruned only while nothing names it: a machine (not
    /// retired) that names it blocks its delete, naming it, as `sites.delete` refuses it.
    #[test]
    fn a_site_a_machine_names_is_not_pruned() {
        const S1: &str = "site_01hzz0000000000000000000s1";
        let site = SiteDoc {
            tenant_id: "ten_x".into(),
            site_id: S1.into(),
            name: "fra1".into(),
            region: "eu".into(),
            labels: BTreeMap::new(),
            version: 1,
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        let empty = fleet_export(&FleetLive::default());
        let held =
            FleetLive { sites: vec![site.clone()], site_machines: vec![("node_1".into(), S1.into())], ..Default::default() };
        let plan = fleet_plan(&held, &empty, true);
        assert!(plan.changes.is_empty(), "{plan:?}");
        assert!(plan.blocked.len() == 1 && plan.blocked[0].reason.contains("metal/node_1"), "{plan:?}");
        let free = FleetLive { sites: vec![site], ..Default::default() };
        let plan = fleet_plan(&free, &empty, true);
        assert_eq!(plan.changes.iter().map(|c| (c.kind, c.op)).collect::<Vec<_>>(), [(OBJECT_SITE, Op::Delete)], "{plan:?}");
    }

    /// A quota's resource limits are exported and plan empty; a document that changes one is a
    /// `~ quota` naming only what differs (a limit left out: unbounded, `null`); limits without
    /// `quotaGpus` are BLOCKED; a quota of GPUs alone keeps the fingerprint it had before limits.
    #[test]
    fn a_quotas_resource_limits_are_exported_and_planned() {
        let quota = QuotaDoc {
            tenant_id: "ten_x".into(),
            pool_id: P1.into(),
            gpus: 8,
            instances: Some(4),
            vcpus: Some(32),
            memory_mib: None,
            sandboxes: Some(10),
            version: 3,
            updated_at_ms: 0,
        };
        let live =
            FleetLive { pools: vec![pool(P1, "a", 2)], quotas: BTreeMap::from([(P1.into(), quota)]), ..Default::default() };
        let doc = fleet_export(&live);
        let p = &doc.pools[P1];
        assert_eq!(
            (p.quota_gpus, p.quota_instances, p.quota_vcpus, p.quota_memory_mib, p.quota_sandboxes),
            (Some(8), Some(4), Some(32), None, Some(10))
        );
        let plan = fleet_plan(&live, &doc, true);
        assert!(plan.changes.is_empty() && plan.blocked.is_empty(), "{plan:?}");
        assert_eq!(plan.reads.get(&format!("quota/{P1} vcpus")), Some(&32));

        let mut edited = doc.clone();
        let e = edited.pools.get_mut(P1).unwrap();
        e.quota_memory_mib = Some(65_536);
        e.quota_sandboxes = None;
        let plan = fleet_plan(&live, &edited, false);
        assert_eq!(plan.changes.len(), 1, "{plan:?}");
        let c = &plan.changes[0];
        assert_eq!((c.kind, c.op, c.id.as_deref()), (OBJECT_QUOTA, Op::Update, Some(P1)));
        assert_eq!(c.fields.keys().collect::<Vec<_>>(), ["memoryMiB", "sandboxes"]);
        assert_eq!(c.fields["sandboxes"], field(json!(10), Value::Null));
        assert_eq!(c.fields["memoryMiB"], field(Value::Null, json!(65_536)));

        let mut no_gpus = doc;
        no_gpus.pools.get_mut(P1).unwrap().quota_gpus = None;
        let plan = fleet_plan(&live, &no_gpus, false);
        assert!(plan.blocked.iter().any(|b| b.kind == OBJECT_QUOTA && b.reason.contains("quotaGpus")), "{plan:?}");

        let gpus_only =
            bc_projections::events::QuotaSet { gpus: 3, instances: None, vcpus: None, memory_mib: None, sandboxes: None };
        assert_eq!(quota_fingerprint(&gpus_only), bc_projections::fleet_config::canonical_sha256(&json!({ "gpus": 3 })));
    }

    /// Webhooks: one signing with a referenced secret is exported with its `secretRef`, one with
    /// a generated secret without; the export plans empty. A new webhook must name a secret by
    /// reference (BLOCKED otherwise), and one naming no secret of the tenant, or one that does
    /// not sign, is BLOCKED; an edit is a `~` of what differs, a webhook without `secretRef`
    /// leaves its secret alone, and `--prune` deletes one left out.
    #[test]
    fn webhooks_are_exported_planned_with_their_secrets_as_references_only() {
        const SECRET: &str = "secret://ten_01hzz00000000000000000000x/sec_01hzz00000000000000000000s";
        const W1: &str = "wh_01hzz0000000000000000000w1";
        const W2: &str = "wh_01hzz0000000000000000000w2";
        let webhook = |id: &str, secret_ref: Option<&str>| bc_projections::WebhookDoc {
            tenant_id: "ten_x".into(),
            webhook_id: id.into(),
            url: format!("https://hooks.example.com/{id}"),
            event_types: vec!["pool.*".into()],
            description: String::new(),
            secret_version: u32::from(secret_ref.is_none()),
            secret_id: if secret_ref.is_none() { format!("{id}/evt_1") } else { String::new() },
            secret_ref: secret_ref.map(str::to_owned),
            previous_secrets: Vec::new(),
            created_seq: 1,
            version: 1,
            created_at_ms: 0,
            updated_at_ms: 0,
        };
        let read = |signs: bool| SecretRead { secret_id: "sec_01hzz00000000000000000000s".into(), version: 2, signs };
        let live = FleetLive {
            webhooks: vec![webhook(W1, Some(SECRET)), webhook(W2, None)],
            webhook_secrets: BTreeMap::from([(SECRET.to_owned(), read(true))]),
            ..Default::default()
        };
        let doc = fleet_export(&live);
        assert_eq!(doc.webhooks[W1].secret_ref.as_deref(), Some(SECRET));
        assert_eq!(doc.webhooks[W2].secret_ref, None, "a generated secret is never in the document");
        let plan = fleet_plan(&live, &doc, true);
        assert!(plan.changes.is_empty() && plan.blocked.is_empty(), "{plan:?}");
        assert_eq!(plan.reads.get("secret/sec_01hzz00000000000000000000s"), Some(&2), "the referenced secret is read");

        let new = |secret_ref: Option<&str>| FleetWebhook {
            url: "https://hooks.example.com/new".into(),
            event_types: vec!["reservation.*".into()],
            description: "ci".into(),
            secret_ref: secret_ref.map(str::to_owned),
        };
        let mut without = doc.clone();
        without.webhooks.insert("ci".into(), new(None));
        let plan = fleet_plan(&live, &without, false);
        assert!(plan.blocked.iter().any(|b| b.kind == OBJECT_WEBHOOK && b.reason.contains("secretRef")), "{plan:?}");
        let mut dangling = doc.clone();
        dangling
            .webhooks
            .insert("ci".into(), new(Some("secret://ten_01hzz00000000000000000000x/sec_01hzz00000000000000000000z")));
        let plan = fleet_plan(&live, &dangling, false);
        assert!(plan.blocked.iter().any(|b| b.reason.contains("dangling reference")), "{plan:?}");
        let not_signing = FleetLive { webhook_secrets: BTreeMap::from([(SECRET.to_owned(), read(false))]), ..live.clone() };
        assert!(fleet_plan(&not_signing, &doc, false).blocked.iter().any(|b| b.reason.contains("whsec_")));

        let mut edited = doc.clone();
        edited.webhooks.insert("ci".into(), new(Some(SECRET)));
        edited.webhooks.get_mut(W2).unwrap().description = "the generated one".into();
        edited.webhooks.remove(W1);
        let plan = fleet_plan(&live, &edited, true);
        let ops: Vec<(Op, &str, &str)> = plan.changes.iter().map(|c| (c.op, c.kind, c.key.as_str())).collect();
        assert_eq!(ops, [(Op::Create, OBJECT_WEBHOOK, "ci"), (Op::Update, OBJECT_WEBHOOK, W2), (Op::Delete, OBJECT_WEBHOOK, W1)]);
        assert_eq!(plan.changes[1].fields.keys().collect::<Vec<_>>(), ["description"], "its secret is left alone");
        assert_eq!(plan.changes[0].fields["secretRef"].to, json!(SECRET));
        assert_eq!(
            plan.changes.iter().map(Change::call).collect::<Vec<_>>(),
            [
                ("webhooks.create", "compute:webhooks:write"),
                ("webhooks.update", "compute:webhooks:write"),
                ("webhooks.delete", "compute:webhooks:write")
            ]
        );
        assert!(plan.blocked.is_empty(), "{plan:?}");

        // Drift: a document that names a webhook's secret records it, so another reference or
        // a generated secret set by hand is drift; one that leaves the secret alone does not.
        let applied = applied_record(&live, &doc);
        let drift_of = |webhook: bc_projections::WebhookDoc, applied: &FleetConfigDoc| {
            let webhooks = vec![webhook, live.webhooks[1].clone()];
            fleet_drift(&FleetLive { webhooks, applied: Some(applied.clone()), ..live.clone() })
        };
        let changed = vec![FleetDrift { kind: OBJECT_WEBHOOK.into(), key: W1.into(), id: W1.into(), what: "changed".into() }];
        assert_eq!(drift_of(webhook(W1, Some(SECRET)), &applied), vec![], "as applied");
        let other = "secret://ten_01hzz00000000000000000000x/sec_01hzz00000000000000000000o";
        assert_eq!(drift_of(webhook(W1, Some(other)), &applied), changed, "another secret referred to by hand");
        assert_eq!(drift_of(webhook(W1, None), &applied), changed, "a generated secret by hand");
        let mut silent = doc.clone();
        silent.webhooks.get_mut(W1).unwrap().secret_ref = None;
        let applied = applied_record(&live, &silent);
        assert_eq!(drift_of(webhook(W1, Some(other)), &applied), vec![], "a secret the document leaves alone");
        assert_eq!(drift_of(webhook(W1, None), &applied), vec![]);
        // A fingerprint recorded before references were in it still matches.
        let mut before = applied_record(&live, &doc);
        let legacy =
            bc_projections::fleet_config::webhook_fingerprint(&webhook(W1, None).url, &webhook(W1, None).event_types, "", None);
        before.objects.get_mut(&bc_projections::fleet_config::object_key(OBJECT_WEBHOOK, W1)).unwrap().fingerprint = legacy;
        assert_eq!(drift_of(webhook(W1, Some(SECRET)), &before), vec![]);
    }

    /// A pool's offers are exported, and the export plans empty; a document that adds and
    /// withdraws a tenant is one `offer` change from the set to the set (`+`, `pools.offer`,
    /// when it only adds; `~`, with `pools.unoffer`, once it withdraws); a document without
    /// `offeredTo` leaves the offers alone.
    #[test]
    fn offers_are_exported_planned_and_left_alone_when_absent() {
        const B: &str = "ten_01hzz00000000000000000000b";
        const C: &str = "ten_01hzz00000000000000000000c";
        let offered = PoolDoc { offered_to: BTreeSet::from([B.to_owned()]), ..pool(P1, "a", 2) };
        let live = FleetLive { pools: vec![offered], ..Default::default() };
        let doc = fleet_export(&live);
        assert_eq!(doc.pools[P1].offered_to, Some(BTreeSet::from([B.to_owned()])));
        let plan = fleet_plan(&live, &doc, true);
        assert!(plan.changes.is_empty() && plan.blocked.is_empty(), "{plan:?}");

        let mut both = doc.clone();
        both.pools.get_mut(P1).unwrap().offered_to = Some(BTreeSet::from([C.to_owned()]));
        let plan = fleet_plan(&live, &both, false);
        assert_eq!(plan.changes.len(), 1, "{plan:?}");
        let change = &plan.changes[0];
        assert_eq!((change.kind, change.op, change.id.as_deref()), (OBJECT_OFFER, Op::Update, Some(P1)));
        assert_eq!(change.fields["offeredTo"], field(json!([B]), json!([C])));

        let mut more = doc.clone();
        more.pools.get_mut(P1).unwrap().offered_to = Some(BTreeSet::from([B.to_owned(), C.to_owned()]));
        assert_eq!(fleet_plan(&live, &more, false).changes[0].call(), ("pools.offer", "compute:pools:admin"));
        let mut none = doc.clone();
        none.pools.get_mut(P1).unwrap().offered_to = Some(BTreeSet::new());
        assert_eq!(fleet_plan(&live, &none, false).changes[0].call(), ("pools.unoffer", "compute:pools:admin"));
        let mut absent = doc;
        absent.pools.get_mut(P1).unwrap().offered_to = None;
        assert!(fleet_plan(&live, &absent, false).changes.is_empty());
    }

    /// What an apply of `doc` on `live` (with nothing of it made yet) records.
    fn applied_record(live: &FleetLive, doc: &FleetDocument) -> FleetConfigDoc {
        let plan = fleet_plan(live, doc, false);
        let objects = applied_objects(&plan, &BTreeMap::new())
            .into_iter()
            .map(|o| {
                let state = bc_projections::fleet_config::FleetObjectState { id: o.id, fingerprint: o.fingerprint };
                (bc_projections::fleet_config::object_key(&o.kind, &o.key), state)
            })
            .collect();
        FleetConfigDoc {
            tenant_id: "ten_x".into(),
            plan_hash: plan.plan_hash,
            document_sha256: plan.document_sha256,
            applied_at_ms: 0,
            applies: 1,
            objects,
            drift: Vec::new(),
            drift_count: 0,
            drift_at_ms: None,
            version: 1,
        }
    }

    /// A document that states a pool's offers records them when applied, so an offer made or
    /// withdrawn outside it (`pools offer`/`unoffer`) is drift (`offer`, `changed`), and gone
    /// once the live offers are the document's again; a document without `offeredTo` records
    /// none, so the offers it leaves alone never drift.
    #[test]
    fn offers_changed_outside_the_applied_document_are_drift() {
        const B: &str = "ten_01hzz00000000000000000000b";
        const C: &str = "ten_01hzz00000000000000000000c";
        let offered = PoolDoc { offered_to: BTreeSet::from([B.to_owned()]), ..pool(P1, "a", 2) };
        let doc = fleet_export(&FleetLive { pools: vec![offered.clone()], ..Default::default() });
        let applied_with = |doc: &FleetDocument, pool: &PoolDoc| {
            applied_record(&FleetLive { pools: vec![pool.clone()], ..Default::default() }, doc)
        };
        let applied = applied_with(&doc, &offered);
        assert_eq!(applied.id_of(OBJECT_OFFER, P1), Some(P1), "{:?}", applied.objects);
        let drift_of = |pool: &PoolDoc| {
            fleet_drift(&FleetLive { pools: vec![pool.clone()], applied: Some(applied.clone()), ..Default::default() })
        };
        assert_eq!(drift_of(&offered), vec![], "as applied");
        let withdrawn = PoolDoc { offered_to: BTreeSet::new(), ..offered.clone() };
        let offer_drift = |what: &str| FleetDrift { kind: OBJECT_OFFER.into(), key: P1.into(), id: P1.into(), what: what.into() };
        assert_eq!(drift_of(&withdrawn), vec![offer_drift("changed")], "unoffered by hand");
        let more = PoolDoc { offered_to: BTreeSet::from([B.to_owned(), C.to_owned()]), ..offered.clone() };
        assert_eq!(drift_of(&more), vec![offer_drift("changed")], "offered to one more by hand");
        let archived = PoolDoc { archived: true, ..offered.clone() };
        let drift = drift_of(&archived);
        assert!(drift.contains(&offer_drift("deleted")), "{drift:?}");

        let mut silent = doc;
        silent.pools.get_mut(P1).unwrap().offered_to = None;
        let applied = applied_with(&silent, &offered);
        assert_eq!(applied.id_of(OBJECT_OFFER, P1), None);
        let live = FleetLive { pools: vec![withdrawn], applied: Some(applied), ..Default::default() };
        assert_eq!(fleet_drift(&live), vec![], "offers the document leaves alone do not drift");
    }

    /// The export of a fleet plans empty against it, and the same inputs give the same hash.
    #[test]
    fn an_export_plans_empty_and_a_plan_hashes_the_same_twice() {
        let live = FleetLive { pools: vec![pool(P1, "a", 1)], ..Default::default() };
        let doc = fleet_export(&live);
        let plan = fleet_plan(&live, &doc, true);
        assert!(plan.changes.is_empty() && plan.blocked.is_empty(), "{plan:?}");
        assert_eq!(plan.plan_hash, fleet_plan(&live, &doc, true).plan_hash);
        // Another version read is another hash, though the changes are the same (none).
        let moved = FleetLive { pools: vec![pool(P1, "a", 2)], ..Default::default() };
        assert_ne!(fleet_plan(&moved, &doc, true).plan_hash, plan.plan_hash);
        // So is the prune flag.
        assert_ne!(fleet_plan(&live, &doc, false).plan_hash, plan.plan_hash);
    }

    /// A rename keeps the object (its key is its id); a new key creates; prune archives what the
    /// document leaves out, and without prune it is left alone.
    #[test]
    fn renames_update_new_keys_create_and_only_prune_deletes() {
        let live =
            FleetLive { pools: vec![pool(P1, "a", 3), pool("pool_01hzz0000000000000000000p2", "b", 1)], ..Default::default() };
        let mut doc = FleetDocument::empty();
        doc.pools.insert(P1.into(), want("a-renamed"));
        doc.pools.insert("gpu-c".into(), FleetPool { quota_gpus: Some(4), ..want("c") });
        let plan = fleet_plan(&live, &doc, false);
        let ops: Vec<(Op, &str, &str)> = plan.changes.iter().map(|c| (c.op, c.kind, c.key.as_str())).collect();
        assert_eq!(
            ops,
            vec![(Op::Create, OBJECT_POOL, "gpu-c"), (Op::Create, OBJECT_QUOTA, "gpu-c"), (Op::Update, OBJECT_POOL, P1)]
        );
        assert_eq!(plan.changes[2].expects, Some(3));
        assert_eq!(plan.unmanaged.len(), 1);
        let pruned = fleet_plan(&live, &doc, true);
        assert_eq!(pruned.changes.last().map(|c| (c.op, c.key.as_str())), Some((Op::Delete, "pool_01hzz0000000000000000000p2")));
    }

    /// The bounds the objects' own creates enforce hold for a plan too: a pool's 65th flavor is
    /// BLOCKED, the 64th is not.
    #[test]
    fn a_plan_past_a_pools_flavors_is_blocked() {
        let live = FleetLive { pools: vec![pool(P1, "a", 1)], ..Default::default() };
        let mut doc = fleet_export(&live);
        for n in 0..FLAVORS_PER_POOL_MAX {
            let name = format!("f{n}");
            doc.flavors
                .insert(name.clone(), FleetFlavor { pool: P1.into(), name, vcpus: 1, memory_mib: 1024, disk_gib: 10, gpus: 0 });
        }
        assert!(fleet_plan(&live, &doc, false).blocked.is_empty());
        doc.flavors.insert(
            "one-more".into(),
            FleetFlavor { pool: P1.into(), name: "one-more".into(), vcpus: 1, memory_mib: 1024, disk_gib: 10, gpus: 0 },
        );
        let plan = fleet_plan(&live, &doc, false);
        assert_eq!(plan.blocked.len(), 1, "{:?}", plan.blocked);
        assert!(plan.blocked[0].reason.contains("65 flavors"), "{:?}", plan.blocked);
    }

    /// What cannot be made in place is BLOCKED: a dangling pool name, an id that names nothing,
    /// an archived pool, a flavor whose pool changed.
    #[test]
    fn dangling_names_missing_ids_archived_pools_and_changed_flavors_are_blocked() {
        let mut archived = pool(P1, "a", 2);
        archived.archived = true;
        let live = FleetLive { pools: vec![archived], ..Default::default() };
        let mut doc = FleetDocument::empty();
        doc.pools.insert(P1.into(), want("a"));
        doc.pools.insert("pool_01hzz0000000000000000000p9".into(), want("gone"));
        doc.flavors.insert(
            "f".into(),
            FleetFlavor { pool: "nowhere".into(), name: "f".into(), vcpus: 1, memory_mib: 1024, disk_gib: 10, gpus: 0 },
        );
        let plan = fleet_plan(&live, &doc, false);
        let reasons: Vec<&str> = plan.blocked.iter().map(|b| b.reason.as_str()).collect();
        assert!(reasons.iter().any(|r| r.contains("dangling reference")), "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("does not exist")), "{reasons:?}");
        assert!(reasons.iter().any(|r| r.contains("archived")), "{reasons:?}");

        let flavor = flavor_doc(1);
        let live = FleetLive {
            pools: vec![pool(P1, "a", 1), pool("pool_01hzz0000000000000000000p2", "b", 1)],
            flavors: vec![flavor.clone()],
            ..Default::default()
        };
        let mut doc = fleet_export(&live);
        doc.flavors.get_mut(&flavor.flavor_id).unwrap().pool = "pool_01hzz0000000000000000000p2".into();
        let plan = fleet_plan(&live, &doc, false);
        assert_eq!(plan.blocked.len(), 1, "{plan:?}");
        assert!(plan.blocked[0].reason.contains("a flavor's pool cannot change in place"), "{:?}", plan.blocked);
    }

    /// A flavor's name and shape change in place: one `flavors.update` with the fields that
    /// changed, at the version read.
    #[test]
    fn a_flavors_shape_is_an_update_in_place() {
        let flavor = flavor_doc(4);
        let live = FleetLive { pools: vec![pool(P1, "a", 1)], flavors: vec![flavor.clone()], ..Default::default() };
        let mut doc = fleet_export(&live);
        let want = doc.flavors.get_mut(&flavor.flavor_id).unwrap();
        want.vcpus = 2;
        want.name = "f-large".into();
        let plan = fleet_plan(&live, &doc, false);
        assert!(plan.blocked.is_empty(), "{:?}", plan.blocked);
        assert_eq!(plan.changes.len(), 1);
        let change = &plan.changes[0];
        assert_eq!((change.op, change.kind, change.expects), (Op::Update, OBJECT_FLAVOR, Some(4)));
        assert_eq!(change.call(), ("flavors.update", "compute:flavors:write"));
        let fields: Vec<(&str, &Value, &Value)> = change.fields.iter().map(|(k, f)| (k.as_str(), &f.from, &f.to)).collect();
        assert_eq!(fields, vec![("name", &json!("f"), &json!("f-large")), ("vcpus", &json!(1), &json!(2))]);
    }

    /// An image's channel moves forward in place (`images.promote`) and never back; a new image
    /// that the document says is stable is registered and promoted.
    #[test]
    fn an_image_is_promoted_by_the_document_and_never_demoted() {
        let image = ImageDoc {
            tenant_id: "ten_x".into(),
            image_id: "img_01hzz0000000000000000000i1".into(),
            name: "ubuntu".into(),
            url: "https://images.example/u.qcow2".into(),
            sha256: "ab".repeat(32),
            disk_format: bc_projections::events::DiskFormat::Qcow2,
            size_bytes: None,
            channel: ImageChannel::Testing,
            version: 1,
            created_at_ms: 0,
        };
        let live = FleetLive { images: vec![image.clone()], ..Default::default() };
        let mut doc = fleet_export(&live);
        assert_eq!(doc.images[&image.image_id].channel, Some(ImageChannelView::Testing), "the export says the channel");
        assert!(fleet_plan(&live, &doc, false).changes.is_empty());
        doc.images.get_mut(&image.image_id).unwrap().channel = None;
        assert!(fleet_plan(&live, &doc, false).changes.is_empty(), "no channel: left alone");
        doc.images.get_mut(&image.image_id).unwrap().channel = Some(ImageChannelView::Stable);
        let plan = fleet_plan(&live, &doc, false);
        assert_eq!(plan.changes.len(), 1, "{plan:?}");
        assert_eq!((plan.changes[0].op, plan.changes[0].call().0), (Op::Update, "images.promote"));

        let stable =
            FleetLive { images: vec![ImageDoc { channel: ImageChannel::Stable, ..image.clone() }], ..Default::default() };
        doc.images.get_mut(&image.image_id).unwrap().channel = Some(ImageChannelView::Testing);
        let plan = fleet_plan(&stable, &doc, false);
        assert!(plan.blocked.iter().any(|b| b.reason.contains("never demoted")), "{plan:?}");

        let mut new = FleetDocument::empty();
        new.images.insert("debian".into(), FleetImage { name: "debian".into(), ..doc.images[&image.image_id].clone() });
        new.images.get_mut("debian").unwrap().channel = Some(ImageChannelView::Stable);
        let plan = fleet_plan(&FleetLive::default(), &new, false);
        assert_eq!(plan.changes.len(), 1);
        assert_eq!(plan.changes[0].op, Op::Create);
        assert_eq!(plan.changes[0].fields["channel"].to, json!("stable"));
    }
}
