//! `sim run` and `sim replay`: the work is in `crate::sim` and `bc_simulator`.

use crate::client::CliError;
use crate::flags::SimCommand;
use crate::output::Format;

use super::Context;

pub async fn run(ctx: &Context, command: SimCommand) -> Result<(), CliError> {
    let value = match command {
        SimCommand::Run {
            seed,
            nodes,
            tenants,
            hours,
            faults,
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
