//! Secrets at rest, through the real binary on each backend: the `secrets`
//! table holds no secret in clear text (webhook signing secrets, the hashes of API keys'
//! secrets), only values sealed under the data key in the data directory (0600); a row written
//! in clear before sealing existed is sealed at the next start; `pki rotate-data-key` re-seals
//! every row under a new key and the server, restarted, still authenticates and signs; the key
//! may be kept elsewhere (`--data-key-file`, `BETTER_COMPUTE_DATA_KEY_FILE`).

use bc_core::store::{EventStore, SecretStore};
use bc_core::testing::ScratchDatabase;
use bc_tests::Server;
use serde_json::json;

/// Every row of the `secrets` table as stored: (tenant, id, value).
async fn raw_rows(store: &dyn EventStore) -> Vec<(String, String, String)> {
    store.secrets_page_raw(None, 10_000).await.unwrap()
}

/// A webhook and an API key; returns the webhook's signing secret and the key's token.
async fn populate(server: &Server) -> (String, String) {
    let (status, hook) =
        server.call("webhooks.create", json!({ "url": "https://hooks.example.com/x", "eventTypes": ["pool.*"] })).await;
    assert_eq!(status, 200, "{hook}");
    let secret = hook["secret"].as_str().expect("the secret, shown once").to_owned();
    let (status, key) = server.call("apiKeys.create", json!({ "name": "reader", "actions": ["compute:pools:read"] })).await;
    assert_eq!(status, 200, "{key}");
    (secret, key["token"].as_str().unwrap().to_owned())
}

/// No row holds `secret` or the SHA-256 of the token's secret part, and every row is sealed,
/// under `key_id` when given.
fn assert_sealed(rows: &[(String, String, String)], secrets: &[&str], key_id: Option<&str>) {
    assert!(rows.len() >= 2, "the admin key, the webhook's secret, the reader key: {rows:?}");
    for (_, id, value) in rows {
        let named = bc_core::sealing::sealed_key_id(value);
        assert!(named.is_some(), "secret {id} is stored in clear: {value}");
        if let Some(key_id) = key_id {
            assert_eq!(named, Some(key_id), "secret {id} is sealed under another key: {rows:?}");
        }
        for secret in secrets {
            assert!(!value.contains(secret), "secret {id} holds a secret in clear");
        }
    }
}

/// The rows of a dev server's SQLite, read by a store opened for the purpose: one kept open
/// across another process's writes was seen to read an older snapshot (see the closing note).
async fn sqlite_rows(server: &Server) -> Vec<(String, String, String)> {
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    raw_rows(&store).await
}

fn data_key_id(server: &Server) -> String {
    bc_core::sealing::DataKey::load(&server.data_dir.join(bc_core::sealing::DATA_KEY_FILE)).unwrap().id().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_sealed_at_rest_a_clear_row_is_sealed_at_start_and_a_rotation_reseals_them() {
    use std::os::unix::fs::PermissionsExt;
    let mut server = Server::dev_with(&["--no-reconcilers"]);
    let (secret, token) = populate(&server).await;
    let key_path = server.data_dir.join(bc_core::sealing::DATA_KEY_FILE);
    assert_eq!(std::fs::metadata(&key_path).unwrap().permissions().mode() & 0o777, 0o600, "the data key is private");
    let first_key = data_key_id(&server);
    server.stop();

    let rows = sqlite_rows(&server).await;
    assert_sealed(&rows, &[&secret, &token], Some(&first_key));
    // Nor in the log or the server's log.
    for suffix in ["", "-wal", "-shm"] {
        let path = format!("{}{suffix}", server.sqlite_path().display());
        let bytes = std::fs::read(&path).unwrap_or_default();
        assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "{path} holds the secret");
    }
    assert!(!server.log_text().contains(&secret), "the server's log holds the secret");

    // A row written in clear (as before sealing existed) is sealed at the next start.
    let store = bc_core::store::sqlite::SqliteStore::open(&server.sqlite_path()).await.unwrap();
    store.secret_put_raw(bc_core::id::TenantId::ROOT, "legacy_plain", "clear text", 0).await.unwrap();
    drop(store);
    server.restart();
    let (status, _) = server.call("pools.list", json!({})).await;
    assert_eq!(status, 200, "the administrator's key still authenticates");
    server.stop();
    let rows = sqlite_rows(&server).await;
    assert_sealed(&rows, &[&secret, "clear text"], Some(&first_key));

    // Rotation: every row re-sealed under a new key; the old one is gone from the directory.
    let data_dir = server.data_dir.display().to_string();
    let (code, out, err) = bc_tests::cli(&["pki", "rotate-data-key", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let rotated = bc_tests::json(&out);
    assert_eq!(rotated["previousKeyId"], first_key.as_str());
    assert_eq!(rotated["resealed"].as_u64(), Some(rows.len() as u64), "{rotated} {rows:?}");
    let new_key = data_key_id(&server);
    assert_ne!(new_key, first_key);
    assert_eq!(rotated["keyId"], new_key.as_str());
    assert!(!server.data_dir.join(bc_core::sealing::DATA_KEY_NEXT_FILE).exists());
    assert_sealed(&sqlite_rows(&server).await, &[&secret], Some(&new_key));
    server.restart();
    let (status, whoami) = server.call_as(&token, "system.whoami", json!({}), None).await;
    assert_eq!(status, 200, "the reader's key opens under the new data key: {whoami}");
    let (status, hooks) = server.call("webhooks.list", json!({})).await;
    assert_eq!(status, 200, "{hooks}");
    let hook = hooks["items"][0]["webhookId"].as_str().unwrap().to_owned();
    let (status, rotated) = server.call("webhooks.rotateSecret", json!({ "webhookId": hook })).await;
    assert_eq!(status, 200, "a webhook's secret is rotated (the old one read and kept) under the new key: {rotated}");

    // A database whose secrets are sealed under a key the directory does not hold is refused
    // at start, before any key is made.
    server.stop();
    std::fs::rename(&key_path, server.data_dir.join("data.key.moved")).unwrap();
    let (code, _, err) = bc_tests::cli(&["reconcile", "--only", "webhooks", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("DATA_KEY_NOT_FOUND"), "{err}");
    assert!(!key_path.exists(), "no new key was made over the database's");

    // The key where an operator keeps it, named by the environment: the rotation finds it
    // there, re-seals every row and leaves the next key nowhere.
    let moved = server.data_dir.join("data.key.moved");
    let moved_text = moved.display().to_string();
    let (code, out, err) =
        bc_tests::cli(&["pki", "rotate-data-key", "--data-dir", &data_dir], &[("BETTER_COMPUTE_DATA_KEY_FILE", &moved_text)]);
    assert_eq!(code, 0, "{err}");
    let rotated = bc_tests::json(&out);
    assert_eq!(rotated["previousKeyId"], new_key.as_str());
    let moved_key = bc_core::sealing::DataKey::load(&moved).unwrap().id().to_owned();
    assert_eq!(rotated["keyId"], moved_key.as_str());
    assert_eq!(std::fs::metadata(&moved).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(!key_path.exists() && !bc_core::sealing::data_key_next_path(&moved).exists());
    assert_sealed(&sqlite_rows(&server).await, &[&secret], Some(&moved_key));
}

/// `dev` (and `serve`) with the data key outside the data directory (`--data-key-file`): made
/// there at first start, 0600, and nothing named data.key in the directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_data_key_may_live_outside_the_data_directory() {
    use std::os::unix::fs::PermissionsExt;
    let keys = tempfile::tempdir().unwrap();
    let path = keys.path().join("bc-data.key");
    let mut server = Server::dev_with(&["--no-reconcilers", "--data-key-file", &path.display().to_string()]);
    let (secret, token) = populate(&server).await;
    server.stop();
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(!server.data_dir.join(bc_core::sealing::DATA_KEY_FILE).exists(), "no key in the data directory");
    let key_id = bc_core::sealing::DataKey::load(&path).unwrap().id().to_owned();
    assert_sealed(&sqlite_rows(&server).await, &[&secret, &token], Some(&key_id));
    server.restart();
    let (status, whoami) = server.call_as(&token, "system.whoami", json!({}), None).await;
    assert_eq!(status, 200, "the key opens again from the same file: {whoami}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_sealed_at_rest_on_postgres() {
    let db = ScratchDatabase::create().await.expect("PostgreSQL is required for this suite");
    let (code, _, err) = bc_tests::cli(&["migrate", "--database-url", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    let mut server = Server::serve_postgres_with(&db.url, &["--no-reconcilers"]);
    let (secret, token) = populate(&server).await;
    let (status, _) = server.call_as(&token, "system.whoami", json!({}), None).await;
    assert_eq!(status, 200);
    let key_id = data_key_id(&server);
    server.stop();
    let store = bc_core::store::postgres::PostgresStore::connect(&db.url).await.unwrap();
    assert_sealed(&raw_rows(&store).await, &[&secret, &token], Some(&key_id));
}
