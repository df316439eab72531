//! Rollouts' decisions: `rollouts.create` ([`rollout_create`]), an operator's verb
//! ([`rollout_verb`]: pause, resume, abort) and the `rollouts` reconciler's pass over one
//! rollout ([`rollout_plan`]). Pure: the documents, the time and the ids of the commands it
//! issues come in; what to append (one append per rollout per pass, at the rollout's version)
//! comes out, with what it waits for, so `rollouts get` can say why a rollout does not move.

use std::collections::BTreeMap;
use std::ops::ControlFlow;

use bc_core::release::{Manifest, ReleaseError, ReleasePublicKey};
use bc_core::store::{ExpectedVersion, NewEvent};
use bc_core::{Error, Result};
use serde_json::json;

use super::Append;
use crate::events::*;
use crate::placement::{Issue, issue_command_for};
use crate::rollout::*;
use crate::{CommandDoc, CommandState, KIND_NODE, NodeDoc, stream_of};

/// What `rollouts.create` asks, checked at the edge (bounds, ids).
#[derive(Clone, Debug, PartialEq)]
pub struct RolloutCreateInput {
    pub pool_id: Option<String>,
    pub selector: Option<String>,
    /// As asked: `"1"`, `"25%"`, cumulative.
    pub waves: Vec<String>,
    pub max_unavailable: u32,
    pub min_ready_s: u64,
    pub node_deadline_s: u64,
    pub wave_failures_max: u32,
    pub busy_nodes: BusyNodes,
}

/// A version as the rollout compares it: semver, or `None` for an agent that reports none
/// (a test or simulator agent), which is never refused as a downgrade.
fn semver(text: &str) -> Option<semver::Version> {
    semver::Version::parse(text.trim_start_matches('v')).ok()
}

/// Resolves the waves to cumulative node counts for `total` nodes; waves that would not take a
/// node more than the one before are merged into it (5 % of 3 nodes is the canary's 1).
pub fn resolve_waves(specs: &[String], total: u32) -> Result<Vec<WaveSpec>> {
    if specs.is_empty() || specs.len() > ROLLOUT_WAVES_MAX {
        return Err(Error::invalid(format!("waves: 1 to {ROLLOUT_WAVES_MAX} waves")));
    }
    let mut out: Vec<WaveSpec> = Vec::new();
    for spec in specs {
        let bad = || Error::InvalidArgument {
            message: format!("waves: {spec:?} is neither a node count nor a percentage"),
            hint: Some(
                "for example \"1\", \"5%\", \"25%\", \"100%\": each how many nodes have the release once it is done".into(),
            ),
        };
        let up_to = if let Some(percent) = spec.strip_suffix('%') {
            let percent: u64 = percent.parse().map_err(|_| bad())?;
            if percent == 0 || percent > 100 {
                return Err(bad());
            }
            (u64::from(total) * percent).div_ceil(100).max(1) as u32
        } else {
            let count: u32 = spec.parse().map_err(|_| bad())?;
            if count == 0 {
                return Err(bad());
            }
            count.min(total)
        };
        match out.last() {
            Some(last) if up_to < last.up_to => {
                return Err(Error::invalid(format!(
                    "waves: {spec:?} takes {up_to} nodes, fewer than the wave before ({}): waves are cumulative",
                    last.up_to
                )));
            }
            Some(last) if up_to == last.up_to => continue,
            _ => out.push(WaveSpec { spec: spec.clone(), up_to }),
        }
    }
    if out.last().is_none_or(|w| w.up_to < total) {
        return Err(Error::InvalidArgument {
            message: format!("waves: the last wave takes {} of the {total} nodes", out.last().map_or(0, |w| w.up_to)),
            hint: Some("end with \"100%\"".into()),
        });
    }
    Ok(out)
}

/// The nodes a rollout takes, as `rollouts.create` names them: every node with an agent (one
/// registered by hand has nothing to update), of `pool_id` when one is named, carrying every
/// one of `labels`; in the order of `nodes`.
pub fn rollout_nodes<'a>(nodes: &'a [NodeDoc], pool_id: Option<&str>, labels: &BTreeMap<String, String>) -> Vec<&'a NodeDoc> {
    nodes
        .iter()
        .filter(|n| n.agent.is_some())
        .filter(|n| pool_id.is_none_or(|p| n.pool_id == p))
        .filter(|n| labels.iter().all(|(k, v)| n.labels.get(k) == Some(v)))
        .collect()
}

/// The selector a rollout records for the `labels` it was named by (`key=value,…`), none for no
/// label.
pub fn rollout_selector(labels: &BTreeMap<String, String>) -> Option<String> {
    (!labels.is_empty()).then(|| labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(","))
}

/// `rollouts.create`: the release to `nodes` (the pool's or the selector's, any order: they are
/// offered the release by node id), refused when a node is in another live rollout or runs a
/// newer version than a release that does not allow downgrades.
pub fn rollout_create(
    rollout_id: &str,
    release: &ReleaseDoc,
    mut nodes: Vec<&NodeDoc>,
    live: &[RolloutDoc],
    input: RolloutCreateInput,
) -> Result<Append> {
    if nodes.is_empty() {
        return Err(Error::state(
            "the rollout would take no node: the pool or the selector matches none with an agent",
            "nodes list shows which nodes have an agent (agentVersion); widen the selector, or join machines with bcd",
        ));
    }
    if nodes.len() > ROLLOUT_NODES_MAX {
        return Err(Error::state(
            format!("{} nodes: a rollout takes at most {ROLLOUT_NODES_MAX}", nodes.len()),
            "narrow the selector and roll out in several rollouts",
        ));
    }
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    let target = semver(&release.release_version);
    for node in &nodes {
        let Some(agent) = &node.agent else {
            return Err(Error::state(
                format!("node {} has no agent to update (it was registered by hand)", node.node_id),
                "leave it out with the selector, or join the machine with bcd",
            ));
        };
        if let Some(other) = live.iter().find(|r| r.node(&node.node_id).is_some()) {
            return Err(Error::Conflict {
                stream: stream_of(KIND_ROLLOUT, &other.rollout_id),
                expected: format!(
                    "no live rollout of node {} (rollout {} is {})",
                    node.node_id,
                    other.rollout_id,
                    other.state.as_str()
                ),
                actual: other.version,
            });
        }
        if let (Some(target), Some(running)) = (&target, semver(&agent.agent_version))
            && running > *target
            && !release.allow_downgrade
        {
            return Err(Error::InvalidArgument {
                message: format!(
                    "node {} runs {running}, newer than release {target}, which does not allow downgrades",
                    node.node_id
                ),
                hint: Some("sign the release with --allow-downgrade to go back, or leave that node out".into()),
            });
        }
    }
    if input.max_unavailable == 0 {
        return Err(Error::invalid("maxUnavailable must be at least 1"));
    }
    let waves = resolve_waves(&input.waves, nodes.len() as u32)?;
    let created = RolloutCreated {
        release_id: release.release_id.clone(),
        target_version: release.release_version.clone(),
        pool_id: input.pool_id,
        selector: input.selector,
        nodes: nodes.iter().map(|n| n.node_id.clone()).collect(),
        waves,
        max_unavailable: input.max_unavailable,
        min_ready_s: input.min_ready_s,
        node_deadline_s: input.node_deadline_s,
        wave_failures_max: input.wave_failures_max,
        busy_nodes: input.busy_nodes,
    };
    Ok(Append {
        stream: stream_of(KIND_ROLLOUT, &rollout_id),
        expected: ExpectedVersion::NoStream,
        guards: Vec::new(),
        events: vec![NewEvent::new(ROLLOUT_CREATED, to_cbor(&created)?)],
    })
}

/// A release refused by `releases.register` or `commands.issue`, as the caller sees it: a
/// signer this control plane does not trust, or a signature that does not hold, is
/// ACCESS_DENIED (a caller may not publish it here); a manifest that does not hold up, or a
/// downgrade permission past its `notAfter`, is INVALID_ARGUMENT. The message starts with the
/// stable code of `bc_core::release` (`release-untrusted-key: …`), the words an agent journals.
pub fn release_refusal(e: ReleaseError) -> Error {
    match e {
        ReleaseError::Malformed(_) | ReleaseError::Expired(_) => Error::InvalidArgument {
            message: format!("{}: {}", e.code(), e.detail()),
            hint: Some("make the manifest with `better-compute releases sign`".into()),
        },
        _ => Error::AccessDenied(format!("{}: {}", e.code(), e.detail())),
    }
}

/// Checks a release the way `releases.register` does: signed under one of `trusted` (the
/// control plane's `--release-key`s, none: every release refused), its fields in their bounds,
/// and a downgrade permission within its `notAfter` at `now_ms`.
pub fn release_check(trusted: &[ReleasePublicKey], manifest: &str, signature: &str, now_ms: u64) -> Result<Manifest> {
    if trusted.is_empty() {
        return Err(Error::AccessDenied(
            "release-untrusted-key: this control plane trusts no release key (start it with --release-key FILE.pub, from `better-compute releases keygen`)".into(),
        ));
    }
    let parsed = bc_core::release::verify(trusted, manifest.as_bytes(), signature).map_err(release_refusal)?;
    bc_core::release::check_validity(&parsed, now_ms).map_err(release_refusal)?;
    Ok(parsed)
}

/// `commands.issue` of `agent.update`: only a release of the tenant's registered ones (`releases`,
/// the tenant's `release/…` documents), byte for byte as registered, checked again as
/// `releases.register` checks it ([`release_check`]: still under a key the control plane trusts,
/// a downgrade permission not expired). So a key holding `commands:write` alone sends a node
/// nothing `releases.register` (`releases:write`) would refuse. Returns the registered release.
pub fn agent_update_issue<'a>(
    trusted: &[ReleasePublicKey],
    releases: &'a [ReleaseDoc],
    manifest: &str,
    signature: &str,
    now_ms: u64,
) -> Result<&'a ReleaseDoc> {
    let parsed = release_check(trusted, manifest, signature, now_ms)?;
    if let Some(registered) = releases.iter().find(|r| r.manifest == manifest) {
        return Ok(registered);
    }
    let message = match releases.iter().find(|r| r.release_version == parsed.version) {
        Some(other) => format!(
            "release-unregistered: this manifest of {} is not the one registered as {} (same version, other text)",
            parsed.version, other.release_id
        ),
        None => format!("release-unregistered: release {} is not registered in this tenant", parsed.version),
    };
    Err(Error::state(
        message,
        "register it first (better-compute releases register), then send it, or roll it out (rollouts create)",
    ))
}

/// An operator's verb on a rollout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RolloutVerb {
    Pause,
    Resume,
    Abort,
}

/// `rollouts.pause|resume|abort`: the event, at the rollout's version, or why not now.
pub fn rollout_verb(rollout: &RolloutDoc, verb: RolloutVerb, reason: Option<String>) -> Result<Append> {
    let (allowed, event_type) = match verb {
        RolloutVerb::Pause => (rollout.state == RolloutState::Running, ROLLOUT_PAUSED),
        RolloutVerb::Resume => (rollout.state == RolloutState::Paused, ROLLOUT_RESUMED),
        RolloutVerb::Abort => (matches!(rollout.state, RolloutState::Running | RolloutState::Paused), ROLLOUT_ABORTING),
    };
    if !allowed {
        let allowed = match rollout.state {
            RolloutState::Running => vec!["pause".to_owned(), "abort".to_owned()],
            RolloutState::Paused => vec!["resume".to_owned(), "abort".to_owned()],
            _ => Vec::new(),
        };
        return Err(Error::InvalidState {
            message: format!("rollout {} is {}", rollout.rollout_id, rollout.state.as_str()),
            allowed,
            hint: None,
        });
    }
    let changed = RolloutChanged { reason, by: Some("operator".into()) };
    Ok(Append {
        stream: stream_of(KIND_ROLLOUT, &rollout.rollout_id),
        expected: ExpectedVersion::Exact(rollout.version),
        guards: Vec::new(),
        events: vec![NewEvent::new(event_type, to_cbor(&changed)?)],
    })
}

/// What one pass decided for one rollout: at most one append (every event of the pass, at the
/// rollout's version), what it did, and what it waits for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RolloutPlan {
    pub append: Option<Append>,
    /// One line per decision, for the reconciler's log.
    pub did: Vec<String>,
    /// Why nodes that could go do not (a busy node, `maxUnavailable` reached, an unreachable
    /// node): what `rollouts get` shows.
    pub waiting: Vec<String>,
}

/// Where a node stands against its gate.
enum Gate {
    Passed,
    Failed(String),
    Waiting,
}

fn reachable(node: &NodeDoc) -> bool {
    node.agent.as_ref().is_some_and(|a| a.reachable)
}

fn version_of(node: &NodeDoc) -> &str {
    node.agent.as_ref().map_or("", |a| a.agent_version.as_str())
}

/// A node sent a command (`agent.update` to `want`, or `agent.rollback` to `want`): passed once
/// the command succeeded, the node reports `want` and stayed ready for `min_ready_s`.
fn gate(
    rollout: &RolloutDoc,
    n: &RolloutNode,
    node: Option<&NodeDoc>,
    command: Option<&CommandDoc>,
    want: &str,
    now_ms: u64,
) -> Gate {
    let Some(node) = node else { return Gate::Failed("the node no longer exists".into()) };
    let started = n.started_at_ms.unwrap_or(0);
    if let Some(c) = command {
        match c.state {
            CommandState::Failed | CommandState::Cancelled => {
                let reason = c.reason.clone().unwrap_or_else(|| format!("command {} {}", c.command_id, c.state.as_str()));
                return Gate::Failed(reason);
            }
            CommandState::Succeeded => {
                let running = version_of(node);
                if running != want {
                    return Gate::Failed(format!("the node reports version {running:?}, not {want}"));
                }
                let agent = node.agent.as_ref();
                let since = [
                    agent.map_or(0, |a| a.ready_since_ms),
                    agent.map_or(0, |a| a.agent_started_at_ms),
                    c.finished_at_ms.unwrap_or(0),
                ]
                .into_iter()
                .max()
                .unwrap_or(0);
                if reachable(node) && now_ms >= since.saturating_add(rollout.min_ready_s * 1000) {
                    return Gate::Passed;
                }
            }
            CommandState::Issued | CommandState::Started => {}
        }
    }
    if now_ms > started.saturating_add(rollout.node_deadline_s * 1000) {
        let state = command.map_or("missing", |c| c.state.as_str());
        return Gate::Failed(format!(
            "not on {want} and ready for {} s within {} s (its command is {state})",
            rollout.min_ready_s, rollout.node_deadline_s
        ));
    }
    Gate::Waiting
}

fn truncate_reason(reason: &str) -> String {
    bc_core::id::truncate(reason, ROLLOUT_REASON_BYTES_MAX).to_owned()
}

/// The `rollouts` reconciler's pass over one live rollout: observe the nodes in flight against
/// their gates, then (running) pause on a wave's failures, offer the release to the wave's next
/// nodes within `maxUnavailable`, pass the wave, complete; (aborting) roll the updated nodes
/// back, then end; last, pause (or end an abort) when nothing moved for a node's deadline.
/// `release` is the rollout's (what `agent.update` carries); `nodes` are the rollout's nodes'
/// documents (a missing one is gone), `commands` the documents of the commands it issued;
/// `new_command_id` draws an id per command.
pub fn rollout_plan(
    rollout: &RolloutDoc,
    release: &ReleaseDoc,
    nodes: &BTreeMap<String, NodeDoc>,
    commands: &BTreeMap<String, CommandDoc>,
    now_ms: u64,
    new_command_id: &mut dyn FnMut() -> String,
) -> Result<RolloutPlan> {
    if !rollout.state.is_live() {
        return Ok(RolloutPlan::default());
    }
    let mut pass = Pass {
        rollout,
        nodes,
        now_ms,
        plan: RolloutPlan::default(),
        events: Vec::new(),
        guards: Vec::new(),
        states: rollout.nodes.iter().map(|n| n.state).collect(),
        new_failures: BTreeMap::new(),
    };
    pass.observe(commands)?;
    let go_on = match rollout.state {
        RolloutState::Running => pass.run_wave(release, new_command_id)?,
        RolloutState::Aborting => {
            pass.roll_back(new_command_id)?;
            ControlFlow::Continue(())
        }
        RolloutState::Paused | RolloutState::Aborted | RolloutState::Done => ControlFlow::Continue(()),
    };
    if go_on.is_continue() {
        pass.give_up_if_stalled()?;
    }
    Ok(pass.finish())
}

/// What a busy node's waiting line says (the one wait that does not stall a rollout).
const BUSY_WAIT: &str = "busyNodes: wait";

/// One pass over one rollout as its phases leave it.
struct Pass<'a> {
    rollout: &'a RolloutDoc,
    nodes: &'a BTreeMap<String, NodeDoc>,
    now_ms: u64,
    plan: RolloutPlan,
    /// Every event of the pass, appended at the rollout's version, with `guards`.
    events: Vec<NewEvent>,
    guards: Vec<(String, ExpectedVersion)>,
    /// The rollout's nodes' states (in its order) as the pass's events leave them.
    states: Vec<RolloutNodeState>,
    /// Wave → the failures this pass found in it (`node: reason`).
    new_failures: BTreeMap<u32, Vec<String>>,
}

impl Pass<'_> {
    /// Records that a node's update or rollback ended (`event_type`), with why.
    fn finished(&mut self, event_type: &str, node_id: &str, reason: Option<String>) -> Result<()> {
        let finished = RolloutNodeFinished { node_id: node_id.to_owned(), reason: reason.map(|r| truncate_reason(&r)) };
        self.events.push(NewEvent::new(event_type, to_cbor(&finished)?));
        Ok(())
    }

    /// Node `i` of the rollout failed for `reason`.
    fn failed(&mut self, i: usize, node_id: &str, reason: String) -> Result<()> {
        self.plan.did.push(format!("{node_id} failed: {reason}"));
        self.finished(ROLLOUT_NODE_FAILED, node_id, Some(reason))?;
        self.states[i] = RolloutNodeState::Failed;
        Ok(())
    }

    /// The gate pauses the rollout for `reason`.
    fn paused(&mut self, reason: String) -> Result<()> {
        self.plan.did.push(format!("paused: {reason}"));
        let changed = RolloutChanged { reason: Some(truncate_reason(&reason)), by: Some("gate".into()) };
        self.events.push(NewEvent::new(ROLLOUT_PAUSED, to_cbor(&changed)?));
        Ok(())
    }

    /// Out: the rollout's commands in flight, and its other nodes that are unreachable.
    fn unavailable(&self) -> u32 {
        let rollout = self.rollout;
        rollout
            .nodes
            .iter()
            .zip(&self.states)
            .filter(|(n, s)| s.in_flight() || self.nodes.get(&n.node_id).is_some_and(|d| !reachable(d)))
            .count() as u32
    }

    /// Issues a command of `kind` to `node` (guarding the node at its version when
    /// `guard_node`), and returns its id.
    fn issue(
        &mut self,
        node: &NodeDoc,
        kind: &str,
        args: serde_json::Value,
        guard_node: bool,
        new_command_id: &mut dyn FnMut() -> String,
    ) -> Result<String> {
        let command_id = new_command_id();
        let (event, _) = issue_command_for(
            &node.node_id,
            kind,
            args,
            AGENT_UPDATE_DEADLINE_S,
            Issue { command_id: &command_id, now_ms: self.now_ms },
            &mut self.guards,
        )?;
        if guard_node {
            self.guards.push((stream_of(KIND_NODE, &node.node_id), ExpectedVersion::Exact(node.version)));
        }
        self.events.push(event);
        Ok(command_id)
    }

    /// The nodes in flight, against their gates: updated or failed, rolled back or not.
    fn observe(&mut self, commands: &BTreeMap<String, CommandDoc>) -> Result<()> {
        let (rollout, nodes) = (self.rollout, self.nodes);
        for (i, n) in rollout.nodes.iter().enumerate() {
            let node = nodes.get(&n.node_id);
            let command = n.command_id.as_ref().and_then(|c| commands.get(c));
            match n.state {
                RolloutNodeState::Updating => match gate(rollout, n, node, command, &rollout.target_version, self.now_ms) {
                    Gate::Passed => {
                        self.finished(ROLLOUT_NODE_UPDATED, &n.node_id, None)?;
                        self.plan.did.push(format!("{} updated to {}", n.node_id, rollout.target_version));
                        self.states[i] = RolloutNodeState::Updated;
                    }
                    Gate::Failed(reason) => {
                        self.new_failures.entry(n.wave).or_default().push(format!("{}: {reason}", n.node_id));
                        self.failed(i, &n.node_id, reason)?;
                    }
                    Gate::Waiting => {}
                },
                RolloutNodeState::RollingBack => {
                    let want = n.from_version.clone().unwrap_or_default();
                    match gate(rollout, n, node, command, &want, self.now_ms) {
                        Gate::Passed => {
                            self.finished(ROLLOUT_NODE_ROLLED_BACK, &n.node_id, None)?;
                            self.plan.did.push(format!("{} rolled back to {want}", n.node_id));
                            self.states[i] = RolloutNodeState::RolledBack;
                        }
                        Gate::Failed(reason) => {
                            self.plan.did.push(format!("{} rollback failed: {reason}", n.node_id));
                            self.finished(ROLLOUT_NODE_ROLLBACK_FAILED, &n.node_id, Some(reason))?;
                            self.states[i] = RolloutNodeState::RollbackFailed;
                        }
                        Gate::Waiting => {}
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A running rollout's wave: paused on its failures, else the release offered to its next
    /// nodes, and the wave passed (and the rollout completed) once each of its nodes is updated
    /// or failed. Breaks when the pass ends here (no wave left, or paused).
    fn run_wave(&mut self, release: &ReleaseDoc, new_command_id: &mut dyn FnMut() -> String) -> Result<ControlFlow<()>> {
        let rollout = self.rollout;
        let w = rollout.wave as usize;
        let Some(wave) = rollout.waves.get(w) else { return Ok(ControlFlow::Break(())) };
        if let Some(reason) = self.wave_failed(wave) {
            self.paused(reason)?;
            return Ok(ControlFlow::Break(()));
        }
        self.offer_updates(wave, release, new_command_id)?;
        let all_done =
            (0..wave.up_to as usize).all(|i| matches!(self.states[i], RolloutNodeState::Updated | RolloutNodeState::Failed));
        if all_done {
            self.events.push(NewEvent::new(ROLLOUT_WAVE_PASSED, to_cbor(&RolloutWavePassed { wave: rollout.wave })?));
            self.plan.did.push(format!("wave {} ({}) passed", w + 1, wave.spec));
            if w + 1 == rollout.waves.len() {
                self.events.push(NewEvent::new(ROLLOUT_COMPLETED, to_cbor(&RolloutChanged::default())?));
                self.plan.did.push("completed".into());
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Why the current wave failed its gate (more failed nodes than `waveFailuresMax`), if it did.
    fn wave_failed(&self, wave: &WaveDoc) -> Option<String> {
        let rollout = self.rollout;
        let fresh = self.new_failures.get(&rollout.wave).map_or(&[][..], |v| v.as_slice());
        let counted = wave.failures_counted + fresh.len() as u32;
        if counted <= rollout.wave_failures_max {
            return None;
        }
        let first = fresh.first().cloned().or_else(|| {
            rollout
                .nodes
                .iter()
                .find(|n| n.wave == rollout.wave && n.state == RolloutNodeState::Failed)
                .map(|n| format!("{}: {}", n.node_id, n.reason.as_deref().unwrap_or("failed")))
        });
        Some(format!(
            "wave {} ({}) failed its gate: {counted} node(s) failed, over its limit of {}; first: {}",
            rollout.wave + 1,
            wave.spec,
            rollout.wave_failures_max,
            first.unwrap_or_default()
        ))
    }

    /// The wave's pending nodes, in order: a gone node failed, an unreachable one waited for
    /// (failed past the node deadline since the wave started), one already on the target
    /// updated, a busy one waited for under `busyNodes: wait`; the others sent `agent.update`
    /// while fewer than `maxUnavailable` nodes are out.
    fn offer_updates(&mut self, wave: &WaveDoc, release: &ReleaseDoc, new_command_id: &mut dyn FnMut() -> String) -> Result<()> {
        let (rollout, nodes) = (self.rollout, self.nodes);
        let mut out = self.unavailable();
        let wave_started = wave.started_at_ms.unwrap_or(rollout.created_at_ms);
        for (i, n) in rollout.nodes.iter().enumerate().take(wave.up_to as usize) {
            if self.states[i] != RolloutNodeState::Pending {
                continue;
            }
            let Some(node) = nodes.get(&n.node_id) else {
                self.finished(ROLLOUT_NODE_FAILED, &n.node_id, Some("the node no longer exists".into()))?;
                self.plan.did.push(format!("{} failed: gone", n.node_id));
                self.states[i] = RolloutNodeState::Failed;
                continue;
            };
            if !reachable(node) {
                if self.now_ms > wave_started.saturating_add(rollout.node_deadline_s * 1000) {
                    let reason = format!("unreachable for the {} s since its wave started", rollout.node_deadline_s);
                    self.failed(i, &n.node_id, reason)?;
                } else {
                    self.plan.waiting.push(format!("node {} is unreachable", n.node_id));
                }
                continue;
            }
            if version_of(node) == rollout.target_version {
                let reason = format!("already on {}", rollout.target_version);
                self.finished(ROLLOUT_NODE_UPDATED, &n.node_id, Some(reason))?;
                self.plan.did.push(format!("{} already on {}", n.node_id, rollout.target_version));
                self.states[i] = RolloutNodeState::Updated;
                continue;
            }
            if rollout.busy_nodes == BusyNodes::Wait && !node.allocations.is_empty() {
                self.plan.waiting.push(format!(
                    "node {} holds {} GPU(s) of live reservations ({BUSY_WAIT}; drain it to hurry)",
                    n.node_id,
                    node.allocations.len()
                ));
                continue;
            }
            if out >= rollout.max_unavailable {
                self.plan.waiting.push(format!("maxUnavailable: {out} of {} nodes are out", rollout.max_unavailable));
                break;
            }
            let args = json!({ "manifest": release.manifest, "signature": release.signature, "rolloutId": rollout.rollout_id });
            let command_id = self.issue(node, AGENT_UPDATE, args, rollout.busy_nodes == BusyNodes::Wait, new_command_id)?;
            let commanded = RolloutNodeCommanded {
                node_id: n.node_id.clone(),
                command_id: command_id.clone(),
                from_version: version_of(node).to_owned(),
            };
            self.events.push(NewEvent::new(ROLLOUT_NODE_UPDATING, to_cbor(&commanded)?));
            self.plan.did.push(format!("{} sent agent.update ({command_id})", n.node_id));
            self.states[i] = RolloutNodeState::Updating;
            out += 1;
        }
        Ok(())
    }

    /// An aborting rollout: each node it updated (or whose update failed) and that is not on its
    /// old version sent `agent.rollback` while fewer than `maxUnavailable` nodes are out; the
    /// abort ends once nothing is in flight and nothing waited for.
    fn roll_back(&mut self, new_command_id: &mut dyn FnMut() -> String) -> Result<()> {
        let (rollout, nodes) = (self.rollout, self.nodes);
        let mut out = self.unavailable();
        for (i, n) in rollout.nodes.iter().enumerate() {
            let Some(from) = n.from_version.as_deref() else { continue };
            if !matches!(self.states[i], RolloutNodeState::Updated | RolloutNodeState::Failed) {
                continue;
            }
            let Some(node) = nodes.get(&n.node_id) else { continue };
            if version_of(node) == from || n.command_id.is_none() {
                continue;
            }
            if !reachable(node) {
                self.plan.waiting.push(format!("node {} is unreachable: it is rolled back when it is back", n.node_id));
                continue;
            }
            if out >= rollout.max_unavailable {
                self.plan.waiting.push(format!("maxUnavailable: {out} of {} nodes are out", rollout.max_unavailable));
                break;
            }
            let args = json!({ "toVersion": from, "rolloutId": rollout.rollout_id });
            let command_id = self.issue(node, AGENT_ROLLBACK, args, false, new_command_id)?;
            let commanded = RolloutNodeCommanded {
                node_id: n.node_id.clone(),
                command_id: command_id.clone(),
                from_version: from.to_owned(),
            };
            self.events.push(NewEvent::new(ROLLOUT_NODE_ROLLING_BACK, to_cbor(&commanded)?));
            self.plan.did.push(format!("{} sent agent.rollback to {from} ({command_id})", n.node_id));
            self.states[i] = RolloutNodeState::RollingBack;
            out += 1;
        }
        let unfinished = self.states.iter().any(|s| s.in_flight());
        if !unfinished && self.plan.waiting.is_empty() {
            self.events.push(NewEvent::new(ROLLOUT_ABORTED, to_cbor(&RolloutChanged::default())?));
            self.plan.did.push("aborted".into());
        }
        Ok(())
    }

    /// Nothing moved for a node's deadline: a rollout never waits without end and without a
    /// reason (only a busy node under `busyNodes: wait` is waited for, as asked). A running one
    /// pauses; an aborting one gives up on the nodes it cannot reach or may not take out, each
    /// recorded, then ends.
    fn give_up_if_stalled(&mut self) -> Result<()> {
        let rollout = self.rollout;
        let stalled =
            self.events.is_empty() && self.now_ms > rollout.updated_at_ms.saturating_add(rollout.node_deadline_s * 1000);
        let blocking = self.plan.waiting.iter().find(|w| !w.contains(BUSY_WAIT)).cloned();
        let (true, Some(blocking)) = (stalled, blocking) else { return Ok(()) };
        match rollout.state {
            RolloutState::Running => self.paused(format!("no progress for {} s: {blocking}", rollout.node_deadline_s))?,
            RolloutState::Aborting => {
                for n in &rollout.nodes {
                    let Some(from) = n.from_version.as_deref() else { continue };
                    let needs = matches!(n.state, RolloutNodeState::Updated | RolloutNodeState::Failed)
                        && n.command_id.is_some()
                        && self.nodes.get(&n.node_id).is_some_and(|d| version_of(d) != from);
                    if needs {
                        let reason = format!("not rolled back to {from} within {} s: {blocking}", rollout.node_deadline_s);
                        self.finished(ROLLOUT_NODE_ROLLBACK_FAILED, &n.node_id, Some(reason))?;
                    }
                }
                self.events.push(NewEvent::new(ROLLOUT_ABORTED, to_cbor(&RolloutChanged::default())?));
                self.plan.did.push("aborted, some nodes not rolled back".into());
            }
            _ => {}
        }
        Ok(())
    }

    /// The plan, with its one append at the rollout's version if the pass has events.
    fn finish(self) -> RolloutPlan {
        let mut plan = self.plan;
        if !self.events.is_empty() {
            plan.append = Some(Append {
                stream: stream_of(KIND_ROLLOUT, &self.rollout.rollout_id),
                expected: ExpectedVersion::Exact(self.rollout.version),
                guards: self.guards,
                events: self.events,
            });
        }
        plan
    }
}
