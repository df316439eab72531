//! `RequestJoin` holds its bounds: anyone may ask, so at most `JOIN_REQUESTS_PENDING_MAX`
//! requests wait at once (a new machine past them is refused, a machine asking again is still
//! answered and appends nothing), a decision makes room, and an ask not signed by the key it
//! names is refused before anything is read.

use crate::common;

use std::sync::Arc;

use bc_core::error::ErrorCode;
use bc_core::id::TenantId;
use bc_gateway::AppState;
use bc_gateway::agents::join_request::{Asked, ask};
use bc_projections::decide::join_request::JOIN_REQUESTS_PENDING_MAX;
use bc_projections::{KIND_JOIN_REQUEST, KIND_JOIN_REQUEST_PENDING};
use ed25519_dalek::Signer;
use serde_json::json;

/// The ask of the machine whose key is made from `seed`, signed by it (or, `forged`, by another).
fn ask_of(seed: u64, forged: bool) -> bc_proto::JoinAsk {
    let key_of = |seed: u64| {
        let mut bytes = [0u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        ed25519_dalek::SigningKey::from_bytes(&bytes)
    };
    let key = key_of(seed);
    let public = key.verifying_key().to_bytes().to_vec();
    let mut signed = bc_proto::JOIN_ASK_SIGNING_PREFIX.to_vec();
    signed.extend_from_slice(&public);
    let signer = if forged { key_of(seed + 1_000_000) } else { key };
    bc_proto::JoinAsk {
        node_public_key: public,
        hardware: Some(bc_proto::HardwareClaims { hostname: format!("m{seed}"), gpus: vec![] }),
        agent_version: "0.1.0".into(),
        signature: signer.sign(&signed).to_bytes().to_vec(),
    }
}

async fn rows(state: &AppState, kind: &str) -> usize {
    state.store.row_list(&TenantId::ROOT.to_string(), kind, None, 1_000).await.unwrap().len()
}

#[tokio::test]
async fn asks_past_the_pending_bound_are_refused_until_a_decision_makes_room() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let token = common::admin_token(&log).await;
    let state = Arc::new(AppState::new(log.clone()));
    let router = bc_gateway::router(state.clone());

    let forged = ask(&state, ask_of(1, true)).await.err().expect("a forged ask");
    assert_eq!(forged.code(), ErrorCode::AccessDenied, "{forged}");
    assert_eq!(rows(&state, KIND_JOIN_REQUEST).await, 0, "a forged ask appends nothing");

    let mut first = None;
    for seed in 0..JOIN_REQUESTS_PENDING_MAX as u64 {
        match ask(&state, ask_of(seed, false)).await.unwrap() {
            Asked::Pending { id } => first = first.or(Some(id)),
            _ => panic!("a new request is pending"),
        }
    }
    let past = ask(&state, ask_of(JOIN_REQUESTS_PENDING_MAX as u64, false)).await.err().expect("an ask past the bound");
    assert_eq!(past.code(), ErrorCode::QuotaExceeded, "{past}");
    assert_eq!(rows(&state, KIND_JOIN_REQUEST_PENDING).await, JOIN_REQUESTS_PENDING_MAX);
    assert_eq!(rows(&state, KIND_JOIN_REQUEST).await, JOIN_REQUESTS_PENDING_MAX, "the refused ask appended nothing");
    // A machine that asked before is still answered, and adds nothing.
    assert!(matches!(ask(&state, ask_of(0, false)).await.unwrap(), Asked::Pending { .. }));
    assert_eq!(rows(&state, KIND_JOIN_REQUEST).await, JOIN_REQUESTS_PENDING_MAX);

    // Rejecting one makes room for one more.
    let first = first.unwrap().to_string();
    let (status, rejected) =
        common::call(&router, &token, "joinRequests.reject", json!({ "joinRequestId": first, "reason": "unknown" })).await;
    assert_eq!((status, rejected["state"].as_str()), (200, Some("rejected")), "{rejected}");
    assert!(matches!(ask(&state, ask_of(0, false)).await.unwrap(), Asked::Rejected { reason, .. } if reason == "unknown"));
    assert!(matches!(ask(&state, ask_of(JOIN_REQUESTS_PENDING_MAX as u64, false)).await.unwrap(), Asked::Pending { .. }));
    let past = ask(&state, ask_of(JOIN_REQUESTS_PENDING_MAX as u64 + 1, false)).await.err().expect("at the bound again");
    assert_eq!(past.code(), ErrorCode::QuotaExceeded, "{past}");
}
