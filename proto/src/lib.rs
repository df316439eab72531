//! `bc-proto`: the agent protocol, `schema/agent.proto`, as Rust types with the tonic client and
//! server. The gateway serves it and `bcd` calls it; both depend on this crate and neither on the
//! other. Wire types only: the domain meaning of an entry or a command lives in `bc-core::agent`.

#![allow(clippy::all)]

pub mod v1 {
    tonic::include_proto!("bettercompute.agent.v1");
}

pub use v1::*;

/// `schema/agent.proto` as an encoded `FileDescriptorSet` (with its imports), for the gateway's
/// gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/agent_descriptor.bin"));

/// The largest tunnel frame a `TunnelFrame` carries: `bc_core::tunnel::FRAME_BYTES_MAX`, the
/// largest message a tunnel's client may send (schema/TUNNELS.md).
pub const TUNNEL_FRAME_BYTES_MAX: usize = 64 * 1024;
/// The largest message either side accepts, encoded: a full tunnel frame with its envelope (the
/// fields' tags and lengths, a tunnel id) fits. It was 64 KiB exactly, and a client's full-size
/// message (65,540 bytes encoded) broke its tunnel.
pub const MESSAGE_BYTES_MAX: usize = TUNNEL_FRAME_BYTES_MAX + 1024;
/// Streams (calls) one agent connection may hold open at once (HTTP/2's
/// `SETTINGS_MAX_CONCURRENT_STREAMS`, which the gateway sends): a `bcd` holds one session and a
/// stream per tunnel to its node.
pub const AGENT_STREAMS_PER_CONNECTION_MAX: u32 = 32;
/// HTTP/2 flow control on an agent's connection, at both ends: each stream's window (what the
/// sender may have in flight on one stream before its reader takes it)...
pub const AGENT_STREAM_WINDOW_BYTES: u32 = 256 * 1024;
/// ...and the connection's, shared by all its streams: room for every stream's window at once.
/// A stream whose reader stalls (a tunnel to a client that reads nothing, or a guest that reads
/// nothing) holds its window's bytes unread, and those count against the connection's window
/// too: with hyper's default, one stream's worth (1 MiB at the gateway), one stalled tunnel held
/// back every other stream of the node's connection, its session's heartbeats among them. The
/// cost is memory: at most this much (8 MiB) buffered for one connection, and only while its
/// streams' readers stall; hence the stream window of 256 KiB, not 1 MiB (32 MiB a connection,
/// 8 GiB for the 256 connections one peer address may hold), enough for a tunnel to carry
/// 25 MB/s over a 10 ms round trip.
pub const AGENT_CONNECTION_WINDOW_BYTES: u32 = AGENT_STREAM_WINDOW_BYTES * AGENT_STREAMS_PER_CONNECTION_MAX;
const _: () = assert!(AGENT_STREAM_WINDOW_BYTES as usize >= 2 * MESSAGE_BYTES_MAX);
/// The largest journal entry body.
pub const ENTRY_BODY_BYTES_MAX: usize = 16 * 1024;
/// Capabilities a `Hello` may name, and the longest.
pub const CAPABILITIES_MAX: usize = 64;
pub const CAPABILITY_BYTES_MAX: usize = 64;
const _: () = assert!(ENTRY_BODY_BYTES_MAX * 2 < MESSAGE_BYTES_MAX);
/// The metadata key of a retry hint on an `UNAVAILABLE` status, in milliseconds (gRPC's
/// retry pushback, gRFC A6): the gateway sets it when it refuses a join for lack of permits,
/// and `bcd join` waits at least that long before its next attempt.
pub const RETRY_PUSHBACK_MS_KEY: &str = "grpc-retry-pushback-ms";
/// What a `JoinAsk`'s signature is over, before the node's public key: the machine asking holds
/// the key its request is named after.
pub const JOIN_ASK_SIGNING_PREFIX: &[u8] = b"better-compute/join-request/v1\n";
/// A `JoinAskAnswer`'s states.
pub const JOIN_ASK_PENDING: &str = "pending";
pub const JOIN_ASK_APPROVED: &str = "approved";
pub const JOIN_ASK_REJECTED: &str = "rejected";
/// The start of the message a revoked node's session ends with (`PERMISSION_DENIED`): `bcd node`
/// exits 1 on it (`agent: this node's certificate was revoked`).
pub const NODE_REVOKED_CODE: &str = "NODE_REVOKED";

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a tunnel client's message of the largest size the framing allows became an
    /// agent message over the bound, and the gateway failed to encode it.
    #[test]
    fn a_full_size_tunnel_frame_fits_one_message() {
        let frame = TunnelFrame { tunnel_id: vec![0xff; 64], frame: vec![0xff; TUNNEL_FRAME_BYTES_MAX].into() };
        let encoded = prost::Message::encoded_len(&frame);
        assert!(encoded > TUNNEL_FRAME_BYTES_MAX && encoded <= MESSAGE_BYTES_MAX, "{encoded}");
    }
}
