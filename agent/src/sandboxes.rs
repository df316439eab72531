//! Sandboxes on this node: each an OCI bundle run by a [`SandboxRuntime`] (gVisor's `runsc`, on
//! the `ptrace` platform, which needs no KVM), recorded in a ledger (`sandboxes.json`) before the
//! machine is touched, so a restart finds every sandbox again and a crash part way leaves the
//! ledger saying what is left to do.
//!
//! - **Root file system**: the template's image is a tar archive (`rootfs-tar`, gzip or not),
//!   fetched and verified by SHA-256 through the node's image cache ([`ImageCache`]), then
//!   unpacked once per digest into `<data_dir>/sandboxes/rootfs/<sha256>` (into a fresh
//!   directory, renamed whole when complete). Every sandbox of the image shares it, read-only:
//!   the runtime lays a writable layer in memory over it (`runsc --overlay`), so nothing a
//!   sandbox writes reaches the host's files or another sandbox.
//! - **Bundle**: `<data_dir>/sandboxes/bundles/<sbx_…>/config.json`, written here with serde
//!   ([`oci_config`], pure): the init process (`/bin/sh` looping on `sleep`), the template's
//!   environment, memory, CPU and process limits from the flavor ([`SANDBOX_PIDS_MAX`]), its own
//!   PID, IPC, UTS, mount and network namespaces, and no network (`runsc --network=none`).
//! - **Runtime**: [`Runsc`] runs `runsc --root <data_dir>/sandboxes/runsc …`, its own state
//!   directory, so its containers are this agent's alone; [`sweep_plan`] (pure) names those no
//!   ledger entry does, which [`Sandboxes::sweep`] removes.
//! - **Volumes**: a sandbox of a template with volumes bind-mounts each (loop-mounted on the node
//!   by [`crate::volumes`]) at its path; only the root file system is under the in-memory layer
//!   (`--overlay2=root:memory`), so what it writes there reaches the volume. A volume mounted by a
//!   sandbox of the ledger is neither grown nor deleted ([`Sandboxes::apply_volume`]).
//! - **Exec**: [`Sandboxes::exec`] runs a command in a running sandbox (`runsc exec`, the
//!   sandbox's environment), its stdin, stdout and stderr streamed as tunnel frames and its exit
//!   status the tunnel's end.
//!
//! Errors carry stable codes, as instance applies do: `bad-args`, `image-fetch`, `image-digest`,
//! `image-size`, `rootfs`, `runtime`, `disk`, `capacity`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use bc_core::tunnel::{self as wire, End, Frame};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::images::ImageCache;
use crate::instances::ImageRef;

/// The command kind and the capability this module adds.
pub const SANDBOX_APPLY: &str = "sandbox.apply";
pub const CAPABILITY_SANDBOX_GVISOR: &str = "sandbox.gvisor";
pub const CAPABILITY_SANDBOX_EXEC: &str = "tunnel.sandbox-exec";
/// The most sandboxes one node runs.
pub const SANDBOXES_PER_NODE_MAX: usize = 64;
/// The most processes (threads included) inside one sandbox: a fork bomb stops here.
pub const SANDBOX_PIDS_MAX: u64 = 512;
/// The most bytes a root file system unpacks to.
pub const ROOTFS_BYTES_MAX: u64 = 8 * 1024 * 1024 * 1024;
/// The most entries a root file system's archive holds.
pub const ROOTFS_ENTRIES_MAX: u64 = 1_000_000;
/// The CFS period the CPU limit is a quota of, in µs.
pub const CPU_PERIOD_US: u64 = 100_000;
/// Bytes of a command's output read at once (one frame at most).
const READ_CHUNK_BYTES: usize = wire::DATA_BYTES_MAX;
/// The longest a sandbox's runtime may take to start it.
pub const SANDBOX_START_TIMEOUT_S: u64 = 60;
/// The `PATH` a sandbox's processes get unless the template says otherwise.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The longest reason a report carries.
const REASON_BYTES_MAX: usize = 1024;

/// What a sandbox's runtime reports of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeState {
    Running,
    Stopped,
}

/// The sandbox runtime: the only place a sandbox's processes are started, asked about or ended.
/// Its calls block (they run processes); callers run them on the blocking pool.
pub trait SandboxRuntime: Send + Sync + 'static {
    /// The runtime's name, as the capability says it (`gvisor`).
    fn name(&self) -> &'static str;
    /// Starts sandbox `id` from the bundle at `bundle` (its `config.json`), detached.
    fn start(&self, id: &str, bundle: &Path) -> Result<(), String>;
    /// The sandbox's state; `None`: the runtime has no such sandbox.
    fn state(&self, id: &str) -> Result<Option<RuntimeState>, String>;
    /// Ends and removes the sandbox; one that does not exist is not an error.
    fn remove(&self, id: &str) -> Result<(), String>;
    /// Every sandbox the runtime holds in this agent's state directory.
    fn list(&self) -> Result<Vec<String>, String>;
    /// The process that runs `command` in sandbox `id` (stdio piped), not started.
    fn exec_command(&self, id: &str, command: &[String]) -> tokio::process::Command;
    /// Saves sandbox `id`'s state (memory and its in-memory disk layer) into `image_dir`; the
    /// sandbox is stopped afterwards ([`crate::sandbox_snapshots`]).
    fn checkpoint(&self, id: &str, image_dir: &Path) -> Result<(), String>;
    /// Starts sandbox `id` from the bundle at `bundle` in the state saved in `image_dir`,
    /// detached.
    fn restore(&self, id: &str, bundle: &Path, image_dir: &Path) -> Result<(), String>;
}

/// gVisor's `runsc`, with its own state directory (`--root`), the `ptrace` platform and no
/// network; the root file system under an in-memory writable layer (`--overlay`).
pub struct Runsc {
    pub binary: PathBuf,
    pub root: PathBuf,
    pub platform: String,
}

impl Runsc {
    /// `runsc` on the `PATH` (or `BCD_RUNSC`), if there is one that runs.
    pub fn find(root: PathBuf) -> Option<Self> {
        let binary = std::env::var_os("BCD_RUNSC").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("runsc"));
        let ok = std::process::Command::new(&binary)
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self { binary, root, platform: "ptrace".into() })
    }

    fn command(&self) -> std::process::Command {
        let mut command = std::process::Command::new(&self.binary);
        command.arg("--root").arg(&self.root).arg(format!("--platform={}", self.platform)).arg("--network=none");
        command.stdin(Stdio::null());
        command
    }

    fn run(&self, what: &str, mut command: std::process::Command) -> Result<std::process::Output, String> {
        let output = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("runtime: running runsc {what}: {e}"))?;
        if output.status.success() {
            Ok(output)
        } else {
            let stderr = String::from_utf8_lossy(&output.stderr);
            Err(format!("runtime: runsc {what} failed ({}): {}", output.status, bc_core::id::truncate(stderr.trim(), 400)))
        }
    }
}

impl SandboxRuntime for Runsc {
    fn name(&self) -> &'static str {
        "gvisor"
    }

    fn start(&self, id: &str, bundle: &Path) -> Result<(), String> {
        // 0700: runsc keeps each sandbox's spec, its environment with any secret's value among
        // it, in its state here.
        let private = || -> std::io::Result<()> {
            use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.root)?;
            std::fs::set_permissions(&self.root, std::fs::Permissions::from_mode(0o700))
        };
        private().map_err(|e| format!("disk: {}: {e}", self.root.display()))?;
        let mut command = self.command();
        // Only the root file system under the in-memory writable layer: a volume's bind mount
        // writes through to the volume.
        command.arg("--overlay2=root:memory").arg("run").arg("--detach").arg("--bundle").arg(bundle).arg(id);
        // The sandbox outlives this call: it must hold none of our pipes.
        let status = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("runtime: running runsc run: {e}"))?;
        if status.success() { Ok(()) } else { Err(format!("runtime: runsc run {id} failed ({status}); see bcd's log")) }
    }

    /// `runsc state ID`, not `runsc list`: a list loads every sandbox of the root and waits on
    /// one that is being deleted (1.9 s here while gVisor tore another sandbox down), and every
    /// exec asks the state first: an exec into any sandbox of the node took 1.8 s right after a
    /// delete (the sandbox bench's warm case), 0.2 s otherwise.
    fn state(&self, id: &str) -> Result<Option<RuntimeState>, String> {
        if !self.root.exists() {
            return Ok(None);
        }
        let mut command = self.command();
        command.arg("state").arg(id);
        let output = match self.run("state", command) {
            Ok(output) => output,
            // runsc's answer for an id its root does not hold: "loading container: file does
            // not exist".
            Err(e) if e.contains("does not exist") => return Ok(None),
            Err(e) => return Err(e),
        };
        #[derive(Deserialize)]
        struct State {
            status: String,
        }
        let state: State =
            serde_json::from_slice(&output.stdout).map_err(|e| format!("runtime: runsc state's answer is not its JSON: {e}"))?;
        Ok(Some(if state.status == "running" { RuntimeState::Running } else { RuntimeState::Stopped }))
    }

    fn remove(&self, id: &str) -> Result<(), String> {
        if self.state(id)?.is_none() {
            return Ok(());
        }
        let mut command = self.command();
        command.arg("delete").arg("--force").arg(id);
        self.run("delete", command).map(|_| ())
    }

    fn list(&self) -> Result<Vec<String>, String> {
        Ok(self.list_states()?.into_keys().collect())
    }

    fn exec_command(&self, id: &str, command: &[String]) -> tokio::process::Command {
        let mut exec = tokio::process::Command::new(&self.binary);
        exec.arg("--root").arg(&self.root).arg(format!("--platform={}", self.platform)).arg("--network=none");
        // Go's flag parsing stops at the container id: what follows is the command, never
        // runsc's options, whatever it starts with.
        exec.arg("exec").arg("--cwd").arg("/").arg(id).args(command);
        exec.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
        exec
    }

    fn checkpoint(&self, id: &str, image_dir: &Path) -> Result<(), String> {
        // Without `--leave-running`: this build's hangs after writing the image (the caller
        // restores the sandbox in place instead).
        let mut command = self.command();
        command.arg("checkpoint").arg("--image-path").arg(image_dir).arg(id);
        self.run("checkpoint", command).map(|_| ())
    }

    fn restore(&self, id: &str, bundle: &Path, image_dir: &Path) -> Result<(), String> {
        let mut command = self.command();
        command
            .arg("--overlay2=root:memory")
            .arg("restore")
            .arg("--detach")
            .arg("--image-path")
            .arg(image_dir)
            .arg("--bundle")
            .arg(bundle)
            .arg(id);
        // The sandbox outlives this call: it must hold none of our pipes.
        let status = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("runtime: running runsc restore: {e}"))?;
        if status.success() { Ok(()) } else { Err(format!("runtime: runsc restore {id} failed ({status}); see bcd's log")) }
    }
}

impl Runsc {
    /// `runsc list --format json`: id → status. No state directory yet: none.
    fn list_states(&self) -> Result<BTreeMap<String, String>, String> {
        if !self.root.exists() {
            return Ok(BTreeMap::new());
        }
        let mut command = self.command();
        command.arg("list").arg("--format").arg("json");
        let output = self.run("list", command)?;
        #[derive(Deserialize)]
        struct Listed {
            id: String,
            status: String,
        }
        let text = String::from_utf8_lossy(&output.stdout);
        let text = text.trim();
        if text.is_empty() || text == "null" {
            return Ok(BTreeMap::new());
        }
        let listed: Vec<Listed> = serde_json::from_str(text).map_err(|e| format!("runtime: runsc list's answer: {e}"))?;
        Ok(listed.into_iter().map(|l| (l.id, l.status)).collect())
    }
}

/// What a `sandbox.apply` asks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxArgs {
    pub sandbox_id: String,
    /// `running` or `deleted`.
    pub desired: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    pub image: ImageRef,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    pub network: String,
    /// The volumes it mounts (this node's, [`crate::volumes`]).
    #[serde(default)]
    pub volumes: Vec<SandboxMount>,
    /// Started from this snapshot (`runsc restore`), verified first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<crate::sandbox_snapshots::SnapshotRef>,
}

/// A volume a sandbox mounts, and where.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxMount {
    pub volume_id: String,
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
}

/// One sandbox the ledger holds: what it was asked to be, written before the machine is
/// touched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxEntry {
    pub desired: String,
    pub command_id: String,
    pub image_sha256: String,
    /// The volumes it mounts: none is grown or deleted while it is here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxLedger {
    pub sandboxes: BTreeMap<String, SandboxEntry>,
}

impl crate::ledger::LedgerContents for SandboxLedger {
    const FILE: &'static str = "sandboxes.json";
}

pub type SandboxLedgerFile = crate::ledger::LedgerFile<SandboxLedger>;

/// Reads and checks a `sandbox.apply`'s arguments. `Err((sandbox id if read, reason))`.
pub fn parse_args(args_json: &str) -> Result<SandboxArgs, (Option<String>, String)> {
    let (id, args): (String, SandboxArgs) =
        crate::ledger::subject_args::<_, bc_core::id::SandboxId>(args_json, "sandboxId", "a sandbox id")?;
    let bad = |why: String| Err((Some(id.clone()), format!("bad-args: {why}")));
    if !matches!(args.desired.as_str(), "running" | "deleted") {
        return bad(format!("desired {:?} is not running or deleted", bc_core::id::truncate(&args.desired, 20)));
    }
    if args.network != "none" {
        return bad("this node runs sandboxes without a network only (network none)".into());
    }
    if !crate::instances::is_sha256(&args.image.sha256) {
        return bad("the image's digest is not 64 lowercase hex digits".into());
    }
    if args.vcpus == 0 || args.memory_mib == 0 {
        return bad("a sandbox needs at least one vCPU and some memory".into());
    }
    if let Some(r) = &args.restore
        && (r.snapshot_id.parse::<bc_core::id::SandboxSnapshotId>().is_err() || !crate::instances::is_sha256(&r.sha256))
    {
        return bad("the snapshot to restore is not an id and 64 lowercase hex digits".into());
    }
    for m in &args.volumes {
        if m.volume_id.parse::<bc_core::id::SandboxVolumeId>().is_err() {
            return bad("a volume's id is not a volume id".into());
        }
        let plain = m.path.len() <= 256
            && m.path.starts_with('/')
            && m.path[1..].split('/').all(|c| !c.is_empty() && c != "." && c != "..")
            && m.path.bytes().all(|b| b.is_ascii_graphic());
        if !plain {
            return bad(format!("a volume's mount path {:?} is not a plain absolute path", bc_core::id::truncate(&m.path, 60)));
        }
    }
    Ok(args)
}

/// The OCI runtime configuration of a sandbox (pure): its init process, environment, root file
/// system (`rootfs`, shared read-only; the runtime's overlay takes its writes), its volumes
/// (`volumes`: each volume's mount point on the node, bind-mounted at its path), limits and
/// namespaces.
pub fn oci_config(args: &SandboxArgs, rootfs: &Path, volumes: &[(PathBuf, &SandboxMount)]) -> Value {
    let mut mounts = vec![
        json!({ "destination": "/proc", "type": "proc", "source": "proc" }),
        json!({ "destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"] }),
    ];
    for (source, m) in volumes {
        let mode = if m.read_only { "ro" } else { "rw" };
        mounts.push(json!({
            "destination": m.path, "type": "bind", "source": source, "options": ["rbind", mode, "nosuid", "nodev"],
        }));
    }
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), DEFAULT_PATH.into());
    env.insert("HOME".into(), "/root".into());
    env.extend(args.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": { "uid": 0, "gid": 0 },
            // The sandbox's first process: it waits, so the sandbox lives until it is deleted.
            "args": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600; done"],
            "env": env,
            "cwd": "/",
            "noNewPrivileges": true,
        },
        "root": { "path": rootfs, "readonly": false },
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": {
            "namespaces": [
                { "type": "pid" }, { "type": "ipc" }, { "type": "uts" }, { "type": "mount" }, { "type": "network" },
            ],
            "resources": {
                "memory": { "limit": args.memory_mib.saturating_mul(1024 * 1024) },
                "cpu": { "quota": u64::from(args.vcpus) * CPU_PERIOD_US, "period": CPU_PERIOD_US },
                "pids": { "limit": SANDBOX_PIDS_MAX },
            },
        },
    })
}

/// The runtime's sandboxes no ledger entry names (pure): what a sweep removes.
pub fn sweep_plan(ledger: &SandboxLedger, listed: &[String]) -> Vec<String> {
    listed.iter().filter(|id| !ledger.sandboxes.contains_key(id.as_str())).cloned().collect()
}

/// What an apply comes to: the sandbox's state afterwards, or why not.
pub type Outcome = Result<&'static str, String>;

/// The node's sandboxes: the ledger, the image cache, the runtime.
pub struct Sandboxes {
    pub(crate) dir: PathBuf,
    pub ledger: tokio::sync::Mutex<SandboxLedger>,
    ledger_file: SandboxLedgerFile,
    images: ImageCache,
    pub runtime: Arc<dyn SandboxRuntime>,
    /// The node's volumes, which its sandboxes mount.
    pub volumes: crate::volumes::Volumes,
    /// The node's snapshots ([`crate::sandbox_snapshots`]).
    pub snapshots: tokio::sync::Mutex<crate::sandbox_snapshots::SnapshotLedger>,
    pub(crate) snapshots_file: crate::sandbox_snapshots::SnapshotLedgerFile,
}

impl Sandboxes {
    /// The sandboxes of `data_dir` on `runtime`.
    pub fn new(data_dir: &Path, runtime: Arc<dyn SandboxRuntime>) -> Result<Self, String> {
        let ledger_file = SandboxLedgerFile::new(data_dir);
        let ledger = ledger_file.load()?;
        let snapshots_file = crate::sandbox_snapshots::SnapshotLedgerFile::new(data_dir);
        let snapshots = tokio::sync::Mutex::new(snapshots_file.load()?);
        Ok(Self {
            snapshots,
            snapshots_file,
            dir: data_dir.join("sandboxes"),
            ledger: tokio::sync::Mutex::new(ledger),
            ledger_file,
            images: ImageCache::new(data_dir)?,
            runtime,
            volumes: crate::volumes::Volumes::new(data_dir, Arc::new(crate::volumes::LoopExt4))?,
        })
    }

    /// The sandboxes of a node, with gVisor when `runsc` is there; `None` (and a log line)
    /// without it.
    pub fn for_config(config: &crate::config::Config) -> Result<Option<Self>, String> {
        let root = config.data_dir.join("sandboxes").join("runsc");
        match Runsc::find(root) {
            Some(runsc) => {
                let mut sandboxes = Self::new(&config.data_dir, Arc::new(runsc))?;
                sandboxes.volumes.crash_after_record = config.hardware.fake_volume_crash.clone();
                // Probed here, at the edge, as runsc is: the capabilities say what was found.
                match crate::volumes::LoopExt4::probe(sandboxes.volumes.dir()) {
                    Ok(bytes) => sandboxes.volumes.file_system_bytes = Some(bytes),
                    Err(why) => {
                        tracing::warn!(reason = %why, "this node makes no sandbox volumes");
                        sandboxes.volumes.unusable = Some(why);
                    }
                }
                Ok(Some(sandboxes))
            }
            None => {
                tracing::info!("runsc is not installed: this node runs no sandboxes (Debian's package runsc)");
                Ok(None)
            }
        }
    }

    /// The capabilities sandboxes add: volumes' only when this node can make them.
    pub fn capabilities(&self) -> Vec<String> {
        let mut out = vec![CAPABILITY_SANDBOX_GVISOR.to_owned(), CAPABILITY_SANDBOX_EXEC.to_owned()];
        if self.volumes.unusable.is_none() {
            out.push(crate::volumes::CAPABILITY_SANDBOX_VOLUMES.to_owned());
        }
        out
    }

    pub(crate) fn bundle_dir(&self, id: &str) -> PathBuf {
        self.dir.join("bundles").join(id)
    }

    /// Carries out an apply: the ledger first, then the machine.
    pub async fn apply(&self, command_id: &str, args: &SandboxArgs) -> Outcome {
        let id = args.sandbox_id.as_str();
        let mut ledger = self.ledger.lock().await;
        if args.desired == "deleted" {
            if let Some(entry) = ledger.sandboxes.get(id)
                && entry.desired != "deleted"
            {
                let mut next = ledger.clone();
                if let Some(e) = next.sandboxes.get_mut(id) {
                    e.desired = "deleted".into();
                    e.command_id = command_id.to_owned();
                }
                self.ledger_file.save(&next).map_err(|e| format!("disk: recording the delete: {e}"))?;
                *ledger = next;
            }
            // The runtime's removal without the ledger's lock: gVisor's `runsc delete` takes
            // seconds (1.6-2 s here), and with the lock held every exec, snapshot and volume
            // change on the node waited that long behind it (the sandbox bench's exec into a
            // claimed sandbox: 1.8 s against 29 ms for `runsc exec`). The entry, marked
            // `deleted`, keeps the sandbox from taking an exec or a second start meanwhile, its
            // volumes stay attached until it is gone, and a crash in between is finished at the
            // next start (`sweep`). Commands run one at a time, so no other apply of this
            // sandbox runs meanwhile.
            drop(ledger);
            self.remove(id).await?;
            let mut ledger = self.ledger.lock().await;
            let mut next = ledger.clone();
            if next.sandboxes.remove(id).is_some() {
                self.ledger_file.save(&next).map_err(|e| format!("disk: recording the delete: {e}"))?;
                *ledger = next;
            }
            tracing::info!(sandbox = %id, "sandbox deleted");
            return Ok("absent");
        }
        if let Some(entry) = ledger.sandboxes.get(id) {
            if entry.desired == "deleted" {
                return Err(format!("bad-args: sandbox {id} is being deleted on this node"));
            }
            // Redelivered: answered by what the runtime says.
            return match self.state(id).await? {
                Some(RuntimeState::Running) => Ok("running"),
                Some(RuntimeState::Stopped) => Ok("stopped"),
                None => Err(format!("runtime: sandbox {id} is recorded but not running")),
            };
        }
        if ledger.sandboxes.len() >= SANDBOXES_PER_NODE_MAX {
            return Err(format!("capacity: this node runs {SANDBOXES_PER_NODE_MAX} sandboxes, its most"));
        }
        let mut next = ledger.clone();
        next.sandboxes.insert(
            id.to_owned(),
            SandboxEntry {
                desired: "running".into(),
                command_id: command_id.to_owned(),
                image_sha256: args.image.sha256.clone(),
                volumes: args.volumes.iter().map(|m| m.volume_id.clone()).collect(),
            },
        );
        self.ledger_file.save(&next).map_err(|e| format!("disk: recording the sandbox: {e}"))?;
        *ledger = next;
        drop(ledger);
        match self.make(args).await {
            Ok(()) => {
                tracing::info!(sandbox = %id, "sandbox started");
                Ok("running")
            }
            Err(reason) => {
                // Nothing half made is left: the runtime's sandbox, its bundle, its entry.
                let _ = self.remove(id).await;
                let mut ledger = self.ledger.lock().await;
                let mut next = ledger.clone();
                next.sandboxes.remove(id);
                if self.ledger_file.save(&next).is_ok() {
                    *ledger = next;
                }
                tracing::info!(sandbox = %id, reason = %reason, "a sandbox did not start");
                Err(reason)
            }
        }
    }

    async fn make(&self, args: &SandboxArgs) -> Result<(), String> {
        let rootfs = self.rootfs(&args.image).await?;
        let mut volumes = Vec::with_capacity(args.volumes.len());
        for m in &args.volumes {
            volumes.push((self.volumes.source(&m.volume_id).await?, m));
        }
        let bundle = self.bundle_dir(&args.sandbox_id);
        // A restore's files are checked against the digest it names before anything starts.
        let image_dir = match &args.restore {
            Some(snapshot) => {
                let dir = crate::sandbox_snapshots::snapshots_dir(&self.dir).join(&snapshot.sha256);
                let check = {
                    let (dir, snapshot) = (dir.clone(), snapshot.clone());
                    move || crate::sandbox_snapshots::verify(&dir, &snapshot)
                };
                blocking(check).await??;
                Some(dir)
            }
            None => None,
        };
        let config = serde_json::to_vec_pretty(&oci_config(args, &rootfs, &volumes)).map_err(|e| format!("disk: {e}"))?;
        let write = {
            let bundle = bundle.clone();
            move || -> std::io::Result<()> {
                use std::os::unix::fs::DirBuilderExt as _;
                std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&bundle)?;
                // 0600: the environment in it may hold values of the tenant's secrets.
                use std::io::Write as _;
                use std::os::unix::fs::OpenOptionsExt as _;
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(bundle.join("config.json"))?;
                file.write_all(&config)
            }
        };
        blocking(write).await?.map_err(|e| format!("disk: {}: {e}", bundle.display()))?;
        let runtime = self.runtime.clone();
        let id = args.sandbox_id.clone();
        let started = blocking(move || match &image_dir {
            Some(image_dir) => runtime.restore(&id, &bundle, image_dir),
            None => runtime.start(&id, &bundle),
        });
        tokio::time::timeout(std::time::Duration::from_secs(SANDBOX_START_TIMEOUT_S), started)
            .await
            .map_err(|_| format!("runtime: the sandbox did not start within {SANDBOX_START_TIMEOUT_S} s"))??
    }

    /// The image's root file system, unpacked once per digest.
    async fn rootfs(&self, image: &ImageRef) -> Result<PathBuf, String> {
        let target = self.dir.join("rootfs").join(&image.sha256);
        if tokio::fs::try_exists(&target).await.unwrap_or(false) {
            return Ok(target);
        }
        let archive = self.images.fetch(image).await.map_err(|e| e.to_string())?;
        let parent = self.dir.join("rootfs");
        let unpack = {
            let target = target.clone();
            move || unpack_rootfs(&archive, &parent, &target)
        };
        blocking(unpack).await??;
        Ok(target)
    }

    pub(crate) async fn state(&self, id: &str) -> Result<Option<RuntimeState>, String> {
        let runtime = self.runtime.clone();
        let id = id.to_owned();
        blocking(move || runtime.state(&id)).await?
    }

    async fn remove(&self, id: &str) -> Result<(), String> {
        let runtime = self.runtime.clone();
        let owned = id.to_owned();
        blocking(move || runtime.remove(&owned)).await??;
        let bundle = self.bundle_dir(id);
        match tokio::fs::remove_dir_all(&bundle).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(format!("disk: {}: {e}", bundle.display())),
            _ => Ok(()),
        }
    }

    /// Carries out a `sandbox_volume.apply`: refused (`attached: …`) when it would grow or
    /// delete a volume a sandbox of this node mounts.
    pub async fn apply_volume(&self, command_id: &str, args: &crate::volumes::VolumeArgs) -> crate::volumes::Outcome {
        let ledger = self.ledger.lock().await;
        let attached_to = ledger.sandboxes.iter().find(|(_, e)| e.volumes.contains(&args.volume_id)).map(|(id, _)| id.clone());
        // Held while the volume changes: no sandbox mounting it starts meanwhile.
        self.volumes.apply(command_id, args, attached_to.as_deref()).await
    }

    /// Mounts the volumes again (a reboot unmounted them; [`crate::volumes::Volumes::recover`]),
    /// removes the runtime's sandboxes no ledger entry names, and finishes the deletes a crash
    /// interrupted (entries marked `deleted`). Returns the sandbox ids removed.
    pub async fn sweep(&self) -> Result<Vec<String>, String> {
        for (volume, why) in self.volumes.recover().await {
            tracing::warn!(volume = %volume, error = %why, "a volume could not be brought back");
        }
        let mut ledger = self.ledger.lock().await;
        let runtime = self.runtime.clone();
        let listed = blocking(move || runtime.list()).await??;
        let mut removed = Vec::new();
        for id in sweep_plan(&ledger, &listed) {
            self.remove(&id).await?;
            tracing::warn!(sandbox = %id, "a sandbox no record names was removed");
            removed.push(id);
        }
        let unfinished: Vec<String> =
            ledger.sandboxes.iter().filter(|(_, e)| e.desired == "deleted").map(|(id, _)| id.clone()).collect();
        for id in unfinished {
            self.remove(&id).await?;
            let mut next = ledger.clone();
            next.sandboxes.remove(&id);
            self.ledger_file.save(&next)?;
            *ledger = next;
            removed.push(id);
        }
        Ok(removed)
    }

    /// Runs `command` in sandbox `id` (running, and this node's), fed by the frames
    /// `from_gateway` gives (stdin, its close), its stdout and stderr sent to `to_gateway` and
    /// then its exit status. A refusal is a `Failure` status alone.
    pub async fn exec<S, B>(&self, id: &str, command: &[String], mut from_gateway: S, to_gateway: mpsc::Sender<Vec<u8>>)
    where
        S: Stream<Item = B> + Unpin,
        B: AsRef<[u8]>,
    {
        let broken = |message: String| Frame::Status(End::Broken { message, timeout: false }).encode();
        let known = self.ledger.lock().await.sandboxes.get(id).is_some_and(|e| e.desired == "running");
        let running = known && matches!(self.state(id).await, Ok(Some(RuntimeState::Running)));
        if !running {
            let _ = to_gateway.send(broken(format!("sandbox {id} is not running on this node"))).await;
            return;
        }
        if command.is_empty() {
            let _ = to_gateway.send(broken("no command to run".into())).await;
            return;
        }
        let mut child = match self.runtime.exec_command(id, command).spawn() {
            Ok(child) => child,
            Err(e) => {
                let _ = to_gateway.send(broken(format!("the node could not run the sandbox's runtime: {e}"))).await;
                return;
            }
        };
        let (Some(mut stdin), Some(stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take()) else {
            let _ = child.kill().await;
            let _ = to_gateway.send(broken("the command's pipes could not be opened".into())).await;
            return;
        };
        let out = tokio::spawn(pipe_out(stdout, wire::CHANNEL_STDOUT, to_gateway.clone()));
        let err = tokio::spawn(pipe_out(stderr, wire::CHANNEL_STDERR, to_gateway.clone()));
        let mut stdin_open = true;
        let status = loop {
            tokio::select! {
                waited = child.wait() => break Some(waited),
                frame = from_gateway.next(), if stdin_open => match frame.map(|b| Frame::decode(b.as_ref())) {
                    Some(Ok(Frame::Data { channel: wire::CHANNEL_STDIN, bytes })) => {
                        if stdin.write_all(&bytes).await.is_err() {
                            stdin_open = false;
                        }
                    }
                    Some(Ok(Frame::Close(wire::CHANNEL_STDIN))) => {
                        let _ = stdin.shutdown().await;
                        stdin_open = false;
                    }
                    Some(Ok(Frame::Resize(_))) | Some(Ok(Frame::Close(_))) => {}
                    Some(Ok(_)) | Some(Err(_)) | None => break None,
                },
            }
        };
        drop(stdin);
        let Some(waited) = status else {
            // The gateway's side ended: the command goes.
            let _ = child.kill().await;
            out.abort();
            err.abort();
            return;
        };
        let _ = out.await;
        let _ = err.await;
        let end = match waited {
            Ok(status) => End::Exited(status.code().and_then(|c| u8::try_from(c).ok()).unwrap_or(255)),
            Err(e) => End::Broken { message: format!("waiting for the command failed: {e}"), timeout: false },
        };
        let _ = to_gateway.send(Frame::Status(end).encode()).await;
    }
}

/// Sends what `reader` gives as `channel` frames until it ends.
async fn pipe_out<R: tokio::io::AsyncRead + Unpin>(mut reader: R, channel: u8, to_gateway: mpsc::Sender<Vec<u8>>) {
    let mut buf = vec![0u8; READ_CHUNK_BYTES];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                let frame = Frame::Data { channel, bytes: buf[..n].to_vec() }.encode();
                if to_gateway.send(frame).await.is_err() {
                    return;
                }
            }
        }
    }
}

pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    tokio::task::spawn_blocking(f).await.map_err(|e| format!("runtime: a blocking task failed: {e}"))
}

/// Unpacks the root file system `archive` (a tar, gzip or not) into `target`, through a fresh
/// directory beside it renamed whole when complete; entries that would leave it are refused
/// (the `tar` crate's `unpack_in`), and so is more than [`ROOTFS_BYTES_MAX`] or
/// [`ROOTFS_ENTRIES_MAX`].
pub fn unpack_rootfs(archive: &Path, parent: &Path, target: &Path) -> Result<(), String> {
    use std::io::Read as _;
    let rootfs = |e: String| format!("rootfs: {e}");
    std::fs::create_dir_all(parent).map_err(|e| format!("disk: {}: {e}", parent.display()))?;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let fresh = parent.join(format!(
        ".{}.{}-{}.partial",
        target.file_name().and_then(|n| n.to_str()).unwrap_or("rootfs"),
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let result = (|| -> Result<(), String> {
        std::fs::create_dir(&fresh).map_err(|e| format!("disk: {}: {e}", fresh.display()))?;
        let mut file = std::fs::File::open(archive).map_err(|e| format!("disk: {}: {e}", archive.display()))?;
        let mut magic = [0u8; 2];
        let gz = file.read(&mut magic).map_err(|e| format!("disk: {e}"))? == 2 && magic == [0x1f, 0x8b];
        let file = std::fs::File::open(archive).map_err(|e| format!("disk: {}: {e}", archive.display()))?;
        let reader: Box<dyn std::io::Read> = if gz { Box::new(flate2::read::GzDecoder::new(file)) } else { Box::new(file) };
        let mut tar = tar::Archive::new(reader);
        tar.set_preserve_permissions(true);
        tar.set_overwrite(false);
        let (mut bytes, mut count) = (0u64, 0u64);
        for entry in tar.entries().map_err(|e| rootfs(e.to_string()))? {
            let mut entry = entry.map_err(|e| rootfs(e.to_string()))?;
            count += 1;
            bytes = bytes.saturating_add(entry.header().size().unwrap_or(0));
            if count > ROOTFS_ENTRIES_MAX || bytes > ROOTFS_BYTES_MAX {
                return Err(rootfs(format!(
                    "the archive holds more than {ROOTFS_ENTRIES_MAX} entries or {ROOTFS_BYTES_MAX} bytes"
                )));
            }
            entry.unpack_in(&fresh).map_err(|e| rootfs(format!("unpacking: {e}")))?;
        }
        if !fresh.join("bin").join("sh").exists() && std::fs::symlink_metadata(fresh.join("bin/sh")).is_err() {
            return Err(rootfs("the root file system has no /bin/sh, which a sandbox's first process runs".into()));
        }
        for dir in ["proc", "tmp", "dev", "root"] {
            let _ = std::fs::create_dir(fresh.join(dir));
        }
        std::fs::rename(&fresh, target).map_err(|e| format!("disk: {}: {e}", target.display()))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&fresh);
    }
    result
}

/// A sandbox report's payload (`sandbox.observed`, `sandbox.apply_failed`), without the command
/// and node the runner adds.
pub fn report_payload(id: &str, outcome: &Outcome) -> (&'static str, Value) {
    match outcome {
        Ok(state) => ("sandbox.observed", json!({ "sandboxId": id, "state": state })),
        Err(reason) => {
            let mut reason = reason.clone();
            if reason.len() > REASON_BYTES_MAX {
                let mut end = REASON_BYTES_MAX;
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                reason.truncate(end);
            }
            ("sandbox.apply_failed", json!({ "sandboxId": id, "reason": reason }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(desired: &str) -> String {
        json!({
            "sandboxId": "sbx_01j00000000000000000000000", "desired": desired, "vcpus": 1, "memoryMiB": 64,
            "image": { "imageId": "img_01j00000000000000000000000", "url": "http://x/", "sha256": "a".repeat(64), "diskFormat": "rootfs-tar" },
            "env": { "X": "1" }, "network": "none",
        })
        .to_string()
    }

    #[test]
    fn args_are_checked_and_the_bundle_carries_the_limits_and_the_env() {
        let parsed = parse_args(&args("running")).unwrap();
        let config = oci_config(&parsed, Path::new("/r"), &[]);
        assert_eq!(config["linux"]["resources"]["memory"]["limit"], json!(64 * 1024 * 1024));
        assert_eq!(config["linux"]["resources"]["pids"]["limit"], json!(SANDBOX_PIDS_MAX));
        assert!(config["process"]["env"].as_array().unwrap().contains(&json!("X=1")));
        assert_eq!(parse_args(&args("paused")).unwrap_err().0.as_deref(), Some("sbx_01j00000000000000000000000"));
        assert!(parse_args(&args("running").replace("\"none\"", "\"egress\"")).unwrap_err().1.contains("network none"));
        assert!(parse_args("{}").unwrap_err().0.is_none());
    }

    #[test]
    fn a_sweep_removes_only_what_no_entry_names() {
        let mut ledger = SandboxLedger::default();
        ledger.sandboxes.insert(
            "sbx_a".into(),
            SandboxEntry {
                desired: "running".into(),
                command_id: "cmd_1".into(),
                image_sha256: String::new(),
                volumes: Vec::new(),
            },
        );
        assert_eq!(sweep_plan(&ledger, &["sbx_a".into(), "sbx_b".into()]), vec!["sbx_b".to_owned()]);
    }
}
