//! `api GROUP.METHOD [ITEM…]`: any method, its body built from items and `--data`; `api --list`.
//!
//! The items, as in the reference CLI:
//!
//! | Item                      | Sets                                   |
//! | ------------------------- | -------------------------------------- |
//! | `name=gpu-a`              | a string                               |
//! | `limit:=10`               | a JSON value                           |
//! | `spec:=@spec.json`        | a JSON value read from a file          |
//! | `notes=@notes.md`         | a string read from a file              |
//! | `resource.type=pool`      | a nested field                         |
//! | `ids[]=a`                 | an item appended to an array           |
//! | `--data JSON`, `--data @file.json`, `--data -` | the whole body, from the argument, a file or standard input |
//!
//! The forms combine (`spec.ids[]:=3`, `a.b=@file.txt`); `\@` at the start of a value is a
//! literal `@`. Items apply after `--data`, in order. A malformed item is a usage error (exit 2)
//! before anything is sent.
//!
//! [`methods`] is the one place the CLI reads the gateway's method table.

use std::io::Read;
use std::path::Path;

use clap::Args;
use serde_json::{Map, Value, json};

use crate::client::CliError;
use crate::output::Format;
use crate::tables;

use super::{Context, nearest};

#[derive(Args)]
pub struct ApiArgs {
    /// GROUP.METHOD (with --list: a group, `reservations`, to list only its methods).
    pub method: Option<String>,
    /// Body fields: `k=v` (a string), `k:=json`, `a.b=v` (nested), `ids[]=x` (appended),
    /// `k=@file.txt` (a string from a file), `k:=@file.json` (JSON from a file).
    pub items: Vec<String>,
    /// The whole body: JSON, `@file.json`, or `-` to read it from standard input.
    #[arg(long)]
    pub data: Option<String>,
    /// Idempotency key to send.
    #[arg(long)]
    pub key: Option<String>,
    /// List the methods.
    #[arg(long)]
    pub list: bool,
}

/// The largest file an item or `--data` reads (the server takes bodies up to 1 MiB).
pub const FILE_BYTES_MAX: u64 = 1024 * 1024;

/// One API method as the CLI sees it: name, IAM action (`None`: public), summary.
pub struct MethodInfo {
    pub name: &'static str,
    pub action: Option<&'static str>,
    pub summary: &'static str,
}

/// Every API method. The only use of the gateway's method table in the CLI: when the table
/// moves, this function is the one line that follows it.
pub fn methods() -> impl Iterator<Item = MethodInfo> {
    bc_gateway::api::table().iter().map(|m| MethodInfo { name: m.name, action: m.access.action(), summary: m.summary })
}

pub async fn run(ctx: &Context, args: ApiArgs) -> Result<(), CliError> {
    if args.list {
        return list(ctx, args.method.as_deref());
    }
    let method = args.method.as_deref().ok_or_else(|| CliError::usage("give GROUP.METHOD, or --list"))?;
    if !methods().any(|m| m.name == method) {
        let hint = match nearest(method, methods().map(|m| m.name)) {
            Some(best) => format!("did you mean {best}? (api --list shows them all)"),
            None => "api --list shows every method".to_owned(),
        };
        return Err(CliError::usage(format!("unknown method {method:?}")).hint(hint));
    }
    let mut body = body(&args.items, args.data.as_deref(), &mut std::io::stdin().lock())?;
    if let (Some(t), Value::Object(map)) = (&ctx.global.tenant, &mut body) {
        map.entry("tenantId").or_insert_with(|| Value::String(t.clone()));
    }
    let value = ctx.client()?.call(method, &body, args.key.as_deref()).await?;
    match (ctx.global.format, tables::for_method(method)) {
        (Some(Format::Table), Some(columns)) => ctx.print_list(&value, columns),
        _ => ctx.print(&value, Format::Json),
    }
}

/// `api --list [GROUP]`: the methods, or one group's.
fn list(ctx: &Context, group: Option<&str>) -> Result<(), CliError> {
    let in_group = |name: &str| group.is_none_or(|g| name.split_once('.').is_some_and(|(prefix, _)| prefix == g));
    let items: Vec<Value> = methods()
        .filter(|m| in_group(m.name))
        .map(|m| json!({ "method": m.name, "action": m.action.unwrap_or("(public)"), "summary": m.summary }))
        .collect();
    if let (Some(group), true) = (group, items.is_empty()) {
        let groups: Vec<&str> = methods().filter_map(|m| m.name.split_once('.').map(|(g, _)| g)).collect();
        let hint = match nearest(group, groups.into_iter()) {
            Some(best) => format!("did you mean {best}? (api --list shows every method)"),
            None => "api --list shows every method".to_owned(),
        };
        return Err(CliError::usage(format!("no method group {group:?}")).hint(hint));
    }
    ctx.print_list(&json!({ "items": items }), tables::METHODS)
}

/// The request body: `--data` (an object), then every item applied to it in order.
pub fn body(items: &[String], data: Option<&str>, stdin: &mut dyn Read) -> Result<Value, CliError> {
    let mut body = match data {
        None => Map::new(),
        Some(text) => {
            let (what, text) = match text {
                "-" => ("--data - (standard input)".to_owned(), read_bounded(stdin, "standard input")?),
                _ => match text.strip_prefix('@') {
                    Some(path) => (format!("--data @{path}"), read_file(Path::new(path))?),
                    None => ("--data".to_owned(), text.to_owned()),
                },
            };
            match serde_json::from_str(&text) {
                Ok(Value::Object(map)) => map,
                Ok(_) => return Err(CliError::usage(format!("{what} must be a JSON object"))),
                Err(e) => return Err(CliError::usage(format!("{what} is not JSON: {e}"))),
            }
        }
    };
    for text in items {
        let item = Item::parse(text)?;
        item.apply(&mut body).map_err(|e| CliError::usage(format!("item {text:?}: {e}")))?;
    }
    Ok(Value::Object(body))
}

/// One parsed item: the path of the field it sets, whether it appends, and the value.
#[derive(Debug, PartialEq)]
pub struct Item {
    pub path: Vec<String>,
    pub append: bool,
    pub value: Value,
}

impl Item {
    pub fn parse(text: &str) -> Result<Item, CliError> {
        let bad = |why: String| {
            CliError::usage(format!("item {text:?}: {why}"))
                .hint("items are k=v (a string), k:=json, a.b=v (nested), ids[]=v (appended), k=@file.txt, k:=@file.json")
        };
        // The key ends at the first `=`; `:=` before it makes the value JSON.
        let at = text.find('=').ok_or_else(|| bad("no = in it".into()))?;
        let (key, json_value) = match text[..at].strip_suffix(':') {
            Some(key) => (key, true),
            None => (&text[..at], false),
        };
        let raw = &text[at + 1..];
        let (key, append) = match key.strip_suffix("[]") {
            Some(key) => (key, true),
            None => (key, false),
        };
        if key.is_empty() {
            return Err(bad("the key is empty".into()));
        }
        let path: Vec<String> = key.split('.').map(str::to_owned).collect();
        if let Some(segment) = path.iter().find(|s| s.is_empty() || s.contains(['[', ']'])) {
            return Err(bad(if segment.is_empty() {
                "a key segment is empty (a..b, .a or a.)".into()
            } else {
                format!("{segment:?}: only the last segment may end in [] (append)")
            }));
        }
        let text_value = match raw.strip_prefix('@') {
            Some(path) => read_file(Path::new(path)).map_err(|e| bad(e.message))?,
            None => raw.strip_prefix("\\@").map(|rest| format!("@{rest}")).unwrap_or_else(|| raw.to_owned()),
        };
        let value = if json_value {
            serde_json::from_str(&text_value).map_err(|e| bad(format!("the value after := is not JSON: {e}")))?
        } else {
            Value::String(text_value)
        };
        Ok(Item { path, append, value })
    }

    /// Sets (or appends) the value in `body`, making the objects on the way.
    pub fn apply(self, body: &mut Map<String, Value>) -> Result<(), String> {
        let (last, parents) = self.path.split_last().expect("a path has a segment");
        let mut here = body;
        let mut walked = String::new();
        for segment in parents {
            walked = if walked.is_empty() { segment.clone() } else { format!("{walked}.{segment}") };
            let next = here.entry(segment.clone()).or_insert_with(|| Value::Object(Map::new()));
            if !next.is_object() {
                return Err(format!("{walked} is already {}, not an object", kind(next)));
            }
            here = next.as_object_mut().expect("checked: an object");
        }
        if self.append {
            let array = here.entry(last.clone()).or_insert_with(|| Value::Array(Vec::new()));
            let Value::Array(items) = array else {
                return Err(format!("{} is already {}, not an array", self.path.join("."), kind(array)));
            };
            items.push(self.value);
        } else {
            here.insert(last.clone(), self.value);
        }
        Ok(())
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn read_file(path: &Path) -> Result<String, CliError> {
    let file = std::fs::File::open(path).map_err(|e| CliError::usage(format!("cannot read {}: {e}", path.display())))?;
    read_bounded(&mut std::io::BufReader::new(file), &path.display().to_string())
}

/// Reads at most [`FILE_BYTES_MAX`] bytes of UTF-8; more is a usage error.
fn read_bounded(input: &mut dyn Read, what: &str) -> Result<String, CliError> {
    let mut bytes = Vec::new();
    input.take(FILE_BYTES_MAX + 1).read_to_end(&mut bytes).map_err(|e| CliError::usage(format!("cannot read {what}: {e}")))?;
    if bytes.len() as u64 > FILE_BYTES_MAX {
        return Err(CliError::usage(format!("{what} is larger than {} KiB", FILE_BYTES_MAX / 1024)));
    }
    String::from_utf8(bytes).map_err(|_| CliError::usage(format!("{what} is not UTF-8 text")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(items: &[&str]) -> Result<Value, CliError> {
        let items: Vec<String> = items.iter().map(|s| s.to_string()).collect();
        body(&items, None, &mut std::io::empty())
    }

    #[test]
    fn every_item_form() {
        let dir = tempfile::tempdir().unwrap();
        let json_file = dir.path().join("spec.json");
        std::fs::write(&json_file, r#"{"a": [1, 2]}"#).unwrap();
        let text_file = dir.path().join("notes.md");
        std::fs::write(&text_file, "line one\nline two\n").unwrap();
        let spec = format!("spec:=@{}", json_file.display());
        let notes = format!("notes=@{}", text_file.display());
        let body = build(&[
            "name=gpu-a",
            "limit:=10",
            r#"labels:=["a","b"]"#,
            &spec,
            &notes,
            "resource.type=pool",
            "resource.count:=2",
            "ids[]=a",
            "ids[]=b",
            "nums[]:=3",
            "url=https://x.example/?a=b:=c",
            r"handle=\@me",
            "empty=",
        ])
        .unwrap();
        assert_eq!(
            body,
            json!({
                "name": "gpu-a", "limit": 10, "labels": ["a", "b"], "spec": { "a": [1, 2] },
                "notes": "line one\nline two\n", "resource": { "type": "pool", "count": 2 },
                "ids": ["a", "b"], "nums": [3], "url": "https://x.example/?a=b:=c", "handle": "@me", "empty": "",
            })
        );
    }

    #[test]
    fn data_then_items() {
        let items = vec!["b=2".to_owned(), "c.d[]=x".to_owned()];
        let mut stdin: &[u8] = br#"{"a": 1, "b": "one"}"#;
        let body = body(&items, Some("-"), &mut stdin).unwrap();
        assert_eq!(body, json!({ "a": 1, "b": "2", "c": { "d": ["x"] } }));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("body.json");
        std::fs::write(&file, r#"{"z": true}"#).unwrap();
        let from_file = super::body(&[], Some(&format!("@{}", file.display())), &mut std::io::empty()).unwrap();
        assert_eq!(from_file, json!({ "z": true }));
        assert_eq!(super::body(&[], Some(r#"{"y":1}"#), &mut std::io::empty()).unwrap(), json!({ "y": 1 }));
    }

    #[test]
    fn bad_items_are_usage_errors() {
        for (items, needle) in [
            (vec!["novalue"], "no = in it"),
            (vec!["=v"], "the key is empty"),
            (vec![":=1"], "the key is empty"),
            (vec!["a..b=v"], "segment is empty"),
            (vec!["a[].b=v"], "only the last segment"),
            (vec!["n:=nope"], "not JSON"),
            (vec!["f=@/nonexistent/bc-cli-test"], "cannot read"),
            (vec!["a=1", "a.b=2"], "a is already a string, not an object"),
            (vec!["a:=1", "a[]=2"], "a is already a number, not an array"),
        ] {
            let e = build(&items).unwrap_err();
            assert_eq!(e.exit_status(), 2, "{items:?}");
            assert!(e.message.contains(needle), "{items:?}: {}", e.message);
        }
        let mut stdin: &[u8] = b"[1]";
        assert!(body(&[], Some("-"), &mut stdin).unwrap_err().message.contains("must be a JSON object"));
        let mut big = std::io::repeat(b' ').take(FILE_BYTES_MAX + 10);
        assert!(body(&[], Some("-"), &mut big).unwrap_err().message.contains("larger than"));
    }

    #[test]
    fn suggestions() {
        assert_eq!(nearest("pools.lst", methods().map(|m| m.name)), Some("pools.list"));
        assert_eq!(nearest("zzzzzzz", methods().map(|m| m.name)), None);
        assert!(methods().any(|m| m.name == "events.get"));
    }
}
