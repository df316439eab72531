//! `auth login|status|logout`: saved credentials (the work is in `crate::credentials`).

use crate::client::CliError;
use crate::credentials;
use crate::flags::AuthCommand;
use crate::output::Format;

use super::Context;

pub async fn run(ctx: &Context, command: AuthCommand) -> Result<(), CliError> {
    let url = &ctx.global.url;
    let value = match command {
        AuthCommand::Login { profile, no_verify } => credentials::login(url, profile.as_deref(), !no_verify).await?,
        AuthCommand::Status => credentials::status(url)?,
        AuthCommand::Logout { profile } => credentials::logout(profile.as_deref())?,
    };
    ctx.print(&value, Format::Json)
}
