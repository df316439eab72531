//! `GET /tunnels/{ticket}` through the gateway's router in process (`schema/TUNNELS.md`): what
//! it does before a socket exists. The node's agent is played through `Tunnels`' own interface
//! (`attach_session`, `agent_attached`), the one the agents' endpoint drives; the upgrade that
//! fails is hyper's own `OnUpgrade` of a request that has no connection to upgrade.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, header};
use bc_core::event::Position;
use bc_core::id::TenantId;
use bc_core::tunnel::{CAPABILITY_NODE_CONSOLE, Op};
use bc_gateway::AppState;
use bc_gateway::agents::ConnectionId;
use bc_gateway::tunnels::AgentEnd;
use bc_projections::decide::tunnel::TunnelGrant;
use serde_json::Value;
use tower::ServiceExt;

const NODE: &str = "node_01jd0000000000000000000000";

/// A gateway over a fresh log with `requests_max` request slots: its state, its router, the
/// administrator's token.
async fn gateway(dir: &std::path::Path, requests_max: usize) -> (Arc<AppState>, axum::Router, String) {
    let log = common::sqlite_log(dir).await;
    let token = common::admin_token(&log).await;
    let mut state = AppState::new(log);
    state.limits.requests_max = requests_max;
    let state = Arc::new(state);
    (state.clone(), bc_gateway::router(state), token)
}

/// A ticket for a console on [`NODE`], issued to the key of `token`.
fn ticket(state: &AppState, token: &str) -> String {
    let key_id = token.split('.').next().unwrap();
    let grant = TunnelGrant { op: Op::Console, node_id: NODE.into(), instance_id: None, port: None, command: Vec::new() };
    let now_ms = state.log.clock.now_ms();
    state.tunnels.issue(TenantId::ROOT, key_id, NODE, now_ms, |_, _| Ok(grant)).unwrap().0
}

/// The WebSocket upgrade of `/tunnels/{ticket}` as `token` (none: no `Authorization`), on a
/// request whose connection cannot be upgraded: its `OnUpgrade` fails once awaited.
fn upgrade_request(ticket: &str, token: Option<&str>) -> Request<Body> {
    let mut request = Request::get(format!("/tunnels/{ticket}"))
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_VERSION, "13")
        .header(header::SEC_WEBSOCKET_KEY, "dGhlIHNhbXBsZSBub25jZQ==")
        .header(header::SEC_WEBSOCKET_PROTOCOL, bc_core::tunnel::SUBPROTOCOL);
    if let Some(token) = token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let mut request = request.body(Body::empty()).unwrap();
    let no_connection = hyper::upgrade::on(Request::new(()));
    request.extensions_mut().insert(no_connection);
    request
}

async fn answer(response: axum::response::Response) -> (u16, Value) {
    let status = response.status().as_u16();
    // The OpenAPI document, read by one test here, is past 1 MiB (1.14 MB with sites, projects
    // and snapshots).
    let bytes = axum::body::to_bytes(response.into_body(), 8 << 20).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// The types of every event in the log.
async fn event_types(state: &AppState) -> Vec<String> {
    state.store.read_after_rows(Position::START, None, 1000).await.unwrap().into_iter().map(|row| row.event_type).collect()
}

/// The form of the ticket is checked before the caller is authenticated (a read of the store
/// and a hash): a malformed one is `NOT_FOUND` even without a token.
#[tokio::test]
async fn a_malformed_ticket_is_refused_before_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let (_state, router, _token) = gateway(dir.path(), 16).await;
    let (status, body) = answer(router.oneshot(upgrade_request("not-a-ticket", None)).await.unwrap()).await;
    assert_eq!((status, body["code"].as_str()), (404, Some("NOT_FOUND")), "{body}");
}

/// The upgrade holds a request slot of the gateway's one limit while it waits for the agent: with
/// one slot, a request behind it waits.
#[tokio::test]
async fn the_tunnels_route_is_under_the_gateways_request_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (state, router, token) = gateway(dir.path(), 1).await;
    // A session whose agent never attaches: the upgrade waits in its dial.
    let (_link, mut asked) = state.tunnels.attach_session(NODE, ConnectionId(1), vec![CAPABILITY_NODE_CONSOLE.into()]);
    let waiting = tokio::spawn(router.clone().oneshot(upgrade_request(&ticket(&state, &token), Some(&token))));
    asked.recv().await.expect("the session is asked to attach");
    // The OpenAPI document: a public route under the limit (`/healthz` is outside it).
    let public = || router.clone().oneshot(Request::get("/api/compute/openapi.json").body(Body::empty()).unwrap());
    assert!(tokio::time::timeout(Duration::from_millis(500), public()).await.is_err(), "the request took the only slot");
    waiting.abort();
    let _ = waiting.await;
    let (status, _) = answer(tokio::time::timeout(Duration::from_secs(5), public()).await.unwrap().unwrap()).await;
    assert_eq!(status, 200);
}

/// An upgrade answered `101` that then fails appends nothing, and gives the tunnel's place back:
/// `tunnel.opened` is appended only once the socket exists.
#[tokio::test]
async fn a_failed_upgrade_appends_nothing_and_gives_the_place_back() {
    let dir = tempfile::tempdir().unwrap();
    let (state, router, token) = gateway(dir.path(), 16).await;
    let (_link, mut asked) = state.tunnels.attach_session(NODE, ConnectionId(1), vec![CAPABILITY_NODE_CONSOLE.into()]);
    let agent = tokio::spawn({
        let state = state.clone();
        async move {
            let request = asked.recv().await.unwrap();
            let (to_node, from_gateway) = tokio::sync::mpsc::channel(4);
            let end = AgentEnd { from_node: Box::pin(futures::stream::pending()), to_node };
            assert!(state.tunnels.agent_attached(&request.tunnel_id, ConnectionId(1), end));
            from_gateway
        }
    });
    let ticket = ticket(&state, &token);
    let before = event_types(&state).await.len();
    let (status, _) = answer(router.oneshot(upgrade_request(&ticket, Some(&token))).await.unwrap()).await;
    assert_eq!(status, 101);
    let mut from_gateway = agent.await.unwrap();
    // The agent's end is dropped with the failed upgrade's callback, and so is the slot.
    tokio::time::timeout(Duration::from_secs(5), async { while from_gateway.recv().await.is_some() {} }).await.unwrap();
    assert_eq!(state.tunnels.open_in(TenantId::ROOT), 0);
    let types = event_types(&state).await;
    assert_eq!(types.len(), before, "nothing appended: {:?}", &types[before..]);
}
