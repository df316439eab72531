//! Property: the allocation-free checks (`canonical::validate`, `EventRow::check`) give exactly
//! the answers of the full decode (`decode_canonical`, `EventRow::decode`) on valid events and
//! on every kind of mutated bytes. Seeded: `BC_TEST_SEED` replays.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use bc_core::canonical;
use bc_core::event::{Envelope, EventRow, GENESIS_PREV, sha256};
use bc_core::id::{EventId, TenantId};
use ciborium::Value;
use proptest::prelude::*;

use crate::seeded;

fn payload() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        any::<u64>().prop_map(|v| Value::Integer(v.into())),
        any::<i64>().prop_map(|v| Value::Integer(v.into())),
        ".{0,30}".prop_map(Value::Text),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::Bytes),
        any::<bool>().prop_map(Value::Bool),
        Just(Value::Null),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("[a-z]{0,30}", inner), 0..6).prop_map(|kv| {
                let mut seen = std::collections::HashSet::new();
                Value::Map(kv.into_iter().filter(|(k, _)| seen.insert(k.clone())).map(|(k, v)| (Value::Text(k), v)).collect())
            }),
        ]
    })
}

#[derive(Clone, Debug)]
enum Mutation {
    None,
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Insert { at: usize, byte: u8 },
    Delete { at: usize },
    Truncate { at: usize },
    Append { byte: u8 },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        Just(Mutation::None),
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        any::<usize>().prop_map(|at| Mutation::Delete { at }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        any::<u8>().prop_map(|byte| Mutation::Append { byte }),
    ]
}

fn mutate(bytes: &mut Vec<u8>, m: &Mutation) {
    let n = bytes.len();
    match *m {
        Mutation::None => {}
        Mutation::Flip { at, bit } => bytes[at % n] ^= 1 << bit,
        Mutation::Set { at, byte } => bytes[at % n] = byte,
        Mutation::Insert { at, byte } => bytes.insert(at % (n + 1), byte),
        Mutation::Delete { at } => {
            bytes.remove(at % n);
        }
        Mutation::Truncate { at } => bytes.truncate(at % n),
        Mutation::Append { byte } => bytes.push(byte),
    }
}

#[test]
fn fast_checks_agree_with_the_full_decode() {
    let seed = bc_core::testing::seed();
    let mut runner = seeded::runner(seed, 2000);
    let result = runner.run(&(payload(), mutation(), any::<bool>(), any::<u64>()), |(payload, m, optional, seq)| {
        let env = Envelope {
            tenant: TenantId::generate(),
            seq: seq % 1_000_000 + 1,
            id: EventId::generate(),
            stream: "pool/x".into(),
            version: 3,
            event_type: "pool.created".into(),
            at_ms: 1_790_000_000_000,
            actor: "prop".into(),
            idempotency_key: optional.then(|| "k".to_owned()),
            causation: None,
            correlation: optional.then(|| "req".to_owned()),
            payload,
            prev: GENESIS_PREV,
        };
        let mut bytes = env.to_canonical().unwrap();
        mutate(&mut bytes, &m);
        prop_assert_eq!(
            canonical::validate(&bytes).is_ok(),
            canonical::decode_canonical(&bytes).is_ok(),
            "validate vs decode on {:?}",
            m
        );
        // Re-hash so the structural checks, not the hash, decide.
        let row = EventRow {
            tenant: env.tenant.to_string(),
            seq: env.seq,
            id: env.id.to_string(),
            stream: env.stream.clone(),
            version: env.version,
            event_type: env.event_type.clone(),
            commit: 1,
            index: 0,
            hash: sha256(&bytes).to_vec(),
            canonical: bytes,
            sig: vec![],
            key_id: "lk_0".into(),
        };
        let fast = row.check().map(|c| (c.hash, c.prev));
        let full = row.clone().decode().map(|e| (e.hash, e.envelope.prev));
        prop_assert_eq!(fast.is_ok(), full.is_ok(), "check vs decode on {:?}: {:?} / {:?}", m, fast, full);
        if let (Ok(a), Ok(b)) = (fast, full) {
            prop_assert_eq!(a, b);
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("property failed with BC_TEST_SEED={seed}: {e}");
    }
}

/// `id::is_canonical` (the allocation-free check of an event's ids, in the audit and every
/// decode) says yes exactly where an id parses
/// and displays as itself, on ids with a character changed, added or dropped.
#[test]
fn the_canonical_spelling_check_agrees_with_parse_and_display() {
    let seed = bc_core::testing::seed();
    let mut runner = seeded::runner(seed, 5000);
    let result = runner.run(&(any::<u128>(), mutation(), any::<bool>()), |(bits, m, tenant)| {
        let ulid = ulid::Ulid(bits);
        let mut bytes =
            if tenant { TenantId::from_ulid(ulid).to_string() } else { EventId::from_ulid(ulid).to_string() }.into_bytes();
        mutate(&mut bytes, &m);
        let Ok(text) = String::from_utf8(bytes) else { return Ok(()) };
        let (fast, full) = if tenant {
            (bc_core::id::is_canonical(&text, TenantId::PREFIX), text.parse::<TenantId>().is_ok_and(|id| id.to_string() == text))
        } else {
            (bc_core::id::is_canonical(&text, EventId::PREFIX), text.parse::<EventId>().is_ok_and(|id| id.to_string() == text))
        };
        prop_assert_eq!(fast, full, "{:?} after {:?}", text, m);
        Ok(())
    });
    if let Err(e) = result {
        panic!("property failed with BC_TEST_SEED={seed}: {e}");
    }
}
