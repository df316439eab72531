//! `reservations.create` past its checks: the quota, the queue and the placement decided
//! together on this process's view of the fleet (`decide::reservation_create`), appended, and
//! decided again when the quota moved under the decision ([`reservation_create`] states the
//! rule).

use bc_core::id::{CommandId, ReservationId, TenantId};
use bc_core::store::{AppendRequest, AppendResult, PreReadQuery};
use bc_core::{Error, ErrorCode, Result};
use bc_projections::decide::{self, Append, OfferedCreate, ReservationAsk, ReservationCreate};
use bc_projections::fleet::Reread;
use bc_projections::{KIND_NODE, KIND_QUOTA, QuotaDoc, stream_of};

use super::{conflict_on, retry_on_conflict};
use crate::api::Call;
use crate::api::call::doc;

/// Decisions a reservation makes before it gives up on a quota that keeps moving under it (each
/// lost race means another reservation landed, so this bounds a burst, not a livelock).
pub const QUOTA_RACE_ATTEMPTS: u32 = 16;

/// What every attempt of one `reservations.create` decides with: its ids, drawn once, and who
/// asks when.
struct Create<'a> {
    /// The chain the reservation lives on: the pool's owner's.
    tenant: TenantId,
    /// In a pool offered to another tenant: that tenant, who asks, whose quota counts it and
    /// whose chain takes the charge.
    holder: Option<TenantId>,
    ask: &'a ReservationAsk,
    reservation_id: String,
    command_id: String,
    actor: String,
    now_ms: u64,
    /// A retry of a request already made (its idempotency key was used): the append answers it
    /// from the log, whatever the quota or the queue say now.
    replay: bool,
    quota_stream: String,
}

/// `reservations.create` of a checked ask: placed at once, queued, or refused over quota (the
/// refusal's record is appended first, without the request's idempotency key, so a retry
/// decides again). A placement that lost its node to another placement (a CONFLICT on any
/// stream but the quota's) is queued instead; the reconciler places it.
///
/// **Retry rule.** The quota is read as a row and its stream guarded at that version. When
/// another reservation (maybe through another gateway) was charged to the quota between the
/// read and the append, the append is a CONFLICT on the quota's stream: the reservation is
/// decided again on the usage as it is now, up to [`QUOTA_RACE_ATTEMPTS`] decisions in all, the
/// last CONFLICT going back to the caller. Each lost race means another reservation landed, so
/// this bounds a burst. Nothing else is retried.
pub async fn reservation_create(call: &Call<'_>, tenant: TenantId, ask: &ReservationAsk) -> Result<AppendResult> {
    create_in(call, tenant, None, ask).await
}

/// `reservations.create` by `holder` in a pool `owner` offered to it
/// (`decide::reservation_create_offered`): the reservation on the owner's chain and
/// `quota.charged` on the holder's, in one group, so the holder's quota stream, the pool's
/// stream (the offer) and the nodes' streams (the GPUs both tenants share) are all guarded at
/// the versions the decision read, in one transaction. The same retry rule as
/// [`reservation_create`], on the holder's quota stream. The call's idempotency key is kept on
/// the owner's chain as `held:HOLDER:KEY`, apart from the owner's own keys.
pub async fn reservation_create_offered(
    call: &Call<'_>,
    holder: TenantId,
    owner: TenantId,
    ask: &ReservationAsk,
) -> Result<AppendResult> {
    create_in(call, owner, Some(holder), ask).await
}

/// The idempotency key of a holder's request on the owner's chain ([`Call::held_key`]).
fn held_key(call: &Call<'_>, holder: TenantId) -> Option<String> {
    call.held_key(holder)
}

async fn create_in(call: &Call<'_>, tenant: TenantId, holder: Option<TenantId>, ask: &ReservationAsk) -> Result<AppendResult> {
    let now_ms = call.now_ms();
    let replay = match (holder, held_key(call, holder.unwrap_or(tenant))) {
        (Some(_), Some(key)) => {
            let query = PreReadQuery { idempotency_keys: vec![(tenant, key)], ..Default::default() };
            !call.state.store.preread(&query).await?.idempotency.is_empty()
        }
        (Some(_), None) => false,
        (None, _) => call.is_retry(tenant).await?,
    };
    let create = Create {
        tenant,
        holder,
        ask,
        reservation_id: ReservationId::from_ulid(call.ulid()).to_string(),
        actor: call.actor(),
        command_id: CommandId::from_ulid(call.state.log.ids.ulid()).to_string(),
        now_ms,
        replay,
        quota_stream: stream_of(KIND_QUOTA, &ask.pool.pool_id),
    };
    retry_on_conflict(&create.quota_stream, QUOTA_RACE_ATTEMPTS, |_| create_once(call, &create)).await
}

/// One decision on the quota as it is read now, and its append. The view reads again what it
/// held back once this attempt is done with it, however it ends.
async fn create_once(call: &Call<'_>, create: &Create<'_>) -> Result<AppendResult> {
    let store = &*call.state.store;
    // Read before the view catches up, so the view holds at least what this version counts.
    let quota_tenant = create.holder.unwrap_or(create.tenant);
    let quota: Option<QuotaDoc> =
        store.row_get(&quota_tenant.to_string(), KIND_QUOTA, &create.ask.pool.pool_id).await?.map(doc).transpose()?;
    let OfferedCreate { decision, charge } = decide_holding(call, create, quota.as_ref()).await?;
    let held_node = decision.held_node().map(str::to_owned);
    // The node's stream and the version the placement read, to tell the view what landed.
    let placed_at = match &decision {
        ReservationCreate::Place { placement, .. } => Some((stream_of(KIND_NODE, &placement.node_id), placement.node_version)),
        _ => None,
    };
    let reread = Reread::new(call.state.fleet.clone(), create.tenant, held_node, create.reservation_id.clone());
    let (append, if_lost) = match decision {
        ReservationCreate::OverQuota { refusal, record } => {
            let mut request = call.decided(quota_tenant, record);
            // The refusal's record is not the request's result: a retry decides again.
            request.idempotency_key = None;
            request.fingerprint = None;
            call.submit(request).await?;
            return Err(refusal.into());
        }
        ReservationCreate::Queue { append, .. } => (append, None),
        ReservationCreate::Place { append, if_lost, .. } => (append, Some(if_lost)),
    };
    match placed_or_queued(call, create, append, if_lost, charge).await {
        Ok((result, placed)) => {
            // Placed: the view's node takes the version the append gave it.
            let landed = placed_at.as_ref().filter(|_| placed && !result.replayed).and_then(|(stream, read)| {
                let event = result.events.iter().find(|e| e.envelope.stream == *stream)?;
                Some((*read, event.envelope.version))
            });
            match landed {
                Some((read, appended)) => reread.landed(read, appended).await,
                None => reread.now().await,
            }
            Ok(result)
        }
        Err(e) => {
            // The quota moved: the view reads again before the next decision.
            if conflict_on(&e, &create.quota_stream) {
                reread.now().await;
            }
            Err(e)
        }
    }
}

/// One look at this process's view decides the quota, the queue and the placement together,
/// and holds the GPUs and the reservation in the view until the append is done, so concurrent
/// requests to this process count them.
async fn decide_holding(call: &Call<'_>, create: &Create<'_>, quota: Option<&QuotaDoc>) -> Result<OfferedCreate> {
    let input = decide::ReservationCreateInput {
        reservation_id: &create.reservation_id,
        command_id: &create.command_id,
        now_ms: create.now_ms,
        actor: &create.actor,
        replay: create.replay,
    };
    let holder = create.holder.map(|h| h.to_string());
    let decided = call
        .state
        .fleet
        .with_tenant(&*call.state.store, create.tenant, |view| {
            let decision = match &holder {
                Some(tenant_id) => {
                    let held_for = decide::HeldFor { tenant_id };
                    decide::reservation_create_offered(view, quota, create.ask, &input, held_for)
                }
                None => decide::reservation_create(view, quota, create.ask, &input)
                    .map(|decision| OfferedCreate { decision, charge: None }),
            };
            if let Ok(d) = &decision {
                d.decision.hold(view);
            }
            decision
        })
        .await?;
    Ok(decided?)
}

/// Appends `append`; when it placed the reservation and lost the node to another placement (a
/// CONFLICT not on the quota), appends `if_lost` instead, which queues it. Says whether the
/// first append landed.
async fn placed_or_queued(
    call: &Call<'_>,
    create: &Create<'_>,
    append: Append,
    if_lost: Option<Append>,
    charge: Option<Append>,
) -> Result<(AppendResult, bool)> {
    match (submit(call, create, append, charge.clone()).await, if_lost) {
        (Err(e), Some(if_lost)) if e.code() == ErrorCode::Conflict && !conflict_on(&e, &create.quota_stream) => {
            tracing::debug!(reservation = %create.reservation_id, error = %e, "placement lost a race; queueing");
            submit(call, create, if_lost, charge).await.map(|r| (r, false))
        }
        (other, _) => other.map(|r| (r, true)),
    }
}

/// The reservation's append on the owner's chain, with the holder's charge on its chain in the
/// same group when there is one.
async fn submit(call: &Call<'_>, create: &Create<'_>, append: Append, charge: Option<Append>) -> Result<AppendResult> {
    let Some(holder) = create.holder else { return call.submit(call.decided(create.tenant, append)).await };
    let mut request: AppendRequest = call.decided(create.tenant, append);
    request.idempotency_key = held_key(call, holder);
    let Some(charge) = charge else { return call.state.log.append(request).await };
    let mut charged = call.decided(holder, charge);
    charged.idempotency_key = None;
    charged.fingerprint = None;
    let mut results = call.state.log.append_group(vec![request, charged]).await?;
    if results.is_empty() {
        return Err(Error::Internal("a reservation's group of appends answered with nothing".into()));
    }
    Ok(results.swap_remove(0))
}
