//! What the gVisor end-to-end tests (`sandboxes`, `sandbox_volumes`) share: the check that the
//! runtime and its tools are installed, a busybox root file system registered as a `rootfs-tar`
//! image beside a small flavor, a fakehw node joined to a pool that comes up ready with
//! `sandbox.gvisor`, `runsc list` of a node's state directory, and calls that must answer 200.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use bc_tests::{AgentNode, ImageServer, Server};
use serde_json::{Value, json};
use sha2::Digest;

/// The runtime and the tools the tests' sandboxes and volumes need: `make test` installs them
/// (`make system-deps`). Missing, the test fails; it never skips.
pub fn require_runtime() {
    let runsc = Command::new("runsc").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(runsc, "runsc (gVisor) is not installed: `make test` installs it (Debian's package runsc, make system-deps)");
    assert!(
        Path::new("/bin/busybox").exists(),
        "/bin/busybox is not installed: `make test` installs it (Debian's package busybox-static, make system-deps)"
    );
    let mkfs = Command::new("mkfs.ext4").arg("-V").output().is_ok_and(|o| o.status.success());
    assert!(mkfs, "mkfs.ext4 is not installed (Debian's package e2fsprogs)");
}

/// A root file system as a tar archive: busybox and `applets` as links to it.
pub fn busybox_rootfs(dir: &Path, applets: &[&str]) -> Vec<u8> {
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for applet in applets {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    let archive = dir.join("rootfs.tar");
    let status = Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&archive).arg(".").status().unwrap();
    assert!(status.success(), "tar");
    std::fs::read(archive).unwrap()
}

pub async fn call_ok(server: &Server, method: &str, body: Value) -> Value {
    let (status, doc) = server.call(method, body).await;
    assert_eq!(status, 200, "{method}: {doc}");
    doc
}

/// A fakehw node (seed 1) joined to `pool`, not yet started: the caller sets up what must
/// clean up after it, then starts it and waits with [`wait_gvisor_ready`].
pub async fn joined_node(server: &Server, port: u16, pool: &str) -> AgentNode {
    let machine = AgentNode::new(server, port);
    let config = std::fs::read_to_string(machine.config()).unwrap();
    std::fs::write(machine.config(), format!("{config}\n[hardware]\nfake_seed = 1\n")).unwrap();
    machine.join_pool(server, pool).await;
    machine
}

/// Waits until the started `machine` is ready and advertises `sandbox.gvisor`.
pub async fn wait_gvisor_ready(server: &Server, machine: &AgentNode) {
    let node = machine.node_id();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let doc = call_ok(server, "nodes.get", json!({ "nodeId": node })).await;
        let caps = doc["agent"]["inventory"]["capabilities"].as_array().cloned().unwrap_or_default();
        if doc["state"] == "ready" && caps.iter().any(|c| c == "sandbox.gvisor") {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "node not ready with sandbox.gvisor: {doc}\n{}", machine.node_log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The busybox image (`rootfs-tar`, served from loopback by `images`) and a flavor of one vCPU
/// and 256 MiB in `pool`.
pub struct Busybox {
    pub image_id: String,
    pub flavor_id: String,
    /// The archive's SHA-256: the node unpacks it once, under this name.
    pub digest: String,
    /// Serves the archive for as long as this lives: a node fetches it when it first needs it.
    pub _served: ImageServer,
}

pub async fn busybox_catalogue(server: &Server, pool: &str, dir: &Path, applets: &[&str]) -> Busybox {
    let bytes = busybox_rootfs(dir, applets);
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let size = bytes.len();
    let images = ImageServer::start("busybox.tar", bytes);
    let image = call_ok(
        server,
        "images.register",
        json!({ "name": "busybox", "url": images.url, "sha256": digest, "diskFormat": "rootfs-tar", "sizeBytes": size }),
    )
    .await;
    let flavor = call_ok(
        server,
        "flavors.create",
        json!({ "poolId": pool, "name": "sbx-small", "vcpus": 1, "memoryMiB": 256, "diskGiB": 1, "gpus": 0 }),
    )
    .await;
    Busybox {
        image_id: image["imageId"].as_str().unwrap().to_owned(),
        flavor_id: flavor["flavorId"].as_str().unwrap().to_owned(),
        digest,
        _served: images,
    }
}

/// The ids of the runsc containers in the state directory `root`.
pub fn runsc_list(root: &Path) -> Vec<String> {
    if !root.exists() {
        return Vec::new();
    }
    let out = Command::new("runsc").arg("--root").arg(root).args(["list", "--format", "json"]).output().unwrap();
    let listed: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap_or(Value::Null);
    listed.as_array().map(|a| a.iter().filter_map(|c| c["id"].as_str().map(str::to_owned)).collect()).unwrap_or_default()
}
