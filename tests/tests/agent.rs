//! Nodes that join, end to end with real processes: `better-compute dev`, `join-tokens create
//! --out`, `bcd join`, `bcd node`, over gRPC with a pinned TLS certificate. The token is in no
//! log and in no process's argv; a spent token is refused; two racing joins with one token:
//! exactly one wins; the journal survives SIGKILL and a gateway outage with every entry in the
//! log exactly once (node signatures verified); commands issued while the node is away (more
//! than 64) run once each after it returns; liveness follows the lease.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use bc_tests::{AgentNode, Server, json, wait_until};
use serde_json::{Value, json};

async fn token(server: &Server, pool: &str, uses: u32) -> String {
    let (status, created) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": uses })).await;
    assert_eq!(status, 200, "{created}");
    created["token"].as_str().unwrap().to_owned()
}

/// Polls `commands.get` until the command is in `state`.
async fn wait_command(server: &Server, command: &str, state: &str, timeout: Duration) -> Value {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let (status, doc) = server.call("commands.get", json!({ "commandId": command })).await;
        assert_eq!(status, 200, "{doc}");
        if doc["state"] == state {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "command {command} not {state} after {timeout:?}: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn node_doc(server: &Server, node: &str) -> Value {
    let (status, doc) = server.call("nodes.get", json!({ "nodeId": node })).await;
    assert_eq!(status, 200, "{doc}");
    doc
}

async fn wait_state(server: &Server, node: &str, state: &str, timeout: Duration) -> Value {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let doc = node_doc(server, node).await;
        if doc["state"] == state {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "node {node} not {state} after {timeout:?}: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every event of the root tenant of these types, oldest first.
async fn events(server: &Server, types: &[&str]) -> Vec<Value> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "types": types, "limit": 500 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let (status, page) = server.call("events.list", body).await;
        assert_eq!(status, 200, "{page}");
        all.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return all,
        }
    }
}

/// Whether any process's command line holds `secret`.
fn in_some_argv(secret: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|entry| {
        std::fs::read(entry.path().join("cmdline")).is_ok_and(|bytes| String::from_utf8_lossy(&bytes).contains(secret))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_joins_with_a_token_file_on_stdin_runs_and_is_ready_and_the_token_is_nowhere() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let machine_dir = tempfile::tempdir().unwrap();
    let token_file = machine_dir.path().join("join.token");
    let (code, out, err) =
        server.cli(&["join-tokens", "create", "--pool", &pool, "--out", &token_file.display().to_string(), "--format", "json"]);
    assert_eq!(code, 0, "join-tokens create: {err}");
    let secret = std::fs::read_to_string(&token_file).unwrap().trim().to_owned();
    assert!(secret.starts_with("bcjt_") && !out.contains(&secret) && !err.contains(&secret), "the secret went to the file only");

    let mut machine = AgentNode::new(&server, port);
    let (code, out, err) = machine.join_stdin(&secret);
    assert_eq!(code, 0, "bcd join: {out} {err}");
    assert!(out.starts_with("joined as node_"), "{out}");
    let node = machine.node_id();
    use std::os::unix::fs::PermissionsExt;
    let key_mode = std::fs::metadata(machine.data().join("node.key")).unwrap().permissions().mode() & 0o777;
    assert_eq!(key_mode, 0o600);

    // Joined already: says so and reads no token.
    let (code, out, _) = machine.bcd(&["join", "--config", &machine.config()], &[], None);
    assert_eq!(code, 0);
    assert!(out.starts_with(&format!("already joined as {node}")), "{out}");

    machine.start();
    let doc = wait_state(&server, &node, "ready", Duration::from_secs(20)).await;
    assert_eq!(doc["poolId"], pool.as_str());
    assert_eq!(doc["agent"]["reachable"], true);
    let status =
        wait_until("bcd status says live", Duration::from_secs(10), || machine.status().filter(|s| s["session"] == "live"));
    assert_eq!(status["nodeId"], node.as_str());
    // This machine's inventory says whether its agent can hold GPUs, and if not, why (a machine
    // without vfio-pci, or not root, cannot: `node-unprivileged`).
    let reported = wait_until("the inventory is reported", Duration::from_secs(20), || {
        let doc = bc_tests::block_on(node_doc(&server, &node));
        doc["agent"]["inventory"].is_object().then(|| doc["agent"]["inventory"].clone())
    });
    let can_hold = reported["capabilities"].as_array().unwrap().iter().any(|c| c == "gpu.hold");
    let why = reported["holdUnavailable"].as_str().unwrap_or_default();
    assert!(can_hold != why.starts_with("node-unprivileged:"), "either it can hold or it says why not: {reported}");

    // A spent token is refused, and the refusal does not quote it.
    let other = AgentNode::new(&server, port);
    let (code, out, err) = other.bcd(&["join", "--config", &other.config()], &[("BCD_JOIN_TOKEN", &secret)], None);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("spent"), "{err}");
    assert!(!err.contains(&secret) && !out.contains(&secret));

    // The token is in no log line and no process's argv.
    assert!(!in_some_argv(&secret));
    let server_log = std::fs::read_to_string(server.data_dir.join("server.log")).unwrap();
    // The secret is the tail after `bcjt_` and the id's fixed length; it is base64url and may
    // itself hold `_`, so splitting at the last `_` could take a fragment of a character or two
    // that any log holds by chance (CI saw it).
    let secret_part = &secret["bcjt_jt_".len() + 26 + 1..];
    assert_eq!(secret_part.len(), 43, "{secret}");
    for (name, text) in [("server", server_log.as_str()), ("node", &machine.node_log()), ("join", &err)] {
        assert!(!text.contains(&secret), "the token is in the {name} log");
        assert!(!text.contains(secret_part), "the token's secret is in the {name} log");
    }
    assert_eq!(machine.stop(), 0, "bcd node stops with 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_racing_joins_with_one_token_exactly_one_wins() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("race").await;
    for _ in 0..3 {
        let secret = token(&server, &pool, 1).await;
        let machines: Vec<AgentNode> = (0..2).map(|_| AgentNode::new(&server, port)).collect();
        let codes: Vec<i32> = std::thread::scope(|s| {
            let handles: Vec<_> = machines
                .iter()
                .map(|m| {
                    let secret = secret.clone();
                    s.spawn(move || m.bcd(&["join", "--config", &m.config()], &[("BCD_JOIN_TOKEN", &secret)], None).0)
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut sorted = codes.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1], "exactly one join wins: {codes:?}");
    }
}

/// A join whose answer the machine never kept (lost with a failover, a timeout, `bcd` killed
/// after the commit) is asked again with the same node key and the spent token: the gateway
/// answers with the node it made (one node, a renewed certificate), where it used to refuse the
/// spent token and leave a node no machine could run as. Another key with that token is
/// still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_asked_again_with_the_same_key_is_answered_with_the_node_it_made() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("again").await;
    let secret = token(&server, &pool, 1).await;
    let mut machine = AgentNode::new(&server, port);
    assert_eq!(machine.join_stdin(&secret).0, 0);
    let node = machine.node_id();
    // The answer lost: everything the join kept but the node's key.
    for entry in std::fs::read_dir(machine.data()).unwrap().flatten() {
        if entry.file_name() != "node.key" {
            let path = entry.path();
            if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) }.unwrap();
        }
    }
    let (code, out, err) = machine.join_stdin(&secret);
    assert_eq!(code, 0, "the join asked again is answered: {out}{err}");
    assert_eq!(machine.node_id(), node, "as the node the first made");
    let (status, nodes) = server.call("nodes.list", json!({ "poolId": pool })).await;
    assert_eq!(status, 200, "{nodes}");
    assert_eq!(nodes["items"].as_array().unwrap().len(), 1, "one node: {nodes}");
    let issued: Vec<Value> = events(&server, &["node.certificate_issued"])
        .await
        .into_iter()
        .filter(|e| e["stream"] == format!("node/{node}"))
        .collect();
    assert_eq!(issued.len(), 2, "the join's certificate and the one answered again: {issued:?}");
    assert_eq!(issued[1]["payload"]["renewal"], true, "{issued:?}");

    let other = AgentNode::new(&server, port);
    let (code, _, err) = other.join_stdin(&secret);
    assert_eq!(code, 1, "another key with the spent token is refused: {err}");
    assert!(err.contains("spent"), "{err}");

    machine.start();
    wait_state(&server, &node, "ready", Duration::from_secs(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_survives_sigkill_and_an_outage_and_every_entry_is_in_the_log_once() {
    let (mut server, port) = bc_tests::agents_gateway();
    let pool = server.pool("journal").await;
    let secret = token(&server, &pool, 1).await;
    let mut machine = AgentNode::new(&server, port);
    assert_eq!(machine.join_stdin(&secret).0, 0);
    let node = machine.node_id();
    machine.start();
    wait_state(&server, &node, "ready", Duration::from_secs(20)).await;

    // Commands keep the journal busy; the agent is killed in the middle of them.
    let mut commands = Vec::new();
    for _ in 0..30 {
        let (status, command) = server.call("commands.issue", json!({ "nodeId": node, "kind": "ping" })).await;
        assert_eq!(status, 200, "{command}");
        commands.push(command["commandId"].as_str().unwrap().to_owned());
    }
    machine.kill9();
    machine.start();
    // The gateway goes away while the agent journals (observations every 150 ms).
    wait_until("the agent is live again", Duration::from_secs(20), || machine.status().filter(|s| s["session"] == "live"));
    server.kill9();
    // Unacknowledged entries alone do not say the session is gone (a window is in flight while
    // live); the agent must also have seen the stream break, which under load takes a moment.
    let offline = wait_until("entries wait in the journal while the gateway is down", Duration::from_secs(10), || {
        machine.status().filter(|s| s["journalUnacked"].as_u64().unwrap_or(0) >= 3 && s["session"] != "live")
    });
    assert_ne!(offline["session"], "live");
    // What the killed gateway logged ends here; what follows is the restarted one's.
    let restarted_at = server.log_text().len();
    server.restart();

    // Caught up: every command ran once, and the log holds the journal up to the agent's head.
    for command in &commands {
        let done = wait_command(&server, command, "succeeded", Duration::from_secs(30)).await;
        assert_eq!(done["result"]["pong"], true);
    }
    // What the agent sent before it stopped may still be landing. The gateway handles a
    // session's messages in order and ends the session after the last one: once every session of
    // this node the restarted gateway started has ended, nothing more of the agent's can land.
    // (Counted, not "one more ended": the agent may not have reconnected before the stop, or its
    // last session may have ended before it; the killed gateway appends nothing more.)
    let count =
        |log: &str, what: &[&str]| log.lines().filter(|l| l.contains(&node) && what.iter().any(|w| l.contains(w))).count();
    assert_eq!(machine.stop(), 0);
    wait_until("the gateway ended every session of the stopped agent", Duration::from_secs(30), || {
        let log = server.log_text().split_off(restarted_at);
        let started = count(&log, &["node session started"]);
        (count(&log, &["node session ended", "node session refused"]) >= started).then_some(())
    });
    let head = node_doc(&server, &node).await["agent"]["journalSeq"].as_u64().unwrap();
    let journaled = events(&server, &["command.*", "node.observed", "node.inventory_reported", "node.agent_started"]).await;
    // The log holds at least what the agent saw acknowledged, and nothing it did not write.
    let (acked, written) = agent_journal(&machine).await;
    assert!(acked <= head && head <= written, "acknowledged {acked} <= the log's {head} <= written {written}");
    assert!(head > 60, "30 commands (started and succeeded) and observations: {head}");
    let mut seqs: BTreeMap<u64, usize> = BTreeMap::new();
    for event in &journaled {
        if let Some(seq) = event["payload"]["journal"]["seq"].as_u64() {
            *seqs.entry(seq).or_default() += 1;
        }
    }
    assert!(seqs.values().all(|n| *n == 1), "an entry appended twice");
    assert_eq!(seqs.keys().copied().collect::<Vec<_>>(), (1..=head).collect::<Vec<_>>(), "every entry, none missing");
    for command in &commands {
        let started =
            journaled.iter().filter(|e| e["type"] == "command.started" && e["payload"]["commandId"] == command.as_str()).count();
        let succeeded = journaled
            .iter()
            .filter(|e| e["type"] == "command.succeeded" && e["payload"]["commandId"] == command.as_str())
            .count();
        assert_eq!((started, succeeded), (1, 1), "command {command} ran once");
    }
    // The chains verify, the node's signatures included.
    let (code, out, err) =
        server.cli(&["audit", "verify", "--data-dir", &server.data_dir.display().to_string(), "--format", "json"]);
    assert_eq!(code, 0, "audit verify: {out} {err}");
    let report = json(&out);
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(report["nodeSignedEvents"].as_u64(), Some(head), "{report}");
}

/// The stopped agent's journal (`journal.db`): the newest entry the gateway acknowledged, and
/// the newest written.
async fn agent_journal(machine: &AgentNode) -> (u64, u64) {
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(machine.data().join("journal.db"));
    let pool = sqlx::SqlitePool::connect_with(options).await.expect("open the agent's journal");
    let (acked,): (i64,) = sqlx::query_as("SELECT seq FROM acked WHERE id = 1").fetch_one(&pool).await.unwrap();
    let (written,): (Option<i64>,) = sqlx::query_as("SELECT MAX(seq) FROM entries").fetch_one(&pool).await.unwrap();
    pool.close().await;
    (acked as u64, written.map_or(acked, |w| w.max(acked)) as u64)
}

/// Commands issued to the away node beside the first: more than a session once sent at a time.
const PINGS_WHILE_AWAY: usize = 70;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_issued_while_the_node_is_away_runs_once_when_it_returns_and_liveness_follows_the_lease() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("away").await;
    let secret = token(&server, &pool, 1).await;
    let mut machine = AgentNode::new(&server, port);
    assert_eq!(machine.join_stdin(&secret).0, 0);
    let node = machine.node_id();
    assert_eq!(node_doc(&server, &node).await["state"], "unreachable", "joined is not running");

    let (status, command) = server.call("commands.issue", json!({ "nodeId": node, "kind": "ping" })).await;
    assert_eq!(status, 200, "{command}");
    let command = command["commandId"].as_str().unwrap().to_owned();
    // GPUs are set aside only by a reservation's activation, never by a caller's command.
    let (status, refused) = server
        .call("commands.issue", json!({ "nodeId": node, "kind": "gpu.hold", "args": { "reservationId": "rsv_01jd0000000000000000000000", "gpus": [0] } }))
        .await;
    assert_eq!((status, refused["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{refused}");
    // More than one round's worth once (a session sent 64 and left the rest for the node's next
    // command): every one is sent when the node returns.
    let mut more = Vec::new();
    for _ in 0..PINGS_WHILE_AWAY {
        let (status, issued) = server.call("commands.issue", json!({ "nodeId": node, "kind": "ping" })).await;
        assert_eq!(status, 200, "{issued}");
        more.push(issued["commandId"].as_str().unwrap().to_owned());
    }
    machine.start();
    wait_state(&server, &node, "ready", Duration::from_secs(20)).await;
    let done = wait_command(&server, &command, "succeeded", Duration::from_secs(20)).await;
    assert_eq!(done["journalSeqs"].as_array().unwrap().len(), 2, "started and succeeded, once each: {done}");
    for id in &more {
        let done = wait_command(&server, id, "succeeded", Duration::from_secs(20)).await;
        assert_eq!(done["journalSeqs"].as_array().unwrap().len(), 2, "{done}");
    }

    // Stopped: unreachable once the lease (2 s) lapses; started again: ready.
    assert_eq!(machine.stop(), 0);
    wait_state(&server, &node, "unreachable", Duration::from_secs(15)).await;
    machine.start();
    wait_state(&server, &node, "ready", Duration::from_secs(20)).await;
    let liveness: Vec<String> = events(&server, &["node.ready", "node.unreachable"])
        .await
        .iter()
        .filter(|e| e["stream"] == format!("node/{node}"))
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(liveness, ["node.ready", "node.unreachable", "node.ready"], "each change an event, heartbeats none");
}

#[test]
fn bcd_never_echoes_an_argument_and_exits_as_the_reference_says() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(bc_tests::binary("bcd")).args(args).stdin(Stdio::null()).output().unwrap();
        (
            out.status.code().unwrap(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let pasted = "bcjt_jt_01jd0000000000000000000000_c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0";
    let (code, out, err) = run(&["join", pasted]);
    assert_eq!(code, 2);
    assert!(err.contains("takes no positional arguments") && err.contains("never from arguments"), "{err}");
    assert!(!err.contains(pasted) && !out.contains(pasted));
    let (code, _, err) = run(&[pasted]);
    assert_eq!((code, err.trim()), (2, "bcd: unknown command"));
    let (code, _, err) = run(&["joinn"]);
    assert_eq!(code, 2);
    assert!(err.contains("\"joinn\""), "a command-shaped name is echoed: {err}");
    let (code, out, _) = run(&["version"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("bcd "));
    assert_eq!(run(&["help"]).0, 0);
    // Not joined: exit 1 with the reference's message.
    let config = dir.path().join("config.toml");
    let pin = "sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    std::fs::write(
        &config,
        format!("data_dir = {:?}\ngateway = \"http://127.0.0.1:9\"\nlog_key_pin = {pin:?}\n", dir.path().display().to_string()),
    )
    .unwrap();
    let (code, _, err) = run(&["node", "--config", &config.display().to_string()]);
    assert_eq!(code, 1);
    assert!(err.contains("this node has not joined (run bcd join)"), "{err}");
    // No token anywhere: usage.
    let (code, _, err) = run(&["join", "--config", &config.display().to_string()]);
    assert_eq!(code, 2, "{err}");
    // Plaintext to another address is refused.
    std::fs::write(
        &config,
        format!("data_dir = {:?}\ngateway = \"http://10.1.2.3:7444\"\nlog_key_pin = {pin:?}\n", dir.path().display().to_string()),
    )
    .unwrap();
    let (code, _, err) = run(&["node", "--config", &config.display().to_string()]);
    assert_eq!(code, 1);
    assert!(err.contains("refuses plaintext"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_nodes_journal_is_refused_and_reset_moves_the_identity_aside_to_join_again() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("reset").await;
    let mut first = AgentNode::new(&server, port);
    assert_eq!(first.join_stdin(&token(&server, &pool, 1).await).0, 0);
    first.start();
    wait_until("the first node journals", Duration::from_secs(20), || {
        first.status().filter(|s| s["journalHead"].as_u64().unwrap_or(0) >= 1)
    });
    assert_eq!(first.stop(), 0);
    let mut second = AgentNode::new(&server, port);
    assert_eq!(second.join_stdin(&token(&server, &pool, 1).await).0, 0);
    // The whole database: its last writes may still be in the WAL.
    for file in ["journal.db", "journal.db-wal"] {
        if first.data().join(file).exists() {
            std::fs::copy(first.data().join(file), second.data().join(file)).unwrap();
        }
    }
    let (code, _, err) = second.bcd(&["node", "--config", &second.config()], &[], None);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("belongs to node") && err.contains("another node's journal"), "{err}");

    // --reset without --yes says what it would move and moves nothing.
    let (code, out, _) = second.bcd(&["join", "--reset", "--config", &second.config()], &[], None);
    assert_eq!(code, 2);
    assert!(out.contains("identity.json") && second.data().join("identity.json").exists(), "{out}");
    let old_node = second.node_id();
    let (code, out, err) = second.bcd(
        &["join", "--reset", "--yes", "--config", &second.config()],
        &[("BCD_JOIN_TOKEN", &token(&server, &pool, 1).await)],
        None,
    );
    assert_eq!(code, 0, "{out} {err}");
    assert!(out.contains("moved") && out.contains("joined as node_"), "{out}");
    assert_ne!(second.node_id(), old_node, "a new identity");
    second.start();
    let new_node = second.node_id();
    wait_state(&server, &new_node, "ready", Duration::from_secs(20)).await;
    assert_eq!(second.stop(), 0);
}

/// The node's GPUs come from what its agent finds (a seeded fake machine here, as the
/// test build has one), at join and in `node.inventory_reported`; `bcd hardware` on this machine,
/// which has no NVIDIA driver, reports no GPUs with the reason and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_gpus_come_from_its_inventory_and_hardware_says_why_there_are_none() {
    let (code, out, err) = AgentNode::run_bcd(&["hardware"]);
    assert_eq!(code, 0, "{err}");
    let here = json(&out);
    assert!(here["host"]["cpus"].as_u64().unwrap() >= 1, "{here}");
    if here["gpus"]["gpus"].as_array().unwrap().is_empty() {
        assert!(here["gpus"]["unavailable"].as_str().unwrap().contains("NVML"), "{here}");
    }
    let (code, out, _) = AgentNode::run_bcd(&["hardware", "--fake-hw", "7"]);
    assert_eq!(code, 0);
    let fake = json(&out);
    let fake_gpus = fake["gpus"]["gpus"].as_array().unwrap().clone();
    assert!(!fake_gpus.is_empty(), "seed 7 has GPUs: {fake}");

    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("inventory").await;
    let mut machine = AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = 7\n")).unwrap();
    assert_eq!(machine.join_stdin(&token(&server, &pool, 1).await).0, 0);
    let node = machine.node_id();
    let joined = node_doc(&server, &node).await;
    assert_eq!(joined["gpus"].as_array().unwrap().len(), fake_gpus.len(), "claimed at join: {joined}");
    machine.start();
    let doc = wait_until("the inventory is reported", Duration::from_secs(20), || {
        let doc = bc_tests::block_on(node_doc(&server, &node));
        doc["agent"]["inventory"].is_object().then_some(doc)
    });
    let inventory = &doc["agent"]["inventory"];
    assert_eq!(inventory["gpus"].as_array().unwrap(), &fake_gpus, "{inventory}");
    assert_eq!(inventory["host"]["serial"], "FAKE0000000007");
    // A fake machine's binding can hold: the agent says so, and gives no reason it cannot.
    assert!(inventory["capabilities"].as_array().unwrap().iter().any(|c| c == "gpu.hold"), "{inventory}");
    assert!(inventory.get("holdUnavailable").is_none(), "{inventory}");
    assert_eq!(doc["gpus"][0]["model"], fake_gpus[0]["model"]);

    // The drivers the fleet has are what its agents advertise: this one runs instances on the
    // fake machine's hypervisor, and sandboxes under gVisor where runsc is installed.
    assert!(inventory["capabilities"].as_array().unwrap().iter().any(|c| c == "hypervisor.fake"), "{inventory}");
    wait_state(&server, &node, "ready", Duration::from_secs(20)).await;
    let (code, out, err) = server.cli(&["drivers", "list", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let drivers = json(&out);
    let fake = drivers["items"].as_array().unwrap().iter().find(|d| d["name"] == "fake").cloned();
    let fake = fake.unwrap_or_else(|| panic!("the fake hypervisor is listed: {drivers}"));
    let counts = (fake["kind"].as_str(), fake["nodes"].as_u64(), fake["ready"].as_u64());
    assert_eq!(counts, (Some("hypervisor"), Some(1), Some(1)), "{fake}");
    assert_eq!(fake["pools"], json!([pool]), "{fake}");
    let runs_gvisor =
        drivers["items"].as_array().unwrap().iter().any(|d| d["kind"] == "sandbox-runtime" && d["name"] == "gvisor");
    let runsc = Command::new("runsc").arg("--version").output().is_ok_and(|o| o.status.success());
    assert_eq!(runs_gvisor, runsc, "gVisor is listed where runsc is installed: {drivers}");
    let (code, table, err) = server.cli(&["drivers", "list"]);
    assert_eq!(code, 0, "{err}");
    assert!(table.trim_start().starts_with("KIND") && table.contains("hypervisor") && table.contains("fake"), "{table}");
    assert_eq!(machine.stop(), 0);
}

/// Polls `reservations.get` until `done` says yes.
async fn wait_reservation(server: &Server, rsv: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, doc) = server.call("reservations.get", json!({ "reservationId": rsv })).await;
        assert_eq!(status, 200, "{doc}");
        if done(&doc) {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "reservation {rsv}: not {what} after 30 s: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A fake machine with at least `gpus` GPUs: the seed, and its GPUs' UUIDs.
fn fake_machine_with(gpus: usize) -> (u64, Vec<String>) {
    for seed in 1..100u64 {
        let hardware = bc_tests::fake_hardware(seed);
        let uuids: Vec<String> =
            hardware["gpus"]["gpus"].as_array().unwrap().iter().map(|g| g["uuid"].as_str().unwrap().to_owned()).collect();
        if uuids.len() >= gpus {
            return (seed, uuids);
        }
    }
    panic!("no fake machine with {gpus} GPUs among seeds 1..100");
}

/// A reserve on an agent's node reaches the agent as `gpu.hold` and turns `bound`, with the
/// GPUs' UUIDs from its inventory and the hold in the agent's ledger; a release turns it
/// `released` and frees them on the agent. An agent that cannot bind makes the reservation go
/// back to its queue with the reason (in `reservations.get`), and fail after the last try.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_becomes_a_hold_on_the_agent_and_a_refused_hold_goes_back_to_the_queue() {
    let (server, port) = bc_tests::agents_gateway();
    let (seed, uuids) = fake_machine_with(2);
    let pool = server.pool("holds").await;
    let mut machine = AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = {seed}\n")).unwrap();
    assert_eq!(machine.join_stdin(&token(&server, &pool, 1).await).0, 0);
    let node = machine.node_id();
    machine.start();
    wait_state(&server, &node, "ready", Duration::from_secs(20)).await;

    let (status, rsv) = server.call("reservations.create", json!({ "poolId": pool, "gpus": 2, "durationS": 3600 })).await;
    assert_eq!(status, 200, "{rsv}");
    assert_eq!((rsv["state"].as_str(), rsv["binding"]["state"].as_str()), (Some("active"), Some("pending")), "{rsv}");
    let id = rsv["reservationId"].as_str().unwrap().to_owned();
    let bound = wait_reservation(&server, &id, "bound", |r| r["binding"]["state"] == "bound").await;
    let held: Vec<String> =
        bound["binding"]["gpuUuids"].as_array().unwrap().iter().map(|u| u.as_str().unwrap().to_owned()).collect();
    let expected: Vec<String> =
        bound["gpuIndexes"].as_array().unwrap().iter().map(|i| uuids[i.as_u64().unwrap() as usize].clone()).collect();
    assert_eq!(held, expected, "the node held the GPUs it was given, by UUID: {bound}");
    let ledger: Value = serde_json::from_str(&std::fs::read_to_string(machine.data().join("holds.json")).unwrap()).unwrap();
    assert!(ledger["holds"][&id].is_object(), "the agent's ledger holds it: {ledger}");
    let hold_command = bound["binding"]["holdCommandId"].as_str().unwrap();
    let command = wait_command(&server, hold_command, "succeeded", Duration::from_secs(5)).await;
    assert_eq!(command["kind"], "gpu.hold");

    // Released while the node is away: the release waits for it, and no caller can cancel it
    // (that would leave the GPUs held on the node for good).
    assert_eq!(machine.stop(), 0);
    let (status, released) = server.call("reservations.release", json!({ "reservationId": id })).await;
    assert_eq!(status, 200, "{released}");
    let release_command = released["binding"]["releaseCommandId"].as_str().expect("a release was sent").to_owned();
    let (status, refused) = server.call("commands.cancel", json!({ "commandId": release_command })).await;
    assert_eq!((status, refused["code"].as_str()), (409, Some("INVALID_STATE")), "{refused}");
    machine.start();
    let released = wait_reservation(&server, &id, "released on the node", |r| r["binding"]["state"] == "released").await;
    assert_eq!(released["state"], "released");
    let ledger: Value = serde_json::from_str(&std::fs::read_to_string(machine.data().join("holds.json")).unwrap()).unwrap();
    assert!(ledger["holds"].as_object().unwrap().is_empty(), "freed on the agent: {ledger}");
    let stream: Vec<String> = events(&server, &["reservation.*", "gpu.*"])
        .await
        .iter()
        .filter(|e| e["stream"] == format!("reservation/{id}"))
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        stream,
        ["reservation.requested", "reservation.activated", "gpu.held", "reservation.released", "gpu.released"],
        "the reservation's own history tells it"
    );
    assert_eq!(machine.stop(), 0);

    // A node that cannot bind: each hold fails with its reason, the reservation goes back to
    // the head of its queue, and after the last try it fails with that reason.
    let refusing_pool = server.pool("refusing").await;
    let mut refusing = AgentNode::new(&server, port);
    let config = std::fs::read_to_string(refusing.config()).unwrap();
    let reason = "gpu-in-use: the fake machine refuses every hold";
    std::fs::write(refusing.config(), format!("{config}\n[hardware]\nfake_seed = {seed}\nfake_hold_refusal = {reason:?}\n"))
        .unwrap();
    assert_eq!(refusing.join_stdin(&token(&server, &refusing_pool, 1).await).0, 0);
    let refusing_node = refusing.node_id();
    refusing.start();
    wait_state(&server, &refusing_node, "ready", Duration::from_secs(20)).await;
    let (status, rsv) = server.call("reservations.create", json!({ "poolId": refusing_pool, "gpus": 1, "durationS": 600 })).await;
    assert_eq!(status, 200, "{rsv}");
    let id = rsv["reservationId"].as_str().unwrap().to_owned();
    let requeued = wait_reservation(&server, &id, "requeued", |r| r["holdAttempts"].as_u64() >= Some(1)).await;
    assert_eq!(requeued["lastError"], reason, "{requeued}");
    let failed = wait_reservation(&server, &id, "failed", |r| r["state"] == "failed").await;
    assert_eq!((failed["holdAttempts"].as_u64(), failed["lastError"].as_str()), (Some(3), Some(reason)), "{failed}");
    let (status, node) = server.call("nodes.get", json!({ "nodeId": refusing_node })).await;
    assert_eq!(status, 200);
    // The view always carries the map (empty when nothing is held): a missing one is a failure.
    assert_eq!(node["allocations"], json!({}), "its GPUs are free again: {node}");
    let types: Vec<String> = events(&server, &["reservation.*", "gpu.*"])
        .await
        .iter()
        .filter(|e| e["stream"] == format!("reservation/{id}"))
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    let count = |what: &str| types.iter().filter(|t| *t == what).count();
    let (requeues, refusals, failed) = (count("reservation.requeued"), count("gpu.hold_failed"), count("reservation.failed"));
    assert_eq!((requeues, refusals, failed), (2, 3, 1), "{types:?}");
    let last_refusal = types.iter().rposition(|t| t == "gpu.hold_failed").unwrap();
    assert!(types.iter().position(|t| t == "reservation.failed").unwrap() > last_refusal, "{types:?}");
    assert_eq!(refusing.stop(), 0);
}
