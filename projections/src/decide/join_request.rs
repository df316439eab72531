//! Join requests (`bcd join --request`, `joinRequests.approve`, `.reject`): what a machine's ask
//! is answered with, and what an operator's decision appends. Pure: the gateway reads the
//! request's document and counts the pending ones, and appends what these say.

use bc_core::id::{JoinRequestId, NodeId, PoolId, TenantId};
use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};

use super::Append;
use crate::events::{self as ev, to_cbor};
use crate::join_request::{JoinRequestDoc, JoinRequestState, KIND_JOIN_REQUEST};
use crate::stream_of;

/// Most join requests pending at once. Anyone may ask, unauthenticated: this bounds what asking
/// can add to the log before an operator decides (a machine asking again adds nothing).
pub const JOIN_REQUESTS_PENDING_MAX: usize = 64;
/// Longest rejection reason, in characters: the machine prints it.
pub const JOIN_REQUEST_REASON_CHARS_MAX: usize = 500;

/// What a machine's ask is answered with.
#[derive(Debug, PartialEq)]
pub enum JoinRequestAnswer {
    /// A new request: append this; the machine is told it is pending.
    Create(Append),
    /// Asked before and not decided yet: wait and ask again.
    Pending,
    /// Approved: the machine joins as this node of this tenant's pool.
    Approved { tenant: TenantId, pool: PoolId, node: NodeId },
    /// Rejected, for this reason: the machine's wait ends.
    Rejected { reason: String },
}

/// The answer to the ask of the machine holding `created.public_key`, whose request is `id`:
/// its request as it stands (`existing`), or a new one while fewer than
/// [`JOIN_REQUESTS_PENDING_MAX`] are pending (`pending`).
pub fn join_request_ask(
    id: JoinRequestId,
    existing: Option<&JoinRequestDoc>,
    created: ev::JoinRequestCreated,
    pending: usize,
) -> Result<JoinRequestAnswer> {
    let Some(doc) = existing else {
        if pending >= JOIN_REQUESTS_PENDING_MAX {
            return Err(Error::QuotaExceeded(format!(
                "{JOIN_REQUESTS_PENDING_MAX} join requests are pending already: an operator must decide some first; ask again later"
            )));
        }
        let event = NewEvent::new(ev::JOIN_REQUEST_CREATED, to_cbor(&created)?);
        return Ok(JoinRequestAnswer::Create(Append {
            stream: stream_of(KIND_JOIN_REQUEST, &id),
            expected: ExpectedVersion::NoStream,
            guards: Vec::new(),
            events: vec![event],
        }));
    };
    if doc.public_key != created.public_key {
        // The id is 128 bits of a hash of the key: another key with it is not a collision to
        // expect, but it is not this machine's request either.
        return Err(Error::AccessDenied(format!("join request {id} is another machine's")));
    }
    match doc.state {
        JoinRequestState::Pending => Ok(JoinRequestAnswer::Pending),
        JoinRequestState::Rejected => Ok(JoinRequestAnswer::Rejected { reason: doc.reason.clone().unwrap_or_default() }),
        JoinRequestState::Approved => {
            let field = |f: &Option<String>, what: &str| {
                f.clone().ok_or_else(|| Error::Internal(format!("approved join request {id} names no {what}")))
            };
            Ok(JoinRequestAnswer::Approved {
                tenant: field(&doc.tenant_id, "tenant")?.parse()?,
                pool: field(&doc.pool_id, "pool")?.parse()?,
                node: field(&doc.node_id, "node")?.parse()?,
            })
        }
    }
}

/// A decided request refuses another decision.
fn pending(doc: &JoinRequestDoc) -> Result<()> {
    if doc.state == JoinRequestState::Pending {
        return Ok(());
    }
    Err(Error::InvalidState {
        message: format!("join request {} is {} already", doc.join_request_id, doc.state.as_str()),
        allowed: Vec::new(),
        hint: Some(
            "a decided request stays decided: the machine asks again with a new key (bcd join --reset --yes --request)".into(),
        ),
    })
}

/// `joinRequests.approve`: the machine joins `tenant`'s pool `pool` as `node` (a new id the
/// caller drew) when it asks next. `expected` is the request's version the caller read (or an
/// `ifVersion` it was checked against).
pub fn join_request_approve(doc: &JoinRequestDoc, tenant: TenantId, pool: PoolId, node: NodeId) -> Result<Append> {
    pending(doc)?;
    let payload = ev::JoinRequestApproved { tenant_id: tenant.to_string(), pool_id: pool.to_string(), node_id: node.to_string() };
    Ok(decided(doc, NewEvent::new(ev::JOIN_REQUEST_APPROVED, to_cbor(&payload)?)))
}

/// `joinRequests.reject`: the machine's wait ends with `reason` (checked at the edge).
pub fn join_request_reject(doc: &JoinRequestDoc, reason: &str) -> Result<Append> {
    pending(doc)?;
    let payload = ev::JoinRequestRejected { reason: reason.to_owned() };
    Ok(decided(doc, NewEvent::new(ev::JOIN_REQUEST_REJECTED, to_cbor(&payload)?)))
}

fn decided(doc: &JoinRequestDoc, event: NewEvent) -> Append {
    Append {
        stream: format!("{KIND_JOIN_REQUEST}/{}", doc.join_request_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards: Vec::new(),
        events: vec![event],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::join_request::join_request_id_of;

    fn created(key: &str) -> ev::JoinRequestCreated {
        ev::JoinRequestCreated {
            public_key: key.into(),
            hostname: "gpu-7".into(),
            agent_version: "0.1.0".into(),
            gpus: Vec::new(),
            gpu_uuids: Vec::new(),
        }
    }

    fn doc(state: JoinRequestState) -> JoinRequestDoc {
        JoinRequestDoc {
            join_request_id: join_request_id_of(b"k").to_string(),
            state,
            public_key: "a2V5".into(),
            hostname: "gpu-7".into(),
            agent_version: "0.1.0".into(),
            gpus: Vec::new(),
            gpu_uuids: Vec::new(),
            tenant_id: Some(TenantId::ROOT.to_string()),
            pool_id: Some(PoolId::from_ulid(ulid::Ulid::from_parts(1, 1)).to_string()),
            node_id: Some(NodeId::from_ulid(ulid::Ulid::from_parts(1, 2)).to_string()),
            reason: Some("not ours".into()),
            decided_by: None,
            decided_at_ms: 0,
            version: 1,
            created_at_ms: 0,
        }
    }

    #[test]
    fn a_new_ask_is_a_request_until_the_pending_bound_and_an_old_one_is_answered_by_its_state() {
        let id = join_request_id_of(b"k");
        assert_eq!(id, join_request_id_of(b"k"), "a machine asking again finds its request");
        assert_ne!(id, join_request_id_of(b"other"));
        let Ok(JoinRequestAnswer::Create(append)) = join_request_ask(id, None, created("a2V5"), 0) else { panic!("a request") };
        assert_eq!((append.expected, append.event_types()), (ExpectedVersion::NoStream, vec![ev::JOIN_REQUEST_CREATED]));
        let full = join_request_ask(id, None, created("a2V5"), JOIN_REQUESTS_PENDING_MAX).unwrap_err();
        assert_eq!(full.code(), bc_core::error::ErrorCode::QuotaExceeded, "{full}");
        let pending = doc(JoinRequestState::Pending);
        assert_eq!(
            join_request_ask(id, Some(&pending), created("a2V5"), JOIN_REQUESTS_PENDING_MAX).unwrap(),
            JoinRequestAnswer::Pending
        );
        let rejected = doc(JoinRequestState::Rejected);
        assert_eq!(
            join_request_ask(id, Some(&rejected), created("a2V5"), 0).unwrap(),
            JoinRequestAnswer::Rejected { reason: "not ours".into() }
        );
        let approved = doc(JoinRequestState::Approved);
        assert!(matches!(join_request_ask(id, Some(&approved), created("a2V5"), 0).unwrap(), JoinRequestAnswer::Approved { .. }));
        assert!(join_request_ask(id, Some(&pending), created("b3RoZXI="), 0).is_err(), "another key's request is not answered");
    }

    #[test]
    fn a_request_is_decided_once() {
        let pending = doc(JoinRequestState::Pending);
        let (tenant, pool, node) =
            (TenantId::ROOT, PoolId::from_ulid(ulid::Ulid::from_parts(1, 1)), NodeId::from_ulid(ulid::Ulid::nil()));
        let approve = join_request_approve(&pending, tenant, pool, node).unwrap();
        assert_eq!((approve.expected, approve.event_types()), (ExpectedVersion::Exact(1), vec![ev::JOIN_REQUEST_APPROVED]));
        let reject = join_request_reject(&pending, "unknown machine").unwrap();
        assert_eq!(reject.event_types(), vec![ev::JOIN_REQUEST_REJECTED]);
        for state in [JoinRequestState::Approved, JoinRequestState::Rejected] {
            let decided = doc(state);
            let e = join_request_approve(&decided, tenant, pool, node).unwrap_err();
            assert_eq!(e.code(), bc_core::error::ErrorCode::InvalidState, "{e}");
            assert!(join_request_reject(&decided, "no").is_err());
        }
    }
}
