//! Regression: `audit check-proof` took the old checkpoint for the consistency proof
//! from the prover's own consistency file, so a forked log signed with the real key passed, and
//! a proof without that file silently skipped consistency. The auditor's own saved checkpoint
//! (`--saved`) is what consistency is proved from, and a check says when none was made.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use bc_core::audit::{self, Consistency};
use bc_core::event::{Envelope, GENESIS_PREV, sha256};
use bc_core::id::{EventId, TenantId};
use bc_core::keys::LogKey;
use bc_core::merkle;
use bc_core::note::{self, CheckpointBody, ConsistencyFile, ProofFile};
use ciborium::Value;

const DEPLOYMENT: &str = "fork";

/// `n` chained events of `tenant`; from `diverge_at` on, payloads carry `branch`, so two calls
/// with different branches share the prefix before `diverge_at` and differ after it.
fn log(tenant: TenantId, n: u64, diverge_at: u64, branch: &str) -> Vec<(Vec<u8>, [u8; 32])> {
    let mut prev = GENESIS_PREV;
    (1..=n)
        .map(|seq| {
            let payload = if seq < diverge_at { format!("common-{seq}") } else { format!("{branch}-{seq}") };
            let env = Envelope {
                tenant,
                seq,
                id: EventId::from_ulid(ulid::Ulid::from_parts(seq, 0)),
                stream: "s/1".into(),
                version: seq,
                event_type: "x.y".into(),
                at_ms: seq,
                actor: "test".into(),
                idempotency_key: None,
                causation: None,
                correlation: None,
                payload: Value::Text(payload),
                prev,
            };
            let bytes = env.to_canonical().unwrap();
            prev = sha256(&bytes);
            (bytes, prev)
        })
        .collect()
}

fn leaves(events: &[(Vec<u8>, [u8; 32])]) -> Vec<merkle::Hash> {
    events.iter().map(|(_, h)| merkle::leaf_hash(h)).collect()
}

fn checkpoint(key: &LogKey, tenant: TenantId, leaves: &[merkle::Hash]) -> String {
    let body =
        CheckpointBody { origin: note::origin_of(DEPLOYMENT, &tenant), size: leaves.len() as u64, root: merkle::root(leaves) };
    note::sign_note(&body.encode(), DEPLOYMENT, key).unwrap()
}

/// The proof of the event at `index` in the checkpoint over all of `events`, with the
/// consistency file from the checkpoint of the first `old` events.
fn prove(key: &LogKey, tenant: TenantId, events: &[(Vec<u8>, [u8; 32])], index: u64, old: u64) -> (String, String) {
    let all = leaves(events);
    let file = ProofFile {
        event: events[index as usize].0.clone(),
        vkey: audit::vkey_of(key, DEPLOYMENT).unwrap().encode(),
        index,
        path: merkle::inclusion_proof(index, &all).unwrap(),
        checkpoint: checkpoint(key, tenant, &all),
        rotations: vec![],
    };
    let consistency = ConsistencyFile {
        path: merkle::consistency_proof(old, &all).unwrap(),
        old_checkpoint: checkpoint(key, tenant, &all[..old as usize]),
    };
    (file.encode(), consistency.encode())
}

#[test]
fn a_forked_log_signed_with_the_real_key_is_caught_with_saved() {
    let key = LogKey::from_seed([21; 32]);
    let pins = [key.pin()];
    let tenant = TenantId::generate();
    // What the auditor saw: the honest log at size 6, its checkpoint saved.
    let honest = log(tenant, 12, 5, "honest");
    let saved = checkpoint(&key, tenant, &leaves(&honest)[..6]);
    // The operator (holding the real key) forks after seq 4 and proves an event of the fork,
    // with a consistency file from the fork's own checkpoint at size 6.
    let forked = log(tenant, 12, 5, "forked");
    let (proof, consistency) = prove(&key, tenant, &forked, 8, 6);

    // What the check used to do: the prover's old checkpoint agrees with the prover's new one.
    let trusting = audit::check_proof(&proof, Some(&consistency), None, &pins, &[]).expect("the fork is self-consistent");
    assert_eq!(trusting.consistency, Consistency::FromProver { size: 6 });
    // With the auditor's own checkpoint, the fork is caught.
    let error = audit::check_proof(&proof, Some(&consistency), Some(&saved), &pins, &[]).unwrap_err();
    assert!(error.contains("does not extend your saved checkpoint") && error.contains("forked"), "{error}");
    // Saved at the fork's own size: the same size, another root.
    let saved_at_12 = checkpoint(&key, tenant, &leaves(&honest));
    let error = audit::check_proof(&proof, None, Some(&saved_at_12), &pins, &[]).unwrap_err();
    assert!(error.contains("different roots"), "{error}");

    // The honest log's proof checks from the saved checkpoint.
    let (proof, consistency) = prove(&key, tenant, &honest, 8, 6);
    let checked = audit::check_proof(&proof, Some(&consistency), Some(&saved), &pins, &[]).expect("honest");
    assert_eq!(checked.consistency, Consistency::FromSaved { size: 6 });
    // Even when the prover's consistency file starts elsewhere, the saved checkpoint is used.
    let (_, from_seven) = prove(&key, tenant, &honest, 8, 7);
    assert!(audit::check_proof(&proof, Some(&from_seven), Some(&saved), &pins, &[]).is_err());

    // No --saved and no consistency file: nothing was checked, and that is what is reported.
    let unchecked = audit::check_proof(&proof, None, None, &pins, &[]).expect("inclusion alone");
    assert_eq!(unchecked.consistency, Consistency::NotChecked);
    // --saved without a consistency file to check it with is refused, not skipped.
    let error = audit::check_proof(&proof, None, Some(&saved), &pins, &[]).unwrap_err();
    assert!(error.contains("no consistency proof from your saved checkpoint"), "{error}");
    // A saved checkpoint newer than the proof's: refused.
    let (older_proof, _) = prove(&key, tenant, &honest[..5], 2, 3);
    let error = audit::check_proof(&older_proof, None, Some(&saved), &pins, &[]).unwrap_err();
    assert!(error.contains("newer than the proof's"), "{error}");
    // A saved checkpoint signed by a key the auditor does not trust: refused.
    let stranger = checkpoint(&LogKey::from_seed([22; 32]), tenant, &leaves(&honest)[..6]);
    let error = audit::check_proof(&proof, Some(&consistency), Some(&stranger), &pins, &[]).unwrap_err();
    assert!(error.contains("not signed by a trusted key"), "{error}");
}
