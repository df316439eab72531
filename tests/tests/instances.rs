//! Instances end to end: a real `better-compute dev`, a real `bcd node` on a
//! seeded fake machine whose hypervisor is libvirt's `test:///default` driver (the `libvirt`
//! feature), and an image served over HTTP from loopback. An instance is created on a bound
//! reservation through the CLI, then stopped, started, resized and deleted through the API;
//! `instances get` shows each state as libvirt reports it. An image whose bytes do not match
//! its digest fails the instance after the named number of applies, with the node's reason; a
//! released reservation takes its instance with it.

use std::time::Duration;

use bc_tests::{AgentNode, ImageServer, Server, json};
use serde_json::{Value, json};
use sha2::Digest;

async fn call_ok(server: &Server, method: &str, body: Value) -> Value {
    let (status, doc) = server.call(method, body).await;
    assert_eq!(status, 200, "{method}: {doc}");
    doc
}

/// Polls `instances.get` until `done` says yes.
async fn wait_instance(server: &Server, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let doc = call_ok(server, "instances.get", json!({ "instanceId": id })).await;
        if done(&doc) {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "instance {id}: not {what} after 60 s: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_reservation(server: &Server, id: &str, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let doc = call_ok(server, "reservations.get", json!({ "reservationId": id })).await;
        if done(&doc) {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "reservation {id}: not {what} after 30 s: {doc}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn settled_in(state: &'static str) -> impl Fn(&Value) -> bool {
    move |doc| doc["state"] == state
}

/// A reservation of `gpus` in `pool`, waited on until its GPUs are bound.
async fn bound_reservation(server: &Server, pool: &str, gpus: u32) -> String {
    let rsv = call_ok(server, "reservations.create", json!({ "poolId": pool, "gpus": gpus, "durationS": 3600 })).await;
    let id = rsv["reservationId"].as_str().unwrap().to_owned();
    wait_reservation(server, &id, "bound", |r| r["binding"]["state"] == "bound").await;
    id
}

/// A `dev` with a `bcd node` joined on a seeded fake machine whose hypervisor is libvirt's
/// `test:///default`, ready and advertising `instance.apply`, and a 1.5 MB qcow2 image
/// registered from a loopback server: (server, pool, machine, node, image, its server).
async fn libvirt_node() -> (Server, String, AgentNode, String, Value, ImageServer) {
    let (server, port) = bc_tests::agents_gateway();
    let seed = bc_tests::fake_seed_with(2);
    let pool = server.pool("vms").await;
    let mut machine = AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(
        machine.config(),
        format!("{config}\n[hardware]\nfake_seed = {seed}\n\n[hypervisor]\nuri = \"test:///default\"\n"),
    )
    .unwrap();
    let (status, token) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    assert_eq!(status, 200, "{token}");
    let (code, _, err) = machine.join_stdin(token["token"].as_str().unwrap());
    assert_eq!(code, 0, "join: {err}");
    let node = machine.node_id();
    machine.start();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let doc = call_ok(&server, "nodes.get", json!({ "nodeId": node })).await;
        let caps = doc["agent"]["inventory"]["capabilities"].as_array().cloned().unwrap_or_default();
        if doc["state"] == "ready" && caps.iter().any(|c| c == "instance.apply") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "node not ready with instance.apply: {doc}\n{}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let bytes = bc_tests::qcow2_image(1_500_000);
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let images = ImageServer::start("ubuntu.qcow2", bytes);
    let image = call_ok(
        &server,
        "images.register",
        json!({ "name": "ubuntu", "url": images.url, "sha256": digest, "diskFormat": "qcow2", "sizeBytes": 1_500_000 }),
    )
    .await;
    (server, pool, machine, node, image, images)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_lives_through_the_api_on_libvirt_and_reports_each_state_as_libvirt_does() {
    // Ready, and its inventory says it runs instances.
    let (server, pool, mut machine, _node, image, images) = libvirt_node().await;
    let digest = image["sha256"].as_str().unwrap().to_owned();
    let small = call_ok(
        &server,
        "flavors.create",
        json!({ "poolId": pool, "name": "small", "vcpus": 2, "memoryMiB": 1024, "diskGiB": 10, "gpus": 2 }),
    )
    .await;
    let large = call_ok(
        &server,
        "flavors.create",
        json!({ "poolId": pool, "name": "large", "vcpus": 4, "memoryMiB": 2048, "diskGiB": 10, "gpus": 2 }),
    )
    .await;
    let rsv = bound_reservation(&server, &pool, 2).await;

    // Created through the CLI, which waits until the node observes it running.
    let (code, out, err) = server.cli(&[
        "instances",
        "create",
        "--name",
        "vm1",
        "--reservation",
        &rsv,
        "--flavor",
        small["flavorId"].as_str().unwrap(),
        "--image",
        image["imageId"].as_str().unwrap(),
        "--wait",
        "60",
    ]);
    assert_eq!(code, 0, "instances create: {err}\n{}", machine.node_log());
    let created = json(&out);
    let id = created["instanceId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("inst_"), "{created}");
    assert_eq!(created["state"], "running", "{created}");
    assert_eq!(created["observed"]["state"], "running", "as libvirt reports it: {created}");
    assert_eq!((created["observed"]["vcpus"].as_u64(), created["observed"]["memoryMiB"].as_u64()), (Some(2), Some(1024)));
    assert_eq!(created["gpus"].as_array().unwrap().len(), 2, "the reservation's GPUs, passed through: {created}");
    assert_eq!(images.served(), 1, "the node fetched the image once");
    let cached = machine.data().join("images").join(&digest);
    assert_eq!(std::fs::metadata(&cached).map(|m| m.len()).ok(), Some(1_500_000), "cached by digest");
    let rsv_doc = call_ok(&server, "reservations.get", json!({ "reservationId": rsv })).await;
    assert_eq!(rsv_doc["instanceId"], id.as_str(), "the reservation names its instance: {rsv_doc}");
    // One instance per reservation.
    let (status, taken) = server
        .call(
            "instances.create",
            json!({ "name": "vm2", "reservationId": rsv, "flavorId": small["flavorId"], "imageId": image["imageId"] }),
        )
        .await;
    assert_eq!((status, taken["code"].as_str()), (409, Some("CONFLICT")), "{taken}");

    // Stopped, started, resized: each state as libvirt reports it.
    call_ok(&server, "instances.stop", json!({ "instanceId": id })).await;
    let stopped = wait_instance(&server, &id, "stopped", settled_in("stopped")).await;
    assert_eq!((stopped["observed"]["state"].as_str(), stopped["generation"].as_u64()), (Some("stopped"), Some(2)));
    call_ok(&server, "instances.start", json!({ "instanceId": id })).await;
    wait_instance(&server, &id, "running again", settled_in("running")).await;
    let resized = call_ok(&server, "instances.resize", json!({ "instanceId": id, "flavorId": large["flavorId"] })).await;
    assert_eq!((resized["vcpus"].as_u64(), resized["state"].as_str()), (Some(4), Some("pending")), "{resized}");
    let resized = wait_instance(&server, &id, "resized", settled_in("running")).await;
    assert_eq!((resized["observed"]["vcpus"].as_u64(), resized["observed"]["memoryMiB"].as_u64()), (Some(4), Some(2048)));
    assert_eq!(images.served(), 1, "the cached image is used again");

    // Deleted: gone from libvirt, the instance finished, the reservation free for another.
    call_ok(&server, "instances.delete", json!({ "instanceId": id })).await;
    let deleted = wait_instance(&server, &id, "deleted", settled_in("deleted")).await;
    assert_eq!(deleted["observed"]["state"], "absent", "{deleted}");
    let rsv_doc = call_ok(&server, "reservations.get", json!({ "reservationId": rsv })).await;
    assert!(rsv_doc["instanceId"].is_null(), "detached: {rsv_doc}");
    let (status, again) = server.call("instances.start", json!({ "instanceId": id })).await;
    assert_eq!((status, again["code"].as_str()), (409, Some("CONFLICT")), "a deleted instance takes no request: {again}");
    let events: Vec<String> = call_ok(&server, "events.list", json!({ "types": ["instance.*"], "limit": 500 })).await["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["stream"] == format!("instance/{id}"))
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    for expected in [
        "instance.created",
        "instance.observed",
        "instance.stop_requested",
        "instance.start_requested",
        "instance.resize_requested",
        "instance.delete_requested",
        "instance.deleted",
    ] {
        assert!(events.iter().any(|e| e == expected), "{expected} in the instance's history: {events:?}");
    }

    // An image whose bytes are not its digest: every apply fails with the node's reason, and
    // after the last the instance is failed.
    let bad = call_ok(
        &server,
        "images.register",
        json!({ "name": "tampered", "url": images.url, "sha256": "0".repeat(64), "diskFormat": "qcow2" }),
    )
    .await;
    let doomed = call_ok(
        &server,
        "instances.create",
        json!({ "name": "doomed", "reservationId": rsv, "flavorId": small["flavorId"], "imageId": bad["imageId"] }),
    )
    .await;
    let doomed_id = doomed["instanceId"].as_str().unwrap().to_owned();
    let failed = wait_instance(&server, &doomed_id, "failed", settled_in("failed")).await;
    assert!(failed["lastError"].as_str().unwrap().starts_with("image-digest"), "{failed}");
    assert_eq!(failed["applyAttempts"], bc_projections::INSTANCE_APPLY_ATTEMPTS_MAX, "{failed}");
    assert!(!machine.data().join("images").join("0".repeat(64)).exists(), "nothing kept of a bad image");
    call_ok(&server, "instances.delete", json!({ "instanceId": doomed_id })).await;
    wait_instance(&server, &doomed_id, "deleted", settled_in("deleted")).await;

    // A released reservation takes its running instance with it.
    let last = call_ok(
        &server,
        "instances.create",
        json!({ "name": "last", "reservationId": rsv, "flavorId": small["flavorId"], "imageId": image["imageId"] }),
    )
    .await;
    let last_id = last["instanceId"].as_str().unwrap().to_owned();
    wait_instance(&server, &last_id, "running", settled_in("running")).await;
    call_ok(&server, "reservations.release", json!({ "reservationId": rsv })).await;
    let gone = wait_instance(&server, &last_id, "deleted with its reservation", settled_in("deleted")).await;
    assert!(gone["lastError"].as_str().unwrap_or_default().starts_with("reservation-ended"), "{gone}");
    wait_reservation(&server, &rsv, "released on the node", |r| r["binding"]["state"] == "released").await;
    assert_eq!(machine.stop(), 0);
}

/// Desired and observed state are reconciled, not ignored: on a fake machine whose hypervisor
/// crashes a running domain behind the agent's back (`fake_domain_crash_after`), the node
/// reports the crash by itself, the instance turns `drifted`, and the `instances` reconciler
/// applies it again until the node observes it running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_that_crashes_behind_the_agents_back_is_started_again_by_the_reconciler() {
    let (server, port) = bc_tests::agents_gateway();
    let seed = bc_tests::fake_seed_with(1);
    let pool = server.pool("drift").await;
    let mut machine = AgentNode::new(&server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = {seed}\nfake_domain_crash_after = 8\n")).unwrap();
    let (status, token) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    assert_eq!(status, 200, "{token}");
    assert_eq!(machine.join_stdin(token["token"].as_str().unwrap()).0, 0);
    machine.start();
    let bytes = vec![7u8; 4096];
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let images = ImageServer::start("tiny.raw", bytes);
    let image =
        call_ok(&server, "images.register", json!({ "name": "tiny", "url": images.url, "sha256": digest, "diskFormat": "raw" }))
            .await;
    let flavor = call_ok(
        &server,
        "flavors.create",
        json!({ "poolId": pool, "name": "one", "vcpus": 1, "memoryMiB": 512, "diskGiB": 1, "gpus": 1 }),
    )
    .await;
    let rsv = bound_reservation(&server, &pool, 1).await;
    let created = call_ok(
        &server,
        "instances.create",
        json!({ "name": "flaky", "reservationId": rsv, "flavorId": flavor["flavorId"], "imageId": image["imageId"] }),
    )
    .await;
    let id = created["instanceId"].as_str().unwrap().to_owned();
    wait_instance(&server, &id, "running", settled_in("running")).await;
    let drifted = wait_instance(&server, &id, "seen crashed", |d| d["observed"]["state"] == "crashed").await;
    assert!(matches!(drifted["state"].as_str(), Some("drifted" | "pending")), "{drifted}");
    let history = |events: &Value| -> Vec<Value> {
        events["items"].as_array().unwrap().iter().filter(|e| e["stream"] == format!("instance/{id}")).cloned().collect()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let reapplied = loop {
        let events = call_ok(&server, "events.list", json!({ "types": ["instance.*"], "limit": 500 })).await;
        let found = history(&events).into_iter().find(|e| e["type"] == "instance.reapplied");
        if let Some(found) = found {
            break found;
        }
        assert!(std::time::Instant::now() < deadline, "never applied again: {:?}", history(&events));
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let reason = reapplied["payload"]["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("drift: node") && reason.contains("crashed, desired running"), "{reapplied}");
    let revived = wait_instance(&server, &id, "running again", |d| {
        d["state"] == "running" && d["updatedAtMs"].as_u64() > drifted["updatedAtMs"].as_u64()
    })
    .await;
    assert_eq!(revived["observed"]["state"], "running", "{revived}");
    call_ok(&server, "instances.delete", json!({ "instanceId": id })).await;
    wait_instance(&server, &id, "deleted", settled_in("deleted")).await;
    assert_eq!(machine.stop(), 0);
}

/// The instance and quota events of the log (what an instance's create or resize appends; the
/// node's own reports are left out, as they come when they come).
async fn decided_events(server: &Server) -> usize {
    let types = ["instance.created", "instance.resize_requested", "quota.counted", "quota.set"];
    let page = call_ok(server, "events.list", json!({ "types": types, "limit": 500 })).await;
    page["items"].as_array().unwrap().len()
}

/// The `quota.resource_exceeded` records in the log, oldest first.
async fn refusal_records(server: &Server) -> Vec<Value> {
    let page = call_ok(server, "events.list", json!({ "types": ["quota.resource_exceeded"], "limit": 10 })).await;
    page["items"].as_array().unwrap().clone()
}

/// Quotas per resource (issue 56): `quotas set` with instance, vCPU and memory limits beside
/// GPUs; an instance past the instances limit and a resize past the vCPUs limit are refused
/// `QUOTA_EXCEEDED` naming the resource, its limit and its use, appending nothing but the
/// refusal's record (`quota.resource_exceeded`, naming the limit and who asked); `quotas get`
/// shows each limit and its use; the fleet document carries the limits (export, plan `~ quota`,
/// apply), and the raised limit lets the resize through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_and_resizes_past_a_resource_quota_are_refused_naming_it() {
    let (server, pool, mut machine, _node, image, _images) = libvirt_node().await;
    let flavor = |name: &str, vcpus: u32, memory_mib: u32| json!({ "poolId": pool, "name": name, "vcpus": vcpus, "memoryMiB": memory_mib, "diskGiB": 10, "gpus": 1 });
    let small = call_ok(&server, "flavors.create", flavor("small", 2, 1024)).await;
    let tiny = call_ok(&server, "flavors.create", flavor("tiny", 1, 512)).await;
    let large = call_ok(&server, "flavors.create", flavor("large", 4, 2048)).await;

    // Limits: bounded at the edge, set beside the GPUs, shown with their use.
    let (status, body) = server.call("quotas.set", json!({ "poolId": pool, "gpus": 2, "vcpus": 200_000_000i64 })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{body}");
    let (code, _, err) = server.cli(&["quotas", "set", "--pool", &pool, "--gpus", "2", "--instances", "-1"]);
    assert_eq!(code, 2, "a negative limit is a usage error: {err}");
    let (code, out, err) = server.cli(&[
        "quotas",
        "set",
        "--pool",
        &pool,
        "--gpus",
        "2",
        "--instances",
        "1",
        "--vcpus",
        "3",
        "--memory-mib",
        "4096",
    ]);
    assert_eq!(code, 0, "quotas set: {err}");
    let quota = json(&out);
    assert_eq!(
        (&quota["gpus"], &quota["instances"], &quota["vcpus"], &quota["memoryMiB"], &quota["sandboxes"]),
        (&json!(2), &json!(1), &json!(3), &json!(4096), &Value::Null),
        "{quota}"
    );
    assert_eq!(quota["resourcesInUse"], json!({ "instances": 0, "vcpus": 0, "memoryMiB": 0, "sandboxes": 0 }));

    let a_rsv = bound_reservation(&server, &pool, 1).await;
    let b_rsv = bound_reservation(&server, &pool, 1).await;
    let vm = |name: &str, rsv: &str, flavor: &Value| json!({ "name": name, "reservationId": rsv, "flavorId": flavor["flavorId"], "imageId": image["imageId"] });
    let a = call_ok(&server, "instances.create", vm("a", &a_rsv, &small)).await;
    let a_id = a["instanceId"].as_str().unwrap().to_owned();

    // A second instance passes the instances limit: refused, named, nothing appended.
    let before = decided_events(&server).await;
    let (status, refused) = server.call("instances.create", vm("b", &b_rsv, &tiny)).await;
    assert_eq!((status, refused["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "{refused}");
    let message = refused["message"].as_str().unwrap();
    assert!(message.contains("quota of 1 instances") && message.contains("in use: 1") && message.contains(&pool), "{message}");
    assert_eq!(decided_events(&server).await, before, "a refusal appends nothing but its record");
    let records = refusal_records(&server).await;
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert_eq!(record["stream"], format!("quota/{pool}"), "{record}");
    let payload = &record["payload"];
    assert_eq!(
        (&payload["resource"], &payload["requested"], &payload["inUse"], &payload["limit"]),
        (&json!("instances"), &json!(1), &json!(1), &json!(1)),
        "{record}"
    );
    assert!(payload["subject"].as_str().unwrap().starts_with("inst_") && payload["actor"].is_string(), "{record}");

    // A resize past the vCPUs limit: refused, named.
    wait_instance(&server, &a_id, "running", settled_in("running")).await;
    let (status, refused) = server.call("instances.resize", json!({ "instanceId": a_id, "flavorId": large["flavorId"] })).await;
    assert_eq!((status, refused["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "{refused}");
    let message = refused["message"].as_str().unwrap();
    assert!(message.contains("quota of 3 vCPUs") && message.contains("in use: 2"), "{message}");
    let records = refusal_records(&server).await;
    assert_eq!(records.len(), 2, "{records:?}");
    assert_eq!(
        (&records[1]["payload"]["resource"], &records[1]["payload"]["subject"]),
        (&json!("vcpus"), &json!(a_id)),
        "{}",
        records[1]
    );

    // Raised through the CLI, the second instance goes; the use shows both.
    let (code, _, err) = server.cli(&[
        "quotas",
        "set",
        "--pool",
        &pool,
        "--gpus",
        "2",
        "--instances",
        "2",
        "--vcpus",
        "3",
        "--memory-mib",
        "4096",
    ]);
    assert_eq!(code, 0, "{err}");
    // This one names its image by channel (issue 56): refused while the image is in testing,
    // and both forms at once is refused; promoted, `ubuntu@stable` resolves to it, and the
    // instance records the id.
    let by_channel = json!({ "name": "b", "reservationId": b_rsv, "flavorId": tiny["flavorId"], "image": "ubuntu@stable" });
    let (status, refused) = server.call("instances.create", by_channel.clone()).await;
    assert_eq!((status, refused["code"].as_str()), (404, Some("NOT_FOUND")), "{refused}");
    assert!(refused["message"].as_str().unwrap().contains("is in testing"), "{refused}");
    let mut both = by_channel.clone();
    both["imageId"] = image["imageId"].clone();
    let (status, refused) = server.call("instances.create", both).await;
    assert_eq!((status, refused["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{refused}");
    call_ok(&server, "images.promote", json!({ "imageId": image["imageId"] })).await;
    let b = call_ok(&server, "instances.create", by_channel).await;
    assert_eq!(b["image"]["imageId"], image["imageId"], "the resolved id: {b}");
    let (code, out, err) = server.cli(&["quotas", "get", "--pool", &pool]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["resourcesInUse"], json!({ "instances": 2, "vcpus": 3, "memoryMiB": 1536, "sandboxes": 0 }));
    let counted = call_ok(&server, "events.list", json!({ "types": ["quota.counted"], "limit": 10 })).await;
    assert_eq!(counted["items"].as_array().map(Vec::len), Some(2), "one quota.counted per admitted instance: {counted}");

    // The fleet document carries the limits: exported, planned empty, raised by an apply.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("fleet.json");
    let (code, _, err) = server.cli(&["fleet", "export", "--out", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let mut doc: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let exported = &doc["pools"][&pool];
    assert_eq!(
        (&exported["quotaGpus"], &exported["quotaInstances"], &exported["quotaVcpus"], &exported["quotaMemoryMiB"]),
        (&json!(2), &json!(2), &json!(3), &json!(4096)),
        "{doc}"
    );
    assert!(exported.get("quotaSandboxes").is_none(), "an unbounded limit is left out: {exported}");
    let (code, _, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--fail-on-drift"]);
    assert_eq!(code, 0, "the export plans empty: {err}");
    doc["pools"][&pool]["quotaVcpus"] = json!(8);
    std::fs::write(&file, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--calls"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("~ quota") && out.contains("quotas.set"), "{out}");
    let (code, _, err) = server.cli(&["fleet", "apply", file.to_str().unwrap(), "--yes"]);
    assert_eq!(code, 0, "{err}");
    let quota = call_ok(&server, "quotas.get", json!({ "poolId": pool })).await;
    assert_eq!((&quota["vcpus"], &quota["instances"], &quota["memoryMiB"]), (&json!(8), &json!(2), &json!(4096)), "{quota}");
    let resized = call_ok(&server, "instances.resize", json!({ "instanceId": a_id, "flavorId": large["flavorId"] })).await;
    assert_eq!(resized["vcpus"], 4, "{resized}");
    assert_eq!(machine.stop(), 0);
}
