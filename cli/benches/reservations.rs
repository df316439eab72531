//! `make bench` (reservations): on a fleet of 10,000 nodes × 8 GPUs (one pool, SQLite, the real
//! gateway over HTTP on loopback, the reservations reconciler in process):
//! - reserve → active latency (p50, p99) of one client reserving one GPU at a time: the request
//!   is placed at once, so this is the create's round trip;
//! - queued → active latency: a reservation queued behind a full pool, from the release that
//!   frees its GPUs to the moment `reservations.get` shows it active (the reconciler's path);
//! - reservations per second with 16 concurrent clients until the pool is full;
//! - beside them, two baselines from the same run: HTTP appends on the same loaded database (16
//!   clients creating pools: an authenticated call that validates, reads a row, appends one event
//!   and reads its document back), which is a reservation's work minus what is under test (the
//!   fleet view, the quota, the queue and the placement decision, and the guarded append of three
//!   events on two streams), so the ratio is what placing costs over a plain HTTP append; and
//!   the raw in-process append rate of the same store (single-event appends, 16 at once).
//!
//! The reservations and the two baselines are measured in [`TURNS`] turns on the loaded
//! database (raw appends, HTTP appends, then a share of the reservations, each turn), and each
//! rate is its total over its time in all turns: a machine that speeds up or slows down during
//! the run moves all three alike. (Measured once each, minutes apart, the raw rate moved from
//! 15,638 to 20,308 appends/s between its run before the reservations and its run after them,
//! and the goal's ratio with it.)

use std::sync::{Arc, Mutex};
use std::time::Instant;

use bc_core::clock::SystemClock;
use bc_core::id::{NodeId, PoolId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_gateway::AppState;
use bc_projections::events::{self as ev, Gpu};
use bc_projections::{KIND_NODE, KIND_POOL, Projections, stream_of};
use serde_json::{Value, json};

const NODES: usize = 10_000;
const GPUS_PER_NODE: u32 = 8;
const CLIENTS: usize = 16;
const LATENCY_SAMPLES: usize = 300;
const QUEUED_SAMPLES: usize = 30;
const RAW_APPENDS: usize = 4000;
/// HTTP appends (pool creates) of the baseline on the loaded database.
const HTTP_APPENDS: usize = 2000;
/// The throughput and its baselines are measured in this many turns.
const TURNS: usize = 5;
const _: () = assert!(RAW_APPENDS.is_multiple_of(TURNS) && HTTP_APPENDS.is_multiple_of(TURNS));

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn append(tenant: TenantId, stream: String, event_type: &str, payload: ciborium::Value) -> AppendRequest {
    AppendRequest::new(tenant, stream, ExpectedVersion::Any, "bench", vec![NewEvent::new(event_type, payload)])
}

/// Raw single-event appends into the log's database, `count` of them 16 at once, each a pool of
/// a tenant of its own: the seconds they took.
async fn raw_appends(log: &Arc<Log>, turn: usize, count: usize) -> f64 {
    let l = log.clone();
    concurrently(count, CLIENTS, move |i| {
        let l = l.clone();
        async move {
            let payload = ev::to_cbor(&ev::PoolCreated::named(format!("raw-{turn}-{i}"))).unwrap();
            l.append(append(TenantId::generate(), stream_of(KIND_POOL, &PoolId::generate()), ev::POOL_CREATED, payload))
                .await
                .unwrap();
        }
    })
    .await
}

/// Runs `f(0..total)` on `clients` tasks at once: the seconds it took.
async fn concurrently<F, Fut>(total: usize, clients: usize, f: F) -> f64
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (next, f) = (next.clone(), f.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= total {
                    break;
                }
                f(i).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed().as_secs_f64()
}

async fn call(http: &reqwest::Client, url: &str, token: &str, method: &str, body: Value) -> Value {
    let r = http.post(format!("{url}/api/compute/{method}")).bearer_auth(token).json(&body).send().await.unwrap();
    let status = r.status();
    let v: Value = r.json().await.unwrap();
    assert!(status.is_success(), "{method}: {v}");
    v
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("r.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let log =
            Arc::new(Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap());

        let token = Arc::new(Mutex::new(String::new()));
        let t2 = token.clone();
        bc_gateway::bootstrap_root(&log, move |t| { *t2.lock().unwrap() = t.to_owned(); Ok(()) }, || {}).await.unwrap();
        let token = token.lock().unwrap().clone();
        let tenant = TenantId::ROOT;
        let pool = PoolId::generate().to_string();
        let created =
            ev::PoolCreated::named("bench");
        log.append(append(tenant, stream_of(KIND_POOL, &pool), ev::POOL_CREATED, ev::to_cbor(&created).unwrap())).await.unwrap();
        eprintln!("registering {NODES} nodes × {GPUS_PER_NODE} GPUs…");
        let (l, p) = (log.clone(), pool.clone());
        let registered_s = concurrently(NODES, CLIENTS, move |i| {
            let (l, p) = (l.clone(), p.clone());
            async move {
                let gpus = (0..GPUS_PER_NODE)
                    .map(|g| Gpu { model: "H100".into(), product: "H100-SXM5-80GB".into(), vram_gib: 80, nvlink_domain: g / 4 })
                    .collect();
                let node = ev::NodeRegistered { pool_id: p, name: format!("n{i}"), gpus, labels: Default::default() };
                l.append(append(TenantId::ROOT, stream_of(KIND_NODE, &NodeId::generate()), ev::NODE_REGISTERED, ev::to_cbor(&node).unwrap()))
                    .await
                    .unwrap();
            }
        })
        .await;
        eprintln!("  in {registered_s:.1} s");

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let mut state = AppState::new(log.clone());
        // The bench measures the write path, not the per-key rate limit.
        state.rate_limiter = Arc::new(bc_gateway::rate_limit::RateLimiter::new(bc_gateway::rate_limit::RateLimits::off()));
        let state = Arc::new(state);
        tokio::spawn(bc_gateway::serve(listener, state, std::future::pending()));
        let (_stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(bc_reconcilers::reservations::run(log.clone(), Arc::new(SystemClock), 500, Some(log.subscribe()), stopped));
        let http = reqwest::Client::new();

        // Warm the gateway's fleet view (its first use reads every node).
        let started = Instant::now();
        call(&http, &url, &token, "capacity.preview", json!({ "poolId": pool, "gpus": 1, "durationS": 60 })).await;
        let first_use_ms = started.elapsed().as_secs_f64() * 1000.0;

        // Reserve → active, one client, one GPU at a time.
        let mut latency = Vec::new();
        for _ in 0..LATENCY_SAMPLES {
            let started = Instant::now();
            let r = call(&http, &url, &token, "reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 3600 })).await;
            assert_eq!(r["state"], "active");
            latency.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        latency.sort_by(|a, b| a.partial_cmp(b).unwrap());

        // Throughput: 16 clients reserving 4 GPUs each until the pool is full, in turns with the
        // two baselines on the same loaded database, by the same 16 clients: raw single-event
        // appends in process, and plain HTTP appends.
        let capacity = NODES as u32 * GPUS_PER_NODE - LATENCY_SAMPLES as u32;
        let asks = (capacity / 4) as usize;
        let (mut raw_s, mut http_s, mut created_s) = (0.0, 0.0, 0.0);
        let queued_at_create = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for turn in 0..TURNS {
            raw_s += raw_appends(&log, turn, RAW_APPENDS / TURNS).await;
            let (h, u, t) = (http.clone(), url.clone(), token.clone());
            http_s += concurrently(HTTP_APPENDS / TURNS, CLIENTS, move |i| {
                let (h, u, t) = (h.clone(), u.clone(), t.clone());
                async move {
                    call(&h, &u, &t, "pools.create", json!({ "name": format!("baseline-{turn}-{i}") })).await;
                }
            })
            .await;
            let share = if turn + 1 == TURNS { asks - asks / TURNS * (TURNS - 1) } else { asks / TURNS };
            let (h, u, t, p, q) = (http.clone(), url.clone(), token.clone(), pool.clone(), queued_at_create.clone());
            created_s += concurrently(share, CLIENTS, move |_| {
                let (h, u, t, p, q) = (h.clone(), u.clone(), t.clone(), p.clone(), q.clone());
                async move {
                    let r = call(&h, &u, &t, "reservations.create", json!({ "poolId": p, "gpus": 4, "durationS": 3600 })).await;
                    if r["state"] == "queued" {
                        q.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            })
            .await;
        }
        let queued_at_create = queued_at_create.load(std::sync::atomic::Ordering::Relaxed);
        // Until the reconciler has activated whatever was queued.
        let started = Instant::now();
        loop {
            let q = call(&http, &url, &token, "reservations.list", json!({ "state": "queued", "limit": 1 })).await;
            let cap = call(&http, &url, &token, "capacity.get", json!({ "poolId": pool })).await;
            if cap["items"][0]["free"].as_u64().unwrap() < 4 || (q["items"].as_array().unwrap().is_empty() && q["nextCursor"].is_null()) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let all_s = created_s + started.elapsed().as_secs_f64();
        let rate = asks as f64 / all_s;
        let (raw_rate, http_rate) = (RAW_APPENDS as f64 / raw_s, HTTP_APPENDS as f64 / http_s);

        // Queued → active: the pool is full; queue one, release one, time until it is active.
        let active = call(&http, &url, &token, "reservations.list", json!({ "state": "active", "limit": QUEUED_SAMPLES })).await;
        let mut queued_ms = Vec::new();
        for victim in active["items"].as_array().unwrap().iter().take(QUEUED_SAMPLES) {
            let gpus = victim["gpus"].as_u64().unwrap();
            let q = call(&http, &url, &token, "reservations.create", json!({ "poolId": pool, "gpus": gpus, "durationS": 3600 })).await;
            assert_eq!(q["state"], "queued", "{q}");
            let started = Instant::now();
            call(&http, &url, &token, "reservations.release", json!({ "reservationId": victim["reservationId"] })).await;
            loop {
                let r = call(&http, &url, &token, "reservations.get", json!({ "reservationId": q["reservationId"] })).await;
                if r["state"] == "active" {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            queued_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        queued_ms.sort_by(|a, b| a.partial_cmp(b).unwrap());

        println!("reservations: {NODES} nodes × {GPUS_PER_NODE} GPUs in one pool, SQLite, HTTP on loopback");
        println!(
            "  raw single-event appends, in process  {raw_rate:>8.0} /s   ({RAW_APPENDS} in {TURNS} turns beside the reservations')"
        );
        println!(
            "  HTTP appends on the loaded database   {http_rate:>8.0} /s   (the baseline: {CLIENTS} clients creating pools, {HTTP_APPENDS} in {TURNS} turns)"
        );
        println!("  first placement (loads the fleet view) {first_use_ms:>7.1} ms");
        println!(
            "  reserve → active (placed at once)      p50 {:.2} ms  p99 {:.2} ms  ({LATENCY_SAMPLES} sequential)",
            percentile(&latency, 0.5),
            percentile(&latency, 0.99)
        );
        println!(
            "  queued → active (after a release)      p50 {:.2} ms  p99 {:.2} ms  ({QUEUED_SAMPLES} samples)",
            percentile(&queued_ms, 0.5),
            percentile(&queued_ms, 0.99)
        );
        println!(
            "  reservations, {CLIENTS} clients, 4 GPUs each  {rate:>8.0} /s   ratio {:.2} of HTTP appends ({:.2} of raw)  ({asks} in {all_s:.1} s in {TURNS} turns; creates answered in {created_s:.1} s)",
            rate / http_rate,
            rate / raw_rate
        );
        println!("  of which queued at their create           {queued_at_create:>8}   (the rest placed at once)");
        let p99 = percentile(&latency, 0.99);
        println!("goal 5: reservations >= 0.30 of the raw append rate, reserve → active p99 <= 10 ms");
        // Three places, so a ratio just under the goal does not read as on it.
        println!("  ratio to raw appends {:.3}  {}", rate / raw_rate, if rate / raw_rate >= 0.3 { "met" } else { "MISSED" });
        println!("  reserve → active p99 {p99:.2} ms  {}", if p99 <= 10.0 { "met" } else { "MISSED" });
    });
}
