//! `make bench` (fleet_config): `fleet plan` and `fleet apply` of a document of `BC_BENCH_CHANGES`
//! changes (default 800, `FLEET_CHANGES_MAX`, the most one apply makes: its one transaction is
//! bounded by the log's 1,000 events) against creating the same objects call by call, in the same
//! run, on the same server. A release `better-compute dev` (SQLite) runs as a child; the fleet is
//! applied in one tenant and the same objects are made by `pools.create`, `quotas.set`,
//! `flavors.create` and `images.register`, one request at a time as a script would, in another.
//! Reported: plan, apply and call-by-call times, the ratio call-by-call ÷ (plan + apply), and how
//! many transactions (commit numbers) the apply's events landed in (1 is the claim).

use std::time::Instant;

use serde_json::{Value, json};

use crate::support::dev;

const CHANGES_DEFAULT: usize = 800;
const DIGEST: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// POSTs `method` as `token`; the answer, which must be a 200.
async fn call(http: &reqwest::Client, url: &str, token: &str, method: &str, body: Value) -> Value {
    let response = http.post(format!("{url}/api/compute/{method}")).bearer_auth(token).json(&body).send().await.unwrap();
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    assert!(status.is_success(), "{method}: {status} {body}");
    body
}

/// A document of `changes` changes: a quarter pools (each with the tenant's quota: two changes),
/// then flavors in them, then images.
fn document(changes: usize) -> Value {
    let pools = changes / 4;
    let images = changes / 8;
    let flavors = changes - 2 * pools - images;
    let mut doc = json!({ "apiVersion": "better-compute/v1", "kind": "FleetConfig", "pools": {}, "flavors": {}, "images": {} });
    for p in 0..pools {
        doc["pools"][format!("pool-{p:04}")] =
            json!({ "name": format!("pool-{p:04}"), "labels": { "rack": format!("r{}", p % 16) }, "quotaGpus": 8 });
    }
    for f in 0..flavors {
        doc["flavors"][format!("flavor-{f:04}")] = json!({
            "pool": format!("pool-{:04}", f % pools.max(1)), "name": format!("f{f:04}"),
            "vcpus": 8, "memoryMiB": 65536, "diskGiB": 200, "gpus": 1,
        });
    }
    for i in 0..images {
        doc["images"][format!("image-{i:04}")] = json!({
            "name": format!("image-{i:04}"), "url": format!("https://images.example/{i}.qcow2"), "sha256": DIGEST, "diskFormat": "qcow2",
        });
    }
    doc
}

pub fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let changes: usize = std::env::var("BC_BENCH_CHANGES").ok().and_then(|v| v.parse().ok()).unwrap_or(CHANGES_DEFAULT);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let dev = dev::Dev::start(&[]);
        let http = reqwest::Client::new();
        let (url, token) = (dev.url.as_str(), dev.token.as_str());
        let doc = document(changes);
        let fleet_tenant = call(&http, url, token, "tenants.create", json!({ "name": "fleet" })).await["tenantId"].clone();
        let calls_tenant = call(&http, url, token, "tenants.create", json!({ "name": "calls" })).await["tenantId"].clone();

        // The fleet: plan, then apply by the plan's hash.
        let started = Instant::now();
        let plan = call(&http, url, token, "fleet.plan", json!({ "tenantId": fleet_tenant, "document": doc })).await;
        let plan_s = started.elapsed().as_secs_f64();
        assert_eq!(plan["changes"].as_array().unwrap().len(), changes, "the plan has every change");
        let hash = plan["planHash"].clone();
        let started = Instant::now();
        let applied =
            call(&http, url, token, "fleet.apply", json!({ "tenantId": fleet_tenant, "document": doc, "planHash": hash })).await;
        let apply_s = started.elapsed().as_secs_f64();
        assert_eq!(applied["applied"], true, "{applied}");

        // The apply's transactions: the commit numbers of its events.
        let mut commits = std::collections::BTreeSet::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut body = json!({ "tenantId": fleet_tenant, "limit": 500 });
            if let Some(c) = &cursor {
                body["cursor"] = json!(c);
            }
            let page = call(&http, url, token, "events.list", body).await;
            for e in page["items"].as_array().unwrap() {
                let t = e["type"].as_str().unwrap_or("");
                if !t.starts_with("checkpoint.") && !t.starts_with("tenant.") && !t.starts_with("api_key.") {
                    commits.insert(e["position"].as_str().unwrap().split(['.', ':']).next().unwrap().to_owned());
                }
            }
            match page["nextCursor"].as_str() {
                Some(c) => cursor = Some(c.to_owned()),
                None => break,
            }
        }

        // The same objects, call by call, in the other tenant.
        let started = Instant::now();
        let mut pool_ids = std::collections::BTreeMap::new();
        for (key, p) in doc["pools"].as_object().unwrap() {
            let made = call(
                &http,
                url,
                token,
                "pools.create",
                json!({ "tenantId": calls_tenant, "name": p["name"], "labels": p["labels"] }),
            )
            .await;
            let id = made["poolId"].clone();
            call(&http, url, token, "quotas.set", json!({ "tenantId": calls_tenant, "poolId": id, "gpus": 8 })).await;
            pool_ids.insert(key.clone(), id);
        }
        for f in doc["flavors"].as_object().unwrap().values() {
            let mut body = f.clone();
            body["poolId"] = pool_ids[f["pool"].as_str().unwrap()].clone();
            body.as_object_mut().unwrap().remove("pool");
            body["tenantId"] = calls_tenant.clone();
            call(&http, url, token, "flavors.create", body).await;
        }
        for i in doc["images"].as_object().unwrap().values() {
            let mut body = i.clone();
            body["tenantId"] = calls_tenant.clone();
            call(&http, url, token, "images.register", body).await;
        }
        let calls_s = started.elapsed().as_secs_f64();

        let fleet_s = plan_s + apply_s;
        println!(
            "fleet_config: {changes} changes ({} pools with quotas, {} flavors, {} images)",
            pool_ids.len(),
            doc["flavors"].as_object().unwrap().len(),
            doc["images"].as_object().unwrap().len()
        );
        println!("  fleet plan            {:8.3} s", plan_s);
        println!("  fleet apply           {:8.3} s  ({} transaction(s))", apply_s, commits.len());
        println!("  call by call          {:8.3} s  ({changes} requests, one at a time)", calls_s);
        println!("  ratio call-by-call / (plan + apply): {:.2}", calls_s / fleet_s);
    });
}
