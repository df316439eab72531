//! `batch keygen|sign|sign-approvers|approvers|publish-approvers|create|list|show|members|approve|cancel`:
//! destructive batches under a quorum (`docs/batches.md`).
//!
//! The approver's side never takes the server's word for what a batch holds: `show` and
//! `approve` page the whole scope, recompute its RFC 6962 root from the leaves
//! (`bc_projections::batch`, the code the server uses) and check it against the root and size
//! the server asks to sign; then the review rules (the state and window, `--max-hours`, unbound
//! leaves, `--root`, `--expect`) before anything is signed. Every refusal has its own code:
//! `SCOPE_MISMATCH`, `SCOPE_CHANGED`, `SCOPE_UNEXPECTED`, `UNBOUND_SCOPE`, `INVALID_RESPONSE`,
//! `INVALID_STATE`. Approver keys are P-256 PKCS#8 PEM files, 0600, never written over a file,
//! encrypted under `BETTER_COMPUTE_APPROVER_PASSPHRASE` when it is set; a key file that others
//! may read is refused, as ssh does.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use bc_core::id::CommandBatchId;
use bc_projections::batch::{
    ApproverKey, COMMAND_BATCH_HOURS_MAX, COMMAND_BATCH_LEAVES_MAX, Leaf, approval_message, approver_key_of,
    approver_set_message, kid_of_spki, scope_root, verify_signature,
};
use clap::Subcommand;
use p256::ecdsa::signature::Signer as _;
use p256::ecdsa::{DerSignature, SigningKey, VerifyingKey};
use p256::pkcs8::{DecodePrivateKey as _, DecodePublicKey as _, EncodePrivateKey as _, EncodePublicKey as _, LineEnding};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::client::CliError;
use crate::flags::{IdempotencyKey, Page};
use crate::output::Format;

use super::{Context, add_page, check_id};

/// The environment variable whose value encrypts (`keygen`) and decrypts an approver key.
pub const PASSPHRASE_ENV: &str = "BETTER_COMPUTE_APPROVER_PASSPHRASE";
/// The largest key, public key, signature, scope or expect file read.
const KEY_FILE_BYTES_MAX: u64 = 16 * 1024;
const SCOPE_FILE_BYTES_MAX: u64 = 4 * 1024 * 1024;
/// Leaves asked per `commandBatches.show` page.
const SCOPE_PAGE: u64 = 256;
/// The default of `--max-hours`.
const MAX_HOURS_DEFAULT: u64 = 72;

#[derive(clap::Args, Clone, Debug, Default)]
pub struct Review {
    /// Sign without a reviewed root: the summary shown is what you approve.
    #[arg(long)]
    pub yes: bool,
    /// Sign only if the batch still has this root (the one a previous run showed).
    #[arg(long, value_name = "ROOT")]
    pub root: Option<String>,
    /// Sign only if the batch holds exactly these: one subject per line, or `{"subject", "kind"}`
    /// JSON lines.
    #[arg(long, value_name = "FILE")]
    pub expect: Option<PathBuf>,
    /// Accept leaves that admit any payload of their kind.
    #[arg(long)]
    pub allow_unbound: bool,
    /// Refuse a batch whose window stays open longer than this many hours from now.
    #[arg(long, default_value_t = MAX_HOURS_DEFAULT, value_parser = clap::value_parser!(u64).range(1..=8760))]
    pub max_hours: u64,
}

#[derive(Subcommand)]
pub enum BatchCommand {
    /// Make an approver key: PATH (P-256, PKCS#8 PEM, 0600; encrypted when
    /// BETTER_COMPUTE_APPROVER_PASSPHRASE is set) and PATH.pub; prints its kid. Never over a file.
    Keygen {
        #[arg(long, value_name = "PATH")]
        out: PathBuf,
    },
    /// The deployment's approver set (approvers.get).
    Approvers,
    /// Publish an approver set (approvers.publish): epoch 1 as the root admin, a later epoch with
    /// the current quorum's `sign-approvers` signatures.
    PublishApprovers {
        #[command(flatten)]
        set: ApproverSetArgs,
        /// A file `sign-approvers` wrote (repeatable).
        #[arg(long = "signature", value_name = "FILE")]
        signatures: Vec<PathBuf>,
    },
    /// Sign a new approver set with your current approver key (offline).
    SignApprovers {
        #[arg(long, value_name = "PATH")]
        key: PathBuf,
        #[command(flatten)]
        set: ApproverSetArgs,
    },
    /// Make a batch (commandBatches.create) from a JSON file of `{subject, kind, payload}` leaves.
    Create {
        #[arg(long)]
        reason: String,
        #[arg(long, value_name = "FILE")]
        scope: PathBuf,
        /// Hours the batch stays open for approvals (1 to 72; default 24).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=COMMAND_BATCH_HOURS_MAX))]
        hours: Option<u64>,
        #[command(flatten)]
        key: IdempotencyKey,
    },
    /// A tenant's batches.
    List {
        #[arg(long, value_parser = ["pending", "released", "cancelled", "expired"])]
        state: Option<String>,
        #[command(flatten)]
        page: Page,
    },
    /// A batch with its scope, paged and checked against its root; --scope-out writes the input
    /// of `batch sign`.
    Show {
        #[arg(long, value_name = "ID")]
        batch: String,
        #[arg(long, value_name = "FILE")]
        scope_out: Option<PathBuf>,
    },
    /// A batch's commands and their states (awaitingApproval while held).
    Members {
        #[arg(long, value_name = "ID")]
        batch: String,
        /// Only members in this state.
        #[arg(long)]
        state: Option<String>,
    },
    /// Review a batch and sign your approval with --key, or submit one `batch sign` made offline
    /// with --signature.
    Approve {
        #[arg(long, value_name = "ID")]
        batch: String,
        #[arg(long, value_name = "PATH", required_unless_present = "signature", conflicts_with = "signature")]
        key: Option<PathBuf>,
        #[arg(long, value_name = "FILE")]
        signature: Option<PathBuf>,
        #[command(flatten)]
        review: Review,
    },
    /// The same review and signature on an offline machine, from `batch show --scope-out`'s file.
    Sign {
        #[arg(long, value_name = "PATH")]
        key: PathBuf,
        #[arg(long, value_name = "FILE")]
        scope: PathBuf,
        #[command(flatten)]
        review: Review,
        /// The time the window is judged at, in ms since the epoch (default: this machine's clock).
        #[arg(long, value_name = "MS")]
        now_ms: Option<u64>,
    },
    /// End a pending batch; its held commands are never issued.
    Cancel {
        #[arg(long, value_name = "ID")]
        batch: String,
    },
}

#[derive(clap::Args, Clone, Debug)]
pub struct ApproverSetArgs {
    /// The set's epoch: 1 for the first, one above the published set's after.
    #[arg(long)]
    pub epoch: u64,
    /// K: approvals a batch needs.
    #[arg(long)]
    pub quorum: u64,
    /// The deployment's trust domain (fixed at epoch 1).
    #[arg(long, value_name = "DOMAIN")]
    pub trust_domain: String,
    /// An approver's PATH.pub (repeatable): the keys of the new set.
    #[arg(long = "approver", value_name = "PATH.pub", required = true)]
    pub approvers: Vec<PathBuf>,
}

/// What `batch show --scope-out` writes and `batch sign` reads: the batch as the server
/// described it and every leaf.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ScopeFile {
    pub batch_id: String,
    pub reason: String,
    pub state: String,
    pub root: String,
    pub size: u64,
    pub expires_at_ms: u64,
    pub trust_domain: String,
    pub epoch: u64,
    pub quorum: u64,
    pub approvals: u64,
    pub proposed_by: String,
    pub leaves: Vec<Leaf>,
}

/// What `batch sign` prints and `batch approve --signature` submits.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SignatureFile {
    pub batch_id: String,
    pub kid: String,
    pub public_key: String,
    pub signature: String,
    pub root: String,
    pub size: u64,
    pub expires_at_ms: u64,
    pub trust_domain: String,
}

pub async fn run(ctx: &Context, command: BatchCommand) -> Result<(), CliError> {
    let value = match command {
        BatchCommand::Keygen { out } => keygen(&out)?,
        BatchCommand::Approvers => ctx.call("approvers.get", Map::new(), None).await?,
        BatchCommand::PublishApprovers { set, signatures } => {
            let keys = set.approvers.iter().map(|p| read_public_key(p)).collect::<Result<Vec<_>, _>>()?;
            let mut signed = Vec::new();
            for path in &signatures {
                let text = read_bounded(path, KEY_FILE_BYTES_MAX, "--signature")?;
                let v: Value = serde_json::from_slice(&text)
                    .map_err(|e| CliError::usage(format!("--signature {}: not JSON: {e}", path.display())))?;
                signed.push(json!({ "kid": v["kid"], "signature": v["signature"] }));
            }
            let body = json!({
                "epoch": set.epoch, "quorum": set.quorum, "trustDomain": set.trust_domain,
                "keys": keys, "signatures": signed,
            });
            let Value::Object(body) = body else { unreachable!("a JSON object") };
            ctx.call("approvers.publish", body, None).await?
        }
        BatchCommand::SignApprovers { key, set } => {
            let signing = load_key(&key)?;
            let keys = set.approvers.iter().map(|p| read_public_key(p)).collect::<Result<Vec<_>, _>>()?;
            let message = approver_set_message(&set.trust_domain, set.epoch, set.quorum, &keys);
            let own = approver_key_of(signing.verifying_key())?;
            json!({ "epoch": set.epoch, "kid": own.kid, "signature": sign(&signing, &message) })
        }
        BatchCommand::Create { reason, scope, hours, key } => {
            let text = read_bounded(&scope, SCOPE_FILE_BYTES_MAX, "--scope")?;
            let leaves: Vec<Leaf> = serde_json::from_slice(&text).map_err(|e| {
                CliError::usage(format!("--scope {}: not a JSON list of {{subject, kind, payload}}: {e}", scope.display()))
            })?;
            if leaves.iter().any(|l| l.kind == bc_projections::decide::batch::LEAF_METAL_DEPLOY) {
                // Its join tokens come back once, and must go to files, never to the terminal.
                return Err(CliError::usage(
                    "a batch of metal.deploy leaves mints the installed systems' join tokens: make it with \
                     metal bulk --verb deploy --image IMG --token-dir DIR",
                ));
            }
            let mut body = ctx.tenant_body()?;
            body.insert("reason".into(), json!(reason));
            body.insert("leaves".into(), serde_json::to_value(&leaves).map_err(|e| CliError::usage(e.to_string()))?);
            if let Some(hours) = hours {
                body.insert("hours".into(), json!(hours));
            }
            ctx.create("commandBatches.create", body, &key).await?
        }
        BatchCommand::List { state, page } => {
            let mut body = ctx.tenant_body()?;
            if let Some(state) = state {
                body.insert("state".into(), json!(state));
            }
            add_page(&mut body, &page);
            ctx.call("commandBatches.list", body, None).await?
        }
        BatchCommand::Show { batch, scope_out } => {
            let scope = fetch_scope(ctx, &batch).await?;
            check_root(&scope)?;
            if let Some(path) = &scope_out {
                let text = serde_json::to_vec_pretty(&scope).map_err(|e| CliError::usage(e.to_string()))?;
                bc_core::keys::write_new_file(path, &text, 0o644)?;
            }
            serde_json::to_value(&scope).map_err(|e| CliError::usage(e.to_string()))?
        }
        BatchCommand::Members { batch, state } => {
            let mut body = ctx.tenant_body()?;
            body.insert("batchId".into(), json!(check_id::<CommandBatchId>("--batch", &batch)?));
            let mut members = ctx.call("commandBatches.members", body, None).await?;
            if let (Some(state), Some(items)) = (state, members["items"].as_array_mut()) {
                items.retain(|m| m["state"] == state.as_str());
            }
            members
        }
        BatchCommand::Approve { batch, key, signature, review } => {
            let scope = fetch_scope(ctx, &batch).await?;
            let signed = match (key, signature) {
                (Some(key), _) => {
                    let signing = load_key(&key)?;
                    match review_and_sign(&scope, &review, &signing, wall_clock_ms())? {
                        Some(signed) => signed,
                        None => return Ok(()),
                    }
                }
                (None, Some(path)) => {
                    check_root(&scope)?;
                    let text = read_bounded(&path, KEY_FILE_BYTES_MAX, "--signature")?;
                    let signed: SignatureFile = serde_json::from_slice(&text)
                        .map_err(|e| CliError::usage(format!("--signature {}: not a batch sign file: {e}", path.display())))?;
                    check_signature_file(&scope, &signed)?;
                    signed
                }
                (None, None) => return Err(CliError::usage("give --key PATH or --signature FILE")),
            };
            let mut body = ctx.tenant_body()?;
            body.insert("batchId".into(), json!(scope.batch_id));
            body.insert("kid".into(), json!(signed.kid));
            body.insert("signature".into(), json!(signed.signature));
            ctx.call("commandBatches.approve", body, None).await?
        }
        BatchCommand::Sign { key, scope, review, now_ms } => {
            let text = read_bounded(&scope, SCOPE_FILE_BYTES_MAX, "--scope")?;
            let scope: ScopeFile = serde_json::from_slice(&text)
                .map_err(|e| CliError::new("INVALID_RESPONSE", format!("--scope {}: not a scope file: {e}", scope.display())))?;
            let signing = load_key(&key)?;
            match review_and_sign(&scope, &review, &signing, now_ms.unwrap_or_else(wall_clock_ms))? {
                Some(signed) => serde_json::to_value(&signed).map_err(|e| CliError::usage(e.to_string()))?,
                None => return Ok(()),
            }
        }
        BatchCommand::Cancel { batch } => {
            let mut body = ctx.tenant_body()?;
            body.insert("batchId".into(), json!(check_id::<CommandBatchId>("--batch", &batch)?));
            ctx.call("commandBatches.cancel", body, None).await?
        }
    };
    ctx.print(&value, Format::Json)
}

#[allow(clippy::disallowed_methods)] // the approver's own clock judges the window, not the server's
fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// `batch keygen`: the key (0600, encrypted under the passphrase when one is set) and PATH.pub.
fn keygen(out: &Path) -> Result<Value, CliError> {
    let signing = loop {
        if let Ok(key) = SigningKey::from_slice(&rand::random::<[u8; 32]>()) {
            break key;
        }
    };
    let public_path = pub_path_of(out);
    if public_path.exists() {
        return Err(bc_core::Error::AlreadyExists { what: format!("file {}", public_path.display()) }.into());
    }
    let passphrase = std::env::var(PASSPHRASE_ENV).ok().filter(|p| !p.is_empty());
    let pem = match &passphrase {
        Some(passphrase) => signing.to_pkcs8_encrypted_pem(passphrase.as_bytes(), LineEnding::LF),
        None => signing.to_pkcs8_pem(LineEnding::LF),
    }
    .map_err(|e| CliError::new("INTERNAL", format!("encoding the key: {e}")))?;
    let public_pem = signing
        .verifying_key()
        .to_public_key_pem(LineEnding::LF)
        .map_err(|e| CliError::new("INTERNAL", format!("encoding the public key: {e}")))?;
    bc_core::keys::write_new_file(out, pem.as_bytes(), 0o600)?;
    bc_core::keys::write_new_file(&public_path, public_pem.as_bytes(), 0o644)?;
    let public = approver_key_of(signing.verifying_key())?;
    Ok(json!({
        "kid": public.kid, "key": out.display().to_string(), "publicKeyFile": public_path.display().to_string(),
        "publicKey": public.public_key, "encrypted": passphrase.is_some(),
    }))
}

fn pub_path_of(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>, CliError> {
    let file = std::fs::File::open(path).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(|e| CliError::usage(format!("{what} {}: {e}", path.display())))?;
    if bytes.len() as u64 > max {
        return Err(CliError::usage(format!("{what} {} is over {max} bytes", path.display())));
    }
    Ok(bytes)
}

/// An approver key file: refused when others may read it (as ssh refuses), decrypted with the
/// passphrase when it is encrypted.
pub fn load_key(path: &Path) -> Result<SigningKey, CliError> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::metadata(path).map_err(|e| CliError::usage(format!("--key {}: {e}", path.display())))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(CliError::new(
            "INVALID_STATE",
            format!("approver key {} is readable by others (mode {mode:03o})", path.display()),
        )
        .hint(format!("chmod 600 {}", path.display())));
    }
    let bytes = read_bounded(path, KEY_FILE_BYTES_MAX, "--key")?;
    let text = String::from_utf8(bytes).map_err(|_| CliError::usage(format!("--key {} is not a PEM file", path.display())))?;
    let bad = |e: String| {
        CliError::usage(format!("--key {}: not a P-256 approver key: {e}", path.display()))
            .hint("give the file batch keygen wrote (not PATH.pub)")
    };
    if text.contains("ENCRYPTED PRIVATE KEY") {
        let passphrase = std::env::var(PASSPHRASE_ENV).ok().filter(|p| !p.is_empty()).ok_or_else(|| {
            CliError::new("MISSING_ENV", format!("approver key {} is encrypted and {PASSPHRASE_ENV} is not set", path.display()))
        })?;
        SigningKey::from_pkcs8_encrypted_pem(&text, passphrase.as_bytes()).map_err(|e| bad(e.to_string()))
    } else {
        SigningKey::from_pkcs8_pem(&text).map_err(|e| bad(e.to_string()))
    }
}

/// An approver's PATH.pub: a PEM public key (SubjectPublicKeyInfo), as the set carries it.
fn read_public_key(path: &Path) -> Result<ApproverKey, CliError> {
    let bytes = read_bounded(path, KEY_FILE_BYTES_MAX, "--approver")?;
    let text = String::from_utf8(bytes).map_err(|_| CliError::usage(format!("{} is not text", path.display())))?;
    let key = VerifyingKey::from_public_key_pem(&text)
        .map_err(|e| CliError::usage(format!("{}: not a P-256 public key: {e}", path.display())).hint("pass PATH.pub"))?;
    Ok(approver_key_of(&key)?)
}

fn sign(key: &SigningKey, message: &str) -> String {
    let signature: DerSignature = key.sign(message.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(signature.as_bytes())
}

fn invalid_response(message: impl Into<String>) -> CliError {
    CliError::new("INVALID_RESPONSE", message)
}

fn text_of(v: &Value, field: &str) -> Result<String, CliError> {
    v[field].as_str().map(str::to_owned).ok_or_else(|| invalid_response(format!("the batch has no text {field}")))
}

fn number_of(v: &Value, field: &str) -> Result<u64, CliError> {
    v[field].as_u64().ok_or_else(|| invalid_response(format!("the batch has no number {field}")))
}

/// Pages the whole scope of `batch` through `commandBatches.show`: every page must describe the
/// same batch, start where the last ended and advance, and the leaves must be no more than its
/// size (`INVALID_RESPONSE` otherwise). The root is not checked here ([`check_root`]).
pub async fn fetch_scope(ctx: &Context, batch: &str) -> Result<ScopeFile, CliError> {
    let batch_id = check_id::<CommandBatchId>("--batch", batch)?;
    let mut leaves: Vec<Leaf> = Vec::new();
    let mut first: Option<Value> = None;
    let mut offset = 0u64;
    loop {
        let mut body = ctx.tenant_body()?;
        body.insert("batchId".into(), json!(batch_id));
        body.insert("offset".into(), json!(offset));
        body.insert("limit".into(), json!(SCOPE_PAGE));
        let page = ctx.call("commandBatches.show", body, None).await?;
        let described = page["batch"].clone();
        if !described.is_object() || text_of(&described, "batchId")? != batch_id {
            return Err(invalid_response(format!("a scope page of {batch_id} describes another batch")));
        }
        match &first {
            None => first = Some(described.clone()),
            Some(f) if f["root"] != described["root"] || f["size"] != described["size"] => {
                return Err(invalid_response(format!("{batch_id}'s root or size changed between scope pages")));
            }
            Some(_) => {}
        }
        if page["offset"].as_u64() != Some(offset) {
            return Err(invalid_response(format!("asked for the scope from leaf {offset}, got a page from {}", page["offset"])));
        }
        let items = page["leaves"].as_array().ok_or_else(|| invalid_response("a scope page without leaves"))?;
        for (i, item) in items.iter().enumerate() {
            if item["index"].as_u64() != Some(offset + i as u64) {
                return Err(invalid_response(format!("leaf {} of the page is not leaf {}", i, offset + i as u64)));
            }
            let leaf = Leaf {
                subject: text_of(item, "subject")?,
                kind: text_of(item, "kind")?,
                payload: item.get("payload").cloned().ok_or_else(|| invalid_response("a leaf without a payload"))?,
            };
            leaves.push(leaf);
        }
        if leaves.len() > COMMAND_BATCH_LEAVES_MAX || leaves.len() as u64 > number_of(&described, "size")? {
            return Err(invalid_response(format!("{batch_id}'s scope lists more leaves than its size")));
        }
        match page["nextOffset"].as_u64() {
            None if page["nextOffset"].is_null() || page.get("nextOffset").is_none() => break,
            Some(next) if next == offset + items.len() as u64 && !items.is_empty() => offset = next,
            _ => return Err(invalid_response(format!("{batch_id}'s scope page at {offset} does not advance"))),
        }
    }
    let b = first.ok_or_else(|| invalid_response("no scope page"))?;
    Ok(ScopeFile {
        batch_id,
        reason: text_of(&b, "reason")?,
        state: text_of(&b, "state")?,
        root: text_of(&b, "root")?,
        size: number_of(&b, "size")?,
        expires_at_ms: number_of(&b, "expiresAtMs")?,
        trust_domain: text_of(&b, "trustDomain")?,
        epoch: number_of(&b, "epoch")?,
        quorum: number_of(&b, "quorum")?,
        approvals: b["approvals"].as_array().map_or(0, |a| a.len() as u64),
        proposed_by: b["proposedBy"].as_str().unwrap_or_default().to_owned(),
        leaves,
    })
}

/// The leaves give the root and size the server asks to sign, or `SCOPE_MISMATCH`.
pub fn check_root(scope: &ScopeFile) -> Result<(), CliError> {
    let recomputed = scope_root(&scope.leaves)?;
    if scope.leaves.len() as u64 != scope.size || recomputed != scope.root {
        return Err(CliError::new(
            "SCOPE_MISMATCH",
            format!(
                "batch {}'s {} listed leaves give the root {recomputed}, not the root {} of size {} the server asks to sign",
                scope.batch_id,
                scope.leaves.len(),
                scope.root,
                scope.size
            ),
        )
        .hint("do not approve: the server's answer does not match what it would have you sign"));
    }
    Ok(())
}

/// `--batch-reason` of `nodes delete`, `release` and `rollouts create`: instead of the call, one
/// batch (`commandBatches.create`) of the same operations, a `kind` leaf per `(subject,
/// payload)`, the way `metal bulk` makes one of metal verbs; `reason` is what the approvers
/// read; `key` the batch's idempotency key (a fresh one unless given). Nothing happens until
/// the approvers' quorum signs it (`batch approve`).
pub async fn make_batch(
    ctx: &Context,
    reason: &str,
    kind: &str,
    leaves: Vec<(String, Value)>,
    key: &IdempotencyKey,
) -> Result<Value, CliError> {
    let count = leaves.len();
    let mut body = ctx.tenant_body()?;
    body.insert("reason".into(), json!(reason));
    let leaves =
        leaves.into_iter().map(|(subject, payload)| json!({ "subject": subject, "kind": kind, "payload": payload })).collect();
    body.insert("leaves".into(), Value::Array(leaves));
    let batch = ctx.create("commandBatches.create", body, key).await?;
    if let Some(id) = batch["batchId"].as_str() {
        eprintln!(
            "batch {id} holds {count} {kind} leaves; nothing happens until the approvers sign it: batch approve --batch {id} --key PATH"
        );
    }
    Ok(batch)
}

/// What `nodes delete` and `release` act on: several ids only through one batch.
pub enum OneOrBatch {
    /// No `--batch-reason`: the one id, for the call itself.
    One(String),
    /// The batch made of them (what [`make_batch`] answered), to print.
    Batch(Value),
}

/// With `--batch-reason`, one batch of a `kind` leaf (payload `{}`) per id, through
/// [`make_batch`] (`--if-version`, one object's version, is refused beside it); without, exactly
/// one id. `verb` names one operation (`delete`), `several` the many (`nodes are deleted`), for
/// the usage errors.
pub async fn one_or_batch(
    ctx: &Context,
    ids: Vec<String>,
    batch_reason: Option<String>,
    if_version: Option<u64>,
    kind: &str,
    (verb, several): (&str, &str),
) -> Result<OneOrBatch, CliError> {
    if let Some(reason) = batch_reason {
        if if_version.is_some() {
            return Err(CliError::usage(format!("--if-version goes with one {verb} now, not with --batch-reason")));
        }
        let leaves = ids.into_iter().map(|id| (id, json!({}))).collect();
        return Ok(OneOrBatch::Batch(make_batch(ctx, &reason, kind, leaves, &IdempotencyKey { key: None }).await?));
    }
    let [one] = <[String; 1]>::try_from(ids).map_err(|_| {
        CliError::usage(format!("several {several} through one batch: add --batch-reason TEXT (the approvers sign it)"))
    })?;
    Ok(OneOrBatch::One(one))
}

/// A `rollouts.create` leaf as the approver reads it: the release, how many nodes and which,
/// the pool and labels that chose them, the waves.
fn rollout_line(leaf: &Leaf) -> String {
    let p = &leaf.payload;
    let nodes: Vec<&str> = p["nodes"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    let shown: Vec<&str> = nodes.iter().take(10).copied().collect();
    let more = if nodes.len() > 10 { format!(", … ({} more)", nodes.len() - 10) } else { String::new() };
    let labels: Vec<String> =
        p["labels"].as_object().into_iter().flatten().map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("?"))).collect();
    let waves: Vec<&str> = p["waves"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
    format!(
        "  rollouts.create of {} to {} node(s): {}{more}; pool {}, labels {}, waves {}\n",
        leaf.subject,
        nodes.len(),
        shown.join(", "),
        p["poolId"].as_str().unwrap_or("any"),
        if labels.is_empty() { "none".to_owned() } else { labels.join(",") },
        waves.join(",")
    )
}

/// The summary an approver reads before signing.
fn summary(scope: &ScopeFile) -> String {
    let mut kinds: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for leaf in &scope.leaves {
        kinds.entry(&leaf.kind).or_default().push(&leaf.subject);
    }
    let subjects: std::collections::BTreeSet<&str> = scope.leaves.iter().map(|l| l.subject.as_str()).collect();
    let mut text = format!("Batch {}: {}\n", scope.batch_id, scope.reason);
    text.push_str(&format!("Proposed by {}.\n", scope.proposed_by));
    let counts: Vec<String> = kinds.iter().map(|(k, s)| format!("{k} ×{}", s.len())).collect();
    text.push_str(&format!("{} command(s) on {} subject(s): {}\n", scope.leaves.len(), subjects.len(), counts.join(", ")));
    for (kind, subjects) in &kinds {
        let shown: Vec<&str> = subjects.iter().take(10).copied().collect();
        let more = if subjects.len() > 10 { format!(", … ({} more)", subjects.len() - 10) } else { String::new() };
        text.push_str(&format!("  {kind}: {}{more}\n", shown.join(", ")));
    }
    for leaf in scope.leaves.iter().filter(|l| l.kind == bc_projections::decide::batch::LEAF_ROLLOUT_CREATE).take(10) {
        text.push_str(&rollout_line(leaf));
    }
    text.push_str(&format!(
        "Approvals: {} of {}; the window closes at {} ms (trust domain {}, approver set epoch {}).\n",
        scope.approvals, scope.quorum, scope.expires_at_ms, scope.trust_domain, scope.epoch
    ));
    text.push_str(&format!("Root {} over {} leaves, recomputed here.\n", scope.root, scope.size));
    text
}

/// `--expect FILE`: the subjects (or `{subject, kind}` pairs) the batch must hold, exactly.
fn check_expect(scope: &ScopeFile, path: &Path) -> Result<(), CliError> {
    let text = read_bounded(path, SCOPE_FILE_BYTES_MAX, "--expect")?;
    let text = String::from_utf8(text).map_err(|_| CliError::usage(format!("--expect {} is not text", path.display())))?;
    let mut expected: BTreeMap<(String, Option<String>), i64> = BTreeMap::new();
    let mut with_kind = false;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let entry = if line.starts_with('{') {
            let v: Value =
                serde_json::from_str(line).map_err(|e| CliError::usage(format!("--expect: {line:?} is not JSON: {e}")))?;
            with_kind = true;
            (
                text_of(&v, "subject").map_err(|_| CliError::usage("--expect: a line without subject"))?,
                v["kind"].as_str().map(str::to_owned),
            )
        } else {
            (line.to_owned(), None)
        };
        *expected.entry(entry).or_default() += 1;
    }
    let mut held: BTreeMap<(String, Option<String>), i64> = BTreeMap::new();
    for leaf in &scope.leaves {
        *held.entry((leaf.subject.clone(), with_kind.then(|| leaf.kind.clone()))).or_default() += 1;
    }
    let mut differences = Vec::new();
    for (entry, n) in &held {
        let e = expected.get(entry).copied().unwrap_or(0);
        if *n > e {
            differences.push(format!(
                "unexpected {}{}",
                entry.0,
                entry.1.as_deref().map(|k| format!(" ({k})")).unwrap_or_default()
            ));
        }
    }
    for (entry, n) in &expected {
        if held.get(entry).copied().unwrap_or(0) < *n {
            differences.push(format!("missing {}{}", entry.0, entry.1.as_deref().map(|k| format!(" ({k})")).unwrap_or_default()));
        }
    }
    if !differences.is_empty() {
        return Err(CliError::new(
            "SCOPE_UNEXPECTED",
            format!("batch {} is not what {} lists: {}", scope.batch_id, path.display(), differences.join("; ")),
        ));
    }
    Ok(())
}

/// The review, then the signature: the root recomputed, the state and window, unbound leaves,
/// `--root`, `--expect`; without `--yes`, `--root` or `--expect`, the summary only (`None`).
pub fn review_and_sign(
    scope: &ScopeFile,
    review: &Review,
    key: &SigningKey,
    now_ms: u64,
) -> Result<Option<SignatureFile>, CliError> {
    check_root(scope)?;
    eprint!("{}", summary(scope));
    if scope.state != "pending" {
        return Err(CliError::new("INVALID_STATE", format!("batch {} is {}, not pending", scope.batch_id, scope.state)));
    }
    if now_ms >= scope.expires_at_ms {
        return Err(CliError::new("INVALID_STATE", format!("batch {}'s window has closed", scope.batch_id)));
    }
    if scope.expires_at_ms - now_ms > review.max_hours * 3_600_000 {
        return Err(CliError::new(
            "INVALID_STATE",
            format!("batch {} stays open longer than --max-hours {}", scope.batch_id, review.max_hours),
        ));
    }
    if !review.allow_unbound
        && let Some(leaf) = scope.leaves.iter().find(|l| !l.is_bound())
    {
        return Err(CliError::new(
            "UNBOUND_SCOPE",
            format!("batch {}: the {} leaf on {} admits any payload", scope.batch_id, leaf.kind, leaf.subject),
        )
        .hint("approve only with --allow-unbound, knowing any payload of that kind runs"));
    }
    if let Some(root) = &review.root
        && !root.eq_ignore_ascii_case(&scope.root)
    {
        return Err(CliError::new(
            "SCOPE_CHANGED",
            format!("batch {} no longer has the root {root} you reviewed: it is {}", scope.batch_id, scope.root),
        ));
    }
    if let Some(expect) = &review.expect {
        check_expect(scope, expect)?;
    }
    if !review.yes && review.root.is_none() && review.expect.is_none() {
        eprintln!("Not approved. Re-run with --yes, or with --root {}.", scope.root);
        return Ok(None);
    }
    let message = approval_message(&scope.trust_domain, &scope.batch_id, &scope.root, scope.size, scope.expires_at_ms);
    let public = approver_key_of(key.verifying_key())?;
    Ok(Some(SignatureFile {
        batch_id: scope.batch_id.clone(),
        kid: public.kid,
        public_key: public.public_key,
        signature: sign(key, &message),
        root: scope.root.clone(),
        size: scope.size,
        expires_at_ms: scope.expires_at_ms,
        trust_domain: scope.trust_domain.clone(),
    }))
}

/// A `batch sign` file signs this batch, as its verified scope says, or `SCOPE_MISMATCH`.
fn check_signature_file(scope: &ScopeFile, signed: &SignatureFile) -> Result<(), CliError> {
    let mismatch = |why: &str| {
        CliError::new("SCOPE_MISMATCH", format!("--signature signs something else than batch {}: {why}", scope.batch_id))
    };
    let der = base64::engine::general_purpose::STANDARD
        .decode(&signed.public_key)
        .map_err(|_| mismatch("its publicKey is not base64"))?;
    let key = VerifyingKey::from_public_key_der(&der).map_err(|_| mismatch("its publicKey is not a P-256 key"))?;
    if kid_of_spki(&der) != signed.kid {
        return Err(mismatch("its kid is not its key's"));
    }
    let message = approval_message(&scope.trust_domain, &scope.batch_id, &scope.root, scope.size, scope.expires_at_ms);
    if !verify_signature(&key, &message, &signed.signature) {
        return Err(mismatch("its signature does not verify over this batch's id, root, size, expiry and trust domain"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SigningKey {
        let mut bytes = [7u8; 32];
        bytes[0] = 1;
        SigningKey::from_slice(&bytes).unwrap()
    }

    fn scope() -> ScopeFile {
        let leaves: Vec<Leaf> = ["node_a", "node_b", "node_c"]
            .iter()
            .map(|s| Leaf { subject: (*s).into(), kind: "ping".into(), payload: json!({}) })
            .collect();
        ScopeFile {
            batch_id: "batch_01k0000000000000000000000".into(),
            reason: "r".into(),
            state: "pending".into(),
            root: scope_root(&leaves).unwrap(),
            size: 3,
            expires_at_ms: 10 * 3_600_000,
            trust_domain: "compute.test".into(),
            epoch: 1,
            quorum: 2,
            approvals: 0,
            proposed_by: "apikey:x".into(),
            leaves,
        }
    }

    fn yes() -> Review {
        Review { yes: true, max_hours: MAX_HOURS_DEFAULT, ..Review::default() }
    }

    fn code(result: Result<Option<SignatureFile>, CliError>) -> String {
        result.err().map(|e| e.code).unwrap_or_else(|| "signed".into())
    }

    /// The approver reads a rollout leaf whole: its release, how many nodes and which, the pool,
    /// the labels and the waves; the other kinds by count and subject.
    #[test]
    fn the_summary_shows_what_a_rollout_leaf_binds() {
        let mut s = scope();
        s.leaves.push(Leaf {
            subject: "rel_a".into(),
            kind: bc_projections::decide::batch::LEAF_ROLLOUT_CREATE.into(),
            payload: json!({ "poolId": "pool_a", "labels": { "rack": "12" }, "waves": ["1", "100%"], "nodes": ["node_a", "node_b"] }),
        });
        let text = summary(&s);
        assert!(text.contains("4 command(s) on 4 subject(s): ping ×3, rollouts.create ×1"), "{text}");
        assert!(
            text.contains("rollouts.create of rel_a to 2 node(s): node_a, node_b; pool pool_a, labels rack=12, waves 1,100%"),
            "{text}"
        );
    }

    /// A server that changes one leaf, adds one, or reports another root or size: SCOPE_MISMATCH,
    /// and nothing is signed.
    #[test]
    fn a_lying_scope_is_refused_before_anything_is_signed() {
        let mut changed = scope();
        changed.leaves[1].subject = "node_z".into();
        assert_eq!(code(review_and_sign(&changed, &yes(), &key(), 0)), "SCOPE_MISMATCH");
        let mut payload = scope();
        payload.leaves[2].payload = json!({ "force": true });
        assert_eq!(code(review_and_sign(&payload, &yes(), &key(), 0)), "SCOPE_MISMATCH");
        let mut root = scope();
        root.root = "00".repeat(32);
        assert_eq!(code(review_and_sign(&root, &yes(), &key(), 0)), "SCOPE_MISMATCH");
        let mut size = scope();
        size.size = 4;
        assert_eq!(code(review_and_sign(&size, &yes(), &key(), 0)), "SCOPE_MISMATCH");
        assert_eq!(code(review_and_sign(&scope(), &yes(), &key(), 0)), "signed");
    }

    /// The review rules, each with its code; the signature verifies over the documented message.
    #[test]
    fn each_review_rule_has_its_code() {
        let reviewed = Review { root: Some("ab".repeat(32)), max_hours: MAX_HOURS_DEFAULT, ..Review::default() };
        assert_eq!(code(review_and_sign(&scope(), &reviewed, &key(), 0)), "SCOPE_CHANGED");
        let short = Review { max_hours: 2, ..yes() };
        assert_eq!(code(review_and_sign(&scope(), &short, &key(), 0)), "INVALID_STATE");
        assert_eq!(code(review_and_sign(&scope(), &yes(), &key(), 10 * 3_600_000)), "INVALID_STATE");
        let mut released = scope();
        released.state = "released".into();
        assert_eq!(code(review_and_sign(&released, &yes(), &key(), 0)), "INVALID_STATE");
        let mut unbound = scope();
        unbound.leaves[0].payload = Value::Null;
        unbound.root = scope_root(&unbound.leaves).unwrap();
        assert_eq!(code(review_and_sign(&unbound, &yes(), &key(), 0)), "UNBOUND_SCOPE");
        let allowed = Review { allow_unbound: true, ..yes() };
        assert_eq!(code(review_and_sign(&unbound, &allowed, &key(), 0)), "signed");
        let summary_only = review_and_sign(&scope(), &Review { max_hours: 72, ..Review::default() }, &key(), 0);
        assert!(matches!(summary_only, Ok(None)), "without --yes, --root or --expect nothing is signed");
        let s = scope();
        let signed = review_and_sign(&s, &yes(), &key(), 0).unwrap().unwrap();
        let message = approval_message(&s.trust_domain, &s.batch_id, &s.root, s.size, s.expires_at_ms);
        assert!(verify_signature(key().verifying_key(), &message, &signed.signature));
        check_signature_file(&s, &signed).unwrap();
        let mut other = scope();
        other.batch_id = "batch_01k0000000000000000000001".into();
        assert_eq!(check_signature_file(&other, &signed).unwrap_err().code, "SCOPE_MISMATCH");
    }
}
