//! `bcd node`: the [`Machine`] wrapped in tokio and tonic. The driver owns the IO the machine
//! asks for: the stream to the gateway, the journal, the command runner, the clock, the status
//! socket. Each input it feeds the machine and each output it carries out, in order.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bc_core::clock::{Clock, SystemClock};
use bc_proto::agent_client::AgentClient;
use bc_proto::{agent_message, gateway_message};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::config::{Config, Identity};
use crate::journal::{Journal, JournalError, READ_ENTRIES_MAX};
use crate::machine::{Input, Machine, Output, Phase, SystemRng};
use crate::runner::{Agent, Instances, Runner};

/// How often the machine is ticked.
pub const TICK_MS: u64 = 100;
/// Messages queued towards the gateway; past it the driver waits (the stream's own flow control).
pub const OUTBOUND_MESSAGES: usize = 256;
/// How often the inventory is read again to see whether it changed.
pub const INVENTORY_CHECK_MS: u64 = 60_000;
/// Commands waiting to run, in order.
pub const COMMANDS_QUEUED_MAX: usize = 512;

/// What `bcd status` shows.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    pub node_id: String,
    pub tenant_id: String,
    pub pool_id: String,
    pub agent_version: String,
    pub gateway: String,
    /// `idle`, `connecting`, `handshake`, `live`.
    pub session: String,
    pub sessions: u64,
    pub journal_head: u64,
    pub journal_acked: u64,
    pub journal_unacked: u64,
    /// The journal is at its bound: nothing more is written until the gateway acknowledges.
    pub journal_full: bool,
    pub last_error: Option<String>,
}

enum Event {
    Connected(u64, mpsc::Sender<bc_proto::AgentMessage>),
    Message(u64, gateway_message::Msg),
    Broken(u64, String),
    Journaled(u64, [u8; 32]),
    JournalFull(String),
}

pub async fn run(config: Config, identity: Identity, shutdown: impl std::future::Future<Output = ()>) -> Result<(), String> {
    let node: bc_core::id::NodeId = identity.identity.node_id.parse().map_err(|e: bc_core::Error| e.to_string())?;
    let gateway = config.gateway()?;
    let channel = gateway.channel()?;
    let journal = Arc::new(Journal::open(&config.journal_path(), node, config.unacked_max()).await.map_err(|e| match e {
        JournalError::OtherNode { .. } => {
            format!("{}: {e} (hint: this data directory holds another node's journal)", config.journal_path().display())
        }
        other => other.to_string(),
    })?);
    let version = env!("CARGO_PKG_VERSION").to_owned();
    let head = journal.head().await.map_err(|e| e.to_string())?;
    let acked = journal.acked().await.map_err(|e| e.to_string())?;
    let runner = Runner::for_config(&config, journal.clone(), identity.key.clone(), node, version.clone())?;
    let agent = Arc::new(Agent { runner, instances: Instances::for_config(&config)? });
    let inventory = agent.runner.inventory.clone();
    let capabilities = agent.capabilities();
    if !capabilities.iter().any(|c| c == crate::runner::CAPABILITY_GPU_HOLD)
        && let Some(reason) = agent.runner.binding.unprivileged()
    {
        tracing::warn!(reason = %reason, "this node cannot hold GPUs: holds fail at once");
    }
    if agent.instances.is_none() {
        tracing::info!("this node has no hypervisor: it runs no instances");
    }
    let mut machine = Machine::new(node, identity.key.clone(), capabilities, version.clone(), head, acked);
    let status = Arc::new(Mutex::new(Status {
        node_id: identity.identity.node_id.clone(),
        tenant_id: identity.identity.tenant_id.clone(),
        pool_id: identity.identity.pool_id.clone(),
        agent_version: version,
        gateway: config.gateway.clone(),
        ..Default::default()
    }));
    let socket = crate::status::serve(&config.socket_path(), status.clone())?;
    tracing::info!(node = %node, gateway = %config.gateway, journal_head = head.0, journal_acked = acked, "bcd node started");

    let clock = SystemClock;
    let mut rng = SystemRng;
    let (events_tx, mut events) = mpsc::channel::<Event>(1024);
    let (commands_tx, commands_rx) = mpsc::channel::<bc_proto::Command>(COMMANDS_QUEUED_MAX);
    let worker = tokio::spawn(run_commands(agent.clone(), commands_rx, events_tx.clone()));
    let observer = tokio::spawn(observe(agent.clone(), inventory, config.observe_interval_ms()?, events_tx.clone()));
    let mut generation = 0u64;
    let mut outbound: Option<mpsc::Sender<bc_proto::AgentMessage>> = None;
    let mut ticker = tokio::time::interval(Duration::from_millis(TICK_MS));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let result = loop {
        let input = tokio::select! {
            _ = &mut shutdown => break Ok(()),
            _ = ticker.tick() => Input::Tick,
            event = events.recv() => match event {
                None => break Err("the driver's channels closed".into()),
                Some(Event::Connected(g, sender)) if g == generation => { outbound = Some(sender); Input::Connected }
                Some(Event::Message(g, msg)) if g == generation => Input::Received(msg),
                Some(Event::Broken(g, reason)) if g == generation => {
                    outbound = None;
                    tracing::info!(reason = %reason, "the session to the gateway ended");
                    status.lock().expect("status lock").last_error = Some(reason.clone());
                    Input::Disconnected { reason }
                }
                Some(Event::Journaled(seq, hash)) => {
                    let mut s = status.lock().expect("status lock");
                    s.journal_full = false;
                    Input::Journaled { seq, hash }
                }
                Some(Event::JournalFull(message)) => {
                    tracing::error!(error = %message, "the journal is full");
                    let mut s = status.lock().expect("status lock");
                    s.journal_full = true;
                    s.last_error = Some(message);
                    continue;
                }
                Some(_) => continue, // an event of a session already given up
            },
        };
        let outputs = machine.step(clock.now_ms(), &mut rng, input);
        let mut overflowed = false;
        for output in outputs {
            match output {
                Output::Connect => {
                    generation += 1;
                    tokio::spawn(connect(channel.clone(), generation, events_tx.clone()));
                }
                Output::Send(msg) => send(&outbound, msg).await,
                Output::SendEntries { from, to } => {
                    if let Err(e) = send_entries(&journal, &outbound, from, to).await {
                        tracing::error!(error = %e, "reading the journal failed");
                    }
                }
                Output::Acknowledged { seq } => {
                    if let Err(e) = journal.ack(seq).await {
                        tracing::error!(error = %e, "marking entries acknowledged failed");
                    }
                }
                Output::Run(command) => {
                    // Dropping one command and running the next would run them out of order
                    // (a release before its hold): the session ends instead, and the next one
                    // delivers every unfinished command again, in issue order.
                    if !overflowed && commands_tx.try_send(command).is_err() {
                        tracing::warn!("the command queue is full; the session ends so commands come again in order");
                        overflowed = true;
                        outbound = None;
                        generation += 1;
                    }
                }
                Output::Close { reason } => {
                    tracing::info!(reason = %reason, "closing the session");
                    outbound = None;
                    generation += 1;
                }
                Output::Fatal(message) => {
                    worker.abort();
                    observer.abort();
                    return Err(message);
                }
            }
        }
        if overflowed {
            machine.step(clock.now_ms(), &mut rng, Input::Disconnected { reason: "the command queue is full".into() });
        }
        let mut s = status.lock().expect("status lock");
        s.session = match machine.phase() {
            Phase::Idle { .. } => "idle",
            Phase::Connecting => "connecting",
            Phase::AwaitChallenge | Phase::AwaitWelcome => "handshake",
            Phase::Live => "live",
        }
        .into();
        s.sessions = machine.sessions;
        s.journal_head = machine.head();
        s.journal_acked = machine.acked();
        s.journal_unacked = machine.head().saturating_sub(machine.acked());
    };
    worker.abort();
    observer.abort();
    socket.abort();
    let _ = std::fs::remove_file(config.socket_path());
    tracing::info!("bcd node stopped");
    result
}

async fn send(outbound: &Option<mpsc::Sender<bc_proto::AgentMessage>>, msg: agent_message::Msg) {
    if let Some(sender) = outbound {
        let _ = sender.send(bc_proto::AgentMessage { msg: Some(msg) }).await;
    }
}

async fn send_entries(
    journal: &Journal,
    outbound: &Option<mpsc::Sender<bc_proto::AgentMessage>>,
    from: u64,
    to: u64,
) -> Result<(), JournalError> {
    let mut next = from;
    while next <= to {
        let count = (to - next + 1).min(u64::from(READ_ENTRIES_MAX)) as u32;
        let entries = journal.after(next - 1, count).await?;
        if entries.is_empty() {
            break;
        }
        for entry in entries {
            next = entry.seq + 1;
            let msg = agent_message::Msg::Entry(bc_proto::JournalEntry {
                seq: entry.seq,
                body: entry.body,
                signature: entry.signature.to_vec(),
            });
            send(outbound, msg).await;
        }
    }
    Ok(())
}

async fn connect(channel: tonic::transport::Channel, generation: u64, events: mpsc::Sender<Event>) {
    let (sender, receiver) = mpsc::channel(OUTBOUND_MESSAGES);
    let mut client = AgentClient::new(channel)
        .max_decoding_message_size(bc_proto::MESSAGE_BYTES_MAX)
        .max_encoding_message_size(bc_proto::MESSAGE_BYTES_MAX);
    let mut inbound = match client.session(ReceiverStream::new(receiver)).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let _ = events.send(Event::Broken(generation, format!("{}: {}", status.code(), status.message()))).await;
            return;
        }
    };
    if events.send(Event::Connected(generation, sender)).await.is_err() {
        return;
    }
    loop {
        let event = match inbound.message().await {
            Ok(Some(bc_proto::GatewayMessage { msg: Some(msg) })) => Event::Message(generation, msg),
            Ok(Some(_)) => continue,
            Ok(None) => Event::Broken(generation, "the gateway closed the stream".into()),
            Err(status) => Event::Broken(generation, format!("{}: {}", status.code(), status.message())),
        };
        let broken = matches!(event, Event::Broken(..));
        if events.send(event).await.is_err() || broken {
            return;
        }
    }
}

async fn run_commands(agent: Arc<Agent>, mut commands: mpsc::Receiver<bc_proto::Command>, events: mpsc::Sender<Event>) {
    while let Some(command) = commands.recv().await {
        match agent.run(&command, SystemClock.now_ms()).await {
            Ok(entries) => {
                for entry in entries {
                    let _ = events.send(Event::Journaled(entry.seq, entry.hash)).await;
                }
            }
            Err(JournalError::Full(n)) => {
                let message =
                    format!("journal full ({n} unacknowledged entries): command {} waits for its redelivery", command.command_id);
                let _ = events.send(Event::JournalFull(message)).await;
            }
            Err(e) => tracing::error!(error = %e, "journaling a command failed"),
        }
    }
}

/// Journals what the machine holds at start and whenever it changes (looked at every
/// `INVENTORY_CHECK_MS`), and an observation every `interval_ms`; each tick it retries the
/// releases the machine refused and journals each instance whose state changed.
async fn observe(
    agent: Arc<Agent>,
    inventory: Arc<dyn crate::inventory::InventorySource>,
    interval_ms: u64,
    events: mpsc::Sender<Event>,
) {
    let mut ticker = tokio::time::interval(Duration::from_millis(interval_ms));
    let mut reported: Option<crate::inventory::Inventory> = None;
    let mut next_inventory_ms = 0u64;
    loop {
        ticker.tick().await;
        let now_ms = SystemClock.now_ms();
        journaled(&events, agent.retry_releases(now_ms).await, "a retried release").await;
        journaled(&events, agent.observe_instances(now_ms).await, "an instance's change").await;
        if now_ms >= next_inventory_ms {
            next_inventory_ms = now_ms + INVENTORY_CHECK_MS;
            let found = inventory.read();
            if reported.as_ref() != Some(&found) {
                match agent.report_inventory(now_ms, &found).await {
                    Ok(entry) => {
                        tracing::info!(gpus = found.gpus.gpus.len(), unavailable = ?found.gpus.unavailable, "inventory reported");
                        reported = Some(found);
                        let _ = events.send(Event::Journaled(entry.seq, entry.hash)).await;
                    }
                    Err(JournalError::Full(n)) => {
                        let _ = events
                            .send(Event::JournalFull(format!("journal full ({n} unacknowledged entries): the inventory waits")))
                            .await;
                    }
                    Err(e) => tracing::error!(error = %e, "journaling the inventory failed"),
                }
            }
        }
        journaled(&events, agent.runner.observe(now_ms).await.map(|entry| vec![entry]), "an observation").await;
    }
}

/// Tells the session loop of the entries `written` (so it sends them), or that the journal is
/// full and `what` was not written.
async fn journaled(events: &mpsc::Sender<Event>, written: Result<Vec<bc_core::agent::SignedEntry>, JournalError>, what: &str) {
    match written {
        Ok(entries) => {
            for entry in entries {
                let _ = events.send(Event::Journaled(entry.seq, entry.hash)).await;
            }
        }
        Err(JournalError::Full(n)) => {
            let message = format!("journal full ({n} unacknowledged entries): {what} was not written");
            let _ = events.send(Event::JournalFull(message)).await;
        }
        Err(e) => tracing::error!(error = %e, what, "journaling failed"),
    }
}
