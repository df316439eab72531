//! The same control plane on PostgreSQL: `migrate`, then `serve`, then the API.

use bc_core::testing::ScratchDatabase;
use bc_tests::Server;
use serde_json::json;

#[tokio::test]
async fn serve_on_postgres() {
    let db = ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    // serve refuses an unmigrated database, with a hint.
    let (code, _, err) = bc_tests::cli(
        &[
            "serve",
            "--database-url",
            &db.url,
            "--listen",
            "127.0.0.1:0",
            "--agents-listen",
            "127.0.0.1:0",
            "--data-dir",
            "/nonexistent/x",
        ],
        &[],
    );
    assert_ne!(code, 0);
    assert!(err.contains("migrate"), "{err}");
    let (code, out, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("0001_log"), "{out}");
    let (code, out, _) = bc_tests::cli(&["migrate"], &[("BETTER_COMPUTE_DATABASE_URL", &db.url)]);
    assert_eq!(code, 0);
    assert!(out.contains("\"applied\": []"), "migrations apply once: {out}");

    let mut server = Server::serve_postgres(&db.url);
    let pool = server.pool("pg-pool").await;
    let (status, node) = server
        .call("nodes.register", json!({ "poolId": pool, "name": "n1", "gpus": [{ "model": "A100", "product": "A100-SXM4-40GB", "vramGiB": 40, "nvlinkDomain": 0 }] }))
        .await;
    assert_eq!(status, 200, "{node}");
    let (status, version) = server.call("system.version", json!({})).await;
    assert_eq!((status, version["backend"].as_str()), (200, Some("postgresql")));
    // Restart: same key, same token, the data is there.
    server.restart();
    let (status, got) = server.call("nodes.get", json!({ "nodeId": node["nodeId"] })).await;
    assert_eq!(status, 200, "{got}");
    server.stop();

    let (code, out, err) = bc_tests::cli(&["projections", "rebuild", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"rows\": 4"), "{out}");
    let store = bc_core::store::postgres::PostgresStore::connect(&db.url).await.unwrap();
    let (events, tenants) = bc_tests::verify_store(&store).await;
    assert_eq!((events, tenants), (4, 1));
}
