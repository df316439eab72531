//! Running what [`crate::flags`] parsed: [`Command::run`] starts the runtime and calls the
//! command's function, here or in `join.rs` (`bcd join`). Each prints its own failure as
//! `bcd COMMAND: message` and returns the exit code: 0 ok, 1 failure, 2 usage.

mod join;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bc_agent::config::{Config, load_identity};
use bc_agent::update::WATCHDOG_COMMAND;

use crate::flags::{Command, DoctorArgs, HardwareArgs, SupportBundleArgs, UpdateArgs, WatchdogArgs};

/// What `bcd node` asks to execute once the runtime is down: a binary and its arguments.
type Reexec = Option<(PathBuf, Vec<String>)>;

impl Command {
    /// Runs the command. `env_token` is `BCD_JOIN_TOKEN`, taken out of the environment at start;
    /// `words` are the arguments bcd was given, which `bcd node` re-executes itself with after a
    /// self-update.
    pub fn run(self, env_token: Option<String>, words: Vec<String>) -> ExitCode {
        // The watchdog outlives the agent it watches, and needs no runtime.
        if let Command::UpdateWatchdog(args) = &self {
            return watchdog(args);
        }
        let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
            Ok(r) => r,
            Err(e) => {
                eprintln!("bcd: cannot start: {e}");
                return ExitCode::from(1);
            }
        };
        let (code, reexec) = runtime.block_on(async move {
            let code = match self {
                Command::Join(args) => join::run(&args, env_token).await,
                Command::Node(config) => return node(&config.path, words).await,
                Command::Hardware(args) => hardware(&args),
                Command::Doctor(args) => doctor(&args).await,
                Command::SupportBundle(args) => support_bundle(&args, env_token.as_deref()).await,
                #[cfg(feature = "fakehw")]
                Command::Sim(args) => sim(&args, env_token).await,
                Command::Update(args) => update(&args),
                Command::Status(config) => status(&config.path),
                Command::UpdateWatchdog(_) => unreachable!("the watchdog runs without a runtime"),
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
}

fn init_logging(config: Option<&Config>) {
    let level = config.and_then(|c| c.log.level.clone()).unwrap_or_else(|| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&level).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // The TSS binding's every context close and handle flush are at info: only its warnings.
    #[cfg(feature = "tpm")]
    let filter = filter.add_directive("tss_esapi=warn".parse().expect("a valid directive"));
    let json = match config.and_then(|c| c.log.format.as_deref()) {
        Some("json") => true,
        Some("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

fn load_config(name: &str, path: &Path) -> Result<Config, ExitCode> {
    Config::load(path).map_err(|e| {
        eprintln!("bcd {name}: {e}");
        ExitCode::from(1)
    })
}

/// `bcd __update-watchdog --config C [--detached]` (hidden; see `bc_agent::update::watchdog`).
fn watchdog(args: &WatchdogArgs) -> ExitCode {
    let path = &args.config.path;
    init_logging(Config::load(path).ok().as_ref());
    match bc_agent::update::watchdog(path, args.detached) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(target: "bcd", error = %e, "the update watchdog failed");
            eprintln!("bcd {WATCHDOG_COMMAND}: {e}");
            ExitCode::from(1)
        }
    }
}

/// `bcd update`: the release handed to the running `bcd node` over its status socket, which
/// decides and installs it as it does an `agent.update` (without a command to answer): the
/// answer, or the refusal with its code, exit 1.
fn update(args: &UpdateArgs) -> ExitCode {
    let config = match load_config("update", &args.config.path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let read = |path: &Path, max: usize| -> Result<String, String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        if meta.len() > max as u64 {
            return Err(format!("{} is over {max} bytes", path.display()));
        }
        std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
    };
    let (manifest, signature) = match (
        read(&args.manifest, bc_core::release::MANIFEST_BYTES_MAX),
        read(&args.signature_path(), bc_core::release::SIGNATURE_BYTES_MAX),
    ) {
        (Ok(m), Ok(s)) => (m, s),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("bcd update: {e}");
            return ExitCode::from(2);
        }
    };
    let request = bc_agent::update::UpdateArgs { manifest, signature, rollout_id: None };
    match bc_agent::update::request(&config, &request) {
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

/// `bcd node`: the agent, until a signal, or until a self-update asks to re-execute.
async fn node(config_path: &Path, words: Vec<String>) -> (ExitCode, Reexec) {
    let config = match load_config("node", config_path) {
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
    let launch = bc_agent::update::Launch { config_path: config_path.to_owned(), args: words.clone() };
    match bc_agent::driver::run_node(config, identity, Some(launch), shutdown_signal()).await {
        Ok(bc_agent::driver::Exit::Stopped) => (ExitCode::SUCCESS, None),
        Ok(bc_agent::driver::Exit::Reexec(binary)) => (ExitCode::SUCCESS, Some((binary, words))),
        Err(e) => {
            tracing::error!(target: "bcd", error = %e, "bcd node cannot go on");
            eprintln!("bcd node: {e}");
            (ExitCode::from(1), None)
        }
    }
}

/// `bcd hardware`: the inventory as JSON; no GPUs is not a failure (the reason is in it).
fn hardware(args: &HardwareArgs) -> ExitCode {
    match bc_agent::inventory::source(args.root.as_deref(), args.fake_hw) {
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
async fn doctor(args: &DoctorArgs) -> ExitCode {
    let checks = bc_agent::doctor::run(&args.config.path).await;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&checks).unwrap_or_default());
    } else {
        print!("{}", bc_agent::doctor::render(&checks));
    }
    ExitCode::from(bc_agent::doctor::exit_code(&checks, args.strict))
}

/// `bcd support-bundle`: the bundle written (its summary as JSON), or why not, exit 1 (an
/// existing --out among them: never written over).
async fn support_bundle(args: &SupportBundleArgs, env_token: Option<&str>) -> ExitCode {
    let options = bc_agent::support_bundle::NodeBundleOptions {
        config_path: &args.config.path,
        out: &args.out,
        log_file: args.log_file.as_deref(),
        log_lines: args.log_lines as usize,
        join_token: env_token,
        progress: std::io::stderr().is_terminal(),
    };
    match bc_agent::support_bundle::node_bundle(&options).await {
        Ok(summary) => {
            println!("{}", serde_json::to_string_pretty(&summary).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bcd support-bundle: {e}");
            ExitCode::from(1)
        }
    }
}

/// `bcd sim`: N agents on seeded fake machines, until a signal.
#[cfg(feature = "fakehw")]
async fn sim(args: &crate::flags::SimArgs, env_token: Option<String>) -> ExitCode {
    let base = match load_config("sim", &args.config.path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    init_logging(Some(&base));
    if let Err(e) = bc_agent::sim::check(args.nodes, args.seed) {
        eprintln!("bcd sim: {e}");
        return ExitCode::from(2);
    }
    let options = bc_agent::sim::SimOptions { nodes: args.nodes, seed: args.seed, data_dir: args.data_dir.clone(), base };
    let token = move || {
        let stdin = std::io::stdin();
        bc_agent::token::read(env_token, stdin.is_terminal(), &mut stdin.lock(), None).map(|t| t.secret).map_err(|e| e.0)
    };
    match bc_agent::sim::run(options, token, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bcd sim: {e}");
            ExitCode::from(1)
        }
    }
}

/// `bcd status`: the running agent's answer on its socket, as JSON.
fn status(config_path: &Path) -> ExitCode {
    let config = match load_config("status", config_path) {
        Ok(c) => c,
        Err(code) => return code,
    };
    match bc_agent::status::query(&config.socket_path()) {
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
