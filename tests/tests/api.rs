//! End-to-end: the real `better-compute dev` over HTTP and through its own CLI.

use base64::Engine;
use bc_tests::Server;
use ed25519_dalek::{Signature, Verifier, VerifyingKey};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

#[tokio::test]
async fn pools_nodes_and_events_round_trip() {
    let server = Server::dev();
    let (status, me) = server.call("system.whoami", json!({})).await;
    assert_eq!(status, 200, "{me}");
    assert_eq!(me["root"], true);

    let pool = server.pool("gpu-a").await;
    let (_, got) = server.call("pools.get", json!({ "poolId": pool })).await;
    assert_eq!(got["name"], "gpu-a");
    assert_eq!(got["version"], 1);

    let (status, updated) =
        server.call("pools.update", json!({ "poolId": pool, "description": "H100 row 4", "ifVersion": 1 })).await;
    assert_eq!(status, 200, "{updated}");
    assert_eq!(updated["version"], 2);
    assert_eq!(updated["description"], "H100 row 4");
    let (status, stale) = server.call("pools.update", json!({ "poolId": pool, "name": "gpu-b", "ifVersion": 1 })).await;
    assert_eq!((status, stale["code"].as_str()), (409, Some("CONFLICT")), "{stale}");

    let gpus: Vec<Value> =
        (0..8).map(|i| json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": i / 4 })).collect();
    let (status, node) = server
        .call("nodes.register", json!({ "poolId": pool, "name": "h100-01", "gpus": gpus, "labels": { "rack": "r4" } }))
        .await;
    assert_eq!(status, 200, "{node}");
    let node_id = node["nodeId"].as_str().unwrap();
    let (_, nodes) = server.call("nodes.list", json!({ "poolId": pool })).await;
    assert_eq!(nodes["items"][0]["nodeId"], node_id);
    assert_eq!(nodes["items"][0]["gpus"].as_array().unwrap().len(), 8);

    let (status, archived) = server.call("pools.archive", json!({ "poolId": pool })).await;
    assert_eq!(status, 200, "{archived}");
    assert_eq!(archived["archived"], true);
    let (_, listed) = server.call("pools.list", json!({})).await;
    assert!(listed["items"].as_array().unwrap().is_empty(), "archived pools are hidden by default");
    let (_, listed) = server.call("pools.list", json!({ "includeArchived": true })).await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);
    let (status, refused) = server.call("nodes.register", json!({ "poolId": pool, "name": "late", "gpus": [] })).await;
    assert_eq!((status, refused["code"].as_str()), (409, Some("INVALID_STATE")), "{refused}");
    assert!(refused["details"]["hint"].as_str().is_some_and(|h| h.contains("pools list")), "{refused}");

    // Cursor paging over events: 2 bootstrap + created, updated, node, archived.
    let mut cursor = Value::Null;
    let mut seqs = Vec::new();
    loop {
        let (status, page) = server.call("events.list", json!({ "limit": 2, "cursor": cursor })).await;
        assert_eq!(status, 200, "{page}");
        seqs.extend(page["items"].as_array().unwrap().iter().map(|e| e["seq"].as_u64().unwrap()));
        cursor = page["nextCursor"].clone();
        if cursor.is_null() {
            break;
        }
    }
    assert_eq!(seqs, [1, 2, 3, 4, 5, 6]);
}

/// Anyone can re-verify one event with a hash function and an Ed25519 library, given the pin.
#[tokio::test]
async fn one_event_verifies_with_independent_libraries() {
    let server = Server::dev();
    let pool = server.pool("verify-me").await;
    let (_, page) = server.call("events.list", json!({})).await;
    let event = page["items"].as_array().unwrap().iter().find(|e| e["type"] == "pool.created").unwrap().clone();
    let (status, full) = server.call("events.get", json!({ "eventId": event["id"] })).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["payload"]["name"], "verify-me");
    assert!(full["stream"].as_str().unwrap().ends_with(&pool));

    let b64 = base64::engine::general_purpose::STANDARD;
    let canonical = b64.decode(full["canonical"].as_str().unwrap()).unwrap();
    let hash: [u8; 32] = Sha256::digest(&canonical).into();
    assert_eq!(hex(&hash), full["hash"].as_str().unwrap(), "hash = SHA-256(canonical bytes)");

    let (code, pki, err) = bc_tests::cli(&["pki", "show", "--data-dir", server.data_dir.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{err}");
    let pki: Value = serde_json::from_str(&pki).unwrap();
    let public: [u8; 32] = b64.decode(pki["publicKey"].as_str().unwrap()).unwrap().try_into().unwrap();
    let pin = format!("sha256/{}", b64.encode(Sha256::digest(public)));
    assert_eq!(pki["pin"], pin, "the pin is SHA-256 of the public key");
    assert_eq!(full["keyId"], pki["keyId"]);
    let key = VerifyingKey::from_bytes(&public).unwrap();
    let sig = Signature::from_slice(&b64.decode(full["sig"].as_str().unwrap()).unwrap()).unwrap();
    let mut message = b"better-compute/event/v1\n".to_vec();
    message.extend_from_slice(&hash);
    key.verify_strict(&message, &sig).expect("signature verifies under the pinned key");
    let mut tampered = message.clone();
    tampered[30] ^= 1;
    assert!(key.verify(&tampered, &sig).is_err());
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn idempotent_creates_over_http() {
    let server = Server::dev();
    let token = server.token.clone();
    let body = json!({ "name": "once", "labels": { "a": "1" } });
    let (s1, first) = server.call_as(&token, "pools.create", body.clone(), Some("k-1")).await;
    let before = server.last_commit().await;
    // Same key, same request (keys reordered): the first result, nothing appended.
    let (s2, again) =
        server.call_as(&token, "pools.create", json!({ "labels": { "a": "1" }, "name": "once" }), Some("k-1")).await;
    assert_eq!((s1, s2), (200, 200));
    assert_eq!(first["poolId"], again["poolId"]);
    assert_eq!(server.last_commit().await, before);
    // Same key, different request.
    let (s3, conflict) = server.call_as(&token, "pools.create", json!({ "name": "twice" }), Some("k-1")).await;
    assert_eq!((s3, conflict["code"].as_str()), (409, Some("IDEMPOTENCY_CONFLICT")), "{conflict}");
    assert_eq!(server.last_commit().await, before);
    let (_, pools) = server.call("pools.list", json!({})).await;
    assert_eq!(pools["items"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn keys_are_bound_to_a_tenant_and_actions() {
    let server = Server::dev();
    let acme = server.tenant("acme").await;
    // The root administrator acts in acme.
    server.tenant_pool(&acme, "acme-a").await;
    let (status, key) = server
        .call(
            "apiKeys.create",
            json!({ "tenantId": acme, "name": "reader", "actions": ["compute:pools:read", "compute:events:read"] }),
        )
        .await;
    assert_eq!(status, 200, "{key}");
    let reader = key["token"].as_str().unwrap().to_owned();
    let (_, keys) = server.call("apiKeys.list", json!({ "tenantId": acme })).await;
    assert!(!keys.to_string().contains("secret"), "key listings never carry secrets: {keys}");

    let (status, me) = server.call_as(&reader, "system.whoami", json!({}), None).await;
    assert_eq!((status, me["tenantId"].as_str()), (200, Some(acme.as_str())));
    let (status, pools) = server.call_as(&reader, "pools.list", json!({}), None).await;
    assert_eq!(status, 200);
    assert_eq!(pools["items"][0]["name"], "acme-a");
    let (status, denied) = server.call_as(&reader, "pools.create", json!({ "name": "nope" }), None).await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")));
    let (status, denied) =
        server.call_as(&reader, "pools.list", json!({ "tenantId": "ten_00000000000000000000000000" }), None).await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")), "a tenant's key cannot read another tenant");
    let (status, denied) = server.call_as(&reader, "tenants.create", json!({ "name": "evil" }), None).await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")));

    // Regression (review): a key could grant more than its creator held.
    let (status, admin) = server
        .call("apiKeys.create", json!({ "tenantId": acme, "name": "keys-only", "actions": ["compute:apikeys:admin"] }))
        .await;
    assert_eq!(status, 200, "{admin}");
    let keys_only = admin["token"].as_str().unwrap().to_owned();
    let (status, denied) =
        server.call_as(&keys_only, "apiKeys.create", json!({ "name": "escalate", "actions": ["*"] }), None).await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")), "{denied}");
    let (status, denied) = server
        .call_as(&keys_only, "apiKeys.create", json!({ "name": "escalate", "actions": ["compute:pools:write"] }), None)
        .await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")), "{denied}");

    // Regression (review): retrying tenants.create with one key created a tenant each time.
    let token = server.token.clone();
    let (_, first) = server.call_as(&token, "tenants.create", json!({ "name": "once" }), Some("tenant-1")).await;
    let (status, again) = server.call_as(&token, "tenants.create", json!({ "name": "once" }), Some("tenant-1")).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(first["tenantId"], again["tenantId"]);

    // apiKeys.update: a key cannot be given more than its changer holds, and nothing is changed.
    let (status, denied) =
        server.call_as(&keys_only, "apiKeys.update", json!({ "keyId": admin["keyId"], "actions": ["*"] }), None).await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")), "{denied}");
    let (status, empty) = server.call("apiKeys.update", json!({ "tenantId": acme, "keyId": key["keyId"] })).await;
    assert_eq!((status, empty["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{empty}");
    // The reader's key now writes pools too, at once, and is renamed; the log says so.
    let (status, updated) = server
        .call(
            "apiKeys.update",
            json!({ "tenantId": acme, "keyId": key["keyId"], "name": "writer", "actions": ["compute:pools:*"] }),
        )
        .await;
    assert_eq!(status, 200, "{updated}");
    assert_eq!((updated["name"].as_str(), updated["actions"].clone()), (Some("writer"), json!(["compute:pools:*"])));
    let (status, made) = server.call_as(&reader, "pools.create", json!({ "name": "now-allowed" }), None).await;
    assert_eq!(status, 200, "{made}");
    // What the key already is changes nothing: answered as it is, no event.
    let (status, same) =
        server.call("apiKeys.update", json!({ "tenantId": acme, "keyId": key["keyId"], "name": "writer" })).await;
    assert_eq!((status, &same["version"]), (200, &updated["version"]), "{same}");
    let (status, stale) =
        server.call("apiKeys.update", json!({ "tenantId": acme, "keyId": key["keyId"], "ifVersion": 1, "name": "x" })).await;
    assert_eq!((status, stale["code"].as_str()), (409, Some("CONFLICT")), "{stale}");

    let (status, _) = server.call("apiKeys.revoke", json!({ "tenantId": acme, "keyId": key["keyId"] })).await;
    assert_eq!(status, 200);
    let (status, gone) = server.call_as(&reader, "pools.list", json!({}), None).await;
    assert_eq!((status, gone["code"].as_str()), (401, Some("UNAUTHENTICATED")));
    let (status, revoked) =
        server.call("apiKeys.update", json!({ "tenantId": acme, "keyId": key["keyId"], "name": "back" })).await;
    assert_eq!((status, revoked["code"].as_str()), (409, Some("INVALID_STATE")), "{revoked}");
}

#[tokio::test]
async fn cli_commands_and_exit_statuses() {
    let server = Server::dev();
    let (code, out, err) = server.cli(&["pools", "create", "--name", "cli-pool", "--label", "site=ams", "--key", "pc-1"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("idempotency key: pc-1"));
    let pool: Value = serde_json::from_str(&out).unwrap();
    let pool_id = pool["poolId"].as_str().unwrap();
    // Repeating with the same --key creates nothing new.
    let (code, again, _) = server.cli(&["pools", "create", "--name", "cli-pool", "--label", "site=ams", "--key", "pc-1"]);
    assert_eq!(code, 0);
    assert_eq!(serde_json::from_str::<Value>(&again).unwrap()["poolId"], pool_id);

    let (code, out, err) =
        server.cli(&["nodes", "register", "--pool", pool_id, "--name", "n1", "--gpu", "H100:H100-SXM5-80GB:80:0"]);
    assert_eq!(code, 0, "{err}");
    let node: Value = serde_json::from_str(&out).unwrap();
    let (code, table, _) = server.cli(&["nodes", "list"]);
    assert_eq!(code, 0);
    assert!(table.contains("1× H100-SXM5-80GB (80 GiB)"), "{table}");
    let (code, out, _) = server.cli(&["nodes", "get", node["nodeId"].as_str().unwrap(), "--query", "name"]);
    assert_eq!((code, out.trim()), (0, "n1"));
    let (code, out, _) = server.cli(&["pools", "list", "--format", "compact", "--query", "items[].name"]);
    assert_eq!((code, out.trim()), (0, r#"["cli-pool"]"#));
    let (code, out, _) = server.cli(&["api", "pools.get", &format!("poolId={pool_id}"), "--format", "compact"]);
    assert_eq!(code, 0);
    assert!(out.contains("\"site\":\"ams\""));
    let (code, out, _) = server.cli(&["api", "--list"]);
    assert_eq!(code, 0);
    assert!(out.contains("events.get"));
    let (code, out, _) = server.cli(&["events", "list", "--limit", "2"]);
    assert_eq!(code, 0);
    assert!(out.contains("(more rows: --cursor"), "{out}");

    // Usage mistakes exit 2 before any call; server refusals exit 1 with the code.
    let before = server.last_commit().await;
    let (code, _, err) = server.cli(&["pools", "get", node["nodeId"].as_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.starts_with("INVALID_ARGUMENT: ") && err.contains("not a pool_ id"), "{err}");
    let (code, _, err) = server.cli(&["pool", "list"]);
    assert_eq!(code, 2);
    // clap names every near command ('pools', and since `console`, that one too).
    assert!(err.contains("similar subcommand") && err.contains("'pools'"), "{err}");
    let (code, _, err) = server.cli(&["api", "pools.lst"]);
    assert_eq!(code, 2);
    assert!(err.contains("did you mean pools.list"), "{err}");
    let (code, _, err) = server.cli(&["pools", "get", "pool_00000000000000000000000000"]);
    assert_eq!(code, 1);
    assert!(err.starts_with("NOT_FOUND: "), "{err}");
    let (code, _, err) = bc_tests::cli(&["pools", "list"], &[("BETTER_COMPUTE_URL", &server.url)]);
    assert_eq!(code, 1);
    assert!(err.starts_with("MISSING_ENV: ") && err.contains("hint: "), "{err}");
    let (code, _, err) = bc_tests::cli(
        &["pools", "list"],
        &[("BETTER_COMPUTE_URL", &server.url), ("BETTER_COMPUTE_TOKEN", "key_01jzzzzzzzzzzzzzzzzzzzzzzz.nope")],
    );
    assert_eq!(code, 1);
    assert!(err.starts_with("UNAUTHENTICATED: "), "{err}");
    assert_eq!(server.last_commit().await, before, "refusals append nothing");
}

#[tokio::test]
async fn the_token_never_reaches_stdout_and_secrets_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let server = Server::dev();
    let log = std::fs::read_to_string(server.data_dir.join("server.log")).unwrap();
    assert!(!log.contains(&server.token), "the admin token leaked into the log");
    for file in ["admin.token", "log.key"] {
        let mode = std::fs::metadata(server.data_dir.join(file)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{file}");
    }
}

/// The OpenAPI document lists every method with its input schema, and needs no token.
#[tokio::test]
async fn openapi_document_covers_every_method() {
    let server = Server::dev();
    let response = server.http.get(format!("{}/api/compute/openapi.json", server.url)).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let doc: serde_json::Value = response.json().await.unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let (_, list, _) = server.cli(&["api", "--list", "--format", "json"]);
    let methods: serde_json::Value = serde_json::from_str(&list).unwrap();
    for m in methods["items"].as_array().unwrap() {
        let name = m["method"].as_str().unwrap();
        assert!(doc["paths"][format!("/api/compute/{name}")]["post"]["requestBody"].is_object(), "{name} is documented");
    }
    let create = &doc["components"]["schemas"]["AskInput"]["properties"];
    assert!(create["gpus"].is_object() && create["selector"].is_object(), "{create}");
    // A method is POST only: another HTTP method is 405 with `Allow: POST` (as schemathesis's
    // conformance checks ask), and a path outside the API is 404.
    let other = server.http.get(format!("{}/api/compute/pools.list", server.url)).send().await.unwrap();
    assert_eq!(other.status(), 405);
    assert_eq!(other.headers()["allow"], "POST");
    let nowhere = server.http.get(format!("{}/api/other", server.url)).send().await.unwrap();
    assert_eq!(nowhere.status(), 404);
}

/// A filtered `events.list` matches rows on their columns and checks every row it serves
/// against its hashed bytes: an event whose bytes were changed behind the server's back is
/// refused as corrupt when a page would serve it, and passed over by a filter it does not match.
#[tokio::test]
async fn a_filtered_page_checks_the_events_it_serves() {
    let server = Server::dev();
    let pool = server.pool("gpu-a").await;
    let (status, updated) = server.call("pools.update", json!({ "poolId": pool, "description": "row 4", "ifVersion": 1 })).await;
    assert_eq!(status, 200, "{updated}");
    let (status, page) = server.call("events.list", json!({ "types": ["pool.*"] })).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["items"].as_array().unwrap().len(), 2, "{page}");

    server.sql("UPDATE events SET canonical = canonical || X'00' WHERE type = 'pool.created'").await;
    let (status, refused) = server.call("events.list", json!({ "types": ["pool.created"] })).await;
    assert_eq!((status, refused["code"].as_str()), (500, Some("LOG_CORRUPT")), "{refused}");
    let (status, refused) = server.call("events.list", json!({})).await;
    assert_eq!(refused["code"], "LOG_CORRUPT", "an unfiltered page serves it too: {status} {refused}");
    let (status, page) = server.call("events.list", json!({ "types": ["pool.updated"] })).await;
    assert_eq!(status, 200, "{page}");
    let items = page["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{page}");
    assert_eq!(items[0]["type"], "pool.updated");
}
