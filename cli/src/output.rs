//! Printing results: `--format json|compact|table`, `--query PATH`, and terminal safety.
//!
//! Results carry the server's words (names, messages), so nothing printed may move the cursor
//! or change the terminal: JSON escapes DEL, the C1 controls and U+2028/U+2029 as well as what
//! JSON itself escapes; raw strings and table cells have their control characters replaced.

use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Json,
    Compact,
    Table,
}

/// Selects part of a result: `a.b`, `items[].id` (every element), `items[0].id`.
pub fn query(value: &Value, path: &str) -> Result<Value, String> {
    let mut current = vec![value.clone()];
    let mut mapped = false;
    for segment in path.split('.').filter(|s| !s.is_empty()) {
        let (name, index) = match segment.find('[') {
            Some(at) if segment.ends_with(']') => (&segment[..at], Some(&segment[at + 1..segment.len() - 1])),
            Some(_) => return Err(format!("malformed query segment {segment:?}")),
            None => (segment, None),
        };
        let mut next = Vec::new();
        for v in current {
            let v = if name.is_empty() { v } else { v.get(name).cloned().unwrap_or(Value::Null) };
            match index {
                None => next.push(v),
                Some("") => {
                    mapped = true;
                    next.extend(v.as_array().cloned().unwrap_or_default());
                }
                Some(i) => {
                    let i: usize = i.parse().map_err(|_| format!("malformed index in {segment:?}"))?;
                    next.push(v.get(i).cloned().unwrap_or(Value::Null));
                }
            }
        }
        current = next;
    }
    Ok(if mapped { Value::Array(current) } else { current.into_iter().next().unwrap_or(Value::Null) })
}

/// JSON with the terminal-unsafe characters that JSON leaves alone escaped too.
pub fn safe_json(value: &Value, pretty: bool) -> String {
    let text = if pretty { serde_json::to_string_pretty(value) } else { serde_json::to_string(value) }.unwrap_or_default();
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\u{7f}'..='\u{9f}' | '\u{2028}' | '\u{2029}' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// A failure as printed on stderr: `CODE: message`, with `debug` a `caused by: …` line per cause
/// (the chain under the message, outermost first), then `hint: …` when there is one.
pub fn error_text(e: &crate::client::CliError, debug: bool) -> String {
    let mut text = format!("{}: {}\n", e.code, safe_text(&e.message));
    if debug {
        for cause in &e.causes {
            text.push_str(&format!("  caused by: {}\n", safe_text(cause)));
        }
    }
    if let Some(hint) = &e.hint {
        text.push_str(&format!("hint: {}\n", safe_text(hint)));
    }
    text
}

/// A raw string with control characters turned into spaces (line breaks and tabs stay).
pub fn safe_text(text: &str) -> String {
    text.chars()
        .map(|c| if (c.is_control() && c != '\n' && c != '\t') || c == '\u{2028}' || c == '\u{2029}' { ' ' } else { c })
        .collect()
}

/// One line, no control characters: for table cells.
pub fn cell(value: &Value) -> String {
    let text = match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        Value::Array(items) if items.iter().all(|i| !i.is_object() && !i.is_array()) => {
            items.iter().map(|i| i.as_str().map(str::to_owned).unwrap_or_else(|| i.to_string())).collect::<Vec<_>>().join(",")
        }
        other => other.to_string(),
    };
    text.chars().map(|c| if c.is_control() || c == '\u{2028}' || c == '\u{2029}' { ' ' } else { c }).collect()
}

fn table(value: &Value) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    let (rows, more) = match value {
        Value::Object(map) if map.get("items").is_some_and(Value::is_array) => (
            map["items"].as_array().cloned().unwrap_or_default(),
            map.get("nextCursor").and_then(Value::as_str).map(str::to_owned),
        ),
        Value::Array(items) => (items.clone(), None),
        Value::Object(map) => {
            table.set_header(["FIELD", "VALUE"]);
            for (k, v) in map {
                table.add_row([cell(&Value::String(k.clone())), cell(v)]);
            }
            return table.to_string();
        }
        other => return safe_text(&cell(other)),
    };
    // Columns: the scalar fields of the rows, in first-seen order.
    let mut columns: Vec<String> = Vec::new();
    for row in &rows {
        if let Value::Object(map) = row {
            for (k, v) in map {
                if !v.is_object() && !columns.contains(k) {
                    columns.push(k.clone());
                }
            }
        }
    }
    if columns.is_empty() {
        table.set_header(["VALUE"]);
        for row in &rows {
            table.add_row([cell(row)]);
        }
    } else {
        table.set_header(columns.iter().map(|c| c.to_uppercase()));
        for row in &rows {
            table.add_row(columns.iter().map(|c| cell(row.get(c).unwrap_or(&Value::Null))));
        }
    }
    finish(table, rows.is_empty(), more)
}

/// The footer every list table ends with: `(no rows)`, or the cursor of the next page.
fn finish(table: comfy_table::Table, empty: bool, more: Option<String>) -> String {
    let mut out = table.to_string();
    if empty {
        out.push_str("\n(no rows)");
    }
    if let Some(cursor) = more {
        out.push_str(&format!("\n(more rows: --cursor {})", safe_text(&cursor)));
    }
    out
}

/// One column of a list table: its header, and its cell computed from a row and the time now
/// (milliseconds since the Unix epoch), so ages and ends can be shown relative to it.
pub struct Column {
    pub header: &'static str,
    pub cell: fn(&Value, i64) -> String,
}

/// A page (`{ items, nextCursor }`) or an array as a table with chosen columns.
pub fn table_of(value: &Value, columns: &[Column], now_ms: i64) -> String {
    let (rows, more) = match value {
        Value::Object(map) => (
            map.get("items").and_then(Value::as_array).cloned().unwrap_or_default(),
            map.get("nextCursor").and_then(Value::as_str).map(str::to_owned),
        ),
        Value::Array(items) => (items.clone(), None),
        other => return safe_text(&cell(other)),
    };
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header(columns.iter().map(|c| c.header));
    for row in &rows {
        table.add_row(columns.iter().map(|c| cell(&Value::String((c.cell)(row, now_ms)))));
    }
    finish(table, rows.is_empty(), more)
}

/// Prints one result and a line break on standard output. A closed pipe (`| head -1`) is not a
/// failure: the reader has what it wanted.
pub fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.write_all(b"\n")).and_then(|()| out.flush());
}

pub fn render(value: &Value, format: Format, query_path: Option<&str>) -> Result<String, String> {
    let value = match query_path {
        Some(path) => query(value, path)?,
        None => value.clone(),
    };
    if let Value::String(s) = &value {
        return Ok(safe_text(s));
    }
    Ok(match format {
        Format::Json => safe_json(&value, true),
        Format::Compact => safe_json(&value, false),
        Format::Table => table(&value),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn queries() {
        let v = json!({"items": [{"id": "a"}, {"id": "b"}], "n": {"m": 1}});
        assert_eq!(query(&v, "items[].id").unwrap(), json!(["a", "b"]));
        assert_eq!(query(&v, "items[1].id").unwrap(), json!("b"));
        assert_eq!(query(&v, "n.m").unwrap(), json!(1));
        assert!(query(&v, "items[x").is_err());
    }

    #[test]
    fn terminal_safety() {
        let v = json!({"name": "a\u{7f}b\u{9b}c\u{2028}d\u{1b}[31m"});
        let out = safe_json(&v, false);
        assert!(!out.chars().any(|c| c.is_control() || c == '\u{2028}'), "{out:?}");
        assert!(out.contains("\\u007f") && out.contains("\\u009b") && out.contains("\\u2028") && out.contains("\\u001b"));
        assert_eq!(render(&v, Format::Json, Some("name")).unwrap(), "a b c d [31m");
        let t = render(&json!({"items": [{"name": "x\ny\u{1b}"}], "nextCursor": "pool_1"}), Format::Table, None).unwrap();
        assert!(t.contains("x y") && t.contains("(more rows: --cursor pool_1)"), "{t}");
    }

    #[test]
    fn a_failure_prints_its_causes_only_when_asked() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused\u{1b}[2J");
        let e = crate::client::CliError::new("UNAVAILABLE", "cannot reach it").hint("start it").caused_by(&io);
        assert_eq!(error_text(&e, false), "UNAVAILABLE: cannot reach it\nhint: start it\n");
        assert_eq!(error_text(&e, true), "UNAVAILABLE: cannot reach it\n  caused by: refused [2J\nhint: start it\n");
    }
}
