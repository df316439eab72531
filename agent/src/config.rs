//! `config.toml` (`--config`, default `/etc/bcd/config.toml`), and the node's files in
//! `data_dir`: `node.key` (the node's Ed25519 key, 0600, never leaves the machine),
//! `identity.json` (the identity the control plane signed at join), `journal.db`, `bcd.sock`,
//! `holds.json` and `instances.json` (the ledgers), `images/` (the image cache) and
//! `instances/` (each instance's disk), `bcd.pid`, and with `[update]` `slots/` and the
//! entrypoint `bin/bcd` ([`crate::update`]).

use std::path::{Path, PathBuf};

use bc_core::agent::{NodeIdentity, identity_signing_message};
use ed25519_dalek::{Signature, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

pub const CONFIG_DEFAULT: &str = "/etc/bcd/config.toml";
pub const DATA_DIR_DEFAULT: &str = "/var/lib/bcd";
pub const NODE_KEY_FILE: &str = "node.key";
pub const IDENTITY_FILE: &str = "identity.json";
pub const SOCKET_FILE: &str = "bcd.sock";
/// The join encryption key (a public X25519 JWK), beside `config.toml`.
pub const JOIN_ENCRYPTION_JWK_FILE: &str = "join-encryption.jwk";
/// The largest configuration file read.
pub const CONFIG_BYTES_MAX: u64 = 64 * 1024;
/// How often the node journals an observation of itself, by default.
pub const OBSERVE_INTERVAL_MS_DEFAULT: u64 = 60_000;
pub const OBSERVE_INTERVAL_MS_MIN: u64 = 100;
/// The longest `[hypervisor] uri`.
pub const HYPERVISOR_URI_BYTES_MAX: usize = 1024;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub data_dir: PathBuf,
    /// `https://HOST:PORT`, or `http://` to a loopback dev gateway.
    pub gateway: String,
    /// `sha256/…` of the gateway's serving certificate's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_ca_spki_pin: Option<String>,
    /// `sha256/…` of the log key that signs node identities (`better-compute pki show`).
    pub log_key_pin: String,
    /// `sha256/…` of the deployment's join signing key (the well-known document's, `pki show`'s
    /// `joinSigningPin`): with it, `bcd join` takes only a `JoinResponse` that key signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_signing_key_pin: Option<String>,
    /// `sha256/…` of the join encryption key (`joinEncryptionPin`): `join-encryption.jwk`
    /// beside this file must be that key, to which `bcd join` seals the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_encryption_key_pin: Option<String>,
    /// A duration (`60s`, `500ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observe_interval: Option<String>,
    /// The approver set's root this node trusts for destructive batches: SHA-256 of the
    /// epoch-1 approver set's message, 64 lowercase hex digits per root, comma-separated
    /// (`better-compute batch approvers` prints it as `commandRootSha256`). With it, a command a
    /// batch released runs only once its release verifies here (`bc_core::approval`); a release
    /// that does not is refused, the reason journaled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_root_sha256: Option<String>,
    #[serde(default)]
    pub journal: JournalConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub hardware: HardwareConfig,
    #[serde(default)]
    pub hypervisor: HypervisorConfig,
    /// Signed releases, slots and the watchdog (`[update]`); none: `agent.update` is refused
    /// `update-unconfigured`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<UpdateConfig>,
    /// Break-glass SSH (`[ssh]`): the files sshd reads to accept the deployment's node-bound
    /// certificates ([`crate::ssh_ca`]); none: bcd writes nothing for sshd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh: Option<crate::ssh_ca::SshConfig>,
}

/// `[update]`: what `agent.update` and `bcd update` need ([`crate::update`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateConfig {
    /// The release keys this node trusts, each `rk_<16 hex> <base64>` (a `KEY.pub` line); empty:
    /// every update is refused.
    #[serde(default)]
    pub release_keys: Vec<String>,
    /// The slots (`a/bcd`, `b/bcd`, `state.json`); default `<data_dir>/slots`.
    pub slots_dir: Option<PathBuf>,
    /// The symlink to the active slot's binary that a service manager starts; default
    /// `<data_dir>/bin/bcd`.
    pub entrypoint: Option<PathBuf>,
    /// Seconds a new agent has to confirm its health before the watchdog rolls back (120).
    pub confirm_within_s: Option<u64>,
    /// Seconds a new agent's session must be live before it confirms (5).
    pub healthy_after_s: Option<u64>,
}

/// Where instances run (`[hypervisor]`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HypervisorConfig {
    /// libvirt's connection URI (`qemu:///system`); `libvirt` builds only. Unset: a fake machine
    /// runs instances on the in-memory fake hypervisor, any other node runs none.
    pub uri: Option<String>,
    /// The libvirt network each domain gets a virtio interface on (`default`, libvirt's NAT
    /// network), so the agent can reach its guests' ports (`forward`); unset: domains have no
    /// network interface, and only their serial console is reached.
    pub network: Option<String>,
}

/// The longest `[hypervisor] network`.
pub const NETWORK_NAME_BYTES_MAX: usize = 64;

/// Whether `name` may be a libvirt network's name as this agent writes it into domain XML.
pub fn is_network_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NETWORK_NAME_BYTES_MAX
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The refusal of a `[hypervisor] uri` by a build without libvirt.
pub const HYPERVISOR_NEEDS_LIBVIRT: &str =
    "[hypervisor] uri needs a libvirt build (cargo build --features bc-agent/libvirt); this bcd has no libvirt";

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareConfig {
    /// Where `/proc` and `/sys` are read (`/` by default; a fake tree in tests).
    pub root: Option<PathBuf>,
    /// A seeded fake machine instead of this one (`fakehw` builds only).
    pub fake_seed: Option<u64>,
    /// The fake machine refuses every `gpu.hold` with this reason (`code: words`), to exercise
    /// a node that cannot bind (`fakehw` builds, with `fake_seed`).
    pub fake_hold_refusal: Option<String>,
    /// The fake machine's hypervisor crashes a running domain once it has been observed this
    /// many times since its start, to exercise a domain that fails behind the agent's back
    /// (`fakehw` builds, with `fake_seed`).
    pub fake_domain_crash_after: Option<u32>,
    /// The fake machine's guests are reached here: port N of any running instance is port N of
    /// this address (`127.0.0.1`: a server the tests run stands for the guest), and the agent
    /// advertises `tunnel.instance-dial` (`fakehw` builds, with `fake_seed`).
    pub fake_guest_address: Option<std::net::IpAddr>,
    /// The fake machine's instances' serial console: a TCP endpoint the agent connects to, as
    /// QEMU's `-serial tcp:HOST:PORT` chardev does (`fakehw` builds, with `fake_guest_address`).
    pub fake_guest_console: Option<std::net::SocketAddr>,
    /// `bcd` kills itself (SIGKILL) right after recording a volume `creating` (`create`) or
    /// `growing` (`grow`), before `mkfs.ext4` or `resize2fs`, to exercise the ledger's recovery
    /// at the next start (`fakehw` builds, with `fake_seed`).
    pub fake_volume_crash: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalConfig {
    /// Unacknowledged entries held at most (default 100 000).
    pub unacked_max: Option<u64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `error`, `warn`, `info` (default), `debug`, `trace`, or a tracing filter.
    pub level: Option<String>,
    /// `json` (the default when standard error is not a terminal) or `text`.
    pub format: Option<String>,
}

/// `[metrics]`: bcd's own `GET /metrics` ([`crate::metrics`]), served by `bcd node` on `listen`
/// (`127.0.0.1:9464`; a loopback address unless a scraper elsewhere needs it). Without it, none.
/// Read apart from [`Config`] ([`MetricsConfig::load`]), which the rest of the agent shares.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    pub listen: Option<String>,
}

impl MetricsConfig {
    /// The `[metrics]` table of the configuration at `path`; the default when it has none.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let meta = std::fs::metadata(path).map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
        if meta.len() > CONFIG_BYTES_MAX {
            return Err(ConfigError(format!("{} is over {CONFIG_BYTES_MAX} bytes", path.display())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
        let Some(mut table) = metrics_table(&text) else { return Ok(Self::default()) };
        let metrics = table.remove("metrics").unwrap_or_else(|| toml::Value::Table(Default::default()));
        let metrics = <MetricsConfig as Deserialize>::deserialize(metrics)
            .map_err(|e| ConfigError(format!("{}: [metrics] {e}", path.display())))?;
        if let Some(listen) = &metrics.listen
            && listen.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(ConfigError(format!("{}: [metrics] listen {listen:?} is not HOST:PORT", path.display())));
        }
        Ok(metrics)
    }
}

/// The configuration's text as a table, when it parses and has a `[metrics]` key.
fn metrics_table(text: &str) -> Option<toml::Table> {
    text.parse::<toml::Table>().ok().filter(|t| t.contains_key("metrics"))
}

/// A configuration that does not load: exit 1.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl Config {
    /// What `bcd join --server` writes: the data directory, the agents' endpoint and the pins it
    /// was given or read, every other setting at its default.
    pub fn joined(data_dir: PathBuf, gateway: String, serving_ca_spki_pin: Option<String>, log_key_pin: String) -> Self {
        Self {
            data_dir,
            gateway,
            serving_ca_spki_pin,
            log_key_pin,
            join_signing_key_pin: None,
            join_encryption_key_pin: None,
            observe_interval: None,
            command_root_sha256: None,
            hardware: Default::default(),
            hypervisor: Default::default(),
            journal: Default::default(),
            log: Default::default(),
            update: None,
            ssh: None,
        }
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let meta = std::fs::metadata(path).map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
        if meta.len() > CONFIG_BYTES_MAX {
            return Err(ConfigError(format!("{} is over {CONFIG_BYTES_MAX} bytes", path.display())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError(format!("cannot read {}: {e}", path.display())))?;
        let config: Config = match metrics_table(&text) {
            // `[metrics]` is read apart ([`MetricsConfig::load`]); the rest as ever.
            Some(mut table) => {
                table.remove("metrics");
                <Config as Deserialize>::deserialize(table).map_err(|e| ConfigError(format!("{}: {e}", path.display())))?
            }
            None => toml::from_str(&text).map_err(|e| ConfigError(format!("{}: {e}", path.display())))?,
        };
        config.check().map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
        Ok(config)
    }

    fn check(&self) -> Result<(), String> {
        crate::client::check_pin(&self.log_key_pin).map_err(|e| format!("log_key_pin: {e}"))?;
        for (name, pin) in
            [("join_signing_key_pin", &self.join_signing_key_pin), ("join_encryption_key_pin", &self.join_encryption_key_pin)]
        {
            if let Some(pin) = pin {
                crate::client::check_pin(pin).map_err(|e| format!("{name}: {e}"))?;
            }
        }
        crate::client::Gateway::parse(&self.gateway, self.serving_ca_spki_pin.as_deref())?;
        self.observe_interval_ms()?;
        self.command_roots()?;
        if self.hardware.fake_seed.is_some() && !cfg!(feature = "fakehw") {
            return Err("[hardware] fake_seed needs a fakehw build (cargo build --features bc-agent/fakehw)".into());
        }
        if self.hypervisor.uri.as_deref().is_some_and(|uri| uri.is_empty() || uri.len() > HYPERVISOR_URI_BYTES_MAX) {
            return Err(format!("[hypervisor] uri is 1 to {HYPERVISOR_URI_BYTES_MAX} bytes"));
        }
        if self.hypervisor.uri.is_some() && !cfg!(feature = "libvirt") {
            return Err(HYPERVISOR_NEEDS_LIBVIRT.into());
        }
        if self.hardware.fake_domain_crash_after.is_some() && self.hardware.fake_seed.is_none() {
            return Err("[hardware] fake_domain_crash_after is for a fake machine: set fake_seed too".into());
        }
        crate::update::UpdateSettings::of(self)?;
        if let Some(ssh) = &self.ssh {
            ssh.validate()?;
        }
        if let Some(phase) = &self.hardware.fake_volume_crash {
            if self.hardware.fake_seed.is_none() {
                return Err("[hardware] fake_volume_crash is for a fake machine: set fake_seed too".into());
            }
            if !matches!(phase.as_str(), "create" | "grow") {
                return Err("[hardware] fake_volume_crash is create or grow".into());
            }
        }
        if self.hardware.fake_hold_refusal.is_some() && self.hardware.fake_seed.is_none() {
            return Err("[hardware] fake_hold_refusal is for a fake machine: set fake_seed too".into());
        }
        if self.hardware.fake_guest_address.is_some() && self.hardware.fake_seed.is_none() {
            return Err("[hardware] fake_guest_address is for a fake machine: set fake_seed too".into());
        }
        if self.hardware.fake_guest_console.is_some() && self.hardware.fake_guest_address.is_none() {
            return Err("[hardware] fake_guest_console is a fake machine's guest's: set fake_guest_address too".into());
        }
        if self.hypervisor.network.as_deref().is_some_and(|n| !is_network_name(n)) {
            return Err(format!(
                "[hypervisor] network is a libvirt network's name: 1 to {NETWORK_NAME_BYTES_MAX} letters, digits, '-', '_' or '.'"
            ));
        }
        if self.hypervisor.network.is_some() && self.hypervisor.uri.is_none() {
            return Err("[hypervisor] network is libvirt's: set uri too".into());
        }
        Ok(())
    }

    /// The pinned approver-set roots (`command_root_sha256`); empty without it.
    pub fn command_roots(&self) -> Result<Vec<String>, String> {
        self.command_root_sha256.as_deref().map_or(Ok(Vec::new()), bc_core::approval::parse_command_roots)
    }

    pub fn gateway(&self) -> Result<crate::client::Gateway, String> {
        crate::client::Gateway::parse(&self.gateway, self.serving_ca_spki_pin.as_deref())
    }

    pub fn observe_interval_ms(&self) -> Result<u64, String> {
        match &self.observe_interval {
            None => Ok(OBSERVE_INTERVAL_MS_DEFAULT),
            Some(text) => {
                let ms =
                    humantime::parse_duration(text).map_err(|e| format!("observe_interval {text:?}: {e}"))?.as_millis() as u64;
                if ms < OBSERVE_INTERVAL_MS_MIN {
                    return Err(format!("observe_interval is at least {OBSERVE_INTERVAL_MS_MIN}ms"));
                }
                Ok(ms)
            }
        }
    }

    pub fn unacked_max(&self) -> u64 {
        self.journal.unacked_max.unwrap_or(crate::journal::UNACKED_MAX_DEFAULT).max(1)
    }

    pub fn key_path(&self) -> PathBuf {
        self.data_dir.join(NODE_KEY_FILE)
    }

    pub fn identity_path(&self) -> PathBuf {
        self.data_dir.join(IDENTITY_FILE)
    }

    pub fn journal_path(&self) -> PathBuf {
        self.data_dir.join(crate::journal::JOURNAL_FILE)
    }

    pub fn socket_path(&self) -> PathBuf {
        self.data_dir.join(SOCKET_FILE)
    }
}

/// The identity file: the signed document as the control plane sent it, and its signature.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IdentityFile {
    /// The exact bytes signed (JSON text of [`NodeIdentity`]).
    pub identity: String,
    /// Standard base64 of the log key's signature.
    pub signature: String,
    /// Standard base64 of the log key's public half.
    pub log_public_key: String,
}

/// A loaded, checked identity.
pub struct Identity {
    pub identity: NodeIdentity,
    pub key: SigningKey,
}

/// Checks an identity document against the pinned log key and the node's own key.
pub fn verify_identity(file: &IdentityFile, log_key_pin: &str, node_key: &VerifyingKey) -> Result<NodeIdentity, String> {
    let public = bc_core::agent::unb64(&file.log_public_key)?;
    let public: [u8; 32] = public.try_into().map_err(|_| "the log key is not 32 bytes".to_owned())?;
    let log_key = VerifyingKey::from_bytes(&public).map_err(|e| format!("the log key: {e}"))?;
    if bc_core::keys::pin_of(&log_key) != log_key_pin {
        return Err("the identity is signed by a log key other than the pinned one (log_key_pin)".into());
    }
    let signature =
        Signature::from_slice(&bc_core::agent::unb64(&file.signature)?).map_err(|_| "the signature is malformed".to_owned())?;
    log_key
        .verify(&identity_signing_message(file.identity.as_bytes()), &signature)
        .map_err(|_| "the identity's signature does not verify against the pinned log key".to_owned())?;
    let identity: NodeIdentity = serde_json::from_str(&file.identity).map_err(|e| format!("the identity document: {e}"))?;
    if identity.node_public_key != bc_core::agent::b64(node_key.as_bytes()) {
        return Err("the identity names another node key than node.key".into());
    }
    identity.node_id.parse::<bc_core::id::NodeId>().map_err(|e| e.to_string())?;
    Ok(identity)
}

/// Loads `node.key` and `identity.json`; `Ok(None)` when the machine has not joined.
pub fn load_identity(config: &Config) -> Result<Option<Identity>, String> {
    let (key_path, identity_path) = (config.key_path(), config.identity_path());
    if !identity_path.exists() {
        return Ok(None);
    }
    let key = read_node_key(&key_path)?;
    let text = std::fs::read_to_string(&identity_path).map_err(|e| format!("cannot read {}: {e}", identity_path.display()))?;
    let file: IdentityFile = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", identity_path.display()))?;
    let identity = verify_identity(&file, &config.log_key_pin, &key.verifying_key())
        .map_err(|e| format!("{}: {e}", identity_path.display()))?;
    Ok(Some(Identity { identity, key }))
}

pub fn read_node_key(path: &Path) -> Result<SigningKey, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let bytes = hex::decode(text.trim()).map_err(|_| format!("{} is not a hex Ed25519 seed", path.display()))?;
    let seed: [u8; 32] = bytes.try_into().map_err(|_| format!("{} is not 32 bytes", path.display()))?;
    Ok(SigningKey::from_bytes(&seed))
}

/// The node key: the one in `data_dir` if a join was interrupted after making it, else a new
/// one written 0600, from the OS's randomness (a secret, never drawn from a seed; the
/// simulator's nodes get theirs from the seed without this).
#[allow(clippy::disallowed_methods)]
pub fn node_key_load_or_create(config: &Config) -> Result<SigningKey, String> {
    let path = config.key_path();
    if path.exists() {
        return read_node_key(&path);
    }
    let key = SigningKey::from_bytes(&rand::random::<[u8; 32]>());
    bc_core::keys::write_new_file(&path, format!("{}\n", hex::encode(key.to_bytes())).as_bytes(), 0o600)
        .map_err(|e| e.to_string())?;
    Ok(key)
}

#[cfg(test)]
mod metrics_config_tests {
    use super::*;

    const BASE: &str = "data_dir = \"/d\"\ngateway = \"http://127.0.0.1:9\"\nlog_key_pin = \"sha256/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\"\n";

    fn with(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, format!("{BASE}{text}")).unwrap();
        (dir, path)
    }

    #[test]
    fn metrics_are_off_unless_listen_is_set_and_a_bad_listen_is_refused() {
        let (_dir, path) = with("");
        assert_eq!(MetricsConfig::load(&path).unwrap(), MetricsConfig::default());
        let (_dir, path) = with("\n[metrics]\nlisten = \"127.0.0.1:9464\"\n");
        assert!(Config::load(&path).is_ok(), "the rest of the agent reads the file as before");
        assert_eq!(MetricsConfig::load(&path).unwrap().listen.as_deref(), Some("127.0.0.1:9464"));
        let (_dir, path) = with("\n[metrics]\nlisten = \"anywhere\"\n");
        assert!(MetricsConfig::load(&path).unwrap_err().0.contains("is not HOST:PORT"));
        let (_dir, path) = with("\n[metrics]\nport = 9\n");
        assert!(MetricsConfig::load(&path).unwrap_err().0.contains("unknown field"));
        let (_dir, path) = with("\n[metricz]\nlisten = \"127.0.0.1:1\"\n");
        assert!(Config::load(&path).unwrap_err().0.contains("unknown field"), "other tables are still refused");
    }
}
