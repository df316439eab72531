//! Sandboxes and their templates: the documents (`sandbox_template/sbxt_…`, `sandbox/sbx_…`),
//! the live row of each sandbox not yet deleted, the payloads of `sandbox_template.*` and
//! `sandbox.*`, and their fold.
//!
//! A **template** says what its sandboxes are: a pool, a flavor's shape (vCPUs, memory), a
//! root-filesystem image, an environment, the bounds of their lives (`defaultTtlS`, `maxTtlS`),
//! the network policy (`none`) and how many are kept started unclaimed (`warmMin`).
//!
//! A **sandbox** is made on a node of the template's pool whose agent runs the sandbox runtime
//! (`sandbox.gvisor`) with a `sandbox.apply` command issued in the same append; the node answers
//! from its journal (`sandbox.observed`, `sandbox.apply_failed`) on the sandbox's stream. Its
//! life is in the log:
//!
//! - `sandbox.created`: made for a caller (cold: `warm: false`, with its end), or for a
//!   template's warm pool (`warm: true`, no end until claimed);
//! - `sandbox.claimed`: a warm one handed to a caller, with its end (one append);
//! - `sandbox.extended`: a later end, within the template's `maxTtlS` from its claim or creation;
//! - `sandbox.delete_requested`: by a caller, or by the `sandboxes` reconciler at its end
//!   (`reason: ttl-expired`) or again when a delete went unanswered (`reason: retry: …`), each
//!   with its own `sandbox.apply`;
//! - `sandbox.observed` with `state: absent` after a delete: the sandbox is `deleted` and its
//!   live row goes.
//!
//! `state` is the summary a caller reads: `starting` (an apply in flight), `running`,
//! `deleting`, `failed` (the node could not start it; the reason in `lastError`), `deleted`.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::command::{ResourceReport, apply_report};
use crate::events::*;
use crate::{NoFields, corrupt, delete_once, from_doc, payload, set_if, to_doc};

pub const SANDBOX_TEMPLATE_CREATED: &str = "sandbox_template.created";
pub const SANDBOX_TEMPLATE_UPDATED: &str = "sandbox_template.updated";
pub const SANDBOX_TEMPLATE_DELETED: &str = "sandbox_template.deleted";
pub const SANDBOX_CREATED: &str = "sandbox.created";
pub const SANDBOX_CLAIMED: &str = "sandbox.claimed";
pub const SANDBOX_EXTENDED: &str = "sandbox.extended";
pub const SANDBOX_DELETE_REQUESTED: &str = "sandbox.delete_requested";
/// What the node's runtime says of the sandbox, from its journal ([`SandboxReport`]).
pub const SANDBOX_OBSERVED: &str = "sandbox.observed";
/// The node could not apply (`image-digest: …`, `runtime: …`); finishes the command.
pub const SANDBOX_APPLY_FAILED: &str = "sandbox.apply_failed";
/// The node's sandbox reports.
pub const SANDBOX_REPORT_TYPES: &[&str] = &[SANDBOX_OBSERVED, SANDBOX_APPLY_FAILED];

pub const KIND_SANDBOX_TEMPLATE: &str = "sandbox_template";
pub const KIND_SANDBOX: &str = "sandbox";
/// One row per sandbox not yet deleted: what the `sandboxes` reconciler scans.
pub const KIND_SANDBOX_LIVE: &str = "sandbox_live";
/// The command the control plane sends a node to make a sandbox what it should be.
pub const SANDBOX_APPLY: &str = "sandbox.apply";
/// How long a node has to answer `sandbox.apply` (a root filesystem's fetch takes time);
/// unanswered by then, a delete is sent again.
pub const SANDBOX_APPLY_DEADLINE_S: u64 = 300;
/// The capability an agent says when it runs gVisor sandboxes.
pub const CAPABILITY_SANDBOX_GVISOR: &str = "sandbox.gvisor";
/// The only network policy sandboxes have so far: no network at all.
pub const SANDBOX_NETWORK_NONE: &str = "none";

/// The shape a sandbox gets: its template's flavor's when the template was made.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxShape {
    pub flavor_id: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
}

/// `sandbox_template.created`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxTemplateCreated {
    pub name: String,
    pub pool_id: String,
    pub shape: SandboxShape,
    pub image: InstanceImage,
    pub warm_min: u32,
    pub default_ttl_s: u64,
    pub max_ttl_s: u64,
    pub env: std::collections::BTreeMap<String, String>,
    pub network: String,
    /// The volumes every sandbox mounts (a template with volumes keeps no warm pool).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// `sandbox_template.updated`: what changes in place (absent: unchanged). Its pool, flavor, image
/// and network do not: a template made otherwise is another template. Sandboxes already claimed
/// keep what they were made with; warm ones made with another environment are replaced.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxTemplateUpdated {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_min: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_ttl_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ttl_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<std::collections::BTreeMap<String, String>>,
    /// The volumes from now on, replacing the old whole (empty: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<Vec<VolumeMount>>,
}

pub type SandboxTemplateDeleted = NoFields;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxTemplateDoc {
    pub tenant_id: String,
    pub template_id: String,
    pub name: String,
    pub pool_id: String,
    pub shape: SandboxShape,
    pub image: InstanceImage,
    pub warm_min: u32,
    pub default_ttl_s: u64,
    pub max_ttl_s: u64,
    pub env: std::collections::BTreeMap<String, String>,
    pub network: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    pub version: u64,
    pub created_at_ms: u64,
}

/// `sandbox.created`: on `node_id` of the template's pool, with its `sandbox.apply`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxCreated {
    pub template_id: String,
    pub pool_id: String,
    pub node_id: String,
    pub shape: SandboxShape,
    pub image: InstanceImage,
    pub env: std::collections::BTreeMap<String, String>,
    pub network: String,
    /// Made for the template's warm pool: unclaimed, no end until a claim gives it one.
    pub warm: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_at_ms: Option<u64>,
    pub apply: HoldIssued,
    /// The template's volumes, each attached to this sandbox in the same append.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// Started from this snapshot (its `sandbox.apply` carries it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<crate::sandbox_snapshot::SandboxRestore>,
    /// The project (`proj_…` of the tenant, live when it was made) a cold sandbox is made in;
    /// a warm one has none until its claim names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
}

/// `sandbox.claimed`: a warm sandbox handed out, its end, and the project its claim names.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxClaimed {
    pub ends_at_ms: u64,
    /// The project (`proj_…`, live when claimed) the claim is made in, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
}

/// `sandbox.extended` (and, before projects, `sandbox.claimed`): its end now.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxEnd {
    pub ends_at_ms: u64,
}

/// `sandbox.delete_requested`: the `sandbox.apply` that removes it, and why (a caller: none).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxDeleteRequested {
    pub apply: HoldIssued,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `sandbox.observed` and `sandbox.apply_failed`, from the node's journal, on the sandbox's
/// stream. With `command_id`, the answer to that `sandbox.apply` (and it finishes it).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxReport {
    pub sandbox_id: String,
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// `sandbox.observed` only: `running`, `stopped` or `absent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// `sandbox.apply_failed` only: a stable code, a colon, and words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal: Option<bc_core::agent::JournalOrigin>,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Starting,
    Running,
    Deleting,
    Failed,
    Deleted,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Starting => "starting",
            Self::Running => "running",
            Self::Deleting => "deleting",
            Self::Failed => "failed",
            Self::Deleted => "deleted",
        }
    }
}

/// The last `sandbox.apply` sent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxApply {
    pub command_id: String,
    /// `running` or `deleted`: what it asks.
    pub desired: String,
    pub deadline_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_at_ms: Option<u64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDoc {
    pub tenant_id: String,
    pub sandbox_id: String,
    pub template_id: String,
    pub pool_id: String,
    pub node_id: String,
    pub shape: SandboxShape,
    pub image: InstanceImage,
    pub env: std::collections::BTreeMap<String, String>,
    pub network: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// The project it was made in, or claimed in (`proj_…`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    /// Unclaimed, in its template's warm pool.
    pub warm: bool,
    /// When it was claimed (a warm one) or created (a cold one): what `maxTtlS` counts from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends_at_ms: Option<u64>,
    pub state: SandboxState,
    pub apply: SandboxApply,
    /// Deletes sent so far (the reconciler's retries count here).
    #[serde(default)]
    pub delete_attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl SandboxDoc {
    /// The `sandbox.apply` arguments for this document (`desired`: `running` or `deleted`).
    pub fn apply_args(&self, desired: &str) -> Value {
        let mut args = self.apply_args_base(desired);
        if !self.volumes.is_empty() {
            args["volumes"] = serde_json::json!(self.volumes);
        }
        args
    }

    fn apply_args_base(&self, desired: &str) -> Value {
        serde_json::json!({
            "sandboxId": self.sandbox_id,
            "desired": desired,
            "vcpus": self.shape.vcpus,
            "memoryMiB": self.shape.memory_mib,
            "image": self.image,
            "env": self.env,
            "network": self.network,
        })
    }
}

fn apply_status(apply: HoldIssued, desired: &str) -> SandboxApply {
    SandboxApply {
        command_id: apply.command_id,
        desired: desired.to_owned(),
        deadline_at_ms: apply.deadline_at_ms,
        answered_at_ms: None,
    }
}

/// Folds one `sandbox_template.*` event into the template's row.
fn apply_template(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match event.envelope.event_type.as_str() {
        SANDBOX_TEMPLATE_CREATED => {
            crate::create_once(key, &current, event, ("sandbox template", "created"), |p: SandboxTemplateCreated, env| {
                SandboxTemplateDoc {
                    tenant_id: env.tenant.to_string(),
                    template_id: key.id.clone(),
                    name: p.name,
                    pool_id: p.pool_id,
                    shape: p.shape,
                    image: p.image,
                    warm_min: p.warm_min,
                    default_ttl_s: p.default_ttl_s,
                    max_ttl_s: p.max_ttl_s,
                    env: p.env,
                    network: p.network,
                    volumes: p.volumes,
                    version: env.version,
                    created_at_ms: env.at_ms,
                }
            })
        }
        SANDBOX_TEMPLATE_UPDATED => crate::update(event, current, |doc: &mut SandboxTemplateDoc, p: SandboxTemplateUpdated| {
            set_if(&mut doc.name, p.name);
            set_if(&mut doc.warm_min, p.warm_min);
            set_if(&mut doc.default_ttl_s, p.default_ttl_s);
            set_if(&mut doc.max_ttl_s, p.max_ttl_s);
            set_if(&mut doc.env, p.env);
            set_if(&mut doc.volumes, p.volumes);
            doc.version = event.envelope.version;
        }),
        SANDBOX_TEMPLATE_DELETED => delete_once(key, current, event),
        _ => Ok(current),
    }
}

/// Folds a `sandbox.*` event into the sandbox's document or live row.
fn apply_sandbox(kind: &str, id: &str, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if kind == KIND_SANDBOX_LIVE && current.is_none() && env.event_type != SANDBOX_CREATED {
        return Ok(None);
    }
    let mut doc: SandboxDoc = match env.event_type.as_str() {
        SANDBOX_CREATED => {
            if current.is_some() {
                return Err(corrupt(event, format!("sandbox {id} created twice")));
            }
            let p: SandboxCreated = payload(event)?;
            SandboxDoc {
                tenant_id: env.tenant.to_string(),
                sandbox_id: id.to_owned(),
                template_id: p.template_id,
                pool_id: p.pool_id,
                node_id: p.node_id,
                shape: p.shape,
                image: p.image,
                env: p.env,
                network: p.network,
                volumes: p.volumes,
                project_id: p.project_id,
                warm: p.warm,
                started_at_ms: (!p.warm).then_some(env.at_ms),
                ends_at_ms: p.ends_at_ms,
                state: SandboxState::Starting,
                apply: apply_status(p.apply, "running"),
                delete_attempts: 0,
                last_error: None,
                version: env.version,
                created_at_ms: env.at_ms,
                updated_at_ms: env.at_ms,
            }
        }
        _ => from_doc(event, current)?,
    };
    match env.event_type.as_str() {
        SANDBOX_CREATED => {}
        SANDBOX_CLAIMED => {
            let p: SandboxClaimed = payload(event)?;
            if !doc.warm {
                return Err(corrupt(event, format!("sandbox {id} claimed, but it is not warm")));
            }
            doc.warm = false;
            doc.started_at_ms = Some(env.at_ms);
            doc.ends_at_ms = Some(p.ends_at_ms);
            doc.project_id = p.project_id;
        }
        SANDBOX_EXTENDED => {
            let p: SandboxEnd = payload(event)?;
            doc.ends_at_ms = Some(p.ends_at_ms);
        }
        SANDBOX_DELETE_REQUESTED => {
            let p: SandboxDeleteRequested = payload(event)?;
            doc.apply = apply_status(p.apply, "deleted");
            doc.state = SandboxState::Deleting;
            doc.delete_attempts += 1;
            if p.reason.is_some() {
                doc.last_error = p.reason;
            }
        }
        SANDBOX_OBSERVED | SANDBOX_APPLY_FAILED => {
            let report: SandboxReport = payload(event)?;
            let answers = report.command_id.as_deref() == Some(doc.apply.command_id.as_str());
            if answers {
                doc.apply.answered_at_ms = Some(env.at_ms);
            }
            if env.event_type == SANDBOX_OBSERVED {
                let state = report.state.ok_or_else(|| corrupt(event, "sandbox.observed without a state".into()))?;
                doc.state = match (state.as_str(), doc.apply.desired.as_str()) {
                    ("absent", "deleted") => SandboxState::Deleted,
                    (_, "deleted") => SandboxState::Deleting,
                    ("running", _) => SandboxState::Running,
                    // Gone or stopped behind the control plane's back: it is not coming back.
                    _ => {
                        doc.last_error = Some(format!("runtime: the node observes the sandbox {state}"));
                        SandboxState::Failed
                    }
                };
            } else if answers {
                doc.last_error = report.reason;
                if doc.apply.desired != "deleted" {
                    doc.state = SandboxState::Failed;
                }
            }
        }
        _ => return to_doc(&doc),
    }
    doc.version = env.version;
    doc.updated_at_ms = env.at_ms;
    if kind == KIND_SANDBOX_LIVE && doc.state == SandboxState::Deleted { Ok(None) } else { to_doc(&doc) }
}

/// `sandbox.observed` or `.apply_failed`, from the node's journal: the sandbox's rows, the
/// node's journal head, and the command it answers.
fn report(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    if matches!(key.kind.as_str(), KIND_SANDBOX | KIND_SANDBOX_LIVE) {
        return apply_sandbox(&key.kind, &key.id, current, event);
    }
    let report: SandboxReport = payload(event)?;
    let failed = event.envelope.event_type == SANDBOX_APPLY_FAILED;
    let result = (!failed).then(|| serde_json::json!({ "state": report.state }));
    let (node_id, command_id, reason, journal) = (report.node_id, report.command_id, report.reason, report.journal);
    apply_report(
        key,
        current,
        event,
        ResourceReport { what: "a sandbox report", node_id, command_id, reason, journal, result, failed },
    )
}

/// Folds one `sandbox_template.*` or `sandbox.*` event into the row `key`.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match event.envelope.event_type.as_str() {
        SANDBOX_TEMPLATE_CREATED | SANDBOX_TEMPLATE_UPDATED | SANDBOX_TEMPLATE_DELETED => apply_template(key, current, event),
        SANDBOX_CREATED | SANDBOX_CLAIMED | SANDBOX_EXTENDED | SANDBOX_DELETE_REQUESTED => {
            apply_sandbox(&key.kind, &key.id, current, event)
        }
        SANDBOX_OBSERVED | SANDBOX_APPLY_FAILED => report(key, current, event),
        _ => Ok(current),
    }
}
