//! Witnesses, pure: the C2SP `tlog-witness` request and answers, and the cosignatures a
//! checkpoint carries (C2SP `tlog-cosignature`).
//!
//! - request body of `POST /add-checkpoint`: `old N\n`, the RFC 6962 consistency proof from
//!   size `N` (base64, one hash a line), a blank line, then the signed checkpoint verbatim;
//! - `409 Conflict` carries the size the witness has (`text/x.tlog.size`): resend from it;
//! - `200` carries the witness's cosignature line(s), which are appended to the note.
//!
//! Two kinds of witness key are accepted: a `cosignature/v1` key (vkey type `0x04`; the
//! signature blob is key id ‖ timestamp (u64 big-endian) ‖ Ed25519 signature over
//! `cosignature/v1\ntime T\n` ‖ the checkpoint body), as the spec defines, and a plain Ed25519
//! note key (type `0x01`, a signature over the body), which is what `siglog`'s witness 0.1.0
//! returns.

use base64::Engine;
use ed25519_dalek::{Signature, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::merkle::Hash;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;
const SIGNATURE_PREFIX: &str = "\u{2014} ";
const ALGORITHM_ED25519: u8 = 0x01;
const ALGORITHM_COSIGNATURE_V1: u8 = 0x04;
/// Witnesses one deployment names at most.
pub const WITNESSES_MAX: usize = 16;

/// A witness's verifier key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WitnessKey {
    pub name: String,
    pub algorithm: u8,
    pub public: VerifyingKey,
    pub key_id: [u8; 4],
}

impl WitnessKey {
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut parts = text.trim().splitn(3, '+');
        let (Some(name), Some(id), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
            return Err("a witness vkey is NAME+KEYID+KEY".into());
        };
        let key = B64.decode(key).map_err(|_| "witness vkey key is not base64".to_owned())?;
        if key.len() != 33 || !matches!(key[0], ALGORITHM_ED25519 | ALGORITHM_COSIGNATURE_V1) {
            return Err("a witness vkey is an Ed25519 (0x01) or cosignature/v1 (0x04) key".into());
        }
        let public = VerifyingKey::from_bytes(key[1..].try_into().expect("32 bytes"))
            .map_err(|_| "witness key is not a valid Ed25519 point".to_owned())?;
        let mut h = Sha256::new();
        h.update(name.as_bytes());
        h.update([b'\n', key[0]]);
        h.update(public.as_bytes());
        let digest = h.finalize();
        let key_id = [digest[0], digest[1], digest[2], digest[3]];
        if hex::encode(key_id) != id {
            return Err("witness vkey key id does not match its key".into());
        }
        Ok(Self { name: name.to_owned(), algorithm: key[0], public, key_id })
    }

    /// Whether one of `note`'s signature lines is this witness's valid cosignature of its body.
    pub fn cosigned(&self, note: &str) -> bool {
        let Some(at) = note.rfind("\n\n") else { return false };
        let (body, signatures) = (&note[..at + 1], &note[at + 2..]);
        signatures.lines().any(|line| {
            let Some((name, blob)) = line.strip_prefix(SIGNATURE_PREFIX).and_then(|r| r.split_once(' ')) else {
                return false;
            };
            let Ok(blob) = B64.decode(blob) else { return false };
            if name != self.name || blob.len() < 4 || blob[..4] != self.key_id {
                return false;
            }
            match self.algorithm {
                ALGORITHM_COSIGNATURE_V1 if blob.len() == 4 + 8 + 64 => {
                    let time = u64::from_be_bytes(blob[4..12].try_into().expect("8 bytes"));
                    let message = format!("cosignature/v1\ntime {time}\n{body}");
                    Signature::from_slice(&blob[12..]).is_ok_and(|s| self.public.verify_strict(message.as_bytes(), &s).is_ok())
                }
                ALGORITHM_ED25519 if blob.len() == 4 + 64 => {
                    Signature::from_slice(&blob[4..]).is_ok_and(|s| self.public.verify_strict(body.as_bytes(), &s).is_ok())
                }
                _ => false,
            }
        })
    }
}

/// How many of `keys` (distinct witnesses) cosigned `note`.
pub fn cosigners(note: &str, keys: &[WitnessKey]) -> usize {
    keys.iter().filter(|k| k.cosigned(note)).count()
}

/// The body of `POST /add-checkpoint`.
pub fn add_checkpoint_body(old_size: u64, proof: &[Hash], checkpoint: &str) -> String {
    let mut out = format!("old {old_size}\n");
    for h in proof {
        out.push_str(&B64.encode(h));
        out.push('\n');
    }
    out.push('\n');
    out.push_str(checkpoint);
    out
}

/// The size a `409 Conflict` names.
pub fn parse_conflict(body: &str) -> Option<u64> {
    let line = body.lines().next()?.trim();
    (!line.is_empty() && line.bytes().all(|b| b.is_ascii_digit())).then(|| line.parse().ok()).flatten()
}

/// Appends the signature lines of a `200` answer to `note`, skipping any already there and any
/// line that is not a signature line.
pub fn add_cosignatures(note: &str, answer: &str) -> String {
    let mut out = note.to_owned();
    for line in answer.lines().filter(|l| l.starts_with(SIGNATURE_PREFIX)) {
        if !note.lines().any(|l| l == line) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};

    fn vkey(name: &str, alg: u8, key: &SigningKey) -> String {
        let public = key.verifying_key();
        let mut h = Sha256::new();
        h.update(name.as_bytes());
        h.update([b'\n', alg]);
        h.update(public.as_bytes());
        let id = &h.finalize()[..4];
        let mut k = vec![alg];
        k.extend_from_slice(public.as_bytes());
        format!("{name}+{}+{}", hex::encode(id), B64.encode(k))
    }

    #[test]
    fn cosignatures_of_both_kinds_verify_and_tampering_does_not() {
        let log = crate::keys::LogKey::from_seed([1; 32]);
        let note =
            crate::note::sign_note("example/audit/ten_x\n5\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n", "example", &log)
                .unwrap();
        let body = &note[..note.rfind("\n\n").unwrap() + 1];
        let w1 = SigningKey::from_bytes(&[2; 32]);
        let w2 = SigningKey::from_bytes(&[3; 32]);
        let k1 = WitnessKey::parse(&vkey("w1.example", 0x04, &w1)).unwrap();
        let k2 = WitnessKey::parse(&vkey("w2.example", 0x01, &w2)).unwrap();
        let time = 1_790_000_000u64;
        let mut blob = k1.key_id.to_vec();
        blob.extend_from_slice(&time.to_be_bytes());
        blob.extend_from_slice(&w1.sign(format!("cosignature/v1\ntime {time}\n{body}").as_bytes()).to_bytes());
        let line1 = format!("\u{2014} w1.example {}\n", B64.encode(blob));
        let mut blob = k2.key_id.to_vec();
        blob.extend_from_slice(&w2.sign(body.as_bytes()).to_bytes());
        let line2 = format!("\u{2014} w2.example {}\n", B64.encode(blob));
        let cosigned = add_cosignatures(&add_cosignatures(&note, &line1), &format!("{line2}{line1}"));
        assert_eq!(cosigned.matches('\u{2014}').count(), 3, "no duplicates: {cosigned}");
        assert_eq!(cosigners(&cosigned, &[k1.clone(), k2.clone()]), 2);
        assert_eq!(cosigners(&note, &[k1.clone(), k2.clone()]), 0);
        assert_eq!(cosigners(&cosigned.replace("\n5\n", "\n6\n"), &[k1, k2]), 0);
        assert_eq!(parse_conflict("17\n"), Some(17));
        assert_eq!(add_checkpoint_body(0, &[], "x\n"), "old 0\n\nx\n");
    }
}
