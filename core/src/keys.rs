//! The log key: an Ed25519 key that signs every event hash (and, later, checkpoints).
//!
//! Keys are named by a key id derived from the public key, so a log can hold events signed
//! under several keys after a rotation. The *pin* (`sha256/` + base64 of SHA-256 of the 32-byte
//! public key) is what an auditor writes down once and checks everything against.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use base64::Engine;
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Prefix of the message that an event signature covers: `EVENT_SIGNATURE_CONTEXT ‖ hash`.
/// It keeps an event signature from ever being valid as any other signed statement.
pub const EVENT_SIGNATURE_CONTEXT: &[u8] = b"better-compute/event/v1\n";

/// `lk_` + the first 8 bytes of SHA-256(public key), hex.
pub fn key_id_of(public: &VerifyingKey) -> String {
    let digest = Sha256::digest(public.as_bytes());
    format!("lk_{}", hex::encode(&digest[..8]))
}

/// `sha256/` + standard base64 of SHA-256(public key).
pub fn pin_of(public: &VerifyingKey) -> String {
    let digest = Sha256::digest(public.as_bytes());
    format!("sha256/{}", base64::engine::general_purpose::STANDARD.encode(digest))
}

pub fn event_signing_message(hash: &[u8; 32]) -> Vec<u8> {
    let mut message = Vec::with_capacity(EVENT_SIGNATURE_CONTEXT.len() + 32);
    message.extend_from_slice(EVENT_SIGNATURE_CONTEXT);
    message.extend_from_slice(hash);
    message
}

/// Ed25519 signatures this process has found good, for a caller that verifies the same log again
/// and again (the simulator's full checks, every few steps of a run). Whether a signature
/// verifies is a function of the public key, the message and the signature alone, so one found
/// good once is good again: [`crate::audit::verify_with`] still recomputes every event's hash
/// from its bytes and checks every link, and skips only the curve arithmetic of a signature it
/// has checked before. Kept as a SHA-256 of the three and of which check (strict or plain) found
/// it good: 32 bytes a signature.
#[derive(Default)]
pub struct VerifiedSignatures {
    seen: std::sync::Mutex<std::collections::HashSet<[u8; 32]>>,
}

impl VerifiedSignatures {
    fn digest(key: &VerifyingKey, message: &[u8], signature: &Signature, strict: bool) -> [u8; 32] {
        let mut digest = Sha256::new();
        digest.update([u8::from(strict)]);
        digest.update(key.as_bytes());
        digest.update(signature.to_bytes());
        digest.update(message);
        digest.finalize().into()
    }

    /// Whether this signature of `message` under `key` was found good before (by
    /// `verify_strict` when `strict`, else by `verify`: a signature can pass one and not the other).
    pub fn contains(&self, key: &VerifyingKey, message: &[u8], signature: &Signature, strict: bool) -> bool {
        let digest = Self::digest(key, message, signature, strict);
        self.seen.lock().expect("verified signatures").contains(&digest)
    }

    /// Remembers a signature found good.
    pub fn insert(&self, key: &VerifyingKey, message: &[u8], signature: &Signature, strict: bool) {
        let digest = Self::digest(key, message, signature, strict);
        self.seen.lock().expect("verified signatures").insert(digest);
    }

    /// Verifies (`verify_strict` when `strict`, else `verify`) unless found good before, and
    /// remembers it when good.
    pub fn verify(&self, key: &VerifyingKey, message: &[u8], signature: &Signature, strict: bool) -> bool {
        let digest = Self::digest(key, message, signature, strict);
        if self.seen.lock().expect("verified signatures").contains(&digest) {
            return true;
        }
        let good = if strict { key.verify_strict(message, signature).is_ok() } else { key.verify(message, signature).is_ok() };
        if good {
            self.seen.lock().expect("verified signatures").insert(digest);
        }
        good
    }

    /// How many signatures are remembered.
    pub fn len(&self) -> usize {
        self.seen.lock().expect("verified signatures").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub struct LogKey {
    signing: SigningKey,
    key_id: String,
}

impl std::fmt::Debug for LogKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret half.
        f.debug_struct("LogKey").field("key_id", &self.key_id).finish_non_exhaustive()
    }
}

impl LogKey {
    /// A new key from the OS's randomness (a secret is never drawn from a seed; the simulator's
    /// key is `from_seed`).
    #[allow(clippy::disallowed_methods)]
    pub fn generate() -> Self {
        Self::from_seed(rand::random::<[u8; 32]>())
    }

    pub fn from_seed(seed: [u8; 32]) -> Self {
        let signing = SigningKey::from_bytes(&seed);
        let key_id = key_id_of(&signing.verifying_key());
        Self { signing, key_id }
    }

    /// The secret seed as hex, for writing the key file. Never log it.
    pub fn seed_hex(&self) -> String {
        hex::encode(self.signing.to_bytes())
    }

    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    pub fn public(&self) -> VerifyingKey {
        self.signing.verifying_key()
    }

    pub fn pin(&self) -> String {
        pin_of(&self.public())
    }

    /// Signs arbitrary bytes. Only for formats that carry their own context (C2SP signed notes,
    /// whose text starts with an origin line); events use [`LogKey::sign_event_hash`].
    pub fn sign_raw(&self, message: &[u8]) -> [u8; 64] {
        self.signing.sign(message).to_bytes()
    }

    pub fn sign_event_hash(&self, hash: &[u8; 32]) -> [u8; 64] {
        self.signing.sign(&event_signing_message(hash)).to_bytes()
    }

    /// Loads the key file, or creates it (mode 0600, never over an existing file) when absent.
    /// Returns whether it was created.
    pub fn load_or_create(path: &Path) -> Result<(Self, bool)> {
        match std::fs::read_to_string(path) {
            Ok(text) => Ok((Self::parse_file(path, &text)?, false)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = Self::generate();
                write_secret_file(path, format!("{}\n", key.seed_hex()).as_bytes())?;
                Ok((key, true))
            }
            Err(e) => Err(Error::Internal(format!("reading log key {}: {e}", path.display()))),
        }
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::InvalidArgument {
            message: format!("cannot read log key {}: {e}", path.display()),
            hint: Some("run better-compute dev (or serve) once to create it".into()),
        })?;
        Self::parse_file(path, &text)
    }

    fn parse_file(path: &Path, text: &str) -> Result<Self> {
        let bytes = hex::decode(text.trim()).ok().and_then(|b| <[u8; 32]>::try_from(b).ok());
        let seed = bytes.ok_or_else(|| Error::Corrupt {
            tenant: "-".into(),
            seq: 0,
            what: format!("log key file {} is not 64 hex characters", path.display()),
        })?;
        Ok(Self::from_seed(seed))
    }
}

/// Writes a new file readable only by its owner; refuses to replace an existing one.
pub fn write_secret_file(path: &Path, contents: &[u8]) -> Result<()> {
    write_new_file(path, contents, 0o600)
}

/// Writes a new file with `mode`, synced, and syncs its directory so the file's name survives a
/// crash too (a key or token lost after its first use is a log that no longer verifies);
/// refuses to replace an existing one (`ALREADY_EXISTS`).
pub fn write_new_file(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::Internal(format!("creating {}: {e}", parent.display())))?;
    }
    let mut file =
        std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => Error::AlreadyExists { what: format!("file {}", path.display()) },
            _ => Error::Internal(format!("creating {}: {e}", path.display())),
        })?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .map_err(|e| Error::Internal(format!("writing {}: {e}", path.display())))?;
    sync_dir_of(path)
}

/// Syncs the directory holding `path`, so that a file created or renamed there is durable.
pub fn sync_dir_of(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::Internal(format!("syncing directory {}: {e}", dir.display())))
}

/// A public key as the store holds it (`signing_keys`): 32 bytes, a valid point, and named by
/// its own key id.
pub fn stored_public_key(key_id: &str, public: &[u8]) -> Result<VerifyingKey> {
    let corrupt = |what: String| Error::Corrupt { tenant: "-".into(), seq: 0, what };
    let bytes = <[u8; 32]>::try_from(public).map_err(|_| corrupt(format!("key {key_id} is not 32 bytes")))?;
    let public = VerifyingKey::from_bytes(&bytes).map_err(|_| corrupt(format!("key {key_id} is not a valid point")))?;
    if key_id_of(&public) != key_id {
        return Err(corrupt(format!("key id {key_id} does not match its key")));
    }
    Ok(public)
}

/// Public keys by key id, for verification.
#[derive(Clone, Default, Debug)]
pub struct KeyRing {
    keys: HashMap<String, VerifyingKey>,
}

impl KeyRing {
    pub fn insert(&mut self, public: VerifyingKey) {
        self.keys.insert(key_id_of(&public), public);
    }

    pub fn insert_bytes(&mut self, key_id: &str, public: &[u8]) -> Result<()> {
        self.insert(stored_public_key(key_id, public)?);
        Ok(())
    }

    pub fn get(&self, key_id: &str) -> Option<&VerifyingKey> {
        self.keys.get(key_id)
    }

    /// Checks an event signature under the named key. `verify_strict` rejects small-order keys
    /// and non-canonical signatures.
    pub fn verify_event(&self, key_id: &str, hash: &[u8; 32], sig: &[u8]) -> Result<(), String> {
        let key = self.get(key_id).ok_or_else(|| format!("unknown key id {key_id}"))?;
        let sig = Signature::from_slice(sig).map_err(|_| "signature is not 64 bytes".to_owned())?;
        key.verify_strict(&event_signing_message(hash), &sig).map_err(|_| "signature does not verify".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_found_good_is_remembered_and_a_bad_one_never() {
        let key = LogKey::from_seed([7; 32]);
        let public = key.public();
        let message = event_signing_message(&[1; 32]);
        let good = Signature::from_bytes(&key.sign_event_hash(&[1; 32]));
        let verified = VerifiedSignatures::default();
        assert!(!verified.contains(&public, &message, &good, true));
        assert!(verified.verify(&public, &message, &good, true));
        assert!(verified.contains(&public, &message, &good, true));
        // Found good by the strict check is not found good by the other, nor for another message.
        assert!(!verified.contains(&public, &message, &good, false));
        assert!(!verified.contains(&public, &event_signing_message(&[2; 32]), &good, true));
        // A bad signature fails and is not remembered; nor is a good one under another key.
        let mut bytes = good.to_bytes();
        bytes[0] ^= 1;
        let bad = Signature::from_bytes(&bytes);
        assert!(!verified.verify(&public, &message, &bad, true));
        assert!(!verified.contains(&public, &message, &bad, true));
        let other = LogKey::from_seed([8; 32]).public();
        assert!(!verified.verify(&other, &message, &good, true));
        assert_eq!(verified.len(), 1);
    }
}
