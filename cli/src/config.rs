//! The configuration file, `better-compute.toml`: the settings `dev`, `serve`, `reconcile` and
//! the operator commands read beside their flags.
//!
//! **Its keys are the flags.** Every key is the long name of a flag of `dev`, `serve` or
//! `reconcile`, without its `--` (`listen`, `data-dir`, `node-lease`, `witness`), so nothing lists
//! the settings a second time: [`settings`] reads them from clap's command tree, and a flag added
//! to one of those commands is a key of the file, and a line of `init`'s file, with no other
//! change. A file's values become the flags' defaults (clap's `Arg::default_value`) before the
//! command line is parsed again, so clap's own order decides: a flag given, then the flag's
//! environment variable, then the file, then the built-in default (`ArgMatches::value_source`
//! says `DefaultValue` for the file's). A command reads the keys it has a flag for; the others
//! are another command's settings and are left alone.
//!
//! **Checked whole, at load**, whichever command runs: an unknown key, a table, a value of the
//! wrong type (an integer for an address, a string for an on/off flag, a lone string for a
//! repeatable flag) or one the flag's own parser refuses (`lease = "soon"`) is `CONFIG_INVALID`,
//! naming the file, the line and the key. Relative paths are relative to the file's directory.
//!
//! **It holds no secret.** The keys are files in `data-dir` (0600); a `database-url` carrying a
//! password is refused ([`SECRET_BEARING_KEYS`]): the password comes from the environment
//! (`BETTER_COMPUTE_DATABASE_URL`, which wins over the file). [`load_table`] and [`redacted`] are
//! for whoever shows the file (`support-bundle`).
//!
//! Where it is: `--config PATH`, else `BETTER_COMPUTE_CONFIG` (either must exist:
//! `CONFIG_NOT_FOUND`), else `./better-compute.toml` when there is one.

use std::any::TypeId;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use clap::{Arg, ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches};
use toml::de::{DeTable, DeValue};

use crate::client::CliError;
use crate::flags::Cli;

/// The file `init` writes and the commands find in the working directory.
pub const CONFIG_FILE: &str = "better-compute.toml";
/// The environment variable naming the file (as `--config` does).
pub const CONFIG_ENV: &str = "BETTER_COMPUTE_CONFIG";
/// The largest configuration file read: far above the few kilobytes of every setting.
pub const CONFIG_BYTES_MAX: u64 = 256 * 1024;
/// The commands whose flags are the file's keys.
pub const SETTING_COMMANDS: &[&str] = &["dev", "serve", "reconcile"];
/// The commands that read the file (each reads the keys it has a flag for): the servers and the
/// operator commands that open the database themselves. A new operator command reads it once
/// its name is here.
pub const READERS: &[&str] =
    &["dev", "serve", "reconcile", "migrate", "doctor", "pki", "reconcilers", "projections", "audit", "support-bundle"];
/// Keys whose values may carry a secret: refused here when they do (a `database-url` with a
/// password), and blanked by [`redacted`] whatever they hold.
pub const SECRET_BEARING_KEYS: &[&str] = &["database-url"];
/// Keys naming files that hold secrets (their paths are not secret; the files are, and are never
/// to be copied anywhere: `data.key`, the agents' TLS key).
#[allow(dead_code)] // For `support-bundle` (being written beside): what it must never copy.
pub const SECRET_FILE_KEYS: &[&str] = &["data-key-file", "agents-tls-key"];
/// Keys the file gives together or not at all (as their flags `requires` each other, which clap
/// does not check of defaults).
const TOGETHER: &[(&str, &str)] = &[("agents-tls-cert", "agents-tls-key")];
/// What [`redacted`] puts in place of a secret-bearing value.
#[allow(dead_code)] // For `support-bundle`, through `redacted`.
pub const REDACTED: &str = "(redacted)";

/// One key of the file: a flag of [`SETTING_COMMANDS`], as the first command that has it
/// declares it, and which of them take it.
#[derive(Clone)]
pub struct Setting {
    pub key: String,
    pub arg: Arg,
    pub commands: Vec<&'static str>,
}

/// Every key of the file, in the order the commands declare their flags.
pub fn settings() -> Vec<Setting> {
    let root = Cli::command();
    let mut out: Vec<Setting> = Vec::new();
    for name in SETTING_COMMANDS {
        let command = root.find_subcommand(name).expect("a setting command exists");
        for arg in command.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if arg.is_hide_set() || matches!(arg.get_action(), ArgAction::Help | ArgAction::Version) {
                continue;
            }
            match out.iter_mut().find(|s| s.key == long) {
                Some(setting) => setting.commands.push(name),
                None => out.push(Setting { key: long.to_owned(), arg: arg.clone(), commands: vec![name] }),
            }
        }
    }
    out
}

/// The configuration file's settings, checked: each key's values as its flag would take them.
#[derive(Debug, Default)]
pub struct Config {
    /// `(key, values)`, in the file's order of keys (alphabetical).
    pub values: Vec<(String, Vec<OsString>)>,
}

/// Why the command line could not be read: clap's own error (help, version, usage), or the file.
pub enum ParseError {
    Clap(clap::Error),
    Config(CliError),
}

/// Parses `argv` as [`Cli`], the configuration file's settings under the flags for the
/// commands in [`READERS`].
pub fn parse_cli(argv: Vec<OsString>) -> Result<Cli, ParseError> {
    let (path, explicit) = chosen(&argv).map_err(ParseError::Clap)?;
    let mut command = Cli::command();
    if path.first().is_some_and(|name| READERS.contains(&name.as_str()))
        && let Some(file) = find(explicit.as_deref()).map_err(ParseError::Config)?
    {
        command = Config::load(&file).map_err(ParseError::Config)?.apply(command, &path);
    }
    let matches = command.try_get_matches_from(&argv).map_err(ParseError::Clap)?;
    Cli::from_arg_matches(&matches).map_err(ParseError::Clap)
}

/// The subcommands `argv` chose and the `--config` (or `BETTER_COMPUTE_CONFIG`) it names, read
/// past every other mistake (a required flag the file may give, a bad value): the real parse
/// after the file reports those. Only help and version stop here.
fn chosen(argv: &[OsString]) -> Result<(Vec<String>, Option<PathBuf>), clap::Error> {
    let lenient = Cli::command().ignore_errors(true).try_get_matches_from(argv)?;
    let explicit = lenient.try_get_one::<PathBuf>("config").ok().flatten().cloned();
    Ok((subcommand_path(&lenient), explicit))
}

/// The names of the subcommands the command line chose, outermost first (`["pki", "show"]`).
fn subcommand_path(matches: &ArgMatches) -> Vec<String> {
    let mut path = Vec::new();
    let mut at = matches;
    while let Some((name, sub)) = at.subcommand() {
        path.push(name.to_owned());
        at = sub;
    }
    path
}

/// The file to read: `explicit` (`--config` or `BETTER_COMPUTE_CONFIG`), which must exist, else
/// `./better-compute.toml` when present, else none.
pub fn find(explicit: Option<&Path>) -> Result<Option<PathBuf>, CliError> {
    match explicit {
        Some(path) if path.is_file() => Ok(Some(path.to_owned())),
        Some(path) => {
            let e = CliError::new("CONFIG_NOT_FOUND", format!("no configuration file at {}", path.display()))
                .hint(format!("check --config or {CONFIG_ENV}; `better-compute init` writes one"));
            Err(match std::fs::metadata(path) {
                Err(io) => e.caused_by(&io),
                Ok(_) => e,
            })
        }
        None => {
            let local = PathBuf::from(CONFIG_FILE);
            Ok(local.is_file().then_some(local))
        }
    }
}

/// Reads `path`, at most [`CONFIG_BYTES_MAX`].
fn read_text(path: &Path) -> Result<String, CliError> {
    use std::io::Read;
    let unreadable =
        |e: std::io::Error| CliError::new("CONFIG_NOT_FOUND", format!("cannot read {}: {e}", path.display())).caused_by(&e);
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let mut text = String::new();
    file.take(CONFIG_BYTES_MAX + 1)
        .read_to_string(&mut text)
        .map_err(|e| CliError::new("CONFIG_INVALID", format!("{}: not UTF-8 text", path.display())).caused_by(&e))?;
    if text.len() as u64 > CONFIG_BYTES_MAX {
        return Err(CliError::new(
            "CONFIG_INVALID",
            format!("{} is larger than {} KiB (CONFIG_BYTES_MAX)", path.display(), CONFIG_BYTES_MAX / 1024),
        ));
    }
    Ok(text)
}

/// The file's line holding byte `offset` (from 1).
fn line_of(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())].iter().filter(|b| **b == b'\n').count() + 1
}

/// The TOML table of `text`, or `CONFIG_INVALID` naming `path` and the line.
fn parse_toml<'t>(path: &Path, text: &'t str) -> Result<DeTable<'t>, CliError> {
    DeTable::parse(text).map(|t| t.into_inner()).map_err(|e| {
        let line = e.span().map(|s| format!(" line {}", line_of(text, s.start))).unwrap_or_default();
        CliError::new("CONFIG_INVALID", format!("{}{line}: not valid TOML: {}", path.display(), e.message())).caused_by(&e)
    })
}

impl Config {
    /// Reads and checks the file: every key a setting, every value of its flag's type and
    /// accepted by its parser, no secret.
    pub fn load(path: &Path) -> Result<Config, CliError> {
        let text = read_text(path)?;
        Self::parse(path, &text)
    }

    /// [`Config::load`] on text already read (`path` names it in errors and anchors relative paths).
    pub fn parse(path: &Path, text: &str) -> Result<Config, CliError> {
        let table = parse_toml(path, text)?;
        let settings = settings();
        let base = path.parent().unwrap_or(Path::new(""));
        let mut values = Vec::new();
        for (key, value) in &table {
            let key_name: &str = key.get_ref();
            let at = |span: std::ops::Range<usize>| format!("{} line {}", path.display(), line_of(text, span.start));
            let Some(setting) = settings.iter().find(|s| s.key == key_name) else {
                let mut e = CliError::new("CONFIG_INVALID", format!("{}: unknown key `{key_name}`", at(key.span())));
                let nearest = crate::commands::nearest(key_name, settings.iter().map(|s| s.key.as_str()));
                e = e.hint(match nearest {
                    Some(best) => format!("did you mean `{best}`? Keys are the flags of dev, serve and reconcile, without `--`"),
                    None => {
                        "keys are the flags of dev, serve and reconcile, without `--` (`better-compute init` writes them all)"
                            .into()
                    }
                });
                return Err(e);
            };
            let checked = setting_values(setting, value.get_ref(), base)
                .map_err(|problem| CliError::new("CONFIG_INVALID", format!("{}: `{key_name}` {problem}", at(value.span()))))?;
            if SECRET_BEARING_KEYS.contains(&key_name) && checked.iter().any(|v| carries_password(v)) {
                return Err(CliError::new(
                    "CONFIG_INVALID",
                    format!("{}: `{key_name}` carries a password, and a configuration file holds no secret", at(value.span())),
                )
                .hint("leave the password out of the file and give the whole URL in BETTER_COMPUTE_DATABASE_URL (the environment wins over the file)"));
            }
            values.push((key_name.to_owned(), checked));
        }
        for (one, other) in TOGETHER {
            let has = |key: &str| values.iter().any(|(k, _)| k == key);
            if has(one) != has(other) {
                let (given, missing) = if has(one) { (one, other) } else { (other, one) };
                return Err(CliError::new(
                    "CONFIG_INVALID",
                    format!("{}: `{given}` is set without `{missing}`; the two go together", path.display()),
                ));
            }
        }
        Ok(Config { values })
    }

    /// `command` (the whole [`Cli`] tree) with the file's values as the defaults of the flags of
    /// the subcommand at `path` that has them; a required flag the file gives is required no more.
    pub fn apply(&self, command: Command, path: &[String]) -> Command {
        let Some((name, rest)) = path.split_first() else { return self.apply_here(command) };
        command.mut_subcommand(name, |sub| self.apply(sub, rest))
    }

    fn apply_here(&self, mut command: Command) -> Command {
        for (key, values) in &self.values {
            let Some(id) = command.get_arguments().find(|a| a.get_long() == Some(key)).map(|a| a.get_id().clone()) else {
                continue;
            };
            // clap (without its `string` feature) keeps defaults as `&'static`: the values are
            // leaked, once per process, at most `CONFIG_BYTES_MAX` of them.
            let values: Vec<&'static OsStr> = values.iter().map(|v| &*Box::leak(v.clone().into_boxed_os_str())).collect();
            command = command.mut_arg(id, |arg| arg.required(false).default_values(values));
        }
        command
    }
}

/// The types clap's value parsers hand back for text (an integer in the file is not one of them).
fn is_text(arg: &Arg) -> bool {
    let produced = arg.get_value_parser().type_id();
    produced == TypeId::of::<String>() || produced == TypeId::of::<PathBuf>() || produced == TypeId::of::<OsString>()
}

fn is_path(arg: &Arg) -> bool {
    arg.get_value_parser().type_id() == TypeId::of::<PathBuf>()
}

/// A value's TOML type, as the errors name it.
fn type_name(value: &DeValue<'_>) -> &'static str {
    match value {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date-time",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table",
    }
}

/// `value` as the text(s) `setting`'s flag takes, checked by its parser; the problem otherwise.
fn setting_values(setting: &Setting, value: &DeValue<'_>, base: &Path) -> Result<Vec<OsString>, String> {
    let arg = &setting.arg;
    match arg.get_action() {
        ArgAction::SetTrue | ArgAction::SetFalse => match value {
            DeValue::Boolean(b) => Ok(vec![OsString::from(b.to_string())]),
            other => Err(format!("must be true or false, not {}", type_name(other))),
        },
        ArgAction::Append => match value {
            DeValue::Array(items) => items
                .iter()
                .map(|item| scalar(setting, item.get_ref(), base))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("(an item) {e}")),
            other => {
                Err(format!("must be an array (the flag is repeatable: `{} = [\"…\"]`), not {}", setting.key, type_name(other)))
            }
        },
        ArgAction::Set => scalar(setting, value, base).map(|v| vec![v]),
        _ => Err("cannot be set in a configuration file".into()),
    }
}

/// One value of a flag taking a value: a string, or an integer where the flag's value is a
/// number; checked by the flag's own parser (ranges, durations, choices).
fn scalar(setting: &Setting, value: &DeValue<'_>, base: &Path) -> Result<OsString, String> {
    let arg = &setting.arg;
    let text = match value {
        DeValue::String(s) => s.to_string(),
        DeValue::Integer(i) if !is_text(arg) => i128::from_str_radix(i.as_str(), i.radix())
            .map_err(|e| format!("is not an integer this flag takes: {e}"))?
            .to_string(),
        other => {
            let wanted = if is_text(arg) { "a string" } else { "a string or an integer" };
            return Err(format!("must be {wanted}, not {}", type_name(other)));
        }
    };
    let text = if is_path(arg) && Path::new(&text).is_relative() && !text.is_empty() {
        base.join(&text).into_os_string()
    } else {
        OsString::from(text)
    };
    check_with_parser(setting, &text)?;
    Ok(text)
}

/// Runs `setting`'s flag's own value parser on `text`, as clap would on the command line.
fn check_with_parser(setting: &Setting, text: &OsStr) -> Result<(), String> {
    let probe = Command::new(CONFIG_FILE).no_binary_name(true).arg(
        Arg::new("value")
            .long("value")
            .value_name("VALUE")
            .action(ArgAction::Set)
            .allow_hyphen_values(true)
            .value_parser(setting.arg.get_value_parser().clone()),
    );
    let mut flag = OsString::from("--value=");
    flag.push(text);
    probe.try_get_matches_from([flag]).map(|_| ()).map_err(|e| {
        let rendered = e.render().to_string();
        let first = rendered.lines().next().unwrap_or_default().trim_start_matches("error: ");
        first.replace("'--value <VALUE>'", &format!("--{}", setting.key))
    })
}

/// A URL carrying a password: in its user part, or as a `password` query parameter.
fn carries_password(value: &OsStr) -> bool {
    let Some(text) = value.to_str() else { return false };
    match url::Url::parse(text) {
        Ok(url) => url.password().is_some() || url.query_pairs().any(|(k, _)| k.eq_ignore_ascii_case("password")),
        // Not a URL its command will take either (a libpq `key=value` string, say): refused when
        // it may hold one, so it is never kept here.
        Err(_) => text.contains('@') || text.to_ascii_lowercase().contains("password"),
    }
}

/// The file at `path` as a TOML table, unchecked beyond its syntax (for `support-bundle`: show
/// it through [`redacted`]).
#[allow(dead_code)] // For `support-bundle` (being written beside).
pub fn load_table(path: &Path) -> Result<toml::Table, CliError> {
    let text = read_text(path)?;
    parse_toml(path, &text)?;
    text.parse::<toml::Table>().map_err(|e| {
        CliError::new("CONFIG_INVALID", format!("{}: not valid TOML: {}", path.display(), e.message())).caused_by(&e)
    })
}

/// `table` with the value of every [`SECRET_BEARING_KEYS`] key replaced by [`REDACTED`].
#[allow(dead_code)] // For `support-bundle` (being written beside).
pub fn redacted(mut table: toml::Table) -> toml::Table {
    for key in SECRET_BEARING_KEYS {
        if let Some(value) = table.get_mut(*key) {
            *value = toml::Value::String(REDACTED.into());
        }
    }
    table
}

// ---------------------------------------------------------------------------------------------
// The file `init` writes, from the same settings.

/// Lines of the file's comments wrap here.
const COMMENT_WIDTH: usize = 98;

/// The commented file `init` writes: every setting, grouped by the commands that take it, with
/// its help and its default commented out; `data-dir` set to `data_dir`.
pub fn template(data_dir: &str) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "# {CONFIG_FILE}: the settings of `better-compute dev`, `serve` and `reconcile` (and the\n\
         # database and keys every operator command opens), written by `better-compute init`.\n\
         #\n\
         # Every key is a flag's long name without its `--`: `listen = \"0.0.0.0:7070\"` is\n\
         # `--listen 0.0.0.0:7070`, and a repeatable flag takes an array. A flag given on the command\n\
         # line wins over this file, and so does the environment variable a flag reads (named below).\n\
         # An unknown key or a value of the wrong type is an error naming its line. Relative paths are\n\
         # relative to this file's directory. Commented lines show the built-in defaults.\n\
         #\n\
         # This file holds no secret: the keys are files in data-dir (mode 0600), and a database URL\n\
         # with a password is refused here (give it in BETTER_COMPUTE_DATABASE_URL instead).\n\
         # Found as --config PATH, else ${CONFIG_ENV}, else ./{CONFIG_FILE}.\n\n"
    ));
    let settings = settings();
    let mut groups: Vec<Vec<&'static str>> = Vec::new();
    for s in &settings {
        if !groups.contains(&s.commands) {
            groups.push(s.commands.clone());
        }
    }
    for group in groups {
        let title = match group.as_slice() {
            [one] => format!("{one} only"),
            [init @ .., last] => format!("{} and {last}", init.join(", ")),
            [] => continue,
        };
        out.push_str(&format!("# ---- {title} {}\n\n", "-".repeat(COMMENT_WIDTH.saturating_sub(title.len() + 8))));
        for s in settings.iter().filter(|s| s.commands == group) {
            setting_lines(&mut out, s, data_dir);
        }
    }
    out
}

fn setting_lines(out: &mut String, s: &Setting, data_dir: &str) {
    let help = s.arg.get_long_help().or(s.arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
    let mut notes = help.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    if let Some(env) = s.arg.get_env() {
        notes.push(format!("(env {})", env.to_string_lossy()));
    }
    if SECRET_BEARING_KEYS.contains(&s.key.as_str()) {
        notes.extend(
            "Never with a password here (refused): a URL with one goes in the environment.".split(' ').map(str::to_owned),
        );
    }
    wrap_comment(out, &notes);
    let defaults: Vec<String> = s.arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
    if s.key == "data-dir" {
        out.push_str(&format!("{} = {}\n\n", s.key, toml_literal(&s.arg, data_dir)));
        return;
    }
    let line = match s.arg.get_action() {
        ArgAction::SetTrue => format!("{} = {}", s.key, defaults.first().map(String::as_str).unwrap_or("false")),
        ArgAction::Append => {
            format!("{} = [{}]", s.key, defaults.iter().map(|d| toml_literal(&s.arg, d)).collect::<Vec<_>>().join(", "))
        }
        _ => match defaults.first() {
            Some(d) => format!("{} = {}", s.key, toml_literal(&s.arg, d)),
            None => {
                let example =
                    s.arg.get_value_names().and_then(|v| v.first()).map(|n| n.to_string()).unwrap_or_else(|| "VALUE".into());
                out.push_str("# (no default)\n");
                format!("{} = {}", s.key, toml_literal(&s.arg, &example))
            }
        },
    };
    out.push_str(&format!("# {line}\n\n"));
}

/// `text` as TOML: an integer where the flag's value is a number and `text` is one, else a string.
fn toml_literal(arg: &Arg, text: &str) -> String {
    if !is_text(arg) && text.parse::<i64>().is_ok() {
        return text.to_owned();
    }
    toml::Value::String(text.to_owned()).to_string()
}

fn wrap_comment(out: &mut String, words: &[String]) {
    let mut line = String::from("#");
    for word in words {
        if line.len() + 1 + word.len() > COMMENT_WIDTH && line.len() > 1 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    if line.len() > 1 {
        out.push_str(&line);
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use clap::parser::ValueSource;

    use super::*;
    use crate::commands::operator::{DevArgs, ReconcileArgs, ServeArgs};
    use crate::flags::Command as C;

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("better-compute").chain(args.iter().copied()).map(OsString::from).collect()
    }

    /// `args` parsed with the file `text` (at `dir/better-compute.toml`) under the flags.
    fn with_file(text: &str, args: &[&str]) -> Result<(Cli, ArgMatches), CliError> {
        let path = Path::new("/etc/bc").join(CONFIG_FILE);
        let config = Config::parse(&path, text)?;
        let (path, _) = chosen(&argv(args)).expect("a command");
        let command = config.apply(Cli::command(), &path);
        let matches = command.try_get_matches_from(argv(args)).map_err(|e| CliError::usage(e.to_string()))?;
        Ok((Cli::from_arg_matches(&matches).expect("a Cli"), matches))
    }

    fn dev(cli: Cli) -> DevArgs {
        let C::Dev(args) = cli.command else { panic!("not dev") };
        args
    }

    #[test]
    fn the_file_sits_between_the_built_in_default_and_the_flag() {
        let file = "listen = \"127.0.0.1:9001\"\nnode-lease = \"30s\"\nconcurrency = 7\nwitness = [\"a=https://w.example+b\"]\n";
        let (cli, matches) = with_file(file, &["dev"]).unwrap();
        let args = dev(cli);
        assert_eq!(args.server.listen, "127.0.0.1:9001", "the file over the built-in default");
        assert_eq!(args.server.agents.node_lease, 30_000);
        assert_eq!(args.server.consumers.concurrency, 7);
        assert_eq!(args.server.witnesses, vec!["a=https://w.example+b".to_owned()]);
        assert_eq!(args.server.agents.node_heartbeat, 5_000, "a key the file leaves out keeps its default");
        let (_, dev_matches) = matches.subcommand().unwrap();
        assert_eq!(dev_matches.value_source("listen"), Some(ValueSource::DefaultValue));

        let (cli, matches) = with_file(file, &["dev", "--listen", "127.0.0.1:9002", "--concurrency", "9"]).unwrap();
        let args = dev(cli);
        assert_eq!((args.server.listen.as_str(), args.server.consumers.concurrency), ("127.0.0.1:9002", 9), "the flag wins");
        assert_eq!(args.server.agents.node_lease, 30_000);
        assert_eq!(matches.subcommand().unwrap().1.value_source("listen"), Some(ValueSource::CommandLine));
    }

    #[test]
    fn each_command_takes_the_keys_it_has_a_flag_for() {
        let file = "database-url = \"postgres://bc@db.example/bc\"\nlisten = \"127.0.0.1:9001\"\nonly = [\"webhooks\"]\nwebhook-allow-loopback = true\n";
        // serve's required --database-url comes from the file.
        let (cli, _) = with_file(file, &["serve"]).unwrap();
        let C::Serve(ServeArgs { database_url, server, webhook_allow_loopback, .. }) = cli.command else { panic!("not serve") };
        assert_eq!((database_url.as_str(), server.listen.as_str()), ("postgres://bc@db.example/bc", "127.0.0.1:9001"));
        assert!(webhook_allow_loopback, "an on/off flag the file turns on");
        let (cli, _) = with_file(file, &["reconcile"]).unwrap();
        let C::Reconcile(ReconcileArgs { only, db, .. }) = cli.command else { panic!("not reconcile") };
        assert_eq!(only, vec!["webhooks".to_owned()]);
        assert_eq!(db.database_url.as_deref(), Some("postgres://bc@db.example/bc"));
        // dev has no --database-url: it stays on SQLite, and the key is not an error.
        assert_eq!(dev(with_file(file, &["dev"]).unwrap().0).server.listen, "127.0.0.1:9001");
        // migrate reads the database and the data directory, nothing else.
        let (cli, _) = with_file(file, &["migrate"]).unwrap();
        let C::Migrate(args) = cli.command else { panic!("not migrate") };
        assert_eq!(args.db.database_url.as_deref(), Some("postgres://bc@db.example/bc"));
    }

    #[test]
    fn relative_paths_are_relative_to_the_files_directory() {
        let (cli, _) = with_file("data-dir = \"state\"\ndata-key-file = \"/keys/data.key\"\n", &["dev"]).unwrap();
        let args = dev(cli);
        assert_eq!(args.dir.data_dir, Path::new("/etc/bc/state"));
        assert_eq!(args.server.data_key.data_key_file.as_deref(), Some(Path::new("/keys/data.key")));
        let (cli, _) = with_file("data-dir = \"state\"\n", &["dev", "--data-dir", "here"]).unwrap();
        assert_eq!(dev(cli).dir.data_dir, Path::new("here"), "a flag is relative to the working directory, as always");
    }

    fn refusal(text: &str) -> CliError {
        match with_file(text, &["dev"]) {
            Ok(_) => panic!("{text:?} was accepted"),
            Err(e) => e,
        }
    }

    #[test]
    fn an_unknown_key_is_named_with_its_line() {
        let e = refusal("listen = \"127.0.0.1:9001\"\n\n# a comment\nlisten-adress = \"x\"\n");
        assert_eq!(e.code, "CONFIG_INVALID");
        assert_eq!(e.message, "/etc/bc/better-compute.toml line 4: unknown key `listen-adress`");
        assert!(e.hint.as_deref().unwrap().contains("did you mean `listen`?"), "{:?}", e.hint);
        // Global and per-call flags are not settings; nor are sections.
        assert!(refusal("format = \"json\"\n").message.contains("unknown key `format`"));
        assert!(refusal("strict = true\n").message.contains("unknown key `strict`"));
        assert!(refusal("[server]\nlisten = \"x\"\n").message.contains("line 1: unknown key `server`"));
    }

    #[test]
    fn a_wrong_type_is_named_with_its_key_and_line() {
        let e = refusal("data-dir = \"d\"\nlisten = 7070\n");
        assert_eq!(e.message, "/etc/bc/better-compute.toml line 2: `listen` must be a string, not an integer");
        let e = refusal("no-reconcilers = \"yes\"\n");
        assert_eq!(e.message, "/etc/bc/better-compute.toml line 1: `no-reconcilers` must be true or false, not a string");
        let e = refusal("witness = \"a=https://w+b\"\n");
        assert!(e.message.starts_with("/etc/bc/better-compute.toml line 1: `witness` must be an array"), "{}", e.message);
        let e = refusal("concurrency = 1.5\n");
        assert!(e.message.ends_with("`concurrency` must be a string or an integer, not a float"), "{}", e.message);
        // The flag's own parser: its range, its durations.
        let e = refusal("concurrency = 0\n");
        assert!(e.message.starts_with("/etc/bc/better-compute.toml line 1: `concurrency` invalid value '0'"), "{}", e.message);
        let e = refusal("\nlease = \"soon\"\n");
        assert!(e.message.contains("line 2: `lease` invalid value 'soon'"), "{}", e.message);
        assert!(e.message.contains("not a duration"), "{}", e.message);
        let e = refusal("lease = 60\n");
        assert!(e.message.contains("`lease` invalid value '60'"), "a duration needs its unit: {}", e.message);
        // Not TOML at all: the line of the mistake.
        let e = refusal("listen = \"127.0.0.1:1\"\nlisten = \"twice\"\n");
        assert!(e.message.starts_with("/etc/bc/better-compute.toml line 2: not valid TOML"), "{}", e.message);
        assert!(!e.causes.is_empty(), "the parser's error is kept as the cause");
    }

    #[test]
    fn a_database_url_with_a_password_is_refused() {
        let e = refusal("database-url = \"postgres://bc:hunter2@db/bc\"\n");
        assert!(e.message.contains("line 1: `database-url` carries a password"), "{}", e.message);
        assert!(!format!("{} {:?}", e.message, e.hint).contains("hunter2"), "the password is never echoed");
        assert!(refusal("database-url = \"postgres://bc@db/bc?password=hunter2\"\n").message.contains("carries a password"));
        assert!(refusal("database-url = \"host=db user=bc password=hunter2\"\n").message.contains("carries a password"));
        assert!(with_file("database-url = \"postgres://bc@db/bc?sslmode=require\"\n", &["dev"]).is_ok());
        let table: toml::Table = "database-url = \"postgres://bc@db/bc\"\nlisten = \"x\"\n".parse().unwrap();
        let shown = redacted(table);
        assert_eq!(shown["database-url"].as_str(), Some(REDACTED));
        assert_eq!(shown["listen"].as_str(), Some("x"));
    }

    #[test]
    fn inits_file_loads_and_every_default_in_it_is_one_its_flag_takes() {
        let text = template(".better-compute");
        let config = Config::parse(Path::new(CONFIG_FILE), &text).unwrap();
        assert_eq!(config.values.len(), 1, "only data-dir is set: {:?}", config.values);
        for s in settings() {
            assert!(text.contains(&format!("{} = ", s.key)), "{} is in the file", s.key);
        }
        // Uncommented, every default is a value its flag takes, of the right type.
        let uncommented: String = text
            .split("\n\n")
            .filter(|block| !block.contains("# (no default)"))
            .flat_map(|block| block.lines())
            .filter_map(|line| line.strip_prefix("# "))
            .filter(|line| line.contains(" = ") && settings().iter().any(|s| line.starts_with(&format!("{} = ", s.key))))
            .map(|line| format!("{line}\n"))
            .collect();
        let config =
            Config::parse(Path::new(CONFIG_FILE), &uncommented).unwrap_or_else(|e| panic!("{}\n{uncommented}", e.message));
        assert!(config.values.len() > 40, "{} settings", config.values.len());
        let (plain, _) = with_file("", &["dev"]).unwrap();
        let (filled, _) = with_file(&uncommented, &["dev"]).unwrap();
        let (plain, filled) = (dev(plain).server, dev(filled).server);
        assert_eq!(
            (plain.listen, plain.consumers.lease, plain.agents.node_lease, plain.rate_per_key),
            (filled.listen, filled.consumers.lease, filled.agents.node_lease, filled.rate_per_key)
        );
    }

    #[test]
    fn the_file_is_found_where_it_is_named() {
        let e = find(Some(Path::new("/nonexistent/bc/better-compute.toml"))).unwrap_err();
        assert_eq!(e.code, "CONFIG_NOT_FOUND");
        assert!(e.causes.iter().any(|c| c.contains("No such file")), "{:?}", e.causes);
    }
}
