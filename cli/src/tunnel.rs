//! The client's end of a tunnel (`schema/TUNNELS.md`): `console`'s WebSocket, the terminal in
//! raw mode until the remote program exits, resizes followed (SIGWINCH), Ctrl-] to detach. The
//! command exits with the remote program's status, 255 when the tunnel broke (`REMOTE_EXIT`).

use std::io::{Read, Write};

use bc_core::tunnel::{self as wire, End, Frame, WindowSize};
use futures::{SinkExt, StreamExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;

use crate::client::CliError;

/// The key that detaches (Ctrl-], as telnet and `docker attach`).
pub const DETACH_BYTE: u8 = 0x1d;
/// Bytes read from the terminal at once.
const READ_BYTES: usize = 4096;

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

/// The WebSocket address of a ticket's `url`, on the API's own scheme, host and port.
pub fn socket_url(api: &url::Url, path: &str) -> Result<url::Url, CliError> {
    let mut url = api.join(path).map_err(|e| CliError::new("INVALID_RESPONSE", format!("the ticket's url {path:?}: {e}")))?;
    let scheme = match api.scheme() {
        "https" => "wss",
        _ => "ws",
    };
    url.set_scheme(scheme).map_err(|()| CliError::new("INTERNAL", "setting the WebSocket scheme"))?;
    Ok(url)
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

/// Opens the WebSocket of `url` with `token` and `v5.channel.k8s.io`; a refusal is the server's
/// error.
async fn connect(
    url: &url::Url,
    token: &str,
) -> Result<tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>, CliError> {
    if url.scheme() == "wss" {
        return Err(CliError::new("UNSUPPORTED", "this client opens tunnels over plain ws:// (loopback) only for now")
            .hint("reach the gateway on a loopback address, or use a WebSocket client that speaks schema/TUNNELS.md"));
    }
    let mut request =
        url.as_str().into_client_request().map_err(|e| CliError::new("INTERNAL", format!("the WebSocket request: {e}")))?;
    let auth =
        HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| CliError::usage("the token is not a header value"))?;
    request.headers_mut().insert("authorization", auth);
    request.headers_mut().insert("sec-websocket-protocol", HeaderValue::from_static(wire::SUBPROTOCOL));
    match tokio_tungstenite::connect_async(request).await {
        Ok((socket, response)) => {
            let chosen = response.headers().get("sec-websocket-protocol").and_then(|v| v.to_str().ok());
            if chosen != Some(wire::SUBPROTOCOL) {
                return Err(CliError::new(
                    "INVALID_RESPONSE",
                    format!("the server chose the subprotocol {chosen:?}, not {}", wire::SUBPROTOCOL),
                ));
            }
            Ok(socket)
        }
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            let status = response.status();
            let body: serde_json::Value =
                response.body().as_ref().and_then(|b| serde_json::from_slice(b).ok()).unwrap_or(serde_json::Value::Null);
            let code = body["code"].as_str().unwrap_or("UNAVAILABLE");
            let message = body["message"].as_str().map(str::to_owned).unwrap_or_else(|| format!("the server answered {status}"));
            let mut error = CliError::new(code, message);
            error.hint = body["details"]["hint"].as_str().map(str::to_owned);
            Err(error)
        }
        Err(e) => Err(CliError::new("UNAVAILABLE", format!("cannot open the tunnel's WebSocket: {e}"))),
    }
}

/// Attaches the local terminal to the tunnel at `url` until the remote program ends, the user
/// detaches, or the tunnel breaks.
pub async fn attach(url: &url::Url, token: &str) -> Result<Outcome, CliError> {
    let socket = connect(url, token).await?;
    let (mut to_remote, mut from_remote) = socket.split();
    let raw = RawTerminal::enter();
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        .map_err(|e| CliError::new("INTERNAL", format!("watching the window size: {e}")))?;
    if let Some(size) = window_size() {
        let _ = to_remote.send(Message::Binary(Frame::Resize(size).encode().into())).await;
    }
    let mut typed = read_stdin();
    let mut stdin_open = true;
    let mut stdout = std::io::stdout();
    let outcome = loop {
        tokio::select! {
            keys = typed.recv(), if stdin_open => match keys {
                Some(keys) => {
                    let (before, detach) = match keys.iter().position(|b| *b == DETACH_BYTE) {
                        Some(at) => (&keys[..at], true),
                        None => (&keys[..], false),
                    };
                    if !before.is_empty() && to_remote.send(Message::Binary(Frame::stdin(before.to_vec()).encode().into())).await.is_err() {
                        break Outcome::Broken("the tunnel closed".into());
                    }
                    if detach {
                        let _ = to_remote.send(Message::Close(None)).await;
                        break Outcome::Detached;
                    }
                }
                None => stdin_open = false,
            },
            _ = winch.recv() => {
                if let Some(size) = window_size() {
                    let _ = to_remote.send(Message::Binary(Frame::Resize(size).encode().into())).await;
                }
            }
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
    drop(raw);
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_is_on_the_apis_own_host() {
        let api = url::Url::parse("http://127.0.0.1:7070").unwrap();
        assert_eq!(socket_url(&api, "/tunnels/bctt_x").unwrap().as_str(), "ws://127.0.0.1:7070/tunnels/bctt_x");
        let api = url::Url::parse("https://compute.example.com/").unwrap();
        assert_eq!(socket_url(&api, "/tunnels/bctt_x").unwrap().as_str(), "wss://compute.example.com/tunnels/bctt_x");
    }

    #[test]
    fn exit_statuses() {
        assert_eq!(Outcome::Ended(End::Exited(7)).exit_status(), 7);
        assert_eq!(Outcome::Ended(End::Broken { message: String::new(), timeout: true }).exit_status(), 255);
        assert_eq!(Outcome::Broken(String::new()).exit_status(), 255);
        assert_eq!(Outcome::Detached.exit_status(), 0);
    }
}
