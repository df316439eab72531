//! `projections rebuild` through the real binary, on each backend: projection rows deleted,
//! corrupted and invented directly in the database are put back to what the log implies, as
//! folded here independently through `bc_projections::Projections`.

use bc_core::store::EventStore;
use bc_core::testing::ScratchDatabase;
use bc_tests::{Server, fold_log, rows_sorted};
use serde_json::json;

/// Rows of every kind: tenants, API keys, pools, nodes, reservations, webhooks.
async fn populate(server: &Server) {
    let pool = server.pool("rebuild-a").await;
    server.pool("rebuild-b").await;
    server.h100_nodes(&pool, 2).await;
    for _ in 0..3 {
        let (status, r) = server.call("reservations.create", json!({ "poolId": pool, "gpus": 2, "durationS": 3600 })).await;
        assert_eq!(status, 200, "{r}");
    }
    let (status, key) = server.call("apiKeys.create", json!({ "name": "reader", "actions": ["compute:pools:read"] })).await;
    assert_eq!(status, 200, "{key}");
    let (status, hook) =
        server.call("webhooks.create", json!({ "url": "https://hooks.example.com/x", "eventTypes": ["pool.*"] })).await;
    assert_eq!(status, 200, "{hook}");
}

/// Deletes the first row of every kind, corrupts every other row, and invents one.
const TAMPER: &str = "DELETE FROM projections WHERE (kind, id) IN (SELECT kind, MIN(id) FROM projections GROUP BY kind); \
     UPDATE projections SET doc = '{\"corrupt\": true}'; \
     INSERT INTO projections (tenant_id, kind, id, doc) \
         SELECT tenant_id, kind, 'pool_invented', '{\"name\": \"invented\"}' FROM projections WHERE kind = 'pool' LIMIT 1;";

/// The tampering took hold (so the rebuild has something to do), then the rebuild undid it.
async fn check(store: &dyn EventStore, rebuild: impl FnOnce() -> (i32, String, String)) {
    let folded = fold_log(store).await;
    assert!(folded.len() >= 10, "too few rows to mean anything: {}", folded.len());
    let tampered = rows_sorted(store).await;
    assert_eq!(tampered.len(), folded.len() + 1 - kinds(&folded), "rows deleted and one invented");
    assert!(tampered.iter().all(|r| r.doc == json!({ "corrupt": true }) || r.key.id == "pool_invented"));
    let (code, out, err) = rebuild();
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("\"rows\": {}", folded.len())), "{out}");
    assert_eq!(rows_sorted(store).await, folded, "the rebuilt rows are the log's fold");
}

fn kinds(rows: &[bc_core::store::Row]) -> usize {
    rows.iter().map(|r| r.key.kind.as_str()).collect::<std::collections::BTreeSet<_>>().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_repairs_tampered_rows_on_sqlite() {
    let mut server = Server::dev_with(&["--no-reconcilers"]);
    populate(&server).await;
    server.stop();
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    assert_eq!(rows_sorted(&store).await, fold_log(&store).await, "the rows were the fold before the tampering");
    sqlx::raw_sql(sqlx::AssertSqlSafe(TAMPER.to_owned())).execute(store.pool()).await.unwrap();
    let data_dir = server.data_dir.display().to_string();
    check(&store, || bc_tests::cli(&["projections", "rebuild", "--data-dir", &data_dir], &[])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuild_repairs_tampered_rows_on_postgres() {
    let db = ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let mut server = Server::serve_postgres_with(&db.url, &["--no-reconcilers"]);
    populate(&server).await;
    server.stop();
    let store = bc_core::store::postgres::PostgresStore::connect(&db.url).await.unwrap();
    assert_eq!(rows_sorted(&store).await, fold_log(&store).await, "the rows were the fold before the tampering");
    store.pool().get().await.unwrap().batch_execute(TAMPER).await.unwrap();
    check(&store, || bc_tests::cli(&["projections", "rebuild", "--database-url", &db.url], &[])).await;
}
