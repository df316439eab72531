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
use bc_core::store::{AppendRequest, ExpectedVersion, PreReadQuery};
use bc_core::{Error, ErrorCode, Result};
use bc_projections::decide::{self, Append, PoolLoad, ReservationAsk, ReservationCreate};
use bc_projections::events::{self as ev};
use bc_projections::placement::{RESERVATION_GPUS_MAX, Selector};
use bc_projections::{
    KIND_NODE, KIND_POOL, KIND_QUOTA, KIND_RESERVATION, KIND_RESERVATION_LIVE, NodeDoc, PoolDoc, QuotaDoc, ReservationDoc,
    ReservationState, stream_of,
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
    ask: ReservationAsk,
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
    let ask = ReservationAsk {
        pool,
        gpus: input.gpus as u32,
        duration_s: input.duration_s as u64,
        selector_text,
        selector,
        nvlink: input.nvlink,
        tolerations: input.tolerations,
    };
    Ok(Checked { tenant, ask: ask.check_pool()? })
}

async fn rsv_doc(call: &Call<'_>, tenant: TenantId, id: &ReservationId) -> Result<ReservationDoc> {
    let row = call.state.store.row_get(&tenant.to_string(), KIND_RESERVATION, &id.to_string()).await?;
    doc(row.ok_or_else(|| Error::not_found(format!("reservation {id}")))?)
}

/// The pools' loads, from this process's view of the log (no scan of the rows).
async fn loads(call: &Call<'_>, tenant: TenantId) -> Result<BTreeMap<String, PoolLoad>> {
    call.state.fleet.with_tenant(&*call.state.store, tenant, |view| PoolLoad::by_pool(view)).await
}

async fn pool_load(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<PoolLoad> {
    call.state.fleet.with_tenant(&*call.state.store, tenant, |view| PoolLoad::of_pool(view, pool)).await
}

/// A decision's append on behalf of this call (its key, its request id, its fingerprint).
fn request_of(call: &Call<'_>, tenant: TenantId, append: Append) -> AppendRequest {
    let mut request = call.request(tenant, append.stream, append.expected, append.events);
    request.guards = append.guards;
    request
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
            let items = call
                .state
                .fleet
                .with_tenant(store, tenant, |view| pools.iter().map(|pool| decide::pool_capacity(pool, view)).collect::<Vec<_>>())
                .await?;
            Ok(json!({ "items": items }))
        }
        "capacity.preview" => {
            let checked = check_ask(call, parse(body)?).await?;
            let preview =
                call.state.fleet.with_tenant(store, checked.tenant, |view| decide::capacity_preview(view, &checked.ask)).await?;
            serde_json::to_value(preview).map_err(|e| Error::Internal(format!("response: {e}")))
        }
        "reservations.create" => {
            let Checked { tenant, ask } = check_ask(call, parse(body)?).await?;
            let pool_id = ask.pool.pool_id.clone();
            // A retry of a request already made is answered from the log (the append below
            // replays it), whatever the quota or the queue say now.
            let replay = match &call.idempotency_key {
                Some(key) => {
                    let query = PreReadQuery { idempotency_keys: vec![(tenant, format!("request:{key}"))], ..Default::default() };
                    !store.preread(&query).await?.idempotency.is_empty()
                }
                None => false,
            };
            let quota: Option<QuotaDoc> = store.row_get(&tenant.to_string(), KIND_QUOTA, &pool_id).await?.map(doc).transpose()?;
            let rsv_text = ReservationId::generate().to_string();
            let actor = call.actor();
            let input = decide::ReservationCreateInput { reservation_id: &rsv_text, now_ms, actor: &actor, replay };
            let fleet = &call.state.fleet;
            // One look at this process's view decides the quota, the queue and the placement
            // together, and holds the GPUs and the reservation in the view until the append is
            // done, so concurrent requests to this process count them.
            let decision = fleet
                .with_tenant(store, tenant, |view| {
                    let decision = decide::reservation_create(view, quota.as_ref(), &ask, &input);
                    if let Ok(d) = &decision {
                        d.hold(view);
                    }
                    decision
                })
                .await??;
            // The view reads what it held back from the store once this request is done with it,
            // however it ends.
            let held_node = decision.held_node().map(str::to_owned);
            let reread = bc_projections::fleet::Reread::new(fleet.clone(), tenant, held_node, rsv_text.clone());
            let (append, if_lost) = match decision {
                ReservationCreate::OverQuota { refusal, record } => {
                    let mut request = request_of(call, tenant, record);
                    // The refusal's record is not the request's result: a retry decides again.
                    request.idempotency_key = None;
                    request.fingerprint = None;
                    call.state.log.append(request).await?;
                    return Err(refusal.into());
                }
                ReservationCreate::Queue { append, .. } => (append, None),
                ReservationCreate::Place { append, if_lost, .. } => (append, Some(if_lost)),
            };
            let result = match (call.state.log.append(request_of(call, tenant, append)).await, if_lost) {
                (Ok(r), _) => r,
                // Lost the node to another placement: queue instead; the reconciler places it.
                (Err(e), Some(if_lost)) if e.code() == ErrorCode::Conflict => {
                    tracing::debug!(reservation = %rsv_text, error = %e, "placement lost a race; queueing");
                    call.state.log.append(request_of(call, tenant, if_lost)).await?
                }
                (Err(e), _) => return Err(e),
            };
            reread.now().await;
            let id = result.events[0].envelope.stream.split_once('/').map(|(_, id)| id.to_owned()).unwrap_or_default();
            let id: ReservationId = parse_id("reservationId", &id)?;
            let rsv = rsv_doc(call, tenant, &id).await?;
            let load =
                if rsv.state == ReservationState::Queued { Some(pool_load(call, tenant, &rsv.pool_id).await?) } else { None };
            let mut out = view(&rsv, load.as_ref())?;
            out["replayed"] = json!(result.replayed);
            Ok(out)
        }
        "reservations.get" => {
            let input: RsvRef = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
            let rsv = rsv_doc(call, tenant, &id).await?;
            let load =
                if rsv.state == ReservationState::Queued { Some(pool_load(call, tenant, &rsv.pool_id).await?) } else { None };
            view(&rsv, load.as_ref())
        }
        "reservations.list" => {
            let input: RsvList = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let state = input.state.as_deref().map(str::parse::<ReservationState>).transpose()?;
            let pool = input.pool_id.as_deref().map(|p| parse_id::<PoolId>("poolId", p)).transpose()?.map(|p| p.to_string());
            // Queued and active reservations have their own rows: no scan of finished ones.
            let kind = match state {
                Some(s) if s.is_live() => KIND_RESERVATION_LIVE,
                _ => KIND_RESERVATION,
            };
            let loads = loads(call, tenant).await?;
            let list = crate::methods::ListInput::page(input.limit, input.cursor.clone());
            crate::methods::list_rows(call, tenant, kind, &list, |row| {
                let rsv: ReservationDoc = doc(row)?;
                let wanted = state.is_none_or(|s| s == rsv.state) && pool.as_ref().is_none_or(|p| *p == rsv.pool_id);
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
            let pool: PoolDoc = doc(store
                .row_get(&tenant.to_string(), KIND_POOL, &rsv.pool_id)
                .await?
                .ok_or_else(|| Error::not_found("pool"))?)?;
            let append = decide::reservation_extend(&rsv, &pool, input.by_s as u64, input.if_version)?;
            call.state.log.append(request_of(call, tenant, append)).await?;
            view(&rsv_doc(call, tenant, &id).await?, None)
        }
        "reservations.release" => {
            let input: RsvRef = parse(body)?;
            let tenant = call.tenant(opt_tenant(&input.tenant_id)?).await?;
            let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
            let rsv = rsv_doc(call, tenant, &id).await?;
            // None: already over; releasing again changes nothing.
            if let Some(append) = decide::reservation_release(&rsv, input.if_version)? {
                call.state.log.append(request_of(call, tenant, append)).await?;
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
