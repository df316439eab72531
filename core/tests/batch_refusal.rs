//! Issue 15, finding 4 (second half): a request whose projection fold fails inside the commit
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
async fn finding_4_a_request_whose_fold_fails_is_refused_alone_and_its_batch_commits() {
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

/// A chain of appends handed to the log at once lands in order or not at all: after one that
/// does not land (a guard refused here, a fold failed inside the commit there), every later one
/// that waits on the chain is refused unread, while one that does not wait is decided on its
/// own; a chain whose appends all land commits them together.
#[tokio::test]
async fn a_chain_stops_at_its_first_append_that_does_not_land() {
    use bc_core::store::{Chain, InChain};
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap());
    store.migrate().await.unwrap();
    let log =
        Log::open(store.clone(), Arc::new(RefusingProjector), Arc::new(LogKey::generate()), Arc::new(SystemClock)).await.unwrap();
    let tenant = TenantId::generate();
    let linked = |mut r: AppendRequest, chain: &Chain, waits: bool| {
        r.chain = Some(InChain { chain: chain.clone(), waits });
        r
    };
    // All land, in one commit.
    let chain = Chain::new();
    let all = futures::future::join_all(
        (0..4).map(|i| log.append(linked(request(tenant, &format!("a/{i}"), "test.made"), &chain, true))),
    )
    .await;
    let commits: Vec<u64> = all.into_iter().map(|r| r.expect("lands").events[0].position.commit).collect();
    assert!(commits.windows(2).all(|w| w[0] == w[1]), "one commit: {commits:?}");

    for refusal in ["guard", "fold"] {
        let chain = Chain::new();
        let mut first = request(tenant, &format!("b/{refusal}/0"), if refusal == "fold" { REFUSED } else { "test.made" });
        if refusal == "guard" {
            first.expected = ExpectedVersion::Exact(7);
        }
        let requests = vec![
            linked(first, &chain, true),
            linked(request(tenant, &format!("b/{refusal}/1"), "test.made"), &chain, true),
            linked(request(tenant, &format!("b/{refusal}/2"), "test.made"), &chain, false),
            linked(request(tenant, &format!("b/{refusal}/3"), "test.made"), &chain, true),
            request(tenant, &format!("b/{refusal}/alone"), "test.made"),
        ];
        let results = futures::future::join_all(requests.into_iter().map(|r| log.append(r))).await;
        let landed: Vec<bool> = results.iter().map(Result::is_ok).collect();
        assert_eq!(landed, [false, false, true, false, true], "{refusal}: {results:?}");
        assert_eq!(results[1].as_ref().unwrap_err().code(), bc_core::ErrorCode::Conflict, "{refusal}");
        // A later append of a broken chain is refused too, in another batch.
        let late = log.append(linked(request(tenant, &format!("b/{refusal}/late"), "test.made"), &chain, true)).await;
        assert_eq!(late.unwrap_err().code(), bc_core::ErrorCode::Conflict, "{refusal}");
    }
}
