//! The node CA's rolls as the log records them: `node_ca.renewed` on `node_ca/<root tenant>`.
//! The CA itself (its key, its certificate, the replaced ones in their overlap) is a sealed secret
//! (`bc_gateway::node_ca`), never in the log; the event says which CA became current, which one
//! it replaced and until when that one verifies, so an auditor sees every roll. It folds into no
//! row.
//!
//! The secret is written first (`pki renew-ca`), then the event is appended under an
//! idempotency key named after the new CA's pin ([`node_ca_renewed_key`]): by `pki renew-ca`,
//! and again by every server that reads the renewal, so a roll whose command died between the two
//! writes is recorded all the same, and once.

use bc_core::id::TenantId;
use serde::{Deserialize, Serialize};

use crate::stream_of;

pub const KIND_NODE_CA: &str = "node_ca";
pub const NODE_CA_RENEWED: &str = "node_ca.renewed";
/// Who appends it.
pub const NODE_CA_ACTOR: &str = "system:pki";

/// The node CA's stream, on the root tenant.
pub fn node_ca_stream() -> String {
    stream_of(KIND_NODE_CA, &TenantId::ROOT)
}

/// The idempotency key of the roll that made the CA of `pin` current.
pub fn node_ca_renewed_key(pin: &str) -> String {
    format!("node_ca_renewed:{pin}")
}

/// `node_ca.renewed`: the CA of `pin` (`sha256/…` of its key) is current; the one it replaced
/// (`previousPin`) verifies until `overlapEndsAtMs`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeCaRenewed {
    pub pin: String,
    pub previous_pin: String,
    pub overlap_ends_at_ms: u64,
}
