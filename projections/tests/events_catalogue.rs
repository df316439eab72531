//! `schema/EVENTS.md` is the catalogue a reader re-implements the log from: its table names
//! exactly the types `EVENT_TYPES` lists, each once, so a new event type cannot land without
//! its row, and a row cannot outlive its type.

use std::collections::BTreeSet;

use bc_projections::events::EVENT_TYPES;

const CATALOGUE: &str = include_str!("../../schema/EVENTS.md");

/// The types a row's first cell names: backquoted, comma-separated; `.rest` abbreviates the
/// first type's group (`instance.start_requested`, `.stop_requested`).
fn row_types(cell: &str) -> Vec<String> {
    let mut group: Option<String> = None;
    let mut types = Vec::new();
    for quoted in cell.split('`').skip(1).step_by(2) {
        let name = match quoted.strip_prefix('.') {
            Some(rest) => format!("{}.{rest}", group.as_deref().expect("an abbreviated type follows a whole one")),
            None => {
                group = quoted.split_once('.').map(|(g, _)| g.to_owned());
                quoted.to_owned()
            }
        };
        types.push(name);
    }
    types
}

#[test]
fn the_catalogue_names_every_event_type_once_and_no_other() {
    let mut named = Vec::new();
    for line in CATALOGUE.lines().filter(|l| l.starts_with("| `")) {
        let cell = line.split('|').nth(1).unwrap();
        named.extend(row_types(cell));
    }
    let mut seen = BTreeSet::new();
    let twice: Vec<&String> = named.iter().filter(|t| !seen.insert(t.as_str())).collect();
    assert!(twice.is_empty(), "rows of schema/EVENTS.md name these types twice: {twice:?}");
    let known: BTreeSet<&str> = EVENT_TYPES.iter().copied().collect();
    let missing: Vec<&&str> = known.iter().filter(|t| !seen.contains(**t)).collect();
    let unknown: Vec<&&str> = seen.iter().filter(|t| !known.contains(**t)).collect();
    assert!(missing.is_empty(), "event types with no row in schema/EVENTS.md: {missing:?}");
    assert!(unknown.is_empty(), "rows of schema/EVENTS.md for types EVENT_TYPES does not list: {unknown:?}");
}

#[test]
fn an_abbreviated_type_takes_the_group_of_the_whole_one_before_it() {
    assert_eq!(
        row_types(" `instance.start_requested`, `.stop_requested` "),
        ["instance.start_requested", "instance.stop_requested"]
    );
    assert_eq!(row_types(" `node.ready`, `node.unreachable` "), ["node.ready", "node.unreachable"]);
}
