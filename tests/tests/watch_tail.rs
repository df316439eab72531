//! A new watcher starts at the end of the log, as `tail -f` does: `events watch` (and
//! `GET /watch` without `since`) shows only what commits after it connected, while
//! `--since start` replays from the beginning.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use bc_tests::Server;
use serde_json::{Value, json};

/// Starts `events watch ARGS --count 1` and returns a channel that gets its one line.
fn first_line(server: &Server, args: &[&str]) -> (std::process::Child, mpsc::Receiver<String>) {
    let mut child = Command::new(bc_tests::binary("better-compute"))
        .args(["events", "watch", "--types", "pool.*", "--count", "1"])
        .args(args)
        .env("BETTER_COMPUTE_URL", &server.url)
        .env("BETTER_COMPUTE_TOKEN", &server.token)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the watcher");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        if let Some(Ok(line)) = BufReader::new(stdout).lines().next() {
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_watcher_starts_at_the_end_and_since_start_replays() {
    let server = Server::dev();
    let (status, before) = server.call("pools.create", json!({ "name": "before" })).await;
    assert_eq!(status, 200, "{before}");

    // Without --since: the pool made before it connected never shows; pools made after do.
    let (mut tail, line) = first_line(&server, &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    let got = loop {
        if let Ok(line) = line.try_recv() {
            break line;
        }
        assert!(Instant::now() < deadline, "the watcher printed nothing");
        n += 1;
        let (status, body) = server.call("pools.create", json!({ "name": format!("after-{n}") })).await;
        assert_eq!(status, 200, "{body}");
        if let Ok(line) = line.recv_timeout(Duration::from_millis(200)) {
            break line;
        }
    };
    let event: Value = serde_json::from_str(&got).unwrap();
    let name = event["payload"]["name"].as_str().unwrap_or_default();
    assert!(name.starts_with("after-"), "a new watcher starts at the end, but it printed {event}");
    let _ = tail.wait();

    // --since start replays from the beginning: the first pool event is `before`.
    for since in ["start", "0"] {
        let (mut replay, line) = first_line(&server, &["--since", since]);
        let got = line.recv_timeout(Duration::from_secs(20)).expect("the replay printed a line");
        let event: Value = serde_json::from_str(&got).unwrap();
        assert_eq!(event["payload"]["name"], "before", "--since {since} replays from the beginning: {event}");
        let _ = replay.wait();
    }

    // The same over HTTP: GET /watch?since=start replays.
    let response = server
        .http
        .get(format!("{}/watch?since=start&types=pool.*", server.url))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    use futures::StreamExt;
    let mut text = String::new();
    while !text.contains("\ndata:") && !text.starts_with("data:") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), body.next()).await.expect("a chunk").expect("a body");
        text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(text.contains("\"before\""), "{text}");
}
