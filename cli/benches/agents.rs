//! `make bench` (agents): the node agent's session and journal against the real gateway.
//! - Journal replay: one `bcd` driver (the real one, in process) with `REPLAY_ENTRIES` entries
//!   waiting in its journal connects to an in-process gateway on SQLite; entries per second until
//!   the log holds them all, beside the raw rate of the same appends (one at a time, as one session
//!   sends them) into the same database in the same run.
//! - Sessions: `better-compute dev` (the release binary, a child process) with `SESSIONS`
//!   sessions over real TCP and pinned TLS, each the real session machine
//!   (`bc_agent::machine`): the gateway's memory per session (goal at most 100 KiB) and the
//!   heartbeat round trip's p50/p99; then the gateway is killed and started again: reconnects per
//!   100 ms, peak over mean (goal at most 3), and the time until every agent is back (goal: within
//!   the maximum back-off, 120 s).
//! - Under attack: `better-compute dev` again with `ATTACK_AGENTS` honest
//!   agents heartbeating every `ATTACK_HEARTBEAT`; for `ATTACK_WINDOW_S` without an attack, then
//!   as long again while an unauthenticated client opens `ATTACK_STREAMS` `Session` streams on
//!   one TLS connection after another (each closed by the gateway after its refusals), round
//!   after round: the gateway's peak memory and the honest heartbeats' p99, with and without,
//!   as ratios.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bc_agent::config::{Config, load_identity};
use bc_agent::session::{Input, Output, Phase, SeededRng, SessionMachine};
use bc_core::clock::{Clock, SystemClock};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_gateway::agents::{AgentService, SessionConfig, Transport};
use bc_proto::agent_client::AgentClient;
use bc_proto::gateway_message;
use serde_json::{Value, json};
use tokio_stream::wrappers::ReceiverStream;

use crate::support::gateway;
#[path = "../../gateway/tests/h2_flood/mod.rs"]
mod h2_flood;

const REPLAY_ENTRIES: u64 = 3_000;
const SESSIONS: usize = 1_000;
/// How long heartbeats are sampled with every session live.
const HEARTBEAT_SAMPLE_S: u64 = 20;
const RECONNECT_BUCKET_MS: u64 = 100;
/// The attack: stream opens per round (each round on as many connections as the gateway makes
/// it use), the honest agents beside it, how often they heartbeat, and each window's length.
const ATTACK_STREAMS: u32 = 20_000;
const ATTACK_AGENTS: usize = 10;
const ATTACK_HEARTBEAT: &str = "500ms";
const ATTACK_LEASE: &str = "2s";
const ATTACK_WINDOW_S: u64 = 15;
/// How often the gateway's memory is read during a window.
const RSS_SAMPLE_MS: u64 = 50;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn call(http: &reqwest::Client, url: &str, token: &str, method: &str, body: Value) -> Value {
    let r = http.post(format!("{url}/api/compute/{method}")).bearer_auth(token).json(&body).send().await.unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(status.is_success(), "{method}: {v}");
    v
}

fn agent_config(dir: &Path, gateway: &str, serving_pin: Option<String>, log_key_pin: &str) -> Config {
    let text = format!(
        "data_dir = {:?}\ngateway = {gateway:?}\n{}log_key_pin = {log_key_pin:?}\n",
        dir.display().to_string(),
        serving_pin.map(|p| format!("serving_ca_spki_pin = {p:?}\n")).unwrap_or_default()
    );
    let path = dir.join("config.toml");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(&path, text).unwrap();
    Config::load(&path).unwrap()
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let (replay_rate, raw_rate, journal_write_rate) = replay().await;
        let sessions = sessions().await;
        let attack = attack().await;
        println!();
        println!("agents (SQLite, {} cores)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        println!("  journal writes (local, synchronous=FULL)      {journal_write_rate:>10.0} entries/s");
        println!("  journal replay into the log                   {replay_rate:>10.0} entries/s");
        println!("  raw appends, one at a time (same database)    {raw_rate:>10.0} appends/s");
        println!("  replay / raw                                  {:>10.2}", replay_rate / raw_rate);
        println!("  sessions over TLS                             {:>10}", SESSIONS);
        println!("  gateway memory per session                    {:>10.1} KiB   (goal ≤ 100)", sessions.per_session_kib);
        println!(
            "  heartbeat round trip p50 / p99                {:>6.2} / {:.2} ms ({} samples)",
            sessions.heartbeat_p50_ms, sessions.heartbeat_p99_ms, sessions.heartbeats
        );
        println!("  after a restart: reconnects per 100 ms peak   {:>10}", sessions.peak);
        println!("                   mean over the window         {:>10.1}", sessions.mean);
        println!("                   peak / mean                  {:>10.2}   (goal ≤ 3)", sessions.peak as f64 / sessions.mean);
        println!(
            "                   every agent back after       {:>10.1} s (goal ≤ 120; {} of {} back)",
            sessions.all_back_s, sessions.back, SESSIONS
        );
        println!(
            "  under attack: {} Session streams a round on unauthenticated TLS, {} honest agents",
            ATTACK_STREAMS, ATTACK_AGENTS
        );
        println!(
            "                   HEADERS written / opened      {:>10} / {} ({} connections, {} s)",
            attack.streams_sent, attack.streams_opened, attack.connections, ATTACK_WINDOW_S
        );
        println!(
            "                   gateway peak memory           {:>10.1} MiB, {:.1} MiB without (ratio {:.2})",
            attack.rss_peak_attack_mib,
            attack.rss_peak_quiet_mib,
            attack.rss_peak_attack_mib / attack.rss_peak_quiet_mib
        );
        println!(
            "                   honest heartbeat p99          {:>10.2} ms, {:.2} ms without (ratio {:.2}; {} / {} samples)",
            attack.heartbeat_p99_attack_ms,
            attack.heartbeat_p99_quiet_ms,
            attack.heartbeat_p99_attack_ms / attack.heartbeat_p99_quiet_ms,
            attack.heartbeats_attack,
            attack.heartbeats_quiet
        );
        println!("                   honest agents live after      {:>10} of {}", attack.live_after, ATTACK_AGENTS);
    });
}

async fn replay() -> (f64, f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let server = gateway::start(&dir.path().join("g.sqlite3"), |_| {}).await;
    let (log, key, state, url, token) = (server.log, server.key, server.state, server.url, server.token);
    let agents_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let agents = format!("http://{}", agents_listener.local_addr().unwrap());
    let service = AgentService::new(state.clone(), SessionConfig::default());
    tokio::spawn(bc_gateway::agents::serve(agents_listener, Transport::Plaintext, service, std::future::pending()));
    let http = reqwest::Client::new();
    let pool = call(&http, &url, &token, "pools.create", json!({ "name": "bench" })).await["poolId"].as_str().unwrap().to_owned();
    let secret =
        call(&http, &url, &token, "joinTokens.create", json!({ "poolId": pool })).await["token"].as_str().unwrap().to_owned();

    let machine_dir = dir.path().join("machine");
    let config = agent_config(&machine_dir, &agents, None, &key.pin());
    let joined =
        bc_agent::join::join(&config, bc_agent::token::Token { secret, source: bc_agent::token::Source::Stdin }, None, None)
            .await;
    assert!(joined.is_ok(), "the bench's join failed");
    let identity = load_identity(&config).unwrap().unwrap();
    let node: bc_core::id::NodeId = identity.identity.node_id.parse().unwrap();
    // Entries waiting: the agent was offline while it observed.
    let journal = Arc::new(bc_agent::journal::Journal::open(&config.journal_path(), node, u64::MAX).await.unwrap());
    let runner =
        bc_agent::runner::Runner::for_config(&config, journal.clone(), identity.key.clone(), node, "bench".into()).unwrap();
    let started = Instant::now();
    for _ in 0..REPLAY_ENTRIES {
        runner.observe(SystemClock.now_ms()).await.unwrap();
    }
    let journal_write_rate = REPLAY_ENTRIES as f64 / started.elapsed().as_secs_f64();
    drop(runner);
    Arc::try_unwrap(journal).ok().unwrap().close().await;

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let driver = tokio::spawn(bc_agent::driver::run(config, identity, async move {
        let _ = stopped.await;
    }));
    loop {
        let doc = call(&http, &url, &token, "nodes.get", json!({ "nodeId": node.to_string() })).await;
        if doc["agent"]["journalSeq"].as_u64().unwrap_or(0) >= REPLAY_ENTRIES {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let replay_rate = REPLAY_ENTRIES as f64 / started.elapsed().as_secs_f64();
    let _ = stop.send(());
    let _ = driver.await;

    // Baseline: the same number of single-event appends of the same size, one at a time.
    let tenant = bc_core::id::TenantId::ROOT;
    let payload = bc_core::canonical::from_json(
        &json!({ "nodeId": node.to_string(), "uptimeS": 1, "loadAvg1Milli": 1, "memAvailableKiB": 1, "pad": "x".repeat(600) }),
    )
    .unwrap();
    let started = Instant::now();
    for i in 0..REPLAY_ENTRIES {
        let mut request = AppendRequest::new(
            tenant,
            format!("bench/{node}"),
            ExpectedVersion::Any,
            "bench",
            vec![NewEvent::new("bench.raw", payload.clone())],
        );
        request.idempotency_key = Some(format!("bench:{i}"));
        log.append(request).await.unwrap();
    }
    let raw_rate = REPLAY_ENTRIES as f64 / started.elapsed().as_secs_f64();
    (replay_rate, raw_rate, journal_write_rate)
}

struct SessionFigures {
    per_session_kib: f64,
    heartbeat_p50_ms: f64,
    heartbeat_p99_ms: f64,
    heartbeats: usize,
    peak: u64,
    mean: f64,
    all_back_s: f64,
    back: usize,
}

fn rss_kib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next()).unwrap().parse().unwrap()
}

/// `better-compute dev` as a child, and what it printed: (child, http url, agents pin). Every
/// agent of the bench connects from 127.0.0.1, so the cap per peer address is lifted.
fn start_gateway(dir: &Path, agents_port: u16) -> (std::process::Child, String, String) {
    start_gateway_with(dir, agents_port, &[])
}

fn start_gateway_with(dir: &Path, agents_port: u16, extra: &[&str]) -> (std::process::Child, String, String) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["dev", "--data-dir", &dir.display().to_string(), "--listen", "127.0.0.1:0"])
        .args(["--agents-listen", &format!("127.0.0.1:{agents_port}")])
        .args(["--agents-connections-per-peer-max", "65536"])
        .args(extra)
        .env("BETTER_COMPUTE_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut url = String::new();
    let mut pin = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(u) = line.strip_prefix("better-compute listening on ") {
            url = u.trim().to_owned();
        }
        if line.trim_start().starts_with("agents:") {
            pin = line.split("pin ").nth(1).map(|p| p.trim_end_matches(')').trim().to_owned()).unwrap_or_default();
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    assert!(!url.is_empty() && !pin.is_empty(), "the gateway did not print its addresses");
    (child, url, pin)
}

#[derive(Default)]
struct Shared {
    heartbeats_ms: Vec<f64>,
    /// When each session became live, after `since`.
    lives: Vec<Instant>,
}

/// One agent: the real session machine over a real channel; no journal.
async fn agent(
    gateway: bc_agent::client::Gateway,
    node: bc_core::id::NodeId,
    key: ed25519_dalek::SigningKey,
    seed: u64,
    shared: Arc<Mutex<Shared>>,
) {
    let mut machine = SessionMachine::new(node, key, vec![], "bench".into(), (0, bc_core::agent::GENESIS_HASH), 0);
    let mut rng = SeededRng(seed);
    let channel = gateway.channel().unwrap();
    let mut outbound: Option<tokio::sync::mpsc::Sender<bc_proto::AgentMessage>> = None;
    let mut inbound: Option<tonic::Streaming<bc_proto::GatewayMessage>> = None;
    let mut heartbeat_sent: Option<Instant> = None;
    let mut input = Input::Tick;
    let mut ticker = tokio::time::interval(Duration::from_millis(100));
    loop {
        let was_live = *machine.phase() == Phase::Live;
        let outputs = machine.step(SystemClock.now_ms(), &mut rng, input);
        if !was_live && *machine.phase() == Phase::Live {
            shared.lock().unwrap().lives.push(Instant::now());
        }
        let mut next: Option<Input> = None;
        for output in outputs {
            match output {
                Output::Connect => {
                    let (tx, rx) = tokio::sync::mpsc::channel(16);
                    match AgentClient::new(channel.clone()).session(ReceiverStream::new(rx)).await {
                        Ok(response) => {
                            outbound = Some(tx);
                            inbound = Some(response.into_inner());
                            next = Some(Input::Connected);
                        }
                        Err(status) => next = Some(Input::Disconnected { reason: status.message().to_owned() }),
                    }
                }
                Output::Send(msg) => {
                    if matches!(msg, bc_proto::agent_message::Msg::Heartbeat(_)) {
                        heartbeat_sent = Some(Instant::now());
                    }
                    if let Some(tx) = &outbound {
                        let _ = tx.send(bc_proto::AgentMessage { msg: Some(msg) }).await;
                    }
                }
                Output::Close { .. } => {
                    outbound = None;
                    inbound = None;
                }
                Output::Fatal(message) => panic!("{message}"),
                Output::SendEntries { .. } | Output::Acknowledged { .. } | Output::Run(_) => {}
            }
        }
        if let Some(n) = next {
            input = n;
            continue;
        }
        input = tokio::select! {
            _ = ticker.tick() => Input::Tick,
            msg = async { match inbound.as_mut() { Some(s) => s.message().await, None => std::future::pending().await } } => match msg {
                Ok(Some(bc_proto::GatewayMessage { msg: Some(msg) })) => {
                    if matches!(msg, gateway_message::Msg::HeartbeatAck(_)) && let Some(sent) = heartbeat_sent.take() {
                        shared.lock().unwrap().heartbeats_ms.push(sent.elapsed().as_secs_f64() * 1000.0);
                    }
                    Input::Received(msg)
                }
                Ok(_) => { outbound = None; inbound = None; Input::Disconnected { reason: "closed".into() } }
                Err(status) => { outbound = None; inbound = None; Input::Disconnected { reason: status.message().to_owned() } }
            },
        };
    }
}

async fn sessions() -> SessionFigures {
    let dir = tempfile::tempdir().unwrap();
    let agents_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (mut child, url, serving_pin) = start_gateway(dir.path(), agents_port);
    let token = std::fs::read_to_string(dir.path().join("admin.token")).unwrap().trim().to_owned();
    let http = reqwest::Client::new();
    let pool = call(&http, &url, &token, "pools.create", json!({ "name": "bench" })).await["poolId"].as_str().unwrap().to_owned();
    let secret = call(&http, &url, &token, "joinTokens.create", json!({ "poolId": pool, "uses": SESSIONS })).await["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let gateway = bc_agent::client::Gateway::parse(&format!("https://127.0.0.1:{agents_port}"), Some(&serving_pin)).unwrap();
    eprintln!("joining {SESSIONS} nodes…");
    let nodes = join_nodes(&gateway, &secret, SESSIONS, 0, "bench").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before_kib = rss_kib(child.id());
    let shared = Arc::new(Mutex::new(Shared::default()));
    eprintln!("opening {SESSIONS} sessions…");
    for (i, (node, key)) in nodes.into_iter().enumerate() {
        tokio::spawn(agent(gateway.clone(), node, key, 1000 + i as u64, shared.clone()));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while shared.lock().unwrap().lives.len() < SESSIONS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shared.lock().unwrap().heartbeats_ms.clear();
    tokio::time::sleep(Duration::from_secs(HEARTBEAT_SAMPLE_S)).await;
    let after_kib = rss_kib(child.id());
    let mut heartbeats = std::mem::take(&mut shared.lock().unwrap().heartbeats_ms);
    heartbeats.sort_by(|a, b| a.partial_cmp(b).unwrap());

    // The restart: kill the gateway, start it again where the agents look.
    eprintln!("restarting the gateway…");
    let _ = child.kill();
    let _ = child.wait();
    let killed = Instant::now();
    shared.lock().unwrap().lives.clear();
    let (mut child, _, pin_again) = start_gateway(dir.path(), agents_port);
    assert_eq!(pin_again, serving_pin, "the serving certificate is kept across restarts");
    let deadline = Instant::now() + Duration::from_secs(180);
    while shared.lock().unwrap().lives.len() < SESSIONS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let lives = shared.lock().unwrap().lives.clone();
    let _ = child.kill();
    let _ = child.wait();
    let first = lives.iter().min().copied().unwrap_or(killed);
    let last = lives.iter().max().copied().unwrap_or(killed);
    let buckets = ((last - first).as_millis() as u64 / RECONNECT_BUCKET_MS + 1) as usize;
    let mut counts = vec![0u64; buckets];
    for at in &lives {
        counts[((*at - first).as_millis() as u64 / RECONNECT_BUCKET_MS) as usize] += 1;
    }
    SessionFigures {
        per_session_kib: (after_kib - before_kib) / SESSIONS as f64,
        heartbeat_p50_ms: percentile(&heartbeats, 0.5),
        heartbeat_p99_ms: percentile(&heartbeats, 0.99),
        heartbeats: heartbeats.len(),
        peak: counts.iter().copied().max().unwrap_or(0),
        mean: lives.len() as f64 / buckets as f64,
        all_back_s: (last - killed).as_secs_f64(),
        back: lives.len(),
    }
}

struct AttackFigures {
    streams_sent: u64,
    streams_opened: u64,
    connections: u64,
    rss_peak_quiet_mib: f64,
    rss_peak_attack_mib: f64,
    heartbeat_p99_quiet_ms: f64,
    heartbeat_p99_attack_ms: f64,
    heartbeats_quiet: usize,
    heartbeats_attack: usize,
    live_after: usize,
}

/// The gateway's peak memory over `window`, read every `RSS_SAMPLE_MS`.
async fn rss_peak_mib(pid: u32, window: Duration) -> f64 {
    let end = Instant::now() + window;
    let mut peak: f64 = 0.0;
    while Instant::now() < end {
        peak = peak.max(rss_kib(pid));
        tokio::time::sleep(Duration::from_millis(RSS_SAMPLE_MS)).await;
    }
    peak / 1024.0
}

async fn attack() -> AttackFigures {
    let dir = tempfile::tempdir().unwrap();
    let agents_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let lease = ["--node-heartbeat", ATTACK_HEARTBEAT, "--node-lease", ATTACK_LEASE];
    let (mut child, url, serving_pin) = start_gateway_with(dir.path(), agents_port, &lease);
    let token = std::fs::read_to_string(dir.path().join("admin.token")).unwrap().trim().to_owned();
    let http = reqwest::Client::new();
    let pool = call(&http, &url, &token, "pools.create", json!({ "name": "bench" })).await["poolId"].as_str().unwrap().to_owned();
    let secret = call(&http, &url, &token, "joinTokens.create", json!({ "poolId": pool, "uses": ATTACK_AGENTS })).await["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let gateway = bc_agent::client::Gateway::parse(&format!("https://127.0.0.1:{agents_port}"), Some(&serving_pin)).unwrap();
    let shared = Arc::new(Mutex::new(Shared::default()));
    for (i, (node, key)) in join_nodes(&gateway, &secret, ATTACK_AGENTS, 7, "honest").await.into_iter().enumerate() {
        tokio::spawn(agent(gateway.clone(), node, key, 5000 + i as u64, shared.clone()));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while shared.lock().unwrap().lives.len() < ATTACK_AGENTS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;

    let window = Duration::from_secs(ATTACK_WINDOW_S);
    shared.lock().unwrap().heartbeats_ms.clear();
    let rss_peak_quiet_mib = rss_peak_mib(child.id(), window).await;
    let mut quiet = std::mem::take(&mut shared.lock().unwrap().heartbeats_ms);

    eprintln!("attacking the agents' endpoint for {ATTACK_WINDOW_S} s…");
    let addr: std::net::SocketAddr = format!("127.0.0.1:{agents_port}").parse().unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let attacker = tokio::spawn(async move {
        let (mut sent, mut opened, mut connections) = (0u64, 0u64, 0u64);
        while !*stopped.borrow() {
            // One round: ATTACK_STREAMS stream opens, on a new connection whenever the gateway
            // closes the last.
            let mut left = ATTACK_STREAMS;
            while left > 0 && !*stopped.borrow() {
                let Ok(tls) = h2_flood::tls_connect(addr).await else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                };
                connections += 1;
                let path = "/bettercompute.agent.v1.Agent/Session";
                let report = h2_flood::flood(tls, left, path, true, Duration::from_secs(2)).await;
                sent += u64::from(report.sent);
                opened += report.accepted.len() as u64;
                left -= report.sent.max(1).min(left);
            }
        }
        (sent, opened, connections)
    });
    let rss_peak_attack_mib = rss_peak_mib(child.id(), window).await;
    let _ = stop.send(true);
    let mut attacked = std::mem::take(&mut shared.lock().unwrap().heartbeats_ms);
    let (streams_sent, streams_opened, connections) = attacker.await.unwrap();
    // Whether every honest agent is live after: a beat within the last lease.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let live_after = {
        let doc = call(&http, &url, &token, "nodes.list", json!({ "poolId": pool })).await;
        doc["items"].as_array().map(|items| items.iter().filter(|n| n["state"] == json!("ready")).count()).unwrap_or(0)
    };
    let _ = child.kill();
    let _ = child.wait();
    quiet.sort_by(|a, b| a.partial_cmp(b).unwrap());
    attacked.sort_by(|a, b| a.partial_cmp(b).unwrap());
    AttackFigures {
        streams_sent,
        streams_opened,
        connections,
        rss_peak_quiet_mib,
        rss_peak_attack_mib,
        heartbeat_p99_quiet_ms: percentile(&quiet, 0.99),
        heartbeat_p99_attack_ms: percentile(&attacked, 0.99),
        heartbeats_quiet: quiet.len(),
        heartbeats_attack: attacked.len(),
        live_after,
    }
}

/// Joins `count` machines with `secret` over one channel, each with a key of its own (its seed's
/// first 8 bytes its number, the rest `seed_fill`) and host name `PREFIX-N`: their node ids and keys.
async fn join_nodes(
    gateway: &bc_agent::client::Gateway,
    secret: &str,
    count: usize,
    seed_fill: u8,
    hostname_prefix: &str,
) -> Vec<(bc_core::id::NodeId, ed25519_dalek::SigningKey)> {
    let join_channel = gateway.channel().unwrap();
    let mut nodes = Vec::with_capacity(count);
    for i in 0..count {
        let key = ed25519_dalek::SigningKey::from_bytes(&{
            let mut seed = [seed_fill; 32];
            seed[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
            seed
        });
        let response = AgentClient::new(join_channel.clone())
            .join(bc_proto::JoinRequest {
                token: secret.to_owned(),
                node_public_key: key.verifying_key().as_bytes().to_vec(),
                hardware: Some(bc_proto::HardwareClaims { hostname: format!("{hostname_prefix}-{i}"), gpus: vec![] }),
                agent_version: "bench".into(),
                node_id: String::new(),
                sealed_token: None,
            })
            .await
            .unwrap()
            .into_inner();
        let identity: bc_core::agent::NodeIdentity = serde_json::from_slice(&response.identity).unwrap();
        nodes.push((identity.node_id.parse::<bc_core::id::NodeId>().unwrap(), key));
    }
    nodes
}
