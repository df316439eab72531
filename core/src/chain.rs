//! Verification of one tenant's hash chain: pure, no IO (STYLE rule 3).
//!
//! The verifier is fed the stored rows in `seq` order and stops at the first problem, naming
//! the first sequence number that does not verify. Not every event carries a signature: one
//! without is covered by the next signed event of its chain, whose hash commits to it through
//! the `prev` links between them, so a walk's events are vouched for up to the last signed one,
//! and the chain head must be signed (`schema/LOG-FORMAT.md`, "Signature").

use crate::event::{EventRow, GENESIS_PREV, SignatureColumns, StoredEvent, signature_columns};
use crate::id::TenantId;
use crate::keys::KeyRing;

/// The first thing wrong with a chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainProblem {
    pub tenant: String,
    pub seq: u64,
    pub what: String,
}

impl std::fmt::Display for ChainProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tenant {} seq {}: {}", self.tenant, self.seq, self.what)
    }
}

/// Walks one chain. Feed rows with [`ChainVerifier::push`], then call [`ChainVerifier::finish`]
/// with the head the database claims, so a truncated tail is caught too.
pub struct ChainVerifier<'k> {
    tenant: TenantId,
    keys: &'k KeyRing,
    next_seq: u64,
    prev: [u8; 32],
    /// The first event of the walk no signature covers yet.
    uncovered_from: Option<u64>,
}

impl<'k> ChainVerifier<'k> {
    pub fn new(tenant: TenantId, keys: &'k KeyRing) -> Self {
        Self { tenant, keys, next_seq: 1, prev: GENESIS_PREV, uncovered_from: None }
    }

    /// Resumes a walk mid-chain: the next event is `next_seq` and the one before it hashed to
    /// `prev` (what an export that starts after seq 1 carries). `next_seq` 1 with
    /// [`GENESIS_PREV`] is [`ChainVerifier::new`].
    pub fn resume(tenant: TenantId, keys: &'k KeyRing, next_seq: u64, prev: [u8; 32]) -> Self {
        Self { tenant, keys, next_seq: next_seq.max(1), prev, uncovered_from: None }
    }

    fn problem(&self, seq: u64, what: impl Into<String>) -> ChainProblem {
        ChainProblem { tenant: self.tenant.to_string(), seq, what: what.into() }
    }

    /// Checks the next row and returns its event. An event without a signature of its own is
    /// linked but not yet vouched for: a later signed event covers it, and
    /// [`ChainVerifier::finish`] refuses a walk that ends on an uncovered event.
    pub fn push(&mut self, row: EventRow) -> Result<StoredEvent, ChainProblem> {
        let expected = self.next_seq;
        if row.seq > expected {
            return Err(self.problem(expected, format!("event missing: the next stored event is seq {}", row.seq)));
        }
        if row.seq < expected {
            return Err(self.problem(expected, format!("out of order: seq {} stored after seq {}", row.seq, expected - 1)));
        }
        if row.tenant != self.tenant.to_string() {
            return Err(self.problem(expected, "row belongs to another tenant"));
        }
        let event = row.decode().map_err(|what| self.problem(expected, what))?;
        if event.envelope.prev != self.prev {
            return Err(self.problem(expected, "prev does not match the hash of the event before"));
        }
        match signature_columns(expected, &event.envelope.event_type, &event.key_id, &event.sig) {
            Ok(SignatureColumns::CoveredLater) => {
                self.uncovered_from.get_or_insert(expected);
            }
            Ok(SignatureColumns::Signed { key_id, sig }) => {
                self.keys.verify_event(key_id, &event.hash, sig).map_err(|what| self.problem(expected, what))?;
                self.uncovered_from = None;
            }
            Err(what) => return Err(self.problem(expected, what)),
        }
        self.prev = event.hash;
        self.next_seq += 1;
        Ok(event)
    }

    /// The last seq verified (after [`ChainVerifier::resume`], counting the events before it).
    pub fn verified(&self) -> u64 {
        self.next_seq - 1
    }

    pub fn last_hash(&self) -> [u8; 32] {
        self.prev
    }

    /// The first event of the walk that no signature covers yet (none after a signed event).
    pub fn uncovered_from(&self) -> Option<u64> {
        self.uncovered_from
    }

    /// Compares the end of the walk with the stored head (`None` if the tenant has no head);
    /// the head must be signed.
    pub fn finish(&self, head: Option<(u64, [u8; 32])>) -> Result<u64, ChainProblem> {
        let (head_seq, head_hash) = head.unwrap_or((0, GENESIS_PREV));
        let last = self.verified();
        if head_seq > last {
            return Err(self.problem(last + 1, format!("event missing: the chain head says seq {head_seq}")));
        }
        if head_seq < last {
            return Err(self.problem(head_seq + 1, format!("seq {} is past the chain head {head_seq}", head_seq + 1)));
        }
        if head_hash != self.prev {
            return Err(self.problem(last, "chain head hash differs from the last event's hash"));
        }
        match self.uncovered_from {
            Some(seq) => Err(self.problem(seq, uncovered(seq, last))),
            None => Ok(last),
        }
    }
}

/// What a walk that ends on unsigned events says about them.
pub fn uncovered(from: u64, last: u64) -> String {
    format!("no signature covers seq {from} to {last}: the last event of a chain must be signed")
}

/// Verifies a whole chain held in memory.
pub fn verify_chain(
    tenant: TenantId,
    rows: impl IntoIterator<Item = EventRow>,
    head: Option<(u64, [u8; 32])>,
    keys: &KeyRing,
) -> Result<u64, ChainProblem> {
    let mut verifier = ChainVerifier::new(tenant, keys);
    for row in rows {
        verifier.push(row)?;
    }
    verifier.finish(head)
}
