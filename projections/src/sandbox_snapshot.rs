//! Sandbox snapshots (`sandbox_snapshot/snap_…`): a running sandbox's memory and disk saved on its
//! node (`runsc checkpoint`), content-addressed there by SHA-256, from which
//! `sandboxes.create --from-snapshot` starts a new sandbox (`runsc restore`) with its own id. The
//! live row of each snapshot not yet deleted, the payloads of `sandbox_snapshot.*`, and their fold.
//!
//! - `sandbox_snapshot.requested`: of a sandbox, on its node, with the `sandbox.snapshot` command
//!   that takes it (`desired: ready`); `keep` says whether it outlives the sandbox;
//! - `sandbox_snapshot.delete_requested`: with its `sandbox.snapshot` (`desired: deleted`), by a
//!   caller or by the `sandboxes` reconciler once the sandbox of a snapshot without `keep` is gone;
//! - `sandbox_snapshot.observed` / `sandbox_snapshot.apply_failed`, from the node's journal: `ready`
//!   with the snapshot's digest (`sha256`, of its files' manifest) and size, or `absent` after a
//!   delete (the snapshot is `deleted`, its live row goes); or why not.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::command::{ResourceReport, apply_report};
use crate::events::HoldIssued;
use crate::{corrupt, from_doc, payload, to_doc};

pub const SANDBOX_SNAPSHOT_REQUESTED: &str = "sandbox_snapshot.requested";
pub const SANDBOX_SNAPSHOT_DELETE_REQUESTED: &str = "sandbox_snapshot.delete_requested";
/// What the node made of the last `sandbox.snapshot`, from its journal.
pub const SANDBOX_SNAPSHOT_OBSERVED: &str = "sandbox_snapshot.observed";
/// The node could not (`runtime: …`, `capacity: …`); finishes the command.
pub const SANDBOX_SNAPSHOT_APPLY_FAILED: &str = "sandbox_snapshot.apply_failed";
/// The node's snapshot reports.
pub const SANDBOX_SNAPSHOT_REPORT_TYPES: &[&str] = &[SANDBOX_SNAPSHOT_OBSERVED, SANDBOX_SNAPSHOT_APPLY_FAILED];

pub const KIND_SANDBOX_SNAPSHOT: &str = "sandbox_snapshot";
/// One row per snapshot not yet deleted: what the tenant's bounds count and `list` shows.
pub const KIND_SANDBOX_SNAPSHOT_LIVE: &str = "sandbox_snapshot_live";
/// The command that takes a snapshot on its node, or removes it.
pub const SANDBOX_SNAPSHOT_APPLY: &str = "sandbox.snapshot";
/// How long a node has to answer `sandbox.snapshot` (a checkpoint of a large memory takes time).
pub const SANDBOX_SNAPSHOT_APPLY_DEADLINE_S: u64 = 300;

/// `sandbox_snapshot.requested`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxSnapshotRequested {
    pub sandbox_id: String,
    pub template_id: String,
    pub pool_id: String,
    pub node_id: String,
    /// With the processes' memory (always, so far: a disk-only snapshot is not built).
    pub memory: bool,
    /// Outlives its sandbox.
    pub keep: bool,
    /// What it may come to before the node says (the sandbox's memory): what the bounds count
    /// until then.
    pub estimated_bytes: u64,
    pub apply: HoldIssued,
}

/// `sandbox_snapshot.delete_requested`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxSnapshotDeleteRequested {
    pub apply: HoldIssued,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `sandbox_snapshot.observed` and `.apply_failed`, from the node's journal.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxSnapshotReport {
    pub snapshot_id: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// `observed` only: `ready` or `absent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// `observed` with `ready`: the SHA-256 of the snapshot's manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// `apply_failed` only: a stable code, a colon, and words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SandboxSnapshotState {
    /// Its checkpoint in flight.
    Taking,
    Ready,
    /// The node could not take it (the reason in `lastError`); delete it.
    Failed,
    Deleting,
    Deleted,
}

impl SandboxSnapshotState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Taking => "taking",
            Self::Ready => "ready",
            Self::Failed => "failed",
            Self::Deleting => "deleting",
            Self::Deleted => "deleted",
        }
    }
}

/// The last `sandbox.snapshot` sent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotApply {
    pub command_id: String,
    /// `ready` or `deleted`.
    pub desired: String,
    pub deadline_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSnapshotDoc {
    pub tenant_id: String,
    pub snapshot_id: String,
    pub sandbox_id: String,
    pub template_id: String,
    pub pool_id: String,
    /// The node that holds its files.
    pub node_id: String,
    pub memory: bool,
    pub keep: bool,
    pub state: SandboxSnapshotState,
    /// Its digest, once the node took it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// Its size once taken; until then, its estimate.
    pub bytes: u64,
    pub created_by: String,
    pub apply: SnapshotApply,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl SandboxSnapshotDoc {
    /// The `sandbox.snapshot` arguments.
    pub fn apply_args(snapshot_id: &str, sandbox_id: &str, desired: &str) -> Value {
        serde_json::json!({ "snapshotId": snapshot_id, "sandboxId": sandbox_id, "desired": desired })
    }
}

fn apply_status(apply: HoldIssued, desired: &str) -> SnapshotApply {
    SnapshotApply {
        command_id: apply.command_id,
        desired: desired.to_owned(),
        deadline_at_ms: apply.deadline_at_ms,
        answered_at_ms: None,
    }
}

fn apply_snapshot(kind: &str, id: &str, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if kind == KIND_SANDBOX_SNAPSHOT_LIVE && current.is_none() && env.event_type != SANDBOX_SNAPSHOT_REQUESTED {
        return Ok(None);
    }
    let mut doc: SandboxSnapshotDoc = match env.event_type.as_str() {
        SANDBOX_SNAPSHOT_REQUESTED => {
            if current.is_some() {
                return Err(corrupt(event, format!("sandbox snapshot {id} requested twice")));
            }
            let p: SandboxSnapshotRequested = payload(event)?;
            SandboxSnapshotDoc {
                tenant_id: env.tenant.to_string(),
                snapshot_id: id.to_owned(),
                sandbox_id: p.sandbox_id,
                template_id: p.template_id,
                pool_id: p.pool_id,
                node_id: p.node_id,
                memory: p.memory,
                keep: p.keep,
                state: SandboxSnapshotState::Taking,
                sha256: None,
                bytes: p.estimated_bytes,
                created_by: env.actor.clone(),
                apply: apply_status(p.apply, "ready"),
                last_error: None,
                version: env.version,
                created_at_ms: env.at_ms,
                updated_at_ms: env.at_ms,
            }
        }
        _ => from_doc(event, current)?,
    };
    match env.event_type.as_str() {
        SANDBOX_SNAPSHOT_REQUESTED => {}
        SANDBOX_SNAPSHOT_DELETE_REQUESTED => {
            let p: SandboxSnapshotDeleteRequested = payload(event)?;
            doc.apply = apply_status(p.apply, "deleted");
            doc.state = SandboxSnapshotState::Deleting;
            if p.reason.is_some() {
                doc.last_error = p.reason;
            }
        }
        SANDBOX_SNAPSHOT_OBSERVED | SANDBOX_SNAPSHOT_APPLY_FAILED => {
            let report: SandboxSnapshotReport = payload(event)?;
            if report.command_id.as_deref() == Some(doc.apply.command_id.as_str()) {
                doc.apply.answered_at_ms = Some(env.at_ms);
                if env.event_type == SANDBOX_SNAPSHOT_OBSERVED {
                    let state = report.state.ok_or_else(|| corrupt(event, "sandbox_snapshot.observed without a state".into()))?;
                    match (state.as_str(), doc.apply.desired.as_str()) {
                        ("absent", "deleted") => doc.state = SandboxSnapshotState::Deleted,
                        ("ready", "ready") => {
                            doc.state = SandboxSnapshotState::Ready;
                            doc.sha256 = report.sha256;
                            doc.bytes = report.bytes.unwrap_or(doc.bytes);
                            doc.last_error = None;
                        }
                        _ => {
                            doc.last_error =
                                Some(format!("the node observed the snapshot {state} answering a {}", doc.apply.desired))
                        }
                    }
                } else {
                    doc.last_error = report.reason;
                    if doc.state == SandboxSnapshotState::Taking {
                        doc.state = SandboxSnapshotState::Failed;
                    }
                }
            }
        }
        _ => return to_doc(&doc),
    }
    doc.version = env.version;
    doc.updated_at_ms = env.at_ms;
    if kind == KIND_SANDBOX_SNAPSHOT_LIVE && doc.state == SandboxSnapshotState::Deleted { Ok(None) } else { to_doc(&doc) }
}

/// Folds one `sandbox_snapshot.*` event into the row `key`: the snapshot's rows, and for a node's
/// report also the node's journal head and the command it answers.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    if matches!(key.kind.as_str(), KIND_SANDBOX_SNAPSHOT | KIND_SANDBOX_SNAPSHOT_LIVE) {
        return apply_snapshot(&key.kind, &key.id, current, event);
    }
    if !SANDBOX_SNAPSHOT_REPORT_TYPES.contains(&event.envelope.event_type.as_str()) {
        return Ok(current);
    }
    let report: SandboxSnapshotReport = payload(event)?;
    let failed = event.envelope.event_type == SANDBOX_SNAPSHOT_APPLY_FAILED;
    let result = (!failed).then(|| serde_json::json!({ "state": report.state, "sha256": report.sha256, "bytes": report.bytes }));
    let (node_id, command_id, reason, journal) = (report.node_id, report.command_id, report.reason, report.journal);
    apply_report(
        key,
        current,
        event,
        ResourceReport { what: "a sandbox snapshot report", node_id, command_id, reason, journal, result, failed },
    )
}

/// The snapshot a new sandbox starts from: its id and digest, which the node checks its files
/// against before `runsc restore`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxRestore {
    pub snapshot_id: String,
    pub sha256: String,
}
