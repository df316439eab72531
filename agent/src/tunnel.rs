//! The agent's end of a tunnel (`schema/TUNNELS.md`): IO, at the edge, apart from the session's
//! state machine. The gateway asks on the session stream (`OpenTunnel`); the driver calls
//! [`attach`], which opens a `Tunnel` call on the same connection carrying the tunnel's id and
//! relays frames between it and the op's end:
//!
//! - `console` on the node: [`console`], a login shell (`/bin/sh -l`) on a new pseudo-terminal,
//!   as the user `bcd` runs as; resizes applied to the terminal; the shell's exit status sent as
//!   channel 3, then the call ends. The gateway ending the call hangs the shell up.
//! - instance ops: this agent does not advertise `tunnel.instance-dial`, so the gateway never
//!   asks; one that comes anyway is answered with a `Failure` status.
//!
//! Nothing typed or printed is logged or kept: bytes pass through bounded channels only.

use std::io::{Read, Write};

use bc_core::tunnel::{self as wire, End, Frame, WindowSize};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;

/// Frames queued each way: a slow side holds the other back rather than growing a buffer.
pub const FRAMES_QUEUED: usize = 16;
/// After the shell exits, its last output is read for at most this long before the status.
pub const DRAIN_AFTER_EXIT_MS: u64 = 2_000;
/// The terminal's size until the client's first resize.
pub const INITIAL_SIZE: WindowSize = WindowSize { width: 80, height: 24 };
/// The shell a console runs, as a login shell.
pub const SHELL: &str = "/bin/sh";

fn pty_size(size: WindowSize) -> portable_pty::PtySize {
    portable_pty::PtySize { rows: size.height, cols: size.width, pixel_width: 0, pixel_height: 0 }
}

/// Runs a console: a login shell on a new pseudo-terminal, fed by the frames `from_gateway`
/// gives, its output and finally its exit status sent to `to_gateway`. Returns when the shell
/// exited (its status sent) or the gateway's side ended (the shell is killed).
pub async fn console<S>(mut from_gateway: S, to_gateway: mpsc::Sender<Vec<u8>>)
where
    S: Stream<Item = Vec<u8>> + Unpin,
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
            frame = from_gateway.next() => match frame.map(|bytes| Frame::decode(&bytes)) {
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
/// either side ends. An op this agent does not attach is answered with a `Failure` status.
pub async fn attach(channel: tonic::transport::Channel, open: bc_proto::OpenTunnel) {
    let (to_gateway, from_end) = mpsc::channel::<Vec<u8>>(FRAMES_QUEUED);
    let first = bc_proto::TunnelFrame { tunnel_id: open.tunnel_id, frame: Vec::new() };
    let frames =
        tokio_stream::wrappers::ReceiverStream::new(from_end).map(|frame| bc_proto::TunnelFrame { tunnel_id: Vec::new(), frame });
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
    match wire::Op::parse(&open.op) {
        Some(wire::Op::Console) if open.instance_id.is_empty() => {
            tracing::info!("a console tunnel opened");
            console(&mut from_gateway, to_gateway).await;
            tracing::info!("a console tunnel ended");
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
