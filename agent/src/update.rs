//! `agent.update` and `bcd update`: a signed release into the inactive slot, the switch, the
//! re-exec, and the watchdog that rolls back an agent that does not confirm its health.
//! `agent.rollback` (a rollout's abort, or by hand): back to the version the previous slot
//! holds, by the same switch, re-exec and watchdog (so a previous binary that no longer starts
//! is itself rolled back to the one that ran).
//!
//! Files (`[update]` in config.toml): `slots/a/bcd` and `slots/b/bcd`, the two slots;
//! `slots/state.json`, which slot is active, what each holds, the update waiting for its
//! confirmation and the last rollback ([`SlotsState`], written whole like the ledgers);
//! `slots/pending`, the marker of an update waiting for its confirmation, which the new agent
//! (confirming) and the watchdog (rolling back) each try to rename away: `rename` succeeds for
//! one of them only, so the two can never both win; and the entrypoint (`bin/bcd` by default), a
//! symlink to the active slot's binary, which is what a service manager should start.
//!
//! The decisions are pure ([`decide_update`], [`decide_rollback`], [`watchdog_verdict`],
//! [`trailer_version`]); the
//! rest is the thin shell around them: one install at a time (`slots/install.lock`, an exclusive
//! `flock` taken without waiting: a `bcd update` by hand and a command at once, the second is
//! refused `update-in-progress`; the decision's state read again under it), fetching the
//! artifact (bounded in size and time, through `images.rs`'s bounded download into a fresh
//! file of its own, `O_EXCL | O_NOFOLLOW`, hashed as written, synced, then hashed again as it
//! is on disk), writing the slot (that file renamed, 0755),
//! switching the symlink (a new link renamed over it), and the watchdog: a detached process of
//! the *old* binary (`bcd __update-watchdog`), which past `confirm_within_s` (or as soon as the
//! new agent is gone) kills the new agent, points the entrypoint back, records the rollback and
//! execs the old agent with the same arguments. The old agent, at its start, journals the
//! command `command.failed` with `rolled-back: …`.
//!
//! The **floor** (`floorVersion` in `state.json`): the newest version this node has run
//! healthy (started with no update waiting, or confirmed). An update to a version below it is
//! refused `release-downgrade` unless its manifest allows a downgrade and is within its
//! `notAfter` (`bc_core::release::check_update`); so once a node ran 0.3.0, a manifest of 0.2.0
//! signed long ago does not take it back, even from a 0.1.0 it was rolled back to. An
//! `agent.rollback` goes back to the binary the previous slot holds and is not held to it.
//!
//! Reasons start with stable codes: `bc_core::release`'s (`release-…`, `artifact-…`), and
//! `update-unconfigured`, `update-in-progress`, `update-failed` (the node's own files, or the
//! watchdog could not be started), `rollback-unavailable` (the previous slot does not hold the
//! version asked for).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bc_core::clock::{Clock as _, SystemClock};
use bc_core::release::{
    ARTIFACT_BYTES_MAX, Artifact, Manifest, ReleaseError, ReleasePublicKey, UPDATE_COMMAND_DEADLINE_S, UpdateCheck, check_update,
    verify,
};
use serde::{Deserialize, Serialize};

use crate::config::Config;

/// The slots directory under `data_dir`, by default, and the files in it.
pub const SLOTS_DIR_DEFAULT: &str = "slots";
pub const STATE_FILE: &str = "state.json";
pub const PENDING_FILE: &str = "pending";
/// A slot's binary, in its directory.
pub const BINARY_FILE: &str = "bcd";
/// The entrypoint under `data_dir`, by default.
pub const ENTRYPOINT_DEFAULT: &str = "bin/bcd";
/// `bcd node` writes its process id here (so an agent the watchdog started can be found).
pub const PID_FILE: &str = "bcd.pid";
/// How long a new agent has to confirm its health, by default, and the bounds.
pub const CONFIRM_WITHIN_S_DEFAULT: u64 = 120;
pub const CONFIRM_WITHIN_S_MIN: u64 = 2;
pub const CONFIRM_WITHIN_S_MAX: u64 = 300;
/// How long a new agent must be live (after its session's Welcome) before it confirms.
pub const HEALTHY_AFTER_S_DEFAULT: u64 = 5;
/// Release keys pinned at most.
pub const RELEASE_KEYS_MAX: usize = 16;
/// The longest an artifact fetch may take: with the confirmation, within the command's deadline.
pub const ARTIFACT_FETCH_TIMEOUT_S: u64 = 240;
/// How often the watchdog looks at the state and the new agent.
pub const WATCHDOG_POLL_MS: u64 = 250;
/// How long the watchdog waits for a killed agent to be gone.
pub const WATCHDOG_KILL_WAIT_MS: u64 = 5_000;
/// How long arming the watchdog (its first stage, which detaches the second) may take.
pub const WATCHDOG_ARM_TIMEOUT_S: u64 = 10;
/// The lock one install holds, in the slots directory.
pub const INSTALL_LOCK_FILE: &str = "install.lock";
/// The largest state file read.
pub const STATE_BYTES_MAX: u64 = 64 * 1024;
/// The hidden command of the watchdog.
pub const WATCHDOG_COMMAND: &str = "__update-watchdog";
/// The fakehw builds' version trailer: the executable's last bytes are
/// `\nbcd-fakehw-version=X.Y.Z\n`, so a test makes release B from the same binary.
pub const FAKEHW_TRAILER_PREFIX: &[u8] = b"\nbcd-fakehw-version=";
/// The trailer's bytes at most.
pub const FAKEHW_TRAILER_BYTES_MAX: usize = 96;

const _: () = assert!(ARTIFACT_FETCH_TIMEOUT_S + CONFIRM_WITHIN_S_MAX < UPDATE_COMMAND_DEADLINE_S);
const _: () = assert!(CONFIRM_WITHIN_S_MIN * 1000 > WATCHDOG_POLL_MS);

/// One of the two slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Slot {
    A,
    B,
}

impl Slot {
    pub fn other(self) -> Self {
        match self {
            Self::A => Self::B,
            Self::B => Self::A,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::A => "a",
            Self::B => "b",
        }
    }
}

/// An update switched to, waiting for the new agent to confirm its health.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pending {
    /// The `agent.update` command; none for a `bcd update` by hand.
    pub command_id: Option<String>,
    pub slot: Slot,
    pub version: String,
    pub from_slot: Slot,
    pub from_version: String,
    /// Past it, the watchdog rolls back.
    pub deadline_ms: u64,
    pub confirm_within_s: u64,
    /// The agent's process (the same after the exec), which the watchdog watches.
    pub pid: u32,
    /// The arguments the agent runs with, which the old agent is started with again.
    pub args: Vec<String>,
}

/// A rollback the watchdog made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rollback {
    pub command_id: Option<String>,
    pub slot: Slot,
    pub version: String,
    pub back_slot: Slot,
    pub back_version: String,
    /// `rolled-back: …`, as journaled.
    pub reason: String,
    pub at_ms: u64,
    /// Whether the old agent journaled it.
    pub reported: bool,
}

/// `slots/state.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SlotsState {
    pub active: Slot,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<Slot>,
    /// The version each slot holds.
    #[serde(default)]
    pub versions: BTreeMap<Slot, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<Pending>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rollback: Option<Rollback>,
    /// The version the last `bcd node` ran (the next start's `previousVersion`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_started_version: Option<String>,
    /// The newest version this node has run healthy: an update below it needs a valid
    /// downgrade permission (see the module's header). None in a state written before it was
    /// kept: the next start sets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floor_version: Option<String>,
}

impl SlotsState {
    /// A first start: the running binary adopted as slot `a`.
    pub fn adopted(version: &str) -> Self {
        Self {
            active: Slot::A,
            previous: None,
            versions: BTreeMap::from([(Slot::A, version.to_owned())]),
            pending: None,
            last_rollback: None,
            last_started_version: None,
            floor_version: None,
        }
    }

    /// Raises the floor to `version` if it is newer (a floor that does not parse is replaced).
    pub fn raise_floor(&mut self, version: &str) {
        let Ok(new) = semver::Version::parse(version) else { return };
        let higher = match self.floor_version.as_deref().map(semver::Version::parse) {
            Some(Ok(floor)) => new > floor,
            _ => true,
        };
        if higher {
            self.floor_version = Some(version.to_owned());
        }
    }
}

/// What an `agent.update` asks: the manifest and signature as signed.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateArgs {
    pub manifest: String,
    pub signature: String,
    #[serde(default)]
    pub rollout_id: Option<String>,
}

/// What [`decide_update`] says to do.
// One plan is made per update command and dropped once carried out, never kept in numbers:
// boxing the manifest would buy nothing but an indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdatePlan {
    /// The release is what runs: succeeded at once (`already: true`).
    Already { version: String },
    /// This command is the update waiting for this agent's confirmation (redelivered to the new
    /// agent): nothing to do; the confirmation answers it.
    AwaitingConfirmation,
    /// Fetch `artifact` into `slot`, switch to it, re-exec.
    Install { manifest: Manifest, artifact: Artifact, slot: Slot, from_slot: Slot },
}

/// The refusal of an update that is not configured.
pub const UPDATE_UNCONFIGURED: &str =
    "update-unconfigured: this node pins no release keys (hint: set [update] release_keys in config.toml)";

/// Decides an update at `now_ms`, purely: the release must be signed by a pinned key
/// (`trusted`), be one the running `current` may take above the node's floor (a downgrade only
/// by a manifest that allows it, within its `notAfter`), and have a build for `arch`; no other
/// update may be waiting for its confirmation. Refusals are the reason to journal, starting with
/// its code.
pub fn decide_update(
    current: &str,
    trusted: &[ReleasePublicKey],
    args: &UpdateArgs,
    arch: &str,
    state: &SlotsState,
    command_id: Option<&str>,
    now_ms: u64,
) -> Result<UpdatePlan, String> {
    if trusted.is_empty() {
        return Err(UPDATE_UNCONFIGURED.into());
    }
    if let Some(pending) = &state.pending {
        if command_id.is_some() && pending.command_id.as_deref() == command_id {
            return Ok(UpdatePlan::AwaitingConfirmation);
        }
        return Err(format!(
            "update-in-progress: the update to {} (slot {}) waits for its confirmation; try again once it is confirmed or rolled back",
            pending.version,
            pending.slot.as_str()
        ));
    }
    let manifest = verify(trusted, args.manifest.as_bytes(), &args.signature).map_err(|e| e.to_string())?;
    match check_update(current, state.floor_version.as_deref(), &manifest, now_ms).map_err(|e| e.to_string())? {
        UpdateCheck::Same => return Ok(UpdatePlan::Already { version: manifest.version }),
        UpdateCheck::Upgrade | UpdateCheck::Downgrade => {}
    }
    let artifact = manifest.artifact_for(arch).map_err(|e| e.to_string())?.clone();
    Ok(UpdatePlan::Install { manifest, artifact, slot: state.active.other(), from_slot: state.active })
}

/// What an `agent.rollback` asks: the version to go back to.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RollbackArgs {
    pub to_version: String,
    #[serde(default)]
    pub rollout_id: Option<String>,
}

/// What [`decide_rollback`] says to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RollbackPlan {
    /// `toVersion` is what runs: succeeded at once (`already: true`).
    Already { version: String },
    /// This command is the rollback waiting for this agent's confirmation (redelivered to the
    /// agent of the previous slot): the confirmation answers it.
    AwaitingConfirmation,
    /// Point the entrypoint back at `slot`, which holds `version`, and re-exec.
    Switch { slot: Slot, version: String, from_slot: Slot },
}

/// Decides a rollback, purely: the version asked for runs already, or the previous slot holds
/// it (then back to it, as an update is made: pending, watched); no update may be waiting for
/// its confirmation. Refusals start with their code.
pub fn decide_rollback(
    current: &str,
    state: &SlotsState,
    to_version: &str,
    command_id: Option<&str>,
) -> Result<RollbackPlan, String> {
    if let Some(pending) = &state.pending {
        if command_id.is_some() && pending.command_id.as_deref() == command_id {
            return Ok(RollbackPlan::AwaitingConfirmation);
        }
        return Err(format!(
            "update-in-progress: the switch to {} (slot {}) waits for its confirmation; try again once it is confirmed or rolled back",
            pending.version,
            pending.slot.as_str()
        ));
    }
    if current == to_version {
        return Ok(RollbackPlan::Already { version: current.to_owned() });
    }
    let Some(previous) = state.previous.filter(|p| *p != state.active) else {
        return Err(format!("rollback-unavailable: no previous slot (this node runs {current} and never switched slots)"));
    };
    match state.versions.get(&previous) {
        Some(held) if held == to_version => {
            Ok(RollbackPlan::Switch { slot: previous, version: held.clone(), from_slot: state.active })
        }
        Some(held) => {
            Err(format!("rollback-unavailable: the previous slot holds {held}, not {to_version} (slot {})", previous.as_str()))
        }
        None => Err(format!(
            "rollback-unavailable: the previous slot holds no known version, not {to_version} (slot {})",
            previous.as_str()
        )),
    }
}

/// The reason a rollback is journaled with.
pub fn rollback_reason(pending: &Pending) -> String {
    format!(
        "rolled-back: the agent {} did not confirm health within {} s; back on slot {} (version {})",
        pending.version,
        pending.confirm_within_s,
        pending.from_slot.as_str(),
        pending.from_version
    )
}

/// What the watchdog does on one look.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchdogVerdict {
    /// The update was confirmed (or is gone): the watchdog ends.
    Done,
    Wait,
    /// Past the deadline, or the new agent is gone: roll back.
    RollBack,
}

/// The watchdog's decision for the update of `command_id` it watches: `state` as read now,
/// whether the marker is still there, whether the agent's process lives.
pub fn watchdog_verdict(state: &SlotsState, watched: &Pending, marker: bool, agent_alive: bool, now_ms: u64) -> WatchdogVerdict {
    match &state.pending {
        Some(p) if p == watched && marker => {
            if now_ms >= p.deadline_ms || !agent_alive {
                WatchdogVerdict::RollBack
            } else {
                WatchdogVerdict::Wait
            }
        }
        _ => WatchdogVerdict::Done,
    }
}

/// The version a fakehw trailer at the end of `tail` (an executable's last bytes) says.
pub fn trailer_version(tail: &[u8]) -> Option<String> {
    let body = tail.strip_suffix(b"\n")?;
    let at = body.windows(FAKEHW_TRAILER_PREFIX.len()).rposition(|w| w == FAKEHW_TRAILER_PREFIX)?;
    let version = std::str::from_utf8(&body[at + FAKEHW_TRAILER_PREFIX.len()..]).ok()?;
    semver_ok(version).then(|| version.to_owned())
}

fn semver_ok(text: &str) -> bool {
    text.len() <= bc_core::release::VERSION_BYTES_MAX && bc_core::release::is_version(text)
}

/// The version this agent reports: the package's, or in a fakehw build the trailer's of its
/// executable when it has one.
pub fn running_version() -> String {
    if cfg!(feature = "fakehw")
        && let Some(version) = std::env::current_exe().ok().and_then(|exe| executable_trailer(&exe))
    {
        return version;
    }
    env!("CARGO_PKG_VERSION").to_owned()
}

fn executable_trailer(path: &Path) -> Option<String> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let mut file = std::fs::File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let take = len.min(FAKEHW_TRAILER_BYTES_MAX as u64);
    file.seek(SeekFrom::Start(len - take)).ok()?;
    let mut tail = Vec::with_capacity(take as usize);
    file.take(take).read_to_end(&mut tail).ok()?;
    trailer_version(&tail)
}

/// `[update]`, checked, with its defaults filled in.
#[derive(Clone, Debug)]
pub struct UpdateSettings {
    pub release_keys: Vec<ReleasePublicKey>,
    pub slots_dir: PathBuf,
    pub entrypoint: PathBuf,
    pub confirm_within_s: u64,
    pub healthy_after_s: u64,
    pub data_dir: PathBuf,
}

impl UpdateSettings {
    /// `config`'s `[update]`; `None` without one.
    pub fn of(config: &Config) -> Result<Option<Self>, String> {
        let Some(update) = &config.update else { return Ok(None) };
        if update.release_keys.len() > RELEASE_KEYS_MAX {
            return Err(format!("[update] release_keys holds at most {RELEASE_KEYS_MAX} keys"));
        }
        let mut release_keys = Vec::new();
        for (i, line) in update.release_keys.iter().enumerate() {
            release_keys.push(ReleasePublicKey::parse_line(line).map_err(|e| format!("[update] release_keys[{i}]: {e}"))?);
        }
        let confirm_within_s = update.confirm_within_s.unwrap_or(CONFIRM_WITHIN_S_DEFAULT);
        if !(CONFIRM_WITHIN_S_MIN..=CONFIRM_WITHIN_S_MAX).contains(&confirm_within_s) {
            return Err(format!("[update] confirm_within_s is {CONFIRM_WITHIN_S_MIN} to {CONFIRM_WITHIN_S_MAX}"));
        }
        let healthy_after_s = update.healthy_after_s.unwrap_or(HEALTHY_AFTER_S_DEFAULT.min(confirm_within_s / 2));
        if healthy_after_s >= confirm_within_s {
            return Err("[update] healthy_after_s is less than confirm_within_s".into());
        }
        let absolute = |p: PathBuf| if p.is_absolute() { p } else { config.data_dir.join(p) };
        Ok(Some(Self {
            release_keys,
            slots_dir: absolute(update.slots_dir.clone().unwrap_or_else(|| SLOTS_DIR_DEFAULT.into())),
            entrypoint: absolute(update.entrypoint.clone().unwrap_or_else(|| ENTRYPOINT_DEFAULT.into())),
            confirm_within_s,
            healthy_after_s,
            data_dir: config.data_dir.clone(),
        }))
    }

    pub fn binary(&self, slot: Slot) -> PathBuf {
        self.slots_dir.join(slot.as_str()).join(BINARY_FILE)
    }

    fn state_path(&self) -> PathBuf {
        self.slots_dir.join(STATE_FILE)
    }

    fn marker_path(&self) -> PathBuf {
        self.slots_dir.join(PENDING_FILE)
    }

    /// The state, or none before the first start with `[update]`.
    pub fn load_state(&self) -> Result<Option<SlotsState>, String> {
        let path = self.state_path();
        match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
            Ok(meta) if meta.len() > STATE_BYTES_MAX => {
                return Err(format!("{} is over {STATE_BYTES_MAX} bytes", path.display()));
            }
            Ok(_) => {}
        }
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_slice(&bytes).map(Some).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn save_state(&self, state: &SlotsState) -> Result<(), String> {
        let bytes = serde_json::to_vec_pretty(state).map_err(|e| e.to_string())?;
        write_replacing(&self.state_path(), &bytes, 0o600).map_err(|e| format!("{}: {e}", self.state_path().display()))
    }

    /// Points the entrypoint at `slot`'s binary: a new link renamed over the old one.
    pub fn point_entrypoint(&self, slot: Slot) -> Result<(), String> {
        let link = &self.entrypoint;
        let err = |e: std::io::Error| format!("the entrypoint {}: {e}", link.display());
        if let Some(dir) = link.parent() {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let temp = sibling(link, ".tmp");
        let _ = std::fs::remove_file(&temp);
        std::os::unix::fs::symlink(self.binary(slot), &temp).map_err(err)?;
        std::fs::rename(&temp, link).map_err(err)?;
        bc_core::keys::sync_dir_of(link).map_err(|e| e.to_string())
    }
}

/// `path` with `suffix` added to its name.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Writes `bytes` whole to `path` with `mode`: a temporary file, synced, renamed over it, the
/// directory synced.
fn write_replacing(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temp = sibling(path, ".tmp");
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&temp)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&temp, path)?;
    std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
}

/// What a start of `bcd node` learns from the slots, and journals.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartReport {
    pub slot: Slot,
    pub previous_version: Option<String>,
    /// A rollback not journaled yet: its command fails with its reason.
    pub rollback: Option<Rollback>,
    /// This agent is the update waiting for its confirmation.
    pub pending: Option<Pending>,
}

/// How `bcd node` was started: what the watchdog needs to start the old agent again.
#[derive(Clone, Debug)]
pub struct Launch {
    pub config_path: PathBuf,
    /// The arguments after the program's name.
    pub args: Vec<String>,
}

/// The update machinery of a running `bcd node`.
pub struct Updater {
    pub settings: UpdateSettings,
    pub version: String,
    launch: Launch,
    http: reqwest::Client,
    /// The binary to re-execute, once an update switched to it; the driver watches it.
    reexec: tokio::sync::watch::Sender<Option<PathBuf>>,
}

impl Updater {
    pub fn new(settings: UpdateSettings, version: String, launch: Launch) -> Result<Self, String> {
        let http = crate::images::http_client(ARTIFACT_FETCH_TIMEOUT_S)?;
        Ok(Self { settings, version, launch, http, reexec: tokio::sync::watch::Sender::new(None) })
    }

    /// Where the driver learns that an update wants this process re-executed.
    pub fn reexec_requested(&self) -> tokio::sync::watch::Receiver<Option<PathBuf>> {
        self.reexec.subscribe()
    }

    /// At the start of `bcd node`: the slots made if there are none (this executable adopted as
    /// slot `a`, the entrypoint pointed at it), the start recorded.
    pub fn start(&self) -> Result<StartReport, String> {
        let s = &self.settings;
        let mut state = match s.load_state()? {
            Some(state) => state,
            None => {
                let exe = std::env::current_exe().map_err(|e| format!("update-failed: this executable: {e}"))?;
                let target = s.binary(Slot::A);
                copy_executable(&exe, &target).map_err(|e| format!("adopting {} as slot a: {e}", exe.display()))?;
                let state = SlotsState::adopted(&self.version);
                s.save_state(&state)?;
                s.point_entrypoint(Slot::A)?;
                tracing::info!(slot = "a", version = %self.version, entrypoint = %s.entrypoint.display(), "this bcd was adopted as slot a");
                state
            }
        };
        // A state written before the slots' versions were recorded learns the running one's.
        state.versions.entry(state.active).or_insert_with(|| self.version.clone());
        let previous_version = state.last_started_version.replace(self.version.clone());
        let rollback = state.last_rollback.clone().filter(|r| !r.reported);
        let pending = state.pending.clone().filter(|p| p.slot == state.active);
        if state.pending.is_none() {
            // Started with no update waiting: this version runs as the node's own.
            state.raise_floor(&self.version);
        }
        s.save_state(&state)?;
        Ok(StartReport { slot: state.active, previous_version, rollback, pending })
    }

    /// The slot the entrypoint points at.
    pub fn active_slot(&self) -> Option<Slot> {
        self.settings.load_state().ok().flatten().map(|s| s.active)
    }

    /// Records that the rollback's failure was journaled.
    pub fn rollback_reported(&self) -> Result<(), String> {
        let Some(mut state) = self.settings.load_state()? else { return Ok(()) };
        if let Some(r) = state.last_rollback.as_mut() {
            r.reported = true;
        }
        self.settings.save_state(&state)
    }

    /// The pure decision, on the state as it is now, at `now_ms`.
    pub fn decide(&self, args: &UpdateArgs, command_id: Option<&str>, now_ms: u64) -> Result<UpdatePlan, String> {
        let state = self
            .settings
            .load_state()
            .map_err(|e| format!("update-failed: {e}"))?
            .unwrap_or_else(|| SlotsState::adopted(&self.version));
        decide_update(&self.version, &self.settings.release_keys, args, std::env::consts::ARCH, &state, command_id, now_ms)
    }

    /// Carries out an [`UpdatePlan::Install`]: under the install lock (none free:
    /// `update-in-progress`), the state read again (another install switched meanwhile:
    /// `update-in-progress`), the artifact fetched into a fresh file, checked as written and again
    /// as it is on disk, renamed into the slot, the update recorded as pending, the entrypoint
    /// switched, the watchdog armed; then the driver is asked to re-execute. Any failure before
    /// the switch leaves the running agent as it was.
    pub async fn install(&self, plan: UpdatePlan, command_id: Option<&str>, now_ms: u64) -> Result<PathBuf, String> {
        let UpdatePlan::Install { manifest, artifact, slot, from_slot } = plan else {
            return Err("update-failed: nothing to install".into());
        };
        let s = &self.settings;
        let _lock = take_install_lock(&s.slots_dir)?;
        let state =
            s.load_state().map_err(|e| format!("update-failed: {e}"))?.unwrap_or_else(|| SlotsState::adopted(&self.version));
        if let Some(pending) = &state.pending {
            return Err(format!(
                "update-in-progress: the update to {} (slot {}) waits for its confirmation; try again once it is confirmed or rolled back",
                pending.version,
                pending.slot.as_str()
            ));
        }
        if state.active != from_slot {
            return Err(format!("update-in-progress: slot {} became active meanwhile; try again", state.active.as_str()));
        }
        let target = s.binary(slot);
        let dir = target.parent().unwrap_or(&s.slots_dir).to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| format!("update-failed: {}: {e}", dir.display()))?;
        // Under the lock no other install writes here: what a crashed one left goes.
        remove_partials(&dir);
        let wanted = crate::images::Wanted {
            what: "artifact",
            url: &artifact.url,
            sha256: &artifact.sha256,
            size_bytes: Some(artifact.size),
            limit: ARTIFACT_BYTES_MAX,
        };
        let temp =
            crate::images::download(&self.http, &wanted, &dir, BINARY_FILE).await.map_err(|e| artifact_error(e).to_string())?;
        // The file that will run, as it is on disk (no one else had it open: it is new).
        let on_disk = {
            let temp = temp.clone();
            tokio::task::spawn_blocking(move || file_sha256(&temp, ARTIFACT_BYTES_MAX))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))
                .and_then(|r| r)
        };
        match on_disk {
            Ok((digest, size)) if digest == artifact.sha256 && size == artifact.size => {}
            Ok((digest, size)) => {
                let _ = std::fs::remove_file(&temp);
                return Err(ReleaseError::ArtifactDigest(format!(
                    "the slot's file has {size} bytes of SHA-256 {digest} on disk, not the artifact's {}",
                    artifact.sha256
                ))
                .to_string());
            }
            Err(e) => {
                let _ = std::fs::remove_file(&temp);
                return Err(format!("update-failed: {}: {e}", temp.display()));
            }
        }
        let placed = (|| {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o755))?;
            std::fs::rename(&temp, &target)?;
            std::fs::File::open(&dir)?.sync_all()
        })();
        if let Err(e) = placed {
            let _ = std::fs::remove_file(&temp);
            return Err(format!("update-failed: {}: {e}", target.display()));
        }
        self.switch(slot, &manifest.version, from_slot, command_id, now_ms)?;
        tracing::info!(version = %manifest.version, slot = slot.as_str(), "release installed; re-executing");
        Ok(target)
    }

    /// The switch an update and a rollback share: the switch to `slot` (holding `version`)
    /// recorded as pending, the marker written, the entrypoint pointed at it, the watchdog armed
    /// from `from_slot`'s binary (the one running). On a failure all is put back as it was.
    /// Returns the binary to re-execute as.
    fn switch(
        &self,
        slot: Slot,
        version: &str,
        from_slot: Slot,
        command_id: Option<&str>,
        now_ms: u64,
    ) -> Result<PathBuf, String> {
        let s = &self.settings;
        let mut state =
            s.load_state().map_err(|e| format!("update-failed: {e}"))?.unwrap_or_else(|| SlotsState::adopted(&self.version));
        let before = state.clone();
        let pending = Pending {
            command_id: command_id.map(str::to_owned),
            slot,
            version: version.to_owned(),
            from_slot,
            from_version: self.version.clone(),
            deadline_ms: now_ms + s.confirm_within_s * 1000,
            confirm_within_s: s.confirm_within_s,
            pid: std::process::id(),
            args: self.launch.args.clone(),
        };
        state.versions.insert(slot, version.to_owned());
        state.versions.entry(from_slot).or_insert_with(|| self.version.clone());
        state.previous = Some(from_slot);
        state.active = slot;
        state.pending = Some(pending);
        let switched = (|| {
            s.save_state(&state)?;
            write_replacing(&s.marker_path(), command_id.unwrap_or("by-hand").as_bytes(), 0o600)
                .map_err(|e| format!("{}: {e}", s.marker_path().display()))?;
            s.point_entrypoint(slot)?;
            self.arm_watchdog(from_slot)
        })();
        if let Err(e) = switched {
            // Back as it was: the old slot active, nothing pending.
            let _ = std::fs::remove_file(s.marker_path());
            let _ = s.point_entrypoint(from_slot);
            let _ = s.save_state(&before);
            return Err(format!("update-failed: {e}"));
        }
        Ok(s.binary(slot))
    }

    /// The pure rollback decision, on the state as it is now.
    pub fn decide_rollback(&self, args: &RollbackArgs, command_id: Option<&str>) -> Result<RollbackPlan, String> {
        let state = self
            .settings
            .load_state()
            .map_err(|e| format!("update-failed: {e}"))?
            .unwrap_or_else(|| SlotsState::adopted(&self.version));
        decide_rollback(&self.version, &state, &args.to_version, command_id)
    }

    /// Carries out a [`RollbackPlan::Switch`]: the same switch as an update's (pending, the
    /// entrypoint, the watchdog), to the previous slot's binary, which must still be there.
    /// Returns the binary to re-execute as.
    pub fn roll_back(&self, plan: RollbackPlan, command_id: Option<&str>, now_ms: u64) -> Result<PathBuf, String> {
        let RollbackPlan::Switch { slot, version, from_slot } = plan else {
            return Err("update-failed: nothing to roll back to".into());
        };
        let binary = self.settings.binary(slot);
        if !binary.is_file() {
            return Err(format!("rollback-unavailable: the previous slot's binary {} is gone", binary.display()));
        }
        let target = self.switch(slot, &version, from_slot, command_id, now_ms)?;
        tracing::info!(version = %version, slot = slot.as_str(), "rolling back to the previous slot; re-executing");
        Ok(target)
    }

    /// Asks the driver to re-execute as `binary` (an installed update).
    pub fn request_reexec(&self, binary: PathBuf) {
        self.reexec.send_replace(Some(binary));
    }

    /// An update by hand (`bcd update`, through the status socket): decided and installed as an
    /// `agent.update` is, with no command to answer. `Ok`: what to tell the person, and the
    /// binary to re-execute as once told (none: nothing to do).
    pub async fn by_hand(&self, args: &UpdateArgs, now_ms: u64) -> Result<(String, Option<PathBuf>), String> {
        match self.decide(args, None, now_ms)? {
            UpdatePlan::Already { version } => Ok((format!("bcd {version} runs already"), None)),
            UpdatePlan::AwaitingConfirmation => Err("update-in-progress: an update waits for its confirmation".into()),
            plan => {
                let UpdatePlan::Install { manifest, slot, .. } = &plan else { unreachable!("matched above") };
                let message = format!(
                    "switched to bcd {} in slot {}; the agent re-executes and confirms its health within {} s, or the watchdog rolls it back",
                    manifest.version,
                    slot.as_str(),
                    self.settings.confirm_within_s
                );
                let binary = self.install(plan, None, now_ms).await?;
                Ok((message, Some(binary)))
            }
        }
    }

    /// Starts the watchdog from the old slot's binary and waits for its first stage, which
    /// detaches the second and ends.
    fn arm_watchdog(&self, from_slot: Slot) -> Result<(), String> {
        let binary = self.settings.binary(from_slot);
        let mut child = std::process::Command::new(&binary)
            .arg(WATCHDOG_COMMAND)
            .arg("--config")
            .arg(&self.launch.config_path)
            .stdin(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("starting the watchdog {}: {e}", binary.display()))?;
        for _ in 0..(WATCHDOG_ARM_TIMEOUT_S * 1000 / 50) {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return Ok(()),
                Ok(Some(status)) => return Err(format!("the watchdog did not start ({status})")),
                Ok(None) => std::thread::sleep(std::time::Duration::from_millis(50)),
                Err(e) => return Err(format!("the watchdog: {e}")),
            }
        }
        let _ = child.kill();
        Err(format!("the watchdog did not start within {WATCHDOG_ARM_TIMEOUT_S} s"))
    }

    /// The new agent confirms its health: it takes the marker (the watchdog then has nothing to
    /// roll back) and records the update done. `false`: the watchdog took it first.
    pub fn confirm(&self, pending: &Pending) -> Result<bool, String> {
        let s = &self.settings;
        match std::fs::rename(s.marker_path(), sibling(&s.marker_path(), ".confirmed")) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(format!("{}: {e}", s.marker_path().display())),
        }
        let mut state = s.load_state()?.unwrap_or_else(|| SlotsState::adopted(&self.version));
        if state.pending.as_ref() == Some(pending) {
            state.pending = None;
        }
        // Confirmed healthy: this version is the node's own now.
        state.raise_floor(&pending.version);
        s.save_state(&state)?;
        tracing::info!(version = %pending.version, slot = pending.slot.as_str(), "the update is confirmed healthy");
        Ok(true)
    }
}

/// Takes the install lock (`slots/install.lock`, an exclusive `flock`, released when the file is
/// closed, so a crashed install leaves none behind), without waiting: held, the install is
/// refused `update-in-progress`.
fn take_install_lock(slots_dir: &Path) -> Result<std::fs::File, String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let path = slots_dir.join(INSTALL_LOCK_FILE);
    let failed = |e: std::io::Error| format!("update-failed: {}: {e}", path.display());
    std::fs::create_dir_all(slots_dir).map_err(failed)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(crate::images::no_follow_flag())
        .open(&path)
        .map_err(failed)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err("update-in-progress: another install (a bcd update or an agent.update) is under way; try again once it is done"
                .into())
        }
        Err(std::fs::TryLockError::Error(e)) => Err(failed(e)),
    }
}

/// Removes the `*.partial` files in a slot's directory (only under the install lock).
fn remove_partials(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().ends_with(crate::images::PARTIAL_SUFFIX) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The SHA-256 (hex) and size of the file at `path`, read to at most `limit` bytes (not
/// following a link).
fn file_sha256(path: &Path, limit: u64) -> std::io::Result<(String, u64)> {
    use sha2::{Digest as _, Sha256};
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(crate::images::no_follow_flag()).open(path)?;
    let mut reader = file.take(limit + 1);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((hex::encode(hasher.finalize()), total))
}

fn artifact_error(e: crate::images::ImageError) -> ReleaseError {
    use crate::images::ImageError;
    match e {
        ImageError::Fetch(m) => ReleaseError::ArtifactFetch(m),
        ImageError::Digest(m) => ReleaseError::ArtifactDigest(m),
        ImageError::Size(m) => ReleaseError::ArtifactSize(m),
        ImageError::Disk(m) => ReleaseError::ArtifactFetch(format!("writing the slot: {m}")),
    }
}

/// Copies an executable into a slot: a temporary file, synced, 0755, renamed.
fn copy_executable(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    if let Some(dir) = to.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temp = sibling(to, ".partial");
    std::fs::copy(from, &temp)?;
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::File::open(&temp)?.sync_all()?;
    std::fs::rename(&temp, to)?;
    std::fs::File::open(to.parent().unwrap_or(Path::new(".")))?.sync_all()
}

/// Writes `<data_dir>/bcd.pid`.
pub fn write_pid_file(data_dir: &Path) -> Result<(), String> {
    let path = data_dir.join(PID_FILE);
    write_replacing(&path, format!("{}\n", std::process::id()).as_bytes(), 0o644).map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether process `pid` runs (a zombie does not).
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's name in parentheses, which may hold anything.
        Ok(stat) => {
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|s| s != "Z" && s != "X")
        }
        Err(_) => false,
    }
}

/// `bcd update`: hands the release to the running agent of `config` ([`crate::status`]).
pub fn request(config: &Config, args: &UpdateArgs) -> Result<String, String> {
    crate::status::request_update(&config.socket_path(), args)
}

/// `bcd __update-watchdog --config C [--detached]`: the first stage starts the second in its
/// own process group (so it outlives the agent's exec and its group's signals) and ends; the
/// second watches the pending update (see the module's header). Returns when there is nothing
/// to do; on a rollback it does not return (it becomes the old agent).
pub fn watchdog(config_path: &Path, detached: bool) -> Result<(), String> {
    use std::os::unix::process::CommandExt as _;
    let config = Config::load(config_path).map_err(|e| e.to_string())?;
    let settings = UpdateSettings::of(&config)?.ok_or("the configuration has no [update]")?;
    if !detached {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        std::process::Command::new(exe)
            .arg(WATCHDOG_COMMAND)
            .arg("--config")
            .arg(config_path)
            .arg("--detached")
            .stdin(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("detaching the watchdog: {e}"))?;
        return Ok(());
    }
    let watched = match settings.load_state()?.and_then(|s| s.pending) {
        Some(p) => p,
        None => return Ok(()),
    };
    tracing::info!(version = %watched.version, slot = watched.slot.as_str(), within_s = watched.confirm_within_s, "watching the update");
    loop {
        let state = settings.load_state()?.ok_or("the slots' state is gone")?;
        let marker = settings.marker_path().exists();
        let now_ms = SystemClock.now_ms();
        match watchdog_verdict(&state, &watched, marker, process_alive(watched.pid), now_ms) {
            WatchdogVerdict::Done => {
                tracing::info!(version = %watched.version, "the update was confirmed; the watchdog ends");
                return Ok(());
            }
            WatchdogVerdict::Wait => std::thread::sleep(std::time::Duration::from_millis(WATCHDOG_POLL_MS)),
            WatchdogVerdict::RollBack => break,
        }
    }
    // Take the marker: if the new agent confirmed meanwhile, it has it and this ends.
    match std::fs::rename(settings.marker_path(), sibling(&settings.marker_path(), ".rolled-back")) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", settings.marker_path().display())),
    }
    let reason = rollback_reason(&watched);
    tracing::warn!(reason = %reason, "rolling back");
    if process_alive(watched.pid) {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(watched.pid as i32).ok_or("pid 0")?,
            rustix::process::Signal::KILL,
        );
        let mut waited_ms = 0;
        while process_alive(watched.pid) && waited_ms < WATCHDOG_KILL_WAIT_MS {
            std::thread::sleep(std::time::Duration::from_millis(50));
            waited_ms += 50;
        }
    }
    settings.point_entrypoint(watched.from_slot)?;
    let mut state = settings.load_state()?.ok_or("the slots' state is gone")?;
    state.active = watched.from_slot;
    state.previous = Some(watched.slot);
    state.pending = None;
    state.last_rollback = Some(Rollback {
        command_id: watched.command_id.clone(),
        slot: watched.slot,
        version: watched.version.clone(),
        back_slot: watched.from_slot,
        back_version: watched.from_version.clone(),
        reason,
        at_ms: SystemClock.now_ms(),
        reported: false,
    });
    settings.save_state(&state)?;
    let binary = settings.binary(watched.from_slot);
    let e = std::process::Command::new(&binary).args(&watched.args).exec();
    Err(format!("starting the old agent {}: {e}", binary.display()))
}

#[cfg(test)]
mod tests {
    use bc_core::release::{MANIFEST_FORMAT, ReleaseKey, sign};

    use super::*;

    /// 2026-05-01T00:00:00Z.
    const NOW_MS: u64 = 1_777_593_600_000;

    fn release(key: &ReleaseKey, version: &str) -> UpdateArgs {
        let manifest = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: version.into(),
            min_update_from: None,
            allow_downgrade: false,
            not_after: None,
            key_id: key.key_id().into(),
            artifacts: vec![Artifact {
                arch: "x86_64".into(),
                url: "http://127.0.0.1:1/bcd".into(),
                sha256: "cd".repeat(32),
                size: 10,
            }],
        };
        let text = manifest.to_text();
        UpdateArgs { signature: sign(key, text.as_bytes()), manifest: text, rollout_id: None }
    }

    fn pending(command: &str) -> Pending {
        Pending {
            command_id: Some(command.into()),
            slot: Slot::B,
            version: "0.2.0".into(),
            from_slot: Slot::A,
            from_version: "0.1.0".into(),
            deadline_ms: 10_000,
            confirm_within_s: 10,
            pid: 42,
            args: vec!["node".into()],
        }
    }

    #[test]
    fn an_update_installs_into_the_inactive_slot_or_says_why_not() {
        let key = ReleaseKey::from_seed([1; 32]);
        let trusted = [key.public().clone()];
        let state = SlotsState::adopted("0.1.0");
        let plan = decide_update("0.1.0", &trusted, &release(&key, "0.2.0"), "x86_64", &state, Some("cmd_1"), NOW_MS).unwrap();
        let UpdatePlan::Install { slot, from_slot, manifest, artifact } = plan else { panic!("{plan:?}") };
        assert_eq!((slot, from_slot, manifest.version.as_str(), artifact.size), (Slot::B, Slot::A, "0.2.0", 10));
        let on_b = SlotsState { active: Slot::B, ..state.clone() };
        let plan = decide_update("0.1.0", &trusted, &release(&key, "0.2.0"), "x86_64", &on_b, None, NOW_MS).unwrap();
        assert!(matches!(plan, UpdatePlan::Install { slot: Slot::A, from_slot: Slot::B, .. }));

        let reason = |r: Result<UpdatePlan, String>| r.unwrap_err().split(':').next().unwrap().to_owned();
        assert_eq!(
            reason(decide_update("0.1.0", &[], &release(&key, "0.2.0"), "x86_64", &state, None, NOW_MS)),
            "update-unconfigured"
        );
        let other = ReleaseKey::from_seed([2; 32]);
        assert_eq!(
            reason(decide_update("0.1.0", &trusted, &release(&other, "0.2.0"), "x86_64", &state, None, NOW_MS)),
            "release-untrusted-key"
        );
        let mut tampered = release(&key, "0.2.0");
        tampered.manifest = tampered.manifest.replace("0.2.0", "0.2.1");
        assert_eq!(reason(decide_update("0.1.0", &trusted, &tampered, "x86_64", &state, None, NOW_MS)), "release-bad-signature");
        assert_eq!(
            reason(decide_update("0.3.0", &trusted, &release(&key, "0.2.0"), "x86_64", &state, None, NOW_MS)),
            "release-downgrade"
        );
        assert_eq!(
            reason(decide_update("0.1.0", &trusted, &release(&key, "0.2.0"), "riscv64", &state, None, NOW_MS)),
            "artifact-no-arch"
        );
        assert_eq!(
            decide_update("0.2.0", &trusted, &release(&key, "0.2.0"), "x86_64", &state, None, NOW_MS),
            Ok(UpdatePlan::Already { version: "0.2.0".into() })
        );
    }

    /// A node that ran 0.3.0 and was rolled back to 0.1.0 is not taken to 0.2.0 by a
    /// manifest that allows no downgrade; one that does, within its notAfter, takes it.
    #[test]
    fn an_update_below_the_floor_needs_a_valid_downgrade_permission() {
        let key = ReleaseKey::from_seed([1; 32]);
        let trusted = [key.public().clone()];
        let mut state = SlotsState::adopted("0.1.0");
        state.raise_floor("0.3.0");
        state.raise_floor("0.2.5");
        state.raise_floor("junk");
        assert_eq!(state.floor_version.as_deref(), Some("0.3.0"), "the floor only rises");
        let refused = decide_update("0.1.0", &trusted, &release(&key, "0.2.0"), "x86_64", &state, None, NOW_MS).unwrap_err();
        assert!(refused.starts_with("release-downgrade: ") && refused.contains("this node has run 0.3.0"), "{refused}");
        let upgrade = decide_update("0.1.0", &trusted, &release(&key, "0.4.0"), "x86_64", &state, None, NOW_MS);
        assert!(matches!(upgrade, Ok(UpdatePlan::Install { .. })), "{upgrade:?}");

        let downgrade = |not_after: &str| {
            let manifest = Manifest {
                allow_downgrade: true,
                not_after: Some(not_after.into()),
                ..Manifest::parse(release(&key, "0.2.0").manifest.as_bytes()).unwrap()
            };
            let text = manifest.to_text();
            UpdateArgs { signature: sign(&key, text.as_bytes()), manifest: text, rollout_id: None }
        };
        let allowed = decide_update("0.1.0", &trusted, &downgrade("2026-05-02T00:00:00Z"), "x86_64", &state, None, NOW_MS);
        assert!(matches!(allowed, Ok(UpdatePlan::Install { .. })), "{allowed:?}");
        let expired =
            decide_update("0.1.0", &trusted, &downgrade("2026-04-30T00:00:00Z"), "x86_64", &state, None, NOW_MS).unwrap_err();
        assert!(expired.starts_with("release-expired: "), "{expired}");
    }

    #[test]
    fn a_pending_update_waits_for_its_confirmation_and_blocks_others() {
        let key = ReleaseKey::from_seed([1; 32]);
        let trusted = [key.public().clone()];
        let state = SlotsState { pending: Some(pending("cmd_1")), active: Slot::B, ..SlotsState::adopted("0.1.0") };
        assert_eq!(
            decide_update("0.2.0", &trusted, &release(&key, "0.2.0"), "x86_64", &state, Some("cmd_1"), NOW_MS),
            Ok(UpdatePlan::AwaitingConfirmation)
        );
        let other =
            decide_update("0.2.0", &trusted, &release(&key, "0.3.0"), "x86_64", &state, Some("cmd_2"), NOW_MS).unwrap_err();
        assert!(other.starts_with("update-in-progress: "), "{other}");
    }

    #[test]
    fn a_rollback_goes_back_to_the_previous_slot_only_when_it_holds_the_version() {
        let fresh = SlotsState::adopted("0.1.0");
        let refused = |r: Result<RollbackPlan, String>| r.unwrap_err();
        // Already there: succeeded at once, whatever the slots.
        assert_eq!(
            decide_rollback("0.1.0", &fresh, "0.1.0", Some("cmd_1")),
            Ok(RollbackPlan::Already { version: "0.1.0".into() })
        );
        assert_eq!(
            refused(decide_rollback("0.1.0", &fresh, "0.0.9", Some("cmd_1"))),
            "rollback-unavailable: no previous slot (this node runs 0.1.0 and never switched slots)"
        );
        // Updated from a (0.1.0) to b (0.2.0).
        let on_b = SlotsState {
            active: Slot::B,
            previous: Some(Slot::A),
            versions: BTreeMap::from([(Slot::A, "0.1.0".to_owned()), (Slot::B, "0.2.0".to_owned())]),
            ..fresh.clone()
        };
        assert_eq!(
            decide_rollback("0.2.0", &on_b, "0.1.0", Some("cmd_1")),
            Ok(RollbackPlan::Switch { slot: Slot::A, version: "0.1.0".into(), from_slot: Slot::B })
        );
        assert_eq!(
            refused(decide_rollback("0.2.0", &on_b, "0.0.9", Some("cmd_1"))),
            "rollback-unavailable: the previous slot holds 0.1.0, not 0.0.9 (slot a)"
        );
        let unknown = SlotsState { versions: BTreeMap::from([(Slot::B, "0.2.0".to_owned())]), ..on_b.clone() };
        assert!(refused(decide_rollback("0.2.0", &unknown, "0.1.0", None)).starts_with("rollback-unavailable: "));
        // Back on a by a watchdog's rollback: b (the bad one) is the previous slot.
        let rolled = SlotsState { active: Slot::A, previous: Some(Slot::B), ..on_b.clone() };
        assert!(
            refused(decide_rollback("0.1.0", &rolled, "0.0.9", None))
                .starts_with("rollback-unavailable: the previous slot holds 0.2.0")
        );
        // Switched back and waiting for the confirmation: redelivered to the agent of slot a,
        // it waits (not `already`), and blocks any other switch.
        let waiting = SlotsState {
            active: Slot::A,
            previous: Some(Slot::B),
            pending: Some(Pending {
                slot: Slot::A,
                version: "0.1.0".into(),
                from_slot: Slot::B,
                from_version: "0.2.0".into(),
                ..pending("cmd_1")
            }),
            ..on_b.clone()
        };
        assert_eq!(decide_rollback("0.1.0", &waiting, "0.1.0", Some("cmd_1")), Ok(RollbackPlan::AwaitingConfirmation));
        assert!(refused(decide_rollback("0.1.0", &waiting, "0.1.0", Some("cmd_2"))).starts_with("update-in-progress: "));
        // An update waiting for its confirmation blocks a rollback too, and the reverse.
        let updating = SlotsState { pending: Some(pending("cmd_1")), ..on_b.clone() };
        assert!(refused(decide_rollback("0.2.0", &updating, "0.1.0", Some("cmd_2"))).starts_with("update-in-progress: "));
    }

    #[test]
    fn the_watchdog_rolls_back_past_the_deadline_or_when_the_agent_is_gone() {
        let watched = pending("cmd_1");
        let state = SlotsState { pending: Some(watched.clone()), active: Slot::B, ..SlotsState::adopted("0.1.0") };
        assert_eq!(watchdog_verdict(&state, &watched, true, true, 9_999), WatchdogVerdict::Wait);
        assert_eq!(watchdog_verdict(&state, &watched, true, true, 10_000), WatchdogVerdict::RollBack);
        assert_eq!(watchdog_verdict(&state, &watched, true, false, 1), WatchdogVerdict::RollBack);
        assert_eq!(
            watchdog_verdict(&state, &watched, false, false, 10_000),
            WatchdogVerdict::Done,
            "confirmed: the marker is gone"
        );
        let confirmed = SlotsState { pending: None, ..state.clone() };
        assert_eq!(watchdog_verdict(&confirmed, &watched, true, true, 10_000), WatchdogVerdict::Done);
        let another = SlotsState { pending: Some(pending("cmd_2")), ..state };
        assert_eq!(watchdog_verdict(&another, &watched, true, true, 10_000), WatchdogVerdict::Done);
        assert_eq!(
            rollback_reason(&watched),
            "rolled-back: the agent 0.2.0 did not confirm health within 10 s; back on slot a (version 0.1.0)"
        );
    }

    #[test]
    fn a_trailer_names_a_version_only_when_it_is_one() {
        assert_eq!(trailer_version(b"\x7fELF...\nbcd-fakehw-version=0.2.0\n"), Some("0.2.0".into()));
        assert_eq!(trailer_version(b"\nbcd-fakehw-version=0.2.0"), None, "no final newline");
        assert_eq!(trailer_version(b"\nbcd-fakehw-version=two\n"), None);
        assert_eq!(trailer_version(b"\x7fELF and nothing else"), None);
    }

    #[test]
    fn slots_are_adopted_switched_and_confirmed_once() {
        let dir = tempfile::tempdir().unwrap();
        let config: Config = toml::from_str(&format!(
            "data_dir = {:?}\ngateway = \"http://127.0.0.1:9\"\nlog_key_pin = \"sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\"\n[update]\nrelease_keys = [{:?}]\nconfirm_within_s = 10\n",
            dir.path().display().to_string(),
            ReleaseKey::from_seed([1; 32]).public().line()
        ))
        .unwrap();
        let settings = UpdateSettings::of(&config).unwrap().unwrap();
        assert_eq!((settings.confirm_within_s, settings.healthy_after_s), (10, 5));
        let launch = Launch { config_path: "/c".into(), args: vec!["node".into()] };
        let updater = Updater::new(settings.clone(), "0.1.0".into(), launch).unwrap();
        let first = updater.start().unwrap();
        assert_eq!((first.slot, first.previous_version.as_deref()), (Slot::A, None));
        assert!(settings.binary(Slot::A).exists());
        assert_eq!(std::fs::read_link(&settings.entrypoint).unwrap(), settings.binary(Slot::A));
        let second = updater.start().unwrap();
        assert_eq!(second.previous_version.as_deref(), Some("0.1.0"));

        // Pending on b: the confirmation takes the marker once.
        let watched = pending("cmd_1");
        let mut state = settings.load_state().unwrap().unwrap();
        state.pending = Some(watched.clone());
        state.active = Slot::B;
        settings.save_state(&state).unwrap();
        write_replacing(&settings.marker_path(), b"cmd_1", 0o600).unwrap();
        settings.point_entrypoint(Slot::B).unwrap();
        assert_eq!(std::fs::read_link(&settings.entrypoint).unwrap(), settings.binary(Slot::B));
        assert_eq!(updater.start().unwrap().pending, Some(watched.clone()));
        assert_eq!(settings.load_state().unwrap().unwrap().floor_version.as_deref(), Some("0.1.0"), "started: its floor");
        assert!(updater.confirm(&watched).unwrap());
        assert!(!updater.confirm(&watched).unwrap(), "taken once");
        assert_eq!(settings.load_state().unwrap().unwrap().pending, None);
        assert_eq!(settings.load_state().unwrap().unwrap().floor_version.as_deref(), Some("0.2.0"), "confirmed: the floor");

        // A rollback to a previous slot whose binary is gone is refused; nothing moves.
        let on_b = Updater::new(settings.clone(), "0.2.0".into(), Launch { config_path: "/c".into(), args: vec![] }).unwrap();
        let mut state = settings.load_state().unwrap().unwrap();
        state.previous = Some(Slot::A);
        state.versions.insert(Slot::B, "0.2.0".into());
        settings.save_state(&state).unwrap();
        let args = RollbackArgs { to_version: "0.1.0".into(), rollout_id: None };
        let plan = on_b.decide_rollback(&args, Some("cmd_2")).unwrap();
        assert_eq!(plan, RollbackPlan::Switch { slot: Slot::A, version: "0.1.0".into(), from_slot: Slot::B });
        std::fs::remove_file(settings.binary(Slot::A)).unwrap();
        let refused = on_b.roll_back(plan, Some("cmd_2"), 1).unwrap_err();
        assert!(refused.starts_with("rollback-unavailable: the previous slot's binary "), "{refused}");
        assert_eq!(settings.load_state().unwrap().unwrap(), state);
        assert_eq!(std::fs::read_link(&settings.entrypoint).unwrap(), settings.binary(Slot::B));
    }

    /// A loopback HTTP/1.1 server of `bodies` at `/0`, `/1`, …, each sent a chunk at a time with
    /// a pause between, so two downloads at once overlap.
    async fn paced_server(bodies: Vec<Vec<u8>>) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        const CHUNK_BYTES: usize = 4096;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let bodies = std::sync::Arc::new(bodies);
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let bodies = bodies.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let path = String::from_utf8_lossy(&head).split_whitespace().nth(1).unwrap_or("").to_owned();
                    let Some(body) = path.strip_prefix('/').and_then(|i| i.parse::<usize>().ok()).and_then(|i| bodies.get(i))
                    else {
                        let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n").await;
                        return;
                    };
                    let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
                    if stream.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    for chunk in body.chunks(CHUNK_BYTES) {
                        if stream.write_all(chunk).await.is_err() || stream.flush().await.is_err() {
                            return;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    }
                    let _ = stream.shutdown().await;
                });
            }
        });
        base
    }

    /// Regression: every install downloaded into one `slots/<x>/bcd.partial`, opened
    /// with truncate, and checked the stream, not the file: a `bcd update` by hand and a command
    /// at once wrote into one file, and what ran was neither release. Now one install holds the
    /// lock and the other is refused; the slot's binary is the winner's, byte for byte.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_installs_at_once_end_with_a_binary_whose_hash_is_the_manifests() {
        use sha2::{Digest as _, Sha256};
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let key = ReleaseKey::from_seed([1; 32]);
        let config: Config = toml::from_str(&format!(
            "data_dir = {:?}\ngateway = \"http://127.0.0.1:9\"\nlog_key_pin = \"sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\"\n[update]\nrelease_keys = [{:?}]\nconfirm_within_s = 10\n",
            dir.path().display().to_string(),
            key.public().line()
        ))
        .unwrap();
        let settings = UpdateSettings::of(&config).unwrap().unwrap();
        let updater = Updater::new(settings.clone(), "0.1.0".into(), Launch { config_path: "/c".into(), args: vec![] }).unwrap();
        updater.start().unwrap();
        // Slot a's binary arms the watchdog: here a script that arms at once (a test is no bcd).
        std::fs::write(settings.binary(Slot::A), b"#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(settings.binary(Slot::A), std::fs::Permissions::from_mode(0o755)).unwrap();

        let bodies: Vec<Vec<u8>> = [b'2', b'3'].iter().map(|b| [*b; 7].repeat(64 * 1024)).collect();
        let base = paced_server(bodies.clone()).await;
        let versions = ["0.2.0", "0.3.0"];
        let digests: Vec<String> = bodies.iter().map(|b| hex::encode(Sha256::digest(b))).collect();
        let plans: Vec<UpdatePlan> = (0..2)
            .map(|i| {
                let manifest = Manifest {
                    artifacts: vec![Artifact {
                        arch: std::env::consts::ARCH.into(),
                        url: format!("{base}/{i}"),
                        sha256: digests[i].clone(),
                        size: bodies[i].len() as u64,
                    }],
                    ..Manifest::parse(release(&key, versions[i]).manifest.as_bytes()).unwrap()
                };
                let text = manifest.to_text();
                let args = UpdateArgs { signature: sign(&key, text.as_bytes()), manifest: text, rollout_id: None };
                updater.decide(&args, None, NOW_MS).unwrap()
            })
            .collect();
        let [by_hand, command] = <[UpdatePlan; 2]>::try_from(plans).unwrap();
        let results = {
            let (a, b) = tokio::join!(updater.install(by_hand, None, NOW_MS), updater.install(command, Some("cmd_1"), NOW_MS));
            [a, b]
        };
        let won: Vec<usize> = (0..2).filter(|i| results[*i].is_ok()).collect();
        assert_eq!(won.len(), 1, "one install, the other refused: {results:?}");
        let (winner, loser) = (won[0], 1 - won[0]);
        let refused = results[loser].as_ref().unwrap_err();
        assert!(refused.starts_with("update-in-progress: "), "{refused}");
        let installed = std::fs::read(settings.binary(Slot::B)).unwrap();
        assert_eq!(hex::encode(Sha256::digest(&installed)), digests[winner], "the slot holds the winner's release");
        let state = settings.load_state().unwrap().unwrap();
        assert_eq!(state.pending.as_ref().map(|p| p.version.as_str()), Some(versions[winner]));
        assert_eq!(state.versions.get(&Slot::B).map(String::as_str), Some(versions[winner]));
        let left: Vec<_> = std::fs::read_dir(settings.slots_dir.join("b"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| n != BINARY_FILE)
            .collect();
        assert!(left.is_empty(), "no partial file left: {left:?}");
    }
}
