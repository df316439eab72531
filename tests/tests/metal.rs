//! Bare metal through the real binary (issue 12): the `metal` commands' validation at the
//! edge, `INVALID_STATE` naming the verbs allowed, the in-process `metal` reconciler failing a
//! workflow against a BMC that is not there with the reason, within its bound, and the BMC's
//! password in no row, log line, event or answer.

use std::time::Duration;

use bc_tests::{Server, json, wait_until};
use serde_json::Value;

const PASSWORD: &str = "bmc-password-7f3a9c-never-shown";

/// Every byte of the dev server's database files (the main file, its WAL and shared memory).
fn database_bytes(server: &Server) -> Vec<u8> {
    let mut all = Vec::new();
    for suffix in ["", "-wal", "-shm"] {
        let path = format!("{}{suffix}", server.sqlite_path().display());
        if let Ok(bytes) = std::fs::read(&path) {
            all.extend(bytes);
        }
    }
    all
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn enroll(server: &Server, pool: &str, address: &str, password_file: &std::path::Path, tls: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "metal",
        "enroll",
        "--pool",
        pool,
        "--name",
        "rack1-u07",
        "--bmc-address",
        address,
        "--bmc-username",
        "admin",
        "--bmc-password-file",
        password_file.to_str().unwrap(),
    ];
    args.extend_from_slice(tls);
    server.cli(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enroll_is_checked_at_the_edge_verbs_name_what_is_allowed_and_the_password_is_never_shown() {
    let server = Server::dev();
    let pool = server.pool("metal").await;
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("bmc-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    // Nothing listens here: every BMC call is refused.
    let port = bc_tests::free_port();
    let address = format!("https://127.0.0.1:{port}");

    // At the edge: http, no way to check the certificate, two ways, a path in the address.
    for (given, tls, why) in [
        (format!("http://127.0.0.1:{port}"), vec!["--bmc-insecure"], "https://"),
        (address.clone(), vec![], "--bmc-ca-file, --bmc-pin or --bmc-insecure"),
        (format!("{address}/redfish/v1"), vec!["--bmc-insecure"], "an origin"),
        (address.clone(), vec!["--bmc-pin", "sha256/short"], "sha256/"),
    ] {
        let (code, out, err) = enroll(&server, &pool, &given, &password_file, &tls);
        assert_eq!(code, 2, "{given} {tls:?}: {out}{err}");
        assert!(err.contains(why), "{given} {tls:?}: {err}");
    }
    let (code, _, err) = server.cli(&[
        "metal",
        "enroll",
        "--pool",
        &pool,
        "--name",
        "x",
        "--bmc-address",
        &address,
        "--bmc-username",
        "admin",
        "--bmc-password",
        PASSWORD,
    ]);
    assert_eq!(code, 2, "a password is never an argument: {err}");

    let (code, out, err) = enroll(&server, &pool, &address, &password_file, &["--bmc-insecure"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("not checked"), "an insecure enrollment says so: {err}");
    let machine = json(&out);
    let node = machine["nodeId"].as_str().unwrap().to_owned();
    assert_eq!((machine["state"].as_str(), machine["bmc"]["insecure"].as_bool()), (Some("enroll"), Some(true)), "{machine}");

    // A verb the state does not take: INVALID_STATE, naming the verbs it does.
    let (status, refused) = server.call("metal.provide", serde_json::json!({ "nodeId": node })).await;
    assert_eq!((status, refused["code"].as_str()), (409, Some("INVALID_STATE")), "{refused}");
    assert_eq!(refused["details"]["allowed"], serde_json::json!(["manage", "recover"]), "{refused}");
    let (code, _, err) = server.cli(&["metal", "provide", &node]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains("allowed now: manage, recover"), "{err}");

    // Manage against a BMC that is not there: the step's bounded attempts, then back to
    // enroll with the reason, within the back-off's bound (1 + 2 + 4 + 8 s and the passes).
    let (code, out, err) = server.cli(&["metal", "manage", &node]);
    assert_eq!(code, 0, "{out}{err}");
    let machine: Value = wait_until("the manage fails", Duration::from_secs(60), || {
        let (_, out, _) = server.cli(&["metal", "get", &node]);
        let machine = json(&out);
        (machine["workflow"]["outcome"] == "failed").then_some(machine)
    });
    assert_eq!(machine["state"], "enroll", "{machine}");
    let error = machine["lastError"].as_str().unwrap();
    assert!(error.contains("failed 5 times") && error.contains("unreachable"), "{error}");
    let workflow = machine["workflow"]["workflowId"].as_str().unwrap().to_owned();
    let (code, out, err) = server.cli(&["workflows", "list", "--node", &node, "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["items"][0]["workflowId"], workflow.as_str(), "{out}");
    let (code, out, _) = server.cli(&["workflows", "get", &workflow]);
    assert_eq!(code, 0);
    assert_eq!(json(&out)["steps"][0], serde_json::json!({ "name": "check-bmc", "state": "failed" }), "{out}");

    // The password: in no answer, no event, no log line, no byte of the database.
    let (code, events, _) = server.cli(&["events", "list", "--format", "json", "--limit", "500"]);
    assert_eq!(code, 0);
    assert!(events.contains("metal.enrolled") && !events.contains(PASSWORD), "{events}");
    assert!(!out.contains(PASSWORD) && !machine.to_string().contains(PASSWORD));
    assert!(!server.log_text().contains(PASSWORD), "the server log holds the password");
    assert!(!contains(&database_bytes(&server), PASSWORD), "the database holds the password in clear text");
}
