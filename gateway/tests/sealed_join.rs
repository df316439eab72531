//! `Join` with a token sealed to the join encryption key (docs/admission.md, "The sealed join
//! token"), in process: a token sealed for another node key, one whose ciphertext was changed,
//! one sealed to another deployment's key, and one sent both sealed and plain are each refused
//! with the token unspent; the right one joins; a gateway without join keys refuses a sealed
//! token but still takes a plain one; and one that takes sealed tokens only refuses a plain one.

use crate::common;

use std::sync::Arc;

use bc_core::store::Log;
use bc_core::well_known::{JoinEncryptionKey, seal_join_token};
use bc_gateway::AppState;
use bc_gateway::join_keys::JoinKeys;
use serde_json::json;

const NODE_SEED: [u8; 32] = [7; 32];

fn node_public_key() -> Vec<u8> {
    ed25519_dalek::SigningKey::from_bytes(&NODE_SEED).verifying_key().to_bytes().to_vec()
}

/// A seeded RNG: a test's sealing need not be secret.
fn rng() -> rand::rngs::StdRng {
    rand::SeedableRng::seed_from_u64(11)
}

fn request(token: String, sealed: Option<bc_proto::SealedJoinToken>) -> bc_proto::JoinRequest {
    bc_proto::JoinRequest {
        token,
        node_public_key: node_public_key(),
        hardware: Some(bc_proto::HardwareClaims { hostname: "h1".into(), gpus: vec![] }),
        agent_version: "0.1.0".into(),
        node_id: String::new(),
        sealed_token: sealed,
    }
}

fn sealed_to(key: &JoinEncryptionKey, token: &str, node_public_key: &[u8]) -> bc_proto::SealedJoinToken {
    let sealed = seal_join_token(key.public(), token.as_bytes(), node_public_key, &mut rng()).unwrap();
    bc_proto::SealedJoinToken { enc: sealed.enc, ciphertext: sealed.ciphertext, key_pin: key.pin() }
}

/// A state with `keys` (or none), taking sealed tokens only or not, a pool and a one-use join
/// token: (state, token, its id).
async fn setup(log: &Arc<Log>, keys: Option<JoinKeys>, sealed_only: bool) -> (Arc<AppState>, String, String) {
    let admin = common::admin_token(log).await;
    let mut state = AppState::new(log.clone()).with_sealed_joins_only(sealed_only);
    if let Some(keys) = keys {
        state = state.with_join_keys(Arc::new(keys), None);
    }
    let state = Arc::new(state);
    let router = bc_gateway::router(state.clone());
    let (status, pool) = common::call(&router, &admin, "pools.create", json!({ "name": "gpu-a" })).await;
    assert_eq!(status, 200, "{pool}");
    let (status, created) =
        common::call(&router, &admin, "joinTokens.create", json!({ "poolId": pool["poolId"], "uses": 1 })).await;
    assert_eq!(status, 200, "{created}");
    (state, created["token"].as_str().unwrap().to_owned(), created["joinTokenId"].as_str().unwrap().to_owned())
}

async fn uses(state: &AppState, token_id: &str) -> u64 {
    let row = state.store.row_find(bc_projections::KIND_JOIN_TOKEN, token_id).await.unwrap().expect("the token's row");
    row.doc["uses"].as_u64().unwrap()
}

#[tokio::test]
async fn a_sealed_token_joins_only_intact_for_its_node_key_and_this_deployments_key() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let keys = JoinKeys::from_seeds(&[1; 32], &[2; 32]);
    let ours = keys.encryption().clone();
    let (state, token, token_id) = setup(&log, Some(keys), false).await;
    let join = |request| bc_gateway::agents::join::join(&state, request);

    // Sealed for another node key (the associated data): a sealed token lifted off the wire does
    // not join another machine.
    let lifted = sealed_to(&ours, &token, &[9; 32]);
    let refused = join(request(String::new(), Some(lifted))).await.err().expect("another node key");
    assert!(refused.to_string().contains("does not open"), "{refused}");
    // One byte of the ciphertext changed.
    let mut tampered = sealed_to(&ours, &token, &node_public_key());
    tampered.ciphertext[3] ^= 1;
    let refused = join(request(String::new(), Some(tampered))).await.err().expect("a tampered token");
    assert!(refused.to_string().contains("does not open"), "{refused}");
    // Sealed to another deployment's key: said so, by its pin.
    let theirs = JoinEncryptionKey::from_secret(&[3; 32]);
    let refused = join(request(String::new(), Some(sealed_to(&theirs, &token, &node_public_key())))).await.err().unwrap();
    assert!(refused.to_string().contains("another join encryption key"), "{refused}");
    // The pin left out, the wrong key all the same: it does not open.
    let mut unnamed = sealed_to(&theirs, &token, &node_public_key());
    unnamed.key_pin.clear();
    assert!(join(request(String::new(), Some(unnamed))).await.is_err());
    // Both sealed and plain.
    let both = join(request(token.clone(), Some(sealed_to(&ours, &token, &node_public_key())))).await.err().unwrap();
    assert_eq!(both.code(), bc_core::ErrorCode::InvalidArgument, "{both}");
    assert_eq!(uses(&state, &token_id).await, 0, "nothing refused spent the token");

    // Intact, for this node's key, to this deployment's key: joined.
    let joined = join(request(String::new(), Some(sealed_to(&ours, &token, &node_public_key())))).await.expect("the sealed join");
    let identity: serde_json::Value = serde_json::from_slice(&joined.identity).unwrap();
    assert!(identity["nodeId"].as_str().unwrap().starts_with("node_"), "{identity}");
    assert_eq!(uses(&state, &token_id).await, 1);
}

#[tokio::test]
async fn a_gateway_without_join_keys_refuses_a_sealed_token_and_takes_a_plain_one() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let (state, token, token_id) = setup(&log, None, false).await;
    let key = JoinEncryptionKey::from_secret(&[2; 32]);
    let refused =
        bc_gateway::agents::join::join(&state, request(String::new(), Some(sealed_to(&key, &token, &node_public_key()))))
            .await
            .err()
            .unwrap();
    assert!(refused.to_string().contains("no join encryption key"), "{refused}");
    assert_eq!(uses(&state, &token_id).await, 0);
    bc_gateway::agents::join::join(&state, request(token, None)).await.expect("a plain token is still taken");
    assert_eq!(uses(&state, &token_id).await, 1);
}

#[tokio::test]
async fn a_gateway_that_takes_sealed_tokens_only_refuses_a_plain_one_unspent() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let keys = JoinKeys::from_seeds(&[1; 32], &[2; 32]);
    let ours = keys.encryption().clone();
    let (state, token, token_id) = setup(&log, Some(keys), true).await;
    let refused = bc_gateway::agents::join::join(&state, request(token.clone(), None)).await.err().expect("a plain token");
    assert!(refused.to_string().contains("only sealed"), "{refused}");
    assert!(!refused.to_string().contains(&token), "the token is not repeated: {refused}");
    assert_eq!(uses(&state, &token_id).await, 0, "refused before it was looked at");
    let sealed = sealed_to(&ours, &token, &node_public_key());
    bc_gateway::agents::join::join(&state, request(String::new(), Some(sealed))).await.expect("the sealed join");
    assert_eq!(uses(&state, &token_id).await, 1);
}
