//! Tampering with a real database of each backend, by editing stored rows directly: `verify`
//! names each change, and proofs against a forged checkpoint are rejected offline. Every check
//! is made twice, the second time remembering the signatures a verification of the honest log
//! found good (`audit::verify_with`, as the simulator's full checks do): remembering may skip
//! arithmetic, never a change.

use std::sync::Arc;

use bc_core::audit::{self, Trust};
use bc_core::clock::{Clock, SystemClock};
use bc_core::event::{Envelope, sha256};
use bc_core::id::TenantId;
use bc_core::keys::{LogKey, VerifiedSignatures};
use bc_core::note;
use bc_core::store::postgres::PostgresStore;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_core::testing::ScratchDatabase;
use bc_projections::Projections;
use ciborium::Value;

const DEPLOYMENT: &str = "tamper-test";

enum Raw {
    Sqlite(sqlx::SqlitePool, #[allow(dead_code)] tempfile::TempDir),
    Postgres(deadpool_postgres::Pool, #[allow(dead_code)] ScratchDatabase),
}

impl Raw {
    fn blob(&self, bytes: &[u8]) -> String {
        match self {
            Raw::Sqlite(..) => format!("X'{}'", hex(bytes)),
            Raw::Postgres(..) => format!("'\\x{}'::bytea", hex(bytes)),
        }
    }

    async fn exec(&self, sql: &str) {
        match self {
            Raw::Sqlite(pool, _) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).execute(pool).await.unwrap();
            }
            Raw::Postgres(pool, _) => pool.get().await.unwrap().batch_execute(sql).await.unwrap(),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

struct Fixture {
    store: Arc<dyn EventStore>,
    raw: Raw,
    /// Kept so the appender outlives the fixture's setup.
    _log: Log,
    key: Arc<LogKey>,
    tenant: TenantId,
    /// The checkpoint note sealed at size 10, which an auditor saved.
    saved: String,
    /// The signatures a verification of the honest log found good.
    verified: Arc<VerifiedSignatures>,
}

fn request(tenant: TenantId, i: u64) -> AppendRequest {
    AppendRequest {
        tenant,
        stream: format!("pool/pool_{:026}", i),
        expected: ExpectedVersion::Any,
        idempotency_key: None,
        actor: "test".into(),
        causation: None,
        correlation: None,
        fingerprint: None,
        guards: vec![],
        events: vec![NewEvent {
            stream: None,
            event_type: "pool.created".into(),
            payload: Value::Map(vec![
                (Value::Text("name".into()), Value::Text(format!("p{i}"))),
                (Value::Text("description".into()), Value::Text(String::new())),
                (Value::Text("labels".into()), Value::Map(vec![])),
            ]),
        }],
    }
}

/// 10 events, a checkpoint (seq 11), 9 more, a checkpoint (seq 21), 2 more in one append: 23
/// events, every one signed but seq 22 (the last of an append is; seq 23 covers 22).
async fn fixture(postgres: bool) -> Fixture {
    let (store, raw): (Arc<dyn EventStore>, Raw) = if postgres {
        let db = ScratchDatabase::create().await.expect("PostgreSQL");
        let store = PostgresStore::connect(&db.url).await.unwrap();
        let pool = store.pool().clone();
        (Arc::new(store), Raw::Postgres(pool, db))
    } else {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("t.sqlite3")).await.unwrap();
        let pool = store.pool().clone();
        (Arc::new(store), Raw::Sqlite(pool, dir))
    };
    store.migrate().await.unwrap();
    let key = Arc::new(LogKey::generate());
    let log = Log::open(store.clone(), Arc::new(Projections), key.clone(), Arc::new(SystemClock)).await.unwrap();
    let tenant = TenantId::generate();
    for i in 0..10 {
        log.append(request(tenant, i)).await.unwrap();
    }
    let saved =
        audit::seal(&log, tenant, DEPLOYMENT, &Trust::of(&[key.public()], DEPLOYMENT).unwrap()).await.unwrap().unwrap().note;
    for i in 10..19 {
        log.append(request(tenant, i)).await.unwrap();
    }
    let second = audit::seal(&log, tenant, DEPLOYMENT, &Trust::of(&[key.public()], DEPLOYMENT).unwrap()).await.unwrap().unwrap();
    assert_eq!(second.size, 20);
    let mut pair = request(tenant, 19);
    pair.events.push(request(tenant, 20).events.remove(0));
    log.append(pair).await.unwrap();
    let verified = Arc::new(VerifiedSignatures::default());
    let f = Fixture { store, raw, _log: log, key, tenant, saved, verified };
    let report = verify(&f).await;
    assert!(report.problems.is_empty(), "honest log: {:?}", report.problems);
    assert_eq!((report.events, report.checkpoints), (23, 2));
    // Every event's signature, and no other, is remembered: 22 of them.
    assert!(row(&f, 22).await.sig.is_empty() && row(&f, 22).await.key_id.is_empty());
    assert_eq!(f.verified.len(), 22);
    f
}

/// Verifies from scratch, and again remembering what the honest log's verification found good:
/// both name the same problems.
async fn verify(f: &Fixture) -> audit::Report {
    let trust = Trust::of(&[f.key.public()], DEPLOYMENT).unwrap();
    let fresh = audit::verify(&f.store, &trust, None, &|_| {}).await.unwrap();
    let remembered = audit::verify_with(&f.store, &trust, None, &|_| {}, Some(f.verified.clone())).await.unwrap();
    let problems = |r: &audit::Report| r.problems.iter().map(|p| (p.seq, p.what.clone())).collect::<Vec<_>>();
    assert_eq!(problems(&remembered), problems(&fresh), "remembering signatures changed what verify found");
    assert_eq!((remembered.events, remembered.checkpoints), (fresh.events, fresh.checkpoints));
    fresh
}

async fn first_problem(f: &Fixture) -> (u64, String) {
    let report = verify(f).await;
    let p = report.problems.first().unwrap_or_else(|| panic!("tampering went unnoticed"));
    (p.seq, p.what.clone())
}

async fn row(f: &Fixture, seq: u64) -> bc_core::event::EventRow {
    f.store.read_chain_rows(f.tenant, seq, 1).await.unwrap().remove(0)
}

async fn each_backend(case: impl AsyncFn(Fixture)) {
    case(fixture(false).await).await;
    case(fixture(true).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_payload_byte_is_named() {
    each_backend(async |f: Fixture| {
        let mut canonical = row(&f, 5).await.canonical;
        let at = canonical.len() - 3; // inside the payload's last text
        canonical[at] ^= 0x01;
        f.raw
            .exec(&format!(
                "UPDATE events SET canonical = {} WHERE tenant_id = '{}' AND seq = 5",
                f.raw.blob(&canonical),
                f.tenant
            ))
            .await;
        let (seq, what) = first_problem(&f).await;
        assert_eq!(seq, 5, "{what}");
        assert!(what.contains("hash"), "{what}");
    })
    .await;
}

/// Seq 22 carries no signature of its own; seq 23's covers it. Rewriting 22 with every hash
/// after it recomputed is caught by that signature; taking 23's away leaves both uncovered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_without_a_signature_is_covered_by_the_next_one() {
    each_backend(async |f: Fixture| {
        let (r22, r23) = (row(&f, 22).await, row(&f, 23).await);
        let mut env = Envelope::from_canonical(&r22.canonical).unwrap();
        env.payload = Value::Map(vec![(Value::Text("name".into()), Value::Text("forged".into()))]);
        let canonical = env.to_canonical().unwrap();
        let hash = sha256(&canonical);
        let mut next = Envelope::from_canonical(&r23.canonical).unwrap();
        next.prev = hash;
        let next_canonical = next.to_canonical().unwrap();
        let next_hash = sha256(&next_canonical);
        f.raw
            .exec(&format!(
                "UPDATE events SET canonical = {}, hash = {} WHERE tenant_id = '{}' AND seq = 22;
                 UPDATE events SET canonical = {}, hash = {} WHERE tenant_id = '{}' AND seq = 23;
                 UPDATE chain_heads SET hash = {} WHERE tenant_id = '{}'",
                f.raw.blob(&canonical),
                f.raw.blob(&hash),
                f.tenant,
                f.raw.blob(&next_canonical),
                f.raw.blob(&next_hash),
                f.tenant,
                f.raw.blob(&next_hash),
                f.tenant
            ))
            .await;
        let (seq, what) = first_problem(&f).await;
        assert_eq!(seq, 23, "{what}");
        assert!(what.contains("signature does not verify"), "{what}");
        // Put them back, then take the head's signature away.
        f.raw
            .exec(&format!(
                "UPDATE events SET canonical = {}, hash = {} WHERE tenant_id = '{}' AND seq = 22;
                 UPDATE events SET canonical = {}, hash = {}, sig = {}, key_id = '' WHERE tenant_id = '{}' AND seq = 23;
                 UPDATE chain_heads SET hash = {} WHERE tenant_id = '{}'",
                f.raw.blob(&r22.canonical),
                f.raw.blob(&r22.hash),
                f.tenant,
                f.raw.blob(&r23.canonical),
                f.raw.blob(&r23.hash),
                f.raw.blob(&[]),
                f.tenant,
                f.raw.blob(&r23.hash),
                f.tenant
            ))
            .await;
        let (seq, what) = first_problem(&f).await;
        assert_eq!(seq, 22, "{what}");
        assert!(what.contains("no signature covers seq 22 to 23"), "{what}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_event_is_named() {
    each_backend(async |f: Fixture| {
        f.raw.exec(&format!("DELETE FROM events WHERE tenant_id = '{}' AND seq = 7", f.tenant)).await;
        let (seq, what) = first_problem(&f).await;
        assert_eq!(seq, 7, "{what}");
        assert!(what.contains("missing"), "{what}");
    })
    .await;
}

/// A page of a chain is its first `limit` stored rows from a seq, whatever gaps a tampered chain
/// has (PostgreSQL reads the range `[from, from + limit)` first, and past it only when the range
/// is short): every start and page size over a chain with a gap of one and a gap of five.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_a_chain_reads_past_its_gaps() {
    each_backend(async |f: Fixture| {
        f.raw.exec(&format!("DELETE FROM events WHERE tenant_id = '{}' AND (seq = 5 OR seq BETWEEN 8 AND 12)", f.tenant)).await;
        let stored: Vec<u64> = (1..=23).filter(|s| *s != 5 && !(8..=12).contains(s)).collect();
        for limit in [1u32, 2, 3, 4, 7, 30] {
            for from in 1..=25u64 {
                let page: Vec<u64> =
                    f.store.read_chain_rows(f.tenant, from, limit).await.unwrap().iter().map(|r| r.seq).collect();
                let expected: Vec<u64> = stored.iter().copied().filter(|s| *s >= from).take(limit as usize).collect();
                assert_eq!(page, expected, "from seq {from}, limit {limit}");
            }
        }
        // Another tenant's chain is not read.
        assert!(f.store.read_chain_rows(TenantId::generate(), 1, 30).await.unwrap().is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_events_are_named() {
    each_backend(async |f: Fixture| {
        let (a, b) = (row(&f, 3).await, row(&f, 4).await);
        for (seq, other) in [(3, &b), (4, &a)] {
            f.raw
                .exec(&format!(
                    "UPDATE events SET canonical = {}, hash = {}, sig = {} WHERE tenant_id = '{}' AND seq = {seq}",
                    f.raw.blob(&other.canonical),
                    f.raw.blob(&other.hash),
                    f.raw.blob(&other.sig),
                    f.tenant
                ))
                .await;
        }
        let (seq, what) = first_problem(&f).await;
        assert_eq!(seq, 3, "{what}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_tail_is_named() {
    each_backend(async |f: Fixture| {
        f.raw.exec(&format!("DELETE FROM events WHERE tenant_id = '{}' AND seq > 21", f.tenant)).await;
        let (seq, what) = first_problem(&f).await;
        assert_eq!(seq, 22, "{what}");
        // Rewinding the head too leaves a checkpoint beyond the log's end.
        f.raw.exec(&format!("DELETE FROM events WHERE tenant_id = '{}' AND seq > 15", f.tenant)).await;
        let last = row(&f, 15).await;
        f.raw
            .exec(&format!("UPDATE chain_heads SET seq = 15, hash = {} WHERE tenant_id = '{}'", f.raw.blob(&last.hash), f.tenant))
            .await;
        let report = verify(&f).await;
        assert!(report.problems.iter().any(|p| p.what.contains("beyond the end")), "{:?}", report.problems);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_checkpoint_is_named() {
    each_backend(async |f: Fixture| {
        // Put the older (validly signed) note in the newer checkpoint's row.
        let doc = serde_json::json!({ "treeSize": 20, "note": f.saved, "seq": 21, "sealedAtMs": 0 }).to_string();
        f.raw
            .exec(&format!(
                "UPDATE projections SET doc = '{}' WHERE tenant_id = '{}' AND kind = 'checkpoint' AND id = '{}'",
                doc.replace('\'', "''"),
                f.tenant,
                audit::checkpoint_row_id(20)
            ))
            .await;
        let report = verify(&f).await;
        assert!(
            report.problems.iter().any(|p| p.seq == 20 && p.what.contains("another tenant or size")),
            "{:?}",
            report.problems
        );
        assert!(report.problems.iter().any(|p| p.seq == 21 && p.what.contains("no longer stored")), "{:?}", report.problems);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewinding_to_an_older_checkpoint_is_named() {
    each_backend(async |f: Fixture| {
        f.raw
            .exec(&format!(
                "DELETE FROM projections WHERE tenant_id = '{}' AND kind = 'checkpoint' AND id = '{}'",
                f.tenant,
                audit::checkpoint_row_id(20)
            ))
            .await;
        let report = verify(&f).await;
        assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
        assert_eq!(report.problems[0].seq, 21);
        assert!(report.problems[0].what.contains("no longer stored"));
        // Regression (review): sealing once signed on top of a log that verify rejects.
        let trust = Trust::of(&[f.key.public()], DEPLOYMENT).unwrap();
        let err = audit::seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap_err();
        assert!(err.to_string().contains("missing from the store"), "{err}");
    })
    .await;
}

/// An attacker rewrites history from seq 3 and re-signs every event and a checkpoint with a key
/// of their own, which they also slip into `signing_keys`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_re_signed_with_another_key_is_rejected() {
    each_backend(async |f: Fixture| {
        // A proof made before the forgery, against the honest checkpoint of size 20.
        let vkey = audit::vkey_of(&f.key, DEPLOYMENT).unwrap();
        let event = row(&f, 3).await;
        let honest = audit::prove(&*f.store, f.tenant, event.id.parse().unwrap(), &vkey, None).await.unwrap().0.encode();
        let pin = f.key.pin();
        audit::check_proof(&honest, None, None, std::slice::from_ref(&pin), &[]).expect("honest proof");

        let evil = LogKey::generate();
        f.raw
            .exec(&format!(
                "INSERT INTO signing_keys (key_id, public_key, created_at_ms) VALUES ('{}', {}, 0)",
                evil.key_id(),
                f.raw.blob(evil.public().as_bytes())
            ))
            .await;
        let mut prev = row(&f, 2).await.hash;
        let head = f.store.heads().await.unwrap().into_iter().find(|(t, _)| *t == f.tenant).unwrap().1;
        for seq in 3..=head.seq {
            let r = row(&f, seq).await;
            let mut env = Envelope::from_canonical(&r.canonical).unwrap();
            if seq == 3 {
                env.payload = Value::Map(vec![(Value::Text("name".into()), Value::Text("forged".into()))]);
            }
            env.prev = prev.clone().try_into().unwrap();
            let canonical = env.to_canonical().unwrap();
            let hash = sha256(&canonical);
            let sig = evil.sign_event_hash(&hash);
            f.raw
                .exec(&format!(
                    "UPDATE events SET canonical = {}, hash = {}, sig = {}, key_id = '{}' WHERE tenant_id = '{}' AND seq = {seq}",
                    f.raw.blob(&canonical),
                    f.raw.blob(&hash),
                    f.raw.blob(&sig),
                    evil.key_id(),
                    f.tenant
                ))
                .await;
            prev = hash.to_vec();
        }
        f.raw.exec(&format!("UPDATE chain_heads SET hash = {} WHERE tenant_id = '{}'", f.raw.blob(&prev), f.tenant)).await;
        let (seq, what) = first_problem(&f).await;
        assert_eq!(seq, 3, "{what}");
        assert!(what.contains("untrusted key"), "{what}");

        // The attacker's own checkpoint over the forged tree, and a proof against it.
        let forged_leaves: Vec<_> = f
            .store
            .read_chain_rows(f.tenant, 1, 100)
            .await
            .unwrap()
            .iter()
            .take(20)
            .map(|r| bc_core::merkle::leaf_hash(&r.hash))
            .collect();
        let body = note::CheckpointBody {
            origin: note::origin_of(DEPLOYMENT, &f.tenant),
            size: 20,
            root: bc_core::merkle::root(&forged_leaves),
        };
        let forged_note = note::sign_note(&body.encode(), DEPLOYMENT, &evil).unwrap();
        let forged = note::ProofFile {
            event: row(&f, 3).await.canonical,
            vkey: audit::vkey_of(&evil, DEPLOYMENT).unwrap().encode(),
            index: 2,
            path: bc_core::merkle::inclusion_proof(2, &forged_leaves).unwrap(),
            checkpoint: forged_note.clone(),
            rotations: vec![],
        };
        let err = audit::check_proof(&forged.encode(), None, None, std::slice::from_ref(&pin), &[]).unwrap_err();
        assert!(err.contains("not signed by a trusted key"), "{err}");
        // Even with the honest key's vkey swapped in, the forged checkpoint's signature fails.
        let mut swapped = forged.clone();
        swapped.vkey = vkey.encode();
        assert!(audit::check_proof(&swapped.encode(), None, None, std::slice::from_ref(&pin), &[]).is_err());
        // The honest proof made before tampering still checks offline, and the log can no
        // longer prove consistency with the checkpoint the auditor saved.
        audit::check_proof(&honest, None, None, std::slice::from_ref(&pin), &[]).expect("offline proof unaffected");
        let again = audit::prove(&*f.store, f.tenant, event.id.parse().unwrap(), &vkey, Some(&f.saved)).await;
        assert!(again.is_err(), "proving against a forged log must fail");
    })
    .await;
}

/// Regression (review): sealing once signed over rows whose hashes matched but whose
/// signatures did not; it must refuse a log that does not verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealing_refuses_a_log_that_does_not_verify() {
    each_backend(async |f: Fixture| {
        // Rewrite seq 22 with a consistent hash but no valid signature.
        rewrite(&f, 22).await;
        // New events still chain onto the stored head, so the log "grew" since the last seal.
        f._log.append(request(f.tenant, 99)).await.unwrap();
        let trust = Trust::of(&[f.key.public()], DEPLOYMENT).unwrap();
        let err = audit::seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap_err();
        assert!(err.to_string().contains("refusing to seal"), "{err}");
    })
    .await;
}

/// Regression (review): a deleted chain head once hid a tenant's whole chain from `verify`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_chain_head_does_not_hide_a_tenant() {
    each_backend(async |f: Fixture| {
        f.raw.exec(&format!("DELETE FROM chain_heads WHERE tenant_id = '{}'", f.tenant)).await;
        let report = verify(&f).await;
        assert_eq!(report.tenants, 1);
        assert!(report.problems.iter().any(|p| p.what.contains("past the chain head")), "{:?}", report.problems);
        // Nor do every tenant's heads gone: the store finds the tenants in the events and the
        // projection rows themselves, one after another.
        let mut tenants = vec![f.tenant];
        for i in 0..3 {
            let tenant = TenantId::generate();
            f._log.append(request(tenant, i)).await.unwrap();
            tenants.push(tenant);
        }
        f.raw.exec("DELETE FROM chain_heads").await;
        tenants.sort_by_key(|t| t.to_string());
        assert_eq!(f.store.tenants().await.unwrap(), tenants);
        assert_eq!(verify(&f).await.tenants, 4);
        // A tenant whose events are gone too is still found by its projection rows; with the
        // projection rows gone as well, the tenants with events are found by those alone.
        let emptied = tenants.remove(1);
        f.raw.exec(&format!("DELETE FROM events WHERE tenant_id = '{emptied}'")).await;
        let mut all = tenants.clone();
        all.insert(1, emptied);
        assert_eq!(f.store.tenants().await.unwrap(), all);
        f.raw.exec("DELETE FROM projections").await;
        assert_eq!(f.store.tenants().await.unwrap(), tenants);
    })
    .await;
}

/// Rewrites the event at `seq` with another payload and a hash that matches it (the signature,
/// made over the old hash, no longer does).
async fn rewrite(f: &Fixture, seq: u64) {
    let r = row(f, seq).await;
    let mut env = Envelope::from_canonical(&r.canonical).unwrap();
    env.payload = Value::Text("forged".into());
    let canonical = env.to_canonical().unwrap();
    let hash = sha256(&canonical);
    f.raw
        .exec(&format!(
            "UPDATE events SET canonical = {}, hash = {} WHERE tenant_id = '{}' AND seq = {seq}",
            f.raw.blob(&canonical),
            f.raw.blob(&hash),
            f.tenant
        ))
        .await;
}

/// The tree's root in a sealed checkpoint's note.
fn root_of(f: &Fixture, cp: &audit::StoredCheckpoint) -> [u8; 32] {
    let vkey = audit::vkey_of(&f.key, DEPLOYMENT).unwrap();
    note::CheckpointBody::parse(&note::open_note(&cp.note, &vkey).unwrap()).unwrap().root
}

/// The checkpoints reconciler's sealer walks a chain from seq 1 once, then only the events
/// appended since. A row rewritten in the part it already verified is never signed over: the
/// checkpoint it seals extends the tree it verified, and a walk from seq 1 refuses the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealer_walks_only_what_was_appended_and_never_signs_over_a_rewritten_row() {
    each_backend(async |f: Fixture| {
        let trust = Trust::of(&[f.key.public()], DEPLOYMENT).unwrap();
        let mut sealer = audit::Sealer::default();
        let first = sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed");
        assert_eq!(first.size, 23);
        assert_eq!((sealer.walks_from_start(), sealer.events_walked()), (1, 23));
        // Nothing grew: nothing sealed, and only the checkpoint just appended is walked.
        assert!(sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap().is_none());
        assert_eq!((sealer.walks_from_start(), sealer.events_walked()), (1, 24));
        let honest = audit::leaves(&*f.store, f.tenant, 24).await.unwrap();
        for i in 0..3 {
            f._log.append(request(f.tenant, 100 + i)).await.unwrap();
        }
        let second = sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed");
        assert_eq!(second.size, 27);
        assert_eq!((sealer.walks_from_start(), sealer.events_walked()), (1, 27));
        assert_eq!(root_of(&f, &second), bc_core::merkle::root(&audit::leaves(&*f.store, f.tenant, 27).await.unwrap()));
        let report = verify(&f).await;
        assert!(report.problems.is_empty(), "{:?}", report.problems);
        assert_eq!(report.checkpoints, 4);

        rewrite(&f, 5).await;
        f._log.append(request(f.tenant, 200)).await.unwrap();
        let third = sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed");
        assert_eq!(third.size, 29);
        assert_eq!((sealer.walks_from_start(), sealer.events_walked()), (1, 29));
        let now = audit::leaves(&*f.store, f.tenant, 29).await.unwrap();
        let mut expected = honest.clone();
        expected.extend_from_slice(&now[24..]);
        assert_eq!(root_of(&f, &third), bc_core::merkle::root(&expected), "the checkpoint is the honest tree's");
        assert_ne!(bc_core::merkle::root(&now), bc_core::merkle::root(&expected));
        assert_eq!(first_problem(&f).await.0, 5);
        f._log.append(request(f.tenant, 201)).await.unwrap();
        let err = audit::seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap_err();
        assert!(err.to_string().contains("refusing to seal"), "{err}");
    })
    .await;
}

/// A row rewritten past what the sealer verified is refused, by the walk from where it stopped
/// and then by one from seq 1; a sealer that failed walks from seq 1 next time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealer_refuses_a_rewritten_row_past_what_it_verified() {
    each_backend(async |f: Fixture| {
        let trust = Trust::of(&[f.key.public()], DEPLOYMENT).unwrap();
        let mut sealer = audit::Sealer::default();
        assert_eq!(sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed").size, 23);
        let mut pair = request(f.tenant, 300);
        pair.events.push(request(f.tenant, 301).events.remove(0));
        f._log.append(pair).await.unwrap();
        rewrite(&f, 26).await;
        let err = sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap_err();
        assert!(err.to_string().contains("refusing to seal"), "{err}");
        assert_eq!(sealer.walks_from_start(), 2);
        let err = sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap_err();
        assert!(err.to_string().contains("refusing to seal"), "{err}");
        assert_eq!(sealer.walks_from_start(), 3);
    })
    .await;
}

/// A sealer walks each chain from seq 1 again once `SEAL_FULL_WALK_INTERVAL_MS` has passed
/// since its last walk from seq 1, and at once when the clock went back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealer_walks_from_the_start_daily_and_when_the_clock_goes_back() {
    each_backend(async |f: Fixture| {
        let trust = Trust::of(&[f.key.public()], DEPLOYMENT).unwrap();
        let started_ms = SystemClock.now_ms();
        let clock = Arc::new(bc_core::clock::ManualClock::new(started_ms));
        let log = Log::open(f.store.clone(), Arc::new(Projections), f.key.clone(), clock.clone()).await.unwrap();
        let mut sealer = audit::Sealer::default();
        let grow = async |i: u64| log.append(request(f.tenant, i)).await.unwrap();
        assert!(sealer.seal(&log, f.tenant, DEPLOYMENT, &trust).await.unwrap().is_some());
        grow(400).await;
        clock.advance_ms(audit::SEAL_FULL_WALK_INTERVAL_MS - 1);
        assert_eq!(sealer.seal(&log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed").size, 25);
        assert_eq!(sealer.walks_from_start(), 1);
        grow(401).await;
        clock.advance_ms(1);
        assert_eq!(sealer.seal(&log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed").size, 27);
        assert_eq!((sealer.walks_from_start(), sealer.events_walked()), (2, 23 + 2 + 27));
        grow(402).await;
        clock.set_ms(started_ms + audit::SEAL_FULL_WALK_INTERVAL_MS - 1);
        assert_eq!(sealer.seal(&log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed").size, 29);
        assert_eq!((sealer.walks_from_start(), sealer.events_walked()), (3, 23 + 2 + 27 + 29));
        assert!(verify(&f).await.problems.is_empty());
    })
    .await;
}

/// The newest checkpoint sealed in the chain must still be stored as sealed, even when the walk
/// from where the sealer stopped does not meet it (it was walked the time before): regression
/// (review) of a sealer that signed on top of a deleted checkpoint row, which `audit verify` and a
/// walk from seq 1 refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealer_refuses_when_the_newest_checkpoint_is_no_longer_stored() {
    each_backend(async |f: Fixture| {
        let trust = Trust::of(&[f.key.public()], DEPLOYMENT).unwrap();
        let mut sealer = audit::Sealer::default();
        assert_eq!(sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap().expect("sealed").size, 23);
        // This walk meets the checkpoint just sealed (seq 24) and seals nothing.
        assert!(sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap().is_none());
        f.raw
            .exec(&format!(
                "DELETE FROM projections WHERE tenant_id = '{}' AND kind = 'checkpoint' AND id = '{}'",
                f.tenant,
                audit::checkpoint_row_id(23)
            ))
            .await;
        f._log.append(request(f.tenant, 500)).await.unwrap();
        let err = sealer.seal(&f._log, f.tenant, DEPLOYMENT, &trust).await.unwrap_err();
        assert!(err.to_string().contains("missing from the store"), "{err}");
        assert_eq!(sealer.walks_from_start(), 2);
    })
    .await;
}
