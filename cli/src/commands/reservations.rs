//! `reserve`, `release`, `extend`, `reservations list|get`, `capacity`, `quotas get|set`.

use std::time::{Duration, Instant};

use bc_core::id::{PoolId, ReservationId};
use clap::{Args, Subcommand};
use serde_json::{Map, Value, json};

use crate::client::{CliError, Client};
use crate::flags::{IdempotencyKey, IfVersion, Page, parse_duration_s};
use crate::output::Format;
use crate::tables;

use super::batch::{OneOrBatch, one_or_batch};
use super::{Context, add_page, check_id, idempotency_key, put_id};

#[derive(Args)]
pub struct ReserveArgs {
    #[command(flatten)]
    pub ask: AskArgs,
    /// Seconds to wait while queued (0 to 600).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=RESERVE_WAIT_S_MAX))]
    pub wait: u64,
    /// The project it is made in (`proj_…`, a live project of the tenant).
    #[arg(long)]
    pub project: Option<String>,
    #[command(flatten)]
    pub key: IdempotencyKey,
}

#[derive(Args)]
pub struct ReleaseArgs {
    /// The reservations, `rsv_…`: one, or several with --batch-reason.
    #[arg(required = true, value_name = "RESERVATION_ID")]
    pub reservation_ids: Vec<String>,
    #[command(flatten)]
    pub if_version: IfVersion,
    /// Make a batch of `reservations.release` leaves (commandBatches.create) with this reason,
    /// what the approvers read, rather than releasing now; `batch approve` signs it. The root
    /// tenant's release of another tenant's reservation (`--tenant`) takes this when the
    /// deployment runs the approvers' quorum (--approvers).
    #[arg(long, value_name = "TEXT")]
    pub batch_reason: Option<String>,
}

#[derive(Args)]
pub struct ExtendArgs {
    pub reservation_id: String,
    /// How much longer: `30m`, `4h`, `1d`.
    #[arg(long, value_parser = parse_duration_s)]
    pub by: u64,
    #[command(flatten)]
    pub if_version: IfVersion,
}

/// Longest `reserve --wait`: ten minutes.
pub const RESERVE_WAIT_S_MAX: u64 = 600;

/// What a reservation asks for: `reserve` sends it, `capacity --preview` tries it.
#[derive(Args)]
pub struct AskArgs {
    #[arg(long)]
    pub pool: String,
    /// GPUs, all on one node (1 to 64).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus: u32,
    /// How long: `90s`, `30m`, `8h`, `1d` (at most the pool's maximum).
    #[arg(long = "for", value_parser = parse_duration_s)]
    pub duration: u64,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

/// Where a reservation may go.
#[derive(Args, Clone)]
pub struct PlacementArgs {
    /// All GPUs in one NVLink domain.
    #[arg(long)]
    pub nvlink: bool,
    /// `gpuProduct in (H100-SXM5-80GB), vramGiB >= 80, label.rack = r1`.
    #[arg(long)]
    pub selector: Option<String>,
    /// Adds `gpuModel = MODEL`.
    #[arg(long)]
    pub model: Option<String>,
    /// Adds `gpuProduct = PRODUCT`.
    #[arg(long)]
    pub product: Option<String>,
    /// A taint key this reservation tolerates (repeatable).
    #[arg(long = "tolerate")]
    pub tolerations: Vec<String>,
}

#[derive(Args)]
pub struct CapacityArgs {
    #[arg(long)]
    pub preview: bool,
    #[arg(long)]
    pub pool: Option<String>,
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus: Option<u32>,
    #[arg(long = "for", value_parser = parse_duration_s)]
    pub duration: Option<u64>,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

#[derive(Subcommand)]
pub enum ReservationsCommand {
    /// Reserve GPUs (what `reserve` does), in a project with --project.
    Create(ReserveArgs),
    /// A tenant's reservations.
    List {
        /// queued, active, released, expired or cancelled.
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        pool: Option<String>,
        /// Only the reservations made in this project (`proj_…`).
        #[arg(long)]
        project: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    Get {
        reservation_id: String,
    },
}

#[derive(Subcommand)]
pub enum QuotasCommand {
    /// The tenant's quota in a pool, per resource, and how much of each is in use.
    Get {
        #[arg(long)]
        pool: String,
    },
    /// Set the tenant's quota in a pool: GPUs (queued and active reservations count) and, each
    /// optional, live instances, vCPUs, memory and sandboxes. A set replaces the whole quota: a
    /// limit left out is unbounded.
    Set {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        gpus: u32,
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=i64::from(bc_projections::decide::quota::QUOTA_COUNT_MAX)))]
        instances: Option<u32>,
        /// vCPUs of live instances and claimed or cold sandboxes.
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=i64::from(bc_projections::decide::quota::QUOTA_VCPUS_MAX)))]
        vcpus: Option<u32>,
        /// Memory in MiB of the same.
        #[arg(long = "memory-mib", value_parser = clap::value_parser!(u64).range(0..=bc_projections::decide::quota::QUOTA_MEMORY_MIB_MAX))]
        memory_mib: Option<u64>,
        /// Live claimed or cold sandboxes.
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=i64::from(bc_projections::decide::quota::QUOTA_COUNT_MAX)))]
        sandboxes: Option<u32>,
    },
}

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
    put_id::<PoolId>(body, "poolId", "--pool", pool)?;
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
pub async fn reserve(ctx: &Context, args: ReserveArgs) -> Result<(), CliError> {
    let ReserveArgs { ask, wait: wait_s, project, key } = args;
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    ask_body(&mut body, &ask.pool, ask.gpus, ask.duration, &ask.placement)?;
    if let Some(project) = project {
        put_id::<bc_core::id::ProjectId>(&mut body, "projectId", "--project", &project)?;
    }
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
    put_id::<ReservationId>(&mut body, "reservationId", "RESERVATION_ID", id)?;
    for (k, v) in extra {
        body.insert((*k).into(), v.clone());
    }
    c.call(method, &Value::Object(body), None).await
}

pub async fn release(ctx: &Context, args: ReleaseArgs) -> Result<(), CliError> {
    let ReleaseArgs { reservation_ids, if_version, batch_reason } = args;
    let mut ids: Vec<String> = Vec::new();
    for id in &reservation_ids {
        let id = check_id::<ReservationId>("RESERVATION_ID", id)?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    let kind = bc_projections::decide::batch::LEAF_RESERVATION_RELEASE;
    let what = ("release", "reservations are released");
    let reservation_id = match one_or_batch(ctx, ids, batch_reason, if_version.if_version, kind, what).await? {
        OneOrBatch::One(id) => id,
        OneOrBatch::Batch(batch) => return ctx.print(&batch, Format::Json),
    };
    let extra: Vec<(&str, Value)> = if_version.if_version.iter().map(|v| ("ifVersion", json!(v))).collect();
    let v = on_reservation(&ctx.client()?, "reservations.release", ctx.tenant_body()?, &reservation_id, &extra).await?;
    ctx.print(&v, Format::Json)
}

pub async fn extend(ctx: &Context, args: ExtendArgs) -> Result<(), CliError> {
    let ExtendArgs { reservation_id, by: by_s, if_version } = args;
    let mut extra = vec![("byS", json!(by_s))];
    extra.extend(if_version.if_version.iter().map(|v| ("ifVersion", json!(v))));
    let v = on_reservation(&ctx.client()?, "reservations.extend", ctx.tenant_body()?, &reservation_id, &extra).await?;
    ctx.print(&v, Format::Json)
}

pub async fn run(ctx: &Context, command: ReservationsCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    match command {
        ReservationsCommand::List { state, pool, project, page } => {
            if let Some(state) = state {
                body.insert("state".into(), json!(state));
            }
            if let Some(pool) = pool {
                put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            }
            if let Some(p) = project {
                put_id::<bc_core::id::ProjectId>(&mut body, "projectId", "--project", &p)?;
            }
            add_page(&mut body, &page);
            ctx.print_list(&c.call("reservations.list", &Value::Object(body), None).await?, tables::RESERVATIONS)
        }
        ReservationsCommand::Get { reservation_id } => {
            ctx.print(&on_reservation(&c, "reservations.get", body, &reservation_id, &[]).await?, Format::Json)
        }
        ReservationsCommand::Create(args) => reserve(ctx, args).await,
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
        put_id::<PoolId>(&mut body, "poolId", "--pool", pool)?;
    }
    ctx.print_list(&c.call("capacity.get", &Value::Object(body), None).await?, tables::CAPACITY)
}

pub async fn quotas(ctx: &Context, command: QuotasCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    let (method, pool) = match &command {
        QuotasCommand::Get { pool } => ("quotas.get", pool),
        QuotasCommand::Set { pool, gpus, instances, vcpus, memory_mib, sandboxes } => {
            body.insert("gpus".into(), json!(gpus));
            let limits = [
                ("instances", instances.map(u64::from)),
                ("vcpus", vcpus.map(u64::from)),
                ("memoryMiB", *memory_mib),
                ("sandboxes", sandboxes.map(u64::from)),
            ];
            for (field, value) in limits {
                if let Some(v) = value {
                    body.insert(field.into(), json!(v));
                }
            }
            ("quotas.set", pool)
        }
    };
    put_id::<PoolId>(&mut body, "poolId", "--pool", pool)?;
    ctx.print(&c.call(method, &Value::Object(body), None).await?, Format::Json)
}
