//! `make bench`: every benchmark of the workspace, one binary. Each file is one benchmark (its
//! own doc comment says what it measures against which baseline); this runs those named on the
//! command line, in that order:
//!
//! ```sh
//! cargo bench -p bc-cli --bench benches -- append watch
//! ```
//!
//! One name runs in this process. Several, or none (every benchmark, in `make bench`'s order),
//! run one child process each, so no benchmark inherits another's threads, heap or global state,
//! and the first that fails stops the rest. Arguments starting with `--` (cargo passes `--bench`)
//! are ignored. One binary rather than one per benchmark because each binary compiled its own
//! copy of the generic code they share and was linked on its own, in every `make test` build too.

use std::process::{Command, ExitCode};

mod agents;
mod api_writes;
mod append;
mod audit;
mod batches;
mod fleet;
mod fleet_config;
mod ha_writes;
mod log_growth;
mod metrics;
mod reservations;
mod sandboxes;
mod sim;
mod tunnels;
mod unknown_method;
mod usage;
mod watch;
mod webhooks;

/// What several benchmarks share (a `dev` or `serve` child, etcd, wrk, simulated agents).
mod support {
    pub mod agents;
    pub mod banner;
    pub mod dev;
    pub mod etcd;
    pub mod gateway;
    pub mod wrk;
}

/// The allocator `better-compute` runs with (`cli/src/main.rs`), so what a benchmark runs in
/// process (appends, audits, the simulator, the webhooks consumer) is what the product runs.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Every benchmark, in `make bench`'s order: the log first, then the API, agents, fleet,
/// simulator, access, sandboxes, usage and the HA cluster.
const BENCHES: &[(&str, fn())] = &[
    ("append", append::main),
    ("audit", audit::main),
    ("watch", watch::main),
    ("api_writes", api_writes::main),
    ("metrics", metrics::main),
    ("log_growth", log_growth::main),
    ("webhooks", webhooks::main),
    ("reservations", reservations::main),
    ("unknown_method", unknown_method::main),
    ("agents", agents::main),
    ("fleet", fleet::main),
    ("batches", batches::main),
    ("fleet_config", fleet_config::main),
    ("sim", sim::main),
    ("tunnels", tunnels::main),
    ("sandboxes", sandboxes::main),
    ("usage", usage::main),
    ("ha_writes", ha_writes::main),
];

fn main() -> ExitCode {
    let names: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let known: Vec<&str> = BENCHES.iter().map(|(name, _)| *name).collect();
    if let Some(unknown) = names.iter().find(|n| !known.contains(&n.as_str())) {
        eprintln!("no benchmark named {unknown:?}; the benchmarks: {}", known.join(" "));
        return ExitCode::from(2);
    }
    if let [name] = names.as_slice() {
        let (_, run) = BENCHES.iter().find(|(n, _)| n == name).expect("checked above");
        run();
        return ExitCode::SUCCESS;
    }
    let chosen: Vec<&str> = if names.is_empty() { known } else { names.iter().map(String::as_str).collect() };
    let me = std::env::current_exe().expect("the bench binary's own path");
    for name in chosen {
        eprintln!("== bench {name}");
        let status = Command::new(&me).arg(name).arg("--bench").status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("bench {name} failed ({s}); the rest are not run");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("bench {name} could not start: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
