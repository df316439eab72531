//! `bcd join --server URL`: the control plane's `/.well-known/better-compute`, fetched once
//! (bounded: [`WELL_KNOWN_FETCH_TIMEOUT_MS`], `bc_core::well_known::WELL_KNOWN_BYTES_MAX`, no
//! redirect), checked whole (`bc_core::well_known::verify_document`: its signature by the join
//! signing key it names) and against each pin the machine was given, before anything is sent to
//! the agents' endpoint; then `join-encryption.jwk` ([`write_jwk`]), to which the join token is
//! sealed, and [`read_jwk`] on later joins.
//!
//! Every refusal has a stable code at the start of its message (`WELL_KNOWN_FETCH`,
//! `WELL_KNOWN_TOO_LARGE`, `WELL_KNOWN_MALFORMED`, `WELL_KNOWN_BAD_SIGNATURE`,
//! `WELL_KNOWN_UNSUPPORTED`, `PIN_MISMATCH`, `JOIN_ENCRYPTION_JWK`) and exits 1.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bc_core::well_known::{HeldPins, WELL_KNOWN_BYTES_MAX, WELL_KNOWN_PATH, WellKnown, WellKnownError};

/// The whole fetch (connect, TLS, the answer) gives up after this.
pub const WELL_KNOWN_FETCH_TIMEOUT_MS: u64 = 10_000;
/// The largest `join-encryption.jwk` read.
pub const JWK_BYTES_MAX: u64 = 4096;

/// The control plane's URL, checked: `https://HOST[:PORT]`, or `http://` to a loopback address
/// (a `dev` gateway), with no path, user or query. The document's URL.
pub fn document_url(server: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(server).map_err(|_| format!("--server {server:?} is not a URL"))?;
    let host = url.host_str().ok_or("--server names no host")?.to_owned();
    let path_ok = url.path() == "/" || url.path().is_empty();
    if !url.username().is_empty() || url.password().is_some() || url.query().is_some() || url.fragment().is_some() || !path_ok {
        return Err("--server is the control plane's https://HOST[:PORT], without a path, user or query".into());
    }
    match url.scheme() {
        "https" => {}
        "http" => {
            let bare = host.trim_start_matches('[').trim_end_matches(']');
            let loopback = bare == "localhost" || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(format!("bcd refuses plaintext (http://) to {host}: only a loopback dev gateway may be plaintext"));
            }
        }
        other => return Err(format!("--server's scheme is https, not {other:?}")),
    }
    let mut document = url;
    document.set_path(WELL_KNOWN_PATH);
    Ok(document.to_string())
}

fn fetch_error(message: impl Into<String>) -> WellKnownError {
    WellKnownError::new("WELL_KNOWN_FETCH", message)
}

/// GETs the document at `url`: one request, no redirect, at most `WELL_KNOWN_BYTES_MAX` bytes
/// read (a longer answer is refused without reading it whole), within
/// [`WELL_KNOWN_FETCH_TIMEOUT_MS`]. The document's trust comes from its signature and the pins,
/// not from the transport: over https the server is checked against the system's roots.
pub async fn fetch(url: &str) -> Result<Vec<u8>, WellKnownError> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(WELL_KNOWN_FETCH_TIMEOUT_MS))
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("bcd/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| fetch_error(format!("the HTTP client: {e}")))?;
    let mut response = client.get(url).send().await.map_err(|e| fetch_error(format!("GET {url}: {}", error_chain(&e))))?;
    if !response.status().is_success() {
        return Err(fetch_error(format!("GET {url} answered {}", response.status())));
    }
    if response.content_length().is_some_and(|n| n > WELL_KNOWN_BYTES_MAX as u64) {
        return Err(WellKnownError::new("WELL_KNOWN_TOO_LARGE", format!("the document is over {WELL_KNOWN_BYTES_MAX} bytes")));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| fetch_error(format!("reading {url}: {}", error_chain(&e))))? {
        if body.len() + chunk.len() > WELL_KNOWN_BYTES_MAX {
            return Err(WellKnownError::new(
                "WELL_KNOWN_TOO_LARGE",
                format!("the document is over {WELL_KNOWN_BYTES_MAX} bytes"),
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// The document of `server`, fetched and checked: its signature, then each pin given. The
/// caller has sent nothing anywhere else yet.
pub async fn fetch_checked(server: &str, held: &HeldPins<'_>) -> Result<WellKnown, WellKnownError> {
    let url = document_url(server).map_err(fetch_error)?;
    let bytes = fetch(&url).await?;
    check(&bytes, held)
}

/// A fetched document checked whole and against the held pins.
pub fn check(bytes: &[u8], held: &HeldPins<'_>) -> Result<WellKnown, WellKnownError> {
    let (document, _signer) = bc_core::well_known::verify_document(bytes)?;
    document.check_pins(held)?;
    Ok(document)
}

/// `join-encryption.jwk` beside the configuration file `config`.
pub fn jwk_path(config: &Path) -> PathBuf {
    config.parent().unwrap_or(Path::new(".")).join(crate::config::JOIN_ENCRYPTION_JWK_FILE)
}

/// Writes the document's join encryption key as `join-encryption.jwk` (0644: a public key),
/// a new file renamed into place.
pub fn write_jwk(path: &Path, document: &WellKnown) -> Result<(), String> {
    let text = serde_json::to_string_pretty(&document.join_encryption_key).map_err(|e| e.to_string())?;
    let partial = path.with_extension("jwk.partial");
    let _ = std::fs::remove_file(&partial);
    bc_core::keys::write_new_file(&partial, format!("{text}\n").as_bytes(), 0o644).map_err(|e| e.to_string())?;
    std::fs::rename(&partial, path).map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(())
}

/// The join encryption key of `join-encryption.jwk` at `path`, if the file exists, checked
/// against `pin` when one is configured.
pub fn read_jwk(path: &Path, pin: Option<&str>) -> Result<Option<[u8; 32]>, WellKnownError> {
    let refused = |message: String| WellKnownError::new("JOIN_ENCRYPTION_JWK", message);
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(refused(format!("cannot read {}: {e}", path.display()))),
    };
    if meta.len() > JWK_BYTES_MAX {
        return Err(refused(format!("{} is over {JWK_BYTES_MAX} bytes", path.display())));
    }
    let text = std::fs::read_to_string(path).map_err(|e| refused(format!("cannot read {}: {e}", path.display())))?;
    let jwk: serde_json::Value = serde_json::from_str(&text).map_err(|e| refused(format!("{}: {e}", path.display())))?;
    let key = bc_core::well_known::parse_x25519_jwk(&jwk).map_err(|e| refused(format!("{}: {e}", path.display())))?;
    let actual = bc_core::well_known::encryption_pin(&key);
    if let Some(pin) = pin
        && actual != pin
    {
        return Err(WellKnownError::new(
            "PIN_MISMATCH",
            format!("{} is the key {actual}, not join_encryption_key_pin {pin}", path.display()),
        ));
    }
    Ok(Some(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_url_is_https_or_loopback_http_without_a_path() {
        assert_eq!(document_url("https://cp.example:8443").unwrap(), "https://cp.example:8443/.well-known/better-compute");
        assert_eq!(document_url("http://127.0.0.1:7000/").unwrap(), "http://127.0.0.1:7000/.well-known/better-compute");
        assert!(document_url("http://cp.example:7000").unwrap_err().contains("plaintext"));
        assert!(document_url("https://cp.example/api").is_err());
        assert!(document_url("https://u:p@cp.example").is_err());
        assert!(document_url("ftp://cp.example").is_err());
        assert!(document_url("not a url").is_err());
    }

    #[test]
    fn a_jwk_file_is_read_and_checked_against_its_pin() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("join-encryption.jwk");
        assert_eq!(read_jwk(&path, None).unwrap(), None, "no file: no key");
        let key = bc_core::well_known::JoinEncryptionKey::from_secret(&[2; 32]);
        std::fs::write(&path, key.jwk().to_string()).unwrap();
        assert_eq!(read_jwk(&path, Some(&key.pin())).unwrap(), Some(*key.public()));
        let other = bc_core::well_known::JoinEncryptionKey::from_secret(&[3; 32]).pin();
        assert_eq!(read_jwk(&path, Some(&other)).unwrap_err().code, "PIN_MISMATCH");
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(read_jwk(&path, None).unwrap_err().code, "JOIN_ENCRYPTION_JWK");
    }
}
