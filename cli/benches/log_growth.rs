//! `make bench` (log_growth), goal 2: the costs users feel stay flat as a tenant's log
//! grows. Six operations, each timed on a tenant whose log holds `SMALL_EVENTS` and on one
//! whose log holds `LARGE_EVENTS`, two databases set up alike, each with its gateway:
//!
//! - `events.list`, the first page with a type filter (`reservation.*`);
//! - `GET /watch` resumed from a recent position (`RESUME_BACK_EVENTS` back), until it has
//!   every event since;
//! - `reservations.create` (one GPU; each released again, untimed);
//! - `capacity.get`;
//! - sealing a checkpoint after `SEAL_AFTER_EVENTS` more events, by the sealer the checkpoints
//!   reconciler keeps between passes (`audit::Sealer`); a walk from seq 1, as it makes once a
//!   day and every seal made before, is timed once per log and printed apart;
//! - `GET /audit/{tenant}/checkpoint`, the newest checkpoint (what a monitor polls, and what
//!   every tile request reads first).
//!
//! Each log is sealed every `SEAL_EVERY_EVENTS` as it grows, as the hourly reconciler would
//! over its life: the large log holds about a hundred times the checkpoints of the small one.
//!
//! The log grows by `pool.updated` events on a pool of its own (appended in process, 100 per
//! append), so the tenant's state (its pools, nodes and live reservations) stays the same size
//! and only the log grows. The gateway on SQLite is served in this process on a runtime of its
//! own; the client is reqwest over HTTP/1.1 on loopback. The two are measured in turns
//! (`ROUNDS` rounds, each taking its share of the samples on the small log, then on the large),
//! so a machine that speeds up or slows down during the run moves both alike. Each figure is
//! the median of `SAMPLES` calls after `WARMUP` that are not counted. Goal: large ÷ small ≤ 1.3
//! for each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bc_core::audit::{self, Sealer, Trust};
use bc_core::id::{NodeId, PoolId, TenantId};
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::{KIND_NODE, KIND_POOL, stream_of};
use futures::StreamExt;
use serde_json::{Value, json};

use crate::support::gateway;

const SMALL_EVENTS: u64 = 10_000;
const LARGE_EVENTS: u64 = 1_000_000;
/// Filler events per append (one transaction).
const FILL_BATCH_EVENTS: u64 = 100;
const NODES: usize = 100;
const GPUS_PER_NODE: u32 = 8;
const SAMPLES: usize = 200;
const WARMUP: usize = 20;
/// Turns between the two logs; each round takes `SAMPLES / ROUNDS` samples of each operation.
const ROUNDS: usize = 5;
/// How far back the resumed watch starts.
const RESUME_BACK_EVENTS: u64 = 50;
const GOAL_RATIO_MAX: f64 = 1.3;
/// Events appended (untimed) before each timed seal: the log's growth between two passes.
const SEAL_AFTER_EVENTS: u64 = 100;
/// Events between two seals while a log grows.
const SEAL_EVERY_EVENTS: u64 = 1_000;

const SEAL_ROW: &str = "checkpoint seal after 100 more events (the reconciler's sealer)";
const _: () = assert!(SEAL_AFTER_EVENTS == 100, "SEAL_ROW names the count");

fn median(mut ms: Vec<f64>) -> f64 {
    ms.sort_by(f64::total_cmp);
    ms[ms.len() / 2]
}

struct Client {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Client {
    async fn call(&self, method: &str, body: Value) -> Value {
        let r = self
            .http
            .post(format!("{}/api/compute/{method}", self.url))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        let value: Value = r.json().await.unwrap();
        assert!(status.is_success(), "{method}: {status} {value}");
        value
    }

    /// The milliseconds of `f` over `samples` calls, after `warmup` not counted, into `ms`.
    async fn timed<F, Fut>(&self, warmup: usize, samples: usize, ms: &mut Vec<f64>, f: F)
    where
        F: Fn(usize) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        for i in 0..warmup + samples {
            let started = Instant::now();
            f(i).await;
            if i >= warmup {
                ms.push(started.elapsed().as_secs_f64() * 1000.0);
            }
        }
    }

    /// One resumed watch: from `since`, until `expected` events arrived.
    async fn watch_from(&self, since: &str, expected: u64) {
        let r = self.http.get(format!("{}/watch?since={since}", self.url)).bearer_auth(&self.token).send().await.unwrap();
        assert!(r.status().is_success(), "watch: {}", r.status());
        let mut stream = r.bytes_stream();
        // Counted by the lines that start with `id:` (one per event; heartbeats are comments).
        let (mut seen, mut buf, mut pos) = (0u64, Vec::new(), 0usize);
        while seen < expected {
            let chunk =
                tokio::time::timeout(Duration::from_secs(30), stream.next()).await.expect("watch stalled").unwrap().unwrap();
            buf.extend_from_slice(&chunk);
            while let Some(nl) = buf[pos..].iter().position(|b| *b == b'\n') {
                if buf[pos..pos + nl].starts_with(b"id:") {
                    seen += 1;
                }
                pos += nl + 1;
            }
        }
    }
}

/// What one log's calls took, in milliseconds, every sample.
#[derive(Default)]
struct Samples {
    events_list: Vec<f64>,
    watch_resume: Vec<f64>,
    reserve: Vec<f64>,
    capacity: Vec<f64>,
    seal: Vec<f64>,
    checkpoint: Vec<f64>,
}

/// One database with its gateway: the tenant's log, and what the calls name.
struct Db {
    client: Client,
    log: Arc<Log>,
    store: Arc<dyn EventStore>,
    pool: String,
    filler: String,
    tenant: TenantId,
    sealer: Sealer,
    trust: Trust,
}

/// One round of the six operations on `db`: `samples` calls each, after `warmup`.
async fn measure(db: &mut Db, warmup: usize, samples: usize, into: &mut Samples) {
    let client = &db.client;
    client
        .timed(warmup, samples, &mut into.events_list, |_| async {
            client.call("events.list", json!({ "types": ["reservation.*"], "limit": 20 })).await;
        })
        .await;
    client
        .timed(warmup, samples, &mut into.capacity, |_| async {
            client.call("capacity.get", json!({ "poolId": db.pool })).await;
        })
        .await;
    for i in 0..warmup + samples {
        let started = Instant::now();
        let r = client.call("reservations.create", json!({ "poolId": db.pool, "gpus": 1, "durationS": 3600 })).await;
        if i >= warmup {
            into.reserve.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        assert_eq!(r["state"], "active", "{r}");
        client.call("reservations.release", json!({ "reservationId": r["reservationId"] })).await;
    }
    // A recent position: the position of the event RESUME_BACK_EVENTS from the end.
    let last = db.store.last_commit().await.unwrap();
    let back = db
        .store
        .read_after_touches(bc_core::event::Position { commit: last.saturating_sub(RESUME_BACK_EVENTS), index: 0 }, 10_000)
        .await
        .unwrap();
    let since = back.first().map(|t| format!("{}.{}", t.commit, t.index)).unwrap();
    let expected = back.len() as u64 - 1;
    client.timed(warmup, samples, &mut into.watch_resume, |_| async { client.watch_from(&since, expected).await }).await;
    for i in 0..warmup + samples {
        grow(&db.log, db.tenant, &db.filler, SEAL_AFTER_EVENTS).await;
        let started = Instant::now();
        let sealed = db.sealer.seal(&db.log, db.tenant, audit::DEPLOYMENT_DEFAULT, &db.trust).await.unwrap();
        if i >= warmup {
            into.seal.push(started.elapsed().as_secs_f64() * 1000.0);
        }
        assert!(sealed.is_some(), "the log grew, so a checkpoint is sealed");
    }
    let url = format!("{}/audit/{}/checkpoint", client.url, db.tenant);
    client
        .timed(warmup, samples, &mut into.checkpoint, |_| async {
            let r = client.http.get(&url).bearer_auth(&client.token).send().await.unwrap();
            assert!(r.status().is_success(), "checkpoint: {}", r.status());
            assert!(r.text().await.unwrap().contains("/audit/"));
        })
        .await;
}

/// Grows the log by `count` filler events, sealing every `SEAL_EVERY_EVENTS` with `db`'s sealer.
async fn grow_sealed(db: &mut Db, count: u64) {
    let mut done = 0;
    while done < count {
        let n = SEAL_EVERY_EVENTS.min(count - done);
        grow(&db.log, db.tenant, &db.filler, n).await;
        db.sealer.seal(&db.log, db.tenant, audit::DEPLOYMENT_DEFAULT, &db.trust).await.unwrap();
        done += n;
        if done % 100_000 == 0 {
            eprintln!("  {done} filler events");
        }
    }
}

/// Appends `count` filler events (`pool.updated` on the filler pool), 100 per transaction.
async fn grow(log: &Log, tenant: TenantId, filler: &str, count: u64) {
    let started = Instant::now();
    let mut done = 0;
    while done < count {
        let n = FILL_BATCH_EVENTS.min(count - done);
        let events = (0..n)
            .map(|i| {
                let update = ev::PoolUpdated { description: Some(format!("filler {}", done + i)), ..Default::default() };
                NewEvent::new(ev::POOL_UPDATED, ev::to_cbor(&update).unwrap())
            })
            .collect();
        log.append(AppendRequest::new(tenant, stream_of(KIND_POOL, &filler), ExpectedVersion::Any, "bench", events))
            .await
            .unwrap();
        done += n;
        if count >= 100_000 && done % 100_000 == 0 {
            eprintln!("  {done} filler events ({:.0}/s)", done as f64 / started.elapsed().as_secs_f64());
        }
    }
}

/// Starts a gateway on a fresh database at `path` and sets the tenant up: the pool the calls
/// use, `NODES` nodes in it, and the pool the filler events go to.
async fn open_db(path: &std::path::Path, tenant: TenantId) -> Db {
    let server = gateway::start(path, |_| {}).await;
    let (pool, filler) = (PoolId::generate().to_string(), PoolId::generate().to_string());
    for (id, name) in [(&pool, "gpus"), (&filler, "filler")] {
        let created = ev::PoolCreated::named(name);
        let event = NewEvent::new(ev::POOL_CREATED, ev::to_cbor(&created).unwrap());
        server
            .log
            .append(AppendRequest::new(tenant, stream_of(KIND_POOL, id), ExpectedVersion::NoStream, "bench", vec![event]))
            .await
            .unwrap();
    }
    for i in 0..NODES {
        let gpus = (0..GPUS_PER_NODE)
            .map(|g| Gpu { model: "H100".into(), product: "H100-SXM5-80GB".into(), vram_gib: 80, nvlink_domain: g / 4 })
            .collect();
        let node = ev::NodeRegistered { pool_id: pool.clone(), name: format!("n{i}"), gpus, labels: Default::default() };
        let event = NewEvent::new(ev::NODE_REGISTERED, ev::to_cbor(&node).unwrap());
        let stream = stream_of(KIND_NODE, &NodeId::generate());
        server.log.append(AppendRequest::new(tenant, stream, ExpectedVersion::NoStream, "bench", vec![event])).await.unwrap();
    }
    let client = Client { http: reqwest::Client::new(), url: server.url, token: server.token };
    let trust = Trust::of(&[server.key.public()], audit::DEPLOYMENT_DEFAULT).unwrap();
    Db { client, log: server.log, store: server.store, pool, filler, tenant, sealer: Sealer::default(), trust }
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server_runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let client_runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tenant = TenantId::ROOT;
    let head = |store: &Arc<dyn EventStore>| {
        let store = store.clone();
        server_runtime
            .block_on(async move { store.heads().await.unwrap().iter().find(|(t, _)| *t == tenant).map(|(_, h)| h.seq).unwrap() })
    };
    let mut sized = Vec::new();
    let mut full_walks_ms = Vec::new();
    for (name, events) in [("small", SMALL_EVENTS), ("large", LARGE_EVENTS)] {
        let path = dir.path().join(format!("{name}.sqlite3"));
        let mut db = server_runtime.block_on(open_db(&path, tenant));
        eprintln!("log_growth: growing the {name} log to {events} events, sealed every {SEAL_EVERY_EVENTS}…");
        let have = head(&db.store);
        server_runtime.block_on(grow_sealed(&mut db, events.saturating_sub(have)));
        let at = head(&db.store);
        // A walk from seq 1 (it seals nothing: the log has not grown since the last seal).
        let started = Instant::now();
        server_runtime.block_on(audit::seal(&db.log, tenant, audit::DEPLOYMENT_DEFAULT, &db.trust)).unwrap();
        full_walks_ms.push(started.elapsed().as_secs_f64() * 1000.0);
        sized.push((db, at, Samples::default()));
    }
    eprintln!("  measuring both in {ROUNDS} rounds…");
    for round in 0..ROUNDS {
        let warmup = if round == 0 { WARMUP } else { 0 };
        for (db, _, samples) in &mut sized {
            client_runtime.block_on(measure(db, warmup, SAMPLES / ROUNDS, samples));
        }
    }
    let [(_, small_at, small), (_, large_at, large)] = <[_; 2]>::try_from(sized).ok().expect("two logs");

    println!();
    println!(
        "log_growth: one tenant a database, SQLite, {NODES} nodes × {GPUS_PER_NODE} GPUs; median of {} calls (ms), taken in {ROUNDS} turns",
        SAMPLES / ROUNDS * ROUNDS
    );
    println!("| operation | at {small_at} events | at {large_at} events | ratio |");
    println!("|-----------|------:|------:|------:|");
    let rows = [
        ("events.list, first page, types reservation.*", median(small.events_list), median(large.events_list)),
        ("watch resumed from a recent position", median(small.watch_resume), median(large.watch_resume)),
        ("reservations.create", median(small.reserve), median(large.reserve)),
        ("capacity.get", median(small.capacity), median(large.capacity)),
        (SEAL_ROW, median(small.seal), median(large.seal)),
        ("GET /audit/{tenant}/checkpoint", median(small.checkpoint), median(large.checkpoint)),
    ];
    for (name, a, b) in rows {
        println!("| {name} | {a:.2} | {b:.2} | {:.2} |", b / a);
    }
    println!(
        "(a seal's walk from seq 1, as the checkpoints reconciler makes once a day and every seal made before: {:.1} and {:.1} ms)",
        full_walks_ms[0], full_walks_ms[1]
    );
    println!("goal 2: each at most {GOAL_RATIO_MAX}× apart");
    for (name, a, b) in rows {
        let ratio = b / a;
        println!("  {name}: {ratio:.2}  {}", if ratio <= GOAL_RATIO_MAX { "met" } else { "MISSED" });
    }
    drop(server_runtime);
}
