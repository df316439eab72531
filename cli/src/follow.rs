//! `audit follow URL`: a monitor over HTTP. Each round fetches the tenant's checkpoint, its keys
//! (to find the pinned one), and for every leaf past the last checkpoint seen the entry bundle,
//! the level-0 tile and the event bundle (`schema/LOG-FORMAT.md`, "Tiles"); the checks are
//! `bc_core::follow`'s. A checkpoint signed by a key not trusted yet makes it fetch the key
//! rotations' proofs (`rotations`) and trust the new keys the trusted ones vouch for, as
//! `check-proof` does; a forged rotation is refused. The state file keeps the last accepted
//! checkpoint and its compact range, replaced atomically, 0600. A fork or a bad entry ends the
//! command with `AUDIT_FORK` or `AUDIT_BAD_ENTRY` (exit 3), naming the tenant and the size or
//! index.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use bc_core::follow::{FollowError, FollowState};
use bc_core::id::TenantId;
use bc_core::merkle::Hash;
use bc_core::note::Vkey;
use bc_core::tiles::{self, TILE_WIDTH, TilePath, TileRef};
use ed25519_dalek::VerifyingKey;
use serde_json::{Value, json};

use crate::client::{self, CliError};

/// Largest response read (a full event bundle of 256 events of 64 KiB payloads is ~17 MiB).
const FOLLOW_RESPONSE_BYTES_MAX: usize = 32 * 1024 * 1024;
const FOLLOW_TIMEOUT_S: u64 = 60;

/// GETs under `URL/audit/TENANT/` with the caller's token: `audit follow`'s, and the tiles
/// `usage export --with-proofs` builds its proofs from.
pub(crate) struct Fetcher {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Fetcher {
    pub(crate) fn new(url: &str, tenant: &str) -> Result<Self, CliError> {
        let parsed = client::api_url(url)?;
        let http = client::api_http(&parsed, reqwest::Client::builder().timeout(Duration::from_secs(FOLLOW_TIMEOUT_S)))?;
        let token = crate::credentials::token(url)?;
        Ok(Self { http, base: format!("{}/audit/{tenant}", url.trim_end_matches('/')), token })
    }

    /// `Ok(None)` for 404.
    pub(crate) async fn get(&self, path: &str) -> Result<Option<Vec<u8>>, CliError> {
        let unavailable = |e: String| CliError::new("UNAVAILABLE", format!("GET {}/{path}: {e}", self.base));
        let response = self
            .http
            .get(format!("{}/{path}", self.base))
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let status = response.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            return Err(CliError::new(
                if status.as_u16() == 401 { "UNAUTHENTICATED" } else { "UNAVAILABLE" },
                format!("GET {path}: {status}: {body}"),
            ));
        }
        let bytes = response.bytes().await.map_err(|e| unavailable(e.to_string()))?;
        if bytes.len() > FOLLOW_RESPONSE_BYTES_MAX {
            return Err(unavailable("response too large".into()));
        }
        Ok(Some(bytes.to_vec()))
    }

    /// A file the checkpoint covers: its absence is the server's fault (`INVALID_RESPONSE`).
    pub(crate) async fn must(&self, path: &str) -> Result<Vec<u8>, CliError> {
        self.get(path)
            .await?
            .ok_or_else(|| CliError::new("INVALID_RESPONSE", format!("GET {path}: not found, though the checkpoint covers it")))
    }
}

fn follow_error(e: FollowError) -> CliError {
    let message = e.to_string();
    match e {
        FollowError::Fork { tenant, size, .. } => {
            let mut err = CliError::new("AUDIT_FORK", message);
            err.details = Some(json!({ "tenant": tenant, "size": size }));
            err
        }
        FollowError::BadEntry { tenant, index, .. } => {
            let mut err = CliError::new("AUDIT_BAD_ENTRY", message);
            err.details = Some(json!({ "tenant": tenant, "index": index }));
            err
        }
        FollowError::Invalid(m) | FollowError::Untrusted(m) => CliError::new("INVALID_PROOF", m),
    }
}

fn load_state(path: &Path, tenant: TenantId) -> Result<FollowState, CliError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let state: FollowState = serde_json::from_slice(&bytes)
                .map_err(|e| CliError::usage(format!("the state file {} does not parse: {e}", path.display())))?;
            if state.tenant != tenant.to_string() {
                return Err(CliError::usage(format!(
                    "the state file {} follows tenant {}, not {tenant}",
                    path.display(),
                    state.tenant
                )));
            }
            Ok(state)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FollowState::new(tenant)),
        Err(e) => Err(CliError::usage(format!("cannot read {}: {e}", path.display()))),
    }
}

/// Replaces the state file atomically: a new 0600 file beside it, synced, renamed over it.
fn save_state(path: &Path, state: &FollowState) -> Result<(), CliError> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let temp = dir.join(format!(".{}.{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("state"), std::process::id()));
    let bytes = serde_json::to_vec_pretty(state).map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
    let written = (|| {
        let _ = std::fs::remove_file(&temp);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&temp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    written.map_err(|e| {
        let _ = std::fs::remove_file(&temp);
        CliError::new("INTERNAL", format!("writing {}: {e}", path.display()))
    })
}

fn tile_path(kind: TilePath) -> String {
    tiles::tile_path(kind)
}

/// One round: returns the JSON summary.
async fn round(
    f: &Fetcher,
    state: &mut FollowState,
    pins: &[String],
    vkeys: &[Vkey],
    state_path: &Path,
) -> Result<Value, CliError> {
    let Some(note) = f.get("checkpoint").await? else {
        return Ok(json!({ "tenant": state.tenant, "size": state.size, "checked": 0, "said": "no checkpoint sealed yet" }));
    };
    let note = String::from_utf8(note).map_err(|_| CliError::new("INVALID_PROOF", "the checkpoint is not UTF-8"))?;
    let mut pinned: Vec<VerifyingKey> = vkeys.iter().map(|v| v.public).collect();
    if !pins.is_empty() {
        let keys = f.get("keys").await?.unwrap_or_default();
        for line in String::from_utf8_lossy(&keys).lines() {
            if let Ok(v) = Vkey::parse(line)
                && pins.contains(&v.pin())
            {
                pinned.push(v.public);
            }
        }
    }
    let mut trusted = state.trusted(&pinned);
    if trusted.is_empty() {
        return Err(CliError::new("INVALID_PROOF", "no key the log serves matches --pin")
            .hint("check the pin with `better-compute pki show`"));
    }
    let origin = note.lines().next().unwrap_or_default();
    let deployment = origin.strip_suffix(&format!("/audit/{}", state.tenant)).unwrap_or(origin).to_owned();
    let checked = match state.check_checkpoint(&note, &trusted, &deployment) {
        // Signed by a key not trusted yet: a rotation the trusted keys vouch for may introduce it.
        Err(FollowError::Untrusted(_)) => {
            let rotations = match f.get("rotations").await? {
                None => vec![],
                Some(bytes) => bc_core::note::parse_rotations(&bytes)
                    .map_err(|e| CliError::new("INVALID_PROOF", format!("tenant {}: {e}", state.tenant)))?,
            };
            let learned = state.learn_rotations(&rotations, &pinned).map_err(follow_error)?;
            if learned > 0 {
                eprintln!("tenant {}: learned {learned} rotated log key(s) from rotations the trusted key signed", state.tenant);
            }
            trusted = state.trusted(&pinned);
            state.check_checkpoint(&note, &trusted, &deployment)
        }
        other => other,
    };
    let Some(body) = checked.map_err(follow_error)? else {
        return Ok(json!({ "tenant": state.tenant, "size": state.size, "checked": 0 }));
    };
    let (mut entries, mut tile, mut events) = (Vec::new(), Vec::<Hash>::new(), Vec::new());
    let first = state.size;
    for n in first / TILE_WIDTH..=(body.size - 1) / TILE_WIDTH {
        let width = TILE_WIDTH.min(body.size - n * TILE_WIDTH);
        let t = TileRef { index: n, width };
        let skip = first.saturating_sub(n * TILE_WIDTH) as usize;
        let bad = |what: String| CliError::new("INVALID_PROOF", format!("tenant {}: bundle {n}: {what}", state.tenant));
        let e = tiles::parse_entry_bundle(&f.must(&tile_path(TilePath::Entries(t))).await?).map_err(bad)?;
        let h = f.must(&tile_path(TilePath::Hashes { level: 0, tile: t })).await?;
        let v = tiles::parse_event_bundle(&f.must(&tile_path(TilePath::Events(t))).await?).map_err(bad)?;
        if e.len() as u64 != width || v.len() as u64 != width || h.len() as u64 != width * 32 {
            return Err(bad(format!("wanted {width} entries, hashes and events")));
        }
        entries.extend(e.into_iter().skip(skip));
        tile.extend(h.chunks(32).skip(skip).map(|c| <Hash>::try_from(c).expect("32 bytes")));
        events.extend(v.into_iter().skip(skip));
        eprintln!("tenant {}: fetched leaves {}..{}", state.tenant, (n * TILE_WIDTH).max(first), n * TILE_WIDTH + width);
    }
    let checked = state.advance(&body, &note, &entries, &tile, &events, &trusted).map_err(follow_error)?;
    save_state(state_path, state)?;
    eprintln!("tenant {}: checked {checked} new entries; the log extends what was seen, size {}", state.tenant, state.size);
    Ok(json!({ "tenant": state.tenant, "size": state.size, "checked": checked, "rotatedKeys": state.rotated_keys.len() }))
}

pub async fn run(
    url: &str,
    tenant: Option<TenantId>,
    pins: &[String],
    vkeys: &[String],
    state_path: &Path,
    once: bool,
    interval_ms: u64,
) -> Result<Value, CliError> {
    if pins.is_empty() && vkeys.is_empty() {
        return Err(CliError::usage("give --pin PIN (or BETTER_COMPUTE_AUDIT_PIN) or --vkey VKEY: the key you trust"));
    }
    let vkeys: Vec<Vkey> =
        vkeys.iter().map(|v| Vkey::parse(v).map_err(|e| CliError::usage(format!("--vkey: {e}")))).collect::<Result<_, _>>()?;
    let tenant = tenant.unwrap_or(TenantId::ROOT);
    let f = Fetcher::new(url, &tenant.to_string())?;
    let mut state = load_state(state_path, tenant)?;
    loop {
        let result = round(&f, &mut state, pins, &vkeys, state_path).await;
        match result {
            Ok(summary) if once => return Ok(summary),
            Ok(summary) => println!("{summary}"),
            // A fork or a bad entry ends the monitor; an unreachable server is retried.
            Err(e) if !once && matches!(e.code.as_str(), "UNAVAILABLE") => eprintln!("{}: {} (retrying)", e.code, e.message),
            Err(e) => return Err(e),
        }
        tokio::time::sleep(Duration::from_millis(interval_ms.max(100))).await;
    }
}
