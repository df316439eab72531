//! Bare-metal machines and their workflows: the documents (`metal/node_…`, `workflow/wf_…`),
//! the recipes (which steps each verb runs, as data), the types and payloads of the `metal.*`
//! events, and their fold.
//!
//! A machine's lifecycle state moves only by the table in [`crate::metal`]; each state that is
//! not stable runs a **workflow**: the steps of its recipe ([`recipe`]), executed one at a time
//! by the `metal` reconciler against the machine's BMC. Each step's end is an event
//! (`metal.step_done`), so a reconciler killed at any point resumes at the first step not done;
//! a failed step is tried again after a back-off (`metal.step_retried`, counted, bounded); and
//! every workflow carries the deadline it started with, so no machine waits forever. A
//! power change (`metal power`) is a workflow in a stable state: the state does not move.
//!
//! Every event is on the machine's stream; a workflow's own row is folded from the same events
//! by the same code as the copy in the machine's document ([`fold_workflow`]).

use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use bc_core::{Result, canonical};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::metal::{MetalFlags, MetalState, POWER_DEADLINE_S, Verb};
use crate::{corrupt, from_doc, payload, to_doc};

/// A bare-metal machine (`metal/node_…`) was enrolled by its BMC ([`MetalEnrolled`]); its BMC
/// password is sealed in the secret store, never in the log.
pub const METAL_ENROLLED: &str = "metal.enrolled";
/// The machine moved from one lifecycle state to another by a verb ([`MetalTransitioned`]):
/// a caller's, or its workflow's (`done`, `wait`, `fail`). Every transition is one of these.
pub const METAL_TRANSITIONED: &str = "metal.transitioned";
/// One step of the machine's workflow finished ([`MetalStepDone`]).
pub const METAL_STEP_DONE: &str = "metal.step_done";
/// One step failed and is tried again after a back-off ([`MetalStepRetried`]).
pub const METAL_STEP_RETRIED: &str = "metal.step_retried";
/// A workflow ended ([`MetalWorkflowFinished`]): succeeded, failed (with the reason) or aborted.
pub const METAL_WORKFLOW_FINISHED: &str = "metal.workflow_finished";
/// An operator paused or resumed a workflow's steps (its deadline runs on either way).
pub const METAL_WORKFLOW_PAUSED: &str = "metal.workflow_paused";
pub const METAL_WORKFLOW_RESUMED: &str = "metal.workflow_resumed";
/// The machine was put in maintenance with a reason ([`MetalMaintenanceSet`]): a BMC that
/// refuses its credentials, after bounded retries. `recover` clears it.
pub const METAL_MAINTENANCE_SET: &str = "metal.maintenance_set";
/// The BMC says another power state than the log, on reads a sync interval apart
/// ([`MetalPowerDrifted`]): the log follows the machine.
pub const METAL_POWER_DRIFTED: &str = "metal.power_drifted";

/// How a BMC's certificate is checked, as enrolled. The CA bundle and the pin are public.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalBmc {
    /// `https://host[:port]`.
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_path: Option<String>,
    pub username: String,
    /// `ca`, `pin` or `insecure`.
    pub tls: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pin: Option<String>,
    /// Where the password is sealed in the secret store.
    pub secret_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalEnrolled {
    pub pool_id: String,
    pub name: String,
    pub bmc: MetalBmc,
    /// The site the machine is at (`site_…` of the tenant): the one asked for, or its pool's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site_id: Option<String>,
}

/// A workflow started by a transition: its id, its steps in order, and what they need.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalWorkflowStart {
    pub workflow_id: String,
    /// The verb it runs (`deploy`, `power`, …).
    pub verb: String,
    pub steps: Vec<String>,
    /// When it fails if not finished: the state's deadline (or the power change's).
    pub deadline_at_ms: u64,
    /// The image a deploy or a rescue boots (its URL, from the catalog).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_url: Option<String>,
    /// A deploy's join token, bound to the node, that the installed system joins with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_token_id: Option<String>,
    /// `on`, `off` or `reboot`: a power workflow's target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalTransitioned {
    pub verb: String,
    pub from: String,
    pub to: String,
    /// Why (a failure's reason: the machine's `lastError`; an operator's note).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The workflow the new state runs, when it runs one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<MetalWorkflowStart>,
}

/// What a machine's BMC said at inspection.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalInspection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manufacturer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processor_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_gib: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalStepDone {
    pub workflow_id: String,
    pub step: String,
    pub index: u32,
    /// The power state the BMC said at this step (`on`/`off`), when it read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inspection: Option<MetalInspection>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalStepRetried {
    pub workflow_id: String,
    pub step: String,
    pub index: u32,
    /// Failed attempts of this step so far.
    pub attempts: u32,
    /// The BMC error's kind (`unauthorized`, `timeout`, `unreachable`, `refused`, `protocol`).
    pub error_kind: String,
    pub error: String,
    pub retry_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalWorkflowFinished {
    pub workflow_id: String,
    /// `succeeded`, `failed` or `aborted`.
    pub outcome: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalWorkflowRef {
    pub workflow_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalMaintenanceSet {
    pub reason: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MetalPowerDrifted {
    /// What the log said (`on`/`off`), and what the BMC says now.
    pub expected: String,
    pub observed: String,
}

/// A machine's document, keyed by its node id.
pub const KIND_METAL: &str = "metal";
/// A workflow's document (every workflow a machine ran, `workflows.list --node`).
pub const KIND_WORKFLOW: &str = "workflow";

/// Failed attempts of one step before the workflow fails.
pub const STEP_ATTEMPTS_MAX: u32 = 5;
/// Answers of 401 in a row before the machine goes into maintenance (credentials do not heal
/// by retrying; an endless loop against a BMC can lock its account).
pub const UNAUTHORIZED_ATTEMPTS_MAX: u32 = 3;
/// The back-off after a failed attempt: this, doubled per attempt, at most [`STEP_BACKOFF_MAX_MS`].
pub const STEP_BACKOFF_MS: u64 = 1_000;
pub const STEP_BACKOFF_MAX_MS: u64 = 30_000;

/// One step of a workflow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Step {
    /// Read the system: the credentials work and the power state is known.
    CheckBmc,
    /// Read the system's hardware summary (out-of-band inspection).
    ReadInventory,
    /// Ask for power off (skipped when already off).
    PowerOff,
    /// Poll until the BMC says off, within [`POWER_DEADLINE_S`].
    WaitPowerOff,
    /// Ask for power on (skipped when already on).
    PowerOn,
    /// Poll until the BMC says on, within [`POWER_DEADLINE_S`].
    WaitPowerOn,
    /// Ask for a forced restart.
    Reboot,
    EjectMedia,
    /// Insert the workflow's image into the virtual CD drive.
    InsertMedia,
    /// Boot once from the virtual CD at the next boot.
    BootOnceCd,
    /// Wait (in the wait state) for the installed system's agent to join as this node.
    WaitAgent,
}

impl Step {
    pub const ALL: &[Step] = &[
        Step::CheckBmc,
        Step::ReadInventory,
        Step::PowerOff,
        Step::WaitPowerOff,
        Step::PowerOn,
        Step::WaitPowerOn,
        Step::Reboot,
        Step::EjectMedia,
        Step::InsertMedia,
        Step::BootOnceCd,
        Step::WaitAgent,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Step::CheckBmc => "check-bmc",
            Step::ReadInventory => "read-inventory",
            Step::PowerOff => "power-off",
            Step::WaitPowerOff => "wait-power-off",
            Step::PowerOn => "power-on",
            Step::WaitPowerOn => "wait-power-on",
            Step::Reboot => "reboot",
            Step::EjectMedia => "eject-media",
            Step::InsertMedia => "insert-media",
            Step::BootOnceCd => "boot-once-cd",
            Step::WaitAgent => "wait-agent",
        }
    }

    pub fn parse(text: &str) -> Option<Step> {
        Step::ALL.iter().copied().find(|s| s.as_str() == text)
    }

    /// The power state a waiting step waits for, with its own deadline.
    pub fn waits_for_power(self) -> Option<&'static str> {
        match self {
            Step::WaitPowerOff => Some("off"),
            Step::WaitPowerOn => Some("on"),
            _ => None,
        }
    }
}

use Step as St;

/// The steps a workflow runs, by the state it runs in (and, for a power change in a stable
/// state, its target). `None`: the state runs no workflow of its own.
pub fn recipe(state: MetalState, power: Option<&str>) -> Option<&'static [Step]> {
    use MetalState as S;
    if state.is_stable() {
        return match power? {
            "on" => Some(&[St::PowerOn, St::WaitPowerOn]),
            "off" => Some(&[St::PowerOff, St::WaitPowerOff]),
            "reboot" => Some(&[St::Reboot, St::WaitPowerOn]),
            _ => None,
        };
    }
    Some(match state {
        S::Verifying => &[St::CheckBmc],
        S::Inspecting => &[St::CheckBmc, St::ReadInventory],
        // Metadata-only cleaning: off, and nothing left in the drive.
        S::Cleaning => &[St::PowerOff, St::WaitPowerOff, St::EjectMedia],
        S::Deploying => &[
            St::PowerOff,
            St::WaitPowerOff,
            St::EjectMedia,
            St::InsertMedia,
            St::BootOnceCd,
            St::PowerOn,
            St::WaitPowerOn,
            St::WaitAgent,
        ],
        S::Deleting => &[St::PowerOff, St::WaitPowerOff, St::EjectMedia],
        S::Rescuing => {
            &[St::PowerOff, St::WaitPowerOff, St::EjectMedia, St::InsertMedia, St::BootOnceCd, St::PowerOn, St::WaitPowerOn]
        }
        S::Unrescuing => &[St::PowerOff, St::WaitPowerOff, St::EjectMedia, St::PowerOn, St::WaitPowerOn],
        // The wait states continue the workflow of the state before them.
        _ => return None,
    })
}

/// How a workflow ended, or that it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WorkflowOutcome {
    Running,
    Succeeded,
    Failed,
    Aborted,
}

impl WorkflowOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkflowOutcome::Running => "running",
            WorkflowOutcome::Succeeded => "succeeded",
            WorkflowOutcome::Failed => "failed",
            WorkflowOutcome::Aborted => "aborted",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        [Self::Running, Self::Succeeded, Self::Failed, Self::Aborted].into_iter().find(|o| o.as_str() == text)
    }
}

/// A workflow: its steps, where it is, and when it must be done.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Workflow {
    pub tenant_id: String,
    pub workflow_id: String,
    pub node_id: String,
    pub verb: String,
    pub steps: Vec<String>,
    /// The step running now (`steps.len()` once all are done).
    pub step_index: u32,
    /// When the current step began: the previous step's end, or the workflow's start.
    pub step_started_at_ms: u64,
    /// Failed attempts of the current step, and of those how many were 401s in a row.
    pub attempts: u32,
    pub unauthorized: u32,
    /// Not before this time is the current step tried again.
    pub retry_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub started_at_ms: u64,
    pub deadline_at_ms: u64,
    pub paused: bool,
    pub outcome: WorkflowOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_token_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
    /// The machine stream's version at this workflow's last event.
    pub version: u64,
    pub updated_at_ms: u64,
}

impl Workflow {
    /// The step running now, `None` once every step is done.
    pub fn current(&self) -> Option<Step> {
        self.steps.get(self.step_index as usize).and_then(|s| Step::parse(s))
    }

    pub fn is_running(&self) -> bool {
        self.outcome == WorkflowOutcome::Running
    }

    /// The deadline of the step running now: a power wait's own, else the workflow's.
    pub fn step_deadline_at_ms(&self) -> u64 {
        match self.current().and_then(Step::waits_for_power) {
            Some(_) => self.deadline_at_ms.min(self.step_started_at_ms.saturating_add(POWER_DEADLINE_S * 1000)),
            None => self.deadline_at_ms,
        }
    }
}

/// A bare-metal machine's document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MetalDoc {
    pub tenant_id: String,
    pub node_id: String,
    pub pool_id: String,
    pub name: String,
    /// The site it is at, if it names one; while it is not retired, the site is not deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site_id: Option<String>,
    pub state: MetalState,
    pub flags: MetalFlags,
    /// The reason of the last failure, kept until a workflow succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub bmc: MetalBmc,
    /// The power state as the log last knew it (`on`/`off`; `None` before the BMC was read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inspection: Option<MetalInspection>,
    /// The image it was last deployed with (`active`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_id: Option<String>,
    pub state_entered_at_ms: u64,
    /// The workflow running now, or the last one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workflow: Option<Workflow>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl MetalDoc {
    /// The workflow running now, if any.
    pub fn running(&self) -> Option<&Workflow> {
        self.workflow.as_ref().filter(|w| w.is_running())
    }
}

fn parse_state(event: &StoredEvent, text: &str) -> Result<MetalState> {
    crate::metal::STATES
        .iter()
        .copied()
        .find(|s| s.as_str() == text)
        .ok_or_else(|| corrupt(event, format!("unknown metal state {text:?}")))
}

fn parse_verb(event: &StoredEvent, text: &str) -> Result<Verb> {
    Verb::ALL.iter().copied().find(|v| v.as_str() == text).ok_or_else(|| corrupt(event, format!("unknown metal verb {text:?}")))
}

/// The workflow a transition starts.
fn started(tenant_id: &str, node_id: &str, start: &MetalWorkflowStart, event: &StoredEvent) -> Workflow {
    let env = &event.envelope;
    Workflow {
        tenant_id: tenant_id.to_owned(),
        workflow_id: start.workflow_id.clone(),
        node_id: node_id.to_owned(),
        verb: start.verb.clone(),
        steps: start.steps.clone(),
        step_index: 0,
        step_started_at_ms: env.at_ms,
        attempts: 0,
        unauthorized: 0,
        retry_at_ms: 0,
        last_error: None,
        started_at_ms: env.at_ms,
        deadline_at_ms: start.deadline_at_ms,
        paused: false,
        outcome: WorkflowOutcome::Running,
        reason: None,
        finished_at_ms: None,
        image_id: start.image_id.clone(),
        image_url: start.image_url.clone(),
        join_token_id: start.join_token_id.clone(),
        power: start.power.clone(),
        version: env.version,
        updated_at_ms: env.at_ms,
    }
}

/// The fold of one machine event into a workflow (the machine's copy or the workflow's row);
/// events of other workflows leave it as it is.
pub fn fold_workflow(workflow: &mut Workflow, event: &StoredEvent) -> Result<()> {
    let env = &event.envelope;
    let ours = |id: &str| id == workflow.workflow_id;
    match env.event_type.as_str() {
        METAL_STEP_DONE => {
            let p: MetalStepDone = payload(event)?;
            if !ours(&p.workflow_id) {
                return Ok(());
            }
            if p.index != workflow.step_index || !workflow.is_running() {
                return Err(corrupt(event, format!("workflow {}: step {} done out of order", workflow.workflow_id, p.index)));
            }
            workflow.step_index += 1;
            workflow.step_started_at_ms = env.at_ms;
            workflow.attempts = 0;
            workflow.unauthorized = 0;
            workflow.retry_at_ms = 0;
        }
        METAL_STEP_RETRIED => {
            let p: MetalStepRetried = payload(event)?;
            if !ours(&p.workflow_id) {
                return Ok(());
            }
            workflow.attempts = p.attempts;
            workflow.unauthorized = if p.error_kind == "unauthorized" { workflow.unauthorized + 1 } else { 0 };
            workflow.retry_at_ms = p.retry_at_ms;
            workflow.last_error = Some(p.error);
        }
        METAL_WORKFLOW_FINISHED => {
            let p: MetalWorkflowFinished = payload(event)?;
            if !ours(&p.workflow_id) {
                return Ok(());
            }
            workflow.outcome = WorkflowOutcome::parse(&p.outcome)
                .filter(|o| *o != WorkflowOutcome::Running)
                .ok_or_else(|| corrupt(event, format!("unknown workflow outcome {:?}", p.outcome)))?;
            workflow.reason = p.reason;
            workflow.finished_at_ms = Some(env.at_ms);
        }
        METAL_WORKFLOW_PAUSED | METAL_WORKFLOW_RESUMED => {
            let p: MetalWorkflowRef = payload(event)?;
            if !ours(&p.workflow_id) {
                return Ok(());
            }
            workflow.paused = env.event_type == METAL_WORKFLOW_PAUSED;
            if !workflow.paused {
                // Resumed: the current step runs at once.
                workflow.retry_at_ms = 0;
            }
        }
        _ => return Ok(()),
    }
    workflow.version = env.version;
    workflow.updated_at_ms = env.at_ms;
    Ok(())
}

/// The workflow an event names (what its row is keyed by).
pub fn workflow_of(payload: &Value) -> Option<&str> {
    payload.get("workflowId").or_else(|| payload.get("workflow").and_then(|w| w.get("workflowId"))).and_then(Value::as_str)
}

/// The fold of a `metal.*` event into the machine's document or a workflow's row.
pub(crate) fn apply_metal(kind: &str, id: &str, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if kind == KIND_WORKFLOW {
        return apply_workflow_row(id, current, event);
    }
    let mut doc: MetalDoc = match env.event_type.as_str() {
        METAL_ENROLLED => {
            if current.is_some() {
                return Err(corrupt(event, format!("machine {id} enrolled twice")));
            }
            let p: MetalEnrolled = payload(event)?;
            MetalDoc {
                tenant_id: env.tenant.to_string(),
                node_id: id.to_owned(),
                pool_id: p.pool_id,
                name: p.name,
                site_id: p.site_id,
                state: MetalState::Enroll,
                flags: MetalFlags::default(),
                last_error: None,
                bmc: p.bmc,
                power: None,
                inspection: None,
                image_id: None,
                state_entered_at_ms: env.at_ms,
                workflow: None,
                version: env.version,
                created_at_ms: env.at_ms,
                updated_at_ms: env.at_ms,
            }
        }
        METAL_TRANSITIONED => {
            let p: MetalTransitioned = payload(event)?;
            let mut doc: MetalDoc = from_doc(event, current)?;
            let from = parse_state(event, &p.from)?;
            if from != doc.state {
                return Err(corrupt(event, format!("machine {id} moved from {from}, but it is {}", doc.state)));
            }
            let verb = parse_verb(event, &p.verb)?;
            let to = parse_state(event, &p.to)?;
            match verb {
                Verb::Retire => doc.flags.retired = true,
                Verb::Recover => doc.flags.maintenance = None,
                Verb::Fail => doc.last_error = p.reason.clone(),
                _ => {}
            }
            if to == MetalState::Active && verb == Verb::Done {
                doc.image_id = doc.workflow.as_ref().and_then(|w| w.image_id.clone());
            }
            if to != from {
                doc.state = to;
                doc.state_entered_at_ms = env.at_ms;
            }
            if let Some(start) = &p.workflow {
                doc.workflow = Some(started(&doc.tenant_id, &doc.node_id, start, event));
            }
            doc
        }
        METAL_STEP_DONE | METAL_STEP_RETRIED | METAL_WORKFLOW_FINISHED | METAL_WORKFLOW_PAUSED | METAL_WORKFLOW_RESUMED => {
            let mut doc: MetalDoc = from_doc(event, current)?;
            let workflow = doc.workflow.as_mut().ok_or_else(|| corrupt(event, format!("machine {id} runs no workflow")))?;
            fold_workflow(workflow, event)?;
            if env.event_type == METAL_STEP_DONE {
                let p: MetalStepDone = payload(event)?;
                if p.power.is_some() {
                    doc.power = p.power;
                }
                if p.inspection.is_some() {
                    doc.inspection = p.inspection;
                }
            }
            if env.event_type == METAL_WORKFLOW_FINISHED && workflow.outcome == WorkflowOutcome::Succeeded {
                doc.last_error = None;
            }
            // An abort leaves the machine in a failed state too (deploy-wait → deploy-failed), and
            // every failed state says why.
            if env.event_type == METAL_WORKFLOW_FINISHED
                && matches!(workflow.outcome, WorkflowOutcome::Failed | WorkflowOutcome::Aborted)
            {
                doc.last_error = workflow.reason.clone();
            }
            doc
        }
        METAL_MAINTENANCE_SET => {
            let p: MetalMaintenanceSet = payload(event)?;
            let mut doc: MetalDoc = from_doc(event, current)?;
            doc.flags.maintenance = Some(p.reason);
            doc
        }
        METAL_POWER_DRIFTED => {
            let p: MetalPowerDrifted = payload(event)?;
            let mut doc: MetalDoc = from_doc(event, current)?;
            doc.power = Some(p.observed);
            doc
        }
        other => return Err(corrupt(event, format!("{other} is not a machine event"))),
    };
    doc.version = env.version;
    doc.updated_at_ms = env.at_ms;
    to_doc(&doc)
}

/// The fold of a `metal.*` event into a workflow's row: made by the transition that starts it.
fn apply_workflow_row(id: &str, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    if env.event_type == METAL_TRANSITIONED {
        let p: MetalTransitioned = payload(event)?;
        if let Some(start) = p.workflow.filter(|w| w.workflow_id == id) {
            if current.is_some() {
                return Err(corrupt(event, format!("workflow {id} started twice")));
            }
            let node_id = crate::stream_id_of(&env.stream).to_owned();
            return to_doc(&started(&env.tenant.to_string(), &node_id, &start, event));
        }
        return Ok(current);
    }
    let mut workflow: Workflow = from_doc(event, current)?;
    fold_workflow(&mut workflow, event)?;
    to_doc(&workflow)
}

/// Folds one `metal.*` event into the row `key` (the machine's, or its workflow's); any other
/// type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match event.envelope.event_type.as_str() {
        METAL_ENROLLED
        | METAL_TRANSITIONED
        | METAL_STEP_DONE
        | METAL_STEP_RETRIED
        | METAL_WORKFLOW_FINISHED
        | METAL_WORKFLOW_PAUSED
        | METAL_WORKFLOW_RESUMED
        | METAL_MAINTENANCE_SET
        | METAL_POWER_DRIFTED => apply_metal(&key.kind, &key.id, current, event),
        _ => Ok(current),
    }
}

/// The rows a `metal.*` event changes: the machine's, and its workflow's when it names one.
pub(crate) fn touches(event: &StoredEvent, id: &str, out: &mut Vec<RowKey>) {
    let tenant = event.envelope.tenant.to_string();
    out.push(RowKey { tenant: tenant.clone(), kind: KIND_METAL.to_owned(), id: id.to_owned() });
    if let Some(workflow) = workflow_of(&canonical::to_json(&event.envelope.payload)) {
        out.push(RowKey { tenant, kind: KIND_WORKFLOW.to_owned(), id: workflow.to_owned() });
    }
}
