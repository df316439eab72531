//! The pure decisions of `bc_projections::decide`, without a database: views and documents are
//! built in memory, and what each decision would append is checked event by event.

use std::collections::BTreeMap;

use bc_core::store::ExpectedVersion;
use bc_core::{Error, ErrorCode};
use bc_projections::decide::{
    self, Action, Append, PoolLoad, Refusal, ReservationAsk, ReservationCreate, ReservationCreateInput,
};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::fleet::FleetIndex;
use bc_projections::placement::{self, Selector};
use bc_projections::{NodeDoc, NodeState, PoolDoc, QuotaDoc, ReservationDoc, ReservationState};

use crate::support;

const TENANT: &str = "ten_01kb0000000000000000000000";
const POOL: &str = "pool_01kb0000000000000000000000";
const OTHER_POOL: &str = "pool_01kb0000000000000000000001";
const NOW_MS: u64 = 1_000_000;

fn pool(max_reservation_s: u64) -> PoolDoc {
    PoolDoc {
        tenant_id: TENANT.into(),
        pool_id: POOL.into(),
        name: "p".into(),
        description: String::new(),
        labels: BTreeMap::new(),
        max_reservation_s,
        archived: false,
        site_id: None,
        offered_to: Default::default(),
        version: 3,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

/// A ready node of `pool` with `gpus` H100s in NVLink domain 0, version 7.
fn node(id: &str, pool: &str, gpus: u32) -> NodeDoc {
    NodeDoc {
        tenant_id: TENANT.into(),
        node_id: id.into(),
        pool_id: pool.into(),
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

fn queued(id: &str, pool: &str, gpus: u32, request_seq: u64) -> ReservationDoc {
    let request = ev::ReservationRequested {
        pool_id: pool.into(),
        gpus,
        duration_s: 60,
        selector: String::new(),
        nvlink: false,
        tolerations: vec![],
        project_id: None,
    };
    ReservationDoc::requested(TENANT.into(), id.into(), request, request_seq, 0, 1)
}

/// The command id every test decision draws.
const ISSUE: placement::Issue<'static> = placement::Issue { command_id: "cmd_01", now_ms: NOW_MS };

/// An active reservation holding `gpu_indexes` of `node` (whose allocations the caller sets).
fn active(id: &str, node: &str, gpu_indexes: Vec<u32>, ends_at_ms: u64) -> ReservationDoc {
    ReservationDoc {
        state: ReservationState::Active,
        node_id: Some(node.into()),
        gpus: gpu_indexes.len() as u32,
        gpu_indexes,
        activated_at_ms: Some(ends_at_ms.saturating_sub(60_000)),
        ends_at_ms: Some(ends_at_ms),
        version: 2,
        ..queued(id, POOL, 0, 1)
    }
}

fn hold_on(node: &mut NodeDoc, rsv: &ReservationDoc) {
    for gpu in &rsv.gpu_indexes {
        node.allocations.insert(*gpu, rsv.reservation_id.clone());
    }
}

fn ask(gpus: u32, duration_s: u64) -> ReservationAsk {
    ReservationAsk {
        pool: pool(3600),
        gpus,
        duration_s,
        selector_text: String::new(),
        selector: Selector::default(),
        nvlink: false,
        tolerations: vec![],
        project: None,
    }
}

fn input(reservation_id: &str) -> ReservationCreateInput<'_> {
    ReservationCreateInput { reservation_id, command_id: "cmd_01", now_ms: NOW_MS, actor: "apikey:key_1", replay: false }
}

fn quota(gpus: u32) -> QuotaDoc {
    QuotaDoc { tenant_id: TENANT.into(), pool_id: POOL.into(), gpus, version: 1, updated_at_ms: 0, ..QuotaDoc::default() }
}

fn guard_of(append: &Append, stream: &str) -> Option<ExpectedVersion> {
    append.guards.iter().find(|(s, _)| s == stream).map(|(_, v)| *v)
}

#[test]
fn create_over_quota_is_refused_with_a_record() {
    let mut a = node("node_a", POOL, 8);
    let running = active("rsv_run", "node_a", vec![0, 1, 2], NOW_MS + 60_000);
    hold_on(&mut a, &running);
    let mut view = FleetIndex::new([a], [running]);
    let decision = decide::reservation_create(&view, Some(&quota(4)), &ask(2, 60), &input("rsv_new")).unwrap();
    let ReservationCreate::OverQuota { refusal, record } = &decision else { panic!("not refused: {decision:?}") };
    assert_eq!(*refusal, Refusal::OverQuota { pool_id: POOL.into(), requested: 2, in_use: 3, limit: 4 });
    assert_eq!(record.stream, format!("quota/{POOL}"));
    assert_eq!(record.expected, ExpectedVersion::Any);
    assert_eq!(record.event_types(), [ev::QUOTA_EXCEEDED]);
    let payload: ev::QuotaExceeded = serde_json::from_value(bc_core::canonical::to_json(&record.events[0].payload)).unwrap();
    assert_eq!(payload, ev::QuotaExceeded { requested: 2, in_use: 3, limit: 4, actor: "apikey:key_1".into() });
    let error = Error::from(refusal.clone());
    assert_eq!(error.code(), ErrorCode::QuotaExceeded);
    assert!(error.to_string().contains("take the tenant to 5 of its quota of 4"), "{error}");
    // A refusal holds nothing in the view.
    decision.hold(&mut view);
    assert_eq!(view.live().len(), 1);
    // Within the quota, the same request is placed.
    let placed = decide::reservation_create(&view, Some(&quota(5)), &ask(2, 60), &input("rsv_new")).unwrap();
    assert!(matches!(placed, ReservationCreate::Place { .. }), "{placed:?}");
}

#[test]
fn create_queues_behind_the_pools_queue_and_holds_its_place() {
    let view_nodes = [node("node_a", POOL, 8)];
    let mut view = FleetIndex::new(view_nodes, [queued("rsv_first", POOL, 8, 10)]);
    let decision = decide::reservation_create(&view, None, &ask(1, 60), &input("rsv_second")).unwrap();
    let ReservationCreate::Queue { pending: Some(pending), append } = &decision else { panic!("not queued: {decision:?}") };
    assert_eq!(append.stream, "reservation/rsv_second");
    assert_eq!(append.expected, ExpectedVersion::NoStream);
    assert_eq!(append.event_types(), [ev::RESERVATION_REQUESTED]);
    assert_eq!(append.guards, [(format!("pool/{POOL}"), ExpectedVersion::Exact(3))]);
    assert_eq!(pending.state, ReservationState::Queued);
    decision.hold(&mut view);
    let load = view.pool_load(POOL);
    assert_eq!(load.queued.len(), 2);
    assert_eq!(load.position(&view.live()["rsv_first"]), Some(1));
    assert_eq!(load.position(&view.live()["rsv_second"]), Some(2), "a new request is last in line");
    // A third asks after both.
    let third = decide::reservation_create(&view, None, &ask(1, 60), &input("rsv_third")).unwrap();
    third.hold(&mut view);
    assert_eq!(view.pool_load(POOL).position(&view.live()["rsv_first"]), Some(1));
    assert_eq!(view.pool_load(POOL).queued_gpus, 10);
}

#[test]
fn create_places_at_the_tightest_fit_and_holds_the_gpus() {
    let mut roomy = node("node_a", POOL, 8);
    roomy.version = 4;
    let mut tight = node("node_b", POOL, 4);
    let running = active("rsv_run", "node_b", vec![0, 1], NOW_MS + 60_000);
    hold_on(&mut tight, &running);
    let mut view = FleetIndex::new([roomy, tight, node("node_c", OTHER_POOL, 2)], [running]);
    let decision = decide::reservation_create(&view, None, &ask(2, 60), &input("rsv_new")).unwrap();
    let ReservationCreate::Place { placement, append, if_lost, pending } = &decision else { panic!("not placed: {decision:?}") };
    assert_eq!((placement.node_id.as_str(), placement.gpus.as_slice(), placement.leftover), ("node_b", &[2, 3][..], 0));
    assert_eq!(append.stream, "reservation/rsv_new");
    assert_eq!(append.expected, ExpectedVersion::NoStream);
    assert_eq!(append.event_types(), [ev::RESERVATION_REQUESTED, ev::RESERVATION_ACTIVATED, ev::NODE_ALLOCATED]);
    assert_eq!(append.events[2].stream.as_deref(), Some("node/node_b"));
    assert_eq!(guard_of(append, "node/node_b"), Some(ExpectedVersion::Exact(7)), "the node at the version read");
    assert_eq!(guard_of(append, &format!("pool/{POOL}")), Some(ExpectedVersion::Exact(3)));
    let activated: ev::ReservationActivated =
        serde_json::from_value(bc_core::canonical::to_json(&append.events[1].payload)).unwrap();
    assert_eq!(activated.ends_at_ms, NOW_MS + 60_000, "ends at now plus the duration");
    assert_eq!(if_lost.event_types(), [ev::RESERVATION_REQUESTED], "a lost race queues the request");
    assert_eq!(pending.state, ReservationState::Active);
    assert_eq!(decision.held_node(), Some("node_b"));
    decision.hold(&mut view);
    assert_eq!(view.nodes()["node_b"].allocations.get(&2).map(String::as_str), Some("rsv_new"));
    assert!(view.is_held("node_b"));
    assert_eq!(view.nodes()["node_b"].version, 7, "a hold does not move the version a guard names");
    // The next request in this process goes to a node with no placement in flight.
    let next = decide::reservation_create(&view, None, &ask(1, 60), &input("rsv_next")).unwrap();
    assert_eq!(next.held_node(), Some("node_a"), "{next:?}");
}

#[test]
fn create_refuses_what_no_node_could_ever_hold_and_queues_a_replay() {
    let view = FleetIndex::new([node("node_a", POOL, 4), node("node_c", OTHER_POOL, 16)], []);
    let refusal = decide::reservation_create(&view, None, &ask(8, 60), &input("rsv_big")).unwrap_err();
    assert_eq!(refusal, Refusal::NeverFits { pool_id: POOL.into(), gpus: 8, selector: String::new(), nvlink: false });
    let error = Error::from(refusal);
    assert_eq!(error.code(), ErrorCode::InvalidState, "it depends on the fleet, not on the request alone");
    assert!(error.to_string().contains("could ever hold 8 GPUs"), "{error}");
    assert!(error.hint().is_some_and(|h| h.contains("capacity")), "{error:?}");
    // A retry of a request already made replays it, whatever the fleet says now.
    let replay = ReservationCreateInput { replay: true, ..input("rsv_big") };
    let decision = decide::reservation_create(&view, Some(&quota(0)), &ask(8, 60), &replay).unwrap();
    assert!(matches!(&decision, ReservationCreate::Queue { pending: None, .. }), "{decision:?}");
}

#[test]
fn asks_past_the_pools_maximum_or_in_an_archived_pool_are_refused() {
    let refusal = ask(1, 3601).check_pool().unwrap_err();
    assert_eq!(refusal, Refusal::DurationPastPoolMaximum { duration_s: 3601, max_reservation_s: 3600 });
    assert!(Error::from(refusal).to_string().contains("maximum"));
    let mut archived = ask(1, 60);
    archived.pool.archived = true;
    assert_eq!(archived.check_pool().unwrap_err(), Refusal::PoolArchived { pool_id: POOL.into() });
    assert!(ask(1, 3600).check_pool().is_ok());
}

/// A refusal that depends on what is stored (the pool's maximum and state, the fleet, the
/// reservation's state, the tenant's counts) is INVALID_STATE (409), with what to do next: the
/// same request may succeed in another state, so it is no usage mistake (INVALID_ARGUMENT, 400,
/// exit 2), which a client checking its requests against the schema could never have avoided.
#[test]
fn refusals_that_depend_on_state_are_invalid_state_with_a_hint() {
    let refusals = [
        Refusal::PoolArchived { pool_id: POOL.into() },
        Refusal::DurationPastPoolMaximum { duration_s: 3601, max_reservation_s: 3600 },
        Refusal::NeverFits { pool_id: POOL.into(), gpus: 8, selector: "vramGiB >= 80".into(), nvlink: true },
        Refusal::NotActive { reservation_id: "rsv_q".into(), state: ReservationState::Queued },
        Refusal::ExtendPastPoolMaximum { by_s: 601, max_reservation_s: 3600 },
        Refusal::TooManyNodeKeys { node_id: "node_1".into(), what: "taints", count: 65 },
        Refusal::TooManyNodes { count: 4096 },
        Refusal::InstanceMismatch("flavor f has 2 GPUs; the reservation holds 1".into()),
        Refusal::HeldForOther { reservation_id: "rsv_h".into(), holder_tenant_id: "ten_b".into() },
        Refusal::OfferWithdrawn { reservation_id: "rsv_h".into(), pool_id: "pool_1".into(), tenant_id: "ten_b".into() },
    ];
    for refusal in refusals {
        let error = Error::from(refusal.clone());
        assert_eq!(error.code(), ErrorCode::InvalidState, "{refusal:?}");
        assert_eq!(error.to_string(), refusal.to_string(), "the message is the refusal's");
        assert!(error.hint().is_some_and(|h| !h.is_empty()), "{refusal:?} says what to do next");
    }
}

#[test]
fn extend_stays_within_the_pools_maximum() {
    let started = NOW_MS;
    let rsv = ReservationDoc { activated_at_ms: Some(started), ..active("rsv_a", "node_a", vec![0], started + 3_000_000) };
    let pool = pool(3600);
    let append = decide::reservation_extend(&rsv, &pool, 600, None).unwrap();
    assert_eq!(append.stream, "reservation/rsv_a");
    assert_eq!(append.expected, ExpectedVersion::Exact(2));
    assert_eq!(append.event_types(), [ev::RESERVATION_EXTENDED]);
    let extended: ev::ReservationExtended =
        serde_json::from_value(bc_core::canonical::to_json(&append.events[0].payload)).unwrap();
    assert_eq!(extended.ends_at_ms, started + 3_600_000);
    assert_eq!(
        decide::reservation_extend(&rsv, &pool, 601, None).unwrap_err(),
        Refusal::ExtendPastPoolMaximum { by_s: 601, max_reservation_s: 3600 }
    );
    let waiting = queued("rsv_q", POOL, 1, 5);
    assert_eq!(
        decide::reservation_extend(&waiting, &pool, 1, None).unwrap_err(),
        Refusal::NotActive { reservation_id: "rsv_q".into(), state: ReservationState::Queued }
    );
    let stale = decide::reservation_extend(&rsv, &pool, 1, Some(1)).unwrap_err();
    assert_eq!(stale, Refusal::VersionMismatch { reservation_id: "rsv_a".into(), expected: 1, actual: 2 });
    assert_eq!(Error::from(stale).code(), ErrorCode::Conflict);
}

#[test]
fn release_cancels_a_queued_reservation_and_frees_an_active_ones_gpus() {
    let waiting = queued("rsv_q", POOL, 2, 5);
    let cancel = decide::reservation_release(&waiting, None, ISSUE).unwrap().unwrap();
    assert_eq!(cancel.event_types(), [ev::RESERVATION_CANCELLED]);
    assert_eq!((cancel.stream.as_str(), cancel.expected), ("reservation/rsv_q", ExpectedVersion::Exact(1)));
    assert!(cancel.guards.is_empty(), "a queued reservation holds no GPUs");

    let running = active("rsv_a", "node_a", vec![0, 1], NOW_MS);
    let release = decide::reservation_release(&running, Some(2), ISSUE).unwrap().unwrap();
    assert_eq!(release.event_types(), [ev::RESERVATION_RELEASED, ev::NODE_FREED]);
    assert_eq!(release.events[1].stream.as_deref(), Some("node/node_a"));
    assert_eq!(release.expected, ExpectedVersion::Exact(2));
    assert_eq!(guard_of(&release, "node/node_a"), Some(ExpectedVersion::Any), "freeing commutes on the node");

    for state in [ReservationState::Released, ReservationState::Expired, ReservationState::Cancelled] {
        let over = ReservationDoc { state, ..running.clone() };
        assert_eq!(decide::reservation_release(&over, None, ISSUE).unwrap(), None, "releasing again changes nothing");
    }
    assert!(matches!(decide::reservation_release(&running, Some(1), ISSUE), Err(Refusal::VersionMismatch { .. })));
    let broken = ReservationDoc { node_id: None, ..running };
    assert!(matches!(decide::reservation_release(&broken, None, ISSUE), Err(Refusal::Internal(_))));
}

/// node_a (4 GPUs) is full with `rsv_done`, due now; node_b (2 GPUs) is free. Queue of POOL:
/// `rsv_big` (4 GPUs, oldest), `rsv_small` (2), `rsv_late` (2). OTHER_POOL: `rsv_other` (1).
fn busy_view() -> FleetIndex {
    let mut a = node("node_a", POOL, 4);
    let done = active("rsv_done", "node_a", vec![0, 1, 2, 3], NOW_MS);
    hold_on(&mut a, &done);
    let mut still = node("node_s", POOL, 1);
    let running = active("rsv_running", "node_s", vec![0], NOW_MS + 1);
    hold_on(&mut still, &running);
    FleetIndex::new(
        [a, node("node_b", POOL, 2), still, node("node_o", OTHER_POOL, 1)],
        [
            done,
            running,
            queued("rsv_small", POOL, 2, 21),
            queued("rsv_big", POOL, 4, 20),
            queued("rsv_late", POOL, 2, 22),
            queued("rsv_other", OTHER_POOL, 1, 23),
        ],
    )
}

#[test]
fn plan_expires_first_then_activates_each_pool_oldest_first() {
    let actions = decide::plan(&busy_view(), NOW_MS);
    let summary: Vec<(&str, &str)> = actions
        .iter()
        .map(|a| {
            let kind = match a {
                Action::Expire { .. } => "expire",
                Action::HoldFailed { .. } => "hold failed",
                Action::Activate { .. } => "activate",
                Action::Skip { .. } => "skip",
                Action::Withdraw { .. } => "withdraw",
            };
            (kind, a.reservation_id())
        })
        .collect();
    assert_eq!(
        summary,
        [("expire", "rsv_done"), ("activate", "rsv_big"), ("activate", "rsv_small"), ("activate", "rsv_other")],
        "rsv_running ends after now; rsv_late finds no room once rsv_small took node_b"
    );
    let Action::Activate { placement, freed_by, ends_at_ms, .. } = &actions[1] else { unreachable!() };
    assert_eq!((placement.node_id.as_str(), placement.gpus.as_slice()), ("node_a", &[0, 1, 2, 3][..]));
    assert_eq!(placement.node_version, 8, "the node's version once the expiry's node.freed lands");
    assert_eq!(freed_by, &["rsv_done".to_owned()]);
    assert_eq!(*ends_at_ms, NOW_MS + 60_000);
    let Action::Activate { placement, freed_by, .. } = &actions[2] else { unreachable!() };
    assert_eq!((placement.node_id.as_str(), placement.node_version), ("node_b", 7));
    assert!(freed_by.is_empty());

    let expire = actions[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(expire.event_types(), [ev::RESERVATION_EXPIRED, ev::NODE_FREED]);
    assert_eq!(expire.expected, ExpectedVersion::Exact(2));
    let activate = actions[1].append(ISSUE).unwrap().unwrap();
    assert_eq!(activate.stream, "reservation/rsv_big");
    assert_eq!(activate.expected, ExpectedVersion::Exact(1));
    assert_eq!(activate.event_types(), [ev::RESERVATION_ACTIVATED, ev::NODE_ALLOCATED]);
    assert_eq!(guard_of(&activate, "node/node_a"), Some(ExpectedVersion::Exact(8)));
}

#[test]
fn plan_never_lets_a_small_request_overtake_one_that_does_not_fit_yet() {
    // Before rsv_done ends, rsv_big does not fit: nothing of POOL is activated, though
    // rsv_small would fit on node_b; the other pool's queue goes on.
    let actions = decide::plan(&busy_view(), NOW_MS - 1);
    let ids: Vec<&str> = actions.iter().map(Action::reservation_id).collect();
    assert_eq!(ids, ["rsv_other"]);
}

#[test]
fn plan_skips_an_unreadable_selector_without_stopping_the_queue() {
    let mut view = busy_view();
    let mut big = view.remove_live("rsv_big").unwrap();
    big.selector = "gpuColour = red".into();
    view.put_live(big);
    let actions = decide::plan(&view, NOW_MS - 1);
    assert!(matches!(&actions[0], Action::Skip { reservation_id, .. } if reservation_id == "rsv_big"), "{actions:?}");
    assert_eq!(actions[0].append(ISSUE).unwrap(), None);
    assert!(matches!(&actions[1], Action::Activate { reservation_id, .. } if reservation_id == "rsv_small"));
}

#[test]
fn a_plan_is_deterministic_for_the_same_view_and_time() {
    let first = decide::plan(&busy_view(), NOW_MS);
    for _ in 0..20 {
        // Each view's maps iterate in their own order; the plan must not depend on it.
        let view = busy_view();
        assert_eq!(decide::plan(&view, NOW_MS), first);
        let appends: Vec<Option<Append>> = first.iter().map(|a| a.append(ISSUE).unwrap()).collect();
        assert_eq!(decide::plan(&view, NOW_MS).iter().map(|a| a.append(ISSUE).unwrap()).collect::<Vec<_>>(), appends);
    }
    assert_ne!(decide::plan(&busy_view(), NOW_MS - 1), first, "and it does depend on the time");
}

#[test]
fn capacity_counts_free_reserved_and_unavailable_gpus() {
    let mut view = busy_view();
    let mut node_b = view.nodes()["node_b"].clone();
    node_b.state = NodeState::Cordoned;
    view.put_node(node_b);
    let capacity = decide::pool_capacity(&pool(3600), &view);
    assert_eq!((capacity.nodes, capacity.gpus, capacity.free, capacity.reserved, capacity.unavailable), (3, 7, 0, 5, 2));
    assert_eq!((capacity.queued, capacity.queued_gpus), (3, 8));
    assert_eq!(capacity.by_model.len(), 1);
    let json = serde_json::to_value(&capacity).unwrap();
    assert_eq!(json["queuedGpus"], 8);
    assert_eq!(json["byProduct"][0]["product"], "H100-SXM5-80GB");

    let preview = decide::capacity_preview(&view, &ask(1, 60));
    assert!(preview.possible && !preview.fits && !preview.fits_ignoring_queue, "{preview:?}");
    assert_eq!(preview.queued_ahead, 3);
}

#[test]
fn states_are_stored_as_the_lowercase_words() {
    for state in ReservationState::ALL {
        assert_eq!(serde_json::to_value(state).unwrap(), state.as_str());
        assert_eq!(state.as_str().parse::<ReservationState>().unwrap(), *state);
    }
    for state in NodeState::ALL {
        assert_eq!(serde_json::to_value(state).unwrap(), state.as_str());
        assert_eq!(state.as_str().parse::<NodeState>().unwrap(), *state);
    }
    let error = "done".parse::<ReservationState>().unwrap_err();
    assert_eq!(error.code(), ErrorCode::InvalidArgument);
    assert!(error.to_string().contains("not a reservation state"), "{error}");
    assert_eq!(error.hint(), Some("queued, active, released, expired, cancelled, failed"));
    assert!("Ready".parse::<NodeState>().is_err());
}

/// Regression: labels and taints added up on a node without a cap, and a tenant's
/// nodes had no limit. A change is checked against the node's keys after it (remove, then
/// set), and a registration against the tenant's count.
#[test]
fn node_keys_and_nodes_per_tenant_are_capped() {
    use bc_projections::decide::{NODE_KEYS_MAX, NODES_PER_TENANT_MAX, Refusal, node_keys_change, node_register};
    let full: BTreeMap<String, String> = (0..NODE_KEYS_MAX).map(|i| (format!("k{i}"), "v".to_owned())).collect();
    let one_more: BTreeMap<String, String> = [("new".to_owned(), "v".to_owned())].into();
    let refused = node_keys_change("node_1", "labels", &full, &one_more, &[]).unwrap_err();
    assert_eq!(refused, Refusal::TooManyNodeKeys { node_id: "node_1".into(), what: "labels", count: NODE_KEYS_MAX + 1 });
    assert_eq!(Error::from(refused).code(), ErrorCode::InvalidState);
    // Replacing a key, or removing one to make room, is within the cap.
    assert!(node_keys_change("node_1", "labels", &full, &one_more, &["k0".into()]).is_ok());
    let replaced: BTreeMap<String, String> = [("k1".to_owned(), "w".to_owned())].into();
    assert!(node_keys_change("node_1", "taints", &full, &replaced, &[]).is_ok());
    assert!(node_register(NODES_PER_TENANT_MAX - 1).is_ok());
    assert_eq!(node_register(NODES_PER_TENANT_MAX), Err(Refusal::TooManyNodes { count: NODES_PER_TENANT_MAX }));
}

/// A node that joined with `bcd`: its GPUs have UUIDs, and holds go to its agent.
fn agent_node(id: &str, gpus: u32) -> NodeDoc {
    NodeDoc {
        gpu_uuids: (0..gpus).map(|i| format!("GPU-{id}-{i}")).collect(),
        agent: Some(bc_projections::NodeAgent {
            reachable: true,
            lease_expires_at_ms: NOW_MS + 60_000,
            ..bc_projections::NodeAgent::joined(String::new(), "test".into(), id.into(), "jt_1".into(), 0)
        }),
        ..node(id, POOL, gpus)
    }
}

/// An active reservation on `node` whose binding is in `state`.
fn bound(rsv: ReservationDoc, state: bc_projections::BindingState, deadline_at_ms: u64, reason: Option<&str>) -> ReservationDoc {
    ReservationDoc {
        binding: Some(bc_projections::Binding {
            state,
            hold_command_id: Some("cmd_hold".into()),
            deadline_at_ms: Some(deadline_at_ms),
            release_command_id: None,
            gpu_uuids: vec![],
            reason: reason.map(str::to_owned),
            changed_at_ms: 0,
        }),
        ..rsv
    }
}

/// On a node with an agent, an activation sends the node `gpu.hold` for the GPUs' UUIDs in the
/// same append, and the reservation's binding waits on that command; on a node registered by
/// hand it does not.
#[test]
fn an_activation_on_an_agent_node_issues_gpu_hold_in_the_same_append() {
    let view = FleetIndex::new([agent_node("node_g", 4)], [queued("rsv_q", POOL, 2, 5)]);
    let actions = decide::plan(&view, NOW_MS);
    let append = actions[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(append.event_types(), [ev::RESERVATION_ACTIVATED, ev::NODE_ALLOCATED, ev::COMMAND_ISSUED]);
    let issued = &append.events[2];
    assert_eq!(issued.stream.as_deref(), Some("command/cmd_01"));
    let command = bc_core::canonical::to_json(&issued.payload);
    assert_eq!(command["kind"], "gpu.hold");
    assert_eq!(command["args"]["gpuUuids"], serde_json::json!(["GPU-node_g-0", "GPU-node_g-1"]));
    assert_eq!(command["args"]["reservationId"], "rsv_q");
    let activated = bc_core::canonical::to_json(&append.events[0].payload);
    assert_eq!(activated["hold"]["commandId"], "cmd_01");
    assert_eq!(activated["hold"]["deadlineAtMs"], NOW_MS + bc_projections::HOLD_DEADLINE_S * 1000);

    let by_hand = FleetIndex::new([node("node_h", POOL, 4)], [queued("rsv_q", POOL, 2, 5)]);
    let append = decide::plan(&by_hand, NOW_MS)[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(append.event_types(), [ev::RESERVATION_ACTIVATED, ev::NODE_ALLOCATED]);
}

/// A failed hold frees the GPUs and requeues the reservation, which is then next in its pool:
/// nothing behind it is activated in the same pass, and the next pass places it on another
/// node than the one that failed when one fits. After `HOLD_ATTEMPTS_MAX` failures it fails.
#[test]
fn a_failed_hold_requeues_at_the_head_then_fails_after_the_last_attempt() {
    use bc_projections::BindingState;
    let mut bad = agent_node("node_bad", 2);
    let rsv = bound(
        active("rsv_a", "node_bad", vec![0, 1], NOW_MS + 60_000),
        BindingState::Failed,
        NOW_MS + 1,
        Some("gpu-in-use: GPU-0 runs 1 processes"),
    );
    hold_on(&mut bad, &rsv);
    let view = FleetIndex::new([bad.clone(), agent_node("node_good", 2)], [rsv.clone(), queued("rsv_later", POOL, 2, 9)]);
    let actions = decide::plan(&view, NOW_MS);
    assert_eq!(actions.len(), 1, "rsv_later does not overtake the requeued one: {actions:?}");
    let Action::HoldFailed { reason, attempts, gives_up, release, .. } = &actions[0] else { panic!("{actions:?}") };
    assert_eq!((reason.as_str(), *attempts, *gives_up, *release), ("gpu-in-use: GPU-0 runs 1 processes", 1, false, true));
    let append = actions[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(
        append.event_types(),
        [ev::RESERVATION_REQUEUED, ev::NODE_FREED, ev::COMMAND_ISSUED],
        "a node that refused may still hold them (bound, then lost its answer): released anyway"
    );
    assert_eq!(append.expected, ExpectedVersion::Exact(rsv.version));

    // Requeued (as the fold leaves it): placed on the node that did not fail.
    let requeued = ReservationDoc { hold_attempts: 1, hold_failed_nodes: vec!["node_bad".into()], ..queued("rsv_a", POOL, 2, 1) };
    let view = FleetIndex::new([agent_node("node_bad", 2), agent_node("node_good", 2)], [requeued.clone()]);
    let Action::Activate { placement, .. } = &decide::plan(&view, NOW_MS)[0] else { panic!() };
    assert_eq!(placement.node_id, "node_good");
    // Only the failing node fits: it is tried again rather than waiting for ever.
    let view = FleetIndex::new([agent_node("node_bad", 2)], [requeued]);
    assert!(matches!(&decide::plan(&view, NOW_MS)[0], Action::Activate { placement, .. } if placement.node_id == "node_bad"));

    // The last attempt fails the reservation instead.
    let last = ReservationDoc { hold_attempts: bc_projections::HOLD_ATTEMPTS_MAX - 1, ..rsv };
    let view = FleetIndex::new([bad], [last]);
    let actions = decide::plan(&view, NOW_MS);
    assert!(matches!(&actions[0], Action::HoldFailed { gives_up: true, attempts: 3, .. }), "{actions:?}");
    assert_eq!(
        actions[0].append(ISSUE).unwrap().unwrap().event_types(),
        [ev::RESERVATION_FAILED, ev::NODE_FREED, ev::COMMAND_ISSUED]
    );
}

/// A hold the node never answers counts as failed at its deadline, and the node is sent
/// `gpu.release` in case it holds the GPUs after all; before the deadline nothing happens.
#[test]
fn an_unanswered_hold_fails_at_its_deadline_and_sends_a_release() {
    use bc_projections::BindingState;
    let mut n = agent_node("node_g", 2);
    let rsv = bound(active("rsv_a", "node_g", vec![0, 1], NOW_MS + 600_000), BindingState::Pending, NOW_MS, None);
    hold_on(&mut n, &rsv);
    let view = FleetIndex::new([n], [rsv]);
    assert!(decide::plan(&view, NOW_MS - 1).is_empty());
    let actions = decide::plan(&view, NOW_MS);
    let Action::HoldFailed { reason, release: true, .. } = &actions[0] else { panic!("{actions:?}") };
    assert!(reason.starts_with("hold-timeout:"), "{reason}");
    let append = actions[0].append(ISSUE).unwrap().unwrap();
    assert_eq!(append.event_types(), [ev::RESERVATION_REQUEUED, ev::NODE_FREED, ev::COMMAND_ISSUED]);
    assert_eq!(bc_core::canonical::to_json(&append.events[2].payload)["kind"], "gpu.release");
}

/// Releasing a reservation whose node holds its GPUs sends `gpu.release` with the release.
#[test]
fn releasing_a_bound_reservation_sends_gpu_release() {
    use bc_projections::BindingState;
    let rsv = bound(active("rsv_a", "node_g", vec![0], NOW_MS + 60_000), BindingState::Bound, NOW_MS, None);
    let append = decide::reservation_release(&rsv, None, ISSUE).unwrap().unwrap();
    assert_eq!(append.event_types(), [ev::RESERVATION_RELEASED, ev::NODE_FREED, ev::COMMAND_ISSUED]);
    let failed = bound(rsv, BindingState::Failed, NOW_MS, Some("x"));
    let append = decide::reservation_release(&failed, None, ISSUE).unwrap().unwrap();
    assert_eq!(append.event_types(), [ev::RESERVATION_RELEASED, ev::NODE_FREED], "a failed hold holds nothing");
}

/// Under a quota, the request is charged on the quota's stream at the version
/// the decision read, whether placed or queued, so a decision on stale usage cannot land.
#[test]
fn a_reservation_under_a_quota_is_charged_at_the_quota_version_read() {
    let view = FleetIndex::new([node("node_a", POOL, 4)], []);
    let q = quota(8);
    let ReservationCreate::Place { append, if_lost, .. } =
        decide::reservation_create(&view, Some(&q), &ask(1, 60), &input("rsv_q")).unwrap()
    else {
        panic!("placed")
    };
    for a in [&append, &if_lost] {
        assert_eq!(guard_of(a, &format!("quota/{POOL}")), Some(ExpectedVersion::Exact(q.version)));
        assert_eq!(a.events.last().map(|e| e.event_type.as_str()), Some(ev::QUOTA_CHARGED));
    }
    // Without a quota nothing is charged, and a replay charges nothing again.
    let ReservationCreate::Place { append, .. } = decide::reservation_create(&view, None, &ask(1, 60), &input("rsv_q")).unwrap()
    else {
        panic!("placed")
    };
    assert!(!append.event_types().contains(&ev::QUOTA_CHARGED));
    let replay = ReservationCreateInput { replay: true, ..input("rsv_q") };
    let ReservationCreate::Queue { append, .. } = decide::reservation_create(&view, Some(&q), &ask(1, 60), &replay).unwrap()
    else {
        panic!("queued")
    };
    assert!(!append.event_types().contains(&ev::QUOTA_CHARGED));
}

// Instances: create on a bound reservation, requests, and the instances reconciler's plan.

use bc_projections::decide::{InstanceAction, InstanceCreateInput, InstanceRequest};
use bc_projections::events::{DesiredState, ObservedState};
use bc_projections::{FlavorDoc, ImageDoc, InstanceDoc, InstanceState};

fn flavor(gpus: u32) -> FlavorDoc {
    FlavorDoc {
        tenant_id: TENANT.into(),
        flavor_id: "flv_1".into(),
        pool_id: POOL.into(),
        name: "f".into(),
        vcpus: 4,
        memory_mib: 2048,
        disk_gib: 10,
        gpus,
        version: 1,
        created_at_ms: 0,
    }
}

fn image() -> ImageDoc {
    ImageDoc {
        tenant_id: TENANT.into(),
        image_id: "img_1".into(),
        name: "i".into(),
        url: "https://images.example/u.qcow2".into(),
        sha256: "ab".repeat(32),
        disk_format: ev::DiskFormat::Qcow2,
        size_bytes: None,
        channel: ev::ImageChannel::Testing,
        version: 1,
        created_at_ms: 0,
    }
}

/// An agent node whose inventory says it runs instances (or not).
fn instance_node(runs_instances: bool) -> NodeDoc {
    let mut node = agent_node("node_g", 4);
    let capabilities = if runs_instances { vec!["gpu.hold".to_owned(), "instance.apply".to_owned()] } else { vec![] };
    node.agent.as_mut().unwrap().inventory = Some(ev::NodeInventoryReported {
        node_id: "node_g".into(),
        gpus: vec![],
        driver_version: None,
        cuda_version: None,
        unavailable: None,
        host: ev::InventoryHost {
            cpus: 8,
            memory_kib: 1 << 24,
            cpu_model: None,
            vendor: None,
            product: None,
            serial: None,
            disks: vec![],
        },
        capabilities,
        hold_unavailable: None,
        volume_file_system_bytes: None,
        journal: None,
    });
    node
}

/// An active reservation of 2 GPUs on node_g, bound by its agent.
fn bound_reservation() -> ReservationDoc {
    let mut rsv = bound(active("rsv_a", "node_g", vec![0, 1], NOW_MS + 60_000), bc_projections::BindingState::Bound, 0, None);
    rsv.binding.as_mut().unwrap().gpu_uuids = vec!["GPU-node_g-0".into(), "GPU-node_g-1".into()];
    rsv
}

#[test]
fn an_instance_is_made_only_on_a_bound_reservation_with_a_fitting_flavor() {
    let (node, rsv, flavor2, image) = (instance_node(true), bound_reservation(), flavor(2), image());
    fn input<'a>(
        rsv: &'a ReservationDoc,
        node: &'a NodeDoc,
        flavor: &'a FlavorDoc,
        image: &'a ImageDoc,
    ) -> InstanceCreateInput<'a> {
        InstanceCreateInput { instance_id: "inst_1", name: "vm", reservation: rsv, node, flavor, image, start: true, quota: None }
    }
    let append = decide::instance_create(&input(&rsv, &node, &flavor2, &image), ISSUE).unwrap();
    assert_eq!(append.stream, "instance/inst_1");
    assert_eq!(append.expected, ExpectedVersion::NoStream);
    assert_eq!(append.event_types(), [ev::INSTANCE_CREATED, ev::COMMAND_ISSUED, ev::RESERVATION_INSTANCE_ATTACHED]);
    assert_eq!(guard_of(&append, "reservation/rsv_a"), Some(ExpectedVersion::Exact(rsv.version)), "two creates never both land");
    let command = bc_core::canonical::to_json(&append.events[1].payload);
    assert_eq!(command["kind"], "instance.apply");
    assert_eq!(command["args"]["gpus"], serde_json::json!(["GPU-node_g-0", "GPU-node_g-1"]));
    assert_eq!(command["args"]["desired"], "running");
    assert_eq!(command["args"]["image"]["sha256"], "ab".repeat(32));
    assert_eq!(command["deadlineAtMs"], NOW_MS + bc_projections::INSTANCE_APPLY_DEADLINE_S * 1000);

    let refused = |rsv: &ReservationDoc, node: &NodeDoc, flavor: &FlavorDoc| {
        let e: Error = decide::instance_create(&input(rsv, node, flavor, &image), ISSUE).unwrap_err().into();
        (e.code(), e.to_string())
    };
    let (code, _) = refused(&rsv, &node, &flavor(1));
    assert_eq!(code, ErrorCode::InvalidState, "a flavor with another GPU count");
    let (code, message) = refused(&rsv, &instance_node(false), &flavor2);
    assert_eq!(code, ErrorCode::Conflict);
    assert!(message.contains("instance.apply"), "{message}");
    let pending = bound(rsv.clone(), bc_projections::BindingState::Pending, 0, None);
    let (code, message) = refused(&pending, &node, &flavor2);
    assert_eq!((code, message.contains("pending")), (ErrorCode::Conflict, true), "{message}");
    let taken = ReservationDoc { instance_id: Some("inst_0".into()), ..rsv.clone() };
    assert!(refused(&taken, &node, &flavor2).1.contains("inst_0"));
    let queued_rsv = queued("rsv_q", POOL, 2, 1);
    assert_eq!(refused(&queued_rsv, &node, &flavor2).0, ErrorCode::Conflict);
    // Held for another tenant (a pool offered to it): its GPUs are that tenant's, so the owner,
    // on whose chain it lives, starts nothing on them, bound or not.
    let held = ReservationDoc { holder_tenant_id: Some("ten_b".into()), ..rsv.clone() };
    let (code, message) = refused(&held, &node, &flavor2);
    assert_eq!(code, ErrorCode::InvalidState, "{message}");
    assert!(message.contains("held for tenant ten_b"), "{message}");
}

/// An instance on a reservation made in a project is made in it: `instance.created` names the
/// reservation's project (what the instance's document and its usage meter fold); on a
/// reservation in no project, it names none.
#[test]
fn an_instance_takes_its_reservations_project() {
    let (node, flavor2, image) = (instance_node(true), flavor(2), image());
    let created = |rsv: &ReservationDoc| {
        let input = InstanceCreateInput {
            instance_id: "inst_1",
            name: "vm",
            reservation: rsv,
            node: &node,
            flavor: &flavor2,
            image: &image,
            start: true,
            quota: None,
        };
        let append = decide::instance_create(&input, ISSUE).unwrap();
        bc_core::canonical::to_json(&append.events[0].payload)
    };
    let in_project = ReservationDoc { project_id: Some("proj_1".into()), ..bound_reservation() };
    let payload = created(&in_project);
    assert_eq!(payload["projectId"], "proj_1", "{payload}");
    let parsed: ev::InstanceCreated = serde_json::from_value(payload).unwrap();
    assert_eq!(parsed.project_id.as_deref(), Some("proj_1"));
    let payload = created(&bound_reservation());
    assert!(payload.get("projectId").is_none(), "no project, no key: {payload}");
}

/// The document an instance has after its create was applied and the node answered `observed`.
fn instance(desired: DesiredState, observed: Option<ObservedState>, answered: bool) -> InstanceDoc {
    InstanceDoc {
        tenant_id: TENANT.into(),
        instance_id: "inst_1".into(),
        name: "vm".into(),
        pool_id: POOL.into(),
        node_id: "node_g".into(),
        reservation_id: "rsv_a".into(),
        project_id: None,
        shape: ev::InstanceShape { flavor_id: "flv_1".into(), vcpus: 4, memory_mib: 2048, disk_gib: 10 },
        gpus: vec!["GPU-node_g-0".into()],
        image: ev::InstanceImage {
            image_id: "img_1".into(),
            url: "https://images.example/u.qcow2".into(),
            sha256: "ab".repeat(32),
            disk_format: ev::DiskFormat::Qcow2,
            size_bytes: None,
        },
        desired,
        generation: 1,
        state: InstanceState::Pending,
        observed: observed.map(|state| bc_projections::instance::InstanceObserved {
            state,
            vcpus: Some(4),
            memory_mib: Some(2048),
            generation: 1,
            at_ms: NOW_MS,
        }),
        apply: bc_projections::instance::ApplyStatus {
            command_id: "cmd_apply".into(),
            generation: 1,
            deadline_at_ms: NOW_MS + 900_000,
            answered_at_ms: answered.then_some(NOW_MS),
            failed: None,
        },
        apply_attempts: 1,
        last_error: None,
        version: 4,
        created_at_ms: 0,
        updated_at_ms: NOW_MS,
    }
}

fn reservations(rsv: Option<ReservationDoc>) -> std::collections::HashMap<String, ReservationDoc> {
    rsv.into_iter().map(|r| (r.reservation_id.clone(), r)).collect()
}

#[test]
fn the_plan_applies_again_on_drift_after_a_back_off_and_gives_up_after_the_last_attempt() {
    let live = reservations(Some(bound_reservation()));
    let converged = instance(DesiredState::Running, Some(ObservedState::Running), true);
    assert!(converged.converged());
    assert_eq!(decide::instances_plan(std::slice::from_ref(&converged), &live, NOW_MS + 60_000), []);
    // Crashed behind the agent's back: applied again once the back-off has passed.
    let crashed = instance(DesiredState::Running, Some(ObservedState::Crashed), true);
    assert_eq!(decide::instances_plan(std::slice::from_ref(&crashed), &live, NOW_MS + 1), [], "within the back-off");
    let later = NOW_MS + bc_projections::instance::INSTANCE_REAPPLY_BACKOFF_MS;
    let actions = decide::instances_plan(std::slice::from_ref(&crashed), &live, later);
    let [InstanceAction::Reapply { reason, attempts: 2, version: 4, .. }] = actions.as_slice() else { panic!("{actions:?}") };
    assert!(reason.starts_with("drift: node node_g observes crashed, desired running"), "{reason}");
    let append = actions[0].append(&crashed, ISSUE).unwrap();
    assert_eq!(append.event_types(), [ev::INSTANCE_REAPPLIED, ev::COMMAND_ISSUED]);
    assert_eq!(append.expected, ExpectedVersion::Exact(4));
    // A shape the node does not have is a drift too.
    let mut small = converged.clone();
    small.observed.as_mut().unwrap().vcpus = Some(2);
    assert!(matches!(decide::instances_plan(&[small], &live, later).as_slice(), [InstanceAction::Reapply { .. }]));
    // The last attempt: failed, with the reason.
    let exhausted = InstanceDoc { apply_attempts: bc_projections::INSTANCE_APPLY_ATTEMPTS_MAX, ..crashed };
    let far = NOW_MS + 3_600_000;
    assert!(matches!(decide::instances_plan(&[exhausted], &live, far).as_slice(), [InstanceAction::Fail { attempts: 3, .. }]));
    // A failed apply is applied again with the node's own reason.
    let mut failed = instance(DesiredState::Running, None, true);
    failed.apply.failed = Some("image-digest: the bytes' SHA-256 is not the image's".into());
    let actions = decide::instances_plan(&[failed], &live, later);
    assert!(matches!(actions.as_slice(), [InstanceAction::Reapply { reason, .. }] if reason.starts_with("image-digest")));
}

#[test]
fn the_plan_times_out_unanswered_applies_deletes_on_ended_reservations_and_finishes_deletes() {
    let live = reservations(Some(bound_reservation()));
    let unanswered = instance(DesiredState::Running, None, false);
    assert_eq!(decide::instances_plan(std::slice::from_ref(&unanswered), &live, NOW_MS + 899_000), []);
    let actions = decide::instances_plan(&[unanswered], &live, NOW_MS + 900_001);
    assert!(matches!(actions.as_slice(), [InstanceAction::Reapply { reason, .. }] if reason.starts_with("apply-timeout")));

    // The reservation ended: the instance is deleted (a new generation, desired deleted).
    let running = instance(DesiredState::Running, Some(ObservedState::Running), true);
    let actions = decide::instances_plan(std::slice::from_ref(&running), &reservations(None), NOW_MS);
    let [InstanceAction::Delete { reason, .. }] = actions.as_slice() else { panic!("{actions:?}") };
    assert!(reason.starts_with("reservation-ended"));
    let append = actions[0].append(&running, ISSUE).unwrap();
    assert_eq!(append.event_types(), [ev::INSTANCE_DELETE_REQUESTED, ev::COMMAND_ISSUED]);
    let command = bc_core::canonical::to_json(&append.events[1].payload);
    assert_eq!((command["args"]["desired"].as_str(), command["args"]["generation"].as_u64()), (Some("deleted"), Some(2)));

    // Gone from the node after a delete: deleted, and detached from its reservation.
    let gone = instance(DesiredState::Deleted, Some(ObservedState::Absent), true);
    let actions = decide::instances_plan(std::slice::from_ref(&gone), &live, NOW_MS);
    assert!(matches!(actions.as_slice(), [InstanceAction::Deleted { reservation_version: Some(2), .. }]), "{actions:?}");
    let append = actions[0].append(&gone, ISSUE).unwrap();
    assert_eq!(append.event_types(), [ev::INSTANCE_DELETED, ev::RESERVATION_INSTANCE_DETACHED]);
    assert_eq!(guard_of(&append, "reservation/rsv_a"), Some(ExpectedVersion::Exact(2)));
    // A failed instance takes no action.
    let failed = InstanceDoc { state: InstanceState::Failed, ..instance(DesiredState::Running, None, false) };
    assert_eq!(decide::instances_plan(&[failed], &live, NOW_MS + 10_000_000), []);
}

/// Under a quota bounding instances, vCPUs or memory in the pool, an instance's create counts
/// one instance and its flavor's vCPUs and memory (`quota.counted` on the quota's stream, guarded
/// at the version read), a resize counts its growth; past a limit, QUOTA_EXCEEDED naming it.
#[test]
fn an_instance_is_counted_against_its_tenants_resource_limits() {
    use bc_projections::decide::quota::{QuotaRead, ResourceUse};
    let (node, flavor2, image) = (instance_node(true), flavor(2), image());
    let rsv = bound_reservation();
    let limits = QuotaDoc { instances: Some(2), vcpus: Some(8), memory_mib: Some(4096), version: 7, ..quota(8) };
    let create = |in_use: ResourceUse| {
        let input = InstanceCreateInput {
            instance_id: "inst_1",
            name: "vm",
            reservation: &rsv,
            node: &node,
            flavor: &flavor2,
            image: &image,
            start: true,
            quota: Some(QuotaRead { quota: &limits, in_use }),
        };
        decide::instance_create(&input, ISSUE)
    };
    let append = create(ResourceUse { instances: 1, vcpus: 4, memory_mib: 2048, sandboxes: 0 }).unwrap();
    assert_eq!(
        append.event_types(),
        [ev::INSTANCE_CREATED, ev::COMMAND_ISSUED, ev::RESERVATION_INSTANCE_ATTACHED, ev::QUOTA_COUNTED]
    );
    assert_eq!(guard_of(&append, &format!("quota/{POOL}")), Some(ExpectedVersion::Exact(7)));
    let counted = bc_core::canonical::to_json(&append.events[3].payload);
    assert_eq!(
        counted,
        serde_json::json!({ "subject": "inst_1", "instances": 1, "vcpus": 4, "memoryMiB": 2048, "sandboxes": 0 })
    );
    for (in_use, what) in [
        (ResourceUse { instances: 2, ..ResourceUse::default() }, "quota of 2 instances"),
        (ResourceUse { instances: 1, vcpus: 5, ..ResourceUse::default() }, "quota of 8 vCPUs"),
        (ResourceUse { instances: 1, memory_mib: 3000, ..ResourceUse::default() }, "quota of 4096 memory (MiB)"),
    ] {
        let err: Error = create(in_use).unwrap_err().into();
        assert_eq!(err.code(), ErrorCode::QuotaExceeded, "{err}");
        assert!(err.to_string().contains(what) && err.to_string().contains("in use:"), "{err}");
    }
    // A resize counts its growth only; a shrink passes at the limit.
    let running = instance(DesiredState::Running, Some(ObservedState::Running), true);
    let shape = |vcpus: u32, memory_mib: u64| ev::InstanceShape { vcpus, memory_mib, ..running.shape.clone() };
    let at_limit = QuotaRead { quota: &limits, in_use: ResourceUse { instances: 2, vcpus: 8, memory_mib: 4096, sandboxes: 0 } };
    let grow = InstanceRequest::Resize(shape(running.shape.vcpus + 1, running.shape.memory_mib));
    let err: Error = decide::instance_request_under(&running, &grow, None, None, ISSUE, Some(&at_limit)).unwrap_err().into();
    assert!(err.code() == ErrorCode::QuotaExceeded && err.to_string().contains("1 more vCPUs"), "{err}");
    let shrink = InstanceRequest::Resize(shape(1, 256));
    let append = decide::instance_request_under(&running, &shrink, None, None, ISSUE, Some(&at_limit)).unwrap();
    assert!(!append.event_types().contains(&ev::QUOTA_COUNTED), "a shrink counts nothing");
    let room = QuotaRead { quota: &limits, in_use: ResourceUse { instances: 1, vcpus: 2, memory_mib: 512, sandboxes: 0 } };
    let append = decide::instance_request_under(&running, &grow, None, None, ISSUE, Some(&room)).unwrap();
    assert_eq!(append.event_types().last(), Some(&ev::QUOTA_COUNTED));
}

#[test]
fn requests_bump_the_generation_and_a_deleted_instance_takes_none() {
    let running = instance(DesiredState::Running, Some(ObservedState::Running), true);
    let append = decide::instance_request(&running, &InstanceRequest::Stop, Some(4), None, ISSUE).unwrap();
    assert_eq!(append.event_types(), [ev::INSTANCE_STOP_REQUESTED, ev::COMMAND_ISSUED]);
    let command = bc_core::canonical::to_json(&append.events[1].payload);
    assert_eq!((command["args"]["desired"].as_str(), command["args"]["generation"].as_u64()), (Some("stopped"), Some(2)));
    let stale: Error = decide::instance_request(&running, &InstanceRequest::Stop, Some(3), None, ISSUE).unwrap_err().into();
    assert_eq!(stale.code(), ErrorCode::Conflict);
    let deleted = InstanceDoc { state: InstanceState::Deleted, ..running.clone() };
    let refused: Error = decide::instance_request(&deleted, &InstanceRequest::Start, None, None, ISSUE).unwrap_err().into();
    assert_eq!(refused.code(), ErrorCode::Conflict);
    let deleting = InstanceDoc { desired: DesiredState::Deleted, ..running };
    assert!(decide::instance_request(&deleting, &InstanceRequest::Start, None, None, ISSUE).is_err());
    assert!(
        decide::instance_request(&deleting, &InstanceRequest::Delete, None, None, ISSUE).is_ok(),
        "a delete again resends it"
    );
}

/// Every state a workflow runs in fails at its deadline on a virtual clock, into a state where
/// the machine rests, with the reason as its `lastError`; a moment before, it does not.
#[test]
fn every_unstable_state_times_out_into_its_failed_state_with_the_reason() {
    use bc_projections::decide::{MetalPlan, metal_fail, metal_plan};
    use bc_projections::metal::{MetalFlags, STATES};
    use bc_projections::workflow::{MetalDoc, Workflow, WorkflowOutcome};

    let started = 1_000_000u64;
    for &state in STATES.iter().filter(|s| !s.is_stable()) {
        let deadline_s = state.deadline_s().unwrap();
        let workflow = Workflow {
            tenant_id: "ten_x".into(),
            workflow_id: "wf_x".into(),
            node_id: "node_x".into(),
            verb: "test".into(),
            steps: vec!["wait-agent".into()],
            step_index: 0,
            step_started_at_ms: started,
            attempts: 0,
            unauthorized: 0,
            retry_at_ms: 0,
            last_error: None,
            started_at_ms: started,
            deadline_at_ms: started + deadline_s * 1000,
            paused: true,
            outcome: WorkflowOutcome::Running,
            reason: None,
            finished_at_ms: None,
            image_id: None,
            image_url: None,
            join_token_id: None,
            power: None,
            version: 1,
            updated_at_ms: started,
        };
        let doc = MetalDoc {
            tenant_id: "ten_x".into(),
            node_id: "node_x".into(),
            pool_id: "pool_x".into(),
            name: "m".into(),
            site_id: None,
            state,
            flags: MetalFlags::default(),
            last_error: None,
            bmc: bc_projections::events::MetalBmc {
                address: "https://bmc".into(),
                system_path: None,
                username: "u".into(),
                tls: "insecure".into(),
                ca_pem: None,
                pin: None,
                secret_id: "bmc_node_x".into(),
            },
            power: None,
            inspection: None,
            image_id: None,
            state_entered_at_ms: started,
            workflow: Some(workflow),
            version: 1,
            created_at_ms: started,
            updated_at_ms: started,
        };
        assert_eq!(metal_plan(&doc, started + deadline_s * 1000 - 1), MetalPlan::Idle, "{state}: paused, before its deadline");
        let MetalPlan::Fail(reason) = metal_plan(&doc, started + deadline_s * 1000) else {
            panic!("{state}: no failure at its deadline");
        };
        assert!(reason.contains(&format!("{state} did not finish within its deadline of {deadline_s} s")), "{reason}");
        let append = metal_fail(&doc, &reason).unwrap();
        let moved = append.events.iter().find(|e| e.event_type == bc_projections::events::METAL_TRANSITIONED).unwrap();
        let to = bc_core::canonical::to_json(&moved.payload)["to"].as_str().unwrap().to_owned();
        let to_state = STATES.iter().copied().find(|s| s.as_str() == to).unwrap();
        assert!(to_state.is_stable(), "{state} fails into {to}, which is not a resting state");
        // Folded, the reason is the machine's lastError.
        let mut current = Some(serde_json::to_value(&doc).unwrap());
        for (i, event) in append.events.iter().enumerate() {
            let id = ulid::Ulid::from_parts(started, i as u128);
            let stored = support::stored(TENANT, "metal/node_x".into(), 2 + i as u64, id, started + deadline_s * 1000, event);
            let key = bc_core::store::RowKey { tenant: "ten_x".into(), kind: "metal".into(), id: "node_x".into() };
            current = bc_core::store::Projector::apply(&bc_projections::Projections, &key, current, &stored).unwrap();
        }
        let folded: MetalDoc = serde_json::from_value(current.unwrap()).unwrap();
        assert_eq!((folded.state, folded.last_error.as_deref()), (to_state, Some(reason.as_str())), "{state}");
    }
}

/// A seeded source of draws below `n` (a linear congruential generator): the same seed, the
/// same draws.
fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    move |n: u64| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 33) % n
    }
}

/// The view's per-pool loads, kept as reservations come, change and go, always equal a count of
/// its live reservations from scratch (seeded; the seed is printed on failure).
#[test]
fn pool_loads_kept_as_reservations_change_equal_a_recount() {
    for seed in 0..64u64 {
        let mut next = draws(seed);
        let pools = [POOL, "pool_01jd00000000000000000000b", "pool_01jd00000000000000000000c"];
        let mut view = FleetIndex::new([], []);
        for _ in 0..300 {
            let id = format!("rsv_{}", next(40));
            match next(4) {
                0 => drop(view.remove_live(&id)),
                _ => {
                    let pool = pools[next(3) as usize];
                    // A reservation keeps its pool; a new one draws one.
                    let pool = view.live().get(&id).map(|r| r.pool_id.clone()).unwrap_or_else(|| pool.to_owned());
                    let mut rsv = queued(&id, &pool, 1 + next(8) as u32, next(20));
                    if next(2) == 0 {
                        rsv.state = ReservationState::Active;
                    }
                    view.put_live(rsv);
                }
            }
            let mut recount: BTreeMap<String, PoolLoad> = BTreeMap::new();
            for pool in pools {
                let load = PoolLoad::of(view.live().values().filter(|r| r.pool_id == pool));
                if load.reservations > 0 {
                    recount.insert(pool.to_owned(), load);
                }
            }
            assert_eq!(*view.pool_loads(), recount, "seed {seed}");
        }
    }
}

/// The view's active reservations by when a pass must look at them, kept as reservations come,
/// change and go, always list exactly those a scan of every live reservation finds due, and
/// among them every one the plan acts on (an end come, a hold failed, a hold's deadline past)
/// (seeded; the seed is printed on failure).
#[test]
fn reservations_needing_attention_kept_as_they_change_equal_a_scan() {
    use bc_projections::{Binding, BindingState};
    for seed in 0..64u64 {
        let mut next = draws(seed);
        let mut view = FleetIndex::new([], []);
        for _ in 0..300 {
            let id = format!("rsv_{}", next(40));
            if next(4) == 0 {
                drop(view.remove_live(&id));
            } else {
                let mut rsv = queued(&id, POOL, 1 + next(8) as u32, next(20));
                if next(3) > 0 {
                    rsv = active(&id, "node_a", vec![0], 1 + next(100));
                    if next(4) == 0 {
                        rsv.ends_at_ms = None;
                    }
                    if next(2) == 0 {
                        let state = [BindingState::Pending, BindingState::Bound, BindingState::Failed, BindingState::Released]
                            [next(4) as usize];
                        rsv.binding = Some(Binding {
                            state,
                            hold_command_id: Some("cmd_x".into()),
                            deadline_at_ms: (next(2) == 0).then(|| next(100)),
                            release_command_id: None,
                            gpu_uuids: vec![],
                            reason: None,
                            changed_at_ms: 0,
                        });
                    }
                }
                view.put_live(rsv);
            }
            for now in [0, next(100), 100] {
                let listed: Vec<&str> = view.needing_attention(now).map(|r| r.reservation_id.as_str()).collect();
                let mut scanned: Vec<(u64, &str)> = view
                    .live()
                    .values()
                    .filter_map(|r| Some((bc_projections::fleet::attention_at(r)?, r.reservation_id.as_str())))
                    .filter(|(at, _)| *at <= now)
                    .collect();
                scanned.sort();
                assert_eq!(listed, scanned.iter().map(|(_, id)| *id).collect::<Vec<_>>(), "seed {seed}, now {now}");
                for r in view.live().values().filter(|r| r.state == ReservationState::Active) {
                    let ended = r.ends_at_ms.is_some_and(|end| end <= now);
                    let hold_due = r.binding.as_ref().is_some_and(|b| {
                        b.state == BindingState::Failed
                            || (b.state == BindingState::Pending && b.deadline_at_ms.is_some_and(|d| d <= now))
                    });
                    if ended || hold_due {
                        assert!(listed.contains(&r.reservation_id.as_str()), "seed {seed}, now {now}: {}", r.reservation_id);
                    }
                }
            }
        }
    }
}

/// The view's ranking of each pool's nodes by free GPUs, kept as nodes come, change, go and
/// have GPUs held, always equals a ranking from scratch (seeded; the seed is printed on failure).
#[test]
fn nodes_ranked_by_free_gpus_as_they_change_equal_a_ranking_from_scratch() {
    for seed in 0..64u64 {
        let mut next = draws(seed);
        let pools = [POOL, "pool_01jd00000000000000000000b"];
        let mut view = FleetIndex::new([], []);
        for step in 0..300u64 {
            let id = format!("node_{}", next(20));
            match next(4) {
                0 => drop(view.remove_node(&id)),
                1 => {
                    let Some(doc) = view.nodes().get(&id) else { continue };
                    let free: Vec<u32> = (0..doc.gpus.len() as u32).filter(|i| !doc.allocations.contains_key(i)).collect();
                    let Some(&gpu) = free.get(next(free.len().max(1) as u64) as usize) else { continue };
                    let placement = placement::Placement {
                        node_id: id.clone(),
                        node_version: doc.version,
                        gpus: vec![gpu],
                        leftover: 0,
                        hold: None,
                    };
                    let pending = queued(&format!("rsv_{step}"), &doc.pool_id.clone(), 1, step);
                    view.hold(pending, Some(&placement));
                }
                _ => {
                    // A node keeps its pool; a new one draws one.
                    let pool = view.nodes().get(&id).map_or_else(|| pools[next(2) as usize].to_owned(), |n| n.pool_id.clone());
                    let mut doc = node(&id, &pool, 1 + next(8) as u32);
                    for gpu in 0..doc.gpus.len() as u32 {
                        if next(3) == 0 {
                            doc.allocations.insert(gpu, "rsv_x".into());
                        }
                    }
                    view.put_node(doc);
                }
            }
            for pool in pools {
                let mut scratch: Vec<(u32, &str)> = view
                    .nodes()
                    .values()
                    .filter(|n| n.pool_id == pool)
                    .map(|n| (placement::free_gpus(n), n.node_id.as_str()))
                    .collect();
                scratch.sort();
                let kept: Vec<(u32, &str)> = view.ranked(pool, 0).map(|(free, n)| (free, n.node_id.as_str())).collect();
                assert_eq!(kept, scratch, "seed {seed} step {step}");
                let at_least_3: Vec<_> = scratch.iter().copied().filter(|(free, _)| *free >= 3).collect();
                let kept_3: Vec<_> = view.ranked(pool, 3).map(|(free, n)| (free, n.node_id.as_str())).collect();
                assert_eq!(kept_3, at_least_3, "seed {seed} step {step}");
            }
        }
    }
}

/// Property: a view for which `needs_nodes` says no is planned to nothing, whatever its nodes
/// hold (the reconciler then leaves the nodes it would read again unread), and one that has a
/// queue or a reservation due says yes. Random views of active reservations (bound, pending or
/// failed holds, ends around now) and queues, at random times. Seeded: `BC_TEST_SEED` replays,
/// and a failure prints the seed.
#[test]
fn a_plan_looks_at_the_nodes_only_when_needs_nodes_says_so() {
    use bc_projections::BindingState;
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};
    let seed = bc_core::testing::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut planned_nothing, mut planned) = (0, 0);
    for case in 0..2_000 {
        let mut nodes: Vec<NodeDoc> = (0..rng.random_range(1..5)).map(|n| node(&format!("node_{n}"), POOL, 4)).collect();
        let mut live = Vec::new();
        for r in 0..rng.random_range(0..6) {
            let id = format!("rsv_{r}");
            if rng.random_bool(0.2) {
                live.push(queued(&id, POOL, rng.random_range(1..5), 100 + r));
                continue;
            }
            let at = rng.random_range(0..nodes.len());
            let free: Vec<u32> = (0..4).filter(|gpu| !nodes[at].allocations.contains_key(gpu)).collect();
            let Some(&gpu) = free.first() else { continue };
            let mut rsv = active(&id, &nodes[at].node_id, vec![gpu], NOW_MS + rng.random_range(0..2_000) - 1_000);
            rsv = match rng.random_range(0..4) {
                0 => bound(rsv, BindingState::Pending, NOW_MS + rng.random_range(0..2_000) - 1_000, None),
                1 => bound(rsv, BindingState::Failed, 0, Some("hold-failed: test")),
                2 => bound(rsv, BindingState::Bound, 0, None),
                _ => rsv,
            };
            hold_on(&mut nodes[at], &rsv);
            live.push(rsv);
        }
        let view = FleetIndex::new(nodes, live.clone());
        let now = NOW_MS + rng.random_range(0..2_000) - 1_000;
        let needs = decide::needs_nodes(&view, now);
        let actions = decide::plan(&view, now);
        assert!(needs || actions.is_empty(), "seed {seed}, case {case}: needs_nodes said no to a plan of {actions:?}");
        let due = live.iter().any(|r| {
            r.state == ReservationState::Queued
                || r.ends_at_ms.is_some_and(|end| end <= now)
                || r.binding.as_ref().is_some_and(|b| {
                    b.state == BindingState::Failed
                        || (b.state == BindingState::Pending && b.deadline_at_ms.is_some_and(|d| d <= now))
                })
        });
        assert_eq!(needs, due, "seed {seed}, case {case}: a queue or a reservation due is what needs the nodes");
        if actions.is_empty() { planned_nothing += 1 } else { planned += 1 }
    }
    assert!(planned_nothing > 100 && planned > 100, "seed {seed}: both kinds of view drawn ({planned_nothing}, {planned})");
}
