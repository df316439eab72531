//! `bc-simulator`: the deterministic simulator and incident replay. Two halves:
//! export and replay (a tenant's chain written as a self-verifying file, and that file verified
//! and folded back into the tenant's projection rows at any seq, with the real chain verifier
//! and the real fold), and `sim run` (one seeded world of the real log, decisions, reservations
//! reconciler and agents' runners on a virtual clock, with a workload, faults and invariants).
//! Nothing here decides or folds on its own. It depends on `bc-core`, `bc-projections`,
//! `bc-reconcilers` (the passes it runs), `bc-agent` (the runner and the session machine it
//! runs) and `bc-gateway` for the gateway's side of the agents' session alone
//! (`agents::session`: its functions, never its server).
//!
//! **Invariants.** A run is a function of its seed and options: one thread, a virtual clock,
//! ids and randomness from the seed, no wall clock (clippy bans it here), so the same seed gives
//! the same digest in any process. The reconcilers it activates are the registry's, in the
//! registry's order. Export, replay, the oracle, the timeline and the report are pure over
//! their inputs; the invariants are checked after every step, against a reference model
//! written from `schema/EVENTS.md` apart from the fold.
//!
//! `better-compute events export` and `better-compute sim replay` (`cli/src/sim.rs`) are the
//! commands; they own the files (a temporary file, fsynced, renamed: exports, rows, reports)
//! and the terminal.

pub mod export;
pub mod format;
pub mod oracle;
pub mod replay;
pub mod report;
pub mod run;
pub mod timeline;
pub mod whatif;
pub mod world;

pub use replay::{ReplayError, Replayed, replay};

#[cfg(test)]
mod checker_tests;

#[cfg(test)]
mod tests {
    //! Files made here, event by event, with a known key; then tampered with, byte by byte.
    use bc_core::event::{Envelope, GENESIS_PREV, sha256};
    use bc_core::id::TenantId;
    use bc_core::keys::LogKey;
    use ciborium::Value;

    use crate::format::{Header, Record, encode_item};
    use crate::replay::{self, EXPORT_MALFORMED, EXPORT_TAMPERED, EXPORT_TRUNCATED, EXPORT_UNTRUSTED_KEY};

    const EVENTS: u64 = 4;

    fn pool_created(seq: u64, prev: [u8; 32]) -> Envelope {
        let text = |s: &str| Value::Text(s.into());
        Envelope {
            tenant: TenantId::ROOT,
            seq,
            id: format!("evt_01jd00000000000000000000{seq:02}").parse().expect("an event id"),
            stream: format!("pool/pool_01jd00000000000000000000{seq:02}"),
            version: 1,
            event_type: "pool.created".into(),
            at_ms: 1_790_000_000_000 + seq,
            actor: "system".into(),
            idempotency_key: None,
            causation: None,
            correlation: None,
            payload: Value::Map(vec![
                (text("name"), text(&format!("gpu-{seq}"))),
                (text("description"), text("")),
                (text("labels"), Value::Map(vec![])),
            ]),
            prev,
        }
    }

    /// `EVENTS` pools created, signed by `key`, as records in chain order.
    fn records(key: &LogKey) -> Vec<Record> {
        let mut prev = GENESIS_PREV;
        (1..=EVENTS)
            .map(|seq| {
                let event = pool_created(seq, prev).to_canonical().unwrap();
                let hash = sha256(&event);
                let record = Record {
                    seq,
                    hash: hash.to_vec(),
                    prev: prev.to_vec(),
                    sig: key.sign_event_hash(&hash).to_vec(),
                    key_id: key.key_id().to_owned(),
                    commit: seq,
                    index: 0,
                    event,
                };
                prev = hash;
                record
            })
            .collect()
    }

    fn file(keys: &[&LogKey], records: &[Record]) -> Vec<u8> {
        let header = Header {
            tenant: TenantId::ROOT.to_string(),
            from_seq: 1,
            to_seq: EVENTS,
            prev_hash: GENESIS_PREV,
            last_hash: <[u8; 32]>::try_from(records.last().unwrap().hash.as_slice()).unwrap_or([0; 32]),
            keys: keys.iter().map(|k| (k.key_id().to_owned(), *k.public().as_bytes())).collect(),
            rotations: bc_core::note::encode_rotations(&[]),
        };
        let mut out = encode_item(header.to_cbor()).unwrap();
        for r in records {
            out.extend(encode_item(r.to_cbor()).unwrap());
        }
        out
    }

    fn key() -> LogKey {
        LogKey::from_seed([7; 32])
    }

    fn refused(bytes: &[u8], pin: &str) -> replay::ReplayError {
        replay::replay(&mut &bytes[..], pin, None).expect_err("the file must be refused")
    }

    #[test]
    fn an_honest_file_replays_to_its_rows_at_any_seq() {
        let key = key();
        let bytes = file(&[&key], &records(&key));
        let all = replay::replay(&mut &bytes[..], &key.pin(), None).unwrap();
        assert_eq!((all.events_verified, all.at_seq), (EVENTS, EVENTS));
        assert_eq!(all.counts().get("pool"), Some(&EVENTS));
        assert_eq!(all.key_ids, vec![key.key_id().to_owned()]);
        let early = replay::replay(&mut &bytes[..], &key.pin(), Some(2)).unwrap();
        assert_eq!(early.events_verified, EVENTS, "the whole file is verified whatever --until");
        assert_eq!(early.counts().get("pool"), Some(&2));
        assert_ne!(early.digest(), all.digest());
        assert_eq!(all.digest(), replay::replay(&mut &bytes[..], &key.pin(), None).unwrap().digest(), "the digest is stable");
        let outside = replay::replay(&mut &bytes[..], &key.pin(), Some(EVENTS + 1)).unwrap_err();
        assert_eq!(outside.code, replay::REPLAY_UNTIL_OUTSIDE);
    }

    /// The records before the last carry no signature of their own, as the appender writes
    /// one batch: the file replays; with the last signature taken away it is refused at the
    /// first uncovered seq.
    #[test]
    fn records_a_later_signature_covers_replay_and_a_stripped_last_one_is_refused() {
        let key = key();
        let mut records = records(&key);
        let last = records.len() - 1;
        for r in &mut records[..last] {
            (r.sig, r.key_id) = (Vec::new(), String::new());
        }
        let replayed = replay::replay(&mut &file(&[&key], &records)[..], &key.pin(), None).unwrap();
        assert_eq!((replayed.events_verified, replayed.counts().get("pool")), (EVENTS, Some(&EVENTS)));
        (records[last].sig, records[last].key_id) = (Vec::new(), String::new());
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(1)), "{e}");
        assert!(e.message.contains("no signature covers seq 1"), "{e}");
        // A keyId with an empty sig is not how a record says it has none.
        records[0].key_id = key.key_id().to_owned();
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_MALFORMED, Some(1)), "{e}");
    }

    #[test]
    fn a_flipped_payload_byte_is_refused_at_its_seq() {
        let key = key();
        let mut records = records(&key);
        // The last byte of the envelope is inside its payload's text or the version: flip a
        // byte of the pool's name instead, found by its text.
        let event = &mut records[2].event;
        let at = event.windows(5).position(|w| w == b"gpu-3").expect("the name") + 4;
        event[at] ^= 0x01;
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(3)), "{e}");
        assert!(e.message.contains("hash"), "{e}");
    }

    #[test]
    fn a_re_hashed_payload_is_refused_by_its_signature_and_a_broken_link_by_the_next() {
        let key = key();
        // Changed and hashed again: the hash matches, the signature does not.
        let mut records = records(&key);
        let event = &mut records[1].event;
        let at = event.windows(5).position(|w| w == b"gpu-2").expect("the name") + 4;
        event[at] ^= 0x01;
        records[1].hash = sha256(&records[1].event).to_vec();
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(2)), "{e}");
        assert!(e.message.contains("signature"), "{e}");
        // A record left out: the next one's prev names a hash the chain never had.
        let mut records = self::records(&key);
        records.remove(1);
        for (i, r) in records.iter_mut().enumerate() {
            r.seq = i as u64 + 1;
        }
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(2)), "{e}");
        // The record's own seq renumbered does not match its envelope.
        let mut records = self::records(&key);
        records.swap(1, 2);
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(2)), "{e}");
        // The record's prev copy disagreeing with its envelope.
        let mut records = self::records(&key);
        records[3].prev = vec![1; 32];
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(4)), "{e}");
    }

    #[test]
    fn a_record_signed_by_another_key_is_refused_and_so_is_a_file_the_pin_does_not_vouch_for() {
        let (key, other) = (key(), LogKey::from_seed([8; 32]));
        let mut records = records(&key);
        let hash = <[u8; 32]>::try_from(records[2].hash.as_slice()).unwrap();
        records[2].sig = other.sign_event_hash(&hash).to_vec();
        records[2].key_id = other.key_id().to_owned();
        // The file names both keys; the pin vouches for one.
        let e = refused(&file(&[&key, &other], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(3)), "{e}");
        assert!(e.message.contains(other.key_id()), "{e}");
        // The same signature under the honest key's id.
        records[2].key_id = key.key_id().to_owned();
        let e = refused(&file(&[&key], &records), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TAMPERED, Some(3)), "{e}");
        // A whole file of another log.
        let e = refused(&file(&[&other], &self::records(&other)), &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_UNTRUSTED_KEY, None), "{e}");
    }

    #[test]
    fn a_cut_file_and_a_foreign_one_are_refused() {
        let key = key();
        let records = records(&key);
        let bytes = file(&[&key], &records[..3]);
        let e = refused(&bytes, &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_TRUNCATED, Some(4)), "{e}");
        let whole = file(&[&key], &records);
        let e = refused(&whole[..whole.len() - 10], &key.pin());
        assert_eq!((e.code, e.seq), (EXPORT_MALFORMED, Some(4)), "{e}");
        let e = refused(b"not an export at all", &key.pin());
        assert_eq!(e.code, EXPORT_MALFORMED, "{e}");
    }
}
