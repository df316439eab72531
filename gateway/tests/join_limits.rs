//! `Join` holds the same bounds as the API: a tenant at its node limit takes no machine through
//! a join token (as `nodes.register` takes none), and a join token revoked by the log (as the end
//! of a failed or aborted bare-metal deploy revokes its token) joins nothing.

use crate::common;

use std::sync::Arc;

use bc_core::id::{NodeId, PoolId, TenantId};
use bc_core::store::{AppendRequest, ExpectedVersion, Log, NewEvent};
use bc_gateway::AppState;
use bc_projections::decide::NODES_PER_TENANT_MAX;
use bc_projections::events as ev;
use bc_projections::{KIND_JOIN_TOKEN, KIND_NODE, stream_of};
use serde_json::json;

/// Nodes appended at once: the log's group commit takes them in a few transactions.
const NODES_AT_ONCE: usize = 256;

/// A join request for a new machine with `token`.
/// A join of machine `machine` (its node key) with `token`: one machine asking again is answered
/// with the node it made (`join::joined_before`), so the limit is met by another.
fn join_request(token: &str, machine: u8) -> bc_proto::JoinRequest {
    let key = ed25519_dalek::SigningKey::from_bytes(&[machine; 32]);
    bc_proto::JoinRequest {
        token: token.to_owned(),
        node_public_key: key.verifying_key().to_bytes().to_vec(),
        hardware: Some(bc_proto::HardwareClaims { hostname: "h1".into(), gpus: vec![] }),
        agent_version: "0.1.0".into(),
        node_id: String::new(),
        sealed_token: None,
    }
}

/// The root tenant's router, state and a pool with a join token of `uses` uses.
async fn pool_and_token(log: &Arc<Log>, uses: u32) -> (Arc<AppState>, PoolId, String, String) {
    let token = common::admin_token(log).await;
    let state = Arc::new(AppState::new(log.clone()));
    let router = bc_gateway::router(state.clone());
    let (status, pool) = common::call(&router, &token, "pools.create", json!({ "name": "gpu-a" })).await;
    assert_eq!(status, 200, "{pool}");
    let pool_id: PoolId = pool["poolId"].as_str().unwrap().parse().unwrap();
    let (status, created) =
        common::call(&router, &token, "joinTokens.create", json!({ "poolId": pool_id.to_string(), "uses": uses })).await;
    assert_eq!(status, 200, "{created}");
    let join_token = created["token"].as_str().unwrap().to_owned();
    let join_token_id = created["joinTokenId"].as_str().unwrap().to_owned();
    (state, pool_id, join_token, join_token_id)
}

#[tokio::test]
async fn a_join_past_the_tenants_node_limit_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let (state, pool, join_token, _) = pool_and_token(&log, 2).await;

    // One node short of the limit: the first join goes through.
    let registered = |_| {
        let payload = ev::to_cbor(&ev::NodeRegistered {
            pool_id: pool.to_string(),
            name: "n".into(),
            gpus: vec![],
            labels: Default::default(),
        })
        .unwrap();
        let node = NodeId::generate();
        let events = vec![NewEvent::new(ev::NODE_REGISTERED, payload)];
        log.append(AppendRequest::new(TenantId::ROOT, stream_of(KIND_NODE, &node), ExpectedVersion::NoStream, "test", events))
    };
    let short = (0..NODES_PER_TENANT_MAX - 1).collect::<Vec<_>>();
    for chunk in short.chunks(NODES_AT_ONCE) {
        for appended in futures::future::join_all(chunk.iter().map(registered)).await {
            appended.unwrap();
        }
    }
    bc_gateway::agents::join::join(&state, join_request(&join_token, 7)).await.expect("the join that reaches the limit");

    // At the limit: refused, and the token's second use is not spent.
    let refused =
        bc_gateway::agents::join::join(&state, join_request(&join_token, 8)).await.err().expect("a join past the limit");
    assert!(refused.to_string().contains(&format!("its limit of {NODES_PER_TENANT_MAX}")), "{refused}");
    let nodes = state.store.row_list(&TenantId::ROOT.to_string(), KIND_NODE, None, 5_000).await.unwrap();
    assert_eq!(nodes.len(), NODES_PER_TENANT_MAX);
}

#[tokio::test]
async fn a_join_token_revoked_in_the_log_joins_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let log = common::sqlite_log(dir.path()).await;
    let (state, _, join_token, join_token_id) = pool_and_token(&log, 1).await;
    // As a deploy that ends any way but success revokes its token: one event, the hash kept.
    let revoked = NewEvent::new(ev::JOIN_TOKEN_REVOKED, ev::to_cbor(&ev::JoinTokenRevoked {}).unwrap());
    let stream = stream_of(KIND_JOIN_TOKEN, &join_token_id);
    log.append(AppendRequest::new(TenantId::ROOT, stream, ExpectedVersion::Exact(1), "test", vec![revoked])).await.unwrap();
    let refused = bc_gateway::agents::join::join(&state, join_request(&join_token, 7)).await.err().expect("a revoked token");
    assert!(refused.to_string().contains("the join token was revoked"), "{refused}");
}
