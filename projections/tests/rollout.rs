//! Rollouts' decisions: waves resolved, creation refused where it must be, and the reconciler's
//! plan driven over a model fleet whose agents update well, fail to start (their watchdog puts
//! them back), hang, or come back unhealthy, with operators pausing, resuming and aborting at
//! random. Property: the rollout never has more than `maxUnavailable` of its nodes updating,
//! rolling back or unreachable at once, and every rollout ends done, paused with a reason, or
//! aborted. Seeded: set `BC_TEST_SEED` to replay; the seed is printed when a case fails.

// A test, outside the simulator: the seed may come from the OS.
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;

use bc_core::store::{Projector, RowKey};
use bc_projections::decide::{
    RolloutCreateInput, RolloutVerb, agent_update_issue, resolve_waves, rollout_create, rollout_plan, rollout_verb,
};
use bc_projections::events::{self as ev, CommandIssued};
use bc_projections::rollout::{
    AGENT_ROLLBACK, AGENT_UPDATE, BusyNodes, KIND_ROLLOUT, KIND_ROLLOUT_LIVE, ReleaseDoc, RolloutDoc, RolloutNodeState,
    RolloutState,
};
use bc_projections::{CommandDoc, CommandState, NodeAgent, NodeDoc, NodeState, Projections};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::support;

const TENANT: &str = "ten_01kb0000000000000000000000";
const ROLLOUT: &str = "ro_01kb0000000000000000000000";
const FROM: &str = "1.0.0";
const TO: &str = "1.1.0";

fn node(i: usize) -> NodeDoc {
    NodeDoc {
        tenant_id: TENANT.into(),
        node_id: format!("node_{i:02}"),
        pool_id: "pool_1".into(),
        name: format!("n{i}"),
        gpus: Vec::new(),
        gpu_uuids: Vec::new(),
        labels: BTreeMap::new(),
        state: NodeState::Ready,
        taints: BTreeMap::new(),
        allocations: BTreeMap::new(),
        cordoned: false,
        draining: false,
        agent: Some(NodeAgent {
            reachable: true,
            lease_expires_at_ms: u64::MAX,
            agent_slot: "a".into(),
            ..NodeAgent::joined(String::new(), FROM.into(), format!("n{i}"), "jt_1".into(), 0)
        }),
        version: 1,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

fn release() -> ReleaseDoc {
    ReleaseDoc {
        tenant_id: TENANT.into(),
        release_id: "rel_1".into(),
        release_version: TO.into(),
        key_id: "rk_0000000000000000".into(),
        min_update_from: None,
        allow_downgrade: false,
        artifacts: Vec::new(),
        manifest: "{}".into(),
        signature: "rk_0000000000000000 AAAA".into(),
        version: 1,
        created_at_ms: 0,
    }
}

fn input(waves: &[&str], max_unavailable: u32, wave_failures_max: u32) -> RolloutCreateInput {
    RolloutCreateInput {
        pool_id: Some("pool_1".into()),
        selector: None,
        waves: waves.iter().map(|w| (*w).to_owned()).collect(),
        max_unavailable,
        min_ready_s: 10,
        node_deadline_s: 120,
        wave_failures_max,
        busy_nodes: BusyNodes::Wait,
    }
}

/// The model: the rollout's document folded by the real projection, the nodes, the commands.
struct World {
    rollout: Option<serde_json::Value>,
    /// The rollout's live row, folded from the same events.
    live: Option<serde_json::Value>,
    seq: u64,
    nodes: BTreeMap<String, NodeDoc>,
    commands: BTreeMap<String, CommandDoc>,
    next_command: u64,
    now_ms: u64,
}

impl World {
    fn new(count: usize) -> Self {
        let nodes = (0..count).map(node).map(|n| (n.node_id.clone(), n)).collect();
        Self { rollout: None, live: None, seq: 0, nodes, commands: BTreeMap::new(), next_command: 0, now_ms: 1_000 }
    }

    fn doc(&self) -> RolloutDoc {
        serde_json::from_value(self.rollout.clone().expect("a rollout")).unwrap()
    }

    /// Folds an append's events: the rollout's through the real projection, the commands it
    /// issued into the model's command documents.
    fn apply(&mut self, append: bc_projections::decide::Append) {
        for event in append.events {
            match &event.stream {
                Some(stream) if stream.starts_with("command/") => {
                    assert_eq!(event.event_type, ev::COMMAND_ISSUED);
                    let issued: CommandIssued = serde_json::from_value(bc_core::canonical::to_json(&event.payload)).unwrap();
                    let id = stream.trim_start_matches("command/").to_owned();
                    self.commands.insert(
                        id.clone(),
                        CommandDoc {
                            tenant_id: TENANT.into(),
                            command_id: id,
                            node_id: issued.node_id,
                            kind: issued.kind,
                            args: issued.args,
                            state: CommandState::Issued,
                            reason: None,
                            result: None,
                            issued_by: "test".into(),
                            issued_at_ms: self.now_ms,
                            deadline_at_ms: issued.deadline_at_ms,
                            started_at_ms: None,
                            finished_at_ms: None,
                            journal_seqs: Vec::new(),
                            version: 1,
                            release: None,
                        },
                    );
                }
                _ => {
                    self.seq += 1;
                    let id = ulid::Ulid::from_parts(self.now_ms, u128::from(self.seq as u32));
                    let stored = support::stored(TENANT, format!("{KIND_ROLLOUT}/{ROLLOUT}"), self.seq, id, self.now_ms, &event);
                    let key = RowKey { tenant: TENANT.into(), kind: KIND_ROLLOUT.into(), id: ROLLOUT.into() };
                    self.rollout = Projections.apply(&key, self.rollout.take(), &stored).unwrap();
                    let live = RowKey { tenant: TENANT.into(), kind: KIND_ROLLOUT_LIVE.into(), id: ROLLOUT.into() };
                    self.live = Projections.apply(&live, self.live.take(), &stored).unwrap();
                    let running = self.doc().state.is_live();
                    assert_eq!(self.live.is_some(), running, "the live row is there exactly while the rollout is live");
                    if running {
                        assert_eq!(self.live, self.rollout, "the live row is the document");
                    }
                }
            }
        }
    }

    fn plan(&mut self) -> bc_projections::decide::RolloutPlan {
        let doc = self.doc();
        let mut n = self.next_command;
        let mut ids = || {
            n += 1;
            format!("cmd_{n:04}")
        };
        let plan = rollout_plan(&doc, &release(), &self.nodes, &self.commands, self.now_ms, &mut ids).unwrap();
        self.next_command = n;
        if let Some(append) = plan.append.clone() {
            self.apply(append);
        }
        plan
    }

    /// What the node's agent does with a command: succeed, switching version.
    fn finish(&mut self, command: &str, state: CommandState, reason: Option<&str>) {
        let c = self.commands.get_mut(command).unwrap();
        c.state = state;
        c.reason = reason.map(str::to_owned);
        c.finished_at_ms = Some(self.now_ms);
    }

    fn set_version(&mut self, node: &str, version: &str) {
        let agent = self.nodes.get_mut(node).unwrap().agent.as_mut().unwrap();
        agent.agent_version = version.into();
        agent.agent_started_at_ms = self.now_ms;
    }

    fn set_reachable(&mut self, node: &str, reachable: bool) {
        let doc = self.nodes.get_mut(node).unwrap();
        let agent = doc.agent.as_mut().unwrap();
        if reachable && !agent.reachable {
            agent.ready_since_ms = self.now_ms;
        }
        agent.reachable = reachable;
        doc.state = if reachable { NodeState::Ready } else { NodeState::Unreachable };
    }

    /// The rollout's nodes updating, rolling back or unreachable.
    fn out(&self) -> u32 {
        let doc = self.doc();
        doc.nodes.iter().filter(|n| n.state.in_flight() || !self.nodes[&n.node_id].agent.as_ref().unwrap().reachable).count()
            as u32
    }
}

#[test]
fn waves_resolve_to_cumulative_counts() {
    let specs = |s: &[&str]| s.iter().map(|w| (*w).to_owned()).collect::<Vec<_>>();
    let counts = |s: &[&str], total| resolve_waves(&specs(s), total).unwrap().iter().map(|w| w.up_to).collect::<Vec<_>>();
    assert_eq!(counts(&["1", "5%", "25%", "100%"], 100), vec![1, 5, 25, 100]);
    // 5 % of 3 nodes is 1, the canary's: merged.
    assert_eq!(counts(&["1", "5%", "25%", "100%"], 3), vec![1, 3]);
    assert_eq!(counts(&["50%", "100%"], 3), vec![2, 3]);
    assert_eq!(counts(&["10", "100%"], 4), vec![4]);
    for bad in [&["1"][..], &["0", "100%"], &["50%", "1"], &["101%"], &["x"], &["1.5"], &[]] {
        assert!(resolve_waves(&specs(bad), 4).is_err(), "{bad:?} should be refused");
    }
}

#[test]
fn creation_refuses_overlap_downgrades_and_empty_sets() {
    let nodes: Vec<NodeDoc> = (0..3).map(node).collect();
    let refs: Vec<&NodeDoc> = nodes.iter().collect();
    assert!(rollout_create(ROLLOUT, &release(), Vec::new(), &[], input(&["100%"], 1, 0)).is_err());
    let mut world = World::new(3);
    world.apply(rollout_create(ROLLOUT, &release(), refs.clone(), &[], input(&["1", "100%"], 1, 0)).unwrap());
    let live = world.doc();
    let overlap = rollout_create("ro_2", &release(), refs.clone(), &[live], input(&["100%"], 1, 0)).unwrap_err();
    assert_eq!(overlap.code(), bc_core::ErrorCode::Conflict, "{overlap}");
    let mut newer = node(9);
    newer.agent.as_mut().unwrap().agent_version = "2.0.0".into();
    let downgrade = rollout_create("ro_3", &release(), vec![&newer], &[], input(&["100%"], 1, 0)).unwrap_err();
    assert!(downgrade.to_string().contains("does not allow downgrades"), "{downgrade}");
    let mut allowing = release();
    allowing.allow_downgrade = true;
    assert!(rollout_create("ro_3", &allowing, vec![&newer], &[], input(&["100%"], 1, 0)).is_ok());
}

/// A signed release of `version` by `key`, as `releases sign` writes it: (manifest, signature).
fn signed(key: &bc_core::release::ReleaseKey, version: &str, downgrade_until: Option<&str>) -> (String, String) {
    use bc_core::release::{Artifact, MANIFEST_FORMAT, Manifest};
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: version.into(),
        min_update_from: None,
        allow_downgrade: downgrade_until.is_some(),
        not_after: downgrade_until.map(str::to_owned),
        key_id: key.key_id().into(),
        artifacts: vec![Artifact {
            arch: "x86_64".into(),
            url: "http://127.0.0.1:1/bcd".into(),
            sha256: "ab".repeat(32),
            size: 10,
        }],
    }
    .to_text();
    let signature = bc_core::release::sign(key, manifest.as_bytes());
    (manifest, signature)
}

/// Regression: `commands.issue` of `agent.update` sent any manifest, so a key with
/// `commands:write` alone could send a node what `releases.register` refuses.
#[test]
fn agent_update_is_issued_only_for_a_registered_release_the_control_plane_trusts() {
    use bc_core::release::ReleaseKey;
    // 2026-05-01T00:00:00Z.
    let now_ms = 1_777_593_600_000;
    let (trusted_key, untrusted_key) = (ReleaseKey::from_seed([1; 32]), ReleaseKey::from_seed([2; 32]));
    let trusted = [trusted_key.public().clone()];
    let (manifest, signature) = signed(&trusted_key, TO, None);
    let registered = ReleaseDoc { manifest: manifest.clone(), signature: signature.trim_end().to_owned(), ..release() };
    let releases = [registered.clone()];

    let issued = agent_update_issue(&trusted, &releases, &manifest, &signature, now_ms).unwrap();
    assert_eq!(issued.release_id, registered.release_id);

    let code = |e: bc_core::Error| (e.code(), e.to_string().split(':').next().unwrap_or_default().to_owned());
    // Signed by a key the control plane does not trust, allowing a downgrade to 0.0.1: what
    // releases.register refuses, refused here with the same code.
    let (evil, evil_signature) = signed(&untrusted_key, "0.0.1", Some("2026-05-08T00:00:00Z"));
    let refused = agent_update_issue(&trusted, &releases, &evil, &evil_signature, now_ms).unwrap_err();
    assert_eq!(code(refused), (bc_core::ErrorCode::AccessDenied, "release-untrusted-key".into()));
    assert_eq!(
        agent_update_issue(&[], &releases, &manifest, &signature, now_ms).unwrap_err().code(),
        bc_core::ErrorCode::AccessDenied
    );
    // Signed by a trusted key but never registered.
    let (unregistered, unregistered_signature) = signed(&trusted_key, "0.0.1", Some("2026-05-08T00:00:00Z"));
    let refused = agent_update_issue(&trusted, &releases, &unregistered, &unregistered_signature, now_ms).unwrap_err();
    assert_eq!(code(refused), (bc_core::ErrorCode::InvalidState, "release-unregistered".into()));
    // The registered version, another text.
    let (other_text, other_signature) = signed(&trusted_key, TO, Some("2026-05-08T00:00:00Z"));
    let refused = agent_update_issue(&trusted, &releases, &other_text, &other_signature, now_ms).unwrap_err();
    assert!(refused.to_string().starts_with("release-unregistered: ") && refused.to_string().contains("rel_1"), "{refused}");
    // Registered, but its downgrade permission has expired.
    let downgrade = ReleaseDoc { manifest: unregistered.clone(), ..release() };
    let week_ms = 7 * 24 * 3600 * 1000;
    assert!(
        agent_update_issue(&trusted, std::slice::from_ref(&downgrade), &unregistered, &unregistered_signature, now_ms).is_ok()
    );
    let expired =
        agent_update_issue(&trusted, &[downgrade], &unregistered, &unregistered_signature, now_ms + week_ms).unwrap_err();
    assert_eq!(code(expired), (bc_core::ErrorCode::InvalidArgument, "release-expired".into()));
}

#[test]
fn a_canary_then_the_rest_each_past_its_gate() {
    let mut world = World::new(3);
    let nodes: Vec<NodeDoc> = world.nodes.values().cloned().collect();
    world.apply(rollout_create(ROLLOUT, &release(), nodes.iter().collect(), &[], input(&["1", "100%"], 2, 0)).unwrap());
    let plan = world.plan();
    assert_eq!(plan.did.len(), 1, "only the canary goes first: {:?}", plan.did);
    let canary = world.doc().nodes[0].clone();
    assert_eq!(canary.state, RolloutNodeState::Updating);
    let command = canary.command_id.clone().unwrap();
    assert_eq!(world.commands[&command].kind, AGENT_UPDATE);
    // The node updates; the gate waits for minReadyS.
    world.now_ms += 1_000;
    world.set_version(&canary.node_id, TO);
    world.finish(&command, CommandState::Succeeded, None);
    assert!(world.plan().append.is_none(), "not ready for 10 s yet");
    world.now_ms += 10_000;
    world.plan();
    let doc = world.doc();
    assert_eq!(doc.nodes[0].state, RolloutNodeState::Updated);
    assert_eq!((doc.wave, doc.waves[0].state.as_str()), (1, "passed"));
    // The second wave: two at once (maxUnavailable 2).
    world.plan();
    let doc = world.doc();
    assert_eq!(doc.nodes.iter().filter(|n| n.state == RolloutNodeState::Updating).count(), 2);
    for n in doc.nodes.iter().filter(|n| n.state == RolloutNodeState::Updating) {
        world.set_version(&n.node_id, TO);
        world.finish(n.command_id.as_ref().unwrap(), CommandState::Succeeded, None);
    }
    world.now_ms += 11_000;
    world.plan();
    assert_eq!(world.doc().state, RolloutState::Done);
}

#[test]
fn a_failed_canary_pauses_with_its_reason_and_abort_rolls_back() {
    let mut world = World::new(3);
    let nodes: Vec<NodeDoc> = world.nodes.values().cloned().collect();
    world.apply(rollout_create(ROLLOUT, &release(), nodes.iter().collect(), &[], input(&["1", "100%"], 1, 0)).unwrap());
    world.plan();
    let canary = world.doc().nodes[0].clone();
    world.now_ms += 30_000;
    world.finish(canary.command_id.as_ref().unwrap(), CommandState::Failed, Some("rolled-back: the agent 1.1.0 did not confirm"));
    world.plan();
    let doc = world.doc();
    assert_eq!(doc.state, RolloutState::Paused);
    let reason = doc.reason.clone().unwrap();
    assert!(reason.contains("wave 1") && reason.contains("rolled-back"), "{reason}");
    // The other nodes were never sent anything.
    assert!(doc.nodes[1..].iter().all(|n| n.state == RolloutNodeState::Pending && n.command_id.is_none()));
    assert_eq!(world.commands.len(), 1);
    // Paused: nothing moves.
    world.now_ms += 60_000;
    assert!(world.plan().append.is_none());
    // Resume accepts the failure; the next wave goes.
    let resumed = rollout_verb(&doc, RolloutVerb::Resume, None).unwrap();
    world.apply(resumed);
    world.plan();
    world.plan();
    let doc = world.doc();
    assert_eq!(doc.wave, 1, "the first wave passed with its failure accepted");
    let second = doc.nodes.iter().find(|n| n.state == RolloutNodeState::Updating).unwrap().clone();
    world.set_version(&second.node_id, TO);
    world.finish(second.command_id.as_ref().unwrap(), CommandState::Succeeded, None);
    world.now_ms += 11_000;
    world.plan();
    // Abort: the node still updating finishes first (maxUnavailable 1 holds during an abort
    // too); then the updated nodes go back one at a time; the failed canary is on its old
    // version already.
    world.apply(rollout_verb(&world.doc(), RolloutVerb::Abort, Some("bad release".into())).unwrap());
    let third = world.doc().nodes.iter().find(|n| n.state == RolloutNodeState::Updating).unwrap().clone();
    assert!(world.plan().append.is_none(), "nothing rolls back while a node is out");
    world.set_version(&third.node_id, TO);
    world.finish(third.command_id.as_ref().unwrap(), CommandState::Succeeded, None);
    world.now_ms += 11_000;
    let mut rolled = Vec::new();
    for _ in 0..2 {
        world.plan();
        let doc = world.doc();
        let back: Vec<_> = doc.nodes.iter().filter(|n| n.state == RolloutNodeState::RollingBack).cloned().collect();
        assert_eq!(back.len(), 1, "one at a time: {:?}", doc.counts());
        let rollback = back[0].command_id.clone().unwrap();
        assert_eq!(world.commands[&rollback].kind, AGENT_ROLLBACK);
        assert_eq!(world.commands[&rollback].args["toVersion"], FROM);
        world.set_version(&back[0].node_id, FROM);
        world.finish(&rollback, CommandState::Succeeded, None);
        world.now_ms += 11_000;
        rolled.push(back[0].node_id.clone());
    }
    rolled.sort();
    assert_eq!(rolled, vec![second.node_id.clone(), third.node_id.clone()]);
    world.plan();
    let doc = world.doc();
    assert_eq!(doc.state, RolloutState::Aborted);
    assert_eq!(doc.reason.as_deref(), Some("bad release"));
}

#[test]
fn a_busy_node_waits_and_says_so() {
    let mut world = World::new(1);
    world.nodes.get_mut("node_00").unwrap().allocations.insert(0, "rsv_1".into());
    let nodes: Vec<NodeDoc> = world.nodes.values().cloned().collect();
    world.apply(rollout_create(ROLLOUT, &release(), nodes.iter().collect(), &[], input(&["100%"], 1, 0)).unwrap());
    let plan = world.plan();
    assert!(plan.append.is_none());
    assert!(plan.waiting[0].contains("live reservations"), "{:?}", plan.waiting);
    world.nodes.get_mut("node_00").unwrap().allocations.clear();
    let plan = world.plan();
    let append = plan.append.expect("the node is free now");
    let _ = append;
    assert_eq!(world.doc().nodes[0].state, RolloutNodeState::Updating);
}

/// How a model agent takes an update.
#[derive(Clone, Copy, Debug)]
enum Behaviour {
    Good,
    /// The new agent exits at start; the watchdog puts the old one back and the command fails.
    FailsToStart,
    /// Nothing comes back: the rollout's deadline fails it.
    Hangs,
    /// The new agent runs and confirms, then the node drops off (unreachable) for good.
    Unhealthy,
}

#[test]
fn property_max_unavailable_holds_and_every_rollout_ends_with_a_reason() {
    let seed = bc_core::testing::seed();
    let mut endings: BTreeMap<&'static str, u32> = BTreeMap::new();
    for case in 0..200u64 {
        let case_seed = seed.wrapping_add(case);
        match std::panic::catch_unwind(|| run_case(case_seed)) {
            Ok(state) => *endings.entry(state.as_str()).or_insert(0) += 1,
            Err(e) => {
                panic!("rollout property failed; replay with BC_TEST_SEED={seed} (case {case}, case seed {case_seed}): {e:?}")
            }
        }
    }
    // The cases reach every ending, or the property tested little.
    for ending in ["done", "paused", "aborted"] {
        assert!(endings.get(ending).copied().unwrap_or(0) >= 5, "seed {seed}: endings {endings:?}");
    }
}

fn run_case(case_seed: u64) -> RolloutState {
    let mut rng = StdRng::seed_from_u64(case_seed);
    let count = rng.random_range(1..=12);
    let mut world = World::new(count);
    let max_unavailable = rng.random_range(1..=3);
    let wave_failures_max = rng.random_range(0..=1);
    let waves: &[&str] = [&["1", "100%"][..], &["1", "25%", "100%"], &["50%", "100%"], &["100%"]][rng.random_range(0..4)];
    let nodes: Vec<NodeDoc> = world.nodes.values().cloned().collect();
    world.apply(
        rollout_create(ROLLOUT, &release(), nodes.iter().collect(), &[], input(waves, max_unavailable, wave_failures_max))
            .unwrap(),
    );
    // Each node's behaviour, and when its agent answers (ms after the command).
    let behaviours: BTreeMap<String, (Behaviour, u64)> = world
        .nodes
        .keys()
        .map(|id| {
            let b = match rng.random_range(0..10) {
                0 => Behaviour::FailsToStart,
                1 => Behaviour::Hangs,
                2 => Behaviour::Unhealthy,
                _ => Behaviour::Good,
            };
            (id.clone(), (b, rng.random_range(1_000..60_000)))
        })
        .collect();
    // Some cases have no operator: a rollout the gate pauses stays paused.
    let operator = rng.random_bool(0.6);
    for step in 0..5_000 {
        world.now_ms += rng.random_range(500..8_000);
        // The agents answer their commands when due.
        let due: Vec<(String, CommandDoc)> = world
            .commands
            .iter()
            .filter(|(_, c)| matches!(c.state, CommandState::Issued | CommandState::Started))
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect();
        for (id, c) in due {
            let (behaviour, delay) = behaviours[&c.node_id];
            if world.now_ms < c.issued_at_ms + delay {
                continue;
            }
            if c.kind == AGENT_ROLLBACK {
                let to = c.args["toVersion"].as_str().unwrap().to_owned();
                world.set_version(&c.node_id, &to);
                world.set_reachable(&c.node_id, true);
                world.finish(&id, CommandState::Succeeded, None);
                continue;
            }
            match behaviour {
                Behaviour::Good => {
                    world.set_version(&c.node_id, TO);
                    world.finish(&id, CommandState::Succeeded, None);
                }
                Behaviour::FailsToStart => world.finish(&id, CommandState::Failed, Some("rolled-back: exited at start")),
                Behaviour::Hangs => {}
                Behaviour::Unhealthy => {
                    world.set_version(&c.node_id, TO);
                    world.finish(&id, CommandState::Succeeded, None);
                    world.set_reachable(&c.node_id, false);
                }
            }
        }
        // Operators, now and then.
        let doc = world.doc();
        let roll = rng.random_range(0..100);
        let verb = match (doc.state, if operator { roll } else { 100 }) {
            (RolloutState::Running, 0) => Some(RolloutVerb::Pause),
            (RolloutState::Running | RolloutState::Paused, 1) => Some(RolloutVerb::Abort),
            (RolloutState::Paused, 2..=20) => Some(RolloutVerb::Resume),
            _ => None,
        };
        if let Some(verb) = verb {
            world.apply(rollout_verb(&doc, verb, Some(format!("operator {verb:?} at step {step}"))).unwrap());
        }
        let plan = world.plan();
        let out = world.out();
        assert!(
            out <= max_unavailable,
            "step {step}: {out} nodes out, over maxUnavailable {max_unavailable}; plan {:?}",
            plan.did
        );
        let doc = world.doc();
        if !doc.state.is_live() || (doc.state == RolloutState::Paused && (!operator || step > 4_000)) {
            break;
        }
    }
    let doc = world.doc();
    match doc.state {
        RolloutState::Done => {
            assert!(doc.nodes.iter().all(|n| matches!(n.state, RolloutNodeState::Updated | RolloutNodeState::Failed)));
        }
        RolloutState::Paused => assert!(doc.reason.is_some(), "paused without a reason"),
        RolloutState::Aborted => {
            assert!(doc.nodes.iter().all(|n| !n.state.in_flight()), "aborted with commands in flight");
        }
        other => panic!("the rollout is stuck {}: {:?} waiting {:?}", other.as_str(), doc.counts(), world.plan().waiting),
    }
    doc.state
}
