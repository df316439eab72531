//! Sandbox volumes on this node: each an ext4 file system in a sparse disk image file
//! (`<data_dir>/volumes/<vol_…>.img`), loop-mounted at `<data_dir>/volumes/mnt/<vol_…>`, where a
//! sandbox's runtime bind-mounts it ([`crate::sandboxes`]). Recorded in a ledger
//! (`volumes.json`) before the machine is touched, so a restart finds every volume again
//! ([`Volumes::recover`] mounts the ready ones and finishes, or redoes, what a crash
//! interrupted: an entry is `creating` or `growing` while `mkfs.ext4` or `resize2fs` runs, and
//! `ready` only once the work is done; [`recovery`] decides what each entry needs).
//!
//! What to do is decided here without IO ([`parse_args`], [`step`]); the disk images, the file
//! systems and the mounts are touched only through a [`VolumeDisk`] ([`LoopExt4`]: `mkfs.ext4`,
//! `mount -o loop`, `umount`, `e2fsck`, `resize2fs`).
//!
//! A volume grows only while no sandbox mounts it (the control plane refuses a resize of an
//! attached volume, and so does this node): the file system is unmounted, the file grown, the
//! file system checked and grown offline, and mounted again. A delete unmounts it and removes
//! the file: its data is gone. Errors carry stable codes: `bad-args`, `disk`, `attached`,
//! `capacity`, `volume`, `no-volumes`.
//!
//! A node advertises [`CAPABILITY_SANDBOX_VOLUMES`] only when [`LoopExt4::probe`] (run once at
//! start, where the runtime is probed) finds `mkfs.ext4` and usable loop devices; without it,
//! it makes and grows none ([`step_on_node`]) and the control plane sends it none to make.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The command kind this module carries out.
pub const SANDBOX_VOLUME_APPLY: &str = "sandbox_volume.apply";
/// The capability a node says when it can make volumes ([`LoopExt4::probe`] found what they
/// need); the control plane places volumes only on such nodes.
pub const CAPABILITY_SANDBOX_VOLUMES: &str = "sandbox-volume.ext4";
/// The loop devices' control: a volume is loop-mounted, so a node that cannot open it keeps none.
const LOOP_CONTROL: &str = "/dev/loop-control";
/// The most volumes one node keeps.
pub const VOLUMES_PER_NODE_MAX: usize = 64;
/// The largest volume, in GiB (as the control plane bounds it).
pub const VOLUME_SIZE_MAX_GIB: u64 = 16 * 1024;
const GIB: u64 = 1024 * 1024 * 1024;
/// The longest reason a report carries.
const REASON_BYTES_MAX: usize = 1024;

/// What a `sandbox_volume.apply` asks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeArgs {
    pub volume_id: String,
    /// `ready` (at `size_gib`) or `deleted`.
    pub desired: String,
    #[serde(rename = "sizeGiB")]
    pub size_gib: u64,
}

/// One volume the ledger holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeEntry {
    /// `creating` (recorded, its file system not yet made), `growing` (recorded, not yet grown
    /// from `from_gib`), `ready` (the work done) or `deleted` (a delete begun).
    pub desired: String,
    /// The size it was made or grown to, or is being made or grown to.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u64,
    pub command_id: String,
    /// While `growing`: the size it had, which it keeps if the growth fails.
    #[serde(default, rename = "fromGiB", skip_serializing_if = "Option::is_none")]
    pub from_gib: Option<u64>,
}

/// What a ledger entry found at start needs ([`Volumes::recover`]; pure).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// It is made: mount it again (a reboot unmounted it).
    Mount,
    /// A crash came between the record and the file system's being made (or mounted): make it
    /// again from nothing (no sandbox mounts a volume before it is `ready`, so nothing was
    /// written to it), then `ready`.
    Create { size_gib: u64 },
    /// A crash came between the record and the growth's end: grow it again (a file already
    /// long enough stays; `resize2fs` of a file system that fills its file changes nothing),
    /// then `ready` at `to_gib`.
    Grow { from_gib: u64, to_gib: u64 },
    /// A delete begun: finish it.
    Delete,
}

/// Decides what `entry` needs after a start.
pub fn recovery(entry: &VolumeEntry) -> Recovery {
    match entry.desired.as_str() {
        "deleted" => Recovery::Delete,
        "creating" => Recovery::Create { size_gib: entry.size_gib },
        "growing" => Recovery::Grow { from_gib: entry.from_gib.unwrap_or(entry.size_gib), to_gib: entry.size_gib },
        _ => Recovery::Mount,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeLedger {
    pub volumes: BTreeMap<String, VolumeEntry>,
}

impl crate::ledger::LedgerContents for VolumeLedger {
    const FILE: &'static str = "volumes.json";
}

pub type VolumeLedgerFile = crate::ledger::LedgerFile<VolumeLedger>;

/// Reads and checks a `sandbox_volume.apply`'s arguments. `Err((volume id if read, reason))`.
pub fn parse_args(args_json: &str) -> Result<VolumeArgs, (Option<String>, String)> {
    let (id, args): (String, VolumeArgs) =
        crate::ledger::subject_args::<_, bc_core::id::SandboxVolumeId>(args_json, "volumeId", "a volume id")?;
    if !matches!(args.desired.as_str(), "ready" | "deleted") {
        return Err((
            Some(id),
            format!("bad-args: desired {:?} is not ready or deleted", bc_core::id::truncate(&args.desired, 20)),
        ));
    }
    if args.size_gib == 0 || args.size_gib > VOLUME_SIZE_MAX_GIB {
        return Err((Some(id), format!("bad-args: sizeGiB {} is outside 1 to {VOLUME_SIZE_MAX_GIB}", args.size_gib)));
    }
    Ok(args)
}

/// What an apply comes to on this node (pure: the ledger's entry, the ask, whether a sandbox
/// mounts it, how many volumes the node keeps).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Make it: record, then a sparse file, `mkfs.ext4`, mounted.
    Create { size_gib: u64 },
    /// Grow it from `from_gib`: record, then the file and the file system.
    Grow { from_gib: u64, to_gib: u64 },
    /// It already is what was asked (a redelivery): make sure it is mounted and say so.
    Ready { size_gib: u64 },
    /// Remove it (it is, or was being, deleted): record, unmount, remove the file.
    Delete,
    /// Refused, with the reason.
    Refuse(String),
}

/// Decides an apply. An entry still `creating` or `growing` (its recovery failed) is made or
/// grown again.
pub fn step(entry: Option<&VolumeEntry>, args: &VolumeArgs, attached_to: Option<&str>, volumes: usize) -> Step {
    let id = &args.volume_id;
    match (args.desired.as_str(), entry) {
        ("deleted", _) => match attached_to {
            Some(sandbox) => Step::Refuse(format!("attached: volume {id} is mounted in sandbox {sandbox} on this node")),
            None => Step::Delete,
        },
        (_, Some(e)) if e.desired == "deleted" => Step::Refuse(format!("bad-args: volume {id} is being deleted on this node")),
        (_, Some(e)) if e.desired == "creating" => Step::Create { size_gib: args.size_gib },
        (_, Some(e)) if e.desired == "growing" && args.size_gib >= e.size_gib && attached_to.is_none() => {
            Step::Grow { from_gib: e.from_gib.unwrap_or(e.size_gib), to_gib: args.size_gib }
        }
        (_, None) if volumes >= VOLUMES_PER_NODE_MAX => {
            Step::Refuse(format!("capacity: this node keeps {VOLUMES_PER_NODE_MAX} volumes, its most"))
        }
        (_, None) => Step::Create { size_gib: args.size_gib },
        (_, Some(e)) if args.size_gib < e.size_gib => {
            Step::Refuse(format!("bad-args: volume {id} is {} GiB; volumes only grow", e.size_gib))
        }
        (_, Some(e)) if args.size_gib == e.size_gib => Step::Ready { size_gib: e.size_gib },
        (_, Some(_)) if attached_to.is_some() => Step::Refuse(format!(
            "attached: volume {id} is mounted in sandbox {}; it grows only while no sandbox mounts it",
            attached_to.unwrap_or_default()
        )),
        (_, Some(e)) => Step::Grow { from_gib: e.size_gib, to_gib: args.size_gib },
    }
}

/// `step` on a node that cannot make volumes (`unusable`: why, from [`LoopExt4::probe`]): what
/// would make or grow a file system is refused (`no-volumes: …`); what keeps, mounts or deletes
/// one that exists is left as it is.
pub fn step_on_node(step: Step, unusable: Option<&str>) -> Step {
    match (step, unusable) {
        (Step::Create { .. } | Step::Grow { .. }, Some(why)) => {
            Step::Refuse(format!("no-volumes: this node makes no volumes: {why}"))
        }
        (step, _) => step,
    }
}

/// The disk images, file systems and mounts of volumes: the only place this module touches the
/// machine. Its calls block (they run processes); callers run them on the blocking pool.
pub trait VolumeDisk: Send + Sync + 'static {
    /// A sparse file of `size_gib` at `image` with an empty ext4 file system in it (replacing
    /// what a crash left half made).
    fn create(&self, image: &Path, size_gib: u64) -> Result<(), String>;
    /// Grows the file at `image` to `size_gib` and its file system to fill it; it is unmounted.
    fn grow(&self, image: &Path, size_gib: u64) -> Result<(), String>;
    /// Loop-mounts `image` at `mount` (made if missing), unless it is mounted there already.
    fn mount(&self, image: &Path, mount: &Path) -> Result<(), String>;
    /// Unmounts `mount` if something is mounted there.
    fn unmount(&self, mount: &Path) -> Result<(), String>;
    /// Removes the file and the mount point; what is not there is not an error.
    fn remove(&self, image: &Path, mount: &Path) -> Result<(), String>;
}

/// ext4 in a sparse file, loop-mounted: `mkfs.ext4`, `mount -o loop`, `umount`, `e2fsck`,
/// `resize2fs` (Debian's e2fsprogs and mount).
pub struct LoopExt4;

impl LoopExt4 {
    /// Whether this node can make volumes: `mkfs.ext4` runs (Debian's e2fsprogs, which brings
    /// `e2fsck` and `resize2fs` with it) and [`LOOP_CONTROL`] opens for reading and writing (the
    /// loop module is there and `bcd` may attach loop devices); then the size in bytes of the file
    /// system that holds `dir`, the volumes' directory (made if missing), which the node reports
    /// so the control plane bounds the volumes' sizes by it. `Err(why)` otherwise. Run once at
    /// start, beside the runtime's probe; what it finds is [`CAPABILITY_SANDBOX_VOLUMES`] or not.
    pub fn probe(dir: &Path) -> Result<u64, String> {
        let mkfs = std::process::Command::new("mkfs.ext4")
            .arg("-V")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !mkfs.is_ok_and(|s| s.success()) {
            return Err("mkfs.ext4 does not run (hint: install Debian's package e2fsprogs)".into());
        }
        std::fs::OpenOptions::new().read(true).write(true).open(LOOP_CONTROL).map_err(|e| {
            format!("loop devices are not usable: {LOOP_CONTROL}: {e} (hint: modprobe loop, and run bcd as root)")
        })?;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let fs = rustix::fs::statvfs(dir).map_err(|e| format!("the file system of {}: {e}", dir.display()))?;
        Ok(fs.f_blocks.saturating_mul(fs.f_frsize))
    }

    fn run(program: &str, args: &[&std::ffi::OsStr]) -> Result<(), String> {
        let output = std::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| format!("disk: running {program}: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            let stderr = String::from_utf8_lossy(&output.stderr);
            Err(format!("disk: {program} failed ({}): {}", output.status, bc_core::id::truncate(stderr.trim(), 400)))
        }
    }

    /// Whether something is mounted at `mount` (`/proc/self/mountinfo`'s fifth field).
    fn is_mounted(mount: &Path) -> Result<bool, String> {
        let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| format!("disk: /proc/self/mountinfo: {e}"))?;
        let want = mount.to_string_lossy();
        Ok(info.lines().any(|l| l.split(' ').nth(4).is_some_and(|p| unescape_mountinfo(p) == want)))
    }
}

/// A mountinfo path with its octal escapes (`\040` for a space) undone.
fn unescape_mountinfo(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        if bytes[i] == b'\\'
            && let Some(digits) = octal
        {
            out.push(digits.iter().fold(0u8, |n, d| n.wrapping_mul(8).wrapping_add(d - b'0')));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl VolumeDisk for LoopExt4 {
    fn create(&self, image: &Path, size_gib: u64) -> Result<(), String> {
        if let Some(dir) = image.parent() {
            std::fs::create_dir_all(dir).map_err(|e| format!("disk: {}: {e}", dir.display()))?;
        }
        {
            use std::os::unix::fs::OpenOptionsExt as _;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(image)
                .map_err(|e| format!("disk: {}: {e}", image.display()))?;
            file.set_len(size_gib * GIB).map_err(|e| format!("disk: sizing {}: {e}", image.display()))?;
        }
        // No blocks reserved for root: a sandbox's processes run as root, and the volume is
        // theirs whole.
        Self::run("mkfs.ext4", &["-F".as_ref(), "-q".as_ref(), "-m".as_ref(), "0".as_ref(), image.as_os_str()])
    }

    fn grow(&self, image: &Path, size_gib: u64) -> Result<(), String> {
        let file = std::fs::OpenOptions::new().write(true).open(image).map_err(|e| format!("disk: {}: {e}", image.display()))?;
        let len = file.metadata().map_err(|e| format!("disk: {}: {e}", image.display()))?.len();
        if len < size_gib * GIB {
            file.set_len(size_gib * GIB).map_err(|e| format!("disk: growing {}: {e}", image.display()))?;
        }
        drop(file);
        // resize2fs wants a file system checked since it was last mounted.
        Self::run("e2fsck", &["-f".as_ref(), "-p".as_ref(), image.as_os_str()])?;
        Self::run("resize2fs", &[image.as_os_str()])
    }

    fn mount(&self, image: &Path, mount: &Path) -> Result<(), String> {
        std::fs::create_dir_all(mount).map_err(|e| format!("disk: {}: {e}", mount.display()))?;
        if Self::is_mounted(mount)? {
            return Ok(());
        }
        Self::run("mount", &["-o".as_ref(), "loop,nosuid,nodev".as_ref(), image.as_os_str(), mount.as_os_str()])
    }

    fn unmount(&self, mount: &Path) -> Result<(), String> {
        if !Self::is_mounted(mount)? {
            return Ok(());
        }
        Self::run("umount", &[mount.as_os_str()])
    }

    fn remove(&self, image: &Path, mount: &Path) -> Result<(), String> {
        for result in [std::fs::remove_file(image), std::fs::remove_dir(mount)] {
            if let Err(e) = result
                && e.kind() != std::io::ErrorKind::NotFound
            {
                return Err(format!("disk: removing a volume: {e}"));
            }
        }
        Ok(())
    }
}

/// What an apply comes to: the volume's state and size afterwards, or why not.
pub type Outcome = Result<(&'static str, u64), String>;

/// The node's volumes: the ledger and the disk.
pub struct Volumes {
    dir: PathBuf,
    pub ledger: tokio::sync::Mutex<VolumeLedger>,
    ledger_file: VolumeLedgerFile,
    pub disk: Arc<dyn VolumeDisk>,
    /// Why this node cannot make volumes ([`LoopExt4::probe`]), if it cannot: it then advertises
    /// no [`CAPABILITY_SANDBOX_VOLUMES`] and refuses to make or grow one ([`step_on_node`]).
    pub unusable: Option<String>,
    /// The size in bytes of the file system under [`Self::dir`] ([`LoopExt4::probe`]), reported
    /// in the inventory (`volumeFileSystemBytes`): what the control plane bounds the sum of this
    /// node's volumes' sizes by (the images are sparse, so nothing here would).
    pub file_system_bytes: Option<u64>,
    /// Test-only (`[hardware] fake_volume_crash`, `fakehw` builds): `bcd` kills itself
    /// (SIGKILL) right after recording a volume `creating` (`create`) or `growing` (`grow`), before
    /// the disk work, so a test shows what [`Self::recover`] makes of it.
    pub crash_after_record: Option<String>,
}

impl Volumes {
    pub fn new(data_dir: &Path, disk: Arc<dyn VolumeDisk>) -> Result<Self, String> {
        let ledger_file = VolumeLedgerFile::new(data_dir);
        let ledger = ledger_file.load()?;
        Ok(Self {
            dir: data_dir.join("volumes"),
            ledger: tokio::sync::Mutex::new(ledger),
            ledger_file,
            disk,
            unusable: None,
            file_system_bytes: None,
            crash_after_record: None,
        })
    }

    /// Where the images are: what [`LoopExt4::probe`] measures.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn image(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.img"))
    }

    /// Where the volume is mounted on the node: what a sandbox bind-mounts.
    pub fn mount_point(&self, id: &str) -> PathBuf {
        self.dir.join("mnt").join(id)
    }

    async fn disk<T: Send + 'static>(&self, f: impl FnOnce(&dyn VolumeDisk) -> T + Send + 'static) -> Result<T, String> {
        let disk = self.disk.clone();
        tokio::task::spawn_blocking(move || f(&*disk)).await.map_err(|e| format!("disk: a blocking task failed: {e}"))
    }

    fn save(&self, ledger: &mut VolumeLedger, next: VolumeLedger) -> Result<(), String> {
        self.ledger_file.save(&next).map_err(|e| format!("disk: recording the volume: {e}"))?;
        *ledger = next;
        Ok(())
    }

    /// Carries out an apply: the ledger first, then the disk. `attached_to`: the sandbox of this
    /// node that mounts it, if one does.
    pub async fn apply(&self, command_id: &str, args: &VolumeArgs, attached_to: Option<&str>) -> Outcome {
        let id = args.volume_id.clone();
        let mut ledger = self.ledger.lock().await;
        let (image, mount) = (self.image(&id), self.mount_point(&id));
        let record = |ledger: &VolumeLedger, desired: &str, size_gib: u64, from_gib: Option<u64>| {
            let mut next = ledger.clone();
            next.volumes.insert(
                id.clone(),
                VolumeEntry { desired: desired.to_owned(), size_gib, command_id: command_id.to_owned(), from_gib },
            );
            next
        };
        match step_on_node(step(ledger.volumes.get(&id), args, attached_to, ledger.volumes.len()), self.unusable.as_deref()) {
            Step::Refuse(reason) => Err(reason),
            Step::Ready { size_gib } => {
                self.disk(move |d| d.mount(&image, &mount)).await??;
                Ok(("ready", size_gib))
            }
            Step::Create { size_gib } => {
                let next = record(&ledger, "creating", size_gib, None);
                self.save(&mut ledger, next)?;
                self.crash_point("create");
                self.finish_create(&mut ledger, &id, size_gib).await?;
                tracing::info!(volume = %id, size_gib, "volume made");
                Ok(("ready", size_gib))
            }
            Step::Grow { from_gib, to_gib } => {
                let next = record(&ledger, "growing", to_gib, Some(from_gib));
                self.save(&mut ledger, next)?;
                self.crash_point("grow");
                self.finish_grow(&mut ledger, &id, from_gib, to_gib).await?;
                tracing::info!(volume = %id, from_gib, to_gib, "volume grown");
                Ok(("ready", to_gib))
            }
            Step::Delete => {
                if ledger.volumes.get(&id).is_some_and(|e| e.desired != "deleted") {
                    let size = ledger.volumes.get(&id).map_or(args.size_gib, |e| e.size_gib);
                    let next = record(&ledger, "deleted", size, None);
                    self.save(&mut ledger, next)?;
                }
                self.disk(move |d| d.unmount(&mount).and_then(|()| d.remove(&image, &mount))).await??;
                let mut next = ledger.clone();
                if next.volumes.remove(&id).is_some() {
                    self.save(&mut ledger, next)?;
                }
                tracing::info!(volume = %id, "volume deleted");
                Ok(("absent", args.size_gib))
            }
        }
    }

    /// Test-only: dies here when [`Self::crash_after_record`] names `phase`.
    fn crash_point(&self, phase: &str) {
        if self.crash_after_record.as_deref() == Some(phase) {
            tracing::warn!(phase, "fake_volume_crash: killing bcd after the volume's record, before its disk work");
            let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
            std::process::abort();
        }
    }

    /// Sets `id`'s entry to `desired` at `size_gib` (its command kept).
    fn mark(&self, ledger: &mut VolumeLedger, id: &str, desired: &str, size_gib: u64) -> Result<(), String> {
        let mut next = ledger.clone();
        if let Some(entry) = next.volumes.get_mut(id) {
            entry.desired = desired.to_owned();
            entry.size_gib = size_gib;
            entry.from_gib = None;
        }
        self.save(ledger, next)
    }

    /// Makes the file system of `id`, recorded `creating`, mounts it and records it `ready`; on
    /// failure leaves nothing half made (the mount, the file, the entry).
    async fn finish_create(&self, ledger: &mut VolumeLedger, id: &str, size_gib: u64) -> Result<(), String> {
        let (image, mount) = (self.image(id), self.mount_point(id));
        let made = {
            let (image, mount) = (image.clone(), mount.clone());
            self.disk(move |d| d.create(&image, size_gib).and_then(|()| d.mount(&image, &mount))).await?
        };
        if let Err(reason) = made {
            let _ = self.disk(move |d| d.unmount(&mount).and_then(|()| d.remove(&image, &mount))).await;
            let mut next = ledger.clone();
            next.volumes.remove(id);
            let _ = self.save(ledger, next);
            return Err(reason);
        }
        self.mark(ledger, id, "ready", size_gib)
    }

    /// Grows `id`, recorded `growing`, from `from_gib` to `to_gib` (unmounted, the file, the file
    /// system, mounted again whatever the growth did) and records it `ready` at the size it has.
    async fn finish_grow(&self, ledger: &mut VolumeLedger, id: &str, from_gib: u64, to_gib: u64) -> Result<(), String> {
        let (image, mount) = (self.image(id), self.mount_point(id));
        let grown = self
            .disk(move |d| {
                d.unmount(&mount)?;
                let grown = d.grow(&image, to_gib);
                // Mounted again whatever the grow did: the data stays reachable.
                let mounted = d.mount(&image, &mount);
                grown.and(mounted)
            })
            .await?;
        if let Err(reason) = grown {
            let _ = self.mark(ledger, id, "ready", from_gib);
            return Err(reason);
        }
        self.mark(ledger, id, "ready", to_gib)
    }

    /// The mount point of a ready volume of this node for a sandbox to bind-mount (mounted again
    /// if a reboot unmounted it); a volume this node does not keep is refused (`volume: …`).
    pub async fn source(&self, id: &str) -> Result<PathBuf, String> {
        let ledger = self.ledger.lock().await;
        if ledger.volumes.get(id).is_none_or(|e| e.desired != "ready") {
            return Err(format!("volume: volume {id} is not on this node"));
        }
        let (image, mount) = (self.image(id), self.mount_point(id));
        let target = mount.clone();
        self.disk(move |d| d.mount(&image, &mount)).await??;
        Ok(target)
    }

    /// After a start: mounts every ready volume again (a reboot unmounted them), makes or grows
    /// again those a crash left `creating` or `growing`, and finishes the deletes a crash
    /// interrupted ([`recovery`]). Returns the ids of the volumes it could not bring back, with
    /// why (one left `creating` is then gone from the ledger; one left `growing` is `ready` at the
    /// size it had).
    pub async fn recover(&self) -> Vec<(String, String)> {
        let mut ledger = self.ledger.lock().await;
        let mut failed = Vec::new();
        for (id, entry) in ledger.volumes.clone() {
            let (image, mount) = (self.image(&id), self.mount_point(&id));
            let done = match recovery(&entry) {
                Recovery::Mount => self.disk(move |d| d.mount(&image, &mount)).await.and_then(|r| r),
                Recovery::Create { size_gib } => {
                    let made = self.finish_create(&mut ledger, &id, size_gib).await;
                    if made.is_ok() {
                        tracing::warn!(volume = %id, size_gib, "a volume a crash left half made was made again");
                    }
                    made
                }
                Recovery::Grow { from_gib, to_gib } => {
                    let grown = self.finish_grow(&mut ledger, &id, from_gib, to_gib).await;
                    if grown.is_ok() {
                        tracing::warn!(volume = %id, from_gib, to_gib, "a volume a crash left half grown was grown again");
                    }
                    grown
                }
                Recovery::Delete => {
                    let removed =
                        self.disk(move |d| d.unmount(&mount).and_then(|()| d.remove(&image, &mount))).await.and_then(|r| r);
                    removed.and_then(|()| {
                        let mut next = ledger.clone();
                        next.volumes.remove(&id);
                        self.save(&mut ledger, next)
                    })
                }
            };
            if let Err(e) = done {
                failed.push((id, e));
            }
        }
        failed
    }
}

/// A volume report's payload (`sandbox_volume.observed`, `sandbox_volume.apply_failed`), without
/// the command and node the runner adds.
pub fn report_payload(id: &str, outcome: &Outcome) -> (&'static str, Value) {
    match outcome {
        Ok((state, size_gib)) if *state == "ready" => {
            ("sandbox_volume.observed", json!({ "volumeId": id, "state": state, "sizeGiB": size_gib }))
        }
        Ok((state, _)) => ("sandbox_volume.observed", json!({ "volumeId": id, "state": state })),
        Err(reason) => {
            let mut reason = reason.clone();
            if reason.len() > REASON_BYTES_MAX {
                let mut end = REASON_BYTES_MAX;
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                reason.truncate(end);
            }
            ("sandbox_volume.apply_failed", json!({ "volumeId": id, "reason": reason }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "vol_01j00000000000000000000000";

    fn args(desired: &str, size: u64) -> VolumeArgs {
        VolumeArgs { volume_id: ID.into(), desired: desired.into(), size_gib: size }
    }

    fn entry(desired: &str, size: u64) -> VolumeEntry {
        VolumeEntry { desired: desired.into(), size_gib: size, command_id: "cmd_1".into(), from_gib: None }
    }

    fn growing(from: u64, to: u64) -> VolumeEntry {
        VolumeEntry { from_gib: Some(from), ..entry("growing", to) }
    }

    #[test]
    fn a_start_finishes_or_redoes_what_a_crash_interrupted() {
        assert_eq!(recovery(&entry("ready", 2)), Recovery::Mount);
        assert_eq!(recovery(&entry("creating", 2)), Recovery::Create { size_gib: 2 });
        assert_eq!(recovery(&growing(2, 5)), Recovery::Grow { from_gib: 2, to_gib: 5 });
        assert_eq!(recovery(&entry("deleted", 2)), Recovery::Delete);
        // A ledger written before these states (no fromGiB) reads as it did.
        let old: VolumeEntry = serde_json::from_value(json!({ "desired": "ready", "sizeGiB": 3, "commandId": "cmd_1" })).unwrap();
        assert_eq!((old.from_gib, recovery(&old)), (None, Recovery::Mount));
        assert!(!serde_json::to_string(&entry("ready", 1)).unwrap().contains("fromGiB"));
        // An entry left half done (its recovery failed) is made or grown again by the next apply.
        assert_eq!(step(Some(&entry("creating", 2)), &args("ready", 2), None, 1), Step::Create { size_gib: 2 });
        assert_eq!(step(Some(&growing(2, 5)), &args("ready", 5), None, 1), Step::Grow { from_gib: 2, to_gib: 5 });
        assert!(matches!(step(Some(&growing(2, 5)), &args("ready", 3), None, 1), Step::Refuse(r) if r.contains("only grow")));
    }

    #[test]
    fn args_are_checked() {
        let parsed = parse_args(&json!({ "volumeId": ID, "desired": "ready", "sizeGiB": 2 }).to_string()).unwrap();
        assert_eq!(parsed, args("ready", 2));
        let err = parse_args(&json!({ "volumeId": ID, "desired": "ready", "sizeGiB": 0 }).to_string()).unwrap_err();
        assert_eq!(err.0.as_deref(), Some(ID));
        assert!(parse_args(&json!({ "volumeId": ID, "desired": "mounted", "sizeGiB": 1 }).to_string()).is_err());
        assert!(
            parse_args(&json!({ "volumeId": "sbx_01j00000000000000000000000", "desired": "ready", "sizeGiB": 1 }).to_string())
                .unwrap_err()
                .0
                .is_none()
        );
    }

    #[test]
    fn an_apply_makes_grows_keeps_or_deletes_and_never_under_a_sandbox() {
        assert_eq!(step(None, &args("ready", 2), None, 0), Step::Create { size_gib: 2 });
        assert_eq!(step(Some(&entry("ready", 2)), &args("ready", 2), None, 1), Step::Ready { size_gib: 2 });
        assert_eq!(step(Some(&entry("ready", 2)), &args("ready", 3), None, 1), Step::Grow { from_gib: 2, to_gib: 3 });
        assert!(matches!(step(Some(&entry("ready", 3)), &args("ready", 2), None, 1), Step::Refuse(r) if r.contains("only grow")));
        assert!(
            matches!(step(Some(&entry("ready", 2)), &args("ready", 3), Some("sbx_a"), 1), Step::Refuse(r) if r.starts_with("attached:"))
        );
        assert!(
            matches!(step(Some(&entry("ready", 2)), &args("deleted", 2), Some("sbx_a"), 1), Step::Refuse(r) if r.starts_with("attached:"))
        );
        assert_eq!(step(Some(&entry("ready", 2)), &args("deleted", 2), None, 1), Step::Delete);
        assert_eq!(step(None, &args("deleted", 2), None, 0), Step::Delete, "deleting what is gone is done");
        assert!(matches!(step(Some(&entry("deleted", 2)), &args("ready", 2), None, 1), Step::Refuse(_)));
        assert!(
            matches!(step(None, &args("ready", 2), None, VOLUMES_PER_NODE_MAX), Step::Refuse(r) if r.starts_with("capacity:"))
        );
    }

    #[test]
    fn a_node_that_cannot_make_volumes_makes_and_grows_none_but_deletes() {
        let why = Some("mkfs.ext4 does not run");
        let refused = step_on_node(step(None, &args("ready", 2), None, 0), why);
        assert!(matches!(&refused, Step::Refuse(r) if r.starts_with("no-volumes:") && r.contains("mkfs.ext4")), "{refused:?}");
        let grow = step(Some(&entry("ready", 2)), &args("ready", 3), None, 1);
        assert!(matches!(step_on_node(grow.clone(), why), Step::Refuse(_)));
        assert_eq!(step_on_node(grow, None), Step::Grow { from_gib: 2, to_gib: 3 });
        let delete = step(Some(&entry("ready", 2)), &args("deleted", 2), None, 1);
        assert_eq!(step_on_node(delete, why), Step::Delete);
        assert_eq!(step_on_node(step(Some(&entry("ready", 2)), &args("ready", 2), None, 1), why), Step::Ready { size_gib: 2 });
    }

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain/path"), "/plain/path");
    }

    /// A disk that records what it was asked, for the ledger's order.
    #[derive(Default)]
    struct Recorder(std::sync::Mutex<Vec<String>>, std::sync::atomic::AtomicBool);

    impl VolumeDisk for Arc<Recorder> {
        fn create(&self, _: &Path, size: u64) -> Result<(), String> {
            self.0.lock().unwrap().push(format!("create {size}"));
            if self.1.load(std::sync::atomic::Ordering::SeqCst) { Err("disk: full".into()) } else { Ok(()) }
        }
        fn grow(&self, _: &Path, size: u64) -> Result<(), String> {
            self.0.lock().unwrap().push(format!("grow {size}"));
            if self.1.load(std::sync::atomic::Ordering::SeqCst) { Err("disk: full".into()) } else { Ok(()) }
        }
        fn mount(&self, _: &Path, _: &Path) -> Result<(), String> {
            self.0.lock().unwrap().push("mount".into());
            Ok(())
        }
        fn unmount(&self, _: &Path) -> Result<(), String> {
            self.0.lock().unwrap().push("unmount".into());
            Ok(())
        }
        fn remove(&self, _: &Path, _: &Path) -> Result<(), String> {
            self.0.lock().unwrap().push("remove".into());
            Ok(())
        }
    }

    #[tokio::test]
    async fn the_ledger_is_written_first_and_a_failed_creation_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let recorder = Arc::new(Recorder::default());
        let volumes = Volumes::new(dir.path(), Arc::new(recorder.clone())).unwrap();
        assert_eq!(volumes.apply("cmd_1", &args("ready", 1), None).await, Ok(("ready", 1)));
        assert_eq!(VolumeLedgerFile::new(dir.path()).load().unwrap().volumes[ID].size_gib, 1);
        assert_eq!(volumes.apply("cmd_2", &args("ready", 3), None).await, Ok(("ready", 3)));
        assert_eq!(volumes.apply("cmd_3", &args("deleted", 3), None).await, Ok(("absent", 3)));
        assert!(VolumeLedgerFile::new(dir.path()).load().unwrap().volumes.is_empty());
        assert_eq!(*recorder.0.lock().unwrap(), ["create 1", "mount", "unmount", "grow 3", "mount", "unmount", "remove"]);

        recorder.1.store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(volumes.apply("cmd_4", &args("ready", 1), None).await, Err("disk: full".into()));
        assert!(VolumeLedgerFile::new(dir.path()).load().unwrap().volumes.is_empty(), "no entry of a volume not made");
    }

    #[tokio::test]
    async fn a_crash_between_the_record_and_the_disk_is_repaired_at_start() {
        const OTHER: &str = "vol_01j00000000000000000000001";
        let dir = tempfile::tempdir().unwrap();
        // What a crash right after each record leaves: one volume `creating`, one `growing`.
        let mut crashed = VolumeLedger::default();
        crashed.volumes.insert(ID.into(), entry("creating", 2));
        crashed.volumes.insert(OTHER.into(), growing(1, 4));
        VolumeLedgerFile::new(dir.path()).save(&crashed).unwrap();
        let recorder = Arc::new(Recorder::default());
        let volumes = Volumes::new(dir.path(), Arc::new(recorder.clone())).unwrap();
        assert_eq!(volumes.recover().await, []);
        assert_eq!(*recorder.0.lock().unwrap(), ["create 2", "mount", "unmount", "grow 4", "mount"]);
        let after = VolumeLedgerFile::new(dir.path()).load().unwrap();
        assert_eq!((after.volumes[ID].desired.as_str(), after.volumes[ID].size_gib), ("ready", 2));
        assert_eq!(after.volumes[OTHER], entry("ready", 4));
        // The redelivered commands find them done.
        assert_eq!(volumes.apply("cmd_1", &args("ready", 2), None).await, Ok(("ready", 2)));

        // A recovery that cannot make the file system leaves nothing; one that cannot grow it
        // leaves it ready at the size it had.
        VolumeLedgerFile::new(dir.path()).save(&crashed).unwrap();
        let recorder = Arc::new(Recorder::default());
        recorder.1.store(true, std::sync::atomic::Ordering::SeqCst);
        let volumes = Volumes::new(dir.path(), Arc::new(recorder.clone())).unwrap();
        let failed = volumes.recover().await;
        assert_eq!(failed, [(ID.to_owned(), "disk: full".to_owned()), (OTHER.to_owned(), "disk: full".to_owned())]);
        let after = VolumeLedgerFile::new(dir.path()).load().unwrap();
        assert!(!after.volumes.contains_key(ID), "{after:?}");
        assert_eq!(after.volumes[OTHER], entry("ready", 1));
    }
}
