//! `exec --instance`: a shell in a running instance through its node's agent, op `exec`
//! (`schema/TUNNELS.md`), decided as `compute:instances:exec`. bcd refuses it until guests
//! have an agent: the server answers `UNSUPPORTED` (`details.reason: guest-agent`) before any
//! ticket, and that refusal is the command's error (exit 1), with the way that works instead
//! (`console --instance`, the serial console). A granted one runs as `console` does
//! ([`super::console::terminal`]).

use bc_core::id::InstanceId;
use clap::Args;
use serde_json::json;

use super::{Context, check_id};
use crate::client::CliError;

#[derive(Args, Debug)]
pub struct ExecArgs {
    /// The running instance.
    #[arg(long, value_name = "INSTANCE_ID")]
    pub instance: String,
}

pub async fn run(ctx: &Context, args: ExecArgs) -> Result<(), CliError> {
    let instance = check_id::<InstanceId>("--instance", &args.instance)?;
    let mut body = ctx.tenant_body()?;
    body.insert("op".into(), json!("exec"));
    body.insert("instanceId".into(), json!(instance));
    super::console::terminal(ctx, body).await.map_err(|e| match e.code.as_str() {
        "UNSUPPORTED" if e.hint.is_none() => {
            e.hint(format!("`better-compute console --instance {instance}` reaches the instance's serial console"))
        }
        _ => e,
    })
}
