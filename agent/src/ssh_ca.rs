//! Break-glass SSH on the node (`[ssh]` in `config.toml`): the files `sshd` reads to accept the
//! deployment's node-bound user certificates (`better-compute ssh-cert`).
//!
//! - `trusted_user_ca_keys`: the file `sshd_config` names as `TrustedUserCAKeys`; `bcd` writes
//!   every CA key the gateway trusts now, one OpenSSH line each: the current CA and, after a
//!   rotation, the replaced one until its grace ends. The keys come with the session's welcome
//!   and again whenever they change (`SshUserCaKeys`); each carries the end of its trust, and
//!   [`SshInstaller`] drops a key at its end by this node's clock even if the gateway cannot
//!   say so (a node cut off from the control plane is when break-glass is used).
//! - `authorized_principals_file`: `sshd_config`'s `AuthorizedPrincipalsFile`, with `%u` for the
//!   account as sshd expands it; for each of `accounts` `bcd` writes the one principal only
//!   this node and that account accept, `bc-node:<node id>:<account>`.
//!
//! Each file is written whole to a temporary file beside it, made 0644 and renamed over the
//! old one, and only when its contents change, so sshd never reads half a file. An empty list
//! of CA keys (a gateway that has none) changes nothing. What to write ([`planned_files`]) and
//! what `doctor` concludes from `sshd_config` ([`sshd_config_check`]) are pure; [`install`]
//! does the writing, from the driver, and [`sshd_check`] the reading, for `doctor`.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::doctor::Check;

/// The configuration `doctor` reads when `[ssh]` names none.
pub const SSHD_CONFIG_DEFAULT: &str = "/etc/ssh/sshd_config";
/// The most CA keys a node trusts at once (the current one and those in their grace period).
pub const SSH_CA_KEYS_MAX: usize = 4;
/// The longest CA key line taken, in bytes.
pub const SSH_CA_KEY_BYTES_MAX: usize = 1024;
/// The most accounts `[ssh] accounts` lists.
pub const SSH_ACCOUNTS_MAX: usize = 16;
/// The largest `sshd_config` `doctor` reads.
pub const SSHD_CONFIG_BYTES_MAX: u64 = 1024 * 1024;
/// What a principal starts with (the gateway's `decide::SSH_PRINCIPAL_PREFIX`).
pub const SSH_PRINCIPAL_PREFIX: &str = "bc-node:";
/// The first line of every file `bcd` writes here.
const HEADER: &str = "# written by bcd from the control plane; changes are overwritten\n";

/// `[ssh]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SshConfig {
    /// The file `sshd_config` names as `TrustedUserCAKeys` (`/etc/ssh/bc_user_ca.pub`).
    pub trusted_user_ca_keys: PathBuf,
    /// `sshd_config`'s `AuthorizedPrincipalsFile`, `%u` for the account
    /// (`/etc/ssh/bc_principals/%u`).
    pub authorized_principals_file: String,
    /// The accounts a certificate may log in as; default `["root"]`.
    #[serde(default = "default_accounts")]
    pub accounts: Vec<String>,
    /// The sshd configuration `bcd doctor` checks; default `/etc/ssh/sshd_config`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sshd_config: Option<PathBuf>,
}

fn default_accounts() -> Vec<String> {
    vec!["root".into()]
}

impl SshConfig {
    /// Checks what a configuration file gave.
    pub fn validate(&self) -> Result<(), String> {
        if !self.trusted_user_ca_keys.is_absolute() {
            return Err("[ssh] trusted_user_ca_keys must be an absolute path".into());
        }
        if !self.authorized_principals_file.starts_with('/') {
            return Err("[ssh] authorized_principals_file must be an absolute path".into());
        }
        if self.accounts.is_empty() || self.accounts.len() > SSH_ACCOUNTS_MAX {
            return Err(format!("[ssh] accounts lists 1 to {SSH_ACCOUNTS_MAX} accounts"));
        }
        if let Some(bad) = self.accounts.iter().find(|a| !is_unix_account(a)) {
            return Err(format!("[ssh] accounts: {bad:?} is not a Unix account name"));
        }
        if self.accounts.len() > 1 && !self.authorized_principals_file.contains("%u") {
            return Err("[ssh] authorized_principals_file needs %u when accounts lists more than one".into());
        }
        Ok(())
    }

    /// The principals file of `account`: `%u` replaced as sshd does.
    pub fn principals_path(&self, account: &str) -> PathBuf {
        PathBuf::from(self.authorized_principals_file.replace("%u", account))
    }

    pub fn sshd_config_path(&self) -> PathBuf {
        self.sshd_config.clone().unwrap_or_else(|| PathBuf::from(SSHD_CONFIG_DEFAULT))
    }
}

/// `[a-z_][a-z0-9_-]{0,31}`.
fn is_unix_account(account: &str) -> bool {
    let mut chars = account.chars();
    account.len() <= 32
        && chars.next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// Whether `line` looks like one OpenSSH Ed25519 or ECDSA public key line (sshd checks it
/// properly; this keeps anything else, a second line above all, out of the file).
fn is_ca_key_line(line: &str) -> bool {
    let mut parts = line.split(' ');
    let algorithm_ok = parts.next().is_some_and(|a| a == "ssh-ed25519" || a.starts_with("ecdsa-sha2-nistp"));
    let base64_ok = parts
        .next()
        .is_some_and(|b| !b.is_empty() && b.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'+' || c == b'/' || c == b'='));
    algorithm_ok && base64_ok && line.len() <= SSH_CA_KEY_BYTES_MAX && line.chars().all(|c| c.is_ascii_graphic() || c == ' ')
}

/// The files to write for `node_id` trusting `ca_keys`: `(path, contents)`, the CA file first.
/// `None` when `ca_keys` is empty (nothing to change); an error names a key line refused.
pub fn planned_files(config: &SshConfig, node_id: &str, ca_keys: &[String]) -> Result<Option<Vec<(PathBuf, String)>>, String> {
    if ca_keys.is_empty() {
        return Ok(None);
    }
    if ca_keys.len() > SSH_CA_KEYS_MAX {
        return Err(format!("the gateway sent {} SSH CA keys, more than {SSH_CA_KEYS_MAX}", ca_keys.len()));
    }
    if let Some(bad) = ca_keys.iter().position(|k| !is_ca_key_line(k)) {
        return Err(format!("SSH CA key {bad} from the gateway is not one Ed25519 or ECDSA public key line"));
    }
    let mut files = vec![(config.trusted_user_ca_keys.clone(), format!("{HEADER}{}\n", ca_keys.join("\n")))];
    for account in &config.accounts {
        let principal = format!("{SSH_PRINCIPAL_PREFIX}{node_id}:{account}");
        files.push((config.principals_path(account), format!("{HEADER}{principal}\n")));
    }
    Ok(Some(files))
}

/// Writes the files [`planned_files`] gives whose contents differ from what is on disk;
/// returns the paths written.
pub fn install(config: &SshConfig, node_id: &str, ca_keys: &[String]) -> Result<Vec<PathBuf>, String> {
    let Some(files) = planned_files(config, node_id, ca_keys)? else { return Ok(Vec::new()) };
    let mut written = Vec::new();
    for (path, contents) in files {
        if std::fs::read_to_string(&path).is_ok_and(|current| current == contents) {
            continue;
        }
        write_atomically(&path, contents.as_bytes()).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

/// [`install`] as the driver runs it on each welcome: what it wrote, or why it could not, goes
/// to the log; a failure does not end the session (sshd keeps the files it had).
pub fn install_logged(config: &SshConfig, node_id: &str, ca_keys: &[String]) {
    match install(config, node_id, ca_keys) {
        Ok(written) if written.is_empty() => {}
        Ok(written) => {
            let files: Vec<String> = written.iter().map(|p| p.display().to_string()).collect();
            tracing::info!(files = %files.join(", "), keys = ca_keys.len(), "installed the SSH user CA for sshd");
        }
        Err(e) => tracing::warn!(error = %e, "cannot install the SSH user CA for sshd"),
    }
}

/// Pairs each key line with the end of its trust: `until_ms` is parallel to `keys` (the
/// protocol's `until_ms`), 0 or absent meaning none.
pub fn keys_with_ends(keys: &[String], until_ms: &[u64]) -> Vec<(String, Option<u64>)> {
    keys.iter().enumerate().map(|(i, k)| (k.clone(), until_ms.get(i).copied().filter(|&u| u > 0))).collect()
}

/// The keys still trusted at `now_ms`, in the order given: those whose end is not reached.
pub fn keys_trusted_at(keys: &[(String, Option<u64>)], now_ms: u64) -> Vec<String> {
    keys.iter().filter(|(_, until)| until.is_none_or(|u| u > now_ms)).map(|(k, _)| k.clone()).collect()
}

/// When [`keys_trusted_at`] next gives less after `now_ms`: the earliest end still ahead.
pub fn next_end_after(keys: &[(String, Option<u64>)], now_ms: u64) -> Option<u64> {
    keys.iter().filter_map(|(_, until)| *until).filter(|&u| u > now_ms).min()
}

/// `[ssh]` on a running node: the CA keys of the gateway's last word (a welcome, or
/// `SshUserCaKeys`) with the end of each one's trust, installed on every message and again when
/// an end passes. The driver feeds it; what to write is [`keys_trusted_at`]'s, pure.
#[derive(Debug)]
pub struct SshInstaller {
    config: SshConfig,
    node: String,
    keys: Vec<(String, Option<u64>)>,
    /// The next end of a key's trust, when the file is written again without a message.
    next_end_ms: Option<u64>,
}

impl SshInstaller {
    pub fn new(config: SshConfig, node: String) -> Self {
        Self { config, node, keys: Vec::new(), next_end_ms: None }
    }

    /// A message from the gateway: a welcome's or an `SshUserCaKeys`' keys replace those held
    /// and are installed (an empty list changes nothing); any other message is not this one's.
    pub fn received(&mut self, msg: &bc_proto::gateway_message::Msg, now_ms: u64) {
        use bc_proto::gateway_message::Msg;
        let keys = match msg {
            Msg::Welcome(w) => keys_with_ends(&w.ssh_user_ca_keys, &w.ssh_user_ca_keys_until_ms),
            Msg::SshUserCaKeys(k) => keys_with_ends(&k.keys, &k.until_ms),
            _ => return,
        };
        if keys.is_empty() {
            return;
        }
        self.keys = keys;
        self.install(now_ms);
    }

    /// On every tick of the driver: once a key's trust has ended, installs the keys left.
    pub fn tick(&mut self, now_ms: u64) {
        if self.next_end_ms.is_some_and(|end| end <= now_ms) {
            self.install(now_ms);
        }
    }

    fn install(&mut self, now_ms: u64) {
        self.next_end_ms = next_end_after(&self.keys, now_ms);
        install_logged(&self.config, &self.node, &keys_trusted_at(&self.keys, now_ms));
    }
}

/// Writes `path` through a temporary file beside it, 0644, synced, then renamed over it.
fn write_atomically(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temporary = parent.join(format!(".{name}.bcd-{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(&temporary)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        file.write_all(contents)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result
}

/// The first value sshd takes for `keyword` in `text` (sshd keeps the first one it reads),
/// from the global part (before any `Match`). `Include`d files are not followed.
fn sshd_setting<'a>(text: &'a str, keyword: &str) -> Option<&'a str> {
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line.split_once(|c: char| c.is_whitespace() || c == '=').unwrap_or((line, ""));
        if key.eq_ignore_ascii_case("match") {
            return None;
        }
        if key.eq_ignore_ascii_case(keyword) {
            return Some(value.trim_start_matches(|c: char| c.is_whitespace() || c == '=').trim());
        }
    }
    None
}

/// `doctor`'s verdict on `sshd_config` (its text, or `None` if there is none to read).
pub fn sshd_config_check(config: &SshConfig, path: &Path, text: Option<&str>) -> Check {
    const NAME: &str = "ssh";
    let Some(text) = text else {
        return Check::warn(
            NAME,
            format!("no sshd configuration at {}: break-glass certificates are not accepted here", path.display()),
            "install openssh-server, or set [ssh] sshd_config to the file sshd reads",
        );
    };
    let ca = config.trusted_user_ca_keys.to_string_lossy();
    let mut missing = Vec::new();
    if sshd_setting(text, "TrustedUserCAKeys") != Some(ca.as_ref()) {
        missing.push(format!("TrustedUserCAKeys {ca}"));
    }
    if sshd_setting(text, "AuthorizedPrincipalsFile") != Some(config.authorized_principals_file.as_str()) {
        missing.push(format!("AuthorizedPrincipalsFile {}", config.authorized_principals_file));
    }
    if missing.is_empty() {
        return Check::ok(NAME, format!("{} names the CA and principals files bcd writes", path.display()));
    }
    Check::fail(
        NAME,
        format!("{} does not say {} (before any Match)", path.display(), missing.join(" and ")),
        format!("add to {}: {}; then reload sshd", path.display(), missing.join("; ")),
    )
}

/// `doctor`'s check: reads the sshd configuration `[ssh]` names (bounded) and judges it.
pub fn sshd_check(config: &SshConfig) -> Check {
    let path = config.sshd_config_path();
    let text = std::fs::File::open(&path).ok().and_then(|file| {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(file, SSHD_CONFIG_BYTES_MAX), &mut text).ok().map(|_| text)
    });
    sshd_config_check(config, &path, text.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Status;

    const CA: &str =
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGPp5cSj0ubxLBNKS9nHc9vlsXR+lxeUHkpUqc6yIaLy better-compute-ssh-user-ca";

    fn config(dir: &Path) -> SshConfig {
        SshConfig {
            trusted_user_ca_keys: dir.join("ca.pub"),
            authorized_principals_file: format!("{}/principals/%u", dir.display()),
            accounts: vec!["root".into(), "ops".into()],
            sshd_config: None,
        }
    }

    #[test]
    fn the_ca_keys_and_each_accounts_principal_are_written_0644_and_only_on_change() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path());
        config.validate().unwrap();
        let written = install(&config, "node_01", &[CA.to_owned()]).unwrap();
        assert_eq!(written.len(), 3);
        let ca = std::fs::read_to_string(dir.path().join("ca.pub")).unwrap();
        assert!(ca.ends_with(&format!("{CA}\n")), "{ca}");
        let root = std::fs::read_to_string(dir.path().join("principals/root")).unwrap();
        assert_eq!(root.lines().last(), Some("bc-node:node_01:root"));
        let ops = std::fs::read_to_string(dir.path().join("principals/ops")).unwrap();
        assert_eq!(ops.lines().last(), Some("bc-node:node_01:ops"));
        let mode = std::fs::metadata(dir.path().join("ca.pub")).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        assert!(install(&config, "node_01", &[CA.to_owned()]).unwrap().is_empty(), "unchanged");
        assert!(install(&config, "node_01", &[]).unwrap().is_empty(), "no keys: nothing changes");
        assert!(dir.path().join("ca.pub").exists());
        let rotated = install(&config, "node_01", &[CA.to_owned(), CA.replace("IGPp", "IGPq")]).unwrap();
        assert_eq!(rotated, vec![dir.path().join("ca.pub")]);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        assert_eq!(leftovers.len(), 2, "{leftovers:?}");
    }

    #[test]
    fn a_ca_line_that_is_not_one_public_key_is_refused_and_nothing_written() {
        let dir = tempfile::tempdir().unwrap();
        let config = config(dir.path());
        for bad in [format!("{CA}\nssh-ed25519 AAAA evil"), "ssh-rsa AAAAB3 x".into(), "ssh-ed25519".into(), "".into()] {
            assert!(install(&config, "node_01", std::slice::from_ref(&bad)).is_err(), "{bad:?}");
        }
        assert!(install(&config, "node_01", &vec![CA.to_owned(); SSH_CA_KEYS_MAX + 1]).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn the_configuration_is_checked() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path());
        c.authorized_principals_file = "/etc/ssh/principals".into();
        assert!(c.validate().unwrap_err().contains("%u"));
        c.accounts = vec!["Root".into()];
        assert!(c.validate().is_err());
        c.accounts = vec!["root".into()];
        c.validate().unwrap();
        c.trusted_user_ca_keys = "ca.pub".into();
        assert!(c.validate().is_err());
        let parsed: SshConfig =
            toml::from_str("trusted_user_ca_keys = \"/etc/ssh/ca.pub\"\nauthorized_principals_file = \"/etc/ssh/p/%u\"\n")
                .unwrap();
        assert_eq!(parsed.accounts, ["root"]);
        assert_eq!(parsed.sshd_config_path(), Path::new(SSHD_CONFIG_DEFAULT));
    }

    #[test]
    fn doctor_reads_the_global_settings_sshd_would_take() {
        let c = SshConfig {
            trusted_user_ca_keys: "/etc/ssh/ca.pub".into(),
            authorized_principals_file: "/etc/ssh/p/%u".into(),
            accounts: vec!["root".into()],
            sshd_config: None,
        };
        let path = Path::new("/etc/ssh/sshd_config");
        let good = "# comment\nPort 22\ntrustedusercakeys /etc/ssh/ca.pub\nAuthorizedPrincipalsFile=/etc/ssh/p/%u\n";
        assert_eq!(sshd_config_check(&c, path, Some(good)).status, Status::Ok);
        let first_wins = "TrustedUserCAKeys /other\nTrustedUserCAKeys /etc/ssh/ca.pub\nAuthorizedPrincipalsFile /etc/ssh/p/%u\n";
        let check = sshd_config_check(&c, path, Some(first_wins));
        assert_eq!(check.status, Status::Fail);
        assert!(check.message.contains("TrustedUserCAKeys /etc/ssh/ca.pub"), "{}", check.message);
        let in_match = "Match User root\n  TrustedUserCAKeys /etc/ssh/ca.pub\n  AuthorizedPrincipalsFile /etc/ssh/p/%u\n";
        assert_eq!(sshd_config_check(&c, path, Some(in_match)).status, Status::Fail);
        assert_eq!(sshd_config_check(&c, path, None).status, Status::Warn);
    }

    fn welcome(keys: &[&str], until_ms: &[u64]) -> bc_proto::gateway_message::Msg {
        bc_proto::gateway_message::Msg::Welcome(bc_proto::Welcome {
            ssh_user_ca_keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            ssh_user_ca_keys_until_ms: until_ms.to_vec(),
            ..Default::default()
        })
    }

    fn ca_lines(dir: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(dir.join("ca.pub")).unwrap();
        text.lines().filter(|l| !l.starts_with('#')).map(str::to_owned).collect()
    }

    #[test]
    fn a_replaced_ca_is_trusted_beside_the_new_one_until_its_grace_ends_by_the_nodes_clock() {
        let dir = tempfile::tempdir().unwrap();
        let old = CA.replace("IGPp", "IGPq");
        let mut installer = SshInstaller::new(config(dir.path()), "node_01".into());
        installer.received(&welcome(&[CA], &[]), 1_000);
        assert_eq!(ca_lines(dir.path()), [CA]);
        // A rotation: the new CA first, the old one until 5 000.
        let rotated = bc_proto::gateway_message::Msg::SshUserCaKeys(bc_proto::SshUserCaKeys {
            keys: vec![CA.to_owned(), old.clone()],
            until_ms: vec![0, 5_000],
        });
        installer.received(&rotated, 2_000);
        assert_eq!(ca_lines(dir.path()), [CA.to_owned(), old.clone()]);
        installer.tick(4_999);
        assert_eq!(ca_lines(dir.path()).len(), 2);
        // The gateway says nothing more (cut off); the node's own clock ends the grace.
        installer.tick(5_000);
        assert_eq!(ca_lines(dir.path()), [CA]);
        // A welcome that still lists the old one after its end (a gateway's clock behind) does
        // not bring it back.
        installer.received(&welcome(&[CA, &old], &[0, 5_000]), 6_000);
        assert_eq!(ca_lines(dir.path()), [CA]);
        // Other messages and empty lists change nothing.
        installer.received(&bc_proto::gateway_message::Msg::HeartbeatAck(bc_proto::HeartbeatAck {}), 7_000);
        installer.received(&welcome(&[], &[]), 7_000);
        assert_eq!(ca_lines(dir.path()), [CA]);
    }

    #[test]
    fn the_ends_pair_with_their_keys_and_a_missing_end_is_none() {
        let keys = keys_with_ends(&["a".into(), "b".into(), "c".into()], &[0, 9]);
        assert_eq!(keys, [("a".to_owned(), None), ("b".to_owned(), Some(9)), ("c".to_owned(), None)]);
        assert_eq!(keys_trusted_at(&keys, 8), ["a", "b", "c"]);
        assert_eq!(keys_trusted_at(&keys, 9), ["a", "c"]);
        assert_eq!((next_end_after(&keys, 0), next_end_after(&keys, 9)), (Some(9), None));
    }
}
