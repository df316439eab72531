//! The disk bound of a node's volumes holds under concurrency: two `sandboxVolumes.create`
//! decisions that read the node before either landed (two requests, two gateways) each fit
//! alone but not together; the append of each writes `node.volumes_promised` on the node's
//! stream at the version it read, so the second is a `CONFLICT`, and decided again from what
//! the log now holds it is `QUOTA_EXCEEDED`. The negative control: the same two appends without
//! the node's event both land, and the node promises more than its disk.

// A test, outside the simulator: fresh random ids, the real clock (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;

use bc_core::ErrorCode;
use bc_core::clock::SystemClock;
use bc_core::id::{CommandId, NodeId, PoolId, SandboxVolumeId, TenantId};
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
use bc_projections::decide::sandbox_volume::{self as decide, NODE_VOLUMES_PROMISED, SandboxVolumeInput};
use bc_projections::events::{self as ev};
use bc_projections::placement::Issue;
use bc_projections::sandbox_volume::{KIND_SANDBOX_VOLUME_LIVE, SandboxVolumeDoc};
use bc_projections::{KIND_NODE, KIND_POOL, NodeDoc, PoolDoc, Projections, stream_of};

const DISK_GIB: u64 = 10;
const EACH_GIB: u64 = 6;

struct World {
    _dir: tempfile::TempDir,
    store: Arc<dyn EventStore>,
    log: Log,
    tenant: TenantId,
    pool: String,
}

impl World {
    async fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = SqliteStore::open(&dir.path().join("race.sqlite3")).await.unwrap();
        sqlite.migrate().await.unwrap();
        let store: Arc<dyn EventStore> = Arc::new(sqlite);
        let log =
            Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap();
        let (tenant, pool) = (TenantId::generate(), PoolId::generate().to_string());
        // From JSON: the fields a pool may have beyond these are optional.
        let created: ev::PoolCreated =
            serde_json::from_value(serde_json::json!({ "name": "p", "description": "", "labels": {} })).unwrap();
        log.append(AppendRequest::new(
            tenant,
            stream_of(KIND_POOL, &pool),
            ExpectedVersion::NoStream,
            "test",
            vec![NewEvent::new(ev::POOL_CREATED, ev::to_cbor(&created).unwrap())],
        ))
        .await
        .unwrap();
        World { _dir: dir, store, log, tenant, pool }
    }

    /// A node of the pool (registered; its row's version is what a decision reads), with an
    /// agent that runs sandboxes, makes volumes and reports a file system of [`DISK_GIB`].
    async fn node(&self) -> String {
        let node = NodeId::generate().to_string();
        let registered: ev::NodeRegistered =
            serde_json::from_value(serde_json::json!({ "poolId": self.pool, "name": "n", "gpus": [], "labels": {} })).unwrap();
        self.log
            .append(AppendRequest::new(
                self.tenant,
                stream_of(KIND_NODE, &node),
                ExpectedVersion::NoStream,
                "test",
                vec![NewEvent::new(ev::NODE_REGISTERED, ev::to_cbor(&registered).unwrap())],
            ))
            .await
            .unwrap();
        node
    }

    async fn node_doc(&self, node: &str) -> NodeDoc {
        let row = self.store.row_get(&self.tenant.to_string(), KIND_NODE, node).await.unwrap().unwrap();
        let mut doc = row.doc;
        doc["agent"] = serde_json::json!({
            "publicKey": "", "agentVersion": "0", "hostname": "n", "joinTokenId": "", "joinedAtMs": 0,
            "reachable": true, "leaseExpiresAtMs": 0, "journalSeq": 0, "journalHash": "",
            "inventory": {
                "nodeId": node, "gpus": [], "host": { "cpus": 1, "memoryKiB": 1, "disks": [] },
                "capabilities": ["sandbox.gvisor", "sandbox-volume.ext4"], "volumeFileSystemBytes": DISK_GIB << 30
            }
        });
        serde_json::from_value(doc).unwrap()
    }

    async fn pool_doc(&self) -> PoolDoc {
        serde_json::from_value(self.store.row_get(&self.tenant.to_string(), KIND_POOL, &self.pool).await.unwrap().unwrap().doc)
            .unwrap()
    }

    async fn live(&self) -> Vec<SandboxVolumeDoc> {
        let rows = self.store.row_list(&self.tenant.to_string(), KIND_SANDBOX_VOLUME_LIVE, None, 100).await.unwrap();
        rows.into_iter().map(|r| serde_json::from_value(r.doc).unwrap()).collect()
    }

    /// A create of [`EACH_GIB`] on `node` as decided from `node` and `live` (what was read).
    fn create(&self, name: &str, pool: &PoolDoc, node: &NodeDoc, live: &[SandboxVolumeDoc]) -> AppendRequest {
        let (volume_id, command_id) = (SandboxVolumeId::generate().to_string(), CommandId::generate().to_string());
        let chosen = decide::volume_node(std::slice::from_ref(node), &self.pool, &Default::default(), live, EACH_GIB).unwrap();
        let input = SandboxVolumeInput { volume_id: &volume_id, name, pool, node: chosen, size_gib: EACH_GIB, live };
        decide::sandbox_volume_create(&input, Issue { command_id: &command_id, now_ms: 1 })
            .unwrap()
            .into_request(self.tenant, "test")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_volume_creates_racing_for_one_node_s_disk_cannot_both_land() {
    let world = World::new().await;
    let node = world.node().await;
    let (pool, read_node, read_live) = (world.pool_doc().await, world.node_doc(&node).await, world.live().await);
    // Both read the node before either landed: each fits alone (6 of 10 GiB).
    let first = world.create("a", &pool, &read_node, &read_live);
    let second = world.create("b", &pool, &read_node, &read_live);
    assert!(first.events.iter().any(|e| e.event_type == NODE_VOLUMES_PROMISED));
    world.log.append(first).await.unwrap();
    let err = world.log.append(second).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict, "the second lands on a node that moved: {err}");
    // Decided again from what the log holds now: the disk is taken.
    let (node_now, live_now) = (world.node_doc(&node).await, world.live().await);
    assert_eq!(node_now.version, read_node.version + 1, "the promise moved the node's version");
    assert_eq!(decide::node_volumes_gib(&live_now, &node), EACH_GIB);
    let err =
        decide::volume_node(std::slice::from_ref(&node_now), &world.pool, &Default::default(), &live_now, EACH_GIB).unwrap_err();
    assert_eq!(err.code(), ErrorCode::QuotaExceeded, "{err}");

    // The negative control: the same race with the node's event and guard taken out (the
    // decision before it was guarded) lands twice, and the node promises 12 GiB of 10.
    let other = world.node().await;
    let (pool, read_node, read_live) = (world.pool_doc().await, world.node_doc(&other).await, world.live().await);
    let unguarded = |mut request: AppendRequest| {
        let stream = stream_of(KIND_NODE, &other);
        request.events.retain(|e| e.stream.as_deref() != Some(stream.as_str()));
        request.guards.retain(|(g, _)| *g != stream);
        request
    };
    let first = unguarded(world.create("c", &pool, &read_node, &read_live));
    let second = unguarded(world.create("d", &pool, &read_node, &read_live));
    world.log.append(first).await.unwrap();
    world.log.append(second).await.unwrap();
    assert_eq!(decide::node_volumes_gib(&world.live().await, &other), 2 * EACH_GIB, "past the node's {DISK_GIB} GiB");
}

/// A session through a node's agent (`tunnel.opened`, `.closed` on the node's stream) moves the
/// node's version with its stream: a decision that reads the node after it and guards on the
/// version it read lands. Before, the document stayed behind and every guarded decision on
/// that node (this resize, placement, liveness, deletes) was refused `CONFLICT` for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_on_a_node_moves_the_version_its_decisions_guard() {
    use bc_projections::tunnel::{TUNNEL_CLOSED, TUNNEL_OPENED};
    let world = World::new().await;
    let node = world.node().await;
    for event_type in [TUNNEL_OPENED, TUNNEL_CLOSED] {
        // The payloads as the gateway writes them do not matter to the node's row.
        let payload = ev::to_cbor(&serde_json::json!({ "tunnelId": "tun_1" })).unwrap();
        let request = AppendRequest::new(
            world.tenant,
            stream_of(KIND_NODE, &node),
            ExpectedVersion::Any,
            "test",
            vec![NewEvent::new(event_type, payload)],
        );
        world.log.append(request).await.unwrap();
    }
    let read = world.node_doc(&node).await;
    assert_eq!(read.version, 3, "registered, then a tunnel opened and closed");
    let (pool, live) = (world.pool_doc().await, world.live().await);
    world.log.append(world.create("a", &pool, &read, &live)).await.expect("guarded on the version read, it lands");
}
