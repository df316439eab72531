//! `better-compute init [--data-dir DIR]`: writes the configuration file (`--config PATH` or
//! `BETTER_COMPUTE_CONFIG`, else `./better-compute.toml`), every setting of `dev`, `serve` and
//! `reconcile` commented out with its default (`crate::config::template`, from the flags
//! themselves), and makes the keys in its data directory as the first start of `dev` or `serve`
//! does, by the same functions: the log key (`LogKey::load_or_create`), the data key
//! (`sealing::load_data_key_file`) and the agents' serving certificate
//! (`ServingIdentity::load_or_create`), keys 0600 in a 0700 directory. Keys already there are
//! kept. Never over an existing configuration file (`ALREADY_EXISTS`, before any key is made).

use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::config::{CONFIG_FILE, template};
use crate::flags::DEFAULT_DATA_DIR;
use crate::output::Format;
use crate::server;

use super::Context;

#[derive(Args)]
pub struct InitArgs {
    /// Where the keys (and dev's embedded database) go. Default: `.better-compute` beside the
    /// configuration file.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
}

/// The configuration file's mode: it holds no secret, but nothing in it is for other users.
pub const CONFIG_FILE_MODE: u32 = 0o600;

pub fn run(ctx: &Context, args: InitArgs) -> Result<(), CliError> {
    let path = ctx.global.config.clone().unwrap_or_else(|| PathBuf::from(CONFIG_FILE));
    if std::fs::symlink_metadata(&path).is_ok() {
        return Err(CliError::new(
            "ALREADY_EXISTS",
            format!("{} exists: init never writes over a configuration file", path.display()),
        )
        .hint("edit it (every setting is there, commented out), or move it away and run init again"));
    }
    let beside = path.parent().unwrap_or(Path::new(""));
    // The file's relative paths are relative to its directory; a --data-dir given here is
    // relative to this one, so it is written absolute.
    let (data_dir, written) = match &args.data_dir {
        Some(dir) => {
            let dir = std::path::absolute(dir).map_err(|e| CliError::usage(format!("--data-dir {}: {e}", dir.display())))?;
            let text =
                dir.to_str().ok_or_else(|| CliError::usage("--data-dir must be UTF-8 to be written in the file"))?.to_owned();
            (dir, text)
        }
        None => (beside.join(DEFAULT_DATA_DIR), DEFAULT_DATA_DIR.to_owned()),
    };
    let keys = make_keys(&data_dir)?;
    bc_core::keys::write_new_file(&path, template(&written).as_bytes(), CONFIG_FILE_MODE)?;
    let flag = match ctx.global.config.is_some() {
        true => format!(" --config {}", path.display()),
        false => String::new(),
    };
    let next = vec![
        format!("better-compute dev{flag}    # the control plane on SQLite in {}", data_dir.display()),
        "export BETTER_COMPUTE_DATABASE_URL=postgres://USER:PASSWORD@HOST/DB    # or, on PostgreSQL: the URL with its password stays in the environment"
            .to_owned(),
        format!("better-compute migrate{flag} && better-compute serve{flag}"),
        format!("better-compute doctor{flag}    # checks the database, the keys and their modes"),
    ];
    let result = json!({ "config": path, "dataDir": data_dir, "keys": keys, "next": next });
    if ctx.global.format.is_some() || ctx.global.query.is_some() {
        return ctx.print(&result, Format::Json);
    }
    println!("wrote {} (mode 0600): every setting of dev, serve and reconcile, commented out with its default", path.display());
    println!("keys in {} (mode 0600; the certificate beside its key 0644):", data_dir.display());
    for key in keys.as_array().into_iter().flatten() {
        let state = if key["made"] == true { "made" } else { "kept" };
        let pin = key["pin"].as_str().map(|p| format!(", pin {p}")).unwrap_or_default();
        println!(
            "  {:<22} {} ({state}{pin})",
            key["name"].as_str().unwrap_or_default(),
            key["path"].as_str().unwrap_or_default()
        );
    }
    println!("next:");
    for step in &next {
        println!("  {step}");
    }
    Ok(())
}

/// The data directory's keys, made where absent by the functions `dev` and `serve` make them
/// with at their first start; one entry per key: its name, file, whether made now, its pin.
fn make_keys(data_dir: &Path) -> Result<Value, CliError> {
    server::create_private_dir(data_dir)?;
    let log_key_path = data_dir.join(server::LOG_KEY_FILE);
    let (log_key, log_made) = bc_core::keys::LogKey::load_or_create(&log_key_path)?;
    let data_key_path = data_dir.join(bc_core::sealing::DATA_KEY_FILE);
    let (data_keys, data_made) = bc_core::sealing::load_data_key_file(&data_key_path, true)?;
    let (identity, cert_made) = bc_gateway::agents::tls::ServingIdentity::load_or_create(data_dir, &[])?;
    let cert_key_path = data_dir.join(bc_gateway::agents::tls::SERVING_KEY_FILE);
    Ok(json!([
        { "name": "log key", "path": log_key_path, "made": log_made, "keyId": log_key.key_id(), "pin": log_key.pin() },
        { "name": "data key", "path": data_key_path, "made": data_made, "keyId": data_keys.current.id() },
        { "name": "agents' TLS key", "path": cert_key_path, "made": cert_made, "pin": identity.pin,
          "certificate": data_dir.join(bc_gateway::agents::tls::SERVING_CERT_FILE) },
    ]))
}
