//! Break-glass SSH end to end, against Debian's real `sshd`: `dev`, a fakehw `bcd node` with
//! `[ssh]` writing the deployment's CA and its principals file, `sshd` on a loopback port
//! reading exactly those files, and `better-compute ssh-cert --connect` running the real `ssh`.
//! `sshd` itself refuses a certificate for another node, one signed by another CA, an expired
//! one, and a port forward (a certificate permits a terminal only). After `pki rotate-ssh-ca`,
//! certificates of the old CA and of the new one both log in until the grace ends, and then
//! `sshd` refuses the old one's. The method's validation and authorization are checked at the
//! API.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bc_tests::{AgentNode, Server, wait_until};
use serde_json::{Value, json};

/// `sshd -D -e` on a loopback port with its own host key, trusting the CA file the agent
/// wrote, for the principals file the agent wrote; killed when dropped.
struct Sshd {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Sshd {
    fn start(dir: &Path, ca_file: &Path, principals: &str) -> Sshd {
        let host_key = dir.join("host_key");
        run("ssh-keygen", &["-q", "-t", "ed25519", "-N", "", "-f", &host_key.display().to_string()]);
        // sshd's privilege separation directory.
        std::fs::create_dir_all("/run/sshd").unwrap();
        let port = bc_tests::free_port();
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {}\nPidFile {}\nTrustedUserCAKeys {}\n\
                 AuthorizedPrincipalsFile {principals}\nAuthorizedKeysFile none\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\nLogLevel VERBOSE\n",
                host_key.display(),
                dir.join("sshd.pid").display(),
                ca_file.display(),
            ),
        )
        .unwrap();
        let log = dir.join("sshd.log");
        let child = Command::new("/usr/sbin/sshd")
            .args(["-D", "-e", "-f", &config.display().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start sshd (openssh-server: scripts/system-deps installs it)");
        wait_until("sshd listens", Duration::from_secs(10), || std::net::TcpStream::connect(("127.0.0.1", port)).ok());
        Sshd { child, port, log }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The account the test logs in as: the one sshd runs as (root in CI).
fn account() -> String {
    run("id", &["-un"]).trim().to_owned()
}

/// A wrapper around `ssh` adding what a test needs (the port, no known hosts, no prompts, no
/// user configuration) and passing `ssh-cert`'s own arguments through unchanged.
fn ssh_wrapper(dir: &Path, port: u16) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("ssh-wrapper");
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nexec ssh -F /dev/null -p {port} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes -o LogLevel=ERROR \"$@\"\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `ssh` with a certificate to the test's sshd, running `echo ok`: (status, stdout).
fn ssh_with(wrapper: &Path, key: &Path, certificate: &Path, account: &str) -> (i32, String) {
    ssh_with_options(wrapper, key, certificate, account, &[])
}

/// [`ssh_with`], with more ssh options before the host.
fn ssh_with_options(wrapper: &Path, key: &Path, certificate: &Path, account: &str, options: &[&str]) -> (i32, String) {
    let out = Command::new(wrapper)
        .args(["-i", &key.display().to_string(), "-o", &format!("CertificateFile={}", certificate.display())])
        .args(["-o", "IdentitiesOnly=yes", "-l", account])
        .args(options)
        .args(["--", "127.0.0.1", "echo", "ok"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A machine that joined `server`'s pool, with `[ssh]` naming files in its directory when
/// `ssh` (accounts: `account`).
async fn joined_machine(server: &Server, port: u16, pool: &str, ssh: Option<&str>) -> AgentNode {
    let machine = AgentNode::new(server, port);
    if let Some(account) = ssh {
        let section = format!(
            "\n[ssh]\ntrusted_user_ca_keys = {:?}\nauthorized_principals_file = {:?}\naccounts = [{account:?}]\nsshd_config = {:?}\n",
            machine.dir.path().join("ssh/ca.pub").display().to_string(),
            format!("{}/ssh/principals/%u", machine.dir.path().display()),
            machine.dir.path().join("sshd_config").display().to_string(),
        );
        let mut config = std::fs::read_to_string(machine.config()).unwrap();
        config.push_str(&section);
        std::fs::write(machine.config(), config).unwrap();
    }
    let token_file = machine.dir.path().join("join.token");
    let (code, _, err) = server.cli(&["join-tokens", "create", "--pool", pool, "--out", &token_file.display().to_string()]);
    assert_eq!(code, 0, "join-tokens create: {err}");
    let (code, out, err) = machine.join_stdin(std::fs::read_to_string(&token_file).unwrap().trim());
    assert_eq!(code, 0, "bcd join: {out} {err}");
    machine
}

async fn ssh_cert_events(server: &Server) -> Vec<Value> {
    let (status, page) = server.call("events.list", json!({ "types": ["node.ssh_cert_issued"], "limit": 100 })).await;
    assert_eq!(status, 200, "{page}");
    page["items"].as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_node_bound_certificate_opens_sshd_on_that_node_only_and_sshd_refuses_the_rest() {
    let account = account();
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let mut machine = joined_machine(&server, port, &pool, Some(&account)).await;
    let node = machine.node_id();
    machine.start();
    let ca_file = machine.dir.path().join("ssh/ca.pub");
    let principals = machine.dir.path().join("ssh/principals").join(&account);
    wait_until("the agent writes the CA and principals files", Duration::from_secs(20), || {
        (ca_file.exists() && principals.exists()).then_some(())
    });
    // The CA the agent installed is the one `pki show` prints.
    let (code, out, err) = server.cli(&["pki", "show", "--data-dir", &server.data_dir.display().to_string()]);
    assert_eq!(code, 0, "{err}");
    let ca_line = bc_tests::json(&out)["sshUserCa"].as_str().expect("pki show prints the SSH user CA").to_owned();
    assert!(std::fs::read_to_string(&ca_file).unwrap().lines().any(|l| l == ca_line), "the node trusts the deployment's CA");
    assert_eq!(std::fs::read_to_string(&principals).unwrap().lines().last(), Some(format!("bc-node:{node}:{account}").as_str()));

    let dir = machine.dir.path().to_path_buf();
    let principals_pattern = format!("{}/ssh/principals/%u", dir.display());
    let sshd = Sshd::start(&dir, &ca_file, &principals_pattern);
    // `bcd doctor` reads the same sshd configuration and finds both files named.
    let (_, out, _) = machine.bcd(&["doctor", "--config", &machine.config(), "--json"], &[], None);
    let checks = bc_tests::json(&out);
    let ssh =
        checks.as_array().unwrap().iter().find(|c| c["name"] == "ssh").unwrap_or_else(|| panic!("doctor checks ssh: {out}"));
    assert_eq!(ssh["status"], "ok", "{ssh}");

    let key = dir.join("id_ed25519");
    run("ssh-keygen", &["-q", "-t", "ed25519", "-N", "", "-C", "tester", "-f", &key.display().to_string()]);
    let public = format!("{}.pub", key.display());
    let certificate = dir.join("id_ed25519-cert.pub");
    let wrapper = ssh_wrapper(&dir, sshd.port);
    let wrapper_arg = wrapper.display().to_string();

    // The one path a person takes: issue, write beside the key, run ssh.
    let (code, out, err) = server.cli(&[
        "ssh-cert",
        "--node",
        &node,
        "--key",
        &public,
        "--account",
        &account,
        "--minutes",
        "15",
        "--connect",
        "127.0.0.1",
        "--ssh",
        &wrapper_arg,
        "--",
        "echo",
        "ok",
    ]);
    assert_eq!((code, out.trim()), (0, "ok"), "ssh-cert --connect: {err}\nsshd: {}", sshd.log_text());
    let listed = run("ssh-keygen", &["-L", "-f", &certificate.display().to_string()]);
    assert!(listed.contains("ssh-ed25519-cert-v01@openssh.com user certificate"), "{listed}");
    assert!(listed.contains(&format!("bc-node:{node}:{account}")), "{listed}");
    assert!(
        listed.contains(&format!("node={node}")) && listed.contains("caller=apikey:") && listed.contains("request=req_"),
        "{listed}"
    );
    assert!(listed.contains("Valid: from"), "{listed}");
    assert!(listed.contains("permit-pty"), "{listed}");
    for broader in ["permit-port-forwarding", "permit-agent-forwarding", "permit-X11-forwarding", "permit-user-rc"] {
        assert!(!listed.contains(broader), "a terminal only, not {broader}: {listed}");
    }
    // sshd itself holds the certificate to that: a remote port forward is refused.
    let forward = ["-o", "ExitOnForwardFailure=yes", "-R", "0:127.0.0.1:9"];
    let (code, out) = ssh_with_options(&wrapper, &key, &certificate, &account, &forward);
    assert_eq!((code, out.as_str()), (255, ""), "no port forwarding: {}", sshd.log_text());
    assert!(
        sshd.log_text().contains("Accepted publickey") || sshd.log_text().contains("Accepted certificate"),
        "{}",
        sshd.log_text()
    );

    // The event says who, which node, which account and key, and no key material.
    let events = ssh_cert_events(&server).await;
    assert_eq!(events.len(), 1, "{events:?}");
    let event = events[0].to_string();
    let payload = &events[0]["payload"];
    assert_eq!(payload["account"], account.as_str());
    assert_eq!(payload["principal"], format!("bc-node:{node}:{account}"));
    assert!(payload["publicKeyFingerprint"].as_str().unwrap().starts_with("SHA256:"), "{event}");
    let key_base64 = std::fs::read_to_string(&public).unwrap().split(' ').nth(1).unwrap().to_owned();
    assert!(!event.contains(&key_base64) && !event.contains("PRIVATE"), "{event}");

    // ssh's status is the command's.
    let (code, _, _) = server.cli(&[
        "ssh-cert",
        "--node",
        &node,
        "--key",
        &public,
        "--account",
        &account,
        "--connect",
        "127.0.0.1",
        "--ssh",
        &wrapper_arg,
        "--",
        "exit",
        "7",
    ]);
    assert_eq!(code, 7);

    // A short certificate, kept for the expiry check at the end.
    let (code, out, err) = server.cli(&["ssh-cert", "--node", &node, "--key", &public, "--account", &account, "--minutes", "1"]);
    assert_eq!(code, 0, "{err}");
    let short = bc_tests::json(&out);
    let short_valid_before = short["validBefore"].as_u64().expect("validBefore, unix seconds");
    let short_certificate = dir.join("short-cert.pub");
    std::fs::copy(&certificate, &short_certificate).unwrap();
    let (code, out) = ssh_with(&wrapper, &key, &short_certificate, &account);
    assert_eq!((code, out.trim()), (0, "ok"), "valid for now");

    // A certificate for another node: sshd finds its principal in no file of this node.
    let other = joined_machine(&server, port, &pool, None).await;
    let other_node = other.node_id();
    let (code, _, err) = server.cli(&["ssh-cert", "--node", &other_node, "--key", &public, "--account", &account]);
    assert_eq!(code, 0, "{err}");
    let (code, out) = ssh_with(&wrapper, &key, &certificate, &account);
    assert_eq!((code, out.as_str()), (255, ""), "another node's certificate is refused");

    // One signed by another CA, for this node's very principal.
    let rogue_ca = dir.join("rogue_ca");
    run("ssh-keygen", &["-q", "-t", "ed25519", "-N", "", "-f", &rogue_ca.display().to_string()]);
    let principal = format!("bc-node:{node}:{account}");
    run("ssh-keygen", &["-q", "-s", &rogue_ca.display().to_string(), "-I", "rogue", "-n", &principal, "-V", "-5m:+5m", &public]);
    let (code, out) = ssh_with(&wrapper, &key, &certificate, &account);
    assert_eq!((code, out.as_str()), (255, ""), "another CA's certificate is refused");

    // The short one, once past its validBefore.
    wait_until("the short certificate expires", Duration::from_secs(90), || {
        (bc_tests::now_ms() / 1000 > short_valid_before + 1).then_some(())
    });
    let (code, out) = ssh_with(&wrapper, &key, &short_certificate, &account);
    assert_eq!((code, out.as_str()), (255, ""), "an expired certificate is refused");
    let log = sshd.log_text();
    assert!(log.contains("expired") || log.contains("not yet valid") || log.contains("Certificate invalid"), "{log}");
    assert_eq!(ssh_cert_events(&server).await.len(), 4);
}

/// The grace the rotation test gives the replaced CA: long enough for the checks made within
/// it, short enough to wait out.
const ROTATION_GRACE_S: u64 = 30;

/// The SSH user CA keys in the file the agent wrote for sshd.
fn trusted_lines(ca_file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(ca_file).unwrap_or_default();
    text.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).map(str::to_owned).collect()
}

/// `ssh-keygen -L`'s "Signing CA" line of a certificate.
fn signing_ca(certificate: &Path) -> String {
    let listed = run("ssh-keygen", &["-L", "-f", &certificate.display().to_string()]);
    listed.lines().find(|l| l.trim_start().starts_with("Signing CA:")).unwrap_or_else(|| panic!("{listed}")).to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn after_a_rotation_both_cas_log_in_until_the_grace_ends_then_sshd_refuses_the_old_one() {
    let account = account();
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let mut machine = joined_machine(&server, port, &pool, Some(&account)).await;
    let node = machine.node_id();
    machine.start();
    let dir = machine.dir.path().to_path_buf();
    let ca_file = dir.join("ssh/ca.pub");
    wait_until("the agent writes the CA file", Duration::from_secs(20), || ca_file.exists().then_some(()));
    let sshd = Sshd::start(&dir, &ca_file, &format!("{}/ssh/principals/%u", dir.display()));
    let wrapper = ssh_wrapper(&dir, sshd.port);
    let key = dir.join("id_ed25519");
    run("ssh-keygen", &["-q", "-t", "ed25519", "-N", "", "-C", "tester", "-f", &key.display().to_string()]);
    let public = format!("{}.pub", key.display());
    let certificate = dir.join("id_ed25519-cert.pub");
    let data_dir = server.data_dir.display().to_string();
    let issue = |what: &str| {
        let (code, out, err) = server.cli(&["ssh-cert", "--node", &node, "--key", &public, "--account", &account]);
        assert_eq!(code, 0, "{what}: {err}");
        bc_tests::json(&out)
    };

    // A certificate of the first CA, kept for after the rotation.
    let (code, out, err) = server.cli(&["pki", "show", "--data-dir", &data_dir]);
    assert_eq!(code, 0, "{err}");
    let first = bc_tests::json(&out);
    let first_ca = first["sshUserCa"].as_str().unwrap().to_owned();
    assert_eq!((first["sshUserCaGeneration"].as_u64(), first["sshUserCaInGrace"].clone()), (Some(1), json!([])));
    issue("the first CA's certificate");
    let old_certificate = dir.join("old-cert.pub");
    std::fs::copy(&certificate, &old_certificate).unwrap();
    assert_eq!(ssh_with(&wrapper, &key, &old_certificate, &account), (0, "ok\n".into()));

    let (code, out, err) =
        server.cli(&["pki", "rotate-ssh-ca", "--data-dir", &data_dir, "--grace", &format!("{ROTATION_GRACE_S}s")]);
    assert_eq!(code, 0, "pki rotate-ssh-ca: {err}");
    let rotated = bc_tests::json(&out);
    let new_ca = rotated["publicKey"].as_str().unwrap().to_owned();
    let grace_ends_ms = rotated["graceEndsAtMs"].as_u64().unwrap();
    assert_ne!(new_ca, first_ca);
    assert_eq!((rotated["generation"].as_u64(), rotated["previousKeyDeleted"].as_bool()), (Some(2), Some(true)), "{rotated}");

    // The running server signs with the new CA at once; the agent trusts both.
    let answer = issue("the new CA's certificate");
    assert_eq!(answer["caFingerprint"], rotated["fingerprint"], "{answer}");
    assert!(signing_ca(&certificate).contains(rotated["fingerprint"].as_str().unwrap()), "{}", signing_ca(&certificate));
    wait_until("the agent trusts the new CA beside the old one", Duration::from_secs(10), || {
        (trusted_lines(&ca_file) == [new_ca.clone(), first_ca.clone()]).then_some(())
    });
    let (code, out, err) = server.cli(&["pki", "show", "--data-dir", &data_dir]);
    assert_eq!(code, 0, "{err}");
    let shown = bc_tests::json(&out);
    assert_eq!((shown["sshUserCa"].as_str(), shown["sshUserCaGeneration"].as_u64()), (Some(new_ca.as_str()), Some(2)));
    let in_grace = &shown["sshUserCaInGrace"];
    assert_eq!(
        (in_grace[0]["publicKey"].as_str(), in_grace[0]["graceEndsAtMs"].as_u64()),
        (Some(first_ca.as_str()), Some(grace_ends_ms)),
        "{shown}"
    );

    // Within the grace, both log in.
    assert_eq!(ssh_with(&wrapper, &key, &certificate, &account), (0, "ok\n".into()), "the new CA's: {}", sshd.log_text());
    assert_eq!(ssh_with(&wrapper, &key, &old_certificate, &account), (0, "ok\n".into()), "the old CA's: {}", sshd.log_text());
    assert!(bc_tests::now_ms() < grace_ends_ms, "the checks within the grace took longer than {ROTATION_GRACE_S} s");

    // The rotation is in the root tenant's log, public keys only.
    let (status, page) = server.call("events.list", json!({ "types": ["ssh_ca.rotated"], "limit": 10 })).await;
    assert_eq!(status, 200, "{page}");
    let events = page["items"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{page}");
    assert_eq!(events[0]["payload"]["previousPublicKey"], first_ca.as_str());
    assert_eq!(events[0]["payload"]["graceEndsAtMs"], grace_ends_ms);

    // Once the grace ends, the agent writes the new CA alone, and sshd refuses the old one's.
    wait_until("the grace ends", Duration::from_secs(ROTATION_GRACE_S + 10), || {
        (bc_tests::now_ms() >= grace_ends_ms).then_some(())
    });
    wait_until("the agent trusts the new CA alone", Duration::from_secs(10), || {
        (trusted_lines(&ca_file) == [new_ca.clone()]).then_some(())
    });
    assert_eq!(ssh_with(&wrapper, &key, &old_certificate, &account), (255, String::new()), "the old CA's, after the grace");
    assert_eq!(ssh_with(&wrapper, &key, &certificate, &account), (0, "ok\n".into()), "the new CA's: {}", sshd.log_text());
    let (code, out, _) = server.cli(&["pki", "show", "--data-dir", &data_dir]);
    assert_eq!((code, bc_tests::json(&out)["sshUserCaInGrace"].clone()), (0, json!([])));
}

#[tokio::test(flavor = "multi_thread")]
async fn issue_ssh_cert_checks_its_input_and_the_action_before_signing() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("gpu-a").await;
    let machine = joined_machine(&server, port, &pool, None).await;
    let node = machine.node_id();
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGPp5cSj0ubxLBNKS9nHc9vlsXR+lxeUHkpUqc6yIaLy me@laptop";
    let body = |patch: Value| {
        let mut body = json!({ "nodeId": node, "publicKey": key, "account": "root", "minutes": 15 });
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let private =
        "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n-----END OPENSSH PRIVATE KEY-----\n";
    for (patch, says) in [
        (json!({ "publicKey": private }), "private key"),
        (json!({ "publicKey": "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQC7 x" }), "not an OpenSSH public key"),
        (json!({ "account": "Root" }), "Unix account"),
        (json!({ "account": "root;reboot" }), "Unix account"),
        (json!({ "minutes": 0 }), "1 to 60"),
        (json!({ "minutes": 61 }), "1 to 60"),
    ] {
        let (status, answer) = server.call("nodes.issueSshCert", body(patch.clone())).await;
        assert_eq!((status, answer["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{patch}: {answer}");
        assert!(answer.to_string().contains(says), "{patch}: {answer}");
        assert!(!answer.to_string().contains("b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ"), "the key is not echoed");
    }
    // The default validity is 15 minutes.
    let (status, answer) =
        server.call("nodes.issueSshCert", json!({ "nodeId": node, "publicKey": key, "account": "root" })).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["principal"], format!("bc-node:{node}:root"));
    let now_s = bc_tests::now_ms() / 1000;
    let valid_before = answer["validBefore"].as_u64().unwrap();
    assert!((now_s + 14 * 60..=now_s + 16 * 60).contains(&valid_before), "{answer}");

    // A key that may write nodes but not ssh-root gets nothing.
    let (status, created) = server
        .call("apiKeys.create", json!({ "name": "nodes-writer", "actions": ["compute:nodes:read", "compute:nodes:write"] }))
        .await;
    assert_eq!(status, 200, "{created}");
    let writer = created["token"].as_str().unwrap().to_owned();
    let (status, denied) = server.call_as(&writer, "nodes.issueSshCert", body(json!({})), None).await;
    assert_eq!((status, denied["code"].as_str()), (403, Some("ACCESS_DENIED")), "{denied}");
    let (status, created) =
        server.call("apiKeys.create", json!({ "name": "breakglass", "actions": ["compute:nodes:ssh-root"] })).await;
    assert_eq!(status, 200, "{created}");
    let breakglass = created["token"].as_str().unwrap().to_owned();
    let (status, answer) = server.call_as(&breakglass, "nodes.issueSshCert", body(json!({})), None).await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["keyId"].as_str().unwrap().contains(&format!("caller=apikey:{}", created["id"].as_str().unwrap_or("key_"))),
        "{answer}"
    );
    assert_eq!(ssh_cert_events(&server).await.len(), 2);
}
