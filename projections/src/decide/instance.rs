//! The decisions about instances: create one on a reservation ([`instance_create`]), change what
//! it should be ([`instance_request`]), and the instances reconciler's pass ([`instances_plan`]),
//! which compares what each instance should be with what its node observes.
//!
//! Every decision that changes what an instance should be, or tries again, issues one
//! `instance.apply` command to its node in the same append (on the command's new stream,
//! guarded as new), carrying the whole desired state, so any apply the node runs makes the
//! domain what the instance's generation says, whatever ran before.

use std::collections::HashMap;

use bc_core::store::{ExpectedVersion, NewEvent};

use super::{Append, Refusal};
use crate::events::*;
use crate::instance::{INSTANCE_APPLY, INSTANCE_APPLY_ATTEMPTS_MAX, INSTANCE_REAPPLY_BACKOFF_MS};
use crate::placement::{Issue, issue_command};
use crate::{
    Binding, BindingState, FlavorDoc, ImageDoc, InstanceDoc, InstanceState, KIND_INSTANCE, KIND_RESERVATION, NodeDoc,
    ReservationDoc, ReservationState, stream_of,
};

/// The capability an agent says when it can run instances (it has a hypervisor).
pub const CAPABILITY_INSTANCE_APPLY: &str = "instance.apply";

/// What `instances.create` decides on: the documents it read and the request.
pub struct InstanceCreateInput<'a> {
    pub instance_id: &'a str,
    pub name: &'a str,
    pub reservation: &'a ReservationDoc,
    pub node: &'a NodeDoc,
    pub flavor: &'a FlavorDoc,
    pub image: &'a ImageDoc,
    /// Start it once made (else it is defined, stopped).
    pub start: bool,
    /// The tenant's quota in the pool and its live work there, when it has one
    /// ([`super::quota::admit`]: the instance counts one instance and its flavor's vCPUs and memory).
    pub quota: Option<super::quota::QuotaRead<'a>>,
}

fn not_ready(reservation: &ReservationDoc, why: impl Into<String>) -> Refusal {
    Refusal::ReservationNotReady {
        reservation_id: reservation.reservation_id.clone(),
        version: reservation.version,
        why: why.into(),
    }
}

/// An instance on the reservation's node with the reservation's GPUs: the reservation is active,
/// its GPUs bound by the node's agent, and it has no instance; the flavor is of its pool and
/// gives as many GPUs as it holds; the node's agent runs instances. Appends
/// `instance.created`, `command.issued` (`instance.apply`) and `reservation.instance_attached`
/// (guarded at the reservation's version, so two creates on one reservation never both land).
pub fn instance_create(input: &InstanceCreateInput<'_>, issue: Issue<'_>) -> Result<Append, Refusal> {
    let rsv = input.reservation;
    // A reservation held for another tenant (`pools.offer`) is that tenant's, charged to its
    // quota: the owner, whose chain it lives on, starts nothing on its GPUs.
    if let Some(holder) = &rsv.holder_tenant_id {
        return Err(Refusal::HeldForOther { reservation_id: rsv.reservation_id.clone(), holder_tenant_id: holder.clone() });
    }
    let binding = bound_for_instance(rsv)?;
    instance_fits(input)?;
    let doc = pending_instance(input, binding, issue.now_ms);
    let mut guards = Vec::new();
    let (command, apply) = issue_command(&doc.node_id, INSTANCE_APPLY, doc.apply_args(), issue, &mut guards)?;
    let adding = super::quota::ResourceUse::instance(doc.shape.vcpus, doc.shape.memory_mib);
    let counted = super::quota::admit(input.quota.as_ref(), &adding, input.instance_id).map_err(Refusal::of_quota)?;
    let created = InstanceCreated {
        name: doc.name,
        pool_id: doc.pool_id,
        node_id: doc.node_id,
        reservation_id: doc.reservation_id,
        shape: doc.shape,
        gpus: doc.gpus,
        image: doc.image,
        desired: doc.desired,
        generation: 1,
        apply,
        project_id: doc.project_id,
    };
    let rsv_stream = stream_of(KIND_RESERVATION, &rsv.reservation_id);
    guards.push((rsv_stream.clone(), ExpectedVersion::Exact(rsv.version)));
    let attached = NewEvent {
        stream: Some(rsv_stream),
        event_type: RESERVATION_INSTANCE_ATTACHED.into(),
        payload: to_cbor(&ReservationInstance { instance_id: input.instance_id.to_owned() })?,
    };
    let mut events = vec![NewEvent::new(INSTANCE_CREATED, to_cbor(&created)?), command, attached];
    if let Some((guard, event)) = counted {
        guards.push(guard);
        events.push(event);
    }
    Ok(Append { stream: stream_of(KIND_INSTANCE, &input.instance_id), expected: ExpectedVersion::NoStream, guards, events })
}

/// The reservation's binding, when an instance may take its GPUs: the reservation is active,
/// its GPUs bound by the node's agent, and no instance uses them.
fn bound_for_instance(rsv: &ReservationDoc) -> Result<&Binding, Refusal> {
    if rsv.state != ReservationState::Active {
        return Err(not_ready(rsv, format!("it is {}, not active", rsv.state.as_str())));
    }
    let binding = rsv.binding.as_ref().filter(|b| b.state == BindingState::Bound);
    let Some(binding) = binding else {
        let state = rsv.binding.as_ref().map_or("none", |b| match b.state {
            BindingState::Pending => "pending",
            BindingState::Bound => "bound",
            BindingState::Failed => "failed",
            BindingState::Released => "released",
        });
        return Err(not_ready(rsv, format!("its GPUs are not bound yet (binding {state})")));
    };
    if binding.hold_command_id.is_none() || binding.gpu_uuids.is_empty() {
        return Err(not_ready(rsv, "its node has no agent to run an instance (registered by hand)"));
    }
    if let Some(other) = &rsv.instance_id {
        return Err(not_ready(rsv, format!("instance {other} uses its GPUs")));
    }
    Ok(binding)
}

/// Whether the flavor, the image and the node suit the reservation: the flavor is of its pool
/// and gives as many GPUs as it holds, the image is a disk (not an ISO), and the node's agent
/// runs instances.
fn instance_fits(input: &InstanceCreateInput<'_>) -> Result<(), Refusal> {
    let rsv = input.reservation;
    if input.flavor.pool_id != rsv.pool_id {
        return Err(Refusal::InstanceMismatch(format!(
            "flavor {} is of pool {}, the reservation of pool {}",
            input.flavor.flavor_id, input.flavor.pool_id, rsv.pool_id
        )));
    }
    if input.flavor.gpus != rsv.gpus {
        return Err(Refusal::InstanceMismatch(format!(
            "flavor {} gives {} GPUs, reservation {} holds {}",
            input.flavor.flavor_id, input.flavor.gpus, rsv.reservation_id, rsv.gpus
        )));
    }
    if input.image.disk_format == crate::events::DiskFormat::RootfsTar {
        return Err(Refusal::InstanceMismatch(format!(
            "image {} is a root file system (rootfs-tar, for sandboxes): an instance boots a qcow2 or raw disk",
            input.image.image_id
        )));
    }
    if input.image.disk_format == crate::events::DiskFormat::Iso {
        return Err(Refusal::InstanceMismatch(format!(
            "image {} is an ISO (for bare-metal deploys): an instance boots a qcow2 or raw disk",
            input.image.image_id
        )));
    }
    let capabilities = input.node.agent.as_ref().and_then(|a| a.inventory.as_ref()).map(|i| i.capabilities.as_slice());
    if !capabilities.unwrap_or_default().iter().any(|c| c == CAPABILITY_INSTANCE_APPLY) {
        return Err(Refusal::NodeCannotRunInstances { node_id: input.node.node_id.clone(), version: input.node.version });
    }
    Ok(())
}

/// The new instance's document, as `instance.created` will fold it (generation 1, pending), so
/// its first `instance.apply` carries what the document will say.
fn pending_instance(input: &InstanceCreateInput<'_>, binding: &Binding, now_ms: u64) -> InstanceDoc {
    let rsv = input.reservation;
    InstanceDoc {
        tenant_id: rsv.tenant_id.clone(),
        instance_id: input.instance_id.to_owned(),
        name: input.name.to_owned(),
        pool_id: rsv.pool_id.clone(),
        node_id: input.node.node_id.clone(),
        reservation_id: rsv.reservation_id.clone(),
        project_id: rsv.project_id.clone(),
        shape: InstanceShape {
            flavor_id: input.flavor.flavor_id.clone(),
            vcpus: input.flavor.vcpus,
            memory_mib: input.flavor.memory_mib,
            disk_gib: input.flavor.disk_gib,
        },
        gpus: binding.gpu_uuids.clone(),
        image: InstanceImage {
            image_id: input.image.image_id.clone(),
            url: input.image.url.clone(),
            sha256: input.image.sha256.clone(),
            disk_format: input.image.disk_format,
            size_bytes: input.image.size_bytes,
        },
        desired: if input.start { DesiredState::Running } else { DesiredState::Stopped },
        generation: 1,
        state: InstanceState::Pending,
        observed: None,
        apply: crate::instance::ApplyStatus {
            command_id: String::new(),
            generation: 1,
            deadline_at_ms: 0,
            answered_at_ms: None,
            failed: None,
        },
        apply_attempts: 1,
        last_error: None,
        version: 0,
        created_at_ms: now_ms,
        updated_at_ms: now_ms,
    }
}

/// What a caller asks of an existing instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceRequest {
    Start,
    Stop,
    /// To another flavor of its pool, with as many GPUs (the instance keeps its reservation).
    Resize(InstanceShape),
    Delete,
}

/// A request on `doc` at `if_version` (if given): a new generation with its desired state or
/// shape, and `instance.apply` for it. A deleted instance takes none; a deleting one only
/// another delete (which sends the apply again).
pub fn instance_request(
    doc: &InstanceDoc,
    request: &InstanceRequest,
    if_version: Option<u64>,
    reason: Option<String>,
    issue: Issue<'_>,
) -> Result<Append, Refusal> {
    instance_request_under(doc, request, if_version, reason, issue, None)
}

/// [`instance_request`] under the tenant's quota in the instance's pool (`quota`, its live work
/// there counting this instance at its shape now): a resize that grows its vCPUs or memory
/// counts the growth ([`super::quota::admit`]); other requests count nothing.
pub fn instance_request_under(
    doc: &InstanceDoc,
    request: &InstanceRequest,
    if_version: Option<u64>,
    reason: Option<String>,
    issue: Issue<'_>,
    quota: Option<&super::quota::QuotaRead<'_>>,
) -> Result<Append, Refusal> {
    if let Some(expected) = if_version
        && expected != doc.version
    {
        return Err(Refusal::InstanceVersionMismatch { instance_id: doc.instance_id.clone(), expected, actual: doc.version });
    }
    let deleting = doc.desired == DesiredState::Deleted;
    if doc.state == InstanceState::Deleted || (deleting && *request != InstanceRequest::Delete) {
        return Err(Refusal::InstanceFinished {
            instance_id: doc.instance_id.clone(),
            version: doc.version,
            state: if doc.state == InstanceState::Deleted { "deleted" } else { "being deleted" },
        });
    }
    let mut next = doc.clone();
    next.generation = doc.generation + 1;
    let (event_type, shape) = match request {
        InstanceRequest::Start => {
            next.desired = DesiredState::Running;
            (INSTANCE_START_REQUESTED, None)
        }
        InstanceRequest::Stop => {
            next.desired = DesiredState::Stopped;
            (INSTANCE_STOP_REQUESTED, None)
        }
        InstanceRequest::Resize(shape) => {
            next.shape = shape.clone();
            (INSTANCE_RESIZE_REQUESTED, Some(shape.clone()))
        }
        InstanceRequest::Delete => {
            next.desired = DesiredState::Deleted;
            (INSTANCE_DELETE_REQUESTED, None)
        }
    };
    let mut guards = Vec::new();
    let counted = match request {
        InstanceRequest::Resize(shape) => {
            let growth =
                super::quota::ResourceUse::growth((doc.shape.vcpus, doc.shape.memory_mib), (shape.vcpus, shape.memory_mib));
            if !growth.is_empty() {
                super::quota::admit(quota, &growth, &doc.instance_id).map_err(Refusal::of_quota)?
            } else {
                None
            }
        }
        _ => None,
    };
    let (command, apply) = issue_command(&doc.node_id, INSTANCE_APPLY, next.apply_args(), issue, &mut guards)?;
    let requested = InstanceRequested { desired: next.desired, generation: next.generation, apply, shape, reason };
    let mut events = vec![NewEvent::new(event_type, to_cbor(&requested)?), command];
    if let Some((guard, event)) = counted {
        guards.push(guard);
        events.push(event);
    }
    Ok(Append {
        stream: stream_of(KIND_INSTANCE, &doc.instance_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards,
        events,
    })
}

/// One step of the instances reconciler's pass, on one instance at the version the plan read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceAction {
    /// Send `instance.apply` again for the same generation.
    Reapply { instance_id: String, version: u64, reason: String, attempts: u32 },
    /// No more applies: `failed`, with the reason.
    Fail { instance_id: String, version: u64, reason: String, attempts: u32 },
    /// Its reservation ended: delete it (a new generation).
    Delete { instance_id: String, version: u64, reason: String },
    /// The node reported the domain gone after a delete: finished, and detached from its
    /// reservation (at the reservation's version).
    Deleted { instance_id: String, version: u64, reservation_id: String, reservation_version: Option<u64> },
}

impl InstanceAction {
    pub fn instance_id(&self) -> &str {
        match self {
            Self::Reapply { instance_id, .. }
            | Self::Fail { instance_id, .. }
            | Self::Delete { instance_id, .. }
            | Self::Deleted { instance_id, .. } => instance_id,
        }
    }

    /// Whether the append issues a command (and so needs `issue`'s id).
    pub fn issues_command(&self) -> bool {
        matches!(self, Self::Reapply { .. } | Self::Delete { .. })
    }

    /// The append of this action on `doc` (the document the plan read).
    pub fn append(&self, doc: &InstanceDoc, issue: Issue<'_>) -> Result<Append, Refusal> {
        let stream = stream_of(KIND_INSTANCE, &doc.instance_id);
        match self {
            Self::Reapply { version, reason, attempts, .. } => {
                let mut guards = Vec::new();
                let (command, apply) = issue_command(&doc.node_id, INSTANCE_APPLY, doc.apply_args(), issue, &mut guards)?;
                let payload = InstanceReapplied { apply, reason: reason.clone(), attempts: *attempts };
                Ok(Append {
                    stream,
                    expected: ExpectedVersion::Exact(*version),
                    guards,
                    events: vec![NewEvent::new(INSTANCE_REAPPLIED, to_cbor(&payload)?), command],
                })
            }
            Self::Fail { version, reason, attempts, .. } => Ok(Append {
                stream,
                expected: ExpectedVersion::Exact(*version),
                guards: Vec::new(),
                events: vec![NewEvent::new(
                    INSTANCE_FAILED,
                    to_cbor(&InstanceFailed { reason: reason.clone(), attempts: *attempts })?,
                )],
            }),
            Self::Delete { version, reason, .. } => {
                instance_request(doc, &InstanceRequest::Delete, Some(*version), Some(reason.clone()), issue)
            }
            Self::Deleted { version, reservation_id, reservation_version, .. } => {
                let mut events = vec![NewEvent::new(INSTANCE_DELETED, to_cbor(&InstanceDeleted {})?)];
                let mut guards = Vec::new();
                // The reservation is free for another instance; one that has ended (its row
                // gone from the plan's view) keeps the name of its last instance.
                if let Some(reservation_version) = reservation_version {
                    let rsv_stream = stream_of(KIND_RESERVATION, reservation_id);
                    guards.push((rsv_stream.clone(), ExpectedVersion::Exact(*reservation_version)));
                    events.push(NewEvent {
                        stream: Some(rsv_stream),
                        event_type: RESERVATION_INSTANCE_DETACHED.into(),
                        payload: to_cbor(&ReservationInstance { instance_id: doc.instance_id.clone() })?,
                    });
                }
                Ok(Append { stream, expected: ExpectedVersion::Exact(*version), guards, events })
            }
        }
    }
}

/// Another apply, or (at [`INSTANCE_APPLY_ATTEMPTS_MAX`]) failed.
fn again(doc: &InstanceDoc, reason: String) -> InstanceAction {
    let (instance_id, version) = (doc.instance_id.clone(), doc.version);
    if doc.apply_attempts >= INSTANCE_APPLY_ATTEMPTS_MAX {
        InstanceAction::Fail { instance_id, version, reason, attempts: doc.apply_attempts }
    } else {
        InstanceAction::Reapply { instance_id, version, reason, attempts: doc.apply_attempts + 1 }
    }
}

/// The instances reconciler's pass over a tenant's live instances at `now_ms`, given the
/// reservations they run on (live ones; a reservation absent from `reservations` has ended).
/// For each instance, in id order, at most one action:
///
/// 1. its reservation ended and it is not being deleted: delete it;
/// 2. its apply went unanswered past the deadline: apply again (or fail);
/// 3. the node answered and the domain is gone after a delete: `deleted`;
/// 4. the node answered and what it observes is not what is desired (the apply failed, or the
///    domain drifted since): apply again after [`INSTANCE_REAPPLY_BACKOFF_MS`] × the attempts so
///    far (or fail).
pub fn instances_plan(
    instances: &[InstanceDoc],
    reservations: &HashMap<String, ReservationDoc>,
    now_ms: u64,
) -> Vec<InstanceAction> {
    let mut sorted: Vec<&InstanceDoc> = instances.iter().filter(|i| i.state.is_live()).collect();
    sorted.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
    let mut actions = Vec::new();
    for doc in sorted {
        let reservation = reservations.get(&doc.reservation_id).filter(|r| r.state == ReservationState::Active);
        if reservation.is_none() && doc.desired != DesiredState::Deleted {
            actions.push(InstanceAction::Delete {
                instance_id: doc.instance_id.clone(),
                version: doc.version,
                reason: format!("reservation-ended: reservation {} ended", doc.reservation_id),
            });
            continue;
        }
        let Some(answered_at_ms) = doc.apply.answered_at_ms else {
            if now_ms > doc.apply.deadline_at_ms {
                let reason = format!("apply-timeout: node {} did not answer instance.apply by its deadline", doc.node_id);
                actions.push(again(doc, reason));
            }
            continue;
        };
        if doc.converged() {
            if doc.desired == DesiredState::Deleted {
                actions.push(InstanceAction::Deleted {
                    instance_id: doc.instance_id.clone(),
                    version: doc.version,
                    reservation_id: doc.reservation_id.clone(),
                    reservation_version: reservations.get(&doc.reservation_id).map(|r| r.version),
                });
            }
            continue;
        }
        let since = doc.observed.as_ref().map_or(answered_at_ms, |o| o.at_ms.max(answered_at_ms));
        if now_ms < since.saturating_add(INSTANCE_REAPPLY_BACKOFF_MS.saturating_mul(doc.apply_attempts.max(1).into())) {
            continue;
        }
        let reason = match (&doc.apply.failed, &doc.observed) {
            (Some(failed), _) => failed.clone(),
            (None, Some(observed)) => format!(
                "drift: node {} observes {}{}, desired {}",
                doc.node_id,
                observed.state.as_str(),
                match (observed.vcpus, observed.memory_mib) {
                    (Some(v), Some(m)) if observed.state.satisfies(doc.desired) => format!(" with {v} vCPUs and {m} MiB"),
                    _ => String::new(),
                },
                doc.desired.as_str()
            ),
            (None, None) => format!("drift: node {} reported nothing of it", doc.node_id),
        };
        actions.push(again(doc, reason));
    }
    actions
}
