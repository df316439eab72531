//! `bcd join`: the configuration (loaded, or written from `--server` and the pins), `--reset`,
//! then the token and the join itself (`bc_agent::join`).

use std::io::IsTerminal;
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
    let config = config_for(args)?;
    super::init_logging(Some(&config));
    for (flag, given, configured) in [
        ("serving-ca-pin", &args.serving_ca_pin, config.serving_ca_spki_pin.as_deref()),
        ("log-key-pin", &args.log_key_pin, Some(config.log_key_pin.as_str())),
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
    let stdin = std::io::stdin();
    let token = token::read(env_token, stdin.is_terminal(), &mut stdin.lock(), token_file).map_err(|e| fail(join::usage(e.0)))?;
    match join::join(&config, token, token_file, node_id.as_deref()).await {
        Ok(join::Outcome::Joined(message) | join::Outcome::AlreadyJoined(message)) => Ok(message),
        Err(e) => Err(fail(e)),
    }
}

/// The configuration: loaded from `--config`, or, where there is none and `--server` is given,
/// written there (0600) from `--server`, `--data-dir` and the pins, then loaded.
fn config_for(args: &JoinArgs) -> Result<Config, ExitCode> {
    let path = &args.config.path;
    let Some(server) = args.server.as_ref().filter(|_| !path.exists()) else {
        return super::load_config("join", path);
    };
    let Some(log_key_pin) = &args.log_key_pin else {
        return Err(fail(join::usage("--server without a config.toml needs --log-key-pin (and --serving-ca-pin for https)")));
    };
    let config = Config {
        data_dir: args.data_dir.clone(),
        gateway: server.clone(),
        serving_ca_spki_pin: args.serving_ca_pin.clone(),
        log_key_pin: log_key_pin.clone(),
        observe_interval: None,
        command_root_sha256: None,
        hardware: Default::default(),
        hypervisor: Default::default(),
        journal: Default::default(),
        log: Default::default(),
        update: None,
        ssh: None,
    };
    let text = toml::to_string(&config).map_err(|e| failed(e.to_string()))?;
    bc_core::keys::write_new_file(path, text.as_bytes(), 0o600).map_err(|e| failed(e.to_string()))?;
    Config::load(path).map_err(|e| failed(e.to_string()))
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
