//! Ids and time are inputs, through the gateway: a scripted sequence of tenant, pool, node and
//! reservation calls, run twice on fresh databases with the same seed and the same manual
//! clock, leaves the same tenant chain byte for byte (canonical encodings and hashes). A third
//! run on another seed differs, so the equality is not an accident.
//!
//! The root tenant's chain is left out: its first API key's secret is real randomness (a token
//! is a secret, never drawn from a seed), and the key's hash is in that chain.

use crate::common;

use std::sync::Arc;

use bc_core::clock::{Clock, ManualClock};
use bc_core::id::TenantId;
use bc_core::id_source::SeededIds;
use bc_core::keys::LogKey;
use bc_core::store::sqlite::SqliteStore;
use bc_core::store::{EventStore, Log, decode_rows};
use serde_json::{Value, json};

const START_MS: u64 = 1_800_000_000_000;

struct Run {
    /// (canonical bytes, hash) of every event of the scripted tenant's chain.
    chain: Vec<(Vec<u8>, [u8; 32])>,
    tenant: TenantId,
}

async fn call(router: &axum::Router, token: &str, method: &str, body: Value) -> Value {
    let (status, value) = common::call(router, token, method, body).await;
    assert!((200..300).contains(&status), "{method}: {status} {value}");
    value
}

async fn run(seed: u64) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(SqliteStore::open(&dir.path().join("log.sqlite3")).await.unwrap());
    let clock = Arc::new(ManualClock::new(START_MS));
    store.migrate_at(clock.now_ms()).await.unwrap();
    let store: Arc<dyn EventStore> = store;
    let key = Arc::new(LogKey::from_seed([7; 32]));
    let ids = Arc::new(SeededIds::new(seed, clock.clone()));
    let log = Arc::new(
        Log::open_with_ids(store.clone(), Arc::new(bc_projections::Projections), key, clock.clone(), ids).await.unwrap(),
    );
    let (router, token) = common::gateway_over(&log).await;

    let tenant = call(&router, &token, "tenants.create", json!({ "name": "acme" })).await;
    let tenant_id = tenant["tenantId"].as_str().unwrap().to_owned();
    clock.advance_ms(1000);
    let pool = call(&router, &token, "pools.create", json!({ "tenantId": tenant_id, "name": "gpu-a" })).await;
    let pool_id = pool["poolId"].as_str().unwrap();
    for (n, name) in ["n1", "n2"].iter().enumerate() {
        clock.advance_ms(250);
        let gpus: Vec<Value> = (0..4)
            .map(|i| json!({ "model": "H100", "product": "H100-SXM5-80GB", "vramGiB": 80, "nvlinkDomain": i / 2 }))
            .collect();
        let body =
            json!({ "tenantId": tenant_id, "poolId": pool_id, "name": name, "gpus": gpus, "labels": { "rack": n.to_string() } });
        call(&router, &token, "nodes.register", body).await;
    }
    clock.advance_ms(1000);
    let ask = json!({ "tenantId": tenant_id, "poolId": pool_id, "gpus": 2, "durationS": 3600, "nvlink": true });
    let first = call(&router, &token, "reservations.create", ask.clone()).await;
    assert_eq!(first["state"], "active", "{first}");
    clock.advance_ms(500);
    let second = call(
        &router,
        &token,
        "reservations.create",
        json!({ "tenantId": tenant_id, "poolId": pool_id, "gpus": 4, "durationS": 60 }),
    )
    .await;
    clock.advance_ms(500);
    let first_id = first["reservationId"].as_str().unwrap();
    call(&router, &token, "reservations.extend", json!({ "tenantId": tenant_id, "reservationId": first_id, "byS": 600 })).await;
    clock.advance_ms(500);
    call(&router, &token, "reservations.release", json!({ "tenantId": tenant_id, "reservationId": second["reservationId"] }))
        .await;
    call(&router, &token, "nodes.cordon", json!({ "tenantId": tenant_id, "nodeId": first["nodeId"] })).await;

    let tenant: TenantId = tenant_id.parse().unwrap();
    let events = decode_rows(store.read_chain_rows(tenant, 1, 1000).await.unwrap()).unwrap();
    assert!(events.len() >= 9, "the script appended {} events", events.len());
    Run { chain: events.into_iter().map(|e| (e.canonical, e.hash)).collect(), tenant }
}

#[tokio::test]
async fn the_same_seed_and_clock_give_the_same_events_byte_for_byte() {
    let (a, b, other) = (run(42).await, run(42).await, run(43).await);
    assert_eq!(a.tenant, b.tenant, "the tenant's id comes from the seed");
    assert_eq!(a.chain.len(), b.chain.len());
    for (i, (x, y)) in a.chain.iter().zip(&b.chain).enumerate() {
        assert_eq!(x.0, y.0, "event {} of the chain: canonical bytes differ", i + 1);
        assert_eq!(x.1, y.1, "event {} of the chain: hashes differ", i + 1);
    }
    assert_ne!(a.tenant, other.tenant, "another seed gives other ids");
    assert_ne!(a.chain[0].1, other.chain[0].1);
}
