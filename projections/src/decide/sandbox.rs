//! The decisions about sandboxes and their templates: make a template
//! ([`sandbox_template_create`]), a sandbox (warm from the pool, [`sandbox_claim`], or cold on a
//! node, [`sandbox_create`]), extend and delete one, and the `sandboxes` reconciler's pass
//! ([`sandboxes_plan`]): deletes at a sandbox's end, a delete sent again when its node did not
//! answer, and the warm pools kept at each template's `warmMin` (filled up to it; past it after a
//! change, [`sandbox_template_update`], the newest deleted, and those made with an older `env`
//! replaced).
//!
//! Every bound is a named constant checked here, so the gateway, the reconciler and the tests
//! decide alike; what a caller sees when one is hit is an `INVALID_ARGUMENT` (the request is wrong
//! in any state) or an `INVALID_STATE` (the same request may pass later).

use std::collections::BTreeMap;

use bc_core::Error;
use bc_core::store::{ExpectedVersion, NewEvent};

use super::Append;
use super::project::ProjectRef;
use crate::events::*;
use crate::placement::{Issue, issue_command_for};
use crate::sandbox::{
    CAPABILITY_SANDBOX_GVISOR, KIND_SANDBOX, KIND_SANDBOX_TEMPLATE, SANDBOX_APPLY, SANDBOX_APPLY_DEADLINE_S,
    SANDBOX_NETWORK_NONE, SandboxDoc, SandboxState, SandboxTemplateDoc,
};
use crate::sandbox_volume::SandboxVolumeDoc;
use crate::{FlavorDoc, ImageDoc, NodeDoc, NodeState, PoolDoc, stream_of};

/// The shortest life a sandbox may be given, in seconds.
pub const SANDBOX_TTL_MIN_S: u64 = 5;
/// The longest `maxTtlS` a template may have (a day).
pub const SANDBOX_TTL_MAX_S: u64 = 24 * 3600;
/// A template's `defaultTtlS` when it names none.
pub const SANDBOX_TTL_DEFAULT_S: u64 = 30 * 60;
/// The most sandboxes one tenant has live at once (warm ones count).
pub const SANDBOXES_PER_TENANT_MAX: usize = 256;
/// The most sandboxes kept warm per template.
pub const SANDBOX_WARM_MIN_MAX: u32 = 64;
/// Warm sandboxes made per template per pass: a refill is gradual, never a burst on one node.
pub const SANDBOX_WARM_REFILL_PER_PASS_MAX: usize = 4;
/// The most environment variables a template gives.
pub const SANDBOX_ENV_VARS_MAX: usize = 32;
/// The most bytes of a template's environment (names and values together).
pub const SANDBOX_ENV_BYTES_MAX: usize = 16 * 1024;
/// The longest environment variable name.
pub const SANDBOX_ENV_NAME_BYTES_MAX: usize = 128;
/// Deletes sent in a row to an unanswering node before the reconciler stops trying that often
/// (it keeps trying, at every deadline).
pub const SANDBOX_DELETE_ATTEMPTS_WARN: u32 = 3;

const _: () = assert!(SANDBOX_TTL_MIN_S < SANDBOX_TTL_DEFAULT_S && SANDBOX_TTL_DEFAULT_S < SANDBOX_TTL_MAX_S);
const _: () = assert!((SANDBOX_WARM_MIN_MAX as usize) < SANDBOXES_PER_TENANT_MAX);

/// The most sandboxes one node runs, warm ones and those being deleted included: what its agent
/// runs at most (`bcd`'s own `SANDBOXES_PER_NODE_MAX`, the same figure), so placement sends none
/// to a full node, where it would only fail (`capacity`).
pub const SANDBOXES_PER_NODE_MAX: usize = 64;
/// The most warm (unclaimed) sandboxes one node holds: half of what it runs, so a claimed or
/// cold sandbox always finds room beside the warm pools.
pub const SANDBOX_WARM_PER_NODE_MAX: usize = SANDBOXES_PER_NODE_MAX / 2;
/// The most warm sandboxes a tenant's templates keep together (their `warmMin` summed): half of
/// the tenant's bound, so its warm pools never take the room of the sandboxes it claims.
pub const SANDBOX_WARM_PER_TENANT_MAX: u32 = (SANDBOXES_PER_TENANT_MAX / 2) as u32;

const _: () = assert!(SANDBOX_WARM_MIN_MAX <= SANDBOX_WARM_PER_TENANT_MAX);

/// Whether `warm_min` for template `template_id` (new, or changed) keeps the tenant's templates
/// (`templates`, the others and this one as it is) within [`SANDBOX_WARM_PER_TENANT_MAX`] warm
/// sandboxes together. Lowering a template's `warmMin` is always allowed. `QUOTA_EXCEEDED`
/// with the figures otherwise.
pub fn check_tenant_warm(templates: &[SandboxTemplateDoc], template_id: &str, warm_min: u32) -> Result<(), Error> {
    let now = templates.iter().find(|t| t.template_id == template_id).map_or(0, |t| t.warm_min);
    let others: u32 = templates.iter().filter(|t| t.template_id != template_id).map(|t| t.warm_min).fold(0, u32::saturating_add);
    if warm_min <= now || others.saturating_add(warm_min) <= SANDBOX_WARM_PER_TENANT_MAX {
        return Ok(());
    }
    Err(Error::QuotaExceeded(format!(
        "the tenant's other templates keep {others} warm sandboxes; warmMin {warm_min} would make {}, past the \
         {SANDBOX_WARM_PER_TENANT_MAX} a tenant keeps warm (SANDBOX_WARM_PER_TENANT_MAX): lower another template's \
         warmMin, or ask for at most {}",
        others.saturating_add(warm_min),
        SANDBOX_WARM_PER_TENANT_MAX.saturating_sub(others)
    )))
}

/// The warm sandboxes (starting or running, unclaimed) on each node of `sandboxes`.
pub fn warm_load(sandboxes: &[SandboxDoc]) -> BTreeMap<String, usize> {
    let mut out: BTreeMap<String, usize> = BTreeMap::new();
    for s in sandboxes.iter().filter(|s| s.warm && matches!(s.state, SandboxState::Starting | SandboxState::Running)) {
        *out.entry(s.node_id.clone()).or_default() += 1;
    }
    out
}

/// Whether node `node_id` runs another sandbox beside its `load` (its live sandboxes):
/// [`SANDBOXES_PER_NODE_MAX`]. `QUOTA_EXCEEDED` otherwise.
pub fn check_node_room(node_id: &str, load: &BTreeMap<String, usize>) -> Result<(), Error> {
    let held = load.get(node_id).copied().unwrap_or(0);
    if held < SANDBOXES_PER_NODE_MAX {
        return Ok(());
    }
    Err(Error::QuotaExceeded(format!(
        "node {node_id} runs {held} sandboxes, the most a node runs (SANDBOXES_PER_NODE_MAX {SANDBOXES_PER_NODE_MAX}): \
         delete some, or join another node to the pool"
    )))
}

/// The node a new sandbox of `pool_id` goes to: [`sandbox_node`] among the nodes with room
/// ([`SANDBOXES_PER_NODE_MAX`] by `load`; for a warm one, `warm` its nodes' warm sandboxes, also
/// fewer than [`SANDBOX_WARM_PER_NODE_MAX`]). `INVALID_STATE` when no node runs sandboxes
/// ([`no_sandbox_node`]), `QUOTA_EXCEEDED` when those that do are full.
pub fn place_sandbox<'a>(
    nodes: &'a [NodeDoc],
    pool_id: &str,
    load: &BTreeMap<String, usize>,
    warm: Option<&BTreeMap<String, usize>>,
) -> Result<&'a NodeDoc, Error> {
    let count = |map: &BTreeMap<String, usize>, n: &NodeDoc| map.get(&n.node_id).copied().unwrap_or(0);
    let running: Vec<&NodeDoc> = nodes.iter().filter(|n| runs_sandboxes(n, pool_id)).collect();
    if running.is_empty() {
        return Err(no_sandbox_node(pool_id));
    }
    let room = running
        .iter()
        .filter(|n| count(load, n) < SANDBOXES_PER_NODE_MAX && warm.is_none_or(|w| count(w, n) < SANDBOX_WARM_PER_NODE_MAX))
        .min_by_key(|n| (count(load, n), n.node_id.clone()));
    room.copied().ok_or_else(|| {
        let what = match warm {
            Some(_) => format!(
                "{SANDBOXES_PER_NODE_MAX} sandboxes (SANDBOXES_PER_NODE_MAX) or {SANDBOX_WARM_PER_NODE_MAX} warm ones \
                 (SANDBOX_WARM_PER_NODE_MAX)"
            ),
            None => format!("{SANDBOXES_PER_NODE_MAX} sandboxes (SANDBOXES_PER_NODE_MAX)"),
        };
        Error::QuotaExceeded(format!(
            "each of the {} ready node(s) of pool {pool_id} that run sandboxes holds {what}, the most a node holds: \
             delete some, or join another node to the pool",
            running.len()
        ))
    })
}

/// What `sandboxTemplates.create` decides on.
pub struct SandboxTemplateInput<'a> {
    pub template_id: &'a str,
    pub name: &'a str,
    pub pool: &'a PoolDoc,
    pub flavor: &'a FlavorDoc,
    pub image: &'a ImageDoc,
    pub warm_min: u32,
    pub default_ttl_s: Option<u64>,
    pub max_ttl_s: Option<u64>,
    pub env: &'a BTreeMap<String, String>,
    pub network: Option<&'a str>,
    /// The volumes every sandbox mounts, and the tenant's volumes they name
    /// ([`super::sandbox_volume::check_template_volumes`]).
    pub volumes: &'a [VolumeMount],
    pub volume_docs: &'a [SandboxVolumeDoc],
}

/// Whether `name` may be an environment variable's name: a letter or `_`, then letters, digits
/// and `_`.
pub fn env_name_ok(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= SANDBOX_ENV_NAME_BYTES_MAX
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Checks a template's environment against its bounds.
pub fn check_env(env: &BTreeMap<String, String>) -> Result<(), Error> {
    if env.len() > SANDBOX_ENV_VARS_MAX {
        return Err(Error::invalid(format!(
            "env has {} variables, more than the {SANDBOX_ENV_VARS_MAX} a template may give",
            env.len()
        )));
    }
    let bytes: usize = env.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > SANDBOX_ENV_BYTES_MAX {
        return Err(Error::invalid(format!(
            "env holds {bytes} bytes, more than the {SANDBOX_ENV_BYTES_MAX} a template may give"
        )));
    }
    for (name, value) in env {
        if !env_name_ok(name) {
            return Err(Error::invalid(format!(
                "env name {:?} is not a variable name (a letter or _, then letters, digits and _; at most {SANDBOX_ENV_NAME_BYTES_MAX} bytes)",
                bc_core::id::truncate(name, 40)
            )));
        }
        if value.contains('\0') {
            return Err(Error::invalid(format!("env {name}'s value holds a NUL byte")));
        }
    }
    Ok(())
}

/// A TTL's bounds: at least [`SANDBOX_TTL_MIN_S`], at most `max_s`.
pub fn check_ttl(field: &str, ttl_s: u64, max_s: u64) -> Result<(), Error> {
    if ttl_s < SANDBOX_TTL_MIN_S {
        return Err(Error::invalid(format!(
            "{field} is {ttl_s} s, less than the {SANDBOX_TTL_MIN_S} s a sandbox lives at least"
        )));
    }
    if ttl_s > max_s {
        return Err(Error::InvalidArgument {
            message: format!("{field} is {ttl_s} s, past the maximum of {max_s} s"),
            hint: Some(format!("ask for at most {max_s} s")),
        });
    }
    Ok(())
}

/// A template of `pool` from `flavor` and a root-filesystem `image`: its bounds checked.
pub fn sandbox_template_create(input: &SandboxTemplateInput<'_>) -> Result<Append, Error> {
    if input.pool.archived {
        return Err(Error::state(format!("pool {} is archived", input.pool.pool_id), super::ARCHIVED_POOL_HINT));
    }
    if input.flavor.pool_id != input.pool.pool_id {
        return Err(Error::invalid(format!(
            "flavor {} is of pool {}, not {}",
            input.flavor.flavor_id, input.flavor.pool_id, input.pool.pool_id
        )));
    }
    if input.image.disk_format != DiskFormat::RootfsTar {
        return Err(Error::InvalidArgument {
            message: format!("image {} is not a root file system (its disk format is not rootfs-tar)", input.image.image_id),
            hint: Some(
                "register the sandbox's root file system as a tar archive: images register --disk-format rootfs-tar".into(),
            ),
        });
    }
    if input.warm_min > SANDBOX_WARM_MIN_MAX {
        return Err(Error::invalid(format!(
            "warmMin is {}, more than the {SANDBOX_WARM_MIN_MAX} a template keeps",
            input.warm_min
        )));
    }
    let max_ttl_s = input.max_ttl_s.unwrap_or(SANDBOX_TTL_MAX_S);
    check_ttl("maxTtlS", max_ttl_s, SANDBOX_TTL_MAX_S)?;
    let default_ttl_s = input.default_ttl_s.unwrap_or(SANDBOX_TTL_DEFAULT_S.min(max_ttl_s));
    check_ttl("defaultTtlS", default_ttl_s, max_ttl_s)?;
    check_env(input.env)?;
    super::sandbox_volume::check_template_volumes(&input.pool.pool_id, input.warm_min, input.volumes, input.volume_docs)?;
    let network = input.network.unwrap_or(SANDBOX_NETWORK_NONE);
    if network != SANDBOX_NETWORK_NONE {
        return Err(Error::Unsupported {
            message: format!("network {:?}: sandboxes have no network yet (only none)", bc_core::id::truncate(network, 20)),
            reason: "network-policy".into(),
        });
    }
    let created = SandboxTemplateCreated {
        name: input.name.to_owned(),
        pool_id: input.pool.pool_id.clone(),
        shape: SandboxShape {
            flavor_id: input.flavor.flavor_id.clone(),
            vcpus: input.flavor.vcpus,
            memory_mib: input.flavor.memory_mib,
        },
        image: image_of(input.image),
        warm_min: input.warm_min,
        default_ttl_s,
        max_ttl_s,
        env: input.env.clone(),
        network: network.to_owned(),
        volumes: input.volumes.to_vec(),
    };
    let pool_stream = stream_of(crate::KIND_POOL, &input.pool.pool_id);
    Ok(Append {
        stream: stream_of(KIND_SANDBOX_TEMPLATE, &input.template_id),
        expected: ExpectedVersion::NoStream,
        guards: vec![(pool_stream, ExpectedVersion::Exact(input.pool.version))],
        events: vec![NewEvent::new(SANDBOX_TEMPLATE_CREATED, to_cbor(&created)?)],
    })
}

fn image_of(image: &ImageDoc) -> InstanceImage {
    InstanceImage {
        image_id: image.image_id.clone(),
        url: image.url.clone(),
        sha256: image.sha256.clone(),
        disk_format: image.disk_format,
        size_bytes: image.size_bytes,
    }
}

/// Deletes a template (its warm sandboxes go with the reconciler's next pass).
pub fn sandbox_template_delete(template: &SandboxTemplateDoc) -> Result<Append, Error> {
    Ok(Append {
        stream: stream_of(KIND_SANDBOX_TEMPLATE, &template.template_id),
        expected: ExpectedVersion::Exact(template.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(SANDBOX_TEMPLATE_DELETED, to_cbor(&NoFieldsPayload {})?)],
    })
}

#[derive(serde::Serialize)]
struct NoFieldsPayload {}

/// Whether `node` can take a sandbox: ready, of the pool, and its agent runs gVisor.
pub fn runs_sandboxes(node: &NodeDoc, pool_id: &str) -> bool {
    let capabilities = node.agent.as_ref().and_then(|a| a.inventory.as_ref()).map(|i| i.capabilities.as_slice());
    node.pool_id == pool_id
        && node.state == NodeState::Ready
        && capabilities.unwrap_or_default().iter().any(|c| c == CAPABILITY_SANDBOX_GVISOR)
}

/// The node a new sandbox of `pool_id` goes to: of those that run sandboxes, the one with the
/// fewest live sandboxes (`load`), then the lowest id; `None` if none does.
pub fn sandbox_node<'a>(nodes: &'a [NodeDoc], pool_id: &str, load: &BTreeMap<String, usize>) -> Option<&'a NodeDoc> {
    nodes
        .iter()
        .filter(|n| runs_sandboxes(n, pool_id))
        .min_by_key(|n| (load.get(&n.node_id).copied().unwrap_or(0), n.node_id.clone()))
}

/// The refusal when no node of a template's pool runs sandboxes.
pub fn no_sandbox_node(pool_id: &str) -> Error {
    Error::state(
        format!("no ready node of pool {pool_id} runs sandboxes (capability {CAPABILITY_SANDBOX_GVISOR})"),
        "join a node whose bcd finds runsc (make test installs it; Debian's package runsc), or wait until one is ready",
    )
}

/// A new sandbox of `template` on `node`: cold for a caller (with its end, `ttl_s` checked
/// against the template's maximum) or warm for the pool (`ttl_s: None`).
pub fn sandbox_create(
    template: &SandboxTemplateDoc,
    sandbox_id: &str,
    node: &NodeDoc,
    ttl_s: Option<u64>,
    issue: Issue<'_>,
) -> Result<Append, Error> {
    sandbox_create_mounting(template, sandbox_id, node, ttl_s, issue, &[], &[], &SandboxAdmission::default())
}

/// The guards and events an admitted sandbox's append adds.
type Admitted = (Vec<(String, ExpectedVersion)>, Vec<NewEvent>);

/// What a caller's sandbox is admitted under: the project it is made in (guarded at the version
/// read, [`ProjectRef::guard`]) and the tenant's quota in the template's pool with its live work
/// there ([`super::quota::admit`]: one sandbox, its vCPUs and memory). The warm pool's own
/// sandboxes are admitted under neither: their claim is.
#[derive(Clone, Copy, Debug, Default)]
pub struct SandboxAdmission<'a> {
    pub project: Option<&'a ProjectRef>,
    pub quota: Option<super::quota::QuotaRead<'a>>,
}

/// What one sandbox of `template` adds to its tenant's use under a quota: what its admission
/// counts, and what the record of a refusal past a limit names.
pub fn sandbox_use(template: &SandboxTemplateDoc) -> super::quota::ResourceUse {
    super::quota::ResourceUse::sandbox(template.shape.vcpus, template.shape.memory_mib)
}

impl SandboxAdmission<'_> {
    /// The guards and events `sandbox_id`'s append adds, or `QUOTA_EXCEEDED`.
    fn admit(&self, template: &SandboxTemplateDoc, sandbox_id: &str) -> Result<Admitted, Error> {
        let adding = sandbox_use(template);
        let mut guards: Vec<(String, ExpectedVersion)> = self.project.map(ProjectRef::guard).into_iter().collect();
        let mut events = Vec::new();
        if let Some((guard, event)) = super::quota::admit(self.quota.as_ref(), &adding, sandbox_id)? {
            guards.push(guard);
            events.push(event);
        }
        Ok((guards, events))
    }
}

/// [`sandbox_create`] for a template that may mount volumes: each of the template's volumes
/// (found in `volumes`) is attached to the new sandbox in the same append, guarded at its
/// version, and must be on `node` and mounted by none of the tenant's `live` sandboxes
/// ([`super::sandbox_volume::attach_volumes`]). Admitted under `admission` ([`SandboxAdmission`]).
#[allow(clippy::too_many_arguments)]
pub fn sandbox_create_mounting(
    template: &SandboxTemplateDoc,
    sandbox_id: &str,
    node: &NodeDoc,
    ttl_s: Option<u64>,
    issue: Issue<'_>,
    volumes: &[SandboxVolumeDoc],
    live: &[SandboxDoc],
    admission: &SandboxAdmission<'_>,
) -> Result<Append, Error> {
    sandbox_create_from(template, sandbox_id, node, ttl_s, issue, volumes, live, None, admission)
}

/// [`sandbox_create_mounting`], started from a snapshot when `restore` names one
/// ([`super::sandbox_snapshot`]): its `sandbox.apply` carries the snapshot's digest, which the node
/// checks before it restores.
#[allow(clippy::too_many_arguments)]
pub fn sandbox_create_from(
    template: &SandboxTemplateDoc,
    sandbox_id: &str,
    node: &NodeDoc,
    ttl_s: Option<u64>,
    issue: Issue<'_>,
    volumes: &[SandboxVolumeDoc],
    live: &[SandboxDoc],
    restore: Option<&crate::sandbox_snapshot::SandboxRestore>,
    admission: &SandboxAdmission<'_>,
) -> Result<Append, Error> {
    let project = admission.project;
    if (project.is_some() || admission.quota.is_some()) && ttl_s.is_none() {
        return Err(Error::invalid("a warm sandbox is made in no project and under no quota: its claim is"));
    }
    let (admitted_guards, counted) = admission.admit(template, sandbox_id)?;
    if ttl_s.is_none() && !template.volumes.is_empty() {
        return Err(Error::state(
            format!("template {} mounts volumes: it keeps no warm sandboxes", template.template_id),
            "create sandboxes of it one at a time (sandbox create)",
        ));
    }
    let (volume_guards, attached) = super::sandbox_volume::attach_volumes(template, sandbox_id, &node.node_id, volumes, live)?;
    if let Some(ttl_s) = ttl_s {
        check_ttl("ttlS", ttl_s, template.max_ttl_s)?;
    }
    let doc = SandboxDoc {
        tenant_id: template.tenant_id.clone(),
        sandbox_id: sandbox_id.to_owned(),
        template_id: template.template_id.clone(),
        pool_id: template.pool_id.clone(),
        node_id: node.node_id.clone(),
        shape: template.shape.clone(),
        image: template.image.clone(),
        env: template.env.clone(),
        network: template.network.clone(),
        volumes: template.volumes.clone(),
        project_id: project.map(|p| p.project_id.clone()),
        warm: ttl_s.is_none(),
        started_at_ms: None,
        ends_at_ms: None,
        state: SandboxState::Starting,
        apply: crate::sandbox::SandboxApply {
            command_id: String::new(),
            desired: "running".into(),
            deadline_at_ms: 0,
            answered_at_ms: None,
        },
        delete_attempts: 0,
        last_error: None,
        version: 0,
        created_at_ms: issue.now_ms,
        updated_at_ms: issue.now_ms,
    };
    let mut guards = vec![(stream_of(KIND_SANDBOX_TEMPLATE, &template.template_id), ExpectedVersion::Exact(template.version))];
    guards.extend(volume_guards);
    guards.extend(admitted_guards);
    let mut args = doc.apply_args("running");
    if let Some(restore) = restore {
        args["restore"] = serde_json::json!(restore);
    }
    let (command, apply) = issue_command_for(&node.node_id, SANDBOX_APPLY, args, SANDBOX_APPLY_DEADLINE_S, issue, &mut guards)?;
    let created = SandboxCreated {
        template_id: doc.template_id,
        pool_id: doc.pool_id,
        node_id: doc.node_id,
        shape: doc.shape,
        image: doc.image,
        env: doc.env,
        network: doc.network,
        warm: doc.warm,
        ends_at_ms: ttl_s.map(|s| issue.now_ms.saturating_add(s * 1000)),
        apply,
        volumes: doc.volumes,
        restore: restore.cloned(),
        project_id: doc.project_id,
    };
    let mut events = vec![NewEvent::new(SANDBOX_CREATED, to_cbor(&created)?), command];
    events.extend(attached);
    events.extend(counted);
    Ok(Append { stream: stream_of(KIND_SANDBOX, &sandbox_id), expected: ExpectedVersion::NoStream, guards, events })
}

/// The warm sandbox of a template to hand out: a running one, unclaimed, made with the
/// template's environment as it is now (one made before an `env` change is being replaced), the
/// oldest first.
pub fn warm_sandbox<'a>(sandboxes: &'a [SandboxDoc], template: &SandboxTemplateDoc) -> Option<&'a SandboxDoc> {
    sandboxes
        .iter()
        .filter(|s| {
            s.warm
                && s.template_id == template.template_id
                && s.state == SandboxState::Running
                && s.env == template.env
                && s.volumes == template.volumes
        })
        .min_by_key(|s| (s.created_at_ms, s.sandbox_id.clone()))
}

/// Claims a warm sandbox for a caller: its end, at the version read (one append), admitted as
/// a cold create is ([`SandboxAdmission`]: its project, the tenant's quota).
pub fn sandbox_claim(
    template: &SandboxTemplateDoc,
    warm: &SandboxDoc,
    ttl_s: u64,
    now_ms: u64,
    admission: &SandboxAdmission<'_>,
) -> Result<Append, Error> {
    check_ttl("ttlS", ttl_s, template.max_ttl_s)?;
    let (guards, counted) = admission.admit(template, &warm.sandbox_id)?;
    let claimed = SandboxClaimed {
        ends_at_ms: now_ms.saturating_add(ttl_s * 1000),
        project_id: admission.project.map(|p| p.project_id.clone()),
    };
    let mut events = vec![NewEvent::new(SANDBOX_CLAIMED, to_cbor(&claimed)?)];
    events.extend(counted);
    Ok(Append {
        stream: stream_of(KIND_SANDBOX, &warm.sandbox_id),
        expected: ExpectedVersion::Exact(warm.version),
        guards,
        events,
    })
}

fn live(doc: &SandboxDoc) -> Result<(), Error> {
    match doc.state {
        SandboxState::Deleting | SandboxState::Deleted => Err(Error::InvalidState {
            message: format!("sandbox {} is {}", doc.sandbox_id, doc.state.as_str()),
            allowed: Vec::new(),
            hint: Some("create another sandbox (sandbox create --template …)".into()),
        }),
        _ => Ok(()),
    }
}

/// A later end for a claimed sandbox: `until_ms`, at most the template's `maxTtlS` after the
/// sandbox started (`max_ttl_s`), and not before now.
pub fn sandbox_extend(doc: &SandboxDoc, max_ttl_s: u64, until_ms: u64, now_ms: u64) -> Result<Append, Error> {
    live(doc)?;
    let Some(started) = doc.started_at_ms.filter(|_| !doc.warm) else {
        return Err(Error::state(format!("sandbox {} is warm, not claimed", doc.sandbox_id), "claim one with sandbox create"));
    };
    let latest = started.saturating_add(max_ttl_s * 1000);
    if until_ms > latest {
        return Err(Error::InvalidArgument {
            message: format!(
                "extending sandbox {} to {until_ms} goes past its template's maxTtlS of {max_ttl_s} s (at most {latest})",
                doc.sandbox_id
            ),
            hint: Some("extend by less, or create another sandbox".into()),
        });
    }
    if until_ms <= now_ms || doc.ends_at_ms.is_some_and(|e| until_ms <= e) {
        return Err(Error::invalid(format!("sandbox {}'s new end must be later than its end and now", doc.sandbox_id)));
    }
    Ok(Append {
        stream: stream_of(KIND_SANDBOX, &doc.sandbox_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(SANDBOX_EXTENDED, to_cbor(&SandboxEnd { ends_at_ms: until_ms })?)],
    })
}

/// A delete: `sandbox.delete_requested` with its `sandbox.apply` (`desired: deleted`). A caller
/// may not delete a sandbox being deleted; the reconciler (`reason`) sends one again.
pub fn sandbox_delete(doc: &SandboxDoc, reason: Option<String>, issue: Issue<'_>) -> Result<Append, Error> {
    if reason.is_none() {
        live(doc)?;
    }
    let mut guards = Vec::new();
    let (command, apply) =
        issue_command_for(&doc.node_id, SANDBOX_APPLY, doc.apply_args("deleted"), SANDBOX_APPLY_DEADLINE_S, issue, &mut guards)?;
    let requested = SandboxDeleteRequested { apply, reason };
    Ok(Append {
        stream: stream_of(KIND_SANDBOX, &doc.sandbox_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards,
        events: vec![NewEvent::new(SANDBOX_DELETE_REQUESTED, to_cbor(&requested)?), command],
    })
}

/// What the `sandboxes` reconciler does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SandboxAction {
    /// Delete a sandbox (its end passed, its template is gone, or a delete went unanswered).
    Delete { sandbox_id: String, reason: String },
    /// Make `count` warm sandboxes of a template.
    Warm { template_id: String, count: usize },
}

/// The reconciler's pass over one tenant's live sandboxes and templates at `now_ms`: every
/// sandbox past its end is deleted (whatever its node's state), a delete whose node did not
/// answer by its deadline is sent again, the warm sandboxes of a deleted template go, and each
/// template's warm pool is refilled to `warmMin` (counting those still starting), at most
/// [`SANDBOX_WARM_REFILL_PER_PASS_MAX`] a pass, within the tenant's bound.
pub fn sandboxes_plan(templates: &[SandboxTemplateDoc], sandboxes: &[SandboxDoc], now_ms: u64) -> Vec<SandboxAction> {
    let mut out = Vec::new();
    let known: BTreeMap<&str, &SandboxTemplateDoc> = templates.iter().map(|t| (t.template_id.as_str(), t)).collect();
    for s in sandboxes {
        let delete = |reason: String| SandboxAction::Delete { sandbox_id: s.sandbox_id.clone(), reason };
        match s.state {
            SandboxState::Deleted => {}
            SandboxState::Deleting => {
                if s.apply.answered_at_ms.is_none() && now_ms >= s.apply.deadline_at_ms {
                    out.push(delete(format!("retry: node {} did not answer the delete by its deadline", s.node_id)));
                } else if s.apply.answered_at_ms.is_some() && now_ms >= s.apply.deadline_at_ms {
                    // Answered, but not gone (it failed): try again.
                    out.push(delete(format!("retry: {}", s.last_error.as_deref().unwrap_or("the node did not delete it"))));
                }
            }
            _ if s.ends_at_ms.is_some_and(|end| now_ms >= end) => out.push(delete("ttl-expired".into())),
            _ if s.warm && !known.contains_key(s.template_id.as_str()) => out.push(delete("template-deleted".into())),
            // A warm one that failed to start is replaced: it goes, and the refill makes another.
            SandboxState::Failed if s.warm => out.push(delete("warm-failed".into())),
            // The template's environment changed since it was made: it would run commands with
            // the old one, so it is replaced.
            SandboxState::Starting | SandboxState::Running
                if s.warm && known.get(s.template_id.as_str()).is_some_and(|t| t.env != s.env || t.volumes != s.volumes) =>
            {
                out.push(delete("template-updated".into()))
            }
            _ => {}
        }
    }
    let live = sandboxes.iter().filter(|s| s.state != SandboxState::Deleted).count();
    let mut room = SANDBOXES_PER_TENANT_MAX.saturating_sub(live);
    for t in templates {
        // Oldest first: past `warmMin` (it was lowered), the newest go.
        let mut warm: Vec<&SandboxDoc> = sandboxes
            .iter()
            .filter(|s| {
                s.warm
                    && s.template_id == t.template_id
                    && s.env == t.env
                    && s.volumes == t.volumes
                    && matches!(s.state, SandboxState::Starting | SandboxState::Running)
                    && s.ends_at_ms.is_none_or(|end| now_ms < end)
            })
            .collect();
        warm.sort_by_key(|s| (s.created_at_ms, s.sandbox_id.clone()));
        for extra in warm.iter().skip(t.warm_min as usize) {
            out.push(SandboxAction::Delete { sandbox_id: extra.sandbox_id.clone(), reason: "warm-excess".into() });
        }
        let warm = warm.len();
        let count = (t.warm_min as usize).saturating_sub(warm).min(SANDBOX_WARM_REFILL_PER_PASS_MAX).min(room);
        if count > 0 {
            room -= count;
            out.push(SandboxAction::Warm { template_id: t.template_id.clone(), count });
        }
    }
    out
}

/// A template's change in place: every field it names checked as at creation, and the TTLs
/// together (`defaultTtlS` at most `maxTtlS`, whichever of them changes), at the version read.
/// A change that names nothing is refused; one that names only what the template already is
/// appends nothing (`None`), so every `sandbox_template.updated` says what changed.
pub fn sandbox_template_update(doc: &SandboxTemplateDoc, change: SandboxTemplateUpdated) -> Result<Option<Append>, Error> {
    if change == SandboxTemplateUpdated::default() {
        return Err(Error::invalid("nothing to update: give name, warmMin, defaultTtlS, maxTtlS, env or volumes"));
    }
    let volumes = change.volumes.as_ref().unwrap_or(&doc.volumes);
    let warm_min = change.warm_min.unwrap_or(doc.warm_min);
    if !volumes.is_empty() && warm_min > 0 {
        return Err(Error::InvalidArgument {
            message: format!("a template with volumes keeps no warm pool, but warmMin is {warm_min}"),
            hint: Some("give warmMin 0 (--warm-min 0) with the volumes".into()),
        });
    }
    if let Some(warm_min) = change.warm_min
        && warm_min > SANDBOX_WARM_MIN_MAX
    {
        return Err(Error::invalid(format!("warmMin is {warm_min}, more than the {SANDBOX_WARM_MIN_MAX} a template keeps")));
    }
    let max_ttl_s = change.max_ttl_s.unwrap_or(doc.max_ttl_s);
    if change.max_ttl_s.is_some() {
        check_ttl("maxTtlS", max_ttl_s, SANDBOX_TTL_MAX_S)?;
    }
    check_ttl("defaultTtlS", change.default_ttl_s.unwrap_or(doc.default_ttl_s), max_ttl_s)?;
    if let Some(env) = &change.env {
        check_env(env)?;
    }
    let changed = SandboxTemplateUpdated {
        name: change.name.filter(|n| *n != doc.name),
        warm_min: change.warm_min.filter(|n| *n != doc.warm_min),
        default_ttl_s: change.default_ttl_s.filter(|s| *s != doc.default_ttl_s),
        max_ttl_s: change.max_ttl_s.filter(|s| *s != doc.max_ttl_s),
        env: change.env.filter(|e| *e != doc.env),
        volumes: change.volumes.filter(|v| *v != doc.volumes),
    };
    if changed == SandboxTemplateUpdated::default() {
        return Ok(None);
    }
    Ok(Some(Append {
        stream: stream_of(KIND_SANDBOX_TEMPLATE, &doc.template_id),
        expected: ExpectedVersion::Exact(doc.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(SANDBOX_TEMPLATE_UPDATED, to_cbor(&changed)?)],
    }))
}

/// The capability an agent says when it runs commands in its sandboxes (`exec` tunnels).
pub const CAPABILITY_SANDBOX_EXEC: &str = "tunnel.sandbox-exec";
/// The most arguments a sandbox `exec` carries, and their bytes together.
pub const SANDBOX_EXEC_ARGS_MAX: usize = 256;
pub const SANDBOX_EXEC_BYTES_MAX: usize = 64 * 1024;

/// What `sandboxes.exec` decides on: the sandbox, the command, the node's session, the counts.
pub struct SandboxExecInput<'a> {
    pub sandbox: &'a SandboxDoc,
    pub command: &'a [String],
    /// The capabilities of the node's agent's session with this gateway (`None`: no session).
    pub capabilities: Option<&'a [String]>,
    pub open: super::tunnel::TunnelCounts,
    pub bounds: super::tunnel::TunnelBounds,
}

/// Decides an `exec` tunnel into a sandbox: it is running (claimed or warm), the command is
/// within its bounds, the node's agent has a session here and runs sandbox commands, and the
/// open tunnels are within theirs.
pub fn sandbox_exec(input: &SandboxExecInput<'_>) -> Result<super::tunnel::TunnelGrant, super::tunnel::TunnelRefusal> {
    use super::tunnel::{TunnelGrant, TunnelRefusal, TunnelRefusalKind as K};
    let refuse = |kind, message: String, reason| TunnelRefusal { kind, message, reason };
    let s = input.sandbox;
    if input.command.is_empty() {
        return Err(refuse(K::InvalidArgument, "command is empty: name the program to run".into(), None));
    }
    let bytes: usize = input.command.iter().map(|a| a.len() + 1).sum();
    if input.command.len() > SANDBOX_EXEC_ARGS_MAX || bytes > SANDBOX_EXEC_BYTES_MAX {
        return Err(refuse(
            K::InvalidArgument,
            format!(
                "command has {} arguments of {bytes} bytes; at most {SANDBOX_EXEC_ARGS_MAX} of {SANDBOX_EXEC_BYTES_MAX}",
                input.command.len()
            ),
            None,
        ));
    }
    if input.command.iter().any(|a| a.contains('\0')) {
        return Err(refuse(K::InvalidArgument, "an argument holds a NUL byte".into(), None));
    }
    if s.state != SandboxState::Running {
        return Err(refuse(K::InvalidState, format!("sandbox {} is {}, not running", s.sandbox_id, s.state.as_str()), None));
    }
    let Some(capabilities) = input.capabilities else {
        return Err(refuse(
            K::Unavailable,
            format!("node {}'s agent has no session with this gateway now; try again when it is connected", s.node_id),
            None,
        ));
    };
    if !capabilities.iter().any(|c| c == CAPABILITY_SANDBOX_EXEC) {
        return Err(refuse(
            K::Unsupported,
            format!("node {}'s agent does not advertise {CAPABILITY_SANDBOX_EXEC}", s.node_id),
            Some("daemon-capability"),
        ));
    }
    let bounds = [
        (input.open.tenant, input.bounds.per_tenant_max, "tunnels-per-tenant", "the tenant"),
        (input.open.key, input.bounds.per_key_max, "tunnels-per-key", "this key"),
        (input.open.node, input.bounds.per_node_max, "tunnels-per-node", "the node"),
    ];
    for (open, max, reason, who) in bounds {
        if open >= max {
            return Err(refuse(K::QuotaExceeded, format!("{who} holds {open} open tunnels, the most it may"), Some(reason)));
        }
    }
    Ok(TunnelGrant {
        op: bc_core::tunnel::Op::Exec,
        node_id: s.node_id.clone(),
        instance_id: Some(s.sandbox_id.clone()),
        port: None,
        command: input.command.to_vec(),
    })
}

/// Why an open `exec` tunnel's sandbox has ended, read again while the tunnel lasts.
pub fn sandbox_exec_ended(sandbox_id: &str, now: Option<&SandboxDoc>) -> Option<String> {
    match now {
        None => Some(format!("sandbox {sandbox_id} is gone")),
        Some(s) if s.state != SandboxState::Running => Some(format!("sandbox {sandbox_id} is {}", s.state.as_str())),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(warm_min: u32) -> SandboxTemplateDoc {
        SandboxTemplateDoc {
            tenant_id: "t".into(),
            template_id: "sbxt_1".into(),
            name: "py".into(),
            pool_id: "pool_1".into(),
            shape: SandboxShape { flavor_id: "flv_1".into(), vcpus: 1, memory_mib: 128 },
            image: InstanceImage {
                image_id: "img_1".into(),
                url: "http://x/".into(),
                sha256: "0".repeat(64),
                disk_format: DiskFormat::RootfsTar,
                size_bytes: None,
            },
            warm_min,
            default_ttl_s: 60,
            max_ttl_s: 600,
            env: BTreeMap::new(),
            network: "none".into(),
            volumes: Vec::new(),
            version: 1,
            created_at_ms: 0,
        }
    }

    fn sandbox(id: &str, state: SandboxState, warm: bool, ends_at_ms: Option<u64>) -> SandboxDoc {
        SandboxDoc {
            tenant_id: "t".into(),
            sandbox_id: id.into(),
            template_id: "sbxt_1".into(),
            pool_id: "pool_1".into(),
            node_id: "node_1".into(),
            shape: template(0).shape,
            image: template(0).image,
            env: BTreeMap::new(),
            network: "none".into(),
            volumes: Vec::new(),
            project_id: None,
            warm,
            started_at_ms: (!warm).then_some(0),
            ends_at_ms,
            state,
            apply: crate::sandbox::SandboxApply {
                command_id: "cmd_1".into(),
                desired: if state == SandboxState::Deleting { "deleted".into() } else { "running".into() },
                deadline_at_ms: 1_000,
                answered_at_ms: None,
            },
            delete_attempts: 0,
            last_error: None,
            version: 2,
            created_at_ms: 0,
            updated_at_ms: 0,
        }
    }

    #[test]
    fn a_sandbox_past_its_end_is_deleted_and_an_unanswered_delete_is_sent_again() {
        let t = template(0);
        let s = [
            sandbox("sbx_a", SandboxState::Running, false, Some(500)),
            sandbox("sbx_b", SandboxState::Running, false, Some(5_000)),
            sandbox("sbx_c", SandboxState::Deleting, false, Some(500)),
        ];
        let plan = sandboxes_plan(std::slice::from_ref(&t), &s, 1_000);
        assert_eq!(
            plan,
            vec![
                SandboxAction::Delete { sandbox_id: "sbx_a".into(), reason: "ttl-expired".into() },
                SandboxAction::Delete {
                    sandbox_id: "sbx_c".into(),
                    reason: "retry: node node_1 did not answer the delete by its deadline".into()
                },
            ]
        );
        assert!(sandboxes_plan(&[t], &s[1..2], 1_000).is_empty(), "nothing to do before its end");
    }

    #[test]
    fn warm_pools_are_refilled_to_warm_min_counting_those_starting() {
        let t = template(3);
        let s = [sandbox("sbx_a", SandboxState::Starting, true, None), sandbox("sbx_b", SandboxState::Running, false, None)];
        assert_eq!(
            sandboxes_plan(std::slice::from_ref(&t), &s, 0),
            vec![SandboxAction::Warm { template_id: "sbxt_1".into(), count: 2 }]
        );
        let full: Vec<SandboxDoc> = (0..3).map(|i| sandbox(&format!("sbx_{i}"), SandboxState::Running, true, None)).collect();
        assert!(sandboxes_plan(&[t], &full, 0).is_empty());
        // The template deleted: its warm sandboxes go.
        assert_eq!(sandboxes_plan(&[], &full[..1], 0).len(), 1);
    }

    #[test]
    fn a_lowered_warm_min_deletes_the_newest_and_a_changed_env_replaces_the_warm_ones() {
        let mut t = template(1);
        let mut warm: Vec<SandboxDoc> = (0..3).map(|i| sandbox(&format!("sbx_{i}"), SandboxState::Running, true, None)).collect();
        for (i, s) in warm.iter_mut().enumerate() {
            s.created_at_ms = i as u64;
        }
        let deleted = |plan: Vec<SandboxAction>| -> Vec<(String, String)> {
            plan.into_iter()
                .filter_map(|a| match a {
                    SandboxAction::Delete { sandbox_id, reason } => Some((sandbox_id, reason)),
                    SandboxAction::Warm { .. } => None,
                })
                .collect()
        };
        let excess = |id: &str| (id.to_owned(), "warm-excess".to_owned());
        assert_eq!(deleted(sandboxes_plan(std::slice::from_ref(&t), &warm, 0)), vec![excess("sbx_1"), excess("sbx_2")]);
        // A claimed one is not warm: it lives to its end.
        warm[2].warm = false;
        assert_eq!(deleted(sandboxes_plan(std::slice::from_ref(&t), &warm, 0)), vec![excess("sbx_1")]);

        // A new environment: the warm ones made with the old go, and as many are made again.
        t.env.insert("X".into(), "2".into());
        t.warm_min = 2;
        let plan = sandboxes_plan(std::slice::from_ref(&t), &warm, 0);
        let updated = |id: &str| (id.to_owned(), "template-updated".to_owned());
        assert_eq!(deleted(plan.clone()), vec![updated("sbx_0"), updated("sbx_1")]);
        assert!(plan.contains(&SandboxAction::Warm { template_id: "sbxt_1".into(), count: 2 }), "{plan:?}");
    }

    #[test]
    fn a_template_update_is_checked_like_a_creation() {
        let t = template(0);
        let change = |f: fn(&mut SandboxTemplateUpdated)| {
            let mut c = SandboxTemplateUpdated::default();
            f(&mut c);
            sandbox_template_update(&t, c)
        };
        assert!(change(|_| {}).unwrap_err().to_string().contains("nothing to update"));
        assert!(change(|c| c.warm_min = Some(SANDBOX_WARM_MIN_MAX + 1)).is_err());
        assert!(change(|c| c.max_ttl_s = Some(SANDBOX_TTL_MAX_S + 1)).is_err());
        // The default (60 s) past a lowered maximum, and a default past the maximum kept.
        assert!(change(|c| c.max_ttl_s = Some(30)).unwrap_err().to_string().contains("defaultTtlS is 60 s"));
        assert!(change(|c| c.default_ttl_s = Some(601)).is_err());
        assert!(change(|c| c.env = Some(BTreeMap::from([("1X".into(), String::new())]))).is_err());
        let append = change(|c| {
            c.max_ttl_s = Some(30);
            c.default_ttl_s = Some(30);
        })
        .unwrap()
        .expect("a change");
        assert_eq!(append.expected, ExpectedVersion::Exact(t.version));
        assert_eq!(append.events[0].event_type, SANDBOX_TEMPLATE_UPDATED);
        // What the template already is changes nothing, and is not recorded.
        assert_eq!(change(|c| c.name = Some("py".into())).unwrap(), None);
        let append = change(|c| {
            c.name = Some("py".into());
            c.warm_min = Some(2);
        })
        .unwrap()
        .expect("a change");
        let only_new: SandboxTemplateUpdated =
            serde_json::from_value(bc_core::canonical::to_json(&append.events[0].payload)).unwrap();
        assert_eq!(only_new, SandboxTemplateUpdated { warm_min: Some(2), ..Default::default() });
    }

    #[test]
    fn ttls_are_bounded_by_the_template() {
        let t = template(0);
        assert!(check_ttl("ttlS", 601, t.max_ttl_s).unwrap_err().to_string().contains("past the maximum of 600 s"));
        assert!(check_ttl("ttlS", SANDBOX_TTL_MIN_S - 1, t.max_ttl_s).is_err());
        check_ttl("ttlS", 600, t.max_ttl_s).unwrap();
        let claimed = sandbox("sbx_a", SandboxState::Running, false, Some(60_000));
        assert!(sandbox_extend(&claimed, t.max_ttl_s, 601_000, 1_000).is_err(), "past maxTtl from its start");
        sandbox_extend(&claimed, t.max_ttl_s, 600_000, 1_000).unwrap();
        let deleted = sandbox("sbx_a", SandboxState::Deleted, false, Some(60_000));
        assert!(sandbox_extend(&deleted, t.max_ttl_s, 100_000, 1_000).is_err());
    }

    #[test]
    fn env_names_and_sizes_are_checked() {
        let mut env = BTreeMap::new();
        env.insert("X".to_owned(), "1".to_owned());
        check_env(&env).unwrap();
        env.insert("1BAD".to_owned(), "1".to_owned());
        assert!(check_env(&env).is_err());
        let big: BTreeMap<String, String> = (0..=SANDBOX_ENV_VARS_MAX).map(|i| (format!("V{i}"), String::new())).collect();
        assert!(check_env(&big).is_err());
    }
    /// A cold sandbox made in a project, and a warm one claimed in one, carry it in their event
    /// and guard the project's stream at the version read; a warm one is made in none.
    #[test]
    fn a_sandbox_is_made_or_claimed_in_a_project() {
        let node = crate::drivers::test_node("n1", "pool_1", NodeState::Ready, &[CAPABILITY_SANDBOX_GVISOR]);
        let project = ProjectRef { project_id: "proj_1".into(), version: 3 };
        let issue = Issue { command_id: "cmd_01j00000000000000000000000", now_ms: 1_000 };
        let t = template(0);
        let in_project = SandboxAdmission { project: Some(&project), quota: None };
        let made = sandbox_create_mounting(&t, "sbx_9", &node, Some(60), issue, &[], &[], &in_project).unwrap();
        assert!(made.guards.contains(&("project/proj_1".to_owned(), ExpectedVersion::Exact(3))), "{:?}", made.guards);
        let created: SandboxCreated = ciborium::Value::deserialized(&made.events[0].payload).unwrap();
        assert_eq!(created.project_id.as_deref(), Some("proj_1"));
        let none = sandbox_create(&t, "sbx_9", &node, Some(60), issue).unwrap();
        assert!(none.guards.iter().all(|(s, _)| !s.starts_with("project/")));
        let err = sandbox_create_mounting(&t, "sbx_9", &node, None, issue, &[], &[], &in_project).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::InvalidArgument, "a warm sandbox waits for its claim's project: {err}");

        let warm = sandbox("sbx_1", SandboxState::Running, true, None);
        let claim = sandbox_claim(&t, &warm, 60, 1_000, &in_project).unwrap();
        assert_eq!(claim.guards, vec![("project/proj_1".to_owned(), ExpectedVersion::Exact(3))]);
        let claimed: SandboxClaimed = ciborium::Value::deserialized(&claim.events[0].payload).unwrap();
        assert_eq!(claimed, SandboxClaimed { ends_at_ms: 61_000, project_id: Some("proj_1".into()) });
        let plain = sandbox_claim(&t, &warm, 60, 1_000, &SandboxAdmission::default()).unwrap();
        assert!(plain.guards.is_empty());
        // A claim from before projects decodes as one in no project.
        let old: SandboxClaimed = ciborium::Value::deserialized(&to_cbor(&SandboxEnd { ends_at_ms: 5 }).unwrap()).unwrap();
        assert_eq!(old.project_id, None);
    }

    /// Under a quota bounding sandboxes, vCPUs or memory, a cold create and a claim each count
    /// one sandbox and its template's vCPUs and memory; past a limit, QUOTA_EXCEEDED naming it.
    #[test]
    fn a_sandbox_is_counted_against_its_tenants_resource_limits() {
        use crate::decide::quota::{QuotaRead, ResourceUse};
        let node = crate::drivers::test_node("n1", "pool_1", NodeState::Ready, &[CAPABILITY_SANDBOX_GVISOR]);
        let issue = Issue { command_id: "cmd_01j00000000000000000000000", now_ms: 1_000 };
        let t = template(0);
        let q =
            crate::QuotaDoc { pool_id: "pool_1".into(), sandboxes: Some(2), vcpus: Some(4), version: 5, ..Default::default() };
        let under = |sandboxes: u32, vcpus: u64| SandboxAdmission {
            project: None,
            quota: Some(QuotaRead { quota: &q, in_use: ResourceUse { sandboxes, vcpus, ..ResourceUse::default() } }),
        };
        let made = sandbox_create_mounting(&t, "sbx_9", &node, Some(60), issue, &[], &[], &under(1, 1)).unwrap();
        assert_eq!(made.event_types().last(), Some(&QUOTA_COUNTED));
        assert!(made.guards.contains(&("quota/pool_1".to_owned(), ExpectedVersion::Exact(5))), "{:?}", made.guards);
        let err = sandbox_create_mounting(&t, "sbx_9", &node, Some(60), issue, &[], &[], &under(2, 1)).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::QuotaExceeded, "{err}");
        assert!(err.to_string().contains("quota of 2 sandboxes") && err.to_string().contains("in use: 2"), "{err}");
        let warm = sandbox("sbx_1", SandboxState::Running, true, None);
        let err = sandbox_claim(&t, &warm, 60, 1_000, &under(0, 4)).unwrap_err();
        assert!(err.to_string().contains("quota of 4 vCPUs"), "a claim is counted too: {err}");
        let claim = sandbox_claim(&t, &warm, 60, 1_000, &under(0, 0)).unwrap();
        assert_eq!(claim.event_types(), vec![SANDBOX_CLAIMED, QUOTA_COUNTED]);
        // The warm pool's own creates are under no quota.
        let err = sandbox_create_mounting(&t, "sbx_9", &node, None, issue, &[], &[], &under(0, 0)).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::InvalidArgument);
    }

    #[test]
    fn warm_sandboxes_are_bounded_per_tenant_and_per_node() {
        // The tenant: the templates' warmMin summed.
        let with = |id: &str, warm: u32| SandboxTemplateDoc { template_id: id.into(), ..template(warm) };
        let templates = [with("sbxt_1", 60), with("sbxt_2", 60)];
        check_tenant_warm(&templates, "sbxt_3", SANDBOX_WARM_PER_TENANT_MAX - 120).unwrap();
        let err = check_tenant_warm(&templates, "sbxt_3", SANDBOX_WARM_PER_TENANT_MAX - 119).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::QuotaExceeded, "{err}");
        assert!(err.to_string().contains("SANDBOX_WARM_PER_TENANT_MAX") && err.to_string().contains("at most 8"), "{err}");
        check_tenant_warm(&templates, "sbxt_1", 64).unwrap();
        assert!(check_tenant_warm(&templates, "sbxt_1", SANDBOX_WARM_PER_TENANT_MAX - 59).is_err());
        let over = [with("sbxt_1", 64), with("sbxt_2", 64), with("sbxt_3", 64)];
        check_tenant_warm(&over, "sbxt_1", 10).expect("lowering is always allowed");

        // The node: what it runs, and of that, what it keeps warm.
        let gvisor = [CAPABILITY_SANDBOX_GVISOR];
        let nodes = [
            crate::drivers::test_node("n1", "pool_1", NodeState::Ready, &gvisor),
            crate::drivers::test_node("n2", "pool_1", NodeState::Ready, &gvisor),
        ];
        let map =
            |pairs: &[(&str, usize)]| -> BTreeMap<String, usize> { pairs.iter().map(|(n, c)| ((*n).to_owned(), *c)).collect() };
        let load = map(&[("n1", 3), ("n2", 5)]);
        assert_eq!(place_sandbox(&nodes, "pool_1", &load, None).unwrap().node_id, "n1");
        let warm = map(&[("n1", SANDBOX_WARM_PER_NODE_MAX)]);
        assert_eq!(place_sandbox(&nodes, "pool_1", &load, Some(&warm)).unwrap().node_id, "n2", "n1 holds its most warm ones");
        assert_eq!(place_sandbox(&nodes, "pool_1", &load, None).unwrap().node_id, "n1", "a cold one still fits there");
        let full = map(&[("n1", SANDBOXES_PER_NODE_MAX), ("n2", SANDBOXES_PER_NODE_MAX)]);
        let err = place_sandbox(&nodes, "pool_1", &full, None).unwrap_err();
        assert_eq!(err.code(), bc_core::ErrorCode::QuotaExceeded, "{err}");
        assert!(err.to_string().contains("2 ready node(s)") && err.to_string().contains("SANDBOXES_PER_NODE_MAX"), "{err}");
        assert_eq!(place_sandbox(&nodes, "pool_2", &load, None).unwrap_err().code(), bc_core::ErrorCode::InvalidState);
        check_node_room("n1", &load).unwrap();
        assert_eq!(check_node_room("n1", &full).unwrap_err().code(), bc_core::ErrorCode::QuotaExceeded);

        // Warm ones counted: starting or running, unclaimed.
        let mut claimed = sandbox("sbx_2", SandboxState::Running, false, Some(1));
        claimed.node_id = "n1".into();
        let mut starting = sandbox("sbx_1", SandboxState::Starting, true, None);
        starting.node_id = "n1".into();
        let failed = sandbox("sbx_3", SandboxState::Failed, true, None);
        assert_eq!(warm_load(&[starting, claimed, failed]), map(&[("n1", 1)]));
    }
}
