//! The decisions of `reservations.create`, `.release` and `.extend`.
//!
//! **Queue rule**: FIFO per pool by request order, strictly. A new request is placed at once
//! only when nothing is queued in its pool and a node fits; otherwise it is queued, and the
//! reconciler's [`super::plan`] activates it in its turn.

use bc_core::store::ExpectedVersion;

use super::{Append, Refusal};
use crate::events::{self as ev, to_cbor};
use crate::fleet::FleetIndex;
use crate::placement::{self, Ask, Placement, Preference, Selector};
use crate::{KIND_POOL, KIND_QUOTA, KIND_RESERVATION, PoolDoc, QuotaDoc, ReservationDoc, ReservationState, stream_of};
use bc_core::store::NewEvent;

/// A parsed and checked `reservations.create` / `capacity.preview` request.
#[derive(Clone, Debug)]
pub struct ReservationAsk {
    /// The pool as read: the append guards its version, so a pool archived or changed meanwhile
    /// is a CONFLICT.
    pub pool: PoolDoc,
    pub gpus: u32,
    pub duration_s: u64,
    /// The selector as written (with `--model` / `--product` folded in): what the event keeps.
    pub selector_text: String,
    pub selector: Selector,
    pub nvlink: bool,
    pub tolerations: Vec<String>,
    /// The tenant's live project it is made in, as read: the append on the tenant's own chain
    /// (the request, or in an offered pool the holder's charge) guards its version.
    pub project: Option<super::project::ProjectRef>,
}

impl ReservationAsk {
    /// Refuses an ask the pool does not take: archived, or longer than its maximum.
    pub fn check_pool(self) -> Result<Self, Refusal> {
        if self.pool.archived {
            return Err(Refusal::PoolArchived { pool_id: self.pool.pool_id });
        }
        if self.duration_s > self.pool.max_reservation_s {
            return Err(Refusal::DurationPastPoolMaximum {
                duration_s: self.duration_s,
                max_reservation_s: self.pool.max_reservation_s,
            });
        }
        Ok(self)
    }

    /// What placement is asked.
    pub fn placement_ask(&self) -> Ask<'_> {
        Ask { gpus: self.gpus, selector: &self.selector, nvlink: self.nvlink, tolerations: &self.tolerations }
    }

    /// The `reservation.requested` payload of this ask.
    fn payload(&self) -> ev::ReservationRequested {
        ev::ReservationRequested {
            pool_id: self.pool.pool_id.clone(),
            gpus: self.gpus,
            duration_s: self.duration_s,
            selector: self.selector_text.clone(),
            nvlink: self.nvlink,
            tolerations: self.tolerations.clone(),
            project_id: self.project.as_ref().map(|p| p.project_id.clone()),
        }
    }

    fn requested(&self) -> Result<NewEvent, Refusal> {
        Ok(NewEvent::new(ev::RESERVATION_REQUESTED, to_cbor(&self.payload())?))
    }

    /// The reservation as the view holds it until the append is read back: last in line when
    /// queued (no request seq yet).
    fn pending(&self, reservation_id: &str, state: ReservationState) -> ReservationDoc {
        let (tenant_id, id) = (self.pool.tenant_id.clone(), reservation_id.to_owned());
        ReservationDoc { state, ..ReservationDoc::requested(tenant_id, id, self.payload(), u64::MAX, 0, 0) }
    }
}

/// What `reservations.create` takes besides the state and the ask.
#[derive(Clone, Copy, Debug)]
pub struct ReservationCreateInput<'a> {
    /// The new reservation's id, drawn by the caller.
    pub reservation_id: &'a str,
    /// The id of the `gpu.hold` command a placement on a node with an agent issues, drawn by
    /// the caller (unused otherwise).
    pub command_id: &'a str,
    pub now_ms: u64,
    /// Who asks, for the record of a quota refusal.
    pub actor: &'a str,
    /// The request's idempotency key already has a result: the append replays it, whatever the
    /// quota or the queue say now.
    pub replay: bool,
}

/// What `reservations.create` decided.
#[derive(Clone, Debug, PartialEq)]
pub enum ReservationCreate {
    /// Placed at once: `append` requests and activates it, guarding the node and the pool at
    /// the versions read. If that append is a CONFLICT (a concurrent placement took the node
    /// first), `if_lost` requests it only, queued; the reconciler places it.
    Place { placement: Placement, pending: ReservationDoc, append: Append, if_lost: Append },
    /// Queued (or a replay): `append` requests it, guarding the pool. `pending` is what the
    /// view holds meanwhile; `None` for a replay, which creates nothing.
    Queue { pending: Option<ReservationDoc>, append: Append },
    /// Refused over quota, with a record of the refusal to append first. The record is not the
    /// request's result: it is appended without the request's idempotency key, so a retry
    /// decides again.
    OverQuota { refusal: Refusal, record: Append },
}

impl ReservationCreate {
    /// Holds in the view what the append is about to do (see [`FleetIndex::hold`]).
    pub fn hold(&self, view: &mut FleetIndex) {
        match self {
            Self::Place { placement, pending, .. } => view.hold(pending.clone(), Some(placement)),
            Self::Queue { pending: Some(pending), .. } => view.hold(pending.clone(), None),
            Self::Queue { pending: None, .. } | Self::OverQuota { .. } => {}
        }
    }

    /// The node whose GPUs [`Self::hold`] holds.
    pub fn held_node(&self) -> Option<&str> {
        match self {
            Self::Place { placement, .. } => Some(&placement.node_id),
            _ => None,
        }
    }
}

/// The tightest fit in `pool`, on a node with no placement of this process in flight if one
/// fits (two appends in flight on one node guard the same version: one would conflict), else
/// on any.
fn place_preferring_quiet(view: &FleetIndex, pool_id: &str, ask: &Ask<'_>) -> Option<Placement> {
    let ranked = view.ranked(pool_id, ask.gpus);
    let quiet = ranked.clone().filter(|(_, n)| !view.is_held(&n.node_id));
    placement::place_ranked(quiet, ask, Preference::TightestFit)
        .or_else(|| placement::place_ranked(ranked, ask, Preference::TightestFit))
}

/// `reservations.create`: a replay is queued (its append replays the first result); a request
/// no node of the pool could ever hold is refused; one past the tenant's quota in the pool
/// (live reservations' GPUs plus its own) is refused with a record; otherwise it is placed at
/// once if nothing is queued ahead in its pool and a node fits, else queued.
pub fn reservation_create(
    view: &FleetIndex,
    quota: Option<&QuotaDoc>,
    ask: &ReservationAsk,
    input: &ReservationCreateInput<'_>,
) -> Result<ReservationCreate, Refusal> {
    Ok(create(view, quota, ask, input, None)?.decision)
}

/// The tenant a reservation in an offered pool is held for (`pools.offer`).
#[derive(Clone, Copy, Debug)]
pub struct HeldFor<'a> {
    /// The offered tenant, who asks: its quota in the pool counts the reservation.
    pub tenant_id: &'a str,
}

/// What `reservations.create` decided in a pool another tenant offered: `decision`'s appends go
/// on the pool owner's chain (the reservation, its node, the pool's guard), and `charge` on the
/// holder's (`quota.charged` on its `quota/pool_…`, at the version read), **in one group**
/// (`Log::append_group`), so the holder's quota and the owner's nodes are decided together.
/// `charge` is `None` for a replay and a refusal (whose record goes on the holder's chain).
#[derive(Clone, Debug, PartialEq)]
pub struct OfferedCreate {
    pub decision: ReservationCreate,
    pub charge: Option<Append>,
}

/// `reservations.create` by a tenant the pool was offered to: [`reservation_create`]'s rules
/// (replay, never fits, the FIFO queue, placement) on the owner's view, where the holder's
/// reservations and the owner's share the nodes and the queue; the quota is the holder's own
/// in the pool (`quota` read on its chain), counting only the reservations held for it. An
/// offered tenant with no quota row in the pool has a limit of 0: the pool's owner lends
/// capacity, the root tenant's administrators say how much (`quotas.set`).
pub fn reservation_create_offered(
    view: &FleetIndex,
    quota: Option<&QuotaDoc>,
    ask: &ReservationAsk,
    input: &ReservationCreateInput<'_>,
    held_for: HeldFor<'_>,
) -> Result<OfferedCreate, Refusal> {
    create(view, quota, ask, input, Some(held_for))
}

fn create(
    view: &FleetIndex,
    quota: Option<&QuotaDoc>,
    ask: &ReservationAsk,
    input: &ReservationCreateInput<'_>,
    held_for: Option<HeldFor<'_>>,
) -> Result<OfferedCreate, Refusal> {
    let pool_id = &ask.pool.pool_id;
    let holder = held_for.map(|h| h.tenant_id);
    // The offer is read on the pool's document, whose version the append guards: a pool
    // unoffered meanwhile is a CONFLICT, never a reservation.
    if let Some(tenant_id) = holder
        && !ask.pool.offered_to.contains(tenant_id)
    {
        return Err(Refusal::NotOffered { pool_id: pool_id.clone(), tenant_id: tenant_id.to_owned() });
    }
    let quota_stream = stream_of(KIND_QUOTA, pool_id);
    // The holder's charge, on its own chain: `quota.charged` at the version its quota was read.
    let holder_charge = |charged: bool| -> Result<Option<Append>, Refusal> {
        let (Some(_), Some(q), true) = (holder, quota, charged) else { return Ok(None) };
        let payload = ev::QuotaCharged {
            reservation_id: input.reservation_id.to_owned(),
            gpus: ask.gpus,
            owner_tenant_id: Some(ask.pool.tenant_id.clone()),
        };
        Ok(Some(Append {
            stream: quota_stream.clone(),
            expected: ExpectedVersion::Exact(q.version),
            // The project is the holder's, on its chain: its charge guards it.
            guards: ask.project.iter().map(|p| p.guard()).collect(),
            events: vec![NewEvent::new(ev::QUOTA_CHARGED, to_cbor(&payload)?)],
        }))
    };
    let requested = || -> Result<Vec<NewEvent>, Refusal> {
        let mut events = vec![ask.requested()?];
        if let Some(tenant_id) = holder {
            let held = ev::ReservationHeldFor { tenant_id: tenant_id.to_owned() };
            events.push(NewEvent::new(ev::RESERVATION_HELD_FOR, to_cbor(&held)?));
        }
        Ok(events)
    };
    let pending = |state: ReservationState| ReservationDoc {
        holder_tenant_id: holder.map(str::to_owned),
        ..ask.pending(input.reservation_id, state)
    };
    let rsv_stream = stream_of(KIND_RESERVATION, &input.reservation_id);
    let pool_guard = (stream_of(KIND_POOL, pool_id), ExpectedVersion::Exact(ask.pool.version));
    // On the tenant's own chain the request guards its project (an offered pool's holder
    // guards it with its charge, on its own chain).
    let own_guards: Vec<(String, ExpectedVersion)> =
        std::iter::once(pool_guard.clone()).chain(ask.project.iter().filter(|_| holder.is_none()).map(|p| p.guard())).collect();
    // Under a quota, the request is charged on the quota's stream at the version read, so the
    // usage it was decided on is the usage it lands on, whichever gateway decided it.
    let charge = |guards: &mut Vec<(String, ExpectedVersion)>, events: &mut Vec<NewEvent>| -> Result<(), Refusal> {
        if let (None, Some(q)) = (holder, quota) {
            let stream = stream_of(KIND_QUOTA, pool_id);
            guards.push((stream.clone(), ExpectedVersion::Exact(q.version)));
            let charged =
                ev::QuotaCharged { reservation_id: input.reservation_id.to_owned(), gpus: ask.gpus, owner_tenant_id: None };
            events.push(NewEvent { stream: Some(stream), event_type: ev::QUOTA_CHARGED.into(), payload: to_cbor(&charged)? });
        }
        Ok(())
    };
    // The request alone: what a queued (or replayed) request appends.
    let request_only = |charged: bool| -> Result<Append, Refusal> {
        let (mut guards, mut events) = (own_guards.clone(), requested()?);
        if charged {
            charge(&mut guards, &mut events)?;
        }
        Ok(Append { stream: rsv_stream.clone(), expected: ExpectedVersion::NoStream, guards, events })
    };
    if input.replay {
        // Answered from the first result: nothing is charged again.
        let decision = ReservationCreate::Queue { pending: None, append: request_only(false)? };
        return Ok(OfferedCreate { decision, charge: None });
    }
    let placement_ask = ask.placement_ask();
    if !view.ranked(pool_id, 0).any(|(_, n)| placement::could_fit(n, &placement_ask)) {
        return Err(Refusal::NeverFits {
            pool_id: pool_id.clone(),
            gpus: ask.gpus,
            selector: ask.selector_text.clone(),
            nvlink: ask.nvlink,
        });
    }
    let load = view.pool_load(pool_id);
    let in_use = load.gpus_of(holder);
    // In an offered pool, no quota row is a limit of 0.
    let limit = quota.map(|q| q.gpus).or(holder.map(|_| 0));
    if let Some(limit) = limit
        && in_use.saturating_add(ask.gpus) > limit
    {
        let refusal = Refusal::OverQuota { pool_id: pool_id.clone(), requested: ask.gpus, in_use, limit };
        let record = ev::QuotaExceeded { requested: ask.gpus, in_use, limit, actor: input.actor.to_owned() };
        let record = Append {
            stream: stream_of(KIND_QUOTA, pool_id),
            expected: ExpectedVersion::Any,
            guards: vec![],
            events: vec![NewEvent::new(ev::QUOTA_EXCEEDED, to_cbor(&record)?)],
        };
        return Ok(OfferedCreate { decision: ReservationCreate::OverQuota { refusal, record }, charge: None });
    }
    let placed = if load.queued.is_empty() { place_preferring_quiet(view, pool_id, &placement_ask) } else { None };
    let Some(placement) = placed else {
        let decision = ReservationCreate::Queue { pending: Some(pending(ReservationState::Queued)), append: request_only(true)? };
        return Ok(OfferedCreate { decision, charge: holder_charge(true)? });
    };
    let ends_at_ms = input.now_ms.saturating_add(ask.duration_s.saturating_mul(1000));
    let issue = placement::Issue { command_id: input.command_id, now_ms: input.now_ms };
    let (activation, mut guards) = placement::activation(input.reservation_id, &placement, ends_at_ms, issue)?;
    guards.extend(own_guards.iter().cloned());
    let mut events: Vec<NewEvent> = requested()?.into_iter().chain(activation).collect();
    charge(&mut guards, &mut events)?;
    let append = Append { stream: rsv_stream.clone(), expected: ExpectedVersion::NoStream, guards, events };
    let pending = pending(ReservationState::Active);
    let decision = ReservationCreate::Place { placement, pending, append, if_lost: request_only(true)? };
    Ok(OfferedCreate { decision, charge: holder_charge(true)? })
}

/// `--if-version`: the reservation must be at the version the caller read, and the decision is
/// made on that same version (a transition checked on one version and appended on another
/// could cancel an active reservation without freeing its GPUs).
fn check_version(rsv: &ReservationDoc, if_version: Option<u64>) -> Result<(), Refusal> {
    match if_version {
        Some(expected) if expected != rsv.version => {
            Err(Refusal::VersionMismatch { reservation_id: rsv.reservation_id.clone(), expected, actual: rsv.version })
        }
        _ => Ok(()),
    }
}

/// `reservations.release`: a queued reservation is cancelled, an active one released (its GPUs
/// freed on its node's stream in the same append); one already over needs nothing (`None`:
/// releasing again changes nothing). Guarded at the version read. An active one whose node may
/// hold its GPUs also sends the node `gpu.release`, with `release`'s id.
pub fn reservation_release(
    rsv: &ReservationDoc,
    if_version: Option<u64>,
    release: placement::Issue<'_>,
) -> Result<Option<Append>, Refusal> {
    check_version(rsv, if_version)?;
    let stream = stream_of(KIND_RESERVATION, &rsv.reservation_id);
    let expected = ExpectedVersion::Exact(rsv.version);
    Ok(match rsv.state {
        ReservationState::Queued => Some(Append {
            stream,
            expected,
            guards: vec![],
            events: vec![NewEvent::new(ev::RESERVATION_CANCELLED, to_cbor(&ev::ReservationEnded::default())?)],
        }),
        ReservationState::Active => {
            let node = rsv.node_id.as_deref().ok_or_else(|| Refusal::Internal("active reservation without a node".into()))?;
            let may_hold = rsv.binding.as_ref().is_some_and(crate::Binding::may_hold);
            let ending = placement::ending(&rsv.reservation_id, node, may_hold, placement::Ending::Released, release)?;
            Some(Append::guarded(stream, expected, ending))
        }
        ReservationState::Released | ReservationState::Expired | ReservationState::Cancelled | ReservationState::Failed => None,
    })
}

/// `reservations.extend` by `by_s` seconds (at least 1, checked by the caller): only an active
/// reservation, and never past its pool's maximum counted from its activation.
pub fn reservation_extend(rsv: &ReservationDoc, pool: &PoolDoc, by_s: u64, if_version: Option<u64>) -> Result<Append, Refusal> {
    check_version(rsv, if_version)?;
    if rsv.state != ReservationState::Active {
        return Err(Refusal::NotActive { reservation_id: rsv.reservation_id.clone(), state: rsv.state });
    }
    // A held reservation is extended only while its pool is offered to its holder, read on the
    // pool's document whose version the append guards: an unoffer meanwhile is a CONFLICT.
    let mut guards = vec![];
    if let Some(holder) = &rsv.holder_tenant_id {
        if !pool.offered_to.contains(holder) {
            return Err(Refusal::OfferWithdrawn {
                reservation_id: rsv.reservation_id.clone(),
                pool_id: rsv.pool_id.clone(),
                tenant_id: holder.clone(),
            });
        }
        guards.push((stream_of(KIND_POOL, &pool.pool_id), ExpectedVersion::Exact(pool.version)));
    }
    let started = rsv.activated_at_ms.unwrap_or(rsv.requested_at_ms);
    let ends = rsv.ends_at_ms.unwrap_or(started).saturating_add(by_s.saturating_mul(1000));
    if ends.saturating_sub(started) > pool.max_reservation_s.saturating_mul(1000) {
        return Err(Refusal::ExtendPastPoolMaximum { by_s, max_reservation_s: pool.max_reservation_s });
    }
    Ok(Append {
        stream: stream_of(KIND_RESERVATION, &rsv.reservation_id),
        expected: ExpectedVersion::Exact(rsv.version),
        guards,
        events: vec![NewEvent::new(ev::RESERVATION_EXTENDED, to_cbor(&ev::ReservationExtended { ends_at_ms: ends })?)],
    })
}
