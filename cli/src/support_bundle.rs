//! `better-compute support-bundle --out FILE`: what an operator sends when asking for help, as
//! one tar.gz written 0600, never over an existing file (`ALREADY_EXISTS`). The parts and the
//! scrubbing are `bc_agent::support_bundle`'s, which `bcd support-bundle` makes a node's with.
//!
//! In it: `versions.json` (this binary, the log and journal formats, the host, rustc),
//! `config.json` (the effective settings: the data directory, the database with its URL's
//! password removed, the key files' paths, the `BETTER_COMPUTE_*` environment and a
//! `better-compute.toml` when there is one, every secret redacted), `doctor.json` (`doctor
//! --json`, run in process), `reconcilers.json` (`reconcilers status`), `data-dir.json` (the
//! data directory's files by name, mode and size, never their contents) and, with `--log-file`,
//! the log's last lines. Nothing is written but the bundle: a data directory without a database
//! is reported, never created.
//!
//! Every file is scrubbed of the data directory's secrets (the log keys, the data key, the
//! agents' serving key, the admin token, every small owner-only file), of the token in
//! `BETTER_COMPUTE_TOKEN` and the saved credentials, and of the database URL's password.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use bc_agent::support_bundle::{self as bundle, Bundle, BundleError, Redactor};
use clap::Args;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::commands::Context;
use crate::commands::operator::DataKeyArgs;
use crate::flags::DatabaseArgs;
use crate::output::Format;
use crate::server::{ADMIN_TOKEN_FILE, Database, LOG_KEY_FILE, SQLITE_FILE};

#[derive(Args)]
pub struct SupportBundleArgs {
    /// The bundle to write: a new file, mode 0600, never over an existing one (ALREADY_EXISTS).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub data_key: DataKeyArgs,
    /// A file holding the server's log (`journalctl -u better-compute > FILE`, or where its
    /// standard error goes): its last --log-lines lines go in, scrubbed.
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,
    /// How many of the log's last lines.
    #[arg(long, value_name = "N", default_value_t = bundle::LOG_LINES_DEFAULT as u32,
          value_parser = clap::value_parser!(u32).range(1..=bundle::LOG_LINES_MAX as i64))]
    pub log_lines: u32,
}

fn bundle_error(e: BundleError) -> CliError {
    match e {
        BundleError::Exists(path) => {
            CliError::new("ALREADY_EXISTS", format!("{} exists; a support bundle is never written over a file", path.display()))
                .hint("give --out a new file")
        }
        BundleError::Io(message) => CliError::new("INTERNAL", message),
    }
}

/// The password of a `scheme://user:PASSWORD@host…` URL, or of libpq's `password=…`.
fn url_password(url: &str) -> Option<String> {
    if let Ok(parsed) = url::Url::parse(url)
        && let Some(password) = parsed.password()
    {
        return Some(percent_decoded(password));
    }
    let at = url.find("password=")?;
    let rest = &url[at + "password=".len()..];
    Some(rest[..rest.find(|c: char| c.is_whitespace() || c == '&').unwrap_or(rest.len())].to_owned())
}

fn percent_decoded(text: &str) -> String {
    url::form_urlencoded::parse(format!("p={text}").as_bytes()).next().map(|(_, v)| v.into_owned()).unwrap_or_default()
}

/// Every secret this host knows of for the deployment in `data_dir`.
fn redactor(data_dir: &Path, data_key: &Path, database_url: Option<&str>) -> Redactor {
    let mut redactor = Redactor::new();
    let mut files = vec![
        data_dir.join(LOG_KEY_FILE),
        data_dir.join(ADMIN_TOKEN_FILE),
        data_dir.join(bc_gateway::agents::tls::SERVING_KEY_FILE),
        data_key.to_path_buf(),
        bc_core::sealing::data_key_next_path(data_key),
    ];
    // The log keys a rotation kept (`log.key.KEYID`), and every small owner-only file: keys and
    // tokens as this system writes them, whatever their names.
    files.extend(bundle::owner_only_files(data_dir).into_iter().filter(|p| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        !name.starts_with(SQLITE_FILE)
    }));
    for file in &files {
        redactor.secret_file(file);
    }
    if let Ok(token) = std::env::var("BETTER_COMPUTE_TOKEN") {
        redactor.secret(&token);
    }
    if let Ok(path) = crate::credentials::path()
        && let Ok(saved) = crate::credentials::load(&path)
    {
        for profile in saved.profiles.values() {
            redactor.secret(&profile.token);
        }
    }
    if let Some(password) = database_url.and_then(url_password) {
        redactor.password(&password);
    }
    redactor
}

/// The configuration file (`--config`, `BETTER_COMPUTE_CONFIG`, else `./better-compute.toml` when
/// present) as `config.rs` shows it ([`crate::config::redacted`]), redacted again by
/// `bc_agent::support_bundle`'s rules for a key or value that says secret; none without a file.
/// A `data-dir` in the file other than `data_dir`, the one this bundle read, is pointed out.
fn config_file(explicit: Option<&Path>, data_dir: &Path) -> Value {
    let path = match crate::config::find(explicit) {
        Ok(Some(path)) => path,
        Ok(None) => return Value::Null,
        Err(e) => return json!({ "error": bundle::redact_urls(&e.message) }),
    };
    match crate::config::load_table(&path) {
        Ok(table) => {
            let named = table.get("data-dir").and_then(|v| v.as_str()).map(|d| {
                // Relative to the file's directory, as the commands that read it take it.
                path.parent().unwrap_or(Path::new(".")).join(d)
            });
            let shown = bundle::redact_toml("", &toml::Value::Table(crate::config::redacted(table)));
            let mut value = json!({ "path": path.display().to_string(), "settings": shown });
            let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
                (Ok(a), Ok(b)) => a == b,
                _ => a == b,
            };
            if let Some(named) = named.filter(|named| !same(named, data_dir)) {
                value["note"] = json!(format!(
                    "the file names data-dir {}, but this bundle read {}: make it again with --data-dir {}",
                    named.display(),
                    data_dir.display(),
                    named.display()
                ));
            }
            value
        }
        Err(e) => json!({ "path": path.display().to_string(), "error": bundle::redact_urls(&e.message) }),
    }
}

pub async fn run(ctx: &Context, args: SupportBundleArgs) -> Result<(), CliError> {
    bundle::refuse_existing(&args.out).map_err(bundle_error)?;
    let progress = std::io::stderr().is_terminal();
    let step = |what: &str| {
        if progress {
            eprintln!("support-bundle: {what}…");
        }
    };
    let data_dir = &args.db.data_dir;
    let data_key = args.data_key.path(data_dir);
    let db = args.db.database();
    let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let redactor = redactor(data_dir, &data_key, args.db.database_url.as_deref());
    let mut out = Bundle::new("better-compute-support-bundle");

    step("versions");
    out.add_json(
        "versions.json",
        &json!({
            "binary": "better-compute",
            "build": crate::commands::version::build_info(),
            "journalFormat": bc_core::agent::JOURNAL_FORMAT_VERSION,
            "host": bundle::system_facts(),
        }),
    );

    step("configuration");
    let database = match &db {
        Database::Sqlite(path) => json!({ "backend": "sqlite", "path": path.display().to_string(), "exists": path.exists() }),
        Database::Postgres(url) => json!({ "backend": "postgres", "url": bundle::redact_urls(url) }),
    };
    out.add_json(
        "config.json",
        &json!({
            "dataDir": data_dir.display().to_string(),
            "database": database,
            "logKeyFile": data_dir.join(LOG_KEY_FILE).display().to_string(),
            "dataKeyFile": data_key.display().to_string(),
            "adminTokenFile": data_dir.join(ADMIN_TOKEN_FILE).display().to_string(),
            "configFile": config_file(ctx.global.config.as_deref(), data_dir),
            "environment": bundle::environment(&["BETTER_COMPUTE_"]),
        }),
    );

    step("doctor");
    let paths = crate::doctor::Paths { data_dir, data_key: &data_key };
    out.add_json("doctor.json", &crate::doctor::run(&db, &paths).await);

    step("reconcilers");
    // Reading the status would create an embedded database that is not there: reported instead.
    let status = match &db {
        Database::Sqlite(path) if !path.exists() => json!({ "error": format!("no database at {}", path.display()) }),
        _ => crate::server::reconcilers_status(&db).await.unwrap_or_else(|e| json!({ "error": e.message, "code": e.code })),
    };
    out.add_json("reconcilers.json", &status);

    step("data directory");
    let listed = match bundle::listing(data_dir) {
        Ok(entries) => json!({ "path": data_dir.display().to_string(), "entries": entries }),
        Err(e) => json!({ "path": data_dir.display().to_string(), "error": e }),
    };
    out.add_json("data-dir.json", &listed);

    if let Some(path) = &args.log_file {
        step("logs");
        match bundle::log_tail(path, args.log_lines as usize) {
            Ok(bytes) => out.add("logs/better-compute.log", bytes),
            Err(e) => out.add("logs/ERROR.txt", format!("{e}\n")),
        }
    }
    out.add(
        "README.txt",
        format!(
            "A support bundle of better-compute {}, made at {now_s} (Unix seconds).\n\n\
             versions.json: this binary, the log's and journal's formats, the host.\n\
             config.json: the effective settings (data directory, database, key files, the BETTER_COMPUTE_* \
             environment, better-compute.toml when there is one), every secret replaced by {}.\n\
             doctor.json: better-compute doctor --json.\n\
             reconcilers.json: better-compute reconcilers status.\n\
             data-dir.json: the data directory's files by name, kind, mode and size; no file's contents.\n\
             {}\
             Every file was scrubbed of the data directory's keys and tokens, the API token of this \
             environment and saved credentials, and the database's password ({} forms of secrets).\n",
            env!("CARGO_PKG_VERSION"),
            bundle::REDACTED,
            bundle::logs_readme("better-compute", args.log_file.as_deref(), args.log_lines as usize),
            redactor.len(),
        ),
    );
    let names = out.names();
    step("writing");
    let bytes = out.write(&args.out, &redactor, now_s).map_err(bundle_error)?;
    ctx.print(&json!({ "out": args.out.display().to_string(), "bytes": bytes, "files": names }), Format::Json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_urls_password_is_found() {
        assert_eq!(url_password("postgres://bc:s3cr%40t-pw@db:5432/bc").as_deref(), Some("s3cr@t-pw"));
        assert_eq!(url_password("postgres://bc@db/bc"), None);
        assert_eq!(url_password("host=db password=hunter22 user=bc").as_deref(), Some("hunter22"));
    }

    #[test]
    fn the_data_directorys_secrets_are_scrubbed_and_the_database_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let token = "key_01jabcdefghjkmnpqrstvwxyz0.c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0";
        bc_core::keys::write_secret_file(&dir.path().join(ADMIN_TOKEN_FILE), format!("{token}\n").as_bytes()).unwrap();
        let seed = "09".repeat(32);
        bc_core::keys::write_secret_file(&dir.path().join("log.key.lk_0011223344556677"), seed.as_bytes()).unwrap();
        bc_core::keys::write_secret_file(&dir.path().join(SQLITE_FILE), b"not scrubbed: hello world").unwrap();
        let redactor = redactor(dir.path(), &dir.path().join("data.key"), Some("postgres://u:pa55word@h/d"));
        let text = format!("a {token} b {seed} c pa55word d hello world");
        let scrubbed = String::from_utf8(redactor.scrub(text.as_bytes())).unwrap();
        assert_eq!(scrubbed, "a [REDACTED] b [REDACTED] c [REDACTED] d hello world");
    }
}
