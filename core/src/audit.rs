//! Audit: signed per-tenant checkpoints, verification of the whole log, inclusion and
//! consistency proofs, and the offline check of a proof file.
//!
//! A tenant's tree has leaf `i` = the hash of the event with `seq = i + 1` (`merkle`). A
//! checkpoint is a C2SP signed note over `DEPLOYMENT/audit/TENANT`, the tree size and the root
//! (`note`); it is appended to the tenant's own chain as a `checkpoint.sealed` event, and the
//! projections keep one row per checkpoint (kind `checkpoint`). Before signing, the sealer
//! recomputes the previous checkpoint's root from the log, so it never signs a checkpoint that
//! is not consistent with the one before.
//!
//! Trust: event signatures are checked against *trusted* keys only (the pins an auditor gives,
//! or the local log key), never merely against whatever `signing_keys` holds, so a chain
//! re-signed with a key slipped into the database does not verify.

use std::collections::BTreeMap;
use std::sync::Arc;

use ciborium::Value;
use ed25519_dalek::{Signature, VerifyingKey};

use crate::chain::ChainProblem;
use crate::error::{Error, Result};
use crate::event::{EventRow, GENESIS_PREV, SignatureColumns, sha256};
use crate::id::{EventId, TenantId};
use crate::keys::{KeyRing, LogKey, VerifiedSignatures, event_signing_message, key_id_of};
use crate::merkle::{self, RootBuilder};
use crate::note::{self, CheckpointBody, ConsistencyFile, ProofFile, Vkey};
use crate::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent, READ_ROWS_MAX, decode_row};

pub const CHECKPOINT_SEALED: &str = "checkpoint.sealed";
/// A witness's cosignature of a sealed checkpoint (`{treeSize, witness, cosignature}`),
/// appended to the tenant's chain; it does not make the tree "grow" for sealing.
pub const CHECKPOINT_COSIGNED: &str = "checkpoint.cosigned";
/// Appended to the root tenant's chain, signed by the old key, when the log key rotates.
pub const LOG_KEY_ROTATED: &str = "log_key.rotated";
pub const KIND_CHECKPOINT: &str = "checkpoint";
/// The deployment's name: the signing key's name in notes and the prefix of every origin.
pub const DEPLOYMENT_DEFAULT: &str = "better-compute";
/// Most problems one `verify` reports; past that it says how many more there were.
pub const PROBLEMS_MAX: usize = 1000;
/// Rows per page while verifying; bounds memory whatever the log's size.
const VERIFY_PAGE_ROWS: u32 = READ_ROWS_MAX;

/// The row id of a checkpoint: its size, zero-padded so ids sort by size.
pub fn checkpoint_row_id(size: u64) -> String {
    format!("{size:020}")
}

/// The payload of `checkpoint.sealed`: `{treeSize, note}` (the root is inside the note).
pub fn checkpoint_payload(size: u64, note: &str) -> Value {
    Value::Map(vec![
        (Value::Text("treeSize".into()), Value::Integer(size.into())),
        (Value::Text("note".into()), Value::Text(note.to_owned())),
    ])
}

/// Reads `{treeSize, note}` back from a payload.
pub fn parse_checkpoint_payload(payload: &Value) -> Option<(u64, String)> {
    let Value::Map(entries) = payload else { return None };
    let (mut size, mut note) = (None, None);
    for (k, v) in entries {
        match (k, v) {
            (Value::Text(k), Value::Integer(i)) if k == "treeSize" => size = u64::try_from(*i).ok(),
            (Value::Text(k), Value::Text(t)) if k == "note" => note = Some(t.clone()),
            _ => {}
        }
    }
    Some((size?, note?))
}

/// Every key the store has registered, as note verifiers named `deployment`. Used to open this
/// log's *own* older checkpoints (after a rotation they are signed by an older key); auditors
/// trust pins they hold instead.
pub async fn known_vkeys(store: &dyn EventStore, deployment: &str) -> Result<Vec<Vkey>> {
    let mut out = Vec::new();
    for (key_id, public) in store.signing_keys().await? {
        let public = crate::keys::stored_public_key(&key_id, &public)?;
        out.push(Vkey::new(deployment, public).map_err(Error::invalid)?);
    }
    Ok(out)
}

/// Opens a note with the first of `vkeys` that signed it; returns the body and that key.
fn open_with(note: &str, vkeys: &[Vkey]) -> Result<(CheckpointBody, Vkey), String> {
    let mut last = "no keys to check the checkpoint with".to_owned();
    for v in vkeys {
        match note::open_note(note, v) {
            Ok(text) => return Ok((CheckpointBody::parse(&text)?, v.clone())),
            Err(e) => last = e,
        }
    }
    Err(last)
}

pub fn vkey_of(key: &LogKey, deployment: &str) -> Result<Vkey> {
    Vkey::new(deployment, key.public()).map_err(Error::invalid)
}

/// A stored checkpoint.
#[derive(Clone, Debug)]
pub struct StoredCheckpoint {
    pub size: u64,
    /// The note as sealed (the log's signature only), verbatim.
    pub note: String,
    /// Witnesses' cosignature lines, in the order they came.
    pub cosignatures: Vec<String>,
}

impl StoredCheckpoint {
    /// The note with the witnesses' cosignature lines appended: what is served and proved.
    pub fn cosigned_note(&self) -> String {
        let mut out = self.note.clone();
        for line in &self.cosignatures {
            out.push_str(line);
            out.push('\n');
        }
        out
    }
}

/// The payload of `checkpoint.cosigned`.
pub fn cosigned_payload(size: u64, witness: &str, cosignature: &str) -> Value {
    Value::Map(vec![
        (Value::Text("treeSize".into()), Value::Integer(size.into())),
        (Value::Text("witness".into()), Value::Text(witness.to_owned())),
        (Value::Text("cosignature".into()), Value::Text(cosignature.to_owned())),
    ])
}

/// Reads `{treeSize, witness, cosignature}` back.
pub fn parse_cosigned_payload(payload: &Value) -> Option<(u64, String, String)> {
    let Value::Map(entries) = payload else { return None };
    let (mut size, mut witness, mut line) = (None, None, None);
    for (k, v) in entries {
        match (k, v) {
            (Value::Text(k), Value::Integer(i)) if k == "treeSize" => size = u64::try_from(*i).ok(),
            (Value::Text(k), Value::Text(t)) if k == "witness" => witness = Some(t.clone()),
            (Value::Text(k), Value::Text(t)) if k == "cosignature" => line = Some(t.clone()),
            _ => {}
        }
    }
    Some((size?, witness?, line?))
}

/// Records a witness's cosignature of the checkpoint of `size` (idempotent per witness and size).
pub async fn record_cosignature(log: &Log, tenant: TenantId, size: u64, witness: &str, line: &str) -> Result<()> {
    log.append(AppendRequest {
        tenant,
        stream: format!("{KIND_CHECKPOINT}/{tenant}"),
        expected: ExpectedVersion::Any,
        idempotency_key: Some(format!("cosigned:{size}:{witness}")),
        actor: "system:witness".into(),
        causation: None,
        correlation: None,
        fingerprint: None,
        guards: vec![],
        events: vec![NewEvent::new(CHECKPOINT_COSIGNED, cosigned_payload(size, witness, line))],
    })
    .await?;
    Ok(())
}

async fn checkpoints_of(store: &dyn EventStore, tenant: TenantId) -> Result<Vec<StoredCheckpoint>> {
    checkpoints_after(store, tenant, None).await
}

/// A tenant's stored checkpoints larger than `after_size` (all of them for `None`), by size.
async fn checkpoints_after(store: &dyn EventStore, tenant: TenantId, after_size: Option<u64>) -> Result<Vec<StoredCheckpoint>> {
    let mut out = Vec::new();
    let mut after: Option<String> = after_size.map(checkpoint_row_id);
    loop {
        let rows = store.row_list(&tenant.to_string(), KIND_CHECKPOINT, after.as_deref(), READ_ROWS_MAX).await?;
        let Some(last) = rows.last() else { break };
        after = Some(last.key.id.clone());
        out.extend(rows.into_iter().map(stored_checkpoint));
    }
    Ok(out)
}

/// A stored checkpoint from its projection row.
fn stored_checkpoint(row: crate::store::Row) -> StoredCheckpoint {
    let size = row.doc["treeSize"].as_u64().unwrap_or(0);
    let note = row.doc["note"].as_str().unwrap_or("").to_owned();
    let cosignatures = row.doc["cosignatures"]
        .as_array()
        .map(|a| a.iter().filter_map(|l| l.as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    StoredCheckpoint { size, note, cosignatures }
}

/// The newest stored checkpoint of `tenant`, if any was sealed: the last row of its kind (ids
/// are zero-padded sizes), one row read however many were sealed.
pub async fn newest_checkpoint(store: &dyn EventStore, tenant: TenantId) -> Result<Option<StoredCheckpoint>> {
    Ok(store.row_last(&tenant.to_string(), KIND_CHECKPOINT).await?.map(stored_checkpoint))
}

/// The leaf hashes of a tenant's first `size` events (for proofs; 32 bytes per event).
pub async fn leaves(store: &dyn EventStore, tenant: TenantId, size: u64) -> Result<Vec<merkle::Hash>> {
    let mut out = Vec::with_capacity(size as usize);
    let mut from = 1;
    while (out.len() as u64) < size {
        let rows = store.read_chain_rows(tenant, from, VERIFY_PAGE_ROWS).await?;
        if rows.is_empty() {
            break;
        }
        for row in rows {
            if out.len() as u64 == size {
                break;
            }
            let hash = <[u8; 32]>::try_from(row.hash.as_slice()).map_err(|_| Error::Corrupt {
                tenant: tenant.to_string(),
                seq: row.seq,
                what: "hash is not 32 bytes".into(),
            })?;
            out.push(merkle::leaf_hash(&hash));
        }
        from = out.len() as u64 + 1;
    }
    if (out.len() as u64) < size {
        return Err(Error::Corrupt { tenant: tenant.to_string(), seq: out.len() as u64 + 1, what: "event missing".into() });
    }
    Ok(out)
}

/// What [`seal_all`] did: the checkpoints sealed, and the tenants that could not be sealed.
#[derive(Debug, Default)]
pub struct Sealed {
    pub sealed: Vec<(TenantId, StoredCheckpoint)>,
    pub failed: Vec<(TenantId, Error)>,
}

/// Seals every tenant whose tree grew (or just `only`), each with a walk of its whole chain
/// ([`Sealer`] keeps what it verified between calls; this does not). One tenant's failure (a
/// log that does not verify) does not stop the others; it is logged and returned.
pub async fn seal_all(log: &Log, only: Option<TenantId>, deployment: &str, trust: &Trust) -> Result<Sealed> {
    Sealer::default().seal_all(log, only, deployment, trust).await
}

/// Seals a checkpoint of `tenant` now, if its tree grew, after a walk of its whole chain
/// ([`Sealer::seal`]).
pub async fn seal(log: &Log, tenant: TenantId, deployment: &str, trust: &Trust) -> Result<Option<StoredCheckpoint>> {
    Sealer::default().seal(log, tenant, deployment, trust).await
}

/// Longest a [`Sealer`] goes without walking a tenant's chain from seq 1 again (by the log's
/// clock; a clock that goes back makes the walk due at once). Between full walks it verifies
/// only the events appended since the last one it walked, and of the stored checkpoints those
/// of the sizes it meets and the newest sealed in the chain, so a seal costs what the log grew
/// by, not what it holds. An event rewritten in the part already verified, or an older
/// checkpoint's stored row changed, is caught by the next full walk (and by `audit verify`); the
/// event is never signed over: the new checkpoint's root extends the tree of the events as they
/// were verified, not as they read now.
pub const SEAL_FULL_WALK_INTERVAL_MS: u64 = 24 * 60 * 60 * 1000;

/// Seals checkpoints, keeping what it verified of each tenant's chain so that the next seal
/// walks only the events appended since (the `checkpoints` reconciler's: a seal per interval
/// that re-verified the whole chain each time cost more every hour as the log grew).
/// It walks a chain from seq 1 on its first seal of a tenant, after [`SEAL_FULL_WALK_INTERVAL_MS`],
/// after a walk that failed, and when a walk from where it stopped finds the log does not verify
/// (which includes a benign race: another process's checkpoint of a size this one had walked
/// past, which it keeps no stored row of). Use one sealer with one `trust`.
#[derive(Default)]
pub struct Sealer {
    walked: std::collections::HashMap<TenantId, Walked>,
    /// Walks from seq 1 so far, and events walked in all (for the reconciler's log and tests).
    walks_from_start: u64,
    events_walked: u64,
}

/// What a [`Sealer`] verified of one chain.
#[derive(Clone)]
struct Walked {
    /// The tree of the events verified: seq 1 to its size.
    builder: RootBuilder,
    /// The hash of the last of them.
    last_hash: [u8; 32],
    /// The tree's root at each size a checkpoint might name: stored checkpoints' sizes passed on
    /// the way, and the size each walk ended at. None below `previous`'s size.
    roots: BTreeMap<u64, merkle::Hash>,
    /// The newest checkpoint sealed in the chain: its size, its note, the seq it was sealed at.
    previous: Option<(u64, String, u64)>,
    /// The last event that made the tree grow (not a checkpoint or a cosignature).
    grew_at: Option<u64>,
    /// When the last walk from seq 1 was.
    full_at_ms: u64,
}

impl Sealer {
    /// How many walks started from seq 1.
    pub fn walks_from_start(&self) -> u64 {
        self.walks_from_start
    }

    /// How many events all walks verified, in all.
    pub fn events_walked(&self) -> u64 {
        self.events_walked
    }

    /// [`seal_all`], keeping what each walk verified.
    pub async fn seal_all(&mut self, log: &Log, only: Option<TenantId>, deployment: &str, trust: &Trust) -> Result<Sealed> {
        let mut out = Sealed::default();
        let tenants: Vec<TenantId> = match only {
            Some(t) => vec![t],
            None => log.store.heads().await?.into_iter().map(|(t, _)| t).collect(),
        };
        for tenant in tenants {
            match self.seal(log, tenant, deployment, trust).await {
                Ok(Some(cp)) => out.sealed.push((tenant, cp)),
                Ok(None) => {}
                Err(e) => {
                    tracing::error!(%tenant, error = %e, "sealing a checkpoint failed");
                    out.failed.push((tenant, e));
                }
            }
        }
        Ok(out)
    }

    /// Seals a checkpoint of `tenant` now, if its tree grew (events other than checkpoints
    /// were appended since the last one). Only a log that verifies is signed: the chain is
    /// checked under `trust` (every seq, link and signature, and the head) from where this
    /// sealer last stopped, or from seq 1 (see [`Sealer`]), and the last checkpoint sealed *in
    /// the chain* must still match the log, so two checkpoints of a tenant are never
    /// inconsistent. Returns the new checkpoint's size and note.
    pub async fn seal(
        &mut self,
        log: &Log,
        tenant: TenantId,
        deployment: &str,
        trust: &Trust,
    ) -> Result<Option<StoredCheckpoint>> {
        let now_ms = log.clock.now_ms();
        // A clock that went back since the last walk from seq 1 makes the next one due now.
        let kept =
            self.walked.remove(&tenant).filter(|w| now_ms >= w.full_at_ms && now_ms - w.full_at_ms < SEAL_FULL_WALK_INTERVAL_MS);
        let mut walk = async |from: Option<Walked>| {
            let start = from.as_ref().map_or(0, |w| w.builder.size());
            if from.is_none() {
                self.walks_from_start += 1;
            }
            let done = seal_walk(log, tenant, deployment, trust, from).await;
            if let Ok(Some((walked, _))) = &done {
                self.events_walked += walked.builder.size() - start;
            }
            done
        };
        let walked = match kept {
            // A walk from where the last stopped that finds the log does not verify is walked
            // again from seq 1, whose answer (and error message) stands. Another error (the
            // store's) is the seal's, and what was verified is kept for the next.
            Some(kept) => match walk(Some(kept.clone())).await {
                Ok(done) => done,
                Err(Error::Corrupt { .. }) => walk(None).await?,
                Err(e) => {
                    self.walked.insert(tenant, kept);
                    return Err(e);
                }
            },
            None => walk(None).await?,
        };
        let Some((walked, sealed)) = walked else { return Ok(None) };
        self.walked.insert(tenant, walked);
        Ok(sealed)
    }
}

/// One seal: walks `tenant`'s chain from `from` (what an earlier walk verified) or from seq 1
/// up to its head, and signs and appends a checkpoint if the tree grew. Returns what was
/// verified and the checkpoint sealed, if any; `None` for a tenant without a head.
async fn seal_walk(
    log: &Log,
    tenant: TenantId,
    deployment: &str,
    trust: &Trust,
    from: Option<Walked>,
) -> Result<Option<(Walked, Option<StoredCheckpoint>)>> {
    let store = &*log.store;
    // This tenant's head alone (a pass seals every tenant: reading every head for each was a
    // pass quadratic in the tenants).
    let query = crate::store::PreReadQuery { tenants: vec![tenant], ..Default::default() };
    let Some(head) = store.preread(&query).await?.heads.remove(&tenant) else {
        return Ok(None);
    };
    let refuse = Refusal { tenant, resumed: from.is_some() };
    // The stored checkpoints must be the ones the chain sealed, as `verify` demands. A walk from
    // where the last stopped, at size `n`, reads only those of size `n` on: the next checkpoint
    // the chain holds is of the size the last walk ended at (this sealer's own) or larger. One
    // smaller (another process's, sealed at a head this one had walked past) fails the walk's
    // check that each checkpoint met is stored, and the seal walks from seq 1.
    let from_size = from.as_ref().map(|w| w.builder.size().saturating_sub(1));
    let stored: BTreeMap<u64, String> =
        checkpoints_after(store, tenant, from_size).await?.into_iter().map(|c| (c.size, c.note)).collect();
    let mut walked = from.unwrap_or(Walked {
        builder: RootBuilder::new(),
        last_hash: GENESIS_PREV,
        roots: BTreeMap::new(),
        previous: None,
        grew_at: None,
        full_at_ms: log.clock.now_ms(),
    });
    let mut verifier = crate::chain::ChainVerifier::resume(tenant, &trust.keys, walked.builder.size() + 1, walked.last_hash);
    walk_to_head(store, &refuse, head.seq, &stored, &mut verifier, &mut walked).await?;
    verifier.finish(Some((head.seq, head.hash))).map_err(|p| refuse.problem(p))?;
    check_last_checkpoint(store, &refuse, deployment, trust, &stored, &walked).await?;
    // The next walk needs no root below the newest checkpoint's, and may meet a checkpoint of
    // the size this one ends at (this sealer's, or another process's).
    if let Some((size, _, _)) = &walked.previous {
        walked.roots = walked.roots.split_off(size);
    }
    walked.roots.insert(walked.builder.size(), walked.builder.root());
    walked.last_hash = verifier.last_hash();
    // The tree grew: an event other than a checkpoint or a cosignature past the newest checkpoint.
    let last_size = walked.previous.as_ref().map(|(size, _, _)| *size).unwrap_or(0);
    let grew = walked.grew_at.is_some_and(|seq| seq > last_size);
    if !grew {
        return Ok(Some((walked, None)));
    }
    let body =
        CheckpointBody { origin: note::origin_of(deployment, &tenant), size: walked.builder.size(), root: walked.builder.root() };
    let sealed = append_checkpoint(log, tenant, deployment, body).await?;
    Ok(Some((walked, Some(sealed))))
}

/// A seal's refusal of a log that does not verify. A walk from where the last stopped that
/// fails is walked again from seq 1, whose failure is the one to raise the alarm (the first can
/// be a benign race: another process's checkpoint of a size this sealer had walked past).
struct Refusal {
    tenant: TenantId,
    resumed: bool,
}

impl Refusal {
    /// The refusal for what is wrong at `seq`.
    fn at(&self, seq: u64, what: impl Into<String>) -> Error {
        self.problem(ChainProblem { tenant: self.tenant.to_string(), seq, what: what.into() })
    }

    /// The refusal for a problem the chain verifier found, logged as a debug line for a resumed
    /// walk and as an error for a walk from seq 1.
    fn problem(&self, p: ChainProblem) -> Error {
        if self.resumed {
            tracing::debug!(tenant = %p.tenant, seq = p.seq, what = %p.what, "a seal from where the last stopped does not verify; walking from seq 1");
        } else {
            tracing::error!(tenant = %p.tenant, seq = p.seq, what = %p.what, "refusing to seal a log that does not verify");
        }
        Error::Corrupt { tenant: p.tenant, seq: p.seq, what: format!("refusing to seal: {}", p.what) }
    }
}

/// Verifies the chain's rows from where `walked` ends up to `head_seq`, growing its tree,
/// keeping the roots at the stored checkpoints' sizes, and noting the newest checkpoint sealed
/// (each must be stored as sealed) and the last event that made the tree grow.
async fn walk_to_head(
    store: &dyn EventStore,
    refuse: &Refusal,
    head_seq: u64,
    stored: &BTreeMap<u64, String>,
    verifier: &mut crate::chain::ChainVerifier<'_>,
    walked: &mut Walked,
) -> Result<()> {
    while walked.builder.size() < head_seq {
        let rows = store.read_chain_rows(refuse.tenant, walked.builder.size() + 1, VERIFY_PAGE_ROWS).await?;
        if rows.is_empty() {
            break;
        }
        for row in rows {
            if row.seq > head_seq {
                break;
            }
            let event = verifier.push(row).map_err(|p| refuse.problem(p))?;
            walked.builder.push_leaf_hash(merkle::leaf_hash(&event.hash));
            if stored.contains_key(&walked.builder.size()) {
                walked.roots.insert(walked.builder.size(), walked.builder.root());
            }
            let seq = event.envelope.seq;
            if event.envelope.event_type == CHECKPOINT_SEALED {
                let (size, note) = parse_checkpoint_payload(&event.envelope.payload)
                    .ok_or_else(|| refuse.at(seq, "checkpoint payload does not parse"))?;
                if stored.get(&size) != Some(&note) {
                    return Err(refuse.at(seq, format!("the checkpoint of size {size} is missing from the store or differs")));
                }
                if walked.previous.as_ref().is_none_or(|(s, _, _)| size >= *s) {
                    walked.previous = Some((size, note, seq));
                }
            } else if event.envelope.event_type != CHECKPOINT_COSIGNED {
                walked.grew_at = Some(seq);
            }
        }
    }
    Ok(())
}

/// The newest checkpoint sealed in the chain, if any, must still be stored as sealed, verify
/// under a trusted key, and name this deployment's tenant and the root the walk found at its
/// size: two checkpoints of a tenant are never inconsistent.
async fn check_last_checkpoint(
    store: &dyn EventStore,
    refuse: &Refusal,
    deployment: &str,
    trust: &Trust,
    stored: &BTreeMap<u64, String>,
    walked: &Walked,
) -> Result<()> {
    let Some((size, note, sealed_at)) = &walked.previous else { return Ok(()) };
    let tenant = refuse.tenant;
    // Still stored as sealed: checked on the way if it was met in this walk, else here.
    if !stored.contains_key(size) {
        let row = store.row_get(&tenant.to_string(), KIND_CHECKPOINT, &checkpoint_row_id(*size)).await?;
        if row.map(stored_checkpoint).map(|c| c.note).as_ref() != Some(note) {
            return Err(refuse.at(*sealed_at, format!("the checkpoint of size {size} is missing from the store or differs")));
        }
    }
    // The walk that met it kept the root at its size (a stored size it passed, or the size
    // a walk ended at), and `roots` keeps every size from the newest checkpoint's on.
    let Some(root) = walked.roots.get(size) else {
        return Err(refuse.at(*sealed_at, "the log no longer matches its last checkpoint"));
    };
    let (body, _) =
        open_with(note, &trust.vkeys).map_err(|e| refuse.at(*sealed_at, format!("the last checkpoint does not verify: {e}")))?;
    if body.size != *size || body.origin != note::origin_of(deployment, &tenant) || body.root != *root {
        return Err(refuse.at(body.size, "the log no longer matches its last checkpoint"));
    }
    Ok(())
}

/// Signs `body` and appends it as the tenant's `checkpoint.sealed`.
async fn append_checkpoint(log: &Log, tenant: TenantId, deployment: &str, body: CheckpointBody) -> Result<StoredCheckpoint> {
    let signed = note::sign_note(&body.encode(), deployment, &log.key).map_err(Error::Internal)?;
    log.append(AppendRequest {
        tenant,
        stream: format!("{KIND_CHECKPOINT}/{tenant}"),
        expected: ExpectedVersion::Any,
        // The same size gives the same note (Ed25519 is deterministic): sealing twice is a
        // replay. Client keys live under `request:`, so they cannot collide with this one.
        idempotency_key: Some(format!("checkpoint:{}", body.size)),
        actor: "system:audit".into(),
        causation: None,
        correlation: None,
        fingerprint: None,
        guards: vec![],
        events: vec![NewEvent {
            stream: None,
            event_type: CHECKPOINT_SEALED.into(),
            payload: checkpoint_payload(body.size, &signed),
        }],
    })
    .await?;
    Ok(StoredCheckpoint { size: body.size, note: signed, cosignatures: vec![] })
}

/// Rotates the log key: appends `log_key.rotated` (naming the new key) to the root tenant's
/// chain, signed by the current key, and registers the new key. The caller then signs with
/// `new` (restarting servers). Old events and checkpoints keep verifying under the old key.
pub async fn rotate_log_key(log: &Log, new: &LogKey, at_ms: u64) -> Result<u64> {
    log.store.signing_key_put(new.key_id(), new.public().as_bytes(), at_ms).await?;
    let root = TenantId::ROOT;
    let payload = Value::Map(vec![
        (Value::Text("previousKeyId".into()), Value::Text(log.key.key_id().to_owned())),
        (Value::Text("newKeyId".into()), Value::Text(new.key_id().to_owned())),
        (Value::Text("newPublicKey".into()), Value::Bytes(new.public().as_bytes().to_vec())),
    ]);
    let result = log
        .append(AppendRequest {
            tenant: root,
            stream: format!("log_key/{root}"),
            expected: ExpectedVersion::Any,
            idempotency_key: Some(format!("rotate:{}", new.key_id())),
            actor: "system:pki".into(),
            causation: None,
            correlation: None,
            fingerprint: None,
            guards: vec![],
            events: vec![NewEvent::new(LOG_KEY_ROTATED, payload)],
        })
        .await?;
    Ok(result.events[0].envelope.seq)
}

/// One thing wrong, located.
pub type Problem = ChainProblem;

#[derive(Clone, Debug, Default)]
pub struct Report {
    pub tenants: u64,
    pub events: u64,
    /// Events a node originated whose node signature verified.
    pub node_entries: u64,
    pub checkpoints: u64,
    pub problems: Vec<Problem>,
    /// Problems found beyond `PROBLEMS_MAX`.
    pub problems_omitted: u64,
}

impl Report {
    fn problem(&mut self, tenant: TenantId, seq: u64, what: impl Into<String>) {
        if self.problems.len() < PROBLEMS_MAX {
            self.problems.push(ChainProblem { tenant: tenant.to_string(), seq, what: what.into() });
        } else {
            self.problems_omitted += 1;
        }
    }
}

/// What `verify` trusts: the event-signing keys and the note keys (the same keys, by name).
#[derive(Clone, Debug)]
pub struct Trust {
    pub keys: KeyRing,
    pub vkeys: Vec<Vkey>,
}

impl Trust {
    /// Trusts exactly `publics`, named `deployment` in notes.
    pub fn of(publics: &[VerifyingKey], deployment: &str) -> Result<Self> {
        let mut keys = KeyRing::default();
        let mut vkeys = Vec::new();
        for p in publics {
            keys.insert(*p);
            vkeys.push(Vkey::new(deployment, *p).map_err(Error::invalid)?);
        }
        Ok(Self { keys, vkeys })
    }
}

/// Per-row checks that need no order: hash, encoding, columns; then one batch signature check.
/// Returns, per row, its hash and `prev`, or the problem. Runs on a blocking thread.
/// What the order-free checks learn about one row.
struct CheckedRow {
    hash: [u8; 32],
    prev: [u8; 32],
    /// The event's Merkle leaf hash, computed beside the rest of the page's checks.
    leaf: merkle::Hash,
    /// `(tree size, note)` when the row seals a checkpoint.
    checkpoint: Option<(u64, String)>,
    /// What the row says about a node's own signatures, checked in chain order (boxed: few
    /// rows have one, and every row's checks are moved between the page's vectors).
    node: Option<Box<NodeFact>>,
    /// Whether the row carries a signature of its own (checked here); one without is covered
    /// by the next that does, which the walk in chain order checks exists.
    signed: bool,
}

/// A node joining (its key is known from here on), or an event a node originated.
enum NodeFact {
    Joined { node: String, key: VerifyingKey },
    Journal { origin: crate::agent::JournalOrigin, event_type: String, stream: String, payload: serde_json::Value },
}

/// The node fact of a row: `node.joined` carries the node's key; an event with a `journal`
/// payload field carries a node's signed entry.
fn node_fact(row: &EventRow, payload: &[u8]) -> Result<Option<Box<NodeFact>>, String> {
    let journaled = row.event_type.starts_with("command.")
        || row.event_type == "node.observed"
        || row.event_type == "node.agent_started"
        || row.event_type == "node.inventory_reported";
    if row.event_type != NODE_JOINED && !journaled {
        return Ok(None);
    }
    let value: Value = ciborium::de::from_reader(payload).map_err(|e| format!("{} payload: {e}", row.event_type))?;
    let json = crate::canonical::to_json(&value);
    if row.event_type == NODE_JOINED {
        let node = row.stream.strip_prefix("node/").ok_or("node.joined is not on a node stream")?.to_owned();
        let key = json
            .get("publicKey")
            .and_then(|k| k.as_str())
            .ok_or("node.joined carries no publicKey")
            .map_err(str::to_owned)
            .and_then(crate::agent::unb64)
            .and_then(|bytes| crate::agent::node_public_key(&bytes))?;
        return Ok(Some(Box::new(NodeFact::Joined { node, key })));
    }
    let Some(origin) = json.get(crate::agent::JOURNAL_PAYLOAD_KEY) else { return Ok(None) };
    let origin: crate::agent::JournalOrigin =
        serde_json::from_value(origin.clone()).map_err(|e| format!("the journal entry it carries: {e}"))?;
    Ok(Some(Box::new(NodeFact::Journal {
        origin,
        event_type: row.event_type.clone(),
        stream: row.stream.clone(),
        payload: json,
    })))
}

/// The `node.joined` event type (projections names it; the verifier must know it too).
pub const NODE_JOINED: &str = "node.joined";

/// A row's signature as the batch checks it: the trusted key (borrowed from the ring: a
/// `VerifyingKey` is 192 bytes), the signature and the message.
struct RowSignature<'k> {
    key: &'k VerifyingKey,
    sig: Signature,
    message: Vec<u8>,
}

fn check_rows(rows: &[EventRow], keys: &KeyRing, verified: Option<&VerifiedSignatures>) -> Vec<Result<CheckedRow, String>> {
    let decoded: Vec<_> = rows
        .iter()
        .map(|row| {
            let event = row.check()?;
            let signature = match crate::event::signature_columns(row.seq, &row.event_type, &row.key_id, &row.sig)? {
                SignatureColumns::CoveredLater => None,
                SignatureColumns::Signed { key_id, sig } => {
                    let key = keys.get(key_id).ok_or_else(|| format!("signed by untrusted key {key_id}"))?;
                    let sig = Signature::from_slice(sig).map_err(|_| "signature is not 64 bytes".to_owned())?;
                    Some(RowSignature { key, sig, message: event_signing_message(&event.hash) })
                }
            };
            let checkpoint = if row.event_type == CHECKPOINT_SEALED {
                let payload: Value = ciborium::de::from_reader(event.payload).map_err(|e| format!("checkpoint payload: {e}"))?;
                parse_checkpoint_payload(&payload)
            } else {
                None
            };
            let node = node_fact(row, event.payload)?;
            let signed = signature.is_some();
            let leaf = merkle::leaf_hash(&event.hash);
            Ok((CheckedRow { hash: event.hash, prev: event.prev, leaf, checkpoint, node, signed }, signature))
        })
        .collect::<Vec<Result<_, String>>>();
    // Batch-verify the signatures of the rows that decoded (but those found good before); on
    // failure, find the bad ones.
    let batch: Vec<&RowSignature> = decoded
        .iter()
        .filter_map(|d| d.as_ref().ok().and_then(|(_, s)| s.as_ref()))
        .filter(|s| verified.is_none_or(|v| !v.contains(s.key, &s.message, &s.sig, true)))
        .collect();
    let messages: Vec<&[u8]> = batch.iter().map(|s| s.message.as_slice()).collect();
    let sigs: Vec<Signature> = batch.iter().map(|s| s.sig).collect();
    let publics: Vec<VerifyingKey> = batch.iter().map(|s| *s.key).collect();
    let batch_ok = batch.is_empty() || ed25519_dalek::verify_batch(&messages, &sigs, &publics).is_ok();
    if batch_ok && let Some(verified) = verified {
        for s in &batch {
            verified.insert(s.key, &s.message, &s.sig, true);
        }
    }
    decoded
        .into_iter()
        .map(|d| {
            let (checked, signature) = d?;
            let Some(RowSignature { key, sig, message }) = signature else { return Ok(checked) };
            let good = match (batch_ok, verified) {
                (true, _) => true,
                (false, Some(verified)) => verified.verify(key, &message, &sig, true),
                (false, None) => key.verify_strict(&message, &sig).is_ok(),
            };
            if !good {
                return Err("signature does not verify".to_owned());
            }
            Ok(checked)
        })
        .collect()
}

/// Verifies every chain (or one tenant's): hashes, links, signatures under trusted keys, every
/// checkpoint's signature and root, and that every sealed checkpoint is still stored. Streams
/// the log page by page (bounded memory: two pages a core in flight) and checks the pages on all
/// cores while the oldest is walked in chain order.
pub async fn verify(
    store: &Arc<dyn EventStore>,
    trust: &Trust,
    only: Option<TenantId>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Report> {
    verify_with(store, trust, only, progress, None).await
}

/// [`verify`], skipping the arithmetic of the event and journal signatures `verified` found good
/// in an earlier run (and remembering the ones this run finds good). Everything else is checked
/// again: every hash recomputed from the stored bytes, every link, every checkpoint. For a caller
/// that verifies the same growing log again and again (the simulator's full checks).
pub async fn verify_with(
    store: &Arc<dyn EventStore>,
    trust: &Trust,
    only: Option<TenantId>,
    progress: &(dyn Fn(u64) + Sync),
    verified: Option<std::sync::Arc<VerifiedSignatures>>,
) -> Result<Report> {
    let mut report = Report::default();
    let heads: std::collections::HashMap<TenantId, crate::store::Head> = store.heads().await?.into_iter().collect();
    // Pages in flight: two a core (four at least), so each core has a page to check while the
    // walk reads the next one and walks the oldest, and an uneven page does not idle a core.
    let pages_in_flight = std::thread::available_parallelism().map(|n| n.get().saturating_mul(2)).unwrap_or(1).clamp(4, 32);
    // Every tenant with events, a head or checkpoints: deleting a head must not hide a chain.
    let tenants: Vec<TenantId> = store.tenants().await?.into_iter().filter(|t| only.is_none_or(|o| o == *t)).collect();
    if let Some(only) = only
        && tenants.is_empty()
    {
        return Err(Error::not_found(format!("tenant {only} in this log")));
    }
    for tenant in tenants {
        let head = heads.get(&tenant).copied().unwrap_or(crate::store::Head { seq: 0, hash: GENESIS_PREV });
        report.tenants += 1;
        let mut walk = ChainWalk::new(tenant, verified.clone());
        walk.stored_checkpoints(&**store, trust, &mut report).await?;
        let mut pages = PageReader::new(tenant, head.seq, pages_in_flight);
        while let Some(page) = pages.next(store, &trust.keys, &verified).await? {
            walk.page(page, &mut report)?;
            progress(report.events);
            if walk.broken {
                break;
            }
        }
        if !walk.broken {
            walk.finish(head, &mut report);
        }
    }
    Ok(report)
}

/// The pages of one tenant's chain, read in order and each checked on a blocking thread of its
/// own (up to two pages a core in flight), while the oldest checked page is walked in chain
/// order. Memory stays bounded by the pages in flight.
///
/// Up to the chain head the pages are fixed ranges of seqs, so each is read as well as checked
/// beside the walk (reading was a third of the work, and done in the walk, one page at a time,
/// it left a core idle); past the head (rows a tampered head no longer counts, or appends since
/// it was read), page by page from the last row read, as far as rows go.
struct PageReader {
    tenant: TenantId,
    head_seq: u64,
    pages_in_flight: usize,
    read_from: u64,
    read_all: bool,
    in_flight: InFlight,
}

impl PageReader {
    fn new(tenant: TenantId, head_seq: u64, pages_in_flight: usize) -> PageReader {
        PageReader { tenant, head_seq, pages_in_flight, read_from: 1, read_all: false, in_flight: InFlight::default() }
    }

    /// The oldest page's checks, once the pipeline is refilled; `None` past the last row.
    async fn next(
        &mut self,
        store: &Arc<dyn EventStore>,
        keys: &KeyRing,
        verified: &Option<Arc<VerifiedSignatures>>,
    ) -> Result<Option<CheckedPage>> {
        let tenant = self.tenant;
        while self.in_flight.0.len() < self.pages_in_flight && !self.read_all {
            let (keys, verified) = (keys.clone(), verified.clone());
            if self.read_from <= self.head_seq {
                let (from, to) = (self.read_from, self.head_seq.min(self.read_from + u64::from(VERIFY_PAGE_ROWS) - 1));
                self.read_from = to + 1;
                let store = store.clone();
                self.in_flight.0.push_back(tokio::spawn(async move {
                    let mut rows = store.read_chain_rows(tenant, from, VERIFY_PAGE_ROWS).await?;
                    // Rows past the range (after a gap in it) are the next page's.
                    if let Some(past) = rows.iter().position(|r| r.seq > to) {
                        rows.truncate(past);
                    }
                    check_page(rows, keys, verified).await
                }));
            } else {
                let rows = store.read_chain_rows(tenant, self.read_from, VERIFY_PAGE_ROWS).await?;
                let Some(last) = rows.last() else {
                    self.read_all = true;
                    break;
                };
                self.read_from = last.seq + 1;
                self.in_flight.0.push_back(tokio::spawn(check_page(rows, keys, verified)));
            }
        }
        let Some(checked) = self.in_flight.0.pop_front() else { return Ok(None) };
        Ok(Some(checked.await.map_err(|e| Error::Internal(format!("verifier: {e}")))??))
    }
}

/// One tenant's walk in chain order: what it carries from row to row.
struct ChainWalk {
    tenant: TenantId,
    /// The stored checkpoints' roots and notes by size, each checkpoint checked on its own first.
    expected_roots: BTreeMap<u64, [u8; 32]>,
    stored_notes: BTreeMap<u64, String>,
    builder: RootBuilder,
    node_keys: std::collections::HashMap<String, VerifyingKey>,
    prev: [u8; 32],
    next_seq: u64,
    /// The walk stopped at a gap, a row that fails its checks or a broken link.
    broken: bool,
    /// The first event since the last signed one: a later signature must cover it.
    uncovered_from: Option<u64>,
    verified: Option<Arc<VerifiedSignatures>>,
}

impl ChainWalk {
    fn new(tenant: TenantId, verified: Option<Arc<VerifiedSignatures>>) -> ChainWalk {
        ChainWalk {
            tenant,
            expected_roots: BTreeMap::new(),
            stored_notes: BTreeMap::new(),
            builder: RootBuilder::new(),
            node_keys: std::collections::HashMap::new(),
            prev: GENESIS_PREV,
            next_seq: 1,
            broken: false,
            uncovered_from: None,
            verified,
        }
    }

    /// Reads the tenant's stored checkpoints, each checked on its own: signed by a trusted key,
    /// of this tenant, of the size it is stored under.
    async fn stored_checkpoints(&mut self, store: &dyn EventStore, trust: &Trust, report: &mut Report) -> Result<()> {
        let tenant = self.tenant;
        for cp in checkpoints_of(store, tenant).await? {
            report.checkpoints += 1;
            let opened = trust.vkeys.iter().find_map(|v| note::open_note(&cp.note, v).ok());
            let Some(text) = opened else {
                report.problem(tenant, cp.size, format!("checkpoint of size {} is not signed by a trusted key", cp.size));
                continue;
            };
            match CheckpointBody::parse(&text) {
                Ok(body) if body.size == cp.size && body.origin.ends_with(&format!("/audit/{tenant}")) => {
                    self.expected_roots.insert(body.size, body.root);
                    self.stored_notes.insert(body.size, cp.note.clone());
                }
                Ok(_) => report.problem(tenant, cp.size, "checkpoint names another tenant or size"),
                Err(e) => report.problem(tenant, cp.size, format!("checkpoint does not parse: {e}")),
            }
        }
        Ok(())
    }

    /// Walks a checked page. The page goes into the tree as the subtrees hashed beside its
    /// checks, once the walk has vouched for every leaf of it; a page a stored checkpoint's size
    /// falls in goes leaf by leaf, the checkpoint's root checked at its size in chain order.
    fn page(&mut self, (seqs, results, subtrees): CheckedPage, report: &mut Report) -> Result<()> {
        let (from, whole) = (self.builder.size(), seqs.len());
        let at_once = subtrees.is_some() && self.expected_roots.range(from + 1..=from + whole as u64).next().is_none();
        let mut leaves = Vec::with_capacity(if at_once { whole } else { 0 });
        for (seq, result) in seqs.into_iter().zip(results) {
            if !self.row(seq, result, at_once.then_some(&mut leaves), report) {
                self.broken = true;
                break;
            }
        }
        // No stored checkpoint's size falls in such a page, so there is no root to check.
        match subtrees {
            Some(subtrees) if at_once && leaves.len() == whole => {
                for (size, hash) in subtrees {
                    if !self.builder.push_subtree(size, hash) {
                        return Err(Error::Internal(format!(
                            "verifier: a subtree of {size} does not start where the tree of {} ends",
                            self.builder.size()
                        )));
                    }
                }
            }
            // The walk stopped inside the page: the leaves it vouched for.
            _ => leaves.into_iter().for_each(|leaf| self.builder.push_leaf_hash(leaf)),
        }
        Ok(())
    }

    /// Walks one row: its seq, its own checks and its link, the node fact it carries, its leaf
    /// (into `leaves` for a page taken at once, else into the tree, checked against a stored
    /// root) and the checkpoint it seals. False where the chain breaks at it.
    fn row(
        &mut self,
        seq: u64,
        result: Result<CheckedRow, String>,
        leaves: Option<&mut Vec<merkle::Hash>>,
        report: &mut Report,
    ) -> bool {
        let tenant = self.tenant;
        if seq != self.next_seq {
            let what = if seq > self.next_seq {
                format!("event missing: the next stored event is seq {seq}")
            } else {
                format!("out of order: seq {seq} stored after seq {}", self.next_seq - 1)
            };
            report.problem(tenant, self.next_seq, what);
            return false;
        }
        let CheckedRow { hash, prev: event_prev, leaf, checkpoint, node, signed } = match result {
            Ok(ok) => ok,
            Err(what) => {
                report.problem(tenant, seq, what);
                return false;
            }
        };
        if event_prev != self.prev {
            report.problem(tenant, seq, "prev does not match the hash of the event before");
            return false;
        }
        if let Some(fact) = node {
            self.node_fact(seq, *fact, report);
        }
        if signed {
            self.uncovered_from = None;
        } else {
            self.uncovered_from.get_or_insert(seq);
        }
        self.prev = hash;
        self.next_seq += 1;
        report.events += 1;
        match leaves {
            Some(leaves) => leaves.push(leaf),
            None => {
                self.builder.push_leaf_hash(leaf);
                check_root(report, tenant, &self.builder, &self.expected_roots);
            }
        }
        if let Some((size, sealed_note)) = checkpoint {
            self.sealed_checkpoint(seq, size, &sealed_note, report);
        }
        true
    }

    /// A node's join remembers its key; a journal entry is checked under the key it joined with.
    fn node_fact(&mut self, seq: u64, fact: NodeFact, report: &mut Report) {
        let tenant = self.tenant;
        match fact {
            NodeFact::Joined { node, key } => {
                self.node_keys.insert(node, key);
            }
            NodeFact::Journal { origin, event_type, stream, payload } => match self.node_keys.get(&origin.node_id) {
                None => report.problem(tenant, seq, format!("an entry of node {} that never joined this chain", origin.node_id)),
                Some(key) => {
                    if let Err(what) = origin.check_remembered(key, &event_type, &stream, &payload, self.verified.as_deref()) {
                        report.problem(tenant, seq, format!("node {}'s journal entry {}: {what}", origin.node_id, origin.seq));
                    } else {
                        report.node_entries += 1;
                    }
                }
            },
        }
    }

    /// The checkpoint a row sealed must still be stored, as it was sealed.
    fn sealed_checkpoint(&self, seq: u64, size: u64, sealed_note: &str, report: &mut Report) {
        match self.stored_notes.get(&size) {
            Some(stored) if stored == sealed_note => {}
            Some(_) => report.problem(
                self.tenant,
                seq,
                format!("the stored checkpoint of size {size} differs from the one sealed at seq {seq}"),
            ),
            None => {
                report.problem(self.tenant, seq, format!("the checkpoint of size {size} sealed at seq {seq} is no longer stored"))
            }
        }
    }

    /// The end of an unbroken walk: the chain head agrees with the last event, every event is
    /// covered by a signature, and no stored checkpoint is larger than the log.
    fn finish(&self, head: crate::store::Head, report: &mut Report) {
        let tenant = self.tenant;
        let last = self.next_seq - 1;
        if head.seq > last {
            report.problem(tenant, last + 1, format!("event missing: the chain head says seq {}", head.seq));
        } else if head.seq < last {
            report.problem(tenant, head.seq + 1, format!("seq {} is past the chain head {}", head.seq + 1, head.seq));
        } else if head.hash != self.prev {
            report.problem(tenant, last, "chain head hash differs from the last event's hash");
        } else if let Some(from) = self.uncovered_from {
            report.problem(tenant, from, crate::chain::uncovered(from, last));
        }
        for size in self.expected_roots.keys().filter(|s| **s > last) {
            report.problem(tenant, last + 1, format!("checkpoint of size {size} is beyond the end of the log (truncated?)"));
        }
    }
}

/// A page's order-free checks, as the walk takes them: its rows' seqs, each row's checks, and
/// the page's Merkle subtrees if it holds the leaves from its first seq on (the walk checks
/// that it does before it uses them).
type CheckedPage = (Vec<u64>, Vec<Result<CheckedRow, String>>, Option<Vec<(u64, merkle::Hash)>>);

/// Checks a page on a blocking thread ([`check_rows`] and the page's Merkle subtrees).
async fn check_page(rows: Vec<EventRow>, keys: KeyRing, verified: Option<Arc<VerifiedSignatures>>) -> Result<CheckedPage> {
    tokio::task::spawn_blocking(move || {
        let results = check_rows(&rows, &keys, verified.as_deref());
        let leaves: Option<Vec<merkle::Hash>> = results.iter().map(|r| r.as_ref().ok().map(|c| c.leaf)).collect();
        let subtrees = match (leaves, rows.first()) {
            (Some(leaves), Some(first)) => Some(merkle::range_subtrees(first.seq.saturating_sub(1), &leaves)),
            _ => None,
        };
        (rows.iter().map(|r| r.seq).collect::<Vec<_>>(), results, subtrees)
    })
    .await
    .map_err(|e| Error::Internal(format!("verifier: {e}")))
}

/// The verify's pages in flight, oldest first; those still running when the walk ends early (a
/// broken chain, an error) are stopped rather than read and checked for nothing.
#[derive(Default)]
struct InFlight(std::collections::VecDeque<tokio::task::JoinHandle<Result<CheckedPage>>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

/// Reports a stored checkpoint of the tree's size whose root is not the tree's.
fn check_root(report: &mut Report, tenant: TenantId, builder: &RootBuilder, expected_roots: &BTreeMap<u64, [u8; 32]>) {
    if let Some(root) = expected_roots.get(&builder.size())
        && *root != builder.root()
    {
        report.problem(tenant, builder.size(), format!("checkpoint of size {} does not match the log", builder.size()));
    }
}

/// Builds the proof of `event` in the newest checkpoint that contains it, and, given a
/// checkpoint the auditor saved, the consistency proof from it to that checkpoint.
pub async fn prove(
    store: &dyn EventStore,
    tenant: TenantId,
    event: EventId,
    vkey: &Vkey,
    saved: Option<&str>,
) -> Result<(ProofFile, Option<ConsistencyFile>)> {
    let row = store.event_row(tenant, event).await?.ok_or_else(|| Error::not_found(format!("event {event}")))?;
    let seq = row.seq;
    let stored = decode_row(row)?;
    let newest = newest_checkpoint(store, tenant).await?.filter(|c| c.size >= seq).ok_or_else(|| Error::InvalidArgument {
        message: format!("no checkpoint of tenant {tenant} contains seq {seq} yet"),
        hint: Some("seal one with `better-compute audit checkpoint`".into()),
    })?;
    let mut vkeys = vec![vkey.clone()];
    vkeys.extend(known_vkeys(store, &vkey.name).await?);
    let (body, signer) = open_with(&newest.note, &vkeys).map_err(|e| Error::Corrupt {
        tenant: tenant.to_string(),
        seq: newest.size,
        what: format!("stored checkpoint does not verify: {e}"),
    })?;
    let leaves = leaves(store, tenant, body.size).await?;
    if merkle::root(&leaves) != body.root {
        return Err(Error::Corrupt {
            tenant: tenant.to_string(),
            seq: body.size,
            what: "the log does not match its checkpoint".into(),
        });
    }
    let path = merkle::inclusion_proof(seq - 1, &leaves).expect("seq is within the checkpoint");
    let proof = ProofFile {
        event: stored.canonical,
        vkey: signer.encode(),
        index: seq - 1,
        path,
        checkpoint: newest.cosigned_note(),
        rotations: rotation_proofs(store, &vkeys).await?,
    };
    let consistency = match saved {
        None => None,
        Some(saved) => {
            let (old, _) = open_with(saved, &vkeys).map_err(|e| Error::InvalidArgument {
                message: format!("the saved checkpoint does not verify under this log's keys: {e}"),
                hint: None,
            })?;
            if old.origin != body.origin {
                return Err(Error::invalid(format!("the saved checkpoint is for {}, not {}", old.origin, body.origin)));
            }
            if old.size > body.size {
                return Err(Error::invalid(format!(
                    "the saved checkpoint (size {}) is newer than the log's newest (size {}): the log was rewound",
                    old.size, body.size
                )));
            }
            let path = merkle::consistency_proof(old.size, &leaves)
                .ok_or_else(|| Error::invalid("no consistency proof from an empty tree"))?;
            Some(ConsistencyFile { path, old_checkpoint: saved.to_owned() })
        }
    };
    Ok((proof, consistency))
}

/// Every `log_key.rotated` of the root tenant's chain, each proved in the first root checkpoint
/// the *old* key signed that covers it (`pki rotate-log-key` seals one). A rotation no such
/// checkpoint covers yet is left out: a checker holding only the old pin cannot follow it yet.
pub async fn rotation_proofs(store: &dyn EventStore, vkeys: &[Vkey]) -> Result<Vec<note::RotationProof>> {
    let root = TenantId::ROOT;
    let mut rotations = Vec::new();
    let mut from = 1;
    loop {
        let rows = store.read_chain_rows(root, from, VERIFY_PAGE_ROWS).await?;
        let Some(last) = rows.last() else { break };
        from = last.seq + 1;
        rotations.extend(rows.into_iter().filter(|r| r.event_type == LOG_KEY_ROTATED));
    }
    if rotations.is_empty() {
        return Ok(vec![]);
    }
    let checkpoints = checkpoints_of(store, root).await?;
    let mut out = Vec::new();
    for row in rotations.into_iter().take(note::ROTATIONS_MAX) {
        let Some(old) = vkeys.iter().find(|v| key_id_of(&v.public) == row.key_id) else { continue };
        let Some(cp) = checkpoints
            .iter()
            .filter(|c| c.size >= row.seq)
            .filter(|c| note::open_note(&c.note, old).is_ok())
            .min_by_key(|c| c.size)
        else {
            continue;
        };
        let leaves = leaves(store, root, cp.size).await?;
        let path = merkle::inclusion_proof(row.seq - 1, &leaves).expect("seq is within the checkpoint");
        out.push(note::RotationProof {
            event: row.canonical,
            sig: row.sig,
            vkey: old.encode(),
            index: row.seq - 1,
            path,
            checkpoint: cp.note.clone(),
        });
    }
    Ok(out)
}

/// The rotation proofs `GET /audit/{tenant}/rotations` serves, computed once per newest root
/// checkpoint and number of log keys: a rotation adds a key, and the checkpoint that proves it
/// is a new root checkpoint, so neither can change without the key changing. Computing them
/// reads the root tenant's whole chain; a monitor asks only when a checkpoint is signed by a
/// key it does not trust yet, but any reader could ask, hence the cache.
#[derive(Default)]
pub struct RotationSource {
    cached: std::sync::Mutex<Option<(RotationsKey, std::sync::Arc<Vec<note::RotationProof>>)>>,
}

/// What the rotations depend on: the newest root checkpoint's size and the number of log keys.
type RotationsKey = (u64, usize);

impl RotationSource {
    pub async fn get(&self, store: &dyn EventStore, deployment: &str) -> Result<std::sync::Arc<Vec<note::RotationProof>>> {
        let vkeys = known_vkeys(store, deployment).await?;
        let root_size = newest_checkpoint(store, TenantId::ROOT).await?.map(|c| c.size).unwrap_or(0);
        let key = (root_size, vkeys.len());
        if let Some((k, proofs)) = &*self.cached.lock().expect("rotation cache lock")
            && *k == key
        {
            return Ok(proofs.clone());
        }
        let proofs = std::sync::Arc::new(rotation_proofs(store, &vkeys).await?);
        *self.cached.lock().expect("rotation cache lock") = Some((key, proofs.clone()));
        Ok(proofs)
    }
}

/// Follows rotations (a proof file's, or what `GET /audit/{tenant}/rotations` serves) from the
/// keys trusted (`pins`, `trusted`): each rotation's old key must be trusted already, have
/// signed the rotation event and a root checkpoint that includes it; then its new key is
/// trusted. A rotation whose old key is not trusted is passed over; one that is but does not
/// check is an error. Returns every key trusted at the end.
pub fn follow_rotations(
    rotations: &[note::RotationProof],
    pins: &[String],
    trusted: &[VerifyingKey],
) -> Result<Vec<VerifyingKey>, String> {
    let mut trusted = trusted.to_vec();
    for (n, r) in rotations.iter().enumerate() {
        let what = |e: String| format!("key rotation {}: {e}", n + 1);
        let old = Vkey::parse(&r.vkey).map_err(what)?;
        if !trusted.contains(&old.public) && !pins.contains(&old.pin()) {
            continue;
        }
        let body = CheckpointBody::parse(&note::open_note(&r.checkpoint, &old).map_err(what)?).map_err(what)?;
        if !body.origin.ends_with(&format!("/audit/{}", TenantId::ROOT)) {
            return Err(what("the checkpoint is not the root tenant's".into()));
        }
        let event = crate::event::Envelope::from_canonical(&r.event).map_err(what)?;
        if event.event_type != LOG_KEY_ROTATED || event.tenant != TenantId::ROOT || Some(event.seq) != r.index.checked_add(1) {
            return Err(what("the event is not the root tenant's log_key.rotated at that index".into()));
        }
        let hash = sha256(&r.event);
        let sig = Signature::from_slice(&r.sig).map_err(|_| what("signature is not 64 bytes".into()))?;
        old.public.verify_strict(&event_signing_message(&hash), &sig).map_err(|_| what("not signed by the old key".into()))?;
        let previous = match &event.payload {
            Value::Map(m) => m.iter().find_map(|(k, v)| match (k, v) {
                (Value::Text(k), Value::Text(t)) if k == "previousKeyId" => Some(t.clone()),
                _ => None,
            }),
            _ => None,
        };
        if previous.as_deref() != Some(key_id_of(&old.public).as_str()) {
            return Err(what("the event does not name the old key as the previous one".into()));
        }
        let path: Vec<Vec<u8>> = r.path.iter().map(|h| h.to_vec()).collect();
        merkle::verify_inclusion(r.index, body.size, &merkle::leaf_hash(&hash), &path, &body.root)
            .map_err(|e| what(format!("inclusion: {e}")))?;
        let new = crate::follow::rotated_key(&event.payload).ok_or_else(|| what("the new key does not parse".into()))?;
        if !trusted.contains(&old.public) {
            trusted.push(old.public);
        }
        if !trusted.contains(&new) {
            trusted.push(new);
        }
    }
    Ok(trusted)
}

/// Which consistency an offline check established, if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Consistency {
    /// None: no checkpoint of the auditor's own was given and the proof came without a
    /// consistency file. The proof shows only that the event is in *a* tree the key signed: a
    /// forked log signed with the same key would pass.
    NotChecked,
    /// From the prover's own older checkpoint (the consistency file's): it shows that the
    /// prover's two checkpoints agree, not that the log extends what the auditor saw.
    FromProver { size: u64 },
    /// From the auditor's saved checkpoint (`--saved`): the log the proof is in extends the one
    /// the auditor saw. This is what catches a fork.
    FromSaved { size: u64 },
}

/// What an offline check established.
#[derive(Clone, Debug)]
pub struct Proved {
    pub tenant: TenantId,
    pub event: crate::event::Envelope,
    pub hash: [u8; 32],
    pub index: u64,
    pub origin: String,
    pub tree_size: u64,
    pub root: [u8; 32],
    pub key_id: String,
    pub consistency: Consistency,
}

/// Checks a proof file offline: the checkpoint's signature by a trusted key (a pin, or a vkey),
/// the event's hash, the inclusion path, and the consistency of the log with an older
/// checkpoint. `saved` is the auditor's own earlier checkpoint: when given, consistency is
/// proved from it, never from the checkpoint the prover's consistency file carries (a forked
/// log signed with the real key brings a consistent old checkpoint of its own). Without
/// `saved`, a consistency file is checked from its own old checkpoint (`FromProver`); without
/// either, nothing is (`NotChecked`), and callers must say so.
pub fn check_proof(
    proof: &str,
    consistency: Option<&str>,
    saved: Option<&str>,
    pins: &[String],
    vkeys: &[Vkey],
) -> Result<Proved, String> {
    let file = ProofFile::parse(proof)?;
    let vkey = proof_vkey(&file, pins, vkeys)?;
    let text = note::open_note(&file.checkpoint, &vkey)?;
    let body = CheckpointBody::parse(&text)?;
    let event = crate::event::Envelope::from_canonical(&file.event).map_err(|e| format!("the event: {e}"))?;
    if !body.origin.ends_with(&format!("/audit/{}", event.tenant)) {
        return Err(format!("the checkpoint is for {}, not for the event's tenant {}", body.origin, event.tenant));
    }
    // Leaf `index` is the event of seq `index + 1`: no seq follows u64::MAX.
    let Some(seq_proved) = file.index.checked_add(1) else {
        return Err(format!("the proof's index {} is out of range: no event has seq {} + 1", file.index, file.index));
    };
    if event.seq != seq_proved {
        return Err(format!("the event has seq {} but the proof is for index {}", event.seq, file.index));
    }
    let hash = sha256(&file.event);
    let path: Vec<Vec<u8>> = file.path.iter().map(|h| h.to_vec()).collect();
    merkle::verify_inclusion(file.index, body.size, &merkle::leaf_hash(&hash), &path, &body.root)
        .map_err(|e| format!("inclusion proof: {e}"))?;
    let mut trusted = vkeys.to_vec();
    trusted.push(vkey.clone());
    let consistency_file = consistency.map(ConsistencyFile::parse).transpose()?;
    let consistency = match (saved, &consistency_file) {
        (Some(saved), _) => consistency_from_saved(saved, consistency_file.as_ref(), &trusted, &body)?,
        (None, None) => Consistency::NotChecked,
        (None, Some(c)) => consistency_from_prover(c, &trusted, &body)?,
    };
    Ok(Proved {
        tenant: event.tenant,
        hash,
        index: file.index,
        origin: body.origin,
        tree_size: body.size,
        root: body.root,
        key_id: key_id_of(&vkey.public),
        consistency,
        event,
    })
}

/// The key a proof's checkpoint is to be opened with: a trusted vkey, the key a pin names, or a
/// newer key introduced by rotations the trusted key signed.
fn proof_vkey(file: &ProofFile, pins: &[String], vkeys: &[Vkey]) -> Result<Vkey, String> {
    let carried = Vkey::parse(&file.vkey).map_err(|e| format!("the proof's vkey: {e}"))?;
    if let Some(v) = vkeys.iter().find(|v| v.name == carried.name && v.public == carried.public) {
        Ok(v.clone())
    } else if pins.iter().any(|p| *p == carried.pin()) {
        Ok(carried)
    } else if follow_rotations(&file.rotations, pins, &vkeys.iter().map(|v| v.public).collect::<Vec<_>>())?
        .contains(&carried.public)
    {
        // A newer key, introduced by rotations the trusted key signed.
        Ok(carried)
    } else {
        Err("the proof is not signed by a trusted key (check --pin or --vkey)".into())
    }
}

/// The proof's checkpoint against the auditor's `saved` one: the same tree, no older, the same
/// root at the same size, else extended from it as the consistency file proves.
fn consistency_from_saved(
    saved: &str,
    consistency_file: Option<&ConsistencyFile>,
    trusted: &[Vkey],
    body: &CheckpointBody,
) -> Result<Consistency, String> {
    let (old, _) = open_with(saved, trusted).map_err(|e| format!("your saved checkpoint is not signed by a trusted key: {e}"))?;
    if old.origin != body.origin {
        return Err(format!("your saved checkpoint is for {}, the proof for {}", old.origin, body.origin));
    }
    if old.size > body.size {
        return Err(format!(
            "your saved checkpoint (size {}) is newer than the proof's (size {}): the log was rewound, or ask \
             for a proof in a checkpoint at least as new as yours",
            old.size, body.size
        ));
    }
    if old.size == body.size {
        if old.root != body.root {
            return Err(format!(
                "the proof's checkpoint and your saved one both have size {} but different roots: the log was forked",
                old.size
            ));
        }
    } else {
        let Some(c) = consistency_file else {
            return Err(format!(
                "no consistency proof from your saved checkpoint (size {}) came with the proof: ask for one made \
                 with `audit prove --checkpoint` and your saved checkpoint",
                old.size
            ));
        };
        let path: Vec<Vec<u8>> = c.path.iter().map(|h| h.to_vec()).collect();
        merkle::verify_consistency(old.size, body.size, &old.root, &body.root, &path).map_err(|e| {
            format!(
                "the log in the proof does not extend your saved checkpoint (size {}): it was forked or rewritten ({e})",
                old.size
            )
        })?;
    }
    Ok(Consistency::FromSaved { size: old.size })
}

/// The proof's checkpoint extends the older checkpoint the prover's consistency file carries.
fn consistency_from_prover(c: &ConsistencyFile, trusted: &[Vkey], body: &CheckpointBody) -> Result<Consistency, String> {
    let (old, _) =
        open_with(&c.old_checkpoint, trusted).map_err(|_| "the older checkpoint is not signed by a trusted key".to_owned())?;
    if old.origin != body.origin {
        return Err("the older checkpoint is for another tree".into());
    }
    let path: Vec<Vec<u8>> = c.path.iter().map(|h| h.to_vec()).collect();
    merkle::verify_consistency(old.size, body.size, &old.root, &body.root, &path)
        .map_err(|e| format!("consistency proof: {e}"))?;
    Ok(Consistency::FromProver { size: old.size })
}
