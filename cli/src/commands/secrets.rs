//! `secrets put|list|delete`: write-only secrets (the `secrets.*` methods). A value is read from
//! a file (`--value-file`) or standard input (`--stdin`) only, never from an argument, and is
//! never printed: the answers name the secret, its version and its reference
//! (`secret://TENANT/sec_…`), which is what webhooks (`--secret-ref`) take.

use std::io::Read;
use std::path::PathBuf;

use bc_projections::decide::secret::SECRET_VALUE_CHARS_MAX;
use clap::{ArgGroup, Subcommand};
use serde_json::json;

use crate::client::CliError;
use crate::flags::{IdempotencyKey, IfVersion, Page};
use crate::output::Format;
use crate::tables;

use super::{Context, add_if_version, add_page, idempotency_key};

/// Most bytes a value's file or standard input may hold: the largest value in 4-byte characters.
const SECRET_VALUE_READ_BYTES_MAX: usize = SECRET_VALUE_CHARS_MAX * 4;

#[derive(Subcommand)]
pub enum SecretsCommand {
    /// Store a value under NAME (a new version if NAME exists). The value is read, exactly as
    /// it is (a trailing newline included), from --value-file or standard input, never from
    /// an argument.
    #[command(group(ArgGroup::new("source").required(true).args(["value_file", "stdin"])))]
    Put {
        /// 1 to 63 of a-z 0-9 - . _, starting with a letter or digit; unique in the tenant.
        name: String,
        /// Read the value from this file.
        #[arg(long, visible_alias = "from-file")]
        value_file: Option<PathBuf>,
        /// Read the value from standard input.
        #[arg(long, visible_alias = "from-stdin")]
        stdin: bool,
        #[command(flatten)]
        if_version: IfVersion,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's secrets: names, versions and references, never values.
    List {
        #[command(flatten)]
        page: Page,
    },
    /// Delete a secret and its values; refused while a webhook names it.
    Delete {
        name: String,
        #[command(flatten)]
        if_version: IfVersion,
    },
}

/// The value, from a file or standard input, at most [`SECRET_VALUE_READ_BYTES_MAX`] bytes of
/// UTF-8. No error quotes any of it.
fn read_value(file: &Option<PathBuf>) -> Result<String, CliError> {
    let mut bytes = Vec::new();
    let limit = SECRET_VALUE_READ_BYTES_MAX as u64 + 1;
    match file {
        Some(path) => std::fs::File::open(path)
            .and_then(|f| f.take(limit).read_to_end(&mut bytes))
            .map_err(|e| CliError::usage(format!("cannot read {}: {e}", path.display())))?,
        None => std::io::stdin()
            .lock()
            .take(limit)
            .read_to_end(&mut bytes)
            .map_err(|e| CliError::usage(format!("cannot read standard input: {e}")))?,
    };
    if bytes.len() > SECRET_VALUE_READ_BYTES_MAX {
        return Err(CliError::usage(format!("the value is longer than {SECRET_VALUE_READ_BYTES_MAX} bytes")));
    }
    if bytes.is_empty() {
        return Err(CliError::usage("the value is empty"));
    }
    String::from_utf8(bytes).map_err(|_| CliError::usage("the value is not UTF-8 text"))
}

pub async fn run(ctx: &Context, command: SecretsCommand) -> Result<(), CliError> {
    let c = ctx.client()?;
    let mut body = ctx.tenant_body()?;
    let value = match command {
        SecretsCommand::List { page } => {
            add_page(&mut body, &page);
            return ctx.print_list(&c.call("secrets.list", &json!(body), None).await?, tables::SECRETS);
        }
        SecretsCommand::Put { name, value_file, stdin: _, if_version, key } => {
            let value = read_value(&value_file)?;
            body.insert("name".into(), json!(name));
            body.insert("value".into(), json!(value));
            add_if_version(&mut body, &if_version);
            let key = idempotency_key(&key.key);
            c.call("secrets.put", &json!(body), Some(key.as_str())).await?
        }
        SecretsCommand::Delete { name, if_version } => {
            body.insert("name".into(), json!(name));
            add_if_version(&mut body, &if_version);
            c.call("secrets.delete", &json!(body), None).await?
        }
    };
    ctx.print(&value, Format::Json)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::flags::Cli;

    #[test]
    fn a_value_never_comes_from_an_argument() {
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("better-compute").chain(args.iter().copied()));
        assert!(parse(&["secrets", "put", "db", "--stdin"]).is_ok());
        assert!(parse(&["secrets", "put", "db", "--value-file", "/tmp/v"]).is_ok());
        assert!(parse(&["secrets", "put", "db", "--from-file", "/tmp/v"]).is_ok());
        assert!(parse(&["secrets", "put", "db", "--from-stdin"]).is_ok());
        assert!(parse(&["secrets", "put", "db"]).is_err(), "a source is required");
        assert!(parse(&["secrets", "put", "db", "--stdin", "--value-file", "/tmp/v"]).is_err(), "one source");
        assert!(parse(&["secrets", "put", "db", "hunter2", "--stdin"]).is_err(), "no value argument");
        assert!(parse(&["secrets", "put", "db", "--value", "hunter2"]).is_err(), "no value flag");
    }

    #[test]
    fn a_value_is_read_whole_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v");
        std::fs::write(&path, "whsec_abc\n").unwrap();
        assert_eq!(super::read_value(&Some(path.clone())).unwrap(), "whsec_abc\n", "exactly as read");
        std::fs::write(&path, "").unwrap();
        assert!(super::read_value(&Some(path.clone())).is_err());
        std::fs::write(&path, vec![b'x'; super::SECRET_VALUE_READ_BYTES_MAX + 1]).unwrap();
        assert!(super::read_value(&Some(path.clone())).is_err());
        std::fs::write(&path, [0xff, 0xfe, b's', b'3']).unwrap();
        let err = super::read_value(&Some(path)).unwrap_err();
        assert!(!format!("{err:?}").contains("s3"), "no error quotes the value");
    }
}
