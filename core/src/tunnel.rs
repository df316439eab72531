//! The tunnels' wire format, `v5.channel.k8s.io` (`schema/TUNNELS.md`): one leading channel byte
//! per binary WebSocket message, the Kubernetes `Status` that ends a tunnel, the resize message,
//! and v5's close frame. Pure: the gateway, the agent and the CLI encode and decode with it, so
//! the three agree byte for byte.
//!
//! Invariant: a frame this module encodes decodes to itself, and a decoded frame re-encodes to
//! the bytes it came from.

use serde_json::{Value, json};

/// The WebSocket subprotocol a client must offer.
pub const SUBPROTOCOL: &str = "v5.channel.k8s.io";
/// How long a ticket is good for after `tunnels.open`.
pub const TICKET_TTL_MS: u64 = 30_000;
/// A ticket's prefix; 43 characters of base64url (32 random bytes) follow.
pub const TICKET_PREFIX: &str = "bctt_";
/// The length of a whole ticket.
pub const TICKET_CHARS: usize = TICKET_PREFIX.len() + 43;
/// The largest message either side sends, its channel byte included.
pub const FRAME_BYTES_MAX: usize = 64 * 1024;
/// The largest data payload the gateway and the agent put in one frame: half a message, so a
/// frame with its gRPC envelope stays well inside `bc_proto::MESSAGE_BYTES_MAX`.
pub const DATA_BYTES_MAX: usize = 32 * 1024;
const _: () = assert!(DATA_BYTES_MAX < FRAME_BYTES_MAX);
/// The largest resize or status JSON read.
pub const CONTROL_BYTES_MAX: usize = 4096;
/// The capability an agent advertises when it can reach an instance (its serial console, a TCP
/// port of the guest).
pub const CAPABILITY_INSTANCE_DIAL: &str = "tunnel.instance-dial";
/// The capability an agent advertises when it attaches a console on its node.
pub const CAPABILITY_NODE_CONSOLE: &str = "tunnel.node-console";

pub const CHANNEL_STDIN: u8 = 0;
pub const CHANNEL_STDOUT: u8 = 1;
pub const CHANNEL_STDERR: u8 = 2;
pub const CHANNEL_STATUS: u8 = 3;
pub const CHANNEL_RESIZE: u8 = 4;
pub const CHANNEL_CLOSE: u8 = 255;

/// What a tunnel carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// A terminal: a shell on the node, or an instance's serial console.
    Console,
    /// A command in an instance (refused until guests have an agent).
    Exec,
    /// A TCP connection to a port of an instance.
    Tcp,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Console => "console",
            Self::Exec => "exec",
            Self::Tcp => "tcp",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "console" => Some(Self::Console),
            "exec" => Some(Self::Exec),
            "tcp" => Some(Self::Tcp),
            _ => None,
        }
    }
}

/// A terminal's size in character cells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowSize {
    pub width: u16,
    pub height: u16,
}

/// How a tunnel ended, as channel 3 says it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// The remote program exited with this status (0 to 255).
    Exited(u8),
    /// The tunnel itself failed; `timeout` for the idle timeout and the maximum duration.
    Broken { message: String, timeout: bool },
}

impl End {
    /// The status a client exits with: the program's own, 255 when the tunnel broke.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Exited(code) => *code,
            Self::Broken { .. } => 255,
        }
    }
}

/// One message of the tunnel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Channels 0, 1, 2: bytes.
    Data { channel: u8, bytes: Vec<u8> },
    /// Channel 3: the end.
    Status(End),
    /// Channel 4: a new window size.
    Resize(WindowSize),
    /// `[255, channel]`: no more data on `channel`.
    Close(u8),
}

/// Why a message is not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("an empty message carries no channel byte")]
    Empty,
    #[error("a message of {0} bytes is over the limit of {FRAME_BYTES_MAX}")]
    TooLarge(usize),
    #[error("channel {0} is not a channel of v5.channel.k8s.io")]
    UnknownChannel(u8),
    #[error("a close frame is exactly [255, channel]")]
    BadClose,
    #[error("the resize is not {{\"Width\":1..65535,\"Height\":1..65535}}: {0}")]
    BadResize(String),
    #[error("the status is not a Kubernetes Status: {0}")]
    BadStatus(String),
}

impl Frame {
    pub fn stdin(bytes: impl Into<Vec<u8>>) -> Self {
        Self::Data { channel: CHANNEL_STDIN, bytes: bytes.into() }
    }

    pub fn stdout(bytes: impl Into<Vec<u8>>) -> Self {
        Self::Data { channel: CHANNEL_STDOUT, bytes: bytes.into() }
    }

    /// The message's bytes: the channel, then the payload.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Data { channel, bytes } => {
                let mut out = Vec::with_capacity(1 + bytes.len());
                out.push(*channel);
                out.extend_from_slice(bytes);
                out
            }
            Self::Status(end) => {
                let mut out = vec![CHANNEL_STATUS];
                out.extend_from_slice(status_json(end).to_string().as_bytes());
                out
            }
            Self::Resize(size) => {
                let mut out = vec![CHANNEL_RESIZE];
                out.extend_from_slice(json!({ "Width": size.width, "Height": size.height }).to_string().as_bytes());
                out
            }
            Self::Close(channel) => vec![CHANNEL_CLOSE, *channel],
        }
    }

    /// The frame a message holds.
    /// A data frame's channel and payload, borrowed from `message` (the relays' hot path: no
    /// copy); `None` for any other message, which [`Frame::decode`] reads and checks.
    pub fn data_of(message: &[u8]) -> Option<(u8, &[u8])> {
        match message.split_first() {
            Some((&channel @ (CHANNEL_STDIN | CHANNEL_STDOUT | CHANNEL_STDERR), payload)) if message.len() <= FRAME_BYTES_MAX => {
                Some((channel, payload))
            }
            _ => None,
        }
    }

    pub fn decode(message: &[u8]) -> Result<Self, FrameError> {
        if message.len() > FRAME_BYTES_MAX {
            return Err(FrameError::TooLarge(message.len()));
        }
        let (&channel, payload) = message.split_first().ok_or(FrameError::Empty)?;
        match channel {
            CHANNEL_STDIN | CHANNEL_STDOUT | CHANNEL_STDERR => Ok(Self::Data { channel, bytes: payload.to_vec() }),
            CHANNEL_STATUS => parse_status(payload).map(Self::Status),
            CHANNEL_RESIZE => parse_resize(payload).map(Self::Resize),
            CHANNEL_CLOSE => match payload {
                [closed] => Ok(Self::Close(*closed)),
                _ => Err(FrameError::BadClose),
            },
            other => Err(FrameError::UnknownChannel(other)),
        }
    }
}

/// The Kubernetes `Status` of an end, as kubectl's `remotecommand` reads it.
pub fn status_json(end: &End) -> Value {
    match end {
        End::Exited(0) => json!({ "metadata": {}, "status": "Success" }),
        End::Exited(code) => json!({
            "metadata": {},
            "status": "Failure",
            "message": format!("command terminated with non-zero exit code: {code}"),
            "reason": "NonZeroExitCode",
            "details": { "causes": [{ "reason": "ExitCode", "message": code.to_string() }] },
        }),
        End::Broken { message, timeout } => json!({
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": if *timeout { "Timeout" } else { "InternalError" },
        }),
    }
}

/// Reads a `Status`: `Success` is exit 0; a `Failure` with an `ExitCode` cause is that status;
/// any other `Failure` is a broken tunnel.
pub fn parse_status(payload: &[u8]) -> Result<End, FrameError> {
    if payload.len() > CONTROL_BYTES_MAX {
        return Err(FrameError::BadStatus(format!("{} bytes", payload.len())));
    }
    let value: Value = serde_json::from_slice(payload).map_err(|e| FrameError::BadStatus(e.to_string()))?;
    match value.get("status").and_then(Value::as_str) {
        Some("Success") => Ok(End::Exited(0)),
        Some("Failure") => {
            let causes = value.pointer("/details/causes").and_then(Value::as_array);
            let code = causes.into_iter().flatten().find_map(|cause| {
                (cause.get("reason").and_then(Value::as_str) == Some("ExitCode"))
                    .then(|| cause.get("message").and_then(Value::as_str))
                    .flatten()
            });
            match code {
                Some(code) => match code.parse::<u8>() {
                    Ok(0) | Err(_) => Err(FrameError::BadStatus(format!("exit code {code:?} is not 1 to 255"))),
                    Ok(code) => Ok(End::Exited(code)),
                },
                None => Ok(End::Broken {
                    message: value.get("message").and_then(Value::as_str).unwrap_or("the tunnel failed").to_owned(),
                    timeout: value.get("reason").and_then(Value::as_str) == Some("Timeout"),
                }),
            }
        }
        _ => Err(FrameError::BadStatus("status is neither Success nor Failure".into())),
    }
}

/// Reads a resize: `{"Width": W, "Height": H}`, each 1 to 65535.
pub fn parse_resize(payload: &[u8]) -> Result<WindowSize, FrameError> {
    if payload.len() > CONTROL_BYTES_MAX {
        return Err(FrameError::BadResize(format!("{} bytes", payload.len())));
    }
    let value: Value = serde_json::from_slice(payload).map_err(|e| FrameError::BadResize(e.to_string()))?;
    let cells = |name: &str| {
        value
            .get(name)
            .and_then(Value::as_u64)
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| FrameError::BadResize(format!("{name} is missing or out of range")))
    };
    Ok(WindowSize { width: cells("Width")?, height: cells("Height")? })
}

/// Whether `text` has the shape of a ticket (`bctt_` and 43 base64url characters), checked
/// before it is looked up.
pub fn is_ticket(text: &str) -> bool {
    text.len() == TICKET_CHARS
        && text
            .strip_prefix(TICKET_PREFIX)
            .is_some_and(|rest| rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
}

/// An exit status as a shell reports it: the code, or 128 + the signal that ended the program.
pub fn exit_status_of(code: Option<i32>, signal: Option<i32>) -> u8 {
    match (code, signal) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(255),
        (None, Some(signal)) => u8::try_from(128 + (signal & 0x7f)).unwrap_or(255),
        (None, None) => 255,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_frame_round_trips() {
        let frames = [
            Frame::stdin(b"ls\r".to_vec()),
            Frame::stdout(Vec::new()),
            Frame::Data { channel: CHANNEL_STDERR, bytes: vec![0, 255, 3] },
            Frame::Status(End::Exited(0)),
            Frame::Status(End::Exited(7)),
            Frame::Status(End::Exited(255)),
            Frame::Status(End::Broken { message: "the agent went away".into(), timeout: false }),
            Frame::Status(End::Broken { message: "idle for 900 s".into(), timeout: true }),
            Frame::Resize(WindowSize { width: 120, height: 40 }),
            Frame::Close(CHANNEL_STDIN),
        ];
        for frame in frames {
            let bytes = frame.encode();
            assert_eq!(Frame::decode(&bytes).unwrap(), frame, "{bytes:?}");
            assert_eq!(Frame::decode(&bytes).unwrap().encode(), bytes);
        }
    }

    /// `data_of` says what `decode` says of a data frame, and nothing of any other message.
    #[test]
    fn data_of_borrows_exactly_the_data_frames() {
        let data = [
            Frame::stdin(b"ls\r".to_vec()),
            Frame::stdout(Vec::new()),
            Frame::Data { channel: CHANNEL_STDERR, bytes: vec![0, 255] },
        ];
        for frame in data {
            let bytes = frame.encode();
            let Frame::Data { channel, bytes: payload } = &frame else { unreachable!() };
            assert_eq!(Frame::data_of(&bytes), Some((*channel, payload.as_slice())));
        }
        let others = [
            Frame::Status(End::Exited(0)).encode(),
            Frame::Close(CHANNEL_STDIN).encode(),
            vec![CHANNEL_RESIZE],
            vec![9, 1],
            vec![],
        ];
        for message in others {
            assert_eq!(Frame::data_of(&message), None, "{message:?}");
        }
        let mut large = vec![0u8; FRAME_BYTES_MAX + 1];
        assert_eq!(Frame::data_of(&large), None, "over the limit");
        large.pop();
        assert_eq!(Frame::data_of(&large).map(|(c, p)| (c, p.len())), Some((CHANNEL_STDIN, FRAME_BYTES_MAX - 1)));
    }

    /// The bytes kubectl's remotecommand writes and reads, byte for byte.
    #[test]
    fn the_status_is_kubernetes_own() {
        let seven = Frame::Status(End::Exited(7)).encode();
        assert_eq!(seven[0], 3);
        let value: Value = serde_json::from_slice(&seven[1..]).unwrap();
        assert_eq!(
            value,
            json!({"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: 7",
                   "reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"7"}]}})
        );
        assert_eq!(&Frame::Status(End::Exited(0)).encode()[1..], br#"{"metadata":{},"status":"Success"}"#);
        // As a Kubernetes API server writes it, with fields this side never sends.
        let k8s = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"x","reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"42"}]},"code":500}"#;
        assert_eq!(parse_status(k8s).unwrap(), End::Exited(42));
        assert_eq!(End::Exited(42).exit_code(), 42);
        assert_eq!(End::Broken { message: String::new(), timeout: false }.exit_code(), 255);
    }

    #[test]
    fn the_resize_is_kubernetes_own() {
        assert_eq!(&Frame::Resize(WindowSize { width: 80, height: 24 }).encode()[1..], br#"{"Height":24,"Width":80}"#);
        assert_eq!(parse_resize(br#"{"Width":132,"Height":50}"#).unwrap(), WindowSize { width: 132, height: 50 });
        for bad in [&br#"{"Width":0,"Height":5}"#[..], br#"{"Width":70000,"Height":5}"#, br#"{"Width":5}"#, b"[]", b"nope"] {
            assert!(matches!(parse_resize(bad), Err(FrameError::BadResize(_))), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn malformed_messages_are_refused_by_name() {
        assert_eq!(Frame::decode(&[]), Err(FrameError::Empty));
        assert_eq!(Frame::decode(&[9, 1]), Err(FrameError::UnknownChannel(9)));
        assert_eq!(Frame::decode(&[255]), Err(FrameError::BadClose));
        assert_eq!(Frame::decode(&[255, 0, 0]), Err(FrameError::BadClose));
        assert_eq!(Frame::decode(&vec![0; FRAME_BYTES_MAX + 1]), Err(FrameError::TooLarge(FRAME_BYTES_MAX + 1)));
        assert!(matches!(Frame::decode(b"\x03{\"status\":\"Maybe\"}"), Err(FrameError::BadStatus(_))));
        assert!(matches!(
            Frame::decode(br#"{"status":"Failure","details":{"causes":[{"reason":"ExitCode","message":"0"}]}}"#.as_slice()),
            Err(FrameError::UnknownChannel(b'{'))
        ));
        assert!(matches!(
            parse_status(br#"{"status":"Failure","details":{"causes":[{"reason":"ExitCode","message":"0"}]}}"#),
            Err(FrameError::BadStatus(_))
        ));
    }

    #[test]
    fn tickets_ops_and_exit_statuses() {
        let ticket = format!("{TICKET_PREFIX}{}", "A".repeat(43));
        assert!(is_ticket(&ticket));
        assert!(!is_ticket(&ticket[..ticket.len() - 1]));
        assert!(!is_ticket(&format!("{TICKET_PREFIX}{}/", "A".repeat(42))));
        assert!(!is_ticket(&format!("bcxx_{}", "A".repeat(43))));
        for op in [Op::Console, Op::Exec, Op::Tcp] {
            assert_eq!(Op::parse(op.as_str()), Some(op));
        }
        assert_eq!(Op::parse("ssh"), None);
        assert_eq!(exit_status_of(Some(7), None), 7);
        assert_eq!(exit_status_of(Some(256 + 3), None), 3);
        assert_eq!(exit_status_of(None, Some(9)), 137);
        assert_eq!(exit_status_of(None, None), 255);
    }
}
