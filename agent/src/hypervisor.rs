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
//! addresses (`managed='no'`: the agent's hold already bound them to `vfio-pci`), and every
//! domain has a serial console on a pseudo-terminal.
//!
//! Reaching a guest (`tunnel.instance-dial`, for `forward` and `console --instance`): the trait
//! says where a running domain's port is ([`Hypervisor::guest_address`]) and hands its serial
//! console ([`Hypervisor::serial_console`]); the bytes themselves are `crate::tunnel`'s, at the
//! edge. libvirt reads the address from the domain's interfaces (DHCP leases, else the guest
//! agent) and opens the console as a libvirt stream; the fake names a local address
//! (`[hardware] fake_guest_address`, `fake_guest_console`) where a test's server stands for
//! the guest.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
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

/// Where a running guest's serial console is.
pub enum SerialConsole {
    /// A TCP endpoint that carries it, as QEMU's `-serial tcp:HOST:PORT` chardev (the fake's).
    Tcp(SocketAddr),
    /// libvirt's stream of the domain's console (`virDomainOpenConsole`), open.
    #[cfg(feature = "libvirt")]
    Libvirt(virt::stream::Stream),
}

pub trait Hypervisor: Send + Sync {
    /// Its driver's name, which the agent advertises as `hypervisor.<name>` (`drivers.list`).
    fn driver(&self) -> &'static str;
    /// Defines (or redefines, for a domain not running) the domain.
    fn define(&self, spec: &DomainSpec) -> Result<(), String>;
    fn start(&self, name: &str) -> Result<(), String>;
    /// Stops it: an ACPI shutdown, or at once with `force`.
    fn stop(&self, name: &str, force: bool) -> Result<(), String>;
    /// Removes the definition (a running domain is stopped first).
    fn delete(&self, name: &str) -> Result<(), String>;
    /// `None`: no such domain.
    fn observe(&self, name: &str) -> Result<Option<Observed>, String>;
    /// Whether this agent can reach its guests (their ports, their serial consoles): it then
    /// advertises `tunnel.instance-dial`.
    fn reaches_guests(&self) -> bool;
    /// The address of port `port` of the domain `name`, which the caller saw running.
    fn guest_address(&self, name: &str, port: u16) -> Result<SocketAddr, String>;
    /// The serial console of the domain `name`, which the caller saw running.
    fn serial_console(&self, name: &str) -> Result<SerialConsole, String>;
}

/// The address a guest is reached at among its interfaces' addresses (each an interface's
/// name and its addresses): the first IPv4 address that is not loopback, else the first
/// global IPv6 one (a link-local address needs a scope this agent does not know).
pub fn guest_ip(interfaces: &[(String, Vec<IpAddr>)]) -> Option<IpAddr> {
    let all = || interfaces.iter().filter(|(name, _)| name != "lo").flat_map(|(_, addrs)| addrs.iter().copied());
    let usable = |ip: &IpAddr| !ip.is_loopback() && !ip.is_unspecified() && !ip.is_multicast();
    all()
        .find(|ip| ip.is_ipv4() && usable(ip))
        .or_else(|| all().find(|ip| matches!(ip, IpAddr::V6(v6) if usable(ip) && (v6.segments()[0] & 0xffc0) != 0xfe80)))
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('\'', "&apos;").replace('"', "&quot;")
}

/// The libvirt domain XML of `spec` for the domain type `kind` (`kvm`; libvirt's test driver
/// takes `test`): the vCPUs and memory, the disk as virtio with an empty `<backingStore/>` (QEMU
/// opens no backing file, whatever the image's header names; `disk_header` refuses such an
/// image before this), each GPU as a PCI `hostdev` at its address, a virtio interface on the
/// libvirt network `network` if any, and a serial console on a pseudo-terminal.
pub fn domain_xml(spec: &DomainSpec, kind: &str, network: Option<&str>) -> Result<String, String> {
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
    if let Some(network) = network {
        xml.push_str(&format!(
            "    <interface type='network'>\n      <source network='{}'/>\n      <model type='virtio'/>\n    </interface>\n",
            escape(network)
        ));
    }
    // The serial console `console --instance` reaches (`virDomainOpenConsole`).
    xml.push_str("    <serial type='pty'>\n      <target port='0'/>\n    </serial>\n");
    xml.push_str("    <console type='pty'>\n      <target type='serial' port='0'/>\n    </console>\n");
    xml.push_str("  </devices>\n</domain>\n");
    Ok(xml)
}

/// The hypervisor `config` names: libvirt at `[hypervisor] uri`; else, on a fake machine
/// (`[hardware] fake_seed`), the in-memory [`Fake`]; else none (the node runs no instances).
pub fn for_config(config: &crate::config::Config) -> Result<Option<Box<dyn Hypervisor>>, String> {
    let hardware = &config.hardware;
    match (&config.hypervisor.uri, hardware.fake_seed) {
        #[cfg(feature = "libvirt")]
        (Some(uri), _) => Ok(Some(Box::new(Libvirt::open(uri)?.with_network(config.hypervisor.network.clone())))),
        #[cfg(not(feature = "libvirt"))]
        (Some(_), _) => Err(crate::config::HYPERVISOR_NEEDS_LIBVIRT.into()),
        (None, Some(_)) => {
            let fake = match hardware.fake_domain_crash_after {
                Some(after) => Fake::crashing_after(after),
                None => Fake::default(),
            };
            Ok(Some(Box::new(match hardware.fake_guest_address {
                Some(address) => fake.reaching(FakeGuests { address, console: hardware.fake_guest_console }),
                None => fake,
            })))
        }
        (None, None) => Ok(None),
    }
}

/// Where a fake machine's guests are reached (`[hardware] fake_guest_address`,
/// `fake_guest_console`): servers on this machine stand for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FakeGuests {
    /// Port N of every running instance is port N of this address.
    pub address: IpAddr,
    /// Every running instance's serial console, a TCP endpoint (as QEMU's `-serial tcp:`).
    pub console: Option<SocketAddr>,
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
    /// Where its guests are reached; none: the fake reaches no guest.
    guests: Option<FakeGuests>,
}

impl Fake {
    /// A fake whose running domains crash after `observations` looks (see [`Fake::crash_after`]).
    pub fn crashing_after(observations: u32) -> Self {
        Self { crash_after: Some(observations.max(1)), ..Self::default() }
    }

    /// This fake, its guests reached at `guests`.
    pub fn reaching(self, guests: FakeGuests) -> Self {
        Self { guests: Some(guests), ..self }
    }
}

impl Hypervisor for Fake {
    fn driver(&self) -> &'static str {
        "fake"
    }

    fn define(&self, spec: &DomainSpec) -> Result<(), String> {
        domain_xml(spec, "kvm", None)?;
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

    fn reaches_guests(&self) -> bool {
        self.guests.is_some()
    }

    fn guest_address(&self, name: &str, port: u16) -> Result<SocketAddr, String> {
        self.running(name)?;
        let guests = self.guests.ok_or("this fake machine names no guest address ([hardware] fake_guest_address)")?;
        Ok(SocketAddr::new(guests.address, port))
    }

    fn serial_console(&self, name: &str) -> Result<SerialConsole, String> {
        self.running(name)?;
        let console = self.guests.and_then(|g| g.console);
        console
            .map(SerialConsole::Tcp)
            .ok_or_else(|| "this fake machine names no serial console ([hardware] fake_guest_console)".into())
    }
}

impl Fake {
    /// `Ok` if the domain `name` is running.
    fn running(&self, name: &str) -> Result<(), String> {
        match self.domains.lock().expect("fake hypervisor").get(name) {
            Some((_, DomainState::Running)) => Ok(()),
            Some((_, state)) => Err(format!("domain {name} is {}, not running", state.as_str())),
            None => Err(format!("no domain {name}")),
        }
    }
}

/// libvirt, on one connection.
#[cfg(feature = "libvirt")]
pub struct Libvirt {
    connection: Mutex<virt::connect::Connect>,
    pub uri: String,
    /// The libvirt network each domain gets an interface on (`[hypervisor] network`).
    pub network: Option<String>,
}

#[cfg(feature = "libvirt")]
impl Libvirt {
    pub fn open(uri: &str) -> Result<Self, String> {
        let connection = virt::connect::Connect::open(Some(uri)).map_err(|e| format!("libvirt {uri}: {}", e.message()))?;
        Ok(Self { connection: Mutex::new(connection), uri: uri.to_owned(), network: None })
    }

    /// Domains defined from now on get an interface on `network`.
    pub fn with_network(self, network: Option<String>) -> Self {
        Self { network, ..self }
    }

    /// The running domain `name`.
    fn running(&self, name: &str) -> Result<virt::domain::Domain, String> {
        let domain = self.existing(name)?;
        match domain.is_active().map_err(|e| e.message().to_owned())? {
            true => Ok(domain),
            false => Err(format!("domain {name} is not running")),
        }
    }

    /// The domain's interfaces and their addresses, as `source` knows them.
    fn interfaces(domain: &virt::domain::Domain, source: u32) -> Result<Vec<(String, Vec<IpAddr>)>, String> {
        let interfaces = domain.interface_addresses(source, 0).map_err(|e| e.message().to_owned())?;
        Ok(interfaces
            .into_iter()
            .map(|i| (i.name, i.addrs.iter().filter_map(|a| a.addr.parse::<IpAddr>().ok()).collect()))
            .collect())
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
    fn driver(&self) -> &'static str {
        "libvirt"
    }

    fn define(&self, spec: &DomainSpec) -> Result<(), String> {
        // libvirt's test driver has its own domain type; every real one here is KVM.
        let kind = if self.uri.starts_with("test:") { "test" } else { "kvm" };
        let mut xml = domain_xml(spec, kind, self.network.as_deref())?;
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

    /// A domain's serial console is always reached (every domain has one); its ports when it
    /// has an address on a network the host routes to.
    fn reaches_guests(&self) -> bool {
        true
    }

    /// The domain's address from its DHCP leases on a libvirt network, else from the guest
    /// agent (a guest on a bridge, with an agent, that no libvirt DHCP server leased to).
    fn guest_address(&self, name: &str, port: u16) -> Result<SocketAddr, String> {
        let domain = self.running(name)?;
        let mut why = Vec::new();
        for (source, what) in [
            (virt::sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE, "DHCP leases"),
            (virt::sys::VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_AGENT, "the guest agent"),
        ] {
            match Self::interfaces(&domain, source) {
                Ok(interfaces) => match guest_ip(&interfaces) {
                    Some(ip) => return Ok(SocketAddr::new(ip, port)),
                    None => why.push(format!("{what}: no address")),
                },
                Err(e) => why.push(format!("{what}: {e}")),
            }
        }
        Err(format!("domain {name} has no address this node reaches ({})", why.join("; ")))
    }

    fn serial_console(&self, name: &str) -> Result<SerialConsole, String> {
        let domain = self.running(name)?;
        let stream = {
            let connection = self.connection.lock().expect("libvirt");
            virt::stream::Stream::new(&connection, 0).map_err(|e| e.message().to_owned())?
        };
        // FORCE: a console left open by an earlier tunnel (or virsh) is taken over, not refused.
        domain
            .open_console(None, &stream, virt::sys::VIR_DOMAIN_CONSOLE_FORCE)
            .map_err(|e| format!("domain {name}'s serial console: {}", e.message()))?;
        Ok(SerialConsole::Libvirt(stream))
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
        let xml = domain_xml(&spec("inst_1"), "kvm", None).unwrap();
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
        assert!(
            xml.contains("<serial type='pty'>") && xml.contains("<console type='pty'>\n      <target type='serial' port='0'/>"),
            "every domain has a serial console: {xml}"
        );
        assert!(!xml.contains("<interface"), "no network named, no interface: {xml}");
        let networked = domain_xml(&spec("inst_1"), "kvm", Some("default")).unwrap();
        assert!(networked.contains("<interface type='network'>\n      <source network='default'/>"), "{networked}");
        let hostile = DomainSpec { name: "a'/><x".into(), ..spec("x") };
        assert!(!domain_xml(&hostile, "kvm", None).unwrap().contains("'/><x"), "names are escaped");
        assert!(domain_xml(&DomainSpec { vcpus: 0, ..spec("x") }, "kvm", None).is_err());
        assert!(domain_xml(&DomainSpec { disk_format: "vmdk".into(), ..spec("x") }, "kvm", None).is_err());
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

    /// The guest's address is the first usable IPv4 one, else a global IPv6 one; never
    /// loopback or link-local.
    #[test]
    fn a_guest_is_reached_at_its_first_usable_address() {
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        let nic = |name: &str, addrs: &[&str]| (name.to_owned(), addrs.iter().map(|a| ip(a)).collect::<Vec<_>>());
        assert_eq!(guest_ip(&[nic("lo", &["127.0.0.1"]), nic("eth0", &["fe80::1", "192.168.122.7"])]), Some(ip("192.168.122.7")));
        assert_eq!(guest_ip(&[nic("eth0", &["fe80::1", "2001:db8::7"])]), Some(ip("2001:db8::7")));
        assert_eq!(guest_ip(&[nic("eth0", &["fe80::1"]), nic("lo", &["::1"])]), None);
        assert_eq!(guest_ip(&[]), None);
    }

    /// The fake reaches its guests only when the configuration names where: a running domain's
    /// port N is that address's port N, its console the endpoint named; a stopped one is not
    /// reached.
    #[test]
    fn the_fake_reaches_a_running_guest_where_the_configuration_says() {
        let bare = Fake::default();
        assert!(!bare.reaches_guests());
        let console: SocketAddr = "127.0.0.1:4555".parse().unwrap();
        let fake = Fake::default().reaching(FakeGuests { address: "127.0.0.1".parse().unwrap(), console: Some(console) });
        assert!(fake.reaches_guests());
        fake.define(&spec("inst_1")).unwrap();
        assert!(fake.guest_address("inst_1", 5432).unwrap_err().contains("not running"));
        assert!(fake.guest_address("inst_2", 5432).unwrap_err().contains("no domain"));
        fake.start("inst_1").unwrap();
        assert_eq!(fake.guest_address("inst_1", 5432).unwrap(), "127.0.0.1:5432".parse().unwrap());
        assert!(matches!(fake.serial_console("inst_1").unwrap(), SerialConsole::Tcp(a) if a == console));
        let no_console = Fake::default().reaching(FakeGuests { address: "127.0.0.1".parse().unwrap(), console: None });
        no_console.define(&spec("inst_1")).unwrap();
        no_console.start("inst_1").unwrap();
        assert!(no_console.serial_console("inst_1").is_err_and(|e| e.contains("fake_guest_console")));
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
            assert!(!fake.reaches_guests(), "no guest address named");
            let guests =
                "[hardware]\nfake_seed = 7\nfake_guest_address = \"127.0.0.1\"\nfake_guest_console = \"127.0.0.1:4555\"\n";
            let fake = for_config(&config(guests).unwrap()).unwrap().unwrap();
            assert!(fake.reaches_guests());
        }
        // The guest keys belong to a fake machine, the network to libvirt, and are checked.
        let refused = |extra: &str| config(extra).unwrap_err();
        assert!(refused("[hardware]\nfake_guest_address = \"127.0.0.1\"\n").contains("set fake_seed too"));
        assert!(refused("[hardware]\nfake_guest_address = \"nope\"\n").contains("fake_guest_address"));
        assert!(
            refused("[hardware]\nfake_seed = 7\nfake_guest_console = \"127.0.0.1:1\"\n").contains("set fake_guest_address too")
        );
        assert!(refused("[hypervisor]\nnetwork = \"default\"\n").contains("set uri too"));
        assert!(refused("[hypervisor]\nuri = \"test:///default\"\nnetwork = \"a'b\"\n").contains("a libvirt network's name"));
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

    /// What libvirt's test driver says of a guest's address and its console, on a domain with
    /// an interface on its `default` network: a stopped domain is not reached; a running one's
    /// address is read from the driver's leases (the test driver makes them up in
    /// 192.168.122.0/24); its console is refused by libvirt itself (the test driver has no
    /// `virDomainOpenConsole`), and the refusal says so.
    #[cfg(feature = "libvirt")]
    #[test]
    fn a_guest_is_found_through_libvirts_test_driver() {
        let libvirt = Libvirt::open("test:///default").unwrap().with_network(Some("default".into()));
        assert!(libvirt.reaches_guests());
        let name = format!("inst_dial_{}", std::process::id());
        libvirt.define(&DomainSpec { name: name.clone(), ..spec("x") }).unwrap();
        assert!(libvirt.guest_address(&name, 22).unwrap_err().contains("not running"));
        assert!(libvirt.serial_console(&name).is_err());
        libvirt.start(&name).unwrap();
        let address = libvirt.guest_address(&name, 22).unwrap();
        assert_eq!(address.port(), 22);
        assert!(address.ip().is_ipv4() && !address.ip().is_loopback(), "{address}");
        // The test driver opens no console (only the hypervisor drivers do): libvirt's own
        // refusal comes back, named.
        let console = libvirt.serial_console(&name).map(|_| ()).unwrap_err();
        assert!(console.contains("serial console") && console.contains("virDomainOpenConsole"), "{console}");
        libvirt.delete(&name).unwrap();
        assert!(libvirt.guest_address(&name, 22).unwrap_err().contains("no domain"));
    }
}
