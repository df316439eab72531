//! `inventory get|history|diff --node NODE`: the `inventory.*` methods, what a joined node's
//! agent reported its machine holds. `get` and `diff` print JSON, `history` a table (one row
//! per report, by `seq`), as `nodes get` and `nodes list` do.

use bc_core::id::NodeId;
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::InventoryCommand;
use crate::output::Format;
use crate::tables;

use super::{Context, add_page, check_id};

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
