//! A monitor's checks, pure: what `better-compute audit follow` does with what it fetched.
//!
//! The monitor keeps, per tenant, the last checkpoint it accepted, the compact range of that
//! tree (`merkle::RootBuilder`'s perfect subtrees: O(log n) hashes) and the hash of the last
//! event. Each new checkpoint must be signed by a trusted key and be no smaller; every new
//! entry is checked (the event hashes to its entry, the entry's leaf hash is the level-0 tile's,
//! `seq` and `prev` follow on, its signature, when it carries one, verifies under a trusted
//! key), pushed onto the compact range, and at the end the range's root must be the
//! checkpoint's. Because the range was built from the old tree, a matching root proves the new
//! tree extends the old one: a fork or a rewritten entry fails here, with the tenant and the
//! index.
//!
//! Key rotation: when a trusted key signed a `log_key.rotated` event (in the root tenant's
//! chain) and that event is then covered by a checkpoint a trusted key signed, the new key is
//! trusted from then on (`FollowState::rotated_keys`). A monitor of the root tenant sees the
//! event among its entries; a monitor of any tenant (or one that missed the checkpoint the old
//! key sealed) is given a checkpoint signed by a key it does not trust yet
//! ([`FollowError::Untrusted`]), fetches the rotations' proofs and learns the key from them
//! ([`FollowState::learn_rotations`], the checks `audit check-proof` makes).

use base64::Engine;
use ed25519_dalek::VerifyingKey;
use serde::{Deserialize, Serialize};

use crate::audit::LOG_KEY_ROTATED;
use crate::event::{Envelope, GENESIS_PREV, SignatureColumns, sha256, signature_columns};
use crate::id::TenantId;
use crate::keys::{KeyRing, key_id_of};
use crate::merkle::{self, Hash, RootBuilder};
use crate::note::{self, CheckpointBody, Vkey};
use crate::tiles::BundledEvent;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// What went wrong, located. `Fork` and `BadEntry` are what a monitor exists to find.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FollowError {
    #[error("tenant {tenant}: fork at size {size}: {what}")]
    Fork { tenant: String, size: u64, what: String },
    #[error("tenant {tenant}: bad entry at index {index}: {what}")]
    BadEntry { tenant: String, index: u64, what: String },
    /// The checkpoint verifies under no trusted key: a rotation not yet learned, or a log
    /// signing with a key the monitor must not trust.
    #[error("{0}")]
    Untrusted(String),
    #[error("{0}")]
    Invalid(String),
}

/// The state file's contents for one tenant.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FollowState {
    pub tenant: String,
    pub size: u64,
    /// The last accepted checkpoint, verbatim (empty before the first).
    pub checkpoint: String,
    /// The compact range of the tree of `size`: (subtree size, base64 hash), left to right.
    pub subtrees: Vec<(u64, String)>,
    /// Base64 of the hash of event `size` (zeros before the first).
    pub last_hash: String,
    /// Keys trusted on top of the pins, learned from rotations (hex public keys).
    pub rotated_keys: Vec<String>,
    /// Rotations seen in entries not yet covered by an accepted checkpoint: (index, hex key).
    #[serde(default)]
    pub pending_rotations: Vec<(u64, String)>,
}

impl FollowState {
    pub fn new(tenant: TenantId) -> Self {
        Self {
            tenant: tenant.to_string(),
            size: 0,
            checkpoint: String::new(),
            subtrees: vec![],
            last_hash: B64.encode(GENESIS_PREV),
            rotated_keys: vec![],
            pending_rotations: vec![],
        }
    }

    fn fork(&self, size: u64, what: impl Into<String>) -> FollowError {
        FollowError::Fork { tenant: self.tenant.clone(), size, what: what.into() }
    }

    fn bad(&self, index: u64, what: impl Into<String>) -> FollowError {
        FollowError::BadEntry { tenant: self.tenant.clone(), index, what: what.into() }
    }

    /// The keys trusted: the pinned ones and the ones rotations introduced.
    pub fn trusted(&self, pinned: &[VerifyingKey]) -> Vec<VerifyingKey> {
        let mut out = pinned.to_vec();
        for k in &self.rotated_keys {
            if let Some(key) =
                hex::decode(k).ok().and_then(|b| <[u8; 32]>::try_from(b).ok()).and_then(|b| VerifyingKey::from_bytes(&b).ok())
                && !out.contains(&key)
            {
                out.push(key);
            }
        }
        out
    }

    /// Opens a fetched checkpoint with the trusted keys (named `deployment`) and compares it
    /// with the last one accepted. Returns its body; `None` when it is the same tree.
    pub fn check_checkpoint(
        &self,
        note_text: &str,
        trusted: &[VerifyingKey],
        deployment: &str,
    ) -> Result<Option<CheckpointBody>, FollowError> {
        let mut opened = Err("no trusted key".to_owned());
        for key in trusted {
            let vkey = Vkey::new(deployment, *key).map_err(FollowError::Invalid)?;
            opened = note::open_note(note_text, &vkey);
            if opened.is_ok() {
                break;
            }
        }
        let text =
            opened.map_err(|e| FollowError::Untrusted(format!("tenant {}: the checkpoint does not verify: {e}", self.tenant)))?;
        let body = CheckpointBody::parse(&text).map_err(FollowError::Invalid)?;
        if !body.origin.ends_with(&format!("/audit/{}", self.tenant)) {
            return Err(FollowError::Invalid(format!("the checkpoint is for {}, not tenant {}", body.origin, self.tenant)));
        }
        if body.size < self.size {
            return Err(self.fork(body.size, format!("the log shrank from size {} to {}: rewound", self.size, body.size)));
        }
        if body.size == self.size {
            if self.size > 0 && body.root != self.root()? {
                return Err(self.fork(body.size, "a checkpoint of the size already seen with another root"));
            }
            return Ok(None);
        }
        Ok(Some(body))
    }

    /// Learns the new keys of `rotations` (`GET /audit/{tenant}/rotations`) that the keys trusted
    /// now (`pinned`, and the ones learned before) vouch for, each checked as
    /// `bc_core::audit::follow_rotations` does for `check-proof`; returns how many are new. A
    /// rotation whose old key is trusted but that does not check is an error: a forged rotation.
    pub fn learn_rotations(
        &mut self,
        rotations: &[crate::note::RotationProof],
        pinned: &[VerifyingKey],
    ) -> Result<usize, FollowError> {
        let trusted = self.trusted(pinned);
        let after = crate::audit::follow_rotations(rotations, &[], &trusted)
            .map_err(|e| FollowError::Untrusted(format!("tenant {}: {e}", self.tenant)))?;
        let mut learned = 0;
        for key in after.iter().filter(|k| !trusted.contains(k)) {
            self.rotated_keys.push(hex::encode(key.as_bytes()));
            learned += 1;
        }
        Ok(learned)
    }

    fn builder(&self) -> Result<RootBuilder, FollowError> {
        let mut stack = Vec::new();
        for (size, h) in &self.subtrees {
            let h = B64
                .decode(h)
                .ok()
                .and_then(|b| <Hash>::try_from(b).ok())
                .ok_or_else(|| FollowError::Invalid("state file: a bad hash".into()))?;
            stack.push((*size, h));
        }
        let b =
            RootBuilder::from_subtrees(stack).ok_or_else(|| FollowError::Invalid("state file: a bad compact range".into()))?;
        if b.size() != self.size {
            return Err(FollowError::Invalid("state file: the compact range does not match its size".into()));
        }
        Ok(b)
    }

    fn root(&self) -> Result<Hash, FollowError> {
        Ok(self.builder()?.root())
    }

    /// Checks the entries `self.size ..` (in order) and, if the root matches `body`, accepts
    /// `note_text` as the new checkpoint. `entries[i]`, `tile[i]`, `events[i]` are leaf
    /// `self.size + i`'s entry, level-0 tile hash and event. Nothing changes on an error.
    pub fn advance(
        &mut self,
        body: &CheckpointBody,
        note_text: &str,
        entries: &[Vec<u8>],
        tile: &[Hash],
        events: &[BundledEvent],
        trusted: &[VerifyingKey],
    ) -> Result<u64, FollowError> {
        let count = body.size - self.size;
        if entries.len() as u64 != count || tile.len() as u64 != count || events.len() as u64 != count {
            return Err(FollowError::Invalid(format!("tenant {}: fetched the wrong number of entries", self.tenant)));
        }
        let mut keys = KeyRing::default();
        for k in trusted {
            keys.insert(*k);
        }
        let mut builder = self.builder()?;
        let mut prev: Hash = B64
            .decode(&self.last_hash)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| FollowError::Invalid("state file: a bad last hash".into()))?;
        let mut rotations = self.pending_rotations.clone();
        for (i, ((entry, tile_hash), event)) in entries.iter().zip(tile).zip(events).enumerate() {
            let index = self.size + i as u64;
            let hash = sha256(&event.canonical);
            if entry.as_slice() != hash.as_slice() {
                return Err(self.bad(index, "the event does not hash to its entry (an edited event)"));
            }
            if merkle::leaf_hash(&hash) != *tile_hash {
                return Err(self.bad(index, "the level-0 tile differs from the entry's leaf hash"));
            }
            let envelope = Envelope::from_canonical(&event.canonical).map_err(|e| self.bad(index, format!("the event: {e}")))?;
            if envelope.tenant.to_string() != self.tenant || envelope.seq != index + 1 {
                return Err(self.bad(
                    index,
                    format!(
                        "the event is seq {} of {}, wanted seq {} of {}",
                        envelope.seq,
                        envelope.tenant,
                        index + 1,
                        self.tenant
                    ),
                ));
            }
            if envelope.prev != prev {
                return Err(self.bad(index, "prev does not match the hash of the event before"));
            }
            // An event's own signature, when it carries one (the checkpoint's signature over
            // the root covers every entry either way); the ones `signed_alone` names must.
            match signature_columns(envelope.seq, &envelope.event_type, &event.key_id, &event.sig) {
                Ok(SignatureColumns::CoveredLater) => {}
                Ok(SignatureColumns::Signed { key_id, sig }) => keys
                    .verify_event(key_id, &hash, sig)
                    .map_err(|e| self.bad(index, format!("signature: {e} (a key you trust?)")))?,
                Err(what) => return Err(self.bad(index, what)),
            }
            if envelope.event_type == LOG_KEY_ROTATED
                && let Some(new) = rotated_key(&envelope.payload)
            {
                // Trusted only once a trusted checkpoint covers it (below); usable for the
                // entries after it already, as the log uses it from then on.
                keys.insert(new);
                rotations.push((index, hex::encode(new.as_bytes())));
            }
            builder.push_leaf_hash(merkle::leaf_hash(&hash));
            prev = hash;
        }
        if builder.root() != body.root {
            return Err(self.fork(
                body.size,
                "the checkpoint's root is not the root of the entries after the last checkpoint: the log was forked or rewritten",
            ));
        }
        self.size = body.size;
        self.checkpoint = note_text.to_owned();
        self.subtrees = builder.subtrees().iter().map(|(s, h)| (*s, B64.encode(h))).collect();
        self.last_hash = B64.encode(prev);
        self.pending_rotations.clear();
        for (_, key) in rotations {
            if !self.rotated_keys.contains(&key) {
                self.rotated_keys.push(key);
            }
        }
        Ok(count)
    }
}

/// The new key a `log_key.rotated` payload names, if it is well formed and its id matches.
pub fn rotated_key(payload: &ciborium::Value) -> Option<VerifyingKey> {
    let ciborium::Value::Map(entries) = payload else { return None };
    let (mut id, mut key) = (None, None);
    for (k, v) in entries {
        match (k, v) {
            (ciborium::Value::Text(k), ciborium::Value::Text(t)) if k == "newKeyId" => id = Some(t.clone()),
            (ciborium::Value::Text(k), ciborium::Value::Bytes(b)) if k == "newPublicKey" => key = Some(b.clone()),
            _ => {}
        }
    }
    let key = VerifyingKey::from_bytes(&<[u8; 32]>::try_from(key?).ok()?).ok()?;
    (key_id_of(&key) == id?).then_some(key)
}
