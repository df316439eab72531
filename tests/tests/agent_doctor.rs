//! `bcd doctor` end to end: against a real `better-compute dev` and a joined
//! `bcd`, the checks a node needs are `ok` (the hardware checks read a fake tree, so they are
//! too, except NVML on a machine without a driver, a warning that `--strict` turns into exit 1);
//! a wrong serving pin fails the gateway check and exits 1; a missing configuration fails with
//! a fix.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bc_tests::wait_until;
use serde_json::{Value, json};

use bc_tests::bcd;

/// `bcd doctor --json`: the exit code and the checks by name.
fn doctor(config: &str, extra: &[&str]) -> (i32, Vec<Value>) {
    let mut args = vec!["doctor", "--config", config, "--json"];
    args.extend_from_slice(extra);
    let (code, out, err) = bcd(&args, &[], None);
    let checks = serde_json::from_str::<Value>(&out).unwrap_or_else(|e| panic!("doctor --json: {e}: {out} {err}"));
    (code, checks.as_array().unwrap().clone())
}

fn check<'a>(checks: &'a [Value], name: &str) -> &'a Value {
    checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no {name} check: {checks:?}"))
}

/// A fake hardware tree with vfio-pci bound and a libvirt socket.
fn hardware_root(dir: &std::path::Path) -> std::path::PathBuf {
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("sys/bus/pci/drivers/vfio-pci")).unwrap();
    std::fs::write(root.join("sys/bus/pci/drivers/vfio-pci/bind"), "").unwrap();
    std::fs::create_dir_all(root.join("var/run/libvirt")).unwrap();
    std::fs::write(root.join("var/run/libvirt/virtqemud-sock"), "").unwrap();
    root
}

fn write_config(dir: &std::path::Path, port: u16, serving_pin: &str, log_pin: &str) -> String {
    let path = dir.join("config.toml");
    let text = format!(
        "data_dir = {:?}\ngateway = \"https://127.0.0.1:{port}\"\nserving_ca_spki_pin = {serving_pin:?}\nlog_key_pin = {log_pin:?}\nobserve_interval = \"200ms\"\n\n[log]\nformat = \"json\"\n\n[hardware]\nroot = {:?}\n\n[hypervisor]\nuri = \"test:///default\"\n",
        dir.join("data").display().to_string(),
        hardware_root(dir).display().to_string(),
    );
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

const REQUIRED: &[&str] = &["config", "identity", "journal", "gateway", "clock"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_passes_on_a_joined_node_and_fails_a_wrong_pin_and_a_missing_config() {
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("doctor").await;
    let dir = tempfile::tempdir().unwrap();
    let log_pin = bc_tests::log_key_pin(&server);
    let config = write_config(dir.path(), port, server.agents_pin.as_deref().unwrap(), &log_pin);

    // Before the join: the identity check fails and says to join.
    let (code, checks) = doctor(&config, &[]);
    assert_eq!(code, 1, "{checks:?}");
    assert_eq!(check(&checks, "identity")["status"], "fail");
    assert!(check(&checks, "identity")["fix"].as_str().unwrap().contains("bcd join"));
    assert_eq!(check(&checks, "gateway")["status"], "ok", "the gateway answers before a join too: {checks:?}");

    let (status, created) = server.call("joinTokens.create", json!({ "poolId": pool })).await;
    assert_eq!(status, 200, "{created}");
    let (code, out, err) = bcd(&["join", "--config", &config], &[], Some(&format!("{}\n", created["token"].as_str().unwrap())));
    assert_eq!(code, 0, "bcd join: {out} {err}");

    // Joined, before bcd node: no journal yet is fine.
    let (code, checks) = doctor(&config, &[]);
    for name in REQUIRED {
        assert_eq!(check(&checks, name)["status"], "ok", "{name}: {checks:?}");
    }
    assert!(check(&checks, "gateway")["message"].as_str().unwrap().contains("pinned certificate"), "{checks:?}");
    assert_eq!(check(&checks, "vfio")["status"], "ok", "{checks:?}");
    assert_eq!(check(&checks, "libvirt")["status"], "ok", "{checks:?}");
    let hypervisor = check(&checks, "hypervisor");
    assert_eq!(hypervisor["status"], "ok", "the configured libvirt answers: {checks:?}");
    assert!(hypervisor["message"].as_str().unwrap().contains("test:///default"), "{hypervisor}");
    assert_ne!(check(&checks, "nvml")["status"], "fail", "no driver is a warning, never a failure: {checks:?}");
    assert_eq!(code, 0, "{checks:?}");

    // With bcd node running: the journal is this node's, and the doctor does not disturb it.
    let log = std::fs::File::create(dir.path().join("node.log")).unwrap();
    let mut node: Child = Command::new(bc_tests::binary("bcd"))
        .args(["node", "--config", &config])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let node_id = check(&checks, "identity")["message"].as_str().unwrap().split(' ').next().unwrap().to_owned();
    wait_until("bcd node writes its journal", Duration::from_secs(20), || {
        dir.path().join("data/journal.db").exists().then_some(())
    });
    wait_until("the node is ready", Duration::from_secs(20), || {
        let (status, doc) = bc_tests::block_on(server.call("nodes.get", json!({ "nodeId": node_id })));
        (status == 200 && doc["state"] == "ready").then_some(())
    });
    let (code, checks) = doctor(&config, &[]);
    assert_eq!(code, 0, "{checks:?}");
    let journal = check(&checks, "journal");
    assert_eq!(journal["status"], "ok");
    assert!(journal["message"].as_str().unwrap().contains(&format!("{node_id}'s")), "{journal}");
    // Human output: one line per check, the status first.
    let (code, out, _) = bcd(&["doctor", "--config", &config], &[], None);
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), checks.len(), "{out}");
    assert!(out.lines().any(|l| l.starts_with("ok   gateway: ")), "{out}");
    // --strict: the warning of a machine without NVML is a failure.
    let nvml_warns = check(&checks, "nvml")["status"] == "warn";
    let (code, _) = doctor(&config, &["--strict"]);
    assert_eq!(code, i32::from(nvml_warns), "--strict exits 1 exactly when something warns: {checks:?}");
    let node_log = std::fs::read_to_string(dir.path().join("node.log")).unwrap();
    assert!(!node_log.contains("the session to the gateway ended"), "the doctor's call took no session: {node_log}");
    let _ = node.kill();
    let _ = node.wait();

    // Another serving pin: the gateway check fails and says the pin did not match.
    let wrong = dir.path().join("wrong");
    std::fs::create_dir_all(&wrong).unwrap();
    let wrong_config = write_config(&wrong, port, "sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", &log_pin);
    let (code, checks) = doctor(&wrong_config, &[]);
    assert_eq!(code, 1, "{checks:?}");
    let gateway = check(&checks, "gateway");
    assert_eq!(gateway["status"], "fail");
    assert!(gateway["message"].as_str().unwrap().contains("does not match serving_ca_spki_pin"), "{gateway}");
    assert!(gateway["fix"].as_str().unwrap().contains("serving_ca_spki_pin"), "{gateway}");
    assert_ne!(check(&checks, "clock")["status"], "ok", "no clock without a trusted gateway");

    // No configuration: the config check fails with a fix.
    let missing = dir.path().join("absent.toml").display().to_string();
    let (code, checks) = doctor(&missing, &[]);
    assert_eq!(code, 1);
    let config_check = check(&checks, "config");
    assert_eq!(config_check["status"], "fail");
    assert!(config_check["fix"].as_str().unwrap().contains("--config"), "{config_check}");
    let (code, out, _) = bcd(&["doctor", "--config", &missing], &[], None);
    assert_eq!(code, 1);
    assert!(out.starts_with("fail config: ") && out.contains("(fix: "), "{out}");
}
