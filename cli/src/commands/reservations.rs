//! `reserve`, `release`, `extend`, `reservations list|get`, `capacity`, `quotas get|set`.

use std::time::{Duration, Instant};

use bc_core::id::{PoolId, ReservationId};
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{AskArgs, CapacityArgs, IdempotencyKey, IfVersion, PlacementArgs, QuotasCommand, ReservationsCommand};
use crate::output::Format;
use crate::tables;

use super::{Context, add_page, check_id, idempotency_key};

/// How often `reserve` looks again while its reservation is queued.
const QUEUED_POLL_MS: u64 = 250;

/// The body fields of what a reservation asks for.
fn ask_body(
    body: &mut Map<String, Value>,
    pool: &str,
    gpus: u32,
    duration_s: u64,
    placement: &PlacementArgs,
) -> Result<(), CliError> {
    body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", pool)?));
    body.insert("gpus".into(), json!(gpus));
    body.insert("durationS".into(), json!(duration_s));
    body.insert("nvlink".into(), json!(placement.nvlink));
    if let Some(s) = &placement.selector {
        // Checked here too, so a typo is a usage error before anything is sent.
        bc_projections::placement::Selector::parse(s).map_err(CliError::from)?;
        body.insert("selector".into(), json!(s));
    }
    if let Some(m) = &placement.model {
        body.insert("model".into(), json!(m));
    }
    if let Some(p) = &placement.product {
        body.insert("product".into(), json!(p));
    }
    if !placement.tolerations.is_empty() {
        body.insert("tolerations".into(), json!(placement.tolerations));
    }
    Ok(())
}

/// `reserve`: creates, then waits up to `--wait` seconds while the reservation is queued.
pub async fn reserve(ctx: &Context, ask: AskArgs, wait_s: u64, key: IdempotencyKey) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    ask_body(&mut body, &ask.pool, ask.gpus, ask.duration, &ask.placement)?;
    let key = idempotency_key(&key.key);
    let mut rsv = c.call("reservations.create", &Value::Object(body.clone()), Some(&key)).await?;
    let deadline = Instant::now() + Duration::from_secs(wait_s);
    let mut announced = false;
    while rsv["state"] == "queued" && Instant::now() < deadline {
        if !announced {
            eprintln!("queued at position {}; waiting up to {wait_s} s for GPUs…", rsv["queuePosition"]);
            announced = true;
        }
        tokio::time::sleep(Duration::from_millis(QUEUED_POLL_MS)).await;
        let mut get = Map::new();
        if let Some(t) = body.get("tenantId") {
            get.insert("tenantId".into(), t.clone());
        }
        get.insert("reservationId".into(), rsv["reservationId"].clone());
        rsv = c.call("reservations.get", &Value::Object(get), None).await?;
    }
    ctx.print(&rsv, Format::Json)
}

/// One call on one reservation.
async fn on_reservation(
    c: &Client,
    method: &str,
    mut body: Map<String, Value>,
    id: &str,
    extra: &[(&str, Value)],
) -> Result<Value, CliError> {
    body.insert("reservationId".into(), json!(check_id::<ReservationId>("RESERVATION_ID", id)?));
    for (k, v) in extra {
        body.insert((*k).into(), v.clone());
    }
    c.call(method, &Value::Object(body), None).await
}

pub async fn release(ctx: &Context, reservation_id: String, if_version: IfVersion) -> Result<(), CliError> {
    let extra: Vec<(&str, Value)> = if_version.if_version.iter().map(|v| ("ifVersion", json!(v))).collect();
    let v = on_reservation(&ctx.client()?, "reservations.release", ctx.tenant_body()?, &reservation_id, &extra).await?;
    ctx.print(&v, Format::Json)
}

pub async fn extend(ctx: &Context, reservation_id: String, by_s: u64, if_version: IfVersion) -> Result<(), CliError> {
    let mut extra = vec![("byS", json!(by_s))];
    extra.extend(if_version.if_version.iter().map(|v| ("ifVersion", json!(v))));
    let v = on_reservation(&ctx.client()?, "reservations.extend", ctx.tenant_body()?, &reservation_id, &extra).await?;
    ctx.print(&v, Format::Json)
}

pub async fn run(ctx: &Context, command: ReservationsCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    match command {
        ReservationsCommand::List { state, pool, page } => {
            if let Some(state) = state {
                body.insert("state".into(), json!(state));
            }
            if let Some(pool) = pool {
                body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", &pool)?));
            }
            add_page(&mut body, &page);
            ctx.print_list(&c.call("reservations.list", &Value::Object(body), None).await?, tables::RESERVATIONS)
        }
        ReservationsCommand::Get { reservation_id } => {
            ctx.print(&on_reservation(&c, "reservations.get", body, &reservation_id, &[]).await?, Format::Json)
        }
    }
}

/// `capacity`: free GPUs per pool (a list); `capacity --preview`: would this ask fit now.
pub async fn capacity(ctx: &Context, args: CapacityArgs) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    if args.preview {
        let (Some(pool), Some(gpus), Some(duration)) = (&args.pool, args.gpus, args.duration) else {
            return Err(CliError::usage("--preview needs --pool, --gpus and --for"));
        };
        ask_body(&mut body, pool, gpus, duration, &args.placement)?;
        return ctx.print(&c.call("capacity.preview", &Value::Object(body), None).await?, Format::Json);
    }
    if args.gpus.is_some() || args.duration.is_some() || args.placement.selector.is_some() || args.placement.nvlink {
        return Err(CliError::usage("--gpus, --for, --selector and --nvlink go with --preview"));
    }
    if let Some(pool) = &args.pool {
        body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", pool)?));
    }
    ctx.print_list(&c.call("capacity.get", &Value::Object(body), None).await?, tables::CAPACITY)
}

pub async fn quotas(ctx: &Context, command: QuotasCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    let (method, pool) = match &command {
        QuotasCommand::Get { pool } => ("quotas.get", pool),
        QuotasCommand::Set { pool, gpus } => {
            body.insert("gpus".into(), json!(gpus));
            ("quotas.set", pool)
        }
    };
    body.insert("poolId".into(), json!(check_id::<PoolId>("--pool", pool)?));
    ctx.print(&c.call(method, &Value::Object(body), None).await?, Format::Json)
}
