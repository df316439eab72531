//! `approvers.*` and `commandBatches.*`: destructive batches under a quorum (`docs/batches.md`).
//!
//! The approver set lives on the root tenant's chain (`approver_set/deployment`); the root admin
//! publishes epoch 1, and each later epoch carries the signatures of the current set's quorum.
//! A batch's commands get their ids when it is made and are issued, in the transaction of the
//! approval that reaches the quorum, only then; the node's session delivers them as any other
//! command. Each decision is in `bc_projections::decide::batch`.

use bc_core::id::{
    CommandBatchId, CommandId, ImageId, JoinTokenId, NodeId, ReleaseId, ReservationId, RolloutId, TenantId, WorkflowId,
};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_core::{Error, Result};
use bc_projections::batch::{
    APPROVER_SET_ID, ApproverKey, ApproverSetDoc, ApproverSignature, BatchState, COMMAND_BATCH_CHUNK_LEAVES,
    COMMAND_BATCH_HOURS_MAX, COMMAND_BATCH_LEAVES_MAX, COMMAND_BATCH_REASON_BYTES_MAX, CommandBatchDoc, KIND_APPROVER_SET,
    KIND_COMMAND_BATCH, Leaf, approver_set_history, chunk_requests, node_without_room,
};
use bc_projections::decide::batch::{
    ApproverSetInput, BatchCreateInput, LEAF_METAL_DEPLOY, LEAF_NODE_DELETE, LEAF_RESERVATION_RELEASE, LEAF_ROLLOUT_CREATE,
    applied_at_release, approver_set_publish, batch_approve, batch_cancel, batch_create, batch_expired, metal_leaf_verb,
    release_chunk, split_scope,
};
use bc_projections::events as ev;
use bc_projections::rollout::{BusyNodes, KIND_ROLLOUT, ROLLOUT_NODES_MAX, ROLLOUT_WAVES_MAX, RolloutDoc};
use bc_projections::workflow::{KIND_METAL, KIND_WORKFLOW, MetalDoc, Workflow};
use bc_projections::{
    CommandDoc, ImageDoc, KIND_COMMAND, KIND_IMAGE, KIND_NODE, KIND_RESERVATION, NodeDoc, ReservationDoc, stream_of,
};
use schemars::{JsonSchema, json_schema};
use serde::Deserialize;

use super::body::parse_id;
use super::call::doc;
use super::commands::{COMMAND_DEADLINE_S_DEFAULT, COMMAND_DEADLINE_S_MAX};
use super::paging::{Page, list_rows};
use super::rollouts::{WAVE_PATTERN, WAVE_SPEC_CHARS_MAX};
use super::validate::{
    CommandBatchIdText, CursorText, ImageIdText, LabelsMap, LimitNumber, NodeIdText, PoolIdText, ReleaseIdText,
    ReservationIdText, TenantIdText, string_schema,
};
use super::views::{ApproverSetView, BatchMemberView, BatchMembersView, CommandBatchScopeView, CommandBatchView, LeafView};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:batches:read");
const CREATE: Access = Access::Action("compute:batches:create");
const APPROVE: Access = Access::Action("compute:batches:approve");
const ADMIN: Access = Access::Action("compute:approvers:admin");

/// Chunks the approval that releases a batch issues itself, at most (2,000 commands): the rest
/// are the `batches` reconciler's, so the call stays well inside the request timeout.
pub const RELEASE_CHUNKS_INLINE_MAX: u64 = 10;
/// Leaves one `commandBatches.show` page holds at most.
pub const SCOPE_PAGE_MAX: u64 = 256;
/// A scope page's size unless asked.
pub const SCOPE_PAGE_DEFAULT: u64 = 100;

pub(super) const METHODS: &[Method] = &[
    method!("approvers.publish", ADMIN, "publish the deployment's approver set at its next epoch", ApproversPublish => ApproverSetView, approvers_publish),
    method!("approvers.get", Access::Authenticated, "the deployment's current approver set", ApproversGet => ApproverSetView, approvers_get),
    method!("commandBatches.create", CREATE, "hold commands in a batch until a quorum of approvers signs its scope", BatchesCreate => CommandBatchView, batches_create),
    method!("commandBatches.list", READ, "a tenant's batches, paged by cursor", BatchesList => Page<CommandBatchView>, batches_list),
    method!("commandBatches.show", READ, "a batch and one page of its scope", BatchesShow => CommandBatchScopeView, batches_show),
    method!("commandBatches.members", READ, "a batch's commands and their states", BatchRef => BatchMembersView, batches_members),
    method!("commandBatches.approve", APPROVE, "one approver's signature; the quorum releases the batch's commands", BatchesApprove => CommandBatchView, batches_approve),
    method!("commandBatches.cancel", APPROVE, "end a pending batch; its commands are never issued", BatchRef => CommandBatchView, batches_cancel),
];

string_schema!(/// `ak_` and 16 hex digits.
    KidText, json_schema!({ "type": "string", "pattern": "^ak_[0-9a-f]{16}$" }));
string_schema!(/// ECDSA P-256 / SHA-256, ASN.1 DER, base64 (standard, padded).
    SignatureText, json_schema!({ "type": "string", "pattern": "^[A-Za-z0-9+/]{8,124}={0,2}$" }));
string_schema!(/// 1 to 253 bytes of a-z, 0-9, '.' and '-'.
    TrustDomainText, json_schema!({ "type": "string", "pattern": "^[a-z0-9.-]{1,253}$" }));
string_schema!(/// What approvers read: 1 to 500 bytes.
    BatchReasonText, json_schema!({ "type": "string", "minLength": 1, "maxLength": COMMAND_BATCH_REASON_BYTES_MAX, "pattern": "\\S" }));
string_schema!(/// `pending`, `released`, `cancelled`, `expired`.
    BatchStateText, json_schema!({ "type": "string", "enum": ["pending", "released", "cancelled", "expired"] }));

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproverKeyInput {
    #[schemars(with = "KidText")]
    kid: String,
    /// The P-256 SubjectPublicKeyInfo, DER, base64 (`batch keygen` writes it to PATH.pub).
    #[schemars(length(min = 1, max = bc_projections::batch::PUBLIC_KEY_B64_BYTES_MAX))]
    public_key: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproverSignatureInput {
    #[schemars(with = "KidText")]
    kid: String,
    #[schemars(with = "SignatureText")]
    signature: String,
}

/// The set at `epoch`: 1 for the first (the root admin's, no signatures), else one above the
/// published set's, with the signatures of its quorum (`batch sign-approvers`).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproversPublish {
    #[schemars(range(min = 1, max = u32::MAX))]
    epoch: u64,
    #[schemars(range(min = 1, max = bc_projections::batch::APPROVERS_MAX))]
    quorum: u64,
    #[schemars(with = "TrustDomainText")]
    trust_domain: String,
    #[schemars(length(min = 1, max = bc_projections::batch::APPROVERS_MAX))]
    keys: Vec<ApproverKeyInput>,
    #[serde(default)]
    #[schemars(length(max = bc_projections::batch::APPROVERS_MAX))]
    signatures: Vec<ApproverSignatureInput>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproversGet {}

/// A leaf's arguments: `{}` for `ping`, `metal.undeploy`, `metal.retire`, `metal.powerOff`,
/// `nodes.delete` and `reservations.release`; `{imageId}` for `metal.deploy` (the gateway adds
/// the `joinTokenId` it mints for it, so the leaf binds that token too); `rollouts.create`'s
/// arguments for `rollouts.create` (the gateway fills in the defaults and adds `nodes`, the ids
/// of the nodes they choose now, so the leaf binds those nodes too).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeafPayload {
    /// `metal.deploy`: the registered ISO the machine boots.
    #[serde(default)]
    #[schemars(with = "Option<ImageIdText>")]
    image_id: Option<String>,
    /// `rollouts.create`: the pool whose nodes (with an agent) take the release; with
    /// `labels`, only those carrying every label. At least one of the two.
    #[serde(default)]
    #[schemars(with = "Option<PoolIdText>")]
    pool_id: Option<String>,
    #[serde(default)]
    #[schemars(with = "Option<LabelsMap>")]
    labels: Option<std::collections::BTreeMap<String, String>>,
    /// `rollouts.create`: cumulative waves, as `rollouts.create` takes them (default `["1", "100%"]`).
    #[serde(default)]
    #[schemars(length(min = 1, max = ROLLOUT_WAVES_MAX), inner(length(min = 1, max = WAVE_SPEC_CHARS_MAX), regex(pattern = WAVE_PATTERN)))]
    waves: Option<Vec<String>>,
    #[serde(default)]
    #[schemars(range(min = 1, max = ROLLOUT_NODES_MAX))]
    max_unavailable: Option<u32>,
    #[serde(default)]
    #[schemars(range(max = bc_projections::rollout::MIN_READY_S_MAX))]
    min_ready_s: Option<u64>,
    #[serde(default)]
    #[schemars(range(min = bc_projections::rollout::NODE_DEADLINE_S_MIN, max = bc_projections::rollout::NODE_DEADLINE_S_MAX))]
    node_deadline_s: Option<u64>,
    #[serde(default)]
    #[schemars(range(max = ROLLOUT_NODES_MAX))]
    wave_failures_max: Option<u32>,
    #[serde(default)]
    busy_nodes: Option<BusyNodes>,
}

impl LeafPayload {
    /// Whether any of `rollouts.create`'s arguments is given.
    fn has_rollout(&self) -> bool {
        self.pool_id.is_some()
            || self.labels.is_some()
            || self.waves.is_some()
            || self.max_unavailable.is_some()
            || self.min_ready_s.is_some()
            || self.node_deadline_s.is_some()
            || self.wave_failures_max.is_some()
            || self.busy_nodes.is_some()
    }
}

/// One operation: a command of `kind` to the node `subject` (a `metal.*` kind: to the machine
/// `subject`; `nodes.delete`: that node's deletion; `reservations.release`: the reservation
/// `subject`'s release; `rollouts.create`: a rollout of the release `subject`), with exactly
/// `payload`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeafInput {
    subject: String,
    kind: String,
    payload: LeafPayload,
}

/// The payload fields, each of which a leaf kind that does not take it may give only as `null`.
const LEAF_PAYLOAD_FIELDS: [&str; 9] =
    ["imageId", "poolId", "labels", "waves", "maxUnavailable", "minReadyS", "nodeDeadlineS", "waveFailuresMax", "busyNodes"];

/// A leaf, documented as the server takes it: one schema per group of kinds, each naming the
/// subject's kind of id and the payload that kind takes (`{}`, or its fields as `null`, for the
/// kinds without arguments; `{imageId}` for `metal.deploy`; `rollouts.create`'s arguments for
/// `rollouts.create`), so a leaf whose subject or payload is not its kind's is invalid by the
/// document as it is refused by the server.
impl JsonSchema for LeafInput {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "LeafInput".into()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        use bc_projections::decide::batch::{LEAF_METAL_POWER_OFF, LEAF_METAL_RETIRE, LEAF_METAL_UNDEPLOY};
        let nulls = |except: &[&str]| {
            let fields: serde_json::Map<String, serde_json::Value> = LEAF_PAYLOAD_FIELDS
                .iter()
                .filter(|f| !except.contains(f))
                .map(|f| ((*f).to_owned(), serde_json::json!({ "type": "null" })))
                .collect();
            fields
        };
        let leaf = |kinds: &[&str], subject: schemars::Schema, payload: serde_json::Value| {
            serde_json::json!({
                "type": "object",
                "additionalProperties": false,
                "required": ["subject", "kind", "payload"],
                "properties": { "subject": subject, "kind": { "type": "string", "enum": kinds }, "payload": payload },
            })
        };
        let no_arguments = serde_json::json!({ "type": "object", "additionalProperties": false, "properties": nulls(&[]) });
        let mut deploy_fields = nulls(&["imageId"]);
        deploy_fields.insert("imageId".into(), g.subschema_for::<ImageIdText>().to_value());
        let deploy = serde_json::json!({
            "type": "object", "additionalProperties": false, "required": ["imageId"], "properties": deploy_fields,
        });
        let rollout = serde_json::json!({
            "allOf": [g.subschema_for::<LeafPayload>(), { "properties": { "imageId": { "type": "null" } } }],
        });
        let node = g.subschema_for::<NodeIdText>();
        json_schema!({
            "description": "One operation: a command of `kind` to the node `subject` (a `metal.*` kind: to the machine `subject`; `nodes.delete`: that node's deletion; `reservations.release`: the reservation `subject`'s release; `rollouts.create`: a rollout of the release `subject`), with exactly `payload`.",
            "oneOf": [
                leaf(&["ping", LEAF_METAL_UNDEPLOY, LEAF_METAL_RETIRE, LEAF_METAL_POWER_OFF, LEAF_NODE_DELETE], node.clone(), no_arguments.clone()),
                leaf(&[LEAF_METAL_DEPLOY], node, deploy),
                leaf(&[LEAF_RESERVATION_RELEASE], g.subschema_for::<ReservationIdText>(), no_arguments),
                leaf(&[LEAF_ROLLOUT_CREATE], g.subschema_for::<ReleaseIdText>(), rollout),
            ]
        })
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchesCreate {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "BatchReasonText")]
    reason: String,
    #[schemars(length(min = 1, max = COMMAND_BATCH_LEAVES_MAX))]
    leaves: Vec<LeafInput>,
    /// Hours the batch stays open for approvals (default 24, at most 72).
    #[schemars(range(min = 1, max = COMMAND_BATCH_HOURS_MAX))]
    hours: Option<u64>,
    /// Seconds each command has to run once released (default 300).
    #[schemars(range(min = 1, max = COMMAND_DEADLINE_S_MAX))]
    deadline_s: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchesList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "Option<BatchStateText>")]
    state: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchesShow {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "CommandBatchIdText")]
    batch_id: String,
    /// The first leaf of the page (default 0).
    #[schemars(range(min = 0, max = COMMAND_BATCH_LEAVES_MAX))]
    offset: Option<u64>,
    /// Leaves in the page (default 100, at most 256).
    #[schemars(range(min = 1, max = SCOPE_PAGE_MAX))]
    limit: Option<u64>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "CommandBatchIdText")]
    batch_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchesApprove {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "CommandBatchIdText")]
    batch_id: String,
    #[schemars(with = "KidText")]
    kid: String,
    #[schemars(with = "SignatureText")]
    signature: String,
}

fn check_kid(kid: &str) -> Result<()> {
    let ok =
        kid.len() == 19 && kid.starts_with("ak_") && kid[3..].bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok { Ok(()) } else { Err(Error::invalid("kid must be ak_ and 16 lowercase hex digits")) }
}

fn check_signature(signature: &str) -> Result<()> {
    let body = signature.trim_end_matches('=');
    let ok = (8..=124).contains(&body.len())
        && signature.len() - body.len() <= 2
        && body.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/');
    if ok { Ok(()) } else { Err(Error::invalid("signature must be base64 (standard alphabet), 8 to 126 characters")) }
}

/// The current approver set, if one is published.
pub(crate) async fn approver_set(call: &Call<'_>) -> Result<Option<ApproverSetDoc>> {
    call.state.store.row_get(&TenantId::ROOT.to_string(), KIND_APPROVER_SET, APPROVER_SET_ID).await?.map(doc).transpose()
}

/// The test-only switch of a gateway that lies: set (to anything) in a debug build, the first
/// approval of a batch releases it whatever the quorum, so the end-to-end test can show that a
/// node that pins the approver set's root refuses the release. A release build ignores it.
pub const FORGE_RELEASE_ENV: &str = "BC_TEST_ONLY_FORGE_BATCH_RELEASE";

fn forge_release() -> bool {
    cfg!(debug_assertions) && std::env::var_os(FORGE_RELEASE_ENV).is_some()
}

/// The test-only length of a batch window's hour, in milliseconds: set in a debug build, a batch
/// of `hours` stays open `hours` times this, so the end-to-end test sees windows close. A release
/// build ignores it.
pub const HOUR_MS_ENV: &str = "BC_TEST_ONLY_BATCH_HOUR_MS";

fn test_hour_ms() -> Option<u64> {
    cfg!(debug_assertions).then(|| std::env::var(HOUR_MS_ENV).ok()?.parse().ok()).flatten()
}

async fn approvers_publish(call: &Call<'_>, input: ApproversPublish) -> Result<ApproverSetView> {
    if !call.principal().is_root() {
        return Err(Error::AccessDenied("the approver set is the root tenant's: publish it with a root key".into()));
    }
    let tenant = call.tenant(&None).await?;
    if !bc_projections::decide::batch::is_trust_domain(&input.trust_domain) {
        return Err(Error::invalid("trustDomain must be 1 to 253 bytes of a-z, 0-9, '.' and '-'"));
    }
    for key in &input.keys {
        check_kid(&key.kid)?;
    }
    for signature in &input.signatures {
        check_kid(&signature.kid)?;
        check_signature(&signature.signature)?;
    }
    let current = approver_set(call).await?;
    let published = approver_set_publish(
        current.as_ref(),
        ApproverSetInput {
            epoch: input.epoch,
            quorum: input.quorum,
            trust_domain: input.trust_domain,
            keys: input.keys.into_iter().map(|k| ApproverKey { kid: k.kid, public_key: k.public_key }).collect(),
            signatures: input.signatures.into_iter().map(|s| ApproverSignature { kid: s.kid, signature: s.signature }).collect(),
        },
    )?;
    let expected = current.as_ref().map_or(ExpectedVersion::NoStream, |c| ExpectedVersion::Exact(c.version));
    call.append(
        tenant,
        stream_of(KIND_APPROVER_SET, &APPROVER_SET_ID),
        expected,
        ev::APPROVER_SET_PUBLISHED,
        ev::to_cbor(&published)?,
    )
    .await?;
    Ok(call.row::<ApproverSetDoc>(tenant, KIND_APPROVER_SET, APPROVER_SET_ID, "approver set").await?.into())
}

async fn approvers_get(call: &Call<'_>, _input: ApproversGet) -> Result<ApproverSetView> {
    Ok(approver_set(call)
        .await?
        .ok_or_else(|| {
            Error::not_found("approver set (none is published: the root admin publishes epoch 1 with approvers.publish)")
        })?
        .into())
}

async fn batch_doc(call: &Call<'_>, tenant: TenantId, id: &str) -> Result<CommandBatchDoc> {
    let id: CommandBatchId = parse_id("batchId", id)?;
    call.row(tenant, KIND_COMMAND_BATCH, &id.to_string(), "batch").await
}

async fn batches_create(call: &Call<'_>, input: BatchesCreate) -> Result<CommandBatchView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let hours = input.hours.unwrap_or(24);
    let deadline_s = input.deadline_s.unwrap_or(COMMAND_DEADLINE_S_DEFAULT);
    if !(1..=COMMAND_DEADLINE_S_MAX).contains(&deadline_s) {
        return Err(Error::invalid(format!("deadlineS must be 1 to {COMMAND_DEADLINE_S_MAX} seconds")));
    }
    if input.reason.len() > COMMAND_BATCH_REASON_BYTES_MAX || input.reason.trim().is_empty() {
        return Err(Error::invalid(format!("reason must be 1 to {COMMAND_BATCH_REASON_BYTES_MAX} bytes, not only spaces")));
    }
    if input.leaves.is_empty() || input.leaves.len() > COMMAND_BATCH_LEAVES_MAX {
        return Err(Error::invalid(format!("a batch holds 1 to {COMMAND_BATCH_LEAVES_MAX} leaves")));
    }
    let mut leaves = Vec::with_capacity(input.leaves.len());
    let mut command_ids = Vec::with_capacity(input.leaves.len());
    // Each metal.deploy leaf's join token: its machine, id, the token and its secret's hash.
    let mut tokens: Vec<(String, String, String, String)> = Vec::new();
    for (i, leaf) in input.leaves.into_iter().enumerate() {
        let subject_field = format!("leaves[{i}].subject");
        let kind = leaf.kind.as_str();
        if kind != LEAF_ROLLOUT_CREATE && leaf.payload.has_rollout() {
            return Err(Error::invalid(format!("leaves[{i}]: only a rollouts.create takes a rollout's arguments")));
        }
        if kind != LEAF_METAL_DEPLOY && leaf.payload.image_id.is_some() {
            return Err(Error::invalid(format!("leaves[{i}]: a {kind} takes no imageId")));
        }
        // The subject, of its kind and of the tenant, and the exact payload; the operation
        // itself is decided when the batch is released.
        let (subject, payload, command_id) = match kind {
            LEAF_NODE_DELETE => {
                let node_id: NodeId = parse_id(&subject_field, &leaf.subject)?;
                let _: NodeDoc = call.row(tenant, KIND_NODE, &node_id.to_string(), "node").await?;
                (node_id.to_string(), serde_json::json!({}), CommandId::from_ulid(call.ulid()).to_string())
            }
            LEAF_RESERVATION_RELEASE => {
                let rsv: ReservationId = parse_id(&subject_field, &leaf.subject)?;
                let _: ReservationDoc = call.row(tenant, KIND_RESERVATION, &rsv.to_string(), "reservation").await?;
                // The command its release sends the reservation's node, if it is active then.
                (rsv.to_string(), serde_json::json!({}), CommandId::from_ulid(call.ulid()).to_string())
            }
            LEAF_ROLLOUT_CREATE => {
                let release: ReleaseId = parse_id(&subject_field, &leaf.subject)?;
                let rollout = RolloutId::from_ulid(call.ulid()).to_string();
                let p = leaf.payload;
                let asked = super::rollouts::RolloutsCreate {
                    tenant_id: Some(tenant.to_string()),
                    release_id: release.to_string(),
                    pool_id: p.pool_id,
                    labels: p.labels,
                    waves: p.waves,
                    max_unavailable: p.max_unavailable,
                    min_ready_s: p.min_ready_s,
                    node_deadline_s: p.node_deadline_s,
                    wave_failures_max: p.wave_failures_max,
                    busy_nodes: p.busy_nodes,
                };
                let payload = super::rollouts::rollout_leaf(call, &rollout, asked).await?;
                (release.to_string(), payload, rollout)
            }
            _ => {
                let node_id: NodeId = parse_id(&subject_field, &leaf.subject)?;
                let metal = metal_leaf_verb(kind).is_some();
                if metal {
                    // A machine of the tenant; its verb is decided when the batch is released.
                    let _: MetalDoc = call.row(tenant, KIND_METAL, &node_id.to_string(), "machine").await?;
                } else {
                    let node: NodeDoc = call.row(tenant, KIND_NODE, &node_id.to_string(), "node").await?;
                    if node.agent.is_none() {
                        return Err(Error::InvalidArgument {
                            message: format!("leaves[{i}]: node {node_id} has no agent: it was registered by hand"),
                            hint: Some("commands go to nodes that joined with bcd join".into()),
                        });
                    }
                }
                let payload = match (kind, leaf.payload.image_id) {
                    (LEAF_METAL_DEPLOY, Some(image)) => {
                        let image: ImageId = parse_id(&format!("leaves[{i}].payload.imageId"), &image)?;
                        let doc: ImageDoc = call.row(tenant, KIND_IMAGE, &image.to_string(), "image").await?;
                        if doc.disk_format != ev::DiskFormat::Iso {
                            return Err(Error::InvalidArgument {
                                message: format!("leaves[{i}]: image {image} is not an ISO: a BMC's virtual CD boots it"),
                                hint: Some("register the image with --disk-format iso".into()),
                            });
                        }
                        let token_id = JoinTokenId::from_ulid(call.ulid());
                        let (token, secret_sha256) = bc_core::agent::join_token_new(token_id);
                        tokens.push((node_id.to_string(), token_id.to_string(), token, secret_sha256));
                        serde_json::json!({ "imageId": image.to_string(), "joinTokenId": token_id.to_string() })
                    }
                    (LEAF_METAL_DEPLOY, None) => {
                        return Err(Error::invalid(format!("leaves[{i}]: a metal.deploy names its image: payload {{imageId}}")));
                    }
                    _ => serde_json::json!({}),
                };
                let command_id = if metal {
                    WorkflowId::from_ulid(call.ulid()).to_string()
                } else {
                    CommandId::from_ulid(call.ulid()).to_string()
                };
                (node_id.to_string(), payload, command_id)
            }
        };
        leaves.push(Leaf { subject, kind: leaf.kind, payload });
        command_ids.push(command_id);
    }
    let set = approver_set(call).await?;
    let mut created = batch_create(
        set.as_ref(),
        BatchCreateInput { reason: input.reason, leaves, hours, deadline_s, command_ids },
        call.now_ms(),
    )?;
    if let Some(hour_ms) = test_hour_ms() {
        created.expires_at_ms = call.now_ms().saturating_add(hours.saturating_mul(hour_ms));
    }
    let batch = CommandBatchId::from_ulid(call.ulid());
    // The leaves go in chunks: the creation event carries the first, then one `scope_added`
    // each, in one append.
    let (created, added) = split_scope(created);
    let mut events = vec![NewEvent::new(ev::COMMAND_BATCH_CREATED, ev::to_cbor(&created)?)];
    for chunk in &added {
        events.push(NewEvent::new(ev::COMMAND_BATCH_SCOPE_ADDED, ev::to_cbor(chunk)?));
    }
    let stream = stream_of(KIND_COMMAND_BATCH, &batch);
    let result = call.submit(call.request(tenant, stream, ExpectedVersion::NoStream, events)).await?;
    let stream = &result.events[0].envelope.stream;
    let mut view: CommandBatchView =
        call.row::<CommandBatchDoc>(tenant, KIND_COMMAND_BATCH, super::call::stream_id(stream), "batch").await?.into();
    if !result.replayed && !tokens.is_empty() {
        // The tokens' hashes once the batch is in the log (as metal.deploy stores its token's):
        // a token joins only once its deploy's release appended the token itself.
        let mut answered = std::collections::BTreeMap::new();
        for (node, token_id, token, secret_sha256) in tokens {
            call.state.store.secret_put(tenant, &token_id, &secret_sha256, call.now_ms()).await?;
            answered.insert(node, token);
        }
        view.join_tokens = Some(answered);
    }
    Ok(view)
}

async fn batches_list(call: &Call<'_>, input: BatchesList) -> Result<Page<CommandBatchView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let state: Option<BatchState> = input.state.as_deref().map(str::parse).transpose()?;
    list_rows(call, tenant, KIND_COMMAND_BATCH, input.limit, input.cursor.as_deref(), |row| {
        let batch: CommandBatchDoc = doc(row)?;
        Ok(state.is_none_or(|s| s == batch.state).then(|| CommandBatchView::from(&batch)))
    })
    .await
}

async fn batches_show(call: &Call<'_>, input: BatchesShow) -> Result<CommandBatchScopeView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let batch = batch_doc(call, tenant, &input.batch_id).await?;
    let offset = input.offset.unwrap_or(0);
    let limit = input.limit.unwrap_or(SCOPE_PAGE_DEFAULT);
    if offset > COMMAND_BATCH_LEAVES_MAX as u64 || !(1..=SCOPE_PAGE_MAX).contains(&limit) {
        return Err(Error::invalid(format!("offset is 0 to {COMMAND_BATCH_LEAVES_MAX} and limit 1 to {SCOPE_PAGE_MAX}")));
    }
    let start = (offset as usize).min(batch.leaves.len());
    let end = start.saturating_add(limit as usize).min(batch.leaves.len());
    let leaves = batch.leaves[start..end].iter().enumerate().map(|(i, leaf)| LeafView::new(start + i, leaf)).collect();
    let next_offset = (end < batch.leaves.len()).then_some(end as u64);
    Ok(CommandBatchScopeView { batch: CommandBatchView::from(&batch), offset: start as u64, leaves, next_offset })
}

async fn batches_members(call: &Call<'_>, input: BatchRef) -> Result<BatchMembersView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let batch = batch_doc(call, tenant, &input.batch_id).await?;
    let mut items = Vec::with_capacity(batch.leaves.len());
    for (index, (leaf, command_id)) in batch.leaves.iter().zip(&batch.command_ids).enumerate() {
        let (state, reason) = match batch.state {
            BatchState::Pending => ("awaitingApproval".to_owned(), None),
            BatchState::Cancelled | BatchState::Expired => ("cancelled".to_owned(), batch.end_reason.clone()),
            BatchState::Released if (index / COMMAND_BATCH_CHUNK_LEAVES) as u64 >= batch.chunks_issued => {
                ("releasing".to_owned(), None)
            }
            BatchState::Released if applied_at_release(&leaf.kind) => {
                if let Some(refused) = batch.refused.iter().find(|r| r.index == index as u64) {
                    ("failed".to_owned(), Some(refused.reason.clone()))
                } else if leaf.kind == LEAF_ROLLOUT_CREATE {
                    // The rollout's own state: running, paused, aborting, aborted, done.
                    match call.state.store.row_get(&tenant.to_string(), KIND_ROLLOUT, command_id).await? {
                        Some(row) => {
                            let rollout: RolloutDoc = doc(row)?;
                            (rollout.state.as_str().to_owned(), rollout.reason)
                        }
                        None => ("releasing".to_owned(), None),
                    }
                } else if leaf.kind == LEAF_NODE_DELETE || leaf.kind == LEAF_RESERVATION_RELEASE {
                    // Appended with its chunk: the node is gone, the reservation released (or
                    // it was over already).
                    ("succeeded".to_owned(), None)
                } else {
                    match call.state.store.row_get(&tenant.to_string(), KIND_WORKFLOW, command_id).await? {
                        Some(row) => {
                            let workflow: Workflow = doc(row)?;
                            (workflow.outcome.as_str().to_owned(), workflow.reason)
                        }
                        // A verb that runs no workflow (retire) is done once appended.
                        None => ("succeeded".to_owned(), None),
                    }
                }
            }
            BatchState::Released => match call.state.store.row_get(&tenant.to_string(), KIND_COMMAND, command_id).await? {
                Some(row) => {
                    let command: CommandDoc = doc(row)?;
                    (command.state.as_str().to_owned(), command.reason)
                }
                None => ("releasing".to_owned(), None),
            },
        };
        items.push(BatchMemberView {
            index: index as u64,
            subject: leaf.subject.clone(),
            kind: leaf.kind.clone(),
            command_id: command_id.clone(),
            state,
            reason,
        });
    }
    Ok(BatchMembersView { batch_id: batch.batch_id, state: batch.state, items })
}

async fn batches_approve(call: &Call<'_>, input: BatchesApprove) -> Result<CommandBatchView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    check_kid(&input.kid)?;
    check_signature(&input.signature)?;
    let batch = batch_doc(call, tenant, &input.batch_id).await?;
    let set = approver_set(call).await?.ok_or_else(|| Error::state("no approver set is published", "publish one first"))?;
    let now_ms = call.now_ms();
    expire_if_due(call, tenant, &batch, now_ms).await?;
    let mut outcome = batch_approve(&batch, &set, &input.kid, &input.signature, now_ms)?;
    if forge_release() {
        // A lying gateway, for the end-to-end test of the nodes' own check: the first approval
        // releases.
        tracing::warn!(batch = %batch.batch_id, "{FORGE_RELEASE_ENV} is set: releasing without the quorum");
        outcome.releases = true;
    }
    let stream = stream_of(KIND_COMMAND_BATCH, &batch.batch_id);
    let mut events = vec![NewEvent::new(ev::COMMAND_BATCH_APPROVED, ev::to_cbor(&outcome.approved)?)];
    if !outcome.releases {
        call.submit(call.request(tenant, stream, ExpectedVersion::Exact(batch.version), events)).await?;
        return Ok(batch_doc(call, tenant, &batch.batch_id).await?.into());
    }
    // The quorum: the release, then the commands a chunk a transaction, each command on its own
    // new stream with what its node checks before it runs it. A chunk that fails here (a node's
    // queue full, a crash) is issued by the `batches` reconciler.
    events.push(NewEvent::new(
        ev::COMMAND_BATCH_RELEASED,
        ev::to_cbor(&ev::CommandBatchReleased { approvals: outcome.approvals.clone() })?,
    ));
    call.submit(call.request(tenant, stream, ExpectedVersion::Exact(batch.version), events)).await?;
    let history = approver_set_history(&*call.state.store).await?;
    for _ in 0..RELEASE_CHUNKS_INLINE_MAX {
        let batch = batch_doc(call, tenant, &batch.batch_id).await?;
        let Some(chunk) = release_chunk(&batch, &history, call.now_ms())? else { return Ok(batch.into()) };
        let subjects: Vec<&str> = chunk.commands.iter().map(|(_, c)| c.node_id.as_str()).collect();
        if let Some(node) = node_without_room(&*call.state.store, &tenant.to_string(), &subjects).await? {
            tracing::info!(batch = %batch.batch_id, node = %node, "a chunk waits for room in a node's queue; the batches reconciler issues it");
            return Ok(batch.into());
        }
        let requests =
            chunk_requests(&*call.state.store, &batch, chunk, &call.actor(), Some(&call.request_id), call.now_ms()).await?;
        if let Err(e) = call.state.log.append_group(requests).await {
            tracing::info!(batch = %batch.batch_id, code = %e.code(), error = %e, "a chunk was not issued here; the batches reconciler issues it");
            return Ok(batch_doc(call, tenant, &batch.batch_id).await?.into());
        }
    }
    Ok(batch_doc(call, tenant, &batch.batch_id).await?.into())
}

async fn batches_cancel(call: &Call<'_>, input: BatchRef) -> Result<CommandBatchView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let batch = batch_doc(call, tenant, &input.batch_id).await?;
    expire_if_due(call, tenant, &batch, call.now_ms()).await?;
    batch_cancel(&batch)?;
    let payload = ev::to_cbor(&ev::CommandBatchEnded { reason: format!("cancelled by {}", call.actor()) })?;
    call.append(
        tenant,
        stream_of(KIND_COMMAND_BATCH, &batch.batch_id),
        ExpectedVersion::Exact(batch.version),
        ev::COMMAND_BATCH_CANCELLED,
        payload,
    )
    .await?;
    Ok(batch_doc(call, tenant, &batch.batch_id).await?.into())
}

/// A pending batch whose window has closed is ended as `command_batch.expired` by the first
/// approval or cancellation that finds it so (its commands were never issued), and that call is
/// refused `INVALID_STATE`.
async fn expire_if_due(call: &Call<'_>, tenant: TenantId, batch: &CommandBatchDoc, now_ms: u64) -> Result<()> {
    if !batch_expired(batch, now_ms) {
        return Ok(());
    }
    let payload = ev::to_cbor(&ev::CommandBatchEnded { reason: format!("its window closed at {} ms", batch.expires_at_ms) })?;
    let stream = stream_of(KIND_COMMAND_BATCH, &batch.batch_id);
    let request = AppendRequest::new(
        tenant,
        stream,
        ExpectedVersion::Exact(batch.version),
        call.actor(),
        vec![NewEvent::new(ev::COMMAND_BATCH_EXPIRED, payload)],
    );
    call.state.log.append(request).await?;
    Err(Error::state(format!("batch {} expired: its window closed", batch.batch_id), "make the batch again"))
}
