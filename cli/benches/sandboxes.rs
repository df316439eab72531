//! `make bench` (sandboxes): the time from `sandboxes.create` to a command's first output in the
//! sandbox, with the release `better-compute dev` and the release `bcd` of a `fakehw` build
//! (which `make bench` builds first) as child processes on loopback, the node running gVisor
//! (`runsc`, Debian's package, `--platform=ptrace`) with a root file system from Debian's
//! `busybox-static`.
//! - The floors, measured in the same run: `runsc do /bin/true` (a gVisor sandbox made, run and
//!   gone, with no control plane), and `runsc exec` of `echo ready` into a sandbox `runsc run`
//!   started (the exec alone, to its end), `FLOOR_RUNS` times each.
//! - Cold: a template with no warm pool; `sandboxes.create`, then `sandboxes.get` every
//!   `POLL_MS` until it is `running`, then `better-compute sandbox exec SBX -- echo ready`
//!   until its first byte of output; `SAMPLES` times (each sandbox deleted before the next,
//!   and the warm pool refilled, untimed: a node runs its commands one at a time).
//! - Warm: a template with `warmMin: WARM_MIN`; each sample waits (untimed) until the pool is
//!   full, then `sandboxes.create` (a claim) and the same exec. Each sample's exec is also timed
//!   on its own (the CLI started, the tunnel opened, the command run, its end), against the
//!   exec floor.
//! - Snapshots: a running cold sandbox snapshotted (`sandboxes.snapshot`, until the snapshot is
//!   `ready`), and a sandbox restored from it (`sandboxes.create` with `fromSnapshotId`, until its
//!   first exec output), `SNAPSHOT_SAMPLES` times.
//! - Capacity: a template of a 64 MiB flavor, sandboxes created one after another until the
//!   control plane or the node says no; how many ran, and what said no.
//!
//! Each figure is printed beside the floor as a ratio. The anchors (Firecracker's
//! 125 ms from start to guest init, e2b's ~150 ms from a snapshot) are other machines' figures,
//! printed for reference, not measured here.

use crate::support::banner;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::Digest;

/// `runsc do /bin/true` runs timed for the floor.
const FLOOR_RUNS: usize = 20;
/// Creates timed, cold and warm each.
const SAMPLES: usize = 30;
/// The warm pool's size.
const WARM_MIN: u32 = 2;
/// How often the bench asks whether a cold sandbox is running.
const POLL_MS: u64 = 5;
/// Snapshots taken and restored, timed.
const SNAPSHOT_SAMPLES: usize = 5;
/// The most sandboxes the capacity case tries (past the control plane's bound per node, 64).
const CAPACITY_TRIES: usize = 80;

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The `bcd` beside the bench's `better-compute`: a `fakehw` build (`make bench` builds it).
fn bcd() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_better-compute")).with_file_name("bcd");
    let fake = Command::new(&path).args(["hardware", "--fake-hw", "1"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    assert!(
        fake.is_ok_and(|s| s.success()),
        "{} is not a fakehw build\nhint: cargo build --release -p bc-agent --features fakehw --bin bcd (make bench does)",
        path.display()
    );
    path
}

/// What the bench needs from Debian, checked first: `runsc` and `/bin/busybox`.
fn require_runtime() {
    let runsc = Command::new("runsc").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(runsc, "runsc (gVisor) is not installed (Debian's package runsc; make system-deps)");
    assert!(Path::new("/bin/busybox").exists(), "/bin/busybox is not installed (Debian's package busybox-static)");
}

/// `better-compute dev` as a child: (child, http url, agents' port, serving pin, log key pin).
fn start_gateway(dir: &Path) -> (Killed, String, u16, String, String) {
    let agents_port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["dev", "--data-dir", &dir.display().to_string(), "--listen", "127.0.0.1:0"])
        .args(["--agents-listen", &format!("127.0.0.1:{agents_port}"), "--rate-per-key", "0", "--rate-per-tenant", "0"])
        .env("BETTER_COMPUTE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (url, serving_pin, log_pin) = banner::read(child.stdout.take().unwrap());
    (Killed(child), url, agents_port, serving_pin, log_pin)
}

/// The API, as the root administrator.
struct Api {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Api {
    async fn try_call(&self, method: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}/api/compute/{method}", self.url))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    async fn call(&self, method: &str, body: Value) -> Value {
        let (status, v) = self.try_call(method, body).await;
        assert!((200..300).contains(&status), "{method}: {v}");
        v
    }

    /// Polls `method` every `every_ms` until `done` says yes (120 s at most).
    async fn wait(&self, method: &str, body: Value, what: &str, every_ms: u64, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let doc = self.call(method, body.clone()).await;
            if done(&doc) {
                return doc;
            }
            assert!(Instant::now() < deadline, "not {what} after 120 s: {doc}");
            tokio::time::sleep(Duration::from_millis(every_ms)).await;
        }
    }
}

/// A fake machine running `bcd node` (gVisor found): joined to `pool`, ready with
/// `sandbox.gvisor`; its node id.
async fn start_node(api: &Api, bcd: &Path, dir: &Path, gateway: (u16, &str, &str), pool: &str) -> (Killed, String) {
    let (agents_port, serving_pin, log_pin) = gateway;
    std::fs::create_dir_all(dir).unwrap();
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {:?}\ngateway = \"https://127.0.0.1:{agents_port}\"\nserving_ca_spki_pin = {serving_pin:?}\nlog_key_pin = {log_pin:?}\nobserve_interval = \"150ms\"\n\n[log]\nlevel = \"warn\"\n\n[hardware]\nfake_seed = 1\n",
            dir.join("data").display().to_string()
        ),
    )
    .unwrap();
    let token = api.call("joinTokens.create", json!({ "poolId": pool, "uses": 1 })).await["token"].as_str().unwrap().to_owned();
    let mut join =
        Command::new(bcd).args(["join", "--config", &config.display().to_string()]).stdin(Stdio::piped()).spawn().unwrap();
    join.stdin.take().unwrap().write_all(format!("{token}\n").as_bytes()).unwrap();
    assert!(join.wait().unwrap().success(), "bcd join");
    let identity: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("data/identity.json")).unwrap()).unwrap();
    let node =
        serde_json::from_str::<Value>(identity["identity"].as_str().unwrap()).unwrap()["nodeId"].as_str().unwrap().to_owned();
    let child = Command::new(bcd)
        .args(["node", "--config", &config.display().to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    api.wait("nodes.get", json!({ "nodeId": node }), "ready with sandbox.gvisor", 100, |d| {
        d["state"] == "ready"
            && d["agent"]["inventory"]["capabilities"].as_array().is_some_and(|c| c.iter().any(|c| c == "sandbox.gvisor"))
    })
    .await;
    (Killed(child), node)
}

/// A root file system as a tar archive: busybox and the applets the bench runs.
fn busybox_rootfs(dir: &Path) -> Vec<u8> {
    let root = dir.join("rootfs");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for applet in ["sh", "echo", "true", "sleep", "cat"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    let archive = dir.join("rootfs.tar");
    assert!(Command::new("tar").arg("-C").arg(&root).arg("-cf").arg(&archive).arg(".").status().unwrap().success(), "tar");
    std::fs::read(archive).unwrap()
}

/// Serves `bytes` to every GET on a loopback port: the image's URL.
fn image_server(bytes: Vec<u8>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/busybox.tar", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut head = Vec::new();
            let mut buffer = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buffer) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buffer[..n]),
                }
            }
            let _ = write!(stream, "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", bytes.len());
            let _ = stream.write_all(&bytes);
        }
    });
    url
}

/// `runsc do /bin/true` on this machine's root, as the node runs it (ptrace, no network): its
/// wall time in ms.
fn runsc_do(root: &Path) -> f64 {
    let started = Instant::now();
    let status = Command::new("runsc")
        .arg("--root")
        .arg(root)
        .args(["--platform=ptrace", "--network=none", "do", "/bin/true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    assert!(status.success(), "runsc do /bin/true: {status}");
    ms
}

/// A sandbox `runsc run` starts (detached) from the bundle in `dir` (its `rootfs`, from
/// [`busybox_rootfs`]), running `sleep`: what `runsc exec` runs in for the exec floor.
fn runsc_sleeper(root: &Path, dir: &Path) -> &'static str {
    const ID: &str = "bench-exec-floor";
    let spec = Command::new("runsc").current_dir(dir).args(["spec", "--", "/bin/sleep", "3600"]).status().unwrap();
    assert!(spec.success(), "runsc spec");
    let run = Command::new("runsc")
        .arg("--root")
        .arg(root)
        .args(["--platform=ptrace", "--network=none", "run", "--detach", "--bundle"])
        .arg(dir)
        .arg(ID)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(run.success(), "runsc run --detach: {run}");
    ID
}

/// `runsc exec ID /bin/echo ready` into the sleeper, to its end: its wall time in ms.
fn runsc_exec(root: &Path, id: &str) -> f64 {
    let started = Instant::now();
    let out = Command::new("runsc")
        .arg("--root")
        .arg(root)
        .args(["--platform=ptrace", "exec", id, "/bin/echo", "ready"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    assert!(out.status.success() && out.stdout.starts_with(b"ready"), "runsc exec: {out:?}");
    ms
}

fn runsc_delete(root: &Path, id: &str) {
    let _ = Command::new("runsc").arg("--root").arg(root).args(["delete", "--force", id]).status();
}

/// `better-compute sandbox exec SBX -- echo ready`: until its first byte of output (then to
/// its end, checked).
fn first_output(api: &Api, sandbox: &str) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_better-compute"))
        .args(["sandbox", "exec", sandbox, "--url", &api.url, "--", "echo", "ready"])
        .env("BETTER_COMPUTE_TOKEN", &api.token)
        .env("BETTER_COMPUTE_CREDENTIALS", "/nonexistent/bench/credentials.json")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    let got = out.read(&mut first).unwrap();
    let mut rest = Vec::new();
    let _ = out.read_to_end(&mut rest);
    let output = child.wait_with_output().unwrap();
    assert!(
        got == 1 && output.status.success(),
        "sandbox exec: {} {}",
        String::from_utf8_lossy(&rest),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// One sample: create from `template` (from `snapshot` when given), wait until running (a
/// claimed warm one already is), exec until the first output. (ms in all, ms of the exec alone,
/// whether it was warm, the sandbox id).
async fn create_to_output(api: &Api, template: &str, snapshot: Option<&str>) -> (f64, f64, bool, String) {
    let started = Instant::now();
    let mut body = json!({ "templateId": template, "ttlS": 600 });
    if let Some(snapshot) = snapshot {
        body["fromSnapshotId"] = json!(snapshot);
    }
    let created = api.call("sandboxes.create", body).await;
    let sandbox = created["sandboxId"].as_str().unwrap().to_owned();
    if created["state"] != "running" {
        let doc =
            api.wait("sandboxes.get", json!({ "sandboxId": sandbox }), "running", POLL_MS, |s| s["state"] != "starting").await;
        assert_eq!(doc["state"], "running", "{doc}");
    }
    let exec_started = Instant::now();
    let http = api.http.clone();
    let (url, token, id) = (api.url.clone(), api.token.clone(), sandbox.clone());
    tokio::task::spawn_blocking(move || first_output(&Api { http, url, token }, &id)).await.unwrap();
    let ms = |since: Instant| since.elapsed().as_secs_f64() * 1000.0;
    (ms(started), ms(exec_started), created["claimed"] == "warm", sandbox)
}

/// A snapshot of `sandbox` (kept past it), until `ready`: (ms, the snapshot's id).
async fn snapshot(api: &Api, sandbox: &str) -> (f64, String) {
    let started = Instant::now();
    let taken = api.call("sandboxes.snapshot", json!({ "sandboxId": sandbox, "keep": true })).await;
    let id = taken["snapshotId"].as_str().unwrap().to_owned();
    let doc = api.wait("sandboxSnapshots.get", json!({ "snapshotId": id }), "ready", POLL_MS, |s| s["state"] != "taking").await;
    assert_eq!(doc["state"], "ready", "{doc}");
    (started.elapsed().as_secs_f64() * 1000.0, id)
}

/// Deletes `sandbox` and waits (untimed) until the node has removed it: a node runs its commands
/// one at a time, and gVisor's removal takes about 2 s, so a sample started before it was done
/// would time the delete too.
async fn delete(api: &Api, sandbox: &str) {
    api.call("sandboxes.delete", json!({ "sandboxId": sandbox })).await;
    api.wait("sandboxes.get", json!({ "sandboxId": sandbox }), "deleted", 20, |s| s["state"] == "deleted").await;
}

/// Waits until `template` has `count` warm sandboxes running.
async fn warm_full(api: &Api, template: &str, count: usize) {
    api.wait("sandboxes.list", json!({ "templateId": template, "limit": 100 }), "warm pool full", 20, |page| {
        page["items"]
            .as_array()
            .is_some_and(|items| items.iter().filter(|s| s["warm"] == true && s["state"] == "running").count() >= count)
    })
    .await;
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    require_runtime();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let bcd = bcd();
        let dir = tempfile::tempdir().unwrap();
        let (gateway, url, agents_port, serving_pin, log_pin) = start_gateway(&dir.path().join("gateway"));
        let token = std::fs::read_to_string(dir.path().join("gateway/admin.token")).unwrap().trim().to_owned();
        let api = Api { http: reqwest::Client::new(), url, token };
        let pool = api.call("pools.create", json!({ "name": "sandboxes" })).await["poolId"].as_str().unwrap().to_owned();
        let (node_child, node) =
            start_node(&api, &bcd, &dir.path().join("node"), (agents_port, &serving_pin, &log_pin), &pool).await;

        let bytes = busybox_rootfs(dir.path());
        let digest: String = sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        let size = bytes.len();
        let image = api
            .call(
                "images.register",
                json!({ "name": "busybox", "url": image_server(bytes), "sha256": digest, "diskFormat": "rootfs-tar", "sizeBytes": size }),
            )
            .await["imageId"]
            .as_str()
            .unwrap()
            .to_owned();
        let flavor = |name: &str, mib: u64| {
            json!({ "poolId": pool, "name": name, "vcpus": 1, "memoryMiB": mib, "diskGiB": 1, "gpus": 0 })
        };
        let small = api.call("flavors.create", flavor("sbx-64", 64)).await["flavorId"].as_str().unwrap().to_owned();
        let template = |name: &str, warm: u32| {
            json!({ "name": name, "poolId": pool, "flavorId": small, "imageId": image, "warmMin": warm, "maxTtlS": 3600 })
        };
        let cold = api.call("sandboxTemplates.create", template("cold", 0)).await["templateId"].as_str().unwrap().to_owned();

        // The floor, and the first cold sandbox (untimed: it fetches and unpacks the image).
        let runsc_root = dir.path().join("runsc-floor");
        std::fs::create_dir_all(&runsc_root).unwrap();
        let _ = runsc_do(&runsc_root);
        let sleeper = runsc_sleeper(&runsc_root, dir.path());
        let _ = runsc_exec(&runsc_root, sleeper);
        let (_, _, _, first) = create_to_output(&api, &cold, None).await;
        delete(&api, &first).await;

        let (mut floor, mut exec_floor) = (Vec::new(), Vec::new());
        let (mut cold_ms, mut warm_ms, mut exec_ms) = (Vec::new(), Vec::new(), Vec::new());
        let warm_template = api.call("sandboxTemplates.create", template("warm", WARM_MIN)).await["templateId"]
            .as_str()
            .unwrap()
            .to_owned();
        // Interleaved: a floor run, a cold sample, a warm sample, so the machine's noise falls
        // on all three alike.
        for i in 0..SAMPLES {
            if i < FLOOR_RUNS {
                let root = runsc_root.clone();
                floor.push(tokio::task::spawn_blocking(move || runsc_do(&root)).await.unwrap());
                let root = runsc_root.clone();
                exec_floor.push(tokio::task::spawn_blocking(move || runsc_exec(&root, sleeper)).await.unwrap());
            }
            // The warm pool's refill (a start on the node) done first, untimed, as the deletes are.
            warm_full(&api, &warm_template, WARM_MIN as usize).await;
            let (ms, _, warm, sandbox) = create_to_output(&api, &cold, None).await;
            assert!(!warm, "the cold template keeps no warm pool");
            cold_ms.push(ms);
            delete(&api, &sandbox).await;
            warm_full(&api, &warm_template, WARM_MIN as usize).await;
            let (ms, exec, warm, sandbox) = create_to_output(&api, &warm_template, None).await;
            assert!(warm, "a full warm pool hands one out");
            warm_ms.push(ms);
            exec_ms.push(exec);
            delete(&api, &sandbox).await;
        }
        runsc_delete(&runsc_root, sleeper);
        api.call("sandboxTemplates.delete", json!({ "templateId": warm_template })).await;

        // Snapshots: a running cold sandbox snapshotted, and a new one restored from it.
        let (mut snapshot_ms, mut restore_ms) = (Vec::new(), Vec::new());
        for _ in 0..SNAPSHOT_SAMPLES {
            let (_, _, _, source) = create_to_output(&api, &cold, None).await;
            let (ms, taken) = snapshot(&api, &source).await;
            snapshot_ms.push(ms);
            let (ms, _, _, restored) = create_to_output(&api, &cold, Some(&taken)).await;
            restore_ms.push(ms);
            delete(&api, &restored).await;
            delete(&api, &source).await;
            api.call("sandboxSnapshots.delete", json!({ "snapshotId": taken })).await;
        }
        api.wait("sandboxes.list", json!({ "limit": 100 }), "the warm pool gone", 100, |p| {
            p["items"].as_array().is_some_and(|i| i.is_empty())
        })
        .await;

        // Capacity: 64 MiB sandboxes, one after another, until something says no.
        let mem_before = mem_available_kib();
        let mut made = Vec::new();
        let mut refusal = String::from("nothing said no");
        for _ in 0..CAPACITY_TRIES {
            let (status, created) = api.try_call("sandboxes.create", json!({ "templateId": cold, "ttlS": 600 })).await;
            if status != 200 {
                refusal = format!("the control plane: {} {}", created["code"], created["message"]);
                break;
            }
            let id = created["sandboxId"].as_str().unwrap().to_owned();
            let doc = api.wait("sandboxes.get", json!({ "sandboxId": id }), "started", 20, |s| s["state"] != "starting").await;
            made.push(id);
            if doc["state"] != "running" {
                refusal = format!("the node: {}", doc["lastError"]);
                break;
            }
        }
        let running = made.len() - usize::from(!refusal.starts_with("the control plane") && refusal != "nothing said no");
        let mem_after = mem_available_kib();
        for id in &made {
            delete(&api, id).await;
        }

        for samples in [&mut floor, &mut exec_floor, &mut cold_ms, &mut warm_ms, &mut exec_ms, &mut snapshot_ms, &mut restore_ms] {
            samples.sort_by(f64::total_cmp);
        }
        let (f50, f99) = (percentile(&floor, 0.5), percentile(&floor, 0.99));
        let (e50, e99) = (percentile(&exec_floor, 0.5), percentile(&exec_floor, 0.99));
        println!();
        println!(
            "sandboxes (release dev and bcd on loopback, gVisor {} --platform=ptrace, {} cores)",
            runsc_version(),
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        );
        println!("  floor: runsc do /bin/true           p50 {f50:>7.1} ms, p99 {f99:>7.1} ms ({FLOOR_RUNS} runs)");
        println!("  floor: runsc exec (running sandbox) p50 {e50:>7.1} ms, p99 {e99:>7.1} ms ({FLOOR_RUNS} runs)");
        let line = |what: &str, samples: &[f64], (b50, b99): (f64, f64), base: &str| {
            let (p50, p99) = (percentile(samples, 0.5), percentile(samples, 0.99));
            println!(
                "  {what:<34} p50 {p50:>7.1} ms, p99 {p99:>7.1} ms; ÷ {base} p50 {:.2}, p99 {:.2} ({} samples)",
                p50 / b50,
                p99 / b99,
                samples.len()
            );
        };
        line("create → first exec output, cold", &cold_ms, (f50, f99), "runsc do");
        line("create → first exec output, warm", &warm_ms, (f50, f99), "runsc do");
        line("sandbox exec alone (warm, to end)", &exec_ms, (e50, e99), "runsc exec");
        line("snapshot (until ready)", &snapshot_ms, (f50, f99), "runsc do");
        line("restore → first exec output", &restore_ms, (f50, f99), "runsc do");
        println!("  anchors (other machines, not measured): Firecracker 125 ms start → guest init; e2b ~150 ms from a snapshot");
        println!(
            "  64 MiB sandboxes on one node: {running} running before {refusal}; MemAvailable {:.0} → {:.0} MiB ({:.1} MiB a sandbox)",
            mem_before / 1024.0,
            mem_after / 1024.0,
            (mem_before - mem_after) / 1024.0 / running.max(1) as f64
        );
        drop(node_child);
        drop(gateway);
        let _ = node;
    });
}

fn mem_available_kib() -> f64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    info.lines().find_map(|l| l.strip_prefix("MemAvailable:")).and_then(|v| v.split_whitespace().next()).unwrap().parse().unwrap()
}

fn runsc_version() -> String {
    let out = Command::new("runsc").arg("--version").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    out.ok().and_then(|o| o.lines().next().map(|l| l.trim_start_matches("runsc version ").to_owned())).unwrap_or_default()
}
