//! `bcd doctor`: checks of what `bcd node` needs, each `ok`, `warn` or `fail` with a fix a
//! person can act on. The verdicts are pure functions of what was read ([`clock_check`],
//! [`nvml_check`], [`exit_code`], …); [`run`] does the reading: the configuration, the node's
//! files, one TLS handshake and one session call to the gateway, NVML, and two paths under the
//! hardware root. Nothing is written: the journal is opened read-only.
//!
//! The gateway's time is the HTTP `Date` header of its agents' endpoint (hyper sets it on every
//! HTTP/2 response), read from the response to a `Session` call that sends nothing: no change to
//! the protocol, and no session is bound (a session needs `Hello` first), so a running `bcd node`
//! is not disturbed. `Date` has a resolution of one second, which the bounds allow for.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::config::Config;
use crate::inventory::GpuInventory;

/// Skew past this is a warning: command deadlines and leases are the gateway's times, compared
/// with the node's clock.
pub const CLOCK_SKEW_WARN_MS: u64 = 2_000;
/// Skew past this fails: a command issued now would look past its deadline, or far from it.
pub const CLOCK_SKEW_FAIL_MS: u64 = 60_000;
/// The gateway checks give up after this.
pub const GATEWAY_TIMEOUT_MS: u64 = 10_000;
/// Where vfio-pci binds devices for passthrough, under the hardware root.
pub const VFIO_DRIVER_DIR: &str = "sys/bus/pci/drivers/vfio-pci";
/// libvirt's sockets (monolithic libvirtd, or the modular QEMU daemon), under the hardware root.
pub const LIBVIRT_SOCKETS: &[&str] = &["var/run/libvirt/libvirt-sock", "var/run/libvirt/virtqemud-sock"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One check's verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub message: String,
    /// What to do about a warning or a failure; `None` when ok.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    pub fn ok(name: &'static str, message: impl Into<String>) -> Self {
        Self { name, status: Status::Ok, message: message.into(), fix: None }
    }
    pub fn warn(name: &'static str, message: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { name, status: Status::Warn, message: message.into(), fix: Some(fix.into()) }
    }
    pub fn fail(name: &'static str, message: impl Into<String>, fix: impl Into<String>) -> Self {
        Self { name, status: Status::Fail, message: message.into(), fix: Some(fix.into()) }
    }
}

/// 1 when a check failed, or (`strict`) warned; else 0.
pub fn exit_code(checks: &[Check], strict: bool) -> u8 {
    let bad = |c: &Check| c.status == Status::Fail || (strict && c.status == Status::Warn);
    u8::from(checks.iter().any(bad))
}

/// One line per check: `ok   name: message`, and the fix after a warning or a failure.
pub fn render(checks: &[Check]) -> String {
    let mut out = String::new();
    for c in checks {
        out.push_str(&format!("{:<4} {}: {}", c.status.as_str(), c.name, c.message));
        if let Some(fix) = &c.fix {
            out.push_str(&format!(" (fix: {fix})"));
        }
        out.push('\n');
    }
    out
}

/// The verdict on the skew between the node's clock and the gateway's `Date`: `sent_ms` and
/// `received_ms` bracket the call on the node's clock; the gateway's time lies in
/// `[date_ms, date_ms + 1000)` (the header has whole seconds). The skew is the smallest gap
/// between the two intervals, so a second's truncation or a slow round trip is never counted.
pub fn clock_check(sent_ms: u64, received_ms: u64, date_ms: u64) -> Check {
    let (gateway_from, gateway_to) = (date_ms, date_ms + 999);
    let skew_ms = if received_ms < gateway_from {
        -((gateway_from - received_ms) as i64)
    } else if sent_ms > gateway_to {
        (sent_ms - gateway_to) as i64
    } else {
        0
    };
    let magnitude = skew_ms.unsigned_abs();
    let side = if skew_ms > 0 { "ahead of" } else { "behind" };
    let fix = "synchronise the clock (chrony or systemd-timesyncd) on this node and the gateway";
    if magnitude > CLOCK_SKEW_FAIL_MS {
        Check::fail("clock", format!("this node's clock is {magnitude} ms {side} the gateway's"), fix)
    } else if magnitude > CLOCK_SKEW_WARN_MS {
        Check::warn("clock", format!("this node's clock is {magnitude} ms {side} the gateway's"), fix)
    } else {
        Check::ok(
            "clock",
            format!("within {CLOCK_SKEW_WARN_MS} ms of the gateway's (round trip {} ms)", received_ms.saturating_sub(sent_ms)),
        )
    }
}

/// NVML: no library or no driver is a warning with the reason (a node without GPUs can still
/// run), never a failure.
pub fn nvml_check(gpus: &GpuInventory) -> Check {
    let fix = "install the NVIDIA driver (it brings libnvidia-ml.so.1), or ignore on a node without GPUs";
    match (&gpus.unavailable, gpus.gpus.len()) {
        (Some(reason), _) => Check::warn("nvml", reason.clone(), fix),
        (None, 0) => Check::warn("nvml", "NVML loads but sees no GPU", fix),
        (None, n) => Check::ok("nvml", format!("{n} GPUs, driver {}", gpus.driver_version.as_deref().unwrap_or("unknown"))),
    }
}

/// vfio-pci: whether the agent's binding could hold GPUs here (`binding::Vfio`'s own test:
/// the driver's `bind` file under `root` exists and may be written, which sysfs lets only root).
pub fn vfio_check(root: &Path) -> Check {
    let binding = crate::binding::Vfio { root: root.to_path_buf(), in_use: Box::new(crate::binding::NvmlInUse) };
    match crate::binding::GpuBinding::unprivileged(&binding) {
        None => Check::ok("vfio", format!("{} is writable: GPUs can be held", root.join(VFIO_DRIVER_DIR).join("bind").display())),
        Some(reason) => Check::warn("vfio", reason, "modprobe vfio-pci, and run bcd as root"),
    }
}

/// libvirt: one of its sockets exists under `root`.
pub fn libvirt_check(root: &Path) -> Check {
    let found: Vec<PathBuf> = LIBVIRT_SOCKETS.iter().map(|s| root.join(s)).filter(|p| p.exists()).collect();
    match found.first() {
        Some(socket) => Check::ok("libvirt", format!("{} exists", socket.display())),
        None => Check::warn(
            "libvirt",
            format!("no libvirt socket under {}", root.join("var/run/libvirt").display()),
            "install libvirt and start libvirtd or virtqemud (systemctl enable --now virtqemud.socket)",
        ),
    }
}

/// The hypervisor instances run on: the configured libvirt URI opens (and says its version),
/// a fake machine's in-memory one, or none (the node runs no instances: a warning).
pub fn hypervisor_check(config: &Config) -> Check {
    match crate::hypervisor::for_config(config) {
        Ok(Some(_)) => match &config.hypervisor.uri {
            #[cfg(feature = "libvirt")]
            Some(uri) => match crate::hypervisor::Libvirt::open(uri).and_then(|l| l.version()) {
                Ok(version) => Check::ok("hypervisor", format!("libvirt {version} answers at {uri}")),
                Err(e) => Check::fail("hypervisor", e, format!("start libvirt, or correct [hypervisor] uri ({uri})")),
            },
            _ => Check::ok("hypervisor", "the fake machine's in-memory hypervisor: instances run in name only"),
        },
        Ok(None) => Check::warn(
            "hypervisor",
            "no [hypervisor] uri: this node runs no instances (it does not say instance.apply)",
            "set [hypervisor] uri = \"qemu:///system\" in the configuration",
        ),
        Err(e) => Check::fail("hypervisor", e, "connect libvirt, or correct [hypervisor] uri"),
    }
}

/// Every check, in order. A configuration that does not load leaves the checks that need it
/// unchecked (each a warning saying so; the configuration's failure already fails the run).
pub async fn run(config_path: &Path) -> Vec<Check> {
    let mut checks = Vec::new();
    let config = match Config::load(config_path) {
        Ok(config) => {
            checks.push(Check::ok("config", format!("{} loads", config_path.display())));
            Some(config)
        }
        Err(e) => {
            let fix = if config_path.exists() {
                format!("correct {} (see the README's bcd section)", config_path.display())
            } else {
                format!(
                    "write {} (bcd join --server URL --join-signing-pin PIN writes one from the well-known document), or pass --config FILE",
                    config_path.display()
                )
            };
            checks.push(Check::fail("config", e.to_string(), fix));
            None
        }
    };
    match &config {
        Some(config) => {
            checks.extend(node_files(config).await);
            checks.extend(gateway(config).await);
        }
        None => {
            for name in ["identity", "journal", "gateway", "clock"] {
                checks.push(Check::warn(name, "not checked: the configuration does not load", "fix the configuration first"));
            }
        }
    }
    checks.push(nvml_check(&crate::inventory::Nvml::read()));
    let root = config.as_ref().and_then(|c| c.hardware.root.clone()).unwrap_or_else(|| PathBuf::from("/"));
    checks.push(vfio_check(&root));
    checks.push(libvirt_check(&root));
    if let Some(config) = &config {
        checks.push(hypervisor_check(config));
        if let Some(ssh) = &config.ssh {
            checks.push(crate::ssh_ca::sshd_check(ssh));
        }
    }
    checks
}

/// The identity (signed by the pinned log key, naming `node.key`) and the journal (naming
/// that node).
async fn node_files(config: &Config) -> Vec<Check> {
    let identity = match crate::config::load_identity(config) {
        Ok(Some(identity)) => identity,
        Ok(None) => {
            return vec![
                Check::fail("identity", "this node has not joined", "run bcd join"),
                Check::warn("journal", "not checked: no identity", "run bcd join"),
            ];
        }
        Err(e) => {
            return vec![
                Check::fail("identity", e, "check log_key_pin, or join again with bcd join --reset --yes"),
                Check::warn("journal", "not checked: the identity does not load", "fix the identity first"),
            ];
        }
    };
    let node = identity.identity.node_id;
    let path = config.journal_path();
    let journal = match crate::journal::Journal::owner(&path).await {
        Ok(None) => Check::ok("journal", format!("none yet ({} is made by bcd node)", path.display())),
        Ok(Some(owner)) if owner == node => Check::ok("journal", format!("{} is {node}'s", path.display())),
        Ok(Some(owner)) => Check::fail(
            "journal",
            format!("{} belongs to node {owner}, not {node}", path.display()),
            "this data directory holds another node's journal: bcd join --reset --yes moves it aside",
        ),
        Err(e) => Check::fail("journal", format!("{}: {e}", path.display()), "check the file's owner and mode (0600)"),
    };
    vec![
        Check::ok("identity", format!("{node} (tenant {}, pool {})", identity.identity.tenant_id, identity.identity.pool_id)),
        journal,
    ]
}

/// The gateway answers with the pinned certificate; its clock against ours.
async fn gateway(config: &Config) -> Vec<Check> {
    let unchecked_clock = |why: &str| Check::warn("clock", format!("not checked: {why}"), "fix the gateway check first");
    let gateway = match config.gateway() {
        Ok(g) => g,
        Err(e) => return vec![Check::fail("gateway", e, "correct gateway in the configuration"), unchecked_clock("no gateway")],
    };
    let check = match gateway.handshake().await {
        Ok(true) => Check::ok("gateway", format!("{} answers with the pinned certificate", config.gateway)),
        Ok(false) => Check::ok("gateway", format!("{} answers (plaintext h2c to loopback, nothing pinned)", config.gateway)),
        Err(e @ crate::client::HandshakeError::PinMismatch) => {
            return vec![
                Check::fail(
                    "gateway",
                    format!("{}: {e}", config.gateway),
                    "set serving_ca_spki_pin to the pin better-compute dev/serve prints for the agents' endpoint",
                ),
                unchecked_clock("the pin does not match"),
            ];
        }
        Err(e) => {
            return vec![
                Check::fail("gateway", format!("{}: {e}", config.gateway), "start the gateway, or correct gateway's address"),
                unchecked_clock("the gateway does not answer"),
            ];
        }
    };
    let clock = match gateway_date(&gateway).await {
        Ok((sent_ms, received_ms, date_ms)) => clock_check(sent_ms, received_ms, date_ms),
        Err(e) => Check::warn("clock", format!("not checked: {e}"), "check that the gateway is a Better Compute gateway"),
    };
    vec![check, clock]
}

/// The gateway's `Date` on a `Session` call that sends nothing, bracketed by the node's clock.
async fn gateway_date(gateway: &crate::client::Gateway) -> Result<(u64, u64, u64), String> {
    use bc_core::clock::{Clock, SystemClock};
    let channel = gateway.channel()?;
    let mut client = bc_proto::agent_client::AgentClient::new(channel);
    let (sender, receiver) = tokio::sync::mpsc::channel::<bc_proto::AgentMessage>(1);
    let sent_ms = SystemClock.now_ms();
    let call = client.session(tokio_stream::wrappers::ReceiverStream::new(receiver));
    let answer = tokio::time::timeout(Duration::from_millis(GATEWAY_TIMEOUT_MS), call)
        .await
        .map_err(|_| "the gateway did not answer in time".to_owned())?;
    let received_ms = SystemClock.now_ms();
    drop(sender);
    let metadata = match &answer {
        Ok(response) => response.metadata(),
        Err(status) => status.metadata(),
    };
    let date = metadata.get("date").and_then(|v| v.to_str().ok()).ok_or("the gateway's answer has no Date header")?;
    let date = httpdate::parse_http_date(date).map_err(|e| format!("the gateway's Date {date:?}: {e}"))?;
    let date_ms = date.duration_since(std::time::UNIX_EPOCH).map_err(|e| e.to_string())?.as_millis() as u64;
    Ok((sent_ms, received_ms, date_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exit_code_is_1_on_a_failure_and_with_strict_on_a_warning() {
        let ok = Check::ok("a", "fine");
        let warn = Check::warn("b", "hm", "do x");
        let fail = Check::fail("c", "no", "do y");
        assert_eq!(exit_code(std::slice::from_ref(&ok), false), 0);
        assert_eq!(exit_code(&[ok.clone(), warn.clone()], false), 0);
        assert_eq!(exit_code(&[ok.clone(), warn.clone()], true), 1);
        assert_eq!(exit_code(&[ok, fail], false), 1);
        let text = render(&[warn]);
        assert_eq!(text, "warn b: hm (fix: do x)\n");
    }

    #[test]
    fn the_clock_allows_for_the_dates_whole_seconds_and_the_round_trip() {
        // The gateway's second 1000.xxx; the call took 40 ms around 1000.5 s: no skew.
        assert_eq!(clock_check(1_000_480, 1_000_520, 1_000_000).status, Status::Ok);
        // A slow round trip (1.5 s) that holds the gateway's second is no skew either.
        assert_eq!(clock_check(999_000, 1_000_500, 1_000_000).status, Status::Ok);
        // 3 s ahead: a warning that says ahead.
        let ahead = clock_check(1_004_000, 1_004_010, 1_000_000);
        assert_eq!(ahead.status, Status::Warn);
        assert!(ahead.message.contains("3001 ms ahead"), "{}", ahead.message);
        // Just past the bound behind; far past it: a failure.
        let behind = clock_check(1_000_000 - CLOCK_SKEW_WARN_MS - 1, 1_000_000 - CLOCK_SKEW_WARN_MS - 1, 1_000_000);
        assert_eq!(behind.status, Status::Warn);
        assert!(behind.message.contains("behind"), "{}", behind.message);
        assert_eq!(clock_check(1_000_000 - CLOCK_SKEW_WARN_MS, 1_000_000 - CLOCK_SKEW_WARN_MS, 1_000_000).status, Status::Ok);
        assert_eq!(clock_check(2_000_000, 2_000_001, 1_000_000).status, Status::Fail);
    }

    #[test]
    fn no_nvml_is_a_warning_with_the_reason_and_gpus_are_ok() {
        let none = GpuInventory { unavailable: Some("NVML is not available: libnvidia-ml.so.1".into()), ..Default::default() };
        let check = nvml_check(&none);
        assert_eq!(check.status, Status::Warn);
        assert!(check.message.contains("libnvidia-ml") && check.fix.is_some());
        assert_eq!(nvml_check(&GpuInventory::default()).status, Status::Warn);
        let gpu = crate::inventory::GpuInfo {
            index: 0,
            uuid: "GPU-0".into(),
            model: "H100".into(),
            product: "NVIDIA-H100".into(),
            vram_gib: 80,
            pci_bus_id: "00000000:10:00.0".into(),
            nvlink_domain: 0,
        };
        let some = GpuInventory { gpus: vec![gpu], driver_version: Some("550".into()), ..Default::default() };
        assert_eq!(nvml_check(&some), Check::ok("nvml", "1 GPUs, driver 550"));
    }

    #[test]
    fn vfio_and_libvirt_are_read_under_the_hardware_root() {
        let root = tempfile::tempdir().unwrap();
        let vfio = vfio_check(root.path());
        assert_eq!(vfio.status, Status::Warn);
        assert!(vfio.fix.as_deref().unwrap().contains("modprobe vfio-pci"));
        assert_eq!(libvirt_check(root.path()).status, Status::Warn);
        let dir = root.path().join(VFIO_DRIVER_DIR);
        std::fs::create_dir_all(&dir).unwrap();
        let without_bind = vfio_check(root.path());
        assert!(without_bind.status == Status::Warn && without_bind.message.contains("bind"), "the driver without its bind file");
        std::fs::write(dir.join("bind"), "").unwrap();
        assert_eq!(vfio_check(root.path()).status, Status::Ok);
        std::fs::create_dir_all(root.path().join("var/run/libvirt")).unwrap();
        std::fs::write(root.path().join(LIBVIRT_SOCKETS[1]), "").unwrap();
        let libvirt = libvirt_check(root.path());
        assert_eq!(libvirt.status, Status::Ok);
        assert!(libvirt.message.contains("virtqemud-sock"));
    }

    #[tokio::test]
    async fn a_missing_configuration_fails_with_a_fix_and_leaves_the_rest_unchecked() {
        let dir = tempfile::tempdir().unwrap();
        let checks = run(&dir.path().join("config.toml")).await;
        assert_eq!(checks[0].name, "config");
        assert_eq!(checks[0].status, Status::Fail);
        assert!(checks[0].fix.as_deref().unwrap().contains("bcd join --server"), "{:?}", checks[0]);
        let names: Vec<&str> = checks.iter().map(|c| c.name).collect();
        assert_eq!(names, ["config", "identity", "journal", "gateway", "clock", "nvml", "vfio", "libvirt"]);
        assert_eq!(exit_code(&checks, false), 1);
    }
}
