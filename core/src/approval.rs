//! The bytes of destructive batches that every party checks alike (`docs/batches.md`): the
//! approval and approver-set messages, approver key ids, ECDSA P-256 signatures, a leaf's
//! canonical encoding, and the **release** a node gets with each command of a batch, with
//! [`verify_release`], the node's own check of it. Pure: bytes in, a verdict out.
//!
//! A node pins the approver set's root (`command_root_sha256` in `bcd`'s `config.toml`): the
//! SHA-256 of the epoch-1 set's message ([`approver_set_message`]). A release carries the chain
//! of sets from epoch 1 to the one the batch was approved under (each later set with the
//! signatures of its predecessor's quorum), the K approvals of the batch's message, and the
//! command's leaf index and RFC 6962 inclusion proof in the batch's root; the node recomputes
//! its leaf from the command it got (`{subject: its own node id, kind, payload: args}`).

use base64::Engine as _;
use p256::ecdsa::signature::Verifier as _;
use p256::ecdsa::{DerSignature, VerifyingKey};
use p256::pkcs8::DecodePublicKey as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::merkle::{self, Hash};
use crate::{Result, canonical};

/// The first line of the approval message (its format's version).
pub const APPROVAL_MESSAGE_V1: &str = "better-compute batch approval v1";
/// The first line of the approver-set message.
pub const APPROVER_SET_MESSAGE_V1: &str = "better-compute approver set v1";
/// A DER ECDSA P-256 signature is at most 72 bytes; its base64 at most this.
pub const SIGNATURE_B64_BYTES_MAX: usize = 128;
/// A P-256 SubjectPublicKeyInfo is 91 bytes; its base64 at most this.
pub const PUBLIC_KEY_B64_BYTES_MAX: usize = 256;
/// Approver-set epochs one release carries at most (the chain from the pinned epoch 1).
pub const RELEASE_EPOCHS_MAX: usize = 64;
/// Root pins one node's `command_root_sha256` holds at most.
pub const COMMAND_ROOTS_MAX: usize = 8;
/// Approvals or keys one release's set or approval list holds at most.
pub const RELEASE_KEYS_MAX: usize = 16;

/// What an approver signs for a batch: UTF-8, one `name value` line each, every line ending in
/// `\n`:
///
/// ```text
/// better-compute batch approval v1
/// trust-domain compute.example.com
/// batch batch_01k…
/// root 3f1c…            (64 lowercase hex digits)
/// size 12
/// expires-at-ms 1790000000000
/// ```
pub fn approval_message(trust_domain: &str, batch_id: &str, root_hex: &str, size: u64, expires_at_ms: u64) -> String {
    format!(
        "{APPROVAL_MESSAGE_V1}\ntrust-domain {trust_domain}\nbatch {batch_id}\nroot {root_hex}\nsize {size}\nexpires-at-ms {expires_at_ms}\n"
    )
}

/// One approver's public key.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeyRef {
    /// `ak_` and 16 hex digits: [`kid_of_spki`].
    pub kid: String,
    /// The key's SubjectPublicKeyInfo, DER, base64 (standard alphabet, padded).
    pub public_key: String,
}

/// One signature by an approver: ECDSA P-256 / SHA-256, ASN.1 DER, base64.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SignatureRef {
    pub kid: String,
    pub signature: String,
}

/// What K approvers of epoch N sign to publish the set of epoch N+1: its trust domain, epoch
/// and quorum, then one `key KID PUBLIC_KEY` line per key, sorted by kid.
pub fn approver_set_message<'a>(
    trust_domain: &str,
    epoch: u64,
    quorum: u64,
    keys: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> String {
    let mut sorted: Vec<(&str, &str)> = keys.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut text = format!("{APPROVER_SET_MESSAGE_V1}\ntrust-domain {trust_domain}\nepoch {epoch}\nquorum {quorum}\n");
    for (kid, public_key) in sorted {
        text.push_str(&format!("key {kid} {public_key}\n"));
    }
    text
}

/// An approver's key id: `ak_` and the first 16 hex digits of SHA-256 of its SubjectPublicKeyInfo
/// (DER).
pub fn kid_of_spki(spki_der: &[u8]) -> String {
    format!("ak_{}", &hex::encode(Sha256::digest(spki_der))[..16])
}

/// Parses a base64 SubjectPublicKeyInfo of a P-256 key, checking that `kid` is its id; the
/// refusal says why.
pub fn parse_public_key(kid: &str, public_key: &str) -> std::result::Result<VerifyingKey, String> {
    if public_key.len() > PUBLIC_KEY_B64_BYTES_MAX {
        return Err(format!("publicKey is over {PUBLIC_KEY_B64_BYTES_MAX} bytes"));
    }
    let der = base64::engine::general_purpose::STANDARD.decode(public_key).map_err(|e| format!("not base64: {e}"))?;
    let parsed = VerifyingKey::from_public_key_der(&der).map_err(|e| format!("not a P-256 public key: {e}"))?;
    let actual = kid_of_spki(&der);
    if actual != kid {
        return Err(format!("its key id is {actual}"));
    }
    Ok(parsed)
}

/// Whether `signature` (base64 DER) is `key`'s ECDSA P-256 / SHA-256 signature of `message`.
pub fn verify_signature(key: &VerifyingKey, message: &str, signature: &str) -> bool {
    if signature.len() > SIGNATURE_B64_BYTES_MAX {
        return false;
    }
    let Ok(der) = base64::engine::general_purpose::STANDARD.decode(signature) else { return false };
    let Ok(signature) = DerSignature::from_bytes(&der) else { return false };
    key.verify(message.as_bytes(), &signature).is_ok()
}

/// A leaf's bytes: `{subject, kind, payload}` in the log's canonical CBOR (map keys sorted by
/// their encoding, shortest integers, no floats).
pub fn leaf_bytes(subject: &str, kind: &str, payload: &serde_json::Value) -> Result<Vec<u8>> {
    let json = serde_json::json!({ "subject": subject, "kind": kind, "payload": payload });
    canonical::encode(canonical::from_json(&json)?)
}

/// The RFC 6962 inclusion proof of every leaf, in one pass: the tree built bottom-up (a level's
/// last node without a sibling goes up unchanged, which gives RFC 6962's tree), each proof the
/// siblings from the leaf up. `O(n log n)`, where one [`merkle::inclusion_proof`] per leaf is
/// `O(n²)`.
pub fn inclusion_proofs(leaves: &[Hash]) -> Vec<Vec<Hash>> {
    let mut proofs = vec![Vec::new(); leaves.len()];
    if leaves.len() < 2 {
        return proofs;
    }
    let mut level: Vec<Hash> = leaves.to_vec();
    // Where each leaf sits in the current level.
    let mut at: Vec<usize> = (0..leaves.len()).collect();
    while level.len() > 1 {
        for (leaf, position) in at.iter_mut().enumerate() {
            let sibling = *position ^ 1;
            if sibling < level.len() {
                proofs[leaf].push(level[sibling]);
            }
            *position >>= 1;
        }
        level =
            level.chunks(2).map(|pair| if pair.len() == 2 { merkle::node_hash(&pair[0], &pair[1]) } else { pair[0] }).collect();
    }
    proofs
}

/// One approver set of a release's chain.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReleaseSet {
    pub epoch: u64,
    pub quorum: u64,
    pub keys: Vec<KeyRef>,
    /// The signatures of the previous epoch's keys over this set's message (none for epoch 1).
    pub signatures: Vec<SignatureRef>,
}

/// What a node gets with each command of a released batch: enough to check, itself, that a
/// quorum of the pinned approver set signed a scope holding exactly this command.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchRelease {
    pub batch_id: String,
    pub trust_domain: String,
    /// The scope's RFC 6962 root, 64 lowercase hex digits.
    pub root: String,
    pub size: u64,
    pub expires_at_ms: u64,
    /// The command's leaf in the scope, and its inclusion proof (hex hashes, leaf upward).
    pub index: u64,
    pub proof: Vec<String>,
    /// The approvals that released the batch.
    pub approvals: Vec<SignatureRef>,
    /// The approver sets from epoch 1 to the one the batch was made under, in order.
    pub sets: Vec<ReleaseSet>,
}

/// Parses `command_root_sha256`: 64 lowercase hex digits per root, comma-separated (spaces
/// around a comma allowed), 1 to [`COMMAND_ROOTS_MAX`].
pub fn parse_command_roots(text: &str) -> std::result::Result<Vec<String>, String> {
    let bad = || "command_root_sha256 must be 64 lowercase hex digits per root, comma-separated".to_owned();
    let roots: Vec<String> = text.split(',').map(|r| r.trim().to_owned()).collect();
    if roots.is_empty() || roots.len() > COMMAND_ROOTS_MAX {
        return Err(bad());
    }
    for root in &roots {
        if root.len() != 64 || !root.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(bad());
        }
    }
    Ok(roots)
}

/// The root pin of an epoch-1 approver set: SHA-256 of its message, lowercase hex.
pub fn command_root_of(trust_domain: &str, quorum: u64, keys: &[KeyRef]) -> String {
    let message = approver_set_message(trust_domain, 1, quorum, keys.iter().map(|k| (k.kid.as_str(), k.public_key.as_str())));
    hex::encode(Sha256::digest(message.as_bytes()))
}

/// The kids of `signatures` that are valid signatures of `message` by distinct keys of `keys`.
fn valid_signers(keys: &[KeyRef], message: &str, signatures: &[SignatureRef]) -> std::result::Result<usize, String> {
    let mut valid: Vec<&str> = Vec::new();
    for signature in signatures {
        let Some(key) = keys.iter().find(|k| k.kid == signature.kid) else { continue };
        let key = parse_public_key(&key.kid, &key.public_key).map_err(|e| format!("approver key {}: {e}", key.kid))?;
        if verify_signature(&key, message, &signature.signature) && !valid.contains(&signature.kid.as_str()) {
            valid.push(&signature.kid);
        }
    }
    Ok(valid.len())
}

/// A node's check of a batch command's release: `roots` are its pins (`command_root_sha256`),
/// `node_id`, `kind` and `args` the command as it got it. `Ok` only when the chain of sets
/// starts at a pinned epoch-1 set, each later set carries the signatures of its predecessor's
/// quorum, the batch's message carries the final set's quorum of approvals, and the leaf
/// `{node_id, kind, args}` is at `index` under `root`. The refusal says which check failed.
pub fn verify_release(
    roots: &[String],
    node_id: &str,
    kind: &str,
    args: &serde_json::Value,
    release: &BatchRelease,
) -> std::result::Result<(), String> {
    let first = release.sets.first().ok_or("the release carries no approver set")?;
    if release.sets.len() > RELEASE_EPOCHS_MAX {
        return Err(format!("the release carries {} approver sets; at most {RELEASE_EPOCHS_MAX}", release.sets.len()));
    }
    for set in &release.sets {
        if set.keys.len() > RELEASE_KEYS_MAX || set.signatures.len() > RELEASE_KEYS_MAX {
            return Err(format!("the approver set of epoch {} has over {RELEASE_KEYS_MAX} keys or signatures", set.epoch));
        }
        if set.quorum == 0 || set.quorum > set.keys.len() as u64 {
            return Err(format!("the approver set of epoch {} has quorum {} of {} keys", set.epoch, set.quorum, set.keys.len()));
        }
    }
    if first.epoch != 1 {
        return Err(format!("the approver sets start at epoch {}, not 1", first.epoch));
    }
    let pin = command_root_of(&release.trust_domain, first.quorum, &first.keys);
    if !roots.contains(&pin) {
        return Err(format!("the epoch-1 approver set (sha256 {pin}) is not the pinned command root"));
    }
    for pair in release.sets.windows(2) {
        let (previous, next) = (&pair[0], &pair[1]);
        if next.epoch != previous.epoch + 1 {
            return Err(format!("the approver set of epoch {} follows epoch {}", next.epoch, previous.epoch));
        }
        let message = approver_set_message(
            &release.trust_domain,
            next.epoch,
            next.quorum,
            next.keys.iter().map(|k| (k.kid.as_str(), k.public_key.as_str())),
        );
        let valid = valid_signers(&previous.keys, &message, &next.signatures)?;
        if (valid as u64) < previous.quorum {
            return Err(format!(
                "the approver set of epoch {} has {valid} valid signatures of epoch {}'s keys; its quorum is {}",
                next.epoch, previous.epoch, previous.quorum
            ));
        }
    }
    let set = release.sets.last().expect("one set at least");
    if release.approvals.len() > RELEASE_KEYS_MAX {
        return Err(format!("the release carries over {RELEASE_KEYS_MAX} approvals"));
    }
    let message = approval_message(&release.trust_domain, &release.batch_id, &release.root, release.size, release.expires_at_ms);
    let valid = valid_signers(&set.keys, &message, &release.approvals)?;
    if (valid as u64) < set.quorum {
        return Err(format!(
            "batch {} has {valid} valid approval(s) of the approver set of epoch {}; its quorum is {}",
            crate::id::truncate(&release.batch_id, 40),
            set.epoch,
            set.quorum
        ));
    }
    let leaf = leaf_bytes(node_id, kind, args).map_err(|e| format!("the command's leaf does not encode: {e}"))?;
    let proof = release
        .proof
        .iter()
        .map(hex::decode)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| "the inclusion proof is not hex".to_owned())?;
    let root = hex::decode(&release.root).map_err(|_| "the root is not hex".to_owned())?;
    merkle::verify_inclusion(release.index, release.size, &merkle::leaf_hash(&leaf), &proof, &root)
        .map_err(|e| format!("this command is not leaf {} of the approved scope: {e:?}", release.index))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-pass proofs are RFC 6962's: each equals `merkle::inclusion_proof` and verifies,
    /// for every leaf of trees of 1 to 70 leaves.
    #[test]
    fn one_pass_proofs_are_rfc_6962s() {
        for n in 1..=70u64 {
            let leaves: Vec<Hash> = (0..n).map(|i| merkle::leaf_hash(&i.to_be_bytes())).collect();
            let root = merkle::root(&leaves);
            let proofs = inclusion_proofs(&leaves);
            for (i, proof) in proofs.iter().enumerate() {
                assert_eq!(Some(proof.clone()), merkle::inclusion_proof(i as u64, &leaves), "n {n} leaf {i}");
                let proof: Vec<Vec<u8>> = proof.iter().map(|h| h.to_vec()).collect();
                merkle::verify_inclusion(i as u64, n, &leaves[i], &proof, &root).unwrap();
            }
        }
    }

    #[test]
    fn command_roots_parse_as_the_reference_says() {
        let a = "a".repeat(64);
        let b = "0123456789abcdef".repeat(4);
        assert_eq!(parse_command_roots(&a).unwrap(), vec![a.clone()]);
        assert_eq!(parse_command_roots(&format!("{a}, {b}")).unwrap(), vec![a.clone(), b]);
        for bad in ["", "A".repeat(64).as_str(), &"a".repeat(63), &format!("{a},"), &[a.as_str(); 9].join(",")] {
            assert_eq!(
                parse_command_roots(bad).unwrap_err(),
                "command_root_sha256 must be 64 lowercase hex digits per root, comma-separated"
            );
        }
    }
}
