//! End-to-end audit with the real binary: `dev`, some pools and nodes, `audit checkpoint`,
//! `audit prove`, then `audit check-proof` with the pin from `pki show`, in a directory with no
//! database; consistency with a checkpoint saved earlier; refusals.

use bc_tests::{Server, cli};
use serde_json::{Value, json};

fn json_of(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

#[tokio::test]
async fn checkpoint_prove_and_check_offline() {
    let server = Server::dev();
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    let pool = server.pool("audited").await;
    let (status, node) = server
        .call("nodes.register", json!({ "poolId": pool, "name": "n1", "gpus": [{ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }] }))
        .await;
    assert_eq!(status, 200, "{node}");

    // Seal while the server runs; the auditor keeps the checkpoint.
    let (code, out, err) = cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let sealed = json_of(&out);
    let first = sealed["sealed"][0]["checkpoint"].as_str().unwrap().to_owned();
    assert_eq!(sealed["sealed"][0]["treeSize"], 4);
    let (code, out, _) = cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!((code, json_of(&out)["sealed"].as_array().unwrap().len()), (0, 0), "nothing grew, nothing sealed");

    server.pool("later").await;
    let (code, _, err) = cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");

    let (code, pki, _) = cli(&["pki", "show", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0);
    let pki = json_of(&pki);
    let pin = pki["pin"].as_str().unwrap().to_owned();
    let vkey = pki["vkey"].as_str().unwrap().to_owned();

    // The auditor's own directory: no database, no server.
    let auditor = tempfile::tempdir().unwrap();
    let saved = auditor.path().join("saved.checkpoint");
    std::fs::write(&saved, &first).unwrap();
    let proof = auditor.path().join("node.tlog-proof");
    let (_, events, _) = server.cli(&["events", "list", "--format", "json"]);
    let node_event = json_of(&events)["items"].as_array().unwrap().iter().find(|e| e["type"] == "node.registered").unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (code, out, err) = cli(
        &[
            "audit",
            "prove",
            &node_event,
            "--out",
            proof.to_str().unwrap(),
            "--checkpoint",
            saved.to_str().unwrap(),
            "--data-dir",
            &data_dir,
        ],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(json_of(&out)["consistency"].is_string());
    let (code, _, err) = cli(&["audit", "prove", &node_event, "--out", proof.to_str().unwrap(), "--data-dir", &data_dir], &[]);
    assert_eq!(code, 1);
    assert!(err.starts_with("ALREADY_EXISTS: "), "{err}");

    drop(server); // the log's host is gone; the check needs nothing but the files and the pin
    let offline = |args: &[&str], env: &[(&str, &str)]| {
        let mut command = std::process::Command::new(bc_tests::binary("better-compute"));
        command.current_dir(auditor.path()).args(args).env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
        for (k, v) in env {
            command.env(k, v);
        }
        let out = command.output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, out, err) = offline(&["audit", "check-proof", "node.tlog-proof", "--pin", &pin], &[]);
    assert_eq!(code, 0, "{err}");
    let proved = json_of(&out);
    assert_eq!(proved["type"], "node.registered");
    assert_eq!(proved["payload"]["name"], "n1");
    assert_eq!(proved["consistentFrom"], 4);
    assert_eq!(proved["treeSize"], 6);
    let (code, _, err) = offline(&["audit", "check-proof", "node.tlog-proof"], &[("BETTER_COMPUTE_AUDIT_PIN", &pin)]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = offline(&["audit", "check-proof", "node.tlog-proof", "--vkey", &vkey], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(!auditor.path().join(".better-compute").exists(), "check-proof created no database");
    // With the auditor's own saved checkpoint, consistency is proved from it and the
    // output says so; without it, the output says whose checkpoint it was proved from.
    assert_eq!(proved["consistencyFrom"], "prover", "{proved}");
    let (code, out, err) =
        offline(&["audit", "check-proof", "node.tlog-proof", "--pin", &pin, "--saved", "saved.checkpoint"], &[]);
    assert_eq!(code, 0, "{err}");
    let checked = json_of(&out);
    assert_eq!((checked["consistencyFrom"].as_str(), checked["consistentFrom"].as_u64()), (Some("saved"), Some(4)), "{checked}");
    assert!(err.is_empty(), "no warning when consistency was proved from the saved checkpoint: {err}");
    std::fs::rename(auditor.path().join("node.tlog-proof.consistency"), auditor.path().join("moved.consistency")).unwrap();
    let (code, out, err) = offline(&["audit", "check-proof", "node.tlog-proof", "--pin", &pin], &[]);
    assert_eq!(code, 0, "{err}");
    let unchecked = json_of(&out);
    assert!(unchecked["consistency"].as_str().unwrap().starts_with("NOT CHECKED"), "{unchecked}");
    assert!(unchecked["consistencyFrom"].is_null() && err.contains("NOT CHECKED"), "{unchecked} {err}");
    let (code, _, err) = offline(&["audit", "check-proof", "node.tlog-proof", "--pin", &pin, "--saved", "saved.checkpoint"], &[]);
    assert_eq!(code, 1, "--saved without a consistency proof is refused, not skipped");
    assert!(err.contains("no consistency proof from your saved checkpoint"), "{err}");
    std::fs::rename(auditor.path().join("moved.consistency"), auditor.path().join("node.tlog-proof.consistency")).unwrap();

    // Refusals: another pin, a changed path hash, a changed event.
    let (code, _, err) = offline(
        &["audit", "check-proof", "node.tlog-proof", "--pin", "sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="],
        &[],
    );
    assert_eq!(code, 1);
    assert!(err.starts_with("INVALID_PROOF: "), "{err}");
    let text = std::fs::read_to_string(&proof).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let path_line = lines.iter().position(|l| l.starts_with("index ")).unwrap() + 1;
    let mut tampered: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let flipped = if tampered[path_line].starts_with('A') { "B" } else { "A" };
    tampered[path_line].replace_range(0..1, flipped);
    std::fs::write(auditor.path().join("bad.tlog-proof"), tampered.join("\n") + "\n").unwrap();
    let (code, _, err) = offline(&["audit", "check-proof", "bad.tlog-proof", "--pin", &pin], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("INVALID_PROOF"), "{err}");
    let (code, _, err) = offline(&["audit", "check-proof", "node.tlog-proof", "--pin", "not-a-pin"], &[]);
    assert_eq!(code, 2, "{err}");
}

#[tokio::test]
async fn verify_reports_tampering_with_audit_tampered() {
    let mut server = Server::dev();
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    for i in 0..5 {
        server.pool(&format!("p{i}")).await;
    }
    // Regression (review): a client's idempotency key once shared the sealer's namespace and
    // could block a tenant's checkpoints.
    let token = server.token.clone();
    let (status, _) = server.call_as(&token, "pools.create", json!({ "name": "squatter" }), Some("checkpoint:8")).await;
    assert_eq!(status, 200);
    let (code, _, err) = cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    server.stop();
    let (code, out, err) = cli(&["audit", "verify", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let summary = json_of(&out);
    assert_eq!(
        (summary["ok"].as_bool(), summary["events"].as_u64(), summary["checkpoints"].as_u64()),
        (Some(true), Some(9), Some(1))
    );

    // Change one stored byte of seq 4.
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    sqlx::query("UPDATE events SET canonical = canonical || X'00' WHERE seq = 4").execute(store.pool()).await.unwrap();
    let (code, out, err) = cli(&["audit", "verify", "--data-dir", &data_dir, "--query", "problems"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("AUDIT_TAMPERED: "), "{err}");
    let problems = json_of(&out);
    assert_eq!(problems[0]["seq"], 4, "{problems}");
    assert_eq!(problems[0]["tenantId"], "ten_00000000000000000000000000");
}

#[tokio::test]
async fn rotating_the_log_key_keeps_old_checkpoints_verifying() {
    let mut server = Server::dev();
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    server.pool("before").await;
    let (code, _, err) = cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let old_pin = json_of(&cli(&["pki", "show", "--data-dir", &data_dir], &[]).1)["pin"].as_str().unwrap().to_owned();
    let auditor = tempfile::tempdir().unwrap();
    let (_, events, _) = server.cli(&["events", "list", "--format", "json"]);
    let first_pool = json_of(&events)["items"][2]["id"].as_str().unwrap().to_owned();
    let old_proof = auditor.path().join("old.tlog-proof");
    let (code, _, err) =
        cli(&["audit", "prove", &first_pool, "--out", old_proof.to_str().unwrap(), "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");

    let rotated = server.rotate_log_key_offline();
    let new_pin = rotated["pin"].as_str().unwrap().to_owned();
    assert_ne!(new_pin, old_pin);
    server.pool("after").await;
    let (_, events, _) = server.cli(&["events", "list", "--format", "json"]);
    let items = json_of(&events)["items"].as_array().unwrap().clone();
    let rotation = items.iter().find(|e| e["type"] == "log_key.rotated").expect("the rotation is in the log");
    assert_eq!(rotation["keyId"].as_str(), rotated["previousKeyId"].as_str(), "signed by the old key");
    assert_eq!(rotation["payload"]["newKeyId"], rotated["keyId"]);
    let after =
        items.iter().find(|e| e["type"] == "pool.created" && e["keyId"] == rotated["keyId"]).expect("new events use the new key");

    // Sealing reads the old checkpoint under the old key, and signs with the new one.
    let (code, out, err) = cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json_of(&out)["sealed"].as_array().unwrap().len(), 1);
    server.stop();
    let (code, out, err) = cli(&["audit", "verify", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}{out}");
    // The rotation sealed a root checkpoint with the old key, covering the announcement.
    assert_eq!(json_of(&out)["checkpoints"], 3);
    assert!(rotated["rotationCheckpointSize"].as_u64().unwrap() >= rotated["rotationSeq"].as_u64().unwrap(), "{rotated}");

    let new_proof = auditor.path().join("new.tlog-proof");
    let (code, _, err) = cli(
        &["audit", "prove", after["id"].as_str().unwrap(), "--out", new_proof.to_str().unwrap(), "--data-dir", &data_dir],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = cli(&["audit", "check-proof", old_proof.to_str().unwrap(), "--pin", &old_pin], &[]);
    assert_eq!(code, 0, "old proofs keep verifying under the old pin: {err}");
    let (code, _, err) = cli(&["audit", "check-proof", new_proof.to_str().unwrap(), "--pin", &new_pin], &[]);
    assert_eq!(code, 0, "{err}");
    // The old pin alone follows the rotation the old key signed and sealed.
    let (code, out, err) = cli(&["audit", "check-proof", new_proof.to_str().unwrap(), "--pin", &old_pin], &[]);
    assert_eq!(code, 0, "a proof made after the rotation checks with only the old pin: {err}");
    assert_eq!(json_of(&out)["keyId"], rotated["keyId"]);
    // Without the rotation's proof, the old pin does not vouch for the new key.
    let text = std::fs::read_to_string(&new_proof).unwrap();
    let mut file = bc_core::note::ProofFile::parse(&text).unwrap();
    assert_eq!(file.rotations.len(), 1);
    let stripped = auditor.path().join("stripped.tlog-proof");
    let mut bad_event = file.clone();
    file.rotations.clear();
    std::fs::write(&stripped, file.encode()).unwrap();
    let (code, _, err) = cli(&["audit", "check-proof", stripped.to_str().unwrap(), "--pin", &old_pin], &[]);
    assert_eq!(code, 1, "the old pin does not vouch for the new key's checkpoints unproved: {err}");
    // A rotation event altered (another new key) no longer matches its inclusion proof.
    let other = bc_core::keys::LogKey::from_seed([5; 32]);
    let mut envelope = bc_core::event::Envelope::from_canonical(&bad_event.rotations[0].event).unwrap();
    envelope.payload = ciborium::Value::Map(vec![
        (ciborium::Value::Text("previousKeyId".into()), ciborium::Value::Text(rotated["previousKeyId"].as_str().unwrap().into())),
        (ciborium::Value::Text("newKeyId".into()), ciborium::Value::Text(other.key_id().to_owned())),
        (ciborium::Value::Text("newPublicKey".into()), ciborium::Value::Bytes(other.public().as_bytes().to_vec())),
    ]);
    bad_event.rotations[0].event = envelope.to_canonical().unwrap();
    std::fs::write(&stripped, bad_event.encode()).unwrap();
    let (code, _, err) = cli(&["audit", "check-proof", stripped.to_str().unwrap(), "--pin", &old_pin], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("key rotation 1"), "{err}");
}
