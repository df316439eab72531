//! The agents' endpoint's serving certificate. Agents do not trust a CA for it: they pin the
//! SHA-256 of its SubjectPublicKeyInfo (`sha256/` + base64, RFC 7469's pin), printed at every
//! start. Given by flags, or made at first start in the data directory (the key 0600), so a
//! fresh `dev` or `serve` is TLS from the first agent on.

use std::path::Path;
use std::sync::Arc;

use bc_core::{Error, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub const SERVING_CERT_FILE: &str = "agents-tls.crt";
pub const SERVING_KEY_FILE: &str = "agents-tls.key";

/// A serving certificate chain, its key, and the pin of the first certificate's key.
pub struct ServingIdentity {
    pub chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    pub pin: String,
}

impl std::fmt::Debug for ServingIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServingIdentity").field("pin", &self.pin).finish_non_exhaustive()
    }
}

/// `sha256/` + standard base64 of SHA-256 over the certificate's SubjectPublicKeyInfo
/// (`bc_pin::spki_pin`, the computation agents check it with).
pub fn spki_pin(cert: &CertificateDer<'_>) -> Result<String> {
    bc_pin::spki_pin(cert).map_err(|e| Error::invalid(format!("the serving certificate does not parse: {e}")))
}

impl ServingIdentity {
    /// From PEM files given by flags (`--agents-tls-cert`, `--agents-tls-key`).
    pub fn load(cert: &Path, key: &Path) -> Result<Self> {
        let read = |path: &Path| std::fs::read(path).map_err(|e| Error::invalid(format!("cannot read {}: {e}", path.display())));
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(cert)?)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::invalid(format!("{}: not a PEM certificate chain: {e}", cert.display())))?;
        let first = chain.first().ok_or_else(|| Error::invalid(format!("{} holds no certificate", cert.display())))?;
        let pin = spki_pin(first)?;
        let key = PrivateKeyDer::from_pem_slice(&read(key)?)
            .map_err(|e| Error::invalid(format!("{}: not a PEM private key: {e}", key.display())))?;
        Ok(Self { chain, key, pin })
    }

    /// The certificate in `dir`, made (self-signed, for `localhost` and the loopback addresses,
    /// plus `names`) when there is none; `true` when it was made now.
    pub fn load_or_create(dir: &Path, names: &[String]) -> Result<(Self, bool)> {
        let (cert_path, key_path) = (dir.join(SERVING_CERT_FILE), dir.join(SERVING_KEY_FILE));
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => return Ok((Self::load(&cert_path, &key_path)?, false)),
            (false, false) => {}
            _ => {
                return Err(Error::InvalidArgument {
                    message: format!("only one of {} and {} exists", cert_path.display(), key_path.display()),
                    hint: Some(
                        "restore the other, or move both away to make a new certificate (agents must then pin the new one)"
                            .into(),
                    ),
                });
            }
        }
        let mut subject_names = vec!["localhost".to_owned(), "127.0.0.1".to_owned(), "::1".to_owned()];
        subject_names.extend(names.iter().cloned());
        let made = rcgen::generate_simple_self_signed(subject_names)
            .map_err(|e| Error::Internal(format!("making the serving certificate: {e}")))?;
        // The key first, never over an existing file, then the certificate.
        bc_core::keys::write_new_file(&key_path, made.signing_key.serialize_pem().as_bytes(), 0o600)?;
        bc_core::keys::write_new_file(&cert_path, made.cert.pem().as_bytes(), 0o644)?;
        bc_core::keys::sync_dir_of(&cert_path)?;
        Ok((Self::load(&cert_path, &key_path)?, true))
    }

    /// The rustls configuration: TLS 1.2 and 1.3 with ring, HTTP/2 only (gRPC).
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>> {
        self.server_config_for_nodes(None)
    }

    /// [`Self::server_config`], asking each peer for a node certificate checked by `nodes`
    /// (`crate::node_ca::NodeCa::client_verifier`), when given.
    pub fn server_config_for_nodes(
        &self,
        nodes: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    ) -> Result<Arc<rustls::ServerConfig>> {
        let builder = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Internal(format!("tls: {e}")))?;
        let builder = match nodes {
            Some(verifier) => builder.with_client_cert_verifier(verifier),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| Error::invalid(format!("the serving certificate and key do not go together: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_made_certificate_is_kept_and_its_pin_is_stable() {
        let dir = tempfile::tempdir().unwrap();
        let (made, created) = ServingIdentity::load_or_create(dir.path(), &[]).unwrap();
        assert!(created && made.pin.starts_with("sha256/"));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(SERVING_KEY_FILE)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (again, created) = ServingIdentity::load_or_create(dir.path(), &[]).unwrap();
        assert!(!created);
        assert_eq!(again.pin, made.pin);
        again.server_config().unwrap();
        std::fs::remove_file(dir.path().join(SERVING_CERT_FILE)).unwrap();
        assert!(ServingIdentity::load_or_create(dir.path(), &[]).is_err(), "a lone key is not replaced");
    }
}
