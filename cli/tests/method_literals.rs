//! The CLI names methods as text (`"pools.list"`) where it calls them; every such name must be a
//! method of the gateway's table, so a method renamed or removed there fails here, not at a
//! user's prompt. A literal counts as a method name when its part before the dot is one of the
//! table's groups (so `"c.pem"` is not one). Unit tests (after `#[cfg(test)]`) are not read.

use std::collections::BTreeSet;
use std::path::Path;

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `"word.word"` string literal of `source` (ASCII letters, the first of each lowercase).
fn dotted_literals(source: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (i, _) in source.match_indices('"') {
        let rest = &source[i + 1..];
        let Some(end) = rest.find('"') else { break };
        let text = &rest[..end];
        let Some((group, method)) = text.split_once('.') else { continue };
        let word =
            |w: &str| w.chars().next().is_some_and(|c| c.is_ascii_lowercase()) && w.chars().all(|c| c.is_ascii_alphabetic());
        if word(group) && word(method) {
            found.push(text.to_owned());
        }
    }
    found
}

#[test]
fn every_method_the_cli_names_is_in_the_gateways_table() {
    let table = bc_gateway::api::table();
    let groups: BTreeSet<&str> = table.iter().map(|m| m.group()).collect();
    let mut files = Vec::new();
    rust_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"), &mut files);
    let mut named = 0;
    let mut unknown = Vec::new();
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        // Unit tests may misspell a method on purpose (the suggestions' test does).
        let source = source.split("#[cfg(test)]").next().unwrap();
        for literal in dotted_literals(source) {
            let group = literal.split_once('.').unwrap().0;
            if !groups.contains(group) {
                continue;
            }
            named += 1;
            if bc_gateway::api::find(&literal).is_none() {
                unknown.push(format!("{}: {literal}", file.display()));
            }
        }
    }
    assert!(unknown.is_empty(), "the CLI names methods the gateway does not have: {unknown:#?}");
    // The scan finds what it is for: the CLI names most of the table.
    assert!(named >= table.len() / 2, "only {named} method names found in cli/src: is the scan broken?");
}

#[test]
fn a_dotted_literal_is_found_and_a_file_name_is_not_a_method() {
    let source = r#"call("pools.list", x); let f = "c.pem"; "node_…" "a.b.c""#;
    assert_eq!(dotted_literals(source), ["pools.list", "c.pem"]);
}
