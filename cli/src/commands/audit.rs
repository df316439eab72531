//! `audit checkpoint|verify|prove|follow|check-proof`: the work is in `crate::audit` and
//! `crate::follow`.

use std::path::PathBuf;

use clap::Subcommand;

use crate::client::CliError;
use crate::flags::{DatabaseArgs, Deployment, parse_duration_ms};
use crate::output::Format;

use super::{Context, check_id};

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

pub async fn run(ctx: &Context, command: AuditCommand) -> Result<(), CliError> {
    let tenant = ctx.tenant_id()?;
    let value = match command {
        AuditCommand::Checkpoint { db, deployment } => {
            crate::audit::checkpoint(&db.database(), &db.data_dir, tenant, &deployment.deployment).await?
        }
        AuditCommand::Verify { db, pins, deployment } => {
            match crate::audit::verify(&db.database(), &db.data_dir, tenant, &pins, &deployment.deployment).await {
                Ok(v) => v,
                Err(mut e) => {
                    // The problems go to stdout even though the command fails.
                    if let Some(details) = e.details.take() {
                        ctx.print(&details, Format::Json)?;
                    }
                    return Err(e);
                }
            }
        }
        AuditCommand::Prove { event_id, out, checkpoint, db, deployment } => {
            let event = check_id::<bc_core::id::EventId>("EVENT_ID", &event_id)?.parse().expect("checked");
            let database = db.database();
            crate::audit::prove(&database, &db.data_dir, tenant, event, &out, checkpoint.as_deref(), &deployment.deployment)
                .await?
        }
        AuditCommand::Follow { url, pins, vkeys, state, once, interval } => {
            crate::follow::run(&url, tenant, &pins, &vkeys, &state, once, interval).await?
        }
        AuditCommand::CheckProof { file, pins, vkeys, saved, witnesses, witnesses_min } => {
            crate::audit::check_proof(&file, &pins, &vkeys, saved.as_deref(), &witnesses, witnesses_min)?
        }
    };
    ctx.print(&value, Format::Json)
}
