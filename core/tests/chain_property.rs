//! Property: random appends across tenants always give chains that verify, and flipping any
//! byte of any stored event, deleting one or reordering two is detected at the first bad `seq`;
//! taking a signature away is harmless where a later one covers the event, caught where none does.
//! Seeded: set `BC_TEST_SEED` to replay a failure; the seed is printed when a case fails.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;

use bc_core::chain::verify_chain;
use bc_core::clock::SystemClock;
use bc_core::event::StoredEvent;
use bc_core::event::{EventRow, SIGNED_SEQ_INTERVAL};
use bc_core::id::TenantId;
use bc_core::keys::{KeyRing, LogKey};
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent, Projector, RowKey};
use ciborium::Value;
use proptest::prelude::*;

#[path = "support/seeded.rs"]
mod seeded;

struct NoProjections;
impl Projector for NoProjections {
    fn touches(&self, _: &StoredEvent, _: &mut Vec<RowKey>) {}
    fn apply(&self, _: &RowKey, c: Option<serde_json::Value>, _: &StoredEvent) -> bc_core::Result<Option<serde_json::Value>> {
        Ok(c)
    }
}

/// A tenant, its stored rows, and its head (seq, hash).
type Chain = (TenantId, Vec<EventRow>, (u64, [u8; 32]));

#[derive(Clone, Debug)]
enum Tamper {
    /// Flip one bit of one stored field of one event: its canonical bytes, hash, signature,
    /// or the id, stream, type or key id column.
    Flip {
        field: u8,
        event: usize,
        byte: usize,
        bit: u8,
    },
    Delete {
        event: usize,
    },
    Swap {
        a: usize,
        b: usize,
    },
    /// Take one event's signature away (its `sig` and `key_id` emptied): harmless when a later
    /// signed event covers it, caught at the first uncovered seq when none does (the head).
    Strip {
        event: usize,
    },
}

fn tamper() -> impl Strategy<Value = Tamper> {
    prop_oneof![
        (0u8..7, any::<usize>(), any::<usize>(), 0u8..8).prop_map(|(field, event, byte, bit)| Tamper::Flip {
            field,
            event,
            byte,
            bit
        }),
        any::<usize>().prop_map(|event| Tamper::Delete { event }),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Tamper::Swap { a, b }),
        any::<usize>().prop_map(|event| Tamper::Strip { event }),
    ]
}

/// (tenant, stream, events) triples.
fn appends() -> impl Strategy<Value = Vec<(usize, usize, usize)>> {
    prop::collection::vec((0usize..3, 0usize..3, 1usize..4), 1..12)
}

#[test]
fn chains_verify_and_tampering_is_located() {
    let seed = bc_core::testing::seed();
    let mut runner = seeded::runner(seed, 24);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let result = runner.run(&(appends(), tamper()), |(appends, tamper)| {
        runtime.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("p.sqlite3")).await.unwrap());
            store.migrate().await.unwrap();
            let key = Arc::new(LogKey::generate());
            let mut keys = KeyRing::default();
            keys.insert(key.public());
            let log = Log::open(store.clone(), Arc::new(NoProjections), key, Arc::new(SystemClock)).await.unwrap();
            let tenants: Vec<TenantId> = (0..3).map(|_| TenantId::generate()).collect();
            for (t, s, n) in &appends {
                let events = (0..*n).map(|i| NewEvent::new("x.y", Value::Integer((i as u64).into()))).collect();
                log.append(AppendRequest {
                    tenant: tenants[*t],
                    stream: format!("s/{s}"),
                    expected: ExpectedVersion::Any,
                    idempotency_key: None,
                    actor: "prop".into(),
                    causation: None,
                    correlation: None,
                    fingerprint: None,
                    guards: vec![],
                    events,
                })
                .await
                .unwrap();
            }
            // Honest: every chain verifies, its head signed; an append of several events
            // leaves the ones before its last without a signature of their own.
            let heads = store.heads().await.unwrap();
            let mut chains: Vec<Chain> = Vec::new();
            for (tenant, head) in heads {
                let rows = store.read_chain_rows(tenant, 1, 1000).await.unwrap();
                let verified = verify_chain(tenant, rows.clone(), Some((head.seq, head.hash)), &keys);
                prop_assert_eq!(verified, Ok(head.seq));
                prop_assert!(!rows.last().unwrap().sig.is_empty(), "the head is signed");
                chains.push((tenant, rows, (head.seq, head.hash)));
            }
            // Exactly: each append decided alone signs its last event and every 16th seq.
            let mut next = [1u64; 3];
            let mut expected = 0;
            for (t, _, n) in &appends {
                expected += (next[*t]..next[*t] + *n as u64 - 1).filter(|seq| seq % SIGNED_SEQ_INTERVAL != 0).count();
                next[*t] += *n as u64;
            }
            let unsigned = chains.iter().flat_map(|c| &c.1).filter(|r| r.sig.is_empty()).count();
            prop_assert_eq!(unsigned, expected);
            // Tamper with the largest chain and expect the first bad seq to be named.
            chains.sort_by_key(|c| std::cmp::Reverse(c.1.len()));
            let (tenant, mut rows, head) = chains.swap_remove(0);
            let n = rows.len();
            let expected_seq = match tamper {
                Tamper::Flip { field, event, byte, bit } => {
                    let i = event % n;
                    // Any stored byte: the hashed bytes, the hash, the signature, or a column.
                    // An event without a signature of its own has an empty `sig` and
                    // `key_id`: one is given a byte instead.
                    fn flip_text(text: &mut String, byte: usize, bit: u8) {
                        let mut bytes = std::mem::take(text).into_bytes();
                        if bytes.is_empty() {
                            bytes.push(b'x');
                        } else {
                            let at = byte % bytes.len();
                            bytes[at] ^= 1 << bit;
                        }
                        *text = String::from_utf8_lossy(&bytes).into_owned();
                    }
                    let row = &mut rows[i];
                    match field {
                        0..=2 => {
                            let target = match field {
                                0 => &mut row.canonical,
                                1 => &mut row.hash,
                                _ => &mut row.sig,
                            };
                            if target.is_empty() {
                                target.push(1 << bit);
                            } else {
                                let at = byte % target.len();
                                target[at] ^= 1 << bit;
                            }
                        }
                        3 => flip_text(&mut row.id, byte, bit),
                        4 => flip_text(&mut row.stream, byte, bit),
                        5 => flip_text(&mut row.event_type, byte, bit),
                        _ => flip_text(&mut row.key_id, byte, bit),
                    }
                    row.seq
                }
                Tamper::Delete { event } => {
                    let i = event % n;
                    rows.remove(i);
                    (i + 1) as u64
                }
                Tamper::Swap { a, b } => {
                    if n < 2 {
                        return Ok(());
                    }
                    let (a, b) = (a % n, b % n);
                    let (a, b) = if a == b { (a, (a + 1) % n) } else { (a.min(b), a.max(b)) };
                    let (a, b) = (a.min(b), a.max(b));
                    rows.swap(a, b);
                    (a + 1) as u64
                }
                Tamper::Strip { event } => {
                    let i = event % n;
                    rows[i].sig.clear();
                    rows[i].key_id.clear();
                    if bc_core::event::signed_alone(rows[i].seq, &rows[i].event_type) {
                        // Every 16th seq must carry its own.
                        (i + 1) as u64
                    } else if rows[i..].iter().any(|r| !r.sig.is_empty()) {
                        let verified = verify_chain(tenant, rows, Some(head), &keys);
                        prop_assert_eq!(verified, Ok(head.0), "a later signature covers seq {}", i + 1);
                        return Ok(());
                    } else {
                        // The first of the unsigned run the head ends.
                        rows.iter().rposition(|r| !r.sig.is_empty()).map_or(1, |signed| signed as u64 + 2)
                    }
                }
            };
            let problem = verify_chain(tenant, rows, Some(head), &keys).expect_err("tampering went unnoticed");
            prop_assert_eq!(problem.seq, expected_seq, "{}", problem);
            Ok(())
        })
    });
    if let Err(e) = result {
        panic!("property failed with BC_TEST_SEED={seed}: {e}");
    }
}
