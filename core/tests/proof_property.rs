//! Property: random logs, random checkpoints, random events: every honest proof file checks,
//! and every mutated one (any byte of a path hash, the index, the event, the checkpoint, a
//! hash added or dropped, a consistency proof bent) fails. Seeded: `BC_TEST_SEED` replays.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use base64::Engine;
use bc_core::audit;
use bc_core::event::{Envelope, GENESIS_PREV, sha256};
use bc_core::id::{EventId, TenantId};
use bc_core::keys::LogKey;
use bc_core::merkle;
use bc_core::note::{self, CheckpointBody, ConsistencyFile, ProofFile};
use ciborium::Value;
use proptest::prelude::*;

use crate::seeded;

const DEPLOYMENT: &str = "prop";

fn log(tenant: TenantId, n: u64) -> Vec<(Vec<u8>, [u8; 32])> {
    let mut prev = GENESIS_PREV;
    (1..=n)
        .map(|seq| {
            let env = Envelope {
                tenant,
                seq,
                id: EventId::generate(),
                stream: format!("s/{}", seq % 3),
                version: seq,
                event_type: "x.y".into(),
                at_ms: seq,
                actor: "prop".into(),
                idempotency_key: None,
                causation: None,
                correlation: None,
                payload: Value::Integer(seq.into()),
                prev,
            };
            let bytes = env.to_canonical().unwrap();
            prev = sha256(&bytes);
            (bytes, prev)
        })
        .collect()
}

fn checkpoint(key: &LogKey, tenant: TenantId, leaves: &[merkle::Hash]) -> String {
    let body =
        CheckpointBody { origin: note::origin_of(DEPLOYMENT, &tenant), size: leaves.len() as u64, root: merkle::root(leaves) };
    note::sign_note(&body.encode(), DEPLOYMENT, key).unwrap()
}

#[test]
fn honest_proof_files_check_and_mutated_ones_fail() {
    let seed = bc_core::testing::seed();
    let mut runner = seeded::runner(seed, 48);
    let key = LogKey::from_seed([11; 32]);
    let pin = key.pin();
    let result = runner.run(&(2u64..80, any::<u64>(), any::<u64>(), any::<u64>(), 0u8..8), |(n, a, b, c, what)| {
        let tenant = TenantId::generate();
        let events = log(tenant, n);
        let leaves: Vec<merkle::Hash> = events.iter().map(|(_, h)| merkle::leaf_hash(h)).collect();
        let size = 1 + a % n; // the checkpoint
        let old = 1 + c % size; // an older checkpoint the auditor saved
        let index = b % size; // the event proved
        let file = ProofFile {
            event: events[index as usize].0.clone(),
            vkey: audit::vkey_of(&key, DEPLOYMENT).unwrap().encode(),
            index,
            path: merkle::inclusion_proof(index, &leaves[..size as usize]).unwrap(),
            checkpoint: checkpoint(&key, tenant, &leaves[..size as usize]),
            rotations: vec![],
        };
        let consistency = ConsistencyFile {
            path: merkle::consistency_proof(old, &leaves[..size as usize]).unwrap(),
            old_checkpoint: checkpoint(&key, tenant, &leaves[..old as usize]),
        };
        let honest = audit::check_proof(&file.encode(), Some(&consistency.encode()), None, std::slice::from_ref(&pin), &[]);
        prop_assert!(honest.is_ok(), "honest proof failed: {:?}", honest.err());
        let proved = honest.unwrap();
        prop_assert_eq!(
            (proved.event.seq, proved.tree_size, proved.consistency),
            (index + 1, size, audit::Consistency::FromProver { size: old })
        );

        let mut bad = file.clone();
        let mut bad_consistency = consistency.clone();
        let changed = match what {
            0 if !bad.path.is_empty() => {
                let h = (a as usize) % bad.path.len();
                bad.path[h][(c as usize) % 32] ^= 1 << (b % 8);
                true
            }
            1 => {
                bad.index = (index + 1 + c % size) % size;
                bad.index != index
            }
            2 => {
                let at = (c as usize) % bad.event.len();
                bad.event[at] ^= 1;
                true
            }
            3 => {
                bad.path.push([7; 32]);
                true
            }
            4 => bad.path.pop().is_some(),
            5 => {
                // A checkpoint of another size (validly signed) with this path.
                let other = 1 + (size + c) % n;
                bad.checkpoint = checkpoint(&key, tenant, &leaves[..other as usize]);
                other != size
            }
            6 if !bad_consistency.path.is_empty() => {
                let h = (b as usize) % bad_consistency.path.len();
                bad_consistency.path[h][(a as usize) % 32] ^= 1;
                true
            }
            7 => {
                // The checkpoint text edited after signing.
                let b64 = base64::engine::general_purpose::STANDARD;
                bad.checkpoint =
                    bad.checkpoint.replacen(&b64.encode(merkle::root(&leaves[..size as usize])), &b64.encode([0u8; 32]), 1);
                true
            }
            _ => false,
        };
        if changed {
            let got = audit::check_proof(&bad.encode(), Some(&bad_consistency.encode()), None, std::slice::from_ref(&pin), &[]);
            prop_assert!(got.is_err(), "mutation {} verified", what);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("property failed with BC_TEST_SEED={seed}: {e}");
    }
}

/// Property: a log grown by runs of leaves, each run cut by `range_subtrees` and pushed as
/// subtrees (what `audit verify` does with the pages it hashes on other cores), is the tree
/// grown leaf by leaf: the same root, size and compact range at every run's end.
#[test]
fn runs_pushed_as_subtrees_build_the_tree_leaves_build() {
    let seed = bc_core::testing::seed();
    let mut runner = seeded::runner(seed, 64);
    let runs = proptest::collection::vec(1usize..300, 1..12);
    let result = runner.run(&runs, |runs| {
        let total: usize = runs.iter().sum();
        let leaves: Vec<merkle::Hash> = (0..total as u64).map(|i| merkle::leaf_hash(&i.to_be_bytes())).collect();
        let (mut by_leaf, mut by_run) = (merkle::RootBuilder::new(), merkle::RootBuilder::new());
        let mut at = 0usize;
        for run in runs {
            for leaf in &leaves[at..at + run] {
                by_leaf.push_leaf_hash(*leaf);
            }
            for (size, hash) in merkle::range_subtrees(at as u64, &leaves[at..at + run]) {
                prop_assert!(by_run.push_subtree(size, hash), "subtree of {} at {}", size, by_run.size());
            }
            at += run;
            prop_assert_eq!(by_run.size(), at as u64);
            prop_assert_eq!(by_run.root(), by_leaf.root());
            prop_assert_eq!(by_run.subtrees(), by_leaf.subtrees());
            prop_assert_eq!(by_run.root(), merkle::root(&leaves[..at]));
        }
        // A subtree that does not sit on a multiple of its size is refused.
        if at % 2 == 1 {
            prop_assert!(!by_run.push_subtree(2, leaves[0]));
        }
        prop_assert!(!by_run.push_subtree(3, leaves[0]));
        Ok(())
    });
    if let Err(e) = result {
        panic!("property failed with BC_TEST_SEED={seed}: {e}");
    }
}
