//! The node certificate: the X.509 client certificate the deployment's node CA issued for this
//! node's own key (at join, then renewed on the session), presented in every TLS handshake to
//! the agents' endpoint (docs/admission.md).
//!
//! It lives in `node-certificate.json` in the data directory (public: the key stays in
//! `node.key`), replaced whole on renewal. [`NodeCertificates`] is the rustls client
//! certificate resolver the channel holds: a renewal swaps what it presents, so the next
//! handshake uses the new certificate while the session goes on over the old connection.
//! [`renewal_due_ms`] says when to renew (pure).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use base64::Engine;
use ed25519_dalek::SigningKey;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;
use serde::{Deserialize, Serialize};

/// The file in the data directory.
pub const NODE_CERT_FILE: &str = "node-certificate.json";
/// A node renews its certificate once this fraction (numerator / denominator) of its lifetime
/// has passed, so a renewal refused or lost leaves a third to try again.
pub const RENEW_AT_NUMERATOR: u64 = 2;
pub const RENEW_AT_DENOMINATOR: u64 = 3;
const _: () = assert!(RENEW_AT_NUMERATOR < RENEW_AT_DENOMINATOR);
/// A renewal asked for and not answered is asked again after this.
pub const RENEW_RETRY_MS: u64 = 15_000;
/// The largest certificate file read.
pub const NODE_CERT_FILE_BYTES_MAX: u64 = 64 * 1024;
/// The message `bcd node` exits 1 with once its certificate is revoked.
pub const REVOKED_MESSAGE: &str = "agent: this node's certificate was revoked";

/// `node-certificate.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeCertificateFile {
    /// PEM.
    pub certificate: String,
    /// The node CA's certificate, PEM (for `openssl verify -CAfile` and the like).
    pub ca_certificate: String,
    /// When this node received it, and when it ends (Unix ms): the renewal is due between.
    pub issued_at_ms: u64,
    pub not_after_ms: u64,
}

fn pem(label: &str, der: &[u8]) -> String {
    let body = base64::engine::general_purpose::STANDARD.encode(der);
    let mut text = format!("-----BEGIN {label}-----\n");
    for line in body.as_bytes().chunks(64) {
        text.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        text.push('\n');
    }
    text.push_str(&format!("-----END {label}-----\n"));
    text
}

impl NodeCertificateFile {
    pub fn new(certificate_der: &[u8], ca_certificate_der: &[u8], issued_at_ms: u64, not_after_ms: u64) -> Self {
        Self {
            certificate: pem("CERTIFICATE", certificate_der),
            ca_certificate: pem("CERTIFICATE", ca_certificate_der),
            issued_at_ms,
            not_after_ms,
        }
    }

    /// The certificate's DER.
    pub fn certificate_der(&self) -> Result<CertificateDer<'static>, String> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(self.certificate.as_bytes()).map_err(|e| format!("the node certificate: {e}"))
    }

    /// The CA certificate's DER.
    pub fn ca_certificate_der(&self) -> Result<Vec<u8>, String> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(self.ca_certificate.as_bytes())
            .map(|c| c.to_vec())
            .map_err(|e| format!("the node CA certificate: {e}"))
    }

    pub fn path(data_dir: &Path) -> PathBuf {
        data_dir.join(NODE_CERT_FILE)
    }

    /// The file in `data_dir`, if there is one (a node that joined before the node CA has none).
    pub fn load(data_dir: &Path) -> Result<Option<Self>, String> {
        let path = Self::path(data_dir);
        let size = match std::fs::metadata(&path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        if size > NODE_CERT_FILE_BYTES_MAX {
            return Err(format!("{} is over {NODE_CERT_FILE_BYTES_MAX} bytes", path.display()));
        }
        let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map(Some).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes the file whole (a new file renamed over the old one), 0644: nothing in it is secret.
    pub fn store(&self, data_dir: &Path) -> Result<(), String> {
        let path = Self::path(data_dir);
        let mut temporary = path.clone().into_os_string();
        temporary.push(".new");
        let temporary = PathBuf::from(temporary);
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_file(&temporary);
        bc_core::keys::write_new_file(&temporary, format!("{text}\n").as_bytes(), 0o644).map_err(|e| e.to_string())?;
        std::fs::rename(&temporary, &path).map_err(|e| format!("cannot replace {}: {e}", path.display()))?;
        bc_core::keys::sync_dir_of(&path).map_err(|e| e.to_string())
    }
}

/// When a certificate received at `issued_at_ms` and ending at `not_after_ms` is to be renewed:
/// at [`RENEW_AT_NUMERATOR`]/[`RENEW_AT_DENOMINATOR`] of the way; `renew_after_ms` (a test's
/// `BCD_RENEW_AFTER`) brings the first renewal forward to that long after `started_ms`.
pub fn renewal_due_ms(issued_at_ms: u64, not_after_ms: u64, first: Option<(u64, u64)>) -> u64 {
    let lifetime = not_after_ms.saturating_sub(issued_at_ms);
    let due = issued_at_ms + lifetime / RENEW_AT_DENOMINATOR * RENEW_AT_NUMERATOR;
    match first {
        Some((started_ms, renew_after_ms)) => due.min(started_ms.saturating_add(renew_after_ms)),
        None => due,
    }
}

/// The node key as rustls signs with it: Ed25519 in a PKCS#8 v1 document (RFC 8410).
fn signing_key(key: &SigningKey) -> Result<Arc<dyn rustls::sign::SigningKey>, String> {
    // SEQUENCE { INTEGER 0, SEQUENCE { OID 1.3.101.112 }, OCTET STRING { OCTET STRING seed } }.
    const PREFIX: [u8; 16] = [0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    let mut der = PREFIX.to_vec();
    der.extend_from_slice(key.as_bytes());
    rustls::crypto::ring::sign::any_eddsa_type(&PrivatePkcs8KeyDer::from(der)).map_err(|e| format!("the node key for TLS: {e}"))
}

/// What the channel presents as its client certificate: the node's current certificate with
/// its key, swapped on renewal; nothing before the node has one.
#[derive(Debug)]
pub struct NodeCertificates {
    key: Arc<dyn rustls::sign::SigningKey>,
    current: RwLock<Option<Arc<CertifiedKey>>>,
}

impl NodeCertificates {
    pub fn new(key: &SigningKey, file: Option<&NodeCertificateFile>) -> Result<Arc<Self>, String> {
        let certificates = Self { key: signing_key(key)?, current: RwLock::new(None) };
        if let Some(file) = file {
            certificates.set(file)?;
        }
        Ok(Arc::new(certificates))
    }

    /// Presents `file`'s certificate from the next handshake on.
    pub fn set(&self, file: &NodeCertificateFile) -> Result<(), String> {
        let certified = CertifiedKey::new(vec![file.certificate_der()?], self.key.clone());
        *self.current.write().expect("the certificate lock is never poisoned") = Some(Arc::new(certified));
        Ok(())
    }
}

impl ResolvesClientCert for NodeCertificates {
    fn resolve(&self, _root_hint_subjects: &[&[u8]], sigschemes: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        if !sigschemes.contains(&rustls::SignatureScheme::ED25519) {
            return None;
        }
        self.current.read().expect("the certificate lock is never poisoned").clone()
    }

    fn has_certs(&self) -> bool {
        self.current.read().expect("the certificate lock is never poisoned").is_some()
    }
}

/// The alert rustls reports when the gateway's TLS layer refused this node's certificate as
/// revoked, as its `Display` writes it.
const REVOKED_ALERT_TEXT: &str = "received fatal alert: CertificateRevoked";

/// Whether a session's end says the node was revoked: the gateway's refusal
/// (`PERMISSION_DENIED`, `NODE_REVOKED: …`), or the TLS layer's `certificate_revoked` alert
/// anywhere in the error's chain. Under TLS 1.3 the alert comes after the client's side of the
/// handshake is done, on HTTP/2's first read, and h2 keeps only an I/O error's kind and text:
/// so the alert is recognised as a `rustls::Error` where it survives, else by its text.
pub fn is_revoked(status: &tonic::Status) -> bool {
    if status.code() == tonic::Code::PermissionDenied && status.message().starts_with(bc_proto::NODE_REVOKED_CODE) {
        return true;
    }
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = next {
        if is_revoked_alert(error) || error.to_string().contains(REVOKED_ALERT_TEXT) {
            return true;
        }
        // An io::Error's source skips the error it wraps: look at that one too.
        if let Some(inner) = error.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref())
            && is_revoked_alert(inner)
        {
            return true;
        }
        next = error.source();
    }
    false
}

/// A session's end as a person reads it: the status, then each error of its chain.
pub fn describe(status: &tonic::Status) -> String {
    let mut text = format!("{}: {}", status.code(), status.message());
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    let mut depth = 0;
    while let Some(error) = next
        && depth < ERROR_CHAIN_MAX
    {
        text.push_str(&format!(": {error}"));
        next = error.source();
        depth += 1;
    }
    text
}

/// The errors of a chain [`describe`] writes at most.
const ERROR_CHAIN_MAX: usize = 8;

fn is_revoked_alert(error: &(dyn std::error::Error + 'static)) -> bool {
    matches!(
        error.downcast_ref::<rustls::Error>(),
        Some(rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRevoked))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_is_renewed_two_thirds_of_the_way_or_when_a_test_says() {
        assert_eq!(renewal_due_ms(1_000, 121_000, None), 81_000);
        assert_eq!(renewal_due_ms(1_000, 121_000, Some((5_000, 3_000))), 8_000, "BCD_RENEW_AFTER brings it forward");
        assert_eq!(renewal_due_ms(1_000, 121_000, Some((5_000, 999_000))), 81_000, "but never later");
        assert_eq!(renewal_due_ms(5_000, 1_000, None), 5_000, "an expired one at once");
    }

    #[test]
    fn the_file_round_trips_and_the_key_signs_for_tls() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(NodeCertificateFile::load(dir.path()).unwrap(), None);
        let key = SigningKey::from_bytes(&[3; 32]);
        let made = rcgen::generate_simple_self_signed(vec!["node".to_owned()]).unwrap();
        let file = NodeCertificateFile::new(made.cert.der(), made.cert.der(), 10, 20);
        file.store(dir.path()).unwrap();
        file.store(dir.path()).unwrap();
        let loaded = NodeCertificateFile::load(dir.path()).unwrap().unwrap();
        assert_eq!(loaded, file);
        assert_eq!(loaded.certificate_der().unwrap(), *made.cert.der());
        let certificates = NodeCertificates::new(&key, None).unwrap();
        assert!(!certificates.has_certs());
        certificates.set(&loaded).unwrap();
        assert!(certificates.has_certs());
        assert!(certificates.resolve(&[], &[rustls::SignatureScheme::ED25519]).is_some());
        assert!(certificates.resolve(&[], &[rustls::SignatureScheme::ECDSA_NISTP256_SHA256]).is_none());
    }

    #[test]
    fn a_revocation_is_told_by_its_code_alone() {
        assert!(is_revoked(&tonic::Status::permission_denied(format!("{}: node x was revoked", bc_proto::NODE_REVOKED_CODE))));
        assert!(!is_revoked(&tonic::Status::permission_denied("node x has not joined, or was deleted")));
        assert!(!is_revoked(&tonic::Status::unavailable(bc_proto::NODE_REVOKED_CODE)));
    }
}
