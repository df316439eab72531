//! The `metal` reconciler's scheduling: one tenant's BMCs that never answer hold
//! that tenant's share of turns and nothing else; another tenant's machine gets its BMC request
//! at once, and a tenant with more machines than its share has each of them in turn.
// Fixtures' ids only name things; the clock is the manual one.
#![allow(clippy::disallowed_methods)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bc_bmc::fake::FakeConnector;
use bc_bmc::{Bmc, BmcConnector, BmcResult, BmcTarget, BootSource, ResetType, SystemInfo};
use bc_core::clock::{Clock as _, ManualClock};
use bc_core::id::{NodeId, TenantId, WorkflowId};
use bc_core::store::{EventStore, Log};
use bc_projections::decide::{self, VerbInput};
use bc_projections::metal::Verb;
use bc_projections::workflow::{KIND_METAL, MetalDoc};
use bc_reconcilers::metal::{Metal, Scheduler, TENANT_TURNS_MAX};

/// A BMC that accepts the call and never answers: a tarpit. Counts the calls it holds.
struct Tarpit {
    held: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl Bmc for Tarpit {
    async fn system(&self) -> BmcResult<SystemInfo> {
        self.held.fetch_add(1, Ordering::SeqCst);
        std::future::pending().await
    }
    async fn reset(&self, _: ResetType) -> BmcResult<()> {
        std::future::pending().await
    }
    async fn set_boot_once(&self, _: BootSource) -> BmcResult<()> {
        std::future::pending().await
    }
    async fn insert_media(&self, _: &str) -> BmcResult<()> {
        std::future::pending().await
    }
    async fn eject_media(&self) -> BmcResult<()> {
        std::future::pending().await
    }
}

/// Tarpits at `https://tarpit-…`, fakes elsewhere.
struct Connector {
    fake: FakeConnector,
    held: Arc<AtomicUsize>,
}

impl BmcConnector for Connector {
    fn connect(&self, target: &BmcTarget) -> BmcResult<Arc<dyn Bmc>> {
        if target.address.host_str().is_some_and(|h| h.starts_with("tarpit-")) {
            Ok(Arc::new(Tarpit { held: self.held.clone() }))
        } else {
            self.fake.connect(target)
        }
    }
}

struct World {
    _dir: tempfile::TempDir,
    store: Arc<dyn EventStore>,
    log: Arc<Log>,
    clock: Arc<ManualClock>,
}

async fn world() -> World {
    let (dir, store, log, clock) = support::manual_log().await;
    World { _dir: dir, store, log, clock }
}

impl World {
    /// Enrolls a machine whose BMC is at `address` and asks to manage it: its first step is a
    /// BMC request.
    async fn managed_machine(&self, tenant: TenantId, address: &str) -> String {
        let node = NodeId::generate().to_string();
        support::enroll(&*self.store, &self.log, tenant, &node, format!("m-{node}"), address, "p").await;
        let doc = self.doc(tenant, &node).await;
        let wf = WorkflowId::generate().to_string();
        let input = VerbInput {
            now_ms: self.clock.now_ms(),
            workflow_id: &wf,
            image: None,
            join_token_id: None,
            power: None,
            if_version: None,
        };
        let append = decide::metal_verb(&doc, Verb::Manage, &input).unwrap();
        self.log.append(append.into_request(tenant, "test")).await.unwrap();
        node
    }

    async fn doc(&self, tenant: TenantId, node: &str) -> MetalDoc {
        let row = self.store.row_get(&tenant.to_string(), KIND_METAL, node).await.unwrap().unwrap();
        serde_json::from_value(row.doc).unwrap()
    }
}

/// 32 machines of tenant B behind BMCs that never answer, walked first; tenant A's
/// machine gets its first BMC request while they hang (a generous 2 s deadline on that event;
/// before, a pass waited for B's slowest, so A's request waited for B's timeouts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_tarpit_bmcs_delay_nothing_but_their_own_machines() {
    let w = world().await;
    let mut tenants = [TenantId::generate(), TenantId::generate()];
    tenants.sort_by_key(|t| t.to_string());
    // B sorts first: the tenant a walk in order would wait on.
    let [b, a] = tenants;
    for i in 0..32 {
        w.managed_machine(b, &format!("https://tarpit-{i}.example")).await;
    }
    w.managed_machine(a, "https://bmc-a.example").await;
    let fake = FakeConnector::default();
    let held = Arc::new(AtomicUsize::new(0));
    let connector = Arc::new(Connector { fake: fake.clone(), held: held.clone() });
    let metal = Arc::new(Metal::new(w.log.clone(), w.clock.clone(), connector));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let reconciler = tokio::spawn(bc_reconcilers::metal::run(metal, 1_000, stopped));

    let a_bmc = fake.machine("https://bmc-a.example");
    let first_request = tokio::time::timeout(Duration::from_secs(2), async {
        while a_bmc.with(|s| s.calls.is_empty()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(first_request.is_ok(), "tenant A's machine got no BMC request while B's BMCs hang");
    // B holds its share of turns, no more: the rest of its machines wait for a free slot.
    let deadline = tokio::time::timeout(Duration::from_secs(2), async {
        while held.load(Ordering::SeqCst) < TENANT_TURNS_MAX {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(deadline.is_ok(), "B's turns never started");
    assert_eq!(held.load(Ordering::SeqCst), TENANT_TURNS_MAX, "B holds more than its share");
    stop.send(true).unwrap();
    reconciler.await.unwrap();
}

/// A tenant with more machines than its share: the scheduler starts its share, and as turns
/// end, the machines not yet taken, from where the last start left off, across passes.
#[tokio::test]
async fn a_tenant_with_more_machines_than_its_share_has_each_in_turn() {
    let w = world().await;
    let tenant = TenantId::generate();
    let mut nodes = Vec::new();
    for i in 0..TENANT_TURNS_MAX + 4 {
        nodes.push(w.managed_machine(tenant, &format!("https://bmc-{i}.example")).await);
    }
    nodes.sort();
    let mut docs = Vec::new();
    for node in &nodes {
        docs.push(w.doc(tenant, node).await);
    }
    let all = || std::collections::BTreeMap::from([(tenant.to_string(), docs.clone())]);
    let mut scheduler = Scheduler::default();
    scheduler.read(all());
    let first: Vec<String> = scheduler.start().into_iter().map(|d| d.node_id).collect();
    assert_eq!(first, nodes[..TENANT_TURNS_MAX], "its share, in order");
    assert!(scheduler.start().is_empty(), "no more while its share runs");
    for node in &first {
        scheduler.finished(&tenant.to_string(), node);
    }
    // The next pass reads every machine again: the ones not yet taken come first.
    scheduler.read(all());
    let second: Vec<String> = scheduler.start().into_iter().map(|d| d.node_id).collect();
    assert_eq!(second[..4], nodes[TENANT_TURNS_MAX..], "the rest first: {second:?}");
    assert_eq!(second.len(), TENANT_TURNS_MAX);
}
