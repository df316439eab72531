//! `reservations.*`: GPUs reserved for a while.
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

use bc_core::id::{PoolId, ProjectId, ReservationId, TenantId};
use bc_core::{Error, Result};
use bc_projections::decide::{self, PoolLoad, ReservationAsk};
use bc_projections::placement::{RESERVATION_GPUS_MAX, SELECTOR_BYTES_MAX, Selector};
use bc_projections::{
    KIND_RESERVATION, KIND_RESERVATION_LIVE, KIND_RESERVATION_REF, ReservationDoc, ReservationRefDoc, ReservationState,
};
use schemars::JsonSchema;
use serde::Deserialize;

use super::body::parse_id;
use super::call::{doc, stream_id};
use super::paging::{Page, list_rows, merge_pages};
use super::pools::{pool_doc, usable_pool};
use super::validate::{CursorText, LimitNumber, PoolIdText, ReservationIdText, TenantIdText, VersionNumber, string_schema};
use super::views::ReservationView;
use super::{Access, Call, Method, method};
use crate::app;

const READ: Access = Access::Action("compute:reservations:read");
const WRITE: Access = Access::Action("compute:reservations:write");

/// Tolerations one request may carry.
pub const TOLERATIONS_MAX: usize = 16;
/// The longest duration a request may name before its pool's own maximum is applied: the
/// longest any pool may allow.
pub const DURATION_S_MAX: i64 = super::pools::MAX_RESERVATION_S_LIMIT as i64;

pub(super) const METHODS: &[Method] = &[
    method!("reservations.create", WRITE, "reserve GPUs: placed at once, or queued", AskInput => ReservationView, reservations_create),
    method!("reservations.get", READ, "one reservation", ReservationRef => ReservationView, reservations_get),
    method!("reservations.list", READ, "a tenant's reservations", ReservationsList => Page<ReservationView>, reservations_list),
    method!(
        "reservations.extend",
        WRITE,
        "move an active reservation's end",
        ReservationsExtend => ReservationView,
        reservations_extend,
    ),
    method!(
        "reservations.release",
        WRITE,
        "end an active reservation, or cancel a queued one",
        ReservationRef => ReservationView,
        reservations_release,
    ),
];

string_schema!(
    /// A bare word of a request: 1 to 63 of `A-Z a-z 0-9 . _ - /`.
    BareWord as "BareWord",
    |_| {
            schemars::json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9._/-]{1,63}$" })
    }
);

string_schema!(
    /// The selector language (`bc_projections::placement`). The pattern states a regular subset of
    /// it (equality on names and labels, comparisons on numbers); the full grammar also takes `in`
    /// and `notin` lists and quoted values.
    SelectorText as "Selector",
    |_| {
            let word = "(gpuModel|gpuProduct|nodeName|label\\.[A-Za-z0-9._/-]{1,40}) ?(=|==|!=) ?[A-Za-z0-9._/-]{1,40}";
            let number = "(vramGiB|nvlinkDomain) ?(=|==|!=|>|>=|<|<=) ?[0-9]{1,6}";
            let clause = format!("({word}|{number})");
            schemars::json_schema!({
                "type": "string",
                "maxLength": SELECTOR_BYTES_MAX,
                "pattern": format!("^({clause}(, ?{clause}){{0,7}})?$"),
                "description": "comma-separated clauses that must all hold for a GPU: ATTR OP VALUE (OP = == != > >= < <=), ATTR in (V, …), ATTR notin (V, …); attributes gpuModel, gpuProduct, vramGiB, nvlinkDomain, node, nodeName, label.KEY",
            })
    }
);

/// What to reserve (`reservations.create`) or preview (`capacity.preview`).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AskInput {
    #[schemars(with = "Option<TenantIdText>")]
    pub(super) tenant_id: Option<String>,
    #[schemars(with = "PoolIdText")]
    pub(super) pool_id: String,
    #[schemars(range(min = 1, max = RESERVATION_GPUS_MAX))]
    pub(super) gpus: i64,
    /// Seconds; at most the pool's `maxReservationS`.
    #[schemars(range(min = 1, max = DURATION_S_MAX))]
    pub(super) duration_s: i64,
    #[serde(default)]
    #[schemars(with = "SelectorText")]
    pub(super) selector: String,
    /// All GPUs from one NVLink domain.
    #[serde(default)]
    pub(super) nvlink: bool,
    /// Shorthand for `gpuModel = MODEL`.
    #[schemars(with = "Option<BareWord>")]
    pub(super) model: Option<String>,
    /// Shorthand for `gpuProduct = PRODUCT`.
    #[schemars(with = "Option<BareWord>")]
    pub(super) product: Option<String>,
    /// Taints of nodes it may be placed on.
    #[serde(default)]
    #[schemars(with = "Vec<BareWord>", length(max = TOLERATIONS_MAX))]
    pub(super) tolerations: Vec<String>,
    /// The asking tenant's live project it is made in (`projects.*`).
    #[schemars(with = "Option<crate::api::validate::ProjectIdText>")]
    pub(super) project_id: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ReservationIdText")]
    reservation_id: String,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationsExtend {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "ReservationIdText")]
    reservation_id: String,
    /// Seconds to add to its end; the whole stays within the pool's `maxReservationS`.
    #[schemars(range(min = 1, max = DURATION_S_MAX))]
    by_s: i64,
    #[schemars(with = "Option<VersionNumber>")]
    if_version: Option<u64>,
}

string_schema!(
    /// A reservation state, as a filter.
    ReservationStateText as "ReservationStateFilter",
    |_| {
            let states: Vec<&str> = ReservationState::ALL.iter().map(|s| s.as_str()).collect();
            schemars::json_schema!({ "type": "string", "enum": states })
    }
);

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "Option<ReservationStateText>")]
    state: Option<String>,
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
    /// Only the reservations made in this project (a filtered page can come back short).
    #[schemars(with = "Option<crate::api::validate::ProjectIdText>")]
    project_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

/// A checked ask: what `create` and `preview` place.
pub(super) struct Checked {
    /// The tenant that asks.
    pub(super) tenant: TenantId,
    /// The pool's owner, on whose chain the reservation lives and whose view places it: the
    /// tenant itself, or another that offered it the pool.
    pub(super) owner: TenantId,
    pub(super) offered: bool,
    pub(super) ask: ReservationAsk,
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

/// Checks an ask: everything the request says on its own first, then the pool it names.
pub(super) async fn check_ask(call: &Call<'_>, input: AskInput) -> Result<Checked> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let pool_id: PoolId = parse_id("poolId", &input.pool_id)?;
    if !(1..=i64::from(RESERVATION_GPUS_MAX)).contains(&input.gpus) {
        return Err(Error::invalid(format!("gpus must be 1 to {RESERVATION_GPUS_MAX}, not {}", input.gpus)));
    }
    if input.duration_s < 1 {
        return Err(Error::invalid(format!("durationS must be at least 1 second, not {}", input.duration_s)));
    }
    if input.duration_s > DURATION_S_MAX {
        return Err(Error::invalid(format!(
            "durationS {} is past the maximum of {DURATION_S_MAX} s (a year); a pool may allow less",
            input.duration_s
        )));
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
    let usable = usable_pool(call, tenant, &pool_id.to_string()).await?;
    let project = match &input.project_id {
        Some(project_id) => Some(super::projects::project_for_work(call, tenant, project_id).await?),
        None => None,
    };
    let ask = ReservationAsk {
        pool: usable.doc,
        gpus: input.gpus as u32,
        duration_s: input.duration_s as u64,
        selector_text,
        selector,
        nvlink: input.nvlink,
        tolerations: input.tolerations,
        project,
    };
    Ok(Checked { tenant, owner: usable.owner, offered: usable.offered, ask: ask.check_pool()? })
}

async fn rsv_doc(call: &Call<'_>, tenant: TenantId, id: &ReservationId) -> Result<ReservationDoc> {
    call.row(tenant, KIND_RESERVATION, &id.to_string(), "reservation").await
}

/// The pools' loads, from this process's view of the log (no scan of the rows).
pub(super) async fn loads(call: &Call<'_>, tenant: TenantId) -> Result<BTreeMap<String, PoolLoad>> {
    call.state.fleet.with_tenant(&*call.state.store, tenant, |view| view.pool_loads().clone()).await
}

/// A queued reservation's place in its pool's queue (1: next), from the view.
async fn position_in_queue(call: &Call<'_>, tenant: TenantId, rsv: &ReservationDoc) -> Result<Option<usize>> {
    call.state.fleet.with_tenant(&*call.state.store, tenant, |view| view.pool_load(&rsv.pool_id).position(rsv)).await
}

/// A decision's append on behalf of this call (its key, its request id, its fingerprint).
/// The place of a queued reservation in its pool's queue (1: next).
fn queue_position(load: Option<&PoolLoad>, rsv: &ReservationDoc) -> Option<u32> {
    load.and_then(|l| l.position(rsv)).map(queue_number)
}

fn queue_number(position: usize) -> u32 {
    u32::try_from(position).unwrap_or(u32::MAX)
}

/// GPUs of the tenant's queued and active reservations in the pool: what its quota counts. In a
/// pool `owner` offered to it, those held for it on the owner's view.
pub(super) async fn gpus_in_use(call: &Call<'_>, tenant: TenantId, owner: TenantId, pool: &str) -> Result<u32> {
    let holder = (owner != tenant).then(|| tenant.to_string());
    call.state.fleet.with_tenant(&*call.state.store, owner, |view| view.pool_load(pool).gpus_of(holder.as_deref())).await
}

/// The reservation with its place in the queue (1: next) while queued.
async fn view_of(call: &Call<'_>, tenant: TenantId, rsv: ReservationDoc) -> Result<ReservationView> {
    let position = if rsv.state == ReservationState::Queued { position_in_queue(call, tenant, &rsv).await? } else { None };
    Ok(ReservationView::of(rsv, position.map(queue_number)))
}

/// Parse, decide (with the quota race's retry: `app::reservations::reservation_create`),
/// answer with the reservation its append wrote.
async fn reservations_create(call: &Call<'_>, input: AskInput) -> Result<ReservationView> {
    let Checked { tenant, owner, offered, ask } = check_ask(call, input).await?;
    let result = if offered {
        app::reservations::reservation_create_offered(call, tenant, owner, &ask).await?
    } else {
        app::reservations::reservation_create(call, tenant, &ask).await?
    };
    let id: ReservationId = parse_id("reservationId", stream_id(&result.events[0].envelope.stream))?;
    let mut view = view_of(call, owner, rsv_doc(call, owner, &id).await?).await?;
    view.replayed = Some(result.replayed);
    Ok(view)
}

/// Where `tenant`'s reservation lives: on its own chain, or, held for it in a pool another
/// tenant offered (`reservation_ref/rsv_…`, from its `quota.charged`), on that owner's chain.
async fn locate(call: &Call<'_>, tenant: TenantId, id: &ReservationId) -> Result<(TenantId, ReservationDoc)> {
    let store = &call.state.store;
    if let Some(row) = store.row_get(&tenant.to_string(), KIND_RESERVATION, &id.to_string()).await? {
        return Ok((tenant, doc(row)?));
    }
    if let Some(row) = store.row_get(&tenant.to_string(), KIND_RESERVATION_REF, &id.to_string()).await? {
        let held: ReservationRefDoc = doc(row)?;
        let owner: TenantId = parse_id("tenantId", &held.owner_tenant_id)?;
        let rsv = rsv_doc(call, owner, id).await?;
        if rsv.holder_tenant_id.as_deref() == Some(tenant.to_string().as_str()) {
            return Ok((owner, rsv));
        }
    }
    Err(Error::not_found(format!("reservation {id}")))
}

/// A decision's append for `tenant` on `owner`'s chain: a held reservation's key is kept apart
/// from the owner's own (`held:TENANT:KEY`).
fn decided_on(call: &Call<'_>, tenant: TenantId, owner: TenantId, append: decide::Append) -> bc_core::store::AppendRequest {
    let mut request = call.decided(owner, append);
    if owner != tenant {
        request.idempotency_key = call.held_key(tenant);
    }
    request
}

async fn reservations_get(call: &Call<'_>, input: ReservationRef) -> Result<ReservationView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
    let (owner, rsv) = locate(call, tenant, &id).await?;
    view_of(call, owner, rsv).await
}

async fn reservations_list(call: &Call<'_>, input: ReservationsList) -> Result<Page<ReservationView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let state = input.state.as_deref().map(str::parse::<ReservationState>).transpose()?;
    let pool = input.pool_id.as_deref().map(|p| parse_id::<PoolId>("poolId", p)).transpose()?.map(|p| p.to_string());
    let project = super::body::parse_filter::<ProjectId>("projectId", &input.project_id)?;
    // Queued and active reservations have their own rows: no scan of finished ones.
    let kind = match state {
        Some(s) if s.is_live() => KIND_RESERVATION_LIVE,
        _ => KIND_RESERVATION,
    };
    let wanted = |rsv: &ReservationDoc| {
        state.is_none_or(|s| s == rsv.state)
            && pool.as_ref().is_none_or(|p| *p == rsv.pool_id)
            && project.as_ref().is_none_or(|p| rsv.project_id.as_ref() == Some(p))
    };
    let loads = loads(call, tenant).await?;
    let own = list_rows(call, tenant, kind, input.limit, input.cursor.as_deref(), |row| {
        let rsv: ReservationDoc = doc(row)?;
        Ok(wanted(&rsv).then(|| {
            let position = queue_position(loads.get(&rsv.pool_id), &rsv);
            ReservationView::of(rsv, position)
        }))
    })
    .await?;
    // Those held for the tenant in pools other tenants offered, on their owners' chains, merged
    // in by id under the same cursor.
    let refs = list_rows(call, tenant, KIND_RESERVATION_REF, input.limit, input.cursor.as_deref(), |row| {
        Ok(Some(doc::<ReservationRefDoc>(row)?).filter(|r| pool.as_ref().is_none_or(|p| *p == r.pool_id)))
    })
    .await?;
    if refs.items.is_empty() && refs.next_cursor.is_none() {
        return Ok(own);
    }
    let mut owners: BTreeMap<String, BTreeMap<String, PoolLoad>> = BTreeMap::new();
    let mut held = Vec::new();
    for r in refs.items {
        let Ok(owner) = parse_id::<TenantId>("tenantId", &r.owner_tenant_id) else { continue };
        let Some(row) = call.state.store.row_get(&owner.to_string(), KIND_RESERVATION, &r.reservation_id).await? else {
            continue;
        };
        let rsv: ReservationDoc = doc(row)?;
        if rsv.holder_tenant_id.as_deref() != Some(tenant.to_string().as_str()) || !wanted(&rsv) {
            continue;
        }
        if !owners.contains_key(&r.owner_tenant_id) {
            owners.insert(r.owner_tenant_id.clone(), self::loads(call, owner).await?);
        }
        let position = queue_position(owners.get(&r.owner_tenant_id).and_then(|l| l.get(&rsv.pool_id)), &rsv);
        held.push(ReservationView::of(rsv, position));
    }
    merge_pages(own, held, refs.next_cursor, input.limit, |r| r.reservation_id.as_str())
}

async fn reservations_extend(call: &Call<'_>, input: ReservationsExtend) -> Result<ReservationView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
    if !(1..=DURATION_S_MAX).contains(&input.by_s) {
        return Err(Error::invalid(format!("byS must be 1 second to {DURATION_S_MAX} (a year), not {}", input.by_s)));
    }
    let (owner, rsv) = locate(call, tenant, &id).await?;
    let pool = pool_doc(call, owner, &rsv.pool_id).await?;
    let append = decide::reservation_extend(&rsv, &pool, input.by_s as u64, input.if_version)?;
    call.submit(decided_on(call, tenant, owner, append)).await?;
    Ok(ReservationView::of(rsv_doc(call, owner, &id).await?, None))
}

async fn reservations_release(call: &Call<'_>, input: ReservationRef) -> Result<ReservationView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
    let (owner, rsv) = locate(call, tenant, &id).await?;
    let principal = call.principal();
    decide::batch::batch_required(
        call.state.batch_quorum,
        decide::batch::DestructiveScope::ReservationRelease {
            root_caller: principal.is_root(),
            other_tenant: tenant != principal.tenant,
        },
    )?;
    // None: already over; releasing again changes nothing.
    let command_id = bc_core::id::CommandId::from_ulid(call.state.log.ids.ulid()).to_string();
    let release = bc_projections::placement::Issue { command_id: &command_id, now_ms: call.state.log.clock.now_ms() };
    if let Some(append) = decide::reservation_release(&rsv, input.if_version, release)? {
        call.submit(decided_on(call, tenant, owner, append)).await?;
    }
    Ok(ReservationView::of(rsv_doc(call, owner, &id).await?, None))
}
