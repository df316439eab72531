//! `reservations.*`, `capacity.*`, `quotas.*` and the node operations that change what can be
//! placed (`nodes.cordon/uncordon/drain/label/taint`).
//!
//! A reservation is placed at once when nothing is queued ahead of it in its pool and a node
//! fits; otherwise it is queued, and the `reservations` reconciler activates it. **Queue rule**:
//! FIFO per pool by request order, strictly: the reconciler activates queued reservations
//! oldest first and stops at the first that does not fit, so a large request is never overtaken
//! by smaller ones; a new request is placed at once only when nothing is queued in its pool.
//!
//! Placement never double-books: activating appends to the reservation's stream and, in the same
//! append, `node.allocated` to the node's stream at the version placement read (see
//! `bc_projections::placement`). A placement that lost a race (CONFLICT) is queued instead.

use std::collections::BTreeMap;

use bc_core::id::{NodeId, PoolId, ReservationId, TenantId};
use bc_core::store::{ExpectedVersion, NewEvent, PreReadQuery};
use bc_core::{Error, ErrorCode, Result};
use bc_projections::events::{self as ev};
use bc_projections::placement::{self, Ask, RESERVATION_GPUS_MAX, Selector};
use bc_projections::{
    ACTIVE, KIND_NODE, KIND_POOL, KIND_QUOTA, KIND_RESERVATION, KIND_RESERVATION_LIVE, NodeDoc, PoolDoc, QUEUED, QuotaDoc,
    RESERVATION_STATES, ReservationDoc, stream_of,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::methods::{Call, doc, opt_tenant, parse, parse_id};

/// Tolerations one request may carry.
pub const TOLERATIONS_MAX: usize = 16;
/// Labels or taints one call may set or remove.
pub const KEY_CHANGES_MAX: usize = 64;

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AskInput {
    tenant_id: Option<String>,
    pool_id: String,
    gpus: i64,
    duration_s: i64,
    #[serde(default)]
    selector: String,
    #[serde(default)]
    nvlink: bool,
    model: Option<String>,
    product: Option<String>,
    #[serde(default)]
    tolerations: Vec<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RsvRef {
    tenant_id: Option<String>,
    reservation_id: String,
    if_version: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Extend {
    tenant_id: Option<String>,
    reservation_id: String,
    by_s: i64,
    if_version: Option<u64>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RsvList {
    tenant_id: Option<String>,
    state: Option<String>,
    pool_id: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolOnly {
    tenant_id: Option<String>,
    pool_id: Option<String>,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct QuotaSetInput {
    tenant_id: Option<String>,
    pool_id: String,
    gpus: i64,
}

#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NodeOp {
    tenant_id: Option<String>,
    node_id: String,
    if_version: Option<u64>,
    #[serde(default)]
    set: BTreeMap<String, String>,
    #[serde(default)]
    remove: Vec<String>,
}

/// A checked ask: what `create` and `preview` place.
struct Checked {
    tenant: TenantId,
    pool: PoolDoc,
    gpus: u32,
    duration_s: u64,
    selector_text: String,
    selector: Selector,
    nvlink: bool,
    tolerations: Vec<String>,
}

fn bare_word(field: &str, value: &str) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if !ok {
        return Err(Error::invalid(format!(
            "{field} {:?} must be 1 to 63 of A-Z a-z 0-9 . _ - /",
            bc_core::id::truncate(value, 70)
        )));
    }
    Ok(())
}

async fn check_ask(call: &Call<'_>, input: AskInput) -> Result<Checked> {
    let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
    let pool_id: PoolId = parse_id("poolId", &input.pool_id)?;
    if !(1..=i64::from(RESERVATION_GPUS_MAX)).contains(&input.gpus) {
        return Err(Error::invalid(format!("gpus must be 1 to {RESERVATION_GPUS_MAX}, not {}", input.gpus)));
    }
    if input.duration_s < 1 {
        return Err(Error::invalid(format!("durationS must be at least 1 second, not {}", input.duration_s)));
    }
    let mut parts = Vec::new();
    if !input.selector.trim().is_empty() {
        Selector::parse(&input.selector)?;
        parts.push(input.selector.trim().to_owned());
    }
    if let Some(model) = &input.model {
        bare_word("model", model)?;
        parts.push(format!("gpuModel = {model}"));
    }
    if let Some(product) = &input.product {
        bare_word("product", product)?;
        parts.push(format!("gpuProduct = {product}"));
    }
    let selector_text = parts.join(", ");
    let selector = Selector::parse(&selector_text)?;
    if input.tolerations.len() > TOLERATIONS_MAX {
        return Err(Error::invalid(format!("at most {TOLERATIONS_MAX} tolerations")));
    }
    for t in &input.tolerations {
        bare_word("toleration", t)?;
    }
    let pool: PoolDoc = doc(call
        .state
        .store
        .row_get(&tenant.to_string(), KIND_POOL, &pool_id.to_string())
        .await?
        .ok_or_else(|| Error::not_found(format!("pool {pool_id}")))?)?;
    if pool.archived {
        return Err(Error::invalid(format!("pool {pool_id} is archived")));
    }
    let duration_s = input.duration_s as u64;
    if duration_s > pool.max_reservation_s {
        return Err(Error::InvalidArgument {
            message: format!("durationS {duration_s} is past the pool's maximum of {} s", pool.max_reservation_s),
            hint: Some("ask for a shorter reservation and extend it later, within the maximum".into()),
        });
    }
    Ok(Checked {
        tenant,
        pool,
        gpus: input.gpus as u32,
        duration_s,
        selector_text,
        selector,
        nvlink: input.nvlink,
        tolerations: input.tolerations,
    })
}

async fn rsv_doc(call: &Call<'_>, tenant: TenantId, id: &ReservationId) -> Result<ReservationDoc> {
    let row = call.state.store.row_get(&tenant.to_string(), KIND_RESERVATION, &id.to_string()).await?;
    doc(row.ok_or_else(|| Error::not_found(format!("reservation {id}")))?)
}

/// What the queue and the quota need of a tenant's live reservations in one pool.
#[derive(Default)]
struct PoolLoad {
    /// Queued reservations by request order: (request seq, id).
    queued: Vec<(u64, String)>,
    queued_gpus: u32,
    /// GPUs of queued and active reservations: what the quota counts.
    gpus: u32,
}

impl PoolLoad {
    /// The load of these live reservations (all of one pool).
    fn of<'a>(reservations: impl IntoIterator<Item = &'a ReservationDoc>) -> Self {
        let mut load = Self::default();
        for r in reservations {
            load.gpus += r.gpus;
            if r.state == QUEUED {
                load.queued.push((r.request_seq, r.reservation_id.clone()));
                load.queued_gpus += r.gpus;
            }
        }
        load.queued.sort();
        load
    }

    /// 1 for the next in line.
    fn position(&self, rsv: &ReservationDoc) -> Option<usize> {
        (rsv.state == QUEUED).then(|| self.queued.partition_point(|(seq, _)| *seq < rsv.request_seq) + 1)
    }
}

/// The pools' loads, from this process's view of the log (no scan of the rows).
async fn loads(call: &Call<'_>, tenant: TenantId) -> Result<BTreeMap<String, PoolLoad>> {
    call.state
        .fleet
        .with_tenant(&*call.state.store, tenant, |view| {
            let mut by_pool: BTreeMap<&str, Vec<&ReservationDoc>> = BTreeMap::new();
            for r in view.live.values() {
                by_pool.entry(r.pool_id.as_str()).or_default().push(r);
            }
            by_pool.into_iter().map(|(pool, list)| (pool.to_owned(), PoolLoad::of(list))).collect()
        })
        .await
}

async fn pool_load(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<PoolLoad> {
    call.state
        .fleet
        .with_tenant(&*call.state.store, tenant, |view| PoolLoad::of(view.live.values().filter(|r| r.pool_id == pool)))
        .await
}

/// `--if-version`: the reservation must be at the version the caller read, and the handler
/// decides on that same version (a transition checked on one version and appended on another
/// could cancel an active reservation without freeing its GPUs).
fn check_version(rsv: &ReservationDoc, if_version: Option<u64>) -> Result<()> {
    match if_version {
        Some(v) if v != rsv.version => Err(Error::Conflict {
            stream: stream_of(KIND_RESERVATION, &rsv.reservation_id),
            expected: v.to_string(),
            actual: rsv.version,
        }),
        _ => Ok(()),
    }
}

/// What `reservations.create` decided on the view.
enum Decision {
    /// No node of the pool could hold it even empty: queued, it would block the pool for good.
    Never,
    OverQuota {
        in_use: u32,
        limit: u32,
    },
    Queue,
    Place(placement::Placement),
}

/// The reservation `create` is about to append, as the view holds it meanwhile (queued ones
/// last in line).
fn pending(tenant: TenantId, id: &str, c: &Checked, active: bool) -> ReservationDoc {
    ReservationDoc {
        tenant_id: tenant.to_string(),
        reservation_id: id.to_owned(),
        pool_id: c.pool.pool_id.clone(),
        gpus: c.gpus,
        duration_s: c.duration_s,
        selector: c.selector_text.clone(),
        nvlink: c.nvlink,
        tolerations: c.tolerations.clone(),
        state: if active { ACTIVE } else { QUEUED }.into(),
        node_id: None,
        gpu_indexes: Vec::new(),
        request_seq: u64::MAX,
        requested_at_ms: 0,
        activated_at_ms: None,
        ends_at_ms: None,
        ended_at_ms: None,
        version: 0,
    }
}

/// The reservation with its place in the queue (1: next) while queued.
fn view(rsv: &ReservationDoc, load: Option<&PoolLoad>) -> Result<Value> {
    let mut v = serde_json::to_value(rsv).map_err(|e| Error::Internal(format!("response: {e}")))?;
    if let Some(position) = load.and_then(|l| l.position(rsv)) {
        v["queuePosition"] = json!(position);
    }
    Ok(v)
}

/// The input type of each method here, for the OpenAPI document.
pub fn input_schema(name: &str, g: &mut schemars::SchemaGenerator) -> Option<schemars::Schema> {
    Some(match name {
        "nodes.cordon" | "nodes.uncordon" | "nodes.drain" | "nodes.label" | "nodes.taint" => g.subschema_for::<NodeOp>(),
        "capacity.get" | "quotas.get" => g.subschema_for::<PoolOnly>(),
        "capacity.preview" | "reservations.create" => g.subschema_for::<AskInput>(),
        "reservations.get" | "reservations.release" => g.subschema_for::<RsvRef>(),
        "reservations.list" => g.subschema_for::<RsvList>(),
        "reservations.extend" => g.subschema_for::<Extend>(),
        "quotas.set" => g.subschema_for::<QuotaSetInput>(),
        _ => return None,
    })
}

pub async fn dispatch(call: &Call<'_>, name: &str, body: &[u8]) -> Result<Value> {
    let store = &*call.state.store;
    let now_ms = call.state.log.clock.now_ms();
    match name {
        "nodes.cordon" | "nodes.uncordon" | "nodes.drain" | "nodes.label" | "nodes.taint" => {
            let input: NodeOp = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let node_id: NodeId = parse_id("nodeId", &input.node_id)?;
            let node: NodeDoc = doc(store
                .row_get(&tenant.to_string(), KIND_NODE, &node_id.to_string())
                .await?
                .ok_or_else(|| Error::not_found(format!("node {node_id}")))?)?;
            let keyed = matches!(name, "nodes.label" | "nodes.taint");
            if keyed {
                if input.set.is_empty() && input.remove.is_empty() {
                    return Err(Error::invalid("nothing to change: give set or remove"));
                }
                if input.set.len() + input.remove.len() > KEY_CHANGES_MAX {
                    return Err(Error::invalid(format!("at most {KEY_CHANGES_MAX} keys per call")));
                }
                crate::methods::validate_labels(&input.set)?;
                for key in &input.remove {
                    crate::methods::validate_labels(&[(key.clone(), String::new())].into())?;
                }
            } else if !input.set.is_empty() || !input.remove.is_empty() {
                return Err(Error::invalid(format!("{name} takes no set or remove")));
            }
            let (event_type, payload) = match name {
                "nodes.cordon" => (ev::NODE_CORDONED, ev::to_cbor(&ev::NodeStateChanged {})?),
                "nodes.uncordon" => (ev::NODE_UNCORDONED, ev::to_cbor(&ev::NodeStateChanged {})?),
                "nodes.drain" => (ev::NODE_DRAINING, ev::to_cbor(&ev::NodeStateChanged {})?),
                "nodes.label" => (ev::NODE_LABELED, ev::to_cbor(&ev::NodeKeysChanged { set: input.set, remove: input.remove })?),
                _ => (ev::NODE_TAINTED, ev::to_cbor(&ev::NodeKeysChanged { set: input.set, remove: input.remove })?),
            };
            let expected = ExpectedVersion::Exact(input.if_version.unwrap_or(node.version));
            call.append(tenant, stream_of(KIND_NODE, &node_id), expected, event_type, payload).await?;
            let row = store.row_get(&tenant.to_string(), KIND_NODE, &node_id.to_string()).await?;
            let mut out = row.ok_or_else(|| Error::not_found("node"))?.doc;
            let held = out["allocations"].as_object().map(|m| m.len()).unwrap_or(0);
            out["drained"] = json!(out["state"] == "draining" && held == 0);
            Ok(out)
        }
        "capacity.get" => {
            let input: PoolOnly = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pools: Vec<PoolDoc> = match &input.pool_id {
                Some(p) => {
                    let id: PoolId = parse_id("poolId", p)?;
                    let row = store.row_get(&tenant.to_string(), KIND_POOL, &id.to_string()).await?;
                    vec![doc(row.ok_or_else(|| Error::not_found(format!("pool {id}")))?)?]
                }
                None => {
                    let rows = store.row_list(&tenant.to_string(), KIND_POOL, None, crate::methods::LIST_LIMIT_MAX).await?;
                    rows.into_iter().map(doc).collect::<Result<Vec<PoolDoc>>>()?.into_iter().filter(|p| !p.archived).collect()
                }
            };
            let loads = loads(call, tenant).await?;
            let mut items = Vec::new();
            for pool in pools {
                let (node_count, (by_model, by_product), [total, free, held, unavailable]) = call
                    .state
                    .fleet
                    .with_pool(store, tenant, &pool.pool_id, |nodes| {
                        let mut by_product: BTreeMap<String, (u32, u32)> = BTreeMap::new();
                        let mut by_model: BTreeMap<String, (u32, u32)> = BTreeMap::new();
                        let mut counts = [0u32; 4];
                        for node in nodes.iter() {
                            let usable = node.state == "ready";
                            for (i, gpu) in node.gpus.iter().enumerate() {
                                let free = !node.allocations.contains_key(&(i as u32)) && usable;
                                for (map, key) in [(&mut by_product, &gpu.product), (&mut by_model, &gpu.model)] {
                                    let entry = map.entry(key.clone()).or_default();
                                    entry.0 += 1;
                                    entry.1 += u32::from(free);
                                }
                                counts[0] += 1;
                                if node.allocations.contains_key(&(i as u32)) {
                                    counts[2] += 1;
                                } else if usable {
                                    counts[1] += 1;
                                } else {
                                    counts[3] += 1;
                                }
                            }
                        }
                        (nodes.len(), (by_model, by_product), counts)
                    })
                    .await?;
                let load = loads.get(&pool.pool_id);
                items.push(json!({
                    "poolId": pool.pool_id,
                    "name": pool.name,
                    "nodes": node_count,
                    "gpus": total,
                    "free": free,
                    "reserved": held,
                    "unavailable": unavailable,
                    "queued": load.map(|l| l.queued.len()).unwrap_or(0),
                    "queuedGpus": load.map(|l| l.queued_gpus).unwrap_or(0),
                    "byModel": by_model.into_iter().map(|(m, (t, f))| json!({ "model": m, "gpus": t, "free": f })).collect::<Vec<_>>(),
                    "byProduct": by_product.into_iter().map(|(p, (t, f))| json!({ "product": p, "gpus": t, "free": f })).collect::<Vec<_>>(),
                    "maxReservationS": pool.max_reservation_s,
                }));
            }
            Ok(json!({ "items": items }))
        }
        "capacity.preview" => {
            let checked = check_ask(call, parse(body)?).await?;
            let ahead = pool_load(call, checked.tenant, &checked.pool.pool_id).await?.queued.len();
            let ask = Ask {
                gpus: checked.gpus,
                selector: &checked.selector,
                nvlink: checked.nvlink,
                tolerations: &checked.tolerations,
            };
            let placed = call
                .state
                .fleet
                .with_pool(store, checked.tenant, &checked.pool.pool_id, |nodes| {
                    let possible = nodes.iter().any(|n| placement::could_fit(n, &ask));
                    (placement::place(nodes.iter().map(|n| &**n), &ask), possible)
                })
                .await?;
            let (placed, possible) = placed;
            Ok(json!({
                "possible": possible,
                "fits": placed.is_some() && ahead == 0,
                "fitsIgnoringQueue": placed.is_some(),
                "queuedAhead": ahead,
                "nodeId": placed.as_ref().map(|p| p.node_id.clone()),
                "gpus": placed.as_ref().map(|p| p.gpus.clone()),
                "selector": checked.selector_text,
            }))
        }
        "reservations.create" => {
            let c = check_ask(call, parse(body)?).await?;
            let tenant = c.tenant;
            let pool_id = c.pool.pool_id.clone();
            // A retry of a request already made is answered from the log (the append below
            // replays it), whatever the quota or the queue say now.
            let retry = match &call.idempotency_key {
                Some(key) => {
                    let query = PreReadQuery { idempotency_keys: vec![(tenant, format!("request:{key}"))], ..Default::default() };
                    !store.preread(&query).await?.idempotency.is_empty()
                }
                None => false,
            };
            let quota: Option<QuotaDoc> = store.row_get(&tenant.to_string(), KIND_QUOTA, &pool_id).await?.map(doc).transpose()?;
            let rsv = ReservationId::generate();
            let rsv_text = rsv.to_string();
            let ask = Ask { gpus: c.gpus, selector: &c.selector, nvlink: c.nvlink, tolerations: &c.tolerations };
            let fleet = &call.state.fleet;
            // One look at this process's view decides the quota, the queue and the placement
            // together, and holds the GPUs and the reservation in the view until the append is
            // done, so concurrent requests to this process count them.
            let decision = fleet
                .with_tenant(store, tenant, |view| {
                    let load = PoolLoad::of(view.live.values().filter(|r| r.pool_id == pool_id));
                    let (in_use, queued_ahead) = (load.gpus, !load.queued.is_empty());
                    if retry {
                        return Decision::Queue;
                    }
                    if !view.pool_nodes(&pool_id).iter().any(|n| placement::could_fit(n, &ask)) {
                        return Decision::Never;
                    }
                    if let Some(q) = &quota
                        && in_use + c.gpus > q.gpus
                    {
                        return Decision::OverQuota { in_use, limit: q.gpus };
                    }
                    let placed = if queued_ahead { None } else { view.place_and_hold(&pool_id, &ask, &rsv_text) };
                    view.live.insert(rsv_text.clone(), pending(tenant, &rsv_text, &c, placed.is_some()));
                    placed.map(Decision::Place).unwrap_or(Decision::Queue)
                })
                .await?;
            // The view reads what it held back from the store once this request is done with it,
            // however it ends.
            let held_node = match &decision {
                Decision::Place(p) => Some(p.node_id.clone()),
                _ => None,
            };
            let reread = bc_projections::fleet::Reread::new(fleet.clone(), tenant, held_node, rsv_text.clone());
            let rsv_stream = stream_of(KIND_RESERVATION, &rsv);
            let requested = NewEvent::new(
                ev::RESERVATION_REQUESTED,
                ev::to_cbor(&ev::ReservationRequested {
                    pool_id: pool_id.clone(),
                    gpus: c.gpus,
                    duration_s: c.duration_s,
                    selector: c.selector_text.clone(),
                    nvlink: c.nvlink,
                    tolerations: c.tolerations.clone(),
                })?,
            );
            let pool_guard = (stream_of(KIND_POOL, &pool_id), ExpectedVersion::Exact(c.pool.version));
            let mut result = None;
            match decision {
                Decision::OverQuota { in_use, limit } => {
                    let refusal = ev::QuotaExceeded { requested: c.gpus, in_use, limit, actor: call.actor() };
                    let events = vec![NewEvent::new(ev::QUOTA_EXCEEDED, ev::to_cbor(&refusal)?)];
                    let mut request = call.request(tenant, stream_of(KIND_QUOTA, &pool_id), ExpectedVersion::Any, events);
                    // The refusal's record is not the request's result: a retry decides again.
                    request.idempotency_key = None;
                    request.fingerprint = None;
                    call.state.log.append(request).await?;
                    return Err(Error::QuotaExceeded(format!(
                        "{} GPUs would take the tenant to {} of its quota of {limit} in pool {pool_id}",
                        c.gpus,
                        in_use + c.gpus,
                    )));
                }
                Decision::Never => {
                    return Err(Error::InvalidArgument {
                        message: format!(
                            "no node in pool {pool_id} could ever hold {} GPUs{}{}",
                            c.gpus,
                            if c.selector_text.is_empty() { String::new() } else { format!(" matching {:?}", c.selector_text) },
                            if c.nvlink { " in one NVLink domain" } else { "" },
                        ),
                        hint: Some("check the selector's values with `capacity`, or ask for fewer GPUs".into()),
                    });
                }
                Decision::Queue => {}
                Decision::Place(p) => {
                    let ends_at_ms = now_ms.saturating_add(c.duration_s.saturating_mul(1000));
                    let (events, node_guard) = placement::activation(&rsv_text, &p, ends_at_ms)?;
                    let events = std::iter::once(requested.clone()).chain(events).collect();
                    let mut request = call.request(tenant, rsv_stream.clone(), ExpectedVersion::NoStream, events);
                    request.guards = vec![node_guard, pool_guard.clone()];
                    let appended = call.state.log.append(request).await;
                    match appended {
                        Ok(r) => result = Some(r),
                        // Lost the node to another placement: queue instead; the reconciler places it.
                        Err(e) if e.code() == ErrorCode::Conflict => {
                            tracing::debug!(reservation = %rsv, error = %e, "placement lost a race; queueing")
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            let result = match result {
                Some(r) => r,
                None => {
                    let mut request = call.request(tenant, rsv_stream, ExpectedVersion::NoStream, vec![requested]);
                    request.guards = vec![pool_guard];
                    call.state.log.append(request).await?
                }
            };
            reread.now().await;
            let id = result.events[0].envelope.stream.split_once('/').map(|(_, id)| id.to_owned()).unwrap_or_default();
            let id: ReservationId = parse_id("reservationId", &id)?;
            let rsv = rsv_doc(call, tenant, &id).await?;
            let load = if rsv.state == QUEUED { Some(pool_load(call, tenant, &rsv.pool_id).await?) } else { None };
            let mut out = view(&rsv, load.as_ref())?;
            out["replayed"] = json!(result.replayed);
            Ok(out)
        }
        "reservations.get" => {
            let input: RsvRef = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
            let rsv = rsv_doc(call, tenant, &id).await?;
            let load = if rsv.state == QUEUED { Some(pool_load(call, tenant, &rsv.pool_id).await?) } else { None };
            view(&rsv, load.as_ref())
        }
        "reservations.list" => {
            let input: RsvList = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            if let Some(state) = &input.state
                && !RESERVATION_STATES.contains(&state.as_str())
            {
                return Err(Error::InvalidArgument {
                    message: format!("state {:?} is not a reservation state", bc_core::id::truncate(state, 40)),
                    hint: Some(RESERVATION_STATES.join(", ")),
                });
            }
            let pool = input.pool_id.as_deref().map(|p| parse_id::<PoolId>("poolId", p)).transpose()?.map(|p| p.to_string());
            // Queued and active reservations have their own rows: no scan of finished ones.
            let kind = match input.state.as_deref() {
                Some(QUEUED) | Some(ACTIVE) => KIND_RESERVATION_LIVE,
                _ => KIND_RESERVATION,
            };
            let loads = loads(call, tenant).await?;
            let list = crate::methods::ListInput::page(input.limit, input.cursor.clone());
            let state = input.state.clone();
            crate::methods::list_rows(call, tenant, kind, &list, |row| {
                let rsv: ReservationDoc = doc(row)?;
                let wanted = state.as_ref().is_none_or(|s| *s == rsv.state) && pool.as_ref().is_none_or(|p| *p == rsv.pool_id);
                wanted.then(|| view(&rsv, loads.get(&rsv.pool_id))).transpose()
            })
            .await
        }
        "reservations.extend" => {
            let input: Extend = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
            if input.by_s < 1 {
                return Err(Error::invalid(format!("byS must be at least 1 second, not {}", input.by_s)));
            }
            let rsv = rsv_doc(call, tenant, &id).await?;
            check_version(&rsv, input.if_version)?;
            if rsv.state != ACTIVE {
                return Err(Error::InvalidArgument {
                    message: format!("reservation {id} is {}: only an active reservation is extended", rsv.state),
                    hint: None,
                });
            }
            let pool: PoolDoc = doc(store
                .row_get(&tenant.to_string(), KIND_POOL, &rsv.pool_id)
                .await?
                .ok_or_else(|| Error::not_found("pool"))?)?;
            let started = rsv.activated_at_ms.unwrap_or(rsv.requested_at_ms);
            let ends = rsv.ends_at_ms.unwrap_or(started).saturating_add((input.by_s as u64).saturating_mul(1000));
            if ends.saturating_sub(started) > pool.max_reservation_s.saturating_mul(1000) {
                return Err(Error::InvalidArgument {
                    message: format!(
                        "extending by {} s goes past the pool's maximum of {} s",
                        input.by_s, pool.max_reservation_s
                    ),
                    hint: None,
                });
            }
            let expected = ExpectedVersion::Exact(rsv.version);
            let payload = ev::to_cbor(&ev::ReservationExtended { ends_at_ms: ends })?;
            call.append(tenant, stream_of(KIND_RESERVATION, &id), expected, ev::RESERVATION_EXTENDED, payload).await?;
            view(&rsv_doc(call, tenant, &id).await?, None)
        }
        "reservations.release" => {
            let input: RsvRef = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
            let rsv = rsv_doc(call, tenant, &id).await?;
            check_version(&rsv, input.if_version)?;
            let expected = ExpectedVersion::Exact(rsv.version);
            let stream = stream_of(KIND_RESERVATION, &id);
            match rsv.state.as_str() {
                QUEUED => {
                    call.append(tenant, stream, expected, ev::RESERVATION_CANCELLED, ev::to_cbor(&ev::ReservationEnded {})?)
                        .await?;
                }
                ACTIVE => {
                    let node =
                        rsv.node_id.as_deref().ok_or_else(|| Error::Internal("active reservation without a node".into()))?;
                    let (events, guard) = placement::ending(&id.to_string(), node, ev::RESERVATION_RELEASED)?;
                    let mut request = call.request(tenant, stream, expected, events);
                    request.guards = vec![guard];
                    call.state.log.append(request).await?;
                }
                // Already over: releasing again changes nothing.
                _ => {}
            }
            view(&rsv_doc(call, tenant, &id).await?, None)
        }
        "quotas.get" => {
            let input: PoolOnly = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pool: PoolId = parse_id("poolId", input.pool_id.as_deref().ok_or_else(|| Error::invalid("poolId is required"))?)?;
            let quota = store.row_get(&tenant.to_string(), KIND_QUOTA, &pool.to_string()).await?;
            let limit = quota.map(doc::<QuotaDoc>).transpose()?.map(|q| q.gpus);
            let in_use = pool_load(call, tenant, &pool.to_string()).await?.gpus;
            Ok(json!({ "tenantId": tenant, "poolId": pool, "gpus": limit, "inUse": in_use }))
        }
        "quotas.set" => {
            let input: QuotaSetInput = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let pool: PoolId = parse_id("poolId", &input.pool_id)?;
            if !(0..=i64::from(u32::MAX)).contains(&input.gpus) {
                return Err(Error::invalid(format!("gpus must be 0 or more, not {}", input.gpus)));
            }
            store
                .row_get(&tenant.to_string(), KIND_POOL, &pool.to_string())
                .await?
                .ok_or_else(|| Error::not_found(format!("pool {pool}")))?;
            let payload = ev::to_cbor(&ev::QuotaSet { gpus: input.gpus as u32 })?;
            call.append(tenant, stream_of(KIND_QUOTA, &pool), ExpectedVersion::Any, ev::QUOTA_SET, payload).await?;
            let row = store.row_get(&tenant.to_string(), KIND_QUOTA, &pool.to_string()).await?;
            Ok(row.ok_or_else(|| Error::not_found("quota"))?.doc)
        }
        _ => Err(Error::not_found(format!("method {name}"))),
    }
}
