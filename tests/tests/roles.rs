//! Processes split by role (`serve --roles`) and a first fleet in `dev` (`dev --sim N`), from
//! outside: two `serve --roles api` and one `serve --roles agents,reconcilers` on one PostgreSQL
//! behave as one control plane (a reservation made through one API process is bound by the agent
//! connected to the third process, and seen by the other API process); a process without the
//! `api` role answers its probes and its scrape and refuses the rest; `dev --sim 5` shows five
//! simulated machines and a first `reserve` bound by one of them.

use std::time::Duration;

use bc_core::testing::ScratchDatabase;
use bc_tests::{AgentNode, Server, wait_until};
use serde_json::{Value, json};

/// `GET path` without a token: status and body.
async fn get(server: &Server, path: &str) -> (u16, String) {
    let response = reqwest::Client::new().get(format!("{}{path}", server.url)).send().await.expect(path);
    (response.status().as_u16(), response.text().await.unwrap_or_default())
}

/// Polls `reservations.get` on `server` until the binding is `bound`.
fn wait_bound(server: &Server, reservation: &str, timeout: Duration) -> Value {
    wait_until("the reservation's binding bound", timeout, || {
        let (status, doc) = bc_tests::block_on(server.call("reservations.get", json!({ "reservationId": reservation })));
        assert_eq!(status, 200, "{doc}");
        (doc["binding"]["state"] == "bound").then_some(doc)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_api_processes_and_an_agents_process_on_one_postgresql_are_one_control_plane() {
    let db = ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    // The first process makes the data directory's keys; the others share it (the log key).
    let agents = Server::serve_postgres_with(
        &db.url,
        &["--roles", "agents,reconcilers", "--node-lease", "2s", "--node-heartbeat", "300ms"],
    );
    let api_a = agents.serve_beside_as("api");
    let api_b = agents.serve_beside_as("api");
    // The API processes print `agents: none`; only the third runs reconcilers, so what places
    // and binds the reservation below runs there.
    assert!(api_a.agents_addr.is_empty() && !agents.agents_addr.is_empty());

    // Each process answers its own probes and scrape; without the api role, nothing else.
    for server in [&agents, &api_a] {
        assert_eq!(get(server, "/healthz").await, (200, "ok".to_owned()));
        assert_eq!(get(server, "/readyz").await.0, 200);
        let (status, metrics) = get(server, "/metrics").await;
        assert_eq!(status, 200);
        assert!(metrics.contains("# TYPE"), "{metrics}");
    }
    let (status, refused) = agents.call("pools.list", json!({})).await;
    assert_eq!((status, refused["code"].as_str()), (501, Some("UNSUPPORTED")), "{refused}");
    assert_eq!(refused["details"]["reason"], "api-not-served", "{refused}");
    assert_eq!(get(&agents, "/api/compute/openapi.json").await.0, 501);

    // A machine joins through the agents' process, its pool and token made through API A.
    let pool = api_a.pool("split").await;
    let port: u16 = agents.agents_addr.rsplit(':').next().unwrap().parse().unwrap();
    let mut machine = AgentNode::new(&agents, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = 7\n")).unwrap();
    machine.join_pool(&api_a, &pool).await;
    machine.start();
    let node = machine.node_id();
    wait_until("the node ready, seen through API B", Duration::from_secs(30), || {
        let (_, doc) = bc_tests::block_on(api_b.call("nodes.get", json!({ "nodeId": node })));
        (doc["state"] == "ready").then_some(())
    });

    // Reserved through API A, placed by the reconcilers and held by the agent on the third
    // process, seen through API B.
    let (status, rsv) = api_a.call("reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 3600 })).await;
    assert_eq!(status, 200, "{rsv}");
    let id = rsv["reservationId"].as_str().unwrap();
    let bound = wait_bound(&api_b, id, Duration::from_secs(30));
    assert_eq!(bound["nodeId"], node, "{bound}");
    assert_eq!(bound["binding"]["gpuUuids"].as_array().map(Vec::len), Some(1), "{bound}");
    assert_eq!(machine.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_with_five_simulated_machines_binds_a_first_reserve() {
    let server = Server::dev_with(&["--sim", "5"]);
    let pool = wait_until("the sim pool", Duration::from_secs(30), || {
        let (_, pools) = bc_tests::block_on(server.call("pools.list", json!({})));
        pools["items"].as_array()?.iter().find(|p| p["name"] == "sim").map(|p| p["poolId"].as_str().unwrap().to_owned())
    });
    wait_until("five ready machines", Duration::from_secs(60), || {
        let (_, nodes) = bc_tests::block_on(server.call("nodes.list", json!({ "poolId": pool })));
        let nodes = nodes["items"].as_array()?.clone();
        (nodes.len() == 5 && nodes.iter().all(|n| n["state"] == "ready")).then_some(())
    });
    let (code, out, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h"]);
    assert_eq!(code, 0, "reserve: {out} {err}");
    let rsv = bc_tests::json(&out);
    let bound = wait_bound(&server, rsv["reservationId"].as_str().unwrap(), Duration::from_secs(30));
    assert!(bound["nodeId"].as_str().is_some_and(|n| n.starts_with("node_")), "{bound}");
    assert!(server.log_text().contains("joined 5/5"), "{}", server.log_text());
    // The machines live in the data directory: a restart joins none again.
    assert!(server.data_dir.join("sim/node-4/identity.json").exists());
}

#[test]
fn roles_and_sim_out_of_bounds_are_usage_errors() {
    for (args, says) in [
        (vec!["serve", "--database-url", "postgres://x", "--roles", "controllers"], "is not a role"),
        (vec!["serve", "--database-url", "postgres://x", "--roles", "api,api"], "named twice"),
        (vec!["serve", "--database-url", "postgres://x", "--roles", "reconcilers:nope"], "is not a reconciler"),
        (vec!["serve", "--database-url", "postgres://x", "--roles", "api", "--no-reconcilers"], "cannot be used with"),
        (vec!["dev", "--sim", "0"], "1 to 1000"),
        (vec!["dev", "--sim", "1001"], "1 to 1000"),
    ] {
        let (code, out, err) = bc_tests::cli(&args, &[]);
        assert_eq!(code, 2, "{args:?}: {out} {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
