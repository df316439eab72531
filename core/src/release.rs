//! Signed `bcd` releases: release keys, the manifest, its detached signature, and the checks an
//! agent (and the control plane's `releases.register`) make before trusting one.
//!
//! A **release key** is Ed25519, named `rk_` + the first 8 bytes of SHA-256(public key) in hex.
//! Its secret file is the 32-byte seed as hex (0600, never written over a file); its public file
//! `KEY.pub` is one line, `rk_<16 hex> <standard base64 of the public key>`, which is also how
//! an agent's `[update] release_keys` and the control plane pin it.
//!
//! The **manifest** is JSON (camelCase), signed as its exact bytes: the format, the version, the
//! oldest version it may update from, whether it may replace a newer one and until when
//! (`notAfter`, RFC 3339 UTC, which a manifest that allows a downgrade must carry, at most
//! [`DOWNGRADE_VALID_S_MAX`] ahead), the signer's key id, and per architecture the artifact's
//! URL, SHA-256 and size. A manifest without `allowDowngrade` keeps the format it always had. The **signature file** is one line,
//! `rk_<16 hex> <base64 signature>`, over [`RELEASE_SIGNATURE_CONTEXT`] ‖ the manifest's bytes.
//!
//! [`verify`] checks the signature first (under the trusted key the line names) and only then
//! parses what it signed; [`check_validity`] says whether a downgrade permission holds at a time;
//! [`check_update`] says whether a running version (and the highest this node ran, its floor)
//! may take it. All are pure (time is an argument); the errors carry the stable codes an agent
//! journals ([`ReleaseError::code`]).

use std::path::{Path, PathBuf};

use base64::Engine as _;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::error::{Error, Result};

/// Prefix of the message a release signature covers, so it is never valid as any other
/// signed statement of this project.
pub const RELEASE_SIGNATURE_CONTEXT: &[u8] = b"better-compute/release/v1\n";
/// The manifest's `format`.
pub const MANIFEST_FORMAT: &str = "bcd-release/v1";
/// The largest manifest, in bytes (it travels in a command's arguments).
pub const MANIFEST_BYTES_MAX: usize = 8 * 1024;
/// The longest signature file: `rk_` + 16 hex, a space, 88 base64 characters, a newline, with
/// room for a carriage return and spaces.
pub const SIGNATURE_BYTES_MAX: usize = 256;
/// Artifacts in one manifest at most (one per architecture).
pub const ARTIFACTS_MAX: usize = 16;
/// The largest artifact a manifest may name: far above any `bcd` binary, far below a disk.
pub const ARTIFACT_BYTES_MAX: u64 = 512 * 1024 * 1024;
/// The longest artifact URL, version text and architecture name.
pub const ARTIFACT_URL_BYTES_MAX: usize = 2048;
pub const VERSION_BYTES_MAX: usize = 64;
pub const ARCH_BYTES_MAX: usize = 32;
/// The deadline of an `agent.update` command (`commands.issue` and the `rollouts` reconciler):
/// the fetch, the switch, the re-exec and the new agent's confirmation of health fit in it.
pub const UPDATE_COMMAND_DEADLINE_S: u64 = 600;
/// The longest a downgrade permission may run: a manifest with `allowDowngrade` names a
/// `notAfter` at most this far past the time it is checked (registered, issued, taken), so a
/// signed way back to an old version cannot be kept and replayed for good.
pub const DOWNGRADE_VALID_S_MAX: u64 = 30 * 24 * 3600;
/// The longest `notAfter` text (`YYYY-MM-DDTHH:MM:SS.sssssssssZ`).
pub const NOT_AFTER_BYTES_MAX: usize = 40;
/// The prefix of a release key's id.
pub const RELEASE_KEY_ID_PREFIX: &str = "rk_";

const _: () = assert!(SIGNATURE_BYTES_MAX < MANIFEST_BYTES_MAX);
const _: () = assert!(ARTIFACTS_MAX * ARTIFACT_URL_BYTES_MAX > MANIFEST_BYTES_MAX, "the manifest bound binds first");

/// Why a release is not taken; [`ReleaseError::code`] is stable, the text after it is for a
/// person.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReleaseError {
    /// The signature names a key this side does not trust.
    #[error("release-untrusted-key: {0}")]
    UntrustedKey(String),
    /// No signature, a signature that does not verify, or one by a key other than the
    /// manifest's `keyId`.
    #[error("release-bad-signature: {0}")]
    BadSignature(String),
    /// The manifest is not a manifest of this format, or breaks a bound.
    #[error("release-malformed: {0}")]
    Malformed(String),
    /// The release is older than what runs (or than the newest version this node ran), and does
    /// not say it may downgrade.
    #[error("release-downgrade: {0}")]
    Downgrade(String),
    /// The manifest allows a downgrade, and its `notAfter` has passed.
    #[error("release-expired: {0}")]
    Expired(String),
    /// What runs is older than the release's `minUpdateFrom`.
    #[error("release-too-old: {0}")]
    TooOld(String),
    /// The fetched artifact's SHA-256 is not the manifest's.
    #[error("artifact-digest: {0}")]
    ArtifactDigest(String),
    /// The fetched artifact's size is not the manifest's (or over the bound).
    #[error("artifact-size: {0}")]
    ArtifactSize(String),
    /// The artifact could not be fetched.
    #[error("artifact-fetch: {0}")]
    ArtifactFetch(String),
    /// The manifest has no artifact for this machine's architecture.
    #[error("artifact-no-arch: {0}")]
    ArtifactNoArch(String),
}

impl ReleaseError {
    /// What failed, without the code.
    pub fn detail(&self) -> &str {
        match self {
            Self::UntrustedKey(d)
            | Self::BadSignature(d)
            | Self::Malformed(d)
            | Self::Downgrade(d)
            | Self::Expired(d)
            | Self::TooOld(d)
            | Self::ArtifactDigest(d)
            | Self::ArtifactSize(d)
            | Self::ArtifactFetch(d)
            | Self::ArtifactNoArch(d) => d,
        }
    }

    /// The stable code, the first word of the message.
    pub fn code(&self) -> &'static str {
        match self {
            Self::UntrustedKey(_) => "release-untrusted-key",
            Self::BadSignature(_) => "release-bad-signature",
            Self::Malformed(_) => "release-malformed",
            Self::Downgrade(_) => "release-downgrade",
            Self::Expired(_) => "release-expired",
            Self::TooOld(_) => "release-too-old",
            Self::ArtifactDigest(_) => "artifact-digest",
            Self::ArtifactSize(_) => "artifact-size",
            Self::ArtifactFetch(_) => "artifact-fetch",
            Self::ArtifactNoArch(_) => "artifact-no-arch",
        }
    }
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// `rk_` + the first 8 bytes of SHA-256(public key), hex.
pub fn release_key_id_of(public: &VerifyingKey) -> String {
    let digest = Sha256::digest(public.as_bytes());
    format!("{RELEASE_KEY_ID_PREFIX}{}", hex::encode(&digest[..8]))
}

/// Whether `text` has the shape of a release key id.
pub fn is_release_key_id(text: &str) -> bool {
    text.strip_prefix(RELEASE_KEY_ID_PREFIX)
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// The message a release signature covers.
pub fn release_signing_message(manifest: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(RELEASE_SIGNATURE_CONTEXT.len() + manifest.len());
    message.extend_from_slice(RELEASE_SIGNATURE_CONTEXT);
    message.extend_from_slice(manifest);
    message
}

/// The public half of a release key, as pinned (`rk_… base64`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleasePublicKey {
    key_id: String,
    public: VerifyingKey,
}

impl ReleasePublicKey {
    pub fn new(public: VerifyingKey) -> Self {
        Self { key_id: release_key_id_of(&public), public }
    }

    /// `rk_<16 hex> <base64>`: the id must be the key's own.
    pub fn parse_line(line: &str) -> std::result::Result<Self, String> {
        let mut words = line.split_whitespace();
        let (Some(key_id), Some(encoded), None) = (words.next(), words.next(), words.next()) else {
            return Err("a release key is one line: rk_<16 hex> <base64 of the 32-byte public key>".into());
        };
        if !is_release_key_id(key_id) {
            return Err(format!("{:?} is not a release key id (rk_ + 16 hex)", crate::id::truncate(key_id, 40)));
        }
        let bytes = b64().decode(encoded).map_err(|_| format!("the key of {key_id} is not base64"))?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| format!("the key of {key_id} is not 32 bytes"))?;
        let public = VerifyingKey::from_bytes(&bytes).map_err(|_| format!("the key of {key_id} is not a valid point"))?;
        let key = Self::new(public);
        if key.key_id != key_id {
            return Err(format!("{key_id} is not the id of the key beside it ({})", key.key_id));
        }
        Ok(key)
    }

    /// The pinned form, `rk_<16 hex> <base64>` (no newline).
    pub fn line(&self) -> String {
        format!("{} {}", self.key_id, b64().encode(self.public.as_bytes()))
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    pub fn public(&self) -> &VerifyingKey {
        &self.public
    }
}

/// A release key: the secret that signs manifests.
pub struct ReleaseKey {
    signing: SigningKey,
    public: ReleasePublicKey,
}

impl std::fmt::Debug for ReleaseKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret half.
        f.debug_struct("ReleaseKey").field("key_id", &self.public.key_id).finish_non_exhaustive()
    }
}

/// `KEY` + `.pub`: where a release key's public half is written.
pub fn public_path_of(secret: &Path) -> PathBuf {
    let mut name = secret.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

impl ReleaseKey {
    /// A new key from the OS's randomness (a secret is never drawn from a seed).
    #[allow(clippy::disallowed_methods)]
    pub fn generate() -> Self {
        Self::from_seed(rand::random::<[u8; 32]>())
    }

    pub fn from_seed(seed: [u8; 32]) -> Self {
        let signing = SigningKey::from_bytes(&seed);
        let public = ReleasePublicKey::new(signing.verifying_key());
        Self { signing, public }
    }

    /// Reads a secret key file (64 hex characters).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::InvalidArgument {
            message: format!("cannot read release key {}: {e}", path.display()),
            hint: Some("make one with better-compute releases keygen --out FILE".into()),
        })?;
        let seed = hex::decode(text.trim()).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()).ok_or_else(|| {
            Error::invalid(format!("{} is not a release key (64 hex characters); is it the .pub file?", path.display()))
        })?;
        Ok(Self::from_seed(seed))
    }

    /// Writes the secret to `path` (0600) and the public line to `path.pub` (0644), each a new
    /// file: neither is ever written over. Returns the public file's path.
    pub fn write_new(&self, path: &Path) -> Result<PathBuf> {
        let public_path = public_path_of(path);
        if public_path.exists() {
            return Err(Error::AlreadyExists { what: format!("file {}", public_path.display()) });
        }
        crate::keys::write_secret_file(path, format!("{}\n", hex::encode(self.signing.to_bytes())).as_bytes())?;
        crate::keys::write_new_file(&public_path, format!("{}\n", self.public.line()).as_bytes(), 0o644)?;
        Ok(public_path)
    }

    pub fn key_id(&self) -> &str {
        &self.public.key_id
    }

    pub fn public(&self) -> &ReleasePublicKey {
        &self.public
    }
}

/// The signature file's text for `manifest`: `rk_… base64\n`.
pub fn sign(key: &ReleaseKey, manifest: &[u8]) -> String {
    let signature = key.signing.sign(&release_signing_message(manifest));
    format!("{} {}\n", key.key_id(), b64().encode(signature.to_bytes()))
}

/// One architecture's build.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Artifact {
    /// As `std::env::consts::ARCH` spells it (`x86_64`, `aarch64`).
    pub arch: String,
    /// `http://` or `https://`.
    pub url: String,
    /// 64 lowercase hex digits.
    pub sha256: String,
    /// Bytes, at most [`ARTIFACT_BYTES_MAX`].
    pub size: u64,
}

/// A release manifest, as signed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: String,
    /// Semver.
    pub version: String,
    /// The oldest version (semver) this release may replace; none: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_update_from: Option<String>,
    /// Whether it may replace a newer version (a rollback release).
    #[serde(default)]
    pub allow_downgrade: bool,
    /// Until when (RFC 3339, UTC) the manifest may be taken: required with `allowDowngrade`, and
    /// then at most [`DOWNGRADE_VALID_S_MAX`] ahead of the time it is checked at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_after: Option<String>,
    /// The release key that signs it.
    pub key_id: String,
    pub artifacts: Vec<Artifact>,
}

fn semver_of(field: &str, text: &str) -> std::result::Result<semver::Version, ReleaseError> {
    if text.len() > VERSION_BYTES_MAX {
        return Err(ReleaseError::Malformed(format!("{field} is over {VERSION_BYTES_MAX} bytes")));
    }
    semver::Version::parse(text).map_err(|e| {
        ReleaseError::Malformed(format!("{field} {:?} is not a semantic version: {e}", crate::id::truncate(text, 40)))
    })
}

/// `notAfter` in milliseconds since the epoch: RFC 3339 in UTC (`2026-05-01T00:00:00Z`).
pub fn not_after_ms_of(text: &str) -> std::result::Result<u64, ReleaseError> {
    let bad = || {
        ReleaseError::Malformed(format!(
            "notAfter {:?} is not an RFC 3339 time in UTC (2026-05-01T00:00:00Z)",
            crate::id::truncate(text, 40)
        ))
    };
    if text.len() > NOT_AFTER_BYTES_MAX || !text.ends_with('Z') {
        return Err(bad());
    }
    let at = humantime::parse_rfc3339(text).map_err(|_| bad())?;
    let ms = at.duration_since(std::time::UNIX_EPOCH).map_err(|_| bad())?.as_millis();
    u64::try_from(ms).map_err(|_| bad())
}

/// `ms` since the epoch as `notAfter` spells it (RFC 3339 UTC, whole seconds).
pub fn not_after_text(ms: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)).to_string()
}

/// Whether `manifest` may be taken at `now_ms` (registered, issued, installed): a manifest with
/// a `notAfter` is refused past it (`release-expired`), and one whose `notAfter` is more than
/// [`DOWNGRADE_VALID_S_MAX`] ahead is refused as malformed (a downgrade permission is
/// short-lived by construction). A manifest without one (which then allows no downgrade) is
/// always valid.
pub fn check_validity(manifest: &Manifest, now_ms: u64) -> std::result::Result<(), ReleaseError> {
    let Some(text) = &manifest.not_after else {
        if manifest.allow_downgrade {
            return Err(ReleaseError::Malformed("a manifest that allows a downgrade says until when: notAfter".into()));
        }
        return Ok(());
    };
    let not_after_ms = not_after_ms_of(text)?;
    if now_ms >= not_after_ms {
        return Err(ReleaseError::Expired(format!(
            "release {} was valid until {text}; it is {} (sign it again with a new --not-after)",
            manifest.version,
            not_after_text(now_ms)
        )));
    }
    if not_after_ms - now_ms > DOWNGRADE_VALID_S_MAX * 1000 {
        return Err(ReleaseError::Malformed(format!(
            "notAfter {text} is more than {} days ahead: a release is valid for at most that long",
            DOWNGRADE_VALID_S_MAX / (24 * 3600)
        )));
    }
    Ok(())
}

/// Whether `text` is a semantic version (what `version` and `minUpdateFrom` must be).
pub fn is_version(text: &str) -> bool {
    semver::Version::parse(text).is_ok()
}

fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl Manifest {
    /// Parses and checks a manifest's bytes (not its signature: see [`verify`]).
    pub fn parse(bytes: &[u8]) -> std::result::Result<Self, ReleaseError> {
        if bytes.len() > MANIFEST_BYTES_MAX {
            return Err(ReleaseError::Malformed(format!("the manifest is over {MANIFEST_BYTES_MAX} bytes")));
        }
        let manifest: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| ReleaseError::Malformed(format!("the manifest: {}", crate::id::truncate(&e.to_string(), 200))))?;
        manifest.check()?;
        Ok(manifest)
    }

    /// The bounds every field keeps.
    pub fn check(&self) -> std::result::Result<(), ReleaseError> {
        let malformed = |m: String| Err(ReleaseError::Malformed(m));
        if self.format != MANIFEST_FORMAT {
            return malformed(format!("format is {:?}, not {MANIFEST_FORMAT}", crate::id::truncate(&self.format, 40)));
        }
        semver_of("version", &self.version)?;
        if let Some(min) = &self.min_update_from {
            semver_of("minUpdateFrom", min)?;
        }
        if !is_release_key_id(&self.key_id) {
            return malformed("keyId is not a release key id (rk_ + 16 hex)".into());
        }
        if let Some(not_after) = &self.not_after {
            not_after_ms_of(not_after)?;
        } else if self.allow_downgrade {
            return malformed("a manifest that allows a downgrade says until when: notAfter (releases sign --not-after)".into());
        }
        if self.artifacts.is_empty() || self.artifacts.len() > ARTIFACTS_MAX {
            return malformed(format!("a manifest has 1 to {ARTIFACTS_MAX} artifacts"));
        }
        for (i, artifact) in self.artifacts.iter().enumerate() {
            let arch_ok = !artifact.arch.is_empty()
                && artifact.arch.len() <= ARCH_BYTES_MAX
                && artifact.arch.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
            if !arch_ok {
                return malformed(format!("artifact {i}: arch is 1 to {ARCH_BYTES_MAX} of a-z, 0-9, _ (as Rust spells it)"));
            }
            if self.artifacts[..i].iter().any(|a| a.arch == artifact.arch) {
                return malformed(format!("two artifacts for {}", artifact.arch));
            }
            if artifact.url.len() > ARTIFACT_URL_BYTES_MAX {
                return malformed(format!("artifact {}: the URL is over {ARTIFACT_URL_BYTES_MAX} bytes", artifact.arch));
            }
            match url::Url::parse(&artifact.url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => {}
                _ => return malformed(format!("artifact {}: the URL is not an http(s) URL", artifact.arch)),
            }
            if !is_sha256_hex(&artifact.sha256) {
                return malformed(format!("artifact {}: sha256 is not 64 lowercase hex digits", artifact.arch));
            }
            if artifact.size == 0 || artifact.size > ARTIFACT_BYTES_MAX {
                return malformed(format!("artifact {}: size is 1 to {ARTIFACT_BYTES_MAX} bytes", artifact.arch));
            }
        }
        Ok(())
    }

    /// The artifact for `arch` (`std::env::consts::ARCH`).
    pub fn artifact_for(&self, arch: &str) -> std::result::Result<&Artifact, ReleaseError> {
        self.artifacts.iter().find(|a| a.arch == arch).ok_or_else(|| {
            let have: Vec<&str> = self.artifacts.iter().map(|a| a.arch.as_str()).collect();
            ReleaseError::ArtifactNoArch(format!("release {} has no {arch} build (it has {})", self.version, have.join(", ")))
        })
    }

    /// The manifest's text as `release sign` writes it (and signs).
    pub fn to_text(&self) -> String {
        let mut text = serde_json::to_string_pretty(self).expect("a manifest serializes");
        text.push('\n');
        text
    }
}

/// The key id a signature file names (its shape checked, not the signature).
pub fn signature_key_id(text: &str) -> std::result::Result<&str, ReleaseError> {
    parse_signature(text).map(|(key_id, _)| key_id)
}

/// The signature line's key id and signature.
fn parse_signature(text: &str) -> std::result::Result<(&str, Signature), ReleaseError> {
    if text.len() > SIGNATURE_BYTES_MAX {
        return Err(ReleaseError::BadSignature(format!("the signature file is over {SIGNATURE_BYTES_MAX} bytes")));
    }
    let mut words = text.split_whitespace();
    let (Some(key_id), Some(encoded), None) = (words.next(), words.next(), words.next()) else {
        return Err(ReleaseError::BadSignature("no signature: the signature file is one line, rk_… <base64>".into()));
    };
    if !is_release_key_id(key_id) {
        return Err(ReleaseError::BadSignature("the signature does not name a release key (rk_ + 16 hex)".into()));
    }
    let bytes = b64().decode(encoded).map_err(|_| ReleaseError::BadSignature("the signature is not base64".into()))?;
    let signature =
        Signature::from_slice(&bytes).map_err(|_| ReleaseError::BadSignature("the signature is not 64 bytes".into()))?;
    Ok((key_id, signature))
}

/// Checks `manifest` under `signature` (the signature file's text): the key the signature
/// names must be in `trusted`, the signature must verify over the exact bytes, and only then is
/// the manifest parsed, its `keyId` held to the signer's and every field to its bound.
pub fn verify(trusted: &[ReleasePublicKey], manifest: &[u8], signature: &str) -> std::result::Result<Manifest, ReleaseError> {
    if manifest.len() > MANIFEST_BYTES_MAX {
        return Err(ReleaseError::Malformed(format!("the manifest is over {MANIFEST_BYTES_MAX} bytes")));
    }
    let (key_id, signature) = parse_signature(signature)?;
    let Some(key) = trusted.iter().find(|k| k.key_id == key_id) else {
        return Err(ReleaseError::UntrustedKey(format!(
            "signed by {key_id}, which is not a trusted release key (trusted: {})",
            if trusted.is_empty() {
                "none".to_owned()
            } else {
                trusted.iter().map(|k| k.key_id.as_str()).collect::<Vec<_>>().join(", ")
            }
        )));
    };
    key.public
        .verify_strict(&release_signing_message(manifest), &signature)
        .map_err(|_| ReleaseError::BadSignature(format!("the signature by {key_id} does not verify over the manifest")))?;
    let parsed = Manifest::parse(manifest)?;
    if parsed.key_id != key_id {
        return Err(ReleaseError::BadSignature(format!("the manifest names key {} but is signed by {key_id}", parsed.key_id)));
    }
    Ok(parsed)
}

/// What taking a release means for what runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateCheck {
    /// A newer version.
    Upgrade,
    /// An older version the manifest allows (`allowDowngrade`).
    Downgrade,
    /// The version that runs already.
    Same,
}

/// Whether the agent running `current` may take `manifest` at `now_ms`, on a node that has run
/// `floor` at the highest (none: nothing known beyond `current`): the same version is `Same`; a
/// `current` older than `minUpdateFrom` is refused (`release-too-old`); a manifest past its
/// `notAfter` is refused (`release-expired`, [`check_validity`]); a version older than what
/// runs, or than the floor, is refused (`release-downgrade`) unless the manifest allows a
/// downgrade (and is then, by [`check_validity`], within its `notAfter`).
pub fn check_update(
    current: &str,
    floor: Option<&str>,
    manifest: &Manifest,
    now_ms: u64,
) -> std::result::Result<UpdateCheck, ReleaseError> {
    let running = semver_of("the running version", current)?;
    let target = semver_of("version", &manifest.version)?;
    if running == target {
        return Ok(UpdateCheck::Same);
    }
    if let Some(min) = &manifest.min_update_from
        && running < semver_of("minUpdateFrom", min)?
    {
        return Err(ReleaseError::TooOld(format!(
            "release {target} updates from {min} or later; this agent runs {running} (update to {min} first)"
        )));
    }
    check_validity(manifest, now_ms)?;
    // A floor that does not parse (a hand-edited state) is no floor: what runs still is one.
    let floor = floor.and_then(|f| semver::Version::parse(f).ok()).filter(|f| *f > running);
    if target < running || floor.as_ref().is_some_and(|f| target < *f) {
        if manifest.allow_downgrade {
            return Ok(UpdateCheck::Downgrade);
        }
        let newest = match &floor {
            Some(f) => format!("the running {running} (this node has run {f})"),
            None => format!("the running {running}"),
        };
        return Err(ReleaseError::Downgrade(format!("release {target} is older than {newest} and does not allow a downgrade")));
    }
    Ok(UpdateCheck::Upgrade)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> ReleaseKey {
        ReleaseKey::from_seed([n; 32])
    }

    fn manifest(key: &ReleaseKey, version: &str) -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT.into(),
            version: version.into(),
            min_update_from: Some("0.1.0".into()),
            allow_downgrade: false,
            not_after: None,
            key_id: key.key_id().into(),
            artifacts: vec![Artifact {
                arch: "x86_64".into(),
                url: "http://127.0.0.1:8080/bcd".into(),
                sha256: "ab".repeat(32),
                size: 1234,
            }],
        }
    }

    fn signed(key: &ReleaseKey, m: &Manifest) -> (Vec<u8>, String) {
        let text = m.to_text().into_bytes();
        let signature = sign(key, &text);
        (text, signature)
    }

    #[test]
    fn a_signed_manifest_verifies_and_round_trips() {
        let k = key(1);
        let m = manifest(&k, "0.2.0");
        let (text, signature) = signed(&k, &m);
        assert!(signature.starts_with(&format!("{} ", k.key_id())) && signature.ends_with('\n'));
        assert_eq!(verify(&[k.public().clone()], &text, &signature).unwrap(), m);
        assert!(is_release_key_id(k.key_id()));
        let line = k.public().line();
        assert_eq!(ReleasePublicKey::parse_line(&line).unwrap(), *k.public());
        assert_eq!(ReleasePublicKey::parse_line(&format!("{line}\n")).unwrap(), *k.public());
    }

    #[test]
    fn a_tampered_byte_is_a_bad_signature() {
        let k = key(1);
        let (mut text, signature) = signed(&k, &manifest(&k, "0.2.0"));
        let at = text.iter().position(|&b| b == b'2').unwrap();
        text[at] = b'9';
        let e = verify(&[k.public().clone()], &text, &signature).unwrap_err();
        assert_eq!(e.code(), "release-bad-signature", "{e}");
        assert!(e.to_string().starts_with("release-bad-signature: "));
        let unsigned = verify(&[k.public().clone()], &text, "").unwrap_err();
        assert_eq!(unsigned.code(), "release-bad-signature");
    }

    #[test]
    fn a_key_not_trusted_or_not_named_is_refused() {
        let (good, other) = (key(1), key(2));
        let (text, signature) = signed(&good, &manifest(&good, "0.2.0"));
        let e = verify(&[other.public().clone()], &text, &signature).unwrap_err();
        assert_eq!(e.code(), "release-untrusted-key", "{e}");
        assert_eq!(verify(&[], &text, &signature).unwrap_err().code(), "release-untrusted-key");

        // Signed by a trusted key but saying it is another key's.
        let m = Manifest { key_id: other.key_id().into(), ..manifest(&good, "0.2.0") };
        let (text, signature) = signed(&good, &m);
        let e = verify(&[good.public().clone(), other.public().clone()], &text, &signature).unwrap_err();
        assert_eq!(e.code(), "release-bad-signature", "{e}");

        // A wrong key under a trusted key's id: the signature does not verify.
        let (text, forged) = signed(&other, &manifest(&good, "0.2.0"));
        let forged = forged.replace(other.key_id(), good.key_id());
        assert_eq!(verify(&[good.public().clone()], &text, &forged).unwrap_err().code(), "release-bad-signature");
    }

    #[test]
    fn a_malformed_or_oversized_manifest_is_refused() {
        let k = key(1);
        let trusted = [k.public().clone()];
        for bad in [
            Manifest { format: "bcd-release/v2".into(), ..manifest(&k, "0.2.0") },
            Manifest { version: "two".into(), ..manifest(&k, "0.2.0") },
            Manifest { min_update_from: Some("0.1".into()), ..manifest(&k, "0.2.0") },
            Manifest { artifacts: vec![], ..manifest(&k, "0.2.0") },
        ] {
            let (text, signature) = signed(&k, &bad);
            assert_eq!(verify(&trusted, &text, &signature).unwrap_err().code(), "release-malformed", "{bad:?}");
        }
        let mut artifacts = manifest(&k, "0.2.0").artifacts;
        for (field, value) in [("url", "file:///bin/sh"), ("sha256", "AB"), ("arch", "x86-64")] {
            let mut a = artifacts[0].clone();
            match field {
                "url" => a.url = value.into(),
                "sha256" => a.sha256 = value.into(),
                _ => a.arch = value.into(),
            }
            let (text, signature) = signed(&k, &Manifest { artifacts: vec![a], ..manifest(&k, "0.2.0") });
            assert_eq!(verify(&trusted, &text, &signature).unwrap_err().code(), "release-malformed", "{field}");
        }
        artifacts.push(artifacts[0].clone());
        let (text, signature) = signed(&k, &Manifest { artifacts, ..manifest(&k, "0.2.0") });
        assert_eq!(verify(&trusted, &text, &signature).unwrap_err().code(), "release-malformed", "two of one arch");

        let (text, signature) = signed(
            &k,
            &Manifest {
                artifacts: vec![Artifact { size: 0, ..manifest(&k, "0.2.0").artifacts[0].clone() }],
                ..manifest(&k, "0.2.0")
            },
        );
        assert_eq!(verify(&trusted, &text, &signature).unwrap_err().code(), "release-malformed", "an empty artifact");

        let signature = sign(&k, b"{not json");
        assert_eq!(verify(&trusted, b"{not json", &signature).unwrap_err().code(), "release-malformed");

        let mut big = manifest(&k, "0.2.0").to_text().into_bytes();
        big.resize(MANIFEST_BYTES_MAX + 1, b' ');
        let signature = sign(&k, &big);
        let e = verify(&trusted, &big, &signature).unwrap_err();
        assert_eq!(e.code(), "release-malformed", "{e}");
        let long_signature = format!("{} {}", k.key_id(), "A".repeat(SIGNATURE_BYTES_MAX));
        assert_eq!(verify(&trusted, &text, &long_signature).unwrap_err().code(), "release-bad-signature");
    }

    /// 2026-05-01T00:00:00Z.
    const MAY_1_MS: u64 = 1_777_593_600_000;
    const DAY_MS: u64 = 24 * 3600 * 1000;

    #[test]
    fn updates_refuse_downgrades_and_too_old_agents() {
        let k = key(1);
        let m = manifest(&k, "0.2.0");
        let check = |current: &str, m: &Manifest| check_update(current, None, m, MAY_1_MS);
        assert_eq!(check("0.1.0", &m), Ok(UpdateCheck::Upgrade));
        assert_eq!(check("0.1.5", &m), Ok(UpdateCheck::Upgrade));
        assert_eq!(check("0.2.0", &m), Ok(UpdateCheck::Same));
        assert_eq!(check("0.3.0", &m).unwrap_err().code(), "release-downgrade");
        assert_eq!(check("0.2.0-rc.1", &m), Ok(UpdateCheck::Upgrade), "a pre-release is older");
        let allowed = Manifest { allow_downgrade: true, not_after: Some("2026-05-08T00:00:00Z".into()), ..m.clone() };
        assert_eq!(check("0.3.0", &allowed), Ok(UpdateCheck::Downgrade));
        let strict = Manifest { min_update_from: Some("0.1.5".into()), ..m.clone() };
        let e = check("0.1.0", &strict).unwrap_err();
        assert_eq!(e.code(), "release-too-old", "{e}");
        assert_eq!(check("0.0.9", &Manifest { min_update_from: None, ..m.clone() }), Ok(UpdateCheck::Upgrade));
        assert_eq!(check("nonsense", &m).unwrap_err().code(), "release-malformed");
    }

    #[test]
    fn a_downgrade_permission_expires_and_is_short_lived() {
        let k = key(1);
        let trusted = [k.public().clone()];
        // Allowing a downgrade without saying until when is not a manifest.
        let unbounded = Manifest { allow_downgrade: true, ..manifest(&k, "0.1.0") };
        let (text, signature) = signed(&k, &unbounded);
        let e = verify(&trusted, &text, &signature).unwrap_err();
        assert_eq!(e.code(), "release-malformed", "{e}");
        assert!(e.detail().contains("notAfter"), "{e}");
        assert_eq!(check_validity(&unbounded, MAY_1_MS).unwrap_err().code(), "release-malformed");

        let downgrade = Manifest { not_after: Some("2026-05-08T00:00:00Z".into()), ..unbounded };
        let (text, signature) = signed(&k, &downgrade);
        assert_eq!(verify(&trusted, &text, &signature).unwrap(), downgrade, "notAfter is signed and round-trips");
        assert_eq!(not_after_ms_of("2026-05-08T00:00:00Z"), Ok(MAY_1_MS + 7 * DAY_MS));
        assert_eq!(not_after_text(MAY_1_MS), "2026-05-01T00:00:00Z");
        assert_eq!(check_validity(&downgrade, MAY_1_MS), Ok(()));
        assert_eq!(check_update("0.3.0", None, &downgrade, MAY_1_MS), Ok(UpdateCheck::Downgrade));
        // Past it: refused, as a downgrade and as anything else.
        let past = MAY_1_MS + 7 * DAY_MS;
        assert_eq!(check_validity(&downgrade, past).unwrap_err().code(), "release-expired");
        assert_eq!(check_update("0.3.0", None, &downgrade, past).unwrap_err().code(), "release-expired");
        let any = Manifest { min_update_from: None, ..downgrade.clone() };
        assert_eq!(check_update("0.0.5", None, &any, past).unwrap_err().code(), "release-expired", "an upgrade too");
        // Too far ahead of the time it is checked at.
        let early = MAY_1_MS + 7 * DAY_MS - DOWNGRADE_VALID_S_MAX * 1000 - 1;
        assert_eq!(check_validity(&downgrade, early).unwrap_err().code(), "release-malformed");
        for bad in ["2026-05-08", "2026-05-08T00:00:00+02:00", "tomorrow", "2026-05-08T00:00:00.0000000000000000000000Z"] {
            let m = Manifest { not_after: Some(bad.into()), ..downgrade.clone() };
            assert_eq!(m.check().unwrap_err().code(), "release-malformed", "{bad}");
        }
        // A manifest without allowDowngrade keeps the format it had: no notAfter in its text.
        assert!(!manifest(&k, "0.2.0").to_text().contains("notAfter"));
    }

    #[test]
    fn the_floor_refuses_what_runs_newer_versions_had_replaced() {
        let k = key(1);
        let m = Manifest { min_update_from: None, ..manifest(&k, "0.2.0") };
        // Running 0.1.0 after a rollback from 0.3.0: 0.2.0 is an upgrade of what runs but
        // older than what this node ran.
        let e = check_update("0.1.0", Some("0.3.0"), &m, MAY_1_MS).unwrap_err();
        assert_eq!(e.code(), "release-downgrade", "{e}");
        assert!(e.detail().contains("this node has run 0.3.0"), "{e}");
        assert_eq!(check_update("0.1.0", Some("0.2.0"), &m, MAY_1_MS), Ok(UpdateCheck::Upgrade), "the floor itself");
        assert_eq!(check_update("0.1.0", Some("0.1.0"), &m, MAY_1_MS), Ok(UpdateCheck::Upgrade));
        assert_eq!(check_update("0.1.0", Some("junk"), &m, MAY_1_MS), Ok(UpdateCheck::Upgrade));
        // A valid downgrade permission goes below it; an expired one does not.
        let allowed = Manifest { allow_downgrade: true, not_after: Some("2026-05-02T00:00:00Z".into()), ..m };
        assert_eq!(check_update("0.1.0", Some("0.3.0"), &allowed, MAY_1_MS), Ok(UpdateCheck::Downgrade));
        let e = check_update("0.1.0", Some("0.3.0"), &allowed, MAY_1_MS + DAY_MS).unwrap_err();
        assert_eq!(e.code(), "release-expired", "{e}");
    }

    #[test]
    fn an_artifact_is_found_by_arch() {
        let k = key(1);
        let m = manifest(&k, "0.2.0");
        assert_eq!(m.artifact_for("x86_64").unwrap().size, 1234);
        let e = m.artifact_for("riscv64").unwrap_err();
        assert_eq!(e.code(), "artifact-no-arch", "{e}");
    }

    #[test]
    fn a_key_is_written_new_and_loaded_back() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("release.key");
        let k = ReleaseKey::generate();
        let public = k.write_new(&path).unwrap();
        assert_eq!(public, dir.path().join("release.key.pub"));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(&public).unwrap().permissions().mode() & 0o777, 0o644);
        let loaded = ReleaseKey::load(&path).unwrap();
        assert_eq!(loaded.public(), k.public());
        let line = std::fs::read_to_string(&public).unwrap();
        assert_eq!(ReleasePublicKey::parse_line(&line).unwrap(), *k.public());
        // Never over a file.
        let again = ReleaseKey::generate().write_new(&path).unwrap_err();
        assert_eq!(again.code(), crate::ErrorCode::AlreadyExists);
        assert_eq!(ReleaseKey::load(&path).unwrap().public(), k.public());
        assert!(ReleaseKey::load(&public).is_err(), "the public file is not a secret key");
        assert!(format!("{k:?}").contains(k.key_id()) && !format!("{k:?}").contains(&hex::encode(k.signing.to_bytes())));
    }

    #[test]
    fn a_public_line_must_name_its_own_key() {
        let (a, b) = (key(1), key(2));
        let swapped = format!("{} {}", a.key_id(), b.public().line().split(' ').nth(1).unwrap());
        assert!(ReleasePublicKey::parse_line(&swapped).is_err());
        assert!(ReleasePublicKey::parse_line("rk_00 AAAA").is_err());
        assert!(ReleasePublicKey::parse_line("").is_err());
    }
}
