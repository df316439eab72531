//! Rollouts end to end with real processes: `better-compute dev` trusting one release key
//! (`--release-key`), three fakehw `bcd node`s on version A with `[update]` pinning that key,
//! releases made by `releases sign`, registered by `releases register` and served on loopback.
//!
//! - Release B in two waves (a canary, then the rest): every agent ends on B, re-executed from
//!   slot b, and `rollouts get` shows each wave's gate passed.
//! - A bad release C (its binary exits at start): the canary fails its gate, the rollout pauses
//!   with the reason, the canary is back on B through its watchdog, and the other nodes were
//!   never sent anything.
//! - A release signed by a key the control plane does not trust is refused at registration.
//! - Aborting a rollout of B in its second wave: the node in flight finishes its update, then
//!   every updated node is sent `agent.rollback` one at a time and ends back on A from slot a.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bc_tests::{AgentNode, ImageServer, Server, json, wait_until};
use serde_json::{Value, json};

/// `releases sign` then `releases register`: the release's `rel_…` id.
fn release(server: &Server, key: &Path, dir: &Path, version: &str, artifact: &Path, url: &str) -> (i32, Value, String) {
    let manifest = dir.join(format!("{version}-{}.json", key.file_stem().unwrap().to_string_lossy()));
    let item = format!("{}={}={url}", std::env::consts::ARCH, artifact.display());
    let key = key.display().to_string();
    let out = manifest.display().to_string();
    let (code, stdout, err) =
        server.cli(&["releases", "sign", "--key", &key, "--version", version, "--artifact", &item, "--out", &out]);
    assert_eq!(code, 0, "releases sign: {stdout} {err}");
    let (code, stdout, err) = server.cli(&["releases", "register", "--manifest", &out, "--format", "json"]);
    let value = if code == 0 { json(&stdout) } else { Value::Null };
    (code, value, err)
}

/// Polls `check` until it gives a value, or fails after `timeout`.
async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(std::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn rollout(server: &Server, id: &str) -> Value {
    let (status, doc) = server.call("rollouts.get", json!({ "rolloutId": id })).await;
    assert_eq!(status, 200, "{doc}");
    doc
}

/// `better-compute dev` trusting a fresh release key (`--release-key`), and `n` fakehw agents on
/// version A in one pool, each pinning that key under `[update]`, live and known on A. Fields
/// drop in order: the agents (through `bcd.pid`) before the server and the directory.
struct Fleet {
    _guards: Vec<bc_tests::PidGuard>,
    machines: Vec<AgentNode>,
    server: Server,
    pool: String,
    /// The release key (`release.key`, its public half beside it).
    key: PathBuf,
    version_a: String,
    work: tempfile::TempDir,
}

impl Fleet {
    async fn start(n: usize) -> Self {
        let work = tempfile::tempdir().unwrap();
        let dir = work.path();
        let key = dir.join("release.key");
        let (code, _, err) = bc_tests::cli(&["releases", "keygen", "--out", &key.display().to_string()], &[]);
        assert_eq!(code, 0, "releases keygen: {err}");
        let public = dir.join("release.key.pub");
        let pinned = std::fs::read_to_string(&public).unwrap().trim().to_owned();

        let (server, port) = bc_tests::agents_gateway_with(&["--release-key", &public.display().to_string()]);
        let pool = server.pool("gpu-a").await;

        let (code, version_a, _) = bc_tests::bcd(&["version"], &[], None);
        assert_eq!(code, 0);
        let version_a = version_a.trim().strip_prefix("bcd ").unwrap().to_owned();
        let mut machines = Vec::new();
        let mut guards = Vec::new();
        for _ in 0..n {
            let mut machine = AgentNode::new(&server, port);
            machine.trust_release_key(&pinned);
            machine.join_pool(&server, &pool).await;
            machine.start();
            guards.push(bc_tests::PidGuard(machine.data().join("bcd.pid")));
            machines.push(machine);
        }
        for machine in &machines {
            wait_until("the agent is live", Duration::from_secs(30), || machine.status().filter(|s| s["session"] == "live"));
        }
        // The control plane knows each agent's version from its start.
        for machine in &machines {
            let node = machine.node_id();
            wait_for("the node reports A", Duration::from_secs(20), || async {
                let (_, doc) = server.call("nodes.get", json!({ "nodeId": node })).await;
                (doc["agent"]["agentVersion"] == version_a.as_str() && doc["state"] == "ready").then_some(())
            })
            .await;
        }
        Self { _guards: guards, machines, server, pool, key, version_a, work }
    }

    fn dir(&self) -> &Path {
        self.work.path()
    }

    /// Every agent's log, for a failed assertion.
    fn logs(&self) -> String {
        self.machines.iter().map(|m| m.node_log()).collect::<Vec<_>>().join("\n----\n")
    }

    fn machine(&self, node_id: &Value) -> &AgentNode {
        self.machines.iter().find(|m| m.node_id() == node_id.as_str().unwrap()).unwrap()
    }
}

/// Release B: this `bcd` with the fakehw trailer of version 9.0.0, written to `dir/bcd-b` and
/// served on loopback.
fn artifact_b(dir: &Path) -> (PathBuf, Vec<u8>, ImageServer) {
    let mut bytes_b = std::fs::read(bc_tests::binary("bcd")).unwrap();
    bytes_b.extend_from_slice(b"\nbcd-fakehw-version=9.0.0\n");
    let artifact_b = dir.join("bcd-b");
    std::fs::write(&artifact_b, &bytes_b).unwrap();
    let served_b = ImageServer::start("bcd-b", bytes_b.clone());
    (artifact_b, bytes_b, served_b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_goes_out_in_waves_and_a_bad_one_pauses_at_its_canary() {
    let fleet = Fleet::start(3).await;
    let (server, dir, machines, key, pool) = (&fleet.server, fleet.dir(), &fleet.machines, &fleet.key, &fleet.pool);
    let untrusted = dir.join("untrusted.key");
    assert_eq!(bc_tests::cli(&["releases", "keygen", "--out", &untrusted.display().to_string()], &[]).0, 0);
    let node_of = |m: &AgentNode| m.node_id();

    // A release signed by a key the control plane does not trust is refused.
    let (artifact_b, _, served_b) = artifact_b(dir);
    let (code, _, err) = release(server, &untrusted, dir, "9.0.0", &artifact_b, &served_b.url);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("ACCESS_DENIED: release-untrusted-key: "), "{err}");

    // Release B in two waves.
    let (code, b, err) = release(server, key, dir, "9.0.0", &artifact_b, &served_b.url);
    assert_eq!(code, 0, "releases register: {err}");
    assert_eq!(b["releaseVersion"], "9.0.0");
    let rel_b = b["releaseId"].as_str().unwrap().to_owned();
    let (code, out, err) = server.cli(&[
        "rollouts",
        "create",
        "--release",
        &rel_b,
        "--pool",
        pool,
        "--waves",
        "1,100%",
        "--max-unavailable",
        "1",
        "--min-ready",
        "2s",
        "--node-deadline",
        "90s",
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "rollouts create: {out} {err}");
    let created = json(&out);
    let ro_b = created["rolloutId"].as_str().unwrap().to_owned();
    assert_eq!(created["waves"].as_array().unwrap().len(), 2);
    // `rollouts get --wait` follows it to the end.
    let (code, out, err) = server.cli(&["rollouts", "get", &ro_b, "--wait", "240s", "--format", "json"]);
    let logs = || fleet.logs();
    assert_eq!(code, 0, "rollouts get --wait: {out} {err}\n{}", logs());
    let done = json(&out);
    assert_eq!(done["state"], "done", "{done}");
    for wave in done["waves"].as_array().unwrap() {
        assert_eq!(wave["state"], "passed", "{done}");
        assert!(wave["passedAtMs"].as_u64().is_some(), "{done}");
    }
    assert!(done["nodes"].as_array().unwrap().iter().all(|n| n["state"] == "updated"), "{done}");
    assert!(err.contains("wave 2 of 2"), "progress on standard error: {err}");
    // The canary went alone first: its gate passed before any other node was sent the release.
    let nodes = done["nodes"].as_array().unwrap();
    let canary_done = nodes[0]["finishedAtMs"].as_u64().unwrap();
    assert!(nodes[1..].iter().all(|n| n["startedAtMs"].as_u64().unwrap() >= canary_done), "{done}");
    for machine in machines {
        let status =
            wait_until("B is live", Duration::from_secs(30), || machine.status().filter(|s| s["agentVersion"] == "9.0.0"));
        assert_eq!(status["session"], "live");
        let entrypoint = machine.data().join("bin/bcd");
        assert_eq!(std::fs::read_link(&entrypoint).unwrap(), machine.data().join("slots/b/bcd"), "re-executed from slot b");
        let (_, doc) = server.call("nodes.get", json!({ "nodeId": node_of(machine) })).await;
        assert_eq!(
            (doc["agent"]["agentVersion"].as_str(), doc["agent"]["agentSlot"].as_str()),
            (Some("9.0.0"), Some("b")),
            "{doc}"
        );
    }
    assert_eq!(served_b.served(), 3);

    // A bad release C: its binary exits at start.
    let bad = dir.join("bcd-bad");
    std::fs::write(&bad, b"#!/bin/sh\nexit 1\n").unwrap();
    let served_bad = ImageServer::start("bcd-bad", std::fs::read(&bad).unwrap());
    let (code, c, err) = release(server, key, dir, "10.0.0", &bad, &served_bad.url);
    assert_eq!(code, 0, "releases register: {err}");
    let pids: Vec<String> = machines.iter().map(bc_tests::pid_of).collect();
    let (status, created) = server
        .call(
            "rollouts.create",
            json!({ "releaseId": c["releaseId"], "poolId": pool, "waves": ["1", "100%"], "minReadyS": 2, "nodeDeadlineS": 90 }),
        )
        .await;
    assert_eq!(status, 200, "{created}");
    let ro_c = created["rolloutId"].as_str().unwrap().to_owned();
    let paused = wait_for("the rollout pauses", Duration::from_secs(120), || async {
        let doc = rollout(server, &ro_c).await;
        (doc["state"] != "running").then_some(doc)
    })
    .await;
    assert_eq!(paused["state"], "paused", "{paused}\n{}", logs());
    let reason = paused["reason"].as_str().unwrap();
    assert!(reason.contains("wave 1") && reason.contains("rolled-back"), "{paused}");
    let canary = &paused["nodes"][0];
    assert_eq!(canary["state"], "failed", "{paused}");
    // The others were never touched: no command, the same process, still on B.
    for (i, n) in paused["nodes"].as_array().unwrap().iter().enumerate().skip(1) {
        assert_eq!(n["state"], "pending", "{paused}");
        assert!(n.get("commandId").is_none(), "{paused}");
        let machine = machines.iter().find(|m| m.node_id() == n["nodeId"].as_str().unwrap()).unwrap();
        assert_eq!(bc_tests::pid_of(machine), pids[machines.iter().position(|m| std::ptr::eq(m, machine)).unwrap()], "node {i}");
    }
    assert_eq!(served_bad.served(), 1, "only the canary fetched C");
    // The canary is back on B, through its watchdog.
    let canary_machine = fleet.machine(&canary["nodeId"]);
    let status = wait_until("the canary is back on B", Duration::from_secs(30), || {
        canary_machine.status().filter(|s| s["agentVersion"] == "9.0.0" && s["session"] == "live")
    });
    assert_eq!(status["agentVersion"], "9.0.0");
    assert_eq!(std::fs::read_link(canary_machine.data().join("bin/bcd")).unwrap(), canary_machine.data().join("slots/b/bcd"));

    // An operator ends it; nothing was updated, so nothing rolls back.
    let (code, out, err) = server.cli(&["rollouts", "abort", &ro_c, "--reason", "C exits at start", "--format", "json"]);
    assert_eq!(code, 0, "rollouts abort: {out} {err}");
    let ended = wait_for("the rollout is aborted", Duration::from_secs(30), || async {
        let doc = rollout(server, &ro_c).await;
        (doc["state"] == "aborted").then_some(doc)
    })
    .await;
    assert_eq!(ended["reason"], "C exits at start");
    // Every decision is an event.
    let (status, page) = server.call("events.list", json!({ "types": ["rollout.*"], "limit": 200 })).await;
    assert_eq!(status, 200, "{page}");
    let types: Vec<&str> = page["items"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap()).collect();
    for t in [
        "rollout.created",
        "rollout.node_updating",
        "rollout.node_updated",
        "rollout.wave_passed",
        "rollout.completed",
        "rollout.node_failed",
        "rollout.paused",
        "rollout.aborting",
        "rollout.aborted",
    ] {
        assert!(types.contains(&t), "{t} missing from {types:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_rollout_rolls_its_updated_nodes_back_one_at_a_time() {
    let fleet = Fleet::start(2).await;
    let (server, dir, version_a) = (&fleet.server, fleet.dir(), fleet.version_a.as_str());
    let (artifact_b, bytes_b, _) = artifact_b(dir);
    // The canary's download is answered; the second node's is held until the abort is in, so
    // the abort lands while that node's update is under way, by what the test sees.
    let served_b = ImageServer::gated("bcd-b", bytes_b, 1);
    let (code, b, err) = release(server, &fleet.key, dir, "9.0.0", &artifact_b, &served_b.url);
    assert_eq!(code, 0, "releases register: {err}");
    let (status, created) = server
        .call(
            "rollouts.create",
            json!({
                "releaseId": b["releaseId"],
                "poolId": fleet.pool,
                "waves": ["1", "100%"],
                "maxUnavailable": 1,
                "minReadyS": 3,
                "nodeDeadlineS": 90,
            }),
        )
        .await;
    assert_eq!(status, 200, "{created}");
    let ro = created["rolloutId"].as_str().unwrap().to_owned();

    // The canary passed its gate; the second node is being updated: its download of B is
    // held at the server.
    let in_flight = wait_for("the second wave's node in flight", Duration::from_secs(120), || async {
        let doc = rollout(server, &ro).await;
        assert_eq!(doc["state"], "running", "{doc}\n{}", fleet.logs());
        (doc["wave"] == 1
            && doc["nodes"][0]["state"] == "updated"
            && doc["nodes"][1]["state"] == "updating"
            && served_b.arrived() == 2)
            .then_some(doc)
    })
    .await;
    let nodes: Vec<Value> = in_flight["nodes"].as_array().unwrap().iter().map(|n| n["nodeId"].clone()).collect();
    let (code, out, err) = server.cli(&["rollouts", "abort", &ro, "--reason", "B is not wanted", "--format", "json"]);
    assert_eq!(code, 0, "rollouts abort: {out} {err}");
    assert_eq!(json(&out)["state"], "aborting", "{out}");
    assert_eq!(served_b.served(), 1, "the abort is in while the second node's download is held");
    served_b.open();

    let ended = wait_for("the rollout is aborted", Duration::from_secs(180), || async {
        let doc = rollout(server, &ro).await;
        (doc["state"] == "aborted").then_some(doc)
    })
    .await;
    assert_eq!(ended["reason"], "B is not wanted", "{ended}");
    for n in ended["nodes"].as_array().unwrap() {
        assert_eq!(n["state"], "rolled-back", "{ended}\n{}", fleet.logs());
        assert_eq!(n["fromVersion"], version_a, "{ended}");
        // The rollback's command: agent.rollback to A, confirmed by the agent of slot a.
        let (status, command) = server.call("commands.get", json!({ "commandId": n["commandId"] })).await;
        assert_eq!(status, 200, "{command}");
        assert_eq!(command["kind"], "agent.rollback", "{command}");
        assert_eq!(command["args"], json!({ "toVersion": version_a, "rolloutId": ro }), "{command}");
        assert_eq!(command["state"], "succeeded", "{command}");
        assert_eq!(command["result"], json!({ "version": version_a, "slot": "a" }), "{command}");
    }
    // Every node is back on A, from slot a.
    for node in &nodes {
        let machine = fleet.machine(node);
        let status = wait_until("A is live again", Duration::from_secs(30), || {
            machine.status().filter(|s| s["agentVersion"] == version_a && s["session"] == "live")
        });
        assert_eq!(status["agentVersion"], version_a);
        assert_eq!(std::fs::read_link(machine.data().join("bin/bcd")).unwrap(), machine.data().join("slots/a/bcd"));
        let (_, doc) = server.call("nodes.get", json!({ "nodeId": node })).await;
        assert_eq!(
            (doc["agent"]["agentVersion"].as_str(), doc["agent"]["agentSlot"].as_str()),
            (Some(version_a), Some("a")),
            "{doc}"
        );
    }
    assert_eq!(served_b.served(), 2, "both nodes took B before going back");

    // The log: the node in flight finished its update after the abort, then the rollbacks went
    // one at a time (maxUnavailable 1): each rolled back before the next was sent its command.
    let (status, page) = server.call("events.list", json!({ "types": ["rollout.*"], "limit": 200 })).await;
    assert_eq!(status, 200, "{page}");
    let seen: Vec<(String, String)> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["type"].as_str().unwrap().to_owned(), e["payload"]["nodeId"].as_str().unwrap_or("").to_owned()))
        .collect();
    let at = |t: &str, node: &Value| {
        seen.iter()
            .position(|(st, sn)| st == t && sn == node.as_str().unwrap())
            .unwrap_or_else(|| panic!("no {t} of {node} in {seen:?}"))
    };
    let aborting = seen.iter().position(|(t, _)| t == "rollout.aborting").expect("rollout.aborting");
    assert!(at("rollout.node_updated", &nodes[1]) > aborting, "the node in flight finished after the abort: {seen:?}");
    let mut rollbacks: Vec<(usize, usize)> =
        nodes.iter().map(|n| (at("rollout.node_rolling_back", n), at("rollout.node_rolled_back", n))).collect();
    rollbacks.sort();
    assert!(rollbacks[0].0 > at("rollout.node_updated", &nodes[1]), "{seen:?}");
    assert!(rollbacks[0].1 < rollbacks[1].0, "one at a time: {seen:?}");
    assert!(seen.iter().position(|(t, _)| t == "rollout.aborted").unwrap() > rollbacks[1].1, "{seen:?}");
}
