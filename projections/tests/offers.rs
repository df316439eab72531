//! Pools offered to other tenants (`decide::pool_offer`, `decide::reservation_create_offered`),
//! without a database: an offer and its withdrawal, and a reservation held for an offered
//! tenant under its own quota, on the owner's view it shares with the owner's reservations.

use std::collections::{BTreeMap, BTreeSet};

use bc_core::store::ExpectedVersion;
use bc_projections::decide::pool_offer::{OFFERS_PER_POOL_MAX, pool_offer, pool_unoffer, unoffered_reason};
use bc_projections::decide::{
    self, Append, HeldFor, OfferedCreate, Refusal, ReservationAsk, ReservationCreate, ReservationCreateInput,
};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::fleet::FleetIndex;
use bc_projections::placement::Selector;
use bc_projections::{NodeDoc, NodeState, PoolDoc, QuotaDoc, ReservationDoc, ReservationState};

const OWNER: &str = "ten_01kb00000000000000000000a0";
const B: &str = "ten_01kb00000000000000000000b0";
const C: &str = "ten_01kb00000000000000000000c0";
const POOL: &str = "pool_01kb0000000000000000000000";
const NOW_MS: u64 = 1_000_000;

fn pool(offered_to: &[&str]) -> PoolDoc {
    PoolDoc {
        tenant_id: OWNER.into(),
        pool_id: POOL.into(),
        name: "p".into(),
        description: String::new(),
        labels: BTreeMap::new(),
        max_reservation_s: 3600,
        archived: false,
        site_id: None,
        offered_to: offered_to.iter().map(|t| (*t).to_owned()).collect(),
        version: 3,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

fn node(id: &str, gpus: u32) -> NodeDoc {
    NodeDoc {
        tenant_id: OWNER.into(),
        node_id: id.into(),
        pool_id: POOL.into(),
        name: id.into(),
        gpus: (0..gpus)
            .map(|_| Gpu { model: "H100".into(), product: "H100-SXM5-80GB".into(), vram_gib: 80, nvlink_domain: 0 })
            .collect(),
        labels: BTreeMap::new(),
        state: NodeState::Ready,
        taints: BTreeMap::new(),
        allocations: BTreeMap::new(),
        gpu_uuids: vec![],
        cordoned: false,
        draining: false,
        agent: None,
        version: 7,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

/// A live reservation of `gpus` held for `holder` (`None`: the owner's own).
fn live(id: &str, gpus: u32, state: ReservationState, holder: Option<&str>) -> ReservationDoc {
    let request = ev::ReservationRequested {
        pool_id: POOL.into(),
        gpus,
        duration_s: 60,
        selector: String::new(),
        nvlink: false,
        tolerations: vec![],
        project_id: None,
    };
    ReservationDoc {
        state,
        holder_tenant_id: holder.map(str::to_owned),
        version: 2,
        ..ReservationDoc::requested(OWNER.into(), id.into(), request, 1, 0, 1)
    }
}

fn ask(offered_to: &[&str], gpus: u32) -> ReservationAsk {
    ReservationAsk {
        pool: pool(offered_to),
        gpus,
        duration_s: 60,
        selector_text: String::new(),
        selector: Selector::default(),
        nvlink: false,
        tolerations: vec![],
        project: None,
    }
}

fn input(reservation_id: &str) -> ReservationCreateInput<'_> {
    ReservationCreateInput { reservation_id, command_id: "cmd_01", now_ms: NOW_MS, actor: "apikey:key_b", replay: false }
}

fn quota(tenant: &str, gpus: u32, version: u64) -> QuotaDoc {
    QuotaDoc { tenant_id: tenant.into(), pool_id: POOL.into(), gpus, version, updated_at_ms: 0, ..QuotaDoc::default() }
}

fn set(ids: &[&str]) -> BTreeSet<String> {
    ids.iter().map(|t| (*t).to_owned()).collect()
}

fn payload<T: serde::de::DeserializeOwned>(append: &Append, n: usize) -> T {
    serde_json::from_value(bc_core::canonical::to_json(&append.events[n].payload)).unwrap()
}

#[test]
fn an_offer_appends_on_the_pool_and_on_each_new_tenants_chain_and_again_changes_nothing() {
    let offered = pool_offer(&pool(&[B]), &set(&[B, C])).unwrap().expect("C is new");
    assert_eq!(offered.owner.stream, format!("pool/{POOL}"));
    assert_eq!(offered.owner.expected, ExpectedVersion::Exact(3));
    assert_eq!(offered.owner.event_types(), [ev::POOL_OFFERED]);
    assert_eq!(
        payload::<ev::PoolOffers>(&offered.owner, 0),
        ev::PoolOffers { tenant_ids: vec![C.into()], owner_tenant_id: None }
    );
    assert_eq!(offered.offered.len(), 1, "only the tenant not offered yet");
    let (tenant, append) = &offered.offered[0];
    assert_eq!((tenant.as_str(), append.stream.as_str()), (C, format!("pool_offer/{POOL}").as_str()));
    assert_eq!(payload::<ev::PoolOffers>(append, 0).owner_tenant_id.as_deref(), Some(OWNER));
    // Every tenant offered already: nothing to append.
    assert_eq!(pool_offer(&pool(&[B, C]), &set(&[B])).unwrap(), None);
}

#[test]
fn an_offer_is_refused_to_the_owner_past_the_bound_and_on_an_archived_pool() {
    assert!(matches!(pool_offer(&pool(&[]), &set(&[OWNER, B])), Err(Refusal::OfferInvalid(_))));
    let many: Vec<String> = (0..OFFERS_PER_POOL_MAX).map(|n| format!("ten_01kb000000000000000000{n:04}")).collect();
    let full = PoolDoc { offered_to: many.into_iter().collect(), ..pool(&[]) };
    let refused = pool_offer(&full, &set(&[B])).unwrap_err();
    assert!(matches!(&refused, Refusal::OfferInvalid(m) if m.contains("limit of 64")), "{refused}");
    let archived = PoolDoc { archived: true, ..pool(&[]) };
    assert_eq!(pool_offer(&archived, &set(&[B])).unwrap_err(), Refusal::PoolArchived { pool_id: POOL.into() });
}

#[test]
fn an_unoffer_cancels_the_tenants_queued_reservations_keeps_its_active_ones_and_guards_its_quota() {
    let reservations = [
        live("rsv_b_active", 2, ReservationState::Active, Some(B)),
        live("rsv_b_queued", 2, ReservationState::Queued, Some(B)),
        live("rsv_c_queued", 1, ReservationState::Queued, Some(C)),
        live("rsv_own_queued", 1, ReservationState::Queued, None),
    ];
    let versions = BTreeMap::from([(B.to_owned(), 5)]);
    let withdrawn = pool_unoffer(&pool(&[B, C]), &set(&[B]), &reservations, &versions).unwrap().expect("B is offered");
    assert_eq!(withdrawn.owner.expected, ExpectedVersion::Exact(3));
    assert_eq!(withdrawn.owner.event_types(), [ev::POOL_UNOFFERED, ev::RESERVATION_CANCELLED]);
    assert_eq!(withdrawn.owner.events[1].stream.as_deref(), Some("reservation/rsv_b_queued"));
    assert!(withdrawn.owner.guards.contains(&("reservation/rsv_b_queued".into(), ExpectedVersion::Exact(2))));
    let ended: ev::ReservationEnded = payload(&withdrawn.owner, 1);
    assert_eq!(ended.reason, Some(unoffered_reason(POOL, B)));
    let (tenant, append) = &withdrawn.offered[0];
    assert_eq!(tenant, B);
    assert_eq!(append.event_types(), [ev::POOL_UNOFFERED]);
    assert_eq!(append.guards, vec![(format!("quota/{POOL}"), ExpectedVersion::Exact(5))]);
    // C has no quota stream yet: its withdrawal guards that none appears meanwhile.
    let c = pool_unoffer(&pool(&[B, C]), &set(&[C]), &reservations, &versions).unwrap().unwrap();
    assert_eq!(c.offered[0].1.guards, vec![(format!("quota/{POOL}"), ExpectedVersion::NoStream)]);
    // A tenant not offered: nothing to append.
    assert_eq!(pool_unoffer(&pool(&[C]), &set(&[B]), &reservations, &versions).unwrap(), None);
}

#[test]
fn a_held_reservation_is_charged_on_the_holders_chain_and_counts_against_its_quota_only() {
    let mut n = node("node_a", 8);
    // The owner holds 6 GPUs, B 1: B's quota of 2 leaves it 1 more, whatever the owner holds.
    let owner_rsv = ReservationDoc {
        node_id: Some("node_a".into()),
        gpu_indexes: (0..6).collect(),
        ..live("rsv_own", 6, ReservationState::Active, None)
    };
    let b_rsv = ReservationDoc {
        node_id: Some("node_a".into()),
        gpu_indexes: vec![6],
        ..live("rsv_b", 1, ReservationState::Active, Some(B))
    };
    for r in [&owner_rsv, &b_rsv] {
        for g in &r.gpu_indexes {
            n.allocations.insert(*g, r.reservation_id.clone());
        }
    }
    let view = FleetIndex::new([n], [owner_rsv, b_rsv]);
    assert_eq!((view.pool_load(POOL).gpus_of(None), view.pool_load(POOL).gpus_of(Some(B))), (6, 1));
    let held = HeldFor { tenant_id: B };
    let q = quota(B, 2, 4);
    let OfferedCreate { decision, charge } =
        decide::reservation_create_offered(&view, Some(&q), &ask(&[B], 1), &input("rsv_new"), held).unwrap();
    let ReservationCreate::Place { placement, append, pending, .. } = &decision else { panic!("not placed: {decision:?}") };
    assert_eq!(placement.gpus, vec![7], "the one GPU neither tenant holds");
    assert_eq!(pending.holder_tenant_id.as_deref(), Some(B));
    assert_eq!(append.event_types()[..2], [ev::RESERVATION_REQUESTED, ev::RESERVATION_HELD_FOR]);
    assert!(!append.event_types().contains(&ev::QUOTA_CHARGED), "the owner's chain is not charged");
    assert_eq!(append.guards.iter().find(|(s, _)| *s == format!("pool/{POOL}")).map(|g| g.1), Some(ExpectedVersion::Exact(3)));
    assert!(append.guards.iter().any(|(s, v)| s == "node/node_a" && *v == ExpectedVersion::Exact(7)), "{append:?}");
    let charge = charge.expect("charged on B's chain");
    assert_eq!((charge.stream.as_str(), charge.expected), (format!("quota/{POOL}").as_str(), ExpectedVersion::Exact(4)));
    let charged: ev::QuotaCharged = payload(&charge, 0);
    assert_eq!(charged.owner_tenant_id.as_deref(), Some(OWNER));

    // Past B's quota: refused, whatever room the pool has.
    let OfferedCreate { decision, charge } =
        decide::reservation_create_offered(&view, Some(&q), &ask(&[B], 2), &input("rsv_big"), held).unwrap();
    let ReservationCreate::OverQuota { refusal, .. } = decision else { panic!("not refused") };
    assert_eq!(refusal, Refusal::OverQuota { pool_id: POOL.into(), requested: 2, in_use: 1, limit: 2 });
    assert_eq!(charge, None);
    // No quota row in an offered pool: a limit of 0.
    let OfferedCreate { decision, .. } =
        decide::reservation_create_offered(&view, None, &ask(&[B], 1), &input("rsv_none"), held).unwrap();
    assert!(matches!(decision, ReservationCreate::OverQuota { refusal: Refusal::OverQuota { limit: 0, .. }, .. }));
    // The owner's own quota does not count B's GPUs.
    let own = decide::reservation_create(&view, Some(&quota(OWNER, 7, 1)), &ask(&[B], 1), &input("rsv_own2")).unwrap();
    assert!(matches!(own, ReservationCreate::Place { .. }), "{own:?}");
}

#[test]
fn a_tenant_the_pool_is_not_offered_to_is_refused() {
    let view = FleetIndex::new([node("node_a", 8)], []);
    let refused = decide::reservation_create_offered(
        &view,
        Some(&quota(B, 8, 1)),
        &ask(&[C], 1),
        &input("rsv_x"),
        HeldFor { tenant_id: B },
    )
    .unwrap_err();
    assert_eq!(refused, Refusal::NotOffered { pool_id: POOL.into(), tenant_id: B.into() });
    assert_eq!(bc_core::Error::from(refused).code(), bc_core::ErrorCode::NotFound);
}

#[test]
fn a_held_reservation_is_extended_only_while_its_pool_is_offered_to_its_holder_guarded_at_the_pools_version() {
    let held = ReservationDoc {
        activated_at_ms: Some(NOW_MS),
        ends_at_ms: Some(NOW_MS + 60_000),
        ..live("rsv_b", 2, ReservationState::Active, Some(B))
    };
    let append = decide::reservation_extend(&held, &pool(&[B]), 60, None).unwrap();
    assert_eq!(append.event_types(), [ev::RESERVATION_EXTENDED]);
    assert_eq!(append.guards, vec![(format!("pool/{POOL}"), ExpectedVersion::Exact(3))], "an unoffer meanwhile is a CONFLICT");
    let refused = decide::reservation_extend(&held, &pool(&[C]), 60, None).unwrap_err();
    assert_eq!(refused, Refusal::OfferWithdrawn { reservation_id: "rsv_b".into(), pool_id: POOL.into(), tenant_id: B.into() });
    assert_eq!(bc_core::Error::from(refused).code(), bc_core::ErrorCode::InvalidState);
    // The owner's own reservation guards nothing more.
    let own = ReservationDoc { holder_tenant_id: None, ..held };
    assert!(decide::reservation_extend(&own, &pool(&[]), 60, None).unwrap().guards.is_empty());
}

/// An active reservation held for `holder` on `node_a`'s GPUs 0 and 1, whose hold the node
/// refused.
fn hold_failed(holder: &str) -> (NodeDoc, ReservationDoc) {
    let rsv = ReservationDoc {
        node_id: Some("node_a".into()),
        gpu_indexes: vec![0, 1],
        activated_at_ms: Some(NOW_MS - 1000),
        ends_at_ms: Some(NOW_MS + 60_000),
        binding: Some(bc_projections::Binding {
            state: bc_projections::BindingState::Failed,
            hold_command_id: Some("cmd_hold".into()),
            deadline_at_ms: Some(NOW_MS + 1),
            release_command_id: None,
            gpu_uuids: vec![],
            reason: Some("gpu-in-use: GPU-0 runs 1 processes".into()),
            changed_at_ms: 0,
        }),
        ..live("rsv_b", 2, ReservationState::Active, Some(holder))
    };
    let mut n = node("node_a", 8);
    for g in &rsv.gpu_indexes {
        n.allocations.insert(*g, rsv.reservation_id.clone());
    }
    (n, rsv)
}

fn view_with(nodes: Vec<NodeDoc>, live: Vec<ReservationDoc>, pool: Option<PoolDoc>) -> FleetIndex {
    let mut view = FleetIndex::new(nodes, live);
    if let Some(pool) = pool {
        view.put_pool(pool);
    }
    view
}

const ISSUE: bc_projections::placement::Issue<'static> =
    bc_projections::placement::Issue { command_id: "cmd_01", now_ms: NOW_MS };

/// Regression: a held reservation whose hold failed after its pool was withdrawn from its
/// holder was requeued like any other and could be placed again (the plan did not read
/// offers). Now it fails, with the reason, and is never requeued; while the pool is still
/// offered it is requeued, guarding the pool's version read, so a withdrawal meanwhile is a
/// CONFLICT and the next pass fails it instead.
#[test]
fn a_held_reservation_whose_hold_fails_after_an_unoffer_fails_with_the_reason_instead_of_requeueing() {
    let pool_guard = (format!("pool/{POOL}"), ExpectedVersion::Exact(3));
    let (n, rsv) = hold_failed(B);

    let withdrawn = view_with(vec![n.clone()], vec![rsv.clone()], Some(pool(&[C])));
    let actions = decide::plan(&withdrawn, NOW_MS);
    assert_eq!(actions.len(), 1, "{actions:?}");
    let decide::Action::HoldFailed { gives_up, attempts, reason, offer_version, .. } = &actions[0] else { panic!("{actions:?}") };
    assert_eq!((*gives_up, *attempts, *offer_version), (true, 1, Some(3)), "its first failure is its last");
    assert!(reason.starts_with("gpu-in-use: GPU-0 runs 1 processes; not requeued: "), "{reason}");
    assert!(reason.ends_with(&unoffered_reason(POOL, B)), "{reason}");
    let append = actions[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(append.event_types()[..2], [ev::RESERVATION_FAILED, ev::NODE_FREED]);
    assert_eq!(payload::<ev::ReservationFailed>(&append, 0).reason, *reason);
    assert!(append.guards.contains(&pool_guard), "{:?}", append.guards);

    // Still offered: requeued as any other, guarded at the pool's version.
    let offered = view_with(vec![n.clone()], vec![rsv.clone()], Some(pool(&[B])));
    let actions = decide::plan(&offered, NOW_MS);
    let decide::Action::HoldFailed { gives_up: false, offer_version: Some(3), .. } = &actions[0] else { panic!("{actions:?}") };
    let append = actions[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(append.event_types()[0], ev::RESERVATION_REQUEUED);
    assert!(append.guards.contains(&pool_guard), "{:?}", append.guards);

    // A view that does not know the pool offers it to no one: failed, with nothing to guard.
    let unknown = view_with(vec![n], vec![rsv], None);
    let actions = decide::plan(&unknown, NOW_MS);
    assert!(matches!(&actions[0], decide::Action::HoldFailed { gives_up: true, offer_version: None, .. }), "{actions:?}");
}

/// A queued reservation held for a tenant the pool is no longer offered to (a requeue that
/// landed before the rule above, say) is cancelled with the reason, wherever it is in the
/// queue, and the queue goes on behind it; offered, it is placed, guarding the pool's version.
#[test]
fn a_queued_held_reservation_no_longer_offered_is_cancelled_and_the_queue_goes_on() {
    let held = ReservationDoc { request_seq: 1, ..live("rsv_b", 4, ReservationState::Queued, Some(B)) };
    let own = ReservationDoc { request_seq: 2, ..live("rsv_own", 4, ReservationState::Queued, None) };
    let pool_guard = (format!("pool/{POOL}"), ExpectedVersion::Exact(3));

    let withdrawn = view_with(vec![node("node_a", 8)], vec![held.clone(), own.clone()], Some(pool(&[C])));
    let actions = decide::plan(&withdrawn, NOW_MS);
    let summary: Vec<(&str, &str)> = actions
        .iter()
        .map(|a| match a {
            decide::Action::Withdraw { .. } => ("withdraw", a.reservation_id()),
            decide::Action::Activate { .. } => ("activate", a.reservation_id()),
            _ => ("other", a.reservation_id()),
        })
        .collect();
    assert_eq!(summary, [("withdraw", "rsv_b"), ("activate", "rsv_own")]);
    let cancel = actions[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(cancel.event_types(), [ev::RESERVATION_CANCELLED]);
    assert_eq!(cancel.expected, ExpectedVersion::Exact(2));
    assert_eq!(payload::<ev::ReservationEnded>(&cancel, 0).reason, Some(unoffered_reason(POOL, B)));
    assert_eq!(cancel.guards, vec![pool_guard.clone()]);
    let own_activation = actions[1].append(ISSUE).unwrap().unwrap();
    assert!(!own_activation.guards.iter().any(|(s, _)| s.starts_with("pool/")), "the owner's own relies on no offer");

    // Behind a head that does not fit: cancelled all the same.
    let big = ReservationDoc { request_seq: 0, ..live("rsv_big", 8, ReservationState::Queued, None) };
    let blocked = view_with(vec![node("node_a", 4)], vec![big, held.clone()], Some(pool(&[C])));
    let actions = decide::plan(&blocked, NOW_MS);
    assert!(
        matches!(&actions[..], [decide::Action::Withdraw { reservation_id, .. }] if reservation_id == "rsv_b"),
        "{actions:?}"
    );

    // Offered: placed, the pool's version guarded.
    let offered = view_with(vec![node("node_a", 8)], vec![held, own], Some(pool(&[B])));
    let actions = decide::plan(&offered, NOW_MS);
    assert!(matches!(&actions[0], decide::Action::Activate { offer_version: Some(3), .. }), "{actions:?}");
    assert!(actions[0].append(ISSUE).unwrap().unwrap().guards.contains(&pool_guard));
}
