//! Disk images (`image/img_…`): the document, the payloads of `image.*`, and their fold.
//!
//! An image is registered by where it is fetched from and the SHA-256 its bytes must have. It is
//! registered once and deleted once: either twice, or a delete of what does not exist, is a
//! broken log, not a no-op. It is registered in the `testing` channel and promoted, once, to
//! `stable` (`image.promoted`); its bytes never change.

use bc_core::Result;
use bc_core::event::StoredEvent;
use bc_core::store::RowKey;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{NoFields, corrupt, create_once, delete_once, from_doc, payload, to_doc};

pub const IMAGE_REGISTERED: &str = "image.registered";
pub const IMAGE_DELETED: &str = "image.deleted";
pub const IMAGE_PROMOTED: &str = "image.promoted";

/// A registered disk image (`image/img_…`).
pub const KIND_IMAGE: &str = "image";

/// A registered image. Deleting it removes the document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ImageDoc {
    pub tenant_id: String,
    pub image_id: String,
    pub name: String,
    pub url: String,
    pub sha256: String,
    pub disk_format: DiskFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// `testing` when registered, `stable` once promoted.
    #[serde(default)]
    pub channel: ImageChannel,
    pub version: u64,
    pub created_at_ms: u64,
}

/// An image's release channel: registered in `testing`, promoted once to `stable`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum ImageChannel {
    #[default]
    Testing,
    Stable,
}

impl ImageChannel {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Testing => "testing",
            Self::Stable => "stable",
        }
    }
}

/// An image moved to a channel further on (today only `testing` → `stable`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImagePromoted {
    pub from: ImageChannel,
    pub to: ImageChannel,
}

/// How an image's bytes are laid out on disk.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DiskFormat {
    Qcow2,
    Raw,
    /// A bootable ISO 9660 image: what a bare-metal deploy or rescue boots through a BMC's
    /// virtual CD; never an instance's disk.
    Iso,
    /// A root file system as a tar archive (`rootfs-tar`): what a sandbox runs from, read-only
    /// under a writable layer; never an instance's disk.
    #[serde(rename = "rootfs-tar")]
    RootfsTar,
}

/// A disk image, by where it is fetched from and the SHA-256 its bytes must have.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageRegistered {
    pub name: String,
    pub url: String,
    /// Lowercase hex SHA-256 of the image's bytes.
    pub sha256: String,
    pub disk_format: DiskFormat,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

pub type ImageDeleted = NoFields;

/// Folds one `image.*` event into the row `key`; any other type leaves the row as it was.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    match event.envelope.event_type.as_str() {
        IMAGE_REGISTERED => create_once(key, &current, event, ("image", "registered"), |p: ImageRegistered, env| ImageDoc {
            tenant_id: env.tenant.to_string(),
            image_id: key.id.clone(),
            name: p.name,
            url: p.url,
            sha256: p.sha256,
            disk_format: p.disk_format,
            size_bytes: p.size_bytes,
            channel: ImageChannel::Testing,
            version: env.version,
            created_at_ms: env.at_ms,
        }),
        IMAGE_PROMOTED => {
            let p: ImagePromoted = payload(event)?;
            let mut doc: ImageDoc = from_doc(event, current)?;
            if doc.channel != p.from || p.to <= p.from {
                return Err(corrupt(
                    event,
                    format!("image {} promoted from {:?} to {:?} while in {:?}", key.id, p.from, p.to, doc.channel),
                ));
            }
            doc.channel = p.to;
            doc.version = event.envelope.version;
            to_doc(&doc)
        }
        IMAGE_DELETED => delete_once(key, current, event),
        _ => Ok(current),
    }
}
