//! `auth login|status|logout`: saved credentials (the work is in `crate::credentials`).

use clap::Subcommand;

use crate::client::CliError;
use crate::credentials;
use crate::output::Format;

use super::Context;

#[derive(Subcommand)]
pub enum AuthCommand {
    /// Save a token for --url: read from standard input or BETTER_COMPUTE_TOKEN, never an
    /// argument; checked with system.whoami unless --no-verify.
    Login {
        #[arg(long)]
        profile: Option<String>,
        #[arg(long)]
        no_verify: bool,
    },
    /// Which credential commands use (source, profile, path); never the token.
    Status,
    /// Forget a saved profile (the key stays valid on the server).
    Logout {
        #[arg(long)]
        profile: Option<String>,
    },
}

pub async fn run(ctx: &Context, command: AuthCommand) -> Result<(), CliError> {
    let url = &ctx.global.url;
    let value = match command {
        AuthCommand::Login { profile, no_verify } => credentials::login(url, profile.as_deref(), !no_verify).await?,
        AuthCommand::Status => credentials::status(url)?,
        AuthCommand::Logout { profile } => credentials::logout(profile.as_deref())?,
    };
    ctx.print(&value, Format::Json)
}
