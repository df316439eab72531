//! `approvers.*` and `commandBatches.*`: the approver set, a batch, a page of its scope, its
//! members.

use bc_projections::batch::{ApproverKey, ApproverSetDoc, BatchState, CommandBatchDoc, Leaf};
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::Value;

/// The deployment's approver set.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApproverSetView {
    pub epoch: u64,
    /// K: approvals a batch needs.
    pub quorum: u64,
    /// What every approval and approver-set signature names.
    pub trust_domain: String,
    pub keys: Vec<ApproverKey>,
    /// The keys of the previous epoch whose signatures published it (none at epoch 1).
    pub signed_by: Vec<String>,
    pub published_by: String,
    pub published_at_ms: u64,
    /// What a node pins as `command_root_sha256` in its `config.toml`: SHA-256 of the epoch-1
    /// set's message (`docs/batches.md`), the same at every epoch.
    pub command_root_sha256: String,
}

impl From<ApproverSetDoc> for ApproverSetView {
    fn from(d: ApproverSetDoc) -> Self {
        Self {
            epoch: d.epoch,
            quorum: d.quorum,
            trust_domain: d.trust_domain,
            keys: d.keys,
            signed_by: d.signed_by,
            published_by: d.published_by,
            published_at_ms: d.published_at_ms,
            command_root_sha256: d.command_root_sha256,
        }
    }
}

/// One approval a batch holds.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchApprovalView {
    pub kid: String,
    /// ECDSA P-256 / SHA-256, DER, base64, over the approval message (`docs/batches.md`).
    pub signature: String,
    pub epoch: u64,
    pub at_ms: u64,
}

/// A batch, without its scope (`commandBatches.show` pages it).
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CommandBatchView {
    pub tenant_id: String,
    pub batch_id: String,
    /// What the approvers read.
    pub reason: String,
    pub state: BatchState,
    /// The RFC 6962 root of the leaves, hex; what approvers sign with `size`, `expiresAtMs`,
    /// `trustDomain` and the batch id.
    pub root: String,
    pub size: u64,
    pub expires_at_ms: u64,
    pub trust_domain: String,
    /// The approver set's epoch the batch is approved under.
    pub epoch: u64,
    /// Approvals needed.
    pub quorum: u64,
    pub approvals: Vec<BatchApprovalView>,
    /// Who made it.
    pub proposed_by: String,
    pub created_at_ms: u64,
    pub ended_at_ms: Option<u64>,
    pub end_reason: Option<String>,
    pub version: u64,
    /// `commandBatches.create` only, once (absent on a replay): the one-use join token of each
    /// `metal.deploy` leaf, by machine, for its installed system's `bcd join --node-id`. It
    /// joins only once the batch is released and the deploy started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_tokens: Option<std::collections::BTreeMap<String, String>>,
}

impl From<&CommandBatchDoc> for CommandBatchView {
    fn from(d: &CommandBatchDoc) -> Self {
        Self {
            tenant_id: d.tenant_id.clone(),
            batch_id: d.batch_id.clone(),
            reason: d.reason.clone(),
            state: d.state,
            root: d.root.clone(),
            size: d.size,
            expires_at_ms: d.expires_at_ms,
            trust_domain: d.trust_domain.clone(),
            epoch: d.epoch,
            quorum: d.quorum,
            approvals: d
                .approvals
                .iter()
                .map(|a| BatchApprovalView { kid: a.kid.clone(), signature: a.signature.clone(), epoch: a.epoch, at_ms: a.at_ms })
                .collect(),
            proposed_by: d.created_by.clone(),
            created_at_ms: d.created_at_ms,
            ended_at_ms: d.ended_at_ms,
            end_reason: d.end_reason.clone(),
            version: d.version,
            join_tokens: None,
        }
    }
}

impl From<CommandBatchDoc> for CommandBatchView {
    fn from(d: CommandBatchDoc) -> Self {
        Self::from(&d)
    }
}

/// One leaf of a batch's scope, with its place.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeafView {
    pub index: u64,
    pub subject: String,
    pub kind: String,
    pub payload: Value,
}

impl LeafView {
    pub fn new(index: usize, leaf: &Leaf) -> Self {
        Self { index: index as u64, subject: leaf.subject.clone(), kind: leaf.kind.clone(), payload: leaf.payload.clone() }
    }
}

/// A batch and one page of its scope: the leaves from `offset`; `nextOffset` is where the next
/// page starts (absent after the last).
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CommandBatchScopeView {
    pub batch: CommandBatchView,
    pub offset: u64,
    pub leaves: Vec<LeafView>,
    pub next_offset: Option<u64>,
}

/// One command of a batch and its state: `awaitingApproval` while the batch is pending (held),
/// `cancelled` when it was cancelled or expired, `releasing` once released until its chunk is
/// issued, then the command's own (`issued`, `started`, `succeeded`, `failed`); a metal leaf's
/// is its workflow's (`running`, `succeeded`, `failed`, `aborted`; `succeeded` for a verb that
/// runs none, `retire`), or `failed` with the reason its machine refused the verb at the release.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchMemberView {
    pub index: u64,
    pub subject: String,
    pub kind: String,
    /// The command's `cmd_…` id; a metal leaf's `wf_…`, the workflow its release starts.
    pub command_id: String,
    pub state: String,
    pub reason: Option<String>,
}

/// A batch's commands, in leaf order.
#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BatchMembersView {
    pub batch_id: String,
    pub state: BatchState,
    pub items: Vec<BatchMemberView>,
}
