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

use bc_core::id::{PoolId, ReservationId, TenantId};
use bc_core::store::{ExpectedVersion, NewEvent, PreReadQuery};
use bc_core::{Error, ErrorCode, Result};
use bc_projections::events as ev;
use bc_projections::placement::{self, Ask, RESERVATION_GPUS_MAX, SELECTOR_BYTES_MAX, Selector};
use bc_projections::{
    ACTIVE, KIND_POOL, KIND_QUOTA, KIND_RESERVATION, KIND_RESERVATION_LIVE, PoolDoc, QUEUED, QuotaDoc, RESERVATION_STATES,
    ReservationDoc, stream_of,
};
use schemars::JsonSchema;
use serde::Deserialize;

use super::pools::pool_doc;
use super::toolkit::{
    CursorText, LimitNumber, Page, PoolIdText, ReservationIdText, TenantIdText, VersionNumber, doc, list_rows, parse_id,
    stream_id,
};
use super::views::ReservationView;
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:reservations:read");
const WRITE: Access = Access::Action("compute:reservations:write");

/// Tolerations one request may carry.
pub const TOLERATIONS_MAX: usize = 16;
/// The longest duration a request may name before its pool's own maximum is applied: a year.
pub const DURATION_S_MAX: i64 = 366 * 24 * 3600;

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

/// A bare word of a request: 1 to 63 of `A-Z a-z 0-9 . _ - /`.
pub(super) struct BareWord;

impl JsonSchema for BareWord {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "BareWord".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9._/-]{1,63}$" })
    }
}

/// The selector language (`bc_projections::placement`). The pattern states a regular subset of
/// it (equality on names and labels, comparisons on numbers); the full grammar also takes `in`
/// and `notin` lists and quoted values.
pub(super) struct SelectorText;

impl JsonSchema for SelectorText {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Selector".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
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
}

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

/// A reservation state, as a filter.
struct ReservationStateText;

impl JsonSchema for ReservationStateText {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ReservationStateFilter".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({ "type": "string", "enum": RESERVATION_STATES })
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "Option<ReservationStateText>")]
    state: Option<String>,
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

/// A checked ask: what `create` and `preview` place.
pub(super) struct Checked {
    pub(super) tenant: TenantId,
    pub(super) pool: PoolDoc,
    pub(super) gpus: u32,
    pub(super) duration_s: u64,
    pub(super) selector_text: String,
    pub(super) selector: Selector,
    pub(super) nvlink: bool,
    pub(super) tolerations: Vec<String>,
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
    if !(1..=DURATION_S_MAX).contains(&input.duration_s) {
        return Err(Error::invalid(format!("durationS must be 1 second to {DURATION_S_MAX} (a year), not {}", input.duration_s)));
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
    let pool = pool_doc(call, tenant, &pool_id.to_string()).await?;
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
    call.row(tenant, KIND_RESERVATION, &id.to_string(), "reservation").await
}

/// What the queue and the quota need of a tenant's live reservations in one pool.
#[derive(Default)]
pub(super) struct PoolLoad {
    /// Queued reservations by request order: (request seq, id).
    pub(super) queued: Vec<(u64, String)>,
    pub(super) queued_gpus: u32,
    /// GPUs of queued and active reservations: what the quota counts.
    pub(super) gpus: u32,
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
    fn position(&self, rsv: &ReservationDoc) -> Option<u32> {
        (rsv.state == QUEUED).then(|| self.queued.partition_point(|(seq, _)| *seq < rsv.request_seq) as u32 + 1)
    }
}

/// The pools' loads, from this process's view of the log (no scan of the rows).
pub(super) async fn loads(call: &Call<'_>, tenant: TenantId) -> Result<BTreeMap<String, PoolLoad>> {
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

pub(super) async fn pool_load(call: &Call<'_>, tenant: TenantId, pool: &str) -> Result<PoolLoad> {
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
async fn view_of(call: &Call<'_>, tenant: TenantId, rsv: ReservationDoc) -> Result<ReservationView> {
    let position = if rsv.state == QUEUED { pool_load(call, tenant, &rsv.pool_id).await?.position(&rsv) } else { None };
    Ok(ReservationView::of(rsv, position))
}

async fn reservations_create(call: &Call<'_>, input: AskInput) -> Result<ReservationView> {
    let store = &*call.state.store;
    let now_ms = call.now_ms();
    let c = check_ask(call, input).await?;
    let tenant = c.tenant;
    let pool_id = c.pool.pool_id.clone();
    // A retry of a request already made is answered from the log (the append below replays
    // it), whatever the quota or the queue say now.
    let retry = match &call.idempotency_key {
        Some(key) => {
            let query = PreReadQuery { idempotency_keys: vec![(tenant, format!("request:{key}"))], ..Default::default() };
            !store.preread(&query).await?.idempotency.is_empty()
        }
        None => false,
    };
    let quota: Option<QuotaDoc> = store.row_get(&tenant.to_string(), KIND_QUOTA, &pool_id).await?.map(doc).transpose()?;
    let rsv = ReservationId::from_ulid(call.ulid());
    let rsv_text = rsv.to_string();
    let ask = Ask { gpus: c.gpus, selector: &c.selector, nvlink: c.nvlink, tolerations: &c.tolerations };
    let fleet = &call.state.fleet;
    // One look at this process's view decides the quota, the queue and the placement together,
    // and holds the GPUs and the reservation in the view until the append is done, so
    // concurrent requests to this process count them.
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
            match call.state.log.append(request).await {
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
    let id: ReservationId = parse_id("reservationId", stream_id(&result.events[0].envelope.stream))?;
    let mut view = view_of(call, tenant, rsv_doc(call, tenant, &id).await?).await?;
    view.replayed = Some(result.replayed);
    Ok(view)
}

async fn reservations_get(call: &Call<'_>, input: ReservationRef) -> Result<ReservationView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
    view_of(call, tenant, rsv_doc(call, tenant, &id).await?).await
}

async fn reservations_list(call: &Call<'_>, input: ReservationsList) -> Result<Page<ReservationView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
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
    let state = input.state.clone();
    list_rows(call, tenant, kind, input.limit, input.cursor.as_deref(), |row| {
        let rsv: ReservationDoc = doc(row)?;
        let wanted = state.as_ref().is_none_or(|s| *s == rsv.state) && pool.as_ref().is_none_or(|p| *p == rsv.pool_id);
        Ok(wanted.then(|| {
            let position = loads.get(&rsv.pool_id).and_then(|l| l.position(&rsv));
            ReservationView::of(rsv, position)
        }))
    })
    .await
}

async fn reservations_extend(call: &Call<'_>, input: ReservationsExtend) -> Result<ReservationView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
    if !(1..=DURATION_S_MAX).contains(&input.by_s) {
        return Err(Error::invalid(format!("byS must be 1 second to {DURATION_S_MAX} (a year), not {}", input.by_s)));
    }
    let rsv = rsv_doc(call, tenant, &id).await?;
    check_version(&rsv, input.if_version)?;
    if rsv.state != ACTIVE {
        return Err(Error::InvalidArgument {
            message: format!("reservation {id} is {}: only an active reservation is extended", rsv.state),
            hint: None,
        });
    }
    let pool = pool_doc(call, tenant, &rsv.pool_id).await?;
    let started = rsv.activated_at_ms.unwrap_or(rsv.requested_at_ms);
    let ends = rsv.ends_at_ms.unwrap_or(started).saturating_add((input.by_s as u64).saturating_mul(1000));
    if ends.saturating_sub(started) > pool.max_reservation_s.saturating_mul(1000) {
        return Err(Error::InvalidArgument {
            message: format!("extending by {} s goes past the pool's maximum of {} s", input.by_s, pool.max_reservation_s),
            hint: None,
        });
    }
    let expected = ExpectedVersion::Exact(rsv.version);
    let payload = ev::to_cbor(&ev::ReservationExtended { ends_at_ms: ends })?;
    call.append(tenant, stream_of(KIND_RESERVATION, &id), expected, ev::RESERVATION_EXTENDED, payload).await?;
    Ok(ReservationView::of(rsv_doc(call, tenant, &id).await?, None))
}

async fn reservations_release(call: &Call<'_>, input: ReservationRef) -> Result<ReservationView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: ReservationId = parse_id("reservationId", &input.reservation_id)?;
    let rsv = rsv_doc(call, tenant, &id).await?;
    check_version(&rsv, input.if_version)?;
    let expected = ExpectedVersion::Exact(rsv.version);
    let stream = stream_of(KIND_RESERVATION, &id);
    match rsv.state.as_str() {
        QUEUED => {
            call.append(tenant, stream, expected, ev::RESERVATION_CANCELLED, ev::to_cbor(&ev::ReservationEnded {})?).await?;
        }
        ACTIVE => {
            let node = rsv.node_id.as_deref().ok_or_else(|| Error::Internal("active reservation without a node".into()))?;
            let (events, guard) = placement::ending(&id.to_string(), node, ev::RESERVATION_RELEASED)?;
            let mut request = call.request(tenant, stream, expected, events);
            request.guards = vec![guard];
            call.state.log.append(request).await?;
        }
        // Already over: releasing again changes nothing.
        _ => {}
    }
    Ok(ReservationView::of(rsv_doc(call, tenant, &id).await?, None))
}
