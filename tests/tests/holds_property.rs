//! Property: random reservations, releases, reconciler passes and liveness sweeps, failed holds,
//! unanswered holds, releases the machine refuses, agents away or with skewed clocks (±30 s), agents that crash before their journal reaches the
//! log, and commands delivered twice never leave one GPU held for two reservations, on the
//! control plane or on an agent; and once the faults stop, every active reservation settles
//! `bound` and every agent holds exactly what the control plane says it does (none leaked).
//!
//! It drives the real pieces: the decisions (`decide::reservation_release`, the reservations
//! reconciler's `pass`, which places, requeues and fails), the real fold on SQLite, and each
//! agent's real `Runner` (its journal, its ledger in `holds.json`, `decide_hold`) over a machine
//! whose binding the test can make refuse holds or releases. What it leaves out is the
//! transport: each journal entry is appended as the gateway's session appends it (checked
//! against the node's signature, on its subject's stream, exactly once by its idempotency key,
//! with the entry under `journal`), which the end-to-end tests cover over gRPC. Seeded:
//! `BC_PROPERTY_SEED` runs one case, `BC_PROPERTY_CASES` sets how many (default 12); a failure
//! prints its seed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use std::sync::atomic::{AtomicBool, Ordering};

use bc_agent::binding::{GpuBinding, HeldGpu};
use bc_agent::holds::{Ledger, LedgerFile};
use bc_agent::inventory::{GpuInfo, GpuInventory, Inventory, InventorySource};
use bc_agent::journal::Journal;
use bc_agent::machine::{Rng, SeededRng};
use bc_agent::runner::Runner;
use bc_core::agent::{JournalOrigin, SignedEntry};
use bc_core::clock::{Clock, ManualClock};
use bc_core::id::{CommandId, NodeId, PoolId, ReservationId, TenantId};
use bc_core::id_source::SeededIds;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::events as ev;
use bc_projections::fleet::Fleet;
use bc_projections::{
    BindingState, CommandDoc, KIND_COMMAND, KIND_NODE, KIND_NODE_COMMANDS, KIND_POOL, KIND_RESERVATION, KIND_RESERVATION_LIVE,
    NodeCommandsDoc, NodeDoc, Projections, ReservationDoc, ReservationState, stream_of,
};
use ed25519_dalek::SigningKey;

const NODES: usize = 3;
const STEPS: usize = 150;
const CASES_DEFAULT: u64 = 12;

/// The machine under an agent: its GPUs, and a binding the test can make refuse.
#[derive(Clone, Default)]
struct Machine {
    inventory: Inventory,
    refuse_holds: Arc<AtomicBool>,
    refuse_releases: Arc<AtomicBool>,
}

impl InventorySource for Machine {
    fn read(&self) -> Inventory {
        self.inventory.clone()
    }
}

impl GpuBinding for Machine {
    fn unprivileged(&self) -> Option<String> {
        None
    }
    fn hold(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
        if self.refuse_holds.load(Ordering::SeqCst) { Err("gpu-in-use: the property test's refusal".into()) } else { Ok(()) }
    }
    fn release(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
        if self.refuse_releases.load(Ordering::SeqCst) { Err("device busy".into()) } else { Ok(()) }
    }
}

/// One node's agent: its data directory, key, the running `Runner` (`None`: crashed or away),
/// and how far its journal reached the log.
struct Agent {
    node: String,
    key: SigningKey,
    dir: tempfile::TempDir,
    machine: Machine,
    runner: Option<Runner>,
    delivered: u64,
    /// How far this agent's clock is from the control plane's (ms; either way).
    skew_ms: i64,
}

impl Agent {
    async fn start(&mut self) {
        let node: NodeId = self.node.parse().unwrap();
        let journal = Journal::open(&self.dir.path().join("journal.db"), node, u64::MAX).await.unwrap();
        let ledger_file = LedgerFile::new(self.dir.path());
        let ledger = ledger_file.load().unwrap();
        self.runner = Some(Runner {
            journal: Arc::new(journal),
            key: self.key.clone(),
            node,
            version: "property".into(),
            binding: Box::new(self.machine.clone()),
            inventory: Arc::new(self.machine.clone()),
            ledger: tokio::sync::Mutex::new(ledger),
            ledger_file,
        });
    }

    /// What `holds.json` says (the ledger survives a crash).
    fn ledger(&self) -> Ledger {
        LedgerFile::new(self.dir.path()).load().unwrap()
    }
}

fn pick(rng: &mut SeededRng, n: usize) -> usize {
    (rng.next_unit() * n as f64) as usize % n.max(1)
}

fn chance(rng: &mut SeededRng, p: f64) -> bool {
    rng.next_unit() < p
}

struct World {
    _dir: tempfile::TempDir,
    store: Arc<dyn EventStore>,
    log: Log,
    clock: Arc<ManualClock>,
    tenant: TenantId,
    pool: String,
    fleet: Fleet,
    agents: Vec<Agent>,
}

impl World {
    async fn new(seed: u64, rng: &mut SeededRng) -> World {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("p.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        // Every id from the seed, so a seed repeats the run: placement breaks ties by node id,
        // and the plan orders failed holds by reservation id.
        let ids = Arc::new(SeededIds::new(seed, clock.clone()));
        let log = Log::open_with_ids(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), clock.clone(), ids)
            .await
            .unwrap();
        let tenant = TenantId::from_ulid(log.ids.ulid());
        let pool = PoolId::from_ulid(log.ids.ulid()).to_string();
        let created =
            ev::PoolCreated { name: "p".into(), description: String::new(), labels: Default::default(), max_reservation_s: None };
        let event = NewEvent::new(ev::POOL_CREATED, ev::to_cbor(&created).unwrap());
        log.append(AppendRequest::new(tenant, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, "test", vec![event]))
            .await
            .unwrap();
        let mut agents = Vec::new();
        for n in 0..NODES {
            let node = NodeId::from_ulid(log.ids.ulid()).to_string();
            let count = 2 + pick(rng, 3) as u32;
            let gpus: Vec<GpuInfo> = (0..count)
                .map(|i| GpuInfo {
                    index: i,
                    uuid: format!("GPU-{n}-{i}"),
                    model: "H100".into(),
                    product: "H100".into(),
                    vram_gib: 80,
                    pci_bus_id: format!("00000000:{:02x}:00.0", 0x10 + i),
                    nvlink_domain: 0,
                })
                .collect();
            let key = SigningKey::from_bytes(&{
                let mut bytes = [0u8; 32];
                for b in &mut bytes {
                    *b = pick(rng, 256) as u8;
                }
                bytes
            });
            let joined = ev::NodeJoined {
                pool_id: pool.clone(),
                name: format!("n{n}"),
                gpus: gpus
                    .iter()
                    .map(|g| ev::Gpu { model: g.model.clone(), product: g.product.clone(), vram_gib: 80, nvlink_domain: 0 })
                    .collect(),
                labels: Default::default(),
                public_key: bc_core::agent::b64(key.verifying_key().as_bytes()),
                join_token_id: "jt_property".into(),
                agent_version: "property".into(),
                hostname: format!("n{n}"),
                gpu_uuids: gpus.iter().map(|g| g.uuid.clone()).collect(),
            };
            let ready = ev::NodeLiveness { lease_expires_at_ms: u64::MAX / 2 };
            let events = vec![
                NewEvent::new(ev::NODE_JOINED, ev::to_cbor(&joined).unwrap()),
                NewEvent::new(ev::NODE_READY, ev::to_cbor(&ready).unwrap()),
            ];
            log.append(AppendRequest::new(tenant, stream_of(KIND_NODE, &node), ExpectedVersion::NoStream, "test", events))
                .await
                .unwrap();
            let inventory = Inventory { gpus: GpuInventory { gpus, ..Default::default() }, ..Default::default() };
            let machine = Machine { inventory, ..Default::default() };
            let skew_ms = pick(rng, 60_001) as i64 - 30_000;
            let mut agent = Agent { node, key, dir: tempfile::tempdir().unwrap(), machine, runner: None, delivered: 0, skew_ms };
            agent.start().await;
            agents.push(agent);
        }
        let fleet = Fleet::new();
        fleet.prime(&*store).await.unwrap();
        World { _dir: dir, store, log, clock, tenant, pool, fleet, agents }
    }

    async fn rows<T: serde::de::DeserializeOwned>(&self, kind: &str) -> Vec<T> {
        let rows = self.store.row_list(&self.tenant.to_string(), kind, None, 10_000).await.unwrap();
        rows.into_iter().map(|r| serde_json::from_value(r.doc).unwrap()).collect()
    }

    async fn doc<T: serde::de::DeserializeOwned>(&self, kind: &str, id: &str) -> Option<T> {
        let row = self.store.row_get(&self.tenant.to_string(), kind, id).await.unwrap();
        row.map(|r| serde_json::from_value(r.doc).unwrap())
    }

    async fn request(&self, rng: &mut SeededRng) {
        let requested = ev::ReservationRequested {
            pool_id: self.pool.clone(),
            gpus: 1 + pick(rng, 2) as u32,
            duration_s: 60 + 60 * pick(rng, 10) as u64,
            selector: String::new(),
            nvlink: false,
            tolerations: vec![],
        };
        let id = ReservationId::from_ulid(self.log.ids.ulid()).to_string();
        let event = NewEvent::new(ev::RESERVATION_REQUESTED, ev::to_cbor(&requested).unwrap());
        let request =
            AppendRequest::new(self.tenant, stream_of(KIND_RESERVATION, &id), ExpectedVersion::NoStream, "test", vec![event]);
        self.log.append(request).await.unwrap();
    }

    async fn release(&self, rng: &mut SeededRng) {
        let live: Vec<ReservationDoc> = self.rows(KIND_RESERVATION_LIVE).await;
        if live.is_empty() {
            return;
        }
        let rsv = &live[pick(rng, live.len())];
        let command = CommandId::from_ulid(self.log.ids.ulid()).to_string();
        let issue = bc_projections::placement::Issue { command_id: &command, now_ms: self.clock.now_ms() };
        if let Some(append) = bc_projections::decide::reservation_release(rsv, None, issue).unwrap() {
            match self.log.append(append.into_request(self.tenant, "test")).await {
                Ok(_) => {}
                Err(e) if e.code() == bc_core::ErrorCode::Conflict => {}
                Err(e) => panic!("release: {e}"),
            }
        }
    }

    /// The reservations reconciler's pass, and the liveness sweep (which fails commands past
    /// their deadline, but never a `gpu.release`).
    async fn pass(&self) {
        bc_reconcilers::reservations::pass(&self.log, &self.fleet, &*self.clock, &[self.tenant]).await.unwrap();
        bc_reconcilers::liveness::pass(&self.log, &*self.clock).await.unwrap();
    }

    /// Agent `a` runs its queued commands in issue order with its real runner (and the
    /// releases it retries), then its journal reaches the log, unless it `crash`es first (its
    /// entries wait in its journal for its restart). `again` delivers a finished command a
    /// second time, which the runner must not run twice.
    async fn answer(&mut self, a: usize, crash: bool, again: Option<String>) {
        let now = self.clock.now_ms().saturating_add_signed(self.agents[a].skew_ms);
        let node = self.agents[a].node.clone();
        let Some(runner) = self.agents[a].runner.as_ref() else { return };
        let mut ids = self.doc::<NodeCommandsDoc>(KIND_NODE_COMMANDS, &node).await.map(|q| q.pending).unwrap_or_default();
        ids.extend(again);
        for id in ids {
            let command: CommandDoc = self.doc(KIND_COMMAND, &id).await.expect("a queued command exists");
            let proto = bc_proto::Command {
                command_id: command.command_id.clone(),
                kind: command.kind.clone(),
                args_json: serde_json::to_string(&command.args).unwrap(),
                issued_at_ms: command.issued_at_ms,
                deadline_ms: command.deadline_at_ms,
            };
            runner.run(&proto, now).await.unwrap();
        }
        runner.retry_releases(now).await.unwrap();
        if crash {
            self.agents[a].runner = None;
            return;
        }
        self.deliver(a).await;
    }

    /// Appends the agent's journal entries the log lacks, as the gateway's session does.
    async fn deliver(&mut self, a: usize) {
        let agent = &self.agents[a];
        let Some(runner) = agent.runner.as_ref() else { return };
        let mut delivered = agent.delivered;
        loop {
            let entries = runner.journal.after(delivered, 256).await.unwrap();
            if entries.is_empty() {
                break;
            }
            for entry in entries {
                let (body, _) =
                    SignedEntry::verify(entry.seq, &entry.body, &entry.signature, &agent.key.verifying_key()).unwrap();
                let origin = JournalOrigin {
                    node_id: agent.node.clone(),
                    seq: entry.seq,
                    body: bc_core::agent::b64(&entry.body),
                    signature: bc_core::agent::b64(&entry.signature),
                };
                let mut payload = body.payload.clone();
                payload[bc_core::agent::JOURNAL_PAYLOAD_KEY] = serde_json::to_value(&origin).unwrap();
                let event = NewEvent::new(body.entry_type.clone(), bc_core::canonical::from_json(&payload).unwrap());
                let mut request = AppendRequest::new(
                    self.tenant,
                    body.subject.clone(),
                    ExpectedVersion::Any,
                    format!("node:{}", agent.node),
                    vec![event],
                );
                request.idempotency_key = Some(format!("journal:{}:{}", agent.node, entry.seq));
                self.log.append(request).await.unwrap();
                delivered = entry.seq;
            }
        }
        self.agents[a].delivered = delivered;
    }

    /// Prints a reservation's events and its node's commands, to explain a failure.
    async fn history(&self, reservation_id: &str) {
        let rows = self
            .store
            .read_after_rows(bc_core::event::Position { commit: 0, index: 0 }, Some(self.tenant), 100_000)
            .await
            .unwrap();
        for row in rows {
            let (seq, stream, event_type) = (row.seq, row.stream.clone(), row.event_type.clone());
            let event = row.decode().unwrap();
            let payload = bc_core::canonical::to_json(&event.envelope.payload).to_string();
            if stream.ends_with(reservation_id) || payload.contains(reservation_id) {
                eprintln!("  {seq} {stream} {event_type} {}", bc_core::id::truncate(&payload, 400));
            }
        }
    }

    /// No GPU held for two reservations, on the control plane or on an agent; what the control
    /// plane calls bound, the agent holds.
    async fn check(&self, seed: u64, step: usize) {
        let live: Vec<ReservationDoc> = self.rows(KIND_RESERVATION_LIVE).await;
        let nodes: Vec<NodeDoc> = self.rows(KIND_NODE).await;
        let mut taken: BTreeMap<(String, u32), String> = BTreeMap::new();
        for rsv in live.iter().filter(|r| r.state == ReservationState::Active) {
            let node = rsv.node_id.clone().unwrap();
            for gpu in &rsv.gpu_indexes {
                if let Some(other) = taken.insert((node.clone(), *gpu), rsv.reservation_id.clone()) {
                    panic!("seed {seed} step {step}: GPU {gpu} of {node} is {other}'s and {}'s", rsv.reservation_id);
                }
                let doc = nodes.iter().find(|n| n.node_id == node).unwrap();
                assert_eq!(
                    doc.allocations.get(gpu),
                    Some(&rsv.reservation_id),
                    "seed {seed} step {step}: the node's allocations"
                );
            }
        }
        for agent in &self.agents {
            let ledger = agent.ledger();
            let mut held: BTreeMap<&str, &str> = BTreeMap::new();
            for (rsv, hold) in &ledger.holds {
                for gpu in &hold.gpus {
                    if let Some(other) = held.insert(&gpu.uuid, rsv) {
                        panic!("seed {seed} step {step}: the agent of {} holds {} for {other} and {rsv}", agent.node, gpu.uuid);
                    }
                }
            }
            for rsv in live.iter().filter(|r| r.node_id.as_deref() == Some(agent.node.as_str())) {
                let Some(binding) = rsv.binding.as_ref().filter(|b| b.state == BindingState::Bound) else { continue };
                let on_agent: BTreeSet<&str> = ledger
                    .holds
                    .get(&rsv.reservation_id)
                    .map(|h| h.gpus.iter().map(|g| g.uuid.as_str()).collect())
                    .unwrap_or_default();
                let bound: BTreeSet<&str> = binding.gpu_uuids.iter().map(String::as_str).collect();
                if on_agent != bound {
                    self.history(&rsv.reservation_id).await;
                }
                assert_eq!(
                    on_agent, bound,
                    "seed {seed} step {step}: {} is bound, so its node holds its GPUs",
                    rsv.reservation_id
                );
                for gpu in &bound {
                    assert_eq!(held.get(gpu), Some(&rsv.reservation_id.as_str()), "seed {seed} step {step}: {gpu}");
                }
            }
        }
    }
}

async fn case(seed: u64) {
    let mut rng = SeededRng(seed);
    let mut w = World::new(seed, &mut rng).await;
    // (node, command) of finished commands.
    let mut finished: Vec<(String, String)> = Vec::new();
    for step in 0..STEPS {
        match pick(&mut rng, 11) {
            0 | 1 => w.request(&mut rng).await,
            2 => w.release(&mut rng).await,
            3 | 4 => w.pass().await,
            5 | 6 => {
                let a = pick(&mut rng, NODES);
                let crash = chance(&mut rng, 0.15);
                // A command of this node's delivered again (the gateway sends a node only its own).
                let own: Vec<&(String, String)> = finished.iter().filter(|(n, _)| *n == w.agents[a].node).collect();
                let again = (chance(&mut rng, 0.2) && !own.is_empty()).then(|| own[pick(&mut rng, own.len())].1.clone());
                w.answer(a, crash, again).await;
            }
            7 => {
                // Time passes: sometimes past holds' deadlines and reservations' ends.
                let by = if chance(&mut rng, 0.3) { bc_projections::HOLD_DEADLINE_S * 1000 + 1 } else { 5_000 };
                w.clock.set_ms(w.clock.now_ms() + by);
            }
            8 => {
                // An agent goes away (or crashes), or comes back and its journal catches up.
                let a = pick(&mut rng, NODES);
                if w.agents[a].runner.is_some() {
                    w.agents[a].runner = None;
                } else {
                    w.agents[a].start().await;
                    w.deliver(a).await;
                }
            }
            9 => {
                let m = &w.agents[pick(&mut rng, NODES)].machine;
                m.refuse_holds.store(!m.refuse_holds.load(Ordering::SeqCst), Ordering::SeqCst);
            }
            _ => {
                let m = &w.agents[pick(&mut rng, NODES)].machine;
                m.refuse_releases.store(!m.refuse_releases.load(Ordering::SeqCst), Ordering::SeqCst);
            }
        }
        if step % 10 == 0 {
            let commands: Vec<CommandDoc> = w.rows(KIND_COMMAND).await;
            finished = commands.into_iter().filter(|c| c.state.is_finished()).map(|c| (c.node_id, c.command_id)).collect();
        }
        w.check(seed, step).await;
    }
    // Faults stop: every agent runs and binds; within a bounded number of rounds every active
    // reservation is bound and every agent holds exactly the bound ones.
    for a in 0..NODES {
        let m = &w.agents[a].machine;
        m.refuse_holds.store(false, Ordering::SeqCst);
        m.refuse_releases.store(false, Ordering::SeqCst);
        if w.agents[a].runner.is_none() {
            w.agents[a].start().await;
        }
        w.deliver(a).await;
    }
    for _ in 0..20 {
        w.pass().await;
        for a in 0..NODES {
            w.answer(a, false, None).await;
        }
    }
    w.check(seed, STEPS).await;
    let live: Vec<ReservationDoc> = w.rows(KIND_RESERVATION_LIVE).await;
    for rsv in live.iter().filter(|r| r.state == ReservationState::Active) {
        assert_eq!(
            rsv.binding.as_ref().map(|b| b.state),
            Some(BindingState::Bound),
            "seed {seed}: {} settles bound",
            rsv.reservation_id
        );
    }
    let all: Vec<ReservationDoc> = w.rows(KIND_RESERVATION).await;
    let count = |state: ReservationState| all.iter().filter(|r| r.state == state).count();
    let retried: u32 = all.iter().map(|r| r.hold_attempts).sum();
    eprintln!(
        "seed {seed}: {} reservations: {} active, {} queued, {} released, {} expired, {} failed; {retried} failed holds",
        all.len(),
        count(ReservationState::Active),
        count(ReservationState::Queued),
        count(ReservationState::Released),
        count(ReservationState::Expired),
        count(ReservationState::Failed),
    );
    for agent in &w.agents {
        let expected: BTreeSet<&str> = live
            .iter()
            .filter(|r| r.state == ReservationState::Active && r.node_id.as_deref() == Some(agent.node.as_str()))
            .map(|r| r.reservation_id.as_str())
            .collect();
        let ledger = agent.ledger();
        let held: BTreeSet<&str> = ledger.holds.keys().map(String::as_str).collect();
        assert_eq!(held, expected, "seed {seed}: the agent of {} holds exactly its bound reservations (none leaked)", agent.node);
    }
}

#[tokio::test]
async fn no_gpu_is_ever_held_for_two_reservations_and_holds_settle() {
    let seeds: Vec<u64> = match std::env::var("BC_PROPERTY_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(seed) => vec![seed],
        None => {
            let cases = std::env::var("BC_PROPERTY_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(CASES_DEFAULT);
            let base = bc_tests::now_ms();
            (0..cases).map(|i| base.wrapping_add(i)).collect()
        }
    };
    for seed in seeds {
        eprintln!("holds property: seed {seed} (BC_PROPERTY_SEED={seed} repeats it)");
        case(seed).await;
    }
}
