//! Webhooks end to end: the real `better-compute` (dev, serve, reconcile) delivering to a
//! receiver on loopback. Signatures are checked as a receiver would, with the secret the CLI
//! wrote to a 0600 file.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use bc_core::webhook::{Secret, verify};
use bc_tests::receiver::{Received, Receiver};
use bc_tests::{Reconciler, Server};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// `webhooks create` with `--secret-out`; returns the webhook id and the secret from the file.
fn create_webhook(server: &Server, url: &str, types: &str, secret_file: &Path) -> (String, Secret) {
    let (code, out, err) =
        server.cli(&["webhooks", "create", "--endpoint", url, "--types", types, "--secret-out", secret_file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let created = bc_tests::json(&out);
    assert!(!out.contains("whsec_"), "the secret went to the file, not the output: {out}");
    let mode = std::fs::metadata(secret_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the secret file is private");
    let secret = Secret::parse(&std::fs::read_to_string(secret_file).unwrap()).unwrap();
    (created["webhookId"].as_str().unwrap().to_owned(), secret)
}

fn verifies(secret: &Secret, r: &Received) -> bool {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    verify(secret, &r.id, r.timestamp, &r.body, &r.signature, now)
}

/// Event ids of the tenant's events of `types`, in log order.
async fn event_ids(server: &Server, types: &str) -> Vec<String> {
    let (status, page) = server.call("events.list", json!({ "types": [types], "limit": 500 })).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect()
}

/// How many work items with this id the dev's SQLite database holds (0 or 1).
async fn work_items(server: &Server, id: &str) -> i64 {
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(server.sqlite_path()).read_only(true);
    let pool = sqlx::SqlitePool::connect_with(options).await.expect("open the dev's database");
    let n = sqlx::query_scalar("SELECT COUNT(*) FROM work_items WHERE id = ?1").bind(id).fetch_one(&pool).await.expect("count");
    pool.close().await;
    n
}

fn deliveries(server: &Server, webhook: &str) -> Vec<Value> {
    let (code, out, err) = server.cli(&["webhooks", "deliveries", webhook, "--format", "json", "--limit", "100"]);
    assert_eq!(code, 0, "{err}");
    bc_tests::json(&out)["items"].as_array().unwrap().clone()
}

fn wait_deliveries(server: &Server, webhook: &str, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let list = deliveries(server, webhook);
        if done(&list) {
            return list;
        }
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}: {list:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_are_signed_pinged_rotated_and_stop_on_delete() {
    let server = Server::dev();
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let (webhook, secret) = create_webhook(&server, &receiver.url, "pool.*,webhook.pinged", &dir.path().join("s1"));

    for i in 0..5 {
        server.pool(&format!("p{i}")).await;
    }
    let pools = event_ids(&server, "pool.created").await;
    assert_eq!(pools.len(), 5);
    let got = receiver.wait_for(WAIT, "5 pool deliveries", |r| r.len() >= 5);
    let ids: BTreeSet<&str> = got.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, pools.iter().map(String::as_str).collect(), "exactly the pool events, once each");
    for r in &got {
        assert!(verifies(&secret, r), "signature of {} verifies", r.id);
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["type"], "pool.created");
        assert_eq!(body["data"]["id"].as_str(), Some(r.id.as_str()), "webhook-id is the event id");
        assert!(body["timestamp"].as_str().unwrap().ends_with('Z'));
    }
    // A tampered body does not verify.
    let mut forged = got[0].clone();
    forged.body = br#"{"type":"pool.created"}"#.to_vec();
    assert!(!verifies(&secret, &forged));

    // Ping: a webhook.pinged delivery to this webhook.
    let (code, out, err) = server.cli(&["webhooks", "ping", &webhook]);
    assert_eq!(code, 0, "{err}");
    let ping = bc_tests::json(&out);
    let got = receiver.wait_for(WAIT, "the ping", |r| r.iter().any(|r| r.id == ping["messageId"].as_str().unwrap()));
    assert!(got.iter().all(|r| verifies(&secret, r)));

    // Rotate: new deliveries carry the new and, for now, the old signature.
    let (code, _, err) =
        server.cli(&["webhooks", "rotate-secret", &webhook, "--secret-out", dir.path().join("s1").to_str().unwrap()]);
    assert_ne!(code, 0, "--secret-out never overwrites");
    assert!(err.contains("ALREADY_EXISTS"), "{err}");
    let (code, out, err) =
        server.cli(&["webhooks", "rotate-secret", &webhook, "--secret-out", dir.path().join("s2").to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(bc_tests::json(&out)["secretVersion"], 2);
    let new_secret = Secret::parse(&std::fs::read_to_string(dir.path().join("s2")).unwrap()).unwrap();
    server.pool("after-rotation").await;
    let after = event_ids(&server, "pool.created").await.pop().unwrap();
    let got = receiver.wait_for(WAIT, "the delivery after rotation", |r| r.iter().any(|r| r.id == after));
    let r = got.iter().find(|r| r.id == after).unwrap();
    assert!(verifies(&new_secret, r) && verifies(&secret, r), "both secrets sign during the overlap: {}", r.signature);
    // A second rotation inside the overlap keeps both older secrets signing.
    let (code, _, err) =
        server.cli(&["webhooks", "rotate-secret", &webhook, "--secret-out", dir.path().join("s3").to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let third = Secret::parse(&std::fs::read_to_string(dir.path().join("s3")).unwrap()).unwrap();
    server.pool("after-second-rotation").await;
    let after = event_ids(&server, "pool.created").await.pop().unwrap();
    let got = receiver.wait_for(WAIT, "the delivery after two rotations", |r| r.iter().any(|r| r.id == after));
    let r = got.iter().find(|r| r.id == after).unwrap();
    assert!([&secret, &new_secret, &third].iter().all(|s| verifies(s, r)), "three signatures: {}", r.signature);

    // Every delivery is recorded with its status and latency.
    let list = wait_deliveries(&server, &webhook, "all done", |l| l.len() == 8 && l.iter().all(|d| d["state"] == "done"));
    for d in &list {
        let log = d["attemptLog"].as_array().unwrap();
        assert_eq!(log.len(), 1);
        assert_eq!(log[0]["status"], 204);
        assert!(log[0]["latencyMs"].is_u64());
    }

    // Deleted: nothing more is delivered. A second webhook, still subscribed, proves the
    // consumer went past the event: its delivery is fanned out in the same step that would have
    // made the deleted one's, so once it arrived the deleted one has no work item for the event.
    let other = Receiver::start();
    create_webhook(&server, &other.url, "pool.created", &dir.path().join("other"));
    let (code, _, err) = server.cli(&["webhooks", "delete", &webhook]);
    assert_eq!(code, 0, "{err}");
    let before = receiver.received().len();
    server.pool("after-delete").await;
    let after = event_ids(&server, "pool.created").await.pop().unwrap();
    other.wait_for(WAIT, "the live webhook's delivery after the delete", |r| r.iter().any(|r| r.id == after));
    let items = work_items(&server, &bc_projections::webhook_delivery_id(&after, &webhook)).await;
    assert_eq!(items, 0, "no delivery of {after} was made for the deleted webhook");
    assert_eq!(receiver.received().len(), before, "a deleted webhook receives nothing");
}

/// A `reconcile --only webhooks` process killed with SIGKILL while deliveries are in flight,
/// then started again: every event arrives at least once, every signature verifies, and a
/// duplicate is the same message (same webhook-id, same body). The kill is placed by what the
/// test sees, not by timing: the first deliveries are let through and recorded done, then the
/// receiver holds the next requests unanswered, and the kill comes once some are held; the
/// work table then shows it landed mid-way (some done, some not, and deliveries the receiver
/// got with no attempt recorded, leased by the dead process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciler_killed_mid_delivery_loses_nothing() {
    let server = Server::dev_with(&["--no-reconcilers"]);
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let (webhook, secret) = create_webhook(&server, &receiver.url, "pool.created", &dir.path().join("secret"));
    let data_dir = server.data_dir.display().to_string();
    // The held requests outlive no delivery timeout before the kill: the kill follows the
    // sight of them within far less than 1 s.
    let args = [
        "--only",
        "webhooks",
        "--data-dir",
        &data_dir,
        "--webhook-allow-loopback",
        "--lease",
        "2s",
        "--delivery-timeout",
        "1s",
        "--retry-base",
        "200ms",
        "--concurrency",
        "4",
    ];
    let mut reconciler = Reconciler::start(&args, dir.path());
    for i in 0..6 {
        server.pool(&format!("p{i}")).await;
    }
    wait_deliveries(&server, &webhook, "the first 6 deliveries done", |l| l.len() == 6 && l.iter().all(|d| d["state"] == "done"));
    receiver.hold(true);
    for i in 6..30 {
        server.pool(&format!("p{i}")).await;
    }
    let wanted: BTreeSet<String> = event_ids(&server, "pool.created").await.into_iter().collect();
    assert_eq!(wanted.len(), 30);
    receiver.wait_for(WAIT, "deliveries held in flight", |r| r.len() > 6);
    reconciler.kill9();
    let at_kill = receiver.received();
    // What the kill cut off: items the receiver got, unanswered, with no attempt recorded and
    // the dead process's lease still on them.
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    let items: Vec<(String, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT id, state, (SELECT COUNT(*) FROM work_attempts a WHERE a.consumer = i.consumer AND a.item_id = i.id), \
         lease_owner FROM work_items i WHERE consumer = 'webhooks'",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    let done = items.iter().filter(|(_, state, _, _)| state == "done").count();
    let held: BTreeSet<String> = at_kill[6..].iter().map(|r| bc_projections::webhook_delivery_id(&r.id, &webhook)).collect();
    let cut_off = items
        .iter()
        .filter(|(id, state, recorded, owner)| state == "pending" && *recorded == 0 && owner.is_some() && held.contains(id))
        .count();
    eprintln!("killed with {done} of 30 done and {} requests held, {cut_off} of them cut off", held.len());
    assert_eq!(done, 6, "the kill landed mid-way: the first 6 done, none of the held ones: {items:?}");
    assert!(cut_off > 0, "deliveries in flight at the kill: received, unanswered, leased by the dead process: {items:?}");
    receiver.hold(false);
    reconciler.restart();
    // Done means a receiver answered 2xx; what was in flight at the kill is sent again once its
    // lease runs out.
    wait_deliveries(&server, &webhook, "every delivery done", |l| {
        l.len() == wanted.len() && l.iter().all(|d| d["state"] == "done")
    });
    let got = receiver.received();
    let ids: BTreeSet<String> = got.iter().map(|r| r.id.clone()).collect();
    assert!(ids.is_superset(&wanted), "every event reached the receiver");
    let mut by_id: BTreeMap<&str, Vec<&Received>> = BTreeMap::new();
    for r in &got {
        assert!(verifies(&secret, r), "signature of {} verifies", r.id);
        by_id.entry(&r.id).or_default().push(r);
    }
    let duplicates = by_id.values().filter(|v| v.len() > 1).count();
    for copies in by_id.values() {
        assert!(copies.iter().all(|c| c.body == copies[0].body), "a redelivery sends the same bytes");
    }
    eprintln!("{} deliveries for {} events ({duplicates} duplicated by the kill)", got.len(), wanted.len());
    assert!(duplicates >= cut_off, "each delivery cut off by the kill was sent again");
}

/// A receiver that fails, then recovers: the attempts follow the schedule (shortened to a
/// 200 ms base); one that never recovers lands in dead letters, and `redeliver` sends it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_follow_the_schedule_then_dead_letter_and_redeliver() {
    let server = Server::dev_with(&["--retry-base", "200ms", "--retry-attempts", "3"]);
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let (webhook, _) = create_webhook(&server, &receiver.url, "pool.created", &dir.path().join("secret"));

    receiver.fail_first(2);
    server.pool("flaky").await;
    let list = wait_deliveries(&server, &webhook, "the flaky delivery", |l| l.len() == 1 && l[0]["state"] == "done");
    let log = list[0]["attemptLog"].as_array().unwrap();
    let statuses: Vec<u64> = log.iter().map(|a| a["status"].as_u64().unwrap()).collect();
    assert_eq!(statuses, [503, 503, 204]);
    for (n, pair) in log.windows(2).enumerate() {
        // The written schedule: base × 4^(n-1), ±20 % jitter, counted from the end of the attempt.
        let nominal = 200.0 * 4f64.powi(n as i32);
        let ended = pair[0]["atMs"].as_u64().unwrap() + pair[0]["latencyMs"].as_u64().unwrap();
        let next = pair[0]["nextAtMs"].as_u64().expect("a failed attempt schedules the next");
        let delay = (next - ended) as f64;
        assert!(delay >= nominal * 0.8 - 1.0 && delay <= nominal * 1.2 + 1.0, "attempt {}: delay {delay} vs {nominal}", n + 1);
        assert!(pair[1]["atMs"].as_u64().unwrap() >= next, "attempt {} came before it was due", n + 2);
    }

    receiver.fail_always(true);
    server.pool("down").await;
    let list = wait_deliveries(&server, &webhook, "a dead letter", |l| l.iter().any(|d| d["state"] == "dead"));
    let dead = list.iter().find(|d| d["state"] == "dead").unwrap().clone();
    assert_eq!(dead["attempts"], 3, "dead after --retry-attempts");
    assert!(dead["lastError"].as_str().unwrap().contains("503"), "{dead}");
    let (code, out, _) = server.cli(&["webhooks", "deliveries", &webhook, "--state", "dead", "--format", "json"]);
    assert_eq!(code, 0);
    assert_eq!(bc_tests::json(&out)["items"].as_array().unwrap().len(), 1, "the dead letter is listed");

    receiver.fail_always(false);
    receiver.fail_first(0);
    let delivery = dead["deliveryId"].as_str().unwrap();
    let (code, out, err) = server.cli(&["webhooks", "redeliver", &webhook, delivery]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(bc_tests::json(&out)["state"], "pending");
    let list = wait_deliveries(&server, &webhook, "the redelivery", |l| l.iter().all(|d| d["state"] == "done"));
    let again = list.iter().find(|d| d["deliveryId"] == delivery).unwrap();
    assert_eq!(again["attempts"], 4);
    let got = receiver.received();
    let message = dead["messageId"].as_str().unwrap();
    assert_eq!(got.iter().filter(|r| r.id == message).count(), 4, "3 failed attempts and the redelivery");

    // A pending delivery cannot be queued twice; an unknown one is not found.
    let (code, _, err) = server.cli(&["webhooks", "redeliver", &webhook, &format!("evt_01m8md8t4pc01mpgg8eh8n10hr/{webhook}")]);
    assert_eq!(code, 1);
    assert!(err.contains("NOT_FOUND"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_webhook_input_is_refused_with_a_code() {
    let server = Server::dev();
    let cases: &[(&[&str], &str)] = &[
        (&["webhooks", "create", "--endpoint", "http://hooks.example.com/x", "--types", "*"], "https"),
        (&["webhooks", "create", "--endpoint", "https://10.1.2.3/x", "--types", "*"], "private"),
        (&["webhooks", "create", "--endpoint", "https://169.254.169.254/latest", "--types", "*"], "link-local"),
        (&["webhooks", "create", "--endpoint", "https://[fe80::1]/x", "--types", "*"], "link-local"),
        (&["webhooks", "create", "--endpoint", "https://[fd00::1]/x", "--types", "*"], "private"),
        (&["webhooks", "create", "--endpoint", "https://user:pw@hooks.example.com/", "--types", "*"], "credentials"),
        (&["webhooks", "create", "--endpoint", "https://hooks.example.com/x", "--types", "nope.*"], "unknown type pattern"),
        (&["webhooks", "create", "--endpoint", "https://hooks.example.com/x", "--types", ","], "empty"),
        (&["webhooks", "get", "pool_01m8md8t2hsbztp95s8efzj87k"], "wh_"),
        (&["webhooks", "deliveries", "wh_01m8md8t2hsbztp95s8efzj87k", "--state", "lost"], "delivery state"),
    ];
    for (args, needle) in cases {
        let (code, _, err) = server.cli(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("INVALID_ARGUMENT") && err.contains(needle), "{args:?}: {err}");
    }
    let many: Vec<String> = (0..21).map(|_| "pool.*".to_owned()).collect();
    let (status, body) =
        server.call("webhooks.create", json!({ "url": "https://hooks.example.com/x", "eventTypes": many })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{body}");
    // Loopback is for dev only: serve-like policy comes from the deployment, tested in core.
    let (status, body) =
        server.call("webhooks.create", json!({ "url": "https://hooks.example.com/x", "eventTypes": ["*"], "secret": "x" })).await;
    assert_eq!(status, 400, "unknown fields are refused: {body}");
    let (code, out, _) = server.cli(&["webhooks", "create", "--endpoint", "http://127.0.0.1:9/x", "--types", "*"]);
    assert_eq!(code, 0, "dev accepts a loopback receiver");
    let webhook = bc_tests::json(&out)["webhookId"].as_str().unwrap().to_owned();
    let (code, _, err) = server.cli(&["webhooks", "redeliver", &webhook, "evt_x/wh_y"]);
    assert_eq!(code, 2, "{err}");
    let (status, body) =
        server.call("webhooks.rotateSecret", json!({ "webhookId": webhook, "previousValidS": 30 * 24 * 3600 })).await;
    assert_eq!(status, 400, "{body}");
    // A key that may manage webhooks but not read events cannot subscribe to them.
    let (status, key) = server.call("apiKeys.create", json!({ "name": "hooks-only", "actions": ["compute:webhooks:*"] })).await;
    assert_eq!(status, 200, "{key}");
    let (status, body) = server
        .call_as(
            key["token"].as_str().unwrap(),
            "webhooks.create",
            json!({ "url": "https://hooks.example.com/x", "eventTypes": ["*"] }),
            None,
        )
        .await;
    assert_eq!((status, body["code"].as_str()), (403, Some("ACCESS_DENIED")), "{body}");
    // A lease shorter than two delivery timeouts would let two processes send one delivery.
    let (code, _, err) = bc_tests::cli(&["reconcile", "--lease", "10s", "--delivery-timeout", "10s"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--lease"), "{err}");
    // Nothing was created by the refusals.
    let (code, out, _) = server.cli(&["webhooks", "list", "--format", "json"]);
    assert_eq!(code, 0);
    assert_eq!(bc_tests::json(&out)["items"].as_array().unwrap().len(), 1);
}

/// Two `reconcile` processes on PostgreSQL split the deliveries (SKIP LOCKED): with no crash,
/// every event is delivered exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reconcilers_on_postgres_deliver_each_event_once() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let server = Server::serve_postgres_with(&db.url, &["--no-reconcilers", "--webhook-allow-loopback"]);
    let receiver = Receiver::start();
    // The receiver holds every request until both processes are seen delivering: one process
    // has at most 4 (--concurrency) in flight, so a fifth held request is the other's. (Paced
    // by a slow receiver instead, a clean CI run once saw one process deliver them all.)
    receiver.hold(true);
    let dir = tempfile::tempdir().unwrap();
    let (webhook, secret) = create_webhook(&server, &receiver.url, "pool.created", &dir.path().join("secret"));
    // The signing secrets are sealed under the server's data key: the reconcilers read it there.
    let data_dir = server.data_dir.display().to_string();
    let args = [
        "--only",
        "webhooks",
        "--database-url",
        &db.url,
        "--data-dir",
        &data_dir,
        "--webhook-allow-loopback",
        "--concurrency",
        "4",
    ];
    let _a = Reconciler::start(&args, dir.path());
    let _b = Reconciler::start(&args, dir.path());
    for i in 0..40 {
        server.pool(&format!("p{i}")).await;
    }
    let wanted: BTreeSet<String> = event_ids(&server, "pool.created").await.into_iter().collect();
    receiver.wait_for(WAIT, "both processes' deliveries in flight", |r| r.len() > 4);
    receiver.hold(false);
    receiver.wait_for(WAIT, "every event", |r| r.len() >= wanted.len());
    // Every delivery done: no item can be claimed again, so whatever was sent has arrived.
    wait_deliveries(&server, &webhook, "every delivery done", |l| {
        l.len() == wanted.len() && l.iter().all(|d| d["state"] == "done")
    });
    let got_after = receiver.received();
    assert_eq!(got_after.len(), wanted.len(), "nothing delivered twice");
    let ids: BTreeSet<String> = got_after.iter().map(|r| r.id.clone()).collect();
    assert_eq!(ids, wanted);
    assert!(got_after.iter().all(|r| verifies(&secret, r)));
    let list = deliveries(&server, &webhook);
    let attempts: Vec<Value> = list.iter().flat_map(|d| d["attemptLog"].as_array().unwrap().clone()).collect();
    assert_eq!(attempts.len(), wanted.len(), "one attempt each");
    let owners: BTreeSet<&str> = attempts.iter().map(|a| a["owner"].as_str().unwrap()).collect();
    eprintln!("deliveries split over {} reconciler processes", owners.len());
    assert_eq!(owners.len(), 2, "both reconcilers delivered: {owners:?}");
}
