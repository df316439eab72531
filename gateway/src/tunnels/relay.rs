//! The relay of one open tunnel (`schema/TUNNELS.md`, §3 and §4): frames between the client's
//! WebSocket and the agent's end until either ends or the tunnel must close.
//!
//! One task per direction under a supervisor, so that neither direction waits on the other:
//!
//! - [`client_to_node`] takes the client's frames (stdin, resize and close only), counts stdin's
//!   payload bytes and sends each to the agent's end, whose channel holds at most
//!   `TUNNEL_FRAMES_QUEUED`: an agent that does not read holds back what the client sends, and
//!   nothing else.
//! - [`node_to_client`] takes the node's frames (stdout, stderr, v5's close `[255, channel]`, the
//!   status), counts stdout's and stderr's payload bytes and sends each to the client, pings the
//!   client every `TUNNEL_KEEPALIVE_S`, and is the only writer to the client: the supervisor's
//!   last word goes through it. A client that does not read holds back the node's output (the
//!   agent's stream, and so the node's terminal, fills), and nothing else.
//! - The supervisor ([`supervise`]) holds the timers: the idle timeout (a payload byte either
//!   way moves it; pings, resizes and close frames do not), the maximum duration, the gateway's
//!   shutdown, and every `TUNNEL_RECHECK_S` the [`Recheck`] (is the key still live and still
//!   granted the action, has the target ended). When it ends the tunnel, the client is sent a `Failure` status and a
//!   close through the second task, given `TUNNEL_CLOSE_GRACE_MS` for them, and then both tasks
//!   are stopped, which drops the agent's end and so ends its call.
//!
//! Invariants: a status (channel 3) is the last frame a client is sent, at most once, followed by
//! a close; the counts are of payload bytes only, and no byte of a frame is ever logged.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::ws::{CloseFrame, Message};
use bc_core::tunnel::{self as wire, End, Frame};
use bc_projections::tunnel::CloseReason;
use futures::future::BoxFuture;
use futures::{Sink, SinkExt, Stream, StreamExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{AgentEnd, TUNNEL_KEEPALIVE_S, TUNNEL_RECHECK_S, TunnelLimits};

/// Once the supervisor ends a tunnel, the client has this long to be sent its last status and
/// close before both directions are stopped (a client that reads nothing never gets them).
pub const TUNNEL_CLOSE_GRACE_MS: u64 = 2_000;

/// Why a recheck ends a tunnel, and what the client is told (its `Failure` status's message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ending {
    pub reason: CloseReason,
    pub message: String,
}

/// Asked every `TUNNEL_RECHECK_S` while a tunnel is open whether it may stay open: `Some` ends
/// it. A check that takes longer than that period (a slow database) is given up until the next.
pub type Recheck = Box<dyn FnMut() -> BoxFuture<'static, Option<Ending>> + Send>;

/// What a relay came to: why it ended, the remote program's exit status if it exited, and the
/// payload bytes each way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relayed {
    pub reason: CloseReason,
    pub exit: Option<u8>,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

/// The payload bytes each way, and when data last passed (for the idle timeout), shared by the
/// two directions and the supervisor.
struct Counters {
    started: Instant,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// Milliseconds from `started` to the last payload byte either way.
    last_data_ms: AtomicU64,
    /// The node's status, once it came (the program's exit status if it exited), set before it
    /// is forwarded: a client closes its socket once it has the status, and the supervisor may
    /// see that close before the node-to-client task has ended.
    status: OnceLock<Option<u8>>,
}

impl Counters {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            last_data_ms: AtomicU64::new(0),
            status: OnceLock::new(),
        }
    }

    fn add(&self, to: &AtomicU64, bytes: usize) {
        if bytes > 0 {
            to.fetch_add(bytes as u64, Ordering::Relaxed);
            let now_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
            self.last_data_ms.store(now_ms, Ordering::Relaxed);
        }
    }

    /// How long no payload byte has passed either way.
    fn quiet_for(&self) -> Duration {
        let last = self.started + Duration::from_millis(self.last_data_ms.load(Ordering::Relaxed));
        Instant::now().saturating_duration_since(last)
    }
}

/// How the client's side ended, as [`client_to_node`] saw it.
enum FromClient {
    /// The client closed the socket or went away.
    Closed,
    /// The client sent what the protocol does not allow: the socket is closed with this code
    /// and reason.
    Refused(u16, String),
    /// The agent's end no longer takes frames.
    AgentGone,
}

/// How [`node_to_client`] ended.
enum ToClient {
    /// The node's status was forwarded: the program's exit status if it exited.
    Ended(Option<u8>),
    /// The agent's stream ended without a status, or sent what is not the tunnel's; the client
    /// was told.
    AgentGone,
    /// A write to the client failed.
    ClientGone,
    /// The supervisor's last word was sent.
    Told,
}

/// What ends a tunnel besides its two sides: the time limits, the gateway's shutdown, rechecks.
struct Timers {
    limits: TunnelLimits,
    shutdown: watch::Receiver<bool>,
    recheck: Recheck,
}

/// How the supervisor ended the tunnel.
enum Verdict {
    /// The node-to-client task ended first, so.
    Ended(ToClient),
    /// For this reason, with a last word queued for the client.
    Told(CloseReason),
    /// For this reason, with nothing more to say: the client is gone.
    Over(CloseReason),
}

impl ToClient {
    fn reason(&self) -> CloseReason {
        match self {
            ToClient::Ended(Some(_)) => CloseReason::Exited,
            ToClient::Ended(None) | ToClient::AgentGone => CloseReason::AgentGone,
            ToClient::ClientGone | ToClient::Told => CloseReason::ClientClosed,
        }
    }
}

/// What the supervisor has the client sent last.
enum LastWord {
    /// A `Failure` status that is no exit status, then a close.
    Broken { message: String, timeout: bool },
    /// A close only, with this code and reason.
    Close(u16, String),
}

/// Relays between the client (`to_client`, `from_client`: the split WebSocket) and the agent's
/// `end` until the tunnel ends (the module's header says how).
pub async fn relay<Tx, Rx>(
    to_client: Tx,
    from_client: Rx,
    end: AgentEnd,
    limits: TunnelLimits,
    shutdown: watch::Receiver<bool>,
    recheck: Recheck,
) -> Relayed
where
    Tx: Sink<Message> + Send + Unpin + 'static,
    Rx: Stream<Item = Result<Message, axum::Error>> + Send + Unpin + 'static,
{
    let counters = Arc::new(Counters::new());
    let (last_word, to_say) = mpsc::channel(1);
    let AgentEnd { from_node, to_node } = end;
    let mut up = tokio::spawn(client_to_node(from_client, to_node, counters.clone()));
    let mut down = tokio::spawn(node_to_client(from_node, to_client, to_say, counters.clone()));
    let timers = Timers { limits, shutdown, recheck };
    let verdict = supervise(&mut up, &mut down, &last_word, &counters, timers).await;
    // The agent's end goes with the client's: its call ends, and the node hangs the program up.
    up.abort();
    let (reason, down_ended) = match verdict {
        Verdict::Ended(ended) => (ended.reason(), Some(ended)),
        Verdict::Told(reason) => {
            let grace = Duration::from_millis(TUNNEL_CLOSE_GRACE_MS);
            (reason, tokio::time::timeout(grace, &mut down).await.ok().and_then(Result::ok))
        }
        Verdict::Over(reason) => (reason, None),
    };
    down.abort();
    let (reason, exit) = match (down_ended, counters.status.get()) {
        (Some(ToClient::Ended(exit)), _) => (reason, exit),
        // The client closed after the node's status reached the gateway (it had read it, or it
        // was on its way): the program ended the tunnel, not the client.
        (_, Some(&exit)) if reason == CloseReason::ClientClosed => (ToClient::Ended(exit).reason(), exit),
        _ => (reason, None),
    };
    Relayed {
        reason,
        exit,
        bytes_in: counters.bytes_in.load(Ordering::Relaxed),
        bytes_out: counters.bytes_out.load(Ordering::Relaxed),
    }
}

/// Waits for either direction to end or a timer to end the tunnel, and says how it ends. A last
/// word to the client is queued on `last_word` (empty until then: the supervisor says one word
/// at most) for the node-to-client task.
async fn supervise(
    up: &mut JoinHandle<FromClient>,
    down: &mut JoinHandle<ToClient>,
    last_word: &mpsc::Sender<LastWord>,
    counters: &Counters,
    timers: Timers,
) -> Verdict {
    let Timers { limits, mut shutdown, mut recheck } = timers;
    let every = Duration::from_secs(TUNNEL_RECHECK_S);
    let mut rechecks = tokio::time::interval_at(Instant::now() + every, every);
    rechecks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let deadline = tokio::time::sleep(limits.max_duration);
    tokio::pin!(deadline);
    let idle = tokio::time::sleep(limits.idle_timeout);
    tokio::pin!(idle);
    let tell = |word: LastWord, reason: CloseReason| {
        let _ = last_word.try_send(word);
        Verdict::Told(reason)
    };
    let broken = |message: String, timeout: bool, reason: CloseReason| tell(LastWord::Broken { message, timeout }, reason);
    loop {
        tokio::select! {
            ended = &mut *down => return Verdict::Ended(ended.unwrap_or(ToClient::ClientGone)),
            ended = &mut *up => return match ended.unwrap_or(FromClient::Closed) {
                FromClient::Closed => Verdict::Over(CloseReason::ClientClosed),
                FromClient::Refused(code, why) => tell(LastWord::Close(code, why), CloseReason::ClientClosed),
                FromClient::AgentGone => broken("the node's agent went away".into(), false, CloseReason::AgentGone),
            },
            () = &mut idle => {
                let quiet = counters.quiet_for();
                if quiet >= limits.idle_timeout {
                    let message = format!("no data either way for {} s", limits.idle_timeout.as_secs());
                    return broken(message, true, CloseReason::IdleTimeout);
                }
                idle.as_mut().reset(Instant::now() + (limits.idle_timeout - quiet));
            }
            () = &mut deadline => {
                let message = format!("the tunnel reached its maximum duration of {} s", limits.max_duration.as_secs());
                return broken(message, true, CloseReason::MaxDuration);
            }
            _ = shutdown.changed() => return broken("the gateway is stopping".into(), false, CloseReason::Shutdown),
            _ = rechecks.tick() => {
                if let Ok(Some(ending)) = tokio::time::timeout(every, recheck()).await {
                    return broken(ending.message, false, ending.reason);
                }
            }
        }
    }
}

/// The client's frames to the agent's end, checked and counted, until the client ends, breaks
/// the protocol, or the agent's end is gone. A frame goes on as the socket gave it (no copy).
async fn client_to_node<Rx>(mut from_client: Rx, to_node: mpsc::Sender<Bytes>, counters: Arc<Counters>) -> FromClient
where
    Rx: Stream<Item = Result<Message, axum::Error>> + Unpin,
{
    loop {
        let bytes = match from_client.next().await {
            Some(Ok(Message::Binary(bytes))) => bytes,
            Some(Ok(Message::Text(_))) => return FromClient::Refused(1003, "frames are binary messages".into()),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_)) | Err(_)) | None => return FromClient::Closed,
        };
        match Frame::data_of(&bytes) {
            Some((wire::CHANNEL_STDIN, data)) => counters.add(&counters.bytes_in, data.len()),
            Some(_) => return FromClient::Refused(1008, "clients send stdin, resize and close frames only".into()),
            None => match Frame::decode(&bytes) {
                Ok(Frame::Resize(_) | Frame::Close(_)) => {}
                Ok(_) => return FromClient::Refused(1008, "clients send stdin, resize and close frames only".into()),
                Err(e) => return FromClient::Refused(1008, e.to_string()),
            },
        }
        if to_node.send(bytes).await.is_err() {
            return FromClient::AgentGone;
        }
    }
}

/// The node's frames to the client, checked and counted, with keep-alive pings, until the
/// node's status, the agent's end or the client is gone, or the supervisor's last word.
async fn node_to_client<Tx>(
    mut from_node: Pin<Box<dyn Stream<Item = Bytes> + Send>>,
    mut to_client: Tx,
    mut last_word: mpsc::Receiver<LastWord>,
    counters: Arc<Counters>,
) -> ToClient
where
    Tx: Sink<Message> + Unpin,
{
    let period = Duration::from_secs(TUNNEL_KEEPALIVE_S);
    let mut keepalive = tokio::time::interval_at(Instant::now() + period, period);
    loop {
        tokio::select! {
            biased;
            word = last_word.recv() => {
                match word {
                    Some(LastWord::Broken { message, timeout }) => end_broken(&mut to_client, &message, timeout).await,
                    Some(LastWord::Close(code, reason)) => {
                        let _ = to_client.send(close(code, &reason)).await;
                    }
                    None => {}
                }
                return ToClient::Told;
            }
            frame = from_node.next() => {
                let Some(bytes) = frame else {
                    end_broken(&mut to_client, "the node's agent went away", false).await;
                    return ToClient::AgentGone;
                };
                match Frame::data_of(&bytes) {
                    Some((wire::CHANNEL_STDOUT | wire::CHANNEL_STDERR, data)) => counters.add(&counters.bytes_out, data.len()),
                    Some(_) => {
                        end_broken(&mut to_client, NOT_THE_TUNNELS, false).await;
                        return ToClient::AgentGone;
                    }
                    None => match Frame::decode(&bytes) {
                        // v5's close, forwarded: a `tcp` tunnel's peer closed its side.
                        Ok(Frame::Close(_)) => {}
                        Ok(Frame::Status(end)) => {
                            let exit = match end {
                                End::Exited(code) => Some(code),
                                End::Broken { .. } => None,
                            };
                            let _ = counters.status.set(exit);
                            let _ = to_client.send(Message::Binary(bytes)).await;
                            let _ = to_client.send(close(1000, "the remote program ended")).await;
                            return ToClient::Ended(exit);
                        }
                        Ok(_) | Err(_) => {
                            end_broken(&mut to_client, NOT_THE_TUNNELS, false).await;
                            return ToClient::AgentGone;
                        }
                    },
                }
                if to_client.send(Message::Binary(bytes)).await.is_err() {
                    return ToClient::ClientGone;
                }
            }
            _ = keepalive.tick() => {
                if to_client.send(Message::Ping(Vec::new().into())).await.is_err() {
                    return ToClient::ClientGone;
                }
            }
        }
    }
}

/// What the client is told when the agent sends what a node does not send.
const NOT_THE_TUNNELS: &str = "the node's agent sent a frame that is not the tunnel's";

fn close(code: u16, reason: &str) -> Message {
    // A close reason is at most 123 bytes.
    let reason: String = reason.chars().take(100).collect();
    Message::Close(Some(CloseFrame { code, reason: reason.into() }))
}

/// Ends the client's side with a `Failure` status that is no exit status, then a close.
pub async fn end_broken<S>(to_client: &mut S, message: &str, timeout: bool)
where
    S: Sink<Message> + Unpin,
{
    let status = Frame::Status(End::Broken { message: message.to_owned(), timeout }).encode();
    let _ = to_client.send(Message::Binary(status.into())).await;
    let _ = to_client.send(close(1000, message)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use bc_core::tunnel::WindowSize;
    use futures::channel::mpsc as client;
    use tokio_stream::wrappers::ReceiverStream;

    /// A relay between a client and a node played by channels: what each side sends and gets.
    struct Rig {
        /// The client's frames, as its socket would give them.
        client_sends: client::Sender<Result<Message, axum::Error>>,
        /// What the client is sent (a channel of no room: a client that does not read blocks
        /// the relay's writes, as a full socket does).
        client_gets: client::Receiver<Message>,
        node_sends: mpsc::Sender<Bytes>,
        node_gets: mpsc::Receiver<Bytes>,
        _shutdown: watch::Sender<bool>,
        relay: JoinHandle<Relayed>,
    }

    fn rig(idle_s: u64, max_s: u64) -> Rig {
        rig_rechecked(idle_s, max_s, Box::new(|| Box::pin(async { None })))
    }

    fn rig_rechecked(idle_s: u64, max_s: u64, recheck: Recheck) -> Rig {
        let (to_node, node_gets) = mpsc::channel(super::super::TUNNEL_FRAMES_QUEUED);
        let (node_sends, from_node) = mpsc::channel(super::super::TUNNEL_FRAMES_QUEUED);
        let end = AgentEnd { from_node: Box::pin(ReceiverStream::new(from_node)), to_node };
        let (client_sends, from_client) = client::channel(16);
        let (to_client, client_gets) = client::channel(0);
        let limits = TunnelLimits {
            idle_timeout: Duration::from_secs(idle_s),
            max_duration: Duration::from_secs(max_s),
            ..TunnelLimits::default()
        };
        let (shutdown, stopping) = watch::channel(false);
        let relay = tokio::spawn(relay(to_client, from_client, end, limits, stopping, recheck));
        Rig { client_sends, client_gets, node_sends, node_gets, _shutdown: shutdown, relay }
    }

    fn binary(frame: Frame) -> Result<Message, axum::Error> {
        Ok(Message::Binary(frame.encode().into()))
    }

    /// Everything the client is sent until the relay lets go of its socket.
    async fn client_reads(gets: client::Receiver<Message>) -> Vec<Message> {
        gets.filter(|m| std::future::ready(!matches!(m, Message::Ping(_)))).collect().await
    }

    fn status_of(message: &Message) -> End {
        let Message::Binary(bytes) = message else { panic!("not a frame: {message:?}") };
        match Frame::decode(bytes).unwrap() {
            Frame::Status(end) => end,
            other => panic!("not a status: {other:?}"),
        }
    }

    /// A client that reads nothing while the node prints holds back only the node's output:
    /// what the client types still reaches the node, and the maximum duration still ends the
    /// tunnel.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_does_not_read_holds_back_only_the_nodes_output() {
        let mut rig = rig(3600, 60);
        let node_sends = rig.node_sends.clone();
        let printing =
            tokio::spawn(async move { while node_sends.send(Frame::stdout(vec![b'x'; 1024]).encode().into()).await.is_ok() {} });
        for i in 0..40u8 {
            rig.client_sends.send(binary(Frame::stdin(vec![i]))).await.unwrap();
            let got = tokio::time::timeout(Duration::from_secs(1), rig.node_gets.recv()).await;
            assert_eq!(got.expect("the node gets what the client typed").unwrap(), Frame::stdin(vec![i]).encode());
        }
        let relayed = tokio::time::timeout(Duration::from_secs(120), rig.relay).await.expect("the relay ends").unwrap();
        assert_eq!(relayed.reason, CloseReason::MaxDuration);
        assert_eq!(relayed.bytes_in, 40);
        printing.abort();
    }

    /// The node's v5 close frames reach the client (a `tcp` tunnel's half-close), before the
    /// status and the close.
    #[tokio::test(start_paused = true)]
    async fn the_nodes_close_frames_reach_the_client() {
        let rig = rig(3600, 3600);
        let reading = tokio::spawn(client_reads(rig.client_gets));
        rig.node_sends.send(Frame::stdout(b"hi".to_vec()).encode().into()).await.unwrap();
        rig.node_sends.send(Frame::Close(wire::CHANNEL_STDOUT).encode().into()).await.unwrap();
        rig.node_sends.send(Frame::Status(End::Exited(0)).encode().into()).await.unwrap();
        let relayed = rig.relay.await.unwrap();
        assert_eq!((relayed.reason, relayed.exit, relayed.bytes_out), (CloseReason::Exited, Some(0), 2));
        let got = reading.await.unwrap();
        assert_eq!(got.len(), 4, "{got:?}");
        assert_eq!(got[0], Message::Binary(Frame::stdout(b"hi".to_vec()).encode().into()));
        assert_eq!(got[1], Message::Binary(vec![wire::CHANNEL_CLOSE, wire::CHANNEL_STDOUT].into()));
        assert_eq!(status_of(&got[2]), End::Exited(0));
        assert!(matches!(&got[3], Message::Close(Some(f)) if f.code == 1000), "{:?}", got[3]);
    }

    /// A client that closes its socket once the node's status has reached the gateway, before
    /// the relay has finished forwarding it (here: the client reads nothing, so the status waits
    /// behind the output), leaves a tunnel the program ended, with its exit status: the close
    /// must not be taken for the client's. (The console end-to-end test once saw
    /// `tunnel.closed` without its `exitStatus` this way.)
    #[tokio::test(start_paused = true)]
    async fn a_client_closing_after_the_status_came_leaves_the_programs_exit() {
        let mut rig = rig(3600, 3600);
        rig.node_sends.send(Frame::stdout(b"bye".to_vec()).encode().into()).await.unwrap();
        rig.node_sends.send(Frame::Status(End::Exited(7)).encode().into()).await.unwrap();
        // The client reads the output and nothing more: the relay has the status and waits for
        // the client to take it.
        let first = rig.client_gets.next().await.unwrap();
        assert_eq!(first, Message::Binary(Frame::stdout(b"bye".to_vec()).encode().into()));
        tokio::time::sleep(Duration::from_millis(50)).await;
        rig.client_sends.send(Ok(Message::Close(None))).await.unwrap();
        let relayed = rig.relay.await.unwrap();
        assert_eq!((relayed.reason, relayed.exit, relayed.bytes_out), (CloseReason::Exited, Some(7), 3));
    }

    /// A client that closes while the program runs ends the tunnel as the client's, with no
    /// exit status.
    #[tokio::test(start_paused = true)]
    async fn a_client_closing_before_any_status_is_the_clients_close() {
        let mut rig = rig(3600, 3600);
        rig.node_sends.send(Frame::stdout(b"still running".to_vec()).encode().into()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        rig.client_sends.send(Ok(Message::Close(None))).await.unwrap();
        let relayed = rig.relay.await.unwrap();
        assert_eq!((relayed.reason, relayed.exit), (CloseReason::ClientClosed, None));
    }

    /// Data either way moves the idle timeout; a resize does not. The client is told why.
    #[tokio::test(start_paused = true)]
    async fn the_idle_timeout_counts_data_either_way() {
        let mut rig = rig(10, 3600);
        let reading = tokio::spawn(client_reads(rig.client_gets));
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs(6)).await;
        rig.client_sends.send(binary(Frame::stdin(b"a".to_vec()))).await.unwrap();
        assert!(rig.node_gets.recv().await.is_some());
        tokio::time::sleep(Duration::from_secs(6)).await;
        rig.node_sends.send(Frame::stdout(b"b".to_vec()).encode().into()).await.unwrap();
        tokio::time::sleep(Duration::from_secs(6)).await;
        rig.client_sends.send(binary(Frame::Resize(WindowSize { width: 80, height: 24 }))).await.unwrap();
        let relayed = rig.relay.await.unwrap();
        assert_eq!(relayed.reason, CloseReason::IdleTimeout);
        assert_eq!(started.elapsed().as_secs(), 22, "10 s after the node's byte at 12 s");
        assert_eq!((relayed.bytes_in, relayed.bytes_out), (1, 1));
        let got = reading.await.unwrap();
        assert_eq!(status_of(&got[1]), End::Broken { message: "no data either way for 10 s".into(), timeout: true });
        assert!(matches!(got.last(), Some(Message::Close(_))), "{got:?}");
    }

    /// A recheck that finds the tunnel must end ends it, with its reason, and the client is told
    /// why; until then the tunnel stays open.
    #[tokio::test(start_paused = true)]
    async fn a_recheck_that_says_so_ends_the_tunnel() {
        let asked = Arc::new(AtomicU64::new(0));
        let recheck: Recheck = Box::new({
            let asked = asked.clone();
            move || {
                let n = asked.fetch_add(1, Ordering::Relaxed) + 1;
                Box::pin(async move {
                    (n == 3).then(|| Ending { reason: CloseReason::KeyRevoked, message: "the key was revoked".into() })
                })
            }
        });
        let rig = rig_rechecked(3600, 3600, recheck);
        let reading = tokio::spawn(client_reads(rig.client_gets));
        let started = Instant::now();
        assert_eq!(rig.relay.await.unwrap().reason, CloseReason::KeyRevoked);
        assert_eq!(started.elapsed(), Duration::from_secs(3 * TUNNEL_RECHECK_S), "the third recheck ended it");
        let got = reading.await.unwrap();
        assert_eq!(status_of(&got[0]), End::Broken { message: "the key was revoked".into(), timeout: false });
        assert!(matches!(got.last(), Some(Message::Close(Some(f))) if f.code == 1000), "{got:?}");
    }

    /// The gateway stopping ends the tunnel with a `Failure` status.
    #[tokio::test(start_paused = true)]
    async fn the_gateway_stopping_ends_the_tunnel_with_a_status() {
        let rig = rig(3600, 3600);
        let reading = tokio::spawn(client_reads(rig.client_gets));
        rig._shutdown.send_replace(true);
        assert_eq!(rig.relay.await.unwrap().reason, CloseReason::Shutdown);
        let got = reading.await.unwrap();
        assert_eq!(status_of(&got[0]), End::Broken { message: "the gateway is stopping".into(), timeout: false });
    }
}
