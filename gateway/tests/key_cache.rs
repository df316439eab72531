//! The API keys found live are taken from memory for `KEY_CACHE_TTL`: a key revoked
//! through this process is refused at once, through another process on the same database
//! within the TTL, and a cached key id never lets a different secret in.

use crate::common;

use common::call;

use std::sync::Arc;
use std::time::Duration;

use bc_gateway::AppState;
use bc_gateway::auth::KEY_CACHE_TTL;
use serde_json::json;

/// Two gateways (each its own key cache, as two `serve` processes have) over one log, and a
/// reader key made through the first.
async fn two_gateways() -> (tempfile::TempDir, axum::Router, axum::Router, String, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let (first, admin) = common::gateway_over(&log).await;
    let second = bc_gateway::router(Arc::new(AppState::new(log.clone())));
    let (status, key) =
        call(&first, &admin, "apiKeys.create", json!({ "name": "reader", "actions": ["compute:pools:read"] })).await;
    assert_eq!(status, 200, "{key}");
    let (token, key_id) = (key["token"].as_str().unwrap().to_owned(), key["keyId"].as_str().unwrap().to_owned());
    (dir, first, second, admin, token, key_id)
}

#[tokio::test]
async fn a_key_revoked_here_is_refused_at_once_and_through_another_gateway_within_the_ttl() {
    let (_dir, first, second, admin, reader, key_id) = two_gateways().await;
    // Both gateways have the key in memory now.
    for gateway in [&first, &second] {
        let (status, body) = call(gateway, &reader, "pools.list", json!({})).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = call(&first, &admin, "apiKeys.revoke", json!({ "keyId": key_id })).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = call(&first, &reader, "pools.list", json!({})).await;
    assert_eq!((status, body["code"].as_str()), (401, Some("UNAUTHENTICATED")), "refused at once where it was revoked");
    tokio::time::sleep(KEY_CACHE_TTL + Duration::from_millis(100)).await;
    let (status, body) = call(&second, &reader, "pools.list", json!({})).await;
    assert_eq!((status, body["code"].as_str()), (401, Some("UNAUTHENTICATED")), "refused by the other gateway after the TTL");
}

#[tokio::test]
async fn a_cached_key_id_with_another_secret_is_refused() {
    let (_dir, first, _second, _admin, reader, _key_id) = two_gateways().await;
    let (status, body) = call(&first, &reader, "pools.list", json!({})).await;
    assert_eq!(status, 200, "{body}");
    let (id, secret) = reader.split_once('.').unwrap();
    let mut forged = secret.to_owned();
    let last = if forged.ends_with('A') { "B" } else { "A" };
    forged.replace_range(forged.len() - 1.., last);
    let (status, body) = call(&first, &format!("{id}.{forged}"), "pools.list", json!({})).await;
    assert_eq!((status, body["code"].as_str()), (401, Some("UNAUTHENTICATED")), "{body}");
    // And the right one still works: the refusal did not evict or poison anything.
    let (status, body) = call(&first, &reader, "pools.list", json!({})).await;
    assert_eq!(status, 200, "{body}");
}
