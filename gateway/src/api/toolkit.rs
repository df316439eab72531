//! What every handler shares: the [`Call`], body parsing, field validators, list paging, and
//! the JSON schemas of the constrained strings the validators enforce.
//!
//! This module imports no handler. Every rule a validator here enforces is also stated by the
//! schema of the same name below (a pattern, a length, a range), so the OpenAPI document says
//! exactly what the server takes: the schemathesis run holds the two together from outside.

use std::collections::BTreeMap;

use bc_core::id::TenantId;
use bc_core::id::truncate;
use bc_core::store::{AppendRequest, AppendResult, ExpectedVersion, NewEvent, PreReadQuery, READ_ROWS_MAX, Row, RowKey};
use bc_core::{Error, Result};
use schemars::{JsonSchema, json_schema};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::AppState;
use crate::auth::Principal;

/// Rows a list method returns at most; the default is `LIST_LIMIT_DEFAULT`.
pub const LIST_LIMIT_MAX: u32 = 500;
pub const LIST_LIMIT_DEFAULT: u32 = 100;
/// Bounds on user-provided names and labels.
pub const NAME_CHARS_MAX: usize = 63;
pub const DESCRIPTION_CHARS_MAX: usize = 1024;
pub const LABELS_MAX: usize = 64;
pub const LABEL_KEY_CHARS_MAX: usize = 63;
pub const LABEL_VALUE_CHARS_MAX: usize = 255;
/// Longest list cursor (a row id).
pub const CURSOR_CHARS_MAX: usize = 64;
const _: () = assert!(LIST_LIMIT_DEFAULT <= LIST_LIMIT_MAX && LIST_LIMIT_MAX <= READ_ROWS_MAX);

/// Everything a handler needs about the call.
pub struct Call<'a> {
    pub state: &'a AppState,
    pub principal: Option<Principal>,
    pub action: &'static str,
    pub idempotency_key: Option<String>,
    /// SHA-256 of the method name and the request body, for idempotent retries.
    pub fingerprint: [u8; 32],
    pub request_id: String,
    /// The projection rows this call's appends touched, as their commits left them: what
    /// [`Call::row`] answers for those rows instead of reading them back.
    pub appended: std::sync::Mutex<Vec<(RowKey, Option<Value>)>>,
}

impl Call<'_> {
    /// Who appends: the calling key.
    pub fn actor(&self) -> String {
        self.principal.as_ref().map(|p| format!("apikey:{}", p.key_id)).unwrap_or_else(|| "system".into())
    }

    pub fn principal(&self) -> &Principal {
        self.principal.as_ref().expect("authenticated methods have a principal")
    }

    /// The tenant the call acts in (the key's own unless `tenantId` says otherwise), authorized.
    pub async fn tenant(&self, requested: &Option<String>) -> Result<TenantId> {
        let requested = requested.as_deref().map(|t| parse_id("tenantId", t)).transpose()?;
        let principal = self.principal();
        let tenant = requested.unwrap_or(principal.tenant);
        self.state.authorize_tenant(principal, self.action, tenant).await?;
        Ok(tenant)
    }

    /// Appends one event to `stream` on behalf of this call.
    pub async fn append(
        &self,
        tenant: TenantId,
        stream: String,
        expected: ExpectedVersion,
        event_type: &str,
        payload: ciborium::Value,
    ) -> Result<AppendResult> {
        self.append_guarded(tenant, stream, expected, event_type, payload, vec![]).await
    }

    /// Appends one event to `stream`, only while the `guards` streams are at their versions.
    pub async fn append_guarded(
        &self,
        tenant: TenantId,
        stream: String,
        expected: ExpectedVersion,
        event_type: &str,
        payload: ciborium::Value,
        guards: Vec<(String, ExpectedVersion)>,
    ) -> Result<AppendResult> {
        let mut request = self.request(tenant, stream, expected, vec![NewEvent::new(event_type, payload)]);
        request.guards = guards;
        self.submit(request).await
    }

    /// Appends `request` and remembers the rows its commit left, so that a handler answering
    /// with a row its append just wrote does not read it back ([`Call::row`]). They move into
    /// the call: the result handed back has none.
    pub async fn submit(&self, request: AppendRequest) -> Result<AppendResult> {
        let mut result = self.state.log.append(request).await?;
        let mut appended = self.appended.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, doc) in std::mem::take(&mut result.rows) {
            match appended.iter_mut().find(|(k, _)| *k == key) {
                Some(slot) => slot.1 = doc,
                None => appended.push((key, doc)),
            }
        }
        Ok(result)
    }

    /// An append on behalf of this call: its key, its request id, its fingerprint.
    pub fn request(&self, tenant: TenantId, stream: String, expected: ExpectedVersion, events: Vec<NewEvent>) -> AppendRequest {
        let mut request = AppendRequest::new(tenant, stream, expected, self.actor(), events);
        // Clients' keys live in their own namespace, apart from the server's own
        // (`checkpoint:…`), so a client cannot pre-empt them.
        request.idempotency_key = self.idempotency_key.as_ref().map(|k| format!("request:{k}"));
        request.correlation = Some(self.request_id.clone());
        request.fingerprint = Some(self.fingerprint);
        request
    }

    /// The append a decision asked for (`bc_projections::decide::Append`: its events, stream,
    /// expected version and guards), on behalf of this call.
    pub fn decided(&self, tenant: TenantId, append: bc_projections::decide::Append) -> AppendRequest {
        let mut request = self.request(tenant, append.stream, append.expected, append.events);
        request.guards = append.guards;
        request
    }

    /// Whether this call's idempotency key was used before in `tenant`: a retry, which the
    /// append answers from the log whatever the state says now. A check that the first
    /// request's own effect now fails (its name is taken, by itself) is skipped for a retry.
    pub async fn is_retry(&self, tenant: TenantId) -> Result<bool> {
        let Some(key) = &self.idempotency_key else { return Ok(false) };
        let query = PreReadQuery { idempotency_keys: vec![(tenant, format!("request:{key}"))], ..Default::default() };
        Ok(!self.state.store.preread(&query).await?.idempotency.is_empty())
    }

    /// Now, from the deployment's clock.
    pub fn now_ms(&self) -> u64 {
        self.state.log.clock.now_ms()
    }

    /// A fresh ULID for a new entity's id, from the deployment's id source (seeded in tests
    /// and the simulator, so the same inputs give the same ids).
    pub fn ulid(&self) -> ulid::Ulid {
        self.state.log.ids.ulid()
    }

    /// The stored document of `kind/id`, or `NOT_FOUND` naming `what`: as this call's own
    /// append left it when one touched it, else read.
    pub async fn row<T: DeserializeOwned>(&self, tenant: TenantId, kind: &str, id: &str, what: &str) -> Result<T> {
        let not_found = || Error::not_found(format!("{what} {id}"));
        let key = RowKey { tenant: tenant.to_string(), kind: kind.to_owned(), id: id.to_owned() };
        let remembered: Option<Result<T>> = {
            let appended = self.appended.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            appended.iter().find(|(k, _)| *k == key).map(|(_, doc)| match doc {
                Some(doc) => T::deserialize(doc).map_err(|e| Error::Internal(format!("projection document {kind}/{id}: {e}"))),
                None => Err(not_found()),
            })
        };
        match remembered {
            Some(answer) => answer,
            None => doc(self.state.store.row_get(&key.tenant, kind, id).await?.ok_or_else(not_found)?),
        }
    }
}

/// The version an append expects: the version the handler read and checked. A stated
/// `ifVersion` must be that same version, else `CONFLICT` before anything is appended: a request
/// checked against one version and appended at another could land on a deleted webhook or an
/// archived pool, which the projection fold then refuses inside the commit.
pub fn expected_version(if_version: Option<u64>, read: u64, stream: &str) -> Result<ExpectedVersion> {
    match if_version {
        Some(stated) if stated != read => {
            Err(Error::Conflict { stream: stream.to_owned(), expected: ExpectedVersion::Exact(stated).to_string(), actual: read })
        }
        _ => Ok(ExpectedVersion::Exact(read)),
    }
}

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
/// whose JSON encoder writes every number as a float is understood. An empty body is `{}`.
pub fn body_json(body: &[u8]) -> serde_json::Result<Value> {
    if body.iter().all(u8::is_ascii_whitespace) {
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

/// The id in a stream name (`pool/pool_…` → `pool_…`).
pub fn stream_id(stream: &str) -> &str {
    stream.split_once('/').map(|(_, id)| id).unwrap_or_default()
}

pub fn doc<T: DeserializeOwned>(row: Row) -> Result<T> {
    serde_json::from_value(row.doc).map_err(|e| Error::Internal(format!("projection document: {e}")))
}

pub fn limit(requested: Option<u32>) -> Result<u32> {
    match requested {
        None => Ok(LIST_LIMIT_DEFAULT),
        Some(n) if (1..=LIST_LIMIT_MAX).contains(&n) => Ok(n),
        Some(n) => Err(Error::invalid(format!("limit {n} is out of range 1 to {LIST_LIMIT_MAX}"))),
    }
}

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

/// One page of a list: `nextCursor` is set while rows remain.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "{T}Page")]
pub struct Page<T> {
    pub items: Vec<T>,
    #[schemars(with = "Option<CursorText>")]
    pub next_cursor: Option<String>,
}

/// Pages through one kind of row by id. `view` may drop a row (a filter) by returning `None`;
/// filtered pages can come back short, and `nextCursor` is set while rows remain.
pub async fn list_rows<T>(
    call: &Call<'_>,
    tenant: TenantId,
    kind: &str,
    limit_requested: Option<u32>,
    cursor: Option<&str>,
    view: impl Fn(Row) -> Result<Option<T>>,
) -> Result<Page<T>> {
    let limit = limit(limit_requested)?;
    if let Some(cursor) = cursor
        && (cursor.is_empty()
            || cursor.len() > CURSOR_CHARS_MAX
            || !cursor.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
    {
        return Err(Error::invalid("malformed cursor"));
    }
    let rows = call.state.store.row_list(&tenant.to_string(), kind, cursor, limit + 1).await?;
    let more = rows.len() > limit as usize;
    let rows: Vec<_> = rows.into_iter().take(limit as usize).collect();
    let next_cursor = if more { rows.last().map(|r| r.key.id.clone()) } else { None };
    let mut items = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(v) = view(row)? {
            items.push(v);
        }
    }
    Ok(Page { items, next_cursor })
}

// ---- the schemas of constrained strings ----

/// Crockford base 32 as ULIDs spell it (either case; no I, L, O or U), the first character at
/// most 7 so that the 128 bits do not overflow.
const ULID_PATTERN: &str = "[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}";
/// The characters `is_control` refuses, but newline and tab.
pub(crate) const TEXT_PATTERN: &str = "^[^\\u0000-\\u0008\\u000B-\\u001F\\u007F-\\u009F]*$";

/// Declares a schema-only type for a constrained value, named in the document's components:
/// `string_schema!(NameText, json_schema!({…}))`, or with another component name and the
/// generator in hand, `string_schema!(GpuNameText as "GpuName", |g| …)`.
macro_rules! string_schema {
    ($(#[$doc:meta])* $name:ident, $schema:expr) => {
        $crate::api::toolkit::string_schema!($(#[$doc])* $name as stringify!($name), |_| $schema);
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
id_schema!(/// `rel_…`
    ReleaseIdText, bc_core::id::ReleaseId);
id_schema!(/// `ro_…`
    RolloutIdText, bc_core::id::RolloutId);

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
    use schemars::{Schema, SchemaGenerator};

    use super::*;

    /// The patterns say what the validators do: checked on a sample of accepted and refused
    /// strings with a real regex engine.
    #[test]
    fn bodies_are_objects_and_integral_floats_are_integers() {
        #[derive(serde::Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        struct Input {
            limit: Option<u32>,
        }
        assert_eq!(parse::<Input>(b"").unwrap().limit, None);
        assert_eq!(parse::<Input>(br#"{"limit": 306.0}"#).unwrap().limit, Some(306));
        assert!(parse::<Input>(br#"{"limit": 1.5}"#).is_err());
        assert!(parse::<Input>(br#"[null]"#).is_err(), "a struct is not read from an array");
        assert!(parse::<Input>(br#"{"other": 1}"#).is_err());
    }

    /// A stated `ifVersion` other than the version read is `CONFLICT`;
    /// the append always expects the version read.
    #[test]
    fn expected_version_is_the_version_read() {
        assert_eq!(expected_version(None, 3, "pool/p").unwrap(), ExpectedVersion::Exact(3));
        assert_eq!(expected_version(Some(3), 3, "pool/p").unwrap(), ExpectedVersion::Exact(3));
        for stated in [2, 4] {
            match expected_version(Some(stated), 3, "pool/p") {
                Err(Error::Conflict { stream, actual: 3, .. }) => assert_eq!(stream, "pool/p"),
                other => panic!("ifVersion {stated} at version 3: {other:?}"),
            }
        }
    }

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
