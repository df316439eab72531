//! `flavors` and `images` against a real `dev`, through the CLI and HTTP: create, list, get and
//! delete; a name twice is `ALREADY_EXISTS`; bad input is `INVALID_ARGUMENT` (exit 2) and
//! appends nothing; an archived pool takes no flavor (`CONFLICT`); a pool holds at most 64 flavors; and the
//! rows the server keeps are the rows its log folds to.

use bc_tests::{Server, fold_log, json, rows_sorted};
use serde_json::{Value, json};

const DIGEST: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// Whether the CLI's standard error says it failed with `code` (after any other lines, such as
/// the idempotency key it printed).
fn fails_with(err: &str, code: &str) -> bool {
    err.lines().any(|line| line.starts_with(&format!("{code}: ")))
}

fn flavor_body(pool: &str, name: &str) -> Value {
    json!({ "poolId": pool, "name": name, "vcpus": 8, "memoryMiB": 65536, "diskGiB": 200, "gpus": 1 })
}

/// `flavors create` of `name` in `pool` with `[vcpus, memory MiB, disk GiB]`, then `extra`.
fn flavors_create(server: &Server, pool: &str, name: &str, shape: [&str; 3], extra: &[&str]) -> (i32, String, String) {
    let [vcpus, memory_mib, disk_gib] = shape;
    let mut args = vec![
        "flavors",
        "create",
        "--pool",
        pool,
        "--name",
        name,
        "--vcpus",
        vcpus,
        "--memory-mib",
        memory_mib,
        "--disk-gib",
        disk_gib,
    ];
    args.extend_from_slice(extra);
    server.cli(&args)
}

/// `images register` of `name` at `url` with digest `sha256` in `disk_format`.
fn images_register(server: &Server, name: &str, url: &str, sha256: &str, disk_format: &str) -> (i32, String, String) {
    server.cli(&["images", "register", "--name", name, "--image-url", url, "--sha256", sha256, "--disk-format", disk_format])
}

#[tokio::test]
async fn flavors_are_created_listed_got_and_deleted_with_their_bounds_enforced() {
    let server = Server::dev();
    let pool = server.pool("gpu-a").await;
    let other = server.pool("gpu-b").await;

    let (code, out, err) = flavors_create(&server, &pool, "g1.large", ["8", "65536", "200"], &["--gpus", "1"]);
    assert_eq!(code, 0, "{err}");
    let created = json(&out);
    let id = created["flavorId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("flv_"), "{out}");
    assert_eq!(
        (&created["poolId"], &created["vcpus"], &created["memoryMiB"], &created["diskGiB"], &created["gpus"]),
        (&json!(pool), &json!(8), &json!(65536), &json!(200), &json!(1)),
        "{out}"
    );

    // A retry with the same idempotency key is answered from the log, not refused for its name.
    let (status, first) = server.call_as(&server.token, "flavors.create", flavor_body(&pool, "retried"), Some("k-1")).await;
    assert_eq!(status, 200, "{first}");
    let (status, again) = server.call_as(&server.token, "flavors.create", flavor_body(&pool, "retried"), Some("k-1")).await;
    assert_eq!((status, &again["flavorId"]), (200, &first["flavorId"]), "{again}");
    let (status, body) = server.call("flavors.delete", json!({ "flavorId": first["flavorId"] })).await;
    assert_eq!(status, 200, "{body}");

    // The same name in the same pool is refused; in another pool it is another flavor.
    let (code, _, err) = flavors_create(&server, &pool, "g1.large", ["1", "1", "1"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(fails_with(&err, "ALREADY_EXISTS") && err.contains(&id), "{err}");
    let (status, body) = server.call("flavors.create", flavor_body(&pool, "g1.large")).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("ALREADY_EXISTS")), "{body}");
    let (status, in_other) = server.call("flavors.create", flavor_body(&other, "g1.large")).await;
    assert_eq!(status, 200, "{in_other}");

    // Creates of one name at once: one flavor, the others ALREADY_EXISTS.
    let racing = (0..8).map(|_| server.call("flavors.create", flavor_body(&pool, "raced")));
    let answers = futures::future::join_all(racing).await;
    let created: Vec<&Value> = answers.iter().filter(|(status, _)| *status == 200).map(|(_, body)| body).collect();
    assert_eq!(created.len(), 1, "one create of a name wins: {answers:?}");
    assert!(answers.iter().all(|(s, b)| *s == 200 || b["code"] == "ALREADY_EXISTS"), "{answers:?}");
    let (status, body) = server.call("flavors.delete", json!({ "flavorId": created[0]["flavorId"] })).await;
    assert_eq!(status, 200, "{body}");

    // list, of all pools and of one; the table shows the chosen columns.
    let (code, out, err) = server.cli(&["flavors", "list", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["items"].as_array().unwrap().len(), 2, "{out}");
    let (code, out, err) = server.cli(&["flavors", "list", "--pool", &other, "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let items = json(&out)["items"].as_array().cloned().unwrap();
    assert_eq!(items.len(), 1, "{out}");
    assert_eq!(items[0]["flavorId"], in_other["flavorId"]);
    let (code, table, err) = server.cli(&["flavors", "list", "--pool", &pool]);
    assert_eq!(code, 0, "{err}");
    for expected in ["ID", "POOL", "VCPUS", "MEMORY", "DISK", "GPUS", id.as_str(), "64 GiB", "200 GiB"] {
        assert!(table.contains(expected), "{expected}: {table}");
    }
    let (code, out, err) = server.cli(&["flavors", "get", &id]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["name"], "g1.large");

    // Bad input: the stable code, exit status 2, and nothing appended.
    let before = server.last_commit().await;
    for (field, value) in [
        ("vcpus", json!(0)),
        ("vcpus", json!(1025)),
        ("memoryMiB", json!(0)),
        ("memoryMiB", json!(16 * 1024 * 1024 + 1)),
        ("diskGiB", json!(65537)),
        ("gpus", json!(65)),
        ("name", json!("Not A Name")),
        ("poolId", json!("pool_x")),
    ] {
        let mut body = flavor_body(&pool, "bad");
        body[field] = value.clone();
        let (status, answer) = server.call("flavors.create", body).await;
        assert_eq!((status, answer["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{field}={value}: {answer}");
    }
    let (code, _, err) = flavors_create(&server, &pool, "huge", ["2000", "1", "1"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(fails_with(&err, "INVALID_ARGUMENT") && err.contains("vcpus"), "{err}");
    let (code, _, err) = server.cli(&["flavors", "get", "flv_nope"]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(server.last_commit().await, before, "a refusal appends nothing");

    // A pool that does not exist, or is archived, takes no flavor.
    let missing = bc_core::id::PoolId::generate().to_string();
    let (status, body) = server.call("flavors.create", flavor_body(&missing, "x")).await;
    assert_eq!((status, body["code"].as_str()), (404, Some("NOT_FOUND")), "{body}");
    let (status, body) = server.call("pools.archive", json!({ "poolId": other })).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.call("flavors.create", flavor_body(&other, "after-archive")).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("CONFLICT")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("archived"), "{body}");

    // At most 64 flavors in one pool (one is there already).
    for n in 1..64 {
        let (status, body) = server.call("flavors.create", flavor_body(&pool, &format!("f{n}"))).await;
        assert_eq!(status, 200, "flavor {n}: {body}");
    }
    let (status, body) = server.call("flavors.create", flavor_body(&pool, "one-too-many")).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("INVALID_STATE")), "{body}");
    assert!(body["message"].as_str().unwrap().contains("64"), "{body}");

    // Delete: a stale ifVersion is CONFLICT; then it is gone, and its name is free again.
    let (status, body) = server.call("flavors.delete", json!({ "flavorId": id, "ifVersion": 7 })).await;
    assert_eq!((status, body["code"].as_str()), (409, Some("CONFLICT")), "{body}");
    let (code, out, err) = server.cli(&["flavors", "delete", &id, "--if-version", "1"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out), json!({ "flavorId": id, "deleted": true }));
    let (code, _, err) = server.cli(&["flavors", "get", &id]);
    assert_eq!(code, 1, "{err}");
    assert!(fails_with(&err, "NOT_FOUND"), "{err}");
    let (status, body) = server.call("flavors.create", flavor_body(&pool, "g1.large")).await;
    assert_eq!(status, 200, "the name is free once its flavor is deleted: {body}");

    // The events are in the log, and the rows are what the log folds to.
    let (code, out, err) = server.cli(&["events", "list", "--types", "flavor.*", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let types: Vec<String> =
        json(&out)["items"].as_array().unwrap().iter().map(|e| e["type"].as_str().unwrap().to_owned()).collect();
    assert!(types.contains(&"flavor.created".to_owned()) && types.contains(&"flavor.deleted".to_owned()), "{types:?}");
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    assert_eq!(rows_sorted(&store).await, fold_log(&store).await, "the stored rows are the log's fold");
}

#[tokio::test]
async fn images_are_registered_listed_got_and_deleted_and_bad_ones_refused() {
    let server = Server::dev();
    let (code, out, err) =
        images_register(&server, "ubuntu-24.04", "https://images.example.com/ubuntu-24.04.qcow2", DIGEST, "qcow2");
    assert_eq!(code, 0, "{err}");
    let image = json(&out);
    let id = image["imageId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("img_"), "{out}");
    assert_eq!((&image["diskFormat"], &image["sha256"]), (&json!("qcow2"), &json!(DIGEST)), "{out}");
    assert!(image.get("sizeBytes").is_none(), "no size unless one was given: {out}");

    let (code, _, err) = images_register(&server, "ubuntu-24.04", "http://10.0.0.5:8080/other.raw", DIGEST, "raw");
    assert_eq!(code, 1, "{err}");
    assert!(fails_with(&err, "ALREADY_EXISTS"), "{err}");
    let body = json!({ "name": "retried", "url": "https://a.example/r.img", "sha256": DIGEST, "diskFormat": "raw" });
    let (status, first) = server.call_as(&server.token, "images.register", body.clone(), Some("k-2")).await;
    assert_eq!(status, 200, "{first}");
    let (status, again) = server.call_as(&server.token, "images.register", body, Some("k-2")).await;
    assert_eq!((status, &again["imageId"]), (200, &first["imageId"]), "a retry is answered from the log: {again}");
    let (status, body) = server.call("images.delete", json!({ "imageId": first["imageId"] })).await;
    assert_eq!(status, 200, "{body}");
    let (status, raw) = server
        .call(
            "images.register",
            json!({ "name": "scratch", "url": "http://10.0.0.5:8080/s.raw", "sha256": DIGEST, "diskFormat": "raw", "sizeBytes": 1 << 30 }),
        )
        .await;
    assert_eq!(status, 200, "{raw}");
    assert_eq!(raw["sizeBytes"], 1u64 << 30);

    // Registrations of one name at once: one image, the others ALREADY_EXISTS.
    let body = json!({ "name": "raced", "url": "https://a.example/r.img", "sha256": DIGEST, "diskFormat": "raw" });
    let answers = futures::future::join_all((0..8).map(|_| server.call("images.register", body.clone()))).await;
    let registered: Vec<&Value> = answers.iter().filter(|(status, _)| *status == 200).map(|(_, body)| body).collect();
    assert_eq!(registered.len(), 1, "one registration of a name wins: {answers:?}");
    assert!(answers.iter().all(|(s, b)| *s == 200 || b["code"] == "ALREADY_EXISTS"), "{answers:?}");
    let (status, body) = server.call("images.delete", json!({ "imageId": registered[0]["imageId"] })).await;
    assert_eq!(status, 200, "{body}");

    let (code, table, err) = server.cli(&["images", "list"]);
    assert_eq!(code, 0, "{err}");
    for expected in ["ID", "NAME", "FORMAT", "SHA256", "URL", "ubuntu-24.04", "scratch", &DIGEST[..12]] {
        assert!(table.contains(expected), "{expected}: {table}");
    }
    let (code, out, err) = server.cli(&["images", "get", &id]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["url"], "https://images.example.com/ubuntu-24.04.qcow2");

    // Bad input: the stable code, exit status 2, nothing appended; no secret-bearing URL is kept.
    let before = server.last_commit().await;
    let good = json!({ "name": "x", "url": "https://a.example/x.img", "sha256": DIGEST, "diskFormat": "raw" });
    for (field, value) in [
        ("url", json!("ftp://a.example/x.img")),
        ("url", json!("https://user:hunter2@a.example/x.img")),
        ("url", json!("https://a.example/x.img?X-Amz-Signature=abc")),
        ("url", json!(format!("https://a.example/{}", "x".repeat(2048)))),
        ("sha256", json!(DIGEST.to_uppercase())),
        ("sha256", json!(&DIGEST[..63])),
        ("diskFormat", json!("vmdk")),
        ("sizeBytes", json!(0)),
        ("name", json!("")),
    ] {
        let mut body = good.clone();
        body[field] = value.clone();
        let (status, answer) = server.call("images.register", body).await;
        assert_eq!((status, answer["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{field}={value}: {answer}");
        assert!(!answer.to_string().contains("hunter2"), "the refusal does not echo a password: {answer}");
    }
    let (code, _, err) = images_register(&server, "y", "file:///etc/passwd", DIGEST, "raw");
    assert_eq!(code, 2, "{err}");
    assert!(fails_with(&err, "INVALID_ARGUMENT"), "{err}");
    let (code, _, err) = images_register(&server, "y", "https://a/x", DIGEST, "vmdk");
    assert_eq!(code, 2, "clap refuses an unknown format: {err}");
    assert_eq!(server.last_commit().await, before, "a refusal appends nothing");

    let (code, out, err) = server.cli(&["images", "delete", &id]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["deleted"], true);
    let (code, out, err) = server.cli(&["images", "list", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let listed = json(&out);
    let names: Vec<&str> = listed["items"].as_array().unwrap().iter().map(|i| i["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["scratch"]);
    let (status, body) = server.call("images.delete", json!({ "imageId": id })).await;
    assert_eq!((status, body["code"].as_str()), (404, Some("NOT_FOUND")), "deleting twice: {body}");

    // An API key with only the read actions reads but does not register.
    let (status, key) = server
        .call("apiKeys.create", json!({ "name": "reader", "actions": ["compute:images:read", "compute:flavors:read"] }))
        .await;
    assert_eq!(status, 200, "{key}");
    let token = key["token"].as_str().unwrap();
    let (status, body) = server.call_as(token, "images.list", json!({}), None).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.call_as(token, "images.register", good, None).await;
    assert_eq!((status, body["code"].as_str()), (403, Some("ACCESS_DENIED")), "{body}");

    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    assert_eq!(rows_sorted(&store).await, fold_log(&store).await, "the stored rows are the log's fold");
}

/// `flavors update` changes a flavor's name and shape in place, through the CLI: the fields
/// given, the others kept, a name taken in the pool refused, a bound refused, a stale
/// `--if-version` refused; the pool is not a field it takes.
#[tokio::test]
async fn a_flavor_is_updated_in_place_but_never_moved_to_another_pool() {
    let server = Server::dev();
    let pool = server.pool("gpu-a").await;
    let (code, out, err) = flavors_create(&server, &pool, "small", ["2", "4096", "20"], &[]);
    assert_eq!(code, 0, "{err}");
    let small = json(&out);
    let id = small["flavorId"].as_str().unwrap().to_owned();
    let (code, _, err) = flavors_create(&server, &pool, "taken", ["1", "1024", "10"], &[]);
    assert_eq!(code, 0, "{err}");

    let (code, out, err) = server.cli(&["flavors", "update", &id, "--vcpus", "4", "--name", "medium"]);
    assert_eq!(code, 0, "{err}");
    let updated = json(&out);
    assert_eq!(
        (&updated["name"], &updated["vcpus"], &updated["memoryMiB"], &updated["diskGiB"], &updated["poolId"]),
        (&json!("medium"), &json!(4), &json!(4096), &json!(20), &json!(pool)),
        "{out}"
    );
    assert_eq!(updated["version"], small["version"].as_u64().unwrap() + 1);
    let (status, events) = server.call("events.list", json!({ "types": ["flavor.updated"] })).await;
    assert_eq!(status, 200);
    assert_eq!(events["items"][0]["payload"], json!({ "name": "medium", "vcpus": 4 }), "only what changed: {events}");

    let (code, _, err) = server.cli(&["flavors", "update", &id, "--name", "taken"]);
    assert_eq!(code, 1);
    assert!(fails_with(&err, "ALREADY_EXISTS"), "{err}");
    let (code, _, err) = server.cli(&["flavors", "update", &id, "--vcpus", "0"]);
    assert_ne!(code, 0);
    assert!(fails_with(&err, "INVALID_ARGUMENT"), "{err}");
    let (code, _, err) = server.cli(&["flavors", "update", &id, "--gpus", "1", "--if-version", "1"]);
    assert_ne!(code, 0);
    assert!(fails_with(&err, "CONFLICT"), "{err}");
    let (code, _, err) = server.cli(&["flavors", "update", &id]);
    assert_eq!(code, 2, "nothing to update is a usage error: {err}");
    let (code, _, _) = server.cli(&["flavors", "update", &id, "--pool", &pool]);
    assert_eq!(code, 2, "there is no --pool");
    let (status, body) = server.call("flavors.update", json!({ "flavorId": id, "poolId": pool })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{body}");

    let (code, out, _) = server.cli(&["flavors", "get", &id]);
    assert_eq!(code, 0);
    assert_eq!(
        (json(&out)["name"].as_str(), json(&out)["vcpus"].as_u64()),
        (Some("medium"), Some(4)),
        "refusals changed nothing"
    );
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    assert_eq!(rows_sorted(&store).await, fold_log(&store).await, "the stored rows are the log's fold");
}

/// `images promote` moves an image from `testing` (where it is registered) to `stable`, once;
/// `images list --channel` filters by it.
#[tokio::test]
async fn an_image_is_promoted_from_testing_to_stable_once() {
    let server = Server::dev();
    let (code, out, err) = images_register(&server, "ubuntu", "https://images.example.com/u.qcow2", DIGEST, "qcow2");
    assert_eq!(code, 0, "{err}");
    let image = json(&out);
    assert_eq!(image["channel"], "testing", "{out}");
    let id = image["imageId"].as_str().unwrap().to_owned();
    let (code, _, err) = images_register(&server, "debian", "https://images.example.com/d.qcow2", DIGEST, "qcow2");
    assert_eq!(code, 0, "{err}");

    let (code, out, err) = server.cli(&["images", "promote", &id]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["channel"], "stable", "{out}");
    let (code, _, err) = server.cli(&["images", "promote", &id]);
    assert_eq!(code, 1);
    assert!(fails_with(&err, "INVALID_STATE") && err.contains("already stable"), "{err}");

    let (code, out, err) = server.cli(&["images", "list", "--channel", "stable", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let stable = json(&out);
    let names: Vec<&str> = stable["items"].as_array().unwrap().iter().map(|i| i["name"].as_str().unwrap()).collect();
    assert_eq!(names, vec!["ubuntu"]);
    let (code, out, _) = server.cli(&["images", "list", "--channel", "testing", "--format", "json"]);
    assert_eq!(code, 0);
    assert_eq!(json(&out)["items"].as_array().unwrap().len(), 1);
    let (status, events) = server.call("events.list", json!({ "types": ["image.promoted"] })).await;
    assert_eq!(status, 200);
    assert_eq!(events["items"][0]["payload"], json!({ "from": "testing", "to": "stable" }), "{events}");
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    assert_eq!(rows_sorted(&store).await, fold_log(&store).await, "the stored rows are the log's fold");
}
