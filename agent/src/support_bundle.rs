//! Support bundles: what an operator sends when asking for help, as one tar.gz written 0600,
//! never over an existing file. `bcd support-bundle` makes a node's ([`node_bundle`]);
//! `better-compute support-bundle` makes the control plane's with the same parts ([`Bundle`],
//! [`Redactor`], [`listing`], [`log_tail`], [`system_facts`], [`redact_toml`]).
//!
//! No secret goes in, by two means that do not rely on each other:
//! - what is collected never reads a secret's contents: a configuration's values under a key
//!   whose name says secret ([`is_secret_name`]), a URL's password and anything shaped like a
//!   token ([`looks_secret`]) are replaced by [`REDACTED`] before they are written; the data
//!   directory is listed by name, mode and size, never read;
//! - every file of the bundle is scrubbed at the end ([`Redactor::scrub`]) of every secret the
//!   caller knows of (the key files, the tokens), in each form it may take: as stored, its raw
//!   bytes, hex, base64 (standard and URL-safe, padded or not), and a PEM's body lines and DER.
//!
//! Bounds: [`LOG_LINES_MAX`] lines of at most [`LOG_LINE_BYTES_MAX`] bytes from the end of a log,
//! read from at most its last [`LOG_TAIL_BYTES_MAX`]; [`LISTING_ENTRIES_MAX`] entries of the
//! data directory to [`LISTING_DEPTH_MAX`] levels; secret files of at most
//! [`SECRET_FILE_BYTES_MAX`].

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Serialize;
use serde_json::{Value, json};

/// What a redacted value reads as.
pub const REDACTED: &str = "[REDACTED]";
/// The log lines a bundle takes by default.
pub const LOG_LINES_DEFAULT: usize = 1_000;
/// The most log lines a bundle takes.
pub const LOG_LINES_MAX: usize = 100_000;
/// A longer log line is cut to this.
pub const LOG_LINE_BYTES_MAX: usize = 4_096;
/// The most of a log's end read to find its last lines.
pub const LOG_TAIL_BYTES_MAX: u64 = 16 << 20;
/// The data directory's entries listed at most, and how deep.
pub const LISTING_ENTRIES_MAX: usize = 10_000;
pub const LISTING_DEPTH_MAX: usize = 3;
/// A file treated as a secret (a key, a token) is read up to this; a longer one is not a key.
pub const SECRET_FILE_BYTES_MAX: u64 = 64 * 1024;
/// Secrets shorter than this are not scrubbed (they would match ordinary text); every key and
/// token of the system is far longer.
pub const SECRET_CHARS_MIN: usize = 12;
/// A password given as such is scrubbed from this length.
pub const PASSWORD_CHARS_MIN: usize = 4;
/// What a configuration key's name holds when its value is a secret.
pub const SECRET_NAME_WORDS: &[&str] =
    &["token", "secret", "password", "passwd", "credential", "private", "apikey", "api_key", "seed", "cookie"];
/// Prefixes of the system's secrets and of PEM private keys: a value that starts with one is
/// redacted whatever its key's name.
pub const SECRET_PREFIXES: &[&str] = &["bcjt_", "whsec_", "bctt_", "bcs1:", "-----BEGIN"];

/// Whether a configuration key's name says its value is secret: it names a token, secret,
/// password, credential or private material, or is a key that is not a public pin, an id or a
/// path (`node_key`, `data_key`; not `log_key_pin`, `data_key_file`).
pub fn is_secret_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase().replace('-', "_");
    if SECRET_NAME_WORDS.iter().any(|w| name.contains(w)) {
        return true;
    }
    let public = ["_pin", "_pins", "_id", "_ids", "_file", "_path", "_dir", "_url"];
    name.contains("key") && !public.iter().any(|s| name.ends_with(s))
}

/// Whether a value is shaped like a secret: one of [`SECRET_PREFIXES`], or an API key's token
/// (`key_….SECRET`).
pub fn looks_secret(value: &str) -> bool {
    let v = value.trim();
    SECRET_PREFIXES.iter().any(|p| v.starts_with(p)) || (v.starts_with("key_") && v.contains('.'))
}

/// `text` with the password of every URL in it (`scheme://user:PASSWORD@host`) and every
/// libpq `password=…` replaced by [`REDACTED`].
pub fn redact_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        // The authority ends at the first '/', '?', '#' or whitespace; its userinfo at its last '@'.
        let end = tail.find(|c: char| c == '/' || c == '?' || c == '#' || c.is_whitespace()).unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(userinfo_end) => {
                let userinfo = &authority[..userinfo_end];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..=colon]);
                        out.push_str(REDACTED);
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[userinfo_end..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    redact_keywords(&out)
}

/// libpq's `password=VALUE` (a keyword/value connection string, or a URL's query).
fn redact_keywords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.to_ascii_lowercase().find("password=") {
        let (head, tail) = rest.split_at(at + "password=".len());
        out.push_str(head);
        let end = tail.find(|c: char| c.is_whitespace() || c == '&').unwrap_or(tail.len());
        out.push_str(REDACTED);
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// A string of a configuration, as a bundle shows it.
pub fn redact_string(name: &str, value: &str) -> String {
    if is_secret_name(name) || looks_secret(value) { REDACTED.to_owned() } else { redact_urls(value) }
}

/// A parsed TOML configuration with every secret replaced ([`redact_string`]); `name` is the
/// key the value sits under (an array's items take their array's).
pub fn redact_toml(name: &str, value: &toml::Value) -> toml::Value {
    match value {
        toml::Value::String(s) => toml::Value::String(redact_string(name, s)),
        toml::Value::Table(table) => toml::Value::Table(table.iter().map(|(k, v)| (k.clone(), redact_toml(k, v))).collect()),
        toml::Value::Array(items) => toml::Value::Array(items.iter().map(|v| redact_toml(name, v)).collect()),
        _ if is_secret_name(name) => toml::Value::String(REDACTED.to_owned()),
        other => other.clone(),
    }
}

/// A configuration file as a bundle shows it: parsed and redacted ([`redact_toml`]), or what was
/// wrong with it; never its text (a file that does not parse could hold anything).
pub fn config_file(path: &Path) -> Value {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) => return json!({ "path": path.display().to_string(), "error": format!("cannot read: {e}") }),
    };
    if meta.len() > SECRET_FILE_BYTES_MAX {
        return json!({ "path": path.display().to_string(), "error": format!("over {SECRET_FILE_BYTES_MAX} bytes: not read") });
    }
    let parsed = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read: {e}"))
        .and_then(|text| text.parse::<toml::Table>().map_err(|e| format!("does not parse as TOML: {}", e.message())));
    match parsed {
        Ok(table) => {
            let redacted = redact_toml("", &toml::Value::Table(table));
            json!({ "path": path.display().to_string(), "mode": mode_text(&meta), "settings": redacted })
        }
        Err(e) => json!({ "path": path.display().to_string(), "error": e }),
    }
}

/// The environment variables whose names start with one of `prefixes`, each value redacted as a
/// configuration's ([`redact_string`]).
pub fn environment(prefixes: &[&str]) -> Value {
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| prefixes.iter().any(|p| k.starts_with(p)))
        .map(|(k, v)| {
            let shown = redact_string(&k, &v);
            (k, shown)
        })
        .collect();
    vars.sort();
    Value::Object(vars.into_iter().map(|(k, v)| (k, Value::String(v))).collect())
}

/// The secrets a bundle is scrubbed of, each in every form it may be written in.
#[derive(Default)]
pub struct Redactor {
    needles: Vec<Vec<u8>>,
}

impl Redactor {
    pub fn new() -> Self {
        Self::default()
    }

    /// How many byte strings are scrubbed (every form of every secret).
    pub fn len(&self) -> usize {
        self.needles.len()
    }

    pub fn is_empty(&self) -> bool {
        self.needles.is_empty()
    }

    fn needle(&mut self, bytes: &[u8]) {
        // Raw key bytes are as short as 32; text forms below SECRET_CHARS_MIN are not secrets.
        if bytes.len() >= SECRET_CHARS_MIN.min(16) && !self.needles.iter().any(|n| n == bytes) {
            self.needles.push(bytes.to_vec());
        }
    }

    /// A password given as such (a database URL's): scrubbed however short, from
    /// [`PASSWORD_CHARS_MIN`] characters (ordinary words may go with it).
    pub fn password(&mut self, text: &str) {
        if text.len() >= PASSWORD_CHARS_MIN && !self.needles.iter().any(|n| n == text.as_bytes()) {
            self.needles.push(text.as_bytes().to_vec());
        }
        self.secret(text);
    }

    /// `bytes` and their hex and base64 forms.
    fn bytes_forms(&mut self, bytes: &[u8]) {
        use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
        if bytes.len() < 16 {
            return;
        }
        self.needle(bytes);
        self.needle(hex::encode(bytes).as_bytes());
        self.needle(hex::encode_upper(bytes).as_bytes());
        for engine in [&STANDARD, &STANDARD_NO_PAD, &URL_SAFE, &URL_SAFE_NO_PAD] {
            let text = engine.encode(bytes);
            self.needle(text.as_bytes());
            // Inside a longer base64 text, only the whole groups of three bytes encode alike.
            if text.len() > 8 {
                self.needle(&text.as_bytes()[..text.len() - 4]);
            }
        }
    }

    /// A secret as text (a token, a password, a key's hex): the text, and, when it decodes as
    /// hex or base64, its bytes in every form.
    pub fn secret(&mut self, text: &str) {
        use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
        let text = text.trim();
        if text.len() < SECRET_CHARS_MIN {
            return;
        }
        self.needle(text.as_bytes());
        if let Ok(bytes) = hex::decode(text) {
            self.bytes_forms(&bytes);
        }
        for engine in [&STANDARD, &STANDARD_NO_PAD, &URL_SAFE, &URL_SAFE_NO_PAD] {
            if let Ok(bytes) = engine.decode(text) {
                self.bytes_forms(&bytes);
            }
        }
        // An API key's token, `key_….SECRET`: its secret part alone too.
        if let Some((_, secret)) = text.split_once('.') {
            self.secret(secret);
        }
    }

    /// A file holding a secret (a key, a token, a PEM private key): its contents as text, each
    /// line, and a PEM's body lines and DER, in every form. A missing or larger file adds nothing.
    pub fn secret_file(&mut self, path: &Path) {
        let Ok(meta) = std::fs::metadata(path) else { return };
        if !meta.is_file() || meta.len() > SECRET_FILE_BYTES_MAX {
            return;
        }
        let Ok(bytes) = std::fs::read(path) else { return };
        self.bytes_forms(&bytes);
        let text = String::from_utf8_lossy(&bytes).into_owned();
        self.secret(&text);
        let mut body = String::new();
        for line in text.lines().map(str::trim) {
            if line.starts_with("-----") {
                if !body.is_empty() {
                    if let Ok(der) = base64::engine::general_purpose::STANDARD.decode(&body) {
                        self.bytes_forms(&der);
                    }
                    self.secret(&body);
                    body.clear();
                }
                continue;
            }
            self.secret(line);
            body.push_str(line);
        }
    }

    /// `bytes` with every secret replaced by [`REDACTED`].
    pub fn scrub(&self, bytes: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        // Longest first, so a secret's whole form goes before a part of it would.
        let mut needles: Vec<&Vec<u8>> = self.needles.iter().collect();
        needles.sort_by_key(|n| std::cmp::Reverse(n.len()));
        for needle in needles {
            if out.len() < needle.len() {
                continue;
            }
            let mut scrubbed = Vec::with_capacity(out.len());
            let mut i = 0;
            // From one occurrence of the needle's first byte to the next.
            while let Some(at) = out[i..].iter().position(|b| *b == needle[0]) {
                scrubbed.extend_from_slice(&out[i..i + at]);
                i += at;
                if out[i..].starts_with(needle) {
                    scrubbed.extend_from_slice(REDACTED.as_bytes());
                    i += needle.len();
                } else {
                    scrubbed.push(out[i]);
                    i += 1;
                }
            }
            scrubbed.extend_from_slice(&out[i..]);
            out = scrubbed;
        }
        out
    }
}

/// A file's mode as `0600`.
pub fn mode_text(meta: &std::fs::Metadata) -> String {
    use std::os::unix::fs::PermissionsExt;
    format!("{:04o}", meta.permissions().mode() & 0o7777)
}

/// One entry of a directory's listing.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    /// Relative to the listed directory.
    pub path: String,
    /// `file`, `dir`, `symlink`, `socket`, `other`.
    pub kind: &'static str,
    pub mode: String,
    pub bytes: u64,
    pub modified_ms: u64,
}

/// The entries under `dir` (not following links), to [`LISTING_DEPTH_MAX`] levels and at most
/// [`LISTING_ENTRIES_MAX`]: names, kinds, modes and sizes, never contents. The error when `dir`
/// cannot be read.
pub fn listing(dir: &Path) -> Result<Vec<Entry>, String> {
    use std::os::unix::fs::FileTypeExt;
    std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut entries = Vec::new();
    let mut pending: Vec<(PathBuf, usize)> = vec![(dir.to_path_buf(), 1)];
    while let Some((at, depth)) = pending.pop() {
        let Ok(read) = std::fs::read_dir(&at) else { continue };
        let mut names: Vec<PathBuf> = read.filter_map(|e| e.ok().map(|e| e.path())).collect();
        names.sort();
        for path in names {
            if entries.len() >= LISTING_ENTRIES_MAX {
                return Ok(entries);
            }
            let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
            let kind = meta.file_type();
            let kind = if kind.is_symlink() {
                "symlink"
            } else if kind.is_dir() {
                "dir"
            } else if kind.is_file() {
                "file"
            } else if kind.is_socket() {
                "socket"
            } else {
                "other"
            };
            if kind == "dir" && depth < LISTING_DEPTH_MAX {
                pending.push((path.clone(), depth + 1));
            }
            let modified_ms = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let relative = path.strip_prefix(dir).unwrap_or(&path).display().to_string();
            entries.push(Entry { path: relative, kind, mode: mode_text(&meta), bytes: meta.len(), modified_ms });
        }
    }
    Ok(entries)
}

/// Files of these kinds are never taken for keys by [`owner_only_files`]: logs, ledgers,
/// databases, pid files.
pub const NOT_KEY_SUFFIXES: &[&str] = &[".log", ".json", ".db", ".sqlite3", "-wal", "-shm", "-journal", ".pid", ".sock"];

/// The small files under `dir` (to [`LISTING_DEPTH_MAX`] levels, not following links, at most
/// [`LISTING_ENTRIES_MAX`] looked at) readable by their owner alone: keys and tokens as this
/// system writes them (0600, [`SECRET_FILE_BYTES_MAX`] at most), whatever their names and
/// wherever they sit (`dev --sim`'s machines keep their `node.key` under `sim/node-N/`), but for
/// [`NOT_KEY_SUFFIXES`].
pub fn owner_only_files(dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let mut files = Vec::new();
    let mut looked = 0usize;
    let mut pending: Vec<(PathBuf, usize)> = vec![(dir.to_path_buf(), 1)];
    while let Some((at, depth)) = pending.pop() {
        let Ok(read) = std::fs::read_dir(&at) else { continue };
        for entry in read.filter_map(|e| e.ok()) {
            looked += 1;
            if looked > LISTING_ENTRIES_MAX {
                files.sort();
                return files;
            }
            let path = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
            if meta.is_dir() {
                if depth < LISTING_DEPTH_MAX {
                    pending.push((path, depth + 1));
                }
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let key_like = meta.is_file() && meta.len() <= SECRET_FILE_BYTES_MAX && meta.permissions().mode() & 0o077 == 0;
            if key_like && !NOT_KEY_SUFFIXES.iter().any(|s| name.ends_with(s)) {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The last `lines` lines of the log at `path` (at most [`LOG_LINES_MAX`], each cut at
/// [`LOG_LINE_BYTES_MAX`]), read from at most its last [`LOG_TAIL_BYTES_MAX`] bytes.
pub fn log_tail(path: &Path, lines: usize) -> Result<Vec<u8>, String> {
    let lines = lines.min(LOG_LINES_MAX);
    let mut file = std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let start = len.saturating_sub(LOG_TAIL_BYTES_MAX);
    file.seek(std::io::SeekFrom::Start(start)).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    file.take(LOG_TAIL_BYTES_MAX).read_to_end(&mut bytes).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut all: Vec<&[u8]> = bytes.split(|b| *b == b'\n').collect();
    if all.last().is_some_and(|l| l.is_empty()) {
        all.pop();
    }
    // A read that began inside the file began inside a line: that part of it is dropped.
    if start > 0 && !all.is_empty() {
        all.remove(0);
    }
    let mut out = Vec::new();
    for line in &all[all.len().saturating_sub(lines)..] {
        out.extend_from_slice(&line[..line.len().min(LOG_LINE_BYTES_MAX)]);
        out.push(b'\n');
    }
    Ok(redact_token_shapes(&redact_urls(&String::from_utf8_lossy(&out))).into_bytes())
}

/// `text` with everything shaped like one of the system's secrets replaced by [`REDACTED`]: a
/// value after one of [`SECRET_PREFIXES`] (a join token, a webhook secret, a ticket, a sealed
/// value), and the secret half of an API key's token (`key_<26>.SECRET`, its key id kept).
pub fn redact_token_shapes(text: &str) -> String {
    let token_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '+' | '/' | '=');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let next = SECRET_PREFIXES.iter().filter(|p| !p.starts_with('-')).filter_map(|p| rest.find(p).map(|at| (at, *p))).min();
        let api_key = rest.find("key_").filter(|at| {
            let after = &rest[at + 4..];
            after.len() > 27 && after.as_bytes()[..26].iter().all(u8::is_ascii_alphanumeric) && after.as_bytes()[26] == b'.'
        });
        match (next, api_key) {
            (Some((at, prefix)), key) if key.is_none_or(|k| at < k) => {
                out.push_str(&rest[..at]);
                out.push_str(REDACTED);
                let tail = &rest[at + prefix.len()..];
                rest = &tail[tail.find(|c: char| !token_char(c)).unwrap_or(tail.len())..];
            }
            (_, Some(at)) => {
                // The key id stays (it names the key, it opens nothing); the secret goes.
                out.push_str(&rest[..at + 4 + 27]);
                out.push_str(REDACTED);
                let tail = &rest[at + 4 + 27..];
                rest = &tail[tail.find(|c: char| !token_char(c)).unwrap_or(tail.len())..];
            }
            _ => break,
        }
    }
    out.push_str(rest);
    out
}

/// The rustc this build was made with (`build.rs`), when it could be asked.
pub const RUSTC_VERSION: &str = env!("BC_RUSTC_VERSION");

/// The host: its OS (`/etc/os-release`), kernel, architecture, and the rustc of this build.
pub fn system_facts() -> Value {
    let read = |path: &str| std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned());
    let os = read("/etc/os-release")
        .and_then(|text| text.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=")).map(|v| v.trim_matches('"').to_owned()));
    json!({
        "os": os,
        "kernel": read("/proc/sys/kernel/osrelease"),
        "kernelVersion": read("/proc/sys/kernel/version"),
        "arch": std::env::consts::ARCH,
        "rustc": (!RUSTC_VERSION.is_empty()).then_some(RUSTC_VERSION),
    })
}

/// Why a bundle was not written.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// `--out` exists: a bundle is never written over a file.
    #[error("{0} exists; a support bundle is never written over a file")]
    Exists(PathBuf),
    #[error("{0}")]
    Io(String),
}

/// A bundle being made: files under one directory, scrubbed and packed by [`Bundle::write`].
pub struct Bundle {
    root: String,
    files: Vec<(String, Vec<u8>)>,
}

impl Bundle {
    /// A bundle whose files sit under `root/` in the archive.
    pub fn new(root: &str) -> Self {
        Self { root: root.to_owned(), files: Vec::new() }
    }

    /// The names of the files added so far.
    pub fn names(&self) -> Vec<String> {
        self.files.iter().map(|(n, _)| format!("{}/{n}", self.root)).collect()
    }

    pub fn add(&mut self, name: &str, bytes: impl Into<Vec<u8>>) {
        self.files.push((name.to_owned(), bytes.into()));
    }

    pub fn add_json(&mut self, name: &str, value: &impl Serialize) {
        let mut text = serde_json::to_vec_pretty(value).unwrap_or_else(|e| format!("\"{e}\"").into_bytes());
        text.push(b'\n');
        self.add(name, text);
    }

    /// Scrubs every file of `redactor`'s secrets, packs them as a tar.gz into a new 0600 file
    /// beside `out` and links it into place, never over an existing file; the bytes written.
    pub fn write(self, out: &Path, redactor: &Redactor, mtime_s: u64) -> Result<u64, BundleError> {
        use std::os::unix::fs::OpenOptionsExt;
        refuse_existing(out)?;
        let temporary = temporary_path(out);
        let io = |what: &str, path: &Path, e: std::io::Error| BundleError::Io(format!("{what} {}: {e}", path.display()));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temporary)
            .map_err(|e| io("cannot create", &temporary, e))?;
        let packed = self.pack(file, redactor, mtime_s).and_then(|file| {
            file.sync_all()?;
            Ok(file.metadata()?.len())
        });
        let linked = packed.map_err(|e| io("cannot write", &temporary, e)).and_then(|bytes| {
            // A link fails when `out` appeared meanwhile: never over a file, even then.
            std::fs::hard_link(&temporary, out).map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => BundleError::Exists(out.to_path_buf()),
                _ => io("cannot create", out, e),
            })?;
            Ok(bytes)
        });
        let _ = std::fs::remove_file(&temporary);
        let bytes = linked?;
        bc_core::keys::sync_dir_of(out).map_err(|e| BundleError::Io(e.to_string()))?;
        Ok(bytes)
    }

    fn pack(self, file: std::fs::File, redactor: &Redactor, mtime_s: u64) -> std::io::Result<std::fs::File> {
        let gz = flate2::write::GzEncoder::new(std::io::BufWriter::new(file), flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        for (name, bytes) in &self.files {
            let bytes = redactor.scrub(bytes);
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o600);
            header.set_mtime(mtime_s);
            header.set_entry_type(tar::EntryType::Regular);
            tar.append_data(&mut header, format!("{}/{name}", self.root), bytes.as_slice())?;
        }
        let gz = tar.into_inner()?;
        let mut writer = gz.finish()?;
        writer.flush()?;
        writer.into_inner().map_err(|e| e.into_error())
    }
}

/// [`BundleError::Exists`] when `out` exists (checked again when it is linked into place).
pub fn refuse_existing(out: &Path) -> Result<(), BundleError> {
    if std::fs::symlink_metadata(out).is_ok() { Err(BundleError::Exists(out.to_path_buf())) } else { Ok(()) }
}

/// `.NAME.tmp-PID` beside `out`: on the same file system, so linking it into place is atomic.
fn temporary_path(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "bundle".into());
    out.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// What a bundle says of the logs it holds, or of where to find them when it holds none.
pub fn logs_readme(binary: &str, log_file: Option<&Path>, lines: usize) -> String {
    match log_file {
        Some(path) => format!(
            "logs/: the last {lines} lines of {} (each at most {LOG_LINE_BYTES_MAX} bytes), scrubbed of the secrets above.\n",
            path.display()
        ),
        None => format!(
            "logs/: none. {binary} logs to standard error, which this bundle cannot read by itself: under systemd, \
             run `journalctl -u UNIT -n {lines} --no-pager > FILE` and make the bundle again with --log-file FILE, \
             or attach that file yourself after reading it for secrets.\n"
        ),
    }
}

/// What `bcd support-bundle` was asked.
pub struct NodeBundleOptions<'a> {
    pub config_path: &'a Path,
    pub out: &'a Path,
    pub log_file: Option<&'a Path>,
    pub log_lines: usize,
    /// `BCD_JOIN_TOKEN`, taken out of the environment at start: scrubbed, never written.
    pub join_token: Option<&'a str>,
    /// A line on standard error per step (a terminal).
    pub progress: bool,
}

/// `bcd support-bundle`: the versions, the configuration (redacted), `bcd doctor --json`,
/// `bcd status` when the agent runs, the data directory's listing and the log's last lines.
/// The summary printed on success.
pub async fn node_bundle(options: &NodeBundleOptions<'_>) -> Result<Value, BundleError> {
    refuse_existing(options.out)?;
    let step = |what: &str| {
        if options.progress {
            eprintln!("support-bundle: {what}…");
        }
    };
    let now = bc_core::clock::Clock::now_ms(&bc_core::clock::SystemClock) / 1000;
    let mut bundle = Bundle::new("bcd-support-bundle");
    let mut redactor = Redactor::new();
    if let Some(token) = options.join_token {
        redactor.secret(token);
    }
    step("versions");
    bundle.add_json(
        "versions.json",
        &json!({
            "binary": "bcd",
            "version": crate::update::running_version(),
            "journalFormat": bc_core::agent::JOURNAL_FORMAT_VERSION,
            "logFormat": bc_core::event::ENVELOPE_FORMAT,
            "features": { "fakehw": cfg!(feature = "fakehw"), "libvirt": cfg!(feature = "libvirt") },
            "host": system_facts(),
        }),
    );
    step("configuration");
    let config = crate::config::Config::load(options.config_path);
    let mut settings = config_file(options.config_path);
    settings["loads"] = match &config {
        Ok(_) => json!(true),
        Err(e) => json!(redact_urls(&e.to_string())),
    };
    settings["environment"] = environment(&["BCD_"]);
    bundle.add_json("config.json", &settings);
    if let Ok(config) = &config {
        // The node's key, its next one during a rotation, and every small owner-only file beside it.
        redactor.secret_file(&config.key_path());
        redactor.secret_file(&config.data_dir.join(format!("{}.next", crate::config::NODE_KEY_FILE)));
        for path in owner_only_files(&config.data_dir) {
            if path != config.journal_path() {
                redactor.secret_file(&path);
            }
        }
    }
    step("doctor");
    bundle.add_json("doctor.json", &crate::doctor::run(options.config_path).await);
    if let Ok(config) = &config {
        step("status");
        let status = match crate::status::query(&config.socket_path()) {
            Ok(value) => value,
            Err(e) => json!({ "error": e }),
        };
        bundle.add_json("status.json", &status);
        step("data directory");
        let listed = match listing(&config.data_dir) {
            Ok(entries) => json!({ "path": config.data_dir.display().to_string(), "entries": entries }),
            Err(e) => json!({ "path": config.data_dir.display().to_string(), "error": e }),
        };
        bundle.add_json("data-dir.json", &listed);
    }
    if let Some(path) = options.log_file {
        step("logs");
        match log_tail(path, options.log_lines) {
            Ok(bytes) => bundle.add("logs/bcd.log", bytes),
            Err(e) => bundle.add("logs/ERROR.txt", format!("{e}\n")),
        }
    }
    bundle.add(
        "README.txt",
        format!(
            "A support bundle of bcd {}, made at {} (Unix seconds).\n\n\
             versions.json: this binary, its formats and the host.\n\
             config.json: {} as parsed, every secret replaced by {REDACTED}; the BCD_* environment, likewise.\n\
             doctor.json: bcd doctor --json.\n\
             status.json: bcd status (the running agent's answer on its socket), or why there is none.\n\
             data-dir.json: the data directory's files by name, kind, mode and size; no file's contents.\n\
             {}\
             Every file was scrubbed of the node's key and the other owner-only files of the data directory \
             ({} forms of secrets).\n",
            crate::update::running_version(),
            now,
            options.config_path.display(),
            logs_readme("bcd", options.log_file, options.log_lines),
            redactor.len(),
        ),
    );
    let names = bundle.names();
    step("writing");
    let bytes = bundle.write(options.out, &redactor, now)?;
    Ok(json!({ "out": options.out.display().to_string(), "bytes": bytes, "files": names }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_names_and_values() {
        for name in ["token", "admin_token", "webhook_secret", "password", "node_key", "data_key", "PRIVATE_KEY", "api-key"] {
            assert!(is_secret_name(name), "{name}");
        }
        for name in ["log_key_pin", "data_key_file", "serving_ca_spki_pin", "gateway", "data_dir", "listen", "key_id"] {
            assert!(!is_secret_name(name), "{name}");
        }
        assert!(looks_secret("bcjt_jt_01abc.xyz") && looks_secret("key_01abc.secretpart"));
        assert!(looks_secret("-----BEGIN PRIVATE KEY-----\nabc") && !looks_secret("https://gateway:7444"));
    }

    #[test]
    fn url_passwords_are_redacted_and_the_rest_kept() {
        assert_eq!(redact_urls("postgres://bc:hunter2@db:5432/bc"), "postgres://bc:[REDACTED]@db:5432/bc");
        assert_eq!(redact_urls("postgres://bc@db/bc"), "postgres://bc@db/bc");
        assert_eq!(
            redact_urls("url postgresql://u:p%40ss@h/d?sslmode=require end"),
            "url postgresql://u:[REDACTED]@h/d?sslmode=require end"
        );
        assert_eq!(redact_urls("host=db password=hunter2 user=bc"), "host=db password=[REDACTED] user=bc");
        assert_eq!(redact_urls("https://gateway:7444"), "https://gateway:7444");
    }

    #[test]
    fn a_configuration_keeps_its_shape_and_loses_its_secrets() {
        let text = "gateway = \"https://g:1\"\nlog_key_pin = \"sha256/abc\"\ndatabase_url = \"postgres://u:pw@h/d\"\n\
                    [auth]\ntoken = \"abc\"\nport = 3\n[x]\nlist = [\"bcjt_secret_token_x\", \"fine\"]\npassword = 42\n";
        let redacted = redact_toml("", &toml::Value::Table(text.parse::<toml::Table>().unwrap()));
        let shown = redacted.to_string();
        assert!(shown.contains("sha256/abc") && shown.contains("https://g:1") && shown.contains("port = 3"), "{shown}");
        for secret in ["pw@", "\"abc\"", "bcjt_secret_token_x", "42"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("postgres://u:[REDACTED]@h/d") && shown.contains("fine"), "{shown}");
    }

    #[test]
    fn every_form_of_a_secret_is_scrubbed() {
        let key = [7u8; 32];
        let hex_text = hex::encode(key);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.key");
        std::fs::write(&path, format!("{hex_text}\n")).unwrap();
        let mut redactor = Redactor::new();
        redactor.secret_file(&path);
        redactor.secret("key_01jabc.c2VjcmV0LXNlY3JldC1zZWNyZXQ");
        use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
        let forms: Vec<Vec<u8>> = vec![
            key.to_vec(),
            hex_text.clone().into_bytes(),
            hex_text.to_uppercase().into_bytes(),
            STANDARD.encode(key).into_bytes(),
            URL_SAFE_NO_PAD.encode(key).into_bytes(),
            b"c2VjcmV0LXNlY3JldC1zZWNyZXQ".to_vec(),
            b"secret-secret-secret".to_vec(),
        ];
        for form in forms {
            let mut text = b"before ".to_vec();
            text.extend_from_slice(&form);
            text.extend_from_slice(b" after");
            let scrubbed = redactor.scrub(&text);
            assert!(!scrubbed.windows(form.len()).any(|w| w == form.as_slice()), "{}", String::from_utf8_lossy(&form));
            assert!(scrubbed.starts_with(b"before ") && scrubbed.ends_with(b" after"));
        }
        assert_eq!(redactor.scrub(b"nothing secret here"), b"nothing secret here");
    }

    #[test]
    fn a_pem_key_is_scrubbed_by_its_lines_and_its_der() {
        let der: Vec<u8> = (0u8..120).collect();
        let body = base64::engine::general_purpose::STANDARD.encode(&der);
        let pem = format!("-----BEGIN PRIVATE KEY-----\n{}\n{}\n-----END PRIVATE KEY-----\n", &body[..64], &body[64..]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tls.key");
        std::fs::write(&path, &pem).unwrap();
        let mut redactor = Redactor::new();
        redactor.secret_file(&path);
        for form in [pem.as_bytes(), body.as_bytes(), &body.as_bytes()[..64], der.as_slice()] {
            let scrubbed = redactor.scrub(form);
            assert!(!scrubbed.windows(form.len()).any(|w| w == form), "{}", String::from_utf8_lossy(form));
        }
    }

    #[test]
    fn token_shapes_are_redacted_and_key_ids_kept() {
        let key = format!("key_{}", "0".repeat(26));
        let text = format!("a bcjt_jt_01x.abc-def b {key}.c2VjcmV0 c whsec_Zm9v d {key} e");
        assert_eq!(redact_token_shapes(&text), format!("a [REDACTED] b {key}.[REDACTED] c [REDACTED] d {key} e"));
        assert_eq!(redact_token_shapes("nothing here"), "nothing here");
    }

    #[test]
    fn owner_only_files_are_found_below_too_and_logs_are_not_keys() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("sim/node-0");
        std::fs::create_dir_all(&deep).unwrap();
        for (path, mode) in [
            (dir.path().join("admin.token"), 0o600),
            (deep.join("node.key"), 0o600),
            (dir.path().join("agents-tls.crt"), 0o644),
            (dir.path().join("server.log"), 0o600),
            (deep.join("journal.db"), 0o600),
        ] {
            std::fs::write(&path, "x").unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        assert_eq!(owner_only_files(dir.path()), vec![dir.path().join("admin.token"), deep.join("node.key")]);
    }

    #[test]
    fn a_log_tail_is_its_last_lines_cut_to_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let long = "x".repeat(LOG_LINE_BYTES_MAX + 10);
        std::fs::write(&path, format!("one\ntwo\n{long}\nfour\n")).unwrap();
        let tail = String::from_utf8(log_tail(&path, 2).unwrap()).unwrap();
        assert_eq!(tail, format!("{}\nfour\n", "x".repeat(LOG_LINE_BYTES_MAX)));
        assert_eq!(String::from_utf8(log_tail(&path, 10).unwrap()).unwrap().lines().count(), 4);
        assert!(log_tail(&dir.path().join("none"), 2).is_err());
    }

    #[test]
    fn a_bundle_is_0600_scrubbed_and_never_over_a_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("bundle.tar.gz");
        let mut redactor = Redactor::new();
        redactor.secret("a-secret-of-some-length");
        let mut bundle = Bundle::new("b");
        bundle.add("x.txt", "value: a-secret-of-some-length\n");
        let bytes = bundle.write(&out, &redactor, 0).unwrap();
        assert_eq!(std::fs::metadata(&out).unwrap().len(), bytes);
        assert_eq!(std::fs::metadata(&out).unwrap().permissions().mode() & 0o777, 0o600);
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(std::fs::File::open(&out).unwrap()));
        let mut seen = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let mut text = String::new();
            entry.read_to_string(&mut text).unwrap();
            seen.push((entry.path().unwrap().display().to_string(), text));
        }
        assert_eq!(seen, vec![("b/x.txt".to_owned(), "value: [REDACTED]\n".to_owned())]);
        let again = Bundle::new("b").write(&out, &redactor, 0);
        assert!(matches!(again, Err(BundleError::Exists(_))), "{again:?}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary file is left");
    }
}
