//! Releases and rollouts: the documents (`release/rel_…`, `rollout/ro_…`), the types and
//! payloads of `release.*` and `rollout.*`, and the fold of those events into them.
//!
//! A **release** is a signed manifest of a `bcd` version (`bc_core::release`): registered once
//! per version, after the gateway checked its signature under a release key it was configured
//! with. A **rollout** takes one release to a fixed list of nodes (a pool's, or a selector's,
//! frozen at creation, ordered by node id) in **waves**: each wave names how many of the nodes
//! have been offered the release once it is done (`1`, then `5%`, `25%`, `100%`: cumulative),
//! resolved to counts when the rollout is made. Each node goes `pending` → `updating` (an
//! `agent.update` command issued) → `updated` (the node reported the new version, its update
//! command succeeded, and it stayed `ready` for `minReadyS`) or `failed` (the command failed,
//! the node came back on another version, or nothing healthy within `nodeDeadlineS`). A wave
//! whose failures pass `waveFailuresMax` **pauses** the rollout with the reason; `resume`
//! accepts the failures seen so far; `abort` rolls the updated nodes back (`agent.rollback`) and
//! then ends. Never more than `maxUnavailable` of the rollout's nodes are updating, rolling back
//! or unreachable at once.
//!
//! The rollout's own events are the reconciler's record of what it decided; the nodes' versions
//! and readiness come from their documents, so a pass can always be decided again from the log.

use std::collections::BTreeMap;

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};

use crate::{CommandDoc, KIND_COMMAND, KIND_NODE, NodeDoc, corrupt, from_doc, payload, to_doc};

/// A signed `bcd` release, checked under a configured release key (`release/rel_…`).
pub const RELEASE_REGISTERED: &str = "release.registered";
/// A rollout of a release to a fixed list of nodes, in waves (`rollout/ro_…`; see
/// `crate::rollout`).
pub const ROLLOUT_CREATED: &str = "rollout.created";
/// A node was sent `agent.update` (the command issued in the same append).
pub const ROLLOUT_NODE_UPDATING: &str = "rollout.node_updating";
/// A node runs the release, confirmed, and stayed ready for the rollout's `minReadyS`.
pub const ROLLOUT_NODE_UPDATED: &str = "rollout.node_updated";
/// A node did not get there (the reason: its command's, or the deadline's).
pub const ROLLOUT_NODE_FAILED: &str = "rollout.node_failed";
/// After `abort`: an updated node was sent `agent.rollback`, and how that ended.
pub const ROLLOUT_NODE_ROLLING_BACK: &str = "rollout.node_rolling_back";
pub const ROLLOUT_NODE_ROLLED_BACK: &str = "rollout.node_rolled_back";
pub const ROLLOUT_NODE_ROLLBACK_FAILED: &str = "rollout.node_rollback_failed";
/// Every node of a wave finished, within the wave's failure limit.
pub const ROLLOUT_WAVE_PASSED: &str = "rollout.wave_passed";
/// Paused by an operator or by a wave's gate (with the reason); resumed by an operator.
pub const ROLLOUT_PAUSED: &str = "rollout.paused";
pub const ROLLOUT_RESUMED: &str = "rollout.resumed";
/// `abort` asked: the updated nodes are rolled back, then `rollout.aborted`.
pub const ROLLOUT_ABORTING: &str = "rollout.aborting";
pub const ROLLOUT_ABORTED: &str = "rollout.aborted";
/// Every wave passed.
pub const ROLLOUT_COMPLETED: &str = "rollout.completed";

/// A registered release: `release/rel_…`.
pub const KIND_RELEASE: &str = "release";
/// A rollout: `rollout/ro_…`.
pub const KIND_ROLLOUT: &str = "rollout";
/// One row per rollout still running, paused or aborting (removed when it ends): what the
/// reconciler and `rollouts.create`'s overlap check scan, so they never read finished ones.
pub const KIND_ROLLOUT_LIVE: &str = "rollout_live";
/// The commands a rollout sends a node.
pub const AGENT_UPDATE: &str = "agent.update";
pub const AGENT_ROLLBACK: &str = "agent.rollback";
/// How long a node has to answer `agent.update` or `agent.rollback` (a download, a re-exec and
/// the new agent's health confirmation); the command fails past it.
pub const AGENT_UPDATE_DEADLINE_S: u64 = bc_core::release::UPDATE_COMMAND_DEADLINE_S;
/// Nodes one rollout may take.
pub const ROLLOUT_NODES_MAX: usize = 10_000;
/// Waves one rollout may have.
pub const ROLLOUT_WAVES_MAX: usize = 16;
/// Bounds of the gates, in seconds.
pub const MIN_READY_S_MAX: u64 = 24 * 3600;
pub const NODE_DEADLINE_S_MIN: u64 = 10;
pub const NODE_DEADLINE_S_MAX: u64 = 7 * 24 * 3600;
/// Defaults of `rollouts.create`.
pub const MIN_READY_S_DEFAULT: u64 = 30;
pub const NODE_DEADLINE_S_DEFAULT: u64 = 900;
pub const MAX_UNAVAILABLE_DEFAULT: u32 = 1;
/// The longest reason a rollout records, in bytes.
pub const ROLLOUT_REASON_BYTES_MAX: usize = 1000;

/// What a rollout does with a node that holds live reservations when its turn comes.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BusyNodes {
    /// Leave it pending until its reservations end (drain it to hurry that along): the wave
    /// waits for it, and `rollouts get` says so.
    #[default]
    Wait,
    /// Update it anyway: the agent restarts, the GPUs it holds and the instances it runs stay.
    Proceed,
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RolloutState {
    Running,
    Paused,
    /// Rolling the updated nodes back after `abort`.
    Aborting,
    Aborted,
    Done,
}

impl RolloutState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Aborting => "aborting",
            Self::Aborted => "aborted",
            Self::Done => "done",
        }
    }

    /// Whether the reconciler still has work on it.
    pub fn is_live(self) -> bool {
        matches!(self, Self::Running | Self::Paused | Self::Aborting)
    }
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum RolloutNodeState {
    Pending,
    Updating,
    Updated,
    Failed,
    RollingBack,
    RolledBack,
    RollbackFailed,
}

impl RolloutNodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Updating => "updating",
            Self::Updated => "updated",
            Self::Failed => "failed",
            Self::RollingBack => "rolling-back",
            Self::RolledBack => "rolled-back",
            Self::RollbackFailed => "rollback-failed",
        }
    }

    /// A command of the rollout is in flight on the node: it counts as unavailable.
    pub fn in_flight(self) -> bool {
        matches!(self, Self::Updating | Self::RollingBack)
    }
}

// ---- events ----

/// `release.registered`: a signed manifest, checked by the gateway before the append.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseRegistered {
    pub release_version: String,
    /// The manifest's bytes as signed (JSON text) and its signature line.
    pub manifest: String,
    pub signature: String,
    pub key_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_update_from: Option<String>,
    #[serde(default)]
    pub allow_downgrade: bool,
    pub artifacts: Vec<ReleaseArtifact>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseArtifact {
    pub arch: String,
    pub url: String,
    pub sha256: String,
    pub size: u64,
}

/// One wave as asked (`"1"`, `"25%"`) and what it resolved to: how many of the rollout's nodes
/// have been offered the release once this wave is done (cumulative).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WaveSpec {
    pub spec: String,
    pub up_to: u32,
}

/// `rollout.created`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutCreated {
    pub release_id: String,
    pub target_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The nodes, in the order they are offered the release.
    pub nodes: Vec<String>,
    pub waves: Vec<WaveSpec>,
    pub max_unavailable: u32,
    pub min_ready_s: u64,
    pub node_deadline_s: u64,
    pub wave_failures_max: u32,
    pub busy_nodes: BusyNodes,
}

/// `rollout.node_updating` (with `agent.update` issued in the same append) and
/// `rollout.node_rolling_back` (with `agent.rollback`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutNodeCommanded {
    pub node_id: String,
    pub command_id: String,
    /// The version the node ran when the rollout took it (`node_updating`), or the one it goes
    /// back to (`node_rolling_back`).
    pub from_version: String,
}

/// `rollout.node_updated`, `rollout.node_failed`, `rollout.node_rolled_back`,
/// `rollout.node_rollback_failed`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutNodeFinished {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `rollout.wave_passed`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutWavePassed {
    pub wave: u32,
}

/// `rollout.paused`, `rollout.aborting` (a reason), `rollout.resumed`, `rollout.aborted`,
/// `rollout.completed` (none needed).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RolloutChanged {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Who: `operator` (a caller) or `gate` (the reconciler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

// ---- documents ----

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseDoc {
    pub tenant_id: String,
    pub release_id: String,
    pub release_version: String,
    pub key_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_update_from: Option<String>,
    pub allow_downgrade: bool,
    pub artifacts: Vec<ReleaseArtifact>,
    pub manifest: String,
    pub signature: String,
    pub version: u64,
    pub created_at_ms: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutNode {
    pub node_id: String,
    /// The wave (0-based) the node belongs to.
    pub wave: u32,
    pub state: RolloutNodeState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WaveDoc {
    pub spec: String,
    pub up_to: u32,
    /// `pending`, `running`, `passed`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passed_at_ms: Option<u64>,
    /// Nodes of this wave that failed, in all.
    pub failures: u32,
    /// Failures since the wave started or was last resumed: what the gate counts.
    pub failures_counted: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutDoc {
    pub tenant_id: String,
    pub rollout_id: String,
    pub release_id: String,
    pub target_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    pub state: RolloutState,
    /// Why it paused, aborted or was resumed last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The wave in progress (0-based); equal to the number of waves once all passed.
    pub wave: u32,
    pub waves: Vec<WaveDoc>,
    /// In the order they are offered the release.
    pub nodes: Vec<RolloutNode>,
    pub max_unavailable: u32,
    pub min_ready_s: u64,
    pub node_deadline_s: u64,
    pub wave_failures_max: u32,
    pub busy_nodes: BusyNodes,
    pub version: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

impl RolloutDoc {
    pub fn node(&self, node_id: &str) -> Option<&RolloutNode> {
        self.nodes.iter().find(|n| n.node_id == node_id)
    }

    fn node_mut(&mut self, node_id: &str) -> Option<&mut RolloutNode> {
        self.nodes.iter_mut().find(|n| n.node_id == node_id)
    }

    /// How many nodes are in each state.
    pub fn counts(&self) -> BTreeMap<&'static str, u32> {
        let mut out = BTreeMap::new();
        for node in &self.nodes {
            *out.entry(node.state.as_str()).or_insert(0) += 1;
        }
        out
    }
}

/// The wave each of `count` nodes belongs to, given the cumulative `up_to`s.
pub fn wave_of(index: usize, waves: &[WaveSpec]) -> u32 {
    waves.iter().position(|w| index < w.up_to as usize).unwrap_or(waves.len().saturating_sub(1)) as u32
}

/// Folds a `release.*` event into its document.
pub fn apply_release(id: &str, current: Option<serde_json::Value>, event: &StoredEvent) -> Result<Option<serde_json::Value>> {
    let env = &event.envelope;
    match env.event_type.as_str() {
        RELEASE_REGISTERED => {
            if current.is_some() {
                return Err(corrupt(event, format!("release {id} registered twice")));
            }
            let p: ReleaseRegistered = payload(event)?;
            to_doc(&ReleaseDoc {
                tenant_id: env.tenant.to_string(),
                release_id: id.to_owned(),
                release_version: p.release_version,
                key_id: p.key_id,
                min_update_from: p.min_update_from,
                allow_downgrade: p.allow_downgrade,
                artifacts: p.artifacts,
                manifest: p.manifest,
                signature: p.signature,
                version: env.version,
                created_at_ms: env.at_ms,
            })
        }
        other => Err(corrupt(event, format!("{other} is not a release event"))),
    }
}

/// Folds a `rollout.*` event into its document (`kind` [`KIND_ROLLOUT`]) or its live row
/// ([`KIND_ROLLOUT_LIVE`]: the same document while the rollout is live, then none).
pub fn apply_rollout(
    kind: &str,
    id: &str,
    current: Option<serde_json::Value>,
    event: &StoredEvent,
) -> Result<Option<serde_json::Value>> {
    if kind == KIND_ROLLOUT_LIVE {
        if current.is_none() && event.envelope.event_type != ROLLOUT_CREATED {
            return Ok(None);
        }
        let doc = apply_rollout(KIND_ROLLOUT, id, current, event)?;
        let live =
            doc.as_ref().and_then(|d| serde_json::from_value::<RolloutDoc>(d.clone()).ok()).is_some_and(|d| d.state.is_live());
        return Ok(if live { doc } else { None });
    }
    let env = &event.envelope;
    if env.event_type == ROLLOUT_CREATED {
        return rollout_created(id, current, event);
    }
    let mut doc: RolloutDoc = from_doc(event, current)?;
    let at = env.at_ms;
    let missing = |node: &str| corrupt(event, format!("node {node} is not in rollout {id}"));
    match env.event_type.as_str() {
        ROLLOUT_NODE_UPDATING | ROLLOUT_NODE_ROLLING_BACK => {
            let p: RolloutNodeCommanded = payload(event)?;
            let updating = env.event_type == ROLLOUT_NODE_UPDATING;
            let node = doc.node_mut(&p.node_id).ok_or_else(|| missing(&p.node_id))?;
            node.state = if updating { RolloutNodeState::Updating } else { RolloutNodeState::RollingBack };
            node.command_id = Some(p.command_id);
            if updating {
                node.from_version = Some(p.from_version);
            }
            node.started_at_ms = Some(at);
            node.finished_at_ms = None;
            node.reason = None;
        }
        ROLLOUT_NODE_UPDATED | ROLLOUT_NODE_FAILED | ROLLOUT_NODE_ROLLED_BACK | ROLLOUT_NODE_ROLLBACK_FAILED => {
            let p: RolloutNodeFinished = payload(event)?;
            let node = doc.node_mut(&p.node_id).ok_or_else(|| missing(&p.node_id))?;
            node.state = match env.event_type.as_str() {
                ROLLOUT_NODE_UPDATED => RolloutNodeState::Updated,
                ROLLOUT_NODE_FAILED => RolloutNodeState::Failed,
                ROLLOUT_NODE_ROLLED_BACK => RolloutNodeState::RolledBack,
                _ => RolloutNodeState::RollbackFailed,
            };
            node.finished_at_ms = Some(at);
            node.reason = p.reason;
            if env.event_type == ROLLOUT_NODE_FAILED {
                let wave = node.wave as usize;
                if let Some(w) = doc.waves.get_mut(wave) {
                    w.failures += 1;
                    w.failures_counted += 1;
                }
            }
        }
        ROLLOUT_WAVE_PASSED => {
            let p: RolloutWavePassed = payload(event)?;
            let wave = p.wave as usize;
            let w = doc.waves.get_mut(wave).ok_or_else(|| corrupt(event, format!("rollout {id} has no wave {wave}")))?;
            w.state = "passed".into();
            w.passed_at_ms = Some(at);
            doc.wave = p.wave + 1;
            if let Some(next) = doc.waves.get_mut(wave + 1) {
                next.state = "running".into();
                next.started_at_ms = Some(at);
            }
        }
        ROLLOUT_PAUSED | ROLLOUT_RESUMED | ROLLOUT_ABORTING | ROLLOUT_ABORTED | ROLLOUT_COMPLETED => {
            let p: RolloutChanged = payload(event)?;
            doc.state = match env.event_type.as_str() {
                ROLLOUT_PAUSED => RolloutState::Paused,
                ROLLOUT_RESUMED => {
                    // The failures seen so far are accepted: the gate counts anew.
                    for w in &mut doc.waves {
                        w.failures_counted = 0;
                    }
                    RolloutState::Running
                }
                ROLLOUT_ABORTING => RolloutState::Aborting,
                ROLLOUT_ABORTED => RolloutState::Aborted,
                _ => RolloutState::Done,
            };
            if p.reason.is_some() {
                doc.reason = p.reason;
            }
        }
        other => return Err(corrupt(event, format!("{other} is not a rollout event"))),
    }
    doc.version = env.version;
    doc.updated_at_ms = at;
    to_doc(&doc)
}

/// A rollout's document as `rollout.created` makes it: every node pending, its first wave running.
fn rollout_created(id: &str, current: Option<serde_json::Value>, event: &StoredEvent) -> Result<Option<serde_json::Value>> {
    let env = &event.envelope;
    if current.is_some() {
        return Err(corrupt(event, format!("rollout {id} created twice")));
    }
    let p: RolloutCreated = payload(event)?;
    let nodes = p
        .nodes
        .iter()
        .enumerate()
        .map(|(i, node_id)| RolloutNode {
            node_id: node_id.clone(),
            wave: wave_of(i, &p.waves),
            state: RolloutNodeState::Pending,
            command_id: None,
            from_version: None,
            started_at_ms: None,
            finished_at_ms: None,
            reason: None,
        })
        .collect();
    let waves = p
        .waves
        .iter()
        .enumerate()
        .map(|(i, w)| WaveDoc {
            spec: w.spec.clone(),
            up_to: w.up_to,
            state: if i == 0 { "running" } else { "pending" }.into(),
            started_at_ms: (i == 0).then_some(env.at_ms),
            passed_at_ms: None,
            failures: 0,
            failures_counted: 0,
        })
        .collect();
    to_doc(&RolloutDoc {
        tenant_id: env.tenant.to_string(),
        rollout_id: id.to_owned(),
        release_id: p.release_id,
        target_version: p.target_version,
        pool_id: p.pool_id,
        selector: p.selector,
        state: RolloutState::Running,
        reason: None,
        wave: 0,
        waves,
        nodes,
        max_unavailable: p.max_unavailable,
        min_ready_s: p.min_ready_s,
        node_deadline_s: p.node_deadline_s,
        wave_failures_max: p.wave_failures_max,
        busy_nodes: p.busy_nodes,
        version: env.version,
        created_at_ms: env.at_ms,
        updated_at_ms: env.at_ms,
    })
}

fn parse_doc<T: serde::de::DeserializeOwned>(what: &str, doc: serde_json::Value) -> Result<T> {
    serde_json::from_value(doc).map_err(|e| bc_core::Error::Internal(format!("{what} row: {e}")))
}

/// What a plan of `rollout` reads: its release, its nodes, the commands it issued.
pub struct PlanInputs {
    pub release: ReleaseDoc,
    pub nodes: BTreeMap<String, NodeDoc>,
    pub commands: BTreeMap<String, CommandDoc>,
}

/// Reads what [`crate::decide::rollout_plan`] needs for `rollout`; `all_nodes` is the tenant's nodes
/// when the caller has them (one scan for all its rollouts).
pub async fn plan_inputs(
    store: &dyn bc_core::store::EventStore,
    rollout: &RolloutDoc,
    all_nodes: Option<&BTreeMap<String, NodeDoc>>,
) -> Result<PlanInputs> {
    let tenant = &rollout.tenant_id;
    let release = store.row_get(tenant, KIND_RELEASE, &rollout.release_id).await?.ok_or_else(|| {
        bc_core::Error::Internal(format!("rollout {}'s release {} has no row", rollout.rollout_id, rollout.release_id))
    })?;
    let release: ReleaseDoc = parse_doc("release", release.doc)?;
    let mut nodes = BTreeMap::new();
    for n in &rollout.nodes {
        let doc = match all_nodes {
            Some(all) => all.get(&n.node_id).cloned(),
            None => match store.row_get(tenant, KIND_NODE, &n.node_id).await? {
                Some(row) => Some(parse_doc::<NodeDoc>("node", row.doc)?),
                None => None,
            },
        };
        if let Some(doc) = doc {
            nodes.insert(n.node_id.clone(), doc);
        }
    }
    let mut commands = BTreeMap::new();
    for n in rollout.nodes.iter().filter(|n| n.state.in_flight()) {
        if let Some(id) = &n.command_id
            && let Some(row) = store.row_get(tenant, KIND_COMMAND, id).await?
        {
            commands.insert(id.clone(), parse_doc::<CommandDoc>("command", row.doc)?);
        }
    }
    Ok(PlanInputs { release, nodes, commands })
}

/// Folds one `release.*` or `rollout.*` event into the row `key`; any other type leaves the row
/// as it was.
pub(crate) fn apply(key: &RowKey, current: Option<serde_json::Value>, event: &StoredEvent) -> Result<Option<serde_json::Value>> {
    match event.envelope.event_type.as_str() {
        RELEASE_REGISTERED => apply_release(&key.id, current, event),
        ROLLOUT_CREATED
        | ROLLOUT_NODE_UPDATING
        | ROLLOUT_NODE_UPDATED
        | ROLLOUT_NODE_FAILED
        | ROLLOUT_NODE_ROLLING_BACK
        | ROLLOUT_NODE_ROLLED_BACK
        | ROLLOUT_NODE_ROLLBACK_FAILED
        | ROLLOUT_WAVE_PASSED
        | ROLLOUT_PAUSED
        | ROLLOUT_RESUMED
        | ROLLOUT_ABORTING
        | ROLLOUT_ABORTED
        | ROLLOUT_COMPLETED => apply_rollout(&key.kind, &key.id, current, event),
        _ => Ok(current),
    }
}
