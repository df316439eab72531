//! `releases keygen|sign|verify|register|list|get`: signed `bcd` releases. `keygen`, `sign` and
//! `verify` work offline (no server is called); `register`, `list` and `get` are the
//! `releases.*` methods. The key is read from a file, never from an argument; every file is
//! written new (keys 0600, the public line and the manifest 0644) and never over one. A refused
//! manifest exits 1 with its stable code (`release-bad-signature: …`), the same words an agent
//! journals.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use bc_core::id::ReleaseId;
use bc_core::release::{
    ARTIFACT_BYTES_MAX, Artifact, MANIFEST_BYTES_MAX, MANIFEST_FORMAT, Manifest, ReleaseError, ReleaseKey, ReleasePublicKey,
    SIGNATURE_BYTES_MAX,
};
use clap::Subcommand;
use serde_json::json;
use sha2::{Digest as _, Sha256};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, put_id};

#[derive(Subcommand)]
pub enum ReleasesCommand {
    /// Make a release key: KEY (the secret, 0600) and KEY.pub (its public line, which agents pin
    /// in [update] release_keys); never over a file.
    Keygen {
        /// Where the secret key goes (a new file).
        #[arg(long, value_name = "KEY")]
        out: PathBuf,
    },
    /// Write a release manifest for the artifacts and its detached signature (MANIFEST and
    /// MANIFEST.sig, new files).
    Sign {
        /// The release key (a file keygen wrote); never the secret itself.
        #[arg(long, value_name = "KEY")]
        key: PathBuf,
        /// The release's version (semver).
        #[arg(long)]
        version: String,
        /// ARCH=FILE (its URL is --url-base/FILE's name) or ARCH=FILE=URL; repeatable, one per
        /// architecture (x86_64, aarch64).
        #[arg(long = "artifact", value_name = "ARCH=FILE[=URL]", required = true)]
        artifacts: Vec<String>,
        /// Where the artifacts are served: http(s)://HOST/PATH.
        #[arg(long, value_name = "URL")]
        url_base: Option<String>,
        /// The oldest version this release may update (semver).
        #[arg(long, value_name = "VERSION")]
        min_update_from: Option<String>,
        /// It may replace a newer version (a release that rolls back); needs --not-after.
        #[arg(long, requires = "not_after")]
        allow_downgrade: bool,
        /// Until when the release may be taken (RFC 3339 UTC, 2026-05-01T00:00:00Z; at most 30
        /// days ahead when it is registered and taken): what a downgrade permission must say.
        #[arg(long, value_name = "TIME")]
        not_after: Option<String>,
        /// The manifest to write (and MANIFEST.sig beside it).
        #[arg(long, value_name = "MANIFEST")]
        out: PathBuf,
    },
    /// Check a manifest's signature against release public keys (KEY.pub), and its fields.
    Verify {
        #[arg(long, value_name = "MANIFEST")]
        manifest: PathBuf,
        /// The signature file (default: MANIFEST.sig).
        #[arg(long, value_name = "SIG")]
        signature: Option<PathBuf>,
        /// A trusted release key's public file (repeatable).
        #[arg(long = "key", value_name = "KEY.pub", required = true)]
        keys: Vec<PathBuf>,
    },
    /// Register a signed release: the manifest and signature `release sign` wrote. The control
    /// plane keeps it only when a key it trusts (`--release-key` of dev/serve) signed it.
    Register {
        /// The manifest (JSON, as signed).
        #[arg(long, value_name = "FILE")]
        manifest: PathBuf,
        /// Its signature (default: the manifest's path + `.sig`).
        #[arg(long, value_name = "FILE")]
        signature: Option<PathBuf>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's releases.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One release, by its `rel_…` id.
    Get { release_id: String },
}

/// The largest public key file read.
const PUBLIC_KEY_FILE_BYTES_MAX: u64 = 4 * 1024;

pub async fn run(ctx: &Context, command: ReleasesCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let value = match command {
        ReleasesCommand::List { page } => return ctx.list("releases.list", body, &page, tables::RELEASES).await,
        ReleasesCommand::Get { release_id } => {
            put_id::<ReleaseId>(&mut body, "releaseId", "RELEASE_ID", &release_id)?;
            ctx.call("releases.get", body, None).await?
        }
        ReleasesCommand::Register { manifest, signature, key } => {
            let signature = signature.unwrap_or_else(|| signature_path_of(&manifest));
            let manifest_text = read_text_bounded(&manifest, "--manifest", MANIFEST_BYTES_MAX)?;
            let signature_text = read_text_bounded(&signature, "--signature", SIGNATURE_BYTES_MAX)?;
            body.insert("manifest".into(), json!(manifest_text));
            body.insert("signature".into(), json!(signature_text.trim_end()));
            ctx.create("releases.register", body, &key).await?
        }
        ReleasesCommand::Keygen { out } => {
            let key = ReleaseKey::generate();
            let public = key.write_new(&out)?;
            json!({
                "keyId": key.key_id(), "key": out.display().to_string(),
                "publicKeyFile": public.display().to_string(), "publicKey": key.public().line(),
            })
        }
        ReleasesCommand::Sign { key, version, artifacts, url_base, min_update_from, allow_downgrade, not_after, out } => {
            let key = ReleaseKey::load(&key)?;
            let mut listed = Vec::new();
            for item in &artifacts {
                listed.push(artifact(item, url_base.as_deref())?);
            }
            let manifest = Manifest {
                format: MANIFEST_FORMAT.into(),
                version,
                min_update_from,
                allow_downgrade,
                not_after,
                key_id: key.key_id().into(),
                artifacts: listed,
            };
            manifest.check().map_err(refused)?;
            let text = manifest.to_text();
            if text.len() > MANIFEST_BYTES_MAX {
                return Err(CliError::usage(format!("the manifest would be over {MANIFEST_BYTES_MAX} bytes")));
            }
            let signature = bc_core::release::sign(&key, text.as_bytes());
            bc_core::release::verify(&[key.public().clone()], text.as_bytes(), &signature).map_err(refused)?;
            let signature_path = signature_path_of(&out);
            if signature_path.exists() {
                return Err(bc_core::Error::AlreadyExists { what: format!("file {}", signature_path.display()) }.into());
            }
            bc_core::keys::write_new_file(&out, text.as_bytes(), 0o644)?;
            bc_core::keys::write_new_file(&signature_path, signature.as_bytes(), 0o644)?;
            json!({
                "manifest": out.display().to_string(), "signature": signature_path.display().to_string(),
                "keyId": key.key_id(), "version": manifest.version, "artifacts": manifest.artifacts,
            })
        }
        ReleasesCommand::Verify { manifest, signature, keys } => {
            let mut trusted = Vec::new();
            for path in &keys {
                trusted.push(public_key(path)?);
            }
            let text = read_bounded(&manifest, MANIFEST_BYTES_MAX as u64, "the manifest")?;
            let signature_path = signature.unwrap_or_else(|| signature_path_of(&manifest));
            let signature = read_bounded(&signature_path, SIGNATURE_BYTES_MAX as u64, "the signature")?;
            let signature = String::from_utf8(signature).map_err(|_| refused(ReleaseError::BadSignature("not text".into())))?;
            let verified = bc_core::release::verify(&trusted, &text, &signature).map_err(refused)?;
            json!({ "verified": true, "keyId": verified.key_id, "version": verified.version, "manifest": verified })
        }
    };
    ctx.print(&value, Format::Json)
}

/// A manifest or signature file to register, bounded before it is read.
fn read_text_bounded(path: &Path, what: &str, max: usize) -> Result<String, CliError> {
    let meta = std::fs::metadata(path).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))?;
    if meta.len() > max as u64 {
        return Err(CliError::usage(format!("{what} {} is over {max} bytes", path.display())));
    }
    std::fs::read_to_string(path).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))
}

/// A refused release: its stable code, exit 1.
fn refused(e: ReleaseError) -> CliError {
    CliError::new(e.code(), e.detail())
}

/// `MANIFEST` + `.sig`.
fn signature_path_of(manifest: &Path) -> PathBuf {
    let mut name = manifest.as_os_str().to_owned();
    name.push(".sig");
    PathBuf::from(name)
}

fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>, CliError> {
    let file = std::fs::File::open(path).map_err(|e| CliError::usage(format!("cannot read {what} {}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| CliError::usage(format!("cannot read {what} {}: {e}", path.display())))?;
    if bytes.len() as u64 > max {
        let e = match what {
            "the signature" => ReleaseError::BadSignature(format!("the signature file is over {max} bytes")),
            _ => ReleaseError::Malformed(format!("{what} is over {max} bytes")),
        };
        return Err(refused(e));
    }
    Ok(bytes)
}

fn public_key(path: &Path) -> Result<ReleasePublicKey, CliError> {
    let bytes = read_bounded(path, PUBLIC_KEY_FILE_BYTES_MAX, "the public key")?;
    let text = String::from_utf8(bytes).map_err(|_| CliError::usage(format!("{} is not text", path.display())))?;
    let line = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    ReleasePublicKey::parse_line(line)
        .map_err(|e| CliError::usage(format!("{}: {e}", path.display())).hint("pass KEY.pub, the file release keygen wrote"))
}

/// `ARCH=FILE` (URL: the base + the file's name) or `ARCH=FILE=URL`: hashed and measured.
fn artifact(item: &str, url_base: Option<&str>) -> Result<Artifact, CliError> {
    let mut parts = item.splitn(3, '=');
    let (Some(arch), Some(file)) = (parts.next(), parts.next()) else {
        return Err(CliError::usage(format!("--artifact {item:?} is not ARCH=FILE or ARCH=FILE=URL")));
    };
    let path = PathBuf::from(file);
    let url = match (parts.next(), url_base) {
        (Some(url), _) => url.to_owned(),
        (None, Some(base)) => {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| CliError::usage(format!("--artifact {item:?}: the file has no UTF-8 name")))?;
            format!("{}/{name}", base.trim_end_matches('/'))
        }
        (None, None) => {
            return Err(CliError::usage(format!("--artifact {item:?} has no URL")).hint("give --url-base URL, or ARCH=FILE=URL"));
        }
    };
    let mut file = std::fs::File::open(&path).map_err(|e| CliError::usage(format!("cannot read {}: {e}", path.display())))?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = file.read(&mut buffer).map_err(|e| CliError::usage(format!("reading {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        if size > ARTIFACT_BYTES_MAX {
            return Err(CliError::usage(format!("{} is over {ARTIFACT_BYTES_MAX} bytes", path.display())));
        }
        hasher.update(&buffer[..n]);
    }
    Ok(Artifact { arch: arch.to_owned(), url, sha256: hex_of(&hasher.finalize()), size })
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
