//! `drivers list`: `drivers.list`, the hypervisors, sandbox runtimes and BMC protocols of the
//! tenant's fleet, as its agents advertise them and its machines are enrolled.

use clap::Subcommand;
use serde_json::Value;

use crate::client::CliError;
use crate::tables;

use super::Context;

#[derive(Subcommand)]
pub enum DriversCommand {
    /// Each driver of the fleet: its kind, name, how many nodes have it (ready now) and their pools.
    List,
}

pub async fn run(ctx: &Context, command: DriversCommand) -> Result<(), CliError> {
    match command {
        DriversCommand::List => {
            let body = ctx.tenant_body()?;
            let drivers: Value = ctx.call("drivers.list", body, None).await?;
            ctx.print_list(&drivers, tables::DRIVERS)
        }
    }
}
