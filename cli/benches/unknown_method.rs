//! `make bench` (unknown method): what an unauthenticated caller can make the server do. Requests
//! per second of `POST /api/compute/{64 KB name}` (an unknown method: `NOT_FOUND`, no token
//! needed) beside those of `system.version` (a known public method), in the same run, on one
//! real server (the gateway on SQLite, in this process, on loopback) and plain HTTP/1.1 over
//! keep-alive connections.
//!
//! The ratio is known ÷ unknown: how many times more an unknown method costs than a known one.
//! The goal is at most 2 (the name is bounded before the "did you mean" compares it with every
//! method's). `BC_BENCH_REQUESTS` sets the requests per kind (default 2000), in 5 alternating
//! rounds whose median is shown. A third row sends the same 64 KB request line to a path no
//! route takes (the router's 404): what HTTP itself costs for those bytes, the floor of any
//! answer to them.

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use bc_core::clock::SystemClock;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log};
use bc_gateway::AppState;
use bc_projections::Projections;

const REQUESTS_DEFAULT: usize = 2000;
/// Rounds per kind, alternating: the rate shown is the median.
const ROUNDS: usize = 5;

fn median(mut rates: Vec<f64>) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}
/// Connections, each with one request in flight.
const CONCURRENCY: usize = 16;
/// 64 KB: a URI is at most 65,534 bytes (the `http` crate's bound), so no longer name arrives.
const NAME_BYTES: usize = 64_000;

/// Requests per second of `count` POSTs of `path`, `CONCURRENCY` connections at a time, each
/// sending its requests one after another (keep-alive). The request bytes are made once and the
/// answer is read by its `content-length`, so the client's own work per request is a copy: what
/// is measured is the server's. Every answer must have status `expect`.
async fn rate(addr: std::net::SocketAddr, path: &str, count: usize, expect: u16) -> f64 {
    let request: Arc<[u8]> =
        format!("POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}")
            .into_bytes()
            .into();
    let started = Instant::now();
    let mut workers = Vec::new();
    for worker in 0..CONCURRENCY {
        let request = request.clone();
        let share = count / CONCURRENCY + usize::from(worker < count % CONCURRENCY);
        workers.push(tokio::spawn(async move {
            let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut buffer = Vec::new();
            for _ in 0..share {
                stream.write_all(&request).await.unwrap();
                let status = read_response(&mut stream, &mut buffer).await;
                assert_eq!(status, expect);
            }
        }));
    }
    for worker in workers {
        worker.await.unwrap();
    }
    count as f64 / started.elapsed().as_secs_f64()
}

/// Reads one HTTP/1.1 response with a `content-length` body; returns its status.
async fn read_response(stream: &mut tokio::net::TcpStream, buffer: &mut Vec<u8>) -> u16 {
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).to_ascii_lowercase();
            let status: u16 = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status line");
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("a content-length");
            while buffer.len() < end + 4 + length {
                let mut chunk = [0u8; 4096];
                let n = stream.read(&mut chunk).await.unwrap();
                assert!(n > 0, "the server closed the connection");
                buffer.extend_from_slice(&chunk[..n]);
            }
            buffer.drain(..end + 4 + length);
            return status;
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the server closed the connection");
        buffer.extend_from_slice(&chunk[..n]);
    }
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
        let addr = listener.local_addr().unwrap();
        tokio::spawn(bc_gateway::serve(listener, Arc::new(AppState::new(log)), std::future::pending()));
        let known = "/api/compute/system.version".to_owned();
        let unknown = format!("/api/compute/{}", "p".repeat(NAME_BYTES));
        // The same bytes on a path no route takes: the router's own 404, so what HTTP costs
        // for a 64 KB request line, before any of the gateway's code.
        let unrouted = format!("/x/{}", "p".repeat(NAME_BYTES));
        eprintln!("unknown-method benchmark: {count} requests each in {ROUNDS} rounds, {CONCURRENCY} at a time");
        // Warm up both paths (connections, the method table).
        rate(addr, &known, CONCURRENCY, 200).await;
        rate(addr, &unknown, CONCURRENCY, 404).await;
        rate(addr, &unrouted, CONCURRENCY, 404).await;
        // Rounds alternate the three kinds and each rate is the median of its rounds, so load
        // from elsewhere on the machine falls on all three alike.
        let (mut known_all, mut unknown_all, mut unrouted_all) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            known_all.push(rate(addr, &known, count / ROUNDS, 200).await);
            unknown_all.push(rate(addr, &unknown, count / ROUNDS, 404).await);
            unrouted_all.push(rate(addr, &unrouted, count / ROUNDS, 404).await);
        }
        let (known_rps, unknown_rps, unrouted_rps) = (median(known_all), median(unknown_all), median(unrouted_all));
        println!();
        println!("| request | requests/s |");
        println!("|:--------|-----------:|");
        println!("| system.version (known, public) | {known_rps:>10.0} |");
        println!("| unknown method, {} KB name | {unknown_rps:>10.0} |", NAME_BYTES / 1000);
        println!("| no route, the same 64 KB request line (HTTP's own cost) | {unrouted_rps:>10.0} |");
        println!("| cost ratio unknown ÷ known (goal ≤ 2) | {:>10.2} |", known_rps / unknown_rps);
        println!("| cost ratio unknown ÷ no route | {:>10.2} |", unrouted_rps / unknown_rps);
    });
}
