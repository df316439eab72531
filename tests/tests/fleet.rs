//! `fleet export|plan|apply|status` against a real `dev`, through the CLI and HTTP: a fleet made
//! call by call exports to a document that plans empty and that Python's `jsonschema` (not this
//! project's code) validates against the checked-in schema; an edited document applies with its
//! plan's hash in one transaction named by one `fleet.applied`; a change between plan and apply,
//! two racing applies and a denied call each apply nothing; a dangling reference is
//! `PLAN_BLOCKED`; a pool changed by hand is `FLEET_DRIFTED`. A fleet with a site, a pool at it
//! and a project round-trips the same way, and a machine at the site blocks its prune.

use std::path::{Path, PathBuf};
use std::process::Command;

use bc_tests::{Server, json};
use serde_json::{Value, json};

const DIGEST: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

fn fails_with(err: &str, code: &str) -> bool {
    err.lines().any(|line| line.starts_with(&format!("{code}: ")))
}

/// The Python of `make fleet-venv`. Missing, the test fails: it never skips.
fn python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fleet-venv/bin/python");
    assert!(
        python.exists(),
        "no Python with jsonschema at {} (run `make fleet-venv`, which `make test` runs; it installs from PyPI)",
        python.display()
    );
    python
}

/// Validates `document` with Python's jsonschema against schema/fleet-config.schema.json: the
/// errors it lists (empty: valid).
fn jsonschema_errors(dir: &Path, document: &Value) -> String {
    let file = dir.join(format!("doc-{}.json", rand_suffix()));
    std::fs::write(&file, serde_json::to_vec(document).unwrap()).unwrap();
    let schema = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schema/fleet-config.schema.json");
    let script = "import json, sys\nfrom jsonschema import Draft202012Validator\n\
        schema = json.load(open(sys.argv[1]))\nDraft202012Validator.check_schema(schema)\n\
        v = Draft202012Validator(schema)\n\
        errors = [f'{list(e.absolute_path)}: {e.message}' for e in v.iter_errors(json.load(open(sys.argv[2])))]\n\
        print('\\n'.join(errors))\n";
    let out = Command::new(python()).args(["-c", script]).arg(&schema).arg(&file).output().expect("python");
    assert!(out.status.success(), "jsonschema: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::SeqCst)
}

fn read(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn write(path: &Path, document: &Value) {
    std::fs::write(path, serde_json::to_vec_pretty(document).unwrap()).unwrap();
}

/// The plan's hash, from `fleet plan`'s last line.
fn plan_hash(out: &str) -> String {
    out.lines().find_map(|l| l.strip_prefix("planHash: ")).expect("a planHash line").to_owned()
}

/// The seq of the newest event a change of the fleet could have appended (the server's own
/// checkpoints and usage windows, appended on their own schedule, left out).
async fn head(server: &Server) -> u64 {
    changes(server).await.iter().filter_map(|e| e["seq"].as_u64()).max().unwrap_or(0)
}

async fn changes(server: &Server) -> Vec<Value> {
    let (status, events) = server.call("events.list", json!({ "limit": 500 })).await;
    assert_eq!(status, 200, "{events}");
    let items = events["items"].as_array().unwrap().clone();
    items
        .into_iter()
        .filter(|e| !e["type"].as_str().is_some_and(|t| t.starts_with("checkpoint.") || t.starts_with("usage.")))
        .collect()
}

/// A fleet made call by call: a pool with the tenant's quota, a flavor, an image.
async fn fleet(server: &Server) -> (String, String, String) {
    let pool = server.pool("gpu-a").await;
    let (status, q) = server.call("quotas.set", json!({ "poolId": pool, "gpus": 8 })).await;
    assert_eq!(status, 200, "{q}");
    let (status, f) = server
        .call(
            "flavors.create",
            json!({ "poolId": pool, "name": "g1", "vcpus": 8, "memoryMiB": 65536, "diskGiB": 200, "gpus": 1 }),
        )
        .await;
    assert_eq!(status, 200, "{f}");
    let (status, i) = server
        .call(
            "images.register",
            json!({ "name": "ubuntu", "url": "https://images.example/ubuntu.qcow2", "sha256": DIGEST, "diskFormat": "qcow2" }),
        )
        .await;
    assert_eq!(status, 200, "{i}");
    (pool, f["flavorId"].as_str().unwrap().to_owned(), i["imageId"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn an_exported_fleet_plans_empty_validates_outside_and_applies_edits_by_its_reviewed_hash() {
    let server = Server::dev();
    let dir = tempfile::tempdir().unwrap();
    let (pool, flavor, image) = fleet(&server).await;

    // Export: objects the fleet did not create are keyed by id.
    let file = dir.path().join("fleet.json");
    let (code, out, err) = server.cli(&["fleet", "export", "--out", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["pools"], 1, "{out}");
    let doc = read(&file);
    assert_eq!(doc["pools"][&pool]["quotaGpus"], 8, "{doc}");
    assert_eq!(doc["flavors"][&flavor]["pool"], json!(pool), "{doc}");
    assert_eq!(doc["images"][&image]["sha256"], DIGEST, "{doc}");
    // Never over a file.
    let (code, _, err) = server.cli(&["fleet", "export", "--out", file.to_str().unwrap()]);
    assert!(code != 0 && fails_with(&err, "ALREADY_EXISTS"), "{err}");

    // The schema, checked by a validator this project did not write: the export passes, and a
    // document it must refuse is refused (the check can fail).
    assert_eq!(jsonschema_errors(dir.path(), &doc), "", "the export must validate");
    let mut bad = doc.clone();
    bad["pools"][&pool]["name"] = json!("Not A Name");
    bad["flavors"]["Bad_Key"] = json!({ "pool": pool, "name": "x", "vcpus": 0, "memoryMiB": 1, "diskGiB": 1, "gpus": 0 });
    let errors = jsonschema_errors(dir.path(), &bad);
    assert!(errors.contains("Not A Name") && errors.contains("Bad_Key") && errors.contains("vcpus"), "{errors}");

    // Plan: empty, and --fail-on-drift passes.
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--fail-on-drift"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("No changes"), "{out}");

    // Edit: rename the pool (its key, the id, keeps it), raise the quota, add a pool of the
    // fleet's own with a flavor in it, grow the flavor in place, promote the image.
    let mut edited = doc.clone();
    assert_eq!(doc["images"][&image]["channel"], "testing", "{doc}");
    edited["flavors"][&flavor]["vcpus"] = json!(16);
    edited["images"][&image]["channel"] = json!("stable");
    edited["images"]["debian"] = json!({
        "name": "debian", "url": "https://images.example/debian.raw", "sha256": DIGEST, "diskFormat": "raw", "channel": "stable"
    });
    edited["pools"][&pool]["name"] = json!("gpu-a-renamed");
    edited["pools"][&pool]["quotaGpus"] = json!(16);
    edited["pools"]["gpu-b"] = json!({ "name": "gpu-b", "labels": { "site": "fra1" }, "quotaGpus": 4 });
    edited["flavors"]["gpu-b-small"] =
        json!({ "pool": "gpu-b", "name": "small", "vcpus": 4, "memoryMiB": 8192, "diskGiB": 50, "gpus": 0 });
    write(&file, &edited);
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--calls"]);
    assert_eq!(code, 0, "{err}");
    let (flavor_line, image_line) = (format!("~ flavor {flavor}"), format!("~ image {image}"));
    for line in [
        "~ pool ",
        "+ pool gpu-b",
        "~ quota ",
        "+ quota gpu-b",
        "+ flavor gpu-b-small",
        "call: pools.create (compute:pools:write)",
        flavor_line.as_str(),
        "call: flavors.update (compute:flavors:write)",
        image_line.as_str(),
        "call: images.promote (compute:images:write)",
        "+ image debian",
    ] {
        assert!(out.contains(line), "{line:?} in\n{out}");
    }
    let hash = plan_hash(&out);
    // The same plan over the same fleet has the same hash.
    let (_, again, _) = server.cli(&["fleet", "plan", file.to_str().unwrap()]);
    assert_eq!(plan_hash(&again), hash);
    // --fail-on-drift: the plan is not empty.
    let (code, _, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--fail-on-drift"]);
    assert!(code == 1 && fails_with(&err, "FLEET_DRIFTED"), "{err}");
    // Without --plan-hash or --yes, apply only plans.
    let before = head(&server).await;
    let (code, out, _) = server.cli(&["fleet", "apply", file.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert_eq!(plan_hash(&out), hash);
    assert_eq!(head(&server).await, before, "apply without a hash appends nothing");

    // Apply with the reviewed hash: everything in one transaction, one fleet.applied naming it.
    let (code, out, err) = server.cli(&["fleet", "apply", file.to_str().unwrap(), "--plan-hash", &hash]);
    assert_eq!(code, 0, "{err}");
    let applied = json(&out);
    assert_eq!(
        (applied["applied"].as_bool(), applied["created"].as_u64(), applied["updated"].as_u64()),
        (Some(true), Some(4), Some(4)),
        "{out}"
    );
    let (_, grown) = server.call("flavors.get", json!({ "flavorId": flavor })).await;
    assert_eq!((grown["vcpus"].as_u64(), grown["poolId"].as_str()), (Some(16), Some(pool.as_str())), "{grown}");
    let (_, promoted) = server.call("images.get", json!({ "imageId": image })).await;
    assert_eq!(promoted["channel"], "stable", "{promoted}");
    // A new image the document says is stable is registered and promoted in one append.
    let debian = applied["createdIds"]["image/debian"].as_str().unwrap();
    let (_, debian) = server.call("images.get", json!({ "imageId": debian })).await;
    assert_eq!((debian["channel"].as_str(), debian["version"].as_u64()), (Some("stable"), Some(2)), "{debian}");
    let new_pool = applied["createdIds"]["pool/gpu-b"].as_str().unwrap().to_owned();
    let (_, renamed) = server.call("pools.get", json!({ "poolId": pool })).await;
    assert_eq!(renamed["name"], "gpu-a-renamed");
    let (_, quota) = server.call("quotas.get", json!({ "poolId": new_pool })).await;
    assert_eq!(quota["gpus"], 4, "{quota}");
    let (_, events) = server.call("events.list", json!({ "limit": 500, "types": ["fleet.applied"] })).await;
    let items = events["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{events}");
    assert_eq!(items[0]["payload"]["planHash"], json!(hash), "{events}");
    let commits: std::collections::BTreeSet<String> = changes(&server)
        .await
        .iter()
        .filter(|e| e["seq"].as_u64() > Some(before))
        .map(|e| e["position"].as_str().unwrap().split(['.', ':']).next().unwrap().to_owned())
        .collect();
    assert_eq!(commits.len(), 1, "the apply is one transaction: {commits:?}");

    // The same document plans empty now, and its export keys the fleet's own objects by key.
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--fail-on-drift"]);
    assert_eq!(code, 0, "{out}{err}");
    let (status, export) = server.call("fleet.export", json!({})).await;
    assert_eq!(status, 200);
    assert_eq!(export["document"]["pools"]["gpu-b"]["labels"]["site"], "fra1", "{export}");
    assert_eq!(export["document"]["flavors"]["gpu-b-small"]["pool"], "gpu-b", "{export}");

    // Drift: a pool changed by hand is FLEET_DRIFTED, named.
    let (code, _, err) = server.cli(&["fleet", "status", "--fail-on-drift"]);
    assert_eq!(code, 0, "{err}");
    let (status, _) = server.call("pools.update", json!({ "poolId": new_pool, "description": "by hand" })).await;
    assert_eq!(status, 200);
    let (code, _, err) = server.cli(&["fleet", "status", "--fail-on-drift"]);
    assert!(code == 1 && fails_with(&err, "FLEET_DRIFTED") && err.contains("gpu-b"), "{err}");
}

#[tokio::test]
async fn a_change_between_plan_and_apply_a_race_a_denial_and_a_dangling_name_apply_nothing() {
    let server = Server::dev();
    let dir = tempfile::tempdir().unwrap();
    let (pool, _, _) = fleet(&server).await;
    let file = dir.path().join("fleet.json");
    let (code, _, err) = server.cli(&["fleet", "export", "--out", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let doc = read(&file);

    // CONFIG_DRIFT: the pool changed through the API after the plan.
    let mut edited = doc.clone();
    edited["pools"]["gpu-c"] = json!({ "name": "gpu-c" });
    write(&file, &edited);
    let (_, out, _) = server.cli(&["fleet", "plan", file.to_str().unwrap()]);
    let hash = plan_hash(&out);
    let (status, _) = server.call("pools.update", json!({ "poolId": pool, "description": "meanwhile" })).await;
    assert_eq!(status, 200);
    let before = head(&server).await;
    let (code, _, err) = server.cli(&["fleet", "apply", file.to_str().unwrap(), "--plan-hash", &hash]);
    assert!(code == 1 && fails_with(&err, "CONFIG_DRIFT"), "{err}");
    assert_eq!(head(&server).await, before, "nothing applied");

    // Two applies of two plans racing: exactly one applies, the other is CONFIG_DRIFT.
    let (_, out, _) = server.cli(&["fleet", "plan", file.to_str().unwrap()]);
    let hash_c = plan_hash(&out);
    let other = dir.path().join("other.json");
    let mut edited_d = read(&file);
    edited_d["pools"]["gpu-d"] = json!({ "name": "gpu-d" });
    write(&other, &edited_d);
    let (_, out, _) = server.cli(&["fleet", "plan", other.to_str().unwrap()]);
    let hash_d = plan_hash(&out);
    let doc_c = read(&file);
    let (a, b) = tokio::join!(
        server.call("fleet.apply", json!({ "document": doc_c, "planHash": hash_c })),
        server.call("fleet.apply", json!({ "document": edited_d, "planHash": hash_d })),
    );
    let mut outcomes =
        vec![(a.0, a.1["code"].as_str().unwrap_or("").to_owned()), (b.0, b.1["code"].as_str().unwrap_or("").to_owned())];
    outcomes.sort();
    assert_eq!(outcomes, vec![(200, String::new()), (409, "CONFIG_DRIFT".to_owned())], "{a:?} {b:?}");

    // A denial stops everything: a root key holding the fleet's action but not the images' one.
    let (status, key) = server
        .call("apiKeys.create", json!({ "name": "fleet-no-images", "actions": ["compute:fleet:admin", "compute:pools:*", "compute:quotas:*", "compute:flavors:*"] }))
        .await;
    assert_eq!(status, 200, "{key}");
    let token = key["token"].as_str().unwrap().to_owned();
    let (_, now) = server.call("fleet.export", json!({})).await;
    let mut denied = now["document"].clone();
    for n in 0..40 {
        denied["pools"][format!("p{n:02}")] = json!({ "name": format!("p{n:02}") });
    }
    denied["images"]["debian"] =
        json!({ "name": "debian", "url": "https://images.example/debian.raw", "sha256": DIGEST, "diskFormat": "raw" });
    let (_, plan) = server.call_as(&token, "fleet.plan", json!({ "document": denied }), None).await;
    let hash = plan["planHash"].as_str().unwrap().to_owned();
    assert_eq!(plan["changes"].as_array().unwrap().len(), 41, "{plan}");
    let before = head(&server).await;
    let (status, refused) = server.call_as(&token, "fleet.apply", json!({ "document": denied, "planHash": hash }), None).await;
    assert_eq!((status, refused["code"].as_str()), (403, Some("ACCESS_DENIED")), "{refused}");
    assert!(refused["message"].as_str().unwrap().contains("call 41 of 41"), "{refused}");
    assert_eq!(head(&server).await, before, "nothing applied");

    // A dangling name: PLAN_BLOCKED, from plan and from apply.
    let mut dangling = now["document"].clone();
    dangling["flavors"]["orphan"] =
        json!({ "pool": "no-such-pool", "name": "orphan", "vcpus": 1, "memoryMiB": 1024, "diskGiB": 10, "gpus": 0 });
    write(&file, &dangling);
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap()]);
    assert!(
        code == 1 && fails_with(&err, "PLAN_BLOCKED") && out.contains("BLOCKED flavor orphan: dangling reference"),
        "{out}{err}"
    );
    let (code, _, err) = server.cli(&["fleet", "apply", file.to_str().unwrap(), "--yes"]);
    assert!(code == 1 && fails_with(&err, "PLAN_BLOCKED"), "{err}");

    // Only the root tenant's administrators manage the fleet.
    let acme = server.tenant("acme").await;
    let (_, key) = server.call("apiKeys.create", json!({ "tenantId": acme, "name": "acme-admin", "actions": ["*"] })).await;
    let acme_token = key["token"].as_str().unwrap();
    let (status, refused) = server.call_as(acme_token, "fleet.export", json!({}), None).await;
    assert_eq!((status, refused["code"].as_str()), (403, Some("ACCESS_DENIED")), "{refused}");
}

/// The round trip with a site and a project (issue 56): a fleet made call by call holding a
/// site, a pool at that site (with a quota) and a project exports to a document whose pool
/// names its site by the site's key; Python's `jsonschema` validates it against the checked-in
/// schema (and refuses a site and a project it must refuse); it plans empty, with `--prune`
/// too (nothing of the fleet is left out of it). An archived project is not exported. A
/// bare-metal machine (not in the document) at the site holds it: a document that leaves the
/// site and its pool out, pruned, is `PLAN_BLOCKED` naming the machine.
#[tokio::test]
async fn a_fleet_with_a_site_a_pool_at_it_and_a_project_round_trips() {
    let server = Server::dev_with(&["--bmc-allow-network", "127.0.0.1/32"]);
    let dir = tempfile::tempdir().unwrap();
    let ok = |args: &[&str]| {
        let (code, out, err) = server.cli(args);
        assert_eq!(code, 0, "{args:?}: {err}");
        json(&out)
    };
    let site = ok(&["sites", "create", "--name", "fra1", "--region", "eu-central", "--label", "dc=fra"]);
    let site = site["siteId"].as_str().unwrap().to_owned();
    let pool = ok(&["pools", "create", "--name", "gpu-fra", "--site", &site, "--label", "tier=a"]);
    let pool = pool["poolId"].as_str().unwrap().to_owned();
    let (status, q) = server.call("quotas.set", json!({ "poolId": pool, "gpus": 8 })).await;
    assert_eq!(status, 200, "{q}");
    let project = ok(&["projects", "create", "--name", "training", "--description", "the big run"]);
    let project = project["projectId"].as_str().unwrap().to_owned();
    let old = ok(&["projects", "create", "--name", "old"]);
    ok(&["projects", "archive", old["projectId"].as_str().unwrap()]);

    let file = dir.path().join("fleet.json");
    ok(&["fleet", "export", "--out", file.to_str().unwrap()]);
    let doc = read(&file);
    assert_eq!(doc["sites"][&site], json!({ "name": "fra1", "region": "eu-central", "labels": { "dc": "fra" } }), "{doc}");
    assert_eq!(doc["pools"][&pool]["site"], json!(site), "a pool names its site by the site's key: {doc}");
    assert_eq!(doc["pools"][&pool]["quotaGpus"], 8, "{doc}");
    assert_eq!(doc["projects"], json!({ project.clone(): { "name": "training", "description": "the big run" } }), "{doc}");

    // Validated by a validator this project did not write; a bad site and project are refused.
    assert_eq!(jsonschema_errors(dir.path(), &doc), "", "the export must validate");
    let mut bad = doc.clone();
    bad["sites"][&site]["region"] = json!("EU Central");
    bad["projects"]["Bad_Key"] = json!({ "name": "x" });
    bad["pools"][&pool]["site"] = json!("Not a key");
    let errors = jsonschema_errors(dir.path(), &bad);
    assert!(errors.contains("EU Central") && errors.contains("Bad_Key") && errors.contains("Not a key"), "{errors}");

    // It plans empty, pruning or not.
    for extra in [&[][..], &["--prune"][..]] {
        let mut args = vec!["fleet", "plan", file.to_str().unwrap(), "--fail-on-drift"];
        args.extend_from_slice(extra);
        let (code, out, err) = server.cli(&args);
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        assert!(out.contains("No changes"), "{args:?}: {out}");
    }
    // The check can fail: the document without its project, pruned, archives it.
    let mut without = doc.clone();
    without.as_object_mut().unwrap().remove("projects");
    write(&file, &without);
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--prune", "--fail-on-drift"]);
    assert!(code == 1 && fails_with(&err, "FLEET_DRIFTED") && out.contains(&format!("- project {project}")), "{out}{err}");

    // A machine at the site (its pool's) holds it against a prune that archives the pool.
    let password = dir.path().join("bmc-password");
    std::fs::write(&password, "not-a-real-password\n").unwrap();
    let address = format!("https://127.0.0.1:{}", bc_tests::free_port());
    let machine = ok(&[
        "metal",
        "enroll",
        "--pool",
        &pool,
        "--name",
        "m1",
        "--bmc-address",
        &address,
        "--bmc-username",
        "admin",
        "--bmc-password-file",
        password.to_str().unwrap(),
        "--bmc-insecure",
    ]);
    assert_eq!(machine["siteId"], json!(site), "{machine}");
    let mut bare = doc.clone();
    for key in ["sites", "pools"] {
        bare.as_object_mut().unwrap().remove(key);
    }
    write(&file, &bare);
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--prune"]);
    let named = format!("metal/{}", machine["nodeId"].as_str().unwrap());
    assert!(code == 1 && fails_with(&err, "PLAN_BLOCKED") && out.contains(&named), "{out}{err}");
}

/// Webhooks in the fleet document (issue 56): their signing secrets only ever as references. A
/// webhook signing with a referenced secret is exported with its `secretRef`, one with a
/// generated secret without any (the document holds no secret value); the export plans empty. A
/// new webhook without a reference is PLAN_BLOCKED; with one, `+ webhook`; an edit of the
/// generated one is `~ webhook` and leaves its secret alone (its deliveries still verify with
/// it); `--prune` deletes the one left out (`- webhook`); `--calls` names the webhooks calls.
/// After the apply, the new webhook signs with the referenced value, and the secret cannot be
/// deleted while it names it.
#[tokio::test]
async fn webhooks_in_the_document_name_their_secrets_by_reference_only() {
    use bc_core::webhook::{Secret, verify};
    let server = Server::dev();
    let receiver = bc_tests::receiver::Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let signing = Secret::generate().expose();
    let value_file = dir.path().join("hook.secret");
    std::fs::write(&value_file, &signing).unwrap();
    let (code, out, err) = server.cli(&["secrets", "put", "hook-signing", "--value-file", value_file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let reference = json(&out)["ref"].as_str().unwrap().to_owned();
    let (status, by_ref) =
        server.call("webhooks.create", json!({ "url": receiver.url, "eventTypes": ["pool.*"], "secretRef": reference })).await;
    assert_eq!(status, 200, "{by_ref}");
    let by_ref = by_ref["webhookId"].as_str().unwrap().to_owned();
    let (status, own) =
        server.call("webhooks.create", json!({ "url": receiver.url, "eventTypes": ["pool.*"], "description": "own" })).await;
    assert_eq!(status, 200, "{own}");
    let own_secret = own["secret"].as_str().unwrap().to_owned();
    let own = own["webhookId"].as_str().unwrap().to_owned();

    // Exported: a reference, or nothing; never a value.
    let file = dir.path().join("fleet.json");
    let (code, _, err) = server.cli(&["fleet", "export", "--out", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(!text.contains("whsec_") && !text.contains(&own_secret) && !text.contains(&signing), "no secret value: {text}");
    let doc = read(&file);
    assert_eq!(doc["webhooks"][&by_ref]["secretRef"], json!(reference), "{doc}");
    assert!(doc["webhooks"][&own].get("secretRef").is_none(), "{doc}");
    assert_eq!(doc["webhooks"][&own]["description"], "own");
    assert_eq!(jsonschema_errors(dir.path(), &doc), "", "the export with webhooks must validate");
    let mut with_value = doc.clone();
    with_value["webhooks"][&by_ref]["secret"] = json!("whsec_not_in_a_document");
    assert_ne!(jsonschema_errors(dir.path(), &with_value), "", "a webhook's secret value is no field of the document");
    let (code, _, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--fail-on-drift", "--prune"]);
    assert_eq!(code, 0, "the export plans empty: {err}");

    // A receiver this deployment refuses (link-local: the metadata service's address) is in the
    // document's form but blocks the plan, naming it, not a 400.
    let mut refused = doc.clone();
    refused["webhooks"]["meta"] =
        json!({ "url": "https://169.254.169.254/hook", "eventTypes": ["pool.*"], "secretRef": reference });
    assert_eq!(jsonschema_errors(dir.path(), &refused), "", "the form is the schema's");
    write(&file, &refused);
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap()]);
    assert!(
        code == 1
            && fails_with(&err, "PLAN_BLOCKED")
            && err.contains("document.webhooks.meta")
            && err.contains("169.254.169.254"),
        "{out}{err}"
    );

    // A new webhook must name its secret by reference.
    let mut edited = doc.clone();
    edited["webhooks"]["ci"] = json!({ "url": receiver.url, "eventTypes": ["pool.*"], "description": "ci" });
    write(&file, &edited);
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap()]);
    assert!(code == 1 && fails_with(&err, "PLAN_BLOCKED") && out.contains("BLOCKED webhook ci"), "{out}{err}");

    // With one: created; the generated one's description changes, its secret stays; the one left
    // out is deleted with --prune.
    edited["webhooks"]["ci"]["secretRef"] = json!(reference);
    edited["webhooks"][&own]["description"] = json!("own, reviewed");
    edited["webhooks"].as_object_mut().unwrap().remove(&by_ref);
    write(&file, &edited);
    let (code, out, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--prune", "--calls"]);
    assert_eq!(code, 0, "{err}");
    for line in ["+ webhook ci", &format!("~ webhook {own}"), &format!("- webhook {by_ref}")] {
        assert!(out.contains(line), "{line} in {out}");
    }
    for call in ["webhooks.create", "webhooks.update", "webhooks.delete"] {
        assert!(out.contains(call), "{call} in {out}");
    }
    let hash = plan_hash(&out);
    let (code, out, err) = server.cli(&["fleet", "apply", file.to_str().unwrap(), "--prune", "--plan-hash", &hash]);
    assert_eq!(code, 0, "{out}{err}");
    let (status, list) = server.call("webhooks.list", json!({})).await;
    assert_eq!(status, 200, "{list}");
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{list}");
    let ci = items.iter().find(|w| w["description"] == "ci").expect("ci made");
    assert_eq!((&ci["secretRef"], &ci["secretVersion"]), (&json!(reference), &json!(0)), "{ci}");
    let mine = items.iter().find(|w| w["webhookId"] == own.as_str()).expect("own kept");
    assert_eq!((&mine["description"], &mine["secretVersion"]), (&json!("own, reviewed"), &json!(1)), "{mine}");
    assert!(mine["secretRef"].is_null(), "its generated secret is left alone: {mine}");
    let (code, _, err) = server.cli(&["fleet", "plan", file.to_str().unwrap(), "--fail-on-drift", "--prune"]);
    assert_eq!(code, 0, "applied: {err}");

    // Both sign: the created one with the referenced value, the kept one with its own secret.
    let pool = server.pool("after-the-apply").await;
    let (_, events) = server.call("events.list", json!({ "types": ["pool.created"], "limit": 500 })).await;
    let event = events["items"].as_array().unwrap().iter().find(|e| e["stream"] == format!("pool/{pool}")).unwrap().clone();
    let id = event["id"].as_str().unwrap().to_owned();
    let got =
        receiver.wait_for(std::time::Duration::from_secs(60), "two deliveries", |r| r.iter().filter(|r| r.id == id).count() >= 2);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let signs = |secret: &str| {
        let secret = Secret::parse(secret).unwrap();
        got.iter().filter(|r| r.id == id).any(|r| verify(&secret, &r.id, r.timestamp, &r.body, &r.signature, now))
    };
    assert!(signs(&signing), "the document's webhook signs with the referenced value");
    assert!(signs(&own_secret), "the kept webhook still signs with its own secret");

    // The secret is held by the webhook the document made.
    let (code, _, err) = server.cli(&["secrets", "delete", "hook-signing"]);
    let ci_id = ci["webhookId"].as_str().unwrap();
    assert!(code == 1 && err.contains("INVALID_STATE") && err.contains(ci_id), "{err}");
}
