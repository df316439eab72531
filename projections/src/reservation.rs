//! Reservations (`reservation/rsv_…`): the document, its states, its binding to the node's GPUs,
//! the payloads of `reservation.*` and of the nodes' `gpu.*` reports, and their fold.
//!
//! A reservation is `queued` → `active` → `released` | `expired`, or `queued` → `cancelled`, or
//! `failed` after [`HOLD_ATTEMPTS_MAX`] holds failed. Its live row exists while it is queued or
//! active, and once gone stays gone. A GPU report changes the binding only when it answers the
//! command the binding waits on; a stale answer moves only the version. The decisions over
//! reservations are in [`crate::decide`].

use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use bc_core::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::command::{COMMAND_FAILED, COMMAND_SUCCEEDED, CommandProgress, CommandStep, apply_command};
use crate::{from_doc, payload, state_from_str, to_doc};

pub const RESERVATION_REQUESTED: &str = "reservation.requested";
pub const RESERVATION_ACTIVATED: &str = "reservation.activated";
pub const RESERVATION_EXTENDED: &str = "reservation.extended";
pub const RESERVATION_RELEASED: &str = "reservation.released";
pub const RESERVATION_EXPIRED: &str = "reservation.expired";
pub const RESERVATION_CANCELLED: &str = "reservation.cancelled";
/// A node's answer to `gpu.hold` and `gpu.release`, journaled on the reservation's stream
/// ([`GpuReport`]); each finishes its command.
pub const GPU_HELD: &str = "gpu.held";
pub const GPU_HOLD_FAILED: &str = "gpu.hold_failed";
pub const GPU_RELEASED: &str = "gpu.released";
/// The GPU reports, which finish a command and change a reservation's binding.
pub const GPU_REPORT_TYPES: &[&str] = &[GPU_HELD, GPU_HOLD_FAILED, GPU_RELEASED];
/// An active reservation whose hold failed, given back to the head of its pool's queue.
pub const RESERVATION_REQUEUED: &str = "reservation.requeued";
/// A reservation whose holds failed [`crate::HOLD_ATTEMPTS_MAX`] times: ended, with the reason.
pub const RESERVATION_FAILED: &str = "reservation.failed";
/// In the request's own append, after `reservation.requested`: the reservation is held for
/// another tenant, in a pool its owner offered to that tenant and under that tenant's quota
/// (`pools.offer`); it lives on the pool owner's chain, beside the owner's own.
pub const RESERVATION_HELD_FOR: &str = "reservation.held_for";
/// On the reservation's stream: an instance now uses its GPUs, or no longer does.
pub const RESERVATION_INSTANCE_ATTACHED: &str = "reservation.instance_attached";
pub const RESERVATION_INSTANCE_DETACHED: &str = "reservation.instance_detached";

/// A reservation's document; also its stream's prefix (`reservation/rsv_…`).
pub const KIND_RESERVATION: &str = "reservation";
/// The first word of the nodes' GPU reports' types (`gpu.held`, …), which this module folds.
pub(crate) const GPU: &str = "gpu";
/// One row per queued or active reservation (removed when it ends): what the reconciler and
/// the capacity views scan, so they never read finished reservations.
pub const KIND_RESERVATION_LIVE: &str = "reservation_live";
/// Holds a reservation may try: after this many failed holds it fails, with the last reason,
/// instead of going back to its queue again.
pub const HOLD_ATTEMPTS_MAX: u32 = 3;
/// How long a node has to answer `gpu.hold` or `gpu.release`; an unanswered hold then counts as
/// failed (`hold-timeout`).
pub const HOLD_DEADLINE_S: u64 = 120;

/// A reservation: `queued` → `active` → `released` | `expired`, or `queued` → `cancelled`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReservationDoc {
    pub tenant_id: String,
    pub reservation_id: String,
    pub pool_id: String,
    pub gpus: u32,
    pub duration_s: u64,
    pub selector: String,
    pub nvlink: bool,
    pub tolerations: Vec<String>,
    pub state: ReservationState,
    pub node_id: Option<String>,
    pub gpu_indexes: Vec<u32>,
    /// The tenant chain's sequence number of the request: the queue's order.
    pub request_seq: u64,
    pub requested_at_ms: u64,
    pub activated_at_ms: Option<u64>,
    pub ends_at_ms: Option<u64>,
    pub ended_at_ms: Option<u64>,
    /// Whether its node really set its GPUs aside; `None` while queued.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binding: Option<Binding>,
    /// Holds that failed so far (each put it back in its queue), the nodes they failed on, and
    /// the last reason.
    #[serde(default)]
    pub hold_attempts: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hold_failed_nodes: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The instance using its GPUs, until that instance is deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// The tenant it is held for, in a pool offered to that tenant (absent: the chain's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_tenant_id: Option<String>,
    /// The project it was made in (`proj_…` of the asking tenant), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    pub version: u64,
}

/// A reservation's GPUs on its node: `pending` (the node was sent `gpu.hold`) → `bound` (it
/// journaled `gpu.held`) or `failed` (`gpu.hold_failed`, or no answer by the deadline); after the
/// reservation ends, `released` once the node journaled `gpu.released`. A node registered by
/// hand has no agent to ask: `bound` at once.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Binding {
    pub state: BindingState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_command_id: Option<String>,
    /// When a pending hold counts as failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_command_id: Option<String>,
    /// The GPUs' UUIDs the node reported holding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_uuids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub changed_at_ms: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BindingState {
    Pending,
    Bound,
    Failed,
    Released,
}

impl Binding {
    /// Whether the node may hold the GPUs: a hold was sent and not refused (`pending` or
    /// `bound`), so ending the reservation sends `gpu.release`.
    pub fn may_hold(&self) -> bool {
        self.hold_command_id.is_some() && matches!(self.state, BindingState::Pending | BindingState::Bound)
    }
}

impl BindingState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Bound => "bound",
            Self::Failed => "failed",
            Self::Released => "released",
        }
    }
}

/// Where a reservation is in its life: `queued` → `active` → `released` | `expired`, or
/// `queued` → `cancelled`. Stored (and shown) in lowercase, as the words were before the enum.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReservationState {
    /// Waiting in its pool's queue for GPUs.
    Queued,
    /// Holding GPUs on a node until its end.
    Active,
    /// Ended by its owner before its end.
    Released,
    /// Ended at its end time by the reconciler.
    Expired,
    /// Ended by its owner while still queued.
    Cancelled,
    /// Ended because its node could not hold its GPUs, [`HOLD_ATTEMPTS_MAX`] times
    /// (`lastError` says why).
    Failed,
}

impl ReservationState {
    pub const ALL: &[Self] = &[Self::Queued, Self::Active, Self::Released, Self::Expired, Self::Cancelled, Self::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Active => "active",
            Self::Released => "released",
            Self::Expired => "expired",
            Self::Cancelled => "cancelled",
            Self::Failed => "failed",
        }
    }

    /// Queued or active: the reservation has a live row and counts against its pool's quota.
    pub fn is_live(self) -> bool {
        matches!(self, Self::Queued | Self::Active)
    }
}

impl std::str::FromStr for ReservationState {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        state_from_str("reservation", text, Self::ALL, Self::as_str)
    }
}

impl std::fmt::Display for ReservationState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationRequested {
    pub pool_id: String,
    pub gpus: u32,
    pub duration_s: u64,
    /// The selector as written (checked when requested); empty: any GPU.
    pub selector: String,
    pub nvlink: bool,
    pub tolerations: Vec<String>,
    /// The tenant's project it is made in (`proj_…`), live when it was asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationActivated {
    pub node_id: String,
    pub gpus: Vec<u32>,
    pub ends_at_ms: u64,
    /// On a node with an agent: the `gpu.hold` command issued in the same append; the binding
    /// is `pending` until the node answers (absent: a node registered by hand, bound at once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<HoldIssued>,
}

/// The `gpu.hold` (or `gpu.release`) command an append issued for a reservation.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HoldIssued {
    pub command_id: String,
    /// The command's deadline: a hold not answered by then counts as failed.
    pub deadline_at_ms: u64,
}

/// `reservation.requeued`: the hold on `node_id` failed (or was not answered by its deadline);
/// the GPUs are freed in the same append and the reservation waits at the head of its queue.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationRequeued {
    pub node_id: String,
    pub reason: String,
    /// Holds failed so far, this one included.
    pub attempts: u32,
    /// `gpu.release` to the node, when the hold was not answered (it may yet hold them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<HoldIssued>,
}

/// `reservation.failed`: ended after its last allowed hold failed; the same fields as
/// `reservation.requeued`.
pub type ReservationFailed = ReservationRequeued;

/// `gpu.held`, `gpu.hold_failed`, `gpu.released`: a node's answer to its `gpu.hold` or
/// `gpu.release` command, from its journal, on the stream of the reservation the command names.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuReport {
    pub command_id: String,
    pub node_id: String,
    pub reservation_id: String,
    /// The GPUs' UUIDs.
    pub gpus: Vec<String>,
    /// Why a hold failed: a stable code, a colon, and words (`node-unprivileged: …`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationExtended {
    pub ends_at_ms: u64,
}

/// `reservation.released`, `.expired`, `.cancelled`: no payload, but for the `gpu.release`
/// issued in the same append to a node that may hold the GPUs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationEnded {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<HoldIssued>,
    /// Why, when the system ended it (a queued reservation of a tenant whose offer was
    /// withdrawn); kept as the document's `lastError`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `reservation.held_for`: the tenant the reservation is held for.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationHeldFor {
    pub tenant_id: String,
}

/// `reservation.instance_attached` / `.instance_detached`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationInstance {
    pub instance_id: String,
}

/// Folds one `reservation.*` or `gpu.*` event into the row `key`: the reservation's document and
/// live row, and for a GPU report the command it finishes; any other type leaves the row as it
/// was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        RESERVATION_REQUESTED => requested(key, event),
        RESERVATION_HELD_FOR => {
            if key.kind == KIND_RESERVATION_LIVE && current.is_none() {
                return Ok(None);
            }
            let p: ReservationHeldFor = payload(event)?;
            let mut doc: ReservationDoc = from_doc(event, current)?;
            doc.holder_tenant_id = Some(p.tenant_id);
            doc.version = env.version;
            to_doc(&doc)
        }
        GPU_HELD | GPU_HOLD_FAILED | GPU_RELEASED => apply_gpu_report(key, current, event),
        RESERVATION_INSTANCE_ATTACHED | RESERVATION_INSTANCE_DETACHED => {
            if key.kind == KIND_RESERVATION_LIVE && current.is_none() {
                return Ok(None);
            }
            let p: ReservationInstance = payload(event)?;
            let mut doc: ReservationDoc = from_doc(event, current)?;
            doc.instance_id = (env.event_type == RESERVATION_INSTANCE_ATTACHED).then_some(p.instance_id);
            doc.version = env.version;
            to_doc(&doc)
        }
        RESERVATION_ACTIVATED
        | RESERVATION_EXTENDED
        | RESERVATION_RELEASED
        | RESERVATION_EXPIRED
        | RESERVATION_CANCELLED
        | RESERVATION_REQUEUED
        | RESERVATION_FAILED => changed(key, current, event),
        _ => Ok(current),
    }
}

impl ReservationDoc {
    /// A reservation as its request makes it: queued (at `request_seq`, the request's place in
    /// line), on no node, nothing held or tried yet.
    pub fn requested(
        tenant_id: String,
        reservation_id: String,
        p: ReservationRequested,
        request_seq: u64,
        requested_at_ms: u64,
        version: u64,
    ) -> Self {
        ReservationDoc {
            tenant_id,
            reservation_id,
            pool_id: p.pool_id,
            gpus: p.gpus,
            duration_s: p.duration_s,
            selector: p.selector,
            nvlink: p.nvlink,
            tolerations: p.tolerations,
            state: ReservationState::Queued,
            node_id: None,
            gpu_indexes: Vec::new(),
            request_seq,
            requested_at_ms,
            activated_at_ms: None,
            ends_at_ms: None,
            ended_at_ms: None,
            binding: None,
            hold_attempts: 0,
            hold_failed_nodes: Vec::new(),
            last_error: None,
            instance_id: None,
            holder_tenant_id: None,
            project_id: p.project_id,
            version,
        }
    }
}

fn requested(key: &RowKey, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let p: ReservationRequested = payload(event)?;
    to_doc(&ReservationDoc::requested(env.tenant.to_string(), key.id.clone(), p, env.seq, env.at_ms, env.version))
}

/// A reservation's activation, extension, requeue or end.
fn changed(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    // The live row of a reservation that has ended stays gone.
    if key.kind == KIND_RESERVATION_LIVE && current.is_none() {
        return Ok(None);
    }
    let mut doc: ReservationDoc = from_doc(event, current)?;
    match env.event_type.as_str() {
        RESERVATION_ACTIVATED => {
            let p: ReservationActivated = payload(event)?;
            doc.state = ReservationState::Active;
            doc.node_id = Some(p.node_id);
            doc.gpu_indexes = p.gpus;
            doc.activated_at_ms = Some(env.at_ms);
            doc.ends_at_ms = Some(p.ends_at_ms);
            doc.binding = Some(Binding {
                state: if p.hold.is_some() { BindingState::Pending } else { BindingState::Bound },
                hold_command_id: p.hold.as_ref().map(|h| h.command_id.clone()),
                deadline_at_ms: p.hold.as_ref().map(|h| h.deadline_at_ms),
                release_command_id: None,
                gpu_uuids: Vec::new(),
                reason: None,
                changed_at_ms: env.at_ms,
            });
        }
        RESERVATION_EXTENDED => {
            let p: ReservationExtended = payload(event)?;
            doc.ends_at_ms = Some(p.ends_at_ms);
        }
        RESERVATION_REQUEUED => {
            let p: ReservationRequeued = payload(event)?;
            doc.state = ReservationState::Queued;
            doc.node_id = None;
            doc.gpu_indexes = Vec::new();
            doc.activated_at_ms = None;
            doc.ends_at_ms = None;
            doc.binding = None;
            doc.hold_attempts = p.attempts;
            if !doc.hold_failed_nodes.contains(&p.node_id) {
                doc.hold_failed_nodes.push(p.node_id);
            }
            doc.last_error = Some(p.reason);
        }
        ended => {
            doc.state = match ended {
                RESERVATION_RELEASED => ReservationState::Released,
                RESERVATION_EXPIRED => ReservationState::Expired,
                RESERVATION_FAILED => ReservationState::Failed,
                _ => ReservationState::Cancelled,
            };
            let release = if ended == RESERVATION_FAILED {
                let p: ReservationFailed = payload(event)?;
                doc.hold_attempts = p.attempts;
                doc.last_error = Some(p.reason);
                p.release
            } else {
                let p = payload::<ReservationEnded>(event)?;
                if let Some(reason) = p.reason {
                    doc.last_error = Some(reason);
                }
                p.release
            };
            if let (Some(binding), Some(release)) = (doc.binding.as_mut(), release) {
                binding.release_command_id = Some(release.command_id);
                binding.changed_at_ms = env.at_ms;
            }
            doc.ended_at_ms = Some(env.at_ms);
        }
    }
    doc.version = env.version;
    let live = doc.state.is_live();
    if key.kind == KIND_RESERVATION_LIVE && !live { Ok(None) } else { to_doc(&doc) }
}

/// A node's GPU report (`gpu.held`, `gpu.hold_failed`, `gpu.released`, on the reservation's
/// stream): it finishes its command (as `command.succeeded` or `.failed` would) and changes the
/// reservation's binding when it answers the command the binding waits on; a stale answer (the
/// reservation requeued or ended meanwhile) changes only the reservation's version.
fn apply_gpu_report(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    let report: GpuReport = payload(event)?;
    match key.kind.as_str() {
        KIND_RESERVATION | KIND_RESERVATION_LIVE => {
            if key.kind == KIND_RESERVATION_LIVE && current.is_none() {
                return Ok(None);
            }
            let mut doc: ReservationDoc = from_doc(event, current)?;
            if let Some(binding) = doc.binding.as_mut() {
                let answers_hold = binding.hold_command_id.as_deref() == Some(report.command_id.as_str())
                    && binding.state == BindingState::Pending;
                let answers_release = binding.release_command_id.as_deref() == Some(report.command_id.as_str());
                match env.event_type.as_str() {
                    GPU_HELD if answers_hold => {
                        binding.state = BindingState::Bound;
                        binding.gpu_uuids = report.gpus.clone();
                        binding.changed_at_ms = env.at_ms;
                    }
                    GPU_HOLD_FAILED if answers_hold => {
                        binding.state = BindingState::Failed;
                        binding.reason = report.reason.clone();
                        binding.changed_at_ms = env.at_ms;
                    }
                    GPU_RELEASED if answers_release => {
                        binding.state = BindingState::Released;
                        binding.changed_at_ms = env.at_ms;
                    }
                    _ => {}
                }
            }
            doc.version = env.version;
            to_doc(&doc)
        }
        _ => {
            let result = (env.event_type != GPU_HOLD_FAILED).then(|| serde_json::json!({ "gpus": report.gpus }));
            let progress = CommandProgress {
                command_id: report.command_id.clone(),
                node_id: report.node_id,
                result,
                reason: report.reason,
                journal: report.journal,
            };
            let effect = if env.event_type == GPU_HOLD_FAILED { COMMAND_FAILED } else { COMMAND_SUCCEEDED };
            apply_command(key, current, event, CommandStep { command_id: report.command_id, progress: Some(progress), effect })
        }
    }
}
