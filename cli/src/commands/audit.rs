//! `audit checkpoint|verify|prove|follow|check-proof`: the work is in `crate::audit` and
//! `crate::follow`.

use crate::client::CliError;
use crate::flags::AuditCommand;
use crate::output::Format;

use super::{Context, check_id};

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
