//! Property: random reservations, releases, reconciler passes and liveness sweeps, failed holds,
//! unanswered holds, releases the machine refuses, agents away or with skewed clocks (±30 s), agents that crash before their journal reaches the
//! log, and commands delivered twice never leave one GPU held for two reservations, on the
//! control plane or on an agent; and once the faults stop, every active reservation settles
//! `bound` and every agent holds exactly what the control plane says it does (none leaked).
//!
//! It drives the real pieces through the simulator's one world (`bc_simulator::world`, which
//! `sim run` drives too): the decisions (`decide::reservation_release`, the reservations
//! reconciler's `pass`, which places, requeues and fails), the real fold on SQLite, and each
//! agent's real `Runner` (its journal, its ledger in `holds.json`, `decide_hold`) over a machine
//! whose binding the test can make refuse holds or releases. What it leaves out is the
//! transport: each journal entry is appended as the gateway's session appends it (checked
//! against the node's signature, on its subject's stream, exactly once by its idempotency key,
//! with the entry under `journal`), which the end-to-end tests cover over gRPC. Seeded:
//! `BC_PROPERTY_SEED` runs one case, `BC_PROPERTY_CASES` sets how many (default 12); a failure
//! prints its seed.

use bc_agent::machine::SeededRng;
use bc_core::clock::Clock;
use bc_projections::{KIND_RESERVATION, ReservationDoc, ReservationState};
use bc_simulator::world::{Shape, World, chance, pick};

const NODES: usize = 3;
const STEPS: usize = 150;
const CASES_DEFAULT: u64 = 12;

async fn check(w: &World, seed: u64, step: usize) {
    if let Err(violation) = w.check().await {
        panic!("seed {seed} step {step}: {violation}");
    }
}

async fn case(seed: u64) {
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
                }
            }
            9 => {
                let m = &w.agents[pick(&mut rng, NODES)].machine;
                m.set_refuse_holds(!m.refuses_holds());
            }
            _ => {
                let m = &w.agents[pick(&mut rng, NODES)].machine;
                m.set_refuse_releases(!m.refuses_releases());
            }
        }
        check(&w, seed, step).await;
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
    if let Err(violation) = w.settled().await {
        panic!("seed {seed}: not settled (none leaked, every active one bound): {violation}");
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
}

#[tokio::test]
async fn no_gpu_is_ever_held_for_two_reservations_and_holds_settle() {
    let seeds: Vec<u64> = match std::env::var("BC_PROPERTY_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(seed) => vec![seed],
        None => {
            let cases = std::env::var("BC_PROPERTY_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(CASES_DEFAULT);
            let base = bc_tests::now_ms();
            (0..cases).map(|i| base.wrapping_add(i)).collect()
        }
    };
    for seed in seeds {
        eprintln!("holds property: seed {seed} (BC_PROPERTY_SEED={seed} repeats it)");
        case(seed).await;
    }
}
