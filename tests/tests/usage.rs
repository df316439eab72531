//! Usage end to end with the real binary: reservations on registered H100 nodes, the `usage`
//! reconciler closing 2-second windows (`--usage-window 2s`), `usage list` adding up to exactly
//! each reservation's active time, prices frozen into the rows, and `usage export` checked by tools
//! this project did not write: the FinOps Foundation's focus-validator (FOCUS 1.0) on the CSV and
//! the CloudEvents SDK for Python on every JSON line (`tests/scripts/usage_check.py`, in the
//! virtual environment `make usage-venv` makes).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bc_tests::Server;
use serde_json::Value;

const WINDOW_MS: u64 = 2000;
const WAIT: Duration = Duration::from_secs(60);
const SKU: &str = "H100-SXM5-80GB";
/// 3.6 per GPU-hour: a millionth per GPU-millisecond, so a row's cost in millionths is its
/// GPU-milliseconds.
const PRICE: &str = "3.6";

/// The Python of `make usage-venv` (`BC_USAGE_PYTHON` names another). Missing, the test fails: it
/// never skips.
fn usage_python() -> PathBuf {
    let path = std::env::var_os("BC_USAGE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/usage-venv/bin/python"));
    assert!(
        path.exists(),
        "no Python with focus-validator at {} (run `make usage-venv`, which `make test` runs; it installs from PyPI)",
        path.display()
    );
    path
}

/// Runs the outside checkers on an export; their JSON verdict.
fn check(csv: &Path, jsonl: &Path) -> Value {
    let out = std::process::Command::new(usage_python())
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/usage_check.py"))
        .arg(csv)
        .arg(jsonl)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/usage-focus-overrides.yaml"))
        .output()
        .expect("python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}{}", String::from_utf8_lossy(&out.stderr)))
}

fn cli_json(server: &Server, args: &[&str]) -> Value {
    let (code, out, err) = server.cli(args);
    assert_eq!(code, 0, "{args:?}: {err}");
    bc_tests::json(&out)
}

/// Every usage row since the epoch, all pages.
fn rows(server: &Server) -> Vec<Value> {
    rows_paged(server, "500")
}

/// Every usage row since the epoch, in pages of `limit` rows.
fn rows_paged(server: &Server, limit: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut args = vec!["usage", "list", "--from", "0", "--limit", limit, "--format", "json"];
        if let Some(c) = &cursor {
            args.extend(["--cursor", c.as_str()]);
        }
        let page = cli_json(server, &args);
        all.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return all,
        }
    }
}

#[tokio::test]
async fn windows_add_up_to_each_reservation_and_the_export_passes_focus_and_cloudevents() {
    usage_python();
    let server = Server::dev_with(&["--usage-window", "2s"]);
    let pool = server.pool("gpu").await;
    server.h100_nodes(&pool, 2).await;
    let price = cli_json(
        &server,
        &["usage", "prices", "set", "--sku", SKU, "--currency", "USD", "--gpu-hour-price", PRICE, "--from", "0"],
    );
    assert_eq!(price["periods"][0]["gpuHourMicros"], 3_600_000, "{price}");
    let (code, _, err) =
        server.cli(&["usage", "prices", "set", "--sku", "bad sku", "--currency", "USD", "--gpu-hour-price", "1"]);
    assert_ne!(code, 0);
    assert!(err.contains("INVALID_ARGUMENT"), "{err}");

    // Two reservations: one released after about 3 windows, one that expires after 3 s.
    let reserve = |gpus: &str, duration: &str| {
        let r = cli_json(&server, &["reserve", "--pool", &pool, "--gpus", gpus, "--for", duration, "--format", "json"]);
        assert_eq!(r["state"], "active", "{r}");
        r["reservationId"].as_str().unwrap().to_owned()
    };
    let released = reserve("2", "1h");
    let expiring = reserve("4", "3s");
    std::thread::sleep(Duration::from_millis(3 * WINDOW_MS + 500));
    cli_json(&server, &["release", &released, "--format", "json"]);

    // Each reservation's rows add up to exactly its GPUs times its active time, once every
    // window it touched has closed.
    let mut spans = BTreeMap::new();
    for id in [&released, &expiring] {
        let deadline = Instant::now() + WAIT;
        let r = loop {
            let r = cli_json(&server, &["reservations", "get", id]);
            if r["endedAtMs"].is_u64() {
                break r;
            }
            assert!(Instant::now() < deadline, "{id} never ended: {r}");
            std::thread::sleep(Duration::from_millis(200));
        };
        let (start, end) = (r["activatedAtMs"].as_u64().unwrap(), r["endedAtMs"].as_u64().unwrap());
        let end = end.min(r["endsAtMs"].as_u64().unwrap());
        spans.insert(id.clone(), (start, end, r["gpus"].as_u64().unwrap()));
    }
    let last_end = spans.values().map(|(_, end, _)| *end).max().unwrap();
    bc_tests::wait_until("the last window to close", WAIT, || {
        let closed = rows(&server).iter().any(|r| r["windowEndMs"].as_u64().unwrap() >= last_end);
        closed.then_some(())
    });
    std::thread::sleep(Duration::from_millis(WINDOW_MS)); // corrections, if an end came late
    let rows = rows(&server);
    // Regression: a page that began inside a usage event skipped as many lines of every later
    // event of the page (a listing of 1,000 reservations showed 60 rows a window). Pages of 3
    // rows cut the windows of two lines mid-event.
    assert!(rows.iter().any(|r| r["line"] == 1), "a usage event of several lines: {rows:#?}");
    assert_eq!(rows_paged(&server, "3"), rows, "the same rows, whatever the page size");
    for (id, (start, end, gpus)) in &spans {
        let mine: Vec<&Value> = rows.iter().filter(|r| r["reservationId"] == id.as_str()).collect();
        let total: i64 = mine.iter().map(|r| r["quantityMs"].as_i64().unwrap()).sum();
        assert_eq!(total, ((end - start) * gpus) as i64, "{id}: {mine:#?}");
        assert!(mine.len() >= 2, "{id} spans several windows: {mine:#?}");
        for r in &mine {
            let (ws, we) = (r["windowStartMs"].as_u64().unwrap(), r["windowEndMs"].as_u64().unwrap());
            assert_eq!((ws % WINDOW_MS, we - ws), (0, WINDOW_MS), "{r}");
            assert!(ws <= r["fromMs"].as_u64().unwrap() && r["toMs"].as_u64().unwrap() <= we, "{r}");
            assert_eq!(r["costMicros"], r["quantityMs"], "priced at {PRICE} per GPU-hour: {r}");
            assert_eq!(r["sku"], SKU);
            assert!(r["seqs"].as_array().unwrap().len() >= 2, "{r}");
        }
    }

    // The table in GPU-hours, and a sum by reservation.
    let (code, table, err) = server.cli(&["usage", "list", "--from", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(table.contains("GPU-hours") && table.contains(&released), "{table}");
    let groups = cli_json(&server, &["usage", "list", "--from", "0", "--group-by", "reservation", "--format", "json"]);
    let (start, end, gpus) = spans[&released];
    let group = groups["groups"].as_array().unwrap().iter().find(|g| g["reservationId"] == released.as_str()).unwrap();
    assert_eq!(group["quantityMs"].as_i64().unwrap(), ((end - start) * gpus) as i64, "{group}");

    // The exports, checked by the outside tools.
    let dir = tempfile::tempdir().unwrap();
    let (csv, jsonl) = (dir.path().join("usage.csv"), dir.path().join("usage.jsonl"));
    for (format, path) in [("csv", &csv), ("jsonl", &jsonl)] {
        let path = path.to_str().unwrap();
        let summary = cli_json(&server, &["usage", "export", "--from", "0", "--export-format", format, "--out", path]);
        assert_eq!(summary["rows"].as_u64().unwrap(), rows.len() as u64, "{summary}");
        let (code, _, err) = server.cli(&["usage", "export", "--from", "0", "--export-format", format, "--out", path]);
        assert!(code != 0 && err.contains("ALREADY_EXISTS"), "an export is never written over a file: {err}");
    }
    let csv_text = std::fs::read_to_string(&csv).unwrap();
    let header: Vec<&str> = csv_text.lines().next().unwrap().split(',').collect();
    for column in ["ResourceId", "SkuPriceId", "x_SourceSeqs", "x_EventSeq", "BilledCost", "ConsumedQuantity"] {
        assert!(header.contains(&column), "{column} in {header:?}");
    }
    assert_eq!(csv_text.lines().count(), rows.len() + 1);
    let verdict = check(&csv, &jsonl);
    assert_eq!(verdict["focus"], "succeeded", "{}", verdict["focusOutput"].as_str().unwrap_or_default());
    assert_eq!(verdict["cloudevents"].as_u64(), Some(rows.len() as u64), "{verdict}");

    // The checkers can fail: a currency that is not ISO 4217, and a record without its id.
    let (bad_csv, bad_jsonl) = (dir.path().join("bad.csv"), dir.path().join("bad.jsonl"));
    std::fs::write(&bad_csv, csv_text.replace(",USD,", ",XXQ,")).unwrap();
    let first = std::fs::read_to_string(&jsonl).unwrap().lines().next().unwrap().replace("\"id\":", "\"idx\":");
    std::fs::write(&bad_jsonl, first).unwrap();
    let verdict = check(&bad_csv, &bad_jsonl);
    assert_eq!(verdict["focus"], "failed", "{verdict}");
    assert!(verdict["cloudeventsError"].as_str().unwrap().starts_with("line 1"), "{verdict}");

    // Priced rows of two reservations over several windows prove offline, costs recounted too.
    let (code, _, err) = bc_tests::cli(&["audit", "checkpoint", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let proved = dir.path().join("proved.jsonl");
    let proved = proved.to_str().unwrap();
    cli_json(&server, &["usage", "export", "--from", "0", "--export-format", "jsonl", "--out", proved, "--with-proofs"]);
    let pin = bc_tests::log_key_pin(&server);
    let proofs = format!("{proved}.proofs");
    let (code, out, err) = bc_tests::cli(&["usage", "verify", "--export", proved, "--proofs", &proofs, "--pin", &pin], &[]);
    assert_eq!(code, 0, "{err}{out}");
    assert_eq!(bc_tests::json(&out)["proved"].as_u64(), Some(rows.len() as u64), "{out}");
}

/// Runs `better-compute ARGS` with no server, no URL and no token: what an auditor holds.
fn offline(args: &[&str]) -> (i32, String, String) {
    bc_tests::cli(args, &[])
}

/// `usage export --with-proofs` and `usage verify`: each row proved offline from the export, its
/// proofs and the log key's pin; before a checkpoint covers the rows they are marked unproved; a
/// quantity edited in the file fails naming the row and the column, in either format; a repeated
/// row fails; a tampered proof fails; and each proof is the file `audit check-proof` reads.
#[tokio::test]
async fn each_row_is_proved_offline_and_an_edited_quantity_fails_naming_its_row() {
    let server = Server::dev_with(&["--usage-window", "2s"]);
    let pool = server.pool("gpu").await;
    server.h100_nodes(&pool, 1).await;
    let r = cli_json(&server, &["reserve", "--pool", &pool, "--gpus", "2", "--for", "3s", "--format", "json"]);
    assert_eq!(r["state"], "active", "{r}");
    let id = r["reservationId"].as_str().unwrap().to_owned();
    let ended = bc_tests::wait_until("the reservation to end", WAIT, || {
        let r = cli_json(&server, &["reservations", "get", &id]);
        r["endedAtMs"].as_u64().map(|end| end.min(r["endsAtMs"].as_u64().unwrap()))
    });
    bc_tests::wait_until("its last window to close", WAIT, || {
        rows(&server).iter().any(|r| r["windowEndMs"].as_u64().unwrap() >= ended).then_some(())
    });
    std::thread::sleep(Duration::from_millis(WINDOW_MS)); // a correction, if the end came late
    let listed = rows(&server);
    assert!(listed.len() >= 2, "{listed:#?}");
    let pin = bc_tests::log_key_pin(&server);
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let verify =
        |export: &str, proofs: &str| offline(&["usage", "verify", "--export", export, "--proofs", proofs, "--pin", &pin]);

    // No checkpoint yet (dev seals hourly): the export is written, its rows marked unproved.
    let early = cli_json(
        &server,
        &["usage", "export", "--from", "0", "--export-format", "csv", "--out", &path("early.csv"), "--with-proofs"],
    );
    assert_eq!(early["proofs"]["eventsProved"], 0, "{early}");
    assert!(early["proofs"]["eventsUnproved"].as_u64().unwrap() > 0, "{early}");
    let (code, out, err) = verify(&path("early.csv"), &path("early.csv.proofs"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("USAGE_UNPROVED") && err.contains("no checkpoint"), "{err}");
    assert_eq!(bc_tests::json(&out)["unproved"].as_u64(), Some(listed.len() as u64), "{out}");

    // Sealed: every row proves, in both formats, from the files and the pin alone.
    let (code, _, err) = bc_tests::cli(&["audit", "checkpoint", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    for (format, name) in [("csv", "usage.csv"), ("jsonl", "usage.jsonl")] {
        let summary = cli_json(
            &server,
            &["usage", "export", "--from", "0", "--export-format", format, "--out", &path(name), "--with-proofs"],
        );
        assert_eq!(summary["proofs"]["eventsUnproved"], 0, "{summary}");
        let (code, out, err) = verify(&path(name), &format!("{}.proofs", path(name)));
        assert_eq!(code, 0, "{format}: {err}{out}");
        let verdict = bc_tests::json(&out);
        assert_eq!((verdict["ok"].as_bool(), verdict["proved"].as_u64()), (Some(true), Some(listed.len() as u64)), "{verdict}");
        let (code, _, err) = server.cli(&[
            "usage",
            "export",
            "--from",
            "0",
            "--export-format",
            format,
            "--out",
            &path("other"),
            "--with-proofs",
            "--proofs",
            &format!("{}.proofs", path(name)),
        ]);
        assert!(code != 0 && err.contains("ALREADY_EXISTS"), "proofs are never written over a file: {err}");
        assert!(!dir.path().join("other").exists(), "no export without its proofs");
    }
    // Another key's pin proves nothing.
    let (code, _, err) = offline(&[
        "usage",
        "verify",
        "--export",
        &path("usage.csv"),
        "--proofs",
        &path("usage.csv.proofs"),
        "--pin",
        "sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
    ]);
    assert!(code == 1 && err.contains("INVALID_PROOF") && err.contains("trusted key"), "{err}");

    // Each proof is an `audit check-proof` file.
    let proofs_text = std::fs::read_to_string(path("usage.csv.proofs")).unwrap();
    let entries: Vec<Value> = proofs_text.lines().map(bc_tests::json).collect();
    assert_eq!(entries[0]["format"], "better-compute-usage-proofs/1", "{}", entries[0]);
    std::fs::write(path("one.proof"), entries[1]["proof"].as_str().unwrap()).unwrap();
    let (code, out, err) = offline(&["audit", "check-proof", &path("one.proof"), "--pin", &pin]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(bc_tests::json(&out)["seq"], entries[1]["seq"]);

    // A quantity edited in the CSV: the row and the column named, exit 1 (as check-proof fails).
    let csv_text = std::fs::read_to_string(path("usage.csv")).unwrap();
    let mut csv_lines: Vec<String> = csv_text.lines().map(str::to_owned).collect();
    let column = FOCUS_COLUMN_CONSUMED;
    // The first row that counts time (the export keeps `usage.list`'s order); ConsumedUnit
    // follows ConsumedQuantity.
    let row = 1 + listed.iter().position(|r| r["quantityMs"].as_i64().unwrap() > 0).unwrap();
    let q = listed[row - 1]["quantityMs"].as_i64().unwrap();
    let seconds = |ms: i64| format!(",{}.{:06},GPU-Seconds,", ms / 1000, (ms % 1000) * 1000);
    assert!(csv_lines[row].contains(&seconds(q)), "{}", csv_lines[row]);
    csv_lines[row] = csv_lines[row].replace(&seconds(q), &seconds(q + 3_600_000));
    std::fs::write(path("edited.csv"), csv_lines.join("\n") + "\n").unwrap();
    let (code, out, err) = verify(&path("edited.csv"), &path("usage.csv.proofs"));
    eprintln!("an edited CSV row: {err}");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_PROOF") && err.contains(&format!("row {row}")) && err.contains(column), "{err}");
    let verdict = bc_tests::json(&out);
    assert_eq!(verdict["failures"][0]["row"].as_u64(), Some(row as u64), "{verdict}");

    // A quantity edited in the JSON lines: data.quantityMs named.
    let jsonl_text = std::fs::read_to_string(path("usage.jsonl")).unwrap();
    let mut records: Vec<Value> = jsonl_text.lines().map(bc_tests::json).collect();
    let q = records[0]["data"]["quantityMs"].as_i64().unwrap();
    records[0]["data"]["quantityMs"] = Value::from(q * 2);
    let edited: Vec<String> = records.iter().map(Value::to_string).collect();
    std::fs::write(path("edited.jsonl"), edited.join("\n") + "\n").unwrap();
    let (code, out, err) = verify(&path("edited.jsonl"), &path("usage.jsonl.proofs"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("row 1") && err.contains("data.quantityMs"), "{err}");
    assert_eq!(bc_tests::json(&out)["failures"][0]["row"], 1);

    // A row billed twice.
    let first_row = csv_text.lines().nth(1).unwrap();
    std::fs::write(path("twice.csv"), format!("{csv_text}{first_row}\n")).unwrap();
    let (code, _, err) = verify(&path("twice.csv"), &path("usage.csv.proofs"));
    assert!(code == 1 && err.contains(&format!("row {}", listed.len() + 1)) && err.contains("repeats row 1"), "{err}");

    // A tampered proof: a hash of the first proof's path changed.
    let mut tampered = entries.clone();
    let proof = tampered[1]["proof"].as_str().unwrap().to_owned();
    let mut proof_lines: Vec<String> = proof.split('\n').map(str::to_owned).collect();
    let hash_at = proof_lines.iter().position(|l| l.starts_with("index ")).unwrap() + 1;
    assert!(proof_lines[hash_at].len() == 44, "the proof has a path: {proof}");
    let flipped = if proof_lines[hash_at].starts_with('A') { "B" } else { "A" };
    proof_lines[hash_at].replace_range(0..1, flipped);
    tampered[1]["proof"] = Value::from(proof_lines.join("\n"));
    let text: Vec<String> = tampered.iter().map(Value::to_string).collect();
    std::fs::write(path("tampered.proofs"), text.join("\n") + "\n").unwrap();
    let (code, out, err) = verify(&path("usage.csv"), &path("tampered.proofs"));
    eprintln!("a tampered proof: {err}");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_PROOF") && err.contains("does not verify"), "{err}");
    let seq = tampered[1]["seq"].as_u64().unwrap();
    assert!(out.contains(&format!("(seq {seq}) does not verify")), "{out}");

    // An event that is not in the log: the activation of the edited row, forged a second earlier
    // (what would bill more), in a proof otherwise intact. Every row computed from it fails,
    // naming that event, and no other row does.
    let activation = listed[row - 1]["activationSeq"].as_u64().unwrap();
    let mut forged = entries.clone();
    let at = forged.iter().position(|e| e["seq"].as_u64() == Some(activation)).expect("the activation has a proof");
    let mut proof = bc_core::note::ProofFile::parse(forged[at]["proof"].as_str().unwrap()).unwrap();
    let mut event = bc_core::event::Envelope::from_canonical(&proof.event).unwrap();
    assert_eq!(event.event_type, "reservation.activated", "{}", forged[at]);
    event.at_ms -= 1000;
    proof.event = event.to_canonical().unwrap();
    forged[at]["proof"] = Value::from(proof.encode());
    let text: Vec<String> = forged.iter().map(Value::to_string).collect();
    std::fs::write(path("forged.proofs"), text.join("\n") + "\n").unwrap();
    let (code, out, err) = verify(&path("usage.csv"), &path("forged.proofs"));
    eprintln!("an event not in the log: {err}");
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_PROOF") && err.contains(&format!("(seq {activation}) does not verify")), "{err}");
    let verdict = bc_tests::json(&out);
    let failed: Vec<u64> = verdict["failures"].as_array().unwrap().iter().map(|f| f["row"].as_u64().unwrap()).collect();
    let naming: Vec<u64> = (1..=listed.len() as u64)
        .filter(|r| listed[*r as usize - 1]["seqs"].as_array().unwrap().iter().any(|s| s.as_u64() == Some(activation)))
        .collect();
    assert_eq!(failed, naming, "the rows computed from the forged event, and only they: {verdict}");
    assert!(failed.contains(&(row as u64)), "{verdict}");
    assert_eq!(verdict["proved"].as_u64(), Some((listed.len() - naming.len()) as u64), "{verdict}");
}

const FOCUS_COLUMN_CONSUMED: &str = "ConsumedQuantity";

async fn call_ok(server: &Server, method: &str, body: Value) -> Value {
    let (status, doc) = server.call(method, body).await;
    assert_eq!(status, 200, "{method}: {doc}");
    doc
}

/// Polls `GET` (`instances.get`, `reservations.get`) of `id_field: id` until `done` says yes.
async fn wait_doc(server: &Server, method: &str, id_field: &str, id: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let doc = call_ok(server, method, serde_json::json!({ id_field: id })).await;
        if done(&doc) {
            return doc;
        }
        assert!(Instant::now() < deadline, "{method} {id}: not there after 60 s: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An instance's vCPU and memory time end to end: a real `bcd node` on a fake machine whose
/// hypervisor is libvirt's `test:///default` driver runs an instance made at 2 vCPUs and 1 GiB,
/// resized while it runs to 4 vCPUs and 2 GiB, stopped and deleted. Its `vcpu` and `memory` rows
/// of 2-second windows add up to exactly what its events say (from `instance.created` to the
/// resize at the first shape, from the resize to `instance.stop_requested` at the second),
/// `usage list` shows them in vCPU- and GiB-hours and sums them by instance, the export passes
/// focus-validator and the CloudEvents SDK with these rows in it, and each row proves offline
/// while one whose quantity was edited fails, named. The reservation is made in a project: the
/// instance takes it (its view, `instances list --project`), and every row, GPU, vCPU and
/// memory, names it (`projectId`, a `project` tag in FOCUS's `Tags`, `--group-by project`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instances_vcpu_and_memory_time_shows_in_usage_exports_and_proves_offline() {
    use serde_json::json;
    use sha2::Digest;
    usage_python();
    let (server, port) = bc_tests::agents_gateway_with(&["--usage-window", "2s"]);
    let seed = bc_tests::fake_seed_with(2);
    let pool = server.pool("vms").await;
    let mut machine = bc_tests::AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(
        machine.config(),
        format!("{config}\n[hardware]\nfake_seed = {seed}\n\n[hypervisor]\nuri = \"test:///default\"\n"),
    )
    .unwrap();
    let token = call_ok(&server, "joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    let (code, _, err) = machine.join_stdin(token["token"].as_str().unwrap());
    assert_eq!(code, 0, "join: {err}");
    let node = machine.node_id();
    machine.start();
    wait_doc(&server, "nodes.get", "nodeId", &node, |doc| {
        let caps = doc["agent"]["inventory"]["capabilities"].as_array().cloned().unwrap_or_default();
        doc["state"] == "ready" && caps.iter().any(|c| c == "instance.apply")
    })
    .await;
    let bytes = bc_tests::qcow2_image(1_000_000);
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let images = bc_tests::ImageServer::start("ubuntu.qcow2", bytes);
    let image = call_ok(
        &server,
        "images.register",
        json!({ "name": "ubuntu", "url": images.url, "sha256": digest, "diskFormat": "qcow2", "sizeBytes": 1_000_000 }),
    )
    .await;
    let flavor = |name: &str, vcpus: u64, memory: u64| json!({ "poolId": pool, "name": name, "vcpus": vcpus, "memoryMiB": memory, "diskGiB": 10, "gpus": 2 });
    let small = call_ok(&server, "flavors.create", flavor("small", 2, 1024)).await;
    let large = call_ok(&server, "flavors.create", flavor("large", 4, 2048)).await;
    let project = call_ok(&server, "projects.create", json!({ "name": "vms" })).await;
    let project = project["projectId"].as_str().unwrap().to_owned();
    let rsv =
        call_ok(&server, "reservations.create", json!({ "poolId": pool, "gpus": 2, "durationS": 3600, "projectId": project }))
            .await;
    let rsv = rsv["reservationId"].as_str().unwrap().to_owned();
    wait_doc(&server, "reservations.get", "reservationId", &rsv, |r| r["binding"]["state"] == "bound").await;

    let created = call_ok(
        &server,
        "instances.create",
        json!({ "name": "vm1", "reservationId": rsv, "flavorId": small["flavorId"], "imageId": image["imageId"] }),
    )
    .await;
    let id = created["instanceId"].as_str().unwrap().to_owned();
    assert_eq!(created["projectId"], json!(project), "the instance takes its reservation's project: {created}");
    let in_project = cli_json(&server, &["instances", "list", "--project", &project, "--format", "json"]);
    assert_eq!(in_project["items"].as_array().map(Vec::len), Some(1), "{in_project}");
    assert_eq!(in_project["items"][0]["instanceId"], json!(id), "{in_project}");
    let other = call_ok(&server, "projects.create", json!({ "name": "elsewhere" })).await;
    let elsewhere =
        cli_json(&server, &["instances", "list", "--project", other["projectId"].as_str().unwrap(), "--format", "json"]);
    assert_eq!(elsewhere["items"].as_array().map(Vec::len), Some(0), "another project holds no instance: {elsewhere}");
    wait_doc(&server, "instances.get", "instanceId", &id, |d| d["state"] == "running").await;
    tokio::time::sleep(Duration::from_millis(WINDOW_MS + 500)).await;
    call_ok(&server, "instances.resize", json!({ "instanceId": id, "flavorId": large["flavorId"] })).await;
    wait_doc(&server, "instances.get", "instanceId", &id, |d| d["state"] == "running" && d["observed"]["vcpus"] == 4).await;
    tokio::time::sleep(Duration::from_millis(WINDOW_MS)).await;
    call_ok(&server, "instances.stop", json!({ "instanceId": id })).await;
    wait_doc(&server, "instances.get", "instanceId", &id, |d| d["state"] == "stopped").await;
    call_ok(&server, "instances.delete", json!({ "instanceId": id })).await;
    wait_doc(&server, "instances.get", "instanceId", &id, |d| d["state"] == "deleted").await;
    // The reservation ends too, so every row's events are in the checkpoint sealed below.
    call_ok(&server, "reservations.release", json!({ "reservationId": rsv })).await;
    let ended = wait_doc(&server, "reservations.get", "reservationId", &rsv, |r| r["endedAtMs"].is_u64()).await;

    // What the instance's events say, counted here: [created, resize) at 2 vCPUs and 1,024 MiB,
    // [resize, stop) at 4 vCPUs and 2,048 MiB.
    let events = call_ok(&server, "events.list", json!({ "types": ["instance.*"], "limit": 500 })).await;
    let at = |event_type: &str| {
        let e = events["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["stream"] == format!("instance/{id}") && e["type"] == event_type);
        e.unwrap_or_else(|| panic!("{event_type} of {id}: {events}"))["at"].as_u64().unwrap()
    };
    let (start, resize, stop) = (at("instance.created"), at("instance.resize_requested"), at("instance.stop_requested"));
    let vcpu_ms = (2 * (resize - start) + 4 * (stop - resize)) as i64;
    let mib_ms = (1024 * (resize - start) + 2048 * (stop - resize)) as i64;
    let last_end = stop.max(ended["endedAtMs"].as_u64().unwrap());
    bc_tests::wait_until("the last window to close", WAIT, || {
        rows(&server).iter().any(|r| r["windowEndMs"].as_u64().unwrap() >= last_end).then_some(())
    });
    tokio::time::sleep(Duration::from_millis(WINDOW_MS)).await; // corrections, if an end came late
    let listed = rows(&server);
    let mine = |kind: &str| -> Vec<&Value> {
        listed.iter().filter(|r| r["instanceId"] == id.as_str() && r["resourceKind"] == kind).collect()
    };
    let sum = |rows: &[&Value]| rows.iter().map(|r| r["quantityMs"].as_i64().unwrap()).sum::<i64>();
    let (vcpu, memory) = (mine("vcpu"), mine("memory"));
    assert_eq!(sum(&vcpu), vcpu_ms, "vCPU-ms from {start} to {resize} to {stop}: {vcpu:#?}");
    assert_eq!(sum(&memory), mib_ms, "MiB-ms: {memory:#?}");
    assert!(vcpu.len() >= 3, "several windows: {vcpu:#?}");
    for r in vcpu.iter().chain(&memory) {
        let (ws, we) = (r["windowStartMs"].as_u64().unwrap(), r["windowEndMs"].as_u64().unwrap());
        assert_eq!((ws % WINDOW_MS, we - ws), (0, WINDOW_MS), "{r}");
        assert_eq!(
            (r["reservationId"].as_str(), r["gpus"].as_u64(), r["poolId"].as_str()),
            (Some(rsv.as_str()), Some(0), Some(pool.as_str()))
        );
        let units = r["units"].as_u64().unwrap();
        let span = r["toMs"].as_u64().unwrap() - r["fromMs"].as_u64().unwrap();
        assert_eq!(r["quantityMs"].as_i64().unwrap().unsigned_abs(), units * span, "{r}");
        let expected_units = if r["activationSeq"].as_u64() == vcpu[0]["activationSeq"].as_u64() { [2, 1024] } else { [4, 2048] };
        let expected = if r["resourceKind"] == "vcpu" { expected_units[0] } else { expected_units[1] };
        assert_eq!(units, expected, "the shape its events say, from the resize on: {r}");
        assert_eq!(r["sku"], if r["resourceKind"] == "vcpu" { "vCPU" } else { "Memory-GiB" });
    }
    // Every row, the reservation's GPU rows too, names the project.
    assert!(!listed.is_empty() && listed.iter().all(|r| r["projectId"] == project.as_str()), "{listed:#?}");
    let by_project = cli_json(&server, &["usage", "list", "--from", "0", "--group-by", "project", "--format", "json"]);
    let vcpu_of_project = by_project["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["projectId"] == project.as_str() && g["resourceKind"] == "vcpu")
        .cloned();
    assert_eq!(vcpu_of_project.and_then(|g| g["quantityMs"].as_i64()), Some(vcpu_ms), "{by_project}");

    // The table in human units; sums by instance, one per resource kind.
    let (code, table, err) = server.cli(&["usage", "list", "--from", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        table.contains("vCPU-hours") && table.contains("GiB-hours") && table.contains("GPU-hours") && table.contains(&id),
        "{table}"
    );
    let groups = cli_json(&server, &["usage", "list", "--from", "0", "--group-by", "instance", "--format", "json"]);
    let group = |kind: &str| {
        groups["groups"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["instanceId"] == id.as_str() && g["resourceKind"] == kind)
            .cloned()
            .unwrap()
    };
    assert_eq!(
        (group("vcpu")["quantityMs"].as_i64(), group("memory")["quantityMs"].as_i64()),
        (Some(vcpu_ms), Some(mib_ms)),
        "{groups}"
    );

    // The exports, with GPU, vCPU and memory rows, checked by the outside tools; then proved.
    let (code, _, err) = bc_tests::cli(&["audit", "checkpoint", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    for (format, name) in [("csv", "usage.csv"), ("jsonl", "usage.jsonl")] {
        let summary = cli_json(
            &server,
            &["usage", "export", "--from", "0", "--export-format", format, "--out", &path(name), "--with-proofs"],
        );
        assert_eq!(summary["rows"].as_u64(), Some(listed.len() as u64), "{summary}");
        let pin = bc_tests::log_key_pin(&server);
        let (code, out, err) =
            offline(&["usage", "verify", "--export", &path(name), "--proofs", &format!("{}.proofs", path(name)), "--pin", &pin]);
        assert_eq!(code, 0, "{format}: {err}{out}");
        assert_eq!(bc_tests::json(&out)["proved"].as_u64(), Some(listed.len() as u64), "{out}");
    }
    let verdict = check(Path::new(&path("usage.csv")), Path::new(&path("usage.jsonl")));
    assert_eq!(verdict["focus"], "succeeded", "{}", verdict["focusOutput"].as_str().unwrap_or_default());
    let types: Vec<&str> = verdict["types"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for t in ["com.better-compute.usage.gpu", "com.better-compute.usage.vcpu", "com.better-compute.usage.memory"] {
        assert!(types.contains(&t), "{t} in {types:?}");
    }
    let csv_text = std::fs::read_to_string(path("usage.csv")).unwrap();
    assert!(csv_text.contains(",vCPU-Seconds,") && csv_text.contains(",GiB-Hours,"), "{csv_text}");
    // The project is a tag (FOCUS's `Tags`, a JSON object), on every row.
    let tagged = format!("\"\"project\"\":\"\"{project}\"\"");
    assert_eq!(csv_text.lines().skip(1).filter(|l| l.contains(&tagged)).count(), listed.len(), "{csv_text}");

    // A vCPU row's quantity edited in the CSV fails, naming its row and the column.
    let row = 1 + listed.iter().position(|r| r["resourceKind"] == "vcpu" && r["quantityMs"].as_i64().unwrap() > 0).unwrap();
    let q = listed[row - 1]["quantityMs"].as_i64().unwrap();
    let seconds = |ms: i64| format!(",{}.{:06},vCPU-Seconds,", ms / 1000, (ms % 1000) * 1000);
    let mut lines: Vec<String> = csv_text.lines().map(str::to_owned).collect();
    assert!(lines[row].contains(&seconds(q)), "{}", lines[row]);
    lines[row] = lines[row].replace(&seconds(q), &seconds(q + 1000));
    std::fs::write(path("edited.csv"), lines.join("\n") + "\n").unwrap();
    let pin = bc_tests::log_key_pin(&server);
    let (code, out, err) =
        offline(&["usage", "verify", "--export", &path("edited.csv"), "--proofs", &path("usage.csv.proofs"), "--pin", &pin]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_PROOF") && err.contains(&format!("row {row}")) && err.contains(FOCUS_COLUMN_CONSUMED), "{err}");
    assert_eq!(bc_tests::json(&out)["failures"][0]["row"].as_u64(), Some(row as u64), "{out}");
    assert_eq!(machine.stop(), 0);
}

/// Deletes, whatever happened, every runsc container left in a node's state directory.
struct RunscCleanup(PathBuf);

impl Drop for RunscCleanup {
    fn drop(&mut self) {
        if !self.0.exists() {
            return;
        }
        let out = std::process::Command::new("runsc").arg("--root").arg(&self.0).args(["list", "--format", "json"]).output();
        let listed: Value = out.ok().and_then(|o| serde_json::from_slice(&o.stdout).ok()).unwrap_or(Value::Null);
        for id in listed.as_array().into_iter().flatten().filter_map(|c| c["id"].as_str()) {
            let _ = std::process::Command::new("runsc").arg("--root").arg(&self.0).args(["delete", "--force", id]).status();
        }
    }
}

/// A sandbox's life end to end, in gVisor (`runsc`) on a fake machine: a cold sandbox of a
/// template whose flavor has 1 vCPU and 256 MiB, made for 5 s and deleted by the `sandboxes`
/// reconciler at its end. Its `sandbox`, `vcpu` and `memory` rows add up to exactly its life as
/// its events say (from `sandbox.created` to its `endsAtMs`: a deletion appended after the end
/// does not bill the delay), times 1, 1 and 256; and they prove offline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxs_life_shows_in_usage_with_its_flavors_vcpus_and_memory() {
    use serde_json::json;
    use sha2::Digest;
    let runsc = std::process::Command::new("runsc").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(runsc && Path::new("/bin/busybox").exists(), "runsc and /bin/busybox: `make system-deps` installs them");
    let (server, port) = bc_tests::agents_gateway_with(&["--usage-window", "2s"]);
    let pool = server.pool("sandboxes").await;
    let mut machine = bc_tests::AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = 1\n")).unwrap();
    machine.join_pool(&server, &pool).await;
    let node = machine.node_id();
    let _cleanup = RunscCleanup(machine.data().join("sandboxes").join("runsc"));
    machine.start();
    wait_doc(&server, "nodes.get", "nodeId", &node, |doc| {
        let caps = doc["agent"]["inventory"]["capabilities"].as_array().cloned().unwrap_or_default();
        doc["state"] == "ready" && caps.iter().any(|c| c == "sandbox.gvisor")
    })
    .await;
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for applet in ["sh", "sleep", "true"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    let archive = work.path().join("rootfs.tar");
    let status = std::process::Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&archive).arg(".").status().unwrap();
    assert!(status.success(), "tar");
    let bytes = std::fs::read(archive).unwrap();
    let (digest, size) = (hex::encode(sha2::Sha256::digest(&bytes)), bytes.len());
    let images = bc_tests::ImageServer::start("busybox.tar", bytes);
    let image = call_ok(
        &server,
        "images.register",
        json!({ "name": "busybox", "url": images.url, "sha256": digest, "diskFormat": "rootfs-tar", "sizeBytes": size }),
    )
    .await;
    let flavor = call_ok(
        &server,
        "flavors.create",
        json!({ "poolId": pool, "name": "sbx-small", "vcpus": 1, "memoryMiB": 256, "diskGiB": 1, "gpus": 0 }),
    )
    .await;
    // The image by channel (issue 56): not yet stable, so `busybox@stable` names nothing;
    // `busybox@testing` resolves to it and the template records its id; a bare name is a usage
    // error before anything is sent.
    let template_with = |image: &str| {
        server.cli(&[
            "sandbox-template",
            "create",
            "--name",
            "busybox",
            "--pool",
            &pool,
            "--flavor",
            flavor["flavorId"].as_str().unwrap(),
            "--image",
            image,
            "--max-ttl",
            "10m",
            "--warm-min",
            "0",
        ])
    };
    let (code, _, err) = template_with("busybox@stable");
    assert!(code == 1 && err.contains("NOT_FOUND") && err.contains("is in testing"), "{err}");
    let (code, _, err) = template_with("busybox");
    assert_eq!(code, 2, "{err}");
    let (code, out, err) = template_with("busybox@testing");
    assert_eq!(code, 0, "sandbox-template create: {err}");
    let made = bc_tests::json(&out);
    assert_eq!(made["image"]["imageId"], image["imageId"], "the resolved id: {made}");
    let template = made["templateId"].as_str().unwrap().to_owned();
    // Made in a project (issue 56): an archived project, another tenant's, or a name for an id
    // make nothing.
    let project = call_ok(&server, "projects.create", json!({ "name": "agents" })).await;
    let project_id = project["projectId"].as_str().unwrap().to_owned();
    let old = call_ok(&server, "projects.create", json!({ "name": "old" })).await;
    call_ok(&server, "projects.archive", json!({ "projectId": old["projectId"] })).await;
    let (code, _, err) = server.cli(&[
        "sandbox",
        "create",
        "--template",
        &template,
        "--ttl",
        "5s",
        "--project",
        old["projectId"].as_str().unwrap(),
    ]);
    assert!(code == 1 && err.contains("INVALID_STATE") && err.contains("archived"), "{err}");
    let other = server.tenant("other").await;
    let theirs = call_ok(&server, "projects.create", json!({ "tenantId": other, "name": "theirs" })).await;
    let (status, body) =
        server.call("sandboxes.create", json!({ "templateId": template, "ttlS": 5, "projectId": theirs["projectId"] })).await;
    assert_eq!((status, body["code"].as_str()), (404, Some("NOT_FOUND")), "{body}");
    let (code, _, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "5s", "--project", "agents"]);
    assert_eq!(code, 2, "a name for an id is a usage error: {err}");
    let none = call_ok(&server, "sandboxes.list", json!({ "deleted": true })).await;
    assert_eq!(none["items"].as_array().map(Vec::len), Some(0), "nothing was made: {none}");
    let created =
        call_ok(&server, "sandboxes.create", json!({ "templateId": template, "ttlS": 5, "projectId": project_id })).await;
    assert_eq!(created["projectId"], json!(project_id), "{created}");
    let id = created["sandboxId"].as_str().unwrap().to_owned();
    // Under a quota of one sandbox in the pool (issue 56's quotas per resource), a second one
    // is refused while the first lives, naming the limit and its use.
    let (code, _, err) = server.cli(&["quotas", "set", "--pool", &pool, "--gpus", "0", "--sandboxes", "1"]);
    assert_eq!(code, 0, "{err}");
    let quota = call_ok(&server, "quotas.get", json!({ "poolId": pool })).await;
    assert_eq!(quota["sandboxes"], 1, "{quota}");
    assert_eq!(quota["resourcesInUse"], json!({ "instances": 0, "vcpus": 1, "memoryMiB": 256, "sandboxes": 1 }), "{quota}");
    let (status, refused) = server.call("sandboxes.create", json!({ "templateId": template, "ttlS": 5 })).await;
    assert_eq!((status, refused["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "{refused}");
    let message = refused["message"].as_str().unwrap();
    assert!(message.contains("quota of 1 sandboxes") && message.contains("in use: 1"), "{message}");
    let records = call_ok(&server, "events.list", json!({ "types": ["quota.resource_exceeded"], "limit": 10 })).await;
    let record = &records["items"][0]["payload"];
    assert_eq!(
        (
            &record["resource"],
            &record["requested"],
            &record["inUse"],
            &record["limit"],
            records["items"].as_array().map(Vec::len)
        ),
        (&json!("sandboxes"), &json!(1), &json!(1), &json!(1), Some(1)),
        "the refusal is recorded: {records}"
    );
    // Raised to room for exactly four more, four creates at once all land: each one that lost
    // the race on the quota's stream is decided again (never CONFLICT), and the quota holds.
    let (code, _, err) = server.cli(&["quotas", "set", "--pool", &pool, "--gpus", "0", "--sandboxes", "5"]);
    assert_eq!(code, 0, "{err}");
    let creates = (0..4).map(|_| server.call("sandboxes.create", json!({ "templateId": template, "ttlS": 5 })));
    for (status, body) in futures::future::join_all(creates).await {
        assert_eq!(status, 200, "{body}");
    }
    let quota = call_ok(&server, "quotas.get", json!({ "poolId": pool })).await;
    assert_eq!(quota["resourcesInUse"]["sandboxes"], 5, "{quota}");
    let (status, refused) = server.call("sandboxes.create", json!({ "templateId": template, "ttlS": 5 })).await;
    assert_eq!((status, refused["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "{refused}");
    let in_project = cli_json(&server, &["sandbox", "list", "--project", &project_id, "--deleted", "--format", "json"]);
    assert_eq!(in_project["items"][0]["sandboxId"], json!(id), "{in_project}");
    let in_other =
        cli_json(&server, &["sandbox", "list", "--project", old["projectId"].as_str().unwrap(), "--deleted", "--format", "json"]);
    assert_eq!(in_other["items"].as_array().map(Vec::len), Some(0), "{in_other}");
    wait_doc(&server, "sandboxes.get", "sandboxId", &id, |s| s["state"] == "deleted").await;

    let events = call_ok(&server, "events.list", json!({ "types": ["sandbox.*"], "limit": 500 })).await;
    let event = |event_type: &str| {
        let e = events["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["stream"] == format!("sandbox/{id}") && e["type"] == event_type);
        e.cloned().unwrap_or_else(|| panic!("{event_type} of {id}: {events}"))
    };
    let made = event("sandbox.created");
    let (start, ends_at) = (made["at"].as_u64().unwrap(), made["payload"]["endsAtMs"].as_u64().unwrap());
    assert_eq!(made["payload"]["projectId"], json!(project_id), "sandbox.created names the project: {made}");
    let end = event("sandbox.delete_requested")["at"].as_u64().unwrap().min(ends_at);
    let life = (end - start) as i64;
    bc_tests::wait_until("the sandbox's last window to close", WAIT, || {
        let rows = rows(&server);
        rows.iter().any(|r| r["sandboxId"] == id.as_str() && r["windowEndMs"].as_u64().unwrap() >= end).then_some(())
    });
    tokio::time::sleep(Duration::from_millis(WINDOW_MS)).await; // a correction, if the end came late
    let listed = rows(&server);
    let sum = |kind: &str| -> i64 {
        listed
            .iter()
            .filter(|r| r["sandboxId"] == id.as_str() && r["resourceKind"] == kind)
            .map(|r| r["quantityMs"].as_i64().unwrap())
            .sum()
    };
    assert_eq!((sum("sandbox"), sum("vcpu"), sum("memory")), (life, life, 256 * life), "[{start}, {end}): {listed:#?}");
    for r in listed.iter().filter(|r| r["sandboxId"] == id.as_str()) {
        assert!(r.get("reservationId").is_none() && r["poolId"] == pool.as_str(), "{r}");
        assert_eq!(r["projectId"], json!(project_id), "every row names the sandbox's project: {r}");
        assert_eq!(r["seqs"][0], made["seq"], "its creation first: {r}");
    }
    let groups = cli_json(&server, &["usage", "list", "--from", "0", "--group-by", "sandbox", "--format", "json"]);
    let group =
        groups["groups"].as_array().unwrap().iter().find(|g| g["sandboxId"] == id.as_str() && g["resourceKind"] == "sandbox");
    assert_eq!(group.and_then(|g| g["quantityMs"].as_i64()), Some(life), "{groups}");
    let (code, table, err) = server.cli(&["usage", "list", "--from", "0"]);
    assert!(code == 0 && table.contains("sandbox-hours") && table.contains(&id), "{err}{table}");

    // Proved offline, in both formats; the outside tools read the export.
    let (code, _, err) = bc_tests::cli(&["audit", "checkpoint", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let pin = bc_tests::log_key_pin(&server);
    for (format, name) in [("csv", "usage.csv"), ("jsonl", "usage.jsonl")] {
        cli_json(&server, &["usage", "export", "--from", "0", "--export-format", format, "--out", &path(name), "--with-proofs"]);
        let (code, out, err) =
            offline(&["usage", "verify", "--export", &path(name), "--proofs", &format!("{}.proofs", path(name)), "--pin", &pin]);
        assert_eq!(code, 0, "{format}: {err}{out}");
    }
    // A sandbox row's quantity doubled in the JSON lines fails, named.
    let text = std::fs::read_to_string(path("usage.jsonl")).unwrap();
    let mut records: Vec<Value> = text.lines().map(bc_tests::json).collect();
    let at = records.iter().position(|r| r["data"]["resourceKind"] == "sandbox").unwrap();
    let q = records[at]["data"]["quantityMs"].as_i64().unwrap();
    records[at]["data"]["quantityMs"] = Value::from(q * 2);
    let edited: Vec<String> = records.iter().map(Value::to_string).collect();
    std::fs::write(path("edited.jsonl"), edited.join("\n") + "\n").unwrap();
    let (code, _, err) =
        offline(&["usage", "verify", "--export", &path("edited.jsonl"), "--proofs", &path("usage.jsonl.proofs"), "--pin", &pin]);
    assert!(code == 1 && err.contains(&format!("row {}", at + 1)) && err.contains("data.quantityMs"), "{err}");
    let verdict = check(Path::new(&path("usage.csv")), Path::new(&path("usage.jsonl")));
    assert_eq!(verdict["focus"], "succeeded", "{}", verdict["focusOutput"].as_str().unwrap_or_default());
    assert!(verdict["types"].as_array().unwrap().iter().any(|t| t == "com.better-compute.usage.sandbox"), "{verdict}");
    assert_eq!(machine.stop(), 0);
}
