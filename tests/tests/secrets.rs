//! Write-only secrets end to end (issue 56): the real `better-compute dev` and CLI, a receiver on
//! loopback. A webhook that names a secret (`--secret-ref secret://…`) signs with the secret's
//! current value, checked at the receiver as Standard Webhooks says with that value; the value
//! is in no event, no API answer, no delivery, no line of the server's log and nowhere in its
//! data directory in the clear; a referenced secret is not deleted, and the refusal names the
//! webhook; `secrets list` shows names and versions only.

use std::path::Path;
use std::time::Duration;

use bc_core::webhook::{Secret, verify};
use bc_tests::Server;
use bc_tests::receiver::{Received, Receiver};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn verifies(secret: &Secret, r: &Received) -> bool {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    verify(secret, &r.id, r.timestamp, &r.body, &r.signature, now)
}

/// Every event of the server's tenant as `events.list` answers them, page by page.
async fn all_events(server: &Server) -> Vec<Value> {
    let mut events = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "limit": 500 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let (status, page) = server.call("events.list", body).await;
        assert_eq!(status, 200, "{page}");
        events.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return events,
        }
    }
}

/// The id of the last event of `event_type`.
async fn last_event(server: &Server, event_type: &str) -> Value {
    all_events(server).await.into_iter().rev().find(|e| e["type"] == event_type).unwrap_or_else(|| panic!("no {event_type}"))
}

/// Every file under `dir`, read whole.
fn files_under(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else if let Ok(bytes) = std::fs::read(&path) {
            out.push((path.display().to_string(), bytes));
        }
    }
    out
}

/// The rows of the dev's `secrets` table whose id starts with `prefix` (a secret's values).
async fn value_rows(server: &Server, prefix: &str) -> Vec<String> {
    let options = sqlx::sqlite::SqliteConnectOptions::new().filename(server.sqlite_path()).read_only(true);
    let pool = sqlx::SqlitePool::connect_with(options).await.expect("open the dev's database");
    let ids = sqlx::query_scalar("SELECT id FROM secrets WHERE id LIKE ?1 ORDER BY id")
        .bind(format!("{prefix}/%"))
        .fetch_all(&pool)
        .await
        .expect("read the secrets table");
    pool.close().await;
    ids
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_signs_with_a_referenced_secret_whose_value_appears_nowhere_else() {
    let server = Server::dev();
    let receiver = Receiver::start();
    let watcher = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let env = server.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    // Everything the CLI printed, on either stream: scanned for the values at the end.
    let mut outputs: Vec<String> = Vec::new();

    // A watcher with a secret of its own sees every event, resolutions included.
    let (code, out, err) = server.cli(&["webhooks", "create", "--endpoint", &watcher.url, "--types", "*"]);
    assert_eq!(code, 0, "{err}");
    outputs.push(out);

    // Put from a file: version 1, shown as a reference.
    let first = Secret::generate().expose();
    let file = dir.path().join("hook.secret");
    std::fs::write(&file, format!("{first}\n")).unwrap();
    let (code, out, err) = server.cli(&["secrets", "put", "hook-signing", "--value-file", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let put = bc_tests::json(&out);
    outputs.extend([out.clone(), err]);
    assert_eq!(put["secretVersion"], 1, "{put}");
    assert_eq!(put["name"], "hook-signing");
    let reference = put["ref"].as_str().unwrap().to_owned();
    let secret_id = put["secretId"].as_str().unwrap().to_owned();
    assert_eq!(reference, format!("secret://{}/{secret_id}", put["tenantId"].as_str().unwrap()));

    // A value never comes from an argument: there is no flag for one.
    let (code, _, err) = server.cli(&["secrets", "put", "other", "--value", "hunter2"]);
    assert_eq!(code, 2, "a usage error: {err}");

    // A webhook naming it: no secret of its own is made or shown.
    let (code, out, err) =
        server.cli(&["webhooks", "create", "--endpoint", &receiver.url, "--types", "pool.*", "--secret-ref", &reference]);
    assert_eq!(code, 0, "{err}");
    let created = bc_tests::json(&out);
    outputs.extend([out.clone(), err]);
    let webhook = created["webhookId"].as_str().unwrap().to_owned();
    assert!(created["secret"].is_null(), "no secret is shown for a reference: {created}");
    assert_eq!(created["secretRef"], json!(reference));

    // It signs with the referenced value.
    let pool = server.pool("signed-by-reference").await;
    let event = last_event(&server, "pool.created").await;
    assert_eq!(event["stream"], json!(format!("pool/{pool}")));
    let id = event["id"].as_str().unwrap().to_owned();
    let got = receiver.wait_for(WAIT, "the pool's delivery", |r| r.iter().any(|r| r.id == id));
    let delivery = got.iter().find(|r| r.id == id).unwrap();
    let first_secret = Secret::parse(&first).unwrap();
    assert!(verifies(&first_secret, delivery), "signed with the referenced value: {}", delivery.signature);
    assert_eq!(delivery.signature.split(' ').count(), 1, "one signature");

    // A new version from standard input: the next delivery signs with it, not with the first.
    let second = Secret::generate().expose();
    let (code, out, err) = bc_tests::cli_stdin(&["secrets", "put", "hook-signing", "--stdin"], &env, Some(&second));
    assert_eq!(code, 0, "{err}");
    let put = bc_tests::json(&out);
    outputs.extend([out.clone(), err]);
    assert_eq!((put["secretVersion"].as_u64(), put["secretId"].as_str()), (Some(2), Some(secret_id.as_str())));
    server.pool("after-the-second-version").await;
    let id = last_event(&server, "pool.created").await["id"].as_str().unwrap().to_owned();
    let got = receiver.wait_for(WAIT, "the delivery after the second version", |r| r.iter().any(|r| r.id == id));
    let delivery = got.iter().find(|r| r.id == id).unwrap();
    let second_secret = Secret::parse(&second).unwrap();
    assert!(verifies(&second_secret, delivery), "signed with version 2");
    assert!(!verifies(&first_secret, delivery), "version 1 signs no more");

    // A value that is no signing secret, put to the secret a webhook signs with: refused, naming
    // the webhook, and no version made.
    let (code, _, err) = bc_tests::cli_stdin(&["secrets", "put", "hook-signing", "--stdin"], &env, Some("hunter2"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains(&format!("webhook/{webhook}")), "{err}");
    assert!(!err.contains("hunter2"), "the value is never quoted: {err}");

    // Each version's value has a row of its own; the previous one is kept for deliveries that
    // read the secret just before the put.
    let rows = value_rows(&server, &secret_id).await;
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(rows[0].starts_with(&format!("{secret_id}/v1/")) && rows[1].starts_with(&format!("{secret_id}/v2/")), "{rows:?}");
    let puts: Vec<Value> = all_events(&server).await.into_iter().filter(|e| e["type"] == "secret.put").collect();
    assert_eq!(puts.last().unwrap()["payload"]["valueId"], json!(rows[1]), "the event names the row, not the value");

    // Each resolution is in the log once, without the value: the referrer and the version.
    let resolved: Vec<Value> = all_events(&server).await.into_iter().filter(|e| e["type"] == "secret.resolved").collect();
    let seen: Vec<(String, u64)> = resolved
        .iter()
        .map(|e| (e["payload"]["referrer"].as_str().unwrap().to_owned(), e["payload"]["secretVersion"].as_u64().unwrap()))
        .collect();
    assert_eq!(seen, vec![(format!("webhook/{webhook}"), 1), (format!("webhook/{webhook}"), 2)], "{resolved:#?}");
    for e in &resolved {
        assert_eq!(e["payload"]["secretId"], json!(secret_id));
        assert_eq!(e["stream"], json!(format!("secret_resolution/{secret_id}")));
    }

    // A referenced secret is not deleted; the refusal names the webhook.
    let (code, out, err) = server.cli(&["secrets", "delete", "hook-signing"]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("INVALID_STATE") && err.contains(&format!("webhook/{webhook}")), "{err}");
    outputs.extend([out, err]);
    // Nor is a webhook that signs with a reference given a secret of its own by rotating.
    let (code, _, err) = server.cli(&["webhooks", "rotate-secret", &webhook]);
    assert_ne!(code, 0);
    assert!(err.contains("INVALID_STATE") && err.contains(&reference), "{err}");
    outputs.push(err);

    // The list: names and versions, never values.
    let (code, out, err) = server.cli(&["secrets", "list", "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    let list = bc_tests::json(&out);
    outputs.push(out.clone());
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    let mut fields: Vec<&str> = items[0].as_object().unwrap().keys().map(String::as_str).collect();
    fields.sort_unstable();
    assert_eq!(
        fields,
        vec!["createdAtMs", "name", "ref", "secretId", "secretVersion", "tenantId", "updatedAtMs", "version"],
        "{list}"
    );
    assert_eq!(items[0]["secretVersion"], 2);
    let (code, out, _) = server.cli(&["secrets", "list"]);
    assert_eq!(code, 0);
    assert!(out.contains("hook-signing") && out.contains("NAME") && out.contains("VERSION"), "{out}");
    outputs.push(out);
    let (code, out, _) = server.cli(&["webhooks", "get", &webhook]);
    assert_eq!(code, 0);
    outputs.push(out);

    // Once no webhook names it, it goes, with its values.
    let (code, _, err) = server.cli(&["webhooks", "delete", &webhook]);
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = server.cli(&["secrets", "delete", "hook-signing"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(bc_tests::json(&out)["deleted"], true);
    outputs.push(out);
    assert_eq!(value_rows(&server, &secret_id).await, Vec::<String>::new(), "its values went with it");
    let (code, out, _) = server.cli(&["secrets", "list", "--format", "json"]);
    assert_eq!(code, 0);
    assert_eq!(bc_tests::json(&out)["items"], json!([]));

    // The watcher received every event up to now, each signed; none carries a value.
    let last = all_events(&server).await.last().unwrap()["id"].as_str().unwrap().to_owned();
    let watched = watcher.wait_for(WAIT, "every event at the watcher", |r| r.iter().any(|r| r.id == last));

    // The values are nowhere: not in an event, an answer, a delivery, the server's log, or any
    // file of its data directory (the database and its WAL hold them sealed).
    let events = serde_json::to_string(&all_events(&server).await).unwrap();
    assert!(events.contains("secret.put") && events.contains("secret.deleted"));
    let log = server.log_text();
    assert!(!log.is_empty(), "the server logs");
    for value in [&first, &second] {
        let body = value.strip_prefix("whsec_").unwrap();
        for (what, text) in [("events.list", events.as_str()), ("the server's log", log.as_str())] {
            assert!(!text.contains(body), "a value in {what}");
        }
        for out in &outputs {
            assert!(!out.contains(body), "a value in the CLI's output: {out}");
        }
        for r in &watched {
            assert!(!contains(&r.body, body), "a value in a delivery");
        }
        for (path, bytes) in files_under(&server.data_dir) {
            assert!(!contains(&bytes, body), "a value in the clear in {path}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_must_name_a_webhook_secret_of_the_same_tenant() {
    let server = Server::dev();
    let receiver = Receiver::start();
    let env = server.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (code, out, err) = bc_tests::cli_stdin(&["secrets", "put", "db-password", "--stdin"], &env, Some("hunter2"));
    assert_eq!(code, 0, "{err}");
    let put = bc_tests::json(&out);
    let reference = put["ref"].as_str().unwrap();
    // Not a whsec_ value: refused as the secret's state, naming it, never quoting the value.
    let (code, _, err) =
        server.cli(&["webhooks", "create", "--endpoint", &receiver.url, "--types", "*", "--secret-ref", reference]);
    assert_ne!(code, 0);
    assert!(err.contains("INVALID_STATE") && err.contains("db-password") && !err.contains("hunter2"), "{err}");
    // Another tenant's secret is not found from this one.
    let other = format!("secret://{}/{}", bc_core::id::TenantId::generate(), put["secretId"].as_str().unwrap());
    let (code, _, err) = server.cli(&["webhooks", "create", "--endpoint", &receiver.url, "--types", "*", "--secret-ref", &other]);
    assert_ne!(code, 0);
    assert!(err.contains("NOT_FOUND"), "{err}");
    // Malformed: refused before anything is read.
    let (status, body) =
        server.call("webhooks.create", json!({ "url": receiver.url, "eventTypes": ["*"], "secretRef": "secret://nope" })).await;
    assert_eq!(status, 400, "{body}");
    // A put with a stale ifVersion changes nothing.
    let (code, _, err) =
        bc_tests::cli_stdin(&["secrets", "put", "db-password", "--stdin", "--if-version", "7"], &env, Some("other"));
    assert_ne!(code, 0);
    assert!(err.contains("CONFLICT"), "{err}");
    let (_, list) = server.call("secrets.list", json!({})).await;
    assert_eq!(list["items"][0]["secretVersion"], 1, "{list}");
    // Deleting a name that is not there.
    let (code, _, err) = server.cli(&["secrets", "delete", "no-such-secret"]);
    assert_ne!(code, 0);
    assert!(err.contains("NOT_FOUND"), "{err}");
}

/// `reconcile --only webhooks`, a process of its own, resolves a reference too: it opens the
/// log with the data directory's log key and records the resolution before it delivers; its
/// log holds no value either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhooks_process_of_its_own_resolves_and_records_a_reference() {
    let server = Server::dev_with(&["--no-reconcilers"]);
    let receiver = Receiver::start();
    let dir = tempfile::tempdir().unwrap();
    let env = server.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let value = Secret::generate().expose();
    let (code, out, err) = bc_tests::cli_stdin(&["secrets", "put", "hook-signing", "--stdin"], &env, Some(&value));
    assert_eq!(code, 0, "{err}");
    let reference = bc_tests::json(&out)["ref"].as_str().unwrap().to_owned();
    let (code, out, err) =
        server.cli(&["webhooks", "create", "--endpoint", &receiver.url, "--types", "pool.*", "--secret-ref", &reference]);
    assert_eq!(code, 0, "{err}");
    let webhook = bc_tests::json(&out)["webhookId"].as_str().unwrap().to_owned();
    let data_dir = server.data_dir.display().to_string();
    let reconciler = bc_tests::Reconciler::start(
        &["--only", "webhooks", "--data-dir", &data_dir, "--webhook-allow-loopback", "--retry-base", "200ms"],
        dir.path(),
    );
    server.pool("delivered-by-its-own-process").await;
    let id = last_event(&server, "pool.created").await["id"].as_str().unwrap().to_owned();
    let got = receiver.wait_for(WAIT, "the delivery", |r| r.iter().any(|r| r.id == id));
    let delivery = got.iter().find(|r| r.id == id).unwrap();
    assert!(verifies(&Secret::parse(&value).unwrap(), delivery), "signed with the referenced value");
    let resolved = last_event(&server, "secret.resolved").await;
    assert_eq!(resolved["payload"]["referrer"], json!(format!("webhook/{webhook}")), "{resolved}");
    assert_eq!(resolved["actor"], "reconciler:webhooks", "{resolved}");
    let body = value.strip_prefix("whsec_").unwrap();
    assert!(!reconciler.log_text().contains(body) && !server.log_text().contains(body), "no value in either log");
}
