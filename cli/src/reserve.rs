//! `reserve`, `release`, `extend`, `reservations list/get`, `capacity`, `quotas get/set`, and
//! the node operations `nodes cordon/uncordon/drain/label/taint`.

use std::time::{Duration, Instant};

use bc_core::id::{NodeId, PoolId, ReservationId};
use clap::{Args, Subcommand};
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};

/// Longest `--wait`: ten minutes.
pub const WAIT_S_MAX: u64 = 600;
/// Longest `--for` or `--by` the CLI sends (the pool's own maximum decides below it).
const DURATION_S_MAX: u64 = 10 * 366 * 24 * 3600;

/// `90s`, `30m`, `8h`, `1d`: whole seconds, more than zero.
pub fn parse_duration_s(text: &str) -> Result<u64, String> {
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let n: u64 = digits.parse().map_err(|_| format!("{text:?} is not a duration like 90s, 30m, 8h or 1d"))?;
    let s = match unit {
        "s" => n,
        "m" => n.saturating_mul(60),
        "h" => n.saturating_mul(3600),
        "d" => n.saturating_mul(86_400),
        _ => return Err(format!("{text:?} is not a duration like 90s, 30m, 8h or 1d")),
    };
    if s == 0 {
        return Err(format!("{text:?} is zero: a reservation lasts at least a second"));
    }
    if s > DURATION_S_MAX {
        return Err(format!("{text:?} is longer than ten years"));
    }
    Ok(s)
}

#[derive(Args)]
pub struct AskArgs {
    #[arg(long)]
    pub(crate) pool: String,
    /// GPUs, all on one node (1 to 64).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub(crate) gpus: u32,
    /// How long: `90s`, `30m`, `8h`, `1d` (at most the pool's maximum).
    #[arg(long = "for", value_parser = parse_duration_s)]
    pub(crate) duration: u64,
    /// All GPUs in one NVLink domain.
    #[arg(long)]
    pub(crate) nvlink: bool,
    /// `gpuProduct in (H100-SXM5-80GB), vramGiB >= 80, label.rack = r1`.
    #[arg(long)]
    pub(crate) selector: Option<String>,
    /// Adds `gpuModel = MODEL`.
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Adds `gpuProduct = PRODUCT`.
    #[arg(long)]
    pub(crate) product: Option<String>,
    /// A taint key this reservation tolerates (repeatable).
    #[arg(long = "tolerate")]
    pub(crate) tolerations: Vec<String>,
}

impl AskArgs {
    fn body(&self, body: &mut Map<String, Value>) -> Result<(), CliError> {
        body.insert("poolId".into(), json!(crate::check_id::<PoolId>("--pool", &self.pool)?));
        body.insert("gpus".into(), json!(self.gpus));
        body.insert("durationS".into(), json!(self.duration));
        body.insert("nvlink".into(), json!(self.nvlink));
        if let Some(s) = &self.selector {
            // Checked here too, so a typo is a usage error before anything is sent.
            bc_projections::placement::Selector::parse(s).map_err(CliError::from)?;
            body.insert("selector".into(), json!(s));
        }
        if let Some(m) = &self.model {
            body.insert("model".into(), json!(m));
        }
        if let Some(p) = &self.product {
            body.insert("product".into(), json!(p));
        }
        if !self.tolerations.is_empty() {
            body.insert("tolerations".into(), json!(self.tolerations));
        }
        Ok(())
    }
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
        page: crate::Page,
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

/// `reserve`: creates, then waits up to `--wait` seconds while the reservation is queued.
pub async fn reserve(
    c: &Client,
    mut body: Map<String, Value>,
    ask: &AskArgs,
    wait_s: u64,
    key: &Option<String>,
) -> Result<Value, CliError> {
    ask.body(&mut body)?;
    let key = crate::idempotency_key(key);
    let mut rsv = c.call("reservations.create", &Value::Object(body.clone()), Some(&key)).await?;
    let deadline = Instant::now() + Duration::from_secs(wait_s);
    let mut announced = false;
    while rsv["state"] == "queued" && Instant::now() < deadline {
        if !announced {
            eprintln!("queued at position {}; waiting up to {wait_s} s for GPUs…", rsv["queuePosition"]);
            announced = true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mut get = Map::new();
        if let Some(t) = body.get("tenantId") {
            get.insert("tenantId".into(), t.clone());
        }
        get.insert("reservationId".into(), rsv["reservationId"].clone());
        rsv = c.call("reservations.get", &Value::Object(get), None).await?;
    }
    Ok(rsv)
}

pub async fn simple(
    c: &Client,
    method: &str,
    mut body: Map<String, Value>,
    id: &str,
    extra: &[(&str, Value)],
) -> Result<Value, CliError> {
    body.insert("reservationId".into(), json!(crate::check_id::<ReservationId>("RESERVATION_ID", id)?));
    for (k, v) in extra {
        body.insert((*k).into(), v.clone());
    }
    c.call(method, &Value::Object(body), None).await
}

pub async fn reservations(
    c: &Client,
    mut body: Map<String, Value>,
    command: &ReservationsCommand,
) -> Result<(Value, bool), CliError> {
    match command {
        ReservationsCommand::List { state, pool, page } => {
            if let Some(state) = state {
                body.insert("state".into(), json!(state));
            }
            if let Some(pool) = pool {
                body.insert("poolId".into(), json!(crate::check_id::<PoolId>("--pool", pool)?));
            }
            crate::add_page(&mut body, page);
            Ok((c.call("reservations.list", &Value::Object(body), None).await?, true))
        }
        ReservationsCommand::Get { reservation_id } => {
            Ok((simple(c, "reservations.get", body, reservation_id, &[]).await?, false))
        }
    }
}

pub async fn capacity(
    c: &Client,
    mut body: Map<String, Value>,
    preview: Option<&AskArgs>,
    pool: Option<&str>,
) -> Result<(Value, bool), CliError> {
    match preview {
        Some(ask) => {
            ask.body(&mut body)?;
            Ok((c.call("capacity.preview", &Value::Object(body), None).await?, false))
        }
        None => {
            if let Some(pool) = pool {
                body.insert("poolId".into(), json!(crate::check_id::<PoolId>("--pool", pool)?));
            }
            let mut value = c.call("capacity.get", &Value::Object(body), None).await?;
            for item in value["items"].as_array_mut().into_iter().flatten() {
                let by: Vec<String> = item["byProduct"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| format!("{} {}/{}", p["product"].as_str().unwrap_or("?"), p["free"], p["gpus"]))
                    .collect();
                item["byProduct"] = json!(by.join(", "));
                item.as_object_mut().map(|m| m.remove("byModel"));
            }
            Ok((value, true))
        }
    }
}

pub async fn quotas(c: &Client, mut body: Map<String, Value>, command: &QuotasCommand) -> Result<Value, CliError> {
    match command {
        QuotasCommand::Get { pool } => {
            body.insert("poolId".into(), json!(crate::check_id::<PoolId>("--pool", pool)?));
            c.call("quotas.get", &Value::Object(body), None).await
        }
        QuotasCommand::Set { pool, gpus } => {
            body.insert("poolId".into(), json!(crate::check_id::<PoolId>("--pool", pool)?));
            body.insert("gpus".into(), json!(gpus));
            c.call("quotas.set", &Value::Object(body), None).await
        }
    }
}

/// `nodes cordon|uncordon|drain|label|taint NODE`. `drain --wait N` waits until the node holds no
/// reservation.
pub async fn node_op(
    c: &Client,
    mut body: Map<String, Value>,
    method: &str,
    node: &str,
    if_version: Option<u64>,
    items: &[String],
    wait_s: u64,
) -> Result<Value, CliError> {
    body.insert("nodeId".into(), json!(crate::check_id::<NodeId>("NODE_ID", node)?));
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
