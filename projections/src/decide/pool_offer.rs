//! The decisions of `pools.offer` and `pools.unoffer`: a pool's owner lends its capacity to
//! named tenants, who reserve from it under their own quota (`decide::reservation_create_offered`).
//!
//! **What guards what.** An offer is read on the pool's document and every reservation an
//! offered tenant makes guards the pool's stream at the version it read, so a reservation
//! decided on an offer that an unoffer has since withdrawn is a CONFLICT. The other way round,
//! an unoffer guards each withdrawn tenant's quota stream (`quota/pool_…` on its chain) at the
//! version it read, and every reservation of that tenant in the pool moves that stream
//! (`quota.charged`): so a reservation that lands between an unoffer's read and its append
//! makes the unoffer a CONFLICT, and the queued reservations the unoffer cancels are all there
//! are.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::store::{ExpectedVersion, NewEvent};

use super::{Append, Refusal};
use crate::events::{self as ev, to_cbor};
use crate::{KIND_POOL, KIND_POOL_OFFER, KIND_QUOTA, KIND_RESERVATION, PoolDoc, ReservationDoc, ReservationState, stream_of};

/// Tenants one pool may be offered to at once (and named in one call).
pub const OFFERS_PER_POOL_MAX: usize = 64;

/// The appends of an offer or an unoffer, all in one group (`Log::append_group`): `owner` on the
/// pool owner's chain, and one on each named tenant's chain.
#[derive(Clone, Debug, PartialEq)]
pub struct OfferAppends {
    pub owner: Append,
    /// (tenant id, its append).
    pub offered: Vec<(String, Append)>,
}

impl OfferAppends {
    /// Every append, the owner's first, with the tenant whose chain it goes on.
    pub fn into_appends(self, owner_tenant_id: &str) -> Vec<(String, Append)> {
        std::iter::once((owner_tenant_id.to_owned(), self.owner)).chain(self.offered).collect()
    }
}

fn offers(tenant_ids: Vec<String>, owner: Option<&str>) -> Result<NewEvent, Refusal> {
    let p = ev::PoolOffers { tenant_ids, owner_tenant_id: owner.map(str::to_owned) };
    Ok(NewEvent::new(ev::POOL_OFFERED, to_cbor(&p)?))
}

/// `pools.offer`: the tenants not offered the pool yet are offered it (`None`: all already
/// are, nothing to append). Refused for an archived pool, for the owner itself, and past
/// [`OFFERS_PER_POOL_MAX`]. The tenants' existence is the caller's check.
pub fn pool_offer(pool: &PoolDoc, tenant_ids: &BTreeSet<String>) -> Result<Option<OfferAppends>, Refusal> {
    if pool.archived {
        return Err(Refusal::PoolArchived { pool_id: pool.pool_id.clone() });
    }
    if tenant_ids.contains(&pool.tenant_id) {
        return Err(Refusal::OfferInvalid(format!(
            "tenant {} owns pool {}: a pool is offered to other tenants only",
            pool.tenant_id, pool.pool_id
        )));
    }
    let new: Vec<String> = tenant_ids.difference(&pool.offered_to).cloned().collect();
    if new.is_empty() {
        return Ok(None);
    }
    if pool.offered_to.len() + new.len() > OFFERS_PER_POOL_MAX {
        return Err(Refusal::OfferInvalid(format!(
            "pool {} is offered to {} tenants; {} more would pass the limit of {OFFERS_PER_POOL_MAX}",
            pool.pool_id,
            pool.offered_to.len(),
            new.len()
        )));
    }
    let owner = Append {
        stream: stream_of(KIND_POOL, &pool.pool_id),
        expected: ExpectedVersion::Exact(pool.version),
        guards: vec![],
        events: vec![offers(new.clone(), None)?],
    };
    let offered = new
        .into_iter()
        .map(|t| {
            let append = Append {
                stream: stream_of(KIND_POOL_OFFER, &pool.pool_id),
                expected: ExpectedVersion::Any,
                guards: vec![],
                events: vec![offers(vec![t.clone()], Some(&pool.tenant_id))?],
            };
            Ok((t, append))
        })
        .collect::<Result<_, Refusal>>()?;
    Ok(Some(OfferAppends { owner, offered }))
}

/// Why a queued reservation ends at an unoffer.
pub fn unoffered_reason(pool_id: &str, tenant_id: &str) -> String {
    format!("pool {pool_id} is no longer offered to tenant {tenant_id}")
}

/// `pools.unoffer`: the named tenants that are offered the pool are no longer (`None`: none
/// is, nothing to append). Their active reservations run to their end; their queued ones in
/// the pool (`live`: the owner's live reservations) are cancelled in the same append, each at
/// the version read, with the reason. `quota_versions` holds each named tenant's quota stream
/// version in the pool (0 or absent: no stream yet), which each tenant's append guards (see the
/// module's doc).
pub fn pool_unoffer<'a>(
    pool: &PoolDoc,
    tenant_ids: &BTreeSet<String>,
    live: impl IntoIterator<Item = &'a ReservationDoc>,
    quota_versions: &BTreeMap<String, u64>,
) -> Result<Option<OfferAppends>, Refusal> {
    let gone: Vec<String> = tenant_ids.intersection(&pool.offered_to).cloned().collect();
    if gone.is_empty() {
        return Ok(None);
    }
    let payload = |tenant_ids: Vec<String>, owner: Option<&str>| -> Result<NewEvent, Refusal> {
        let p = ev::PoolOffers { tenant_ids, owner_tenant_id: owner.map(str::to_owned) };
        Ok(NewEvent::new(ev::POOL_UNOFFERED, to_cbor(&p)?))
    };
    let mut owner = Append {
        stream: stream_of(KIND_POOL, &pool.pool_id),
        expected: ExpectedVersion::Exact(pool.version),
        guards: vec![],
        events: vec![payload(gone.clone(), None)?],
    };
    for rsv in live {
        let Some(holder) = rsv.holder_tenant_id.as_deref() else {
            continue;
        };
        if rsv.pool_id != pool.pool_id || rsv.state != ReservationState::Queued || !gone.iter().any(|t| t == holder) {
            continue;
        }
        let stream = stream_of(KIND_RESERVATION, &rsv.reservation_id);
        let ended = ev::ReservationEnded { release: None, reason: Some(unoffered_reason(&pool.pool_id, holder)) };
        owner.guards.push((stream.clone(), ExpectedVersion::Exact(rsv.version)));
        owner.events.push(NewEvent {
            stream: Some(stream),
            event_type: ev::RESERVATION_CANCELLED.into(),
            payload: to_cbor(&ended)?,
        });
    }
    let offered = gone
        .into_iter()
        .map(|t| {
            let quota = match quota_versions.get(&t).copied().unwrap_or(0) {
                0 => ExpectedVersion::NoStream,
                v => ExpectedVersion::Exact(v),
            };
            let append = Append {
                stream: stream_of(KIND_POOL_OFFER, &pool.pool_id),
                expected: ExpectedVersion::Any,
                guards: vec![(stream_of(KIND_QUOTA, &pool.pool_id), quota)],
                events: vec![payload(vec![t.clone()], Some(&pool.tenant_id))?],
            };
            Ok((t, append))
        })
        .collect::<Result<_, Refusal>>()?;
    Ok(Some(OfferAppends { owner, offered }))
}
