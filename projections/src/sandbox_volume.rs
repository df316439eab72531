//! Sandbox volumes: persistent disks for sandboxes (`sandbox_volume/vol_…`), the live row of each
//! volume not yet deleted, the payloads of `sandbox_volume.*`, and their fold.
//!
//! A **volume** is an ext4 file system in a disk image file of its size on ONE node of its pool
//! (the node chosen at its creation, one that runs sandboxes), loop-mounted there by the agent.
//! A template names volumes and a mount path for each; a sandbox of that template is placed on
//! the volumes' node and the runtime bind-mounts each into it. A volume is attached to at most
//! one live sandbox at a time: the sandbox's creation appends `sandbox_volume.attached` on the
//! volume's stream at the version it read, so a second create racing for it loses on that
//! version. Its life is in the log:
//!
//! - `sandbox_volume.created`: its name, pool, node and size, with the `sandbox_volume.apply`
//!   that makes it on the node (a sparse file, `mkfs.ext4`, mounted);
//! - `sandbox_volume.resize_requested`: a larger size, with its `sandbox_volume.apply` (the file
//!   and the file system grow; never while attached);
//! - `sandbox_volume.attached` / `sandbox_volume.detached`: the sandbox that mounts it, and its
//!   end (the `sandboxes` reconciler detaches a volume whose sandbox is no longer live);
//! - `sandbox_volume.delete_requested`: with its `sandbox_volume.apply` (`desired: deleted`: the
//!   file is removed, its data gone);
//! - `sandbox_volume.observed` / `sandbox_volume.apply_failed`, from the node's journal: what the
//!   node made of the last apply (`ready` with its size, or `absent` after a delete, which makes
//!   the volume `deleted` and removes its live row).

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::command::{ResourceReport, apply_report};
use crate::events::HoldIssued;
use crate::{corrupt, from_doc, payload, to_doc};

pub const SANDBOX_VOLUME_CREATED: &str = "sandbox_volume.created";
pub const SANDBOX_VOLUME_RESIZE_REQUESTED: &str = "sandbox_volume.resize_requested";
pub const SANDBOX_VOLUME_ATTACHED: &str = "sandbox_volume.attached";
pub const SANDBOX_VOLUME_DETACHED: &str = "sandbox_volume.detached";
pub const SANDBOX_VOLUME_DELETE_REQUESTED: &str = "sandbox_volume.delete_requested";
/// What the node says of the volume after an apply, from its journal ([`SandboxVolumeReport`]).
pub const SANDBOX_VOLUME_OBSERVED: &str = "sandbox_volume.observed";
/// The node could not apply (`disk: …`, `attached: …`); finishes the command.
pub const SANDBOX_VOLUME_APPLY_FAILED: &str = "sandbox_volume.apply_failed";
/// The node's volume reports.
pub const SANDBOX_VOLUME_REPORT_TYPES: &[&str] = &[SANDBOX_VOLUME_OBSERVED, SANDBOX_VOLUME_APPLY_FAILED];

pub const KIND_SANDBOX_VOLUME: &str = "sandbox_volume";
/// One row per volume not yet deleted: what counts against the tenant's bound and lists by
/// default.
pub const KIND_SANDBOX_VOLUME_LIVE: &str = "sandbox_volume_live";
/// The command that makes a volume on its node what it should be (`ready` at a size, or
/// `deleted`).
pub const SANDBOX_VOLUME_APPLY: &str = "sandbox_volume.apply";
/// How long a node has to answer `sandbox_volume.apply` (a `mkfs.ext4` or a `resize2fs` of a
/// large file system takes time).
pub const SANDBOX_VOLUME_APPLY_DEADLINE_S: u64 = 300;
/// The capability an agent says when it can make volumes: `mkfs.ext4` runs and the loop devices'
/// control opens. Not under `sandbox.`: that prefix names a sandbox runtime (`drivers.list`,
/// `bc_core::agent::driver_of_capability`), and this is none.
pub const CAPABILITY_SANDBOX_VOLUMES: &str = "sandbox-volume.ext4";

/// Where a template mounts a volume, and how (its sandboxes get the same).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeMount {
    pub volume_id: String,
    /// An absolute path inside the sandbox.
    pub path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// `sandbox_volume.created`: on `node_id` of `pool_id`, with its `sandbox_volume.apply`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumeCreated {
    pub name: String,
    pub pool_id: String,
    pub node_id: String,
    #[serde(rename = "sizeGiB")]
    pub size_gib: u64,
    pub apply: HoldIssued,
}

/// `sandbox_volume.resize_requested`: its new size, with the apply that grows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumeResizeRequested {
    #[serde(rename = "sizeGiB")]
    pub size_gib: u64,
    pub apply: HoldIssued,
}

/// `sandbox_volume.delete_requested`: the apply that removes it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumeDeleteRequested {
    pub apply: HoldIssued,
}

/// `sandbox_volume.attached`: the sandbox that mounts it now, and where.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumeAttached {
    pub sandbox_id: String,
    pub path: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// `sandbox_volume.detached`: the sandbox that mounted it is no longer live.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumeDetached {
    pub sandbox_id: String,
}

/// `sandbox_volume.observed` and `sandbox_volume.apply_failed`, from the node's journal, on the
/// volume's stream. With `command_id`, the answer to that `sandbox_volume.apply`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxVolumeReport {
    pub volume_id: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// `sandbox_volume.observed` only: `ready` or `absent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// `sandbox_volume.observed` with `ready`: its size on the node.
    #[serde(default, rename = "sizeGiB", skip_serializing_if = "Option::is_none")]
    pub size_gib: Option<u64>,
    /// `sandbox_volume.apply_failed` only: a stable code, a colon, and words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SandboxVolumeState {
    /// Its creation in flight.
    Creating,
    Ready,
    /// A resize in flight.
    Resizing,
    Deleting,
    /// The node could not make it (the reason in `lastError`); delete it.
    Failed,
    Deleted,
}

impl SandboxVolumeState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "creating",
            Self::Ready => "ready",
            Self::Resizing => "resizing",
            Self::Deleting => "deleting",
            Self::Failed => "failed",
            Self::Deleted => "deleted",
        }
    }
}

/// The last `sandbox_volume.apply` sent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeApply {
    pub command_id: String,
    /// `ready` or `deleted`: what it asks.
    pub desired: String,
    pub deadline_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
}

/// The sandbox that mounts a volume.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct VolumeAttachment {
    pub sandbox_id: String,
    pub path: String,
    #[serde(default)]
    pub read_only: bool,
    pub attached_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxVolumeDoc {
    pub tenant_id: String,
    pub volume_id: String,
    pub name: String,
    pub pool_id: String,
    pub node_id: String,
    /// Its size on the node (the last the node reported; at creation, the size asked).
    #[serde(rename = "sizeGiB")]
    pub size_gib: u64,
    /// The size a resize in flight asks.
    #[serde(default, rename = "requestedSizeGiB", skip_serializing_if = "Option::is_none")]
    pub requested_size_gib: Option<u64>,
    /// Who made it (the creating event's actor): `list` shows a caller its own by default.
    pub created_by: String,
    pub state: SandboxVolumeState,
    pub apply: VolumeApply,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<VolumeAttachment>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl SandboxVolumeDoc {
    /// The `sandbox_volume.apply` arguments (`desired`: `ready` at `size_gib`, or `deleted`).
    pub fn apply_args(volume_id: &str, desired: &str, size_gib: u64) -> Value {
        serde_json::json!({ "volumeId": volume_id, "desired": desired, "sizeGiB": size_gib })
    }
}

fn apply_status(apply: HoldIssued, desired: &str) -> VolumeApply {
    VolumeApply {
        command_id: apply.command_id,
        desired: desired.to_owned(),
        deadline_at_ms: apply.deadline_at_ms,
        answered_at_ms: None,
    }
}

/// Folds a `sandbox_volume.*` event into the volume's document or its live row.
fn apply_volume(kind: &str, id: &str, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if kind == KIND_SANDBOX_VOLUME_LIVE && current.is_none() && env.event_type != SANDBOX_VOLUME_CREATED {
        return Ok(None);
    }
    let mut doc: SandboxVolumeDoc = match env.event_type.as_str() {
        SANDBOX_VOLUME_CREATED => {
            if current.is_some() {
                return Err(corrupt(event, format!("sandbox volume {id} created twice")));
            }
            let p: SandboxVolumeCreated = payload(event)?;
            SandboxVolumeDoc {
                tenant_id: env.tenant.to_string(),
                volume_id: id.to_owned(),
                name: p.name,
                pool_id: p.pool_id,
                node_id: p.node_id,
                size_gib: p.size_gib,
                requested_size_gib: None,
                created_by: env.actor.clone(),
                state: SandboxVolumeState::Creating,
                apply: apply_status(p.apply, "ready"),
                attachment: None,
                last_error: None,
                version: env.version,
                created_at_ms: env.at_ms,
                updated_at_ms: env.at_ms,
            }
        }
        _ => from_doc(event, current)?,
    };
    match env.event_type.as_str() {
        SANDBOX_VOLUME_CREATED => {}
        SANDBOX_VOLUME_RESIZE_REQUESTED => {
            let p: SandboxVolumeResizeRequested = payload(event)?;
            doc.requested_size_gib = Some(p.size_gib);
            doc.apply = apply_status(p.apply, "ready");
            doc.state = SandboxVolumeState::Resizing;
        }
        SANDBOX_VOLUME_ATTACHED => {
            let p: SandboxVolumeAttached = payload(event)?;
            doc.attachment = Some(VolumeAttachment {
                sandbox_id: p.sandbox_id,
                path: p.path,
                read_only: p.read_only,
                attached_at_ms: env.at_ms,
            });
        }
        SANDBOX_VOLUME_DETACHED => {
            let p: SandboxVolumeDetached = payload(event)?;
            if doc.attachment.as_ref().is_none_or(|a| a.sandbox_id != p.sandbox_id) {
                return Err(corrupt(
                    event,
                    format!("sandbox volume {id} detached from {}, which it is not attached to", p.sandbox_id),
                ));
            }
            doc.attachment = None;
        }
        SANDBOX_VOLUME_DELETE_REQUESTED => {
            let p: SandboxVolumeDeleteRequested = payload(event)?;
            doc.apply = apply_status(p.apply, "deleted");
            doc.state = SandboxVolumeState::Deleting;
        }
        SANDBOX_VOLUME_OBSERVED | SANDBOX_VOLUME_APPLY_FAILED => {
            let report: SandboxVolumeReport = payload(event)?;
            // An answer to an older apply changes nothing: the last one decides the state.
            let answers = report.command_id.as_deref() == Some(doc.apply.command_id.as_str());
            if answers {
                doc.apply.answered_at_ms = Some(env.at_ms);
                answer(&mut doc, &env.event_type, report, event)?;
            }
        }
        _ => return to_doc(&doc),
    }
    doc.version = env.version;
    doc.updated_at_ms = env.at_ms;
    if kind == KIND_SANDBOX_VOLUME_LIVE && doc.state == SandboxVolumeState::Deleted { Ok(None) } else { to_doc(&doc) }
}

/// What the node's answer to the last apply makes of the volume.
fn answer(doc: &mut SandboxVolumeDoc, event_type: &str, report: SandboxVolumeReport, event: &StoredEvent) -> Result<()> {
    if event_type == SANDBOX_VOLUME_OBSERVED {
        let state = report.state.ok_or_else(|| corrupt(event, "sandbox_volume.observed without a state".into()))?;
        match (state.as_str(), doc.apply.desired.as_str()) {
            ("absent", "deleted") => doc.state = SandboxVolumeState::Deleted,
            ("ready", "ready") => {
                doc.state = SandboxVolumeState::Ready;
                if let Some(size) = report.size_gib {
                    doc.size_gib = size;
                }
                doc.requested_size_gib = None;
                doc.last_error = None;
            }
            // Not what the apply asked (the gateway lets no such report through): said, not
            // taken as the volume's state.
            _ => doc.last_error = Some(format!("the node observed the volume {state} answering a {}", doc.apply.desired)),
        }
        return Ok(());
    }
    doc.last_error = report.reason;
    doc.state = match doc.state {
        SandboxVolumeState::Creating => SandboxVolumeState::Failed,
        // A resize that failed leaves the volume as it was.
        SandboxVolumeState::Resizing => {
            doc.requested_size_gib = None;
            SandboxVolumeState::Ready
        }
        other => other,
    };
    Ok(())
}

/// Folds one `sandbox_volume.*` event into the row `key`: the volume's rows, and for a node's
/// report also the node's journal head and the command it answers.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let reported = SANDBOX_VOLUME_REPORT_TYPES.contains(&event.envelope.event_type.as_str());
    if matches!(key.kind.as_str(), KIND_SANDBOX_VOLUME | KIND_SANDBOX_VOLUME_LIVE) {
        return apply_volume(&key.kind, &key.id, current, event);
    }
    if !reported {
        return Ok(current);
    }
    let report: SandboxVolumeReport = payload(event)?;
    let failed = event.envelope.event_type == SANDBOX_VOLUME_APPLY_FAILED;
    let result = (!failed).then(|| serde_json::json!({ "state": report.state, "sizeGiB": report.size_gib }));
    let (node_id, command_id, reason, journal) = (report.node_id, report.command_id, report.reason, report.journal);
    apply_report(
        key,
        current,
        event,
        ResourceReport { what: "a sandbox volume report", node_id, command_id, reason, journal, result, failed },
    )
}
