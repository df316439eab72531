//! `agent.update` end to end with real processes: `better-compute dev` trusting two release keys
//! made by `releases keygen`, a fakehw `bcd node` with `[update]` pinning the first, releases made
//! by `releases sign`, registered by `releases register` and served on loopback. A release that
//! is not registered is refused by `commands.issue` itself (`release-unregistered`, or the code
//! `releases.register` gives a key it does not trust). Refused releases (a tampered artifact, a key the node does not pin, a
//! downgrade) fail their command with the reason's code and touch nothing; a release whose
//! binary exits at start is rolled back by the watchdog (the agent back on slot a, version A,
//! the command failed `rolled-back: …`); a good release B (the same binary with the fakehw
//! version trailer) is re-executed from slot b in the same process, reports B in its status and
//! its start, and its command succeeds once it confirmed its health. `agent.rollback` by hand:
//! refused when the previous slot does not hold the version; a previous binary that no longer
//! starts is rolled back by the watchdog (back on B); else back on slot a, confirmed; then
//! `already`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bc_tests::{AgentNode, ImageServer, Server, json, wait_until};
use serde_json::{Value, json};

async fn wait_command_done(server: &Server, command: &str, timeout: Duration) -> Value {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let (status, doc) = server.call("commands.get", json!({ "commandId": command })).await;
        assert_eq!(status, 200, "{doc}");
        if doc["state"] == "succeeded" || doc["state"] == "failed" {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "command {command} not done after {timeout:?}: {doc}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn issue_update(server: &Server, node: &str, manifest: &Path) -> String {
    let text = |p: &Path| std::fs::read_to_string(p).unwrap();
    let mut signature = manifest.as_os_str().to_owned();
    signature.push(".sig");
    let args = json!({ "manifest": text(manifest), "signature": text(Path::new(&signature)) });
    let (status, issued) = server.call("commands.issue", json!({ "nodeId": node, "kind": "agent.update", "args": args })).await;
    assert_eq!(status, 200, "{issued}");
    issued["commandId"].as_str().unwrap().to_owned()
}

async fn issue(server: &Server, node: &str, kind: &str, args: Value) -> (u16, Value) {
    server.call("commands.issue", json!({ "nodeId": node, "kind": kind, "args": args })).await
}

/// `agent.rollback` to `to`, issued (with its default deadline) and waited for.
async fn rollback(server: &Server, node: &str, to: &str) -> Value {
    let (status, issued) = issue(server, node, "agent.rollback", json!({ "toVersion": to })).await;
    assert_eq!(status, 200, "{issued}");
    let deadline_s = (issued["deadlineAtMs"].as_u64().unwrap() - issued["issuedAtMs"].as_u64().unwrap()).div_ceil(1000);
    assert_eq!(deadline_s, 600, "agent.rollback's default deadline: {issued}");
    wait_command_done(server, issued["commandId"].as_str().unwrap(), Duration::from_secs(60)).await
}

/// `releases sign` into `dir/NAME.json` (and `.sig`): version `version` of the file `artifact`
/// served at `url`, then `releases register`.
fn sign(server: &Server, key: &Path, dir: &Path, name: &str, version: &str, artifact: &Path, url: &str) -> PathBuf {
    let out = sign_only(server, key, dir, name, version, artifact, url);
    let (code, stdout, err) = server.cli(&["releases", "register", "--manifest", &out.display().to_string()]);
    assert_eq!(code, 0, "releases register: {stdout} {err}");
    out
}

/// [`sign`] without registering.
fn sign_only(server: &Server, key: &Path, dir: &Path, name: &str, version: &str, artifact: &Path, url: &str) -> PathBuf {
    let out = dir.join(format!("{name}.json"));
    let item = format!("{}={}={url}", std::env::consts::ARCH, artifact.display());
    let (code, stdout, err) = server.cli(&[
        "releases",
        "sign",
        "--key",
        &key.display().to_string(),
        "--version",
        version,
        "--artifact",
        &item,
        "--out",
        &out.display().to_string(),
        "--format",
        "json",
    ]);
    assert_eq!(code, 0, "releases sign: {stdout} {err}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_are_refused_rolled_back_or_taken_from_the_new_slot() {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path();

    // Two release keys, both trusted by the control plane: the node pins the first.
    let key = dir.join("release.key");
    let (code, out, err) = bc_tests::cli(&["releases", "keygen", "--out", &key.display().to_string(), "--format", "json"], &[]);
    assert_eq!(code, 0, "releases keygen: {err}");
    let made = json(&out);
    let pinned = std::fs::read_to_string(dir.join("release.key.pub")).unwrap().trim().to_owned();
    assert_eq!(made["publicKey"], pinned.as_str());
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(std::fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
    let (code, _, err) = bc_tests::cli(&["releases", "keygen", "--out", &key.display().to_string()], &[]);
    assert_ne!(code, 0, "never over a key: {err}");
    let other_key = dir.join("other.key");
    assert_eq!(bc_tests::cli(&["releases", "keygen", "--out", &other_key.display().to_string()], &[]).0, 0);
    let untrusted_key = dir.join("untrusted.key");
    assert_eq!(bc_tests::cli(&["releases", "keygen", "--out", &untrusted_key.display().to_string()], &[]).0, 0);
    let (server, port) = bc_tests::agents_gateway_with(&[
        "--release-key",
        &dir.join("release.key.pub").display().to_string(),
        "--release-key",
        &dir.join("other.key.pub").display().to_string(),
    ]);
    let pool = server.pool("gpu-a").await;

    // Version A, and release B: the same binary with the fakehw version trailer.
    let (code, version_a, _) = bc_tests::bcd(&["version"], &[], None);
    assert_eq!(code, 0);
    let version_a = version_a.trim().strip_prefix("bcd ").unwrap().to_owned();
    let mut bytes_b = std::fs::read(bc_tests::binary("bcd")).unwrap();
    bytes_b.extend_from_slice(b"\nbcd-fakehw-version=9.0.0\n");
    let artifact_b = dir.join("bcd-b");
    std::fs::write(&artifact_b, &bytes_b).unwrap();
    let served_b = ImageServer::start("bcd-b", bytes_b.clone());

    let mut machine = AgentNode::new(&server, port);
    machine.trust_release_key(&pinned);
    machine.join_pool(&server, &pool).await;
    let node = machine.node_id();
    machine.start();
    let _guard = bc_tests::PidGuard(machine.data().join("bcd.pid"));
    wait_until("the agent is live", Duration::from_secs(20), || machine.status().filter(|s| s["session"] == "live"));
    let entrypoint = machine.data().join("bin/bcd");
    let slot = |s: &str| machine.data().join("slots").join(s).join("bcd");
    assert_eq!(std::fs::read_link(&entrypoint).unwrap(), slot("a"), "the running bcd is adopted as slot a");
    let first_pid = bc_tests::pid_of(&machine);

    // `releases verify`: the pinned key verifies B, the other key does not.
    let manifest_b = sign(&server, &key, dir, "b", "9.0.0", &artifact_b, &served_b.url);
    let (code, out, err) = server.cli(&[
        "releases",
        "verify",
        "--manifest",
        &manifest_b.display().to_string(),
        "--key",
        &dir.join("release.key.pub").display().to_string(),
    ]);
    assert_eq!(code, 0, "releases verify: {out} {err}");
    let (code, _, err) = server.cli(&[
        "releases",
        "verify",
        "--manifest",
        &manifest_b.display().to_string(),
        "--key",
        &dir.join("other.key.pub").display().to_string(),
    ]);
    assert_eq!(code, 1);
    assert!(err.starts_with("release-untrusted-key: "), "{err}");

    // (c) Refused: each fails with its code, and nothing changes.
    let tampered = {
        let mut bytes = bytes_b.clone();
        let last = bytes.len() - 40;
        bytes[last] ^= 0xff;
        ImageServer::start("bcd-tampered", bytes)
    };
    // Regression: commands.issue sent any manifest; now only a registered one, still under a key
    // the control plane trusts. Neither reaches the node.
    let text = |p: &Path| std::fs::read_to_string(p).unwrap();
    let with_sig = |p: &Path| {
        let mut s = p.as_os_str().to_owned();
        s.push(".sig");
        PathBuf::from(s)
    };
    let unregistered = sign_only(&server, &key, dir, "unregistered", "9.9.9", &artifact_b, &served_b.url);
    let untrusted = sign_only(&server, &untrusted_key, dir, "untrusted", "9.9.8", &artifact_b, &served_b.url);
    for (manifest, status, code) in [(&unregistered, 409, "release-unregistered: "), (&untrusted, 403, "release-untrusted-key: ")]
    {
        let args = json!({ "manifest": text(manifest), "signature": text(&with_sig(manifest)) });
        let (got, body) = issue(&server, &node, "agent.update", args).await;
        assert_eq!(got, status, "{body}");
        assert!(body["message"].as_str().unwrap_or_default().starts_with(code), "{body}");
    }
    let refusals = [
        ("tampered", sign(&server, &key, dir, "tampered", "9.0.1", &artifact_b, &tampered.url), "artifact-digest: "),
        (
            "other-key",
            sign(&server, &other_key, dir, "other-key", "9.0.2", &artifact_b, &served_b.url),
            "release-untrusted-key: ",
        ),
        ("downgrade", sign(&server, &key, dir, "downgrade", "0.0.1", &artifact_b, &served_b.url), "release-downgrade: "),
    ];
    for (what, manifest, code) in refusals {
        let command = issue_update(&server, &node, &manifest).await;
        let done = wait_command_done(&server, &command, Duration::from_secs(60)).await;
        assert_eq!(done["state"], "failed", "{what}: {done}");
        let reason = done["reason"].as_str().unwrap_or_default();
        assert!(reason.starts_with(code), "{what}: {done}");
    }
    assert_eq!(served_b.served(), 0, "a refused signature or version fetches nothing");
    assert_eq!(std::fs::read_link(&entrypoint).unwrap(), slot("a"));
    assert!(!slot("b").exists(), "a tampered artifact is never put in a slot");
    assert_eq!(bc_tests::pid_of(&machine), first_pid);

    // (b) A bad release: its binary exits at start. The watchdog puts A back.
    let bad = dir.join("bcd-bad");
    std::fs::write(&bad, b"#!/bin/sh\nexit 1\n").unwrap();
    let served_bad = ImageServer::start("bcd-bad", std::fs::read(&bad).unwrap());
    let manifest_bad = sign(&server, &key, dir, "bad", "8.0.0", &bad, &served_bad.url);
    let command = issue_update(&server, &node, &manifest_bad).await;
    let done = wait_command_done(&server, &command, Duration::from_secs(90)).await;
    assert_eq!(done["state"], "failed", "{done}");
    let reason = done["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with(&format!(
            "rolled-back: the agent 8.0.0 did not confirm health within 20 s; back on slot a (version {version_a})"
        )),
        "{done}\n{}",
        machine.node_log()
    );
    assert_eq!(std::fs::read_link(&entrypoint).unwrap(), slot("a"));
    let status = wait_until("the old agent is live again", Duration::from_secs(30), || {
        machine.status().filter(|s| s["session"] == "live")
    });
    assert_eq!(status["agentVersion"], version_a.as_str());
    let rolled_back_pid = bc_tests::pid_of(&machine);
    assert_ne!(rolled_back_pid, first_pid, "the watchdog started the old agent");
    let state: Value = serde_json::from_slice(&std::fs::read(machine.data().join("slots/state.json")).unwrap()).unwrap();
    assert_eq!(state["active"], "a");
    assert!(state["lastRollback"]["reason"].as_str().unwrap().starts_with("rolled-back: "), "{state}");

    // (a) Release B: fetched into slot b, switched, re-executed in the same process, confirmed.
    let command = issue_update(&server, &node, &manifest_b).await;
    let done = wait_command_done(&server, &command, Duration::from_secs(90)).await;
    assert_eq!(done["state"], "succeeded", "{done}\n{}", machine.node_log());
    assert_eq!(done["result"], json!({ "version": "9.0.0", "slot": "b" }));
    assert_eq!(served_b.served(), 1);
    assert_eq!(std::fs::read_link(&entrypoint).unwrap(), slot("b"));
    assert_eq!(std::fs::read(slot("b")).unwrap(), bytes_b);
    let status = wait_until("B is live", Duration::from_secs(30), || machine.status().filter(|s| s["agentVersion"] == "9.0.0"));
    assert_eq!(status["session"], "live");
    assert_eq!(bc_tests::pid_of(&machine), rolled_back_pid, "re-executed in place");

    // Every start is in the log: A, the A after the rollback, and B from slot b.
    let (status, page) = server.call("events.list", json!({ "types": ["node.agent_started"], "limit": 100 })).await;
    assert_eq!(status, 200, "{page}");
    let starts: Vec<(String, String, Option<String>)> = page["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let p = &e["payload"];
            (
                p["version"].as_str().unwrap().to_owned(),
                p["slot"].as_str().unwrap().to_owned(),
                p["previousVersion"].as_str().map(str::to_owned),
            )
        })
        .collect();
    // (The bad release never started `bcd node`: the A after the rollback follows A.)
    let a = || (version_a.clone(), "a".to_owned());
    assert_eq!(
        starts,
        vec![
            (a().0, a().1, None),
            (a().0, a().1, Some(version_a.clone())),
            ("9.0.0".into(), "b".into(), Some(version_a.clone()))
        ],
    );

    // A second B is the same version: succeeded at once, already.
    let command = issue_update(&server, &node, &manifest_b).await;
    let done = wait_command_done(&server, &command, Duration::from_secs(30)).await;
    assert_eq!((done["state"].as_str(), done["result"]["already"].as_bool()), (Some("succeeded"), Some(true)), "{done}");

    // By hand (`bcd update`, over the running agent's socket): the same checks.
    let by_hand = |manifest: &Path| {
        machine.bcd(&["update", "--config", &machine.config(), "--manifest", &manifest.display().to_string()], &[], None)
    };
    let (code, out, err) = by_hand(&manifest_b);
    assert_eq!((code, out.trim()), (0, "bcd 9.0.0 runs already"), "{err}");
    let (code, _, err) = by_hand(&dir.join("downgrade.json"));
    assert_eq!(code, 1);
    assert!(err.starts_with("bcd update: release-downgrade: "), "{err}");

    // `agent.rollback` by hand: its arguments are checked at the edge (and `agent.update`'s
    // rolloutId is a rollout id); the previous slot must hold the version asked for.
    let issue = |kind: &'static str, args: Value| issue(&server, &node, kind, args);
    for args in [json!({ "toVersion": "nine" }), json!({}), json!({ "toVersion": version_a, "rolloutId": "ro_1" })] {
        let (status, body) = issue("agent.rollback", args.clone()).await;
        assert_eq!(status, 400, "{args}: {body}");
    }
    let (status, body) = issue(
        "agent.update",
        json!({ "manifest": text(&manifest_b), "signature": text(&dir.join("b.json.sig")), "rolloutId": "ro_nope" }),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    let done = rollback(&server, &node, "7.7.7").await;
    assert_eq!(done["state"], "failed", "{done}");
    assert_eq!(
        done["reason"].as_str().unwrap(),
        format!("rollback-unavailable: the previous slot holds {version_a}, not 7.7.7 (slot a)"),
        "{done}"
    );
    assert_eq!(bc_tests::pid_of(&machine), rolled_back_pid, "nothing moved");
    // A previous binary that no longer starts: the watchdog puts B back, the command fails.
    let binary_a = std::fs::read(slot("a")).unwrap();
    std::fs::write(slot("a"), b"#!/bin/sh\nexit 1\n").unwrap();
    let done = rollback(&server, &node, &version_a).await;
    assert_eq!(done["state"], "failed", "{done}");
    assert_eq!(
        done["reason"].as_str().unwrap(),
        format!("rolled-back: the agent {version_a} did not confirm health within 20 s; back on slot b (version 9.0.0)"),
        "{done}\n{}",
        machine.node_log()
    );
    assert_eq!(std::fs::read_link(&entrypoint).unwrap(), slot("b"));
    wait_until("B is live again", Duration::from_secs(30), || {
        machine.status().filter(|s| s["agentVersion"] == "9.0.0" && s["session"] == "live")
    });
    let b_pid = bc_tests::pid_of(&machine);
    std::fs::write(slot("a"), &binary_a).unwrap();
    std::fs::set_permissions(slot("a"), std::fs::Permissions::from_mode(0o755)).unwrap();
    // Back to A: slot a again, re-executed in place, confirmed by the agent of slot a.
    let done = rollback(&server, &node, &version_a).await;
    assert_eq!(done["state"], "succeeded", "{done}\n{}", machine.node_log());
    assert_eq!(done["result"], json!({ "version": version_a, "slot": "a" }));
    assert_eq!(std::fs::read_link(&entrypoint).unwrap(), slot("a"));
    let status = wait_until("A is live", Duration::from_secs(30), || {
        machine.status().filter(|s| s["agentVersion"] == version_a.as_str() && s["session"] == "live")
    });
    assert_eq!(status["agentVersion"], version_a.as_str());
    assert_eq!(bc_tests::pid_of(&machine), b_pid, "re-executed in place");
    let state: Value = serde_json::from_slice(&std::fs::read(machine.data().join("slots/state.json")).unwrap()).unwrap();
    assert_eq!((state["active"].as_str(), state["previous"].as_str()), (Some("a"), Some("b")), "{state}");
    assert_eq!(state["versions"], json!({ "a": version_a, "b": "9.0.0" }), "{state}");
    // Again: it runs A already.
    let done = rollback(&server, &node, &version_a).await;
    assert_eq!((done["state"].as_str(), done["result"]["already"].as_bool()), (Some("succeeded"), Some(true)), "{done}");
}
