//! `sandbox create|list|get|extend|delete|exec|templates` (the `sandboxes.*` methods),
//! `sandbox-template create|list|get|update|delete` (`sandboxTemplates.*`), `sandbox-volume
//! create|list|get|resize|delete` (`sandboxVolumes.*`) and `sandbox-snapshot list|get|delete`
//! (`sandboxSnapshots.*`; `sandbox snapshot` takes one, `sandbox create --from-snapshot` restores
//! one). Ids are checked before anything is sent (`sbx_…`, `sbxt_…`, `vol_…`, `snap_…`: a usage
//! error, exit 2). `sandbox create --wait S` (0 to
//! 30, default 30) follows a cold sandbox until it leaves `starting`; `sandbox exec SBX --
//! COMMAND…` runs the command in the sandbox through an `exec` tunnel and exits with its status
//! (`REMOTE_EXIT`).

use std::collections::BTreeMap;

use bc_core::id::{FlavorId, PoolId, SandboxId, SandboxSnapshotId, SandboxTemplateId, SandboxVolumeId};
use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, Settle, add_if_version, add_page, idempotency_key, put_id};

/// `--wait`'s bound, as the reference's: a create waits at most this long.
pub const CREATE_WAIT_S_MAX: u64 = 30;

/// A duration such as `90s`, `15m` or `2h`, in whole seconds.
fn duration_s(text: &str) -> Result<u64, String> {
    let d = humantime::parse_duration(text).map_err(|e| format!("{text:?} is not a duration such as 15m or 2h: {e}"))?;
    if d.subsec_nanos() != 0 || d.as_secs() == 0 {
        return Err(format!("{text:?} is not a whole, positive number of seconds"));
    }
    Ok(d.as_secs())
}

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// A sandbox of a template: a warm one when its pool has one, else started cold.
    Create {
        #[arg(long)]
        template: String,
        /// Its life (`15m`, `2h`; whole seconds): the template's default when absent.
        #[arg(long, value_parser = duration_s)]
        ttl: Option<u64>,
        /// Wait up to this many seconds (0 to 30) until it leaves `starting`.
        #[arg(long, default_value_t = CREATE_WAIT_S_MAX, value_parser = clap::value_parser!(u64).range(0..=CREATE_WAIT_S_MAX))]
        wait: u64,
        /// Start it from this snapshot (`snap_…`) of a sandbox of the template: a new sandbox,
        /// restored on the node that holds the snapshot, checked against its SHA-256 first.
        #[arg(long = "from-snapshot", value_name = "ID")]
        from_snapshot: Option<String>,
        /// The project (`proj_…`, a live project of the tenant) it is made in.
        #[arg(long)]
        project: Option<String>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// Save a running sandbox's memory and disk on its node (`sandboxes.snapshot`, always with
    /// an idempotency key).
    Snapshot {
        sandbox_id: String,
        /// The disk alone, without memory (refused on this runtime: UNSUPPORTED).
        #[arg(long = "no-memory")]
        no_memory: bool,
        /// Keep it after the sandbox is deleted.
        #[arg(long)]
        keep: bool,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// The tenant's live sandboxes (with --deleted, deleted ones too), of one template with
    /// --template.
    List {
        #[arg(long)]
        template: Option<String>,
        /// Only the sandboxes made or claimed in this project (`proj_…`).
        #[arg(long)]
        project: Option<String>,
        #[arg(long)]
        deleted: bool,
        #[command(flatten)]
        page: Page,
    },
    /// One sandbox, by its `sbx_…` id.
    Get { sandbox_id: String },
    /// A later end, within its template's maximum: exactly one of --by and --until.
    Extend {
        sandbox_id: String,
        /// Added to its end (`30m`).
        #[arg(long, value_parser = duration_s, conflicts_with = "until", required_unless_present = "until")]
        by: Option<u64>,
        /// Its new end, Unix ms.
        #[arg(long)]
        until: Option<u64>,
    },
    /// Delete a sandbox from its node.
    Delete { sandbox_id: String },
    /// Run a command in a running sandbox, with its template's environment; exits with the
    /// command's status.
    Exec {
        sandbox_id: String,
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// The tenant's sandbox templates (as `sandbox-template list`).
    Templates {
        #[command(flatten)]
        page: Page,
    },
}

#[derive(Subcommand)]
pub enum SandboxTemplateCommand {
    /// A template: sandboxes of --pool, each with --flavor's vCPUs and memory, from --image (a
    /// registered `rootfs-tar`).
    Create(TemplateCreate),
    /// The tenant's sandbox templates.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// One template, by its `sbxt_…` id.
    Get { template_id: String },
    /// Change a template in place: its name, warm pool, TTLs or environment (its pool, flavor,
    /// image and network stay; make another template for those). Claimed sandboxes keep what
    /// they were made with; warm ones made with another environment are replaced.
    Update(TemplateUpdate),
    /// Delete a template; its warm sandboxes go, claimed ones live to their end.
    Delete { template_id: String },
}

#[derive(Args)]
pub struct TemplateCreate {
    #[arg(long)]
    name: String,
    #[arg(long)]
    pool: String,
    #[arg(long)]
    flavor: String,
    /// The image: by id (`img_…`) or by channel (`NAME@stable`, `NAME@testing`).
    #[arg(long)]
    image: String,
    /// Sandboxes kept started and unclaimed (0 to 64).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    warm_min: u32,
    /// A sandbox's life when its create names none (`30m`).
    #[arg(long, value_parser = duration_s)]
    default_ttl: Option<u64>,
    /// The longest a sandbox may live, extensions included (`4h`; at most `24h`).
    #[arg(long, value_parser = duration_s)]
    max_ttl: Option<u64>,
    /// `NAME=VALUE`, repeatable: the environment of every command in its sandboxes.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    env: Vec<String>,
    /// `none` (the only policy so far).
    #[arg(long, default_value = "none", value_parser = ["none"])]
    network: String,
    /// `NAME:/PATH[:ro]`, repeatable or comma-separated: the volumes every sandbox mounts, each
    /// by name or by `vol_…` id (the template keeps no warm pool then).
    #[arg(long = "volumes", value_name = "NAME:/PATH[:ro],…")]
    volumes: Vec<String>,
    #[command(flatten)]
    key: IdempotencyKey,
}

#[derive(Args)]
pub struct TemplateUpdate {
    template_id: String,
    #[arg(long)]
    name: Option<String>,
    /// Sandboxes kept started and unclaimed (0 to 64); lowered, the newest warm ones go.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=64))]
    warm_min: Option<u32>,
    #[arg(long, value_parser = duration_s)]
    default_ttl: Option<u64>,
    #[arg(long, value_parser = duration_s)]
    max_ttl: Option<u64>,
    /// `NAME=VALUE`, repeatable: the environment from now on, replacing the old one whole.
    #[arg(long = "env", value_name = "NAME=VALUE", conflicts_with = "clear_env")]
    env: Vec<String>,
    /// An empty environment from now on.
    #[arg(long)]
    clear_env: bool,
    /// `NAME:/PATH[:ro]`, repeatable or comma-separated: the volumes from now on, replacing the
    /// old ones (`--volumes ""`: none).
    #[arg(long = "volumes", value_name = "NAME:/PATH[:ro],…")]
    volumes: Option<Vec<String>>,
    #[command(flatten)]
    if_version: IfVersion,
}

/// `--wait`: until the sandbox leaves `starting`, read again every 100 ms.
const SETTLE: Settle = Settle {
    get: "sandboxes.get",
    id_field: "sandboxId",
    poll_ms: 100,
    progress: |sandbox| {
        let state = sandbox["state"].as_str().unwrap_or_default();
        (state == "starting").then(|| format!("starting on node {}", sandbox["nodeId"].as_str().unwrap_or("?")))
    },
    timed_out: |_, wait_s| {
        CliError::new("TIMEOUT", format!("the sandbox is still starting after {wait_s} s"))
            .hint("`sandbox get` shows where it stands; the node may be fetching the root file system")
    },
};

fn env_of(items: &[String]) -> Result<BTreeMap<String, String>, CliError> {
    let mut env = BTreeMap::new();
    for item in items {
        let Some((name, value)) = item.split_once('=') else {
            return Err(CliError::usage(format!("--env {item:?} is not NAME=VALUE")));
        };
        env.insert(name.to_owned(), value.to_owned());
    }
    Ok(env)
}

pub async fn run(ctx: &Context, command: SandboxCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let c = ctx.client()?;
    match command {
        SandboxCommand::Create { template, ttl, wait, from_snapshot, project, key } => {
            put_id::<SandboxTemplateId>(&mut body, "templateId", "--template", &template)?;
            if let Some(p) = project {
                put_id::<bc_core::id::ProjectId>(&mut body, "projectId", "--project", &p)?;
            }
            if let Some(snapshot) = from_snapshot {
                put_id::<SandboxSnapshotId>(&mut body, "fromSnapshotId", "--from-snapshot", &snapshot)?;
            }
            if let Some(ttl) = ttl {
                body.insert("ttlS".into(), json!(ttl));
            }
            let created = c.call("sandboxes.create", &Value::Object(body), Some(&idempotency_key(&key.key))).await?;
            let claimed = created["claimed"].clone();
            let mut sandbox = SETTLE.follow(ctx, &c, created, wait).await?;
            sandbox["claimed"] = claimed;
            if sandbox["state"] == "failed" {
                ctx.print(&sandbox, Format::Json)?;
                return Err(CliError::new(
                    "SANDBOX_FAILED",
                    format!("the sandbox did not start: {}", sandbox["lastError"].as_str().unwrap_or("no reason given")),
                ));
            }
            ctx.print(&sandbox, Format::Json)
        }
        SandboxCommand::List { template, project, deleted, page } => {
            if let Some(t) = template {
                put_id::<SandboxTemplateId>(&mut body, "templateId", "--template", &t)?;
            }
            if let Some(p) = project {
                put_id::<bc_core::id::ProjectId>(&mut body, "projectId", "--project", &p)?;
            }
            if deleted {
                body.insert("deleted".into(), json!(true));
            }
            add_page(&mut body, &page);
            ctx.print_list(&c.call("sandboxes.list", &Value::Object(body), None).await?, tables::SANDBOXES)
        }
        SandboxCommand::Snapshot { sandbox_id, no_memory, keep, key } => {
            put_id::<SandboxId>(&mut body, "sandboxId", "SANDBOX", &sandbox_id)?;
            if no_memory {
                body.insert("noMemory".into(), json!(true));
            }
            if keep {
                body.insert("keep".into(), json!(true));
            }
            let taken = c.call("sandboxes.snapshot", &Value::Object(body), Some(&idempotency_key(&key.key))).await?;
            ctx.print(&taken, Format::Json)
        }
        SandboxCommand::Get { sandbox_id } => {
            put_id::<SandboxId>(&mut body, "sandboxId", "SANDBOX", &sandbox_id)?;
            ctx.print(&c.call("sandboxes.get", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxCommand::Extend { sandbox_id, by, until } => {
            put_id::<SandboxId>(&mut body, "sandboxId", "SANDBOX", &sandbox_id)?;
            match (by, until) {
                (Some(by), None) => body.insert("byS".into(), json!(by)),
                (None, Some(until)) => body.insert("untilMs".into(), json!(until)),
                _ => return Err(CliError::usage("give exactly one of --by and --until")),
            };
            ctx.print(&c.call("sandboxes.extend", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxCommand::Delete { sandbox_id } => {
            put_id::<SandboxId>(&mut body, "sandboxId", "SANDBOX", &sandbox_id)?;
            ctx.print(&c.call("sandboxes.delete", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxCommand::Exec { sandbox_id, command } => {
            put_id::<SandboxId>(&mut body, "sandboxId", "SANDBOX", &sandbox_id)?;
            body.insert("command".into(), json!(command));
            super::console::terminal_by(ctx, "sandboxes.exec", body).await
        }
        SandboxCommand::Templates { page } => {
            add_page(&mut body, &page);
            ctx.print_list(&c.call("sandboxTemplates.list", &Value::Object(body), None).await?, tables::SANDBOX_TEMPLATES)
        }
    }
}

pub async fn run_template(ctx: &Context, command: SandboxTemplateCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let c = ctx.client()?;
    match command {
        SandboxTemplateCommand::Create(t) => {
            body.insert("name".into(), json!(t.name));
            put_id::<PoolId>(&mut body, "poolId", "--pool", &t.pool)?;
            put_id::<FlavorId>(&mut body, "flavorId", "--flavor", &t.flavor)?;
            super::put_image(&mut body, &t.image)?;
            body.insert("warmMin".into(), json!(t.warm_min));
            if let Some(s) = t.default_ttl {
                body.insert("defaultTtlS".into(), json!(s));
            }
            if let Some(s) = t.max_ttl {
                body.insert("maxTtlS".into(), json!(s));
            }
            body.insert("env".into(), json!(env_of(&t.env)?));
            body.insert("network".into(), json!(t.network));
            if !t.volumes.is_empty() {
                body.insert("volumes".into(), volumes_of(&t.volumes)?);
            }
            let created = c.call("sandboxTemplates.create", &Value::Object(body), Some(&idempotency_key(&t.key.key))).await?;
            ctx.print(&created, Format::Json)
        }
        SandboxTemplateCommand::List { page } => {
            add_page(&mut body, &page);
            ctx.print_list(&c.call("sandboxTemplates.list", &Value::Object(body), None).await?, tables::SANDBOX_TEMPLATES)
        }
        SandboxTemplateCommand::Get { template_id } => {
            put_id::<SandboxTemplateId>(&mut body, "templateId", "TEMPLATE", &template_id)?;
            ctx.print(&c.call("sandboxTemplates.get", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxTemplateCommand::Update(t) => {
            put_id::<SandboxTemplateId>(&mut body, "templateId", "TEMPLATE", &t.template_id)?;
            let numbers = [("warmMin", t.warm_min.map(u64::from)), ("defaultTtlS", t.default_ttl), ("maxTtlS", t.max_ttl)];
            let new_env = t.clear_env || !t.env.is_empty();
            if t.name.is_none() && numbers.iter().all(|(_, v)| v.is_none()) && !new_env && t.volumes.is_none() {
                return Err(CliError::usage(
                    "nothing to update: give --name, --warm-min, --default-ttl, --max-ttl, --env, --clear-env or --volumes",
                ));
            }
            if let Some(volumes) = &t.volumes {
                body.insert("volumes".into(), volumes_of(volumes)?);
            }
            if let Some(name) = t.name {
                body.insert("name".into(), json!(name));
            }
            for (field, value) in numbers {
                if let Some(value) = value {
                    body.insert(field.into(), json!(value));
                }
            }
            if new_env {
                body.insert("env".into(), json!(env_of(&t.env)?));
            }
            add_if_version(&mut body, &t.if_version);
            ctx.print(&c.call("sandboxTemplates.update", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxTemplateCommand::Delete { template_id } => {
            put_id::<SandboxTemplateId>(&mut body, "templateId", "TEMPLATE", &template_id)?;
            ctx.print(&c.call("sandboxTemplates.delete", &Value::Object(body), None).await?, Format::Json)
        }
    }
}

/// `--volumes NAME:/PATH[:ro],…` (repeatable, comma-separated, `""` for none) as the API's
/// `volumes`: each entry by name, or by id when it looks like `vol_…`, at an absolute path, `:ro`
/// for a read-only mount.
fn volumes_of(items: &[String]) -> Result<Value, CliError> {
    let mut out = Vec::new();
    for entry in items.iter().flat_map(|i| i.split(',')).filter(|e| !e.is_empty()) {
        let bad = |why: &str| CliError::usage(format!("--volumes {entry:?}: {why} (NAME:/PATH or NAME:/PATH:ro)"));
        let mut parts = entry.splitn(3, ':');
        let (Some(volume), Some(path)) = (parts.next(), parts.next()) else { return Err(bad("no path")) };
        let read_only = match parts.next() {
            None => false,
            Some("ro") => true,
            Some(_) => return Err(bad("the only mode is ro")),
        };
        if volume.is_empty() {
            return Err(bad("no volume"));
        }
        if !path.starts_with('/') {
            return Err(bad("the path is not absolute"));
        }
        let mut mount = serde_json::Map::new();
        if volume.starts_with("vol_") {
            volume.parse::<SandboxVolumeId>().map_err(|e| bad(&format!("not a volume id: {e}")))?;
            mount.insert("volumeId".into(), json!(volume));
        } else {
            mount.insert("name".into(), json!(volume));
        }
        mount.insert("path".into(), json!(path));
        if read_only {
            mount.insert("readOnly".into(), json!(true));
        }
        out.push(Value::Object(mount));
    }
    Ok(Value::Array(out))
}

#[derive(Subcommand)]
pub enum SandboxVolumeCommand {
    /// A volume of --size GiB (1 to 16384) on a node of --pool that runs sandboxes.
    Create {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        name: String,
        /// GiB, 1 to 16384.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16384))]
        size: u64,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// Your volumes (--all: every one of the tenant; --pool: one pool's; --deleted: deleted
    /// ones too).
    List {
        #[arg(long)]
        all: bool,
        #[arg(long)]
        pool: Option<String>,
        #[arg(long)]
        deleted: bool,
        #[command(flatten)]
        page: Page,
    },
    /// One volume, by its `vol_…` id.
    Get { volume_id: String },
    /// Grow a volume to --size GiB (volumes only grow; not while a sandbox mounts it).
    Resize {
        volume_id: String,
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=16384))]
        size: u64,
    },
    /// Delete a volume and its data (refused while a live sandbox mounts it).
    Delete { volume_id: String },
}

pub async fn run_volume(ctx: &Context, command: SandboxVolumeCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let c = ctx.client()?;
    match command {
        SandboxVolumeCommand::Create { pool, name, size, key } => {
            put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            body.insert("name".into(), json!(name));
            body.insert("sizeGiB".into(), json!(size));
            let created = c.call("sandboxVolumes.create", &Value::Object(body), Some(&idempotency_key(&key.key))).await?;
            ctx.print(&created, Format::Json)
        }
        SandboxVolumeCommand::List { all, pool, deleted, page } => {
            if all {
                body.insert("scope".into(), json!("all"));
            }
            if let Some(pool) = pool {
                put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            }
            if deleted {
                body.insert("deleted".into(), json!(true));
            }
            add_page(&mut body, &page);
            ctx.print_list(&c.call("sandboxVolumes.list", &Value::Object(body), None).await?, tables::SANDBOX_VOLUMES)
        }
        SandboxVolumeCommand::Get { volume_id } => {
            put_id::<SandboxVolumeId>(&mut body, "volumeId", "VOLUME", &volume_id)?;
            ctx.print(&c.call("sandboxVolumes.get", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxVolumeCommand::Resize { volume_id, size } => {
            put_id::<SandboxVolumeId>(&mut body, "volumeId", "VOLUME", &volume_id)?;
            body.insert("sizeGiB".into(), json!(size));
            ctx.print(&c.call("sandboxVolumes.resize", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxVolumeCommand::Delete { volume_id } => {
            put_id::<SandboxVolumeId>(&mut body, "volumeId", "VOLUME", &volume_id)?;
            ctx.print(&c.call("sandboxVolumes.delete", &Value::Object(body), None).await?, Format::Json)
        }
    }
}

#[derive(Subcommand)]
pub enum SandboxSnapshotCommand {
    /// Your snapshots (--all: every one of the tenant; --sandbox: one sandbox's; --deleted:
    /// deleted ones too).
    List {
        #[arg(long)]
        all: bool,
        #[arg(long, value_name = "ID")]
        sandbox: Option<String>,
        #[arg(long)]
        deleted: bool,
        #[command(flatten)]
        page: Page,
    },
    /// One snapshot, by its `snap_…` id: its state, digest and size.
    Get { snapshot_id: String },
    /// Delete a snapshot and its files from its node.
    Delete { snapshot_id: String },
}

pub async fn run_snapshot(ctx: &Context, command: SandboxSnapshotCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let c = ctx.client()?;
    match command {
        SandboxSnapshotCommand::List { all, sandbox, deleted, page } => {
            if all {
                body.insert("scope".into(), json!("all"));
            }
            if let Some(sandbox) = sandbox {
                put_id::<SandboxId>(&mut body, "sandboxId", "--sandbox", &sandbox)?;
            }
            if deleted {
                body.insert("deleted".into(), json!(true));
            }
            add_page(&mut body, &page);
            ctx.print_list(&c.call("sandboxSnapshots.list", &Value::Object(body), None).await?, tables::SANDBOX_SNAPSHOTS)
        }
        SandboxSnapshotCommand::Get { snapshot_id } => {
            put_id::<SandboxSnapshotId>(&mut body, "snapshotId", "SNAPSHOT", &snapshot_id)?;
            ctx.print(&c.call("sandboxSnapshots.get", &Value::Object(body), None).await?, Format::Json)
        }
        SandboxSnapshotCommand::Delete { snapshot_id } => {
            put_id::<SandboxSnapshotId>(&mut body, "snapshotId", "SNAPSHOT", &snapshot_id)?;
            ctx.print(&c.call("sandboxSnapshots.delete", &Value::Object(body), None).await?, Format::Json)
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn volumes_are_name_or_id_at_an_absolute_path() {
        let v = super::volumes_of(&["notes:/workspace,vol_01j00000000000000000000000:/data:ro".into()]).unwrap();
        assert_eq!(
            v,
            serde_json::json!([
                { "name": "notes", "path": "/workspace" },
                { "volumeId": "vol_01j00000000000000000000000", "path": "/data", "readOnly": true },
            ])
        );
        assert_eq!(super::volumes_of(&[String::new()]).unwrap(), serde_json::json!([]), "\"\" is none");
        for bad in ["notes", "notes:workspace", "notes:/w:rw", ":/w", "vol_x:/w"] {
            assert!(super::volumes_of(&[bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_are_whole_positive_seconds() {
        assert_eq!(super::duration_s("15m"), Ok(900));
        assert_eq!(super::duration_s("2h"), Ok(7200));
        assert!(super::duration_s("0s").is_err());
        assert!(super::duration_s("1500ms").is_err());
        assert!(super::duration_s("soon").is_err());
    }
}
