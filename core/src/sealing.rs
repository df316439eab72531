//! Secrets at rest: every value of the `secrets` table (webhook signing secrets, the SHA-256 of
//! API keys' and join tokens' secrets, and BMC passwords) is sealed with
//! XChaCha20-Poly1305 under the deployment's **data key**, a 32-byte key in a 0600 file beside
//! the log key (`data.key`) or where `--data-key-file` / `BETTER_COMPUTE_DATA_KEY_FILE` says,
//! never in the database. Whoever reads the database (a backup, a
//! replica, a leaked dump) reads no secret.
//!
//! A sealed value is text: `bcs1:`, then the key's id (`dk_` and 8 bytes of SHA-256 of the key,
//! hex), `:`, and standard base64 of the 24-byte nonce followed by the ciphertext and its tag.
//! The associated data binds it to its row (`tenant`, `id`), so a sealed value copied to another
//! row does not open. A value without the prefix is one written before sealing existed: it is
//! read as it is, and [`crate::store::SecretStore::secrets_reseal`] seals it.
//!
//! Rotation (`better-compute pki rotate-data-key`) makes a new key, re-seals every row under
//! it while the old one still opens what is not yet re-sealed, then retires the old key; a
//! crash in between loses nothing (both keys are on disk until every row names the new one).

use std::path::Path;
use std::sync::Arc;

use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::id::TenantId;

/// The prefix of a sealed value.
pub const SEALED_PREFIX: &str = "bcs1:";
/// The data key's file in the data directory.
pub const DATA_KEY_FILE: &str = "data.key";
/// The next data key, while a rotation re-seals the rows.
pub const DATA_KEY_NEXT_FILE: &str = "data.key.next";
/// What the associated data starts with, so a sealed secret is never valid as anything else.
const CONTEXT: &[u8] = b"better-compute/secret/v1\n";
const NONCE_BYTES: usize = 24;

/// One data key.
pub struct DataKey {
    cipher: XChaCha20Poly1305,
    id: String,
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataKey").field("id", &self.id).finish_non_exhaustive()
    }
}

impl DataKey {
    pub fn from_bytes(key: [u8; 32]) -> Self {
        let digest = Sha256::digest(key);
        Self { cipher: XChaCha20Poly1305::new(&key.into()), id: format!("dk_{}", hex::encode(&digest[..8])) }
    }

    /// A new data key from the OS's randomness: a secret, never drawn from a seed.
    #[allow(clippy::disallowed_methods)]
    pub fn generate() -> (Self, [u8; 32]) {
        let key = rand::random::<[u8; 32]>();
        (Self::from_bytes(key), key)
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Loads the key file (64 hex characters).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::InvalidArgument {
            message: format!("cannot read data key {}: {e}", path.display()),
            hint: Some("run better-compute dev (or serve) once to create it, beside the log key".into()),
        })?;
        let bytes = hex::decode(text.trim()).ok().and_then(|b| <[u8; 32]>::try_from(b).ok());
        let key = bytes.ok_or_else(|| Error::Corrupt {
            tenant: "-".into(),
            seq: 0,
            what: format!("data key file {} is not 64 hex characters", path.display()),
        })?;
        Ok(Self::from_bytes(key))
    }

    /// Writes a new key to `path` (0600, never over an existing file).
    pub fn create(path: &Path) -> Result<Self> {
        let (key, bytes) = Self::generate();
        crate::keys::write_secret_file(path, format!("{}\n", hex::encode(bytes)).as_bytes())?;
        Ok(key)
    }

    fn aad(tenant: TenantId, id: &str) -> Vec<u8> {
        let mut aad = CONTEXT.to_vec();
        aad.extend_from_slice(tenant.to_string().as_bytes());
        aad.push(b'\n');
        aad.extend_from_slice(id.as_bytes());
        aad
    }

    /// `value` sealed for the row (`tenant`, `id`). The nonce is from the OS's randomness: a
    /// nonce from a seed could repeat under one key, which XChaCha20-Poly1305 must never see.
    #[allow(clippy::disallowed_methods)]
    pub fn seal(&self, tenant: TenantId, id: &str, value: &str) -> Result<String> {
        let nonce_bytes = rand::random::<[u8; NONCE_BYTES]>();
        let aad = Self::aad(tenant, id);
        let nonce = XNonce::from(nonce_bytes);
        let sealed = self
            .cipher
            .encrypt(&nonce, Payload { msg: value.as_bytes(), aad: &aad })
            .map_err(|_| Error::Internal("sealing a secret failed".into()))?;
        let mut blob = nonce_bytes.to_vec();
        blob.extend_from_slice(&sealed);
        Ok(format!("{SEALED_PREFIX}{}:{}", self.id, base64::engine::general_purpose::STANDARD.encode(blob)))
    }

    fn open_blob(&self, tenant: TenantId, id: &str, blob: &[u8]) -> Result<String> {
        let corrupt = |what: &str| Error::Corrupt { tenant: tenant.to_string(), seq: 0, what: format!("secret {id}: {what}") };
        if blob.len() < NONCE_BYTES {
            return Err(corrupt("the sealed value is too short"));
        }
        let (nonce, sealed) = blob.split_at(NONCE_BYTES);
        let nonce = XNonce::try_from(nonce).map_err(|_| corrupt("the nonce is not 24 bytes"))?;
        let aad = Self::aad(tenant, id);
        let plain = self
            .cipher
            .decrypt(&nonce, Payload { msg: sealed, aad: &aad })
            .map_err(|_| corrupt("it does not open under its data key (altered, or moved from another row)"))?;
        String::from_utf8(plain).map_err(|_| corrupt("it is not text"))
    }
}

/// The keys a process opens secrets with: the current one (which seals) and, during a rotation,
/// the one before it.
#[derive(Debug)]
pub struct DataKeys {
    pub current: DataKey,
    pub previous: Option<DataKey>,
}

/// Whether a stored value is sealed, and under which key id.
pub fn sealed_key_id(stored: &str) -> Option<&str> {
    stored.strip_prefix(SEALED_PREFIX).and_then(|rest| rest.split_once(':')).map(|(id, _)| id)
}

impl DataKeys {
    pub fn new(current: DataKey) -> Arc<Self> {
        Arc::new(Self { current, previous: None })
    }

    pub fn seal(&self, tenant: TenantId, id: &str, value: &str) -> Result<String> {
        self.current.seal(tenant, id, value)
    }

    /// The value of a stored secret: opened with the key it names, or (written before sealing)
    /// as it is.
    pub fn open(&self, tenant: TenantId, id: &str, stored: &str) -> Result<String> {
        let Some(rest) = stored.strip_prefix(SEALED_PREFIX) else { return Ok(stored.to_owned()) };
        let (key_id, blob) = rest.split_once(':').ok_or_else(|| Error::Corrupt {
            tenant: tenant.to_string(),
            seq: 0,
            what: format!("secret {id}: a sealed value without its key id"),
        })?;
        let key =
            [Some(&self.current), self.previous.as_ref()].into_iter().flatten().find(|k| k.id == key_id).ok_or_else(|| {
                Error::Corrupt {
                    tenant: tenant.to_string(),
                    seq: 0,
                    what: format!("secret {id} is sealed under data key {key_id}, which this process does not hold"),
                }
            })?;
        let blob = base64::engine::general_purpose::STANDARD.decode(blob).map_err(|_| Error::Corrupt {
            tenant: tenant.to_string(),
            seq: 0,
            what: format!("secret {id}: the sealed value is not base64"),
        })?;
        key.open_blob(tenant, id, &blob)
    }
}

/// The data keys of `data_dir`: `data.key` (created at first start when `create`), and
/// `data.key.next` when a rotation was cut short (the rows are then being re-sealed under it:
/// it seals, the old one still opens).
pub fn load_data_keys(data_dir: &Path, create: bool) -> Result<(Arc<DataKeys>, bool)> {
    load_data_key_file(&data_dir.join(DATA_KEY_FILE), create)
}

/// The rotation's next key beside `path`: `path` + `.next` (`data.key.next` for `data.key`).
pub fn data_key_next_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".next");
    path.with_file_name(name)
}

/// [`load_data_keys`] with the key at `path` (given by a flag or the environment) and a
/// rotation's next key at [`data_key_next_path`].
pub fn load_data_key_file(path: &Path, create: bool) -> Result<(Arc<DataKeys>, bool)> {
    let (current, created) =
        if path.exists() || !create { (DataKey::load(path)?, false) } else { (DataKey::create(path)?, true) };
    let next = data_key_next_path(path);
    if next.exists() {
        let next = DataKey::load(&next)?;
        return Ok((Arc::new(DataKeys { current: next, previous: Some(current) }), created));
    }
    Ok((DataKeys::new(current), created))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_value_opens_only_in_its_own_row_and_under_its_key() {
        let keys = DataKeys::new(DataKey::from_bytes([7; 32]));
        let tenant = TenantId::ROOT;
        let sealed = keys.seal(tenant, "whsec_1", "the secret").unwrap();
        assert!(sealed.starts_with("bcs1:dk_") && !sealed.contains("the secret"), "{sealed}");
        assert_eq!(sealed_key_id(&sealed), Some(keys.current.id()));
        assert_eq!(keys.open(tenant, "whsec_1", &sealed).unwrap(), "the secret");
        assert_ne!(keys.seal(tenant, "whsec_1", "the secret").unwrap(), sealed, "a fresh nonce each time");
        assert!(keys.open(tenant, "whsec_2", &sealed).is_err(), "moved to another row");
        let other = TenantId::from_ulid(ulid::Ulid::from_parts(1, 1));
        assert!(keys.open(other, "whsec_1", &sealed).is_err(), "moved to another tenant");
        let mut flipped = sealed.clone().into_bytes();
        let last = flipped.len() - 2;
        flipped[last] = if flipped[last] == b'A' { b'B' } else { b'A' };
        assert!(keys.open(tenant, "whsec_1", std::str::from_utf8(&flipped).unwrap()).is_err(), "altered");
        let stranger = DataKeys::new(DataKey::from_bytes([8; 32]));
        let e = stranger.open(tenant, "whsec_1", &sealed).unwrap_err().to_string();
        assert!(e.contains("does not hold"), "{e}");
        assert_eq!(keys.open(tenant, "legacy", "plain text").unwrap(), "plain text", "written before sealing");
    }

    #[test]
    fn during_a_rotation_the_previous_key_still_opens_and_the_new_one_seals() {
        let old = DataKey::from_bytes([1; 32]);
        let sealed_old = old.seal(TenantId::ROOT, "s", "v").unwrap();
        let keys = DataKeys { current: DataKey::from_bytes([2; 32]), previous: Some(old) };
        assert_eq!(keys.open(TenantId::ROOT, "s", &sealed_old).unwrap(), "v");
        assert_eq!(sealed_key_id(&keys.seal(TenantId::ROOT, "s", "v").unwrap()), Some(keys.current.id()));
    }

    #[test]
    fn the_key_file_is_private_and_made_once() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (keys, created) = load_data_keys(dir.path(), true).unwrap();
        assert!(created);
        let mode = std::fs::metadata(dir.path().join(DATA_KEY_FILE)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (again, created) = load_data_keys(dir.path(), true).unwrap();
        assert!(!created);
        assert_eq!(again.current.id(), keys.current.id());
        assert!(load_data_keys(tempfile::tempdir().unwrap().path(), false).is_err(), "not made unless asked");
    }
}
