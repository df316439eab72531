//! Saved credentials: `auth login`, `auth status`, `auth logout`, and which token a command
//! uses.
//!
//! A command takes the first credential it finds: `BETTER_COMPUTE_TOKEN`; else the saved
//! profile `BETTER_COMPUTE_PROFILE`, else the file's current profile, else `default`. A saved
//! token is used only for the origin (scheme, host, port) it was saved for, so a token for one
//! deployment is never sent to another. The file is `BETTER_COMPUTE_CREDENTIALS`, else
//! `$XDG_CONFIG_HOME/better-compute/credentials.json`, else
//! `~/.config/better-compute/credentials.json`; every write replaces it atomically (a new 0600
//! file renamed over it), and its directory is created 0700.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::client::{CliError, Client};

/// Longest token accepted from standard input.
const TOKEN_BYTES_MAX: usize = 4096;
/// Largest credentials file read.
const FILE_BYTES_MAX: u64 = 1024 * 1024;
/// Profiles one file may hold.
const PROFILES_MAX: usize = 64;

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Profile {
    pub url: String,
    pub token: String,
    pub tenant_id: Option<String>,
    pub key_id: Option<String>,
    pub saved_at_ms: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct File {
    pub current: Option<String>,
    pub profiles: BTreeMap<String, Profile>,
}

pub fn path() -> Result<PathBuf, CliError> {
    if let Ok(p) = std::env::var("BETTER_COMPUTE_CREDENTIALS")
        && !p.is_empty()
    {
        return Ok(PathBuf::from(p));
    }
    let base = match std::env::var("XDG_CONFIG_HOME") {
        Ok(x) if !x.is_empty() => PathBuf::from(x),
        _ => {
            let home = std::env::var("HOME").map_err(|_| {
                CliError::new("MISSING_ENV", "neither BETTER_COMPUTE_CREDENTIALS, XDG_CONFIG_HOME nor HOME is set")
            })?;
            PathBuf::from(home).join(".config")
        }
    };
    Ok(base.join("better-compute").join("credentials.json"))
}

pub fn load(path: &Path) -> Result<File, CliError> {
    let text = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(File::default()),
        Err(e) => return Err(CliError::new("INTERNAL", format!("reading {}: {e}", path.display()))),
        Ok(m) if m.len() > FILE_BYTES_MAX => {
            return Err(CliError::new("INVALID_CREDENTIALS", format!("{} is larger than 1 MiB", path.display())));
        }
        Ok(_) => {
            std::fs::read_to_string(path).map_err(|e| CliError::new("INTERNAL", format!("reading {}: {e}", path.display())))?
        }
    };
    serde_json::from_str(&text).map_err(|e| {
        CliError::new("INVALID_CREDENTIALS", format!("{} is not a credentials file: {e}", path.display()))
            .hint("fix or remove it, then run auth login again")
    })
}

/// Replaces the file atomically: a new 0600 file beside it, flushed, renamed over it.
pub fn save(path: &Path, file: &File) -> Result<(), CliError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| CliError::new("INTERNAL", format!("creating {}: {e}", dir.display())))?;
    let temp = dir.join(format!(".credentials.{}.tmp", ulid::Ulid::generate().to_string().to_lowercase()));
    let bytes = serde_json::to_vec_pretty(file).map_err(|e| CliError::new("INTERNAL", e.to_string()))?;
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&temp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&temp, path)?;
        // The rename itself survives a crash only once the directory is synced.
        std::fs::File::open(dir)?.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(CliError::new("INTERNAL", format!("writing {}: {e}", path.display())));
    }
    Ok(())
}

/// `scheme://host:port` of a URL, for matching a profile to the command's URL.
fn origin(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    Some(format!("{}://{}:{}", u.scheme(), u.host_str()?, u.port_or_known_default()?))
}

fn profile_name() -> Option<String> {
    std::env::var("BETTER_COMPUTE_PROFILE").ok().filter(|p| !p.is_empty())
}

/// Where a command's token comes from.
pub enum Source {
    Env(String),
    Profile { name: String, profile: Profile },
}

/// The credential for a command calling `url`, or `None`.
pub fn resolve(url: &str) -> Result<Option<Source>, CliError> {
    if let Some(token) = std::env::var("BETTER_COMPUTE_TOKEN").ok().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()) {
        return Ok(Some(Source::Env(token)));
    }
    let file = load(&path()?)?;
    let name = profile_name().or(file.current.clone()).unwrap_or_else(|| "default".into());
    let Some(profile) = file.profiles.get(&name) else { return Ok(None) };
    if origin(&profile.url).is_none() || origin(&profile.url) != origin(url) {
        // Saved for another deployment: never send it here.
        return Ok(None);
    }
    if crate::client::api_url(&profile.url).is_err() {
        // Saved (by an older client, or by hand) for a URL the policy refuses: never use it.
        return Ok(None);
    }
    Ok(Some(Source::Profile { name, profile: profile.clone() }))
}

/// The token for a command calling `url`, or MISSING_ENV with what to do.
pub fn token(url: &str) -> Result<String, CliError> {
    match resolve(url)? {
        Some(Source::Env(t)) => Ok(t),
        Some(Source::Profile { profile, .. }) => Ok(profile.token),
        None => Err(CliError::new("MISSING_ENV", format!("no credential for {url}"))
            .hint("export BETTER_COMPUTE_TOKEN=…, or run `better-compute auth login --url URL < token.txt`")),
    }
}

fn valid_profile_name(name: &str) -> Result<(), CliError> {
    let ok =
        !name.is_empty() && name.len() <= 63 && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok { Ok(()) } else { Err(CliError::usage(format!("--profile {name:?} must be 1 to 63 of A-Z a-z 0-9 - _ ."))) }
}

/// `auth login`: the token from standard input or `BETTER_COMPUTE_TOKEN`, checked with
/// `system.whoami` unless `--no-verify`, saved under the profile, which becomes current.
pub async fn login(url: &str, profile: Option<&str>, verify: bool) -> Result<Value, CliError> {
    let name = profile.map(str::to_owned).or_else(profile_name).unwrap_or_else(|| "default".into());
    valid_profile_name(&name)?;
    // The URL's policy (plain http only on loopback) before the token is even read.
    crate::client::api_url(url)?;
    let token = match std::env::var("BETTER_COMPUTE_TOKEN").ok().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()) {
        Some(t) => {
            eprintln!("using the token in BETTER_COMPUTE_TOKEN");
            t
        }
        None => {
            let stdin = std::io::stdin();
            if stdin.is_terminal() {
                eprintln!("paste the token, then press Enter and Ctrl-D:");
            }
            let mut buffer = String::new();
            stdin
                .lock()
                .take(TOKEN_BYTES_MAX as u64 + 1)
                .read_to_string(&mut buffer)
                .map_err(|e| CliError::usage(format!("reading the token from standard input: {e}")))?;
            if buffer.len() > TOKEN_BYTES_MAX {
                return Err(CliError::usage(format!("the token is longer than {TOKEN_BYTES_MAX} bytes")));
            }
            buffer.trim().to_owned()
        }
    };
    if token.is_empty() {
        return Err(CliError::usage("no token: pipe it on standard input or set BETTER_COMPUTE_TOKEN (never an argument)"));
    }
    if token.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(CliError::usage("the token holds whitespace or control characters"));
    }
    let (tenant, key) = if verify {
        let who = Client::new(url, Some(token.clone()))?.call("system.whoami", &json!({}), None).await?;
        (who["tenantId"].as_str().map(str::to_owned), who["keyId"].as_str().map(str::to_owned))
    } else {
        Client::new(url, None)?;
        (None, None)
    };
    let path = path()?;
    let mut file = load(&path)?;
    if !file.profiles.contains_key(&name) && file.profiles.len() >= PROFILES_MAX {
        return Err(CliError::usage(format!("at most {PROFILES_MAX} profiles; auth logout --profile one first")));
    }
    let saved_at_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    file.profiles.insert(
        name.clone(),
        Profile { url: url.to_owned(), token, tenant_id: tenant.clone(), key_id: key.clone(), saved_at_ms },
    );
    file.current = Some(name.clone());
    save(&path, &file)?;
    Ok(json!({ "profile": name, "url": url, "tenantId": tenant, "keyId": key, "verified": verify, "path": path }))
}

/// `auth status`: which credential commands calling `url` use. Never the token.
pub fn status(url: &str) -> Result<Value, CliError> {
    let path = path()?;
    let file = load(&path)?;
    let profiles: Vec<&String> = file.profiles.keys().collect();
    Ok(match resolve(url)? {
        Some(Source::Env(_)) => json!({ "source": "BETTER_COMPUTE_TOKEN", "url": url, "path": path, "profiles": profiles }),
        Some(Source::Profile { name, profile }) => json!({
            "source": "profile",
            "profile": name,
            "url": profile.url,
            "tenantId": profile.tenant_id,
            "keyId": profile.key_id,
            "path": path,
            "profiles": profiles,
        }),
        None => json!({ "source": null, "url": url, "path": path, "profiles": profiles, "current": file.current }),
    })
}

/// `auth logout`: forgets a profile (the key itself stays valid on the server).
pub fn logout(profile: Option<&str>) -> Result<Value, CliError> {
    let path = path()?;
    let mut file = load(&path)?;
    let name = profile.map(str::to_owned).or_else(profile_name).or(file.current.clone()).unwrap_or_else(|| "default".into());
    let removed = file.profiles.remove(&name).is_some();
    if file.current.as_deref() == Some(&name) {
        file.current = None;
    }
    if removed {
        save(&path, &file)?;
    }
    Ok(json!({ "profile": name, "removed": removed, "path": path }))
}
