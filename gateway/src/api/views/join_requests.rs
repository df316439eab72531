//! `joinRequests.*`: a machine's request to join without a token, and what was decided.

use bc_projections::{JoinRequestDoc, JoinRequestState};
use schemars::JsonSchema;
use serde::Serialize;

use super::GpuView;
use crate::api::validate::{JoinRequestIdText, NodeIdText, PoolIdText, TenantIdText};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum JoinRequestStateView {
    /// The machine waits, asking again.
    Pending,
    /// The machine joins (or joined) as `nodeId` of `tenantId`'s pool `poolId`.
    Approved,
    /// The machine's wait ended with `reason`.
    Rejected,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct JoinRequestView {
    #[schemars(with = "JoinRequestIdText")]
    pub join_request_id: String,
    pub state: JoinRequestStateView,
    /// Standard base64 of the machine's Ed25519 public key (the request is named after it).
    pub public_key: String,
    /// What the machine says of itself.
    pub hostname: String,
    pub agent_version: String,
    pub gpus: Vec<GpuView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<TenantIdText>")]
    pub tenant_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<PoolIdText>")]
    pub pool_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<NodeIdText>")]
    pub node_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who decided (`apikey:key_…`), and when (0: not yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decided_by: Option<String>,
    pub decided_at_ms: u64,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<JoinRequestDoc> for JoinRequestView {
    fn from(d: JoinRequestDoc) -> Self {
        Self {
            join_request_id: d.join_request_id,
            state: match d.state {
                JoinRequestState::Pending => JoinRequestStateView::Pending,
                JoinRequestState::Approved => JoinRequestStateView::Approved,
                JoinRequestState::Rejected => JoinRequestStateView::Rejected,
            },
            public_key: d.public_key,
            hostname: d.hostname,
            agent_version: d.agent_version,
            gpus: d
                .gpus
                .into_iter()
                .map(|g| GpuView { model: g.model, product: g.product, vram_gib: g.vram_gib, nvlink_domain: g.nvlink_domain })
                .collect(),
            tenant_id: d.tenant_id,
            pool_id: d.pool_id,
            node_id: d.node_id,
            reason: d.reason,
            decided_by: d.decided_by,
            decided_at_ms: d.decided_at_ms,
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}
