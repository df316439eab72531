//! The operator commands that open the database themselves: `dev`, `serve`, `reconcile`,
//! `migrate`, `pki show|rotate-log-key`, `projections rebuild`. The work is in `crate::server`
//! and `crate::audit`; this module turns flags into its options.

use std::path::{Path, PathBuf};

use crate::client::CliError;
use crate::flags::{
    AgentsArgs, ConsumerArgs, DataDir, DataKeyArgs, DatabaseArgs, PkiCommand, ProjectionsCommand, ReconcilersCommand, Sealing,
    ServerArgs,
};
use crate::output::Format;
use crate::server::{self, AgentsOptions, ConsumerOptions, Database};

use super::Context;

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
        AgentsOptions::new(&self.agents_listen, tls_files, plaintext, dev, session, limits)
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
            ..bc_gateway::ServeLimits::default()
        })
    }
}

async fn run_server(
    db: Database,
    data_dir: &Path,
    args: &ServerArgs,
    dev: bool,
    allow_loopback: bool,
    agents_plaintext: bool,
) -> Result<(), CliError> {
    let options = args.consumers.options(allow_loopback)?;
    let agents = args.agents.options(agents_plaintext, dev, args.write_stall)?;
    let run = (!args.no_reconcilers).then_some(&options);
    let release_keys = read_release_keys(&args.release_keys)?;
    server::run_server(
        db,
        data_dir,
        &args.data_key.path(data_dir),
        &args.listen,
        dev,
        args.sealing.checkpoint_interval,
        &args.sealing.deployment.deployment,
        &args.witnesses,
        run,
        options.policy,
        options.bmc_networks.clone(),
        args.serve_limits()?,
        &agents,
        release_keys,
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

pub async fn dev(dir: DataDir, args: ServerArgs, agents_insecure_h2c: bool) -> Result<(), CliError> {
    let db = Database::Sqlite(dir.data_dir.join(server::SQLITE_FILE));
    // dev delivers webhooks to loopback receivers: that is where a developer's are.
    run_server(db, &dir.data_dir, &args, true, true, agents_insecure_h2c).await
}

pub async fn serve(database_url: String, data_dir: PathBuf, args: ServerArgs, allow_loopback: bool) -> Result<(), CliError> {
    run_server(Database::Postgres(database_url), &data_dir, &args, false, allow_loopback, false).await
}

pub async fn reconcile(
    only: Vec<String>,
    witnesses: Vec<String>,
    db: DatabaseArgs,
    consumers: ConsumerArgs,
    sealing: Sealing,
    data_key: DataKeyArgs,
    allow_loopback: bool,
) -> Result<(), CliError> {
    let key_path = data_key.path(&db.data_dir);
    let options = consumers.options(allow_loopback)?;
    server::reconcile(&db.database(), &db.data_dir, &key_path, &only, &options, &sealing, &witnesses).await
}

pub async fn reconcilers(ctx: &Context, command: ReconcilersCommand) -> Result<(), CliError> {
    match command {
        ReconcilersCommand::Status { db } => {
            let value = server::reconcilers_status(&db.database()).await?;
            ctx.print_list(&value, crate::tables::RECONCILER_PASSES)
        }
    }
}

pub async fn migrate(ctx: &Context, db: DatabaseArgs) -> Result<(), CliError> {
    ctx.print(&server::migrate(&db.database()).await?, Format::Json)
}

pub async fn pki(ctx: &Context, command: PkiCommand) -> Result<(), CliError> {
    let value = match command {
        PkiCommand::Show { dir, deployment } => server::pki_show(&dir.data_dir, &deployment.deployment)?,
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
