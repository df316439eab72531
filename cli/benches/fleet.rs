//! `make bench` (fleet): a thousand real agents on one gateway. `better-compute dev`
//! (the release binary, SQLite, reconcilers in process) runs as a child process, and so does
//! `bcd sim --nodes N` (the release `bcd` of a `fakehw` build, which `make bench` builds first):
//! N real agents, each its own identity, journal and session over TLS, on seeded fake machines,
//! joining with one token of N uses. It measures:
//! - the time until every node is `ready` (sessions live; `nodes.list`, paged), and joins per
//!   second until the sim's last join;
//! - the gateway's memory from `/proc/PID/status` of the child: `VmRSS` before any agent, the peak
//!   (`VmHWM`) and the steady `VmRSS` with N agents after `STEADY_S`, and the growth per agent;
//!   beside it the sim's own `VmRSS` (every agent, one process);
//! - reserve → `bound`: `BC_BENCH_RESERVES` reservations of one GPU, one at a time, on the agents'
//!   pool; each is `active` with its binding `pending` when the create returns, and turns `bound`
//!   when its agent has answered the `gpu.hold`: timed from the create's return (and from its
//!   start) to `reservations.get` showing `bound` (polled every `POLL_BOUND_MS`, which bounds the
//!   error), then released. The baseline, in the same run with the same N agents connected: the
//!   same reservations on a pool of N nodes registered by hand (`nodes.register`), which bind at
//!   once, so the create's round trip is its whole reserve → bound. The ratio is what a real hold
//!   on an agent costs over a placement alone.
//!
//! `BC_BENCH_AGENTS` (default 1,000, at most one join token's uses) and `BC_BENCH_RESERVES`
//! (default 200) change the sizes. The sim needs about six open files per agent: the bench
//! starts it with the soft limit raised to the hard one (the sim refuses a lower one, with a hint).

use crate::support::agents;

use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agents::{Killed, bcd, start_gateway};
use serde_json::{Value, json};

const AGENTS_DEFAULT: u32 = 1_000;
const RESERVES_DEFAULT: usize = 200;
/// The first fake machine's seed (machine `i` is `SIM_SEED + i`).
const SIM_SEED: u64 = 1;
/// How long every node may take to be `ready`.
const READY_DEADLINE_S: u64 = 900;
const POLL_READY_MS: u64 = 250;
/// A reservation's binding is read this often while it is `pending`.
const POLL_BOUND_MS: u64 = 2;
/// How long one binding may stay `pending`.
const BOUND_DEADLINE_S: u64 = 30;
/// With every agent ready, the memory is read after this long: three heartbeats (5 s) and more.
const STEADY_S: u64 = 20;
/// How long `bcd sim` may take to stop on SIGTERM.
const STOP_DEADLINE_S: u64 = 30;
/// GPUs of each hand-registered node of the baseline: about the fake machines' mean (0, 2, 4 or 8).
const BASELINE_GPUS_PER_NODE: usize = 4;
/// Rows per `nodes.list` page (the API's largest).
const PAGE: u32 = 500;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(text) => text.parse().unwrap_or_else(|_| panic!("{name}={text:?} is not a number")),
        Err(_) => default,
    }
}

async fn call(http: &reqwest::Client, url: &str, token: &str, method: &str, body: Value) -> Value {
    let r = http.post(format!("{url}/api/compute/{method}")).bearer_auth(token).json(&body).send().await.unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(status.is_success(), "{method}: {v}");
    v
}

/// `VmRSS` and `VmHWM` of a process, KiB.
fn memory_kib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// What the sim printed: when its last join was reported, and its last lines (for a failure).
#[derive(Default)]
struct SimLog {
    all_joined: Option<Instant>,
    tail: Vec<String>,
}

/// `bcd sim --nodes N`, the token on its standard input, its standard error read into `log`.
fn start_sim(bcd: &Path, nodes: u32, dir: &Path, config: &Path, secret: &str, log: Arc<Mutex<SimLog>>) -> Child {
    // The sim refuses too low an open-files limit; raise the soft one as far as the hard one.
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -n \"$(ulimit -Hn)\" 2>/dev/null; exec \"$0\" \"$@\""])
        .arg(bcd)
        .args(["sim", "--nodes", &nodes.to_string(), "--seed", &SIM_SEED.to_string()])
        .args(["--data-dir", &dir.display().to_string(), "--config", &config.display().to_string()])
        .env_remove("BCD_JOIN_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{secret}").unwrap();
    drop(stdin);
    let done = format!("bcd sim: joined {nodes}/{nodes}");
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let mut log = log.lock().unwrap();
            if line.contains(&done) {
                log.all_joined = Some(Instant::now());
            }
            log.tail.push(line);
            if log.tail.len() > 20 {
                log.tail.remove(0);
            }
        }
    });
    child
}

/// SIGTERM, and SIGKILL if it has not ended after `STOP_DEADLINE_S`.
fn stop(child: &mut Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let deadline = Instant::now() + Duration::from_secs(STOP_DEADLINE_S);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            eprintln!("fleet: bcd sim did not stop after {STOP_DEADLINE_S} s; killed");
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pool's nodes: (how many, how many `ready`), every page.
async fn pool_nodes(http: &reqwest::Client, url: &str, token: &str, pool: &str) -> (usize, usize) {
    let (mut all, mut ready) = (0, 0);
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "poolId": pool, "limit": PAGE });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let page = call(http, url, token, "nodes.list", body).await;
        for node in page["items"].as_array().unwrap() {
            all += 1;
            ready += usize::from(node["state"] == "ready");
        }
        match page["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return (all, ready),
        }
    }
}

/// One-GPU reservations on one pool, one at a time: latencies in ms, sorted.
#[derive(Default)]
struct Reserved {
    /// The create's round trip.
    creates: Vec<f64>,
    /// From the create's return until `bound`.
    after: Vec<f64>,
    /// From the create's start until `bound`.
    total: Vec<f64>,
    /// Creates that answered `bound` already.
    bound_at_once: usize,
    /// The reservations, in order.
    ids: Vec<String>,
}

/// `count` reservations of one GPU on `pool`, each released once bound.
async fn reserve(http: &reqwest::Client, url: &str, token: &str, pool: &str, count: usize) -> Reserved {
    let mut r = Reserved::default();
    for _ in 0..count {
        let started = Instant::now();
        let rsv = call(http, url, token, "reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 3600 })).await;
        let returned = Instant::now();
        assert_eq!(rsv["state"], "active", "the pool has room: {rsv}");
        let id = rsv["reservationId"].as_str().unwrap().to_owned();
        r.ids.push(id.clone());
        let mut binding = rsv["binding"]["state"].as_str().unwrap_or_default().to_owned();
        r.bound_at_once += usize::from(binding == "bound");
        while binding != "bound" {
            assert!(binding == "pending", "{id}: binding {binding}");
            assert!(returned.elapsed() < Duration::from_secs(BOUND_DEADLINE_S), "{id}: not bound after {BOUND_DEADLINE_S} s");
            tokio::time::sleep(Duration::from_millis(POLL_BOUND_MS)).await;
            let doc = call(http, url, token, "reservations.get", json!({ "reservationId": id })).await;
            binding = doc["binding"]["state"].as_str().unwrap_or_default().to_owned();
        }
        let bound = Instant::now();
        r.creates.push((returned - started).as_secs_f64() * 1000.0);
        r.after.push((bound - returned).as_secs_f64() * 1000.0);
        r.total.push((bound - started).as_secs_f64() * 1000.0);
        call(http, url, token, "reservations.release", json!({ "reservationId": id })).await;
    }
    for v in [&mut r.creates, &mut r.after, &mut r.total] {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    }
    r
}

/// For each of `ids`, the time from `reservation.activated` to `gpu.held` by their commit times
/// in the log (the gateway's clock, whole ms), sorted: reserve → bound without the polling.
async fn log_gaps(http: &reqwest::Client, url: &str, token: &str, ids: &[String]) -> Vec<f64> {
    let mut activated = std::collections::HashMap::new();
    let mut held = std::collections::HashMap::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "types": ["reservation.activated", "gpu.held"], "limit": PAGE });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let page = call(http, url, token, "events.list", body).await;
        for event in page["items"].as_array().unwrap() {
            let (stream, at) = (event["stream"].as_str().unwrap().to_owned(), event["at"].as_u64().unwrap());
            let into = if event["type"] == "gpu.held" { &mut held } else { &mut activated };
            into.entry(stream).or_insert(at);
        }
        match page["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let mut gaps: Vec<f64> = ids
        .iter()
        .map(|id| {
            let stream = format!("reservation/{id}");
            let (a, h) = (activated[&stream], held[&stream]);
            h.saturating_sub(a) as f64
        })
        .collect();
    gaps.sort_by(|a, b| a.partial_cmp(b).unwrap());
    gaps
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let nodes: u32 = env_or("BC_BENCH_AGENTS", AGENTS_DEFAULT);
    let reserves: usize = env_or("BC_BENCH_RESERVES", RESERVES_DEFAULT);
    assert!((1..=1000).contains(&nodes), "BC_BENCH_AGENTS is 1 to 1000 (one join token's uses at most)");
    assert!(reserves >= 1, "BC_BENCH_RESERVES is at least 1");
    let bcd = bcd();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let agents_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (gateway, url, serving_pin, log_pin) = start_gateway(&dir.path().join("gateway"), agents_port);
        let gateway = Killed(gateway);
        let token = std::fs::read_to_string(dir.path().join("gateway/admin.token")).unwrap().trim().to_owned();
        let http = reqwest::Client::new();
        let pool = call(&http, &url, &token, "pools.create", json!({ "name": "fleet" })).await["poolId"].as_str().unwrap().to_owned();
        let secret = call(&http, &url, &token, "joinTokens.create", json!({ "poolId": pool, "uses": nodes })).await["token"]
            .as_str()
            .unwrap()
            .to_owned();
        let config = dir.path().join("sim.toml");
        std::fs::write(
            &config,
            format!(
                "data_dir = \"/unused\"\ngateway = \"https://127.0.0.1:{agents_port}\"\nserving_ca_spki_pin = {serving_pin:?}\nlog_key_pin = {log_pin:?}\n\n[log]\nlevel = \"warn\"\n"
            ),
        )
        .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (before_kib, _) = memory_kib(gateway.0.id());

        eprintln!("fleet: {nodes} agents joining…");
        let log = Arc::new(Mutex::new(SimLog::default()));
        let started = Instant::now();
        let mut sim = Killed(start_sim(&bcd, nodes, &dir.path().join("machines"), &config, &secret, log.clone()));
        let ready = loop {
            if let Some(status) = sim.0.try_wait().unwrap() {
                panic!("bcd sim ended ({status}):\n{}", log.lock().unwrap().tail.join("\n"));
            }
            let (_, ready) = pool_nodes(&http, &url, &token, &pool).await;
            if ready == nodes as usize {
                break ready;
            }
            assert!(started.elapsed() < Duration::from_secs(READY_DEADLINE_S), "{ready} of {nodes} ready after {READY_DEADLINE_S} s");
            tokio::time::sleep(Duration::from_millis(POLL_READY_MS)).await;
        };
        let all_ready_s = started.elapsed().as_secs_f64();
        let all_joined_s = log.lock().unwrap().all_joined.map_or(f64::NAN, |at| (at - started).as_secs_f64());
        let (_, join_peak_kib) = memory_kib(gateway.0.id());
        eprintln!("fleet: {ready} nodes ready after {all_ready_s:.1} s; steady for {STEADY_S} s…");
        tokio::time::sleep(Duration::from_secs(STEADY_S)).await;
        let (steady_kib, _) = memory_kib(gateway.0.id());
        let (sim_kib, _) = memory_kib(sim.0.id());

        eprintln!("fleet: {reserves} reservations on the agents' pool…");
        let agents = reserve(&http, &url, &token, &pool, reserves).await;

        eprintln!("fleet: baseline, {nodes} nodes registered by hand…");
        let hand = call(&http, &url, &token, "pools.create", json!({ "name": "by-hand" })).await["poolId"].as_str().unwrap().to_owned();
        let gpus: Vec<Value> = (0..BASELINE_GPUS_PER_NODE)
            .map(|_| json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }))
            .collect();
        for i in 0..nodes {
            call(&http, &url, &token, "nodes.register", json!({ "poolId": hand, "name": format!("hand-{i}"), "gpus": gpus })).await;
        }
        let by_hand = reserve(&http, &url, &token, &hand, reserves).await;
        let (_, peak_kib) = memory_kib(gateway.0.id());
        let in_log = log_gaps(&http, &url, &token, &agents.ids).await;

        stop(&mut sim.0);
        drop(gateway);

        let ms = |v: &[f64]| format!("{:.1} / {:.1}", percentile(v, 0.5), percentile(v, 0.99));
        println!();
        println!(
            "fleet: {nodes} agents from `bcd sim` on one gateway (SQLite, TLS, {} cores, both processes on this machine)",
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        );
        println!();
        println!("| measure | value |");
        println!("| --- | --- |");
        println!("| every node `ready` after | {all_ready_s:.1} s |");
        println!("| the sim's last join after | {all_joined_s:.1} s ({:.1} joins/s) |", nodes as f64 / all_joined_s);
        println!("| gateway RSS before any agent | {:.1} MiB |", before_kib / 1024.0);
        println!("| gateway peak RSS (VmHWM) while joining | {:.1} MiB |", join_peak_kib / 1024.0);
        println!("| gateway RSS with {nodes} agents, steady ({STEADY_S} s on) | {:.1} MiB |", steady_kib / 1024.0);
        println!("| gateway memory per agent (steady − before) / N | {:.1} KiB |", (steady_kib - before_kib) / nodes as f64);
        println!("| gateway peak RSS (VmHWM) over the whole run | {:.1} MiB |", peak_kib / 1024.0);
        println!("| `bcd sim` RSS, all agents ({nodes}) | {:.1} MiB ({:.1} KiB per agent) |", sim_kib / 1024.0, sim_kib / nodes as f64);
        println!("| agents' pool: create round trip p50 / p99 (`pending`) | {} ms |", ms(&agents.creates));
        println!("| agents' pool: create return → `bound` p50 / p99 | {} ms |", ms(&agents.after));
        println!("| agents' pool: reserve → `bound` (create start) p50 / p99 | {} ms |", ms(&agents.total));
        println!("| agents' pool: in the log, `reservation.activated` → `gpu.held` p50 / p99 | {} ms |", ms(&in_log));
        println!("| baseline, nodes by hand: reserve → `bound` (the create) p50 / p99 | {} ms |", ms(&by_hand.creates));
        println!(
            "| reserve → `bound`, agents / by hand, p50 / p99 | {:.1} / {:.1} |",
            percentile(&agents.total, 0.5) / percentile(&by_hand.creates, 0.5),
            percentile(&agents.total, 0.99) / percentile(&by_hand.creates, 0.99)
        );
        println!("| samples | {reserves} reservations each, one at a time, polled every {POLL_BOUND_MS} ms |");
        println!(
            "| creates that answered `bound` already: agents' pool / by hand | {} / {} of {reserves} |",
            agents.bound_at_once, by_hand.bound_at_once
        );
        assert_eq!(by_hand.bound_at_once, reserves, "nodes registered by hand bind at once, in the create");
    });
}
