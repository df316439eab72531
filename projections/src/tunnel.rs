//! Tunnels (`schema/TUNNELS.md`): the two events that account for each one, on its node's stream,
//! and the one that records a ticket refused. A tunnel has no document of its own: the events are
//! the audit record (who had a terminal on which node, from where, for how long; who tried a
//! ticket that was not theirs, or no longer good), and nothing typed or printed is ever in them,
//! only counts, nor a ticket. No read model folds them: the one row they change is their node's,
//! whose version moves with its stream (`node::apply_foreign`), as decisions guard on it.

use serde::{Deserialize, Serialize};

pub const TUNNEL_OPENED: &str = "tunnel.opened";
pub const TUNNEL_CLOSED: &str = "tunnel.closed";
pub const TUNNEL_REFUSED: &str = "tunnel.refused";

/// `tunnel.opened`, on `node/node_…`: the agent attached the op's end and the relay started.
/// The key that opened it is the event's actor.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TunnelOpened {
    /// `tun_…`: what `tunnel.closed` names.
    pub tunnel_id: String,
    /// `console`, `exec` or `tcp`.
    pub op: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The API key that opened it (`key_…`).
    pub key_id: String,
    /// The client's address as the gateway saw it (`IP:PORT`).
    pub from: String,
}

/// `tunnel.closed`, on `node/node_…`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TunnelClosed {
    pub tunnel_id: String,
    pub node_id: String,
    pub duration_ms: u64,
    /// Payload bytes from the client to the node (channel 0), and from the node to the client
    /// (channels 1 and 2).
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// The remote program's exit status, when it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<u8>,
    /// `exited`, `client-closed`, `agent-gone`, `idle-timeout`, `max-duration`, `shutdown`,
    /// `key-revoked`, `access-lost`, `target-ended` ([`CloseReason`]).
    pub reason: String,
}

/// `tunnel.refused`, on `node/node_…`: a ticket of this node was presented and refused. The key
/// that presented it is the event's actor; the ticket itself is never in it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct TunnelRefused {
    /// What the ticket was for.
    pub op: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// The API key that presented the ticket (`key_…`).
    pub key_id: String,
    /// The API key the ticket was issued to: another than `keyId` for `other-key`.
    pub ticket_key_id: String,
    /// The client's address as the gateway saw it (`IP:PORT`).
    pub from: String,
    /// `spent`, `expired` or `other-key`.
    pub reason: String,
}

/// Why a tunnel closed, as `tunnel.closed` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// The remote program exited (its status is in the event).
    Exited,
    /// The client closed the WebSocket (a detach, or the client went away).
    ClientClosed,
    /// The agent's end broke or its session ended.
    AgentGone,
    IdleTimeout,
    MaxDuration,
    /// The gateway is stopping.
    Shutdown,
    /// The API key that opened it was revoked (or is gone).
    KeyRevoked,
    /// The API key no longer grants the tunnel's action in its tenant.
    AccessLost,
    /// Its node was deleted, or its instance stopped or was deleted, or the reservation holding
    /// the instance ended.
    TargetEnded,
}

impl CloseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exited => "exited",
            Self::ClientClosed => "client-closed",
            Self::AgentGone => "agent-gone",
            Self::IdleTimeout => "idle-timeout",
            Self::MaxDuration => "max-duration",
            Self::Shutdown => "shutdown",
            Self::KeyRevoked => "key-revoked",
            Self::AccessLost => "access-lost",
            Self::TargetEnded => "target-ended",
        }
    }
}
