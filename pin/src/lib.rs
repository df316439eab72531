//! Trusting a TLS server by the key it holds, not by a CA: the pin of RFC 7469 (`sha256/` and the
//! standard base64 of the SHA-256 of the certificate's DER SubjectPublicKeyInfo, what
//! `openssl x509 -pubkey | openssl pkey -pubin -outform der | openssl dgst -sha256 -binary |
//! base64` prints) and a rustls verifier that accepts exactly the leaf whose key hashes to it.
//!
//! The agent pins the gateway's agents' endpoint, the Redfish client pins a BMC's self-signed
//! certificate, and the gateway prints the pin of its own serving certificate: one computation,
//! so the three agree by construction.
//!
//! Invariants: a pinned leaf is accepted whatever signed it and whatever name or dates it carries
//! (a BMC's self-signed certificate rarely names its address or is renewed), but the handshake's
//! signatures are checked as always, so the server proves it holds the pinned key. A mismatch is
//! an error that names the key presented ([`PinMismatch`]), so an operator who trusts it can pin
//! it. No workspace dependency: `bmc` stays a leaf crate.

use std::sync::Arc;

use base64::Engine;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

/// What every pin starts with: the only hash RFC 7469 defines.
pub const PIN_PREFIX: &str = "sha256/";

/// The pin of a certificate's key.
pub fn spki_pin(cert: &CertificateDer<'_>) -> Result<String, rustls::Error> {
    let parsed = webpki::EndEntityCert::try_from(cert)
        .map_err(|_| rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding))?;
    let spki = parsed.subject_public_key_info();
    Ok(format!("{PIN_PREFIX}{}", base64::engine::general_purpose::STANDARD.encode(Sha256::digest(spki.as_ref()))))
}

/// Why a text is not a pin.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PinFormat {
    #[error("a pin is sha256/ followed by base64 (of the key's SHA-256)")]
    NoPrefix,
    #[error("a pin is sha256/ followed by the base64 of 32 bytes")]
    NotThirtyTwoBytes,
}

/// Checks that `text` is a pin (`sha256/` and the standard base64 of 32 bytes).
pub fn check_pin(text: &str) -> Result<(), PinFormat> {
    let digest = text.strip_prefix(PIN_PREFIX).ok_or(PinFormat::NoPrefix)?;
    match base64::engine::general_purpose::STANDARD.decode(digest) {
        Ok(bytes) if bytes.len() == 32 => Ok(()),
        _ => Err(PinFormat::NotThirtyTwoBytes),
    }
}

/// The leaf's key is not the pinned one: says which key it is.
#[derive(Debug, thiserror::Error)]
#[error("{subject} key is {presented}, not the pinned key")]
pub struct PinMismatch {
    /// Whose certificate, as a person reads it: "the BMC's certificate".
    pub subject: &'static str,
    pub presented: String,
}

/// Whether a rustls error is a pinned [`Verifier`]'s refusal of another key.
pub fn is_pin_mismatch(error: &rustls::Error) -> bool {
    match error {
        rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other)) => other.0.is::<PinMismatch>(),
        _ => false,
    }
}

/// Rewrites webpki's refusal of a certificate (its cause, and the pin of the key the server
/// presented) into the error a person reads, one that says what to do instead.
pub type Explain = fn(cause: String, presented: String) -> Arc<dyn std::error::Error + Send + Sync>;

/// How [`Verifier`] trusts a server.
#[derive(Debug)]
enum Trust {
    /// Exactly the leaf whose key hashes to `pin`.
    Pin { pin: String, subject: &'static str },
    /// webpki against a CA bundle (the host name included), its refusals explained.
    Ca { inner: Arc<WebPkiServerVerifier>, explain: Explain },
    /// Anything: no certificate and no handshake signature is checked.
    Any,
}

/// The workspace's one rustls server-certificate verifier: by pin, by a CA bundle, or (insecure
/// mode) not at all. By pin, the leaf is accepted whatever signed it and whatever name or dates
/// it carries, and the handshake's signatures are checked with the provider's algorithms.
#[derive(Debug)]
pub struct Verifier {
    trust: Trust,
    provider: Arc<CryptoProvider>,
}

impl Verifier {
    /// Trusts exactly the leaf whose key hashes to `pin`, checked first; `subject` names whose
    /// certificate it checks in a mismatch's message ("the BMC's certificate").
    pub fn pinned(pin: &str, subject: &'static str, provider: Arc<CryptoProvider>) -> Result<Self, PinFormat> {
        check_pin(pin)?;
        Ok(Self { trust: Trust::Pin { pin: pin.to_owned(), subject }, provider })
    }

    /// Trusts what `inner` (webpki over a CA bundle) trusts; a refusal of the certificate is
    /// rewritten by `explain`, given the pin of the key presented.
    pub fn ca(inner: Arc<WebPkiServerVerifier>, explain: Explain, provider: Arc<CryptoProvider>) -> Self {
        Self { trust: Trust::Ca { inner, explain }, provider }
    }

    /// Trusts any certificate and any handshake signature: insecure mode proves nothing, so it
    /// does not fail on keys the provider will not verify (old 1024-bit RSA) either.
    pub fn any(provider: Arc<CryptoProvider>) -> Self {
        Self { trust: Trust::Any, provider }
    }
}

impl Verifier {
    /// A handshake signature checked as the trust says: by the CA bundle's verifier, by the
    /// provider's algorithms (a pinned key must still prove it is held), or not at all.
    fn signature(
        &self,
        by_ca: impl FnOnce(&WebPkiServerVerifier) -> Result<HandshakeSignatureValid, rustls::Error>,
        by_provider: impl FnOnce(&WebPkiSupportedAlgorithms) -> Result<HandshakeSignatureValid, rustls::Error>,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        match &self.trust {
            Trust::Pin { .. } => by_provider(&self.provider.signature_verification_algorithms),
            Trust::Ca { inner, .. } => by_ca(inner),
            Trust::Any => Ok(HandshakeSignatureValid::assertion()),
        }
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let refuse = |error: Arc<dyn std::error::Error + Send + Sync>| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(error)))
        };
        match &self.trust {
            Trust::Pin { pin, subject } => {
                let presented = spki_pin(end_entity)?;
                if presented == *pin {
                    return Ok(ServerCertVerified::assertion());
                }
                Err(refuse(Arc::new(PinMismatch { subject, presented })))
            }
            Trust::Ca { inner, explain } => {
                inner.verify_server_cert(end_entity, intermediates, server_name, ocsp, now).map_err(|e| match e {
                    rustls::Error::InvalidCertificate(cause) => {
                        let presented = spki_pin(end_entity).unwrap_or_else(|_| "(its key is unreadable)".into());
                        refuse(explain(format!("{cause:?}"), presented))
                    }
                    other => other,
                })
            }
            Trust::Any => Ok(ServerCertVerified::assertion()),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.signature(
            |inner| inner.verify_tls12_signature(message, cert, dss),
            |algs| verify_tls12_signature(message, cert, dss, algs),
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.signature(
            |inner| inner.verify_tls13_signature(message, cert, dss),
            |algs| verify_tls13_signature(message, cert, dss, algs),
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        match &self.trust {
            Trust::Ca { inner, .. } => inner.supported_verify_schemes(),
            Trust::Pin { .. } | Trust::Any => self.provider.signature_verification_algorithms.supported_schemes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate() -> CertificateDer<'static> {
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap().cert.der().clone()
    }

    #[test]
    fn a_pin_is_sha256_and_the_base64_of_32_bytes() {
        let pin = spki_pin(&certificate()).unwrap();
        assert_eq!(check_pin(&pin), Ok(()));
        assert_eq!(check_pin("sha1/AAAA"), Err(PinFormat::NoPrefix));
        assert_eq!(check_pin("sha256/AAAA"), Err(PinFormat::NotThirtyTwoBytes));
        assert_eq!(check_pin("sha256/not base64!"), Err(PinFormat::NotThirtyTwoBytes));
    }

    #[test]
    fn only_the_pinned_key_is_accepted_and_a_mismatch_names_the_key_presented() {
        let (pinned, other) = (certificate(), certificate());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = Verifier::pinned(&spki_pin(&pinned).unwrap(), "the test's certificate", provider).unwrap();
        let name = ServerName::try_from("anything.example").unwrap();
        assert!(verifier.verify_server_cert(&pinned, &[], &name, &[], UnixTime::now()).is_ok(), "any name, any issuer");
        let refused = verifier.verify_server_cert(&other, &[], &name, &[], UnixTime::now()).unwrap_err();
        assert!(is_pin_mismatch(&refused), "{refused}");
        let presented = spki_pin(&other).unwrap();
        let rustls::Error::InvalidCertificate(rustls::CertificateError::Other(mismatch)) = &refused else { panic!("{refused}") };
        assert_eq!(mismatch.0.to_string(), format!("the test's certificate key is {presented}, not the pinned key"));
        assert!(!is_pin_mismatch(&rustls::Error::InvalidCertificate(rustls::CertificateError::BadEncoding)));
    }
}
