//! Rollouts in `sim run` (the `rollouts` fault): an operator registers a signed release and
//! rolls it out to a tenant's pool with the real `decide::rollout_create`; the real `rollouts`
//! reconciler's pass (in `World::pass`) takes it on; and each node's agent, handed
//! `agent.update` or `agent.rollback` by its real session machine, is the machine `bcd update`
//! runs on: its slots and its re-exec are modelled here (the IO `bc_agent::update` does on a
//! host), the outcome drawn from the seed per update:
//!
//! - it restarts on the new version and confirms (`node.agent_started`, `command.succeeded`);
//! - its new binary exits at start: the watchdog puts the old agent back within seconds
//!   (`command.failed` `rolled-back: …`);
//! - its new agent hangs and never confirms: the watchdog rolls back at `confirm_within_s`;
//! - it confirms, then drops off (unhealthy: the agent goes away for up to half an hour).
//!
//! Each entry is journaled through the node's real journal (started, then finished), so a
//! redelivered command finds its stage there and is not run twice. The operator, at each later
//! `rollouts` fault on the tenant, pauses, resumes or aborts now and then. Checked after every
//! pass: no live rollout's document has more nodes in flight than its `maxUnavailable`; and
//! whenever a modelled updater takes its node out, the rollout's nodes out counted from the
//! modelled agents (in an update or rollback, or down since before the command was issued),
//! not from the document the plan writes, are within it too ([`Sim::max_unavailable_check`]).
//! In the liveness phase the operator aborts what still runs, and the run settles only once
//! every rollout is done, paused with a reason, or aborted.

use bc_agent::journal::{Draft, Stage};
use bc_agent::session::Rng as _;
use bc_core::id::RolloutId;
use bc_core::release::{ReleaseKey, sign};
use bc_core::store::{AppendRequest, ExpectedVersion, NewEvent};
use bc_projections::decide::{self, RolloutCreateInput, RolloutVerb};
use bc_projections::events as ev;
use bc_projections::rollout::{
    AGENT_ROLLBACK, AGENT_UPDATE, BusyNodes, KIND_RELEASE, KIND_ROLLOUT_LIVE, ReleaseArtifact, ReleaseDoc, ReleaseRegistered,
    RolloutDoc, RolloutState,
};
use bc_projections::{KIND_NODE, NodeDoc, stream_of};
use serde_json::json;

use super::{Sim, Task, between};
use crate::world::{Violation, chance, pick, seed_bytes};

/// The gates of the simulated rollouts: short, so a rollout ends within a run's liveness bound.
pub const MIN_READY_S: u64 = 10;
pub const NODE_DEADLINE_S: u64 = 300;
/// The modelled agents' `[update] confirm_within_s`: a new agent that hangs is rolled back then.
pub const CONFIRM_WITHIN_MS: u64 = 120_000;
/// How long a restart (a re-exec, or the watchdog bringing the old agent back) takes at most.
pub const RESTART_MS_MAX: u64 = 10_000;

/// An agent down this long before a command was issued was marked unreachable by then: its
/// lease lapsed, the liveness pass after that said so (a few passes later at worst, when
/// failing commits or a crashed pass cut some short), and the rollouts pass reads it.
pub const DOWN_SEEN_MS: u64 = super::net::SESSION.lease_ms + 5 * super::RECONCILE_EVERY_MS;

/// What an agent's next start says about the update in flight.
#[derive(Clone, Debug)]
pub(super) struct Restart {
    command_id: String,
    /// The version and slot it starts on.
    version: String,
    slot: String,
    /// `None`: the update (or rollback) succeeded; else the command fails with this.
    failure: Option<String>,
    /// It drops off (unhealthy) this long after confirming.
    away_after_ms: Option<u64>,
}

fn other_slot(slot: &str) -> &'static str {
    if slot == "b" { "a" } else { "b" }
}

impl Sim {
    /// The `rollouts` fault on node `a`'s tenant: a new rollout if none is live, else an
    /// operator's verb now and then.
    pub(super) async fn rollout_fault(&mut self, a: usize) {
        let t = self.world.agents[a].tenant;
        let live: Vec<RolloutDoc> =
            self.world.rows::<RolloutDoc>(t, KIND_ROLLOUT_LIVE).await.into_iter().filter(|r| r.state.is_live()).collect();
        if let Some(rollout) = live.first() {
            let roll = self.rng.next_unit();
            let verb = match rollout.state {
                RolloutState::Running if roll < 0.2 => Some(RolloutVerb::Pause),
                RolloutState::Running if roll < 0.3 => Some(RolloutVerb::Abort),
                RolloutState::Paused if roll < 0.6 => Some(RolloutVerb::Resume),
                RolloutState::Paused if roll < 0.8 => Some(RolloutVerb::Abort),
                _ => None,
            };
            if let Some(verb) = verb {
                let append =
                    decide::rollout_verb(rollout, verb, Some(format!("sim operator: {verb:?}"))).expect("a verb allowed now");
                let _ = self.world.log.append(append.into_request(self.world.tenants[t].id, "operator")).await;
            }
            return;
        }
        // A release: signed by the seed's release key, as `releases sign` makes one.
        self.releases += 1;
        let version = format!("{}.0.0", self.releases + 1);
        let key = ReleaseKey::from_seed(seed_bytes(&mut self.rng));
        let manifest = json!({
            "format": bc_core::release::MANIFEST_FORMAT,
            "version": version,
            "keyId": key.key_id(),
            "artifacts": [{ "arch": "x86_64", "url": "https://releases.sim/bcd", "sha256": "0".repeat(64), "size": 1 }],
        })
        .to_string();
        let signature = sign(&key, manifest.as_bytes());
        let tenant = self.world.tenants[t].id;
        let release_id = bc_core::id::ReleaseId::from_ulid(self.world.log.ids.ulid()).to_string();
        let registered = ReleaseRegistered {
            release_version: version.clone(),
            manifest: manifest.clone(),
            signature: signature.trim_end().to_owned(),
            key_id: key.key_id().to_owned(),
            min_update_from: None,
            allow_downgrade: false,
            artifacts: vec![ReleaseArtifact {
                arch: "x86_64".into(),
                url: "https://releases.sim/bcd".into(),
                sha256: "0".repeat(64),
                size: 1,
            }],
        };
        let request = AppendRequest::new(
            tenant,
            stream_of(KIND_RELEASE, &release_id),
            ExpectedVersion::NoStream,
            "operator",
            vec![NewEvent::new(ev::RELEASE_REGISTERED, ev::to_cbor(&registered).expect("encodes"))],
        );
        if self.world.log.append(request).await.is_err() {
            return; // a failing commit: the operator tries at a later fault
        }
        let Some(release) = self.world.doc::<ReleaseDoc>(t, KIND_RELEASE, &release_id).await else { return };
        // The pool of node `a`, every node of it with an agent.
        let nodes: Vec<NodeDoc> = self.world.rows(t, KIND_NODE).await;
        let Some(pool) = nodes.iter().find(|n| n.node_id == self.world.agents[a].node).map(|n| n.pool_id.clone()) else { return };
        let chosen = decide::rollout_nodes(&nodes, Some(&pool), &Default::default());
        let waves: &[&str] = [&["1", "100%"][..], &["1", "50%", "100%"], &["100%"]][pick(&mut self.rng, 3)];
        let input = RolloutCreateInput {
            pool_id: Some(pool),
            selector: None,
            waves: waves.iter().map(|w| (*w).to_owned()).collect(),
            max_unavailable: between(&mut self.rng, 1, 3) as u32,
            min_ready_s: MIN_READY_S,
            node_deadline_s: NODE_DEADLINE_S,
            wave_failures_max: between(&mut self.rng, 0, 2) as u32,
            busy_nodes: if chance(&mut self.rng, 0.7) { BusyNodes::Proceed } else { BusyNodes::Wait },
        };
        let rollout_id = RolloutId::from_ulid(self.world.log.ids.ulid()).to_string();
        let Ok(append) = decide::rollout_create(&rollout_id, &release, chosen, &live, input) else { return };
        if self.world.log.append(append.into_request(tenant, "operator")).await.is_ok() {
            self.out.rollouts += 1;
        }
    }

    /// Node `a`'s agent was handed `agent.update` or `agent.rollback`: journaled as started, the
    /// agent stops (it re-executes), and its next start is scheduled with what it will say.
    /// A command whose stage the journal already has is not run again.
    pub(super) async fn agent_update(&mut self, a: usize, command: &bc_proto::Command) {
        let now = self.agent_now(a);
        let Some(runner) = self.world.agents[a].runner.as_ref() else { return };
        if runner.journal.command_stage(&command.command_id).await.expect("the journal reads").is_some() {
            return;
        }
        let agent = &self.world.agents[a];
        let (version, slot) = (agent.version.clone(), agent.slot.clone());
        let args: serde_json::Value = serde_json::from_str(&command.args_json).unwrap_or_default();
        let restart = if command.kind == AGENT_ROLLBACK {
            let to = args["toVersion"].as_str().unwrap_or_default().to_owned();
            match &agent.previous {
                _ if to == version => {
                    Restart { command_id: command.command_id.clone(), version, slot, failure: None, away_after_ms: None }
                }
                Some((previous, previous_slot)) if *previous == to => Restart {
                    command_id: command.command_id.clone(),
                    version: to,
                    slot: previous_slot.clone(),
                    failure: None,
                    away_after_ms: None,
                },
                _ => Restart {
                    command_id: command.command_id.clone(),
                    version: version.clone(),
                    slot,
                    failure: Some(format!("rollback-unavailable: the previous slot does not hold {to}")),
                    away_after_ms: None,
                },
            }
        } else {
            let manifest: serde_json::Value =
                args["manifest"].as_str().and_then(|m| serde_json::from_str(m).ok()).unwrap_or_default();
            let new = manifest["version"].as_str().unwrap_or_default().to_owned();
            let back = |why: String| Some(format!("rolled-back: the agent {new} {why}; back on slot {slot} (version {version})"));
            let roll = self.rng.next_unit();
            let (to_version, to_slot, failure, away) = if roll < 0.1 {
                (version.clone(), slot.clone(), back("exited at start".into()), None)
            } else if roll < 0.2 {
                (
                    version.clone(),
                    slot.clone(),
                    back(format!("did not confirm health within {} s", CONFIRM_WITHIN_MS / 1000)),
                    None,
                )
            } else if roll < 0.3 {
                (new.clone(), other_slot(&slot).to_owned(), None, Some(between(&mut self.rng, 5_000, 60_000)))
            } else {
                (new.clone(), other_slot(&slot).to_owned(), None, None)
            };
            Restart { command_id: command.command_id.clone(), version: to_version, slot: to_slot, failure, away_after_ms: away }
        };
        let rollout_id = args["rolloutId"].as_str().unwrap_or_default().to_owned();
        let hang = restart.failure.as_deref().is_some_and(|f| f.contains("did not confirm"));
        let payload = json!({ "commandId": command.command_id, "nodeId": self.world.agents[a].node });
        let draft = Draft {
            at_ms: now,
            entry_type: ev::COMMAND_STARTED.into(),
            subject: format!("command/{}", command.command_id),
            payload,
            command: Some((command.command_id.clone(), Stage::Started)),
        };
        let runner = self.world.agents[a].runner.as_ref().expect("running");
        runner.journal.append(&runner.key, draft).await.expect("the journal writes");
        self.out.updates += 1;
        self.agent_stop(a);
        let after = if hang { CONFIRM_WITHIN_MS } else { between(&mut self.rng, 1_000, RESTART_MS_MAX) };
        self.after(after, Task::UpdateRestart(a, Box::new(restart)));
        self.updating.insert(a, (rollout_id.clone(), command.issued_at_ms));
        if let Err(violation) = self.max_unavailable_check(a, &rollout_id, command.issued_at_ms).await {
            self.found.get_or_insert(violation);
        }
    }

    /// Node `a`'s modelled updater has just taken it out for `rollout_id`'s command issued at
    /// `issued_at_ms`: no more of the rollout's nodes may be out than its `maxUnavailable`,
    /// counted from the modelled agents, not from the rollout's document (which the plan under
    /// test writes): the nodes whose updater is in an update or rollback of the rollout (whose
    /// command the plan still waits for: issued within its node deadline), and the nodes whose
    /// agent has been down since long enough before the command was issued that the liveness
    /// pass had marked them unreachable when the plan decided ([`DOWN_SEEN_MS`]). Nodes gone
    /// for good are left out (the plan no longer counts a deleted node).
    async fn max_unavailable_check(&mut self, a: usize, rollout_id: &str, issued_at_ms: u64) -> Result<(), Violation> {
        let t = self.world.agents[a].tenant;
        let rollouts: Vec<RolloutDoc> = self.world.rows(t, KIND_ROLLOUT_LIVE).await;
        let Some(rollout) = rollouts.iter().find(|r| r.rollout_id == rollout_id) else { return Ok(()) };
        if self.options.unsafe_break == Some(super::Break::RolloutAllAtOnce) {
            // TEST ONLY: the release pushed to every running node of the rollout at once.
            for n in &rollout.nodes {
                let Some(b) = self.world.agents.iter().position(|g| g.node == n.node_id) else { continue };
                if b != a && self.net.links[b].machine.is_some() && !self.departed.contains(&b) {
                    self.agent_stop(b);
                    self.updating.insert(b, (rollout_id.to_owned(), self.world.now_ms()));
                    let back = between(&mut self.rng, 1_000, RESTART_MS_MAX);
                    self.after(back, Task::Restart(b));
                }
            }
        }
        let now = self.world.now_ms();
        let deadline_ms = rollout.node_deadline_s * 1000;
        let mut updating = Vec::new();
        let mut down = Vec::new();
        for n in &rollout.nodes {
            let Some(b) = self.world.agents.iter().position(|g| g.node == n.node_id) else { continue };
            if self.departed.contains(&b) {
                continue;
            }
            match self.updating.get(&b) {
                Some((r, issued)) if r == rollout_id && now <= issued.saturating_add(deadline_ms) => {
                    updating.push(n.node_id.as_str())
                }
                _ => {
                    if self.down_since.get(&b).is_some_and(|since| since.saturating_add(DOWN_SEEN_MS) <= issued_at_ms) {
                        down.push(n.node_id.as_str());
                    }
                }
            }
        }
        let out = (updating.len() + down.len()) as u32;
        if out > rollout.max_unavailable {
            return Err(Violation(format!(
                "rollout {rollout_id} has {out} nodes out, over its maxUnavailable {}: updating or rolling back (the modelled updaters) {updating:?}, unreachable {down:?}",
                rollout.max_unavailable
            )));
        }
        Ok(())
    }

    /// Node `a`'s agent starts again after an update: on the version the update left, journaling
    /// its start and its command's end.
    pub(super) async fn update_restart(&mut self, a: usize, restart: Restart) -> Result<(), Violation> {
        if self.departed.contains(&a) {
            return Ok(());
        }
        if self.net.links[a].machine.is_some() {
            // Started meanwhile (the liveness phase starts every agent): this is its re-exec.
            self.agent_stop(a);
        }
        {
            let agent = &mut self.world.agents[a];
            let previous = agent.version.clone();
            if restart.version != agent.version {
                agent.previous = Some((agent.version.clone(), agent.slot.clone()));
            }
            agent.version = restart.version.clone();
            agent.slot = restart.slot.clone();
            agent.start().await;
            let now = self.agent_now(a);
            let agent = &self.world.agents[a];
            let runner = agent.runner.as_ref().expect("started");
            let node = agent.node.clone();
            let started = Draft {
                at_ms: now,
                entry_type: ev::NODE_AGENT_STARTED.into(),
                subject: format!("agent/{node}"),
                payload: json!({ "nodeId": node, "version": restart.version, "slot": restart.slot, "previousVersion": previous }),
                command: None,
            };
            runner.journal.append(&runner.key, started).await.expect("the journal writes");
            let mut payload = json!({ "commandId": restart.command_id, "nodeId": node });
            let entry_type = match &restart.failure {
                None => {
                    payload["result"] = json!({ "version": restart.version, "slot": restart.slot });
                    ev::COMMAND_SUCCEEDED
                }
                Some(reason) => {
                    payload["reason"] = json!(reason);
                    ev::COMMAND_FAILED
                }
            };
            let finished = Draft {
                at_ms: now,
                entry_type: entry_type.into(),
                subject: format!("command/{}", restart.command_id),
                payload,
                command: Some((restart.command_id.clone(), Stage::Finished)),
            };
            runner.journal.append(&runner.key, finished).await.expect("the journal writes");
        }
        self.agent_start(a).await;
        if let Some(away) = restart.away_after_ms {
            self.after(away, Task::UpdateAway(a));
        }
        Ok(())
    }

    /// An unhealthy new agent drops off for up to half an hour: a fault, so not once the faults
    /// have stopped (the liveness phase).
    pub(super) fn update_away(&mut self, a: usize) {
        if self.faults_running && self.net.links[a].machine.is_some() && !self.departed.contains(&a) {
            self.agent_stop(a);
            let back = between(&mut self.rng, 60_000, 1_800_000);
            self.after(back, Task::Restart(a));
        }
    }

    /// Every tenant's live rollouts.
    async fn live_rollouts(&self) -> Vec<RolloutDoc> {
        let mut out = Vec::new();
        for t in 0..self.world.tenants.len() {
            out.extend(self.world.rows::<RolloutDoc>(t, KIND_ROLLOUT_LIVE).await.into_iter().filter(|r| r.state.is_live()));
        }
        out
    }

    /// After a pass: no live rollout has more nodes in flight than its `maxUnavailable`.
    pub(super) async fn rollouts_check(&self) -> Result<(), Violation> {
        for rollout in self.live_rollouts().await {
            let in_flight = rollout.nodes.iter().filter(|n| n.state.in_flight()).count() as u32;
            if in_flight > rollout.max_unavailable {
                return Err(Violation(format!(
                    "rollout {} has {in_flight} nodes updating or rolling back, over its maxUnavailable {}",
                    rollout.rollout_id, rollout.max_unavailable
                )));
            }
        }
        Ok(())
    }

    /// The liveness phase: the operator aborts what still runs (a paused rollout stays paused,
    /// with its reason).
    pub(super) async fn rollouts_abort_running(&mut self) {
        for rollout in self.live_rollouts().await {
            if rollout.state == RolloutState::Running {
                let append = decide::rollout_verb(&rollout, RolloutVerb::Abort, Some("sim: the workload stops".into()))
                    .expect("a running rollout aborts");
                let tenant = rollout.tenant_id.parse().expect("a tenant id");
                self.world.log.append(append.into_request(tenant, "operator")).await.expect("the abort appends");
            }
        }
    }

    /// Every rollout is done, paused with a reason, or aborted.
    pub(super) async fn rollouts_settled(&self) -> Result<(), Violation> {
        for rollout in self.live_rollouts().await {
            if rollout.state == RolloutState::Paused && rollout.reason.is_some() {
                continue;
            }
            return Err(Violation(format!(
                "rollout {} is still {} ({:?})",
                rollout.rollout_id,
                rollout.state.as_str(),
                rollout.counts()
            )));
        }
        Ok(())
    }
}

/// Whether the runner leaves this command to the modelled updater.
pub(super) fn is_update(command: &bc_proto::Command) -> bool {
    command.kind == AGENT_UPDATE || command.kind == AGENT_ROLLBACK
}
