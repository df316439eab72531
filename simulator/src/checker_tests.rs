//! The checkers' own tests: a world brought to a checked, settled state, then corrupted in one
//! way (underneath the log, in an agent's ledger, or in the view of the log a checker is
//! given), and the checker that must see it named. Each test prints its seed.

use std::collections::BTreeMap;

use bc_agent::session::SeededRng;
use bc_core::agent::{EntryBody, SignedEntry};
use bc_core::clock::Clock;
use bc_projections::{KIND_NODE, KIND_RESERVATION_LIVE, NodeDoc, ReservationDoc, ReservationState};
use ed25519_dalek::SigningKey;

use crate::run::{LogFold, full_check, full_check_on};
use crate::world::{JournalInLog, JournalRefusalCause, Shape, World};

const SEED: u64 = 41;

/// One tenant, two nodes of four GPUs, two reservations of two GPUs active and bound (the
/// reconciler placed them, the agents held them, their journals reached the log), every check
/// passing.
async fn busy_world() -> World {
    println!("seed {SEED}");
    let mut rng = SeededRng(SEED);
    let mut world = World::new(SEED, &mut rng, Shape { tenants: 1, nodes: 2, gpus_min: 4, gpus_max: 4 }).await;
    world.request(0, 2, 3600).await;
    world.request(0, 2, 3600).await;
    settle(&mut world).await;
    let live: Vec<ReservationDoc> = world.rows(0, KIND_RESERVATION_LIVE).await;
    assert_eq!(live.iter().filter(|r| r.state == ReservationState::Active).count(), 2, "{live:?}");
    world.check().await.expect("the honest world passes the step check");
    world.settled().await.expect("the honest world is settled");
    full_check(&world, true).await.expect("the honest world passes the full check");
    world
}

/// Passes and answers until the queues are empty (a few rounds at most).
async fn settle(world: &mut World) {
    for _ in 0..4 {
        world.clock.set_ms(world.clock.now_ms() + 10_000);
        world.pass().await;
        for a in 0..world.agents.len() {
            world.answer(a, false, None, false, false).await;
        }
    }
}

async fn active(world: &World) -> Vec<ReservationDoc> {
    let live: Vec<ReservationDoc> = world.rows(0, KIND_RESERVATION_LIVE).await;
    live.into_iter().filter(|r| r.state == ReservationState::Active).collect()
}

/// Overwrites one projection row underneath the log (the test-only switches' way, which also
/// makes the step check read its rows again).
async fn overwrite_row(world: &World, kind: &str, id: &str, doc: &serde_json::Value) {
    assert!(world.row_overwrite(0, kind, id, doc).await, "{kind}/{id}");
}

#[tokio::test]
async fn a_gpu_given_to_two_active_reservations_on_the_control_plane_is_named() {
    let world = busy_world().await;
    let active = active(&world).await;
    let (first, second) = (&active[0], &active[1]);
    let mut stolen = serde_json::to_value(second).unwrap();
    stolen["nodeId"] = serde_json::json!(first.node_id);
    stolen["gpuIndexes"] = serde_json::json!(first.gpu_indexes);
    overwrite_row(&world, KIND_RESERVATION_LIVE, &second.reservation_id, &stolen).await;
    let found = world.check().await.expect_err("the step check must see it");
    assert!(found.0.starts_with("double booking: GPU"), "{found}");
    assert!(found.0.contains(&first.reservation_id) && found.0.contains(&second.reservation_id), "{found}");
}

/// The rows the step check keeps between steps (read again only where the tenant's events since
/// touched them) are held to the store's by the full checks: a row changed underneath without
/// the world hearing of it (not through `row_overwrite`) is named.
#[tokio::test]
async fn rows_the_step_check_keeps_that_differ_from_the_store_are_named() {
    let world = busy_world().await;
    world.check().await.expect("the honest world passes");
    world.check_checked_rows().await.expect("the kept rows are the store's");
    let rsv = active(&world).await.remove(0);
    let mut moved = serde_json::to_value(&rsv).unwrap();
    moved["gpuIndexes"] = serde_json::json!([97]);
    sqlx::query("UPDATE projections SET doc = ? WHERE tenant_id = ? AND kind = ? AND id = ?")
        .bind(serde_json::to_string(&moved).unwrap())
        .bind(world.tenants[0].id.to_string())
        .bind(KIND_RESERVATION_LIVE)
        .bind(&rsv.reservation_id)
        .execute(world.sqlite.pool())
        .await
        .unwrap();
    let found = world.check_checked_rows().await.expect_err("the full check must see it");
    assert!(found.0.starts_with("the rows the step check keeps for tenant"), "{found}");
}

#[tokio::test]
async fn a_gpu_held_for_two_reservations_by_an_agent_is_named_and_so_is_a_bound_one_not_held() {
    let world = busy_world().await;
    let a = (0..2).find(|&a| !world.agents[a].ledger().holds.is_empty()).expect("an agent holds something");
    let honest = world.agents[a].ledger();
    let (rsv, hold) = honest.holds.iter().next().unwrap();
    let mut doubled = honest.clone();
    doubled.holds.insert("rsv_01zzzzzzzzzzzzzzzzzzzzzzzz".into(), hold.clone());
    world.agents[a].ledger_overwrite(&doubled);
    let found = world.check().await.expect_err("the step check must see it");
    assert!(found.0.starts_with("double hold: the agent of"), "{found}");
    assert!(found.0.contains(&hold.gpus[0].uuid) || found.0.contains(&hold.gpus[1].uuid), "{found}");
    // The hold forgotten: bound on the control plane, held by nobody.
    let mut forgotten = honest.clone();
    forgotten.holds.remove(rsv);
    world.agents[a].ledger_overwrite(&forgotten);
    let found = world.check().await.expect_err("the step check must see it");
    assert!(found.0.contains(&format!("{rsv} is bound to")) && found.0.contains("holds {}"), "{found}");
}

#[tokio::test]
async fn a_changed_event_byte_breaks_the_chain_check() {
    let world = busy_world().await;
    let tenant = world.tenants[0].id.to_string();
    let (canonical,): (Vec<u8>,) = sqlx::query_as("SELECT canonical FROM events WHERE tenant_id = ? AND seq = 1")
        .bind(&tenant)
        .fetch_one(world.sqlite.pool())
        .await
        .unwrap();
    let mut changed = canonical.clone();
    let at = changed.windows(6).position(|w| w == b"pool-0").expect("the pool's name") + 5;
    changed[at] = b'9';
    sqlx::query("UPDATE events SET canonical = ? WHERE tenant_id = ? AND seq = 1")
        .bind(changed)
        .bind(&tenant)
        .execute(world.sqlite.pool())
        .await
        .unwrap();
    let found = full_check(&world, true).await.expect_err("the full check must see it");
    assert!(found.0.starts_with("the chain does not verify") && found.0.contains("seq: 1"), "{found}");
}

#[tokio::test]
async fn a_journal_entry_its_node_never_signed_breaks_the_chain_check() {
    let mut world = busy_world().await;
    // A journal entry the agent wrote but has not delivered yet: it crashes after running.
    let a = an_agent_with_an_entry_not_delivered(&mut world).await;
    let entry = world.agents[a].journal_entries().await.into_iter().find(|e| e.seq == world.agents[a].delivered + 1).unwrap();
    let (body, _) = SignedEntry::verify(entry.seq, &entry.body, &entry.signature, &world.agents[a].key.verifying_key()).unwrap();
    // The same entry, signed by a key that is not the node's.
    let other = SigningKey::from_bytes(&[9; 32]);
    let forged = SignedEntry::sign(&other, &body).unwrap();
    let request = world.journal_request_unchecked(a, entry.seq, &body, &forged.body, &forged.signature);
    world.log.append(request).await.expect("the log itself does not check node signatures");
    let found = full_check(&world, false).await.expect_err("the full check must see it");
    assert!(found.0.starts_with("the chain does not verify"), "{found}");
    assert!(found.0.contains(&world.agents[a].node) && found.0.contains("signature"), "{found}");
}

/// The first agent with a command queued for its node.
/// A reservation requested and a pass run, so a node has a command to run: that node.
async fn a_node_with_a_command(world: &World) -> usize {
    world.request(0, 1, 3600).await;
    world.clock.set_ms(world.clock.now_ms() + 10_000);
    world.pass().await;
    node_with_command(world).await
}

/// A node whose agent ran its command, crashed before delivering the entry it journaled, and
/// started again: the entry waits in its journal.
async fn an_agent_with_an_entry_not_delivered(world: &mut World) -> usize {
    let a = a_node_with_a_command(world).await;
    world.answer(a, true, None, false, false).await;
    world.agents[a].start().await;
    a
}

async fn node_with_command(world: &World) -> usize {
    for a in 0..world.agents.len() {
        if !world.pending(a).await.is_empty() {
            return a;
        }
    }
    panic!("no node has a command queued")
}

#[tokio::test]
async fn a_projection_row_unlike_the_fold_of_the_log_is_named() {
    let world = busy_world().await;
    let node = world.agents[0].node.clone();
    let doc: NodeDoc = world.doc(0, KIND_NODE, &node).await.unwrap();
    let mut changed = serde_json::to_value(&doc).unwrap();
    changed["cordoned"] = serde_json::json!(!doc.cordoned);
    overwrite_row(&world, KIND_NODE, &node, &changed).await;
    let found = full_check(&world, true).await.expect_err("the full check must see it");
    assert!(found.0.starts_with("the projections differ from a fold of the log"), "{found}");
    assert!(found.0.contains(&format!("/node/{node}")), "{found}");
}

/// The full checks of a run keep their fold and fold only what the log grew by: what they keep
/// is what a fold of the whole log from scratch gives, as the log grows.
#[tokio::test]
async fn a_kept_fold_is_the_fold_from_scratch_as_the_log_grows() {
    let mut world = busy_world().await;
    let mut kept = LogFold::default();
    let (events, _) = full_check_on(&world, true, &mut kept).await.expect("sound");
    world.request(0, 1, 600).await;
    world.request(0, 3, 60).await;
    settle(&mut world).await;
    let (more, _) = full_check_on(&world, true, &mut kept).await.expect("still sound");
    assert!(more > events, "the log grew: {events} → {more}");
    let mut scratch = LogFold::default();
    full_check_on(&world, true, &mut scratch).await.expect("sound from scratch");
    assert_eq!(kept.after, scratch.after);
    assert_eq!(kept.ids, scratch.ids);
    assert_eq!(kept.journal, scratch.journal);
    let sorted = |fold: &LogFold| {
        fold.state.iter().collect::<BTreeMap<_, _>>().into_iter().map(|(k, v)| (k.clone(), v.clone())).collect::<Vec<_>>()
    };
    assert_eq!(sorted(&kept), sorted(&scratch));
    let listed = |fold: &LogFold| fold.logged.iter().map(|e| (e.tenant, e.seq, e.id.clone(), e.position)).collect::<Vec<_>>();
    assert_eq!(listed(&kept), listed(&scratch));
}

/// A row changed underneath the log after a check folded its events is named by the next check
/// that keeps its fold: every stored row is compared each time, not only the ones new events
/// touch.
#[tokio::test]
async fn a_row_changed_after_a_kept_fold_is_named() {
    let world = busy_world().await;
    let mut kept = LogFold::default();
    full_check_on(&world, true, &mut kept).await.expect("sound");
    let node = world.agents[1].node.clone();
    let doc: NodeDoc = world.doc(0, KIND_NODE, &node).await.unwrap();
    let mut changed = serde_json::to_value(&doc).unwrap();
    changed["cordoned"] = serde_json::json!(!doc.cordoned);
    overwrite_row(&world, KIND_NODE, &node, &changed).await;
    let found = full_check_on(&world, true, &mut kept).await.expect_err("the next check must see it");
    assert!(found.0.contains(&format!("/node/{node}")), "{found}");
}

#[tokio::test]
async fn an_acknowledged_append_cut_from_the_log_is_named() {
    let world = busy_world().await;
    // The newest event is a workload append the log acknowledged; the store then loses it,
    // head and all (a chain cut short still verifies).
    world.request(0, 1, 3600).await;
    let tenant = world.tenants[0].id.to_string();
    let (seq,): (i64,) = sqlx::query_as("SELECT seq FROM chain_heads WHERE tenant_id = ?")
        .bind(&tenant)
        .fetch_one(world.sqlite.pool())
        .await
        .unwrap();
    let (hash,): (Vec<u8>,) = sqlx::query_as("SELECT hash FROM events WHERE tenant_id = ? AND seq = ?")
        .bind(&tenant)
        .bind(seq - 1)
        .fetch_one(world.sqlite.pool())
        .await
        .unwrap();
    sqlx::query("DELETE FROM events WHERE tenant_id = ? AND seq = ?")
        .bind(&tenant)
        .bind(seq)
        .execute(world.sqlite.pool())
        .await
        .unwrap();
    sqlx::query("UPDATE chain_heads SET seq = ?, hash = ? WHERE tenant_id = ?")
        .bind(seq - 1)
        .bind(hash)
        .bind(&tenant)
        .execute(world.sqlite.pool())
        .await
        .unwrap();
    let found = full_check(&world, true).await.expect_err("the full check must see it");
    assert!(found.0.starts_with("an acknowledged append is lost") && found.0.contains(&format!("seq {seq}")), "{found}");
}

/// Each node's journal as the log holds it, read as the full check reads it.
async fn journal_in_log(world: &World) -> BTreeMap<String, JournalInLog> {
    let mut out: BTreeMap<String, JournalInLog> = BTreeMap::new();
    for agent in &world.agents {
        let entries = agent.journal_entries().await;
        let delivered: JournalInLog =
            entries.iter().take(agent.delivered as usize).map(|e| (e.seq, bc_core::agent::b64(&e.body))).collect();
        out.insert(agent.node.clone(), delivered);
    }
    out
}

#[tokio::test]
async fn the_journal_check_names_a_duplicate_a_reordering_a_loss_an_entry_never_written_and_a_changed_one() {
    let world = busy_world().await;
    let honest = journal_in_log(&world).await;
    world.check_journals(&honest, true).await.expect("the honest view passes");
    let node = world.agents[0].node.clone();
    assert!(honest[&node].len() >= 2, "the node's agent journaled: {honest:?}");
    let corrupt = |change: &dyn Fn(&mut JournalInLog)| {
        let mut view = honest.clone();
        change(view.get_mut(&node).unwrap());
        view
    };
    let cases: Vec<(&str, BTreeMap<String, JournalInLog>)> = vec![
        ("more than once (duplicated)", corrupt(&|j| j.push(j[0].clone()))),
        ("(out of order)", corrupt(&|j| j.swap(0, 1))),
        ("was acknowledged to its agent but is not in the log (lost", corrupt(&|j| drop(j.remove(0)))),
        ("which its agent never wrote", corrupt(&|j| j.push((j.len() as u64 + 1, j[0].1.clone())))),
        ("is not the one its agent wrote", corrupt(&|j| j[1].1 = j[0].1.clone())),
    ];
    for (named, view) in cases {
        let found = world.check_journals(&view, true).await.expect_err(named);
        assert!(found.0.contains(named) && found.0.contains(&node), "expected {named:?}, found {found}");
    }
}

#[tokio::test]
async fn a_lost_acknowledgement_is_not_a_lost_entry() {
    // The regression: after a lost ack the log is ahead of what the agent was acknowledged;
    // the full check inside that window used to call the entries lost or out of order.
    let mut world = busy_world().await;
    let a = a_node_with_a_command(&world).await;
    let before = world.agents[a].delivered;
    world.answer(a, false, None, false, true).await;
    assert_eq!(world.agents[a].delivered, before, "the ack was lost");
    full_check(&world, false).await.expect("the log ahead of the acknowledgement is no violation");
    // Settled means delivered: the agent is told nothing reached the log yet.
    let found = full_check(&world, true).await.expect_err("undelivered while settled");
    assert!(found.0.contains("never reached the log"), "{found}");
    // Delivered again, taken once: settled and whole.
    world.deliver(a, false).await;
    assert!(world.refused.is_none(), "{:?}", world.refused);
    full_check(&world, true).await.expect("delivered again, taken once");
}

#[tokio::test]
async fn a_refused_journal_entry_is_named_by_its_cause() {
    // Without the idempotency key, an entry delivered again is appended again: the fold
    // refuses it, and the run is told it was duplicated.
    let mut world = busy_world().await;
    world.journal_dedupe = false;
    let a = 0;
    let delivered = world.agents[a].delivered;
    assert!(delivered >= 1);
    world.agents[a].delivered = delivered - 1;
    world.deliver(a, false).await;
    let refused = world.refused.take().expect("refused");
    assert_eq!(
        (refused.cause.clone(), refused.seq, refused.head_in_log),
        (JournalRefusalCause::Duplicated, delivered, delivered)
    );
    assert!(refused.to_string().contains("delivered twice (duplicated)"), "{refused}");
    // An entry past the head's next: a gap.
    world.journal_dedupe = true;
    let a = an_agent_with_an_entry_not_delivered(&mut world).await;
    let head = world.agents[a].delivered;
    let written = world.agents[a].journal_entries().await.len() as u64;
    assert!(written >= head + 2, "the hold was started and answered: {head} {written}");
    world.agents[a].delivered = head + 1;
    world.deliver(a, false).await;
    let refused = world.refused.take().expect("refused");
    assert_eq!((refused.cause.clone(), refused.seq, refused.head_in_log), (JournalRefusalCause::Gap, head + 2, head));
    assert!(refused.to_string().contains("came after a gap"), "{refused}");
}

#[tokio::test]
async fn a_journal_idempotency_key_held_by_another_request_is_named() {
    let mut world = busy_world().await;
    let a = an_agent_with_an_entry_not_delivered(&mut world).await;
    let next = world.agents[a].delivered + 1;
    let node = world.agents[a].node.clone();
    // Another request took the entry's key first: a node.observed the agent never wrote.
    let body = EntryBody {
        node: node.parse().unwrap(),
        seq: next,
        prev: [0; 32],
        at_ms: world.clock.now_ms(),
        entry_type: bc_projections::events::NODE_OBSERVED.into(),
        subject: format!("agent/{node}"),
        payload: serde_json::json!({ "nodeId": node }),
    };
    let signed = SignedEntry::sign(&world.agents[a].key, &body).unwrap();
    let request = world.journal_request(a, next, &signed.body, &signed.signature).unwrap();
    world.log.append(request).await.expect("the forged entry goes in");
    world.deliver(a, false).await;
    let refused = world.refused.take().expect("refused");
    assert_eq!(refused.cause, JournalRefusalCause::IdempotencyKeyTaken, "{refused}");
    // And the journal check names the forged entry as not the agent's.
    let found = full_check(&world, false).await.expect_err("the full check must see it");
    assert!(found.0.contains(&format!("journal entry {next} of {node} is not the one its agent wrote")), "{found}");
}

#[tokio::test]
async fn a_failed_commit_writes_nothing_and_the_next_append_takes_its_place() {
    let world = busy_world().await;
    let heads = world.store.heads().await.unwrap();
    let rows = world.store.rows_all().await.unwrap().len();
    world.log.commits_fail(1);
    let event = bc_core::store::NewEvent::new(
        bc_projections::events::NODE_CORDONED,
        bc_projections::events::to_cbor(&bc_projections::events::NodeStateChanged {}).unwrap(),
    );
    let node = world.agents[0].node.clone();
    let request = bc_core::store::AppendRequest::new(
        world.tenants[0].id,
        bc_projections::stream_of(KIND_NODE, &node),
        bc_core::store::ExpectedVersion::Any,
        "sim-operator",
        vec![event],
    );
    let e = world.append_acknowledged(request.clone()).await.expect_err("the commit fails");
    assert!(crate::world::injected(&e), "{e}");
    assert_eq!(world.store.heads().await.unwrap(), heads, "no head moved");
    assert_eq!(world.store.rows_all().await.unwrap().len(), rows);
    full_check(&world, true).await.expect("nothing half written");
    let doc: NodeDoc = world.doc(0, KIND_NODE, &node).await.unwrap();
    assert!(!doc.cordoned);
    // The next one commits, at the seq the failed one would have had.
    let appended = world.append_acknowledged(request).await.expect("the next commit goes through");
    let head = heads.iter().find(|(t, _)| *t == world.tenants[0].id).unwrap().1.seq;
    assert_eq!(appended.events[0].envelope.seq, head + 1);
    full_check(&world, true).await.expect("the log is whole");
}
