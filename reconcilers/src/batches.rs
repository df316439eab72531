//! The `batches` reconciler: ends every pending command batch whose approval window has closed
//! (`command_batch.expired`; its commands were never issued, and now never will be), and issues
//! the chunks a released batch still has to issue (`command_batch.chunk_issued` with its
//! commands, one append group a chunk: what the approval that released it left, after a crash
//! or a node's full queue). Level-triggered: every pass re-reads each tenant's live batches
//! (`command_batch_live`: pending, or released with chunks to go) and appends at the batch's
//! version, so whatever lands first wins and the rest is decided again next pass (a CONFLICT).
//! The decisions are [`bc_projections::decide::batch::batch_expired`] and
//! [`bc_projections::decide::batch::release_chunk`].

use std::sync::Arc;

use bc_core::clock::Clock;
use bc_core::store::{AppendRequest, ExpectedVersion, Log, NewEvent};
use bc_core::{ErrorCode, Result};
use bc_projections::batch::{
    CommandBatchDoc, KIND_COMMAND_BATCH, KIND_COMMAND_BATCH_LIVE, approver_set_history, chunk_requests, node_without_room,
};
use bc_projections::decide::batch::{batch_expired, release_chunk};
use bc_projections::events as ev;
use bc_projections::placement::all_rows;
use bc_projections::stream_of;

pub const NAME: &str = "batches";
const ACTOR: &str = "reconciler:batches";
/// How often a pass runs.
pub const TICK_MS_DEFAULT: u64 = 5_000;

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Batches ended as expired.
    pub expired: usize,
    /// Chunks of released batches issued.
    pub chunks: usize,
    pub conflicts: usize,
}

/// One pass over every tenant's pending batches.
pub async fn pass(log: &Log, clock: &dyn Clock) -> Result<Pass> {
    let mut done = Pass::default();
    for tenant in log.store.tenants().await? {
        let live = all_rows::<CommandBatchDoc>(&*log.store, tenant, KIND_COMMAND_BATCH_LIVE).await?;
        for batch in live {
            if batch.releasing() {
                let id = batch.batch_id.clone();
                if let Err(e) = issue_chunks(log, clock, tenant, batch, &mut done).await {
                    tracing::warn!(reconciler = NAME, batch = %id, code = %e.code(), error = %e, "chunks not issued");
                }
                continue;
            }
            if !batch_expired(&batch, clock.now_ms()) {
                continue;
            }
            let payload =
                ev::to_cbor(&ev::CommandBatchEnded { reason: format!("its window closed at {} ms", batch.expires_at_ms) })?;
            let request = AppendRequest::new(
                tenant,
                stream_of(KIND_COMMAND_BATCH, &batch.batch_id),
                ExpectedVersion::Exact(batch.version),
                ACTOR,
                vec![NewEvent::new(ev::COMMAND_BATCH_EXPIRED, payload)],
            );
            match log.append(request).await {
                Ok(_) => {
                    done.expired += 1;
                    tracing::info!(reconciler = NAME, batch = %batch.batch_id, "expired: its commands are never issued");
                }
                Err(e) if e.code() == ErrorCode::Conflict => done.conflicts += 1,
                Err(e) => {
                    tracing::warn!(reconciler = NAME, batch = %batch.batch_id, code = %e.code(), error = %e, "append failed");
                }
            }
        }
    }
    Ok(done)
}

/// Issues a released batch's chunks in turn until none is left or one cannot be issued now (a
/// node without room in its queue, a conflict: the next pass tries again).
async fn issue_chunks(
    log: &Log,
    clock: &dyn Clock,
    tenant: bc_core::id::TenantId,
    mut batch: CommandBatchDoc,
    done: &mut Pass,
) -> Result<()> {
    let history = approver_set_history(&*log.store).await?;
    while let Some(chunk) = release_chunk(&batch, &history, clock.now_ms())? {
        let subjects: Vec<&str> = chunk.commands.iter().map(|(_, c)| c.node_id.as_str()).collect();
        if let Some(node) = node_without_room(&*log.store, &tenant.to_string(), &subjects).await? {
            tracing::info!(reconciler = NAME, batch = %batch.batch_id, node = %node, "a chunk waits for room in a node's queue");
            return Ok(());
        }
        let chunk_number = chunk.issued.chunk;
        let requests = chunk_requests(&*log.store, &batch, chunk, ACTOR, None, clock.now_ms()).await?;
        match log.append_group(requests).await {
            Ok(_) => {
                done.chunks += 1;
                tracing::info!(reconciler = NAME, batch = %batch.batch_id, chunk = chunk_number, "chunk issued");
            }
            Err(e) if e.code() == ErrorCode::Conflict => {
                done.conflicts += 1;
                return Ok(());
            }
            Err(e) => {
                tracing::warn!(reconciler = NAME, batch = %batch.batch_id, code = %e.code(), error = %e, "chunk not issued");
                return Ok(());
            }
        }
        let Some(row) = log.store.row_get(&tenant.to_string(), KIND_COMMAND_BATCH, &batch.batch_id).await? else { return Ok(()) };
        batch = serde_json::from_value(row.doc).map_err(|e| bc_core::Error::Internal(format!("batch row: {e}")))?;
    }
    Ok(())
}

impl crate::driver::PassReport for Pass {
    fn counts(&self) -> Vec<(&'static str, u64)> {
        vec![("expired", self.expired as u64), ("chunks", self.chunks as u64), ("conflicts", self.conflicts as u64)]
    }

    fn again(&self) -> bool {
        self.conflicts > 0
    }
}

/// The reconciler: [`pass`] every [`TICK_MS_DEFAULT`] ([`crate::registry`]).
pub fn reconciler(log: Arc<Log>, clock: Arc<dyn Clock>) -> crate::driver::LogPasses<Pass> {
    crate::driver::LogPasses { name: NAME, log, clock, pass: |log, clock| Box::pin(pass(log, clock)) }
}

#[cfg(test)]
// Tests, outside the simulator: fresh random ids (clippy.toml).
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::sync::Arc;

    use bc_core::clock::ManualClock;
    use bc_core::id::{CommandBatchId, TenantId};
    use bc_core::keys::LogKey;
    use bc_core::store::sqlite::SqliteStore;
    use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, NewEvent};
    use bc_projections::batch::{
        BatchState, CommandBatchCreated, CommandBatchDoc, KIND_COMMAND_BATCH, KIND_COMMAND_BATCH_LIVE, Leaf,
    };
    use bc_projections::events as ev;
    use bc_projections::{Projections, stream_of};

    use super::{Pass, pass};

    /// A pending batch is left alone inside its window and expired once it closed; its live row
    /// goes with it, and the next pass has nothing to do. A released batch is never expired.
    #[tokio::test]
    async fn a_closed_window_expires_the_batch_once() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn EventStore> = Arc::new(SqliteStore::open(&dir.path().join("s.sqlite3")).await.unwrap());
        store.migrate().await.unwrap();
        let clock = Arc::new(ManualClock::new(1_800_000_000_000));
        let log = Log::open(store.clone(), Arc::new(Projections), Arc::new(LogKey::generate()), clock.clone()).await.unwrap();
        let tenant = TenantId::generate();
        let make = |expires_at_ms: u64| CommandBatchCreated {
            reason: "r".into(),
            leaves: vec![Leaf { subject: "node_x".into(), kind: "ping".into(), payload: serde_json::json!({}) }],
            root: "00".repeat(32),
            size: 1,
            expires_at_ms,
            trust_domain: "compute.test".into(),
            epoch: 1,
            quorum: 1,
            command_ids: vec!["cmd_x".into()],
            deadline_s: 300,
        };
        let (open, released) = (CommandBatchId::generate().to_string(), CommandBatchId::generate().to_string());
        for (id, extra) in [(&open, vec![]), (&released, vec![ev::COMMAND_BATCH_RELEASED])] {
            let mut events = vec![NewEvent::new(ev::COMMAND_BATCH_CREATED, ev::to_cbor(&make(1_800_000_060_000)).unwrap())];
            for t in extra {
                events.push(NewEvent::new(t, ev::to_cbor(&ev::CommandBatchReleased { approvals: vec!["ak_0".into()] }).unwrap()));
            }
            let request =
                AppendRequest::new(tenant, stream_of(KIND_COMMAND_BATCH, id), ExpectedVersion::NoStream, "test", events);
            log.append(request).await.unwrap();
        }
        let live = |id: String| {
            let store = store.clone();
            async move { store.row_get(&tenant.to_string(), KIND_COMMAND_BATCH_LIVE, &id).await.unwrap().is_some() }
        };
        assert!(live(open.clone()).await && live(released.clone()).await, "pending, or released with its chunk to go");
        assert_eq!(pass(&log, &*clock).await.unwrap(), Pass::default(), "inside its window");
        clock.advance_ms(60_000);
        assert_eq!(pass(&log, &*clock).await.unwrap(), Pass { expired: 1, ..Pass::default() });
        let row = store.row_get(&tenant.to_string(), KIND_COMMAND_BATCH, &open).await.unwrap().unwrap();
        let doc: CommandBatchDoc = serde_json::from_value(row.doc).unwrap();
        assert_eq!(doc.state, BatchState::Expired, "{doc:?}");
        assert!(!live(open).await, "an expired batch leaves the live rows");
        assert_eq!(pass(&log, &*clock).await.unwrap(), Pass::default(), "expired once");
    }
}
