//! `make bench`: signed, chained, projected appends per second against raw inserts of the same
//! bytes into the same database, measured in the same run, on SQLite and PostgreSQL, at batch
//! sizes 1 and 100. Ratios, not absolute rates, are the result: these machines are noisy.
//!
//! Batch 1 is one single-event append per transaction, one at a time. Batch 100 is 100
//! concurrent single-event appends (each creating its own pool, so 100 projection rows) that
//! the appender commits in one transaction; the raw baseline inserts 100 rows in one statement
//! per transaction. The "CPU only" line is canonical encoding + SHA-256 + Ed25519 signing of the
//! same events with no database: where the time goes that is not the database's.
//!
//! **What each side writes.** The raw baseline writes one row per event into `bench_raw`: five
//! columns (`tenant_id`, `seq`, `canonical`, `hash`, `sig`: the same bytes an event stores) and
//! one index, its primary key `(tenant_id, seq)`. A signed append writes, per event, an `events`
//! row of twelve columns (tenant, seq, id, stream, version, type, commit number and index,
//! canonical, hash, signature, key id) under its primary key and four more indexes (`events_by_id`,
//! `events_by_stream`, `events_by_position`, `events_by_tenant_position`); per transaction the
//! commit counter's row, the chain head of each tenant touched, and an idempotency record where a
//! key is given; and per event here one projection row (the pool's document, as JSON, under the
//! projections' primary key and `projections_by_id`). So the ratio is what the log's guarantees
//! (chaining, signing, the heads' check, projections in the same transaction) cost over storing
//! the same bytes, not over an equal amount of indexing.

use std::sync::Arc;
use std::time::Instant;

use bc_core::clock::SystemClock;
use bc_core::event::StoredEvent;
use bc_core::id::{PoolId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::postgres::PostgresStore;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::events as ev;
use bc_projections::{KIND_POOL, Projections, stream_of};

/// Events per measurement, per batch size.
const EVENTS_BATCH_1: usize = 1500;

const EVENTS_BATCH_100: usize = 20_000;

fn pool_request(tenant: TenantId) -> AppendRequest {
    let pool = PoolId::generate();
    let payload = ev::to_cbor(&ev::PoolCreated {
        name: format!("bench-{}", pool.ulid().to_string().to_ascii_lowercase()),
        description: "a pool created by the append benchmark, sized like a real one".into(),
        labels: [("site".to_owned(), "ams-1".to_owned()), ("class".to_owned(), "h100".to_owned())].into(),
        max_reservation_s: None,
        site_id: None,
    })
    .unwrap();
    AppendRequest {
        tenant,
        stream: stream_of(KIND_POOL, &pool),
        expected: ExpectedVersion::NoStream,
        idempotency_key: None,
        actor: "apikey:key_01jbenchbenchbenchbenchbench".into(),
        causation: None,
        correlation: Some("req_01jbenchbenchbenchbenchbench".into()),
        fingerprint: None,
        guards: vec![],
        events: vec![NewEvent::new(ev::POOL_CREATED, payload)],
    }
}

/// Appends `total` events in groups of `batch` concurrent requests; returns (events/s, events).
/// Each request is its own task, so all of a group are queued before the appender wakes.
async fn signed(log: &Arc<Log>, tenant: TenantId, total: usize, batch: usize) -> (f64, Vec<StoredEvent>) {
    let mut events = Vec::with_capacity(total);
    let started = Instant::now();
    for _ in 0..total / batch {
        let tasks: Vec<_> = (0..batch)
            .map(|_| {
                let log = log.clone();
                tokio::spawn(async move { log.append(pool_request(tenant)).await })
            })
            .collect();
        for task in tasks {
            events.extend(task.await.expect("task").expect("append").events);
        }
    }
    (events.len() as f64 / started.elapsed().as_secs_f64(), events)
}

trait Raw {
    async fn setup(&self);
    async fn insert(&self, rows: &[StoredEvent], offset: i64);
}

struct RawSqlite(sqlx::SqlitePool);

impl Raw for RawSqlite {
    async fn setup(&self) {
        sqlx::raw_sql(
            "CREATE TABLE bench_raw (tenant_id TEXT NOT NULL, seq INTEGER NOT NULL, canonical BLOB NOT NULL, hash BLOB NOT NULL, sig BLOB NOT NULL, PRIMARY KEY (tenant_id, seq))",
        )
        .execute(&self.0)
        .await
        .unwrap();
    }
    async fn insert(&self, rows: &[StoredEvent], offset: i64) {
        let mut tx = self.0.begin().await.unwrap();
        let mut q = sqlx::QueryBuilder::<sqlx::Sqlite>::new("INSERT INTO bench_raw (tenant_id, seq, canonical, hash, sig) ");
        q.push_values(rows, |mut b, e| {
            b.push_bind(e.envelope.tenant.to_string())
                .push_bind(e.envelope.seq as i64 + offset)
                .push_bind(e.canonical.clone())
                .push_bind(e.hash.to_vec())
                .push_bind(e.sig.clone());
        });
        q.build().execute(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
    }
}

struct RawPostgres(deadpool_postgres::Pool);

impl Raw for RawPostgres {
    async fn setup(&self) {
        let client = self.0.get().await.unwrap();
        client
            .batch_execute(
                "CREATE TABLE bench_raw (tenant_id TEXT NOT NULL, seq BIGINT NOT NULL, canonical BYTEA NOT NULL, hash BYTEA NOT NULL, sig BYTEA NOT NULL, PRIMARY KEY (tenant_id, seq))",
            )
            .await
            .unwrap();
    }
    async fn insert(&self, rows: &[StoredEvent], offset: i64) {
        let mut client = self.0.get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        let t: Vec<String> = rows.iter().map(|e| e.envelope.tenant.to_string()).collect();
        let s: Vec<i64> = rows.iter().map(|e| e.envelope.seq as i64 + offset).collect();
        let c: Vec<&[u8]> = rows.iter().map(|e| e.canonical.as_slice()).collect();
        let h: Vec<&[u8]> = rows.iter().map(|e| &e.hash[..]).collect();
        let g: Vec<&[u8]> = rows.iter().map(|e| e.sig.as_slice()).collect();
        tx.execute(
            "INSERT INTO bench_raw SELECT * FROM UNNEST($1::text[], $2::int8[], $3::bytea[], $4::bytea[], $5::bytea[])",
            &[&t, &s, &c, &h, &g],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
}

async fn raw_rate(raw: &impl Raw, events: &[StoredEvent], batch: usize, offset: i64) -> f64 {
    let started = Instant::now();
    for chunk in events.chunks(batch) {
        raw.insert(chunk, offset).await;
    }
    events.len() as f64 / started.elapsed().as_secs_f64()
}

struct Line {
    backend: &'static str,
    batch: usize,
    raw: f64,
    signed: f64,
    /// Mean µs per batch in pre-read, decide (hash + sign), commit; events per batch.
    phases: [f64; 4],
}

async fn measure(store: Arc<dyn EventStore>, raw: &impl Raw, backend: &'static str, lines: &mut Vec<Line>) {
    store.migrate().await.unwrap();
    raw.setup().await;
    let log =
        Arc::new(Log::open(store, Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap());
    for (batch, total) in [(1, EVENTS_BATCH_1), (100, EVENTS_BATCH_100)] {
        let tenant = TenantId::generate();
        // Warm up, then alternate raw and signed halves so drift hits both alike.
        let _ = signed(&log, tenant, batch.max(10), batch).await;
        let half = total / 2;
        let before = log.stats.snapshot();
        let (s1, events1) = signed(&log, tenant, half, batch).await;
        let r1 = raw_rate(raw, &events1, batch, 0).await;
        let (s2, events2) = signed(&log, tenant, half, batch).await;
        let r2 = raw_rate(raw, &events2, batch, 0).await;
        let after = log.stats.snapshot();
        let batches = (after[0] - before[0]).max(1) as f64;
        let phases = [
            (after[2] - before[2]) as f64 / batches,
            (after[3] - before[3]) as f64 / batches,
            (after[4] - before[4]) as f64 / batches,
            (after[1] - before[1]) as f64 / batches,
        ];
        lines.push(Line { backend, batch, raw: (r1 + r2) / 2.0, signed: (s1 + s2) / 2.0, phases });
        eprintln!("  {backend} batch {batch}: done");
    }
}

/// µs per event to encode, hash and sign the same events on one core, with no database.
fn cpu_only(n: usize) -> [f64; 3] {
    let key = LogKey::generate();
    let tenant = TenantId::generate();
    let envelopes: Vec<_> = (0..n)
        .map(|i| {
            let r = pool_request(tenant);
            bc_core::event::Envelope {
                tenant,
                seq: i as u64 + 1,
                id: bc_core::id::EventId::generate(),
                stream: r.stream,
                version: 1,
                event_type: r.events[0].event_type.clone(),
                at_ms: 1_790_000_000_000,
                actor: r.actor,
                idempotency_key: None,
                causation: None,
                correlation: r.correlation,
                payload: r.events[0].payload.clone(),
                prev: [0; 32],
            }
        })
        .collect();
    let started = Instant::now();
    let encoded: Vec<Vec<u8>> = envelopes.iter().map(|e| e.to_canonical().unwrap()).collect();
    let encode_us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    let started = Instant::now();
    let hashes: Vec<[u8; 32]> = encoded.iter().map(|b| bc_core::event::sha256(b)).collect();
    let hash_us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    let started = Instant::now();
    for h in &hashes {
        std::hint::black_box(key.sign_event_hash(h));
    }
    let sign_us = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    [encode_us, hash_us, sign_us]
}

pub fn main() {
    if std::env::var("BENCH_TRACE").is_ok() {
        tracing_subscriber::fmt().with_env_filter("bc_core=debug").with_writer(std::io::stderr).init();
    }
    // One thread: every request of a batch is queued before the appender wakes (group commit).
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let mut lines = Vec::new();
        eprintln!("append benchmark: {EVENTS_BATCH_1} events at batch 1, {EVENTS_BATCH_100} at batch 100, per backend");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bench.sqlite3");
        let sqlite = Arc::new(SqliteStore::open(&path).await.unwrap());
        let raw = RawSqlite(sqlite.pool().clone());
        measure(sqlite, &raw, "sqlite", &mut lines).await;

        let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL for the benchmark");
        let pg = Arc::new(PostgresStore::connect(&db.url).await.unwrap());
        let raw = RawPostgres(pg.pool().clone());
        measure(pg, &raw, "postgresql", &mut lines).await;

        let cpu = cpu_only(20_000);
        println!();
        println!("| backend    | batch | raw inserts/s | signed appends/s | ratio |");
        println!("|------------|------:|--------------:|-----------------:|------:|");
        for l in &lines {
            println!("| {:<10} | {:>5} | {:>13.0} | {:>16.0} | {:>5.2} |", l.backend, l.batch, l.raw, l.signed, l.signed / l.raw);
        }
        println!();
        println!("Where the time goes: mean per batch inside the appender (µs), the rest is the callers' side");
        println!("| backend    | batch | events/batch | pre-read | decide (hash+sign) | commit |");
        println!("|------------|------:|-------------:|---------:|-------------------:|-------:|");
        for l in &lines {
            println!(
                "| {:<10} | {:>5} | {:>12.1} | {:>8.0} | {:>18.0} | {:>6.0} |",
                l.backend, l.batch, l.phases[3], l.phases[0], l.phases[1], l.phases[2]
            );
        }
        println!();
        println!(
            "CPU per event, one core, no database: canonical CBOR {:.1} µs, SHA-256 {:.2} µs, Ed25519 sign {:.1} µs",
            cpu[0], cpu[1], cpu[2]
        );
        println!();
        println!("goal 3: signed appends >= 0.50 of raw inserts at batch 100, on both backends");
        for l in lines.iter().filter(|l| l.batch == 100) {
            let ratio = l.signed / l.raw;
            println!("  {:<10} batch 100: {ratio:.2}  {}", l.backend, if ratio >= 0.5 { "met" } else { "MISSED" });
        }
    });
}
