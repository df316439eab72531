//! Bare-metal machines and their workflows as the API shows them. The BMC's password is not
//! here, nor where it is sealed.

use bc_projections::events::MetalInspection;
use bc_projections::metal::{MetalState, allowed};
use bc_projections::workflow::{MetalDoc, Workflow, WorkflowOutcome};
use schemars::JsonSchema;
use serde::Serialize;

use crate::api::validate::{ImageIdText, JoinTokenIdText, NameText, NodeIdText, PoolIdText, TenantIdText, WorkflowIdText};

/// How the control plane reaches a machine's BMC.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BmcView {
    pub address: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_path: Option<String>,
    pub username: String,
    /// `ca` (checked against the enrolled CA bundle), `pin` (the leaf's public key), or
    /// `insecure` (not checked at all).
    pub tls: String,
    /// True when the BMC's certificate is not checked: anyone on the path can read its password.
    pub insecure: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin: Option<String>,
}

/// A machine.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    /// The node its installed system's agent joins as.
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    /// The site it is at (`sites.*`): the one it was enrolled at, or its pool's.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<crate::api::validate::SiteIdText>")]
    pub site_id: Option<String>,
    pub state: MetalState,
    /// Whether a workflow is running in this state (`false`: it rests until a caller acts).
    pub stable: bool,
    /// The caller's verbs this state takes now.
    pub allowed: Vec<String>,
    pub retired: bool,
    /// Why the machine is in maintenance; only `recover`, `abort` and `power` are taken then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<String>,
    /// The last failure's reason, until a workflow succeeds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// `on` / `off`, as last read from the BMC.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
    pub bmc: BmcView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inspection: Option<MetalInspection>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ImageIdText>")]
    pub image_id: Option<String>,
    pub state_entered_at_ms: u64,
    /// The running workflow, or the last one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workflow: Option<WorkflowView>,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl From<MetalDoc> for MetalView {
    fn from(doc: MetalDoc) -> Self {
        let allowed = if doc.running().is_some() {
            let abort = doc.state.is_stable() || allowed(doc.state, &doc.flags).contains(&bc_projections::metal::Verb::Abort);
            if abort { vec!["abort".to_owned()] } else { vec![] }
        } else {
            allowed(doc.state, &doc.flags).iter().map(|v| v.as_str().to_owned()).collect()
        };
        MetalView {
            tenant_id: doc.tenant_id,
            node_id: doc.node_id,
            pool_id: doc.pool_id,
            name: doc.name,
            site_id: doc.site_id,
            state: doc.state,
            stable: doc.state.is_stable(),
            allowed,
            retired: doc.flags.retired,
            maintenance: doc.flags.maintenance,
            last_error: doc.last_error,
            power: doc.power,
            bmc: BmcView {
                address: doc.bmc.address,
                system_path: doc.bmc.system_path,
                username: doc.bmc.username,
                insecure: doc.bmc.tls == "insecure",
                tls: doc.bmc.tls,
                pin: doc.bmc.pin,
            },
            inspection: doc.inspection,
            image_id: doc.image_id,
            state_entered_at_ms: doc.state_entered_at_ms,
            workflow: doc.workflow.map(WorkflowView::from),
            version: doc.version,
            created_at_ms: doc.created_at_ms,
            updated_at_ms: doc.updated_at_ms,
        }
    }
}

/// One step of a workflow and where it is.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowStepView {
    pub name: String,
    /// `done`, `running`, `pending` (not reached), or `failed` (where the workflow failed).
    pub state: String,
}

/// A workflow.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkflowView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "WorkflowIdText")]
    pub workflow_id: String,
    #[schemars(with = "NodeIdText")]
    pub node_id: String,
    /// The verb it runs.
    pub verb: String,
    pub outcome: WorkflowOutcome,
    pub steps: Vec<WorkflowStepView>,
    /// Failed attempts of the current step.
    pub attempts: u32,
    /// The current step runs again at this time (after a failure's back-off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_at_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub paused: bool,
    pub started_at_ms: u64,
    /// When it fails if not done (paused or not).
    pub deadline_at_ms: u64,
    /// Why it failed or was aborted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ImageIdText>")]
    pub image_id: Option<String>,
    /// A deploy's join token (its id; the token itself was shown once by `metal.deploy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<JoinTokenIdText>")]
    pub join_token_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub power: Option<String>,
    pub updated_at_ms: u64,
}

impl From<Workflow> for WorkflowView {
    fn from(w: Workflow) -> Self {
        let at = w.step_index as usize;
        let steps = w
            .steps
            .iter()
            .enumerate()
            .map(|(i, name)| WorkflowStepView {
                name: name.clone(),
                state: match (i.cmp(&at), w.outcome) {
                    (std::cmp::Ordering::Less, _) => "done",
                    (std::cmp::Ordering::Equal, WorkflowOutcome::Running) => "running",
                    (std::cmp::Ordering::Equal, WorkflowOutcome::Failed | WorkflowOutcome::Aborted) => "failed",
                    _ => "pending",
                }
                .to_owned(),
            })
            .collect();
        WorkflowView {
            tenant_id: w.tenant_id,
            workflow_id: w.workflow_id,
            node_id: w.node_id,
            verb: w.verb,
            outcome: w.outcome,
            steps,
            attempts: w.attempts,
            retry_at_ms: (w.retry_at_ms > 0 && w.outcome == WorkflowOutcome::Running).then_some(w.retry_at_ms),
            last_error: w.last_error,
            paused: w.paused,
            started_at_ms: w.started_at_ms,
            deadline_at_ms: w.deadline_at_ms,
            reason: w.reason,
            finished_at_ms: w.finished_at_ms,
            image_id: w.image_id,
            join_token_id: w.join_token_id,
            power: w.power,
            updated_at_ms: w.updated_at_ms,
        }
    }
}
