//! `ssh-cert`: break-glass SSH to a node with a node-bound OpenSSH user certificate.
//!
//! The user's own public key goes to `nodes.issueSshCert`; the private key never leaves the
//! machine: a `--key` that is not a `.pub` file, or that holds a private key, is refused before
//! anything is sent. The answer is checked before use (an OpenSSH user certificate for this
//! very key, whose one principal is the one of the node and account asked for, valid no
//! longer than the minutes asked), else `INVALID_RESPONSE` and nothing is written. The certificate goes beside the key as
//! `KEY-cert.pub`, where `ssh -i KEY` finds it. With `--connect HOST` the user's `ssh` runs with
//! exactly `-i KEY -o CertificateFile=CERT -o IdentitiesOnly=yes -l ACCOUNT -- HOST [command]`;
//! `HOST` is checked to be a host name or an address (never an option) before a certificate is
//! issued, and the command exits with ssh's status (`REMOTE_EXIT`; 255 if ssh was killed).

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use bc_core::id::NodeId;
use bc_projections::decide::ssh_cert::{SSH_CERT_MINUTES_DEFAULT, SSH_CERT_MINUTES_MAX, is_unix_account, ssh_principal};
use serde_json::{Value, json};
use ssh_key::certificate::CertType;
use ssh_key::{Algorithm, Certificate, PublicKey};

use super::{Context, check_id};
use crate::client::CliError;
use crate::output::Format;

/// The largest key file read.
pub const KEY_FILE_BYTES_MAX: u64 = 64 * 1024;
/// The longest `--connect` host name.
pub const HOST_CHARS_MAX: usize = 253;
/// The status when ssh was ended by a signal, as ssh itself reports a broken connection.
pub const SIGNALLED_EXIT_STATUS: u8 = 255;

/// `ssh-cert`.
#[derive(clap::Args, Debug)]
pub struct SshCertArgs {
    /// The node the certificate is for.
    #[arg(long)]
    pub node: String,
    /// Your public key (`.pub`); default `~/.ssh/id_ed25519.pub`, else `~/.ssh/id_ecdsa.pub`.
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// The Unix account to log in as.
    #[arg(long, default_value = "root")]
    pub account: String,
    /// How long the certificate is valid, 1 to 60.
    #[arg(long, default_value_t = SSH_CERT_MINUTES_DEFAULT)]
    pub minutes: u32,
    /// Then run ssh to this host name or address with the certificate.
    #[arg(long, value_name = "HOST")]
    pub connect: Option<String>,
    /// The OpenSSH client `--connect` runs.
    #[arg(long, default_value = "ssh")]
    pub ssh: PathBuf,
    /// The command ssh runs on the node (after `--`; needs `--connect`); none: a shell.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

pub async fn run(ctx: &Context, args: SshCertArgs) -> Result<(), CliError> {
    // Everything that can be refused locally is, before a certificate is issued.
    let node = check_id::<NodeId>("--node", &args.node)?;
    if !args.command.is_empty() && args.connect.is_none() {
        return Err(CliError::usage("a command after -- runs only with --connect HOST"));
    }
    if let Some(host) = &args.connect {
        check_host(host)?;
    }
    if !is_unix_account(&args.account) {
        return Err(CliError::usage(format!("--account {:?} is not a Unix account name", args.account)));
    }
    if !(1..=SSH_CERT_MINUTES_MAX).contains(&args.minutes) {
        return Err(CliError::usage(format!("--minutes must be 1 to {SSH_CERT_MINUTES_MAX}")));
    }
    let key_path = match args.key {
        Some(path) => path,
        None => default_key_path()?,
    };
    let (public_line, public_key) = read_public_key(&key_path)?;
    let mut body = ctx.tenant_body()?;
    body.insert("nodeId".into(), json!(node));
    body.insert("publicKey".into(), json!(public_line));
    body.insert("account".into(), json!(args.account));
    body.insert("minutes".into(), json!(args.minutes));
    let answer = ctx.client()?.call("nodes.issueSshCert", &Value::Object(body), None).await?;
    let certificate = check_answer(&answer, &public_key, &ssh_principal(&node.to_string(), &args.account), args.minutes)?;
    let cert_path = certificate_path(&key_path);
    write_certificate(&cert_path, &certificate)?;
    let Some(host) = args.connect else {
        let mut shown = answer;
        if let Value::Object(map) = &mut shown {
            map.insert("certificateFile".into(), json!(cert_path.display().to_string()));
        }
        return ctx.print(&shown, Format::Json);
    };
    eprintln!("certificate: {} (valid until {})", cert_path.display(), answer["validBefore"]);
    let arguments = ssh_arguments(&private_key_path(&key_path), &cert_path, &args.account, &host, &args.command);
    let status = std::process::Command::new(&args.ssh)
        .args(&arguments)
        .status()
        .map_err(|e| CliError::new("UNAVAILABLE", format!("cannot run {}: {e}", args.ssh.display())))?;
    remote_exit(status.code())
}

/// ssh's exit as this command's: 0 is success, any other status (or a signal: 255) is
/// `REMOTE_EXIT` carrying it.
fn remote_exit(code: Option<i32>) -> Result<(), CliError> {
    let status = match code {
        Some(0) => return Ok(()),
        Some(code) => u8::try_from(code).unwrap_or(SIGNALLED_EXIT_STATUS),
        None => SIGNALLED_EXIT_STATUS,
    };
    let mut error = CliError::new("REMOTE_EXIT", format!("ssh exited with status {status}"));
    error.details = Some(json!({ "exitStatus": status }));
    Err(error)
}

fn default_key_path() -> Result<PathBuf, CliError> {
    let home =
        std::env::var_os("HOME").map(PathBuf::from).ok_or_else(|| CliError::usage("HOME is not set: give --key PATH.pub"))?;
    let candidates = [home.join(".ssh/id_ed25519.pub"), home.join(".ssh/id_ecdsa.pub")];
    candidates.iter().find(|p| p.exists()).cloned().ok_or_else(|| {
        CliError::usage("no ~/.ssh/id_ed25519.pub nor ~/.ssh/id_ecdsa.pub")
            .hint("make one with ssh-keygen -t ed25519, or give --key PATH.pub")
    })
}

/// Reads the user's public key: a `.pub` file holding one OpenSSH Ed25519 or ECDSA public key,
/// and no private key. Returns the line sent and the key.
pub fn read_public_key(path: &Path) -> Result<(String, PublicKey), CliError> {
    if path.extension().is_none_or(|e| e != "pub") {
        return Err(CliError::usage(format!(
            "--key {} is not a .pub file: give the public key, never the private one",
            path.display()
        ))
        .hint("ssh-keygen writes the public key beside the private one as KEY.pub"));
    }
    let file = std::fs::File::open(path).map_err(|e| CliError::usage(format!("cannot read --key {}: {e}", path.display())))?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, KEY_FILE_BYTES_MAX + 1), &mut text)
        .map_err(|e| CliError::usage(format!("cannot read --key {}: {e}", path.display())))?;
    if text.contains("PRIVATE KEY") {
        return Err(CliError::usage(format!("--key {} holds a private key; nothing was sent", path.display()))
            .hint("give the public key file (ssh-keygen -y -f KEY > KEY.pub makes one)"));
    }
    if text.len() as u64 > KEY_FILE_BYTES_MAX {
        return Err(CliError::usage(format!("--key {} is larger than a public key file", path.display())));
    }
    let line = text.lines().map(str::trim).find(|l| !l.is_empty() && !l.starts_with('#')).unwrap_or_default();
    let key = PublicKey::from_openssh(line)
        .map_err(|_| CliError::usage(format!("--key {} is not an OpenSSH public key", path.display())))?;
    if !matches!(key.algorithm(), Algorithm::Ed25519 | Algorithm::Ecdsa { .. }) {
        return Err(CliError::usage(format!(
            "--key {} is a {} key; only Ed25519 and ECDSA keys are certified",
            path.display(),
            key.algorithm().as_str()
        )));
    }
    Ok((line.to_owned(), key))
}

/// `KEY.pub` → `KEY` (what `ssh -i` takes).
pub fn private_key_path(public: &Path) -> PathBuf {
    public.with_extension("")
}

/// `KEY.pub` → `KEY-cert.pub`, where ssh looks for the certificate of `KEY`.
pub fn certificate_path(public: &Path) -> PathBuf {
    let private = private_key_path(public);
    let mut name = private.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push("-cert.pub");
    private.with_file_name(name)
}

/// A host name (letters, digits, `-`, `_`, `.`, not starting with `-`) or an IP address: never
/// anything ssh would read as an option.
pub fn check_host(host: &str) -> Result<(), CliError> {
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    let name_ok = !host.is_empty()
        && host.len() <= HOST_CHARS_MAX
        && !host.starts_with(['-', '.'])
        && host.split('.').all(|label| {
            !label.is_empty()
                && !label.starts_with('-')
                && label.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        });
    if name_ok {
        return Ok(());
    }
    Err(CliError::usage(format!("--connect {:?} is not a host name or an IP address", crate::output::safe_text(host)))
        .hint("give the node's address (10.0.0.5) or name; ssh options go in your ssh configuration"))
}

/// Checks the server's answer: an OpenSSH user certificate for `key` whose one principal is
/// `principal`, the one of the node and account asked for (and what the answer says), valid for
/// no longer than the `minutes` asked; `INVALID_RESPONSE` otherwise.
pub fn check_answer(answer: &Value, key: &PublicKey, principal: &str, minutes: u32) -> Result<Certificate, CliError> {
    let invalid =
        |why: &str| CliError::new("INVALID_RESPONSE", format!("nodes.issueSshCert answered {why}; nothing was written"));
    let text = answer["certificate"].as_str().ok_or_else(|| invalid("no certificate"))?;
    if text.trim_end().contains('\n') {
        return Err(invalid("more than one line as the certificate"));
    }
    let certificate =
        Certificate::from_openssh(text.trim()).map_err(|_| invalid("a certificate that is not an OpenSSH certificate"))?;
    if certificate.cert_type() != CertType::User {
        return Err(invalid("a host certificate"));
    }
    if certificate.public_key() != key.key_data() {
        return Err(invalid("a certificate for another key"));
    }
    if answer["principal"].as_str() != Some(principal) || certificate.valid_principals() != [principal.to_owned()] {
        return Err(invalid(&format!("a certificate whose principals are not {principal}, the node's and account's asked for")));
    }
    let window_s = certificate.valid_before().saturating_sub(certificate.valid_after());
    if window_s > u64::from(minutes) * 60 {
        return Err(invalid(&format!("a certificate valid for {window_s} s, longer than the {minutes} minutes asked")));
    }
    Ok(certificate)
}

/// Writes the certificate (public, 0644) whole, through a temporary file beside it.
fn write_certificate(path: &Path, certificate: &Certificate) -> Result<(), CliError> {
    use std::os::unix::fs::PermissionsExt;
    let text = certificate.to_openssh().map_err(|e| CliError::new("INTERNAL", format!("encoding the certificate: {e}")))?;
    let failed = |e: std::io::Error| CliError::new("INTERNAL", format!("cannot write {}: {e}", path.display()));
    let mut temporary = path.as_os_str().to_os_string();
    temporary.push(format!(".tmp-{}", std::process::id()));
    let temporary = PathBuf::from(temporary);
    let result = (|| {
        let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(&temporary)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        file.write_all(format!("{text}\n").as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.map_err(failed)
}

/// ssh's arguments, exactly: `-i KEY -o CertificateFile=CERT -o IdentitiesOnly=yes -l ACCOUNT --
/// HOST [command…]`.
pub fn ssh_arguments(private_key: &Path, certificate: &Path, account: &str, host: &str, command: &[OsString]) -> Vec<OsString> {
    let mut certificate_option = OsString::from("CertificateFile=");
    certificate_option.push(certificate);
    let mut arguments: Vec<OsString> = vec![
        "-i".into(),
        private_key.into(),
        "-o".into(),
        certificate_option,
        "-o".into(),
        "IdentitiesOnly=yes".into(),
        "-l".into(),
        account.into(),
        "--".into(),
        host.into(),
    ];
    arguments.extend(command.iter().cloned());
    arguments
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGPp5cSj0ubxLBNKS9nHc9vlsXR+lxeUHkpUqc6yIaLy me@laptop";

    #[test]
    fn the_certificate_goes_beside_the_key_where_ssh_finds_it() {
        let public = Path::new("/home/me/.ssh/id_ed25519.pub");
        assert_eq!(private_key_path(public), Path::new("/home/me/.ssh/id_ed25519"));
        assert_eq!(certificate_path(public), Path::new("/home/me/.ssh/id_ed25519-cert.pub"));
        assert_eq!(certificate_path(Path::new("k.pub")), Path::new("k-cert.pub"));
    }

    #[test]
    fn hosts_are_names_or_addresses_never_options() {
        for good in ["10.0.0.5", "::1", "127.0.0.1", "node-1.example.com", "gpu_7", "localhost"] {
            check_host(good).unwrap();
        }
        for bad in ["-oProxyCommand=sh", "-p", "", "a b", "host;rm", "user@host", ".x", "a..b", "-x.example", "h\n"] {
            assert_eq!(check_host(bad).unwrap_err().code, "INVALID_ARGUMENT", "{bad:?}");
        }
    }

    #[test]
    fn the_ssh_arguments_are_exactly_the_documented_ones() {
        let arguments =
            ssh_arguments(Path::new("/k"), Path::new("/k-cert.pub"), "root", "10.0.0.5", &["echo".into(), "ok".into()]);
        let text: Vec<_> = arguments.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(
            text,
            [
                "-i",
                "/k",
                "-o",
                "CertificateFile=/k-cert.pub",
                "-o",
                "IdentitiesOnly=yes",
                "-l",
                "root",
                "--",
                "10.0.0.5",
                "echo",
                "ok"
            ]
        );
    }

    #[test]
    fn a_private_key_or_a_file_that_is_not_a_pub_is_refused_before_anything_is_sent() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("id_ed25519");
        std::fs::write(&private, "-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n").unwrap();
        assert!(read_public_key(&private).unwrap_err().message.contains("not a .pub"));
        let disguised = dir.path().join("id_ed25519.pub");
        std::fs::write(&disguised, std::fs::read(&private).unwrap()).unwrap();
        let e = read_public_key(&disguised).unwrap_err();
        assert!(e.message.contains("holds a private key") && !e.message.contains("AAAA"), "{}", e.message);
        std::fs::write(&disguised, format!("{KEY}\n")).unwrap();
        let (line, _) = read_public_key(&disguised).unwrap();
        assert_eq!(line, KEY);
        std::fs::write(&disguised, "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQC7 x\n").unwrap();
        assert!(read_public_key(&disguised).is_err());
    }

    #[test]
    fn exit_statuses_pass_through_and_a_signal_is_255() {
        assert!(remote_exit(Some(0)).is_ok());
        let e = remote_exit(Some(7)).unwrap_err();
        assert_eq!((e.code.as_str(), e.details.unwrap()["exitStatus"].as_u64()), ("REMOTE_EXIT", Some(7)));
        assert_eq!(remote_exit(None).unwrap_err().details.unwrap()["exitStatus"], 255);
    }

    #[test]
    fn an_answer_that_is_not_a_user_certificate_for_this_key_is_invalid() {
        let key = PublicKey::from_openssh(KEY).unwrap();
        for answer in [
            json!({}),
            json!({ "certificate": "ssh-ed25519-cert-v01@openssh.com AAAA", "principal": "bc-node:n:root" }),
            json!({ "certificate": KEY }),
        ] {
            let e = check_answer(&answer, &key, "bc-node:node_01:root", 15).unwrap_err();
            assert_eq!(e.code, "INVALID_RESPONSE", "{answer}");
        }
    }

    #[test]
    fn only_a_user_certificate_for_this_key_this_node_and_account_and_the_minutes_asked_is_taken() {
        use bc_gateway::ssh_ca::{CertificateOrder, SshUserCa};
        let key = PublicKey::from_openssh(KEY).unwrap();
        let order = |principal, valid_before_s| CertificateOrder {
            principal,
            key_id: "caller=apikey:key_01 node=node_01 request=req_01",
            serial: 1,
            valid_after_s: 1_000,
            valid_before_s,
            event_id: "evt_01",
        };
        let ca = SshUserCa::from_seed(&[3; 32]);
        let sign = |principal, valid_before_s| ca.sign(&key, &order(principal, valid_before_s)).unwrap().to_openssh().unwrap();
        let asked = ssh_principal("node_01", "root");
        let certificate = sign("bc-node:node_01:root", 1_000 + 15 * 60);
        let answer = json!({ "certificate": certificate, "principal": "bc-node:node_01:root" });
        let taken = check_answer(&answer, &key, &asked, 15).unwrap();
        assert_eq!(taken.key_id(), "caller=apikey:key_01 node=node_01 request=req_01");
        // Longer than asked: refused.
        assert_eq!(check_answer(&answer, &key, &asked, 14).unwrap_err().code, "INVALID_RESPONSE");
        // Another node's, or another account's, even when the answer names it: refused.
        for principal in ["bc-node:node_02:root", "bc-node:node_01:admin"] {
            let other = json!({ "certificate": sign(principal, 1_000 + 60), "principal": principal });
            let e = check_answer(&other, &key, &asked, 15).unwrap_err();
            assert_eq!(e.code, "INVALID_RESPONSE", "{principal}");
            assert!(e.message.contains("bc-node:node_01:root"), "{}", e.message);
        }
        // The answer naming another principal than its certificate's: refused.
        let mislabelled = json!({ "certificate": certificate, "principal": "bc-node:node_02:root" });
        assert_eq!(check_answer(&mislabelled, &key, &asked, 15).unwrap_err().code, "INVALID_RESPONSE");
        let other_key =
            PublicKey::from_openssh("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAII9A0eG82lMzYlOAjRSvh8EskMEHT5D22bf0oi/ulU7R other")
                .unwrap();
        assert_eq!(check_answer(&answer, &other_key, &asked, 15).unwrap_err().code, "INVALID_RESPONSE");
    }
}
