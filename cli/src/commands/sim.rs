//! `sim run` and `sim replay`: the work is in `crate::sim` and `bc_simulator`.

use std::path::PathBuf;

use clap::Subcommand;

use crate::client::CliError;
use crate::output::Format;

use super::Context;

#[derive(Subcommand)]
pub enum SimCommand {
    /// One seeded, deterministic run of the real log, decisions, reservations reconciler and
    /// agents' runners, and of the metal reconciler against simulated BMCs, on a virtual clock,
    /// with a workload and faults, checking the invariants after every step and a liveness
    /// phase at the end; prints a summary, the chain heads and one digest (the same seed gives
    /// the same digest). A broken invariant prints the seed and the command that repeats the
    /// run, and exits 1.
    Run {
        #[arg(long)]
        seed: u64,
        /// Nodes in all, dealt to the tenants in turn (at most 5,000).
        #[arg(long, default_value_t = 20)]
        nodes: usize,
        /// Tenants, each with one pool (at most 100).
        #[arg(long, default_value_t = 3)]
        tenants: usize,
        /// Simulated hours before the liveness phase (at most 720).
        #[arg(long, default_value_t = 1)]
        hours: u64,
        /// The faults the seed may enable: all, none, or names separated by commas
        /// (failed-holds, unanswered-holds, refused-releases, agents-away, clock-skew,
        /// agent-crash, duplicate-commands, stale-view, lost-acks, reconciler-crash,
        /// gateway-restart, failing-commits, drop-messages, delay-messages,
        /// duplicate-messages, reorder-messages, partition, failing-receivers, rollouts, and bare
        /// metal's bmc-hangs, power-never-applies, deploy-never-joins, bmc-refuses-credentials;
        /// and failover, a database failover losing commits' answers).
        #[arg(long, default_value = "all")]
        faults: String,
        /// Bare-metal machines enrolled (at most 1,000; 0: none), their operators' verbs and
        /// the metal faults with them; by default one for every 25 nodes, at least one.
        #[arg(long, value_name = "N")]
        metal: Option<usize>,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// The CPU the run keeps to, with SQLite's worker threads: `auto` (the one it starts
        /// on), a CPU number, or `any` (wherever the scheduler puts it). The run hands every
        /// statement to a worker thread and waits for it, which costs about half as much on
        /// one CPU as across two; runs side by side each take their own.
        #[arg(long, default_value = "auto", value_name = "auto|N|any")]
        cpu: String,
        /// Also write a self-contained HTML page (inline SVG, nothing fetched): a timeline over
        /// simulated time of GPU utilization, queue depth, nodes up, faults injected and
        /// invariant checks, the first failure marked. Written over a file of that name; the
        /// run and its digest are the same with or without it.
        #[arg(long, value_name = "FILE.html")]
        report: Option<PathBuf>,
        /// TEST ONLY: drops the node guard of placements decided on a stale view, to show that
        /// the checker finds the double booking. Never a way to run anything.
        #[arg(long, hide = true)]
        unsafe_no_placement_guard: bool,
        /// TEST ONLY: appends journal entries without their idempotency key and loses
        /// deliveries' acknowledgements often, to show that the checker finds the duplicate.
        #[arg(long, hide = true)]
        unsafe_no_journal_dedupe: bool,
        /// TEST ONLY: breaks one thing behind the back of the code that would refuse it
        /// (wrong-fold, rollout-all-at-once, leaked-hold, bad-proof, metal-deadline-ignored), to
        /// show that the simulator's own checks find it. Never a way to run anything.
        #[arg(long, hide = true, value_name = "NAME")]
        unsafe_break: Option<String>,
    },
    /// Verify an `events export` file against the log key's pin and fold its events into the
    /// tenant's projection rows; prints the state's digest and its rows per kind. Exits 1 with
    /// EXPORT_TAMPERED (naming the first bad record's seq), EXPORT_UNTRUSTED_KEY,
    /// EXPORT_TRUNCATED or EXPORT_MALFORMED when the file does not verify.
    Replay {
        file: PathBuf,
        /// The pin of the log key that signed the file, `sha256/…` (`pki show` prints it).
        #[arg(long)]
        log_key_pin: String,
        /// Rebuild the state as it was right after this seq (default: the file's last).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        until: Option<u64>,
        /// Also write the rows, `{tenantId, atSeq, stateDigest, rows: [{kind, id, doc}]}`, to a
        /// new JSON file.
        #[arg(long, value_name = "FILE.json")]
        rows_out: Option<PathBuf>,
        /// Also write a self-contained HTML page (inline SVG, nothing fetched): a timeline over
        /// the whole file's time of the tenant's GPU utilization, queue depth, nodes up, fault
        /// events and records verified, the --until point marked. Written over a file of that
        /// name.
        #[arg(long, value_name = "FILE.html")]
        report: Option<PathBuf>,
        /// Decide the file's reservations again under another policy and show the first
        /// decision that differs and what followed: `queue=fifo|backfill`,
        /// `placement=tightest-fit|spread` (repeatable).
        #[arg(long = "what-if", value_name = "KEY=VALUE")]
        what_if: Vec<String>,
    },
}

pub async fn run(ctx: &Context, command: SimCommand) -> Result<(), CliError> {
    let value = match command {
        SimCommand::Run {
            seed,
            nodes,
            tenants,
            hours,
            faults,
            metal,
            json,
            cpu,
            report,
            unsafe_no_placement_guard,
            unsafe_no_journal_dedupe,
            unsafe_break,
        } => {
            let args = crate::sim::RunArgs {
                seed,
                nodes,
                tenants,
                hours,
                faults: &faults,
                metal,
                cpu: &cpu,
                report: report.as_deref(),
                unsafe_no_placement_guard,
                unsafe_no_journal_dedupe,
                unsafe_break: unsafe_break.as_deref(),
            };
            return crate::sim::run(args, json).await;
        }
        SimCommand::Replay { file, log_key_pin, until, rows_out, report, what_if } => {
            crate::sim::replay(crate::sim::ReplayArgs {
                file: &file,
                pin: &log_key_pin,
                until,
                rows_out: rows_out.as_deref(),
                report: report.as_deref(),
                what_if: &what_if,
            })?
        }
    };
    ctx.print(&value, Format::Json)
}
