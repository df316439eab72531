//! `nodes list|get|register|cordon|uncordon|drain|label|taint|delete`. `drain --wait N` waits
//! until the node holds no reservation; `delete` asks for `--yes` before any call.

use std::time::{Duration, Instant};

use bc_core::id::{NodeId, PoolId};
use clap::Subcommand;
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::batch::{OneOrBatch, one_or_batch};
use super::{Context, check_id, idempotency_key, labels, put_id};

/// Longest `nodes drain --wait`: a day.
pub const DRAIN_WAIT_S_MAX: u64 = 86_400;

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
    /// --yes, before any call. With --batch-reason, the nodes (one or several) are deleted
    /// through a destructive batch instead, once the approvers' quorum signs it: what a
    /// deployment with the quorum on (--approvers) asks for.
    Delete {
        #[arg(required = true, value_name = "NODE_ID")]
        node_ids: Vec<String>,
        /// Why, kept in the log (at most 500 characters); a batch's deletion names the batch.
        #[arg(long, conflicts_with = "batch_reason")]
        reason: Option<String>,
        /// Confirm: the node's document goes (its events stay in the log).
        #[arg(long)]
        yes: bool,
        /// Make a batch of `nodes.delete` leaves (commandBatches.create) with this reason,
        /// what the approvers read, rather than deleting now; `batch approve` signs it.
        #[arg(long, value_name = "TEXT")]
        batch_reason: Option<String>,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Revoke a node (`node.revoked`): the agents' endpoint refuses its certificate and ends its
    /// sessions at once, and `bcd node` there exits 1; it never starts another session (join the
    /// machine again as a new node). Refused without --yes, before any call.
    Revoke {
        node_id: String,
        /// Why, kept in the log (at most 500 characters).
        #[arg(long)]
        reason: Option<String>,
        /// Confirm: a revoked node cannot be restored.
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

pub async fn run(ctx: &Context, command: NodesCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let body = ctx.tenant_body()?;
    let value = match command {
        NodesCommand::List { page, pool } => {
            let mut body = ctx.page_body(&page)?;
            if let Some(pool) = pool {
                put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            }
            return ctx.print_list(&c.call("nodes.list", &Value::Object(body), None).await?, tables::NODES);
        }
        NodesCommand::Get { node_id } => node_op(&c, body, "nodes.get", &node_id, None, &[], 0).await?,
        NodesCommand::Cordon { node_id, if_version } => {
            node_op(&c, body, "nodes.cordon", &node_id, if_version.if_version, &[], 0).await?
        }
        NodesCommand::Uncordon { node_id, if_version } => {
            node_op(&c, body, "nodes.uncordon", &node_id, if_version.if_version, &[], 0).await?
        }
        NodesCommand::Drain { node_id, if_version, wait } => {
            node_op(&c, body, "nodes.drain", &node_id, if_version.if_version, &[], wait).await?
        }
        NodesCommand::Label { node_id, items, if_version } => {
            node_op(&c, body, "nodes.label", &node_id, if_version.if_version, &items, 0).await?
        }
        NodesCommand::Taint { node_id, items, if_version } => {
            node_op(&c, body, "nodes.taint", &node_id, if_version.if_version, &items, 0).await?
        }
        NodesCommand::Delete { node_ids, reason, yes, batch_reason, if_version } => {
            let mut nodes: Vec<String> = Vec::new();
            for id in &node_ids {
                let node = check_id::<NodeId>("NODE_ID", id)?;
                if !nodes.contains(&node) {
                    nodes.push(node);
                }
            }
            if !yes {
                return Err(CliError::usage(format!(
                    "nodes delete removes {} for good (its events stay in the log); add --yes to confirm",
                    nodes.join(", ")
                )));
            }
            let kind = bc_projections::decide::batch::LEAF_NODE_DELETE;
            let what = ("delete", "nodes are deleted");
            let node = match one_or_batch(ctx, nodes, batch_reason, if_version.if_version, kind, what).await? {
                OneOrBatch::One(node) => node,
                OneOrBatch::Batch(batch) => return ctx.print(&batch, Format::Json),
            };
            let mut body = body;
            body.insert("nodeId".into(), json!(node));
            if let Some(v) = if_version.if_version {
                body.insert("ifVersion".into(), json!(v));
            }
            if let Some(reason) = reason {
                body.insert("reason".into(), json!(reason));
            }
            c.call("nodes.delete", &Value::Object(body), None).await?
        }
        NodesCommand::Revoke { node_id, reason, yes, if_version } => {
            let node = check_id::<NodeId>("NODE_ID", &node_id)?;
            if !yes {
                return Err(CliError::usage(format!("nodes revoke ends {node}'s admission for good; add --yes to confirm")));
            }
            let mut body = body;
            body.insert("nodeId".into(), json!(node));
            if let Some(v) = if_version.if_version {
                body.insert("ifVersion".into(), json!(v));
            }
            if let Some(reason) = reason {
                body.insert("reason".into(), json!(reason));
            }
            c.call("nodes.revoke", &Value::Object(body), None).await?
        }
        NodesCommand::Register { pool, name, gpus, labels: items, key } => {
            let mut body = body;
            put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            body.insert("name".into(), json!(name));
            let gpus = gpus.iter().map(|spec| gpu(spec)).collect::<Result<Vec<_>, _>>()?;
            body.insert("gpus".into(), Value::Array(gpus));
            body.insert("labels".into(), labels(&items)?);
            let key = idempotency_key(&key.key);
            c.call("nodes.register", &Value::Object(body), Some(&key)).await?
        }
    };
    ctx.print(&value, Format::Json)
}

/// `--gpu MODEL:PRODUCT:VRAM_GIB:NVLINK_DOMAIN`.
fn gpu(spec: &str) -> Result<Value, CliError> {
    let parts: Vec<&str> = spec.split(':').collect();
    let [model, product, vram, domain] = parts[..] else {
        return Err(CliError::usage(format!("--gpu {spec:?} is not MODEL:PRODUCT:VRAM_GIB:NVLINK_DOMAIN")));
    };
    let vram: u32 = vram.parse().map_err(|_| CliError::usage(format!("--gpu {spec:?}: VRAM_GIB is not a number")))?;
    let domain: u32 = domain.parse().map_err(|_| CliError::usage(format!("--gpu {spec:?}: NVLINK_DOMAIN is not a number")))?;
    Ok(json!({ "model": model, "product": product, "vramGiB": vram, "nvlinkDomain": domain }))
}

/// One call on one node; `label` and `taint` send `set`/`remove` from `KEY=VALUE`/`KEY-` items.
async fn node_op(
    c: &Client,
    mut body: Map<String, Value>,
    method: &str,
    node: &str,
    if_version: Option<u64>,
    items: &[String],
    wait_s: u64,
) -> Result<Value, CliError> {
    put_id::<NodeId>(&mut body, "nodeId", "NODE_ID", node)?;
    if let Some(v) = if_version {
        body.insert("ifVersion".into(), json!(v));
    }
    if matches!(method, "nodes.label" | "nodes.taint") {
        let (mut set, mut remove) = (Map::new(), Vec::new());
        for item in items {
            match (item.split_once('='), item.strip_suffix('-')) {
                (Some((k, v)), _) => {
                    set.insert(k.to_owned(), json!(v));
                }
                (None, Some(k)) => remove.push(json!(k)),
                _ => return Err(CliError::usage(format!("{item:?} is neither KEY=VALUE (set) nor KEY- (remove)"))),
            }
        }
        if items.is_empty() {
            return Err(CliError::usage("give KEY=VALUE to set or KEY- to remove"));
        }
        body.insert("set".into(), Value::Object(set));
        body.insert("remove".into(), Value::Array(remove));
    }
    let mut node_doc = c.call(method, &Value::Object(body.clone()), None).await?;
    if method == "nodes.drain" {
        let deadline = Instant::now() + Duration::from_secs(wait_s);
        while node_doc["drained"] != true && Instant::now() < deadline {
            eprintln!("draining: {} GPUs still reserved", node_doc["allocations"].as_object().map(|m| m.len()).unwrap_or(0));
            tokio::time::sleep(Duration::from_secs(1)).await;
            let mut get = Map::new();
            if let Some(t) = body.get("tenantId") {
                get.insert("tenantId".into(), t.clone());
            }
            get.insert("nodeId".into(), body["nodeId"].clone());
            node_doc = c.call("nodes.get", &Value::Object(get), None).await?;
            let held = node_doc["allocations"].as_object().map(|m| m.len()).unwrap_or(0);
            node_doc["drained"] = json!(node_doc["state"] == "draining" && held == 0);
        }
    }
    Ok(node_doc)
}
