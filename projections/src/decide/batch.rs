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
use crate::decide::{Append, NodeHolders, RolloutCreateInput, VerbInput};
use crate::metal::Verb;
use crate::rollout::{BusyNodes, ROLLOUT_WAVES_MAX, ReleaseDoc, RolloutDoc};
use crate::workflow::MetalDoc;
use crate::{ImageDoc, NodeDoc, ReservationDoc};
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

/// `nodes.delete` (payload `{}`; the subject a node `node_…` of the batch's tenant): the node's
/// deletion, as `nodes.delete` decides it ([`crate::decide::node_delete`]) when the batch is
/// released; its `node.deleted` reason names the batch.
pub const LEAF_NODE_DELETE: &str = "nodes.delete";
/// `reservations.release` (payload `{}`; the subject a reservation `rsv_…` of the batch's
/// tenant): its release, as `reservations.release` decides it when the batch is released. The
/// root tenant's release of another tenant's reservation goes this way under the quorum: the
/// batch is made in that tenant (`tenantId`).
pub const LEAF_RESERVATION_RELEASE: &str = "reservations.release";
/// `rollouts.create` (the subject the release `rel_…`; the payload a [`RolloutLeaf`]: the
/// rollout as asked, its defaults filled in, and the nodes its pool and labels chose when the
/// batch was made): the rollout, created when the batch is released, with the id drawn for the
/// leaf, only if its pool and labels still choose exactly those nodes.
pub const LEAF_ROLLOUT_CREATE: &str = "rollouts.create";

/// Nodes one `rollouts.create` leaf binds at most: its payload names each (about 33 bytes of
/// encoded id a node), so one such leaf fits a chunk's [`COMMAND_BATCH_LEAF_BYTES_MAX`].
pub const ROLLOUT_LEAF_NODES_MAX: usize = 1_000;

/// The kinds a batch may hold (a leaf's `kind`), each with the payload it takes: `ping`, a
/// command its node runs; the destructive metal verbs, which the release starts as their
/// machines' workflows ([`metal_leaf_start`]); and `nodes.delete`, `reservations.release` and
/// `rollouts.create`, which the release applies itself ([`leaf_start`]).
pub const BATCH_LEAF_KINDS: &[&str] = &[
    "ping",
    LEAF_METAL_UNDEPLOY,
    LEAF_METAL_DEPLOY,
    LEAF_METAL_RETIRE,
    LEAF_METAL_POWER_OFF,
    LEAF_NODE_DELETE,
    LEAF_RESERVATION_RELEASE,
    LEAF_ROLLOUT_CREATE,
];

/// Whether the release carries a leaf of `kind` out itself, in the chunk's append (the gateway
/// or the `batches` reconciler), rather than issuing it as a command to a node: the metal verbs,
/// `nodes.delete`, `reservations.release` and `rollouts.create`.
pub fn applied_at_release(kind: &str) -> bool {
    metal_leaf_verb(kind).is_some() || matches!(kind, LEAF_NODE_DELETE | LEAF_RESERVATION_RELEASE | LEAF_ROLLOUT_CREATE)
}

/// A `rollouts.create` leaf's payload: `rollouts.create`'s arguments with every default filled
/// in, and `nodes`, the ids of the nodes its pool and labels chose when the batch was made
/// (sorted, each once, 1 to [`ROLLOUT_LEAF_NODES_MAX`]). An absent pool and no labels are
/// left out, so one rollout has one encoding.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutLeaf {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<String>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    pub waves: Vec<String>,
    pub max_unavailable: u32,
    pub min_ready_s: u64,
    pub node_deadline_s: u64,
    pub wave_failures_max: u32,
    pub busy_nodes: BusyNodes,
    pub nodes: Vec<String>,
}

impl RolloutLeaf {
    /// The leaf of a rollout asked as `input` (checked at the edge as `rollouts.create` checks
    /// it), named by `labels`, to the nodes `chosen`.
    pub fn new(
        input: &RolloutCreateInput,
        labels: &std::collections::BTreeMap<String, String>,
        chosen: &[&NodeDoc],
    ) -> Result<Self> {
        let mut nodes: Vec<String> = chosen.iter().map(|n| n.node_id.clone()).collect();
        nodes.sort();
        nodes.dedup();
        let leaf = Self {
            pool_id: input.pool_id.clone(),
            labels: labels.clone(),
            waves: input.waves.clone(),
            max_unavailable: input.max_unavailable,
            min_ready_s: input.min_ready_s,
            node_deadline_s: input.node_deadline_s,
            wave_failures_max: input.wave_failures_max,
            busy_nodes: input.busy_nodes,
            nodes,
        };
        leaf.check()?;
        Ok(leaf)
    }

    /// The payload the leaf binds.
    pub fn payload(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self).map_err(|e| Error::Internal(format!("a rollout leaf: {e}")))
    }

    /// Reads a payload that is exactly a rollout leaf's, in its one encoding.
    pub fn parse(payload: &serde_json::Value) -> Result<Self> {
        let what = "a rollouts.create takes the payload {poolId?, labels?, waves, maxUnavailable, minReadyS, nodeDeadlineS, waveFailuresMax, busyNodes, nodes}";
        let leaf: Self = serde_json::from_value(payload.clone()).map_err(|e| Error::invalid(format!("{what}: {e}")))?;
        leaf.check()?;
        if &leaf.payload()? != payload {
            return Err(Error::invalid(format!("{what}, with no empty labels and no null pool")));
        }
        Ok(leaf)
    }

    fn check(&self) -> Result<()> {
        if self.nodes.is_empty() || self.nodes.len() > ROLLOUT_LEAF_NODES_MAX {
            return Err(Error::invalid(format!(
                "a rollouts.create leaf binds 1 to {ROLLOUT_LEAF_NODES_MAX} nodes, not {}: narrow the pool or the labels",
                self.nodes.len()
            )));
        }
        if self.nodes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::invalid("a rollouts.create leaf's nodes are sorted, each once"));
        }
        if let Some(bad) = self.nodes.iter().find(|n| n.parse::<bc_core::id::NodeId>().is_err()) {
            return Err(Error::invalid(format!(
                "a rollouts.create leaf's nodes: {:?} is no node id",
                bc_core::id::truncate(bad, 40)
            )));
        }
        if let Some(pool) = &self.pool_id
            && pool.parse::<bc_core::id::PoolId>().is_err()
        {
            return Err(Error::invalid("a rollouts.create leaf's poolId is no pool id"));
        }
        if self.pool_id.is_none() && self.labels.is_empty() {
            return Err(Error::invalid("a rollouts.create leaf names its nodes: poolId, labels, or both"));
        }
        if self.waves.is_empty() || self.waves.len() > ROLLOUT_WAVES_MAX {
            return Err(Error::invalid(format!("a rollouts.create leaf has 1 to {ROLLOUT_WAVES_MAX} waves")));
        }
        Ok(())
    }

    /// What `rollouts.create` decides with.
    pub fn input(&self) -> RolloutCreateInput {
        RolloutCreateInput {
            pool_id: self.pool_id.clone(),
            selector: crate::decide::rollout_selector(&self.labels),
            waves: self.waves.clone(),
            max_unavailable: self.max_unavailable,
            min_ready_s: self.min_ready_s,
            node_deadline_s: self.node_deadline_s,
            wave_failures_max: self.wave_failures_max,
            busy_nodes: self.busy_nodes,
        }
    }
}

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
    } else if leaf.kind == LEAF_ROLLOUT_CREATE {
        RolloutLeaf::parse(&leaf.payload).map_err(|e| Error::invalid(format!("leaves[{i}]: {}", e.public_message())))?;
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
    check_applied_leaves(&leaves)?;
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

/// The rules across the leaves the release applies itself: a reservation released, a node
/// deleted or a release rolled out once; a node deleted has no other leaf (no command, verb or
/// rollout would find it); a node is in one rollout leaf at most (one live rollout a node).
fn check_applied_leaves(leaves: &[Leaf]) -> Result<()> {
    use std::collections::BTreeMap;
    // Each node a leaf touches: the first leaf that does, and whether one deletes it.
    let mut touched: BTreeMap<&str, (usize, bool)> = BTreeMap::new();
    let mut rolled: BTreeMap<String, usize> = BTreeMap::new();
    let mut once: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for (i, leaf) in leaves.iter().enumerate() {
        let subject = bc_core::id::truncate(&leaf.subject, 40);
        if matches!(leaf.kind.as_str(), LEAF_NODE_DELETE | LEAF_RESERVATION_RELEASE | LEAF_ROLLOUT_CREATE)
            && let Some(first) = once.insert((leaf.kind.as_str(), leaf.subject.as_str()), i)
        {
            return Err(Error::invalid(format!("leaves[{i}]: leaves[{first}] is the same {} of {subject} already", leaf.kind)));
        }
        let mut nodes: Vec<&str> = Vec::new();
        match leaf.kind.as_str() {
            LEAF_RESERVATION_RELEASE => {}
            LEAF_ROLLOUT_CREATE => {
                let rollout = RolloutLeaf::parse(&leaf.payload)?;
                for node in &rollout.nodes {
                    if let Some(first) = rolled.insert(node.clone(), i) {
                        return Err(Error::invalid(format!(
                            "leaves[{i}]: node {node} is in the rollout of leaves[{first}] already; a node is in one rollout at a time"
                        )));
                    }
                }
                nodes.extend(leaf.payload["nodes"].as_array().into_iter().flatten().filter_map(|n| n.as_str()));
            }
            _ => nodes.push(&leaf.subject),
        }
        let deletes = leaf.kind == LEAF_NODE_DELETE;
        for node in nodes {
            match touched.get(node) {
                Some(&(first, deleted)) if deleted || deletes => {
                    return Err(Error::invalid(format!(
                        "leaves[{i}] and leaves[{first}] both act on node {}, and one deletes it: a deleted node takes no other leaf",
                        bc_core::id::truncate(node, 40)
                    )));
                }
                Some(_) => {}
                None => {
                    touched.insert(node, (i, deletes));
                }
            }
        }
    }
    Ok(())
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
/// the leaves the release applies itself ([`applied_at_release`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkRelease {
    pub issued: CommandBatchChunkIssued,
    pub commands: Vec<(String, CommandIssued)>,
    pub applied: Vec<LeafStart>,
}

/// A leaf of a released chunk that the release applies itself: its index, the leaf, and the id
/// drawn for it when the batch was made (the leaf's entry in `command_ids`): the workflow a
/// metal leaf starts, the rollout a `rollouts.create` makes, the command a
/// `reservations.release` sends the reservation's node.
#[derive(Clone, Debug, PartialEq)]
pub struct LeafStart {
    pub index: u64,
    pub leaf: Leaf,
    pub id: String,
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
    let mut applied = Vec::new();
    for (release, i) in releases.into_iter().zip(start..end) {
        let leaf = &batch.leaves[i];
        if applied_at_release(&leaf.kind) {
            applied.push(LeafStart { index: i as u64, leaf: leaf.clone(), id: batch.command_ids[i].clone() });
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
    let issued = CommandBatchChunkIssued { chunk, commands: (commands.len() + applied.len()) as u64, refused: vec![] };
    Ok(Some(ChunkRelease { issued, commands, applied }))
}

/// What a leaf the release applies needs read besides the batch, as of the release: a metal
/// leaf's machine, the machine's node (an undeploy cordons it) and a deploy's image; a
/// `nodes.delete`'s node and what holds on to it; a `reservations.release`'s reservation; a
/// `rollouts.create`'s release, the tenant's nodes and its live rollouts.
#[derive(Clone, Debug, Default)]
pub struct LeafWorld<'a> {
    pub machine: Option<&'a MetalDoc>,
    pub node: Option<&'a NodeDoc>,
    pub image: Option<&'a ImageDoc>,
    pub holders: Option<&'a NodeHolders>,
    pub reservation: Option<&'a ReservationDoc>,
    pub release: Option<&'a ReleaseDoc>,
    pub nodes: &'a [NodeDoc],
    pub live: &'a [RolloutDoc],
}

/// Decides one leaf the release applies itself, as of the release (`world`): a metal verb
/// ([`metal_leaf_start`]); a `nodes.delete`, as `nodes.delete` decides it, at the node's
/// version, its reason naming `batch_id`; a `reservations.release`, as `reservations.release`
/// decides it (`None`: the reservation is already over, nothing to append); a `rollouts.create`
/// with the leaf's id, as `rollouts.create` decides it, only while its pool and labels still
/// choose exactly the nodes the leaf binds. Refused (its subject is gone or moved on since the
/// batch was made), the leaf applies nothing and the caller records why.
pub fn leaf_start(start: &LeafStart, world: &LeafWorld<'_>, batch_id: &str, now_ms: u64) -> Result<Option<Append>> {
    let leaf = &start.leaf;
    let subject = bc_core::id::truncate(&leaf.subject, 40);
    match leaf.kind.as_str() {
        LEAF_NODE_DELETE => {
            let node = world
                .node
                .filter(|n| n.node_id == leaf.subject)
                .ok_or_else(|| Error::not_found(format!("node {subject} (deleted already?)")))?;
            let holders = world.holders.ok_or_else(|| Error::Internal(format!("leaf {}: no holders read", start.index)))?;
            Ok(Some(crate::decide::node_delete(node, holders, Some(format!("deleted by batch {batch_id}")))?))
        }
        LEAF_RESERVATION_RELEASE => {
            let rsv = world
                .reservation
                .filter(|r| r.reservation_id == leaf.subject)
                .ok_or_else(|| Error::not_found(format!("reservation {subject}")))?;
            let issue = crate::placement::Issue { command_id: &start.id, now_ms };
            Ok(crate::decide::reservation_release(rsv, None, issue)?)
        }
        LEAF_ROLLOUT_CREATE => {
            let rollout = RolloutLeaf::parse(&leaf.payload)?;
            let release = world
                .release
                .filter(|r| r.release_id == leaf.subject)
                .ok_or_else(|| Error::not_found(format!("release {subject}")))?;
            let chosen = crate::decide::rollout_nodes(world.nodes, rollout.pool_id.as_deref(), &rollout.labels);
            let mut now: Vec<&str> = chosen.iter().map(|n| n.node_id.as_str()).collect();
            now.sort_unstable();
            if now != rollout.nodes {
                let gone = rollout.nodes.iter().filter(|n| !now.contains(&n.as_str())).count();
                let new = now.iter().filter(|n| !rollout.nodes.iter().any(|b| b == *n)).count();
                return Err(Error::state(
                    format!(
                        "the nodes the rollout's pool and labels choose changed since the batch was made: of the {} it binds {gone} are gone, and {new} are new",
                        rollout.nodes.len()
                    ),
                    "make the batch again for the nodes there are now",
                ));
            }
            Ok(Some(crate::decide::rollout_create(&start.id, release, chosen, world.live, rollout.input())?))
        }
        _ => metal_leaf_start(start, world, now_ms).map(Some),
    }
}

/// Decides the start of one released metal leaf on its machine: the verb as the caller's
/// `metal.*` method decides it ([`crate::decide::metal_verb`]), with the leaf's exact arguments and
/// the workflow id the batch drew for it, appended at the machine's version. An undeploy is
/// refused while the machine's node holds reservations and cordons the node
/// ([`undeploy_cordons`]), as `metal.undeploy` does. Refused (the machine moved on since the
/// batch was made), the leaf starts nothing and the caller records why.
pub fn metal_leaf_start(start: &LeafStart, world: &LeafWorld<'_>, now_ms: u64) -> Result<Append> {
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
        workflow_id: &start.id,
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
/// `applied` are the appends of the chunk's leaves the release applies ([`leaf_start`]); the
/// ones refused are in `chunk.issued.refused`.
pub fn chunk_appends(
    tenant: bc_core::id::TenantId,
    batch: &CommandBatchDoc,
    chunk: ChunkRelease,
    applied: Vec<Append>,
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
    for append in applied {
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
/// root tenant of another tenant's reservation are refused `BATCH_REQUIRED`, with a hint naming
/// the command that makes the batch of the same operation (`metal bulk`, or the refused command
/// with `--batch-reason`). Everything else passes.
pub fn batch_required(quorum: bool, scope: DestructiveScope) -> Result<()> {
    if !quorum {
        return Ok(());
    }
    let (what, command) = match scope {
        DestructiveScope::Metal { verb, machines } if machines > 1 && BATCH_METAL_VERBS.contains(&verb) => (
            format!("metal {verb} on {machines} machines"),
            format!("better-compute metal bulk --verb {} --nodes … --reason TEXT", verb.replace(' ', "-")),
        ),
        DestructiveScope::Rollout { nodes } if nodes > 1 => (
            format!("a rollout to {nodes} nodes"),
            "better-compute rollouts create … --batch-reason TEXT, with the same flags".to_owned(),
        ),
        DestructiveScope::NodeDelete => {
            ("nodes.delete".to_owned(), "better-compute nodes delete NODE… --yes --batch-reason TEXT".to_owned())
        }
        DestructiveScope::ReservationRelease { root_caller: true, other_tenant: true } => (
            "the root tenant's release of another tenant's reservation".to_owned(),
            "better-compute release RESERVATION… --tenant TENANT --batch-reason TEXT".to_owned(),
        ),
        _ => return Ok(()),
    };
    let hint = format!("make a batch of it ({command}) and have the approvers sign it (batch approve)");
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

    /// The publication history of the set `s`, published at epoch 1 (what a release reads).
    fn epoch_1_history(s: &ApproverSetDoc) -> [ApproverSetPublished; 1] {
        [ApproverSetPublished {
            epoch: 1,
            quorum: s.quorum,
            trust_domain: "compute.test".into(),
            keys: s.keys.clone(),
            signatures: vec![],
        }]
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
        assert!(make(vec![Leaf { kind: "nodes.drain".into(), ..ping("n") }], 1).is_err());
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
    /// scopes, each `BATCH_REQUIRED` with a hint naming the command that makes its batch.
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
                Rollout { .. } => assert!(hint.contains("rollouts create … --batch-reason TEXT"), "{e:?}"),
                NodeDelete => assert!(hint.contains("nodes delete NODE… --yes --batch-reason TEXT"), "{e:?}"),
                ReservationRelease { .. } => {
                    assert!(hint.contains("release RESERVATION… --tenant TENANT --batch-reason TEXT"), "{e:?}")
                }
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
        let history = epoch_1_history(&s);
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
        let history = epoch_1_history(&s);
        assert_eq!(release_chunk(&doc, &history, 5_000).unwrap(), None, "a pending batch starts nothing");
        approve(&mut doc, &s, &a).unwrap();
        assert_eq!(release_chunk(&doc, &history, 5_000).unwrap(), None, "one approval of two starts nothing");
        approve(&mut doc, &s, &b).unwrap();
        doc.state = BatchState::Released;
        let chunk = release_chunk(&doc, &history, 5_000).unwrap().unwrap();
        assert_eq!(chunk.commands.len(), 1, "only the ping goes to a node");
        assert_eq!(chunk.applied.iter().map(|m| (m.index, m.id.as_str())).collect::<Vec<_>>(), [(0, "cmd_0"), (1, "cmd_1")]);
        assert_eq!(chunk.issued.commands, 3);

        let active = machine("node_a", "active");
        let free = node_doc("node_a", false, serde_json::json!({}));
        let world = LeafWorld { machine: Some(&active), node: Some(&free), image: None, ..Default::default() };
        let append = metal_leaf_start(&chunk.applied[0], &world, 5_000).unwrap();
        assert_eq!(append.stream, "metal/node_a");
        assert_eq!(append.expected, ExpectedVersion::Exact(9));
        assert_eq!(append.event_types(), ["metal.transitioned", "node.cordoned"]);
        assert_eq!(append.guards, [("node/node_a".to_owned(), ExpectedVersion::Exact(4))]);
        let started: crate::events::MetalTransitioned = ciborium::Value::deserialized(&append.events[0].payload).unwrap();
        assert_eq!((started.verb.as_str(), started.to.as_str()), ("undeploy", "deleting"));
        assert_eq!(started.workflow.unwrap().workflow_id, "cmd_0");

        let held = node_doc("node_a", true, serde_json::json!({ "0": "rsv_a" }));
        let refused = metal_leaf_start(&chunk.applied[0], &LeafWorld { node: Some(&held), ..world.clone() }, 5_000);
        assert!(refused.unwrap_err().to_string().contains("drain it"));
        let moved = machine("node_a", "available");
        let refused = metal_leaf_start(&chunk.applied[0], &LeafWorld { machine: Some(&moved), ..world.clone() }, 5_000);
        assert_eq!(refused.unwrap_err().code(), ErrorCode::InvalidState);
        let other = machine("node_z", "active");
        let refused = metal_leaf_start(&chunk.applied[0], &LeafWorld { machine: Some(&other), ..world }, 5_000);
        assert_eq!(refused.unwrap_err().code(), ErrorCode::NotFound);

        let manageable = machine("node_b", "manageable");
        let append =
            metal_leaf_start(&chunk.applied[1], &LeafWorld { machine: Some(&manageable), ..Default::default() }, 5_000).unwrap();
        let started: crate::events::MetalTransitioned = ciborium::Value::deserialized(&append.events[0].payload).unwrap();
        assert_eq!(started.workflow.unwrap().power.as_deref(), Some("off"));
    }

    const NODE_1: &str = "node_01jd0000000000000000000001";
    const NODE_2: &str = "node_01jd0000000000000000000002";
    const NODE_3: &str = "node_01jd0000000000000000000003";
    const POOL: &str = "pool_01jd0000000000000000000000";
    const RSV: &str = "rsv_01jd0000000000000000000000";
    const REL: &str = "rel_01jd0000000000000000000000";

    fn leaf(kind: &str, subject: &str, payload: serde_json::Value) -> Leaf {
        Leaf { subject: subject.into(), kind: kind.into(), payload }
    }

    fn make(leaves: Vec<Leaf>) -> Result<CommandBatchCreated> {
        let s = set(&[&key(1)], 1);
        let ids = (0..leaves.len()).map(|i| format!("cmd_{i}")).collect();
        batch_create(Some(&s), BatchCreateInput { reason: "r".into(), leaves, hours: 1, deadline_s: 300, command_ids: ids }, 0)
    }

    /// A node with an agent (`agent`) in the pool, with `labels`.
    fn agent_node(node: &str, labels: serde_json::Value, agent: bool) -> NodeDoc {
        let mut doc = serde_json::json!({
            "tenantId": "ten_00000000000000000000000000", "nodeId": node, "poolId": POOL, "name": node,
            "gpus": [], "labels": labels, "state": "ready", "cordoned": false, "allocations": {},
            "version": 3, "createdAtMs": 1, "updatedAtMs": 2,
        });
        if agent {
            doc["agent"] = serde_json::json!({
                "publicKey": "AAAA", "agentVersion": "1.0.0", "hostname": node, "joinTokenId": "jt_x",
                "joinedAtMs": 1, "reachable": true, "leaseExpiresAtMs": 9, "journalSeq": 0, "journalHash": "",
            });
        }
        serde_json::from_value(doc).expect("a node document")
    }

    fn release_doc() -> ReleaseDoc {
        serde_json::from_value(serde_json::json!({
            "tenantId": "ten_00000000000000000000000000", "releaseId": REL, "releaseVersion": "2.0.0", "keyId": "k",
            "allowDowngrade": false, "artifacts": [], "manifest": "{}", "signature": "s", "version": 1, "createdAtMs": 1,
        }))
        .expect("a release document")
    }

    fn rsv_doc(state: &str, node: Option<&str>) -> ReservationDoc {
        serde_json::from_value(serde_json::json!({
            "tenantId": "ten_00000000000000000000000001", "reservationId": RSV, "poolId": POOL, "gpus": 1,
            "durationS": 600, "selector": "", "nvlink": false, "tolerations": [], "state": state, "nodeId": node,
            "gpuIndexes": if node.is_some() { serde_json::json!([0]) } else { serde_json::json!([]) },
            "requestSeq": 1, "requestedAtMs": 1, "activatedAtMs": node.map(|_| 2), "endsAtMs": node.map(|_| 600_002),
            "endedAtMs": null, "version": 5,
        }))
        .expect("a reservation document")
    }

    fn rollout_input() -> RolloutCreateInput {
        RolloutCreateInput {
            pool_id: Some(POOL.into()),
            selector: None,
            waves: vec!["1".into(), "100%".into()],
            max_unavailable: 1,
            min_ready_s: 30,
            node_deadline_s: 900,
            wave_failures_max: 0,
            busy_nodes: BusyNodes::Wait,
        }
    }

    /// The leaf of a rollout of the pool to `nodes`.
    fn rollout_leaf(nodes: &[&NodeDoc]) -> Leaf {
        let payload = RolloutLeaf::new(&rollout_input(), &Default::default(), nodes).unwrap().payload().unwrap();
        leaf(LEAF_ROLLOUT_CREATE, REL, payload)
    }

    /// `nodes.delete`, `reservations.release` and `rollouts.create` leaves: each takes exactly its
    /// payload (`{}`, or a rollout leaf in its one encoding, whose nodes are sorted, each once, at
    /// most `ROLLOUT_LEAF_NODES_MAX`), binds its exact operation (another node set is another
    /// root), and acts once: no operation twice, no other leaf on a node deleted, no node in two
    /// rollouts.
    #[test]
    fn the_applied_leaves_take_exactly_their_payload_and_act_once() {
        let empty = serde_json::json!({});
        let (n1, n2, n3) = (
            agent_node(NODE_1, serde_json::json!({}), true),
            agent_node(NODE_2, serde_json::json!({}), true),
            agent_node(NODE_3, serde_json::json!({}), true),
        );
        assert!(BATCH_LEAF_KINDS.contains(&LEAF_NODE_DELETE) && BATCH_LEAF_KINDS.contains(&LEAF_ROLLOUT_CREATE));
        for kind in [LEAF_NODE_DELETE, LEAF_RESERVATION_RELEASE, LEAF_ROLLOUT_CREATE] {
            assert!(applied_at_release(kind), "{kind}");
        }
        assert!(!applied_at_release("ping"));
        assert!(applied_at_release(LEAF_METAL_RETIRE));

        assert!(make(vec![leaf(LEAF_NODE_DELETE, NODE_1, empty.clone())]).is_ok());
        assert!(make(vec![leaf(LEAF_RESERVATION_RELEASE, RSV, empty.clone())]).is_ok());
        for bad in [serde_json::json!({"reason": "x"}), serde_json::Value::Null, serde_json::json!({"imageId": IMAGE})] {
            assert!(make(vec![leaf(LEAF_NODE_DELETE, NODE_1, bad.clone())]).is_err(), "{bad}");
            assert!(make(vec![leaf(LEAF_RESERVATION_RELEASE, RSV, bad.clone())]).is_err(), "{bad}");
            assert!(make(vec![leaf(LEAF_ROLLOUT_CREATE, REL, bad.clone())]).is_err(), "{bad}");
        }

        let rollout = rollout_leaf(&[&n2, &n1]);
        assert_eq!(rollout.payload["nodes"], serde_json::json!([NODE_1, NODE_2]), "sorted");
        assert_eq!(rollout.payload.get("labels"), None, "no labels: left out");
        assert!(make(vec![rollout.clone()]).is_ok());
        assert_ne!(scope_root(std::slice::from_ref(&rollout)).unwrap(), scope_root(&[rollout_leaf(&[&n1, &n2, &n3])]).unwrap());
        let with = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut payload = rollout.payload.clone();
            f(&mut payload);
            make(vec![leaf(LEAF_ROLLOUT_CREATE, REL, payload)])
        };
        let refused = |f: &dyn Fn(&mut serde_json::Value), why: &str| {
            let e = with(f).unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
            assert!(e.to_string().contains(why), "{why}: {e}");
        };
        refused(&|p| p["nodes"] = serde_json::json!([NODE_2, NODE_1]), "sorted, each once");
        refused(&|p| p["nodes"] = serde_json::json!([NODE_1, NODE_1]), "sorted, each once");
        refused(&|p| p["nodes"] = serde_json::json!([]), "1 to 1000 nodes");
        refused(&|p| p["nodes"] = serde_json::json!(["node_x"]), "is no node id");
        refused(&|p| p["labels"] = serde_json::json!({}), "no empty labels");
        refused(
            &|p| {
                p["poolId"] = serde_json::Value::Null;
                p["labels"] = serde_json::json!({"rack": "12"});
            },
            "no null pool",
        );
        refused(&|p| p["poolId"] = serde_json::json!("pool_x"), "poolId is no pool id");
        refused(&|p| p["extra"] = serde_json::json!(1), "unknown field");
        refused(&|p| drop(p.as_object_mut().unwrap().remove("waves")), "missing field");
        refused(&|p| p["waves"] = serde_json::json!([]), "1 to 16 waves");
        refused(&|p| p["busyNodes"] = serde_json::json!("sometimes"), "unknown variant");
        refused(
            &|p| {
                p.as_object_mut().unwrap().remove("poolId");
            },
            "poolId, labels, or both",
        );
        let many: Vec<NodeDoc> =
            (0..=ROLLOUT_LEAF_NODES_MAX).map(|i| agent_node(&format!("node_01jd{i:022}"), serde_json::json!({}), true)).collect();
        let too_many: Vec<&NodeDoc> = many.iter().collect();
        let e = RolloutLeaf::new(&rollout_input(), &Default::default(), &too_many).unwrap_err();
        assert!(e.to_string().contains("1 to 1000 nodes, not 1001"), "{e}");

        let twice = |a: Leaf, b: Leaf, why: &str| {
            let e = make(vec![a, b]).unwrap_err();
            assert!(e.to_string().contains(why), "{why}: {e}");
        };
        let delete = |node: &str| leaf(LEAF_NODE_DELETE, node, empty.clone());
        twice(delete(NODE_1), delete(NODE_1), "is the same nodes.delete");
        twice(
            leaf(LEAF_RESERVATION_RELEASE, RSV, empty.clone()),
            leaf(LEAF_RESERVATION_RELEASE, RSV, empty.clone()),
            "is the same reservations.release",
        );
        twice(rollout.clone(), rollout.clone(), "is the same rollouts.create");
        twice(ping(NODE_1), delete(NODE_1), "a deleted node takes no other leaf");
        twice(delete(NODE_2), leaf(LEAF_METAL_POWER_OFF, NODE_2, empty.clone()), "a deleted node takes no other leaf");
        twice(rollout.clone(), delete(NODE_1), "a deleted node takes no other leaf");
        let other_release = Leaf { subject: "rel_01jd0000000000000000000001".into(), ..rollout_leaf(&[&n2, &n3]) };
        twice(rollout.clone(), other_release, "a node is in one rollout at a time");
        assert!(make(vec![delete(NODE_3), rollout.clone(), ping(NODE_1), leaf(LEAF_RESERVATION_RELEASE, RSV, empty)]).is_ok());
    }

    /// A released batch applies its `nodes.delete`, `reservations.release` and `rollouts.create`
    /// leaves (no command for a node, nothing while pending or one approval short), each decided
    /// as its own method decides it, as of the release: a node deleted at its version with the
    /// batch in the reason, refused while it holds GPUs or is gone; a reservation released (its
    /// node sent the release with the leaf's id), nothing for one already over; the rollout
    /// created with the leaf's id to exactly its bound nodes, refused once the pool chooses
    /// other nodes or its release is gone.
    #[test]
    fn the_applied_leaves_are_decided_at_release_and_nothing_before() {
        let (a, b) = (key(1), key(2));
        let s = set(&[&a, &b], 2);
        let empty = serde_json::json!({});
        let (n1, n2) = (agent_node(NODE_1, serde_json::json!({}), true), agent_node(NODE_2, serde_json::json!({}), true));
        let leaves = vec![
            leaf(LEAF_NODE_DELETE, NODE_3, empty.clone()),
            leaf(LEAF_RESERVATION_RELEASE, RSV, empty.clone()),
            rollout_leaf(&[&n1, &n2]),
        ];
        let mut doc = batch(&s, leaves);
        let history = epoch_1_history(&s);
        assert_eq!(release_chunk(&doc, &history, 5_000).unwrap(), None, "a pending batch applies nothing");
        approve(&mut doc, &s, &a).unwrap();
        assert_eq!(release_chunk(&doc, &history, 5_000).unwrap(), None, "one approval of two applies nothing");
        approve(&mut doc, &s, &b).unwrap();
        doc.state = BatchState::Released;
        let chunk = release_chunk(&doc, &history, 5_000).unwrap().unwrap();
        assert!(chunk.commands.is_empty(), "no command goes to a node");
        assert_eq!(
            chunk.applied.iter().map(|l| (l.index, l.id.as_str())).collect::<Vec<_>>(),
            [(0, "cmd_0"), (1, "cmd_1"), (2, "cmd_2")]
        );
        assert_eq!(chunk.issued.commands, 3);
        let (delete, release, rollout) = (&chunk.applied[0], &chunk.applied[1], &chunk.applied[2]);

        // nodes.delete: the node's own decision, the batch in its reason.
        let mut gone = agent_node(NODE_3, serde_json::json!({}), false);
        gone.cordoned = true;
        let free = NodeHolders::default();
        let world = LeafWorld { node: Some(&gone), holders: Some(&free), ..Default::default() };
        let append = leaf_start(delete, &world, "batch_a", 5_000).unwrap().unwrap();
        assert_eq!(
            (append.stream.as_str(), append.expected),
            ("node/node_01jd0000000000000000000003", ExpectedVersion::Exact(3))
        );
        assert_eq!(append.event_types(), [crate::events::NODE_DELETED]);
        let deleted: crate::events::NodeDeleted = ciborium::Value::deserialized(&append.events[0].payload).unwrap();
        assert_eq!(deleted.reason.as_deref(), Some("deleted by batch batch_a"));
        let mut held = gone.clone();
        held.allocations.insert(0, RSV.into());
        let e = leaf_start(delete, &LeafWorld { node: Some(&held), ..world.clone() }, "batch_a", 5_000).unwrap_err();
        assert!(e.to_string().contains("GPUs are held"), "{e}");
        let e = leaf_start(delete, &LeafWorld { node: None, ..world.clone() }, "batch_a", 5_000).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound, "a node gone by the release: {e}");
        let e = leaf_start(delete, &LeafWorld { node: Some(&n1), ..world }, "batch_a", 5_000).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound, "another node is not the leaf's: {e}");

        // reservations.release: an active one ends and its node is sent the release, with the leaf's id.
        let active = rsv_doc("active", Some(NODE_1));
        let append = leaf_start(release, &LeafWorld { reservation: Some(&active), ..Default::default() }, "batch_a", 5_000)
            .unwrap()
            .unwrap();
        assert_eq!(
            (append.stream.as_str(), append.expected),
            ("reservation/rsv_01jd0000000000000000000000", ExpectedVersion::Exact(5))
        );
        assert!(append.event_types().contains(&crate::events::RESERVATION_RELEASED), "{:?}", append.event_types());
        let queued = rsv_doc("queued", None);
        let append = leaf_start(release, &LeafWorld { reservation: Some(&queued), ..Default::default() }, "batch_a", 5_000);
        assert_eq!(append.unwrap().unwrap().event_types(), [crate::events::RESERVATION_CANCELLED]);
        let over = rsv_doc("released", None);
        let nothing = leaf_start(release, &LeafWorld { reservation: Some(&over), ..Default::default() }, "batch_a", 5_000);
        assert!(nothing.unwrap().is_none(), "over already: nothing to append");
        let e = leaf_start(release, &LeafWorld::default(), "batch_a", 5_000).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound);

        // rollouts.create: to exactly the bound nodes, with the leaf's id.
        let rel = release_doc();
        let nodes = vec![n1.clone(), n2.clone(), agent_node(NODE_3, serde_json::json!({}), false)];
        let world = LeafWorld { release: Some(&rel), nodes: &nodes, ..Default::default() };
        let append = leaf_start(rollout, &world, "batch_a", 5_000).unwrap().unwrap();
        assert_eq!((append.stream.as_str(), append.expected), ("rollout/cmd_2", ExpectedVersion::NoStream));
        let created: crate::rollout::RolloutCreated = ciborium::Value::deserialized(&append.events[0].payload).unwrap();
        assert_eq!(created.nodes, [NODE_1, NODE_2]);
        assert_eq!((created.release_id.as_str(), created.pool_id.as_deref()), (REL, Some(POOL)));
        // A node joined the pool since: the leaf does not bind it; refused.
        let more = vec![n1.clone(), n2.clone(), agent_node(NODE_3, serde_json::json!({}), true)];
        let e = leaf_start(rollout, &LeafWorld { nodes: &more, ..world.clone() }, "batch_a", 5_000).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidState, "{e}");
        assert!(e.to_string().contains("of the 2 it binds 0 are gone, and 1 are new"), "{e}");
        let fewer = vec![n1.clone()];
        let e = leaf_start(rollout, &LeafWorld { nodes: &fewer, ..world.clone() }, "batch_a", 5_000).unwrap_err();
        assert!(e.to_string().contains("1 are gone, and 0 are new"), "{e}");
        let e = leaf_start(rollout, &LeafWorld { release: None, ..world }, "batch_a", 5_000).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotFound, "{e}");
    }
}
