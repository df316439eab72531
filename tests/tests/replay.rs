//! `events export` and `sim replay` through the real binary: a `dev` run's root tenant (pools,
//! nodes, reservations, a release) exported and replayed offline. The replayed rows are the
//! server's own projection rows for the tenant, `--until` a seq gives the state at that seq, and
//! a file that does not verify is refused with a stable code naming the record. The file is
//! also read by an independent decoder (minicbor, SHA-256 and Ed25519 here), from the format
//! as `schema/LOG-FORMAT.md` writes it down.

use std::path::Path;

use bc_core::id::TenantId;
use bc_core::store::LogStore;
use bc_tests::{Server, cli, json, log_key_pin, rows_sorted};
use serde_json::{Value, json};

/// Two pools, two nodes of four GPUs, three reservations of two GPUs, the first released.
/// Returns the released reservation's id.
async fn populate(server: &Server) -> String {
    let pool = server.pool("replay-a").await;
    server.pool("replay-b").await;
    server.h100_nodes(&pool, 2).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (status, r) = server.call("reservations.create", json!({ "poolId": pool, "gpus": 2, "durationS": 3600 })).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["state"], "active", "{r}");
        ids.push(r["reservationId"].as_str().unwrap().to_owned());
    }
    let (status, released) = server.call("reservations.release", json!({ "reservationId": ids[0] })).await;
    assert_eq!(status, 200, "{released}");
    assert_eq!(released["state"], "released");
    ids.swap_remove(0)
}

/// The rows of `--rows-out`, as `(kind, id, doc)`.
fn rows_of(path: &Path) -> (Value, Vec<(String, String, Value)>) {
    let document = json(&std::fs::read_to_string(path).unwrap());
    let rows = document["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["kind"].as_str().unwrap().to_owned(), r["id"].as_str().unwrap().to_owned(), r["doc"].clone()))
        .collect();
    (document, rows)
}

fn replay(args: &[&str]) -> (i32, Value, String) {
    let mut all = vec!["sim", "replay"];
    all.extend_from_slice(args);
    let (code, out, err) = cli(&all, &[]);
    (code, if code == 0 { json(&out) } else { Value::Null }, err)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_of_a_dev_run_replays_to_the_servers_rows_and_to_any_earlier_seq() {
    let mut server = Server::dev();
    let released = populate(&server).await;
    server.stop();
    let data_dir = server.data_dir.display().to_string();
    let root = TenantId::ROOT.to_string();
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("root.bcx");
    let file_arg = file.display().to_string();

    let (code, out, err) = cli(&["events", "export", "--tenant", &root, "--data-dir", &data_dir, "--out", &file_arg], &[]);
    assert_eq!(code, 0, "{err}");
    let exported = json(&out);
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    let chain = store.read_chain_rows(TenantId::ROOT, 1, 1000).await.unwrap();
    assert_eq!(exported["events"], chain.len() as u64, "{exported}");
    assert_eq!((exported["fromSeq"].as_u64(), exported["toSeq"].as_u64()), (Some(1), Some(chain.len() as u64)));
    let leftovers: Vec<_> = std::fs::read_dir(work.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "only the export, no temporary file: {leftovers:?}");
    let (code, _, err) = cli(&["events", "export", "--tenant", &root, "--data-dir", &data_dir, "--out", &file_arg], &[]);
    assert_eq!(code, 1, "never over a file");
    assert!(err.starts_with("ALREADY_EXISTS: "), "{err}");

    // The whole file: the server's own rows for the tenant.
    let pin = log_key_pin(&server);
    let rows_path = work.path().join("rows.json");
    let (code, summary, err) = replay(&[&file_arg, "--log-key-pin", &pin, "--rows-out", &rows_path.display().to_string()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!((summary["events"].as_u64(), summary["atSeq"].as_u64()), (Some(chain.len() as u64), Some(chain.len() as u64)));
    let server_rows: Vec<(String, String, Value)> =
        rows_sorted(&store).await.into_iter().filter(|r| r.key.tenant == root).map(|r| (r.key.kind, r.key.id, r.doc)).collect();
    let (document, replayed) = rows_of(&rows_path);
    assert!(server_rows.len() >= 10, "too few rows to mean anything: {}", server_rows.len());
    assert_eq!(replayed, server_rows, "the replayed rows are the server's");
    assert_eq!(document["stateDigest"], summary["stateDigest"]);
    assert_eq!(summary["kinds"]["reservation"], 3, "{summary}");
    assert_eq!(summary["kinds"]["pool"], 2, "{summary}");
    let doc_of = |rows: &[(String, String, Value)], kind: &str, id: &str| {
        rows.iter().find(|(k, i, _)| k == kind && i == id).map(|(_, _, d)| d.clone()).unwrap()
    };
    assert_eq!(doc_of(&replayed, "reservation", &released)["state"], "released");

    // Just before the release: the reservation is still active, and the state differs.
    let release_seq = chain
        .iter()
        .find(|r| r.event_type == "reservation.released" && r.stream == format!("reservation/{released}"))
        .expect("the release is in the chain")
        .seq;
    let early_path = work.path().join("early.json");
    let until = (release_seq - 1).to_string();
    let (code, early, err) =
        replay(&[&file_arg, "--log-key-pin", &pin, "--until", &until, "--rows-out", &early_path.display().to_string()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(early["atSeq"].as_u64(), Some(release_seq - 1));
    assert_eq!(early["events"], summary["events"], "the whole file is verified");
    assert_ne!(early["stateDigest"], summary["stateDigest"]);
    let (_, early_rows) = rows_of(&early_path);
    assert_eq!(doc_of(&early_rows, "reservation", &released)["state"], "active");

    // Refusals: another log's pin, a changed byte, usage mistakes.
    let other = "sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let (code, _, err) = replay(&[&file_arg, "--log-key-pin", other]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("EXPORT_UNTRUSTED_KEY: "), "{err}");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.windows(8).position(|w| w == b"replay-b").expect("the pool's name is in the file");
    bytes[at + 7] ^= 0x01;
    let tampered = work.path().join("tampered.bcx");
    std::fs::write(&tampered, &bytes).unwrap();
    let (code, _, err) = replay(&[&tampered.display().to_string(), "--log-key-pin", &pin]);
    assert_eq!(code, 1, "{err}");
    let pool_b_seq = chain.iter().find(|r| r.canonical.windows(8).any(|w| w == b"replay-b")).expect("the pool's event").seq;
    assert!(err.starts_with(&format!("EXPORT_TAMPERED: seq {pool_b_seq}: ")), "{err}");
    let (code, _, err) = replay(&[&file_arg]);
    assert_eq!(code, 2, "no pin: {err}");
    let past = (chain.len() + 1).to_string();
    let (code, _, err) = replay(&[&file_arg, "--log-key-pin", &pin, "--until", &past]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = cli(&["events", "export", "--data-dir", &data_dir, "--out", "/nonexistent/x"], &[]);
    assert_eq!(code, 2, "no tenant: {err}");

    independent_read(&std::fs::read(&file).unwrap(), chain.len() as u64, &pin);
}

/// Reads the file with minicbor, as a reader written from `schema/LOG-FORMAT.md` would: the
/// header names the format and the keys; each record's hash is SHA-256 of its event bytes, its
/// `prev` the hash before, and its signature, when it carries one, verifies under the key its
/// `keyId` names; the last record carries one.
fn independent_read(bytes: &[u8], events: u64, pin: &str) {
    use base64::Engine;
    use ed25519_dalek::{Signature, Verifier, VerifyingKey};
    use sha2::{Digest, Sha256};
    let mut d = minicbor::Decoder::new(bytes);
    let mut keys = std::collections::HashMap::new();
    let entries = d.map().unwrap().expect("a definite map");
    for _ in 0..entries {
        match d.str().unwrap() {
            "format" => assert_eq!(d.str().unwrap(), "better-compute/events-export"),
            "version" => assert_eq!(d.u64().unwrap(), 2),
            "keys" => {
                for _ in 0..d.array().unwrap().unwrap() {
                    let (mut id, mut public) = (String::new(), Vec::new());
                    for _ in 0..d.map().unwrap().unwrap() {
                        match d.str().unwrap() {
                            "keyId" => id = d.str().unwrap().to_owned(),
                            "publicKey" => public = d.bytes().unwrap().to_vec(),
                            other => panic!("unknown key field {other}"),
                        }
                    }
                    let pin_of = format!("sha256/{}", base64::engine::general_purpose::STANDARD.encode(Sha256::digest(&public)));
                    keys.insert(id, (VerifyingKey::from_bytes(&public.try_into().unwrap()).unwrap(), pin_of));
                }
            }
            _ => d.skip().unwrap(),
        }
    }
    assert!(keys.values().any(|(_, p)| p == pin), "the pinned key is in the header");
    let (mut prev, mut seen, mut unsigned) = (vec![0u8; 32], 0u64, 0u64);
    while d.position() < bytes.len() {
        let (mut seq, mut event, mut hash, mut record_prev, mut sig, mut key_id) =
            (0, vec![], vec![], vec![], vec![], String::new());
        for _ in 0..d.map().unwrap().unwrap() {
            match d.str().unwrap() {
                "seq" => seq = d.u64().unwrap(),
                "event" => event = d.bytes().unwrap().to_vec(),
                "hash" => hash = d.bytes().unwrap().to_vec(),
                "prev" => record_prev = d.bytes().unwrap().to_vec(),
                "sig" => sig = d.bytes().unwrap().to_vec(),
                "keyId" => key_id = d.str().unwrap().to_owned(),
                "commit" | "index" => {
                    d.u64().unwrap();
                }
                other => panic!("unknown record field {other}"),
            }
        }
        seen += 1;
        assert_eq!(seq, seen);
        assert_eq!(Sha256::digest(&event).to_vec(), hash, "seq {seq}");
        assert_eq!(record_prev, prev, "seq {seq}");
        // A record without a signature of its own is covered by the next that has one.
        if sig.is_empty() {
            assert!(key_id.is_empty(), "seq {seq}: a keyId without a sig");
            unsigned += 1;
        } else {
            let mut message = b"better-compute/event/v1\n".to_vec();
            message.extend_from_slice(&hash);
            let (key, _) = &keys[&key_id];
            key.verify(&message, &Signature::from_slice(&sig).unwrap()).unwrap_or_else(|e| panic!("seq {seq}: {e}"));
            unsigned = 0;
        }
        prev = hash;
    }
    assert_eq!(seen, events);
    assert_eq!(unsigned, 0, "the last record is signed");
}

/// `pki rotate-log-key` between two runs: the export names both keys and carries the rotation's
/// proof, so the old pin alone replays the whole chain (the new key is trusted from the
/// rotation the old key signed and sealed), and the new pin alone does not vouch for the
/// records before it. Ranges: `--to` gives a prefix that replays; `--from` past 1 verifies no
/// state and is refused for a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_across_a_key_rotation_replays_from_the_old_pin_and_ranges_are_prefixes() {
    let mut server = Server::dev();
    server.pool("before-rotation").await;
    let old_pin = log_key_pin(&server);
    server.stop();
    let data_dir = server.data_dir.display().to_string();
    let (code, out, err) = cli(&["pki", "rotate-log-key", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let new_pin = json(&out)["pin"].as_str().unwrap().to_owned();
    server.restart();
    server.pool("after-rotation").await;
    server.stop();

    let root = TenantId::ROOT.to_string();
    let work = tempfile::tempdir().unwrap();
    let export = |name: &str, range: &[&str]| {
        let path = work.path().join(name).display().to_string();
        let mut args = vec!["events", "export", "--tenant", &root, "--data-dir", &data_dir, "--out", &path];
        args.extend_from_slice(range);
        let (code, out, err) = cli(&args, &[]);
        assert_eq!(code, 0, "{err}");
        (path, json(&out))
    };
    let (file, exported) = export("root.bcx", &[]);
    assert_eq!(exported["rotations"], 1, "{exported}");
    assert_eq!(exported["keyIds"].as_array().unwrap().len(), 2, "both keys signed records: {exported}");
    let (code, summary, err) = replay(&[&file, "--log-key-pin", &old_pin]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(summary["events"], exported["events"]);
    assert_eq!(summary["kinds"]["pool"], 2, "{summary}");
    let (code, _, err) = replay(&[&file, "--log-key-pin", &new_pin]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.starts_with("EXPORT_TAMPERED: seq 1: ") && err.contains("does not vouch for"),
        "the new key did not sign seq 1: {err}"
    );

    // A prefix replays to the state at its end, the same as --until there on the whole file.
    let (prefix, _) = export("prefix.bcx", &["--to", "3"]);
    let (code, short, err) = replay(&[&prefix, "--log-key-pin", &old_pin]);
    assert_eq!(code, 0, "{err}");
    let (code, until, err) = replay(&[&file, "--log-key-pin", &old_pin, "--until", "3"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!((short["events"].as_u64(), short["atSeq"].as_u64()), (Some(3), Some(3)));
    assert_eq!(short["stateDigest"], until["stateDigest"]);
    let (middle, exported) = export("middle.bcx", &["--from", "2", "--to", "3"]);
    assert_eq!((exported["fromSeq"].as_u64(), exported["events"].as_u64()), (Some(2), Some(2)));
    let (code, _, err) = replay(&[&middle, "--log-key-pin", &old_pin]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("REPLAY_PARTIAL_FILE: "), "{err}");
}

/// `sim replay --what-if`: a dev run's reservations decided again under another queue rule and
/// another placement. The baseline (the control plane's own rules) reproduces the log; backfill
/// lets a small request past a large one that waits, spread puts a request on the emptier node,
/// and each shows the first decision that differs and what followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_what_if_shows_the_first_decision_that_differs_and_what_followed() {
    let mut server = Server::dev();
    let pool = server.pool("what-if").await;
    let mut nodes = server.h100_nodes(&pool, 2).await;
    nodes.sort();
    let reserve = |gpus: u32| {
        let server = &server;
        let pool = pool.clone();
        async move {
            let (status, r) =
                server.call("reservations.create", json!({ "poolId": pool, "gpus": gpus, "durationS": 3600 })).await;
            assert_eq!(status, 200, "{r}");
            r
        }
    };
    // n0: E (1) and A (2), the tightest fit; B (4) takes n1; C (2) waits, and D (1) waits
    // behind it (FIFO) though one GPU of n0 is free.
    let e = reserve(1).await;
    let a = reserve(2).await;
    let b = reserve(4).await;
    let c = reserve(2).await;
    let d = reserve(1).await;
    assert_eq!([&e, &a, &b].map(|r| r["state"].as_str().unwrap()), ["active"; 3]);
    assert_eq!(
        (a["nodeId"].as_str(), c["state"].as_str(), d["state"].as_str()),
        (Some(nodes[0].as_str()), Some("queued"), Some("queued"))
    );
    let (status, released) = server.call("reservations.release", json!({ "reservationId": a["reservationId"] })).await;
    assert_eq!(status, 200, "{released}");
    let id = |r: &Value| r["reservationId"].as_str().unwrap().to_owned();
    bc_tests::wait_until("C and D active", std::time::Duration::from_secs(20), || {
        let states: Vec<String> = [&c, &d]
            .iter()
            .map(|r| {
                let out = server.cli(&["reservations", "get", &id(r)]).1;
                json(&out)["state"].as_str().unwrap_or_default().to_owned()
            })
            .collect();
        (states == ["active", "active"]).then_some(())
    });
    server.stop();
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("root.bcx").display().to_string();
    let data_dir = server.data_dir.display().to_string();
    let (code, _, err) =
        cli(&["events", "export", "--tenant", &TenantId::ROOT.to_string(), "--data-dir", &data_dir, "--out", &file], &[]);
    assert_eq!(code, 0, "{err}");
    let pin = log_key_pin(&server);

    // The control plane's own rules: no divergence, and the model reproduces the log.
    let (code, same, err) = replay(&[&file, "--log-key-pin", &pin, "--what-if", "queue=fifo"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(same["whatIf"]["baseline"]["reproducesLog"], true, "{same}");
    assert!(same["whatIf"]["firstDivergence"].is_null(), "{same}");

    // Backfill: D goes at once on n0's free GPU; C still waits for A's release.
    let report = work.path().join("what-if.html");
    let (code, backfill, err) =
        replay(&[&file, "--log-key-pin", &pin, "--what-if", "queue=backfill", "--report", &report.display().to_string()]);
    assert_eq!(code, 0, "{err}");
    let found = &backfill["whatIf"];
    assert_eq!(found["policy"], json!({ "queue": "backfill", "placement": "tightest-fit" }), "{found}");
    assert_eq!(found["baseline"]["reproducesLog"], true, "{found}");
    let divergence = &found["firstDivergence"];
    assert_eq!(
        (divergence["whatIf"]["action"].as_str(), divergence["whatIf"]["reservationId"].as_str()),
        (Some("activate"), Some(id(&d).as_str())),
        "{divergence}"
    );
    assert_eq!(divergence["whatIf"]["nodeId"], nodes[0].as_str(), "{divergence}");
    assert_eq!(
        divergence["baseline"]["reservationId"],
        id(&c).as_str(),
        "the baseline's next decision: C, at A's release: {divergence}"
    );
    assert_eq!(
        (found["followed"]["activatedEarlier"].as_u64(), found["followed"]["activatedLater"].as_u64()),
        (Some(1), Some(0)),
        "{found}"
    );
    let page = std::fs::read_to_string(&report).unwrap();
    assert!(page.contains("mark-divergence"), "the report marks the divergence");

    // Spread: A goes to the empty n1, so B (4) finds no whole node and waits for A's release.
    let (code, spread, err) = replay(&[&file, "--log-key-pin", &pin, "--what-if", "placement=spread"]);
    assert_eq!(code, 0, "{err}");
    let divergence = &spread["whatIf"]["firstDivergence"];
    assert_eq!(divergence["whatIf"]["reservationId"], id(&a).as_str(), "{divergence}");
    assert_eq!(
        (divergence["baseline"]["nodeId"].as_str(), divergence["whatIf"]["nodeId"].as_str()),
        (Some(nodes[0].as_str()), Some(nodes[1].as_str())),
        "{divergence}"
    );
    assert_eq!(spread["whatIf"]["followed"]["activatedLater"], 1, "B waits: {spread}");

    // Bad keys and values: usage errors naming what is taken.
    for (bad, says) in [("queue=lifo", "fifo and backfill"), ("colour=blue", "queue=fifo|backfill"), ("queue", "KEY=VALUE")] {
        let (code, _, err) = replay(&[&file, "--log-key-pin", &pin, "--what-if", bad]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains(says), "{bad}: {err}");
    }
}
