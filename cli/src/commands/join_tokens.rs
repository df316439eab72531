//! `join-tokens create|list|get|revoke`: the `joinTokens.*` methods. A token's secret is
//! printed once, or with `--out FILE` written to a new 0600 file (an existing file is refused
//! before anything is sent) and left out of the output. `get` and `revoke` refuse anything
//! shaped like a secret without sending or echoing it: a pasted token is never an id.

use std::path::{Path, PathBuf};

use bc_core::agent::looks_like_join_token;
use bc_core::id::{JoinTokenId, PoolId};
use clap::Subcommand;
use serde_json::{Map, Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, Page, parse_duration_s};
use crate::output::Format;
use crate::tables;

use super::{Context, check_id, idempotency_key, put_id};

#[derive(Subcommand)]
pub enum JoinTokensCommand {
    /// A join token for one pool. The secret (`bcjt_…`) is printed once, or written to --out.
    Create {
        #[arg(long)]
        pool: String,
        #[arg(long, default_value = "")]
        description: String,
        /// How long it can be used: `30m`, `1h`, `7d` (at most 30 days; default 1h).
        #[arg(long, value_parser = parse_duration_s)]
        expires: Option<u64>,
        /// How many machines may join with it (default 1).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
        uses: Option<u32>,
        /// Write the secret to this new file (mode 0600, never over an existing file) and print
        /// only the token's id and the file.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's join tokens (never their secrets).
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One join token, by its `jt_…` id.
    Get { join_token_id: String },
    /// Revoke a join token by its `jt_…` id (a pasted secret is refused, and never sent).
    Revoke { join_token_id: String },
}

/// A `jt_…` id, refusing a secret without quoting it.
fn token_id(text: &str) -> Result<String, CliError> {
    if looks_like_join_token(text) {
        return Err(CliError::usage("JOIN_TOKEN_ID is a join token's secret, not its id; it was not sent").hint(
            "pass the jt_… id that `join-tokens create` and `join-tokens list` show; treat the secret as exposed \
             (it is in your shell history) and revoke the token by its id",
        ));
    }
    check_id::<JoinTokenId>("JOIN_TOKEN_ID", text)
}

/// `--out` names a new file: refused before the call, so no token is made for nothing.
fn refuse_existing(path: &Path) -> Result<(), CliError> {
    if path.exists() || path.is_symlink() {
        return Err(
            CliError::new("ALREADY_EXISTS", format!("{} exists", path.display())).hint("--out never overwrites: give a new file")
        );
    }
    Ok(())
}

pub async fn run(ctx: &Context, command: JoinTokensCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let value = match command {
        JoinTokensCommand::List { page } => return ctx.list("joinTokens.list", body, &page, tables::JOIN_TOKENS).await,
        JoinTokensCommand::Get { join_token_id } => {
            body.insert("joinTokenId".into(), json!(token_id(&join_token_id)?));
            ctx.call("joinTokens.get", body, None).await?
        }
        JoinTokensCommand::Revoke { join_token_id } => {
            body.insert("joinTokenId".into(), json!(token_id(&join_token_id)?));
            ctx.call("joinTokens.revoke", body, None).await?
        }
        JoinTokensCommand::Create { pool, description, expires, uses, out, key } => {
            if let Some(out) = &out {
                refuse_existing(out)?;
            }
            put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            body.insert("description".into(), json!(description));
            if let Some(s) = expires {
                body.insert("expiresS".into(), json!(s));
            }
            if let Some(n) = uses {
                body.insert("uses".into(), json!(n));
            }
            let c = ctx.client()?;
            let key = idempotency_key(&key.key);
            let created = c.call("joinTokens.create", &Value::Object(body), Some(&key)).await?;
            match out {
                None => created,
                Some(out) => written(created, &out)?,
            }
        }
    };
    ctx.print(&value, Format::Json)
}

/// Writes the secret of `created` to the new file `out`; what is printed instead: the id and
/// the file.
fn written(created: Value, out: &Path) -> Result<Value, CliError> {
    let id = created.get("joinTokenId").cloned().unwrap_or(Value::Null);
    let Some(token) = created.get("token").and_then(Value::as_str) else {
        // A replay of an earlier create (same --key): its secret was shown once, then.
        return Err(CliError::new(
            "REPLAYED",
            format!(
                "--key answered an earlier create of {}: its secret is not shown again; nothing was written",
                id.as_str().unwrap_or("?")
            ),
        )
        .hint("run it without --key for a new token (and revoke the old one if its secret is lost)"));
    };
    bc_core::keys::write_secret_file(out, format!("{token}\n").as_bytes()).map_err(|e| {
        CliError::from(e).hint(format!(
            "the token {} exists but its secret is lost: revoke it and create another with a new --out file",
            id.as_str().unwrap_or("?")
        ))
    })?;
    let mut shown = Map::new();
    shown.insert("joinTokenId".into(), id);
    shown.insert("tokenFile".into(), json!(out.display().to_string()));
    Ok(Value::Object(shown))
}
