//! `make bench` (watch): commit-to-client latency of `GET /watch` with 1 and with 100 connected
//! watchers, beside the latency of the append itself in the same run. One real server (the
//! gateway on SQLite, in this process, on loopback) and real SSE clients (reqwest).
//!
//! Each event is appended once the previous one reached every watcher. The watcher's latency is
//! measured from the commit (the moment the appender announces the commit number, which it does
//! right after the transaction commits) to the moment a watcher has parsed the event, so it does
//! not include the append's own work; the append's latency (request to acknowledgement) is shown
//! beside it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bc_core::clock::SystemClock;
use bc_core::id::{PoolId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, ExpectedVersion, Log, NewEvent};
use bc_gateway::AppState;
use bc_projections::Projections;
use bc_projections::events as ev;
use futures::StreamExt;

const EVENTS: usize = 200;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn run(watchers: usize) -> ([f64; 2], [f64; 2]) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(&dir.path().join("w.sqlite3")).await.unwrap());
    bc_core::store::EventStore::migrate(&*store).await.unwrap();
    let log =
        Arc::new(Log::open(store, Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap());
    let token = Arc::new(Mutex::new(String::new()));
    let t2 = token.clone();
    bc_gateway::bootstrap_root(
        &log,
        move |t| {
            *t2.lock().unwrap() = t.to_owned();
            Ok(())
        },
        || {},
    )
    .await
    .unwrap();
    let token = token.lock().unwrap().clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // Every watcher uses the one administrator key: the per-key and per-tenant limits are
    // raised to the total, which is what is measured.
    let mut state = AppState::new(log.clone());
    let all = bc_gateway::watch::WATCHERS_MAX;
    state.watchers =
        bc_gateway::watch::WatcherSlots::new(bc_gateway::watch::WatcherLimits { total: all, per_tenant: all, per_key: all });
    tokio::spawn(bc_gateway::serve(listener, Arc::new(state), std::future::pending()));

    // Arrival times per event id, per watcher.
    let arrivals: Arc<Mutex<HashMap<String, Vec<Instant>>>> = Arc::default();
    let http = reqwest::Client::new();
    for _ in 0..watchers {
        let (http, url, token, arrivals) = (http.clone(), url.clone(), token.clone(), arrivals.clone());
        let response = http.get(format!("{url}/watch?types=pool.*")).bearer_auth(&token).send().await.unwrap();
        assert!(response.status().is_success());
        tokio::spawn(async move {
            let mut body = response.bytes_stream();
            let mut buffer = Vec::new();
            while let Some(Ok(chunk)) = body.next().await {
                buffer.extend_from_slice(&chunk);
                while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
                    let block: Vec<u8> = buffer.drain(..end + 2).collect();
                    let text = String::from_utf8_lossy(&block);
                    if let Some(data) = text.lines().find_map(|l| l.strip_prefix("data:")) {
                        let value: serde_json::Value = serde_json::from_str(data.trim()).unwrap();
                        let id = value["id"].as_str().unwrap().to_owned();
                        arrivals.lock().unwrap().entry(id).or_default().push(Instant::now());
                    }
                }
            }
        });
    }
    // When each commit was announced: the appender's commit notification, seen here at once
    // (appends are one at a time, so no commit is coalesced into the next).
    let committed: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
    let mut commits = log.subscribe();
    let seen = committed.clone();
    tokio::spawn(async move {
        while commits.changed().await.is_ok() {
            let n = *commits.borrow_and_update();
            seen.lock().unwrap().insert(n, Instant::now());
        }
    });
    let mut append_ms = Vec::new();
    let mut client_ms = Vec::new();
    let mut missed_commits = 0usize;
    for i in 0..EVENTS {
        let pool = PoolId::generate();
        let payload = ev::to_cbor(&ev::PoolCreated {
            name: format!("w{i}"),
            description: String::new(),
            labels: Default::default(),
            max_reservation_s: None,
        })
        .unwrap();
        let started = Instant::now();
        let result = log
            .append(AppendRequest {
                tenant: TenantId::ROOT,
                stream: format!("pool/{pool}"),
                expected: ExpectedVersion::NoStream,
                idempotency_key: None,
                actor: "bench".into(),
                causation: None,
                correlation: None,
                fingerprint: None,
                guards: vec![],
                events: vec![NewEvent::new(ev::POOL_CREATED, payload)],
            })
            .await
            .unwrap();
        let acknowledged = Instant::now();
        append_ms.push(acknowledged.duration_since(started).as_secs_f64() * 1e3);
        let id = result.events[0].envelope.id.to_string();
        let commit = result.events[0].position.commit;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let done = arrivals.lock().unwrap().get(&id).map(|v| v.len()).unwrap_or(0) == watchers;
            if done || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        let from = match committed.lock().unwrap().remove(&commit) {
            Some(at) => at,
            // The notification task ran late and saw a later commit first (a watch channel keeps
            // the newest value): this one is timed from the acknowledgement, just after commit.
            None => {
                missed_commits += 1;
                acknowledged
            }
        };
        for t in arrivals.lock().unwrap().remove(&id).unwrap_or_default() {
            client_ms.push(t.saturating_duration_since(from).as_secs_f64() * 1e3);
        }
    }
    assert_eq!(client_ms.len(), EVENTS * watchers, "every watcher got every event");
    if missed_commits > 0 {
        eprintln!(
            "  {missed_commits} of {EVENTS} events timed from the append's acknowledgement (their commit notification was coalesced)"
        );
    }
    append_ms.sort_by(f64::total_cmp);
    client_ms.sort_by(f64::total_cmp);
    ([percentile(&append_ms, 0.5), percentile(&append_ms, 0.99)], [percentile(&client_ms, 0.5), percentile(&client_ms, 0.99)])
}

fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let mut lines = Vec::new();
        for watchers in [1, 100] {
            eprintln!("watch benchmark: {watchers} watcher(s), {EVENTS} events");
            lines.push((watchers, run(watchers).await));
        }
        println!();
        println!("| watchers | append p50 / p99 (ms) | commit → watcher p50 / p99 (ms) |");
        println!("|---------:|----------------------:|--------------------------------:|");
        for (w, (a, c)) in lines {
            println!("| {w:>8} | {:>9.2} / {:>9.2} | {:>14.2} / {:>14.2} |", a[0], a[1], c[0], c[1]);
        }
    });
}
