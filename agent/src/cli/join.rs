//! `bcd join`: the configuration (loaded, or written from `--server`'s well-known document
//! checked against the pins: `bc_agent::well_known`), `--reset`, then the token, sealed to the
//! join encryption key when `join-encryption.jwk` is there, and the join itself
//! (`bc_agent::join`), or, with `--attestor tpm`, the TPM's rounds and no token
//! (`bc_agent::join::join_tpm`). A document that does not verify or match a pin ends the join (exit 1)
//! before anything reaches the agents' endpoint.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use bc_agent::config::Config;
use bc_agent::{join, token};

use crate::flags::JoinArgs;

pub async fn run(args: &JoinArgs, env_token: Option<String>) -> ExitCode {
    match join_here(args, env_token).await {
        Ok(message) => {
            println!("{message}");
            ExitCode::SUCCESS
        }
        Err(code) => code,
    }
}

/// Prints why the join failed, and the exit code that says so.
fn fail(e: join::JoinError) -> ExitCode {
    eprintln!("bcd join: {}", e.message);
    ExitCode::from(e.exit)
}

/// A failure that is neither usage nor the join's own: exit code 1.
fn failed(message: impl Into<String>) -> ExitCode {
    fail(join::JoinError { exit: 1, message: message.into() })
}

/// The join, phase by phase; what to print when the node is joined (now or before).
async fn join_here(args: &JoinArgs, env_token: Option<String>) -> Result<String, ExitCode> {
    args.check_role().map_err(|message| fail(join::usage(message)))?;
    args.check_request().map_err(|message| fail(join::usage(message)))?;
    for pin in [&args.serving_ca_pin, &args.log_key_pin, &args.join_signing_pin, &args.join_encryption_pin].into_iter().flatten()
    {
        bc_agent::client::check_pin(pin).map_err(|e| fail(join::usage(format!("a pin flag: {e}"))))?;
    }
    let config = config_for(args).await?;
    super::init_logging(Some(&config));
    for (flag, given, configured) in [
        ("serving-ca-pin", &args.serving_ca_pin, config.serving_ca_spki_pin.as_deref()),
        ("log-key-pin", &args.log_key_pin, Some(config.log_key_pin.as_str())),
        ("join-signing-pin", &args.join_signing_pin, config.join_signing_key_pin.as_deref()),
        ("join-encryption-pin", &args.join_encryption_pin, config.join_encryption_key_pin.as_deref()),
    ] {
        if let Some(given) = given
            && Some(given.as_str()) != configured
        {
            return Err(failed(format!("--{flag} differs from the configuration's pin")));
        }
    }
    std::fs::create_dir_all(&config.data_dir).map_err(|e| failed(format!("creating {}: {e}", config.data_dir.display())))?;
    if args.reset {
        reset(args, &config)?;
    }
    let token_file = args.token_file.as_deref();
    let node_id = node_id_wanted(args, &config)?;
    if let Some(message) = join::already_joined(&config).map_err(fail)? {
        if let Some(path) = token_file {
            join::remove_token_file(path);
        }
        return Ok(message);
    }
    if args.request {
        // No token: the machine asks, and says which request an operator decides.
        let told = |id: &str| {
            eprintln!(
                "bcd join: asked to join as {id}; waiting for an operator (better-compute join-requests approve {id} --pool POOL)"
            );
        };
        return match join::request(&config, told).await {
            Ok(join::Outcome::Joined(message) | join::Outcome::AlreadyJoined(message)) => Ok(message),
            Err(e) => Err(fail(e)),
        };
    }
    if args.attestor == "tpm" {
        return join_by_tpm(&config).await;
    }
    let seal_to = join_encryption_key(args, &config).await?;
    let stdin = std::io::stdin();
    let token = token::read(env_token, stdin.is_terminal(), &mut stdin.lock(), token_file).map_err(|e| fail(join::usage(e.0)))?;
    match join::join_sealed(&config, token, token_file, node_id.as_deref(), seal_to.as_ref()).await {
        Ok(join::Outcome::Joined(message) | join::Outcome::AlreadyJoined(message)) => Ok(message),
        Err(e) => Err(fail(e)),
    }
}

/// `--attestor tpm`: the TPM at `BCD_TPM_TCTI` (default `/dev/tpmrm0`) proves the machine, with
/// no token (`bc_agent::tpm`). In fakehw builds its quotes can be recorded and replayed
/// (`BCD_TPM_QUOTE_RECORD`, `BCD_TPM_QUOTE_REPLAY`: the end-to-end test's replay).
#[cfg(feature = "tpm")]
async fn join_by_tpm(config: &Config) -> Result<String, ExitCode> {
    let tcti = std::env::var(bc_agent::tpm::TCTI_ENV).unwrap_or_else(|_| bc_agent::tpm::TCTI_DEFAULT.to_owned());
    let tpm = bc_agent::tpm::esapi::EsapiTpm::open(&tcti).map_err(failed)?;
    #[cfg(feature = "fakehw")]
    let mut tpm = bc_agent::tpm::Replaying {
        inner: tpm,
        record: std::env::var_os("BCD_TPM_QUOTE_RECORD").map(Into::into),
        replay: std::env::var_os("BCD_TPM_QUOTE_REPLAY").map(Into::into),
    };
    #[cfg(not(feature = "fakehw"))]
    let mut tpm = tpm;
    match join::join_tpm(config, &mut tpm).await {
        Ok(join::Outcome::Joined(message) | join::Outcome::AlreadyJoined(message)) => Ok(message),
        Err(e) => Err(fail(e)),
    }
}

/// A build without the `tpm` feature: `check_attestor` refused `--attestor tpm` already.
#[cfg(not(feature = "tpm"))]
async fn join_by_tpm(_config: &Config) -> Result<String, ExitCode> {
    Err(fail(join::usage("--attestor tpm: this build has no TPM support (build bcd with --features bc-agent/tpm)")))
}

/// A refusal of the well-known document or of `join-encryption.jwk`: exit 1, its code first.
fn refused_document(e: bc_core::well_known::WellKnownError) -> ExitCode {
    failed(format!("well-known: {e}"))
}

/// The pins a machine holds for the document: each flag, else the configuration's.
fn held_pins<'a>(args: &'a JoinArgs, config: Option<&'a Config>) -> bc_core::well_known::HeldPins<'a> {
    bc_core::well_known::HeldPins {
        serving_ca: args.serving_ca_pin.as_deref().or(config.and_then(|c| c.serving_ca_spki_pin.as_deref())),
        join_signing: args.join_signing_pin.as_deref().or(config.and_then(|c| c.join_signing_key_pin.as_deref())),
        join_encryption: args.join_encryption_pin.as_deref().or(config.and_then(|c| c.join_encryption_key_pin.as_deref())),
    }
}

/// The join encryption key to seal the token to: `join-encryption.jwk` beside the
/// configuration (checked against `join_encryption_key_pin`); when it is absent and `--server`
/// names the control plane, fetched from its document (checked against the pins) and written.
/// `None`: the token goes unsealed, as before the document (no pin asks for a key).
async fn join_encryption_key(args: &JoinArgs, config: &Config) -> Result<Option<[u8; 32]>, ExitCode> {
    let path = bc_agent::well_known::jwk_path(&args.config.path);
    let pin = config.join_encryption_key_pin.as_deref();
    if let Some(key) = bc_agent::well_known::read_jwk(&path, pin).map_err(refused_document)? {
        return Ok(Some(key));
    }
    let wanted = pin.is_some() || config.join_signing_key_pin.is_some() || args.join_signing_pin.is_some();
    match &args.server {
        Some(server) if wanted || args.join_encryption_pin.is_some() => {
            let document =
                bc_agent::well_known::fetch_checked(server, &held_pins(args, Some(config))).await.map_err(refused_document)?;
            bc_agent::well_known::write_jwk(&path, &document).map_err(failed)?;
            Ok(Some(document.encryption_key().map_err(failed)?))
        }
        _ if pin.is_some() => Err(refused_document(bc_core::well_known::WellKnownError::new(
            "JOIN_ENCRYPTION_JWK",
            format!("join_encryption_key_pin is set but {} is missing: run bcd join --server URL to fetch it", path.display()),
        ))),
        _ => Ok(None),
    }
}

/// The configuration: loaded from `--config`, or, where there is none and `--server` is given,
/// written there (0600) from `--server`'s well-known document checked against the pins (with
/// `join-encryption.jwk` beside it), or, with `--log-key-pin` and no join pin, from `--server`
/// as the agents' endpoint and the pins; then loaded.
async fn config_for(args: &JoinArgs) -> Result<Config, ExitCode> {
    let path = &args.config.path;
    let Some(server) = args.server.as_ref().filter(|_| !path.exists()) else {
        return super::load_config("join", path);
    };
    if args.joins_from_well_known() {
        return config_from_well_known(args, server).await;
    }
    let Some(log_key_pin) = &args.log_key_pin else {
        return Err(fail(join::usage("--server without a config.toml needs --log-key-pin (and --serving-ca-pin for https)")));
    };
    let config = Config::joined(args.data_dir.clone(), server.clone(), args.serving_ca_pin.clone(), log_key_pin.clone());
    write_config(path, &config)
}

/// Writes `config` to `path` (a new file, 0600) and loads it back, as `bcd node` will.
fn write_config(path: &Path, config: &Config) -> Result<Config, ExitCode> {
    let text = toml::to_string(config).map_err(|e| failed(e.to_string()))?;
    bc_core::keys::write_new_file(path, text.as_bytes(), 0o600).map_err(|e| failed(e.to_string()))?;
    Config::load(path).map_err(|e| failed(e.to_string()))
}

/// `config.toml` and `join-encryption.jwk` from the control plane's well-known document: fetched,
/// its signature checked, each pin given checked (`--log-key-pin` too), and only then written.
async fn config_from_well_known(args: &JoinArgs, server: &str) -> Result<Config, ExitCode> {
    let held = held_pins(args, None);
    if held.serving_ca.is_none() && held.join_signing.is_none() && held.join_encryption.is_none() {
        return Err(fail(join::usage(
            "--server without a config.toml needs a pin to check its well-known document against: \
             --join-signing-pin (better-compute pki show's joinSigningPin), --serving-ca-pin or --join-encryption-pin",
        )));
    }
    let document = bc_agent::well_known::fetch_checked(server, &held).await.map_err(refused_document)?;
    if let Some(pin) = &args.log_key_pin
        && *pin != document.log_key_pin
    {
        return Err(failed(format!(
            "well-known: PIN_MISMATCH: the document's logKeyPin is {}, not --log-key-pin {pin}",
            document.log_key_pin
        )));
    }
    let path = &args.config.path;
    let config = Config {
        join_signing_key_pin: Some(document.join_signing_pin.clone()),
        join_encryption_key_pin: Some(document.join_encryption_pin.clone()),
        ..Config::joined(
            args.data_dir.clone(),
            document.agents_url.clone(),
            document.serving_ca_pin.clone(),
            document.log_key_pin.clone(),
        )
    };
    // The configuration is checked as it will be loaded before anything is written.
    config.gateway().map_err(|e| failed(format!("well-known: the document's agents' endpoint: {e}")))?;
    bc_agent::well_known::write_jwk(&bc_agent::well_known::jwk_path(path), &document).map_err(failed)?;
    write_config(path, &config)
}

/// `--reset`: lists what it would move aside, or, with `--yes`, moves it.
fn reset(args: &JoinArgs, config: &Config) -> Result<(), ExitCode> {
    if !args.yes {
        println!("bcd join --reset would move aside:");
        for f in &join::reset_files(config) {
            println!("  {}", f.display());
        }
        return Err(fail(join::usage("confirm with --reset --yes")));
    }
    let moved = join::reset(config, bc_core::clock::Clock::now_ms(&bc_core::clock::SystemClock)).map_err(fail)?;
    for (from, to) in moved {
        println!("moved {} to {}", from.display(), to.display());
    }
    Ok(())
}

/// `--node-id`, checked: well formed, allowed with the attestor flags given, and not another
/// node than the one this machine already joined as.
fn node_id_wanted(args: &JoinArgs, config: &Config) -> Result<Option<String>, ExitCode> {
    let node_id = match &args.node_id {
        None => None,
        Some(text) => match text.parse::<bc_core::id::NodeId>() {
            Ok(id) => Some(id.to_string()),
            Err(e) => return Err(fail(join::usage(format!("--node-id: {e}")))),
        },
    };
    args.check_attestor(node_id.is_some()).map_err(|message| fail(join::usage(message)))?;
    if let Some(want) = &node_id
        && let Some(joined) = join::joined_node(config).map_err(fail)?
        && joined != *want
    {
        return Err(failed(format!(
            "this machine already joined as {joined}, not {want} (bcd join --reset --yes to join again)"
        )));
    }
    Ok(node_id)
}
