//! Destructive batches under a quorum, end to end (`docs/batches.md`): the real `dev`, two
//! joined fake-hardware `bcd` nodes, three approver keys made by `batch keygen`, quorum 2.
//! A batch of `ping`s is held (`awaitingApproval`, no command exists for any node) after one
//! approval and runs after two; `batch members` shows each command's state. An approval of
//! another batch, by a key outside the set, a reused one, and one of a batch made under the
//! previous approver set are each refused with their code; the CLI's review refusals
//! (`SCOPE_CHANGED`, `SCOPE_UNEXPECTED`, `SCOPE_MISMATCH`, `INVALID_STATE`) sign nothing. One
//! approval is verified by `openssl dgst -sha256 -verify`, from the documented message format.
//! A proxy that lies about the scope (one leaf, the root, a page that does not advance) gets no
//! signature: `SCOPE_MISMATCH` or `INVALID_RESPONSE`.
//! Under the quorum (`dev --approvers`), `nodes delete`, the root tenant's release of another
//! tenant's reservation and a rollout to two nodes, each refused alone, go through batches
//! (`--batch-reason`): nothing after one approval, done after two.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use bc_tests::{AgentNode, Server, json};
use serde_json::{Value, json};

fn ok(server: &Server, args: &[&str]) -> Value {
    let (code, out, err) = server.cli(args);
    assert_eq!(code, 0, "better-compute {args:?}: {out}\n{err}");
    json(&out)
}

/// `batch publish-approvers` of the epoch-1 set: `publics` (the approvers' `.pub` files) under
/// `quorum`, in the trust domain `compute.test`; the published set.
fn publish_epoch_1(server: &Server, quorum: u32, publics: &[String]) -> Value {
    let quorum = quorum.to_string();
    let mut args = vec!["batch", "publish-approvers", "--epoch", "1", "--quorum", &quorum, "--trust-domain", "compute.test"];
    for public in publics {
        args.extend(["--approver", public.as_str()]);
    }
    ok(server, &args)
}

/// Runs the CLI expecting a refusal with `code` (exit 1) on stderr.
fn refused(server: &Server, args: &[&str], code: &str) -> String {
    let (status, out, err) = server.cli(args);
    assert_eq!(status, 1, "better-compute {args:?} should fail with {code}: {out}\n{err}");
    assert!(err.contains(&format!("{code}:")), "better-compute {args:?}: expected {code}: {err}");
    err
}

fn path_text(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Two machines joined to `pool`, their `bcd node` started.
async fn two_live_machines(server: &Server, port: u16, pool: &str) -> Vec<AgentNode> {
    let mut machines = Vec::new();
    for _ in 0..2 {
        let mut machine = AgentNode::new(server, port);
        machine.join_pool(server, pool).await;
        machine.start();
        machines.push(machine);
    }
    machines
}

async fn wait_ready(server: &Server, node: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, doc) = server.call("nodes.get", json!({ "nodeId": node })).await;
        assert_eq!(status, 200, "{doc}");
        if doc["state"] == "ready" {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "node {node} not ready: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn commands_of(server: &Server, node: &str) -> Vec<Value> {
    let (status, page) = server.call("commands.list", json!({ "nodeId": node })).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().clone()
}

fn create_batch(server: &Server, dir: &Path, name: &str, leaves: &Value) -> String {
    let scope = dir.join(format!("{name}.json"));
    std::fs::write(&scope, leaves.to_string()).unwrap();
    let created = ok(server, &["batch", "create", "--reason", &format!("{name}: ping the rack"), "--scope", path_text(&scope)]);
    assert_eq!(created["state"], "pending", "{created}");
    created["batchId"].as_str().unwrap().to_owned()
}

/// `batch show --scope-out` then `batch sign --yes` with `key`: the signature file's path.
fn sign_offline(server: &Server, dir: &Path, batch: &str, key: &Path, name: &str) -> PathBuf {
    let scope = dir.join(format!("{name}.scope.json"));
    ok(server, &["batch", "show", "--batch", batch, "--scope-out", path_text(&scope)]);
    let signed = ok(server, &["batch", "sign", "--key", path_text(key), "--scope", path_text(&scope), "--yes"]);
    let path = dir.join(format!("{name}.sig.json"));
    std::fs::write(&path, signed.to_string()).unwrap();
    path
}

/// Restarts `machine` pinning `root` as its `command_root_sha256` (a top-level key, so before
/// the configuration's tables).
fn pin_command_root(machine: &mut AgentNode, root: &str) {
    assert_eq!(root.len(), 64, "{root}");
    machine.kill9();
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("command_root_sha256 = {root:?}\n{config}")).unwrap();
    machine.start();
}

fn signature_of(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_runs_only_after_its_quorum_and_every_bad_approval_is_refused_with_its_code() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("rack").await;
    let mut machines = two_live_machines(&server, port, &pool).await;
    let nodes: Vec<String> = machines.iter().map(AgentNode::node_id).collect();
    for node in &nodes {
        wait_ready(&server, node).await;
    }

    // Three approver keys (0600, never over a file) and one outside the set.
    let dir = tempfile::tempdir().unwrap();
    let key = |name: &str| dir.path().join(format!("{name}.pem"));
    let mut kids = Vec::new();
    for name in ["a", "b", "c", "outsider"] {
        let made = ok(&server, &["batch", "keygen", "--out", path_text(&key(name))]);
        assert!(made["kid"].as_str().unwrap().starts_with("ak_"), "{made}");
        assert_eq!(std::fs::metadata(key(name)).unwrap().permissions().mode() & 0o777, 0o600);
        kids.push(made["kid"].as_str().unwrap().to_owned());
    }
    refused(&server, &["batch", "keygen", "--out", path_text(&key("a"))], "ALREADY_EXISTS");
    let public = |name: &str| format!("{}.pub", key(name).display());

    // Epoch 1: the root admin publishes a, b, c with quorum 2.
    let set = publish_epoch_1(&server, 2, &[public("a"), public("b"), public("c")]);
    assert_eq!((set["epoch"].as_u64(), set["quorum"].as_u64()), (Some(1), Some(2)), "{set}");
    // The first node pins the set's root: the released pings below run there only because their
    // releases verify on the node itself.
    pin_command_root(&mut machines[0], set["commandRootSha256"].as_str().unwrap());
    wait_ready(&server, &nodes[0]).await;

    // A batch of three pings over the two nodes.
    let leaves = json!([
        { "subject": nodes[0], "kind": "ping", "payload": {} },
        { "subject": nodes[1], "kind": "ping", "payload": {} },
        { "subject": nodes[0], "kind": "ping", "payload": {} },
    ]);
    let batch = create_batch(&server, dir.path(), "first", &leaves);
    let members = ok(&server, &["batch", "members", "--batch", &batch]);
    let states: Vec<&str> = members["items"].as_array().unwrap().iter().map(|m| m["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["awaitingApproval"; 3], "{members}");

    // The review: without --yes only the summary; a root that is not the batch's, an --expect that
    // is not what it holds, a key file others may read: each refused, nothing signed.
    let (code, _, summary) = server.cli(&["batch", "approve", "--batch", &batch, "--key", path_text(&key("a"))]);
    assert_eq!(code, 0, "{summary}");
    assert!(summary.contains("3 command(s) on 2 subject(s): ping ×3") && summary.contains("Not approved"), "{summary}");
    refused(
        &server,
        &["batch", "approve", "--batch", &batch, "--key", path_text(&key("a")), "--root", &"0".repeat(64)],
        "SCOPE_CHANGED",
    );
    let expect = dir.path().join("expect.txt");
    std::fs::write(&expect, format!("{}\n{}\n", nodes[0], nodes[1])).unwrap();
    let err = refused(
        &server,
        &["batch", "approve", "--batch", &batch, "--key", path_text(&key("a")), "--expect", path_text(&expect)],
        "SCOPE_UNEXPECTED",
    );
    assert!(err.contains(&format!("unexpected {}", nodes[0])), "{err}");
    std::fs::set_permissions(key("a"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = refused(&server, &["batch", "approve", "--batch", &batch, "--key", path_text(&key("a")), "--yes"], "INVALID_STATE");
    assert!(err.contains("readable by others"), "{err}");
    std::fs::set_permissions(key("a"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let shown = ok(&server, &["batch", "show", "--batch", &batch]);
    assert_eq!(shown["approvals"], 0, "nothing was signed: {shown}");

    // One approval (a, with the exact subjects expected): still held; no node has a command.
    std::fs::write(&expect, format!("{}\n{}\n{}\n", nodes[0], nodes[1], nodes[0])).unwrap();
    let approved =
        ok(&server, &["batch", "approve", "--batch", &batch, "--key", path_text(&key("a")), "--expect", path_text(&expect)]);
    assert_eq!((approved["state"].as_str(), approved["approvals"].as_array().unwrap().len()), (Some("pending"), 1), "{approved}");
    for node in &nodes {
        assert!(commands_of(&server, node).await.is_empty(), "a held command reached {node}");
    }
    let members = ok(&server, &["batch", "members", "--batch", &batch]);
    assert!(members["items"].as_array().unwrap().iter().all(|m| m["state"] == "awaitingApproval"), "{members}");

    // A reused signature: a's own approval again.
    let reused = approved["approvals"][0]["signature"].as_str().unwrap();
    let (status, answer) =
        server.call("commandBatches.approve", json!({ "batchId": batch, "kid": kids[0], "signature": reused })).await;
    assert_eq!((status, answer["code"].as_str()), (409, Some("ALREADY_EXISTS")), "{answer}");

    // An approval of another batch: b signs a second batch offline; its signature is refused on
    // the first by the server (INVALID_ARGUMENT) and by the CLI (SCOPE_MISMATCH).
    let second = create_batch(&server, dir.path(), "second", &json!([{ "subject": nodes[1], "kind": "ping", "payload": {} }]));
    let second_signed = sign_offline(&server, dir.path(), &second, &key("b"), "second-b");
    let signature = signature_of(&second_signed);
    let (status, answer) = server
        .call("commandBatches.approve", json!({ "batchId": batch, "kid": kids[1], "signature": signature["signature"] }))
        .await;
    assert_eq!((status, answer["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{answer}");
    refused(&server, &["batch", "approve", "--batch", &batch, "--signature", path_text(&second_signed)], "SCOPE_MISMATCH");

    // A key outside the set.
    let outsider = sign_offline(&server, dir.path(), &batch, &key("outsider"), "first-outsider");
    let (status, answer) = server
        .call(
            "commandBatches.approve",
            json!({ "batchId": batch, "kid": kids[3], "signature": signature_of(&outsider)["signature"] }),
        )
        .await;
    assert_eq!((status, answer["code"].as_str()), (403, Some("ACCESS_DENIED")), "{answer}");

    // A window the offline reviewer judges closed is refused before anything is signed.
    let scope = dir.path().join("first-outsider.scope.json");
    let err = refused(
        &server,
        &["batch", "sign", "--key", path_text(&key("b")), "--scope", path_text(&scope), "--yes", "--now-ms", "99999999999999"],
        "INVALID_STATE",
    );
    assert!(err.contains("window has closed"), "{err}");

    // An encrypted key: written under the passphrase, refused without it (MISSING_ENV) or with
    // another (exit 2), and signing with it.
    let encrypted = dir.path().join("encrypted.pem");
    let passphrase = [("BETTER_COMPUTE_APPROVER_PASSPHRASE", "correct horse battery")];
    let (code, out, err) = bc_tests::cli(&["batch", "keygen", "--out", path_text(&encrypted)], &passphrase);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(json(&out)["encrypted"], true, "{out}");
    assert!(std::fs::read_to_string(&encrypted).unwrap().contains("BEGIN ENCRYPTED PRIVATE KEY"));
    let sign_encrypted = ["batch", "sign", "--key", path_text(&encrypted), "--scope", path_text(&scope), "--yes"];
    let (code, _, err) = bc_tests::cli(&sign_encrypted, &[]);
    assert!(code == 1 && err.contains("MISSING_ENV:"), "{err}");
    let (code, _, err) = bc_tests::cli(&sign_encrypted, &[("BETTER_COMPUTE_APPROVER_PASSPHRASE", "wrong")]);
    assert_eq!(code, 2, "{err}");
    let (code, out, err) = bc_tests::cli(&sign_encrypted, &passphrase);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["batchId"].as_str(), Some(batch.as_str()), "{out}");

    // A verifier this project did not write: openssl, from the documented message format.
    let message = format!(
        "better-compute batch approval v1\ntrust-domain {}\nbatch {}\nroot {}\nsize {}\nexpires-at-ms {}\n",
        signature["trustDomain"].as_str().unwrap(),
        second,
        signature["root"].as_str().unwrap(),
        signature["size"],
        signature["expiresAtMs"],
    );
    let message_path = dir.path().join("message.txt");
    std::fs::write(&message_path, &message).unwrap();
    let der = base64::engine::general_purpose::STANDARD.decode(signature["signature"].as_str().unwrap()).unwrap();
    let der_path = dir.path().join("signature.der");
    std::fs::write(&der_path, der).unwrap();
    let openssl = |message: &Path| {
        std::process::Command::new("openssl")
            .args(["dgst", "-sha256", "-verify", &public("b"), "-signature", path_text(&der_path), path_text(message)])
            .output()
            .expect("openssl")
    };
    let verified = openssl(&message_path);
    assert!(verified.status.success(), "openssl: {}", String::from_utf8_lossy(&verified.stderr));
    assert!(String::from_utf8_lossy(&verified.stdout).contains("Verified OK"));
    let tampered = dir.path().join("tampered.txt");
    std::fs::write(&tampered, message.replace("size 1\n", "size 2\n")).unwrap();
    assert!(!openssl(&tampered).status.success(), "openssl verified a message with another size");

    // The second approval (c, signed offline, submitted with --signature): released, and every
    // command runs on its node.
    let c_signed = sign_offline(&server, dir.path(), &batch, &key("c"), "first-c");
    let released = ok(&server, &["batch", "approve", "--batch", &batch, "--signature", path_text(&c_signed)]);
    assert_eq!(released["state"], "released", "{released}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let members = ok(&server, &["batch", "members", "--batch", &batch]);
        let states: Vec<&str> = members["items"].as_array().unwrap().iter().map(|m| m["state"].as_str().unwrap()).collect();
        if states == ["succeeded"; 3] {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the released commands did not all succeed: {members}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(commands_of(&server, &nodes[0]).await.len(), 2);
    assert_eq!(commands_of(&server, &nodes[1]).await.len(), 1);
    let (status, answer) = server
        .call("commandBatches.approve", json!({ "batchId": batch, "kid": kids[1], "signature": signature["signature"] }))
        .await;
    assert_eq!((status, answer["code"].as_str()), (409, Some("INVALID_STATE")), "a released batch: {answer}");

    // Cancelled: its command is never issued.
    let cancelled = ok(&server, &["batch", "cancel", "--batch", &second]);
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    let members = ok(&server, &["batch", "members", "--batch", &second]);
    assert_eq!(members["items"][0]["state"], "cancelled", "{members}");

    // Epoch 2 ({b, c, outsider}, quorum 2) with the signatures of a and c of epoch 1; a batch
    // made under epoch 1 is then refused.
    let third = create_batch(&server, dir.path(), "third", &json!([{ "subject": nodes[0], "kind": "ping", "payload": {} }]));
    let third_b = sign_offline(&server, dir.path(), &third, &key("b"), "third-b");
    let mut signatures = Vec::new();
    for name in ["a", "c"] {
        let signed = ok(
            &server,
            &[
                "batch",
                "sign-approvers",
                "--key",
                path_text(&key(name)),
                "--epoch",
                "2",
                "--quorum",
                "2",
                "--trust-domain",
                "compute.test",
                "--approver",
                &public("b"),
                "--approver",
                &public("c"),
                "--approver",
                &public("outsider"),
            ],
        );
        let path = dir.path().join(format!("epoch2-{name}.json"));
        std::fs::write(&path, signed.to_string()).unwrap();
        signatures.push(path);
    }
    let mut publish: Vec<String> =
        ["batch", "publish-approvers", "--epoch", "2", "--quorum", "2", "--trust-domain", "compute.test"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    for name in ["b", "c", "outsider"] {
        publish.extend(["--approver".to_owned(), public(name)]);
    }
    let only_a: Vec<String> =
        publish.iter().cloned().chain(["--signature".to_owned(), path_text(&signatures[0]).to_owned()]).collect();
    refused(&server, &only_a.iter().map(String::as_str).collect::<Vec<_>>(), "INVALID_STATE");
    for path in &signatures {
        publish.extend(["--signature".to_owned(), path_text(path).to_owned()]);
    }
    let set = ok(&server, &publish.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!((set["epoch"].as_u64(), set["signedBy"].as_array().unwrap().len()), (Some(2), 2), "{set}");
    let err = refused(&server, &["batch", "approve", "--batch", &third, "--signature", path_text(&third_b)], "INVALID_STATE");
    assert!(err.contains("epoch 1"), "{err}");

    // Every step is in the log.
    let (status, events) = server.call("events.list", json!({ "limit": 500 })).await;
    assert_eq!(status, 200, "{events}");
    let types: Vec<&str> = events["items"].as_array().unwrap().iter().filter_map(|e| e["type"].as_str()).collect();
    for wanted in ["command_batch.created", "command_batch.approved", "command_batch.released", "command_batch.cancelled"] {
        assert!(types.contains(&wanted), "{wanted} is not in the log: {types:?}");
    }
}

/// A proxy in front of the real server that rewrites `commandBatches.show` answers as `mode`
/// says: `leaf` changes one leaf's subject, `root` the root it reports, `stall` a page that does
/// not advance; anything else passes through.
async fn lying_proxy(upstream: String, mode: std::sync::Arc<std::sync::Mutex<String>>) -> String {
    let client = reqwest::Client::new();
    let app = axum::Router::new().route(
        "/api/compute/{method}",
        axum::routing::post(
            move |axum::extract::Path(method): axum::extract::Path<String>,
                  headers: axum::http::HeaderMap,
                  body: axum::body::Bytes| {
                let (client, upstream, mode) = (client.clone(), upstream.clone(), mode.clone());
                async move {
                    let mut request = client.post(format!("{upstream}/api/compute/{method}")).body(body.to_vec());
                    for name in ["authorization", "content-type"] {
                        if let Some(value) = headers.get(name) {
                            request = request.header(name, value.to_str().unwrap());
                        }
                    }
                    let answer = request.send().await.unwrap();
                    let status = answer.status().as_u16();
                    let mut value: Value = answer.json().await.unwrap();
                    if method == "commandBatches.show" {
                        match mode.lock().unwrap().as_str() {
                            "leaf" => value["leaves"][0]["subject"] = json!("node_01k00000000000000000000000"),
                            "root" => value["batch"]["root"] = json!("00".repeat(32)),
                            "stall" => value["nextOffset"] = json!(0),
                            _ => {}
                        }
                    }
                    (axum::http::StatusCode::from_u16(status).unwrap(), axum::Json(value))
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_lies_about_the_scope_gets_no_signature() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("lies").await;
    let machine = AgentNode::new(&server, port);
    machine.join_pool(&server, &pool).await;
    let node = machine.node_id();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("a.pem");
    ok(&server, &["batch", "keygen", "--out", path_text(&key)]);
    let public = format!("{}.pub", key.display());
    ok(
        &server,
        &["batch", "publish-approvers", "--epoch", "1", "--quorum", "1", "--trust-domain", "lies.test", "--approver", &public],
    );
    let leaves = json!([{ "subject": node, "kind": "ping", "payload": {} }, { "subject": node, "kind": "ping", "payload": {} }]);
    let batch = create_batch(&server, dir.path(), "lied-about", &leaves);

    let mode = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let proxy = lying_proxy(server.url.clone(), mode.clone()).await;
    for (lie, code) in [("leaf", "SCOPE_MISMATCH"), ("root", "SCOPE_MISMATCH"), ("stall", "INVALID_RESPONSE")] {
        *mode.lock().unwrap() = lie.to_owned();
        let args: Vec<String> =
            ["batch", "approve", "--batch", &batch, "--key", path_text(&key), "--yes"].iter().map(|s| s.to_string()).collect();
        let env = [("BETTER_COMPUTE_URL".to_owned(), proxy.clone()), ("BETTER_COMPUTE_TOKEN".to_owned(), server.token.clone())];
        let (status, out, err) = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            bc_tests::cli(&args, &env)
        })
        .await
        .unwrap();
        assert_eq!(status, 1, "a {lie} lie: {out}{err}");
        assert!(err.contains(&format!("{code}:")), "a {lie} lie: {err}");
        let (_, shown) = server.call("commandBatches.show", json!({ "batchId": batch })).await;
        assert_eq!(shown["batch"]["approvals"].as_array().unwrap().len(), 0, "a {lie} lie was signed: {shown}");
    }
    // Told the truth, the same command approves, and quorum 1 releases.
    *mode.lock().unwrap() = String::new();
    let approved = ok(&server, &["batch", "approve", "--batch", &batch, "--key", path_text(&key), "--yes"]);
    assert_eq!(approved["state"], "released", "{approved}");

    // `audit prove` proves the approval and the scope it signed; `check-proof` checks both
    // offline under the log key's pin.
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    let (code, _, err) = bc_tests::cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let pin = bc_tests::log_key_pin(&server);
    let (_, events) = server.call("events.list", json!({ "limit": 500 })).await;
    for (wanted, field, value) in [
        ("command_batch.approved", "kid", approved["approvals"][0]["kid"].clone()),
        ("command_batch.created", "root", approved["root"].clone()),
    ] {
        let event = events["items"].as_array().unwrap().iter().find(|e| e["type"] == wanted).unwrap()["id"].as_str().unwrap();
        let proof = dir.path().join(format!("{wanted}.tlog-proof"));
        let (code, _, err) = bc_tests::cli(&["audit", "prove", event, "--out", path_text(&proof), "--data-dir", &data_dir], &[]);
        assert_eq!(code, 0, "{err}");
        let (code, out, err) = bc_tests::cli(&["audit", "check-proof", path_text(&proof), "--pin", &pin], &[]);
        assert_eq!(code, 0, "{err}");
        let proved = json(&out);
        assert_eq!((proved["type"].as_str(), &proved["payload"][field]), (Some(wanted), &value), "{proved}");
    }
}

/// The approvers' quorum (`dev --approvers`): `nodes.delete` and the root tenant's release of
/// another tenant's reservation are refused `BATCH_REQUIRED` (403, with a hint naming the command
/// that makes the batch)
/// and change nothing; the same calls on a `dev` without the flag go through. The CLI prints the
/// code and the hint and exits 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_quorum_on_a_wide_destructive_call_alone_is_refused_batch_required() {
    for quorum in [true, false] {
        let server = if quorum { Server::dev_with(&["--approvers"]) } else { Server::dev() };
        let tenant = server.tenant("acme").await;
        let pool = server.tenant_pool(&tenant, "rack").await;
        let gpus = vec![json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }); 2];
        let (status, node) =
            server.call("nodes.register", json!({ "tenantId": tenant, "poolId": pool, "name": "n0", "gpus": gpus })).await;
        assert_eq!(status, 200, "{node}");
        let node = node["nodeId"].as_str().unwrap().to_owned();
        let (status, rsv) =
            server.call("reservations.create", json!({ "tenantId": tenant, "poolId": pool, "gpus": 1, "durationS": 600 })).await;
        assert_eq!(status, 200, "{rsv}");
        let rsv = rsv["reservationId"].as_str().unwrap().to_owned();

        // The root tenant releases acme's reservation.
        let (status, released) = server.call("reservations.release", json!({ "tenantId": tenant, "reservationId": rsv })).await;
        if quorum {
            assert_eq!((status, released["code"].as_str()), (403, Some("BATCH_REQUIRED")), "{released}");
            let hint = released["details"]["hint"].as_str().unwrap();
            assert!(hint.contains("better-compute release RESERVATION… --tenant TENANT --batch-reason TEXT"), "{released}");
            let (_, still) = server.call("reservations.get", json!({ "tenantId": tenant, "reservationId": rsv })).await;
            assert_ne!(still["state"], "released", "nothing changed: {still}");
        } else {
            assert_eq!(status, 200, "{released}");
        }

        let (status, cordoned) = server.call("nodes.cordon", json!({ "tenantId": tenant, "nodeId": node })).await;
        assert_eq!(status, 200, "{cordoned}");
        if quorum {
            let (code, out, err) = server.cli(&["nodes", "delete", &node, "--tenant", &tenant, "--yes"]);
            assert_eq!(code, 1, "{out}\n{err}");
            assert!(err.contains("BATCH_REQUIRED:") && err.contains("nodes delete NODE… --yes --batch-reason TEXT"), "{err}");
            let (status, kept) = server.call("nodes.get", json!({ "tenantId": tenant, "nodeId": node })).await;
            assert_eq!(status, 200, "the node is still there: {kept}");
        } else {
            // The reservation's release reached the node; nothing holds it now.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            loop {
                let (status, deleted) = server.call("nodes.delete", json!({ "tenantId": tenant, "nodeId": node })).await;
                if status == 200 {
                    assert_eq!(deleted["deleted"], true, "{deleted}");
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "nodes.delete without the quorum: {deleted}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// `batch approve --yes` of `batch` (in `tenant`; the root tenant's when `None`) with the
/// approver key `key`: its summary (stderr) and the batch it answers.
fn approve_in(server: &Server, tenant: Option<&str>, batch: &str, key: &Path) -> (String, Value) {
    let mut args = vec!["batch", "approve", "--batch", batch, "--key", path_text(key), "--yes"];
    if let Some(tenant) = tenant {
        args.extend(["--tenant", tenant]);
    }
    let (code, out, err) = server.cli(&args);
    assert_eq!(code, 0, "better-compute {args:?}: {out}\n{err}");
    (err, json(&out))
}

/// `batch members` of `batch` (in `tenant`; the root tenant's when `None`): each member's
/// (state, reason), in leaf order.
fn members_in(server: &Server, tenant: Option<&str>, batch: &str) -> Vec<(String, String)> {
    let mut args = vec!["batch", "members", "--batch", batch, "--format", "json"];
    if let Some(tenant) = tenant {
        args.extend(["--tenant", tenant]);
    }
    let members = ok(server, &args);
    members["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["state"].as_str().unwrap().to_owned(), m["reason"].as_str().unwrap_or_default().to_owned()))
        .collect()
}

/// Three approver keys made by `batch keygen` in `dir`, published as epoch 1 with quorum 2.
fn three_approvers(server: &Server, dir: &Path) -> Vec<PathBuf> {
    let keys: Vec<PathBuf> = ["a", "b", "c"].iter().map(|n| dir.join(format!("{n}.pem"))).collect();
    for key in &keys {
        ok(server, &["batch", "keygen", "--out", path_text(key)]);
    }
    let publics: Vec<String> = keys.iter().map(|k| format!("{}.pub", k.display())).collect();
    publish_epoch_1(server, 2, &publics);
    keys
}

/// Issue 57's item 3 whole, for `nodes.delete` and the cross-tenant release (`dev --approvers`,
/// three approver keys, quorum 2): the root tenant deletes three of acme's nodes and releases
/// one of acme's reservations. Each alone is refused `BATCH_REQUIRED`, the hint naming the
/// command with `--batch-reason`; that command makes a batch in acme. After one approval
/// nothing is deleted or released (every member `awaitingApproval`); after the second the two
/// cordoned nodes are gone, the reservation is released, and the third node, which still takes
/// reservations, is refused at the release with the reason (`failed`) while the others
/// `succeeded`; the `node.deleted` events name the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_quorum_on_nodes_delete_and_a_cross_tenant_release_go_through_batches_after_two_approvals() {
    let server = Server::dev_with(&["--approvers"]);
    let dir = tempfile::tempdir().unwrap();
    let keys = three_approvers(&server, dir.path());
    let tenant = server.tenant("acme").await;
    let pool = server.tenant_pool(&tenant, "rack").await;
    let gpus = vec![json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }); 2];
    let mut nodes = Vec::new();
    for name in ["n0", "n1", "n2"] {
        let (status, node) = server
            .call("nodes.register", json!({ "tenantId": tenant, "poolId": pool, "name": name, "gpus": gpus.clone() }))
            .await;
        assert_eq!(status, 200, "{node}");
        nodes.push(node["nodeId"].as_str().unwrap().to_owned());
    }
    // n0 and n1 are cordoned, so the reservation lands on n2, which keeps taking reservations.
    for node in &nodes[..2] {
        let (status, cordoned) = server.call("nodes.cordon", json!({ "tenantId": tenant, "nodeId": node })).await;
        assert_eq!(status, 200, "{cordoned}");
    }
    let (status, rsv) =
        server.call("reservations.create", json!({ "tenantId": tenant, "poolId": pool, "gpus": 1, "durationS": 600 })).await;
    assert_eq!(status, 200, "{rsv}");
    let rsv = rsv["reservationId"].as_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, doc) = server.call("reservations.get", json!({ "tenantId": tenant, "reservationId": rsv })).await;
        if doc["state"] == "active" {
            assert_eq!(doc["nodeId"].as_str(), Some(nodes[2].as_str()), "the one uncordoned node: {doc}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the reservation is not placed: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Alone, each is refused, and the hint names the command that makes its batch; several
    // nodes at once are a usage error without --batch-reason, before any call.
    let err = refused(&server, &["nodes", "delete", &nodes[0], "--tenant", &tenant, "--yes"], "BATCH_REQUIRED");
    assert!(err.contains("better-compute nodes delete NODE… --yes --batch-reason TEXT"), "{err}");
    let mut delete = vec!["nodes", "delete"];
    delete.extend(nodes.iter().map(String::as_str));
    delete.extend(["--tenant", tenant.as_str(), "--yes"]);
    let (code, out, err) = server.cli(&delete);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("add --batch-reason TEXT"), "{err}");
    let err = refused(&server, &["release", &rsv, "--tenant", &tenant], "BATCH_REQUIRED");
    assert!(err.contains("better-compute release RESERVATION… --tenant TENANT --batch-reason TEXT"), "{err}");

    // The same commands with --batch-reason make the batches.
    delete.extend(["--batch-reason", "decommission rack 1"]);
    let deletes = ok(&server, &delete);
    assert_eq!((deletes["state"].as_str(), deletes["size"].as_u64()), (Some("pending"), Some(3)), "{deletes}");
    let deletes = deletes["batchId"].as_str().unwrap().to_owned();
    let release = ok(&server, &["release", &rsv, "--tenant", &tenant, "--batch-reason", "reclaim acme's GPU"]);
    let release = release["batchId"].as_str().unwrap().to_owned();
    let scope = ok(&server, &["batch", "show", "--tenant", &tenant, "--batch", &deletes]);
    let kinds: Vec<(&str, &str)> = scope["leaves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| (l["kind"].as_str().unwrap(), l["subject"].as_str().unwrap()))
        .collect();
    assert_eq!(kinds, nodes.iter().map(|n| ("nodes.delete", n.as_str())).collect::<Vec<_>>());

    // One approval of two: nothing deleted, nothing released.
    for batch in [&deletes, &release] {
        let (summary, after) = approve_in(&server, Some(&tenant), batch, &keys[0]);
        assert!(summary.contains("Approvals: 0 of 2"), "{summary}");
        assert_eq!(after["state"], "pending", "{after}");
        assert!(members_in(&server, Some(&tenant), batch).iter().all(|(s, _)| s == "awaitingApproval"));
    }
    for node in &nodes {
        let (status, kept) = server.call("nodes.get", json!({ "tenantId": tenant, "nodeId": node })).await;
        assert_eq!(status, 200, "one approval deletes nothing: {kept}");
    }
    let (_, still) = server.call("reservations.get", json!({ "tenantId": tenant, "reservationId": rsv })).await;
    assert_eq!(still["state"], "active", "one approval releases nothing: {still}");

    // The second: the cordoned nodes go, the reservation is released; n2 is refused with why.
    for batch in [&deletes, &release] {
        let (_, after) = approve_in(&server, Some(&tenant), batch, &keys[1]);
        assert_eq!(after["state"], "released", "{after}");
    }
    for node in &nodes[..2] {
        let (status, gone) = server.call("nodes.get", json!({ "tenantId": tenant, "nodeId": node })).await;
        assert_eq!(status, 404, "deleted by the batch: {gone}");
    }
    let (status, kept) = server.call("nodes.get", json!({ "tenantId": tenant, "nodeId": nodes[2] })).await;
    assert_eq!(status, 200, "n2 still takes reservations: {kept}");
    let members = members_in(&server, Some(&tenant), &deletes);
    assert_eq!(members[..2], [("succeeded".to_owned(), String::new()), ("succeeded".to_owned(), String::new())]);
    assert_eq!(members[2].0, "failed", "{members:?}");
    assert!(members[2].1.contains("cordon or drain it first"), "{members:?}");
    let (_, released) = server.call("reservations.get", json!({ "tenantId": tenant, "reservationId": rsv })).await;
    assert_eq!(released["state"], "released", "{released}");
    assert_eq!(members_in(&server, Some(&tenant), &release), [("succeeded".to_owned(), String::new())]);

    // Each deletion's event names the batch.
    let (status, page) = server.call("events.list", json!({ "tenantId": tenant, "types": ["node.deleted"] })).await;
    assert_eq!(status, 200, "{page}");
    let reasons: Vec<&str> = page["items"].as_array().unwrap().iter().filter_map(|e| e["payload"]["reason"].as_str()).collect();
    assert_eq!(reasons, [format!("deleted by batch {deletes}"), format!("deleted by batch {deletes}")], "{page}");
}

/// The root tenant's rollouts.
async fn rollouts_of(server: &Server) -> Vec<Value> {
    let (status, page) = server.call("rollouts.list", json!({})).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().clone()
}

/// Issue 57's item 3 for rollouts (`dev --approvers --release-key`, two joined `bcd` nodes,
/// quorum 2): a rollout to the pool's two nodes alone is refused `BATCH_REQUIRED`, the hint
/// naming `rollouts create … --batch-reason`; with it, one `rollouts.create` leaf binds the
/// release, the flags and the two nodes, which `batch approve`'s summary lists. After one
/// approval no rollout exists; after the second the rollout is created with the leaf's id, to
/// exactly those nodes, and its member shows the rollout's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_quorum_on_a_rollout_to_two_nodes_goes_through_a_batch_after_two_approvals() {
    let dir = tempfile::tempdir().unwrap();
    let release_key = dir.path().join("release.key");
    let (code, _, err) = bc_tests::cli(&["releases", "keygen", "--out", path_text(&release_key)], &[]);
    assert_eq!(code, 0, "releases keygen: {err}");
    let public = format!("{}.pub", release_key.display());
    let (server, port) = bc_tests::agents_gateway_with(&["--release-key", &public, "--approvers"]);
    let keys = three_approvers(&server, dir.path());
    let pool = server.pool("rack").await;
    let machines = two_live_machines(&server, port, &pool).await;
    let mut nodes: Vec<String> = machines.iter().map(AgentNode::node_id).collect();
    nodes.sort();
    for node in &nodes {
        wait_ready(&server, node).await;
    }

    // A signed release (its artifact never fetched here: the test is of who may start it).
    let artifact = dir.path().join("bcd-next");
    std::fs::write(&artifact, b"the next bcd").unwrap();
    let manifest = dir.path().join("release.json");
    let item = format!("{}={}=http://127.0.0.1:9/bcd-next", std::env::consts::ARCH, artifact.display());
    ok(
        &server,
        &[
            "releases",
            "sign",
            "--key",
            path_text(&release_key),
            "--version",
            "9.0.0",
            "--artifact",
            &item,
            "--out",
            path_text(&manifest),
        ],
    );
    let registered = ok(&server, &["releases", "register", "--manifest", path_text(&manifest), "--format", "json"]);
    let release = registered["releaseId"].as_str().unwrap().to_owned();

    let create = ["rollouts", "create", "--release", release.as_str(), "--pool", pool.as_str(), "--waves", "1,100%"];
    let err = refused(&server, &create, "BATCH_REQUIRED");
    assert!(err.contains("a rollout to 2 nodes") && err.contains("rollouts create … --batch-reason TEXT"), "{err}");
    let mut with_batch = create.to_vec();
    with_batch.extend(["--batch-reason", "roll 9.0.0 to rack"]);
    let batch = ok(&server, &with_batch);
    assert_eq!((batch["state"].as_str(), batch["size"].as_u64()), (Some("pending"), Some(1)), "{batch}");
    let batch = batch["batchId"].as_str().unwrap().to_owned();
    let scope = ok(&server, &["batch", "show", "--batch", &batch]);
    let leaf = &scope["leaves"][0];
    assert_eq!((leaf["kind"].as_str(), leaf["subject"].as_str()), (Some("rollouts.create"), Some(release.as_str())), "{leaf}");
    assert_eq!(leaf["payload"]["nodes"], json!(nodes), "the leaf binds the two nodes: {leaf}");
    assert_eq!(leaf["payload"]["poolId"], pool.as_str(), "{leaf}");

    let (summary, after) = approve_in(&server, None, &batch, &keys[0]);
    assert!(summary.contains(&format!("rollouts.create of {release} to 2 node(s): {}, {}", nodes[0], nodes[1])), "{summary}");
    assert_eq!(after["state"], "pending", "{after}");
    assert!(rollouts_of(&server).await.is_empty(), "one approval starts no rollout");
    assert_eq!(members_in(&server, None, &batch)[0].0, "awaitingApproval");

    let (_, after) = approve_in(&server, None, &batch, &keys[2]);
    assert_eq!(after["state"], "released", "{after}");
    let made = rollouts_of(&server).await;
    assert_eq!(made.len(), 1, "{made:?}");
    let members = ok(&server, &["batch", "members", "--batch", &batch, "--format", "json"]);
    let member = &members["items"][0];
    assert_eq!(made[0]["rolloutId"], member["commandId"], "the rollout has the leaf's id: {member}");
    assert_eq!(made[0]["releaseId"], release.as_str());
    let mut rolled: Vec<&str> = made[0]["nodes"].as_array().unwrap().iter().map(|n| n["nodeId"].as_str().unwrap()).collect();
    rolled.sort_unstable();
    assert_eq!(rolled, nodes.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(["running", "paused", "done"].contains(&member["state"].as_str().unwrap()), "{member}");
}

/// A gateway that lies (`BC_TEST_ONLY_FORGE_BATCH_RELEASE`: the first approval releases, quorum
/// 2): the node that pins the approver set's root refuses the command and journals why (one
/// valid approval of the two needed); a node that pins nothing runs its command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_pins_the_approver_root_refuses_a_forged_release_and_says_why() {
    let (server, port) = Server::with_env(&[("BC_TEST_ONLY_FORGE_BATCH_RELEASE", "1")], bc_tests::agents_gateway);
    let pool = server.pool("rack").await;
    let mut machines = Vec::new();
    for _ in 0..2 {
        let machine = AgentNode::new(&server, port);
        machine.join_pool(&server, &pool).await;
        machines.push(machine);
    }
    let nodes: Vec<String> = machines.iter().map(AgentNode::node_id).collect();
    let dir = tempfile::tempdir().unwrap();
    let key = |name: &str| dir.path().join(format!("{name}.pem"));
    for name in ["a", "b"] {
        ok(&server, &["batch", "keygen", "--out", path_text(&key(name))]);
    }
    let public = |name: &str| format!("{}.pub", key(name).display());
    let set = publish_epoch_1(&server, 2, &[public("a"), public("b")]);
    let root = set["commandRootSha256"].as_str().unwrap().to_owned();
    std::fs::write(
        machines[0].config(),
        format!("command_root_sha256 = {root:?}\n{}", std::fs::read_to_string(machines[0].config()).unwrap()),
    )
    .unwrap();
    for machine in &mut machines {
        machine.start();
    }
    for node in &nodes {
        wait_ready(&server, node).await;
    }

    let leaves = json!([
        { "subject": nodes[0], "kind": "ping", "payload": {} },
        { "subject": nodes[1], "kind": "ping", "payload": {} },
    ]);
    let batch = create_batch(&server, dir.path(), "forged", &leaves);
    // One approval of the two: the lying gateway releases anyway.
    let approved = ok(&server, &["batch", "approve", "--batch", &batch, "--key", path_text(&key("a")), "--yes"]);
    assert_eq!(approved["state"], "released", "the test switch forges the release: {approved}");

    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let members = loop {
        let members = ok(&server, &["batch", "members", "--batch", &batch]);
        let items = members["items"].as_array().unwrap();
        if items.iter().all(|m| m["state"] == "succeeded" || m["state"] == "failed") {
            break members;
        }
        assert!(std::time::Instant::now() < deadline, "the commands did not finish: {members}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let pinned = &members["items"][0];
    assert_eq!(pinned["state"], "failed", "the pinned node ran a forged release: {members}");
    let reason = pinned["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("batch-release-refused:") && reason.contains("1 valid approval(s)") && reason.contains("quorum is 2"),
        "{reason}"
    );
    assert_eq!(members["items"][1]["state"], "succeeded", "the node that pins nothing runs it: {members}");
    // The node journaled the refusal itself: its log says so, with the reason.
    assert!(machines[0].node_log().contains("a batch command's release was refused"), "{}", machines[0].node_log());
}

/// A batch past the old 256-leaf cap goes in chunks: 450 pings to one node are created in one
/// call (three creation events), and released a chunk of 200 a transaction. The approval issues
/// the first chunk; the second does not fit the node's queue (256 unfinished commands) until the
/// node has run the first, so the `batches` reconciler issues it and the last one later. Every
/// command runs, in three `command_batch.chunk_issued`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_450_leaves_is_released_in_chunks_the_reconciler_resumes() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("rack").await;
    let mut machine = AgentNode::new(&server, port);
    machine.join_pool(&server, &pool).await;
    machine.start();
    let node = machine.node_id();
    wait_ready(&server, &node).await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("a.pem");
    ok(&server, &["batch", "keygen", "--out", path_text(&key)]);
    let public = format!("{}.pub", key.display());
    ok(
        &server,
        &["batch", "publish-approvers", "--epoch", "1", "--quorum", "1", "--trust-domain", "compute.test", "--approver", &public],
    );
    let leaves: Vec<Value> = (0..450).map(|_| json!({ "subject": node, "kind": "ping", "payload": {} })).collect();
    let batch = create_batch(&server, dir.path(), "large", &Value::Array(leaves));
    let shown = ok(&server, &["batch", "show", "--batch", &batch]);
    assert_eq!(shown["size"], 450, "{shown}");
    let released = ok(&server, &["batch", "approve", "--batch", &batch, "--key", path_text(&key), "--yes"]);
    assert_eq!(released["state"], "released", "{released}");

    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let members = ok(&server, &["batch", "members", "--batch", &batch]);
        let items = members["items"].as_array().unwrap();
        assert_eq!(items.len(), 450);
        if items.iter().all(|m| m["state"] == "succeeded") {
            break;
        }
        assert!(items.iter().all(|m| m["state"] != "failed"), "{members}");
        assert!(std::time::Instant::now() < deadline, "not every command ran: {}", members["items"][449]);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (status, events) = server.call("events.list", json!({ "types": ["command_batch.chunk_issued"], "limit": 10 })).await;
    assert_eq!(status, 200, "{events}");
    let chunks: Vec<(u64, u64, String)> = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["payload"]["chunk"].as_u64().unwrap(),
                e["payload"]["commands"].as_u64().unwrap(),
                e["actor"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(chunks.iter().map(|c| (c.0, c.1)).collect::<Vec<_>>(), [(0, 200), (1, 200), (2, 50)], "{events}");
    assert!(chunks[1..].iter().all(|c| c.2 == "reconciler:batches"), "the reconciler resumed the release: {chunks:?}");
}

/// An expired batch (`BC_TEST_ONLY_BATCH_HOUR_MS`: a debug build's window hour lasts 2 s): an
/// approval signed while it was open and sent after its window closed is refused INVALID_STATE
/// and ends it `expired`; a batch nobody touches is expired by the `batches` reconciler. Neither
/// issues a command; `batch approve` refuses before it signs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_batch_is_refused_and_its_commands_never_run() {
    let (server, port) = Server::with_env(&[("BC_TEST_ONLY_BATCH_HOUR_MS", "2000")], bc_tests::agents_gateway);
    let pool = server.pool("rack").await;
    let mut machine = AgentNode::new(&server, port);
    machine.join_pool(&server, &pool).await;
    machine.start();
    let node = machine.node_id();
    wait_ready(&server, &node).await;
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("a.pem");
    let kid = ok(&server, &["batch", "keygen", "--out", path_text(&key)])["kid"].as_str().unwrap().to_owned();
    let public = format!("{}.pub", key.display());
    ok(
        &server,
        &["batch", "publish-approvers", "--epoch", "1", "--quorum", "1", "--trust-domain", "compute.test", "--approver", &public],
    );
    let scope = dir.path().join("scope.json");
    std::fs::write(&scope, json!([{ "subject": node, "kind": "ping", "payload": {} }]).to_string()).unwrap();
    let create = |name: &str| {
        let args = ["batch", "create", "--reason", name, "--scope", path_text(&scope), "--hours", "1"];
        ok(&server, &args)["batchId"].as_str().unwrap().to_owned()
    };
    let (late, untouched) = (create("late"), create("untouched"));
    // Signed while the window is open, sent once it has closed.
    let signed = signature_of(&sign_offline(&server, dir.path(), &late, &key, "late-a"));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (status, answer) =
        server.call("commandBatches.approve", json!({ "batchId": late, "kid": kid, "signature": signed["signature"] })).await;
    assert_eq!((status, answer["code"].as_str()), (409, Some("INVALID_STATE")), "{answer}");
    assert!(answer["message"].as_str().unwrap().contains("expired"), "{answer}");
    let shown = ok(&server, &["batch", "show", "--batch", &late]);
    assert_eq!(shown["state"], "expired", "{shown}");
    let err = refused(&server, &["batch", "approve", "--batch", &untouched, "--key", path_text(&key), "--yes"], "INVALID_STATE");
    assert!(err.contains("window") || err.contains("expired"), "{err}");
    // The reconciler (every 5 s) ends the one nobody touched.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let shown = ok(&server, &["batch", "show", "--batch", &untouched]);
        if shown["state"] == "expired" {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the reconciler did not expire it: {shown}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for batch in [&late, &untouched] {
        let members = ok(&server, &["batch", "members", "--batch", batch]);
        assert_eq!(members["items"][0]["state"], "cancelled", "{members}");
    }
    assert!(commands_of(&server, &node).await.is_empty(), "an expired batch issued a command");
}

/// What the emulator holds of `system` now, read over Redfish (the Redfish client against
/// sushy's own answer): its power and the image in its virtual CD.
async fn emulator_state(
    emulator: &bc_tests::sushy::Emulator,
    ca_pem: &str,
    system: &str,
) -> (Option<bc_bmc::PowerState>, Option<String>) {
    use bc_bmc::Bmc as _;
    let bmc = emulator.bmc(bc_bmc::BmcTls::CaBundle { pem: ca_pem.to_owned() }, Some(system));
    let info = bmc.system().await.expect("the emulator's system");
    (info.power_state, info.media_image)
}

/// `batch members` of `batch`: each command's state, in leaf order.
fn member_states(server: &Server, batch: &str) -> Vec<String> {
    let members = ok(server, &["batch", "members", "--batch", batch, "--format", "json"]);
    members["items"].as_array().unwrap().iter().map(|m| m["state"].as_str().unwrap().to_owned()).collect()
}

/// Reviews and approves `batch` with the approver key `key` (`batch approve --yes`).
fn approve(server: &Server, batch: &str, key: &Path) -> Value {
    ok(server, &["batch", "approve", "--batch", batch, "--key", path_text(key), "--yes"])
}

/// Issue 57's demonstration on a Redfish BMC: three machines on sushy-tools, three approver
/// keys, quorum 2. `metal bulk --verb deploy` makes one batch of three deploys (each machine's
/// join token in a new 0600 file); after one approval nothing reaches the emulator (no state
/// change recorded by sushy, power and virtual CD unchanged over Redfish) and every member is
/// `awaitingApproval`; the second approval starts the three deploys, whose installed systems
/// join with the batch's tokens. Then `metal bulk --verb undeploy` of the three: after one
/// approval the machines stay active and powered on; after two they are torn down, cleaned and
/// end `available`, powered off with the CD ejected, and `batch members` shows each command's
/// state from `awaitingApproval` to `running` and `succeeded`. With the quorum on, the same
/// undeploy as one call (`metal bulk --now`) is refused `BATCH_REQUIRED` with the hint, and a
/// batch's approval proves offline with `audit prove`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_undeploys_three_machines_on_sushy_only_after_two_approvals() {
    use bc_tests::sushy::{SYSTEM_A, SYSTEM_B, SYSTEM_C};
    let pki = bc_tests::sushy::pki();
    let (notifications, notify_url) = bc_tests::sushy::Notifications::start();
    let emulator = bc_tests::sushy::Emulator::start(&pki, &notify_url);
    let (server, agents_port) = bc_tests::agents_gateway_with(&["--approvers", "--bmc-allow-network", "127.0.0.1/32"]);
    let pool = server.pool("metal").await;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str| dir.path().join(name);
    std::fs::write(file("bmc-password"), format!("{}\n", bc_tests::sushy::PASSWORD)).unwrap();
    std::fs::write(file("bmc-ca.pem"), &pki.ca_pem).unwrap();
    let iso = b"an installer ISO, as far as the emulator can tell".to_vec();
    let sha256 = {
        use sha2::Digest as _;
        hex::encode(sha2::Sha256::digest(&iso))
    };
    let images = bc_tests::ImageServer::start("installer.iso", iso);
    let (status, image) = server
        .call("images.register", json!({ "name": "installer", "url": images.url, "sha256": sha256, "diskFormat": "iso" }))
        .await;
    assert_eq!(status, 200, "{image}");
    let image = image["imageId"].as_str().unwrap().to_owned();

    // Three approver keys, quorum 2.
    let key = |name: &str| dir.path().join(format!("{name}.pem"));
    for name in ["a", "b", "c"] {
        ok(&server, &["batch", "keygen", "--out", path_text(&key(name))]);
    }
    let public = |name: &str| format!("{}.pub", key(name).display());
    publish_epoch_1(&server, 2, &[public("a"), public("b"), public("c")]);

    // Three machines, managed and provided one call each (one machine is not a wide scope).
    let systems = [SYSTEM_A, SYSTEM_B, SYSTEM_C];
    let address = format!("https://localhost:{}", emulator.port);
    let mut nodes = Vec::new();
    for (i, system) in systems.iter().enumerate() {
        let machine = ok(
            &server,
            &[
                "metal",
                "enroll",
                "--pool",
                &pool,
                "--name",
                &format!("rack1-u{i}"),
                "--bmc-address",
                &address,
                "--bmc-system-path",
                &format!("/redfish/v1/Systems/{system}"),
                "--bmc-username",
                bc_tests::sushy::USERNAME,
                "--bmc-password-file",
                path_text(&file("bmc-password")),
                "--bmc-ca-file",
                path_text(&file("bmc-ca.pem")),
            ],
        );
        nodes.push(machine["nodeId"].as_str().unwrap().to_owned());
    }
    for verb in ["manage", "provide"] {
        for node in &nodes {
            ok(&server, &["metal", verb, node]);
        }
        for node in &nodes {
            ok(&server, &["metal", "get", node]);
            wait_machine(&server, node, if verb == "manage" { "manageable" } else { "available" }, Duration::from_secs(180));
        }
    }
    let node_list = nodes.join(",");

    // Deploy the three as one batch: the tokens go to new 0600 files, never to the terminal.
    std::fs::create_dir(file("tokens")).unwrap();
    let (code, out, err) = server.cli(&[
        "metal",
        "bulk",
        "--verb",
        "deploy",
        "--nodes",
        &node_list,
        "--image",
        &image,
        "--token-dir",
        path_text(&file("tokens")),
        "--reason",
        "install rack 1",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("bcjt_") && !err.contains("bcjt_"), "a join token was printed");
    let deploys = json(&out)["batchId"].as_str().unwrap().to_owned();
    use std::os::unix::fs::PermissionsExt as _;
    for node in &nodes {
        let token = file("tokens").join(format!("{node}.token"));
        assert_eq!(std::fs::metadata(&token).unwrap().permissions().mode() & 0o777, 0o600, "{}", token.display());
    }
    let before = notifications.0.lock().unwrap().len();
    approve(&server, &deploys, &key("a"));
    // The metal reconciler passes every second: three passes with the batch held.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(notifications.0.lock().unwrap().len(), before, "the emulator changed under one approval");
    assert_eq!(member_states(&server, &deploys), ["awaitingApproval"; 3]);
    for system in systems {
        assert_eq!(emulator_state(&emulator, &pki.ca_pem, system).await, (Some(bc_bmc::PowerState::Off), None), "{system}");
    }
    approve(&server, &deploys, &key("b"));
    let mut installed = Vec::new();
    for node in &nodes {
        bc_tests::wait_until(&format!("{node} waits for its agent"), Duration::from_secs(180), || {
            let machine = ok(&server, &["metal", "get", node]);
            assert_ne!(machine["state"], "deploy-failed", "{machine}");
            (machine["state"] == "deploy-wait").then_some(())
        });
        let mut machine = AgentNode::new(&server, agents_port);
        let token = file("tokens").join(format!("{node}.token"));
        let (code, out, err) = machine.bcd(
            &["join", "--node-id", node, "--token-file", path_text(&token), "--config", &machine.config()],
            &[],
            None,
        );
        assert_eq!(code, 0, "bcd join --node-id with the batch's token: {out}{err}");
        machine.start();
        installed.push(machine);
    }
    for node in &nodes {
        wait_machine(&server, node, "active", Duration::from_secs(120));
    }
    assert_eq!(member_states(&server, &deploys), ["succeeded"; 3]);
    for system in systems {
        let (power, media) = emulator_state(&emulator, &pki.ca_pem, system).await;
        assert_eq!(power, Some(bc_bmc::PowerState::On), "{system}");
        assert!(media.is_some_and(|m| m.ends_with("installer.iso")), "{system}");
    }

    // With the quorum on, undeploying the three in one call is refused, and changes nothing.
    let (code, out, err) = server.cli(&["metal", "bulk", "--verb", "undeploy", "--nodes", &node_list, "--reason", "x", "--now"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("BATCH_REQUIRED:") && err.contains("metal bulk --verb undeploy"), "{err}");

    // The undeploy batch: held after one approval, run after two.
    let (code, out, err) = server.cli(&[
        "metal",
        "bulk",
        "--verb",
        "undeploy",
        "--nodes",
        &node_list,
        "--nodes",
        &nodes[0],
        "--reason",
        "decommission rack 1",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let undeploys = json(&out)["batchId"].as_str().unwrap().to_owned();
    assert_eq!(json(&out)["size"], 3, "deduplicated: {out}");
    let before = notifications.0.lock().unwrap().len();
    let first = approve(&server, &undeploys, &key("c"));
    assert_eq!(first["state"], "pending", "{first}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(notifications.0.lock().unwrap().len(), before, "the emulator changed under one approval");
    assert_eq!(member_states(&server, &undeploys), ["awaitingApproval"; 3]);
    for (node, system) in nodes.iter().zip(systems) {
        assert_eq!(ok(&server, &["metal", "get", node])["state"], "active", "{node}");
        assert_eq!(emulator_state(&emulator, &pki.ca_pem, system).await.0, Some(bc_bmc::PowerState::On), "{system}");
    }
    let second = approve(&server, &undeploys, &key("a"));
    assert_eq!(second["state"], "released", "{second}");
    let states = member_states(&server, &undeploys);
    assert!(states.iter().all(|s| s == "running" || s == "succeeded"), "{states:?}");
    for node in &nodes {
        wait_machine(&server, node, "available", Duration::from_secs(240));
    }
    assert_eq!(member_states(&server, &undeploys), ["succeeded"; 3]);
    let members = ok(&server, &["batch", "members", "--batch", &undeploys, "--format", "json"]);
    for (member, node) in members["items"].as_array().unwrap().iter().zip(&nodes) {
        assert_eq!(
            (member["subject"].as_str(), member["kind"].as_str()),
            (Some(node.as_str()), Some("metal.undeploy")),
            "{member}"
        );
        let workflow = ok(&server, &["workflows", "get", member["commandId"].as_str().unwrap()]);
        assert_eq!(
            (workflow["verb"].as_str(), workflow["outcome"].as_str()),
            (Some("undeploy"), Some("succeeded")),
            "{workflow}"
        );
    }
    for system in systems {
        assert_eq!(emulator_state(&emulator, &pki.ca_pem, system).await, (Some(bc_bmc::PowerState::Off), None), "{system}");
        let last = notifications.of(system).last().cloned().unwrap();
        assert_eq!(last["power_state"], "Off", "{last}");
    }
    drop(installed);

    // The approval that released the undeploys, and the scope it signed, prove offline.
    let events = ok(&server, &["events", "list", "--types", "command_batch.*", "--limit", "100", "--format", "json"]);
    let stream = format!("command_batch/{undeploys}");
    let of = |kind: &str| {
        events["items"].as_array().unwrap().iter().find(|e| e["stream"] == stream.as_str() && e["type"] == kind).unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    let (code, _, err) = bc_tests::cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let pin = bc_tests::log_key_pin(&server);
    for (wanted, event) in
        [("command_batch.approved", of("command_batch.approved")), ("command_batch.created", of("command_batch.created"))]
    {
        let proof = file(&format!("{event}.tlog-proof"));
        let (code, _, err) = bc_tests::cli(&["audit", "prove", &event, "--out", path_text(&proof), "--data-dir", &data_dir], &[]);
        assert_eq!(code, 0, "{err}");
        let (code, out, err) = bc_tests::cli(&["audit", "check-proof", path_text(&proof), "--pin", &pin], &[]);
        assert_eq!(code, 0, "{err}");
        let proved = json(&out);
        assert_eq!(proved["type"].as_str(), Some(wanted), "{proved}");
        if wanted == "command_batch.created" {
            assert_eq!(proved["payload"]["leaves"][0]["kind"], "metal.undeploy", "{proved}");
        }
    }
}

/// Waits until machine `node` rests in `state` (its workflow not running), failing on a failed
/// workflow.
fn wait_machine(server: &Server, node: &str, state: &str, within: Duration) -> Value {
    bc_tests::wait_until(&format!("{node} is {state}"), within, || {
        let machine = ok(server, &["metal", "get", node]);
        assert!(machine["workflow"]["outcome"] != "failed" || machine["state"] == state, "the workflow failed: {machine}");
        (machine["state"] == state && machine["workflow"]["outcome"] != "running").then_some(machine)
    })
}
