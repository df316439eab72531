//! Regression: a request whose projection fold fails inside the commit
//! failed its whole batch (`fail_all`), other tenants' requests included. Now it is refused
//! alone and the rest of its batch commits.

// A test, outside the simulator: fresh random ids, the real clock and timings (clippy.toml).
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;

use bc_core::clock::SystemClock;
use bc_core::event::StoredEvent;
use bc_core::id::TenantId;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{AppendRequest, EventStore, ExpectedVersion, Log, LogStore, NewEvent, Projector, RowKey, RowStore};
use serde_json::{Value, json};

const REFUSED: &str = "test.refused";

/// One row per stream; refuses to fold `test.refused`.
struct RefusingProjector;

impl Projector for RefusingProjector {
    fn touches(&self, event: &StoredEvent, out: &mut Vec<RowKey>) {
        let env = &event.envelope;
        out.push(RowKey { tenant: env.tenant.to_string(), kind: "test".into(), id: env.stream.clone() });
    }

    fn apply(&self, _: &RowKey, _: Option<Value>, event: &StoredEvent) -> bc_core::Result<Option<Value>> {
        if event.envelope.event_type == REFUSED {
            return Err(bc_core::Error::Internal("the fold refuses this event".into()));
        }
        Ok(Some(json!({ "version": event.envelope.version })))
    }
}

fn request(tenant: TenantId, stream: &str, event_type: &str) -> AppendRequest {
    AppendRequest::new(
        tenant,
        stream,
        ExpectedVersion::Any,
        "test",
        vec![NewEvent::new(event_type, ciborium::Value::Integer(1.into()))],
    )
}

#[tokio::test]
async fn a_request_whose_fold_fails_is_refused_alone_and_its_batch_commits() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let log =
        Log::open(store.clone(), Arc::new(RefusingProjector), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap();
    let tenants: Vec<TenantId> = (0..4).map(|_| TenantId::generate()).collect();
    // On this single-threaded runtime every request is queued before the appender runs, so
    // they are one batch.
    let mut requests = Vec::new();
    for i in 0..12 {
        let event_type = if i == 5 { REFUSED } else { "test.made" };
        requests.push(request(tenants[i % 4], &format!("s/{i}"), event_type));
    }
    let results = futures::future::join_all(requests.into_iter().map(|r| log.append(r))).await;
    for (i, result) in results.iter().enumerate() {
        if i == 5 {
            let error = result.as_ref().expect_err("the refused request fails");
            assert!(error.to_string().contains("the fold refuses this event"), "{error}");
        } else {
            assert!(result.is_ok(), "request {i} of the batch commits: {:?}", result.as_ref().err());
        }
    }
    let mut events = 0;
    for tenant in &tenants {
        events += store.read_chain_rows(*tenant, 1, 100).await.unwrap().len();
    }
    assert_eq!(events, 11, "every request but the refused one is in the log");
    assert!(store.row_get(&tenants[1].to_string(), "test", "s/5").await.unwrap().is_none());
    assert!(store.row_get(&tenants[2].to_string(), "test", "s/6").await.unwrap().is_some());
}
