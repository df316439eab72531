//! `Log::answered` moves to a commit once every answer the commit gave has
//! been let go by its caller, and never back. The watch tail waits on it so that a write is
//! answered before its event is fanned out to the watchers.

// A test, outside the simulator: fresh random ids and the real clock (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;

use bc_core::clock::SystemClock;
use bc_core::event::StoredEvent;
use bc_core::id::TenantId;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, AppendResult, EventStore, ExpectedVersion, Log, NewEvent, Projector, RowKey};
use serde_json::Value;

/// Projects nothing: the receipts are what is under test.
struct NoRows;

impl Projector for NoRows {
    fn touches(&self, _: &StoredEvent, _: &mut Vec<RowKey>) {}

    fn apply(&self, _: &RowKey, doc: Option<Value>, _: &StoredEvent) -> bc_core::Result<Option<Value>> {
        Ok(doc)
    }
}

fn request(tenant: TenantId, stream: &str) -> AppendRequest {
    AppendRequest::new(tenant, stream, ExpectedVersion::Any, "test", vec![NewEvent::new("test.made", ciborium::Value::Null)])
}

fn commit_of(result: &AppendResult) -> u64 {
    result.events[0].position.commit
}

#[tokio::test]
async fn answered_moves_to_a_commit_once_its_answers_are_let_go_and_never_back() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let log = Log::open(store, Arc::new(NoRows), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap();
    let (commits, answered) = (log.subscribe(), log.answered());
    let tenant = TenantId::generate();

    // Two requests queued together are one commit: it is answered when both answers are gone.
    let (a, b) = tokio::join!(log.append(request(tenant, "s/a")), log.append(request(tenant, "s/b")));
    let (a, b) = (a.unwrap(), b.unwrap());
    let first = commit_of(&a);
    assert_eq!(commit_of(&b), first, "one batch");
    assert_eq!(*commits.borrow(), first, "the commit itself is announced at once");
    assert!(*answered.borrow() < first, "both answers are still held");
    let kept = b.clone();
    drop(a);
    drop(b);
    assert!(*answered.borrow() < first, "a clone of an answer holds it too");
    drop(kept);
    assert_eq!(*answered.borrow(), first);

    // A later commit let go first moves it on; the older one let go after does not move it back.
    let older = log.append(request(tenant, "s/c")).await.unwrap();
    let newer = log.append(request(tenant, "s/d")).await.unwrap();
    assert!(commit_of(&newer) > commit_of(&older));
    drop(newer);
    let latest = *answered.borrow();
    assert_eq!(latest, *commits.borrow());
    drop(older);
    assert_eq!(*answered.borrow(), latest, "never back");
}
