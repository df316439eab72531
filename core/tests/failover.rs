//! The appender on PostgreSQL when the database goes away under it (issue 60, item 1): a commit
//! whose answer is lost is reported indeterminate (UNAVAILABLE with the hint to retry with the
//! same idempotency key), never as a plain failure, and its retry lands exactly once whether it
//! had committed or not; connections terminated mid-batch (`pg_terminate_backend`, what a
//! primary's death or demotion does to them) are replaced by the pool, and every keyed append
//! retried until it is answered is in the log once, on a chain that verifies.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};

use bc_core::chain::verify_chain;
use bc_core::clock::SystemClock;
use bc_core::error::INDETERMINATE_HINT;
use bc_core::event::StoredEvent;
use bc_core::id::TenantId;
use bc_core::keys::{KeyRing, LogKey};
use bc_core::store::postgres::PostgresStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent, Projector, RowKey, decode_rows};
use bc_core::testing::ScratchDatabase;
use bc_core::{Error, ErrorCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Projects nothing: the log is what is under test.
struct NoRows;

impl Projector for NoRows {
    fn touches(&self, _: &StoredEvent, _: &mut Vec<RowKey>) {}

    fn apply(&self, _: &RowKey, doc: Option<serde_json::Value>, _: &StoredEvent) -> bc_core::Result<Option<serde_json::Value>> {
        Ok(doc)
    }
}

/// The simple-query message tokio-postgres sends to commit (`batch_execute("COMMIT")`).
const COMMIT_MESSAGE: &[u8] = b"Q\x00\x00\x00\x0bCOMMIT\x00";

/// What the proxy does to the next `COMMIT` it sees.
const PASS: u8 = 0;
/// The `COMMIT` reaches the server, which commits; its answer never comes back.
const CUT_AFTER: u8 = 1;
/// The connection is cut before the `COMMIT` reaches the server, which rolls back.
const CUT_BEFORE: u8 = 2;

/// A TCP proxy in front of PostgreSQL that can lose one `COMMIT`'s connection, on either side of
/// the server's commit: the two cases a client cannot tell apart.
struct Proxy {
    port: u16,
    next_commit: Arc<AtomicU8>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let next_commit = Arc::new(AtomicU8::new(PASS));
        let mode = next_commit.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let cut = Arc::new(AtomicBool::new(false));
                let (cut_up, mode) = (cut.clone(), mode.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match client_read.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let chunk = &buf[..n];
                        if chunk.windows(COMMIT_MESSAGE.len()).any(|w| w == COMMIT_MESSAGE) {
                            match mode.swap(PASS, Ordering::SeqCst) {
                                CUT_AFTER => {
                                    cut_up.store(true, Ordering::SeqCst);
                                    let _ = server_write.write_all(chunk).await;
                                    // Time for the server to commit; then both sides close.
                                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                                    return;
                                }
                                CUT_BEFORE => {
                                    cut_up.store(true, Ordering::SeqCst);
                                    return;
                                }
                                _ => {}
                            }
                        }
                        if server_write.write_all(chunk).await.is_err() {
                            return;
                        }
                    }
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match server_read.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if cut.load(Ordering::SeqCst) || client_write.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Self { port, next_commit }
    }
}

/// `host:port` of a `postgres://user@host:port/db` URL.
fn host_port(url: &str) -> String {
    let rest = url.split_once("://").unwrap().1;
    let authority = rest.split('/').next().unwrap();
    authority.rsplit_once('@').map(|(_, hp)| hp).unwrap_or(authority).to_owned()
}

fn keyed(tenant: TenantId, stream: &str, key: &str) -> AppendRequest {
    let mut request = AppendRequest::new(
        tenant,
        stream,
        ExpectedVersion::Any,
        "test",
        vec![NewEvent::new("test.made", ciborium::Value::Text(key.to_owned()))],
    );
    request.idempotency_key = Some(key.to_owned());
    request
}

async fn chain(store: &dyn EventStore, tenant: TenantId) -> Vec<bc_core::event::EventRow> {
    let mut rows = Vec::new();
    loop {
        let page = store.read_chain_rows(tenant, rows.len() as u64 + 1, 1000).await.unwrap();
        let last = page.len() < 1000;
        rows.extend(page);
        if last {
            return rows;
        }
    }
}

/// Every chain verified whole against `key`; the events by idempotency key, each key's count.
async fn verified_events(store: &dyn EventStore, key: &LogKey) -> HashMap<String, Vec<StoredEvent>> {
    let mut keys = KeyRing::default();
    keys.insert(key.public());
    let mut by_key: HashMap<String, Vec<StoredEvent>> = HashMap::new();
    for (tenant, head) in store.heads().await.unwrap() {
        let rows = chain(store, tenant).await;
        verify_chain(tenant, rows.clone(), Some((head.seq, head.hash)), &keys).unwrap_or_else(|p| panic!("{p}"));
        for event in decode_rows(rows).unwrap() {
            by_key.entry(event.envelope.idempotency_key.clone().unwrap_or_default()).or_default().push(event);
        }
    }
    by_key
}

fn assert_indeterminate(outcome: bc_core::Result<bc_core::store::AppendResult>) {
    let error = outcome.expect_err("the commit's answer was lost");
    assert!(matches!(error, Error::Indeterminate(_)), "{error:?}");
    assert_eq!(error.code(), ErrorCode::Unavailable);
    assert_eq!(error.hint(), Some(INDETERMINATE_HINT));
    assert!(INDETERMINATE_HINT.contains("same") && INDETERMINATE_HINT.contains("Idempotency-Key"));
}

#[tokio::test]
async fn a_commit_whose_answer_is_lost_is_indeterminate_and_its_retry_lands_once() {
    let db = ScratchDatabase::create().await.expect("PostgreSQL for the failover tests");
    let direct: Arc<dyn EventStore> = Arc::new(PostgresStore::connect(&db.url).await.unwrap());
    direct.migrate().await.unwrap();
    let proxy = Proxy::start(host_port(&db.url)).await;
    // Plain TCP, so the proxy can see the COMMIT (the server may offer TLS, which `prefer` takes).
    let through = format!("{}?sslmode=disable", db.url.replacen(&host_port(&db.url), &format!("127.0.0.1:{}", proxy.port), 1));
    let store: Arc<dyn EventStore> = Arc::new(PostgresStore::connect(&through).await.unwrap());
    let key = Arc::new(LogKey::generate());
    let log = Log::open(store, Arc::new(NoRows), key.clone(), Arc::new(SystemClock)).await.unwrap();
    let tenant = TenantId::generate();

    let first = log.append(keyed(tenant, "s/a", "k-1")).await.unwrap();
    assert_eq!(first.events[0].envelope.seq, 1);

    // Committed, the answer lost: indeterminate; the retry returns the first result, and the
    // log holds the event once.
    proxy.next_commit.store(CUT_AFTER, Ordering::SeqCst);
    assert_indeterminate(log.append(keyed(tenant, "s/a", "k-2")).await);
    assert_eq!(proxy.next_commit.load(Ordering::SeqCst), PASS, "the proxy cut a COMMIT");
    let stored = verified_events(&*direct, &key).await;
    assert_eq!(stored["k-2"].len(), 1, "the server committed before the answer was lost");
    let retried = log.append(keyed(tenant, "s/a", "k-2")).await.unwrap();
    assert!(retried.replayed, "the retry is answered with the first result");
    assert_eq!(retried.events[0].envelope.id, stored["k-2"][0].envelope.id);

    // Cut before the server saw the COMMIT: the same answer (the client cannot tell), and the
    // retry appends it, once.
    proxy.next_commit.store(CUT_BEFORE, Ordering::SeqCst);
    assert_indeterminate(log.append(keyed(tenant, "s/a", "k-3")).await);
    assert!(!verified_events(&*direct, &key).await.contains_key("k-3"), "rolled back with the connection");
    let retried = log.append(keyed(tenant, "s/a", "k-3")).await.unwrap();
    assert!(!retried.replayed);
    assert_eq!(retried.events[0].envelope.seq, 3, "decided on the chain head re-read from the database");

    // The pool replaced the connections it lost; everything is in the log once.
    log.append(keyed(tenant, "s/b", "k-4")).await.unwrap();
    let stored = verified_events(&*direct, &key).await;
    assert_eq!(stored.values().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_appends_retried_through_terminated_connections_land_once_on_a_chain_that_verifies() {
    const WRITERS: usize = 16;
    const APPENDS: usize = 40;
    const KILLS: usize = 6;
    let db = ScratchDatabase::create().await.expect("PostgreSQL for the failover tests");
    let store: Arc<dyn EventStore> = Arc::new(PostgresStore::connect(&db.url).await.unwrap());
    store.migrate().await.unwrap();
    let key = Arc::new(LogKey::generate());
    let log = Arc::new(Log::open(store.clone(), Arc::new(NoRows), key.clone(), Arc::new(SystemClock)).await.unwrap());
    let tenants: Vec<TenantId> = (0..4).map(|_| TenantId::generate()).collect();
    let unavailable = Arc::new(AtomicU64::new(0));
    let indeterminate = Arc::new(AtomicU64::new(0));

    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (log, tenant) = (log.clone(), tenants[w % tenants.len()]);
        let (unavailable, indeterminate) = (unavailable.clone(), indeterminate.clone());
        writers.push(tokio::spawn(async move {
            let mut answered = Vec::new();
            for i in 0..APPENDS {
                let request_key = format!("w{w}-{i}");
                let request = keyed(tenant, &format!("s/{w}"), &request_key);
                let result = loop {
                    match log.append(request.clone()).await {
                        Ok(result) => break result,
                        Err(Error::Indeterminate(_)) => indeterminate.fetch_add(1, Ordering::Relaxed),
                        Err(e) if e.code() == ErrorCode::Unavailable => unavailable.fetch_add(1, Ordering::Relaxed),
                        Err(e) => panic!("{request_key}: not a failure of the database's availability: {e:?}"),
                    };
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                };
                answered.push((request_key, result.events[0].envelope.id));
            }
            answered
        }));
    }
    // Terminates every connection of the scratch database but its own, a few times mid-load.
    let (admin, connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let mut terminated = 0;
    for _ in 0..KILLS {
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
        let rows = admin
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        terminated += rows.iter().filter(|r| r.get::<_, bool>(0)).count();
    }
    let mut answered = Vec::new();
    for writer in writers {
        answered.extend(writer.await.unwrap());
    }
    eprintln!(
        "terminated {terminated} connections; {} answers UNAVAILABLE, {} of them indeterminate",
        unavailable.load(Ordering::Relaxed) + indeterminate.load(Ordering::Relaxed),
        indeterminate.load(Ordering::Relaxed)
    );
    assert!(terminated > 0, "the pool's connections were there to terminate");

    let stored = verified_events(&*store, &key).await;
    assert_eq!(stored.len(), WRITERS * APPENDS, "every key is in the log");
    for (request_key, id) in answered {
        let events = &stored[&request_key];
        assert_eq!(events.len(), 1, "{request_key} is in the log once");
        assert_eq!(events[0].envelope.id, id, "{request_key}'s answer is the event in the log");
    }
}
