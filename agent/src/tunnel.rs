//! The agent's end of a tunnel (`schema/TUNNELS.md`): IO, at the edge, apart from the session's
//! state machine. The gateway asks on the session stream (`OpenTunnel`); the driver calls
//! [`attach`], which opens a `Tunnel` call on the same connection carrying the tunnel's id and
//! relays frames between it and the op's end:
//!
//! - `console` on the node: [`console`], a login shell (`/bin/sh -l`) on a new pseudo-terminal,
//!   as the user `bcd` runs as; resizes applied to the terminal; the shell's exit status sent as
//!   channel 3, then the call ends. The gateway ending the call hangs the shell up.
//! - `console` on an instance: its serial console, as the hypervisor hands it
//!   (`Hypervisor::serial_console`): bytes both ways ([`relay_bytes`]); resizes and `[255, 0]`
//!   are ignored (a serial line has neither).
//! - `tcp` on an instance: a TCP connection to the port of the guest the hypervisor names
//!   (`Hypervisor::guest_address`), dialled within [`DIAL_TIMEOUT_MS`]: plain bytes, channel 0
//!   to the guest and channel 1 from it ([`relay_bytes`]); `[255, 0]` from the client ends the
//!   connection (no half-close).
//! - `exec` on an instance, or an instance op on a node whose hypervisor reaches no guest: a
//!   `Failure` status.
//!
//! Invariants: only a domain the hypervisor reports running is dialled. A byte stream's end is
//! always `[255, 1]` then a status: `Success` when the guest closed or the client ended it,
//! `Failure` when the guest's side failed; a refusal is a `Failure` status alone. Nothing
//! typed or printed is logged or kept: bytes pass through bounded channels only (each way at
//! most [`FRAMES_QUEUED`] frames of at most `DATA_BYTES_MAX`).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bc_core::tunnel::{self as wire, End, Frame, Op, WindowSize};
use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::hypervisor::{DomainState, Hypervisor, SerialConsole};

/// Frames queued each way: a slow side holds the other back rather than growing a buffer.
pub const FRAMES_QUEUED: usize = 16;
/// After the shell exits, its last output is read for at most this long before the status.
pub const DRAIN_AFTER_EXIT_MS: u64 = 2_000;
/// The terminal's size until the client's first resize.
pub const INITIAL_SIZE: WindowSize = WindowSize { width: 80, height: 24 };
/// The shell a console runs, as a login shell.
pub const SHELL: &str = "/bin/sh";
/// A guest's port (or its console's TCP endpoint) must accept the connection within this.
pub const DIAL_TIMEOUT_MS: u64 = 5_000;
/// What the bytes between a libvirt console stream and the relay pass through (a pipe in
/// memory): the most held there each way.
pub const CONSOLE_PIPE_BYTES: usize = 64 * 1024;

fn pty_size(size: WindowSize) -> portable_pty::PtySize {
    portable_pty::PtySize { rows: size.height, cols: size.width, pixel_width: 0, pixel_height: 0 }
}

/// Runs a console: a login shell on a new pseudo-terminal, fed by the frames `from_gateway`
/// gives, its output and finally its exit status sent to `to_gateway`. Returns when the shell
/// exited (its status sent) or the gateway's side ended (the shell is killed).
pub async fn console<S, B>(mut from_gateway: S, to_gateway: mpsc::Sender<Vec<u8>>)
where
    S: Stream<Item = B> + Unpin,
    B: AsRef<[u8]>,
{
    let broken = |message: String| Frame::Status(End::Broken { message, timeout: false }).encode();
    let system = portable_pty::native_pty_system();
    let pair = match system.openpty(pty_size(INITIAL_SIZE)) {
        Ok(pair) => pair,
        Err(e) => {
            let _ = to_gateway.send(broken(format!("the node could not open a pseudo-terminal: {e}"))).await;
            return;
        }
    };
    let mut command = portable_pty::CommandBuilder::new(SHELL);
    command.arg("-l");
    command.env("TERM", std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into()));
    if let Some(home) = std::env::var_os("HOME") {
        command.cwd(home);
    }
    let mut child = match pair.slave.spawn_command(command) {
        Ok(child) => child,
        Err(e) => {
            let _ = to_gateway.send(broken(format!("the node could not start {SHELL}: {e}"))).await;
            return;
        }
    };
    // Only the shell holds the terminal's other side now, so the reader sees its end.
    drop(pair.slave);
    let master = pair.master;
    let (reader, writer) = match (master.try_clone_reader(), master.take_writer()) {
        (Ok(reader), Ok(writer)) => (reader, writer),
        (Err(e), _) | (_, Err(e)) => {
            let _ = child.kill();
            let _ = to_gateway.send(broken(format!("the node could not attach the terminal: {e}"))).await;
            return;
        }
    };
    let mut killer = child.clone_killer();
    let output = tokio::task::spawn_blocking({
        let to_gateway = to_gateway.clone();
        move || read_terminal(reader, to_gateway)
    });
    let (keys, typed) = mpsc::channel::<Vec<u8>>(FRAMES_QUEUED);
    let input = tokio::task::spawn_blocking(move || write_terminal(writer, typed));
    let mut exited = tokio::task::spawn_blocking(move || child.wait());
    let status = loop {
        tokio::select! {
            waited = &mut exited => break Some(waited),
            frame = from_gateway.next() => match frame.map(|bytes| Frame::decode(bytes.as_ref())) {
                Some(Ok(Frame::Data { channel: wire::CHANNEL_STDIN, bytes })) => {
                    if keys.send(bytes).await.is_err() {
                        continue;
                    }
                }
                Some(Ok(Frame::Resize(size))) => {
                    if let Err(e) = master.resize(pty_size(size)) {
                        tracing::debug!(error = %e, "a console's resize failed");
                    }
                }
                // A terminal has no end of input: the user types Ctrl-D.
                Some(Ok(Frame::Close(_))) => {}
                Some(Ok(_)) | Some(Err(_)) | None => break None,
            },
        }
    };
    drop(keys);
    let Some(waited) = status else {
        // The gateway's side ended: hang the shell up.
        let _ = killer.kill();
        drop(master);
        let _ = exited.await;
        let _ = input.await;
        output.abort();
        return;
    };
    // The shell's last output before its status.
    let _ = tokio::time::timeout(std::time::Duration::from_millis(DRAIN_AFTER_EXIT_MS), output).await;
    drop(master);
    let end = match waited {
        Ok(Ok(status)) => End::Exited(u8::try_from(status.exit_code()).unwrap_or(255)),
        Ok(Err(e)) => End::Broken { message: format!("waiting for the shell failed: {e}"), timeout: false },
        Err(e) => End::Broken { message: format!("waiting for the shell failed: {e}"), timeout: false },
    };
    let _ = to_gateway.send(Frame::Status(end).encode()).await;
    let _ = input.await;
}

/// Reads the terminal's output into stdout frames until it ends (the shell and everything it
/// started closed it) or the gateway's side is gone.
fn read_terminal(mut reader: Box<dyn Read + Send>, to_gateway: mpsc::Sender<Vec<u8>>) {
    let mut buffer = vec![0u8; wire::DATA_BYTES_MAX];
    loop {
        match reader.read(&mut buffer) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if to_gateway.blocking_send(Frame::stdout(buffer[..n].to_vec()).encode()).is_err() {
                    return;
                }
            }
        }
    }
}

/// Writes what the client typed to the terminal until the console ends.
fn write_terminal(mut writer: Box<dyn Write + Send>, mut typed: mpsc::Receiver<Vec<u8>>) {
    while let Some(bytes) = typed.blocking_recv() {
        if writer.write_all(&bytes).and_then(|()| writer.flush()).is_err() {
            return;
        }
    }
}

/// Opens the `Tunnel` call the gateway asked for with `open`, on `channel` (the session's own
/// connection), its first message carrying the tunnel's id, and relays it to the op's end until
/// either side ends. `guests` holds the node's hypervisor, if it runs instances: what instance
/// ops reach. An op this agent does not attach is answered with a `Failure` status.
pub async fn attach(channel: tonic::transport::Channel, open: bc_proto::OpenTunnel, guests: Arc<dyn Guests>) {
    let (to_gateway, from_end) = mpsc::channel::<Vec<u8>>(FRAMES_QUEUED);
    let first = bc_proto::TunnelFrame { tunnel_id: open.tunnel_id, frame: Default::default() };
    // A frame's `Vec` becomes the message's `Bytes` without a copy.
    let frames = tokio_stream::wrappers::ReceiverStream::new(from_end)
        .map(|frame| bc_proto::TunnelFrame { tunnel_id: Vec::new(), frame: frame.into() });
    let outbound = futures::stream::iter([first]).chain(frames);
    let mut client = bc_proto::agent_client::AgentClient::new(channel)
        .max_decoding_message_size(bc_proto::MESSAGE_BYTES_MAX)
        .max_encoding_message_size(bc_proto::MESSAGE_BYTES_MAX);
    let inbound = match client.tunnel(outbound).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::warn!(code = ?status.code(), error = %status.message(), "a tunnel's call was refused");
            return;
        }
    };
    let mut from_gateway = Box::pin(
        inbound.take_while(|m| std::future::ready(m.is_ok())).filter_map(|m| std::future::ready(m.ok().map(|f| f.frame))),
    );
    let op = Op::parse(&open.op);
    match op {
        Some(Op::Exec) if open.instance_id.starts_with(bc_core::id::SandboxId::PREFIX) => match guests.sandboxes() {
            Some(sandboxes) => {
                tracing::info!(sandbox = %open.instance_id, "a sandbox exec tunnel opened");
                sandboxes.exec(&open.instance_id, &open.command, &mut from_gateway, to_gateway).await;
                tracing::info!(sandbox = %open.instance_id, "a sandbox exec tunnel ended");
            }
            None => {
                let _ = to_gateway.send(broken("this node runs no sandboxes (no runsc)".into())).await;
            }
        },
        Some(Op::Console) if open.instance_id.is_empty() => {
            tracing::info!("a console tunnel opened");
            console(&mut from_gateway, to_gateway).await;
            tracing::info!("a console tunnel ended");
        }
        Some(op @ (Op::Console | Op::Tcp)) if !open.instance_id.is_empty() => {
            let port = u16::try_from(open.port).unwrap_or(0);
            match reach_guest(guests, op, open.instance_id.clone(), port).await {
                Ok(guest) => {
                    tracing::info!(op = op.as_str(), instance = %open.instance_id, "an instance tunnel opened");
                    let framing = if op == Op::Tcp { Framing::Tcp } else { Framing::Serial };
                    guest.relay(&mut from_gateway, to_gateway, framing).await;
                    tracing::info!(op = op.as_str(), instance = %open.instance_id, "an instance tunnel ended");
                }
                Err(why) => {
                    tracing::info!(op = op.as_str(), instance = %open.instance_id, reason = %why, "an instance tunnel was refused");
                    let _ = to_gateway.send(broken(why)).await;
                }
            }
        }
        _ => {
            let _ = to_gateway.send(refusal(&format!("{} tunnels", open.op))).await;
        }
    }
    // The call lives until the gateway ends it: dropping it now would reset the stream before
    // its last frames (the status) are sent.
    let drained = async { while from_gateway.next().await.is_some() {} };
    let _ = tokio::time::timeout(std::time::Duration::from_millis(CALL_LINGER_MS), drained).await;
}

fn broken(message: String) -> Vec<u8> {
    Frame::Status(End::Broken { message, timeout: false }).encode()
}

/// A guest's end, found and connected, before any byte moves.
pub enum GuestEnd {
    /// A TCP connection: to a port of the guest, or to its console's endpoint.
    Tcp(tokio::net::TcpStream),
    /// libvirt's console stream of the domain.
    #[cfg(feature = "libvirt")]
    Libvirt(virt::stream::Stream),
}

impl GuestEnd {
    /// Relays the guest's bytes and the gateway's frames until either ends (see [`relay_bytes`]).
    pub async fn relay<S, B>(self, from_gateway: S, to_gateway: mpsc::Sender<Vec<u8>>, framing: Framing)
    where
        S: Stream<Item = B> + Unpin,
        B: AsRef<[u8]>,
    {
        match self {
            Self::Tcp(stream) => {
                let (reader, writer) = stream.into_split();
                relay_bytes(reader, writer, from_gateway, to_gateway, framing).await;
            }
            #[cfg(feature = "libvirt")]
            Self::Libvirt(stream) => {
                let (pipe, threads) = libvirt_pipe(stream);
                let (reader, writer) = tokio::io::split(pipe);
                relay_bytes(reader, writer, from_gateway, to_gateway, framing).await;
                // The relay dropped its end of the pipe: the threads abort the stream and end.
                let _ = threads.await;
            }
        }
    }
}

/// What instance tunnels reach: the node's hypervisor, if it runs instances.
pub trait Guests: Send + Sync + 'static {
    fn hypervisor(&self) -> Option<&dyn Hypervisor>;
    /// The node's sandboxes, if it runs any: what `exec` on a sandbox reaches.
    fn sandboxes(&self) -> Option<&crate::sandboxes::Sandboxes> {
        None
    }
}

impl Guests for crate::runner::Agent {
    fn hypervisor(&self) -> Option<&dyn Hypervisor> {
        self.instances.as_ref().map(|instances| instances.hypervisor.as_ref())
    }

    fn sandboxes(&self) -> Option<&crate::sandboxes::Sandboxes> {
        self.sandboxes.as_deref()
    }
}

impl<H: Hypervisor + 'static> Guests for H {
    fn hypervisor(&self) -> Option<&dyn Hypervisor> {
        Some(self)
    }
}

/// Finds and connects instance `instance`'s end of an `op` tunnel (its `port` for `tcp`) on
/// the hypervisor of `guests`: the domain must be running there. The hypervisor's calls block
/// (libvirt), so they run on the blocking pool.
pub async fn reach_guest(guests: Arc<dyn Guests>, op: Op, instance: String, port: u16) -> Result<GuestEnd, String> {
    if instance.parse::<bc_core::id::InstanceId>().is_err() {
        return Err(format!("{instance:?} is not an instance id"));
    }
    let found = tokio::task::spawn_blocking(move || {
        let hypervisor = guests.hypervisor().ok_or("this node has no hypervisor: it runs no instances")?;
        guest_of(hypervisor, op, &instance, port)
    })
    .await
    .map_err(|e| format!("reaching the guest failed: {e}"))??;
    match found {
        Guest::Address(address) => Ok(GuestEnd::Tcp(dial(address, "the instance's port").await?)),
        Guest::Console(SerialConsole::Tcp(address)) => Ok(GuestEnd::Tcp(dial(address, "the instance's serial console").await?)),
        #[cfg(feature = "libvirt")]
        Guest::Console(SerialConsole::Libvirt(stream)) => Ok(GuestEnd::Libvirt(stream)),
    }
}

/// What the hypervisor says an instance tunnel reaches.
pub enum Guest {
    Address(SocketAddr),
    Console(SerialConsole),
}

/// Asks `hypervisor` where instance `instance`'s end of an `op` tunnel is, if it is running.
pub fn guest_of(hypervisor: &dyn Hypervisor, op: Op, instance: &str, port: u16) -> Result<Guest, String> {
    if !hypervisor.reaches_guests() {
        return Err("this node's hypervisor reaches no guest".into());
    }
    match hypervisor.observe(instance)? {
        Some(observed) if observed.state == DomainState::Running => {}
        Some(observed) => return Err(format!("instance {instance} is {} on this node, not running", observed.state.as_str())),
        None => return Err(format!("instance {instance} is not on this node")),
    }
    match op {
        Op::Tcp if port == 0 => Err("a tcp tunnel names no port".into()),
        Op::Tcp => hypervisor.guest_address(instance, port).map(Guest::Address),
        Op::Console => hypervisor.serial_console(instance).map(Guest::Console),
        Op::Exec => Err("this node runs no command in a guest until guests have an agent".into()),
    }
}

/// Connects to `address` (`what`, for the message) within [`DIAL_TIMEOUT_MS`].
async fn dial(address: SocketAddr, what: &str) -> Result<tokio::net::TcpStream, String> {
    let connect = tokio::net::TcpStream::connect(address);
    let stream = match tokio::time::timeout(Duration::from_millis(DIAL_TIMEOUT_MS), connect).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return Err(format!("{what} ({address}) could not be reached: {e}")),
        Err(_) => return Err(format!("{what} ({address}) did not answer within {DIAL_TIMEOUT_MS} ms")),
    };
    // Keystrokes on a console, and small requests, go at once.
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// What the client's `[255, 0]` means to a byte stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    /// A TCP connection has no half-close: it ends the connection.
    Tcp,
    /// A serial line has no end of input: ignored (as the node's console ignores it).
    Serial,
}

/// How the guest's side of a byte stream ended.
enum GuestClosed {
    /// It closed the connection.
    Closed,
    /// Reading it failed.
    Failed(String),
    /// The gateway's side is gone: nothing more is sent.
    GatewayGone,
}

/// Relays a byte stream: the guest's bytes to the gateway as channel 1 (a task of its own, so
/// a guest that does not read never holds its output back), the gateway's channel 0 to the
/// guest. Ends when the guest closes (`[255, 1]`, then `Success`), its side fails (`[255, 1]`,
/// then a `Failure`), the client ends a `tcp` stream with `[255, 0]` (`[255, 1]`, then
/// `Success`), or the gateway's side ends (nothing more is sent).
pub async fn relay_bytes<R, W, S, B>(
    reader: R,
    mut writer: W,
    mut from_gateway: S,
    to_gateway: mpsc::Sender<Vec<u8>>,
    framing: Framing,
) where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin,
    S: Stream<Item = B> + Unpin,
    B: AsRef<[u8]>,
{
    let mut outbound = tokio::spawn(guest_to_gateway(reader, to_gateway.clone()));
    let ended = loop {
        tokio::select! {
            closed = &mut outbound => break closed.unwrap_or_else(|e| GuestClosed::Failed(format!("reading the guest failed: {e}"))),
            frame = from_gateway.next() => match frame {
                None => break GuestClosed::GatewayGone,
                // The hot path: a data frame's payload written as it came, without a copy.
                Some(frame) if frame.as_ref().first() == Some(&wire::CHANNEL_STDIN) => {
                    if let Err(e) = writer.write_all(&frame.as_ref()[1..]).await {
                        break GuestClosed::Failed(format!("writing to the guest failed: {e}"));
                    }
                }
                Some(frame) => match Frame::decode(frame.as_ref()) {
                    Ok(Frame::Close(wire::CHANNEL_STDIN)) if framing == Framing::Tcp => break GuestClosed::Closed,
                    Ok(Frame::Resize(_) | Frame::Close(_)) => {}
                    // The gateway passes clients' stdin, resize and close frames only.
                    Ok(_) | Err(_) => break GuestClosed::Failed("the gateway sent a frame that is not a client's".into()),
                },
            },
        }
    };
    outbound.abort();
    let _ = writer.shutdown().await;
    drop(writer);
    let end = match ended {
        GuestClosed::GatewayGone => return,
        GuestClosed::Closed => End::Exited(0),
        GuestClosed::Failed(message) => End::Broken { message, timeout: false },
    };
    let _ = to_gateway.send(Frame::Close(wire::CHANNEL_STDOUT).encode()).await;
    let _ = to_gateway.send(Frame::Status(end).encode()).await;
}

/// Reads the guest into stdout frames until it closes, fails, or the gateway's side is gone.
async fn guest_to_gateway<R: AsyncRead + Unpin>(mut reader: R, to_gateway: mpsc::Sender<Vec<u8>>) -> GuestClosed {
    loop {
        // The frame is built in place: its channel byte, then what the read put after it (in
        // the spare capacity: nothing is zeroed first).
        let mut frame = Vec::with_capacity(1 + wire::DATA_BYTES_MAX);
        frame.push(wire::CHANNEL_STDOUT);
        match reader.read_buf(&mut frame).await {
            Ok(0) => return GuestClosed::Closed,
            Ok(_) => {
                if to_gateway.send(frame).await.is_err() {
                    return GuestClosed::GatewayGone;
                }
            }
            Err(e) => return GuestClosed::Failed(format!("reading the guest failed: {e}")),
        }
    }
}

/// A libvirt console stream as an async pipe: two threads (a stream's calls block) copy between
/// it and the pipe's far end. When the pipe's near end is dropped, the stream is aborted, which
/// ends both threads; when the guest's side ends, the near end reads its end.
#[cfg(feature = "libvirt")]
fn libvirt_pipe(stream: virt::stream::Stream) -> (tokio::io::DuplexStream, tokio::task::JoinHandle<()>) {
    let (near, far) = tokio::io::duplex(CONSOLE_PIPE_BYTES);
    let (mut far_read, mut far_write) = tokio::io::split(far);
    let runtime = tokio::runtime::Handle::current();
    let incoming = stream.clone();
    let from_guest = tokio::task::spawn_blocking({
        let runtime = runtime.clone();
        move || {
            let mut buffer = vec![0u8; wire::DATA_BYTES_MAX];
            // recv: 0 at the end of the stream, an error once it is aborted.
            while let Ok(n @ 1..) = incoming.recv(&mut buffer) {
                let n = usize::try_from(n).unwrap_or(0);
                if runtime.block_on(far_write.write_all(&buffer[..n])).is_err() {
                    return;
                }
            }
        }
    });
    let to_guest = tokio::task::spawn_blocking(move || {
        let mut buffer = vec![0u8; wire::DATA_BYTES_MAX];
        loop {
            match runtime.block_on(far_read.read(&mut buffer)) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mut sent = 0;
                    while sent < n {
                        match stream.send(&buffer[sent..n]) {
                            Ok(k @ 1..) => sent += usize::try_from(k).unwrap_or(n),
                            _ => return,
                        }
                    }
                }
            }
        }
        // The relay is done: end the stream, which wakes the reading thread.
        let _ = stream.abort();
    });
    let threads = tokio::spawn(async move {
        let _ = to_guest.await;
        let _ = from_guest.await;
    });
    (near, threads)
}

/// After its end sent everything, a tunnel's call waits this long at most for the gateway to
/// end it.
pub const CALL_LINGER_MS: u64 = 10_000;

/// The answer to an op this agent does not attach.
pub fn refusal(what: &str) -> Vec<u8> {
    Frame::Status(End::Broken { message: format!("this node's agent does not attach {what}"), timeout: false }).encode()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test is the user: a shell on a real pseudo-terminal, its size, a resize, its status.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_console_runs_a_shell_on_a_terminal_and_returns_its_status() {
        let (to_console, from_test) = mpsc::channel::<Vec<u8>>(16);
        let (to_test, mut from_console) = mpsc::channel::<Vec<u8>>(16);
        let console = tokio::spawn(console(tokio_stream::wrappers::ReceiverStream::new(from_test), to_test));
        to_console.send(Frame::Resize(WindowSize { width: 100, height: 30 }).encode()).await.unwrap();
        to_console.send(Frame::stdin(b"tty; stty size; exit 7\n".to_vec()).encode()).await.unwrap();
        let mut printed = Vec::new();
        let end = loop {
            let bytes = tokio::time::timeout(std::time::Duration::from_secs(20), from_console.recv()).await.unwrap().unwrap();
            match Frame::decode(&bytes).unwrap() {
                Frame::Data { channel: wire::CHANNEL_STDOUT, bytes } => printed.extend(bytes),
                Frame::Status(end) => break end,
                other => panic!("{other:?}"),
            }
        };
        let printed = String::from_utf8_lossy(&printed);
        assert_eq!(end, End::Exited(7), "{printed}");
        assert!(printed.contains("/dev/pts/"), "{printed}");
        assert!(printed.contains("30 100"), "{printed}");
        console.await.unwrap();
    }

    use crate::hypervisor::{DomainSpec, Fake, FakeGuests};

    /// A fake hypervisor whose guests are this machine's loopback, its console at `console`,
    /// with one running instance; and that instance's id.
    fn fake_with_a_running_guest(console: Option<SocketAddr>) -> (Arc<Fake>, String) {
        let instance = bc_core::id::InstanceId::from_ulid(ulid::Ulid(7)).to_string();
        let fake = Fake::default().reaching(FakeGuests { address: "127.0.0.1".parse().unwrap(), console });
        let spec = DomainSpec {
            name: instance.clone(),
            vcpus: 1,
            memory_mib: 512,
            disk_path: None,
            disk_format: "raw".into(),
            gpus: Vec::new(),
        };
        fake.define(&spec).unwrap();
        fake.start(&instance).unwrap();
        (Arc::new(fake), instance)
    }

    /// The frames a relay sent, until its status.
    async fn frames_until_status(from_relay: &mut mpsc::Receiver<Vec<u8>>) -> (Vec<u8>, Vec<Frame>) {
        let (mut data, mut control) = (Vec::new(), Vec::new());
        loop {
            let bytes = tokio::time::timeout(Duration::from_secs(20), from_relay.recv()).await.expect("a frame").expect("open");
            match Frame::decode(&bytes).unwrap() {
                Frame::Data { channel: wire::CHANNEL_STDOUT, bytes } => data.extend(bytes),
                status @ Frame::Status(_) => {
                    control.push(status);
                    return (data, control);
                }
                other => control.push(other),
            }
        }
    }

    /// `tcp` to a port of a running guest (a loopback server here): bytes both ways, plain, on
    /// channels 0 and 1; the guest closing is `[255, 1]` then `Success`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tcp_tunnel_carries_bytes_to_a_guests_port_and_ends_when_the_guest_closes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let guest = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut asked = [0u8; 5];
            socket.read_exact(&mut asked).await.unwrap();
            socket.write_all(&[b"echo: ".as_slice(), &asked].concat()).await.unwrap();
            // And closes.
        });
        let (fake, instance) = fake_with_a_running_guest(None);
        let end = reach_guest(fake, Op::Tcp, instance, port).await.unwrap();
        let (to_relay, from_test) = mpsc::channel::<Vec<u8>>(16);
        let (to_test, mut from_relay) = mpsc::channel::<Vec<u8>>(16);
        let relay = tokio::spawn(end.relay(tokio_stream::wrappers::ReceiverStream::new(from_test), to_test, Framing::Tcp));
        to_relay.send(Frame::stdin(b"he".to_vec()).encode()).await.unwrap();
        to_relay.send(Frame::Resize(WindowSize { width: 1, height: 1 }).encode()).await.unwrap();
        to_relay.send(Frame::stdin(b"llo".to_vec()).encode()).await.unwrap();
        let (data, control) = frames_until_status(&mut from_relay).await;
        assert_eq!(data, b"echo: hello");
        assert_eq!(control, [Frame::Close(wire::CHANNEL_STDOUT), Frame::Status(End::Exited(0))]);
        guest.await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), relay).await.expect("the relay ends").unwrap();
    }

    /// The client's `[255, 0]` ends a tcp connection (no half-close): the guest sees its end,
    /// the client `[255, 1]` and `Success`. On a serial console it is ignored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_clients_close_ends_a_tcp_connection_and_not_a_serial_console() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let console = listener.local_addr().unwrap();
        let (fake, instance) = fake_with_a_running_guest(Some(console));
        let guest = tokio::spawn(async move {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut got = Vec::new();
                // Read until the agent ends the connection.
                tokio::time::timeout(Duration::from_secs(10), socket.read_to_end(&mut got)).await.unwrap().unwrap();
                seen.push(got);
            }
            seen
        });
        for (op, framing) in [(Op::Tcp, Framing::Tcp), (Op::Console, Framing::Serial)] {
            let port = console.port();
            let end = reach_guest(fake.clone(), op, instance.clone(), port).await.unwrap();
            let (to_relay, from_test) = mpsc::channel::<Vec<u8>>(16);
            let (to_test, mut from_relay) = mpsc::channel::<Vec<u8>>(16);
            let relay = tokio::spawn(end.relay(tokio_stream::wrappers::ReceiverStream::new(from_test), to_test, framing));
            to_relay.send(Frame::stdin(b"bye".to_vec()).encode()).await.unwrap();
            to_relay.send(Frame::Close(wire::CHANNEL_STDIN).encode()).await.unwrap();
            if framing == Framing::Tcp {
                let (data, control) = frames_until_status(&mut from_relay).await;
                assert!(data.is_empty());
                assert_eq!(control, [Frame::Close(wire::CHANNEL_STDOUT), Frame::Status(End::Exited(0))]);
            } else {
                let more = tokio::time::timeout(Duration::from_millis(1500), from_relay.recv()).await;
                assert!(more.is_err(), "a serial console goes on after [255, 0]: {more:?}");
                // The gateway's side ends: the relay ends the console's connection.
                drop(to_relay);
            }
            tokio::time::timeout(Duration::from_secs(5), relay).await.expect("the relay ends").unwrap();
        }
        let seen = guest.await.unwrap();
        assert_eq!(seen, [b"bye".to_vec(), b"bye".to_vec()]);
    }

    /// Only a running domain is dialled; a port nobody listens on, and a hypervisor that
    /// reaches no guest, are refused with the reason; `exec` is never attached.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn instance_tunnels_are_refused_with_their_reason() {
        let (fake, instance) = fake_with_a_running_guest(None);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let why = |r: Result<GuestEnd, String>| r.err().expect("refused");
        assert!(why(reach_guest(fake.clone(), Op::Tcp, instance.clone(), port).await).contains("could not be reached"));
        assert!(why(reach_guest(fake.clone(), Op::Console, instance.clone(), 0).await).contains("fake_guest_console"));
        assert!(why(reach_guest(fake.clone(), Op::Exec, instance.clone(), 0).await).contains("until guests have an agent"));
        assert!(why(reach_guest(fake.clone(), Op::Tcp, "inst_../etc".into(), port).await).contains("not an instance id"));
        fake.stop(&instance, true).unwrap();
        assert!(
            why(reach_guest(fake.clone(), Op::Tcp, instance.clone(), port).await).contains("stopped on this node, not running")
        );
        let other = bc_core::id::InstanceId::from_ulid(ulid::Ulid(8)).to_string();
        assert!(why(reach_guest(fake, Op::Tcp, other, port).await).contains("is not on this node"));
        let blind: Arc<Fake> = Arc::new(Fake::default());
        assert!(why(reach_guest(blind, Op::Tcp, instance, port).await).contains("reaches no guest"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_gateway_going_away_hangs_the_shell_up() {
        let (to_console, from_test) = mpsc::channel::<Vec<u8>>(16);
        let (to_test, _from_console) = mpsc::channel::<Vec<u8>>(64);
        let console = tokio::spawn(console(tokio_stream::wrappers::ReceiverStream::new(from_test), to_test));
        to_console.send(Frame::stdin(b"sleep 600\n".to_vec()).encode()).await.unwrap();
        drop(to_console);
        tokio::time::timeout(std::time::Duration::from_secs(20), console).await.expect("the console ends").unwrap();
    }
}
