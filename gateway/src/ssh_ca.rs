//! The deployment's SSH user certificate authority: break-glass access to a node with an
//! OpenSSH user certificate that only that node accepts (`nodes.issueSshCert`).
//!
//! The CA is an Ed25519 key made at the first start and kept in the `secrets` table of the
//! root tenant (row [`SSH_USER_CA_SECRET_ID`]), so it is sealed at rest under the data key like
//! every other secret and is never in the log or a projection. Two servers starting on one
//! empty database both try to store one; the second insert fails on the row's key and that
//! server reads the first one's key instead, so a deployment has exactly one CA.
//!
//! Signing happens here, at the edge, from what `decide::ssh_cert_issue` decided and the log
//! holds (principal, validity, key id, serial): the nonce is derived from the appended event's
//! id, so an idempotent retry of the same call signs the very same certificate again.
//!
//! What the node trusts is [`SshUserCa::trusted_public_keys`]: the CA's OpenSSH public key line,
//! sent to every agent in its session's welcome; the agent writes it to the file `sshd` reads
//! as `TrustedUserCAKeys`.

use bc_core::id::TenantId;
use bc_core::store::EventStore;
use bc_core::{Error, Result};
use sha2::{Digest, Sha256};
use ssh_key::certificate::{Builder, CertType};
use ssh_key::private::Ed25519Keypair;
use ssh_key::{Algorithm, Certificate, HashAlg, PrivateKey, PublicKey};

/// The `secrets` row (root tenant) that holds the CA's 32-byte seed, hex, sealed.
pub const SSH_USER_CA_SECRET_ID: &str = "ssh-user-ca/v1";
/// The comment of the CA's public key line, so an operator reading `TrustedUserCAKeys` sees
/// whose key it is.
pub const SSH_USER_CA_COMMENT: &str = "better-compute-ssh-user-ca";
/// The longest public key line `nodes.issueSshCert` reads, in bytes: an Ed25519 line is about
/// 100, a P-521 one about 300; a comment makes up the rest.
pub const SSH_PUBLIC_KEY_BYTES_MAX: usize = 2048;
/// What the certificate's nonce is derived from, before the event id.
const NONCE_CONTEXT: &[u8] = b"better-compute/ssh-cert-nonce/v1\n";

/// The extensions OpenSSH's `ssh-keygen -s` grants a user certificate by default.
pub const SSH_CERT_EXTENSIONS: &[&str] =
    &["permit-X11-forwarding", "permit-agent-forwarding", "permit-port-forwarding", "permit-pty", "permit-user-rc"];

/// The deployment's SSH user CA.
pub struct SshUserCa {
    key: PrivateKey,
}

impl std::fmt::Debug for SshUserCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshUserCa").field("fingerprint", &self.fingerprint()).finish_non_exhaustive()
    }
}

/// What one certificate says, as decided and appended (`node.ssh_cert_issued`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertificateOrder<'a> {
    /// The one principal: the node (and account) it is good for.
    pub principal: &'a str,
    pub key_id: &'a str,
    pub serial: u64,
    pub valid_after_s: u64,
    pub valid_before_s: u64,
    /// The appended event's id: the nonce is derived from it.
    pub event_id: &'a str,
}

impl SshUserCa {
    /// The CA from its 32-byte Ed25519 seed.
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        let mut key = PrivateKey::from(Ed25519Keypair::from_seed(seed));
        key.set_comment(SSH_USER_CA_COMMENT);
        Self { key }
    }

    /// The CA stored in `store` (root tenant), made and stored first if there is none.
    /// Returns whether this call made it.
    pub async fn load_or_create(store: &dyn EventStore, now_ms: u64) -> Result<(Self, bool)> {
        if let Some(ca) = Self::load(store).await? {
            return Ok((ca, false));
        }
        // The CA's key is a secret: from the OS's randomness, never from a seed.
        let seed = rand::random::<[u8; 32]>();
        match store.secret_put(TenantId::ROOT, SSH_USER_CA_SECRET_ID, &hex::encode(seed), now_ms).await {
            Ok(()) => Ok((Self::from_seed(&seed), true)),
            // Another server stored one at the same moment: that one is the deployment's.
            Err(put) => match Self::load(store).await? {
                Some(ca) => Ok((ca, false)),
                None => Err(put),
            },
        }
    }

    async fn load(store: &dyn EventStore) -> Result<Option<Self>> {
        let Some(text) = store.secret_get(TenantId::ROOT, SSH_USER_CA_SECRET_ID).await? else { return Ok(None) };
        let seed = hex::decode(text.trim()).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()).ok_or_else(|| Error::Corrupt {
            tenant: TenantId::ROOT.to_string(),
            seq: 0,
            what: format!("secret {SSH_USER_CA_SECRET_ID} is not a 32-byte hex seed"),
        })?;
        Ok(Some(Self::from_seed(&seed)))
    }

    /// The CA's public key as one OpenSSH line (`ssh-ed25519 AAAA… better-compute-ssh-user-ca`).
    pub fn public_openssh(&self) -> String {
        self.key.public_key().to_openssh().expect("an Ed25519 public key encodes")
    }

    /// `SHA256:…`, as `ssh-keygen -l` prints it.
    pub fn fingerprint(&self) -> String {
        self.key.public_key().fingerprint(HashAlg::Sha256).to_string()
    }

    /// Every CA key a node trusts now, one OpenSSH line each: today the one CA.
    pub fn trusted_public_keys(&self) -> Vec<String> {
        vec![self.public_openssh()]
    }

    /// Signs a user certificate for `subject` as `order` says.
    pub fn sign(&self, subject: &PublicKey, order: &CertificateOrder<'_>) -> Result<Certificate> {
        let nonce = Sha256::new().chain_update(NONCE_CONTEXT).chain_update(order.event_id.as_bytes()).finalize();
        let failed = |e: ssh_key::Error| Error::Internal(format!("signing an SSH certificate: {e}"));
        let mut builder = Builder::new(nonce.to_vec(), subject.key_data().clone(), order.valid_after_s, order.valid_before_s)
            .map_err(failed)?;
        builder.serial(order.serial).map_err(failed)?;
        builder.cert_type(CertType::User).map_err(failed)?;
        builder.key_id(order.key_id).map_err(failed)?;
        builder.valid_principal(order.principal).map_err(failed)?;
        for extension in SSH_CERT_EXTENSIONS {
            builder.extension(*extension, "").map_err(failed)?;
        }
        builder.sign(&self.key).map_err(failed)
    }
}

/// Reads a caller's OpenSSH public key line: Ed25519 or ECDSA only, and never anything that
/// looks like a private key (which is refused without echoing any of it).
pub fn parse_user_public_key(field: &str, text: &str) -> Result<PublicKey> {
    let text = text.trim();
    if text.contains("PRIVATE KEY") {
        return Err(invalid_hint(
            format!("{field} holds a private key; send only the public key"),
            "the .pub file beside your key holds the public line (ssh-keygen -y -f KEY prints it)",
        ));
    }
    if text.len() > SSH_PUBLIC_KEY_BYTES_MAX {
        return Err(Error::invalid(format!("{field} is longer than {SSH_PUBLIC_KEY_BYTES_MAX} bytes")));
    }
    if text.contains('\n') {
        return Err(Error::invalid(format!("{field} must be one OpenSSH public key line")));
    }
    let key = PublicKey::from_openssh(text).map_err(|_| {
        invalid_hint(
            format!("{field} is not an OpenSSH public key"),
            "give the line of an id_ed25519.pub or id_ecdsa.pub file: `ssh-ed25519 AAAA… comment`",
        )
    })?;
    match key.algorithm() {
        Algorithm::Ed25519 | Algorithm::Ecdsa { .. } => Ok(key),
        other => Err(invalid_hint(
            format!("{field} is a {} key; only Ed25519 and ECDSA keys are certified", other.as_str()),
            "make one with ssh-keygen -t ed25519",
        )),
    }
}

fn invalid_hint(message: String, hint: &str) -> Error {
    Error::InvalidArgument { message, hint: Some(hint.to_owned()) }
}

/// The subject key's fingerprint, `SHA256:…`: what the event records of it.
pub fn public_key_fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUBJECT: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGPp5cSj0ubxLBNKS9nHc9vlsXR+lxeUHkpUqc6yIaLy me@laptop";

    fn order() -> CertificateOrder<'static> {
        CertificateOrder {
            principal: "bc-node:node_01:root",
            key_id: "apikey:key_01 node:node_01 request:req_01",
            serial: 42,
            valid_after_s: 1_000,
            valid_before_s: 1_960,
            event_id: "evt_01",
        }
    }

    #[test]
    fn a_certificate_says_what_was_ordered_and_verifies_under_the_ca() {
        let ca = SshUserCa::from_seed(&[7; 32]);
        let subject = parse_user_public_key("publicKey", SUBJECT).unwrap();
        let cert = ca.sign(&subject, &order()).unwrap();
        assert_eq!(cert.cert_type(), CertType::User);
        assert_eq!(cert.valid_principals(), ["bc-node:node_01:root".to_owned()]);
        assert_eq!(cert.key_id(), "apikey:key_01 node:node_01 request:req_01");
        assert_eq!((cert.serial(), cert.valid_after(), cert.valid_before()), (42, 1_000, 1_960));
        assert_eq!(cert.public_key(), subject.key_data());
        assert!(cert.extensions().contains_key("permit-pty"));
        assert!(cert.critical_options().is_empty());
        let ca_fingerprint = ca.key.public_key().fingerprint(HashAlg::Sha256);
        cert.validate_at(1_500, [&ca_fingerprint]).unwrap();
        assert!(cert.validate_at(2_000, [&ca_fingerprint]).is_err(), "expired");
        let other = SshUserCa::from_seed(&[8; 32]).key.public_key().fingerprint(HashAlg::Sha256);
        assert!(cert.validate_at(1_500, [&other]).is_err(), "another CA");
    }

    #[test]
    fn the_same_order_signs_the_same_certificate() {
        let ca = SshUserCa::from_seed(&[7; 32]);
        let subject = parse_user_public_key("publicKey", SUBJECT).unwrap();
        let first = ca.sign(&subject, &order()).unwrap().to_openssh().unwrap();
        assert_eq!(first, ca.sign(&subject, &order()).unwrap().to_openssh().unwrap());
        let other = CertificateOrder { event_id: "evt_02", ..order() };
        assert_ne!(first, ca.sign(&subject, &other).unwrap().to_openssh().unwrap());
    }

    #[test]
    fn the_public_line_is_an_ed25519_openssh_key_with_its_comment() {
        let ca = SshUserCa::from_seed(&[7; 32]);
        let line = ca.public_openssh();
        assert!(line.starts_with("ssh-ed25519 AAAA"), "{line}");
        assert!(line.ends_with(SSH_USER_CA_COMMENT), "{line}");
        assert_eq!(ca.trusted_public_keys(), vec![line]);
        assert!(ca.fingerprint().starts_with("SHA256:"));
        assert!(!format!("{ca:?}").contains(&hex::encode([7u8; 32])));
    }

    #[test]
    fn only_ed25519_and_ecdsa_public_keys_are_read() {
        assert!(parse_user_public_key("publicKey", SUBJECT).is_ok());
        let ecdsa = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBEmKSENjQEezOmxkZMy7opKgwFB9nkt5YRrYMjNuG5N87uRgg6CLrbo5wAdT/y6v0mKV0U2w0WZ2YB/++Tpockg= e@x";
        assert!(parse_user_public_key("publicKey", ecdsa).is_ok());
        let private = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n";
        let e = parse_user_public_key("publicKey", private).unwrap_err().to_string();
        assert!(e.contains("private key") && !e.contains("b3BlbnNzaC1rZXktdjEAAAAA"), "{e}");
        assert!(parse_user_public_key("publicKey", "ssh-ed25519 notbase64").is_err());
        assert!(parse_user_public_key("publicKey", &format!("{SUBJECT}\n{SUBJECT}")).is_err());
        let rsa = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQC7 x@y";
        assert!(parse_user_public_key("publicKey", rsa).is_err());
    }
}
