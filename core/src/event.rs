//! The event envelope, its canonical encoding and hash, and the stored form.
//!
//! `schema/LOG-FORMAT.md` is the normative description of the bytes; this module is its
//! implementation and must change with it.

use std::fmt;
use std::str::FromStr;

use ciborium::Value;
use sha2::{Digest, Sha256};

use crate::canonical;
use crate::error::{Error, Result};
use crate::id::{EventId, TenantId};

/// Version of the envelope format, hashed as key `"v"`.
pub const ENVELOPE_FORMAT: u64 = 1;
/// `prev` of the first event of every chain.
pub const GENESIS_PREV: [u8; 32] = [0; 32];
/// Longest stream name (`pool/pool_…`).
pub const STREAM_NAME_BYTES_MAX: usize = 200;
/// Longest event type (`reservation.requested`).
pub const EVENT_TYPE_BYTES_MAX: usize = 100;
/// Longest actor, idempotency key, causation or correlation string.
pub const LABEL_BYTES_MAX: usize = 200;
/// Largest canonical payload of one event.
pub const PAYLOAD_BYTES_MAX: usize = 64 * 1024;
/// Every event whose `seq` is a multiple of this carries a signature of its own, so an event
/// without one is followed, at most this many events on, by one that covers it
/// (`schema/LOG-FORMAT.md`, "Signature"): `events.get` proves any event with at most this many
/// others' bytes.
pub const SIGNED_SEQ_INTERVAL: u64 = 16;

/// Whether the event at `seq` of type `event_type` must carry a signature of its own, whatever
/// else is decided with it: every [`SIGNED_SEQ_INTERVAL`]th event of a chain, and a key
/// rotation (`audit check-proof` and `audit follow` check that event's signature alone). The
/// appender signs the last event of each chain in a decided batch too (the head it leaves);
/// every verifier refuses an event this names without a signature ([`signature_columns`]).
pub fn signed_alone(seq: u64, event_type: &str) -> bool {
    seq.is_multiple_of(SIGNED_SEQ_INTERVAL) || event_type == crate::audit::LOG_KEY_ROTATED
}

/// An event's `sig` and `key_id` columns as every verifier reads them (`schema/LOG-FORMAT.md`,
/// "Signature"): the one rule of which events carry a signature of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignatureColumns<'a> {
    /// The event carries a signature of its own: check `sig` under the key `key_id`.
    Signed { key_id: &'a str, sig: &'a [u8] },
    /// No signature of its own: a later signed event of the chain must cover it.
    CoveredLater,
}

/// Reads the signature columns of the event at `seq` of type `event_type`: both set, or both
/// empty where [`signed_alone`] does not name the event. Anything else is refused, with what a
/// verifier says of it.
pub fn signature_columns<'a>(seq: u64, event_type: &str, key_id: &'a str, sig: &'a [u8]) -> Result<SignatureColumns<'a>, String> {
    match (sig.is_empty(), key_id.is_empty()) {
        (true, true) if event_type == crate::audit::LOG_KEY_ROTATED => {
            Err("a key rotation without a signature of its own".into())
        }
        (true, true) if signed_alone(seq, event_type) => {
            Err(format!("seq {seq} is a multiple of {SIGNED_SEQ_INTERVAL} and carries no signature"))
        }
        (true, true) => Ok(SignatureColumns::CoveredLater),
        (true, false) => Err(format!("no signature, yet a key id ({key_id})")),
        (false, true) => Err("a signature without a key id".into()),
        (false, false) => Ok(SignatureColumns::Signed { key_id, sig }),
    }
}

/// Where an event sits in the outbox of one database: the append transaction's number,
/// gap-free and in commit order, and the event's index inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Position {
    pub commit: u64,
    pub index: u32,
}

impl Position {
    /// Before every event.
    pub const START: Position = Position { commit: 0, index: 0 };
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.commit, self.index)
    }
}

impl FromStr for Position {
    type Err = Error;
    /// Accepts `COMMIT.INDEX` and `COMMIT:INDEX`.
    fn from_str(text: &str) -> Result<Self> {
        let bad = || Error::InvalidArgument {
            message: format!("malformed position {:?}", crate::id::truncate(text, 40)),
            hint: Some("a position is COMMIT.INDEX (or COMMIT:INDEX), both non-negative integers".into()),
        };
        let (c, i) = text.split_once(['.', ':']).ok_or_else(bad)?;
        let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(c) || !digits(i) {
            return Err(bad());
        }
        // Commit numbers are stored as signed 64-bit integers and indexes as 32-bit ones.
        let commit: u64 = c.parse().map_err(|_| bad())?;
        let index: u32 = i.parse().map_err(|_| bad())?;
        if commit > i64::MAX as u64 || index > i32::MAX as u32 {
            return Err(bad());
        }
        Ok(Position { commit, index })
    }
}

/// Everything that is hashed. `at` is milliseconds since the Unix epoch.
#[derive(Clone, Debug, PartialEq)]
pub struct Envelope {
    pub tenant: TenantId,
    pub seq: u64,
    pub id: EventId,
    pub stream: String,
    pub version: u64,
    pub event_type: String,
    pub at_ms: u64,
    pub actor: String,
    pub idempotency_key: Option<String>,
    pub causation: Option<String>,
    pub correlation: Option<String>,
    pub payload: Value,
    pub prev: [u8; 32],
}

fn text(s: &str) -> Value {
    Value::Text(s.to_owned())
}

impl Envelope {
    /// Whether the payload is a map holding `key`.
    pub fn payload_has(&self, key: &str) -> bool {
        matches!(&self.payload, Value::Map(entries) if entries.iter().any(|(k, _)| matches!(k, Value::Text(t) if t == key)))
    }

    /// The canonical CBOR map of LOG-FORMAT.md. Absent optional fields are omitted.
    pub fn to_canonical(&self) -> Result<Vec<u8>> {
        let mut map = vec![
            (text("v"), Value::Integer(ENVELOPE_FORMAT.into())),
            (text("tenant"), text(&self.tenant.to_string())),
            (text("seq"), Value::Integer(self.seq.into())),
            (text("id"), text(&self.id.to_string())),
            (text("stream"), text(&self.stream)),
            (text("version"), Value::Integer(self.version.into())),
            (text("type"), text(&self.event_type)),
            (text("at"), Value::Integer(self.at_ms.into())),
            (text("actor"), text(&self.actor)),
            (text("payload"), self.payload.clone()),
            (text("prev"), Value::Bytes(self.prev.to_vec())),
        ];
        for (key, value) in
            [("idempotency_key", &self.idempotency_key), ("causation", &self.causation), ("correlation", &self.correlation)]
        {
            if let Some(value) = value {
                map.push((text(key), text(value)));
            }
        }
        canonical::encode(Value::Map(map))
    }

    /// Parses canonical bytes back; fails unless they are exactly the canonical encoding of a
    /// well-formed envelope.
    pub fn from_canonical(bytes: &[u8]) -> Result<Self, String> {
        let value = canonical::decode_canonical(bytes)?;
        let Value::Map(entries) = value else { return Err("envelope is not a map".into()) };
        let mut fields: std::collections::BTreeMap<String, Value> = Default::default();
        for (k, v) in entries {
            let Value::Text(k) = k else { return Err("envelope key is not text".into()) };
            fields.insert(k, v);
        }
        let mut take = |name: &str| fields.remove(name).ok_or_else(|| format!("envelope has no {name:?}"));
        let as_u64 = |name: &str, v: Value| -> Result<u64, String> {
            match v {
                Value::Integer(i) => u64::try_from(i).map_err(|_| format!("{name} is not a u64")),
                _ => Err(format!("{name} is not an integer")),
            }
        };
        let as_text = |name: &str, v: Value| -> Result<String, String> {
            match v {
                Value::Text(s) => Ok(s),
                _ => Err(format!("{name} is not text")),
            }
        };
        let format = as_u64("v", take("v")?)?;
        if format != ENVELOPE_FORMAT {
            return Err(format!("unknown envelope format {format}"));
        }
        let tenant: TenantId = canonical_id("tenant", &as_text("tenant", take("tenant")?)?, TenantId::PREFIX)?;
        let seq = as_u64("seq", take("seq")?)?;
        let id: EventId = canonical_id("id", &as_text("id", take("id")?)?, EventId::PREFIX)?;
        let stream = as_text("stream", take("stream")?)?;
        let version = as_u64("version", take("version")?)?;
        let event_type = as_text("type", take("type")?)?;
        let at_ms = as_u64("at", take("at")?)?;
        let actor = as_text("actor", take("actor")?)?;
        let payload = take("payload")?;
        let prev = match take("prev")? {
            Value::Bytes(b) => <[u8; 32]>::try_from(b).map_err(|_| "prev is not 32 bytes".to_owned())?,
            _ => return Err("prev is not a byte string".into()),
        };
        let mut optional =
            |name: &str| -> Result<Option<String>, String> { fields.remove(name).map(|v| as_text(name, v)).transpose() };
        let idempotency_key = optional("idempotency_key")?;
        let causation = optional("causation")?;
        let correlation = optional("correlation")?;
        if let Some(extra) = fields.keys().next() {
            return Err(format!("envelope has unknown field {extra:?}"));
        }
        Ok(Envelope {
            tenant,
            seq,
            id,
            stream,
            version,
            event_type,
            at_ms,
            actor,
            idempotency_key,
            causation,
            correlation,
            payload,
            prev,
        })
    }
}

/// Parses an id of the kind spelled `prefix` and insists on its canonical spelling (lowercase,
/// no Crockford aliases such as `o` for `0`): the hashed bytes are the record, so one id has one
/// spelling. The spelling is checked from the bytes ([`crate::id::is_canonical`]); only an id
/// that fails it is displayed again, for the error.
fn canonical_id<T: FromStr<Err = Error> + fmt::Display>(name: &str, text: &str, prefix: &str) -> Result<T, String> {
    let id: T = text.parse().map_err(|e: Error| e.to_string())?;
    if !crate::id::is_canonical(text, prefix) && id.to_string() != text {
        return Err(format!("{name} is not in its canonical spelling"));
    }
    Ok(id)
}

/// [`canonical_id`]'s check without the parse where the spelling is canonical (the audit's
/// path, which needs no id value).
fn check_spelling<T: FromStr<Err = Error> + fmt::Display>(name: &str, text: &str, prefix: &str) -> Result<(), String> {
    if crate::id::is_canonical(text, prefix) { Ok(()) } else { canonical_id::<T>(name, text, prefix).map(drop) }
}

pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// An event as stored: the envelope, its canonical bytes, hash and signature, and its position.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredEvent {
    pub envelope: Envelope,
    pub canonical: Vec<u8>,
    pub hash: [u8; 32],
    pub sig: Vec<u8>,
    pub key_id: String,
    pub position: Position,
}

/// The columns of an event row, as a backend reads them, before any check.
#[derive(Clone, Debug)]
pub struct EventRow {
    pub tenant: String,
    pub seq: u64,
    pub id: String,
    pub stream: String,
    pub version: u64,
    pub event_type: String,
    pub commit: u64,
    pub index: u32,
    pub canonical: Vec<u8>,
    pub hash: Vec<u8>,
    pub sig: Vec<u8>,
    pub key_id: String,
}

impl EventRow {
    /// Decodes the row into an event, checking that the indexed columns agree with the hashed
    /// bytes and that the stored hash is the hash of those bytes (STYLE rule 8: check again on
    /// read). Signatures are checked by [`crate::chain`], which has the keys.
    pub fn decode(self) -> Result<StoredEvent, String> {
        // The hash first: any changed byte is reported as what it is.
        let hash = <[u8; 32]>::try_from(self.hash.as_slice()).map_err(|_| "stored hash is not 32 bytes".to_owned())?;
        if sha256(&self.canonical) != hash {
            return Err("stored hash is not SHA-256 of the canonical bytes".into());
        }
        let envelope = Envelope::from_canonical(&self.canonical)?;
        let mismatch = |what: &str| format!("column {what} disagrees with the hashed envelope");
        if envelope.tenant.to_string() != self.tenant {
            return Err(mismatch("tenant_id"));
        }
        if envelope.seq != self.seq {
            return Err(mismatch("seq"));
        }
        if envelope.id.to_string() != self.id {
            return Err(mismatch("id"));
        }
        if envelope.stream != self.stream {
            return Err(mismatch("stream"));
        }
        if envelope.version != self.version {
            return Err(mismatch("version"));
        }
        if envelope.event_type != self.event_type {
            return Err(mismatch("type"));
        }
        Ok(StoredEvent {
            envelope,
            canonical: self.canonical,
            hash,
            sig: self.sig,
            key_id: self.key_id,
            position: Position { commit: self.commit, index: self.index },
        })
    }
}

/// What [`EventRow::check`] establishes about a row without building its envelope.
#[derive(Clone, Debug)]
pub struct CheckedEvent<'a> {
    pub hash: [u8; 32],
    pub prev: [u8; 32],
    /// The payload's bytes (one deterministic CBOR item).
    pub payload: &'a [u8],
}

impl EventRow {
    /// The same checks as [`EventRow::decode`] (hash, deterministic encoding, envelope shape,
    /// columns against the hashed fields) without allocating: the audit's hot path.
    pub fn check(&self) -> Result<CheckedEvent<'_>, String> {
        let hash = <[u8; 32]>::try_from(self.hash.as_slice()).map_err(|_| "stored hash is not 32 bytes".to_owned())?;
        if sha256(&self.canonical) != hash {
            return Err("stored hash is not SHA-256 of the canonical bytes".into());
        }
        // One pass over the bytes checks the deterministic encoding (each head in shortest form,
        // the keys in order, the payload item by item, nothing after the map) and the envelope
        // at once: what `canonical::validate` and then a read of the fields would check apart.
        let mut r = canonical::Reader { bytes: &self.canonical, pos: 0 };
        let (major, entries) = r.head()?;
        if major != 5 {
            return Err("envelope is not a map".into());
        }
        let (mut seen, mut prev, mut payload) = (0u16, None, None);
        let mut previous_key: &[u8] = &[];
        for _ in 0..entries {
            let key_start = r.pos;
            let key = r.text().map_err(|_| "envelope key is not text".to_owned())?;
            let key_bytes = &self.canonical[key_start..r.pos];
            if key_bytes <= previous_key {
                return Err("not in deterministic encoding: map keys are not in deterministic order, or repeat".into());
            }
            previous_key = key_bytes;
            seen |= self.check_field(key, &mut r, &mut prev, &mut payload)?;
        }
        if r.pos != self.canonical.len() {
            return Err("not in deterministic encoding: trailing bytes after the item".into());
        }
        if seen != 2047 {
            return Err("envelope misses a required field".into());
        }
        Ok(CheckedEvent { hash, prev: prev.expect("seen"), payload: payload.expect("seen") })
    }

    /// Reads the value of the envelope's field `key` and checks it against the row's columns
    /// (`prev` and `payload` are kept for the caller); the field's bit among the required fields
    /// (0 for an optional one).
    fn check_field<'a>(
        &'a self,
        key: &str,
        r: &mut canonical::Reader<'a>,
        prev: &mut Option<[u8; 32]>,
        payload: &mut Option<&'a [u8]>,
    ) -> Result<u16, String> {
        let agrees = |same: bool, column: &str, bit: u16| {
            if same { Ok(bit) } else { Err(format!("column {column} disagrees with the hashed envelope")) }
        };
        match key {
            "v" => {
                if r.uint()? != ENVELOPE_FORMAT {
                    return Err("unknown envelope format".into());
                }
                Ok(1)
            }
            "tenant" => {
                let tenant = r.text()?;
                check_spelling::<TenantId>("tenant", tenant, TenantId::PREFIX)?;
                agrees(tenant == self.tenant, "tenant_id", 2)
            }
            "seq" => agrees(r.uint()? == self.seq, "seq", 4),
            "id" => {
                let id = r.text()?;
                check_spelling::<EventId>("id", id, EventId::PREFIX)?;
                agrees(id == self.id, "id", 8)
            }
            "stream" => agrees(r.text()? == self.stream, "stream", 16),
            "version" => agrees(r.uint()? == self.version, "version", 32),
            "type" => agrees(r.text()? == self.event_type, "type", 64),
            "at" => r.uint().map(|_| 128),
            "actor" => r.text().map(|_| 256),
            "payload" => {
                let start = r.pos;
                r.item(1)?;
                *payload = Some(&self.canonical[start..r.pos]);
                Ok(512)
            }
            "prev" => {
                *prev = Some(<[u8; 32]>::try_from(r.bytes()?).map_err(|_| "prev is not 32 bytes".to_owned())?);
                Ok(1024)
            }
            "idempotency_key" | "causation" | "correlation" => r.text().map(|_| 0),
            other => Err(format!("envelope has unknown field {other:?}")),
        }
    }
}

/// Checks the shape of a name used as a stream or event type: printable ASCII without spaces.
pub fn validate_name(what: &str, name: &str, bytes_max: usize) -> Result<()> {
    if name.is_empty() || name.len() > bytes_max {
        return Err(Error::invalid(format!("{what} must be 1 to {bytes_max} bytes")));
    }
    if !name.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::invalid(format!("{what} {:?} must be printable ASCII without spaces", crate::id::truncate(name, 40))));
    }
    Ok(())
}

#[cfg(test)]
// Tests, outside the simulator: fresh random ids and the real clock (clippy.toml).
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn signature_columns_are_both_set_or_both_empty_where_a_later_signature_may_cover() {
        use SignatureColumns::*;
        let sig = [7u8; 64];
        assert_eq!(signature_columns(3, "pool.created", "lk_1", &sig), Ok(Signed { key_id: "lk_1", sig: &sig }));
        assert_eq!(signature_columns(3, "pool.created", "", &[]), Ok(CoveredLater));
        assert_eq!(signature_columns(16, "pool.created", "lk_1", &sig), Ok(Signed { key_id: "lk_1", sig: &sig }));
        let must = signature_columns(32, "pool.created", "", &[]).unwrap_err();
        assert!(must.contains("seq 32 is a multiple of 16"), "{must}");
        let rotation = signature_columns(5, crate::audit::LOG_KEY_ROTATED, "", &[]).unwrap_err();
        assert!(rotation.contains("key rotation"), "{rotation}");
        assert!(signature_columns(3, "pool.created", "lk_1", &[]).unwrap_err().contains("yet a key id (lk_1)"));
        assert!(signature_columns(3, "pool.created", "", &sig).unwrap_err().contains("without a key id"));
    }

    #[test]
    fn positions_parse_both_spellings() {
        assert_eq!("12.3".parse::<Position>().unwrap(), Position { commit: 12, index: 3 });
        assert_eq!("12:3".parse::<Position>().unwrap(), Position { commit: 12, index: 3 });
        for bad in
            ["", "12", "12.", ".3", "a.b", "-1.0", "1.2.3", "99999999999999999999999.0", "18446744073709551615.0", "1.4294967295"]
        {
            assert!(bad.parse::<Position>().is_err(), "{bad}");
        }
        assert_eq!(Position { commit: 7, index: 0 }.to_string(), "7.0");
    }

    #[test]
    fn envelope_round_trips_and_is_readable_by_another_decoder() {
        let env = Envelope {
            tenant: TenantId::generate(),
            seq: 1,
            id: EventId::generate(),
            stream: "pool/x".into(),
            version: 1,
            event_type: "pool.created".into(),
            at_ms: 1_790_000_000_000,
            actor: "system".into(),
            idempotency_key: Some("k1".into()),
            causation: None,
            correlation: None,
            payload: Value::Map(vec![(text("name"), text("gpu-a"))]),
            prev: GENESIS_PREV,
        };
        let bytes = env.to_canonical().unwrap();
        assert_eq!(Envelope::from_canonical(&bytes).unwrap(), env);
        // A third-party decoder (minicbor) reads it: a definite map whose first key is "v".
        let mut decoder = minicbor::Decoder::new(&bytes);
        let entries = decoder.map().unwrap().expect("definite length");
        assert_eq!(entries, 12);
        assert_eq!(decoder.str().unwrap(), "v");
        assert_eq!(decoder.u64().unwrap(), ENVELOPE_FORMAT);
        // Re-encoding through minicbor's token stream gives the same bytes.
        let tokens: Vec<minicbor::data::Token<'_>> = minicbor::decode::Tokenizer::new(&bytes).collect::<Result<_, _>>().unwrap();
        let mut again = minicbor::Encoder::new(Vec::new());
        for t in &tokens {
            again.encode(t).unwrap();
        }
        assert_eq!(again.into_writer(), bytes);
    }
}

#[cfg(test)]
mod known_answer {
    //! The worked example of `schema/LOG-FORMAT.md`. If this test fails, the format changed:
    //! update the document (and think about every verifier already written from it).
    use super::*;
    use crate::keys::LogKey;

    pub fn example() -> Envelope {
        Envelope {
            tenant: "ten_00000000000000000000000000".parse().unwrap(),
            seq: 1,
            id: "evt_01jd000000000000000000000a".parse().unwrap(),
            stream: "pool/pool_01jd000000000000000000000b".into(),
            version: 1,
            event_type: "pool.created".into(),
            at_ms: 1_790_000_000_000,
            actor: "system".into(),
            idempotency_key: None,
            causation: None,
            correlation: None,
            payload: Value::Map(vec![(Value::Text("name".into()), Value::Text("gpu-a".into()))]),
            prev: GENESIS_PREV,
        }
    }

    #[test]
    fn worked_example() {
        let key = LogKey::from_seed([7; 32]);
        let bytes = example().to_canonical().unwrap();
        let hash = sha256(&bytes);
        let sig = key.sign_event_hash(&hash);
        let got = format!(
            "canonical={}\nhash={}\nsig={}\nkey_id={}\npin={}\npublic={}",
            hex::encode(&bytes),
            hex::encode(hash),
            hex::encode(sig),
            key.key_id(),
            key.pin(),
            hex::encode(key.public().as_bytes())
        );
        let expected = include_str!("../../schema/log-format-example.txt");
        assert_eq!(got.trim(), expected.trim(), "\n{got}");
    }
}
