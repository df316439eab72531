//! Instances made real: the [`Hypervisor`] trait the agent defines, starts, stops, resizes and
//! deletes domains through, and reads their real state back from.
//!
//! - [`Libvirt`] (the `libvirt` feature, which `make test` builds): libvirt through `virt`,
//!   libvirt's own binding, on a connection URI (`qemu:///system` on a host; the tests use
//!   libvirt's `test:///default` driver, which needs no daemon).
//! - [`Fake`]: domains in memory, for the simulator and fake machines.
//!
//! The domain is described by [`DomainSpec`] and written as libvirt domain XML by the pure
//! [`domain_xml`]: the held GPUs become `hostdev` PCI passthrough devices at their sysfs
//! addresses (`managed='no'`: the agent's hold already bound them to `vfio-pci`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::binding::HeldGpu;

/// The most vCPUs and memory one domain is given (a guard against a bad request, not a
/// capacity check: the flavor is checked by the control plane).
pub const VCPUS_MAX: u32 = 1024;
pub const MEMORY_MIB_MAX: u64 = 16 * 1024 * 1024;

/// What a domain is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainSpec {
    /// The instance id (`inst_…`): the domain's name.
    pub name: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    /// The boot disk, a file on the host, if any.
    pub disk_path: Option<String>,
    /// `qcow2` or `raw`.
    pub disk_format: String,
    /// Passed through whole.
    pub gpus: Vec<HeldGpu>,
}

/// A domain's state as the hypervisor reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DomainState {
    Running,
    Paused,
    /// Shutting down.
    Stopping,
    Stopped,
    Crashed,
    /// A state this version does not name.
    Other,
}

impl DomainState {
    /// Its name in `instance.observed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Paused => "paused",
            Self::Stopping => "stopping",
            Self::Stopped => "stopped",
            Self::Crashed => "crashed",
            Self::Other => "other",
        }
    }
}

/// What the hypervisor says of one domain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub state: DomainState,
    pub vcpus: u32,
    pub memory_mib: u64,
}

pub trait Hypervisor: Send + Sync {
    /// Defines (or redefines, for a domain not running) the domain.
    fn define(&self, spec: &DomainSpec) -> Result<(), String>;
    fn start(&self, name: &str) -> Result<(), String>;
    /// Stops it: an ACPI shutdown, or at once with `force`.
    fn stop(&self, name: &str, force: bool) -> Result<(), String>;
    /// Removes the definition (a running domain is stopped first).
    fn delete(&self, name: &str) -> Result<(), String>;
    /// `None`: no such domain.
    fn observe(&self, name: &str) -> Result<Option<Observed>, String>;
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('\'', "&apos;").replace('"', "&quot;")
}

/// The libvirt domain XML of `spec` for the domain type `kind` (`kvm`; libvirt's test driver
/// takes `test`): the vCPUs and memory, the disk as virtio with an empty `<backingStore/>` (QEMU
/// opens no backing file, whatever the image's header names; `disk_header` refuses such an
/// image before this), and each GPU as a PCI `hostdev` at its address.
pub fn domain_xml(spec: &DomainSpec, kind: &str) -> Result<String, String> {
    if spec.vcpus == 0 || spec.vcpus > VCPUS_MAX || spec.memory_mib == 0 || spec.memory_mib > MEMORY_MIB_MAX {
        return Err(format!("a domain has 1 to {VCPUS_MAX} vCPUs and 1 to {MEMORY_MIB_MAX} MiB"));
    }
    let mut xml = format!(
        "<domain type='{kind}'>\n  <name>{}</name>\n  <memory unit='MiB'>{}</memory>\n  <vcpu>{}</vcpu>\n  <os>\n    <type arch='x86_64'>hvm</type>\n  </os>\n  <devices>\n",
        escape(&spec.name),
        spec.memory_mib,
        spec.vcpus
    );
    if let Some(path) = &spec.disk_path {
        let format = match spec.disk_format.as_str() {
            "qcow2" | "raw" => spec.disk_format.as_str(),
            other => return Err(format!("disk format {other:?}: qcow2 or raw")),
        };
        xml.push_str(&format!(
            "    <disk type='file' device='disk'>\n      <driver name='qemu' type='{format}'/>\n      <source file='{}'/>\n      <backingStore/>\n      <target dev='vda' bus='virtio'/>\n    </disk>\n",
            escape(path)
        ));
    }
    for gpu in &spec.gpus {
        let (domain, rest) = gpu.pci_address.split_once(':').ok_or("a GPU without a PCI address")?;
        let (bus, rest) = rest.split_once(':').ok_or("a GPU without a PCI address")?;
        let (slot, function) = rest.split_once('.').ok_or("a GPU without a PCI address")?;
        xml.push_str(&format!(
            "    <hostdev mode='subsystem' type='pci' managed='no'>\n      <source>\n        <address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/>\n      </source>\n    </hostdev>\n"
        ));
    }
    xml.push_str("  </devices>\n</domain>\n");
    Ok(xml)
}

/// The hypervisor `config` names: libvirt at `[hypervisor] uri`; else, on a fake machine
/// (`[hardware] fake_seed`), the in-memory [`Fake`]; else none (the node runs no instances).
pub fn for_config(config: &crate::config::Config) -> Result<Option<Box<dyn Hypervisor>>, String> {
    match (&config.hypervisor.uri, config.hardware.fake_seed) {
        #[cfg(feature = "libvirt")]
        (Some(uri), _) => Ok(Some(Box::new(Libvirt::open(uri)?))),
        #[cfg(not(feature = "libvirt"))]
        (Some(_), _) => Err(crate::config::HYPERVISOR_NEEDS_LIBVIRT.into()),
        (None, Some(_)) => Ok(Some(match config.hardware.fake_domain_crash_after {
            Some(after) => Box::new(Fake::crashing_after(after)),
            None => Box::new(Fake::default()),
        })),
        (None, None) => Ok(None),
    }
}

/// Domains in memory: what the simulator and fake machines run instances on.
#[derive(Default)]
pub struct Fake {
    domains: Mutex<BTreeMap<String, (DomainSpec, DomainState)>>,
    /// A running domain crashes when it has been observed this many times since it was last
    /// started (`[hardware] fake_domain_crash_after`), to exercise a domain that fails behind
    /// the agent's back. Counted in observations, not time, so a run is the same every time.
    crash_after: Option<u32>,
    observed_running: Mutex<BTreeMap<String, u32>>,
}

impl Fake {
    /// A fake whose running domains crash after `observations` looks (see [`Fake::crash_after`]).
    pub fn crashing_after(observations: u32) -> Self {
        Self { crash_after: Some(observations.max(1)), ..Self::default() }
    }
}

impl Hypervisor for Fake {
    fn define(&self, spec: &DomainSpec) -> Result<(), String> {
        domain_xml(spec, "kvm")?;
        let mut domains = self.domains.lock().expect("fake hypervisor");
        let state = match domains.get(&spec.name) {
            Some((_, DomainState::Running)) => return Err(format!("domain {} is running", spec.name)),
            Some((_, state)) => *state,
            None => DomainState::Stopped,
        };
        domains.insert(spec.name.clone(), (spec.clone(), state));
        Ok(())
    }

    fn start(&self, name: &str) -> Result<(), String> {
        let mut domains = self.domains.lock().expect("fake hypervisor");
        let (_, state) = domains.get_mut(name).ok_or_else(|| format!("no domain {name}"))?;
        *state = DomainState::Running;
        self.observed_running.lock().expect("fake hypervisor").remove(name);
        Ok(())
    }

    fn stop(&self, name: &str, _force: bool) -> Result<(), String> {
        let mut domains = self.domains.lock().expect("fake hypervisor");
        let (_, state) = domains.get_mut(name).ok_or_else(|| format!("no domain {name}"))?;
        *state = DomainState::Stopped;
        Ok(())
    }

    fn delete(&self, name: &str) -> Result<(), String> {
        self.domains.lock().expect("fake hypervisor").remove(name);
        Ok(())
    }

    fn observe(&self, name: &str) -> Result<Option<Observed>, String> {
        let mut domains = self.domains.lock().expect("fake hypervisor");
        if let (Some(after), Some((_, state))) = (self.crash_after, domains.get_mut(name))
            && *state == DomainState::Running
        {
            let mut seen = self.observed_running.lock().expect("fake hypervisor");
            let count = seen.entry(name.to_owned()).or_default();
            *count += 1;
            if *count >= after {
                *state = DomainState::Crashed;
            }
        }
        Ok(domains.get(name).map(|(spec, state)| Observed { state: *state, vcpus: spec.vcpus, memory_mib: spec.memory_mib }))
    }
}

/// libvirt, on one connection.
#[cfg(feature = "libvirt")]
pub struct Libvirt {
    connection: Mutex<virt::connect::Connect>,
    pub uri: String,
}

#[cfg(feature = "libvirt")]
impl Libvirt {
    pub fn open(uri: &str) -> Result<Self, String> {
        let connection = virt::connect::Connect::open(Some(uri)).map_err(|e| format!("libvirt {uri}: {}", e.message()))?;
        Ok(Self { connection: Mutex::new(connection), uri: uri.to_owned() })
    }

    /// libvirt's version, as `major.minor.release`.
    pub fn version(&self) -> Result<String, String> {
        let v = self.connection.lock().expect("libvirt").lib_version().map_err(|e| e.message().to_owned())?;
        Ok(format!("{}.{}.{}", v / 1_000_000, (v / 1000) % 1000, v % 1000))
    }

    fn domain(&self, name: &str) -> Result<Option<virt::domain::Domain>, String> {
        let connection = self.connection.lock().expect("libvirt");
        match connection.lookup_domain_by_name(name) {
            Ok(domain) => Ok(Some(domain)),
            Err(e) if e.code() == virt::enumutil::Enum::Known(virt::error::ErrorNumber::NoDomain) => Ok(None),
            Err(e) => Err(e.message().to_owned()),
        }
    }

    fn existing(&self, name: &str) -> Result<virt::domain::Domain, String> {
        self.domain(name)?.ok_or_else(|| format!("no domain {name}"))
    }
}

#[cfg(feature = "libvirt")]
impl Hypervisor for Libvirt {
    fn define(&self, spec: &DomainSpec) -> Result<(), String> {
        // libvirt's test driver has its own domain type; every real one here is KVM.
        let kind = if self.uri.starts_with("test:") { "test" } else { "kvm" };
        let mut xml = domain_xml(spec, kind)?;
        // A redefinition names the domain's UUID: without it libvirt makes up another and
        // refuses a second domain of the same name.
        if let Some(domain) = self.domain(&spec.name)? {
            let uuid = domain.uuid_string().map_err(|e| e.message().to_owned())?;
            xml = xml.replacen("</name>\n", &format!("</name>\n  <uuid>{}</uuid>\n", escape(&uuid)), 1);
        }
        let connection = self.connection.lock().expect("libvirt");
        connection.define_domain_xml(&xml).map(|_| ()).map_err(|e| e.message().to_owned())
    }

    fn start(&self, name: &str) -> Result<(), String> {
        let domain = self.existing(name)?;
        if domain.is_active().map_err(|e| e.message().to_owned())? {
            return Ok(());
        }
        domain.create().map(|_| ()).map_err(|e| e.message().to_owned())
    }

    fn stop(&self, name: &str, force: bool) -> Result<(), String> {
        let domain = self.existing(name)?;
        if !domain.is_active().map_err(|e| e.message().to_owned())? {
            return Ok(());
        }
        let stopped = if force { domain.destroy() } else { domain.shutdown().map(|_| ()) };
        stopped.map_err(|e| e.message().to_owned())
    }

    fn delete(&self, name: &str) -> Result<(), String> {
        let Some(domain) = self.domain(name)? else { return Ok(()) };
        if domain.is_active().map_err(|e| e.message().to_owned())? {
            domain.destroy().map_err(|e| e.message().to_owned())?;
        }
        domain.undefine().map_err(|e| e.message().to_owned())
    }

    fn observe(&self, name: &str) -> Result<Option<Observed>, String> {
        use virt::domain::DomainState as S;
        use virt::enumutil::Enum;
        let Some(domain) = self.domain(name)? else { return Ok(None) };
        let info = domain.info().map_err(|e| e.message().to_owned())?;
        let state = match info.state {
            Enum::Known(S::Running | S::Blocked) => DomainState::Running,
            Enum::Known(S::Paused | S::PMSuspended) => DomainState::Paused,
            Enum::Known(S::Shutdown) => DomainState::Stopping,
            Enum::Known(S::Shutoff) => DomainState::Stopped,
            Enum::Known(S::Crashed) => DomainState::Crashed,
            _ => DomainState::Other,
        };
        Ok(Some(Observed { state, vcpus: info.nr_virt_cpu, memory_mib: info.max_mem / 1024 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str) -> DomainSpec {
        DomainSpec {
            name: name.into(),
            vcpus: 4,
            memory_mib: 2048,
            disk_path: Some("/var/lib/bcd/images/ubuntu.qcow2".into()),
            disk_format: "qcow2".into(),
            gpus: vec![HeldGpu { uuid: "GPU-a".into(), pci_address: "0000:3b:00.0".into() }],
        }
    }

    #[test]
    fn the_held_gpus_are_hostdev_passthrough_devices() {
        let xml = domain_xml(&spec("inst_1"), "kvm").unwrap();
        assert!(
            xml.contains("<name>inst_1</name>")
                && xml.contains("<vcpu>4</vcpu>")
                && xml.contains("<memory unit='MiB'>2048</memory>")
        );
        assert!(xml.contains("<hostdev mode='subsystem' type='pci' managed='no'>"), "{xml}");
        assert!(xml.contains("<address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/>"), "{xml}");
        assert!(xml.contains("<driver name='qemu' type='qcow2'/>"));
        assert!(
            xml.contains("<source file='/var/lib/bcd/images/ubuntu.qcow2'/>\n      <backingStore/>\n"),
            "the disk has no backing chain, whatever its header says: {xml}"
        );
        let hostile = DomainSpec { name: "a'/><x".into(), ..spec("x") };
        assert!(!domain_xml(&hostile, "kvm").unwrap().contains("'/><x"), "names are escaped");
        assert!(domain_xml(&DomainSpec { vcpus: 0, ..spec("x") }, "kvm").is_err());
        assert!(domain_xml(&DomainSpec { disk_format: "vmdk".into(), ..spec("x") }, "kvm").is_err());
    }

    #[test]
    fn a_crashing_fake_crashes_a_running_domain_after_its_observations_and_a_start_revives_it() {
        let fake = Fake::crashing_after(3);
        fake.define(&spec("inst_1")).unwrap();
        assert_eq!(fake.observe("inst_1").unwrap().unwrap().state, DomainState::Stopped, "a stopped domain never crashes");
        fake.start("inst_1").unwrap();
        let states: Vec<DomainState> = (0..4).map(|_| fake.observe("inst_1").unwrap().unwrap().state).collect();
        assert_eq!(states, [DomainState::Running, DomainState::Running, DomainState::Crashed, DomainState::Crashed]);
        fake.start("inst_1").unwrap();
        assert_eq!(fake.observe("inst_1").unwrap().unwrap().state, DomainState::Running, "started again, counted afresh");
    }

    #[test]
    fn the_fake_hypervisor_keeps_state() {
        let fake = Fake::default();
        assert_eq!(fake.observe("inst_1").unwrap(), None);
        fake.define(&spec("inst_1")).unwrap();
        assert_eq!(fake.observe("inst_1").unwrap().unwrap().state, DomainState::Stopped);
        fake.start("inst_1").unwrap();
        assert!(fake.define(&spec("inst_1")).is_err(), "a running domain is not redefined");
        fake.stop("inst_1", false).unwrap();
        fake.delete("inst_1").unwrap();
        assert_eq!(fake.observe("inst_1").unwrap(), None);
    }

    fn config(extra: &str) -> Result<crate::config::Config, String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        let text = format!(
            "data_dir = \"/var/lib/bcd\"\ngateway = \"http://127.0.0.1:9\"\nlog_key_pin = \"sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\"\n{extra}"
        );
        std::fs::write(&path, text).unwrap();
        crate::config::Config::load(&path).map_err(|e| e.to_string())
    }

    /// `[hypervisor] uri` is libvirt (a build without it says so); a fake machine without one
    /// runs the fake; any other node has none.
    #[test]
    fn the_hypervisor_is_the_one_the_configuration_names() {
        assert!(for_config(&config("").unwrap()).unwrap().is_none());
        let libvirt = config("[hypervisor]\nuri = \"test:///default\"\n");
        let empty = config("[hypervisor]\nuri = \"\"\n").unwrap_err();
        assert!(empty.contains("[hypervisor] uri is 1 to"), "{empty}");
        if cfg!(feature = "libvirt") {
            let hypervisor = for_config(&libvirt.unwrap()).unwrap().unwrap();
            assert_eq!(hypervisor.observe("inst_nonesuch").unwrap(), None);
        } else {
            assert!(libvirt.unwrap_err().contains("needs a libvirt build"));
        }
        if cfg!(feature = "fakehw") {
            let fake = for_config(&config("[hardware]\nfake_seed = 7\n").unwrap()).unwrap().unwrap();
            fake.define(&spec("inst_1")).unwrap();
            assert!(fake.observe("inst_1").unwrap().is_some());
        }
    }

    /// Against libvirt's `test:///default` driver (no daemon): define, start, stop, resize by
    /// redefinition, delete, each state as libvirt reports it.
    #[cfg(feature = "libvirt")]
    #[test]
    fn a_domain_lives_and_dies_in_libvirts_test_driver() {
        let libvirt = Libvirt::open("test:///default").unwrap();
        assert!(libvirt.version().unwrap().starts_with(char::is_numeric));
        let name = format!("inst_test_{}", std::process::id());
        libvirt.define(&DomainSpec { name: name.clone(), ..spec("x") }).unwrap();
        let observed = libvirt.observe(&name).unwrap().unwrap();
        assert_eq!((observed.state, observed.vcpus, observed.memory_mib), (DomainState::Stopped, 4, 2048));
        libvirt.start(&name).unwrap();
        assert_eq!(libvirt.observe(&name).unwrap().unwrap().state, DomainState::Running);
        libvirt.start(&name).unwrap();
        libvirt.stop(&name, true).unwrap();
        assert_eq!(libvirt.observe(&name).unwrap().unwrap().state, DomainState::Stopped);
        libvirt.delete(&name).unwrap();
        assert_eq!(libvirt.observe(&name).unwrap(), None);
        libvirt.delete(&name).unwrap();
        assert!(libvirt.start(&name).unwrap_err().contains("no domain"));
    }
}
