//! Pools offered to other tenants, end to end with the real `dev`: tenant B reserves from tenant
//! A's pool under B's own quota, the two share the pool's GPUs (neither is given the other's),
//! and once the offer is withdrawn B's active reservation runs to its end, its queued one is
//! cancelled and its new one is refused. Each tenant acts with its own API key.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bc_tests::Server;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// A key of `tenant` with `actions`, made by the root administrator; its token.
async fn key(server: &Server, tenant: &str, actions: &[&str]) -> String {
    let (status, key) = server.call("apiKeys.create", json!({ "tenantId": tenant, "name": "k", "actions": actions })).await;
    assert_eq!(status, 200, "{key}");
    key["token"].as_str().unwrap().to_owned()
}

fn gpus(r: &Value) -> BTreeSet<u64> {
    r["gpuIndexes"].as_array().unwrap().iter().map(|g| g.as_u64().unwrap()).collect()
}

/// The CLI as the holder of `token`.
fn cli_as(server: &Server, token: &str, args: &[&str]) -> (i32, String, String) {
    bc_tests::cli(args, &[("BETTER_COMPUTE_URL", server.url.as_str()), ("BETTER_COMPUTE_TOKEN", token)])
}

#[tokio::test]
async fn an_offered_tenant_reserves_under_its_own_quota_shares_the_gpus_and_keeps_its_live_reservation_when_unoffered() {
    let server = Server::dev();
    let (a, b) = (server.tenant("acme").await, server.tenant("bravo").await);
    let a_key = key(&server, &a, &["compute:pools:*", "compute:reservations:*", "compute:quotas:read"]).await;
    let b_key = key(&server, &b, &["compute:pools:read", "compute:reservations:*", "compute:quotas:read"]).await;
    let pool = server.tenant_pool(&a, "shared").await;
    let eight = vec![json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }); 8];
    let (status, node) =
        server.call("nodes.register", json!({ "tenantId": a, "poolId": pool, "name": "n0", "gpus": eight })).await;
    assert_eq!(status, 200, "{node}");
    let ask = |gpus: u32, duration_s: u32| json!({ "poolId": pool, "gpus": gpus, "durationS": duration_s });

    // Not offered yet: B does not see the pool.
    let (status, refused) = server.call_as(&b_key, "reservations.create", ask(1, 60), None).await;
    assert_eq!((status, refused["code"].as_str()), (404, Some("NOT_FOUND")), "{refused}");

    // The owner offers it from the command line; ids are checked before anything is sent.
    let (code, _, err) = cli_as(&server, &a_key, &["pools", "offer", &pool, "--tenant-id", "bravo"]);
    assert_eq!(code, 2, "a malformed tenant id is a usage error: {err}");
    let (code, out, err) = cli_as(&server, &a_key, &["pools", "offer", &pool, "--tenant-id", &b]);
    assert_eq!(code, 0, "{err}");
    let offered = bc_tests::json(&out);
    assert_eq!(offered["offeredTo"], json!([b]));
    // Again: nothing changes; the owner itself, an unknown tenant and B's own key are refused.
    let (_, again) = server.call_as(&a_key, "pools.offer", json!({ "poolId": pool, "tenantIds": [b] }), None).await;
    assert_eq!(again["version"], offered["version"], "{again}");
    let (status, own) = server.call_as(&a_key, "pools.offer", json!({ "poolId": pool, "tenantIds": [a] }), None).await;
    assert_eq!((status, own["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{own}");
    let ghost = "ten_01kb0000000000000000000zzz";
    let (status, none) = server.call_as(&a_key, "pools.offer", json!({ "poolId": pool, "tenantIds": [ghost] }), None).await;
    assert_eq!((status, none["code"].as_str()), (404, Some("NOT_FOUND")), "{none}");
    let (status, denied) =
        server.call_as(&b_key, "pools.offer", json!({ "tenantId": a, "poolId": pool, "tenantIds": [b] }), None).await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")), "{denied}");

    // B sees the pool, marked offered and without the owner's other offers; it cannot change it.
    let (_, listed) = server.call_as(&b_key, "pools.list", json!({}), None).await;
    let items = listed["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{listed}");
    assert_eq!((items[0]["poolId"].as_str(), items[0]["offered"].as_bool()), (Some(pool.as_str()), Some(true)));
    assert!(items[0].get("offeredTo").is_none(), "{listed}");
    let (status, got) = server.call_as(&b_key, "pools.get", json!({ "poolId": pool }), None).await;
    assert_eq!((status, got["tenantId"].as_str()), (200, Some(a.as_str())), "{got}");

    // Under B's own quota: none set is a limit of 0; the root tenant's administrators set it.
    let (status, refused) = server.call_as(&b_key, "reservations.create", ask(1, 60), None).await;
    assert_eq!((status, refused["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "{refused}");
    let (status, quota) = server.call("quotas.set", json!({ "tenantId": b, "poolId": pool, "gpus": 4 })).await;
    assert_eq!(status, 200, "{quota}");
    let (status, b_active) = server.call_as(&b_key, "reservations.create", ask(3, 8), Some("b-first")).await;
    assert_eq!((status, b_active["state"].as_str()), (200, Some("active")), "{b_active}");
    assert_eq!((b_active["tenantId"].as_str(), b_active["holderTenantId"].as_str()), (Some(a.as_str()), Some(b.as_str())));
    let b_id = b_active["reservationId"].as_str().unwrap().to_owned();
    // The same key again answers the same reservation, and charges nothing more.
    let (_, replayed) = server.call_as(&b_key, "reservations.create", ask(3, 8), Some("b-first")).await;
    assert_eq!((replayed["reservationId"].as_str(), replayed["replayed"].as_bool()), (Some(b_id.as_str()), Some(true)));
    let (status, over) = server.call_as(&b_key, "reservations.create", ask(2, 60), None).await;
    assert_eq!((status, over["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "3 + 2 is past B's 4: {over}");
    let (_, b_quota) = server.call_as(&b_key, "quotas.get", json!({ "poolId": pool }), None).await;
    assert_eq!((b_quota["gpus"].as_u64(), b_quota["inUse"].as_u64()), (Some(4), Some(3)), "{b_quota}");
    let (_, a_quota) = server.call_as(&a_key, "quotas.get", json!({ "poolId": pool }), None).await;
    assert_eq!(a_quota["inUse"].as_u64(), Some(0), "B's GPUs are not the owner's: {a_quota}");

    // Shared capacity: the owner cannot have the GPUs B holds.
    let (_, a_six) = server.call_as(&a_key, "reservations.create", ask(6, 600), None).await;
    assert_eq!(a_six["state"], "queued", "5 are free: {a_six}");
    let (_, cancelled) =
        server.call_as(&a_key, "reservations.release", json!({ "reservationId": a_six["reservationId"] }), None).await;
    assert_eq!(cancelled["state"], "cancelled");
    let (_, a_five) = server.call_as(&a_key, "reservations.create", ask(5, 600), None).await;
    assert_eq!(a_five["state"], "active", "{a_five}");
    assert!(gpus(&a_five).is_disjoint(&gpus(&b_active)), "{a_five} {b_active}");
    // Nothing is free now: B's next one (within its quota) queues.
    let (_, b_queued) = server.call_as(&b_key, "reservations.create", ask(1, 60), None).await;
    assert_eq!(b_queued["state"], "queued", "{b_queued}");
    // B lists its reservations (queued, active), though they live on the owner's chain; the
    // owner lists them too, as its chain's.
    let (_, b_list) = server.call_as(&b_key, "reservations.list", json!({}), None).await;
    let ids: BTreeSet<&str> = b_list["items"].as_array().unwrap().iter().map(|r| r["reservationId"].as_str().unwrap()).collect();
    assert_eq!(ids, BTreeSet::from([b_id.as_str(), b_queued["reservationId"].as_str().unwrap()]), "{b_list}");
    let (_, b_queue) = server.call_as(&b_key, "reservations.list", json!({ "state": "queued" }), None).await;
    assert_eq!(b_queue["items"][0]["queuePosition"], 1, "{b_queue}");
    let (_, a_list) = server.call_as(&a_key, "reservations.list", json!({ "state": "active" }), None).await;
    assert_eq!(a_list["items"].as_array().unwrap().len(), 2, "{a_list}");
    // B reads its reservation by id, though it lives on the owner's chain.
    let (status, b_read) = server.call_as(&b_key, "reservations.get", json!({ "reservationId": b_id }), None).await;
    assert_eq!((status, b_read["state"].as_str()), (200, Some("active")), "{b_read}");

    // The owner starts no instance on the GPUs it holds for B (charged to B's quota).
    let flavor = json!({ "tenantId": a, "poolId": pool, "name": "g3", "vcpus": 4, "memoryMiB": 4096, "diskGiB": 20, "gpus": 3 });
    let (status, flavor) = server.call("flavors.create", flavor).await;
    assert_eq!(status, 200, "{flavor}");
    let image = json!({ "tenantId": a, "name": "u", "url": "https://images.example/u.qcow2", "sha256": "ab".repeat(32), "diskFormat": "qcow2" });
    let (status, image) = server.call("images.register", image).await;
    assert_eq!(status, 200, "{image}");
    let vm = json!({ "tenantId": a, "name": "vm", "reservationId": b_id, "flavorId": flavor["flavorId"], "imageId": image["imageId"] });
    let (status, refused) = server.call("instances.create", vm).await;
    assert_eq!((status, refused["code"].as_str()), (409, Some("INVALID_STATE")), "{refused}");
    assert!(refused["message"].as_str().unwrap().contains(&format!("held for tenant {b}")), "{refused}");

    // Withdrawn: B's active reservation runs on, its queued one is cancelled, a new one refused.
    let (code, out, err) = cli_as(&server, &a_key, &["pools", "unoffer", &pool, "--tenant-id", &b]);
    assert_eq!(code, 0, "{err}");
    assert!(bc_tests::json(&out).get("offeredTo").is_none(), "{out}");
    let (_, b_read) = server.call_as(&b_key, "reservations.get", json!({ "reservationId": b_id }), None).await;
    assert_eq!(b_read["state"], "active", "{b_read}");
    let (_, gone) = server.call_as(&b_key, "reservations.get", json!({ "reservationId": b_queued["reservationId"] }), None).await;
    assert_eq!(gone["state"], "cancelled", "{gone}");
    assert!(gone["lastError"].as_str().unwrap().contains("no longer offered"), "{gone}");
    let (status, refused) = server.call_as(&b_key, "reservations.create", ask(1, 60), None).await;
    assert_eq!((status, refused["code"].as_str()), (404, Some("NOT_FOUND")), "{refused}");
    let (_, listed) = server.call_as(&b_key, "pools.list", json!({}), None).await;
    assert_eq!(listed["items"], json!([]), "{listed}");
    // Nor is it extended, by B or by the owner: it runs to its end.
    for key in [&b_key, &a_key] {
        let (status, refused) =
            server.call_as(key, "reservations.extend", json!({ "reservationId": b_id, "byS": 60 }), None).await;
        assert_eq!((status, refused["code"].as_str()), (409, Some("INVALID_STATE")), "{refused}");
        assert!(refused["message"].as_str().unwrap().contains("no longer offered"), "{refused}");
    }
    // B's active one ends at its end, as any reservation does.
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, r) = server.call_as(&b_key, "reservations.get", json!({ "reservationId": b_id }), None).await;
        if r["state"] == "expired" {
            assert!(r["endedAtMs"].as_u64() >= r["endsAtMs"].as_u64(), "{r}");
            break;
        }
        assert!(Instant::now() < deadline, "B's reservation never expired: {r}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A fleet with an offer exports it, plans empty against its export, and an edited document
/// offers and withdraws through one apply: each offered tenant's part on its own chain, in the
/// apply's one transaction.
#[tokio::test]
async fn a_fleet_document_exports_plans_and_applies_a_pools_offers() {
    let server = Server::dev();
    let (a, b, c) = (server.tenant("acme").await, server.tenant("bravo").await, server.tenant("charlie").await);
    let pool = server.tenant_pool(&a, "shared").await;
    let (status, offered) = server.call("pools.offer", json!({ "tenantId": a, "poolId": pool, "tenantIds": [b] })).await;
    assert_eq!(status, 200, "{offered}");
    let (status, export) = server.call("fleet.export", json!({ "tenantId": a })).await;
    assert_eq!(status, 200, "{export}");
    let mut document = export["document"].clone();
    assert_eq!(document["pools"][&pool]["offeredTo"], json!([b]), "{export}");
    let (_, plan) = server.call("fleet.plan", json!({ "tenantId": a, "document": document })).await;
    assert_eq!(plan["empty"], true, "an export plans empty: {plan}");

    // Withdraw B, offer C: one change, applied by its hash.
    document["pools"][&pool]["offeredTo"] = json!([c]);
    let (_, plan) = server.call("fleet.plan", json!({ "tenantId": a, "document": document })).await;
    let changes = plan["changes"].as_array().unwrap();
    assert_eq!(changes.len(), 1, "{plan}");
    let (status, applied) =
        server.call("fleet.apply", json!({ "tenantId": a, "document": document, "planHash": plan["planHash"] })).await;
    assert_eq!((status, applied["applied"].as_bool()), (200, Some(true)), "{applied}");
    let (_, got) = server.call("pools.get", json!({ "tenantId": a, "poolId": pool })).await;
    assert_eq!(got["offeredTo"], json!([c]), "{got}");
    let (_, b_pools) = server.call("pools.list", json!({ "tenantId": b })).await;
    assert_eq!(b_pools["items"], json!([]), "{b_pools}");
    let (_, c_pools) = server.call("pools.list", json!({ "tenantId": c })).await;
    assert_eq!(c_pools["items"][0]["poolId"].as_str(), Some(pool.as_str()), "{c_pools}");
    let (_, plan) = server.call("fleet.plan", json!({ "tenantId": a, "document": document })).await;
    assert_eq!(plan["empty"], true, "applied, the document plans empty: {plan}");

    // An offer made by hand is drift, named by the pool's key; withdrawn again, none.
    let (_, status) = server.call("fleet.status", json!({ "tenantId": a })).await;
    assert_eq!(status["drift"], json!([]), "{status}");
    let (code, _) = server.call("pools.offer", json!({ "tenantId": a, "poolId": pool, "tenantIds": [b] })).await;
    assert_eq!(code, 200);
    let (_, status) = server.call("fleet.status", json!({ "tenantId": a })).await;
    let offer_drift = json!([{ "kind": "offer", "key": pool, "id": pool, "what": "changed" }]);
    assert_eq!(status["drift"], offer_drift, "{status}");
    let (code, _) = server.call("pools.unoffer", json!({ "tenantId": a, "poolId": pool, "tenantIds": [b] })).await;
    assert_eq!(code, 200);
    let (_, status) = server.call("fleet.status", json!({ "tenantId": a })).await;
    assert_eq!(status["drift"], json!([]), "{status}");

    // An unknown tenant in the document: nothing applies.
    document["pools"][&pool]["offeredTo"] = json!(["ten_01kb0000000000000000000zzz"]);
    let (_, plan) = server.call("fleet.plan", json!({ "tenantId": a, "document": document })).await;
    let (status, refused) =
        server.call("fleet.apply", json!({ "tenantId": a, "document": document, "planHash": plan["planHash"] })).await;
    assert_eq!((status, refused["code"].as_str()), (404, Some("NOT_FOUND")), "{refused}");
    let (_, got) = server.call("pools.get", json!({ "tenantId": a, "poolId": pool })).await;
    assert_eq!(got["offeredTo"], json!([c]), "{got}");
}

/// Usage of a reservation held for B in A's pool is B's: B's `usage.list` shows its rows (each
/// naming A, whose chain holds them), adding up to what it held; A's shows its own reservation's
/// and none of B's.
#[tokio::test]
async fn usage_of_a_held_reservation_is_the_holders_not_the_owners() {
    let server = Server::dev_with(&["--usage-window", "2s"]);
    let (a, b) = (server.tenant("acme").await, server.tenant("bravo").await);
    let b_key = key(&server, &b, &["compute:pools:read", "compute:reservations:*", "compute:usage:read"]).await;
    let pool = server.tenant_pool(&a, "shared").await;
    let eight = vec![json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }); 8];
    let (status, node) =
        server.call("nodes.register", json!({ "tenantId": a, "poolId": pool, "name": "n0", "gpus": eight })).await;
    assert_eq!(status, 200, "{node}");
    let (status, _) = server.call("pools.offer", json!({ "tenantId": a, "poolId": pool, "tenantIds": [b] })).await;
    assert_eq!(status, 200);
    let (status, _) = server.call("quotas.set", json!({ "tenantId": b, "poolId": pool, "gpus": 4 })).await;
    assert_eq!(status, 200);
    let ask = |gpus: u32| json!({ "poolId": pool, "gpus": gpus, "durationS": 3 });
    let (status, held) = server.call_as(&b_key, "reservations.create", ask(2), None).await;
    assert_eq!((status, held["state"].as_str()), (200, Some("active")), "{held}");
    let (status, own) =
        server.call("reservations.create", json!({ "tenantId": a, "poolId": pool, "gpus": 1, "durationS": 3 })).await;
    assert_eq!((status, own["state"].as_str()), (200, Some("active")), "{own}");
    let (held_id, own_id) = (held["reservationId"].as_str().unwrap(), own["reservationId"].as_str().unwrap());

    let list = |tenant: &str| json!({ "tenantId": tenant, "fromMs": 0, "toMs": 9_007_199_254_740_991u64 });
    // What each held, once ended (both on A's chain).
    let mut spans = Vec::new();
    for id in [held_id, own_id] {
        let deadline = Instant::now() + WAIT;
        let r = loop {
            let (_, r) = server.call("reservations.get", json!({ "tenantId": a, "reservationId": id })).await;
            if r["endedAtMs"].is_u64() {
                break r;
            }
            assert!(Instant::now() < deadline, "{id} never ended: {r}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let end = r["endedAtMs"].as_u64().unwrap().min(r["endsAtMs"].as_u64().unwrap());
        spans.push((end - r["activatedAtMs"].as_u64().unwrap()) as i64 * r["gpus"].as_i64().unwrap());
    }
    let counted = |rows: &Value, id: &str| -> i64 {
        rows["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["reservationId"] == id)
            .map(|r| r["quantityMs"].as_i64().unwrap())
            .sum()
    };
    let deadline = Instant::now() + WAIT;
    let (b_rows, a_rows) = loop {
        let (_, b_rows) = server.call("usage.list", list(&b)).await;
        let (_, a_rows) = server.call("usage.list", list(&a)).await;
        if counted(&b_rows, held_id) == spans[0] && counted(&a_rows, own_id) == spans[1] {
            break (b_rows, a_rows);
        }
        assert!(Instant::now() < deadline, "usage never added up: B {b_rows} A {a_rows}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let b_items = b_rows["items"].as_array().unwrap();
    assert!(
        !b_items.is_empty() && b_items.iter().all(|r| r["reservationId"] == held_id && r["ownerTenantId"] == a.as_str()),
        "{b_rows}"
    );
    let a_items = a_rows["items"].as_array().unwrap();
    assert!(a_items.iter().all(|r| r["reservationId"] == own_id && r.get("ownerTenantId").is_none()), "{a_rows}");
    // B's own key reads the same, and sums it by reservation.
    let (_, summed) = server
        .call_as(&b_key, "usage.list", json!({ "fromMs": 0, "toMs": 9_007_199_254_740_991u64, "groupBy": ["reservation"] }), None)
        .await;
    assert_eq!(
        summed["groups"],
        json!([{ "reservationId": held_id, "resourceKind": "gpu", "quantityMs": spans[0], "costs": [{ "currency": "", "costMicros": 0 }], "rows": b_items.len() }]),
        "{summed}"
    );
}

/// Regression: a reservation held for B whose hold failed after its pool was withdrawn from B
/// was requeued like any other and could be placed again. Now it fails at once, with the node's
/// reason and why it is not requeued. (The node's agent is away while B reserves and the pool
/// is withdrawn, so the hold fails only after the withdrawal.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_reservation_whose_hold_fails_after_the_unoffer_fails_instead_of_requeueing() {
    let (server, port) = bc_tests::agents_gateway();
    let b = server.tenant("bravo").await;
    let b_key = key(&server, &b, &["compute:pools:read", "compute:reservations:*"]).await;
    let pool = server.pool("lent").await;
    let (status, _) = server.call("pools.offer", json!({ "poolId": pool, "tenantIds": [b] })).await;
    assert_eq!(status, 200);
    let (status, _) = server.call("quotas.set", json!({ "tenantId": b, "poolId": pool, "gpus": 1 })).await;
    assert_eq!(status, 200);
    let seed = (1..100u64)
        .find(|s| !bc_tests::fake_hardware(*s)["gpus"]["gpus"].as_array().unwrap().is_empty())
        .expect("a fake machine with a GPU");
    let mut machine = bc_tests::AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    let reason = "gpu-in-use: the fake machine refuses every hold";
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = {seed}\nfake_hold_refusal = {reason:?}\n"))
        .unwrap();
    let (status, token) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    assert_eq!(status, 200, "{token}");
    assert_eq!(machine.join_stdin(token["token"].as_str().unwrap()).0, 0);
    let node = machine.node_id();
    machine.start();
    let deadline = Instant::now() + WAIT;
    while server.call("nodes.get", json!({ "nodeId": node })).await.1["state"] != "ready" {
        assert!(Instant::now() < deadline, "node {node} never ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Away: B's reservation is placed, its hold waits for the node; then the pool is withdrawn.
    assert_eq!(machine.stop(), 0);
    let (status, held) =
        server.call_as(&b_key, "reservations.create", json!({ "poolId": pool, "gpus": 1, "durationS": 600 }), None).await;
    assert_eq!((status, held["state"].as_str()), (200, Some("active")), "{held}");
    let id = held["reservationId"].as_str().unwrap();
    let (status, _) = server.call("pools.unoffer", json!({ "poolId": pool, "tenantIds": [b] })).await;
    assert_eq!(status, 200);
    machine.start();
    let deadline = Instant::now() + WAIT;
    let failed = loop {
        let (_, r) = server.call("reservations.get", json!({ "reservationId": id })).await;
        if r["state"] != "active" {
            break r;
        }
        assert!(Instant::now() < deadline, "never ended: {r}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let why = format!("{reason}; not requeued: pool {pool} is no longer offered to tenant {b}");
    assert_eq!((failed["state"].as_str(), failed["lastError"].as_str()), (Some("failed"), Some(why.as_str())), "{failed}");
    assert_eq!(failed["holdAttempts"], 1, "its first failure is its last: {failed}");
    assert_eq!(machine.stop(), 0);
}
