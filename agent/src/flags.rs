//! Every command and flag of `bcd`, as clap types, and the reading of its command line, nothing
//! that runs them (`cli/` does).
//!
//! [`parse`] reads the first word by hand, before clap: `help`, `version`, an unknown command
//! (echoed only when it looks like a command's name) and `sim` in a build without fake machines
//! never reach clap. The rest is [`Command`], a clap subcommand. A clap error is said in words of
//! our own ([`usage`]) that quote nothing the user typed but a flag's name, so a join token
//! pasted on the command line never reaches a terminal log.
//!
//! A join token is never a flag, nor a clap `env`: `main` takes `BCD_JOIN_TOKEN` out of the
//! environment before any thread starts, and the rest is [`bc_agent::token`]'s (standard
//! input, `--token-file`).

use std::path::PathBuf;

use bc_agent::config::{CONFIG_DEFAULT, DATA_DIR_DEFAULT};
use bc_agent::update::WATCHDOG_COMMAND;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{Args, CommandFactory as _, Parser, Subcommand};

/// The commands `bcd help` lists, with what each does.
pub const COMMANDS: &[(&str, &str)] = &[
    ("join", "join this machine to the fleet (the token from BCD_JOIN_TOKEN, standard input or --token-file)"),
    ("node", "run the node agent: the session to the gateway, the journal, commands"),
    ("status", "what the running agent is doing (JSON, from its socket)"),
    ("hardware", "what this machine holds, as JSON: GPUs (NVML) and the host (/proc, /sys)"),
    ("update", "take a signed release by hand: --manifest M --signature S (see bcd update -h)"),
    ("doctor", "check the configuration, the node's files, the gateway, the clock, NVML, vfio, libvirt"),
    ("support-bundle", "write a tar.gz to send when asking for help (--out FILE): versions, config and doctor, no secret"),
    ("sim", "run N agents on seeded fake machines in one process (fakehw builds)"),
    ("version", "print the version"),
    ("help", "this list"),
];

/// The command line, its first word the command's name ([`parse`] has checked it).
#[derive(Parser)]
#[command(name = "bcd", no_binary_name = true, disable_help_subcommand = true)]
struct Bcd {
    #[command(subcommand)]
    command: Command,
}

// The variants carry no doc comments: clap would print them atop each command's help, which
// has none (the summaries are in `COMMANDS`).
#[derive(Subcommand)]
pub enum Command {
    Join(JoinArgs),
    Node(ConfigFile),
    Status(ConfigFile),
    Hardware(HardwareArgs),
    Update(UpdateArgs),
    Doctor(DoctorArgs),
    SupportBundle(SupportBundleArgs),
    #[cfg(feature = "fakehw")]
    Sim(SimArgs),
    // `bc_agent::update::watchdog`, started by `bcd node` itself.
    #[command(name = WATCHDOG_COMMAND, hide = true)]
    UpdateWatchdog(WatchdogArgs),
}

// The flag groups carry `//` comments: a `///` on them would print atop the command's help.

// `--config`, which every command but `hardware` takes.
#[derive(Args)]
pub struct ConfigFile {
    /// the configuration file
    #[arg(long = "config", value_name = "FILE", default_value = CONFIG_DEFAULT)]
    pub path: PathBuf,
}

// `bcd join`. The token is not among them: see the module's header.
#[derive(Args)]
pub struct JoinArgs {
    #[command(flatten)]
    pub config: ConfigFile,
    /// read the token from this file (0600 or 0400, removed once joined)
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// node (the only role this build has)
    #[arg(long, value_name = "ROLE", default_value = "node")]
    pub role: String,
    /// the node an installed system joins as (a bare-metal deploy's join token); implies
    /// --attestor provisioned
    #[arg(long, value_name = "NODE")]
    pub node_id: Option<String>,
    /// join-token; provisioned (with --node-id); or tpm: the machine's TPM proves it, no token
    /// (BCD_TPM_TCTI names the TPM, default device:/dev/tpmrm0)
    #[arg(long, value_name = "ATTESTOR", default_value = "join-token")]
    pub attestor: String,
    /// the control plane (https://HOST:PORT): config.toml and join-encryption.jwk are written
    /// from its /.well-known/better-compute, checked against the pins given; with
    /// --log-key-pin and no join pin, the agents' endpoint itself (config.toml only)
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// sha256/… of the gateway's serving key; must equal serving_ca_spki_pin
    #[arg(long, value_name = "PIN")]
    pub serving_ca_pin: Option<String>,
    /// sha256/… of the join signing key; must equal join_signing_key_pin
    #[arg(long, value_name = "PIN")]
    pub join_signing_pin: Option<String>,
    /// sha256/… of the join encryption key; must equal join_encryption_key_pin
    #[arg(long, value_name = "PIN")]
    pub join_encryption_pin: Option<String>,
    /// sha256/… of the log key; must equal log_key_pin
    #[arg(long, value_name = "PIN")]
    pub log_key_pin: Option<String>,
    /// the data_dir a written config.toml names
    #[arg(long, value_name = "DIR", default_value = DATA_DIR_DEFAULT)]
    pub data_dir: PathBuf,
    /// move this node's identity and journal aside first
    #[arg(long)]
    pub reset: bool,
    /// confirm --reset
    #[arg(long)]
    pub yes: bool,
    /// ask to join without a token and wait for an operator's decision (joinRequests.approve)
    #[arg(long)]
    pub request: bool,
}

impl JoinArgs {
    /// Whether `--server` names the control plane, whose well-known document is fetched: a join
    /// pin is given, or no `--log-key-pin` (with `--log-key-pin` alone, `--server` is the
    /// agents' endpoint, as before the document existed).
    pub fn joins_from_well_known(&self) -> bool {
        self.join_signing_pin.is_some() || self.join_encryption_pin.is_some() || self.log_key_pin.is_none()
    }

    /// `--role`: `node` is the only role this build has.
    pub fn check_role(&self) -> Result<(), &'static str> {
        if self.role == "node" { Ok(()) } else { Err("--role is node (site and ramdisk roles are not in this build)") }
    }

    /// `--request`: a machine with no credential asks; a token or an attestor is another way.
    pub fn check_request(&self) -> Result<(), &'static str> {
        if self.request && (self.token_file.is_some() || self.node_id.is_some() || self.attestor != "join-token") {
            return Err("--request asks to join with no credential: it takes no --token-file, --node-id or --attestor");
        }
        Ok(())
    }

    /// `--attestor`: `join-token`, `provisioned` when `--node-id` named a node, or `tpm` (no
    /// token: neither `--token-file` nor `--node-id`; only in builds with the `tpm` feature).
    pub fn check_attestor(&self, has_node_id: bool) -> Result<(), String> {
        match (self.attestor.as_str(), has_node_id) {
            ("join-token", _) | ("provisioned", true) => Ok(()),
            ("provisioned", false) => Err("--attestor provisioned needs --node-id".into()),
            ("tpm", _) if !cfg!(feature = "tpm") => {
                Err("--attestor tpm: this build has no TPM support (build bcd with --features bc-agent/tpm)".into())
            }
            ("tpm", true) => Err("--attestor tpm joins as the node the TPM names: it takes no --node-id".into()),
            ("tpm", false) if self.token_file.is_some() => {
                Err("--attestor tpm joins with the machine's TPM and no token: it takes no --token-file".into())
            }
            ("tpm", false) => Ok(()),
            // Issue 61 item 5: a cloud instance identity document needs a cloud; there is none here.
            ("cloud-iid", _) => Err(
                "--attestor cloud-iid joins with a cloud instance's signed identity document, which this build does not accept (no cloud here): join with a token (BCD_JOIN_TOKEN, standard input or --token-file)"
                    .into(),
            ),
            (other, _) => Err(format!("--attestor {other:?} is not one this build has (join-token, provisioned, tpm)")),
        }
    }
}

// `bcd hardware`: no configuration, so no `--config`.
#[derive(Args)]
pub struct HardwareArgs {
    /// read /proc and /sys under DIR (a fake tree)
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,
    /// a seeded fake machine (fakehw builds)
    #[arg(long, value_name = "SEED")]
    pub fake_hw: Option<u64>,
}

// `bcd update`.
#[derive(Args)]
pub struct UpdateArgs {
    #[command(flatten)]
    pub config: ConfigFile,
    /// the release manifest
    #[arg(long, value_name = "FILE")]
    pub manifest: PathBuf,
    /// its signature (default: MANIFEST.sig)
    #[arg(long, value_name = "FILE")]
    pub signature: Option<PathBuf>,
}

impl UpdateArgs {
    /// `--signature`, or the manifest's path with `.sig` added.
    pub fn signature_path(&self) -> PathBuf {
        self.signature.clone().unwrap_or_else(|| {
            let mut name = self.manifest.as_os_str().to_owned();
            name.push(".sig");
            PathBuf::from(name)
        })
    }
}

// `bcd doctor`.
#[derive(Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub config: ConfigFile,
    /// the checks as a JSON array
    #[arg(long)]
    pub json: bool,
    /// exit 1 on a warning too
    #[arg(long)]
    pub strict: bool,
}

// `bcd support-bundle`.
#[derive(Args)]
pub struct SupportBundleArgs {
    #[command(flatten)]
    pub config: ConfigFile,
    /// the bundle to write (a new file, 0600; never over an existing one)
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// a file holding bcd's log (e.g. `journalctl -u bcd > FILE`): its last --log-lines lines go in
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,
    /// how many of the log's last lines
    #[arg(long, value_name = "N", default_value_t = bc_agent::support_bundle::LOG_LINES_DEFAULT as u32,
          value_parser = clap::value_parser!(u32).range(1..=bc_agent::support_bundle::LOG_LINES_MAX as i64))]
    pub log_lines: u32,
}

// `bcd sim` (fakehw builds).
#[cfg(feature = "fakehw")]
#[derive(Args)]
pub struct SimArgs {
    #[command(flatten)]
    pub config: ConfigFile,
    /// how many machines (at most 10000)
    #[arg(long, value_name = "N")]
    pub nodes: u32,
    /// machine i is the fake machine of seed S + i
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// machine i keeps its identity and journal in DIR/node-i
    #[arg(long, value_name = "DIR")]
    pub data_dir: PathBuf,
}

// `bcd __update-watchdog`: the first stage (without `--detached`) starts the second.
#[derive(Args)]
pub struct WatchdogArgs {
    #[command(flatten)]
    pub config: ConfigFile,
    #[arg(long)]
    pub detached: bool,
}

/// What the command line asks for.
// Made once per process: the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Parsed {
    /// Run this command.
    Run(Command),
    /// The command list on standard output (`bcd help`, `-h`), exit 0.
    Help,
    /// `bcd version`, exit 0.
    Version,
    /// A command's flags on standard output (`bcd join -h`), exit 0. The command is taken out of
    /// the tree, so that its usage line reads `join [OPTIONS]`, not `bcd join [OPTIONS]`.
    CommandHelp(Box<clap::Command>),
    /// A usage mistake: this text on standard error, exit 2.
    Usage(String),
}

/// Reads the words after `bcd`.
pub fn parse(words: &[String]) -> Parsed {
    let Some(word) = words.first() else {
        return Parsed::Usage(help());
    };
    match word.as_str() {
        "help" | "-h" | "-help" | "--help" => return Parsed::Help,
        "version" | "-version" | "--version" => return Parsed::Version,
        "sim" if !cfg!(feature = "fakehw") => {
            return Parsed::Usage("bcd sim: this build has no fake machines (build with --features bc-agent/fakehw)\n".into());
        }
        _ => {}
    }
    let Some(name) = COMMANDS.iter().map(|(n, _)| *n).chain([WATCHDOG_COMMAND]).find(|n| n == word) else {
        return Parsed::Usage(if looks_like_a_command(word) {
            format!("bcd: unknown command {word:?} (see bcd help)\n")
        } else {
            "bcd: unknown command\n".into()
        });
    };
    match Bcd::try_parse_from(words) {
        Ok(bcd) => Parsed::Run(bcd.command),
        // The watchdog is not for people: it has no help.
        Err(e) if e.kind() == ErrorKind::DisplayHelp && name != WATCHDOG_COMMAND => match Bcd::command().find_subcommand(name) {
            Some(command) => Parsed::CommandHelp(Box::new(command.clone())),
            None => Parsed::Usage(usage(name, &e)),
        },
        Err(e) => Parsed::Usage(usage(name, &e)),
    }
}

fn looks_like_a_command(text: &str) -> bool {
    !text.is_empty() && text.len() <= 32 && text.bytes().all(|b| b.is_ascii_lowercase() || b == b'-')
}

/// The command list.
pub fn help() -> String {
    let mut text = String::from("bcd: the Better Compute node agent\n\nusage: bcd COMMAND [--flag value]\n\ncommands:\n");
    let width = COMMANDS.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    for (name, summary) in COMMANDS {
        text.push_str(&format!("  {name:<width$} {summary}\n"));
    }
    text.push_str("\nexit codes: 0 ok, 1 failure, 2 usage. `bcd COMMAND -h` lists a command's flags.\n");
    text
}

/// A clap error in our words, without quoting what the user typed unless it is a flag's name.
fn usage(name: &str, error: &clap::Error) -> String {
    let offending = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => Some(arg.as_str()),
        _ => None,
    };
    let flag_name = offending
        .and_then(|a| a.split('=').next())
        .filter(|a| a.starts_with("--") && a.len() <= 34 && a[2..].bytes().all(|b| b.is_ascii_lowercase() || b == b'-'));
    match (error.kind(), flag_name) {
        (ErrorKind::UnknownArgument, Some(flag)) => format!("bcd {name}: unknown flag {flag}\n"),
        (ErrorKind::UnknownArgument, None) if name == "join" => "bcd join: takes no positional arguments\n\
             bcd join reads the join token from BCD_JOIN_TOKEN, stdin or --token-file, never from arguments\n"
            .into(),
        (ErrorKind::UnknownArgument, None) => format!("bcd {name}: takes no positional arguments\n"),
        (ErrorKind::InvalidValue | ErrorKind::NoEquals, _) => format!("bcd {name}: a flag is missing its value\n"),
        _ => format!("bcd {name}: bad usage (see bcd {name} -h)\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_words(words: &[&str]) -> Parsed {
        parse(&words.iter().map(|w| w.to_string()).collect::<Vec<_>>())
    }

    fn run(words: &[&str]) -> Command {
        match parse_words(words) {
            Parsed::Run(command) => command,
            Parsed::Usage(text) => panic!("{words:?}: usage: {text}"),
            _ => panic!("{words:?}: not a command to run"),
        }
    }

    fn usage_of(words: &[&str]) -> String {
        match parse_words(words) {
            Parsed::Usage(text) => text,
            _ => panic!("{words:?}: not a usage mistake"),
        }
    }

    #[test]
    fn the_command_tree_is_consistent() {
        Bcd::command().debug_assert();
    }

    #[test]
    fn the_command_list_names_every_command() {
        let built = |n: &&str| cfg!(feature = "fakehw") || *n != "sim";
        let listed: Vec<&str> =
            COMMANDS.iter().map(|(n, _)| *n).filter(|n| !["version", "help"].contains(n) && built(n)).collect();
        let tree = Bcd::command();
        let commands: Vec<&str> = tree.get_subcommands().filter(|c| !c.is_hide_set()).map(|c| c.get_name()).collect();
        assert_eq!(listed, commands);
    }

    #[test]
    fn the_first_word() {
        assert!(matches!(parse_words(&[]), Parsed::Usage(text) if text == help()));
        for word in ["help", "-h", "-help", "--help"] {
            assert!(matches!(parse_words(&[word]), Parsed::Help), "{word}");
        }
        for word in ["version", "-version", "--version"] {
            assert!(matches!(parse_words(&[word, "--anything"]), Parsed::Version), "{word}");
        }
        assert_eq!(usage_of(&["frobnicate"]), "bcd: unknown command \"frobnicate\" (see bcd help)\n");
        // A token, or anything that does not look like a command's name, is not echoed.
        for word in ["bcjt_jt_01abc", "Join", "", "a b", &"x".repeat(33)] {
            assert_eq!(usage_of(&[word]), "bcd: unknown command\n", "{word}");
        }
    }

    #[test]
    fn defaults() {
        let Command::Join(join) = run(&["join"]) else { panic!("not join") };
        assert_eq!(join.config.path, PathBuf::from(CONFIG_DEFAULT));
        assert_eq!((join.role.as_str(), join.attestor.as_str()), ("node", "join-token"));
        assert_eq!(join.data_dir, PathBuf::from(DATA_DIR_DEFAULT));
        assert!(join.token_file.is_none() && join.node_id.is_none() && join.server.is_none());
        assert!(join.serving_ca_pin.is_none() && join.log_key_pin.is_none());
        assert!(!join.reset && !join.yes);
        let Command::Node(config) = run(&["node", "--config", "/c.toml"]) else { panic!("not node") };
        assert_eq!(config.path, PathBuf::from("/c.toml"));
        let Command::Doctor(doctor) = run(&["doctor"]) else { panic!("not doctor") };
        assert!(!doctor.json && !doctor.strict);
        let Command::Hardware(hardware) = run(&["hardware", "--fake-hw", "7"]) else { panic!("not hardware") };
        assert_eq!((hardware.root, hardware.fake_hw), (None, Some(7)));
        let Command::UpdateWatchdog(watchdog) = run(&[WATCHDOG_COMMAND, "--config", "/c.toml", "--detached"]) else {
            panic!("not the watchdog")
        };
        assert!(watchdog.detached);
    }

    #[test]
    fn required_flags() {
        assert_eq!(usage_of(&["update"]), "bcd update: bad usage (see bcd update -h)\n");
        let Command::Update(update) = run(&["update", "--manifest", "/r/m.json"]) else { panic!("not update") };
        assert_eq!(update.signature_path(), PathBuf::from("/r/m.json.sig"));
        let Command::Update(update) = run(&["update", "--manifest", "m", "--signature", "s"]) else { panic!("not update") };
        assert_eq!(update.signature_path(), PathBuf::from("s"));
    }

    #[test]
    fn a_support_bundle_needs_its_out_and_bounds_its_log_lines() {
        assert_eq!(usage_of(&["support-bundle"]), "bcd support-bundle: bad usage (see bcd support-bundle -h)\n");
        let Command::SupportBundle(args) = run(&["support-bundle", "--out", "b.tgz"]) else { panic!("not support-bundle") };
        assert_eq!((args.out, args.log_file, args.log_lines), (PathBuf::from("b.tgz"), None, 1000));
        assert_eq!(args.config.path, PathBuf::from(CONFIG_DEFAULT));
        assert!(matches!(parse_words(&["support-bundle", "--out", "b", "--log-lines", "0"]), Parsed::Usage(_)));
        assert!(matches!(parse_words(&["support-bundle", "--out", "b", "--log-lines", "100001"]), Parsed::Usage(_)));
    }

    #[cfg(feature = "fakehw")]
    #[test]
    fn sim_needs_nodes_and_a_data_dir() {
        assert_eq!(usage_of(&["sim", "--nodes", "2"]), "bcd sim: bad usage (see bcd sim -h)\n");
        assert_eq!(usage_of(&["sim", "--data-dir", "d"]), "bcd sim: bad usage (see bcd sim -h)\n");
        assert_eq!(usage_of(&["sim", "--nodes", "many", "--data-dir", "d"]), "bcd sim: bad usage (see bcd sim -h)\n");
        let Command::Sim(sim) = run(&["sim", "--nodes", "3", "--data-dir", "d"]) else { panic!("not sim") };
        assert_eq!((sim.nodes, sim.seed, sim.data_dir), (3, 0, PathBuf::from("d")));
    }

    #[cfg(not(feature = "fakehw"))]
    #[test]
    fn sim_is_a_usage_mistake_without_fake_machines() {
        assert!(usage_of(&["sim", "--nodes", "3"]).contains("this build has no fake machines"));
    }

    #[test]
    fn a_token_on_the_command_line_is_never_echoed() {
        let token = "bcjt_jt_01secret";
        let text = usage_of(&["join", token]);
        assert_eq!(
            text,
            "bcd join: takes no positional arguments\n\
             bcd join reads the join token from BCD_JOIN_TOKEN, stdin or --token-file, never from arguments\n"
        );
        assert_eq!(usage_of(&["node", "--config", "c", token]), "bcd node: takes no positional arguments\n");
        // Unknown flags are named, but only when they look like flags.
        assert_eq!(usage_of(&["join", "--bogus=x"]), "bcd join: unknown flag --bogus\n");
        assert_eq!(
            usage_of(&["join", &format!("--{token}")]),
            "bcd join: takes no positional arguments\nbcd join reads the join token from BCD_JOIN_TOKEN, stdin or --token-file, never from arguments\n"
        );
        assert_eq!(usage_of(&["join", "--config"]), "bcd join: a flag is missing its value\n");
        for text in [usage_of(&["hardware", "--fake-hw", token]), usage_of(&["join", "-x"])] {
            assert!(!text.contains(token) && !text.contains("-x"), "{text}");
        }
    }

    #[test]
    fn join_role_and_attestor() {
        let join = |words: &[&str]| {
            let Command::Join(join) = run(&[&["join"], words].concat()) else { panic!("not join") };
            join
        };
        assert_eq!(join(&[]).check_role(), Ok(()));
        assert!(join(&["--role", "site"]).check_role().is_err());
        assert_eq!(join(&[]).check_attestor(false), Ok(()));
        assert_eq!(join(&[]).check_attestor(true), Ok(()));
        assert_eq!(join(&["--attestor", "provisioned"]).check_attestor(true), Ok(()));
        assert_eq!(
            join(&["--attestor", "provisioned"]).check_attestor(false),
            Err("--attestor provisioned needs --node-id".to_owned())
        );
        let cloud = join(&["--attestor", "cloud-iid"]).check_attestor(false).unwrap_err();
        assert!(
            cloud.starts_with("--attestor cloud-iid joins with a cloud instance's") && cloud.contains("no cloud here"),
            "{cloud}"
        );
        assert_eq!(
            join(&["--attestor", "sgx"]).check_attestor(false),
            Err("--attestor \"sgx\" is not one this build has (join-token, provisioned, tpm)".to_owned())
        );
        if cfg!(feature = "tpm") {
            assert_eq!(join(&["--attestor", "tpm"]).check_attestor(false), Ok(()));
            assert!(join(&["--attestor", "tpm"]).check_attestor(true).unwrap_err().contains("no --node-id"));
            let with_file = join(&["--attestor", "tpm", "--token-file", "t"]).check_attestor(false);
            assert!(with_file.unwrap_err().contains("no --token-file"));
        } else {
            assert!(join(&["--attestor", "tpm"]).check_attestor(false).unwrap_err().contains("no TPM support"));
        }
    }

    #[test]
    fn help_is_the_commands_own() {
        let help_of = |words: &[&str]| match parse_words(words) {
            Parsed::CommandHelp(mut command) => command.render_help().to_string(),
            _ => panic!("{words:?}: not a command's help"),
        };
        assert!(help_of(&["join", "-h"]).starts_with("Usage: join [OPTIONS]\n"));
        assert!(help_of(&["doctor", "--config", "c", "--help"]).starts_with("Usage: doctor [OPTIONS]\n"));
        let help = help_of(&["update", "--help"]);
        assert!(help.starts_with("Usage: update [OPTIONS] --manifest <FILE>\n"), "{help}");
        // The watchdog has none.
        assert_eq!(
            usage_of(&[WATCHDOG_COMMAND, "-h"]),
            format!("bcd {WATCHDOG_COMMAND}: bad usage (see bcd {WATCHDOG_COMMAND} -h)\n")
        );
    }
}
