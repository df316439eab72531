//! Background work is reconcilers, and each records its last pass: `better-compute reconcilers
//! status` shows the reservations, webhooks, checkpoints and liveness reconcilers of a running `dev`,
//! and of a `reconcile --only checkpoints` process beside it, with outcomes and counts.

use std::time::{Duration, Instant};

use bc_tests::{Reconciler, Server, json};
use serde_json::Value;

/// `reconcilers status --format json`, whole.
fn status_document(server: &Server) -> Value {
    let dir = server.data_dir.display().to_string();
    let (code, out, err) = server.cli(&["reconcilers", "status", "--data-dir", &dir, "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    json(&out)
}

fn status(server: &Server) -> Vec<Value> {
    status_document(server)["items"].as_array().cloned().unwrap_or_default()
}

/// Waits until `wanted` holds of the status rows.
fn wait_for(server: &Server, what: &str, wanted: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let rows = status(server);
        if wanted(&rows) {
            return rows;
        }
        assert!(Instant::now() < deadline, "{what}: {rows:#?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn count(row: &Value, name: &str) -> u64 {
    row["counts"][name].as_u64().unwrap_or(0)
}

#[tokio::test]
async fn reconcilers_record_their_passes_and_status_shows_them() {
    let server = Server::dev_with(&["--checkpoint-interval", "1s"]);
    server.pool("gpu-a").await;
    let rows = wait_for(&server, "the dev's checkpoints reconciler sealed the new pool's tenant", |rows| {
        rows.iter().any(|r| r["name"] == "checkpoints" && r["ok"] == true && count(r, "sealed") >= 1)
    });
    let names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
    for name in ["checkpoints", "reservations", "liveness"] {
        assert!(names.contains(&name), "{name} records its passes: {names:?}");
    }
    for row in &rows {
        assert!(row["instance"].as_str().unwrap().contains(':'), "HOST:PID: {row}");
        assert!(row["passes"].as_u64().unwrap() >= 1 && row["startedAtMs"].as_u64().unwrap() > 0, "{row}");
    }

    // A second process runs the checkpoints reconciler on the same database: its own row.
    let dir = server.data_dir.display().to_string();
    let metrics = format!("127.0.0.1:{}", bc_tests::free_port());
    let args = ["--only", "checkpoints", "--checkpoint-interval", "1s", "--data-dir", &dir, "--metrics-listen", &metrics];
    let _sealer = Reconciler::start(&args, &server.data_dir);
    let rows = wait_for(&server, "the reconcile process records its own passes", |rows| {
        rows.iter().filter(|r| r["name"] == "checkpoints").count() == 2
    });
    let sealers: Vec<&Value> = rows.iter().filter(|r| r["name"] == "checkpoints").collect();
    assert_ne!(sealers[0]["instance"], sealers[1]["instance"]);
    // Its own metrics, on --metrics-listen: its passes.
    let text = reqwest::get(format!("http://{metrics}/metrics")).await.unwrap().text().await.unwrap();
    assert!(text.contains("better_compute_reconciler_passes_total{reconciler=\"checkpoints\",outcome=\"ok\"}"), "{text}");
    assert!(text.contains("better_compute_log_tenants "), "what the database counts: {text}");

    // The table names every column.
    let (code, out, err) = server.cli(&["reconcilers", "status", "--data-dir", &dir]);
    assert_eq!(code, 0, "{err}");
    for header in ["NAME", "INSTANCE", "LAST PASS", "DURATION", "OUTCOME", "PASSES", "COUNTS"] {
        assert!(out.contains(header), "{out}");
    }
    assert!(out.contains("sealed="), "{out}");

    // Bad input: an unknown reconciler, and sealing that would never seal.
    let (code, _, err) = server.cli(&["reconcile", "--only", "sealer", "--data-dir", &dir]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("checkpoints"), "the hint lists the reconcilers: {err}");
    let (code, _, err) = server.cli(&["reconcile", "--only", "checkpoints", "--checkpoint-interval", "0", "--data-dir", &dir]);
    assert_eq!(code, 2, "{err}");
    // `witnesses` is a reconciler too, with nothing to do without a witness.
    let (code, _, err) = server.cli(&["reconcile", "--only", "witnesses", "--data-dir", &dir]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--witness"), "{err}");
}

/// `reconcile --only`'s help lists every registered reconciler (it once listed four of
/// seven).
#[test]
fn the_help_of_reconcile_only_lists_the_registry() {
    let (code, out, err) = bc_tests::cli(&["reconcile", "--help"], &[]);
    assert_eq!(code, 0, "{err}");
    for name in bc_reconcilers::registry::NAMES {
        assert!(out.contains(name), "{name} is missing from the help: {out}");
    }
}

/// `reconcilers status` lists every registered reconciler, those no process has run too: a
/// `dev` without `--witness` never starts `witnesses`, which is listed as never run, with no
/// last pass, beside the passes of those that ran.
#[tokio::test]
async fn status_lists_the_reconcilers_that_never_ran() {
    let server = Server::dev();
    wait_for(&server, "the dev's reservations reconciler records a pass", |rows| {
        rows.iter().any(|r| r["name"] == "reservations")
    });
    let document = status_document(&server);
    let never_run = document["neverRun"].as_array().cloned().unwrap_or_default();
    let witnesses = never_run.iter().find(|r| r["name"] == "witnesses").unwrap_or_else(|| panic!("{document:#}"));
    assert_eq!(witnesses["state"], "never run", "{witnesses}");
    assert!(witnesses.get("startedAtMs").is_none() && witnesses.get("instance").is_none(), "{witnesses}");
    assert!(!never_run.iter().any(|r| r["name"] == "reservations"), "reservations ran: {document:#}");
    // Together, the passes and the reconcilers that never ran name the whole registry.
    let listed: Vec<&str> =
        document["items"].as_array().into_iter().flatten().chain(&never_run).map(|r| r["name"].as_str().unwrap()).collect();
    for name in bc_reconcilers::registry::NAMES {
        assert!(listed.contains(&name), "{name} is missing: {document:#}");
    }
    // The table a person reads shows it too, its state where a pass's outcome would be.
    let dir = server.data_dir.display().to_string();
    let (code, table, err) = server.cli(&["reconcilers", "status", "--data-dir", &dir, "--format", "table"]);
    assert_eq!(code, 0, "{err}");
    let row =
        table.lines().find(|l| l.trim_start().starts_with("witnesses")).unwrap_or_else(|| panic!("no witnesses row:\n{table}"));
    assert!(row.contains("never run") && !row.contains("failed"), "{row}");
}
