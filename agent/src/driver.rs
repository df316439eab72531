//! `bcd node`: the [`SessionMachine`] wrapped in tokio and tonic. The driver owns the IO the machine
//! asks for: the stream to the gateway, the journal, the command runner, the clock, the status
//! socket. Each input it feeds the machine and each output it carries out, in order.

use std::path::PathBuf;
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
use crate::runner::{Agent, Instances, Runner};
use crate::session::{Input, Output, Phase, SessionMachine, SystemRng};
use crate::update::{Launch, Pending, UpdateSettings, Updater};

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
    /// The gateway refused the node as revoked (its session's end, or the TLS layer's alert).
    Revoked(u64),
    Journaled(u64, [u8; 32]),
    JournalFull(String),
}

/// How `bcd node` ended.
#[derive(Debug)]
pub enum Exit {
    /// Stopped by the shutdown signal.
    Stopped,
    /// An update switched to this binary: the process executes it, with the same arguments.
    Reexec(PathBuf),
}

/// `bcd node` without an update path (the agents of `bcd sim`).
pub async fn run(config: Config, identity: Identity, shutdown: impl std::future::Future<Output = ()>) -> Result<(), String> {
    run_node(config, identity, None, shutdown).await.map(|_| ())
}

/// `bcd node`: `launch` is how it was started, which an update needs (with `[update]`) to start
/// the old agent again after a rollback.
pub async fn run_node(
    config: Config,
    identity: Identity,
    launch: Option<Launch>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Exit, String> {
    let node: bc_core::id::NodeId = identity.identity.node_id.parse().map_err(|e: bc_core::Error| e.to_string())?;
    let gateway = config.gateway()?;
    // The node certificate, presented in every handshake and swapped on renewal.
    let certificate = crate::node_cert::NodeCertificateFile::load(&config.data_dir)?;
    let certificates = crate::node_cert::NodeCertificates::new(&identity.key, certificate.as_ref())?;
    let revoked_alert = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let channel = gateway.channel_presenting(Some(certificates.clone()), revoked_alert.clone())?;
    let started_ms = SystemClock.now_ms();
    let first = renew_after_ms()?.map(|after| (started_ms, after));
    let renewal_due_ms = certificate.as_ref().map(|c| crate::node_cert::renewal_due_ms(c.issued_at_ms, c.not_after_ms, first));
    let version = crate::update::running_version();
    let (journal, agent, capabilities) = open_agent(&config, &identity, node, &version, launch.clone()).await?;
    let updater = agent.update.clone();
    let inventory = agent.runner.inventory.clone();
    let status = status_of(&identity, &config, &version);
    let (updates_tx, updates_rx) = mpsc::channel::<crate::status::UpdateRequest>(1);
    let socket = crate::status::serve(&config.socket_path(), status.clone(), updater.as_ref().map(|_| updates_tx))?;
    let by_hand = updater.clone().map(|updater| tokio::spawn(updates_by_hand(updater, updates_rx)));
    if launch.is_some() {
        crate::update::write_pid_file(&config.data_dir)?;
    }
    let pending_confirmation = journal_start(&agent).await?;
    // bcd's own /metrics, fed from here (the machine knows nothing of it); `bcd node` serves it
    // when `[metrics] listen` is set, `bcd sim`'s agents never.
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let metrics_served = match &launch {
        Some(launch) => serve_metrics(&launch.config_path, &metrics).await?,
        None => None,
    };
    let mut reexec = updater.as_ref().map(|u| u.reexec_requested());
    let head = journal.head().await.map_err(|e| e.to_string())?;
    let acked = journal.acked().await.map_err(|e| e.to_string())?;
    let machine = SessionMachine::new(node, identity.key.clone(), capabilities, version.clone(), head, acked);
    tracing::info!(node = %node, gateway = %config.gateway, journal_head = head.0, journal_acked = acked, "bcd node started");

    let (events_tx, mut events) = mpsc::channel::<Event>(1024);
    let (commands_tx, commands_rx) = mpsc::channel::<bc_proto::Command>(COMMANDS_QUEUED_MAX);
    let worker = tokio::spawn(run_commands(agent.clone(), commands_rx, events_tx.clone(), metrics.clone()));
    let observer =
        tokio::spawn(observe(agent.clone(), inventory, config.observe_interval_ms()?, events_tx.clone(), metrics.clone()));
    let mut driver = Driver {
        machine,
        rng: SystemRng,
        channel,
        generation: 0,
        outbound: None,
        events_tx,
        commands_tx,
        journal,
        status,
        agent,
        pending_confirmation,
        live_since_ms: None,
        ssh: config.ssh.clone().map(|ssh| crate::ssh_ca::SshInstaller::new(ssh, node.to_string())),
        metrics,
        renewal: Renewal { data_dir: config.data_dir.clone(), certificates, certificate, due_ms: renewal_due_ms, asked_ms: None },
        revoked_alert,
    };
    let mut ticker = tokio::time::interval(Duration::from_millis(TICK_MS));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let result = loop {
        let input = tokio::select! {
            _ = &mut shutdown => break Ok(Exit::Stopped),
            path = reexec_wanted(&mut reexec) => break Ok(Exit::Reexec(path)),
            _ = ticker.tick() => Input::Tick,
            event = events.recv() => match event {
                None => break Err("the driver's channels closed".into()),
                Some(Event::Revoked(g)) if g == driver.generation => {
                    tracing::error!("the gateway revoked this node: its certificate is refused");
                    break Err(crate::node_cert::REVOKED_MESSAGE.into());
                }
                Some(event) => match driver.input(event) {
                    Some(input) => input,
                    None => continue,
                },
            },
        };
        if let Err(message) = driver.step(input).await {
            worker.abort();
            observer.abort();
            if let Some(task) = &metrics_served {
                task.abort();
            }
            return Err(message);
        }
        driver.confirm_when_healthy().await;
        driver.show_status();
    };
    worker.abort();
    observer.abort();
    socket.abort();
    if let Some(task) = metrics_served {
        task.abort();
    }
    if let Some(task) = by_hand {
        task.abort();
    }
    let _ = std::fs::remove_file(config.socket_path());
    match &result {
        Ok(Exit::Reexec(path)) => tracing::info!(binary = %path.display(), "bcd node re-executes"),
        _ => {
            if launch.is_some() {
                let _ = std::fs::remove_file(config.data_dir.join(crate::update::PID_FILE));
            }
            tracing::info!("bcd node stopped");
        }
    }
    result
}

/// `[metrics] listen` of the configuration at `config_path`: bound, and served until the task
/// is aborted; none without it.
async fn serve_metrics(
    config_path: &std::path::Path,
    metrics: &Arc<crate::metrics::Metrics>,
) -> Result<Option<tokio::task::JoinHandle<()>>, String> {
    let settings = crate::config::MetricsConfig::load(config_path).map_err(|e| e.0)?;
    let Some(listen) = settings.listen else { return Ok(None) };
    let (listener, bound) = crate::metrics::bind(&listen).await?;
    tracing::info!(address = %bound, "serving /metrics");
    Ok(Some(tokio::spawn(crate::metrics::serve(listener, metrics.clone()))))
}

/// Opens the node's journal and builds what runs its commands (the runner, the hypervisor, the
/// updater with `[update]` and a `launch`); and the capabilities the session announces, with a
/// line in the log for each it lacks.
async fn open_agent(
    config: &Config,
    identity: &Identity,
    node: bc_core::id::NodeId,
    version: &str,
    launch: Option<Launch>,
) -> Result<(Arc<Journal>, Arc<Agent>, Vec<String>), String> {
    let journal = Arc::new(Journal::open(&config.journal_path(), node, config.unacked_max()).await.map_err(|e| match e {
        JournalError::OtherNode { .. } => {
            format!("{}: {e} (hint: this data directory holds another node's journal)", config.journal_path().display())
        }
        other => other.to_string(),
    })?);
    let runner = Runner::for_config(config, journal.clone(), identity.key.clone(), node, version.to_owned())?;
    let updater = match (UpdateSettings::of(config)?, launch) {
        (Some(settings), Some(launch)) => Some(Arc::new(Updater::new(settings, version.to_owned(), launch)?)),
        _ => None,
    };
    let sandboxes = crate::sandboxes::Sandboxes::for_config(config)?.map(Arc::new);
    if let Some(sandboxes) = &sandboxes {
        // What a crash or a lost record left behind goes before any command runs.
        match sandboxes.sweep().await {
            Ok(removed) if !removed.is_empty() => tracing::warn!(count = removed.len(), "sandboxes no record names were removed"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "the sandbox sweep failed"),
        }
    }
    let agent = Arc::new(Agent { runner, instances: Instances::for_config(config)?, update: updater, sandboxes });
    let mut capabilities = agent.capabilities();
    // A console on the node: the driver attaches it (`crate::tunnel`), at the edge.
    capabilities.push(bc_core::tunnel::CAPABILITY_NODE_CONSOLE.to_owned());
    // Its instances' ports and serial consoles, when the hypervisor reaches its guests.
    if agent.instances.as_ref().is_some_and(|i| i.hypervisor.reaches_guests()) {
        capabilities.push(bc_core::tunnel::CAPABILITY_INSTANCE_DIAL.to_owned());
    }
    if !capabilities.iter().any(|c| c == crate::runner::CAPABILITY_GPU_HOLD)
        && let Some(reason) = agent.runner.binding.unprivileged()
    {
        tracing::warn!(reason = %reason, "this node cannot hold GPUs: holds fail at once");
    }
    if agent.instances.is_none() {
        tracing::info!("this node has no hypervisor: it runs no instances");
    }
    Ok((journal, agent, capabilities))
}

/// Journals this start, and fails the command of a rollback the watchdog made, before the
/// session delivers anything. The update this agent is to confirm once healthy, if any.
async fn journal_start(agent: &Agent) -> Result<Option<Pending>, String> {
    let start = match &agent.update {
        Some(updater) => Some(updater.start()?),
        None => None,
    };
    let started_ms = SystemClock.now_ms();
    let slot = start.as_ref().map(|s| s.slot.as_str()).unwrap_or("");
    let previous = start.as_ref().and_then(|s| s.previous_version.clone());
    match agent.runner.journal_agent_started(started_ms, slot, previous.as_deref()).await {
        Ok(_) => {}
        Err(JournalError::Full(n)) => tracing::warn!(unacked = n, "the journal is full: this start is not journaled"),
        Err(e) => return Err(e.to_string()),
    }
    let (Some(start), Some(updater)) = (start, &agent.update) else { return Ok(None) };
    if let Some(rollback) = &start.rollback {
        tracing::warn!(reason = %rollback.reason, "the last update was rolled back");
        if let Some(command) = &rollback.command_id {
            agent.runner.finish_update(started_ms, command, Err(rollback.reason.clone())).await.map_err(|e| e.to_string())?;
        }
        updater.rollback_reported()?;
    }
    let Some(pending) = start.pending else { return Ok(None) };
    tracing::info!(version = %pending.version, slot = pending.slot.as_str(), "this agent confirms its health once live");
    Ok(Some(pending))
}

/// The session's loop state: the machine, the current session's stream, and what its outputs
/// are carried out on.
struct Driver {
    machine: SessionMachine,
    rng: SystemRng,
    channel: tonic::transport::Channel,
    /// The current session's number: the events of a session already given up are dropped.
    generation: u64,
    outbound: Option<mpsc::Sender<bc_proto::AgentMessage>>,
    events_tx: mpsc::Sender<Event>,
    commands_tx: mpsc::Sender<bc_proto::Command>,
    journal: Arc<Journal>,
    status: Arc<Mutex<Status>>,
    agent: Arc<Agent>,
    /// The update this agent confirms once its session has been live for `healthy_after_s`.
    pending_confirmation: Option<Pending>,
    live_since_ms: Option<u64>,
    /// `[ssh]` and this node's id: the CA keys of each welcome and `SshUserCaKeys` are
    /// installed for sshd, and dropped at their trust's end.
    ssh: Option<crate::ssh_ca::SshInstaller>,
    /// What `/metrics` shows ([`crate::metrics`]), fed here.
    metrics: Arc<crate::metrics::Metrics>,
    /// The node certificate and its renewal, at the edge: the machine never sees either.
    renewal: Renewal,
    /// Set by the channel when the gateway's TLS layer refused the certificate as revoked.
    revoked_alert: Arc<std::sync::atomic::AtomicBool>,
}

/// The node certificate this agent presents, and when to ask for the next.
struct Renewal {
    data_dir: PathBuf,
    certificates: Arc<crate::node_cert::NodeCertificates>,
    /// None: the node has no certificate (it joined a gateway without a node CA).
    certificate: Option<crate::node_cert::NodeCertificateFile>,
    due_ms: Option<u64>,
    /// When the last renewal was asked for and not answered yet.
    asked_ms: Option<u64>,
}

impl Renewal {
    /// Whether to ask for a new certificate now (on a live session).
    fn ask(&mut self, now_ms: u64) -> bool {
        let due = self.due_ms.is_some_and(|due| now_ms >= due);
        let waiting = self.asked_ms.is_some_and(|asked| now_ms < asked + crate::node_cert::RENEW_RETRY_MS);
        if due && !waiting {
            self.asked_ms = Some(now_ms);
            return true;
        }
        false
    }

    /// A certificate the gateway issued on the session: stored, then presented from the next
    /// handshake on.
    fn received(&mut self, issued: bc_proto::NodeCertificate, now_ms: u64) {
        let Some(current) = &self.certificate else { return };
        let ca = match current.ca_certificate_der() {
            Ok(ca) => ca,
            Err(e) => return tracing::error!(error = %e, "the stored node CA certificate does not parse"),
        };
        let file = crate::node_cert::NodeCertificateFile::new(&issued.certificate, &ca, now_ms, issued.not_after_ms);
        if let Err(e) = file.store(&self.data_dir).and_then(|()| self.certificates.set(&file)) {
            return tracing::error!(error = %e, "the renewed node certificate could not be kept; asking again later");
        }
        tracing::info!(not_after = %bc_core::clock::rfc3339_ms(issued.not_after_ms), "renewed the node certificate");
        self.due_ms = Some(crate::node_cert::renewal_due_ms(now_ms, issued.not_after_ms, None));
        self.asked_ms = None;
        self.certificate = Some(file);
    }
}

/// `BCD_RENEW_AFTER` (fakehw builds only, for end-to-end tests): renew the node certificate this
/// soon after start.
fn renew_after_ms() -> Result<Option<u64>, String> {
    if !crate::FAKE_MACHINES {
        return Ok(None);
    }
    match std::env::var("BCD_RENEW_AFTER") {
        Err(_) => Ok(None),
        Ok(text) => humantime::parse_duration(&text)
            .map(|d| Some(d.as_millis() as u64))
            .map_err(|e| format!("BCD_RENEW_AFTER {text:?}: {e}")),
    }
}

impl Driver {
    /// The machine's input for an event of the driver's tasks; none for an event of a session
    /// already given up, or one only the status shows.
    fn input(&mut self, event: Event) -> Option<Input> {
        match event {
            Event::Connected(g, sender) if g == self.generation => {
                self.outbound = Some(sender);
                Some(Input::Connected)
            }
            Event::Message(g, msg) if g == self.generation => {
                if let Some(ssh) = &mut self.ssh {
                    ssh.received(&msg, SystemClock.now_ms());
                }
                if matches!(msg, bc_proto::gateway_message::Msg::HeartbeatAck(_)) {
                    self.metrics.heartbeat_acked();
                }
                // The trusted CA keys are the edge's alone; the machine never sees them.
                if matches!(msg, bc_proto::gateway_message::Msg::SshUserCaKeys(_)) {
                    return None;
                }
                if let bc_proto::gateway_message::Msg::NodeCertificate(issued) = msg {
                    self.renewal.received(issued, SystemClock.now_ms());
                    return None;
                }
                Some(Input::Received(msg))
            }
            Event::Broken(g, reason) if g == self.generation => {
                self.outbound = None;
                tracing::info!(reason = %reason, "the session to the gateway ended");
                self.status.lock().expect("status lock").last_error = Some(reason.clone());
                Some(Input::Disconnected { reason })
            }
            Event::Journaled(seq, hash) => {
                self.metrics.journal_full(false);
                let mut s = self.status.lock().expect("status lock");
                s.journal_full = false;
                Some(Input::Journaled { seq, hash })
            }
            Event::JournalFull(message) => {
                tracing::error!(error = %message, "the journal is full");
                self.metrics.journal_full(true);
                let mut s = self.status.lock().expect("status lock");
                s.journal_full = true;
                s.last_error = Some(message);
                None
            }
            _ => None,
        }
    }

    /// Feeds the machine one input and carries out its outputs, in order; the message of a
    /// fatal one.
    async fn step(&mut self, input: Input) -> Result<(), String> {
        if let (Input::Tick, Some(ssh)) = (&input, &mut self.ssh) {
            ssh.tick(SystemClock.now_ms());
        }
        if matches!(input, Input::Tick) && matches!(self.machine.phase(), Phase::Live) && self.renewal.ask(SystemClock.now_ms()) {
            tracing::info!("asking for a new node certificate");
            send(&self.outbound, agent_message::Msg::RenewCertificate(bc_proto::RenewCertificate {})).await;
        }
        let outputs = self.machine.step(SystemClock.now_ms(), &mut self.rng, input);
        let mut overflowed = false;
        for output in outputs {
            match output {
                Output::Connect => {
                    self.generation += 1;
                    let guests: Arc<dyn crate::tunnel::Guests> = self.agent.clone();
                    let revoked = self.revoked_alert.clone();
                    tokio::spawn(connect(self.channel.clone(), self.generation, self.events_tx.clone(), guests, revoked));
                }
                Output::Send(msg) => {
                    if matches!(msg, agent_message::Msg::Heartbeat(_)) {
                        self.metrics.heartbeat_sent();
                    }
                    send(&self.outbound, msg).await
                }
                Output::SendEntries { from, to } => {
                    if let Err(e) = send_entries(&self.journal, &self.outbound, from, to).await {
                        tracing::error!(error = %e, "reading the journal failed");
                    }
                }
                Output::Acknowledged { seq } => {
                    if let Err(e) = self.journal.ack(seq).await {
                        tracing::error!(error = %e, "marking entries acknowledged failed");
                    }
                }
                Output::Run(command) => {
                    // Dropping one command and running the next would run them out of order
                    // (a release before its hold): the session ends instead, and the next one
                    // delivers every unfinished command again, in issue order.
                    if !overflowed && self.commands_tx.try_send(command).is_err() {
                        tracing::warn!("the command queue is full; the session ends so commands come again in order");
                        overflowed = true;
                        self.outbound = None;
                        self.generation += 1;
                    }
                }
                Output::Close { reason } => {
                    tracing::info!(reason = %reason, "closing the session");
                    self.outbound = None;
                    self.generation += 1;
                }
                Output::Fatal(message) => return Err(message),
            }
        }
        if overflowed {
            self.machine.step(
                SystemClock.now_ms(),
                &mut self.rng,
                Input::Disconnected { reason: "the command queue is full".into() },
            );
        }
        Ok(())
    }

    /// A new agent confirms its health once its session has been live (Welcome received) for
    /// `healthy_after_s`; then the update's command succeeds.
    async fn confirm_when_healthy(&mut self) {
        let now_ms = SystemClock.now_ms();
        self.live_since_ms = if matches!(self.machine.phase(), Phase::Live) { self.live_since_ms.or(Some(now_ms)) } else { None };
        let (Some(pending), Some(since), Some(updater)) = (&self.pending_confirmation, self.live_since_ms, &self.agent.update)
        else {
            return;
        };
        if now_ms < since + updater.settings.healthy_after_s * 1000 {
            return;
        }
        match updater.confirm(pending) {
            Ok(true) => {
                if let Some(command) = &pending.command_id {
                    let result = serde_json::json!({ "version": pending.version, "slot": pending.slot.as_str() });
                    let finished = self.agent.runner.finish_update(now_ms, command, Ok(result)).await;
                    journaled(&self.events_tx, finished, "an update's success").await;
                }
            }
            Ok(false) => tracing::warn!("the watchdog took the update first: it rolls back"),
            Err(e) => tracing::error!(error = %e, "confirming the update failed"),
        }
        self.pending_confirmation = None;
    }

    /// What `bcd status` shows of the session and the journal.
    fn show_status(&self) {
        let machine = &self.machine;
        let mut s = self.status.lock().expect("status lock");
        let state = match machine.phase() {
            Phase::Idle { .. } => "idle",
            Phase::Connecting => "connecting",
            Phase::AwaitChallenge | Phase::AwaitWelcome => "handshake",
            Phase::Live => "live",
        };
        self.metrics.session(state, machine.sessions, machine.head(), machine.acked());
        s.session = state.into();
        s.sessions = machine.sessions;
        s.journal_head = machine.head();
        s.journal_acked = machine.acked();
        s.journal_unacked = machine.head().saturating_sub(machine.acked());
    }
}

/// Runs the updates asked for by hand (`bcd update`), one at a time; the re-exec is asked for
/// once the answer is written.
async fn updates_by_hand(updater: Arc<Updater>, mut requests: mpsc::Receiver<crate::status::UpdateRequest>) {
    while let Some(request) = requests.recv().await {
        match updater.by_hand(&request.args, SystemClock.now_ms()).await {
            Ok((message, binary)) => {
                let _ = request.reply.send(Ok(message));
                if let Some(binary) = binary {
                    let _ = tokio::time::timeout(Duration::from_secs(3), request.written).await;
                    updater.request_reexec(binary);
                }
            }
            Err(reason) => {
                tracing::warn!(reason = %reason, "an update by hand was refused");
                let _ = request.reply.send(Err(reason));
            }
        }
    }
}

/// The status `bcd status` starts from.
fn status_of(identity: &Identity, config: &Config, version: &str) -> Arc<Mutex<Status>> {
    Arc::new(Mutex::new(Status {
        node_id: identity.identity.node_id.clone(),
        tenant_id: identity.identity.tenant_id.clone(),
        pool_id: identity.identity.pool_id.clone(),
        agent_version: version.to_owned(),
        gateway: config.gateway.clone(),
        ..Default::default()
    }))
}

/// The binary an update asks this process to become; never, without an update path.
async fn reexec_wanted(wanted: &mut Option<tokio::sync::watch::Receiver<Option<PathBuf>>>) -> PathBuf {
    let Some(receiver) = wanted else { return std::future::pending().await };
    loop {
        if let Some(path) = receiver.borrow_and_update().clone() {
            return path;
        }
        if receiver.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
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

async fn connect(
    channel: tonic::transport::Channel,
    generation: u64,
    events: mpsc::Sender<Event>,
    guests: Arc<dyn crate::tunnel::Guests>,
    revoked: Arc<std::sync::atomic::AtomicBool>,
) {
    let (sender, receiver) = mpsc::channel(OUTBOUND_MESSAGES);
    let mut client = AgentClient::new(channel.clone())
        .max_decoding_message_size(bc_proto::MESSAGE_BYTES_MAX)
        .max_encoding_message_size(bc_proto::MESSAGE_BYTES_MAX);
    let mut inbound = match client.session(ReceiverStream::new(receiver)).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let _ = events.send(broken(generation, &status, &revoked)).await;
            return;
        }
    };
    if events.send(Event::Connected(generation, sender)).await.is_err() {
        return;
    }
    loop {
        let event = match inbound.message().await {
            // A tunnel is IO at the edge, beside the session: its own call on this connection.
            Ok(Some(bc_proto::GatewayMessage { msg: Some(gateway_message::Msg::OpenTunnel(open)) })) => {
                tokio::spawn(crate::tunnel::attach(channel.clone(), open, guests.clone()));
                continue;
            }
            Ok(Some(bc_proto::GatewayMessage { msg: Some(msg) })) => Event::Message(generation, msg),
            Ok(Some(_)) => continue,
            Ok(None) => Event::Broken(generation, "the gateway closed the stream".into()),
            Err(status) => broken(generation, &status, &revoked),
        };
        let broken = matches!(event, Event::Broken(..) | Event::Revoked(..));
        if events.send(event).await.is_err() || broken {
            return;
        }
    }
}

/// A session's end: a revocation, or a break the machine reconnects after.
fn broken(generation: u64, status: &tonic::Status, revoked_alert: &std::sync::atomic::AtomicBool) -> Event {
    if crate::node_cert::is_revoked(status) || revoked_alert.load(std::sync::atomic::Ordering::SeqCst) {
        return Event::Revoked(generation);
    }
    Event::Broken(generation, crate::node_cert::describe(status))
}

async fn run_commands(
    agent: Arc<Agent>,
    mut commands: mpsc::Receiver<bc_proto::Command>,
    events: mpsc::Sender<Event>,
    metrics: Arc<crate::metrics::Metrics>,
) {
    while let Some(command) = commands.recv().await {
        let ran = agent.run(&command, SystemClock.now_ms()).await;
        if let Ok(entries) = &ran {
            metrics.command(&command.kind, command_outcome(entries));
            count_holds(&agent, &metrics).await;
        }
        match ran {
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

/// How a command's run ended, from the last entry it journaled (its finish): failed when that
/// entry says so (`command.failed`, `gpu.hold_failed`, `instance.apply_failed`), succeeded for
/// another finish (`command.succeeded`, `gpu.held`, `instance.observed`, …); none when it
/// finished nothing this time (a redelivery of a finished command, an update to confirm).
fn command_outcome(entries: &[bc_core::agent::SignedEntry]) -> Option<bool> {
    let last = bc_core::agent::EntryBody::decode(&entries.last()?.body).ok()?;
    match last.entry_type.as_str() {
        "command.started" => None,
        t => Some(!t.ends_with("failed")),
    }
}

/// The holds' ledger's reservations and GPUs, for `/metrics`.
async fn count_holds(agent: &Agent, metrics: &crate::metrics::Metrics) {
    let ledger = agent.runner.ledger.lock().await;
    metrics.holds(ledger.holds.len(), ledger.holds.values().map(|h| h.gpus.len()).sum());
}

/// Journals what the machine holds at start and whenever it changes (looked at every
/// `INVENTORY_CHECK_MS`), and an observation every `interval_ms`; each tick it retries the
/// releases the machine refused and journals each instance whose state changed.
async fn observe(
    agent: Arc<Agent>,
    inventory: Arc<dyn crate::inventory::InventorySource>,
    interval_ms: u64,
    events: mpsc::Sender<Event>,
    metrics: Arc<crate::metrics::Metrics>,
) {
    let mut ticker = tokio::time::interval(Duration::from_millis(interval_ms));
    let mut reported: Option<crate::inventory::Inventory> = None;
    let mut next_inventory_ms = 0u64;
    loop {
        ticker.tick().await;
        let now_ms = SystemClock.now_ms();
        journaled(&events, agent.retry_releases(now_ms).await, "a retried release").await;
        count_holds(&agent, &metrics).await;
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
