//! Deterministic CBOR (RFC 8949 §4.2.1, "core deterministic encoding") over `ciborium`.
//!
//! ciborium already writes definite lengths and the shortest integer heads; what it does not do
//! is order map keys. [`canonicalize`] sorts every map by the bytewise order of its keys'
//! encodings and refuses what this log never stores (floats, tags, duplicate keys), so that
//! [`encode`] is a function of the value alone and [`decode_canonical`] can insist that the
//! bytes it was given are exactly what encoding their value again gives.

use ciborium::Value;

use crate::error::{Error, Result};

/// Deepest nesting accepted in a payload, so a hostile document cannot exhaust the stack.
pub const NESTING_DEPTH_MAX: usize = 32;

/// Sorts maps (recursively) and rejects values outside the log's subset of CBOR.
pub fn canonicalize(value: Value) -> Result<Value> {
    canonicalize_at(value, 0)
}

fn canonicalize_at(value: Value, depth: usize) -> Result<Value> {
    if depth > NESTING_DEPTH_MAX {
        return Err(Error::invalid(format!("value nested deeper than {NESTING_DEPTH_MAX} levels")));
    }
    Ok(match value {
        Value::Integer(_) | Value::Bytes(_) | Value::Text(_) | Value::Bool(_) | Value::Null => value,
        Value::Float(_) => return Err(Error::invalid("floating-point numbers are not allowed in events")),
        Value::Tag(..) => return Err(Error::invalid("CBOR tags are not allowed in events")),
        Value::Array(items) => Value::Array(items.into_iter().map(|v| canonicalize_at(v, depth + 1)).collect::<Result<_>>()?),
        Value::Map(entries) => {
            let mut sorted = Vec::with_capacity(entries.len());
            for (k, v) in entries {
                sorted.push((canonicalize_at(k, depth + 1)?, canonicalize_at(v, depth + 1)?));
            }
            if sorted.iter().all(|(k, _)| matches!(k, Value::Text(_))) {
                // For text keys the bytewise order of the encodings is the order of (length,
                // bytes), because a deterministic head grows with the length: no need to encode.
                sorted.sort_by(|(a, _), (b, _)| text_key_order(a, b));
            } else {
                let mut keyed = Vec::with_capacity(sorted.len());
                for (k, v) in sorted {
                    keyed.push((encode_raw(&k)?, k, v));
                }
                keyed.sort_by(|a, b| a.0.cmp(&b.0));
                sorted = keyed.into_iter().map(|(_, k, v)| (k, v)).collect();
            }
            if sorted.windows(2).any(|w| w[0].0 == w[1].0) {
                return Err(Error::invalid("duplicate map key"));
            }
            Value::Map(sorted)
        }
        _ => return Err(Error::invalid("unsupported CBOR value")),
    })
}

fn text_key_order(a: &Value, b: &Value) -> std::cmp::Ordering {
    match (a, b) {
        (Value::Text(a), Value::Text(b)) => a.len().cmp(&b.len()).then_with(|| a.as_bytes().cmp(b.as_bytes())),
        _ => std::cmp::Ordering::Equal,
    }
}

fn encode_raw(value: &Value) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(64);
    ciborium::into_writer(value, &mut out).map_err(|e| Error::Internal(format!("cbor encode: {e}")))?;
    Ok(out)
}

/// The deterministic encoding of `value`.
pub fn encode(value: Value) -> Result<Vec<u8>> {
    encode_raw(&canonicalize(value)?)
}

/// Decodes `bytes` and checks that they are the deterministic encoding of what they hold.
pub fn decode_canonical(bytes: &[u8]) -> Result<Value, String> {
    let value: Value = ciborium::de::from_reader_with_recursion_limit(bytes, NESTING_DEPTH_MAX + 2)
        .map_err(|e| format!("not valid CBOR: {e}"))?;
    let again = encode(value.clone()).map_err(|e| format!("not in the log's CBOR subset: {e}"))?;
    if again != bytes {
        return Err("not in deterministic encoding (RFC 8949 §4.2.1)".to_owned());
    }
    Ok(value)
}

/// JSON (from the API) to CBOR. Integers stay integers; floats are refused.
pub fn from_json(json: &serde_json::Value) -> Result<Value> {
    from_json_at(json, 0)
}

fn from_json_at(json: &serde_json::Value, depth: usize) -> Result<Value> {
    if depth > NESTING_DEPTH_MAX {
        return Err(Error::invalid(format!("value nested deeper than {NESTING_DEPTH_MAX} levels")));
    }
    use serde_json::Value as J;
    Ok(match json {
        J::Null => Value::Null,
        J::Bool(b) => Value::Bool(*b),
        J::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::Integer(u.into())
            } else if let Some(i) = n.as_i64() {
                Value::Integer(i.into())
            } else {
                return Err(Error::invalid(format!("number {n} is not an integer; events hold integers only")));
            }
        }
        J::String(s) => Value::Text(s.clone()),
        J::Array(items) => Value::Array(items.iter().map(|v| from_json_at(v, depth + 1)).collect::<Result<_>>()?),
        J::Object(map) => {
            Value::Map(map.iter().map(|(k, v)| Ok((Value::Text(k.clone()), from_json_at(v, depth + 1)?))).collect::<Result<_>>()?)
        }
    })
}

/// CBOR back to JSON for the API. Byte strings become base64 (standard alphabet).
pub fn to_json(value: &Value) -> serde_json::Value {
    use base64::Engine;
    use serde_json::Value as J;
    match value {
        Value::Null => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Integer(i) => {
            let i: i128 = (*i).into();
            if let Ok(u) = u64::try_from(i) {
                J::from(u)
            } else if let Ok(s) = i64::try_from(i) {
                J::from(s)
            } else {
                J::String(i.to_string())
            }
        }
        Value::Text(s) => J::String(s.clone()),
        Value::Bytes(b) => J::String(base64::engine::general_purpose::STANDARD.encode(b)),
        Value::Array(items) => J::Array(items.iter().map(to_json).collect()),
        Value::Map(entries) => J::Object(
            entries
                .iter()
                .map(|(k, v)| {
                    let key = match k {
                        Value::Text(s) => s.clone(),
                        other => format!("{other:?}"),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
        Value::Float(f) => serde_json::Number::from_f64(*f).map(J::Number).unwrap_or(J::Null),
        Value::Tag(_, inner) => to_json(inner),
        _ => J::Null,
    }
}

/// Checks, without allocating, that `bytes` are one item in the log's deterministic subset of
/// CBOR: exactly what [`decode_canonical`] accepts, at a fraction of its cost. The audit's hot
/// path (`EventRow::check`) makes the same checks with the same [`Reader`] in its one pass over
/// an envelope; a property test holds this, that and the full decode to the same answers.
pub fn validate(bytes: &[u8]) -> Result<(), String> {
    let mut reader = Reader { bytes, pos: 0 };
    reader.item(0)?;
    if reader.pos != bytes.len() {
        return Err("trailing bytes after the item".into());
    }
    Ok(())
}

/// A cursor over deterministic CBOR.
pub(crate) struct Reader<'a> {
    pub(crate) bytes: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|e| *e <= self.bytes.len()).ok_or("truncated CBOR")?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// The next head: (major type, argument), refusing non-shortest and indefinite forms.
    pub(crate) fn head(&mut self) -> Result<(u8, u64), String> {
        let initial = self.take(1)?[0];
        let (major, info) = (initial >> 5, initial & 0x1f);
        let arg = match info {
            0..=23 => u64::from(info),
            24 => {
                let v = u64::from(self.take(1)?[0]);
                if v < 24 {
                    return Err("not in shortest form".into());
                }
                v
            }
            25 => {
                let v = u64::from(u16::from_be_bytes(self.take(2)?.try_into().expect("2 bytes")));
                if v <= 0xff {
                    return Err("not in shortest form".into());
                }
                v
            }
            26 => {
                let v = u64::from(u32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")));
                if v <= 0xffff {
                    return Err("not in shortest form".into());
                }
                v
            }
            27 => {
                let v = u64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes"));
                if v <= 0xffff_ffff {
                    return Err("not in shortest form".into());
                }
                v
            }
            _ => return Err("indefinite length or reserved head".into()),
        };
        match major {
            6 => Err("CBOR tags are not allowed".into()),
            7 if !(20..=22).contains(&info) => {
                Err("floats and simple values other than false, true, null are not allowed".into())
            }
            _ => Ok((major, arg)),
        }
    }

    /// A text string's contents.
    pub(crate) fn text(&mut self) -> Result<&'a str, String> {
        let (major, len) = self.head()?;
        if major != 3 {
            return Err("expected text".into());
        }
        std::str::from_utf8(self.take(usize::try_from(len).map_err(|_| "too long")?)?).map_err(|_| "text is not UTF-8".to_owned())
    }

    pub(crate) fn uint(&mut self) -> Result<u64, String> {
        match self.head()? {
            (0, v) => Ok(v),
            _ => Err("expected an unsigned integer".into()),
        }
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], String> {
        let (major, len) = self.head()?;
        if major != 2 {
            return Err("expected a byte string".into());
        }
        self.take(usize::try_from(len).map_err(|_| "too long")?)
    }

    /// Skips one item, checking it.
    pub(crate) fn item(&mut self, depth: usize) -> Result<(), String> {
        if depth > NESTING_DEPTH_MAX {
            return Err("nested too deeply".into());
        }
        let (major, arg) = self.head()?;
        let len = usize::try_from(arg).map_err(|_| "too long");
        match major {
            0 | 1 | 7 => {}
            2 => {
                self.take(len?)?;
            }
            3 => {
                std::str::from_utf8(self.take(len?)?).map_err(|_| "text is not UTF-8".to_owned())?;
            }
            4 => {
                for _ in 0..arg {
                    self.item(depth + 1)?;
                }
            }
            5 => {
                let mut previous: Option<&[u8]> = None;
                for _ in 0..arg {
                    let start = self.pos;
                    self.item(depth + 1)?;
                    let key = &self.bytes[start..self.pos];
                    if previous.is_some_and(|p| key <= p) {
                        return Err("map keys are not in deterministic order, or repeat".into());
                    }
                    previous = Some(key);
                    self.item(depth + 1)?;
                }
            }
            _ => return Err("unknown major type".into()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Value {
        Value::Text(s.to_owned())
    }

    #[test]
    fn known_answers() {
        // RFC 8949 Appendix A examples for the shortest heads.
        assert_eq!(encode(Value::Integer(0.into())).unwrap(), [0x00]);
        assert_eq!(encode(Value::Integer(23.into())).unwrap(), [0x17]);
        assert_eq!(encode(Value::Integer(24.into())).unwrap(), [0x18, 0x18]);
        assert_eq!(encode(Value::Integer(1000.into())).unwrap(), [0x19, 0x03, 0xe8]);
        assert_eq!(encode(Value::Integer(1_000_000.into())).unwrap(), [0x1a, 0x00, 0x0f, 0x42, 0x40]);
        assert_eq!(encode(Value::Integer((-1).into())).unwrap(), [0x20]);
        // Keys sort by their encoded bytes: shorter text first, then bytewise.
        let map = Value::Map(vec![(text("bb"), Value::Null), (text("c"), Value::Null), (text("a"), Value::Null)]);
        assert_eq!(encode(map).unwrap(), [0xa3, 0x61, b'a', 0xf6, 0x61, b'c', 0xf6, 0x62, b'b', b'b', 0xf6]);
    }

    #[test]
    fn text_key_fast_path_matches_encoded_order() {
        // Keys of lengths around the 23/24 head boundary and with shared prefixes.
        let mut keys: Vec<String> = Vec::new();
        for len in [0usize, 1, 2, 22, 23, 24, 25, 255, 256] {
            for c in ['a', 'b', 'z'] {
                keys.push(std::iter::repeat_n(c, len).collect());
            }
        }
        keys.sort();
        keys.dedup();
        let mut by_fast: Vec<Value> = keys.iter().map(|k| text(k)).collect();
        by_fast.sort_by(text_key_order);
        let mut by_encoding: Vec<(Vec<u8>, Value)> = keys.iter().map(|k| (encode_raw(&text(k)).unwrap(), text(k))).collect();
        by_encoding.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(by_fast, by_encoding.into_iter().map(|(_, v)| v).collect::<Vec<_>>());
    }

    #[test]
    fn rejects_non_canonical_bytes() {
        // 24 encoded in two bytes where one would do... reversed: 0 in two bytes.
        assert!(decode_canonical(&[0x18, 0x00]).is_err());
        // Unsorted map.
        assert!(decode_canonical(&[0xa2, 0x61, b'b', 0xf6, 0x61, b'a', 0xf6]).is_err());
        // Indefinite-length array.
        assert!(decode_canonical(&[0x9f, 0x01, 0xff]).is_err());
        // Float.
        assert!(decode_canonical(&[0xf9, 0x3c, 0x00]).is_err());
        assert!(decode_canonical(&[0xa2, 0x61, b'a', 0xf6, 0x61, b'b', 0xf6]).is_ok());
    }

    #[test]
    fn refuses_floats_and_deep_nesting_from_json() {
        assert!(from_json(&serde_json::json!({"x": 1.5})).is_err());
        let mut deep = serde_json::json!(1);
        for _ in 0..40 {
            deep = serde_json::json!([deep]);
        }
        assert!(from_json(&deep).is_err());
        let ok = serde_json::json!({"b": [1, -2, "x", true, null], "a": {"z": 18446744073709551615u64}});
        let cbor = from_json(&ok).unwrap();
        assert_eq!(to_json(&canonicalize(cbor).unwrap()), ok);
    }
}
