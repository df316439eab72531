//! Commands about the CLI itself, generated from its command tree (`flags::Cli`):
//! `completion bash|zsh|fish` (clap_complete) and `help [COMMAND…] [--json]`, whose JSON is the
//! whole manifest: every command and subcommand with every flag, its help, value names, default,
//! choices and whether it is required.

use clap::CommandFactory;
use clap::{Args, ValueEnum};
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::Cli;

#[derive(Args)]
pub struct CompletionArgs {
    #[arg(value_enum)]
    pub shell: CompletionShell,
}

#[derive(Args)]
pub struct HelpArgs {
    /// The command to describe (`help nodes drain`).
    pub command: Vec<String>,
    /// Every command, subcommand and flag as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

const BIN_NAME: &str = "better-compute";

/// clap_complete's bash script names the state of `better-compute reserve` two ways when the
/// binary's name has a hyphen (clap-rs/clap#6421, open in 4.6): the loop that reads the words
/// arrives at `better__compute__subcmd__reserve`, the `case` arms spell it
/// `better__subcmd__compute__subcmd__reserve`, so no subcommand's flags complete. The arms are
/// respelled the loop's way; once clap fixes it, there is nothing left to replace.
const BASH_STATE_MISSPELLED: &str = "better__subcmd__compute";
const BASH_STATE: &str = "better__compute";

pub fn completion(shell: CompletionShell) -> Result<(), CliError> {
    let shell = match shell {
        CompletionShell::Bash => clap_complete::Shell::Bash,
        CompletionShell::Zsh => clap_complete::Shell::Zsh,
        CompletionShell::Fish => clap_complete::Shell::Fish,
    };
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), BIN_NAME, &mut script);
    let mut script = String::from_utf8_lossy(&script).into_owned();
    if matches!(shell, clap_complete::Shell::Bash) {
        script = script.replace(BASH_STATE_MISSPELLED, BASH_STATE);
    }
    crate::output::emit(script.trim_end());
    Ok(())
}

pub fn help(path: &[String], json: bool) -> Result<(), CliError> {
    let mut root = Cli::command().bin_name(BIN_NAME);
    root.build();
    let mut command = &mut root;
    for (depth, name) in path.iter().enumerate() {
        let known: Vec<String> = command.get_subcommands().map(|c| c.get_name().to_owned()).collect();
        command = match command.find_subcommand_mut(name) {
            Some(sub) => sub,
            None => {
                let within = std::iter::once(BIN_NAME).chain(path[..depth].iter().map(String::as_str)).collect::<Vec<_>>();
                let mut e = CliError::usage(format!("no command {:?} in {}", name, within.join(" ")));
                if let Some(best) = super::nearest(name, known.iter().map(String::as_str)) {
                    e = e.hint(format!("did you mean {best}? (help lists the commands)"));
                }
                return Err(e);
            }
        };
    }
    if json {
        crate::output::emit(&crate::output::safe_json(&manifest(command), true));
    } else {
        crate::output::emit(command.render_long_help().to_string().trim_end());
    }
    Ok(())
}

/// One command and everything below it, as JSON.
pub fn manifest(command: &clap::Command) -> Value {
    let text = |s: Option<&clap::builder::StyledStr>| s.map(|s| s.to_string());
    let args: Vec<Value> = command
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .map(|a| {
            let takes_value = a.get_num_args().is_some_and(|n| n.takes_values());
            json!({
                "name": a.get_id().as_str(),
                "long": a.get_long().map(|l| format!("--{l}")),
                "short": a.get_short().map(|s| format!("-{s}")),
                "positional": a.is_positional(),
                "help": text(a.get_long_help().or(a.get_help())),
                "takesValue": takes_value,
                "valueNames": a.get_value_names().map(|v| v.iter().map(|n| n.as_str()).collect::<Vec<_>>()),
                "multiple": matches!(a.get_action(), clap::ArgAction::Append | clap::ArgAction::Count),
                "required": a.is_required_set(),
                "default": a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect::<Vec<_>>(),
                "choices": a.get_possible_values().iter().map(|v| v.get_name()).collect::<Vec<_>>(),
                "env": a.get_env().map(|e| e.to_string_lossy().into_owned()),
                "global": a.is_global_set(),
            })
        })
        .collect();
    let commands: Vec<Value> = command.get_subcommands().filter(|c| !c.is_hide_set()).map(manifest).collect();
    json!({
        "name": command.get_name(),
        "path": command.get_bin_name().unwrap_or(command.get_name()),
        "about": text(command.get_about()),
        "longAbout": text(command.get_long_about()),
        "version": command.get_version(),
        "args": args,
        "commands": commands,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manifest_names_every_command_and_flag() {
        let mut root = Cli::command().bin_name(BIN_NAME);
        root.build();
        let m = manifest(&root);
        let names: Vec<&str> = m["commands"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
        for expected in ["dev", "serve", "api", "events", "reserve", "webhooks", "completion", "help"] {
            assert!(names.contains(&expected), "{expected} in {names:?}");
        }
        let reserve = m["commands"].as_array().unwrap().iter().find(|c| c["name"] == "reserve").unwrap();
        assert_eq!(reserve["path"], "better-compute reserve");
        let wait = reserve["args"].as_array().unwrap().iter().find(|a| a["long"] == "--wait").unwrap();
        assert_eq!(wait["default"], json!(["20"]));
        let pool = reserve["args"].as_array().unwrap().iter().find(|a| a["long"] == "--pool").unwrap();
        assert_eq!(pool["required"], true);
        let format = m["args"].as_array().unwrap().iter().find(|a| a["long"] == "--format").unwrap();
        assert_eq!(format["choices"], json!(["json", "compact", "table"]));
    }
}
