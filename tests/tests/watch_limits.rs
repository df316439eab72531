//! The watch's limits through the real server: at most `WATCHERS_MAX` (1,024) watchers at once,
//! the next refused with 503 `UNAVAILABLE`; and a watcher that stops reading is dropped once a
//! write has waited `--write-stall` (30 s by default, 2 s here), which frees its slot. A key
//! holds at most 16 watchers and a tenant 64 (tested in the gateway's `hardening.rs`), so the 1,024
//! are spread over the administrator's key and keys of sixteen tenants. Each watcher is a
//! connection of its own (HTTP/1.1): the test process needs some 1,100 open files, the server
//! as many; each raises its soft limit to the hard one (and this test fails, saying so, when the
//! hard limit is lower).

use std::time::{Duration, Instant};

use bc_tests::Server;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `bc_gateway::watch::WATCHERS_MAX`, as the server's operator reads it.
const WATCHERS_MAX: usize = 1024;
/// `bc_gateway::watch::WATCHERS_PER_KEY_MAX`.
const WATCHERS_PER_KEY_MAX: usize = 16;
/// `bc_gateway::watch::WATCHERS_PER_TENANT_MAX`.
const WATCHERS_PER_TENANT_MAX: usize = 64;
/// Tenants whose keys hold their tenant's whole share; one more holds 3 keys' worth.
const FULL_TENANTS: usize = 15;
/// The stall limit given to the server, well under the watch's own 30 s send timeout.
const WRITE_STALL: &str = "2s";
/// Open files this process holds at most: a connection a watcher, and some to spare.
const OPEN_FILES_WANTED: u64 = WATCHERS_MAX as u64 + 128;
/// Nodes of about 25 kB of event each: several MB of replay, more than the sockets, the
/// server's write buffer and the watcher's channel can hold, so a reader that takes nothing
/// stalls the server's writes.
const BIG_NODES: usize = 240;

/// Registers `BIG_NODES` nodes with 64 GPUs and 64 long labels each, 8 at a time.
async fn big_events(server: &Server) {
    let pool = server.pool("big").await;
    let gpus: Vec<Value> =
        (0..64).map(|i| json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": i / 8 })).collect();
    let labels: serde_json::Map<String, Value> =
        (0..64).map(|i| (format!("label-{i:02}-{}", "k".repeat(50)), json!("v".repeat(255)))).collect();
    let mut tasks = Vec::new();
    for w in 0..8 {
        let (http, url, token, pool, gpus, labels) =
            (server.http.clone(), server.url.clone(), server.token.clone(), pool.clone(), gpus.clone(), labels.clone());
        tasks.push(tokio::spawn(async move {
            for i in (w..BIG_NODES).step_by(8) {
                let body = json!({ "poolId": pool, "name": format!("n{i}"), "gpus": gpus, "labels": labels });
                let r =
                    http.post(format!("{url}/api/compute/nodes.register")).bearer_auth(&token).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Opens a watch at the end of the log as `token` and returns its response once the headers are in.
async fn open(server: &Server, client: &reqwest::Client, token: &str) -> reqwest::Response {
    client.get(format!("{}/watch", server.url)).bearer_auth(token).send().await.expect("open a watch")
}

/// Keys that may read events: `keys` in each of `tenants` new tenants.
async fn tenant_keys(server: &Server, tenants: usize, keys: usize) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for t in 0..tenants {
        let (status, tenant) = server.call("tenants.create", json!({ "name": format!("t{t}") })).await;
        assert_eq!(status, 200, "{tenant}");
        let mut tokens = Vec::new();
        for k in 0..keys {
            let body = json!({ "tenantId": tenant["tenantId"], "name": format!("k{k}"), "actions": ["compute:events:read"] });
            let (status, key) = server.call("apiKeys.create", body).await;
            assert_eq!(status, 200, "{key}");
            tokens.push(key["token"].as_str().unwrap().to_owned());
        }
        out.push(tokens);
    }
    out
}

/// A watch over a raw socket with a small receive buffer, from the start of the log; the caller
/// reads nothing from it.
async fn stalled_watch(server: &Server) -> tokio::net::TcpStream {
    let addr: std::net::SocketAddr = server.url.trim_start_matches("http://").parse().unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(addr).await.unwrap();
    let request = format!(
        "GET /watch?since=start HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {}\r\naccept: text/event-stream\r\n\r\n",
        server.token
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    // Admitted once the answer's head arrives: peek for it (reading nothing) so the next
    // watcher is not raced into the last slot ahead of this one.
    let mut head = [0u8; 12];
    let peeked = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let n = stream.peek(&mut head).await.unwrap();
            if n >= head.len() || n == 0 {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the stalled watch was answered");
    assert_eq!(&head[..peeked], b"HTTP/1.1 200", "the stalled watch was admitted");
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_are_capped_and_a_stalled_reader_frees_its_slot() {
    bc_tests::raise_open_file_limit(OPEN_FILES_WANTED);
    let server = Server::dev_with(&["--no-reconcilers", "--write-stall", WRITE_STALL]);
    big_events(&server).await;
    let client = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    // 1,024 = the administrator's 16 + 15 tenants' 64 + 48 of a sixteenth tenant (3 of its 4 keys).
    const _: () =
        assert!(WATCHERS_PER_KEY_MAX + FULL_TENANTS * WATCHERS_PER_TENANT_MAX + 3 * WATCHERS_PER_KEY_MAX == WATCHERS_MAX);
    let keys = tenant_keys(&server, FULL_TENANTS + 1, WATCHERS_PER_TENANT_MAX / WATCHERS_PER_KEY_MAX).await;
    let mut tokens: Vec<&str> = vec![&server.token; WATCHERS_PER_KEY_MAX - 1];
    for (t, tenant) in keys.iter().enumerate() {
        let used = if t == FULL_TENANTS { &tenant[..3] } else { &tenant[..] };
        for key in used {
            tokens.extend(std::iter::repeat_n(key.as_str(), WATCHERS_PER_KEY_MAX));
        }
    }
    assert_eq!(tokens.len(), WATCHERS_MAX - 1);
    // Watchers at the end of the log: idle, reading what comes (nothing but heartbeats).
    let mut held = Vec::new();
    for token in tokens {
        let response = open(&server, &client, token).await;
        assert_eq!(response.status(), 200);
        held.push(response);
    }
    // The last slot, the administrator's 16th: a watcher that replays the whole log and reads
    // none of it.
    let mut stalled = stalled_watch(&server).await;
    let refused_at = Instant::now();
    // A key of the sixteenth tenant with no watcher yet, in a tenant under its limit: refused
    // by the total.
    let refused = open(&server, &client, &keys[FULL_TENANTS][3]).await;
    assert_eq!(refused.status(), 503, "watcher {} is refused", WATCHERS_MAX + 1);
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["code"], "UNAVAILABLE", "{body}");
    assert!(body["message"].as_str().unwrap().contains("1024 watchers are connected"), "the total is the limit: {body}");

    // The stalled write fails after --write-stall and the server drops that connection, so a
    // slot is free again while the other 1,023 stay connected.
    let deadline = Instant::now() + Duration::from_secs(60);
    let admitted = loop {
        let response = open(&server, &client, &server.token).await;
        if response.status() == 200 {
            break response;
        }
        assert_eq!(response.status(), 503);
        assert!(Instant::now() < deadline, "the stalled watcher still holds its slot");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("a slot was free {:?} after the cap refused a watcher", refused_at.elapsed());
    // Freed by the write stall, not the watch's 30 s send timeout: that one says so in the log.
    assert!(
        !server.log_text().contains("disconnecting a watcher that stopped reading"),
        "the watch's own send timeout dropped the stalled watcher, not --write-stall"
    );
    // The dropped connection ends: what the socket held, then its end.
    let mut sink = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stalled.read_to_end(&mut sink)).await;
    assert!(read.is_ok(), "the stalled connection was closed by the server");
    assert!(sink.starts_with(b"HTTP/1.1 200"), "it was a watch: {:?}", String::from_utf8_lossy(&sink[..sink.len().min(200)]));
    drop((held, admitted));
}

/// The three caps are the operator's flags: lowered, each refuses the next watcher with 503
/// naming the limit reached; a set that cannot hold (a key's above its tenant's) stops the
/// server before it starts, with exit status 2.
#[tokio::test]
async fn the_watcher_caps_are_the_operators_flags() {
    let caps = ["--watchers-max", "3", "--watchers-per-tenant-max", "2", "--watchers-per-key-max", "1"];
    let server = Server::dev_with(&caps);
    let client = reqwest::Client::new();
    let tenants = tenant_keys(&server, 2, 2).await;
    let first = open(&server, &client, &tenants[0][0]).await;
    assert_eq!(first.status(), 200);
    let refused = open(&server, &client, &tenants[0][0]).await;
    assert_eq!(refused.status(), 503, "a key's second watcher");
    assert!(refused.text().await.unwrap().contains("key"), "the refusal names the key's limit");
    let second = open(&server, &client, &tenants[0][1]).await;
    assert_eq!(second.status(), 200);
    let root = open(&server, &client, &server.token).await;
    assert_eq!(root.status(), 200, "the root tenant has a share of its own");
    let over_total = open(&server, &client, &tenants[1][0]).await;
    assert_eq!(over_total.status(), 503, "a fourth watcher, past --watchers-max 3");
    let body: Value = over_total.json().await.unwrap();
    assert_eq!(body["code"], "UNAVAILABLE", "{body}");
    assert!(body["message"].as_str().unwrap().starts_with("3 watchers are connected already"), "{body}");
    drop((first, second, root));

    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().display().to_string();
    let (code, _, err) = bc_tests::cli(
        &[
            "dev",
            "--data-dir",
            &data_dir,
            "--listen",
            "127.0.0.1:0",
            "--watchers-per-tenant-max",
            "2",
            "--watchers-per-key-max",
            "5",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("per key (5) <= per tenant (2)"), "{err}");
}
