//! The views of `flavors.*` and `images.*`: what an instance will be made of.

use bc_projections::events::{DiskFormat, ImageChannel};
use bc_projections::{FlavorDoc, ImageDoc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::api::validate::{FlavorIdText, ImageIdText, NameText, PoolIdText, TenantIdText};

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FlavorView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "FlavorIdText")]
    pub flavor_id: String,
    #[schemars(with = "PoolIdText")]
    pub pool_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub vcpus: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
    pub gpus: u32,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<FlavorDoc> for FlavorView {
    fn from(d: FlavorDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            flavor_id: d.flavor_id,
            pool_id: d.pool_id,
            name: d.name,
            vcpus: d.vcpus,
            memory_mib: d.memory_mib,
            disk_gib: d.disk_gib,
            gpus: d.gpus,
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FlavorDeletedView {
    #[schemars(with = "FlavorIdText")]
    pub flavor_id: String,
    pub deleted: bool,
}

/// An image's disk format on the wire (the event's [`DiskFormat`] is the log's own type).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormatView {
    /// QEMU copy-on-write v2.
    Qcow2,
    /// A raw disk image.
    Raw,
    /// A bootable ISO 9660 image, for bare-metal deploys and rescues (virtual media).
    Iso,
    /// A root file system as a tar archive, for sandboxes (docs/sandboxes.md).
    #[serde(rename = "rootfs-tar")]
    RootfsTar,
}

impl From<DiskFormat> for DiskFormatView {
    fn from(f: DiskFormat) -> Self {
        match f {
            DiskFormat::Qcow2 => Self::Qcow2,
            DiskFormat::Raw => Self::Raw,
            DiskFormat::Iso => Self::Iso,
            DiskFormat::RootfsTar => Self::RootfsTar,
        }
    }
}

/// An image's release channel on the wire: `testing` when registered, `stable` once promoted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ImageChannelView {
    Testing,
    Stable,
}

impl From<ImageChannel> for ImageChannelView {
    fn from(c: ImageChannel) -> Self {
        match c {
            ImageChannel::Testing => Self::Testing,
            ImageChannel::Stable => Self::Stable,
        }
    }
}

impl From<ImageChannelView> for ImageChannel {
    fn from(c: ImageChannelView) -> Self {
        match c {
            ImageChannelView::Testing => Self::Testing,
            ImageChannelView::Stable => Self::Stable,
        }
    }
}

impl From<DiskFormatView> for DiskFormat {
    fn from(f: DiskFormatView) -> Self {
        match f {
            DiskFormatView::Qcow2 => Self::Qcow2,
            DiskFormatView::Raw => Self::Raw,
            DiskFormatView::Iso => Self::Iso,
            DiskFormatView::RootfsTar => Self::RootfsTar,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageView {
    #[schemars(with = "TenantIdText")]
    pub tenant_id: String,
    #[schemars(with = "ImageIdText")]
    pub image_id: String,
    #[schemars(with = "NameText")]
    pub name: String,
    pub url: String,
    /// Lowercase hex SHA-256 of the image's bytes.
    pub sha256: String,
    pub disk_format: DiskFormatView,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// `testing` when registered, `stable` once promoted (`images.promote`).
    pub channel: ImageChannelView,
    pub version: u64,
    pub created_at_ms: u64,
}

impl From<ImageDoc> for ImageView {
    fn from(d: ImageDoc) -> Self {
        Self {
            tenant_id: d.tenant_id,
            image_id: d.image_id,
            name: d.name,
            url: d.url,
            sha256: d.sha256,
            disk_format: d.disk_format.into(),
            size_bytes: d.size_bytes,
            channel: d.channel.into(),
            version: d.version,
            created_at_ms: d.created_at_ms,
        }
    }
}

#[derive(Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageDeletedView {
    #[schemars(with = "ImageIdText")]
    pub image_id: String,
    pub deleted: bool,
}
