//! `bcd`: reads the command line (`flags.rs`) and runs the command (`cli/`). Exit codes: 0
//! success (and an agent stopped by SIGINT or SIGTERM), 1 failure, 2 usage. No command takes a
//! positional argument, and bcd never echoes an unexpected one: a join token pasted on the
//! command line must not reach a terminal log.

use std::process::ExitCode;

use bc_agent::token;

mod cli;
mod flags;

fn main() -> ExitCode {
    // Before any thread exists: the token leaves the environment at once.
    let env_token = token::take_from_environment();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let words: Vec<String> = std::env::args().skip(1).collect();
    match flags::parse(&words) {
        flags::Parsed::Run(command) => command.run(env_token, words),
        flags::Parsed::Help => {
            print!("{}", flags::help());
            ExitCode::SUCCESS
        }
        flags::Parsed::Version => {
            println!("bcd {}", bc_agent::update::running_version());
            ExitCode::SUCCESS
        }
        flags::Parsed::CommandHelp(mut command) => {
            let _ = command.print_help();
            ExitCode::SUCCESS
        }
        flags::Parsed::Usage(text) => {
            eprint!("{text}");
            ExitCode::from(2)
        }
    }
}
