//! Field validators, and the JSON schemas of the constrained values they enforce.
//!
//! Every rule a validator here enforces is also stated by the schema of the same name (a
//! pattern, a length, a range), so the OpenAPI document says exactly what the server takes: a
//! unit test checks the patterns against the validators, and the schemathesis run holds the two
//! together from outside. The schemas' names are the document's component names.

use std::collections::BTreeMap;

use bc_core::id::truncate;
use bc_core::{Error, Result};
use schemars::json_schema;

use super::paging::LIST_LIMIT_MAX;

/// Bounds on user-provided names and labels.
pub const NAME_CHARS_MAX: usize = 63;
pub const DESCRIPTION_CHARS_MAX: usize = 1024;
pub const LABELS_MAX: usize = 64;
pub const LABEL_KEY_CHARS_MAX: usize = 63;
pub const LABEL_VALUE_CHARS_MAX: usize = 255;

/// A name: 1 to 63 characters of lowercase letters, digits, `-`, `.` and `_`, starting with a
/// letter or digit ([`NameText`]).
pub fn validate_name(field: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.chars().count() <= NAME_CHARS_MAX
        && name.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | '_'));
    if !ok {
        return Err(Error::InvalidArgument {
            message: format!("{field} {:?} is not a valid name", truncate(name, 70)),
            hint: Some(format!("1 to {NAME_CHARS_MAX} of a-z 0-9 - . _, starting with a letter or digit")),
        });
    }
    Ok(())
}

/// Free text: at most `chars_max` characters, no control characters but newline and tab
/// ([`DescriptionText`]).
pub fn validate_text(field: &str, text: &str, chars_max: usize) -> Result<()> {
    if text.chars().count() > chars_max {
        return Err(Error::invalid(format!("{field} is longer than {chars_max} characters")));
    }
    if text.chars().any(|c| c.is_control() && c != '\n' && c != '\t') {
        return Err(Error::invalid(format!("{field} contains control characters")));
    }
    Ok(())
}

/// A label key: 1 to 63 of `A-Z a-z 0-9 - . _ /`.
pub fn validate_label_key(key: &str) -> Result<()> {
    let ok = !key.is_empty()
        && key.len() <= LABEL_KEY_CHARS_MAX
        && key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '/'));
    if !ok {
        return Err(Error::invalid(format!(
            "label key {:?} must be 1 to {LABEL_KEY_CHARS_MAX} of A-Z a-z 0-9 - . _ /",
            truncate(key, 70)
        )));
    }
    Ok(())
}

/// Labels ([`LabelsMap`]): at most 64, keys as [`validate_label_key`], values free text of at
/// most 255 characters.
pub fn validate_labels(labels: &BTreeMap<String, String>) -> Result<()> {
    if labels.len() > LABELS_MAX {
        return Err(Error::invalid(format!("at most {LABELS_MAX} labels")));
    }
    for (key, value) in labels {
        validate_label_key(key)?;
        validate_text(&format!("label {key}"), value, LABEL_VALUE_CHARS_MAX)?;
    }
    Ok(())
}

/// Crockford base 32 as ULIDs spell it (either case; no I, L, O or U), the first character at
/// most 7 so that the 128 bits do not overflow.
pub(crate) const ULID_PATTERN: &str = "[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}";
/// The characters `is_control` refuses, but newline and tab.
pub(crate) const TEXT_PATTERN: &str = "^[^\\u0000-\\u0008\\u000B-\\u001F\\u007F-\\u009F]*$";

/// Declares a schema-only type for a constrained value, named in the document's components:
/// `string_schema!(NameText, json_schema!({…}))`, or with another component name and the
/// generator in hand, `string_schema!(GpuNameText as "GpuName", |g| …)`.
macro_rules! string_schema {
    ($(#[$doc:meta])* $name:ident, $schema:expr) => {
        $crate::api::validate::string_schema!($(#[$doc])* $name as stringify!($name), |_| $schema);
    };
    ($(#[$doc:meta])* $name:ident as $component:expr, |$generator:pat_param| $schema:expr) => {
        $(#[$doc])*
        pub struct $name;
        impl ::schemars::JsonSchema for $name {
            fn schema_name() -> ::std::borrow::Cow<'static, str> {
                $component.into()
            }
            fn json_schema($generator: &mut ::schemars::SchemaGenerator) -> ::schemars::Schema {
                $schema
            }
        }
    };
}
pub(crate) use string_schema;

macro_rules! id_schema {
    ($(#[$doc:meta])* $name:ident, $id:ty) => {
        string_schema!($(#[$doc])* $name, json_schema!({
            "type": "string",
            "pattern": format!("^{}_{ULID_PATTERN}$", <$id>::PREFIX),
            "description": format!("{}_ followed by a 26-character ULID", <$id>::PREFIX),
        }));
    };
}

id_schema!(/// `ten_…`
    TenantIdText, bc_core::id::TenantId);
id_schema!(/// `pool_…`
    PoolIdText, bc_core::id::PoolId);
id_schema!(/// `node_…`
    NodeIdText, bc_core::id::NodeId);
id_schema!(/// `rsv_…`
    ReservationIdText, bc_core::id::ReservationId);
id_schema!(/// `key_…`
    ApiKeyIdText, bc_core::id::ApiKeyId);
id_schema!(/// `wh_…`
    WebhookIdText, bc_core::id::WebhookId);
id_schema!(/// `evt_…`
    EventIdText, bc_core::id::EventId);
id_schema!(/// `jt_…`
    JoinTokenIdText, bc_core::id::JoinTokenId);
id_schema!(/// `jreq_…`
    JoinRequestIdText, bc_core::id::JoinRequestId);
id_schema!(/// `cmd_…`
    CommandIdText, bc_core::id::CommandId);
id_schema!(/// `flv_…`
    FlavorIdText, bc_core::id::FlavorId);
id_schema!(/// `img_…`
    ImageIdText, bc_core::id::ImageId);
id_schema!(/// `inst_…`
    InstanceIdText, bc_core::id::InstanceId);
id_schema!(/// `wf_…`
    WorkflowIdText, bc_core::id::WorkflowId);
id_schema!(/// `sbx_…`
    SandboxIdText, bc_core::id::SandboxId);
id_schema!(/// `sbxt_…`
    SandboxTemplateIdText, bc_core::id::SandboxTemplateId);
id_schema!(/// `vol_…`
    SandboxVolumeIdText, bc_core::id::SandboxVolumeId);
id_schema!(/// `snap_…`
    SandboxSnapshotIdText, bc_core::id::SandboxSnapshotId);
id_schema!(/// `rel_…`
    ReleaseIdText, bc_core::id::ReleaseId);
id_schema!(/// `ro_…`
    RolloutIdText, bc_core::id::RolloutId);
id_schema!(/// `batch_…`
    CommandBatchIdText, bc_core::id::CommandBatchId);
id_schema!(/// `site_…`
    SiteIdText, bc_core::id::SiteId);
id_schema!(/// `proj_…`
    ProjectIdText, bc_core::id::ProjectId);

string_schema!(/// A name ([`validate_name`]).
NameText, json_schema!({
    "type": "string",
    "pattern": "^[a-z0-9][a-z0-9._-]{0,62}$",
    "description": "1 to 63 of a-z 0-9 - . _, starting with a letter or digit",
}));
string_schema!(/// A description ([`validate_text`] with `DESCRIPTION_CHARS_MAX`).
DescriptionText, json_schema!({
    "type": "string",
    "maxLength": DESCRIPTION_CHARS_MAX,
    "pattern": TEXT_PATTERN,
}));
string_schema!(/// A label key ([`validate_label_key`]).
    LabelKeyText, json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9._/-]{1,63}$" }));
string_schema!(/// Labels ([`validate_labels`]).
LabelsMap, json_schema!({
    "type": "object",
    "maxProperties": LABELS_MAX,
    "propertyNames": { "pattern": "^[A-Za-z0-9._/-]{1,63}$" },
    "additionalProperties": { "type": "string", "maxLength": LABEL_VALUE_CHARS_MAX, "pattern": TEXT_PATTERN },
}));
string_schema!(/// A list cursor: the last row id of the page before.
    CursorText, json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9_]{1,64}$" }));
string_schema!(/// An outbox position, `COMMIT.INDEX`.
    PositionText, json_schema!({ "type": "string", "pattern": "^[0-9]{1,18}[.:][0-9]{1,9}$" }));
string_schema!(/// A list's `limit`.
    LimitNumber, json_schema!({ "type": "integer", "minimum": 1, "maximum": LIST_LIMIT_MAX }));
string_schema!(/// A stream version for `ifVersion`: what the caller read.
    VersionNumber, json_schema!({ "type": "integer", "minimum": 0, "maximum": i64::MAX }));
string_schema!(/// A time in milliseconds since the Unix epoch.
    TimeMs, json_schema!({ "type": "integer", "minimum": 0 }));

#[cfg(test)]
mod tests {
    use schemars::{JsonSchema, Schema, SchemaGenerator};

    use super::*;

    /// The patterns say what the validators do: checked on a sample of accepted and refused
    /// strings with a real regex engine.
    #[test]
    fn string_schemas_agree_with_the_validators() {
        let pattern = |schema: Schema| regex::Regex::new(schema.get("pattern").unwrap().as_str().unwrap()).unwrap();
        let mut g = SchemaGenerator::default();
        let name = pattern(NameText::json_schema(&mut g));
        for text in ["a", "gpu-a", "0", "a.b_c-d", &"a".repeat(63), "A", "-a", "", "a b", &"a".repeat(64), "é"] {
            assert_eq!(name.is_match(text), validate_name("name", text).is_ok(), "{text:?}");
        }
        let key = pattern(LabelKeyText::json_schema(&mut g));
        for text in ["a", "A/b.c_d-e", &"k".repeat(63), "", &"k".repeat(64), "a b", "a:b"] {
            assert_eq!(key.is_match(text), validate_label_key(text).is_ok(), "{text:?}");
        }
        let text_ok = regex::Regex::new(TEXT_PATTERN).unwrap();
        for text in ["plain", "two\nlines\tand tab", "\u{7}", "\u{85}", "\u{7f}", "ünïcode"] {
            assert_eq!(text_ok.is_match(text), validate_text("t", text, 100).is_ok(), "{text:?}");
        }
        let pool = pattern(PoolIdText::json_schema(&mut g));
        let id = bc_core::id::PoolId::generate().to_string();
        for text in [id.clone(), id.to_uppercase().replace("POOL_", "pool_"), format!("pool_{}", "8".repeat(26)), "pool_x".into()]
        {
            assert_eq!(pool.is_match(&text), text.parse::<bc_core::id::PoolId>().is_ok(), "{text:?}");
        }
    }
}
