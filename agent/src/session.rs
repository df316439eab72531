//! The agent's session logic as a state machine without IO: what to send next, what an
//! acknowledgement, a command, a broken stream or a reconnect means. Time comes in as `now_ms`,
//! randomness through [`Rng`], and every effect goes out as an [`Output`] the driver carries out
//! (the tokio/tonic driver in `driver.rs`; the simulator runs thousands of these on one thread).
//!
//! Phases: `Idle` (waiting to reconnect, with gRPC's back-off: 1 s growing ×1.6 to 120 s,
//! ±20 % jitter) → `Connecting` → `AwaitChallenge` (Hello sent) → `AwaitWelcome` (proof sent) →
//! `Live`. In `Live` the machine keeps at most `WINDOW_ENTRIES` entries in flight past the
//! gateway's acknowledgement, beats every `heartbeat_ms`, and gives the session up when the
//! gateway says nothing for a lease.

use bc_core::agent::session_proof_message;
use bc_core::id::NodeId;
use bc_proto::{agent_message, gateway_message};
use ed25519_dalek::{Signer, SigningKey};

/// gRPC's connection back-off (doc/connection-backoff.md).
pub const BACKOFF_INITIAL_MS: u64 = 1_000;
pub const BACKOFF_MULTIPLIER: f64 = 1.6;
pub const BACKOFF_JITTER: f64 = 0.2;
pub const BACKOFF_MAX_MS: u64 = 120_000;
/// Entries sent and not yet acknowledged, at most.
pub const WINDOW_ENTRIES: u64 = 64;

/// Uniform randomness in `[0, 1)`.
pub trait Rng {
    fn next_unit(&mut self) -> f64;
}

/// The system's randomness, for the real agent.
pub struct SystemRng;

impl Rng for SystemRng {
    // The real Rng behind the trait (clippy.toml): the simulator and the tests give SeededRng.
    #[allow(clippy::disallowed_methods)]
    fn next_unit(&mut self) -> f64 {
        rand::random::<f64>()
    }
}

/// A seeded generator (SplitMix64), for tests and the simulator.
pub struct SeededRng(pub u64);

impl Rng for SeededRng {
    fn next_unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// gRPC's back-off schedule.
#[derive(Clone, Debug)]
pub struct Backoff {
    current_ms: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { current_ms: BACKOFF_INITIAL_MS as f64 }
    }
}

impl Backoff {
    /// The next delay: the current one ±20 %, then grow it ×1.6 up to the maximum.
    pub fn next_delay_ms(&mut self, rng: &mut dyn Rng) -> u64 {
        let jitter = 1.0 + BACKOFF_JITTER * (2.0 * rng.next_unit() - 1.0);
        let delay = (self.current_ms * jitter).round() as u64;
        self.current_ms = (self.current_ms * BACKOFF_MULTIPLIER).min(BACKOFF_MAX_MS as f64);
        delay
    }

    pub fn reset(&mut self) {
        self.current_ms = BACKOFF_INITIAL_MS as f64;
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    Idle { retry_at_ms: u64 },
    Connecting,
    AwaitChallenge,
    AwaitWelcome,
    Live,
}

/// What happened.
#[derive(Debug)]
pub enum Input {
    /// Time passed.
    Tick,
    /// The stream to the gateway is open.
    Connected,
    /// It broke, closed, or could not be opened.
    Disconnected {
        reason: String,
    },
    Received(gateway_message::Msg),
    /// The journal now ends at this entry.
    Journaled {
        seq: u64,
        hash: [u8; 32],
    },
}

/// What to do.
#[derive(Debug, PartialEq)]
pub enum Output {
    /// Open a stream to the gateway.
    Connect,
    Send(agent_message::Msg),
    /// Send the journal's entries `from..=to`, in order.
    SendEntries {
        from: u64,
        to: u64,
    },
    /// The gateway holds every entry up to this one: the journal may mark and prune them.
    Acknowledged {
        seq: u64,
    },
    /// Run this command (the runner checks the journal first, so a redelivery runs nothing twice).
    Run(bc_proto::Command),
    /// Drop the stream.
    Close {
        reason: String,
    },
    /// Stop the agent (exit 1) with this message.
    Fatal(String),
}

pub struct SessionMachine {
    node: NodeId,
    key: SigningKey,
    capabilities: Vec<String>,
    version: String,
    phase: Phase,
    backoff: Backoff,
    /// The journal's newest entry.
    head: (u64, [u8; 32]),
    /// What the gateway acknowledged, and what this session sent.
    acked: u64,
    sent: u64,
    heartbeat_ms: u64,
    lease_ms: u64,
    next_heartbeat_ms: u64,
    last_heard_ms: u64,
    /// Sessions begun, for status.
    pub sessions: u64,
}

impl SessionMachine {
    pub fn new(
        node: NodeId,
        key: SigningKey,
        capabilities: Vec<String>,
        version: String,
        head: (u64, [u8; 32]),
        acked: u64,
    ) -> Self {
        Self {
            node,
            key,
            capabilities,
            version,
            phase: Phase::Idle { retry_at_ms: 0 },
            backoff: Backoff::default(),
            head,
            acked,
            sent: acked,
            heartbeat_ms: 5_000,
            lease_ms: 15_000,
            next_heartbeat_ms: 0,
            last_heard_ms: 0,
            sessions: 0,
        }
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    pub fn acked(&self) -> u64 {
        self.acked
    }

    pub fn head(&self) -> u64 {
        self.head.0
    }

    /// One step: the input at `now_ms`, and what follows from it.
    pub fn step(&mut self, now_ms: u64, rng: &mut dyn Rng, input: Input) -> Vec<Output> {
        let mut out = Vec::new();
        match input {
            Input::Tick => self.tick(now_ms, rng, &mut out),
            Input::Connected => {
                if self.phase == Phase::Connecting {
                    self.phase = Phase::AwaitChallenge;
                    self.last_heard_ms = now_ms;
                    out.push(Output::Send(agent_message::Msg::Hello(bc_proto::Hello {
                        node_id: self.node.to_string(),
                        capabilities: self.capabilities.clone(),
                        agent_version: self.version.clone(),
                        journal_seq: self.head.0,
                        journal_hash: if self.head.0 == 0 { Vec::new() } else { self.head.1.to_vec() },
                    })));
                }
            }
            Input::Disconnected { reason } => self.disconnected(now_ms, rng, reason, &mut out),
            Input::Received(msg) => {
                self.last_heard_ms = now_ms;
                self.received(now_ms, rng, msg, &mut out);
            }
            Input::Journaled { seq, hash } => {
                if seq > self.head.0 {
                    self.head = (seq, hash);
                }
                self.send_more(&mut out);
            }
        }
        out
    }

    fn tick(&mut self, now_ms: u64, rng: &mut dyn Rng, out: &mut Vec<Output>) {
        match self.phase {
            Phase::Idle { retry_at_ms } if now_ms >= retry_at_ms => {
                self.phase = Phase::Connecting;
                out.push(Output::Connect);
            }
            Phase::AwaitChallenge | Phase::AwaitWelcome | Phase::Live
                if now_ms.saturating_sub(self.last_heard_ms) > self.lease_ms =>
            {
                out.push(Output::Close { reason: "the gateway said nothing for a lease".into() });
                self.disconnected(now_ms, rng, "the gateway said nothing for a lease".into(), out);
            }
            Phase::Live if now_ms >= self.next_heartbeat_ms => {
                self.next_heartbeat_ms = now_ms + self.heartbeat_ms;
                out.push(Output::Send(agent_message::Msg::Heartbeat(bc_proto::Heartbeat {})));
            }
            _ => {}
        }
    }

    fn disconnected(&mut self, now_ms: u64, rng: &mut dyn Rng, _reason: String, _out: &mut Vec<Output>) {
        if matches!(self.phase, Phase::Idle { .. }) {
            return;
        }
        let delay = self.backoff.next_delay_ms(rng);
        self.phase = Phase::Idle { retry_at_ms: now_ms + delay };
        // What was sent and not acknowledged goes again in the next session.
        self.sent = self.acked;
    }

    fn received(&mut self, now_ms: u64, rng: &mut dyn Rng, msg: gateway_message::Msg, out: &mut Vec<Output>) {
        match (msg, &self.phase) {
            (gateway_message::Msg::Challenge(challenge), Phase::AwaitChallenge) => {
                let signature = self.key.sign(&session_proof_message(&self.node.to_string(), &challenge.nonce));
                self.phase = Phase::AwaitWelcome;
                out.push(Output::Send(agent_message::Msg::Proof(bc_proto::Proof { signature: signature.to_bytes().to_vec() })));
            }
            (gateway_message::Msg::Welcome(welcome), Phase::AwaitWelcome) => {
                if welcome.acked_seq > self.head.0 {
                    out.push(Output::Fatal(format!(
                        "the log holds entries up to {} of this node but the journal ends at {}: the journal was lost or replaced \
                         (hint: bcd join --reset --yes, then join again)",
                        welcome.acked_seq, self.head.0
                    )));
                    return;
                }
                self.phase = Phase::Live;
                self.sessions += 1;
                self.backoff.reset();
                self.heartbeat_ms = welcome.heartbeat_ms.clamp(100, 60_000);
                self.lease_ms = welcome.lease_ms.clamp(self.heartbeat_ms * 2, 600_000);
                self.next_heartbeat_ms = now_ms + self.heartbeat_ms;
                if welcome.acked_seq > self.acked {
                    self.acked = welcome.acked_seq;
                    out.push(Output::Acknowledged { seq: self.acked });
                }
                self.sent = self.acked.max(welcome.acked_seq);
                self.send_more(out);
            }
            (gateway_message::Msg::EntryAck(ack), Phase::Live) => {
                if ack.seq > self.acked && ack.seq <= self.sent {
                    self.acked = ack.seq;
                    out.push(Output::Acknowledged { seq: ack.seq });
                }
                self.send_more(out);
            }
            (gateway_message::Msg::EntryRefused(refused), _) => {
                out.push(Output::Close {
                    reason: format!("entry {} refused: {} {}", refused.seq, refused.code, refused.message),
                });
                self.disconnected(now_ms, rng, "refused".into(), out);
            }
            (gateway_message::Msg::Command(command), Phase::Live) => {
                out.push(Output::Send(agent_message::Msg::CommandReceived(bc_proto::CommandReceived {
                    command_id: command.command_id.clone(),
                })));
                out.push(Output::Run(command));
            }
            (gateway_message::Msg::HeartbeatAck(_), _) => {}
            (other, phase) => {
                let reason = format!("unexpected {} in {phase:?}", kind_of(&other));
                out.push(Output::Close { reason: reason.clone() });
                self.disconnected(now_ms, rng, reason, out);
            }
        }
    }

    /// Sends what the window allows.
    fn send_more(&mut self, out: &mut Vec<Output>) {
        if self.phase != Phase::Live {
            return;
        }
        let limit = self.acked + WINDOW_ENTRIES;
        let to = self.head.0.min(limit);
        if to > self.sent {
            out.push(Output::SendEntries { from: self.sent + 1, to });
            self.sent = to;
        }
    }
}

fn kind_of(msg: &gateway_message::Msg) -> &'static str {
    match msg {
        gateway_message::Msg::Challenge(_) => "challenge",
        gateway_message::Msg::Welcome(_) => "welcome",
        gateway_message::Msg::EntryAck(_) => "entry ack",
        gateway_message::Msg::EntryRefused(_) => "entry refusal",
        gateway_message::Msg::Command(_) => "command",
        gateway_message::Msg::HeartbeatAck(_) => "heartbeat ack",
        // The driver answers it at the edge; the machine never sees one.
        gateway_message::Msg::OpenTunnel(_) => "tunnel request",
        // The driver installs them at the edge (`crate::ssh_ca`); the machine never sees one.
        gateway_message::Msg::SshUserCaKeys(_) => "SSH CA keys",
        // The driver stores it at the edge (`crate::node_cert`); the machine never sees one.
        gateway_message::Msg::NodeCertificate(_) => "node certificate",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(head: u64) -> SessionMachine {
        let node = NodeId::from_ulid(ulid::Ulid::from_parts(9, 9));
        SessionMachine::new(node, SigningKey::from_bytes(&[1; 32]), vec![], "test".into(), (head, [head as u8; 32]), 0)
    }

    fn welcome(acked: u64) -> Input {
        Input::Received(gateway_message::Msg::Welcome(bc_proto::Welcome {
            acked_seq: acked,
            acked_hash: vec![],
            lease_ms: 15_000,
            heartbeat_ms: 5_000,
            ssh_user_ca_keys: vec![],
            ssh_user_ca_keys_until_ms: vec![],
        }))
    }

    fn connect(m: &mut SessionMachine, rng: &mut dyn Rng, now: u64) {
        assert_eq!(m.step(now, rng, Input::Tick), vec![Output::Connect]);
        assert!(matches!(m.step(now, rng, Input::Connected)[..], [Output::Send(agent_message::Msg::Hello(_))]));
        let proof =
            m.step(now, rng, Input::Received(gateway_message::Msg::Challenge(bc_proto::Challenge { nonce: vec![7; 32] })));
        assert!(matches!(proof[..], [Output::Send(agent_message::Msg::Proof(_))]));
    }

    #[test]
    fn a_session_replays_what_the_gateway_lacks_within_the_window_then_follows_acks() {
        let seed = 42;
        let mut rng = SeededRng(seed);
        let mut m = machine(100);
        connect(&mut m, &mut rng, 0);
        let out = m.step(0, &mut rng, welcome(10));
        assert_eq!(out, vec![Output::Acknowledged { seq: 10 }, Output::SendEntries { from: 11, to: 74 }], "seed {seed}");
        let out = m.step(1, &mut rng, Input::Received(gateway_message::Msg::EntryAck(bc_proto::EntryAck { seq: 40 })));
        assert_eq!(out, vec![Output::Acknowledged { seq: 40 }, Output::SendEntries { from: 75, to: 100 }]);
        // The stream breaks: unacknowledged entries go again in the next session.
        assert!(m.step(2, &mut rng, Input::Disconnected { reason: "reset".into() }).is_empty());
        assert!(matches!(m.phase(), Phase::Idle { retry_at_ms } if (800..=1200).contains(&(retry_at_ms - 2))));
        let retry = match m.phase() {
            Phase::Idle { retry_at_ms } => *retry_at_ms,
            _ => unreachable!(),
        };
        connect(&mut m, &mut rng, retry);
        assert_eq!(m.step(retry, &mut rng, welcome(40)), vec![Output::SendEntries { from: 41, to: 100 }]);
    }

    #[test]
    fn a_log_ahead_of_the_journal_is_fatal() {
        let mut rng = SeededRng(1);
        let mut m = machine(3);
        connect(&mut m, &mut rng, 0);
        assert!(matches!(&m.step(0, &mut rng, welcome(9))[..], [Output::Fatal(message)] if message.contains("up to 9")));
    }

    #[test]
    fn heartbeats_follow_the_gateways_interval_and_silence_ends_the_session() {
        let mut rng = SeededRng(3);
        let mut m = machine(0);
        connect(&mut m, &mut rng, 0);
        m.step(0, &mut rng, welcome(0));
        assert!(m.step(4_999, &mut rng, Input::Tick).is_empty());
        assert!(matches!(m.step(5_000, &mut rng, Input::Tick)[..], [Output::Send(agent_message::Msg::Heartbeat(_))]));
        let out = m.step(15_001, &mut rng, Input::Tick);
        assert!(matches!(out[..], [Output::Close { .. }]), "{out:?}");
        assert!(matches!(m.phase(), Phase::Idle { .. }));
    }

    /// gRPC's schedule: each delay within ±20 % of 1 s × 1.6ⁿ, capped at 120 s.
    #[test]
    fn the_backoff_follows_grpcs_schedule() {
        for seed in [1, 2, 3, 99] {
            let mut rng = SeededRng(seed);
            let mut backoff = Backoff::default();
            let mut nominal = 1_000.0f64;
            for attempt in 0..20 {
                let delay = backoff.next_delay_ms(&mut rng) as f64;
                assert!(
                    delay >= nominal * 0.8 - 1.0 && delay <= nominal * 1.2 + 1.0,
                    "seed {seed} attempt {attempt}: {delay} vs {nominal}"
                );
                nominal = (nominal * 1.6).min(120_000.0);
            }
        }
    }
}
