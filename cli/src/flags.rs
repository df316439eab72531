//! The top of `better-compute`'s command line, as clap types: [`Cli`], the global flags, the
//! list of commands, and the flag groups several command groups share ([`Deployment`],
//! [`DatabaseArgs`], [`Sealing`], [`Page`], [`IfVersion`], [`IdempotencyKey`]).
//!
//! Each command group's own flags and subcommands live beside the code that runs them, in
//! `commands/<group>.rs`; nothing here runs anything. Durations are parsed in one place,
//! [`parse_duration`] (humantime), each flag with its own bounds, so `90s` means the same
//! everywhere and an out-of-range value is refused before any command runs.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::commands::{
    agent_commands, api, audit, auth, batch, catalogue, console, drivers, events, exec, flavors, fleet, forward, init, instances,
    inventory, join_requests, join_tokens, meta, metal, nodes, operator, pools, releases, reservations, rollouts, sandboxes,
    secrets, sim, ssh_cert, usage, version, webhooks,
};
use crate::output::Format;

pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";
pub const DEFAULT_DATA_DIR: &str = ".better-compute";
/// Longest `--node-lease` accepted: ten minutes (a lapse shows no sooner than the lease).
pub const NODE_LEASE_MS_MAX: u64 = 600_000;
/// Longest sealing interval accepted: a week.
pub const CHECKPOINT_INTERVAL_S_MAX: u64 = 7 * 24 * 3600;
/// Longest lease or retry base accepted: a day.
pub const CONSUMER_DURATION_MS_MAX: u64 = 24 * 3600 * 1000;
/// Longest `--for` or `--by` the CLI sends (the pool's own maximum decides below it).
pub const RESERVATION_DURATION_S_MAX: u64 = 10 * 366 * 24 * 3600;

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
    /// The configuration file dev, serve, reconcile and the operator commands read under their
    /// flags (default: ./better-compute.toml when present); the file init writes.
    #[arg(long, global = true, env = "BETTER_COMPUTE_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
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

// ---------------------------------------------------------------------------------------------
// Commands: one line per command or group; a group's subcommands and flags are in its module.

#[derive(Subcommand)]
pub enum Command {
    /// Write a commented configuration file (better-compute.toml) and make the keys in its data
    /// directory; never over an existing file.
    Init(init::InitArgs),
    /// This build: its version, git commit, log format and target.
    Version(version::VersionArgs),
    /// Run the control plane on the embedded database (SQLite): nothing else to install.
    Dev(operator::DevArgs),
    /// Run the control plane on PostgreSQL (run `migrate` first).
    Serve(operator::ServeArgs),
    /// Run reconcilers (outbox consumers) as their own process, against the same database.
    Reconcile(operator::ReconcileArgs),
    /// Apply the database migrations.
    Migrate(operator::MigrateArgs),
    /// What is wrong with this deployment: the database, its schema, clock and settings, the
    /// keys, the agents' certificate, the disk, the reconcilers; each ok, warn or fail with a fix.
    Doctor(operator::DoctorArgs),
    /// A tar.gz to send when asking for help (--out FILE, new, 0600): versions, the settings
    /// with every secret removed, doctor, reconcilers status, the data directory's listing, the
    /// log's last lines (--log-file).
    SupportBundle(crate::support_bundle::SupportBundleArgs),
    /// The log key.
    Pki {
        #[command(subcommand)]
        command: operator::PkiCommand,
    },
    /// What each reconciler did last, in every process that runs one.
    Reconcilers {
        #[command(subcommand)]
        command: operator::ReconcilersCommand,
    },
    /// Read models.
    Projections {
        #[command(subcommand)]
        command: operator::ProjectionsCommand,
    },
    /// Checkpoints, verification and proofs of the log.
    Audit {
        #[command(subcommand)]
        command: audit::AuditCommand,
    },
    /// Replay an event export offline: verify it, rebuild the tenant's state at a seq.
    Sim {
        #[command(subcommand)]
        command: sim::SimCommand,
    },
    /// Call any API method: `api pools.get poolId=pool_…`; items `k=v`, `k:=json`, `a.b=v`,
    /// `ids[]=x`, `k=@file.txt`, `k:=@file.json`.
    Api(api::ApiArgs),
    /// The event log.
    Events {
        #[command(subcommand)]
        command: events::EventsCommand,
    },
    /// Pools of capacity.
    Pools {
        #[command(subcommand)]
        command: pools::PoolsCommand,
    },
    /// Hosts and their GPUs.
    Nodes {
        #[command(subcommand)]
        command: nodes::NodesCommand,
    },
    /// What a joined node's agent reported its machine holds: the latest, the history, what changed.
    Inventory {
        #[command(subcommand)]
        command: inventory::InventoryCommand,
    },
    /// The tokens machines join with (`bcd join`); a secret is shown once, or written to a new
    /// 0600 file with --out.
    JoinTokens {
        #[command(subcommand)]
        command: join_tokens::JoinTokensCommand,
    },
    /// Machines that asked to join without a token (`bcd join --request`): list them, approve
    /// one into a pool, or reject it with a reason.
    JoinRequests {
        #[command(subcommand)]
        command: join_requests::JoinRequestsCommand,
    },
    /// The hypervisors, sandbox runtimes and BMC protocols of the fleet: what its agents
    /// advertise and how its machines are managed.
    Drivers {
        #[command(subcommand)]
        command: drivers::DriversCommand,
    },
    /// Signed bcd releases: a release key, a signed manifest, its check (offline); register
    /// one with the control plane, list, get.
    Releases {
        #[command(subcommand)]
        command: releases::ReleasesCommand,
    },
    /// Destructive batches under a quorum of approver keys: keygen, sign and sign-approvers
    /// (offline); create, list, show, members, approve, cancel; the approver set.
    Batch {
        #[command(subcommand)]
        command: batch::BatchCommand,
    },
    /// Commands to a node's agent: issue, list, get, cancel.
    Commands {
        #[command(subcommand)]
        command: agent_commands::CommandsCommand,
    },
    /// Reserve GPUs: placed at once, or queued until capacity frees (waits up to --wait).
    Reserve(reservations::ReserveArgs),
    /// End an active reservation, or cancel a queued one.
    Release(reservations::ReleaseArgs),
    /// Move an active reservation's end (within the pool's maximum).
    Extend(reservations::ExtendArgs),
    /// Reservations.
    Reservations {
        #[command(subcommand)]
        command: reservations::ReservationsCommand,
    },
    /// Free GPUs per pool and per product; with --preview, would a reservation fit now, and where.
    Capacity(reservations::CapacityArgs),
    /// GPU quotas per pool.
    Quotas {
        #[command(subcommand)]
        command: reservations::QuotasCommand,
    },
    /// Usage windows in GPU-hours, the billing export (FOCUS CSV, CloudEvents JSON lines), prices.
    Usage {
        #[command(subcommand)]
        command: usage::UsageCommand,
    },
    /// The fleet as one reviewed document: export, plan, apply (with the plan's hash), status.
    Fleet {
        #[command(subcommand)]
        command: fleet::FleetCommand,
    },
    /// The shapes of instance a pool offers: vCPUs, memory, disk, GPUs.
    Flavors {
        #[command(subcommand)]
        command: flavors::FlavorsCommand,
    },
    /// Disk images instances boot from, by URL and SHA-256.
    Images {
        #[command(subcommand)]
        command: flavors::ImagesCommand,
    },
    /// A release taken to a pool's nodes in waves, with health gates: create, list, get,
    /// pause, resume, abort.
    Rollouts {
        #[command(subcommand)]
        command: rollouts::RolloutsCommand,
    },
    /// Virtual machines on a reservation's node, with its GPUs passed through.
    Instances {
        #[command(subcommand)]
        command: instances::InstancesCommand,
    },
    /// Sandboxes: isolated, short-lived machines from templates (gVisor on the node), warm or
    /// cold; `sandbox exec SBX -- COMMAND…` runs a command in one.
    Sandbox {
        #[command(subcommand)]
        command: sandboxes::SandboxCommand,
    },
    /// The templates sandboxes are made from: pool, flavor, root-filesystem image, env, TTLs,
    /// warm pool.
    SandboxTemplate {
        #[command(subcommand)]
        command: sandboxes::SandboxTemplateCommand,
    },
    /// Persistent volumes for sandboxes: an ext4 disk of its size on one node, mounted by the
    /// sandboxes of templates that name it, one sandbox at a time.
    SandboxVolume {
        #[command(subcommand)]
        command: sandboxes::SandboxVolumeCommand,
    },
    /// Snapshots of sandboxes (memory and disk, on their node): list, get, delete; `sandbox
    /// snapshot` takes one and `sandbox create --from-snapshot` restores one.
    SandboxSnapshot {
        #[command(subcommand)]
        command: sandboxes::SandboxSnapshotCommand,
    },
    /// Bare-metal machines by their BMCs: enroll, manage, inspect, provide, deploy, undeploy,
    /// rescue, power; each verb a workflow with deadlines.
    Metal {
        #[command(subcommand)]
        command: metal::MetalCommand,
    },
    /// A machine's workflows: list (--node), get, abort, pause, resume, retry.
    Workflows {
        #[command(subcommand)]
        command: metal::WorkflowsCommand,
    },
    /// Saved credentials: login (token from stdin or BETTER_COMPUTE_TOKEN), status, logout.
    Auth {
        #[command(subcommand)]
        command: auth::AuthCommand,
    },
    /// Write-only secrets: put (the value from --value-file or --stdin only), list (names and
    /// versions, never values), delete; webhooks name them as secret://TENANT/sec_….
    Secrets {
        #[command(subcommand)]
        command: secrets::SecretsCommand,
    },
    /// Sites: where machines are (a region and labels); pools name theirs (`pools create --site`).
    Sites {
        #[command(subcommand)]
        command: catalogue::SitesCommand,
    },
    /// Projects: a tenant's subdivisions; reservations are made in one with --project.
    Projects {
        #[command(subcommand)]
        command: catalogue::ProjectsCommand,
    },
    /// Webhook subscriptions and their deliveries (Standard Webhooks signatures).
    Webhooks {
        #[command(subcommand)]
        command: webhooks::WebhooksCommand,
    },
    /// Break-glass SSH: a certificate for your public key that only this node's sshd accepts,
    /// written as KEY-cert.pub beside it; with --connect HOST, ssh to the node with it.
    SshCert(ssh_cert::SshCertArgs),
    /// A terminal on a node (--node: a shell as its agent's user) or a running instance's
    /// serial console (--instance) through the node's agent; exits with the remote program's
    /// status (255: the tunnel broke). Ctrl-] detaches.
    Console(console::ConsoleArgs),
    /// A shell in a running instance (--instance); refused until guests have an agent (use
    /// console --instance).
    Exec(exec::ExecArgs),
    /// A port of a running instance on a local port, like ssh -L: one tunnel per accepted
    /// connection, until Ctrl-C.
    Forward(forward::ForwardArgs),
    /// Print a shell completion script: `source <(better-compute completion bash)`.
    Completion(meta::CompletionArgs),
    /// The commands, one command's flags (`help reserve`), or with --json the whole manifest.
    Help(meta::HelpArgs),
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

/// `--node-cert-lifetime`: whole milliseconds, within the node CA's bounds
/// (`bc_gateway::node_ca::NODE_CERT_LIFETIME_MS_MIN` to `_MAX`).
pub fn parse_node_cert_lifetime_ms(text: &str) -> Result<u64, String> {
    use bc_gateway::node_ca::{NODE_CERT_LIFETIME_MS_MAX, NODE_CERT_LIFETIME_MS_MIN};
    let (min, max) = (Duration::from_millis(NODE_CERT_LIFETIME_MS_MIN), Duration::from_millis(NODE_CERT_LIFETIME_MS_MAX));
    let value = parse_duration(text, min, max, MILLISECOND)?;
    Ok(value.as_millis() as u64)
}

/// `--node-lease`, `--node-heartbeat`: whole milliseconds, from 100 ms to ten minutes.
pub fn parse_node_lease_ms(text: &str) -> Result<u64, String> {
    let value = parse_duration(text, Duration::from_millis(100), Duration::from_millis(NODE_LEASE_MS_MAX), MILLISECOND)?;
    Ok(value.as_millis() as u64)
}

/// `--tunnel-idle-timeout`, `--tunnel-max-duration`: whole milliseconds, from a second to
/// `tunnels::TUNNEL_TIMEOUT_MAX_S`.
pub fn parse_tunnel_duration_ms(text: &str) -> Result<u64, String> {
    let max = Duration::from_secs(bc_gateway::tunnels::TUNNEL_TIMEOUT_MAX_S);
    Ok(parse_duration(text, SECOND, max, MILLISECOND)?.as_millis() as u64)
}

/// `--tunnel-ticket-ttl`: whole milliseconds, from a second to `tunnels::TICKET_TTL_MAX_S`.
pub fn parse_ticket_ttl_ms(text: &str) -> Result<u64, String> {
    let max = Duration::from_secs(bc_gateway::tunnels::TICKET_TTL_MAX_S);
    Ok(parse_duration(text, SECOND, max, MILLISECOND)?.as_millis() as u64)
}

/// `--usage-window`: whole milliseconds, from `usage::WINDOW_MS_MIN` (a second) to a day.
pub fn parse_usage_window_ms(text: &str) -> Result<u64, String> {
    use bc_reconcilers::usage::{WINDOW_MS_MAX, WINDOW_MS_MIN};
    let (min, max) = (Duration::from_millis(WINDOW_MS_MIN), Duration::from_millis(WINDOW_MS_MAX));
    Ok(parse_duration(text, min, max, SECOND)?.as_millis() as u64)
}

/// `--max-reservation` (`pools update`): whole seconds within the API's bounds
/// (`MAX_RESERVATION_S_MIN`, a minute, to `MAX_RESERVATION_S_LIMIT`, 366 days).
pub fn parse_max_reservation_s(text: &str) -> Result<u64, String> {
    use bc_gateway::api::{MAX_RESERVATION_S_LIMIT, MAX_RESERVATION_S_MIN};
    let (min, max) = (Duration::from_secs(MAX_RESERVATION_S_MIN), Duration::from_secs(MAX_RESERVATION_S_LIMIT));
    Ok(parse_duration(text, min, max, SECOND)?.as_secs())
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
    fn tunnel_durations() {
        assert_eq!(parse_tunnel_duration_ms("2s"), Ok(2_000));
        assert_eq!(parse_tunnel_duration_ms("12h"), Ok(12 * 3600 * 1000));
        assert!(parse_tunnel_duration_ms("500ms").unwrap_err().contains("shorter than"));
        assert!(parse_tunnel_duration_ms("8d").unwrap_err().contains("longer than"));
        assert_eq!(parse_ticket_ttl_ms("30s"), Ok(30_000));
        assert!(parse_ticket_ttl_ms("6m").unwrap_err().contains("longer than"));
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
}
