//! Setting GPUs aside for a reservation: the [`GpuBinding`] trait, and its implementations.
//!
//! - [`Vfio`], the real one: a GPU no process uses (NVML's running processes, behind
//!   [`InUse`]) has its PCI device bound to `vfio-pci` through sysfs (`driver_override`, unbind
//!   from its driver, bind), ready for passthrough; a release undoes it (unbind from `vfio-pci`,
//!   clear the override, re-probe, so its own driver takes it back). The writes are planned by
//!   pure functions ([`bind_plan`], [`release_plan`]) and applied under a configurable sysfs root,
//!   so tests run them on a fake tree.
//! - [`Fake`] (`fakehw` builds): a fake machine's GPUs, held in name only; it can be told to
//!   refuse every hold with a reason, for tests of the failure path.
//!
//! An agent whose binding cannot bind at all (no `vfio-pci` driver, or its `bind` file not
//! writable) advertises no `gpu.hold` capability and fails holds at once as `node-unprivileged`.

use std::path::{Path, PathBuf};

/// The driver a held GPU is bound to.
pub const VFIO_DRIVER: &str = "vfio-pci";

/// One GPU of a hold: NVML's UUID and its PCI address as sysfs names it (`0000:3b:00.0`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HeldGpu {
    pub uuid: String,
    pub pci_address: String,
}

/// How GPUs are set aside on this machine. Each call is all or nothing: a hold that fails part
/// way undoes what it did.
pub trait GpuBinding: Send + Sync {
    /// `Some(reason)` when this binding cannot hold anything here (the reason says what to fix).
    fn unprivileged(&self) -> Option<String>;
    /// Sets `gpus` aside; `Err` is the reason, a stable code, a colon, and words.
    fn hold(&self, gpus: &[HeldGpu]) -> Result<(), String>;
    /// Gives `gpus` back to the machine.
    fn release(&self, gpus: &[HeldGpu]) -> Result<(), String>;
}

/// Whether a GPU is in use: NVML's running compute and graphics processes.
pub trait InUse: Send + Sync {
    fn processes(&self, uuid: &str) -> Result<u32, String>;
}

/// NVML's answer, through `nvml-wrapper`.
pub struct NvmlInUse;

impl InUse for NvmlInUse {
    fn processes(&self, uuid: &str) -> Result<u32, String> {
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| format!("NVML is not available: {e}"))?;
        let device = nvml.device_by_uuid(uuid).map_err(|e| e.to_string())?;
        let compute = device.running_compute_processes().map_err(|e| e.to_string())?.len();
        let graphics = device.running_graphics_processes().map_err(|e| e.to_string())?.len();
        Ok((compute + graphics) as u32)
    }
}

/// `00000000:3B:00.0` (NVML's bus id, 8 hex digits of domain) or `0000:3b:00.0` → sysfs's
/// `0000:3b:00.0`; `None` unless it is exactly a PCI address (it becomes a path).
pub fn pci_address(bus_id: &str) -> Option<String> {
    if !bus_id.is_ascii() {
        return None;
    }
    let bus_id = bus_id.to_ascii_lowercase();
    let (domain, rest) = bus_id.split_once(':')?;
    // NVML gives 8 hex digits of domain, sysfs 4: the extra ones must be zeros.
    let extra = domain.len().checked_sub(4)?;
    if !domain[..extra].bytes().all(|b| b == b'0') {
        return None;
    }
    let domain = &domain[extra..];
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let function_ok = function.len() == 1 && (b'0'..=b'7').contains(&function.as_bytes()[0]);
    (hex(domain, 4) && hex(bus, 2) && hex(device, 2) && function_ok).then(|| format!("{domain}:{bus}:{device}.{function}"))
}

/// One sysfs write: `value` into the file at `path` (relative to the sysfs root's parent, as
/// `sys/bus/pci/…`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Write {
    pub path: String,
    pub value: String,
}

fn device_path(address: &str, file: &str) -> String {
    format!("sys/bus/pci/devices/{address}/{file}")
}

/// The writes that bind the device at `address` to `vfio-pci`, given the driver it has now:
/// the override first (so nothing else claims it once free), then unbind from its driver, then
/// bind to `vfio-pci`. Already on `vfio-pci`: only the override.
pub fn bind_plan(address: &str, driver: Option<&str>) -> Vec<Write> {
    let mut plan = vec![Write { path: device_path(address, "driver_override"), value: VFIO_DRIVER.into() }];
    if driver == Some(VFIO_DRIVER) {
        return plan;
    }
    if driver.is_some() {
        plan.push(Write { path: device_path(address, "driver/unbind"), value: address.into() });
    }
    plan.push(Write { path: format!("sys/bus/pci/drivers/{VFIO_DRIVER}/bind"), value: address.into() });
    plan
}

/// The writes that give the device back: unbind from `vfio-pci` (if bound there), clear the
/// override (a newline), then re-probe so its own driver takes it.
pub fn release_plan(address: &str, driver: Option<&str>) -> Vec<Write> {
    let mut plan = Vec::new();
    if driver == Some(VFIO_DRIVER) {
        plan.push(Write { path: format!("sys/bus/pci/drivers/{VFIO_DRIVER}/unbind"), value: address.into() });
    }
    plan.push(Write { path: device_path(address, "driver_override"), value: "\n".into() });
    plan.push(Write { path: "sys/bus/pci/drivers_probe".into(), value: address.into() });
    plan
}

/// The real binding: `vfio-pci` through sysfs under `root` (`/` on a real machine).
pub struct Vfio {
    pub root: PathBuf,
    pub in_use: Box<dyn InUse>,
}

impl Vfio {
    fn at(&self, path: &str) -> PathBuf {
        self.root.join(path)
    }

    /// The driver the device is bound to now (the name its `driver` link points at).
    pub fn driver(&self, address: &str) -> Option<String> {
        std::fs::read_link(self.at(&device_path(address, "driver")))
            .ok()
            .and_then(|target| target.file_name().map(|n| n.to_string_lossy().into_owned()))
    }

    fn apply(&self, plan: &[Write]) -> Result<(), String> {
        for write in plan {
            write_sysfs(&self.at(&write.path), &write.value)
                .map_err(|e| format!("vfio-bind-failed: writing {:?} to /{}: {e}", write.value.trim(), write.path))?;
        }
        Ok(())
    }

    fn bind_one(&self, gpu: &HeldGpu) -> Result<(), String> {
        if !self.at(&format!("sys/bus/pci/devices/{}", gpu.pci_address)).exists() {
            return Err(format!("gpu-missing: no PCI device {} for {}", gpu.pci_address, gpu.uuid));
        }
        let plan = bind_plan(&gpu.pci_address, self.driver(&gpu.pci_address).as_deref());
        self.apply(&plan)
    }

    fn release_one(&self, gpu: &HeldGpu) -> Result<(), String> {
        let plan = release_plan(&gpu.pci_address, self.driver(&gpu.pci_address).as_deref());
        self.apply(&plan)
    }
}

/// Writes `value` to a sysfs attribute: one `write(2)` on the existing file, never created.
fn write_sysfs(path: &Path, value: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new().write(true).truncate(true).open(path)?;
    file.write_all(value.as_bytes())
}

impl GpuBinding for Vfio {
    fn unprivileged(&self) -> Option<String> {
        let bind = self.at(&format!("sys/bus/pci/drivers/{VFIO_DRIVER}/bind"));
        if !bind.exists() {
            return Some(format!(
                "node-unprivileged: {} does not exist (load the driver: modprobe vfio-pci)",
                Path::new("/").join(bind.strip_prefix(&self.root).unwrap_or(&bind)).display()
            ));
        }
        match std::fs::OpenOptions::new().write(true).open(&bind) {
            Ok(_) => None,
            Err(e) => {
                Some(format!("node-unprivileged: cannot write /sys/bus/pci/drivers/{VFIO_DRIVER}/bind ({e}; run bcd as root)"))
            }
        }
    }

    fn hold(&self, gpus: &[HeldGpu]) -> Result<(), String> {
        if let Some(reason) = self.unprivileged() {
            return Err(reason);
        }
        for gpu in gpus {
            // On vfio-pci already (held before): no driver of the host can be using it.
            if self.driver(&gpu.pci_address).as_deref() == Some(VFIO_DRIVER) {
                continue;
            }
            match self.in_use.processes(&gpu.uuid) {
                Ok(0) => {}
                Ok(n) => return Err(format!("gpu-in-use: {} runs {n} processes", gpu.uuid)),
                Err(e) => return Err(format!("gpu-check-failed: {}: {e}", gpu.uuid)),
            }
        }
        for (done, gpu) in gpus.iter().enumerate() {
            if let Err(reason) = self.bind_one(gpu) {
                // All or nothing: give back what this hold bound.
                for bound in &gpus[..=done] {
                    if let Err(e) = self.release_one(bound) {
                        tracing::error!(gpu = %bound.uuid, error = %e, "undoing a partial hold failed");
                    }
                }
                return Err(reason);
            }
        }
        Ok(())
    }

    fn release(&self, gpus: &[HeldGpu]) -> Result<(), String> {
        let mut failed = Vec::new();
        for gpu in gpus {
            if let Err(e) = self.release_one(gpu) {
                failed.push(e);
            }
        }
        if failed.is_empty() { Ok(()) } else { Err(failed.join("; ")) }
    }
}

/// A fake machine's binding (`fakehw` builds): holds succeed in name only, or all fail with
/// `refuse` (`[hardware] fake_hold_refusal`).
#[cfg(feature = "fakehw")]
pub struct Fake {
    pub refuse: Option<String>,
}

#[cfg(feature = "fakehw")]
impl GpuBinding for Fake {
    fn unprivileged(&self) -> Option<String> {
        None
    }

    fn hold(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
        match &self.refuse {
            Some(reason) => Err(reason.clone()),
            None => Ok(()),
        }
    }

    fn release(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
        Ok(())
    }
}

/// The binding a configuration names: the fake machine's (fakehw builds, with a fake seed),
/// else `vfio-pci` under the sysfs root.
pub fn binding(root: Option<&Path>, fake_seed: Option<u64>, fake_refusal: Option<String>) -> Box<dyn GpuBinding> {
    #[cfg(feature = "fakehw")]
    if fake_seed.is_some() {
        return Box::new(Fake { refuse: fake_refusal });
    }
    let _ = (fake_seed, fake_refusal);
    Box::new(Vfio { root: root.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("/")), in_use: Box::new(NvmlInUse) })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Processes(u32);

    impl InUse for Processes {
        fn processes(&self, _uuid: &str) -> Result<u32, String> {
            Ok(self.0)
        }
    }

    /// A sysfs tree: `vfio-pci` and `nvidia` drivers, and two GPUs bound to `nvidia`.
    fn tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let pci = dir.path().join("sys/bus/pci");
        for driver in ["nvidia", VFIO_DRIVER] {
            std::fs::create_dir_all(pci.join("drivers").join(driver)).unwrap();
            for file in ["bind", "unbind"] {
                std::fs::write(pci.join("drivers").join(driver).join(file), "").unwrap();
            }
        }
        std::fs::write(pci.join("drivers_probe"), "").unwrap();
        for address in ["0000:3b:00.0", "0000:5e:00.0"] {
            let device = pci.join("devices").join(address);
            std::fs::create_dir_all(&device).unwrap();
            std::fs::write(device.join("driver_override"), "(null)\n").unwrap();
            std::os::unix::fs::symlink("../../drivers/nvidia", device.join("driver")).unwrap();
        }
        dir
    }

    fn gpu(uuid: &str, address: &str) -> HeldGpu {
        HeldGpu { uuid: uuid.into(), pci_address: address.into() }
    }

    fn read(dir: &Path, path: &str) -> String {
        std::fs::read_to_string(dir.join(path)).unwrap()
    }

    #[test]
    fn pci_addresses_from_nvml_and_sysfs_and_nothing_else() {
        assert_eq!(pci_address("00000000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(pci_address("0000:5e:00.1").as_deref(), Some("0000:5e:00.1"));
        for bad in [
            "",
            "é000:3b:00.0",
            "000é:3b:00.0",
            "3b:00.0",
            "0000:3b:00.8",
            "0000:3b:00.0/../x",
            "10000000:3b:00.0",
            "0000:3g:00.0",
            "../../0:00:00.0",
        ] {
            assert_eq!(pci_address(bad), None, "{bad:?}");
        }
    }

    /// The order matters: the override first (so no driver claims the device once free), then
    /// unbind from its driver, then bind to vfio-pci; a release undoes it in reverse.
    #[test]
    fn the_plans_write_the_right_files_in_the_right_order() {
        let a = "0000:3b:00.0";
        let paths = |plan: Vec<Write>| plan.into_iter().map(|w| (w.path, w.value)).collect::<Vec<_>>();
        assert_eq!(
            paths(bind_plan(a, Some("nvidia"))),
            [
                (format!("sys/bus/pci/devices/{a}/driver_override"), "vfio-pci".to_owned()),
                (format!("sys/bus/pci/devices/{a}/driver/unbind"), a.to_owned()),
                ("sys/bus/pci/drivers/vfio-pci/bind".to_owned(), a.to_owned()),
            ]
        );
        assert_eq!(paths(bind_plan(a, None)).len(), 2, "no driver: nothing to unbind");
        assert_eq!(paths(bind_plan(a, Some(VFIO_DRIVER))).len(), 1, "already on vfio-pci");
        assert_eq!(
            paths(release_plan(a, Some(VFIO_DRIVER))),
            [
                ("sys/bus/pci/drivers/vfio-pci/unbind".to_owned(), a.to_owned()),
                (format!("sys/bus/pci/devices/{a}/driver_override"), "\n".to_owned()),
                ("sys/bus/pci/drivers_probe".to_owned(), a.to_owned()),
            ]
        );
    }

    #[test]
    fn a_hold_binds_to_vfio_on_a_fake_tree_and_a_release_undoes_it() {
        let dir = tree();
        let vfio = Vfio { root: dir.path().to_path_buf(), in_use: Box::new(Processes(0)) };
        assert_eq!(vfio.unprivileged(), None);
        let gpus = [gpu("GPU-a", "0000:3b:00.0"), gpu("GPU-b", "0000:5e:00.0")];
        vfio.hold(&gpus).unwrap();
        let d = dir.path();
        assert_eq!(read(d, "sys/bus/pci/devices/0000:5e:00.0/driver_override"), "vfio-pci");
        // The driver link points at nvidia in the fake tree: its unbind got the address.
        assert_eq!(read(d, "sys/bus/pci/drivers/nvidia/unbind"), "0000:5e:00.0");
        assert_eq!(read(d, "sys/bus/pci/drivers/vfio-pci/bind"), "0000:5e:00.0");

        // As the kernel would: the device is now vfio-pci's.
        for address in ["0000:3b:00.0", "0000:5e:00.0"] {
            let link = d.join(format!("sys/bus/pci/devices/{address}/driver"));
            std::fs::remove_file(&link).unwrap();
            std::os::unix::fs::symlink("../../drivers/vfio-pci", &link).unwrap();
        }
        // Holding again (a redelivery after a crash) writes only the override.
        std::fs::write(d.join("sys/bus/pci/drivers/vfio-pci/bind"), "").unwrap();
        vfio.hold(&gpus).unwrap();
        assert_eq!(read(d, "sys/bus/pci/drivers/vfio-pci/bind"), "", "not bound twice");
        vfio.release(&gpus[..1]).unwrap();
        assert_eq!(read(d, "sys/bus/pci/drivers/vfio-pci/unbind"), "0000:3b:00.0");
        assert_eq!(read(d, "sys/bus/pci/devices/0000:3b:00.0/driver_override"), "\n");
        assert_eq!(read(d, "sys/bus/pci/drivers_probe"), "0000:3b:00.0");
        assert_eq!(read(d, "sys/bus/pci/devices/0000:5e:00.0/driver_override"), "vfio-pci", "the other GPU stays held");
    }

    #[test]
    fn a_gpu_in_use_is_refused_and_nothing_is_written() {
        let dir = tree();
        let vfio = Vfio { root: dir.path().to_path_buf(), in_use: Box::new(Processes(2)) };
        let reason = vfio.hold(&[gpu("GPU-a", "0000:3b:00.0")]).unwrap_err();
        assert!(reason.starts_with("gpu-in-use:"), "{reason}");
        assert_eq!(read(dir.path(), "sys/bus/pci/devices/0000:3b:00.0/driver_override"), "(null)\n");
        assert_eq!(read(dir.path(), "sys/bus/pci/drivers/vfio-pci/bind"), "");
    }

    #[test]
    fn a_hold_that_fails_part_way_gives_back_what_it_bound() {
        let dir = tree();
        let vfio = Vfio { root: dir.path().to_path_buf(), in_use: Box::new(Processes(0)) };
        let reason = vfio.hold(&[gpu("GPU-a", "0000:3b:00.0"), gpu("GPU-c", "0000:99:00.0")]).unwrap_err();
        assert!(reason.starts_with("gpu-missing:"), "{reason}");
        assert_eq!(read(dir.path(), "sys/bus/pci/devices/0000:3b:00.0/driver_override"), "\n", "the first was undone");
        assert_eq!(read(dir.path(), "sys/bus/pci/drivers_probe"), "0000:3b:00.0");
    }

    #[test]
    fn without_vfio_pci_the_node_is_unprivileged() {
        let dir = tempfile::tempdir().unwrap();
        let vfio = Vfio { root: dir.path().to_path_buf(), in_use: Box::new(Processes(0)) };
        let reason = vfio.unprivileged().unwrap();
        assert!(reason.starts_with("node-unprivileged:") && reason.contains("modprobe vfio-pci"), "{reason}");
        assert!(vfio.hold(&[gpu("GPU-a", "0000:3b:00.0")]).unwrap_err().starts_with("node-unprivileged:"));
    }
}
