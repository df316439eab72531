//! The tree served as C2SP tlog-tiles: an independent client (`tests/scripts/tiles_check.py`,
//! Python's standard library only) recomputes every tile and the root from the entry bundles, and
//! a third-party RFC 6962 implementation (pymerkle, `tests/scripts/tiles_pymerkle.py`, held to
//! the transparency-dev vectors first) recomputes them again and checks the layout against the
//! spec's examples; the event bundles hold the events whose hashes the entries are; caching,
//! access and the tree's edge.

use bc_core::tiles;
use bc_tests::{Server, cli};
use serde_json::{Value, json};

const EVENTS_WANTED: usize = 530;

/// The Python of the virtual environment `make tiles-venv` makes with pymerkle in it
/// (`BC_TILES_PYTHON` names another). Missing, the test fails: it never skips.
fn tiles_python() -> std::path::PathBuf {
    let path = std::env::var_os("BC_TILES_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tiles-venv/bin/python"));
    assert!(
        path.exists(),
        "no Python with pymerkle at {} (run `make tiles-venv`, which `make test` runs; it installs pymerkle from PyPI)",
        path.display()
    );
    path
}

async fn get(server: &Server, token: &str, path: &str) -> (u16, Option<String>, Vec<u8>) {
    let response = server.http.get(format!("{}{path}", server.url)).bearer_auth(token).send().await.expect("request");
    let status = response.status().as_u16();
    let cache = response.headers().get("cache-control").map(|v| v.to_str().unwrap().to_owned());
    (status, cache, response.bytes().await.expect("body").to_vec())
}

#[tokio::test]
async fn tiles_are_what_the_spec_says_checked_by_an_independent_client() {
    let server = Server::dev_with(&["--no-reconcilers"]);
    let root = bc_core::id::TenantId::ROOT.to_string();
    let base = format!("/audit/{root}");
    let (status, _, _) = get(&server, &server.token, &format!("{base}/checkpoint")).await;
    assert_eq!(status, 404, "no checkpoint sealed yet");

    for chunk in (0..EVENTS_WANTED).collect::<Vec<_>>().chunks(25) {
        futures::future::join_all(chunk.iter().map(|i| server.call("pools.create", json!({ "name": format!("p{i}") })))).await;
    }
    let data_dir = server.data_dir.to_str().unwrap().to_owned();
    let (code, out, err) = cli(&["audit", "checkpoint", "--data-dir", &data_dir], &[]);
    assert_eq!(code, 0, "{err}");
    let sealed: Value = serde_json::from_str(&out).unwrap();
    let size = sealed["sealed"][0]["treeSize"].as_u64().unwrap();
    assert!(size as usize > EVENTS_WANTED, "{sealed}");

    let check = std::process::Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/tiles_check.py"))
        .args([&server.url, &root, &server.token])
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{stdout}{}", String::from_utf8_lossy(&check.stderr));
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(summary["size"], size);
    // Every answer needs a token, so none may be kept by a shared cache (RFC 9111 §3.5).
    let (status, cache, _) = get(&server, &server.token, &format!("{base}/checkpoint")).await;
    assert_eq!((status, cache.as_deref()), (200, Some("private, no-cache")));
    let caches = &summary["cacheControl"];
    assert_eq!(caches["tile/0/000"], "private, max-age=31536000, immutable");
    assert_eq!(caches["tile/entries/001"], "private, max-age=31536000, immutable");
    let partial = format!("tile/0/002.p/{}", size - 512);
    assert_eq!(caches[&partial], "private, max-age=10", "{caches}");
    assert_eq!(caches["tile/1/000.p/2"], "private, max-age=10", "{caches}");

    // Again with pymerkle, a third-party RFC 6962 implementation, after it passes the vectors.
    let check = std::process::Command::new(tiles_python())
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/tiles_pymerkle.py"))
        .args([&server.url, &root, &server.token, concat!(env!("CARGO_MANIFEST_DIR"), "/../core/testdata/rfc6962")])
        .output()
        .expect("the tiles venv's python");
    let stdout = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{stdout}{}", String::from_utf8_lossy(&check.stderr));
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!((summary["library"].as_str(), summary["size"].as_u64()), (Some("pymerkle 7.0.0"), Some(size)), "{summary}");
    assert!(summary["vectors"].as_u64().unwrap() >= 10, "{summary}");
    let tiles = summary["tiles"].as_object().unwrap();
    let want = ["tile/0/000", "tile/0/001", partial.as_str(), "tile/1/000.p/2"];
    assert_eq!(tiles.keys().map(String::as_str).collect::<Vec<_>>(), want, "every tile of the layout, no more");

    // The event bundle beside each entry bundle: each event hashes to its entry.
    let (status, _, entries) = get(&server, &server.token, &format!("{base}/tile/entries/001")).await;
    assert_eq!(status, 200);
    let (status, cache, events) = get(&server, &server.token, &format!("{base}/tile/events/001")).await;
    assert_eq!((status, cache.as_deref()), (200, Some("private, max-age=31536000, immutable")));
    let entries = tiles::parse_entry_bundle(&entries).unwrap();
    let events = tiles::parse_event_bundle(&events).unwrap();
    assert_eq!((entries.len(), events.len()), (256, 256));
    for (i, (entry, event)) in entries.iter().zip(&events).enumerate() {
        assert_eq!(bc_core::event::sha256(&event.canonical).as_slice(), entry.as_slice(), "event {i}");
        let envelope = bc_core::event::Envelope::from_canonical(&event.canonical).unwrap();
        assert_eq!(envelope.seq, 256 + i as u64 + 1);
        // A signature of its own, or neither sig nor keyId (covered by a later event); every
        // 16th seq carries one.
        assert!(event.sig.len() == 64 || (event.sig.is_empty() && event.key_id.is_empty()), "event {i}");
        assert!(!envelope.seq.is_multiple_of(bc_core::event::SIGNED_SEQ_INTERVAL) || event.sig.len() == 64, "event {i}");
    }

    // The edge: nothing past the checkpoint, nothing malformed, nothing without a key.
    for path in [
        format!("{base}/tile/0/002"),
        format!("{base}/tile/0/002.p/{}", size - 512 + 1),
        format!("{base}/tile/entries/003.p/1"),
        format!("{base}/tile/1/000"),
        format!("{base}/tile/0/x000/002"),
        format!("{base}/tile/9/000"),
    ] {
        let (status, _, body) = get(&server, &server.token, &path).await;
        assert_eq!(status, 404, "{path}: {}", String::from_utf8_lossy(&body));
    }
    let (status, _, _) = get(&server, "bc_wrong", &format!("{base}/tile/0/000")).await;
    assert_eq!(status, 401);
    let (status, _, _) = get(&server, &server.token, "/audit/ten_nope/checkpoint").await;
    assert_eq!(status, 400);
    // A key without compute:events:read is refused like events.list refuses it.
    let (status, key) = server.call("apiKeys.create", json!({ "name": "pools-only", "actions": ["compute:pools:read"] })).await;
    assert_eq!(status, 200, "{key}");
    let token = key["token"].as_str().unwrap();
    let (status, _, _) = get(&server, token, &format!("{base}/tile/0/000")).await;
    assert_eq!(status, 403);
    let (status, _) = server.call_as(token, "events.list", json!({}), None).await;
    assert_eq!(status, 403, "events.list and the tiles agree");
}
