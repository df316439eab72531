//! `bcd sim` end to end: three real agents on seeded fake machines in one
//! process join a real `better-compute dev` with one token of three uses (read from
//! `BCD_JOIN_TOKEN`), become `ready` with the fake GPUs their inventories report, turn
//! `unreachable` when the sim is stopped, and come back under the same identities when it is
//! started again on the same directory without a token.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bc_tests::{Server, json, wait_until};
use serde_json::{Value, json};

/// `bcd sim`, its standard error to `log`.
fn start_sim(args: &[&str], env: &[(&str, &str)], log: &std::path::Path) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    Command::new(bc_tests::binary("bcd"))
        .arg("sim")
        .args(args)
        .env_remove("BCD_JOIN_TOKEN")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start bcd sim")
}

fn sigterm(child: &mut Child) -> i32 {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let pid = child.id();
    let (done, watchdog) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if watchdog.recv_timeout(Duration::from_secs(30)).is_err() {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        }
    });
    let code = child.wait().unwrap().code().unwrap_or(-1);
    let _ = done.send(());
    code
}

/// `bc nodes list --pool POOL`, by node id.
fn nodes(server: &Server, pool: &str) -> BTreeMap<String, Value> {
    let (code, out, err) = server.cli(&["nodes", "list", "--pool", pool, "--format", "json"]);
    assert_eq!(code, 0, "nodes list: {err}");
    json(&out)["items"].as_array().unwrap().iter().map(|n| (n["nodeId"].as_str().unwrap().to_owned(), n.clone())).collect()
}

fn node_id(dir: &std::path::Path) -> String {
    let identity: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("identity.json")).unwrap()).unwrap();
    let document: Value = serde_json::from_str(identity["identity"].as_str().unwrap()).unwrap();
    document["nodeId"].as_str().unwrap().to_owned()
}

/// The GPUs `bcd hardware --fake-hw SEED` reports.
fn fake_gpus(seed: u64) -> Vec<Value> {
    let out = Command::new(bc_tests::binary("bcd")).args(["hardware", "--fake-hw", &seed.to_string()]).output().unwrap();
    assert!(out.status.success());
    json(&String::from_utf8_lossy(&out.stdout))["gpus"]["gpus"].as_array().unwrap().clone()
}

fn all_in_state(server: &Server, pool: &str, state: &str) -> Option<BTreeMap<String, Value>> {
    let nodes = nodes(server, pool);
    (nodes.len() == 3 && nodes.values().all(|n| n["state"] == state)).then_some(nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_simulated_machines_join_are_ready_with_their_fake_gpus_and_rejoin_nothing_on_restart() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("sim").await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = \"/unused\"\ngateway = \"https://127.0.0.1:{port}\"\nserving_ca_spki_pin = {:?}\nlog_key_pin = {:?}\nobserve_interval = \"500ms\"\n\n[log]\nformat = \"json\"\n",
            server.agents_pin.clone().unwrap(),
            bc_tests::log_key_pin(&server),
        ),
    )
    .unwrap();
    let (status, created) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 3 })).await;
    assert_eq!(status, 200, "{created}");
    let secret = created["token"].as_str().unwrap().to_owned();
    let machines = dir.path().join("machines");
    let (config, machines_arg) = (config.display().to_string(), machines.display().to_string());
    let args = ["--nodes", "3", "--seed", "40", "--data-dir", machines_arg.as_str(), "--config", config.as_str()];
    let log = dir.path().join("sim.log");
    let mut sim = start_sim(&args, &[("BCD_JOIN_TOKEN", &secret)], &log);

    let ready = wait_until("three ready nodes", Duration::from_secs(60), || all_in_state(&server, &pool, "ready"));
    let progress = std::fs::read_to_string(&log).unwrap();
    assert!(progress.contains("joined 3/3"), "{progress}");
    assert!(!progress.contains(&secret), "the token is in no log line");
    // Machine i is the fake machine of seed 40 + i, with its own identity, and its node's GPUs
    // are the ones its inventory reports.
    for i in 0..3u64 {
        let node = node_id(&machines.join(format!("node-{i}")));
        let expected = fake_gpus(40 + i);
        assert_eq!(ready[&node]["gpus"].as_array().unwrap().len(), expected.len(), "node-{i}: {}", ready[&node]);
        let doc = wait_until("the inventory is reported", Duration::from_secs(20), || {
            let (status, doc) = bc_tests::block_on(server.call("nodes.get", json!({ "nodeId": node })));
            (status == 200 && doc["agent"]["inventory"].is_object()).then_some(doc)
        });
        assert_eq!(doc["agent"]["inventory"]["gpus"].as_array().unwrap(), &expected, "node-{i}");
        assert_eq!(doc["agent"]["inventory"]["host"]["serial"], format!("FAKE{:010}", 40 + i));
        assert_eq!(doc["name"], format!("sim-{i}"));
    }

    // Stopped: every node turns unreachable once its lease (2 s) lapses.
    assert_eq!(sigterm(&mut sim), 0, "bcd sim stops with 0 on SIGTERM");
    wait_until("three unreachable nodes", Duration::from_secs(20), || all_in_state(&server, &pool, "unreachable"));

    // Started again on the same directory, without a token: the same three nodes, ready again.
    let mut again = start_sim(&args, &[], &log);
    let back = wait_until("the same three nodes ready again", Duration::from_secs(60), || all_in_state(&server, &pool, "ready"));
    assert_eq!(back.keys().collect::<Vec<_>>(), ready.keys().collect::<Vec<_>>(), "no machine joined again");
    let progress = std::fs::read_to_string(&log).unwrap();
    assert!(progress.contains("3 joined already, 0 to join"), "{progress}");
    assert_eq!(sigterm(&mut again), 0);

    // Bounds and usage: exit 2, nothing started.
    let out = Command::new(bc_tests::binary("bcd"))
        .args(["sim", "--nodes", "10001", "--data-dir", &machines_arg, "--config", &config])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--nodes is 1 to 10000"));
}

/// A join that fails (a token with too few uses) stops every machine with exit 1; the
/// identities written stay, so a run with a new token joins only the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_join_stops_the_sim_and_a_new_token_joins_only_the_rest() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("sim-short").await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = \"/unused\"\ngateway = \"https://127.0.0.1:{port}\"\nserving_ca_spki_pin = {:?}\nlog_key_pin = {:?}\n",
            server.agents_pin.clone().unwrap(),
            bc_tests::log_key_pin(&server),
        ),
    )
    .unwrap();
    let (config, machines) = (config.display().to_string(), dir.path().join("machines").display().to_string());
    let args = ["--nodes", "3", "--data-dir", machines.as_str(), "--config", config.as_str()];
    let run = |token: &str| {
        let out = Command::new(bc_tests::binary("bcd"))
            .arg("sim")
            .args(args)
            .env("BCD_JOIN_TOKEN", token)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (status, short) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 2 })).await;
    assert_eq!(status, 200, "{short}");
    let (code, err) = run(short["token"].as_str().unwrap());
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("spent"), "{err}");
    assert_eq!(nodes(&server, &pool).len(), 2, "two machines joined before the token ran out");
    // Stopping waited for the joins in flight: every node the gateway holds has its identity.
    let identities = (0..3).filter(|i| std::path::Path::new(&machines).join(format!("node-{i}/identity.json")).exists()).count();
    assert_eq!(identities, 2, "a join the gateway took left no identity: {err}");

    let (status, one) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    assert_eq!(status, 200, "{one}");
    let log = dir.path().join("sim.log");
    let mut sim = start_sim(&args, &[("BCD_JOIN_TOKEN", one["token"].as_str().unwrap())], &log);
    wait_until("three ready nodes", Duration::from_secs(60), || all_in_state(&server, &pool, "ready"));
    let progress = std::fs::read_to_string(&log).unwrap();
    assert!(progress.contains("2 joined already, 1 to join") && progress.contains("joined 3/3"), "{progress}");
    assert_eq!(sigterm(&mut sim), 0);
}
