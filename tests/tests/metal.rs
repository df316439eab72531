//! Bare metal through the real binary: the `metal` commands' validation at the
//! edge, `INVALID_STATE` naming the verbs allowed, the in-process `metal` reconciler failing a
//! workflow against a BMC that is not there with the reason, within its bound, and the BMC's
//! password in no row, log line, event or answer.

use std::time::Duration;

use bc_tests::{Server, json, wait_until};
use serde_json::Value;

const PASSWORD: &str = "bmc-password-7f3a9c-never-shown";

/// Every byte of the dev server's database files (the main file, its WAL and shared memory).
fn database_bytes(server: &Server) -> Vec<u8> {
    let mut all = Vec::new();
    for suffix in ["", "-wal", "-shm"] {
        let path = format!("{}{suffix}", server.sqlite_path().display());
        if let Ok(bytes) = std::fs::read(&path) {
            all.extend(bytes);
        }
    }
    all
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

fn enroll(server: &Server, pool: &str, address: &str, password_file: &std::path::Path, tls: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "metal",
        "enroll",
        "--pool",
        pool,
        "--name",
        "rack1-u07",
        "--bmc-address",
        address,
        "--bmc-username",
        "admin",
        "--bmc-password-file",
        password_file.to_str().unwrap(),
    ];
    args.extend_from_slice(tls);
    server.cli(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enroll_is_checked_at_the_edge_verbs_name_what_is_allowed_and_the_password_is_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("bmc-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    // Nothing listens here: every BMC call is refused.
    let port = bc_tests::free_port();
    let address = format!("https://127.0.0.1:{port}");

    // Without the operator naming it, a BMC on loopback is refused at enrollment.
    {
        let server = Server::dev();
        let pool = server.pool("metal").await;
        for given in [address.clone(), format!("https://localhost:{port}")] {
            let (code, out, err) = enroll(&server, &pool, &given, &password_file, &["--bmc-insecure"]);
            assert_eq!(code, 1, "{given}: {out}{err}");
            assert!(
                err.contains("ACCESS_DENIED")
                    && err.contains("not on a network this deployment reaches BMCs on")
                    && err.contains("--bmc-allow-network"),
                "{err}"
            );
        }
    }

    let server = Server::dev_with(&["--bmc-allow-network", "127.0.0.1/32"]);
    let pool = server.pool("metal").await;

    // At the edge: http, no way to check the certificate, two ways, a path in the address.
    for (given, tls, why) in [
        (format!("http://127.0.0.1:{port}"), vec!["--bmc-insecure"], "https://"),
        (address.clone(), vec![], "--bmc-ca-file, --bmc-pin or --bmc-insecure"),
        (format!("{address}/redfish/v1"), vec!["--bmc-insecure"], "nothing after the port"),
        (address.clone(), vec!["--bmc-pin", "sha256/short"], "sha256/"),
    ] {
        let (code, out, err) = enroll(&server, &pool, &given, &password_file, &tls);
        assert_eq!(code, 2, "{given} {tls:?}: {out}{err}");
        assert!(err.contains(why), "{given} {tls:?}: {err}");
    }
    let (code, _, err) = server.cli(&[
        "metal",
        "enroll",
        "--pool",
        &pool,
        "--name",
        "x",
        "--bmc-address",
        &address,
        "--bmc-username",
        "admin",
        "--bmc-password",
        PASSWORD,
    ]);
    assert_eq!(code, 2, "a password is never an argument: {err}");

    let (code, out, err) = enroll(&server, &pool, &address, &password_file, &["--bmc-insecure"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("not checked"), "an insecure enrollment says so: {err}");
    let machine = json(&out);
    let node = machine["nodeId"].as_str().unwrap().to_owned();
    assert_eq!((machine["state"].as_str(), machine["bmc"]["insecure"].as_bool()), (Some("enroll"), Some(true)), "{machine}");

    // A verb the state does not take: INVALID_STATE, naming the verbs it does.
    let (status, refused) = server.call("metal.provide", serde_json::json!({ "nodeId": node })).await;
    assert_eq!((status, refused["code"].as_str()), (409, Some("INVALID_STATE")), "{refused}");
    assert_eq!(refused["details"]["allowed"], serde_json::json!(["manage", "recover"]), "{refused}");
    let (code, _, err) = server.cli(&["metal", "provide", &node]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains("allowed now: manage, recover"), "{err}");

    // Manage against a BMC that is not there: the step's bounded attempts, then back to
    // enroll with the reason, within the back-off's bound (1 + 2 + 4 + 8 s and the passes).
    let (code, out, err) = server.cli(&["metal", "manage", &node]);
    assert_eq!(code, 0, "{out}{err}");
    let machine: Value = wait_until("the manage fails", Duration::from_secs(60), || {
        let (_, out, _) = server.cli(&["metal", "get", &node]);
        let machine = json(&out);
        (machine["workflow"]["outcome"] == "failed").then_some(machine)
    });
    assert_eq!(machine["state"], "enroll", "{machine}");
    let error = machine["lastError"].as_str().unwrap();
    assert!(error.contains("failed 5 times") && error.contains("unreachable"), "{error}");
    let workflow = machine["workflow"]["workflowId"].as_str().unwrap().to_owned();
    let (code, out, err) = server.cli(&["workflows", "list", "--node", &node, "--format", "json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["items"][0]["workflowId"], workflow.as_str(), "{out}");
    let (code, out, _) = server.cli(&["workflows", "get", &workflow]);
    assert_eq!(code, 0);
    assert_eq!(json(&out)["steps"][0], serde_json::json!({ "name": "check-bmc", "state": "failed" }), "{out}");

    // Retry runs the failed verb again as a new workflow; pause stops its steps (its attempts
    // stand still while paused), resume runs them again; abort is refused outside a wait
    // state, naming what is allowed; a finished workflow is not paused.
    let (code, out, err) = server.cli(&["workflows", "retry", &workflow]);
    assert_eq!(code, 0, "{out}{err}");
    let again = json(&out);
    let again_id = again["workflowId"].as_str().unwrap().to_owned();
    assert!(again_id != workflow && again["outcome"] == "running" && again["verb"] == "manage", "{again}");
    let (code, out, err) = server.cli(&["workflows", "pause", &again_id]);
    assert_eq!((code, json(&out)["paused"].as_bool()), (0, Some(true)), "{out}{err}");
    let attempts_paused = json(&out)["attempts"].as_u64().unwrap();
    // Proof that passes ran while it was paused, not a sleep: a metal pass begun once the step
    // was due again (its back-off over) starts the step's turn were the workflow not paused,
    // and the pass after that one finds the turn ended (a refused connection ends it at once).
    let due_ms = json(&out)["retryAtMs"].as_u64().unwrap_or(0).max(bc_tests::now_ms());
    let due_pass = server.wait_reconciler_pass_after("metal", due_ms, Duration::from_secs(30));
    server.wait_reconciler_pass_after("metal", due_pass["startedAtMs"].as_u64().unwrap(), Duration::from_secs(30));
    let (_, out, _) = server.cli(&["workflows", "get", &again_id]);
    let paused = json(&out);
    assert_eq!((paused["paused"].as_bool(), paused["attempts"].as_u64()), (Some(true), Some(attempts_paused)), "{paused}");
    let (code, _, err) = server.cli(&["workflows", "abort", &again_id]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains("verifying"), "{err}");
    let (code, out, err) = server.cli(&["workflows", "resume", &again_id]);
    assert_eq!((code, json(&out)["paused"].as_bool()), (0, Some(false)), "{out}{err}");
    wait_until("the retried manage fails again", Duration::from_secs(60), || {
        let (_, out, _) = server.cli(&["workflows", "get", &again_id]);
        (json(&out)["outcome"] == "failed").then_some(())
    });
    let (code, _, err) = server.cli(&["workflows", "pause", &workflow]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not running"), "{err}");

    // The password: in no answer, no event, no log line, no byte of the database.
    let (code, events, _) = server.cli(&["events", "list", "--format", "json", "--limit", "500"]);
    assert_eq!(code, 0);
    assert!(events.contains("metal.enrolled") && !events.contains(PASSWORD), "{events}");
    assert!(!out.contains(PASSWORD) && !machine.to_string().contains(PASSWORD));
    assert!(!server.log_text().contains(PASSWORD), "the server log holds the password");
    assert!(!contains(&database_bytes(&server), PASSWORD), "the database holds the password in clear text");
}

/// What a sushy-driven test needs: the emulator, the control plane, a pool, the BMC's password
/// and CA in files, and an ISO the emulator can fetch, registered.
struct Rack {
    notifications: bc_tests::sushy::Notifications,
    emulator: bc_tests::sushy::Emulator,
    server: Server,
    agents_port: u16,
    pool: String,
    dir: tempfile::TempDir,
    image: String,
    _images: bc_tests::ImageServer,
}

async fn rack(server_args: &[&str]) -> Rack {
    use sha2::Digest;
    let pki = bc_tests::sushy::pki();
    let (notifications, notify_url) = bc_tests::sushy::Notifications::start();
    let emulator = bc_tests::sushy::Emulator::start(&pki, &notify_url);
    let mut server_args = server_args.to_vec();
    server_args.extend(["--bmc-allow-network", "127.0.0.1/32"]);
    let (server, agents_port) = bc_tests::agents_gateway_with(&server_args);
    let pool = server.pool("metal").await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("bmc-password"), format!("{}\n", bc_tests::sushy::PASSWORD)).unwrap();
    std::fs::write(dir.path().join("bmc-ca.pem"), &pki.ca_pem).unwrap();
    let iso = b"an installer ISO, as far as the emulator can tell".to_vec();
    let sha256 = hex::encode(sha2::Sha256::digest(&iso));
    let images = bc_tests::ImageServer::start("installer.iso", iso);
    let (status, image) = server
        .call(
            "images.register",
            serde_json::json!({ "name": "installer", "url": images.url, "sha256": sha256, "diskFormat": "iso" }),
        )
        .await;
    assert_eq!(status, 200, "{image}");
    let image = image["imageId"].as_str().unwrap().to_owned();
    Rack { notifications, emulator, server, agents_port, pool, dir, image, _images: images }
}

impl Rack {
    fn cli(&self, args: &[&str]) -> Value {
        let (code, out, err) = self.server.cli(args);
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        json(&out)
    }

    fn enroll(&self, system: &str) -> String {
        let address = format!("https://localhost:{}", self.emulator.port);
        let system_path = format!("/redfish/v1/Systems/{system}");
        let path = |name: &str| self.dir.path().join(name).display().to_string();
        let machine = self.cli(&[
            "metal",
            "enroll",
            "--pool",
            &self.pool,
            "--name",
            "rack1-u07",
            "--bmc-address",
            &address,
            "--bmc-system-path",
            &system_path,
            "--bmc-username",
            bc_tests::sushy::USERNAME,
            "--bmc-password-file",
            &path("bmc-password"),
            "--bmc-ca-file",
            &path("bmc-ca.pem"),
        ]);
        assert_eq!((machine["bmc"]["tls"].as_str(), machine["bmc"]["insecure"].as_bool()), (Some("ca"), Some(false)));
        machine["nodeId"].as_str().unwrap().to_owned()
    }

    fn machine(&self, node: &str) -> Value {
        self.cli(&["metal", "get", node])
    }

    fn wait_state(&self, node: &str, state: &str, within: Duration) -> Value {
        wait_until(&format!("{node} is {state}"), within, || {
            let machine = self.machine(node);
            assert!(machine["workflow"]["outcome"] != "failed" || machine["state"] == state, "the workflow failed: {machine}");
            (machine["state"] == state && machine["workflow"]["outcome"] != "running").then_some(machine)
        })
    }

    /// The boot devices the emulator saved for `system`, in order, with repeats folded.
    fn boot_devices(&self, system: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for state in self.notifications.of(system) {
            let device = state["boot_device"].as_str().unwrap_or_default().to_owned();
            if out.last() != Some(&device) {
                out.push(device);
            }
        }
        out
    }

    /// The installed system: a machine with GPUs whose `bcd join --node-id` uses the deploy's
    /// token file.
    fn installed_system(&self, node: &str, token_file: &std::path::Path) -> bc_tests::AgentNode {
        let machine = bc_tests::AgentNode::new(&self.server, self.agents_port);
        let seed = (1..100u64)
            .find(|seed| bc_tests::fake_hardware(*seed)["gpus"]["gpus"].as_array().is_some_and(|g| !g.is_empty()))
            .unwrap();
        let config = std::fs::read_to_string(machine.config()).unwrap();
        std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = {seed}\n")).unwrap();
        let token = token_file.display().to_string();
        let (code, out, err) =
            machine.bcd(&["join", "--node-id", node, "--token-file", &token, "--config", &machine.config()], &[], None);
        assert_eq!(code, 0, "bcd join --node-id: {out}{err}");
        assert!(out.contains(&format!("joined as {node}")), "{out}");
        machine
    }

    /// The machine's transitions in the log (`verb:from>to`), and its steps recorded done
    /// (`workflow/index`), in log order.
    fn history(&self, node: &str) -> (Vec<String>, Vec<String>) {
        let (code, out, err) = self.server.cli(&["events", "list", "--types", "metal.*", "--limit", "500", "--format", "json"]);
        assert_eq!(code, 0, "{err}");
        let page = json(&out);
        assert!(page["nextCursor"].is_null(), "more than a page of machine events");
        let mut transitions = Vec::new();
        let mut steps = Vec::new();
        let stream = format!("metal/{node}");
        for event in page["items"].as_array().unwrap().iter().filter(|e| e["stream"] == stream.as_str()) {
            let p = &event["payload"];
            match event["type"].as_str().unwrap() {
                "metal.transitioned" => transitions.push(format!(
                    "{}:{}>{}",
                    p["verb"].as_str().unwrap(),
                    p["from"].as_str().unwrap(),
                    p["to"].as_str().unwrap()
                )),
                "metal.step_done" => steps.push(format!("{}/{}", p["workflowId"].as_str().unwrap(), p["index"])),
                _ => {}
            }
        }
        (transitions, steps)
    }
}

/// End to end against sushy-tools: enroll → manage → provide → deploy → active (this test plays
/// the installed system's agent, which joins as the machine's node and takes a reservation) →
/// undeploy → available; power on, off and reboot seen by the emulator; the boot override set
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_is_deployed_through_a_redfish_bmc_joins_as_its_node_and_is_undeployed() {
    use bc_tests::sushy::{SYSTEM_A, SYSTEM_B, power_history};
    let rack = rack(&[]).await;
    let node = rack.enroll(SYSTEM_A);
    rack.cli(&["metal", "manage", &node, "--wait", "120"]);
    let machine = rack.wait_state(&node, "manageable", Duration::from_secs(120));
    assert_eq!(machine["power"], "off", "{machine}");
    rack.cli(&["metal", "inspect", &node, "--wait", "120"]);
    let machine = rack.wait_state(&node, "manageable", Duration::from_secs(120));
    assert_eq!(machine["inspection"]["manufacturer"], "Sushy Emulator", "{machine}");

    // Power, as the emulator saw it: on, a reboot (off with a restart pending, then on), off.
    for power in ["on", "reboot", "off"] {
        rack.cli(&["metal", "power", &node, power, "--wait", "120"]);
        let machine = rack.wait_state(&node, "manageable", Duration::from_secs(120));
        assert_eq!(machine["workflow"]["outcome"], "succeeded", "{power}: {machine}");
    }
    let history = power_history(&rack.notifications, SYSTEM_A);
    assert!(history.ends_with(&["On".to_owned(), "Off".to_owned(), "On".to_owned(), "Off".to_owned()]), "{history:?}");

    rack.cli(&["metal", "provide", &node, "--wait", "180"]);
    rack.wait_state(&node, "available", Duration::from_secs(180));

    // Deploy: the token goes to a new 0600 file, never to the terminal.
    let token_file = rack.dir.path().join("node.token");
    let (code, out, err) =
        rack.server.cli(&["metal", "deploy", &node, "--image", &rack.image, "--token-out", &token_file.display().to_string()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("bcjt_") && !err.contains("bcjt_"), "the join token was printed");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777, 0o600);
    let boots_before = rack.boot_devices(SYSTEM_A).iter().filter(|d| *d == "Cd").count();
    let machine = wait_until("deploy-wait", Duration::from_secs(120), || {
        let machine = rack.machine(&node);
        assert_ne!(machine["state"], "deploy-failed", "{machine}");
        (machine["state"] == "deploy-wait").then_some(machine)
    });
    let state = rack.notifications.of(SYSTEM_A).last().cloned().unwrap();
    assert_eq!(state["power_state"], "On", "booted: {state}");
    assert!(
        state["boot_image"]["Cd"][0].as_str().is_some_and(|f| f.ends_with("installer.iso")),
        "the ISO is in the virtual CD: {state}"
    );
    let boots = rack.boot_devices(SYSTEM_A).iter().filter(|d| *d == "Cd").count() - boots_before;
    assert_eq!(boots, 1, "the boot override is set once: {:?}", rack.boot_devices(SYSTEM_A));
    assert!(rack.notifications.of(SYSTEM_B).is_empty(), "the other system was left alone");
    assert_eq!(machine["workflow"]["steps"].as_array().unwrap().iter().filter(|s| s["state"] == "done").count(), 7, "{machine}");

    // The installed system joins as the machine's node with the deploy's token, and runs.
    let mut installed = rack.installed_system(&node, &token_file);
    assert!(!token_file.exists(), "the spent token file is removed");
    installed.start();
    let machine = rack.wait_state(&node, "active", Duration::from_secs(60));
    assert_eq!(machine["imageId"], rack.image.as_str());
    wait_until("the node is ready", Duration::from_secs(30), || {
        let (_, out, _) = rack.server.cli(&["nodes", "get", &node]);
        (json(&out)["state"] == "ready").then_some(())
    });
    let rsv = rack.cli(&["reserve", "--pool", &rack.pool, "--gpus", "1", "--for", "1h", "--wait", "30"]);
    assert_eq!((rsv["state"].as_str(), rsv["nodeId"].as_str()), (Some("active"), Some(node.as_str())), "{rsv}");

    // Undeploy is refused while the node holds the reservation; released, it goes through.
    let (code, _, err) = rack.server.cli(&["metal", "undeploy", &node]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains("drain"), "{err}");
    rack.cli(&["release", rsv["reservationId"].as_str().unwrap()]);
    wait_until("the node is free", Duration::from_secs(30), || {
        let (_, out, _) = rack.server.cli(&["nodes", "get", &node]);
        (json(&out)["allocations"] == serde_json::json!({})).then_some(())
    });
    rack.cli(&["metal", "undeploy", &node, "--wait", "180"]);
    let machine = rack.wait_state(&node, "available", Duration::from_secs(180));
    assert_eq!(machine["power"], "off", "{machine}");
    let state = rack.notifications.of(SYSTEM_A).last().cloned().unwrap();
    // Ejected, as sushy's fake driver records it: the CD drive is there, nothing inserted
    // (`[image, write_protected, inserted]`). A state without the drive does not pass.
    let cd = &state["boot_image"]["Cd"];
    assert!(cd[2] == false && cd[0].as_str().is_none_or(str::is_empty), "the CD is ejected: {state}");
    // Cordoned in the undeploy's append (its state may read unreachable as well: the lease of an
    // agent on a loaded machine can lapse), so it takes no reservation.
    let (_, out, _) = rack.server.cli(&["events", "list", "--types", "node.cordoned", "--format", "json"]);
    let stream = format!("node/{node}");
    assert!(
        json(&out)["items"].as_array().unwrap().iter().any(|e| e["stream"] == stream.as_str()),
        "the node is cordoned: {out}"
    );
    drop(installed);

    let (transitions, _) = rack.history(&node);
    assert_eq!(
        transitions,
        [
            "manage:enroll>verifying",
            "done:verifying>manageable",
            "inspect:manageable>inspecting",
            "done:inspecting>manageable",
            "power:manageable>manageable",
            "power:manageable>manageable",
            "power:manageable>manageable",
            "provide:manageable>cleaning",
            "done:cleaning>available",
            "deploy:available>deploying",
            "wait:deploying>deploy-wait",
            "done:deploy-wait>active",
            "undeploy:active>deleting",
            "done:deleting>cleaning",
            "done:cleaning>available",
        ]
    );
}

/// The `metal` reconciler, its own process, killed with SIGKILL in each state and step of a
/// deploy against sushy as it is first seen, and started again each time: the deploy ends
/// active, and the log shows each transition and each step once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metal_reconciler_killed_through_a_deploy_resumes_and_records_each_transition_once() {
    use bc_tests::sushy::SYSTEM_B;
    let rack = rack(&["--no-reconcilers"]).await;
    let data_dir = rack.server.data_dir.display().to_string();
    let logs = tempfile::tempdir().unwrap();
    let node = rack.enroll(SYSTEM_B);
    let mut reconciler = bc_tests::Reconciler::start(
        &["--only", "metal", "--data-dir", &data_dir, "--bmc-allow-network", "127.0.0.1/32"],
        logs.path(),
    );
    rack.cli(&["metal", "manage", &node]);
    rack.wait_state(&node, "manageable", Duration::from_secs(120));
    rack.cli(&["metal", "provide", &node]);
    rack.wait_state(&node, "available", Duration::from_secs(180));

    let token_file = rack.dir.path().join("node.token");
    rack.cli(&["metal", "deploy", &node, "--image", &rack.image, "--token-out", &token_file.display().to_string()]);
    // Killed with SIGKILL the first time each (state, step) of the deploy is seen, polled every
    // 150 ms, and started again: so in each state of the deploy, and in as many of its steps as
    // last longer than a poll.
    let mut states_killed_in = std::collections::BTreeSet::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    let mut joined = None;
    loop {
        std::thread::sleep(Duration::from_millis(150));
        let machine = rack.machine(&node);
        assert_ne!(machine["state"], "deploy-failed", "{machine}");
        if machine["state"] == "active" {
            reconciler.kill9();
            break;
        }
        let step = machine["workflow"]["steps"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["state"] == "running"))
            .map(|s| s["name"].as_str().unwrap_or_default().to_owned());
        let at = format!("{}/{}", machine["state"].as_str().unwrap(), step.unwrap_or_default());
        if machine["state"] == "deploy-wait" && joined.is_none() && states_killed_in.contains(&at) {
            // Killed once in deploy-wait already: now the installed system may join.
            let mut installed = rack.installed_system(&node, &token_file);
            installed.start();
            joined = Some(installed);
        }
        if states_killed_in.insert(at) {
            reconciler.kill9();
            reconciler.restart();
        }
        assert!(std::time::Instant::now() < deadline, "the deploy did not end: {machine}");
    }
    eprintln!("killed in: {states_killed_in:?}");
    for state in ["deploying/", "deploy-wait/"] {
        assert!(states_killed_in.iter().any(|at| at.starts_with(state)), "never killed in {state}: {states_killed_in:?}");
    }
    assert!(states_killed_in.len() >= 3, "killed in too few steps to mean much: {states_killed_in:?}");
    let (transitions, steps) = rack.history(&node);
    assert_eq!(
        transitions[4..],
        ["deploy:available>deploying", "wait:deploying>deploy-wait", "done:deploy-wait>active"],
        "each transition once: {transitions:?}"
    );
    let unique: std::collections::BTreeSet<&String> = steps.iter().collect();
    assert_eq!(unique.len(), steps.len(), "a step recorded twice: {steps:?}");
    let deploy = rack.machine(&node)["workflow"].clone();
    let deploy_steps = steps.iter().filter(|s| s.starts_with(deploy["workflowId"].as_str().unwrap())).count();
    assert_eq!(deploy_steps, deploy["steps"].as_array().unwrap().len(), "{steps:?}");
}
