//! The live stream end to end: `better-compute events watch` against the real server, through a
//! kill -9 and restart mid-stream; and its refusals.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bc_tests::Server;
use serde_json::{Value, json};

fn watcher(server: &Server, args: &[&str]) -> std::process::Child {
    Command::new(bc_tests::binary("better-compute"))
        .args(["events", "watch"])
        .args(args)
        .env("BETTER_COMPUTE_URL", &server.url)
        .env("BETTER_COMPUTE_TOKEN", &server.token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the watcher")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_every_event_once_in_order_across_a_restart() {
    let mut server = Server::dev();
    // 2 bootstrap events, 3 pools, restart, 3 pools: 8 events. A watch starts at the end of the
    // log unless told otherwise: `--since start` replays the bootstrap events too.
    let mut child = watcher(&server, &["--since", "start", "--count", "8"]);
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines: Vec<String> = Vec::new();
    let wait_for = |n: usize, lines: &mut Vec<String>| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while lines.len() < n && Instant::now() < deadline {
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
                lines.push(line);
            }
        }
        assert!(lines.len() >= n, "the watch printed {} of {n} events: {lines:?}", lines.len());
    };
    for i in 0..3 {
        server.pool(&format!("before-{i}")).await;
    }
    wait_for(5, &mut lines);
    server.restart(); // kill -9, then the same address again
    for i in 0..3 {
        server.pool(&format!("after-{i}")).await;
    }
    wait_for(8, &mut lines);
    let status = child.wait().expect("the watcher exits after --count");
    assert!(status.success());
    let events: Vec<Value> = lines.iter().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
    let positions: Vec<(u64, u64)> = events
        .iter()
        .map(|e| {
            let (c, i) = e["position"].as_str().unwrap().split_once('.').unwrap();
            (c.parse().unwrap(), i.parse().unwrap())
        })
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "in order, each once: {positions:?}");
    let names: Vec<&str> = events.iter().filter_map(|e| e["payload"]["name"].as_str()).collect();
    assert_eq!(names, ["root", "admin", "before-0", "before-1", "before-2", "after-0", "after-1", "after-2"]);
}

#[tokio::test]
async fn watch_filters_resumes_and_refuses_bad_input() {
    let server = Server::dev();
    let pool = server.pool("p").await;
    server
        .call("nodes.register", json!({ "poolId": pool, "name": "n", "gpus": [{ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 }] }))
        .await;
    // Types filter and resume after a position (both spellings).
    let (_, page) = server.call("events.list", json!({ "types": ["pool.*"] })).await;
    let pool_event = &page["items"][0];
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    let position = pool_event["position"].as_str().unwrap().to_owned();
    for since in [position.clone(), position.replace('.', ":")] {
        let out = watcher(&server, &["--since", &since, "--count", "1"]).wait_with_output().unwrap();
        assert!(out.status.success());
        let first: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
        assert_eq!(first["type"], "node.registered", "resumes exactly after {since}");
    }
    let out = watcher(&server, &["--since", "start", "--types", "node.*", "--count", "1"]).wait_with_output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("node.registered"));
    let (_, page) = server.call("events.list", json!({ "stream": pool_event["stream"] })).await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);

    // Refusals: the CLI stops with the server's code.
    let too_many = vec!["pool.*"; 21].join(",");
    for (args, code, status) in [
        (vec!["--types", "bogus.*"], "INVALID_ARGUMENT", 2),
        (vec!["--types", too_many.as_str()], "INVALID_ARGUMENT", 2),
        (vec!["--since", "12;3"], "INVALID_ARGUMENT", 2),
    ] {
        let out = watcher(&server, &args).wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(status), "{args:?}: {err}");
        assert!(err.starts_with(code), "{args:?}: {err}");
    }
    let response = server.http.get(format!("{}/watch?since=abc", server.url)).bearer_auth(&server.token).send().await.unwrap();
    assert_eq!(response.status(), 400);
    let response = server.http.get(format!("{}/watch", server.url)).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let response = server
        .http
        .get(format!("{}/watch?tenantId=ten_01jzzzzzzzzzzzzzzzzzzzzzzz", server.url))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404, "no such tenant");
    let (status, body) = server.call("events.list", json!({ "types": ["nope.*"] })).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("INVALID_ARGUMENT")));
}

/// Regression (review): a connected watcher kept the server from stopping on SIGTERM.
#[tokio::test]
async fn a_connected_watcher_does_not_block_a_graceful_stop() {
    let mut server = Server::dev();
    let mut child = watcher(&server, &["--since", "start"]);
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap(); // connected and streaming
    assert!(first.contains("tenant.created"), "{first}");
    assert!(server.stop_graceful(Duration::from_secs(10)), "the server did not stop within 10 s");
    let _ = child.kill();
    let _ = child.wait();
}

/// Regression (review): a revoked key's open watch kept receiving events.
#[tokio::test]
async fn a_revoked_key_stops_receiving_events() {
    let server = Server::dev();
    let (status, key) = server.call("apiKeys.create", json!({ "name": "watcher", "actions": ["compute:events:read"] })).await;
    assert_eq!(status, 200, "{key}");
    let token = key["token"].as_str().unwrap().to_owned();
    let mut child = Command::new(bc_tests::binary("better-compute"))
        .args(["events", "watch", "--since", "start", "--types", "pool.*"])
        .env("BETTER_COMPUTE_URL", &server.url)
        .env("BETTER_COMPUTE_TOKEN", &token)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    server.pool("seen").await;
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("\"seen\""), "{line}");
    let (status, _) = server.call("apiKeys.revoke", json!({ "keyId": key["keyId"] })).await;
    assert_eq!(status, 200);
    server.pool("unseen").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the revoked key's watch is still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
    assert!(!rest.contains("unseen"), "an event reached a revoked key: {rest}");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("UNAUTHENTICATED"), "{err}");
}
