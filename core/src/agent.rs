//! What the node agent and the gateway must agree on byte for byte: the node's identity document
//! and the signatures over it, the session proof, and the journal entry (its canonical body, hash
//! and node signature). Wire framing lives in `bc-proto`; this module is the meaning, so that the
//! agent, the gateway and `audit verify` check the same bytes the same way.
//!
//! A journal entry's body is deterministic CBOR (RFC 8949 §4.2, as the log's envelope) of the map
//! `{v, node, seq, prev, atMs, type, subject, payload}`; its hash is SHA-256 over the body; the
//! node signs `JOURNAL_SIGNATURE_CONTEXT ‖ hash`. `prev` is the previous entry's hash (32 zero
//! bytes for seq 1), so the journal is a chain of its own, checked by the gateway before it
//! appends an entry and by `audit verify` afterwards.

use base64::Engine;
use ciborium::Value;
use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::canonical;
use crate::error::{Error, Result};
use crate::event::sha256;
use crate::id::NodeId;

pub const IDENTITY_SIGNATURE_CONTEXT: &[u8] = b"better-compute/node-identity/v1\n";
pub const SESSION_PROOF_CONTEXT: &[u8] = b"better-compute/session/v1\n";
pub const JOURNAL_SIGNATURE_CONTEXT: &[u8] = b"better-compute/journal/v1\n";
/// The body format's version, `v` in the map.
pub const JOURNAL_FORMAT_VERSION: u64 = 1;
/// The `prev` of the first entry.
pub const GENESIS_HASH: [u8; 32] = [0; 32];
/// The payload key under which a log event carries the journal entry it came from.
pub const JOURNAL_PAYLOAD_KEY: &str = "journal";
/// The longest entry type and subject.
pub const ENTRY_TYPE_BYTES_MAX: usize = 64;
pub const ENTRY_SUBJECT_BYTES_MAX: usize = 128;

/// Who a joined node is, as the control plane signed it at join time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeIdentity {
    pub node_id: String,
    pub tenant_id: String,
    pub pool_id: String,
    pub name: String,
    /// Standard base64 of the node's Ed25519 public key.
    pub node_public_key: String,
    /// The log key that signed this document.
    pub log_key_id: String,
    pub joined_at_ms: u64,
    /// The `node.joined` event.
    pub event_id: String,
}

pub fn identity_signing_message(identity: &[u8]) -> Vec<u8> {
    [IDENTITY_SIGNATURE_CONTEXT, identity].concat()
}

pub fn session_proof_message(node: &str, nonce: &[u8]) -> Vec<u8> {
    [SESSION_PROOF_CONTEXT, node.as_bytes(), b"\n", nonce].concat()
}

pub fn journal_signing_message(hash: &[u8; 32]) -> Vec<u8> {
    [JOURNAL_SIGNATURE_CONTEXT, hash.as_slice()].concat()
}

pub fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn unb64(text: &str) -> Result<Vec<u8>, String> {
    base64::engine::general_purpose::STANDARD.decode(text).map_err(|e| format!("not base64: {e}"))
}

/// The capability an agent says for the hypervisor it runs instances on: `hypervisor.libvirt`,
/// `hypervisor.fake` (a fake machine's in-memory one).
pub const CAPABILITY_HYPERVISOR_PREFIX: &str = "hypervisor.";
/// The capability an agent says for a sandbox runtime: `sandbox.gvisor`.
pub const CAPABILITY_SANDBOX_PREFIX: &str = "sandbox.";

/// What kind of driver a capability names (`drivers.list`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DriverKind {
    /// Runs instances (`hypervisor.<name>`).
    Hypervisor,
    /// Runs sandboxes (`sandbox.<name>`).
    SandboxRuntime,
    /// Speaks to machines' baseboard management controllers (the control plane's, not an agent's).
    Bmc,
}

impl DriverKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Hypervisor => "hypervisor",
            Self::SandboxRuntime => "sandbox-runtime",
            Self::Bmc => "bmc",
        }
    }
}

/// The driver a capability advertises, if it names one: `hypervisor.libvirt` is the hypervisor
/// `libvirt`, `sandbox.gvisor` the sandbox runtime `gvisor`; any other capability (`gpu.hold`,
/// `tunnel.node-console`) names none.
pub fn driver_of_capability(capability: &str) -> Option<(DriverKind, &str)> {
    let named = |name: &str| !name.is_empty() && !name.contains('.');
    if let Some(name) = capability.strip_prefix(CAPABILITY_HYPERVISOR_PREFIX).filter(|n| named(n)) {
        return Some((DriverKind::Hypervisor, name));
    }
    capability.strip_prefix(CAPABILITY_SANDBOX_PREFIX).filter(|n| named(n)).map(|name| (DriverKind::SandboxRuntime, name))
}

/// A join token is `bcjt_` + its id (`jt_…`) + `_` + 43 characters of base64url secret.
pub const JOIN_TOKEN_PREFIX: &str = "bcjt_";
/// Random bytes in a join token's secret.
pub const JOIN_TOKEN_SECRET_BYTES: usize = 32;
/// The longest a join token may be when read (from standard input or a file).
pub const JOIN_TOKEN_BYTES_MAX: usize = 4096;

/// A new join token for `id` and the hex SHA-256 of its secret, which is all that is stored.
/// The secret is from the OS's randomness, never a seed.
#[allow(clippy::disallowed_methods)]
pub fn join_token_new(id: crate::id::JoinTokenId) -> (String, String) {
    let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rand::random::<[u8; JOIN_TOKEN_SECRET_BYTES]>());
    let hash = hex::encode(sha256(secret.as_bytes()));
    (format!("{JOIN_TOKEN_PREFIX}{id}_{secret}"), hash)
}

/// The token's id and the hex SHA-256 of its secret, or why it is not a join token (never
/// quoting it).
pub fn join_token_parse(token: &str) -> Result<(crate::id::JoinTokenId, String), String> {
    let rest = token.strip_prefix(JOIN_TOKEN_PREFIX).ok_or("a join token starts with bcjt_")?;
    // The id has a fixed length (`jt_` and 26 characters); the secret may itself hold `_`.
    let id_chars = crate::id::JoinTokenId::PREFIX.len() + 1 + 26;
    let (id, secret) = match (rest.get(..id_chars), rest.get(id_chars..)) {
        (Some(id), Some(tail)) if tail.starts_with('_') => (id, &tail[1..]),
        _ => return Err("a join token is bcjt_<id>_<secret>".into()),
    };
    let id: crate::id::JoinTokenId = id.parse().map_err(|_| "a join token's id is jt_ and a ULID".to_owned())?;
    let decoded = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(secret)
        .map_err(|_| "a join token's secret is base64url".to_owned())?;
    if decoded.len() != JOIN_TOKEN_SECRET_BYTES {
        return Err(format!("a join token's secret is {JOIN_TOKEN_SECRET_BYTES} bytes"));
    }
    Ok((id, hex::encode(sha256(secret.as_bytes()))))
}

/// Whether `text` looks like a join token's secret (so it is never sent, logged or echoed as
/// an id).
pub fn looks_like_join_token(text: &str) -> bool {
    text.starts_with(JOIN_TOKEN_PREFIX)
        || text.len() > 40 && text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A node's public key from its 32 bytes.
pub fn node_public_key(bytes: &[u8]) -> Result<VerifyingKey, String> {
    let bytes: [u8; 32] = bytes.try_into().map_err(|_| format!("a node key is 32 bytes, not {}", bytes.len()))?;
    VerifyingKey::from_bytes(&bytes).map_err(|e| format!("not an Ed25519 public key: {e}"))
}

/// What one journal entry says, before it is encoded.
#[derive(Clone, Debug, PartialEq)]
pub struct EntryBody {
    pub node: NodeId,
    pub seq: u64,
    pub prev: [u8; 32],
    pub at_ms: u64,
    /// `command.started`, `command.succeeded`, `command.failed`, …
    pub entry_type: String,
    /// The stream the entry is about (`command/cmd_…`).
    pub subject: String,
    /// A JSON object.
    pub payload: serde_json::Value,
}

impl EntryBody {
    /// The canonical bytes the hash and the signature cover.
    pub fn encode(&self) -> Result<Vec<u8>> {
        if self.seq == 0 {
            return Err(Error::invalid("journal entries are numbered from 1"));
        }
        if !self.payload.is_object() {
            return Err(Error::invalid("a journal entry's payload is an object"));
        }
        check_text("entry type", &self.entry_type, ENTRY_TYPE_BYTES_MAX).map_err(Error::invalid)?;
        check_text("entry subject", &self.subject, ENTRY_SUBJECT_BYTES_MAX).map_err(Error::invalid)?;
        let text = |s: &str| Value::Text(s.to_owned());
        canonical::encode(Value::Map(vec![
            (text("v"), Value::Integer(JOURNAL_FORMAT_VERSION.into())),
            (text("node"), text(&self.node.to_string())),
            (text("seq"), Value::Integer(self.seq.into())),
            (text("prev"), Value::Bytes(self.prev.to_vec())),
            (text("atMs"), Value::Integer(self.at_ms.into())),
            (text("type"), text(&self.entry_type)),
            (text("subject"), text(&self.subject)),
            (text("payload"), canonical::from_json(&self.payload)?),
        ]))
    }

    /// Reads a body back, refusing anything that is not exactly the canonical encoding of a
    /// well-formed entry.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let value = canonical::decode_canonical(bytes)?;
        let Value::Map(mut entries) = value else { return Err("a journal entry is a CBOR map".into()) };
        let mut get = |name: &str| -> Result<Value, String> {
            let at = entries
                .iter()
                .position(|(k, _)| matches!(k, Value::Text(t) if t == name))
                .ok_or_else(|| format!("a journal entry has no {name:?}"))?;
            Ok(entries.remove(at).1)
        };
        let int = |v: Value, name: &str| -> Result<u64, String> {
            match v {
                Value::Integer(i) => u64::try_from(i).map_err(|_| format!("{name} is out of range")),
                _ => Err(format!("{name} is not an integer")),
            }
        };
        let text = |v: Value, name: &str| -> Result<String, String> {
            match v {
                Value::Text(t) => Ok(t),
                _ => Err(format!("{name} is not text")),
            }
        };
        let version = int(get("v")?, "v")?;
        if version != JOURNAL_FORMAT_VERSION {
            return Err(format!("journal format {version} is not known (this build reads {JOURNAL_FORMAT_VERSION})"));
        }
        let node: NodeId = text(get("node")?, "node")?.parse().map_err(|e: Error| e.to_string())?;
        let seq = int(get("seq")?, "seq")?;
        let prev: [u8; 32] = match get("prev")? {
            Value::Bytes(b) => b.try_into().map_err(|_| "prev is not 32 bytes".to_owned())?,
            _ => return Err("prev is not bytes".into()),
        };
        let at_ms = int(get("atMs")?, "atMs")?;
        let entry_type = text(get("type")?, "type")?;
        let subject = text(get("subject")?, "subject")?;
        let payload = canonical::to_json(&get("payload")?);
        if !entries.is_empty() {
            return Err(format!("a journal entry has {} unknown fields", entries.len()));
        }
        if seq == 0 {
            return Err("journal entries are numbered from 1".into());
        }
        if !payload.is_object() {
            return Err("a journal entry's payload is not a map".into());
        }
        check_text("entry type", &entry_type, ENTRY_TYPE_BYTES_MAX)?;
        check_text("entry subject", &subject, ENTRY_SUBJECT_BYTES_MAX)?;
        Ok(Self { node, seq, prev, at_ms, entry_type, subject, payload })
    }
}

fn check_text(what: &str, text: &str, bytes_max: usize) -> Result<(), String> {
    if text.is_empty() || text.len() > bytes_max || text.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(format!("{what} must be 1 to {bytes_max} bytes without spaces or control characters"));
    }
    Ok(())
}

/// One signed entry as it is stored in the journal and sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedEntry {
    pub seq: u64,
    pub body: Vec<u8>,
    pub hash: [u8; 32],
    pub signature: [u8; 64],
}

impl SignedEntry {
    pub fn sign(key: &SigningKey, body: &EntryBody) -> Result<Self> {
        let bytes = body.encode()?;
        let hash = sha256(&bytes);
        let signature = key.sign(&journal_signing_message(&hash)).to_bytes();
        Ok(Self { seq: body.seq, body: bytes, hash, signature })
    }

    /// Checks the signature and the body, and that the body says what the frame says.
    pub fn verify(seq: u64, body: &[u8], signature: &[u8], key: &VerifyingKey) -> Result<(EntryBody, [u8; 32]), String> {
        Self::verify_remembered(seq, body, signature, key, None)
    }

    /// [`SignedEntry::verify`], skipping the signature's arithmetic when `verified` found it
    /// good before (and remembering it there when good).
    pub fn verify_remembered(
        seq: u64,
        body: &[u8],
        signature: &[u8],
        key: &VerifyingKey,
        verified: Option<&crate::keys::VerifiedSignatures>,
    ) -> Result<(EntryBody, [u8; 32]), String> {
        let hash = sha256(body);
        let signature = Signature::from_slice(signature).map_err(|_| "the signature is not 64 bytes".to_owned())?;
        let message = journal_signing_message(&hash);
        let good = match verified {
            Some(verified) => verified.verify(key, &message, &signature, false),
            None => key.verify(&message, &signature).is_ok(),
        };
        if !good {
            return Err("the node's signature does not verify".to_owned());
        }
        let entry = EntryBody::decode(body)?;
        if entry.seq != seq {
            return Err(format!("the frame says entry {seq} but the body says {}", entry.seq));
        }
        Ok((entry, hash))
    }
}

/// The journal provenance a log event carries under [`JOURNAL_PAYLOAD_KEY`]: the entry's bytes
/// and the node's signature, so `audit verify` can check the node signed what the log holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JournalOrigin {
    pub node_id: String,
    pub seq: u64,
    /// Standard base64 of the canonical body.
    pub body: String,
    /// Standard base64 of the node's signature.
    pub signature: String,
}

impl JournalOrigin {
    pub fn of(entry: &SignedEntry, node: &NodeId) -> Self {
        Self { node_id: node.to_string(), seq: entry.seq, body: b64(&entry.body), signature: b64(&entry.signature) }
    }

    /// Checks the node's signature over the body and that the event says what the entry said:
    /// the event's type and stream are the entry's, and its payload is the entry's payload
    /// with this origin beside it.
    pub fn check(
        &self,
        key: &VerifyingKey,
        event_type: &str,
        stream: &str,
        payload: &serde_json::Value,
    ) -> Result<EntryBody, String> {
        self.check_remembered(key, event_type, stream, payload, None)
    }

    /// [`JournalOrigin::check`] with signatures found good before skipped (see
    /// [`crate::keys::VerifiedSignatures`]).
    pub fn check_remembered(
        &self,
        key: &VerifyingKey,
        event_type: &str,
        stream: &str,
        payload: &serde_json::Value,
        verified: Option<&crate::keys::VerifiedSignatures>,
    ) -> Result<EntryBody, String> {
        let body = unb64(&self.body)?;
        let signature = unb64(&self.signature)?;
        let (entry, _) = SignedEntry::verify_remembered(self.seq, &body, &signature, key, verified)?;
        if entry.node.to_string() != self.node_id {
            return Err(format!("the entry is node {}'s, the event names {}", entry.node, self.node_id));
        }
        if entry.entry_type != event_type || entry.subject != stream {
            return Err(format!(
                "the node journaled {} on {}, the log holds {event_type} on {stream}",
                entry.entry_type, entry.subject
            ));
        }
        let mut rest = payload.as_object().cloned().unwrap_or_default();
        rest.remove(JOURNAL_PAYLOAD_KEY);
        if serde_json::Value::Object(rest) != entry.payload {
            return Err("the event's payload is not what the node journaled".into());
        }
        Ok(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drivers_are_named_by_their_capabilities() {
        assert_eq!(driver_of_capability("hypervisor.libvirt"), Some((DriverKind::Hypervisor, "libvirt")));
        assert_eq!(driver_of_capability("sandbox.gvisor"), Some((DriverKind::SandboxRuntime, "gvisor")));
        for none in ["gpu.hold", "tunnel.sandbox-exec", "hypervisor.", "sandbox.a.b", "instance.apply"] {
            assert_eq!(driver_of_capability(none), None, "{none}");
        }
    }

    fn body(seq: u64, prev: [u8; 32]) -> EntryBody {
        EntryBody {
            node: NodeId::from_ulid(ulid::Ulid::from_parts(1, 2)),
            seq,
            prev,
            at_ms: 1_700_000_000_000,
            entry_type: "command.succeeded".into(),
            subject: "command/cmd_01jd0000000000000000000000".into(),
            payload: serde_json::json!({ "commandId": "cmd_01jd0000000000000000000000", "result": { "pong": true } }),
        }
    }

    #[test]
    fn a_join_token_parses_back_to_its_id_and_hash() {
        let id = crate::id::JoinTokenId::from_ulid(ulid::Ulid::from_parts(5, 6));
        let (token, hash) = join_token_new(id);
        assert!(looks_like_join_token(&token));
        assert_eq!(join_token_parse(&token).unwrap(), (id, hash));
        assert!(join_token_parse(&token[..token.len() - 1]).is_err());
        assert!(join_token_parse(&id.to_string()).is_err());
        assert!(!looks_like_join_token(&id.to_string()));
    }

    #[test]
    fn an_entry_round_trips_and_verifies() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let entry = SignedEntry::sign(&key, &body(1, GENESIS_HASH)).unwrap();
        let (back, hash) = SignedEntry::verify(1, &entry.body, &entry.signature, &key.verifying_key()).unwrap();
        assert_eq!(back, body(1, GENESIS_HASH));
        assert_eq!(hash, entry.hash);
    }

    #[test]
    fn a_tampered_entry_or_another_key_is_refused() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let entry = SignedEntry::sign(&key, &body(2, [9; 32])).unwrap();
        let mut tampered = entry.body.clone();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        assert!(SignedEntry::verify(2, &tampered, &entry.signature, &key.verifying_key()).is_err());
        let other = SigningKey::from_bytes(&[8; 32]);
        assert!(SignedEntry::verify(2, &entry.body, &entry.signature, &other.verifying_key()).is_err());
        assert!(SignedEntry::verify(3, &entry.body, &entry.signature, &key.verifying_key()).unwrap_err().contains("body says 2"));
    }

    #[test]
    fn the_origin_ties_the_event_to_the_entry() {
        let key = SigningKey::from_bytes(&[7; 32]);
        let b = body(1, GENESIS_HASH);
        let entry = SignedEntry::sign(&key, &b).unwrap();
        let origin = JournalOrigin::of(&entry, &b.node);
        let mut payload = b.payload.clone();
        payload[JOURNAL_PAYLOAD_KEY] = serde_json::to_value(&origin).unwrap();
        origin.check(&key.verifying_key(), &b.entry_type, &b.subject, &payload).unwrap();
        payload["result"] = serde_json::json!({ "pong": false });
        assert!(origin.check(&key.verifying_key(), &b.entry_type, &b.subject, &payload).is_err());
        assert!(origin.check(&key.verifying_key(), "command.failed", &b.subject, &b.payload).is_err());
    }
}
