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

use bc_core::{Error, Result};

use crate::batch::{
    APPROVERS_MAX, ApproverKey, ApproverSetDoc, ApproverSetPublished, ApproverSignature, BatchState, COMMAND_BATCH_HOURS_MAX,
    COMMAND_BATCH_LEAF_BYTES_MAX, COMMAND_BATCH_LEAVES_MAX, COMMAND_BATCH_REASON_BYTES_MAX, CommandBatchApproved,
    CommandBatchCreated, CommandBatchDoc, Leaf, TRUST_DOMAIN_BYTES_MAX, approval_message, approver_set_message,
    parse_approver_key, scope_root, verify_signature,
};

/// The command kinds a batch may hold (a leaf's `kind`), each with the payload it takes.
pub const BATCH_LEAF_KINDS: &[&str] = &["ping"];

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
    let mut bytes = 0usize;
    for (i, leaf) in leaves.iter().enumerate() {
        if !BATCH_LEAF_KINDS.contains(&leaf.kind.as_str()) {
            return Err(Error::InvalidArgument {
                message: format!("leaves[{i}]: kind {:?} is not one a batch holds", bc_core::id::truncate(&leaf.kind, 40)),
                hint: Some(format!("kinds: {}", BATCH_LEAF_KINDS.join(", "))),
            });
        }
        if leaf.payload != serde_json::json!({}) {
            return Err(Error::invalid(format!("leaves[{i}]: a {} takes the payload {{}}", leaf.kind)));
        }
        bytes += leaf.encode()?.len();
    }
    if bytes > COMMAND_BATCH_LEAF_BYTES_MAX {
        return Err(Error::invalid(format!(
            "the leaves encode to {bytes} bytes; a batch holds at most {COMMAND_BATCH_LEAF_BYTES_MAX}"
        )));
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
}
