//! `make bench` (audit): `audit verify` events per second on a log of 1,000,000 events (set
//! `BENCH_AUDIT_EVENTS` to change it), beside the raw rate of SHA-256 plus batch Ed25519
//! verification of the same events (their signatures: one per append and every 16th seq) on
//! the same number of threads, measured in the same run; and
//! the peak resident memory of the verify.
//!
//! On SQLite and then on PostgreSQL (a scratch database). The log is written through the real
//! append path (`Log::append`, two appends of 500 events in flight, so batches of 1,000 events,
//! signed on all cores); one tenant, sealed once at the end.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bc_core::audit::{self, Trust};
use bc_core::event::sha256;
use bc_core::id::TenantId;
use bc_core::keys::{LogKey, event_signing_message};
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::Projections;
use ciborium::Value;

const BATCH: u64 = 1000;

/// A `/proc/self/status` field in KiB: `VmHWM` (the peak resident set) or `VmRSS` (now).
fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// CPU time this process has used, user and system, from `/proc/self/stat` (in clock ticks of
/// 10 ms, the kernel's `USER_HZ` on Linux).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's closing parenthesis; utime and stime are the 14th and 15th.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
    let ticks: u64 = after.split_whitespace().skip(11).take(2).filter_map(|t| t.parse::<u64>().ok()).sum();
    ticks as f64 / 100.0
}

fn rss_peak_kib() -> u64 {
    status_kib("VmHWM:")
}

fn reset_rss_peak() {
    // Linux: writing 5 to clear_refs resets VmHWM to the current RSS.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

async fn generate(log: &Log, tenant: TenantId, total: u64) {
    let started = Instant::now();
    let mut seq = 0u64;
    while seq < total {
        // Two appends in flight, so the appender commits them as one batch of `BATCH` events.
        let mut appends = Vec::new();
        for half in 0..2 {
            let first = seq + half * BATCH / 2;
            let count = (BATCH / 2).min(total.saturating_sub(first));
            if count == 0 {
                break;
            }
            let events = (first..first + count)
                .map(|n| NewEvent::new("bench.happened", Value::Map(vec![(Value::Text("n".into()), Value::Integer(n.into()))])))
                .collect();
            let stream = format!("bench/{}", (first / (BATCH / 2)) % 1000);
            appends.push(log.append(AppendRequest::new(tenant, stream, ExpectedVersion::Any, "bench", events)));
        }
        for appended in futures::future::join_all(appends).await {
            seq = seq.max(appended.unwrap().events.last().unwrap().envelope.seq);
        }
        if seq.is_multiple_of(100_000) {
            eprintln!("  generated {seq} events ({:.0}/s)", seq as f64 / started.elapsed().as_secs_f64());
        }
    }
}

/// SHA-256 of every canonical encoding plus batch verification of every signature stored, on
/// `threads` threads, over the same rows, timing only that work.
async fn raw_rate(store: &dyn EventStore, tenant: TenantId, key: &LogKey, total: u64, threads: usize) -> f64 {
    let public = key.public();
    let mut cpu = Duration::ZERO;
    let mut from = 1;
    while from <= total {
        let rows = store.read_chain_rows(tenant, from, 1000).await.unwrap();
        from += rows.len() as u64;
        let started = Instant::now();
        let chunk = rows.len().div_ceil(threads).max(1);
        std::thread::scope(|s| {
            for part in rows.chunks(chunk) {
                s.spawn(move || {
                    // Every event hashed; the signatures the events carry verified (the last
                    // of each append's chain and every 16th seq: LOG-FORMAT.md, "Signature").
                    let hashes: Vec<[u8; 32]> = part.iter().map(|r| sha256(&r.canonical)).collect();
                    let signed: Vec<usize> = (0..part.len()).filter(|i| !part[*i].sig.is_empty()).collect();
                    let messages: Vec<Vec<u8>> = signed.iter().map(|i| event_signing_message(&hashes[*i])).collect();
                    let refs: Vec<&[u8]> = messages.iter().map(|m| m.as_slice()).collect();
                    let sigs: Vec<ed25519_dalek::Signature> =
                        signed.iter().map(|i| ed25519_dalek::Signature::from_slice(&part[*i].sig).unwrap()).collect();
                    let keys = vec![public; signed.len()];
                    ed25519_dalek::verify_batch(&refs, &sigs, &keys).expect("honest signatures");
                });
            }
        });
        cpu += started.elapsed();
    }
    total as f64 / cpu.as_secs_f64()
}

/// One backend's figures.
struct Line {
    backend: &'static str,
    size: u64,
    events: u64,
    raw: f64,
    rate: f64,
    seconds: f64,
    /// The verify's peak resident set above the process's as it started, and the process's
    /// resident set as it started, at its peak, and at its peak before (generating the log).
    rss_mib: [u64; 4],
    cores_used: f64,
}

async fn measure(store: Arc<dyn EventStore>, backend: &'static str, total: u64, threads: usize) -> Line {
    store.migrate().await.unwrap();
    let key = Arc::new(LogKey::generate());
    let tenant = TenantId::generate();
    let log = Log::open(store.clone(), Arc::new(Projections), key.clone(), Arc::new(bc_core::clock::SystemClock)).await.unwrap();
    eprintln!("audit benchmark: generating {total} signed events ({backend})…");
    generate(&log, tenant, total).await;
    // Seal one checkpoint at the end (one in the middle of a second, smaller run would add
    // nothing to the walk's cost).
    let trust = Trust::of(&[key.public()], audit::DEPLOYMENT_DEFAULT).unwrap();
    let sealed = audit::seal(&log, tenant, audit::DEPLOYMENT_DEFAULT, &trust).await.unwrap().expect("sealed");
    eprintln!("  measuring the raw rate…");
    let raw = raw_rate(&*store, tenant, &key, total, threads).await;
    eprintln!("  running audit verify…");
    let rss_before = rss_peak_kib();
    reset_rss_peak();
    // What the process holds as the verify starts (the generated log's caches included); the
    // verify's own cost is its peak above this.
    let rss_at_start = status_kib("VmRSS:");
    let (started, cpu_before) = (Instant::now(), cpu_seconds());
    let report = audit::verify(&store, &trust, None, &|_| {}).await.unwrap();
    let elapsed = started.elapsed();
    let cores_used = (cpu_seconds() - cpu_before) / elapsed.as_secs_f64();
    let peak = rss_peak_kib();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert_eq!(report.events, total + 1);
    Line {
        backend,
        size: sealed.size,
        events: report.events,
        raw,
        rate: report.events as f64 / elapsed.as_secs_f64(),
        seconds: elapsed.as_secs_f64(),
        rss_mib: [peak.saturating_sub(rss_at_start) / 1024, rss_at_start / 1024, peak / 1024, rss_before / 1024],
        cores_used,
    }
}

pub fn main() {
    let total: u64 = std::env::var("BENCH_AUDIT_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let dir = tempfile::tempdir().unwrap();
        let sqlite: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("audit.sqlite3")).await.unwrap());
        let mut lines = vec![measure(sqlite, "sqlite", total, threads).await];
        let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for make bench");
        let pg: Arc<dyn EventStore> = Arc::new(bc_core::store::postgres::PostgresStore::connect(&db.url).await.unwrap());
        lines.push(measure(pg, "postgresql", total, threads).await);
        println!();
        println!("| log ({threads} threads), 1 tenant, 1 checkpoint | events | raw SHA-256 + batch verify/s | audit verify/s | ratio | verify time | verify adds to RSS |");
        println!("|------------------------------------|----------:|-----------------------------:|---------------:|------:|------------:|-------------------:|");
        for l in &lines {
            println!(
                "| {:<10} (checkpoint of size {}) | {:>9} | {:>28.0} | {:>14.0} | {:>5.2} | {:>9.1} s | {:>12} MiB |",
                l.backend,
                l.size,
                l.events,
                l.raw,
                l.rate,
                l.rate / l.raw,
                l.seconds,
                l.rss_mib[0]
            );
        }
        for l in &lines {
            println!(
                "({}: the process {} MiB resident as the verify started, {} MiB at its peak; {} MiB at the peak before it, generating the log; \
                 the verify kept {:.2} of {threads} cores busy on average, its CPU time over its wall time{})",
                l.backend,
                l.rss_mib[1],
                l.rss_mib[2],
                l.rss_mib[3],
                l.cores_used,
                if l.backend == "postgresql" { ", the server's not counted" } else { "" }
            );
        }
        println!("goal 4: audit verify >= 0.80 of raw SHA-256 + batch verify");
        for l in &lines {
            let ratio = l.rate / l.raw;
            println!("  {:<10} {ratio:.2}  {}", l.backend, if ratio >= 0.8 { "met" } else { "MISSED" });
        }
    });
}
