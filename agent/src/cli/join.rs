//! `bcd join`: the configuration (loaded, or written from `--server` and the pins), `--reset`,
//! then the token and the join itself (`bc_agent::join`).

use std::io::IsTerminal;
use std::process::ExitCode;

use bc_agent::config::Config;
use bc_agent::{join, token};

use crate::flags::JoinArgs;

pub async fn run(args: &JoinArgs, env_token: Option<String>) -> ExitCode {
    let fail = |e: join::JoinError| {
        eprintln!("bcd join: {}", e.message);
        ExitCode::from(e.exit)
    };
    if let Err(message) = args.check_role() {
        return fail(join::usage(message));
    }
    let path = &args.config.path;
    let config = if !path.exists()
        && let Some(server) = &args.server
    {
        let Some(log_key_pin) = &args.log_key_pin else {
            return fail(join::usage("--server without a config.toml needs --log-key-pin (and --serving-ca-pin for https)"));
        };
        let config = Config {
            data_dir: args.data_dir.clone(),
            gateway: server.clone(),
            serving_ca_spki_pin: args.serving_ca_pin.clone(),
            log_key_pin: log_key_pin.clone(),
            observe_interval: None,
            hardware: Default::default(),
            hypervisor: Default::default(),
            journal: Default::default(),
            log: Default::default(),
            update: None,
        };
        let text = match toml::to_string(&config) {
            Ok(t) => t,
            Err(e) => return fail(join::JoinError { exit: 1, message: e.to_string() }),
        };
        if let Err(e) = bc_core::keys::write_new_file(path, text.as_bytes(), 0o600) {
            return fail(join::JoinError { exit: 1, message: e.to_string() });
        }
        match Config::load(path) {
            Ok(c) => c,
            Err(e) => return fail(join::JoinError { exit: 1, message: e.to_string() }),
        }
    } else {
        match super::load_config("join", path) {
            Ok(c) => c,
            Err(code) => return code,
        }
    };
    super::init_logging(Some(&config));
    for (flag, given, configured) in [
        ("serving-ca-pin", &args.serving_ca_pin, config.serving_ca_spki_pin.as_deref()),
        ("log-key-pin", &args.log_key_pin, Some(config.log_key_pin.as_str())),
    ] {
        if let Some(given) = given
            && Some(given.as_str()) != configured
        {
            return fail(join::JoinError { exit: 1, message: format!("--{flag} differs from the configuration's pin") });
        }
    }
    if let Err(e) = std::fs::create_dir_all(&config.data_dir) {
        return fail(join::JoinError { exit: 1, message: format!("creating {}: {e}", config.data_dir.display()) });
    }
    if args.reset {
        let files = join::reset_files(&config);
        if !args.yes {
            println!("bcd join --reset would move aside:");
            for f in &files {
                println!("  {}", f.display());
            }
            return fail(join::usage("confirm with --reset --yes"));
        }
        match join::reset(&config, bc_core::clock::Clock::now_ms(&bc_core::clock::SystemClock)) {
            Ok(moved) => {
                for (from, to) in moved {
                    println!("moved {} to {}", from.display(), to.display());
                }
            }
            Err(e) => return fail(e),
        }
    }
    let token_file = args.token_file.as_deref();
    let node_id = match &args.node_id {
        None => None,
        Some(text) => match text.parse::<bc_core::id::NodeId>() {
            Ok(id) => Some(id.to_string()),
            Err(e) => return fail(join::usage(format!("--node-id: {e}"))),
        },
    };
    if let Err(message) = args.check_attestor(node_id.is_some()) {
        return fail(join::usage(message));
    }
    if let Some(want) = &node_id {
        match join::joined_node(&config) {
            Ok(Some(joined)) if joined != *want => {
                return fail(join::JoinError {
                    exit: 1,
                    message: format!(
                        "this machine already joined as {joined}, not {want} (bcd join --reset --yes to join again)"
                    ),
                });
            }
            Ok(_) => {}
            Err(e) => return fail(e),
        }
    }
    match join::already_joined(&config) {
        Ok(Some(message)) => {
            if let Some(path) = token_file {
                join::remove_token_file(path);
            }
            println!("{message}");
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => return fail(e),
    }
    let stdin = std::io::stdin();
    let token = match token::read(env_token, stdin.is_terminal(), &mut stdin.lock(), token_file) {
        Ok(t) => t,
        Err(e) => return fail(join::usage(e.0)),
    };
    match join::join(&config, token, token_file, node_id.as_deref()).await {
        Ok(join::Outcome::Joined(message) | join::Outcome::AlreadyJoined(message)) => {
            println!("{message}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}
