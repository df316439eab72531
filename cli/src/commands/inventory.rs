//! `inventory get|history|diff --node NODE`: the `inventory.*` methods, what a joined node's
//! agent reported its machine holds. `get` and `diff` print JSON, `history` a table (one row
//! per report, by `seq`), as `nodes get` and `nodes list` do.

use bc_core::id::NodeId;
use clap::Subcommand;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::Page;
use crate::output::Format;
use crate::tables;

use super::{Context, add_page, check_id};

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

pub async fn run(ctx: &Context, command: InventoryCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let node = |text: &str| check_id::<NodeId>("--node", text);
    let c = ctx.client()?;
    let value = match command {
        InventoryCommand::Get { node: n } => {
            body.insert("nodeId".into(), json!(node(&n)?));
            c.call("inventory.get", &Value::Object(body), None).await?
        }
        InventoryCommand::History { node: n, page } => {
            body.insert("nodeId".into(), json!(node(&n)?));
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("inventory.history", &Value::Object(body), None).await?, tables::INVENTORY);
        }
        InventoryCommand::Diff { node: n, from, to } => {
            body.insert("nodeId".into(), json!(node(&n)?));
            if let Some(seq) = from {
                body.insert("from".into(), json!(seq));
            }
            if let Some(seq) = to {
                body.insert("to".into(), json!(seq));
            }
            c.call("inventory.diff", &Value::Object(body), None).await?
        }
    };
    ctx.print(&value, Format::Json)
}
