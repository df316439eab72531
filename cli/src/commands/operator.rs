//! The operator commands that open the database themselves: `dev`, `serve`, `reconcile`,
//! `migrate`, `doctor`, `pki show|renew-ca|rotate-log-key|rotate-data-key|rotate-ssh-ca`, `projections rebuild`. The work is in `crate::server`
//! and `crate::audit`; this module turns flags into its options.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use crate::client::CliError;
use crate::flags::{
    DEFAULT_DATA_DIR, DatabaseArgs, Deployment, Sealing, parse_duration_ms, parse_node_lease_ms, parse_ticket_ttl_ms,
    parse_tunnel_duration_ms,
};
use crate::output::Format;
use crate::server::{self, AgentsOptions, ConsumerOptions, Database};

use super::Context;

#[derive(Args)]
pub struct DevArgs {
    #[command(flatten)]
    pub dir: DataDir,
    #[command(flatten)]
    pub server: ServerArgs,
    /// Serve the agents' endpoint as plaintext h2c instead of TLS: only on a loopback
    /// --agents-listen, and only in dev.
    #[arg(long)]
    pub agents_insecure_h2c: bool,
    /// Start N simulated machines in this process (1 to 1,000): real agents on seeded fake
    /// machines (as `bcd sim` runs them) in a pool named `sim`, kept in DATA_DIR/sim.
    #[arg(long, value_name = "N", value_parser = crate::sim_agents::parse_sim_nodes)]
    pub sim: Option<u32>,
}

#[derive(Args)]
pub struct ServeArgs {
    /// PostgreSQL: `postgres://USER@HOST/DB`.
    #[arg(long, env = "BETTER_COMPUTE_DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Where the log key and the first admin token are kept.
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    pub data_dir: PathBuf,
    #[command(flatten)]
    pub server: ServerArgs,
    /// Allow http:// webhook receivers on loopback (tests, single-host setups).
    #[arg(long)]
    pub webhook_allow_loopback: bool,
    /// What this process runs: `api` (the API on --listen; without it --listen serves only
    /// /healthz, /readyz and /metrics), `agents` (the agents' endpoint), `reconcilers` or
    /// `reconcilers:NAME[:NAME…]`, comma-separated. Default: all of them.
    #[arg(long, value_name = "ROLES", value_parser = crate::roles::Roles::parse, conflicts_with = "no_reconcilers")]
    pub roles: Option<crate::roles::Roles>,
}

#[derive(Args)]
pub struct ReconcileArgs {
    /// Only these reconcilers (repeatable). Default: all (`witnesses` only with --witness).
    #[arg(long, value_name = "NAME", value_parser = clap::builder::PossibleValuesParser::new(bc_reconcilers::registry::NAMES))]
    pub only: Vec<String>,
    /// A witness to cosign each sealed checkpoint, `NAME=URL+VKEY` (repeatable): the
    /// `witnesses` reconciler sends them.
    #[arg(long = "witness", value_name = "NAME=URL+VKEY")]
    pub witnesses: Vec<String>,
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub consumers: ConsumerArgs,
    #[command(flatten)]
    pub sealing: Sealing,
    #[command(flatten)]
    pub data_key: DataKeyArgs,
    /// Allow http:// webhook receivers on loopback (dev, tests).
    #[arg(long)]
    pub webhook_allow_loopback: bool,
    /// Serve this process's `GET /metrics` (Prometheus: its passes, outbox items and appends)
    /// on this address.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
}

#[derive(Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
}

#[derive(Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub db: DatabaseArgs,
    #[command(flatten)]
    pub data_key: DataKeyArgs,
    /// A warning is a finding too (exit DOCTOR_FINDINGS).
    #[arg(long)]
    pub strict: bool,
    /// The checks as a JSON array.
    #[arg(long)]
    pub json: bool,
    /// A witness to check, `NAME=URL+VKEY` as dev and serve take it (repeatable; the
    /// configuration file's `witness` too): reachable, and cosigning the newest checkpoint.
    #[arg(long = "witness", value_name = "NAME=URL+VKEY")]
    pub witnesses: Vec<String>,
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
pub const DEFAULT_AGENTS_LISTEN: &str = "127.0.0.1:7444";

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
    /// The length of a usage window (`usage list`, `usage export`): from a second (for tests) to a
    /// day. A window closes a tenth of its length after its end, at most a minute.
    #[arg(long, default_value = "1h", value_parser = crate::flags::parse_usage_window_ms)]
    pub usage_window: u64,
}

/// What `dev` and `serve` share: the address, sealing, and the reconcilers run in process.
#[derive(Args)]
pub struct ServerArgs {
    /// Where the API listens (HTTP).
    #[arg(long, default_value = DEFAULT_LISTEN)]
    pub listen: String,
    /// Serve `GET /metrics` (Prometheus) on this address instead of on --listen.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_listen: Option<String>,
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
    /// The approvers' quorum: metal undeploy, deploy, retire and power off beyond one machine,
    /// rollouts to more than one node, nodes delete and the root tenant's release of another
    /// tenant's reservation are taken only through a destructive batch, signed by the published
    /// approver set's quorum (`metal bulk`, or `rollouts create`, `nodes delete` and `release`
    /// with `--batch-reason`); one call on such a scope is refused BATCH_REQUIRED, its hint
    /// naming that command (docs/batches.md).
    #[arg(long)]
    pub approvers: bool,
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
    /// Tunnels (`console`) one tenant may hold open at once, unspent tickets included.
    #[arg(long, default_value_t = bc_gateway::tunnels::TUNNELS_PER_TENANT_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_535))]
    pub tunnels_per_tenant_max: u64,
    /// Tunnels one API key may hold open at once.
    #[arg(long, default_value_t = bc_gateway::tunnels::TUNNELS_PER_KEY_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=65_535))]
    pub tunnels_per_key_max: u64,
    /// Tunnels open to one node at once: each is a stream of the agent's connection, which
    /// carries 32 with its session.
    #[arg(long, default_value_t = bc_gateway::tunnels::TUNNELS_PER_NODE_MAX as u64, value_parser = clap::value_parser!(u64).range(1..=31))]
    pub tunnels_per_node_max: u64,
    /// A tunnel carrying no byte of data either way this long is closed (1s to 7d).
    #[arg(long, default_value = "15m", value_parser = parse_tunnel_duration_ms)]
    pub tunnel_idle_timeout: u64,
    /// The longest a tunnel stays open (1s to 7d).
    #[arg(long, default_value = "12h", value_parser = parse_tunnel_duration_ms)]
    pub tunnel_max_duration: u64,
    /// How long a ticket of tunnels.open is good for (1s to 5m).
    #[arg(long, default_value = "30s", value_parser = parse_ticket_ttl_ms)]
    pub tunnel_ticket_ttl: u64,
    /// Requests a second one API key may make, sustained; more are refused RATE_LIMITED (429
    /// with Retry-After). 0 turns the per-key limit off.
    #[arg(long, default_value_t = bc_gateway::rate_limit::RATE_PER_KEY_DEFAULT, value_parser = clap::value_parser!(u32).range(0..=i64::from(bc_gateway::rate_limit::RATE_MAX)))]
    pub rate_per_key: u32,
    /// Requests one API key may make at once above its rate.
    #[arg(long, default_value_t = bc_gateway::rate_limit::BURST_PER_KEY_DEFAULT, value_parser = clap::value_parser!(u32).range(1..=i64::from(bc_gateway::rate_limit::RATE_MAX)))]
    pub burst_per_key: u32,
    /// Requests a second all of one tenant's API keys may make together. 0 turns it off.
    #[arg(long, default_value_t = bc_gateway::rate_limit::RATE_PER_TENANT_DEFAULT, value_parser = clap::value_parser!(u32).range(0..=i64::from(bc_gateway::rate_limit::RATE_MAX)))]
    pub rate_per_tenant: u32,
    /// Requests one tenant's keys may make at once above its rate.
    #[arg(long, default_value_t = bc_gateway::rate_limit::BURST_PER_TENANT_DEFAULT, value_parser = clap::value_parser!(u32).range(1..=i64::from(bc_gateway::rate_limit::RATE_MAX)))]
    pub burst_per_tenant: u32,
    #[command(flatten)]
    pub agents: AgentsArgs,
}

/// The agents' endpoint (gRPC, `bcd`): where it listens, its serving certificate, the lease.
#[derive(Args)]
pub struct AgentsArgs {
    /// Where the agents' endpoint listens (TLS; agents pin the certificate's key).
    #[arg(long, default_value = DEFAULT_AGENTS_LISTEN)]
    pub agents_listen: String,
    /// The agents' endpoint as agents reach it (https://HOST:PORT; a load balancer or proxy in
    /// front of --agents-listen), which GET /.well-known/better-compute names. Default: the
    /// address --agents-listen bound.
    #[arg(long, value_name = "URL", value_parser = parse_agents_url)]
    pub agents_url: Option<String>,
    /// Take join tokens only sealed to the join encryption key (bcd join through the well-known
    /// document): a plain token is refused, so no proxy in front of the agents' endpoint ever
    /// carries a usable one. Off by default: agents that joined before the document, bcd sim and
    /// dev --sim send plain tokens.
    #[arg(long)]
    pub agents_sealed_joins_only: bool,
    /// The EK CA bundle (PEM): the certificates a TPM's endorsement key certificate must chain to
    /// for bcd join --attestor tpm (the TPM vendors' roots). With --tpm-join-pool; without both,
    /// TPM joins are refused.
    #[arg(long, value_name = "FILE")]
    pub tpm_ek_ca_bundle: Option<PathBuf>,
    /// The pool (pool_…) every machine admitted by its TPM joins; with --tpm-ek-ca-bundle.
    #[arg(long, value_name = "POOL")]
    pub tpm_join_pool: Option<String>,
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
    /// How long a node certificate is valid (1m to 30d); a node renews it at two thirds of that.
    #[arg(long, default_value = "24h", value_parser = crate::flags::parse_node_cert_lifetime_ms)]
    pub node_cert_lifetime: u64,
}

/// `--agents-url`: `https://HOST:PORT` (or `http://` for a loopback h2c `dev` endpoint), no
/// path, at most `bc_core::well_known::AGENTS_URL_BYTES_MAX` bytes: what `bcd` takes as its
/// `gateway`.
fn parse_agents_url(text: &str) -> Result<String, String> {
    let rest = text.strip_prefix("https://").or_else(|| text.strip_prefix("http://"));
    let authority = rest.map(|r| r.trim_end_matches('/'));
    let well_formed = authority.is_some_and(|a| {
        !a.is_empty()
            && !a.contains(['/', '@', '?', '#'])
            && a.rsplit_once(':').is_some_and(|(_, port)| port.parse::<u16>().is_ok())
    });
    if !well_formed
        || text.len() > bc_core::well_known::AGENTS_URL_BYTES_MAX
        || text.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(format!(
            "the agents' URL is https://HOST:PORT (at most {} bytes, no path)",
            bc_core::well_known::AGENTS_URL_BYTES_MAX
        ));
    }
    Ok(text.trim_end_matches('/').to_owned())
}

/// `pki rotate-ssh-ca --grace`'s default: `SSH_CA_GRACE_MS_DEFAULT` (a test holds them equal).
const SSH_CA_GRACE_DEFAULT: &str = "24h";

/// `--grace`: whole seconds, from none to `SSH_CA_GRACE_MS_MAX`.
fn parse_ssh_ca_grace_ms(text: &str) -> Result<u64, String> {
    use bc_projections::decide::ssh_cert::SSH_CA_GRACE_MS_MAX;
    let max = std::time::Duration::from_millis(SSH_CA_GRACE_MS_MAX);
    let grace = crate::flags::parse_duration(text, std::time::Duration::ZERO, max, std::time::Duration::from_secs(1))?;
    Ok(grace.as_millis() as u64)
}

/// `pki renew-ca --overlap`'s default: `NODE_CA_OVERLAP_MS_DEFAULT` (a test holds them equal).
const NODE_CA_OVERLAP_DEFAULT: &str = "48h";

/// `--overlap`: whole seconds, `NODE_CA_OVERLAP_MS_MIN` to `_MAX`.
fn parse_node_ca_overlap_ms(text: &str) -> Result<u64, String> {
    use bc_gateway::node_ca::{NODE_CA_OVERLAP_MS_MAX, NODE_CA_OVERLAP_MS_MIN};
    let (min, max) =
        (std::time::Duration::from_millis(NODE_CA_OVERLAP_MS_MIN), std::time::Duration::from_millis(NODE_CA_OVERLAP_MS_MAX));
    let overlap = crate::flags::parse_duration(text, min, max, std::time::Duration::from_secs(1))?;
    Ok(overlap.as_millis() as u64)
}

#[derive(Subcommand)]
pub enum PkiCommand {
    /// Print the log key's id, pin (`sha256/…`) and note verifier key (vkey), and the SSH user
    /// CA: the current key and the replaced ones still trusted, with their grace's end.
    Show {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        deployment: Deployment,
    },
    /// Replace the SSH user CA: certificates are signed by the new one at once; nodes trust the
    /// replaced one beside it until --grace has passed.
    RotateSshCa {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        data_key: DataKeyArgs,
        /// How long nodes still trust the replaced CA (its certificates keep working), at most
        /// 7 days; `0s` ends its trust at once (a key that leaked).
        #[arg(long, default_value = SSH_CA_GRACE_DEFAULT, value_parser = parse_ssh_ca_grace_ms)]
        grace: u64,
    },
    /// Roll the node CA: node certificates are issued by a new CA at once; the replaced CA's
    /// certificates still verify until --overlap has passed (node-ca.crt holds both till then).
    RenewCa {
        #[command(flatten)]
        db: DatabaseArgs,
        #[command(flatten)]
        data_key: DataKeyArgs,
        /// How long the replaced CA's certificates still verify: 1h to 60d (nodes renew onto the
        /// new CA within two thirds of --node-cert-lifetime).
        #[arg(long, default_value = NODE_CA_OVERLAP_DEFAULT, value_parser = parse_node_ca_overlap_ms)]
        overlap: u64,
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

impl DatabaseArgs {
    pub fn database(&self) -> Database {
        Database::from_args(&self.data_dir, self.database_url.as_deref())
    }
}

impl ConsumerArgs {
    fn options(&self, allow_loopback: bool) -> Result<ConsumerOptions, CliError> {
        if self.lease < 2 * self.delivery_timeout {
            return Err(CliError::usage(format!(
                "--lease ({} ms) must be at least twice --delivery-timeout ({} ms)",
                self.lease, self.delivery_timeout
            )));
        }
        Ok(ConsumerOptions {
            delivery_timeout_ms: self.delivery_timeout,
            policy: bc_core::webhook::EndpointPolicy { allow_loopback, allow_private: self.webhook_allow_private },
            bmc_networks: bc_bmc::BmcNetworks::parse(&self.bmc_allow_networks)
                .map_err(|e| CliError::usage(format!("--bmc-allow-network {e}")))?,
            lease_ms: self.lease,
            retry: bc_reconcilers::outbox::RetryPolicy {
                base_ms: self.retry_base,
                attempts_max: self.retry_attempts,
                ..bc_reconcilers::outbox::RetryPolicy::DEFAULT
            },
            concurrency: self.concurrency as usize,
            poll_ms: 250,
            tick_ms: 500,
            usage_window_ms: self.usage_window,
        })
    }
}

impl AgentsArgs {
    fn options(&self, plaintext: bool, dev: bool, write_stall_ms: u64) -> Result<AgentsOptions, CliError> {
        let tls_files = self.agents_tls_cert.clone().zip(self.agents_tls_key.clone());
        let session = bc_gateway::agents::SessionConfig { lease_ms: self.node_lease, heartbeat_ms: self.node_heartbeat };
        let ms = std::time::Duration::from_millis;
        let limits = bc_gateway::agents::AgentLimits {
            connections_max: self.agents_connections_max as usize,
            connections_per_peer_max: self.agents_connections_per_peer_max.min(self.agents_connections_max) as usize,
            handshake_timeout: ms(self.agents_handshake_timeout),
            idle_timeout: ms(self.agents_idle_timeout.max(self.agents_handshake_timeout)),
            joins_max: self.agents_joins_max as usize,
            write_stall: ms(write_stall_ms),
        };
        let mut options = AgentsOptions::new(&self.agents_listen, tls_files, plaintext, dev, session, limits)?;
        options.node_cert_lifetime_ms = self.node_cert_lifetime;
        options.public_url = self.agents_url.clone();
        options.sealed_joins_only = self.agents_sealed_joins_only;
        options.tpm_joins = match (&self.tpm_ek_ca_bundle, &self.tpm_join_pool) {
            (None, None) => None,
            (Some(bundle), Some(pool)) => {
                let pool = pool.parse().map_err(|e| CliError::usage(format!("--tpm-join-pool: {e}")))?;
                Some(
                    bc_gateway::agents::tpm_join::TpmJoins::load(bundle, pool)
                        .map_err(|e| CliError::usage(format!("--tpm-ek-ca-bundle {e}")))?,
                )
            }
            _ => return Err(CliError::usage("--tpm-ek-ca-bundle and --tpm-join-pool go together (TPM joins need both)")),
        };
        Ok(options)
    }
}

impl ServerArgs {
    fn serve_limits(&self) -> Result<bc_gateway::ServeLimits, CliError> {
        let ms = std::time::Duration::from_millis;
        let watchers = bc_gateway::watch::WatcherLimits::checked(
            self.watchers_max as usize,
            self.watchers_per_tenant_max as usize,
            self.watchers_per_key_max as usize,
            self.connections_max as usize,
        )
        .map_err(|e| CliError::usage(format!("--watchers-max, --watchers-per-tenant-max, --watchers-per-key-max: {e}")))?;
        Ok(bc_gateway::ServeLimits {
            write_stall: ms(self.write_stall),
            header_read_timeout: ms(self.header_timeout),
            idle_timeout: ms(self.idle_timeout.max(self.header_timeout)),
            body_read_timeout: ms(self.body_timeout),
            connections_max: self.connections_max as usize,
            watchers,
            tunnels: bc_gateway::tunnels::TunnelLimits {
                per_tenant_max: self.tunnels_per_tenant_max as usize,
                per_key_max: self.tunnels_per_key_max as usize,
                per_node_max: self.tunnels_per_node_max as usize,
                idle_timeout: ms(self.tunnel_idle_timeout),
                max_duration: ms(self.tunnel_max_duration),
                ticket_ttl: ms(self.tunnel_ticket_ttl),
            },
            rate: bc_gateway::rate_limit::RateLimits {
                per_key: bc_gateway::rate_limit::Rate { per_s: self.rate_per_key, burst: self.burst_per_key },
                per_tenant: bc_gateway::rate_limit::Rate { per_s: self.rate_per_tenant, burst: self.burst_per_tenant },
            },
            ..bc_gateway::ServeLimits::default()
        })
    }
}

/// How `dev` or `serve` runs: its roles, and `dev --sim`'s machines.
struct Shape {
    roles: Option<crate::roles::Roles>,
    sim_nodes: Option<u32>,
}

async fn run_server(
    db: Database,
    data_dir: &Path,
    args: &ServerArgs,
    dev: bool,
    allow_loopback: bool,
    agents_plaintext: bool,
    shape: Shape,
) -> Result<(), CliError> {
    let options = args.consumers.options(allow_loopback)?;
    let agents = args.agents.options(agents_plaintext, dev, args.write_stall)?;
    let roles = match shape.roles {
        Some(roles) => roles,
        None if args.no_reconcilers => crate::roles::Roles::without_reconcilers(),
        None => crate::roles::Roles::all(),
    };
    let release_keys = read_release_keys(&args.release_keys)?;
    server::run_server(
        db,
        data_dir,
        &args.data_key.path(data_dir),
        (&args.listen, args.metrics_listen.as_deref()),
        dev,
        args.sealing.checkpoint_interval,
        &args.sealing.deployment.deployment,
        &args.witnesses,
        &options,
        (&roles, shape.sim_nodes),
        args.serve_limits()?,
        &agents,
        server::Safeguards { release_keys, batch_quorum: args.approvers },
    )
    .await
}

/// The release keys `--release-key` names: each file one `rk_… BASE64` line.
fn read_release_keys(paths: &[PathBuf]) -> Result<Vec<bc_core::release::ReleasePublicKey>, CliError> {
    let mut keys: Vec<bc_core::release::ReleasePublicKey> = Vec::new();
    for path in paths {
        let text =
            std::fs::read_to_string(path).map_err(|e| CliError::usage(format!("--release-key {}: {e}", path.display())))?;
        let key = bc_core::release::ReleasePublicKey::parse_line(text.trim()).map_err(|e| {
            CliError::usage(format!("--release-key {}: {e}", path.display()))
                .hint("give the .pub file `better-compute release keygen` wrote")
        })?;
        if !keys.iter().any(|k| k.key_id() == key.key_id()) {
            keys.push(key);
        }
    }
    Ok(keys)
}

pub async fn dev(args: DevArgs) -> Result<(), CliError> {
    let DevArgs { dir, server, agents_insecure_h2c, sim } = args;
    if sim.is_some() {
        crate::sim_agents::check_build()?;
    }
    let db = Database::Sqlite(dir.data_dir.join(server::SQLITE_FILE));
    // dev delivers webhooks to loopback receivers: that is where a developer's are.
    let shape = Shape { roles: None, sim_nodes: sim };
    run_server(db, &dir.data_dir, &server, true, true, agents_insecure_h2c, shape).await
}

pub async fn serve(args: ServeArgs) -> Result<(), CliError> {
    let ServeArgs { database_url, data_dir, server, webhook_allow_loopback, roles } = args;
    let shape = Shape { roles, sim_nodes: None };
    run_server(Database::Postgres(database_url), &data_dir, &server, false, webhook_allow_loopback, false, shape).await
}

pub async fn reconcile(args: ReconcileArgs) -> Result<(), CliError> {
    let ReconcileArgs { only, witnesses, db, consumers, sealing, data_key, webhook_allow_loopback, metrics_listen } = args;
    let key_path = data_key.path(&db.data_dir);
    let options = consumers.options(webhook_allow_loopback)?;
    let metrics = metrics_listen.as_deref();
    server::reconcile(&db.database(), &db.data_dir, &key_path, &only, &options, &sealing, &witnesses, metrics).await
}

pub async fn reconcilers(ctx: &Context, command: ReconcilersCommand) -> Result<(), CliError> {
    match command {
        ReconcilersCommand::Status { db } => {
            let value = server::reconcilers_status(&db.database()).await?;
            if ctx.global.format.unwrap_or(Format::Table) != Format::Table || ctx.global.query.is_some() {
                return ctx.print(&value, Format::Table);
            }
            // The table shows every registered reconciler: the recorded passes, then one row
            // per reconciler that never ran, its state in OUTCOME.
            let mut rows = value["items"].as_array().cloned().unwrap_or_default();
            rows.extend(value["neverRun"].as_array().cloned().unwrap_or_default());
            ctx.print_list(&serde_json::json!({ "items": rows }), crate::tables::RECONCILER_PASSES)
        }
    }
}

/// `doctor`: one line per check (or `--json`); `DOCTOR_FINDINGS` (exit 1) when one failed, or
/// with `--strict` warned.
pub async fn doctor(ctx: &Context, args: DoctorArgs) -> Result<(), CliError> {
    let data_key = args.data_key.path(&args.db.data_dir);
    let paths = crate::doctor::Paths { data_dir: &args.db.data_dir, data_key: &data_key };
    let mut checks = crate::doctor::run(&args.db.database(), &paths).await;
    checks.extend(crate::doctor::witness_checks(&args.db.database(), &args.witnesses).await);
    if args.json || ctx.global.format == Some(Format::Json) {
        println!("{}", serde_json::to_string_pretty(&checks).unwrap_or_default());
    } else {
        print!("{}", crate::output::safe_text(&bc_agent::doctor::render(&checks)));
    }
    match crate::doctor::findings(&checks, args.strict) {
        0 => Ok(()),
        n => Err(CliError::new("DOCTOR_FINDINGS", format!("{n} of {} checks found a problem", checks.len()))
            .hint("each line's fix says what to do")),
    }
}

pub async fn migrate(ctx: &Context, args: MigrateArgs) -> Result<(), CliError> {
    ctx.print(&server::migrate(&args.db.database()).await?, Format::Json)
}

pub async fn pki(ctx: &Context, command: PkiCommand) -> Result<(), CliError> {
    let value = match command {
        PkiCommand::Show { db, deployment } => server::pki_show(&db.database(), &db.data_dir, &deployment.deployment).await?,
        PkiCommand::RotateSshCa { db, data_key, grace } => {
            server::rotate_ssh_ca(&db.database(), &db.data_dir, &data_key.path(&db.data_dir), grace).await?
        }
        PkiCommand::RenewCa { db, data_key, overlap } => {
            server::renew_node_ca(&db.database(), &db.data_dir, &data_key.path(&db.data_dir), overlap).await?
        }
        PkiCommand::RotateLogKey { db, deployment } => {
            crate::audit::rotate_log_key(&db.database(), &db.data_dir, &deployment.deployment).await?
        }
        PkiCommand::RotateDataKey { db, data_key } => {
            server::rotate_data_key(&db.database(), &data_key.path(&db.data_dir)).await?
        }
    };
    ctx.print(&value, Format::Json)
}

pub async fn projections(ctx: &Context, command: ProjectionsCommand) -> Result<(), CliError> {
    match command {
        ProjectionsCommand::Rebuild { db } => ctx.print(&server::projections_rebuild(&db.database()).await?, Format::Json),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::flags::{Cli, Command};

    #[test]
    fn the_write_stall_defaults_to_the_gateways_limit() {
        let cli = Cli::try_parse_from(["better-compute", "dev"]).unwrap();
        let Command::Dev(DevArgs { server, .. }) = cli.command else { panic!("not dev") };
        assert_eq!(server.write_stall, bc_gateway::conn::WRITE_STALL_S * 1000);
    }

    #[test]
    fn agents_url_is_https_or_http_host_and_port_without_a_path() {
        assert_eq!(parse_agents_url("https://cp.example:7443/").unwrap(), "https://cp.example:7443");
        assert_eq!(parse_agents_url("http://127.0.0.1:7443").unwrap(), "http://127.0.0.1:7443");
        assert_eq!(parse_agents_url("https://[::1]:7443").unwrap(), "https://[::1]:7443");
        for bad in [
            "cp.example:7443",
            "https://cp.example",
            "https://cp.example:7443/agents",
            "https://u@cp:1",
            "ftp://cp:1",
            "https://cp:1 x",
        ] {
            assert!(parse_agents_url(bad).is_err(), "{bad}");
        }
        let long = format!("https://{}:1", "a".repeat(bc_core::well_known::AGENTS_URL_BYTES_MAX));
        assert!(parse_agents_url(&long).is_err());
        let cli = Cli::try_parse_from(["better-compute", "dev", "--agents-url", "https://lb.example:443"]).unwrap();
        let Command::Dev(DevArgs { server, .. }) = cli.command else { panic!("not dev") };
        assert_eq!(server.agents.agents_url.as_deref(), Some("https://lb.example:443"));
    }

    #[test]
    fn the_agents_flags_default_to_the_gateways_session_config() {
        let cli = Cli::try_parse_from(["better-compute", "dev"]).unwrap();
        let Command::Dev(DevArgs { server, agents_insecure_h2c, .. }) = cli.command else { panic!("not dev") };
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
    fn the_ssh_ca_grace_defaults_to_a_day_and_stops_at_its_maximum() {
        use bc_projections::decide::ssh_cert::{SSH_CA_GRACE_MS_DEFAULT, SSH_CA_GRACE_MS_MAX};
        let cli = Cli::try_parse_from(["better-compute", "pki", "rotate-ssh-ca"]).unwrap();
        let Command::Pki { command: PkiCommand::RotateSshCa { grace, .. } } = cli.command else { panic!("not rotate-ssh-ca") };
        assert_eq!(grace, SSH_CA_GRACE_MS_DEFAULT);
        assert_eq!(parse_ssh_ca_grace_ms("0s"), Ok(0));
        assert_eq!(parse_ssh_ca_grace_ms("7d"), Ok(SSH_CA_GRACE_MS_MAX));
        assert!(parse_ssh_ca_grace_ms("8d").is_err());
        assert!(parse_ssh_ca_grace_ms("1500ms").is_err(), "whole seconds");
    }

    #[test]
    fn the_node_ca_overlap_defaults_to_two_days_within_its_bounds() {
        use bc_gateway::node_ca::{NODE_CA_OVERLAP_MS_DEFAULT, NODE_CA_OVERLAP_MS_MAX, NODE_CA_OVERLAP_MS_MIN};
        let cli = Cli::try_parse_from(["better-compute", "pki", "renew-ca"]).unwrap();
        let Command::Pki { command: PkiCommand::RenewCa { overlap, .. } } = cli.command else { panic!("not renew-ca") };
        assert_eq!(overlap, NODE_CA_OVERLAP_MS_DEFAULT);
        assert_eq!(parse_node_ca_overlap_ms("1h"), Ok(NODE_CA_OVERLAP_MS_MIN));
        assert_eq!(parse_node_ca_overlap_ms("60d"), Ok(NODE_CA_OVERLAP_MS_MAX));
        assert!(parse_node_ca_overlap_ms("59m").is_err());
        assert!(parse_node_ca_overlap_ms("61d").is_err());
    }

    #[test]
    fn the_connection_limits_default_to_the_gateways() {
        let cli = Cli::try_parse_from(["better-compute", "dev"]).unwrap();
        let Command::Dev(DevArgs { server, .. }) = cli.command else { panic!("not dev") };
        assert_eq!(server.header_timeout, bc_gateway::conn::HEADER_READ_TIMEOUT_S * 1000);
        assert_eq!(server.idle_timeout, bc_gateway::conn::IDLE_TIMEOUT_S * 1000);
        assert_eq!(server.body_timeout, bc_gateway::conn::BODY_READ_TIMEOUT_S * 1000);
        assert_eq!(server.connections_max, bc_gateway::conn::CONNECTIONS_MAX as u64);
        let watchers = (server.watchers_max, server.watchers_per_tenant_max, server.watchers_per_key_max);
        let defaults = bc_gateway::watch::WatcherLimits::default();
        assert_eq!(watchers, (defaults.total as u64, defaults.per_tenant as u64, defaults.per_key as u64));
        let tunnels = server.serve_limits().unwrap().tunnels;
        assert_eq!(tunnels, bc_gateway::tunnels::TunnelLimits::default());
    }
}
