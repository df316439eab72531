//! `usage`: a tenant's usage windows (`usage list`, in GPU-, vCPU-, GiB- and sandbox-hours), the
//! billing export (`usage export`: FOCUS 1.0 CSV, or CloudEvents 1.0 JSON lines as OpenMeter
//! ingests them), and the prices per SKU (`usage prices set|list`).
//!
//! The export reads `usage.list` page by page and writes each page as it comes, so memory stays
//! bounded whatever the range holds; it writes a temporary file beside `--out` and links it into
//! place only when complete, never over an existing file (`ALREADY_EXISTS`). With
//! `--with-proofs` it also writes the inclusion proofs of the events its rows name, and `usage
//! verify` checks the rows offline against them (`proof`).

mod proof;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Subcommand, ValueEnum};
use serde_json::{Map, Value, json};

use super::Context;
use crate::client::CliError;
use crate::flags::Page;
use crate::output::Column;

/// Rows one `usage.list` page asks for while exporting (the API's most).
const EXPORT_PAGE_ROWS: u32 = 500;
/// The write buffer of an export.
const EXPORT_BUFFER_BYTES: usize = 256 * 1024;
/// How often an export off a terminal says how far it is.
const PROGRESS_INTERVAL_MS: u128 = 1000;
/// GPU-milliseconds in a GPU-hour.
const MS_PER_HOUR: f64 = 3_600_000.0;
/// Who issues the charges, in the FOCUS columns that name a provider.
const PROVIDER: &str = "Better Compute";
/// The first words of a usage row's CloudEvents `type`, which ends in its resource kind:
/// `com.better-compute.usage.gpu`, `.vcpu`, `.memory`, `.sandbox`.
const CLOUDEVENT_TYPE_PREFIX: &str = "com.better-compute.usage.";

/// How a row of each resource kind is shown: in a table, and in FOCUS's units.
struct KindUnits {
    /// The table's unit of its hours (`GPU-hours`) and of what it counts (`GPUs`).
    hours: &'static str,
    /// FOCUS `ConsumedUnit` (seconds) and `PricingUnit` (hours).
    consumed: &'static str,
    pricing: &'static str,
    /// Unit-milliseconds in one unit of the quantity (1,024 for memory: MiB-ms in a GiB-ms).
    per_unit: i64,
    /// FOCUS `ResourceType` and `ServiceName`.
    resource_type: &'static str,
    service: &'static str,
}

fn kind_units(row: &Value) -> KindUnits {
    let sandbox = row.get("sandboxId").is_some_and(Value::is_string);
    let (resource_type, service) = if sandbox {
        ("Sandbox", "Sandboxes")
    } else if text(row, "resourceKind") == "gpu" {
        ("GPU reservation", "GPU reservations")
    } else {
        ("Virtual machine instance", "Instances")
    };
    let (hours, consumed, pricing, per_unit) = match text(row, "resourceKind") {
        "vcpu" => ("vCPU-hours", "vCPU-Seconds", "vCPU-Hours", 1),
        "memory" => ("GiB-hours", "GiB-Seconds", "GiB-Hours", 1024),
        "sandbox" => ("sandbox-hours", "Sandbox-Seconds", "Sandbox-Hours", 1),
        _ => ("GPU-hours", "GPU-Seconds", "GPU-Hours", 1),
    };
    KindUnits { hours, consumed, pricing, per_unit, resource_type, service }
}

/// What a row counts: its instance, its sandbox, or its reservation.
fn subject(row: &Value) -> &str {
    ["instanceId", "sandboxId", "reservationId"].iter().map(|k| text(row, k)).find(|s| !s.is_empty()).unwrap_or("")
}

/// What a row counts of its kind, in words: `2 GPUs`, `4 vCPUs`, `1.5 GiB`, `1 sandbox`.
fn units_cell(row: &Value) -> String {
    let units = num(row, "units");
    match text(row, "resourceKind") {
        "vcpu" => format!("{units} vCPUs"),
        "memory" => format!("{} GiB", units as f64 / 1024.0),
        "sandbox" => format!("{units} sandbox"),
        _ => format!("{} GPUs", num(row, "gpus")),
    }
}

#[derive(Subcommand)]
pub enum UsageCommand {
    /// Usage rows of closed windows (and their corrections), in GPU-, vCPU-, GiB- and
    /// sandbox-hours; or sums by group.
    List {
        #[command(flatten)]
        range: Range,
        /// Sum the range by these keys (window, pool, sku, reservation, instance, sandbox),
        /// comma-separated; always by resource kind too.
        #[arg(long, value_delimiter = ',')]
        group_by: Vec<GroupBy>,
        #[command(flatten)]
        page: Page,
    },
    /// Write the range's usage rows to a new file, page by page.
    Export {
        #[command(flatten)]
        range: Range,
        /// `csv`: FOCUS 1.0 columns and x_ columns; `jsonl`: one CloudEvents 1.0 record a line.
        #[arg(long, value_enum)]
        export_format: ExportFormat,
        /// A new file: an existing one is never written over.
        #[arg(long)]
        out: PathBuf,
        /// The currency of the cost columns of rows without a price (their cost is 0).
        #[arg(long, default_value = "USD")]
        currency: String,
        /// Also write the inclusion proofs of the events each row names, against the tenant's
        /// newest signed checkpoint (to --proofs), so `usage verify` checks the rows offline.
        #[arg(long)]
        with_proofs: bool,
        /// Where --with-proofs writes them: a new file (default: OUT.proofs).
        #[arg(long, requires = "with_proofs")]
        proofs: Option<PathBuf>,
    },
    /// Check an export's rows offline against its proofs and the log key's pin: each row's events
    /// are in a checkpoint the key signed, and recounting the row from them gives its quantity.
    /// No network, no token. Exits INVALID_PROOF naming each row that fails and why, or
    /// USAGE_UNPROVED when rows had no checkpoint covering them at export time.
    Verify {
        /// The export (`usage export`, csv or jsonl).
        #[arg(long)]
        export: PathBuf,
        /// Its proofs (`usage export --with-proofs`).
        #[arg(long)]
        proofs: PathBuf,
        /// The log key's pin, `sha256/…` (`better-compute pki show`).
        #[arg(long = "pin", env = "BETTER_COMPUTE_AUDIT_PIN")]
        pins: Vec<String>,
        /// A note verifier key, `NAME+KEYID+KEY`.
        #[arg(long = "vkey")]
        vkeys: Vec<String>,
    },
    /// Prices per unit-hour (GPU-, vCPU-, GiB-, sandbox-hour), per SKU (a GPU product, vCPU,
    /// Memory-GiB, Sandbox) and period.
    Prices {
        #[command(subcommand)]
        command: PricesCommand,
    },
}

#[derive(Subcommand)]
pub enum PricesCommand {
    /// Set a SKU's price per unit-hour (a GPU-hour; a vCPU-, GiB- or sandbox-hour) from a time on
    /// (root tenant's administrators). Windows already closed keep the price they were closed
    /// with.
    Set {
        #[arg(long)]
        sku: String,
        /// ISO 4217 (USD, EUR).
        #[arg(long)]
        currency: String,
        /// A decimal with at most 6 places (2.5).
        #[arg(long)]
        gpu_hour_price: String,
        /// From when: RFC 3339, epoch ms, `now` or `-DURATION`; now when absent.
        #[arg(long)]
        from: Option<String>,
    },
    /// Every SKU's price periods.
    List {
        #[arg(long)]
        sku: Option<String>,
    },
}

/// A range of windows by their start.
#[derive(clap::Args)]
pub struct Range {
    /// Windows that start at or after this: RFC 3339, epoch ms, `now` or `-DURATION` (`-7d`).
    #[arg(long, default_value = "-24h")]
    pub from: String,
    /// ... and before this.
    #[arg(long, default_value = "now")]
    pub to: String,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum GroupBy {
    Window,
    Pool,
    Sku,
    Reservation,
    Instance,
    Sandbox,
    Project,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    Csv,
    Jsonl,
}

pub async fn run(ctx: &Context, command: UsageCommand) -> Result<(), CliError> {
    match command {
        UsageCommand::List { range, group_by, page } => list(ctx, &range, &group_by, &page).await,
        UsageCommand::Export { range, export_format, out, currency, with_proofs, proofs } => {
            let proofs = with_proofs.then(|| proofs.unwrap_or_else(|| proofs_path_of(&out)));
            let summary = export(ctx, &range, export_format, &out, &currency, proofs.as_deref()).await?;
            ctx.print(&summary, crate::output::Format::Json)
        }
        UsageCommand::Verify { export, proofs, pins, vkeys } => match proof::verify(&export, &proofs, &pins, &vkeys) {
            Ok(summary) => ctx.print(&summary, crate::output::Format::Json),
            Err(mut e) => {
                // The rows that failed go to stdout even though the command fails.
                if let Some(details) = e.details.take() {
                    ctx.print(&details, crate::output::Format::Json)?;
                }
                Err(e)
            }
        },
        UsageCommand::Prices { command: PricesCommand::Set { sku, currency, gpu_hour_price, from } } => {
            let mut body = Map::new();
            body.insert("sku".into(), json!(sku));
            body.insert("currency".into(), json!(currency));
            body.insert("gpuHourPrice".into(), json!(gpu_hour_price));
            if let Some(from) = from {
                body.insert("fromMs".into(), json!(parse_time_ms("--from", &from, now_ms())?));
            }
            ctx.print(&ctx.call("usage.setPrice", body, None).await?, crate::output::Format::Json)
        }
        UsageCommand::Prices { command: PricesCommand::List { sku } } => {
            let mut body = Map::new();
            if let Some(sku) = sku {
                body.insert("sku".into(), json!(sku));
            }
            let prices = ctx.call("usage.listPrices", body, None).await?;
            ctx.print_list(&price_rows(&prices), PRICE_COLUMNS)
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A time: epoch milliseconds, RFC 3339, `now`, or `-DURATION` before now.
pub fn parse_time_ms(flag: &str, text: &str, now_ms: u64) -> Result<u64, CliError> {
    let bad = |why: String| CliError::usage(format!("{flag} {text:?}: {why}"));
    let text = text.trim();
    if text == "now" {
        return Ok(now_ms);
    }
    if let Some(ago) = text.strip_prefix('-') {
        let d = humantime::parse_duration(ago).map_err(|e| bad(format!("not a duration like -24h ({e})")))?;
        return Ok(now_ms.saturating_sub(d.as_millis() as u64));
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map_err(|e| bad(format!("{e}")));
    }
    let at = humantime::parse_rfc3339_weak(text).map_err(|e| bad(format!("not RFC 3339, epoch ms, now or -DURATION ({e})")))?;
    Ok(at.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0))
}

fn range_body(ctx: &Context, range: &Range) -> Result<Map<String, Value>, CliError> {
    let now = now_ms();
    let (from, to) = (parse_time_ms("--from", &range.from, now)?, parse_time_ms("--to", &range.to, now)?);
    if to <= from {
        return Err(CliError::usage(format!("--to ({to}) must be after --from ({from})")));
    }
    let mut body = ctx.tenant_body()?;
    body.insert("fromMs".into(), json!(from));
    body.insert("toMs".into(), json!(to));
    Ok(body)
}

fn num(row: &Value, field: &str) -> i64 {
    row.get(field).and_then(Value::as_i64).unwrap_or(0)
}

fn text<'a>(row: &'a Value, field: &str) -> &'a str {
    row.get(field).and_then(Value::as_str).unwrap_or("")
}

fn time_cell(row: &Value, field: &str) -> String {
    row.get(field).and_then(Value::as_u64).map(bc_core::clock::rfc3339_ms).unwrap_or_default()
}

/// The quantity in hours of its kind's unit: `1.250 GPU-hours`, `0.500 GiB-hours`.
fn hours(row: &Value) -> String {
    let units = kind_units(row);
    format!("{:.3} {}", num(row, "quantityMs") as f64 / MS_PER_HOUR / units.per_unit as f64, units.hours)
}

/// `1234567` millionths → `1.23`, with the currency.
fn money(micros: i64, currency: &str) -> String {
    let cents = (micros as f64 / 1_000_000.0 * 100.0).round() / 100.0;
    if currency.is_empty() { format!("{cents:.2}") } else { format!("{cents:.2} {currency}") }
}

const ROW_COLUMNS: &[Column] = &[
    Column { header: "WINDOW", cell: |r, _| time_cell(r, "windowStartMs") },
    Column { header: "KIND", cell: |r, _| text(r, "kind").to_owned() },
    Column { header: "RESOURCE", cell: |r, _| subject(r).to_owned() },
    Column { header: "POOL", cell: |r, _| text(r, "poolId").to_owned() },
    Column { header: "SKU", cell: |r, _| text(r, "sku").to_owned() },
    Column { header: "UNITS", cell: |r, _| units_cell(r) },
    Column { header: "QUANTITY", cell: |r, _| hours(r) },
    Column { header: "COST", cell: |r, _| money(num(r, "costMicros"), text(r, "currency")) },
    Column { header: "EVENT", cell: |r, _| format!("{}.{}", num(r, "eventSeq"), num(r, "line")) },
];

const GROUP_COLUMNS: &[Column] = &[
    Column { header: "WINDOW", cell: |r, _| time_cell(r, "windowStartMs") },
    Column { header: "POOL", cell: |r, _| text(r, "poolId").to_owned() },
    Column { header: "SKU", cell: |r, _| text(r, "sku").to_owned() },
    Column { header: "RESERVATION", cell: |r, _| text(r, "reservationId").to_owned() },
    Column { header: "INSTANCE", cell: |r, _| text(r, "instanceId").to_owned() },
    Column { header: "SANDBOX", cell: |r, _| text(r, "sandboxId").to_owned() },
    Column { header: "PROJECT", cell: |r, _| text(r, "projectId").to_owned() },
    Column { header: "RESOURCE KIND", cell: |r, _| text(r, "resourceKind").to_owned() },
    Column { header: "QUANTITY", cell: |r, _| hours(r) },
    Column {
        header: "COST",
        cell: |r, _| {
            let costs = r.get("costs").and_then(Value::as_array).cloned().unwrap_or_default();
            costs.iter().map(|c| money(num(c, "costMicros"), text(c, "currency"))).collect::<Vec<_>>().join(" + ")
        },
    },
    Column { header: "ROWS", cell: |r, _| num(r, "rows").to_string() },
];

const PRICE_COLUMNS: &[Column] = &[
    Column { header: "SKU", cell: |r, _| text(r, "sku").to_owned() },
    Column { header: "FROM", cell: |r, _| time_cell(r, "fromMs") },
    Column { header: "UNTIL", cell: |r, _| time_cell(r, "untilMs") },
    Column {
        header: "PER UNIT-HOUR",
        cell: |r, _| format!("{:.6} {}", num(r, "gpuHourMicros") as f64 / 1e6, text(r, "currency")),
    },
];

/// One table row per price period.
fn price_rows(prices: &Value) -> Value {
    let mut rows = Vec::new();
    for sku in prices.as_array().into_iter().flatten() {
        for period in sku.get("periods").and_then(Value::as_array).into_iter().flatten() {
            let mut row = period.clone();
            row["sku"] = sku["sku"].clone();
            rows.push(row);
        }
    }
    Value::Array(rows)
}

async fn list(ctx: &Context, range: &Range, group_by: &[GroupBy], page: &Page) -> Result<(), CliError> {
    let mut body = range_body(ctx, range)?;
    if !group_by.is_empty() {
        let keys: Vec<&str> = group_by
            .iter()
            .map(|g| match g {
                GroupBy::Window => "window",
                GroupBy::Pool => "pool",
                GroupBy::Sku => "sku",
                GroupBy::Reservation => "reservation",
                GroupBy::Instance => "instance",
                GroupBy::Sandbox => "sandbox",
                GroupBy::Project => "project",
            })
            .collect();
        body.insert("groupBy".into(), json!(keys));
        let answer = ctx.call("usage.list", body, None).await?;
        let groups = json!({ "items": answer.get("groups").cloned().unwrap_or(json!([])) });
        if ctx.global.format.is_some() || ctx.global.query.is_some() {
            return ctx.print(&answer, crate::output::Format::Json);
        }
        return ctx.print_list(&groups, GROUP_COLUMNS);
    }
    super::add_page(&mut body, page);
    let answer = ctx.call("usage.list", body, None).await?;
    ctx.print_list(&answer, ROW_COLUMNS)
}

/// How the export shows its progress: a bar on a terminal, a line a second elsewhere.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
    last: Instant,
}

impl Progress {
    fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new_spinner();
            bar.set_style(
                indicatif::ProgressStyle::with_template("exporting {spinner} {human_pos} rows, {per_sec}, {elapsed}")
                    .expect("a valid template"),
            );
            bar
        });
        Self { bar, started: Instant::now(), last: Instant::now() }
    }

    fn rows(&mut self, rows: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(rows);
        } else if self.last.elapsed().as_millis() >= PROGRESS_INTERVAL_MS {
            self.last = Instant::now();
            eprintln!("exported {rows} rows ({:.0}/s)", rows as f64 / self.started.elapsed().as_secs_f64());
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `.NAME.tmp-PID` beside `out`: on the same file system, so linking it into place is atomic.
fn temporary_path(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "usage".into());
    out.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> CliError {
    CliError::new("INTERNAL", format!("{what} {}: {e}", path.display()))
}

/// `OUT.proofs`: where `--with-proofs` writes by default.
fn proofs_path_of(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".proofs");
    PathBuf::from(name)
}

/// Links a complete temporary file into place; fails when `out` exists (never over a file).
fn link_new(temporary: &Path, out: &Path, what: &str) -> Result<(), CliError> {
    std::fs::hard_link(temporary, out).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => {
            CliError::new("ALREADY_EXISTS", format!("{} exists; {what} is never written over a file", out.display()))
        }
        _ => io_error("cannot create", out, e),
    })
}

/// Writes the proofs of `seqs` to a temporary file beside `out`, synced; returns what it wrote.
async fn write_proofs_file(
    ctx: &Context,
    tenant: &str,
    seqs: &std::collections::BTreeSet<u64>,
    temporary: &Path,
) -> Result<proof::ProofsWritten, CliError> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(temporary)
        .map_err(|e| io_error("cannot create", temporary, e))?;
    let mut writer = std::io::BufWriter::with_capacity(EXPORT_BUFFER_BYTES, file);
    let written = proof::write_proofs(&ctx.global.url, tenant, seqs, &mut writer).await?;
    let file = writer.into_inner().map_err(|e| io_error("cannot write", temporary, e.into_error()))?;
    file.sync_all().map_err(|e| io_error("cannot write", temporary, e))?;
    Ok(written)
}

async fn export(
    ctx: &Context,
    range: &Range,
    format: ExportFormat,
    out: &Path,
    currency: &str,
    proofs: Option<&Path>,
) -> Result<Value, CliError> {
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(CliError::usage(format!("--currency {currency:?} is not an ISO 4217 code (USD, EUR)")));
    }
    for path in std::iter::once(out).chain(proofs) {
        if path.exists() {
            return Err(CliError::new(
                "ALREADY_EXISTS",
                format!("{} exists; an export is never written over a file", path.display()),
            ));
        }
    }
    let body = range_body(ctx, range)?;
    let tenant = match ctx.tenant_id()? {
        Some(t) => t.to_string(),
        None => ctx.call("system.whoami", Map::new(), None).await?["tenantId"].as_str().unwrap_or_default().to_owned(),
    };
    let temporary = temporary_path(out);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temporary)
        .map_err(|e| io_error("cannot create", &temporary, e))?;
    let mut writer = std::io::BufWriter::with_capacity(EXPORT_BUFFER_BYTES, file);
    let started = Instant::now();
    let mut seqs = proofs.map(|_| std::collections::BTreeSet::new());
    let written = write_pages(ctx, body, format, &tenant, currency, &mut writer, seqs.as_mut()).await;
    let finished = written.and_then(|rows| {
        let file = writer.into_inner().map_err(|e| io_error("cannot write", &temporary, e.into_error()))?;
        file.sync_all().map_err(|e| io_error("cannot write", &temporary, e))?;
        Ok(rows)
    });
    // The proofs are of the events the rows name, against the newest checkpoint once every page
    // is read; both files land only when both are complete.
    let proofs_temporary = proofs.map(temporary_path);
    let finished = match (finished, proofs, &proofs_temporary, &seqs) {
        (Ok(rows), Some(path), Some(temp), Some(seqs)) => {
            let written = write_proofs_file(ctx, &tenant, seqs, temp).await;
            written.and_then(|w| {
                link_new(&temporary, out, "an export")?;
                link_new(temp, path, "an export's proofs").inspect_err(|_| {
                    let _ = std::fs::remove_file(out);
                })?;
                Ok((rows, Some(w)))
            })
        }
        (Ok(rows), ..) => link_new(&temporary, out, "an export").map(|()| (rows, None)),
        (Err(e), ..) => Err(e),
    };
    let _ = std::fs::remove_file(&temporary);
    if let Some(temp) = &proofs_temporary {
        let _ = std::fs::remove_file(temp);
    }
    let (rows, proved) = finished?;
    bc_core::keys::sync_dir_of(out)?;
    let format_name = if format == ExportFormat::Csv { "csv" } else { "jsonl" };
    let mut summary = json!({ "out": out.display().to_string(), "format": format_name, "rows": rows, "elapsedMs": started.elapsed().as_millis() as u64 });
    if let (Some(path), Some(w)) = (proofs, proved) {
        if w.unproved > 0 {
            eprintln!(
                "warning: {} of the rows' events are past the newest checkpoint (size {}): their rows are marked unproved in {}; export again once a checkpoint covers them",
                w.unproved,
                w.tree_size,
                path.display()
            );
        }
        summary["proofs"] = json!({ "out": path.display().to_string(), "treeSize": w.tree_size, "eventsProved": w.proved, "eventsUnproved": w.unproved });
    }
    Ok(summary)
}

/// Reads `usage.list` page by page and writes each row; returns the rows written.
async fn write_pages(
    ctx: &Context,
    body: Map<String, Value>,
    format: ExportFormat,
    tenant: &str,
    currency: &str,
    writer: &mut impl Write,
    mut seqs: Option<&mut std::collections::BTreeSet<u64>>,
) -> Result<u64, CliError> {
    let client = ctx.client()?;
    let werr = |e: std::io::Error| CliError::new("INTERNAL", format!("writing the export: {e}"));
    if format == ExportFormat::Csv {
        writeln!(writer, "{}", FOCUS_COLUMNS.join(",")).map_err(werr)?;
    }
    let mut progress = Progress::new();
    let mut rows = 0u64;
    let mut cursor: Option<String> = None;
    loop {
        let mut page = body.clone();
        page.insert("limit".into(), json!(EXPORT_PAGE_ROWS));
        if let Some(c) = &cursor {
            page.insert("cursor".into(), json!(c));
        }
        let answer = client.call("usage.list", &Value::Object(page), None).await?;
        for row in answer.get("items").and_then(Value::as_array).into_iter().flatten() {
            let line = match format {
                ExportFormat::Csv => focus_row(row, tenant, currency),
                ExportFormat::Jsonl => cloud_event(row, tenant).to_string(),
            };
            writeln!(writer, "{line}").map_err(werr)?;
            if let Some(seqs) = seqs.as_deref_mut() {
                // Its events are on the chain of the tenant that offered the pool: the proofs
                // file proves one chain, this tenant's.
                if let Some(owner) = row.get("ownerTenantId").and_then(Value::as_str) {
                    return Err(CliError::new(
                        "UNSUPPORTED",
                        format!(
                            "the range holds usage of a reservation held for {tenant} on tenant {owner}'s chain (a pool it offered), which --with-proofs does not prove yet\nhint: export without --with-proofs, or a range without it"
                        ),
                    ));
                }
                proof::row_seqs(row, seqs);
            }
            rows += 1;
        }
        progress.rows(rows);
        cursor = answer.get("nextCursor").and_then(Value::as_str).map(str::to_owned);
        if cursor.is_none() {
            progress.finish();
            return Ok(rows);
        }
    }
}

/// The FOCUS 1.0 columns focus-validator requires, then the project's own (`x_`).
pub const FOCUS_COLUMNS: &[&str] = &[
    "BilledCost",
    "BillingAccountId",
    "BillingAccountName",
    "BillingCurrency",
    "BillingPeriodEnd",
    "BillingPeriodStart",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "ChargeFrequency",
    "ChargePeriodEnd",
    "ChargePeriodStart",
    "CommitmentDiscountCategory",
    "CommitmentDiscountId",
    "CommitmentDiscountName",
    "CommitmentDiscountStatus",
    "CommitmentDiscountType",
    "ConsumedQuantity",
    "ConsumedUnit",
    "ContractedCost",
    "ContractedUnitPrice",
    "EffectiveCost",
    "InvoiceIssuer",
    "ListCost",
    "ListUnitPrice",
    "PricingCategory",
    "PricingQuantity",
    "PricingUnit",
    "Provider",
    "Publisher",
    "RegionId",
    "RegionName",
    "ResourceId",
    "ResourceName",
    "ResourceType",
    "ServiceCategory",
    "ServiceName",
    "SkuId",
    "SkuPriceId",
    "SubAccountId",
    "SubAccountName",
    "Tags",
    "x_EventSeq",
    "x_EventLine",
    "x_SourceSeqs",
    "x_ActivationSeq",
    "x_GpuMilliseconds",
    "x_Gpus",
    "x_RecordedAt",
    "x_ResourceKind",
    "x_UnitMilliseconds",
    "x_Units",
];

/// A CSV field, quoted when it holds a comma, a quote or a line break.
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) { format!("\"{}\"", text.replace('"', "\"\"")) } else { text.to_owned() }
}

/// Millionths as a decimal with six places (`-1.500000`).
fn decimal_micros(micros: i64) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    let m = micros.unsigned_abs();
    format!("{sign}{}.{:06}", m / 1_000_000, m % 1_000_000)
}

/// The calendar month (UTC) holding `ms`: its first instant and the next month's.
fn billing_period(ms: u64) -> (String, String) {
    let date = bc_core::clock::rfc3339_ms(ms);
    let (year, month): (i64, u32) = (date[0..4].parse().unwrap_or(1970), date[5..7].parse().unwrap_or(1));
    let (next_year, next_month) = if month == 12 { (year + 1, 1) } else { (year, month + 1) };
    (format!("{year:04}-{month:02}-01T00:00:00Z"), format!("{next_year:04}-{next_month:02}-01T00:00:00Z"))
}

/// `value / 10^places` as a decimal with `places` places (`-1.500`), exactly.
fn decimal_scaled(value: i128, places: u32) -> String {
    let sign = if value < 0 { "-" } else { "" };
    let scale = 10u128.pow(places);
    let v = value.unsigned_abs();
    format!("{sign}{}.{:0width$}", v / scale, v % scale, width = places as usize)
}

/// The quantity in seconds of its kind's unit, exactly: GPU-, vCPU- or sandbox-seconds with 6
/// places (milliseconds are 3); GiB-seconds of MiB-milliseconds with 13 (1/1,024,000 is
/// 9,765,625 × 10⁻¹³).
fn consumed_seconds(quantity_ms: i64, per_unit: i64) -> String {
    if per_unit == 1024 { decimal_scaled(i128::from(quantity_ms) * 9_765_625, 13) } else { decimal_micros(quantity_ms * 1000) }
}

/// One usage row as a FOCUS 1.0 line.
fn focus_row(row: &Value, tenant: &str, default_currency: &str) -> String {
    let quantity_ms = num(row, "quantityMs");
    let units = kind_units(row);
    let gpu = text(row, "resourceKind") == "gpu";
    let priced = row.get("gpuHourMicros").and_then(Value::as_i64);
    let currency = row.get("currency").and_then(Value::as_str).unwrap_or(default_currency);
    let cost = decimal_micros(num(row, "costMicros"));
    let window_start = num(row, "windowStartMs") as u64;
    let (period_start, period_end) = billing_period(window_start);
    let (reservation, pool, sku) = (text(row, "reservationId"), text(row, "poolId"), text(row, "sku"));
    let resource = subject(row);
    let correction = text(row, "kind") == "correction";
    let seqs: Vec<String> = row
        .get("seqs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .map(|s| s.to_string())
        .collect();
    let mut tags = json!({ "pool": pool, "reservation": reservation, "kind": text(row, "kind") });
    if !gpu {
        tags["resourceKind"] = json!(text(row, "resourceKind"));
        for (key, field) in [("instance", "instanceId"), ("sandbox", "sandboxId")] {
            if row.get(field).is_some_and(Value::is_string) {
                tags[key] = json!(text(row, field));
            }
        }
        if reservation.is_empty() {
            tags.as_object_mut().expect("an object").remove("reservation");
        }
    }
    // FOCUS's own place for what the provider groups costs by: a key-value tag, no new column.
    if let Some(project) = row.get("projectId").and_then(Value::as_str) {
        tags["project"] = json!(project);
    }
    let tags = tags.to_string();
    let description = if gpu {
        format!(
            "{} GPU time of reservation {reservation} ({sku}, {} GPUs) in the window from {}",
            if correction { "correction of the" } else { "the" },
            num(row, "gpus"),
            bc_core::clock::rfc3339_ms(window_start)
        )
    } else {
        format!(
            "{} {} time of {} {resource} ({}) in the window from {}",
            if correction { "correction of the" } else { "the" },
            text(row, "resourceKind"),
            units.resource_type.to_lowercase(),
            units_cell(row),
            bc_core::clock::rfc3339_ms(window_start)
        )
    };
    let seconds = consumed_seconds(quantity_ms, units.per_unit);
    let hours = format!("{:.9}", quantity_ms as f64 / MS_PER_HOUR / units.per_unit as f64);
    let unit_price = priced.map(decimal_micros).unwrap_or_default();
    let fields: Vec<String> = vec![
        cost.clone(),
        tenant.into(),
        tenant.into(),
        currency.into(),
        period_end,
        period_start,
        "Usage".into(),
        if correction { "Correction".into() } else { String::new() },
        description,
        "Usage-Based".into(),
        bc_core::clock::rfc3339_ms(num(row, "windowEndMs") as u64),
        bc_core::clock::rfc3339_ms(window_start),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        seconds,
        units.consumed.into(),
        cost.clone(),
        unit_price.clone(),
        cost.clone(),
        PROVIDER.into(),
        cost,
        unit_price,
        "Standard".into(),
        hours,
        units.pricing.into(),
        PROVIDER.into(),
        PROVIDER.into(),
        String::new(),
        String::new(),
        resource.into(),
        resource.into(),
        units.resource_type.into(),
        "Compute".into(),
        units.service.into(),
        sku.into(),
        if priced.is_some() { format!("{sku}/{currency}") } else { String::new() },
        pool.into(),
        pool.into(),
        tags,
        num(row, "eventSeq").to_string(),
        num(row, "line").to_string(),
        seqs.join(" "),
        num(row, "activationSeq").to_string(),
        if gpu { quantity_ms.to_string() } else { String::new() },
        if gpu { num(row, "gpus").to_string() } else { String::new() },
        bc_core::clock::rfc3339_ms(num(row, "recordedAtMs") as u64),
        text(row, "resourceKind").into(),
        quantity_ms.to_string(),
        if gpu { num(row, "gpus").to_string() } else { num(row, "units").to_string() },
    ];
    debug_assert_eq!(fields.len(), FOCUS_COLUMNS.len());
    fields.iter().map(|f| csv_field(f)).collect::<Vec<_>>().join(",")
}

/// One usage row as a CloudEvents 1.0 record (structured JSON), as OpenMeter ingests them: the
/// tenant is the subject, the window's start the time, the row the data.
fn cloud_event(row: &Value, tenant: &str) -> Value {
    json!({
        "specversion": "1.0",
        // A row on the chain of the tenant that offered a pool is named on that chain.
        "id": format!("{}/{}/{}", row.get("ownerTenantId").and_then(Value::as_str).unwrap_or(tenant), num(row, "eventSeq"), num(row, "line")),
        "source": format!("/better-compute/tenants/{tenant}/usage"),
        "type": format!("{CLOUDEVENT_TYPE_PREFIX}{}", if text(row, "resourceKind").is_empty() { "gpu" } else { text(row, "resourceKind") }),
        "subject": tenant,
        "time": bc_core::clock::rfc3339_ms(num(row, "windowStartMs") as u64),
        "datacontenttype": "application/json",
        "data": row,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_decimals_and_periods() {
        let now = 1_800_000_000_000;
        assert_eq!(parse_time_ms("--from", "now", now).unwrap(), now);
        assert_eq!(parse_time_ms("--from", "-1h", now).unwrap(), now - 3_600_000);
        assert_eq!(parse_time_ms("--from", "1700000000000", now).unwrap(), 1_700_000_000_000);
        assert_eq!(parse_time_ms("--from", "2026-12-01T00:00:00Z", now).unwrap(), 1_796_083_200_000);
        assert!(parse_time_ms("--from", "yesterday", now).is_err());
        assert_eq!(decimal_micros(-1_500_000), "-1.500000");
        assert_eq!(decimal_micros(7), "0.000007");
        assert_eq!(billing_period(1_796_083_200_000), ("2026-12-01T00:00:00Z".into(), "2027-01-01T00:00:00Z".into()));
        assert_eq!(csv_field("a,\"b\""), "\"a,\"\"b\"\"\"");
        // GiB-seconds of MiB-milliseconds, exactly: 1 GiB for 1 s; 512 MiB for 3 ms; taken back.
        assert_eq!(consumed_seconds(1024 * 1000, 1024), "1.0000000000000");
        assert_eq!(consumed_seconds(512 * 3, 1024), "0.0015000000000");
        assert_eq!(consumed_seconds(-1, 1024), "-0.0000009765625");
        assert_eq!(consumed_seconds(1500, 1), "1.500000");
    }
}
