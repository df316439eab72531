//! The destructive-batch decisions (`docs/batches.md`): publishing an approver set, making a
//! batch, approving one (and releasing it at the quorum), cancelling one. Pure: the caller reads
//! the approver set and the batch, draws the ids and the time, and appends what comes back.
//!
//! The refusals an approver meets have codes of their own, which `batch approve` and the tests
//! rely on: a signature that does not verify over this batch's message (an approval of another
//! batch, or of another root) is `INVALID_ARGUMENT`; a batch past its window, one made under an
//! earlier approver set, or not pending, `INVALID_STATE`; a key not in the current set,
//! `ACCESS_DENIED`; a key that approved this batch already (a reused signature),
//! `ALREADY_EXISTS`.

use bc_core::approval::{BatchRelease, ReleaseSet, SignatureRef};
use bc_core::{Error, Result};

use crate::batch::{
    APPROVERS_MAX, ApproverKey, ApproverSetDoc, ApproverSetPublished, ApproverSignature, BatchState, COMMAND_BATCH_CHUNK_LEAVES,
    COMMAND_BATCH_HOURS_MAX, COMMAND_BATCH_LEAF_BYTES_MAX, COMMAND_BATCH_LEAVES_MAX, COMMAND_BATCH_REASON_BYTES_MAX,
    CommandBatchApproved, CommandBatchChunkIssued, CommandBatchCreated, CommandBatchDoc, CommandBatchScopeAdded, Leaf,
    TRUST_DOMAIN_BYTES_MAX, approval_message, approver_set_message, key_refs, parse_approver_key, scope_root, verify_signature,
};
use crate::command::CommandIssued;
use crate::decide::{Append, VerbInput};
use crate::metal::Verb;
use crate::workflow::MetalDoc;
use crate::{ImageDoc, NodeDoc};
use bc_core::store::{ExpectedVersion, NewEvent};

/// `metal.undeploy` (payload `{}`): the machine's undeploy, as `metal.undeploy` decides it.
pub const LEAF_METAL_UNDEPLOY: &str = "metal.undeploy";
/// `metal.deploy` (payload `{imageId, joinTokenId}`): the machine's deploy of that image, its
/// installed system joining with that token (minted when the batch is made, usable only once the
/// release appends it with the deploy).
pub const LEAF_METAL_DEPLOY: &str = "metal.deploy";
/// `metal.retire` (payload `{}`).
pub const LEAF_METAL_RETIRE: &str = "metal.retire";
/// `metal.powerOff` (payload `{}`): `metal.power` with `off`.
pub const LEAF_METAL_POWER_OFF: &str = "metal.powerOff";

/// The kinds a batch may hold (a leaf's `kind`), each with the payload it takes: `ping`, a
/// command its node runs, and the destructive metal verbs, which the release starts as their
/// machines' workflows ([`metal_leaf_start`]).
pub const BATCH_LEAF_KINDS: &[&str] = &["ping", LEAF_METAL_UNDEPLOY, LEAF_METAL_DEPLOY, LEAF_METAL_RETIRE, LEAF_METAL_POWER_OFF];

/// A metal leaf's verb and its power argument; `None` for a kind its node runs (`ping`).
pub fn metal_leaf_verb(kind: &str) -> Option<(Verb, Option<&'static str>)> {
    match kind {
        LEAF_METAL_UNDEPLOY => Some((Verb::Undeploy, None)),
        LEAF_METAL_DEPLOY => Some((Verb::Deploy, None)),
        LEAF_METAL_RETIRE => Some((Verb::Retire, None)),
        LEAF_METAL_POWER_OFF => Some((Verb::Power, Some("off"))),
        _ => None,
    }
}

/// A deploy leaf's image and join token ids, when its payload is exactly `{imageId, joinTokenId}`
/// of well-formed ids.
pub fn deploy_leaf_ids(payload: &serde_json::Value) -> Option<(String, String)> {
    let object = payload.as_object()?;
    let image = object.get("imageId")?.as_str()?.parse::<bc_core::id::ImageId>().ok()?;
    let token = object.get("joinTokenId")?.as_str()?.parse::<bc_core::id::JoinTokenId>().ok()?;
    (object.len() == 2).then(|| (image.to_string(), token.to_string()))
}

/// Whether a leaf's payload is exactly what its kind takes, so the leaf binds one operation.
fn check_leaf_payload(i: usize, leaf: &Leaf) -> Result<()> {
    if leaf.kind == LEAF_METAL_DEPLOY {
        if deploy_leaf_ids(&leaf.payload).is_none() {
            return Err(Error::invalid(format!("leaves[{i}]: a {} takes the payload {{imageId, joinTokenId}}", leaf.kind)));
        }
    } else if leaf.payload != serde_json::json!({}) {
        return Err(Error::invalid(format!("leaves[{i}]: a {} takes the payload {{}}", leaf.kind)));
    }
    Ok(())
}

/// The approver set to publish, as asked.
#[derive(Clone, Debug)]
pub struct ApproverSetInput {
    pub epoch: u64,
    pub quorum: u64,
    pub trust_domain: String,
    pub keys: Vec<ApproverKey>,
    pub signatures: Vec<ApproverSignature>,
}

/// Whether `text` is a trust domain: 1 to 253 bytes of `[a-z0-9.-]`.
pub fn is_trust_domain(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= TRUST_DOMAIN_BYTES_MAX
        && text.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
}

/// Decides an approver set's publication over the current one (`None`: none yet). Epoch 1 needs
/// no signature (the caller checked it is the root admin); epoch N+1 needs valid signatures of
/// at least the current quorum of distinct current keys over [`approver_set_message`], and keeps
/// the trust domain.
pub fn approver_set_publish(current: Option<&ApproverSetDoc>, input: ApproverSetInput) -> Result<ApproverSetPublished> {
    let ApproverSetInput { epoch, quorum, trust_domain, keys, signatures } = input;
    if !is_trust_domain(&trust_domain) {
        return Err(Error::invalid(format!("trustDomain must be 1 to {TRUST_DOMAIN_BYTES_MAX} bytes of a-z, 0-9, '.' and '-'")));
    }
    if keys.is_empty() || keys.len() > APPROVERS_MAX {
        return Err(Error::invalid(format!("an approver set holds 1 to {APPROVERS_MAX} keys, not {}", keys.len())));
    }
    for (i, key) in keys.iter().enumerate() {
        parse_approver_key(key)?;
        if keys[..i].iter().any(|k| k.kid == key.kid) {
            return Err(Error::invalid(format!("key {} is listed twice", key.kid)));
        }
    }
    if quorum == 0 || quorum > keys.len() as u64 {
        return Err(Error::invalid(format!("quorum must be 1 to the number of keys ({}), not {quorum}", keys.len())));
    }
    match current {
        None => {
            if epoch != 1 {
                return Err(Error::state(
                    format!("no approver set is published: the first is epoch 1, not {epoch}"),
                    "publish epoch 1",
                ));
            }
            if !signatures.is_empty() {
                return Err(Error::invalid("epoch 1 is published by the root admin, with no signatures"));
            }
        }
        Some(current) => {
            let next = current.epoch + 1;
            if epoch != next {
                return Err(Error::state(
                    format!("the published approver set is at epoch {}: the next is {next}, not {epoch}", current.epoch),
                    format!("sign the new set with batch sign-approvers --epoch {next}"),
                ));
            }
            if trust_domain != current.trust_domain {
                return Err(Error::invalid(format!(
                    "the trust domain is {:?}; an approver set does not change it",
                    current.trust_domain
                )));
            }
            let message = approver_set_message(&trust_domain, epoch, quorum, &keys);
            let mut valid: Vec<&str> = Vec::new();
            for signature in &signatures {
                let key = current.key(&signature.kid).ok_or_else(|| {
                    Error::AccessDenied(format!("{} is not a key of the approver set at epoch {}", signature.kid, current.epoch))
                })?;
                if !verify_signature(&parse_approver_key(key)?, &message, &signature.signature) {
                    return Err(Error::invalid(format!(
                        "{}'s signature does not verify over the approver set of epoch {epoch}",
                        signature.kid
                    )));
                }
                if valid.contains(&signature.kid.as_str()) {
                    return Err(Error::AlreadyExists { what: format!("a signature by {}", signature.kid) });
                }
                valid.push(&signature.kid);
            }
            if (valid.len() as u64) < current.quorum {
                return Err(Error::state(
                    format!(
                        "epoch {epoch} needs the signatures of {} keys of epoch {}, not {}",
                        current.quorum,
                        current.epoch,
                        valid.len()
                    ),
                    "collect batch sign-approvers signatures from more current approvers",
                ));
            }
        }
    }
    Ok(ApproverSetPublished { epoch, quorum, trust_domain, keys, signatures })
}

/// A batch to make, as asked.
#[derive(Clone, Debug)]
pub struct BatchCreateInput {
    pub reason: String,
    pub leaves: Vec<Leaf>,
    pub hours: u64,
    pub deadline_s: u64,
    /// One id per leaf, drawn by the caller.
    pub command_ids: Vec<String>,
}

/// Decides a batch's creation under the current approver set: the leaves (1 to
/// [`COMMAND_BATCH_LEAVES_MAX`], each a kind of [`BATCH_LEAF_KINDS`] with an object payload; the
/// caller checked each subject is a node it may command), the window (1 to
/// [`COMMAND_BATCH_HOURS_MAX`] hours) and the root.
pub fn batch_create(set: Option<&ApproverSetDoc>, input: BatchCreateInput, now_ms: u64) -> Result<CommandBatchCreated> {
    let set = set.ok_or_else(|| {
        Error::state("no approver set is published", "the root admin publishes one with approvers.publish (epoch 1)")
    })?;
    let BatchCreateInput { reason, leaves, hours, deadline_s, command_ids } = input;
    if reason.trim().is_empty() || reason.len() > COMMAND_BATCH_REASON_BYTES_MAX {
        return Err(Error::invalid(format!("reason must be 1 to {COMMAND_BATCH_REASON_BYTES_MAX} bytes: what approvers read")));
    }
    if leaves.is_empty() || leaves.len() > COMMAND_BATCH_LEAVES_MAX {
        return Err(Error::invalid(format!("a batch holds 1 to {COMMAND_BATCH_LEAVES_MAX} leaves, not {}", leaves.len())));
    }
    if !(1..=COMMAND_BATCH_HOURS_MAX).contains(&hours) {
        return Err(Error::invalid(format!("hours must be 1 to {COMMAND_BATCH_HOURS_MAX}, not {hours}")));
    }
    if command_ids.len() != leaves.len() {
        return Err(Error::Internal(format!("{} command ids for {} leaves", command_ids.len(), leaves.len())));
    }
    for (i, leaf) in leaves.iter().enumerate() {
        if !BATCH_LEAF_KINDS.contains(&leaf.kind.as_str()) {
            return Err(Error::InvalidArgument {
                message: format!("leaves[{i}]: kind {:?} is not one a batch holds", bc_core::id::truncate(&leaf.kind, 40)),
                hint: Some(format!("kinds: {}", BATCH_LEAF_KINDS.join(", "))),
            });
        }
        check_leaf_payload(i, leaf)?;
        // One metal verb a machine: two in one release would race on the machine's stream.
        if metal_leaf_verb(&leaf.kind).is_some()
            && leaves[..i].iter().any(|l| l.subject == leaf.subject && metal_leaf_verb(&l.kind).is_some())
        {
            return Err(Error::invalid(format!(
                "leaves[{i}]: machine {} has a metal leaf already; a batch acts on a machine once",
                bc_core::id::truncate(&leaf.subject, 40)
            )));
        }
    }
    for (chunk, leaves) in leaves.chunks(COMMAND_BATCH_CHUNK_LEAVES).enumerate() {
        let bytes = leaves.iter().map(|l| l.encode().map(|b| b.len())).sum::<Result<usize>>()?;
        if bytes > COMMAND_BATCH_LEAF_BYTES_MAX {
            return Err(Error::invalid(format!(
                "leaves {} to {} encode to {bytes} bytes; {COMMAND_BATCH_CHUNK_LEAVES} leaves may take at most {COMMAND_BATCH_LEAF_BYTES_MAX}",
                chunk * COMMAND_BATCH_CHUNK_LEAVES,
                chunk * COMMAND_BATCH_CHUNK_LEAVES + leaves.len() - 1
            )));
        }
    }
    Ok(CommandBatchCreated {
        reason,
        root: scope_root(&leaves)?,
        size: leaves.len() as u64,
        leaves,
        expires_at_ms: now_ms.saturating_add(hours * 3_600_000),
        trust_domain: set.trust_domain.clone(),
        epoch: set.epoch,
        quorum: set.quorum,
        command_ids,
        deadline_s,
    })
}

/// What an approval does: the event, and whether it reaches the quorum (then the caller issues
/// the batch's commands with `command_batch.released`, in the same transaction).
#[derive(Clone, Debug, PartialEq)]
pub struct BatchApproveOutcome {
    pub approved: CommandBatchApproved,
    pub releases: bool,
    /// The kids of every approval, this one last.
    pub approvals: Vec<String>,
}

/// Whether a batch is still pending and inside its window.
fn open(batch: &CommandBatchDoc, now_ms: u64) -> Result<()> {
    if batch.state != BatchState::Pending {
        return Err(Error::state(
            format!("batch {} is {}", batch.batch_id, batch.state.as_str()),
            "only a pending batch takes this",
        ));
    }
    if now_ms >= batch.expires_at_ms {
        return Err(Error::state(
            format!("batch {}'s window closed at {} ms: it expired", batch.batch_id, batch.expires_at_ms),
            "make the batch again",
        ));
    }
    Ok(())
}

/// Decides one approval of `batch` by `kid` under the current approver set.
pub fn batch_approve(
    batch: &CommandBatchDoc,
    set: &ApproverSetDoc,
    kid: &str,
    signature: &str,
    now_ms: u64,
) -> Result<BatchApproveOutcome> {
    open(batch, now_ms)?;
    if batch.epoch != set.epoch {
        return Err(Error::state(
            format!(
                "batch {} was made under the approver set of epoch {}; the set is now at epoch {}",
                batch.batch_id, batch.epoch, set.epoch
            ),
            "make the batch again under the current set",
        ));
    }
    let key = set.key(kid).ok_or_else(|| {
        Error::AccessDenied(format!("{} is not a key of the approver set at epoch {}", bc_core::id::truncate(kid, 40), set.epoch))
    })?;
    let message = approval_message(&batch.trust_domain, &batch.batch_id, &batch.root, batch.size, batch.expires_at_ms);
    if !verify_signature(&parse_approver_key(key)?, &message, signature) {
        return Err(Error::InvalidArgument {
            message: format!("{kid}'s signature does not verify over batch {}'s message", batch.batch_id),
            hint: Some("sign this batch's id, root, size, expiry and trust domain: batch approve --batch ID --key PATH".into()),
        });
    }
    if batch.approvals.iter().any(|a| a.kid == kid) {
        return Err(Error::AlreadyExists { what: format!("an approval of batch {} by {kid}", batch.batch_id) });
    }
    let mut approvals: Vec<String> = batch.approvals.iter().filter(|a| a.epoch == set.epoch).map(|a| a.kid.clone()).collect();
    approvals.push(kid.to_owned());
    Ok(BatchApproveOutcome {
        approved: CommandBatchApproved { kid: kid.to_owned(), signature: signature.to_owned(), epoch: set.epoch },
        releases: approvals.len() as u64 >= set.quorum,
        approvals,
    })
}

/// Decides a cancellation: only a pending batch is cancelled (its commands are never issued).
pub fn batch_cancel(batch: &CommandBatchDoc) -> Result<()> {
    if batch.state != BatchState::Pending {
        return Err(Error::state(
            format!("batch {} is {}", batch.batch_id, batch.state.as_str()),
            "only a pending batch is cancelled",
        ));
    }
    Ok(())
}

/// Whether a pending batch's window has closed: then it expires (`command_batch.expired`).
pub fn batch_expired(batch: &CommandBatchDoc, now_ms: u64) -> bool {
    batch.state == BatchState::Pending && now_ms >= batch.expires_at_ms
}

/// Splits a creation into its events: `command_batch.created` with the first
/// [`COMMAND_BATCH_CHUNK_LEAVES`] leaves (its root and size still the whole scope's), then one
/// `command_batch.scope_added` per further chunk, all appended in one request.
pub fn split_scope(mut created: CommandBatchCreated) -> (CommandBatchCreated, Vec<CommandBatchScopeAdded>) {
    let first = created.leaves.len().min(COMMAND_BATCH_CHUNK_LEAVES);
    let leaves = created.leaves.split_off(first);
    let command_ids = created.command_ids.split_off(first);
    let added = leaves
        .chunks(COMMAND_BATCH_CHUNK_LEAVES)
        .zip(command_ids.chunks(COMMAND_BATCH_CHUNK_LEAVES))
        .map(|(leaves, ids)| CommandBatchScopeAdded { leaves: leaves.to_vec(), command_ids: ids.to_vec() })
        .collect();
    (created, added)
}

/// One chunk of a released batch to issue: the batch's event, each command's id and issue, and
/// the metal leaves to start on their machines.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkRelease {
    pub issued: CommandBatchChunkIssued,
    pub commands: Vec<(String, CommandIssued)>,
    pub metal: Vec<MetalLeafStart>,
}

/// A metal leaf of a released chunk: its index, the leaf, and the id of the workflow it starts
/// (drawn when the batch was made, the leaf's entry in `command_ids`).
#[derive(Clone, Debug, PartialEq)]
pub struct MetalLeafStart {
    pub index: u64,
    pub leaf: Leaf,
    pub workflow_id: String,
}

/// Decides the next chunk of a released batch (`None`: not released, or every chunk issued):
/// leaves `chunk * COMMAND_BATCH_CHUNK_LEAVES` onwards, each command with its release (the
/// approvals of the batch's epoch, the approver sets `history`, its proof) and the deadline
/// `deadline_s` after `now_ms`. The caller appends `command_batch.chunk_issued` at the batch's
/// version with the commands, each on its new stream, in one group: a chunk is issued once.
pub fn release_chunk(batch: &CommandBatchDoc, history: &[ApproverSetPublished], now_ms: u64) -> Result<Option<ChunkRelease>> {
    if !batch.releasing() {
        return Ok(None);
    }
    let approvals: Vec<ApproverSignature> = batch
        .approvals
        .iter()
        .filter(|a| a.epoch == batch.epoch)
        .map(|a| ApproverSignature { kid: a.kid.clone(), signature: a.signature.clone() })
        .collect();
    let chunk = batch.chunks_issued;
    let start = chunk as usize * COMMAND_BATCH_CHUNK_LEAVES;
    let end = (start + COMMAND_BATCH_CHUNK_LEAVES).min(batch.leaves.len());
    let releases = batch_releases(batch, history, &approvals, start..end)?;
    let deadline_at_ms = now_ms.saturating_add(batch.deadline_s.saturating_mul(1000));
    let mut commands: Vec<(String, CommandIssued)> = Vec::new();
    let mut metal = Vec::new();
    for (release, i) in releases.into_iter().zip(start..end) {
        let leaf = &batch.leaves[i];
        if metal_leaf_verb(&leaf.kind).is_some() {
            metal.push(MetalLeafStart { index: i as u64, leaf: leaf.clone(), workflow_id: batch.command_ids[i].clone() });
            continue;
        }
        let issued = CommandIssued {
            node_id: leaf.subject.clone(),
            kind: leaf.kind.clone(),
            args: leaf.payload.clone(),
            deadline_at_ms,
            release: Some(release),
        };
        commands.push((batch.command_ids[i].clone(), issued));
    }
    let issued = CommandBatchChunkIssued { chunk, commands: (commands.len() + metal.len()) as u64, refused: vec![] };
    Ok(Some(ChunkRelease { issued, commands, metal }))
}

/// What a released metal leaf needs read besides the batch: its machine, the machine's node
/// (an undeploy cordons it), and a deploy's image.
#[derive(Clone, Debug, Default)]
pub struct MetalLeafWorld<'a> {
    pub machine: Option<&'a MetalDoc>,
    pub node: Option<&'a NodeDoc>,
    pub image: Option<&'a ImageDoc>,
}

/// Decides the start of one released metal leaf on its machine: the verb as the caller's
/// `metal.*` method decides it ([`crate::decide::metal_verb`]), with the leaf's exact arguments and
/// the workflow id the batch drew for it, appended at the machine's version. An undeploy is
/// refused while the machine's node holds reservations and cordons the node
/// ([`undeploy_cordons`]), as `metal.undeploy` does. Refused (the machine moved on since the
/// batch was made), the leaf starts nothing and the caller records why.
pub fn metal_leaf_start(start: &MetalLeafStart, world: &MetalLeafWorld<'_>, now_ms: u64) -> Result<Append> {
    let leaf = &start.leaf;
    let (verb, power) = metal_leaf_verb(&leaf.kind)
        .ok_or_else(|| Error::Internal(format!("leaf {} ({}) is not a metal verb", start.index, leaf.kind)))?;
    let machine = world
        .machine
        .filter(|m| m.node_id == leaf.subject)
        .ok_or_else(|| Error::not_found(format!("machine {}", bc_core::id::truncate(&leaf.subject, 40))))?;
    let deploy = if verb == Verb::Deploy {
        let (image_id, token_id) = deploy_leaf_ids(&leaf.payload)
            .ok_or_else(|| Error::invalid(format!("leaf {}: a deploy names its image and join token", start.index)))?;
        let image =
            world.image.filter(|i| i.image_id == image_id).ok_or_else(|| Error::not_found(format!("image {image_id}")))?;
        if image.disk_format != crate::events::DiskFormat::Iso {
            return Err(Error::invalid(format!("image {image_id} is not an ISO: a BMC's virtual CD boots it")));
        }
        Some((image, token_id))
    } else {
        None
    };
    let input = VerbInput {
        now_ms,
        workflow_id: &start.workflow_id,
        image: deploy.as_ref().map(|(image, _)| (image.image_id.as_str(), image.url.as_str())),
        join_token_id: deploy.as_ref().map(|(_, token)| token.as_str()),
        power,
        if_version: None,
    };
    let mut append = crate::decide::metal_verb(machine, verb, &input)?;
    if verb == Verb::Undeploy
        && let Some(node) = world.node
    {
        undeploy_cordons(&mut append, node)?;
    }
    Ok(append)
}

/// An undeploy's hold on the machine's node: refused while the node holds reservations (drain
/// it first); else the node is cordoned in the undeploy's append (unless it is already) and
/// guarded at the version read, so nothing is placed on a machine being torn down.
pub fn undeploy_cordons(append: &mut Append, node: &NodeDoc) -> Result<()> {
    if !node.allocations.is_empty() {
        return Err(Error::InvalidState {
            message: format!(
                "node {} holds {} GPUs of live reservations: drain it (nodes drain) and let them end before undeploying",
                node.node_id,
                node.allocations.len()
            ),
            allowed: vec![],
            hint: None,
        });
    }
    let stream = crate::stream_of(crate::KIND_NODE, &node.node_id);
    if !node.cordoned {
        let mut cordon =
            NewEvent::new(crate::events::NODE_CORDONED, crate::events::to_cbor(&crate::events::NodeStateChanged {})?);
        cordon.stream = Some(stream.clone());
        append.events.push(cordon);
    }
    append.guards.push((stream, ExpectedVersion::Exact(node.version)));
    Ok(())
}

/// The appends of one chunk, for one `Log::append_group`: `command_batch.chunk_issued` at the
/// batch's version (so a chunk is issued once, whoever issues it), then each command on its new
/// stream.
///
/// `metal` are the appends of the chunk's metal leaves that start ([`metal_leaf_start`]); the
/// ones refused are in `chunk.issued.refused`.
pub fn chunk_appends(
    tenant: bc_core::id::TenantId,
    batch: &CommandBatchDoc,
    chunk: ChunkRelease,
    metal: Vec<Append>,
    actor: &str,
    correlation: Option<&str>,
) -> Result<Vec<bc_core::store::AppendRequest>> {
    use bc_core::store::AppendRequest;
    let request = |stream: String, expected, event: NewEvent| {
        let mut request = AppendRequest::new(tenant, stream, expected, actor, vec![event]);
        request.correlation = correlation.map(str::to_owned);
        request
    };
    let mut requests = vec![request(
        crate::stream_of(crate::batch::KIND_COMMAND_BATCH, &batch.batch_id),
        ExpectedVersion::Exact(batch.version),
        NewEvent::new(crate::batch::COMMAND_BATCH_CHUNK_ISSUED, crate::events::to_cbor(&chunk.issued)?),
    )];
    for (command_id, issued) in chunk.commands {
        requests.push(request(
            crate::stream_of(crate::command::KIND_COMMAND, &command_id),
            ExpectedVersion::NoStream,
            NewEvent::new(crate::command::COMMAND_ISSUED, crate::events::to_cbor(&issued)?),
        ));
    }
    for append in metal {
        let mut request = append.into_request(tenant, actor);
        request.correlation = correlation.map(str::to_owned);
        requests.push(request);
    }
    Ok(requests)
}

/// The release each command of `batch` in `range` carries to its node (`bc_core::approval::BatchRelease`):
/// the batch's root, size and window, the leaf's index and inclusion proof, the `approvals` that
/// released it, and the approver sets `history` published from epoch 1 to the batch's epoch
/// (each later one with the signatures that allowed it), so a node that pins the epoch-1 set's
/// root checks the release itself. The proofs are made in one pass over the leaves.
pub fn batch_releases(
    batch: &CommandBatchDoc,
    history: &[ApproverSetPublished],
    approvals: &[ApproverSignature],
    range: std::ops::Range<usize>,
) -> Result<Vec<BatchRelease>> {
    let sets: Vec<ReleaseSet> = history
        .iter()
        .filter(|set| set.epoch <= batch.epoch)
        .map(|set| ReleaseSet {
            epoch: set.epoch,
            quorum: set.quorum,
            keys: key_refs(&set.keys),
            signatures: set
                .signatures
                .iter()
                .map(|s| SignatureRef { kid: s.kid.clone(), signature: s.signature.clone() })
                .collect(),
        })
        .collect();
    let consecutive = sets.iter().enumerate().all(|(i, set)| set.epoch == i as u64 + 1);
    if sets.last().map(|s| s.epoch) != Some(batch.epoch) || !consecutive {
        return Err(Error::Internal(format!(
            "the approver sets' history does not run from epoch 1 to batch {}'s epoch {}",
            batch.batch_id, batch.epoch
        )));
    }
    let hashes = batch.leaves.iter().map(Leaf::hash).collect::<Result<Vec<_>>>()?;
    let approvals: Vec<SignatureRef> =
        approvals.iter().map(|a| SignatureRef { kid: a.kid.clone(), signature: a.signature.clone() }).collect();
    Ok(bc_core::approval::inclusion_proofs(&hashes)
        .into_iter()
        .enumerate()
        .skip(range.start)
        .take(range.len())
        .map(|(index, proof)| BatchRelease {
            batch_id: batch.batch_id.clone(),
            trust_domain: batch.trust_domain.clone(),
            root: batch.root.clone(),
            size: batch.size,
            expires_at_ms: batch.expires_at_ms,
            index: index as u64,
            proof: proof.iter().map(hex::encode).collect(),
            approvals: approvals.clone(),
            sets: sets.clone(),
        })
        .collect())
}

/// A call that may act beyond one machine or on another tenant, as the gateway reads it before
/// deciding it: what [`batch_required`] judges under the approvers' quorum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestructiveScope {
    /// A metal verb (`undeploy`, `deploy`, `retire`, `power off`) on this many machines.
    Metal { verb: &'static str, machines: usize },
    /// A rollout whose pool and labels choose this many nodes.
    Rollout { nodes: usize },
    /// `nodes.delete` of one node.
    NodeDelete,
    /// `reservations.release`: whether the caller is the root tenant's and the reservation
    /// another tenant's.
    ReservationRelease { root_caller: bool, other_tenant: bool },
}

/// The metal verbs that need a batch beyond one machine (`power` only when it is `off`).
pub const BATCH_METAL_VERBS: &[&str] = &["undeploy", "deploy", "retire", "power off"];

/// Decides whether a call must go through a batch: with the quorum off (`quorum`: `dev`/`serve
/// --approvers`), never; with it on, a metal verb of [`BATCH_METAL_VERBS`] on more than one
/// machine, a rollout to more than one node, any `nodes.delete`, and a reservation release by the
/// root tenant of another tenant's reservation are refused `BATCH_REQUIRED`, with a hint to make
/// a batch. Everything else passes.
pub fn batch_required(quorum: bool, scope: DestructiveScope) -> Result<()> {
    if !quorum {
        return Ok(());
    }
    let mut hint = "make a batch of the operation (better-compute batch create --reason TEXT --scope FILE) and have the approvers sign it (batch approve)".to_owned();
    let what = match scope {
        DestructiveScope::Metal { verb, machines } if machines > 1 && BATCH_METAL_VERBS.contains(&verb) => {
            hint = format!(
                "make a batch of it (better-compute metal bulk --verb {} --nodes … --reason TEXT) and have the approvers sign it (batch approve)",
                verb.replace(' ', "-")
            );
            format!("metal {verb} on {machines} machines")
        }
        DestructiveScope::Rollout { nodes } if nodes > 1 => format!("a rollout to {nodes} nodes"),
        DestructiveScope::NodeDelete => "nodes.delete".to_owned(),
        DestructiveScope::ReservationRelease { root_caller: true, other_tenant: true } => {
            "the root tenant's release of another tenant's reservation".to_owned()
        }
        _ => return Ok(()),
    };
    Err(Error::BatchRequired {
        message: format!(
            "{what} needs a destructive batch: this deployment runs with the approvers' quorum on (--approvers), so one key does not act on that scope alone"
        ),
        hint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{BatchApproval, approver_key_of};
    use bc_core::ErrorCode;
    use p256::ecdsa::signature::Signer as _;
    use p256::ecdsa::{DerSignature, SigningKey};

    fn key(seed: u8) -> SigningKey {
        let mut bytes = [0u8; 32];
        bytes[31] = seed;
        bytes[0] = 1;
        SigningKey::from_slice(&bytes).expect("a scalar")
    }

    fn sign(key: &SigningKey, message: &str) -> String {
        use base64::Engine as _;
        let signature: DerSignature = key.sign(message.as_bytes());
        base64::engine::general_purpose::STANDARD.encode(signature.as_bytes())
    }

    fn public(key: &SigningKey) -> ApproverKey {
        approver_key_of(key.verifying_key()).unwrap()
    }

    fn set(keys: &[&SigningKey], quorum: u64) -> ApproverSetDoc {
        ApproverSetDoc {
            epoch: 1,
            quorum,
            trust_domain: "compute.test".into(),
            keys: keys.iter().map(|k| public(k)).collect(),
            signed_by: vec![],
            published_by: "apikey:root".into(),
            published_at_ms: 0,
            version: 1,
            command_root_sha256: String::new(),
        }
    }

    fn ping(node: &str) -> Leaf {
        Leaf { subject: node.into(), kind: "ping".into(), payload: serde_json::json!({}) }
    }

    fn batch(set: &ApproverSetDoc, leaves: Vec<Leaf>) -> CommandBatchDoc {
        let ids = (0..leaves.len()).map(|i| format!("cmd_{i}")).collect();
        let c = batch_create(
            Some(set),
            BatchCreateInput { reason: "r".into(), leaves, hours: 1, deadline_s: 300, command_ids: ids },
            1_000,
        )
        .unwrap();
        CommandBatchDoc {
            tenant_id: "t".into(),
            batch_id: "batch_a".into(),
            reason: c.reason,
            state: BatchState::Pending,
            leaves: c.leaves,
            root: c.root,
            size: c.size,
            expires_at_ms: c.expires_at_ms,
            trust_domain: c.trust_domain,
            epoch: c.epoch,
            quorum: c.quorum,
            command_ids: c.command_ids,
            deadline_s: c.deadline_s,
            approvals: vec![],
            created_by: "x".into(),
            created_at_ms: 1_000,
            ended_at_ms: None,
            end_reason: None,
            version: 1,
            chunks_issued: 0,
            refused: vec![],
        }
    }

    fn message(b: &CommandBatchDoc) -> String {
        approval_message(&b.trust_domain, &b.batch_id, &b.root, b.size, b.expires_at_ms)
    }

    fn approve(b: &mut CommandBatchDoc, s: &ApproverSetDoc, k: &SigningKey) -> Result<BatchApproveOutcome> {
        let kid = public(k).kid;
        let out = batch_approve(b, s, &kid, &sign(k, &message(b)), 2_000)?;
        b.approvals.push(BatchApproval {
            kid,
            signature: out.approved.signature.clone(),
            epoch: 1,
            by: "x".into(),
            at_ms: 2_000,
        });
        Ok(out)
    }

    /// The root is RFC 6962's over the canonical encodings; a change of one leaf changes it.
    #[test]
    fn the_root_binds_every_leaf() {
        let leaves = vec![ping("node_a"), ping("node_b"), ping("node_c")];
        let root = scope_root(&leaves).unwrap();
        let hashes: Vec<_> = leaves.iter().map(|l| bc_core::merkle::leaf_hash(&l.encode().unwrap())).collect();
        assert_eq!(root, hex::encode(bc_core::merkle::root(&hashes)));
        let mut changed = leaves.clone();
        changed[1].payload = serde_json::json!({"x": 1});
        assert_ne!(scope_root(&changed).unwrap(), root);
        changed[1] = ping("node_d");
        assert_ne!(scope_root(&changed).unwrap(), root);
        assert_ne!(scope_root(&leaves[..2]).unwrap(), root);
    }

    /// Two of three: the first approval holds, the second releases.
    #[test]
    fn the_quorum_releases_and_not_before() {
        let (a, b, c) = (key(1), key(2), key(3));
        let s = set(&[&a, &b, &c], 2);
        let mut batch = batch(&s, vec![ping("node_a"), ping("node_b")]);
        assert!(!approve(&mut batch, &s, &a).unwrap().releases);
        let second = approve(&mut batch, &s, &c).unwrap();
        assert!(second.releases);
        assert_eq!(second.approvals, vec![public(&a).kid, public(&c).kid]);
    }

    /// Another batch's signature, an expired batch, a key not in the set, a reused signature,
    /// an older epoch: each refused with its own code.
    #[test]
    fn each_refusal_has_its_code() {
        let (a, b, outsider) = (key(1), key(2), key(9));
        let s = set(&[&a, &b], 2);
        let mut this = batch(&s, vec![ping("node_a")]);
        let other = batch(&s, vec![ping("node_b")]);
        let kid = public(&a).kid;
        let code = |r: Result<BatchApproveOutcome>| r.unwrap_err().code();
        assert_eq!(code(batch_approve(&this, &s, &kid, &sign(&a, &message(&other)), 2_000)), ErrorCode::InvalidArgument);
        assert_eq!(code(batch_approve(&this, &s, &kid, &sign(&a, &message(&this)), this.expires_at_ms)), ErrorCode::InvalidState);
        let outsider_kid = public(&outsider).kid;
        assert_eq!(
            code(batch_approve(&this, &s, &outsider_kid, &sign(&outsider, &message(&this)), 2_000)),
            ErrorCode::AccessDenied
        );
        let signature = sign(&a, &message(&this));
        approve(&mut this, &s, &a).unwrap();
        assert_eq!(code(batch_approve(&this, &s, &kid, &signature, 2_000)), ErrorCode::AlreadyExists);
        let mut later = s.clone();
        later.epoch = 2;
        assert_eq!(
            code(batch_approve(&this, &later, &public(&b).kid, &sign(&b, &message(&this)), 2_000)),
            ErrorCode::InvalidState
        );
    }

    /// Epoch 2 needs the quorum of epoch 1's keys over the new set; the trust domain stays.
    #[test]
    fn a_new_set_needs_the_current_quorum() {
        let (a, b, c, d) = (key(1), key(2), key(3), key(4));
        let first = approver_set_publish(
            None,
            ApproverSetInput {
                epoch: 1,
                quorum: 2,
                trust_domain: "compute.test".into(),
                keys: vec![public(&a), public(&b), public(&c)],
                signatures: vec![],
            },
        )
        .unwrap();
        let current = ApproverSetDoc {
            signed_by: vec![],
            published_by: "r".into(),
            published_at_ms: 0,
            version: 1,
            ..set(&[&a, &b, &c], first.quorum)
        };
        let keys = vec![public(&b), public(&c), public(&d)];
        let message = approver_set_message("compute.test", 2, 2, &keys);
        let signed = |by: &[&SigningKey]| {
            by.iter().map(|k| ApproverSignature { kid: public(k).kid, signature: sign(k, &message) }).collect::<Vec<_>>()
        };
        let input = |signatures| ApproverSetInput {
            epoch: 2,
            quorum: 2,
            trust_domain: "compute.test".into(),
            keys: keys.clone(),
            signatures,
        };
        assert_eq!(approver_set_publish(Some(&current), input(signed(&[&a]))).unwrap_err().code(), ErrorCode::InvalidState);
        assert_eq!(approver_set_publish(Some(&current), input(signed(&[&a, &d]))).unwrap_err().code(), ErrorCode::AccessDenied);
        assert_eq!(approver_set_publish(Some(&current), input(signed(&[&a, &a]))).unwrap_err().code(), ErrorCode::AlreadyExists);
        let published = approver_set_publish(Some(&current), input(signed(&[&a, &c]))).unwrap();
        assert_eq!(published.epoch, 2);
        let mut wrong_epoch = input(signed(&[&a, &c]));
        wrong_epoch.epoch = 3;
        assert_eq!(approver_set_publish(Some(&current), wrong_epoch).unwrap_err().code(), ErrorCode::InvalidState);
        let mut other_domain = input(signed(&[&a, &c]));
        other_domain.trust_domain = "elsewhere".into();
        assert_eq!(approver_set_publish(Some(&current), other_domain).unwrap_err().code(), ErrorCode::InvalidArgument);
    }

    /// Leaves, hours and kinds are bounded; a set must exist.
    #[test]
    fn a_batch_is_bounded() {
        let a = key(1);
        let s = set(&[&a], 1);
        let make = |leaves: Vec<Leaf>, hours| {
            let ids = (0..leaves.len()).map(|i| format!("cmd_{i}")).collect();
            batch_create(Some(&s), BatchCreateInput { reason: "r".into(), leaves, hours, deadline_s: 300, command_ids: ids }, 0)
        };
        assert!(make(vec![], 1).is_err());
        assert!(make(vec![ping("n"); COMMAND_BATCH_LEAVES_MAX + 1], 1).is_err());
        assert!(make(vec![ping("n")], 0).is_err());
        assert!(make(vec![ping("n")], COMMAND_BATCH_HOURS_MAX + 1).is_err());
        assert!(make(vec![Leaf { kind: "nodes.delete".into(), ..ping("n") }], 1).is_err());
        assert!(make(vec![Leaf { payload: serde_json::Value::Null, ..ping("n") }], 1).is_err());
        assert_eq!(
            make(vec![ping("n"); COMMAND_BATCH_LEAVES_MAX], COMMAND_BATCH_HOURS_MAX).unwrap().size,
            COMMAND_BATCH_LEAVES_MAX as u64
        );
        assert!(
            batch_create(
                None,
                BatchCreateInput {
                    reason: "r".into(),
                    leaves: vec![ping("n")],
                    hours: 1,
                    deadline_s: 1,
                    command_ids: vec!["c".into()]
                },
                0
            )
            .is_err()
        );
    }
    /// With the quorum off nothing needs a batch; with it on, exactly the wide or cross-tenant
    /// scopes, each `BATCH_REQUIRED` with a hint naming `batch create`.
    #[test]
    fn the_quorum_sends_wide_scopes_to_a_batch() {
        use DestructiveScope::*;
        let wide = [
            Metal { verb: "undeploy", machines: 2 },
            Metal { verb: "deploy", machines: 3 },
            Metal { verb: "retire", machines: 10 },
            Metal { verb: "power off", machines: 2 },
            Rollout { nodes: 2 },
            NodeDelete,
            ReservationRelease { root_caller: true, other_tenant: true },
        ];
        let narrow = [
            Metal { verb: "undeploy", machines: 1 },
            Metal { verb: "power on", machines: 5 },
            Metal { verb: "reboot", machines: 5 },
            Metal { verb: "inspect", machines: 5 },
            Rollout { nodes: 1 },
            Rollout { nodes: 0 },
            ReservationRelease { root_caller: true, other_tenant: false },
            ReservationRelease { root_caller: false, other_tenant: false },
        ];
        for scope in wide.iter().chain(&narrow) {
            assert!(batch_required(false, *scope).is_ok(), "{scope:?} without the quorum");
        }
        for scope in narrow {
            assert!(batch_required(true, scope).is_ok(), "{scope:?}");
        }
        for scope in wide {
            let e = batch_required(true, scope).unwrap_err();
            assert_eq!(e.code(), ErrorCode::BatchRequired, "{scope:?}");
            assert_eq!(e.code().as_str(), "BATCH_REQUIRED");
            let hint = e.hint().unwrap();
            match scope {
                Metal { verb, .. } => {
                    assert!(hint.contains(&format!("metal bulk --verb {}", verb.replace(' ', "-"))), "{e:?}")
                }
                _ => assert!(hint.contains("batch create"), "{e:?}"),
            }
        }
    }
    /// A node's own check of a release: the pinned epoch-1 set, a chain to epoch 2 signed by
    /// epoch 1's quorum, K approvals, this command as its leaf. One approval short, another
    /// node, other arguments, another pin, a chain link signed by one key: each refused, saying
    /// why.
    #[test]
    fn a_node_checks_a_release_itself() {
        use bc_core::approval::verify_release;
        let (a, b, c) = (key(1), key(2), key(3));
        let first = ApproverSetPublished {
            epoch: 1,
            quorum: 2,
            trust_domain: "compute.test".into(),
            keys: vec![public(&a), public(&b), public(&c)],
            signatures: vec![],
        };
        let pin = bc_core::approval::command_root_of("compute.test", 2, &key_refs(&first.keys));
        let s = set(&[&a, &b, &c], 2);
        let leaves = vec![ping("node_a"), ping("node_b"), ping("node_c")];
        let doc = batch(&s, leaves.clone());
        let approval = |k: &SigningKey| ApproverSignature { kid: public(k).kid, signature: sign(k, &message(&doc)) };
        let releases = batch_releases(&doc, std::slice::from_ref(&first), &[approval(&a), approval(&c)], 0..usize::MAX).unwrap();
        let roots = vec![pin.clone()];
        let empty = serde_json::json!({});
        for (leaf, release) in leaves.iter().zip(&releases) {
            verify_release(&roots, &leaf.subject, "ping", &empty, release).unwrap();
        }
        let why = |r: std::result::Result<(), String>| r.unwrap_err();
        assert!(why(verify_release(&roots, "node_b", "ping", &empty, &releases[0])).contains("not leaf 0"));
        assert!(why(verify_release(&roots, "node_a", "ping", &serde_json::json!({"x": 1}), &releases[0])).contains("not leaf 0"));
        assert!(why(verify_release(&["0".repeat(64)], "node_a", "ping", &empty, &releases[0])).contains("not the pinned"));
        let short = batch_releases(&doc, std::slice::from_ref(&first), &[approval(&a)], 0..usize::MAX).unwrap();
        assert!(why(verify_release(&roots, "node_a", "ping", &empty, &short[0])).contains("1 valid approval(s)"));
        let twice = batch_releases(&doc, std::slice::from_ref(&first), &[approval(&a), approval(&a)], 0..usize::MAX).unwrap();
        assert!(why(verify_release(&roots, "node_a", "ping", &empty, &twice[0])).contains("1 valid approval(s)"));

        // Epoch 2 (b, c, quorum 2), signed by a and c of epoch 1; a batch under it.
        let keys2 = vec![public(&b), public(&c)];
        let message2 = approver_set_message("compute.test", 2, 2, &keys2);
        let link = |by: &[&SigningKey]| ApproverSetPublished {
            epoch: 2,
            quorum: 2,
            trust_domain: "compute.test".into(),
            keys: keys2.clone(),
            signatures: by.iter().map(|k| ApproverSignature { kid: public(k).kid, signature: sign(k, &message2) }).collect(),
        };
        let mut s2 = set(&[&b, &c], 2);
        s2.epoch = 2;
        let doc2 = batch(&s2, vec![ping("node_a")]);
        let approval2 = |k: &SigningKey| ApproverSignature { kid: public(k).kid, signature: sign(k, &message(&doc2)) };
        let good =
            batch_releases(&doc2, &[first.clone(), link(&[&a, &c])], &[approval2(&b), approval2(&c)], 0..usize::MAX).unwrap();
        verify_release(&roots, "node_a", "ping", &empty, &good[0]).unwrap();
        let weak = batch_releases(&doc2, &[first.clone(), link(&[&a])], &[approval2(&b), approval2(&c)], 0..usize::MAX).unwrap();
        assert!(why(verify_release(&roots, "node_a", "ping", &empty, &weak[0])).contains("1 valid signatures of epoch 1"));
        // Approvals by epoch 1's keys do not count under epoch 2.
        let old =
            batch_releases(&doc2, &[first.clone(), link(&[&a, &c])], &[approval2(&a), approval2(&b)], 0..usize::MAX).unwrap();
        assert!(why(verify_release(&roots, "node_a", "ping", &empty, &old[0])).contains("1 valid approval(s)"));
        assert!(
            batch_releases(&doc2, std::slice::from_ref(&first), &[], 0..1).is_err(),
            "the history must reach the batch's epoch"
        );
    }
    /// A scope of 450 leaves: created in chunks of 200 (the root and size the whole scope's),
    /// released in three chunks of 200, 200 and 50 in turn, each command with a release that
    /// verifies for its own node; nothing after the last, nothing before the release.
    #[test]
    fn a_large_batch_goes_in_chunks() {
        let (a, b) = (key(1), key(2));
        let s = set(&[&a, &b], 2);
        let leaves: Vec<Leaf> = (0..450).map(|i| ping(&format!("node_{}", i % 7))).collect();
        let ids: Vec<String> = (0..450).map(|i| format!("cmd_{i}")).collect();
        let created = batch_create(
            Some(&s),
            BatchCreateInput { reason: "r".into(), leaves: leaves.clone(), hours: 1, deadline_s: 300, command_ids: ids },
            1_000,
        )
        .unwrap();
        let root = created.root.clone();
        let (first, added) = split_scope(created);
        assert_eq!(
            (first.leaves.len(), first.command_ids.len(), first.size, first.root.as_str()),
            (200, 200, 450, root.as_str())
        );
        assert_eq!(added.iter().map(|a| a.leaves.len()).collect::<Vec<_>>(), [200, 50]);
        assert_eq!(added[1].command_ids[49], "cmd_449");

        let mut doc = batch(&s, leaves.clone());
        let history = [ApproverSetPublished {
            epoch: 1,
            quorum: 2,
            trust_domain: "compute.test".into(),
            keys: s.keys.clone(),
            signatures: vec![],
        }];
        assert_eq!(release_chunk(&doc, &history, 5_000).unwrap(), None, "a pending batch issues nothing");
        for k in [&a, &b] {
            approve(&mut doc, &s, k).unwrap();
        }
        doc.state = BatchState::Released;
        let roots = vec![bc_core::approval::command_root_of("compute.test", 2, &key_refs(&s.keys))];
        let mut sizes = Vec::new();
        while let Some(chunk) = release_chunk(&doc, &history, 5_000).unwrap() {
            assert_eq!(chunk.issued.chunk, doc.chunks_issued);
            for (id, issued) in &chunk.commands {
                let index: usize = id.trim_start_matches("cmd_").parse().unwrap();
                assert_eq!(issued.node_id, leaves[index].subject);
                assert_eq!(issued.deadline_at_ms, 305_000);
                let release = issued.release.as_ref().unwrap();
                assert_eq!(release.index, index as u64);
                bc_core::approval::verify_release(&roots, &issued.node_id, "ping", &issued.args, release).unwrap();
            }
            sizes.push(chunk.commands.len());
            doc.chunks_issued += 1;
        }
        assert_eq!(sizes, [200, 200, 50]);
        assert_eq!(doc.chunks(), 3);
    }

    fn metal_leaf(kind: &str, node: &str, payload: serde_json::Value) -> Leaf {
        Leaf { subject: node.into(), kind: kind.into(), payload }
    }

    const IMAGE: &str = "img_01jd0000000000000000000000";
    const TOKEN: &str = "jt_01jd0000000000000000000000";

    /// A metal leaf's bytes are its canonical CBOR, whatever order its payload's keys came in;
    /// another image, token, machine or kind is another leaf; each kind takes exactly its payload,
    /// and a batch acts on a machine once.
    #[test]
    fn a_metal_leaf_binds_its_exact_operation() {
        let deploy = |payload: &str| metal_leaf(LEAF_METAL_DEPLOY, "node_a", serde_json::from_str(payload).unwrap());
        let one = deploy(&format!(r#"{{"imageId": "{IMAGE}", "joinTokenId": "{TOKEN}"}}"#));
        let reordered = deploy(&format!(r#"{{"joinTokenId": "{TOKEN}", "imageId": "{IMAGE}"}}"#));
        assert_eq!(one.encode().unwrap(), reordered.encode().unwrap());
        // RFC 8949 §4.2.1: the map's keys sorted by their encoding (shorter first), the payload's too.
        let bytes = one.encode().unwrap();
        let value: ciborium::Value = ciborium::from_reader(bytes.as_slice()).unwrap();
        let keys: Vec<String> = value.as_map().unwrap().iter().map(|(k, _)| k.as_text().unwrap().to_owned()).collect();
        assert_eq!(keys, ["kind", "payload", "subject"]);
        let mut again = Vec::new();
        ciborium::into_writer(&value, &mut again).unwrap();
        assert_eq!(again, bytes, "re-encoding gives the same bytes");
        let root = scope_root(std::slice::from_ref(&one)).unwrap();
        for other in [
            deploy(&format!(r#"{{"imageId": "img_01jd0000000000000000000001", "joinTokenId": "{TOKEN}"}}"#)),
            deploy(&format!(r#"{{"imageId": "{IMAGE}", "joinTokenId": "jt_01jd0000000000000000000001"}}"#)),
            Leaf { subject: "node_b".into(), ..one.clone() },
            Leaf { kind: LEAF_METAL_UNDEPLOY.into(), ..one.clone() },
        ] {
            assert_ne!(scope_root(&[other]).unwrap(), root);
        }
        assert_eq!(metal_leaf_verb(LEAF_METAL_POWER_OFF), Some((Verb::Power, Some("off"))));
        assert_eq!(metal_leaf_verb("ping"), None);

        let s = set(&[&key(1)], 1);
        let make = |leaves: Vec<Leaf>| {
            let ids = (0..leaves.len()).map(|i| format!("wf_{i}")).collect();
            batch_create(
                Some(&s),
                BatchCreateInput { reason: "r".into(), leaves, hours: 1, deadline_s: 300, command_ids: ids },
                0,
            )
        };
        let empty = serde_json::json!({});
        for kind in [LEAF_METAL_UNDEPLOY, LEAF_METAL_RETIRE, LEAF_METAL_POWER_OFF] {
            assert!(make(vec![metal_leaf(kind, "node_a", empty.clone())]).is_ok(), "{kind}");
            assert!(make(vec![metal_leaf(kind, "node_a", serde_json::json!({"imageId": IMAGE}))]).is_err(), "{kind}");
            assert!(make(vec![metal_leaf(kind, "node_a", serde_json::Value::Null)]).is_err(), "{kind} unbound");
        }
        assert!(make(vec![one.clone()]).is_ok());
        for payload in [
            serde_json::json!({}),
            serde_json::json!({"imageId": IMAGE}),
            serde_json::json!({"imageId": IMAGE, "joinTokenId": TOKEN, "x": 1}),
            serde_json::json!({"imageId": "node_x", "joinTokenId": TOKEN}),
        ] {
            assert!(make(vec![metal_leaf(LEAF_METAL_DEPLOY, "node_a", payload.clone())]).is_err(), "{payload}");
        }
        let twice = make(vec![
            metal_leaf(LEAF_METAL_POWER_OFF, "node_a", empty.clone()),
            metal_leaf(LEAF_METAL_UNDEPLOY, "node_a", empty.clone()),
        ]);
        assert!(twice.unwrap_err().to_string().contains("acts on a machine once"));
        assert!(make(vec![ping("node_a"), metal_leaf(LEAF_METAL_UNDEPLOY, "node_a", empty)]).is_ok(), "a ping and a verb");
    }

    fn machine(node: &str, state: &str) -> MetalDoc {
        serde_json::from_value(serde_json::json!({
            "tenantId": "ten_00000000000000000000000000", "nodeId": node, "poolId": "pool_01jd0000000000000000000000",
            "name": "m", "state": state, "flags": { "retired": false },
            "bmc": { "address": "https://bmc", "username": "u", "tls": "insecure", "secretId": "bmc_x" },
            "stateEnteredAtMs": 1, "version": 9, "createdAtMs": 1, "updatedAtMs": 1,
        }))
        .expect("a machine document")
    }

    fn node_doc(node: &str, cordoned: bool, allocations: serde_json::Value) -> NodeDoc {
        serde_json::from_value(serde_json::json!({
            "tenantId": "ten_00000000000000000000000000", "nodeId": node,
            "poolId": "pool_01jd0000000000000000000000", "name": "n0", "gpus": [], "labels": {},
            "state": if cordoned { "cordoned" } else { "ready" }, "cordoned": cordoned,
            "allocations": allocations, "version": 4, "createdAtMs": 1, "updatedAtMs": 2,
        }))
        .expect("a node document")
    }

    /// A pending batch releases nothing; released, its metal leaves come out as starts (no
    /// command for any node), each the verb `metal.*` decides on its machine at the machine's
    /// version with the batch's workflow id: an undeploy cordons the node and guards it, and is
    /// refused while the node holds reservations; a machine that moved on refuses its verb.
    #[test]
    fn a_released_metal_leaf_starts_its_machines_workflow_and_nothing_before() {
        let (a, b) = (key(1), key(2));
        let s = set(&[&a, &b], 2);
        let empty = serde_json::json!({});
        let leaves = vec![
            metal_leaf(LEAF_METAL_UNDEPLOY, "node_a", empty.clone()),
            metal_leaf(LEAF_METAL_POWER_OFF, "node_b", empty.clone()),
            ping("node_c"),
        ];
        let mut doc = batch(&s, leaves);
        let history = [ApproverSetPublished {
            epoch: 1,
            quorum: 2,
            trust_domain: "compute.test".into(),
            keys: s.keys.clone(),
            signatures: vec![],
        }];
        assert_eq!(release_chunk(&doc, &history, 5_000).unwrap(), None, "a pending batch starts nothing");
        approve(&mut doc, &s, &a).unwrap();
        assert_eq!(release_chunk(&doc, &history, 5_000).unwrap(), None, "one approval of two starts nothing");
        approve(&mut doc, &s, &b).unwrap();
        doc.state = BatchState::Released;
        let chunk = release_chunk(&doc, &history, 5_000).unwrap().unwrap();
        assert_eq!(chunk.commands.len(), 1, "only the ping goes to a node");
        assert_eq!(
            chunk.metal.iter().map(|m| (m.index, m.workflow_id.as_str())).collect::<Vec<_>>(),
            [(0, "cmd_0"), (1, "cmd_1")]
        );
        assert_eq!(chunk.issued.commands, 3);

        let active = machine("node_a", "active");
        let free = node_doc("node_a", false, serde_json::json!({}));
        let world = MetalLeafWorld { machine: Some(&active), node: Some(&free), image: None };
        let append = metal_leaf_start(&chunk.metal[0], &world, 5_000).unwrap();
        assert_eq!(append.stream, "metal/node_a");
        assert_eq!(append.expected, ExpectedVersion::Exact(9));
        assert_eq!(append.event_types(), ["metal.transitioned", "node.cordoned"]);
        assert_eq!(append.guards, [("node/node_a".to_owned(), ExpectedVersion::Exact(4))]);
        let started: crate::events::MetalTransitioned = ciborium::Value::deserialized(&append.events[0].payload).unwrap();
        assert_eq!((started.verb.as_str(), started.to.as_str()), ("undeploy", "deleting"));
        assert_eq!(started.workflow.unwrap().workflow_id, "cmd_0");

        let held = node_doc("node_a", true, serde_json::json!({ "0": "rsv_a" }));
        let refused = metal_leaf_start(&chunk.metal[0], &MetalLeafWorld { node: Some(&held), ..world.clone() }, 5_000);
        assert!(refused.unwrap_err().to_string().contains("drain it"));
        let moved = machine("node_a", "available");
        let refused = metal_leaf_start(&chunk.metal[0], &MetalLeafWorld { machine: Some(&moved), ..world.clone() }, 5_000);
        assert_eq!(refused.unwrap_err().code(), ErrorCode::InvalidState);
        let other = machine("node_z", "active");
        let refused = metal_leaf_start(&chunk.metal[0], &MetalLeafWorld { machine: Some(&other), ..world }, 5_000);
        assert_eq!(refused.unwrap_err().code(), ErrorCode::NotFound);

        let manageable = machine("node_b", "manageable");
        let append =
            metal_leaf_start(&chunk.metal[1], &MetalLeafWorld { machine: Some(&manageable), ..Default::default() }, 5_000)
                .unwrap();
        let started: crate::events::MetalTransitioned = ciborium::Value::deserialized(&append.events[0].payload).unwrap();
        assert_eq!(started.workflow.unwrap().power.as_deref(), Some("off"));
    }
}
