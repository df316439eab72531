//! Node leases: liveness without appends. A node's session renews its lease on every heartbeat
//! (one row update); only a change, lapsed or held again, becomes an event (`node.unreachable`,
//! `node.ready`), appended by the liveness reconciler, which finds the leases whose state
//! differs from what it last reported. Kubernetes' node leases, with the log as the record of
//! the transitions. Operational state: losing a row loses no event.

use async_trait::async_trait;

use super::Store;
use crate::error::Result;

/// One node's lease and what the log last said of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub tenant: String,
    pub node: String,
    pub expires_at_ms: u64,
    /// Whether the last liveness event appended for the node said ready.
    pub reported_reachable: bool,
}

impl Lease {
    pub fn held_at(&self, now_ms: u64) -> bool {
        self.expires_at_ms > now_ms
    }
}

#[async_trait]
pub trait LeaseStore: Store {
    /// Holds or renews each `(tenant, node, expires_at_ms)` lease (never shortening one; each
    /// key once), in one transaction of one statement per thousand leases: the gateway batches
    /// its sessions' heartbeats, so a thousand nodes cost a few commits a second, not a
    /// thousand.
    async fn lease_renew(&self, leases: &[(String, String, u64)]) -> Result<()>;
    /// Up to `limit` leases whose state at `now_ms` is not what was last reported: lapsed but
    /// reported ready, or held but reported unreachable.
    async fn lease_changes(&self, now_ms: u64, limit: u32) -> Result<Vec<Lease>>;
    /// Records what the log now says of `node`.
    async fn lease_reported(&self, tenant: &str, node: &str, reachable: bool) -> Result<()>;
    async fn lease_get(&self, tenant: &str, node: &str) -> Result<Option<Lease>>;
    /// Claims `node`'s lease for the session `holder` at `now_ms` (held until at least
    /// `expires_at_ms`), written at once rather than batched: a session claims when it binds,
    /// so a session of the same node on another gateway sees, from [`Self::lease_claims_since`],
    /// that it was replaced. The last claim wins.
    async fn lease_claim(&self, claim: &LeaseClaim, expires_at_ms: u64) -> Result<()>;
    /// The claims written at or after `since_ms`, oldest first, at most `limit`.
    async fn lease_claims_since(&self, since_ms: u64, limit: u32) -> Result<Vec<LeaseClaim>>;
}

/// Who holds a node's lease: the session that bound last, and when it claimed the lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseClaim {
    pub tenant: String,
    pub node: String,
    /// The gateway process and its session (`Sessions`' holder ids); empty in rows written
    /// before claims existed, and by callers that never claim (the simulator, one gateway).
    pub holder: String,
    pub claimed_at_ms: u64,
}

pub(crate) const CLAIM_COLUMNS: &str = "tenant_id, node_id, holder, claimed_at_ms";

impl LeaseClaim {
    pub(crate) fn decode(row: &(impl super::Columns + ?Sized)) -> Result<Self> {
        Ok(Self { tenant: row.text(0)?, node: row.text(1)?, holder: row.text(2)?, claimed_at_ms: super::to_u64(row.int(3)?)? })
    }
}

pub(crate) const LEASE_COLUMNS: &str = "tenant_id, node_id, expires_at_ms, reported_reachable";

impl Lease {
    pub(crate) fn decode(row: &(impl super::Columns + ?Sized)) -> Result<Self> {
        Ok(Self {
            tenant: row.text(0)?,
            node: row.text(1)?,
            expires_at_ms: super::to_u64(row.int(2)?)?,
            reported_reachable: row.int(3)? != 0,
        })
    }
}
