//! TPM attestation end to end (docs/admission.md, issue 61 item 3) against swtpm, a TPM 2.0
//! implementation this project did not write (Debian's `swtpm`, `swtpm-tools`; `make
//! system-deps` installs them, and this test fails saying so when they are missing).
//!
//! Each software TPM is manufactured by `swtpm_setup --create-ek-cert`, its EK certificate
//! signed by a test EK CA (`swtpm_localca` with a CA key and certificate made here with
//! openssl), and served on swtpm's TCP socket; `bcd join --attestor tpm` reaches it through the
//! swtpm TCTI (`BCD_TPM_TCTI`). The gateway takes the EK CA bundle and the pool from
//! `better-compute.toml` (`tpm-ek-ca-bundle`, `tpm-join-pool`), written once the pool exists and
//! read at a restart.
//!
//! It shows: a join with no token; the `node.joined` event carrying the evidence (checked again
//! here as an auditor would: the EK certificate by `openssl verify` against the test CA, the
//! quote's signature, nonce and PCR digest by `bc_gateway::tpm`, the node id from the EK); the
//! node going live; and three refusals, each with its stable code and no node made: the same TPM
//! as a new node (`TPM_ALREADY_JOINED`), a replayed quote from the first join
//! (`TPM_QUOTE_NONCE`), and a TPM whose EK certificate is another CA's (`TPM_EK_UNTRUSTED`).

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use bc_tests::{AgentNode, Server, wait_until};
use serde_json::{Value, json};

/// Fails the test with how to get swtpm when it is not installed: never a silent skip.
fn require_swtpm() {
    for tool in ["swtpm", "swtpm_setup", "swtpm_localca", "openssl"] {
        let found = Command::new("sh").args(["-c", &format!("command -v {tool}")]).output().is_ok_and(|o| o.status.success());
        assert!(
            found,
            "{tool} is not installed: the TPM test needs swtpm (Debian: apt-get install swtpm swtpm-tools openssl; `make system-deps` installs them)"
        );
    }
}

fn run(command: &mut Command) -> String {
    let out = command.output().unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{command:?}: {said}");
    said
}

/// A test EK CA: an RSA key and a self-signed CA certificate named `CN=test EK CA`.
struct EkCa {
    key: PathBuf,
    certificate: PathBuf,
}

impl EkCa {
    fn new(dir: &Path) -> EkCa {
        std::fs::create_dir_all(dir).unwrap();
        let (key, certificate) = (dir.join("signkey.pem"), dir.join("issuercert.pem"));
        run(Command::new("openssl").args(["genrsa", "-out"]).arg(&key).arg("2048"));
        run(Command::new("openssl")
            .args(["req", "-x509", "-new", "-key"])
            .arg(&key)
            .args(["-subj", "/CN=test EK CA", "-days", "3650", "-out"])
            .arg(&certificate)
            .args(["-addext", "basicConstraints=critical,CA:true", "-addext", "keyUsage=critical,keyCertSign"]));
        std::fs::write(dir.join("certserial"), "1\n").unwrap();
        EkCa { key, certificate }
    }
}

/// A software TPM on swtpm's TCP socket, manufactured with an EK certificate by `ca`; stopped
/// when dropped.
struct SoftwareTpm {
    child: Child,
    port: u16,
}

impl SoftwareTpm {
    fn manufacture(dir: &Path, ca: &EkCa) -> SoftwareTpm {
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        let (localca, options, setup) = (dir.join("localca.conf"), dir.join("localca.options"), dir.join("setup.conf"));
        let ca_dir = ca.key.parent().unwrap();
        std::fs::write(
            &localca,
            format!(
                "statedir = {}\nsigningkey = {}\nissuercert = {}\ncertserial = {}\n",
                ca_dir.display(),
                ca.key.display(),
                ca.certificate.display(),
                ca_dir.join("certserial").display()
            ),
        )
        .unwrap();
        std::fs::write(&options, "--platform-manufacturer test\n--platform-version 1\n--platform-model test\n").unwrap();
        std::fs::write(
            &setup,
            format!(
                "create_certs_tool = /usr/bin/swtpm_localca\ncreate_certs_tool_config = {}\ncreate_certs_tool_options = {}\nactive_pcr_banks = sha256\n",
                localca.display(),
                options.display()
            ),
        )
        .unwrap();
        let said = run(Command::new("swtpm_setup")
            .args(["--tpm2", "--create-ek-cert", "--overwrite", "--tpmstate"])
            .arg(&state)
            .arg("--config")
            .arg(&setup));
        assert!(said.contains("EK certificate"), "{said}");
        // The TCTI reaches the command port and the control port beside it.
        let port = (0..20)
            .map(|_| bc_tests::free_port())
            .find(|p| *p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok())
            .expect("two free ports side by side");
        let log = std::fs::File::create(dir.join("swtpm.log")).unwrap();
        let child = Command::new("swtpm")
            .args(["socket", "--tpm2", "--tpmstate"])
            .arg(format!("dir={}", state.display()))
            .args(["--server", &format!("type=tcp,port={port},bindaddr=127.0.0.1")])
            .args(["--ctrl", &format!("type=tcp,port={},bindaddr=127.0.0.1", port + 1)])
            .args(["--flags", "not-need-init,startup-clear"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start swtpm");
        wait_until("swtpm listens", Duration::from_secs(10), || TcpStream::connect(("127.0.0.1", port)).ok());
        SoftwareTpm { child, port }
    }

    fn tcti(&self) -> String {
        format!("swtpm:host=127.0.0.1,port={}", self.port)
    }
}

impl Drop for SoftwareTpm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn joined_events(server: &Server) -> Vec<Value> {
    let (status, page) = server.call("events.list", json!({ "types": ["node.joined"], "limit": 500 })).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().clone()
}

/// `bcd join --attestor tpm` on `machine` with the TPM at `tpm`, and `env`.
fn join_by_tpm(machine: &AgentNode, tpm: &SoftwareTpm, env: &[(&str, &str)]) -> (i32, String, String) {
    let tcti = tpm.tcti();
    let mut all = vec![("BCD_TPM_TCTI", tcti.as_str())];
    all.extend_from_slice(env);
    machine.bcd(&["join", "--config", &machine.config(), "--attestor", "tpm"], &all, None)
}

fn b64(text: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(text.as_str().expect("base64 text")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tpm_joins_with_no_token_and_its_evidence_is_in_the_log() {
    require_swtpm();
    let work = tempfile::tempdir().unwrap();
    let ca = EkCa::new(&work.path().join("ca"));
    // Another CA of the same name: its EK certificates look alike but chain to another key.
    let other_ca = EkCa::new(&work.path().join("other-ca"));
    let config = work.path().join("better-compute.toml");
    std::fs::write(&config, "").unwrap();
    let config_text = config.display().to_string();
    let (mut server, port) = Server::with_env(&[("BETTER_COMPUTE_CONFIG", &config_text)], bc_tests::agents_gateway);

    // Before the deployment names an EK CA bundle, a TPM join is refused as not configured.
    let tpm = SoftwareTpm::manufacture(&work.path().join("tpm"), &ca);
    let early = AgentNode::new(&server, port);
    let (code, out, err) = join_by_tpm(&early, &tpm, &[]);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("TPM_NOT_CONFIGURED"), "{err}");

    let pool = server.pool("tpm").await;
    std::fs::write(&config, format!("tpm-ek-ca-bundle = {:?}\ntpm-join-pool = {pool:?}\n", ca.certificate.display().to_string()))
        .unwrap();
    server.restart();

    // No token: the TPM proves the machine.
    let machine = AgentNode::new(&server, port);
    let recorded = work.path().join("quote.json");
    let recorded_text = recorded.display().to_string();
    let (code, out, err) = join_by_tpm(&machine, &tpm, &[("BCD_TPM_QUOTE_RECORD", &recorded_text)]);
    assert_eq!(code, 0, "bcd join --attestor tpm: {out} {err}");
    let node = machine.node_id();
    assert!(out.contains(&format!("joined as {node} (tenant ")) && out.contains(&pool), "{out}");

    // The evidence, in the event, checked again from it alone.
    let joined = joined_events(&server).await;
    assert_eq!(joined.len(), 1, "{joined:?}");
    let event = &joined[0];
    let evidence = &event["payload"]["tpm"];
    assert_eq!(event["payload"]["joinTokenId"], "", "{event}");
    assert_eq!(event["stream"], format!("node/{node}"));
    let ek_pin = evidence["ekPin"].as_str().unwrap();
    assert_eq!(event["actor"], format!("tpm:{ek_pin}"));
    let ek_certificate = b64(&evidence["ekCertificates"][0]);
    let pem = format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        base64::engine::general_purpose::STANDARD.encode(&ek_certificate)
    );
    std::fs::write(work.path().join("ek.pem"), pem).unwrap();
    let verified = run(Command::new("openssl").args(["verify", "-CAfile"]).arg(&ca.certificate).arg(work.path().join("ek.pem")));
    assert!(verified.contains(": OK"), "openssl verify: {verified}");
    let bundle = bc_gateway::tpm::EkCaBundle::from_pem(&std::fs::read(&ca.certificate).unwrap()).unwrap();
    let ek = bundle.verify_chain(&[ek_certificate], (bc_tests::now_ms() / 1000) as i64).unwrap();
    assert_eq!(ek.pin, ek_pin);
    assert_eq!(bc_gateway::tpm::node_id_of(&ek.spki_der).to_string(), node, "the EK names the node");
    let ak = bc_gateway::tpm::AkPublic::parse(&b64(&evidence["akPublic"])).unwrap();
    let qualifying: [u8; 32] = b64(&evidence["qualifyingData"]).try_into().unwrap();
    let pcr_values: Vec<Vec<u8>> =
        evidence["pcrValues"].as_array().unwrap().iter().map(|v| hex::decode(v.as_str().unwrap()).unwrap()).collect();
    assert_eq!(evidence["pcrs"], json!([0, 1, 2, 3, 4, 5, 6, 7]));
    let quote = bc_gateway::tpm::Quote::verify(
        &b64(&evidence["quote"]),
        &b64(&evidence["quoteSignature"]),
        &ak,
        &qualifying,
        &pcr_values,
    )
    .expect("the quote in the log verifies");
    assert_eq!(quote.pcrs, bc_gateway::tpm::QUOTED_PCRS);

    // The node it joined as goes live (its certificate, its session).
    let mut machine = machine;
    machine.start();
    wait_until("the TPM node is live", Duration::from_secs(30), || machine.status().filter(|s| s["session"] == "live"));
    machine.stop();

    // The same TPM as a new node (a fresh node key): refused, no second node.
    let again = AgentNode::new(&server, port);
    let (code, out, err) = join_by_tpm(&again, &tpm, &[]);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("TPM_ALREADY_JOINED") && err.contains(&node), "{err}");
    assert!(!again.data().join("identity.json").exists());

    // The first join's quote replayed in a new join: its nonce is not this join's.
    let replay = AgentNode::new(&server, port);
    let (code, out, err) = join_by_tpm(&replay, &tpm, &[("BCD_TPM_QUOTE_REPLAY", &recorded_text)]);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("TPM_QUOTE_NONCE"), "{err}");

    // A TPM whose EK certificate another CA (of the same name) signed.
    let stranger = SoftwareTpm::manufacture(&work.path().join("stranger"), &other_ca);
    let outsider = AgentNode::new(&server, port);
    let (code, out, err) = join_by_tpm(&outsider, &stranger, &[]);
    assert_eq!(code, 1, "{out} {err}");
    assert!(err.contains("TPM_EK_UNTRUSTED"), "{err}");

    assert_eq!(joined_events(&server).await.len(), 1, "no refused join made a node");
    // A TPM join takes no token file (exit 2, nothing sent).
    let (code, _, err) =
        outsider.bcd(&["join", "--config", &outsider.config(), "--attestor", "tpm", "--token-file", "t"], &[], None);
    assert_eq!(code, 2, "{err}");
}
