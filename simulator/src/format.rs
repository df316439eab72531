//! The export file: a CBOR sequence (RFC 8742) of a header and one record per event, each item
//! in deterministic CBOR. `schema/LOG-FORMAT.md` ("Event exports") is the normative description;
//! this module is its implementation and must change with it.
//!
//! Pure: values to bytes and back, and [`read_item`], which frames one data item from a reader
//! without reading past it (so a file is read one record at a time, in bounded memory).

use std::io::Read;

use bc_core::canonical;
use bc_core::event::{GENESIS_PREV, PAYLOAD_BYTES_MAX};
use ciborium::Value;

/// The header's `format`.
pub const FORMAT_NAME: &str = "better-compute/events-export";
/// The header's `version`: this layout. Version 2's records carry `sig` and `keyId` only for an
/// event that has a signature of its own; version 1's all do, and this build reads both.
pub const FORMAT_VERSION: u64 = 2;
/// Most keys a header names (the log's keys, current and rotated out).
pub const KEYS_MAX: usize = 64;
/// Largest header item: the keys (under 100 bytes each) and the rotations' proofs.
pub const HEADER_BYTES_MAX: usize = bc_core::note::ROTATIONS_BYTES_MAX + 64 * 1024;
/// Largest record item: an envelope (its payload at most `PAYLOAD_BYTES_MAX`, its other fields
/// under 2 KiB), a hash, a signature and a few numbers.
pub const RECORD_BYTES_MAX: usize = PAYLOAD_BYTES_MAX + 16 * 1024;
const _: () = assert!(RECORD_BYTES_MAX < HEADER_BYTES_MAX);

/// The first item: what the file holds and the keys it was signed with.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    pub tenant: String,
    /// The first record's seq (1: the chain from its start).
    pub from_seq: u64,
    /// The last record's seq (`from_seq - 1` when the file holds no record).
    pub to_seq: u64,
    /// The hash of the event before `from_seq` (32 zero bytes when `from_seq` is 1).
    pub prev_hash: [u8; 32],
    /// The hash of the event at `to_seq` (`prev_hash` when the file holds no record), so a
    /// file cut short is told from a shorter export.
    pub last_hash: [u8; 32],
    /// Every log key of the deployment, `(key id, 32-byte public key)`: trusted only through
    /// the pin the reader gives.
    pub keys: Vec<(String, [u8; 32])>,
    /// The key rotations' proofs, exactly as `GET /audit/{tenant}/rotations` serves them
    /// (`bc_core::note::encode_rotations`).
    pub rotations: Vec<u8>,
}

/// One event, with everything needed to verify it alone.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub seq: u64,
    /// The envelope's canonical bytes (what is hashed).
    pub event: Vec<u8>,
    pub hash: Vec<u8>,
    /// The envelope's `prev`, repeated so a reader links records without decoding envelopes.
    pub prev: Vec<u8>,
    pub sig: Vec<u8>,
    pub key_id: String,
    /// The outbox position the event was committed at, `commit.index`.
    pub commit: u64,
    pub index: u64,
}

fn text(s: &str) -> Value {
    Value::Text(s.to_owned())
}

fn uint(n: u64) -> Value {
    Value::Integer(n.into())
}

impl Header {
    pub fn to_cbor(&self) -> Value {
        let keys = self
            .keys
            .iter()
            .map(|(id, public)| Value::Map(vec![(text("keyId"), text(id)), (text("publicKey"), Value::Bytes(public.to_vec()))]))
            .collect();
        Value::Map(vec![
            (text("format"), text(FORMAT_NAME)),
            (text("version"), uint(FORMAT_VERSION)),
            (text("tenant"), text(&self.tenant)),
            (text("fromSeq"), uint(self.from_seq)),
            (text("toSeq"), uint(self.to_seq)),
            (text("prevHash"), Value::Bytes(self.prev_hash.to_vec())),
            (text("lastHash"), Value::Bytes(self.last_hash.to_vec())),
            (text("keys"), Value::Array(keys)),
            (text("rotations"), Value::Bytes(self.rotations.clone())),
        ])
    }

    /// Reads a header back; refuses another format or version, a missing or unknown field, and
    /// a range that does not hold together.
    pub fn from_cbor(value: Value) -> Result<Self, String> {
        let mut fields = Fields::of(value, "the header")?;
        let format = fields.text("format")?;
        if format != FORMAT_NAME {
            return Err(format!("the header's format is {format:?}, not {FORMAT_NAME:?}"));
        }
        let version = fields.uint("version")?;
        if !(1..=FORMAT_VERSION).contains(&version) {
            return Err(format!("export format version {version} is not a version this build reads (1 to {FORMAT_VERSION})"));
        }
        let tenant = fields.text("tenant")?;
        let from_seq = fields.uint("fromSeq")?;
        let to_seq = fields.uint("toSeq")?;
        let prev_hash = hash32("prevHash", fields.bytes("prevHash")?)?;
        let last_hash = hash32("lastHash", fields.bytes("lastHash")?)?;
        let Value::Array(entries) = fields.take("keys")? else { return Err("the header's keys are not an array".into()) };
        if entries.len() > KEYS_MAX {
            return Err(format!("the header names more than {KEYS_MAX} keys"));
        }
        let mut keys = Vec::with_capacity(entries.len());
        for entry in entries {
            let mut key = Fields::of(entry, "a header key")?;
            let id = key.text("keyId")?;
            let public = hash32("publicKey", key.bytes("publicKey")?)?;
            key.done()?;
            keys.push((id, public));
        }
        let rotations = fields.bytes("rotations")?;
        fields.done()?;
        if from_seq == 0 || to_seq.checked_add(1).is_none_or(|end| end < from_seq) {
            return Err(format!("the header's range {from_seq}..={to_seq} is not a range of seqs"));
        }
        if from_seq == 1 && prev_hash != GENESIS_PREV {
            return Err("the header starts at seq 1 but its prevHash is not 32 zero bytes".into());
        }
        Ok(Self { tenant, from_seq, to_seq, prev_hash, last_hash, keys, rotations })
    }
}

impl Record {
    pub fn to_cbor(&self) -> Value {
        let mut fields = vec![
            (text("seq"), uint(self.seq)),
            (text("event"), Value::Bytes(self.event.clone())),
            (text("hash"), Value::Bytes(self.hash.clone())),
            (text("prev"), Value::Bytes(self.prev.clone())),
        ];
        // Only an event that carries a signature of its own has them.
        if !self.sig.is_empty() || !self.key_id.is_empty() {
            fields.push((text("sig"), Value::Bytes(self.sig.clone())));
            fields.push((text("keyId"), text(&self.key_id)));
        }
        fields.push((text("commit"), uint(self.commit)));
        fields.push((text("index"), uint(self.index)));
        Value::Map(fields)
    }

    pub fn from_cbor(value: Value) -> Result<Self, String> {
        let mut fields = Fields::of(value, "a record")?;
        let (has_sig, has_key) = (fields.has("sig"), fields.has("keyId"));
        let record = Self {
            seq: fields.uint("seq")?,
            event: fields.bytes("event")?,
            hash: fields.bytes("hash")?,
            prev: fields.bytes("prev")?,
            sig: if fields.has("sig") { fields.bytes("sig")? } else { Vec::new() },
            key_id: if fields.has("keyId") { fields.text("keyId")? } else { String::new() },
            commit: fields.uint("commit")?,
            index: fields.uint("index")?,
        };
        fields.done()?;
        // Both absent for an event without a signature of its own; never one without the other,
        // nor either empty.
        if record.sig.is_empty() != record.key_id.is_empty() || (record.sig.is_empty() && (has_sig || has_key)) {
            return Err("a record's sig and keyId are both present and not empty, or both absent".into());
        }
        Ok(record)
    }
}

/// Encodes one item of the sequence (deterministic CBOR).
pub fn encode_item(value: Value) -> Result<Vec<u8>, bc_core::Error> {
    canonical::encode(value)
}

/// A map's text-keyed fields, taken one by one; [`Fields::done`] refuses any left over.
struct Fields {
    what: &'static str,
    entries: std::collections::BTreeMap<String, Value>,
}

impl Fields {
    fn of(value: Value, what: &'static str) -> Result<Self, String> {
        let Value::Map(pairs) = value else { return Err(format!("{what} is not a map")) };
        let mut entries = std::collections::BTreeMap::new();
        for (k, v) in pairs {
            let Value::Text(k) = k else { return Err(format!("{what} has a key that is not text")) };
            entries.insert(k, v);
        }
        Ok(Self { what, entries })
    }

    fn take(&mut self, name: &str) -> Result<Value, String> {
        self.entries.remove(name).ok_or_else(|| format!("{} has no {name:?}", self.what))
    }

    fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    fn uint(&mut self, name: &str) -> Result<u64, String> {
        match self.take(name)? {
            Value::Integer(i) => u64::try_from(i).map_err(|_| format!("{}'s {name} is not a u64", self.what)),
            _ => Err(format!("{}'s {name} is not an integer", self.what)),
        }
    }

    fn text(&mut self, name: &str) -> Result<String, String> {
        match self.take(name)? {
            Value::Text(t) => Ok(t),
            _ => Err(format!("{}'s {name} is not text", self.what)),
        }
    }

    fn bytes(&mut self, name: &str) -> Result<Vec<u8>, String> {
        match self.take(name)? {
            Value::Bytes(b) => Ok(b),
            _ => Err(format!("{}'s {name} is not a byte string", self.what)),
        }
    }

    fn done(self) -> Result<(), String> {
        match self.entries.keys().next() {
            Some(extra) => Err(format!("{} has an unknown field {extra:?}", self.what)),
            None => Ok(()),
        }
    }
}

fn hash32(name: &str, bytes: Vec<u8>) -> Result<[u8; 32], String> {
    <[u8; 32]>::try_from(bytes).map_err(|_| format!("{name} is not 32 bytes"))
}

/// Reads the next data item of a CBOR sequence from `reader`, at most `bytes_max` bytes, and
/// no byte past it; `None` at the end of the sequence (the end of the input, between items).
/// Only frames: the caller decodes the bytes (`canonical::decode_canonical`, which also insists
/// on the deterministic encoding). Indefinite lengths are refused, as the format has none.
pub fn read_item(reader: &mut impl Read, bytes_max: usize) -> Result<Option<Vec<u8>>, String> {
    let mut out = Vec::new();
    // Data items still to read: each head is one, and an array or map adds its members.
    let mut pending: u64 = 1;
    while pending > 0 {
        let mut first = [0u8; 1];
        match reader.read(&mut first) {
            Ok(0) if out.is_empty() => return Ok(None),
            Ok(0) => return Err("the file ends inside an item".into()),
            Ok(_) => {}
            Err(e) => return Err(format!("reading: {e}")),
        }
        out.push(first[0]);
        let (major, info) = (first[0] >> 5, first[0] & 0x1f);
        let argument = match info {
            0..=23 => u64::from(info),
            24..=27 => {
                let mut bytes = [0u8; 8];
                let width = 1usize << (info - 24);
                read_exact(reader, &mut bytes[8 - width..])?;
                out.extend_from_slice(&bytes[8 - width..]);
                u64::from_be_bytes(bytes)
            }
            31 => return Err("indefinite lengths are not part of the format".into()),
            _ => return Err(format!("reserved additional information {info} in a head")),
        };
        pending -= 1;
        let too_large = || format!("an item is larger than {bytes_max} bytes");
        match major {
            2 | 3 => {
                let length = usize::try_from(argument).map_err(|_| too_large())?;
                if out.len().saturating_add(length) > bytes_max {
                    return Err(too_large());
                }
                let start = out.len();
                out.resize(start + length, 0);
                read_exact(reader, &mut out[start..])?;
            }
            4 => pending = pending.saturating_add(argument),
            5 => pending = pending.saturating_add(argument.saturating_mul(2)),
            6 => pending += 1,
            _ => {}
        }
        // Every member takes a byte at least: more pending than the bound leaves is too large.
        if out.len() > bytes_max || pending > (bytes_max - out.len().min(bytes_max)) as u64 {
            return Err(too_large());
        }
    }
    Ok(Some(out))
}

fn read_exact(reader: &mut impl Read, into: &mut [u8]) -> Result<(), String> {
    reader.read_exact(into).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "the file ends inside an item".to_owned(),
        _ => format!("reading: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            tenant: "ten_00000000000000000000000000".into(),
            from_seq: 1,
            to_seq: 2,
            prev_hash: GENESIS_PREV,
            last_hash: [9; 32],
            keys: vec![("lk_0011223344556677".into(), [7; 32])],
            rotations: bc_core::note::encode_rotations(&[]),
        }
    }

    #[test]
    fn items_are_framed_one_at_a_time_and_round_trip() {
        let record = Record {
            seq: 1,
            event: vec![0xa0],
            hash: vec![1; 32],
            prev: vec![0; 32],
            sig: vec![2; 64],
            key_id: "lk_0011223344556677".into(),
            commit: 3,
            index: 0,
        };
        let mut file = encode_item(header().to_cbor()).unwrap();
        file.extend(encode_item(record.to_cbor()).unwrap());
        let mut reader = std::io::Cursor::new(file);
        let first = read_item(&mut reader, HEADER_BYTES_MAX).unwrap().unwrap();
        assert_eq!(Header::from_cbor(canonical::decode_canonical(&first).unwrap()).unwrap(), header());
        let second = read_item(&mut reader, RECORD_BYTES_MAX).unwrap().unwrap();
        assert_eq!(Record::from_cbor(canonical::decode_canonical(&second).unwrap()).unwrap(), record);
        assert_eq!(read_item(&mut reader, RECORD_BYTES_MAX).unwrap(), None, "the end, between items");
    }

    #[test]
    fn framing_refuses_cut_oversized_and_indefinite_items() {
        let item = encode_item(header().to_cbor()).unwrap();
        let cut = &item[..item.len() - 3];
        assert!(read_item(&mut &cut[..], HEADER_BYTES_MAX).unwrap_err().contains("ends inside"));
        assert!(read_item(&mut &item[..], 16).unwrap_err().contains("larger than 16"));
        // A byte string claiming 2^63 bytes, and an array claiming 2^63 members.
        let huge = [0x5b, 0x80, 0, 0, 0, 0, 0, 0, 0];
        assert!(read_item(&mut &huge[..], RECORD_BYTES_MAX).unwrap_err().contains("larger"));
        let many = [0x9b, 0x80, 0, 0, 0, 0, 0, 0, 0];
        assert!(read_item(&mut &many[..], RECORD_BYTES_MAX).unwrap_err().contains("larger"));
        assert!(read_item(&mut &[0x9f, 0xff][..], RECORD_BYTES_MAX).unwrap_err().contains("indefinite"));
    }

    /// The entries of a header's map.
    type Entries = Vec<(Value, Value)>;

    #[test]
    fn headers_of_another_format_or_shape_are_refused() {
        let with = |edit: &dyn Fn(&mut Entries)| {
            let Value::Map(mut entries) = header().to_cbor() else { unreachable!() };
            edit(&mut entries);
            Header::from_cbor(Value::Map(entries))
        };
        let set = |name: &'static str, value: Value| {
            move |e: &mut Entries| {
                for (k, v) in e.iter_mut() {
                    if *k == text(name) {
                        *v = value.clone();
                    }
                }
            }
        };
        assert!(with(&set("format", text("other"))).unwrap_err().contains("format"));
        assert!(with(&set("version", uint(3))).unwrap_err().contains("version 3"));
        assert!(with(&set("fromSeq", uint(0))).unwrap_err().contains("range"));
        assert!(with(&set("prevHash", Value::Bytes(vec![1; 32]))).unwrap_err().contains("zero"));
        assert!(with(&|e| e.push((text("extra"), uint(1)))).unwrap_err().contains("unknown field"));
        assert!(with(&|e| e.retain(|(k, _)| *k != text("keys"))).unwrap_err().contains("keys"));
    }
}
