//! The decisions about sandbox snapshots: take one of a running sandbox ([`snapshot_create`]),
//! delete one ([`snapshot_delete`]), where a restore runs ([`restore_node`]), and the `sandboxes`
//! reconciler's pass over them ([`snapshots_plan`]): a snapshot without `keep` goes with its
//! sandbox, and a delete its node did not answer is sent again.
//!
//! Bounds (named, checked here): [`SANDBOX_SNAPSHOTS_PER_TENANT_MAX`] snapshots and
//! [`SANDBOX_SNAPSHOT_BYTES_PER_TENANT_MAX`] bytes a tenant, [`SANDBOX_SNAPSHOTS_PER_NODE_MAX`]
//! and [`SANDBOX_SNAPSHOT_BYTES_PER_NODE_MAX`] a node (the node's agent refuses past the same
//! figures, `capacity`). A snapshot not yet taken counts at its estimate, the sandbox's memory.

use bc_core::Error;
use bc_core::store::{ExpectedVersion, NewEvent};

use super::Append;
use crate::events::to_cbor;
use crate::placement::{Issue, issue_command_for};
use crate::sandbox::{KIND_SANDBOX, SandboxDoc, SandboxState, SandboxTemplateDoc};
use crate::sandbox_snapshot::{
    KIND_SANDBOX_SNAPSHOT, SANDBOX_SNAPSHOT_APPLY, SANDBOX_SNAPSHOT_APPLY_DEADLINE_S, SANDBOX_SNAPSHOT_DELETE_REQUESTED,
    SANDBOX_SNAPSHOT_REQUESTED, SandboxSnapshotDeleteRequested, SandboxSnapshotDoc, SandboxSnapshotRequested,
    SandboxSnapshotState,
};
use crate::{NodeDoc, stream_of};

/// The most snapshots a tenant keeps (not yet deleted).
pub const SANDBOX_SNAPSHOTS_PER_TENANT_MAX: usize = 32;
/// The most bytes of snapshots a tenant keeps (32 GiB).
pub const SANDBOX_SNAPSHOT_BYTES_PER_TENANT_MAX: u64 = 32 * 1024 * 1024 * 1024;
/// The most snapshots one node keeps: its agent's `SNAPSHOTS_PER_NODE_MAX`.
pub const SANDBOX_SNAPSHOTS_PER_NODE_MAX: usize = 64;
/// The most bytes of snapshots one node keeps (64 GiB): its agent's `SNAPSHOT_BYTES_PER_NODE_MAX`.
pub const SANDBOX_SNAPSHOT_BYTES_PER_NODE_MAX: u64 = 64 * 1024 * 1024 * 1024;

/// Whether a snapshot of `estimated_bytes` more fits the bounds: `tenant` the tenant's live
/// snapshots, `node` the live snapshots on the sandbox's node that the caller can see.
pub fn check_bounds(
    tenant: &[SandboxSnapshotDoc],
    node: &[SandboxSnapshotDoc],
    node_id: &str,
    estimated_bytes: u64,
) -> Result<(), Error> {
    let live = |s: &&SandboxSnapshotDoc| s.state != SandboxSnapshotState::Deleted;
    let count = tenant.iter().filter(live).count();
    if count >= SANDBOX_SNAPSHOTS_PER_TENANT_MAX {
        return Err(Error::QuotaExceeded(format!(
            "the tenant keeps {count} snapshots, its most (SANDBOX_SNAPSHOTS_PER_TENANT_MAX {SANDBOX_SNAPSHOTS_PER_TENANT_MAX}): \
             delete some (sandbox-snapshot delete)"
        )));
    }
    let bytes: u64 = tenant.iter().filter(live).map(|s| s.bytes).fold(0, u64::saturating_add);
    if bytes.saturating_add(estimated_bytes) > SANDBOX_SNAPSHOT_BYTES_PER_TENANT_MAX {
        return Err(Error::QuotaExceeded(format!(
            "the tenant's snapshots hold {bytes} bytes; this one (up to {estimated_bytes}, the sandbox's memory) would pass \
             the {SANDBOX_SNAPSHOT_BYTES_PER_TENANT_MAX} a tenant keeps (SANDBOX_SNAPSHOT_BYTES_PER_TENANT_MAX): delete some"
        )));
    }
    let on_node: Vec<&SandboxSnapshotDoc> = node.iter().filter(live).filter(|s| s.node_id == node_id).collect();
    let node_bytes: u64 = on_node.iter().map(|s| s.bytes).fold(0, u64::saturating_add);
    if on_node.len() >= SANDBOX_SNAPSHOTS_PER_NODE_MAX
        || node_bytes.saturating_add(estimated_bytes) > SANDBOX_SNAPSHOT_BYTES_PER_NODE_MAX
    {
        return Err(Error::QuotaExceeded(format!(
            "node {node_id} keeps {} snapshots of {node_bytes} bytes; a node keeps at most {SANDBOX_SNAPSHOTS_PER_NODE_MAX} \
             (SANDBOX_SNAPSHOTS_PER_NODE_MAX) and {SANDBOX_SNAPSHOT_BYTES_PER_NODE_MAX} bytes (SANDBOX_SNAPSHOT_BYTES_PER_NODE_MAX)",
            on_node.len()
        )));
    }
    Ok(())
}

/// What `sandboxes.snapshot` decides on.
pub struct SnapshotInput<'a> {
    pub snapshot_id: &'a str,
    pub sandbox: &'a SandboxDoc,
    /// `--no-memory` refused: a disk-only snapshot has no form on this runtime (docs/sandboxes.md).
    pub memory: bool,
    pub keep: bool,
    /// The tenant's live snapshots.
    pub snapshots: &'a [SandboxSnapshotDoc],
}

/// A snapshot of a running sandbox: `sandbox_snapshot.requested` with its `sandbox.snapshot`
/// command to the sandbox's node, guarded at the sandbox's version (a delete landing first wins).
pub fn snapshot_create(input: &SnapshotInput<'_>, issue: Issue<'_>) -> Result<Append, Error> {
    let sandbox = input.sandbox;
    if !input.memory {
        return Err(Error::Unsupported {
            message: "a snapshot without memory (--no-memory) is not built: the sandbox's disk layer lives in gVisor's \
                      memory and is saved only with it"
                .into(),
            reason: "no-memory".into(),
        });
    }
    if !sandbox.volumes.is_empty() {
        return Err(Error::Unsupported {
            message: format!("sandbox {} mounts volumes: a snapshot would not hold them", sandbox.sandbox_id),
            reason: "volumes".into(),
        });
    }
    if sandbox.state != SandboxState::Running {
        return Err(Error::state(
            format!("sandbox {} is {}, not running", sandbox.sandbox_id, sandbox.state.as_str()),
            "snapshot a running sandbox",
        ));
    }
    let estimated_bytes = sandbox.shape.memory_mib.saturating_mul(1024 * 1024);
    check_bounds(input.snapshots, input.snapshots, &sandbox.node_id, estimated_bytes)?;
    let mut guards = vec![(stream_of(KIND_SANDBOX, &sandbox.sandbox_id), ExpectedVersion::Exact(sandbox.version))];
    let args = SandboxSnapshotDoc::apply_args(input.snapshot_id, &sandbox.sandbox_id, "ready");
    let (command, apply) =
        issue_command_for(&sandbox.node_id, SANDBOX_SNAPSHOT_APPLY, args, SANDBOX_SNAPSHOT_APPLY_DEADLINE_S, issue, &mut guards)?;
    let requested = SandboxSnapshotRequested {
        sandbox_id: sandbox.sandbox_id.clone(),
        template_id: sandbox.template_id.clone(),
        pool_id: sandbox.pool_id.clone(),
        node_id: sandbox.node_id.clone(),
        memory: true,
        keep: input.keep,
        estimated_bytes,
        apply,
    };
    Ok(Append {
        stream: stream_of(KIND_SANDBOX_SNAPSHOT, &input.snapshot_id),
        expected: ExpectedVersion::NoStream,
        guards,
        events: vec![NewEvent::new(SANDBOX_SNAPSHOT_REQUESTED, to_cbor(&requested)?), command],
    })
}

/// A delete: `sandbox_snapshot.delete_requested` with its `sandbox.snapshot` (`desired:
/// deleted`). A caller may not delete one being deleted; the reconciler (`reason`) sends it again.
pub fn snapshot_delete(doc: &SandboxSnapshotDoc, reason: Option<String>, issue: Issue<'_>) -> Result<Append, Error> {
    if reason.is_none() && matches!(doc.state, SandboxSnapshotState::Deleting | SandboxSnapshotState::Deleted) {
        return Err(Error::state(format!("snapshot {} is {}", doc.snapshot_id, doc.state.as_str()), "nothing to do"));
    }
    let mut guards = Vec::new();
    let args = SandboxSnapshotDoc::apply_args(&doc.snapshot_id, &doc.sandbox_id, "deleted");
    let (command, apply) =
        issue_command_for(&doc.node_id, SANDBOX_SNAPSHOT_APPLY, args, SANDBOX_SNAPSHOT_APPLY_DEADLINE_S, issue, &mut guards)?;
    Ok(Append {
        stream: stream_of(KIND_SANDBOX_SNAPSHOT, &doc.snapshot_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards,
        events: vec![
            NewEvent::new(SANDBOX_SNAPSHOT_DELETE_REQUESTED, to_cbor(&SandboxSnapshotDeleteRequested { apply, reason })?),
            command,
        ],
    })
}

/// The node a restore of `snapshot` as a sandbox of `template` runs on: the snapshot's (the
/// node that holds its files; snapshots do not move between nodes yet), which must be ready and
/// run sandboxes. The snapshot must be `ready` and of this template.
pub fn restore_node<'a>(
    snapshot: &SandboxSnapshotDoc,
    template: &SandboxTemplateDoc,
    nodes: &'a [NodeDoc],
) -> Result<&'a NodeDoc, Error> {
    if snapshot.state != SandboxSnapshotState::Ready || snapshot.sha256.is_none() {
        return Err(Error::state(
            format!("snapshot {} is {}, not ready", snapshot.snapshot_id, snapshot.state.as_str()),
            "wait until sandbox-snapshot get shows it ready",
        ));
    }
    if snapshot.template_id != template.template_id {
        return Err(Error::invalid(format!(
            "snapshot {} is of a sandbox of template {}, not {}: restore it with --template {}",
            snapshot.snapshot_id, snapshot.template_id, template.template_id, snapshot.template_id
        )));
    }
    if !template.volumes.is_empty() {
        return Err(Error::Unsupported {
            message: format!("template {} mounts volumes: a restore of it is not built", template.template_id),
            reason: "volumes".into(),
        });
    }
    nodes.iter().find(|n| n.node_id == snapshot.node_id && super::sandbox::runs_sandboxes(n, &template.pool_id)).ok_or_else(
        || {
            Error::state(
                format!(
                    "node {} that holds snapshot {} is not ready to run sandboxes (snapshots do not move between nodes yet)",
                    snapshot.node_id, snapshot.snapshot_id
                ),
                "wait until the node is ready",
            )
        },
    )
}

/// The reconciler's pass over a tenant's live snapshots at `now_ms`: a snapshot without `keep`
/// whose sandbox is no longer live is deleted (`sandbox-deleted`), and a delete its node did not
/// answer by its deadline is sent again. `live_sandboxes`: the ids of the tenant's live sandboxes.
pub fn snapshots_plan(snapshots: &[SandboxSnapshotDoc], live_sandboxes: &[&str], now_ms: u64) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for s in snapshots {
        match s.state {
            SandboxSnapshotState::Deleted => {}
            SandboxSnapshotState::Deleting if now_ms >= s.apply.deadline_at_ms => {
                out.push((s.snapshot_id.clone(), format!("retry: node {} did not delete it by its deadline", s.node_id)));
            }
            SandboxSnapshotState::Deleting => {}
            // One being taken is left to its answer: its delete would race the checkpoint.
            SandboxSnapshotState::Taking => {}
            _ if !s.keep && !live_sandboxes.contains(&s.sandbox_id.as_str()) => {
                out.push((s.snapshot_id.clone(), "sandbox-deleted".into()))
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox_snapshot::SnapshotApply;

    fn snap(id: &str, node: &str, bytes: u64, state: SandboxSnapshotState, keep: bool) -> SandboxSnapshotDoc {
        SandboxSnapshotDoc {
            tenant_id: "t".into(),
            snapshot_id: id.into(),
            sandbox_id: "sbx_a".into(),
            template_id: "sbxt_a".into(),
            pool_id: "pool_a".into(),
            node_id: node.into(),
            memory: true,
            keep,
            state,
            sha256: Some("a".repeat(64)),
            bytes,
            created_by: "u".into(),
            apply: SnapshotApply {
                command_id: "cmd_1".into(),
                desired: "ready".into(),
                deadline_at_ms: 100,
                answered_at_ms: None,
            },
            last_error: None,
            version: 1,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    #[test]
    fn snapshots_are_bounded_per_tenant_and_per_node() {
        let gib = 1024 * 1024 * 1024;
        let many: Vec<_> = (0..SANDBOX_SNAPSHOTS_PER_TENANT_MAX)
            .map(|i| snap(&format!("snap_{i}"), "node_a", 1, SandboxSnapshotState::Ready, true))
            .collect();
        assert!(matches!(check_bounds(&many, &many, "node_a", 1), Err(Error::QuotaExceeded(_))));
        assert!(check_bounds(&many[1..], &many[1..], "node_a", 1).is_ok());
        let big = vec![snap("snap_b", "node_a", 31 * gib, SandboxSnapshotState::Ready, true)];
        assert!(check_bounds(&big, &big, "node_a", gib).is_ok());
        let err = check_bounds(&big, &big, "node_a", gib + 1).unwrap_err();
        assert!(matches!(&err, Error::QuotaExceeded(m) if m.contains("SANDBOX_SNAPSHOT_BYTES_PER_TENANT_MAX")), "{err:?}");
        // Deleted ones do not count.
        let gone = vec![snap("snap_b", "node_a", 31 * gib, SandboxSnapshotState::Deleted, true)];
        assert!(check_bounds(&gone, &gone, "node_a", 32 * gib).is_ok());
        // The node's bytes, among the snapshots seen on it.
        let node = vec![snap("snap_x", "node_a", 63 * gib, SandboxSnapshotState::Ready, true)];
        let err = check_bounds(&[], &node, "node_a", gib + 1).unwrap_err();
        assert!(matches!(&err, Error::QuotaExceeded(m) if m.contains("SANDBOX_SNAPSHOT_BYTES_PER_NODE_MAX")), "{err:?}");
        assert!(check_bounds(&[], &node, "node_b", gib + 1).is_ok());
    }

    #[test]
    fn a_snapshot_without_keep_goes_with_its_sandbox() {
        let snaps = vec![
            snap("snap_1", "n", 1, SandboxSnapshotState::Ready, false),
            snap("snap_2", "n", 1, SandboxSnapshotState::Ready, true),
            snap("snap_3", "n", 1, SandboxSnapshotState::Taking, false),
            snap("snap_4", "n", 1, SandboxSnapshotState::Deleting, false),
        ];
        assert_eq!(snapshots_plan(&snaps, &["sbx_a"], 50), vec![]);
        let plan = snapshots_plan(&snaps, &[], 50);
        assert_eq!(plan, vec![("snap_1".to_owned(), "sandbox-deleted".to_owned())]);
        let plan = snapshots_plan(&snaps, &[], 100);
        assert_eq!(plan.len(), 2);
        assert!(plan[1].1.starts_with("retry:"));
    }
}
