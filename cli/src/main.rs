//! `better-compute`: the composition root and the CLI.
//!
//! Layout: `main.rs` parses the command line (clap) and dispatches; `server.rs` holds the
//! operator commands that open the database (`dev`, `serve`, `migrate`, `pki`, `projections`);
//! `client.rs` is the API client; `output.rs` formats results safely for a terminal.
//!
//! Exit status: 0 on success, 2 for a usage mistake (`INVALID_ARGUMENT`), 1 for anything else.
//! A failure prints `CODE: message` and, when there is one, a `hint:` line.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;

use bc_core::id::{NodeId, PoolId, TenantId};
use clap::{Args, Parser, Subcommand};
use serde_json::{Map, Value, json};

mod audit;
mod client;
mod credentials;
mod output;
mod reserve;
mod server;
mod watch;
mod webhooks;

use client::{CliError, Client};
use output::Format;

const DEFAULT_URL: &str = "http://127.0.0.1:7070";
const DEFAULT_DATA_DIR: &str = ".better-compute";
const DEFAULT_LISTEN: &str = "127.0.0.1:7070";

#[derive(Parser)]
#[command(name = "better-compute", version, about = "An event-sourced control plane for GPU capacity")]
struct Cli {
    /// Output format (lists default to table, everything else to json).
    #[arg(long, global = true, value_enum)]
    format: Option<Format>,
    /// Print part of the result: `items[].id`, `pin`, `items[0].name`.
    #[arg(long, global = true, value_name = "PATH")]
    query: Option<String>,
    /// The API's URL.
    #[arg(long, global = true, env = "BETTER_COMPUTE_URL", default_value = DEFAULT_URL)]
    url: String,
    /// The tenant to act in (default: the token's own).
    #[arg(long, global = true, env = "BETTER_COMPUTE_TENANT")]
    tenant: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct DataDir {
    /// Where the embedded database, the log key and the admin token live.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
}

#[derive(Args)]
struct Sealing {
    /// How often to seal a checkpoint of every tenant whose log grew: `30s`, `15m`, `1h`; `0` never.
    #[arg(long, default_value = "1h", value_parser = parse_interval_s)]
    checkpoint_interval: u64,
    /// The deployment's name: the key's name in checkpoints and the prefix of their origins.
    #[arg(long, env = "BETTER_COMPUTE_DEPLOYMENT", default_value = bc_core::audit::DEPLOYMENT_DEFAULT)]
    deployment: String,
}

/// Longest sealing interval accepted: a week.
const CHECKPOINT_INTERVAL_S_MAX: u64 = 7 * 24 * 3600;

fn parse_interval_s(text: &str) -> Result<u64, String> {
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = digits.parse().map_err(|_| format!("{text:?} is not a duration like 30s, 15m or 1h"))?;
    let seconds = match unit {
        "" if n == 0 => 0,
        "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        _ => return Err(format!("{text:?} is not a duration like 30s, 15m or 1h")),
    };
    if seconds > CHECKPOINT_INTERVAL_S_MAX {
        return Err(format!("{text:?} is longer than a week"));
    }
    Ok(seconds)
}

/// Longest lease or retry base accepted: a day.
const CONSUMER_DURATION_MS_MAX: u64 = 24 * 3600 * 1000;

/// `250ms`, `5s`, `2m`, `1h`, between 1 ms and a day.
fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = digits.parse().map_err(|_| format!("{text:?} is not a duration like 250ms, 5s, 2m or 1h"))?;
    let ms = match unit {
        "ms" => n,
        "s" => n.saturating_mul(1000),
        "m" => n.saturating_mul(60_000),
        "h" => n.saturating_mul(3_600_000),
        _ => return Err(format!("{text:?} is not a duration like 250ms, 5s, 2m or 1h")),
    };
    if ms == 0 || ms > CONSUMER_DURATION_MS_MAX {
        return Err(format!("{text:?} must be between 1ms and 24h"));
    }
    Ok(ms)
}

/// How the outbox consumers (webhook delivery) run.
#[derive(Args)]
struct ConsumerArgs {
    /// How long a claimed delivery stays with this process if it dies: at least twice
    /// --delivery-timeout, so a slow delivery is never sent by two processes at once.
    #[arg(long, default_value = "60s", value_parser = parse_duration_ms)]
    lease: u64,
    /// One delivery's time limit (connect, send, answer).
    #[arg(long, default_value = "10s", value_parser = parse_duration_ms)]
    delivery_timeout: u64,
    /// The first retry's delay; each next one is 4× longer (at most 6 h), ±20 % jitter.
    #[arg(long, default_value = "5s", value_parser = parse_duration_ms)]
    retry_base: u64,
    /// Attempts before a delivery is dead (a dead letter `webhooks redeliver` can send again).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=50))]
    retry_attempts: u32,
    /// Deliveries in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=256))]
    concurrency: u64,
    /// Allow webhook receivers on private and link-local addresses (10/8, 192.168/16, fe80::/10…).
    #[arg(long)]
    webhook_allow_private: bool,
}

impl ConsumerArgs {
    fn options(&self, allow_loopback: bool) -> Result<server::ConsumerOptions, CliError> {
        if self.lease < 2 * self.delivery_timeout {
            return Err(CliError::usage(format!(
                "--lease ({} ms) must be at least twice --delivery-timeout ({} ms)",
                self.lease, self.delivery_timeout
            )));
        }
        Ok(server::ConsumerOptions {
            delivery_timeout_ms: self.delivery_timeout,
            policy: bc_core::webhook::EndpointPolicy { allow_loopback, allow_private: self.webhook_allow_private },
            lease_ms: self.lease,
            retry: bc_reconcilers::outbox::RetryPolicy {
                base_ms: self.retry_base,
                attempts_max: self.retry_attempts,
                ..bc_reconcilers::outbox::RetryPolicy::DEFAULT
            },
            concurrency: self.concurrency as usize,
            poll_ms: 250,
            tick_ms: 500,
        })
    }
}

#[derive(Args)]
struct DatabaseArgs {
    /// Where the embedded database and the log key live.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data_dir: PathBuf,
    /// PostgreSQL instead of the embedded database.
    #[arg(long, env = "BETTER_COMPUTE_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the control plane on the embedded database (SQLite): nothing else to install.
    Dev {
        #[command(flatten)]
        dir: DataDir,
        #[arg(long, default_value = DEFAULT_LISTEN)]
        listen: String,
        #[command(flatten)]
        sealing: Sealing,
        #[command(flatten)]
        consumers: ConsumerArgs,
        /// Do not run the reconcilers in this process (run `reconcile` instead).
        #[arg(long)]
        no_reconcilers: bool,
    },
    /// Run the control plane on PostgreSQL (run `migrate` first).
    Serve {
        #[arg(long, env = "BETTER_COMPUTE_DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[arg(long, default_value = DEFAULT_LISTEN)]
        listen: String,
        /// Where the log key and the first admin token are kept.
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        #[command(flatten)]
        sealing: Sealing,
        #[command(flatten)]
        consumers: ConsumerArgs,
        /// Do not run the reconcilers in this process (run `reconcile` instead).
        #[arg(long)]
        no_reconcilers: bool,
        /// Allow http:// webhook receivers on loopback (tests, single-host setups).
        #[arg(long)]
        webhook_allow_loopback: bool,
    },
    /// Run reconcilers (outbox consumers) as their own process, against the same database.
    Reconcile {
        /// Only these reconcilers (repeatable): reservations, webhooks. Default: all.
        #[arg(long)]
        only: Vec<String>,
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        consumers: ConsumerArgs,
        /// Allow http:// webhook receivers on loopback (dev, tests).
        #[arg(long)]
        webhook_allow_loopback: bool,
    },
    /// Apply the database migrations.
    Migrate {
        #[command(flatten)]
        db: DatabaseArgs,
    },
    /// The log key.
    Pki {
        #[command(subcommand)]
        command: PkiCommand,
    },
    /// Read models.
    Projections {
        #[command(subcommand)]
        command: ProjectionsCommand,
    },
    /// Checkpoints, verification and proofs of the log.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// Call any API method: `api pools.get poolId=pool_…`, `k=v` (string), `k:=json`.
    Api {
        /// GROUP.METHOD
        method: Option<String>,
        /// Body fields: `key=value` (a string) or `key:=json`.
        items: Vec<String>,
        /// The whole body as JSON, or `-` to read it from standard input.
        #[arg(long)]
        data: Option<String>,
        /// Idempotency key to send.
        #[arg(long)]
        key: Option<String>,
        /// List the methods.
        #[arg(long)]
        list: bool,
    },
    /// The event log.
    Events {
        #[command(subcommand)]
        command: EventsCommand,
    },
    /// Pools of capacity.
    Pools {
        #[command(subcommand)]
        command: PoolsCommand,
    },
    /// Hosts and their GPUs.
    Nodes {
        #[command(subcommand)]
        command: NodesCommand,
    },
    /// Reserve GPUs: placed at once, or queued until capacity frees (waits up to --wait).
    Reserve {
        #[command(flatten)]
        ask: reserve::AskArgs,
        /// Seconds to wait while queued (0 to 600).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=reserve::WAIT_S_MAX))]
        wait: u64,
        /// Idempotency key (default: a fresh one, printed on stderr); repeat it to retry safely.
        #[arg(long)]
        key: Option<String>,
    },
    /// End an active reservation, or cancel a queued one.
    Release {
        reservation_id: String,
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Move an active reservation's end (within the pool's maximum).
    Extend {
        reservation_id: String,
        /// How much longer: `30m`, `4h`, `1d`.
        #[arg(long, value_parser = reserve::parse_duration_s)]
        by: u64,
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Reservations.
    Reservations {
        #[command(subcommand)]
        command: reserve::ReservationsCommand,
    },
    /// Free GPUs per pool and per product; with --preview, would a reservation fit now, and where.
    Capacity {
        #[arg(long)]
        preview: bool,
        #[arg(long)]
        pool: Option<String>,
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
        gpus: Option<u32>,
        #[arg(long = "for", value_parser = reserve::parse_duration_s)]
        duration: Option<u64>,
        #[arg(long)]
        nvlink: bool,
        #[arg(long)]
        selector: Option<String>,
        #[arg(long)]
        model: Option<String>,
        #[arg(long)]
        product: Option<String>,
        #[arg(long = "tolerate")]
        tolerations: Vec<String>,
    },
    /// GPU quotas per pool.
    Quotas {
        #[command(subcommand)]
        command: reserve::QuotasCommand,
    },
    /// Saved credentials: login (token from stdin or BETTER_COMPUTE_TOKEN), status, logout.
    Auth {
        #[command(subcommand)]
        command: AuthCommand,
    },
    /// Webhook subscriptions and their deliveries (Standard Webhooks signatures).
    Webhooks {
        #[command(subcommand)]
        command: webhooks::WebhooksCommand,
    },
}

#[derive(Subcommand)]
enum AuthCommand {
    /// Save a token for --url: read from standard input or BETTER_COMPUTE_TOKEN, never an
    /// argument; checked with system.whoami unless --no-verify.
    Login {
        #[arg(long)]
        profile: Option<String>,
        #[arg(long)]
        no_verify: bool,
    },
    /// Which credential commands use (source, profile, path); never the token.
    Status,
    /// Forget a saved profile (the key stays valid on the server).
    Logout {
        #[arg(long)]
        profile: Option<String>,
    },
}

#[derive(Subcommand)]
enum PkiCommand {
    /// Print the log key's id, pin (`sha256/…`) and note verifier key (vkey).
    Show {
        #[command(flatten)]
        dir: DataDir,
        /// The deployment's name (the key's name in checkpoints).
        #[arg(long, env = "BETTER_COMPUTE_DEPLOYMENT", default_value = bc_core::audit::DEPLOYMENT_DEFAULT)]
        deployment: String,
    },
    /// Replace the log key; the old key signs the announcement and is kept as log.key.KEYID.
    RotateLogKey {
        #[command(flatten)]
        db: DatabaseArgs,
        #[arg(long, env = "BETTER_COMPUTE_DEPLOYMENT", default_value = bc_core::audit::DEPLOYMENT_DEFAULT)]
        deployment: String,
    },
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Seal a signed checkpoint now, for every tenant whose log grew (or --tenant).
    Checkpoint {
        #[command(flatten)]
        db: DatabaseArgs,
        #[arg(long, env = "BETTER_COMPUTE_DEPLOYMENT", default_value = bc_core::audit::DEPLOYMENT_DEFAULT)]
        deployment: String,
    },
    /// Recompute every hash, link, signature and checkpoint; exits AUDIT_TAMPERED on a problem.
    Verify {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Trust only keys with this pin (repeatable); default: the local log key.
        #[arg(long = "pin")]
        pins: Vec<String>,
        #[arg(long, env = "BETTER_COMPUTE_DEPLOYMENT", default_value = bc_core::audit::DEPLOYMENT_DEFAULT)]
        deployment: String,
    },
    /// Write the inclusion proof of one event (C2SP tlog-proof) in the newest checkpoint.
    Prove {
        event_id: String,
        /// The proof file to create (never over an existing file).
        #[arg(long)]
        out: PathBuf,
        /// A checkpoint saved earlier: also prove the log still extends it (OUT.consistency).
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        #[command(flatten)]
        db: DatabaseArgs,
        #[arg(long, env = "BETTER_COMPUTE_DEPLOYMENT", default_value = bc_core::audit::DEPLOYMENT_DEFAULT)]
        deployment: String,
    },
    /// Check a proof file offline against the key you trust. No database, no network.
    CheckProof {
        file: PathBuf,
        /// The log key's pin, `sha256/…`.
        #[arg(long = "pin", env = "BETTER_COMPUTE_AUDIT_PIN")]
        pins: Vec<String>,
        /// A note verifier key, `NAME+KEYID+KEY`.
        #[arg(long = "vkey")]
        vkeys: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ProjectionsCommand {
    /// Fold every read model again from the log.
    Rebuild {
        #[command(flatten)]
        db: DatabaseArgs,
    },
}

#[derive(Args)]
struct Page {
    /// Rows per page (1 to 500).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=500))]
    limit: Option<u32>,
    /// Continue after this cursor (printed under a table as `more rows`).
    #[arg(long)]
    cursor: Option<String>,
}

#[derive(Subcommand)]
enum EventsCommand {
    /// Page through a tenant's events by outbox position.
    List {
        #[command(flatten)]
        page: Page,
        /// Comma-separated type patterns (`pool.*`).
        #[arg(long)]
        types: Option<String>,
    },
    /// One event with its canonical bytes, hash and signature.
    Get { event_id: String },
    /// Follow the log live: one JSON line per event; reconnects after a broken connection.
    Watch {
        /// Comma-separated type patterns (`pool.*,node.registered`), at most 20.
        #[arg(long)]
        types: Option<String>,
        /// Start after this position (`COMMIT.INDEX` or `COMMIT:INDEX`).
        #[arg(long)]
        since: Option<String>,
        /// Stop after printing this many events.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
}

#[derive(Subcommand)]
enum PoolsCommand {
    List {
        #[command(flatten)]
        page: Page,
        #[arg(long)]
        include_archived: bool,
    },
    Get {
        pool_id: String,
    },
    Create {
        #[arg(long)]
        name: String,
        #[arg(long, default_value = "")]
        description: String,
        /// `key=value`, repeatable.
        #[arg(long = "label")]
        labels: Vec<String>,
        /// Idempotency key (default: a fresh one, printed on stderr).
        #[arg(long)]
        key: Option<String>,
    },
}

#[derive(Subcommand)]
enum NodesCommand {
    List {
        #[command(flatten)]
        page: Page,
        #[arg(long)]
        pool: Option<String>,
    },
    Get {
        node_id: String,
    },
    /// Take no new reservations on a node.
    Cordon {
        node_id: String,
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Take reservations on a node again.
    Uncordon {
        node_id: String,
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Cordon a node until its reservations end; --wait N waits up to N seconds for that.
    Drain {
        node_id: String,
        #[arg(long)]
        if_version: Option<u64>,
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=86_400))]
        wait: u64,
    },
    /// Set (`KEY=VALUE`) or remove (`KEY-`) a node's labels.
    Label {
        node_id: String,
        #[arg(required = true)]
        items: Vec<String>,
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Set (`KEY=VALUE`) or remove (`KEY-`) a node's taints; a tainted node takes only
    /// reservations that tolerate every taint key (`reserve --tolerate KEY`).
    Taint {
        node_id: String,
        #[arg(required = true)]
        items: Vec<String>,
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Add a host by hand.
    Register {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        name: String,
        /// `MODEL:PRODUCT:VRAM_GIB:NVLINK_DOMAIN`, repeatable (`H100:H100-SXM5-80GB:80:0`).
        #[arg(long = "gpu")]
        gpus: Vec<String>,
        #[arg(long = "label")]
        labels: Vec<String>,
        #[arg(long)]
        key: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if matches!(e.kind(), clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let rendered = e.render().to_string();
            eprintln!("INVALID_ARGUMENT: {}", rendered.trim_start_matches("error: ").trim_end());
            return ExitCode::from(2);
        }
    };
    init_tracing();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("INTERNAL: starting the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}: {}", e.code, output::safe_text(&e.message));
            if let Some(hint) = &e.hint {
                eprintln!("hint: {}", output::safe_text(hint));
            }
            ExitCode::from(e.exit_status())
        }
    }
}

/// Logs go to stderr: human-readable on a terminal, JSON otherwise.
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BETTER_COMPUTE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn,tower_http=info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if std::io::stderr().is_terminal() {
        builder.init();
    } else {
        builder.json().init();
    }
}

fn print(value: &Value, format: Format, query: Option<&str>) -> Result<(), CliError> {
    let text = output::render(value, format, query).map_err(CliError::usage)?;
    println!("{text}");
    Ok(())
}

fn client(cli: &Cli) -> Result<Client, CliError> {
    Client::new(&cli.url, Some(credentials::token(&cli.url)?))
}

/// Checks an id's kind before anything is sent: a wrong one is a usage error.
fn check_id<T: std::str::FromStr<Err = bc_core::Error>>(what: &str, text: &str) -> Result<String, CliError> {
    text.parse::<T>().map(|_| text.to_owned()).map_err(|e| CliError::usage(format!("{what}: {e}")))
}

fn tenant_body(cli: &Cli) -> Result<Map<String, Value>, CliError> {
    let mut body = Map::new();
    if let Some(t) = &cli.tenant {
        body.insert("tenantId".into(), Value::String(check_id::<TenantId>("--tenant", t)?));
    }
    Ok(body)
}

fn page_body(cli: &Cli, page: &Page) -> Result<Map<String, Value>, CliError> {
    let mut body = tenant_body(cli)?;
    add_page(&mut body, page);
    Ok(body)
}

fn add_page(body: &mut Map<String, Value>, page: &Page) {
    if let Some(limit) = page.limit {
        body.insert("limit".into(), json!(limit));
    }
    if let Some(cursor) = &page.cursor {
        body.insert("cursor".into(), json!(cursor));
    }
}

fn labels(items: &[String]) -> Result<Value, CliError> {
    let mut map = Map::new();
    for item in items {
        let (k, v) = item.split_once('=').ok_or_else(|| CliError::usage(format!("--label {item:?} is not key=value")))?;
        map.insert(k.to_owned(), Value::String(v.to_owned()));
    }
    Ok(Value::Object(map))
}

/// The key a create sends: the user's `--key`, or a fresh one, printed so a retry can reuse it.
fn idempotency_key(given: &Option<String>) -> String {
    let key = given.clone().unwrap_or_else(|| format!("cli-{}", ulid::Ulid::generate().to_string().to_ascii_lowercase()));
    eprintln!("idempotency key: {key}");
    key
}

fn parse_items(items: &[String], data: Option<&str>) -> Result<Value, CliError> {
    let mut body = match data {
        None => Map::new(),
        Some(text) => {
            let text = if text == "-" {
                let mut buffer = String::new();
                std::io::stdin()
                    .read_to_string(&mut buffer)
                    .map_err(|e| CliError::usage(format!("reading standard input: {e}")))?;
                buffer
            } else {
                text.to_owned()
            };
            match serde_json::from_str(&text) {
                Ok(Value::Object(map)) => map,
                Ok(_) => return Err(CliError::usage("--data must be a JSON object")),
                Err(e) => return Err(CliError::usage(format!("--data is not JSON: {e}"))),
            }
        }
    };
    for item in items {
        if let Some((k, v)) = item.split_once(":=") {
            let value = serde_json::from_str(v).map_err(|e| CliError::usage(format!("{k}:= is not JSON: {e}")))?;
            body.insert(k.to_owned(), value);
        } else if let Some((k, v)) = item.split_once('=') {
            body.insert(k.to_owned(), Value::String(v.to_owned()));
        } else {
            return Err(CliError::usage(format!("{item:?} is not key=value or key:=json")));
        }
    }
    Ok(Value::Object(body))
}

async fn run(cli: Cli) -> Result<(), CliError> {
    let query = cli.query.clone();
    let q = query.as_deref();
    let json_or = |default: Format| cli.format.unwrap_or(default);
    match &cli.command {
        Command::Dev { dir, listen, sealing, consumers, no_reconcilers } => {
            let db = server::Database::Sqlite(dir.data_dir.join(server::SQLITE_FILE));
            // dev delivers webhooks to loopback receivers: that is where a developer's are.
            let options = consumers.options(true)?;
            let run = (!no_reconcilers).then_some(&options);
            server::run_server(
                db,
                &dir.data_dir,
                listen,
                true,
                sealing.checkpoint_interval,
                &sealing.deployment,
                run,
                options.policy,
            )
            .await
        }
        Command::Serve { database_url, listen, data_dir, sealing, consumers, no_reconcilers, webhook_allow_loopback } => {
            let db = server::Database::Postgres(database_url.clone());
            let options = consumers.options(*webhook_allow_loopback)?;
            let run = (!no_reconcilers).then_some(&options);
            server::run_server(db, data_dir, listen, false, sealing.checkpoint_interval, &sealing.deployment, run, options.policy)
                .await
        }
        Command::Reconcile { only, db, consumers, webhook_allow_loopback } => {
            let database = server::Database::from_args(&db.data_dir, db.database_url.as_deref());
            server::reconcile(&database, &db.data_dir, only, &consumers.options(*webhook_allow_loopback)?).await
        }
        Command::Reserve { ask, wait, key } => {
            let c = client(&cli)?;
            let v = reserve::reserve(&c, tenant_body(&cli)?, ask, *wait, key).await?;
            print(&v, json_or(Format::Json), q)
        }
        Command::Release { reservation_id, if_version } => {
            let c = client(&cli)?;
            let extra: Vec<(&str, Value)> = if_version.iter().map(|v| ("ifVersion", json!(v))).collect();
            let v = reserve::simple(&c, "reservations.release", tenant_body(&cli)?, reservation_id, &extra).await?;
            print(&v, json_or(Format::Json), q)
        }
        Command::Extend { reservation_id, by, if_version } => {
            let c = client(&cli)?;
            let mut extra = vec![("byS", json!(by))];
            extra.extend(if_version.iter().map(|v| ("ifVersion", json!(v))));
            let v = reserve::simple(&c, "reservations.extend", tenant_body(&cli)?, reservation_id, &extra).await?;
            print(&v, json_or(Format::Json), q)
        }
        Command::Reservations { command } => {
            let c = client(&cli)?;
            let (mut v, list) = reserve::reservations(&c, tenant_body(&cli)?, command).await?;
            let format = json_or(if list { Format::Table } else { Format::Json });
            if list && format == Format::Table && q.is_none() {
                for item in v["items"].as_array_mut().into_iter().flatten() {
                    if let Some(m) = item.as_object_mut() {
                        for field in
                            ["tenantId", "tolerations", "requestSeq", "durationS", "version", "endedAtMs", "activatedAtMs"]
                        {
                            m.remove(field);
                        }
                    }
                }
            }
            print(&v, format, q)
        }
        Command::Capacity { preview, pool, gpus, duration, nvlink, selector, model, product, tolerations } => {
            let c = client(&cli)?;
            let ask = if *preview {
                let (Some(pool), Some(gpus), Some(duration)) = (pool.clone(), *gpus, *duration) else {
                    return Err(CliError::usage("--preview needs --pool, --gpus and --for"));
                };
                Some(reserve::AskArgs {
                    pool,
                    gpus,
                    duration,
                    nvlink: *nvlink,
                    selector: selector.clone(),
                    model: model.clone(),
                    product: product.clone(),
                    tolerations: tolerations.clone(),
                })
            } else {
                if gpus.is_some() || duration.is_some() || selector.is_some() || *nvlink {
                    return Err(CliError::usage("--gpus, --for, --selector and --nvlink go with --preview"));
                }
                None
            };
            let (v, list) = reserve::capacity(&c, tenant_body(&cli)?, ask.as_ref(), pool.as_deref()).await?;
            print(&v, json_or(if list { Format::Table } else { Format::Json }), q)
        }
        Command::Quotas { command } => {
            let c = client(&cli)?;
            print(&reserve::quotas(&c, tenant_body(&cli)?, command).await?, json_or(Format::Json), q)
        }
        Command::Auth { command } => {
            let value = match command {
                AuthCommand::Login { profile, no_verify } => credentials::login(&cli.url, profile.as_deref(), !no_verify).await?,
                AuthCommand::Status => credentials::status(&cli.url)?,
                AuthCommand::Logout { profile } => credentials::logout(profile.as_deref())?,
            };
            print(&value, json_or(Format::Json), q)
        }
        Command::Webhooks { command } => {
            let c = client(&cli)?;
            let (mut value, list) = webhooks::run(&c, tenant_body(&cli)?, command).await?;
            let format = json_or(if list { Format::Table } else { Format::Json });
            if format == Format::Table && q.is_none() {
                for item in value["items"].as_array_mut().into_iter().flatten() {
                    item.as_object_mut().map(|m| m.remove("attemptLog"));
                }
            }
            print(&value, format, q)
        }
        Command::Migrate { db } => {
            let value = server::migrate(&server::Database::from_args(&db.data_dir, db.database_url.as_deref())).await?;
            print(&value, json_or(Format::Json), q)
        }
        Command::Pki { command: PkiCommand::Show { dir, deployment } } => {
            print(&server::pki_show(&dir.data_dir, deployment)?, json_or(Format::Json), q)
        }
        Command::Pki { command: PkiCommand::RotateLogKey { db, deployment } } => {
            let database = server::Database::from_args(&db.data_dir, db.database_url.as_deref());
            print(&audit::rotate_log_key(&database, &db.data_dir, deployment).await?, json_or(Format::Json), q)
        }
        Command::Audit { command } => {
            let tenant = cli
                .tenant
                .as_deref()
                .map(|t| check_id::<TenantId>("--tenant", t))
                .transpose()?
                .map(|t| t.parse().expect("checked"));
            let value = match command {
                AuditCommand::Checkpoint { db, deployment } => {
                    audit::checkpoint(
                        &server::Database::from_args(&db.data_dir, db.database_url.as_deref()),
                        &db.data_dir,
                        tenant,
                        deployment,
                    )
                    .await?
                }
                AuditCommand::Verify { db, pins, deployment } => {
                    let database = server::Database::from_args(&db.data_dir, db.database_url.as_deref());
                    match audit::verify(&database, &db.data_dir, tenant, pins, deployment).await {
                        Ok(v) => v,
                        Err(mut e) => {
                            if let Some(details) = e.details.take() {
                                print(&details, json_or(Format::Json), q)?;
                            }
                            return Err(e);
                        }
                    }
                }
                AuditCommand::Prove { event_id, out, checkpoint, db, deployment } => {
                    let event = check_id::<bc_core::id::EventId>("EVENT_ID", event_id)?.parse().expect("checked");
                    let database = server::Database::from_args(&db.data_dir, db.database_url.as_deref());
                    audit::prove(&database, &db.data_dir, tenant, event, out, checkpoint.as_deref(), deployment).await?
                }
                AuditCommand::CheckProof { file, pins, vkeys } => audit::check_proof(file, pins, vkeys)?,
            };
            print(&value, json_or(Format::Json), q)
        }
        Command::Projections { command: ProjectionsCommand::Rebuild { db } } => {
            let value =
                server::projections_rebuild(&server::Database::from_args(&db.data_dir, db.database_url.as_deref())).await?;
            print(&value, json_or(Format::Json), q)
        }
        Command::Api { method, items, data, key, list } => {
            if *list {
                let methods: Vec<Value> = bc_gateway::api::table()
                    .iter()
                    .map(|m| json!({ "method": m.name, "action": m.access.action().unwrap_or("(public)"), "summary": m.summary }))
                    .collect();
                return print(&json!({ "items": methods }), json_or(Format::Table), q);
            }
            let method = method.as_deref().ok_or_else(|| CliError::usage("give GROUP.METHOD, or --list"))?;
            if bc_gateway::api::find(method).is_none() {
                let best = bc_gateway::api::suggest(method);
                let mut e = CliError::usage(format!("unknown method {method:?}"));
                if let Some(best) = best {
                    e = e.hint(format!("did you mean {best}? (api --list shows them all)"));
                }
                return Err(e);
            }
            let mut body = parse_items(items, data.as_deref())?;
            if let (Some(t), Value::Object(map)) = (&cli.tenant, &mut body) {
                map.entry("tenantId").or_insert_with(|| Value::String(t.clone()));
            }
            let value = client(&cli)?.call(method, &body, key.as_deref()).await?;
            print(&value, json_or(Format::Json), q)
        }
        Command::Events { command } => {
            let c = client(&cli)?;
            match command {
                EventsCommand::Watch { types, since, count } => {
                    let token = credentials::token(&cli.url)?;
                    watch::watch(watch::WatchArgs {
                        url: cli.url.clone(),
                        token,
                        tenant: cli.tenant.clone(),
                        types: types.clone(),
                        since: since.clone(),
                        count: *count,
                    })
                    .await
                }
                EventsCommand::List { page, types } => {
                    let mut body = page_body(&cli, page)?;
                    if let Some(types) = types {
                        body.insert("types".into(), json!(types.split(',').map(str::trim).collect::<Vec<_>>()));
                    }
                    let mut value = c.call("events.list", &Value::Object(body), None).await?;
                    if cli.format.unwrap_or(Format::Table) == Format::Table && q.is_none() {
                        // The table shows the envelope, not the payload.
                        if let Some(items) = value["items"].as_array_mut() {
                            for item in items {
                                for field in ["payload", "prev", "hash", "keyId", "tenantId", "correlation"] {
                                    item.as_object_mut().map(|m| m.remove(field));
                                }
                            }
                        }
                    }
                    print(&value, json_or(Format::Table), q)
                }
                EventsCommand::Get { event_id } => {
                    let mut body = tenant_body(&cli)?;
                    body.insert("eventId".into(), json!(check_id::<bc_core::id::EventId>("EVENT_ID", event_id)?));
                    print(&c.call("events.get", &Value::Object(body), None).await?, json_or(Format::Json), q)
                }
            }
        }
        Command::Pools { command } => {
            let c = client(&cli)?;
            match command {
                PoolsCommand::List { page, include_archived } => {
                    let mut body = page_body(&cli, page)?;
                    body.insert("includeArchived".into(), json!(include_archived));
                    print(&c.call("pools.list", &Value::Object(body), None).await?, json_or(Format::Table), q)
                }
                PoolsCommand::Get { pool_id } => {
                    let mut body = tenant_body(&cli)?;
                    body.insert("poolId".into(), json!(check_id::<PoolId>("POOL_ID", pool_id)?));
                    print(&c.call("pools.get", &Value::Object(body), None).await?, json_or(Format::Json), q)
                }
                PoolsCommand::Create { name, description, labels: items, key } => {
                    let mut body = tenant_body(&cli)?;
                    body.insert("name".into(), json!(name));
                    body.insert("description".into(), json!(description));
                    body.insert("labels".into(), labels(items)?);
                    let key = idempotency_key(key);
                    print(&c.call("pools.create", &Value::Object(body), Some(&key)).await?, json_or(Format::Json), q)
                }
            }
        }
        Command::Nodes { command } => {
            let c = client(&cli)?;
            match command {
                NodesCommand::List { page, pool } => {
                    let mut body = page_body(&cli, page)?;
                    if let Some(pool) = pool {
                        body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", pool)?));
                    }
                    let mut value = c.call("nodes.list", &Value::Object(body), None).await?;
                    if cli.format.unwrap_or(Format::Table) == Format::Table && q.is_none() {
                        // One cell per node: "2× H100-SXM5-80GB (80 GiB)".
                        for item in value["items"].as_array_mut().into_iter().flatten() {
                            let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
                            for gpu in item["gpus"].as_array().into_iter().flatten() {
                                let label = format!("{} ({} GiB)", gpu["product"].as_str().unwrap_or("?"), gpu["vramGiB"]);
                                *counts.entry(label).or_default() += 1;
                            }
                            let summary: Vec<String> = counts.into_iter().map(|(label, n)| format!("{n}× {label}")).collect();
                            item["gpus"] = Value::String(summary.join(", "));
                            item.as_object_mut().map(|m| m.remove("tenantId"));
                        }
                    }
                    print(&value, json_or(Format::Table), q)
                }
                NodesCommand::Cordon { node_id, if_version } => {
                    let v = reserve::node_op(&c, tenant_body(&cli)?, "nodes.cordon", node_id, *if_version, &[], 0).await?;
                    print(&v, json_or(Format::Json), q)
                }
                NodesCommand::Uncordon { node_id, if_version } => {
                    let v = reserve::node_op(&c, tenant_body(&cli)?, "nodes.uncordon", node_id, *if_version, &[], 0).await?;
                    print(&v, json_or(Format::Json), q)
                }
                NodesCommand::Drain { node_id, if_version, wait } => {
                    let v = reserve::node_op(&c, tenant_body(&cli)?, "nodes.drain", node_id, *if_version, &[], *wait).await?;
                    print(&v, json_or(Format::Json), q)
                }
                NodesCommand::Label { node_id, items, if_version } => {
                    let v = reserve::node_op(&c, tenant_body(&cli)?, "nodes.label", node_id, *if_version, items, 0).await?;
                    print(&v, json_or(Format::Json), q)
                }
                NodesCommand::Taint { node_id, items, if_version } => {
                    let v = reserve::node_op(&c, tenant_body(&cli)?, "nodes.taint", node_id, *if_version, items, 0).await?;
                    print(&v, json_or(Format::Json), q)
                }
                NodesCommand::Get { node_id } => {
                    let mut body = tenant_body(&cli)?;
                    body.insert("nodeId".into(), json!(check_id::<NodeId>("NODE_ID", node_id)?));
                    print(&c.call("nodes.get", &Value::Object(body), None).await?, json_or(Format::Json), q)
                }
                NodesCommand::Register { pool, name, gpus, labels: items, key } => {
                    let mut body = tenant_body(&cli)?;
                    body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", pool)?));
                    body.insert("name".into(), json!(name));
                    let mut list = Vec::new();
                    for spec in gpus {
                        let parts: Vec<&str> = spec.split(':').collect();
                        let [model, product, vram, domain] = parts[..] else {
                            return Err(CliError::usage(format!("--gpu {spec:?} is not MODEL:PRODUCT:VRAM_GIB:NVLINK_DOMAIN")));
                        };
                        let vram: u32 =
                            vram.parse().map_err(|_| CliError::usage(format!("--gpu {spec:?}: VRAM_GIB is not a number")))?;
                        let domain: u32 = domain
                            .parse()
                            .map_err(|_| CliError::usage(format!("--gpu {spec:?}: NVLINK_DOMAIN is not a number")))?;
                        list.push(json!({ "model": model, "product": product, "vramGiB": vram, "nvlinkDomain": domain }));
                    }
                    body.insert("gpus".into(), Value::Array(list));
                    body.insert("labels".into(), labels(items)?);
                    let key = idempotency_key(key);
                    print(&c.call("nodes.register", &Value::Object(body), Some(&key)).await?, json_or(Format::Json), q)
                }
            }
        }
    }
}
