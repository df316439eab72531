//! Regressions found in review of the reshape.

use bc_tests::Server;
use serde_json::json;

/// `nodes.label` / `nodes.taint` validated their keys before authorizing the caller, so a key
/// without `compute:nodes:write` got INVALID_ARGUMENT instead of ACCESS_DENIED, and an unknown
/// node with bad keys was INVALID_ARGUMENT instead of NOT_FOUND.
#[tokio::test]
async fn node_keys_are_checked_after_the_caller_and_the_node() {
    let server = Server::dev();
    let (status, key) = server.call("apiKeys.create", json!({ "name": "reader", "actions": ["compute:nodes:read"] })).await;
    assert_eq!(status, 200, "{key}");
    let reader = key["token"].as_str().unwrap();
    let pool = server.pool("gpu-a").await;
    let gpus = [json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 })];
    let (status, node) = server.call("nodes.register", json!({ "poolId": pool, "name": "n1", "gpus": gpus })).await;
    assert_eq!(status, 200, "{node}");
    for method in ["nodes.label", "nodes.taint"] {
        let body = json!({ "nodeId": node["nodeId"], "set": {} });
        let (status, answer) = server.call_as(reader, method, body, None).await;
        assert_eq!((status, answer["code"].as_str()), (403, Some("ACCESS_DENIED")), "{method}: {answer}");
        let unknown = json!({ "nodeId": "node_01m8md8t2hsbztp95s8efzj87k", "set": {} });
        let (status, answer) = server.call(method, unknown).await;
        assert_eq!((status, answer["code"].as_str()), (404, Some("NOT_FOUND")), "{method}: {answer}");
        let (status, answer) = server.call(method, json!({ "nodeId": node["nodeId"], "set": {} })).await;
        assert_eq!((status, answer["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{method}: {answer}");
    }
    // No method near a long, unlike name: no `didYouMean` at all (it was an empty string).
    let (status, answer) = server.call("zzzzzzzz.qqqqqqq", json!({})).await;
    assert_eq!(status, 404);
    assert!(answer["details"].get("didYouMean").is_none(), "{answer}");
}
