//! The `liveness` reconciler: turns node leases into events, and fails commands past their
//! deadline. Level-triggered, on a tick: every pass re-reads the world.
//!
//! **Leases.** A node's session renews its lease (`node_leases`, never an append) on every
//! heartbeat. Each pass asks the store for the leases whose state now differs from what was last
//! reported ([`LeaseStore::lease_changes`]), reads each node's document, and when the document's
//! `agent.reachable` disagrees with the lease appends `node.ready` or `node.unreachable` at the
//! document's version; then it records the report. A `CONFLICT` (the node moved meanwhile) is
//! left for the next pass, which reads it again. A process killed between the append and the
//! report appends nothing twice: the next pass finds the document already agreeing.
//!
//! **Deadlines.** Each pass also pages through every tenant's unfinished commands
//! (`command_live` rows): a command still `issued` past its deadline, or `started` past its
//! deadline plus [`COMMAND_REPORT_GRACE_MS`] (the node may be reporting a result it finished in
//! time), gets `command.failed` at the command's version, without a journal entry.

use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::id::TenantId;
use bc_core::store::lease::Lease;
use bc_core::store::{AppendRequest, ExpectedVersion, Log, NewEvent};
use bc_core::{Error, ErrorCode, Result};
use bc_projections::events as ev;
use bc_projections::{CommandDoc, CommandState, KIND_COMMAND, KIND_COMMAND_LIVE, KIND_NODE, NodeDoc, stream_of};

pub const NAME: &str = "liveness";
const ACTOR: &str = "reconciler:liveness";
/// How often a pass runs unless told otherwise: a lease lapse shows within about this much.
pub const TICK_MS_DEFAULT: u64 = 1000;
/// Leases looked at in one pass; a full batch runs the next pass at once.
pub const LEASES_PER_PASS_MAX: u32 = 500;
/// Unfinished commands read per page of the deadline sweep.
pub const COMMANDS_PAGE_MAX: u32 = 500;
/// A started command may report this long past its deadline before it is failed: a node that
/// finished in time may still be sending its result.
pub const COMMAND_REPORT_GRACE_MS: u64 = 60_000;
/// The reason a command failed by the sweep carries.
pub const DEADLINE_REASON: &str = "deadline passed before the node reported";

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub ready: usize,
    pub unreachable: usize,
    /// Commands failed at their deadline.
    pub expired: usize,
    /// Appends refused because another writer moved first; the next pass decides again.
    pub conflicts: usize,
    /// Whether the lease batch was full (more may be waiting).
    pub more: bool,
}

/// One pass: lease changes, then the deadline sweep, both at `clock`'s now.
pub async fn pass(log: &Log, clock: &dyn Clock) -> Result<Pass> {
    let mut done = Pass::default();
    let now_ms = clock.now_ms();
    let leases = log.store.lease_changes(now_ms, LEASES_PER_PASS_MAX).await?;
    done.more = leases.len() as u32 >= LEASES_PER_PASS_MAX;
    for lease in &leases {
        lease_pass(log, lease, now_ms, &mut done).await?;
    }
    for (tenant, _) in log.store.heads().await? {
        sweep_commands(log, tenant, now_ms, &mut done).await?;
    }
    Ok(done)
}

async fn lease_pass(log: &Log, lease: &Lease, now_ms: u64, done: &mut Pass) -> Result<()> {
    let desired = lease.held_at(now_ms);
    let tenant: TenantId = lease.tenant.parse()?;
    let Some(row) = log.store.row_get(&lease.tenant, KIND_NODE, &lease.node).await? else {
        // A lease of a node the log does not know (renewed, then the row went): nothing to say
        // of it; record it so the pass does not look at it again.
        tracing::warn!(reconciler = NAME, tenant = %lease.tenant, node = %lease.node, "a lease names no node");
        return log.store.lease_reported(&lease.tenant, &lease.node, desired).await;
    };
    let doc: NodeDoc =
        serde_json::from_value(row.doc).map_err(|e| Error::Internal(format!("node {} document: {e}", lease.node)))?;
    let Some(agent) = doc.agent.as_ref() else {
        tracing::warn!(reconciler = NAME, tenant = %lease.tenant, node = %lease.node, "a lease names a node without an agent");
        return log.store.lease_reported(&lease.tenant, &lease.node, desired).await;
    };
    if agent.reachable != desired {
        let event_type = if desired { ev::NODE_READY } else { ev::NODE_UNREACHABLE };
        let payload = ev::to_cbor(&ev::NodeLiveness { lease_expires_at_ms: lease.expires_at_ms })?;
        let request = AppendRequest::new(
            tenant,
            stream_of(KIND_NODE, &lease.node),
            ExpectedVersion::Exact(doc.version),
            ACTOR,
            vec![NewEvent::new(event_type, payload)],
        );
        match log.append(request).await {
            Ok(_) if desired => done.ready += 1,
            Ok(_) => done.unreachable += 1,
            Err(e) if e.code() == ErrorCode::Conflict => {
                done.conflicts += 1;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
    log.store.lease_reported(&lease.tenant, &lease.node, desired).await
}

/// Whether the sweep fails `command` at `now_ms`. A `gpu.release` never is: the node may hold
/// the GPUs, so it stays queued for the node until the node answers (the node runs it whatever
/// its deadline).
pub fn past_deadline(command: &CommandDoc, now_ms: u64) -> bool {
    if command.kind == bc_projections::placement::GPU_RELEASE {
        return false;
    }
    match command.state {
        CommandState::Issued => now_ms > command.deadline_at_ms,
        CommandState::Started => now_ms > command.deadline_at_ms.saturating_add(COMMAND_REPORT_GRACE_MS),
        _ => false,
    }
}

async fn sweep_commands(log: &Log, tenant: TenantId, now_ms: u64, done: &mut Pass) -> Result<()> {
    let tenant_text = tenant.to_string();
    let mut after: Option<String> = None;
    loop {
        let rows = log.store.row_list(&tenant_text, KIND_COMMAND_LIVE, after.as_deref(), COMMANDS_PAGE_MAX).await?;
        let full = rows.len() as u32 >= COMMANDS_PAGE_MAX;
        after = rows.last().map(|r| r.key.id.clone());
        for row in rows {
            let command: CommandDoc =
                serde_json::from_value(row.doc).map_err(|e| Error::Internal(format!("command {} document: {e}", row.key.id)))?;
            if !past_deadline(&command, now_ms) {
                continue;
            }
            let payload = ev::to_cbor(&ev::CommandProgress {
                command_id: command.command_id.clone(),
                node_id: command.node_id.clone(),
                result: None,
                reason: Some(DEADLINE_REASON.into()),
                journal: None,
            })?;
            let request = AppendRequest::new(
                tenant,
                stream_of(KIND_COMMAND, &command.command_id),
                ExpectedVersion::Exact(command.version),
                ACTOR,
                vec![NewEvent::new(ev::COMMAND_FAILED, payload)],
            );
            match log.append(request).await {
                Ok(_) => done.expired += 1,
                Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                Err(e) => return Err(e),
            }
        }
        if !full {
            return Ok(());
        }
    }
}

impl crate::driver::PassReport for Pass {
    fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("ready", self.ready as u64),
            ("unreachable", self.unreachable as u64),
            ("expired", self.expired as u64),
            ("conflicts", self.conflicts as u64),
        ]
    }

    fn again(&self) -> bool {
        self.more || self.conflicts > 0
    }

    fn log(&self, name: &'static str) {
        if self.ready + self.unreachable + self.expired + self.conflicts > 0 {
            tracing::info!(
                reconciler = name,
                ready = self.ready,
                unreachable = self.unreachable,
                expired = self.expired,
                conflicts = self.conflicts,
                "pass"
            );
        }
    }
}

/// The reconciler: [`pass`] every [`TICK_MS_DEFAULT`] ([`crate::registry`]); a pass that left
/// work (a full lease batch, a conflict) is followed by the next soon.
pub fn reconciler(log: Arc<Log>, clock: Arc<dyn Clock>) -> crate::driver::LogPasses<Pass> {
    crate::driver::LogPasses { name: NAME, log, clock, pass: |log, clock| Box::pin(pass(log, clock)) }
}

#[cfg(test)]
// Tests, outside the simulator: fresh random ids and the real clock (clippy.toml).
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::sync::Arc;

    use bc_core::clock::{Clock, ManualClock};
    use bc_core::id::{CommandId, NodeId, PoolId, TenantId};
    use bc_core::keys::LogKey;
    use bc_core::store::sqlite::SqliteStore;
    use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
    use bc_projections::events as ev;
    use bc_projections::{CommandDoc, CommandState, KIND_COMMAND, KIND_NODE, NodeDoc, NodeState, Projections, stream_of};

    use super::{COMMAND_REPORT_GRACE_MS, DEADLINE_REASON, Pass, pass};

    struct World {
        _dir: tempfile::TempDir,
        store: Arc<dyn EventStore>,
        log: Log,
        clock: Arc<ManualClock>,
        tenant: TenantId,
        node: String,
    }

    /// A store, a log on a manual clock, and one node that joined (unreachable until a lease).
    async fn world() -> World {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("s.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        let log = Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), clock.clone()).await.unwrap();
        let tenant = TenantId::generate();
        let node = NodeId::generate().to_string();
        let joined = ev::NodeJoined {
            pool_id: PoolId::generate().to_string(),
            name: "n1".into(),
            gpus: vec![],
            labels: Default::default(),
            public_key: "AAAA".into(),
            join_token_id: "jt_test".into(),
            agent_version: "0.1.0".into(),
            hostname: "n1.example".into(),
            gpu_uuids: vec![],
            tpm: None,
        };
        let event = NewEvent::new(ev::NODE_JOINED, ev::to_cbor(&joined).unwrap());
        log.append(AppendRequest::new(tenant, stream_of(KIND_NODE, &node), ExpectedVersion::NoStream, "test", vec![event]))
            .await
            .unwrap();
        World { _dir: dir, store, log, clock, tenant, node }
    }

    impl World {
        async fn node(&self) -> NodeDoc {
            let row = self.store.row_get(&self.tenant.to_string(), KIND_NODE, &self.node).await.unwrap().unwrap();
            serde_json::from_value(row.doc).unwrap()
        }

        async fn command(&self, id: &str) -> CommandDoc {
            let row = self.store.row_get(&self.tenant.to_string(), KIND_COMMAND, id).await.unwrap().unwrap();
            serde_json::from_value(row.doc).unwrap()
        }

        async fn issue(&self, deadline_in_ms: u64) -> String {
            self.issue_kind("ping", deadline_in_ms).await
        }

        async fn issue_kind(&self, kind: &str, deadline_in_ms: u64) -> String {
            let id = CommandId::generate().to_string();
            let issued = ev::CommandIssued {
                node_id: self.node.clone(),
                kind: kind.into(),
                args: serde_json::json!({}),
                deadline_at_ms: self.clock.now_ms() + deadline_in_ms,
                release: None,
            };
            let event = NewEvent::new(ev::COMMAND_ISSUED, ev::to_cbor(&issued).unwrap());
            let stream = stream_of(KIND_COMMAND, &id);
            self.log
                .append(AppendRequest::new(self.tenant, stream, ExpectedVersion::NoStream, "test", vec![event]))
                .await
                .unwrap();
            id
        }

        async fn renew(&self, for_ms: u64) {
            let until = self.clock.now_ms() + for_ms;
            self.store.lease_renew(&[(self.tenant.to_string(), self.node.clone(), until)]).await.unwrap();
        }
    }

    #[tokio::test]
    async fn a_lease_held_makes_the_node_ready_and_a_lapse_unreachable_and_back() {
        let w = world().await;
        assert_eq!(w.node().await.state, NodeState::Unreachable, "joined, never connected");
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass::default(), "no lease: nothing to say");

        w.renew(15_000).await;
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass { ready: 1, ..Pass::default() });
        let node = w.node().await;
        assert_eq!(node.state, NodeState::Ready);
        let agent = node.agent.unwrap();
        assert!(agent.reachable);
        assert_eq!(agent.lease_expires_at_ms, w.clock.now_ms() + 15_000);
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass::default(), "reported: no second event");

        // Renewals within the lease append nothing.
        w.clock.advance_ms(5_000);
        w.renew(15_000).await;
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass::default());

        // The lease lapses: unreachable, once.
        w.clock.advance_ms(15_001);
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass { unreachable: 1, ..Pass::default() });
        assert_eq!(w.node().await.state, NodeState::Unreachable);
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass::default());

        // Back: ready again.
        w.renew(15_000).await;
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass { ready: 1, ..Pass::default() });
        assert_eq!(w.node().await.state, NodeState::Ready);
        let lease = w.store.lease_get(&w.tenant.to_string(), &w.node).await.unwrap().unwrap();
        assert!(lease.reported_reachable);
    }

    /// A pass that appended but died before recording the report appends nothing twice: the
    /// document already agrees, so the next pass only records it.
    #[tokio::test]
    async fn a_lost_report_appends_nothing_twice() {
        let w = world().await;
        w.renew(15_000).await;
        pass(&w.log, &*w.clock).await.unwrap();
        let version = w.node().await.version;
        // Forget the report, as a crash between the append and the report would.
        w.store.lease_reported(&w.tenant.to_string(), &w.node, false).await.unwrap();
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass::default());
        assert_eq!(w.node().await.version, version);
        assert!(w.store.lease_changes(w.clock.now_ms(), 10).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_command_past_its_deadline_fails_and_a_started_one_gets_the_grace() {
        let w = world().await;
        let late = w.issue(10_000).await;
        let running = w.issue(10_000).await;
        let fresh = w.issue(600_000).await;
        // A release is never given up: the node may hold the GPUs.
        let release = w.issue_kind(bc_projections::placement::GPU_RELEASE, 10_000).await;
        // `running` started on the node.
        let started = ev::CommandProgress {
            command_id: running.clone(),
            node_id: w.node.clone(),
            result: None,
            reason: None,
            journal: None,
        };
        let event = NewEvent::new(ev::COMMAND_STARTED, ev::to_cbor(&started).unwrap());
        let stream = stream_of(KIND_COMMAND, &running);
        w.log.append(AppendRequest::new(w.tenant, stream, ExpectedVersion::Exact(1), "test", vec![event])).await.unwrap();

        assert_eq!(pass(&w.log, &*w.clock).await.unwrap().expired, 0, "nothing is late yet");
        w.clock.advance_ms(10_001);
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass { expired: 1, ..Pass::default() });
        let failed = w.command(&late).await;
        assert_eq!(failed.state, CommandState::Failed);
        assert_eq!(failed.reason.as_deref(), Some(DEADLINE_REASON));
        assert_eq!(w.command(&running).await.state, CommandState::Started, "a started one has the grace");
        assert_eq!(w.command(&fresh).await.state, CommandState::Issued);
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass::default(), "failed once");

        w.clock.advance_ms(COMMAND_REPORT_GRACE_MS);
        assert_eq!(pass(&w.log, &*w.clock).await.unwrap(), Pass { expired: 1, ..Pass::default() });
        assert_eq!(w.command(&running).await.state, CommandState::Failed);
        assert_eq!(w.command(&fresh).await.state, CommandState::Issued);
        assert_eq!(w.command(&release).await.state, CommandState::Issued, "a release waits for its node");
    }
}
