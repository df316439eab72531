//! Bad input over HTTP: each gets its code and status, and appends nothing.

use bc_tests::Server;
use serde_json::json;

/// (what, method, body, headers, status, code)
type Case<'a> = (&'a str, &'a str, Vec<u8>, Vec<(&'a str, &'a str)>, u16, &'a str);

#[tokio::test]
async fn bad_requests_get_their_codes_and_append_nothing() {
    let server = Server::dev();
    let pool = server.pool("p").await;
    let before = server.last_commit().await;
    let auth = format!("Bearer {}", server.token);
    let json_headers = [("authorization", auth.as_str()), ("content-type", "application/json")];

    // A well-formed create whose caller is not who it says.
    let unauthenticated =
        |what, headers| -> Case { (what, "pools.create", br#"{"name":"x"}"#.to_vec(), headers, 401, "UNAUTHENTICATED") };
    let cases: Vec<Case> = vec![
        ("malformed JSON", "pools.create", b"{\"name\": ".to_vec(), json_headers.to_vec(), 400, "INVALID_ARGUMENT"),
        ("not an object", "pools.create", b"[1,2]".to_vec(), json_headers.to_vec(), 400, "INVALID_ARGUMENT"),
        (
            "unknown field",
            "pools.create",
            br#"{"name":"x","colour":"red"}"#.to_vec(),
            json_headers.to_vec(),
            400,
            "INVALID_ARGUMENT",
        ),
        ("wrong type", "pools.create", br#"{"name":7}"#.to_vec(), json_headers.to_vec(), 400, "INVALID_ARGUMENT"),
        ("bad name", "pools.create", br#"{"name":"Has Spaces"}"#.to_vec(), json_headers.to_vec(), 400, "INVALID_ARGUMENT"),
        (
            "oversize body",
            "pools.create",
            {
                let mut b = br#"{"name":"x","description":""#.to_vec();
                b.extend(std::iter::repeat_n(b'a', 2 * 1024 * 1024));
                b.extend(br#""}"#);
                b
            },
            json_headers.to_vec(),
            413,
            "PAYLOAD_TOO_LARGE",
        ),
        ("malformed id", "pools.get", br#"{"poolId":"pool_123"}"#.to_vec(), json_headers.to_vec(), 400, "INVALID_ARGUMENT"),
        (
            "id of another kind",
            "nodes.register",
            format!(r#"{{"poolId":"{}","name":"n","gpus":[]}}"#, pool.replace("pool_", "node_")).into_bytes(),
            json_headers.to_vec(),
            400,
            "INVALID_ARGUMENT",
        ),
        (
            "unknown pool",
            "nodes.register",
            br#"{"poolId":"pool_00000000000000000000000000","name":"n","gpus":[]}"#.to_vec(),
            json_headers.to_vec(),
            404,
            "NOT_FOUND",
        ),
        (
            "vram out of range",
            "nodes.register",
            format!(
                r#"{{"poolId":"{pool}","name":"n","gpus":[{{"model":"H100","product":"H100","vramGiB":0,"nvlinkDomain":0}}]}}"#
            )
            .into_bytes(),
            json_headers.to_vec(),
            400,
            "INVALID_ARGUMENT",
        ),
        ("limit out of range", "pools.list", br#"{"limit":100000}"#.to_vec(), json_headers.to_vec(), 400, "INVALID_ARGUMENT"),
        ("malformed cursor", "events.list", br#"{"cursor":"12;drop"}"#.to_vec(), json_headers.to_vec(), 400, "INVALID_ARGUMENT"),
        (
            "float in body",
            "pools.update",
            format!(r#"{{"poolId":"{pool}","ifVersion":1.5}}"#).into_bytes(),
            json_headers.to_vec(),
            400,
            "INVALID_ARGUMENT",
        ),
        (
            "wrong content type",
            "pools.create",
            br#"{"name":"x"}"#.to_vec(),
            vec![("authorization", auth.as_str()), ("content-type", "text/plain")],
            400,
            "INVALID_ARGUMENT",
        ),
        unauthenticated("missing token", vec![("content-type", "application/json")]),
        unauthenticated("not bearer", vec![("authorization", "Basic YTpi"), ("content-type", "application/json")]),
        unauthenticated(
            "wrong token",
            vec![("authorization", "Bearer key_00000000000000000000000000.bogus"), ("content-type", "application/json")],
        ),
        unauthenticated("garbage token", vec![("authorization", "Bearer ###.###"), ("content-type", "application/json")]),
        ("unknown method", "pools.destroy", b"{}".to_vec(), json_headers.to_vec(), 404, "NOT_FOUND"),
        (
            "bad idempotency key",
            "pools.create",
            br#"{"name":"x"}"#.to_vec(),
            vec![("authorization", auth.as_str()), ("content-type", "application/json"), ("idempotency-key", "has space")],
            400,
            "INVALID_ARGUMENT",
        ),
    ];
    for (what, method, body, headers, status, code) in cases {
        let (got_status, got) = server.raw(method, body, &headers).await;
        assert_eq!((got_status, got["code"].as_str()), (status, Some(code)), "{what}: {got}");
        assert!(got["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: a message");
        assert!(got["details"].is_object(), "{what}: details");
    }
    assert_eq!(server.last_commit().await, before, "bad input appended something");
    let (_, pools) = server.call("pools.list", json!({})).await;
    assert_eq!(pools["items"].as_array().unwrap().len(), 1);
}
