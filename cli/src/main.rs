//! `better-compute`: the composition root (it wires a store, the log and the gateway into
//! `dev`, `serve` and `reconcile`) and the client of the API.
//!
//! `main` parses the command line ([`flags::Cli`]) and runs the command ([`flags::Command::run`]):
//! nothing else. Each command group lives in `commands/<group>.rs`, its clap types beside its
//! `run`. The CLI names no method it cannot find in the gateway's table (a test reads every
//! method name in `src/` against it), and what it prints is either the server's JSON untouched
//! (`--format json|compact`, `--query`) or a table of chosen columns, terminal-safe.
//!
//! Exit status: 0 on success, 2 for a usage mistake (`INVALID_ARGUMENT`), 1 for anything else.
//! A failure prints `CODE: message` and, when there is one, a `hint:` line; with
//! `BETTER_COMPUTE_DEBUG=1`, its chain of causes between the two. `dev`, `serve`, `reconcile`
//! and the operator commands read `better-compute.toml` under their flags (`config`).

use std::io::IsTerminal;
use std::process::ExitCode;

mod audit;
mod client;
mod commands;
mod config;
mod credentials;
mod doctor;
mod flags;
mod follow;
mod output;
mod roles;
mod server;
mod sim;
mod sim_agents;
mod support_bundle;
mod tables;
mod tunnel;
mod watch;

/// mimalloc rather than glibc's malloc: a run of the simulator spent a fifth of its time in
/// glibc's `malloc` and `free` (profiled with `perf`, 300 nodes), and the server allocates on
/// the same paths (rows, JSON documents, events).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // The flags, over the configuration file's settings for the commands that read it.
    let cli = match config::parse_cli(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(config::ParseError::Clap(e))
            if matches!(e.kind(), clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion) =>
        {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(config::ParseError::Clap(e)) => {
            let rendered = e.render().to_string();
            eprintln!("INVALID_ARGUMENT: {}", rendered.trim_start_matches("error: ").trim_end());
            return ExitCode::from(2);
        }
        Err(config::ParseError::Config(e)) => return report(&e),
    };
    // A simulation's agents and reconcilers log every command at info: only warnings by default.
    let quiet = matches!(&cli.command, flags::Command::Sim { command: commands::sim::SimCommand::Run { .. } });
    init_tracing(if quiet { "warn" } else { "info,sqlx=warn,tower_http=info" });
    let _ = rustls::crypto::ring::default_provider().install_default();
    // `sim run` is one thread: the world, its log's appender task and every agent on
    // a current-thread runtime. sqlx's SQLite connections still do their blocking calls on
    // their own worker threads (see README, "sim run").
    let built =
        if quiet { tokio::runtime::Builder::new_current_thread().enable_all().build() } else { tokio::runtime::Runtime::new() };
    let runtime = match built {
        Ok(r) => r,
        Err(e) => {
            eprintln!("INTERNAL: starting the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let context = commands::Context::new(cli.global);
    match runtime.block_on(cli.command.run(&context)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => report(&e),
    }
}

/// `BETTER_COMPUTE_DEBUG=1`: a failure prints its chain of causes under its message.
pub const DEBUG_ENV: &str = "BETTER_COMPUTE_DEBUG";

/// Prints a failure on stderr (`CODE: message`, with `BETTER_COMPUTE_DEBUG=1` a `caused by:`
/// line per cause, then the hint) and returns its exit status.
fn report(e: &client::CliError) -> ExitCode {
    eprint!("{}", output::error_text(e, std::env::var(DEBUG_ENV).is_ok_and(|v| v == "1")));
    ExitCode::from(e.exit_status())
}

/// Targets whose debug output carries statement parameters (webhook secrets, token hashes):
/// never below `info`, whatever `BETTER_COMPUTE_LOG` asks. tokio-postgres logs every statement's
/// parameters at debug (`tokio_postgres::query`).
const SECRET_BEARING_TARGETS: &[&str] = &["tokio_postgres=info"];

/// Logs go to stderr: human-readable on a terminal, JSON otherwise.
fn init_tracing(default_filter: &str) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_env("BETTER_COMPUTE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    for directive in SECRET_BEARING_TARGETS {
        filter = filter.add_directive(directive.parse().expect("a valid directive"));
    }
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if std::io::stderr().is_terminal() {
        builder.init();
    } else {
        builder.json().init();
    }
}
