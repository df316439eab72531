//! Hardening, end to end against the real `better-compute dev`: an unknown method's cost
//! without a token, a lost log key, no secret in logs, events or deliveries (on `serve` and
//! PostgreSQL), `quotas.set` as an operator action, and the SQLite files private whatever the
//! umask.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bc_core::store::LogStore;
use bc_core::store::sqlite::SqliteStore;
use bc_tests::{Server, binary};
use serde_json::json;

/// How long a refused start may take to exit.
const REFUSAL_TIMEOUT_S: u64 = 30;

/// Regression: a 64 KB method name, without a token, cost the server a "did you mean" against
/// every method. Now the request head is bounded (`conn::HEAD_BYTES_MAX`, 16 KiB), so a 64 KB
/// name is refused by HTTP itself, `431 Request Header Fields Too Large`, before any of the
/// gateway's code; a name that fits the head but not a method name's bound is `NOT_FOUND`
/// without a suggestion, and the answer repeats only the start of the name; a short typo still
/// gets its suggestion. (The work not done is counted in the gateway's unit test
/// `unknown_method_with_a_64_kib_name_computes_no_suggestion`.)
#[tokio::test]
async fn an_unknown_method_with_a_64_kb_name_is_not_found_without_a_suggestion() {
    let server = Server::dev();
    // 64 KB: a URI is at most 65,534 bytes (the `http` crate's bound).
    let name = "p".repeat(64_000);
    match server.http.post(format!("{}/api/compute/{name}", server.url)).body("{}").send().await {
        Ok(response) => assert_eq!(response.status().as_u16(), 431, "a 64 KB head is refused by its bound"),
        // The server closes the connection after its 431 with the rest of the request unread;
        // the kernel may then reset it before the client reads the answer.
        Err(e) => assert!(e.is_request() || e.is_connect() || e.is_body(), "refused or reset: {e:?}"),
    }
    assert_eq!(server.http.get(format!("{}/healthz", server.url)).send().await.expect("healthz").status().as_u16(), 200);

    let name = "p".repeat(12_000);
    let response = server.http.post(format!("{}/api/compute/{name}", server.url)).body("{}").send().await.expect("request");
    assert_eq!(response.status().as_u16(), 404);
    let body: serde_json::Value = response.json().await.expect("json");
    assert_eq!(body["code"], "NOT_FOUND");
    assert!(body["details"].get("didYouMean").is_none(), "no suggestion for an over-long name: {}", body["details"]);
    assert!(body.to_string().len() < 400, "the answer repeats a bounded part of the name: {} bytes", body.to_string().len());

    let response = server.http.post(format!("{}/api/compute/pools.lsit", server.url)).body("{}").send().await.expect("request");
    assert_eq!(response.status().as_u16(), 404);
    let body: serde_json::Value = response.json().await.expect("json");
    assert_eq!(body["details"]["didYouMean"], "pools.list");
}

/// `better-compute dev` on `data_dir` again: (exit status, stderr) once it exits. A start that
/// is not refused prints its URL instead; it is stopped and the test fails.
fn start_again(data_dir: &Path) -> (i32, String) {
    let dir = data_dir.display().to_string();
    let mut child = Command::new(binary("better-compute"))
        .args(["dev", "--data-dir", &dir, "--listen", "127.0.0.1:0", "--agents-listen", "127.0.0.1:0"])
        .env_remove("BETTER_COMPUTE_DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start better-compute");
    let deadline = Instant::now() + Duration::from_secs(REFUSAL_TIMEOUT_S);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
            return (status.code().unwrap_or(-1), stderr);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let mut stdout = String::new();
            let _ = std::io::Read::read_to_string(&mut child.stdout.take().expect("stdout"), &mut stdout);
            panic!("dev started instead of refusing: {stdout}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// (last commit, signing keys) of the data directory's database.
async fn log_state(sqlite: &Path) -> (u64, Vec<String>) {
    let store = SqliteStore::open(sqlite).await.expect("open");
    let keys = store.signing_keys().await.expect("keys").into_iter().map(|(id, _)| id).collect();
    (store.last_commit().await.expect("last commit"), keys)
}

/// Regression: with `log.key` moved away, `dev` created a new key and kept appending under it,
/// and `audit verify` then called the log tampered. It refuses to start (exit 1, a hint naming
/// `pki` and the data directory), creates no key and appends nothing; so does a foreign key,
/// and a half-done rotation (`log.key.next`) is refused with how to finish it.
#[tokio::test]
async fn a_lost_log_key_is_refused_not_replaced() {
    let mut server = Server::dev();
    server.pool("before").await;
    server.stop();
    let dir = server.data_dir.clone();
    let key = dir.join("log.key");
    let before = log_state(&server.sqlite_path()).await;

    // Moved away: refused, and no new key is made.
    let moved = dir.join("log.key.moved");
    std::fs::rename(&key, &moved).unwrap();
    let (code, stderr) = start_again(&dir);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("PKI_NOT_FOUND") && stderr.contains("pki show"), "{stderr}");
    assert!(stderr.contains(&dir.display().to_string()), "the hint names the data directory: {stderr}");
    assert!(!key.exists(), "no new log key was created");
    assert_eq!(log_state(&server.sqlite_path()).await, before, "nothing appended, no key registered");

    // Another key in its place: refused too.
    std::fs::write(&key, format!("{}\n", bc_core::keys::LogKey::generate().seed_hex())).unwrap();
    let (code, stderr) = start_again(&dir);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("PKI_MISMATCH") && stderr.contains("pki show"), "{stderr}");
    assert_eq!(log_state(&server.sqlite_path()).await, before);

    // A rotation that wrote log.key.next and stopped: refused, with how to finish.
    std::fs::rename(&moved, &key).unwrap();
    let next = dir.join("log.key.next");
    std::fs::write(&next, format!("{}\n", bc_core::keys::LogKey::generate().seed_hex())).unwrap();
    let (code, stderr) = start_again(&dir);
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("PKI_ROTATION_INTERRUPTED") && stderr.contains("rotate-log-key"), "{stderr}");
    assert!(stderr.contains("delete") && stderr.contains("log.key.next"), "the rotation was not recorded: {stderr}");
    assert_eq!(log_state(&server.sqlite_path()).await, before);

    // The key back, nothing half done: it starts, and the log still verifies.
    std::fs::remove_file(&next).unwrap();
    server.restart();
    assert_eq!(server.call("pools.list", json!({})).await.0, 200);
    let (code, out, err) = server.cli(&["audit", "verify", "--data-dir", &dir.display().to_string()]);
    assert_eq!(code, 0, "{out}{err}");
}

/// Regression: `quotas.set` was allowed to a tenant's own key, so a tenant could raise its own
/// quota. Only the root tenant's administrators set quotas; the tenant still reads its quota.
#[tokio::test]
async fn a_tenant_cannot_set_its_own_quota() {
    let server = Server::dev();
    let acme = server.tenant("acme").await;
    let pool = server.tenant_pool(&acme, "acme-a").await;
    let (status, key) = server.call("apiKeys.create", json!({ "tenantId": acme, "name": "owner", "actions": ["*"] })).await;
    assert_eq!(status, 200, "{key}");
    let owner = key["token"].as_str().unwrap().to_owned();

    let (status, body) = server.call_as(&owner, "quotas.set", json!({ "poolId": pool, "gpus": 1000 }), None).await;
    assert_eq!((status, body["code"].as_str()), (403, Some("ACCESS_DENIED")), "{body}");
    let (status, quota) = server.call_as(&owner, "quotas.get", json!({ "poolId": pool }), None).await;
    assert_eq!(status, 200, "{quota}");
    assert!(quota["gpus"].is_null(), "no quota was set: {quota}");

    let (status, body) = server.call("quotas.set", json!({ "tenantId": acme, "poolId": pool, "gpus": 4 })).await;
    assert_eq!(status, 200, "the root tenant's administrator sets it: {body}");
    let (_, quota) = server.call_as(&owner, "quotas.get", json!({ "poolId": pool }), None).await;
    assert_eq!(quota["gpus"], 4);
}

/// Regression: the SQLite file and its `-wal` and `-shm` took the umask when the data directory
/// already existed. With umask 000 and an existing directory, all three are 0600.
#[test]
fn the_sqlite_files_are_private_under_a_permissive_umask() {
    let temp = tempfile::Builder::new().prefix("bc-e2e-umask-").tempdir().expect("tempdir");
    let dir = temp.path().display().to_string();
    let better_compute = binary("better-compute").display().to_string();
    let mut child = Command::new("sh")
        .args([
            "-c",
            "umask 000; exec \"$0\" dev --data-dir \"$1\" --listen 127.0.0.1:0 --agents-listen 127.0.0.1:0",
            &better_compute,
            &dir,
        ])
        .env_remove("BETTER_COMPUTE_DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start better-compute");
    let mut first = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut first).expect("first line");
    let modes: Vec<(String, u32)> = ["better-compute.sqlite3", "better-compute.sqlite3-wal", "better-compute.sqlite3-shm"]
        .iter()
        .map(|name| {
            let metadata = std::fs::metadata(temp.path().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name.to_string(), metadata.permissions().mode() & 0o777)
        })
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    assert!(first.contains("listening"), "{first}");
    for (name, mode) in modes {
        assert_eq!(mode, 0o600, "{name} has mode {mode:o}");
    }
}

/// What the server stores of a token's secret: hex SHA-256 (`bc_gateway::auth::secret_sha256`).
fn token_hash(secret: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(secret.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

/// Regression: with debug logging, tokio-postgres logged statement parameters (`whsec_` secrets
/// included); webhook URLs (which may carry a token) went into events and out to other
/// webhooks' receivers; `api_key.created` carried the key's hash into the log and out to
/// receivers. On PostgreSQL with `BETTER_COMPUTE_LOG=debug`: after creating keys and webhooks
/// and rotating a secret, no log line, event view or delivery contains a secret, a token hash,
/// or a URL's query; the keys still authenticate, also after a rebuild.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_event_or_delivery_contains_a_secret() {
    let db = bc_core::testing::ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let mut server = Server::with_log_filter("debug", || {
        Server::serve_postgres_with(&db.url, &["--webhook-allow-loopback", "--retry-base", "100ms"])
    });
    let receiver = bc_tests::receiver::Receiver::start();
    // Every event of the tenant goes to the receiver, whose own URL carries a token.
    let watched = format!("{}?token=URLQUERYSECRET", receiver.url);
    let (status, webhook) = server.call("webhooks.create", json!({ "url": watched, "eventTypes": ["*"] })).await;
    assert_eq!(status, 200, "{webhook}");
    let mut secrets = vec![webhook["secret"].as_str().unwrap().to_owned()];
    let webhook_id = webhook["webhookId"].as_str().unwrap().to_owned();
    // Another webhook, with a token in its URL: its webhook.created goes to the first. (A URL
    // with userinfo is refused outright; its redaction is the projections' unit test.)
    let other_url = format!("{}?sig=OTHERQUERYSECRET", receiver.url);
    let (status, other) = server.call("webhooks.create", json!({ "url": other_url, "eventTypes": ["pool.*"] })).await;
    assert_eq!(status, 200, "{other}");
    secrets.push(other["secret"].as_str().unwrap().to_owned());
    let (status, rotated) = server.call("webhooks.rotateSecret", json!({ "webhookId": webhook_id })).await;
    assert_eq!(status, 200, "{rotated}");
    secrets.push(rotated["secret"].as_str().unwrap().to_owned());
    let (status, key) = server.call("apiKeys.create", json!({ "name": "ci", "actions": ["compute:pools:read"] })).await;
    assert_eq!(status, 200, "{key}");
    let token = key["token"].as_str().unwrap().to_owned();
    let key_secret = token.split_once('.').unwrap().1.to_owned();
    let mut hashes = vec![token_hash(&key_secret)];
    hashes.push(token_hash(server.token.split_once('.').unwrap().1));
    let (status, _) = server.call_as(&token, "pools.list", json!({}), None).await;
    assert_eq!(status, 200, "the new key authenticates");

    let received = receiver.wait_for(Duration::from_secs(30), "the key's and the webhooks' events", |r| {
        let bodies: Vec<String> = r.iter().map(|d| String::from_utf8_lossy(&d.body).into_owned()).collect();
        ["api_key.created", "webhook.created", "webhook.secret_rotated"].iter().all(|t| bodies.iter().any(|b| b.contains(t)))
    });
    let (status, events) = server.call("events.list", json!({ "limit": 500 })).await;
    assert_eq!(status, 200, "{events}");
    let mut texts = vec![("the server log".to_owned(), server.log_text()), ("events.list".to_owned(), events.to_string())];
    for (i, delivery) in received.iter().enumerate() {
        texts.push((format!("delivery {i}"), String::from_utf8_lossy(&delivery.body).into_owned()));
    }
    assert!(texts[0].1.contains("DEBUG") || texts[0].1.contains("\"level\":\"DEBUG\""), "debug logging is on");
    let forbidden: Vec<String> = secrets
        .iter()
        .chain(&hashes)
        .cloned()
        .chain([key_secret.clone(), "URLQUERYSECRET".into(), "OTHERQUERYSECRET".into()])
        .collect();
    for (what, text) in &texts {
        for secret in &forbidden {
            assert!(!text.contains(secret.as_str()), "{what} contains a secret ({}…)", &secret[..secret.len().min(12)]);
        }
    }
    // The URLs are still recognisable where they are redacted, and whole for their owner.
    assert!(events.to_string().contains(&format!("{}?REDACTED", receiver.url)), "{events}");
    let (_, got) = server.call("webhooks.get", json!({ "webhookId": webhook_id })).await;
    assert_eq!(got["url"], watched.as_str());

    // A rebuild from the log (which has no hashes) still authenticates every key.
    server.stop();
    let (code, _, err) = bc_tests::cli(&["projections", "rebuild", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    server.restart();
    let (status, _) = server.call_as(&token, "pools.list", json!({}), None).await;
    assert_eq!(status, 200, "the key authenticates after a rebuild");
    let (status, _) = server.call("pools.list", json!({})).await;
    assert_eq!(status, 200, "the bootstrap key too");
}
