//! Every flag and subcommand of `better-compute`, as clap types, and nothing that runs them.
//!
//! Flags that several commands share are declared once, as groups flattened into the commands
//! that take them: [`Deployment`], [`DataDir`], [`DatabaseArgs`], [`Sealing`], [`ConsumerArgs`],
//! [`ServerArgs`], [`Page`], [`IfVersion`], [`IdempotencyKey`] and [`AskArgs`]. Durations are
//! parsed in one place, [`parse_duration`] (humantime), with the bounds of each flag.
//! `commands/` runs what is parsed here.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::output::Format;

pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";
pub const DEFAULT_DATA_DIR: &str = ".better-compute";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
pub const DEFAULT_AGENTS_LISTEN: &str = "127.0.0.1:7444";
/// Longest `--node-lease` accepted: ten minutes (a lapse shows no sooner than the lease).
pub const NODE_LEASE_MS_MAX: u64 = 600_000;

/// Longest sealing interval accepted: a week.
pub const CHECKPOINT_INTERVAL_S_MAX: u64 = 7 * 24 * 3600;
/// Longest lease or retry base accepted: a day.
pub const CONSUMER_DURATION_MS_MAX: u64 = 24 * 3600 * 1000;
/// Longest `--for` or `--by` the CLI sends (the pool's own maximum decides below it).
pub const RESERVATION_DURATION_S_MAX: u64 = 10 * 366 * 24 * 3600;
/// Longest `reserve --wait`: ten minutes.
pub const RESERVE_WAIT_S_MAX: u64 = 600;
/// Longest `nodes drain --wait`: a day.
pub const DRAIN_WAIT_S_MAX: u64 = 86_400;

#[derive(Parser)]
#[command(
    name = "better-compute",
    version,
    about = "An event-sourced control plane for GPU capacity",
    disable_help_subcommand = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// The flags every command takes: where the API is, who acts, and how results print.
#[derive(Args, Clone)]
pub struct GlobalArgs {
    /// Output format (lists default to table, everything else to json).
    #[arg(long, global = true, value_enum)]
    pub format: Option<Format>,
    /// Print part of the result: `items[].id`, `pin`, `items[0].name`.
    #[arg(long, global = true, value_name = "PATH")]
    pub query: Option<String>,
    /// The API's URL.
    #[arg(long, global = true, env = "BETTER_COMPUTE_URL", default_value = DEFAULT_URL)]
    pub url: String,
    /// The tenant to act in (default: the token's own).
    #[arg(long, global = true, env = "BETTER_COMPUTE_TENANT")]
    pub tenant: Option<String>,
}

// ---------------------------------------------------------------------------------------------
// Shared flag groups.

#[derive(Args)]
pub struct Deployment {
    /// The deployment's name: the key's name in checkpoints and the prefix of their origins.
    #[arg(long, env = "BETTER_COMPUTE_DEPLOYMENT", default_value = bc_core::audit::DEPLOYMENT_DEFAULT)]
    pub deployment: String,
}

#[derive(Args)]
pub struct DataDir {
    /// Where the embedded database, the log key and the admin token live.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
}

/// Where the data key is: secrets (webhook signing secrets, BMC passwords, token hashes) are
/// sealed under it.
#[derive(Args)]
pub struct DataKeyArgs {
    /// The data key's file (0600; made at first start by dev and serve). Default: `data.key`
    /// in --data-dir, beside the log key. A rotation keeps the next key at FILE.next.
    #[arg(long, value_name = "FILE", env = "BETTER_COMPUTE_DATA_KEY_FILE")]
    pub data_key_file: Option<PathBuf>,
}

impl DataKeyArgs {
    pub fn path(&self, data_dir: &std::path::Path) -> PathBuf {
        self.data_key_file.clone().unwrap_or_else(|| data_dir.join(bc_core::sealing::DATA_KEY_FILE))
    }
}

#[derive(Args)]
pub struct DatabaseArgs {
    /// Where the embedded database and the log key live.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    /// PostgreSQL instead of the embedded database.
    #[arg(long, env = "BETTER_COMPUTE_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
}

#[derive(Args)]
pub struct Sealing {
    /// How often to seal a checkpoint of every tenant whose log grew: `30s`, `15m`, `1h`; `0` never.
    #[arg(long, default_value = "1h", value_parser = parse_interval_s)]
    pub checkpoint_interval: u64,
    #[command(flatten)]
    pub deployment: Deployment,
}

/// How the outbox consumers (webhook delivery) run.
#[derive(Args)]
pub struct ConsumerArgs {
    /// How long a claimed delivery stays with this process if it dies: at least twice
    /// --delivery-timeout, so a slow delivery is never sent by two processes at once.
    #[arg(long, default_value = "60s", value_parser = parse_duration_ms)]
    pub lease: u64,
    /// One delivery's time limit (connect, send, answer).
    #[arg(long, default_value = "10s", value_parser = parse_duration_ms)]
    pub delivery_timeout: u64,
    /// The first retry's delay; each next one is 4× longer (at most 6 h), ±20 % jitter.
    #[arg(long, default_value = "5s", value_parser = parse_duration_ms)]
    pub retry_base: u64,
    /// Attempts before a delivery is dead (a dead letter `webhooks redeliver` can send again).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub retry_attempts: u32,
    /// Deliveries in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub concurrency: u64,
    /// Allow webhook receivers on private addresses (10/8, 172.16/12, 192.168/16, 100.64/10,
    /// fc00::/7). Link-local addresses (169.254/16, fe80::/10: the cloud metadata service's
    /// neighbourhood) stay refused whatever this says.
    #[arg(long)]
    pub webhook_allow_private: bool,
    /// A network BMCs are reached on, CIDR (`10.20.0.0/16`, `fd00:b::/64`) or one address
    /// (repeatable). Without one, only public addresses; loopback, link-local and this host's
    /// own addresses only when named exactly (`127.0.0.1/32`). Checked at enrollment and on
    /// every address a BMC's name resolves to, at connect time.
    #[arg(long = "bmc-allow-network", value_name = "CIDR")]
    pub bmc_allow_networks: Vec<String>,
}

/// What `dev` and `serve` share: the address, sealing, and the reconcilers run in process.
#[derive(Args)]
pub struct ServerArgs {
    #[arg(long, default_value = DEFAULT_LISTEN)]
    pub listen: String,
    #[command(flatten)]
    pub sealing: Sealing,
    /// A witness to cosign each sealed checkpoint, `NAME=URL+VKEY` (repeatable; C2SP
    /// tlog-witness). One that is down delays only its own cosignature.
    #[arg(long = "witness", value_name = "NAME=URL+VKEY")]
    pub witnesses: Vec<String>,
    /// A release key `releases.register` trusts: the `.pub` file `release keygen` wrote
    /// (repeatable). Without one, no release is registered.
    #[arg(long = "release-key", value_name = "FILE.pub")]
    pub release_keys: Vec<PathBuf>,
    #[command(flatten)]
    pub consumers: ConsumerArgs,
    #[command(flatten)]
    pub data_key: DataKeyArgs,
    /// Do not run the reconcilers in this process (run `reconcile` instead).
    #[arg(long)]
    pub no_reconcilers: bool,
    /// How long a write to a client that reads nothing may wait before the connection is
    /// dropped (a stalled watcher frees its slot).
    #[arg(long, default_value = "30s", value_parser = parse_duration_ms)]
    pub write_stall: u64,
    /// How long a request's head (request line and headers) may take to arrive; also how long an
    /// HTTP/1.1 connection may wait for its next request.
    #[arg(long, default_value = "20s", value_parser = parse_duration_ms)]
    pub header_timeout: u64,
    /// How long a connection may carry nothing either way before it is closed.
    #[arg(long, default_value = "120s", value_parser = parse_duration_ms)]
    pub idle_timeout: u64,
    /// How long a request body may take to arrive; a slower one is refused and its
    /// connection closed, so it never holds a request slot longer.
    #[arg(long, default_value = "30s", value_parser = parse_duration_ms)]
    pub body_timeout: u64,
    /// Connections open at once; more wait to be accepted.
    #[arg(long, default_value_t = bc_gateway::conn::CONNECTIONS_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub connections_max: u64,
    /// Watchers (`GET /watch`) connected at once; one more is refused with UNAVAILABLE. Below
    /// --connections-max.
    #[arg(long, default_value_t = bc_gateway::watch::WATCHERS_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_535))]
    pub watchers_max: u64,
    /// Watchers one tenant's keys may hold at once (at most --watchers-max).
    #[arg(long, default_value_t = bc_gateway::watch::WATCHERS_PER_TENANT_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_535))]
    pub watchers_per_tenant_max: u64,
    /// Watchers one API key may hold at once (at most --watchers-per-tenant-max).
    #[arg(long, default_value_t = bc_gateway::watch::WATCHERS_PER_KEY_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_535))]
    pub watchers_per_key_max: u64,
    #[command(flatten)]
    pub agents: AgentsArgs,
}

/// The agents' endpoint (gRPC, `bcd`): where it listens, its serving certificate, the lease.
#[derive(Args)]
pub struct AgentsArgs {
    /// Where the agents' endpoint listens (TLS; agents pin the certificate's key).
    #[arg(long, default_value = DEFAULT_AGENTS_LISTEN)]
    pub agents_listen: String,
    /// The serving certificate chain (PEM); with --agents-tls-key. Default: one made at first
    /// start in the data directory.
    #[arg(long, requires = "agents_tls_key", value_name = "FILE")]
    pub agents_tls_cert: Option<PathBuf>,
    /// The serving certificate's private key (PEM); with --agents-tls-cert.
    #[arg(long, requires = "agents_tls_cert", value_name = "FILE")]
    pub agents_tls_key: Option<PathBuf>,
    /// How long a node's lease lasts past its last heartbeat: it turns unreachable after that.
    #[arg(long, default_value = "15s", value_parser = parse_node_lease_ms)]
    pub node_lease: u64,
    /// How often a node is asked to heartbeat (less than half --node-lease).
    #[arg(long, default_value = "5s", value_parser = parse_node_lease_ms)]
    pub node_heartbeat: u64,
    /// Agent connections open at once; more wait to be accepted.
    #[arg(long, default_value_t = bc_gateway::agents::AGENT_CONNECTIONS_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub agents_connections_max: u64,
    /// Agent connections from one address at once; more are closed at once. Raise it when many
    /// nodes reach the gateway through one NAT address (at most --agents-connections-max).
    #[arg(long, default_value_t = bc_gateway::agents::AGENT_CONNECTIONS_PER_PEER_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pub agents_connections_per_peer_max: u64,
    /// How long a new agent connection may take to finish TLS, send the HTTP/2 preface and open
    /// its first stream before it is closed.
    #[arg(long, default_value = "10s", value_parser = parse_duration_ms)]
    pub agents_handshake_timeout: u64,
    /// How long an agent connection may hold no stream before it is closed.
    #[arg(long, default_value = "60s", value_parser = parse_duration_ms)]
    pub agents_idle_timeout: u64,
    /// Joins decided at once; one more is refused with UNAVAILABLE and a retry hint.
    #[arg(long, default_value_t = bc_gateway::agents::JOINS_CONCURRENT_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub agents_joins_max: u64,
}

#[derive(Args)]
pub struct Page {
    /// Rows per page (1 to 500).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=500))]
    pub limit: Option<u32>,
    /// Continue after this cursor (printed under a table as `more rows`).
    #[arg(long)]
    pub cursor: Option<String>,
}

#[derive(Args)]
pub struct IfVersion {
    /// Only if the resource is still at this version (optimistic concurrency).
    #[arg(long)]
    pub if_version: Option<u64>,
}

#[derive(Args)]
pub struct IdempotencyKey {
    /// Idempotency key (default: a fresh one, printed on stderr); repeat it to retry safely.
    #[arg(long)]
    pub key: Option<String>,
}

/// What a reservation asks for: `reserve` sends it, `capacity --preview` tries it.
#[derive(Args)]
pub struct AskArgs {
    #[arg(long)]
    pub pool: String,
    /// GPUs, all on one node (1 to 64).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus: u32,
    /// How long: `90s`, `30m`, `8h`, `1d` (at most the pool's maximum).
    #[arg(long = "for", value_parser = parse_duration_s)]
    pub duration: u64,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

/// Where a reservation may go.
#[derive(Args, Clone)]
pub struct PlacementArgs {
    /// All GPUs in one NVLink domain.
    #[arg(long)]
    pub nvlink: bool,
    /// `gpuProduct in (H100-SXM5-80GB), vramGiB >= 80, label.rack = r1`.
    #[arg(long)]
    pub selector: Option<String>,
    /// Adds `gpuModel = MODEL`.
    #[arg(long)]
    pub model: Option<String>,
    /// Adds `gpuProduct = PRODUCT`.
    #[arg(long)]
    pub product: Option<String>,
    /// A taint key this reservation tolerates (repeatable).
    #[arg(long = "tolerate")]
    pub tolerations: Vec<String>,
}

// ---------------------------------------------------------------------------------------------
// Commands.

#[derive(Subcommand)]
pub enum Command {
    /// Run the control plane on the embedded database (SQLite): nothing else to install.
    Dev {
        #[command(flatten)]
        dir: DataDir,
        #[command(flatten)]
        server: ServerArgs,
        /// Serve the agents' endpoint as plaintext h2c instead of TLS: only on a loopback
        /// --agents-listen, and only in dev.
        #[arg(long)]
        agents_insecure_h2c: bool,
    },
    /// Run the control plane on PostgreSQL (run `migrate` first).
    Serve {
        #[arg(long, env = "BETTER_COMPUTE_DATABASE_URL", hide_env_values = true)]
        database_url: String,
        /// Where the log key and the first admin token are kept.
        #[arg(long, default_value = DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        #[command(flatten)]
        server: ServerArgs,
        /// Allow http:// webhook receivers on loopback (tests, single-host setups).
        #[arg(long)]
        webhook_allow_loopback: bool,
    },
    /// Run reconcilers (outbox consumers) as their own process, against the same database.
    Reconcile {
        /// Only these reconcilers (repeatable). Default: all (`witnesses` only with --witness).
        #[arg(long, value_name = "NAME", value_parser = clap::builder::PossibleValuesParser::new(bc_reconcilers::registry::NAMES))]
        only: Vec<String>,
        /// A witness to cosign each sealed checkpoint, `NAME=URL+VKEY` (repeatable): the
        /// `witnesses` reconciler sends them.
        #[arg(long = "witness", value_name = "NAME=URL+VKEY")]
        witnesses: Vec<String>,
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        consumers: ConsumerArgs,
        #[command(flatten)]
        sealing: Sealing,
        #[command(flatten)]
        data_key: DataKeyArgs,
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
    /// What each reconciler did last, in every process that runs one.
    Reconcilers {
        #[command(subcommand)]
        command: ReconcilersCommand,
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
    /// Replay an event export offline: verify it, rebuild the tenant's state at a seq.
    Sim {
        #[command(subcommand)]
        command: SimCommand,
    },
    /// Call any API method: `api pools.get poolId=pool_…`; items `k=v`, `k:=json`, `a.b=v`,
    /// `ids[]=x`, `k=@file.txt`, `k:=@file.json`.
    Api(ApiArgs),
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
    /// What a joined node's agent reported its machine holds: the latest, the history, what changed.
    Inventory {
        #[command(subcommand)]
        command: InventoryCommand,
    },
    /// The tokens machines join with (`bcd join`); a secret is shown once, or written to a new
    /// 0600 file with --out.
    JoinTokens {
        #[command(subcommand)]
        command: JoinTokensCommand,
    },
    /// Signed bcd releases: a release key, a signed manifest, its check (offline); register
    /// one with the control plane, list, get.
    Releases {
        #[command(subcommand)]
        command: ReleasesCommand,
    },
    /// Commands to a node's agent: issue, list, get, cancel.
    Commands {
        #[command(subcommand)]
        command: CommandsCommand,
    },
    /// Reserve GPUs: placed at once, or queued until capacity frees (waits up to --wait).
    Reserve {
        #[command(flatten)]
        ask: AskArgs,
        /// Seconds to wait while queued (0 to 600).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=RESERVE_WAIT_S_MAX))]
        wait: u64,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// End an active reservation, or cancel a queued one.
    Release {
        reservation_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Move an active reservation's end (within the pool's maximum).
    Extend {
        reservation_id: String,
        /// How much longer: `30m`, `4h`, `1d`.
        #[arg(long, value_parser = parse_duration_s)]
        by: u64,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Reservations.
    Reservations {
        #[command(subcommand)]
        command: ReservationsCommand,
    },
    /// Free GPUs per pool and per product; with --preview, would a reservation fit now, and where.
    Capacity(CapacityArgs),
    /// GPU quotas per pool.
    Quotas {
        #[command(subcommand)]
        command: QuotasCommand,
    },
    /// The shapes of instance a pool offers: vCPUs, memory, disk, GPUs.
    Flavors {
        #[command(subcommand)]
        command: FlavorsCommand,
    },
    /// Disk images instances boot from, by URL and SHA-256.
    Images {
        #[command(subcommand)]
        command: ImagesCommand,
    },
    /// A release taken to a pool's nodes in waves, with health gates: create, list, get,
    /// pause, resume, abort.
    Rollouts {
        #[command(subcommand)]
        command: RolloutsCommand,
    },
    /// Virtual machines on a reservation's node, with its GPUs passed through.
    Instances {
        #[command(subcommand)]
        command: InstancesCommand,
    },
    /// Bare-metal machines by their BMCs: enroll, manage, inspect, provide, deploy, undeploy,
    /// rescue, power; each verb a workflow with deadlines.
    Metal {
        #[command(subcommand)]
        command: MetalCommand,
    },
    /// A machine's workflows: list (--node), get, abort, pause, resume, retry.
    Workflows {
        #[command(subcommand)]
        command: WorkflowsCommand,
    },
    /// Saved credentials: login (token from stdin or BETTER_COMPUTE_TOKEN), status, logout.
    Auth {
        #[command(subcommand)]
        command: AuthCommand,
    },
    /// Webhook subscriptions and their deliveries (Standard Webhooks signatures).
    Webhooks {
        #[command(subcommand)]
        command: WebhooksCommand,
    },
    /// Print a shell completion script: `source <(better-compute completion bash)`.
    Completion {
        #[arg(value_enum)]
        shell: CompletionShell,
    },
    /// The commands, one command's flags (`help reserve`), or with --json the whole manifest.
    Help {
        /// The command to describe (`help nodes drain`).
        command: Vec<String>,
        /// Every command, subcommand and flag as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum CompletionShell {
    Bash,
    Zsh,
    Fish,
}

#[derive(Args)]
pub struct ApiArgs {
    /// GROUP.METHOD (with --list: a group, `reservations`, to list only its methods).
    pub method: Option<String>,
    /// Body fields: `k=v` (a string), `k:=json`, `a.b=v` (nested), `ids[]=x` (appended),
    /// `k=@file.txt` (a string from a file), `k:=@file.json` (JSON from a file).
    pub items: Vec<String>,
    /// The whole body: JSON, `@file.json`, or `-` to read it from standard input.
    #[arg(long)]
    pub data: Option<String>,
    /// Idempotency key to send.
    #[arg(long)]
    pub key: Option<String>,
    /// List the methods.
    #[arg(long)]
    pub list: bool,
}

#[derive(Args)]
pub struct CapacityArgs {
    #[arg(long)]
    pub preview: bool,
    #[arg(long)]
    pub pool: Option<String>,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus: Option<u32>,
    #[arg(long = "for", value_parser = parse_duration_s)]
    pub duration: Option<u64>,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

#[derive(Subcommand)]
pub enum AuthCommand {
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
pub enum PkiCommand {
    /// Print the log key's id, pin (`sha256/…`) and note verifier key (vkey).
    Show {
        #[command(flatten)]
        dir: DataDir,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// Replace the log key; the old key signs the announcement and is kept as log.key.KEYID.
    RotateLogKey {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// Replace the data key secrets are sealed under, re-sealing every secret (run it with the
    /// servers stopped, or restart them after: a running one holds only the old key).
    RotateDataKey {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        data_key: DataKeyArgs,
    },
}

#[derive(Subcommand)]
pub enum AuditCommand {
    /// Seal a signed checkpoint now, for every tenant whose log grew (or --tenant).
    Checkpoint {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// Recompute every hash, link, signature and checkpoint; exits AUDIT_TAMPERED on a problem.
    Verify {
        #[command(flatten)]
        db: DatabaseArgs,
        /// Trust only keys with this pin (repeatable); default: the local log key.
        #[arg(long = "pin")]
        pins: Vec<String>,
        #[command(flatten)]
        deployment: Deployment,
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
        #[command(flatten)]
        deployment: Deployment,
    },
    /// A monitor: fetch the tenant's checkpoint and tiles from URL, check every new entry and the
    /// consistency with the last checkpoint seen (kept in --state); exits 3 (AUDIT_FORK,
    /// AUDIT_BAD_ENTRY) on a fork or a bad entry.
    Follow {
        /// The server's address (`http://127.0.0.1:8080`); the token is BETTER_COMPUTE_TOKEN or a
        /// profile's (`auth login`).
        url: String,
        /// The log key's pin, `sha256/…`.
        #[arg(long = "pin", env = "BETTER_COMPUTE_AUDIT_PIN")]
        pins: Vec<String>,
        /// A note verifier key, `NAME+KEYID+KEY`.
        #[arg(long = "vkey")]
        vkeys: Vec<String>,
        /// Where the last checkpoint seen is kept (0600, replaced atomically).
        #[arg(long, default_value = "audit-follow.json")]
        state: PathBuf,
        /// Check once and exit, instead of following.
        #[arg(long)]
        once: bool,
        /// How long to wait between rounds when following.
        #[arg(long, default_value = "30s", value_parser = parse_duration_ms)]
        interval: u64,
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
        /// A checkpoint of this tenant you saved earlier yourself: consistency is proved from it
        /// (catching a forked log), never from the prover's own old checkpoint. Without it the
        /// output says what was, or was not, checked.
        #[arg(long, value_name = "CHECKPOINT")]
        saved: Option<PathBuf>,
        /// A witness's verifier key (repeatable): the checkpoint must carry its cosignature
        /// (C2SP tlog-cosignature, or a plain Ed25519 note signature).
        #[arg(long = "witness", value_name = "VKEY")]
        witnesses: Vec<String>,
        /// How many of the --witness keys must have cosigned (default: all of them).
        #[arg(long, value_name = "K")]
        witnesses_min: Option<usize>,
    },
}

#[derive(Subcommand)]
pub enum SimCommand {
    /// One seeded, deterministic run of the real log, decisions, reservations reconciler and
    /// agents' runners on a virtual clock, with a workload and faults, checking the invariants
    /// after every step and a liveness phase at the end; prints a summary, the chain heads and
    /// one digest (the same seed gives the same digest). A broken invariant prints the seed and
    /// the command that repeats the run, and exits 1.
    Run {
        #[arg(long)]
        seed: u64,
        /// Nodes in all, dealt to the tenants in turn (at most 1000).
        #[arg(long, default_value_t = 20)]
        nodes: usize,
        /// Tenants, each with one pool (at most 100).
        #[arg(long, default_value_t = 3)]
        tenants: usize,
        /// Simulated hours before the liveness phase (at most 720).
        #[arg(long, default_value_t = 1)]
        hours: u64,
        /// The faults the seed may enable: all, none, or names separated by commas
        /// (failed-holds, unanswered-holds, refused-releases, agents-away, clock-skew,
        /// agent-crash, duplicate-commands, stale-view, lost-acks, reconciler-crash,
        /// gateway-restart, failing-commits, drop-messages, delay-messages,
        /// duplicate-messages, reorder-messages, partition, failing-receivers).
        #[arg(long, default_value = "all")]
        faults: String,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
        /// The CPU the run keeps to, with SQLite's worker threads: `auto` (the one it starts
        /// on), a CPU number, or `any` (wherever the scheduler puts it). The run hands every
        /// statement to a worker thread and waits for it, which costs about half as much on
        /// one CPU as across two; runs side by side each take their own.
        #[arg(long, default_value = "auto", value_name = "auto|N|any")]
        cpu: String,
        /// Also write a self-contained HTML page (inline SVG, nothing fetched): a timeline over
        /// simulated time of GPU utilization, queue depth, nodes up, faults injected and
        /// invariant checks, the first failure marked. Written over a file of that name; the
        /// run and its digest are the same with or without it.
        #[arg(long, value_name = "FILE.html")]
        report: Option<PathBuf>,
        /// TEST ONLY: drops the node guard of placements decided on a stale view, to show that
        /// the checker finds the double booking. Never a way to run anything.
        #[arg(long, hide = true)]
        unsafe_no_placement_guard: bool,
        /// TEST ONLY: appends journal entries without their idempotency key and loses
        /// deliveries' acknowledgements often, to show that the checker finds the duplicate.
        #[arg(long, hide = true)]
        unsafe_no_journal_dedupe: bool,
        /// TEST ONLY: breaks one thing behind the back of the code that would refuse it
        /// (wrong-fold, rollout-all-at-once, leaked-hold, bad-proof), to show that the
        /// simulator's own checks find it. Never a way to run anything.
        #[arg(long, hide = true, value_name = "NAME")]
        unsafe_break: Option<String>,
    },
    /// Verify an `events export` file against the log key's pin and fold its events into the
    /// tenant's projection rows; prints the state's digest and its rows per kind. Exits 1 with
    /// EXPORT_TAMPERED (naming the first bad record's seq), EXPORT_UNTRUSTED_KEY,
    /// EXPORT_TRUNCATED or EXPORT_MALFORMED when the file does not verify.
    Replay {
        file: PathBuf,
        /// The pin of the log key that signed the file, `sha256/…` (`pki show` prints it).
        #[arg(long)]
        log_key_pin: String,
        /// Rebuild the state as it was right after this seq (default: the file's last).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        until: Option<u64>,
        /// Also write the rows, `{tenantId, atSeq, stateDigest, rows: [{kind, id, doc}]}`, to a
        /// new JSON file.
        #[arg(long, value_name = "FILE.json")]
        rows_out: Option<PathBuf>,
        /// Also write a self-contained HTML page (inline SVG, nothing fetched): a timeline over
        /// the whole file's time of the tenant's GPU utilization, queue depth, nodes up, fault
        /// events and records verified, the --until point marked. Written over a file of that
        /// name.
        #[arg(long, value_name = "FILE.html")]
        report: Option<PathBuf>,
        /// Decide the file's reservations again under another policy and show the first
        /// decision that differs and what followed: `queue=fifo|backfill`,
        /// `placement=tightest-fit|spread` (repeatable).
        #[arg(long = "what-if", value_name = "KEY=VALUE")]
        what_if: Vec<String>,
    },
}

#[derive(Subcommand)]
pub enum ReconcilersCommand {
    /// Each reconciler's last pass per process: when, how long, its outcome and counts.
    Status {
        #[command(flatten)]
        db: DatabaseArgs,
    },
}

#[derive(Subcommand)]
pub enum ProjectionsCommand {
    /// Fold every read model again from the log.
    Rebuild {
        #[command(flatten)]
        db: DatabaseArgs,
    },
}

#[derive(Subcommand)]
pub enum EventsCommand {
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
    /// Write a tenant's events (--tenant), with their hashes and signatures, to a file that
    /// verifies alone (a CBOR sequence; schema/LOG-FORMAT.md, "Event exports"). Reads the
    /// database directly, like `audit verify`.
    Export {
        /// The first seq (default 1: the chain from its start, which `sim replay` needs).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        from: u64,
        /// The last seq (default: the chain head when the export starts).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        to: Option<u64>,
        /// The file to create (never over an existing file).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// Follow the log live from its end (like `tail -f`): one JSON line per event; reconnects
    /// after a broken connection.
    Watch {
        /// Comma-separated type patterns (`pool.*,node.registered`), at most 20.
        #[arg(long)]
        types: Option<String>,
        /// Start after this position (`COMMIT.INDEX` or `COMMIT:INDEX`), or `start` (or `0`) to
        /// replay the log from its beginning. Default: only events appended from now on.
        #[arg(long)]
        since: Option<String>,
        /// Stop after printing this many events.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
}

#[derive(Subcommand)]
pub enum PoolsCommand {
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
        #[command(flatten)]
        key: IdempotencyKey,
    },
}

#[derive(Subcommand)]
pub enum NodesCommand {
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
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Take reservations on a node again.
    Uncordon {
        node_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Cordon a node until its reservations end; --wait N waits up to N seconds for that.
    Drain {
        node_id: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=DRAIN_WAIT_S_MAX))]
        wait: u64,
    },
    /// Set (`KEY=VALUE`) or remove (`KEY-`) a node's labels.
    Label {
        node_id: String,
        #[arg(required = true)]
        items: Vec<String>,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Set (`KEY=VALUE`) or remove (`KEY-`) a node's taints; a tainted node takes only
    /// reservations that tolerate every taint key (`reserve --tolerate KEY`).
    Taint {
        node_id: String,
        #[arg(required = true)]
        items: Vec<String>,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Remove a node for good (`node.deleted`): one cordoned or draining, holding no GPU, its
    /// agent gone, with no unfinished command, live instance or live rollout. Refused without
    /// --yes, before any call.
    Delete {
        node_id: String,
        /// Why, kept in the log (at most 500 characters).
        #[arg(long)]
        reason: Option<String>,
        /// Confirm: the node's document goes (its events stay in the log).
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        if_version: IfVersion,
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
        #[command(flatten)]
        key: IdempotencyKey,
    },
}

#[derive(Subcommand)]
pub enum InventoryCommand {
    /// The node's latest reported inventory: GPUs (UUID, model, product, VRAM, PCI bus id, NVLink
    /// domain), driver and CUDA versions, the host; `seq` names the report.
    Get {
        /// The node (one that joined with `bcd join`).
        #[arg(long)]
        node: String,
    },
    /// The node's reports, newest first (--limit 1 to 50, default 10).
    History {
        #[arg(long)]
        node: String,
        #[command(flatten)]
        page: Page,
    },
    /// What changed between two reports, by their `seq` (default: the latest and the one before).
    Diff {
        #[arg(long)]
        node: String,
        /// The earlier report's seq (default: the one before --to).
        #[arg(long, value_name = "SEQ")]
        from: Option<u64>,
        /// The later report's seq (default: the latest).
        #[arg(long, value_name = "SEQ")]
        to: Option<u64>,
    },
}

#[derive(Subcommand)]
pub enum JoinTokensCommand {
    /// A join token for one pool. The secret (`bcjt_…`) is printed once, or written to --out.
    Create {
        #[arg(long)]
        pool: String,
        #[arg(long, default_value = "")]
        description: String,
        /// How long it can be used: `30m`, `1h`, `7d` (at most 30 days; default 1h).
        #[arg(long, value_parser = parse_duration_s)]
        expires: Option<u64>,
        /// How many machines may join with it (default 1).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1000))]
        uses: Option<u32>,
        /// Write the secret to this new file (mode 0600, never over an existing file) and print
        /// only the token's id and the file.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's join tokens (never their secrets).
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One join token, by its `jt_…` id.
    Get { join_token_id: String },
    /// Revoke a join token by its `jt_…` id (a pasted secret is refused, and never sent).
    Revoke { join_token_id: String },
}

#[derive(Subcommand)]
pub enum FlavorsCommand {
    /// A flavor in one pool; its name is unique within the pool.
    Create {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        name: String,
        /// vCPUs (1 to 1024).
        #[arg(long)]
        vcpus: u32,
        /// Memory in MiB (1 to 16777216, 16 TiB).
        #[arg(long)]
        memory_mib: u64,
        /// Disk in GiB (1 to 65536).
        #[arg(long)]
        disk_gib: u64,
        /// GPUs passed through (0 to 64; default 0).
        #[arg(long, default_value_t = 0)]
        gpus: u32,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's flavors, of one pool with --pool.
    List {
        #[arg(long)]
        pool: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One flavor, by its `flv_…` id.
    Get { flavor_id: String },
    /// Delete a flavor.
    Delete {
        flavor_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

/// An image's disk format.
#[derive(Clone, Copy, ValueEnum)]
pub enum DiskFormatArg {
    Qcow2,
    Raw,
    /// A bootable ISO, for `metal deploy` and `metal rescue`.
    Iso,
}

#[derive(Subcommand)]
pub enum ImagesCommand {
    /// Register an image: where it is fetched from and the SHA-256 its bytes must have.
    Register {
        /// Unique within the tenant.
        #[arg(long)]
        name: String,
        /// Where the image is fetched from: `https://` or `http://`, without user, password or
        /// query (the URL enters the log). Not `--url`, which is every command's API URL: the
        /// token would go to the image's host.
        #[arg(long)]
        image_url: String,
        /// The image's SHA-256, 64 lowercase hex digits (as `sha256sum` prints it).
        #[arg(long)]
        sha256: String,
        /// qcow2 or raw (not `--format`, which is every command's output format).
        #[arg(long, value_enum)]
        disk_format: DiskFormatArg,
        /// The image's size in bytes, when known.
        #[arg(long)]
        size_bytes: Option<u64>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's images.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One image, by its `img_…` id.
    Get { image_id: String },
    /// Delete an image.
    Delete {
        image_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

/// What a node with live reservations does when its turn comes.
#[derive(clap::ValueEnum, Clone, Copy)]
pub enum BusyNodesArg {
    /// Leave it until its reservations end (drain it to hurry that along).
    Wait,
    /// Update it anyway: held GPUs and running instances stay through the agent's restart.
    Proceed,
}

#[derive(Subcommand)]
pub enum RolloutsCommand {
    /// Take a release to the nodes of a pool (and/or those with some labels) in waves.
    Create {
        /// The release, `rel_…`.
        #[arg(long)]
        release: String,
        /// The pool whose nodes take it.
        #[arg(long)]
        pool: Option<String>,
        /// Only nodes with this label, `key=value` (repeatable).
        #[arg(long = "label")]
        labels: Vec<String>,
        /// Cumulative waves, comma-separated: how many nodes have the release once each is
        /// done, as counts or percentages; the last reaches every node.
        #[arg(long, default_value = "1,100%", value_delimiter = ',')]
        waves: Vec<String>,
        /// Most nodes updating, rolling back or unreachable at once.
        #[arg(long, default_value_t = 1)]
        max_unavailable: u32,
        /// How long a node must stay ready on the new version to pass its gate: `30s`, `5m`.
        #[arg(long, default_value = "30s", value_parser = parse_duration_s)]
        min_ready: u64,
        /// How long a node has from its update to passing its gate.
        #[arg(long, default_value = "15m", value_parser = parse_duration_s)]
        node_deadline: u64,
        /// Failed nodes a wave tolerates before the rollout pauses.
        #[arg(long, default_value_t = 0)]
        wave_failures_max: u32,
        /// A node with live reservations: wait for them to end, or proceed.
        #[arg(long, value_enum, default_value = "wait")]
        busy_nodes: BusyNodesArg,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's rollouts.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One rollout: its waves and gates, its nodes, what it waits for.
    Get {
        rollout_id: String,
        /// Wait up to this long for the rollout to end (done, paused or aborted), printing
        /// its progress: `10m`.
        #[arg(long, value_parser = parse_duration_s)]
        wait: Option<u64>,
    },
    /// Send the release to no more nodes (the ones updating finish).
    Pause {
        rollout_id: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Go on, accepting the failures seen so far.
    Resume {
        rollout_id: String,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Roll the updated nodes back to the version they ran, then end.
    Abort {
        rollout_id: String,
        #[arg(long)]
        reason: Option<String>,
    },
}

/// How long to wait for an instance to settle.
#[derive(Args, Clone, Copy)]
pub struct InstanceWait {
    /// Wait up to this many seconds until the node observes what was asked (0: do not wait).
    #[arg(long, default_value_t = 0)]
    pub wait: u64,
}

#[derive(Subcommand)]
pub enum InstancesCommand {
    /// An instance on an active reservation whose GPUs its node holds, from a flavor of the
    /// reservation's pool (as many GPUs) and a registered image; started unless --stopped.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        reservation: String,
        #[arg(long)]
        flavor: String,
        #[arg(long)]
        image: String,
        /// Define it, but do not start it.
        #[arg(long)]
        stopped: bool,
        #[command(flatten)]
        wait: InstanceWait,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's instances, on one reservation with --reservation.
    List {
        #[arg(long)]
        reservation: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One instance, by its `inst_…` id, with what its node observes.
    Get { instance_id: String },
    /// Start an instance.
    Start {
        instance_id: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
    /// Stop an instance.
    Stop {
        instance_id: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
    /// Give an instance another flavor of its pool, with as many GPUs.
    Resize {
        instance_id: String,
        #[arg(long)]
        flavor: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
    /// Delete an instance from its node.
    Delete {
        instance_id: String,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        wait: InstanceWait,
    },
}

/// How long to wait for a machine's workflow to end.
#[derive(Args, Clone, Copy)]
pub struct MetalWait {
    /// Wait up to this many seconds until the machine rests in a stable state (0: do not wait).
    #[arg(long, default_value_t = 0)]
    pub wait: u64,
}

/// A verb on one machine.
#[derive(Args)]
pub struct MachineVerbArgs {
    /// The machine's `node_…` id.
    pub node_id: String,
    #[command(flatten)]
    pub if_version: IfVersion,
    #[command(flatten)]
    pub wait: MetalWait,
}

#[derive(Subcommand)]
pub enum MetalCommand {
    /// Enroll a machine by its BMC (Redfish over HTTPS); the password only from a file.
    Enroll {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        name: String,
        /// `https://host[:port]`.
        #[arg(long)]
        bmc_address: String,
        #[arg(long)]
        bmc_username: String,
        /// A file holding the BMC's password (its first line).
        #[arg(long)]
        bmc_password_file: PathBuf,
        /// The ComputerSystem (`/redfish/v1/Systems/…`) when the BMC has several.
        #[arg(long)]
        bmc_system_path: Option<String>,
        /// Check the BMC's certificate against the CA certificates in this PEM file.
        #[arg(long, conflicts_with_all = ["bmc_pin", "bmc_insecure"])]
        bmc_ca_file: Option<PathBuf>,
        /// Check the BMC's certificate by its public key: `sha256/…`.
        #[arg(long, conflicts_with = "bmc_insecure")]
        bmc_pin: Option<String>,
        /// Do not check the BMC's certificate (anyone on the path can read its password).
        #[arg(long)]
        bmc_insecure: bool,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's machines.
    List {
        #[arg(long)]
        pool: Option<String>,
        /// Only machines in this state (`available`, `deploy-wait`, …).
        #[arg(long)]
        state: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One machine: state, power, BMC, workflow.
    Get { node_id: String },
    /// Check the BMC and manage the machine (enroll → manageable).
    Manage(MachineVerbArgs),
    /// Read the machine's hardware from its BMC.
    Inspect(MachineVerbArgs),
    /// Clean the machine and offer it (manageable → available).
    Provide(MachineVerbArgs),
    /// Boot an image on the machine through virtual media; it is active once the installed
    /// system's agent joins as its node with the join token written to --token-out.
    Deploy {
        #[command(flatten)]
        verb: MachineVerbArgs,
        /// A registered image (`img_…`) whose URL the BMC's virtual CD boots.
        #[arg(long)]
        image: String,
        /// A new 0600 file for the one-use join token the installed system joins with
        /// (`bcd join --node-id NODE --token-file FILE`).
        #[arg(long)]
        token_out: PathBuf,
    },
    /// Tear down a deployed machine and clean it (drain its node first).
    Undeploy(MachineVerbArgs),
    /// Boot a deployed machine into a rescue image.
    Rescue {
        #[command(flatten)]
        verb: MachineVerbArgs,
        #[arg(long)]
        image: String,
    },
    /// Boot a rescued machine back into its system.
    Unrescue(MachineVerbArgs),
    /// Retire a machine: never offered or deployed again.
    Retire(MachineVerbArgs),
    /// Take a machine out of maintenance.
    Recover(MachineVerbArgs),
    /// Abort the machine's running workflow (in a wait state, or a power change).
    Abort(MachineVerbArgs),
    /// Power a machine on, off, or reboot it.
    Power {
        #[command(flatten)]
        verb: MachineVerbArgs,
        #[arg(value_parser = ["on", "off", "reboot"])]
        power: String,
    },
}

#[derive(Subcommand)]
pub enum WorkflowsCommand {
    /// A machine's workflows.
    List {
        #[arg(long)]
        node: String,
        #[command(flatten)]
        page: Page,
    },
    /// One workflow, by its `wf_…` id.
    Get { workflow_id: String },
    /// Abort a running workflow.
    Abort { workflow_id: String },
    /// Stop running a workflow's steps (its deadline runs on).
    Pause { workflow_id: String },
    /// Run a paused workflow's steps again.
    Resume { workflow_id: String },
    /// Run a backing-off step now, or a failed workflow's verb again.
    Retry { workflow_id: String },
}

#[derive(Subcommand)]
pub enum ReleasesCommand {
    /// Make a release key: KEY (the secret, 0600) and KEY.pub (its public line, which agents pin
    /// in [update] release_keys); never over a file.
    Keygen {
        /// Where the secret key goes (a new file).
        #[arg(long, value_name = "KEY")]
        out: PathBuf,
    },
    /// Write a release manifest for the artifacts and its detached signature (MANIFEST and
    /// MANIFEST.sig, new files).
    Sign {
        /// The release key (a file keygen wrote); never the secret itself.
        #[arg(long, value_name = "KEY")]
        key: PathBuf,
        /// The release's version (semver).
        #[arg(long)]
        version: String,
        /// ARCH=FILE (its URL is --url-base/FILE's name) or ARCH=FILE=URL; repeatable, one per
        /// architecture (x86_64, aarch64).
        #[arg(long = "artifact", value_name = "ARCH=FILE[=URL]", required = true)]
        artifacts: Vec<String>,
        /// Where the artifacts are served: http(s)://HOST/PATH.
        #[arg(long, value_name = "URL")]
        url_base: Option<String>,
        /// The oldest version this release may update (semver).
        #[arg(long, value_name = "VERSION")]
        min_update_from: Option<String>,
        /// It may replace a newer version (a release that rolls back); needs --not-after.
        #[arg(long, requires = "not_after")]
        allow_downgrade: bool,
        /// Until when the release may be taken (RFC 3339 UTC, 2026-05-01T00:00:00Z; at most 30
        /// days ahead when it is registered and taken): what a downgrade permission must say.
        #[arg(long, value_name = "TIME")]
        not_after: Option<String>,
        /// The manifest to write (and MANIFEST.sig beside it).
        #[arg(long, value_name = "MANIFEST")]
        out: PathBuf,
    },
    /// Check a manifest's signature against release public keys (KEY.pub), and its fields.
    Verify {
        #[arg(long, value_name = "MANIFEST")]
        manifest: PathBuf,
        /// The signature file (default: MANIFEST.sig).
        #[arg(long, value_name = "SIG")]
        signature: Option<PathBuf>,
        /// A trusted release key's public file (repeatable).
        #[arg(long = "key", value_name = "KEY.pub", required = true)]
        keys: Vec<PathBuf>,
    },
    /// Register a signed release: the manifest and signature `release sign` wrote. The control
    /// plane keeps it only when a key it trusts (`--release-key` of dev/serve) signed it.
    Register {
        /// The manifest (JSON, as signed).
        #[arg(long, value_name = "FILE")]
        manifest: PathBuf,
        /// Its signature (default: the manifest's path + `.sig`).
        #[arg(long, value_name = "FILE")]
        signature: Option<PathBuf>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's releases.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One release, by its `rel_…` id.
    Get { release_id: String },
}

#[derive(Subcommand)]
pub enum CommandsCommand {
    /// Send a command to a node's agent: `ping`, `gpu.hold`, `gpu.release`.
    Issue {
        /// The node (one that joined with `bcd join`).
        #[arg(long)]
        node: String,
        /// `ping`, `gpu.hold` or `gpu.release`.
        kind: String,
        /// The kind's arguments as a JSON object (`{"reservationId":"rsv_…","gpus":[0,1]}`).
        #[arg(long, value_name = "JSON")]
        args: Option<String>,
        /// How long the node has to run it: `30s`, `5m`, `1h` (at most a day; default 5m).
        #[arg(long, value_parser = parse_duration_s)]
        deadline: Option<u64>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's commands, of one node with --node.
    List {
        #[arg(long)]
        node: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One command.
    Get { command_id: String },
    /// Cancel a command that has not finished.
    Cancel { command_id: String },
}

#[derive(Subcommand)]
pub enum ReservationsCommand {
    /// A tenant's reservations.
    List {
        /// queued, active, released, expired or cancelled.
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        pool: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    Get {
        reservation_id: String,
    },
}

#[derive(Subcommand)]
pub enum QuotasCommand {
    /// The tenant's GPU quota in a pool, and how much of it is in use.
    Get {
        #[arg(long)]
        pool: String,
    },
    /// Set the tenant's GPU quota in a pool (queued and active reservations count).
    Set {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        gpus: u32,
    },
}

#[derive(Subcommand)]
pub enum WebhooksCommand {
    /// A tenant's webhooks.
    List {
        #[command(flatten)]
        page: Page,
    },
    Get {
        webhook_id: String,
    },
    /// Subscribe a receiver. The signing secret (`whsec_…`) is shown once.
    Create {
        /// The receiver's URL: https:// (http:// only to loopback in dev).
        #[arg(long)]
        endpoint: String,
        /// Comma-separated type patterns (`pool.*,node.registered`, or `*`).
        #[arg(long)]
        types: String,
        #[arg(long, default_value = "")]
        description: String,
        /// Write the secret to this new file (mode 0600) instead of printing it.
        #[arg(long)]
        secret_out: Option<PathBuf>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// Change the receiver, the types or the description.
    Update {
        webhook_id: String,
        #[arg(long)]
        endpoint: Option<String>,
        #[arg(long)]
        types: Option<String>,
        #[arg(long)]
        description: Option<String>,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Delete a webhook; its pending deliveries die.
    Delete {
        webhook_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Send a test delivery (`webhook.pinged`) to this webhook only.
    Ping {
        webhook_id: String,
    },
    /// A new signing secret, shown once; the old one keeps signing beside it for a while.
    RotateSecret {
        webhook_id: String,
        /// How long the old secret keeps signing: seconds (0 to 604800; default 86400).
        #[arg(long)]
        previous_valid_s: Option<u64>,
        /// Write the secret to this new file (mode 0600) instead of printing it.
        #[arg(long)]
        secret_out: Option<PathBuf>,
    },
    /// Deliveries and their attempts, newest first.
    Deliveries {
        webhook_id: String,
        /// pending, done or dead.
        #[arg(long)]
        state: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// Queue a done or dead delivery again.
    Redeliver {
        webhook_id: String,
        /// `evt_…/wh_…`, from `deliveries`.
        delivery_id: String,
    },
    /// Every event type a webhook can subscribe to.
    EventTypes,
}

// ---------------------------------------------------------------------------------------------
// Durations: one parser (humantime: `250ms`, `90s`, `15m`, `8h`, `1d`, `1h 30m`), bounded per flag.

/// Parses a duration between `min` and `max` that is a whole number of `unit`s.
pub fn parse_duration(text: &str, min: Duration, max: Duration, unit: Duration) -> Result<Duration, String> {
    let value = humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?} is not a duration like 250ms, 90s, 30m, 8h or 1d ({e})"))?;
    if value.as_nanos() % unit.as_nanos() != 0 {
        return Err(format!("{text:?} is not a whole number of {}", humantime::format_duration(unit)));
    }
    if value < min {
        return Err(if value.is_zero() {
            format!("{text:?} is zero: give at least {}", humantime::format_duration(min))
        } else {
            format!("{text:?} is shorter than {}", humantime::format_duration(min))
        });
    }
    if value > max {
        return Err(format!("{text:?} is longer than {}", humantime::format_duration(max)));
    }
    Ok(value)
}

const SECOND: Duration = Duration::from_secs(1);
const MILLISECOND: Duration = Duration::from_millis(1);

/// `--checkpoint-interval`: whole seconds up to a week; `0` never seals.
pub fn parse_interval_s(text: &str) -> Result<u64, String> {
    Ok(parse_duration(text, Duration::ZERO, Duration::from_secs(CHECKPOINT_INTERVAL_S_MAX), SECOND)?.as_secs())
}

/// `--lease`, `--delivery-timeout`, `--retry-base`: whole milliseconds, from 1 ms to a day.
pub fn parse_duration_ms(text: &str) -> Result<u64, String> {
    let value = parse_duration(text, MILLISECOND, Duration::from_millis(CONSUMER_DURATION_MS_MAX), MILLISECOND)?;
    Ok(value.as_millis() as u64)
}

/// `--node-lease`, `--node-heartbeat`: whole milliseconds, from 100 ms to ten minutes.
pub fn parse_node_lease_ms(text: &str) -> Result<u64, String> {
    let value = parse_duration(text, Duration::from_millis(100), Duration::from_millis(NODE_LEASE_MS_MAX), MILLISECOND)?;
    Ok(value.as_millis() as u64)
}

/// `--for`, `--by`: whole seconds, more than zero (a reservation lasts at least a second).
pub fn parse_duration_s(text: &str) -> Result<u64, String> {
    Ok(parse_duration(text, SECOND, Duration::from_secs(RESERVATION_DURATION_S_MAX), SECOND)?.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_tree_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations() {
        assert_eq!(parse_interval_s("0"), Ok(0));
        assert_eq!(parse_interval_s("15m"), Ok(900));
        assert!(parse_interval_s("8d").unwrap_err().contains("longer than"));
        assert!(parse_interval_s("500ms").unwrap_err().contains("whole number"));
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert_eq!(parse_duration_ms("2m"), Ok(120_000));
        assert!(parse_duration_ms("0s").unwrap_err().contains("zero"));
        assert!(parse_duration_ms("25h").is_err());
        assert_eq!(parse_duration_s("1d"), Ok(86_400));
        assert_eq!(parse_duration_s("1h 30m"), Ok(5400));
        assert!(parse_duration_s("0s").unwrap_err().contains("zero"));
        assert!(parse_duration_s("soon").unwrap_err().contains("duration"));
        assert!(parse_duration_s("11y").unwrap_err().contains("longer than"));
    }

    #[test]
    fn the_write_stall_defaults_to_the_gateways_limit() {
        let cli = Cli::try_parse_from(["better-compute", "dev"]).unwrap();
        let Command::Dev { server, .. } = cli.command else { panic!("not dev") };
        assert_eq!(server.write_stall, bc_gateway::conn::WRITE_STALL_S * 1000);
    }

    #[test]
    fn the_agents_flags_default_to_the_gateways_session_config() {
        let cli = Cli::try_parse_from(["better-compute", "dev"]).unwrap();
        let Command::Dev { server, agents_insecure_h2c, .. } = cli.command else { panic!("not dev") };
        let defaults = bc_gateway::agents::SessionConfig::default();
        assert_eq!((server.agents.node_lease, server.agents.node_heartbeat), (defaults.lease_ms, defaults.heartbeat_ms));
        assert_eq!(server.agents.agents_listen, DEFAULT_AGENTS_LISTEN);
        let agents = bc_gateway::agents::AgentLimits::default();
        let a = &server.agents;
        assert_eq!(
            (a.agents_connections_max, a.agents_connections_per_peer_max, a.agents_joins_max),
            (agents.connections_max as u64, agents.connections_per_peer_max as u64, agents.joins_max as u64)
        );
        assert_eq!(
            (a.agents_handshake_timeout, a.agents_idle_timeout),
            (agents.handshake_timeout.as_millis() as u64, agents.idle_timeout.as_millis() as u64)
        );
        assert!(!agents_insecure_h2c);
        // The certificate and its key go together.
        assert!(Cli::try_parse_from(["better-compute", "dev", "--agents-tls-cert", "c.pem"]).is_err());
        assert!(
            Cli::try_parse_from(["better-compute", "dev", "--agents-tls-cert", "c.pem", "--agents-tls-key", "k.pem"]).is_ok()
        );
        // h2c is dev's only.
        let serve = ["better-compute", "serve", "--database-url", "postgres://x", "--agents-insecure-h2c"];
        assert!(Cli::try_parse_from(serve).is_err());
    }

    #[test]
    fn the_connection_limits_default_to_the_gateways() {
        let cli = Cli::try_parse_from(["better-compute", "dev"]).unwrap();
        let Command::Dev { server, .. } = cli.command else { panic!("not dev") };
        assert_eq!(server.header_timeout, bc_gateway::conn::HEADER_READ_TIMEOUT_S * 1000);
        assert_eq!(server.idle_timeout, bc_gateway::conn::IDLE_TIMEOUT_S * 1000);
        assert_eq!(server.body_timeout, bc_gateway::conn::BODY_READ_TIMEOUT_S * 1000);
        assert_eq!(server.connections_max, bc_gateway::conn::CONNECTIONS_MAX as u64);
        let watchers = (server.watchers_max, server.watchers_per_tenant_max, server.watchers_per_key_max);
        let defaults = bc_gateway::watch::WatcherLimits::default();
        assert_eq!(watchers, (defaults.total as u64, defaults.per_tenant as u64, defaults.per_key as u64));
    }
}
