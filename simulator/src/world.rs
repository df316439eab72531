//! One seeded world of the control plane and its agents, in one process: the real `Log` on a
//! real SQLite store with the real `Projections`, the real decisions, the reconcilers the
//! registry marks for the simulator (`bc_reconcilers::registry::simulated`: reservations,
//! rollouts, liveness), and per node the agent's real `Runner` (its journal, its holds ledger,
//! `decide_hold`) over a simulated node ([`SimNode`]) whose binding can be made to refuse. `sim run` connects the agents to the gateway's real session logic over its
//! in-memory transport (`run/net.rs`); [`World::answer`] and [`World::deliver`] are a direct
//! path kept for the checkers' own tests and the holds property test: the pending commands run,
//! and each journal entry is appended as the session appends it (checked against the node's
//! signature, on its subject's stream, by its idempotency key, with the entry under `journal`)
//! but without the session's other checks.
//!
//! `sim run` ([`crate::run`]) and the holds property test (`tests/tests/holds_property.rs`)
//! drive this one world; neither has its own copy. Time is the world's [`ManualClock`], ids
//! its [`SeededIds`], and every other choice comes from the caller's one [`SeededRng`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bc_agent::binding::{GpuBinding, HeldGpu};
use bc_agent::holds::{Ledger, LedgerFile};
use bc_agent::inventory::{GpuInfo, GpuInventory, Inventory, InventorySource};
use bc_agent::journal::Journal;
use bc_agent::runner::Runner;
use bc_agent::session::{Rng, SeededRng};
use bc_core::agent::{JournalOrigin, SignedEntry};
use bc_core::clock::{Clock, ManualClock};
use bc_core::id::{CommandId, NodeId, PoolId, ReservationId, TenantId};
use bc_core::id_source::SeededIds;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent, Projector};
use bc_projections::events as ev;
use bc_projections::fleet::Fleet;
use bc_projections::{
    BindingState, CommandDoc, KIND_COMMAND, KIND_NODE, KIND_NODE_COMMANDS, KIND_POOL, KIND_RESERVATION, KIND_RESERVATION_LIVE,
    NodeCommandsDoc, NodeDoc, Projections, ReservationDoc, ReservationState, stream_of,
};
use bc_reconcilers::registry::{self, SimulatedPass};
use ed25519_dalek::SigningKey;

/// The virtual clock's start (2027-01-15): every run begins at the same instant.
pub const EPOCH_MS: u64 = 1_800_000_000_000;
/// Rows read at once from a projection (a tenant's nodes, reservations or commands).
pub const ROWS_MAX: u32 = 100_000;
/// Commands an agent remembers having run, to deliver one again.
const RAN_REMEMBERED_MAX: usize = 16;
/// Journal entries read at once when delivering.
const DELIVER_PAGE: u32 = 256;

/// Where the world's files go: memory (`/dev/shm`) where there is one, since the store and the
/// journals sync every commit and nothing here needs to outlive the run; else the temporary
/// directory.
pub const SCRATCH_IN_MEMORY: &str = "/dev/shm";

fn scratch_dir() -> tempfile::TempDir {
    let builder = {
        let mut b = tempfile::Builder::new();
        b.prefix("bc-sim-");
        b
    };
    let memory = std::path::Path::new(SCRATCH_IN_MEMORY);
    if memory.is_dir()
        && let Ok(dir) = builder.tempdir_in(memory)
    {
        return dir;
    }
    builder.tempdir().expect("a temporary directory")
}

/// A uniform draw in `0..n` (0 when `n` is 0).
pub fn pick(rng: &mut SeededRng, n: usize) -> usize {
    (rng.next_unit() * n as f64) as usize % n.max(1)
}

/// True with probability `p`.
pub fn chance(rng: &mut SeededRng, p: f64) -> bool {
    rng.next_unit() < p
}

/// 32 bytes from the rng (a node key's or the log key's seed).
pub fn seed_bytes(rng: &mut SeededRng) -> [u8; 32] {
    let mut bytes = [0u8; 32];
    for b in &mut bytes {
        *b = pick(rng, 256) as u8;
    }
    bytes
}

/// True for an append error a fault injected into the log (`failing-commits`,
/// `reconciler-crash`, `failover`'s lost answers): the caller sees an error, as it would from a
/// database or a process that failed, and must cope (after a lost answer the write may have
/// been made: the caller decides again from what the log says, or asks again under its key);
/// any other error is a finding.
pub fn injected(error: &bc_core::Error) -> bool {
    let text = error.to_string();
    error.code() == bc_core::ErrorCode::Unavailable
        && (text.contains(bc_core::store::COMMIT_FAILED)
            || text.contains(bc_core::store::APPENDS_STOPPED)
            || text.contains(bc_core::store::COMMIT_ANSWER_LOST))
}

/// A simulated node, the hardware under an agent: its GPUs, and a binding that can be made to
/// refuse.
#[derive(Clone, Default)]
pub struct SimNode {
    pub inventory: Inventory,
    pub refuse_holds: Arc<AtomicBool>,
    pub refuse_releases: Arc<AtomicBool>,
}

impl SimNode {
    pub fn set_refuse_holds(&self, on: bool) {
        self.refuse_holds.store(on, Ordering::SeqCst);
    }
    pub fn set_refuse_releases(&self, on: bool) {
        self.refuse_releases.store(on, Ordering::SeqCst);
    }
    pub fn refuses_holds(&self) -> bool {
        self.refuse_holds.load(Ordering::SeqCst)
    }
    pub fn refuses_releases(&self) -> bool {
        self.refuse_releases.load(Ordering::SeqCst)
    }
}

impl InventorySource for SimNode {
    fn read(&self) -> Inventory {
        self.inventory.clone()
    }
}

impl GpuBinding for SimNode {
    fn unprivileged(&self) -> Option<String> {
        None
    }
    fn hold(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
        if self.refuses_holds() { Err("gpu-in-use: the simulated machine's refusal".into()) } else { Ok(()) }
    }
    fn release(&self, _gpus: &[HeldGpu]) -> Result<(), String> {
        if self.refuses_releases() { Err("device busy".into()) } else { Ok(()) }
    }
}

/// One node's agent: its data directory, key, the running `Runner` (`None`: crashed or away),
/// and how far its journal reached the log.
pub struct Agent {
    /// The index of the node's tenant in [`World::tenants`].
    pub tenant: usize,
    pub node: String,
    pub key: SigningKey,
    dir: tempfile::TempDir,
    pub machine: SimNode,
    pub runner: Option<Runner>,
    /// The last journal seq appended to the log.
    pub delivered: u64,
    /// How far this agent's clock is from the control plane's (ms; either way).
    pub skew_ms: i64,
    /// Commands this agent ran, newest last (bounded): what a redelivery sends again.
    pub ran: VecDeque<String>,
    /// The version it runs and the update slot it runs from (`rollouts`: `run/rollouts.rs`),
    /// and the version and slot before its last update.
    pub version: String,
    pub slot: String,
    pub previous: Option<(String, String)>,
    /// `holds.json` as last read: the stamp of the file it was read from (`None`: there was
    /// none), the ledger saves the process had made by then, and the ledger.
    ledger_read: std::sync::Mutex<Option<(Option<LedgerStamp>, u64, Ledger)>>,
}

/// Which `holds.json` a ledger was read from: its inode, modification time and size. The
/// runner writes the ledger whole, to a new file renamed over the old one (`LedgerFile::save`),
/// so a write gives a new inode; a stamp unchanged is the file unchanged.
type LedgerStamp = (u64, i64, i64, u64);

impl Agent {
    pub async fn start(&mut self) {
        let node: NodeId = self.node.parse().expect("a node id");
        let journal =
            Journal::open_for_one_thread(&self.dir.path().join("journal.db"), node, u64::MAX).expect("the journal opens");
        let ledger_file = LedgerFile::new(self.dir.path());
        let ledger = ledger_file.load().expect("the ledger loads");
        self.runner = Some(Runner {
            journal: Arc::new(journal),
            key: self.key.clone(),
            node,
            version: self.version.clone(),
            binding: Box::new(self.machine.clone()),
            inventory: Arc::new(self.machine.clone()),
            ledger: tokio::sync::Mutex::new(ledger),
            ledger_file,
            command_roots: Vec::new(),
        });
    }

    /// Remembers commands this agent ran (bounded, newest last): what a redelivery sends again.
    pub fn remember_ran(&mut self, ran: Vec<String>) {
        for id in ran {
            if !self.ran.contains(&id) {
                self.ran.push_back(id);
            }
            while self.ran.len() > RAN_REMEMBERED_MAX {
                self.ran.pop_front();
            }
        }
    }

    /// What `holds.json` says (the ledger survives a crash).
    /// Read again only when the file changed: the check after every step asks each of the
    /// tenant's agents, and reading and parsing every ledger each time was 4 % of a run. Nor is
    /// the file looked at while no ledger was saved in this process since it was last looked at
    /// (`saves_in_process`): a `statx` per agent per step was 2 % of a run.
    pub fn ledger(&self) -> Ledger {
        use std::os::unix::fs::MetadataExt as _;
        // Counted before the file is looked at, so a save after that moves the count past this.
        let saves = bc_agent::ledger::saves_in_process();
        let mut read = self.ledger_read.lock().expect("the ledger cache");
        if let Some((_, seen_saves, ledger)) = read.as_ref()
            && *seen_saves == saves
        {
            return ledger.clone();
        }
        let file = LedgerFile::new(self.dir.path());
        let stamp = match std::fs::metadata(file.path()) {
            Ok(m) => Some((m.ino(), m.mtime(), m.mtime_nsec(), m.size())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => panic!("the ledger's file: {e}"),
        };
        let ledger = match (stamp, read.take()) {
            (Some(stamp), Some((Some(seen), _, ledger))) if seen == stamp => ledger,
            (Some(_), _) => file.load().expect("the ledger loads"),
            (None, _) => Ledger::default(),
        };
        *read = Some((stamp, saves, ledger.clone()));
        ledger
    }

    /// Writes `holds.json` underneath the runner: for the checker's own tests, which corrupt it.
    pub fn ledger_overwrite(&self, ledger: &Ledger) {
        LedgerFile::new(self.dir.path()).save(ledger).expect("the ledger saves");
    }

    /// Every entry of the agent's journal, in order: read through its runner, or, while it is
    /// crashed or away, from its journal file (which outlives the process, as on a node).
    pub async fn journal_entries(&self) -> Vec<SignedEntry> {
        let opened;
        let journal = match self.runner.as_ref() {
            Some(runner) => &*runner.journal,
            None => {
                let node: NodeId = self.node.parse().expect("a node id");
                opened =
                    Journal::open_for_one_thread(&self.dir.path().join("journal.db"), node, u64::MAX).expect("the journal opens");
                &opened
            }
        };
        let mut all: Vec<SignedEntry> = Vec::new();
        loop {
            let after = all.last().map_or(0, |e| e.seq);
            let entries = journal.after(after, DELIVER_PAGE).await.expect("the journal reads");
            if entries.is_empty() {
                break;
            }
            all.extend(entries);
        }
        all
    }
}

/// One node's journal entries as the log holds them, in log order: `(seq, body)`, the body as
/// the entry's `journal.body` carries it (base64).
pub type JournalInLog = Vec<(u64, String)>;

/// Why the log refused a journal entry: what the run reports, from the log's own state (the
/// node's journal head as the log has it) and the error's code, not from its wording.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JournalRefusalCause {
    /// The entry is at or below the node's journal head in the log: it was delivered twice and
    /// taken twice (the idempotency key did not stop it).
    Duplicated,
    /// The entry is past the head's next: the entries between never reached the log.
    Gap,
    /// Its idempotency key (`journal:NODE:SEQ`) is held by another request.
    IdempotencyKeyTaken,
    /// Something else refused it (the error says what).
    Other,
}

/// A journal entry the log refused: a broken premise the run reports at the step that
/// delivered it.
#[derive(Clone, Debug)]
pub struct JournalRefused {
    pub node: String,
    pub seq: u64,
    /// The node's journal head as the log had it when it refused (0: none yet).
    pub head_in_log: u64,
    pub cause: JournalRefusalCause,
    pub error: String,
}

impl std::fmt::Display for JournalRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (node, seq, head) = (&self.node, self.seq, self.head_in_log);
        match self.cause {
            JournalRefusalCause::Duplicated => write!(
                f,
                "journal entry {seq} of {node} was delivered twice (duplicated): the log already has its journal up to {head}"
            )?,
            JournalRefusalCause::Gap => write!(
                f,
                "journal entry {seq} of {node} came after a gap: the log has its journal up to {head}, so {}..={} never reached it",
                head + 1,
                seq - 1
            )?,
            JournalRefusalCause::IdempotencyKeyTaken => {
                write!(f, "journal entry {seq} of {node}: its idempotency key journal:{node}:{seq} is held by another request")?
            }
            JournalRefusalCause::Other => write!(f, "journal entry {seq} of {node} was refused (log journal head {head})")?,
        }
        write!(f, "; the log said: {}", self.error)
    }
}

/// A tenant of the world: its id and its one pool.
#[derive(Clone, Debug)]
pub struct Tenant {
    pub id: TenantId,
    pub pool: String,
}

/// The shape of a world.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub tenants: usize,
    /// Nodes in all, dealt to the tenants in turn (node `i` to tenant `i % tenants`).
    pub nodes: usize,
    /// Each node has `gpus_min..=gpus_max` GPUs, drawn from the seed.
    pub gpus_min: u32,
    pub gpus_max: u32,
}

/// A broken invariant: what, and at which step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation(pub String);

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(Violation(format!($($arg)+)));
        }
    };
}

pub struct World {
    /// Where the store's file lives (a gateway restart opens it again).
    dir: tempfile::TempDir,
    pub store: Arc<dyn EventStore>,
    /// The same store, typed: the checker's own tests corrupt it underneath the log.
    pub sqlite: Arc<SqliteStore>,
    pub log: Arc<Log>,
    /// The reconcilers the registry marks for the simulator, built on `log`, in its order: what
    /// [`Self::pass`] activates.
    reconcilers: tokio::sync::Mutex<Vec<SimulatedPass>>,
    /// The fold the log writes its rows with and the full checks fold the log with again: the
    /// real `Projections`, but for the oracle's own test (`--unsafe-break wrong-fold`).
    pub projector: Arc<dyn Projector>,
    pub log_key: Arc<LogKey>,
    pub clock: Arc<ManualClock>,
    pub tenants: Vec<Tenant>,
    pub fleet: Fleet,
    pub agents: Vec<Agent>,
    /// Journal entries are appended under their idempotency key (false only for the checker's
    /// own test, `--unsafe-no-journal-dedupe`).
    pub journal_dedupe: bool,
    /// The first journal entry the log refused (a broken invariant the run reports).
    pub refused: Option<JournalRefused>,
    /// Every workload append the log acknowledged with new events: `(tenant, seq, event id)`,
    /// which the full check finds in the log again (no acknowledged event lost).
    pub acknowledged: std::sync::Mutex<Vec<(TenantId, u64, String)>>,
    /// Per tenant, the rows the check after every step reads ([`CheckedRows`]), as of a seq of
    /// the tenant's chain. A tenant's projection rows change only in a commit of its own chain
    /// (the projections key every row an event touches by the event's tenant), which moves its
    /// head: rows read at the head still current are the rows in the store, and once it moved,
    /// only the rows the events since touch changed (read again by key). [`Self::row_overwrite`],
    /// which writes underneath the log, forgets them; every full check compares them with the
    /// store ([`Self::check_checked_rows`]). Reading and decoding all of them at every checked
    /// step was a quarter of a run at 100 nodes a tenant.
    checked_rows: std::sync::Mutex<BTreeMap<usize, Arc<CheckedRows>>>,
}

/// The rows of one tenant the check after every step reads, by id: its live reservations and
/// its nodes' allocations, as of the tenant's chain at `head`.
#[derive(Clone, PartialEq)]
struct CheckedRows {
    head: u64,
    live: BTreeMap<String, LiveReservation>,
    nodes: BTreeMap<String, NodeAllocations>,
}

/// Events since [`CheckedRows::head`] at most that are read to find the rows they touched;
/// further behind (a first read), the tenant's rows are read whole.
const CHECKED_ROWS_EVENTS_MAX: u64 = 256;

/// Node `n` of tenant `t` as it joins: its agent (not started) and the append that joins it
/// (`node.joined` and `node.ready` on its new stream). Its id, GPU count and key come from the
/// log's ids and `rng`, in that order.
fn node_joining(log: &Log, tenants: &[Tenant], n: usize, t: usize, rng: &mut SeededRng, shape: &Shape) -> (Agent, AppendRequest) {
    let node = NodeId::from_ulid(log.ids.ulid()).to_string();
    let span = shape.gpus_max.saturating_sub(shape.gpus_min) as usize + 1;
    let count = shape.gpus_min + pick(rng, span) as u32;
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
    let key = SigningKey::from_bytes(&seed_bytes(rng));
    let joined = ev::NodeJoined {
        pool_id: tenants[t].pool.clone(),
        name: format!("n{n}"),
        gpus: gpus
            .iter()
            .map(|g| ev::Gpu { model: g.model.clone(), product: g.product.clone(), vram_gib: 80, nvlink_domain: 0 })
            .collect(),
        labels: Default::default(),
        public_key: bc_core::agent::b64(key.verifying_key().as_bytes()),
        join_token_id: "jt_sim".into(),
        agent_version: "sim".into(),
        hostname: format!("n{n}"),
        gpu_uuids: gpus.iter().map(|g| g.uuid.clone()).collect(),
        tpm: None,
    };
    let ready = ev::NodeLiveness { lease_expires_at_ms: u64::MAX / 2 };
    let events = vec![
        NewEvent::new(ev::NODE_JOINED, ev::to_cbor(&joined).expect("cbor")),
        NewEvent::new(ev::NODE_READY, ev::to_cbor(&ready).expect("cbor")),
    ];
    let request = AppendRequest::new(tenants[t].id, stream_of(KIND_NODE, &node), ExpectedVersion::NoStream, "sim", events);
    let inventory = Inventory { gpus: GpuInventory { gpus, ..Default::default() }, ..Default::default() };
    let machine = SimNode { inventory, ..Default::default() };
    let agent = Agent {
        tenant: t,
        node,
        key,
        dir: scratch_dir(),
        machine,
        runner: None,
        delivered: 0,
        skew_ms: 0,
        ran: VecDeque::new(),
        version: "sim".into(),
        slot: "a".into(),
        previous: None,
        ledger_read: Default::default(),
    };
    (agent, request)
}

/// The part of a node's document the check after each step reads (decoding all of it, every
/// step, was a tenth of a run's time).
#[derive(serde::Deserialize, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
struct NodeAllocations {
    node_id: String,
    #[serde(default)]
    allocations: BTreeMap<u32, String>,
}

/// The part of a live reservation's document the check after each step reads.
#[derive(serde::Deserialize, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
struct LiveReservation {
    reservation_id: String,
    state: ReservationState,
    node_id: Option<String>,
    gpu_indexes: Vec<u32>,
    #[serde(default)]
    binding: Option<LiveBinding>,
}

#[derive(serde::Deserialize, Clone, PartialEq)]
#[serde(rename_all = "camelCase")]
struct LiveBinding {
    state: BindingState,
    #[serde(default)]
    gpu_uuids: Vec<String>,
}

/// The reconcilers of the registry the simulator activates itself, built on `log` and the
/// world's clock.
fn simulated_passes(store: &Arc<dyn EventStore>, log: &Arc<Log>, clock: &Arc<ManualClock>) -> Vec<SimulatedPass> {
    let inputs = registry::Inputs::new(store.clone(), Some(log.clone()), clock.clone());
    registry::simulated(&inputs).expect("the simulated reconcilers build")
}

impl World {
    /// A world of `shape` from `seed`: the log key, the tenants' ids, the nodes' keys and GPU
    /// counts all come from it.
    pub async fn new(seed: u64, rng: &mut SeededRng, shape: Shape) -> World {
        World::new_folding(seed, rng, shape, Arc::new(Projections)).await
    }

    /// [`Self::new`] with another fold (the oracle's own test gives a wrong one).
    pub async fn new_folding(seed: u64, rng: &mut SeededRng, shape: Shape, projector: Arc<dyn Projector>) -> World {
        assert!(shape.tenants >= 1 && shape.nodes >= shape.tenants, "every tenant has a node");
        let dir = scratch_dir();
        let sqlite = Arc::new(SqliteStore::open_for_one_thread(&dir.path().join("sim.sqlite3")).await.expect("the store opens"));
        let store: Arc<dyn EventStore> = sqlite.clone();
        store.migrate_at(EPOCH_MS).await.expect("the store migrates");
        let clock = Arc::new(ManualClock::new(EPOCH_MS));
        // Every id from the seed, so a seed repeats the run: placement breaks ties by node id,
        // and the plan orders failed holds by reservation id.
        let ids = Arc::new(SeededIds::new(seed, clock.clone()));
        let log_key = Arc::new(LogKey::from_seed(seed_bytes(rng)));
        let log = Log::open_with_ids(store.clone(), projector.clone(), log_key.clone(), clock.clone(), ids)
            .await
            .expect("the log opens");
        let mut tenants = Vec::new();
        for t in 0..shape.tenants {
            let id = TenantId::from_ulid(log.ids.ulid());
            let pool = PoolId::from_ulid(log.ids.ulid()).to_string();
            let created = ev::PoolCreated::named(format!("pool-{t}"));
            let event = NewEvent::new(ev::POOL_CREATED, ev::to_cbor(&created).expect("cbor"));
            log.append(AppendRequest::new(id, stream_of(KIND_POOL, &pool), ExpectedVersion::NoStream, "sim", vec![event]))
                .await
                .expect("the pool is created");
            tenants.push(Tenant { id, pool });
        }
        let mut agents = Vec::new();
        for n in 0..shape.nodes {
            let t = n % shape.tenants;
            let (agent, request) = node_joining(&log, &tenants, n, t, rng, &shape);
            log.append(request).await.expect("the node joins");
            agents.push(agent);
        }
        for agent in &mut agents {
            agent.start().await;
        }
        let fleet = Fleet::new();
        fleet.prime(&*store).await.expect("the fleet primes");
        let log = Arc::new(log);
        World {
            dir,
            reconcilers: tokio::sync::Mutex::new(simulated_passes(&store, &log, &clock)),
            store,
            sqlite,
            log,
            projector,
            log_key,
            clock,
            tenants,
            fleet,
            agents,
            journal_dedupe: true,
            refused: None,
            acknowledged: Default::default(),
            checked_rows: Default::default(),
        }
    }

    /// A node of tenant `t` joins now, as `bcd join` makes it join (its agent started): its
    /// index, or `None` when the append failed (a fault the simulator injected; the operator
    /// tries again later).
    pub async fn node_join(&mut self, t: usize, rng: &mut SeededRng, shape: &Shape) -> Option<usize> {
        let n = self.agents.len();
        let (mut agent, request) = node_joining(&self.log, &self.tenants, n, t, rng, shape);
        if let Err(e) = self.append_acknowledged(request).await {
            // The commit made and its answer lost (`failover`): the machine asks again with the
            // same key and the gateway answers with the node it made (`agents/join.rs`,
            // `joined_before`), so it runs as that node. Before, the simulated machine gave
            // up, and the node it had made stayed ready with no agent: its commands were
            // queued for ever.
            let made = matches!(e, bc_core::Error::Indeterminate(_))
                && self.doc::<serde_json::Value>(t, KIND_NODE, &agent.node).await.is_some();
            if !made && injected(&e) {
                return None;
            }
            assert!(made, "a node's join failed: {e}");
        }
        agent.start().await;
        self.agents.push(agent);
        Some(n)
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    pub async fn rows<T: serde::de::DeserializeOwned>(&self, t: usize, kind: &str) -> Vec<T> {
        // Decoded straight from the stored text: through a `serde_json::Value` first, the reads
        // of the check after every step were a fifth of a run.
        let rows = self.store.row_list_raw(&self.tenants[t].id.to_string(), kind, None, ROWS_MAX).await.expect("rows read");
        rows.into_iter().map(|r| serde_json::from_str(&r.doc).expect("a document")).collect()
    }

    pub async fn doc<T: serde::de::DeserializeOwned>(&self, t: usize, kind: &str, id: &str) -> Option<T> {
        let row = self.store.row_get(&self.tenants[t].id.to_string(), kind, id).await.expect("a row read");
        row.map(|r| serde_json::from_value(r.doc).expect("a document"))
    }

    /// TEST ONLY (`--unsafe-…` switches): overwrites tenant `t`'s row `kind`/`id` underneath
    /// the log, as a fold gone wrong or a corrupted database would. True if the row was there.
    pub async fn row_overwrite(&self, t: usize, kind: &str, id: &str, doc: &serde_json::Value) -> bool {
        // Rows changed without a commit of the tenant's chain: what the step check read is stale.
        self.checked_rows.lock().expect("not poisoned").remove(&t);
        let done = sqlx::query("UPDATE projections SET doc = ? WHERE tenant_id = ? AND kind = ? AND id = ?")
            .bind(serde_json::to_string(doc).expect("json"))
            .bind(self.tenants[t].id.to_string())
            .bind(kind)
            .bind(id)
            .execute(self.sqlite.pool())
            .await
            .expect("the row is written");
        done.rows_affected() == 1
    }

    /// Appends a reservation request (queued; the reconciler places it).
    pub async fn request(&self, t: usize, gpus: u32, duration_s: u64) -> String {
        let requested = ev::ReservationRequested {
            pool_id: self.tenants[t].pool.clone(),
            gpus,
            duration_s,
            selector: String::new(),
            nvlink: false,
            tolerations: vec![],
            project_id: None,
        };
        let id = ReservationId::from_ulid(self.log.ids.ulid()).to_string();
        let event = NewEvent::new(ev::RESERVATION_REQUESTED, ev::to_cbor(&requested).expect("cbor"));
        let request = AppendRequest::new(
            self.tenants[t].id,
            stream_of(KIND_RESERVATION, &id),
            ExpectedVersion::NoStream,
            "sim",
            vec![event],
        );
        self.append_acknowledged(request).await.expect("the request is appended");
        id
    }

    /// Releases `rsv` as `reservations.release` does; false if it was over or a CONFLICT.
    pub async fn release_one(&self, t: usize, rsv: &ReservationDoc) -> bool {
        let command = CommandId::from_ulid(self.log.ids.ulid()).to_string();
        let issue = bc_projections::placement::Issue { command_id: &command, now_ms: self.now_ms() };
        let Some(append) = bc_projections::decide::reservation_release(rsv, None, issue).expect("release decides") else {
            return false;
        };
        match self.append_acknowledged(append.into_request(self.tenants[t].id, "sim")).await {
            Ok(_) => true,
            Err(e) if e.code() == bc_core::ErrorCode::Conflict || injected(&e) => false,
            Err(e) => panic!("release: {e}"),
        }
    }

    /// Releases a random live reservation of tenant `t`.
    pub async fn release(&self, t: usize, rng: &mut SeededRng) -> bool {
        let live: Vec<ReservationDoc> = self.rows(t, KIND_RESERVATION_LIVE).await;
        if live.is_empty() {
            return false;
        }
        let rsv = &live[pick(rng, live.len())];
        self.release_one(t, rsv).await
    }

    /// One activation of each reconciler the registry marks for the simulator
    /// (`registry::Simulated::Passes`: reservations, rollouts, liveness), in its order.
    /// Returns how many nodes they found unreachable (the liveness pass's count).
    pub async fn pass(&self) -> u64 {
        let mut unreachable = 0;
        for pass in self.reconcilers.lock().await.iter_mut() {
            // A failed commit (`failing-commits`) ends a pass early, as in a reconciler process:
            // the next pass reads the world again.
            match pass.reconciler.activate().await.outcome {
                Err(e) if !injected(&e) => panic!("the {} pass: {e}", pass.name),
                Ok(counts) => unreachable += counts.iter().filter(|(key, _)| *key == "unreachable").map(|(_, n)| n).sum::<u64>(),
                Err(_) => {}
            }
        }
        unreachable
    }

    /// [`Self::pass`] dropped part way, as a reconciler process dies: of the passes the
    /// `reconciler-crash` fault cuts (`Simulated::Passes { crashes: true }`), the first
    /// `appends` appends (a group of actions, one transaction, is one) are taken and nothing
    /// after them (`Log::appends_limit`); the next pass must do the rest. True if the passes
    /// used up their appends (so the crash may have cut something off).
    pub async fn pass_crashing(&self, appends: u64) -> bool {
        self.log.appends_limit(Some(appends));
        for pass in self.reconcilers.lock().await.iter_mut().filter(|pass| pass.crashes) {
            match pass.reconciler.activate().await.outcome {
                // The process died there: no pass after it runs.
                Err(e) if injected(&e) => break,
                Err(e) => panic!("a reconciler pass: {e}"),
                Ok(_) => {}
            }
        }
        self.log.appends_limit(None) == Some(0)
    }

    /// A gateway restart: the `Log` (its appender task), the store's connections and the
    /// fleet's in-memory views are dropped and opened again from the same SQLite file, as a new
    /// process would. The caller breaks the sessions: the agents reconnect and deliver their
    /// journals from what the log says it holds.
    pub async fn restart_gateway(&mut self) {
        let sqlite = Arc::new(
            SqliteStore::open_for_one_thread(&self.dir.path().join("sim.sqlite3")).await.expect("the store opens again"),
        );
        let store: Arc<dyn EventStore> = sqlite.clone();
        store.migrate_at(self.now_ms()).await.expect("the store migrates (nothing to do)");
        let ids = self.log.ids.clone();
        let log = Log::open_with_ids(store.clone(), self.projector.clone(), self.log_key.clone(), self.clock.clone(), ids)
            .await
            .expect("the log opens again");
        let log = Arc::new(log);
        let fleet = Fleet::new();
        fleet.prime(&*store).await.expect("the fleet primes again");
        // The reconcilers restart with the process: they let go of the old log and their views,
        // and are built again on the new log.
        let reconcilers = simulated_passes(&store, &log, &self.clock);
        drop(std::mem::replace(self.reconcilers.get_mut(), reconcilers));
        // The old appender stops when its queue closes, with the last handle on the old log
        // (nothing is in flight: steps run one at a time).
        drop(std::mem::replace(&mut self.log, log));
        self.fleet = fleet;
        self.store = store;
        self.sqlite = sqlite;
    }

    /// The commands queued for agent `a`'s node, in issue order.
    pub async fn pending(&self, a: usize) -> Vec<String> {
        let agent = &self.agents[a];
        self.doc::<NodeCommandsDoc>(agent.tenant, KIND_NODE_COMMANDS, &agent.node).await.map(|q| q.pending).unwrap_or_default()
    }

    /// Agent `a` runs its queued commands in issue order with its real runner (and the
    /// releases it retries), then its journal reaches the log, unless it `crash`es first (its
    /// entries wait in its journal for its restart). `again` delivers a command a second time,
    /// which the runner must not run twice. `deaf`: the commands do not reach it (they stay
    /// queued, unanswered); it still retries releases and delivers its journal.
    pub async fn answer(&mut self, a: usize, crash: bool, again: Option<String>, deaf: bool, lose_ack: bool) {
        let now = self.now_ms().saturating_add_signed(self.agents[a].skew_ms);
        let t = self.agents[a].tenant;
        if self.agents[a].runner.is_none() {
            return;
        }
        let mut ids = if deaf { Vec::new() } else { self.pending(a).await };
        ids.extend(again);
        let mut ran = Vec::new();
        {
            let runner = self.agents[a].runner.as_ref().expect("running");
            for id in ids {
                let command: CommandDoc = self.doc(t, KIND_COMMAND, &id).await.expect("a queued command exists");
                let proto = bc_proto::Command {
                    command_id: command.command_id.clone(),
                    kind: command.kind.clone(),
                    args_json: serde_json::to_string(&command.args).expect("json"),
                    issued_at_ms: command.issued_at_ms,
                    deadline_ms: command.deadline_at_ms,
                    release_json: command.release.as_ref().map(|r| serde_json::to_string(r).expect("json")).unwrap_or_default(),
                };
                runner.run(&proto, now).await.expect("the runner runs");
                ran.push(id);
            }
            runner.retry_releases(now).await.expect("the runner retries releases");
        }
        let agent = &mut self.agents[a];
        agent.remember_ran(ran);
        if crash {
            agent.runner = None;
            return;
        }
        self.deliver(a, lose_ack).await;
    }

    /// Appends a workload's request (a tenant's or an operator's) and remembers the events the
    /// log acknowledged, so every full check can find them again.
    pub async fn append_acknowledged(&self, request: AppendRequest) -> bc_core::Result<bc_core::store::AppendResult> {
        let result = self.log.append(request).await?;
        if !result.replayed {
            self.acknowledge(&result);
        }
        Ok(result)
    }

    /// A client's append through the gateway: under the idempotency key `key`, and sent again
    /// under the same key when its answer was lost (`failover`'s `Indeterminate`), as the
    /// UNAVAILABLE answer's hint tells a client to. The simulator loses only the answers of
    /// commits that were made, so the retry must replay what the lost commit made: `Err` names
    /// the broken invariant when it appends again (the write made twice) or is refused (a
    /// client never told the outcome). `Ok` holds the answer the client ends with, and whether
    /// it asked twice.
    pub async fn append_as_client(
        &self,
        mut request: AppendRequest,
        key: String,
    ) -> Result<(bc_core::Result<bc_core::store::AppendResult>, bool), String> {
        request.idempotency_key = Some(key.clone());
        match self.append_acknowledged(request.clone()).await {
            Err(bc_core::Error::Indeterminate(_)) => {}
            answered => return Ok((answered, false)),
        }
        match self.append_acknowledged(request).await {
            Ok(result) if result.replayed => {
                self.acknowledge(&result);
                Ok((Ok(result), true))
            }
            Ok(result) => Err(format!(
                "the retry under key {key} of a write whose commit was made and its answer lost appended it again \
                 ({} events from seq {}) instead of replaying it",
                result.events.len(),
                result.events.first().map_or(0, |e| e.envelope.seq)
            )),
            Err(e) => {
                Err(format!("the retry under key {key} of a write whose commit was made and its answer lost was refused: {e}"))
            }
        }
    }

    /// Records `result`'s events as acknowledged to their caller: the full checks must find
    /// each in the log, at its place, for the rest of the run. A replay is acknowledged by the
    /// caller that asked again after its first answer was lost (`failover`).
    pub fn acknowledge(&self, result: &bc_core::store::AppendResult) {
        let mut acknowledged = self.acknowledged.lock().expect("not poisoned");
        for event in &result.events {
            acknowledged.push((event.envelope.tenant, event.envelope.seq, event.envelope.id.to_string()));
        }
    }

    /// The append the gateway's session makes of agent `a`'s journal entry `seq` (its `body` and
    /// node `signature` as the journal holds them): the entry's event on its subject's stream,
    /// its provenance under `journal`, as the node, under the key `journal:NODE:SEQ` (unless the
    /// checker's own test turned that off). Refuses an entry whose signature does not verify
    /// under the node's key, as the session does.
    pub fn journal_request(&self, a: usize, seq: u64, body: &[u8], signature: &[u8; 64]) -> Result<AppendRequest, String> {
        let agent = &self.agents[a];
        let (body_parsed, _) =
            SignedEntry::verify(seq, body, signature, &agent.key.verifying_key()).map_err(|e| e.to_string())?;
        Ok(self.journal_request_unchecked(a, seq, &body_parsed, body, signature))
    }

    /// [`Self::journal_request`] without the signature check: for the checker's own tests, to
    /// put an entry in the log that its node never signed.
    pub fn journal_request_unchecked(
        &self,
        a: usize,
        seq: u64,
        body_parsed: &bc_core::agent::EntryBody,
        body: &[u8],
        signature: &[u8; 64],
    ) -> AppendRequest {
        let agent = &self.agents[a];
        let origin = JournalOrigin {
            node_id: agent.node.clone(),
            seq,
            body: bc_core::agent::b64(body),
            signature: bc_core::agent::b64(signature),
        };
        let mut payload = body_parsed.payload.clone();
        payload[bc_core::agent::JOURNAL_PAYLOAD_KEY] = serde_json::to_value(&origin).expect("json");
        let event = NewEvent::new(body_parsed.entry_type.clone(), bc_core::canonical::from_json(&payload).expect("cbor"));
        let mut request = AppendRequest::new(
            self.tenants[agent.tenant].id,
            body_parsed.subject.clone(),
            ExpectedVersion::Any,
            format!("node:{}", agent.node),
            vec![event],
        );
        if self.journal_dedupe {
            request.idempotency_key = Some(format!("journal:{}:{}", agent.node, seq));
        }
        request
    }

    /// Appends the agent's journal entries the log lacks, as the gateway's session does, each
    /// under its idempotency key (`journal:NODE:SEQ`), so an entry delivered again is taken
    /// once. `lose_ack`: the acknowledgement never reaches the agent, which delivers the same
    /// entries again next time.
    pub async fn deliver(&mut self, a: usize, lose_ack: bool) {
        let agent = &self.agents[a];
        let Some(runner) = agent.runner.as_ref() else { return };
        let mut delivered = agent.delivered;
        loop {
            let entries = runner.journal.after(delivered, DELIVER_PAGE).await.expect("the journal reads");
            if entries.is_empty() {
                break;
            }
            for entry in entries {
                let request = self.journal_request(a, entry.seq, &entry.body, &entry.signature).expect("the entry verifies");
                if let Err(e) = self.log.append(request).await {
                    if injected(&e) {
                        // The session's append failed: nothing is acknowledged from here on (those
                        // before it were taken, their acknowledgement lost with the session); the
                        // agent delivers again next time.
                        return;
                    }
                    // Only a broken premise gets here (an entry appended twice, out of order):
                    // the run reports it, by its cause; this agent delivers nothing more.
                    let refused = self.journal_refused(a, entry.seq, &e).await;
                    self.refused.get_or_insert(refused);
                    return;
                }
                delivered = entry.seq;
            }
        }
        if !lose_ack {
            self.agents[a].delivered = delivered;
        }
    }

    /// TEST ONLY (`--unsafe-no-journal-dedupe`): appends agent `a`'s entry as it came off the
    /// transport, without the gateway session's checks (past the node's signature) and, the
    /// world's `journal_dedupe` being off, without its idempotency key; true if the log took it.
    /// A refusal is kept in [`Self::refused`] for the run to report.
    ///
    /// The guard below the session, the fold's refusal of an entry that does not follow the
    /// node's journal head, is broken too: an entry at or below the head in the node's row
    /// rewinds the row's head to just before it, behind the fold's back, so only the full
    /// check's journal check can find the entry taken twice. When the fold still refuses it
    /// for what it says (its subject's own state), the row is put back and the entry is
    /// dropped, unreported: only a duplicate the log takes is of use here.
    pub async fn append_entry_unchecked(&mut self, a: usize, entry: &bc_proto::JournalEntry) -> bool {
        let Ok(signature) = <[u8; 64]>::try_from(entry.signature.as_slice()) else { return false };
        let request = self.journal_request(a, entry.seq, &entry.body, &signature).expect("the entry verifies");
        let (t, node) = (self.agents[a].tenant, self.agents[a].node.clone());
        let row = self.doc::<serde_json::Value>(t, KIND_NODE, &node).await;
        let head = row.as_ref().and_then(|r| r["agent"]["journalSeq"].as_u64()).unwrap_or(0);
        let rewound = match row.as_ref() {
            Some(row) if entry.seq <= head && entry.seq > 0 => {
                let mut behind = row.clone();
                behind["agent"]["journalSeq"] = (entry.seq - 1).into();
                self.row_overwrite(t, KIND_NODE, &node, &behind).await.then_some(row)
            }
            _ => None,
        };
        match self.log.append(request).await {
            Ok(_) => true,
            Err(e) if injected(&e) => {
                if let Some(row) = rewound {
                    self.row_overwrite(t, KIND_NODE, &node, row).await;
                }
                false
            }
            Err(_) if rewound.is_some() => {
                self.row_overwrite(t, KIND_NODE, &node, rewound.expect("rewound")).await;
                false
            }
            Err(e) => {
                let refused = self.journal_refused(a, entry.seq, &e).await;
                self.refused.get_or_insert(refused);
                false
            }
        }
    }

    /// What the log's refusal of agent `a`'s entry `seq` means, judged by the node's journal
    /// head in the log's rows and the error's code.
    async fn journal_refused(&self, a: usize, seq: u64, error: &bc_core::Error) -> JournalRefused {
        let agent = &self.agents[a];
        let head_in_log =
            self.doc::<NodeDoc>(agent.tenant, KIND_NODE, &agent.node).await.and_then(|n| n.agent).map_or(0, |n| n.journal_seq);
        let cause = if error.code() == bc_core::ErrorCode::IdempotencyConflict {
            JournalRefusalCause::IdempotencyKeyTaken
        } else if seq <= head_in_log {
            JournalRefusalCause::Duplicated
        } else if seq > head_in_log + 1 {
            JournalRefusalCause::Gap
        } else {
            JournalRefusalCause::Other
        };
        JournalRefused { node: agent.node.clone(), seq, head_in_log, cause, error: error.to_string() }
    }

    /// A reservation's events and its node's commands, to explain a failure.
    pub async fn history(&self, t: usize, reservation_id: &str) -> Vec<String> {
        let rows = self
            .store
            .read_after_rows(bc_core::event::Position { commit: 0, index: 0 }, Some(self.tenants[t].id), ROWS_MAX)
            .await
            .expect("the log reads");
        let mut out = Vec::new();
        for row in rows {
            let (seq, stream, event_type) = (row.seq, row.stream.clone(), row.event_type.clone());
            let event = row.decode().expect("an event decodes");
            let payload = bc_core::canonical::to_json(&event.envelope.payload).to_string();
            if stream.ends_with(reservation_id) || payload.contains(reservation_id) {
                out.push(format!("{seq} {stream} {event_type} {}", bc_core::id::truncate(&payload, 400)));
            }
        }
        out
    }

    /// No GPU held for two reservations, on the control plane or on an agent; what the control
    /// plane calls bound, the agent holds.
    pub async fn check(&self) -> Result<(), Violation> {
        for t in 0..self.tenants.len() {
            self.check_tenant(t).await?;
        }
        Ok(())
    }

    /// Tenant `t`'s [`CheckedRows`]: read again only when its chain's head moved since they
    /// were last read (or a row was written underneath the log).
    async fn checked_rows(&self, t: usize) -> Arc<CheckedRows> {
        let tenant = self.tenants[t].id;
        let heads = self.store.heads().await.expect("the heads read");
        let head = heads.iter().find(|(id, _)| *id == tenant).map_or(0, |(_, h)| h.seq);
        let cached = self.checked_rows.lock().expect("not poisoned").remove(&t);
        let rows = match cached {
            Some(mut rows) if rows.head <= head && head - rows.head <= CHECKED_ROWS_EVENTS_MAX => {
                if rows.head < head {
                    self.checked_rows_patch(t, Arc::make_mut(&mut rows), head).await;
                }
                rows
            }
            _ => Arc::new(self.checked_rows_read(t, head).await),
        };
        self.checked_rows.lock().expect("not poisoned").insert(t, rows.clone());
        rows
    }

    /// Tenant `t`'s [`CheckedRows`] read whole, at its chain's `head`.
    async fn checked_rows_read(&self, t: usize, head: u64) -> CheckedRows {
        let live: Vec<LiveReservation> = self.rows(t, KIND_RESERVATION_LIVE).await;
        let nodes: Vec<NodeAllocations> = self.rows(t, KIND_NODE).await;
        CheckedRows {
            head,
            live: live.into_iter().map(|r| (r.reservation_id.clone(), r)).collect(),
            nodes: nodes.into_iter().map(|n| (n.node_id.clone(), n)).collect(),
        }
    }

    /// Brings `rows` from their head to `head`: the rows the tenant's events since touched (by
    /// the log's own projector) are read again by key, and those gone are dropped.
    async fn checked_rows_patch(&self, t: usize, rows: &mut CheckedRows, head: u64) {
        let tenant = self.tenants[t].id;
        let mut touched: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();
        let mut keys = Vec::new();
        let mut from = rows.head + 1;
        while from <= head {
            let page = self.store.read_chain_rows(tenant, from, CHECKED_ROWS_EVENTS_MAX as u32).await.expect("the log reads");
            let Some(last) = page.last() else { break };
            from = last.seq + 1;
            for row in page {
                let event = row.decode().expect("an event decodes");
                keys.clear();
                self.projector.touches(&event, &mut keys);
                for key in keys.drain(..) {
                    for kind in [KIND_NODE, KIND_RESERVATION_LIVE] {
                        if key.kind == kind {
                            touched.entry(kind).or_default().insert(key.id.clone());
                        }
                    }
                }
            }
        }
        let tenant = tenant.to_string();
        for (kind, ids) in touched {
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            for chunk in ids.chunks(bc_core::store::ROWS_GET_MAX) {
                let found = self.store.rows_get_raw(&tenant, kind, chunk).await.expect("rows read");
                let mut found: BTreeMap<String, String> = found.into_iter().map(|r| (r.key.id, r.doc)).collect();
                for id in chunk {
                    let doc = found.remove(*id);
                    if kind == KIND_NODE {
                        match doc {
                            Some(doc) => rows.nodes.insert((*id).to_owned(), serde_json::from_str(&doc).expect("a document")),
                            None => rows.nodes.remove(*id),
                        };
                    } else {
                        match doc {
                            Some(doc) => rows.live.insert((*id).to_owned(), serde_json::from_str(&doc).expect("a document")),
                            None => rows.live.remove(*id),
                        };
                    }
                }
            }
        }
        rows.head = head;
    }

    /// The rows the check after every step keeps ([`Self::checked_rows`]) against the store's,
    /// read whole: a finding if they differ (the check would have judged other rows than the
    /// store's). Each full check runs it.
    pub async fn check_checked_rows(&self) -> Result<(), Violation> {
        let cached: Vec<(usize, Arc<CheckedRows>)> =
            self.checked_rows.lock().expect("not poisoned").iter().map(|(t, rows)| (*t, rows.clone())).collect();
        for (t, rows) in cached {
            let read = self.checked_rows_read(t, rows.head).await;
            let head = self.store.heads().await.expect("the heads read");
            let now = head.iter().find(|(id, _)| *id == self.tenants[t].id).map_or(0, |(_, h)| h.seq);
            ensure!(
                now != rows.head || *rows == read,
                "the rows the step check keeps for tenant {} (at seq {}) differ from the store's",
                self.tenants[t].id,
                rows.head
            );
        }
        Ok(())
    }

    /// [`Self::check`] for tenant `t` alone: its reservations, its nodes and their agents (a
    /// node, its agent and its reservations are all one tenant's).
    pub async fn check_tenant(&self, t: usize) -> Result<(), Violation> {
        let rows = self.checked_rows(t).await;
        let live: Vec<&LiveReservation> = rows.live.values().collect();
        {
            let nodes: BTreeMap<&str, &NodeAllocations> = rows.nodes.iter().map(|(id, n)| (id.as_str(), n)).collect();
            let mut taken: BTreeMap<(String, u32), String> = BTreeMap::new();
            // Every active reservation's GPUs first, so a GPU given twice is named as such
            // rather than as the node's row giving it to the other one.
            for rsv in live.iter().filter(|r| r.state == ReservationState::Active) {
                let node = rsv.node_id.clone().unwrap_or_default();
                for gpu in &rsv.gpu_indexes {
                    if let Some(other) = taken.insert((node.clone(), *gpu), rsv.reservation_id.clone()) {
                        return Err(Violation(format!(
                            "double booking: GPU {gpu} of {node} is {other}'s and {}'s (both active)",
                            rsv.reservation_id
                        )));
                    }
                }
            }
            for rsv in live.iter().filter(|r| r.state == ReservationState::Active) {
                let node = rsv.node_id.clone().unwrap_or_default();
                for gpu in &rsv.gpu_indexes {
                    let doc = nodes.get(node.as_str()).ok_or_else(|| Violation(format!("{node} has no row")))?;
                    ensure!(
                        doc.allocations.get(gpu) == Some(&rsv.reservation_id),
                        "the allocations of {node} give GPU {gpu} to {:?}, not to {} which is active on it",
                        doc.allocations.get(gpu),
                        rsv.reservation_id
                    );
                }
            }
        }
        for agent in self.agents.iter().filter(|a| a.tenant == t) {
            let ledger = agent.ledger();
            let mut held: BTreeMap<&str, &str> = BTreeMap::new();
            for (rsv, hold) in &ledger.holds {
                for gpu in &hold.gpus {
                    if let Some(other) = held.insert(&gpu.uuid, rsv) {
                        return Err(Violation(format!(
                            "double hold: the agent of {} holds {} for {other} and {rsv}",
                            agent.node, gpu.uuid
                        )));
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
                    let history = self.history(agent.tenant, &rsv.reservation_id).await.join("\n  ");
                    return Err(Violation(format!(
                        "{} is bound to {bound:?}, but its node's agent holds {on_agent:?} for it; its history:\n  {history}",
                        rsv.reservation_id
                    )));
                }
                for gpu in &bound {
                    ensure!(
                        held.get(gpu) == Some(&rsv.reservation_id.as_str()),
                        "{gpu} is bound to {}, but the agent of {} holds it for {:?}",
                        rsv.reservation_id,
                        agent.node,
                        held.get(gpu)
                    );
                }
            }
        }
        Ok(())
    }

    /// Each node's journal in the log (`in_log`, from a read of the whole log) against its
    /// agent's journal: every entry the agent holds up to what the gateway acknowledged to it
    /// (`delivered`) is in the log; every journal entry in the log is one the agent wrote (the
    /// same seq, the same body), there once, in seq order. The log may be ahead of `delivered`
    /// (an acknowledgement lost on its way: the agent sends those entries again, and the log
    /// takes them once). `settled`: nothing is left undelivered either.
    pub async fn check_journals(&self, in_log: &BTreeMap<String, JournalInLog>, settled: bool) -> Result<(), Violation> {
        let none = JournalInLog::new();
        for agent in &self.agents {
            let node = &agent.node;
            let journal = agent.journal_entries().await;
            // Acknowledged entries are pruned past `ACKED_KEEP` (the newest stays): the journal
            // may begin past 1, and what it dropped must have been acknowledged.
            let first = journal.first().map_or(1, |e| e.seq);
            for (i, entry) in journal.iter().enumerate() {
                ensure!(
                    entry.seq == first + i as u64,
                    "the journal of {node} holds entry {} at place {}",
                    entry.seq,
                    first + i as u64
                );
            }
            ensure!(
                first <= agent.delivered + 1,
                "the journal of {node} begins at {first} but only {} entries were acknowledged (pruned unacknowledged)",
                agent.delivered
            );
            let written = journal.last().map_or(0, |e| e.seq);
            ensure!(
                agent.delivered <= written,
                "{node}'s agent was acknowledged {} entries but wrote {written}",
                agent.delivered
            );
            let logged = in_log.get(node).unwrap_or(&none);
            let mut times: BTreeMap<u64, u64> = BTreeMap::new();
            let mut previous = 0;
            for (seq, body) in logged {
                let count = times.entry(*seq).or_default();
                *count += 1;
                ensure!(*count == 1, "journal entry {seq} of {node} is in the log more than once (duplicated)");
                ensure!(*seq > previous, "journal entry {seq} of {node} is in the log after entry {previous} (out of order)");
                previous = *seq;
                if *seq < first {
                    // Pruned on the agent after its acknowledgement (checked above).
                    continue;
                }
                let Some(wrote) = seq.checked_sub(first).and_then(|i| journal.get(i as usize)) else {
                    return Err(Violation(format!(
                        "the log has journal entry {seq} of {node}, which its agent never wrote (it wrote {written})"
                    )));
                };
                ensure!(
                    bc_core::agent::b64(&wrote.body) == *body,
                    "the log's journal entry {seq} of {node} is not the one its agent wrote (the bodies differ)"
                );
            }
            if let Some(lost) = (1..=agent.delivered).find(|seq| !times.contains_key(seq)) {
                return Err(Violation(format!(
                    "journal entry {lost} of {node} was acknowledged to its agent but is not in the log (lost; the log has {} of its entries)",
                    logged.len()
                )));
            }
            ensure!(
                !settled || agent.delivered == written,
                "{} journal entries of {node} never reached the log",
                written - agent.delivered
            );
        }
        Ok(())
    }

    /// Settled: every active reservation is bound and every agent holds exactly the active
    /// reservations of its node (none leaked, none missing). `Err` says what is not yet, with
    /// the history of each reservation the agent and the control plane disagree on.
    pub async fn settled(&self) -> Result<(), Violation> {
        self.settled_explained(true).await
    }

    /// [`Self::settled`]; with `histories` false, without the reservations' histories: each
    /// reads the tenant's whole log, and `sim run`'s liveness phase asks at every pass while
    /// releases are in flight (the histories were a sixth of a 1,000-node run). It adds them
    /// once, to a failure.
    pub async fn settled_explained(&self, histories_asked: bool) -> Result<(), Violation> {
        let mut live_by_tenant = Vec::new();
        for t in 0..self.tenants.len() {
            let live: Vec<ReservationDoc> = self.rows(t, KIND_RESERVATION_LIVE).await;
            for rsv in live.iter().filter(|r| r.state == ReservationState::Active) {
                ensure!(
                    rsv.binding.as_ref().map(|b| b.state) == Some(BindingState::Bound),
                    "{} is active but its binding is {:?}",
                    rsv.reservation_id,
                    rsv.binding.as_ref().map(|b| b.state)
                );
            }
            live_by_tenant.push(live);
        }
        for agent in &self.agents {
            let expected: BTreeSet<&str> = live_by_tenant[agent.tenant]
                .iter()
                .filter(|r| r.state == ReservationState::Active && r.node_id.as_deref() == Some(agent.node.as_str()))
                .map(|r| r.reservation_id.as_str())
                .collect();
            let ledger = agent.ledger();
            let held: BTreeSet<&str> = ledger.holds.keys().map(String::as_str).collect();
            if held != expected {
                let mut histories = String::new();
                for rsv in held.symmetric_difference(&expected).filter(|_| histories_asked) {
                    let history = self.history(agent.tenant, rsv).await.join("\n  ");
                    histories.push_str(&format!("\nthe history of {rsv}:\n  {history}"));
                }
                return Err(Violation(format!(
                    "the agent of {} holds {held:?}, the control plane has {expected:?} active on it{histories}",
                    agent.node
                )));
            }
        }
        Ok(())
    }
}
