//! A destructive batch of 10,000 leaves against the same 10,000 commands issued one by one, in
//! one run, through a release `dev` and the CLI (`docs/batches.md`, figures in
//! `docs/benchmarks.md`).
//!
//! `bcd sim --nodes N` (the release `bcd` of a `fakehw` build, which `make bench` builds first)
//! joins N agents; the batch's leaves are `ping`s spread over the first half of them, the
//! baseline's `commands.issue` calls over the other half (a node's queue holds at most 256
//! unfinished commands, and each half gets 10,000 / (N / 2) of them). Measured, each as wall time:
//!
//! - **batch**: `batch create` (the scope in one call), `batch show --scope-out` (pages the whole
//!   scope, 256 leaves a page, and recomputes the root), `batch approve --yes` by two keys of a
//!   quorum of 2 (each pages and recomputes again), then the release: until every command of the
//!   batch is issued (`batch members` shows none `releasing`);
//! - **one by one**: 10,000 `commands.issue` calls over HTTP, `BC_BENCH_CONCURRENCY` at a time
//!   (default 8), as a script of the API would.
//!
//! It prints both and their ratio (one by one / batch: above 1, the batch is faster), and the
//! batch's steps. `BC_BENCH_LEAVES` (default 10,000) and `BC_BENCH_AGENTS` (default 100) change
//! the sizes.

use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agents::{Killed, bcd, start_gateway};
use serde_json::{Value, json};

use crate::support::agents;

const LEAVES_DEFAULT: usize = 10_000;
const AGENTS_DEFAULT: u32 = 100;
const CONCURRENCY_DEFAULT: usize = 8;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn call(http: &reqwest::Client, url: &str, token: &str, method: &str, body: Value) -> (u16, Value) {
    let response = http.post(format!("{url}/api/compute/{method}")).bearer_auth(token).json(&body).send().await.expect(method);
    (response.status().as_u16(), response.json().await.unwrap_or(Value::Null))
}

/// `better-compute ARGS` against the bench's dev: its standard output as JSON.
fn cli(url: &str, token: &str, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(args)
        .env("BETTER_COMPUTE_URL", url)
        .env("BETTER_COMPUTE_TOKEN", token)
        .env("BETTER_COMPUTE_CREDENTIALS", "/nonexistent/bench/credentials.json")
        .output()
        .unwrap();
    assert!(out.status.success(), "better-compute {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// The pool's nodes that are ready, all pages.
async fn ready_nodes(http: &reqwest::Client, url: &str, token: &str, pool: &str) -> Vec<String> {
    let mut ready = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "poolId": pool, "limit": 500 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let (status, page) = call(http, url, token, "nodes.list", body).await;
        assert_eq!(status, 200, "{page}");
        for node in page["items"].as_array().unwrap() {
            if node["state"] == "ready" {
                ready.push(node["nodeId"].as_str().unwrap().to_owned());
            }
        }
        match page["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return ready,
        }
    }
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let leaves: usize = env_or("BC_BENCH_LEAVES", LEAVES_DEFAULT);
    let agents: u32 = env_or("BC_BENCH_AGENTS", AGENTS_DEFAULT);
    let concurrency: usize = env_or("BC_BENCH_CONCURRENCY", CONCURRENCY_DEFAULT);
    assert!(agents >= 2 && agents.is_multiple_of(2), "BC_BENCH_AGENTS is even, at least 2");
    assert!(leaves.div_ceil(agents as usize / 2) <= 256, "a node's queue holds 256 commands: more agents, or fewer leaves");
    let bcd = bcd();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let agents_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let data = dir.path().join("gateway");
        let (child, url, serving_pin, log_pin) = start_gateway(&data, agents_port);
        let _gateway = Killed(child);
        let token = std::fs::read_to_string(data.join("admin.token")).unwrap().trim().to_owned();
        let http = reqwest::Client::new();
        let (_, pool) = call(&http, &url, &token, "pools.create", json!({ "name": "batch" })).await;
        let pool = pool["poolId"].as_str().unwrap().to_owned();
        let (_, join) = call(&http, &url, &token, "joinTokens.create", json!({ "poolId": pool, "uses": agents })).await;
        let secret = join["token"].as_str().unwrap().to_owned();
        let config = dir.path().join("sim.toml");
        std::fs::write(
            &config,
            format!(
                "data_dir = \"/unused\"\ngateway = \"https://127.0.0.1:{agents_port}\"\nserving_ca_spki_pin = {serving_pin:?}\nlog_key_pin = {log_pin:?}\n\n[log]\nlevel = \"warn\"\n"
            ),
        )
        .unwrap();
        eprintln!("batches: {agents} agents joining…");
        let mut sim = Command::new("sh")
            .args(["-c", "ulimit -n \"$(ulimit -Hn)\" 2>/dev/null; exec \"$0\" \"$@\""])
            .arg(&bcd)
            .args(["sim", "--nodes", &agents.to_string(), "--seed", "1"])
            .args(["--data-dir", &dir.path().join("machines").display().to_string(), "--config", &config.display().to_string()])
            .env_remove("BCD_JOIN_TOKEN")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        writeln!(sim.stdin.take().unwrap(), "{secret}").unwrap();
        let stderr = std::io::BufReader::new(sim.stderr.take().unwrap());
        std::thread::spawn(move || for _ in stderr.lines() {});
        let _sim = Killed(sim);
        let deadline = Instant::now() + Duration::from_secs(300);
        let nodes = loop {
            let ready = ready_nodes(&http, &url, &token, &pool).await;
            if ready.len() == agents as usize {
                break ready;
            }
            assert!(Instant::now() < deadline, "{} of {agents} agents ready after 300 s", ready.len());
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let (batch_nodes, single_nodes) = nodes.split_at(nodes.len() / 2);

        // The approver set: two keys, quorum 2.
        let keys = dir.path().join("keys");
        std::fs::create_dir(&keys).unwrap();
        let key = |name: &str| keys.join(format!("{name}.pem")).display().to_string();
        for name in ["a", "b"] {
            cli(&url, &token, &["batch", "keygen", "--out", &key(name)]);
        }
        let (a_pub, b_pub) = (format!("{}.pub", key("a")), format!("{}.pub", key("b")));
        cli(
            &url,
            &token,
            &[
                "batch",
                "publish-approvers",
                "--epoch",
                "1",
                "--quorum",
                "2",
                "--trust-domain",
                "bench.test",
                "--approver",
                &a_pub,
                "--approver",
                &b_pub,
            ],
        );
        let scope: Vec<Value> = (0..leaves)
            .map(|i| json!({ "subject": batch_nodes[i % batch_nodes.len()], "kind": "ping", "payload": {} }))
            .collect();
        let scope_path = dir.path().join("scope.json");
        std::fs::write(&scope_path, serde_json::to_string(&scope).unwrap()).unwrap();
        let scope_path = scope_path.display().to_string();

        // The batch: create, review (page and recompute), approve twice, release.
        eprintln!("batches: a batch of {leaves} leaves…");
        let started = Instant::now();
        let created = cli(&url, &token, &["batch", "create", "--reason", "bench: ping the fleet", "--scope", &scope_path]);
        let batch = created["batchId"].as_str().unwrap().to_owned();
        let create_s = started.elapsed().as_secs_f64();
        let reviewed_at = Instant::now();
        let out = dir.path().join("batch.scope.json").display().to_string();
        cli(&url, &token, &["batch", "show", "--batch", &batch, "--scope-out", &out]);
        let review_s = reviewed_at.elapsed().as_secs_f64();
        let approved_at = Instant::now();
        cli(&url, &token, &["batch", "approve", "--batch", &batch, "--key", &key("a"), "--yes"]);
        let first_approval_s = approved_at.elapsed().as_secs_f64();
        let released_at = Instant::now();
        let released = cli(&url, &token, &["batch", "approve", "--batch", &batch, "--key", &key("b"), "--yes"]);
        assert_eq!(released["state"], "released", "{released}");
        let approve_call_s = released_at.elapsed().as_secs_f64();
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let (status, members) = call(&http, &url, &token, "commandBatches.members", json!({ "batchId": batch })).await;
            assert_eq!(status, 200, "{members}");
            if members["items"].as_array().unwrap().iter().all(|m| m["state"] != "releasing") {
                break;
            }
            assert!(Instant::now() < deadline, "the batch's commands were not all issued in 600 s");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let release_s = released_at.elapsed().as_secs_f64();
        let batch_s = started.elapsed().as_secs_f64();

        // The same commands one by one.
        eprintln!("batches: {leaves} commands.issue calls, {concurrency} at a time…");
        let started = Instant::now();
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut workers = Vec::new();
        for _ in 0..concurrency {
            let (http, url, token, next) = (http.clone(), url.clone(), token.clone(), next.clone());
            let single_nodes = single_nodes.to_vec();
            workers.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= leaves {
                        return;
                    }
                    let node = &single_nodes[i % single_nodes.len()];
                    let body = json!({ "nodeId": node, "kind": "ping", "args": {} });
                    let (status, answer) = call(&http, &url, &token, "commands.issue", body).await;
                    assert_eq!(status, 200, "{answer}");
                }
            }));
        }
        for worker in workers {
            worker.await.unwrap();
        }
        let single_s = started.elapsed().as_secs_f64();

        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!("batches: {leaves} ping commands over {} nodes each way ({cores} cores, dev on SQLite, this machine)", agents / 2);
        println!("| step | wall time |");
        println!("|---|---|");
        println!("| batch create ({leaves} leaves, one call) | {create_s:.2} s |");
        println!("| batch show --scope-out (pages the scope, recomputes the root) | {review_s:.2} s |");
        println!("| batch approve --yes, first key (reviews again, signs) | {first_approval_s:.2} s |");
        println!("| batch approve --yes, second key: the quorum | {approve_call_s:.2} s |");
        println!("| the second approval until every command is issued | {release_s:.2} s |");
        println!("| **the batch, in all** | **{batch_s:.2} s** ({:.0} commands/s) |", leaves as f64 / batch_s);
        println!(
            "| **{leaves} commands.issue, {concurrency} at a time** | **{single_s:.2} s** ({:.0} commands/s) |",
            leaves as f64 / single_s
        );
        println!("| ratio, one by one / batch | {:.2}x |", single_s / batch_s);
    });
}
