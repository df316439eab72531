//! Fair use of the API (issue 58, item 5), from outside: a key past its bucket is answered 429
//! `RATE_LIMITED` with `Retry-After`, another key of its tenant goes on until the tenant's bucket
//! is empty, the CLI waits out a short delay and sends the call once more, and a request id the
//! client gives comes back and is the events' correlation.

use std::time::Instant;

use bc_tests::Server;
use serde_json::{Value, json};

/// One call as `token`: (status, `Retry-After`, body).
async fn call(server: &Server, token: &str, method: &str) -> (u16, Option<String>, Value) {
    let response = reqwest::Client::new()
        .post(format!("{}/api/compute/{method}", server.url))
        .bearer_auth(token)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned());
    (response.status().as_u16(), retry_after, response.json().await.unwrap())
}

/// Calls as `token` until one is refused; how many passed, and the refusal.
async fn until_refused(server: &Server, token: &str) -> (u64, Option<String>, Value, f64) {
    let started = Instant::now();
    for passed in 0..50 {
        let (status, retry_after, body) = call(server, token, "system.whoami").await;
        if status != 200 {
            assert_eq!(status, 429, "{body}");
            return (passed, retry_after, body, started.elapsed().as_secs_f64());
        }
    }
    panic!("50 calls at rate 1/s were never refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_past_its_bucket_gets_429_and_another_key_of_its_tenant_waits_for_the_tenants() {
    let server =
        Server::dev_with(&["--rate-per-key", "1", "--burst-per-key", "3", "--rate-per-tenant", "1", "--burst-per-tenant", "5"]);
    let (status, key) = server.call("apiKeys.create", json!({ "name": "second", "actions": ["*"] })).await;
    assert_eq!(status, 200, "{key}");
    let second = key["token"].as_str().unwrap().to_owned();

    // The first key: its burst (3, one already spent creating the second key), then 429. At 1
    // token a second a slow machine may earn one more while it calls: the bound allows it.
    let (passed, retry_after, body, took_s) = until_refused(&server, &server.token).await;
    assert!((2..=2 + took_s.ceil() as u64).contains(&passed), "{passed} calls passed in {took_s:.2} s: {body}");
    assert_eq!(body["code"], "RATE_LIMITED", "{body}");
    assert!(body["message"].as_str().unwrap().starts_with("this API key made more than 1 requests a second"), "{body}");
    let wait_ms = body["details"]["retryAfterMs"].as_u64().unwrap();
    assert!((1..=1000).contains(&wait_ms), "{body}");
    assert_eq!(retry_after.as_deref(), Some("1"), "Retry-After in whole seconds, rounded up");

    // The second key of the same tenant goes on: the tenant's bucket (5) still holds 2 tokens,
    // fewer than the key's own 3, so the tenant's is the one that refuses.
    let (passed, _, body, took_s) = until_refused(&server, &second).await;
    assert!(passed >= 1, "the second key was not refused for the first key's rate: {body}");
    assert!(passed <= 2 + took_s.ceil() as u64, "{passed} in {took_s:.2} s");
    assert!(body["message"].as_str().unwrap().starts_with("this tenant's API keys"), "the tenant's bucket refused it: {body}");

    // A public method carries no key and is not counted.
    let response =
        reqwest::Client::new().post(format!("{}/api/compute/system.version", server.url)).json(&json!({})).send().await.unwrap();
    assert_eq!(response.status(), 200);

    // The CLI waits out the short delay and sends the call once more, which passes. Drained
    // first, so the CLI's first call is refused unless the wait it would be told is shorter
    // than the CLI's start (a few tries make that vanishingly rare).
    let mut retried = None;
    for _ in 0..5 {
        until_refused(&server, &server.token).await;
        let (code, out, err) = server.cli(&["api", "system.whoami"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("ten_00000000000000000000000000"), "{out}");
        if err.contains("retrying once") {
            retried = Some(err);
            break;
        }
    }
    let err = retried.expect("the CLI's first call was refused and retried in one of 5 tries");
    assert!(err.contains("RATE_LIMITED: this"), "the retry is said with the code: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_the_client_gives_comes_back_and_is_the_events_correlation() {
    let server = Server::dev();
    let http = reqwest::Client::new();
    let create = |name: &str, id: &str| {
        http.post(format!("{}/api/compute/pools.create", server.url))
            .bearer_auth(&server.token)
            .header("x-request-id", id)
            .json(&json!({ "name": name }))
            .send()
    };
    let response = create("by-id", "e2e-req.42:abc_Z").await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-request-id"], "e2e-req.42:abc_Z", "echoed");
    let pool: Value = response.json().await.unwrap();

    // Not of the accepted form (a space; longer than 64): replaced by one of the server's own.
    let too_long = "x".repeat(65);
    for bad in ["has space", too_long.as_str()] {
        let response = create(&format!("bad-{}", bad.len()), bad).await.unwrap();
        assert_eq!(response.status(), 200, "a bad request id never fails a call");
        let echoed = response.headers()["x-request-id"].to_str().unwrap().to_owned();
        assert!(echoed.starts_with("req_") && echoed != bad, "{echoed}");
    }

    let (status, page) =
        server.call("events.list", json!({ "stream": format!("pool/{}", pool["poolId"].as_str().unwrap()) })).await;
    assert_eq!(status, 200, "{page}");
    let event = &page["items"][0];
    assert_eq!(event["type"], "pool.created", "{page}");
    assert_eq!(event["correlation"], "e2e-req.42:abc_Z", "the client's id is the event's correlation: {event}");
}
