//! `tunnels.*`: `tunnels.open` decides a tunnel (`decide::tunnel::tunnel_open`) and grants a
//! single-use ticket for `GET /tunnels/{ticket}` (`crate::tunnels`). Nothing is appended: the
//! ticket is a secret held in this process's memory, and the tunnel's events are appended when
//! it opens and closes.

use bc_core::id::{InstanceId, NodeId};
use bc_core::tunnel::Op;
use bc_core::{Error, Result};
use bc_projections::decide::tunnel::{
    TunnelOpenInput, TunnelRefusal, TunnelRefusalKind, TunnelTarget, tunnel_action, tunnel_open,
};
use bc_projections::{InstanceDoc, KIND_INSTANCE, KIND_NODE, NodeDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::body::parse_id;
use super::validate::{InstanceIdText, NodeIdText, TenantIdText};
use super::{Access, Call, Method, method};

pub(super) const METHODS: &[Method] = &[method!(
    "tunnels.open",
    // Decided in the handler as `compute:nodes:console` (a node) or `compute:instances:exec`
    // (an instance): the action depends on the target.
    Access::Authenticated,
    "a single-use ticket (good for 30 s by default) for a console or TCP tunnel to a node or an instance, opened as GET /tunnels/{ticket} (schema/TUNNELS.md)",
    TunnelsOpen => TunnelTicketView,
    tunnels_open
)];

/// What a tunnel carries.
#[derive(Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
enum TunnelOp {
    Console,
    Exec,
    Tcp,
}

/// Exactly one of `nodeId` and `instanceId`, a string (not `null`).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(extend("oneOf" = [
    { "required": ["nodeId"], "properties": { "nodeId": { "type": "string" } } },
    { "required": ["instanceId"], "properties": { "instanceId": { "type": "string" } } },
]))]
pub struct TunnelsOpen {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    op: TunnelOp,
    /// The node (`console` only); exactly one of `nodeId` and `instanceId`.
    #[schemars(with = "Option<NodeIdText>")]
    node_id: Option<String>,
    #[schemars(with = "Option<InstanceIdText>")]
    instance_id: Option<String>,
    /// `tcp` only: the instance's port.
    #[schemars(range(min = 1, max = 65535))]
    port: Option<u32>,
}

/// A ticket for `GET {url}` as a WebSocket (`v5.channel.k8s.io`), good once until `expiresAtMs`.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TunnelTicketView {
    /// `bctt_…`: a secret; it opens one tunnel, for the key that asked, until it expires.
    ticket: String,
    /// `/tunnels/bctt_…`, on the API's own host.
    url: String,
    expires_at_ms: u64,
}

impl TunnelTicketView {
    pub(super) fn new(ticket: String, expires_at_ms: u64) -> Self {
        Self { url: format!("/tunnels/{ticket}"), ticket, expires_at_ms }
    }
}

pub(super) fn refusal_error(refusal: TunnelRefusal) -> Error {
    match refusal.kind {
        TunnelRefusalKind::InvalidArgument => Error::invalid(refusal.message),
        TunnelRefusalKind::InvalidState => Error::state(refusal.message, "see schema/TUNNELS.md"),
        TunnelRefusalKind::Unavailable => Error::Unavailable(refusal.message),
        TunnelRefusalKind::Unsupported => {
            Error::Unsupported { message: refusal.message, reason: refusal.reason.unwrap_or_default().to_owned() }
        }
        TunnelRefusalKind::QuotaExceeded => Error::QuotaExceeded(match refusal.reason {
            Some(reason) => format!("{} ({reason})", refusal.message),
            None => refusal.message,
        }),
    }
}

async fn tunnels_open(call: &Call<'_>, input: TunnelsOpen) -> Result<TunnelTicketView> {
    let op = match input.op {
        TunnelOp::Console => Op::Console,
        TunnelOp::Exec => Op::Exec,
        TunnelOp::Tcp => Op::Tcp,
    };
    let on_node = match (&input.node_id, &input.instance_id) {
        (Some(_), None) => true,
        (None, Some(_)) => false,
        _ => return Err(Error::invalid("give exactly one of nodeId and instanceId")),
    };
    let principal = call.principal();
    let tenant = match &input.tenant_id {
        Some(t) => parse_id("tenantId", t)?,
        None => principal.tenant,
    };
    call.state.authorize_tenant(principal, tunnel_action(on_node), tenant).await?;
    let (node_id, instance): (String, Option<InstanceDoc>) = match (&input.node_id, &input.instance_id) {
        (Some(node), _) => {
            let node: NodeId = parse_id("nodeId", node)?;
            (node.to_string(), None)
        }
        (_, Some(instance)) => {
            let instance: InstanceId = parse_id("instanceId", instance)?;
            let doc: InstanceDoc = call.row(tenant, KIND_INSTANCE, &instance.to_string(), "instance").await?;
            (doc.node_id.clone(), Some(doc))
        }
        (None, None) => unreachable!("checked above"),
    };
    let node: NodeDoc = call.row(tenant, KIND_NODE, &node_id, "node").await?;
    let target = match &instance {
        None => TunnelTarget::Node { node_id: &node.node_id, has_agent: node.agent.is_some() },
        Some(doc) => TunnelTarget::Instance { instance_id: &doc.instance_id, node_id: &doc.node_id, state: doc.state },
    };
    let tunnels = &call.state.tunnels;
    let bounds = tunnels.limits.bounds();
    let (ticket, expires_at_ms) = tunnels
        .issue(tenant, &principal.key_id, &node_id, call.now_ms(), |open, capabilities| {
            tunnel_open(&TunnelOpenInput { op, target, port: input.port, capabilities, open, bounds })
        })
        .map_err(refusal_error)?;
    Ok(TunnelTicketView { url: format!("/tunnels/{ticket}"), ticket, expires_at_ms })
}
