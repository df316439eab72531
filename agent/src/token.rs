//! Where `bcd join` reads its token: `BCD_JOIN_TOKEN` (unset as soon as it is read), else the
//! first line of standard input (at most 4 KiB, a byte-order mark dropped), else `--token-file`
//! (a regular file, mode 0600 or 0400, at most 4 KiB). Never from an argument, never echoed.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use bc_core::agent::JOIN_TOKEN_BYTES_MAX;

pub const TOKEN_ENV: &str = "BCD_JOIN_TOKEN";

/// Where the token came from, so a token file can be removed after a join.
#[derive(Debug, PartialEq, Eq)]
pub enum Source {
    Environment,
    Stdin,
    File,
}

/// A token and its source. `Debug` never shows the token.
pub struct Token {
    pub secret: String,
    pub source: Source,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Token").field("source", &self.source).finish_non_exhaustive()
    }
}

/// Why no token was read: usage (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TokenError(pub String);

/// Takes the token out of the environment. Called first in `main`, before any thread starts,
/// which is what makes removing a variable sound.
pub fn take_from_environment() -> Option<String> {
    let value = std::env::var(TOKEN_ENV).ok();
    if value.is_some() {
        remove_token_variable();
    }
    value.map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

#[allow(unsafe_code)]
fn remove_token_variable() {
    // SAFETY: `remove_var` is unsound only when another thread reads or writes the environment
    // at the same time; this runs in `main` before the runtime or any other thread starts.
    unsafe { std::env::remove_var(TOKEN_ENV) };
}

/// The first line of `input`, at most [`JOIN_TOKEN_BYTES_MAX`] bytes, without a BOM.
pub fn first_line(input: &mut impl Read) -> Result<Option<String>, TokenError> {
    let mut buf = Vec::with_capacity(256);
    input
        .take(JOIN_TOKEN_BYTES_MAX as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| TokenError(format!("reading standard input: {e}")))?;
    let line_end = buf.iter().position(|b| *b == b'\n').unwrap_or(buf.len());
    if line_end > JOIN_TOKEN_BYTES_MAX {
        return Err(TokenError(format!("the token's line is over {JOIN_TOKEN_BYTES_MAX} bytes")));
    }
    let line = String::from_utf8(buf[..line_end].to_vec()).map_err(|_| TokenError("the token is not UTF-8".into()))?;
    let line = line.strip_prefix('\u{feff}').unwrap_or(&line).trim().to_owned();
    Ok((!line.is_empty()).then_some(line))
}

/// Reads `--token-file`: a regular file (not a link) that only its owner may read.
pub fn from_file(path: &Path) -> Result<String, TokenError> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| TokenError(format!("--token-file {}: {e}", path.display())))?;
    if !meta.file_type().is_file() {
        return Err(TokenError(format!("--token-file {} is not a regular file", path.display())));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(TokenError(format!(
            "--token-file {} is mode {mode:04o}: others may read it (chmod 600 it, and treat the token as exposed)",
            path.display()
        )));
    }
    if meta.len() > JOIN_TOKEN_BYTES_MAX as u64 {
        return Err(TokenError(format!("--token-file {} is over {JOIN_TOKEN_BYTES_MAX} bytes", path.display())));
    }
    let mut file = std::fs::File::open(path).map_err(|e| TokenError(format!("--token-file {}: {e}", path.display())))?;
    first_line(&mut file)?.ok_or_else(|| TokenError(format!("--token-file {} is empty", path.display())))
}

/// The token, from the first source that has one.
pub fn read(from_env: Option<String>, stdin_is_terminal: bool, stdin: &mut impl Read, file: Option<&Path>) -> Result<Token, TokenError> {
    if let Some(secret) = from_env {
        return Ok(Token { secret, source: Source::Environment });
    }
    if !stdin_is_terminal && let Some(secret) = first_line(stdin)? {
        return Ok(Token { secret, source: Source::Stdin });
    }
    if let Some(path) = file {
        return Ok(Token { secret: from_file(path)?, source: Source::File });
    }
    Err(TokenError(
        "no join token: set BCD_JOIN_TOKEN, pipe it on standard input, or pass --token-file (never as an argument)".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_line_without_a_bom_and_within_the_bound() {
        assert_eq!(first_line(&mut "\u{feff}bcjt_x\nrest".as_bytes()).unwrap().as_deref(), Some("bcjt_x"));
        assert_eq!(first_line(&mut "".as_bytes()).unwrap(), None);
        let long = "a".repeat(JOIN_TOKEN_BYTES_MAX + 1);
        assert!(first_line(&mut long.as_bytes()).is_err());
    }

    #[test]
    fn a_token_file_others_may_read_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        std::fs::write(&path, "bcjt_secret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = from_file(&path).unwrap_err();
        assert!(e.0.contains("0644") && !e.0.contains("bcjt_secret"), "{e}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        assert_eq!(from_file(&path).unwrap(), "bcjt_secret");
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(from_file(&link).is_err());
    }

    #[test]
    fn the_environment_comes_first_then_stdin_then_the_file() {
        let t = read(Some("e".into()), false, &mut "s\n".as_bytes(), None).unwrap();
        assert_eq!((t.secret.as_str(), t.source), ("e", Source::Environment));
        let t = read(None, false, &mut "s\n".as_bytes(), None).unwrap();
        assert_eq!(t.source, Source::Stdin);
        assert!(read(None, true, &mut "s\n".as_bytes(), None).is_err(), "a terminal is not read");
        assert!(!format!("{t:?}").contains('s') || !format!("{t:?}").contains("\"s\""));
    }
}
