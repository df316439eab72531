//! Snapshots of this node's sandboxes (memory and disk): `runsc checkpoint` of a running sandbox
//! into a directory, kept content-addressed by SHA-256 under `<data_dir>/sandboxes/snapshots/<sha256>`,
//! and verified against the digest the restore names before `runsc restore` runs.
//!
//! - **Digest**: the SHA-256 of the image directory's manifest ([`manifest`], pure): one line
//!   `<sha256 of the file> <size> <name>` per regular file, sorted by name. runsc 20221219 writes
//!   one file (`checkpoint.img`: the sentry's state, the processes' memory, and the in-memory
//!   writable layer of the root file system); the manifest covers whatever it writes. Anything but
//!   regular files in the directory is refused.
//! - **Taking one**: the ledger (`sandbox_snapshots.json`, 0600, written whole) records the
//!   snapshot (`taking`) before the runtime is touched; the checkpoint goes into a fresh
//!   `.partial-<id>` directory, is hashed, and renamed whole to its digest's name (or dropped when
//!   that content is already there). `runsc checkpoint` stops the sandbox, and this build's
//!   `--leave-running` hangs (docs/sandboxes.md, "Snapshots"), so the source is then restored
//!   in place, under its own id, from the image just taken: it continues where it was.
//! - **Restoring**: a `sandbox.apply` with `restore` names the snapshot's digest; the node
//!   recomputes the manifest of the files it holds under that name and refuses (`snapshot-digest:
//!   …`, nothing started) unless it is that digest, or (`snapshot-missing: …`) when it holds none.
//!   The restore is a new sandbox, with its own id.
//! - **Bounds**: at most [`SNAPSHOTS_PER_NODE_MAX`] snapshots and [`SNAPSHOT_BYTES_PER_NODE_MAX`]
//!   bytes on a node (`capacity: …`; a checkpoint past the bytes is removed again).
//!
//! Decisions are pure ([`plan_snapshot`], [`check_node_bytes`], [`manifest`], [`removable`]);
//! the runtime sits behind [`crate::sandboxes::SandboxRuntime`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::Digest as _;

/// The most snapshots one node keeps.
pub const SNAPSHOTS_PER_NODE_MAX: usize = 64;
/// The most bytes of snapshots one node keeps (64 GiB).
pub const SNAPSHOT_BYTES_PER_NODE_MAX: u64 = 64 * 1024 * 1024 * 1024;
/// The most files one snapshot's directory may hold.
pub const SNAPSHOT_FILES_MAX: usize = 64;

/// The snapshot a restore starts from: its digest (the manifest's SHA-256), from the control
/// plane's record, never from the node's own files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRef {
    pub snapshot_id: String,
    pub sha256: String,
}

/// One snapshot the ledger holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotEntry {
    pub sandbox_id: String,
    /// `taking` (recorded, the checkpoint not yet named), `ready`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    #[serde(default)]
    pub bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotLedger {
    pub snapshots: BTreeMap<String, SnapshotEntry>,
}

impl crate::ledger::LedgerContents for SnapshotLedger {
    const FILE: &'static str = "sandbox_snapshots.json";
}

pub type SnapshotLedgerFile = crate::ledger::LedgerFile<SnapshotLedger>;

/// What a snapshot comes to: its digest and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taken {
    pub sha256: String,
    pub bytes: u64,
}

/// What to do about a request to snapshot `sandbox_id` as `snapshot_id` (pure).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SnapshotPlan {
    /// Already taken (a redelivered command): answer it again.
    Done(Taken),
    /// Record it and take it.
    Take,
}

/// Decides a snapshot: the sandbox must be one this node runs (`sandbox_running`), the node
/// below [`SNAPSHOTS_PER_NODE_MAX`]; a snapshot already taken is answered again.
pub fn plan_snapshot(
    ledger: &SnapshotLedger,
    snapshot_id: &str,
    sandbox_id: &str,
    sandbox_running: bool,
) -> Result<SnapshotPlan, String> {
    if let Some(entry) = ledger.snapshots.get(snapshot_id) {
        if entry.sandbox_id != sandbox_id {
            return Err(format!("bad-args: snapshot {snapshot_id} is of sandbox {}", entry.sandbox_id));
        }
        if let (Some(sha256), "ready") = (&entry.sha256, entry.state.as_str()) {
            return Ok(SnapshotPlan::Done(Taken { sha256: sha256.clone(), bytes: entry.bytes }));
        }
        return Ok(SnapshotPlan::Take);
    }
    if !sandbox_running {
        return Err(format!("runtime: sandbox {sandbox_id} is not running on this node"));
    }
    if ledger.snapshots.len() >= SNAPSHOTS_PER_NODE_MAX {
        return Err(format!("capacity: this node keeps {SNAPSHOTS_PER_NODE_MAX} snapshots, its most (SNAPSHOTS_PER_NODE_MAX)"));
    }
    Ok(SnapshotPlan::Take)
}

/// Whether `bytes` more fit beside the node's ready snapshots (each digest counted once):
/// [`SNAPSHOT_BYTES_PER_NODE_MAX`].
pub fn check_node_bytes(ledger: &SnapshotLedger, bytes: u64) -> Result<(), String> {
    let mut held: BTreeMap<&str, u64> = BTreeMap::new();
    for e in ledger.snapshots.values() {
        if let Some(sha) = &e.sha256 {
            held.insert(sha, e.bytes);
        }
    }
    let held: u64 = held.values().sum();
    if held.saturating_add(bytes) > SNAPSHOT_BYTES_PER_NODE_MAX {
        return Err(format!(
            "capacity: this node keeps {held} bytes of snapshots; {bytes} more would pass its \
             {SNAPSHOT_BYTES_PER_NODE_MAX} (SNAPSHOT_BYTES_PER_NODE_MAX)"
        ));
    }
    Ok(())
}

/// Whether the files of digest `sha256` may go once `snapshot_id` is gone: no other entry
/// names them (pure).
pub fn removable(ledger: &SnapshotLedger, snapshot_id: &str, sha256: &str) -> bool {
    !ledger.snapshots.iter().any(|(id, e)| id != snapshot_id && e.sha256.as_deref() == Some(sha256))
}

/// The manifest of a snapshot's files (`(name, size, sha256)`), sorted by name: one line each,
/// `<sha256> <size> <name>` (pure). Its SHA-256 is the snapshot's digest ([`digest`]).
pub fn manifest(files: &[(String, u64, String)]) -> String {
    let mut sorted: Vec<&(String, u64, String)> = files.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    sorted.iter().map(|(name, size, sha)| format!("{sha} {size} {name}\n")).collect()
}

/// The SHA-256 of `manifest`, in lowercase hex.
pub fn digest(manifest: &str) -> String {
    hex::encode(sha2::Sha256::digest(manifest.as_bytes()))
}

/// Reads the snapshot directory `dir`: each regular file hashed; anything else refused. Returns
/// the digest and the bytes together.
pub fn read_digest(dir: &Path) -> Result<Taken, String> {
    let mut files = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| format!("disk: {}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("disk: {}: {e}", dir.display()))?;
        let kind = entry.file_type().map_err(|e| format!("disk: {e}"))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !kind.is_file() {
            return Err(format!("snapshot-digest: {name} in the snapshot is not a regular file"));
        }
        if files.len() >= SNAPSHOT_FILES_MAX {
            return Err(format!("snapshot-digest: the snapshot holds more than {SNAPSHOT_FILES_MAX} files"));
        }
        let mut file = std::fs::File::open(entry.path()).map_err(|e| format!("disk: {name}: {e}"))?;
        let mut hasher = sha2::Sha256::new();
        let mut size = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            use std::io::Read as _;
            let n = file.read(&mut buf).map_err(|e| format!("disk: {name}: {e}"))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            size += n as u64;
        }
        files.push((name, size, hex::encode(hasher.finalize())));
    }
    let bytes = files.iter().map(|f| f.1).sum();
    Ok(Taken { sha256: digest(&manifest(&files)), bytes })
}

/// Checks that `dir` holds exactly the snapshot `expected` names: `snapshot-missing` when there
/// is no such directory, `snapshot-digest` when its files are not what the digest says.
pub fn verify(dir: &Path, expected: &SnapshotRef) -> Result<(), String> {
    if !dir.is_dir() {
        return Err(format!(
            "snapshot-missing: this node holds no snapshot {} (sha256 {})",
            expected.snapshot_id, expected.sha256
        ));
    }
    let found = read_digest(dir)?;
    if found.sha256 != expected.sha256 {
        return Err(format!(
            "snapshot-digest: snapshot {}'s files on this node have SHA-256 {}, not {}: refused, nothing started",
            expected.snapshot_id, found.sha256, expected.sha256
        ));
    }
    Ok(())
}

/// Where the snapshots of the sandboxes directory `dir` are kept.
pub fn snapshots_dir(sandboxes_dir: &Path) -> PathBuf {
    sandboxes_dir.join("snapshots")
}

/// What a `sandbox.snapshot` asks: snapshot `sandbox_id` as `snapshot_id`, or (`desired:
/// deleted`) remove the snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotArgs {
    pub snapshot_id: String,
    pub sandbox_id: String,
    /// `ready` or `deleted`.
    pub desired: String,
}

/// The command kind that takes or removes a snapshot.
pub const SANDBOX_SNAPSHOT: &str = "sandbox.snapshot";
/// The longest reason a report carries.
const REASON_BYTES_MAX: usize = 1024;

/// Reads and checks a `sandbox.snapshot`'s arguments. `Err((snapshot id if read, reason))`.
pub fn parse_args(args_json: &str) -> Result<SnapshotArgs, (Option<String>, String)> {
    let (id, args): (String, SnapshotArgs) =
        crate::ledger::subject_args::<_, bc_core::id::SandboxSnapshotId>(args_json, "snapshotId", "a snapshot id")?;
    if !matches!(args.desired.as_str(), "ready" | "deleted") {
        return Err((Some(id), "bad-args: desired is not ready or deleted".into()));
    }
    if args.sandbox_id.parse::<bc_core::id::SandboxId>().is_err() {
        return Err((Some(id), "bad-args: sandboxId is not a sandbox id".into()));
    }
    Ok(args)
}

/// A snapshot report's payload (`sandbox_snapshot.observed` ready with its digest and size, or
/// absent; `sandbox_snapshot.apply_failed`), without the command and node the runner adds.
pub fn report_payload(id: &str, outcome: &Result<Option<Taken>, String>) -> (&'static str, serde_json::Value) {
    use serde_json::json;
    match outcome {
        Ok(Some(t)) => {
            ("sandbox_snapshot.observed", json!({ "snapshotId": id, "state": "ready", "sha256": t.sha256, "bytes": t.bytes }))
        }
        Ok(None) => ("sandbox_snapshot.observed", json!({ "snapshotId": id, "state": "absent" })),
        Err(reason) => {
            let mut reason = reason.clone();
            if reason.len() > REASON_BYTES_MAX {
                let mut end = REASON_BYTES_MAX;
                while !reason.is_char_boundary(end) {
                    end -= 1;
                }
                reason.truncate(end);
            }
            ("sandbox_snapshot.apply_failed", json!({ "snapshotId": id, "reason": reason }))
        }
    }
}

impl crate::sandboxes::Sandboxes {
    /// Carries out a `sandbox.snapshot`: takes it (`ready`: its digest and size) or removes it
    /// (`deleted`: `None`, absent).
    pub async fn apply_snapshot(&self, args: &SnapshotArgs) -> Result<Option<Taken>, String> {
        if args.desired == "deleted" {
            return self.delete_snapshot(&args.snapshot_id).await.map(|()| None);
        }
        self.snapshot(args).await.map(Some)
    }

    /// Takes a snapshot of a running sandbox of this node: the ledger first (`taking`), then
    /// `runsc checkpoint` into a fresh directory, the source restored in place from it, the files
    /// hashed and renamed to their digest, the ledger `ready`. Redelivered, a snapshot already
    /// taken is answered again.
    pub async fn snapshot(&self, args: &SnapshotArgs) -> Result<Taken, String> {
        use crate::sandboxes::{RuntimeState, blocking};
        let (snap, sbx) = (args.snapshot_id.as_str(), args.sandbox_id.as_str());
        // The sandbox ledger is held throughout: no delete of the source runs meanwhile.
        let sandboxes = self.ledger.lock().await;
        let mut ledger = self.snapshots.lock().await;
        let known = sandboxes.sandboxes.get(sbx).is_some_and(|e| e.desired == "running");
        let running = known && matches!(self.state(sbx).await, Ok(Some(RuntimeState::Running)));
        if let SnapshotPlan::Done(taken) = plan_snapshot(&ledger, snap, sbx, running)? {
            return Ok(taken);
        }
        if !running {
            return Err(format!("runtime: sandbox {sbx} is not running on this node"));
        }
        let mut next = ledger.clone();
        next.snapshots.insert(
            snap.to_owned(),
            SnapshotEntry { sandbox_id: sbx.to_owned(), state: "taking".into(), sha256: None, bytes: 0 },
        );
        self.snapshots_file.save(&next).map_err(|e| format!("disk: recording the snapshot: {e}"))?;
        *ledger = next;
        let root = snapshots_dir(&self.dir);
        let partial = root.join(format!(".partial-{snap}"));
        let bundle = self.bundle_dir(sbx);
        let runtime = self.runtime.clone();
        let taken = {
            let (root, partial, sbx) = (root.clone(), partial.clone(), sbx.to_owned());
            blocking(move || -> Result<Taken, String> {
                let _ = std::fs::remove_dir_all(&partial);
                use std::os::unix::fs::DirBuilderExt as _;
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&partial)
                    .map_err(|e| format!("disk: {}: {e}", partial.display()))?;
                // Stopped by the checkpoint: back where it was, in place, from what was saved.
                if let Err(why) = runtime.checkpoint(&sbx, &partial) {
                    return Err(format!("{why} (the checkpoint of sandbox {sbx})"));
                }
                runtime.remove(&sbx)?;
                runtime
                    .restore(&sbx, &bundle, &partial)
                    .map_err(|e| format!("{e} (restoring sandbox {sbx} in place after its checkpoint: it is stopped)"))?;
                let taken = read_digest(&partial)?;
                let named = root.join(&taken.sha256);
                if named.exists() {
                    let _ = std::fs::remove_dir_all(&partial);
                } else {
                    std::fs::rename(&partial, &named).map_err(|e| format!("disk: {}: {e}", named.display()))?;
                }
                Ok(taken)
            })
            .await?
        };
        let bounded = taken.and_then(|t| match check_node_bytes(&ledger, t.bytes) {
            Ok(()) => Ok(t),
            // Past the node's bytes: its files go again (unless another snapshot is the same).
            Err(why) => {
                if removable(&ledger, snap, &t.sha256) {
                    let _ = std::fs::remove_dir_all(root.join(&t.sha256));
                }
                Err(why)
            }
        });
        let taken = match bounded {
            Ok(taken) => taken,
            Err(why) => {
                let _ = std::fs::remove_dir_all(&partial);
                let mut next = ledger.clone();
                next.snapshots.remove(snap);
                if self.snapshots_file.save(&next).is_ok() {
                    *ledger = next;
                }
                return Err(why);
            }
        };
        let mut next = ledger.clone();
        next.snapshots.insert(
            snap.to_owned(),
            SnapshotEntry {
                sandbox_id: sbx.to_owned(),
                state: "ready".into(),
                sha256: Some(taken.sha256.clone()),
                bytes: taken.bytes,
            },
        );
        self.snapshots_file.save(&next).map_err(|e| format!("disk: recording the snapshot: {e}"))?;
        *ledger = next;
        tracing::info!(sandbox = %sbx, snapshot = %snap, sha256 = %taken.sha256, bytes = taken.bytes, "snapshot taken");
        Ok(taken)
    }

    /// Removes a snapshot: its entry, and its files once no other entry names them.
    pub async fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), String> {
        let mut ledger = self.snapshots.lock().await;
        let Some(entry) = ledger.snapshots.get(snapshot_id).cloned() else { return Ok(()) };
        let mut next = ledger.clone();
        next.snapshots.remove(snapshot_id);
        self.snapshots_file.save(&next).map_err(|e| format!("disk: recording the delete: {e}"))?;
        let root = snapshots_dir(&self.dir);
        let files = match &entry.sha256 {
            Some(sha) if removable(&ledger, snapshot_id, sha) => Some(root.join(sha)),
            Some(_) => None,
            None => Some(root.join(format!(".partial-{snapshot_id}"))),
        };
        *ledger = next;
        if let Some(dir) = files {
            match tokio::fs::remove_dir_all(&dir).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(format!("disk: {}: {e}", dir.display())),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(sandbox: &str, sha: Option<&str>, bytes: u64) -> SnapshotEntry {
        SnapshotEntry {
            sandbox_id: sandbox.into(),
            state: if sha.is_some() { "ready" } else { "taking" }.into(),
            sha256: sha.map(str::to_owned),
            bytes,
        }
    }

    #[test]
    fn a_snapshot_is_planned_once_and_bounded() {
        let mut ledger = SnapshotLedger::default();
        assert_eq!(plan_snapshot(&ledger, "snap_1", "sbx_a", true), Ok(SnapshotPlan::Take));
        assert!(plan_snapshot(&ledger, "snap_1", "sbx_a", false).unwrap_err().starts_with("runtime:"));
        ledger.snapshots.insert("snap_1".into(), entry("sbx_a", Some("ab"), 10));
        assert_eq!(
            plan_snapshot(&ledger, "snap_1", "sbx_a", false),
            Ok(SnapshotPlan::Done(Taken { sha256: "ab".into(), bytes: 10 }))
        );
        assert!(plan_snapshot(&ledger, "snap_1", "sbx_b", true).unwrap_err().starts_with("bad-args:"));
        for i in 1..SNAPSHOTS_PER_NODE_MAX {
            ledger.snapshots.insert(format!("snap_x{i}"), entry("sbx_a", None, 0));
        }
        assert!(plan_snapshot(&ledger, "snap_new", "sbx_a", true).unwrap_err().starts_with("capacity:"));
        // Bytes: one digest counted once.
        let mut ledger = SnapshotLedger::default();
        ledger.snapshots.insert("a".into(), entry("sbx_a", Some("d1"), SNAPSHOT_BYTES_PER_NODE_MAX / 2));
        ledger.snapshots.insert("b".into(), entry("sbx_a", Some("d1"), SNAPSHOT_BYTES_PER_NODE_MAX / 2));
        assert!(check_node_bytes(&ledger, SNAPSHOT_BYTES_PER_NODE_MAX / 2).is_ok());
        assert!(check_node_bytes(&ledger, SNAPSHOT_BYTES_PER_NODE_MAX / 2 + 1).unwrap_err().starts_with("capacity:"));
        assert!(!removable(&ledger, "a", "d1"));
        ledger.snapshots.remove("b");
        assert!(removable(&ledger, "a", "d1"));
    }

    #[test]
    fn the_digest_covers_every_byte_and_name() {
        let dir = std::env::temp_dir().join(format!("bc-snap-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("checkpoint.img"), b"memory and disk").unwrap();
        let taken = read_digest(&dir).unwrap();
        assert_eq!(taken.bytes, 15);
        let good = SnapshotRef { snapshot_id: "snap_1".into(), sha256: taken.sha256.clone() };
        assert_eq!(verify(&dir, &good), Ok(()));
        // One byte flipped: refused.
        std::fs::write(dir.join("checkpoint.img"), b"memory and disK").unwrap();
        assert!(verify(&dir, &good).unwrap_err().starts_with("snapshot-digest:"));
        // The same bytes under another name: another digest.
        std::fs::write(dir.join("checkpoint.img"), b"memory and disk").unwrap();
        assert_eq!(verify(&dir, &good), Ok(()));
        std::fs::rename(dir.join("checkpoint.img"), dir.join("other.img")).unwrap();
        assert!(verify(&dir, &good).is_err());
        assert!(verify(&dir.join("none"), &good).unwrap_err().starts_with("snapshot-missing:"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
