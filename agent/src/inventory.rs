//! What the machine holds: its GPUs (from NVML), and the host (from `/proc` and `/sys`). Each
//! source sits behind a trait; the NVML source is itself written over [`GpuLibrary`], the handful
//! of NVML calls it makes, so the grouping into NVLink domains is tested without a driver. No
//! driver or no library means no GPUs and the reason, never a crash.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// NVLink links per GPU that NVML numbers (NVML_NVLINK_MAX_LINKS).
pub const NVLINK_LINKS_MAX: u32 = 18;
/// GPUs read at most (a node carries at most 64).
pub const GPUS_MAX: u32 = 64;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    /// `H100`, from the name NVML gives (`NVIDIA H100 80GB HBM3`).
    pub model: String,
    /// NVML's name, as a product id (`NVIDIA-H100-80GB-HBM3`).
    pub product: String,
    #[serde(rename = "vramGiB")]
    pub vram_gib: u32,
    pub pci_bus_id: String,
    /// GPUs joined by NVLink share a domain (numbered from 0 in index order).
    pub nvlink_domain: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuInventory {
    pub gpus: Vec<GpuInfo>,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    /// Why there are no GPUs, when NVML could not be used.
    pub unavailable: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Disk {
    pub name: String,
    pub bytes: u64,
    pub rotational: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HostInfo {
    pub cpu_model: Option<String>,
    pub cpus: u32,
    #[serde(rename = "memoryKiB")]
    pub memory_kib: u64,
    pub disks: Vec<Disk>,
    pub vendor: Option<String>,
    pub product: Option<String>,
    /// Readable by root only on most machines; absent otherwise.
    pub serial: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Inventory {
    pub gpus: GpuInventory,
    pub host: HostInfo,
}

/// A source of what the machine holds.
pub trait InventorySource: Send + Sync {
    fn read(&self) -> Inventory;
}

/// The NVML calls the GPU inventory makes.
pub trait GpuLibrary {
    fn device_count(&self) -> Result<u32, String>;
    fn uuid(&self, index: u32) -> Result<String, String>;
    fn name(&self, index: u32) -> Result<String, String>;
    fn memory_total_bytes(&self, index: u32) -> Result<u64, String>;
    fn pci_bus_id(&self, index: u32) -> Result<String, String>;
    /// The PCI bus id at the other end of an active NVLink link, if any.
    fn nvlink_remote(&self, index: u32, link: u32) -> Option<String>;
    fn driver_version(&self) -> Option<String>;
    fn cuda_version(&self) -> Option<String>;
}

/// Reads the GPUs through `library`; a GPU that cannot be read is left out and the reason said.
pub fn gpus_from(library: &dyn GpuLibrary) -> GpuInventory {
    let count = match library.device_count() {
        Ok(n) => n.min(GPUS_MAX),
        Err(e) => return GpuInventory { unavailable: Some(e), ..Default::default() },
    };
    let mut gpus = Vec::new();
    let mut problems = Vec::new();
    let mut links: Vec<(usize, String)> = Vec::new();
    for index in 0..count {
        let read = || -> Result<GpuInfo, String> {
            let name = library.name(index)?;
            Ok(GpuInfo {
                index,
                uuid: library.uuid(index)?,
                model: model_of(&name),
                product: product_of(&name),
                vram_gib: (library.memory_total_bytes(index)? / (1 << 30)).max(1) as u32,
                pci_bus_id: library.pci_bus_id(index)?.to_ascii_lowercase(),
                nvlink_domain: 0,
            })
        };
        match read() {
            Ok(gpu) => {
                for link in 0..NVLINK_LINKS_MAX {
                    if let Some(remote) = library.nvlink_remote(index, link) {
                        links.push((gpus.len(), remote.to_ascii_lowercase()));
                    }
                }
                gpus.push(gpu);
            }
            Err(e) => problems.push(format!("GPU {index}: {e}")),
        }
    }
    assign_domains(&mut gpus, &links);
    GpuInventory {
        gpus,
        driver_version: library.driver_version(),
        cuda_version: library.cuda_version(),
        unavailable: (!problems.is_empty()).then(|| problems.join("; ")),
    }
}

/// Union-find over NVLink links (to peers by bus id; links to an NVSwitch join nothing here),
/// then domains numbered by their lowest GPU index.
fn assign_domains(gpus: &mut [GpuInfo], links: &[(usize, String)]) {
    let mut parent: Vec<usize> = (0..gpus.len()).collect();
    fn root(parent: &mut [usize], mut i: usize) -> usize {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    let by_bus: BTreeMap<String, usize> = gpus.iter().enumerate().map(|(i, g)| (g.pci_bus_id.clone(), i)).collect();
    for (from, remote) in links {
        if let Some(&to) = by_bus.get(remote) {
            let (a, b) = (root(&mut parent, *from), root(&mut parent, to));
            parent[a.max(b)] = a.min(b);
        }
    }
    let mut numbers: BTreeMap<usize, u32> = BTreeMap::new();
    for (i, gpu) in gpus.iter_mut().enumerate() {
        let r = root(&mut parent, i);
        let next = numbers.len() as u32;
        gpu.nvlink_domain = *numbers.entry(r).or_insert(next);
    }
}

/// `NVIDIA H100 80GB HBM3` → `H100`.
fn model_of(name: &str) -> String {
    let word = name.split_whitespace().find(|w| w.chars().any(|c| c.is_ascii_digit()) && *w != "NVIDIA").unwrap_or("GPU");
    clean(word)
}

/// `NVIDIA H100 80GB HBM3` → `NVIDIA-H100-80GB-HBM3`.
fn product_of(name: &str) -> String {
    clean(&name.split_whitespace().collect::<Vec<_>>().join("-"))
}

/// Only `A-Z a-z 0-9 - . _`, at most 63, starting with a letter or digit (the API's GPU names).
fn clean(text: &str) -> String {
    let cleaned: String = text.chars().filter(|c| c.is_ascii_alphanumeric() || "-._".contains(*c)).take(63).collect();
    let trimmed = cleaned.trim_start_matches(['-', '.', '_']);
    if trimmed.is_empty() { "GPU".into() } else { trimmed.to_owned() }
}

/// NVML through `nvml-wrapper`, which loads `libnvidia-ml.so.1` at run time.
pub struct Nvml;

impl Nvml {
    pub fn read() -> GpuInventory {
        match nvml_wrapper::Nvml::init() {
            Ok(nvml) => gpus_from(&NvmlLibrary(nvml)),
            Err(e) => GpuInventory { unavailable: Some(format!("NVML is not available: {e}")), ..Default::default() },
        }
    }
}

struct NvmlLibrary(nvml_wrapper::Nvml);

impl GpuLibrary for NvmlLibrary {
    fn device_count(&self) -> Result<u32, String> {
        self.0.device_count().map_err(|e| e.to_string())
    }
    fn uuid(&self, index: u32) -> Result<String, String> {
        self.0.device_by_index(index).and_then(|d| d.uuid()).map_err(|e| e.to_string())
    }
    fn name(&self, index: u32) -> Result<String, String> {
        self.0.device_by_index(index).and_then(|d| d.name()).map_err(|e| e.to_string())
    }
    fn memory_total_bytes(&self, index: u32) -> Result<u64, String> {
        self.0.device_by_index(index).and_then(|d| d.memory_info()).map(|m| m.total).map_err(|e| e.to_string())
    }
    fn pci_bus_id(&self, index: u32) -> Result<String, String> {
        self.0.device_by_index(index).and_then(|d| d.pci_info()).map(|p| p.bus_id).map_err(|e| e.to_string())
    }
    fn nvlink_remote(&self, index: u32, link: u32) -> Option<String> {
        let device = self.0.device_by_index(index).ok()?;
        let wrapper = device.link_wrapper_for(link);
        if !wrapper.is_active().ok()? {
            return None;
        }
        wrapper.remote_pci_info().ok().map(|p| p.bus_id)
    }
    fn driver_version(&self) -> Option<String> {
        self.0.sys_driver_version().ok()
    }
    fn cuda_version(&self) -> Option<String> {
        self.0.sys_cuda_driver_version().ok().map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
    }
}

/// The host, from `/proc` and `/sys` under `root` (`/` on a real machine; a fake tree in tests).
pub struct Host {
    pub root: PathBuf,
}

impl Host {
    fn read_text(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(self.root.join(path.trim_start_matches('/')))
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty())
    }

    pub fn read(&self) -> HostInfo {
        let cpuinfo = self.read_text("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|l| l.trim_start_matches([' ', '\t', ':']).trim().to_owned());
        let cpus = cpuinfo.lines().filter(|l| l.starts_with("processor")).count() as u32;
        let memory_kib = self
            .read_text("/proc/meminfo")
            .and_then(|m| {
                m.lines().find_map(|l| l.strip_prefix("MemTotal:")).and_then(|v| v.split_whitespace().next()?.parse().ok())
            })
            .unwrap_or(0);
        let mut disks = Vec::new();
        if let Ok(entries) = std::fs::read_dir(self.root.join("sys/block")) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if ["loop", "ram", "zram", "dm-", "sr"].iter().any(|p| name.starts_with(p)) {
                    continue;
                }
                let sectors: u64 = self.read_text(&format!("/sys/block/{name}/size")).and_then(|s| s.parse().ok()).unwrap_or(0);
                let rotational = self.read_text(&format!("/sys/block/{name}/queue/rotational")).as_deref() == Some("1");
                disks.push(Disk { name, bytes: sectors * 512, rotational });
            }
        }
        disks.sort_by(|a, b| a.name.cmp(&b.name));
        HostInfo {
            cpu_model,
            cpus,
            memory_kib,
            disks,
            vendor: self.read_text("/sys/class/dmi/id/sys_vendor"),
            product: self.read_text("/sys/class/dmi/id/product_name"),
            serial: self.read_text("/sys/class/dmi/id/product_serial"),
        }
    }
}

/// The real hardware: NVML and the host under `root`.
pub struct HostInventory {
    pub root: PathBuf,
}

impl InventorySource for HostInventory {
    fn read(&self) -> Inventory {
        Inventory { gpus: Nvml::read(), host: Host { root: self.root.clone() }.read() }
    }
}

/// A seeded fake machine (`--fake-hw SEED`, `fakehw` builds): 0, 2, 4 or 8 GPUs of a model the
/// seed picks, in NVLink pairs or one domain.
#[cfg(feature = "fakehw")]
pub struct Fake {
    pub seed: u64,
}

#[cfg(feature = "fakehw")]
impl InventorySource for Fake {
    fn read(&self) -> Inventory {
        let mut rng = crate::session::SeededRng(self.seed);
        use crate::session::Rng;
        let pick = |rng: &mut crate::session::SeededRng, n: usize| (rng.next_unit() * n as f64) as usize % n;
        let count = [0u32, 2, 4, 8][pick(&mut rng, 4)];
        let (model, product, vram) =
            [("H100", "NVIDIA-H100-80GB-HBM3", 80), ("A100", "NVIDIA-A100-SXM4-40GB", 40), ("L40S", "NVIDIA-L40S", 48)]
                [pick(&mut rng, 3)];
        let paired = pick(&mut rng, 2) == 0;
        let gpus = (0..count)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-{:08x}-{:04x}-fake-{index:04}", self.seed as u32, (self.seed >> 32) as u16),
                model: model.into(),
                product: product.into(),
                vram_gib: vram,
                pci_bus_id: format!("00000000:{:02x}:00.0", 0x10 + index),
                nvlink_domain: if paired { index / 2 } else { 0 },
            })
            .collect();
        Inventory {
            gpus: GpuInventory {
                gpus,
                driver_version: Some("550.54.15".into()),
                cuda_version: Some("12.4".into()),
                unavailable: None,
            },
            host: HostInfo {
                cpu_model: Some("Fake CPU @ 3.00GHz".into()),
                cpus: 16 << pick(&mut rng, 3),
                memory_kib: 64 * 1024 * 1024,
                disks: vec![Disk { name: "nvme0n1".into(), bytes: 1 << 40, rotational: false }],
                vendor: Some("Better Compute".into()),
                product: Some("fakehw".into()),
                serial: Some(format!("FAKE{:010}", self.seed)),
            },
        }
    }
}

/// The source a configuration names: the fake machine of `fake_seed` (fakehw builds), else
/// this machine under `root` (default `/`).
pub fn source(root: Option<&Path>, fake_seed: Option<u64>) -> Result<Box<dyn InventorySource>, String> {
    if let Some(seed) = fake_seed {
        #[cfg(feature = "fakehw")]
        return Ok(Box::new(Fake { seed }));
        #[cfg(not(feature = "fakehw"))]
        return Err(format!("a fake machine (seed {seed}) needs a fakehw build"));
    }
    Ok(Box::new(HostInventory { root: root.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/")) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake NVML: four GPUs; 0–1 and 2–3 joined by NVLink; GPU 2's link to an NVSwitch.
    struct FakeLibrary {
        fail_count: bool,
    }

    impl GpuLibrary for FakeLibrary {
        fn device_count(&self) -> Result<u32, String> {
            if self.fail_count { Err("NVML is not available: libnvidia-ml.so.1 not found".into()) } else { Ok(4) }
        }
        fn uuid(&self, i: u32) -> Result<String, String> {
            Ok(format!("GPU-{i}"))
        }
        fn name(&self, _: u32) -> Result<String, String> {
            Ok("NVIDIA H100 80GB HBM3".into())
        }
        fn memory_total_bytes(&self, _: u32) -> Result<u64, String> {
            Ok(81_559_191_552)
        }
        fn pci_bus_id(&self, i: u32) -> Result<String, String> {
            Ok(format!("00000000:{:02X}:00.0", 0x10 + i))
        }
        fn nvlink_remote(&self, i: u32, link: u32) -> Option<String> {
            match (i, link) {
                (0, 0) => Some("00000000:11:00.0".into()),
                (1, 3) => Some("00000000:10:00.0".into()),
                (3, 1) => Some("00000000:12:00.0".into()),
                (2, 5) => Some("00000000:FF:00.0".into()),
                _ => None,
            }
        }
        fn driver_version(&self) -> Option<String> {
            Some("550.54.15".into())
        }
        fn cuda_version(&self) -> Option<String> {
            Some("12.4".into())
        }
    }

    #[test]
    fn gpus_are_read_and_grouped_into_nvlink_domains() {
        let inventory = gpus_from(&FakeLibrary { fail_count: false });
        assert_eq!(inventory.unavailable, None);
        let domains: Vec<u32> = inventory.gpus.iter().map(|g| g.nvlink_domain).collect();
        assert_eq!(domains, [0, 0, 1, 1]);
        let first = &inventory.gpus[0];
        assert_eq!((first.model.as_str(), first.product.as_str(), first.vram_gib), ("H100", "NVIDIA-H100-80GB-HBM3", 75));
        assert_eq!(first.pci_bus_id, "00000000:10:00.0");
    }

    #[test]
    fn no_library_means_no_gpus_and_the_reason() {
        let inventory = gpus_from(&FakeLibrary { fail_count: true });
        assert!(inventory.gpus.is_empty());
        assert!(inventory.unavailable.unwrap().contains("not found"));
    }

    #[test]
    fn the_host_is_read_from_a_fake_tree() {
        let root = tempfile::tempdir().unwrap();
        let write = |path: &str, text: &str| {
            let path = root.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("proc/cpuinfo", "processor\t: 0\nmodel name\t: Test CPU\nprocessor\t: 1\nmodel name\t: Test CPU\n");
        write("proc/meminfo", "MemTotal:       16384 kB\nMemFree: 1 kB\n");
        write("sys/block/nvme0n1/size", "2048\n");
        write("sys/block/nvme0n1/queue/rotational", "0\n");
        write("sys/block/loop0/size", "8\n");
        write("sys/class/dmi/id/sys_vendor", "Acme\n");
        let host = Host { root: root.path().to_path_buf() }.read();
        assert_eq!(host.cpu_model.as_deref(), Some("Test CPU"));
        assert_eq!((host.cpus, host.memory_kib), (2, 16384));
        assert_eq!(host.disks, vec![Disk { name: "nvme0n1".into(), bytes: 2048 * 512, rotational: false }]);
        assert_eq!((host.vendor.as_deref(), host.serial), (Some("Acme"), None));
    }
}
