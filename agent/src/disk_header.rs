//! What an instance's disk says of itself in its first bytes, checked before a domain is defined
//! on it: a disk image may name other files, and QEMU opens what it names with the node's
//! rights. A qcow2 header can name a backing file (`-b /var/lib/bcd/node.key -F raw`: the guest
//! reads the node's key) or an external data file (`-o data_file=/dev/sda`: the guest writes a
//! host file), so a qcow2 disk is refused when its header names either, has an incompatible
//! feature this check does not know, or is not a qcow2 header at all; a disk registered as raw
//! is refused when it begins as an image format that can name other files (qcow, QED, VMDK,
//! VHDX), since it is not what it claims to be.
//!
//! The header is read here, not by `qemu-img info`: the check trusts no external tool and works
//! where QEMU's tools are absent. [`inspect_header`] is a pure function of the bytes;
//! [`inspect`] reads them (at most [`HEADER_READ_BYTES_MAX`]) from the copy the domain will use,
//! so nothing can change between the check and the use. The domain XML states `<backingStore/>`
//! too (`hypervisor::domain_xml`), so libvirt has QEMU open no backing chain even if one were
//! there. Errors carry the instances protocol's stable code `image-format`.

use std::path::Path;

use tokio::io::AsyncReadExt as _;

use crate::instances::DiskFormat;

/// The most of a disk read to check it: QEMU's largest qcow2 cluster (`cluster_bits` 21), so
/// the header and all its extensions (which end within the first cluster) are read.
pub const HEADER_READ_BYTES_MAX: u64 = 1 << QCOW2_CLUSTER_BITS_MAX;
/// The cluster sizes QEMU opens, as powers of two (512 B to 2 MiB).
pub const QCOW2_CLUSTER_BITS_MIN: u32 = 9;
pub const QCOW2_CLUSTER_BITS_MAX: u32 = 21;
/// The header extensions walked at most (QEMU writes a handful; a first cluster of 2 MiB holds
/// at most this many of 8 bytes each).
pub const QCOW2_EXTENSIONS_MAX: usize = (HEADER_READ_BYTES_MAX / 8) as usize;

const _: () = assert!(QCOW2_CLUSTER_BITS_MIN < QCOW2_CLUSTER_BITS_MAX);

/// `QFI\xfb`: the magic of qcow (version 1) and qcow2 (versions 2 and 3).
const QCOW_MAGIC: [u8; 4] = *b"QFI\xfb";
/// The length of a version 2 header, where its extensions begin; a version 3 header says its
/// own (`header_length`, at least [`QCOW2_V3_HEADER_BYTES_MIN`]).
const QCOW2_V2_HEADER_BYTES: usize = 72;
const QCOW2_V3_HEADER_BYTES_MIN: usize = 104;
/// The incompatible features (version 3, bits of the `u64` at byte 72) known here: dirty (0),
/// corrupt (1), external data file (2), compression type (3), extended L2 entries (4).
const INCOMPATIBLE_DIRTY: u64 = 1 << 0;
const INCOMPATIBLE_CORRUPT: u64 = 1 << 1;
const INCOMPATIBLE_DATA_FILE: u64 = 1 << 2;
const INCOMPATIBLE_COMPRESSION_TYPE: u64 = 1 << 3;
const INCOMPATIBLE_EXTENDED_L2: u64 = 1 << 4;
const INCOMPATIBLE_KNOWN: u64 =
    INCOMPATIBLE_DIRTY | INCOMPATIBLE_CORRUPT | INCOMPATIBLE_DATA_FILE | INCOMPATIBLE_COMPRESSION_TYPE | INCOMPATIBLE_EXTENDED_L2;
/// The header extension naming the external data file (`DATA`).
const EXTENSION_DATA_FILE: u32 = 0x4441_5441;
/// The header extension that ends the list.
const EXTENSION_END: u32 = 0;

/// Formats a disk registered as raw must not begin as: each can name other files.
const NAMING_FORMATS: &[(&[u8], &str)] = &[
    (&QCOW_MAGIC, "qcow"),
    (b"QED\0", "QED"),
    (b"KDMV", "VMDK"),
    (b"# Disk DescriptorFile", "VMDK descriptor"),
    (b"vhdxfile", "VHDX"),
];

/// The hint every refusal of a qcow2 ends with.
const FLATTEN_HINT: &str = "hint: register a standalone image, e.g. `qemu-img convert -O qcow2 IMAGE flat.qcow2`";

fn be_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn be_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// Whether a disk of `format` whose first bytes are `header` (as many as the file has, up to
/// [`HEADER_READ_BYTES_MAX`]) may be given to a domain; why not, in words (without the code).
pub fn inspect_header(header: &[u8], format: DiskFormat) -> Result<(), String> {
    match format {
        DiskFormat::Raw => match NAMING_FORMATS.iter().find(|(magic, _)| header.starts_with(magic)) {
            Some((_, name)) => Err(format!(
                "the image is registered as raw but is a {name} image, a format that can name other files \
                 (hint: register it as what it is, or `qemu-img convert -O raw IMAGE disk.raw`)"
            )),
            None => Ok(()),
        },
        DiskFormat::Qcow2 => inspect_qcow2(header),
        DiskFormat::RootfsTar => Err("a root file system (rootfs-tar) is a sandbox's, never a domain's disk".into()),
    }
}

fn inspect_qcow2(header: &[u8]) -> Result<(), String> {
    if !header.starts_with(&QCOW_MAGIC) {
        return Err("the image is registered as qcow2 but has no qcow2 header (its first bytes are not QFI\\xfb)".into());
    }
    let truncated = || "the image's qcow2 header is cut short".to_owned();
    let version = be_u32(header, 4).ok_or_else(truncated)?;
    if version != 2 && version != 3 {
        return Err(format!("the image is qcow version {version}; a disk is qcow2 version 2 or 3"));
    }
    let backing_file_offset = be_u64(header, 8).ok_or_else(truncated)?;
    let backing_file_size = be_u32(header, 16).ok_or_else(truncated)?;
    if backing_file_offset != 0 || backing_file_size != 0 {
        return Err(format!(
            "the qcow2 image names a backing file ({backing_file_size} bytes of name); a disk stands alone ({FLATTEN_HINT})"
        ));
    }
    let cluster_bits = be_u32(header, 20).ok_or_else(truncated)?;
    if !(QCOW2_CLUSTER_BITS_MIN..=QCOW2_CLUSTER_BITS_MAX).contains(&cluster_bits) {
        return Err(format!(
            "the qcow2 image has clusters of 2^{cluster_bits} bytes; QEMU opens 2^{QCOW2_CLUSTER_BITS_MIN} to 2^{QCOW2_CLUSTER_BITS_MAX}"
        ));
    }
    let extensions_at = if version == 2 {
        QCOW2_V2_HEADER_BYTES
    } else {
        let incompatible = be_u64(header, 72).ok_or_else(truncated)?;
        if incompatible & INCOMPATIBLE_DATA_FILE != 0 {
            return Err(format!("the qcow2 image keeps its data in an external data file; a disk stands alone ({FLATTEN_HINT})"));
        }
        if incompatible & INCOMPATIBLE_CORRUPT != 0 {
            return Err("the qcow2 image is marked corrupt (hint: `qemu-img check -r all IMAGE`, then register it again)".into());
        }
        let unknown = incompatible & !INCOMPATIBLE_KNOWN;
        if unknown != 0 {
            return Err(format!(
                "the qcow2 image has incompatible features this node does not know (bits {unknown:#x}); \
                 it may name other files ({FLATTEN_HINT})"
            ));
        }
        let header_length = be_u32(header, 100).ok_or_else(truncated)? as usize;
        if header_length < QCOW2_V3_HEADER_BYTES_MIN {
            return Err(format!("the qcow2 image's header is {header_length} bytes; version 3's has at least 104"));
        }
        header_length
    };
    // The extensions end within the first cluster: QEMU reads no further.
    let cluster_bytes = 1usize << cluster_bits;
    let first_cluster = &header[..header.len().min(cluster_bytes)];
    let mut at = extensions_at;
    for _ in 0..QCOW2_EXTENSIONS_MAX {
        let (Some(kind), Some(length)) = (be_u32(first_cluster, at), be_u32(first_cluster, at + 4)) else {
            return Err("the qcow2 image's header extensions run past its first cluster".into());
        };
        if kind == EXTENSION_END {
            return Ok(());
        }
        if kind == EXTENSION_DATA_FILE {
            return Err(format!("the qcow2 image names an external data file; a disk stands alone ({FLATTEN_HINT})"));
        }
        // The data, padded to a multiple of 8 bytes.
        let padded = (length as usize).div_ceil(8) * 8;
        at = at.saturating_add(8).saturating_add(padded);
        if at > first_cluster.len() {
            return Err("the qcow2 image's header extensions run past its first cluster".into());
        }
    }
    Err(format!("the qcow2 image has over {QCOW2_EXTENSIONS_MAX} header extensions"))
}

/// Reads the first bytes of the disk at `path` (at most [`HEADER_READ_BYTES_MAX`]) and checks
/// them ([`inspect_header`]): `image-format: …` when it may not be used, `disk: …` when it
/// cannot be read.
pub async fn inspect(path: &Path, format: DiskFormat) -> Result<(), String> {
    let mut header = Vec::new();
    let read = async {
        let file = tokio::fs::File::open(path).await?;
        file.take(HEADER_READ_BYTES_MAX).read_to_end(&mut header).await
    };
    read.await.map_err(|e| format!("disk: {}: {e}", path.display()))?;
    inspect_header(&header, format).map_err(|reason| format!("image-format: {reason}"))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::PathBuf;
    use std::process::Command;

    use super::*;

    /// Runs the real `qemu-img` with `args` in `dir`; a machine without it fails the test and
    /// says how to get it (never skips).
    pub(crate) fn qemu_img(dir: &Path, args: &[&str]) {
        let output = match Command::new("qemu-img").args(args).current_dir(dir).output() {
            Ok(output) => output,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "qemu-img is not installed: these tests build hostile images with the real one \
                 (hint: `make system-deps`, or `apt-get install qemu-utils`)"
            ),
            Err(e) => panic!("qemu-img {args:?}: {e}"),
        };
        assert!(output.status.success(), "qemu-img {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    }

    /// The images a test needs, made by `qemu-img` in a temporary directory: a host file
    /// standing for the node's key, and qcow2 images clean and hostile.
    pub(crate) struct Images {
        pub dir: tempfile::TempDir,
    }

    impl Images {
        pub(crate) fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("node.key"), b"the node's secret key").unwrap();
            Self { dir }
        }

        /// `qemu-img create -f qcow2 [options] NAME 1M`: the image's bytes.
        pub(crate) fn qcow2(&self, name: &str, options: &[&str]) -> Vec<u8> {
            let mut args = vec!["create", "-q", "-f", "qcow2"];
            args.extend_from_slice(options);
            args.extend_from_slice(&[name, "1M"]);
            qemu_img(self.dir.path(), &args);
            std::fs::read(self.path(name)).unwrap()
        }

        pub(crate) fn path(&self, name: &str) -> PathBuf {
            self.dir.path().join(name)
        }

        /// A qcow2 whose header names the host file `node.key` as its raw backing file.
        pub(crate) fn with_backing_file(&self) -> Vec<u8> {
            let key = self.path("node.key");
            self.qcow2("backed.qcow2", &["-b", key.to_str().unwrap(), "-F", "raw"])
        }

        /// A qcow2 whose data lives in the host file `host.raw`.
        pub(crate) fn with_data_file(&self) -> Vec<u8> {
            qemu_img(self.dir.path(), &["create", "-q", "-f", "raw", "host.raw", "1M"]);
            let option = format!("data_file={}", self.path("host.raw").display());
            self.qcow2("data.qcow2", &["-o", &option])
        }
    }

    fn refused(header: &[u8], format: DiskFormat) -> String {
        inspect_header(header, format).expect_err("refused")
    }

    #[test]
    fn a_standalone_qcow2_of_either_version_is_used() {
        let images = Images::new();
        inspect_header(&images.qcow2("v3.qcow2", &[]), DiskFormat::Qcow2).unwrap();
        inspect_header(&images.qcow2("v2.qcow2", &["-o", "compat=0.10"]), DiskFormat::Qcow2).unwrap();
        let extended = images.qcow2("l2.qcow2", &["-o", "extended_l2=on,cluster_size=128k,compression_type=zstd"]);
        inspect_header(&extended, DiskFormat::Qcow2).unwrap();
        inspect_header(b"a raw disk, its first sector anything", DiskFormat::Raw).unwrap();
        inspect_header(b"", DiskFormat::Raw).unwrap();
    }

    /// A qcow2 naming a host file as its backing file or data file is refused.
    #[test]
    fn a_qcow2_naming_a_backing_file_or_a_data_file_is_refused() {
        let images = Images::new();
        let backed = refused(&images.with_backing_file(), DiskFormat::Qcow2);
        assert!(backed.contains("names a backing file") && backed.contains("hint: "), "{backed}");
        assert!(!backed.contains("node.key"), "the name is not echoed: {backed}");
        let v2_backed = images.qcow2("v2b.qcow2", &["-o", "compat=0.10", "-b", "node.key", "-F", "raw"]);
        assert!(refused(&v2_backed, DiskFormat::Qcow2).contains("names a backing file"));
        let data = images.with_data_file();
        assert!(refused(&data, DiskFormat::Qcow2).contains("external data file"));
        // The extension naming the data file refuses it even without the feature bit.
        let mut named_only = data.clone();
        named_only[72..80].copy_from_slice(&0u64.to_be_bytes());
        let reason = refused(&named_only, DiskFormat::Qcow2);
        assert!(reason.contains("names an external data file"), "{reason}");
    }

    #[test]
    fn an_unknown_incompatible_feature_or_a_false_format_is_refused() {
        let images = Images::new();
        let clean = images.qcow2("v3.qcow2", &[]);
        let mut unknown = clean.clone();
        unknown[72..80].copy_from_slice(&(1u64 << 40).to_be_bytes());
        let reason = refused(&unknown, DiskFormat::Qcow2);
        assert!(reason.contains("incompatible features this node does not know (bits 0x10000000000)"), "{reason}");
        let mut corrupt = clean.clone();
        corrupt[72..80].copy_from_slice(&INCOMPATIBLE_CORRUPT.to_be_bytes());
        assert!(refused(&corrupt, DiskFormat::Qcow2).contains("marked corrupt"));
        let mut version_4 = clean.clone();
        version_4[4..8].copy_from_slice(&4u32.to_be_bytes());
        assert!(refused(&version_4, DiskFormat::Qcow2).contains("qcow version 4"));
        let mut huge_clusters = clean.clone();
        huge_clusters[20..24].copy_from_slice(&30u32.to_be_bytes());
        assert!(refused(&huge_clusters, DiskFormat::Qcow2).contains("clusters of 2^30 bytes"));
        let mut runaway = clean.clone();
        runaway[112..120].copy_from_slice(&[0x12, 0x34, 0x56, 0x78, 0xff, 0xff, 0xff, 0xf0]);
        assert!(refused(&runaway, DiskFormat::Qcow2).contains("run past its first cluster"));
        assert!(refused(&clean[..90], DiskFormat::Qcow2).contains("cut short"));

        assert!(refused(b"a raw disk", DiskFormat::Qcow2).contains("no qcow2 header"));
        assert!(refused(b"", DiskFormat::Qcow2).contains("no qcow2 header"));
        let as_raw = refused(&images.with_backing_file(), DiskFormat::Raw);
        assert!(as_raw.contains("registered as raw but is a qcow image"), "{as_raw}");
        assert!(refused(b"KDMV\x01\0\0\0", DiskFormat::Raw).contains("VMDK"));
    }

    #[tokio::test]
    async fn the_disk_is_read_from_its_file() {
        let images = Images::new();
        images.with_backing_file();
        let reason = inspect(&images.path("backed.qcow2"), DiskFormat::Qcow2).await.unwrap_err();
        assert!(reason.starts_with("image-format: the qcow2 image names a backing file"), "{reason}");
        images.qcow2("v3.qcow2", &[]);
        inspect(&images.path("v3.qcow2"), DiskFormat::Qcow2).await.unwrap();
        let missing = inspect(&images.path("nonesuch"), DiskFormat::Raw).await.unwrap_err();
        assert!(missing.starts_with("disk: "), "{missing}");
    }
}
