//! Node admission end to end (docs/admission.md): `bcd join` gets a short-lived node certificate
//! from the deployment's node CA, which `openssl verify` (a verifier this project did not write)
//! accepts against `pki show`'s CA; `bcd node` presents it in every handshake and renews it on
//! its session with no gap; `nodes revoke` ends the session and `bcd node` exits 1 with the
//! message; the revoked certificate is refused by the gateway's TLS layer in a direct
//! connection, and a certified node that presents none is refused its session.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bc_tests::{AgentNode, Server, json, wait_until};
use serde_json::{Value, json};

/// Every event of the root tenant of these types, oldest first (one page is enough here).
async fn events(server: &Server, types: &[&str]) -> Vec<Value> {
    let (status, page) = server.call("events.list", json!({ "types": types, "limit": 500 })).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().clone()
}

fn certificate_file(machine: &AgentNode) -> bc_agent::node_cert::NodeCertificateFile {
    bc_agent::node_cert::NodeCertificateFile::load(&machine.data()).unwrap().expect("bcd join wrote the node certificate")
}

/// A `bcd node` of this test, killed when dropped (a failed assertion leaves none running).
struct NodeProcess(Child);

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `bcd node` with `env`, its standard error to `node.log` in the machine's directory.
fn start_node(machine: &AgentNode, env: &[(&str, &str)]) -> NodeProcess {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(machine.dir.path().join("node.log")).unwrap();
    Command::new(bc_tests::binary("bcd"))
        .args(["node", "--config", &machine.config()])
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map(NodeProcess)
        .expect("start bcd node")
}

/// `openssl verify -CAfile CA -purpose sslclient CERT`: its exit code and output.
fn openssl_verify(dir: &Path, ca_pem: &str, certificate_pem: &str) -> (i32, String) {
    let (ca, certificate) = (dir.join("ca.pem"), dir.join("node.pem"));
    std::fs::write(&ca, ca_pem).unwrap();
    std::fs::write(&certificate, certificate_pem).unwrap();
    let out = Command::new("openssl")
        .args(["verify", "-CAfile", &ca.display().to_string(), "-purpose", "sslclient", &certificate.display().to_string()])
        .output()
        .expect("openssl (Debian's openssl package) runs");
    (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// A TLS connection to the agents' endpoint presenting the machine's node certificate, outside
/// `bcd`: the HTTP/2 preface sent and the server's first frame read. `Ok`: the gateway took the
/// certificate; `Err`: the TLS error it answered with.
fn direct_connection(server: &Server, port: u16, machine: &AgentNode) -> Result<(), String> {
    let key = bc_agent::config::read_node_key(&machine.data().join("node.key")).unwrap();
    let certificates = bc_agent::node_cert::NodeCertificates::new(&key, Some(&certificate_file(machine))).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let pin = server.agents_pin.clone().unwrap();
    let verifier = bc_pin::Verifier::pinned(&pin, "the gateway's certificate", provider.clone()).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_cert_resolver(certificates);
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = rustls::pki_types::ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, 1]).into());
    let mut connection = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut tls = rustls::Stream::new(&mut connection, &mut socket);
    let tls_error = |e: std::io::Error| match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        Some(rustls) => format!("{rustls:?}"),
        None => format!("io: {e}"),
    };
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0").map_err(tls_error)?;
    let mut frame = [0u8; 9];
    tls.read_exact(&mut frame).map_err(tls_error)?;
    assert_eq!(frame[3], 4, "the server's first frame is its SETTINGS");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_certificate_verifies_with_openssl_renews_with_no_gap_and_a_revoked_node_is_refused() {
    let (server, port) = bc_tests::agents_gateway_with(&["--node-cert-lifetime", "2m"]);
    let pool = server.pool("gpu-a").await;
    let machine = AgentNode::new(&server, port);
    let (created_status, created) = server.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await;
    assert_eq!(created_status, 200, "{created}");
    let (code, out, err) = machine.join_stdin(created["token"].as_str().unwrap());
    assert_eq!(code, 0, "bcd join: {out} {err}");
    assert!(out.contains("; certificate valid until "), "{out}");
    let node = machine.node_id();

    // The certificate is for two minutes, recorded at join, and chains to `pki show`'s CA.
    let joined = certificate_file(&machine);
    let lifetime_ms = joined.not_after_ms - joined.issued_at_ms;
    assert!((110_000..=125_000).contains(&lifetime_ms), "a 2m certificate: {lifetime_ms} ms");
    let (code, shown, err) = server.cli(&["pki", "show", "--data-dir", &server.data_dir.display().to_string()]);
    assert_eq!(code, 0, "pki show: {err}");
    let shown = json(&shown);
    let ca_path = shown["nodeCa"]["certificate"].as_str().expect("pki show names the node CA").to_owned();
    assert!(shown["nodeCa"]["pin"].as_str().unwrap().starts_with("sha256/"), "{shown}");
    let ca_pem = std::fs::read_to_string(&ca_path).unwrap();
    assert_eq!(ca_pem.trim(), joined.ca_certificate.trim(), "the CA the node was given is the deployment's");
    let (code, said) = openssl_verify(machine.dir.path(), &ca_pem, &joined.certificate);
    assert_eq!(code, 0, "openssl verify accepts the node certificate: {said}");
    assert!(said.contains(": OK"), "{said}");
    // Against another CA (the agents' serving certificate), openssl refuses it.
    let serving = std::fs::read_to_string(server.data_dir.join("agents-tls.crt")).unwrap();
    let (code, said) = openssl_verify(machine.dir.path(), &serving, &joined.certificate);
    assert_ne!(code, 0, "another CA does not verify it: {said}");
    let issued = events(&server, &["node.certificate_issued"]).await;
    assert_eq!(issued.len(), 1, "{issued:?}");
    assert_eq!(issued[0]["payload"]["renewal"], false);

    // Renewed on the session (BCD_RENEW_AFTER brings it forward), with no gap: one session,
    // the node ready throughout.
    let mut agent = start_node(&machine, &[("BCD_RENEW_AFTER", "2s")]);
    wait_until("the node is live", Duration::from_secs(20), || machine.status().filter(|s| s["session"] == "live"));
    let renewed = wait_until("a renewal", Duration::from_secs(30), || {
        let issued = bc_tests::block_on(events(&server, &["node.certificate_issued"]));
        issued.iter().find(|e| e["payload"]["renewal"] == true).cloned()
    });
    assert_eq!(renewed["actor"], format!("node:{node}"), "{renewed}");
    let renewed_file = wait_until("the renewed certificate is kept", Duration::from_secs(10), || {
        let file = certificate_file(&machine);
        (file.certificate != joined.certificate).then_some(file)
    });
    assert_eq!(renewed_file.not_after_ms, renewed["payload"]["notAfterMs"].as_u64().unwrap());
    let (code, said) = openssl_verify(machine.dir.path(), &ca_pem, &renewed_file.certificate);
    assert_eq!(code, 0, "the renewed certificate verifies too: {said}");
    let status = machine.status().unwrap();
    assert_eq!((status["session"].as_str(), status["sessions"].as_u64()), (Some("live"), Some(1)), "no gap: {status}");
    assert!(events(&server, &["node.unreachable"]).await.iter().all(|e| e["stream"] != format!("node/{node}")));
    direct_connection(&server, port, &machine).expect("the renewed certificate is taken in a handshake");

    // Revoked: the session ends, bcd node exits 1 with the message; the certificate is
    // refused in the TLS handshake, and a new bcd node exits 1 the same way.
    let revoked_at = Instant::now();
    let (code, out, err) = server.cli(&["nodes", "revoke", &node, "--reason", "decommissioned", "--yes"]);
    assert_eq!(code, 0, "nodes revoke: {out} {err}");
    let exit = wait_until("bcd node exits", Duration::from_secs(10), || agent.0.try_wait().unwrap());
    eprintln!("bcd node exited {:?} after the revocation", revoked_at.elapsed());
    assert_eq!(exit.code(), Some(1), "{}", machine.node_log());
    assert!(machine.node_log().contains("bcd node: agent: this node's certificate was revoked"), "{}", machine.node_log());
    let refused = direct_connection(&server, port, &machine).expect_err("a revoked certificate is refused");
    assert!(refused.contains("CertificateRevoked"), "{refused}");
    let (code, out, err) = server.cli(&["nodes", "revoke", &node, "--yes"]);
    assert_ne!(code, 0, "revoked once: {out}");
    assert!(err.contains("already revoked"), "{err}");
    let mut again = start_node(&machine, &[]);
    let exit = wait_until("a new bcd node exits", Duration::from_secs(20), || again.0.try_wait().unwrap());
    assert_eq!(exit.code(), Some(1));
    let said = "bcd node: agent: this node's certificate was revoked";
    assert_eq!(machine.node_log().matches(said).count(), 2, "{}", machine.node_log());
    let revoked = events(&server, &["node.revoked"]).await;
    assert_eq!(revoked.len(), 1);
    assert_eq!(revoked[0]["payload"]["reason"], "decommissioned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certified_node_without_its_certificate_is_refused_a_deleted_ones_certificate_too_and_cloud_iid_exits_2() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let mut machine = AgentNode::new(&server, port);
    // No cloud here: `--attestor cloud-iid` is a usage error, before any token is read.
    let (code, out, err) =
        machine.bcd(&["join", "--config", &machine.config(), "--attestor", "cloud-iid"], &[], Some("bcjt_x\n"));
    assert_eq!(code, 2, "{out} {err}");
    assert!(err.contains("--attestor cloud-iid") && err.contains("no cloud here"), "{err}");
    machine.join_pool(&server, &pool).await;
    let node = machine.node_id();
    let certificate_path = bc_agent::node_cert::NodeCertificateFile::path(&machine.data());
    let kept = std::fs::read(&certificate_path).unwrap();
    std::fs::remove_file(&certificate_path).unwrap();
    machine.start();
    wait_until("the session is refused", Duration::from_secs(20), || {
        machine.node_log().contains(&format!("node {node} must present its node certificate")).then_some(())
    });
    let (status, doc) = server.call("nodes.get", json!({ "nodeId": node })).await;
    assert_eq!(status, 200);
    assert_eq!(doc["state"], "unreachable", "{doc}");

    // Deleted (its agent gone): its certificate is refused by the TLS layer too.
    machine.kill9();
    std::fs::write(&certificate_path, &kept).unwrap();
    direct_connection(&server, port, &machine).expect("the certificate is taken before the deletion");
    let (code, out, err) = server.cli(&["nodes", "cordon", &node]);
    assert_eq!(code, 0, "{out} {err}");
    let (code, out, err) = server.cli(&["nodes", "delete", &node, "--yes"]);
    assert_eq!(code, 0, "nodes delete: {out} {err}");
    let refused = direct_connection(&server, port, &machine).expect_err("a deleted node's certificate is refused");
    assert!(refused.contains("CertificateRevoked"), "{refused}");
}

/// `bcd join --request` of `machine`, running: its standard output and error go to
/// `request.out` and `request.err` in the machine's directory.
fn ask_to_join(machine: &AgentNode) -> NodeProcess {
    let file = |name: &str| std::fs::File::create(machine.dir.path().join(name)).unwrap();
    Command::new(bc_tests::binary("bcd"))
        .args(["join", "--request", "--config", &machine.config()])
        .env_remove("BCD_JOIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(file("request.out"))
        .stderr(file("request.err"))
        .spawn()
        .map(NodeProcess)
        .expect("start bcd join --request")
}

fn said(machine: &AgentNode, name: &str) -> String {
    std::fs::read_to_string(machine.dir.path().join(name)).unwrap_or_default()
}

/// The one pending join request, once there is one.
fn pending_request(server: &Server) -> Value {
    wait_until("a pending join request", Duration::from_secs(20), || {
        let (status, page) = bc_tests::block_on(server.call("joinRequests.list", json!({ "pending": true })));
        assert_eq!(status, 200, "{page}");
        let items = page["items"].as_array().unwrap();
        assert!(items.len() <= 1, "one machine asks at a time here: {page}");
        items.first().cloned()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_that_asks_is_approved_joins_and_goes_live_and_a_rejected_one_exits_1_with_the_reason() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let mut machine = AgentNode::new(&server, port);
    // A request takes no credential: a token file with it is a usage error.
    let (code, out, err) =
        machine.bcd(&["join", "--request", "--config", &machine.config(), "--token-file", "/nonexistent"], &[], None);
    assert_eq!(code, 2, "{out} {err}");
    assert!(err.contains("--request asks to join with no credential"), "{err}");

    // Pending: the machine waits, asking again; the request names its host.
    let mut asking = ask_to_join(&machine);
    let request = pending_request(&server);
    let id = request["joinRequestId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("jreq_"), "{request}");
    assert_eq!(request["state"], "pending");
    assert!(!request["publicKey"].as_str().unwrap().is_empty());
    wait_until("bcd join says which request waits", Duration::from_secs(10), || {
        said(&machine, "request.err").contains(&format!("asked to join as {id}")).then_some(())
    });
    assert!(asking.0.try_wait().unwrap().is_none(), "still waiting: {}", said(&machine, "request.err"));
    let (code, listed, err) = server.cli(&["join-requests", "list", "--pending"]);
    assert_eq!(code, 0, "{err}");
    assert!(listed.contains(&id) && listed.contains("pending"), "{listed}");
    let created = events(&server, &["join_request.created"]).await;
    assert_eq!(created.len(), 1, "asking again appends nothing: {created:?}");
    assert_eq!(created[0]["actor"], format!("join_request:{id}"));

    // Approved: the machine joins as the node the approval names, with its node certificate.
    let (code, approved, err) = server.cli(&["join-requests", "approve", &id, "--pool", &pool]);
    assert_eq!(code, 0, "join-requests approve: {approved} {err}");
    let approved = json(&approved);
    assert_eq!(approved["state"], "approved", "{approved}");
    let node = approved["nodeId"].as_str().unwrap().to_owned();
    let exit = wait_until("bcd join --request ends", Duration::from_secs(60), || asking.0.try_wait().unwrap());
    assert_eq!(exit.code(), Some(0), "{} {}", said(&machine, "request.out"), said(&machine, "request.err"));
    let out = said(&machine, "request.out");
    assert!(out.contains(&format!("joined as {node} ")) && out.contains("; certificate valid until "), "{out}");
    assert_eq!(machine.node_id(), node);
    let joined = events(&server, &["node.joined"]).await;
    assert_eq!(joined.len(), 1, "{joined:?}");
    assert_eq!(
        (joined[0]["stream"].as_str(), joined[0]["actor"].as_str()),
        (Some(&*format!("node/{node}")), Some(&*format!("join_request:{id}")))
    );
    let (code, said_twice, err) = server.cli(&["join-requests", "approve", &id, "--pool", &pool]);
    assert_ne!(code, 0, "decided once: {said_twice}");
    assert!(err.contains("approved already"), "{err}");
    let certificate = certificate_file(&machine);
    let ca_pem = std::fs::read_to_string(server.data_dir.join("node-ca.crt")).unwrap();
    let (code, verified) = openssl_verify(machine.dir.path(), &ca_pem, &certificate.certificate);
    assert_eq!(code, 0, "the admitted node's certificate verifies: {verified}");

    // The node goes live with it.
    machine.start();
    wait_until("the node is live", Duration::from_secs(30), || machine.status().filter(|s| s["session"] == "live"));
    wait_until("the node is ready", Duration::from_secs(30), || {
        let (status, doc) = bc_tests::block_on(server.call("nodes.get", json!({ "nodeId": node })));
        (status == 200 && doc["state"] == "ready").then_some(())
    });

    // Another machine, rejected: its wait ends with exit 1 and the reason; asking again says so
    // at once.
    let other = AgentNode::new(&server, port);
    let mut asking = ask_to_join(&other);
    let request = pending_request(&server);
    let other_id = request["joinRequestId"].as_str().unwrap().to_owned();
    assert_ne!(other_id, id);
    let (code, out, err) = server.cli(&["join-requests", "reject", &other_id, "--reason", "not in the inventory"]);
    assert_eq!(code, 0, "join-requests reject: {out} {err}");
    assert_eq!(json(&out)["state"], "rejected");
    let exit = wait_until("the rejected bcd join ends", Duration::from_secs(60), || asking.0.try_wait().unwrap());
    assert_eq!(exit.code(), Some(1), "{}", said(&other, "request.err"));
    let reason = format!("bcd join: {other_id} was rejected: not in the inventory");
    assert!(said(&other, "request.err").contains(&reason), "{}", said(&other, "request.err"));
    assert!(!other.data().join("identity.json").exists(), "a rejected machine has no identity");
    let (code, out, err) = other.bcd(&["join", "--request", "--config", &other.config()], &[], None);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains(&reason), "{err}");
    let (code, out, err) = server.cli(&["join-requests", "reject", &other_id, "--reason", "again"]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("rejected already"), "{err}");
    // A reason is required, and bounded.
    let (status, refused) = server.call("joinRequests.reject", json!({ "joinRequestId": other_id, "reason": "" })).await;
    assert_eq!((status, refused["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{refused}");
    let (code, _, err) = server.cli(&["join-requests", "approve", "jt_nope", "--pool", &pool]);
    assert_eq!(code, 2, "a malformed id is a usage error before anything is sent: {err}");
}

/// The certificates in a PEM bundle.
fn certificates_in(pem: &str) -> usize {
    pem.matches("-----BEGIN CERTIFICATE-----").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renew_ca_rolls_the_node_ca_with_an_overlap_in_which_both_verify_and_past_which_the_old_certificates_do_not() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let machine = AgentNode::new(&server, port);
    machine.join_pool(&server, &pool).await;
    let old = certificate_file(&machine);
    let data_dir = server.data_dir.display().to_string();
    let ca_path = server.data_dir.join("node-ca.crt");
    let show = || {
        let (code, out, err) = server.cli(&["pki", "show", "--data-dir", &data_dir]);
        assert_eq!(code, 0, "pki show: {err}");
        json(&out)["nodeCa"].clone()
    };
    let before = show();
    let old_pin = before["pin"].as_str().unwrap().to_owned();
    assert_eq!(before["previousPins"], json!([]), "{before}");
    let (code, said) = openssl_verify(machine.dir.path(), &std::fs::read_to_string(&ca_path).unwrap(), &old.certificate);
    assert_eq!(code, 0, "openssl verify accepts the node certificate against the node CA: {said}");

    // Rolled, with a short overlap (the test-only switch of a debug build): both CAs verify
    // until it ends, and pki show prints both pins.
    let overlap = [("BC_TEST_ONLY_NODE_CA_OVERLAP_MS", "20000")];
    let (code, out, err) = bc_tests::cli(&["pki", "renew-ca", "--data-dir", &data_dir], &overlap);
    assert_eq!(code, 0, "pki renew-ca: {out} {err}");
    let renewed = json(&out);
    assert_eq!(renewed["previousPin"], old_pin.as_str(), "{renewed}");
    let new_pin = renewed["pin"].as_str().unwrap().to_owned();
    assert_ne!(new_pin, old_pin);
    let during = show();
    assert_eq!((during["pin"].as_str(), during["previousPins"].clone()), (Some(new_pin.as_str()), json!([old_pin])), "{during}");
    let bundle = std::fs::read_to_string(&ca_path).unwrap();
    assert_eq!(certificates_in(&bundle), 2, "{bundle}");
    let (code, said) = openssl_verify(machine.dir.path(), &bundle, &old.certificate);
    assert_eq!(code, 0, "in the overlap the old CA's certificate verifies: {said}");
    direct_connection(&server, port, &machine).expect("in the overlap the gateway takes the old CA's certificate");

    // Past the overlap the gateway's node-ca.crt holds the new CA alone: openssl refuses the old
    // certificate, and so does the gateway's TLS layer; a machine joining now is the new CA's.
    let alone = wait_until("the overlap ends", Duration::from_secs(60), || {
        let pem = std::fs::read_to_string(&ca_path).unwrap();
        (certificates_in(&pem) == 1).then_some(pem)
    });
    let (code, said) = openssl_verify(machine.dir.path(), &alone, &old.certificate);
    assert_ne!(code, 0, "past the overlap openssl refuses the old CA's certificate: {said}");
    assert_eq!(show()["previousPins"], json!([]));
    direct_connection(&server, port, &machine).expect_err("past the overlap the gateway refuses the old CA's certificate");
    let second = AgentNode::new(&server, port);
    second.join_pool(&server, &pool).await;
    let (code, said) = openssl_verify(second.dir.path(), &alone, &certificate_file(&second).certificate);
    assert_eq!(code, 0, "a certificate issued after the roll verifies against the new CA: {said}");
    direct_connection(&server, port, &second).expect("the new CA's certificate is taken");
    // The roll is in the log once, though the command and the server each recorded it.
    let rolled = events(&server, &["node_ca.renewed"]).await;
    assert_eq!(rolled.len(), 1, "{rolled:?}");
    assert_eq!(
        (rolled[0]["payload"]["pin"].as_str(), rolled[0]["payload"]["previousPin"].as_str()),
        (Some(new_pin.as_str()), Some(old_pin.as_str()))
    );
    assert_eq!(renewed["recorded"], true, "{renewed}");
}
