//! `make bench` (usage): what closing usage windows and exporting them cost, as ratios against
//! baselines measured in the same run.
//!
//! 1. **Windows closed per second on a log of 1,000,000 reservation events**, in memory: the
//!    events (activations, extensions, releases, expiries of one tenant, ~240 reservations active
//!    at a time, over ~4 months) are generated first, then folded one by one with the ledger's
//!    own fold (`bc_projections::usage::fold_reservation_event`, what the `usage_open` rows fold)
//!    while the pure decision (`decide::usage::usage_close`) closes each hourly window as the
//!    event time passes its end, and its events are folded back, as the reconciler does. The
//!    store is left out: a million real appends through the `Log` take longer than the bench
//!    budget, and the reconciler's reads are one row per open reservation.
//!    Against it: **the raw append rate of the same run**: the same million events' canonical
//!    bytes, hash and a signature's 64 bytes inserted into a bare SQLite table, 100 rows a
//!    transaction, as `benches/append.rs` measures its raw baseline.
//! 2. **The export's rows per second** and its **peak memory**, through the real binary: a
//!    release `better-compute dev --usage-window 1s` with 1,000 one-GPU reservations active on
//!    250 nodes, closing 1,000 rows a second, then `usage export` (csv, jsonl, csv
//!    `--with-proofs`) of a quarter, half and all of the windows, each under `/usr/bin/time -v`
//!    for its peak RSS; the slope of peak RSS against rows says whether memory is bounded. The
//!    baseline is `usage.list` paged over HTTP by this process (what the export reads, without
//!    formatting or writing). `usage verify` of the proved export is timed too. A million rows
//!    through the server would take 17 minutes of closing at this rate: the slope stands in for
//!    it. `BC_BENCH_USAGE_RESERVATIONS` (default 1,000; a node per 4) and
//!    `BC_BENCH_USAGE_SECONDS` (default 60) make more rows: 2,000 for 200 s give ~400,000.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use bc_core::event::Envelope;
use bc_core::id::{EventId, TenantId};
use bc_projections::decide::usage::{UsageCloseInput, usage_close};
use bc_projections::events as ev;
use bc_projections::usage::{UsageLedger, fold_reservation_event};
use serde_json::{Value, json};

use crate::support::dev;

/// Reservation events in the in-memory log.
const EVENTS: usize = 1_000_000;
const HOUR_MS: u64 = 3_600_000;
/// Mean time between two activations: with a mean hold of ~1.5 h, ~240 are active at once.
const ARRIVAL_MS_MEAN: u64 = 22_000;
/// Rows a raw insert transaction carries (append.rs's batch 100).
const RAW_BATCH: usize = 100;
/// Events encoded at a time for the raw baseline (the encoding is not timed).
const RAW_CHUNK: usize = 10_000;
/// One-GPU reservations active while windows close (`BC_BENCH_USAGE_RESERVATIONS`), on a
/// four-GPU node per four.
const EXPORT_RESERVATIONS: usize = 1000;
/// How long the reservations run, closing 1 s windows: rows ≈ reservations × seconds
/// (`BC_BENCH_USAGE_SECONDS`).
const EXPORT_RUN_S: u64 = 60;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A seeded source of draws below `n`.
fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = seed;
    move |n| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % n.max(1)
    }
}

/// One tenant's reservation events, in time order: activations, some extensions, releases
/// before the end or expiries at it (some appended minutes late).
fn reservation_events(count: usize) -> Vec<Envelope> {
    let tenant = TenantId::generate();
    let mut next = draws(58);
    let mut timed: Vec<(u64, String, &'static str, ciborium::Value)> = Vec::with_capacity(count + 4);
    let mut at = 1_700_000_000_000u64;
    let mut n = 0u64;
    while timed.len() < count {
        n += 1;
        at += 1 + next(2 * ARRIVAL_MS_MEAN);
        let id = format!("rsv_{n:026}");
        let gpus = 1 + next(8) as u32;
        let mut ends_at = at + 10 * 60_000 + next(3 * HOUR_MS);
        let activated =
            ev::ReservationActivated { node_id: "node_1".into(), gpus: (0..gpus).collect(), ends_at_ms: ends_at, hold: None };
        timed.push((at, id.clone(), ev::RESERVATION_ACTIVATED, ev::to_cbor(&activated).unwrap()));
        if next(4) == 0 {
            let when = at + next(ends_at - at);
            ends_at += HOUR_MS;
            timed.push((
                when,
                id.clone(),
                ev::RESERVATION_EXTENDED,
                ev::to_cbor(&ev::ReservationExtended { ends_at_ms: ends_at }).unwrap(),
            ));
        }
        let ended = ev::to_cbor(&ev::ReservationEnded::default()).unwrap();
        if next(10) < 7 {
            timed.push((at + 1 + next(ends_at - at), id, ev::RESERVATION_RELEASED, ended));
        } else {
            timed.push((ends_at + next(10 * 60_000), id, ev::RESERVATION_EXPIRED, ended));
        }
    }
    timed.truncate(count);
    timed.sort_by_key(|(at, ..)| *at);
    let mut versions: BTreeMap<String, u64> = BTreeMap::new();
    timed
        .into_iter()
        .enumerate()
        .map(|(i, (at_ms, id, event_type, payload))| {
            let version = versions.entry(id.clone()).or_default();
            *version += 1;
            Envelope {
                tenant,
                seq: i as u64 + 1,
                id: EventId::generate(),
                stream: format!("reservation/{id}"),
                version: *version,
                event_type: event_type.into(),
                at_ms,
                actor: "system:reconciler".into(),
                idempotency_key: None,
                causation: None,
                correlation: None,
                payload,
                prev: [0; 32],
            }
        })
        .collect()
}

/// Folds the events and closes every window as the log's time passes it; returns (windows,
/// lines, seconds).
fn fold_and_close(events: &[Envelope]) -> (usize, usize, f64) {
    let (details, prices) = (BTreeMap::new(), BTreeMap::new());
    let mut ledger = UsageLedger::default();
    let (mut windows, mut lines) = (0, 0);
    let mut next_close = events[0].at_ms / HOUR_MS * HOUR_MS + HOUR_MS;
    let started = Instant::now();
    let mut close = |ledger: &mut UsageLedger, now_ms: u64| loop {
        let input = UsageCloseInput { ledger, now_ms, window_ms: HOUR_MS, grace_ms: 60_000, details: &details, prices: &prices };
        let closed = usage_close(&input);
        windows += closed.windows;
        for event in &closed.events {
            lines += event.lines().len();
            event.fold(ledger);
        }
        if !closed.more {
            break;
        }
    };
    for env in events {
        if env.at_ms >= next_close + 60_000 {
            close(&mut ledger, env.at_ms);
            next_close = env.at_ms / HOUR_MS * HOUR_MS + HOUR_MS;
        }
        let id = env.stream.strip_prefix("reservation/").unwrap();
        fold_reservation_event(&mut ledger, id, env).unwrap();
    }
    close(&mut ledger, events.last().unwrap().at_ms + 48 * HOUR_MS);
    (windows, lines, started.elapsed().as_secs_f64())
}

/// The same events' bytes into a bare SQLite table, `RAW_BATCH` a transaction: rows per second.
async fn raw_appends(events: &[Envelope], dir: &std::path::Path) -> f64 {
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.join("raw.sqlite3"))
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Normal);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    sqlx::raw_sql(
        "CREATE TABLE bench_raw (tenant_id TEXT NOT NULL, seq INTEGER NOT NULL, canonical BLOB NOT NULL, hash BLOB NOT NULL, sig BLOB NOT NULL, PRIMARY KEY (tenant_id, seq))",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut timed = Duration::ZERO;
    for chunk in events.chunks(RAW_CHUNK) {
        let rows: Vec<(String, i64, Vec<u8>, Vec<u8>)> = chunk
            .iter()
            .map(|e| {
                let canonical = e.to_canonical().unwrap();
                let hash = bc_core::event::sha256(&canonical).to_vec();
                (e.tenant.to_string(), e.seq as i64, canonical, hash)
            })
            .collect();
        let started = Instant::now();
        for batch in rows.chunks(RAW_BATCH) {
            let mut tx = pool.begin().await.unwrap();
            let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new("INSERT INTO bench_raw (tenant_id, seq, canonical, hash, sig) ");
            q.push_values(batch, |mut b, (tenant, seq, canonical, hash)| {
                b.push_bind(tenant).push_bind(seq).push_bind(canonical).push_bind(hash).push_bind(vec![0u8; 64]);
            });
            q.build().execute(&mut *tx).await.unwrap();
            tx.commit().await.unwrap();
        }
        timed += started.elapsed();
    }
    events.len() as f64 / timed.as_secs_f64()
}

/// `better-compute dev` (release) closing 1 s windows.
struct Server {
    dev: dev::Dev,
}

impl Server {
    fn start() -> Self {
        Self { dev: dev::Dev::start(&["--usage-window", "1s"]) }
    }

    async fn call(&self, http: &reqwest::Client, method: &str, body: Value) -> Value {
        let r = http
            .post(format!("{}/api/compute/{method}", self.dev.url))
            .bearer_auth(&self.dev.token)
            .header("Idempotency-Key", EventId::generate().to_string())
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert!(status.is_success(), "{method}: {v}");
        v
    }

    /// Runs the CLI under `/usr/bin/time -v`: its JSON output and its peak RSS in KiB.
    fn cli_measured(&self, args: &[&str]) -> (Value, u64) {
        let out = Command::new("/usr/bin/time")
            .arg("-v")
            .arg(env!("CARGO_BIN_EXE_better-compute"))
            .args(args)
            .env("BETTER_COMPUTE_URL", &self.dev.url)
            .env("BETTER_COMPUTE_TOKEN", &self.dev.token)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        let rss = stderr
            .lines()
            .find_map(|l| l.trim().strip_prefix("Maximum resident set size (kbytes): "))
            .and_then(|v| v.trim().parse().ok())
            .expect("time -v's peak RSS");
        (serde_json::from_slice(&out.stdout).unwrap(), rss)
    }
}

/// The least-squares slope of `y` against `x`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let num: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let den: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    num / den
}

async fn export_part() {
    let server = Server::start();
    let http = reqwest::Client::new();
    let pool = server.call(&http, "pools.create", json!({ "name": "usage-bench" })).await["poolId"].as_str().unwrap().to_owned();
    let gpus = vec![json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }); 4];
    let reservations: usize = env_or("BC_BENCH_USAGE_RESERVATIONS", EXPORT_RESERVATIONS);
    let run_s: u64 = env_or("BC_BENCH_USAGE_SECONDS", EXPORT_RUN_S);
    for n in 0..reservations.div_ceil(4) {
        server.call(&http, "nodes.register", json!({ "poolId": pool, "name": format!("n{n}"), "gpus": gpus })).await;
    }
    for _ in 0..reservations {
        let r = server.call(&http, "reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 3600 })).await;
        assert_eq!(r["state"], "active", "{r}");
    }
    eprintln!("usage: {reservations} reservations active; closing 1 s windows for {run_s} s…");
    tokio::time::sleep(Duration::from_secs(run_s)).await;

    // The baseline: usage.list paged by this process.
    let (mut listed, mut cursor, mut windows) = (0u64, None::<String>, Vec::new());
    let started = Instant::now();
    loop {
        let mut body = json!({ "fromMs": 0, "toMs": 9_007_199_254_740_991u64, "limit": 500 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let page = server.call(&http, "usage.list", body).await;
        for row in page["items"].as_array().unwrap() {
            windows.push(row["windowStartMs"].as_u64().unwrap());
        }
        listed += page["items"].as_array().unwrap().len() as u64;
        match page["nextCursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let list_rate = listed as f64 / started.elapsed().as_secs_f64();
    windows.sort_unstable();
    windows.dedup();
    let (first, last) = (windows[0], *windows.last().unwrap() + 1);

    let data = server.dev.data_dir();
    let out = |name: &str| data.join(name).to_str().unwrap().to_owned();
    let mut points = Vec::new();
    let mut csv_rate = 0.0;
    for quarters in [1u64, 2, 4] {
        let to = (first + (last - first) * quarters / 4).to_string();
        let name = format!("q{quarters}.csv");
        let (summary, rss) = server.cli_measured(&[
            "usage",
            "export",
            "--from",
            &first.to_string(),
            "--to",
            &to,
            "--export-format",
            "csv",
            "--out",
            &out(&name),
        ]);
        let rows = summary["rows"].as_u64().unwrap();
        csv_rate = rows as f64 / (summary["elapsedMs"].as_u64().unwrap().max(1) as f64 / 1000.0);
        eprintln!("usage: export csv of {rows} rows: {csv_rate:.0} rows/s, peak RSS {rss} KiB");
        points.push((rows as f64, rss as f64));
    }
    let (summary, jsonl_rss) =
        server.cli_measured(&["usage", "export", "--from", "0", "--export-format", "jsonl", "--out", &out("all.jsonl")]);
    let jsonl_rate = summary["rows"].as_u64().unwrap() as f64 / (summary["elapsedMs"].as_u64().unwrap().max(1) as f64 / 1000.0);

    let sealed = Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["audit", "checkpoint", "--data-dir", data.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(sealed.status.success(), "{}", String::from_utf8_lossy(&sealed.stderr));
    let (proved, proved_rss) = server.cli_measured(&[
        "usage",
        "export",
        "--from",
        "0",
        "--to",
        &last.to_string(),
        "--export-format",
        "csv",
        "--out",
        &out("proved.csv"),
        "--with-proofs",
    ]);
    let proved_rows = proved["rows"].as_u64().unwrap();
    let proved_rate = proved_rows as f64 / (proved["elapsedMs"].as_u64().unwrap().max(1) as f64 / 1000.0);
    let pin = {
        let o = Command::new(env!("CARGO_BIN_EXE_better-compute"))
            .args(["pki", "show", "--data-dir", data.to_str().unwrap()])
            .output()
            .unwrap();
        serde_json::from_slice::<Value>(&o.stdout).unwrap()["pin"].as_str().unwrap().to_owned()
    };
    let started = Instant::now();
    let (verdict, verify_rss) = server.cli_measured(&[
        "usage",
        "verify",
        "--export",
        &out("proved.csv"),
        "--proofs",
        &out("proved.csv.proofs"),
        "--pin",
        &pin,
    ]);
    let verify_rate = verdict["proved"].as_u64().unwrap() as f64 / started.elapsed().as_secs_f64();

    let per_1000 = slope(&points) * 1000.0;
    println!("usage export, real binary, {listed} rows ({} windows of 1 s, {reservations} reservations):", windows.len());
    println!("  usage.list paged over HTTP (baseline): {list_rate:.0} rows/s");
    println!("  export csv:   {csv_rate:.0} rows/s = {:.2}x the listing", csv_rate / list_rate);
    println!("  export jsonl: {jsonl_rate:.0} rows/s = {:.2}x the listing, peak RSS {jsonl_rss} KiB", jsonl_rate / list_rate);
    println!(
        "  peak RSS against rows (csv): {} -> slope {per_1000:.1} KiB per 1,000 rows",
        points.iter().map(|(r, k)| format!("{r:.0} rows {k:.0} KiB")).collect::<Vec<_>>().join(", ")
    );
    println!(
        "  export csv --with-proofs: {proved_rate:.0} rows/s = {:.2}x the plain export ({} events proved, peak RSS {proved_rss} KiB)",
        proved_rate / csv_rate,
        proved["proofs"]["eventsProved"]
    );
    println!("  usage verify (offline): {verify_rate:.0} rows/s, peak RSS {verify_rss} KiB");
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    eprintln!("usage: generating {EVENTS} reservation events…");
    let events = reservation_events(EVENTS);
    let span_h = (events.last().unwrap().at_ms - events[0].at_ms) / HOUR_MS;
    let (windows, lines, seconds) = fold_and_close(&events);
    let fold_rate = EVENTS as f64 / seconds;
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let raw_rate = runtime.block_on(raw_appends(&events, dir.path()));
    drop(events);
    println!("usage windows, pure fold and close over {EVENTS} reservation events ({span_h} h of one tenant):");
    println!(
        "  {windows} windows closed, {lines} lines, in {seconds:.2} s: {:.0} windows/s, {:.0} lines/s",
        windows as f64 / seconds,
        lines as f64 / seconds
    );
    println!("  events folded and closed: {fold_rate:.0}/s");
    println!("  raw append (SQLite, {RAW_BATCH} a transaction, same events' bytes, baseline): {raw_rate:.0}/s");
    println!("  ratio: the windows keep up with {:.1}x the raw append rate", fold_rate / raw_rate);
    runtime.block_on(export_part());
}
