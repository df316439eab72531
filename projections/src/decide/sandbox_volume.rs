//! The decisions about sandbox volumes: make one on a node of its pool
//! ([`sandbox_volume_create`]), grow it ([`sandbox_volume_resize`]), delete it
//! ([`sandbox_volume_delete`]), check the volumes a template names ([`check_template_volumes`]),
//! attach them to a new sandbox ([`attach_volumes`], guarded by each volume's version, so a
//! volume mounts in at most one live sandbox), and detach them once that sandbox is no longer
//! live ([`volumes_to_detach`], the `sandboxes` reconciler's).
//!
//! A volume is **mounted** while the sandbox its attachment names has a live row (not yet
//! deleted, a failed one included: its node may still hold it). Every bound is a named constant
//! checked here.

use bc_core::Error;
use bc_core::store::{ExpectedVersion, NewEvent};

use super::Append;
use crate::events::*;
use crate::placement::{Issue, issue_command_for};
use crate::sandbox::{SandboxDoc, SandboxState, SandboxTemplateDoc};
use crate::sandbox_volume::{
    CAPABILITY_SANDBOX_VOLUMES, KIND_SANDBOX_VOLUME, SANDBOX_VOLUME_APPLY, SANDBOX_VOLUME_APPLY_DEADLINE_S, SandboxVolumeDoc,
    SandboxVolumeState,
};
use crate::{NodeDoc, PoolDoc, stream_of};

/// The smallest volume, in GiB.
pub const SANDBOX_VOLUME_SIZE_MIN_GIB: u64 = 1;
/// The largest volume, in GiB (16 TiB).
pub const SANDBOX_VOLUME_SIZE_MAX_GIB: u64 = 16 * 1024;
/// The most volumes a tenant has at once (those being deleted count until they are gone).
pub const SANDBOX_VOLUMES_PER_TENANT_MAX: usize = 64;
/// The most volumes one template mounts.
pub const SANDBOX_TEMPLATE_VOLUMES_MAX: usize = 8;
/// The longest mount path inside a sandbox.
pub const SANDBOX_VOLUME_PATH_BYTES_MAX: usize = 256;
/// Where a volume may not be mounted: what the runtime itself puts there.
pub const SANDBOX_VOLUME_PATHS_RESERVED: &[&str] = &["/proc", "/dev", "/sys", "/tmp"];

const _: () = assert!(SANDBOX_VOLUME_SIZE_MIN_GIB >= 1 && SANDBOX_VOLUME_SIZE_MIN_GIB < SANDBOX_VOLUME_SIZE_MAX_GIB);

/// What a node's volumes promise of its disk changed (on the node's stream, in the same append
/// as the volume's creation or growth, at the node's version the decision read). It moves the
/// node's version, so of two decisions that read the node before either landed (two requests,
/// two gateways) the second is a `CONFLICT` instead of both passing [`check_node_disk`]; the
/// node's document shows nothing new.
pub const NODE_VOLUMES_PROMISED: &str = "node.volumes_promised";

/// `node.volumes_promised`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NodeVolumesPromised {
    /// The volume made or grown.
    pub volume_id: String,
    /// What the node's volumes promise with it, in GiB.
    #[serde(rename = "promisedGiB")]
    pub promised_gib: u64,
}

/// The guard and the event that take `node`'s disk for a decision ([`NODE_VOLUMES_PROMISED`]).
fn promise(
    node: &NodeDoc,
    volume_id: &str,
    promised_gib: u64,
    guards: &mut Vec<(String, ExpectedVersion)>,
) -> Result<NewEvent, Error> {
    let stream = stream_of(crate::KIND_NODE, &node.node_id);
    guards.push((stream.clone(), ExpectedVersion::Exact(node.version)));
    let payload = to_cbor(&NodeVolumesPromised { volume_id: volume_id.to_owned(), promised_gib })?;
    Ok(NewEvent { stream: Some(stream), event_type: NODE_VOLUMES_PROMISED.into(), payload })
}

/// A volume's size: whole GiB, [`SANDBOX_VOLUME_SIZE_MIN_GIB`] to [`SANDBOX_VOLUME_SIZE_MAX_GIB`].
pub fn check_size(size_gib: u64) -> Result<(), Error> {
    if !(SANDBOX_VOLUME_SIZE_MIN_GIB..=SANDBOX_VOLUME_SIZE_MAX_GIB).contains(&size_gib) {
        return Err(Error::InvalidArgument {
            message: format!("sizeGiB is {size_gib}, outside {SANDBOX_VOLUME_SIZE_MIN_GIB} to {SANDBOX_VOLUME_SIZE_MAX_GIB} GiB"),
            hint: Some(format!("ask for {SANDBOX_VOLUME_SIZE_MIN_GIB} to {SANDBOX_VOLUME_SIZE_MAX_GIB} GiB")),
        });
    }
    Ok(())
}

/// A mount path inside a sandbox: absolute, plain components (no `.`, `..` or empty one), not
/// `/` nor under what the runtime mounts itself ([`SANDBOX_VOLUME_PATHS_RESERVED`]), at most
/// [`SANDBOX_VOLUME_PATH_BYTES_MAX`] bytes of printable ASCII but `:` and `,` (the CLI's
/// separators).
pub fn check_mount_path(path: &str) -> Result<(), Error> {
    let bad = |why: &str| {
        Err(Error::InvalidArgument {
            message: format!("mount path {:?} {why}", bc_core::id::truncate(path, 60)),
            hint: Some("an absolute path such as /workspace".into()),
        })
    };
    if path.len() > SANDBOX_VOLUME_PATH_BYTES_MAX {
        return bad(&format!("is longer than {SANDBOX_VOLUME_PATH_BYTES_MAX} bytes"));
    }
    if !path.starts_with('/') || path == "/" {
        return bad("is not an absolute path below /");
    }
    if !path.bytes().all(|b| b.is_ascii_graphic() && b != b':' && b != b',') {
        return bad("holds a character other than printable ASCII (but : and ,)");
    }
    if path[1..].split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return bad("has an empty, . or .. component");
    }
    if SANDBOX_VOLUME_PATHS_RESERVED.iter().any(|r| path == *r || path.strip_prefix(r).is_some_and(|rest| rest.starts_with('/')))
    {
        return bad(&format!("is where the runtime mounts its own ({})", SANDBOX_VOLUME_PATHS_RESERVED.join(", ")));
    }
    Ok(())
}

/// The live sandbox that mounts `volume`, if one does (`live`: the tenant's live sandboxes).
pub fn mounted_by<'a>(volume: &'a SandboxVolumeDoc, live: &[SandboxDoc]) -> Option<&'a str> {
    let attached = volume.attachment.as_ref()?;
    live.iter()
        .any(|s| s.sandbox_id == attached.sandbox_id && s.state != SandboxState::Deleted)
        .then_some(attached.sandbox_id.as_str())
}

fn attached_error(volume: &SandboxVolumeDoc, sandbox: &str, what: &str) -> Error {
    Error::state(
        format!("volume {} is attached to sandbox {sandbox}: {what}", volume.volume_id),
        format!("delete sandbox {sandbox} first (sandbox delete {sandbox}), or wait for its end"),
    )
}

/// How much of the file system under a node's volumes their sizes may promise together, in
/// percent of its size: 100, the whole file system. The images are sparse, so this bounds what
/// they can come to hold, not what they hold now: within it, volumes that each stay within their
/// size cannot together need more than the disk (the journal and ledgers beside them still
/// share it: an operator keeps the volumes on their own file system for a hard line). Above 100,
/// a node would promise bytes it does not have; below, it would refuse volumes the disk holds.
pub const SANDBOX_VOLUME_NODE_FILE_SYSTEM_PERCENT: u64 = 100;
const GIB: u64 = 1 << 30;

/// The GiB the volumes on `node_id` promise (`volumes`: the tenant's live volumes, those being
/// deleted included, their files still there): each one's size, or the size a resize in flight
/// grows it to.
pub fn node_volumes_gib(volumes: &[SandboxVolumeDoc], node_id: &str) -> u64 {
    volumes
        .iter()
        .filter(|v| v.node_id == node_id && v.state != SandboxVolumeState::Deleted)
        .map(|v| v.size_gib.max(v.requested_size_gib.unwrap_or(0)))
        .fold(0, u64::saturating_add)
}

/// Whether `node` holds `adding_gib` more of volumes beside the `promised_gib` its volumes
/// promise: within [`SANDBOX_VOLUME_NODE_FILE_SYSTEM_PERCENT`] of the file system size its agent
/// reports (`volumeFileSystemBytes`; a node that reports none holds none). `QUOTA_EXCEEDED`
/// otherwise, with the figures.
pub fn check_node_disk(node: &NodeDoc, promised_gib: u64, adding_gib: u64) -> Result<(), Error> {
    let reported = node.agent.as_ref().and_then(|a| a.inventory.as_ref()).and_then(|i| i.volume_file_system_bytes);
    let limit_bytes = u128::from(reported.unwrap_or(0)) * u128::from(SANDBOX_VOLUME_NODE_FILE_SYSTEM_PERCENT) / 100;
    let wanted_bytes = u128::from(promised_gib.saturating_add(adding_gib)) * u128::from(GIB);
    if wanted_bytes <= limit_bytes {
        return Ok(());
    }
    let limit_gib = limit_bytes / u128::from(GIB);
    Err(Error::QuotaExceeded(match reported {
        None => format!("node {} has not reported the size of its volumes' file system; it takes no volume", node.node_id),
        Some(_) => format!(
            "node {}'s volumes would promise {} GiB ({promised_gib} GiB now, {adding_gib} GiB more), past the {limit_gib} GiB \
             of its volumes' file system ({SANDBOX_VOLUME_NODE_FILE_SYSTEM_PERCENT} %): \
             delete a volume of this node, or ask for less",
            node.node_id,
            promised_gib.saturating_add(adding_gib)
        ),
    }))
}

/// Whether `node` can keep a new volume of `pool_id`: it runs sandboxes (ready, of the pool,
/// `sandbox.gvisor`) and its agent advertises [`CAPABILITY_SANDBOX_VOLUMES`].
pub fn keeps_volumes(node: &NodeDoc, pool_id: &str) -> bool {
    let capabilities = node.agent.as_ref().and_then(|a| a.inventory.as_ref()).map(|i| i.capabilities.as_slice());
    super::sandbox::runs_sandboxes(node, pool_id)
        && capabilities.unwrap_or_default().iter().any(|c| c == CAPABILITY_SANDBOX_VOLUMES)
}

/// The node a new volume of `size_gib` in `pool_id` goes to: of the pool's nodes that keep
/// volumes ([`keeps_volumes`]) and hold `size_gib` more ([`check_node_disk`] over `volumes`, the
/// tenant's live volumes), the one with the fewest live sandboxes (`load`), then the lowest id.
/// Refused when no node of the pool runs sandboxes (`INVALID_STATE`, as a sandbox is), when
/// those that do all lack the capability (`UNSUPPORTED`, reason `daemon-capability`: their agents
/// found no `mkfs.ext4` or no usable loop devices, or are older than volumes), and when those
/// that have it hold no more (`QUOTA_EXCEEDED`, the least full one's figures).
pub fn volume_node<'a>(
    nodes: &'a [NodeDoc],
    pool_id: &str,
    load: &std::collections::BTreeMap<String, usize>,
    volumes: &[SandboxVolumeDoc],
    size_gib: u64,
) -> Result<&'a NodeDoc, Error> {
    let capable: Vec<&NodeDoc> = nodes.iter().filter(|n| keeps_volumes(n, pool_id)).collect();
    let chosen = capable
        .iter()
        .filter(|n| check_node_disk(n, node_volumes_gib(volumes, &n.node_id), size_gib).is_ok())
        .min_by_key(|n| (load.get(&n.node_id).copied().unwrap_or(0), n.node_id.clone()));
    if let Some(node) = chosen {
        return Ok(node);
    }
    if let Some(roomiest) = capable.iter().min_by_key(|n| (node_volumes_gib(volumes, &n.node_id), n.node_id.clone())) {
        return check_node_disk(roomiest, node_volumes_gib(volumes, &roomiest.node_id), size_gib).map(|()| *roomiest);
    }
    let running = nodes.iter().filter(|n| super::sandbox::runs_sandboxes(n, pool_id)).count();
    if running == 0 {
        return Err(super::sandbox::no_sandbox_node(pool_id));
    }
    Err(Error::Unsupported {
        message: format!(
            "{running} ready node(s) of pool {pool_id} run sandboxes, and none advertises {CAPABILITY_SANDBOX_VOLUMES}: \
             their agents cannot make volumes (hint: install e2fsprogs for mkfs.ext4, make loop devices usable (modprobe loop, \
             bcd as root), and restart bcd; `nodes get` lists a node's capabilities)"
        ),
        reason: "daemon-capability".into(),
    })
}

/// What `sandboxVolumes.create` decides on.
pub struct SandboxVolumeInput<'a> {
    pub volume_id: &'a str,
    pub name: &'a str,
    pub pool: &'a PoolDoc,
    /// The node it lives on: [`volume_node`]'s choice.
    pub node: &'a NodeDoc,
    pub size_gib: u64,
    /// The tenant's volumes not yet deleted.
    pub live: &'a [SandboxVolumeDoc],
}

/// A volume of `size_gib` on `node`, with the `sandbox_volume.apply` that makes it there: its
/// size checked, its name free among the tenant's volumes, within the tenant's bound.
pub fn sandbox_volume_create(input: &SandboxVolumeInput<'_>, issue: Issue<'_>) -> Result<Append, Error> {
    check_size(input.size_gib)?;
    if input.pool.archived {
        return Err(Error::state(format!("pool {} is archived", input.pool.pool_id), super::ARCHIVED_POOL_HINT));
    }
    if input.live.iter().any(|v| v.name == input.name) {
        return Err(Error::AlreadyExists { what: format!("a sandbox volume named {}", input.name) });
    }
    if input.live.len() >= SANDBOX_VOLUMES_PER_TENANT_MAX {
        return Err(Error::QuotaExceeded(format!(
            "the tenant has {} sandbox volumes, the most it may ({SANDBOX_VOLUMES_PER_TENANT_MAX}); delete some first",
            input.live.len()
        )));
    }
    let mut guards = vec![(stream_of(crate::KIND_POOL, &input.pool.pool_id), ExpectedVersion::Exact(input.pool.version))];
    let promised = node_volumes_gib(input.live, &input.node.node_id).saturating_add(input.size_gib);
    let promised = promise(input.node, input.volume_id, promised, &mut guards)?;
    let args = SandboxVolumeDoc::apply_args(input.volume_id, "ready", input.size_gib);
    let (command, apply) =
        issue_command_for(&input.node.node_id, SANDBOX_VOLUME_APPLY, args, SANDBOX_VOLUME_APPLY_DEADLINE_S, issue, &mut guards)?;
    let created = SandboxVolumeCreated {
        name: input.name.to_owned(),
        pool_id: input.pool.pool_id.clone(),
        node_id: input.node.node_id.clone(),
        size_gib: input.size_gib,
        apply,
    };
    Ok(Append {
        stream: stream_of(KIND_SANDBOX_VOLUME, &input.volume_id),
        expected: ExpectedVersion::NoStream,
        guards,
        events: vec![NewEvent::new(SANDBOX_VOLUME_CREATED, to_cbor(&created)?), command, promised],
    })
}

/// What a resize checks the volume's node's disk with.
#[derive(Clone, Copy)]
pub struct NodeDisk<'a> {
    /// The volume's node (its reported `volumeFileSystemBytes`).
    pub node: &'a NodeDoc,
    /// The tenant's live volumes ([`node_volumes_gib`] picks the node's).
    pub volumes: &'a [SandboxVolumeDoc],
}

/// A larger size for a ready volume no live sandbox mounts (the node unmounts it to grow the file
/// system), with the `sandbox_volume.apply` that grows it, within its node's disk
/// ([`check_node_disk`]). Volumes only grow.
pub fn sandbox_volume_resize(
    volume: &SandboxVolumeDoc,
    size_gib: u64,
    live: &[SandboxDoc],
    disk: NodeDisk<'_>,
    issue: Issue<'_>,
) -> Result<Append, Error> {
    check_size(size_gib)?;
    if volume.state != SandboxVolumeState::Ready {
        return Err(Error::InvalidState {
            message: format!("volume {} is {}, not ready", volume.volume_id, volume.state.as_str()),
            allowed: vec![SandboxVolumeState::Ready.as_str().into()],
            hint: Some("wait until it is ready (sandbox-volume get)".into()),
        });
    }
    if size_gib <= volume.size_gib {
        return Err(Error::InvalidArgument {
            message: format!(
                "volume {} is {} GiB; a resize only grows it (asked {size_gib} GiB)",
                volume.volume_id, volume.size_gib
            ),
            hint: Some(format!("ask for more than {} GiB", volume.size_gib)),
        });
    }
    if let Some(sandbox) = mounted_by(volume, live) {
        return Err(attached_error(volume, sandbox, "it grows only while no sandbox mounts it"));
    }
    // What the node's volumes promise, this one at its size now; the growth must fit beside it.
    let promised = node_volumes_gib(disk.volumes, &volume.node_id);
    check_node_disk(disk.node, promised, size_gib - volume.size_gib)?;
    let mut guards = Vec::new();
    let promised = promise(disk.node, &volume.volume_id, promised + (size_gib - volume.size_gib), &mut guards)?;
    let args = SandboxVolumeDoc::apply_args(&volume.volume_id, "ready", size_gib);
    let (command, apply) =
        issue_command_for(&volume.node_id, SANDBOX_VOLUME_APPLY, args, SANDBOX_VOLUME_APPLY_DEADLINE_S, issue, &mut guards)?;
    Ok(Append {
        stream: stream_of(KIND_SANDBOX_VOLUME, &volume.volume_id),
        expected: ExpectedVersion::Exact(volume.version),
        guards,
        events: vec![
            NewEvent::new(SANDBOX_VOLUME_RESIZE_REQUESTED, to_cbor(&SandboxVolumeResizeRequested { size_gib, apply })?),
            command,
            promised,
        ],
    })
}

/// A delete: `sandbox_volume.delete_requested` with the apply that removes its file (its data
/// gone), refused while a live sandbox mounts it. One being deleted may be deleted again (the
/// node did not answer, or failed).
pub fn sandbox_volume_delete(volume: &SandboxVolumeDoc, live: &[SandboxDoc], issue: Issue<'_>) -> Result<Append, Error> {
    if volume.state == SandboxVolumeState::Deleted {
        return Err(Error::state(format!("volume {} is deleted", volume.volume_id), "nothing to do"));
    }
    if let Some(sandbox) = mounted_by(volume, live) {
        return Err(attached_error(volume, sandbox, "a mounted volume is not deleted"));
    }
    let mut guards = Vec::new();
    let args = SandboxVolumeDoc::apply_args(&volume.volume_id, "deleted", volume.size_gib);
    let (command, apply) =
        issue_command_for(&volume.node_id, SANDBOX_VOLUME_APPLY, args, SANDBOX_VOLUME_APPLY_DEADLINE_S, issue, &mut guards)?;
    Ok(Append {
        stream: stream_of(KIND_SANDBOX_VOLUME, &volume.volume_id),
        expected: ExpectedVersion::Exact(volume.version),
        guards,
        events: vec![NewEvent::new(SANDBOX_VOLUME_DELETE_REQUESTED, to_cbor(&SandboxVolumeDeleteRequested { apply })?), command],
    })
}

/// The volumes a template names (`mounts`, each found in `volumes`): at most
/// [`SANDBOX_TEMPLATE_VOLUMES_MAX`], each once, at distinct valid paths, of the template's pool,
/// not being deleted, all on one node (a sandbox runs on one); and a template with volumes keeps
/// no warm pool (`warm_min` 0: a warm sandbox would hold a volume no caller asked for).
pub fn check_template_volumes(
    pool_id: &str,
    warm_min: u32,
    mounts: &[VolumeMount],
    volumes: &[SandboxVolumeDoc],
) -> Result<(), Error> {
    if mounts.is_empty() {
        return Ok(());
    }
    if warm_min > 0 {
        return Err(Error::InvalidArgument {
            message: format!("a template with volumes keeps no warm pool, but warmMin is {warm_min}"),
            hint: Some("give warmMin 0 (--warm-min 0): each sandbox attaches the volumes when it is created".into()),
        });
    }
    if mounts.len() > SANDBOX_TEMPLATE_VOLUMES_MAX {
        return Err(Error::invalid(format!(
            "{} volumes, more than the {SANDBOX_TEMPLATE_VOLUMES_MAX} a template mounts",
            mounts.len()
        )));
    }
    let mut node: Option<&str> = None;
    for (i, m) in mounts.iter().enumerate() {
        check_mount_path(&m.path)?;
        if mounts[..i].iter().any(|o| o.volume_id == m.volume_id) {
            return Err(Error::invalid(format!("volume {} is named twice", m.volume_id)));
        }
        if mounts[..i].iter().any(|o| o.path == m.path) {
            return Err(Error::invalid(format!("two volumes mount at {}", m.path)));
        }
        let Some(v) = volumes.iter().find(|v| v.volume_id == m.volume_id) else {
            return Err(Error::not_found(format!("sandbox volume {}", m.volume_id)));
        };
        if v.pool_id != pool_id {
            return Err(Error::invalid(format!("volume {} is of pool {}, not the template's {pool_id}", v.volume_id, v.pool_id)));
        }
        if matches!(v.state, SandboxVolumeState::Deleting | SandboxVolumeState::Deleted) {
            return Err(Error::state(format!("volume {} is {}", v.volume_id, v.state.as_str()), "name another volume"));
        }
        match node {
            Some(n) if n != v.node_id => {
                return Err(Error::invalid(format!(
                    "volume {} is on node {}, another than the template's other volumes ({n}); a sandbox runs on one node",
                    v.volume_id, v.node_id
                )));
            }
            _ => node = Some(&v.node_id),
        }
    }
    Ok(())
}

/// The node a sandbox of `template` must run on: its volumes' (`None` without volumes).
pub fn volumes_node<'a>(template: &SandboxTemplateDoc, volumes: &'a [SandboxVolumeDoc]) -> Result<Option<&'a str>, Error> {
    let Some(first) = template.volumes.first() else { return Ok(None) };
    let v = volumes
        .iter()
        .find(|v| v.volume_id == first.volume_id)
        .ok_or_else(|| Error::not_found(format!("sandbox volume {}", first.volume_id)))?;
    Ok(Some(&v.node_id))
}

/// Other streams an append guards, at the versions read.
pub type Guards = Vec<(String, ExpectedVersion)>;

/// Attaches `template`'s volumes to the new sandbox `sandbox_id` on `node_id`: each ready, on
/// that node, mounted by no live sandbox (`live`); a `sandbox_volume.attached` on each volume's
/// stream, guarded at the version read, so of two creates racing for one volume one loses
/// (`CONFLICT`). Returns the guards and the events to add to the sandbox's creation.
pub fn attach_volumes(
    template: &SandboxTemplateDoc,
    sandbox_id: &str,
    node_id: &str,
    volumes: &[SandboxVolumeDoc],
    live: &[SandboxDoc],
) -> Result<(Guards, Vec<NewEvent>), Error> {
    let (mut guards, mut events) = (Vec::new(), Vec::new());
    for m in &template.volumes {
        let v = volumes
            .iter()
            .find(|v| v.volume_id == m.volume_id)
            .ok_or_else(|| Error::not_found(format!("sandbox volume {}", m.volume_id)))?;
        if v.state != SandboxVolumeState::Ready {
            return Err(Error::InvalidState {
                message: format!("volume {} is {}, not ready", v.volume_id, v.state.as_str()),
                allowed: vec![SandboxVolumeState::Ready.as_str().into()],
                hint: Some("wait until it is ready (sandbox-volume get), or fix the template's volumes".into()),
            });
        }
        if v.node_id != node_id {
            return Err(Error::invalid(format!("volume {} is on node {}, not {node_id}", v.volume_id, v.node_id)));
        }
        if let Some(sandbox) = mounted_by(v, live) {
            return Err(attached_error(v, sandbox, "a volume mounts in one sandbox at a time"));
        }
        let stream = stream_of(KIND_SANDBOX_VOLUME, &v.volume_id);
        guards.push((stream.clone(), ExpectedVersion::Exact(v.version)));
        let attached = SandboxVolumeAttached { sandbox_id: sandbox_id.to_owned(), path: m.path.clone(), read_only: m.read_only };
        let mut event = NewEvent::new(SANDBOX_VOLUME_ATTACHED, to_cbor(&attached)?);
        event.stream = Some(stream);
        events.push(event);
    }
    Ok((guards, events))
}

/// The volumes whose sandbox is no longer live (`live`: the tenant's live sandboxes): each gets
/// a `sandbox_volume.detached` at the version read (the reconciler's).
pub fn volumes_to_detach(volumes: &[SandboxVolumeDoc], live: &[SandboxDoc]) -> Result<Vec<Append>, Error> {
    let mut out = Vec::new();
    for v in volumes {
        let Some(attached) = &v.attachment else { continue };
        if mounted_by(v, live).is_some() {
            continue;
        }
        let detached = SandboxVolumeDetached { sandbox_id: attached.sandbox_id.clone() };
        out.push(Append {
            stream: stream_of(KIND_SANDBOX_VOLUME, &v.volume_id),
            expected: ExpectedVersion::Exact(v.version),
            guards: Vec::new(),
            events: vec![NewEvent::new(SANDBOX_VOLUME_DETACHED, to_cbor(&detached)?)],
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox_volume::{VolumeApply, VolumeAttachment};

    fn volume(id: &str, node: &str, state: SandboxVolumeState, attached_to: Option<&str>) -> SandboxVolumeDoc {
        SandboxVolumeDoc {
            tenant_id: "t".into(),
            volume_id: id.into(),
            name: format!("name-{id}"),
            pool_id: "pool_1".into(),
            node_id: node.into(),
            size_gib: 2,
            requested_size_gib: None,
            created_by: "apikey:key_1".into(),
            state,
            apply: VolumeApply {
                command_id: "cmd_1".into(),
                desired: "ready".into(),
                deadline_at_ms: 0,
                answered_at_ms: Some(1),
            },
            attachment: attached_to.map(|s| VolumeAttachment {
                sandbox_id: s.into(),
                path: "/w".into(),
                read_only: false,
                attached_at_ms: 0,
            }),
            last_error: None,
            version: 3,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    fn live_sandbox(id: &str) -> SandboxDoc {
        serde_json::from_value(serde_json::json!({
            "tenantId": "t", "sandboxId": id, "templateId": "sbxt_1", "poolId": "pool_1", "nodeId": "node_1",
            "shape": { "flavorId": "flv_1", "vcpus": 1, "memoryMiB": 64 },
            "image": { "imageId": "img_1", "url": "http://x/", "sha256": "0".repeat(64), "diskFormat": "rootfs-tar" },
            "env": {}, "network": "none", "warm": false, "state": "running",
            "apply": { "commandId": "cmd_2", "desired": "running", "deadlineAtMs": 0 },
            "version": 1, "createdAtMs": 0, "updatedAtMs": 0,
        }))
        .unwrap()
    }

    fn issue() -> Issue<'static> {
        Issue { command_id: "cmd_01j00000000000000000000000", now_ms: 1_000 }
    }

    #[test]
    fn sizes_and_paths_are_bounded() {
        assert!(check_size(0).unwrap_err().to_string().contains("outside 1 to 16384 GiB"));
        assert!(check_size(SANDBOX_VOLUME_SIZE_MAX_GIB + 1).is_err());
        check_size(1).unwrap();
        check_size(SANDBOX_VOLUME_SIZE_MAX_GIB).unwrap();
        check_mount_path("/workspace").unwrap();
        check_mount_path("/data/notes").unwrap();
        for bad in
            ["workspace", "/", "/a/../b", "/a//b", "/a/", "/proc", "/dev/x", "/a:b", "/a b", &format!("/{}", "a".repeat(300))]
        {
            assert!(check_mount_path(bad).is_err(), "{bad}");
        }
        check_mount_path("/process").unwrap();
    }

    #[test]
    fn a_mounted_volume_is_neither_resized_nor_deleted_nor_attached_again() {
        let live = [live_sandbox("sbx_a")];
        let mounted = volume("vol_1", "node_1", SandboxVolumeState::Ready, Some("sbx_a"));
        let err = sandbox_volume_delete(&mounted, &live, issue()).unwrap_err();
        assert!(err.to_string().contains("attached to sandbox sbx_a"), "{err}");
        assert_eq!(err.code(), bc_core::ErrorCode::InvalidState);
        assert!(sandbox_volume_resize(&mounted, 4, &live, roomy(), issue()).is_err());
        let mut template: SandboxTemplateDoc = serde_json::from_value(serde_json::json!({
            "tenantId": "t", "templateId": "sbxt_1", "name": "x", "poolId": "pool_1",
            "shape": { "flavorId": "flv_1", "vcpus": 1, "memoryMiB": 64 },
            "image": { "imageId": "img_1", "url": "http://x/", "sha256": "0".repeat(64), "diskFormat": "rootfs-tar" },
            "warmMin": 0, "defaultTtlS": 60, "maxTtlS": 600, "env": {}, "network": "none", "version": 1, "createdAtMs": 0,
        }))
        .unwrap();
        template.volumes = vec![VolumeMount { volume_id: "vol_1".into(), path: "/w".into(), read_only: false }];
        let volumes = [mounted.clone()];
        assert!(
            attach_volumes(&template, "sbx_b", "node_1", &volumes, &live)
                .unwrap_err()
                .to_string()
                .contains("one sandbox at a time")
        );

        // Its sandbox gone: it attaches again, guarded at the volume's version, and is detached.
        let (guards, events) = attach_volumes(&template, "sbx_b", "node_1", &volumes, &[]).unwrap();
        assert_eq!(guards, vec![("sandbox_volume/vol_1".to_owned(), ExpectedVersion::Exact(3))]);
        assert_eq!(events[0].stream.as_deref(), Some("sandbox_volume/vol_1"));
        assert_eq!(events[0].event_type, SANDBOX_VOLUME_ATTACHED);
        assert_eq!(volumes_to_detach(&volumes, &live).unwrap().len(), 0);
        assert_eq!(volumes_to_detach(&volumes, &[]).unwrap().len(), 1);
        sandbox_volume_delete(&mounted, &[], issue()).unwrap();

        // Not ready, or on another node: refused.
        let creating = [volume("vol_1", "node_1", SandboxVolumeState::Creating, None)];
        assert!(attach_volumes(&template, "sbx_b", "node_1", &creating, &[]).is_err());
        assert!(attach_volumes(&template, "sbx_b", "node_2", &volumes, &[]).is_err());
    }

    fn node(id: &str, pool: &str, state: crate::NodeState, capabilities: &[&str]) -> NodeDoc {
        let mut doc = crate::drivers::test_node(id, pool, state, capabilities);
        // As an agent that makes volumes does: the size of their file system (1 TiB) beside it.
        doc.agent.as_mut().unwrap().inventory.as_mut().unwrap().volume_file_system_bytes =
            capabilities.contains(&CAPABILITY_SANDBOX_VOLUMES).then_some(1 << 40);
        doc
    }

    /// A node of pool_1 that makes volumes, on a file system of `gib`.
    fn disk_node(id: &str, gib: u64) -> NodeDoc {
        let mut doc =
            node(id, "pool_1", crate::NodeState::Ready, &[crate::sandbox::CAPABILITY_SANDBOX_GVISOR, CAPABILITY_SANDBOX_VOLUMES]);
        doc.agent.as_mut().unwrap().inventory.as_mut().unwrap().volume_file_system_bytes = Some(gib << 30);
        doc
    }

    /// A disk no test fills.
    fn roomy() -> NodeDisk<'static> {
        NodeDisk { node: Box::leak(Box::new(disk_node("node_1", 1 << 20))), volumes: &[] }
    }

    #[test]
    fn a_node_s_volumes_promise_at_most_its_file_system() {
        let on = |id: &str, node: &str, size: u64| {
            let mut v = volume(id, node, SandboxVolumeState::Ready, None);
            v.size_gib = size;
            v
        };
        let mut growing = on("vol_3", "n1", 2);
        growing.requested_size_gib = Some(5);
        let mut gone = on("vol_4", "n1", 100);
        gone.state = SandboxVolumeState::Deleted;
        let volumes = [on("vol_1", "n1", 3), on("vol_2", "n2", 7), growing, gone];
        assert_eq!(node_volumes_gib(&volumes, "n1"), 8, "3, and 5 for the one growing; the deleted one not");

        // 10 GiB of file system, 8 promised: 2 more fit, 3 do not.
        let n1 = disk_node("n1", 10);
        check_node_disk(&n1, 8, 2).unwrap();
        let err = check_node_disk(&n1, 8, 3).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::QuotaExceeded, "{err}");
        assert!(err.to_string().contains("11 GiB") && err.to_string().contains("10 GiB"), "{err}");
        let mut silent = n1.clone();
        silent.agent.as_mut().unwrap().inventory.as_mut().unwrap().volume_file_system_bytes = None;
        assert!(check_node_disk(&silent, 0, 1).unwrap_err().to_string().contains("not reported"));

        // Placement skips the full node for the one with room, though it is busier.
        let nodes = [n1.clone(), disk_node("n2", 10)];
        let busy_n2: std::collections::BTreeMap<String, usize> = [("n2".to_owned(), 5)].into();
        assert_eq!(volume_node(&nodes, "pool_1", &busy_n2, &volumes, 3).unwrap().node_id, "n2");
        assert_eq!(volume_node(&nodes, "pool_1", &busy_n2, &volumes, 2).unwrap().node_id, "n1");
        let err = volume_node(&nodes, "pool_1", &busy_n2, &volumes, 4).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::QuotaExceeded, "neither holds 4 GiB more: {err}");

        // A resize counts only its growth: vol_1 (3 GiB) to 5 fits, to 6 does not.
        let disk = NodeDisk { node: &n1, volumes: &volumes };
        sandbox_volume_resize(&volumes[0], 5, &[], disk, issue()).unwrap();
        let err = sandbox_volume_resize(&volumes[0], 6, &[], disk, issue()).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::QuotaExceeded, "{err}");
    }

    #[test]
    fn a_volume_goes_only_to_a_node_that_advertises_volumes() {
        use crate::NodeState::{Cordoned, Ready};
        const GVISOR: &str = crate::sandbox::CAPABILITY_SANDBOX_GVISOR;
        let both = [GVISOR, CAPABILITY_SANDBOX_VOLUMES];
        let load = |pairs: &[(&str, usize)]| pairs.iter().map(|(n, l)| ((*n).to_owned(), *l)).collect();

        // The least loaded node that keeps volumes, not the least loaded that runs sandboxes.
        let nodes =
            [node("n1", "pool_1", Ready, &[GVISOR]), node("n2", "pool_1", Ready, &both), node("n3", "pool_1", Ready, &both)];
        assert_eq!(volume_node(&nodes, "pool_1", &load(&[("n2", 3), ("n3", 1)]), &[], 1).unwrap().node_id, "n3");
        assert_eq!(volume_node(&nodes, "pool_1", &load(&[]), &[], 1).unwrap().node_id, "n2", "a tie goes to the lowest id");

        // Sandboxes run in the pool, but no agent can make volumes: UNSUPPORTED, naming it.
        let without =
            [node("n1", "pool_1", Ready, &[GVISOR]), node("n2", "pool_1", Cordoned, &both), node("n3", "pool_2", Ready, &both)];
        let err = volume_node(&without, "pool_1", &load(&[]), &[], 1).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::Unsupported, "{err}");
        assert!(matches!(&err, Error::Unsupported { reason, .. } if reason == "daemon-capability"), "{err:?}");
        assert!(err.to_string().contains(CAPABILITY_SANDBOX_VOLUMES) && err.to_string().contains("1 ready node"), "{err}");

        // No node runs sandboxes at all (the capability alone is not enough): as a sandbox is.
        let none = [node("n1", "pool_1", Ready, &[CAPABILITY_SANDBOX_VOLUMES])];
        let err = volume_node(&none, "pool_1", &load(&[]), &[], 1).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::InvalidState, "{err}");
        assert!(err.to_string().contains("runs sandboxes"), "{err}");
        assert!(volume_node(&[], "pool_1", &load(&[]), &[], 1).is_err());

        // Not a sandbox runtime to drivers.list.
        assert_eq!(bc_core::agent::driver_of_capability(CAPABILITY_SANDBOX_VOLUMES), None);
    }

    #[test]
    fn a_resize_only_grows() {
        let v = volume("vol_1", "node_1", SandboxVolumeState::Ready, None);
        assert!(sandbox_volume_resize(&v, 2, &[], roomy(), issue()).unwrap_err().to_string().contains("only grows"));
        assert!(sandbox_volume_resize(&v, 1, &[], roomy(), issue()).is_err());
        assert!(sandbox_volume_resize(&v, SANDBOX_VOLUME_SIZE_MAX_GIB + 1, &[], roomy(), issue()).is_err());
        let append = sandbox_volume_resize(&v, 3, &[], roomy(), issue()).unwrap();
        assert_eq!(append.expected, ExpectedVersion::Exact(3));
        assert_eq!(append.events[0].event_type, SANDBOX_VOLUME_RESIZE_REQUESTED);
        // The node's disk is taken at the node's version read (projections/tests/volume_disk_race.rs).
        let node_stream = stream_of(crate::KIND_NODE, &"node_1");
        assert!(append.guards.contains(&(node_stream.clone(), ExpectedVersion::Exact(1))), "{:?}", append.guards);
        assert_eq!(
            (append.events[2].event_type.as_str(), append.events[2].stream.as_ref()),
            (NODE_VOLUMES_PROMISED, Some(&node_stream))
        );
        let resizing = volume("vol_1", "node_1", SandboxVolumeState::Resizing, None);
        assert!(sandbox_volume_resize(&resizing, 4, &[], roomy(), issue()).is_err());
    }

    #[test]
    fn a_template_s_volumes_are_checked() {
        let volumes = [
            volume("vol_1", "node_1", SandboxVolumeState::Ready, None),
            volume("vol_2", "node_2", SandboxVolumeState::Ready, None),
            volume("vol_3", "node_1", SandboxVolumeState::Deleting, None),
        ];
        let m = |id: &str, path: &str| VolumeMount { volume_id: id.into(), path: path.into(), read_only: false };
        check_template_volumes("pool_1", 0, &[m("vol_1", "/w")], &volumes).unwrap();
        let err = check_template_volumes("pool_1", 1, &[m("vol_1", "/w")], &volumes).unwrap_err();
        assert!(err.to_string().contains("keeps no warm pool"), "{err}");
        check_template_volumes("pool_1", 2, &[], &volumes).unwrap();
        assert!(check_template_volumes("pool_1", 0, &[m("vol_1", "/w"), m("vol_2", "/v")], &volumes).is_err(), "two nodes");
        assert!(check_template_volumes("pool_1", 0, &[m("vol_1", "/w"), m("vol_1", "/v")], &volumes).is_err());
        assert!(check_template_volumes("pool_1", 0, &[m("vol_3", "/w")], &volumes).is_err());
        assert!(check_template_volumes("pool_2", 0, &[m("vol_1", "/w")], &volumes).is_err());
        assert!(check_template_volumes("pool_1", 0, &[m("vol_9", "/w")], &volumes).is_err());
        assert!(check_template_volumes("pool_1", 0, &[m("vol_1", "w")], &volumes).is_err());
    }
}
