//! Property: random reservations, releases, reconciler passes and liveness sweeps, failed holds,
//! unanswered holds, releases the machine refuses, agents away or with skewed clocks (±30 s), agents that crash before their journal reaches the
//! log, and commands delivered twice never leave one GPU held for two reservations, on the
//! control plane or on an agent; and once the faults stop, every active reservation settles
//! `bound` and every agent holds exactly what the control plane says it does (none leaked);
//! and the rows agree with the oracle (`bc_simulator::oracle`), a model of the same events
//! written apart from the fold.
//!
//! It drives the real pieces through the simulator's one world (`bc_simulator::world`, which
//! `sim run` drives too): the decisions (`decide::reservation_release`, the reservations
//! reconciler's `pass`, which places, requeues and fails), the real fold on SQLite, and each
//! agent's real `Runner` (its journal, its ledger in `holds.json`, `decide_hold`) over a machine
//! whose binding the test can make refuse holds or releases. What it leaves out is the
//! transport: each journal entry is appended as the gateway's session appends it (checked
//! against the node's signature, on its subject's stream, exactly once by its idempotency key,
//! with the entry under `journal`), which the end-to-end tests cover over gRPC.
//!
//! Seeded: case `i` runs from `BC_TEST_SEED + i` (`bc_core::testing::seed`, a fixed seed when
//! unset), `BC_PROPERTY_CASES` cases (default 12); a failure prints the case's seed, and
//! `BC_TEST_SEED=<it> BC_PROPERTY_CASES=1` runs that case alone. The run then asserts that the
//! cases reached, between them, what the property is about ([`OUTCOMES`]: holds refused,
//! requeues after a failed and after an unanswered hold, reservations failed after their last
//! hold, commands delivered twice, crashes before the journal reached the log), or it tested
//! little: it passed before if no hold ever failed.

use std::collections::BTreeMap;

use bc_agent::session::SeededRng;
use bc_core::clock::Clock;
use bc_projections::events::{self as ev, ReservationRequeued};
use bc_projections::{KIND_RESERVATION, ReservationDoc, ReservationState};
use bc_simulator::world::{Shape, World, chance, pick};

const NODES: usize = 3;
const STEPS: usize = 150;
const CASES_DEFAULT: u64 = 12;

/// What the cases must reach between them (each at least [`OUTCOME_MIN`] times), or the
/// property tested little.
const OUTCOMES: [&str; 9] = [
    "a hold refused by its node",
    "a reservation requeued after a failed hold",
    "a reservation requeued after an unanswered hold",
    "a reservation failed after its last hold",
    "a reservation released",
    "a reservation expired",
    "a command delivered twice",
    "an agent crashed before its journal reached the log",
    "an agent away, then back",
];
const OUTCOME_MIN: u32 = 3;

/// Counts of what a case reached, by outcome.
type Reached = BTreeMap<&'static str, u32>;

async fn check(w: &World, seed: u64, step: usize) {
    if let Err(violation) = w.check().await {
        panic!("seed {seed} step {step}: {violation}");
    }
}

/// The simulator's full checks on the same event sequence: the chains, the rows against a fold
/// of the log and against the oracle (`bc_simulator::oracle`, a model of GPUs held per node and
/// reservations per state written apart from the fold), the journals.
async fn full_check(w: &World, seed: u64, step: usize) {
    if let Err(violation) = bc_simulator::run::full_check(w, false).await {
        panic!("seed {seed} step {step}: {violation}");
    }
}

async fn case(seed: u64) -> Reached {
    let mut reached = Reached::new();
    let mut reach = |outcome: &'static str| *reached.entry(outcome).or_default() += 1;
    let mut rng = SeededRng(seed);
    let shape = Shape { tenants: 1, nodes: NODES, gpus_min: 2, gpus_max: 4 };
    let mut w = World::new(seed, &mut rng, shape).await;
    for agent in &mut w.agents {
        agent.skew_ms = pick(&mut rng, 60_001) as i64 - 30_000;
    }
    for step in 0..STEPS {
        match pick(&mut rng, 11) {
            0 | 1 => {
                let (gpus, duration_s) = (1 + pick(&mut rng, 2) as u32, 60 + 60 * pick(&mut rng, 10) as u64);
                w.request(0, gpus, duration_s).await;
            }
            2 => {
                w.release(0, &mut rng).await;
            }
            3 | 4 => {
                w.pass().await;
            }
            5 | 6 => {
                let a = pick(&mut rng, NODES);
                let crash = chance(&mut rng, 0.15);
                // A command this node ran delivered again (the gateway sends a node only its own).
                let ran = &w.agents[a].ran;
                let again = (chance(&mut rng, 0.2) && !ran.is_empty()).then(|| ran[pick(&mut rng, ran.len())].clone());
                if again.is_some() {
                    reach("a command delivered twice");
                }
                if crash && w.agents[a].runner.is_some() && !w.pending(a).await.is_empty() {
                    reach("an agent crashed before its journal reached the log");
                }
                w.answer(a, crash, again, false, false).await;
            }
            7 => {
                // Time passes: sometimes past holds' deadlines and reservations' ends.
                let by = if chance(&mut rng, 0.3) { bc_projections::HOLD_DEADLINE_S * 1000 + 1 } else { 5_000 };
                w.clock.set_ms(w.clock.now_ms() + by);
            }
            8 => {
                // An agent goes away (or crashes), or comes back and its journal catches up.
                let a = pick(&mut rng, NODES);
                if w.agents[a].runner.is_some() {
                    w.agents[a].runner = None;
                } else {
                    w.agents[a].start().await;
                    w.deliver(a, false).await;
                    reach("an agent away, then back");
                }
            }
            9 => {
                let m = &w.agents[pick(&mut rng, NODES)].machine;
                // Biased towards refusing (about two thirds of the time once touched): failed
                // holds, their requeues and reservations that fail after their last hold are
                // what this property is about.
                m.set_refuse_holds(!m.refuses_holds() || chance(&mut rng, 0.5));
            }
            _ => {
                let m = &w.agents[pick(&mut rng, NODES)].machine;
                m.set_refuse_releases(!m.refuses_releases());
            }
        }
        check(&w, seed, step).await;
        if step % 50 == 49 {
            full_check(&w, seed, step).await;
        }
    }
    // Faults stop: every agent runs and binds; within a bounded number of rounds every active
    // reservation is bound and every agent holds exactly the bound ones.
    for a in 0..NODES {
        let m = &w.agents[a].machine;
        m.set_refuse_holds(false);
        m.set_refuse_releases(false);
        if w.agents[a].runner.is_none() {
            w.agents[a].start().await;
        }
        w.deliver(a, false).await;
    }
    for _ in 0..20 {
        w.pass().await;
        for a in 0..NODES {
            w.answer(a, false, None, false, false).await;
        }
    }
    check(&w, seed, STEPS).await;
    full_check(&w, seed, STEPS).await;
    if let Err(violation) = w.settled().await {
        panic!("seed {seed}: not settled (none leaked, every active one bound): {violation}");
    }
    // What the log says happened.
    let tenant = w.tenants[0].id;
    let mut from = 1;
    loop {
        let rows = w.store.read_chain_rows(tenant, from, 1000).await.expect("the log reads");
        let Some(last) = rows.last() else { break };
        from = last.seq + 1;
        for row in rows {
            let event = row.decode().expect("an event decodes");
            match event.envelope.event_type.as_str() {
                ev::GPU_HOLD_FAILED => reach("a hold refused by its node"),
                ev::RESERVATION_RELEASED => reach("a reservation released"),
                ev::RESERVATION_EXPIRED => reach("a reservation expired"),
                ev::RESERVATION_FAILED => reach("a reservation failed after its last hold"),
                ev::RESERVATION_REQUEUED => {
                    let p: ReservationRequeued =
                        serde_json::from_value(bc_core::canonical::to_json(&event.envelope.payload)).expect("a requeue decodes");
                    // Requeued either way with a release sent (a node that refused may yet hold
                    // them); the reason says which (`decide::plan`).
                    reach(if p.reason.starts_with("hold-timeout") {
                        "a reservation requeued after an unanswered hold"
                    } else {
                        "a reservation requeued after a failed hold"
                    });
                }
                _ => {}
            }
        }
    }
    let all: Vec<ReservationDoc> = w.rows(0, KIND_RESERVATION).await;
    let count = |state: ReservationState| all.iter().filter(|r| r.state == state).count();
    let retried: u32 = all.iter().map(|r| r.hold_attempts).sum();
    eprintln!(
        "seed {seed}: {} reservations: {} active, {} queued, {} released, {} expired, {} failed; {retried} failed holds",
        all.len(),
        count(ReservationState::Active),
        count(ReservationState::Queued),
        count(ReservationState::Released),
        count(ReservationState::Expired),
        count(ReservationState::Failed),
    );
    reached
}

#[tokio::test]
async fn no_gpu_is_ever_held_for_two_reservations_and_holds_settle() {
    let seed = bc_core::testing::seed();
    let cases = std::env::var("BC_PROPERTY_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(CASES_DEFAULT);
    let mut reached = Reached::new();
    for i in 0..cases {
        let case_seed = seed.wrapping_add(i);
        eprintln!("holds property: seed {case_seed} (BC_TEST_SEED={case_seed} BC_PROPERTY_CASES=1 repeats it)");
        for (outcome, n) in case(case_seed).await {
            *reached.entry(outcome).or_default() += n;
        }
    }
    eprintln!("holds property: BC_TEST_SEED={seed}, {cases} cases reached {reached:?}");
    if cases >= CASES_DEFAULT {
        for outcome in OUTCOMES {
            assert!(
                reached.get(outcome).copied().unwrap_or(0) >= OUTCOME_MIN,
                "BC_TEST_SEED={seed}: {cases} cases reached {outcome:?} fewer than {OUTCOME_MIN} times: the property tested little; reached {reached:?}"
            );
        }
    }
}
