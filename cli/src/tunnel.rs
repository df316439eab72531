//! The client's end of a tunnel (`schema/TUNNELS.md`): the ticket, the WebSocket, and what runs
//! over it: `console`'s and `exec`'s terminal ([`attach`]) and `forward`'s byte streams
//! ([`pump`]).
//!
//! Invariants:
//! - The socket's address is built here from the API's own URL and the ticket, which must look
//!   like one ([`tunnel_url`]); no URL the server answers is ever joined or followed. The upgrade
//!   goes through the CLI's own HTTP client ([`crate::client::api_http`]): the same TLS trust as
//!   every call (the platform's roots), `wss` exactly when `--url` is `https`, plain `ws` only on
//!   loopback, no redirect followed, no proxy for plain http.
//! - Each direction is a task of its own, so a send that waits (a slow network, a slow local
//!   reader) never holds the other direction back.
//! - `forward`'s memory is bounded per connection: the local socket is no longer read while
//!   more than [`UNSENT_PAUSE_ABOVE_BYTES`] read from it wait to be sent, until fewer than
//!   [`UNSENT_RESUME_BELOW_BYTES`] do; and the socket is no longer read while more than
//!   [`BEHIND_PAUSE_ABOVE_BYTES`] wait for a slow local reader, until fewer than
//!   [`BEHIND_RESUME_BELOW_BYTES`] do. A paused socket holds the gateway back, which holds the
//!   node's agent back, which holds the guest back (TCP's flow control and HTTP/2's windows all
//!   the way), as `ssh -L` and `kubectl port-forward` do: a slow reader is slowed, never cut off.
//!   A reader that never reads again ends with the tunnel's idle timeout. Each count ([`Held`])
//!   is added before its bytes are handed to the other task, never after.
//! - Nothing typed or printed is logged.

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bc_core::tunnel::{self as wire, End, Frame, WindowSize};
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Bytes, Message};

use crate::client::CliError;

/// The key that detaches (Ctrl-], as telnet and `docker attach`).
pub const DETACH_BYTE: u8 = 0x1d;
/// Bytes read from the terminal at once.
const READ_BYTES: usize = 4096;
/// The upgrade must be answered within this: the gateway waits up to 10 s for the node's agent
/// to attach before it answers.
pub const UPGRADE_TIMEOUT_S: u64 = 30;
/// Connecting to the API must succeed within this.
pub const CONNECT_TIMEOUT_S: u64 = 10;
/// `forward` stops reading a local connection while more than this read from it waits to be
/// sent...
pub const UNSENT_PAUSE_ABOVE_BYTES: usize = 4 * 1024 * 1024;
/// ...and reads it again once less than this does.
pub const UNSENT_RESUME_BELOW_BYTES: usize = 1024 * 1024;
const _: () = assert!(UNSENT_RESUME_BELOW_BYTES < UNSENT_PAUSE_ABOVE_BYTES);
/// `forward` stops reading the tunnel's socket while more than this that it delivered waits for
/// the local reader...
pub const BEHIND_PAUSE_ABOVE_BYTES: usize = 4 * 1024 * 1024;
/// ...and reads it again once less than this does.
pub const BEHIND_RESUME_BELOW_BYTES: usize = 1024 * 1024;
const _: () = assert!(BEHIND_RESUME_BELOW_BYTES < BEHIND_PAUSE_ABOVE_BYTES);
/// Bytes of a local connection sent in one frame (a frame is at most `FRAME_BYTES_MAX`).
pub const CHUNK_BYTES: usize = wire::DATA_BYTES_MAX;
const _: () = assert!(CHUNK_BYTES < wire::FRAME_BYTES_MAX);
/// After the remote end closed, what it sent is written to the local connection for at most
/// this long (a local peer that no longer reads does not hold the connection open); after the
/// local peer closed, the remote's end is waited for as long.
pub const LOCAL_DRAIN_TIMEOUT_S: u64 = 30;

/// The tunnel's socket: the upgraded connection of the CLI's HTTP client.
pub type Socket = WebSocketStream<reqwest::Upgraded>;

/// How a console ended, for the command's exit status.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The remote program ended (or the tunnel broke: `End::Broken`).
    Ended(End),
    /// The user pressed Ctrl-].
    Detached,
    /// The socket closed without a status: the tunnel broke.
    Broken(String),
}

impl Outcome {
    /// The command's exit status: the remote program's, 0 after a detach, 255 for a broken tunnel.
    pub fn exit_status(&self) -> u8 {
        match self {
            Self::Ended(end) => end.exit_code(),
            Self::Detached => 0,
            Self::Broken(_) => 255,
        }
    }
}

/// The ticket of a `tunnels.open` answer, checked to look like one (its `url` is not used).
pub fn ticket_of(answer: &serde_json::Value) -> Result<String, CliError> {
    match answer["ticket"].as_str() {
        Some(ticket) if wire::is_ticket(ticket) => Ok(ticket.to_owned()),
        _ => Err(CliError::new("INVALID_RESPONSE", "tunnels.open answered no ticket of the form bctt_…")),
    }
}

/// The tunnel's address: `/tunnels/TICKET` under the API's own URL (its scheme, host, port and
/// path), never a URL the server supplied. `https` is the WebSocket's `wss`, `http` its `ws`.
pub fn tunnel_url(api: &url::Url, ticket: &str) -> Result<url::Url, CliError> {
    if !wire::is_ticket(ticket) {
        return Err(CliError::new("INVALID_RESPONSE", "the ticket is not of the form bctt_…"));
    }
    let mut url = api.clone();
    let base = api.path().trim_end_matches('/');
    url.set_path(&format!("{base}/tunnels/{ticket}"));
    url.set_query(None);
    url.set_fragment(None);
    Ok(url)
}

/// The HTTP client tunnels are opened with: the API's own ([`crate::client::api_http`]), on
/// HTTP/1.1 (a WebSocket upgrade), without an overall timeout (the connection outlives it).
pub fn upgrade_client(api: &url::Url) -> Result<reqwest::Client, CliError> {
    let builder = reqwest::Client::builder().http1_only().connect_timeout(Duration::from_secs(CONNECT_TIMEOUT_S));
    crate::client::api_http(api, builder)
}

/// The WebSocket's limits: a message is at most `FRAME_BYTES_MAX`.
fn socket_config() -> WebSocketConfig {
    WebSocketConfig::default().max_message_size(Some(wire::FRAME_BYTES_MAX)).max_frame_size(Some(wire::FRAME_BYTES_MAX))
}

/// Opens the WebSocket of `ticket` on `http` (see [`upgrade_client`]) with `token` and
/// `v5.channel.k8s.io`; a refusal is the server's error, with its code.
pub async fn connect(http: &reqwest::Client, api: &url::Url, ticket: &str, token: &str) -> Result<Socket, CliError> {
    let url = tunnel_url(api, ticket)?;
    let key = tokio_tungstenite::tungstenite::handshake::client::generate_key();
    let request = http
        .get(url)
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", &key)
        .header("sec-websocket-protocol", wire::SUBPROTOCOL)
        .bearer_auth(token);
    let response = match tokio::time::timeout(Duration::from_secs(UPGRADE_TIMEOUT_S), request.send()).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => return Err(CliError::new("UNAVAILABLE", format!("cannot open the tunnel's WebSocket: {e}"))),
        Err(_) => {
            return Err(CliError::new(
                "UNAVAILABLE",
                format!("the tunnel's WebSocket was not opened within {UPGRADE_TIMEOUT_S} s"),
            ));
        }
    };
    let status = response.status();
    if status.is_redirection() {
        return Err(crate::client::redirect_refused(status, response.headers().get(reqwest::header::LOCATION)));
    }
    if status != reqwest::StatusCode::SWITCHING_PROTOCOLS {
        return Err(refusal(status, response.bytes().await.unwrap_or_default()));
    }
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    if header("sec-websocket-accept").as_deref() != Some(accept.as_str()) {
        return Err(CliError::new("INVALID_RESPONSE", "the server's Sec-WebSocket-Accept does not answer this upgrade"));
    }
    let chosen = header("sec-websocket-protocol");
    if chosen.as_deref() != Some(wire::SUBPROTOCOL) {
        return Err(CliError::new(
            "INVALID_RESPONSE",
            format!("the server chose the subprotocol {chosen:?}, not {}", wire::SUBPROTOCOL),
        ));
    }
    let upgraded = response
        .upgrade()
        .await
        .map_err(|e| CliError::new("UNAVAILABLE", format!("the tunnel's WebSocket upgrade failed: {e}")))?;
    Ok(WebSocketStream::from_raw_socket(upgraded, Role::Client, Some(socket_config())).await)
}

/// The error of a refused upgrade: the API's envelope, else the status.
fn refusal(status: reqwest::StatusCode, body: Bytes) -> CliError {
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    let code = body["code"].as_str().unwrap_or("UNAVAILABLE");
    let message = body["message"].as_str().map(str::to_owned).unwrap_or_else(|| format!("the server answered {status}"));
    let mut error = CliError::new(code, message);
    error.hint = body["details"]["hint"].as_str().map(str::to_owned);
    error
}

/// The terminal the console attaches to, in raw mode while this lives.
struct RawTerminal {
    saved: Option<rustix::termios::Termios>,
}

impl RawTerminal {
    fn enter() -> Self {
        let stdin = std::io::stdin();
        let Ok(saved) = rustix::termios::tcgetattr(&stdin) else { return Self { saved: None } };
        let mut raw = saved.clone();
        raw.make_raw();
        if rustix::termios::tcsetattr(&stdin, rustix::termios::OptionalActions::Now, &raw).is_err() {
            return Self { saved: None };
        }
        Self { saved: Some(saved) }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(saved) = &self.saved {
            let _ = rustix::termios::tcsetattr(std::io::stdin(), rustix::termios::OptionalActions::Now, saved);
        }
    }
}

/// The terminal's size now, if stdout is one.
fn window_size() -> Option<WindowSize> {
    let size = rustix::termios::tcgetwinsize(std::io::stdout()).ok()?;
    (size.ws_col > 0 && size.ws_row > 0).then_some(WindowSize { width: size.ws_col, height: size.ws_row })
}

/// Reads the local terminal on a thread of its own (a read of stdin cannot be cancelled, and a
/// blocking task would hold the runtime's shutdown): chunks until end of input.
fn read_stdin() -> mpsc::Receiver<Vec<u8>> {
    let (keys, typed) = mpsc::channel(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buffer = [0u8; READ_BYTES];
        loop {
            match stdin.read(&mut buffer) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if keys.blocking_send(buffer[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    typed
}

fn binary(frame: Frame) -> Message {
    Message::Binary(frame.encode().into())
}

/// Why the terminal's sending side stopped.
enum Sent {
    Detached,
    Broken,
}

/// The terminal's sending side: what is typed (up to a Ctrl-], which detaches) and the window's
/// size (at once, and on every SIGWINCH) go to the remote, on a task of its own. `detaching` is
/// set before the close a detach sends, so the socket's end that follows is not taken for a
/// broken tunnel.
async fn send_terminal<S>(mut to_remote: S, mut winch: tokio::signal::unix::Signal, detaching: Arc<AtomicBool>) -> Sent
where
    S: futures::Sink<Message> + Unpin,
{
    if let Some(size) = window_size()
        && to_remote.send(binary(Frame::Resize(size))).await.is_err()
    {
        return Sent::Broken;
    }
    let mut typed = read_stdin();
    let mut stdin_open = true;
    loop {
        let frame = tokio::select! {
            keys = typed.recv(), if stdin_open => match keys {
                Some(keys) => match keys.iter().position(|b| *b == DETACH_BYTE) {
                    Some(at) => {
                        if at > 0 {
                            let _ = to_remote.send(binary(Frame::stdin(keys[..at].to_vec()))).await;
                        }
                        detaching.store(true, Ordering::Release);
                        let _ = to_remote.send(Message::Close(None)).await;
                        return Sent::Detached;
                    }
                    None => Frame::stdin(keys),
                },
                None => {
                    stdin_open = false;
                    continue;
                }
            },
            _ = winch.recv() => match window_size() {
                Some(size) => Frame::Resize(size),
                None => continue,
            },
        };
        if to_remote.send(binary(frame)).await.is_err() {
            return Sent::Broken;
        }
    }
}

/// Attaches the local terminal to `socket` until the remote program ends, the user detaches,
/// or the tunnel breaks. What is typed goes out on a task of its own; the remote's output is
/// written here.
pub async fn attach(socket: Socket) -> Result<Outcome, CliError> {
    let (to_remote, mut from_remote) = socket.split();
    let winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        .map_err(|e| CliError::new("INTERNAL", format!("watching the window size: {e}")))?;
    let raw = RawTerminal::enter();
    let detaching = Arc::new(AtomicBool::new(false));
    let mut sending = tokio::spawn(send_terminal(to_remote, winch, detaching.clone()));
    // A send that failed (the remote closed) does not end the console: its status may follow.
    let mut sending_done = false;
    let mut stdout = std::io::stdout();
    let outcome = loop {
        tokio::select! {
            sent = &mut sending, if !sending_done => match sent {
                Ok(Sent::Detached) => break Outcome::Detached,
                Ok(Sent::Broken) | Err(_) => sending_done = true,
            },
            message = from_remote.next() => match message {
                Some(Ok(Message::Binary(bytes))) => match Frame::decode(&bytes) {
                    Ok(Frame::Data { channel: wire::CHANNEL_STDERR, bytes }) => {
                        let _ = std::io::stderr().write_all(&bytes);
                    }
                    Ok(Frame::Data { bytes, .. }) => {
                        let _ = stdout.write_all(&bytes).and_then(|()| stdout.flush());
                    }
                    Ok(Frame::Status(end)) => break Outcome::Ended(end),
                    Ok(_) => {}
                    Err(e) => break Outcome::Broken(format!("the server sent a frame that is not the tunnel's: {e}")),
                },
                Some(Ok(Message::Close(frame))) => {
                    break Outcome::Broken(frame.map(|f| f.reason.to_string()).unwrap_or_else(|| "the tunnel closed".into()));
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => break Outcome::Broken(format!("the tunnel broke: {e}")),
                None => break Outcome::Broken("the tunnel closed".into()),
            },
        }
    };
    sending.abort();
    drop(raw);
    // The server's answer to a detach's close can come before the sending task says it is done.
    if matches!(outcome, Outcome::Broken(_)) && detaching.load(Ordering::Acquire) {
        return Ok(Outcome::Detached);
    }
    Ok(outcome)
}

/// Bytes held between a reader and a writer, counted, so that either side can be bounded.
/// Bytes are added before they are handed to the other task and removed by it once passed on,
/// so a removal never comes before its addition: handed over first, the other side (on another
/// worker thread) could take them off before they were counted, and the count went below zero
/// (a panic in a debug build; in a release build a wrapped count that could miss the wake-up
/// of a paused reader and stall its connection).
#[derive(Default)]
pub struct Held {
    bytes: AtomicUsize,
    /// Woken when the count drops below the resume mark.
    drained: Notify,
}

impl Held {
    pub fn now(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// Counts `n` more; the count now.
    fn add(&self, n: usize) -> usize {
        self.bytes.fetch_add(n, Ordering::AcqRel) + n
    }

    /// Counts `n` fewer, waking a reader waiting for fewer than `resume_below`.
    fn remove(&self, n: usize, resume_below: usize) {
        let left = self.bytes.fetch_sub(n, Ordering::AcqRel) - n;
        if left < resume_below {
            self.drained.notify_waiters();
        }
    }

    /// Returns once fewer than `below` are held.
    async fn wait_below(&self, below: usize) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.now() < below {
                return;
            }
            drained.await;
        }
    }
}

/// How one forwarded connection ended.
#[derive(Debug, PartialEq, Eq)]
pub enum PumpEnd {
    /// The remote end closed (`Success`), or the local peer did and the remote acknowledged.
    Closed,
    /// The tunnel ended with a failure, with its message.
    Failed(String),
    /// Writing to the local connection failed: its peer went away.
    LocalGone,
}

/// What goes out on the socket: a data frame of `n` payload bytes, or the end of the local side.
enum Outgoing {
    Data(Vec<u8>),
    Closed,
}

/// Carries one local connection over a `tcp` tunnel's socket until either end closes it (see
/// the module's invariants for the bounds). `unsent` and `behind` are the connection's counts,
/// given so that a caller (a test) can watch them.
pub async fn pump<S>(local: tokio::net::TcpStream, socket: WebSocketStream<S>, unsent: Arc<Held>, behind: Arc<Held>) -> PumpEnd
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (local_read, local_write) = local.into_split();
    let (to_remote, from_remote) = socket.split();
    let (outgoing, queued) = mpsc::unbounded_channel::<Outgoing>();
    let (incoming, delivered) = mpsc::unbounded_channel::<Bytes>();
    let mut reading = tokio::spawn(read_local(local_read, outgoing, unsent.clone()));
    let sending = tokio::spawn(send_remote(to_remote, queued, unsent));
    let mut writing = tokio::spawn(write_local(local_write, delivered, behind.clone()));
    let mut receiving = tokio::spawn(receive_remote(from_remote, incoming, behind));
    let failed = |e: tokio::task::JoinError| PumpEnd::Failed(format!("the tunnel's reader failed: {e}"));
    let (end, writer_done) = tokio::select! {
        end = &mut receiving => (end.unwrap_or_else(failed), false),
        // The writer ends by itself only once the receiver is done, or when the peer is gone.
        written = &mut writing => match written {
            Ok(Ok(())) => ((&mut receiving).await.unwrap_or_else(failed), true),
            Ok(Err(())) | Err(_) => (PumpEnd::LocalGone, true),
        },
        // The local peer ended its side (`[255, 0]` is sent): the remote's end follows, within
        // a bound.
        _ = &mut reading => match tokio::time::timeout(Duration::from_secs(LOCAL_DRAIN_TIMEOUT_S), &mut receiving).await {
            Ok(end) => (end.unwrap_or_else(failed), false),
            Err(_) => (PumpEnd::Failed(format!("the tunnel did not end within {LOCAL_DRAIN_TIMEOUT_S} s of the local side's")), false),
        },
    };
    let end = match (end, writer_done) {
        // What the remote sent before its end reaches the local peer, within a bound.
        (PumpEnd::Closed, false) => match tokio::time::timeout(Duration::from_secs(LOCAL_DRAIN_TIMEOUT_S), &mut writing).await {
            Ok(Ok(Ok(()))) => PumpEnd::Closed,
            _ => PumpEnd::LocalGone,
        },
        (end, _) => end,
    };
    for task in [reading, sending] {
        task.abort();
    }
    receiving.abort();
    writing.abort();
    end
}

/// Reads the local connection into frames, pausing above the unsent mark; at its end, says so.
/// A frame is read in place (its channel byte, then the read); one the read filled less than
/// half is copied out at its size, so what is held stays within twice what is counted.
async fn read_local(mut local: tokio::net::tcp::OwnedReadHalf, outgoing: mpsc::UnboundedSender<Outgoing>, unsent: Arc<Held>) {
    loop {
        // Read into the spare capacity: nothing is zeroed first.
        let mut frame = Vec::with_capacity(1 + CHUNK_BYTES);
        frame.push(wire::CHANNEL_STDIN);
        let n = match local.read_buf(&mut frame).await {
            Ok(0) | Err(_) => {
                let _ = outgoing.send(Outgoing::Closed);
                return;
            }
            Ok(n) => n,
        };
        if n < CHUNK_BYTES / 2 {
            frame.shrink_to_fit();
        }
        // Counted before it is handed over: the sender takes it off once sent.
        let held = unsent.add(n);
        if outgoing.send(Outgoing::Data(frame)).is_err() {
            return;
        }
        if held > UNSENT_PAUSE_ABOVE_BYTES {
            unsent.wait_below(UNSENT_RESUME_BELOW_BYTES).await;
        }
    }
}

/// Sends the queued frames, as many as are queued before each flush; the local side's end is
/// `[255, 0]` (the tunnel has no half-close: the remote then ends the connection).
async fn send_remote<W>(mut to_remote: W, mut queued: mpsc::UnboundedReceiver<Outgoing>, unsent: Arc<Held>)
where
    W: futures::Sink<Message> + Unpin,
{
    while let Some(first) = queued.recv().await {
        let mut next = Some(first);
        while let Some(outgoing) = next {
            let (message, n) = match outgoing {
                Outgoing::Data(frame) => {
                    let n = frame.len() - 1;
                    (Message::Binary(frame.into()), n)
                }
                Outgoing::Closed => (binary(Frame::Close(wire::CHANNEL_STDIN)), 0),
            };
            if to_remote.feed(message).await.is_err() {
                return;
            }
            unsent.remove(n, UNSENT_RESUME_BELOW_BYTES);
            next = queued.try_recv().ok();
        }
        if to_remote.flush().await.is_err() {
            return;
        }
    }
}

/// Reads the socket: channel 1's bytes go to the local writer, pausing above the behind mark;
/// the status ends it.
async fn receive_remote<R>(mut from_remote: R, incoming: mpsc::UnboundedSender<Bytes>, behind: Arc<Held>) -> PumpEnd
where
    R: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    loop {
        let bytes = match from_remote.next().await {
            Some(Ok(Message::Binary(bytes))) => bytes,
            Some(Ok(Message::Close(frame))) => {
                let why = frame.map(|f| f.reason.to_string()).filter(|r| !r.is_empty());
                return PumpEnd::Failed(why.unwrap_or_else(|| "the tunnel closed without a status".into()));
            }
            Some(Ok(Message::Text(_))) => return PumpEnd::Failed("the server sent a text message".into()),
            Some(Ok(_)) => continue,
            Some(Err(e)) => return PumpEnd::Failed(format!("the tunnel broke: {e}")),
            None => return PumpEnd::Failed("the tunnel closed without a status".into()),
        };
        if bytes.first() == Some(&wire::CHANNEL_STDOUT) {
            // Copied out at its size: a slice would hold the socket's larger read buffer.
            let data = Bytes::copy_from_slice(&bytes[1..]);
            // Counted before it is handed over: the writer takes it off once written.
            let held = behind.add(data.len());
            if incoming.send(data).is_err() {
                return PumpEnd::LocalGone;
            }
            if held > BEHIND_PAUSE_ABOVE_BYTES {
                behind.wait_below(BEHIND_RESUME_BELOW_BYTES).await;
            }
            continue;
        }
        match Frame::decode(&bytes) {
            Ok(Frame::Status(End::Exited(0))) => return PumpEnd::Closed,
            Ok(Frame::Status(End::Exited(code))) => return PumpEnd::Failed(format!("the tunnel ended with status {code}")),
            Ok(Frame::Status(End::Broken { message, .. })) => return PumpEnd::Failed(message),
            Ok(_) => {}
            Err(e) => return PumpEnd::Failed(format!("the server sent a frame that is not the tunnel's: {e}")),
        }
    }
}

/// Writes what the tunnel delivered to the local connection; at the end (the receiver gone),
/// ends the connection.
async fn write_local(
    mut local: tokio::net::tcp::OwnedWriteHalf,
    mut delivered: mpsc::UnboundedReceiver<Bytes>,
    behind: Arc<Held>,
) -> Result<(), ()> {
    while let Some(bytes) = delivered.recv().await {
        local.write_all(&bytes).await.map_err(|_| ())?;
        behind.remove(bytes.len(), BEHIND_RESUME_BELOW_BYTES);
    }
    let _ = local.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICKET: &str = "bctt_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";

    /// The socket is on the API's own scheme, host, port and path; the server's `url` is never
    /// used, and a ticket that is not one is refused before anything is joined.
    #[test]
    fn the_socket_is_built_from_the_apis_own_url() {
        let api = url::Url::parse("http://127.0.0.1:7070").unwrap();
        assert_eq!(tunnel_url(&api, TICKET).unwrap().as_str(), format!("http://127.0.0.1:7070/tunnels/{TICKET}"));
        let api = url::Url::parse("https://compute.example.com/base/?x=1").unwrap();
        assert_eq!(tunnel_url(&api, TICKET).unwrap().as_str(), format!("https://compute.example.com/base/tunnels/{TICKET}"));
        for bad in ["//evil.example/x", "../x", "bctt_short", &format!("{}/", &TICKET[..TICKET.len() - 1])] {
            assert_eq!(tunnel_url(&api, bad).unwrap_err().code, "INVALID_RESPONSE", "{bad}");
        }
        let answer = serde_json::json!({ "ticket": TICKET, "url": "https://evil.example/steal" });
        assert_eq!(ticket_of(&answer).unwrap(), TICKET);
        assert!(ticket_of(&serde_json::json!({ "url": "/tunnels/x" })).is_err());
    }

    /// A WebSocket pair on loopback: the server's end (standing for the gateway) and the
    /// client's, as `pump` gets it.
    async fn socket_pair() -> (WebSocketStream<tokio::net::TcpStream>, WebSocketStream<tokio::net::TcpStream>) {
        let listener = small_buffered_listener();
        let address = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            tokio_tungstenite::accept_async(tcp).await.unwrap()
        });
        let tcp = small_buffered_connect(address).await;
        let (client, _) = tokio_tungstenite::client_async(format!("ws://{address}/"), tcp).await.unwrap();
        (server.await.unwrap(), client)
    }

    /// A local connection pair: the end `pump` carries, and the local peer's.
    async fn local_pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = small_buffered_listener();
        let peer = small_buffered_connect(listener.local_addr().unwrap()).await;
        (listener.accept().await.unwrap().0, peer)
    }

    /// The kernel's buffers on loopback grow to `tcp_rmem`'s maximum (32 MiB here), enough to
    /// hold a whole test's transfer and hide the tunnel's own bounds: the tests' sockets have
    /// fixed small buffers (which turns the growth off).
    const SOCKET_BUFFER_BYTES: u32 = 256 * 1024;

    fn small_buffered_listener() -> tokio::net::TcpListener {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES).unwrap();
        socket.set_send_buffer_size(SOCKET_BUFFER_BYTES).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        socket.listen(16).unwrap()
    }

    async fn small_buffered_connect(address: std::net::SocketAddr) -> tokio::net::TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES).unwrap();
        socket.set_send_buffer_size(SOCKET_BUFFER_BYTES).unwrap();
        socket.connect(address).await.unwrap()
    }

    fn start_pump(
        local: tokio::net::TcpStream,
        socket: WebSocketStream<tokio::net::TcpStream>,
    ) -> (Arc<Held>, Arc<Held>, tokio::task::JoinHandle<PumpEnd>) {
        let (unsent, behind) = (Arc::new(Held::default()), Arc::new(Held::default()));
        (unsent.clone(), behind.clone(), tokio::spawn(pump(local, socket, unsent, behind)))
    }

    /// While the tunnel takes nothing, the local connection is read up to the pause mark and no
    /// further; once the tunnel drains it below the resume mark, reading goes on, and every byte
    /// arrives in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_local_socket_pauses_above_the_unsent_mark_and_resumes_below_the_other() {
        let (mut server, client) = socket_pair().await;
        let (local, mut peer) = local_pair().await;
        let (unsent, _, pumping) = start_pump(local, client);
        const TOTAL: usize = 24 * 1024 * 1024;
        let pattern: Vec<u8> = (0..TOTAL).map(|i| (i % 251) as u8).collect();
        let expected = pattern.clone();
        let writer = tokio::spawn(async move { peer.write_all(&pattern).await.map(|()| peer) });
        // The server reads nothing: the unsent bytes rise to the mark (once the kernel's buffers
        // are full, however long that takes on a busy machine) and stay there.
        let mut peak = 0;
        let mut after_rise = 0;
        for _ in 0..400 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            peak = peak.max(unsent.now());
            if peak > UNSENT_PAUSE_ABOVE_BYTES / 2 {
                after_rise += 1;
                if after_rise == 20 {
                    break;
                }
            }
        }
        assert!(peak > UNSENT_PAUSE_ABOVE_BYTES / 2, "the local socket was read: {peak}");
        assert!(peak <= UNSENT_PAUSE_ABOVE_BYTES + CHUNK_BYTES, "paused above the mark: {peak}");
        assert!(!writer.is_finished(), "the local writer is held back");
        // The server reads: everything arrives, in order.
        let mut received = Vec::with_capacity(TOTAL);
        while received.len() < TOTAL {
            match tokio::time::timeout(Duration::from_secs(20), server.next()).await.unwrap().unwrap().unwrap() {
                Message::Binary(frame) => {
                    assert_eq!(frame[0], wire::CHANNEL_STDIN);
                    assert!(frame.len() <= 1 + CHUNK_BYTES);
                    received.extend_from_slice(&frame[1..]);
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(received == expected, "the bytes arrived in order");
        drop(writer.await.unwrap().unwrap());
        // The local peer's end is [255, 0].
        let closed = tokio::time::timeout(Duration::from_secs(10), server.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(closed, Message::Binary(Frame::Close(wire::CHANNEL_STDIN).encode().into()));
        server.send(binary(Frame::Close(wire::CHANNEL_STDOUT))).await.unwrap();
        server.send(binary(Frame::Status(End::Exited(0)))).await.unwrap();
        assert_eq!(tokio::time::timeout(Duration::from_secs(10), pumping).await.unwrap().unwrap(), PumpEnd::Closed);
    }

    /// A local reader that reads nothing pauses the socket once the named mark is behind: the
    /// bytes held for it never pass that mark by more than a frame, and the remote's sends stop
    /// (its socket fills); once the reader reads again everything arrives, in order, and the
    /// connection goes on. A slow reader is slowed, never cut off.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_local_reader_that_stops_reading_pauses_the_socket_until_it_reads_again() {
        let (mut server, client) = socket_pair().await;
        let (local, mut peer) = local_pair().await;
        let (_, behind, pumping) = start_pump(local, client);
        // Frame i is CHUNK_BYTES of the byte i % 251.
        let sent = Arc::new(AtomicUsize::new(0));
        let flood = tokio::spawn({
            let sent = sent.clone();
            async move {
                for i in 0usize.. {
                    let frame = binary(Frame::stdout(vec![(i % 251) as u8; CHUNK_BYTES]));
                    if server.send(frame).await.is_err() {
                        return;
                    }
                    sent.store(i + 1, Ordering::Release);
                }
            }
        });
        // The remote's sends stop: nothing more is sent for a second while the peer reads nothing.
        let mut peak = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut last = (usize::MAX, tokio::time::Instant::now());
        loop {
            peak = peak.max(behind.now());
            assert!(!pumping.is_finished(), "the connection goes on while its reader pauses");
            let now = sent.load(Ordering::Acquire);
            if now != last.0 {
                last = (now, tokio::time::Instant::now());
            } else if last.1.elapsed() > Duration::from_secs(1) && peak > BEHIND_PAUSE_ABOVE_BYTES / 2 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "the remote was never held back: {now} frames sent");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(peak <= BEHIND_PAUSE_ABOVE_BYTES + CHUNK_BYTES, "{peak}");
        let held_back = last.0;
        // The reader reads again: 64 MiB more than was sent before it, every byte in place.
        let wanted = (held_back + (64 << 20) / CHUNK_BYTES) * CHUNK_BYTES;
        let mut buffer = vec![0u8; 1 << 20];
        let mut read = 0usize;
        while read < wanted {
            let n = tokio::time::timeout(Duration::from_secs(20), peer.read(&mut buffer)).await.expect("the bytes come").unwrap();
            assert!(n > 0, "the local connection ended after {read} bytes");
            for (k, byte) in buffer[..n].iter().enumerate() {
                let at = read + k;
                assert_eq!(*byte, ((at / CHUNK_BYTES) % 251) as u8, "byte {at} is in its place");
            }
            read += n;
        }
        assert!(!pumping.is_finished(), "the connection goes on");
        flood.abort();
        pumping.abort();
    }

    /// The remote end closing (`[255, 1]`, `Success`) delivers what it sent, then ends the local
    /// connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_remote_closing_ends_the_local_connection_after_its_bytes() {
        let (mut server, client) = socket_pair().await;
        let (local, mut peer) = local_pair().await;
        let (_, _, pumping) = start_pump(local, client);
        server.send(binary(Frame::stdout(b"last words".to_vec()))).await.unwrap();
        server.send(binary(Frame::Close(wire::CHANNEL_STDOUT))).await.unwrap();
        server.send(binary(Frame::Status(End::Exited(0)))).await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), peer.read_to_end(&mut got)).await.unwrap().unwrap();
        assert_eq!(got, b"last words");
        assert_eq!(pumping.await.unwrap(), PumpEnd::Closed);
        // A failure is said, with its message.
        let (mut server, client) = socket_pair().await;
        let (local, _peer) = local_pair().await;
        let (_, _, pumping) = start_pump(local, client);
        let refused = End::Broken { message: "port 5432 could not be reached".into(), timeout: false };
        server.send(binary(Frame::Status(refused))).await.unwrap();
        assert_eq!(pumping.await.unwrap(), PumpEnd::Failed("port 5432 could not be reached".into()));
    }

    #[test]
    fn exit_statuses() {
        assert_eq!(Outcome::Ended(End::Exited(7)).exit_status(), 7);
        assert_eq!(Outcome::Ended(End::Broken { message: String::new(), timeout: true }).exit_status(), 255);
        assert_eq!(Outcome::Broken(String::new()).exit_status(), 255);
        assert_eq!(Outcome::Detached.exit_status(), 0);
    }
}
