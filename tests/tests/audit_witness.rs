//! Witnesses: a third-party C2SP witness on loopback (`siglog`'s `witness` 0.1.0, from
//! crates.io; `make witness` installs it under target/tools/) cosigns the checkpoints `dev
//! --witness` sends it, the first while it was still down (sealing went on without it);
//! `check-proof --witness` accepts the cosigned proof and refuses one whose checkpoint lacks the
//! cosignatures; the witness refuses a forked checkpoint of a size it has seen.

use std::time::Duration;

use base64::Engine;
use bc_tests::{Server, cli};
use serde_json::Value;
use sha2::{Digest, Sha256};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

fn witness_bin() -> std::path::PathBuf {
    let path = std::env::var_os("BC_WITNESS_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools/bin/witness"));
    assert!(path.exists(), "no witness at {} (run `make witness`)", path.display());
    path
}

/// An Ed25519 note key: (private key in the Go note format, vkey).
fn note_key(name: &str, seed: [u8; 32]) -> (String, String) {
    let public = ed25519_dalek::SigningKey::from_bytes(&seed).verifying_key();
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update([b'\n', 1]);
    h.update(public.as_bytes());
    let id = hex(&h.finalize()[..4]);
    let mut private = vec![1u8];
    private.extend_from_slice(&seed);
    let mut key = vec![1u8];
    key.extend_from_slice(public.as_bytes());
    (format!("PRIVATE+KEY+{name}+{id}+{}", B64.encode(private)), format!("{name}+{id}+{}", B64.encode(key)))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct Child(std::process::Child);
impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn checkpoint(server: &Server) -> String {
    let root = bc_core::id::TenantId::ROOT;
    let r = server.http.get(format!("{}/audit/{root}/checkpoint", server.url)).bearer_auth(&server.token).send().await.unwrap();
    r.text().await.unwrap()
}

fn seal(server: &Server) -> u64 {
    let (code, out, err) = cli(&["audit", "checkpoint", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str::<Value>(&out).unwrap()["sealed"][0]["treeSize"].as_u64().unwrap()
}

#[tokio::test]
async fn a_third_party_witness_cosigns_and_check_proof_counts_it() {
    let bin = witness_bin();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (witness_private, witness_vkey) = note_key("witness.test", [9; 32]);
    let witness_url = format!("http://127.0.0.1:{port}");
    let server = Server::dev_with(&["--no-reconcilers", "--witness", &format!("w1={witness_url}+{witness_vkey}")]);
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    let (_, pki, _) = cli(&["pki", "show", "--data-dir", &data_dir], &[]);
    let pki: Value = serde_json::from_str(&pki).unwrap();
    let (pin, log_vkey) = (pki["pin"].as_str().unwrap().to_owned(), pki["vkey"].as_str().unwrap().to_owned());
    let origin = bc_core::note::origin_of("better-compute", &bc_core::id::TenantId::ROOT);

    // The witness is down: sealing does not wait for it.
    for i in 0..5 {
        server.pool(&format!("p{i}")).await;
    }
    let first = seal(&server);
    let (_, events, _) = server.cli(&["events", "list", "--format", "json"]);
    let event = serde_json::from_str::<Value>(&events).unwrap()["items"][2]["id"].as_str().unwrap().to_owned();
    let auditor = tempfile::tempdir().unwrap();
    let uncosigned = auditor.path().join("uncosigned.tlog-proof");
    let (code, _, err) = cli(&["audit", "prove", &event, "--out", uncosigned.to_str().unwrap(), "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");

    let dir = tempfile::tempdir().unwrap();
    let _witness = Child(
        std::process::Command::new(&bin)
            .args(["--database-url", &format!("sqlite:{}?mode=rwc", dir.path().join("w.db").display())])
            .args([
                "--private-key",
                &witness_private,
                "--log",
                &format!("{origin}={log_vkey}"),
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("witness.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let key = bc_core::witness::WitnessKey::parse(&witness_vkey).unwrap();
    let mut note = String::new();
    for _ in 0..600 {
        note = checkpoint(&server).await;
        if key.cosigned(&note) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        key.cosigned(&note),
        "no cosignature within 60 s: {note}\n{}\n{}",
        server.log_text(),
        std::fs::read_to_string(dir.path().join("witness.log")).unwrap_or_default()
    );
    assert!(note.contains(&format!("\n{first}\n")));

    // The witnesses reconciler records its passes like every other: the
    // cosignature is counted.
    let mut row = Value::Null;
    for _ in 0..100 {
        let (code, out, err) = server.cli(&["reconcilers", "status", "--data-dir", &data_dir, "--format", "json"]);
        assert_eq!(code, 0, "{err}");
        let rows: Value = serde_json::from_str(&out).unwrap();
        row = rows["items"].as_array().unwrap().iter().find(|r| r["name"] == "witnesses").cloned().unwrap_or(Value::Null);
        if row["counts"]["cosigned"].as_u64().unwrap_or(0) >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(row["ok"] == true && row["counts"]["cosigned"].as_u64().unwrap_or(0) >= 1, "the witnesses' status: {row}");

    // A proof made now carries the cosignature; check-proof counts it.
    let proof = auditor.path().join("cosigned.tlog-proof");
    let (code, _, err) = cli(&["audit", "prove", &event, "--out", proof.to_str().unwrap(), "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let check = |file: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["audit", "check-proof", file.to_str().unwrap(), "--pin", &pin];
        args.extend_from_slice(extra);
        cli(&args, &[])
    };
    let (code, out, err) = check(&proof, &["--witness", &witness_vkey]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["witnessesCosigned"], 1);
    let (code, _, err) = check(&uncosigned, &["--witness", &witness_vkey]);
    assert_eq!(code, 1, "a checkpoint without the cosignature is refused");
    assert!(err.contains("cosigned by 0 of the 1 witnesses"), "{err}");
    let (_, other) = note_key("other.test", [10; 32]);
    let (code, _, err) = check(&proof, &["--witness", &witness_vkey, "--witness", &other]);
    assert_eq!(code, 1, "both required by default: {err}");
    let (code, _, err) = check(&proof, &["--witness", &witness_vkey, "--witness", &other, "--witnesses-min", "1"]);
    assert_eq!(code, 0, "{err}");

    // doctor: the witness answers and cosigned the newest checkpoint; one at a port nobody
    // listens on is a failure naming it.
    let w1 = format!("w1={witness_url}+{witness_vkey}");
    let down = format!("w2=http://127.0.0.1:1+{other}");
    let (_, out, err) = cli(&["doctor", "--data-dir", &data_dir, "--json", "--witness", &w1, "--witness", &down], &[]);
    let checks: Vec<Value> = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    let witnesses: Vec<&Value> = checks.iter().filter(|c| c["name"] == "witness").collect();
    assert_eq!(witnesses.len(), 2, "{checks:?}");
    assert_eq!(witnesses[0]["status"], "ok", "{:?}", witnesses[0]);
    assert!(witnesses[0]["message"].as_str().unwrap().contains("cosigned the newest checkpoint"), "{:?}", witnesses[0]);
    assert_eq!(witnesses[1]["status"], "fail", "{:?}", witnesses[1]);
    assert!(witnesses[1]["message"].as_str().unwrap().starts_with("w2 at http://127.0.0.1:1"), "{:?}", witnesses[1]);

    // The log grows: the witness checks our consistency proof from the size it has.
    for i in 0..3 {
        server.pool(&format!("q{i}")).await;
    }
    let second = seal(&server);
    cosigned(&server, &key, second).await;

    // A fork of a size the witness has seen is refused.
    let log_key = bc_core::keys::LogKey::load(&server.data_dir.join("log.key")).unwrap();
    let forked = bc_core::note::CheckpointBody { origin: origin.clone(), size: second, root: [7; 32] };
    let forked = bc_core::note::sign_note(&forked.encode(), "better-compute", &log_key).unwrap();
    let response = server
        .http
        .post(format!("{witness_url}/add-checkpoint"))
        .body(bc_core::witness::add_checkpoint_body(second, &[], &forked))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    assert!(matches!(status, 409 | 422), "the witness must refuse a fork: {status} {body}");

    // Again: this proof comes from the tree the reconciler kept at the second checkpoint and the
    // events appended since (the second one's came from every leaf), and the witness checks it.
    for i in 0..3 {
        server.pool(&format!("r{i}")).await;
    }
    let third = seal(&server);
    cosigned(&server, &key, third).await;
    // At the first try: a proof the witness refused would be made again from every leaf on the
    // retry, and pass.
    let refused = format!("\"size\":{third},");
    let logs = server.log_text();
    assert!(!logs.lines().any(|l| l.contains("witness did not cosign") && l.contains(&refused)), "{logs}");
}

/// Waits (up to 60 s) for the newest checkpoint to be of `size` and cosigned by `key`.
async fn cosigned(server: &Server, key: &bc_core::witness::WitnessKey, size: u64) {
    let mut note = String::new();
    for _ in 0..600 {
        note = checkpoint(server).await;
        if note.contains(&format!("\n{size}\n")) && key.cosigned(&note) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no cosignature of size {size}: {note}\n{}", server.log_text());
}
