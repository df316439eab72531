//! `better-compute version [--json]`: this build's version, its git commit when the build
//! recorded one (`BETTER_COMPUTE_GIT_COMMIT` at build time, see `cli/build.rs`), the log format it
//! writes (`schema/LOG-FORMAT.md`'s envelope version) and the target it was compiled for.
//! `--version` prints the version alone.

use clap::Args;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::output::Format;

use super::Context;

#[derive(Args)]
pub struct VersionArgs {
    /// As a JSON object: `version`, `commit` (null when not recorded), `logFormat`, `target`.
    #[arg(long)]
    pub json: bool,
}

/// What this build is.
pub fn build_info() -> Value {
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "commit": option_env!("BETTER_COMPUTE_GIT_COMMIT").filter(|c| !c.is_empty()),
        "logFormat": bc_core::event::ENVELOPE_FORMAT,
        "target": env!("BC_BUILD_TARGET"),
    })
}

pub fn run(ctx: &Context, args: VersionArgs) -> Result<(), CliError> {
    let info = build_info();
    if args.json || ctx.global.format.is_some() || ctx.global.query.is_some() {
        return ctx.print(&info, Format::Json);
    }
    println!("better-compute {}", info["version"].as_str().unwrap_or_default());
    println!("  commit:      {}", info["commit"].as_str().unwrap_or("(not recorded by this build)"));
    println!("  log format:  {}", info["logFormat"]);
    println!("  target:      {}", info["target"].as_str().unwrap_or_default());
    Ok(())
}
