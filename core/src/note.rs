//! C2SP formats, pure: signed notes (Ed25519), verifier keys (`vkey`), `tlog-checkpoint`
//! bodies, and `tlog-proof@v1` files.
//!
//! - signed note: the text (lines ending in `\n`), a blank line, then signature lines
//!   `— NAME base64(key_id[4] ‖ signature[64])`, the signature over the text;
//!   key id = SHA-256(NAME ‖ 0x0A ‖ 0x01 ‖ public key)[..4];
//! - vkey: `NAME+hex(key id)+base64(0x01 ‖ public key)`;
//! - checkpoint body: `ORIGIN\nSIZE\nbase64(root)\n`, with origin `DEPLOYMENT/audit/TENANT`;
//! - proof file: `c2sp.org/tlog-proof@v1`, `extra …`, `index N`, the path hashes, a blank line,
//!   the signed checkpoint verbatim. The `extra` line carries the event (its canonical bytes)
//!   and the log's vkey as a deterministic CBOR map, so the auditor sees what was proved.

use base64::Engine;
use ed25519_dalek::{Signature, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::keys::LogKey;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;
/// `— ` (U+2014 and a space) starts every signature line.
const SIGNATURE_PREFIX: &str = "\u{2014} ";
const ALGORITHM_ED25519: u8 = 0x01;
/// Largest note or proof file accepted, in bytes.
pub const NOTE_BYTES_MAX: usize = 64 * 1024;
/// Signature lines read from one note at most (the reference implementation's cap).
pub const NOTE_SIGNATURES_MAX: usize = 100;
pub const PROOF_HEADER: &str = "c2sp.org/tlog-proof@v1";
pub const CONSISTENCY_HEADER: &str = "better-compute/consistency-proof@v1";

pub fn note_key_id(name: &str, public: &VerifyingKey) -> [u8; 4] {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update([b'\n', ALGORITHM_ED25519]);
    h.update(public.as_bytes());
    let digest = h.finalize();
    [digest[0], digest[1], digest[2], digest[3]]
}

fn valid_key_name(name: &str) -> bool {
    !name.is_empty() && !name.contains('+') && name.chars().all(|c| !c.is_whitespace() && !c.is_control())
}

/// A verifier key: a name and an Ed25519 public key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vkey {
    pub name: String,
    pub public: VerifyingKey,
}

impl Vkey {
    pub fn new(name: &str, public: VerifyingKey) -> Result<Self, String> {
        if !valid_key_name(name) {
            return Err(format!("invalid key name {name:?}"));
        }
        Ok(Self { name: name.to_owned(), public })
    }

    pub fn key_id(&self) -> [u8; 4] {
        note_key_id(&self.name, &self.public)
    }

    pub fn encode(&self) -> String {
        let mut key = vec![ALGORITHM_ED25519];
        key.extend_from_slice(self.public.as_bytes());
        format!("{}+{}+{}", self.name, hex::encode(self.key_id()), B64.encode(key))
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        // Names never contain '+'; base64 may.
        let mut parts = text.trim().splitn(3, '+');
        let (Some(name), Some(id), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("a vkey is NAME+KEYID+KEY".into());
        };
        let key = B64.decode(key).map_err(|_| "vkey key is not base64".to_owned())?;
        if key.len() != 33 || key[0] != ALGORITHM_ED25519 {
            return Err("vkey is not an Ed25519 key".into());
        }
        let public = VerifyingKey::from_bytes(key[1..].try_into().expect("32 bytes"))
            .map_err(|_| "vkey key is not a valid Ed25519 point".to_owned())?;
        let vkey = Vkey::new(name, public)?;
        if hex::encode(vkey.key_id()) != id {
            return Err("vkey key id does not match its key".into());
        }
        Ok(vkey)
    }

    /// The `sha256/…` pin of the public key.
    pub fn pin(&self) -> String {
        crate::keys::pin_of(&self.public)
    }
}

/// Signs `text` (which must end in `\n`) as a note with one signature.
pub fn sign_note(text: &str, name: &str, key: &LogKey) -> Result<String, String> {
    if !text.ends_with('\n') || text.contains("\n\n") || text.len() > NOTE_BYTES_MAX {
        return Err("note text must be non-empty lines, each ending in a newline".into());
    }
    let vkey = Vkey::new(name, key.public())?;
    let sig = key.sign_raw(text.as_bytes());
    let mut blob = vkey.key_id().to_vec();
    blob.extend_from_slice(&sig);
    Ok(format!("{text}\n{SIGNATURE_PREFIX}{name} {}\n", B64.encode(blob)))
}

/// Splits a note and checks the signature by `vkey`; returns the text. Signatures by other keys
/// are ignored; a failing signature by `vkey` rejects the note.
pub fn open_note(note: &str, vkey: &Vkey) -> Result<String, String> {
    if note.len() > NOTE_BYTES_MAX {
        return Err("note too large".into());
    }
    let at = note.rfind("\n\n").ok_or("not a signed note: no blank line before the signatures")?;
    let (text, signatures) = (&note[..at + 1], &note[at + 2..]);
    if !signatures.ends_with('\n') {
        return Err("signature block does not end in a newline".into());
    }
    let mut verified = false;
    for (n, line) in signatures.lines().enumerate() {
        if n >= NOTE_SIGNATURES_MAX {
            return Err("too many signatures".into());
        }
        let rest = line.strip_prefix(SIGNATURE_PREFIX).ok_or("malformed signature line")?;
        let (name, blob) = rest.split_once(' ').ok_or("malformed signature line")?;
        let blob = B64.decode(blob).map_err(|_| "signature is not base64".to_owned())?;
        if blob.len() < 4 {
            return Err("signature too short".into());
        }
        if name != vkey.name || blob[..4] != vkey.key_id() {
            continue;
        }
        let sig = Signature::from_slice(&blob[4..]).map_err(|_| "signature is not 64 bytes".to_owned())?;
        vkey.public.verify_strict(text.as_bytes(), &sig).map_err(|_| format!("signature by {name} does not verify"))?;
        verified = true;
    }
    if verified { Ok(text.to_owned()) } else { Err(format!("no signature by the trusted key {}", vkey.name)) }
}

/// A checkpoint's body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointBody {
    pub origin: String,
    pub size: u64,
    pub root: [u8; 32],
}

impl CheckpointBody {
    pub fn encode(&self) -> String {
        format!("{}\n{}\n{}\n", self.origin, self.size, B64.encode(self.root))
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let mut lines = text.split('\n');
        let origin = lines.next().filter(|o| !o.is_empty()).ok_or("checkpoint has no origin")?;
        let size = lines.next().ok_or("checkpoint has no size")?;
        if size.is_empty() || (size.len() > 1 && size.starts_with('0')) || !size.bytes().all(|b| b.is_ascii_digit()) {
            return Err("checkpoint size is not a decimal number".into());
        }
        let size = size.parse().map_err(|_| "checkpoint size out of range".to_owned())?;
        let root =
            B64.decode(lines.next().ok_or("checkpoint has no root")?).map_err(|_| "checkpoint root is not base64".to_owned())?;
        let root = <[u8; 32]>::try_from(root).map_err(|_| "checkpoint root is not 32 bytes".to_owned())?;
        Ok(Self { origin: origin.to_owned(), size, root })
    }
}

/// The origin of a tenant's tree.
pub fn origin_of(deployment: &str, tenant: &crate::id::TenantId) -> String {
    format!("{deployment}/audit/{tenant}")
}

/// A key rotation, proved: the `log_key.rotated` event (signed by the old key), and its
/// inclusion in a root-tenant checkpoint the old key signed. A checker that trusts the old key
/// comes to trust the new one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RotationProof {
    pub event: Vec<u8>,
    pub sig: Vec<u8>,
    /// The old key's vkey (trusted only if it matches a pin or a key already trusted).
    pub vkey: String,
    pub index: u64,
    pub path: Vec<[u8; 32]>,
    pub checkpoint: String,
}

impl RotationProof {
    fn to_cbor(&self) -> ciborium::Value {
        use ciborium::Value as V;
        V::Map(vec![
            (V::Text("event".into()), V::Bytes(self.event.clone())),
            (V::Text("sig".into()), V::Bytes(self.sig.clone())),
            (V::Text("vkey".into()), V::Text(self.vkey.clone())),
            (V::Text("index".into()), V::Integer(self.index.into())),
            (V::Text("path".into()), V::Array(self.path.iter().map(|h| V::Bytes(h.to_vec())).collect())),
            (V::Text("checkpoint".into()), V::Text(self.checkpoint.clone())),
        ])
    }

    fn from_cbor(value: ciborium::Value) -> Result<Self, String> {
        use ciborium::Value as V;
        let V::Map(entries) = value else { return Err("a rotation is not a map".into()) };
        let (mut event, mut sig, mut vkey, mut index, mut path, mut checkpoint) = (None, None, None, None, None, None);
        for (k, v) in entries {
            match (k, v) {
                (V::Text(k), V::Bytes(b)) if k == "event" => event = Some(b),
                (V::Text(k), V::Bytes(b)) if k == "sig" => sig = Some(b),
                (V::Text(k), V::Text(t)) if k == "vkey" => vkey = Some(t),
                (V::Text(k), V::Integer(i)) if k == "index" => index = u64::try_from(i).ok(),
                (V::Text(k), V::Array(a)) if k == "path" && a.len() <= crate::merkle::PROOF_HASHES_MAX => {
                    let mut p = Vec::new();
                    for h in a {
                        let V::Bytes(b) = h else { return Err("a rotation path hash is not bytes".into()) };
                        p.push(<[u8; 32]>::try_from(b).map_err(|_| "a rotation path hash is not 32 bytes".to_owned())?);
                    }
                    path = Some(p);
                }
                (V::Text(k), V::Text(t)) if k == "checkpoint" => checkpoint = Some(t),
                _ => return Err("a rotation has an unknown field".into()),
            }
        }
        Ok(Self {
            event: event.ok_or("a rotation has no event")?,
            sig: sig.ok_or("a rotation has no sig")?,
            vkey: vkey.ok_or("a rotation has no vkey")?,
            index: index.ok_or("a rotation has no index")?,
            path: path.ok_or("a rotation has no path")?,
            checkpoint: checkpoint.ok_or("a rotation has no checkpoint")?,
        })
    }
}

/// Rotations one proof carries at most.
pub const ROTATIONS_MAX: usize = 64;

/// Bytes of [`encode_rotations`] read at most: a rotation is an event, a signature, a vkey, at
/// most `PROOF_HASHES_MAX` hashes (2 KiB) and a checkpoint, well under 8 KiB.
pub const ROTATIONS_BYTES_MAX: usize = ROTATIONS_MAX * 8 * 1024;

/// The rotations as `GET /audit/{tenant}/rotations` serves them: a deterministic CBOR array of
/// the maps a proof file's `rotations` holds, oldest first.
pub fn encode_rotations(rotations: &[RotationProof]) -> Vec<u8> {
    let value = ciborium::Value::Array(rotations.iter().map(RotationProof::to_cbor).collect());
    crate::canonical::encode(value).expect("an array of maps of bytes and text encodes")
}

/// Parses [`encode_rotations`]' bytes; at most `ROTATIONS_MAX` rotations.
pub fn parse_rotations(bytes: &[u8]) -> Result<Vec<RotationProof>, String> {
    if bytes.len() > ROTATIONS_BYTES_MAX {
        return Err("the rotations are too large".into());
    }
    match crate::canonical::decode_canonical(bytes).map_err(|e| format!("the rotations: {e}"))? {
        ciborium::Value::Array(a) if a.len() <= ROTATIONS_MAX => a.into_iter().map(RotationProof::from_cbor).collect(),
        ciborium::Value::Array(_) => Err(format!("more than {ROTATIONS_MAX} rotations")),
        _ => Err("the rotations are not an array".into()),
    }
}

/// An inclusion proof file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProofFile {
    /// The event's canonical bytes.
    pub event: Vec<u8>,
    /// The log's vkey, for a verifier that holds only the pin.
    pub vkey: String,
    pub index: u64,
    pub path: Vec<[u8; 32]>,
    /// The signed checkpoint, verbatim.
    pub checkpoint: String,
    /// The log's key rotations, oldest first (in `extra` only when there are any).
    pub rotations: Vec<RotationProof>,
}

impl ProofFile {
    pub fn encode(&self) -> String {
        let mut fields = vec![
            (ciborium::Value::Text("event".into()), ciborium::Value::Bytes(self.event.clone())),
            (ciborium::Value::Text("vkey".into()), ciborium::Value::Text(self.vkey.clone())),
        ];
        if !self.rotations.is_empty() {
            fields.push((
                ciborium::Value::Text("rotations".into()),
                ciborium::Value::Array(self.rotations.iter().map(RotationProof::to_cbor).collect()),
            ));
        }
        let extra = ciborium::Value::Map(fields);
        let extra = crate::canonical::encode(extra).expect("a map of bytes and text encodes");
        let mut out = format!("{PROOF_HEADER}\nextra {}\nindex {}\n", B64.encode(extra), self.index);
        for h in &self.path {
            out.push_str(&B64.encode(h));
            out.push('\n');
        }
        out.push('\n');
        out.push_str(&self.checkpoint);
        out
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        if text.len() > NOTE_BYTES_MAX * 2 {
            return Err("proof file too large".into());
        }
        let (head, checkpoint) = text.split_once("\n\n").ok_or("no blank line before the checkpoint")?;
        let mut lines = head.split('\n');
        if lines.next() != Some(PROOF_HEADER) {
            return Err(format!("not a {PROOF_HEADER} file"));
        }
        let mut line = lines.next().ok_or("truncated proof")?;
        let mut extra = None;
        if let Some(e) = line.strip_prefix("extra ") {
            extra = Some(B64.decode(e).map_err(|_| "extra is not base64".to_owned())?);
            line = lines.next().ok_or("truncated proof")?;
        }
        let index = line.strip_prefix("index ").ok_or("no index line")?;
        if index.is_empty() || (index.len() > 1 && index.starts_with('0')) || !index.bytes().all(|b| b.is_ascii_digit()) {
            return Err("index is not a decimal number".into());
        }
        let index = index.parse().map_err(|_| "index out of range".to_owned())?;
        let mut path = Vec::new();
        for l in lines {
            let h = B64.decode(l).map_err(|_| "a path hash is not base64".to_owned())?;
            path.push(<[u8; 32]>::try_from(h).map_err(|_| "a path hash is not 32 bytes".to_owned())?);
            if path.len() > crate::merkle::PROOF_HASHES_MAX {
                return Err("too many path hashes".into());
            }
        }
        let extra = extra.ok_or("no extra line: this proof does not carry its event")?;
        let value = crate::canonical::decode_canonical(&extra).map_err(|e| format!("extra: {e}"))?;
        let (mut event, mut vkey, mut rotations) = (None, None, Vec::new());
        if let ciborium::Value::Map(entries) = value {
            for (k, v) in entries {
                match (k, v) {
                    (ciborium::Value::Text(k), ciborium::Value::Bytes(b)) if k == "event" => event = Some(b),
                    (ciborium::Value::Text(k), ciborium::Value::Text(t)) if k == "vkey" => vkey = Some(t),
                    (ciborium::Value::Text(k), ciborium::Value::Array(a)) if k == "rotations" && a.len() <= ROTATIONS_MAX => {
                        rotations = a.into_iter().map(RotationProof::from_cbor).collect::<Result<_, _>>()?;
                    }
                    _ => return Err("extra has an unknown field".into()),
                }
            }
        }
        Ok(Self {
            event: event.ok_or("extra has no event")?,
            vkey: vkey.ok_or("extra has no vkey")?,
            index,
            path,
            checkpoint: checkpoint.to_owned(),
            rotations,
        })
    }
}

/// A consistency proof from an older checkpoint (which the auditor saved) to the newer one in
/// the proof file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsistencyFile {
    pub path: Vec<[u8; 32]>,
    /// The older signed checkpoint, verbatim.
    pub old_checkpoint: String,
}

impl ConsistencyFile {
    pub fn encode(&self) -> String {
        let mut out = format!("{CONSISTENCY_HEADER}\n");
        for h in &self.path {
            out.push_str(&B64.encode(h));
            out.push('\n');
        }
        out.push('\n');
        out.push_str(&self.old_checkpoint);
        out
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let (head, old_checkpoint) = text.split_once("\n\n").ok_or("no blank line before the checkpoint")?;
        let mut lines = head.split('\n');
        if lines.next() != Some(CONSISTENCY_HEADER) {
            return Err(format!("not a {CONSISTENCY_HEADER} file"));
        }
        let mut path = Vec::new();
        for l in lines {
            let h = B64.decode(l).map_err(|_| "a path hash is not base64".to_owned())?;
            path.push(<[u8; 32]>::try_from(h).map_err(|_| "a path hash is not 32 bytes".to_owned())?);
        }
        Ok(Self { path, old_checkpoint: old_checkpoint.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotations_round_trip_and_are_bounded() {
        let r = RotationProof {
            event: vec![0xa0],
            sig: vec![1; 64],
            vkey: "better-compute+1a2b3c4d+AQ".into(),
            index: 3,
            path: vec![[2; 32], [3; 32]],
            checkpoint: "better-compute/audit/x\n4\nAA==\n\n— sig\n".into(),
        };
        let bytes = encode_rotations(std::slice::from_ref(&r));
        assert_eq!(parse_rotations(&bytes).unwrap(), vec![r.clone()]);
        assert_eq!(parse_rotations(&encode_rotations(&[])).unwrap(), vec![]);
        assert!(parse_rotations(&encode_rotations(&vec![r; ROTATIONS_MAX + 1])).is_err());
        assert!(parse_rotations(&bytes[..bytes.len() - 1]).is_err());
        assert!(parse_rotations(b"").is_err());
    }

    #[test]
    fn notes_round_trip_and_reject_tampering() {
        let key = LogKey::from_seed([3; 32]);
        let body = CheckpointBody { origin: "example/audit/ten_x".into(), size: 7, root: [9; 32] };
        let note = sign_note(&body.encode(), "example", &key).unwrap();
        let vkey = Vkey::new("example", key.public()).unwrap();
        assert_eq!(Vkey::parse(&vkey.encode()).unwrap(), vkey);
        let text = open_note(&note, &vkey).unwrap();
        assert_eq!(CheckpointBody::parse(&text).unwrap(), body);
        assert!(open_note(&note.replace("\n7\n", "\n8\n"), &vkey).is_err());
        let other = Vkey::new("example", LogKey::from_seed([4; 32]).public()).unwrap();
        assert!(open_note(&note, &other).is_err(), "a note not signed by the trusted key");
        assert!(Vkey::parse(&vkey.encode().replace('+', "-")).is_err());
    }

    /// Regression: base64 keys contain '+', which once split a vkey in the wrong place.
    #[test]
    fn vkeys_round_trip_whatever_their_base64() {
        let mut saw_plus = false;
        for seed in 0..64u8 {
            let vkey = Vkey::new("example.com/log", LogKey::from_seed([seed; 32]).public()).unwrap();
            let text = vkey.encode();
            saw_plus |= text.splitn(3, '+').nth(2).is_some_and(|key| key.contains('+'));
            assert_eq!(Vkey::parse(&text).unwrap(), vkey, "{text}");
        }
        assert!(saw_plus, "no key exercised the '+' case");
    }

    /// The C2SP signed-note example key and note (from the Go reference's tests).
    #[test]
    fn reference_vkey_and_note() {
        let vkey = Vkey::parse("PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW").unwrap();
        let note = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n\n\u{2014} PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n";
        let text = open_note(note, &vkey).unwrap();
        assert!(text.starts_with("If you think"));
    }
}
