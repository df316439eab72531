//! `sim replay`: the work is in `crate::sim` and `bc_simulator`.

use crate::client::CliError;
use crate::flags::SimCommand;
use crate::output::Format;

use super::Context;

pub fn run(ctx: &Context, command: SimCommand) -> Result<(), CliError> {
    let value = match command {
        SimCommand::Replay { file, log_key_pin, until, rows_out } => {
            crate::sim::replay(crate::sim::ReplayArgs { file: &file, pin: &log_key_pin, until, rows_out: rows_out.as_deref() })?
        }
    };
    ctx.print(&value, Format::Json)
}
