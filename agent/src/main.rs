//! `bcd`: parses the command line and runs one command. Exit codes: 0 success (and an agent
//! stopped by SIGINT or SIGTERM), 1 failure, 2 usage. No command takes a positional argument,
//! and bcd never echoes an unexpected one: a join token pasted on the command line must not
//! reach a terminal log.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use bc_agent::config::{CONFIG_DEFAULT, Config, DATA_DIR_DEFAULT, load_identity};
use bc_agent::update::WATCHDOG_COMMAND;
use bc_agent::{join, status, token};
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Arg, ArgAction, ArgMatches, Command};

const COMMANDS: &[(&str, &str)] = &[
    ("join", "join this machine to the fleet (the token from BCD_JOIN_TOKEN, standard input or --token-file)"),
    ("node", "run the node agent: the session to the gateway, the journal, commands"),
    ("status", "what the running agent is doing (JSON, from its socket)"),
    ("hardware", "what this machine holds, as JSON: GPUs (NVML) and the host (/proc, /sys)"),
    ("update", "take a signed release by hand: --manifest M --signature S (see bcd update -h)"),
    ("doctor", "check the configuration, the node's files, the gateway, the clock, NVML, vfio, libvirt"),
    ("sim", "run N agents on seeded fake machines in one process (fakehw builds)"),
    ("version", "print the version"),
    ("help", "this list"),
];

fn config_arg() -> Arg {
    Arg::new("config").long("config").value_name("FILE").default_value(CONFIG_DEFAULT).help("the configuration file")
}

fn command(name: &'static str) -> Command {
    let base = Command::new(name).no_binary_name(true).disable_version_flag(true).arg(config_arg());
    match name {
        "join" => base
            .arg(
                Arg::new("token-file")
                    .long("token-file")
                    .value_name("FILE")
                    .help("read the token from this file (0600 or 0400, removed once joined)"),
            )
            .arg(
                Arg::new("role")
                    .long("role")
                    .value_name("ROLE")
                    .default_value("node")
                    .help("node (the only role this build has)"),
            )
            .arg(
                Arg::new("node-id").long("node-id").value_name("NODE").help(
                    "the node an installed system joins as (a bare-metal deploy's join token); implies --attestor provisioned",
                ),
            )
            .arg(
                Arg::new("attestor")
                    .long("attestor")
                    .value_name("ATTESTOR")
                    .default_value("join-token")
                    .help("join-token, or provisioned (with --node-id)"),
            )
            .arg(
                Arg::new("server")
                    .long("server")
                    .value_name("URL")
                    .help("the gateway (https://HOST:PORT), to write config.toml when it does not exist"),
            )
            .arg(
                Arg::new("serving-ca-pin")
                    .long("serving-ca-pin")
                    .value_name("PIN")
                    .help("sha256/… of the gateway's serving key; must equal serving_ca_spki_pin"),
            )
            .arg(
                Arg::new("log-key-pin")
                    .long("log-key-pin")
                    .value_name("PIN")
                    .help("sha256/… of the log key; must equal log_key_pin"),
            )
            .arg(
                Arg::new("data-dir")
                    .long("data-dir")
                    .value_name("DIR")
                    .default_value(DATA_DIR_DEFAULT)
                    .help("the data_dir a written config.toml names"),
            )
            .arg(
                Arg::new("reset")
                    .long("reset")
                    .action(ArgAction::SetTrue)
                    .help("move this node's identity and journal aside first"),
            )
            .arg(Arg::new("yes").long("yes").action(ArgAction::SetTrue).help("confirm --reset")),
        "hardware" => Command::new(name)
            .no_binary_name(true)
            .disable_version_flag(true)
            .arg(Arg::new("root").long("root").value_name("DIR").help("read /proc and /sys under DIR (a fake tree)"))
            .arg(
                Arg::new("fake-hw")
                    .long("fake-hw")
                    .value_name("SEED")
                    .value_parser(clap::value_parser!(u64))
                    .help("a seeded fake machine (fakehw builds)"),
            ),
        "update" => base
            .arg(Arg::new("manifest").long("manifest").value_name("FILE").required(true).help("the release manifest"))
            .arg(Arg::new("signature").long("signature").value_name("FILE").help("its signature (default: MANIFEST.sig)")),
        WATCHDOG_COMMAND => base.arg(Arg::new("detached").long("detached").action(ArgAction::SetTrue)),
        "doctor" => base
            .arg(Arg::new("json").long("json").action(ArgAction::SetTrue).help("the checks as a JSON array"))
            .arg(Arg::new("strict").long("strict").action(ArgAction::SetTrue).help("exit 1 on a warning too")),
        "sim" => base
            .arg(
                Arg::new("nodes")
                    .long("nodes")
                    .value_name("N")
                    .required(true)
                    .value_parser(clap::value_parser!(u32))
                    .help("how many machines (at most 10000)"),
            )
            .arg(
                Arg::new("seed")
                    .long("seed")
                    .value_name("S")
                    .default_value("0")
                    .value_parser(clap::value_parser!(u64))
                    .help("machine i is the fake machine of seed S + i"),
            )
            .arg(
                Arg::new("data-dir")
                    .long("data-dir")
                    .value_name("DIR")
                    .required(true)
                    .help("machine i keeps its identity and journal in DIR/node-i"),
            ),
        _ => base,
    }
}

fn looks_like_a_command(text: &str) -> bool {
    !text.is_empty() && text.len() <= 32 && text.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
}

fn help() -> String {
    let mut text = String::from("bcd: the Better Compute node agent\n\nusage: bcd COMMAND [--flag value]\n\ncommands:\n");
    for (name, summary) in COMMANDS {
        text.push_str(&format!("  {name:<8} {summary}\n"));
    }
    text.push_str("\nexit codes: 0 ok, 1 failure, 2 usage. `bcd COMMAND -h` lists a command's flags.\n");
    text
}

/// A clap error, said without quoting what the user typed unless it is a flag's name.
fn usage_error(name: &str, error: clap::Error) -> ExitCode {
    let offending = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => Some(arg.clone()),
        _ => None,
    };
    let flag_name = offending
        .as_deref()
        .and_then(|a| a.split('=').next())
        .filter(|a| a.starts_with("--") && a.len() <= 34 && a[2..].bytes().all(|b| b.is_ascii_lowercase() || b == b'-'));
    match error.kind() {
        ErrorKind::UnknownArgument if flag_name.is_some() => {
            eprintln!("bcd {name}: unknown flag {}", flag_name.unwrap_or_default())
        }
        ErrorKind::UnknownArgument => {
            eprintln!("bcd {name}: takes no positional arguments");
            if name == "join" {
                eprintln!("bcd join reads the join token from BCD_JOIN_TOKEN, stdin or --token-file, never from arguments");
            }
        }
        ErrorKind::InvalidValue | ErrorKind::NoEquals => eprintln!("bcd {name}: a flag is missing its value"),
        _ => eprintln!("bcd {name}: bad usage (see bcd {name} -h)"),
    }
    ExitCode::from(2)
}

fn init_logging(config: Option<&Config>) {
    let level = config.and_then(|c| c.log.level.clone()).unwrap_or_else(|| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&level).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = match config.and_then(|c| c.log.format.as_deref()) {
        Some("json") => true,
        Some("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

fn main() -> ExitCode {
    // Before any thread exists: the token leaves the environment at once.
    let env_token = token::take_from_environment();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut args = std::env::args().skip(1);
    let Some(name) = args.next() else {
        eprint!("{}", help());
        return ExitCode::from(2);
    };
    let rest: Vec<String> = args.collect();
    let launch_args: Vec<String> = std::iter::once(name.clone()).chain(rest.iter().cloned()).collect();
    match name.as_str() {
        "help" | "-h" | "-help" | "--help" => {
            print!("{}", help());
            return ExitCode::SUCCESS;
        }
        "version" | "-version" | "--version" => {
            println!("bcd {}", bc_agent::update::running_version());
            return ExitCode::SUCCESS;
        }
        WATCHDOG_COMMAND => return run_watchdog(rest),
        "join" | "node" | "status" | "hardware" | "doctor" | "update" => {}
        "sim" if cfg!(feature = "fakehw") => {}
        "sim" => {
            eprintln!("bcd sim: this build has no fake machines (build with --features bc-agent/fakehw)");
            return ExitCode::from(2);
        }
        other if looks_like_a_command(other) => {
            eprintln!("bcd: unknown command {other:?} (see bcd help)");
            return ExitCode::from(2);
        }
        _ => {
            eprintln!("bcd: unknown command");
            return ExitCode::from(2);
        }
    }
    let name: &'static str = COMMANDS.iter().find(|(n, _)| *n == name).map(|(n, _)| *n).unwrap_or("node");
    let matches = match command(name).try_get_matches_from(rest) {
        Ok(m) => m,
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp) => {
            let _ = command(name).print_help();
            return ExitCode::SUCCESS;
        }
        Err(e) => return usage_error(name, e),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bcd: cannot start: {e}");
            return ExitCode::from(1);
        }
    };
    let (code, reexec) = runtime.block_on(async move {
        let code = match name {
            "join" => run_join(&matches, env_token).await,
            "node" => return run_node(&matches, launch_args).await,
            "hardware" => run_hardware(&matches),
            "doctor" => run_doctor(&matches).await,
            "sim" => run_sim(&matches, env_token).await,
            "update" => run_update(&matches),
            _ => run_status(&matches),
        };
        (code, None)
    });
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match reexec {
        None => code,
        Some((binary, args)) => {
            use std::os::unix::process::CommandExt as _;
            let e = std::process::Command::new(&binary).args(&args).exec();
            eprintln!("bcd node: re-executing {}: {e}", binary.display());
            ExitCode::from(1)
        }
    }
}

/// `bcd __update-watchdog --config C [--detached]` (hidden; see `bc_agent::update::watchdog`).
fn run_watchdog(rest: Vec<String>) -> ExitCode {
    let matches = match command(WATCHDOG_COMMAND).try_get_matches_from(rest) {
        Ok(m) => m,
        Err(e) => return usage_error(WATCHDOG_COMMAND, e),
    };
    let path = config_path(&matches);
    init_logging(Config::load(&path).ok().as_ref());
    match bc_agent::update::watchdog(&path, matches.get_flag("detached")) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "the update watchdog failed");
            eprintln!("bcd {WATCHDOG_COMMAND}: {e}");
            ExitCode::from(1)
        }
    }
}

/// `bcd update`: the release handed to the running `bcd node` over its status socket, which
/// decides and installs it as it does an `agent.update` (without a command to answer): the
/// answer, or the refusal with its code, exit 1.
fn run_update(matches: &ArgMatches) -> ExitCode {
    let config = match load_config("update", matches) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let manifest_path = PathBuf::from(matches.get_one::<String>("manifest").expect("required"));
    let signature_path = matches.get_one::<String>("signature").map(PathBuf::from).unwrap_or_else(|| {
        let mut name = manifest_path.as_os_str().to_owned();
        name.push(".sig");
        PathBuf::from(name)
    });
    let read = |path: &PathBuf, max: usize| -> Result<String, String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if meta.len() > max as u64 {
            return Err(format!("{} is over {max} bytes", path.display()));
        }
        std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    let (manifest, signature) = match (
        read(&manifest_path, bc_core::release::MANIFEST_BYTES_MAX),
        read(&signature_path, bc_core::release::SIGNATURE_BYTES_MAX),
    ) {
        (Ok(m), Ok(s)) => (m, s),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("bcd update: {e}");
            return ExitCode::from(2);
        }
    };
    let args = bc_agent::update::UpdateArgs { manifest, signature, rollout_id: None };
    match bc_agent::update::request(&config, &args) {
        Ok(answer) => {
            println!("{answer}");
            ExitCode::SUCCESS
        }
        Err(reason) => {
            eprintln!("bcd update: {reason}");
            ExitCode::from(1)
        }
    }
}

fn config_path(matches: &ArgMatches) -> PathBuf {
    PathBuf::from(matches.get_one::<String>("config").expect("has a default"))
}

fn load_config(name: &str, matches: &ArgMatches) -> Result<Config, ExitCode> {
    Config::load(&config_path(matches)).map_err(|e| {
        eprintln!("bcd {name}: {e}");
        ExitCode::from(1)
    })
}

async fn run_join(matches: &ArgMatches, env_token: Option<String>) -> ExitCode {
    let fail = |e: join::JoinError| {
        eprintln!("bcd join: {}", e.message);
        ExitCode::from(e.exit)
    };
    if matches.get_one::<String>("role").map(String::as_str) != Some("node") {
        return fail(join::usage("--role is node (site and ramdisk roles are not in this build)"));
    }
    let path = config_path(matches);
    let config = if !path.exists()
        && let Some(server) = matches.get_one::<String>("server")
    {
        let Some(log_key_pin) = matches.get_one::<String>("log-key-pin") else {
            return fail(join::usage("--server without a config.toml needs --log-key-pin (and --serving-ca-pin for https)"));
        };
        let config = Config {
            data_dir: PathBuf::from(matches.get_one::<String>("data-dir").expect("has a default")),
            gateway: server.clone(),
            serving_ca_spki_pin: matches.get_one::<String>("serving-ca-pin").cloned(),
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
        if let Err(e) = bc_core::keys::write_new_file(&path, text.as_bytes(), 0o600) {
            return fail(join::JoinError { exit: 1, message: e.to_string() });
        }
        match Config::load(&path) {
            Ok(c) => c,
            Err(e) => return fail(join::JoinError { exit: 1, message: e.to_string() }),
        }
    } else {
        match load_config("join", matches) {
            Ok(c) => c,
            Err(code) => return code,
        }
    };
    init_logging(Some(&config));
    for (flag, configured) in
        [("serving-ca-pin", config.serving_ca_spki_pin.as_deref()), ("log-key-pin", Some(config.log_key_pin.as_str()))]
    {
        if let Some(given) = matches.get_one::<String>(flag)
            && Some(given.as_str()) != configured
        {
            return fail(join::JoinError { exit: 1, message: format!("--{flag} differs from the configuration's pin") });
        }
    }
    if let Err(e) = std::fs::create_dir_all(&config.data_dir) {
        return fail(join::JoinError { exit: 1, message: format!("creating {}: {e}", config.data_dir.display()) });
    }
    if matches.get_flag("reset") {
        let files = join::reset_files(&config);
        if !matches.get_flag("yes") {
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
    let token_file = matches.get_one::<String>("token-file").map(PathBuf::from);
    let node_id = match matches.get_one::<String>("node-id") {
        None => None,
        Some(text) => match text.parse::<bc_core::id::NodeId>() {
            Ok(id) => Some(id.to_string()),
            Err(e) => return fail(join::usage(format!("--node-id: {e}"))),
        },
    };
    match (matches.get_one::<String>("attestor").map(String::as_str), &node_id) {
        (Some("join-token"), _) | (Some("provisioned"), Some(_)) => {}
        (Some("provisioned"), None) => return fail(join::usage("--attestor provisioned needs --node-id")),
        (other, _) => {
            return fail(join::usage(format!(
                "--attestor {:?} is not one this build has (join-token, provisioned)",
                other.unwrap_or("")
            )));
        }
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
            if let Some(path) = &token_file {
                join::remove_token_file(path);
            }
            println!("{message}");
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => return fail(e),
    }
    let stdin = std::io::stdin();
    let token = match token::read(env_token, stdin.is_terminal(), &mut stdin.lock(), token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => return fail(join::usage(e.0)),
    };
    match join::join(&config, token, token_file.as_deref(), node_id.as_deref()).await {
        Ok(join::Outcome::Joined(message) | join::Outcome::AlreadyJoined(message)) => {
            println!("{message}");
            ExitCode::SUCCESS
        }
        Err(e) => fail(e),
    }
}

/// What `bcd node` asks `main` to execute once the runtime is down: a binary and its arguments.
type Reexec = Option<(PathBuf, Vec<String>)>;

async fn run_node(matches: &ArgMatches, args: Vec<String>) -> (ExitCode, Reexec) {
    let config = match load_config("node", matches) {
        Ok(c) => c,
        Err(code) => return (code, None),
    };
    init_logging(Some(&config));
    let identity = match load_identity(&config) {
        Ok(Some(identity)) => identity,
        Ok(None) => {
            eprintln!("bcd node: agent: this node has not joined (run bcd join)");
            return (ExitCode::from(1), None);
        }
        Err(e) => {
            eprintln!("bcd node: {e}");
            return (ExitCode::from(1), None);
        }
    };
    let launch = bc_agent::update::Launch { config_path: config_path(matches), args: args.clone() };
    match bc_agent::driver::run_node(config, identity, Some(launch), shutdown_signal()).await {
        Ok(bc_agent::driver::Exit::Stopped) => (ExitCode::SUCCESS, None),
        Ok(bc_agent::driver::Exit::Reexec(binary)) => (ExitCode::SUCCESS, Some((binary, args))),
        Err(e) => {
            tracing::error!(error = %e, "bcd node cannot go on");
            eprintln!("bcd node: {e}");
            (ExitCode::from(1), None)
        }
    }
}

/// `bcd hardware`: the inventory as JSON; no GPUs is not a failure (the reason is in it).
fn run_hardware(matches: &ArgMatches) -> ExitCode {
    let root = matches.get_one::<String>("root").map(PathBuf::from);
    let seed = matches.get_one::<u64>("fake-hw").copied();
    match bc_agent::inventory::source(root.as_deref(), seed) {
        Ok(source) => {
            println!("{}", serde_json::to_string_pretty(&source.read()).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bcd hardware: {e}");
            ExitCode::from(2)
        }
    }
}

/// `bcd doctor`: one line per check (or `--json`, an array); exit 1 when one failed.
async fn run_doctor(matches: &ArgMatches) -> ExitCode {
    let checks = bc_agent::doctor::run(&config_path(matches)).await;
    if matches.get_flag("json") {
        println!("{}", serde_json::to_string_pretty(&checks).unwrap_or_default());
    } else {
        print!("{}", bc_agent::doctor::render(&checks));
    }
    ExitCode::from(bc_agent::doctor::exit_code(&checks, matches.get_flag("strict")))
}

#[cfg(feature = "fakehw")]
async fn run_sim(matches: &ArgMatches, env_token: Option<String>) -> ExitCode {
    let base = match load_config("sim", matches) {
        Ok(c) => c,
        Err(code) => return code,
    };
    init_logging(Some(&base));
    let nodes = *matches.get_one::<u32>("nodes").expect("required");
    let seed = *matches.get_one::<u64>("seed").expect("has a default");
    if let Err(e) = bc_agent::sim::check(nodes, seed) {
        eprintln!("bcd sim: {e}");
        return ExitCode::from(2);
    }
    let data_dir = PathBuf::from(matches.get_one::<String>("data-dir").expect("required"));
    let options = bc_agent::sim::SimOptions { nodes, seed, data_dir, base };
    let token = move || {
        let stdin = std::io::stdin();
        token::read(env_token, stdin.is_terminal(), &mut stdin.lock(), None).map(|t| t.secret).map_err(|e| e.0)
    };
    match bc_agent::sim::run(options, token, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bcd sim: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(not(feature = "fakehw"))]
async fn run_sim(_: &ArgMatches, _: Option<String>) -> ExitCode {
    ExitCode::from(2)
}

fn run_status(matches: &ArgMatches) -> ExitCode {
    let config = match load_config("status", matches) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match status::query(&config.socket_path()) {
        Ok(value) => {
            println!("{}", serde_json::to_string_pretty(&value).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bcd status: {e}");
            ExitCode::from(1)
        }
    }
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(t) => t,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
