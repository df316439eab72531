//! The well-known document end to end (docs/admission.md, issue 61 item 2): `GET
//! /.well-known/better-compute` verifies against `pki show`'s join signing pin and names the
//! agents' endpoint, its serving pin and the log key's pin; `bcd join --server` with a pin that
//! does not match exits 1 before anything is sent (the token stays unused, no `node.joined`, no
//! file written), and so does a document whose signature does not verify, one past 16 KiB, and a
//! control plane that does not answer within the fetch's 10 s; with the right pins
//! it writes `config.toml` (0600) and `join-encryption.jwk`, joins, and the node goes live.
//! A join request through the document takes the approval's answer because the pinned join
//! signing key signed it; a machine pinning another key refuses the same answer (exit 1).
//!
//! The token on the wire is sealed: a plain TCP proxy between `bcd` and a loopback h2c agents'
//! endpoint (`dev --agents-insecure-h2c --agents-url http://PROXY`) records every byte `bcd`
//! sends. Without TLS the proxy sees the gRPC request exactly as a TLS-terminating proxy would
//! after decrypting it. A join through the document leaves no byte of the token (nor of its
//! secret part) in what the proxy saw, though the request's other fields (the node's public key)
//! are there in the clear; a join of the same kind without `join-encryption.jwk` through the same
//! proxy does show the token, so the proxy would have seen it.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bc_tests::{ImageServer, Server, json, log_key_pin, wait_until};
use serde_json::{Value, json};

/// `pki show`'s join pins: (joinSigningPin, joinEncryptionPin).
fn join_pins(server: &Server) -> (String, String) {
    let (code, out, err) = server.cli(&["pki", "show", "--data-dir", &server.data_dir.display().to_string()]);
    assert_eq!(code, 0, "pki show: {err}");
    let shown = json(&out);
    (
        shown["joinSigningPin"].as_str().expect("pki show prints joinSigningPin").to_owned(),
        shown["joinEncryptionPin"].as_str().unwrap().to_owned(),
    )
}

async fn document(server: &Server) -> Vec<u8> {
    let response = server.http.get(format!("{}/.well-known/better-compute", server.url)).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    response.bytes().await.unwrap().to_vec()
}

/// A new one-use join token of `pool`: (its secret, its id).
async fn token(server: &Server, pool: &str) -> (String, String) {
    let (status, created) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    assert_eq!(status, 200, "{created}");
    (created["token"].as_str().unwrap().to_owned(), created["joinTokenId"].as_str().unwrap().to_owned())
}

async fn token_uses(server: &Server, id: &str) -> u64 {
    let (status, got) = server.call("joinTokens.get", json!({ "joinTokenId": id })).await;
    assert_eq!(status, 200, "{got}");
    got["uses"].as_u64().unwrap()
}

async fn joined_events(server: &Server) -> usize {
    let (status, page) = server.call("events.list", json!({ "types": ["node.joined"], "limit": 500 })).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().len()
}

/// `bcd join --config DIR/config.toml --data-dir DIR/data --server SERVER EXTRA…`, the token on
/// standard input.
fn join_from(dir: &Path, server: &str, extra: &[&str], token: &str) -> (i32, String, String) {
    let config = dir.join("config.toml").display().to_string();
    let data = dir.join("data").display().to_string();
    let mut args = vec!["join", "--config", &config, "--data-dir", &data, "--server", server];
    args.extend_from_slice(extra);
    bc_tests::bcd(&args, &[], Some(&format!("{token}\n")))
}

fn mode_of(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_verifies_a_wrong_pin_sends_nothing_and_a_join_through_it_goes_live() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let (signing_pin, encryption_pin) = join_pins(&server);

    // The document, checked as a machine checks it.
    let served = document(&server).await;
    let (doc, signer) = bc_core::well_known::verify_document(&served).expect("the served document verifies");
    assert_eq!(bc_core::well_known::signing_pin(&signer), signing_pin, "signed by the key pki show pins");
    assert_eq!(doc.join_signing_pin, signing_pin);
    assert_eq!(doc.join_encryption_pin, encryption_pin);
    assert_eq!(doc.agents_url, format!("https://127.0.0.1:{port}"));
    assert_eq!(doc.serving_ca_pin, server.agents_pin, "the serving pin is the agents' endpoint's");
    assert_eq!(doc.log_key_pin, log_key_pin(&server));
    assert_eq!(doc.join_encryption_key["kty"], "OKP");
    assert_eq!(doc.join_encryption_key["crv"], "X25519");
    let raw: Value = serde_json::from_slice(&served).unwrap();
    assert!(raw["signature"].is_string(), "{raw}");

    // A pin that does not match: exit 1 with PIN_MISMATCH, before anything reaches the agents'
    // endpoint: the token unused, no node joined, no file written.
    let (secret, token_id) = token(&server, &pool).await;
    let wrong = "sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let refused = tempfile::tempdir().unwrap();
    for pins in [
        vec!["--join-signing-pin", wrong],
        vec!["--join-signing-pin", &signing_pin, "--join-encryption-pin", wrong],
        vec!["--join-signing-pin", &signing_pin, "--serving-ca-pin", wrong],
    ] {
        let (code, out, err) = join_from(refused.path(), &server.url, &pins, &secret);
        assert_eq!(code, 1, "{pins:?}: {out} {err}");
        assert!(err.contains("PIN_MISMATCH"), "{pins:?}: {err}");
        assert!(!err.contains(&secret), "the token is never echoed");
    }
    assert!(!refused.path().join("config.toml").exists() && !refused.path().join("join-encryption.jwk").exists());
    assert!(!refused.path().join("data").join("node.key").exists(), "not even a node key was made");
    assert_eq!(token_uses(&server, &token_id).await, 0, "the token was not spent");
    assert_eq!(joined_events(&server).await, 0, "no node joined");
    // No pin at all is a usage error (exit 2).
    let (code, _, err) = join_from(refused.path(), &server.url, &[], &secret);
    assert_eq!(code, 2, "{err}");

    // A document whose signature does not verify (one member changed after signing, served by a
    // stand-in for the control plane): exit 1, nothing sent.
    let mut tampered: Value = serde_json::from_slice(&served).unwrap();
    tampered["agentsUrl"] = "https://127.0.0.1:1".into();
    let fake = ImageServer::start(".well-known/better-compute", serde_json::to_vec(&tampered).unwrap());
    let fake_url = fake.url.trim_end_matches("/.well-known/better-compute").to_owned();
    let (code, _, err) = join_from(refused.path(), &fake_url, &["--join-signing-pin", &signing_pin], &secret);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("WELL_KNOWN_BAD_SIGNATURE"), "{err}");
    assert_eq!(fake.served(), 1, "the stand-in was asked once");
    // Past the document's bound (16 KiB): refused without reading it whole.
    let large = ImageServer::start(".well-known/better-compute", vec![b' '; bc_core::well_known::WELL_KNOWN_BYTES_MAX + 1]);
    let large_url = large.url.trim_end_matches("/.well-known/better-compute").to_owned();
    let (code, _, err) = join_from(refused.path(), &large_url, &["--join-signing-pin", &signing_pin], &secret);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("WELL_KNOWN_TOO_LARGE"), "{err}");
    // A control plane that never answers: given up after the fetch's bound (10 s).
    let silent = ImageServer::gated(".well-known/better-compute", served.clone(), 0);
    let silent_url = silent.url.trim_end_matches("/.well-known/better-compute").to_owned();
    let started = std::time::Instant::now();
    let (code, _, err) = join_from(refused.path(), &silent_url, &["--join-signing-pin", &signing_pin], &secret);
    let waited = started.elapsed();
    silent.open();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("WELL_KNOWN_FETCH"), "{err}");
    let bound = Duration::from_millis(bc_agent::well_known::WELL_KNOWN_FETCH_TIMEOUT_MS);
    assert!(waited >= bound && waited < bound + Duration::from_secs(10), "{waited:?}");
    assert!(!refused.path().join("config.toml").exists() && !refused.path().join("join-encryption.jwk").exists());
    assert_eq!(token_uses(&server, &token_id).await, 0);

    // The right pins: config.toml (0600) and join-encryption.jwk (0644) are written from the
    // document, the token is sealed, the node joins and goes live with what was written.
    let machine = tempfile::tempdir().unwrap();
    let (code, out, err) = join_from(
        machine.path(),
        &server.url,
        &[
            "--join-signing-pin",
            &signing_pin,
            "--join-encryption-pin",
            &encryption_pin,
            "--serving-ca-pin",
            server.agents_pin.as_deref().unwrap(),
        ],
        &secret,
    );
    assert_eq!(code, 0, "bcd join: {out} {err}");
    assert!(out.contains("joined as node_"), "{out}");
    let config_path = machine.path().join("config.toml");
    assert_eq!(mode_of(&config_path), 0o600);
    let config = std::fs::read_to_string(&config_path).unwrap();
    for line in [
        format!("gateway = {:?}", doc.agents_url),
        format!("join_signing_key_pin = {signing_pin:?}"),
        format!("join_encryption_key_pin = {encryption_pin:?}"),
        format!("log_key_pin = {:?}", doc.log_key_pin),
    ] {
        assert!(config.lines().any(|l| l == line), "config.toml has {line}: {config}");
    }
    let jwk_path = machine.path().join("join-encryption.jwk");
    assert_eq!(mode_of(&jwk_path), 0o644, "a public key");
    let jwk: Value = serde_json::from_str(&std::fs::read_to_string(&jwk_path).unwrap()).unwrap();
    assert_eq!(jwk, doc.join_encryption_key);
    assert_eq!(token_uses(&server, &token_id).await, 1);
    assert_eq!(joined_events(&server).await, 1);

    // The written configuration runs the node.
    let mut node = bc_tests::start_bcd_node(machine.path(), &config_path.display().to_string());
    wait_until("the node is live", Duration::from_secs(20), || {
        let (code, out, _) = bc_tests::bcd(&["status", "--config", &config_path.display().to_string()], &[], None);
        (code == 0 && json(&out)["session"] == "live").then_some(())
    });
    let _ = node.kill();
    let _ = node.wait();
}

/// `--agents-sealed-joins-only`: a machine that sends its token plain (no well-known document
/// behind its configuration) is refused with the reason and its token left unspent; the same
/// token through the document joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_taking_sealed_tokens_only_refuses_a_plain_join_and_takes_one_through_the_document() {
    let (server, port) = bc_tests::agents_gateway_with(&["--agents-sealed-joins-only"]);
    let pool = server.pool("gpu-a").await;
    let (secret, token_id) = token(&server, &pool).await;
    let plain = bc_tests::AgentNode::new(&server, port);
    let (code, out, err) = plain.join_stdin(&secret);
    assert_eq!(code, 1, "a plain token is refused: {out} {err}");
    assert!(err.contains("only sealed") && err.contains("well-known document"), "{err}");
    assert!(!err.contains(&secret), "the token is not repeated: {err}");
    assert_eq!((token_uses(&server, &token_id).await, joined_events(&server).await), (0, 0));

    let (signing_pin, _) = join_pins(&server);
    let machine = tempfile::tempdir().unwrap();
    let pins = ["--join-signing-pin", &signing_pin, "--serving-ca-pin", server.agents_pin.as_deref().unwrap()];
    let (code, out, err) = join_from(machine.path(), &server.url, &pins, &secret);
    assert_eq!(code, 0, "bcd join through the document: {out} {err}");
    assert_eq!((token_uses(&server, &token_id).await, joined_events(&server).await), (1, 1));
}

/// A plain TCP proxy on `listener` to `upstream`, recording every byte the client sends.
fn recording_proxy(listener: std::net::TcpListener, upstream: String) -> Arc<Mutex<Vec<u8>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorded = seen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { continue };
            let Ok(mut server) = std::net::TcpStream::connect(&upstream) else { continue };
            let (mut client_read, mut server_write) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let recorded = recorded.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                loop {
                    match client_read.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            recorded.lock().unwrap().extend_from_slice(&buf[..n]);
                            if server_write.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = server_write.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut server, &mut client);
                let _ = client.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    seen
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The node's public key, from `identity.json` under `data`.
fn node_public_key(data: &Path) -> Vec<u8> {
    let identity: Value = serde_json::from_str(&std::fs::read_to_string(data.join("identity.json")).unwrap()).unwrap();
    let document: Value = serde_json::from_str(identity["identity"].as_str().unwrap()).unwrap();
    bc_core::agent::unb64(document["nodePublicKey"].as_str().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_in_the_middle_never_sees_a_sealed_token() {
    let proxy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    let (server, _port) = bc_tests::agents_gateway_with(&["--agents-insecure-h2c", "--agents-url", &proxy_url]);
    let seen = recording_proxy(proxy, server.agents_addr.clone());
    let pool = server.pool("gpu-a").await;
    let (signing_pin, _) = join_pins(&server);
    let (doc, _) = bc_core::well_known::verify_document(&document(&server).await).unwrap();
    assert_eq!(doc.agents_url, proxy_url, "the document names --agents-url");
    assert_eq!(doc.serving_ca_pin, None, "h2c: no serving certificate");

    // Through the document: sealed. The proxy carried the join (the node's key is in what it
    // saw), and not one copy of the token or its secret.
    let (secret, token_id) = token(&server, &pool).await;
    let machine = tempfile::tempdir().unwrap();
    let (code, out, err) = join_from(machine.path(), &server.url, &["--join-signing-pin", &signing_pin], &secret);
    assert_eq!(code, 0, "bcd join: {out} {err}");
    assert_eq!(token_uses(&server, &token_id).await, 1);
    let sealed_seen = seen.lock().unwrap().clone();
    assert!(
        contains(&sealed_seen, &node_public_key(&machine.path().join("data"))),
        "the join went through the proxy in the clear"
    );
    // `bcjt_` + `jt_` and 26 characters + `_`, then the secret (base64url, which may hold `_`).
    let token_secret = &secret["bcjt_jt_".len() + 26 + 1..];
    assert!(token_secret.len() >= 40, "{token_secret}");
    assert!(!contains(&sealed_seen, secret.as_bytes()), "the proxy saw the token");
    assert!(!contains(&sealed_seen, token_secret.as_bytes()), "the proxy saw the token's secret");
    assert!(!contains(&sealed_seen, &token_secret.as_bytes()[..16]), "the proxy saw part of the token's secret");

    // The same join without join-encryption.jwk (a configuration written by hand, as before the
    // document): the token is sent plain, and the proxy sees it. So the check above can fail.
    seen.lock().unwrap().clear();
    let (plain_secret, plain_id) = token(&server, &pool).await;
    let plain = tempfile::tempdir().unwrap();
    std::fs::write(
        plain.path().join("config.toml"),
        format!(
            "data_dir = {:?}\ngateway = {proxy_url:?}\nlog_key_pin = {:?}\n",
            plain.path().join("data").display().to_string(),
            doc.log_key_pin
        ),
    )
    .unwrap();
    let config = plain.path().join("config.toml").display().to_string();
    let (code, out, err) = bc_tests::bcd(&["join", "--config", &config], &[], Some(&format!("{plain_secret}\n")));
    assert_eq!(code, 0, "bcd join: {out} {err}");
    assert_eq!(token_uses(&server, &plain_id).await, 1, "the gateway still takes a plain token");
    assert!(contains(&seen.lock().unwrap(), plain_secret.as_bytes()), "an unsealed token is seen by the proxy");
}

/// A `bcd` child of this test, killed when dropped.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_request_through_the_document_takes_only_an_approval_signed_by_the_pinned_key() {
    let (server, _port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let (signing_pin, _) = join_pins(&server);
    let machine = tempfile::tempdir().unwrap();
    let (config, data) = (machine.path().join("config.toml"), machine.path().join("data"));
    let file = |name: &str| std::fs::File::create(machine.path().join(name)).unwrap();
    let mut asking = Running(
        std::process::Command::new(bc_tests::binary("bcd"))
            .args(["join", "--request", "--config", &config.display().to_string(), "--data-dir", &data.display().to_string()])
            .args(["--server", &server.url, "--join-signing-pin", &signing_pin])
            .env_remove("BCD_JOIN_TOKEN")
            .stdin(std::process::Stdio::null())
            .stdout(file("request.out"))
            .stderr(file("request.err"))
            .spawn()
            .expect("start bcd join --request"),
    );
    let id = wait_until("a pending join request", Duration::from_secs(20), || {
        let (status, page) = bc_tests::block_on(server.call("joinRequests.list", json!({ "pending": true })));
        assert_eq!(status, 200, "{page}");
        page["items"].as_array().unwrap().first().map(|r| r["joinRequestId"].as_str().unwrap().to_owned())
    });
    let (code, approved, err) = server.cli(&["join-requests", "approve", &id, "--pool", &pool]);
    assert_eq!(code, 0, "join-requests approve: {approved} {err}");
    let exit = wait_until("bcd join --request ends", Duration::from_secs(60), || asking.0.try_wait().unwrap());
    let said = |name: &str| std::fs::read_to_string(machine.path().join(name)).unwrap_or_default();
    assert_eq!(exit.code(), Some(0), "{} {}", said("request.out"), said("request.err"));
    assert!(said("request.out").contains("joined as node_"), "{}", said("request.out"));
    // The configuration it joined with holds the join signing pin, so the approval's answer was
    // taken only because that key signed it.
    let written = std::fs::read_to_string(&config).unwrap();
    assert!(written.lines().any(|l| l == format!("join_signing_key_pin = {signing_pin:?}")), "{written}");
    assert!(data.join("identity.json").exists());

    // Another machine whose configuration pins another join signing key: the approval's answer,
    // signed by the deployment's key, is refused (exit 1, PIN_MISMATCH) and nothing is kept.
    let other = tempfile::tempdir().unwrap();
    let (other_config, other_data) = (other.path().join("config.toml"), other.path().join("data"));
    let wrong = "sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let text = written
        .replace(&format!("join_signing_key_pin = {signing_pin:?}"), &format!("join_signing_key_pin = {wrong:?}"))
        .replace(&format!("{:?}", data.display().to_string()), &format!("{:?}", other_data.display().to_string()));
    assert!(text.contains(wrong) && text.contains(&other_data.display().to_string()), "{text}");
    std::fs::write(&other_config, text).unwrap();
    std::fs::copy(machine.path().join("join-encryption.jwk"), other.path().join("join-encryption.jwk")).unwrap();
    let other_file = |name: &str| std::fs::File::create(other.path().join(name)).unwrap();
    let mut refused = Running(
        std::process::Command::new(bc_tests::binary("bcd"))
            .args(["join", "--request", "--config", &other_config.display().to_string()])
            .env_remove("BCD_JOIN_TOKEN")
            .stdin(std::process::Stdio::null())
            .stdout(other_file("request.out"))
            .stderr(other_file("request.err"))
            .spawn()
            .expect("start bcd join --request"),
    );
    let other_id = wait_until("the other machine's pending request", Duration::from_secs(20), || {
        let (status, page) = bc_tests::block_on(server.call("joinRequests.list", json!({ "pending": true })));
        assert_eq!(status, 200, "{page}");
        page["items"].as_array().unwrap().first().map(|r| r["joinRequestId"].as_str().unwrap().to_owned())
    });
    let (code, approved, err) = server.cli(&["join-requests", "approve", &other_id, "--pool", &pool]);
    assert_eq!(code, 0, "join-requests approve: {approved} {err}");
    let exit = wait_until("the other bcd join --request ends", Duration::from_secs(60), || refused.0.try_wait().unwrap());
    let other_said = std::fs::read_to_string(other.path().join("request.err")).unwrap_or_default();
    assert_eq!(exit.code(), Some(1), "{other_said}");
    assert!(other_said.contains("PIN_MISMATCH") && other_said.contains(wrong), "{other_said}");
    assert!(!other_data.join("identity.json").exists(), "an answer not signed by the pinned key is not kept");
}
