//! The deployment's join keys (docs/admission.md, "The well-known document"): the **join
//! signing key** (Ed25519), which signs the well-known document and every `JoinResponse`, and
//! the **join encryption key** (X25519), to which `bcd join` seals the join token with HPKE
//! (`bc_core::well_known`), so a TLS-terminating proxy in front of the agents' endpoint never
//! sees a token.
//!
//! Both are made once per deployment, at the first start, and kept in one row of the `secrets`
//! table of the root tenant ([`JOIN_KEYS_SECRET_ID`]: two 32-byte seeds, hex), sealed at rest
//! under the data key like every other secret and never in the log or a projection. One row for
//! both, as the node CA's: two servers racing on an empty database agree on one pair (the
//! second insert fails on the row's key and that server reads the first one's).
//!
//! [`WellKnownDocument`] is the signed document this process serves at
//! `GET /.well-known/better-compute`, made once at start from the agents' endpoint it names.

use bc_core::id::TenantId;
use bc_core::store::EventStore;
use bc_core::well_known::{self, JoinEncryptionKey, WellKnown};
use bc_core::{Error, Result};
use ed25519_dalek::{Signer, SigningKey};
use serde::{Deserialize, Serialize};

/// The `secrets` row (root tenant) that holds both keys' seeds, sealed.
pub const JOIN_KEYS_SECRET_ID: &str = "join-keys/v1";
/// The public file beside the log key: both keys' public halves and pins, what `pki show`
/// prints (the keys themselves are in the database, sealed).
pub const JOIN_KEYS_FILE: &str = "join-keys.json";

/// The row's value: both seeds, hex.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Stored {
    signing_seed: String,
    encryption_seed: String,
}

/// The deployment's join keys.
pub struct JoinKeys {
    signing: SigningKey,
    encryption: JoinEncryptionKey,
}

impl std::fmt::Debug for JoinKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinKeys")
            .field("signing_pin", &self.signing_pin())
            .field("encryption_pin", &self.encryption.pin())
            .finish_non_exhaustive()
    }
}

fn corrupt(what: String) -> Error {
    Error::Corrupt { tenant: TenantId::ROOT.to_string(), seq: 0, what }
}

fn seed_of(hex_text: &str) -> Result<[u8; 32]> {
    hex::decode(hex_text)
        .ok()
        .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok())
        .ok_or_else(|| corrupt(format!("the {JOIN_KEYS_SECRET_ID} secret does not hold two 32-byte seeds")))
}

impl JoinKeys {
    pub fn from_seeds(signing: &[u8; 32], encryption: &[u8; 32]) -> Self {
        Self { signing: SigningKey::from_bytes(signing), encryption: JoinEncryptionKey::from_secret(encryption) }
    }

    async fn load(store: &dyn EventStore) -> Result<Option<Self>> {
        let Some(text) = store.secret_get(TenantId::ROOT, JOIN_KEYS_SECRET_ID).await? else { return Ok(None) };
        let stored: Stored =
            serde_json::from_str(&text).map_err(|e| corrupt(format!("the {JOIN_KEYS_SECRET_ID} secret does not parse: {e}")))?;
        Ok(Some(Self::from_seeds(&seed_of(&stored.signing_seed)?, &seed_of(&stored.encryption_seed)?)))
    }

    /// The keys stored in `store`, made and stored first when there are none. Returns whether
    /// this call made them.
    #[allow(clippy::disallowed_methods)] // secret keys: from the OS's randomness, never a seed
    pub async fn load_or_create(store: &dyn EventStore, now_ms: u64) -> Result<(Self, bool)> {
        if let Some(keys) = Self::load(store).await? {
            return Ok((keys, false));
        }
        let (signing, encryption) = (rand::random::<[u8; 32]>(), rand::random::<[u8; 32]>());
        let stored = Stored { signing_seed: hex::encode(signing), encryption_seed: hex::encode(encryption) };
        let text = serde_json::to_string(&stored).map_err(|e| Error::Internal(e.to_string()))?;
        match store.secret_put(TenantId::ROOT, JOIN_KEYS_SECRET_ID, &text, now_ms).await {
            Ok(()) => Ok((Self::from_seeds(&signing, &encryption), true)),
            // Another server stored a pair at the same moment: that one is the deployment's.
            Err(put) => match Self::load(store).await? {
                Some(keys) => Ok((keys, false)),
                None => Err(put),
            },
        }
    }

    pub fn signing_pin(&self) -> String {
        well_known::signing_pin(&self.signing.verifying_key())
    }

    pub fn encryption(&self) -> &JoinEncryptionKey {
        &self.encryption
    }

    pub fn signing_public(&self) -> [u8; 32] {
        self.signing.verifying_key().to_bytes()
    }

    /// The public halves and pins, as [`JOIN_KEYS_FILE`] and `pki show` give them.
    pub fn public_json(&self) -> serde_json::Value {
        serde_json::json!({
            "joinSigningPin": self.signing_pin(),
            "joinSigningKey": well_known::ed25519_jwk(&self.signing.verifying_key()),
            "joinEncryptionPin": self.encryption.pin(),
            "joinEncryptionKey": self.encryption.jwk(),
        })
    }

    /// The join signature of a `JoinResponse` over `message`
    /// (`bc_core::well_known::join_response_signing_message`).
    pub fn sign_join_response(&self, message: &[u8]) -> Vec<u8> {
        self.signing.sign(message).to_bytes().to_vec()
    }

    /// The signed well-known document naming the agents' endpoint at `agents_url`, its serving
    /// certificate's pin (none for h2c) and the log key's pin.
    pub fn document(&self, agents_url: &str, serving_ca_pin: Option<&str>, log_key_pin: &str) -> Result<WellKnownDocument> {
        if agents_url.is_empty() || agents_url.len() > well_known::AGENTS_URL_BYTES_MAX {
            return Err(Error::invalid(format!("the agents' URL is 1 to {} bytes", well_known::AGENTS_URL_BYTES_MAX)));
        }
        let document = WellKnown {
            version: well_known::WELL_KNOWN_VERSION,
            agents_url: agents_url.to_owned(),
            serving_ca_pin: serving_ca_pin.map(str::to_owned),
            log_key_pin: log_key_pin.to_owned(),
            join_signing_key: well_known::ed25519_jwk(&self.signing.verifying_key()),
            join_signing_pin: self.signing_pin(),
            join_encryption_key: self.encryption.jwk(),
            join_encryption_pin: self.encryption.pin(),
            join_encryption_suite: well_known::HpkeSuite::ours(),
        };
        let bytes = well_known::sign_document(&document, &self.signing).map_err(Error::Internal)?;
        // What is served must read back as what a joining machine checks.
        debug_assert!(well_known::verify_document(&bytes).is_ok());
        if bytes.len() > well_known::WELL_KNOWN_BYTES_MAX {
            return Err(Error::Internal("the well-known document is over its bound".into()));
        }
        Ok(WellKnownDocument { bytes })
    }
}

/// The document this process serves, signed once at start.
#[derive(Clone, Debug)]
pub struct WellKnownDocument {
    /// The JSON served, exactly.
    pub bytes: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_verifies_and_names_the_keys() {
        let keys = JoinKeys::from_seeds(&[1; 32], &[2; 32]);
        let served = keys.document("https://127.0.0.1:7443", Some("sha256/x"), "sha256/y").unwrap();
        let (document, signer) = well_known::verify_document(&served.bytes).unwrap();
        assert_eq!(well_known::signing_pin(&signer), keys.signing_pin());
        assert_eq!(document.join_encryption_pin, keys.encryption().pin());
        assert_eq!(document.agents_url, "https://127.0.0.1:7443");
        assert!(format!("{keys:?}").contains("signing_pin"), "Debug shows pins, never seeds");
        assert!(!format!("{keys:?}").contains(&hex::encode([1u8; 32])));
    }
}
