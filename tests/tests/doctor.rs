//! `better-compute doctor` (issue 59, item 3) from outside: all ok against a healthy `dev`, exit 0;
//! then the data key readable by others, a migration missing, a log key that is not this
//! database's: each a named failure with its fix, exit `DOCTOR_FINDINGS` (1). Against
//! PostgreSQL it also reads the database's clock and settings.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use bc_tests::{Server, cli, wait_until};
use serde_json::Value;

/// `doctor --json` on `dir` (and `extra`): (exit code, the checks by name, stderr).
fn doctor(dir: &std::path::Path, extra: &[&str]) -> (i32, Vec<Value>, String) {
    let mut args = vec!["doctor", "--json", "--data-dir", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (code, out, err) = cli(&args, &[]);
    let checks: Vec<Value> = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out} {err}"));
    (code, checks, err)
}

fn check<'a>(checks: &'a [Value], name: &str) -> &'a Value {
    checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no {name} check in {checks:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_passes_a_healthy_dev_and_names_each_fault_with_its_fix() {
    let server = Server::dev();
    let dir = server.data_dir.clone();
    // The reconcilers' first passes are recorded within a second or two of the start.
    wait_until("a reconciler pass", Duration::from_secs(30), || (!server.reconciler_passes().is_empty()).then_some(()));

    let (code, checks, err) = doctor(&dir, &[]);
    assert_eq!(code, 0, "{checks:?} {err}");
    for name in ["database", "schema", "log-key", "data-key", "agents-certificate", "disk", "reconcilers"] {
        let c = check(&checks, name);
        assert_ne!(c["status"], "fail", "{c}");
    }
    assert_eq!(check(&checks, "log-key")["status"], "ok", "the log key is registered in the log");
    let (code, out, _) = cli(&["doctor", "--data-dir", dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0);
    assert!(out.lines().any(|l| l.starts_with("ok   schema: current")), "the table form: {out}");

    // The data key readable by others: a failure naming the chmod.
    let data_key = dir.join("data.key");
    std::fs::set_permissions(&data_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (code, checks, err) = doctor(&dir, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("DOCTOR_FINDINGS: 1 of"), "{err}");
    let c = check(&checks, "data-key");
    assert_eq!(c["status"], "fail", "{c}");
    assert_eq!(c["fix"], format!("chmod 600 {}", data_key.display()));
    std::fs::set_permissions(&data_key, std::fs::Permissions::from_mode(0o600)).unwrap();

    // A log key that is not the one this database's log was signed with (the running server
    // holds its own in memory; the file is put back after).
    let log_key = dir.join("log.key");
    std::fs::rename(&log_key, dir.join("log.key.kept")).unwrap();
    bc_core::keys::LogKey::load_or_create(&log_key).unwrap();
    let (code, checks, _) = doctor(&dir, &[]);
    assert_eq!(code, 1);
    let c = check(&checks, "log-key");
    assert_eq!(c["status"], "fail", "{c}");
    assert!(c["message"].as_str().unwrap().contains("is not a key this database's log was signed with"), "{c}");
    std::fs::rename(dir.join("log.key.kept"), &log_key).unwrap();

    // Another directory, without a database: the database fails, and doctor makes none.
    let other = tempfile::tempdir().unwrap();
    let (code, checks, _) = doctor(other.path(), &[]);
    assert_eq!(code, 1);
    assert_eq!(check(&checks, "database")["status"], "fail");
    assert!(!other.path().join("better-compute.sqlite3").exists(), "doctor writes nothing");

    // A migration missing.
    server.sql("DELETE FROM schema_migrations WHERE version = (SELECT MAX(version) FROM schema_migrations)").await;
    let (code, checks, _) = doctor(&dir, &[]);
    assert_eq!(code, 1);
    let c = check(&checks, "schema");
    assert_eq!(c["status"], "fail", "{c}");
    assert!(c["fix"].as_str().unwrap().contains("better-compute migrate"), "{c}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_reads_postgresqls_clock_and_settings() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let dir = tempfile::tempdir().unwrap();
    let (code, checks, err) = doctor(dir.path(), &["--database-url", &db.url]);
    // No log or data key in an empty directory: those fail; the database's own checks pass.
    assert_eq!(code, 1, "{err}");
    assert_eq!(check(&checks, "database")["status"], "ok");
    assert_eq!(check(&checks, "schema")["status"], "ok");
    assert_eq!(check(&checks, "clock")["status"], "ok", "the same host's clock");
    let sync = check(&checks, "synchronous-commit");
    assert!(sync["message"].as_str().unwrap().starts_with("synchronous_commit is "), "{sync}");
    assert!(check(&checks, "max-connections")["message"].as_str().unwrap().contains("max_connections is"));
    assert_eq!(check(&checks, "log-key")["status"], "fail");
    assert!(checks.iter().all(|c| c["name"] != "disk"), "no embedded database, no disk check");
}
