//! `rollouts.*`: a registered release taken to the nodes of a pool (or those carrying some
//! labels) in waves, by the `rollouts` reconciler (`bc_projections::rollout` says how). Create
//! decides with `decide::rollout_create` over the release, the nodes and the live rollouts;
//! pause, resume and abort with `decide::rollout_verb` at the rollout's version. `rollouts.get`
//! also says what the rollout waits for, from the reconciler's own plan decided on the spot.

use std::collections::BTreeMap;

use bc_core::id::{PoolId, ReleaseId, RolloutId, TenantId};
use bc_core::{Error, Result};
use bc_projections::decide::{self, RolloutCreateInput, RolloutVerb};
use bc_projections::placement::all_rows;
use bc_projections::rollout::{
    BusyNodes, KIND_ROLLOUT, KIND_ROLLOUT_LIVE, MAX_UNAVAILABLE_DEFAULT, MIN_READY_S_DEFAULT, MIN_READY_S_MAX,
    NODE_DEADLINE_S_DEFAULT, NODE_DEADLINE_S_MAX, NODE_DEADLINE_S_MIN, ROLLOUT_NODES_MAX, ROLLOUT_WAVES_MAX, ReleaseDoc,
    RolloutDoc,
};
use bc_projections::{KIND_NODE, NodeDoc};
use schemars::{JsonSchema, json_schema};
use serde::{Deserialize, Serialize};

use super::body::parse_id;
use super::call::{doc, stream_id};
use super::paging::{Page, list_rows};
use super::releases::release_doc;
use super::validate::{
    CursorText, LabelsMap, LimitNumber, PoolIdText, ReleaseIdText, RolloutIdText, TenantIdText, validate_labels, validate_text,
};
use super::validate::{TEXT_PATTERN, string_schema};
use super::{Access, Call, Method, method};

const READ: Access = Access::Action("compute:rollouts:read");
const WRITE: Access = Access::Action("compute:rollouts:write");

/// Longest wave spec (`"100%"`), in characters.
pub const WAVE_SPEC_CHARS_MAX: usize = 8;
/// Longest reason a caller gives a pause or an abort, in characters.
pub const ROLLOUT_REASON_CHARS_MAX: usize = 500;

string_schema!(
    /// A reason given to a pause, resume or abort ([`validate_text`] with
    /// [`ROLLOUT_REASON_CHARS_MAX`]).
    ReasonText,
    json_schema!({ "type": "string", "maxLength": ROLLOUT_REASON_CHARS_MAX, "pattern": TEXT_PATTERN })
);

/// A wave: a node count from 1, or a percentage from 1 % to 100 %.
pub(super) const WAVE_PATTERN: &str = "^([1-9][0-9]{0,6}|[1-9][0-9]?%|100%)$";

pub(super) const METHODS: &[Method] = &[
    method!("rollouts.create", WRITE, "take a release to a pool's nodes in waves", RolloutsCreate => RolloutView, rollouts_create),
    method!("rollouts.get", READ, "one rollout: its waves, its nodes and what it waits for", RolloutRef => RolloutView, rollouts_get),
    method!("rollouts.list", READ, "a tenant's rollouts, paged by cursor", RolloutsList => Page<RolloutView>, rollouts_list),
    method!("rollouts.pause", WRITE, "stop sending the release to more nodes", RolloutAct => RolloutView, rollouts_pause),
    method!("rollouts.resume", WRITE, "go on, accepting the failures seen so far", RolloutAct => RolloutView, rollouts_resume),
    method!("rollouts.abort", WRITE, "roll the updated nodes back and end", RolloutAct => RolloutView, rollouts_abort),
];

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutsCreate {
    #[schemars(with = "Option<TenantIdText>")]
    pub(super) tenant_id: Option<String>,
    #[schemars(with = "ReleaseIdText")]
    pub(super) release_id: String,
    /// The pool whose nodes (with an agent) take the release; with `labels`, only those of
    /// them carrying every label. At least one of the two.
    #[schemars(with = "Option<PoolIdText>")]
    pub(super) pool_id: Option<String>,
    #[schemars(with = "Option<LabelsMap>")]
    pub(super) labels: Option<BTreeMap<String, String>>,
    /// Cumulative: how many nodes have the release once each wave is done, as a count or a
    /// percentage; the last must reach every node. Default `["1", "100%"]`.
    #[schemars(length(min = 1, max = ROLLOUT_WAVES_MAX), inner(length(min = 1, max = WAVE_SPEC_CHARS_MAX), regex(pattern = WAVE_PATTERN)))]
    pub(super) waves: Option<Vec<String>>,
    /// Most of the rollout's nodes updating, rolling back or unreachable at once. Default 1.
    #[schemars(range(min = 1, max = ROLLOUT_NODES_MAX))]
    pub(super) max_unavailable: Option<u32>,
    /// How long a node must stay ready on the new version to pass its gate. Default 30.
    #[schemars(range(max = MIN_READY_S_MAX))]
    pub(super) min_ready_s: Option<u64>,
    /// How long a node has from its update to passing its gate, else it failed. Default 900.
    #[schemars(range(min = NODE_DEADLINE_S_MIN, max = NODE_DEADLINE_S_MAX))]
    pub(super) node_deadline_s: Option<u64>,
    /// Failed nodes a wave tolerates before the rollout pauses. Default 0.
    #[schemars(range(max = ROLLOUT_NODES_MAX))]
    pub(super) wave_failures_max: Option<u32>,
    /// A node with live reservations: `wait` (default) until they end, or `proceed`.
    pub(super) busy_nodes: Option<BusyNodes>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutRef {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "RolloutIdText")]
    rollout_id: String,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutAct {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "RolloutIdText")]
    rollout_id: String,
    /// Why, recorded in the event.
    #[schemars(with = "Option<ReasonText>")]
    reason: Option<String>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutsList {
    #[schemars(with = "Option<TenantIdText>")]
    tenant_id: Option<String>,
    #[schemars(with = "Option<LimitNumber>")]
    limit: Option<u32>,
    #[schemars(with = "Option<CursorText>")]
    cursor: Option<String>,
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutView {
    #[serde(flatten)]
    pub rollout: RolloutDoc,
    /// How many of its nodes are in each state.
    pub counts: BTreeMap<String, u32>,
    /// What keeps nodes that could go from going (only `rollouts.get` fills it).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waiting: Vec<String>,
}

impl From<RolloutDoc> for RolloutView {
    fn from(rollout: RolloutDoc) -> Self {
        let counts = rollout.counts().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        Self { rollout, counts, waiting: Vec::new() }
    }
}

async fn rollout_doc(call: &Call<'_>, tenant: TenantId, id: &RolloutId) -> Result<RolloutDoc> {
    call.row(tenant, KIND_ROLLOUT, &id.to_string(), "rollout").await
}

/// Parse, check, choose the nodes and decide (`decide::rollout_nodes`, `decide::rollout_create`),
/// append, answer with the rollout its append wrote.
async fn rollouts_create(call: &Call<'_>, input: RolloutsCreate) -> Result<RolloutView> {
    let Checked { tenant, release, labels, create } = check_create(call, input).await?;
    let nodes: Vec<NodeDoc> = all_rows(&*call.state.store, tenant, KIND_NODE).await?;
    let chosen = decide::rollout_nodes(&nodes, create.pool_id.as_deref(), &labels);
    decide::batch::batch_required(call.state.batch_quorum, decide::batch::DestructiveScope::Rollout { nodes: chosen.len() })?;
    let live = live_rollouts(call, tenant).await?;
    let rollout = RolloutId::from_ulid(call.ulid());
    let append = decide::rollout_create(&rollout.to_string(), &release, chosen, &live, create)?;
    let result = call.submit(call.decided(tenant, append)).await?;
    let id: RolloutId = parse_id("rolloutId", stream_id(&result.events[0].envelope.stream))?;
    Ok(rollout_doc(call, tenant, &id).await?.into())
}

/// The tenant's live rollouts, which a new rollout's nodes may not be in.
async fn live_rollouts(call: &Call<'_>, tenant: TenantId) -> Result<Vec<RolloutDoc>> {
    Ok(all_rows::<RolloutDoc>(&*call.state.store, tenant, KIND_ROLLOUT_LIVE)
        .await?
        .into_iter()
        .filter(|r| r.state.is_live())
        .collect())
}

/// A `rollouts.create` leaf of a batch (`commandBatches.create`), checked as `rollouts.create`
/// checks the call (the release trusted, the bounds, and the decision itself with the id
/// `rollout_id` drawn for the leaf, so a rollout refused now is refused before anyone
/// approves it): the leaf's payload, binding the nodes its pool and labels choose now
/// (`decide::batch::RolloutLeaf`). The rollout is created when the batch is released.
pub(super) async fn rollout_leaf(call: &Call<'_>, rollout_id: &str, input: RolloutsCreate) -> Result<serde_json::Value> {
    let Checked { tenant, release, labels, create } = check_create(call, input).await?;
    let nodes: Vec<NodeDoc> = all_rows(&*call.state.store, tenant, KIND_NODE).await?;
    let chosen = decide::rollout_nodes(&nodes, create.pool_id.as_deref(), &labels);
    let leaf = decide::batch::RolloutLeaf::new(&create, &labels, &chosen)?;
    let live = live_rollouts(call, tenant).await?;
    decide::rollout_create(rollout_id, &release, chosen, &live, create)?;
    leaf.payload()
}

/// A checked `rollouts.create`: the tenant, the release (found and trusted), the labels that
/// choose the nodes, and the rollout asked, its defaults filled in.
struct Checked {
    tenant: TenantId,
    release: ReleaseDoc,
    labels: BTreeMap<String, String>,
    create: RolloutCreateInput,
}

/// Checks a `rollouts.create`: the release first, then how the rollout goes.
async fn check_create(call: &Call<'_>, input: RolloutsCreate) -> Result<Checked> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let release_id: ReleaseId = parse_id("releaseId", &input.release_id)?;
    let pool: Option<PoolId> = input.pool_id.as_deref().map(|p| parse_id("poolId", p)).transpose()?;
    // The release first: what the rollout is of (NOT_FOUND before any check of how). Checked
    // again as `releases.register` checks it: a release registered while its downgrade permission
    // held, or under a key the control plane has stopped trusting, is not rolled out.
    let release = release_doc(call, tenant, &release_id).await?;
    bc_projections::decide::release_check(&call.state.release_keys, &release.manifest, &release.signature, call.now_ms())?;
    if let Some(labels) = &input.labels {
        validate_labels(labels)?;
    }
    if pool.is_none() && input.labels.as_ref().is_none_or(|l| l.is_empty()) {
        return Err(Error::InvalidArgument {
            message: "a rollout names its nodes: poolId, labels, or both".into(),
            hint: Some("--pool POOL and/or --label KEY=VALUE".into()),
        });
    }
    let waves = input.waves.unwrap_or_else(|| vec!["1".into(), "100%".into()]);
    if waves.iter().any(|w| w.is_empty() || w.chars().count() > WAVE_SPEC_CHARS_MAX) {
        return Err(Error::invalid(format!("waves: each 1 to {WAVE_SPEC_CHARS_MAX} characters, like \"1\" or \"25%\"")));
    }
    let min_ready_s = input.min_ready_s.unwrap_or(MIN_READY_S_DEFAULT);
    if min_ready_s > MIN_READY_S_MAX {
        return Err(Error::invalid(format!("minReadyS is at most {MIN_READY_S_MAX}")));
    }
    let node_deadline_s = input.node_deadline_s.unwrap_or(NODE_DEADLINE_S_DEFAULT);
    if !(NODE_DEADLINE_S_MIN..=NODE_DEADLINE_S_MAX).contains(&node_deadline_s) {
        return Err(Error::invalid(format!("nodeDeadlineS is {NODE_DEADLINE_S_MIN} to {NODE_DEADLINE_S_MAX}")));
    }
    if node_deadline_s <= min_ready_s {
        return Err(Error::invalid(format!(
            "nodeDeadlineS ({node_deadline_s}) must be longer than minReadyS ({min_ready_s}): no node could pass its gate"
        )));
    }
    let max_unavailable = input.max_unavailable.unwrap_or(MAX_UNAVAILABLE_DEFAULT);
    let wave_failures_max = input.wave_failures_max.unwrap_or(0);
    if max_unavailable == 0 || max_unavailable as usize > ROLLOUT_NODES_MAX || wave_failures_max as usize > ROLLOUT_NODES_MAX {
        return Err(Error::invalid(format!(
            "maxUnavailable is 1 to {ROLLOUT_NODES_MAX}; waveFailuresMax at most {ROLLOUT_NODES_MAX}"
        )));
    }
    let labels = input.labels.unwrap_or_default();
    let create = RolloutCreateInput {
        pool_id: pool.map(|p| p.to_string()),
        selector: decide::rollout_selector(&labels),
        waves,
        max_unavailable,
        min_ready_s,
        node_deadline_s,
        wave_failures_max,
        busy_nodes: input.busy_nodes.unwrap_or_default(),
    };
    Ok(Checked { tenant, release, labels, create })
}

async fn rollouts_get(call: &Call<'_>, input: RolloutRef) -> Result<RolloutView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: RolloutId = parse_id("rolloutId", &input.rollout_id)?;
    let rollout = rollout_doc(call, tenant, &id).await?;
    let mut waiting = Vec::new();
    if rollout.state.is_live() {
        // What the reconciler's next pass would wait for; ids drawn here are never used.
        let inputs = bc_projections::rollout::plan_inputs(&*call.state.store, &rollout, None).await?;
        let mut ids = || String::from("cmd_dry_run");
        let plan = decide::rollout_plan(&rollout, &inputs.release, &inputs.nodes, &inputs.commands, call.now_ms(), &mut ids)?;
        waiting = plan.waiting;
    }
    let mut view = RolloutView::from(rollout);
    view.waiting = waiting;
    Ok(view)
}

async fn rollouts_list(call: &Call<'_>, input: RolloutsList) -> Result<Page<RolloutView>> {
    let tenant = call.tenant(&input.tenant_id).await?;
    list_rows(call, tenant, KIND_ROLLOUT, input.limit, input.cursor.as_deref(), |row| Ok(Some(doc::<RolloutDoc>(row)?.into())))
        .await
}

async fn act(call: &Call<'_>, input: RolloutAct, verb: RolloutVerb) -> Result<RolloutView> {
    let tenant = call.tenant(&input.tenant_id).await?;
    let id: RolloutId = parse_id("rolloutId", &input.rollout_id)?;
    if let Some(reason) = &input.reason {
        validate_text("reason", reason, ROLLOUT_REASON_CHARS_MAX)?;
    }
    let rollout = rollout_doc(call, tenant, &id).await?;
    let append = decide::rollout_verb(&rollout, verb, input.reason)?;
    call.submit(call.decided(tenant, append)).await?;
    Ok(rollout_doc(call, tenant, &id).await?.into())
}

async fn rollouts_pause(call: &Call<'_>, input: RolloutAct) -> Result<RolloutView> {
    act(call, input, RolloutVerb::Pause).await
}

async fn rollouts_resume(call: &Call<'_>, input: RolloutAct) -> Result<RolloutView> {
    act(call, input, RolloutVerb::Resume).await
}

async fn rollouts_abort(call: &Call<'_>, input: RolloutAct) -> Result<RolloutView> {
    act(call, input, RolloutVerb::Abort).await
}
