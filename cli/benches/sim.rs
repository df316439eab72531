//! `make bench` (sim): what the simulator and the replay cost, as figures, never as a timed
//! assertion.
//!
//! - **`sim run` at 1,000 nodes** (10 tenants, 100 nodes a tenant as an SRE's `sim run --nodes
//!   1000 --tenants 10` runs it; 1 simulated hour and the liveness phase, every fault, seed 1;
//!   `BC_BENCH_SIM_NODES`, `BC_BENCH_SIM_TENANTS`, `BC_BENCH_SIM_HOURS` change it), in process,
//!   as `better-compute sim run` runs it: simulated node-hours per wall-clock second, how many
//!   times faster than real time the run went (simulated time over wall time), beside its goal
//!   (at least 100× real time), and the process's peak memory during the run. The figure is
//!   printed whether it meets the goal or not.
//! - **The same at a fifth of the fleet** (200 nodes, 100 a tenant), first, in the same process:
//!   how the speed and the peak memory go with the fleet (memory per node should not grow).
//!   The peak is the kernel's high-water mark of the process's resident memory (`VmHWM`), set
//!   back to what is resident before each run (`/proc/self/clear_refs`), so the larger run
//!   comes second.
//! - **Replay** (`sim replay`'s verify and fold, `bc_simulator::replay`) of one tenant's chain
//!   written in this run, beside the raw append rate of the same run: in-process `Log::append`
//!   of single-event appends, 16 at once, on SQLite in memory (`/dev/shm` where there is one),
//!   the events a fleet's log is made of (a pool, nodes joining with 8 GPUs and becoming ready,
//!   cordons and uncordons). The chain is exported (`bc_simulator::export`) into memory first,
//!   so the replay reads no disk; the export's rate is printed too.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use bc_core::clock::SystemClock;
use bc_core::id::{NodeId, PoolId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::{KIND_NODE, KIND_POOL, Projections, stream_of};
use bc_simulator::run::{Fault, Options};

/// The goal: a simulated fleet of 1,000 nodes runs at least this many times faster
/// than real time.
const REAL_TIME_GOAL: f64 = 100.0;
const SIM_NODES: usize = 1000;
const SIM_TENANTS: usize = 10;
/// The smaller run beside it: a fifth of the nodes, as many a tenant.
const SIM_SMALL_SHARE: usize = 5;
const SIM_HOURS: u64 = 1;
const SIM_SEED: u64 = 1;
/// Nodes of the replayed chain; each is 4 events (joined, ready, cordoned, uncordoned).
const REPLAY_NODES: usize = 5000;
const CLIENTS: usize = 16;
const GPUS_PER_NODE: usize = 8;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The process's resident memory's high-water mark (`VmHWM`), in MiB.
fn peak_resident_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/self/status");
    kib / 1024.0
}

/// The run as `sim run` runs it: one thread, a current-thread runtime, kept to the CPU it
/// starts on with SQLite's worker threads (`sim run --cpu auto`). Returns the outcome, the
/// wall-clock seconds it took and the process's peak resident memory while it ran (MiB; the
/// high-water mark is set back to what is resident now first).
fn run_alone(options: Options) -> (bc_simulator::run::Outcome, f64, f64) {
    std::fs::write("/proc/self/clear_refs", "5").expect("setting back the peak resident memory (/proc/self/clear_refs)");
    let (outcome, wall_s) = std::thread::spawn(move || {
        use rustix::thread::{CpuSet, sched_getcpu, sched_setaffinity};
        let mut one = CpuSet::new();
        one.set(sched_getcpu());
        sched_setaffinity(None, &one).expect("keeping to one CPU");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let started = Instant::now();
        let outcome = runtime.block_on(bc_simulator::run::run(options));
        (outcome, started.elapsed().as_secs_f64())
    })
    .join()
    .expect("the run");
    (outcome, wall_s, peak_resident_mib())
}

/// One run's figures.
struct Ran {
    nodes: usize,
    tenants: usize,
    outcome: bc_simulator::run::Outcome,
    wall_s: f64,
    peak_mib: f64,
}

impl Ran {
    fn simulated_h(&self) -> f64 {
        self.outcome.simulated_ms as f64 / 3_600_000.0
    }
    fn node_hours_per_s(&self) -> f64 {
        self.simulated_h() * self.nodes as f64 / self.wall_s
    }
    fn real_time(&self) -> f64 {
        self.simulated_h() * 3600.0 / self.wall_s
    }
}

fn sim_options(nodes: usize, tenants: usize, hours: u64) -> Options {
    let options = Options {
        seed: SIM_SEED,
        nodes,
        tenants,
        hours,
        faults: Fault::ALL.to_vec(),
        metal: None,
        unsafe_no_placement_guard: false,
        unsafe_no_journal_dedupe: false,
        unsafe_break: None,
        timeline: false,
    };
    options.check().expect("the bench's options");
    options
}

fn run_measured(nodes: usize, tenants: usize, hours: u64) -> Ran {
    let options = sim_options(nodes, tenants, hours);
    eprintln!("sim run: {} …", options.command());
    let (outcome, wall_s, peak_mib) = run_alone(options);
    assert!(outcome.violation.is_none(), "the bench's run broke an invariant: {:?}", outcome.violation);
    Ran { nodes, tenants, outcome, wall_s, peak_mib }
}

pub fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let (nodes, tenants, hours) = (
            env_or("BC_BENCH_SIM_NODES", SIM_NODES),
            env_or("BC_BENCH_SIM_TENANTS", SIM_TENANTS),
            env_or("BC_BENCH_SIM_HOURS", SIM_HOURS),
        );
        // The smaller first: the peak of the larger is then not a leftover of the smaller's.
        let small_nodes = (nodes / SIM_SMALL_SHARE).max(1);
        let small_tenants = (tenants / SIM_SMALL_SHARE).clamp(1, small_nodes);
        let small = run_measured(small_nodes, small_tenants, hours);
        let large = run_measured(nodes, tenants, hours);

        let (append_rate, appended, export_rate, replay_rate, replayed) = replay_beside_appends().await;

        let row = |label: &str, value: String, note: String| println!("  {label:<44} {value:>12}   {note}");
        println!("sim: {hours} h and the liveness phase, every fault, seed {SIM_SEED}, in process");
        for ran in [&large, &small] {
            let speed = ran.real_time();
            println!(
                "  {} nodes, {} tenants: simulated {:.3} h ({} steps, {} events) in {:.1} s of wall-clock time",
                ran.nodes,
                ran.tenants,
                ran.simulated_h(),
                ran.outcome.steps,
                ran.outcome.events,
                ran.wall_s
            );
            row("simulated node-hours per wall-clock second", format!("{:.1}", ran.node_hours_per_s()), String::new());
            let goal = if ran.nodes == large.nodes {
                format!("goal ≥ {REAL_TIME_GOAL:.0}× at 1,000 nodes: {}", if speed >= REAL_TIME_GOAL { "met" } else { "missed" })
            } else {
                format!("{:.2}× the larger run's", speed / large.real_time())
            };
            row("× real time (simulated time / wall time)", format!("{speed:.1}"), goal);
            row(
                "peak resident memory",
                format!("{:.0} MiB", ran.peak_mib),
                format!("{:.2} MiB a node", ran.peak_mib / ran.nodes as f64),
            );
        }
        println!(
            "replay: one tenant's chain of {} events (a pool, {REPLAY_NODES} nodes joining, ready, cordoned, uncordoned)",
            replayed
        );
        row(
            &format!("raw appends, in process ({CLIENTS} at once)"),
            format!("{append_rate:.0} /s"),
            format!("the baseline ({appended} appends of one event)"),
        );
        row("export into memory", format!("{export_rate:.0} /s"), format!("{:.2}× the appends", export_rate / append_rate));
        row("replay: verify and fold", format!("{replay_rate:.0} /s"), format!("{:.2}× the appends", replay_rate / append_rate));
    });
}

/// Appends the chain (timed: the baseline), exports it into memory (timed), replays it (timed).
/// Returns (append rate, events appended, export rate, replay rate, events replayed).
async fn replay_beside_appends() -> (f64, u64, f64, f64, u64) {
    let memory = std::path::Path::new("/dev/shm");
    let dir = if memory.is_dir() { tempfile::tempdir_in(memory).unwrap() } else { tempfile::tempdir().unwrap() };
    let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("replay.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let key = Arc::new(LogKey::generate());
    let log = Arc::new(Log::open(store.clone(), Arc::new(Projections), key.clone(), Arc::new(SystemClock)).await.unwrap());
    let tenant = TenantId::ROOT;
    let pool = PoolId::generate().to_string();
    let created = ev::PoolCreated::named("bench");
    let one = |stream: String, event_type: &str, payload: ciborium::Value| {
        AppendRequest::new(tenant, stream, ExpectedVersion::Any, "bench", vec![NewEvent::new(event_type, payload)])
    };
    log.append(one(stream_of(KIND_POOL, &pool), ev::POOL_CREATED, ev::to_cbor(&created).unwrap())).await.unwrap();

    // The baseline: each of CLIENTS tasks takes the next node and appends its four events, one
    // append each.
    let node_ids: Arc<Vec<String>> = Arc::new((0..REPLAY_NODES).map(|_| NodeId::generate().to_string()).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let (log, next, node_ids, pool) = (log.clone(), next.clone(), node_ids.clone(), pool.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(node) = node_ids.get(i) else { break };
                let joined = ev::NodeJoined {
                    pool_id: pool.clone(),
                    name: format!("n{i}"),
                    gpus: vec![
                        Gpu { model: "H100".into(), product: "H100-SXM5-80GB".into(), vram_gib: 80, nvlink_domain: 0 };
                        GPUS_PER_NODE
                    ],
                    labels: Default::default(),
                    public_key: bc_core::agent::b64(&[7; 32]),
                    join_token_id: "jt_bench".into(),
                    agent_version: "bench".into(),
                    hostname: format!("n{i}"),
                    gpu_uuids: (0..GPUS_PER_NODE).map(|g| format!("GPU-{i}-{g}")).collect(),
                    tpm: None,
                };
                let stream = stream_of(KIND_NODE, node);
                let ready = ev::NodeLiveness { lease_expires_at_ms: u64::MAX / 2 };
                let events = [
                    (ev::NODE_JOINED, ev::to_cbor(&joined).unwrap()),
                    (ev::NODE_READY, ev::to_cbor(&ready).unwrap()),
                    (ev::NODE_CORDONED, ev::to_cbor(&ev::NodeStateChanged {}).unwrap()),
                    (ev::NODE_UNCORDONED, ev::to_cbor(&ev::NodeStateChanged {}).unwrap()),
                ];
                for (event_type, payload) in events {
                    log.append(AppendRequest::new(
                        TenantId::ROOT,
                        stream.clone(),
                        ExpectedVersion::Any,
                        "bench",
                        vec![NewEvent::new(event_type, payload)],
                    ))
                    .await
                    .unwrap();
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let appended = (REPLAY_NODES * 4) as u64;
    let append_rate = appended as f64 / started.elapsed().as_secs_f64();

    let mut file = Vec::new();
    let started = Instant::now();
    let exported = bc_simulator::export::export(&*store, tenant, 1, None, "bench", &mut file, &mut |_, _| {}).await.unwrap();
    let export_rate = exported.events as f64 / started.elapsed().as_secs_f64();

    let started = Instant::now();
    let replayed = bc_simulator::replay(&mut &file[..], &key.pin(), None).expect("the chain replays");
    let replay_rate = replayed.events_verified as f64 / started.elapsed().as_secs_f64();
    assert_eq!(replayed.events_verified, exported.events);
    (append_rate, appended, export_rate, replay_rate, replayed.events_verified)
}
