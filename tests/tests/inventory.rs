//! `inventory get|history|diff --node` end to end: a real `bcd` on a seeded
//! fake machine joins a real `better-compute dev`; `inventory get` shows the fake GPUs; the same
//! machine restarted as another fake machine (another `fake_seed`) reports again, so the
//! history holds both reports, newest first, and `diff` shows the GPUs removed and added and the
//! host's serial changed; a second node's reports stay out of the first's history. Bad input: an unknown node is `NOT_FOUND` (exit 1), a node registered
//! by hand `INVALID_ARGUMENT` (exit 2), a malformed node id a usage error before any call.
//!
//! The machine helper is a short copy of `agent.rs`'s (only what this test needs, with
//! `set_seed`); the shared pieces (the gateway, the pins, the fake hardware) are `bc_tests`'.

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bc_tests::{Server, json, wait_until};
use serde_json::{Value, json};

/// One machine: a data directory and a `config.toml` naming the gateway, its pins and a fake
/// machine's seed.
struct AgentNode {
    dir: tempfile::TempDir,
    node: Option<Child>,
    base_config: String,
}

impl AgentNode {
    fn new(server: &Server) -> AgentNode {
        let dir = tempfile::tempdir().unwrap();
        let (code, out, err) = bc_tests::cli(&["pki", "show", "--data-dir", &server.data_dir.display().to_string()], &[]);
        assert_eq!(code, 0, "pki show: {err}");
        let base_config = format!(
            "data_dir = {:?}\ngateway = {:?}\nserving_ca_spki_pin = {:?}\nlog_key_pin = {:?}\nobserve_interval = \"150ms\"\n",
            dir.path().join("data").display().to_string(),
            server.agents_url(),
            server.agents_pin.clone().expect("the agents' endpoint is TLS"),
            json(&out)["pin"].as_str().unwrap(),
        );
        AgentNode { dir, node: None, base_config }
    }

    fn config(&self) -> String {
        self.dir.path().join("config.toml").display().to_string()
    }

    /// The machine becomes the fake one of `seed`.
    fn set_seed(&self, seed: u64) {
        std::fs::write(self.config(), format!("{}\n[hardware]\nfake_seed = {seed}\n", self.base_config)).unwrap();
    }

    fn join(&self, token: &str) {
        let mut child = Command::new(bc_tests::binary("bcd"))
            .args(["join", "--config", &self.config()])
            .env_remove("BCD_JOIN_TOKEN")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start bcd join");
        child.stdin.take().unwrap().write_all(format!("{token}\n").as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "bcd join: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn start(&mut self) {
        self.node = Some(bc_tests::start_bcd_node(self.dir.path(), &self.config()));
    }

    /// SIGTERM, and the exit code.
    fn stop(&mut self) -> i32 {
        let mut child = self.node.take().expect("running");
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        child.wait().unwrap().code().unwrap_or(-1)
    }

    fn node_id(&self) -> String {
        let identity: Value =
            serde_json::from_str(&std::fs::read_to_string(self.dir.path().join("data/identity.json")).unwrap()).unwrap();
        let document: Value = serde_json::from_str(identity["identity"].as_str().unwrap()).unwrap();
        document["nodeId"].as_str().unwrap().to_owned()
    }
}

impl Drop for AgentNode {
    fn drop(&mut self) {
        if let Some(mut child) = self.node.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let kept = self.dir.path().to_path_buf();
            std::mem::forget(std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap()));
            eprintln!("kept the machine's directory: {}", kept.display());
        }
    }
}

fn uuids(gpus: &Value) -> Vec<String> {
    gpus.as_array().unwrap().iter().map(|g| g["uuid"].as_str().unwrap().to_owned()).collect()
}

/// `better-compute ARGS` as the administrator, which must succeed: its JSON.
fn cli_json(server: &Server, args: &[&str]) -> Value {
    let (code, out, err) = server.cli(args);
    assert_eq!(code, 0, "{args:?}: {err}");
    json(&out)
}

/// The node's history through the CLI, once it holds `n` reports.
fn history_of(server: &Server, node: &str, n: usize) -> Value {
    wait_until(&format!("{n} inventory reports"), Duration::from_secs(20), || {
        let page = cli_json(server, &["inventory", "history", "--node", node, "--format", "json"]);
        (page["items"].as_array().unwrap().len() >= n).then_some(page)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_get_history_and_diff_follow_a_machine_that_changes() {
    let (first_seed, second_seed) = (7, 8);
    let first = bc_tests::fake_hardware(first_seed);
    let second = bc_tests::fake_hardware(second_seed);
    let (first_uuids, second_uuids) = (uuids(&first["gpus"]["gpus"]), uuids(&second["gpus"]["gpus"]));
    assert!(!first_uuids.is_empty(), "seed {first_seed} has GPUs: {first}");
    assert_ne!(first_uuids, second_uuids, "two seeds, two machines");

    let server = Server::dev_with(&["--node-lease", "2s", "--node-heartbeat", "300ms"]);
    let pool = server.pool("inventory").await;
    let (status, created) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 2 })).await;
    assert_eq!(status, 200, "{created}");
    let mut machine = AgentNode::new(&server);
    machine.set_seed(first_seed);
    machine.join(created["token"].as_str().unwrap());
    let node = machine.node_id();

    // Joined, not started: the agent has reported nothing yet.
    let (code, _, err) = server.cli(&["inventory", "get", "--node", &node]);
    assert_eq!((code, err.contains("NOT_FOUND")), (1, true), "{err}");
    let page = cli_json(&server, &["inventory", "history", "--node", &node, "--format", "json"]);
    assert_eq!(page["items"], json!([]), "{page}");

    machine.start();
    history_of(&server, &node, 1);
    let latest = cli_json(&server, &["inventory", "get", "--node", &node]);
    assert_eq!(latest["gpus"], first["gpus"]["gpus"], "{latest}");
    assert_eq!(latest["host"]["serial"], format!("FAKE{first_seed:010}"));
    assert_eq!(latest["nodeId"], node);
    let first_seq = latest["seq"].as_u64().unwrap();
    // The seq is the event's: events.get of its id says the same.
    let (status, event) = server.call("events.get", json!({ "eventId": latest["eventId"] })).await;
    assert_eq!(status, 200, "{event}");
    assert_eq!((event["type"].as_str(), event["seq"].as_u64()), (Some("node.inventory_reported"), Some(first_seq)), "{event}");
    // One report: nothing before it to compare with.
    let (code, _, err) = server.cli(&["inventory", "diff", "--node", &node]);
    assert_eq!((code, err.contains("NOT_FOUND")), (1, true), "{err}");
    assert_eq!(machine.stop(), 0);

    // The same node, now another machine.
    machine.set_seed(second_seed);
    machine.start();
    let page = history_of(&server, &node, 2);
    let items = page["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{page}");
    let second_seq = items[0]["seq"].as_u64().unwrap();
    assert!(second_seq > first_seq, "newest first: {page}");
    assert_eq!(items[1]["seq"].as_u64(), Some(first_seq));
    assert_eq!(items[0]["gpus"], second["gpus"]["gpus"]);
    assert_eq!(cli_json(&server, &["inventory", "get", "--node", &node])["seq"].as_u64(), Some(second_seq));

    // Paged by one: the cursor leads from the newest to the first, then ends.
    let one = cli_json(&server, &["inventory", "history", "--node", &node, "--limit", "1", "--format", "json"]);
    assert_eq!(one["items"][0]["seq"].as_u64(), Some(second_seq));
    let cursor = one["nextCursor"].as_str().expect("a second page").to_owned();
    let rest =
        cli_json(&server, &["inventory", "history", "--node", &node, "--limit", "1", "--cursor", &cursor, "--format", "json"]);
    assert_eq!(rest["items"][0]["seq"].as_u64(), Some(first_seq));
    assert!(rest["nextCursor"].is_null(), "{rest}");
    // The table by default, a row per report.
    let (code, table, err) = server.cli(&["inventory", "history", "--node", &node]);
    assert_eq!(code, 0, "{err}");
    assert!(
        table.trim_start().starts_with("SEQ")
            && table.contains(&second_seq.to_string())
            && table.contains(&first_seq.to_string()),
        "{table}"
    );

    // Another node's reports are its own: its rows sit beside this node's (ids sort by node),
    // and neither history reads into the other's.
    let mut other = AgentNode::new(&server);
    other.set_seed(9);
    other.join(created["token"].as_str().unwrap());
    other.start();
    let other_node = other.node_id();
    let other_page = history_of(&server, &other_node, 1);
    assert_eq!(other_page["items"].as_array().unwrap().len(), 1, "{other_page}");
    assert_eq!(other_page["items"][0]["nodeId"], other_node);
    assert_eq!(other.stop(), 0);
    let page = cli_json(&server, &["inventory", "history", "--node", &node, "--format", "json"]);
    assert_eq!(page["items"].as_array().unwrap().len(), 2, "{page}");
    assert!(page["items"].as_array().unwrap().iter().all(|r| r["nodeId"] == node), "{page}");

    // The default diff is the previous report against the latest: by UUID, every GPU of the
    // first machine went and every one of the second came; the serial changed.
    let diff = cli_json(&server, &["inventory", "diff", "--node", &node]);
    assert_eq!((diff["from"].as_u64(), diff["to"].as_u64(), &diff["changed"]), (Some(first_seq), Some(second_seq), &json!(true)));
    let only = |a: &[String], b: &[String]| a.iter().filter(|u| !b.contains(u)).cloned().collect::<Vec<_>>();
    assert_eq!(uuids(&diff["gpusRemoved"]), only(&first_uuids, &second_uuids), "{diff}");
    assert_eq!(uuids(&diff["gpusAdded"]), only(&second_uuids, &first_uuids), "{diff}");
    let serial = diff["hostChanged"].as_array().unwrap().iter().find(|c| c["field"] == "serial").expect("the serial changed");
    assert_eq!(
        (&serial["before"], &serial["after"]),
        (&json!(format!("FAKE{first_seed:010}")), &json!(format!("FAKE{second_seed:010}")))
    );
    // Named both ways round, and a report with itself: nothing changed.
    let back = cli_json(
        &server,
        &["inventory", "diff", "--node", &node, "--from", &second_seq.to_string(), "--to", &first_seq.to_string()],
    );
    assert_eq!(uuids(&back["gpusAdded"]), uuids(&diff["gpusRemoved"]));
    let same = cli_json(
        &server,
        &["inventory", "diff", "--node", &node, "--from", &first_seq.to_string(), "--to", &first_seq.to_string()],
    );
    assert_eq!(same["changed"], false, "{same}");
    assert_eq!(machine.stop(), 0);

    // Bad input. An unknown node, and a seq that is no report of this node: NOT_FOUND, exit 1.
    let unknown = "node_01JZZZZZZZZZZZZZZZZZZZZZZZ".to_owned();
    for args in [
        vec!["inventory", "get", "--node", unknown.as_str()],
        vec!["inventory", "history", "--node", unknown.as_str()],
        vec!["inventory", "diff", "--node", unknown.as_str()],
    ] {
        let (code, _, err) = server.cli(&args);
        assert_eq!((code, err.contains("NOT_FOUND")), (1, true), "{args:?}: {err}");
    }
    let (code, _, err) = server.cli(&["inventory", "diff", "--node", &node, "--from", "1"]);
    assert_eq!((code, err.contains("NOT_FOUND")), (1, true), "{err}");
    // A node registered by hand has no agent, hence no inventory: INVALID_STATE, exit 1.
    let (status, by_hand) = server.call("nodes.register", json!({ "poolId": pool, "name": "by-hand", "gpus": [{ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }] })).await;
    assert_eq!(status, 200, "{by_hand}");
    let (code, _, err) = server.cli(&["inventory", "get", "--node", by_hand["nodeId"].as_str().unwrap()]);
    assert_eq!((code, err.contains("INVALID_STATE") && err.contains("registered by hand")), (1, true), "{err}");
    // Not a node id: refused before any call; over HTTP, the schema's edge says the same.
    let (code, _, err) = server.cli(&["inventory", "get", "--node", "pool_x"]);
    assert_eq!((code, err.contains("--node")), (2, true), "{err}");
    let (status, body) = server.call("inventory.history", json!({ "nodeId": node, "limit": 51 })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{body}");
    let (status, body) = server.call("inventory.history", json!({ "nodeId": node, "cursor": "abc" })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{body}");
}
