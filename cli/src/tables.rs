//! The columns each list prints as a table, the way kubectl chooses them (`ID STATE GPUS NODE
//! AGE ENDS`), and times shown relative to now (`5m ago`, `in 59m`).
//!
//! Only the table is shaped here: `--format json|compact` and `--query` print the raw fields of
//! the result untouched.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::output::{Column, cell};

/// `5m ago`, `in 59m`, `now`: how far `at_ms` is from `now_ms`, in one unit, rounded down.
pub fn relative(at_ms: i64, now_ms: i64) -> String {
    let delta_ms = at_ms.saturating_sub(now_ms);
    if delta_ms.unsigned_abs() < 1000 {
        return "now".into();
    }
    let span = span(delta_ms.unsigned_abs() / 1000);
    if delta_ms < 0 { format!("{span} ago") } else { format!("in {span}") }
}

/// A span of seconds in its largest sensible unit: `90s`, `59m`, `47h`, `12d`, `3y`.
pub fn span(seconds: u64) -> String {
    const MINUTE: u64 = 60;
    const HOUR: u64 = 60 * MINUTE;
    const DAY: u64 = 24 * HOUR;
    const YEAR: u64 = 365 * DAY;
    match seconds {
        s if s < 2 * MINUTE => format!("{s}s"),
        s if s < 2 * HOUR => format!("{}m", s / MINUTE),
        s if s < 2 * DAY => format!("{}h", s / HOUR),
        s if s < 2 * YEAR => format!("{}d", s / DAY),
        s => format!("{}y", s / YEAR),
    }
}

/// A field as one line of text (`-` when it is missing or null).
fn field(row: &Value, name: &str) -> String {
    match row.get(name) {
        None | Some(Value::Null) => "-".into(),
        Some(v) => cell(v),
    }
}

/// A millisecond timestamp field relative to now (`-` when it is missing or null).
fn when(row: &Value, name: &str, now_ms: i64) -> String {
    row.get(name).and_then(Value::as_i64).map(|at| relative(at, now_ms)).unwrap_or_else(|| "-".into())
}

/// `{ "a": "b", "c": "d" }` as `a=b,c=d`.
fn pairs(row: &Value, name: &str) -> String {
    let text: Vec<String> = row
        .get(name)
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={}", v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string())))
        .collect();
    if text.is_empty() { "-".into() } else { text.join(",") }
}

/// One cell per node: `2× H100-SXM5-80GB (80 GiB)`.
fn gpu_summary(node: &Value) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for gpu in node["gpus"].as_array().into_iter().flatten() {
        let label = format!("{} ({} GiB)", gpu["product"].as_str().unwrap_or("?"), gpu["vramGiB"]);
        *counts.entry(label).or_default() += 1;
    }
    let summary: Vec<String> = counts.into_iter().map(|(label, n)| format!("{n}× {label}")).collect();
    summary.join(", ")
}

pub const RESERVATIONS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "reservationId") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "GPUS", cell: |r, _| field(r, "gpus") },
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "AGE", cell: |r, now| when(r, "requestedAtMs", now) },
    // An ended reservation shows when it ended; a queued one has no end yet.
    Column {
        header: "ENDS",
        cell: |r, now| if r["endedAtMs"].is_i64() { when(r, "endedAtMs", now) } else { when(r, "endsAtMs", now) },
    },
];

pub const POOLS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "poolId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "LABELS", cell: |r, _| pairs(r, "labels") },
    Column { header: "MAX", cell: |r, _| r["maxReservationS"].as_u64().map(span).unwrap_or_else(|| "-".into()) },
    Column { header: "ARCHIVED", cell: |r, _| field(r, "archived") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const NODES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "nodeId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "GPUS", cell: |r, _| gpu_summary(r) },
    Column {
        header: "USED",
        cell: |r, _| {
            let used = r["allocations"].as_object().map(|m| m.len()).unwrap_or(0);
            format!("{used}/{}", r["gpus"].as_array().map(Vec::len).unwrap_or(0))
        },
    },
    Column { header: "POOL", cell: |r, _| field(r, "poolId") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const JOIN_TOKENS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "joinTokenId") },
    Column { header: "POOL", cell: |r, _| field(r, "poolId") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "USES", cell: |r, _| format!("{}/{}", field(r, "uses"), field(r, "usesMax")) },
    Column { header: "EXPIRES", cell: |r, now| when(r, "expiresAtMs", now) },
    Column { header: "DESCRIPTION", cell: |r, _| field(r, "description") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const JOIN_REQUESTS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "joinRequestId") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "HOSTNAME", cell: |r, _| field(r, "hostname") },
    Column { header: "GPUS", cell: |r, _| r.get("gpus").and_then(Value::as_array).map_or(0, Vec::len).to_string() },
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "REASON", cell: |r, _| field(r, "reason") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

/// Memory in its largest whole unit: `64 GiB`, `1536 MiB`.
fn mib(row: &Value, name: &str) -> String {
    match row.get(name).and_then(Value::as_u64) {
        Some(m) if m >= 1024 && m % 1024 == 0 => format!("{} GiB", m / 1024),
        Some(m) => format!("{m} MiB"),
        None => "-".into(),
    }
}

pub const FLAVORS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "flavorId") },
    Column { header: "POOL", cell: |r, _| field(r, "poolId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "VCPUS", cell: |r, _| field(r, "vcpus") },
    Column { header: "MEMORY", cell: |r, _| mib(r, "memoryMiB") },
    Column { header: "DISK", cell: |r, _| format!("{} GiB", field(r, "diskGiB")) },
    Column { header: "GPUS", cell: |r, _| field(r, "gpus") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const IMAGES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "imageId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "FORMAT", cell: |r, _| field(r, "diskFormat") },
    Column { header: "CHANNEL", cell: |r, _| field(r, "channel") },
    // The digest's first 12 hex digits, as `docker images` shows ids.
    Column { header: "SHA256", cell: |r, _| field(r, "sha256").chars().take(12).collect() },
    Column { header: "URL", cell: |r, _| field(r, "url") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const RELEASES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "releaseId") },
    Column { header: "VERSION", cell: |r, _| field(r, "releaseVersion") },
    Column { header: "KEY", cell: |r, _| field(r, "keyId") },
    Column {
        header: "ARCHES",
        cell: |r, _| {
            r["artifacts"]
                .as_array()
                .map(|a| a.iter().filter_map(|x| x["arch"].as_str()).collect::<Vec<_>>().join(","))
                .unwrap_or_default()
        },
    },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const ROLLOUTS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "rolloutId") },
    Column { header: "VERSION", cell: |r, _| field(r, "targetVersion") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column {
        header: "WAVE",
        cell: |r, _| {
            let waves = r["waves"].as_array().map_or(0, Vec::len);
            let wave = r["wave"].as_u64().unwrap_or(0) as usize;
            format!("{}/{waves}", (wave + 1).min(waves.max(1)))
        },
    },
    Column {
        header: "UPDATED",
        cell: |r, _| format!("{}/{}", r["counts"]["updated"].as_u64().unwrap_or(0), r["nodes"].as_array().map_or(0, Vec::len)),
    },
    Column { header: "FAILED", cell: |r, _| r["counts"]["failed"].as_u64().unwrap_or(0).to_string() },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const SANDBOXES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "sandboxId") },
    Column { header: "TEMPLATE", cell: |r, _| field(r, "templateId") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "WARM", cell: |r, _| field(r, "warm") },
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "ENDS", cell: |r, now| when(r, "endsAtMs", now) },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const SANDBOX_TEMPLATES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "templateId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "POOL", cell: |r, _| field(r, "poolId") },
    Column { header: "WARM-MIN", cell: |r, _| field(r, "warmMin") },
    Column { header: "MAX-TTL-S", cell: |r, _| field(r, "maxTtlS") },
    Column { header: "IMAGE", cell: |r, _| r["image"]["imageId"].as_str().unwrap_or("-").to_owned() },
];

pub const SANDBOX_VOLUMES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "volumeId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "SIZE-GIB", cell: |r, _| field(r, "sizeGiB") },
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "SANDBOX", cell: |r, _| r["attachment"]["sandboxId"].as_str().unwrap_or("-").to_owned() },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const SANDBOX_SNAPSHOTS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "snapshotId") },
    Column { header: "SANDBOX", cell: |r, _| field(r, "sandboxId") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "KEEP", cell: |r, _| field(r, "keep") },
    Column { header: "BYTES", cell: |r, _| field(r, "bytes") },
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const INSTANCES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "instanceId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "DESIRED", cell: |r, _| field(r, "desired") },
    Column { header: "OBSERVED", cell: |r, _| r["observed"]["state"].as_str().unwrap_or("-").to_owned() },
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "VCPUS", cell: |r, _| field(r, "vcpus") },
    Column { header: "MEMORY", cell: |r, _| mib(r, "memoryMiB") },
    Column { header: "GPUS", cell: |r, _| r["gpus"].as_array().map_or(0, Vec::len).to_string() },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const COMMANDS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "commandId") },
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "KIND", cell: |r, _| field(r, "kind") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "DEADLINE", cell: |r, now| when(r, "deadlineAtMs", now) },
    Column { header: "REASON", cell: |r, _| field(r, "reason") },
    Column { header: "AGE", cell: |r, now| when(r, "issuedAtMs", now) },
];

/// `inventory history`: one row per report.
pub const INVENTORY: &[Column] = &[
    Column { header: "SEQ", cell: |r, _| field(r, "seq") },
    Column { header: "REPORTED", cell: |r, now| when(r, "reportedAtMs", now) },
    Column {
        header: "GPUS",
        cell: |r, _| if r["gpus"].as_array().is_some_and(|g| !g.is_empty()) { gpu_summary(r) } else { "-".into() },
    },
    Column { header: "DRIVER", cell: |r, _| field(r, "driverVersion") },
    Column { header: "CUDA", cell: |r, _| field(r, "cudaVersion") },
    Column { header: "UNAVAILABLE", cell: |r, _| field(r, "unavailable") },
];

pub const EVENTS: &[Column] = &[
    Column { header: "POSITION", cell: |r, _| field(r, "position") },
    Column { header: "AGE", cell: |r, now| when(r, "at", now) },
    Column { header: "TYPE", cell: |r, _| field(r, "type") },
    Column { header: "STREAM", cell: |r, _| field(r, "stream") },
    Column { header: "ACTOR", cell: |r, _| field(r, "actor") },
];

pub const WEBHOOKS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "webhookId") },
    Column { header: "URL", cell: |r, _| field(r, "url") },
    Column { header: "TYPES", cell: |r, _| field(r, "eventTypes") },
    Column { header: "DESCRIPTION", cell: |r, _| field(r, "description") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const SITES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "siteId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "REGION", cell: |r, _| field(r, "region") },
    Column { header: "LABELS", cell: |r, _| pairs(r, "labels") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const PROJECTS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "projectId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "ARCHIVED", cell: |r, _| field(r, "archived") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const SECRETS: &[Column] = &[
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "VERSION", cell: |r, _| field(r, "secretVersion") },
    Column { header: "REF", cell: |r, _| field(r, "ref") },
    Column { header: "UPDATED", cell: |r, now| when(r, "updatedAtMs", now) },
];

pub const DELIVERIES: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "deliveryId") },
    Column { header: "TYPE", cell: |r, _| field(r, "type") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "ATTEMPTS", cell: |r, _| field(r, "attempts") },
    Column { header: "NEXT", cell: |r, now| when(r, "nextAtMs", now) },
    Column { header: "LAST ERROR", cell: |r, _| field(r, "lastError") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

/// `webhooks event-types`: the items are plain strings.
pub const EVENT_TYPES: &[Column] = &[Column { header: "TYPE", cell: |r, _| cell(r) }];

pub const API_KEYS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "keyId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "ACTIONS", cell: |r, _| field(r, "actions") },
    Column { header: "REVOKED", cell: |r, _| field(r, "revoked") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const CAPACITY: &[Column] = &[
    Column { header: "POOL", cell: |r, _| field(r, "poolId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "FREE", cell: |r, _| field(r, "free") },
    Column { header: "GPUS", cell: |r, _| field(r, "gpus") },
    Column { header: "RESERVED", cell: |r, _| field(r, "reserved") },
    Column { header: "QUEUED", cell: |r, _| field(r, "queued") },
    Column { header: "UNAVAILABLE", cell: |r, _| field(r, "unavailable") },
    Column {
        header: "BY PRODUCT",
        cell: |r, _| {
            let by: Vec<String> = r["byProduct"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| format!("{} {}/{}", p["product"].as_str().unwrap_or("?"), p["free"], p["gpus"]))
                .collect();
            by.join(", ")
        },
    },
];

pub const MACHINES: &[Column] = &[
    Column { header: "NODE", cell: |r, _| field(r, "nodeId") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "STATE", cell: |r, _| field(r, "state") },
    Column { header: "POWER", cell: |r, _| field(r, "power") },
    Column { header: "MAINTENANCE", cell: |r, _| field(r, "maintenance") },
    Column { header: "LAST ERROR", cell: |r, _| field(r, "lastError") },
    Column { header: "BMC", cell: |r, _| field(&r["bmc"], "address") },
    Column { header: "AGE", cell: |r, now| when(r, "createdAtMs", now) },
];

pub const WORKFLOWS: &[Column] = &[
    Column { header: "ID", cell: |r, _| field(r, "workflowId") },
    Column { header: "VERB", cell: |r, _| field(r, "verb") },
    Column { header: "OUTCOME", cell: |r, _| field(r, "outcome") },
    Column {
        header: "STEP",
        cell: |r, _| {
            let steps = r["steps"].as_array().cloned().unwrap_or_default();
            let at = steps.iter().find(|s| s["state"] != "done").map(|s| s["name"].as_str().unwrap_or("?").to_owned());
            at.unwrap_or_else(|| "-".into())
        },
    },
    Column { header: "REASON", cell: |r, _| field(r, "reason") },
    Column { header: "STARTED", cell: |r, now| when(r, "startedAtMs", now) },
];

/// `drivers list`: each driver, how many nodes (machines, for a BMC protocol) have it, and where.
pub const DRIVERS: &[Column] = &[
    Column { header: "KIND", cell: |r, _| field(r, "kind") },
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "NODES", cell: |r, _| field(r, "nodes") },
    Column { header: "READY", cell: |r, _| field(r, "ready") },
    Column { header: "POOLS", cell: |r, _| field(r, "pools") },
];

/// `api --list`.
pub const METHODS: &[Column] = &[
    Column { header: "METHOD", cell: |r, _| field(r, "method") },
    Column { header: "ACTION", cell: |r, _| field(r, "action") },
    Column { header: "SUMMARY", cell: |r, _| field(r, "summary") },
];

/// The columns of a list method's result, for `api METHOD --format table`.
pub fn for_method(method: &str) -> Option<&'static [Column]> {
    Some(match method {
        "reservations.list" => RESERVATIONS,
        "pools.list" => POOLS,
        "nodes.list" => NODES,
        "joinTokens.list" => JOIN_TOKENS,
        "joinRequests.list" => JOIN_REQUESTS,
        "commands.list" => COMMANDS,
        "inventory.history" => INVENTORY,
        "events.list" => EVENTS,
        "webhooks.list" => WEBHOOKS,
        "webhooks.deliveries" => DELIVERIES,
        "webhooks.eventTypes" => EVENT_TYPES,
        "secrets.list" => SECRETS,
        "sites.list" => SITES,
        "projects.list" => PROJECTS,
        "apiKeys.list" => API_KEYS,
        "flavors.list" => FLAVORS,
        "images.list" => IMAGES,
        "releases.list" => RELEASES,
        "rollouts.list" => ROLLOUTS,
        "instances.list" => INSTANCES,
        "metal.list" => MACHINES,
        "workflows.list" => WORKFLOWS,
        "capacity.get" => CAPACITY,
        "drivers.list" => DRIVERS,
        _ => return None,
    })
}

/// `reconcilers status`: one row per reconciler and process.
pub const RECONCILER_PASSES: &[Column] = &[
    Column { header: "NAME", cell: |r, _| field(r, "name") },
    Column { header: "INSTANCE", cell: |r, _| field(r, "instance") },
    Column { header: "LAST PASS", cell: |r, now| when(r, "startedAtMs", now) },
    Column {
        header: "DURATION",
        cell: |r, _| r["durationMs"].as_u64().map(|ms| format!("{ms}ms")).unwrap_or_else(|| "-".into()),
    },
    Column {
        header: "OUTCOME",
        cell: |r, _| match (r["ok"].as_bool(), r["state"].as_str()) {
            (Some(true), _) => "ok".into(),
            (None, Some(state)) => state.into(),
            _ => format!("failed: {}", r["error"].as_str().unwrap_or("?")),
        },
    },
    Column { header: "PASSES", cell: |r, _| field(r, "passes") },
    Column { header: "COUNTS", cell: |r, _| pairs(r, "counts") },
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::table_of;
    use serde_json::json;

    const NOW: i64 = 1_800_000_000_000;
    const S: i64 = 1000;

    #[test]
    fn relative_times() {
        assert_eq!(relative(NOW, NOW), "now");
        assert_eq!(relative(NOW - 400, NOW), "now");
        assert_eq!(relative(NOW - 5 * 60 * S, NOW), "5m ago");
        assert_eq!(relative(NOW + 59 * 60 * S + 59 * S, NOW), "in 59m");
        assert_eq!(relative(NOW - 30 * S, NOW), "30s ago");
        assert_eq!(relative(NOW + 90 * S, NOW), "in 90s");
        assert_eq!(relative(NOW - 119 * 60 * S, NOW), "119m ago");
        assert_eq!(relative(NOW - 3 * 3600 * S, NOW), "3h ago");
        assert_eq!(relative(NOW + 47 * 3600 * S, NOW), "in 47h");
        assert_eq!(relative(NOW - 3 * 86_400 * S, NOW), "3d ago");
        assert_eq!(relative(NOW + 800 * 86_400 * S, NOW), "in 2y");
        assert_eq!(relative(i64::MIN, NOW), relative(i64::MIN, NOW), "no overflow");
        assert_eq!(span(2_592_000), "30d");
    }

    #[test]
    fn reservations_table_has_chosen_columns_and_relative_times() {
        let page = json!({
            "items": [
                { "reservationId": "rsv_a", "state": "active", "gpus": 2, "nodeId": "node_a",
                  "requestedAtMs": NOW - 5 * 60 * S, "endsAtMs": NOW + 59 * 60 * S + 30 * S, "endedAtMs": null,
                  "tenantId": "ten_x", "selector": "" },
                { "reservationId": "rsv_b", "state": "queued", "gpus": 4, "nodeId": null,
                  "requestedAtMs": NOW - 30 * S, "endsAtMs": null, "endedAtMs": null },
                { "reservationId": "rsv_c", "state": "released", "gpus": 1, "nodeId": "node_a",
                  "requestedAtMs": NOW - 3 * 3600 * S, "endsAtMs": NOW + 3600 * S, "endedAtMs": NOW - 10 * 60 * S },
            ],
            "nextCursor": "rsv_c",
        });
        let text = table_of(&page, RESERVATIONS, NOW);
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
        assert_eq!(lines[0], ["ID", "STATE", "GPUS", "NODE", "AGE", "ENDS"]);
        assert_eq!(lines[1], ["rsv_a", "active", "2", "node_a", "5m", "ago", "in", "59m"]);
        assert_eq!(lines[2], ["rsv_b", "queued", "4", "-", "30s", "ago", "-"]);
        assert_eq!(lines[3], ["rsv_c", "released", "1", "node_a", "3h", "ago", "10m", "ago"]);
        assert!(text.ends_with("(more rows: --cursor rsv_c)"), "{text}");
        assert!(!text.contains("ten_x"), "only the chosen columns: {text}");
    }

    #[test]
    fn nodes_table_summarises_gpus() {
        let gpu = json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": 0 });
        let page = json!({ "items": [{ "nodeId": "node_a", "name": "n1", "state": "ready", "gpus": [gpu, gpu],
            "allocations": { "0": "rsv_a" }, "poolId": "pool_a", "createdAtMs": NOW - 2 * 86_400 * S }] });
        let text = table_of(&page, NODES, NOW);
        assert!(text.contains("2× H100-SXM5-80GB (80 GiB)") && text.contains("1/2") && text.contains("2d ago"), "{text}");
        assert!(table_of(&json!({ "items": [] }), NODES, NOW).ends_with("(no rows)"));
    }

    #[test]
    fn flavors_show_memory_in_its_unit_and_images_a_short_digest() {
        let page = json!({ "items": [
            { "flavorId": "flv_a", "poolId": "pool_a", "name": "g1", "vcpus": 8, "memoryMiB": 65_536, "diskGiB": 200, "gpus": 1 },
            { "flavorId": "flv_b", "poolId": "pool_a", "name": "odd", "vcpus": 1, "memoryMiB": 1536, "diskGiB": 1, "gpus": 0 },
        ] });
        let text = table_of(&page, FLAVORS, NOW);
        assert!(text.contains("64 GiB") && text.contains("1536 MiB") && text.contains("200 GiB"), "{text}");
        let digest = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        let page = json!({ "items": [{ "imageId": "img_a", "name": "u", "diskFormat": "qcow2", "sha256": digest, "url": "https://a/x" }] });
        let text = table_of(&page, IMAGES, NOW);
        assert!(text.contains("e3b0c44298fc ") && !text.contains(digest), "{text}");
        assert_eq!(for_method("flavors.list").map(<[Column]>::len), Some(FLAVORS.len()));
        assert_eq!(for_method("images.list").map(<[Column]>::len), Some(IMAGES.len()));
    }

    #[test]
    fn cells_stay_terminal_safe() {
        let page = json!({ "items": [{ "poolId": "pool_a", "name": "evil\u{1b}[31m\nname", "labels": { "k": "v\u{7}" } }] });
        let text = table_of(&page, POOLS, NOW);
        assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
        assert_eq!(text.lines().count(), 2, "{text}");
    }
}
