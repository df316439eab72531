//! `make bench` (unknown method): what an unauthenticated caller can make the server do. Requests
//! per second of `POST /api/compute/{64 KB name}` (an unknown method: `NOT_FOUND`, no token
//! needed) beside those of `system.version` (a known public method), in the same run, on one
//! real server (the gateway on SQLite, in this process, on loopback) and a real HTTP client.
//!
//! The ratio is known ÷ unknown: how many times more an unknown method costs than a known one.
//! The goal is at most 2 (the name is bounded before the "did you mean" compares it with every
//! method's). `BC_BENCH_REQUESTS` sets the requests per kind (default 2000).

use std::sync::Arc;
use std::time::Instant;

use bc_core::clock::SystemClock;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log};
use bc_gateway::AppState;
use bc_projections::Projections;

const REQUESTS_DEFAULT: usize = 2000;
/// Requests in flight at once, per kind.
const CONCURRENCY: usize = 16;
/// 64 KB: a URI is at most 65,534 bytes (the `http` crate's bound), so no longer name arrives.
const NAME_BYTES: usize = 64_000;

/// Requests per second of `count` POSTs to `url`, `CONCURRENCY` at a time; every answer must
/// have status `expect`.
async fn rate(http: &reqwest::Client, url: &str, count: usize, expect: u16) -> f64 {
    let started = Instant::now();
    let mut workers = Vec::new();
    for worker in 0..CONCURRENCY {
        let (http, url) = (http.clone(), url.to_owned());
        let share = count / CONCURRENCY + usize::from(worker < count % CONCURRENCY);
        workers.push(tokio::spawn(async move {
            for _ in 0..share {
                let response = http.post(&url).body("{}").header("content-type", "application/json").send().await.unwrap();
                assert_eq!(response.status().as_u16(), expect);
                response.bytes().await.unwrap();
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    count as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let count: usize = std::env::var("BC_BENCH_REQUESTS").ok().and_then(|n| n.parse().ok()).unwrap_or(REQUESTS_DEFAULT);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open(&dir.path().join("u.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let log =
            Arc::new(Log::open(store, Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/api/compute", listener.local_addr().unwrap());
        tokio::spawn(bc_gateway::serve(listener, Arc::new(AppState::new(log)), std::future::pending()));
        let http = reqwest::Client::new();
        let known = format!("{base}/system.version");
        let unknown = format!("{base}/{}", "p".repeat(NAME_BYTES));
        eprintln!("unknown-method benchmark: {count} requests each, {CONCURRENCY} at a time");
        // Warm up both paths (connections, the method table).
        rate(&http, &known, CONCURRENCY, 200).await;
        rate(&http, &unknown, CONCURRENCY, 404).await;
        let known_rps = rate(&http, &known, count, 200).await;
        let unknown_rps = rate(&http, &unknown, count, 404).await;
        println!();
        println!("| request | requests/s |");
        println!("|:--------|-----------:|");
        println!("| system.version (known, public) | {known_rps:>10.0} |");
        println!("| unknown method, {} KB name | {unknown_rps:>10.0} |", NAME_BYTES / 1000);
        println!("| cost ratio unknown ÷ known (goal ≤ 2) | {:>10.2} |", known_rps / unknown_rps);
    });
}
