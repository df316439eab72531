//! `flavors create|list|get|update|delete` and `images register|list|get|promote|delete`: what instances are
//! made of (the `flavors.*` and `images.*` methods). The server checks every bound; the CLI
//! checks only ids, so a refusal reads the same from the CLI and the API.

use bc_core::id::{FlavorId, ImageId, PoolId};
use clap::{Subcommand, ValueEnum};
use serde_json::json;

use crate::client::CliError;
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, add_if_version, put_id};

#[derive(Subcommand)]
pub enum FlavorsCommand {
    /// A flavor in one pool; its name is unique within the pool.
    Create {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        name: String,
        /// vCPUs (1 to 1024).
        #[arg(long)]
        vcpus: u32,
        /// Memory in MiB (1 to 16777216, 16 TiB).
        #[arg(long)]
        memory_mib: u64,
        /// Disk in GiB (1 to 65536).
        #[arg(long)]
        disk_gib: u64,
        /// GPUs passed through (0 to 64; default 0).
        #[arg(long, default_value_t = 0)]
        gpus: u32,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's flavors, of one pool with --pool.
    List {
        #[arg(long)]
        pool: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// One flavor, by its `flv_…` id.
    Get { flavor_id: String },
    /// Change a flavor's name or shape in place: instances made before keep theirs. Its pool
    /// cannot change (create the flavor in the other pool).
    Update {
        flavor_id: String,
        /// A new name, unique within the pool.
        #[arg(long)]
        name: Option<String>,
        /// vCPUs (1 to 1024).
        #[arg(long)]
        vcpus: Option<u32>,
        /// Memory in MiB (1 to 16777216, 16 TiB).
        #[arg(long)]
        memory_mib: Option<u64>,
        /// Disk in GiB (1 to 65536).
        #[arg(long)]
        disk_gib: Option<u64>,
        /// GPUs passed through (0 to 64).
        #[arg(long)]
        gpus: Option<u32>,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// Delete a flavor.
    Delete {
        flavor_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

/// An image's disk format.
#[derive(Clone, Copy, ValueEnum)]
pub enum DiskFormatArg {
    Qcow2,
    Raw,
    /// A bootable ISO, for `metal deploy` and `metal rescue`.
    Iso,
    /// A root file system as a tar archive, for sandbox templates.
    RootfsTar,
}

/// An image's release channel.
#[derive(Clone, Copy, ValueEnum)]
pub enum ChannelArg {
    Testing,
    Stable,
}

#[derive(Subcommand)]
pub enum ImagesCommand {
    /// Register an image: where it is fetched from and the SHA-256 its bytes must have.
    Register {
        /// Unique within the tenant.
        #[arg(long)]
        name: String,
        /// Where the image is fetched from: `https://` or `http://`, without user, password or
        /// query (the URL enters the log). Not `--url`, which is every command's API URL: the
        /// token would go to the image's host.
        #[arg(long)]
        image_url: String,
        /// The image's SHA-256, 64 lowercase hex digits (as `sha256sum` prints it).
        #[arg(long)]
        sha256: String,
        /// qcow2 or raw (not `--format`, which is every command's output format).
        #[arg(long, value_enum)]
        disk_format: DiskFormatArg,
        /// The image's size in bytes, when known.
        #[arg(long)]
        size_bytes: Option<u64>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's images, of one channel with --channel.
    List {
        #[arg(long, value_enum)]
        channel: Option<ChannelArg>,
        #[command(flatten)]
        page: Page,
    },
    /// Promote an image from the testing channel (where it is registered) to stable.
    Promote {
        image_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
    /// One image, by its `img_…` id.
    Get { image_id: String },
    /// Delete an image.
    Delete {
        image_id: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

pub async fn run(ctx: &Context, command: FlavorsCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let value = match command {
        FlavorsCommand::List { pool, page } => {
            if let Some(pool) = pool {
                put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            }
            return ctx.list("flavors.list", body, &page, tables::FLAVORS).await;
        }
        FlavorsCommand::Get { flavor_id } => {
            put_id::<FlavorId>(&mut body, "flavorId", "FLAVOR_ID", &flavor_id)?;
            ctx.call("flavors.get", body, None).await?
        }
        FlavorsCommand::Update { flavor_id, name, vcpus, memory_mib, disk_gib, gpus, if_version } => {
            put_id::<FlavorId>(&mut body, "flavorId", "FLAVOR_ID", &flavor_id)?;
            let fields = [
                ("name", name.map(|n| json!(n))),
                ("vcpus", vcpus.map(|v| json!(v))),
                ("memoryMiB", memory_mib.map(|v| json!(v))),
                ("diskGiB", disk_gib.map(|v| json!(v))),
                ("gpus", gpus.map(|v| json!(v))),
            ];
            if fields.iter().all(|(_, v)| v.is_none()) {
                return Err(CliError::usage("nothing to update: give --name, --vcpus, --memory-mib, --disk-gib or --gpus"));
            }
            for (field, value) in fields {
                if let Some(value) = value {
                    body.insert(field.into(), value);
                }
            }
            add_if_version(&mut body, &if_version);
            ctx.call("flavors.update", body, None).await?
        }
        FlavorsCommand::Delete { flavor_id, if_version } => {
            put_id::<FlavorId>(&mut body, "flavorId", "FLAVOR_ID", &flavor_id)?;
            add_if_version(&mut body, &if_version);
            ctx.call("flavors.delete", body, None).await?
        }
        FlavorsCommand::Create { pool, name, vcpus, memory_mib, disk_gib, gpus, key } => {
            put_id::<PoolId>(&mut body, "poolId", "--pool", &pool)?;
            body.insert("name".into(), json!(name));
            body.insert("vcpus".into(), json!(vcpus));
            body.insert("memoryMiB".into(), json!(memory_mib));
            body.insert("diskGiB".into(), json!(disk_gib));
            body.insert("gpus".into(), json!(gpus));
            ctx.create("flavors.create", body, &key).await?
        }
    };
    ctx.print(&value, Format::Json)
}

fn channel_word(channel: ChannelArg) -> &'static str {
    match channel {
        ChannelArg::Testing => "testing",
        ChannelArg::Stable => "stable",
    }
}

pub async fn images(ctx: &Context, command: ImagesCommand) -> Result<(), CliError> {
    let mut body = ctx.tenant_body()?;
    let value = match command {
        ImagesCommand::List { channel, page } => {
            if let Some(channel) = channel {
                body.insert("channel".into(), json!(channel_word(channel)));
            }
            return ctx.list("images.list", body, &page, tables::IMAGES).await;
        }
        ImagesCommand::Promote { image_id, if_version } => {
            put_id::<ImageId>(&mut body, "imageId", "IMAGE_ID", &image_id)?;
            add_if_version(&mut body, &if_version);
            ctx.call("images.promote", body, None).await?
        }
        ImagesCommand::Get { image_id } => {
            put_id::<ImageId>(&mut body, "imageId", "IMAGE_ID", &image_id)?;
            ctx.call("images.get", body, None).await?
        }
        ImagesCommand::Delete { image_id, if_version } => {
            put_id::<ImageId>(&mut body, "imageId", "IMAGE_ID", &image_id)?;
            add_if_version(&mut body, &if_version);
            ctx.call("images.delete", body, None).await?
        }
        ImagesCommand::Register { name, image_url, sha256, disk_format, size_bytes, key } => {
            body.insert("name".into(), json!(name));
            body.insert("url".into(), json!(image_url));
            body.insert("sha256".into(), json!(sha256));
            let format = match disk_format {
                DiskFormatArg::Qcow2 => "qcow2",
                DiskFormatArg::Raw => "raw",
                DiskFormatArg::Iso => "iso",
                DiskFormatArg::RootfsTar => "rootfs-tar",
            };
            body.insert("diskFormat".into(), json!(format));
            if let Some(size) = size_bytes {
                body.insert("sizeBytes".into(), json!(size));
            }
            ctx.create("images.register", body, &key).await?
        }
    };
    ctx.print(&value, Format::Json)
}
