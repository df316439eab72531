//! Agents across gateways (issue 60, item 4), end to end with real processes: two `serve`
//! processes on one PostgreSQL, and agents that reach them through HAProxy (Debian's `haproxy`,
//! in TCP mode, as the HA recipe runs it) or directly. A gateway killed with SIGKILL: the agent is
//! live on the other within its back-off, a reservation made meanwhile is bound, and its journal
//! is in the log once. A node that binds through the other gateway while its session on the
//! first is still open: the first closes its session (the lease's claim), long before the lease
//! would have ended it.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bc_tests::{AgentNode, Server, wait_until};
use serde_json::{Value, json};

/// HAProxy in front of the two gateways' agents' endpoints: TCP, `a` the server, `b` the backup
/// (so every agent starts on `a` and moves only when `a` is down), checked every 200 ms.
struct Haproxy {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Haproxy {
    fn start(a: &str, b: &str) -> Haproxy {
        let binary = ["/usr/sbin/haproxy", "/usr/bin/haproxy"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("haproxy is not installed: `make test` installs it (scripts/system-deps), or apt-get install haproxy");
        let dir = tempfile::tempdir().unwrap();
        let port = bc_tests::free_port();
        let config = format!(
            "global\n    maxconn 256\n\ndefaults\n    mode tcp\n    timeout connect 1s\n    timeout client 1h\n    timeout server 1h\n\n\
             listen agents\n    bind 127.0.0.1:{port}\n    default-server inter 200ms fall 2 rise 2\n    \
             server a {a} check\n    server b {b} check backup\n"
        );
        let path = dir.path().join("haproxy.cfg");
        std::fs::write(&path, config).unwrap();
        let check = Command::new(binary).args(["-c", "-f"]).arg(&path).output().unwrap();
        assert!(check.status.success(), "haproxy -c: {}", String::from_utf8_lossy(&check.stderr));
        let log = std::fs::File::create(dir.path().join("haproxy.log")).unwrap();
        let child = Command::new(binary)
            .args(["-db", "-f"])
            .arg(&path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        wait_until("haproxy listens", Duration::from_secs(10), || std::net::TcpStream::connect(("127.0.0.1", port)).ok());
        Haproxy { child, port, _dir: dir }
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Two `serve` processes on a fresh PostgreSQL database, sharing a data directory (the log key
/// and the serving certificate, so an agent's pin holds on either), with `lease` and
/// `heartbeat` for their agents.
fn two_gateways(db: &bc_core::testing::ScratchDatabase, lease: &str, heartbeat: &str) -> (Server, Server) {
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let a = Server::serve_postgres_with(&db.url, &["--node-lease", lease, "--node-heartbeat", heartbeat]);
    let b = a.serve_beside();
    assert_eq!(a.agents_pin, b.agents_pin, "one serving certificate");
    (a, b)
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

async fn wait_node_state(server: &Server, node: &str, state: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, doc) = server.call("nodes.get", json!({ "nodeId": node })).await;
        assert_eq!(status, 200, "{doc}");
        if doc["state"] == state {
            return;
        }
        assert!(Instant::now() < deadline, "node {node} not {state} after 30 s: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Lines of `log` that name `node` and say `what`. (The two gateways write one log file.)
fn count(log: &str, node: &str, what: &str) -> usize {
    log.lines().filter(|l| l.contains(node) && l.contains(what)).count()
}

/// The agents' sessions connected to `server`'s process, from its `/metrics`.
async fn sessions_on(server: &Server) -> u64 {
    let text = server.http.get(format!("{}/metrics", server.url)).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix("better_compute_agent_sessions "))
        .unwrap_or_else(|| panic!("no better_compute_agent_sessions in /metrics:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Waits until `server` has `n` agents' sessions.
async fn wait_sessions(server: &Server, n: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while sessions_on(server).await != n {
        assert!(Instant::now() < deadline, "{what}: not {n} session(s) after 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One of two gateways killed with SIGKILL: the agent, which reached it through HAProxy,
/// reconnects through HAProxy to the other within its back-off; a reservation made through the
/// other meanwhile is bound by the agent (its hold command found the node's new session); and
/// every journal entry of the agent is in the log exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_under_its_agents_leaves_them_live_on_the_other_with_nothing_lost_or_doubled() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (mut a, b) = two_gateways(&db, "2s", "300ms");
    let proxy = Haproxy::start(&a.agents_addr, &b.agents_addr);
    let pool = a.pool("across").await;
    let mut machine = AgentNode::new(&a, proxy.port);
    let seed = (1..100u64).find(|s| !bc_tests::fake_hardware(*s)["gpus"]["gpus"].as_array().unwrap().is_empty()).unwrap();
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = {seed}\n")).unwrap();
    machine.join_pool(&a, &pool).await;
    let node = machine.node_id();
    machine.start();
    wait_node_state(&a, &node, "ready").await;
    assert_eq!((sessions_on(&a).await, sessions_on(&b).await), (1, 0), "the agent is on the first gateway, and only there");

    let killed = Instant::now();
    a.kill9();
    // Made through the survivor while the agent is still finding it.
    let (status, rsv) = b.call("reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 3600 })).await;
    assert_eq!(status, 200, "{rsv}");
    assert_eq!(rsv["state"], "active", "placed on the node, whose lease still holds: {rsv}");
    let id = rsv["reservationId"].as_str().unwrap().to_owned();
    wait_sessions(&b, 1, "the agent's session on the surviving gateway").await;
    eprintln!("the agent was live on the other gateway {:?} after the kill", killed.elapsed());
    let deadline = Instant::now() + Duration::from_secs(30);
    let bound = loop {
        let (status, doc) = b.call("reservations.get", json!({ "reservationId": id })).await;
        assert_eq!(status, 200, "{doc}");
        if doc["binding"]["state"] == "bound" {
            break doc;
        }
        assert!(Instant::now() < deadline, "reservation {id} not bound 30 s after the kill: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let ledger: Value = serde_json::from_str(&std::fs::read_to_string(machine.data().join("holds.json")).unwrap()).unwrap();
    assert!(ledger["holds"][&id].is_object(), "the agent holds it: {ledger} {bound}");
    wait_node_state(&b, &node, "ready").await;

    // Stopped, and its session on the survivor ended: nothing more of its can land.
    assert_eq!(machine.stop(), 0);
    wait_sessions(&b, 0, "the survivor ended the agent's session").await;
    let (status, doc) = b.call("nodes.get", json!({ "nodeId": node })).await;
    assert_eq!(status, 200, "{doc}");
    let head = doc["agent"]["journalSeq"].as_u64().unwrap();
    let mut seqs: BTreeMap<u64, usize> = BTreeMap::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "types": ["command.*", "node.observed", "node.inventory_reported", "node.agent_started", "gpu.*", "instance.*"], "limit": 500 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let (status, page) = b.call("events.list", body).await;
        assert_eq!(status, 200, "{page}");
        for event in page["items"].as_array().unwrap() {
            if let Some(seq) = event["payload"]["journal"]["seq"].as_u64() {
                *seqs.entry(seq).or_default() += 1;
            }
        }
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert!(seqs.values().all(|n| *n == 1), "a journal entry appended twice: {seqs:?}");
    assert_eq!(seqs.keys().copied().collect::<Vec<_>>(), (1..=head).collect::<Vec<_>>(), "every entry, none missing");
    let store = bc_core::store::postgres::PostgresStore::connect(&db.url).await.unwrap();
    bc_tests::verify_store(&store).await;
}

/// A node whose session on one gateway is still open binds through the other (here a copy of
/// its identity, as when an agent reconnects through the load balancer while the first
/// gateway's side of its connection has not yet broken): the first gateway closes its session
/// within a second or so, from the lease's claim, and says why, long before the lease (30 s)
/// would have ended it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_binds_through_the_other_gateway_has_its_older_session_closed() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (a, b) = two_gateways(&db, "30s", "1s");
    let pool = a.pool("twice").await;
    let mut first = AgentNode::new(&a, port_of(&a.agents_addr));
    // Quiet: no observations after the first, so the two copies' journals do not move apart
    // while the test looks at their sessions.
    let config =
        std::fs::read_to_string(first.config()).unwrap().replace("observe_interval = \"150ms\"", "observe_interval = \"1h\"");
    std::fs::write(first.config(), &config).unwrap();
    first.join_pool(&a, &pool).await;
    let node = first.node_id();
    first.start();
    wait_node_state(&a, &node, "ready").await;
    wait_until("the first agent's journal acknowledged", Duration::from_secs(30), || {
        first.status().filter(|s| s["session"] == "live" && s["journalUnacked"].as_u64() == Some(0))
    });

    // The same node, its identity copied, through the other gateway.
    let mut second = AgentNode::new(&a, port_of(&b.agents_addr));
    copy_dir(&first.data(), &second.data());
    let second_config =
        std::fs::read_to_string(second.config()).unwrap().replace("observe_interval = \"150ms\"", "observe_interval = \"1h\"");
    std::fs::write(second.config(), second_config).unwrap();
    assert_eq!((sessions_on(&a).await, sessions_on(&b).await), (1, 0));
    second.start();
    wait_sessions(&b, 1, "the second session, on the other gateway").await;
    let bound_elsewhere = Instant::now();
    wait_until("the first gateway closes its older session", Duration::from_secs(20), || {
        (count(&a.log_text(), &node, "a newer session of the node on another gateway replaced it") >= 1).then_some(())
    });
    eprintln!("closed {:?} after the node bound through the other gateway (lease 30 s)", bound_elsewhere.elapsed());
    second.kill9();
    first.kill9();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        let kind = entry.file_type().unwrap();
        if kind.is_dir() {
            copy_dir(&entry.path(), &target);
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}
