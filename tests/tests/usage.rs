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
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut args = vec!["usage", "list", "--from", "0", "--limit", "500", "--format", "json"];
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
    assert!(table.contains("GPU-HOURS") && table.contains(&released), "{table}");
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
}
