//! Regression: a proof file's index is the auditor's input, and `check_proof` computed
//! `index + 1` unchecked, which overflows at `u64::MAX` (a panic in a debug build, a wrapped
//! seq 0 in a release one). It is refused with a clear error, as are the Merkle verifiers'
//! extreme indices and sizes.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use bc_core::audit;
use bc_core::event::{Envelope, GENESIS_PREV, sha256};
use bc_core::id::{EventId, TenantId};
use bc_core::keys::LogKey;
use bc_core::merkle::{self, ProofError};
use bc_core::note::{self, CheckpointBody, ProofFile};

const DEPLOYMENT: &str = "overflow";

/// A signed checkpoint of one event and a proof file for it, with `index` as given.
fn proof_file(key: &LogKey, index: u64, seq: u64) -> String {
    let tenant = TenantId::generate();
    let event = Envelope {
        tenant,
        seq,
        id: EventId::generate(),
        stream: "s/1".into(),
        version: 1,
        event_type: "x.y".into(),
        at_ms: 1,
        actor: "test".into(),
        idempotency_key: None,
        causation: None,
        correlation: None,
        payload: ciborium::Value::Integer(1.into()),
        prev: GENESIS_PREV,
    }
    .to_canonical()
    .unwrap();
    let leaf = merkle::leaf_hash(&sha256(&event));
    let body = CheckpointBody { origin: note::origin_of(DEPLOYMENT, &tenant), size: 1, root: merkle::root(&[leaf]) };
    ProofFile {
        event,
        vkey: audit::vkey_of(key, DEPLOYMENT).unwrap().encode(),
        index,
        path: vec![],
        checkpoint: note::sign_note(&body.encode(), DEPLOYMENT, key).unwrap(),
        rotations: vec![],
    }
    .encode()
}

#[test]
fn a_proof_index_at_u64_max_is_refused_without_overflow() {
    let key = LogKey::from_seed([5; 32]);
    let pins = [key.pin()];
    // The honest proof of the same shape checks, so the refusal below is the index's.
    assert!(audit::check_proof(&proof_file(&key, 0, 1), None, None, &pins, &[]).is_ok());
    for seq in [0, 1, u64::MAX] {
        let error = audit::check_proof(&proof_file(&key, u64::MAX, seq), None, None, &pins, &[]).unwrap_err();
        assert!(error.contains("out of range"), "seq {seq}: {error}");
    }
    let error = audit::check_proof(&proof_file(&key, u64::MAX - 1, u64::MAX), None, None, &pins, &[]).unwrap_err();
    assert!(error.contains("inclusion proof"), "{error}");
}

#[test]
fn merkle_verifiers_take_extreme_indices_and_sizes() {
    let (leaf, root) = ([1u8; 32], [2u8; 32]);
    assert_eq!(
        merkle::verify_inclusion(u64::MAX, u64::MAX, &leaf, &[], &root),
        Err(ProofError::IndexOutOfRange { index: u64::MAX, size: u64::MAX })
    );
    assert_eq!(merkle::verify_inclusion(u64::MAX - 1, u64::MAX, &leaf, &[], &root), Err(ProofError::WrongLength));
    // Paths of every length up to the bound, at the last indices of the largest trees: refused
    // (the hashes are made up), never an overflow.
    for hashes in 0..=merkle::PROOF_HASHES_MAX {
        let path: Vec<Vec<u8>> = (0..hashes).map(|i| vec![i as u8; 32]).collect();
        for (index, size) in [(u64::MAX - 1, u64::MAX), (u64::MAX - 2, u64::MAX - 1), (0, u64::MAX)] {
            assert!(merkle::verify_inclusion(index, size, &leaf, &path, &root).is_err(), "{index} of {size}, {hashes}");
        }
        for (old, new) in [(u64::MAX - 1, u64::MAX), (1, u64::MAX), (u64::MAX, u64::MAX)] {
            let verified = merkle::verify_consistency(old, new, &leaf, &root, &path);
            assert!(verified.is_err(), "{old} to {new}, {hashes}");
        }
    }
    assert!(merkle::verify_consistency(u64::MAX, u64::MAX, &root, &root, &[]).is_ok());
}
