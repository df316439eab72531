//! The in-memory transport of `sim run`: in place of TCP and gRPC between each agent's real
//! session machine (`bc_agent::session::SessionMachine`, the one `bcd node` drives) and the gateway's
//! real session logic (`bc_gateway::agents::session`: `greet`, `prove`, `welcome`, `handle`,
//! `commands_unsent`, `wakes`, the lease batch). A message is a task on the run's schedule, due
//! after a latency drawn from the seed; each direction of a connection is first in, first out,
//! unless a fault reorders it. Nothing here decides what a session does: it carries messages, runs the
//! commands the machine hands it on the agent's real `Runner`, and says which refusals are
//! findings. The gateway's side keeps the session's deadlines as `session::run` does (the hello
//! and the proof within `HANDSHAKE_TIMEOUT_MS`, then a message within a lease of the last one)
//! and follows the log for commands as `session::route_commands` does, waking only the sessions
//! whose node a command was issued to or cancelled for.
//!
//! Faults on the link, each a window of [`LINK_FAULT_MS_MIN`] to [`LINK_FAULT_MS_MAX`] on one
//! node (`partition` aside, each message in the window is hit with [`MESSAGE_FAULT_P`]):
//! - `drop-messages`: a message is lost. A gRPC stream is reliable, so a loss it cannot repair
//!   ends the stream: both ends see it broken and the agent reconnects.
//! - `delay-messages`: a message takes up to [`DELAY_MAX_MS`] more (order kept), past a lease.
//! - `duplicate-messages`: a message arrives twice.
//! - `reorder-messages`: a message overtakes the one before it on its way.
//! - `partition`: the node is cut off both ways: every message on its way is lost and no
//!   connection opens, until it heals; each end notices by its own lease.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bc_core::event::Position;

use bc_agent::session::{Input, Output, Phase, SessionMachine};
use bc_gateway::agents::session::{self, Bound, Greeted, LeaseRenewals, Refusal, RefusalCode, SessionConfig};
use bc_proto::{agent_message, gateway_message};

use super::{Sim, Task, between};
use crate::world::{Violation, chance, seed_bytes};

/// The gateway's lease and heartbeat in the simulated fleet (the defaults are 15 s and 5 s; a
/// longer beat is three times fewer steps, the same code).
pub const SESSION: SessionConfig = SessionConfig { lease_ms: 30_000, heartbeat_ms: 10_000 };
/// How often each agent's session machine is ticked (it beats when its heartbeat is due).
pub const SESSION_TICK_MS: u64 = 10_000;
/// A message's latency, drawn per message.
pub const LATENCY_MIN_MS: u64 = 1;
pub const LATENCY_MAX_MS: u64 = 50;
/// What `delay-messages` adds to a message, at most: more than a lease.
pub const DELAY_MAX_MS: u64 = 40_000;
/// A link fault's window on one node.
pub const LINK_FAULT_MS_MIN: u64 = 10_000;
pub const LINK_FAULT_MS_MAX: u64 = 180_000;
/// The chance a message in a fault's window is dropped, duplicated or reordered.
pub const MESSAGE_FAULT_P: f64 = 0.2;
/// A connection attempt into a partition fails after this.
pub const CONNECT_TIMEOUT_MS: u64 = 5_000;

const _: () = assert!(DELAY_MAX_MS > SESSION.lease_ms && SESSION.heartbeat_ms * 2 < SESSION.lease_ms);
const _: () = assert!(SESSION_TICK_MS <= SESSION.heartbeat_ms);

/// What travels on a connection.
#[derive(Clone, Debug)]
pub enum Message {
    ToGateway(agent_message::Msg),
    ToAgent(gateway_message::Msg),
    /// The agent closed its end: the gateway's session ends when this reaches it.
    Closed,
}

/// The gateway's side of one connection.
pub enum GatewaySide {
    AwaitHello,
    AwaitProof(Box<Greeted>, [u8; 32]),
    Live(Box<Bound>),
}

/// One node's end: its session machine, its connection, the commands waiting for its runner,
/// and its link's faults (each the end of a window).
#[derive(Default)]
pub struct Link {
    /// `None` while the agent is crashed or away.
    pub machine: Option<SessionMachine>,
    /// The connection the machine is on (0: none).
    pub connection: u64,
    /// Commands handed to the runner, in order (a hung runner, `unanswered-holds`, keeps them).
    pub runs: VecDeque<bc_proto::Command>,
    /// The machine's periodic tick: a tick of an older machine (stopped since) is ignored.
    pub tick_generation: u64,
    /// When the last message each way is due (first in, first out).
    to_gateway_last_ms: u64,
    to_agent_last_ms: u64,
    pub drop_until_ms: u64,
    pub delay_until_ms: u64,
    pub duplicate_until_ms: u64,
    pub reorder_until_ms: u64,
    pub partition_until_ms: u64,
}

/// The transport and the gateway's sessions.
#[derive(Default)]
pub struct Net {
    pub links: Vec<Link>,
    /// By node and connection: a node's older connection lives on until its newer one is bound
    /// (as `Sessions::register` replaces it) or its close arrives.
    pub gateway: BTreeMap<(usize, u64), GatewaySide>,
    /// The sessions' lease renewals, written before each liveness pass.
    pub leases: LeaseRenewals,
    connections: u64,
    /// When the gateway's side of each connection last heard from the node (or the stream
    /// opened): it ends the session past its deadline ([`Sim::gateway_idle`]).
    heard: BTreeMap<(usize, u64), u64>,
    /// The gateway's command router (`session::route_commands`): where it has read the log to,
    /// and the log's append count then (it reads again when that moved, or its poll is due).
    router: Router,
}

#[derive(Default)]
struct Router {
    after: Position,
    appends: u64,
    /// When it last read the log: it reads again at least every `COMMAND_POLL_MS`, as the
    /// gateway's router polls for what it was not woken for (another process's commits, or a
    /// commit of its own whose answer a `failover` lost).
    read_at_ms: u64,
}

/// Events the command router reads at once.
const ROUTER_PAGE: u32 = 500;

/// What the transport did, for the outcome.
#[derive(Clone, Debug, Default)]
pub struct NetCounts {
    pub messages: u64,
    pub dropped: u64,
    pub delayed: u64,
    pub duplicated: u64,
    pub reordered: u64,
    pub partitioned: u64,
    pub sessions: u64,
    /// Entries the gateway refused as past a gap (a reordered entry): the session ends.
    pub gaps_refused: u64,
    /// Sessions the gateway ended because the node sent nothing by the deadline.
    pub idle_ended: u64,
}

impl Net {
    pub fn new(nodes: usize) -> Net {
        Net { links: (0..nodes).map(|_| Link::default()).collect(), ..Net::default() }
    }

    /// The gateway restarted: its command router starts again at the log's end, as
    /// `session::route_commands` does (the new sessions are sent what is pending when bound).
    pub async fn router_restart(&mut self, world: &crate::world::World) {
        let commit = world.store.last_commit().await.expect("the log's end reads");
        self.router = Router {
            after: Position { commit, index: i32::MAX as u32 },
            appends: world.log.stats.events.load(std::sync::atomic::Ordering::Relaxed),
            read_at_ms: world.now_ms(),
        };
    }

    pub fn partitioned(&self, a: usize, now_ms: u64) -> bool {
        now_ms < self.links[a].partition_until_ms
    }

    /// Ends every link fault (the liveness phase).
    pub fn heal(&mut self) {
        for link in &mut self.links {
            link.drop_until_ms = 0;
            link.delay_until_ms = 0;
            link.duplicate_until_ms = 0;
            link.reorder_until_ms = 0;
            link.partition_until_ms = 0;
        }
    }
}

/// Refusals a session may end with that are no finding: an injected commit failure
/// (`UNAVAILABLE`), an entry past a gap (the transport reordered it), a handshake message out of
/// order (duplicated or reordered), a node not heard from in time (a delay, a partition).
/// `--unsafe-break bad-proof` flips a bit of the first proof the gateway receives this long
/// into the run (past the start, when every agent connects at once).
const BAD_PROOF_AFTER_MS: u64 = 600_000;

fn refusal_expected(refusal: &Refusal) -> bool {
    refusal.status == RefusalCode::Unavailable
        || refusal.message.starts_with("JOURNAL_GAP")
        || refusal.message.starts_with(OUT_OF_ORDER)
        || refusal.message == HANDSHAKE_AGAIN
        || refusal.status == RefusalCode::DeadlineExceeded
}

/// `session::handle`'s refusal of a hello or a proof once the session is bound (one duplicated
/// or overtaken on its way).
const HANDSHAKE_AGAIN: &str = "hello and proof come once, first";

/// The handshake's refusal of a message out of its place (as `session::run`'s handshake says).
const OUT_OF_ORDER: &str = "out of order: ";

impl Sim {
    /// The agent's clock (skewed).
    pub(super) fn agent_now(&self, a: usize) -> u64 {
        self.world.now_ms().saturating_add_signed(self.world.agents[a].skew_ms)
    }

    /// Puts `message` on connection `connection` of node `a`, through the link's faults.
    pub(super) fn send(&mut self, a: usize, connection: u64, message: Message) {
        let now = self.world.now_ms();
        self.net_counts.messages += 1;
        let faults = self.faults_running;
        let link = &self.net.links[a];
        let (drop, delay, duplicate, reorder) = (
            faults && now < link.drop_until_ms,
            faults && now < link.delay_until_ms,
            faults && now < link.duplicate_until_ms,
            faults && now < link.reorder_until_ms,
        );
        if drop && !matches!(message, Message::Closed) && chance(&mut self.rng, MESSAGE_FAULT_P) {
            self.net_counts.dropped += 1;
            self.cut(a, connection, "a message was lost: the stream broke");
            return;
        }
        let mut latency = between(&mut self.rng, LATENCY_MIN_MS, LATENCY_MAX_MS);
        if delay && chance(&mut self.rng, MESSAGE_FAULT_P) {
            self.net_counts.delayed += 1;
            latency += between(&mut self.rng, 0, DELAY_MAX_MS);
        }
        let to_gateway = !matches!(message, Message::ToAgent(_));
        let link = &mut self.net.links[a];
        let last = if to_gateway { &mut link.to_gateway_last_ms } else { &mut link.to_agent_last_ms };
        let mut at = now.saturating_add(latency).max(*last);
        if reorder && *last > now && chance(&mut self.rng, MESSAGE_FAULT_P) {
            // Overtakes the message before it.
            self.net_counts.reordered += 1;
            at = *last - 1;
        } else {
            *last = at;
        }
        if duplicate && chance(&mut self.rng, MESSAGE_FAULT_P) {
            self.net_counts.duplicated += 1;
            let again = at + between(&mut self.rng, 0, LATENCY_MAX_MS);
            self.schedule(again, Task::Deliver(a, connection, Box::new(message.clone())));
            let link = &mut self.net.links[a];
            let last = if to_gateway { &mut link.to_gateway_last_ms } else { &mut link.to_agent_last_ms };
            *last = (*last).max(again);
        }
        self.schedule(at, Task::Deliver(a, connection, Box::new(message)));
    }

    /// Connection `connection` of node `a` broke: each end hears of it after a latency.
    pub(super) fn cut(&mut self, a: usize, connection: u64, reason: &str) {
        let latency = between(&mut self.rng, LATENCY_MIN_MS, LATENCY_MAX_MS);
        self.after(latency, Task::Broken(a, connection, reason.to_owned()));
        let latency = between(&mut self.rng, LATENCY_MIN_MS, LATENCY_MAX_MS);
        self.after(latency, Task::Deliver(a, connection, Box::new(Message::Closed)));
    }

    /// The agent of node `a` starts (or starts again): its runner over its journal, and a
    /// session machine from the journal's head and what it was acknowledged.
    pub(super) async fn agent_start(&mut self, a: usize) {
        self.down_since.remove(&a);
        self.updating.remove(&a);
        if self.world.agents[a].runner.is_none() {
            self.world.agents[a].start().await;
        }
        let agent = &self.world.agents[a];
        let runner = agent.runner.as_ref().expect("started");
        let head = runner.journal.head().await.expect("the journal's head reads");
        let acked = runner.journal.acked().await.expect("the journal's ack reads");
        let machine =
            SessionMachine::new(runner.node, agent.key.clone(), runner.capabilities(), agent.version.clone(), head, acked);
        let link = &mut self.net.links[a];
        link.machine = Some(machine);
        link.connection = 0;
        link.runs.clear();
        link.tick_generation += 1;
        let generation = link.tick_generation;
        self.after(0, Task::SessionTick(a, generation));
    }

    /// The agent of node `a` stops (crashed or away): its runner, its machine and the commands
    /// it had not run are gone (its journal and ledger stay); its stream breaks.
    pub(super) fn agent_stop(&mut self, a: usize) {
        let now = self.world.now_ms();
        self.down_since.entry(a).or_insert(now);
        self.world.agents[a].runner = None;
        let link = &mut self.net.links[a];
        link.machine = None;
        link.runs.clear();
        let connection = std::mem::take(&mut link.connection);
        if connection != 0 {
            self.cut(a, connection, "the agent stopped");
        }
    }

    /// One input to node `a`'s machine, and everything that follows from it on the agent's
    /// side: messages sent, entries sent, acknowledgements recorded, commands run.
    pub(super) async fn agent_input(&mut self, a: usize, input: Input) -> Result<(), Violation> {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            let now = self.agent_now(a);
            let Some(machine) = self.net.links[a].machine.as_mut() else { return Ok(()) };
            let outputs = machine.step(now, &mut self.rng, input);
            for output in outputs {
                let connection = self.net.links[a].connection;
                match output {
                    Output::Connect => self.connect(a),
                    Output::Send(msg) => {
                        if connection != 0 {
                            self.send(a, connection, Message::ToGateway(msg));
                        }
                    }
                    Output::SendEntries { from, to } => {
                        let Some(runner) = self.world.agents[a].runner.as_ref() else { continue };
                        let count = (to + 1 - from).min(u64::from(bc_agent::journal::READ_ENTRIES_MAX)) as u32;
                        let entries = runner.journal.after(from - 1, count).await.expect("the journal reads");
                        for entry in entries.into_iter().filter(|e| e.seq <= to) {
                            let msg = agent_message::Msg::Entry(bc_proto::JournalEntry {
                                seq: entry.seq,
                                body: entry.body,
                                signature: entry.signature.to_vec(),
                            });
                            if connection != 0 {
                                self.send(a, connection, Message::ToGateway(msg));
                            }
                        }
                    }
                    Output::Acknowledged { seq } => {
                        let agent = &mut self.world.agents[a];
                        if let Some(runner) = agent.runner.as_ref() {
                            runner.journal.ack(seq).await.expect("the journal records the ack");
                        }
                        agent.delivered = agent.delivered.max(seq);
                    }
                    Output::Run(command) => self.net.links[a].runs.push_back(command),
                    Output::Close { .. } => {
                        self.net.links[a].connection = 0;
                        if connection != 0 {
                            self.send(a, connection, Message::Closed);
                        }
                    }
                    Output::Fatal(message) => {
                        return Err(Violation(format!("the agent of {} stopped: {message}", self.world.agents[a].node)));
                    }
                }
            }
            if let Some(journaled) = self.run_commands(a).await {
                inputs.push_back(journaled);
            }
        }
        // A machine gone idle waits for its retry: tick it then.
        if let Some(Phase::Idle { retry_at_ms }) = self.net.links[a].machine.as_ref().map(|m| m.phase().clone()) {
            let connection = std::mem::take(&mut self.net.links[a].connection);
            if connection != 0 {
                self.send(a, connection, Message::Closed);
            }
            let wait = retry_at_ms.saturating_sub(self.agent_now(a));
            self.after(wait.max(1), Task::SessionRetry(a));
        }
        Ok(())
    }

    /// Node `a`'s machine asks for a stream: it opens after a latency, or fails into a partition.
    fn connect(&mut self, a: usize) {
        self.net.connections += 1;
        let connection = self.net.connections;
        self.net.links[a].connection = connection;
        if self.net.partitioned(a, self.world.now_ms()) {
            self.after(CONNECT_TIMEOUT_MS, Task::Broken(a, connection, "the gateway is unreachable".into()));
            return;
        }
        self.net_counts.sessions += 1;
        self.net.gateway.insert((a, connection), GatewaySide::AwaitHello);
        self.net.heard.insert((a, connection), self.world.now_ms());
        self.after(session::HANDSHAKE_TIMEOUT_MS, Task::GatewayIdle(a, connection));
        let latency = between(&mut self.rng, LATENCY_MIN_MS, LATENCY_MAX_MS);
        self.after(latency, Task::Connected(a, connection));
    }

    /// Runs the commands handed to node `a`'s runner, in order (none while it is hung: the
    /// `unanswered-holds` fault), and retries the releases its machine refused. An agent due to
    /// crash (`agent-crash`) crashes after running them, before its journal goes out. Returns
    /// the input that tells the machine of the new entries.
    pub(super) async fn run_commands(&mut self, a: usize) -> Option<Input> {
        let now = self.agent_now(a);
        if self.deaf_until[a] > self.world.now_ms() || self.net.links[a].runs.is_empty() {
            return None;
        }
        let runner = self.world.agents[a].runner.as_ref()?;
        let mut last = None;
        let mut ran = Vec::new();
        let mut update = None;
        while let Some(command) = self.net.links[a].runs.pop_front() {
            if super::rollouts::is_update(&command) {
                // The machine's updater (slots, re-exec) is modelled: `run/rollouts.rs`.
                update.get_or_insert(command);
                continue;
            }
            let entries = runner.run(&command, now).await.expect("the runner runs");
            last = entries.last().map(|e| (e.seq, e.hash)).or(last);
            ran.push(command.command_id);
        }
        self.commands_run += ran.len() as u64;
        self.world.agents[a].remember_ran(ran);
        if let Some(command) = update {
            // What the runner journaled goes out with the agent's next session.
            self.agent_update(a, &command).await;
            return None;
        }
        if std::mem::take(&mut self.crash_next[a]) {
            self.agent_stop(a);
            let back = between(&mut self.rng, 1_000, 120_000);
            self.after(back, Task::Restart(a));
            return None;
        }
        last.map(|(seq, hash)| Input::Journaled { seq, hash })
    }

    /// A message reaches the gateway's side of connection `connection` of node `a`, which
    /// answers as `session::run` does, through the same functions.
    pub(super) async fn gateway_receive(&mut self, a: usize, connection: u64, msg: agent_message::Msg) -> Result<(), Violation> {
        let Some(side) = self.net.gateway.remove(&(a, connection)) else { return Ok(()) };
        self.net.heard.insert((a, connection), self.world.now_ms());
        let next = match (side, msg) {
            (GatewaySide::AwaitHello, agent_message::Msg::Hello(hello)) => match session::greet(&*self.world.store, &hello).await
            {
                Ok(greeted) => {
                    let nonce = seed_bytes(&mut self.rng);
                    let challenge = gateway_message::Msg::Challenge(bc_proto::Challenge { nonce: nonce.to_vec() });
                    self.send(a, connection, Message::ToAgent(challenge));
                    Some(GatewaySide::AwaitProof(Box::new(greeted), nonce))
                }
                Err(refusal) => return self.session_refused(a, connection, refusal),
            },
            (GatewaySide::AwaitProof(greeted, nonce), agent_message::Msg::Proof(mut proof)) => {
                if self.options.unsafe_break == Some(super::Break::BadProof)
                    && self.world.now_ms() >= crate::world::EPOCH_MS + BAD_PROOF_AFTER_MS
                    && !std::mem::replace(&mut self.proof_broken, true)
                    && let Some(bit) = proof.signature.first_mut()
                {
                    // TEST ONLY (`--unsafe-break bad-proof`): one proof, one bit flipped.
                    *bit ^= 1;
                }
                match session::prove(*greeted, &nonce, &proof) {
                    Ok(mut bound) => {
                        // The newest session of a node replaces its older ones.
                        self.net.gateway.retain(|(b, _), _| *b != a);
                        session::renew(&self.world.log, &self.net.leases, bound.tenant, &bound.node, SESSION);
                        self.send(a, connection, Message::ToAgent(session::welcome(&bound, SESSION)));
                        match session::commands_unsent(&*self.world.store, &mut bound).await {
                            Ok(commands) => {
                                for command in commands {
                                    self.send(a, connection, Message::ToAgent(command));
                                }
                            }
                            Err(refusal) => return self.session_refused(a, connection, refusal),
                        }
                        Some(GatewaySide::Live(Box::new(bound)))
                    }
                    Err(refusal) => return self.session_refused(a, connection, refusal),
                }
            }
            (GatewaySide::Live(mut bound), msg) => {
                if let (false, agent_message::Msg::Entry(entry)) = (self.world.journal_dedupe, &msg) {
                    // TEST ONLY (`--unsafe-no-journal-dedupe`): the entry is appended as it
                    // comes, without the session's checks or its idempotency key.
                    if self.world.append_entry_unchecked(a, entry).await {
                        let ack = gateway_message::Msg::EntryAck(bc_proto::EntryAck { seq: entry.seq });
                        self.send(a, connection, Message::ToAgent(ack));
                    }
                    Some(GatewaySide::Live(bound))
                } else {
                    match session::handle(&self.world.log, &self.net.leases, SESSION, &mut bound, msg).await {
                        Ok(reply) => {
                            if let Some(reply) = reply {
                                self.send(a, connection, Message::ToAgent(reply));
                            }
                            Some(GatewaySide::Live(bound))
                        }
                        Err(refusal) => return self.session_refused(a, connection, refusal),
                    }
                }
            }
            (_, msg) => {
                let refusal =
                    Refusal { status: RefusalCode::InvalidArgument, message: format!("{OUT_OF_ORDER}{}", message_kind(&msg)) };
                return self.session_refused(a, connection, refusal);
            }
        };
        if let Some(next) = next {
            self.net.gateway.insert((a, connection), next);
        }
        Ok(())
    }

    /// The gateway's deadline on connection `connection` of node `a`, as `session::run` keeps
    /// it: the hello and the proof each within `HANDSHAKE_TIMEOUT_MS`, then a message within a
    /// lease of the last one; past it, the session ends ([`session::idle_refusal`]). One timer
    /// per session, set again for the deadline the last message moved.
    pub(super) fn gateway_idle(&mut self, a: usize, connection: u64) -> Result<(), Violation> {
        let key = (a, connection);
        let within = match self.net.gateway.get(&key) {
            None => {
                self.net.heard.remove(&key);
                return Ok(());
            }
            Some(GatewaySide::Live(_)) => SESSION.lease_ms,
            Some(_) => session::HANDSHAKE_TIMEOUT_MS,
        };
        let due = self.net.heard.get(&key).copied().unwrap_or_default() + within;
        if self.world.now_ms() < due {
            self.schedule(due, Task::GatewayIdle(a, connection));
            return Ok(());
        }
        self.net.gateway.remove(&key);
        self.net.heard.remove(&key);
        self.net_counts.idle_ended += 1;
        self.session_refused(a, connection, session::idle_refusal())
    }

    /// The gateway ended a session with `refusal`: the stream ends. A refusal no fault explains
    /// (a signature, a link, what a node may say) is a finding.
    fn session_refused(&mut self, a: usize, connection: u64, refusal: Refusal) -> Result<(), Violation> {
        if refusal.message.starts_with("JOURNAL_GAP") {
            self.net_counts.gaps_refused += 1;
        }
        if !refusal_expected(&refusal) {
            return Err(Violation(format!(
                "the gateway's session of {} refused: {:?} {}",
                self.world.agents[a].node, refusal.status, refusal.message
            )));
        }
        self.cut(a, connection, &refusal.message);
        Ok(())
    }

    /// The gateway's command router, after each step: reads what was committed since it last
    /// read (when this process committed something, or its poll is due: a commit whose answer
    /// was lost is counted nowhere, and only the poll finds its commands), and each live session whose node a command was issued
    /// to or cancelled for (`session::wakes`) sends the commands it has not sent yet. No other
    /// session is woken, as in the gateway: a command waits for its node's session to be woken
    /// or bound.
    pub(super) async fn route_commands(&mut self) -> Result<(), Violation> {
        let appends = self.world.log.stats.events.load(std::sync::atomic::Ordering::Relaxed);
        let now_ms = self.world.now_ms();
        let poll_due = now_ms >= self.net.router.read_at_ms.saturating_add(bc_gateway::agents::COMMAND_POLL_MS);
        if appends == self.net.router.appends && !poll_due {
            return Ok(());
        }
        self.net.router.appends = appends;
        self.net.router.read_at_ms = now_ms;
        let mut woken = BTreeSet::new();
        loop {
            let rows = self.world.store.read_after_rows(self.net.router.after, None, ROUTER_PAGE).await.expect("the log reads");
            let full = rows.len() == ROUTER_PAGE as usize;
            for event in bc_core::store::decode_rows(rows).expect("the log decodes") {
                self.net.router.after = event.position;
                woken.extend(session::wakes(&event));
            }
            if !full {
                break;
            }
        }
        if woken.is_empty() {
            return Ok(());
        }
        let keys: Vec<(usize, u64)> = self
            .net
            .gateway
            .iter()
            .filter(|((a, _), side)| woken.contains(&self.world.agents[*a].node) && matches!(side, GatewaySide::Live(_)))
            .map(|(key, _)| *key)
            .collect();
        for (a, connection) in keys {
            let Some(GatewaySide::Live(bound)) = self.net.gateway.get_mut(&(a, connection)) else { continue };
            match session::commands_unsent(&*self.world.store, bound).await {
                Ok(commands) => {
                    for command in commands {
                        self.send(a, connection, Message::ToAgent(command));
                    }
                }
                Err(refusal) => {
                    self.net.gateway.remove(&(a, connection));
                    self.session_refused(a, connection, refusal)?;
                }
            }
        }
        Ok(())
    }
}

fn message_kind(msg: &agent_message::Msg) -> &'static str {
    match msg {
        agent_message::Msg::Hello(_) => "hello",
        agent_message::Msg::Proof(_) => "proof",
        agent_message::Msg::Heartbeat(_) => "heartbeat",
        agent_message::Msg::Entry(_) => "entry",
        agent_message::Msg::CommandReceived(_) => "command received",
        agent_message::Msg::RenewCertificate(_) => "certificate renewal",
    }
}
