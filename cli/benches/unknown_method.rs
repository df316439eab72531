//! `make bench` (unknown method): what an unauthenticated caller can make the server do. Requests
//! per second of `POST /api/compute/{64 KB name}` (an unknown method, no token) beside those of
//! `system.version` (a known public method), in the same run, on one real server (the gateway on
//! SQLite, in this process, on loopback) over plain HTTP/1.1.
//!
//! A 64 KB name does not fit the request head's bound (`conn::HEAD_BYTES_MAX`, 16 KiB): hyper
//! answers `431` and closes the connection, so an attacker pays a connection per request. The
//! goal row therefore compares the two kinds one request per connection, alike; the keep-alive
//! rows beside it show the known method's best case and the costliest unknown method that is
//! still routed (a 12 KB name: `NOT_FOUND`, no "did you mean").
//!
//! The ratio is known ÷ unknown: how many times more an unknown method costs than a known one
//! (goal: at most 2). `BC_BENCH_REQUESTS` sets the requests per kind (default 2000), in 5
//! alternating rounds whose median is shown.

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
/// The longest name that still fits the head's bound with room for the headers.
const ROUTED_NAME_BYTES: usize = 12_000;

/// How a kind of request is sent.
#[derive(Clone, Copy)]
enum Mode {
    /// One request after another on each connection; every answer has this status.
    KeepAlive(u16),
    /// A new connection per request; the answer has this status, or the connection is reset
    /// (a server that closes with the rest of a refused request unread makes the kernel send a
    /// reset, which may overtake the answer).
    Fresh(u16),
}

/// Requests per second of `count` POSTs of `path`, `CONCURRENCY` at a time. The request bytes
/// are made once and the answer is read by its `content-length`, so the client's own work per
/// request is a copy: what is measured is the server's.
async fn rate(addr: std::net::SocketAddr, path: &str, count: usize, mode: Mode) -> f64 {
    // One request per connection says so, and the server closes after its answer.
    let close = if matches!(mode, Mode::Fresh(_)) { "connection: close\r\n" } else { "" };
    let request: Arc<[u8]> =
        format!("POST {path} HTTP/1.1\r\nhost: bench\r\n{close}content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}")
            .into_bytes()
            .into();
    let started = Instant::now();
    let mut workers = Vec::new();
    for worker in 0..CONCURRENCY {
        let request = request.clone();
        let share = count / CONCURRENCY + usize::from(worker < count % CONCURRENCY);
        workers.push(tokio::spawn(async move {
            match mode {
                Mode::KeepAlive(expect) => {
                    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                    let mut buffer = Vec::new();
                    for _ in 0..share {
                        stream.write_all(&request).await.unwrap();
                        assert_eq!(read_response(&mut stream, &mut buffer).await, expect);
                    }
                }
                Mode::Fresh(expect) => {
                    for _ in 0..share {
                        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                        let _ = stream.set_nodelay(true);
                        // A refused head's connection may be closed before all of it is sent.
                        let _ = stream.write_all(&request).await;
                        let mut answer = Vec::new();
                        let _ = stream.read_to_end(&mut answer).await;
                        let status = format!("HTTP/1.1 {expect}");
                        assert!(
                            answer.is_empty() || answer.starts_with(status.as_bytes()),
                            "expected {status}: {:?}",
                            String::from_utf8_lossy(&answer[..answer.len().min(80)])
                        );
                    }
                }
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

pub fn main() {
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
        let routed = format!("/api/compute/{}", "p".repeat(ROUTED_NAME_BYTES));
        eprintln!("unknown-method benchmark: {count} requests each in {ROUNDS} rounds, {CONCURRENCY} at a time");
        // A fresh connection per request must not run out of ephemeral ports: 2000 requests a
        // kind leave at most a few thousand sockets in TIME_WAIT.
        let kinds: [(&str, &str, Mode); 4] = [
            ("known", &known, Mode::Fresh(200)),
            ("unknown", &unknown, Mode::Fresh(431)),
            ("known, keep-alive", &known, Mode::KeepAlive(200)),
            ("routed, keep-alive", &routed, Mode::KeepAlive(404)),
        ];
        // Warm up every path (connections, the method table).
        for (_, path, mode) in kinds {
            rate(addr, path, CONCURRENCY, mode).await;
        }
        // Rounds alternate the kinds and each rate is the median of its rounds, so load from
        // elsewhere on the machine falls on all of them alike.
        let mut all = vec![Vec::new(); kinds.len()];
        for _ in 0..ROUNDS {
            for (i, (_, path, mode)) in kinds.iter().enumerate() {
                all[i].push(rate(addr, path, count / ROUNDS, *mode).await);
            }
        }
        let rps: Vec<f64> = all.into_iter().map(median).collect();
        println!();
        println!("| request | requests/s |");
        println!("|:--------|-----------:|");
        println!("| system.version (known, public), a connection each | {:>10.0} |", rps[0]);
        println!(
            "| unknown method, {} KB name (431: over the head bound), a connection each | {:>10.0} |",
            NAME_BYTES / 1000,
            rps[1]
        );
        println!("| system.version, keep-alive | {:>10.0} |", rps[2]);
        println!("| unknown method, {} KB name (404, no suggestion), keep-alive | {:>10.0} |", ROUTED_NAME_BYTES / 1000, rps[3]);
        println!("| cost ratio unknown ÷ known, a connection each (goal ≤ 2) | {:>10.2} |", rps[0] / rps[1]);
        println!("| cost ratio routed unknown ÷ known, keep-alive | {:>10.2} |", rps[2] / rps[3]);
    });
}
