//! Property: random appends across tenants always give chains that verify, and flipping any
//! byte of any stored event, deleting one or reordering two is detected at the first bad `seq`;
//! taking a signature away is harmless where a later one covers the event, caught where none does,
//! and always caught on a 16th `seq` (which must carry its own).
//! Seeded (`bc_core::testing::seed`: `BC_TEST_SEED`, else a fixed seed); a failure prints the
//! seed to replay it. The appends lean on one tenant with several events each, so the largest
//! chain passes seq 16 in most cases, and the tampering leans on the seqs that matter (every 16th,
//! the head); the run then asserts that each outcome was reached, or it tested little.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::cell::RefCell;
use std::collections::BTreeMap;
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

use crate::seeded;

/// Cases per run: enough that every outcome of [`OUTCOMES`] is reached several times over.
const CASES: u32 = 64;

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
    /// signed event covers it, caught at the first uncovered seq when none does (the head), and
    /// caught at once on a 16th seq.
    Strip {
        at: StripAt,
    },
}

/// Which event [`Tamper::Strip`] takes the signature of: uniform draws rarely land on the few
/// seqs where the answer differs, so the others aim at them.
#[derive(Clone, Debug)]
enum StripAt {
    Any(usize),
    /// A multiple of 16 (any event when the chain is shorter than 16).
    Sixteenth(usize),
    /// An event signed as the last of its append, neither a 16th seq nor the head: a later
    /// signature covers it (any event when there is none).
    Covered(usize),
    Head,
}

/// What the cases must reach between them, or the property tested little.
const OUTCOMES: [&str; 8] = [
    "a chain of 16 events or more",
    "a chain of 32 events or more",
    "a flipped bit located",
    "a deleted event located",
    "a swap located",
    "an unsigned 16th seq refused",
    "a signature taken away, covered by a later one",
    "the head's signature taken away, refused",
];

fn tamper() -> impl Strategy<Value = Tamper> {
    prop_oneof![
        3 => (0u8..7, any::<usize>(), any::<usize>(), 0u8..8).prop_map(|(field, event, byte, bit)| Tamper::Flip {
            field,
            event,
            byte,
            bit
        }),
        2 => any::<usize>().prop_map(|event| Tamper::Delete { event }),
        2 => (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Tamper::Swap { a, b }),
        1 => any::<usize>().prop_map(|event| Tamper::Strip { at: StripAt::Any(event) }),
        2 => any::<usize>().prop_map(|event| Tamper::Strip { at: StripAt::Sixteenth(event) }),
        2 => any::<usize>().prop_map(|event| Tamper::Strip { at: StripAt::Covered(event) }),
        2 => Just(Tamper::Strip { at: StripAt::Head }),
    ]
}

/// (tenant, stream, events) triples: most appends go to tenant 0, several events each (about 35
/// events in all on average), so its chain passes 16 in most cases and 32 in some.
fn appends() -> impl Strategy<Value = Vec<(usize, usize, usize)>> {
    let tenant = prop_oneof![3 => Just(0usize), 1 => 0usize..3];
    prop::collection::vec((tenant, 0usize..3, 1usize..8), 2..16)
}

#[test]
fn chains_verify_and_tampering_is_located() {
    let seed = bc_core::testing::seed();
    let mut runner = seeded::runner(seed, CASES);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let reached: RefCell<BTreeMap<&'static str, u32>> = RefCell::default();
    let reach = |outcome: &'static str| *reached.borrow_mut().entry(outcome).or_default() += 1;
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
            if n >= 16 {
                reach("a chain of 16 events or more");
            }
            if n >= 32 {
                reach("a chain of 32 events or more");
            }
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
                    reach("a flipped bit located");
                    row.seq
                }
                Tamper::Delete { event } => {
                    let i = event % n;
                    rows.remove(i);
                    reach("a deleted event located");
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
                    reach("a swap located");
                    (a + 1) as u64
                }
                Tamper::Strip { at } => {
                    let sixteenths = n / SIGNED_SEQ_INTERVAL as usize;
                    let i = match at {
                        StripAt::Any(event) => event % n,
                        StripAt::Sixteenth(k) if sixteenths > 0 => (k % sixteenths + 1) * SIGNED_SEQ_INTERVAL as usize - 1,
                        StripAt::Covered(k) => {
                            let covered: Vec<usize> = (0..n - 1)
                                .filter(|&i| !rows[i].sig.is_empty() && rows[i].seq % SIGNED_SEQ_INTERVAL != 0)
                                .collect();
                            if covered.is_empty() { k % n } else { covered[k % covered.len()] }
                        }
                        StripAt::Sixteenth(event) => event % n,
                        StripAt::Head => n - 1,
                    };
                    let had_signature = !rows[i].sig.is_empty();
                    rows[i].sig.clear();
                    rows[i].key_id.clear();
                    if bc_core::event::signed_alone(rows[i].seq, &rows[i].event_type) {
                        // Every 16th seq must carry its own.
                        prop_assert_eq!(rows[i].seq % SIGNED_SEQ_INTERVAL, 0);
                        reach("an unsigned 16th seq refused");
                        (i + 1) as u64
                    } else if rows[i..].iter().any(|r| !r.sig.is_empty()) {
                        let verified = verify_chain(tenant, rows, Some(head), &keys);
                        prop_assert_eq!(verified, Ok(head.0), "a later signature covers seq {}", i + 1);
                        if had_signature {
                            reach("a signature taken away, covered by a later one");
                        }
                        return Ok(());
                    } else {
                        reach("the head's signature taken away, refused");
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
    let reached = reached.into_inner();
    eprintln!("seed {seed}: {CASES} cases reached {reached:?}");
    for outcome in OUTCOMES {
        assert!(
            reached.contains_key(outcome),
            "seed {seed} (BC_TEST_SEED={seed} repeats it): no case reached {outcome:?}; reached {reached:?}"
        );
    }
}
