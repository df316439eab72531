//! Destructive batches under a quorum (`docs/batches.md`): the deployment's approver set
//! (`approver_set/deployment` on the root tenant's chain) and command batches
//! (`command_batch/batch_…`): their documents, the payloads of their events, their fold, and
//! the byte formats approvers sign, which the CLI, the gateway and any outside verifier share.
//!
//! - A **leaf** is `{subject, kind, payload}` in the log's canonical CBOR
//!   ([`bc_core::canonical`]), so it binds the exact operation; the **scope** is the list of
//!   leaves, and its root is the RFC 6962 Merkle root of their encodings ([`bc_core::merkle`]).
//! - An **approval** is an ECDSA P-256 / SHA-256 signature (ASN.1 DER, base64) over
//!   [`approval_message`]: the trust domain, the batch id, the root, the size and the expiry.
//! - An **approver set** at epoch N+1 is accepted only with the signatures of K keys of the set
//!   at epoch N over [`approver_set_message`]; the first (epoch 1) is the root admin's.
//!
//! A batch's commands have their ids when the batch is made; they are issued (`command.issued`,
//! in the same transaction as `command_batch.released`) only when the quorum is reached, so a
//! held command cannot be delivered by any path: until then it is `awaitingApproval` in the
//! batch's members and absent from the node's queue.

use base64::Engine as _;
use bc_core::event::StoredEvent;
use bc_core::merkle::{self, Hash};
use bc_core::store::RowKey;
use bc_core::{Error, Result};
use p256::ecdsa::VerifyingKey;
use p256::pkcs8::EncodePublicKey as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{corrupt, from_doc, payload, to_doc};

/// The deployment's approver set: one row on the root tenant.
pub const KIND_APPROVER_SET: &str = "approver_set";
/// The id of the approver set's row and stream (`approver_set/deployment`).
pub const APPROVER_SET_ID: &str = "deployment";
/// A command batch (`command_batch/batch_…`).
pub const KIND_COMMAND_BATCH: &str = "command_batch";
/// One row per pending batch (removed when it is released, cancelled or expires): what the
/// `batches` reconciler scans for windows that closed.
pub const KIND_COMMAND_BATCH_LIVE: &str = "command_batch_live";

pub const APPROVER_SET_PUBLISHED: &str = "approver_set.published";
pub const COMMAND_BATCH_CREATED: &str = "command_batch.created";
pub const COMMAND_BATCH_APPROVED: &str = "command_batch.approved";
pub const COMMAND_BATCH_RELEASED: &str = "command_batch.released";
pub const COMMAND_BATCH_SCOPE_ADDED: &str = "command_batch.scope_added";
pub const COMMAND_BATCH_CHUNK_ISSUED: &str = "command_batch.chunk_issued";
pub const COMMAND_BATCH_CANCELLED: &str = "command_batch.cancelled";
pub const COMMAND_BATCH_EXPIRED: &str = "command_batch.expired";

/// Keys one approver set holds at most.
pub const APPROVERS_MAX: usize = 16;
/// Leaves one batch holds at most. Its creation carries them in events of
/// [`COMMAND_BATCH_CHUNK_LEAVES`] (`command_batch.created`, then `command_batch.scope_added`, one
/// transaction), and its release issues their commands a chunk a transaction.
pub const COMMAND_BATCH_LEAVES_MAX: usize = 10_000;
/// Leaves one creation event carries, and commands one release transaction issues, at most: a
/// chunk (`command_batch.chunk_issued` and its `command.issued`s) is one append group.
pub const COMMAND_BATCH_CHUNK_LEAVES: usize = 200;
/// The encoded leaves of one chunk, at most (one event carries them with their command ids).
pub const COMMAND_BATCH_LEAF_BYTES_MAX: usize = 40 * 1024;
/// The longest window a batch stays open for approvals, in hours.
pub const COMMAND_BATCH_HOURS_MAX: u64 = 72;
/// A batch's reason: at most this many bytes.
pub const COMMAND_BATCH_REASON_BYTES_MAX: usize = 500;
/// A trust domain: at most this many bytes of `[a-z0-9.-]`.
pub const TRUST_DOMAIN_BYTES_MAX: usize = 253;
pub use bc_core::approval::{PUBLIC_KEY_B64_BYTES_MAX, SIGNATURE_B64_BYTES_MAX};
// A chunk's commands and its `chunk_issued`; a creation's events: each one append.
const _: () = assert!(COMMAND_BATCH_CHUNK_LEAVES < bc_core::store::BATCH_EVENTS_MAX);
const _: () = assert!(COMMAND_BATCH_LEAVES_MAX.div_ceil(COMMAND_BATCH_CHUNK_LEAVES) < bc_core::store::BATCH_EVENTS_MAX);
const _: () = assert!(COMMAND_BATCH_LEAF_BYTES_MAX + 24 * 1024 <= bc_core::event::PAYLOAD_BYTES_MAX);

pub use bc_core::approval::{APPROVAL_MESSAGE_V1, APPROVER_SET_MESSAGE_V1, approval_message, kid_of_spki, verify_signature};

/// One operation of a batch's scope.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Leaf {
    /// What it acts on (a node id).
    pub subject: String,
    /// The operation (a command kind, `ping`).
    pub kind: String,
    /// The operation's exact arguments (a JSON object). `null` would admit any payload of the
    /// kind (an unbound leaf); the gateway makes none, and `batch approve` refuses one without
    /// `--allow-unbound`.
    pub payload: Value,
}

impl Leaf {
    /// The leaf's bytes: `{subject, kind, payload}` in the log's canonical CBOR (map keys
    /// sorted by their encoding, shortest integers, no floats).
    pub fn encode(&self) -> Result<Vec<u8>> {
        bc_core::approval::leaf_bytes(&self.subject, &self.kind, &self.payload)
    }

    /// Its RFC 6962 leaf hash.
    pub fn hash(&self) -> Result<Hash> {
        Ok(merkle::leaf_hash(&self.encode()?))
    }

    /// Whether the payload pins the operation (an object, not `null`).
    pub fn is_bound(&self) -> bool {
        self.payload.is_object()
    }
}

/// The RFC 6962 root of the leaves' encodings, as lowercase hex.
pub fn scope_root(leaves: &[Leaf]) -> Result<String> {
    let hashes = leaves.iter().map(Leaf::hash).collect::<Result<Vec<_>>>()?;
    Ok(hex::encode(merkle::root(&hashes)))
}

/// What K approvers of epoch N sign to publish the set of epoch N+1: its trust domain, epoch
/// and quorum, then one `key KID PUBLIC_KEY` line per key, sorted by kid.
pub fn approver_set_message(trust_domain: &str, epoch: u64, quorum: u64, keys: &[ApproverKey]) -> String {
    bc_core::approval::approver_set_message(
        trust_domain,
        epoch,
        quorum,
        keys.iter().map(|k| (k.kid.as_str(), k.public_key.as_str())),
    )
}

/// The key id and base64 SubjectPublicKeyInfo of a P-256 public key.
pub fn approver_key_of(key: &VerifyingKey) -> Result<ApproverKey> {
    let der = key.to_public_key_der().map_err(|e| Error::Internal(format!("encoding a P-256 key: {e}")))?;
    Ok(ApproverKey {
        kid: kid_of_spki(der.as_bytes()),
        public_key: base64::engine::general_purpose::STANDARD.encode(der.as_bytes()),
    })
}

/// Parses a base64 SubjectPublicKeyInfo of a P-256 key, checking that `kid` is its id.
pub fn parse_approver_key(key: &ApproverKey) -> Result<VerifyingKey> {
    bc_core::approval::parse_public_key(&key.kid, &key.public_key)
        .map_err(|why| Error::invalid(format!("approver key {}: {why}", bc_core::id::truncate(&key.kid, 40))))
}

/// The keys as `bc_core::approval` takes them.
pub fn key_refs(keys: &[ApproverKey]) -> Vec<bc_core::approval::KeyRef> {
    keys.iter().map(|k| bc_core::approval::KeyRef { kid: k.kid.clone(), public_key: k.public_key.clone() }).collect()
}

/// One approver's public key.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproverKey {
    /// `ak_` and 16 hex digits: [`kid_of_spki`].
    pub kid: String,
    /// The key's SubjectPublicKeyInfo, DER, base64 (standard alphabet, padded).
    pub public_key: String,
}

/// One signature by an approver.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproverSignature {
    pub kid: String,
    /// ECDSA P-256 / SHA-256, ASN.1 DER, base64.
    pub signature: String,
}

/// `approver_set.published`: the set at `epoch`, with the signatures of the previous set's keys
/// that allowed it (none for epoch 1, which the root admin publishes).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApproverSetPublished {
    pub epoch: u64,
    pub quorum: u64,
    pub trust_domain: String,
    pub keys: Vec<ApproverKey>,
    pub signatures: Vec<ApproverSignature>,
}

/// The deployment's approver set as its newest `approver_set.published` says.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ApproverSetDoc {
    pub epoch: u64,
    pub quorum: u64,
    pub trust_domain: String,
    pub keys: Vec<ApproverKey>,
    /// The kids whose signatures published it (empty for epoch 1).
    pub signed_by: Vec<String>,
    pub published_by: String,
    pub published_at_ms: u64,
    pub version: u64,
    /// The root a node pins (`command_root_sha256` in `bcd`'s `config.toml`): SHA-256 of the
    /// epoch-1 set's message, kept through every later epoch.
    #[serde(default)]
    pub command_root_sha256: String,
}

impl ApproverSetDoc {
    pub fn key(&self, kid: &str) -> Option<&ApproverKey> {
        self.keys.iter().find(|k| k.kid == kid)
    }
}

/// A batch's state: `pending` (open for approvals, its commands held), then `released` (its
/// commands issued), `cancelled` or `expired` (its commands never issued).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BatchState {
    Pending,
    Released,
    Cancelled,
    Expired,
}

impl BatchState {
    pub const ALL: &[Self] = &[Self::Pending, Self::Released, Self::Cancelled, Self::Expired];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Released => "released",
            Self::Cancelled => "cancelled",
            Self::Expired => "expired",
        }
    }
}

impl std::str::FromStr for BatchState {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        crate::state_from_str("batch", text, Self::ALL, Self::as_str)
    }
}

/// `command_batch.created`: the scope, its root, the window, the approver set's epoch and
/// quorum it is to be approved under, and the ids its commands will have.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandBatchCreated {
    pub reason: String,
    pub leaves: Vec<Leaf>,
    pub root: String,
    pub size: u64,
    pub expires_at_ms: u64,
    pub trust_domain: String,
    pub epoch: u64,
    pub quorum: u64,
    /// One per leaf, in leaf order.
    pub command_ids: Vec<String>,
    /// Each released command's deadline, seconds after the release.
    pub deadline_s: u64,
}

/// `command_batch.scope_added`: the next leaves of a batch's scope and their command ids, after
/// `command_batch.created`'s (in the same transaction): a batch's leaves in chunks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandBatchScopeAdded {
    pub leaves: Vec<Leaf>,
    pub command_ids: Vec<String>,
}

/// `command_batch.chunk_issued`: chunk `chunk` of a released batch had its commands issued, in
/// the same transaction.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandBatchChunkIssued {
    pub chunk: u64,
    pub commands: u64,
    /// The metal leaves of the chunk whose verb the machine refused at the release (its state
    /// had moved on, a workflow ran, its node held reservations): they start nothing, and
    /// `batch members` shows them `failed` with the reason. The chunk's other leaves go on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<LeafRefused>,
}

/// One leaf a release could not start, and why.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LeafRefused {
    pub index: u64,
    pub reason: String,
}

/// `command_batch.approved`: one approver's valid signature over the batch's message.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandBatchApproved {
    pub kid: String,
    pub signature: String,
    pub epoch: u64,
}

/// `command_batch.released`: the quorum was reached; the batch's commands are then issued a
/// chunk a transaction (`command_batch.chunk_issued`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandBatchReleased {
    /// The kids whose approvals released it.
    pub approvals: Vec<String>,
}

/// `command_batch.cancelled` and `command_batch.expired`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CommandBatchEnded {
    pub reason: String,
}

/// One approval a batch holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BatchApproval {
    pub kid: String,
    pub signature: String,
    pub epoch: u64,
    pub by: String,
    pub at_ms: u64,
}

/// A command batch's document.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CommandBatchDoc {
    pub tenant_id: String,
    pub batch_id: String,
    pub reason: String,
    pub state: BatchState,
    pub leaves: Vec<Leaf>,
    pub root: String,
    pub size: u64,
    pub expires_at_ms: u64,
    pub trust_domain: String,
    pub epoch: u64,
    pub quorum: u64,
    pub command_ids: Vec<String>,
    pub deadline_s: u64,
    pub approvals: Vec<BatchApproval>,
    pub created_by: String,
    pub created_at_ms: u64,
    pub ended_at_ms: Option<u64>,
    pub end_reason: Option<String>,
    pub version: u64,
    /// Chunks of a released batch whose commands are issued ([`CommandBatchDoc::chunks`] in all).
    #[serde(default)]
    pub chunks_issued: u64,
    /// The metal leaves their release could not start ([`CommandBatchChunkIssued::refused`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<LeafRefused>,
}

impl CommandBatchDoc {
    /// The chunks its commands are issued in.
    pub fn chunks(&self) -> u64 {
        (self.leaves.len() as u64).div_ceil(COMMAND_BATCH_CHUNK_LEAVES as u64)
    }

    /// Whether it is released with chunks still to issue.
    pub fn releasing(&self) -> bool {
        self.state == BatchState::Released && self.chunks_issued < self.chunks()
    }
}

/// Folds `approver_set.*` and `command_batch.*`.
pub(crate) fn apply(key: &RowKey, current: Option<Value>, event: &StoredEvent) -> Result<Option<Value>> {
    let env = &event.envelope;
    match (key.kind.as_str(), env.event_type.as_str()) {
        (KIND_APPROVER_SET, APPROVER_SET_PUBLISHED) => {
            let p: ApproverSetPublished = payload(event)?;
            let command_root_sha256 = match (&current, p.epoch) {
                (_, 1) => bc_core::approval::command_root_of(&p.trust_domain, p.quorum, &key_refs(&p.keys)),
                (Some(doc), _) => doc["commandRootSha256"].as_str().unwrap_or_default().to_owned(),
                (None, epoch) => return Err(corrupt(event, format!("the approver set's first epoch is {epoch}"))),
            };
            to_doc(&ApproverSetDoc {
                command_root_sha256,
                epoch: p.epoch,
                quorum: p.quorum,
                trust_domain: p.trust_domain,
                keys: p.keys,
                signed_by: p.signatures.into_iter().map(|s| s.kid).collect(),
                published_by: env.actor.clone(),
                published_at_ms: env.at_ms,
                version: env.version,
            })
        }
        (KIND_COMMAND_BATCH_LIVE, _) => {
            if current.is_none() && env.event_type != COMMAND_BATCH_CREATED {
                return Ok(None);
            }
            let key = RowKey { kind: KIND_COMMAND_BATCH.to_owned(), ..key.clone() };
            let doc = apply(&key, current, event)?;
            let live = match &doc {
                Some(d) => {
                    let batch: CommandBatchDoc = from_doc(event, Some(d.clone()))?;
                    batch.state == BatchState::Pending || batch.releasing()
                }
                None => false,
            };
            Ok(if live { doc } else { None })
        }
        (KIND_COMMAND_BATCH, COMMAND_BATCH_CREATED) => {
            if current.is_some() {
                return Err(corrupt(event, format!("batch {} created twice", key.id)));
            }
            let p: CommandBatchCreated = payload(event)?;
            to_doc(&CommandBatchDoc {
                tenant_id: env.tenant.to_string(),
                batch_id: key.id.clone(),
                reason: p.reason,
                state: BatchState::Pending,
                leaves: p.leaves,
                root: p.root,
                size: p.size,
                expires_at_ms: p.expires_at_ms,
                trust_domain: p.trust_domain,
                epoch: p.epoch,
                quorum: p.quorum,
                command_ids: p.command_ids,
                deadline_s: p.deadline_s,
                approvals: Vec::new(),
                created_by: env.actor.clone(),
                created_at_ms: env.at_ms,
                ended_at_ms: None,
                end_reason: None,
                version: env.version,
                chunks_issued: 0,
                refused: Vec::new(),
            })
        }
        (KIND_COMMAND_BATCH, COMMAND_BATCH_SCOPE_ADDED) => {
            let mut doc: CommandBatchDoc = from_doc(event, current)?;
            let p: CommandBatchScopeAdded = payload(event)?;
            if doc.state != BatchState::Pending || !doc.approvals.is_empty() || p.leaves.len() != p.command_ids.len() {
                return Err(corrupt(event, format!("scope added to batch {} after its creation", key.id)));
            }
            doc.leaves.extend(p.leaves);
            doc.command_ids.extend(p.command_ids);
            if doc.leaves.len() as u64 > doc.size {
                return Err(corrupt(event, format!("batch {} holds more leaves than its size {}", key.id, doc.size)));
            }
            doc.version = env.version;
            to_doc(&doc)
        }
        (KIND_COMMAND_BATCH, COMMAND_BATCH_CHUNK_ISSUED) => {
            let mut doc: CommandBatchDoc = from_doc(event, current)?;
            let p: CommandBatchChunkIssued = payload(event)?;
            if !doc.releasing() || p.chunk != doc.chunks_issued {
                return Err(corrupt(event, format!("chunk {} of batch {} issued out of turn", p.chunk, key.id)));
            }
            doc.chunks_issued += 1;
            doc.refused.extend(p.refused);
            doc.version = env.version;
            to_doc(&doc)
        }
        (
            KIND_COMMAND_BATCH,
            COMMAND_BATCH_APPROVED | COMMAND_BATCH_RELEASED | COMMAND_BATCH_CANCELLED | COMMAND_BATCH_EXPIRED,
        ) => {
            let mut doc: CommandBatchDoc = from_doc(event, current)?;
            if doc.state != BatchState::Pending {
                return Err(corrupt(event, format!("{} on batch {} that is {}", env.event_type, key.id, doc.state.as_str())));
            }
            match env.event_type.as_str() {
                COMMAND_BATCH_APPROVED => {
                    let p: CommandBatchApproved = payload(event)?;
                    doc.approvals.push(BatchApproval {
                        kid: p.kid,
                        signature: p.signature,
                        epoch: p.epoch,
                        by: env.actor.clone(),
                        at_ms: env.at_ms,
                    });
                }
                COMMAND_BATCH_RELEASED => {
                    let _: CommandBatchReleased = payload(event)?;
                    doc.state = BatchState::Released;
                    doc.ended_at_ms = Some(env.at_ms);
                }
                other => {
                    let p: CommandBatchEnded = payload(event)?;
                    doc.state = if other == COMMAND_BATCH_CANCELLED { BatchState::Cancelled } else { BatchState::Expired };
                    doc.ended_at_ms = Some(env.at_ms);
                    doc.end_reason = Some(p.reason);
                }
            }
            doc.version = env.version;
            to_doc(&doc)
        }
        _ => Ok(current),
    }
}

/// Every approver set published, oldest first (`approver_set.published` on the root tenant's
/// chain): the chain a batch's releases carry from epoch 1.
pub async fn approver_set_history(store: &dyn bc_core::store::EventStore) -> Result<Vec<ApproverSetPublished>> {
    let stream = crate::stream_of(KIND_APPROVER_SET, &APPROVER_SET_ID);
    let mut sets = Vec::new();
    let mut after = 0;
    loop {
        let rows = store.read_stream_rows(bc_core::id::TenantId::ROOT, &stream, after, bc_core::store::READ_ROWS_MAX).await?;
        if rows.is_empty() {
            return Ok(sets);
        }
        for event in bc_core::store::decode_rows(rows)? {
            after = event.envelope.version;
            sets.push(payload(&event)?);
        }
    }
}

/// The first node of `subjects` (one per command of a chunk) whose queue has no room for them
/// all (`COMMANDS_PENDING_PER_NODE_MAX` unfinished commands), if any.
pub async fn node_without_room(
    store: &dyn bc_core::store::EventStore,
    tenant: &str,
    subjects: &[&str],
) -> Result<Option<String>> {
    let mut counts: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for subject in subjects {
        *counts.entry(subject).or_default() += 1;
    }
    for (node, adding) in counts {
        let pending = match store.row_get(tenant, crate::command::KIND_NODE_COMMANDS, node).await? {
            Some(row) => serde_json::from_value::<crate::command::NodeCommandsDoc>(row.doc)
                .map_err(|e| Error::Internal(format!("node_commands/{node}: {e}")))?
                .pending
                .len(),
            None => 0,
        };
        if pending + adding > crate::command::COMMANDS_PENDING_PER_NODE_MAX {
            return Ok(Some(node.to_owned()));
        }
    }
    Ok(None)
}

/// The appends of one chunk of a released batch, for one `Log::append_group`: reads what each
/// leaf the release applies needs, as of now (a metal leaf's machine, its node and a deploy's
/// image; a `nodes.delete`'s node and what holds on to it; a `reservations.release`'s
/// reservation; a `rollouts.create`'s release, the tenant's nodes and live rollouts) and decides
/// it ([`crate::decide::batch::leaf_start`]); a leaf refused now is recorded in the chunk's
/// `refused` with the reason and applies nothing, and the chunk's other leaves go on. Shared by
/// the approval that releases a batch and the `batches` reconciler.
pub async fn chunk_requests(
    store: &dyn bc_core::store::EventStore,
    batch: &CommandBatchDoc,
    mut chunk: crate::decide::batch::ChunkRelease,
    actor: &str,
    correlation: Option<&str>,
    now_ms: u64,
) -> Result<Vec<bc_core::store::AppendRequest>> {
    use crate::decide::batch::{LEAF_METAL_DEPLOY, LEAF_NODE_DELETE, LEAF_RESERVATION_RELEASE, LEAF_ROLLOUT_CREATE};
    let tenant: bc_core::id::TenantId =
        batch.tenant_id.parse().map_err(|_| Error::Internal(format!("batch {} names no tenant", batch.batch_id)))?;
    async fn row<T: serde::de::DeserializeOwned>(
        store: &dyn bc_core::store::EventStore,
        tenant: &str,
        kind: &str,
        id: String,
    ) -> Result<Option<T>> {
        match store.row_get(tenant, kind, &id).await? {
            Some(row) => serde_json::from_value(row.doc).map(Some).map_err(|e| Error::Internal(format!("{kind}/{id}: {e}"))),
            None => Ok(None),
        }
    }
    let tenant_text = batch.tenant_id.as_str();
    // A rollout leaf's world: the tenant's nodes and live rollouts, read once a chunk.
    let rollouts = chunk.applied.iter().any(|s| s.leaf.kind == LEAF_ROLLOUT_CREATE);
    let (nodes, live) = if rollouts {
        let nodes: Vec<crate::NodeDoc> = crate::placement::all_rows(store, tenant, crate::KIND_NODE).await?;
        let live: Vec<crate::rollout::RolloutDoc> =
            crate::placement::all_rows(store, tenant, crate::rollout::KIND_ROLLOUT_LIVE).await?;
        (nodes, live.into_iter().filter(|r| r.state.is_live()).collect())
    } else {
        (Vec::new(), Vec::new())
    };
    let mut applied = Vec::with_capacity(chunk.applied.len());
    for start in &chunk.applied {
        let subject = start.leaf.subject.clone();
        let kind = start.leaf.kind.as_str();
        let (mut machine, mut node, mut image, mut holders, mut reservation, mut release) = (None, None, None, None, None, None);
        match kind {
            LEAF_NODE_DELETE => {
                node = row::<crate::NodeDoc>(store, tenant_text, crate::KIND_NODE, subject.clone()).await?;
                if node.is_some() {
                    holders = Some(crate::placement::node_holders(store, tenant, &subject).await?);
                }
            }
            LEAF_RESERVATION_RELEASE => {
                reservation = row::<crate::ReservationDoc>(store, tenant_text, crate::KIND_RESERVATION, subject).await?;
            }
            LEAF_ROLLOUT_CREATE => {
                release = row::<crate::rollout::ReleaseDoc>(store, tenant_text, crate::rollout::KIND_RELEASE, subject).await?;
            }
            _ => {
                machine =
                    row::<crate::workflow::MetalDoc>(store, tenant_text, crate::workflow::KIND_METAL, subject.clone()).await?;
                node = row(store, tenant_text, crate::KIND_NODE, subject).await?;
                image = match crate::decide::batch::deploy_leaf_ids(&start.leaf.payload) {
                    Some((image_id, _)) if kind == LEAF_METAL_DEPLOY => {
                        row::<crate::ImageDoc>(store, tenant_text, crate::KIND_IMAGE, image_id).await?
                    }
                    _ => None,
                };
            }
        }
        let world = crate::decide::batch::LeafWorld {
            machine: machine.as_ref(),
            node: node.as_ref(),
            image: image.as_ref(),
            holders: holders.as_ref(),
            reservation: reservation.as_ref(),
            release: release.as_ref(),
            nodes: &nodes,
            live: &live,
        };
        match crate::decide::batch::leaf_start(start, &world, &batch.batch_id, now_ms) {
            Ok(Some(append)) => applied.push(append),
            // A reservation already over: released, with nothing to append.
            Ok(None) => {}
            Err(e @ (Error::Internal(_) | Error::Storage(_))) => return Err(e),
            Err(e) => chunk.issued.refused.push(LeafRefused { index: start.index, reason: e.public_message() }),
        }
    }
    crate::decide::batch::chunk_appends(tenant, batch, chunk, applied, actor, correlation)
}
