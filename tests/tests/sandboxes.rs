//! Sandboxes end to end, with the real runtime: a real `better-compute dev`, a real `bcd node` on
//! a seeded fake machine (the `fakehw` build) that finds gVisor's `runsc` and advertises
//! `sandbox.gvisor`, and a root file system the test makes from Debian's `busybox-static`,
//! served over HTTP from loopback and registered as a `rootfs-tar` image.
//!
//! A template with `warmMin: 1` fills its warm pool; `sandbox create` claims the warm one;
//! `sandbox exec -- sh -c 'uname -a; echo $X; exit 3'` shows gVisor's kernel, the template's
//! environment (a secret among it, named by reference and resolved only for the node: no event
//! holds its value, and the secret cannot be deleted while the template names it), and exits 3;
//! a file written in one sandbox is in neither the host's root file
//! system nor another sandbox; a sandbox past its end is gone from the node (`runsc list`) and
//! the API; bad input (an unknown image, a TTL past the template's maximum, exec in a deleted
//! sandbox) is a clear error with nothing started; and the agent killed with SIGKILL and started
//! again still runs its sandboxes and removes the one no record names.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use bc_tests::{AgentNode, Server, json};
use serde_json::{Value, json};

use super::gvisor_kit::{busybox_catalogue, call_ok, joined_node, require_runtime, runsc_list, wait_gvisor_ready};

/// Deletes, whatever happened, every runsc container left in the node's state directory, so a
/// failed test leaks no sandbox on the machine.
struct RunscCleanup(PathBuf);

impl RunscCleanup {
    fn list(&self) -> Vec<String> {
        runsc_list(&self.0)
    }
}

impl Drop for RunscCleanup {
    fn drop(&mut self) {
        for id in self.list() {
            let _ = Command::new("runsc").arg("--root").arg(&self.0).args(["delete", "--force", &id]).status();
        }
    }
}

async fn wait_sandbox(server: &Server, id: &str, what: &str, done: impl Fn(&Value) -> bool, machine: &AgentNode) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let doc = call_ok(server, "sandboxes.get", json!({ "sandboxId": id })).await;
        if done(&doc) {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "sandbox {id}: not {what} after 60 s: {doc}\n{}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_run_in_gvisor_from_a_warm_pool_with_exec_ttl_isolation_and_a_restart() {
    require_runtime();
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("sandboxes").await;
    let mut machine = joined_node(&server, port, &pool).await;
    let cleanup = RunscCleanup(machine.data().join("sandboxes").join("runsc"));
    machine.start();
    wait_gvisor_ready(&server, &machine).await;

    let work = tempfile::tempdir().unwrap();
    let busybox =
        busybox_catalogue(&server, &pool, work.path(), &["sh", "echo", "cat", "ls", "uname", "sleep", "true", "id"]).await;
    let (image_id, flavor_id, digest) = (busybox.image_id.clone(), busybox.flavor_id.clone(), busybox.digest.clone());

    // A secret the template's environment names by reference.
    let token_value = "sbx-token-0f1e2d3c4b5a69788796a5b4c3d2e1f0";
    let token_file = work.path().join("token.secret");
    std::fs::write(&token_file, token_value).unwrap();
    let (code, out, err) = server.cli(&["secrets", "put", "sbx-token", "--value-file", token_file.to_str().unwrap()]);
    assert_eq!(code, 0, "secrets put: {err}");
    let reference = json(&out)["ref"].as_str().unwrap().to_owned();
    let token_env = format!("TOKEN={reference}");

    // Bad templates: an image that does not exist, a maximum TTL past the bound, a reference to
    // a secret that does not exist. Nothing made.
    let template_args = |image: &str, max_ttl: &str, token: &str| -> Vec<String> {
        ["sandbox-template", "create", "--name", "busybox", "--pool", &pool, "--flavor", &flavor_id, "--image", image]
            .into_iter()
            .map(str::to_owned)
            .chain(
                ["--max-ttl", max_ttl, "--warm-min", "1", "--env", "X=from-the-template", "--env", token]
                    .into_iter()
                    .map(str::to_owned),
            )
            .collect()
    };
    let missing = format!("TOKEN={}", reference.rsplit_once('/').unwrap().0.to_owned() + "/sec_01j00000000000000000000000");
    let args = template_args(&image_id, "10m", &missing);
    let (code, _, err) = server.cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("NOT_FOUND") && err.contains("sec_01j00000000000000000000000"), "{err}");
    let template_args = |image: &str, max_ttl: &str| template_args(image, max_ttl, &token_env);
    let args = template_args("img_01j00000000000000000000000", "10m");
    let (code, _, err) = server.cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("NOT_FOUND") && err.contains("image img_01j00000000000000000000000"), "{err}");
    let args = template_args(&image_id, "48h");
    let (code, _, err) = server.cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2, "INVALID_ARGUMENT exits 2: {err}");
    assert!(err.contains("INVALID_ARGUMENT") && err.contains("past the maximum of 86400 s"), "{err}");
    let (code, _, err) = server.cli(&["sandbox", "get", "inst_01j00000000000000000000000"]);
    assert_eq!(code, 2, "an id of another kind is a usage error before anything is sent: {err}");
    let listed = call_ok(&server, "sandboxTemplates.list", json!({})).await;
    assert_eq!(listed["items"].as_array().unwrap().len(), 0, "no template was made: {listed}");

    // The template; its warm pool fills.
    let args = template_args(&image_id, "10m");
    let (code, out, err) = server.cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "sandbox-template create: {err}");
    let template = json(&out)["templateId"].as_str().unwrap().to_owned();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let warm_id = loop {
        let page = call_ok(&server, "sandboxes.list", json!({ "templateId": template })).await;
        let warm = page["items"].as_array().unwrap().iter().find(|s| s["warm"] == true && s["state"] == "running").cloned();
        if let Some(warm) = warm {
            break warm["sandboxId"].as_str().unwrap().to_owned();
        }
        assert!(std::time::Instant::now() < deadline, "no warm sandbox after 60 s: {page}\n{}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(cleanup.list().contains(&warm_id), "the warm sandbox runs in runsc: {:?}", cleanup.list());
    // The reconciler's pass says what it read in the process's metrics.
    bc_tests::wait_until("/metrics counts the warm sandbox", Duration::from_secs(10), || {
        let text = bc_tests::block_on(async {
            server.http.get(format!("{}/metrics", server.url)).send().await.unwrap().text().await.unwrap()
        });
        let gauge = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned());
        (gauge("better_compute_sandboxes_warm ").as_deref() == Some("1")
            && gauge("better_compute_sandboxes_live ").as_deref() == Some("1"))
        .then_some(())
    });

    // A TTL past the template's maximum: refused, nothing claimed.
    let (code, _, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "1h"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("INVALID_ARGUMENT") && err.contains("past the maximum of 600 s"), "{err}");

    // The create claims the warm one, in a project, and says so: the claim names the project.
    let project = call_ok(&server, "projects.create", json!({ "name": "claims" })).await;
    let project_id = project["projectId"].as_str().unwrap().to_owned();
    let (code, out, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "5m", "--project", &project_id]);
    assert_eq!(code, 0, "sandbox create: {err}");
    let claimed = json(&out);
    assert_eq!(claimed["claimed"], "warm", "{claimed}");
    assert_eq!(claimed["sandboxId"], warm_id.as_str(), "{claimed}");
    assert_eq!(claimed["projectId"], project_id.as_str(), "{claimed}");
    let listed = call_ok(&server, "sandboxes.list", json!({ "projectId": project_id })).await;
    let ids: Vec<&str> = listed["items"].as_array().unwrap().iter().map(|s| s["sandboxId"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![warm_id.as_str()], "only the claimed one is in the project (the refill is in none): {listed}");
    assert_eq!((claimed["state"].as_str(), claimed["warm"].as_bool()), (Some("running"), Some(false)), "{claimed}");
    let a = warm_id;

    // Exec: gVisor's kernel, the template's environment, the command's status.
    let (code, out, err) = server.cli(&[
        "sandbox",
        "exec",
        &a,
        "--",
        "sh",
        "-c",
        "uname -a; echo X=$X; echo TOKEN=$TOKEN; echo written > /f; exit 3",
    ]);
    assert_eq!(code, 3, "the command's own status: {out} {err}\n{}", machine.node_log());
    assert!(out.contains("Linux sandbox 4.4.0"), "gVisor's kernel (Linux 4.4.0 as the sentry reports it): {out}");
    assert!(out.contains("X=from-the-template"), "the template's env: {out}");
    assert!(out.contains(&format!("TOKEN={token_value}")), "the secret's value, resolved for the node: {out}");

    // The value reached the sandbox and nothing else: the log holds the reference and a
    // resolution naming the sandbox, never the value; the secret cannot go while the template
    // names it.
    let mut events = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut body = json!({ "limit": 500 });
        if let Some(c) = &cursor {
            body["cursor"] = json!(c);
        }
        let page = call_ok(&server, "events.list", body).await;
        events.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["nextCursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    let text = serde_json::to_string(&events).unwrap();
    assert!(!text.contains(token_value), "no event holds the secret's value");
    assert!(
        events.iter().any(|e| e["type"] == "secret.resolved" && e["payload"]["referrer"] == format!("sandbox/{a}").as_str()),
        "the resolution for the sandbox is in the log"
    );
    let (code, _, err) = server.cli(&["secrets", "delete", "sbx-token"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains(&format!("sandbox_template/{template}")), "{err}");
    let (code, out, err) = server.cli(&["sandbox", "exec", &a, "--", "cat", "/f"]);
    assert_eq!((code, out.trim()), (0, "written"), "the sandbox keeps what it wrote: {err}");

    // Another sandbox (cold or warm: the pool refills) does not see it, nor does the host.
    let (code, out, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "5m"]);
    assert_eq!(code, 0, "second sandbox: {err}\n{}", machine.node_log());
    let second = json(&out);
    let b = second["sandboxId"].as_str().unwrap().to_owned();
    assert_eq!(second["state"], "running", "--wait follows it until it runs: {second}");
    let (code, out, err) = server.cli(&["sandbox", "exec", &b, "--", "cat", "/f"]);
    assert_eq!(code, 1, "another sandbox does not see /f: {out} {err}");
    let rootfs = machine.data().join("sandboxes").join("rootfs").join(&digest);
    assert!(rootfs.join("bin/busybox").exists(), "the root file system is unpacked once, by digest");
    assert!(!rootfs.join("f").exists(), "nothing a sandbox writes reaches the host's files");

    // A short life: gone from the node and the API at its end.
    let created = call_ok(&server, "sandboxes.create", json!({ "templateId": template, "ttlS": 5 })).await;
    let c = created["sandboxId"].as_str().unwrap().to_owned();
    wait_sandbox(&server, &c, "running", |s| s["state"] == "running", &machine).await;
    assert!(cleanup.list().contains(&c));
    let gone = wait_sandbox(&server, &c, "deleted", |s| s["state"] == "deleted", &machine).await;
    assert_eq!(gone["lastError"], "ttl-expired", "{gone}");
    assert!(!cleanup.list().contains(&c), "no longer on the node: {:?}", cleanup.list());
    let live = call_ok(&server, "sandboxes.list", json!({})).await;
    assert!(!live["items"].as_array().unwrap().iter().any(|s| s["sandboxId"] == c.as_str()), "not live in the API: {live}");
    let events = call_ok(&server, "events.list", json!({ "stream": format!("sandbox/{c}") })).await;
    let types: Vec<&str> = events["items"].as_array().unwrap().iter().filter_map(|e| e["type"].as_str()).collect();
    // Its life in the log: made (warm or cold; a warm one then claimed), observed running,
    // deleted at its end, observed gone.
    assert_eq!(types.first(), Some(&"sandbox.created"), "{events}");
    assert!(types.contains(&"sandbox.delete_requested"), "{events}");
    assert_eq!(types.last(), Some(&"sandbox.observed"), "{events}");

    // Extend within the maximum, and not past it.
    let (code, _, err) = server.cli(&["sandbox", "extend", &b, "--by", "1m"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = server.cli(&["sandbox", "extend", &b, "--by", "1h"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("maxTtlS"), "{err}");

    // The agent killed and started again: its sandboxes are found again, and one no record
    // names (started behind its back in its own state directory) is removed.
    machine.kill9();
    let bundle = machine.data().join("sandboxes").join("bundles").join(&b);
    let stray = "sbx_01j0000000000000000000stray".to_lowercase();
    let status = Command::new("runsc")
        .arg("--root")
        .arg(&cleanup.0)
        .args(["--platform=ptrace", "--network=none", "--overlay", "run", "--detach", "--bundle"])
        .arg(&bundle)
        .arg(&stray)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "a stray container");
    assert!(cleanup.list().contains(&stray));
    machine.start();
    bc_tests::wait_until("the stray sandbox is swept", Duration::from_secs(30), || {
        (!cleanup.list().contains(&stray)).then_some(())
    });
    let on_node = cleanup.list();
    assert!(on_node.contains(&a) && on_node.contains(&b), "the recorded sandboxes survive the agent: {on_node:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, out, _) = server.cli(&["sandbox", "exec", &b, "--", "echo", "still-here"]);
        if code == 0 {
            assert_eq!(out.trim(), "still-here");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "exec after the restart: {out}\n{}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Deleted: gone from the node; exec in it is a clear error.
    let (code, _, err) = server.cli(&["sandbox", "delete", &a]);
    assert_eq!(code, 0, "{err}");
    wait_sandbox(&server, &a, "deleted", |s| s["state"] == "deleted", &machine).await;
    assert!(!cleanup.list().contains(&a));
    let (code, _, err) = server.cli(&["sandbox", "exec", &a, "--", "true"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("INVALID_STATE") && err.contains(&format!("sandbox {a} is deleted")), "{err}");
    let (code, _, err) = server.cli(&["sandbox", "delete", &a]);
    assert_eq!(code, 1, "a deleted sandbox takes no delete: {err}");

    // The template changed in place: a new environment replaces the warm sandbox made with the
    // old one (`template-updated`), a new sandbox runs with it, and the claimed ones keep theirs;
    // `warmMin` lowered to 0, the warm one left goes (`warm-excess`).
    let warm_of = |page: &Value| -> Vec<Value> {
        page["items"].as_array().unwrap().iter().filter(|s| s["warm"] == true && s["state"] == "running").cloned().collect()
    };
    let old_warm = warm_of(&call_ok(&server, "sandboxes.list", json!({ "templateId": template })).await);
    let (code, out, err) = server.cli(&["sandbox-template", "update", &template, "--env", "X=changed"]);
    assert_eq!(code, 0, "sandbox-template update: {err}");
    assert_eq!(json(&out)["env"], json!({ "X": "changed" }), "{out}");
    for w in &old_warm {
        let id = w["sandboxId"].as_str().unwrap();
        let gone = wait_sandbox(&server, id, "deleted", |s| s["state"] == "deleted", &machine).await;
        assert_eq!(gone["lastError"], "template-updated", "{gone}");
    }
    let (code, out, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "5m"]);
    assert_eq!(code, 0, "a sandbox after the change: {err}\n{}", machine.node_log());
    let d = json(&out)["sandboxId"].as_str().unwrap().to_owned();
    let (code, out, err) = server.cli(&["sandbox", "exec", &d, "--", "sh", "-c", "echo X=$X"]);
    assert_eq!((code, out.trim()), (0, "X=changed"), "the new environment: {err}");
    let (code, out, err) = server.cli(&["sandbox", "exec", &b, "--", "sh", "-c", "echo X=$X"]);
    assert_eq!((code, out.trim()), (0, "X=from-the-template"), "a claimed sandbox keeps its own: {err}");
    let (code, _, err) = server.cli(&["sandbox-template", "update", &template, "--max-ttl", "30s"]);
    assert_eq!(code, 2, "a maximum below the default ttl: {err}");
    assert!(err.contains("INVALID_ARGUMENT") && err.contains("defaultTtlS"), "{err}");
    let (code, _, err) = server.cli(&["sandbox-template", "update", &template, "--warm-min", "0"]);
    assert_eq!(code, 0, "{err}");
    bc_tests::wait_until("no warm sandbox is left", Duration::from_secs(30), || {
        let page = bc_tests::block_on(call_ok(&server, "sandboxes.list", json!({ "templateId": template })));
        let warm = page["items"].as_array().unwrap().iter().any(|s| s["warm"] == true);
        (!warm).then_some(())
    });
    let (code, _, err) = server.cli(&["sandbox", "delete", &d]);
    assert_eq!(code, 0, "{err}");

    // The template deleted: its warm sandboxes go; what the API holds is what runsc runs.
    let (code, _, err) = server.cli(&["sandbox-template", "delete", &template]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = server.cli(&["sandbox", "delete", &b]);
    assert_eq!(code, 0, "{err}");
    bc_tests::wait_until("the node runs nothing the API does not", Duration::from_secs(30), || {
        cleanup.list().is_empty().then_some(())
    });
    drop(cleanup);
}
