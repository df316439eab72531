//! Property: placement over random fleets and requests, through the real log and projections.
//! Every activation takes free GPUs that match its selector, on one node, in one NVLink domain
//! when asked, at the tightest fit; a decision made on a node that has changed since is
//! refused with CONFLICT; no GPU is ever held by two live reservations; and a rebuild of the
//! projections from the log gives the same nodes and reservations.
//!
//! The tightest fit is checked against an oracle of the test's own ([`oracle`]): the test keeps
//! its own record of the fleet it registered and of what it placed and released ([`Fleet`]),
//! draws selectors as data ([`Drawn`]) and evaluates them itself, and tries every node and every
//! NVLink domain. It shares nothing with `placement::fit`, which placement is built on.
//!
//! Seeded (`bc_core::testing::seed`: `BC_TEST_SEED`, else a fixed seed); a failure prints the
//! seed to replay it. The run asserts that the cases reached what makes the property mean
//! something: placements, NVLink ones, asks no node fits, choices between nodes that would leave
//! different numbers free, ties, releases and refused stale decisions.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use bc_core::clock::SystemClock;
use bc_core::id::{NodeId, PoolId, ReservationId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent, rebuild_projections};
use bc_projections::events::{self as ev, Gpu};
use bc_projections::fleet::FleetIndex;
use bc_projections::placement::{self, Ask, Preference, Selector, live, pool_nodes};
use bc_projections::{KIND_NODE, KIND_POOL, KIND_RESERVATION, NodeDoc, NodeState, Projections, stream_of};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// The nodes here are registered by hand: no command is issued, so any id will do.
const ISSUE: placement::Issue<'static> = placement::Issue { command_id: "cmd_unused", now_ms: 1 };

const CASES: usize = 16;
const STEPS: usize = 60;
const PRODUCTS: [(&str, &str, u32); 3] =
    [("H100", "H100-SXM5-80GB", 80), ("A100", "A100-SXM4-40GB", 40), ("L40S", "L40S-48GB", 48)];
const VRAM_GIB: [u32; 3] = [40, 48, 80];

/// What the cases must reach between them, or the property tested little.
const OUTCOMES: [&str; 7] = [
    "placed",
    "placed whole in one NVLink domain (--nvlink)",
    "no node fits",
    "a choice between nodes that would leave different numbers free",
    "a tie broken by the lowest node id",
    "released",
    "a stale decision refused with CONFLICT",
];

/// The test's own record of one node: what it registered, and the GPUs its placements hold.
struct ModelNode {
    id: String,
    /// Not cordoned or draining.
    ready: bool,
    rack: u32,
    /// (index into `PRODUCTS`, NVLink domain) of each GPU.
    gpus: Vec<(usize, u32)>,
    held: BTreeSet<u32>,
}

/// The test's own record of the fleet: its nodes, and which reservation holds which GPUs.
#[derive(Default)]
struct Fleet {
    nodes: Vec<ModelNode>,
    reservations: BTreeMap<String, (String, Vec<u32>)>,
}

/// A selector drawn as data: rendered to text for placement to parse, evaluated by the oracle.
#[derive(Debug, Default)]
struct Drawn {
    model: Option<usize>,
    vram_min: Option<u32>,
    racks: Option<(u32, u32)>,
    not_domain: Option<u32>,
}

impl Drawn {
    fn text(&self) -> String {
        let mut clauses = Vec::new();
        if let Some(model) = self.model {
            clauses.push(format!("gpuModel = {}", PRODUCTS[model].0));
        }
        if let Some(vram) = self.vram_min {
            clauses.push(format!("vramGiB >= {vram}"));
        }
        if let Some((a, b)) = self.racks {
            clauses.push(format!("label.rack in (r{a}, r{b})"));
        }
        if let Some(domain) = self.not_domain {
            clauses.push(format!("nvlinkDomain != {domain}"));
        }
        clauses.join(", ")
    }

    fn matches(&self, node: &ModelNode, (product, domain): (usize, u32)) -> bool {
        self.model.is_none_or(|m| PRODUCTS[m].0 == PRODUCTS[product].0)
            && self.vram_min.is_none_or(|v| PRODUCTS[product].2 >= v)
            && self.racks.is_none_or(|(a, b)| node.rack == a || node.rack == b)
            && self.not_domain.is_none_or(|d| domain != d)
    }
}

/// What the oracle says of an ask: the node tightest fit must take and the matching GPUs it
/// leaves free, and how many nodes could take it and with how many distinct leftovers (what
/// makes the choice a choice).
struct Answer {
    node: String,
    leftover: u32,
    /// The node's free matching GPUs by NVLink domain.
    domains: BTreeMap<u32, u32>,
    fitting: usize,
    leftovers: usize,
    /// Nodes that leave `leftover` free, the chosen one among them.
    tied: usize,
}

/// Brute force, from the test's own record: every ready node, every GPU of it, every NVLink
/// domain. A node fits when enough of its free GPUs match (and, with `nvlink`, enough in one
/// domain); tightest fit takes the node that leaves the fewest matching GPUs free, then the
/// lowest node id.
fn oracle(fleet: &Fleet, drawn: &Drawn, gpus: u32, nvlink: bool) -> Option<Answer> {
    let mut fits: Vec<(u32, &str, BTreeMap<u32, u32>)> = Vec::new();
    for node in fleet.nodes.iter().filter(|n| n.ready) {
        let mut domains: BTreeMap<u32, u32> = BTreeMap::new();
        for (index, &gpu) in node.gpus.iter().enumerate() {
            if !node.held.contains(&(index as u32)) && drawn.matches(node, gpu) {
                *domains.entry(gpu.1).or_default() += 1;
            }
        }
        let free: u32 = domains.values().sum();
        let fits_node = if nvlink { domains.values().any(|&n| n >= gpus) } else { free >= gpus };
        if fits_node {
            fits.push((free - gpus, &node.id, domains));
        }
    }
    let leftovers: BTreeSet<u32> = fits.iter().map(|f| f.0).collect();
    let fitting = fits.len();
    let (leftover, node, domains) = fits.iter().min_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)))?.clone();
    let tied = fits.iter().filter(|f| f.0 == leftover).count();
    Some(Answer { node: node.to_owned(), leftover, domains, fitting, leftovers: leftovers.len(), tied })
}

fn request(
    tenant: TenantId,
    stream: String,
    expected: ExpectedVersion,
    event_type: &str,
    payload: ciborium::Value,
) -> AppendRequest {
    AppendRequest::new(tenant, stream, expected, "property", vec![NewEvent::new(event_type, payload)])
}

fn draw(rng: &mut StdRng) -> Drawn {
    Drawn {
        model: rng.random_bool(0.3).then(|| rng.random_range(0..PRODUCTS.len())),
        vram_min: rng.random_bool(0.3).then(|| VRAM_GIB[rng.random_range(0..VRAM_GIB.len())]),
        racks: rng.random_bool(0.2).then(|| (rng.random_range(0..3), rng.random_range(0..3))),
        not_domain: rng.random_bool(0.1).then(|| rng.random_range(0..2)),
    }
}

async fn case(seed: u64) -> BTreeMap<&'static str, u32> {
    let mut reached: BTreeMap<&'static str, u32> = BTreeMap::new();
    let mut reach = |outcome: &'static str| *reached.entry(outcome).or_default() += 1;
    let mut fleet = Fleet::default();
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("p.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let log = Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap();
    let tenant = TenantId::generate();
    let pool = PoolId::generate().to_string();
    let created = ev::PoolCreated::named("p");
    let payload = ev::to_cbor(&created).unwrap();
    log.append(request(tenant, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, ev::POOL_CREATED, payload)).await.unwrap();
    // Between 2 and 8 nodes, some of one product (ties), most in several NVLink domains.
    let one_product = rng.random_bool(0.3).then(|| rng.random_range(0..PRODUCTS.len()));
    for n in 0..rng.random_range(2..9) {
        let product_index = one_product.unwrap_or_else(|| rng.random_range(0..PRODUCTS.len()));
        let (model, product, vram) = PRODUCTS[product_index];
        let domains = rng.random_range(1..4u32);
        let model_gpus: Vec<(usize, u32)> =
            (0..rng.random_range(1..9)).map(|_| (product_index, rng.random_range(0..domains))).collect();
        let gpus = model_gpus
            .iter()
            .map(|&(_, domain)| Gpu { model: model.into(), product: product.into(), vram_gib: vram, nvlink_domain: domain })
            .collect();
        let rack = rng.random_range(0..3);
        let labels = [("rack".to_owned(), format!("r{rack}"))].into();
        let node = ev::NodeRegistered { pool_id: pool.clone(), name: format!("n{n}"), gpus, labels };
        let id = NodeId::generate();
        let stream = stream_of(KIND_NODE, &id);
        log.append(request(tenant, stream.clone(), ExpectedVersion::NoStream, ev::NODE_REGISTERED, ev::to_cbor(&node).unwrap()))
            .await
            .unwrap();
        let ready = !rng.random_bool(0.15);
        if !ready {
            let state = [ev::NODE_CORDONED, ev::NODE_DRAINING][rng.random_range(0..2)];
            let payload = ev::to_cbor(&ev::NodeStateChanged {}).unwrap();
            log.append(request(tenant, stream, ExpectedVersion::Any, state, payload)).await.unwrap();
        }
        fleet.nodes.push(ModelNode { id: id.to_string(), ready, rack, gpus: model_gpus, held: BTreeSet::new() });
    }
    for step in 0..STEPS {
        let nodes = pool_nodes(&*store, tenant, &pool).await.unwrap();
        // The oracle's record and the projections agree on what the oracle reads.
        assert_eq!(nodes.len(), fleet.nodes.len(), "seed {seed}: nodes");
        for model in &fleet.nodes {
            let node = nodes.iter().find(|n| n.node_id == model.id).unwrap();
            let held: BTreeSet<u32> = node.allocations.keys().copied().collect();
            assert_eq!(held, model.held, "seed {seed} step {step}: {}'s allocations", model.id);
            assert_eq!(node.state == NodeState::Ready, model.ready, "seed {seed} step {step}: {}'s state", model.id);
        }
        let active = live(&*store, tenant).await.unwrap();
        if !active.is_empty() && rng.random_bool(0.3) {
            let r = &active[rng.random_range(0..active.len())];
            let node = r.node_id.as_deref().unwrap();
            let (events, guards) = placement::ending(&r.reservation_id, node, false, placement::Ending::Released, ISSUE).unwrap();
            let stream = stream_of(KIND_RESERVATION, &r.reservation_id);
            let mut req = request(tenant, stream, ExpectedVersion::Exact(r.version), "x", ciborium::Value::Null);
            req.guards = guards;
            req.events = events;
            log.append(req).await.unwrap();
            let (on, gpus) = fleet.reservations.remove(&r.reservation_id).expect("a reservation the test placed");
            assert_eq!((on.as_str(), &gpus), (node, &r.gpu_indexes), "seed {seed}: the reservation's GPUs");
            let model = fleet.nodes.iter_mut().find(|n| n.id == on).unwrap();
            for gpu in gpus {
                model.held.remove(&gpu);
            }
            reach("released");
            continue;
        }
        let drawn = draw(&mut rng);
        let text = drawn.text();
        let selector = Selector::parse(&text).unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
        let ask = Ask { gpus: rng.random_range(1..6), selector: &selector, nvlink: rng.random_bool(0.4), tolerations: &[] };
        let answer = oracle(&fleet, &drawn, ask.gpus, ask.nvlink);
        for node in &nodes {
            let fitted = placement::fit(node, &ask).map(|f| f.leftover);
            assert_eq!(placement::leftover(node, &ask), fitted, "seed {seed}: the fast score disagrees with fit");
        }
        let view = FleetIndex::new(nodes.iter().cloned(), []);
        for &preference in Preference::ALL {
            assert_eq!(
                placement::place_ranked(view.ranked(&pool, ask.gpus), &ask, preference),
                placement::place_by(&nodes, &ask, preference),
                "seed {seed} step {step}: walking the nodes by free GPUs and scoring them all disagree ({preference:?}, {text:?})"
            );
        }
        let Some(p) = placement::place(&nodes, &ask) else {
            if let Some(answer) = answer {
                panic!("seed {seed} step {step}: place said no, but {} fits ({text:?}, {ask:?})", answer.node);
            }
            reach("no node fits");
            continue;
        };
        let Some(answer) = answer else {
            panic!("seed {seed} step {step}: placed on {}, but no node fits ({text:?}, {ask:?})", p.node_id);
        };
        // Tightest fit: the node the oracle names (fewest matching GPUs left free, then the
        // lowest id), leaving what it says.
        assert_eq!(
            (&p.node_id, p.leftover),
            (&answer.node, answer.leftover),
            "seed {seed} step {step}: not the tightest fit ({text:?}, {ask:?})"
        );
        if answer.leftovers > 1 {
            reach("a choice between nodes that would leave different numbers free");
        }
        if answer.tied > 1 {
            reach("a tie broken by the lowest node id");
        }
        assert!(answer.fitting >= answer.tied);
        let node: &NodeDoc = nodes.iter().find(|n| n.node_id == p.node_id).unwrap();
        assert!(placement::usable(node, &[]), "seed {seed}: placed on a node that is not ready");
        let picked: BTreeSet<u32> = p.gpus.iter().copied().collect();
        assert_eq!(picked.len(), ask.gpus as usize, "seed {seed}: distinct GPUs");
        for gpu in &p.gpus {
            assert!(!node.allocations.contains_key(gpu), "seed {seed}: GPU {gpu} was not free");
            assert!(selector.matches(node, *gpu as usize), "seed {seed}: GPU {gpu} does not match {text:?}");
        }
        // On the node: a request one NVLink domain holds whole takes the tightest such domain
        // (with --nvlink it must).
        let domains: BTreeSet<u32> = p.gpus.iter().map(|g| node.gpus[*g as usize].nvlink_domain).collect();
        let tightest_whole = answer.domains.iter().filter(|(_, n)| **n >= ask.gpus).map(|(_, n)| *n).min();
        if let Some(size) = tightest_whole {
            assert_eq!(domains.len(), 1, "seed {seed} step {step}: one domain holds it, yet it spans {domains:?}");
            let domain = domains.first().unwrap();
            assert_eq!(answer.domains[domain], size, "seed {seed} step {step}: not the tightest domain that holds it");
        } else {
            assert!(!ask.nvlink, "seed {seed} step {step}: --nvlink placed with no domain holding it");
        }
        if ask.nvlink {
            reach("placed whole in one NVLink domain (--nvlink)");
        }
        let rsv = ReservationId::generate().to_string();
        let requested = ev::ReservationRequested {
            pool_id: pool.clone(),
            gpus: ask.gpus,
            duration_s: 3600,
            selector: text.clone(),
            nvlink: ask.nvlink,
            tolerations: vec![],
            project_id: None,
        };
        let payload = ev::to_cbor(&requested).unwrap();
        let (events, guards) = placement::activation(&rsv, &p, 1, ISSUE).unwrap();
        let stream = stream_of(KIND_RESERVATION, &rsv);
        let mut req = request(tenant, stream, ExpectedVersion::NoStream, ev::RESERVATION_REQUESTED, payload.clone());
        req.guards = guards;
        req.events.extend(events);
        log.append(req).await.unwrap_or_else(|e| panic!("seed {seed} step {step}: {e}"));
        fleet.nodes.iter_mut().find(|n| n.id == p.node_id).unwrap().held.extend(p.gpus.iter().copied());
        fleet.reservations.insert(rsv, (p.node_id.clone(), p.gpus.clone()));
        reach("placed");
        // The same decision, made on the node as it was before, is refused now: a CONFLICT on
        // the node's stream, not any error.
        let stale_id = ReservationId::generate().to_string();
        let (events, guards) = placement::activation(&stale_id, &p, 1, ISSUE).unwrap();
        let stream = stream_of(KIND_RESERVATION, &stale_id);
        let mut stale = request(tenant, stream, ExpectedVersion::NoStream, ev::RESERVATION_REQUESTED, payload);
        stale.guards = guards;
        stale.events.extend(events);
        match log.append(stale).await {
            Err(bc_core::Error::Conflict { stream, .. }) if stream == stream_of(KIND_NODE, &p.node_id) => {
                reach("a stale decision refused with CONFLICT")
            }
            Err(e) => panic!("seed {seed} step {step}: a stale placement was refused, but not as a CONFLICT on its node: {e:?}"),
            Ok(_) => panic!("seed {seed} step {step}: a stale placement was accepted"),
        }
    }
    let mut held: BTreeMap<(String, u32), String> = BTreeMap::new();
    for r in live(&*store, tenant).await.unwrap() {
        for gpu in &r.gpu_indexes {
            let slot = (r.node_id.clone().unwrap(), *gpu);
            assert!(held.insert(slot, r.reservation_id.clone()).is_none(), "seed {seed}: double booking");
        }
    }
    let before = store.rows_all().await.unwrap();
    rebuild_projections(&*store, &Projections).await.unwrap();
    let after = store.rows_all().await.unwrap();
    assert_eq!(before, after, "seed {seed}: a rebuild changed the projections");
    reached
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_over_random_fleets() {
    let seed = bc_core::testing::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut reached: BTreeMap<&'static str, u32> = BTreeMap::new();
    for _ in 0..CASES {
        let case_seed = rng.random::<u64>();
        match tokio::spawn(case(case_seed)).await {
            Ok(outcomes) => {
                for (outcome, n) in outcomes {
                    *reached.entry(outcome).or_default() += n;
                }
            }
            Err(e) => panic!("placement property failed; replay with BC_TEST_SEED={seed} (case seed {case_seed}): {e}"),
        }
    }
    eprintln!("seed {seed}: {CASES} cases reached {reached:?}");
    for outcome in OUTCOMES {
        assert!(
            reached.get(outcome).copied().unwrap_or(0) >= 5,
            "seed {seed} (BC_TEST_SEED={seed} repeats it): fewer than 5 steps reached {outcome:?}; reached {reached:?}"
        );
    }
    let placed = reached["placed"] as usize;
    assert!(placed >= CASES * 5, "seed {seed}: only {placed} placements: the property tested little");
}
