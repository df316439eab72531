//! Instances: the document (`instance/inst_…`), its live row, the payloads of `instance.*`, and
//! the fold of the instance events into them.
//!
//! An instance has a **desired** state (`running`, `stopped`, `deleted`) and shape, set by the
//! requests and counted by its `generation`, and an **observed** state: what the node's
//! hypervisor last said (`instance.observed`, from the node's journal). Every request issues one
//! `instance.apply` command for its generation (`apply`); the node answers it with what it then
//! observes, or with `instance.apply_failed`. The `state` is the summary a caller reads:
//!
//! - `pending`: an apply is in flight (`deleting` when the desired state is `deleted`);
//! - `running` / `stopped`: the node observed what is desired, in the desired shape;
//! - `drifted`: the node answered, and what it observes is not what is desired (the domain
//!   crashed or was stopped behind the agent's back, or the last apply failed): the instances
//!   reconciler applies again after a back-off;
//! - `failed`: [`INSTANCE_APPLY_ATTEMPTS_MAX`] applies in a row did not get there (the reason in
//!   `lastError`); a new request tries again;
//! - `deleted`: the node reported the domain gone after a delete; the live row is removed and
//!   the reservation can take another instance.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::command::{ResourceReport, apply_report};
use crate::events::*;
use crate::{NoFields, corrupt, from_doc, payload, to_doc};

/// An instance (`instance/inst_…`): created on an active, bound reservation's node with the
/// `instance.apply` command issued in the same append ([`InstanceCreated`]); each request
/// (start, stop, resize, delete) moves its desired state or shape, bumps its generation and
/// issues `instance.apply` again ([`InstanceRequested`]).
pub const INSTANCE_CREATED: &str = "instance.created";
pub const INSTANCE_START_REQUESTED: &str = "instance.start_requested";
pub const INSTANCE_STOP_REQUESTED: &str = "instance.stop_requested";
pub const INSTANCE_RESIZE_REQUESTED: &str = "instance.resize_requested";
pub const INSTANCE_DELETE_REQUESTED: &str = "instance.delete_requested";
/// The instances reconciler sent `instance.apply` again: the node's state differs from the
/// desired one, or the last apply failed or went unanswered ([`InstanceReapplied`]).
pub const INSTANCE_REAPPLIED: &str = "instance.reapplied";
/// Applies failed [`crate::INSTANCE_APPLY_ATTEMPTS_MAX`] times in a row: given up, with the reason.
pub const INSTANCE_FAILED: &str = "instance.failed";
/// The node reported the domain gone after a delete: the instance is finished, and its
/// reservation takes another (`reservation.instance_detached` in the same append).
pub const INSTANCE_DELETED: &str = "instance.deleted";
/// What the node's hypervisor says of the domain ([`InstanceReport`]), from its journal: the
/// answer to an `instance.apply` (finishing it), or a change the node saw by itself.
pub const INSTANCE_OBSERVED: &str = "instance.observed";
/// The node could not apply (`image-digest: …`, `gpus-not-held: …`); finishes the command.
pub const INSTANCE_APPLY_FAILED: &str = "instance.apply_failed";
/// The node's instance reports.
pub const INSTANCE_REPORT_TYPES: &[&str] = &[INSTANCE_OBSERVED, INSTANCE_APPLY_FAILED];

/// What an instance should be: `running`, `stopped`, or `deleted` (gone from its node).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DesiredState {
    Running,
    Stopped,
    Deleted,
}

impl DesiredState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Deleted => "deleted",
        }
    }
}

/// A domain's state as the node's hypervisor reports it; `absent`: no such domain.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ObservedState {
    Running,
    Paused,
    Stopping,
    Stopped,
    Crashed,
    Other,
    Absent,
}

impl ObservedState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Crashed => "crashed",
            Self::Other => "other",
            Self::Absent => "absent",
        }
    }

    /// Whether a domain in this state is what `desired` asks for.
    pub fn satisfies(self, desired: DesiredState) -> bool {
        matches!(
            (self, desired),
            (Self::Running, DesiredState::Running)
                | (Self::Stopped, DesiredState::Stopped)
                | (Self::Absent, DesiredState::Deleted)
        )
    }
}

/// The image an instance boots from, copied from its registration when the instance is made
/// (the node fetches it by URL and checks the digest).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceImage {
    pub image_id: String,
    pub url: String,
    pub sha256: String,
    pub disk_format: DiskFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

/// What an instance is given: its flavor's shape when it was made or last resized.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceShape {
    pub flavor_id: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
}

/// `instance.created`: on the node of `reservation_id` (active and bound), with its GPUs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceCreated {
    pub name: String,
    pub pool_id: String,
    pub node_id: String,
    pub reservation_id: String,
    pub shape: InstanceShape,
    /// The reservation's GPUs' UUIDs, passed through whole.
    pub gpus: Vec<String>,
    pub image: InstanceImage,
    pub desired: DesiredState,
    pub generation: u64,
    /// The `instance.apply` issued in the same append.
    pub apply: HoldIssued,
    /// The project of its reservation (`proj_…` of the tenant), which it is made in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
}

/// `instance.start_requested`, `.stop_requested`, `.resize_requested` (with `shape`),
/// `.delete_requested` (by a caller, or by the reconciler when the reservation ended: `reason`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceRequested {
    pub desired: DesiredState,
    pub generation: u64,
    pub apply: HoldIssued,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<InstanceShape>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `instance.reapplied`: `instance.apply` sent again for the same generation, and why
/// (`drift: …`, `apply-timeout: …`, or the node's last failure); `attempts` so far, this one
/// included.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceReapplied {
    pub apply: HoldIssued,
    pub reason: String,
    pub attempts: u32,
}

/// `instance.failed`: no more applies; the last reason and the attempts made.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceFailed {
    pub reason: String,
    pub attempts: u32,
}

pub type InstanceDeleted = NoFields;

/// `instance.observed` and `instance.apply_failed`, from the node's journal, on the instance's
/// stream. With `command_id`, the answer to that `instance.apply` (and it finishes it).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceReport {
    pub instance_id: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// The generation the node applied (or failed to).
    pub generation: u64,
    /// `instance.observed` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ObservedState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// `instance.apply_failed` only: a stable code, a colon, and words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

/// An instance's document.
pub const KIND_INSTANCE: &str = "instance";
/// One row per instance not yet deleted: what the instances reconciler scans (it acts on
/// failed ones only when a request revives them).
pub const KIND_INSTANCE_LIVE: &str = "instance_live";
/// The command the control plane sends a node to make an instance what it should be.
pub const INSTANCE_APPLY: &str = "instance.apply";
/// How long a node has to answer `instance.apply` (an image fetch takes time); unanswered by
/// then, the apply counts as failed (`apply-timeout`).
pub const INSTANCE_APPLY_DEADLINE_S: u64 = 900;
/// Applies in a row that may fail to reach the desired state before the instance is `failed`.
pub const INSTANCE_APPLY_ATTEMPTS_MAX: u32 = 3;
/// The wait before applying again after a failure or a drift, times the attempts so far.
pub const INSTANCE_REAPPLY_BACKOFF_MS: u64 = 2_000;

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum InstanceState {
    Pending,
    Running,
    Stopped,
    Drifted,
    Deleting,
    Failed,
    Deleted,
}

impl InstanceState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Running => "running",
            Self::Stopped => "stopped",
            Self::Drifted => "drifted",
            Self::Deleting => "deleting",
            Self::Failed => "failed",
            Self::Deleted => "deleted",
        }
    }

    /// Failed and deleted instances take no more applies from the reconciler.
    pub fn is_live(self) -> bool {
        !matches!(self, Self::Failed | Self::Deleted)
    }
}

/// What the node last said of the domain.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct InstanceObserved {
    pub state: ObservedState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// The generation the node had applied when it observed this.
    pub generation: u64,
    pub at_ms: u64,
}

/// The last `instance.apply` sent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ApplyStatus {
    pub command_id: String,
    pub generation: u64,
    pub deadline_at_ms: u64,
    /// When the node answered it (`None`: in flight).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
    /// Its `instance.apply_failed` reason, if it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InstanceDoc {
    pub tenant_id: String,
    pub instance_id: String,
    pub name: String,
    pub pool_id: String,
    pub node_id: String,
    pub reservation_id: String,
    /// The project it was made in: its reservation's, when the reservation names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    pub shape: InstanceShape,
    pub gpus: Vec<String>,
    pub image: InstanceImage,
    pub desired: DesiredState,
    pub generation: u64,
    pub state: InstanceState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed: Option<InstanceObserved>,
    pub apply: ApplyStatus,
    /// Applies since the instance last reached its desired state (or since the last request).
    pub apply_attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl InstanceDoc {
    /// Whether the node observes what is desired, in the desired shape.
    pub fn converged(&self) -> bool {
        let Some(observed) = &self.observed else { return false };
        if !observed.state.satisfies(self.desired) {
            return false;
        }
        self.desired == DesiredState::Deleted
            || (observed.vcpus.is_none_or(|v| v == self.shape.vcpus)
                && observed.memory_mib.is_none_or(|m| m == self.shape.memory_mib))
    }

    /// The state that follows from the desired and observed ones (failed and deleted are set by
    /// their events and kept).
    fn refresh_state(&mut self) {
        if !self.state.is_live() {
            return;
        }
        let deleting = self.desired == DesiredState::Deleted;
        self.state = if self.apply.answered_at_ms.is_none() {
            if deleting { InstanceState::Deleting } else { InstanceState::Pending }
        } else if self.converged() {
            match self.desired {
                DesiredState::Running => InstanceState::Running,
                DesiredState::Stopped => InstanceState::Stopped,
                DesiredState::Deleted => InstanceState::Deleting,
            }
        } else {
            InstanceState::Drifted
        };
    }

    /// The `instance.apply` arguments for this document's generation.
    pub fn apply_args(&self) -> Value {
        serde_json::json!({
            "instanceId": self.instance_id,
            "generation": self.generation,
            "desired": self.desired.as_str(),
            "reservationId": self.reservation_id,
            "vcpus": self.shape.vcpus,
            "memoryMiB": self.shape.memory_mib,
            "diskGiB": self.shape.disk_gib,
            "gpus": self.gpus,
            "image": self.image,
        })
    }
}

/// The fold of an instance event into the instance's rows (its document and live row).
pub(crate) fn apply_instance(kind: &str, id: &str, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if kind == KIND_INSTANCE_LIVE && current.is_none() && env.event_type != INSTANCE_CREATED {
        return Ok(None);
    }
    let mut doc: InstanceDoc = match env.event_type.as_str() {
        INSTANCE_CREATED => {
            if current.is_some() {
                return Err(corrupt(event, format!("instance {id} created twice")));
            }
            let p: InstanceCreated = payload(event)?;
            InstanceDoc {
                tenant_id: env.tenant.to_string(),
                instance_id: id.to_owned(),
                name: p.name,
                pool_id: p.pool_id,
                node_id: p.node_id,
                reservation_id: p.reservation_id,
                project_id: p.project_id,
                shape: p.shape,
                gpus: p.gpus,
                image: p.image,
                desired: p.desired,
                generation: p.generation,
                state: InstanceState::Pending,
                observed: None,
                apply: issued(p.apply, p.generation),
                apply_attempts: 1,
                last_error: None,
                version: env.version,
                created_at_ms: env.at_ms,
                updated_at_ms: env.at_ms,
            }
        }
        _ => from_doc(event, current)?,
    };
    match env.event_type.as_str() {
        INSTANCE_CREATED => {}
        INSTANCE_START_REQUESTED | INSTANCE_STOP_REQUESTED | INSTANCE_RESIZE_REQUESTED | INSTANCE_DELETE_REQUESTED => {
            let p: InstanceRequested = payload(event)?;
            doc.desired = p.desired;
            doc.generation = p.generation;
            if let Some(shape) = p.shape {
                doc.shape = shape;
            }
            doc.apply = issued(p.apply, p.generation);
            doc.apply_attempts = 1;
            doc.last_error = p.reason;
            // A request revives a failed instance: it is tried again.
            if doc.state == InstanceState::Failed {
                doc.state = InstanceState::Pending;
            }
        }
        INSTANCE_REAPPLIED => {
            let p: InstanceReapplied = payload(event)?;
            doc.apply = issued(p.apply, doc.generation);
            doc.apply_attempts = p.attempts;
            doc.last_error = Some(p.reason);
        }
        INSTANCE_FAILED => {
            let p: InstanceFailed = payload(event)?;
            doc.state = InstanceState::Failed;
            doc.apply_attempts = p.attempts;
            doc.last_error = Some(p.reason);
        }
        INSTANCE_DELETED => doc.state = InstanceState::Deleted,
        INSTANCE_OBSERVED | INSTANCE_APPLY_FAILED => {
            let report: InstanceReport = payload(event)?;
            let answers = report.command_id.as_deref() == Some(doc.apply.command_id.as_str());
            if env.event_type == INSTANCE_OBSERVED {
                let state = report.state.ok_or_else(|| corrupt(event, "instance.observed without a state".into()))?;
                doc.observed = Some(InstanceObserved {
                    state,
                    vcpus: report.vcpus,
                    memory_mib: report.memory_mib,
                    generation: report.generation,
                    at_ms: env.at_ms,
                });
                if answers {
                    doc.apply.answered_at_ms = Some(env.at_ms);
                }
                if doc.converged() {
                    doc.apply_attempts = 0;
                }
            } else if answers {
                doc.apply.answered_at_ms = Some(env.at_ms);
                doc.apply.failed = report.reason.clone();
                doc.last_error = report.reason;
            }
        }
        _ => return Ok(Some(serde_json::to_value(&doc).map_err(|e| bc_core::Error::Internal(e.to_string()))?)),
    }
    doc.refresh_state();
    doc.version = env.version;
    doc.updated_at_ms = env.at_ms;
    // A failed instance keeps its live row: a request revives it (the fold cannot rebuild a
    // row it removed, having only the event).
    if kind == KIND_INSTANCE_LIVE && doc.state == InstanceState::Deleted { Ok(None) } else { to_doc(&doc) }
}

fn issued(apply: HoldIssued, generation: u64) -> ApplyStatus {
    ApplyStatus {
        command_id: apply.command_id,
        generation,
        deadline_at_ms: apply.deadline_at_ms,
        answered_at_ms: None,
        failed: None,
    }
}

/// Folds one `instance.*` event into the row `key`: the instance's document and live row, and
/// for a node's report the node's journal head and the command it answers; any other type leaves
/// the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match event.envelope.event_type.as_str() {
        INSTANCE_CREATED
        | INSTANCE_START_REQUESTED
        | INSTANCE_STOP_REQUESTED
        | INSTANCE_RESIZE_REQUESTED
        | INSTANCE_DELETE_REQUESTED
        | INSTANCE_REAPPLIED
        | INSTANCE_FAILED
        | INSTANCE_DELETED => apply_instance(&key.kind, &key.id, current, event),
        INSTANCE_OBSERVED | INSTANCE_APPLY_FAILED => report(key, current, event),
        _ => Ok(current),
    }
}

/// `instance.observed` or `.apply_failed`, from the node's journal.
fn report(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    if matches!(key.kind.as_str(), KIND_INSTANCE | KIND_INSTANCE_LIVE) {
        return apply_instance(&key.kind, &key.id, current, event);
    }
    let report: InstanceReport = payload(event)?;
    let failed = event.envelope.event_type == INSTANCE_APPLY_FAILED;
    let result =
        (!failed).then(|| serde_json::json!({ "state": report.state, "vcpus": report.vcpus, "memoryMiB": report.memory_mib }));
    let (node_id, command_id, reason, journal) = (report.node_id, report.command_id, report.reason, report.journal);
    apply_report(
        key,
        current,
        event,
        ResourceReport { what: "an instance report", node_id, command_id, reason, journal, result, failed },
    )
}
