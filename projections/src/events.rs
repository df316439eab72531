//! Event types and their payloads: the log's wire format (STYLE rule 5: separate from the HTTP
//! JSON and from the documents). The catalogue in `schema/EVENTS.md` lists the same types.
//! Field names are camelCase CBOR text keys; numbers are unsigned integers.
//!
//! Each type and its payload are declared beside the fold that reads them, in their aggregate's
//! module (`crate::pool`, `crate::node`, …); this module re-exports them all, so `events::X` is
//! the one path every crate names them by, and it holds what spans them: [`EVENT_TYPES`], the
//! types a node may originate, and the type filters of watches and webhooks.

use serde::Serialize;

pub use crate::batch::{
    APPROVER_SET_PUBLISHED, ApproverSetPublished, COMMAND_BATCH_APPROVED, COMMAND_BATCH_CANCELLED, COMMAND_BATCH_CHUNK_ISSUED,
    COMMAND_BATCH_CREATED, COMMAND_BATCH_EXPIRED, COMMAND_BATCH_RELEASED, COMMAND_BATCH_SCOPE_ADDED, CommandBatchApproved,
    CommandBatchChunkIssued, CommandBatchCreated, CommandBatchEnded, CommandBatchReleased, CommandBatchScopeAdded,
};
pub use crate::command::{
    COMMAND_CANCELLED, COMMAND_FAILED, COMMAND_ISSUED, COMMAND_STARTED, COMMAND_SUCCEEDED, CommandCancelled, CommandIssued,
    CommandProgress,
};
pub use crate::decide::sandbox_volume::{NODE_VOLUMES_PROMISED, NodeVolumesPromised};
pub use crate::decide::ssh_cert::{NODE_SSH_CERT_ISSUED, NodeSshCertIssued, SSH_CA_ROTATED, SshCaRotated};
pub use crate::flavor::{FLAVOR_CREATED, FLAVOR_DELETED, FLAVOR_UPDATED, FlavorCreated, FlavorDeleted, FlavorUpdated};
pub use crate::image::{
    DiskFormat, IMAGE_DELETED, IMAGE_PROMOTED, IMAGE_REGISTERED, ImageChannel, ImageDeleted, ImagePromoted, ImageRegistered,
};
pub use crate::instance::{
    DesiredState, INSTANCE_APPLY_FAILED, INSTANCE_CREATED, INSTANCE_DELETE_REQUESTED, INSTANCE_DELETED, INSTANCE_FAILED,
    INSTANCE_OBSERVED, INSTANCE_REAPPLIED, INSTANCE_REPORT_TYPES, INSTANCE_RESIZE_REQUESTED, INSTANCE_START_REQUESTED,
    INSTANCE_STOP_REQUESTED, InstanceCreated, InstanceDeleted, InstanceFailed, InstanceImage, InstanceReapplied, InstanceReport,
    InstanceRequested, InstanceShape, ObservedState,
};
pub use crate::inventory::{InventoryDisk, InventoryGpu, InventoryHost, NODE_INVENTORY_REPORTED, NodeInventoryReported};
pub use crate::join_request::{
    JOIN_REQUEST_APPROVED, JOIN_REQUEST_CREATED, JOIN_REQUEST_REJECTED, JoinRequestApproved, JoinRequestCreated,
    JoinRequestRejected,
};
pub use crate::join_token::{
    JOIN_TOKEN_CREATED, JOIN_TOKEN_REVOKED, JOIN_TOKEN_USED, JoinTokenCreated, JoinTokenRevoked, JoinTokenUsed,
};
pub use crate::node::{
    Gpu, NODE_AGENT_STARTED, NODE_ALLOCATED, NODE_CERTIFICATE_ISSUED, NODE_CORDONED, NODE_DELETED, NODE_DRAINING, NODE_FREED,
    NODE_JOINED, NODE_LABELED, NODE_OBSERVED, NODE_READY, NODE_REGISTERED, NODE_REVOKED, NODE_TAINTED, NODE_UNCORDONED,
    NODE_UNREACHABLE, NodeAgentStarted, NodeAllocated, NodeCertificateIssued, NodeDeleted, NodeFreed, NodeJoined,
    NodeKeysChanged, NodeLiveness, NodeObserved, NodeRegistered, NodeRevoked, NodeStateChanged, TpmEvidence,
};
pub use crate::node_ca::{NODE_CA_RENEWED, NodeCaRenewed};
pub use crate::pool::{
    POOL_ARCHIVED, POOL_CREATED, POOL_OFFERED, POOL_UNOFFERED, POOL_UPDATED, PoolArchived, PoolCreated, PoolOffers, PoolUpdated,
};
pub use crate::project::{PROJECT_ARCHIVED, PROJECT_CREATED, ProjectArchived, ProjectCreated};
pub use crate::quota::{
    QUOTA_CHARGED, QUOTA_COUNTED, QUOTA_EXCEEDED, QUOTA_RESOURCE_EXCEEDED, QUOTA_SET, QuotaCharged, QuotaCounted, QuotaExceeded,
    QuotaResourceExceeded, QuotaSet,
};
pub use crate::reservation::{
    GPU_HELD, GPU_HOLD_FAILED, GPU_RELEASED, GPU_REPORT_TYPES, GpuReport, HoldIssued, RESERVATION_ACTIVATED,
    RESERVATION_CANCELLED, RESERVATION_EXPIRED, RESERVATION_EXTENDED, RESERVATION_FAILED, RESERVATION_HELD_FOR,
    RESERVATION_INSTANCE_ATTACHED, RESERVATION_INSTANCE_DETACHED, RESERVATION_RELEASED, RESERVATION_REQUESTED,
    RESERVATION_REQUEUED, ReservationActivated, ReservationEnded, ReservationExtended, ReservationFailed, ReservationHeldFor,
    ReservationInstance, ReservationRequested, ReservationRequeued,
};
pub use crate::rollout::{
    RELEASE_REGISTERED, ROLLOUT_ABORTED, ROLLOUT_ABORTING, ROLLOUT_COMPLETED, ROLLOUT_CREATED, ROLLOUT_NODE_FAILED,
    ROLLOUT_NODE_ROLLBACK_FAILED, ROLLOUT_NODE_ROLLED_BACK, ROLLOUT_NODE_ROLLING_BACK, ROLLOUT_NODE_UPDATED,
    ROLLOUT_NODE_UPDATING, ROLLOUT_PAUSED, ROLLOUT_RESUMED, ROLLOUT_WAVE_PASSED,
};
pub use crate::sandbox::{
    SANDBOX_APPLY_FAILED, SANDBOX_CLAIMED, SANDBOX_CREATED, SANDBOX_DELETE_REQUESTED, SANDBOX_EXTENDED, SANDBOX_OBSERVED,
    SANDBOX_REPORT_TYPES, SANDBOX_TEMPLATE_CREATED, SANDBOX_TEMPLATE_DELETED, SANDBOX_TEMPLATE_UPDATED, SandboxClaimed,
    SandboxCreated, SandboxDeleteRequested, SandboxEnd, SandboxReport, SandboxShape, SandboxTemplateCreated,
    SandboxTemplateDeleted, SandboxTemplateUpdated,
};
pub use crate::sandbox_snapshot::{
    SANDBOX_SNAPSHOT_APPLY_FAILED, SANDBOX_SNAPSHOT_DELETE_REQUESTED, SANDBOX_SNAPSHOT_OBSERVED, SANDBOX_SNAPSHOT_REPORT_TYPES,
    SANDBOX_SNAPSHOT_REQUESTED, SandboxSnapshotDeleteRequested, SandboxSnapshotReport, SandboxSnapshotRequested,
};
pub use crate::sandbox_volume::{
    SANDBOX_VOLUME_APPLY_FAILED, SANDBOX_VOLUME_ATTACHED, SANDBOX_VOLUME_CREATED, SANDBOX_VOLUME_DELETE_REQUESTED,
    SANDBOX_VOLUME_DETACHED, SANDBOX_VOLUME_OBSERVED, SANDBOX_VOLUME_REPORT_TYPES, SANDBOX_VOLUME_RESIZE_REQUESTED,
    SandboxVolumeAttached, SandboxVolumeCreated, SandboxVolumeDeleteRequested, SandboxVolumeDetached, SandboxVolumeReport,
    SandboxVolumeResizeRequested, VolumeMount,
};
pub use crate::secret::{SECRET_DELETED, SECRET_PUT, SECRET_RESOLVED, SecretDeleted, SecretPut, SecretResolved};
pub use crate::site::{SITE_CREATED, SITE_DELETED, SITE_UPDATED, SiteCreated, SiteDeleted, SiteUpdated};
pub use crate::tenant::{
    API_KEY_CREATED, API_KEY_REVOKED, API_KEY_UPDATED, ApiKeyCreated, ApiKeyRevoked, ApiKeyUpdated, TENANT_CREATED, TenantCreated,
};
pub use crate::webhook::{
    WEBHOOK_CREATED, WEBHOOK_DELETED, WEBHOOK_PINGED, WEBHOOK_SECRET_ROTATED, WEBHOOK_UPDATED, WebhookCreated, WebhookDeleted,
    WebhookPinged, WebhookSecretRotated, WebhookUpdated,
};
pub use crate::workflow::{
    METAL_ENROLLED, METAL_MAINTENANCE_SET, METAL_POWER_DRIFTED, METAL_STEP_DONE, METAL_STEP_RETRIED, METAL_TRANSITIONED,
    METAL_WORKFLOW_FINISHED, METAL_WORKFLOW_PAUSED, METAL_WORKFLOW_RESUMED, MetalBmc, MetalEnrolled, MetalInspection,
    MetalMaintenanceSet, MetalPowerDrifted, MetalStepDone, MetalStepRetried, MetalTransitioned, MetalWorkflowFinished,
    MetalWorkflowRef, MetalWorkflowStart,
};

/// The event types a node may originate through its journal; nothing else is appended from one.
pub const NODE_ORIGINATED_TYPES: &[&str] = &[
    COMMAND_STARTED,
    COMMAND_SUCCEEDED,
    COMMAND_FAILED,
    NODE_OBSERVED,
    NODE_AGENT_STARTED,
    NODE_INVENTORY_REPORTED,
    GPU_HELD,
    GPU_HOLD_FAILED,
    GPU_RELEASED,
    INSTANCE_OBSERVED,
    INSTANCE_APPLY_FAILED,
    SANDBOX_OBSERVED,
    SANDBOX_APPLY_FAILED,
    SANDBOX_VOLUME_OBSERVED,
    SANDBOX_VOLUME_APPLY_FAILED,
    SANDBOX_SNAPSHOT_OBSERVED,
    SANDBOX_SNAPSHOT_APPLY_FAILED,
];

/// Every event type this version writes.
pub const EVENT_TYPES: &[&str] = &[
    TENANT_CREATED,
    API_KEY_CREATED,
    API_KEY_UPDATED,
    API_KEY_REVOKED,
    POOL_CREATED,
    POOL_UPDATED,
    POOL_ARCHIVED,
    POOL_OFFERED,
    POOL_UNOFFERED,
    NODE_REGISTERED,
    NODE_CORDONED,
    NODE_UNCORDONED,
    NODE_DRAINING,
    NODE_LABELED,
    NODE_TAINTED,
    NODE_ALLOCATED,
    NODE_FREED,
    NODE_DELETED,
    NODE_SSH_CERT_ISSUED,
    NODE_VOLUMES_PROMISED,
    RESERVATION_REQUESTED,
    RESERVATION_HELD_FOR,
    RESERVATION_ACTIVATED,
    RESERVATION_EXTENDED,
    RESERVATION_RELEASED,
    RESERVATION_EXPIRED,
    RESERVATION_CANCELLED,
    QUOTA_SET,
    QUOTA_EXCEEDED,
    QUOTA_RESOURCE_EXCEEDED,
    QUOTA_CHARGED,
    QUOTA_COUNTED,
    WEBHOOK_CREATED,
    WEBHOOK_UPDATED,
    WEBHOOK_SECRET_ROTATED,
    WEBHOOK_PINGED,
    WEBHOOK_DELETED,
    SECRET_PUT,
    SECRET_DELETED,
    SECRET_RESOLVED,
    SITE_CREATED,
    SITE_UPDATED,
    SITE_DELETED,
    PROJECT_CREATED,
    PROJECT_ARCHIVED,
    FLAVOR_CREATED,
    FLAVOR_UPDATED,
    FLAVOR_DELETED,
    IMAGE_REGISTERED,
    IMAGE_PROMOTED,
    IMAGE_DELETED,
    JOIN_TOKEN_CREATED,
    JOIN_TOKEN_USED,
    JOIN_TOKEN_REVOKED,
    JOIN_REQUEST_CREATED,
    JOIN_REQUEST_APPROVED,
    JOIN_REQUEST_REJECTED,
    NODE_JOINED,
    NODE_READY,
    NODE_UNREACHABLE,
    NODE_CERTIFICATE_ISSUED,
    NODE_REVOKED,
    NODE_CA_RENEWED,
    COMMAND_ISSUED,
    COMMAND_CANCELLED,
    COMMAND_STARTED,
    COMMAND_SUCCEEDED,
    COMMAND_FAILED,
    APPROVER_SET_PUBLISHED,
    COMMAND_BATCH_CREATED,
    COMMAND_BATCH_SCOPE_ADDED,
    COMMAND_BATCH_APPROVED,
    COMMAND_BATCH_RELEASED,
    COMMAND_BATCH_CHUNK_ISSUED,
    COMMAND_BATCH_CANCELLED,
    COMMAND_BATCH_EXPIRED,
    NODE_OBSERVED,
    NODE_AGENT_STARTED,
    NODE_INVENTORY_REPORTED,
    GPU_HELD,
    GPU_HOLD_FAILED,
    GPU_RELEASED,
    RESERVATION_REQUEUED,
    RESERVATION_FAILED,
    INSTANCE_CREATED,
    INSTANCE_START_REQUESTED,
    INSTANCE_STOP_REQUESTED,
    INSTANCE_RESIZE_REQUESTED,
    INSTANCE_DELETE_REQUESTED,
    INSTANCE_REAPPLIED,
    INSTANCE_FAILED,
    INSTANCE_DELETED,
    INSTANCE_OBSERVED,
    INSTANCE_APPLY_FAILED,
    RESERVATION_INSTANCE_ATTACHED,
    RESERVATION_INSTANCE_DETACHED,
    SANDBOX_TEMPLATE_CREATED,
    SANDBOX_TEMPLATE_UPDATED,
    SANDBOX_TEMPLATE_DELETED,
    SANDBOX_CREATED,
    SANDBOX_CLAIMED,
    SANDBOX_EXTENDED,
    SANDBOX_DELETE_REQUESTED,
    SANDBOX_OBSERVED,
    SANDBOX_APPLY_FAILED,
    SANDBOX_VOLUME_CREATED,
    SANDBOX_VOLUME_RESIZE_REQUESTED,
    SANDBOX_VOLUME_ATTACHED,
    SANDBOX_VOLUME_DETACHED,
    SANDBOX_VOLUME_DELETE_REQUESTED,
    SANDBOX_VOLUME_OBSERVED,
    SANDBOX_VOLUME_APPLY_FAILED,
    SANDBOX_SNAPSHOT_REQUESTED,
    SANDBOX_SNAPSHOT_DELETE_REQUESTED,
    SANDBOX_SNAPSHOT_OBSERVED,
    SANDBOX_SNAPSHOT_APPLY_FAILED,
    METAL_ENROLLED,
    METAL_TRANSITIONED,
    METAL_STEP_DONE,
    METAL_STEP_RETRIED,
    METAL_WORKFLOW_FINISHED,
    METAL_WORKFLOW_PAUSED,
    METAL_WORKFLOW_RESUMED,
    RELEASE_REGISTERED,
    ROLLOUT_CREATED,
    ROLLOUT_NODE_UPDATING,
    ROLLOUT_NODE_UPDATED,
    ROLLOUT_NODE_FAILED,
    ROLLOUT_NODE_ROLLING_BACK,
    ROLLOUT_NODE_ROLLED_BACK,
    ROLLOUT_NODE_ROLLBACK_FAILED,
    ROLLOUT_WAVE_PASSED,
    ROLLOUT_PAUSED,
    ROLLOUT_RESUMED,
    ROLLOUT_ABORTING,
    ROLLOUT_ABORTED,
    ROLLOUT_COMPLETED,
    METAL_MAINTENANCE_SET,
    METAL_POWER_DRIFTED,
    crate::tunnel::TUNNEL_OPENED,
    crate::tunnel::TUNNEL_CLOSED,
    crate::tunnel::TUNNEL_REFUSED,
    bc_core::audit::CHECKPOINT_SEALED,
    bc_core::audit::CHECKPOINT_COSIGNED,
    bc_core::audit::LOG_KEY_ROTATED,
    SSH_CA_ROTATED,
    crate::usage::USAGE_WINDOW_CLOSED,
    crate::usage::USAGE_CORRECTION,
    crate::usage::USAGE_PRICE_SET,
    crate::fleet_config::FLEET_APPLIED,
    crate::fleet_config::FLEET_OBJECTS,
    crate::fleet_config::FLEET_DRIFTED,
];

/// Most patterns one filter (a watch, a webhook) takes.
pub const TYPE_PATTERNS_MAX: usize = 20;

/// Event type patterns: a type (`pool.created`), a prefix (`pool.*`) or `*`. Empty: every type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TypeFilter {
    patterns: Vec<String>,
}

impl TypeFilter {
    /// Parses and checks patterns against the event catalogue: a pattern that matches no known
    /// type is a mistake, not an empty stream.
    pub fn parse(patterns: &[String]) -> bc_core::Result<Self> {
        use bc_core::Error;
        if patterns.len() > TYPE_PATTERNS_MAX {
            return Err(Error::invalid(format!("at most {TYPE_PATTERNS_MAX} type patterns, not {}", patterns.len())));
        }
        for p in patterns {
            let well_formed = p == "*"
                || (!p.is_empty()
                    && p.len() <= 100
                    && p.trim_end_matches(".*").split('.').all(|part| {
                        !part.is_empty() && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
                    }));
            if !well_formed {
                return Err(Error::InvalidArgument {
                    message: format!("malformed type pattern {:?}", bc_core::id::truncate(p, 60)),
                    hint: Some("a pattern is a type (pool.created), a prefix (pool.*) or *".into()),
                });
            }
            if !EVENT_TYPES.iter().any(|t| pattern_matches(p, t)) {
                return Err(Error::InvalidArgument {
                    message: format!("unknown type pattern {:?}: it matches no event type", bc_core::id::truncate(p, 60)),
                    hint: Some(format!("event types: {}", EVENT_TYPES.join(", "))),
                });
            }
        }
        Ok(Self { patterns: patterns.to_vec() })
    }

    pub fn matches(&self, event_type: &str) -> bool {
        self.patterns.is_empty() || self.patterns.iter().any(|p| pattern_matches(p, event_type))
    }
}

fn pattern_matches(pattern: &str, event_type: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some("") => true,
        Some(prefix) => event_type.starts_with(prefix),
        None => pattern == event_type,
    }
}

/// A payload as CBOR, ready for an append.
pub fn to_cbor<T: Serialize>(payload: &T) -> bc_core::Result<ciborium::Value> {
    let json = serde_json::to_value(payload).map_err(|e| bc_core::Error::Internal(format!("payload: {e}")))?;
    bc_core::canonical::from_json(&json)
}

/// Every pattern [`TypeFilter::parse`] accepts: `*`, each type, and each prefix (`pool.*`) of
/// some type. The OpenAPI document lists them.
pub fn type_patterns() -> Vec<String> {
    let mut patterns = vec!["*".to_owned()];
    for event_type in EVENT_TYPES {
        let mut prefix = String::new();
        for part in event_type.split('.') {
            let pattern = format!("{prefix}{part}.*");
            if !patterns.contains(&pattern) && EVENT_TYPES.iter().any(|t| t.starts_with(&pattern[..pattern.len() - 1])) {
                patterns.push(pattern);
            }
            prefix.push_str(part);
            prefix.push('.');
        }
        patterns.push((*event_type).to_owned());
    }
    patterns
}
