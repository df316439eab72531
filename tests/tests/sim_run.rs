//! `better-compute sim run`, from outside: the same seed in two processes gives the same digest
//! byte for byte and another seed another; the checker finds the double booking a test-only
//! switch lets in (the node guard of placements decided on a stale view dropped, and the GPUs
//! freed in the node's row behind the fold's back, so the fold takes them: the checker's own
//! message, not the fold's refusal) and prints the command that repeats it, which does; each
//! `--unsafe-break` is found by the one check it is there for (a wrong fold by the oracle, a
//! rollout past its `maxUnavailable` by the modelled updaters, a leaked hold by the liveness
//! bound, a bad proof by the sessions' check, a bare-metal deploy past its bound by the metal
//! check at its step); likewise the duplicate journal entry another
//! switch lets in (entries appended without their idempotency key while acknowledgements get
//! lost, the node's journal head rewound behind the fold's back), found by the journal check;
//! 24 seeds with every fault hold their invariants and settle (`make sim SEEDS=N` runs more); and so
//! do the seeds that once failed at 50 nodes, one at 500 nodes, and one at 300 nodes and 100 a
//! tenant (`make sim-large` runs 1,000).

use std::thread;

use bc_tests::{cli, json, small_sim_run};

/// The seeds the many-seeds test runs (`BC_SIM_SEEDS` sets another count), two at a time, each
/// 50 nodes, 5 tenants, one simulated hour (about 4 s of one core a seed in the test build,
/// whose crates the simulator runs are built at `opt-level = 1`: see the workspace's
/// `Cargo.toml`). 24, not 64 nor 32: with 64 this test took 432 s of a 661 s suite on 2 cores
/// and the clean-clone `make test` ran 26 min, past the bar of well under 20; with 32 (and
/// `failover` among the faults, and a seed costing more as the product grew) it took 283 s of a
/// 659 s suite, and the clean-clone run 26.5 min (2026-12-07). The suite is bound by its CPU.
/// 32 seeds of every fault at 50 nodes passed by hand the day failover joined `all`; deeper runs
/// are `make sim SEEDS=200` (a release build) and `make sim-large`.
const SEEDS_DEFAULT: u64 = 24;
/// The unsafe switch must be caught within this many seeds.
const UNSAFE_SEEDS_MAX: u64 = 3;

fn sim(args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["sim", "run"];
    all.extend_from_slice(args);
    cli(&all, &[])
}

fn digest_of(seed: &str) -> String {
    let (status, out, err) = sim(&["--seed", seed, "--nodes", "20", "--tenants", "3", "--hours", "1", "--json"]);
    assert_eq!(status, 0, "seed {seed} failed:\n{out}\n{err}");
    let value = json(&out);
    assert_eq!(value["ok"], true, "{value}");
    assert_eq!(value["heads"].as_array().map(Vec::len), Some(3), "{value}");
    value["digest"].as_str().expect("a digest").to_owned()
}

/// The command a failed run prints to repeat it.
fn printed_command(err: &str) -> String {
    err.lines().find_map(|l| l.strip_prefix("hint: repeat it with: ")).expect("the command is printed").to_owned()
}

/// Runs the printed command `args` (`better-compute` first) and asserts it fails as `err` did.
fn it_repeats(args: &[&str], err: &str) {
    let (status, _, again) = cli(&args[1..], &[]);
    assert_eq!(status, 1);
    let what = |e: &str| e.lines().find(|l| l.starts_with("SIM_INVARIANT_BROKEN")).map(str::to_owned);
    assert_eq!(what(&again), what(err), "the command repeats the same failure");
}

#[test]
fn the_same_seed_gives_the_same_digest_in_two_processes_and_another_seed_another() {
    // Two processes at once, then the other seed.
    let first = thread::spawn(|| digest_of("7"));
    let second = thread::spawn(|| digest_of("7"));
    let (first, second) = (first.join().unwrap(), second.join().unwrap());
    assert_eq!(first, second, "seed 7 gave two digests");
    assert_eq!(first.len(), 64);
    let other = digest_of("8");
    assert_ne!(first, other, "seeds 7 and 8 gave the same digest");
}

/// Seen failing with the checker's double-booking verdict dropped: the run then failed on the
/// node's row giving the GPU to the other reservation, not on "double booking".
#[test]
fn without_the_placement_guard_the_checker_finds_a_double_booking_and_its_command_repeats_it() {
    let mut found = None;
    for seed in 1..=UNSAFE_SEEDS_MAX {
        let seed = seed.to_string();
        let mut args = small_sim_run(&seed);
        args.push("--unsafe-no-placement-guard");
        let (status, out, err) = sim(&args);
        if status == 0 {
            continue;
        }
        assert_eq!(status, 1, "{out}\n{err}");
        assert!(err.contains("SIM_INVARIANT_BROKEN"), "{err}");
        assert!(err.contains(&format!("seed {seed}")), "the seed is printed: {err}");
        found = Some((seed, out, err));
        break;
    }
    let (seed, out, err) = found.unwrap_or_else(|| panic!("no double booking found within {UNSAFE_SEEDS_MAX} seeds"));
    // The simulator's own checker (`World::check_tenant`), not the fold's refusal relabelled.
    assert!(err.contains("double booking: GPU ") && err.contains("(both active)"), "{err}");
    assert!(!err.contains("already held by"), "the fold must not be what found it: {err}");
    assert!(out.contains("FAILED") && out.contains("reproduce: better-compute sim run"), "{out}");
    // The one command printed repeats the failure, step for step.
    let hint = printed_command(&err);
    let args: Vec<&str> = hint.split_whitespace().collect();
    assert_eq!(&args[..3], &["better-compute", "sim", "run"], "{hint}");
    assert!(args.contains(&"--unsafe-no-placement-guard") && args.contains(&seed.as_str()), "{hint}");
    it_repeats(&args, &err);
}

/// Seen failing with the journal check's duplicate verdict dropped: the run then failed on the
/// same entry "in the log after entry N (out of order)".
#[test]
fn without_the_journal_dedupe_the_checker_finds_the_duplicate_and_its_command_repeats_it() {
    // Only the faults that deliver entries again: with drop-messages too, the unchecked path may
    // first append an entry past a gap, which the log refuses as well.
    let found = first_broken_seed(&["--faults", "duplicate-messages,lost-acks", "--unsafe-no-journal-dedupe"]);
    let (seed, err) = found.unwrap_or_else(|| panic!("no duplicate found within {UNSAFE_SEEDS_MAX} seeds"));
    // The simulator's own journal check (`World::check_journals`), not the log's refusal: the
    // switch rewinds the node's journal head behind the fold's back, so the log takes it.
    assert!(err.contains("is in the log more than once (duplicated)"), "{err}");
    assert!(!err.contains("the log refused a journal entry"), "the fold must not be what found it: {err}");
    let hint = printed_command(&err);
    let args: Vec<&str> = hint.split_whitespace().collect();
    assert!(args.contains(&"--unsafe-no-journal-dedupe") && args.contains(&seed.as_str()), "{hint}");
    it_repeats(&args, &err);
}

/// Runs a small run with `extra` on seeds 1 to `UNSAFE_SEEDS_MAX` until one breaks an invariant
/// (and says so, naming its seed): that seed and its standard error.
fn first_broken_seed(extra: &[&str]) -> Option<(String, String)> {
    for seed in 1..=UNSAFE_SEEDS_MAX {
        let seed = seed.to_string();
        let mut args = small_sim_run(&seed);
        args.extend_from_slice(extra);
        let (status, out, err) = sim(&args);
        if status == 0 {
            continue;
        }
        assert_eq!(status, 1, "{out}\n{err}");
        assert!(err.contains(&format!("SIM_INVARIANT_BROKEN: seed {seed}")), "{err}");
        return Some((seed, err));
    }
    None
}

/// Runs `--unsafe-break NAME` on seeds 1 to `UNSAFE_SEEDS_MAX` until one fails; asserts it fails
/// with `says` (each of them) and that its printed command repeats the same failure.
fn a_break_is_found(name: &str, extra: &[&str], says: &[&str]) -> String {
    let mut args = extra.to_vec();
    args.extend_from_slice(&["--unsafe-break", name]);
    let found = first_broken_seed(&args);
    let (seed, err) = found.unwrap_or_else(|| panic!("--unsafe-break {name} was not found within {UNSAFE_SEEDS_MAX} seeds"));
    for says in says {
        assert!(err.contains(says), "--unsafe-break {name}: expected {says:?} in:\n{err}");
    }
    let hint = printed_command(&err);
    let args: Vec<&str> = hint.split_whitespace().collect();
    assert!(args.windows(2).any(|w| w == ["--unsafe-break", name]) && args.contains(&seed.as_str()), "{hint}");
    it_repeats(&args, &err);
    seed
}

/// A fold wrong on the write path and in the full checks' fold alike (some `node.freed` leave
/// the GPUs allocated): the rows equal a fold of the log, so only the oracle, a model of the
/// log written apart from the fold, finds it. Seen failing with the oracle's comparison
/// skipped: no seed of the three failed.
#[test]
fn a_wrong_fold_is_found_by_the_oracle_not_by_the_fold_compared_with_itself() {
    a_break_is_found(
        "wrong-fold",
        &["--faults", "none"],
        &["the projections differ from the oracle's model of the log", "the log gives it to None, its row to Some("],
    );
}

/// Every running node of a rollout taken out at once by the modelled updaters, which the
/// rollout's own document never says: the `maxUnavailable` check counts the modelled agents.
/// Seen failing with that check's verdict dropped: no seed of the three failed.
#[test]
fn a_rollout_past_its_max_unavailable_is_found_from_the_modelled_updaters() {
    a_break_is_found(
        "rollout-all-at-once",
        &["--faults", "rollouts"],
        &["nodes out, over its maxUnavailable", "updating or rolling back (the modelled updaters)"],
    );
}

/// An agent holding a GPU the control plane never gave it, from the liveness phase on: nothing
/// takes it back, so the run does not settle within its bound. Seen failing with the bound's
/// verdict dropped: no seed of the three failed.
#[test]
fn a_leaked_hold_is_found_by_the_liveness_bound() {
    a_break_is_found(
        "leaked-hold",
        &["--faults", "none"],
        &[
            "ms after the faults stopped (the last reservation running then ended after",
            "and 1052000 ms more): at the last pass",
            "rsv_never_given",
        ],
    );
}

/// A proof with a bit flipped: the gateway's session refuses it, and no fault explains that.
/// Seen failing with every refusal taken as explained: no seed of the three failed.
#[test]
fn a_session_refusal_no_fault_explains_is_found() {
    a_break_is_found("bad-proof", &["--faults", "none"], &["the gateway's session of node_", "refused: "]);
}

/// A bare-metal workflow past its bound: the `metal` reconciler is handed each machine with its
/// running workflow's deadline a day later than the log's, and every deploy's system never
/// joins. The metal check derives each workflow's bound from the lifecycle table (the state's
/// deadline from the workflow's start), not from the row, and finds the deploy still waiting
/// past it at the step it names; the printed command repeats it, and the same seed without the
/// switch holds and settles, its machine deployed at least once. (The liveness phase's bound,
/// also from the table, would find the deploy later; the step check finds it first.)
#[test]
fn a_metal_deploy_past_its_bound_is_found_by_the_metal_check_at_its_step() {
    let seed = a_break_is_found(
        "metal-deadline-ignored",
        &["--faults", "none"],
        &["metal: the deploy workflow wf_", "(deploy-wait, at step wait-agent)", "past its bound of 1870000 ms", ", step "],
    );
    let mut args = small_sim_run(&seed);
    args.extend_from_slice(&["--faults", "none", "--json"]);
    let (status, out, err) = sim(&args);
    assert_eq!(status, 0, "seed {seed} without the switch:\n{out}\n{err}");
    let value = json(&out);
    assert_eq!(value["ok"], true, "{value}");
    assert!(value["metal"]["verbs"]["deploy"].as_u64().unwrap_or(0) >= 1, "a deploy ran: {value}");
    assert!(value["livenessSettledMs"].as_u64().is_some(), "{value}");
}

/// `--metal N` enrolls N machines (the default: one for every 25 nodes, at least one), whose
/// every move the metal check holds against the lifecycle table; `--metal 0` none; past 1,000
/// it is refused as usage.
#[test]
fn metal_sets_the_machines_a_run_enrolls_and_their_moves_are_checked_against_the_table() {
    let count = |extra: &[&str]| {
        let mut args = small_sim_run("4");
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--faults", "none", "--json"]);
        let (status, out, err) = sim(&args);
        assert_eq!(status, 0, "{extra:?}:\n{out}\n{err}");
        let value = json(&out);
        assert_eq!(value["ok"], true, "{value}");
        (value["metal"]["machines"].as_u64(), value["metal"]["moves"].as_u64().unwrap_or(0))
    };
    let (machines, moves) = count(&[]);
    assert_eq!(machines, Some(1), "6 nodes: one machine");
    assert!(moves > 0, "its moves were checked");
    let (machines, moves) = count(&["--metal", "3"]);
    assert_eq!(machines, Some(3));
    assert!(moves > 0, "their moves were checked");
    assert_eq!(count(&["--metal", "0"]), (Some(0), 0));
    let mut args = small_sim_run("4");
    args.extend_from_slice(&["--metal", "1001"]);
    let (status, _, err) = sim(&args);
    assert_eq!(status, 2, "{err}");
    assert!(err.contains("--metal 1001 is outside 0..=1000"), "{err}");
}

#[test]
fn many_seeds_with_every_fault_hold_their_invariants_and_settle() {
    let seeds: u64 = std::env::var("BC_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(SEEDS_DEFAULT);
    let cpus = thread::available_parallelism().map_or(1, usize::from) as u64;
    let run = |seeds: Vec<u64>| {
        thread::spawn(move || {
            // Nodes that joined and left, counted as the fewer of the two per seed.
            let mut churn = 0;
            for seed in seeds {
                let cpu = (seed % cpus).to_string();
                let seed = seed.to_string();
                let (status, out, err) =
                    sim(&["--cpu", &cpu, "--seed", &seed, "--nodes", "50", "--tenants", "5", "--hours", "1", "--json"]);
                assert_eq!(status, 0, "seed {seed}:\n{out}\n{err}");
                let value = json(&out);
                assert_eq!(value["ok"], true, "seed {seed}: {value}");
                // The faults ran: the seed enabled some and they were injected.
                let injected: u64 =
                    value["faultsInjected"].as_object().into_iter().flatten().filter_map(|(_, n)| n.as_u64()).sum();
                assert!(injected > 0, "seed {seed}: no fault was injected: {value}");
                assert!(!value["faultsEnabled"].as_array().is_none_or(Vec::is_empty), "seed {seed}: {value}");
                // The full checks ran during the run, not only at its end, and found the
                // workload's acknowledged appends.
                let checks = &value["invariantChecks"];
                assert!(checks["full"].as_u64().unwrap_or(0) > 1, "seed {seed}: {checks}");
                assert!(checks["acknowledgedAppendsChecked"].as_u64().unwrap_or(0) > 0, "seed {seed}: {checks}");
                // Every step is checked, but those that only moved the transport (nothing
                // appended, nothing run).
                let (checked, quiet) = (checks["afterEveryStep"].as_u64().unwrap(), value["quietSteps"].as_u64().unwrap());
                assert_eq!(checked + quiet, value["steps"].as_u64().unwrap(), "seed {seed}: {checks}");
                // Agents talked to the gateway over the transport, in sessions.
                let transport = &value["transport"];
                assert!(transport["sessions"].as_u64().unwrap_or(0) >= 10, "seed {seed}: {transport}");
                // Every event a subscription matched was delivered at least once or dead-lettered.
                let hooks = &value["webhooks"];
                let count = |k: &str| hooks[k].as_u64().unwrap_or(0);
                assert!(count("subscriptions") >= 2 && count("matchedEvents") > 0, "seed {seed}: {hooks}");
                assert_eq!(count("delivered") + count("deadLetters"), count("matchedEvents"), "seed {seed}: {hooks}");
                churn += value["nodesJoined"].as_u64().unwrap_or(0).min(value["nodesLeft"].as_u64().unwrap_or(0));
            }
            churn
        })
    };
    let base = 1000;
    let (even, odd): (Vec<u64>, Vec<u64>) = (base..base + seeds).partition(|s| s % 2 == 0);
    let (a, b) = (run(even), run(odd));
    let churn = a.join().unwrap() + b.join().unwrap();
    assert!(churn > 0, "in some seed nodes joined and left");
}

/// Seeds that once failed, at the size they failed at: each found a bug (in the checker or in
/// the simulator's model) that the smaller seeds above never reach. Seed 1 at 50 nodes ran a
/// full check in the liveness phase that demanded every journal delivered before the run had
/// settled; seed 4 kept an updated agent "unhealthy" (away for up to 30 minutes) after the
/// faults had stopped, past the liveness bound. A change to the code changes what a seed does,
/// so these guard the fixes only as long as the seeds still reach those paths; `make sim` runs
/// many more.
#[test]
fn seeds_that_once_failed_at_50_nodes_hold_and_settle() {
    let cpus = thread::available_parallelism().map_or(1, usize::from) as u64;
    let runs: Vec<_> = [1u64, 4]
        .into_iter()
        .map(|seed| {
            thread::spawn(move || {
                let (cpu, seed) = ((seed % cpus).to_string(), seed.to_string());
                let (status, out, err) =
                    sim(&["--cpu", &cpu, "--seed", &seed, "--nodes", "50", "--tenants", "5", "--hours", "1", "--json"]);
                assert_eq!(status, 0, "seed {seed}:\n{out}\n{err}");
                let value = json(&out);
                assert_eq!(value["ok"], true, "seed {seed}: {value}");
                assert!(value["livenessSettledMs"].as_u64().is_some(), "seed {seed} settled: {value}");
            })
        })
        .collect();
    for run in runs {
        run.join().unwrap();
    }
}

/// A fleet where some reservation is always ending: seed 3 at 500 nodes was never quiet at a
/// pass within the fixed liveness bound (1,052 s), since the reservations still running when the
/// faults stopped kept ending, each a release in flight, and the run failed reporting the
/// webhooks' fan-out (read between passes). The bound now runs from the last of those ends; the
/// run settled after 1,280 s. Seen failing with the fixed bound put back. Since tenants' creates
/// carry idempotency keys (c527450) the seed's workload differs and it settles in 380 s, inside
/// the fixed bound: the test still runs 500 nodes with every fault to the end and holds the
/// bound to be the derived one, but no longer shows a run that needs more than 1,052 s.
#[test]
fn a_fleet_whose_reservations_keep_ending_settles_after_the_last_of_them() {
    let (status, out, err) =
        sim(&["--seed", "3", "--nodes", "500", "--tenants", "5", "--hours", "1", "--faults", "all", "--json"]);
    assert_eq!(status, 0, "seed 3 at 500 nodes:\n{out}\n{err}");
    let value = json(&out);
    value["livenessSettledMs"].as_u64().unwrap_or_else(|| panic!("it settled: {value}"));
    assert!(value["livenessBoundMs"].as_u64().unwrap() > 1_052_000, "the bound is derived from the work: {value}");
}

/// One seed at 300 nodes, 100 a tenant: the density at which `sim run --nodes 1000 --tenants 10`
/// once failed to settle, at the size where such a failure starts (`make sim-large` runs seeds
/// 1 to 3 at 1,000 nodes in a release build). About 25 s of one core in the test build. Every
/// fault the seed enables is injected, every step is checked or quiet, every matched event
/// settles, and the run settles within its bound, derived from the reservations still running
/// when the faults stopped.
#[test]
fn a_fleet_of_300_nodes_with_every_fault_holds_its_invariants_and_settles() {
    let (status, out, err) =
        sim(&["--seed", "1", "--nodes", "300", "--tenants", "3", "--hours", "1", "--faults", "all", "--json"]);
    assert_eq!(status, 0, "seed 1 at 300 nodes:\n{out}\n{err}");
    let value = json(&out);
    assert_eq!(value["ok"], true, "{value}");
    let injected: u64 = value["faultsInjected"].as_object().into_iter().flatten().filter_map(|(_, n)| n.as_u64()).sum();
    assert!(injected > 0, "faults were injected: {value}");
    let checks = &value["invariantChecks"];
    assert!(checks["full"].as_u64().unwrap_or(0) > 1, "{checks}");
    let (checked, quiet) = (checks["afterEveryStep"].as_u64().unwrap(), value["quietSteps"].as_u64().unwrap());
    assert_eq!(checked + quiet, value["steps"].as_u64().unwrap(), "{checks}");
    assert!(value["transport"]["sessions"].as_u64().unwrap_or(0) >= 300, "every agent held a session: {value}");
    let hooks = &value["webhooks"];
    let count = |k: &str| hooks[k].as_u64().unwrap_or(0);
    assert!(count("matchedEvents") > 0, "{hooks}");
    assert_eq!(count("delivered") + count("deadLetters"), count("matchedEvents"), "{hooks}");
    let settled = value["livenessSettledMs"].as_u64().unwrap_or_else(|| panic!("it settled: {value}"));
    assert!(settled <= value["livenessBoundMs"].as_u64().unwrap(), "{value}");
}

/// `--cpu` takes `auto`, `any` or a CPU this process may run on; anything else is a usage error
/// (exit 2, `INVALID_ARGUMENT`) before the run starts.
#[test]
fn a_cpu_not_a_number_or_not_allowed_to_this_process_is_refused_before_the_run() {
    for (cpu, says) in [("x", "expected auto, any or a CPU number"), ("100000", "may not run on that CPU")] {
        let (status, out, err) = sim(&["--cpu", cpu, "--seed", "1", "--nodes", "2", "--tenants", "1"]);
        assert_eq!(status, 2, "--cpu {cpu}:\n{out}\n{err}");
        assert!(err.starts_with("INVALID_ARGUMENT: ") && err.contains(says), "--cpu {cpu}: {err}");
        assert!(out.is_empty(), "--cpu {cpu}: nothing ran: {out}");
    }
    let (status, out, err) = sim(&["--cpu", "any", "--seed", "1", "--nodes", "2", "--tenants", "1", "--hours", "1", "--json"]);
    assert_eq!(status, 0, "--cpu any:\n{out}\n{err}");
}
