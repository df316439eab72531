//! A ledger: one JSON document in the data directory that says what the node was asked to hold
//! or run, so a restart (or a redelivered command) finds it again. It is written whole (a
//! temporary file, synced, renamed over the old one, the directory synced), 0600, and read back
//! whole; a missing file is the empty ledger. `holds.json` ([`crate::holds`]) and
//! `instances.json` ([`crate::instances`]) are the two.

use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// What one ledger file holds, and its name in the data directory.
pub trait LedgerContents: Default + Serialize + DeserializeOwned {
    const FILE: &'static str;
}

/// A ledger on disk.
pub struct LedgerFile<T> {
    path: PathBuf,
    // `fn() -> T`: the file holds no `T`, so it is `Send` and `Sync` whatever `T` is.
    contents: PhantomData<fn() -> T>,
}

impl<T: LedgerContents> LedgerFile<T> {
    /// The ledger `T::FILE` in `data_dir`.
    pub fn new(data_dir: &Path) -> Self {
        Self { path: data_dir.join(T::FILE), contents: PhantomData }
    }

    /// The file the ledger is kept in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The ledger as last written; empty when there is none yet.
    pub fn load(&self) -> Result<T, String> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| format!("{}: {e}", self.path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
            Err(e) => Err(format!("{}: {e}", self.path.display())),
        }
    }

    /// Writes the ledger whole: a temporary file, synced, renamed over the old one.
    pub fn save(&self, ledger: &T) -> Result<(), String> {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let temp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec_pretty(ledger).map_err(|e| e.to_string())?;
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&temp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
            std::fs::rename(&temp, &self.path)?;
            if let Some(dir) = self.path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        let saved = write().map_err(|e| format!("{}: {e}", self.path.display()));
        // Counted whether it succeeded or not: a failed save may have renamed the file already.
        SAVES.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        saved
    }
}

/// Saves of any ledger made by this process ([`saves_in_process`]).
static SAVES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times this process has saved a ledger (any ledger, any agent): a reader that keeps
/// what it read of a ledger file may keep it while this has not moved, without looking at the
/// file again (the simulator reads every agent's ledger after every step).
pub fn saves_in_process() -> u64 {
    SAVES.load(std::sync::atomic::Ordering::Acquire)
}

/// A ledgered command's arguments (`sandbox.apply`, `sandbox_volume.apply`) read as `T`, with
/// the id of their subject from `field` first, so a refusal can be reported on the subject's
/// stream: `Ok((id, args))`, or `Err((the id if it was read, "bad-args: …"))`. `what` names the
/// id's kind in the refusal (`a sandbox id`).
pub fn subject_args<T: DeserializeOwned, Id: std::str::FromStr>(
    args_json: &str,
    field: &str,
    what: &str,
) -> Result<(String, T), (Option<String>, String)> {
    let value: serde_json::Value = serde_json::from_str(args_json).map_err(|e| (None, format!("bad-args: {e}")))?;
    let id = value.get(field).and_then(serde_json::Value::as_str).filter(|id| id.parse::<Id>().is_ok());
    let Some(id) = id.map(str::to_owned) else {
        return Err((None, format!("bad-args: {field} is not {what}")));
    };
    let args: T = serde_json::from_value(value).map_err(|e| (Some(id.clone()), format!("bad-args: {e}")))?;
    Ok((id, args))
}
