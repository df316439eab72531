//! Health for machines from outside: `GET /healthz` and `GET /readyz` without a token, and the
//! agents' endpoint's standard `grpc.health.v1.Health` and server reflection asked by gRPC's own
//! Python clients (`grpcio-health-checking`, `grpcio-reflection`, in the virtual environment
//! `make health-venv` makes; `tests/scripts/grpc_health_check.py`) over TLS, trusting the
//! gateway's self-signed serving certificate. Then the database dropped under a PostgreSQL
//! `serve`: `/readyz` answers 503 naming the database, `/healthz` still 200, and the gRPC health
//! turns `NOT_SERVING`.

use std::process::Command;
use std::time::Duration;

use bc_core::testing::ScratchDatabase;
use bc_tests::{Server, wait_until};
use serde_json::Value;

const AGENT_SERVICE: &str = "bettercompute.agent.v1.Agent";

/// The agents' endpoint asked by the Python clients: `{"health": {SERVICE: STATUS}, "services":
/// [...], "methods": [...]}`.
fn grpc_from_outside(server: &Server) -> Value {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join("target/health-venv/bin/python");
    assert!(
        python.exists(),
        "no Python with grpcio-health-checking at {} (run `make health-venv`, which `make test` runs)",
        python.display()
    );
    let cert = server.data_dir.join(bc_gateway::agents::tls::SERVING_CERT_FILE);
    let out = Command::new(python)
        .arg(root.join("tests/scripts/grpc_health_check.py"))
        .arg(&server.agents_addr)
        .arg(&cert)
        .output()
        .expect("run the Python gRPC clients");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "grpc_health_check.py: {stdout} {stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// `GET path` without a token: status and body.
async fn get(server: &Server, path: &str) -> (u16, String) {
    let response = reqwest::Client::new().get(format!("{}{path}", server.url)).send().await.expect(path);
    (response.status().as_u16(), response.text().await.unwrap_or_default())
}

#[tokio::test]
async fn a_ready_gateway_answers_its_probes_and_grpc_health_serving_with_reflection() {
    let server = Server::dev();
    assert_eq!(get(&server, "/healthz").await, (200, "ok".to_owned()));
    let (status, body) = get(&server, "/readyz").await;
    let ready: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, ready["status"].as_str()), (200, Some("ready")), "{ready}");
    for check in ["database", "migrations", "logKey"] {
        assert_eq!(ready["checks"][check]["ok"], true, "{check}: {ready}");
    }

    let grpc = grpc_from_outside(&server);
    assert_eq!(grpc["health"][""], "SERVING", "{grpc}");
    assert_eq!(grpc["health"][AGENT_SERVICE], "SERVING", "{grpc}");
    let services: Vec<&str> = grpc["services"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for service in [AGENT_SERVICE, "grpc.health.v1.Health"] {
        assert!(services.contains(&service), "reflection lists {service}: {grpc}");
    }
    let methods: Vec<&str> = grpc["methods"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    for method in ["Join", "Session", "Tunnel"] {
        assert!(methods.contains(&method), "reflection describes {AGENT_SERVICE}/{method}: {grpc}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_its_database_dropped_the_gateway_is_live_but_not_ready() {
    let db = ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let server = Server::serve_postgres(&db.url);
    assert_eq!(get(&server, "/readyz").await.0, 200);
    assert_eq!(grpc_from_outside(&server)["health"][AGENT_SERVICE], "SERVING");

    // DROP DATABASE … WITH (FORCE): the server's connections are cut and the database is gone.
    drop(db);
    let body = wait_until("readyz answers 503", Duration::from_secs(30), || {
        let (status, body) = bc_tests::block_on(get(&server, "/readyz"));
        (status == 503).then_some(body)
    });
    let unready: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(unready["status"], "not ready", "{unready}");
    assert_eq!(unready["failed"][0], "database", "the failed check is named: {unready}");
    assert_eq!(unready["checks"]["database"]["ok"], false, "{unready}");
    assert_eq!(get(&server, "/healthz").await, (200, "ok".to_owned()), "live while not ready");

    // The agents' endpoint says so too, within its recheck (`health::GRPC_HEALTH_INTERVAL_MS`).
    let statuses = wait_until("gRPC health NOT_SERVING", Duration::from_secs(30), || {
        let grpc = grpc_from_outside(&server);
        (grpc["health"][AGENT_SERVICE] == "NOT_SERVING").then_some(grpc["health"].clone())
    });
    assert_eq!(statuses[""], "NOT_SERVING", "{statuses}");
}
