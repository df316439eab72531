//! GPU reservations end to end with the real binaries: reserve, list, extend, release, the
//! queue, expiry, quotas, idempotency, concurrency, bad input, and the reconciler as its own
//! process on PostgreSQL.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bc_tests::{Reconciler, Server};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// A pool with the given nodes; each node is a list of (product, vramGiB, nvlink domain).
async fn fleet(server: &Server, nodes: &[&[(&str, u32, u32)]]) -> (String, Vec<String>) {
    let pool = server.pool("gpu-pool").await;
    let mut ids = Vec::new();
    for (i, gpus) in nodes.iter().enumerate() {
        let gpus: Vec<Value> = gpus
            .iter()
            .map(|(product, vram, domain)| {
                json!({ "model": product.split('-').next().unwrap(), "product": product, "vramGiB": vram, "nvlinkDomain": domain })
            })
            .collect();
        let (status, node) =
            server.call("nodes.register", json!({ "poolId": pool, "name": format!("n{i}"), "gpus": gpus })).await;
        assert_eq!(status, 200, "{node}");
        ids.push(node["nodeId"].as_str().unwrap().to_owned());
    }
    (pool, ids)
}

fn reserve(server: &Server, args: &[&str]) -> (i32, Value, String) {
    let mut all = vec!["reserve", "--format", "json"];
    all.extend_from_slice(args);
    let (code, out, err) = server.cli(&all);
    let value = if code == 0 { bc_tests::json(&out) } else { Value::Null };
    (code, value, err)
}

fn get(server: &Server, rsv: &str) -> Value {
    let (code, out, err) = server.cli(&["reservations", "get", rsv]);
    assert_eq!(code, 0, "{err}");
    bc_tests::json(&out)
}

fn wait_state(server: &Server, rsv: &str, state: &str) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let r = get(server, rsv);
        if r["state"] == state {
            return r;
        }
        assert!(Instant::now() < deadline, "{rsv} never became {state}: {r}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every GPU held by a live reservation, and by which: panics on a GPU held twice. The
/// reconciler may be activating meanwhile, so the reservations and the nodes are read until two
/// reads agree.
async fn holders(server: &Server) -> BTreeMap<(String, u64), String> {
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, page) = server.call("reservations.list", json!({ "state": "active", "limit": 500 })).await;
        assert_eq!(status, 200, "{page}");
        let mut held = BTreeMap::new();
        for r in page["items"].as_array().unwrap() {
            for gpu in r["gpuIndexes"].as_array().unwrap() {
                let slot = (r["nodeId"].as_str().unwrap().to_owned(), gpu.as_u64().unwrap());
                let id = r["reservationId"].as_str().unwrap().to_owned();
                if let Some(other) = held.insert(slot.clone(), id.clone()) {
                    panic!("GPU {slot:?} is held by {other} and {id}");
                }
            }
        }
        let (_, nodes) = server.call("nodes.list", json!({ "limit": 500 })).await;
        let mut from_nodes = BTreeMap::new();
        for n in nodes["items"].as_array().unwrap() {
            for (gpu, rsv) in n["allocations"].as_object().unwrap() {
                from_nodes.insert(
                    (n["nodeId"].as_str().unwrap().to_owned(), gpu.parse::<u64>().unwrap()),
                    rsv.as_str().unwrap().to_owned(),
                );
            }
        }
        if from_nodes == held {
            return held;
        }
        assert!(Instant::now() < deadline, "node allocations {from_nodes:?} never agreed with active reservations {held:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the reconciler has nothing left to activate: a whole reservations pass began
/// after the newest commit and committed nothing (nothing else writes meanwhile).
async fn settle(server: &Server) {
    let deadline = Instant::now() + WAIT;
    loop {
        let commit = server.last_commit().await;
        let began_after_ms = bc_tests::now_ms();
        server.wait_reconciler_pass_after("reservations", began_after_ms, WAIT);
        if server.last_commit().await == commit {
            return;
        }
        assert!(Instant::now() < deadline, "the reservations reconciler never settled");
    }
}

async fn get_state(server: &Server, rsv: &str) -> String {
    let (_, r) = server.call("reservations.get", json!({ "reservationId": rsv })).await;
    r["state"].as_str().unwrap_or_default().to_owned()
}

const H100: (&str, u32, u32) = ("H100-SXM5-80GB", 80, 0);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_queue_extend_release_and_expire() {
    let server = Server::dev();
    let h = |d| ("H100-SXM5-80GB", 80, d);
    let (pool, nodes) =
        fleet(&server, &[&[h(0), h(0), h(1), h(1)], &[("A100-SXM4-40GB", 40, 0), ("A100-SXM4-40GB", 40, 0)]]).await;

    // NVLink and the tightest fit: two H100s of one domain.
    let (code, a, err) =
        reserve(&server, &["--pool", &pool, "--gpus", "2", "--for", "1h", "--nvlink", "--product", "H100-SXM5-80GB"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("idempotency key: cli-"), "reserve prints the key it used: {err}");
    assert_eq!(a["state"], "active");
    assert_eq!(a["nodeId"], nodes[0].as_str());
    assert_eq!(a["gpuIndexes"], json!([0, 1]));
    // A selector that only the A100 node matches.
    let (code, b, err) =
        reserve(&server, &["--pool", &pool, "--gpus", "2", "--for", "1h", "--selector", "vramGiB < 80, gpuModel in (A100)"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(b["nodeId"], nodes[1].as_str());
    // Four on one node do not fit now: queued, first in line.
    let (code, c, err) = reserve(&server, &["--pool", &pool, "--gpus", "4", "--for", "1h", "--wait", "0"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!((c["state"].as_str(), c["queuePosition"].as_u64()), (Some("queued"), Some(1)));
    let c_id = c["reservationId"].as_str().unwrap().to_owned();
    // A small one behind it queues too (strict FIFO), even though 2 H100s are free.
    let (_, d, _) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1h", "--wait", "0"]);
    assert_eq!((d["state"].as_str(), d["queuePosition"].as_u64()), (Some("queued"), Some(2)));
    let (code, out, _) = server.cli(&["reservations", "list", "--state", "queued", "--format", "table"]);
    assert_eq!(code, 0);
    assert!(out.contains(&c_id) && out.lines().count() >= 3, "{out}");
    holders(&server).await;

    // Extend moves the end; past the pool's maximum it is refused.
    let a_id = a["reservationId"].as_str().unwrap();
    let (code, out, err) = server.cli(&["extend", a_id, "--by", "2h"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(bc_tests::json(&out)["endsAtMs"].as_u64().unwrap(), a["endsAtMs"].as_u64().unwrap() + 2 * 3600 * 1000);
    let (code, _, err) = server.cli(&["extend", a_id, "--by", "40d"]);
    assert_eq!(code, 1, "the pool's state refuses it, not a usage mistake: {err}");
    assert!(err.contains("INVALID_STATE: ") && err.contains("maximum"), "{err}");

    // Releasing the first frees its node: the queued 4-GPU reservation is activated there, and
    // the 1-GPU one behind it lands on the tightest remaining fit.
    let (code, out, err) = server.cli(&["release", a_id]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(bc_tests::json(&out)["state"], "released");
    let c = wait_state(&server, &c_id, "active");
    assert_eq!(c["nodeId"], nodes[0].as_str());
    let d_id = d["reservationId"].as_str().unwrap();
    let d = get(&server, d_id);
    assert_eq!(d["state"], "queued", "nothing is free for it now");
    // Cancel the queued one; releasing again changes nothing.
    let (code, out, _) = server.cli(&["release", d_id]);
    assert_eq!((code, bc_tests::json(&out)["state"].as_str()), (0, Some("cancelled")));
    let (code, out, _) = server.cli(&["release", a_id]);
    assert_eq!((code, bc_tests::json(&out)["state"].as_str()), (0, Some("released")));
    holders(&server).await;

    // Expiry: the reconciler ends a reservation at its end time and frees its GPUs.
    let (_, b_gone, _) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1s", "--wait", "0", "--model", "A100"]);
    assert_eq!(b_gone["state"], "queued", "the A100s are taken by b");
    server.cli(&["release", b["reservationId"].as_str().unwrap()]);
    let short = wait_state(&server, b_gone["reservationId"].as_str().unwrap(), "active");
    let expired = wait_state(&server, short["reservationId"].as_str().unwrap(), "expired");
    assert!(expired["endedAtMs"].as_u64().unwrap() >= short["endsAtMs"].as_u64().unwrap());
    let (_, cap) = server.call("capacity.get", json!({ "poolId": pool })).await;
    assert_eq!(cap["items"][0]["free"], 2, "the A100s are free again: {cap}");
    holders(&server).await;

    // Every transition is an event.
    let (_, events) = server.call("events.list", json!({ "types": ["reservation.*"], "limit": 500 })).await;
    let types: BTreeSet<&str> = events["items"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap()).collect();
    for t in [
        "reservation.requested",
        "reservation.activated",
        "reservation.extended",
        "reservation.released",
        "reservation.cancelled",
        "reservation.expired",
    ] {
        assert!(types.contains(t), "{t} missing from {types:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_quota_and_idempotency() {
    let server = Server::dev();
    let (pool, _) = fleet(&server, &[&[H100, H100]]).await;
    let (_, a, _) = reserve(&server, &["--pool", &pool, "--gpus", "2", "--for", "1h"]);
    assert_eq!(a["state"], "active");
    // --wait: queued, then activated when a release frees the GPUs.
    let waiter = {
        let env = server.env();
        let pool = pool.clone();
        std::thread::spawn(move || {
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            bc_tests::cli(&["reserve", "--pool", &pool, "--gpus", "2", "--for", "1h", "--wait", "30", "--format", "json"], &env)
        })
    };
    // Released only once the waiter's reservation is queued, so it was queued behind `a`.
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, queued) = server.call("reservations.list", json!({ "state": "queued", "limit": 500 })).await;
        if !queued["items"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the waiter's reservation never queued");
        tokio::time::sleep(Duration::from_millis(bc_tests::POLL_MS)).await;
    }
    server.cli(&["release", a["reservationId"].as_str().unwrap()]);
    let (code, out, err) = waiter.join().unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("queued at position 1"), "{err}");
    let b = bc_tests::json(&out);
    assert_eq!(b["state"], "active", "--wait returned once it was active");

    // The same --key twice reserves once.
    server.cli(&["release", b["reservationId"].as_str().unwrap()]);
    let args = ["--pool", pool.as_str(), "--gpus", "1", "--for", "1h", "--key", "retry-me"];
    let (_, first, _) = reserve(&server, &args);
    let (_, second, _) = reserve(&server, &args);
    assert_eq!(first["reservationId"], second["reservationId"]);
    assert_eq!(second["replayed"], true);
    let (_, events) = server.call("events.list", json!({ "types": ["reservation.requested"], "limit": 500 })).await;
    assert_eq!(events["items"].as_array().unwrap().len(), 3, "a, the waiter's, and one for the key");
    // The same key with another request is refused.
    let (code, _, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "2", "--for", "1h", "--key", "retry-me"]);
    assert_eq!(code, 1);
    assert!(err.contains("IDEMPOTENCY_CONFLICT"), "{err}");

    // Quota: over it is refused, and only the refusal's record is appended.
    let (code, _, err) = server.cli(&["quotas", "set", "--pool", &pool, "--gpus", "2"]);
    assert_eq!(code, 0, "{err}");
    let before = server.last_commit().await;
    let (code, _, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "2", "--for", "1h"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("QUOTA_EXCEEDED"), "{err}");
    assert_eq!(server.last_commit().await, before + 1, "one commit: the refusal's record");
    let (_, events) = server.call("events.list", json!({ "types": ["quota.exceeded"] })).await;
    let refusal = &events["items"][0]["payload"];
    assert_eq!(
        (refusal["requested"].as_u64(), refusal["inUse"].as_u64(), refusal["limit"].as_u64()),
        (Some(2), Some(1), Some(2))
    );
    let (code, out, _) = server.cli(&["quotas", "get", "--pool", &pool]);
    assert_eq!((code, bc_tests::json(&out)["inUse"].as_u64()), (0, Some(1)));
    // Within the quota it goes through.
    let (code, _, err) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1h"]);
    assert_eq!(code, 0, "{err}");
}

/// Many clients at once against a pool with fewer GPUs than they ask for in total: no GPU is
/// held twice, and every client got a reservation or a queue position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_reservations_never_double_book() {
    let server = Server::dev();
    let eight = [H100; 8];
    let (pool, _) = fleet(&server, &[&eight, &eight, &eight, &eight]).await;
    let asks: Vec<u32> = (0..48).map(|i| 1 + (i % 4)).collect();
    let total: u32 = asks.iter().sum();
    assert!(total > 32, "more asked ({total}) than the pool holds");
    let calls = asks.iter().enumerate().map(|(i, gpus)| {
        let pool = pool.clone();
        let server = &server;
        async move {
            server
                .call_as(
                    &server.token,
                    "reservations.create",
                    json!({ "poolId": pool, "gpus": gpus, "durationS": 3600 }),
                    Some(&format!("burst-{i}")),
                )
                .await
        }
    });
    let results = futures::future::join_all(calls).await;
    let (mut active, mut queued) = (0, 0);
    for (status, r) in &results {
        assert_eq!(*status, 200, "every client gets a clear answer: {r}");
        match r["state"].as_str() {
            Some("active") => active += 1,
            Some("queued") => {
                assert!(r["queuePosition"].as_u64().unwrap() >= 1);
                queued += 1;
            }
            other => panic!("unexpected state {other:?}: {r}"),
        }
    }
    assert!(active > 0 && queued > 0, "{active} active, {queued} queued");
    settle(&server).await;
    let held = holders(&server).await;
    assert!(held.len() <= 32);
    let (_, cap) = server.call("capacity.get", json!({})).await;
    let (_, waiting) = server.call("reservations.list", json!({ "state": "queued", "limit": 500 })).await;
    let head = waiting["items"].as_array().unwrap().iter().find(|r| r["queuePosition"] == 1).expect("a queue head");
    let free = cap["items"][0]["free"].as_u64().unwrap();
    eprintln!(
        "{active} placed at once, {queued} queued; after the reconciler: {} GPUs held, {free} free, head asks {}",
        held.len(),
        head["gpus"]
    );
    // The head waits only because no single node has room for it.
    let (_, preview) = server.call("capacity.preview", json!({ "poolId": pool, "gpus": head["gpus"], "durationS": 3600 })).await;
    assert_eq!(preview["fitsIgnoringQueue"], false, "the queue head fits but was not placed: {preview}");
    // Queue positions are distinct and dense.
    let (_, page) = server.call("reservations.list", json!({ "state": "queued", "limit": 500 })).await;
    let positions: BTreeSet<u64> =
        page["items"].as_array().unwrap().iter().map(|r| r["queuePosition"].as_u64().unwrap()).collect();
    assert_eq!(positions, (1..=positions.len() as u64).collect());
    // The projections rebuilt from the log hold the same assignments.
    let before = server.call("nodes.list", json!({ "limit": 500 })).await.1;
    let (code, _, err) = bc_tests::cli(&["projections", "rebuild", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let after = server.call("nodes.list", json!({ "limit": 500 })).await.1;
    assert_eq!(before, after);
    let (events, _) = bc_tests::verify_sqlite(&server.sqlite_path()).await;
    assert!(events > 48);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_reservation_input_is_refused_before_or_at_the_edge() {
    let server = Server::dev();
    let (pool, nodes) = fleet(&server, &[&[H100]]).await;
    let cases: &[(&[&str], i32, &str)] = &[
        (&["reserve", "--pool", &pool, "--gpus", "1", "--for", "0s"], 2, "zero"),
        (&["reserve", "--pool", &pool, "--gpus", "1", "--for", "400d"], 2, "maximum"),
        (&["reserve", "--pool", &pool, "--gpus", "1", "--for", "soon"], 2, "duration"),
        (&["reserve", "--pool", &pool, "--gpus", "0", "--for", "1h"], 2, "1..=64"),
        (&["reserve", "--pool", &pool, "--gpus", "-1", "--for", "1h"], 2, "INVALID_ARGUMENT"),
        (&["reserve", "--pool", "pool_01m8md8t2hsbztp95s8efzj87k", "--gpus", "1", "--for", "1h"], 1, "NOT_FOUND"),
        (&["reserve", "--pool", &nodes[0], "--gpus", "1", "--for", "1h"], 2, "not a pool_ id"),
        (&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h", "--selector", "vramGiB >= lots"], 2, "column 12"),
        (&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h", "--selector", "colour = red"], 2, "column 1"),
        (&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h", "--product", "H100 SXM"], 2, "product"),
        (&["release", &pool], 2, "not a rsv_ id"),
        (&["extend", "rsv_01m8md8t2hsbztp95s8efzj87k", "--by", "0s"], 2, "zero"),
        (&["reservations", "list", "--state", "sleeping"], 2, "reservation state"),
        (&["nodes", "label", &nodes[0], "nokey"], 2, "KEY=VALUE"),
        (&["capacity", "--gpus", "2"], 2, "--preview"),
    ];
    for (args, status, needle) in cases {
        let (code, _, err) = server.cli(args);
        assert_eq!(code, *status, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    for body in [
        json!({ "poolId": pool, "gpus": -3, "durationS": 60 }),
        json!({ "poolId": pool, "gpus": 65, "durationS": 60 }),
        json!({ "poolId": pool, "gpus": 1, "durationS": 0 }),
        json!({ "poolId": pool, "gpus": 1, "durationS": 60, "selector": "vramGiB >= 80,," }),
        json!({ "poolId": pool, "gpus": 1, "durationS": 60, "colour": "red" }),
    ] {
        let (status, r) = server.call("reservations.create", body.clone()).await;
        assert_eq!((status, r["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{body}: {r}");
    }
    // A request no node could ever hold is refused, not queued to block the pool for good.
    // It depends on the fleet, not on the request alone: INVALID_STATE (409, exit 1), with a hint.
    let (code, _, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "2", "--for", "1h"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE: ") && err.contains("could ever hold") && err.contains("capacity"), "{err}");
    let (code, _, err) = server.cli(&["reserve", "--pool", &pool, "--gpus", "1", "--for", "1h", "--product", "B200"]);
    assert_eq!(code, 1, "{err}");
    let (status, r) = server.call("reservations.create", json!({ "poolId": pool, "gpus": 2, "durationS": 60 })).await;
    assert_eq!((status, r["code"].as_str()), (409, Some("INVALID_STATE")), "{r}");
    assert!(r["details"]["hint"].as_str().is_some_and(|h| h.contains("capacity")), "{r}");
    let (status, r) = server.call("capacity.preview", json!({ "poolId": pool, "gpus": 1, "durationS": 31 * 86_400 })).await;
    assert_eq!((status, r["code"].as_str()), (409, Some("INVALID_STATE")), "past the pool's maximum: {r}");
    let (_, events) = server.call("events.list", json!({ "types": ["reservation.*"] })).await;
    assert_eq!(events["items"].as_array().unwrap().len(), 0, "nothing appended by refusals");
    // Cordoned and tainted nodes take nothing unless tolerated; --if-version guards.
    let (code, _, err) = server.cli(&["nodes", "cordon", &nodes[0], "--if-version", "7"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("CONFLICT"), "{err}");
    let (code, _, _) = server.cli(&["nodes", "cordon", &nodes[0]]);
    assert_eq!(code, 0);
    let (_, r, _) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1h", "--wait", "0"]);
    assert_eq!(r["state"], "queued", "a cordoned node takes no reservation");
    server.cli(&["release", r["reservationId"].as_str().unwrap()]);
    server.cli(&["nodes", "uncordon", &nodes[0]]);
    let (code, _, err) = server.cli(&["nodes", "taint", &nodes[0], "dedicated=ml"]);
    assert_eq!(code, 0, "{err}");
    let (_, r, _) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1h", "--wait", "0"]);
    assert_eq!(r["state"], "queued", "an untolerated taint keeps it off");
    server.cli(&["release", r["reservationId"].as_str().unwrap()]);
    let (_, r, _) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1h", "--tolerate", "dedicated"]);
    assert_eq!(r["state"], "active");
    // --if-version names the version the caller read: another is a CONFLICT, and nothing moves.
    let stale = (r["version"].as_u64().unwrap() + 1).to_string();
    let (code, _, err) = server.cli(&["release", r["reservationId"].as_str().unwrap(), "--if-version", &stale]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("CONFLICT"), "{err}");
    assert_eq!(get(&server, r["reservationId"].as_str().unwrap())["state"], "active");
    // Drain waits for the reservation to end.
    let (code, out, _) = server.cli(&["nodes", "drain", &nodes[0]]);
    assert_eq!((code, bc_tests::json(&out)["drained"].as_bool()), (0, Some(false)));
    server.cli(&["release", r["reservationId"].as_str().unwrap()]);
    let (code, out, err) = server.cli(&["nodes", "drain", &nodes[0], "--wait", "10"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(bc_tests::json(&out)["drained"], true);
}

/// Two `reconcile --only reservations` processes on PostgreSQL: a burst of queued reservations
/// is activated with no reservation activated twice and no GPU held twice; the process seen
/// activating first (by its own log) is killed with SIGKILL while work is left, and the other
/// does the rest: nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reservation_reconcilers_on_postgres() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let server = Server::serve_postgres_with(&db.url, &["--no-reconcilers"]);
    let eight = [H100; 8];
    let (pool, _) = fleet(&server, &[&eight, &eight]).await;
    // Fill the pool, queue 12 more behind it.
    let mut blockers = Vec::new();
    for i in 0..2 {
        let (status, r) = server
            .call_as(
                &server.token,
                "reservations.create",
                json!({ "poolId": pool, "gpus": 8, "durationS": 3600 }),
                Some(&format!("b{i}")),
            )
            .await;
        assert_eq!((status, r["state"].as_str()), (200, Some("active")), "{r}");
        blockers.push(r["reservationId"].as_str().unwrap().to_owned());
    }
    let mut queued = Vec::new();
    // 15 GPUs asked for, 16 in the pool once the blockers go.
    for i in 0..10 {
        let (_, r) = server.call("reservations.create", json!({ "poolId": pool, "gpus": 1 + (i % 2), "durationS": 3600 })).await;
        assert_eq!(r["state"], "queued");
        queued.push(r["reservationId"].as_str().unwrap().to_owned());
    }
    let dir = tempfile::tempdir().unwrap();
    let data_dir = server.data_dir.display().to_string();
    let args = ["--only", "reservations", "--database-url", &db.url, "--data-dir", &data_dir];
    let mut processes = [Reconciler::start(&args, dir.path()), Reconciler::start(&args, dir.path())];
    // Free one node's GPUs: the head of the queue activates, and what does not fit stays queued
    // (15 GPUs asked for, 8 free).
    let (status, r) = server.call("reservations.release", json!({ "reservationId": blockers[0] })).await;
    assert_eq!(status, 200, "{r}");
    // The kill is placed by what is observed: the first process whose log says it activated
    // reservations is the one killed, so the process killed is one that was doing the work.
    let deadline = Instant::now() + WAIT;
    let worker = loop {
        if let Some(i) = processes.iter().position(|p| p.activated() > 0) {
            break i;
        }
        assert!(Instant::now() < deadline, "no process activated anything");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    processes[worker].kill9();
    let done_by_killed = processes[worker].activated();
    let mut active_at_kill = 0;
    for id in &queued {
        if get_state(&server, id).await == "active" {
            active_at_kill += 1;
        }
    }
    eprintln!(
        "{active_at_kill} of {} queued reservations active at the kill, {done_by_killed} by the killed process",
        queued.len()
    );
    assert!(done_by_killed > 0, "the killed process had done part of the work");
    assert!(active_at_kill < queued.len(), "work was left at the kill: {active_at_kill} active");
    let survivor_before = processes[1 - worker].activated();
    let (status, r) = server.call("reservations.release", json!({ "reservationId": blockers[1] })).await;
    assert_eq!(status, 200, "{r}");
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, page) = server.call("reservations.list", json!({ "state": "queued" })).await;
        if page["items"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "still queued: {page}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The rest was the survivor's: what the killed process left, the other one did.
    let survivor_after = processes[1 - worker].activated();
    assert!(
        survivor_after > survivor_before,
        "the surviving process activated what was left ({survivor_before} -> {survivor_after})"
    );
    holders(&server).await;
    let (_, events) = server.call("events.list", json!({ "types": ["reservation.activated"], "limit": 500 })).await;
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for e in events["items"].as_array().unwrap() {
        *per.entry(e["stream"].as_str().unwrap().to_owned()).or_default() += 1;
    }
    assert!(per.values().all(|n| *n == 1), "no reservation activated twice: {per:?}");
    assert_eq!(per.len(), 12, "the two blockers and the ten queued");
    let store = bc_core::store::postgres::PostgresStore::connect(&db.url).await.unwrap();
    bc_tests::verify_store(&store).await;
}

/// What the store logs (at debug, on in the tests' servers) when another process moved a chain's
/// head under a batch: the batch is decided again.
const HEAD_MOVED: &str = "a chain head moved under the batch";

/// Two `serve` processes on one PostgreSQL keep a quota exact, since the quota
/// is guarded in the log (each reservation charged on the quota's stream at the version its
/// decision read), not in one process's memory. Concurrent reserves through both never
/// overshoot it and never give one GPU twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_gateways_on_one_database_never_overshoot_a_quota_or_double_book() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let a = Server::serve_postgres_with(&db.url, &["--no-reconcilers"]);
    let b = a.serve_beside();
    let eight = [H100; 8];
    let (pool, _) = fleet(&a, &[&eight, &eight]).await;
    const QUOTA: usize = 5;
    let (status, quota) = a.call("quotas.set", json!({ "poolId": pool, "gpus": QUOTA })).await;
    assert_eq!(status, 200, "{quota}");

    // 24 reserves of one GPU at once, half through each gateway: 16 GPUs free, a quota of 5.
    let moved_before = a.log_text().matches(HEAD_MOVED).count();
    let asks = (0..24).map(|i| {
        let server = if i % 2 == 0 { &a } else { &b };
        let pool = pool.clone();
        async move {
            let sent = Instant::now();
            let answer = server.call("reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 600 })).await;
            (i % 2, sent, Instant::now(), answer)
        }
    });
    let timed = futures::future::join_all(asks).await;
    // They raced: a request through one gateway was answered while one through the other was
    // still waiting for its answer, and the two processes' appends met on the tenant's chain
    // (a batch of one decided again on the head the other had moved; both log to one file).
    let overlapped = timed.iter().any(|(g, sent, answered, _)| {
        timed.iter().any(|(h, other_sent, other_answered, _)| g != h && sent < other_answered && other_sent < answered)
    });
    assert!(overlapped, "a request through each gateway was in flight at once");
    let moved = a.log_text().matches(HEAD_MOVED).count() - moved_before;
    eprintln!("{moved} batches decided again on the other process's head");
    assert!(moved > 0, "the two processes' appends met on one chain");
    let answers: Vec<(u16, Value)> = timed.into_iter().map(|(_, _, _, answer)| answer).collect();
    let accepted: Vec<&Value> = answers.iter().filter(|(s, _)| *s == 200).map(|(_, r)| r).collect();
    for (status, body) in answers.iter().filter(|(s, _)| *s != 200) {
        assert_eq!(body["code"], "QUOTA_EXCEEDED", "{status} {body}");
    }
    assert_eq!(accepted.len(), QUOTA, "exactly the quota, through both gateways: {answers:?}");
    let mut taken = BTreeSet::new();
    for rsv in &accepted {
        // Placed at once, or queued after losing its node to a placement of the other gateway.
        assert!(rsv["state"] == "active" || rsv["state"] == "queued", "{rsv}");
        for gpu in rsv["gpuIndexes"].as_array().unwrap() {
            assert!(
                taken.insert((rsv["nodeId"].as_str().unwrap().to_owned(), gpu.as_u64().unwrap())),
                "a GPU given twice: {rsv}"
            );
        }
    }
    // Each gateway sees the other's: the next reserve is refused by both.
    for server in [&a, &b] {
        let (status, body) = server.call("reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 600 })).await;
        assert_eq!((status, body["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "{body}");
    }
}

/// `nodes.delete`: a node goes for good only once nothing holds it (cordoned, no GPU held), with
/// the CLI asking for `--yes` before any call; then it is gone from reads and from placement,
/// and the log that says so still verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_deleted_only_once_nothing_holds_it_and_is_gone_from_placement() {
    let server = Server::dev();
    let a100 = ("A100-SXM4-40GB", 40, 0);
    let (pool, nodes) = fleet(&server, &[&[a100, a100]]).await;
    let node = nodes[0].as_str();
    let (code, held, err) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1h"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(held["state"], "active");
    let held = held["reservationId"].as_str().unwrap().to_owned();

    // The CLI refuses before any call without --yes; a bad id is a usage error too.
    let (code, _, err) = server.cli(&["nodes", "delete", node]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--yes"), "{err}");
    let (code, _, err) = server.cli(&["nodes", "delete", "pool_01jd0000000000000000000000", "--yes"]);
    assert_eq!(code, 2, "{err}");
    let delete = |reason: Option<&str>| {
        let mut body = json!({ "nodeId": node });
        if let Some(r) = reason {
            body["reason"] = json!(r);
        }
        server.call("nodes.delete", body)
    };
    // Still taking reservations, then holding a GPU: refused, with what holds it.
    let (status, refused) = delete(None).await;
    assert_eq!((status, refused["code"].as_str()), (409, Some("CONFLICT")), "{refused}");
    assert!(refused["message"].as_str().unwrap().contains("cordon or drain it first"), "{refused}");
    let (code, _, err) = server.cli(&["nodes", "cordon", node]);
    assert_eq!(code, 0, "{err}");
    let (status, refused) = delete(None).await;
    assert_eq!(status, 409, "{refused}");
    assert!(refused["message"].as_str().unwrap().contains(&held), "names the holder: {refused}");
    // A reason past its bound is bad input.
    let (status, refused) = delete(Some(&"x".repeat(501))).await;
    assert_eq!((status, refused["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{refused}");

    let (code, _, err) = server.cli(&["release", &held]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = server.cli(&["nodes", "delete", node, "--yes", "--reason", "decommissioned: rack 4"]);
    assert_eq!(code, 0, "{err}");
    let deleted = bc_tests::json(&out);
    assert_eq!((deleted["nodeId"].as_str(), deleted["deleted"].as_bool()), (Some(node), Some(true)), "{deleted}");

    // Gone: from reads, from lists, from placement; a second delete finds nothing.
    let (status, gone) = server.call("nodes.get", json!({ "nodeId": node })).await;
    assert_eq!((status, gone["code"].as_str()), (404, Some("NOT_FOUND")), "{gone}");
    let (status, list) = server.call("nodes.list", json!({ "poolId": pool })).await;
    assert_eq!(status, 200, "{list}");
    assert!(list["items"].as_array().unwrap().is_empty(), "{list}");
    let (status, again) = delete(None).await;
    assert_eq!(status, 404, "{again}");
    let (code, _, err) = reserve(&server, &["--pool", &pool, "--gpus", "1", "--for", "1h", "--wait", "0"]);
    assert_eq!(code, 1, "no node can hold it now: {err}");
    assert!(err.contains("could ever hold"), "{err}");

    // The log says so, with the reason, and still verifies.
    let (status, events) = server.call("events.list", json!({ "types": ["node.deleted"] })).await;
    assert_eq!(status, 200, "{events}");
    let items = events["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{events}");
    assert_eq!(items[0]["payload"]["reason"], "decommissioned: rack 4", "{events}");
    let (code, out, err) =
        server.cli(&["audit", "verify", "--data-dir", &server.data_dir.display().to_string(), "--format", "json"]);
    assert_eq!(code, 0, "audit verify: {out} {err}");
}

/// An event without a signature of its own (a reservation under a quota appends three events in
/// one append; the appender signs the last) verifies alone from `events.get`, with libraries
/// this project did not write: SHA-256 of its bytes, then each of `coveredBy.following` decoded
/// with minicbor (its `seq` the next, its `prev` the hash before), and the Ed25519 signature
/// over the last hash under the pinned key (`schema/LOG-FORMAT.md`, "Verifying one event").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_a_later_signature_covers_verifies_alone_from_events_get() {
    use base64::Engine;
    use ed25519_dalek::{Signature, VerifyingKey};
    use sha2::{Digest, Sha256};
    let b64 = base64::engine::general_purpose::STANDARD;
    let server = Server::dev();
    let (pool, _) = fleet(&server, &[&[H100; 8]]).await;
    let (status, quota) = server.call("quotas.set", json!({ "poolId": pool, "gpus": 4 })).await;
    assert_eq!(status, 200, "{quota}");
    let (status, rsv) = server.call("reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 600 })).await;
    assert_eq!(status, 200, "{rsv}");
    let (_, page) = server.call("events.list", json!({ "limit": 100 })).await;
    // The reservation's append signs its last event (and any whose seq is a multiple of 16).
    let items = page["items"].as_array().unwrap();
    let at = items.iter().position(|e| e["type"] == "reservation.requested").unwrap_or_else(|| panic!("{page}"));
    let requested = items[at..].iter().find(|e| e.get("keyId").is_none()).unwrap_or_else(|| panic!("{page}")).clone();
    let (status, full) = server.call("events.get", json!({ "eventId": requested["id"] })).await;
    assert_eq!(status, 200, "{full}");
    assert!(full.get("sig").is_none(), "{full}");
    let covered = &full["coveredBy"];
    let following = covered["following"].as_array().unwrap_or_else(|| panic!("{full}"));
    assert_eq!(following.len() as u64, covered["seq"].as_u64().unwrap() - full["seq"].as_u64().unwrap(), "{full}");

    let mut hash: [u8; 32] = Sha256::digest(b64.decode(full["canonical"].as_str().unwrap()).unwrap()).into();
    assert_eq!(hex::encode(hash), full["hash"].as_str().unwrap());
    let mut seq = full["seq"].as_u64().unwrap();
    for bytes in following {
        let bytes = b64.decode(bytes.as_str().unwrap()).unwrap();
        let (mut their_seq, mut their_prev) = (0u64, Vec::new());
        let mut d = minicbor::Decoder::new(&bytes);
        for _ in 0..d.map().unwrap().expect("a definite map") {
            match d.str().unwrap() {
                "seq" => their_seq = d.u64().unwrap(),
                "prev" => their_prev = d.bytes().unwrap().to_vec(),
                _ => d.skip().unwrap(),
            }
        }
        assert_eq!((their_seq, their_prev.as_slice()), (seq + 1, hash.as_slice()), "each links to the one before");
        seq = their_seq;
        hash = Sha256::digest(&bytes).into();
    }
    assert_eq!(seq, covered["seq"].as_u64().unwrap());

    let (code, pki, err) = bc_tests::cli(&["pki", "show", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let pki: Value = serde_json::from_str(&pki).unwrap();
    assert_eq!(covered["keyId"], pki["keyId"]);
    let public: [u8; 32] = b64.decode(pki["publicKey"].as_str().unwrap()).unwrap().try_into().unwrap();
    let key = VerifyingKey::from_bytes(&public).unwrap();
    let sig = Signature::from_slice(&b64.decode(covered["sig"].as_str().unwrap()).unwrap()).unwrap();
    let mut message = b"better-compute/event/v1\n".to_vec();
    message.extend_from_slice(&hash);
    key.verify_strict(&message, &sig).expect("the covering signature verifies under the pinned key");
}
