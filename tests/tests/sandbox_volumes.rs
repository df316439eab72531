//! Sandbox volumes end to end, with the real runtime and real disks: a real `better-compute
//! dev`, a real `bcd node` on a fake machine (`fakehw`) that finds gVisor's `runsc`, and a root
//! file system made from Debian's `busybox-static` (as `sandboxes.rs`).
//!
//! A 1 GiB volume is made on the node (a sparse file, ext4, loop-mounted); a template mounts it
//! at `/data`; a file written there in one sandbox is read by a second sandbox once the first is
//! deleted; while the first is live the volume takes neither a second sandbox, a resize nor a
//! delete; filled, the writer gets ENOSPC and the node carries on; grown to 2 GiB, `df` in the
//! sandbox shows it; deleted, its file is gone from the node. A create or a resize past the size
//! of the node's volumes' file system (its inventory's `volumeFileSystemBytes`) is
//! `QUOTA_EXCEEDED`. Bad input (a size of 0 or past
//! 16384, an id that is not `vol_…`, a template with volumes and a warm pool) is a clear error.
//!
//! A node that runs gVisor but cannot make volumes (its `bcd` finds no `mkfs.ext4`) advertises
//! no `sandbox-volume.ext4`, and a volume of its pool is refused `UNSUPPORTED`
//! (`daemon-capability`) with nothing made.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use bc_tests::{AgentNode, Server, json};
use serde_json::{Value, json};

use super::gvisor_kit::{busybox_catalogue, call_ok, joined_node, require_runtime, runsc_list, wait_gvisor_ready};

/// Whatever happened: deletes the runsc containers left in the node's state directory and
/// unmounts the volumes left mounted under its data directory, so a failed test leaks neither.
struct Cleanup {
    runsc_root: PathBuf,
    volumes: PathBuf,
}

impl Cleanup {
    fn containers(&self) -> Vec<String> {
        runsc_list(&self.runsc_root)
    }

    fn mounts(&self) -> Vec<String> {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let prefix = self.volumes.to_string_lossy().into_owned();
        info.lines().filter_map(|l| l.split(' ').nth(4)).filter(|p| p.starts_with(&prefix)).map(str::to_owned).collect()
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for id in self.containers() {
            let _ = Command::new("runsc").arg("--root").arg(&self.runsc_root).args(["delete", "--force", &id]).status();
        }
        for mount in self.mounts() {
            let _ = Command::new("umount").arg(&mount).status();
        }
    }
}

async fn wait_for(
    server: &Server,
    method: &str,
    body: Value,
    what: &str,
    done: impl Fn(&Value) -> bool,
    machine: &AgentNode,
) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let doc = call_ok(server, method, body.clone()).await;
        if done(&doc) {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "{what}: not after 60 s: {doc}\n{}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The size of the file system at `/data` in a sandbox, in KiB, as its `df` says.
fn df_kib(server: &Server, sandbox: &str) -> u64 {
    let (code, out, err) = server.cli(&["sandbox", "exec", sandbox, "--", "df", "-k", "/data"]);
    assert_eq!(code, 0, "df: {out} {err}");
    let line = out.lines().nth(1).unwrap_or_default();
    line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("df's answer: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_outlives_its_sandbox_grows_fills_and_mounts_in_one_sandbox_at_a_time() {
    require_runtime();
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("volumes").await;
    let mut machine = joined_node(&server, port, &pool).await;
    let node = machine.node_id();
    let cleanup = Cleanup { runsc_root: machine.data().join("sandboxes").join("runsc"), volumes: machine.data().join("volumes") };
    machine.start();
    wait_gvisor_ready(&server, &machine).await;

    // Bad input, each a clear error before anything is made.
    let (code, _, err) = server.cli(&["sandbox-volume", "create", "--pool", &pool, "--name", "notes", "--size", "0"]);
    assert_eq!(code, 2, "a size of 0 is a usage error: {err}");
    let (status, doc) = server.call("sandboxVolumes.create", json!({ "poolId": pool, "name": "notes", "sizeGiB": 0 })).await;
    assert_eq!((status, doc["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{doc}");
    let (status, doc) = server.call("sandboxVolumes.create", json!({ "poolId": pool, "name": "notes", "sizeGiB": 16385 })).await;
    assert_eq!((status, doc["code"].as_str()), (400, Some("INVALID_ARGUMENT")), "{doc}");
    let (code, _, err) = server.cli(&["sandbox-volume", "get", "sbx_01j00000000000000000000000"]);
    assert_eq!(code, 2, "an id of another kind is a usage error before anything is sent: {err}");
    let (code, _, err) = server.cli(&["sandbox-volume", "resize", "not-a-volume", "--size", "2"]);
    assert_eq!(code, 2, "{err}");
    // The node reports its volumes' file system; a volume larger than it is refused (sparse
    // files would promise bytes the disk does not have).
    let doc = call_ok(&server, "nodes.get", json!({ "nodeId": node })).await;
    let fs_bytes = doc["agent"]["inventory"]["volumeFileSystemBytes"].as_u64().unwrap_or_else(|| panic!("{doc}"));
    let past_gib = fs_bytes / (1 << 30) + 1;
    assert!(past_gib <= 16384, "the test's disk is under 16 TiB");
    let (status, doc) =
        server.call("sandboxVolumes.create", json!({ "poolId": pool, "name": "notes", "sizeGiB": past_gib })).await;
    assert_eq!((status, doc["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "{doc}");
    let listed = call_ok(&server, "sandboxVolumes.list", json!({ "scope": "all", "deleted": true })).await;
    assert_eq!(listed["items"], json!([]), "nothing was made: {listed}");

    // The volume: made on the node, a 1 GiB sparse file holding ext4, mounted.
    let (code, out, err) = server.cli(&["sandbox-volume", "create", "--pool", &pool, "--name", "notes", "--size", "1"]);
    assert_eq!(code, 0, "sandbox-volume create: {err}");
    let created = json(&out);
    let volume = created["volumeId"].as_str().unwrap().to_owned();
    assert_eq!((created["nodeId"].as_str(), created["sizeGiB"].as_u64()), (Some(node.as_str()), Some(1)), "{created}");
    let ready = wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume ready",
        |v| v["state"] != "creating",
        &machine,
    )
    .await;
    assert_eq!(ready["state"], "ready", "{ready}\n{}", machine.node_log());
    let image = machine.data().join("volumes").join(format!("{volume}.img"));
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 1 << 30, "a 1 GiB disk image");
    let (code, out, _) = server.cli(&["sandbox-volume", "list"]);
    assert_eq!(code, 0);
    assert!(out.contains(&volume) && out.contains("SIZE-GIB"), "a table of the caller's volumes: {out}");
    let (code, _, err) = server.cli(&["sandbox-volume", "create", "--pool", &pool, "--name", "notes", "--size", "1"]);
    assert_eq!(code, 1, "a name is taken once: {err}");
    assert!(err.contains("ALREADY_EXISTS"), "{err}");

    // A template that mounts it: never with a warm pool.
    let work = tempfile::tempdir().unwrap();
    let applets = ["sh", "echo", "cat", "ls", "sleep", "true", "df", "dd", "rm", "sync"];
    let busybox = busybox_catalogue(&server, &pool, work.path(), &applets).await;
    let (image_id, flavor_id) = (busybox.image_id.clone(), busybox.flavor_id.clone());
    let template_args = |warm: &str, volumes: &str| -> Vec<String> {
        let args = ["sandbox-template", "create", "--name", "notes-user", "--pool", &pool, "--flavor", &flavor_id];
        args.iter()
            .map(|s| s.to_string())
            .chain(
                ["--image", &image_id, "--max-ttl", "10m", "--warm-min", warm, "--volumes", volumes]
                    .iter()
                    .map(|s| s.to_string()),
            )
            .collect()
    };
    let run = |args: Vec<String>| server.cli(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let (code, _, err) = run(template_args("1", "notes:/data"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("keeps no warm pool"), "{err}");
    let (code, _, err) = run(template_args("0", "notes:data"));
    assert_eq!(code, 2, "a relative path is a usage error: {err}");
    let (code, _, err) = run(template_args("0", "missing:/data"));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("NOT_FOUND"), "{err}");
    let (code, out, err) = run(template_args("0", "notes:/data"));
    assert_eq!(code, 0, "sandbox-template create: {err}");
    let template = json(&out);
    assert_eq!(template["volumes"], json!([{ "volumeId": volume, "path": "/data" }]), "{template}");
    let template = template["templateId"].as_str().unwrap().to_owned();

    // The first sandbox writes a file; while it lives, the volume is its alone.
    let (code, out, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "5m"]);
    assert_eq!(code, 0, "sandbox create: {err}\n{}", machine.node_log());
    let a = json(&out);
    assert_eq!((a["state"].as_str(), a["nodeId"].as_str()), (Some("running"), Some(node.as_str())), "{a}");
    let a = a["sandboxId"].as_str().unwrap().to_owned();
    let (code, out, err) = server.cli(&["sandbox", "exec", &a, "--", "sh", "-c", "echo kept > /data/notes.txt && sync"]);
    assert_eq!(code, 0, "write: {out} {err}");
    let before = df_kib(&server, &a);
    assert!((900_000..1_100_000).contains(&before), "a 1 GiB file system: {before} KiB");
    let attached = call_ok(&server, "sandboxVolumes.get", json!({ "volumeId": volume })).await;
    assert_eq!(attached["attachment"]["sandboxId"], a.as_str(), "{attached}");

    let (code, _, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "5m"]);
    assert_eq!(code, 1, "a second sandbox while the volume is mounted: {err}");
    assert!(err.contains("INVALID_STATE") && err.contains(&format!("attached to sandbox {a}")), "{err}");
    let (code, _, err) = server.cli(&["sandbox-volume", "delete", &volume]);
    assert_eq!(code, 1, "a mounted volume is not deleted: {err}");
    assert!(err.contains("INVALID_STATE") && err.contains("attached"), "{err}");
    let (code, _, err) = server.cli(&["sandbox-volume", "resize", &volume, "--size", "2"]);
    assert_eq!(code, 1, "nor grown: {err}");

    // Full: the writer gets ENOSPC; the node carries on.
    let (code, out, err) =
        server.cli(&["sandbox", "exec", &a, "--", "dd", "if=/dev/zero", "of=/data/fill", "bs=4M", "count=1024"]);
    assert_ne!(code, 0, "dd fills the volume and fails: {out}");
    assert!(err.contains("No space left on device"), "ENOSPC: {err}");
    let (code, out, err) = server.cli(&["sandbox", "exec", &a, "--", "rm", "/data/fill"]);
    assert_eq!(code, 0, "{out} {err}");
    let (code, out, _) = server.cli(&["sandbox", "exec", &a, "--", "echo", "still-fine"]);
    assert_eq!((code, out.trim()), (0, "still-fine"));
    let node_doc = call_ok(&server, "nodes.get", json!({ "nodeId": node })).await;
    assert_eq!(node_doc["state"], "ready", "{node_doc}");

    // The sandbox deleted: the volume stays on the node, detached.
    let (code, _, err) = server.cli(&["sandbox", "delete", &a]);
    assert_eq!(code, 0, "{err}");
    wait_for(&server, "sandboxes.get", json!({ "sandboxId": a }), "sandbox deleted", |s| s["state"] == "deleted", &machine).await;
    wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume detached",
        |v| v["attachment"].is_null(),
        &machine,
    )
    .await;
    assert!(image.exists(), "the volume outlives its sandbox");

    // Grown to 2 GiB: the file and the file system.
    let (code, _, err) = server.cli(&["sandbox-volume", "resize", &volume, "--size", "1"]);
    assert_eq!(code, 2, "volumes only grow: {err}");
    assert!(err.contains("only grows"), "{err}");
    let (status, doc) = server.call("sandboxVolumes.resize", json!({ "volumeId": volume, "sizeGiB": past_gib })).await;
    assert_eq!((status, doc["code"].as_str()), (403, Some("QUOTA_EXCEEDED")), "past the node's file system: {doc}");
    let (code, out, err) = server.cli(&["sandbox-volume", "resize", &volume, "--size", "2"]);
    assert_eq!(code, 0, "resize: {err}");
    assert_eq!(json(&out)["state"], "resizing", "{out}");
    let grown = wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume grown",
        |v| v["state"] != "resizing",
        &machine,
    )
    .await;
    assert_eq!((grown["state"].as_str(), grown["sizeGiB"].as_u64()), (Some("ready"), Some(2)), "{grown}\n{}", machine.node_log());
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 2 << 30);

    // A second sandbox mounts it: the file is there, the file system is larger.
    let (code, out, err) = server.cli(&["sandbox", "create", "--template", &template, "--ttl", "5m"]);
    assert_eq!(code, 0, "second sandbox: {err}\n{}", machine.node_log());
    let b = json(&out)["sandboxId"].as_str().unwrap().to_owned();
    let (code, out, err) = server.cli(&["sandbox", "exec", &b, "--", "cat", "/data/notes.txt"]);
    assert_eq!((code, out.trim()), (0, "kept"), "what the first sandbox wrote: {err}");
    let after = df_kib(&server, &b);
    assert!(after > before + 900_000, "df shows the file system grew: {before} KiB, then {after} KiB");

    // Its life in the log.
    let events = call_ok(&server, "events.list", json!({ "stream": format!("sandbox_volume/{volume}") })).await;
    let types: Vec<&str> = events["items"].as_array().unwrap().iter().filter_map(|e| e["type"].as_str()).collect();
    for t in [
        "sandbox_volume.created",
        "sandbox_volume.observed",
        "sandbox_volume.attached",
        "sandbox_volume.detached",
        "sandbox_volume.resize_requested",
    ] {
        assert!(types.contains(&t), "{t} in {types:?}");
    }

    // Deleted once no sandbox mounts it: its data is gone from the node.
    let (code, _, err) = server.cli(&["sandbox", "delete", &b]);
    assert_eq!(code, 0, "{err}");
    wait_for(&server, "sandboxes.get", json!({ "sandboxId": b }), "sandbox deleted", |s| s["state"] == "deleted", &machine).await;
    wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume detached",
        |v| v["attachment"].is_null(),
        &machine,
    )
    .await;
    let (code, _, err) = server.cli(&["sandbox-volume", "delete", &volume]);
    assert_eq!(code, 0, "{err}");
    let gone = wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume deleted",
        |v| v["state"] == "deleted",
        &machine,
    )
    .await;
    assert!(gone["lastError"].is_null(), "{gone}");
    assert!(!image.exists(), "the disk image is removed");
    assert!(cleanup.mounts().is_empty(), "nothing left mounted: {:?}", cleanup.mounts());
    let listed = call_ok(&server, "sandboxVolumes.list", json!({})).await;
    assert_eq!(listed["items"], json!([]), "{listed}");
    drop(cleanup);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_placed_only_on_a_node_that_can_make_volumes() {
    require_runtime();
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("no-volumes").await;
    let mut machine = joined_node(&server, port, &pool).await;
    let _cleanup =
        Cleanup { runsc_root: machine.data().join("sandboxes").join("runsc"), volumes: machine.data().join("volumes") };
    // runsc is in /usr/bin, mkfs.ext4 only in /usr/sbin: this bcd runs sandboxes but makes no volumes.
    assert!(!std::path::Path::new("/usr/bin/mkfs.ext4").exists(), "the test needs mkfs.ext4 outside /usr/bin");
    machine.start_with_env(&[("PATH", "/usr/local/bin:/usr/bin")]);
    wait_gvisor_ready(&server, &machine).await;
    let doc = call_ok(&server, "nodes.get", json!({ "nodeId": machine.node_id() })).await;
    let caps = doc["agent"]["inventory"]["capabilities"].as_array().cloned().unwrap_or_default();
    assert!(!caps.iter().any(|c| c == "sandbox-volume.ext4"), "no volumes advertised without mkfs.ext4: {doc}");
    assert!(machine.node_log().contains("this node makes no sandbox volumes"), "{}", machine.node_log());

    let (status, doc) = server.call("sandboxVolumes.create", json!({ "poolId": pool, "name": "notes", "sizeGiB": 1 })).await;
    assert_eq!((status, doc["code"].as_str()), (501, Some("UNSUPPORTED")), "{doc}");
    assert_eq!(doc["details"]["reason"], "daemon-capability", "{doc}");
    assert!(doc["message"].as_str().unwrap_or_default().contains("sandbox-volume.ext4"), "names the capability: {doc}");
    let (code, _, err) = server.cli(&["sandbox-volume", "create", "--pool", &pool, "--name", "notes", "--size", "1"]);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("UNSUPPORTED") && err.contains("sandbox-volume.ext4"), "{err}");
    let listed = call_ok(&server, "sandboxVolumes.list", json!({ "scope": "all", "deleted": true })).await;
    assert_eq!(listed["items"], json!([]), "nothing was made: {listed}");
    assert!(!machine.data().join("volumes").exists(), "nothing on the node either");
}

/// Whether process `pid` is gone or a zombie (killed, not yet reaped).
fn dead(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |stat| stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()) == Some("Z"))
}

/// The node's volume ledger entry for `volume`.
fn ledger_entry(machine: &AgentNode, volume: &str) -> Value {
    let ledger: Value = serde_json::from_str(&std::fs::read_to_string(machine.data().join("volumes.json")).unwrap()).unwrap();
    ledger["volumes"][volume].clone()
}

/// The size in KiB of the file system mounted at `mount` on the node, as `df` says.
fn host_df_kib(mount: &std::path::Path) -> u64 {
    let out = Command::new("df").arg("-k").arg(mount).output().unwrap();
    let out = String::from_utf8_lossy(&out.stdout).into_owned();
    out.lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("df: {out}"))
}

/// Waits until `bcd` has killed itself (the fakehw switch `fake_volume_crash`), then reaps it.
async fn wait_crashed(machine: &mut AgentNode) {
    let pid = bc_tests::pid_of(machine);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !dead(&pid) {
        assert!(std::time::Instant::now() < deadline, "bcd did not crash: {}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    machine.kill9();
}

/// `bcd` killed (SIGKILL, by the fakehw switch `[hardware] fake_volume_crash`) right after its
/// ledger records a volume `creating`, before `mkfs.ext4`: the next start makes the file system
/// (the ledger's recovery, not the redelivered command, which finds it ready), and the volume is
/// a mounted 1 GiB ext4. Then killed after recording a growth to 2 GiB, before `resize2fs`: the
/// next start grows it, and the file and the file system are 2 GiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_a_volume_s_record_and_its_disk_work_is_repaired_at_start() {
    require_runtime();
    let (server, port) = bc_tests::agents_gateway();
    let pool = server.pool("volume-crash").await;
    let mut machine = joined_node(&server, port, &pool).await;
    let _cleanup =
        Cleanup { runsc_root: machine.data().join("sandboxes").join("runsc"), volumes: machine.data().join("volumes") };
    let config = std::fs::read_to_string(machine.config()).unwrap();
    assert!(config.trim_end().ends_with("fake_seed = 1"), "the [hardware] table is last: {config}");
    std::fs::write(machine.config(), format!("{config}fake_volume_crash = \"create\"\n")).unwrap();
    machine.start();
    wait_gvisor_ready(&server, &machine).await;

    let created = call_ok(&server, "sandboxVolumes.create", json!({ "poolId": pool, "name": "crashy", "sizeGiB": 1 })).await;
    let volume = created["volumeId"].as_str().unwrap().to_owned();
    wait_crashed(&mut machine).await;
    let image = machine.data().join("volumes").join(format!("{volume}.img"));
    let mount = machine.data().join("volumes").join("mnt").join(&volume);
    assert_eq!(ledger_entry(&machine, &volume)["desired"], "creating", "the crash came after the record");
    assert!(!image.exists(), "and before the disk work");
    let doc = call_ok(&server, "sandboxVolumes.get", json!({ "volumeId": volume })).await;
    assert_eq!(doc["state"], "creating", "{doc}");

    // Restarted, crashing next after a growth's record instead.
    std::fs::write(machine.config(), format!("{config}fake_volume_crash = \"grow\"\n")).unwrap();
    machine.start();
    let ready = wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume ready",
        |v| v["state"] != "creating",
        &machine,
    )
    .await;
    assert_eq!((ready["state"].as_str(), ready["sizeGiB"].as_u64()), (Some("ready"), Some(1)), "{ready}\n{}", machine.node_log());
    assert!(machine.node_log().contains("a volume a crash left half made was made again"), "{}", machine.node_log());
    assert_eq!(ledger_entry(&machine, &volume)["desired"], "ready");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 1 << 30);
    let kib = host_df_kib(&mount);
    assert!((900_000..1_100_000).contains(&kib), "a mounted 1 GiB file system: {kib} KiB");

    let (status, doc) = server.call("sandboxVolumes.resize", json!({ "volumeId": volume, "sizeGiB": 2 })).await;
    assert_eq!(status, 200, "{doc}");
    wait_crashed(&mut machine).await;
    let entry = ledger_entry(&machine, &volume);
    assert_eq!(
        (entry["desired"].as_str(), entry["sizeGiB"].as_u64(), entry["fromGiB"].as_u64()),
        (Some("growing"), Some(2), Some(1))
    );
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 1 << 30, "the crash came before the disk work");

    std::fs::write(machine.config(), &config).unwrap();
    machine.start();
    let grown = wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume grown",
        |v| v["state"] != "resizing",
        &machine,
    )
    .await;
    assert_eq!((grown["state"].as_str(), grown["sizeGiB"].as_u64()), (Some("ready"), Some(2)), "{grown}\n{}", machine.node_log());
    assert!(machine.node_log().contains("a volume a crash left half grown was grown again"), "{}", machine.node_log());
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 2 << 30);
    let kib = host_df_kib(&mount);
    assert!(kib > 1_900_000, "the file system grew: {kib} KiB");

    let (code, _, err) = server.cli(&["sandbox-volume", "delete", &volume]);
    assert_eq!(code, 0, "{err}");
    wait_for(
        &server,
        "sandboxVolumes.get",
        json!({ "volumeId": volume }),
        "volume deleted",
        |v| v["state"] == "deleted",
        &machine,
    )
    .await;
    assert!(!image.exists());
}
