//! Crash: append in a loop over HTTP, `kill -9` the real `better-compute dev` (SQLite) or
//! `serve` (PostgreSQL), restart it. Every acknowledged append is there, every chain verifies,
//! and nothing is half-written: the projections equal the log's fold and every commit number up
//! to the last is present.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bc_core::event::Position;
use bc_core::store::{EventStore, decode_rows, rebuild_projections};
use bc_tests::Server;
use serde_json::json;
use tokio::sync::Mutex;

/// Clients appending at once while the server is killed.
const WRITERS: usize = 8;
/// Appends acknowledged in a round before its kill.
const ACKED_PER_ROUND: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_loses_no_acknowledged_append() {
    let mut server = Server::dev();
    let acked = write_through_kills(&mut server).await;
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    check_after_kills(&store, &acked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_on_postgres_loses_no_acknowledged_append() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let mut server = Server::serve_postgres(&db.url);
    let acked = write_through_kills(&mut server).await;
    let store = bc_core::store::postgres::PostgresStore::connect(&db.url).await.unwrap();
    check_after_kills(&store, &acked).await;
}

/// Two rounds of concurrent writers, each ended by `kill -9` of the server and a restart; returns
/// the ids of the acknowledged pools, checked present after the last restart, and stops it.
async fn write_through_kills(server: &mut Server) -> Vec<String> {
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    for round in 0..2 {
        let stop = Arc::new(AtomicBool::new(false));
        let mut writers = Vec::new();
        for w in 0..WRITERS {
            let (http, url, token, acked, stop) =
                (server.http.clone(), server.url.clone(), server.token.clone(), acked.clone(), stop.clone());
            writers.push(tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::SeqCst) {
                    i += 1;
                    let response = http
                        .post(format!("{url}/api/compute/pools.create"))
                        .bearer_auth(&token)
                        .json(&json!({ "name": format!("r{round}-w{w}-{i}") }))
                        .send()
                        .await;
                    match response {
                        Ok(r) if r.status().is_success() => {
                            let body: serde_json::Value = r.json().await.unwrap_or_default();
                            if let Some(id) = body["poolId"].as_str() {
                                acked.lock().await.push(id.to_owned());
                            }
                        }
                        // Refused or cut off by the kill: not acknowledged, so no promise made.
                        _ => tokio::time::sleep(Duration::from_millis(5)).await,
                    }
                }
            }));
        }
        // Kill once this round's writers have been acknowledged a while, so the kill lands
        // among writes under way.
        let start = acked.lock().await.len();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while acked.lock().await.len() < start + ACKED_PER_ROUND {
            assert!(std::time::Instant::now() < deadline, "the writers were not acknowledged");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        server.kill9();
        stop.store(true, Ordering::SeqCst);
        for w in writers {
            w.await.unwrap();
        }
        server.restart();
    }
    let acked = acked.lock().await.clone();
    assert!(acked.len() > 20, "the test appended too little to mean anything: {}", acked.len());
    for id in &acked {
        let (status, pool) = server.call("pools.get", json!({ "poolId": id })).await;
        assert_eq!(status, 200, "acknowledged pool {id} is missing after kill -9: {pool}");
    }
    server.stop();
    acked
}

/// The chains verify, commit numbers are gap-free and the projections are the log's fold.
async fn check_after_kills(store: &dyn EventStore, acked: &[String]) {
    let (events, _) = bc_tests::verify_store(store).await;
    assert!(events as usize >= acked.len() + 2);
    // Commit numbers are gap-free: every transaction that took a number committed whole.
    let mut commits = std::collections::BTreeSet::new();
    let mut after = Position::START;
    loop {
        let page = decode_rows(store.read_after_rows(after, None, 1000).await.unwrap()).unwrap();
        let Some(last) = page.last() else { break };
        after = last.position;
        commits.extend(page.iter().map(|e| e.position.commit));
    }
    let last = store.last_commit().await.unwrap();
    assert_eq!(commits.into_iter().collect::<Vec<_>>(), (1..=last).collect::<Vec<_>>());
    // Projections committed with their events: they are the log's fold, and a rebuild changes
    // nothing.
    let before = bc_tests::rows_sorted(store).await;
    assert_eq!(before, bc_tests::fold_log(store).await, "the projection rows are the log's fold");
    rebuild_projections(store, &bc_projections::Projections).await.unwrap();
    assert_eq!(bc_tests::rows_sorted(store).await, before);
}
