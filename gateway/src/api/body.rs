//! Request bodies in, responses out: the JSON a handler parses and the JSON it answers with.
//!
//! Every body is a JSON object (an empty body is `{}`), read the way JSON Schema reads numbers,
//! so an integral float is an integer. A field that fails to parse is named in the error.

use bc_core::{Error, Result};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// The request body as the method's input type. An empty body is `{}`; any other body must be
/// a JSON object. Numbers are read as JSON Schema reads them: `2.0` is the integer 2.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T> {
    let invalid = |e: &dyn std::fmt::Display| Error::InvalidArgument {
        message: format!("invalid request body: {e}"),
        hint: Some("send a JSON object with the method's fields".into()),
    };
    let value = body_json(body).map_err(|e| invalid(&e))?;
    if !value.is_object() {
        return Err(invalid(&"the body must be a JSON object"));
    }
    serde_json::from_value(value).map_err(|e| invalid(&e))
}

/// The body as JSON, integral numbers written as integers (`2.0` → `2`), so that a client
/// whose JSON encoder writes every number as a float is understood. An empty body (no bytes) is
/// `{}`; one of whitespace only is not JSON, and refused as any other (schemathesis sent `" "`
/// to `fleet.export`, which answered 200).
pub fn body_json(body: &[u8]) -> serde_json::Result<Value> {
    if body.is_empty() {
        return Ok(Value::Object(Default::default()));
    }
    let mut value: Value = serde_json::from_slice(body)?;
    integral_numbers(&mut value);
    Ok(value)
}

fn integral_numbers(value: &mut Value) {
    match value {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            // Exactly representable integers only: within ±2^53.
            if f.fract() == 0.0 && f.abs() <= 9_007_199_254_740_992.0 {
                *value = Value::from(f as i64);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_numbers),
        Value::Object(map) => map.values_mut().for_each(integral_numbers),
        _ => {}
    }
}

pub fn to_value<T: Serialize>(value: &T) -> Result<Value> {
    serde_json::to_value(value).map_err(|e| Error::Internal(format!("response: {e}")))
}

/// A typed id from a field, the error naming the field.
pub fn parse_id<T: std::str::FromStr<Err = Error>>(field: &str, text: &str) -> Result<T> {
    text.parse()
        .map_err(|e: Error| Error::InvalidArgument { message: format!("{field}: {e}"), hint: e.hint().map(str::to_owned) })
}

/// An optional id filter of a list, parsed as `I` (the error naming the field) and kept as the
/// text the documents' ids are compared with.
pub fn parse_filter<I: std::str::FromStr<Err = Error> + std::fmt::Display>(
    field: &str,
    text: &Option<String>,
) -> Result<Option<String>> {
    text.as_deref().map(|t| parse_id::<I>(field, t).map(|id| id.to_string())).transpose()
}
#[cfg(test)]
mod tests {
    use super::*;

    /// An empty body is `{}`, any other body an object; `306.0` is the integer 306.
    #[test]
    fn bodies_are_objects_and_integral_floats_are_integers() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        struct Input {
            limit: Option<u32>,
        }
        assert_eq!(parse::<Input>(b"").unwrap().limit, None);
        // Whitespace alone is no JSON document: refused, not read as the empty body.
        for blank in [&b" "[..], b"\n", b" \t\r\n"] {
            assert_eq!(parse::<Input>(blank).unwrap_err().code(), bc_core::ErrorCode::InvalidArgument, "{blank:?}");
        }
        assert_eq!(parse::<Input>(b" {} ").unwrap().limit, None);
        assert_eq!(parse::<Input>(br#"{"limit": 306.0}"#).unwrap().limit, Some(306));
        assert!(parse::<Input>(br#"{"limit": 1.5}"#).is_err());
        // Parsed exactly: the default parser read this as 4248819660402833.5, no integer.
        #[derive(serde::Deserialize, Debug)]
        struct Time {
            to_ms: u64,
        }
        assert_eq!(parse::<Time>(br#"{"to_ms": 4248819660402834.0}"#).unwrap().to_ms, 4_248_819_660_402_834);
        assert!(parse::<Input>(br#"[null]"#).is_err(), "a struct is not read from an array");
        assert!(parse::<Input>(br#"{"other": 1}"#).is_err());
    }
}
