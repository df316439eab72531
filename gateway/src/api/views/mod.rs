//! Wire types: what every method answers, apart from the stored projection documents.
//!
//! A view is built from a document (or from a decision) by one conversion here, so the JSON a
//! client reads changes only when a view does; every view derives its JSON schema for the
//! OpenAPI document. Field names are the API's (camelCase); times are ms since the Unix epoch
//! and say so in their names (`createdAtMs`).

use std::collections::BTreeMap;

use bc_projections::{ApiKeyDoc, NodeDoc, PoolDoc, TenantDoc};
use schemars::JsonSchema;
use serde::Serialize;

use super::validate::{
    ApiKeyIdText, DescriptionText, LabelsMap, NameText, NodeIdText, PoolIdText, ReservationIdText, TenantIdText,
};

pub use bc_projections::{CoveredBy, EventView};

mod agents;
mod batches;
mod flavors;
mod instances;
mod join_requests;
mod metal;
mod reservations;
mod sandboxes;
mod usage;
mod webhooks;

pub use agents::*;
pub use batches::*;
pub use flavors::*;
pub use instances::*;
pub use join_requests::*;
pub use metal::*;
pub use reservations::*;
pub use sandboxes::*;
pub use usage::*;
pub use webhooks::*;

/// `system.version`.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VersionView {
    pub version: String,
    /// `sqlite` or `postgres`.
    pub backend: String,
    pub log_key_id: String,
    /// The log key's pin (`ed25519:…`), for auditors.
    pub log_key_pin: String,
}

/// `system.whoami`: the calling key.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WhoamiView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "ApiKeyIdText")]
    pub key_id: String,
    pub actions: Vec<String>,
    /// The root tenant's keys act across tenants.
    pub root: bool,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub root: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<TenantDoc> for TenantView {
    fn from(d: TenantDoc) -> Self {
        Self { tenant_id: d.tenant_id, name: d.name, root: d.root, version: d.version, created_at_ms: d.created_at_ms }
    }
}

/// An API key; never its secret or the secret's hash.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyView {
    #[schemars(with = "ApiKeyIdText")]
    pub key_id: String,
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub actions: Vec<String>,
    pub revoked: bool,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<ApiKeyDoc> for ApiKeyView {
    fn from(d: ApiKeyDoc) -> Self {
        Self {
            key_id: d.key_id,
            tenant_id: d.tenant_id,
            name: d.name,
            actions: d.actions,
            revoked: d.revoked,
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}

/// `apiKeys.create`: the key and, once, its token.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyCreatedView {
    #[serde(flatten)]
    pub key: ApiKeyView,
    /// `KEY_ID.SECRET`, shown only in the first answer: `null` when `replayed`.
    pub token: Option<String>,
    /// This answers a retry with the same `Idempotency-Key`; nothing new was created.
    pub replayed: bool,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    #[schemars(with = "DescriptionText")]
    pub description: String,
    #[schemars(with = "LabelsMap")]
    pub labels: BTreeMap<String, String>,
    /// The longest reservation the pool grants, in seconds.
    pub max_reservation_s: u64,
    pub archived: bool,
    /// The tenants its owner offered it to (`pools.offer`); shown to the owner only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schemars(with = "Vec<TenantIdText>")]
    pub offered_to: Vec<String>,
    /// Set when the pool is another tenant's, offered to the caller's: its owner (`tenantId`).
    /// The caller reserves from it under its own quota and cannot change it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offered: Option<bool>,
    /// The site its machines are at (`sites.*`), fixed when it was made.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<super::validate::SiteIdText>")]
    pub site_id: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl PoolView {
    /// The pool as a tenant it is offered to sees it: marked, without the owner's other offers.
    pub fn as_offered(mut self) -> Self {
        self.offered_to = Vec::new();
        self.offered = Some(true);
        self
    }
}

impl From<PoolDoc> for PoolView {
    fn from(d: PoolDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            pool_id: d.pool_id,
            name: d.name,
            description: d.description,
            labels: d.labels,
            max_reservation_s: d.max_reservation_s,
            archived: d.archived,
            offered_to: d.offered_to.into_iter().collect(),
            offered: None,
            site_id: d.site_id,
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

/// A node's state: whether it takes new reservations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum NodeStateView {
    /// Takes reservations.
    Ready,
    /// Takes no new reservation.
    Cordoned,
    /// Cordoned until its reservations end.
    Draining,
    /// Its agent let its lease lapse: it takes nothing until it is back.
    Unreachable,
}

impl From<bc_projections::NodeState> for NodeStateView {
    fn from(s: bc_projections::NodeState) -> Self {
        use bc_projections::NodeState as S;
        match s {
            S::Ready => Self::Ready,
            S::Cordoned => Self::Cordoned,
            S::Draining => Self::Draining,
            S::Unreachable => Self::Unreachable,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuView {
    pub model: String,
    pub product: String,
    #[serde(rename = "vramGiB")]
    pub vram_gib: u32,
    /// GPUs of one node with the same domain share NVLink.
    pub nvlink_domain: u32,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub gpus: Vec<GpuView>,
    #[schemars(with = "LabelsMap")]
    pub labels: BTreeMap<String, String>,
    pub state: NodeStateView,
    #[schemars(with = "LabelsMap")]
    pub taints: BTreeMap<String, String>,
    /// GPU index → the reservation holding it.
    #[schemars(with = "BTreeMap<String, ReservationIdText>")]
    pub allocations: BTreeMap<u32, String>,
    /// Set when the node joined with `bcd`; absent for a node registered by hand.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<NodeAgentView>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<NodeDoc> for NodeView {
    fn from(d: NodeDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            node_id: d.node_id,
            pool_id: d.pool_id,
            name: d.name,
            gpus: d
                .gpus
                .into_iter()
                .map(|g| GpuView { model: g.model, product: g.product, vram_gib: g.vram_gib, nvlink_domain: g.nvlink_domain })
                .collect(),
            labels: d.labels,
            state: d.state.into(),
            taints: d.taints,
            allocations: d.allocations,
            agent: d.agent.map(Into::into),
            version: d.version,
            created_at_ms: d.created_at_ms,
            updated_at_ms: d.updated_at_ms,
        }
    }
}

/// A node `nodes.delete` removed: gone for good, at the log's version of its stream.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeDeletedView {
    #[schemars(with = "super::validate::NodeIdText")]
    pub node_id: String,
    pub deleted: bool,
    /// The node stream's version after `node.deleted`.
    pub version: u64,
}

/// A node after `cordon`, `uncordon`, `drain`, `label` or `taint`.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeChangedView {
    #[serde(flatten)]
    pub node: NodeView,
    /// Draining and holding no GPU: safe to take down.
    pub drained: bool,
}
