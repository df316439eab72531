//! The bare-metal decisions: a caller's verb on a machine ([`metal_verb`]), the `metal`
//! reconciler's plan for one machine ([`metal_plan`]), and what follows from one step's result
//! ([`metal_step`], [`metal_fail`], [`metal_drift`]), and which workflows a caller may retry
//! ([`workflow_retry`]). Pure: the document, the time and the ids
//! in, the append out. The BMC calls happen in the reconciler, between [`metal_plan`] and
//! [`metal_step`]; every append is at the machine's version read, so two reconcilers never
//! both record one step.

use bc_core::Error;
use bc_core::store::{ExpectedVersion, NewEvent};

use super::Append;
use crate::events::{self as ev, MetalInspection, MetalWorkflowStart};
use crate::metal::{MetalRefusal, MetalState, Verb, transition};
use crate::workflow::{
    KIND_METAL, MetalDoc, STEP_ATTEMPTS_MAX, STEP_BACKOFF_MAX_MS, STEP_BACKOFF_MS, Step, UNAUTHORIZED_ATTEMPTS_MAX, Workflow,
    WorkflowOutcome, recipe,
};
use crate::{KIND_JOIN_TOKEN, stream_of};

impl From<MetalRefusal> for Error {
    fn from(refusal: MetalRefusal) -> Self {
        let message = refusal.to_string();
        match refusal {
            MetalRefusal::InvalidState { allowed, .. } => {
                Error::InvalidState { message, allowed: allowed.iter().map(|v| v.as_str().to_owned()).collect(), hint: None }
            }
            MetalRefusal::Retired { .. } | MetalRefusal::InMaintenance { .. } => {
                Error::InvalidState { message, allowed: vec![], hint: None }
            }
        }
    }
}

/// What a caller's verb needs besides the machine: the ids and time it creates things with,
/// and its arguments.
#[derive(Clone, Debug, Default)]
pub struct VerbInput<'a> {
    pub now_ms: u64,
    /// The id of the workflow the verb starts, if it starts one.
    pub workflow_id: &'a str,
    /// `deploy` / `rescue`: the image (its id and URL).
    pub image: Option<(&'a str, &'a str)>,
    /// `deploy`: the join token minted for the installed system (its id), bound to the node.
    pub join_token_id: Option<&'a str>,
    /// `power`: `on`, `off` or `reboot`.
    pub power: Option<&'a str>,
    /// Only while the machine is at this version.
    pub if_version: Option<u64>,
}

/// How long a deploy's join token lives past the deploy's deadline.
pub const DEPLOY_TOKEN_GRACE_S: u64 = 10 * 60;

fn to_cbor<T: serde::Serialize>(payload: &T) -> Result<ciborium::Value, Error> {
    ev::to_cbor(payload)
}

fn start_of(to: MetalState, verb: Verb, input: &VerbInput<'_>) -> Option<MetalWorkflowStart> {
    let steps = recipe(to, input.power.filter(|_| verb == Verb::Power))?;
    let deadline_s = to.deadline_s().unwrap_or(crate::metal::POWER_DEADLINE_S * 2);
    Some(MetalWorkflowStart {
        workflow_id: input.workflow_id.to_owned(),
        verb: verb.as_str().to_owned(),
        steps: steps.iter().map(|s| s.as_str().to_owned()).collect(),
        deadline_at_ms: input.now_ms.saturating_add(deadline_s * 1000),
        image_id: input.image.map(|(id, _)| id.to_owned()),
        image_url: input.image.map(|(_, url)| url.to_owned()),
        join_token_id: input.join_token_id.map(str::to_owned),
        power: input.power.filter(|_| verb == Verb::Power).map(str::to_owned),
    })
}

fn finished(workflow: &Workflow, outcome: &str, reason: Option<String>) -> Result<NewEvent, Error> {
    Ok(NewEvent::new(
        ev::METAL_WORKFLOW_FINISHED,
        to_cbor(&ev::MetalWorkflowFinished { workflow_id: workflow.workflow_id.clone(), outcome: outcome.to_owned(), reason })?,
    ))
}

/// A stream an append guards, at the version it expects.
type Guard = (String, ExpectedVersion);

/// A deploy's join token, revoked when the deploy ends any way but success (aborted, failed,
/// timed out): it was minted for the system that deploy installs, and a token that outlived its
/// deploy could re-key the node afterwards. `None` for any other workflow. The token's stream is
/// a guard at any version (an event on another stream must be one), so a token spent or revoked
/// meanwhile is revoked again, harmlessly.
fn deploy_token_revoked(workflow: &Workflow) -> Result<Option<(NewEvent, Guard)>, Error> {
    let Some(token_id) = workflow.join_token_id.as_deref() else { return Ok(None) };
    let stream = stream_of(KIND_JOIN_TOKEN, &token_id);
    let mut revoked = NewEvent::new(ev::JOIN_TOKEN_REVOKED, to_cbor(&ev::JoinTokenRevoked {})?);
    revoked.stream = Some(stream.clone());
    Ok(Some((revoked, (stream, ExpectedVersion::Any))))
}

/// The machine's append of a workflow that ended any way but success, with its deploy's token
/// revoked ([`deploy_token_revoked`]).
fn ended_unsuccessfully(doc: &MetalDoc, workflow: &Workflow, mut events: Vec<NewEvent>) -> Result<Append, Error> {
    let revoked = deploy_token_revoked(workflow)?;
    let mut guards = Vec::new();
    if let Some((event, guard)) = revoked {
        events.push(event);
        guards.push(guard);
    }
    let mut append = on_machine(doc, events);
    append.guards = guards;
    Ok(append)
}

fn transitioned(
    doc: &MetalDoc,
    verb: Verb,
    to: MetalState,
    reason: Option<String>,
    workflow: Option<MetalWorkflowStart>,
) -> Result<NewEvent, Error> {
    Ok(NewEvent::new(
        ev::METAL_TRANSITIONED,
        to_cbor(&ev::MetalTransitioned {
            verb: verb.as_str().to_owned(),
            from: doc.state.as_str().to_owned(),
            to: to.as_str().to_owned(),
            reason,
            workflow,
        })?,
    ))
}

fn on_machine(doc: &MetalDoc, events: Vec<NewEvent>) -> Append {
    Append { stream: stream_of(KIND_METAL, &doc.node_id), expected: ExpectedVersion::Exact(doc.version), guards: vec![], events }
}

/// A caller's verb on a machine: the transition (and the workflow it starts), or why not.
pub fn metal_verb(doc: &MetalDoc, verb: Verb, input: &VerbInput<'_>) -> Result<Append, Error> {
    if verb.is_internal() {
        return Err(Error::invalid(format!("{verb} is the workflow's own verb, not a caller's")));
    }
    if let Some(expected) = input.if_version
        && expected != doc.version
    {
        return Err(Error::Conflict {
            stream: stream_of(KIND_METAL, &doc.node_id),
            expected: expected.to_string(),
            actual: doc.version,
        });
    }
    if let Some(running) = doc.running() {
        // Only an abort stops a running workflow: in a wait state by the table, in a stable
        // state (a power change) by ending it where it is.
        if verb != Verb::Abort {
            return Err(Error::InvalidState {
                message: format!(
                    "{verb} is refused: workflow {} ({}) is running on {}; wait for it, or abort it",
                    running.workflow_id, running.verb, doc.node_id
                ),
                allowed: if doc.state.is_stable() || crate::metal::allowed(doc.state, &doc.flags).contains(&Verb::Abort) {
                    vec!["abort".into()]
                } else {
                    vec![]
                },
                hint: None,
            });
        }
        if doc.state.is_stable() {
            let aborted = finished(running, "aborted", Some("aborted by a caller".into()))?;
            return ended_unsuccessfully(doc, running, vec![aborted]);
        }
        let to = transition(doc.state, &doc.flags, Verb::Abort)?;
        let reason = Some(format!("{} aborted by a caller", running.verb));
        let ended = vec![finished(running, "aborted", reason.clone())?, transitioned(doc, Verb::Abort, to, reason, None)?];
        return ended_unsuccessfully(doc, running, ended);
    }
    let to = transition(doc.state, &doc.flags, verb)?;
    if matches!(verb, Verb::Deploy | Verb::Rescue) && input.image.is_none() {
        return Err(Error::invalid(format!("{verb} needs an image")));
    }
    if verb == Verb::Power && !matches!(input.power, Some("on" | "off" | "reboot")) {
        return Err(Error::invalid("power needs on, off or reboot"));
    }
    let start = start_of(to, verb, input);
    let mut events = vec![];
    let mut guards = vec![];
    if let (Verb::Deploy, Some(token_id), Some(start)) = (verb, input.join_token_id, &start) {
        let mut token = NewEvent::new(
            ev::JOIN_TOKEN_CREATED,
            to_cbor(&ev::JoinTokenCreated {
                pool_id: doc.pool_id.clone(),
                description: format!("deploy of {} ({})", doc.node_id, start.workflow_id),
                expires_at_ms: start.deadline_at_ms.saturating_add(DEPLOY_TOKEN_GRACE_S * 1000),
                uses_max: 1,
                node_id: Some(doc.node_id.clone()),
            })?,
        );
        let stream = stream_of(KIND_JOIN_TOKEN, &token_id);
        token.stream = Some(stream.clone());
        guards.push((stream, ExpectedVersion::NoStream));
        events.push(token);
    }
    events.insert(0, transitioned(doc, verb, to, None, start)?);
    let mut append = on_machine(doc, events);
    append.guards = guards;
    Ok(append)
}

/// What the reconciler does next for one machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetalPlan {
    /// Nothing now (no workflow, paused, or backing off).
    Idle,
    /// Run this step of the running workflow against the BMC.
    Run(Step),
    /// The workflow's (or the step's) deadline passed: fail it with this reason.
    Fail(String),
    /// A wait's deadline passed (the power, the agent): look once more, and fail with `reason`
    /// unless the look finds it done. The deadline is checked when a pass comes, and a pass
    /// that came late (a slow BMC elsewhere) must not fail a machine whose power was applied,
    /// or whose agent joined, in time.
    LastLook { step: Step, reason: String },
}

/// The plan for one machine at `now_ms`. A paused workflow still fails at its deadline.
pub fn metal_plan(doc: &MetalDoc, now_ms: u64) -> MetalPlan {
    let Some(workflow) = doc.running() else { return MetalPlan::Idle };
    if now_ms >= workflow.deadline_at_ms {
        let step = workflow.current().map_or("its last step", Step::as_str);
        let mut reason = format!(
            "{} did not finish within its deadline of {} s (at step {step})",
            if doc.state.is_stable() {
                format!("power {}", workflow.power.as_deref().unwrap_or("change"))
            } else {
                doc.state.to_string()
            },
            workflow.deadline_at_ms.saturating_sub(workflow.started_at_ms) / 1000,
        );
        if let Some(error) = &workflow.last_error {
            reason.push_str(&format!("; last error: {error}"));
        }
        return match workflow.current() {
            Some(step) if !workflow.paused && (step.waits_for_power().is_some() || step == Step::WaitAgent) => {
                MetalPlan::LastLook { step, reason }
            }
            _ => MetalPlan::Fail(reason),
        };
    }
    let Some(step) = workflow.current() else {
        return MetalPlan::Fail(format!("workflow {} has no step left but did not finish", workflow.workflow_id));
    };
    if let Some(power) = step.waits_for_power()
        && now_ms >= workflow.step_deadline_at_ms()
    {
        let reason = format!(
            "the BMC did not apply power {power} within {} s{}",
            crate::metal::POWER_DEADLINE_S,
            doc.power.as_deref().map(|p| format!(" (it said {p})")).unwrap_or_default()
        );
        return if workflow.paused { MetalPlan::Fail(reason) } else { MetalPlan::LastLook { step, reason } };
    }
    if workflow.paused || now_ms < workflow.retry_at_ms {
        return MetalPlan::Idle;
    }
    MetalPlan::Run(step)
}

/// What running a step found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepResult {
    /// The step is done; what the BMC said on the way.
    Done { power: Option<String>, inspection: Option<MetalInspection> },
    /// A wait is not over yet (the power is not applied, the agent has not joined): no event.
    NotYet,
    /// The step failed: the BMC error's kind and message.
    Failed { kind: String, message: String },
}

/// The back-off after `attempts` failed attempts.
pub fn step_backoff_ms(attempts: u32) -> u64 {
    STEP_BACKOFF_MS.saturating_mul(1u64 << attempts.saturating_sub(1).min(16)).min(STEP_BACKOFF_MAX_MS)
}

/// What follows from one step's result; `next_workflow_id` names the workflow the next state
/// runs, if finishing this one moves the machine into a state that runs one (deleting →
/// cleaning). `None`: nothing to append.
pub fn metal_step(
    doc: &MetalDoc,
    step: Step,
    result: StepResult,
    now_ms: u64,
    next_workflow_id: &str,
) -> Result<Option<Append>, Error> {
    let Some(workflow) = doc.running() else { return Ok(None) };
    if workflow.current() != Some(step) {
        return Ok(None);
    }
    match result {
        StepResult::NotYet => {
            // The deploy's agent wait is its own state: entered once, when the wait begins.
            if step == Step::WaitAgent && doc.state == MetalState::Deploying {
                let to = transition(doc.state, &doc.flags, Verb::Wait)?;
                return Ok(Some(on_machine(doc, vec![transitioned(doc, Verb::Wait, to, None, None)?])));
            }
            Ok(None)
        }
        StepResult::Failed { kind, message } => {
            let attempts = workflow.attempts + 1;
            let unauthorized = if kind == "unauthorized" { workflow.unauthorized + 1 } else { 0 };
            if unauthorized >= UNAUTHORIZED_ATTEMPTS_MAX {
                let reason = format!("the BMC refused the credentials {unauthorized} times in a row: {message}");
                let mut append = metal_fail(doc, &reason)?;
                append.events.insert(
                    0,
                    NewEvent::new(ev::METAL_MAINTENANCE_SET, to_cbor(&ev::MetalMaintenanceSet { reason: reason.clone() })?),
                );
                return Ok(Some(append));
            }
            if attempts >= STEP_ATTEMPTS_MAX {
                let reason = format!("step {} failed {attempts} times; last: {message}", step.as_str());
                return Ok(Some(metal_fail(doc, &reason)?));
            }
            let retried = ev::MetalStepRetried {
                workflow_id: workflow.workflow_id.clone(),
                step: step.as_str().to_owned(),
                index: workflow.step_index,
                attempts,
                error_kind: kind,
                error: bc_core::id::truncate(&message, 500),
                retry_at_ms: now_ms.saturating_add(step_backoff_ms(attempts)),
            };
            Ok(Some(on_machine(doc, vec![NewEvent::new(ev::METAL_STEP_RETRIED, to_cbor(&retried)?)])))
        }
        StepResult::Done { power, inspection } => {
            let done = ev::MetalStepDone {
                workflow_id: workflow.workflow_id.clone(),
                step: step.as_str().to_owned(),
                index: workflow.step_index,
                power,
                inspection,
            };
            let mut events = vec![NewEvent::new(ev::METAL_STEP_DONE, to_cbor(&done)?)];
            if workflow.step_index as usize + 1 >= workflow.steps.len() {
                events.push(finished(workflow, "succeeded", None)?);
                if !doc.state.is_stable() {
                    let to = transition(doc.state, &doc.flags, Verb::Done)?;
                    let input = VerbInput { now_ms, workflow_id: next_workflow_id, ..VerbInput::default() };
                    events.push(transitioned(doc, Verb::Done, to, None, start_of(to, Verb::Done, &input))?);
                }
            }
            Ok(Some(on_machine(doc, events)))
        }
    }
}

/// The running workflow fails with `reason`: into the state's failed state (a power change in
/// a stable state stays where it is).
pub fn metal_fail(doc: &MetalDoc, reason: &str) -> Result<Append, Error> {
    let workflow = doc.running().ok_or_else(|| Error::Internal(format!("machine {} runs no workflow", doc.node_id)))?;
    let mut events = vec![finished(workflow, "failed", Some(reason.to_owned()))?];
    if !doc.state.is_stable() {
        let to = transition(doc.state, &doc.flags, Verb::Fail)?;
        events.push(transitioned(doc, Verb::Fail, to, Some(reason.to_owned()), None)?);
    }
    ended_unsuccessfully(doc, workflow, events)
}

/// A machine at rest (no workflow) whose BMC refused the credentials `reads` sync reads in a
/// row: at [`UNAUTHORIZED_ATTEMPTS_MAX`] it goes into maintenance with the reason (`None`
/// before that, or when a workflow runs or it is in maintenance already).
pub fn metal_unauthorized_at_rest(doc: &MetalDoc, reads: u32, message: &str) -> Result<Option<Append>, Error> {
    if reads < UNAUTHORIZED_ATTEMPTS_MAX || doc.running().is_some() || doc.flags.maintenance.is_some() {
        return Ok(None);
    }
    let reason = format!("the BMC refused the credentials {reads} times in a row: {message}");
    let event = NewEvent::new(ev::METAL_MAINTENANCE_SET, to_cbor(&ev::MetalMaintenanceSet { reason })?);
    Ok(Some(on_machine(doc, vec![event])))
}

/// The BMC says `observed` where the log says otherwise: the log follows the machine.
pub fn metal_drift(doc: &MetalDoc, observed: &str) -> Result<Option<Append>, Error> {
    let Some(expected) = doc.power.as_deref() else { return Ok(None) };
    if expected == observed || doc.running().is_some() {
        return Ok(None);
    }
    let drift = ev::MetalPowerDrifted { expected: expected.to_owned(), observed: observed.to_owned() };
    Ok(Some(on_machine(doc, vec![NewEvent::new(ev::METAL_POWER_DRIFTED, to_cbor(&drift)?)])))
}

/// `workflows.pause` / `resume` on the running workflow (`None`: it already is so).
pub fn metal_pause(doc: &MetalDoc, workflow_id: &str, pause: bool) -> Result<Option<Append>, Error> {
    let workflow = running_workflow(doc, workflow_id)?;
    if workflow.paused == pause {
        return Ok(None);
    }
    let event_type = if pause { ev::METAL_WORKFLOW_PAUSED } else { ev::METAL_WORKFLOW_RESUMED };
    Ok(Some(workflow_event(doc, workflow_id, event_type)?))
}

/// `workflows.retry` of the running workflow: resumed, its current step run at once (its
/// back-off cleared), paused or not.
pub fn metal_run_now(doc: &MetalDoc, workflow_id: &str) -> Result<Append, Error> {
    running_workflow(doc, workflow_id)?;
    workflow_event(doc, workflow_id, ev::METAL_WORKFLOW_RESUMED)
}

/// What `workflows.retry` does with one of a machine's workflows ([`workflow_retry`]).
#[derive(Clone, Debug, PartialEq)]
pub enum WorkflowRetry {
    /// The workflow is running: resumed, its current step run at once ([`metal_run_now`]).
    RunNow(Append),
    /// The machine's last workflow failed: its verb again, as a new workflow.
    Again(Append),
}

/// `workflows.retry`: the running workflow has its current step run at once; the machine's last
/// workflow, failed, is started again as a new workflow (its id drawn from `new_workflow_id`)
/// with the verb, image and power it ran. Refused: any other workflow (only the last failed
/// one is retried), an internal verb's, and a deploy's (a deploy mints a join token that only
/// its answer carries: it is retried with `metal.deploy`).
pub fn workflow_retry(
    doc: &MetalDoc,
    workflow: &Workflow,
    now_ms: u64,
    new_workflow_id: &mut dyn FnMut() -> String,
) -> Result<WorkflowRetry, Error> {
    if doc.running().is_some_and(|w| w.workflow_id == workflow.workflow_id) {
        return Ok(WorkflowRetry::RunNow(metal_run_now(doc, &workflow.workflow_id)?));
    }
    let refused = |message: String| Error::InvalidState { message, allowed: vec![], hint: None };
    if workflow.outcome != WorkflowOutcome::Failed || doc.workflow.as_ref().is_none_or(|w| w.workflow_id != workflow.workflow_id)
    {
        return Err(refused(format!(
            "workflow {} is {} and is not the machine's last: only the last failed workflow is retried",
            workflow.workflow_id,
            workflow.outcome.as_str()
        )));
    }
    let verb = Verb::ALL
        .iter()
        .copied()
        .find(|v| v.as_str() == workflow.verb && !v.is_internal())
        .ok_or_else(|| refused(format!("workflow {} ran {}, which is not retried", workflow.workflow_id, workflow.verb)))?;
    if verb == Verb::Deploy {
        return Err(refused(format!(
            "workflow {} is a deploy: deploy again with metal.deploy (nodeId {}), which mints the new join token",
            workflow.workflow_id, doc.node_id
        )));
    }
    let workflow_id = new_workflow_id();
    let input = VerbInput {
        now_ms,
        workflow_id: &workflow_id,
        image: workflow.image_id.as_deref().zip(workflow.image_url.as_deref()),
        power: workflow.power.as_deref(),
        ..Default::default()
    };
    Ok(WorkflowRetry::Again(metal_verb(doc, verb, &input)?))
}

fn running_workflow<'d>(doc: &'d MetalDoc, workflow_id: &str) -> Result<&'d Workflow, Error> {
    doc.running().filter(|w| w.workflow_id == workflow_id).ok_or_else(|| Error::InvalidState {
        message: format!("workflow {workflow_id} is not running"),
        allowed: vec![],
        hint: None,
    })
}

fn workflow_event(doc: &MetalDoc, workflow_id: &str, event_type: &str) -> Result<Append, Error> {
    let payload = to_cbor(&ev::MetalWorkflowRef { workflow_id: workflow_id.to_owned() })?;
    Ok(on_machine(doc, vec![NewEvent::new(event_type, payload)]))
}
